//! The tenant scheduler's mechanisms on virtual time (the spec's acceptance checks 1–4 and its
//! bad inputs); the random contract run is in `sched/contract.rs`, the simulated orderings in
//! `sim/tenant`.

use std::sync::Arc;
use std::time::Duration;

use super::blocks::{CapRule, fixed_block, next_block, thresholds};
use super::*;
use crate::sched::{Decision, drain};

/// A version's times: `t1 · (s + (1 − s)/c)` µs on `c` cores, times `1 + alpha · k` at level k.
#[derive(Clone, Copy)]
pub(crate) struct V {
    pub t1: f64,
    pub serial: f64,
    pub alpha: f64,
}

pub(crate) fn table(v: V, cores: usize, levels: usize) -> Vec<Vec<f64>> {
    (0..levels)
        .map(|k| {
            (1..=cores)
                .map(|c| v.t1 * (v.serial + (1.0 - v.serial) / c as f64) * (1.0 + v.alpha * k as f64))
                .collect()
        })
        .collect()
}

/// A model of layers `(flops, versions)`.
pub(crate) fn model(
    name: &str,
    qos_ms: u64,
    cores: usize,
    levels: usize,
    layers: &[(f64, &[V])],
) -> TenantModel {
    let layers = layers
        .iter()
        .enumerate()
        .map(|(i, (flops, vs))| LayerProfile {
            name: format!("l{i}"),
            flops: *flops,
            versions: vs.iter().map(|&v| table(v, cores, levels)).collect(),
        })
        .collect();
    TenantModel::new(name, Duration::from_millis(qos_ms), layers).expect("a valid profile")
}

/// A random profile on `cores` cores at `levels` interference levels for the contract checker:
/// 1 to 6 layers of 1 to 3 versions, with a QoS some core count meets or none does.
pub(crate) fn random_model(rng: &mut rand::rngs::StdRng, cores: usize, levels: usize) -> TenantModel {
    use rand::Rng;
    let layers: Vec<(f64, Vec<V>)> = (0..rng.random_range(1..=6))
        .map(|_| {
            let vs = (0..rng.random_range(1..=3))
                .map(|_| V {
                    t1: rng.random_range(50.0..2000.0),
                    serial: rng.random_range(0.0..0.5),
                    alpha: rng.random_range(0.0..1.0),
                })
                .collect();
            (rng.random_range(1e5..1e7), vs)
        })
        .collect();
    let layers: Vec<(f64, &[V])> = layers.iter().map(|(f, v)| (*f, v.as_slice())).collect();
    model("random", rng.random_range(1..10), cores, levels, &layers)
}

/// A layer of `flops` whose one version takes `us_per_flop · flops` on one core.
fn plain(flops: f64, serial: f64) -> (f64, Vec<V>) {
    (flops, vec![V { t1: flops * 1e-3, serial, alpha: 0.0 }])
}

/// 8 layers, some easy to parallelise and some not, profiled on `cores` cores: a mix of needs,
/// `r_l` = 6, 9, 7, 6, 6, 8, 6, 7 and `Avg_C` = 7 with a 5 ms QoS.
fn uneven(cores: usize) -> TenantModel {
    let spec: Vec<(f64, Vec<V>)> = [
        (4e6, 0.01),
        (1e6, 0.1),
        (8e6, 0.05),
        (2e6, 0.02),
        (1e6, 0.02),
        (6e6, 0.08),
        (2e6, 0.01),
        (1e6, 0.05),
    ]
    .iter()
    .map(|&(f, s)| plain(f, s))
    .collect();
    let layers: Vec<(f64, &[V])> = spec.iter().map(|(f, v)| (*f, v.as_slice())).collect();
    model("uneven", 5, cores, 1, &layers)
}

#[test]
fn budgets_sum_to_the_qos_in_proportion_to_flops() {
    let m = uneven(16);
    let b = m.budgets();
    let total: f64 = b.iter().sum();
    assert!((total - 5000.0).abs() < 1e-6, "budgets sum to {total} µs, QoS 5000 µs");
    // Layer 2 has 8× the FLOPs of layer 1.
    assert!((b[2] / b[1] - 8.0).abs() < 1e-9);
}

