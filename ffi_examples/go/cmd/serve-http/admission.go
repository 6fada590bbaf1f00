package main

import (
	"fmt"
	"math"
	"sync"
	"time"
)

// Admission control: the server sheds a request with 503 at once, before reading its body, when
// it predicts that the request would not be answered within its QoS target, so that under
// overload the requests it admits keep their latency instead of all of them waiting in queues
// until their deadline.
//
// The prediction is Little's law on what the server measures of itself:
//
//	wait = pending / rate + service
//
// where pending is the requests admitted and not yet completed (including those whose bodies
// are still being read), rate the server's departure rate — successful completions per second of
// busy time (time with at least one request submitted), an EWMA over windows of busy time — and
// service the latency of a request that found the server idle (an EWMA). A request is admitted
// when wait fits in its target (the QoS target, or its own shorter timeout), or whatever the
// prediction when fewer than floor requests are pending (a stalled server keeps probing with a
// few); never when pending has reached the hard cap maxPending. A cold server, whose first rate
// window has not closed yet, admits while it has been busy for less than the target.
//
// Measuring the rate over busy time makes it the capacity when the server is saturated, and
// the observed latency divided by the concurrency otherwise, so the prediction follows what the
// server actually achieves; a stall (no completions while requests are submitted) decays the
// rate window by window, so a stalled server sheds instead of queueing.
type admission struct {
	target     time.Duration // the QoS target
	maxPending int           // the hard cap on admitted requests
	floor      int           // admitted regardless of the prediction below this many pending
	now        func() time.Time

	mu      sync.Mutex
	reading int // admitted, body not yet read or not yet submitted
	queued  int // submitted to the model, not yet completed
	last    time.Time
	winBusy time.Duration // busy time of the current rate window
	winDone int           // successful completions in it
	rate    float64       // departures per busy second (EWMA); 0 = not measured yet
	service float64       // seconds (EWMA); 0 = not measured yet

	admitted, shed uint64 // requests admitted and refused by enter, for the metrics
}

// Rate windows: a window closes after rateWindowMin of busy time holding at least
// rateWindowDone completions, or after rateWindowMax of busy time whatever it holds (a stall
// folds in a zero); rateAlpha is the EWMA weight of a closed window and serviceAlpha that of a
// service-time sample.
const (
	rateWindowMin  = 50 * time.Millisecond
	rateWindowMax  = 500 * time.Millisecond
	rateWindowDone = 8
	rateAlpha      = 0.25
	serviceAlpha   = 0.1
)

func newAdmission(target time.Duration, maxPending, floor int) *admission {
	return &admission{target: target, maxPending: maxPending, floor: floor, now: time.Now}
}

// ticket is an admitted request.
type ticket struct {
	start time.Time // when it was submitted
	idle  bool      // nothing else was submitted then: its latency is the service time
}

// advance accounts busy time up to now and closes the rate window when it is due. Holds mu.
func (a *admission) advance(now time.Time) {
	if a.queued > 0 && now.After(a.last) {
		a.winBusy += now.Sub(a.last)
	}
	a.last = now
	if !(a.winBusy >= rateWindowMin && a.winDone >= rateWindowDone) && a.winBusy < rateWindowMax {
		return
	}
	if a.rate == 0 && a.winDone < rateWindowDone {
		return // cold: the first window runs on until it holds enough completions
	}
	sample := float64(a.winDone) / a.winBusy.Seconds()
	if a.rate == 0 {
		a.rate = sample
	} else {
		// A window stretched over several rateWindowMax (events were rare: a stall, or a
		// slow model under little load) weighs as that many windows.
		keep := math.Pow(1-rateAlpha, max(1, float64(a.winBusy/rateWindowMax)))
		a.rate = keep*a.rate + (1-keep)*sample
	}
	a.winBusy, a.winDone = 0, 0
}

// enter admits a request whose answer is due within target (the smaller of the QoS target and
// the request's timeout), or says why not. An admitted request must then call submitted or
// abandon.
func (a *admission) enter(target time.Duration) error {
	target = min(target, a.target)
	a.mu.Lock()
	defer a.mu.Unlock()
	err := a.decide(target)
	if err != nil {
		a.shed++
	} else {
		a.admitted++
		a.reading++
	}
	return err
}

// decide is enter's decision. Holds mu.
func (a *admission) decide(target time.Duration) error {
	a.advance(a.now())
	pending := a.reading + a.queued
	if pending >= a.maxPending {
		return fmt.Errorf("overloaded: %d requests in progress, the most this server admits", pending)
	}
	if pending >= a.floor {
		rate := a.rate
		if rate == 0 {
			// Cold: the first window is still open. Admit while the server has been busy for
			// less than the target (a first burst is not refused for want of a measurement,
			// nor judged on its first few completions); then judge by what completed.
			if a.winBusy < target {
				return nil
			}
			if a.winDone == 0 {
				return fmt.Errorf("overloaded: %d requests in progress and none completed in %v", pending, a.winBusy.Round(time.Millisecond))
			}
			rate = float64(a.winDone) / a.winBusy.Seconds()
		}
		wait := time.Duration((float64(pending)/rate + a.service) * float64(time.Second))
		if wait > target {
			return fmt.Errorf("overloaded: predicted latency %v (%d requests in progress at %.0f/s) exceeds the target %v",
				wait.Round(time.Millisecond), pending, rate, target)
		}
	}
	return nil
}

// admissionCounters is what the metrics expose of an admission.
type admissionCounters struct {
	admitted, shed uint64  // requests admitted and shed so far
	pending        int     // admitted, not yet completed (bodies being read included)
	rate           float64 // the measured departure rate, per busy second; 0 until measured
}

func (a *admission) counters() admissionCounters {
	a.mu.Lock()
	defer a.mu.Unlock()
	return admissionCounters{admitted: a.admitted, shed: a.shed, pending: a.reading + a.queued, rate: a.rate}
}

// abandon releases a request admitted by enter that will not be submitted (a bad body).
func (a *admission) abandon() {
	a.mu.Lock()
	a.reading--
	a.mu.Unlock()
}

// submitted moves a request admitted by enter to the model.
func (a *admission) submitted() ticket {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	a.advance(now)
	t := ticket{start: now, idle: a.queued == 0}
	a.reading--
	a.queued++
	return t
}

// done completes a submitted request; served says it succeeded (only successes count as
// departures: a failing backend must not look fast).
func (a *admission) done(t ticket, served bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	a.advance(now)
	a.queued--
	if !served {
		return
	}
	a.winDone++
	if t.idle {
		s := now.Sub(t.start).Seconds()
		if a.service == 0 {
			a.service = s
		} else {
			a.service += serviceAlpha * (s - a.service)
		}
	}
}
