package libserve

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// The committed recurrent fixtures (scripts/make_fixtures.py): small lstm, seq2seq and treelstm
// models with expected outputs computed by a float64 reference.
var recurrentFixtures = []struct {
	dir       string
	kind      string
	outputLen int // Model.OutputLen: the hidden size, 0 for token outputs
	vocab     uint32
	maxNodes  int // the largest request's state slots: 1 per sequence, 1 per tree node
}{
	{"lstm_small", "lstm", 16, 50, 1},
	{"seq2seq_small", "seq2seq", 0, 40, 1},
	{"treelstm_small", "treelstm", 16, 50, 39},
}

// recurrentRequest is one request of a recurrent fixture's expected.json.
type recurrentRequest struct {
	Tokens       []uint32  `json:"tokens"`
	Parents      []int32   `json:"parents"`       // treelstm only
	Output       []float64 `json:"output"`        // lstm, treelstm: the final h
	OutputTokens []uint32  `json:"output_tokens"` // seq2seq: the decoded tokens
}

func recurrentDir(name string) string { return filepath.Join("..", "testdata", name) }

// loadRecurrentFixture reads expected.json of the fixture directory name.
func loadRecurrentFixture(t testing.TB, name string) []recurrentRequest {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(recurrentDir(name), "expected.json"))
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Requests []recurrentRequest `json:"requests"`
	}
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatalf("%s/expected.json: %v", name, err)
	}
	if len(f.Requests) == 0 {
		t.Fatalf("%s/expected.json has no requests", name)
	}
	for i, r := range f.Requests {
		if len(r.Tokens) == 0 || (r.Output == nil) == (r.OutputTokens == nil) {
			t.Fatalf("%s/expected.json: request %d needs tokens and exactly one of output, output_tokens", name, i)
		}
	}
	return f.Requests
}