#[test]
fn the_threshold_is_the_idle_cores_split_by_average_need() {
    assert_eq!(thresholds(64, &[12, 12, 24]), vec![4.0, 4.0, 8.0]);
    // Overloaded: nothing idle, no threshold.
    assert_eq!(thresholds(8, &[6, 6]), vec![0.0, 0.0]);
    assert_eq!(thresholds(8, &[]), Vec::<f64>::new());
}

#[test]
fn a_layer_needs_the_fewest_cores_that_meet_its_budget() {
    let m = uneven(16);
    for (l, &need) in m.needs(Versions::Multi, 0).iter().enumerate() {
        let b = m.budgets()[l];
        assert!(m.time(l, 0, need, 0) <= b || need == 16, "layer {l} misses its budget on {need} cores");
        if need > 1 {
            assert!(m.time(l, 0, need - 1, 0) > b, "layer {l} would meet its budget on {} cores", need - 1);
        }
    }
    // Avg_C is the whole model's uniform need.
    let avg = m.avg_cores(Versions::Multi, 0);
    assert_eq!(avg, m.block_cores(0..8, Versions::Multi, 0));
    assert_eq!((m.needs(Versions::Multi, 0), avg), (&[6, 9, 7, 6, 6, 8, 6, 7][..], 7));
    assert!(m.block_time(0..8, Versions::Multi, 0, avg, 0) <= 5000.0);
    assert!(m.block_time(0..8, Versions::Multi, 0, avg - 1, 0) > 5000.0);
}

/// Every block sequence from `start` under `cap`: contiguous, covering every layer once.
fn blocks_of(m: &TenantModel, cap: f64, rule: CapRule) -> Vec<(usize, usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < m.layers().len() {
        let (end, c) = next_block(m, start, cap, rule, (Versions::Multi, 0), 1.0);
        assert!(end > start, "a block of no layer at {start}");
        out.push((start, end, c));
        start = end;
    }
    out
}

#[test]
fn blocks_cover_every_layer_once_and_rule_r_keeps_them_under_the_cap() {
    let m = uneven(16);
    let avg = m.avg_cores(Versions::Multi, 0) as f64;
    let needs = m.needs(Versions::Multi, 0).to_vec();
    assert!(needs.iter().any(|&r| r as f64 >= avg), "the profile has pivots at thres 0: {needs:?}");
    for thres in [0.0, 1.0, 2.5, 4.0, 8.0, 100.0] {
        let cap = avg + thres;
        for rule in [CapRule::Cap, CapRule::Literal] {
            let bs = blocks_of(&m, cap, rule);
            assert_eq!(bs.first().map(|b| b.0), Some(0));
            assert_eq!(bs.last().map(|b| b.1), Some(8));
            for w in bs.windows(2) {
                assert_eq!(w[0].1, w[1].0, "blocks are contiguous");
            }
            for &(s, e, c) in &bs {
                assert_eq!(c, m.block_cores(s..e, Versions::Multi, 0));
                if rule == CapRule::Cap && e < 8 {
                    assert!(c as f64 <= cap, "R: block {s}..{e} on {c} cores over the cap {cap}");
                }
            }
        }
    }
    // At the lowest cap (thres 0, K = Avg_C = 7) the literal rule cuts at every pivot, so the
    // pivot of need 9 runs alone over the cap; R absorbs the next layer and stays within it.
    let r = blocks_of(&m, avg, CapRule::Cap);
    let l = blocks_of(&m, avg, CapRule::Literal);
    assert_eq!(r, vec![(0, 1, 6), (1, 3, 7), (3, 5, 6), (5, 7, 7), (7, 8, 7)]);
    assert_eq!(l, vec![(0, 1, 6), (1, 2, 9), (2, 5, 7), (5, 7, 7), (7, 8, 7)]);
    // With no cap at all the next block is the rest of the model.
    assert_eq!(next_block(&m, 2, f64::INFINITY, CapRule::Cap, (Versions::Multi, 0), 1.0).0, 8);
    assert_eq!(fixed_block(&m, 6, 6, (Versions::Multi, 0), 1.0).0, 8);
}

