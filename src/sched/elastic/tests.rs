//! E²bird's acceptance checks that are scheduler logic (spec E2, E3, E5 and the ring of E1), on
//! virtual time.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::sched::{Launch, drain};

fn us(v: u64) -> Time {
    Time::from_micros(v)
}

fn n_ebird() -> ElasticPolicy {
    ElasticPolicy::new(ElasticConfig::default()).unwrap()
}

fn launches(d: &[Decision]) -> Vec<&Launch> {
    d.iter()
        .filter_map(|d| match d {
            Decision::Launch(l) => Some(l),
            _ => None,
        })
        .collect()
}

/// `n` requests arrive (ids from `first`), then their inputs land last to first, so that the
/// whole run becomes ready at once (an in-order copy stream: the first slot gates the rest).
fn arrive_ready_together(p: &mut ElasticPolicy, now: Time, first: RequestId, n: u64) -> Vec<Decision> {
    for id in first..first + n {
        p.arrive(now, Arrival::fixed(id));
    }
    assert!(drain(p).is_empty(), "nothing launches before the first input has landed");
    for id in (first..first + n).rev() {
        p.input_ready(now, id);
    }
    drain(p)
}

/// E3: all workers idle and R ready: the greedy split over [16, 8, 4, 2, 1, 1] is R's binary
/// decomposition (13 → 8, 4, 1; 32 → all six workers), every launch exactly full, in slot order.
#[test]
fn greedy_split_is_the_binary_decomposition() {
    for r in 1..=32u64 {
        let mut p = n_ebird();
        let d = arrive_ready_together(&mut p, us(0), 0, r);
        let ls = launches(&d);
        let sizes: Vec<usize> = ls.iter().map(|l| l.batch).collect();
        let mut want = Vec::new();
        let mut left = r as usize;
        for bs in [16, 8, 4, 2, 1, 1] {
            if left >= bs {
                want.push(bs);
                left -= bs;
            }
        }
        assert_eq!(sizes, want, "R = {r}");
        let ids: Vec<RequestId> = ls.iter().flat_map(|l| l.requests.iter().copied()).collect();
        assert_eq!(ids, (0..r).collect::<Vec<_>>(), "R = {r}: slots in arrival order");
        for l in &ls {
            assert_eq!(l.batch, l.requests.len());
            assert_eq!(p.config().workers[l.worker], l.batch, "a launch fills its worker");
        }
        if r == 13 {
            assert_eq!(sizes, [8, 4, 1]);
        }
        if r == 32 {
            assert_eq!(ls.len(), 6);
        }
    }
}

/// No timer: a lone request runs at once on a batch-1 worker, and nothing asks for a wakeup.
#[test]
fn a_lone_request_never_waits_for_a_batch() {
    let mut p = n_ebird();
    p.arrive(us(5), Arrival::fixed(7));
    p.input_ready(us(6), 7);
    let d = drain(&mut p);
    assert_eq!(launches(&d).len(), 1);
    assert_eq!(launches(&d)[0].batch, 1);
    assert_eq!(p.next_wakeup(), None);
    p.task_done(us(9), &TaskReport::of(launches(&d)[0].task));
    assert_eq!(drain(&mut p), vec![Decision::Complete { id: 7, code: Code::Ok }]);
}

/// A slot's input that has not landed holds back the slots after it (in-order copies).
#[test]
fn a_batch_waits_only_for_its_last_slots_input() {
    let mut p = n_ebird();
    for id in 0..3 {
        p.arrive(us(0), Arrival::fixed(id));
    }
    p.input_ready(us(1), 1);
    p.input_ready(us(1), 2);
    assert!(drain(&mut p).is_empty(), "slot 0 gates 1 and 2");
    p.input_ready(us(2), 0);
    let d = drain(&mut p);
    let sizes: Vec<usize> = launches(&d).iter().map(|l| l.batch).collect();
    assert_eq!(sizes, [2, 1]);
}

