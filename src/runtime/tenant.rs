//! The runtime's tenant mode (VELTAIR, ARCHITECTURE.md §7.9): several layer models share a pool
//! of CPU cores, each with its own QoS target, under one [`TenantPolicy`] (a policy group).
//! A query runs as a chain of layer blocks; each block is a task of one row on a worker of its
//! own, on an exclusive lease of cores that the engine turns into CPUs (`EngineGroup::cpus`):
//! the block's threads are pinned one to each leased CPU (`backend/cpu/layered.rs`), and no CPU
//! is leased to two blocks of the group at once. (Two groups, or a group and another load's
//! profiling, each take the first `C` CPUs: they share them.) What one block leaves is the next one's input (the engine
//! moves it from block to block); the last block's output is the request's result.
//!
//! [`Runtime::add_tenants`] profiles each model at load, before any of them serves, on the
//! runner it will serve with and on pinned CPUs as in serving: each layer alone, one row, at
//! every core count `1..=C` (up to 16; past that at 16 counts spread over `1..=C`, the rest
//! interpolated), the median of [`PROFILE_RUNS`] runs of the stream's own timing. That is the
//! solo table `T(l, c)`. The interference levels are the scale of the slowdown proxy the
//! policy reads (its level is the observed slowdown placed among the levels' predictions):
//! level `k` is the solo table slowed by `k ×` [`TenantOptions::level_step`]. A table measured
//! beside a memory antagonist per level (`serve profile --versions` measures one for a single
//! product) would stop the serving models for the length of the sweep, so load does not take it.
//! There is one kernel version per layer (the layer runner's): the multi-version choice of
//! Veltair-FULL and -AC is the solo-best here, so FULL behaves as -AS in this mode.
//!
//! A model whose whole chain cannot meet its QoS on every core alone is **flagged**
//! ([`Tenant::feasible`] is false) and served best-effort, as the spec asks.

use std::sync::Arc;
use std::time::Duration;

use super::engine::EngineGroup;
use super::{Model, Runtime, check};
use crate::backend::cpu::affinity::allowed_cpus;
use crate::backend::{Runner, RunnerShape, TaskData, Work};
use crate::error::{Code, Error, Result};
use crate::model::Network;
use crate::sched::tenant::{self, CapRule, LayerProfile, Scheme, TenantConfig, TenantModel, TenantPolicy};

/// Runs of a layer at a core count whose median the profile takes.
pub const PROFILE_RUNS: usize = 5;
/// Core counts profiled at most (the others interpolated).
const PROFILED_COUNTS: usize = 16;

/// How [`Runtime::add_tenants`] shares the cores.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantOptions {
    /// The scheme: VELTAIR, an ablation or a baseline (default [`Scheme::Veltair`]).
    pub scheme: Scheme,
    /// How an adaptive block that starts at a pivot ends (default [`CapRule::Cap`], the spec's R).
    pub rule: CapRule,
    /// `C`, the cores shared: the first `C` CPUs the calling thread may run on (the process's,
    /// unless the thread was pinned). 0: as many as it may run on, at most the CPU backend's
    /// compute threads.
    pub cores: usize,
    /// Interference levels of the profile (level 0: solo), 1 to 16 (default 5).
    pub levels: usize,
    /// The slowdown one interference level adds (default 0.25: level 4 is twice the solo time).
    pub level_step: f64,
    /// The share of each QoS target the layer budgets sum to, the rest headroom for queueing
    /// (default 0.85, as the simulator plans).
    pub plan_share: f64,
    /// Each tenant's admission bound (default: the runtime's).
    pub admission_bound: Option<usize>,
}

impl Default for TenantOptions {
    fn default() -> Self {
        TenantOptions {
            scheme: Scheme::Veltair,
            rule: CapRule::Cap,
            cores: 0,
            levels: 5,
            level_step: 0.25,
            plan_share: 0.85,
            admission_bound: None,
        }
    }
}

