package libserve

/*
#include <stdint.h>
#include "libserve.h"
*/
import "C"

import (
	"runtime"
	"unsafe"
)

// rawPath is the bare C round trip the benchmarks compare the bindings with: serve_submit_f32
// on a private queue, then a blocking serve_queue_next for its completion, from the calling
// goroutine, with no tags map, channels, poller goroutine or context. It is what a Go program
// calling the C ABI directly, one request at a time per queue, would do. Not safe for
// concurrent use: give each goroutine its own.
type rawPath struct {
	q *C.serve_queue
}

func newRawPath() (*rawPath, error) {
	var q *C.serve_queue
	if err := takeError(C.serve_queue_new(&q)); err != nil {
		return nil, err
	}
	return &rawPath{q: q}, nil
}

func (r *rawPath) close() {
	C.serve_queue_free(r.q)
	r.q = nil
}

// roundTrip submits input to m and waits for its completion, copying its output into out
// (which must have room for it). The caller keeps m open.
func (r *rawPath) roundTrip(m *Model, input, out []float32) error {
	if err := takeError(C.serve_submit_f32(m.s.ptr, r.q, 0, (*C.float)(unsafe.Pointer(&input[0])),
		C.size_t(len(input)), nil, nil)); err != nil {
		return err
	}
	var c *C.serve_completion
	var n C.size_t
	if err := takeError(C.serve_queue_next(r.q, &c, 1, C.UINT64_MAX, &n)); err != nil {
		return err
	}
	defer C.serve_completion_free(c)
	var data *C.float
	var l C.size_t
	if err := takeError(C.serve_completion_output_f32(c, &data, &l)); err != nil {
		return err
	}
	if int(l) > len(out) {
		return invalid("output of %d values does not fit in %d", l, len(out))
	}
	copy(out, unsafe.Slice((*float32)(unsafe.Pointer(data)), int(l)))
	runtime.KeepAlive(m)
	return nil
}