/// The ring: a request arriving while its slot holds an unanswered one is refused BUSY at once;
/// the slot is reusable once its batch is answered; a batch never wraps past the ring's end.
#[test]
fn a_full_ring_refuses_at_once_and_batches_never_wrap() {
    let cfg = ElasticConfig { workers: vec![4, 2, 1], max_inflight: 4, ring_slots: 6, ..Default::default() };
    let mut p = ElasticPolicy::new(cfg).unwrap();
    // Slots 0..6 taken, all ready: 0..4 run on the bs-4 worker (MaxInf 4), 4 and 5 wait.
    let d = arrive_ready_together(&mut p, us(0), 0, 6);
    let ls = launches(&d);
    assert_eq!((ls.len(), ls[0].batch), (1, 4));
    let first = ls[0].task;
    p.arrive(us(1), Arrival::fixed(6));
    assert_eq!(
        drain(&mut p),
        vec![Decision::Reject { id: 6, code: Code::Busy, reason: RING_FULL }],
        "ring full"
    );
    assert_eq!((p.queued(), p.running()), (2, 4));
    // The batch is answered: slots 0..4 free. 4 and 5 run (2 slots left before the ring's end:
    // the bs-4 worker would wrap), new arrivals take the freed slots.
    p.task_done(us(2), &TaskReport::of(first));
    let d = drain(&mut p);
    let ls = launches(&d);
    assert_eq!(ls.iter().map(|l| l.batch).collect::<Vec<_>>(), [2]);
    assert_eq!(ls[0].requests, [4, 5]);
    assert_eq!(d.iter().filter(|d| matches!(d, Decision::Complete { code: Code::Ok, .. })).count(), 4);
    let d = arrive_ready_together(&mut p, us(3), 10, 2);
    let ls = launches(&d);
    // R = min(2 ready, MaxInf 4 − 2 running) = 2; the idle workers are bs 4 (too large) and
    // bs 1: one runs now, the other when a worker frees up. The new requests took slots 0, 1.
    assert_eq!(ls.iter().map(|l| l.batch).collect::<Vec<_>>(), [1]);
    assert_eq!(ls[0].requests, [10]);
    assert_eq!(p.tasks[&ls[0].task].first % 6, 0, "the ring wrapped to slot 0");
}