// loadDir loads the fixture directory name into rt with opts and closes it when the test ends.
func loadDir(t testing.TB, rt *Runtime, name string, opts *ModelOptions) *Model {
	t.Helper()
	m, err := rt.LoadModel(recurrentDir(name), opts)
	if err != nil {
		t.Fatalf("LoadModel(%s, %+v): %v", name, opts, err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// submitRequest sends r to m with the submit call its kind takes.
func submitRequest(ctx context.Context, m *Model, r recurrentRequest) (Output, error) {
	if m.Kind() == "treelstm" {
		y, err := m.SubmitTree(ctx, r.Tokens, r.Parents)
		return Output{F32: y}, err
	}
	return m.SubmitTokens(ctx, r.Tokens)
}

// outputMismatch describes how got differs from r's expected output ("" if it does not): f32
// values within 1e-4·max(1, |want|), tokens exactly, and only the field of the expected kind set.
func outputMismatch(got Output, r recurrentRequest) string {
	if r.OutputTokens != nil {
		if got.F32 != nil || got.Tokens == nil {
			return fmt.Sprintf("want a token output, got %+v", got)
		}
		if len(got.Tokens) != len(r.OutputTokens) {
			return fmt.Sprintf("tokens %v, want %v", got.Tokens, r.OutputTokens)
		}
		for i := range got.Tokens {
			if got.Tokens[i] != r.OutputTokens[i] {
				return fmt.Sprintf("tokens %v, want %v", got.Tokens, r.OutputTokens)
			}
		}
		return ""
	}
	if got.Tokens != nil || got.F32 == nil {
		return fmt.Sprintf("want an f32 output, got %+v", got)
	}
	if len(got.F32) != len(r.Output) {
		return fmt.Sprintf("%d values, want %d", len(got.F32), len(r.Output))
	}
	for i, w := range r.Output {
		g := float64(got.F32[i])
		if math.IsNaN(g) || math.Abs(g-w) > 1e-4*math.Max(1, math.Abs(w)) {
			return fmt.Sprintf("value %d is %v, want %v", i, g, w)
		}
	}
	return ""
}

// TestRecurrentFixtures serves each recurrent fixture under each policy (and variants with tight
// batches, tasks in flight and state slots), submitting every request of expected.json several
// times at once from concurrent goroutines and checking every output.
func TestRecurrentFixtures(t *testing.T) {
	const rounds = 3
	for _, fx := range recurrentFixtures {
		reqs := loadRecurrentFixture(t, fx.dir)
		policies := []struct {
			name string
			opts *ModelOptions
		}{
			{"auto", nil},
			{"cellular", &ModelOptions{Policy: PolicyCellular, Workers: 2}},
			{"padding", &ModelOptions{Policy: PolicyPadding}},
			// An lstm's first layer unfolded (no token-gate tables), and with a budget too small
			// for its table: the same outputs.
			{"unfolded", &ModelOptions{NoTokenGates: true}},
			{"tables-too-small", &ModelOptions{Policy: PolicyPadding, TokenGatesBytes: 64}},
			// Small batches, one task in flight per worker, and just enough state slots for the
			// largest request: requests queue for batch room and for slots.
			{"cellular-tight", &ModelOptions{Policy: PolicyCellular, Workers: 2, MaxBatch: 3,
				MaxTasksToSubmit: 1, StateSlots: fx.maxNodes}},
			{"padding-tight", &ModelOptions{Policy: PolicyPadding, Workers: 2, MaxBatch: 3,
				MaxTasksToSubmit: 2, StateSlots: fx.maxNodes + 1}},
		}
		for _, pol := range policies {
			t.Run(fx.dir+"/"+pol.name, func(t *testing.T) {
				rt := newRuntime(t, nil)
				m := loadDir(t, rt, fx.dir, pol.opts)
				if m.Kind() != fx.kind || m.OutputLen() != fx.outputLen || m.InputLen() != 0 {
					t.Fatalf("kind %q, input len %d, output len %d; want %q, 0, %d",
						m.Kind(), m.InputLen(), m.OutputLen(), fx.kind, fx.outputLen)
				}
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				var wg sync.WaitGroup
				for round := range rounds {
					for i, r := range reqs {
						wg.Add(1)
						go func() {
							defer wg.Done()
							got, err := submitRequest(ctx, m, r)
							if err != nil {
								t.Errorf("round %d, request %d (%d tokens): %v", round, i, len(r.Tokens), err)
								return
							}
							if msg := outputMismatch(got, r); msg != "" {
								t.Errorf("round %d, request %d (%d tokens): %s", round, i, len(r.Tokens), msg)
							}
						}()
					}
				}
				wg.Wait()
				n := uint64(rounds * len(reqs))
				s := stats(t, rt)
				if s.Submitted != n || s.Completed[CodeOK] != n || s.Rejected != 0 {
					t.Errorf("stats %+v, want %d submitted and completed OK", s, n)
				}
				checkExactlyOnce(t, rt)
			})
		}
	}
}

// TestRecurrentBadInputs: malformed sequences and trees, and inputs of the wrong kind, are
// refused at submit with INVALID_ARGUMENT (a message saying what is wrong), produce no
// completion, and leave the models serving.
func TestRecurrentBadInputs(t *testing.T) {
	rt := newRuntime(t, nil)
	lstm := loadDir(t, rt, "lstm_small", &ModelOptions{Policy: PolicyCellular, Workers: 2})
	s2s := loadDir(t, rt, "seq2seq_small", &ModelOptions{Policy: PolicyPadding})
	tree := loadDir(t, rt, "treelstm_small", &ModelOptions{Policy: PolicyCellular, Workers: 2})
	ctx := context.Background()
	tokens := func(m *Model, tok ...uint32) func() error {
		return func() error { _, err := m.SubmitTokens(ctx, tok); return err }
	}
	treeOf := func(m *Model, tok []uint32, parents ...int32) func() error {
		return func() error { _, err := m.SubmitTree(ctx, tok, parents); return err }
	}
	rejectedByLibserve := []struct {
		name     string
		call     func() error
		mentions string // a word the message must contain, if any
	}{
		{"lstm token = vocab", tokens(lstm, 1, 50), "vocabulary"},
		{"lstm token far above vocab", tokens(lstm, 1<<31), "vocabulary"},
		{"lstm no-input token", tokens(lstm, NoToken), "vocabulary"},
		{"lstm empty sequence", tokens(lstm), ""},
		{"seq2seq token = vocab", tokens(s2s, 3, 40), "vocabulary"},
		{"seq2seq empty sequence", tokens(s2s), ""},
		{"tree token = vocab", treeOf(tree, []uint32{50, 1}, -1, 0), "vocabulary"},
		{"tree with two roots", treeOf(tree, []uint32{1, 2, 3}, -1, 0, -1), "root"},
		{"tree with a cycle", treeOf(tree, []uint32{1, 2, 3, 4}, -1, 0, 3, 2), "node"},
		{"tree with a self-parent", treeOf(tree, []uint32{1, 2}, -1, 1), "node 1"},
		{"tree without a root", treeOf(tree, []uint32{1, 2}, 1, 0), "root"},
		{"tree parent out of range", treeOf(tree, []uint32{1, 2}, -1, 2), "node 1"},
		{"tree parent below -1", treeOf(tree, []uint32{1, 2}, -2, 0), "node 0"},
		{"empty tree", treeOf(tree, nil), ""},
		{"f32 to an lstm", func() error { _, err := lstm.Submit(ctx, []float32{1, 2}); return err }, ""},
		{"f32 to a seq2seq", func() error { _, err := s2s.Submit(ctx, []float32{1}); return err }, ""},
		{"tree to an lstm", treeOf(lstm, []uint32{1, 2}, -1, 0), ""},
		{"tree to a seq2seq", treeOf(s2s, []uint32{1, 2}, -1, 0), ""},
		{"tokens to a treelstm", tokens(tree, 1, 2), ""},
	}
	for _, tc := range rejectedByLibserve {
		err := tc.call()
		var e *Error
		if !errors.As(err, &e) || e.Code != CodeInvalidArgument || e.Message == "" || !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: got %v, want INVALID_ARGUMENT with a message", tc.name, err)
			continue
		}
		if !strings.Contains(e.Message, tc.mentions) {
			t.Errorf("%s: message %q does not mention %q", tc.name, e.Message, tc.mentions)
		}
	}
	// Checked in Go (libserve's tree call has one length for both arrays): not a libserve
	// rejection.
	for _, c := range []struct {
		tok     []uint32
		parents []int32
	}{{[]uint32{1, 2}, []int32{-1}}, {[]uint32{1}, []int32{-1, 0}}, {nil, []int32{-1}}} {
		if _, err := tree.SubmitTree(ctx, c.tok, c.parents); !errors.Is(err, ErrInvalidArgument) || CodeOf(err) != CodeInvalidArgument {
			t.Errorf("tree with %d tokens and %d parents: got %v, want INVALID_ARGUMENT", len(c.tok), len(c.parents), err)
		}
	}
	// Every model keeps serving.
	for _, c := range []struct {
		m    *Model
		name string
	}{{lstm, "lstm_small"}, {s2s, "seq2seq_small"}, {tree, "treelstm_small"}} {
		r := loadRecurrentFixture(t, c.name)[2]
		got, err := submitRequest(ctx, c.m, r)
		if err != nil {
			t.Errorf("%s after bad input: %v", c.name, err)
		} else if msg := outputMismatch(got, r); msg != "" {
			t.Errorf("%s after bad input: %s", c.name, msg)
		}
	}
	s := stats(t, rt)
	if s.Rejected != uint64(len(rejectedByLibserve)) || s.Submitted != 3 || s.Completed[CodeOK] != 3 {
		t.Errorf("stats %+v, want %d rejected, 3 submitted and completed OK", s, len(rejectedByLibserve))
	}
	checkExactlyOnce(t, rt)
}

// TestPolicyMustFitKind: a policy that does not fit the model's kind is UNSUPPORTED; an option
// the policy does not have, or a bad value, is INVALID_ARGUMENT; zero options load every kind.
func TestPolicyMustFitKind(t *testing.T) {
	rt := newRuntime(t, nil)
	for _, fx := range recurrentFixtures {
		_, err := rt.LoadModel(recurrentDir(fx.dir), &ModelOptions{Policy: PolicyTimeout})
		var e *Error
		if !errors.As(err, &e) || e.Code != CodeUnsupported || e.Message == "" || !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s under the timeout policy: got %v, want UNSUPPORTED with a message", fx.kind, err)
		}
	}
	for _, p := range []Policy{PolicyCellular, PolicyPadding} {
		if _, err := rt.LoadModel(fixtureDir, &ModelOptions{Policy: p}); !errors.Is(err, ErrUnsupported) {
			t.Errorf("mlp under the %v policy: got %v, want UNSUPPORTED", p, err)
		}
	}
	lstmDir := recurrentDir("lstm_small")
	for name, c := range map[string]struct {
		dir  string
		opts *ModelOptions
	}{
		"max wait under cellular":         {lstmDir, &ModelOptions{Policy: PolicyCellular, MaxWait: time.Millisecond}},
		"max wait under auto (cellular)":  {lstmDir, &ModelOptions{MaxWait: time.Millisecond}},
		"pad to max under padding":        {lstmDir, &ModelOptions{Policy: PolicyPadding, PadToMax: true}},
		"max tasks under timeout":         {fixtureDir, &ModelOptions{MaxTasksToSubmit: 2}},
		"unknown policy":                  {lstmDir, &ModelOptions{Policy: Policy(7)}},
		"negative max tasks":              {lstmDir, &ModelOptions{MaxTasksToSubmit: -1}},
		"huge max tasks":                  {lstmDir, &ModelOptions{MaxTasksToSubmit: math.MaxUint32 + 1}},
		"negative state slots":            {lstmDir, &ModelOptions{StateSlots: -1}},
		"negative workers under cellular": {lstmDir, &ModelOptions{Policy: PolicyCellular, Workers: -1}},
		"huge max batch under padding":    {lstmDir, &ModelOptions{Policy: PolicyPadding, MaxBatch: 1 << 20}},
		"negative admission bound (lstm)": {lstmDir, &ModelOptions{AdmissionBound: -1}},
		"negative token-gate bytes":       {lstmDir, &ModelOptions{TokenGatesBytes: -1}},
		"token gates both off and sized":  {lstmDir, &ModelOptions{NoTokenGates: true, TokenGatesBytes: 1 << 20}},
	} {
		if _, err := rt.LoadModel(c.dir, c.opts); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: got %v, want INVALID_ARGUMENT", name, err)
		}
	}
	// The zero value (not only nil) loads every kind under its own policy; the timeout options
	// load an mlp under an explicit timeout policy.
	for _, fx := range recurrentFixtures {
		loadDir(t, rt, fx.dir, &ModelOptions{})
	}
	loadModel(t, rt, &ModelOptions{Policy: PolicyTimeout, MaxWait: time.Millisecond, PadToMax: true, MaxBatch: 4})
}

