package main

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"
	"time"

	"libserve"
	"libserve/internal/openmetrics"
)

// scrape GETs /metrics, checks the status and content type, and parses the text strictly.
func scrape(t *testing.T, srv *httptest.Server) *openmetrics.Exposition {
	t.Helper()
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != http.StatusOK || ct != libserve.MetricsContentType {
		t.Fatalf("GET /metrics: %d, Content-Type %q, want 200 %q: %s", resp.StatusCode, ct, libserve.MetricsContentType, b)
	}
	e, err := openmetrics.Parse(string(b))
	if err != nil {
		t.Fatalf("GET /metrics: %v\n%s", err, b)
	}
	return e
}

// metric is e's sample name{labels}, or -1 when it is absent.
func metric(e *openmetrics.Exposition, name string, labels ...string) float64 {
	if v, ok := e.Get(name, labels...); ok {
		return v
	}
	return -1
}

// GET /metrics serves libserve's series and the server's own, one valid OpenMetrics text: the
// requests served, refused by libserve and shed by admission control are all counted.
func TestMetricsRoute(t *testing.T) {
	f := loadFixture(t)
	// One request admitted at a time: a request whose body is still being read holds the place.
	srv, rt := startConfig(t, fixtureDir, nil, config{Timeout: 10 * time.Second, MaxPending: 1, AdmitFloor: 1})
	model := filepath.Base(fixtureDir)
	for k, in := range f.Inputs {
		if r, err := post(context.Background(), srv, "", inputJSON(in)); err != nil || r.status != http.StatusOK {
			t.Fatalf("request %d: %+v, %v", k, r, err)
		}
	}
	if r, err := post(context.Background(), srv, "", `{"input":[1,2,3]}`); err != nil || r.status != http.StatusBadRequest {
		t.Fatalf("short input: %+v, %v; want 400", r, err)
	}
	body, write := io.Pipe()
	defer write.Close()
	held := make(chan reply, 1)
	go func() {
		r, err := postBody(srv, body)
		if err != nil {
			r.message = err.Error()
		}
		held <- r
	}()
	waitFor(t, "the request with an unfinished body to be admitted", func() bool {
		return metric(scrape(t, srv), "serve_http_requests_pending", "model", model) == 1
	})
	if r, err := post(context.Background(), srv, "", inputJSON(f.Inputs[0])); err != nil || r.status != http.StatusServiceUnavailable || r.code != "BUSY" {
		t.Fatalf("request while full: %+v, %v; want 503 BUSY", r, err)
	}
	io.WriteString(write, inputJSON(f.Inputs[0]))
	write.Close()
	if r := <-held; r.status != http.StatusOK {
		t.Fatalf("the held request: %+v, want 200", r)
	}

	e := scrape(t, srv)
	ok := float64(len(f.Inputs) + 1)
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"serve_requests_completed_total", []string{"model", model, "code", "OK"}, ok},
		{"serve_requests_rejected_total", []string{"model", model, "code", "INVALID_ARGUMENT"}, 1},
		{"serve_request_latency_seconds_count", []string{"model", model}, ok},
		{"serve_in_flight", []string{"model", model}, 0},
		{"serve_http_requests_admitted_total", []string{"model", model}, ok + 1},
		{"serve_http_requests_shed_total", []string{"model", model}, 1},
		{"serve_http_requests_pending", []string{"model", model}, 0},
	} {
		if got := metric(e, c.name, c.labels...); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	// The shed request never reached libserve.
	if busy := metric(e, "serve_requests_rejected_total", "model", model, "code", "BUSY"); busy > 0 {
		t.Errorf("libserve refused %v requests BUSY", busy)
	}
	if rate := metric(e, "serve_http_departure_rate", "model", model); rate < 0 {
		t.Errorf("serve_http_departure_rate = %v", rate)
	}
	for name, typ := range map[string]string{"serve_requests_completed": "counter", "serve_http_requests_shed": "counter",
		"serve_http_requests_pending": "gauge"} {
		if e.Types[name] != typ {
			t.Errorf("%s is a %q, want %s", name, e.Types[name], typ)
		}
	}

	// A runtime shut down has no metrics: 503 SHUTDOWN, in the JSON error format.
	if err := rt.Shutdown(0); err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Content-Type") != "application/json" {
		t.Errorf("GET /metrics after shutdown: %d %q, want 503 JSON", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
}

// Without libserve's metrics the server still serves its own, and escapes the model's name.
func TestMetricsOfTheServerAlone(t *testing.T) {
	const name = "a \"quoted\\\" name\n"
	srv := httptest.NewServer(newHandler(&slowModel{}, config{Timeout: time.Second, ModelName: name}))
	defer srv.Close()
	e := scrape(t, srv)
	if got := metric(e, "serve_http_requests_shed_total", "model", name); got != 0 || len(e.Samples) != 4 {
		t.Errorf("serve_http_requests_shed_total = %v; samples %v", got, e.Samples)
	}
}
