//! Fault injection (issue 18 item 9): a backend that fails launches, stalls a stream or loses
//! the device at chosen points (`serve::backend::fault`). The requests of the affected tasks
//! complete BACKEND, the others complete normally, nothing hangs (the stall watchdog gives up
//! on a stalled stream), and the runtime keeps serving.

mod common;

use std::time::{Duration, Instant};

use common::openmetrics::Exposition;
use common::recurrent::{cases, fixture};
use common::{input, mlp_dir};
use serve::backend::fault::{FaultKind, FaultPlan};
use serve::{
    BackendChoice, Code, CompletionQueue, Input, ModelOptions, Output, Runtime, SubmitOptions, Ticket,
};

fn runtime(plan: &FaultPlan, stall_timeout: Option<Duration>) -> Runtime {
    Runtime::builder()
        .backend(BackendChoice::Cpu)
        .cpu_threads(2)
        .stall_timeout(stall_timeout)
        .inject_faults(plan.clone())
        .build()
        .unwrap()
}

fn named(name: &str) -> ModelOptions {
    ModelOptions { name: Some(name.into()), ..ModelOptions::default() }
}

/// The request's result; failing (instead of hanging) if it does not complete within 20 s.
fn wait(t: Ticket) -> serve::Result<Output> {
    t.wait_timeout(Duration::from_secs(20))
        .unwrap_or_else(|_| panic!("a request did not complete within 20 s"))
}

fn backend_error(r: serve::Result<Output>, says: &str) {
    let e = r.expect_err("the request should fail");
    assert_eq!(e.code(), Code::Backend, "{e}");
    assert!(e.message().contains(says), "`{says}` not in: {e}");
}

#[test]
fn a_failed_launch_fails_only_its_requests() {
    let plan = FaultPlan::new().at(Some(0), 1, FaultKind::FailLaunch);
    let rt = runtime(&plan, Some(Duration::from_secs(30)));
    let (dir, mlp) = mlp_dir("fault-launch", &[4, 8, 3], 1);
    let m = rt.load_model(&dir, named("m")).unwrap();
    // No-wait batching and one request at a time: one task per request.
    for k in 0..5 {
        let r = wait(m.submit(Input::F32(input(4, k)), SubmitOptions::default()).unwrap());
        if k == 1 {
            backend_error(r, "injected launch failure");
        } else {
            let Output::F32(v) = r.unwrap() else { panic!("f32 output") };
            common::assert_close(&v, &mlp.forward_reference(&input(4, k)));
        }
    }
    assert_eq!(plan.fired(), 1);
    let e = Exposition::parse(&rt.metrics_text());
    let done = |code: Code| e.get("serve_requests_completed_total", &[("model", "m"), ("code", code.name())]);
    assert_eq!((done(Code::Ok), done(Code::Backend)), (Some(4.0), Some(1.0)));
}

#[test]
fn the_watchdog_fails_a_stalled_stream_s_requests_and_other_models_keep_serving() {
    let timeout = Duration::from_millis(200);
    // Model 0's second launch stalls its only worker for good.
    let plan = FaultPlan::new().at(Some(0), 1, FaultKind::Stall { release_after: None });
    let rt = runtime(&plan, Some(timeout));
    let (dir, _) = mlp_dir("fault-stall", &[4, 8, 3], 2);
    let stuck = rt.load_model(&dir, named("stuck")).unwrap();
    let fine = rt.load_model(fixture("lstm_small"), named("fine")).unwrap();
    wait(stuck.submit(Input::F32(input(4, 0)), SubmitOptions::default()).unwrap()).unwrap();

    let t0 = Instant::now();
    let stalled = stuck.submit(Input::F32(input(4, 1)), SubmitOptions::default()).unwrap();
    // While it hangs, the other model serves.
    for c in cases("lstm_small").iter().take(4) {
        wait(fine.submit(c.input.clone(), SubmitOptions::default()).unwrap()).unwrap();
    }
    backend_error(wait(stalled), "stalled");
    assert!(t0.elapsed() >= timeout, "given up on before the stall timeout: {:?}", t0.elapsed());

    // The worker stays stalled: its model's requests fail at once instead of queueing behind it.
    for k in 0..5 {
        backend_error(
            wait(stuck.submit(Input::F32(input(4, k)), SubmitOptions::default()).unwrap()),
            "stalled",
        );
    }
    for c in cases("lstm_small").iter().take(2) {
        wait(fine.submit(c.input.clone(), SubmitOptions::default()).unwrap()).unwrap();
    }
    let e = Exposition::parse(&rt.metrics_text());
    assert_eq!(e.get("serve_worker_stalls_total", &[("model", "stuck"), ("worker", "0")]), Some(1.0));
    assert_eq!(e.get("serve_worker_stalls_total", &[("model", "fine"), ("worker", "0")]), Some(0.0));
    assert_eq!(
        e.get("serve_requests_completed_total", &[("model", "stuck"), ("code", "BACKEND")]),
        Some(6.0)
    );
    // Shutdown does not wait for the stalled stream.
    rt.shutdown(Duration::from_secs(5));
}

