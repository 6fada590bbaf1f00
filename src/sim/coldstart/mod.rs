//! Cold-start serving on simulated GPUs (DeepPlan, EuroSys'23), at the paper's scale: four
//! V100s on two PCIe switches with NVLink, per-layer costs synthesised for the paper's eight
//! models ([`models`]), the plans of [`crate::plan::deepplan`], and the engine that serves
//! requests with them ([`serving`]) over links that share bandwidth ([`fabric`]).
//!
//! * [`single`] — one cold inference on an idle machine (Fig. 11, Table 4's first column), or
//!   two at once on partner GPUs (Table 4's last column);
//! * [`experiment`] — the synthetic serving experiment (Fig. 13): Poisson arrivals over `N`
//!   instances, goodput under an SLO, cold rate and p99.
//!
//! Every figure here is simulated.

pub mod fabric;
pub mod models;
pub mod serving;

#[cfg(test)]
mod tests;

use rand::SeedableRng;
use rand::rngs::StdRng;
use rand_distr::{Distribution, Exp, Uniform};
use serde::Serialize;

pub use serving::{Arrival, Machine, Record, Strategy, serve};

use crate::error::Result;
use crate::plan::deepplan::ColdProfile;

/// Latencies of cold inferences started at t = 0 on each GPU of `gpus` (positions), each for a
/// model instance homed there, with nothing resident.
pub fn single(
    machine: &Machine,
    profile: &ColdProfile,
    strategy: Strategy,
    gpus: &[usize],
) -> Result<Vec<f64>> {
    let arrivals: Vec<Arrival> = gpus.iter().map(|&g| Arrival { at_ms: 0.0, instance: g }).collect();
    Ok(serve(machine, profile, strategy, &arrivals)?.iter().map(Record::latency_ms).collect())
}

/// The serving experiment's parameters.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Workload {
    /// Model instances (independent copies), requested uniformly.
    pub instances: usize,
    /// Total Poisson arrival rate, requests per second.
    pub rate: f64,
    /// Requests served before measuring (filling device memory).
    pub warmup: usize,
    /// Requests measured (the artifact measures 100·λ).
    pub measured: usize,
    pub seed: u64,
}

impl Workload {
    /// The paper's BERT-Base experiment at `instances`: λ = 100, 100·λ requests measured after
    /// a warm-up of 2,000.
    pub fn paper(instances: usize, seed: u64) -> Workload {
        Workload { instances, rate: 100.0, warmup: 2000, measured: 10_000, seed }
    }

    /// The arrivals, in time order.
    pub fn arrivals(&self) -> Vec<Arrival> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        let gap = Exp::new(self.rate / 1e3).expect("a positive rate");
        let pick = Uniform::new(0, self.instances.max(1)).expect("at least one instance");
        let mut t = 0.0;
        (0..self.warmup + self.measured)
            .map(|_| {
                t += gap.sample(&mut rng);
                Arrival { at_ms: t, instance: pick.sample(&mut rng) }
            })
            .collect()
    }
}

/// The share of requests within one SLO.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Goodput {
    pub slo_ms: f64,
    /// Percent of measured requests within `slo_ms`.
    pub goodput_pct: f64,
}

/// What measured requests saw: percentiles as the artifact computes them
/// (`sorted[⌊q·n⌋ − 1]`), cold rate and goodput under each SLO. Shared by the simulator's
/// experiments and `serve bench coldstart`'s real runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Summary {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    /// Percent of measured requests that found their instance cold.
    pub cold_pct: f64,
    pub goodput: Vec<Goodput>,
}

impl Summary {
    /// Of `(latency ms, cold)` per measured request.
    pub fn of(requests: &[(f64, bool)], slos: &[f64]) -> Summary {
        let n = requests.len().max(1) as f64;
        let mut lat: Vec<f64> = requests.iter().map(|r| r.0).collect();
        lat.sort_by(f64::total_cmp);
        let at =
            |q: f64| lat.get(((q * lat.len() as f64) as usize).saturating_sub(1)).copied().unwrap_or(0.0);
        Summary {
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            mean_ms: lat.iter().sum::<f64>() / n,
            cold_pct: 100.0 * requests.iter().filter(|r| r.1).count() as f64 / n,
            goodput: slos
                .iter()
                .map(|&slo_ms| Goodput {
                    slo_ms,
                    goodput_pct: 100.0 * lat.iter().filter(|&&l| l <= slo_ms).count() as f64 / n,
                })
                .collect(),
        }
    }

    /// Goodput under the first SLO (0 with none).
    pub fn goodput_pct(&self) -> f64 {
        self.goodput.first().map_or(0.0, |g| g.goodput_pct)
    }
}

/// One strategy's outcome on a [`Workload`].
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outcome {
    pub strategy: String,
    pub instances: usize,
    /// Instances the four GPUs hold at once.
    pub fit: usize,
    #[serde(flatten)]
    pub summary: Summary,
}

/// Instances of `profile` the machine holds at once under `strategy` (each GPU holds whole
/// instances of its plan's device bytes in its capacity).
pub fn fit(machine: &Machine, profile: &ColdProfile, strategy: Strategy) -> usize {
    machine
        .topology
        .gpus
        .iter()
        .map(|g| {
            let need = strategy.plan_on(machine, profile, g.id).device_bytes.max(1);
            usize::try_from(machine.capacity() / need).unwrap_or(usize::MAX)
        })
        .sum()
}

/// Runs `workload` with `strategy` once and measures it against each of `slos`.
pub fn experiment(
    machine: &Machine,
    profile: &ColdProfile,
    strategy: Strategy,
    workload: &Workload,
    slos: &[f64],
) -> Result<Outcome> {
    let records = serve(machine, profile, strategy, &workload.arrivals())?;
    let measured: Vec<(f64, bool)> =
        records[workload.warmup.min(records.len())..].iter().map(|r| (r.latency_ms(), r.cold)).collect();
    Ok(Outcome {
        strategy: strategy.name().to_string(),
        instances: workload.instances,
        fit: fit(machine, profile, strategy),
        summary: Summary::of(&measured, slos),
    })
}
