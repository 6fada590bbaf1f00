package main

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"libserve"
)

// slowModel is a stub mlp with a known capacity: one worker serves its FIFO queue one request
// at a time, each taking service (or, with gate set, until gate is closed).
type slowModel struct {
	service time.Duration
	gate    chan struct{}
	jobs    chan slowJob
	started chan struct{} // one value per job the worker takes
}

type slowJob struct {
	ctx  context.Context
	done chan error
}

func newSlowModel(t *testing.T, service time.Duration, gate chan struct{}) *slowModel {
	m := &slowModel{service: service, gate: gate, jobs: make(chan slowJob, 4096), started: make(chan struct{}, 4096)}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	go func() {
		for {
			select {
			case <-stop:
				return
			case j := <-m.jobs:
				m.started <- struct{}{}
				if j.ctx.Err() == nil {
					if m.gate != nil {
						<-m.gate
					} else {
						time.Sleep(m.service)
					}
				}
				j.done <- j.ctx.Err()
			}
		}
	}()
	return m
}

func (m *slowModel) Kind() string   { return "mlp" }
func (m *slowModel) InputLen() int  { return 1 }
func (m *slowModel) OutputLen() int { return 1 }

func (m *slowModel) Submit(ctx context.Context, in []float32, _ ...libserve.SubmitOption) ([]float32, error) {
	j := slowJob{ctx: ctx, done: make(chan error, 1)}
	select {
	case m.jobs <- j:
	default:
		return nil, &libserve.Error{Code: libserve.CodeBusy, Message: "stub queue full"}
	}
	if err := <-j.done; err != nil {
		return nil, &libserve.Error{Code: libserve.CodeDeadlineExceeded, Message: err.Error()}
	}
	return in, nil
}

func (m *slowModel) SubmitTokens(context.Context, []uint32, ...libserve.SubmitOption) (libserve.Output, error) {
	return libserve.Output{}, &libserve.Error{Code: libserve.CodeInvalidArgument, Message: "stub takes input"}
}

func (m *slowModel) SubmitTree(context.Context, []uint32, []int32, ...libserve.SubmitOption) ([]float32, error) {
	return nil, &libserve.Error{Code: libserve.CodeInvalidArgument, Message: "stub takes input"}
}

// TestOverloadShedsAtOnce drives a model of capacity 50/s open-loop at 100/s: the server must
// answer part of the requests 503 and let none reach its deadline (504), and no shed request
// may have reached the model (a 503 does not wait in its queue). Checked by counting, not by
// the clock (latencies are only logged); that admitted requests keep the QoS target is shown on
// virtual time by TestAdmissionKeepsAdmittedWithinTarget, and that a 503 comes before the body
// is read by TestShedBeforeReadingTheBody.
func TestOverloadShedsAtOnce(t *testing.T) {
	const (
		service = 20 * time.Millisecond // capacity 50/s
		qos     = time.Second
		rate    = 100 // requests per second: twice the capacity
		total   = 300 // 3 s
	)
	m := newSlowModel(t, service, nil)
	srv := httptest.NewServer(newHandler(m, config{Timeout: 4 * time.Second, QoS: qos}))
	defer srv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: total}}
	defer client.CloseIdleConnections()

	type outcome struct {
		status  int
		latency time.Duration
		err     error
	}
	outcomes := make([]outcome, total)
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / rate)
	defer tick.Stop()
	for i := range total {
		<-tick.C
		wg.Add(1)
		go func() {
			defer wg.Done()
			begin := time.Now()
			resp, err := client.Post(srv.URL+"/v1/infer", "application/json", strings.NewReader(`{"input":[1]}`))
			if err != nil {
				outcomes[i] = outcome{err: err}
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
				t.Error("a 503 without Retry-After")
			}
			outcomes[i] = outcome{status: resp.StatusCode, latency: time.Since(begin)}
		}()
	}
	wg.Wait()

	var ok, shed []time.Duration
	for i, o := range outcomes {
		switch {
		case o.err != nil:
			t.Errorf("request %d: %v", i, o.err)
		case o.status == http.StatusOK:
			ok = append(ok, o.latency)
		case o.status == http.StatusServiceUnavailable:
			shed = append(shed, o.latency)
		default:
			t.Errorf("request %d: status %d, want 200 or 503", i, o.status)
		}
	}
	slices.Sort(ok)
	slices.Sort(shed)
	t.Logf("%d admitted (p50 %v, p99 %v), %d shed (p50 %v, max %v)", len(ok), pct(ok, 50), pct(ok, 99),
		len(shed), pct(shed, 50), pct(shed, 100))
	// About half are admitted; the margins are wide so a loaded machine does not flake.
	if len(ok) < total/4 || len(shed) < total/10 {
		t.Errorf("%d admitted and %d shed of %d at twice the capacity: want both well above zero", len(ok), len(shed), total)
	}
	// Every job the model took was answered 200: nothing shed went through its queue.
	if took := len(m.started); took != len(ok) {
		t.Errorf("the model took %d jobs for %d answers of 200: shed requests reached it", took, len(ok))
	}
}

