package libserve

import (
	"context"
	"errors"
	"runtime"
	"testing"
	"time"
)

func TestSpinBudget(t *testing.T) {
	var ms modelState
	if b := ms.spinBudget(DefaultSpinWait); b != 0 {
		t.Errorf("no wait measured yet: budget %v, want 0", b)
	}
	ms.observeWait(40 * time.Microsecond)
	if b := ms.spinBudget(DefaultSpinWait); b != 80*time.Microsecond {
		t.Errorf("mean 40µs: budget %v, want 80µs", b)
	}
	if b := ms.spinBudget(0); b != 0 {
		t.Errorf("spinning disabled: budget %v, want 0", b)
	}
	ms.observeWait(40*time.Microsecond + 8*time.Microsecond) // mean moves by 1/8 of the difference
	if got := time.Duration(ms.meanWait.Load()); got != 41*time.Microsecond {
		t.Errorf("mean %v, want 41µs", got)
	}
	ms.meanWait.Store(int64(150 * time.Microsecond))
	if b := ms.spinBudget(DefaultSpinWait); b != DefaultSpinWait {
		t.Errorf("mean 150µs: budget %v, want the cap %v", b, DefaultSpinWait)
	}
	ms.meanWait.Store(int64(DefaultSpinWait + 1))
	if b := ms.spinBudget(DefaultSpinWait); b != 0 {
		t.Errorf("mean above the cap: budget %v, want 0", b)
	}
}

func TestSpinWaitOption(t *testing.T) {
	for _, c := range []struct {
		opt, want time.Duration
	}{{0, DefaultSpinWait}, {-1, 0}, {time.Millisecond, time.Millisecond}} {
		rt := newRuntime(t, &RuntimeOptions{SpinWait: c.opt})
		if got := rt.s.maxSpin; got != c.want {
			t.Errorf("SpinWait %v: spins up to %v, want %v", c.opt, got, c.want)
		}
	}
}

// withProcs runs the test with GOMAXPROCS = n, so that Submit may spin (it needs two).
func withProcs(t *testing.T, n int) {
	old := runtime.GOMAXPROCS(n)
	t.Cleanup(func() { runtime.GOMAXPROCS(old) })
}

// Sequential submits spin for their results (one waiter, two Ps, a fast model) and get them right.
func TestSpinningSubmitsMatchFixture(t *testing.T) {
	if !canYield {
		t.Skip("no busy-waiting on this platform")
	}
	withProcs(t, 2)
	f := loadFixture(t)
	// A generous cap, so that slow test machines (or the race detector) still spin.
	rt := newRuntime(t, &RuntimeOptions{SpinWait: 10 * time.Millisecond})
	m := loadModel(t, rt, nil)
	for i := range 200 {
		k := i % len(f.Inputs)
		got, err := m.Submit(context.Background(), f.Inputs[k])
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		if !closeEnough(got, f.Outputs[k]) {
			t.Fatalf("request %d: got %v, want %v", i, got, f.Outputs[k])
		}
	}
	if rt.s.spun.Load() == 0 {
		t.Errorf("no Submit got its result while spinning (mean wait %v)", time.Duration(m.s.meanWait.Load()))
	}
	checkExactlyOnce(t, rt)
}

// A spinning Submit still notices its context ending: with a budget of an hour it would
// otherwise spin past await's patience.
func TestSpinningSubmitHonoursCancel(t *testing.T) {
	if !canYield {
		t.Skip("no busy-waiting on this platform")
	}
	withProcs(t, 2)
	f := loadFixture(t)
	rt := newRuntime(t, &RuntimeOptions{SpinWait: time.Hour})
	m := loadModel(t, rt, slowModel)
	m.s.meanWait.Store(int64(time.Hour / 2)) // spin budget: an hour
	ctx, cancel := context.WithCancel(context.Background())
	done := submitAsync(ctx, m, f.Inputs[0])
	waitFor(t, "the request to be queued", func() bool { return stats(t, rt).InFlight == 1 })
	cancel()
	if err := await(t, done); !errors.Is(err, context.Canceled) || !errors.Is(err, ErrCancelled) {
		t.Errorf("got %v, want context.Canceled wrapping CANCELLED", err)
	}
	checkExactlyOnce(t, rt)
}
