//! DeepPlan (EuroSys'23): cold-start plans. A model that is not in device memory is served by a
//! plan that says, per layer, whether to **load** its parameters (copied host → device by a load
//! stream while earlier layers execute) or to execute it by **direct host access** (DHA: the
//! kernel reads the parameters from mapped pinned host memory over the bus), chosen by
//! Algorithm 1 over a per-layer profile so the pipeline stalls least; with several GPUs, the
//! loaded layers also travel in parallel over distinct PCIe switches and are forwarded to the
//! executing GPU over NVLink.
//!
//! * [`profile`] — the cold-start profile (per layer: bytes, load, in-memory and DHA times);
//! * [`planner`] — the stall model, Algorithm 1, the initial approach;
//! * [`transmission`] — topology, partitions, arrival times under parallel transmission.
//!
//! [`plan`] puts them together: the plan `serve plan deepplan` writes.

pub mod planner;
pub mod profile;
pub mod transmission;

#[cfg(test)]
mod tests;

use serde::Serialize;

pub use planner::{
    Algorithm, Method, Pipeline, PlanOptions, algorithm1, all_load, initial_approach, pipeline,
};
pub use profile::{ColdProfile, LayerCost};
pub use transmission::{Helpers, Partition, Topology};

/// A cold-start plan for one model (the JSON `serve plan deepplan` writes; fields may be added,
/// never renamed).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ColdPlan {
    pub model: String,
    pub algorithm: Algorithm,
    /// One method per layer (parameter-free layers: `load`, meaning nothing to place).
    pub plan: Vec<Method>,
    /// The plan's cold latency: the stall model's, or with parallel transmission the uncontended
    /// arrival model's ([`transmission::arrivals`]).
    pub latency_ms: f64,
    /// The stall model's latency of the all-load plan (PipeSwitch), the reference.
    pub all_load_latency_ms: f64,
    /// Loaded layers by partition: the first goes to the executing GPU, partition `p` to
    /// secondary `p`. One partition without parallel transmission.
    pub partitions: Vec<Partition>,
    /// The GPUs the partitions are carried by when planned for a topology: primary first.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<u32>,
    /// Why parallel transmission is off, when a topology was given and it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub transmission_note: Option<String>,
    /// Bytes that stay on the host (DHA layers; they stay there while the instance is warm).
    pub host_bytes: u64,
    /// Bytes the instance occupies in device memory (the loaded layers).
    pub device_bytes: u64,
}

/// Plans `profile` with `options`; with a topology, for a cold start on `primary` with parallel
/// transmission over its helpers ([`Topology::helpers`]).
pub fn plan(profile: &ColdProfile, options: PlanOptions, topology: Option<(&Topology, u32)>) -> ColdPlan {
    let methods = planner::plan_methods(profile, options);
    let helpers = topology.map(|(t, primary)| (t.helpers(primary), t.nvlink_gbps));
    let mut p = complete(profile, options.algorithm, methods, helpers);
    if topology.is_some_and(|(t, primary)| t.index(primary).is_none()) {
        p.gpus.clear(); // no GPU to name: the note says the primary is not in the topology
    }
    p
}

/// The plan of methods chosen elsewhere (by hand, by a test), split into `k` partitions with
/// the paper's override, its latency by the stall model (one partition) or the uncontended
/// arrival model with NVLink 2.0 (several). Labelled with `algorithm`. INVALID_ARGUMENT unless
/// there is one method per layer and `k` is 1 to [`transmission::MAX_GPUS`].
pub fn plan_given(
    profile: &ColdProfile,
    algorithm: Algorithm,
    methods: Vec<Method>,
    k: usize,
) -> crate::Result<ColdPlan> {
    if methods.len() != profile.layers.len() || !(1..=transmission::MAX_GPUS).contains(&k) {
        return Err(crate::Error::invalid(format!(
            "{} methods and {k} partitions for a profile of {} layers: one method per layer and 1 to {} partitions expected",
            methods.len(),
            profile.layers.len(),
            transmission::MAX_GPUS
        )));
    }
    let helpers = Helpers { primary: 0, secondaries: (1..k as u32).collect(), reason: None };
    let mut p = complete(profile, algorithm, methods, Some((helpers, Topology::p3_8xlarge().nvlink_gbps)));
    p.gpus.clear();
    Ok(p)
}

fn complete(
    profile: &ColdProfile,
    algorithm: Algorithm,
    methods: Vec<Method>,
    helpers: Option<(Helpers, f64)>,
) -> ColdPlan {
    assert_eq!(methods.len(), profile.layers.len(), "one method per layer");
    let all_load_latency_ms = pipeline(profile, &all_load(profile)).latency_ms;
    let k = helpers.as_ref().map_or(1, |(h, _)| h.k());
    let (methods, partitions) = transmission::parallel(profile, &methods, k);
    let latency_ms = match &helpers {
        Some((_, nvlink_gbps)) if partitions.len() > 1 => {
            let ready = transmission::arrivals(profile, &partitions, *nvlink_gbps);
            transmission::latency_with_arrivals(profile, &methods, &ready)
        }
        _ => pipeline(profile, &methods).latency_ms,
    };
    let device_bytes = partitions.iter().map(|p| p.bytes).sum();
    let gpus = match &helpers {
        Some((h, _)) => {
            std::iter::once(h.primary).chain(h.secondaries.iter().copied()).take(partitions.len()).collect()
        }
        None => vec![],
    };
    ColdPlan {
        model: profile.model.clone(),
        algorithm,
        plan: methods,
        latency_ms,
        all_load_latency_ms,
        partitions,
        gpus,
        transmission_note: helpers.and_then(|(h, _)| h.reason),
        host_bytes: profile.bytes() - device_bytes,
        device_bytes,
    }
}
