package libserve

import (
	"context"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestVersion(t *testing.T) {
	v := Version()
	if err := checkVersion(); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("%d.%d.", HeaderVersionMajor, HeaderVersionMinor); !strings.HasPrefix(v, want) {
		t.Errorf("Version() = %q, header is %d.%d.%d", v, HeaderVersionMajor, HeaderVersionMinor, HeaderVersionPatch)
	}
}

func TestCodeNamesMirrorHeader(t *testing.T) {
	want := map[Code]string{
		CodeOK:               "OK",
		CodeInvalidArgument:  "INVALID_ARGUMENT",
		CodeNotFound:         "NOT_FOUND",
		CodeFormat:           "FORMAT",
		CodeBusy:             "BUSY",
		CodeDeadlineExceeded: "DEADLINE_EXCEEDED",
		CodeCancelled:        "CANCELLED",
		CodeShutdown:         "SHUTDOWN",
		CodeUnavailable:      "UNAVAILABLE",
		CodeUnsupported:      "UNSUPPORTED",
		CodeBackend:          "BACKEND",
		CodeIO:               "IO",
		CodeInternal:         "INTERNAL",
	}
	for c := CodeOK; c <= CodeInternal; c++ {
		if got := c.String(); got != want[c] {
			t.Errorf("Code(%d).String() = %q, want %q", uint32(c), got, want[c])
		}
	}
	if len(want) != int(CodeInternal)+1 {
		t.Errorf("codes are not contiguous 0..%d", uint32(CodeInternal))
	}
	if got := Code(999).String(); got != "UNKNOWN" {
		t.Errorf("Code(999).String() = %q, want UNKNOWN", got)
	}
}

func TestErrorMatching(t *testing.T) {
	busy := &Error{Code: CodeBusy, Message: "full"}
	wrapped := fmt.Errorf("handler: %w", busy)
	if !errors.Is(wrapped, ErrBusy) || errors.Is(wrapped, ErrShutdown) {
		t.Errorf("errors.Is by code failed for %v", wrapped)
	}
	if !errors.Is(busy, &Error{Code: CodeBusy, Message: "full"}) || errors.Is(busy, &Error{Code: CodeBusy, Message: "other"}) {
		t.Error("a target with a message must match code and message")
	}
	if busy.Error() != "libserve: BUSY: full" {
		t.Errorf("Error() = %q", busy.Error())
	}
	dl := &Error{Code: CodeDeadlineExceeded, Message: "late"}
	if !errors.Is(dl, context.DeadlineExceeded) || errors.Is(busy, context.DeadlineExceeded) {
		t.Error("only DEADLINE_EXCEEDED matches context.DeadlineExceeded")
	}
	abandoned := fmt.Errorf("%w (%w)", &Error{Code: CodeCancelled, Message: "cancelled"}, context.DeadlineExceeded)
	for _, tc := range []struct {
		err  error
		want Code
	}{
		{nil, CodeOK},
		{wrapped, CodeBusy},
		{dl, CodeDeadlineExceeded},
		{abandoned, CodeDeadlineExceeded},
		{fmt.Errorf("x: %w", context.Canceled), CodeCancelled},
		{ErrClosed, CodeInternal},
		{errors.New("other"), CodeInternal},
	} {
		if got := CodeOf(tc.err); got != tc.want {
			t.Errorf("CodeOf(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
}

func TestSubmitMatchesFixture(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	if b := rt.Backend(); b != "cpu" {
		t.Errorf("Backend() = %q, want cpu", b)
	}
	m := loadModel(t, rt, nil)
	if m.Kind() != "mlp" || m.InputLen() != 4 || m.OutputLen() != 3 {
		t.Fatalf("model: kind %q, input %d, output %d; want mlp, 4, 3", m.Kind(), m.InputLen(), m.OutputLen())
	}
	for i, in := range f.Inputs {
		out, err := m.Submit(context.Background(), in)
		if err != nil {
			t.Fatalf("input %d: %v", i, err)
		}
		if !closeEnough(out, f.Outputs[i]) {
			t.Errorf("input %d: got %v, want %v", i, out, f.Outputs[i])
		}
	}
	// A deadline far away and a priority change nothing about the result.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	out, err := m.Submit(ctx, f.Inputs[0], WithPriority(5))
	if err != nil || !closeEnough(out, f.Outputs[0]) {
		t.Errorf("with deadline and priority: %v, %v", out, err)
	}
	s := stats(t, rt)
	n := uint64(len(f.Inputs) + 1)
	if s.Submitted != n || s.Completed[CodeOK] != n || s.CompletedTotal != n || s.InFlight != 0 || s.Rejected != 0 {
		t.Errorf("stats %+v, want %d submitted and completed OK", s, n)
	}
	checkExactlyOnce(t, rt)
}

func TestConcurrentSubmitsCompleteExactlyOnce(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, &ModelOptions{MaxBatch: 8, MaxWait: 200 * time.Microsecond, Workers: 2})
	const goroutines, perGoroutine = 8, 40
	var wg sync.WaitGroup
	errs := make(chan error, goroutines*perGoroutine)
	for g := range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			for range perGoroutine {
				i := rng.Intn(len(f.Inputs))
				out, err := m.Submit(context.Background(), f.Inputs[i], WithPriority(int32(rng.Intn(3))))
				switch {
				case err != nil:
					errs <- err
				case !closeEnough(out, f.Outputs[i]):
					errs <- fmt.Errorf("input %d: got %v, want %v", i, out, f.Outputs[i])
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	const n = goroutines * perGoroutine
	s := stats(t, rt)
	if s.Submitted != n || s.Completed[CodeOK] != n || s.CompletedTotal != n || s.InFlight != 0 || s.BatchedRequests != n {
		t.Errorf("stats %+v, want %d submitted, batched and completed OK", s, n)
	}
	checkExactlyOnce(t, rt)
}

func TestBadInputIsRejected(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	ctx := context.Background()
	rejectedByLibserve := []struct {
		name string
		call func() error
	}{
		{"nil input", func() error { _, err := m.Submit(ctx, nil); return err }},
		{"empty input", func() error { _, err := m.Submit(ctx, []float32{}); return err }},
		{"short input", func() error { _, err := m.Submit(ctx, []float32{1, 2, 3}); return err }},
		{"long input", func() error { _, err := m.Submit(ctx, []float32{1, 2, 3, 4, 5}); return err }},
		{"tokens to an mlp", func() error { _, err := m.SubmitTokens(ctx, []uint32{1, 2}); return err }},
		{"tree to an mlp", func() error { _, err := m.SubmitTree(ctx, []uint32{1, NoToken}, []int32{-1, 0}); return err }},
	}
	for _, tc := range rejectedByLibserve {
		err := tc.call()
		var e *Error
		if !errors.As(err, &e) || e.Code != CodeInvalidArgument || e.Message == "" || !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: got %v, want INVALID_ARGUMENT with a message", tc.name, err)
		}
	}
	// Checked in Go: libserve's tree call has one length for both arrays.
	if _, err := m.SubmitTree(ctx, []uint32{1, 2}, []int32{-1}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("tree with mismatched lengths: got %v, want INVALID_ARGUMENT", err)
	}
	// The runtime keeps serving.
	out, err := m.Submit(ctx, f.Inputs[1])
	if err != nil || !closeEnough(out, f.Outputs[1]) {
		t.Errorf("after bad input: %v, %v", out, err)
	}
	s := stats(t, rt)
	if s.Rejected != uint64(len(rejectedByLibserve)) || s.Submitted != 1 || s.Completed[CodeOK] != 1 {
		t.Errorf("stats %+v, want %d rejected and 1 submitted", s, len(rejectedByLibserve))
	}
	checkExactlyOnce(t, rt)
}

func TestLoadErrors(t *testing.T) {
	rt := newRuntime(t, nil)
	if _, err := rt.LoadModel(filepath.Join(t.TempDir(), "missing"), nil); !errors.Is(err, ErrNotFound) {
		t.Errorf("missing directory: got %v, want NOT_FOUND", err)
	}
	weights, err := os.ReadFile(filepath.Join(fixtureDir, "weights.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	for name, files := range map[string]map[string][]byte{
		"unknown kind":      {"model.toml": []byte("kind = \"bogus\"\n"), "weights.safetensors": weights},
		"truncated weights": {"model.toml": []byte("kind = \"mlp\"\n"), "weights.safetensors": weights[:len(weights)/2]},
	} {
		dir := t.TempDir()
		for file, data := range files {
			if err := os.WriteFile(filepath.Join(dir, file), data, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := rt.LoadModel(dir, nil); !errors.Is(err, ErrFormat) {
			t.Errorf("%s: got %v, want FORMAT", name, err)
		}
	}
	for name, opts := range map[string]*ModelOptions{
		"negative max batch": {MaxBatch: -1},
		"huge max batch":     {MaxBatch: 1 << 20},
		"negative wait":      {MaxWait: -time.Second},
		"negative bound":     {AdmissionBound: -1},
		"NUL in name":        {Name: "a\x00b"},
	} {
		if _, err := rt.LoadModel(fixtureDir, opts); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: got %v, want INVALID_ARGUMENT", name, err)
		}
	}
	if _, err := rt.LoadModel(fixtureDir+"\x00", nil); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("NUL in directory: got %v, want INVALID_ARGUMENT", err)
	}
	if _, err := NewRuntime(&RuntimeOptions{Backend: "tpu"}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("unknown backend: got %v, want INVALID_ARGUMENT", err)
	}
	if _, err := NewRuntime(&RuntimeOptions{CPUThreads: -1}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("negative threads: got %v, want INVALID_ARGUMENT", err)
	}
}

// submitAsync runs Submit in a goroutine; the channel gets its error.
func submitAsync(ctx context.Context, m *Model, in []float32) <-chan error {
	done := make(chan error, 1)
	go func() {
		_, err := m.Submit(ctx, in)
		done <- err
	}()
	return done
}

// await is the error from done, or a fatal error after 10 s.
func await(t *testing.T, done <-chan error) error {
	t.Helper()
	select {
	case err := <-done:
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Submit did not return within 10 s")
		return nil
	}
}

func TestCancelThroughContext(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, slowModel)
	ctx, cancel := context.WithCancel(context.Background())
	done := submitAsync(ctx, m, f.Inputs[0])
	waitFor(t, "the request to be queued", func() bool { return stats(t, rt).InFlight == 1 })
	start := time.Now()
	cancel()
	err := await(t, done)
	if !errors.Is(err, context.Canceled) || !errors.Is(err, ErrCancelled) || CodeOf(err) != CodeCancelled {
		t.Errorf("got %v, want context.Canceled wrapping CANCELLED", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("cancel took %v", d)
	}
	if s := stats(t, rt); s.Completed[CodeCancelled] != 1 || s.InFlight != 0 {
		t.Errorf("stats %+v, want one CANCELLED completion", s)
	}
	checkExactlyOnce(t, rt)
}

func TestContextDoneBeforeSubmit(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := m.Submit(ctx, f.Inputs[0])
	var e *Error
	if !errors.Is(err, context.Canceled) || errors.As(err, &e) {
		t.Errorf("got %v, want only context.Canceled", err)
	}
	if s := stats(t, rt); s.Submitted != 0 || s.Rejected != 0 {
		t.Errorf("stats %+v: nothing should reach libserve", s)
	}
}

func TestDeadlineFromContext(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, slowModel)
	const timeout = 50 * time.Millisecond
	start := time.Now() // before the deadline is set, so an on-time expiry is never "early"
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	_, err := m.Submit(ctx, f.Inputs[0])
	elapsed := time.Since(start)
	if !errors.Is(err, context.DeadlineExceeded) || !errors.Is(err, ErrDeadlineExceeded) || CodeOf(err) != CodeDeadlineExceeded {
		t.Errorf("got %v, want DEADLINE_EXCEEDED", err)
	}
	if elapsed < timeout || elapsed > 5*time.Second {
		t.Errorf("returned after %v, want just after %v", elapsed, timeout)
	}
	// libserve itself expired the request (the binding waits for that before cancelling).
	if s := stats(t, rt); s.Completed[CodeDeadlineExceeded] != 1 || s.InFlight != 0 {
		t.Errorf("stats %+v, want one DEADLINE_EXCEEDED completion", s)
	}
	checkExactlyOnce(t, rt)
}

// pastDeadline is a context whose deadline has passed but which is not done yet, as a context
// observed just before its timer fires.
type pastDeadline struct{ context.Context }

func (pastDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Second), true }

func TestDeadlinePassedAtSubmit(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	_, err := m.Submit(pastDeadline{context.Background()}, f.Inputs[0])
	if !errors.Is(err, ErrDeadlineExceeded) {
		t.Errorf("got %v, want DEADLINE_EXCEEDED", err)
	}
	if s := stats(t, rt); s.Rejected != 1 || s.Submitted != 0 {
		t.Errorf("stats %+v, want the submit refused", s)
	}
	checkExactlyOnce(t, rt)
}

func TestBusyWhenAdmissionBoundIsFull(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, &ModelOptions{MaxBatch: 32, MaxWait: 10 * time.Second, AdmissionBound: 1})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	first := submitAsync(ctx, m, f.Inputs[0])
	waitFor(t, "the first request to be admitted", func() bool { return stats(t, rt).InFlight == 1 })
	start := time.Now()
	_, err := m.Submit(context.Background(), f.Inputs[1])
	if !errors.Is(err, ErrBusy) || CodeOf(err) != CodeBusy {
		t.Errorf("second request: got %v, want BUSY", err)
	}
	if d := time.Since(start); d > 5*time.Second { // well below the 10 s batch timer
		t.Errorf("BUSY took %v; it should be immediate", d)
	}
	cancel()
	if err := await(t, first); !errors.Is(err, ErrCancelled) {
		t.Errorf("first request: got %v, want CANCELLED", err)
	}
	if s := stats(t, rt); s.Rejected != 1 || s.Submitted != 1 || s.Completed[CodeCancelled] != 1 {
		t.Errorf("stats %+v", s)
	}
	checkExactlyOnce(t, rt)
}

// A caller that has its result has its admission place back: with a bound of one, submits one
// after another are never refused BUSY. (The poller frees the completions, which hold the
// places, before it hands any result over; the other way round a caller's next submit could
// race the free, which is how an HTTP test once got 503.)
func TestResultReturnsTheAdmissionPlace(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, &ModelOptions{MaxBatch: 1, AdmissionBound: 1})
	for i := range 3000 {
		if _, err := m.Submit(context.Background(), f.Inputs[i%len(f.Inputs)]); err != nil {
			t.Fatalf("submit %d after the last one's result: %v", i, err)
		}
	}
	if s := stats(t, rt); s.Rejected != 0 {
		t.Errorf("stats %+v: nothing should be refused", s)
	}
	checkExactlyOnce(t, rt)
}

func TestShutdownCancelsPendingRequests(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, slowModel)
	const n = 5
	var dones []<-chan error
	for i := range n {
		dones = append(dones, submitAsync(context.Background(), m, f.Inputs[i%len(f.Inputs)]))
	}
	waitFor(t, "the requests to be queued", func() bool { return stats(t, rt).InFlight == n })
	if err := rt.Shutdown(0); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	for i, done := range dones {
		if err := await(t, done); !errors.Is(err, ErrCancelled) || CodeOf(err) != CodeCancelled {
			t.Errorf("request %d: got %v, want CANCELLED", i, err)
		}
	}
	if _, err := m.Submit(context.Background(), f.Inputs[0]); !errors.Is(err, ErrShutdown) {
		t.Errorf("submit after shutdown: got %v, want SHUTDOWN", err)
	}
	if _, err := rt.LoadModel(fixtureDir, nil); !errors.Is(err, ErrShutdown) {
		t.Errorf("load after shutdown: got %v, want SHUTDOWN", err)
	}
	if _, err := rt.Stats(); !errors.Is(err, ErrShutdown) {
		t.Errorf("stats after shutdown: got %v, want SHUTDOWN", err)
	}
	if b := rt.Backend(); b != "" {
		t.Errorf("Backend() after shutdown = %q", b)
	}
	if err := rt.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	checkExactlyOnce(t, rt)
	if rt.s.accepted.Load() != n {
		t.Errorf("accepted %d requests, want %d", rt.s.accepted.Load(), n)
	}
}

