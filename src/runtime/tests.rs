//! Engine behaviour that needs a backend with injected faults ([`FaultPlan`]).

use std::time::Duration;

use super::*;
use crate::backend::cpu::CpuBackend;
use crate::backend::fault::FaultKind;
use crate::model::{Lstm, Output};

/// A runtime on one CPU thread whose backend injects `plan`'s faults.
fn faulty_runtime(plan: &FaultPlan) -> Runtime {
    let cpu: Arc<dyn Backend> = Arc::new(CpuBackend::new(1).unwrap());
    Runtime::start(Arc::new(FaultyBackend::new(cpu, plan.clone())), 64, Some(DEFAULT_STALL_TIMEOUT)).unwrap()
}

/// Launch failures at the launches numbered in `fail` (of every model).
fn failing(fail: &[u64]) -> FaultPlan {
    fail.iter().fold(FaultPlan::new(), |p, &n| p.at(None, n, FaultKind::FailLaunch))
}

fn wait(t: Ticket) -> Result<Output> {
    t.wait_timeout(Duration::from_secs(20)).unwrap_or_else(|_| panic!("no completion within 20 s"))
}

/// Launches that fail behind a running task on the same worker (cellular batching submits a
/// chain's cells back to back) are finished after it, in launch order — the policy relies on a
/// worker's tasks finishing in order. The request fails BACKEND; the runtime keeps serving.
#[test]
fn launches_failing_behind_running_tasks_finish_in_order_and_the_runtime_keeps_serving() {
    for fail in [vec![1], vec![1, 2], vec![0, 3]] {
        let rt = faulty_runtime(&failing(&fail));
        let net = Arc::new(Network::Lstm(Lstm::random(10, 4, 8, 1, 3)));
        // MaxTasksToSubmit 5: a chain's cells go back to back, so a failing launch has running
        // tasks ahead of it (`[0, 3]` needs four: launch 3 is still the first request's).
        let policy =
            PolicyConfig::Cellular(CellularOptions { max_tasks_to_submit: Some(5), ..Default::default() });
        let m = rt.add_network(net, "lstm".into(), ModelOptions { policy, ..Default::default() }).unwrap();
        let err = wait(m.submit(Input::Tokens(vec![1; 8]), SubmitOptions::default()).unwrap())
            .expect_err("a cell of the request failed to launch");
        assert_eq!(err.code(), Code::Backend, "failing launches {fail:?}: {err}");
        assert!(err.to_string().contains("injected launch failure"), "{err}");
        let out = wait(m.submit(Input::Tokens(vec![2; 8]), SubmitOptions::default()).unwrap())
            .unwrap_or_else(|e| panic!("failing launches {fail:?}: the next request failed: {e}"));
        assert!(matches!(out, Output::F32(ref v) if v.len() == 8), "{out:?}");
    }
}

/// A model file's `max_nodes` never sizes the default state arena past [`DEFAULT_STATE_BYTES`]
/// (it used to force at least `max_nodes` slots: 1.3 GB at load for `max_nodes = 10^7`); a tree
/// larger than the arena is refused at submit ("needs N state slots", as for any arena).
#[test]
fn max_nodes_never_sizes_the_default_arena_past_its_budget() {
    let mut m = crate::model::TreeLstm::random(10, 4, 1024, 3);
    m.cfg.max_nodes = Some(crate::model::limits::MAX_NODES);
    let net = Network::TreeLstm(m);
    let slot_bytes = net.state_width() * 4;
    let budget = DEFAULT_STATE_BYTES / slot_bytes;
    for bound in [1, 64, 4096, usize::MAX] {
        assert_eq!(default_state_slots(&net, bound), budget, "bound {bound}");
    }
}