/// Cancel and deadline of a request whose input is in the ring: it completes at once, its slot
/// is passed over at DevPtr, or computed as a padding row inside a launched run.
#[test]
fn cancel_and_deadline_in_the_ring() {
    let mut p = n_ebird();
    for id in 0..4 {
        let mut a = Arrival::fixed(id);
        if id == 2 {
            a.deadline = Some(us(10));
        }
        p.arrive(us(0), a);
    }
    p.cancel(us(1), 0);
    assert_eq!(drain(&mut p), vec![Decision::Complete { id: 0, code: Code::Cancelled }]);
    assert_eq!(p.next_wakeup(), Some(us(10)));
    p.tick(us(10));
    assert_eq!(drain(&mut p), vec![Decision::Complete { id: 2, code: Code::DeadlineExceeded }]);
    for id in [3, 1] {
        p.input_ready(us(11), id);
    }
    // Slot 0 (dead) is passed over; slots 1, 2 (dead), 3 run as one batch of 2 and one of 1
    // (three slots: 2 + 1), the dead slot a padding row.
    let d = drain(&mut p);
    let ls = launches(&d);
    assert_eq!(ls.iter().map(|l| l.batch).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(ls[0].requests, [1], "slot 2 is padding in the first batch");
    assert_eq!(ls[1].requests, [3]);
    assert_eq!((p.queued(), p.running()), (0, 2));
    // A running request cancelled completes at its task's end.
    p.cancel(us(12), 3);
    assert!(drain(&mut p).is_empty());
    p.task_done(us(13), &TaskReport::of(ls[1].task));
    assert_eq!(drain(&mut p), vec![Decision::Complete { id: 3, code: Code::Cancelled }]);
}

/// The engine E-Ebird builds from Table 4's picks for ResNet-152: the union of the chosen
/// configurations plus batch sizes 1 and 2 (two bs-4 workers: {4, 4, 8} needs them, reading (d)).
#[test]
fn e_ebird_engine_is_the_union_of_its_configurations() {
    let confs: BTreeMap<usize, Vec<usize>> =
        [(4, vec![4]), (8, vec![8]), (16, vec![4, 4, 8]), (32, vec![8, 8, 16])].into();
    let cfg = ElasticConfig::e_ebird(confs, 32);
    assert_eq!(cfg.workers, [1, 2, 4, 4, 8, 8, 16]);
    cfg.check().unwrap();
    let mut bad = cfg.clone();
    bad.engine_confs.insert(16, vec![16, 16]);
    assert!(bad.check().is_err(), "a configuration must sum to its TotalBS");
    let mut bad = cfg;
    bad.engine_confs.insert(8, vec![2, 2, 2, 2]);
    assert!(bad.check().unwrap_err().to_string().contains("batch size 2"));
    let no_one = ElasticConfig { workers: vec![2, 4], ..Default::default() };
    assert!(
        no_one.check().unwrap_err().to_string().contains("batch size 1"),
        "a remainder could wait for ever"
    );
}

/// E5: one CurConf change per level crossing, Q = idle ∩ CurConf (the bs-1 and bs-2 workers
/// always in it), busy workers outside CurConf parked when they finish.
#[test]
fn e_ebird_reconfigures_once_per_level_crossing() {
    let confs: BTreeMap<usize, Vec<usize>> =
        [(4, vec![4]), (8, vec![8]), (16, vec![4, 4, 8]), (32, vec![8, 8, 16])].into();
    let mut p = ElasticPolicy::new(ElasticConfig::e_ebird(confs, 32)).unwrap();
    let workers = p.config().workers.clone();
    let q = |p: &ElasticPolicy| -> Vec<usize> { p.idle.iter().map(|&(_, w)| workers[w]).collect() };
    assert_eq!(q(&p), [2, 1], "below the smallest level: the bs-1 and bs-2 workers alone");
    // 16 ready at once: level 16 → {4, 4, 8} (+ 2, 1): 8 + 4 + 4 launch.
    let d = arrive_ready_together(&mut p, us(0), 0, 16);
    assert_eq!(p.reconfigurations(), 1);
    let sizes: Vec<usize> = launches(&d).iter().map(|l| l.batch).collect();
    assert_eq!(sizes, [8, 4, 4]);
    assert_eq!(q(&p), [2, 1]);
    // Still level 16 (in flight 16): no change.
    p.tick(us(1));
    assert_eq!(p.reconfigurations(), 1);
    // 16 more: MemState 32 → {8, 8, 16}: the bs-16 and the second bs-8 become usable, and
    // the 16 run on the bs-16 worker (CurInf 16 + 16 = MaxInf).
    let d = arrive_ready_together(&mut p, us(2), 100, 16);
    assert_eq!(p.reconfigurations(), 2);
    assert_eq!(launches(&d).iter().map(|l| l.batch).collect::<Vec<_>>(), [16]);
    assert_eq!(q(&p), [8, 2, 1]);
    // 4 more wait for room under MaxInf.
    assert!(launches(&arrive_ready_together(&mut p, us(3), 200, 4)).is_empty());
    // A bs-4 worker finishes: outside CurConf, it stays parked; the 4 freed slots go greedily
    // to idle ∩ CurConf = {8, 2, 1}: 2 and 1 (one bs-1 worker), one request left waiting.
    let fours: Vec<TaskId> = p.tasks.iter().filter(|(_, t)| t.slots == 4).map(|(&t, _)| t).collect();
    assert_eq!(fours.len(), 2);
    p.task_done(us(4), &TaskReport::of(fours[0]));
    let d = drain(&mut p);
    assert_eq!(launches(&d).iter().map(|l| l.batch).collect::<Vec<_>>(), [2, 1]);
    assert_eq!(q(&p), [8], "the finished bs-4 worker is parked");
    assert_eq!((p.queued(), p.reconfigurations()), (1, 2));
}

/// E2 over a long random run: N-Ebird is work conserving, no idle worker has
/// bs ≤ min(N, MaxInf − CurInf, slots to the ring's end) after any event.
#[test]
fn n_ebird_invariants_over_a_long_random_run() {
    random_run(n_ebird(), 7, |p, r| {
        // Work conserving: no idle worker fits R.
        let idle_fits = (0..p.cfg.workers.len()).any(|w| !p.busy[w] && p.cfg.workers[w] <= r && r > 0);
        assert!(!idle_fits, "an idle worker fits R = {r} after an event");
    });
}

/// The same long random run under E-Ebird (the paper's Table 4 configurations): the same
/// invariants, and never a ready request with nothing running (a remainder worker is held back
/// only while a task is in flight whose end will dispatch again).
#[test]
fn e_ebird_invariants_over_a_long_random_run() {
    let confs: BTreeMap<usize, Vec<usize>> =
        [(4, vec![4]), (8, vec![8]), (16, vec![4, 4, 8]), (32, vec![8, 8, 16])].into();
    let p = ElasticPolicy::new(ElasticConfig::e_ebird(confs, 32)).unwrap();
    random_run(p, 11, |p, r| {
        assert!(p.in_flight() > 0 || r == 0, "{r} ready slots and nothing running");
    });
}

/// `events` random events (virtual time, arrival bursts, input delays, service times) on `p`:
/// Σ running bs ≤ MaxInf; every launch full and contiguous in slot order; FIFO; `idle_check`
/// after every event with R = min(N, MaxInf − CurInf, slots to the ring's end); every request
/// completes exactly once.
fn random_run(mut p: ElasticPolicy, seed: u64, idle_check: impl Fn(&ElasticPolicy, usize)) {
    // Under Miri (about 45 ms an event) the run is short, to look for undefined behaviour on the
    // paths it takes; the long runs that check the invariants are the native ones.
    let events = if cfg!(miri) {
        1_000
    } else if cfg!(debug_assertions) {
        200_000
    } else {
        1_000_000
    };
    let mut rng = StdRng::seed_from_u64(seed);
    let mut now = 0u64;
    let mut next_id: RequestId = 0;
    let mut not_ready: Vec<RequestId> = Vec::new();
    let mut running: Vec<(TaskId, WorkerId)> = Vec::new();
    let mut last_request: Option<RequestId> = None;
    let mut done = std::collections::HashSet::new();
    let (mut arrived, mut completed) = (0u64, 0u64);
    for _ in 0..events {
        now += rng.random_range(0..20);
        let t = us(now);
        match rng.random_range(0..10) {
            0..4 => {
                p.arrive(t, Arrival::fixed(next_id));
                not_ready.push(next_id);
                next_id += 1;
                arrived += 1;
            }
            4..6 if !not_ready.is_empty() => {
                // Inputs land in order (one copy stream), some at a time.
                let k = rng.random_range(1..=not_ready.len());
                for id in not_ready.drain(..k) {
                    p.input_ready(t, id);
                }
            }
            6 if next_id > 0 && rng.random_bool(0.05) => p.cancel(t, rng.random_range(0..next_id)),
            _ if !running.is_empty() => {
                let (task, _) = running.swap_remove(rng.random_range(0..running.len()));
                p.task_done(t, &TaskReport::of(task));
            }
            _ => p.tick(t),
        }
        for d in drain(&mut p) {
            match d {
                Decision::Launch(l) => {
                    assert_eq!(l.batch, p.cfg.workers[l.worker], "a launch fills its worker");
                    assert!(running.iter().all(|&(_, w)| w != l.worker), "worker {} is busy", l.worker);
                    for &id in &l.requests {
                        assert!(
                            last_request.is_none_or(|last| id > last),
                            "FIFO: {id} after {last_request:?}"
                        );
                        last_request = Some(id);
                    }
                    let task = &p.tasks[&l.task];
                    let end = task.first + task.slots as u64;
                    assert!(
                        task.first / p.cfg.ring_slots as u64 == (end - 1) / p.cfg.ring_slots as u64,
                        "slots {}..{end} wrap the ring",
                        task.first
                    );
                    running.push((l.task, l.worker));
                }
                Decision::Complete { id, .. } | Decision::Reject { id, .. } => {
                    assert!(done.insert(id), "request {id} completed twice");
                    completed += 1;
                }
            }
        }
        let in_flight: usize = running.iter().map(|&(_, w)| p.cfg.workers[w]).sum();
        assert_eq!(in_flight, p.in_flight());
        assert!(in_flight <= p.cfg.max_inflight, "Σ running bs {in_flight} > MaxInf");
        for (w, busy) in p.busy.iter().enumerate() {
            assert_eq!(*busy, running.iter().any(|&(_, b)| b == w), "worker {w}'s busy flag");
        }
        let to_end = p.cfg.ring_slots - (p.dev_ptr % p.cfg.ring_slots as u64) as usize;
        let r = p.ready_run().min(p.cfg.max_inflight - in_flight).min(to_end);
        idle_check(&p, r);
    }
    // Drain: every input lands, every task ends.
    for id in not_ready.drain(..) {
        p.input_ready(us(now), id);
    }
    loop {
        for d in drain(&mut p) {
            match d {
                Decision::Launch(l) => running.push((l.task, l.worker)),
                Decision::Complete { id, .. } | Decision::Reject { id, .. } => {
                    assert!(done.insert(id));
                    completed += 1;
                }
            }
        }
        let Some((task, _)) = running.pop() else { break };
        now += 1;
        p.task_done(us(now), &TaskReport::of(task));
    }
    assert_eq!(completed, arrived, "every request completes exactly once");
    assert_eq!((p.queued(), p.running(), p.in_flight()), (0, 0, 0));
}

/// E-Ebird under load: the bs-1 and bs-2 workers outside CurConf take only a remainder. At level
/// 32 with CurConf `{32}`, a backlog arriving while a bs-1 task runs must wait for it (one
/// service time) and then go to the bs-32 worker, not to the bs-2 worker: otherwise the bs-1 and
/// bs-2 tasks overlap for ever, CurInf never reaches 0 and the bs-32 worker never launches
/// (E-Ebird on an H200 ran at a mean batch of 1.5 at overload before this rule).
#[test]
fn e_ebird_remainder_workers_do_not_starve_curconf() {
    let confs: BTreeMap<usize, Vec<usize>> =
        [(4, vec![4]), (8, vec![8]), (16, vec![16]), (32, vec![32])].into();
    let mut p = ElasticPolicy::new(ElasticConfig::e_ebird(confs, 32)).unwrap();
    let sizes = |d: &[Decision]| launches(d).iter().map(|l| l.batch).collect::<Vec<_>>();
    // Low load: one request, below the smallest level: the bs-1 worker takes it.
    assert_eq!(sizes(&arrive_ready_together(&mut p, us(0), 0, 1)), [1]);
    let first = *p.tasks.keys().next().unwrap();
    // A backlog of 40: level 32, CurConf {32}; R = 31 fits no CurConf worker, and 40 ready
    // slots are no remainder: nothing launches.
    assert!(sizes(&arrive_ready_together(&mut p, us(1), 1, 40)).is_empty());
    assert_eq!(p.in_flight(), 1);
    // The bs-1 task ends: the bs-32 worker takes 32.
    p.task_done(us(2), &TaskReport::of(first));
    assert_eq!(sizes(&drain(&mut p)), [32]);
    // 8 left: fewer than CurConf's smallest (32), a remainder, but MaxInf is taken: they wait
    // for the bs-32 task (one service time), then run on level 8's worker.
    assert_eq!(p.queued(), 8);
    let big = *p.tasks.keys().next().unwrap();
    p.task_done(us(3), &TaskReport::of(big));
    assert_eq!(sizes(&drain(&mut p)), [8]);
    // A remainder under a level: 5 ready at level 4 ({4}): the bs-4 worker takes 4, the bs-1
    // remainder worker the fifth.
    let eight = *p.tasks.keys().next().unwrap();
    p.task_done(us(4), &TaskReport::of(eight));
    assert!(sizes(&drain(&mut p)).is_empty());
    assert_eq!(sizes(&arrive_ready_together(&mut p, us(5), 100, 5)), [4, 1]);
}