func TestShutdownDrainsPendingRequests(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, &ModelOptions{MaxBatch: 32, MaxWait: 100 * time.Millisecond})
	type got struct {
		out []float32
		err error
	}
	results := make([]chan got, len(f.Inputs))
	for i, in := range f.Inputs {
		results[i] = make(chan got, 1)
		go func() {
			out, err := m.Submit(context.Background(), in)
			results[i] <- got{out, err}
		}()
	}
	waitFor(t, "the requests to be queued", func() bool { return stats(t, rt).InFlight == uint64(len(f.Inputs)) })
	if err := rt.Shutdown(30 * time.Second); err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	for i, ch := range results {
		select {
		case r := <-ch:
			if r.err != nil || !closeEnough(r.out, f.Outputs[i]) {
				t.Errorf("input %d: got %v, %v; want %v", i, r.out, r.err, f.Outputs[i])
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("input %d: no result after a draining shutdown", i)
		}
	}
	checkExactlyOnce(t, rt)
}

func TestConcurrentCloseWithSubmitters(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	var wg sync.WaitGroup
	errs := make(chan error, 1000)
	for g := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 100 {
				out, err := m.Submit(context.Background(), f.Inputs[(g+i)%len(f.Inputs)])
				switch {
				case errors.Is(err, ErrShutdown):
					return
				case errors.Is(err, ErrCancelled):
				case err != nil:
					errs <- err
					return
				case !closeEnough(out, f.Outputs[(g+i)%len(f.Inputs)]):
					errs <- fmt.Errorf("wrong output %v", out)
					return
				}
			}
		}()
	}
	waitFor(t, "some requests to complete", func() bool { return rt.s.routed.Load() >= 20 })
	var closers sync.WaitGroup
	for range 4 {
		closers.Add(1)
		go func() {
			defer closers.Done()
			if err := rt.Shutdown(time.Second); err != nil {
				errs <- err
			}
		}()
	}
	closers.Wait()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	checkExactlyOnce(t, rt)
}