#[test]
fn as_load_rises_the_cap_falls_and_blocks_stay_under_it() {
    let m = uneven(32);
    let avg = m.avg_cores(Versions::Multi, 0);
    let mut caps = Vec::new();
    for others in 0..=6 {
        let mut load = vec![avg];
        load.extend(vec![avg; others]);
        let cap = avg as f64 + thresholds(32, &load)[0];
        for &(_, e, c) in &blocks_of(&m, cap, CapRule::Cap) {
            assert!(e == 8 || c as f64 <= cap, "a block on {c} cores over the cap {cap}");
        }
        caps.push(cap);
    }
    assert!(caps.windows(2).all(|w| w[1] <= w[0]), "K_m falls as load rises: {caps:?}");
    assert_eq!((caps[0], caps[6]), (32.0, 7.0), "alone: every core; 7 queries of 7: none idle");
    // Alone the whole model is one block; loaded it is cut at the pivots.
    assert_eq!(blocks_of(&m, caps[0], CapRule::Cap).len(), 1);
    assert!(blocks_of(&m, caps[6], CapRule::Cap).len() > 1);
}

fn launches(p: &mut TenantPolicy) -> Vec<Launch> {
    drain(p)
        .into_iter()
        .filter_map(|d| match d {
            Decision::Launch(l) => Some(l),
            _ => None,
        })
        .collect()
}

fn layers_of(l: &Launch) -> (u32, u32) {
    match l.shape {
        TaskShape::Layers { first, last } => (first, last),
        _ => panic!("a tenant task is a layer block: {:?}", l.shape),
    }
}

fn arrival(id: RequestId, model: ModelId) -> Arrival {
    Arrival { id, model, deadline: None, priority: 0, cells: None }
}

#[test]
fn blocks_are_formed_again_at_every_boundary_from_the_load_then() {
    let m = Arc::new(uneven(32));
    // The load's effect alone (the time left is the next test's).
    let cfg = TenantConfig { time_left: false, ..TenantConfig::new(32, Scheme::Veltair, vec![m.clone()]) };
    let mut p = TenantPolicy::new(cfg).unwrap();
    let t = Time::from_micros;
    // Three queries start, each on Avg_C = 7 cores; then query 0 arrives.
    for id in 1..=3 {
        p.arrive(t(0), arrival(id, 0));
    }
    let others = launches(&mut p);
    assert_eq!(others.len(), 3);
    p.arrive(t(1), arrival(0, 0));
    let first = launches(&mut p);
    // Loaded: idle 32 − 4·7 = 4, thres 1, K = 8: layer 1 (need 9) is a pivot, so query 0's
    // first block is layer 0 alone, on its need of 6.
    assert_eq!(first.len(), 1);
    assert_eq!((layers_of(&first[0]), first[0].exec.cores), ((0, 0), 6));
    // The load leaves while that block runs.
    for l in &others {
        p.task_done(t(50), &TaskReport::of(l.task));
    }
    drain(&mut p);
    p.task_done(t(100), &TaskReport::of(first[0].task));
    let next = launches(&mut p);
    assert_eq!(next.len(), 1);
    // Alone now (K = 32): the rest of the model in one block, not the loaded cut at layer 3.
    let alone = next_block(&m, 1, 32.0, CapRule::Cap, (Versions::Multi, 0), 1.0);
    let loaded = next_block(&m, 1, 8.0, CapRule::Cap, (Versions::Multi, 0), 1.0);
    assert_eq!(alone.0, 8);
    assert_ne!(alone, loaded);
    assert_eq!((layers_of(&next[0]).1 as usize + 1, next[0].exec.cores), alone);
}

