package libserve

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// deadlineGrace is how long Submit waits, after its context's deadline passed, for libserve to
// complete the request with DEADLINE_EXCEEDED on its own (it was given the same deadline) before
// cancelling it explicitly.
const deadlineGrace = 100 * time.Millisecond

// Policy is a batching policy: one of the SERVE_POLICY_* constants of include/libserve.h. The
// zero value, PolicyAuto, is the model kind's own policy.
type Policy uint32

// The batching policies, one per SERVE_POLICY_* constant (same names, in Go case).
const (
	// PolicyAuto is the model kind's own policy: timeout batching (no wait) for mlp, cellular
	// batching for lstm, seq2seq and treelstm (SERVE_POLICY_AUTO).
	PolicyAuto Policy = C.SERVE_POLICY_AUTO
	// PolicyTimeout is TF-Serving style timeout batching, for fixed-shape models (mlp)
	// (SERVE_POLICY_TIMEOUT).
	PolicyTimeout Policy = C.SERVE_POLICY_TIMEOUT
	// PolicyCellular is BatchMaker cellular batching, for recurrent models (lstm, seq2seq,
	// treelstm) (SERVE_POLICY_CELLULAR).
	PolicyCellular Policy = C.SERVE_POLICY_CELLULAR
	// PolicyPadding is graph batching with padding, the TF/MXNet baseline, for recurrent models
	// (SERVE_POLICY_PADDING).
	PolicyPadding Policy = C.SERVE_POLICY_PADDING
	// PolicyElastic is E²bird's elastic batching, for fixed-shape models: workers of fixed batch
	// sizes fed full batches from an input ring, no timer (SERVE_POLICY_ELASTIC).
	PolicyElastic Policy = C.SERVE_POLICY_ELASTIC
	// PolicyAdaptive is adaptive batching on a latency model, for fixed-shape models
	// (SERVE_POLICY_ADAPTIVE).
	PolicyAdaptive Policy = C.SERVE_POLICY_ADAPTIVE
)

// String returns the policy's name: "auto", "timeout", "cellular", "padding", "elastic",
// "adaptive", or
// "Policy(N)" for a value that is not a policy.
func (p Policy) String() string {
	switch p {
	case PolicyAuto:
		return "auto"
	case PolicyTimeout:
		return "timeout"
	case PolicyCellular:
		return "cellular"
	case PolicyPadding:
		return "padding"
	case PolicyElastic:
		return "elastic"
	case PolicyAdaptive:
		return "adaptive"
	}
	return fmt.Sprintf("Policy(%d)", uint32(p))
}

