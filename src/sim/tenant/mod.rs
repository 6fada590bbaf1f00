//! The multi-tenant simulator (VELTAIR at 64 cores; ARCHITECTURE.md §7.9, §8): the runtime's
//! [`EngineCore`] with one [`TenantPolicy`] serving every tenant model, on virtual time, each
//! block's work from the [`cost`] model: its layers' solo times in the versions it runs, on its
//! cores, plus a thread-start cost when it is a conflicted unit; it progresses at
//! `1 / (1 + α·P)` for the pressure `P` of the blocks running beside it, recomputed whenever a
//! block starts or ends.
//!
//! Poisson arrivals of the workload's models (each its share of the rate), one seed per run;
//! a query meets its QoS when its latency (arrival to completion) is within its model's target.
//! [`qps_at_95`] searches the highest rate at which ≥ 95% of the queries meet theirs, by
//! bisection over the rate with the seed fixed. Same seed ⇒ the identical decision trace.

pub mod cost;
pub mod models;

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Exp, LogNormal};

use crate::error::{Code, Error, Result};
use crate::runtime::core::{CoreOutput, EngineCore, RowEnd, Submit};
use crate::sched::tenant::{CapRule, Scheme, TenantConfig, TenantModel, TenantPolicy};
use crate::sched::{ModelId, TaskId, TaskReport, TaskShape, Time};
use cost::{Machine, ModelCost};
use models::ModelShape;

/// Most queries one simulated run may have.
pub const MAX_QUERIES: usize = 10_000_000;

/// The spec's workloads: the models of a QoS class at equal rates, or all seven with rates in
/// proportion to 1/QoS (Mix).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    Light,
    Medium,
    Heavy,
    Mix,
}

impl Workload {
    pub fn parse(s: &str) -> Result<Workload> {
        Ok(match s {
            "light" => Workload::Light,
            "medium" => Workload::Medium,
            "heavy" => Workload::Heavy,
            "mix" => Workload::Mix,
            _ => return Err(Error::invalid(format!("unknown workload `{s}` (light, medium, heavy, mix)"))),
        })
    }

    /// Its models, and each one's share of the arrivals.
    pub fn models(self) -> Vec<(ModelShape, f64)> {
        use models::QosClass;
        let all: Vec<ModelShape> = models::all().into_iter().map(sim_variant).collect();
        let class = |c: QosClass| -> Vec<(ModelShape, f64)> {
            let of: Vec<ModelShape> = all.iter().filter(|m| m.class == c).cloned().collect();
            let n = of.len() as f64;
            of.into_iter().map(|m| (m, 1.0 / n)).collect()
        };
        match self {
            Workload::Light => class(QosClass::Light),
            Workload::Medium => class(QosClass::Medium),
            Workload::Heavy => class(QosClass::Heavy),
            Workload::Mix => {
                let total: f64 = all.iter().map(|m| 1.0 / m.qos_ms).sum();
                all.into_iter()
                    .map(|m| {
                        let share = 1.0 / m.qos_ms / total;
                        (m, share)
                    })
                    .collect()
            }
        }
    }
}

/// The sizes the simulator runs (the paper gives none). SSD-ResNet34 at 1200² (433 GFLOP) cannot
/// meet 100 ms on 64 AVX2 cores at any efficiency (4.3 TFLOP/s of a 5.9 peak): it runs at 300²
/// (27 GFLOP; feature maps `M / 16`). BERT-Large at sequence 384 (246 GFLOP) would hold nearly
/// the whole machine for its 130 ms on this cost model: it runs at sequence 128 (82 GFLOP), a
/// heavy model that still needs a third of the machine.
fn sim_variant(mut m: ModelShape) -> ModelShape {
    match m.name {
        "ssd-resnet34" => {
            for l in &mut m.layers {
                l.m = l.m.div_ceil(16);
            }
            m
        }
        "bert-large" => models::bert_large_at(128),
        _ => m,
    }
}

/// The models of a workload on a machine: their costs, profiles and arrival shares.
pub struct Setup {
    pub machine: Machine,
    pub costs: Vec<ModelCost>,
    pub profiles: Vec<Arc<TenantModel>>,
    pub shares: Vec<f64>,
    /// Each model's [`solo`](Setup::solo) latency, computed once.
    solo: Vec<Duration>,
}

