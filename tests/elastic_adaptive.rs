//! Issue 15's policies through the runtime on the CPU backend. E²bird's elastic batching:
//! outputs, the input ring's BUSY, cancel and deadline of a request whose input is in the ring,
//! a worker's launch failing while the others go on. Adaptive batching: outputs with one and two
//! tasks in flight, and an infeasible latency bound still served.

mod common;

use std::time::Duration;

use common::{assert_close, input, mlp_dir};
use serve::backend::fault::{FaultKind, FaultPlan};
use serve::sched::adaptive::{Formula, Streams};
use serve::{
    AdaptiveConfig, BackendChoice, Code, CompletionQueue, ElasticConfig, Input, ModelOptions, Output,
    PolicyConfig, Runtime, SubmitOptions, Ticket,
};

fn runtime(plan: FaultPlan) -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).inject_faults(plan).build().unwrap()
}

fn elastic(cfg: ElasticConfig) -> ModelOptions {
    ModelOptions { policy: PolicyConfig::Elastic(cfg), ..ModelOptions::default() }
}

fn wait(t: Ticket) -> serve::Result<Output> {
    t.wait_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("a request did not complete within 20 s"))
}

fn code(r: &serve::Result<Output>) -> Code {
    r.as_ref().map_or_else(|e| e.code(), |_| Code::Ok)
}

/// `total` requests of `width` inputs, `window` in flight at a time, each completion replaced at
/// once; the results by input index. A request refused BUSY is submitted again, as a client
/// would: the ring frees slots in order, so a batch still running at the ring's oldest slot (its
/// worker's thread descheduled, say) can fill the ring while fewer requests than it has slots are
/// in flight.
fn closed_loop(m: &serve::Model, width: usize, total: u64, window: u64) -> Vec<(u64, serve::Result<Output>)> {
    let q = CompletionQueue::new().unwrap();
    let submit = |k: u64| {
        m.submit_to(Input::F32(input(width, k)), SubmitOptions::default(), &q, k).unwrap();
    };
    (0..window.min(total)).for_each(submit);
    let mut next = window.min(total);
    let mut out = Vec::new();
    while (out.len() as u64) < total {
        for c in q.next(64, Duration::from_secs(20)).unwrap() {
            if c.result.as_ref().is_err_and(|e| e.code() == Code::Busy) {
                submit(c.tag);
                continue;
            }
            out.push((c.tag, c.result));
            if next < total {
                submit(next);
                next += 1;
            }
        }
    }
    out
}

#[test]
fn n_ebird_serves_an_mlp_within_its_workers_sizes() {
    let (dir, mlp) = mlp_dir("elastic", &[16, 64, 8], 1);
    let rt = runtime(FaultPlan::new());
    let m = rt.load_model(&dir, elastic(ElasticConfig::default())).unwrap();
    for (k, r) in closed_loop(&m, 16, 400, 96) {
        let Ok(Output::F32(v)) = r else { panic!("failed: {r:?}") };
        assert_close(&v, &mlp.forward_reference(&input(16, k)));
    }
    let s = rt.stats();
    assert_eq!(s.completed(Code::Ok), 400);
    assert_eq!(s.batched_requests, s.completed(Code::Ok), "refused requests never ran");
    // No task holds more rows than the largest worker's 16.
    assert!(s.tasks_launched >= 400u64.div_ceil(16), "{} tasks for 400 requests", s.tasks_launched);
    // E1: one copy per request, into the input ring at arrival; every batch read in place.
    assert_eq!((s.ring_copies, s.gather_copies), (400, 0));
}

/// Under any other fixed-shape policy there is no ring: each launched row is gathered.
#[test]
fn timeout_batching_gathers_every_row() {
    let (dir, _) = mlp_dir("elastic-gather", &[16, 8], 1);
    let rt = runtime(FaultPlan::new());
    let m = rt.load_model(&dir, ModelOptions::default()).unwrap();
    for (_, r) in closed_loop(&m, 16, 100, 16) {
        r.unwrap();
    }
    let s = rt.stats();
    assert_eq!((s.ring_copies, s.gather_copies), (0, 100));
}

