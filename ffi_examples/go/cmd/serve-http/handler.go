package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"libserve"
)

// maxBodyBytes bounds a request body: a larger one is answered 413.
const maxBodyBytes = 1 << 20

// shedDiscardBytes is the largest declared body that net/http reads and discards after a
// request shed before its body was read, to keep the connection; a larger body, or one of
// unknown length, closes the connection instead.
const shedDiscardBytes = 64 << 10

// statusClientClosedRequest is nginx's status for a request whose client went away first; it is
// logged, never seen by that client.
const statusClientClosedRequest = 499

// inferRequest is the body of POST /v1/infer, in the forms of `serve infer`: {"input":[...]}
// for fixed-shape models (mlp), {"tokens":[...]} for lstm and seq2seq, {"tokens":[...],
// "parents":[...]} for treelstm.
type inferRequest struct {
	Input   []float32 `json:"input"`
	Tokens  []uint32  `json:"tokens"`
	Parents []int32   `json:"parents"`
}

// inferResponse is the body of a successful POST /v1/infer with an f32 output (mlp, lstm,
// treelstm).
type inferResponse struct {
	Output []float32 `json:"output"`
}

// tokensResponse is the body of a successful POST /v1/infer with a token output (seq2seq).
type tokensResponse struct {
	Tokens []uint32 `json:"tokens"`
}

// errorResponse is the body of every error, in the format of `serve infer`:
// {"error":{"code":"BUSY","message":"..."}}.
type errorResponse struct {
	Error errorDetail `json:"error"`
}

type errorDetail struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// modelInfo is the body of GET /v1/model.
type modelInfo struct {
	Kind      string `json:"kind"`
	InputLen  int    `json:"input_len"`
	OutputLen int    `json:"output_len"`
}

// model is what the server needs of a model: *libserve.Model (tests use stubs).
type model interface {
	Kind() string
	InputLen() int
	OutputLen() int
	Submit(ctx context.Context, input []float32, opts ...libserve.SubmitOption) ([]float32, error)
	SubmitTokens(ctx context.Context, tokens []uint32, opts ...libserve.SubmitOption) (libserve.Output, error)
	SubmitTree(ctx context.Context, tokens []uint32, parents []int32, opts ...libserve.SubmitOption) ([]float32, error)
}

// config is the server's request handling configuration.
type config struct {
	// Timeout is the deadline of every request; a request may ask for a shorter one with the
	// query parameter timeout_ms.
	Timeout time.Duration
	// QoS is the latency target of admission control (admission.go); 0 means Timeout/2.
	QoS time.Duration
	// MaxPending is the most requests admitted at once; 0 means defaultMaxPending.
	MaxPending int
	// AdmitFloor is how many requests are admitted whatever the prediction; 0 means
	// defaultAdmitFloor.
	AdmitFloor int
	// ModelName labels the server's own series in GET /metrics: the name libserve knows the
	// model by, so that they join its series.
	ModelName string
	// Metrics returns libserve's metrics text (Runtime.Metrics); nil serves only the server's
	// own series.
	Metrics func() (string, error)
}

const (
	defaultMaxPending = 1024
	defaultAdmitFloor = 8
)

// server serves one model.
type server struct {
	model      model
	timeout    time.Duration
	admit      *admission
	modelName  string
	libMetrics func() (string, error)
}

// newHandler returns the HTTP API for m:
//
//	POST /v1/infer   {"input":[...]} → {"output":[...]}, {"tokens":[...]} → {"output":[...]}
//	                 (lstm) or {"tokens":[...]} (seq2seq), {"tokens":[...],"parents":[...]} →
//	                 {"output":[...]} (treelstm); or an error status and body
//	GET  /v1/model   {"kind":"mlp","input_len":16,"output_len":8}
//	GET  /healthz    200 "ok"
//	GET  /metrics    libserve's and the server's metrics, OpenMetrics text (metrics.go)
//
// Other paths answer 404, other methods 405 (with Allow), both with a JSON error body.
func newHandler(m model, cfg config) http.Handler {
	qos := cfg.QoS
	if qos <= 0 {
		qos = cfg.Timeout / 2
	}
	maxPending, floor := cfg.MaxPending, cfg.AdmitFloor
	if maxPending <= 0 {
		maxPending = defaultMaxPending
	}
	if floor <= 0 {
		floor = defaultAdmitFloor
	}
	s := &server{model: m, timeout: cfg.Timeout, admit: newAdmission(qos, maxPending, floor),
		modelName: cfg.ModelName, libMetrics: cfg.Metrics}
	mux := http.NewServeMux()
	route(mux, "/v1/infer", http.MethodPost, s.infer)
	route(mux, "/v1/model", http.MethodGet, s.info)
	route(mux, "/metrics", http.MethodGet, s.metrics)
	route(mux, "/healthz", http.MethodGet, func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, libserve.CodeNotFound, fmt.Sprintf("no such path: %q", r.URL.Path))
	})
	return mux
}

// route serves path with h for method (GET also answers HEAD) and 405 for other methods.
func route(mux *http.ServeMux, path, method string, h http.HandlerFunc) {
	allow := method
	if method == http.MethodGet {
		allow = "GET, HEAD"
	}
	mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != method && !(method == http.MethodGet && r.Method == http.MethodHead) {
			w.Header().Set("Allow", allow)
			writeError(w, http.StatusMethodNotAllowed, libserve.CodeInvalidArgument,
				fmt.Sprintf("%s %s is not served: use %s", r.Method, path, allow))
			return
		}
		h(w, r)
	})
}

