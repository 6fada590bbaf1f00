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
fn conflicts_rise_with_load_and_model_wise_never_conflicts() {
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
    assert_eq!(rate(Scheme::ModelWise, 400.0).conflicts, 0);
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