/// A stalled task the watchdog gives up on may still read its ring slots, which its policy frees:
/// the engine writes nothing into that ring again, and later batches are gathered, with correct
/// outputs.
#[test]
fn a_task_given_up_on_retires_the_ring() {
    let plan =
        FaultPlan::new().at(Some(0), 0, FaultKind::Stall { release_after: Some(Duration::from_millis(200)) });
    let rt = Runtime::builder()
        .backend(BackendChoice::Cpu)
        .cpu_threads(2)
        .inject_faults(plan.clone())
        .stall_timeout(Some(Duration::from_millis(100)))
        .build()
        .unwrap();
    let (dir, mlp) = mlp_dir("elastic-stall", &[4, 8, 3], 1);
    let cfg = ElasticConfig { workers: vec![1, 1], max_inflight: 2, ..Default::default() };
    let m = rt.load_model(&dir, elastic(cfg)).unwrap();
    let first = m.submit(Input::F32(input(4, 0)), SubmitOptions::default()).unwrap();
    assert_eq!(code(&wait(first)), Code::Backend, "given up on by the watchdog");
    assert_eq!(plan.fired(), 1);
    let before = rt.stats();
    assert_eq!((before.ring_copies, before.gather_copies), (1, 0));
    // The stream recovers once the stall is released; until the poller has seen it, a launch on
    // the stalled worker fails at once (BACKEND, "stalled"), and the client sends it again.
    for k in 1..20 {
        let give_up = std::time::Instant::now() + Duration::from_secs(10);
        let v = loop {
            match wait(m.submit(Input::F32(input(4, k)), SubmitOptions::default()).unwrap()) {
                Ok(Output::F32(v)) => break v,
                Err(e) if e.message().contains("stalled") && std::time::Instant::now() < give_up => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                other => panic!("{other:?}"),
            }
        };
        assert_close(&v, &mlp.forward_reference(&input(4, k)));
    }
    let after = rt.stats();
    assert_eq!(after.ring_copies, 1, "the ring is retired: nothing written into it again");
    assert!(after.gather_copies >= 19, "later batches are gathered: {}", after.gather_copies);
}