/// A model to serve as a tenant.
#[derive(Clone)]
pub struct TenantSpec {
    pub net: Arc<Network>,
    pub name: String,
    /// Its QoS target: a query should complete within it (submit with a deadline to enforce it).
    pub qos: Duration,
    /// Its layer tables measured before on this machine (an earlier tenant's
    /// `profile.layers()`: the same model, pool and levels), used instead of profiling again;
    /// `None`: profiled at load.
    pub layers: Option<Vec<LayerProfile>>,
}

impl TenantSpec {
    pub fn new(net: Arc<Network>, name: &str, qos: Duration) -> TenantSpec {
        TenantSpec { net, name: name.to_string(), qos, layers: None }
    }
}

/// A tenant being served: its handle, and the profile its scheduler plans with.
#[derive(Clone)]
pub struct Tenant {
    pub model: Model,
    pub profile: Arc<TenantModel>,
}

impl Tenant {
    /// Whether its chain of layers meets its QoS alone on every core (when not, it is served
    /// best-effort).
    pub fn feasible(&self) -> bool {
        self.profile.feasible()
    }

    /// Its profiled time alone on every core, the whole chain.
    pub fn solo(&self) -> Duration {
        self.profile.solo()
    }
}

impl Runtime {
    /// Serve `specs` as tenants sharing a pool of CPU cores under one VELTAIR-style scheduler
    /// (the module documentation): each model is prepared with one worker per core, profiled,
    /// and handed to the engine with the others as one group. The CPU backend only
    /// (`UNSUPPORTED` on a device). `INVALID_ARGUMENT` for no model (or more than
    /// [`tenant::MAX_TENANTS`]), a model without layers (recurrent), a core count this process
    /// cannot run on, or options out of range; a layer that fails while profiled fails the
    /// call, naming it. More tenants than cores is allowed (queries wait for cores).
    pub fn add_tenants(&self, specs: Vec<TenantSpec>, opts: TenantOptions) -> Result<Vec<Tenant>> {
        if self.shared.backend.kind() != crate::BackendKind::Cpu {
            return Err(Error::new(
                Code::Unsupported,
                "the tenant mode shares CPU cores; this runtime's backend is a device",
            ));
        }
        if specs.is_empty() || specs.len() > tenant::MAX_TENANTS {
            return Err(Error::invalid(format!(
                "{} tenant models (1 to {})",
                specs.len(),
                tenant::MAX_TENANTS
            )));
        }
        if !(1..=tenant::profile::MAX_LEVELS).contains(&opts.levels) {
            return Err(Error::invalid(format!(
                "{} interference levels (1 to {})",
                opts.levels,
                tenant::profile::MAX_LEVELS
            )));
        }
        if !(opts.level_step.is_finite() && opts.level_step >= 0.0 && opts.level_step <= 10.0) {
            return Err(Error::invalid(format!("a level step of {} (0 to 10)", opts.level_step)));
        }
        let bound = opts.admission_bound.unwrap_or(self.shared.default_bound);
        check::admission_bound(bound)?;
        let cpus = pool_cpus(opts.cores, self.shared.backend.cpu_threads())?;
        let cores = cpus.len();
        let mut prepared = Vec::with_capacity(specs.len());
        for spec in &specs {
            tenant::profile::check_qos(&spec.name, spec.qos)?;
        }
        for spec in &specs {
            spec.net.check()?;
            if spec.net.layers().is_empty() {
                return Err(Error::invalid(format!(
                    "tenant `{}` is a {} model: the tenant mode serves layer models (mlp, resnet, bert, \
                     custom layered)",
                    spec.name,
                    spec.net.kind()
                )));
            }
            let notify = self.shared.notify();
            let runner: Arc<dyn Runner> = Arc::from(self.shared.backend.prepare(
                spec.net.clone(),
                RunnerShape::fixed(cores, 1),
                notify,
            )?);
            let profile = match &spec.layers {
                None => profile(spec, &*runner, &cpus, &opts)?,
                Some(layers) => reuse(spec, layers, cores, &opts)?,
            };
            prepared.push((runner, Arc::new(profile)));
        }
        let profiles: Vec<Arc<TenantModel>> = prepared.iter().map(|(_, p)| p.clone()).collect();
        let mut cfg = TenantConfig::new(cores, opts.scheme, profiles);
        cfg.rule = opts.rule;
        let policy = TenantPolicy::new(cfg)?;
        let gate = self.shared.gate.read().unwrap_or_else(|p| p.into_inner());
        if !*gate {
            return Err(Error::new(Code::Shutdown, "the runtime is shut down"));
        }
        let mut models = Vec::with_capacity(specs.len());
        let mut tenants = Vec::with_capacity(specs.len());
        for (spec, (runner, profile)) in specs.into_iter().zip(prepared) {
            let (index, em, model) = self.register(spec.net, spec.name, runner, None, bound);
            models.push((index, em));
            tenants.push(Tenant { model, profile });
        }
        self.add_group(EngineGroup { policy: Box::new(policy), models, cpus })?;
        drop(gate);
        Ok(tenants)
    }
}