func TestRandomCancellationsCompleteExactlyOnce(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	// With 8 submitters a batch of 16 never fills: requests wait 2 ms in the queue, so cancels
	// and deadlines of 0-3 ms hit requests in every state: not yet submitted, queued, running
	// and completed.
	m := loadModel(t, rt, &ModelOptions{MaxBatch: 16, MaxWait: 2 * time.Millisecond})
	var wg sync.WaitGroup
	var ok, failed atomic.Int64
	errs := make(chan error, 1000)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(100 + g)))
			for range 40 {
				i := rng.Intn(len(f.Inputs))
				ctx, cancel := context.WithCancel(context.Background())
				wait := time.Duration(rng.Intn(3000)) * time.Microsecond
				deadline := false
				switch rng.Intn(3) {
				case 0: // cancelled after a while
					time.AfterFunc(wait, cancel)
				case 1: // a deadline
					ctx, cancel = context.WithTimeout(ctx, wait)
					deadline = true
				}
				out, err := m.Submit(ctx, f.Inputs[i])
				cancel()
				switch {
				case err == nil && !closeEnough(out, f.Outputs[i]):
					errs <- fmt.Errorf("input %d: got %v", i, out)
				case err == nil:
					ok.Add(1)
				case deadline && CodeOf(err) == CodeBusy:
					// Refused at submit: the work queued would not finish by its deadline.
					failed.Add(1)
				case ctx.Err() == nil:
					errs <- fmt.Errorf("failed although its context is live: %v", err)
				case CodeOf(err) != CodeCancelled && CodeOf(err) != CodeDeadlineExceeded:
					errs <- fmt.Errorf("unexpected error: %v", err)
				default:
					failed.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	s := stats(t, rt)
	t.Logf("%d succeeded, %d cancelled or expired; stats %+v", ok.Load(), failed.Load(), s)
	if ok.Load() == 0 || failed.Load() == 0 {
		t.Errorf("%d succeeded and %d failed: the mix should have both", ok.Load(), failed.Load())
	}
	if s.InFlight != 0 || s.CompletedTotal != s.Submitted || s.Submitted != rt.s.accepted.Load() {
		t.Errorf("stats %+v, accepted %d: every accepted request must complete once", s, rt.s.accepted.Load())
	}
	checkExactlyOnce(t, rt)
}

func TestModelClose(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				out, err := m.Submit(context.Background(), f.Inputs[0])
				if errors.Is(err, ErrClosed) {
					return
				}
				if err != nil || !closeEnough(out, f.Outputs[0]) {
					errs <- fmt.Errorf("%v, %v", out, err)
					return
				}
			}
		}()
	}
	waitFor(t, "some requests to complete", func() bool { return rt.s.routed.Load() >= 10 })
	m.Close()
	m.Close()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if _, err := m.Submit(context.Background(), f.Inputs[0]); !errors.Is(err, ErrClosed) {
		t.Errorf("after Close: got %v, want ErrClosed", err)
	}
	// The runtime still serves other models.
	m2 := loadModel(t, rt, nil)
	if out, err := m2.Submit(context.Background(), f.Inputs[2]); err != nil || !closeEnough(out, f.Outputs[2]) {
		t.Errorf("second model: %v, %v", out, err)
	}
	checkExactlyOnce(t, rt)
}