#[test]
fn a_query_behind_plan_asks_for_more_cores_and_one_ahead_for_fewer() {
    let m = Arc::new(uneven(32));
    let t = Time::from_micros;
    // Layer-granular so that every unit is one layer: layer 1's need at its static budget is 9.
    let second_unit = |done_at: u64| {
        let mut p = TenantPolicy::new(TenantConfig::new(32, Scheme::VeltairAc, vec![m.clone()])).unwrap();
        p.arrive(t(0), arrival(0, 0));
        let l = launches(&mut p);
        assert_eq!(l[0].exec.cores, 6, "on time at arrival: the static need");
        // A report of the block's solo time: the level stays at 0.
        p.task_done(
            t(done_at),
            &TaskReport { compute: Some(Duration::from_micros(700)), ..TaskReport::of(l[0].task) },
        );
        launches(&mut p)[0].exec.cores
    };
    // Layer 0's budget is 800 µs of the 5 ms.
    assert_eq!(second_unit(800), 9, "on plan: the static need");
    assert!(second_unit(2500) > 9, "behind plan: more cores");
    assert!(second_unit(100) < 9, "ahead of plan: fewer cores");
    // Without the time left, the static need whatever the time.
    let cfg = TenantConfig { time_left: false, ..TenantConfig::new(32, Scheme::VeltairAc, vec![m.clone()]) };
    let mut p = TenantPolicy::new(cfg).unwrap();
    p.arrive(t(0), arrival(0, 0));
    let l = launches(&mut p);
    p.task_done(
        t(2500),
        &TaskReport { compute: Some(Duration::from_micros(700)), ..TaskReport::of(l[0].task) },
    );
    assert_eq!(launches(&mut p)[0].exec.cores, 9);
}

#[test]
fn a_started_query_short_of_cores_runs_its_next_layer_on_the_free_ones() {
    // Two layers: the first cheap, the second needing many cores.
    let m = Arc::new(model(
        "m",
        2,
        8,
        1,
        &[
            (1e6, &[V { t1: 500.0, serial: 0.0, alpha: 0.0 }]),
            (1e6, &[V { t1: 6000.0, serial: 0.0, alpha: 0.0 }]),
        ],
    ));
    let mut p = TenantPolicy::new(TenantConfig::new(8, Scheme::LayerWise, vec![m.clone()])).unwrap();
    let t = Time::from_micros;
    // Layer budgets 1000 µs each: layer 0 needs 1 core, layer 1 needs 6.
    assert_eq!(m.needs(Versions::SoloBest, 0), &[1, 6]);
    p.arrive(t(0), arrival(0, 0));
    p.arrive(t(0), arrival(1, 0));
    p.arrive(t(0), arrival(2, 0));
    let l = launches(&mut p);
    assert_eq!(l.len(), 3);
    assert!(l.iter().all(|l| l.exec.cores == 1 && !l.exec.conflict));
    // Query 0 goes on to layer 1 with 6 free of 8: it needs 6, no conflict.
    p.task_done(t(600), &TaskReport::of(l[0].task));
    let a = launches(&mut p);
    assert_eq!((a[0].exec.cores, a[0].exec.conflict), (6, false));
    // Query 1 next: 1 core free (query 0 holds 6, query 2 one), it needs 6: a conflict, its
    // next layer alone on that core.
    p.task_done(t(610), &TaskReport::of(l[1].task));
    let b = launches(&mut p);
    assert_eq!(b.len(), 1);
    assert_eq!((layers_of(&b[0]), b[0].exec.cores, b[0].exec.conflict), ((1, 1), 1, true));
    assert_eq!(p.free_cores(), 0);
}

#[test]
fn a_query_not_started_waits_for_its_first_block_in_arrival_order() {
    let m = Arc::new(model("m", 1, 4, 1, &[(1e6, &[V { t1: 3000.0, serial: 0.0, alpha: 0.0 }])]));
    let mut p = TenantPolicy::new(TenantConfig::new(4, Scheme::ModelWise, vec![m])).unwrap();
    let t = Time::from_micros;
    p.arrive(t(0), arrival(0, 0));
    p.arrive(t(1), arrival(1, 0));
    let l = launches(&mut p);
    assert_eq!(l.len(), 1, "query 1 needs 3 of the 1 core left: it waits");
    assert_eq!(l[0].exec.cores, 3);
    assert_eq!((p.queued(), p.running()), (1, 1));
    p.task_done(t(900), &TaskReport::of(l[0].task));
    let d = drain(&mut p);
    assert!(d.contains(&Decision::Complete { id: 0, code: Code::Ok }));
    assert!(d.iter().any(|d| matches!(d, Decision::Launch(l) if l.requests == [1] && l.exec.cores == 3)));
}

/// Two versions: "big" is the faster solo but slows sharply under interference; "small" is a
/// little slower solo and barely slows.
fn two_versions(levels: usize, cores: usize) -> TenantModel {
    let big = V { t1: 8000.0, serial: 0.0, alpha: 0.8 };
    let small = V { t1: 9000.0, serial: 0.0, alpha: 0.05 };
    model("v", 5, cores, levels, &[(1e6, &[big, small]), (1e6, &[big, small])])
}