// ModelOptions configures Runtime.LoadModel. The zero value (or a nil pointer) means libserve's
// defaults: the model kind's own policy (timeout batching with max batch 32, no wait and one
// worker for mlp; cellular batching with max batch 512 per cell type, one worker and 5 tasks
// submitted ahead for lstm, seq2seq and treelstm), the runtime's admission bound, enough state
// slots for it, and the directory's name. Every zero field keeps its default.
//
// A Policy that does not fit the model's kind (PolicyTimeout for a recurrent model,
// PolicyCellular or PolicyPadding for mlp) makes LoadModel fail with CodeUnsupported; an option
// the chosen policy does not have (MaxWait or PadToMax under cellular or padding batching,
// MaxTasksToSubmit under timeout batching) with CodeInvalidArgument.
type ModelOptions struct {
	// Policy is the batching policy; PolicyAuto (0) means the model kind's own.
	Policy Policy
	// MaxBatch is the most requests (rows) per batched task, under every policy; 0 means the
	// default (32 for timeout batching, 512 per cell type for cellular batching).
	MaxBatch int
	// MaxWait is the longest time the oldest queued request waits for a fuller batch; 0 starts
	// a batch as soon as a worker is idle. Timeout policy only.
	MaxWait time.Duration
	// Workers is the number of workers (backend streams) running this model's tasks
	// concurrently, under every policy; 0 means the default (1).
	Workers int
	// PadToMax makes every task compute MaxBatch rows (static batching). Timeout policy only.
	PadToMax bool
	// MaxTasksToSubmit is how many tasks a worker may have submitted and unfinished
	// (BatchMaker's MaxTasksToSubmit); 0 means the default (5; cellular batching of a Seq2Seq
	// model 2). Cellular and padding policies only.
	MaxTasksToSubmit int
	// StateSlots is the number of state slots of a recurrent model: one per in-flight sequence,
	// one per node of an in-flight tree (requests wait for slots when all are taken, and one
	// needing more than there are is CodeInvalidArgument). 0 means the default: enough for the
	// admission bound within 256 MiB of state.
	StateSlots int
	// AdmissionBound overrides the runtime's admission bound for this model; 0 keeps it.
	AdmissionBound int
	// TokenGatesBytes is the most bytes of token-gate tables a recurrent model may hold (CPU
	// backend: an LSTM's first layer with its embedding folded into its input projection,
	// vocab × 4·hidden floats computed at load; a table that does not fit runs unfolded, with
	// the same results up to rounding). 0 means the default, 256 MiB.
	TokenGatesBytes int64
	// NoTokenGates turns token-gate tables off (TokenGatesBytes must then be 0).
	NoTokenGates bool
	// ElasticWorkers is the batch size of each worker under PolicyElastic (1 to 256 of them,
	// one of size 1); nil means N-Ebird's {1, 1, 2, 4, 8, 16}, or with EngineConfigs their union
	// plus a worker of 1 and one of 2.
	ElasticWorkers []int
	// MaxInflight is the most rows running at once over every elastic worker (MaxInf); 0 means
	// 32.
	MaxInflight int
	// RingSlots is the number of slots of the elastic input ring; 0 means 128. A full ring
	// refuses a request with ErrBusy at once.
	RingSlots int
	// EngineConfigs turns N-Ebird into E-Ebird: at load level TotalBS (the key), run the
	// workers of these batch sizes (summing to it).
	EngineConfigs map[int][]int
	// LatencyBound is the latency the adaptive policy sizes batches for; 0 means 100 ms.
	LatencyBound time.Duration
	// Streams is 2 (the adaptive default: the next batch uploads while one computes) or 1 (the
	// serial server); 0 means the default.
	Streams int
	// Name names the model in messages; "" means the directory's name.
	Name string
}