// pct is the p-th percentile of sorted latencies (0 for none).
func pct(sorted []time.Duration, p int) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[(len(sorted)-1)*p/100]
}

// TestShedBeforeReadingTheBody: with the server full, a request is refused with 503 while its
// body has not even been sent.
func TestShedBeforeReadingTheBody(t *testing.T) {
	gate := make(chan struct{})
	m := newSlowModel(t, 0, gate)
	srv := httptest.NewServer(newHandler(m, config{Timeout: 10 * time.Second, MaxPending: 1, AdmitFloor: 1}))
	defer srv.Close()
	first := make(chan int, 1)
	go func() {
		resp, err := srv.Client().Post(srv.URL+"/v1/infer", "application/json", strings.NewReader(`{"input":[1]}`))
		if err != nil {
			first <- 0
			return
		}
		resp.Body.Close()
		first <- resp.StatusCode
	}()
	<-m.started // the first request holds the only place
	body, write := io.Pipe()
	defer write.Close()
	// A guard: without shedding the answer would never come; then the body ends, unfinished.
	guard := time.AfterFunc(10*time.Second, func() { write.Close() })
	defer guard.Stop()
	r, err := postBody(srv, body) // a body that never comes
	if err != nil || r.status != http.StatusServiceUnavailable || r.code != "BUSY" || r.retryAfter == "" {
		t.Errorf("request with an unfinished body: %+v, %v; want 503 BUSY at once", r, err)
	}
	close(gate)
	if s := <-first; s != http.StatusOK {
		t.Errorf("the admitted request: %d, want 200", s)
	}
}

// postBody posts the body read from body to /v1/infer and decodes the answer.
func postBody(srv *httptest.Server, body io.Reader) (reply, error) {
	resp, err := srv.Client().Post(srv.URL+"/v1/infer", "application/json", body)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	var b errorResponse
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil {
		return reply{}, err
	}
	return reply{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), code: b.Error.Code, message: b.Error.Message}, nil
}

// nanModel answers NaN, which JSON cannot carry.
type nanModel struct{ slowModel }

func (nanModel) Submit(context.Context, []float32, ...libserve.SubmitOption) ([]float32, error) {
	return []float32{float32(math.NaN())}, nil
}

// An output that cannot be encoded is a 500 with a JSON error, never a 200 with a broken body.
func TestUnencodableOutputIs500(t *testing.T) {
	srv := httptest.NewServer(newHandler(&nanModel{}, config{Timeout: 10 * time.Second}))
	defer srv.Close()
	r, err := post(context.Background(), srv, "", `{"input":[1]}`)
	if err != nil || r.status != http.StatusInternalServerError || r.code != "INTERNAL" || !strings.Contains(r.message, "NaN") {
		t.Errorf("NaN output: got %+v, %v; want 500 INTERNAL naming NaN", r, err)
	}
}