impl Setup {
    pub fn new(machine: Machine, workload: Workload) -> Result<Setup> {
        let models = workload.models();
        let shapes: Vec<&ModelShape> = models.iter().map(|(m, _)| m).collect();
        let costs: Vec<ModelCost> = shapes.iter().map(|s| cost::model_cost(&machine, s, &shapes)).collect();
        let profiles = costs.iter().map(|c| c.profile(&machine).map(Arc::new)).collect::<Result<Vec<_>>>()?;
        let shares = models.iter().map(|(_, s)| *s).collect();
        let solo = profiles.iter().map(|p| solo_latency(p, machine.cores)).collect();
        Ok(Setup { machine, costs, profiles, shares, solo })
    }

    /// A model's latency alone on the machine: each layer in its fastest version on every core
    /// (as many as help), no interference (the lower bound the paper divides by).
    pub fn solo(&self, model: ModelId) -> Duration {
        self.solo[model]
    }
}

fn solo_latency(p: &TenantModel, cores: usize) -> Duration {
    let us: f64 = (0..p.layers().len())
        .map(|l| {
            (0..p.layers()[l].versions.len())
                .map(|v| p.time(l, v as u8, cores, 0))
                .fold(f64::INFINITY, f64::min)
        })
        .sum();
    Duration::from_secs_f64(us * 1e-6)
}

/// What one simulated run measured.
#[derive(Clone, Debug, Default)]
pub struct TenantOutcome {
    /// Per completed query: its model and latency.
    pub latencies: Vec<(ModelId, Duration)>,
    /// Queries within their model's QoS.
    pub met: usize,
    /// Per model: queries completed, and those within its QoS.
    pub by_model: Vec<(usize, usize)>,
    /// Units (tasks) launched, and those that were conflicts.
    pub units: u64,
    pub conflicts: u64,
    /// Σ cores × duration over every unit, and the span from the first arrival to the last
    /// completion: their ratio is the mean cores in use.
    pub core_time: Duration,
    pub span: Duration,
    /// Peak cores leased at once.
    pub peak_cores: usize,
    /// Wall time spent in the engine core and policy (decisions), for the overhead check.
    pub decide: Duration,
    /// Every launch: (time, model, first layer, last layer, cores, version), when traced.
    pub trace: Vec<(Time, ModelId, u32, u32, usize, u32)>,
}

impl TenantOutcome {
    /// Share of the queries within their QoS.
    pub fn met_share(&self) -> f64 {
        if self.latencies.is_empty() { 0.0 } else { self.met as f64 / self.latencies.len() as f64 }
    }

    pub fn conflict_rate(&self) -> f64 {
        if self.units == 0 { 0.0 } else { self.conflicts as f64 / self.units as f64 }
    }

    pub fn mean_cores(&self) -> f64 {
        let span = self.span.as_secs_f64();
        if span > 0.0 { self.core_time.as_secs_f64() / span } else { 0.0 }
    }

    /// Mean over queries of latency ÷ its model's solo latency.
    pub fn latency_over_solo(&self, setup: &Setup) -> f64 {
        let n = self.latencies.len().max(1) as f64;
        self.latencies.iter().map(|(m, l)| l.as_secs_f64() / setup.solo(*m).as_secs_f64()).sum::<f64>() / n
    }
}

/// One run's parameters.
#[derive(Clone, Copy, Debug)]
pub struct Run {
    pub scheme: Scheme,
    pub rule: CapRule,
    /// Queries per second, all models together.
    pub rate: f64,
    pub queries: usize,
    pub seed: u64,
    pub trace: bool,
    /// [`TenantConfig::time_left`].
    pub time_left: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    Arrive(usize),
    /// The running blocks' earliest end, as predicted under this generation of their rates
    /// (stale once a block started or ended since).
    End(u64),
    Wake,
}

/// A block running in the simulation. It has `left` µs of solo work to do and progresses at
/// `rate` solo µs per µs, `1 / (1 + α·P)` for the pressure `P` of the other blocks running now:
/// when a block starts or ends every rate is computed again, so a long block is slowed by the
/// blocks that start beside it after it did, not only by those it started beside.
struct Running {
    cores: usize,
    /// Bytes per µs it puts on the shared cache and memory.
    pressure: f64,
    /// Its sensitivity: its layers' α weighted by their solo times.
    alpha: f64,
    left: f64,
    rate: f64,
    started: Time,
}

/// The running blocks and their shared progress.
#[derive(Default)]
struct Blocks {
    running: std::collections::BTreeMap<TaskId, Running>,
    /// When `left` was last brought up to date.
    last: Time,
    generation: u64,
}

impl Blocks {
    /// Every running block's progress up to `now` at its current rate.
    fn advance(&mut self, now: Time) {
        let dt = now.since(self.last).as_secs_f64() * 1e6;
        for r in self.running.values_mut() {
            r.left = (r.left - dt * r.rate).max(0.0);
        }
        self.last = now;
    }