func (s *server) info(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, modelInfo{Kind: s.model.Kind(), InputLen: s.model.InputLen(), OutputLen: s.model.OutputLen()})
}

func (s *server) infer(w http.ResponseWriter, r *http.Request) {
	timeout := s.timeout
	if q := r.URL.Query().Get("timeout_ms"); q != "" {
		ms, err := strconv.ParseUint(q, 10, 32)
		if err != nil || ms == 0 {
			writeError(w, http.StatusBadRequest, libserve.CodeInvalidArgument, fmt.Sprintf("timeout_ms=%q is not a positive integer", q))
			return
		}
		timeout = min(timeout, time.Duration(ms)*time.Millisecond)
	}
	// Shed before reading the body: a refusal costs no decoding and holds nothing.
	if err := s.admit.enter(timeout); err != nil {
		if r.ContentLength < 0 || r.ContentLength > shedDiscardBytes {
			// The rest of the body may be long in coming: answer at once and close the
			// connection rather than read it (net/http would, to keep the connection).
			w.Header().Set("Connection", "close")
		}
		w.Header().Set("Retry-After", "1")
		writeError(w, http.StatusServiceUnavailable, libserve.CodeBusy, err.Error())
		return
	}
	req, status, msg := decodeRequest(w, r)
	if status != 0 {
		s.admit.abandon()
		writeError(w, status, libserve.CodeInvalidArgument, msg)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	body, err := func() (any, error) {
		t := s.admit.submitted()
		served := false
		// Deferred so that a panicking model still leaves (as a failure: it served nothing).
		defer func() { s.admit.done(t, served) }()
		body, err := s.run(ctx, req)
		served = err == nil
		return body, err
	}()
	if err != nil {
		code := libserve.CodeOf(err)
		status := httpStatus(code)
		if code == libserve.CodeCancelled && r.Context().Err() != nil {
			status = statusClientClosedRequest
		}
		if status == http.StatusServiceUnavailable {
			w.Header().Set("Retry-After", "1")
		}
		writeError(w, status, code, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, body)
}

// decodeRequest reads and checks the body of POST /v1/infer; on failure it returns the status
// (400, or 413 for a body over maxBodyBytes) and why.
func decodeRequest(w http.ResponseWriter, r *http.Request) (inferRequest, int, string) {
	var req inferRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return req, http.StatusRequestEntityTooLarge, fmt.Sprintf("the body exceeds %d bytes", tooBig.Limit)
		}
		return req, http.StatusBadRequest, "bad JSON body: " + err.Error()
	}
	if dec.More() {
		return req, http.StatusBadRequest, "bad JSON body: data after the request object"
	}
	switch {
	case req.Input != nil && (req.Tokens != nil || req.Parents != nil):
		return req, http.StatusBadRequest, `a request has either "input" or "tokens", not both`
	case req.Parents != nil && req.Tokens == nil:
		return req, http.StatusBadRequest, `"parents" without "tokens"`
	case req.Input == nil && req.Tokens == nil:
		return req, http.StatusBadRequest, `missing "input" (or "tokens")`
	}
	return req, 0, ""
}

// run submits req with the call its form takes and returns the response body.
func (s *server) run(ctx context.Context, req inferRequest) (any, error) {
	switch {
	case req.Input != nil:
		out, err := s.model.Submit(ctx, req.Input)
		return inferResponse{Output: out}, err
	case req.Parents != nil:
		out, err := s.model.SubmitTree(ctx, req.Tokens, req.Parents)
		return inferResponse{Output: out}, err
	default:
		out, err := s.model.SubmitTokens(ctx, req.Tokens)
		if out.Tokens != nil {
			return tokensResponse{Tokens: out.Tokens}, err
		}
		return inferResponse{Output: out.F32}, err
	}
}

// httpStatus maps a libserve code to the HTTP status of a failed request.
func httpStatus(code libserve.Code) int {
	switch code {
	case libserve.CodeOK:
		return http.StatusOK
	case libserve.CodeInvalidArgument:
		return http.StatusBadRequest
	case libserve.CodeNotFound:
		return http.StatusNotFound
	case libserve.CodeBusy, libserve.CodeShutdown, libserve.CodeUnavailable, libserve.CodeCancelled:
		// Overloaded, going away, or cancelled by the server's shutdown: retry elsewhere or later.
		return http.StatusServiceUnavailable
	case libserve.CodeDeadlineExceeded:
		return http.StatusGatewayTimeout
	case libserve.CodeUnsupported:
		return http.StatusNotImplemented
	default: // FORMAT, BACKEND, IO, INTERNAL: the server's fault
		return http.StatusInternalServerError
	}
}

func writeError(w http.ResponseWriter, status int, code libserve.Code, msg string) {
	writeJSON(w, status, errorResponse{Error: errorDetail{Code: code.String(), Message: msg}})
}

// writeJSON answers status with body as JSON; a body that cannot be encoded (a non-finite
// output value) is answered 500 INTERNAL instead, never a success with a broken body.
func writeJSON(w http.ResponseWriter, status int, body any) {
	b, err := json.Marshal(body)
	if err != nil {
		status = http.StatusInternalServerError
		b, _ = json.Marshal(errorResponse{Error: errorDetail{Code: libserve.CodeInternal.String(), Message: "cannot encode the response: " + err.Error()}})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	// A write error here means the client went away; there is no one left to tell.
	_, _ = w.Write(append(b, '\n'))
}