#[test]
fn the_version_follows_the_interference_level() {
    let m = Arc::new(two_versions(4, 8));
    assert_eq!(m.version(0, Versions::Multi, 0), 0, "solo: the big-tile version");
    assert_eq!(m.version(0, Versions::Multi, 3), 1, "under interference: the small-tile one");
    assert_eq!(m.version(0, Versions::SoloBest, 3), 0);
    let mut p = TenantPolicy::new(TenantConfig {
        ewma: 1.0,
        ..TenantConfig::new(8, Scheme::VeltairAc, vec![m.clone()])
    })
    .unwrap();
    let t = Time::from_micros;
    p.arrive(t(0), arrival(0, 0));
    let l = launches(&mut p);
    assert_eq!(l[0].exec.version, 0);
    // The block took 2.6× its solo prediction: level 2 of `big` (1 + 0.8·2).
    let solo = m.block_time(0..1, Versions::Multi, 0, l[0].exec.cores, 0);
    let took = Duration::from_secs_f64(solo * 2.6e-6);
    p.task_done(t(5000), &TaskReport { compute: Some(took), ..TaskReport::of(l[0].task) });
    assert_eq!(p.level(), 2);
    let l = launches(&mut p);
    assert_eq!(l[0].exec.version, 2, "the next block runs level 2's versions");
    assert_eq!(m.version(1, Versions::Multi, 2), 1);
    // A scheme blind to interference keeps level 0.
    let mut blind = TenantPolicy::new(TenantConfig::new(8, Scheme::LayerWise, vec![m])).unwrap();
    blind.arrive(t(0), arrival(0, 0));
    let l = launches(&mut blind);
    blind.task_done(t(5000), &TaskReport { compute: Some(took), ..TaskReport::of(l[0].task) });
    assert_eq!(blind.level(), 0);
    assert_eq!(launches(&mut blind)[0].exec.version, 0);
}

#[test]
fn prema_runs_one_query_at_a_time_on_every_core_and_serves_tokens() {
    let v: &[V] = &[V { t1: 400.0, serial: 0.0, alpha: 0.0 }];
    let tight = Arc::new(model("tight", 2, 4, 1, &[(1e6, v); 3]));
    let loose = Arc::new(model("loose", 50, 4, 1, &[(1e6, v); 3]));
    let mut p = TenantPolicy::new(TenantConfig::new(4, Scheme::Prema, vec![tight, loose])).unwrap();
    let t = Time::from_micros;
    p.arrive(t(0), arrival(0, 1));
    p.arrive(t(1), arrival(1, 0));
    let l = launches(&mut p);
    assert_eq!(l.len(), 1);
    assert_eq!((l[0].requests.as_slice(), l[0].exec.cores), (&[0][..], 4));
    // At the boundary the tight-QoS query has far more tokens: it preempts.
    p.task_done(t(100), &TaskReport::of(l[0].task));
    let l = launches(&mut p);
    assert_eq!(l[0].requests, vec![1]);
    // Tokens count time spent waiting, not running: of two queries of one model, the one that
    // ran its first layer while the other waited yields at the boundary.
    let one = Arc::new(model("one", 10, 4, 1, &[(1e6, v); 3]));
    let mut p = TenantPolicy::new(TenantConfig::new(4, Scheme::Prema, vec![one])).unwrap();
    p.arrive(t(0), arrival(0, 0));
    p.arrive(t(1), arrival(1, 0));
    let l = launches(&mut p);
    assert_eq!(l[0].requests, vec![0]);
    p.task_done(t(1000), &TaskReport::of(l[0].task));
    assert_eq!(launches(&mut p)[0].requests, vec![1], "query 0 waited 0 µs, query 1 999");
}

