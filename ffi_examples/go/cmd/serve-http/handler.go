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

// maxBodyBytes bounds a request body.
const maxBodyBytes = 1 << 20

// statusClientClosedRequest is nginx's status for a request whose client went away first; it is
// logged, never seen by that client.
const statusClientClosedRequest = 499

// inferRequest is the body of POST /v1/infer.
type inferRequest struct {
	Input []float32 `json:"input"`
}

// inferResponse is the body of a successful POST /v1/infer.
type inferResponse struct {
	Output []float32 `json:"output"`
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

// server serves one model.
type server struct {
	model *libserve.Model
	// timeout is the deadline of every request; a request may ask for a shorter one with the
	// query parameter timeout_ms.
	timeout time.Duration
}

// newHandler returns the HTTP API for m:
//
//	POST /v1/infer   {"input":[...]} → {"output":[...]}, or an error status and body
//	GET  /v1/model   {"kind":"mlp","input_len":16,"output_len":8}
//	GET  /healthz    200 "ok"
func newHandler(m *libserve.Model, timeout time.Duration) http.Handler {
	s := &server{model: m, timeout: timeout}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /v1/infer", s.infer)
	mux.HandleFunc("GET /v1/model", s.info)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		io.WriteString(w, "ok\n")
	})
	return mux
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
	var req inferRequest
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxBodyBytes))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, libserve.CodeInvalidArgument, fmt.Sprintf("the body exceeds %d bytes", tooBig.Limit))
			return
		}
		writeError(w, http.StatusBadRequest, libserve.CodeInvalidArgument, "bad JSON body: "+err.Error())
		return
	}
	if dec.More() {
		writeError(w, http.StatusBadRequest, libserve.CodeInvalidArgument, "bad JSON body: data after the request object")
		return
	}
	if req.Input == nil {
		writeError(w, http.StatusBadRequest, libserve.CodeInvalidArgument, `missing "input"`)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), timeout)
	defer cancel()
	out, err := s.model.Submit(ctx, req.Input)
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
	writeJSON(w, http.StatusOK, inferResponse{Output: out})
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

func writeJSON(w http.ResponseWriter, status int, body any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	// An encoding error here means the client went away; there is no one left to tell.
	_ = json.NewEncoder(w).Encode(body)
}