func TestModelOutlivesRuntime(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	if err := rt.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Submit(context.Background(), f.Inputs[0]); !errors.Is(err, ErrShutdown) {
		t.Errorf("got %v, want SHUTDOWN", err)
	}
	if m.Kind() != "mlp" {
		t.Errorf("Kind() = %q", m.Kind())
	}
	m.Close()
}

func TestCleanupReleasesAbandonedObjects(t *testing.T) {
	runtime.GC()
	baseRuntimes, baseModels := liveRuntimes.Load(), liveModels.Load()
	f := loadFixture(t)
	func() {
		rt, err := NewRuntime(&RuntimeOptions{Backend: "cpu", CPUThreads: 1})
		if err != nil {
			t.Fatal(err)
		}
		m, err := rt.LoadModel(fixtureDir, nil)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := m.Submit(context.Background(), f.Inputs[0]); err != nil {
			t.Fatal(err)
		}
	}()
	if liveRuntimes.Load() != baseRuntimes+1 || liveModels.Load() != baseModels+1 {
		t.Fatalf("live runtimes %d, models %d; want %d, %d", liveRuntimes.Load(), liveModels.Load(), baseRuntimes+1, baseModels+1)
	}
	waitFor(t, "cleanups to release the abandoned runtime and model", func() bool {
		runtime.GC()
		return liveRuntimes.Load() == baseRuntimes && liveModels.Load() == baseModels
	})
}

