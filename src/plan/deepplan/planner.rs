//! The layer execution planner (DeepPlan §4.3.2): the pipeline stall model and Algorithm 1,
//! and the paper's "initial approach" as an ablation.
//!
//! **Stall model** (the artifact's `update_PEF`). The load stream copies the load set in layer
//! order, back to back from t = 0 (buffers are preallocated, so it never waits); execution is
//! serial. With the slack `s` (how far the execution stream's end is ahead of the load stream),
//! `s₀ = 0`:
//!
//! * a loaded layer stalls `max(0, Load − s)`, then `s = max(s − Load, 0) + InMem`;
//! * any other layer stalls 0, and `s` grows by its execution time (DHA, or InMem for a
//!   parameter-free layer).
//!
//! Latency = Σ execution + Σ stall. The arithmetic is the artifact's, operation for operation,
//! so plans and latencies agree with it exactly (tests: the oracle check).
//!
//! **Algorithm 1.** Start from the PipeSwitch plan (every layer with parameters loaded). For each
//! layer `i` in order whose stall is positive, the candidates are the layers `1..=i` (`i`
//! itself included) that have parameters and are still loaded, stably sorted by `PerfDiff`
//! ascending, ties toward the larger Load. For each candidate `j` in that order: stop if
//! `Stall_i < PerfDiff_j` (no candidate after it can help either), or if `DHA_j > InMem_j +
//! 1.5·Load_j` (the artifact's guard against a layer far slower read over the bus); otherwise set
//! `j` to DHA and `Stall_i −= Load_j + PerfDiff_j`; once `Stall_i ≤ 0`, re-simulate the whole
//! pipeline (later layers' stalls change) and go on with `i + 1`. When the candidates run out
//! with stall left, neither the paper nor the artifact re-simulates; [`PlanOptions::resim_always`]
//! does.

use serde::{Deserialize, Serialize};

use super::profile::{ColdProfile, LayerCost};

/// How one layer runs on a cold start.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// Load-then-execute: copied to device memory by the load stream, executed from there.
    Load,
    /// Direct host access: executed with its parameters left in mapped pinned host memory.
    Dha,
}

/// Which planner chooses the methods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Every layer with parameters loaded (PipeSwitch's plan; Baseline's too).
    AllLoad,
    /// The paper's initial approach: Embedding and BatchNorm layers by DHA, any other layer by
    /// DHA iff `DHA < InMem + Load`, ignoring the pipeline.
    Initial,
    /// Algorithm 1 over the stall model.
    #[serde(rename = "deepplan")]
    DeepPlan,
}

/// Planner options.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlanOptions {
    pub algorithm: Algorithm,
    /// Re-simulate after a layer whose candidates ran out with stall left (off: as the paper).
    pub resim_always: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions { algorithm: Algorithm::DeepPlan, resim_always: false }
    }
}

/// The stall model's outcome for one plan.
#[derive(Clone, Debug, PartialEq)]
pub struct Pipeline {
    /// Per layer, how long execution waited for its load (0 for DHA and parameter-free layers).
    pub stall_ms: Vec<f64>,
    /// Σ execution + Σ stall.
    pub latency_ms: f64,
}

/// The time layer `l` executes for under `method` (a parameter-free layer always in `exec_ms`).
pub fn exec_time(l: &LayerCost, method: Method) -> f64 {
    match method {
        Method::Dha if l.has_params() => l.dha_ms,
        _ => l.exec_ms,
    }
}

/// Whether layer `l` is copied by the load stream under `method`.
pub fn is_loaded(l: &LayerCost, method: Method) -> bool {
    method == Method::Load && l.has_params()
}

/// The stall model (module docs) for `plan` (one method per layer).
pub fn pipeline(profile: &ColdProfile, plan: &[Method]) -> Pipeline {
    assert_eq!(plan.len(), profile.layers.len(), "one method per layer");
    let mut slack = 0.0f64; // the artifact's `ready_time`
    let mut run = 0.0f64;
    let mut stall_ms = Vec::with_capacity(plan.len());
    for (l, &m) in profile.layers.iter().zip(plan) {
        let mut stall = 0.0;
        if is_loaded(l, m) {
            slack -= l.load_ms;
            if slack < 0.0 {
                stall += -slack;
                run += -slack;
                slack = 0.0;
            }
            slack += l.exec_ms;
            run += l.exec_ms;
        } else {
            let t = exec_time(l, m);
            slack += t;
            run += t;
        }
        stall_ms.push(stall);
    }
    Pipeline { stall_ms, latency_ms: run }
}

/// The plan that loads every layer with parameters.
pub fn all_load(profile: &ColdProfile) -> Vec<Method> {
    vec![Method::Load; profile.layers.len()]
}

/// The paper's initial approach ([`Algorithm::Initial`]).
pub fn initial_approach(profile: &ColdProfile) -> Vec<Method> {
    profile
        .layers
        .iter()
        .map(|l| {
            let by_kind = l.kind.contains("BatchNorm") || l.kind.contains("Embedding");
            if l.has_params() && (by_kind || l.dha_ms < l.exec_ms + l.load_ms) {
                Method::Dha
            } else {
                Method::Load
            }
        })
        .collect()
}

/// The artifact's guard: a layer this much slower over the bus is never read by DHA.
const OVERLOAD_FACTOR: f64 = 1.5;

/// Algorithm 1 (module docs).
pub fn algorithm1(profile: &ColdProfile, resim_always: bool) -> Vec<Method> {
    let layers = &profile.layers;
    let mut plan = all_load(profile);
    let mut trace = pipeline(profile, &plan);
    let mut candidates: Vec<usize> = Vec::with_capacity(layers.len());
    for i in 0..layers.len() {
        let mut stall = trace.stall_ms[i];
        if stall <= 0.0 {
            continue;
        }
        // Step 1: L_1..L_i not yet on DHA, by PerfDiff ascending, ties toward the larger Load
        // (a stable sort: remaining ties in layer order).
        candidates.clear();
        candidates.extend((0..=i).filter(|&j| is_loaded(&layers[j], plan[j])));
        candidates.sort_by(|&a, &b| {
            let (a, b) = (&layers[a], &layers[b]);
            a.perf_diff()
                .partial_cmp(&b.perf_diff())
                .expect("checked profiles hold finite times")
                .then(b.load_ms.partial_cmp(&a.load_ms).expect("checked profiles hold finite times"))
        });
        let mut cleared = false;
        for &j in &candidates {
            let l = &layers[j];
            let perf_diff = l.perf_diff();
            // Step 2: can L_j reduce Stall_i?
            if l.dha_ms > l.exec_ms + OVERLOAD_FACTOR * l.load_ms || stall < perf_diff {
                break;
            }
            // Step 3: L_j to DHA: its load leaves the stream, its execution grows by PerfDiff.
            plan[j] = Method::Dha;
            stall = stall - l.load_ms - perf_diff;
            // Step 4: the stall is gone: the later layers' stalls change.
            if stall <= 0.0 {
                trace = pipeline(profile, &plan);
                cleared = true;
                break;
            }
        }
        if !cleared && resim_always {
            trace = pipeline(profile, &plan);
        }
    }
    plan
}

/// The methods `options` choose for `profile`.
pub fn plan_methods(profile: &ColdProfile, options: PlanOptions) -> Vec<Method> {
    match options.algorithm {
        Algorithm::AllLoad => all_load(profile),
        Algorithm::Initial => initial_approach(profile),
        Algorithm::DeepPlan => algorithm1(profile, options.resim_always),
    }
}