/// Wait until `n` runners have been dropped (a freed model is released on the engine thread a
/// moment after its last request completed; the limit only makes a leak fail instead of hang).
fn until_dropped(plan: &FaultPlan, n: usize) {
    let give_up = std::time::Instant::now() + Duration::from_secs(20);
    while plan.runners_dropped() < n {
        assert!(
            std::time::Instant::now() < give_up,
            "{} runners dropped, expected {n}",
            plan.runners_dropped()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Dropping a model's last handle lets its pending requests complete normally, then drops its
/// runner (threads, arena, buffers) and frees its index, which the next model reuses: the
/// engine's per-model storage does not grow over load/free cycles.
#[test]
fn a_freed_model_is_released_after_its_requests_and_its_index_reused() {
    let plan = FaultPlan::new();
    let rt = faulty_runtime(&plan);
    let net = Arc::new(Network::Lstm(Lstm::random(10, 4, 8, 1, 3)));
    let kept = rt.add_network(net.clone(), "kept".into(), ModelOptions::default()).unwrap();
    for cycle in 0..50 {
        let m = rt.add_network(net.clone(), "cycled".into(), ModelOptions::default()).unwrap();
        assert_eq!(m.m.index, 1, "cycle {cycle}: the freed model's index is reused");
        let tickets: Vec<_> =
            (0..8).map(|k| m.submit(Input::Tokens(vec![k; 6]), SubmitOptions::default()).unwrap()).collect();
        let clone = m.clone();
        drop(m);
        for (k, t) in tickets.into_iter().enumerate() {
            let out = wait(t).unwrap_or_else(|e| panic!("cycle {cycle}, request {k}: {e}"));
            assert!(matches!(out, Output::F32(ref v) if v.len() == 8), "{out:?}");
        }
        // Its requests are done, yet a clone keeps the model: it still serves (a released model
        // would complete the request `Cancelled`).
        let out = wait(clone.submit(Input::Tokens(vec![1; 3]), SubmitOptions::default()).unwrap())
            .unwrap_or_else(|e| panic!("cycle {cycle}: the clone's request: {e}"));
        assert!(matches!(out, Output::F32(ref v) if v.len() == 8), "{out:?}");
        assert_eq!(plan.runners_dropped(), cycle, "a clone keeps the model");
        let last = clone.submit(Input::Tokens(vec![2; 5]), SubmitOptions::default()).unwrap();
        drop(clone);
        let out = wait(last).unwrap_or_else(|e| panic!("cycle {cycle}, a request of a freed model: {e}"));
        assert!(matches!(out, Output::F32(ref v) if v.len() == 8), "{out:?}");
        until_dropped(&plan, cycle + 1);
    }
    let out = wait(kept.submit(Input::Tokens(vec![3; 4]), SubmitOptions::default()).unwrap()).unwrap();
    assert!(matches!(out, Output::F32(ref v) if v.len() == 8), "{out:?}");
    assert_eq!(kept.m.index, 0);
}

#[test]
fn max_tasks_to_submit_defaults_per_model_kind() {
    let s2s = Network::Seq2Seq(crate::model::Seq2Seq::random(40, 8, 8, 1, 1, 2, 6, 2));
    let lstm = Network::Lstm(Lstm::random(10, 4, 8, 1, 3));
    let tree = Network::TreeLstm(crate::model::TreeLstm::random(10, 4, 8, 3));
    let lookahead = |net: &Network, k: Option<usize>| {
        let cfg =
            PolicyConfig::Cellular(CellularOptions { max_tasks_to_submit: k, ..CellularOptions::default() });
        make_policy(net, &cfg, u32::MAX).unwrap().lookahead()
    };
    assert_eq!(lookahead(&s2s, None), CellularOptions::SEQ2SEQ_MAX_TASKS_TO_SUBMIT);
    assert_eq!(lookahead(&lstm, None), DEFAULT_MAX_TASKS_TO_SUBMIT);
    assert_eq!(lookahead(&tree, None), DEFAULT_MAX_TASKS_TO_SUBMIT);
    assert_eq!(lookahead(&s2s, Some(5)), 5, "a caller's value wins");
    assert_eq!(make_policy(&s2s, &PolicyConfig::Auto, u32::MAX).unwrap().lookahead(), 2, "auto is cellular");
    let zero = PolicyConfig::Cellular(CellularOptions {
        max_tasks_to_submit: Some(0),
        ..CellularOptions::default()
    });
    assert!(make_policy(&lstm, &zero, u32::MAX).is_err());
}
