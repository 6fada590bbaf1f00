//! The tenant simulator: determinism, and the spec's orderings on a small machine.

use super::*;

fn setup(cores: usize, w: Workload) -> Setup {
    Setup::new(Machine::threadripper(cores), w).expect("the builtin models are valid profiles")
}

#[test]
fn the_same_seed_gives_the_same_decision_trace() {
    let s = setup(16, Workload::Medium);
    let run = Run {
        scheme: Scheme::Veltair,
        rule: CapRule::Cap,
        rate: 400.0,
        queries: 400,
        seed: 7,
        trace: true,
        time_left: true,
    };
    let a = simulate(&s, &run).unwrap();
    let b = simulate(&s, &run).unwrap();
    assert!(!a.trace.is_empty());
    assert_eq!(a.trace, b.trace);
    let c = simulate(&s, &Run { seed: 8, ..run }).unwrap();
    assert_ne!(a.trace, c.trace);
    assert_eq!(a.latencies.len(), 400);
}

fn run(scheme: Scheme, rate: f64, queries: usize) -> Run {
    Run { scheme, rule: CapRule::Cap, rate, queries, seed: 3, trace: false, time_left: true }
}

#[test]
fn every_scheme_serves_every_workload_to_completion() {
    for w in [Workload::Light, Workload::Medium, Workload::Heavy, Workload::Mix] {
        let s = setup(16, w);
        assert!((s.shares.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        for name in ["veltair", "veltair-as", "veltair-ac", "layer-wise", "model-wise", "fixed-6", "prema"] {
            let o = simulate(&s, &run(Scheme::parse(name).unwrap(), 40.0, 300)).unwrap();
            assert_eq!(o.latencies.len(), 300, "{w:?} {name}");
            assert!(
                o.peak_cores <= 16 && o.units >= 300,
                "{w:?} {name}: peak {} units {}",
                o.peak_cores,
                o.units
            );
            assert_eq!(o.by_model.iter().map(|m| m.0).sum::<usize>(), 300);
        }
    }
    // The Mix's shares follow 1/QoS.
    let mix = Workload::Mix.models();
    let share = |n: &str| mix.iter().find(|(m, _)| m.name == n).unwrap().1;
    assert!((share("efficientnet-b0") / share("bert-large") - 13.0).abs() < 1e-9);
}

#[test]
fn conflicts_rise_with_load() {
    let s = setup(16, Workload::Medium);
    let rate = |scheme, r| simulate(&s, &run(scheme, r, 1500)).unwrap();
    let (low, high) = (rate(Scheme::LayerWise, 20.0), rate(Scheme::LayerWise, 400.0));
    assert!(
        high.conflict_rate() > low.conflict_rate(),
        "{} vs {}",
        high.conflict_rate(),
        low.conflict_rate()
    );
    assert!(high.mean_cores() > low.mean_cores());
}

#[test]
fn temporal_sharing_loses_to_spatial_sharing_on_the_mix() {
    // The spec's ordering ends with PREMA: one query on every core wastes what small models
    // cannot use. (The rest of the ordering does not hold on this cost model: see the README.)
    let s = setup(64, Workload::Mix);
    let q = |scheme| qps_at_95(&s, &run(scheme, 50.0, 2000), 4).unwrap().0;
    let (prema, layer, full) = (q(Scheme::Prema), q(Scheme::LayerWise), q(Scheme::Veltair));
    assert!(layer > prema && full > prema, "prema {prema}, layer-wise {layer}, veltair {full}");
}

#[test]
fn a_tenant_removed_while_its_blocks_run_finishes_them_and_the_others_go_on() {
    use crate::runtime::core::{CoreOutput, EngineCore, RowEnd, Submit};
    use crate::sched::TaskReport;
    use crate::sched::tenant::{TenantConfig, TenantPolicy};
    let s = setup(16, Workload::Medium);
    let mut core: EngineCore<u64> = EngineCore::default();
    core.add_group(
        0,
        Box::new(TenantPolicy::new(TenantConfig::new(16, Scheme::Veltair, s.profiles.clone())).unwrap()),
    );
    core.add_model(0, 0, 0, 0);
    core.add_model(1, 0, 0, 0);
    let sub = |model, id| Submit {
        model,
        id,
        graph: None,
        slots_needed: 0,
        deadline: None,
        priority: 0,
        input_ready: false,
        data: id,
    };
    let t = Time::from_micros;
    core.submit(t(0), sub(1, 1)).unwrap();
    core.input_ready(t(0), 1);
    let mut out: Vec<CoreOutput<u64>> = std::iter::from_fn(|| core.poll()).collect();
    assert!(matches!(out[..], [CoreOutput::Launch { .. }]));
    // Model 1 leaves while its first block runs: new queries for it are refused, model 0's go on.
    core.close_model(1);
    assert!(core.submit(t(1), sub(1, 2)).is_err());
    core.submit(t(1), sub(0, 3)).unwrap();
    core.input_ready(t(1), 3);
    out.extend(std::iter::from_fn(|| core.poll()));
    let (mut completed, mut released, mut now) = (Vec::new(), false, 10);
    while completed.len() < 2 {
        let launches: Vec<(usize, u64)> = out
            .drain(..)
            .filter_map(|o| match o {
                CoreOutput::Launch { group, task } => Some((group, task)),
                CoreOutput::Complete { id, code, .. } => {
                    completed.push((id, code));
                    None
                }
                CoreOutput::Released { model, policy, .. } => {
                    assert_eq!((model, policy.is_none()), (1, true), "model 1 alone; the group stays");
                    released = true;
                    None
                }
            })
            .collect();
        now += 1000;
        for (g, task) in launches {
            core.task_done(t(now), g, &TaskReport::of(task), |_, _, _| RowEnd::Continue);
        }
        out.extend(std::iter::from_fn(|| core.poll()));
        assert!(now < 10_000_000, "stalled: {completed:?}");
    }
    out.drain(..).for_each(|o| released |= matches!(o, CoreOutput::Released { model: 1, .. }));
    completed.sort();
    assert_eq!(completed, vec![(1, Code::Ok), (3, Code::Ok)]);
    assert!(released, "model 1 is released once its query is done");
}
