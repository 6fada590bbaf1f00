package libserve

import (
	"runtime"
	"time"
)

// How a Submit waits for its result.
//
// The poller goroutine hands each result to its Submit through a buffered channel. If the Submit
// is blocked on that channel, the send makes it runnable, and while any processor (P) is idle the
// Go scheduler also wakes an idle OS thread for it (runtime.wakep, a futex wake), in the poller,
// before the poller yields its own thread to the Submit. With GOMAXPROCS >= 2 and a single
// waiting Submit a P is always idle (the Submit's own), so every round trip paid that wake: 7–11 µs
// on a 2-vCPU KVM guest, where waking a thread means waking a halted virtual CPU. The Submit then
// ran on the poller's thread anyway; the woken thread found nothing to do.
//
// A Submit that has not blocked yet when its result arrives takes it without being woken. So a
// Submit first busy-waits: it polls its channel and yields its OS thread between polls
// (sched_yield, so libserve's threads run at once if the kernel put them on the same CPU), for at
// most twice the model's recent mean wait, capped at RuntimeOptions.SpinWait. It spins only while
// it is the runtime's only waiting Submit (with more, the Ps are busy delivering and resubmitting,
// and a spinner would hold one of them; at most one CPU per runtime spins), never with
// GOMAXPROCS = 1 (the poller needs the other P), and never for a model whose requests usually take
// longer than SpinWait. Then it blocks on the channel. The yield is a raw system call: the
// goroutine keeps its P while it spins.
//
// The cost is CPU: a spinning Submit keeps one CPU busy for up to its whole wait.

// DefaultSpinWait is the longest a Submit busy-waits for its result before blocking on it, unless
// RuntimeOptions.SpinWait says otherwise; a model whose requests take longer on average never
// spins.
const DefaultSpinWait = 200 * time.Microsecond

// wait waits for the result on ch, busy-waiting first when that pays (see above). It returns
// false, having taken nothing from ch, if done (the context's Done channel) is closed first.
func (s *runtimeState) wait(ms *modelState, ch <-chan result, done <-chan struct{}) (result, bool) {
	start := time.Now()
	waiting := s.waiting.Add(1)
	defer s.waiting.Add(-1)
	res, ok := s.spin(ms, ch, waiting, done, start)
	if !ok {
		select {
		case res = <-ch:
		case <-done:
			return result{}, false
		}
	}
	ms.observeWait(time.Since(start))
	return res, true
}

// spin polls ch, yielding the OS thread between polls, until the result arrives, done is
// closed, the model's spin budget from start is spent, or another Submit waits too. waiting
// counts the Submits waiting, this one included.
func (s *runtimeState) spin(ms *modelState, ch <-chan result, waiting int32, done <-chan struct{}, start time.Time) (result, bool) {
	procs := s.procs.Load()
	if !canYield || waiting > 1 || procs < 2 {
		return result{}, false
	}
	budget := ms.spinBudget(s.maxSpin)
	if budget <= 0 {
		return result{}, false
	}
	for i := 1; ; i++ {
		select {
		case res := <-ch:
			s.spun.Add(1)
			return res, true
		case <-done:
			return result{}, false
		default:
		}
		if time.Since(start) >= budget || s.waiting.Load() > 1 {
			return result{}, false
		}
		osYield()
		// With two Ps, this Submit and the poller (waiting in C) hold both: goroutines made
		// runnable meanwhile, such as other Submits about to submit, would wait for the spin to
		// end. Let them run now and then; with no P idle, Gosched wakes no thread. With more Ps
		// they run on idle ones, and Gosched would wake idle threads for nothing.
		if procs == 2 && i%8 == 0 {
			runtime.Gosched()
		}
	}
}

// spinBudget is how long a Submit to the model may busy-wait: twice its mean wait, at most
// limit; nothing before the first wait was measured or when the mean exceeds limit.
func (ms *modelState) spinBudget(limit time.Duration) time.Duration {
	mean := time.Duration(ms.meanWait.Load())
	if limit <= 0 || mean <= 0 || mean > limit {
		return 0
	}
	return min(2*mean, limit)
}

// observeWait folds one request's wait (submit to result) into the model's mean wait, an
// exponential moving average with weight 1/8. Concurrent updates may lose one: it is a hint.
func (ms *modelState) observeWait(d time.Duration) {
	d = max(d, 1)
	old := ms.meanWait.Load()
	if old == 0 {
		ms.meanWait.Store(int64(d))
		return
	}
	ms.meanWait.Store(old + (int64(d)-old)/8)
}