    /// The blocks whose work is done at `now` (within a nanosecond), taken out.
    fn finished(&mut self) -> Vec<(TaskId, Running)> {
        let done: Vec<TaskId> =
            self.running.iter().filter(|(_, r)| r.left / r.rate < 1e-3).map(|(&t, _)| t).collect();
        done.into_iter().filter_map(|t| self.running.remove(&t).map(|r| (t, r))).collect()
    }

    /// Compute every rate again from the pressure running now; the earliest end under the new
    /// generation.
    fn rerate(&mut self, now: Time, bandwidth: f64) -> Option<(Time, u64)> {
        self.generation += 1;
        let total: f64 = self.running.values().map(|r| r.pressure).sum();
        let mut first = f64::INFINITY;
        for r in self.running.values_mut() {
            r.rate = 1.0 / (1.0 + r.alpha * (total - r.pressure).max(0.0) / bandwidth);
            first = first.min(r.left / r.rate);
        }
        first.is_finite().then(|| {
            (now + Duration::from_secs_f64(first * 1e-6).max(Duration::from_nanos(1)), self.generation)
        })
    }
}

/// Simulate `run` on `setup`.
pub fn simulate(setup: &Setup, run: &Run) -> Result<TenantOutcome> {
    if run.queries == 0 || run.queries > MAX_QUERIES {
        return Err(Error::invalid(format!("{} queries (1 to {MAX_QUERIES})", run.queries)));
    }
    if !(run.rate.is_finite() && run.rate > 0.0) {
        return Err(Error::invalid(format!("a rate of {} queries/s", run.rate)));
    }
    let m = &setup.machine;
    let mut cfg = TenantConfig::new(m.cores, run.scheme, setup.profiles.clone());
    cfg.rule = run.rule;
    cfg.time_left = run.time_left;
    let mut core: EngineCore<(ModelId, Time)> = EngineCore::default();
    core.add_group(0, Box::new(TenantPolicy::new(cfg)?));
    for i in 0..setup.profiles.len() {
        core.add_model(i, 0, 0, 0);
    }
    // Arrivals: one Poisson stream at the total rate, each query's model drawn by share.
    let mut rng = StdRng::seed_from_u64(run.seed);
    let gap = Exp::new(run.rate).map_err(|e| Error::invalid(e.to_string()))?;
    let spawn = LogNormal::new(100f64.ln(), 1.256).map_err(|e| Error::internal(e.to_string()))?;
    let mut arrivals = Vec::with_capacity(run.queries);
    let mut at = 0.0;
    for _ in 0..run.queries {
        at += gap.sample(&mut rng);
        let mut u: f64 = rng.random();
        let mut model = setup.shares.len() - 1;
        for (i, s) in setup.shares.iter().enumerate() {
            if u < *s {
                model = i;
                break;
            }
            u -= s;
        }
        arrivals.push((Time::ZERO + Duration::from_secs_f64(at), model));
    }
    let mut heap: BinaryHeap<Reverse<(Time, u64, Ev)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |heap: &mut BinaryHeap<_>, at: Time, ev: Ev| {
        seq += 1;
        heap.push(Reverse((at, seq, ev)));
    };
    push(&mut heap, arrivals[0].0, Ev::Arrive(0));
    let mut blocks = Blocks::default();
    let mut out = TenantOutcome::default();
    let mut leased = 0usize;
    let mut last = Time::ZERO;
    let mut wake: Option<Time> = None;
    while let Some(Reverse((now, _, ev))) = heap.pop() {
        let t0 = Instant::now();
        let mut changed = false;
        match ev {
            Ev::Arrive(i) => {
                if let Some(&(next, _)) = arrivals.get(i + 1) {
                    push(&mut heap, next, Ev::Arrive(i + 1));
                }
                let model = arrivals[i].1;
                let s = Submit {
                    model,
                    id: i as u64,
                    graph: None,
                    slots_needed: 0,
                    deadline: None,
                    priority: 0,
                    input_ready: true,
                    data: (model, now),
                };
                core.submit(now, s).map_err(|_| Error::internal("a simulated tenant is not served"))?;
            }
            Ev::End(generation) => {
                if generation == blocks.generation {
                    // Predicted ends are rounded to the nanosecond: a block a sliver short of done
                    // gets a new end, never none.
                    changed = true;
                    blocks.advance(now);
                    for (task, r) in blocks.finished() {
                        changed = true;
                        leased -= r.cores;
                        let took = now.since(r.started);
                        out.core_time += took * u32::try_from(r.cores).unwrap_or(u32::MAX);
                        let report = TaskReport { compute: Some(took), ..TaskReport::of(task) };
                        core.task_done(now, 0, &report, |_, _, _| RowEnd::Continue);
                    }
                }
            }
            Ev::Wake => {
                if wake == Some(now) {
                    wake = None;
                }
            }
        }
        if core.next_wakeup().is_some_and(|w| w <= now) {
            core.tick(now);
        }
        while let Some(o) = core.poll() {
            match o {
                CoreOutput::Launch { group, task } => {
                    let t = core.task(group, task).expect("a launched task is in flight");
                    let TaskShape::Layers { first, last: last_layer } = t.shape else {
                        return Err(Error::internal("a tenant task that is not a layer block"));
                    };
                    let (mc, prof) = (&setup.costs[t.model], &setup.profiles[t.model]);
                    let versions = run.scheme.versions();
                    let (mut us, mut weighted, mut pressure) = (0.0, 0.0, 0.0);
                    for l in first as usize..=last_layer as usize {
                        let vi = prof.version(l, versions, t.exec.version as usize);
                        let v = &mc.layers[l].versions[usize::from(vi)];
                        // The profile's level-0 time is the solo time's envelope: a runner given
                        // more cores than help uses fewer.
                        let solo = prof.time(l, vi, t.exec.cores, 0);
                        us += solo;
                        weighted += solo * v.alpha;
                        pressure = f64::max(pressure, v.pressure * t.exec.cores as f64);
                    }
                    let alpha = if us > 0.0 { weighted / us } else { 0.0 };
                    if t.exec.conflict {
                        us += spawn.sample(&mut rng);
                        out.conflicts += 1;
                    }
                    out.units += 1;
                    leased += t.exec.cores;
                    out.peak_cores = out.peak_cores.max(leased);
                    if run.trace {
                        out.trace.push((now, t.model, first, last_layer, t.exec.cores, t.exec.version));
                    }
                    blocks.advance(now);
                    let r = Running {
                        cores: t.exec.cores,
                        pressure,
                        alpha,
                        left: us.max(1e-3),
                        rate: 1.0,
                        started: now,
                    };
                    blocks.running.insert(task, r);
                    changed = true;
                }
                CoreOutput::Complete { code, data: (model, arrived), .. } => {
                    if code != Code::Ok {
                        return Err(Error::internal(format!("a simulated query completed {code:?}")));
                    }
                    let l = now.since(arrived);
                    let met = l <= setup.profiles[model].qos();
                    out.met += usize::from(met);
                    if out.by_model.len() <= model {
                        out.by_model.resize(setup.profiles.len(), (0, 0));
                    }
                    out.by_model[model].0 += 1;
                    out.by_model[model].1 += usize::from(met);
                    out.latencies.push((model, l));
                    last = now;
                }
                CoreOutput::Released { .. } => {}
            }
        }
        if changed && let Some((at, generation)) = blocks.rerate(now, m.bandwidth) {
            push(&mut heap, at, Ev::End(generation));
        }
        if let Some(w) = core.next_wakeup() {
            // A wakeup still asked for at `now` comes a nanosecond later: time always advances.
            let w = w.max(Time(now.0 + 1));
            if wake.is_none_or(|cur| w < cur) {
                wake = Some(w);
                push(&mut heap, w, Ev::Wake);
            }
        }
        out.decide += t0.elapsed();
    }
    if !core.is_empty() {
        return Err(Error::internal("the tenant simulation ended with queries pending (a policy stalled)"));
    }
    out.span = last.since(arrivals[0].0);
    Ok(out)
}

/// The highest rate (queries/s) at which ≥ 95% of the queries meet their QoS, by bisection
/// between 0 and `hi` (doubled until it fails, at most 2^20 q/s), `steps` halvings, with the
/// run's seed; and the run at that rate.
pub fn qps_at_95(setup: &Setup, run: &Run, steps: u32) -> Result<(f64, Option<TenantOutcome>)> {
    let ok = |rate: f64| -> Result<(bool, TenantOutcome)> {
        let o = simulate(setup, &Run { rate, ..*run })?;
        Ok((o.met_share() >= 0.95, o))
    };
    let (mut lo, mut best) = (0.0, None);
    let mut hi = run.rate.max(1.0);
    loop {
        let (pass, o) = ok(hi)?;
        if !pass {
            break;
        }
        (lo, best) = (hi, Some(o));
        hi *= 2.0;
        if hi > (1 << 20) as f64 {
            return Ok((lo, best));
        }
    }
    for _ in 0..steps {
        let mid = 0.5 * (lo + hi);
        let (pass, o) = ok(mid)?;
        if pass {
            (lo, best) = (mid, Some(o));
        } else {
            hi = mid;
        }
    }
    Ok((lo, best))
}

#[cfg(test)]
mod tests;
