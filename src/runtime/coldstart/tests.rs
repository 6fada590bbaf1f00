use std::sync::Arc;
use std::time::Duration;

use super::*;
use crate::backend::cpu::cold::program::sizes_profile;
use crate::backend::cpu::cold::program::{Layer, Sequential};
use crate::backend::cpu::cold::run_warm;
use crate::plan::deepplan::planner::Method::{self, Dha, Load};
use crate::plan::deepplan::{Algorithm, plan_given};

fn model() -> Arc<Sequential> {
    Arc::new(Sequential::random(
        vec![
            Layer::Embedding { rows: 400, width: 32 },
            Layer::Linear { inputs: 32, outputs: 32 },
            Layer::Relu,
            Layer::LayerNorm { width: 32 },
            Layer::Linear { inputs: 32, outputs: 16 },
        ],
        11,
    ))
}

fn plan_of(m: &Sequential, methods: Vec<Method>) -> ColdPlan {
    plan_given(&sizes_profile(m, "m").unwrap(), Algorithm::DeepPlan, methods, 1).unwrap()
}

fn config(devices: usize, budget_bytes: u64) -> ColdServerConfig {
    ColdServerConfig {
        devices,
        budget_bytes,
        max_queued: 1000,
        copy: ColdOptions { h2d_bytes_per_s: 200e6, ..ColdOptions::default() },
    }
}

fn tokens(i: usize) -> Vec<f32> {
    (0..8).map(|t| ((t * 31 + i * 7) % 400) as f32).collect()
}

/// Every request is answered once, with the warm run's output bit for bit; cold exactly when
/// its instance was not resident; the budget is never exceeded and eviction is LRU.
#[test]
fn serves_beyond_memory_exactly_once() {
    let m = model();
    let plan = plan_of(&m, vec![Load; 5]);
    let bytes = plan.device_bytes;
    // One device holding two instances, three instances requested round robin: LRU thrashes.
    let server = ColdServer::new(m.clone(), plan.clone(), 3, config(1, 2 * bytes)).unwrap();
    let mut colds = vec![];
    for i in 0..9 {
        let r = server.submit(i % 3, tokens(i)).unwrap().recv().unwrap();
        let expected = run_warm(m.as_ref(), &plan.plan, &tokens(i)).unwrap();
        let out = r.result.unwrap();
        assert_eq!(
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            expected.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
        colds.push(r.cold);
    }
    assert!(colds.iter().all(|&c| c), "round robin over 3 with room for 2: every request cold");
    assert_eq!(server.resident(0), vec![1, 2]);
    let (now, peak) = server.resident_bytes(0).unwrap();
    assert_eq!(server.resident_bytes(1), None);
    assert_eq!(now, 2 * bytes);
    assert!(peak <= 2 * bytes);
    // Two instances alternating fit: cold once each.
    let server = ColdServer::new(m.clone(), plan, 2, config(1, 2 * bytes)).unwrap();
    let colds: Vec<bool> =
        (0..6).map(|i| server.submit(i % 2, tokens(i)).unwrap().recv().unwrap().cold).collect();
    assert_eq!(colds, vec![true, true, false, false, false, false]);
}

/// Concurrent submitters over several devices: every request answered once, none lost.
#[test]
fn concurrent_requests_on_several_devices_complete_once() {
    let m = model();
    let plan = plan_of(&m, vec![Dha, Load, Load, Load, Load]);
    let server =
        Arc::new(ColdServer::new(m.clone(), plan.clone(), 12, config(3, 3 * plan.device_bytes)).unwrap());
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let s = Arc::clone(&server);
            std::thread::spawn(move || {
                (0..30).map(|i| s.submit((t * 5 + i) % 12, tokens(i)).unwrap()).collect::<Vec<_>>()
            })
        })
        .collect();
    let mut answered = 0;
    for h in handles {
        for rx in h.join().unwrap() {
            let r = rx.recv().unwrap();
            assert!(r.result.is_ok());
            assert!(rx.recv().is_err(), "one answer per request: the sender is gone after it");
            answered += 1;
        }
    }
    assert_eq!(answered, 120);
    for d in 0..3 {
        assert!(server.resident_bytes(d).unwrap().1 <= 3 * plan.device_bytes);
    }
}

/// A model whose load set exceeds the budget is refused with the sizes; the DHA plan keeps the
/// embedding on the host and fits.
#[test]
fn a_model_over_the_budget_is_refused_or_served_by_its_dha_plan() {
    let m = model();
    let all = plan_of(&m, vec![Load; 5]);
    let dha = plan_of(&m, vec![Dha, Load, Load, Load, Load]);
    let budget = dha.device_bytes;
    let e = ColdServer::new(m.clone(), all.clone(), 1, config(1, budget)).err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("more than the device budget"), "{e}");
    let server = ColdServer::new(m.clone(), dha, 1, config(1, budget)).unwrap();
    assert!(server.submit(0, tokens(0)).unwrap().recv().unwrap().result.is_ok());
    let e = server.submit(1, tokens(0)).err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument);
}

/// Freeing the server answers every queued request (CANCELLED or done), once.
#[test]
fn dropping_the_server_answers_every_queued_request() {
    let m = model();
    let plan = plan_of(&m, vec![Load; 5]);
    let slow = ColdServerConfig {
        copy: ColdOptions { h2d_bytes_per_s: 5e6, ..ColdOptions::default() },
        ..config(1, plan.device_bytes)
    };
    let server = ColdServer::new(m.clone(), plan, 4, slow).unwrap();
    let rxs: Vec<_> = (0..20).map(|i| server.submit(i % 4, tokens(i)).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(5));
    drop(server);
    let mut cancelled = 0;
    for rx in rxs {
        let r = rx.recv().expect("an answer");
        match r.result {
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.code(), Code::Cancelled);
                cancelled += 1;
            }
        }
        assert!(rx.recv().is_err(), "exactly one answer");
    }
    assert!(cancelled > 0, "the queue was cut short");
}

#[test]
fn a_full_queue_answers_busy() {
    let m = model();
    let plan = plan_of(&m, vec![Load; 5]);
    let cfg = ColdServerConfig {
        max_queued: 2,
        copy: ColdOptions { h2d_bytes_per_s: 1e6, ..ColdOptions::default() },
        ..config(1, plan.device_bytes)
    };
    let server = ColdServer::new(m, plan, 3, cfg).unwrap();
    let mut busy = 0;
    for i in 0..10 {
        if let Err(e) = server.submit(i % 3, tokens(i)) {
            assert_eq!(e.code(), Code::Busy);
            busy += 1;
        }
    }
    assert!(busy > 0);
}