// build makes the C options object; the caller frees it. Only the fields that are set reach
// libserve, so options one policy lacks stay unset under the others.
func (o *ModelOptions) build() (*C.serve_model_options, error) {
	for _, f := range []struct {
		name string
		v    int
	}{{"MaxBatch", o.MaxBatch}, {"Workers", o.Workers}, {"MaxTasksToSubmit", o.MaxTasksToSubmit}} {
		if f.v < 0 || uint64(f.v) > math.MaxUint32 {
			return nil, invalid("%s = %d is out of range", f.name, f.v)
		}
	}
	if o.MaxWait < 0 {
		return nil, invalid("MaxWait = %v is negative", o.MaxWait)
	}
	if o.StateSlots < 0 {
		return nil, invalid("StateSlots = %d is negative", o.StateSlots)
	}
	if o.AdmissionBound < 0 {
		return nil, invalid("AdmissionBound = %d is negative", o.AdmissionBound)
	}
	if o.TokenGatesBytes < 0 {
		return nil, invalid("TokenGatesBytes = %d is negative", o.TokenGatesBytes)
	}
	if o.NoTokenGates && o.TokenGatesBytes != 0 {
		return nil, invalid("NoTokenGates with TokenGatesBytes = %d: choose one", o.TokenGatesBytes)
	}
	for _, f := range []struct {
		name string
		v    int
	}{{"MaxInflight", o.MaxInflight}, {"RingSlots", o.RingSlots}, {"Streams", o.Streams}} {
		if f.v < 0 || uint64(f.v) > math.MaxUint32 {
			return nil, invalid("%s = %d is out of range", f.name, f.v)
		}
	}
	if o.LatencyBound < 0 {
		return nil, invalid("LatencyBound = %v is negative", o.LatencyBound)
	}
	sizes := func(name string, v []int) ([]C.uint32_t, error) {
		out := make([]C.uint32_t, len(v))
		for i, b := range v {
			if b <= 0 || uint64(b) > math.MaxUint32 {
				return nil, invalid("%s[%d] = %d is out of range", name, i, b)
			}
			out[i] = C.uint32_t(b)
		}
		return out, nil
	}
	elasticWorkers, err := sizes("ElasticWorkers", o.ElasticWorkers)
	if err != nil {
		return nil, err
	}
	if o.ElasticWorkers != nil && len(o.ElasticWorkers) == 0 {
		return nil, invalid("ElasticWorkers is empty")
	}
	engineConfigs := make(map[int][]C.uint32_t, len(o.EngineConfigs))
	for total, conf := range o.EngineConfigs {
		if total <= 0 || uint64(total) > math.MaxUint32 {
			return nil, invalid("EngineConfigs key %d is out of range", total)
		}
		if len(conf) == 0 {
			return nil, invalid("EngineConfigs[%d] is empty", total)
		}
		c, err := sizes(fmt.Sprintf("EngineConfigs[%d]", total), conf)
		if err != nil {
			return nil, err
		}
		engineConfigs[total] = c
	}
	if strings.IndexByte(o.Name, 0) >= 0 {
		return nil, invalid("Name contains a NUL byte")
	}
	var opts *C.serve_model_options
	if err := takeError(C.serve_model_options_new(&opts)); err != nil {
		return nil, err
	}
	err = func() error {
		if o.Policy != PolicyAuto {
			if err := takeError(C.serve_model_options_set_policy(opts, C.uint32_t(o.Policy))); err != nil {
				return err
			}
		}
		if o.MaxBatch > 0 {
			if err := takeError(C.serve_model_options_set_max_batch(opts, C.uint32_t(o.MaxBatch))); err != nil {
				return err
			}
		}
		// MaxWait 0 and PadToMax false are the timeout policy's defaults; setting them would
		// make a model under another policy fail to load.
		if o.MaxWait > 0 {
			if err := takeError(C.serve_model_options_set_max_wait_ns(opts, C.uint64_t(o.MaxWait))); err != nil {
				return err
			}
		}
		if o.Workers > 0 {
			if err := takeError(C.serve_model_options_set_workers(opts, C.uint32_t(o.Workers))); err != nil {
				return err
			}
		}
		if o.PadToMax {
			if err := takeError(C.serve_model_options_set_pad_to_max(opts, C.bool(true))); err != nil {
				return err
			}
		}
		if o.MaxTasksToSubmit > 0 {
			if err := takeError(C.serve_model_options_set_max_tasks_to_submit(opts, C.uint32_t(o.MaxTasksToSubmit))); err != nil {
				return err
			}
		}
		if o.StateSlots > 0 {
			if err := takeError(C.serve_model_options_set_state_slots(opts, C.uint64_t(o.StateSlots))); err != nil {
				return err
			}
		}
		if o.AdmissionBound > 0 {
			if err := takeError(C.serve_model_options_set_admission_bound(opts, C.uint64_t(o.AdmissionBound))); err != nil {
				return err
			}
		}
		if len(elasticWorkers) > 0 {
			if err := takeError(C.serve_model_options_set_elastic_workers(opts, &elasticWorkers[0], C.size_t(len(elasticWorkers)))); err != nil {
				return err
			}
		}
		if o.MaxInflight > 0 {
			if err := takeError(C.serve_model_options_set_max_inflight(opts, C.uint32_t(o.MaxInflight))); err != nil {
				return err
			}
		}
		if o.RingSlots > 0 {
			if err := takeError(C.serve_model_options_set_ring_slots(opts, C.uint32_t(o.RingSlots))); err != nil {
				return err
			}
		}
		for total, conf := range engineConfigs {
			if err := takeError(C.serve_model_options_add_engine_config(opts, C.uint32_t(total), &conf[0], C.size_t(len(conf)))); err != nil {
				return err
			}
		}
		if o.LatencyBound > 0 {
			if err := takeError(C.serve_model_options_set_latency_bound_ns(opts, C.uint64_t(o.LatencyBound))); err != nil {
				return err
			}
		}
		if o.Streams > 0 {
			if err := takeError(C.serve_model_options_set_streams(opts, C.uint32_t(o.Streams))); err != nil {
				return err
			}
		}
		if o.TokenGatesBytes > 0 || o.NoTokenGates {
			if err := takeError(C.serve_model_options_set_token_gates_bytes(opts, C.uint64_t(o.TokenGatesBytes))); err != nil {
				return err
			}
		}
		if o.Name != "" {
			n := C.CString(o.Name)
			defer C.free(unsafe.Pointer(n))
			return takeError(C.serve_model_options_set_name(opts, n))
		}
		return nil
	}()
	if err != nil {
		C.serve_model_options_free(opts)
		return nil, err
	}
	return opts, nil
}

