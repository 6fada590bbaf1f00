package libserve

import (
	"context"
	"errors"
	"strings"
	"testing"

	"libserve/internal/openmetrics"
)

// metrics is rt.Metrics parsed strictly, or a fatal error.
func metrics(t *testing.T, rt *Runtime) *openmetrics.Exposition {
	t.Helper()
	text, err := rt.Metrics()
	if err != nil {
		t.Fatalf("Metrics: %v", err)
	}
	if !strings.HasSuffix(text, "\n# EOF\n") {
		t.Errorf("the text does not end with # EOF: ...%q", text[max(0, len(text)-40):])
	}
	e, err := openmetrics.Parse(text)
	if err != nil {
		t.Fatalf("%v\n%s", err, text)
	}
	return e
}

func TestMetricsCountRequestsByModelAndCode(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, &ModelOptions{Name: "metrics-mlp"})
	ctx := context.Background()
	for _, in := range f.Inputs {
		if out, err := m.Submit(ctx, in); err != nil {
			t.Fatalf("Submit: %v, %v", out, err)
		}
	}
	if _, err := m.Submit(ctx, []float32{1, 2, 3}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("short input: got %v, want INVALID_ARGUMENT", err)
	}

	e := metrics(t, rt)
	n := float64(len(f.Inputs))
	for _, c := range []struct {
		name   string
		labels []string
		want   float64
	}{
		{"serve_requests_completed_total", []string{"model", "metrics-mlp", "code", "OK"}, n},
		{"serve_requests_rejected_total", []string{"model", "metrics-mlp", "code", "INVALID_ARGUMENT"}, 1},
		{"serve_request_latency_seconds_count", []string{"model", "metrics-mlp"}, n},
		{"serve_in_flight", []string{"model", "metrics-mlp"}, 0},
	} {
		if got, ok := e.Get(c.name, c.labels...); !ok || got != c.want {
			t.Errorf("%s%v = %v (present %v), want %v", c.name, c.labels, got, ok, c.want)
		}
	}
	if e.Types["serve_requests_completed"] != "counter" || e.Types["serve_request_latency_seconds"] != "histogram" {
		t.Errorf("types: %v", e.Types)
	}
	// The same counts as Stats.
	if s := stats(t, rt); float64(s.Completed[CodeOK]) != n || s.Rejected != 1 {
		t.Errorf("stats %+v", s)
	}
	checkExactlyOnce(t, rt)
}

func TestMetricsAfterCloseFails(t *testing.T) {
	rt := newRuntime(t, nil)
	if _, err := rt.Metrics(); err != nil {
		t.Fatalf("Metrics on an open runtime: %v", err)
	}
	if err := rt.Close(); err != nil {
		t.Fatal(err)
	}
	_, err := rt.Metrics()
	_, statsErr := rt.Stats()
	if !errors.Is(err, ErrShutdown) || statsErr == nil || err.Error() != statsErr.Error() {
		t.Errorf("Metrics after Close: %v; want the error of Stats (%v)", err, statsErr)
	}
}
