// Package libserve is an idiomatic Go binding of libserve, the scheduling core of a deep-learning
// inference server, through its C ABI (include/libserve.h).
//
// A Runtime owns a libserve runtime (backend, engine and poller threads) and one completion
// queue. LoadModel returns a Model; Model.Submit sends one request and blocks until its output
// arrives, its context ends, or the runtime shuts down:
//
//	rt, err := libserve.NewRuntime(&libserve.RuntimeOptions{Backend: "cpu"})
//	if err != nil { ... }
//	defer rt.Close()
//	m, err := rt.LoadModel("my-mlp", nil)
//	if err != nil { ... }
//	defer m.Close()
//	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
//	defer cancel()
//	y, err := m.Submit(ctx, []float32{0.5, -1, 2, 0})
//	switch {
//	case errors.Is(err, libserve.ErrBusy): // admission bound full: retry later, or shed load
//	case errors.Is(err, context.DeadlineExceeded): // the context's deadline passed
//	case err != nil: // *libserve.Error (possibly wrapped): see CodeOf
//	}
//
// # Recurrent models
//
// Sequence and tree models (kinds lstm, seq2seq and treelstm) load the same way and are served
// with cellular batching by default; ModelOptions.Policy chooses PolicyCellular or the padding
// baseline PolicyPadding (PolicyTimeout is for mlp only: a policy that does not fit the kind
// fails LoadModel with CodeUnsupported). SubmitTokens takes a token sequence and returns an
// Output whose F32 field is set for lstm (the final hidden state) and whose Tokens field is set
// for seq2seq (the decoded ids); SubmitTree takes a treelstm's tokens and parent indices (-1 for
// the root, NoToken for a node without input) and returns the root's hidden state:
//
//	m, err := rt.LoadModel("my-seq2seq", &libserve.ModelOptions{Policy: libserve.PolicyCellular, Workers: 2})
//	...
//	out, err := m.SubmitTokens(ctx, []uint32{28, 21})  // out.Tokens: []uint32
//	h, err := tree.SubmitTree(ctx, []uint32{7, libserve.NoToken, 3}, []int32{1, -1, 1})
//
// A token outside the vocabulary, an empty sequence or a malformed tree (two roots, a cycle, a
// parent out of range, tokens and parents of different lengths) is CodeInvalidArgument at submit.
//
// # Concurrency
//
// Runtime and Model are safe for concurrent use by any number of goroutines. Each Runtime runs
// one poller goroutine that waits in serve_queue_next and routes every completion, by a Go-side
// tag, to a buffered channel the submitting goroutine waits on. libserve never calls back into
// Go, and no Go pointer is stored in C memory: inputs are passed for the duration of the submit
// call only (libserve copies them) and outputs are copied out of the completion before it is
// freed.
//
// # Waiting for results
//
// A Submit blocked on its channel is made runnable by the poller, and while a processor (P) is
// idle the Go scheduler then also wakes an idle OS thread, which costs the poller microseconds
// per result (a halted virtual CPU to wake, on a VM). So a Submit that is its runtime's only
// waiting one (with GOMAXPROCS >= 2) first busy-waits for its result, yielding its CPU to other
// threads between polls, for up to twice its model's recent mean wait and at most
// RuntimeOptions.SpinWait (DefaultSpinWait, 200 µs), and only then blocks. This trades CPU for
// latency: a lone sequential caller keeps a CPU busy while its request runs. Models whose
// requests take longer than SpinWait never spin; a negative SpinWait turns spinning off.
//
// # Cancellation and deadlines
//
// A context deadline is handed to libserve as the request's deadline, so an expired request
// completes with CodeDeadlineExceeded inside libserve; cancelling the context cancels the
// request (serve_runtime_cancel). Either way Submit still waits for the request's single
// completion, so nothing is leaked, and returns the output if it won the race, otherwise an
// error wrapping both ctx.Err() and libserve's *Error.
//
// # Lifetime
//
// Close a Model and then its Runtime when done. Runtime.Close shuts the runtime down (pending
// requests drain for up to a timeout, the rest complete with CodeCancelled), stops the poller and
// frees the C objects; it is idempotent and safe to call from several goroutines. Cleanups
// (runtime.AddCleanup) release a Runtime or Model that becomes unreachable without Close, as a
// safety net only.
//
// # Building
//
// By default the package links the static library of the checkout it lives in
// (target/release/libserve.a: run `cargo build --release` first). Build with
// `-tags libserve_pkgconfig` to link an installed libserve found through pkg-config instead.
package libserve
