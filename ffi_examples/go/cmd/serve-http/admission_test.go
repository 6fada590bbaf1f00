package main

import (
	"testing"
	"time"
)

// virtualServer drives an admission on virtual time with one FIFO server of a fixed service
// time: exact, no sleeping.
type virtualServer struct {
	a       *admission
	now     time.Time
	service time.Duration
	free    time.Time // when the server has finished everything admitted so far
	pending []virtualRequest
}

type virtualRequest struct {
	t        ticket
	arrival  time.Time
	finishes time.Time
}

func newVirtualServer(target time.Duration, maxPending, floor int, service time.Duration) *virtualServer {
	v := &virtualServer{a: newAdmission(target, maxPending, floor), now: time.Unix(1000, 0), service: service}
	v.a.now = func() time.Time { return v.now }
	v.free = v.now
	return v
}

// arrive completes what finishes by t, then offers a request at t; it says whether the request
// was admitted.
func (v *virtualServer) arrive(t time.Time) bool {
	for len(v.pending) > 0 && !v.pending[0].finishes.After(t) {
		r := v.pending[0]
		v.pending = v.pending[1:]
		v.now = r.finishes
		v.a.done(r.t, true)
	}
	v.now = t
	if v.a.enter(time.Hour) != nil {
		return false
	}
	tk := v.a.submitted()
	v.free = maxTime(v.free, t).Add(v.service)
	v.pending = append(v.pending, virtualRequest{t: tk, arrival: t, finishes: v.free})
	return true
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// At twice the capacity, about half the requests are admitted and every admitted one finishes
// within the target (plus one service time, the prediction's granularity).
func TestAdmissionKeepsAdmittedWithinTarget(t *testing.T) {
	const service, target = 10 * time.Millisecond, 200 * time.Millisecond
	v := newVirtualServer(target, 1<<20, 4, service)
	start := v.now
	admitted, offered := 0, 0
	var worst time.Duration
	for i := range 4000 { // 20 s at 200/s
		at := start.Add(time.Duration(i) * 5 * time.Millisecond)
		if v.arrive(at) {
			r := v.pending[len(v.pending)-1]
			if at.Sub(start) > time.Second { // after the cold start
				worst = max(worst, r.finishes.Sub(r.arrival))
			}
			admitted++
		}
		offered++
	}
	t.Logf("admitted %d of %d, worst latency after the first second %v", admitted, offered, worst)
	if worst > target+service {
		t.Errorf("an admitted request took %v, want at most %v", worst, target+service)
	}
	if share := float64(admitted) / float64(offered); share < 0.45 || share > 0.6 {
		t.Errorf("admitted %d of %d at twice the capacity, want about half", admitted, offered)
	}
}

// A cold server admits a first burst larger than the floor; a server that never completes
// anything stops admitting beyond the floor once it has been busy for the target.
func TestAdmissionColdStartAndStall(t *testing.T) {
	const target = time.Second
	v := newVirtualServer(target, 1<<20, 4, time.Hour) // nothing completes
	for i := range 100 {
		if !v.arrive(v.now) {
			t.Fatalf("cold burst: request %d refused", i)
		}
	}
	v.now = v.now.Add(target)
	if v.arrive(v.now) {
		t.Error("a server that completed nothing for the target admitted more")
	}
}

// The hard cap holds whatever the prediction, and requests whose bodies are being read count.
func TestAdmissionHardCap(t *testing.T) {
	a := newAdmission(time.Hour, 3, 10)
	for i := range 3 {
		if err := a.enter(time.Hour); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if a.enter(time.Hour) == nil {
		t.Error("admitted beyond the hard cap")
	}
	a.abandon()
	if err := a.enter(time.Hour); err != nil {
		t.Errorf("refused after a place freed: %v", err)
	}
}