// TestStateSlotsBoundRequests: a request needing more state slots than the model has is refused
// with INVALID_ARGUMENT at submit; smaller ones are served.
func TestStateSlotsBoundRequests(t *testing.T) {
	rt := newRuntime(t, nil)
	m := loadDir(t, rt, "treelstm_small", &ModelOptions{Policy: PolicyCellular, StateSlots: 10})
	ctx := context.Background()
	served := 0
	for i, r := range loadRecurrentFixture(t, "treelstm_small") {
		got, err := submitRequest(ctx, m, r)
		switch {
		case len(r.Tokens) > 10:
			if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "state slots") {
				t.Errorf("tree %d of %d nodes with 10 slots: got %v, want INVALID_ARGUMENT about state slots", i, len(r.Tokens), err)
			}
		case err != nil:
			t.Errorf("tree %d of %d nodes with 10 slots: %v", i, len(r.Tokens), err)
		default:
			served++
			if msg := outputMismatch(got, r); msg != "" {
				t.Errorf("tree %d: %s", i, msg)
			}
		}
	}
	if served == 0 {
		t.Error("no tree of the fixture fits in 10 slots")
	}
	checkExactlyOnce(t, rt)
}

func TestPolicyNames(t *testing.T) {
	for p, want := range map[Policy]string{
		PolicyAuto: "auto", PolicyTimeout: "timeout", PolicyCellular: "cellular", PolicyPadding: "padding",
		Policy(9): "Policy(9)",
	} {
		if got := p.String(); got != want {
			t.Errorf("Policy(%d).String() = %q, want %q", uint32(p), got, want)
		}
	}
	// The values are the header's (SERVE_POLICY_*), contiguous from 0.
	if PolicyAuto != 0 || PolicyTimeout != 1 || PolicyCellular != 2 || PolicyPadding != 3 {
		t.Errorf("policy values %d %d %d %d, want 0 1 2 3", PolicyAuto, PolicyTimeout, PolicyCellular, PolicyPadding)
	}
}
