package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestNotFoundAndMethodNotAllowedAreJSON(t *testing.T) {
	srv, _ := start(t, nil)
	for _, tc := range []struct {
		method, path string
		status       int
		code, allow  string
	}{
		{http.MethodGet, "/nope", http.StatusNotFound, "NOT_FOUND", ""},
		{http.MethodPost, "/v1/infer/extra", http.StatusNotFound, "NOT_FOUND", ""},
		{http.MethodGet, "/v1/infer", http.StatusMethodNotAllowed, "INVALID_ARGUMENT", "POST"},
		{http.MethodDelete, "/v1/infer", http.StatusMethodNotAllowed, "INVALID_ARGUMENT", "POST"},
		{http.MethodPost, "/v1/model", http.StatusMethodNotAllowed, "INVALID_ARGUMENT", "GET, HEAD"},
		{http.MethodPut, "/healthz", http.StatusMethodNotAllowed, "INVALID_ARGUMENT", "GET, HEAD"},
		{http.MethodPost, "/metrics", http.StatusMethodNotAllowed, "INVALID_ARGUMENT", "GET, HEAD"},
	} {
		req, err := http.NewRequest(tc.method, srv.URL+tc.path, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := srv.Client().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var b errorResponse
		err = json.NewDecoder(resp.Body).Decode(&b)
		resp.Body.Close()
		what := tc.method + " " + tc.path
		if err != nil {
			t.Errorf("%s: %d with a body that is not JSON: %v", what, resp.StatusCode, err)
			continue
		}
		if resp.StatusCode != tc.status || b.Error.Code != tc.code || b.Error.Message == "" ||
			resp.Header.Get("Content-Type") != "application/json" || resp.Header.Get("Allow") != tc.allow {
			t.Errorf("%s: %d %+v (Content-Type %q, Allow %q), want %d %s (Allow %q)", what, resp.StatusCode, b,
				resp.Header.Get("Content-Type"), resp.Header.Get("Allow"), tc.status, tc.code, tc.allow)
		}
	}
	// GET routes answer HEAD too.
	resp, err := srv.Client().Head(srv.URL + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("HEAD /healthz: %d", resp.StatusCode)
	}
}

// recurrentRequest is one request of a recurrent fixture's expected.json (scripts/make_fixtures.py).
type recurrentRequest struct {
	Tokens       []uint32  `json:"tokens"`
	Parents      []int32   `json:"parents"`       // treelstm only
	Output       []float64 `json:"output"`        // lstm, treelstm: the final h
	OutputTokens []uint32  `json:"output_tokens"` // seq2seq: the decoded tokens
}

func loadRecurrent(t *testing.T, dir string) []recurrentRequest {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "expected.json"))
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Requests []recurrentRequest `json:"requests"`
	}
	if err := json.Unmarshal(data, &f); err != nil || len(f.Requests) == 0 {
		t.Fatalf("%s/expected.json: %d requests, %v", dir, len(f.Requests), err)
	}
	return f.Requests
}

// recurrentMismatch says how r differs from the expected answer want ("" if it does not).
func recurrentMismatch(r reply, want recurrentRequest) string {
	if r.status != http.StatusOK {
		return fmt.Sprintf("status %d %s %s", r.status, r.code, r.message)
	}
	if want.OutputTokens != nil {
		if r.output != nil || !slices.Equal(r.tokens, want.OutputTokens) {
			return fmt.Sprintf("got tokens %v output %v, want tokens %v", r.tokens, r.output, want.OutputTokens)
		}
		return ""
	}
	if r.tokens != nil || len(r.output) != len(want.Output) {
		return fmt.Sprintf("got output %v tokens %v, want output %v", r.output, r.tokens, want.Output)
	}
	for i, w := range want.Output {
		if g := float64(r.output[i]); math.IsNaN(g) || math.Abs(g-w) > 1e-4*math.Max(1, math.Abs(w)) {
			return fmt.Sprintf("output[%d] = %v, want %v", i, g, w)
		}
	}
	return ""
}

// TestRecurrentModels serves the committed lstm, seq2seq and treelstm fixtures and posts every
// request of their expected.json, in the forms of `serve infer`, from concurrent clients.
func TestRecurrentModels(t *testing.T) {
	for _, name := range []string{"lstm_small", "seq2seq_small", "treelstm_small"} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join("..", "..", "..", "testdata", name)
			want := loadRecurrent(t, dir)
			srv, _ := startDir(t, dir, nil)
			var wg sync.WaitGroup
			for round := range 3 {
				for i, w := range want {
					wg.Add(1)
					go func() {
						defer wg.Done()
						body, _ := json.Marshal(inferRequest{Tokens: w.Tokens, Parents: w.Parents})
						r, err := post(context.Background(), srv, "", string(body))
						if err != nil {
							t.Errorf("round %d request %d: %v", round, i, err)
						} else if m := recurrentMismatch(r, w); m != "" {
							t.Errorf("round %d request %d (%s): %s", round, i, body, m)
						}
					}()
				}
			}
			wg.Wait()
			// A request of the wrong form is refused with the model's reason.
			bad := `{"input":[1,2]}`
			if strings.HasPrefix(name, "lstm") {
				bad = `{"tokens":[1],"parents":[-1]}`
			}
			if r, err := post(context.Background(), srv, "", bad); err != nil || r.status != http.StatusBadRequest || r.code != "INVALID_ARGUMENT" {
				t.Errorf("%s: got %+v, %v; want 400 INVALID_ARGUMENT", bad, r, err)
			}
		})
	}
}

// Headers over maxHeaderBytes are refused (431) before any handler runs.
func TestHeadersAreBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := newServer("", newHandler(&slowModel{}, config{Timeout: time.Second}), time.Second)
	go srv.Serve(ln)
	defer srv.Close()
	req, err := http.NewRequest(http.MethodGet, "http://"+ln.Addr().String()+"/healthz", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-Filler", strings.Repeat("x", 2*maxHeaderBytes))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
		t.Errorf("headers of %d bytes: %d, want 431", 2*maxHeaderBytes, resp.StatusCode)
	}
}
