package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"libserve"
)

var fixtureDir = filepath.Join("..", "..", "..", "testdata", "mlp_4_8_3")

type fixture struct {
	Inputs  [][]float32 `json:"inputs"`
	Outputs [][]float32 `json:"outputs"`
}

func loadFixture(t *testing.T) fixture {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(fixtureDir, "expected.json"))
	if err != nil {
		t.Fatal(err)
	}
	var f fixture
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	return f
}

func closeEnough(got, want []float32) bool {
	if len(got) != len(want) {
		return false
	}
	for i := range want {
		g, w := float64(got[i]), float64(want[i])
		if math.IsNaN(g) || math.Abs(g-w) > 1e-4*math.Abs(w)+1e-7 {
			return false
		}
	}
	return true
}

// start serves the fixture with opts on a loopback httptest server; everything is closed when
// the test ends.
func start(t *testing.T, opts *libserve.ModelOptions) (*httptest.Server, *libserve.Runtime) {
	t.Helper()
	return startDir(t, fixtureDir, opts)
}

// startDir serves the model directory dir with opts, as start.
func startDir(t *testing.T, dir string, opts *libserve.ModelOptions) (*httptest.Server, *libserve.Runtime) {
	t.Helper()
	return startConfig(t, dir, opts, config{Timeout: 10 * time.Second})
}

// startConfig serves the model directory dir with opts and the server configuration cfg, whose
// metrics are the runtime's and whose model name is the directory's (libserve's default).
func startConfig(t *testing.T, dir string, opts *libserve.ModelOptions, cfg config) (*httptest.Server, *libserve.Runtime) {
	t.Helper()
	rt, err := libserve.NewRuntime(&libserve.RuntimeOptions{Backend: "cpu", CPUThreads: 1})
	if err != nil {
		t.Fatal(err)
	}
	m, err := rt.LoadModel(dir, opts)
	if err != nil {
		rt.Close()
		t.Fatal(err)
	}
	cfg.Metrics, cfg.ModelName = rt.Metrics, filepath.Base(dir)
	srv := httptest.NewServer(newHandler(m, cfg)) // listens on 127.0.0.1
	t.Cleanup(func() {
		srv.Close()
		m.Close()
		rt.Close()
	})
	return srv, rt
}

// reply is a decoded response.
type reply struct {
	status     int
	retryAfter string
	output     []float32
	tokens     []uint32
	code       string
	message    string
}

