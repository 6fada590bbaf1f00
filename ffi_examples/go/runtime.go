package libserve

/*
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// DefaultDrainTimeout is how long Runtime.Close lets pending requests finish before the rest are
// completed with CodeCancelled.
const DefaultDrainTimeout = 5 * time.Second

// The version of include/libserve.h this package was compiled against (SERVE_VERSION_*).
const (
	// HeaderVersionMajor changes only with an incompatible ABI change.
	HeaderVersionMajor = C.SERVE_VERSION_MAJOR
	// HeaderVersionMinor counts compatible additions (new functions and enum values).
	HeaderVersionMinor = C.SERVE_VERSION_MINOR
	// HeaderVersionPatch counts fixes.
	HeaderVersionPatch = C.SERVE_VERSION_PATCH
)

const (
	// pollTimeout bounds each wait of the poller in serve_queue_next, hence how long Close may
	// wait for the poller to notice that it should stop.
	pollTimeout = 10 * time.Millisecond
	// pollBatch is the most completions taken by one serve_queue_next call.
	pollBatch = 64
	// lostCompletionGrace: once the runtime is shut down every accepted request has completed
	// (serve_runtime_shutdown blocks until then), so its completion is already in the queue. A
	// request still without one this long after Close asked the poller to stop would make its
	// Submit wait forever; it is failed with CodeInternal instead (a libserve bug).
	lostCompletionGrace = 2 * time.Second
)

// Live C objects owned by this package, for leak checks in tests.
var liveRuntimes, liveModels atomic.Int64

// Version returns the version of the linked libserve library, "MAJOR.MINOR.PATCH"
// (serve_version). NewRuntime refuses a library whose major version differs from
// HeaderVersionMajor or whose minor version is older than HeaderVersionMinor.
func Version() string {
	return C.GoString(C.serve_version())
}

// checkVersion compares the linked library with the header compiled against.
func checkVersion() error {
	v := Version()
	var major, minor, patch int
	if _, err := fmt.Sscanf(v, "%d.%d.%d", &major, &minor, &patch); err != nil {
		return &Error{Code: CodeUnsupported, Message: fmt.Sprintf("cannot parse the linked libserve version %q", v)}
	}
	if major != HeaderVersionMajor || minor < HeaderVersionMinor {
		return &Error{Code: CodeUnsupported, Message: fmt.Sprintf(
			"linked libserve %s is incompatible with the header compiled against (%d.%d.%d)",
			v, HeaderVersionMajor, HeaderVersionMinor, HeaderVersionPatch)}
	}
	return nil
}

// RuntimeOptions configures NewRuntime. The zero value (or a nil pointer) means libserve's
// defaults.
type RuntimeOptions struct {
	// Backend is "auto" (CUDA when usable, else CPU), "cpu" or "cuda"; "" means "auto".
	Backend string
	// CPUThreads is the number of compute threads of the CPU backend; 0 means one per core.
	CPUThreads int
	// AdmissionBound is each model's default bound on requests accepted and not yet
	// completed, beyond which submits fail with CodeBusy; 0 means libserve's default (4096).
	AdmissionBound int
	// SpinWait bounds how long a Submit busy-waits for its result before blocking on it (see
	// "Waiting for results" in the package documentation); 0 means DefaultSpinWait, and a
	// negative value disables busy-waiting. It stays in Go: libserve never sees it.
	SpinWait time.Duration
}

// build makes the C options object; the caller frees it.
func (o *RuntimeOptions) build() (*C.serve_runtime_options, error) {
	if o.CPUThreads < 0 || uint64(o.CPUThreads) > math.MaxUint32 {
		return nil, invalid("CPUThreads = %d is out of range", o.CPUThreads)
	}
	if o.AdmissionBound < 0 {
		return nil, invalid("AdmissionBound = %d is negative", o.AdmissionBound)
	}
	if strings.IndexByte(o.Backend, 0) >= 0 {
		return nil, invalid("Backend contains a NUL byte")
	}
	var opts *C.serve_runtime_options
	if err := takeError(C.serve_runtime_options_new(&opts)); err != nil {
		return nil, err
	}
	err := func() error {
		if o.Backend != "" {
			b := C.CString(o.Backend)
			defer C.free(unsafe.Pointer(b))
			if err := takeError(C.serve_runtime_options_set_backend(opts, b)); err != nil {
				return err
			}
		}
		if err := takeError(C.serve_runtime_options_set_cpu_threads(opts, C.uint32_t(o.CPUThreads))); err != nil {
			return err
		}
		if o.AdmissionBound > 0 {
			return takeError(C.serve_runtime_options_set_admission_bound(opts, C.uint64_t(o.AdmissionBound)))
		}
		return nil
	}()
	if err != nil {
		C.serve_runtime_options_free(opts)
		return nil, err
	}
	return opts, nil
}

// Runtime is a libserve runtime: its backend, engine and poller threads, the models loaded into
// it, and the completion queue all of its models' requests complete into. It is safe for
// concurrent use. Close it when done.
type Runtime struct {
	// The state lives apart from the handle so that the poller goroutine, which references the
	// state, does not keep an abandoned Runtime reachable: its cleanup can then release it.
	s *runtimeState
}

// result is one request's completion, as routed by the poller.
type result struct {
	out Output
	err *Error
}

// runtimeState is everything a Runtime owns.
type runtimeState struct {
	// mu guards closed and keeps ptr and queue alive: every C call on them is made holding a
	// read lock after checking closed; close frees them after setting closed under the write lock.
	mu     sync.RWMutex
	closed bool
	ptr    *C.serve_runtime
	queue  *C.serve_queue

	// nextTag numbers requests; a tag identifies a request's completion in the queue.
	nextTag atomic.Uint64
	// pending routes a completion's tag to the channel its Submit waits on.
	pendingMu sync.Mutex
	pending   map[uint64]chan<- result

	// Busy-waiting (wait.go): the longest a Submit spins (0: never), GOMAXPROCS (refreshed by
	// the poller: reading it takes the scheduler's lock), how many Submits are now waiting for a
	// result, and how many results were taken by a spinning Submit (for tests).
	maxSpin time.Duration
	procs   atomic.Int32
	waiting atomic.Int32
	spun    atomic.Uint64

	// Counters checked by the tests: requests libserve accepted, completions routed to a
	// waiting Submit, and completions with no such Submit (an unknown or repeated tag).
	accepted, routed, unrouted atomic.Uint64

	closeOnce  sync.Once
	closeErr   error
	stop       chan struct{} // closed by close once the runtime is shut down
	pollerDone chan struct{} // closed by the poller when it returns
}

// NewRuntime starts a runtime with opts (nil for the defaults) and its poller goroutine.
func NewRuntime(opts *RuntimeOptions) (*Runtime, error) {
	if err := checkVersion(); err != nil {
		return nil, err
	}
	var copts *C.serve_runtime_options
	if opts != nil {
		var err error
		if copts, err = opts.build(); err != nil {
			return nil, err
		}
	}
	var ptr *C.serve_runtime
	err := takeError(C.serve_runtime_new(copts, &ptr))
	C.serve_runtime_options_free(copts)
	if err != nil {
		return nil, err
	}
	var q *C.serve_queue
	if err := takeError(C.serve_queue_new(&q)); err != nil {
		C.serve_runtime_free(ptr)
		return nil, err
	}
	maxSpin := DefaultSpinWait
	if opts != nil && opts.SpinWait != 0 {
		maxSpin = max(opts.SpinWait, 0)
	}
	s := &runtimeState{
		ptr:        ptr,
		queue:      q,
		pending:    make(map[uint64]chan<- result),
		maxSpin:    maxSpin,
		stop:       make(chan struct{}),
		pollerDone: make(chan struct{}),
	}
	s.procs.Store(int32(runtime.GOMAXPROCS(0)))
	liveRuntimes.Add(1)
	go s.poll()
	r := &Runtime{s: s}
	// Safety net for a Runtime dropped without Close. No Submit can be waiting (it would keep
	// the Runtime reachable through its Model), so no drain is needed; close blocks for up to a
	// poll interval, so it runs off the cleanup goroutine.
	runtime.AddCleanup(r, func(s *runtimeState) { go s.close(0) }, s)
	return r, nil
}

// Close is Shutdown(DefaultDrainTimeout).
func (r *Runtime) Close() error {
	return r.Shutdown(DefaultDrainTimeout)
}

// Shutdown stops accepting requests (submits then fail with CodeShutdown), lets pending ones
// finish for up to drain (a negative drain waits without limit), completes the rest with
// CodeCancelled (every waiting Submit returns), stops the poller and frees the runtime and its
// queue. It blocks until done. Only the first call (of Shutdown or Close) does this; later and
// concurrent calls wait for it and return its result. Models loaded from r stay open: close them
// with Model.Close.
func (r *Runtime) Shutdown(drain time.Duration) error {
	err := r.s.close(drain)
	runtime.KeepAlive(r)
	return err
}

func (s *runtimeState) close(drain time.Duration) error {
	s.closeOnce.Do(func() {
		ns := C.uint64_t(math.MaxUint64)
		if drain >= 0 {
			ns = C.uint64_t(drain)
		}
		// Concurrent submits are allowed (the runtime is a const handle); from here on they fail
		// with SHUTDOWN, and every request accepted before has completed into the queue.
		s.closeErr = takeError(C.serve_runtime_shutdown(s.ptr, ns))
		// Wait for calls holding the handles (submit, cancel, stats), and refuse new ones.
		s.mu.Lock()
		s.closed = true
		s.mu.Unlock()
		// The poller delivers what is left in the queue, then returns.
		close(s.stop)
		<-s.pollerDone
		C.serve_queue_free(s.queue)
		C.serve_runtime_free(s.ptr)
		s.queue, s.ptr = nil, nil
		liveRuntimes.Add(-1)
	})
	return s.closeErr
}

// errRuntimeClosed is what calls on a closed Runtime (or on its Models) return.
func errRuntimeClosed() error {
	return &Error{Code: CodeShutdown, Message: "the runtime is closed"}
}

// poll is the poller goroutine: it drains the completion queue and routes each completion to
// the channel registered for its tag, until close has shut the runtime down and every pending
// request has been delivered.
func (s *runtimeState) poll() {
	defer close(s.pollerDone)
	// Scratch arrays in C memory: libserve writes completion pointers there, the shim the
	// flattened events; the completions' outputs are copied to Go memory before they are freed.
	comps := (**C.serve_completion)(C.calloc(pollBatch, C.size_t(unsafe.Sizeof((*C.serve_completion)(nil)))))
	evs := (*C.lsgo_event)(C.calloc(pollBatch, C.sizeof_lsgo_event))
	if comps == nil || evs == nil {
		panic("libserve: out of C memory")
	}
	defer C.free(unsafe.Pointer(comps))
	defer C.free(unsafe.Pointer(evs))
	events := unsafe.Slice(evs, pollBatch)

	// Results routed to their callers, sent only once the completions are freed.
	ready := make([]delivery, 0, pollBatch)
	stopping := false
	var giveUpAt time.Time
	for {
		s.procs.Store(int32(runtime.GOMAXPROCS(0)))
		var n C.size_t
		if err := takeError(C.lsgo_next(s.queue, comps, evs, pollBatch, C.uint64_t(pollTimeout), &n)); err != nil {
			// serve_queue_next fails only for a NULL or callback queue: never for ours.
			panic(fmt.Sprintf("libserve: serve_queue_next failed: %v", err))
		}
		for i := range int(n) {
			if d, ok := s.route(&events[i]); ok {
				ready = append(ready, d)
			}
		}
		// Free the completions first: each holds its request's admission place, so a caller
		// handed its result before the free could submit again and be refused BUSY.
		C.lsgo_release(comps, n)
		for i := range ready {
			ready[i].ch <- ready[i].res // buffered (1) and written once: never blocks
			ready[i] = delivery{}
		}
		ready = ready[:0]
		if n > 0 {
			// Let a woken Submit run on this thread now, before the next wait in C holds it:
			// otherwise it waits for another thread to be woken to run it. (A Submit still
			// spinning in wait.go takes its result without being woken; yielding anyway measured
			// slightly faster than going straight back to C.)
			runtime.Gosched()
		}
		if !stopping {
			select {
			case <-s.stop:
				stopping = true
				giveUpAt = time.Now().Add(lostCompletionGrace)
			default:
				continue
			}
		}
		if n > 0 {
			continue
		}
		s.pendingMu.Lock()
		left := len(s.pending)
		if left > 0 && time.Now().After(giveUpAt) {
			for tag, ch := range s.pending {
				delete(s.pending, tag)
				ch <- result{err: &Error{Code: CodeInternal, Message: fmt.Sprintf(
					"libserve delivered no completion for request tag %d by shutdown", tag)}}
			}
			left = 0
		}
		s.pendingMu.Unlock()
		if left == 0 {
			return
		}
	}
}

// deliver copies one completion out of C memory and routes it.
// A result and the channel of the caller waiting for it.
type delivery struct {
	ch  chan<- result
	res result
}

// route copies a completion's result into Go memory and finds its caller; false when no
// caller waits for its tag (counted as unrouted).
func (s *runtimeState) route(ev *C.lsgo_event) (delivery, bool) {
	var res result
	switch code := Code(ev.code); {
	case code != CodeOK:
		msg := "request failed"
		if ev.message != nil {
			msg = C.GoString(ev.message)
		}
		res.err = &Error{Code: code, Message: msg}
	case ev.kind == C.LSGO_OUTPUT_F32:
		res.out.F32 = make([]float32, int(ev.len))
		copy(res.out.F32, unsafe.Slice((*float32)(ev.data), int(ev.len)))
	case ev.kind == C.LSGO_OUTPUT_TOKENS:
		res.out.Tokens = make([]uint32, int(ev.len))
		copy(res.out.Tokens, unsafe.Slice((*uint32)(ev.data), int(ev.len)))
	default:
		res.err = &Error{Code: CodeInternal, Message: "the completion succeeded but holds no output"}
	}
	tag := uint64(ev.tag)
	s.pendingMu.Lock()
	ch, ok := s.pending[tag]
	delete(s.pending, tag)
	s.pendingMu.Unlock()
	if !ok {
		s.unrouted.Add(1)
		return delivery{}, false
	}
	s.routed.Add(1)
	return delivery{ch: ch, res: res}, true
}

func (s *runtimeState) register(tag uint64, ch chan<- result) {
	s.pendingMu.Lock()
	s.pending[tag] = ch
	s.pendingMu.Unlock()
}

func (s *runtimeState) unregister(tag uint64) {
	s.pendingMu.Lock()
	delete(s.pending, tag)
	s.pendingMu.Unlock()
}

// cancel asks libserve to cancel request id. After close there is nothing to cancel: shutdown
// has completed every request.
func (s *runtimeState) cancel(id uint64) {
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return
	}
	// Fails only for an id this runtime never issued; ids come from its own submits.
	_ = takeError(C.serve_runtime_cancel(s.ptr, C.uint64_t(id)))
}

// Backend returns the backend in use, "cpu" or "cuda"; "" once the runtime is closed.
func (r *Runtime) Backend() string {
	s := r.s
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return ""
	}
	b := C.GoString(C.serve_runtime_backend(s.ptr))
	runtime.KeepAlive(r)
	return b
}

// Stats is a snapshot of a runtime's counters (serve_runtime_stats).
type Stats struct {
	// Submitted counts requests accepted by submit.
	Submitted uint64
	// Rejected counts submits refused synchronously (invalid input, busy, shut down, deadline
	// already passed).
	Rejected uint64
	// Completed counts completed requests by code; codes never completed are absent.
	Completed map[Code]uint64
	// CompletedTotal counts completed requests, whatever their code.
	CompletedTotal uint64
	// Queued counts requests waiting in a scheduler queue.
	Queued uint64
	// Running counts requests in tasks executing on the backend.
	Running uint64
	// InFlight counts requests accepted and not yet completed.
	InFlight uint64
	// TasksLaunched counts batched tasks launched on the backend.
	TasksLaunched uint64
	// BatchedRequests counts requests carried by launched tasks (padding excluded); divided by
	// TasksLaunched it is the mean formed batch size.
	BatchedRequests uint64
	// RingCopies counts fixed-shape inputs copied into their model's input ring at arrival
	// (PolicyElastic: one per accepted request), read in place by their batch.
	RingCopies uint64
	// GatherCopies counts rows copied into a batch's input at launch (every fixed-shape policy
	// but PolicyElastic).
	GatherCopies uint64
	// EngineBusyNs counts nanoseconds the engine thread spent working (it is parked the rest of
	// the time); its growth over a wall-clock interval is the thread's utilization.
	EngineBusyNs uint64
}

// Stats takes a snapshot of the runtime's counters. It fails with CodeShutdown once the runtime
// is closed.
func (r *Runtime) Stats() (Stats, error) {
	s := r.s
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return Stats{}, errRuntimeClosed()
	}
	var cs *C.serve_stats
	if err := takeError(C.serve_runtime_stats(s.ptr, &cs)); err != nil {
		return Stats{}, err
	}
	defer C.serve_stats_free(cs)
	st := Stats{
		Submitted:       uint64(C.serve_stats_submitted(cs)),
		Rejected:        uint64(C.serve_stats_rejected(cs)),
		Completed:       make(map[Code]uint64),
		CompletedTotal:  uint64(C.serve_stats_completed_total(cs)),
		Queued:          uint64(C.serve_stats_queued(cs)),
		Running:         uint64(C.serve_stats_running(cs)),
		InFlight:        uint64(C.serve_stats_in_flight(cs)),
		TasksLaunched:   uint64(C.serve_stats_tasks_launched(cs)),
		BatchedRequests: uint64(C.serve_stats_batched_requests(cs)),
		RingCopies:      uint64(C.serve_stats_ring_copies(cs)),
		GatherCopies:    uint64(C.serve_stats_gather_copies(cs)),
		EngineBusyNs:    uint64(C.serve_stats_engine_busy_ns(cs)),
	}
	for c := CodeOK; c <= CodeInternal; c++ {
		if n := uint64(C.serve_stats_completed(cs, C.uint32_t(c))); n > 0 {
			st.Completed[c] = n
		}
	}
	runtime.KeepAlive(r)
	return st, nil
}

// MetricsContentType is the HTTP content type of the text Metrics returns.
const MetricsContentType = "application/openmetrics-text; version=1.0.0; charset=utf-8"

// Metrics returns the runtime's metrics in the OpenMetrics text format, which Prometheus scrapes
// (serve it as MetricsContentType), ending with "# EOF\n" (serve_runtime_metrics; the series are
// listed in include/libserve.h): completed and refused requests by model and code, queue,
// service and total latency histograms, the formed batch size, queue depth, requests in flight
// and worker busy time. It fails with CodeShutdown once the runtime is closed.
func (r *Runtime) Metrics() (string, error) {
	s := r.s
	s.mu.RLock()
	defer s.mu.RUnlock()
	if s.closed {
		return "", errRuntimeClosed()
	}
	var cm *C.serve_metrics
	if err := takeError(C.serve_runtime_metrics(s.ptr, &cm)); err != nil {
		return "", err
	}
	defer C.serve_metrics_free(cm)
	var n C.size_t
	p := C.serve_metrics_text(cm, &n)
	// Copied into Go memory: the text lives until serve_metrics_free.
	text := string(unsafe.Slice((*byte)(unsafe.Pointer(p)), int(n)))
	runtime.KeepAlive(r)
	return text, nil
}