#[test]
fn elastic_is_for_fixed_shape_models_and_checks_its_workers() {
    let rt = runtime(FaultPlan::new());
    let (dir, _) = mlp_dir("elastic-bad", &[4, 4], 1);
    let e = rt
        .load_model(&dir, elastic(ElasticConfig { workers: vec![2, 4], ..Default::default() }))
        .err()
        .expect("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    let e = rt
        .load_model(&dir, elastic(ElasticConfig { ring_slots: 8, ..Default::default() }))
        .err()
        .expect("refused");
    assert!(e.message().contains("ring"), "{e}");
    let lstm = common::recurrent::fixture("lstm_small");
    let e = rt.load_model(&lstm, elastic(ElasticConfig::default())).err().expect("refused");
    assert_eq!(e.code(), Code::Unsupported, "{e}");
}

/// One bs-1 worker, MaxInf 1, a ring of 3 slots; the first launch stalls until released. Slot 0
/// runs, slots 1 and 2 wait: the next request is refused BUSY at once. A waiting request is
/// cancelled, another expires, both at once, while the worker is still stalled; after the
/// release the rest complete and the freed slots take new requests.
#[test]
fn a_full_ring_is_busy_and_requests_in_it_cancel_and_expire() {
    let plan =
        FaultPlan::new().at(Some(0), 0, FaultKind::Stall { release_after: Some(Duration::from_millis(400)) });
    let rt = runtime(plan.clone());
    let (dir, mlp) = mlp_dir("elastic-ring", &[4, 8, 3], 1);
    let cfg = ElasticConfig { workers: vec![1], max_inflight: 1, ring_slots: 3, ..Default::default() };
    let m = rt.load_model(&dir, elastic(cfg)).unwrap();
    let first = m.submit(Input::F32(input(4, 0)), SubmitOptions::default()).unwrap();
    let cancelled = m.submit(Input::F32(input(4, 1)), SubmitOptions::default()).unwrap();
    let expiring =
        m.submit(Input::F32(input(4, 2)), SubmitOptions::with_timeout(Duration::from_millis(50))).unwrap();
    let busy = m.submit(Input::F32(input(4, 3)), SubmitOptions::default()).unwrap();
    let e = wait(busy).expect_err("refused");
    assert_eq!(e.code(), Code::Busy, "{e}");
    assert!(e.message().contains("input ring"), "{e}");
    rt.cancel(cancelled.id()).unwrap();
    assert_eq!(code(&wait(cancelled)), Code::Cancelled);
    assert_eq!(code(&wait(expiring)), Code::DeadlineExceeded);
    let Output::F32(v) = wait(first).unwrap() else { panic!("f32") };
    assert_close(&v, &mlp.forward_reference(&input(4, 0)));
    assert_eq!(plan.fired(), 1);
    // The refused request took no slot: three copies into the ring.
    assert_eq!(rt.stats().ring_copies, 3);
    for k in 10..16 {
        let Output::F32(v) =
            wait(m.submit(Input::F32(input(4, k)), SubmitOptions::default()).unwrap()).unwrap()
        else {
            panic!("f32")
        };
        assert_close(&v, &mlp.forward_reference(&input(4, k)));
    }
}

/// A worker's launch fails: its requests fail BACKEND, its slots are freed, the other workers
/// and later requests go on.
#[test]
fn a_failed_launch_fails_its_batch_and_the_ring_goes_on() {
    let plan = FaultPlan::new().at(Some(0), 2, FaultKind::FailLaunch);
    let rt = runtime(plan.clone());
    let (dir, mlp) = mlp_dir("elastic-fail", &[4, 8, 3], 1);
    let m = rt.load_model(&dir, elastic(ElasticConfig::default())).unwrap();
    let mut failed = 0;
    for (k, r) in closed_loop(&m, 4, 300, 64) {
        match r {
            Ok(Output::F32(v)) => assert_close(&v, &mlp.forward_reference(&input(4, k))),
            Err(e) => {
                assert_eq!(e.code(), Code::Backend, "{e}");
                failed += 1;
            }
            Ok(other) => panic!("{other:?}"),
        }
    }
    assert_eq!(plan.fired(), 1);
    assert!((1..=16).contains(&failed), "one batch failed: {failed} requests");
    // More requests than the ring has slots went through after it.
    assert_eq!(rt.stats().completed(Code::Ok) + failed, 300);
    assert_eq!(rt.stats().completed(Code::Backend), failed);
}

#[test]
fn adaptive_serves_an_mlp_serially_and_with_two_tasks_out() {
    let (dir, mlp) = mlp_dir("adaptive", &[16, 64, 8], 1);
    let rt = runtime(FaultPlan::new());
    for (streams, bound_ms) in [(Streams::Serial, 50), (Streams::Async, 50), (Streams::Async, 0)] {
        // A bound of 0 is refused; 1 µs cannot be met: flagged, still served.
        let latency_bound =
            if bound_ms == 0 { Duration::from_micros(1) } else { Duration::from_millis(bound_ms) };
        let cfg =
            AdaptiveConfig { latency_bound, max_batch: 16, streams, formula: Formula::Exact, window: 8 };
        let m = rt
            .load_model(&dir, ModelOptions { policy: PolicyConfig::Adaptive(cfg), ..ModelOptions::default() })
            .unwrap();
        for (k, r) in closed_loop(&m, 16, 300, 48) {
            let Ok(Output::F32(v)) = r else { panic!("{streams:?}: failed: {r:?}") };
            assert_close(&v, &mlp.forward_reference(&input(16, k)));
        }
    }
    let bad = AdaptiveConfig { latency_bound: Duration::ZERO, ..AdaptiveConfig::default() };
    let e = rt
        .load_model(&dir, ModelOptions { policy: PolicyConfig::Adaptive(bad), ..ModelOptions::default() })
        .err()
        .expect("refused");
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
}