// Model is a model loaded into a Runtime. It is safe for concurrent use: any number of
// goroutines may submit to it. Close it when done; a Model whose Runtime is closed stays open
// (its submits fail with CodeShutdown) until closed.
type Model struct {
	// The state is apart from the handle so that the cleanup can release it (see Runtime).
	s  *modelState
	rt *Runtime

	kind      string
	inputLen  int
	outputLen int
}

// modelState owns the serve_model.
type modelState struct {
	// mu guards closed and keeps ptr alive: submits hold a read lock around their C call.
	mu     sync.RWMutex
	closed bool
	ptr    *C.serve_model

	// meanWait is a moving average of how long this model's requests took from submit to
	// result, in nanoseconds: it sizes the busy-wait of Submit (wait.go).
	meanWait atomic.Int64
}

// LoadModel loads the model directory dir (model.toml + weights.safetensors) with opts (nil for
// the defaults). Errors: CodeNotFound (no such directory or file), CodeFormat (malformed model),
// CodeUnsupported (a Policy that does not fit the model's kind), CodeInvalidArgument (bad
// options, or an option the policy does not have), CodeShutdown (the runtime is closed or
// shutting down).
func (r *Runtime) LoadModel(dir string, opts *ModelOptions) (*Model, error) {
	if strings.IndexByte(dir, 0) >= 0 {
		return nil, invalid("the model directory contains a NUL byte")
	}
	var copts *C.serve_model_options
	if opts != nil {
		var err error
		if copts, err = opts.build(); err != nil {
			return nil, err
		}
		defer C.serve_model_options_free(copts)
	}
	cdir := C.CString(dir)
	defer C.free(unsafe.Pointer(cdir))

	s := r.s
	s.mu.RLock()
	if s.closed {
		s.mu.RUnlock()
		return nil, errRuntimeClosed()
	}
	var ptr *C.serve_model
	err := takeError(C.serve_runtime_load_model(s.ptr, cdir, copts, &ptr))
	s.mu.RUnlock()
	runtime.KeepAlive(r)
	if err != nil {
		return nil, err
	}
	return r.newModel(ptr), nil
}

// newModel wraps a serve_model the caller owns (now the Model's).
func (r *Runtime) newModel(ptr *C.serve_model) *Model {
	ms := &modelState{ptr: ptr}
	liveModels.Add(1)
	m := &Model{
		s:         ms,
		rt:        r,
		kind:      C.GoString(C.serve_model_kind(ptr)),
		inputLen:  int(C.serve_model_input_len(ptr)),
		outputLen: int(C.serve_model_output_len(ptr)),
	}
	runtime.AddCleanup(m, func(ms *modelState) { ms.close() }, ms)
	return m
}

// Kind returns the model's kind: "mlp", "lstm", "seq2seq" or "treelstm".
func (m *Model) Kind() string { return m.kind }

// InputLen returns the number of values in one request's input for fixed-shape models (mlp),
// and 0 for sequence and tree models.
func (m *Model) InputLen() int { return m.inputLen }

// OutputLen returns the number of values in one request's output for models with a fixed
// output size, else 0.
func (m *Model) OutputLen() int { return m.outputLen }

// Close releases the model handle. Requests already submitted still complete normally; once
// they have, libserve releases the model's threads, state and buffers. Later submits fail with
// ErrClosed. Idempotent and safe for concurrent use; it waits for submits in progress
// to hand their request to libserve.
func (m *Model) Close() error {
	m.s.close()
	runtime.KeepAlive(m)
	return nil
}

