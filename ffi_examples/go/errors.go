package libserve

/*
#include "libserve.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
)

// Code is a stable libserve status code: the C enum serve_code. Values are never changed or
// reused; new ones are only appended. String returns the header's name without its
// SERVE_CODE_ prefix ("INVALID_ARGUMENT", "BUSY", ...).
type Code uint32

// The status codes, one per SERVE_CODE_* value of include/libserve.h (same names, in Go case).
const (
	// CodeOK is success (SERVE_CODE_OK).
	CodeOK Code = C.SERVE_CODE_OK
	// CodeInvalidArgument: an argument is invalid, such as an empty or wrong-length input, a
	// bad token id, a malformed tree, or an input of the wrong kind for the model.
	CodeInvalidArgument Code = C.SERVE_CODE_INVALID_ARGUMENT
	// CodeNotFound: a file or directory does not exist.
	CodeNotFound Code = C.SERVE_CODE_NOT_FOUND
	// CodeFormat: a model directory is malformed (model.toml, tensors, dtype, truncation, kind).
	CodeFormat Code = C.SERVE_CODE_FORMAT
	// CodeBusy: the model's admission bound is full and the request was not accepted; the
	// caller may retry later.
	CodeBusy Code = C.SERVE_CODE_BUSY
	// CodeDeadlineExceeded: the request's deadline passed before it could complete (or had
	// already passed at submit).
	CodeDeadlineExceeded Code = C.SERVE_CODE_DEADLINE_EXCEEDED
	// CodeCancelled: the request was cancelled, explicitly or by shutdown.
	CodeCancelled Code = C.SERVE_CODE_CANCELLED
	// CodeShutdown: the runtime is shutting down or shut down; no new requests are accepted.
	CodeShutdown Code = C.SERVE_CODE_SHUTDOWN
	// CodeUnavailable: a requested backend or device is not available on this machine.
	CodeUnavailable Code = C.SERVE_CODE_UNAVAILABLE
	// CodeUnsupported: the request is valid but this build does not support it.
	CodeUnsupported Code = C.SERVE_CODE_UNSUPPORTED
	// CodeBackend: the backend failed while executing.
	CodeBackend Code = C.SERVE_CODE_BACKEND
	// CodeIO: an I/O error other than a missing file.
	CodeIO Code = C.SERVE_CODE_IO
	// CodeInternal: a bug in libserve (or in these bindings).
	CodeInternal Code = C.SERVE_CODE_INTERNAL
)

// String returns the code's name as the C library spells it (serve_code_name), such as
// "DEADLINE_EXCEEDED", or "UNKNOWN" for a value that is not a code.
func (c Code) String() string {
	return C.GoString(C.serve_code_name(C.uint32_t(c)))
}

// Error is a failure reported by libserve: a stable Code and a message saying what was wrong
// and where. Functions of this package return it as *Error (possibly wrapped); test for a code
// with errors.Is against the Err* sentinels, or read it with errors.As or CodeOf.
type Error struct {
	// Code is the stable status code.
	Code Code
	// Message is libserve's explanation (or the binding's, for checks made in Go).
	Message string
}

// Error formats the error as "libserve: CODE: message".
func (e *Error) Error() string {
	if e.Message == "" {
		return "libserve: " + e.Code.String()
	}
	return "libserve: " + e.Code.String() + ": " + e.Message
}

// Is reports whether target is an *Error with the same code and, unless target's message is
// empty (as in the Err* sentinels), the same message. An error with CodeDeadlineExceeded also
// matches context.DeadlineExceeded, so callers can test deadline expiry the same way whether
// libserve or the context noticed it first.
func (e *Error) Is(target error) bool {
	if t, ok := target.(*Error); ok {
		return t.Code == e.Code && (t.Message == "" || t.Message == e.Message)
	}
	return e.Code == CodeDeadlineExceeded && target == context.DeadlineExceeded
}

// Sentinel errors, one per failure code, for errors.Is: errors.Is(err, ErrBusy) holds for any
// *Error with CodeBusy. They match by code only.
var (
	// ErrInvalidArgument matches errors with CodeInvalidArgument.
	ErrInvalidArgument = &Error{Code: CodeInvalidArgument}
	// ErrNotFound matches errors with CodeNotFound.
	ErrNotFound = &Error{Code: CodeNotFound}
	// ErrFormat matches errors with CodeFormat.
	ErrFormat = &Error{Code: CodeFormat}
	// ErrBusy matches errors with CodeBusy.
	ErrBusy = &Error{Code: CodeBusy}
	// ErrDeadlineExceeded matches errors with CodeDeadlineExceeded.
	ErrDeadlineExceeded = &Error{Code: CodeDeadlineExceeded}
	// ErrCancelled matches errors with CodeCancelled.
	ErrCancelled = &Error{Code: CodeCancelled}
	// ErrShutdown matches errors with CodeShutdown.
	ErrShutdown = &Error{Code: CodeShutdown}
	// ErrUnavailable matches errors with CodeUnavailable.
	ErrUnavailable = &Error{Code: CodeUnavailable}
	// ErrUnsupported matches errors with CodeUnsupported.
	ErrUnsupported = &Error{Code: CodeUnsupported}
	// ErrBackend matches errors with CodeBackend.
	ErrBackend = &Error{Code: CodeBackend}
	// ErrIO matches errors with CodeIO.
	ErrIO = &Error{Code: CodeIO}
	// ErrInternal matches errors with CodeInternal.
	ErrInternal = &Error{Code: CodeInternal}
)

// ErrClosed is returned by Model methods called after Model.Close. (A Model whose Runtime is
// closed is still open, and its submits fail with CodeShutdown.)
var ErrClosed = errors.New("libserve: model is closed")

// CodeOf classifies err: CodeOK for nil; CodeDeadlineExceeded or CodeCancelled when err wraps
// context.DeadlineExceeded or context.Canceled (a request given up because its context ended,
// whatever code libserve completed it with); otherwise the code of the first *Error in err's
// chain; CodeInternal for any other error.
func CodeOf(err error) Code {
	var e *Error
	switch {
	case err == nil:
		return CodeOK
	case errors.Is(err, context.DeadlineExceeded):
		return CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return CodeCancelled
	case errors.As(err, &e):
		return e.Code
	default:
		return CodeInternal
	}
}

// takeError converts a serve_error (NULL = success) to a Go error and frees it.
func takeError(e *C.serve_error) error {
	if e == nil {
		return nil
	}
	err := &Error{Code: Code(C.serve_error_code(e)), Message: C.GoString(C.serve_error_message(e))}
	C.serve_error_free(e)
	return err
}

// invalid is an INVALID_ARGUMENT error raised by a check made in Go, before calling libserve.
func invalid(format string, args ...any) error {
	return &Error{Code: CodeInvalidArgument, Message: fmt.Sprintf(format, args...)}
}