// post sends body to /v1/infer (plus query) and decodes the answer.
func post(ctx context.Context, srv *httptest.Server, query, body string) (reply, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/v1/infer"+query, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := srv.Client().Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	var b struct {
		Output []float32   `json:"output"`
		Tokens []uint32    `json:"tokens"`
		Error  errorDetail `json:"error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil {
		return reply{}, fmt.Errorf("status %d, undecodable body: %v", resp.StatusCode, err)
	}
	return reply{status: resp.StatusCode, retryAfter: resp.Header.Get("Retry-After"), output: b.Output, tokens: b.Tokens,
		code: b.Error.Code, message: b.Error.Message}, nil
}

func inputJSON(in []float32) string {
	b, _ := json.Marshal(inferRequest{Input: in})
	return string(b)
}

func stats(t *testing.T, rt *libserve.Runtime) libserve.Stats {
	t.Helper()
	s, err := rt.Stats()
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestConcurrentClientsOverLoopback(t *testing.T) {
	f := loadFixture(t)
	srv, rt := start(t, &libserve.ModelOptions{MaxBatch: 8, MaxWait: 200 * time.Microsecond})
	const clients, perClient = 8, 25
	var wg sync.WaitGroup
	errs := make(chan error, clients*perClient)
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range perClient {
				k := (c + i) % len(f.Inputs)
				r, err := post(context.Background(), srv, "", inputJSON(f.Inputs[k]))
				switch {
				case err != nil:
					errs <- err
				case r.status != http.StatusOK:
					errs <- fmt.Errorf("status %d: %s %s", r.status, r.code, r.message)
				case !closeEnough(r.output, f.Outputs[k]):
					errs <- fmt.Errorf("input %d: got %v, want %v", k, r.output, f.Outputs[k])
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	const n = clients * perClient
	if s := stats(t, rt); s.Submitted != n || s.Completed[libserve.CodeOK] != n || s.InFlight != 0 {
		t.Errorf("stats %+v, want %d requests completed OK", s, n)
	}

	resp, err := srv.Client().Get(srv.URL + "/v1/model")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var info modelInfo
	if err := json.NewDecoder(resp.Body).Decode(&info); err != nil || info != (modelInfo{"mlp", 4, 3}) {
		t.Errorf("GET /v1/model: %+v, %v", info, err)
	}
}

func TestBadRequests(t *testing.T) {
	srv, rt := start(t, nil)
	for _, tc := range []struct {
		name, query, body string
		status            int
	}{
		{"wrong length", "", `{"input":[1,2,3]}`, http.StatusBadRequest},
		{"empty input", "", `{"input":[]}`, http.StatusBadRequest},
		{"missing input", "", `{}`, http.StatusBadRequest},
		{"not JSON", "", `input=1`, http.StatusBadRequest},
		{"unknown field", "", `{"input":[1,2,3,4],"inputs":[1]}`, http.StatusBadRequest},
		{"input and tokens", "", `{"input":[1,2,3,4],"tokens":[1]}`, http.StatusBadRequest},
		{"parents without tokens", "", `{"parents":[-1]}`, http.StatusBadRequest},
		{"negative token", "", `{"tokens":[-1]}`, http.StatusBadRequest},
		{"tokens to an mlp", "", `{"tokens":[1]}`, http.StatusBadRequest},
		{"tree to an mlp", "", `{"tokens":[1],"parents":[-1]}`, http.StatusBadRequest},
		{"out of f32 range", "", `{"input":[1e39,0,0,0]}`, http.StatusBadRequest},
		{"trailing data", "", `{"input":[1,2,3,4]} {}`, http.StatusBadRequest},
		{"bad timeout", "?timeout_ms=soon", `{"input":[1,2,3,4]}`, http.StatusBadRequest},
		{"too large", "", `{"input":[` + strings.Repeat("0,", maxBodyBytes/2) + `0]}`, http.StatusRequestEntityTooLarge},
	} {
		r, err := post(context.Background(), srv, tc.query, tc.body)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if r.status != tc.status || r.code != "INVALID_ARGUMENT" || r.message == "" {
			t.Errorf("%s: got %d %s %q, want %d INVALID_ARGUMENT", tc.name, r.status, r.code, r.message, tc.status)
		}
	}
	// Only the requests that reached libserve (wrong length, empty, tokens or a tree to an mlp)
	// were refused there; the server still serves.
	if s := stats(t, rt); s.Rejected != 4 || s.Submitted != 0 {
		t.Errorf("stats %+v, want 4 rejected", s)
	}
	if r, err := post(context.Background(), srv, "", `{"input":[0,0.5,1,1.5]}`); err != nil || r.status != http.StatusOK {
		t.Errorf("good request after bad ones: %+v, %v", r, err)
	}
}

func TestDeadlineAndBusyStatuses(t *testing.T) {
	f := loadFixture(t)
	// A lone request waits up to 10 s for a batch, and only one may be in flight.
	srv, rt := start(t, &libserve.ModelOptions{MaxBatch: 32, MaxWait: 10 * time.Second, AdmissionBound: 1})
	body := inputJSON(f.Inputs[0])

	r, err := post(context.Background(), srv, "?timeout_ms=50", body)
	if err != nil || r.status != http.StatusGatewayTimeout || r.code != "DEADLINE_EXCEEDED" {
		t.Errorf("short deadline: got %+v, %v; want 504 DEADLINE_EXCEEDED", r, err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := make(chan error, 1)
	go func() {
		_, err := post(ctx, srv, "", body)
		first <- err
	}()
	waitFor(t, "the first request to be admitted", func() bool { return stats(t, rt).InFlight == 1 })
	r, err = post(context.Background(), srv, "", body)
	if err != nil || r.status != http.StatusServiceUnavailable || r.code != "BUSY" || r.retryAfter == "" {
		t.Errorf("second request: got %+v, %v; want 503 BUSY with Retry-After", r, err)
	}
	// The client giving up cancels its request in libserve.
	cancel()
	if err := <-first; err == nil {
		t.Error("the cancelled client got a response")
	}
	waitFor(t, "the abandoned request to be cancelled", func() bool {
		s := stats(t, rt)
		return s.InFlight == 0 && s.Completed[libserve.CodeCancelled] == 1
	})
}

func TestShutdownStatuses(t *testing.T) {
	f := loadFixture(t)
	srv, rt := start(t, &libserve.ModelOptions{MaxBatch: 32, MaxWait: 10 * time.Second})
	body := inputJSON(f.Inputs[0])
	pending := make(chan reply, 1)
	go func() {
		r, err := post(context.Background(), srv, "", body)
		if err != nil {
			r = reply{message: err.Error()}
		}
		pending <- r
	}()
	waitFor(t, "the request to be queued", func() bool { return stats(t, rt).InFlight == 1 })
	if err := rt.Shutdown(0); err != nil {
		t.Fatal(err)
	}
	if r := <-pending; r.status != http.StatusServiceUnavailable || r.code != "CANCELLED" {
		t.Errorf("request pending at shutdown: got %+v, want 503 CANCELLED", r)
	}
	if r, err := post(context.Background(), srv, "", body); err != nil || r.status != http.StatusServiceUnavailable || r.code != "SHUTDOWN" {
		t.Errorf("request after shutdown: got %+v, %v; want 503 SHUTDOWN", r, err)
	}
}

func TestStatusMapping(t *testing.T) {
	want := map[libserve.Code]int{
		libserve.CodeOK:               200,
		libserve.CodeInvalidArgument:  400,
		libserve.CodeNotFound:         404,
		libserve.CodeFormat:           500,
		libserve.CodeBusy:             503,
		libserve.CodeDeadlineExceeded: 504,
		libserve.CodeCancelled:        503,
		libserve.CodeShutdown:         503,
		libserve.CodeUnavailable:      503,
		libserve.CodeUnsupported:      501,
		libserve.CodeBackend:          500,
		libserve.CodeIO:               500,
		libserve.CodeInternal:         500,
	}
	for c := libserve.CodeOK; c <= libserve.CodeInternal; c++ {
		if got := httpStatus(c); got != want[c] {
			t.Errorf("httpStatus(%v) = %d, want %d", c, got, want[c])
		}
	}
}

func TestHealthz(t *testing.T) {
	srv, _ := start(t, nil)
	resp, err := srv.Client().Get(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	if resp.StatusCode != 200 || b.String() != "ok\n" {
		t.Errorf("GET /healthz: %d %q", resp.StatusCode, b.String())
	}
}