func (ms *modelState) close() {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	if ms.closed {
		return
	}
	ms.closed = true
	C.serve_model_free(ms.ptr)
	ms.ptr = nil
	liveModels.Add(-1)
}

// Output is the output of a request: F32 for mlp, lstm and treelstm models (for lstm and
// treelstm, the final hidden state h, Model.OutputLen values), Tokens for seq2seq (the decoded
// token ids). Exactly one of them is non-nil.
type Output struct {
	// F32 holds f32 outputs.
	F32 []float32
	// Tokens holds the token ids of a seq2seq decode.
	Tokens []uint32
}

// SubmitOption sets a per-request option of Submit, SubmitTokens or SubmitTree.
type SubmitOption func(*submitConfig)

type submitConfig struct {
	priority int32
}

// WithPriority sets the request's priority: larger is served first; equal priorities in arrival
// order. The default is 0.
func WithPriority(p int32) SubmitOption {
	return func(c *submitConfig) { c.priority = p }
}

// Submit runs the model on one f32 input (mlp and other fixed-shape models) and returns its
// output. It blocks until the request completes or ctx ends.
//
// The input is copied before Submit hands the request over. A deadline of ctx becomes the
// request's libserve deadline. Errors: *Error with CodeInvalidArgument (empty or wrong-length
// input, input of the wrong kind), CodeBusy (the admission bound is full: the request was not
// accepted and may be retried), CodeDeadlineExceeded, CodeShutdown, CodeBackend, ...; ErrClosed
// after Model.Close. If ctx ends first, the request is cancelled and Submit still waits for its
// completion: it returns the output if the request finished anyway, else an error wrapping
// ctx.Err() and libserve's *Error (so errors.Is works with both). A ctx already done returns
// its error without submitting.
func (m *Model) Submit(ctx context.Context, input []float32, opts ...SubmitOption) ([]float32, error) {
	out, err := m.submit(ctx, opts, func(ptr *C.serve_model, q *C.serve_queue, tag C.uint64_t, how C.lsgo_submit, id *C.uint64_t) *C.serve_error {
		var p *C.float
		if len(input) > 0 {
			p = (*C.float)(unsafe.Pointer(&input[0]))
		}
		return C.lsgo_submit_f32(ptr, q, tag, p, C.size_t(len(input)), how, id)
	})
	if err != nil {
		return nil, err
	}
	if out.F32 == nil {
		return nil, invalid("the request's output is tokens: use SubmitTokens")
	}
	return out.F32, nil
}

// SubmitTokens runs the model on a token sequence (lstm, seq2seq) and returns its output:
// Output.F32 (the final hidden state) for lstm, Output.Tokens (the decoded ids) for seq2seq; the
// other field is nil. An empty sequence, a token id at least the model's vocabulary, a sequence
// longer than its maximum, or a model that does not take tokens (mlp, treelstm) is
// CodeInvalidArgument. Otherwise as Submit.
func (m *Model) SubmitTokens(ctx context.Context, tokens []uint32, opts ...SubmitOption) (Output, error) {
	out, err := m.submit(ctx, opts, func(ptr *C.serve_model, q *C.serve_queue, tag C.uint64_t, how C.lsgo_submit, id *C.uint64_t) *C.serve_error {
		var p *C.uint32_t
		if len(tokens) > 0 {
			p = (*C.uint32_t)(unsafe.Pointer(&tokens[0]))
		}
		return C.lsgo_submit_tokens(ptr, q, tag, p, C.size_t(len(tokens)), how, id)
	})
	return out, err
}

// NoToken marks a tree node without an input token in SubmitTree.
const NoToken = math.MaxUint32

