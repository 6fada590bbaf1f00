package libserve

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// fixtureDir is the committed mlp fixture (4 inputs → 8 hidden → 3 outputs).
var fixtureDir = filepath.Join("..", "testdata", "mlp_4_8_3")

// fixture is expected.json: inputs and the outputs the model must produce for them.
type fixture struct {
	Inputs  [][]float32 `json:"inputs"`
	Outputs [][]float32 `json:"outputs"`
}

func loadFixture(t testing.TB) fixture {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(fixtureDir, "expected.json"))
	if err != nil {
		t.Fatal(err)
	}
	var f fixture
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatal(err)
	}
	if len(f.Inputs) == 0 || len(f.Inputs) != len(f.Outputs) {
		t.Fatalf("expected.json: %d inputs, %d outputs", len(f.Inputs), len(f.Outputs))
	}
	return f
}

// closeEnough reports whether got matches want within 1e-4 relative (plus a tiny absolute term
// for values near zero).
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

// newRuntime starts a CPU runtime with one compute thread (the test machine is small) and closes
// it when the test ends.
func newRuntime(t testing.TB, opts *RuntimeOptions) *Runtime {
	t.Helper()
	o := RuntimeOptions{Backend: "cpu", CPUThreads: 1}
	if opts != nil {
		o.AdmissionBound = opts.AdmissionBound
		o.SpinWait = opts.SpinWait
	}
	rt, err := NewRuntime(&o)
	if err != nil {
		t.Fatalf("NewRuntime: %v", err)
	}
	t.Cleanup(func() {
		if err := rt.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return rt
}

// loadModel loads the fixture into rt and closes it when the test ends.
func loadModel(t testing.TB, rt *Runtime, opts *ModelOptions) *Model {
	t.Helper()
	m, err := rt.LoadModel(fixtureDir, opts)
	if err != nil {
		t.Fatalf("LoadModel: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// waitFor polls cond until it holds or the test's patience (10 s) runs out.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

// stats is rt.Stats or a fatal error.
func stats(t testing.TB, rt *Runtime) Stats {
	t.Helper()
	s, err := rt.Stats()
	if err != nil {
		t.Fatalf("Stats: %v", err)
	}
	return s
}

// slowModel has every request wait up to 10 s for a fuller batch: a lone request stays queued,
// which makes cancel, deadline and busy behaviour deterministic.
var slowModel = &ModelOptions{MaxBatch: 32, MaxWait: 10 * time.Second}

// checkExactlyOnce asserts that every request libserve accepted was routed to its Submit exactly
// once and nothing is left pending.
func checkExactlyOnce(t testing.TB, rt *Runtime) {
	t.Helper()
	s := rt.s
	s.pendingMu.Lock()
	left := len(s.pending)
	s.pendingMu.Unlock()
	if left != 0 {
		t.Errorf("%d requests still pending", left)
	}
	if a, r := s.accepted.Load(), s.routed.Load(); a != r {
		t.Errorf("accepted %d requests but routed %d completions", a, r)
	}
	if u := s.unrouted.Load(); u != 0 {
		t.Errorf("%d completions had no waiting request (duplicate or unknown tag)", u)
	}
	if w := s.waiting.Load(); w != 0 {
		t.Errorf("%d Submits still counted as waiting", w)
	}
}