#[test]
fn a_stream_that_recovers_serves_again_and_recurrent_requests_release_their_state() {
    // An lstm (cellular batching: a request's cells span several tasks) whose fourth launch
    // stalls for 1.5 s; the watchdog gives up after 100 ms.
    let plan = FaultPlan::new().at(
        Some(0),
        3,
        FaultKind::Stall { release_after: Some(Duration::from_millis(1500)) },
    );
    let rt = runtime(&plan, Some(Duration::from_millis(100)));
    let lstm =
        rt.load_model(fixture("lstm_small"), ModelOptions { state_slots: Some(4), ..named("lstm") }).unwrap();
    let all = cases("lstm_small");
    let case = all.iter().max_by_key(|c| match &c.input {
        Input::Tokens(t) => t.len(),
        _ => 0,
    });
    let case = case.unwrap();
    // A request long enough to be running when its cell's task stalls.
    backend_error(wait(lstm.submit(case.input.clone(), SubmitOptions::default()).unwrap()), "stalled");
    // Until the stream catches up its worker refuses work; then requests succeed again, with
    // their state slots (4 in all) handed back by the failed ones.
    let give_up = Instant::now() + Duration::from_secs(20);
    let mut failed = 0;
    loop {
        match wait(lstm.submit(case.input.clone(), SubmitOptions::default()).unwrap()) {
            Ok(out) => {
                let Output::F32(v) = out else { panic!("f32 output") };
                common::assert_close(&v, case.output.as_ref().unwrap());
                break;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::Backend, "{e}");
                failed += 1;
            }
        }
        assert!(Instant::now() < give_up, "the worker never served again");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(failed > 4, "more failures ({failed}) than state slots: the slots were handed back");
    for c in &all {
        let out = wait(lstm.submit(c.input.clone(), SubmitOptions::default()).unwrap()).unwrap();
        let Output::F32(v) = out else { panic!("f32 output") };
        common::assert_close(&v, c.output.as_ref().unwrap());
    }
}

#[test]
fn a_lost_device_fails_pending_and_later_requests_exactly_once_and_shutdown_completes() {
    // The device is lost at the lstm's sixth launch, with requests in flight.
    let plan = FaultPlan::new().at(Some(0), 5, FaultKind::LoseDevice);
    let rt = runtime(&plan, Some(Duration::from_secs(30)));
    let lstm = rt.load_model(fixture("lstm_small"), named("lstm")).unwrap();
    let (dir, _) = mlp_dir("fault-lost", &[4, 3], 3);
    let mlp = rt.load_model(&dir, named("mlp")).unwrap();
    let q = CompletionQueue::new().unwrap();
    let all = cases("lstm_small");
    let mut ids = Vec::new();
    for (tag, c) in all.iter().enumerate() {
        ids.push(lstm.submit_to(c.input.clone(), SubmitOptions::default(), &q, tag as u64).unwrap());
    }
    let mut seen = vec![0u32; all.len()];
    let mut codes = Vec::new();
    let give_up = Instant::now() + Duration::from_secs(20);
    while codes.len() < all.len() {
        assert!(Instant::now() < give_up, "{} of {} requests completed", codes.len(), all.len());
        for c in q.next(64, Duration::from_millis(100)).unwrap() {
            seen[c.tag as usize] += 1;
            codes.push(c.result.as_ref().map_or_else(|e| e.code(), |_| Code::Ok));
        }
    }
    assert!(seen.iter().all(|&n| n == 1), "exactly once: {seen:?}");
    assert!(codes.iter().all(|&c| c == Code::Ok || c == Code::Backend), "{codes:?}");
    assert!(codes.contains(&Code::Backend), "the lost device failed nothing: {codes:?}");
    // Every later request on the device fails at once, on every model; loading fails.
    backend_error(
        wait(lstm.submit(all[0].input.clone(), SubmitOptions::default()).unwrap()),
        "device was lost",
    );
    backend_error(
        wait(mlp.submit(Input::F32(input(4, 0)), SubmitOptions::default()).unwrap()),
        "device was lost",
    );
    assert_eq!(rt.load_model(&dir, named("late")).err().unwrap().code(), Code::Unavailable);
    assert!(q.next(1, Duration::from_millis(50)).unwrap().is_empty(), "no second completion");
    rt.shutdown(Duration::from_secs(5));
    let s = rt.stats();
    assert_eq!(s.completed_total(), s.submitted);
}

#[test]
fn without_a_watchdog_a_stalled_request_waits_until_shutdown_cancels_it() {
    let plan = FaultPlan::new().at(Some(0), 0, FaultKind::Stall { release_after: None });
    let rt = runtime(&plan, None);
    let (dir, _) = mlp_dir("fault-nowatch", &[4, 3], 4);
    let m = rt.load_model(&dir, named("m")).unwrap();
    let t = m.submit(Input::F32(input(4, 0)), SubmitOptions::default()).unwrap();
    let t = t.wait_timeout(Duration::from_millis(300)).expect_err("no watchdog: the request waits");
    rt.shutdown(Duration::ZERO);
    assert_eq!(wait(t).unwrap_err().code(), Code::Cancelled);
}

#[test]
fn a_zero_stall_timeout_is_refused() {
    let e = Runtime::builder()
        .backend(BackendChoice::Cpu)
        .stall_timeout(Some(Duration::ZERO))
        .build()
        .err()
        .unwrap();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("stall timeout"), "{e}");
}
