//! `serve plan deepplan` (issue 17, ARCHITECTURE.md §7.10): a cold-start plan from a per-layer
//! profile — a `serve profile --coldstart` file or a shipped V100 profile
//! (`deepplan-v100-<model>`) — optionally for a GPU of a topology, with parallel transmission.

use std::path::{Path, PathBuf};

use clap::{Args, ValueEnum};
use serde_json::json;

use serve::plan::deepplan::{Algorithm, ColdProfile, Method, PlanOptions, Topology, plan};
use serve::sim::coldstart::models::{self, MODELS};

use crate::bench::{open_report, write_report};
use crate::{CliResult, fatal};

/// `--algorithm`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum AlgorithmArg {
    /// Algorithm 1 over the stall model.
    Deepplan,
    /// The paper's initial approach (ablation).
    Initial,
    /// Every layer loaded (PipeSwitch).
    AllLoad,
}

#[derive(Args, Debug)]
pub(crate) struct DeepplanArgs {
    /// The cold-start profile: a JSON file (`serve profile --coldstart`) or a shipped V100
    /// profile `deepplan-v100-<model>` (resnet50, resnet101, bert-base, bert-large, roberta-base,
    /// roberta-large, gpt2, gpt2-medium).
    #[arg(long)]
    profile: String,
    /// Write the plan as JSON: {"plan": ["load"|"dha", …], "latency_ms", "all_load_latency_ms",
    /// "partitions", …}.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A topology JSON file (GPUs, PCIe switches, NVLink; ARCHITECTURE.md §7.10), or
    /// `p3.8xlarge`: plan parallel transmission for a cold start on --gpu.
    #[arg(long)]
    topology: Option<String>,
    /// The executing GPU's id in the topology.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    #[arg(long, value_enum, default_value_t = AlgorithmArg::Deepplan)]
    algorithm: AlgorithmArg,
    /// Re-simulate the pipeline also after a layer whose candidates ran out with stall left
    /// (neither the paper nor its artifact does).
    #[arg(long)]
    resim_always: bool,
}

/// A profile by shipped name or path.
pub(crate) fn open_profile(name_or_path: &str) -> CliResult<ColdProfile> {
    if let Some(p) = models::builtin_profile(name_or_path) {
        return Ok(p);
    }
    ColdProfile::open(Path::new(name_or_path)).map_err(|e| {
        fatal(format!(
            "profile `{name_or_path}`: {e} (shipped profiles: {})",
            MODELS.iter().map(|m| format!("deepplan-v100-{m}")).collect::<Vec<_>>().join(", ")
        ))
    })
}

/// A topology by name (`p3.8xlarge`) or path.
pub(crate) fn open_topology(name_or_path: &str) -> CliResult<Topology> {
    if name_or_path == "p3.8xlarge" {
        return Ok(Topology::p3_8xlarge());
    }
    Topology::open(Path::new(name_or_path)).map_err(|e| fatal(format!("topology `{name_or_path}`: {e}")))
}

pub(crate) fn cmd_plan_deepplan(a: &DeepplanArgs) -> CliResult<()> {
    let profile = open_profile(&a.profile)?;
    let topology = a.topology.as_deref().map(open_topology).transpose()?;
    if let Some(t) = &topology
        && t.index(a.gpu).is_none()
    {
        return Err(fatal(format!("--gpu {}: not a GPU of the topology", a.gpu)));
    }
    let report = open_report(a.json.as_ref())?;
    let algorithm = match a.algorithm {
        AlgorithmArg::Deepplan => Algorithm::DeepPlan,
        AlgorithmArg::Initial => Algorithm::Initial,
        AlgorithmArg::AllLoad => Algorithm::AllLoad,
    };
    let options = PlanOptions { algorithm, resim_always: a.resim_always };
    let p = plan(&profile, options, topology.as_ref().map(|t| (t, a.gpu)));
    let dha: Vec<&str> = profile
        .layers
        .iter()
        .zip(&p.plan)
        .filter(|(l, m)| l.has_params() && **m == Method::Dha)
        .map(|(l, _)| l.name.as_str())
        .collect();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    println!(
        "# {}: {} layers, {:.1} MiB; {} on DHA ({:.1} MiB stay on the host): {}",
        profile.model,
        profile.layers.len(),
        mib(profile.bytes()),
        dha.len(),
        mib(p.host_bytes),
        if dha.is_empty() { "none".to_string() } else { dha.join(", ") }
    );
    println!(
        "cold latency {:.3} ms vs all-load (PipeSwitch) {:.3} ms: {:.3}×",
        p.latency_ms,
        p.all_load_latency_ms,
        p.all_load_latency_ms / p.latency_ms
    );
    for (i, part) in p.partitions.iter().enumerate() {
        let gpu = p.gpus.get(i).map_or(String::new(), |g| format!(" on GPU {g}"));
        println!("partition {}{gpu}: {} layers, {:.1} MiB", i + 1, part.layers.len(), mib(part.bytes));
    }
    if let Some(note) = &p.transmission_note {
        println!("# {note}");
    }
    if let Some((path, file)) = report {
        let mut v = serde_json::to_value(&p).map_err(|e| fatal(format!("cannot encode the plan: {e}")))?;
        v["dha_layers"] = json!(dha);
        write_report(&path, file, &v)?;
    }
    Ok(())
}