// SubmitTree runs the model on a tree (treelstm): node i has token tokens[i] (NoToken for none)
// and parent parents[i] (-1 for the root), in any node order. It returns the root's final hidden
// state (Model.OutputLen values). A malformed tree (empty, no root, two roots, a cycle, a parent
// out of range), a token id at least the model's vocabulary, tokens and parents of different
// lengths, a tree needing more state slots than the model has, or a model that does not take
// trees is CodeInvalidArgument. Otherwise as Submit.
func (m *Model) SubmitTree(ctx context.Context, tokens []uint32, parents []int32, opts ...SubmitOption) ([]float32, error) {
	if len(tokens) != len(parents) {
		return nil, invalid("a tree needs one parent per token: %d tokens, %d parents", len(tokens), len(parents))
	}
	out, err := m.submit(ctx, opts, func(ptr *C.serve_model, q *C.serve_queue, tag C.uint64_t, how C.lsgo_submit, id *C.uint64_t) *C.serve_error {
		var t *C.uint32_t
		var p *C.int32_t
		if len(tokens) > 0 {
			t = (*C.uint32_t)(unsafe.Pointer(&tokens[0]))
			p = (*C.int32_t)(unsafe.Pointer(&parents[0]))
		}
		return C.lsgo_submit_tree(ptr, q, tag, t, p, C.size_t(len(tokens)), how, id)
	})
	if err != nil {
		return nil, err
	}
	if out.F32 == nil {
		return nil, invalid("the request's output is tokens: use SubmitTokens")
	}
	return out.F32, nil
}

// submitC submits one request to libserve; its arguments are those of the lsgo_submit_* shims.
type submitC func(model *C.serve_model, queue *C.serve_queue, tag C.uint64_t, how C.lsgo_submit, requestID *C.uint64_t) *C.serve_error

// Result channels are reused: each carries exactly one value per request and is drained before
// it goes back to the pool.
var resultChans = sync.Pool{New: func() any { return make(chan result, 1) }}

// submit registers a tag, submits with it, and waits for the completion (see Submit).
func (m *Model) submit(ctx context.Context, opts []SubmitOption, do submitC) (Output, error) {
	if err := ctx.Err(); err != nil {
		return Output{}, fmt.Errorf("libserve: request not submitted: %w", err)
	}
	var cfg submitConfig
	for _, o := range opts {
		o(&cfg)
	}
	how := C.lsgo_submit{priority: C.int32_t(cfg.priority)}
	deadline, hasDeadline := ctx.Deadline()
	if hasDeadline {
		how.has_deadline = 1
		how.relative_deadline_ns = C.int64_t(time.Until(deadline))
	}

	rs := m.rt.s
	ch := resultChans.Get().(chan result)
	tag := rs.nextTag.Add(1)
	var id C.uint64_t
	rs.mu.RLock()
	if rs.closed {
		rs.mu.RUnlock()
		resultChans.Put(ch)
		return Output{}, errRuntimeClosed()
	}
	m.s.mu.RLock()
	if m.s.closed {
		m.s.mu.RUnlock()
		rs.mu.RUnlock()
		resultChans.Put(ch)
		return Output{}, ErrClosed
	}
	// Registered first: the completion may reach the poller before the submit call returns.
	rs.register(tag, ch)
	cerr := do(m.s.ptr, rs.queue, C.uint64_t(tag), how, &id)
	if cerr != nil {
		rs.unregister(tag) // a refused submit produces no completion
	} else {
		rs.accepted.Add(1)
	}
	m.s.mu.RUnlock()
	rs.mu.RUnlock()
	runtime.KeepAlive(m)
	if cerr != nil {
		resultChans.Put(ch)
		return Output{}, takeError(cerr)
	}

	if res, ok := rs.wait(m.s, ch, ctx.Done()); ok {
		resultChans.Put(ch)
		if res.err != nil {
			return Output{}, res.err
		}
		return res.out, nil
	}
	var res result
	// The context ended first. libserve has the same deadline and completes the request with
	// DEADLINE_EXCEEDED itself, so give it a moment; otherwise (or if it does not) cancel.
	// Either way wait for the request's single completion.
	if hasDeadline && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t := time.NewTimer(deadlineGrace)
		select {
		case res = <-ch:
		case <-t.C:
			rs.cancel(uint64(id))
			res = <-ch
		}
		t.Stop()
	} else {
		rs.cancel(uint64(id))
		res = <-ch
	}
	runtime.KeepAlive(m)
	resultChans.Put(ch)
	if res.err == nil {
		return res.out, nil
	}
	return Output{}, fmt.Errorf("%w (%w)", res.err, ctx.Err())
}