#[test]
fn bad_inputs_get_precise_errors_and_everything_completes() {
    let m = Arc::new(uneven(4));
    assert!(!m.feasible(), "Avg_C is 7: 4 cores cannot meet 5 ms");
    let easy: &[V] = &[V { t1: 2000.0, serial: 0.05, alpha: 0.0 }];
    let m = Arc::new(model("easy", 5, 4, 1, &[(1e6, easy), (2e6, easy), (1e6, easy)]));
    let err = TenantPolicy::new(TenantConfig::new(8, Scheme::Veltair, vec![m.clone()])).unwrap_err();
    assert!(err.to_string().contains("profiled on 4 cores"), "{err}");
    assert!(TenantPolicy::new(TenantConfig::new(4, Scheme::Veltair, vec![])).is_err());
    let e = TenantPolicy::new(TenantConfig::new(
        8,
        Scheme::Veltair,
        vec![Arc::new(two_versions(4, 8)), Arc::new(two_versions(2, 8))],
    ))
    .unwrap_err();
    assert!(e.to_string().contains("interference levels"), "{e}");
    let bad_ewma = TenantConfig { ewma: 0.0, ..TenantConfig::new(4, Scheme::Veltair, vec![m.clone()]) };
    assert!(TenantPolicy::new(bad_ewma).is_err());
    assert!(Scheme::parse("fixed-0").is_err());
    assert_eq!(Scheme::parse("fixed-11").unwrap(), Scheme::Fixed(11));
    for name in ["veltair", "veltair-as", "veltair-ac", "layer-wise", "model-wise", "fixed-6", "prema"] {
        assert_eq!(Scheme::parse(name).unwrap().to_string(), name);
    }
    // Profiles that cannot be models: NaN, subnormal or absurd times, absurd FLOPs.
    for t in [f64::NAN, 1e-300, 1e300, 0.0] {
        let l = LayerProfile { name: "x".into(), flops: 1.0, versions: vec![vec![vec![t]]] };
        assert!(TenantModel::new("x", Duration::from_millis(1), vec![l]).is_err(), "time {t}");
    }
    let huge = LayerProfile { name: "x".into(), flops: 1e300, versions: vec![vec![vec![1.0]]] };
    assert!(TenantModel::new("x", Duration::from_millis(1), vec![huge]).is_err());
    let none = LayerProfile { name: "x".into(), flops: 1.0, versions: vec![] };
    assert!(TenantModel::new("x", Duration::from_millis(1), vec![none]).is_err());
    assert!(TenantModel::new("x", Duration::from_millis(1), vec![]).is_err());
    // A QoS no core count meets: flagged, and served best-effort on every core.
    let hopeless =
        Arc::new(model("hopeless", 1, 4, 1, &[(1e6, &[V { t1: 50_000.0, serial: 0.5, alpha: 0.0 }])]));
    assert!(!hopeless.feasible());
    assert!(m.feasible());
    // An unknown model index is refused at once, and its deadline is not left armed.
    let mut p = TenantPolicy::new(TenantConfig::new(4, Scheme::Veltair, vec![m.clone()])).unwrap();
    p.arrive(Time::ZERO, Arrival { deadline: Some(Time::from_millis(5)), ..arrival(9, 3) });
    assert!(matches!(drain(&mut p)[..], [Decision::Reject { id: 9, code: Code::InvalidArgument, .. }]));
    assert_eq!((p.queued(), p.running(), p.next_wakeup()), (0, 0, None));
    // More tenants than cores, an unknown model index, a cancel mid-query: all complete once.
    let models = vec![m.clone(), hopeless, m.clone(), m.clone(), m.clone(), m];
    for scheme in [Scheme::Veltair, Scheme::LayerWise, Scheme::ModelWise, Scheme::Prema, Scheme::Fixed(3)] {
        let mut p = TenantPolicy::new(TenantConfig::new(4, scheme, models.clone())).unwrap();
        let t = Time::from_micros;
        for id in 0..12 {
            p.arrive(t(id), arrival(id, (id % 7) as usize));
        }
        p.cancel(t(20), 3);
        let mut done = std::collections::HashMap::new();
        let mut now = 20;
        loop {
            let d = drain(&mut p);
            let mut ran = Vec::new();
            for d in d {
                match d {
                    Decision::Launch(l) => ran.push(l.task),
                    Decision::Complete { id, code } | Decision::Reject { id, code, .. } => {
                        assert!(done.insert(id, code).is_none(), "{scheme}: request {id} completed twice");
                    }
                }
            }
            if done.len() == 12 {
                break;
            }
            now += 100;
            for task in ran {
                p.task_done(t(now), &TaskReport::of(task));
            }
            assert!(now < 1_000_000, "{scheme}: stalled with {} done", done.len());
        }
        assert_eq!(done[&6], Code::InvalidArgument, "{scheme}: model index 6 does not exist");
        assert_eq!(done[&3], Code::Cancelled);
        assert_eq!(done[&1], Code::Ok, "{scheme}: the infeasible model is served best-effort");
        assert_eq!((p.queued(), p.running()), (0, 0));
        assert_eq!(p.free_cores(), 4);
    }
}