func TestRawPathBaseline(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	m := loadModel(t, rt, nil)
	raw, err := newRawPath()
	if err != nil {
		t.Fatal(err)
	}
	defer raw.close()
	out := make([]float32, m.OutputLen())
	for i, in := range f.Inputs {
		if err := raw.roundTrip(m, in, out); err != nil {
			t.Fatal(err)
		}
		if !closeEnough(out, f.Outputs[i]) {
			t.Errorf("input %d: got %v, want %v", i, out, f.Outputs[i])
		}
	}
}

// TestElasticAndAdaptivePolicies: the fixed-shape policies of issue 15 through ModelOptions,
// concurrent submits (within the ring), every output checked; bad settings are invalid.
func TestElasticAndAdaptivePolicies(t *testing.T) {
	f := loadFixture(t)
	rt := newRuntime(t, nil)
	for name, opts := range map[string]*ModelOptions{
		"nebird": {Policy: PolicyElastic, ElasticWorkers: []int{1, 2, 4}, MaxInflight: 4, RingSlots: 64},
		"eebird": {Policy: PolicyElastic, EngineConfigs: map[int][]int{4: {2, 2}, 8: {4, 4}}, MaxInflight: 8},
		"serial": {Policy: PolicyAdaptive, LatencyBound: 20 * time.Millisecond, Streams: 1, MaxBatch: 8},
		"async":  {Policy: PolicyAdaptive, LatencyBound: 20 * time.Millisecond, MaxBatch: 8},
	} {
		t.Run(name, func(t *testing.T) {
			m := loadModel(t, rt, opts)
			var wg sync.WaitGroup
			for i := 0; i < 40; i++ {
				wg.Add(1)
				go func(k int) {
					defer wg.Done()
					out, err := m.Submit(context.Background(), f.Inputs[k])
					if err != nil || !closeEnough(out, f.Outputs[k]) {
						t.Errorf("input %d: %v, %v", k, out, err)
					}
				}(i % len(f.Inputs))
			}
			wg.Wait()
		})
	}
	// The two elastic models copied each input once into their rings; the adaptive ones
	// gathered each row at launch.
	if st, err := rt.Stats(); err != nil || st.RingCopies != 80 || st.GatherCopies != 80 {
		t.Errorf("ring copies %d, gather copies %d (want 80, 80): %v", st.RingCopies, st.GatherCopies, err)
	}
	for name, opts := range map[string]*ModelOptions{
		"no workers":            {Policy: PolicyElastic, ElasticWorkers: []int{}},
		"zero worker size":      {Policy: PolicyElastic, ElasticWorkers: []int{1, 0}},
		"no bs-1 worker":        {Policy: PolicyElastic, ElasticWorkers: []int{2, 4}},
		"config sum":            {Policy: PolicyElastic, EngineConfigs: map[int][]int{8: {4, 2}}},
		"three streams":         {Policy: PolicyAdaptive, Streams: 3},
		"negative bound":        {Policy: PolicyAdaptive, LatencyBound: -time.Millisecond},
		"bound under elastic":   {Policy: PolicyElastic, LatencyBound: time.Millisecond},
		"ring under timeout":    {Policy: PolicyTimeout, RingSlots: 8},
		"max batch for elastic": {Policy: PolicyElastic, MaxBatch: 8},
	} {
		if _, err := rt.LoadModel(fixtureDir, opts); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%s: got %v, want INVALID_ARGUMENT", name, err)
		}
	}
}