/// The CPUs of a pool of `cores` cores (0: every CPU the calling thread may run on, at most
/// `threads`, the CPU backend's compute threads).
fn pool_cpus(cores: usize, threads: usize) -> Result<Vec<usize>> {
    let allowed = allowed_cpus();
    let most = allowed.len().min(threads.max(1));
    let cores = if cores == 0 { most } else { cores };
    if cores > most || cores > tenant::profile::MAX_CORES {
        return Err(Error::invalid(format!(
            "a pool of {cores} cores: this thread may run on {} CPUs and the CPU backend has {threads} \
             compute threads",
            allowed.len()
        )));
    }
    Ok(allowed[..cores].to_vec())
}

/// The core counts profiled on a pool of `cores`: all of them up to [`PROFILED_COUNTS`], else
/// that many spread over `1..=cores` (1 and `cores` included).
fn profiled_counts(cores: usize) -> Vec<usize> {
    if cores <= PROFILED_COUNTS {
        return (1..=cores).collect();
    }
    let mut counts: Vec<usize> =
        (0..PROFILED_COUNTS).map(|i| 1 + (i * (cores - 1)).div_ceil(PROFILED_COUNTS - 1)).collect();
    counts.dedup();
    counts
}

/// Run one task on worker 0 of `runner` and wait for it (the runner is not serving yet: its
/// streams run nothing else); its output and the stream's timing of it.
fn run_one(runner: &dyn Runner, task: Arc<TaskData>) -> Result<(Vec<f32>, Duration)> {
    let target = runner.launch(0, task.clone())?;
    let signal = runner.signal(0);
    while signal.completed() < target {
        std::thread::park_timeout(Duration::from_micros(50));
    }
    runner.collect(0, &task);
    let mut io = task.io.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = io.error.take() {
        return Err(e);
    }
    let took = io.stages.compute.unwrap_or_default();
    Ok((std::mem::take(&mut io.output), took))
}