#[test]
fn a_block_of_non_pivots_never_asks_for_more_than_its_neediest_layer() {
    // Layer 1 meets its 1000 µs budget on no core count and is fastest on 2 cores (its need);
    // the block of both misses its summed budget everywhere and is fastest on 3 cores, but it
    // gains nothing there that its neediest layer could use: it asks for 2.
    let layer = |name: &str, row: [f64; 4]| LayerProfile {
        name: name.into(),
        flops: 1e6,
        versions: vec![vec![row.to_vec()]],
    };
    let m = TenantModel::new(
        "m",
        Duration::from_millis(2),
        vec![layer("a", [1000.0, 500.0, 400.0, 400.0]), layer("b", [3000.0, 2500.0, 2500.0, 2500.0])],
    )
    .unwrap();
    assert_eq!(m.needs(Versions::Multi, 0), &[1, 2]);
    assert_eq!(m.block_cores(0..2, Versions::Multi, 0), 3, "the block's own fastest point");
    assert_eq!(next_block(&m, 0, 100.0, CapRule::Cap, (Versions::Multi, 0), 1.0), (2, 2));
}

#[test]
fn a_conflicted_unit_does_not_move_the_interference_level() {
    // Each query's first layer needs 4 of 10 cores: two get them, the third starts on 2.
    let m = Arc::new(two_versions(4, 10));
    let cfg = TenantConfig { ewma: 1.0, ..TenantConfig::new(10, Scheme::VeltairAc, vec![m.clone()]) };
    let mut p = TenantPolicy::new(cfg).unwrap();
    let t = Time::from_micros;
    for id in 0..3 {
        p.arrive(t(0), arrival(id, 0));
    }
    let all = launches(&mut p);
    let conflicted: Vec<&Launch> = all.iter().filter(|l| l.exec.conflict).collect();
    assert!(!conflicted.is_empty(), "{all:?}");
    // The conflicted unit took 3× its prediction (thread starts): the level stays at 0.
    let c = conflicted[0];
    let solo = m.block_time(0..1, Versions::Multi, 0, c.exec.cores, 0);
    let took = Duration::from_secs_f64(solo * 3e-6);
    p.task_done(t(9000), &TaskReport { compute: Some(took), ..TaskReport::of(c.task) });
    assert_eq!(p.level(), 0);
    // The same time reported for a unit that had its cores moves it.
    let clean = all.iter().find(|l| !l.exec.conflict).unwrap();
    let solo = m.block_time(0..1, Versions::Multi, 0, clean.exec.cores, 0);
    p.task_done(
        t(9001),
        &TaskReport { compute: Some(Duration::from_secs_f64(solo * 3e-6)), ..TaskReport::of(clean.task) },
    );
    assert!(p.level() > 0);
}

/// A query the driver ends early (a block of it failed; its error is its result) completes
/// `Ok` at that block's end and runs no more blocks; its cores go to the next query.
#[test]
fn a_query_ended_early_completes_at_its_block_s_end() {
    let m = Arc::new(uneven(4));
    let mut p = TenantPolicy::new(TenantConfig::new(4, Scheme::LayerWise, vec![m])).unwrap();
    let t = Time::from_micros;
    p.arrive(t(0), arrival(1, 0));
    let first = launches(&mut p);
    assert_eq!(first.len(), 1);
    p.end_early(t(5), 1);
    p.task_done(t(10), &TaskReport::of(first[0].task));
    let d = drain(&mut p);
    assert!(matches!(d[..], [Decision::Complete { id: 1, code: Code::Ok }]), "{d:?}");
    assert_eq!((p.queued(), p.running(), p.free_cores()), (0, 0, 4));
    p.end_early(t(11), 1); // completed: ignored
    p.arrive(t(12), arrival(2, 0));
    assert_eq!(launches(&mut p).len(), 1, "the next query runs");
}