/// The tenant profile of `spec` (the module documentation), measured on `runner` with leases of
/// the first `c` of `cpus`.
fn profile(
    spec: &TenantSpec,
    runner: &dyn Runner,
    cpus: &[usize],
    opts: &TenantOptions,
) -> Result<TenantModel> {
    let layers = spec.net.layers();
    let bounds = spec.net.layer_bounds();
    let counts = profiled_counts(cpus.len());
    let mut input = vec![0.0f32; bounds[0]];
    let mut out = Vec::with_capacity(layers.len());
    for (k, l) in layers.iter().enumerate() {
        let cannot = |e: Error| {
            Error::new(
                e.code(),
                format!("tenant `{}`: layer `{}` cannot be profiled: {}", spec.name, l.name, e.message()),
            )
        };
        let mut measured = Vec::with_capacity(counts.len());
        let mut next = Vec::new();
        for &c in &counts {
            let mut runs = Vec::with_capacity(PROFILE_RUNS + 1);
            for _ in 0..=PROFILE_RUNS {
                let work = Work::Layers { first: k, last: k + 1, input: input.clone() };
                let (output, took) =
                    run_one(runner, TaskData::leased(1, c, cpus[..c].to_vec(), work)).map_err(cannot)?;
                if output.len() != bounds[k + 1] {
                    return Err(cannot(Error::internal(format!(
                        "{} output values, the layer gives {}",
                        output.len(),
                        bounds[k + 1]
                    ))));
                }
                runs.push(took.as_secs_f64() * 1e6);
                next = output;
            }
            // The first run warms the lease's threads and caches: left out.
            let mut runs = runs.split_off(1);
            runs.sort_by(f64::total_cmp);
            measured.push(runs[runs.len() / 2].clamp(tenant::profile::MIN_US, tenant::profile::MAX_US));
        }
        input = next;
        let solo = interpolate(&counts, &measured, cpus.len());
        let table = (0..opts.levels)
            .map(|lv| {
                solo.iter()
                    .map(|t| (t * (1.0 + lv as f64 * opts.level_step)).min(tenant::profile::MAX_US))
                    .collect()
            })
            .collect();
        out.push(LayerProfile {
            name: l.name.clone(),
            flops: (l.flops_per_row as f64).max(1.0),
            versions: vec![table],
        });
    }
    TenantModel::new(&spec.name, spec.qos, out)?.with_headroom(opts.plan_share)
}

/// A profile from tables measured before: one per layer of the model, each on this pool's core
/// count and the options' levels.
fn reuse(
    spec: &TenantSpec,
    layers: &[LayerProfile],
    cores: usize,
    opts: &TenantOptions,
) -> Result<TenantModel> {
    let want = spec.net.layers().len();
    let shape = |l: &LayerProfile| l.versions.first().map(|v| (v.len(), v.first().map_or(0, Vec::len)));
    if layers.len() != want || layers.iter().any(|l| shape(l) != Some((opts.levels, cores))) {
        return Err(Error::invalid(format!(
            "tenant `{}`: its given profile has {} layers of {:?} levels × cores; the model has {want} layers \
             and the pool {} levels × {cores} cores",
            spec.name,
            layers.len(),
            layers.first().and_then(shape),
            opts.levels
        )));
    }
    TenantModel::new(&spec.name, spec.qos, layers.to_vec())?.with_headroom(opts.plan_share)
}

/// The times at every core count `1..=cores` from those measured at `counts` (ascending, 1
/// first, `cores` last): linear between neighbours.
fn interpolate(counts: &[usize], measured: &[f64], cores: usize) -> Vec<f64> {
    (1..=cores)
        .map(|c| {
            let i = counts.partition_point(|&n| n < c);
            match (counts.get(i), i.checked_sub(1)) {
                (Some(&n), _) if n == c => measured[i],
                (Some(&hi), Some(lo)) => {
                    let (a, b) = (counts[lo], hi);
                    let w = (c - a) as f64 / (b - a) as f64;
                    measured[lo] + w * (measured[i] - measured[lo])
                }
                _ => measured[measured.len() - 1],
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiled_counts_cover_the_pool_and_interpolation_fills_the_rest() {
        assert_eq!(profiled_counts(3), vec![1, 2, 3]);
        let c = profiled_counts(64);
        assert_eq!((c[0], *c.last().unwrap()), (1, 64));
        assert!(c.len() <= PROFILED_COUNTS && c.windows(2).all(|w| w[0] < w[1]), "{c:?}");
        let t = interpolate(&[1, 3, 5], &[30.0, 10.0, 6.0], 5);
        assert_eq!(t, vec![30.0, 20.0, 10.0, 8.0, 6.0]);
    }

    #[test]
    fn a_pool_larger_than_the_process_may_run_on_is_refused() {
        let allowed = allowed_cpus().len();
        assert_eq!(pool_cpus(0, 1).unwrap().len(), 1);
        assert_eq!(pool_cpus(0, 4096).unwrap().len(), allowed);
        let e = pool_cpus(allowed + 1, 4096).unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("CPUs"), "{e}");
    }
}
