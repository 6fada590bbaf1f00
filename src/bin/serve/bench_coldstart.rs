//! `serve bench coldstart` (issue 17, ARCHITECTURE.md §7.10): serving beyond device memory on
//! the real runtime's cold server (`serve::runtime::coldstart`) with the CPU executor, and the
//! simulator's prediction of the same run next to it.
//!
//! The model is a small transformer-like stack (a 30,522 × 128 embedding, then blocks of two
//! linears around a ReLU and a layer norm) at 32 tokens. Copies run at `--h2d-gbps` and DHA reads
//! at `--dha-gbps` (an emulated bus: the CPU has none), so the embedding dominates the load as in
//! BERT. The model is profiled on this machine (`serve::backend::cpu::cold::profile`), planned
//! all-load (PipeSwitch) and by Algorithm 1 (DHA), and served by one device with a budget of
//! `--budget-instances` all-load instances, Poisson arrivals over N instances. The simulator gets
//! the measured profile, the same budget and the same arrivals.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::{Value, json};

use serve::backend::cpu::cold::program::{Layer, Sequential};
use serve::backend::cpu::cold::{ColdOptions, profile::profile};
use serve::plan::deepplan::{ColdProfile, Topology, plan};
use serve::runtime::coldstart::{ColdServer, ColdServerConfig};
use serve::sim::coldstart::{Arrival, Machine, Strategy, Summary, Workload, serve as simulate};

use crate::bench::{open_report, write_report};
use crate::{CliResult, fatal, in_range, positive_f64};

#[derive(Args, Debug)]
pub(crate) struct BenchColdstartArgs {
    /// Instance counts.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [2, 6, 12, 30], value_parser = in_range(1, 4096))]
    instances: Vec<usize>,
    /// The device budget, in all-load instances of the model.
    #[arg(long, default_value_t = 4, value_parser = in_range(1, 4096))]
    budget_instances: usize,
    /// Poisson arrival rate, requests/s.
    #[arg(long, default_value_t = 15.0, value_parser = request_rate)]
    rate: f64,
    /// Requests measured per run.
    #[arg(long, default_value_t = 200, value_parser = in_range(1, 1_000_000))]
    requests: usize,
    /// Requests before measuring.
    #[arg(long, default_value_t = 30, value_parser = in_range(0, 1_000_000))]
    warmup: usize,
    /// Emulated host → device copy rate, GB/s.
    #[arg(long, default_value_t = 0.5, value_parser = bus_gbps)]
    h2d_gbps: f64,
    /// Emulated direct host read rate, GB/s.
    #[arg(long, default_value_t = 0.5, value_parser = bus_gbps)]
    dha_gbps: f64,
    /// Transformer blocks of the model.
    #[arg(long, default_value_t = 6, value_parser = in_range(1, 64))]
    blocks: usize,
    /// The latency objective for goodput, ms.
    #[arg(long, default_value_t = 100.0, value_parser = positive_f64)]
    slo_ms: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the measured profile (a cold-start profile, for `serve plan deepplan`).
    #[arg(long)]
    profile_json: Option<PathBuf>,
    /// Write the results as one JSON object.
    #[arg(long)]
    json: Option<PathBuf>,
}

const TOKENS: usize = 32;

fn model(blocks: usize) -> Sequential {
    let mut layers = vec![Layer::Embedding { rows: 30522, width: 128 }, Layer::LayerNorm { width: 128 }];
    for _ in 0..blocks {
        layers.extend([
            Layer::Linear { inputs: 128, outputs: 512 },
            Layer::Relu,
            Layer::Linear { inputs: 512, outputs: 128 },
            Layer::LayerNorm { width: 128 },
        ]);
    }
    Sequential::random(layers, 5)
}

fn input(i: usize) -> Vec<f32> {
    (0..TOKENS).map(|t| ((t * 7919 + i * 104_729) % 30522) as f32).collect()
}

/// `serve profile --coldstart`: the cold-start profile of an mlp model directory, or of this
/// bench's model, on the CPU executor with an emulated bus.
pub(crate) fn profile_coldstart(
    model_dir: Option<&std::path::Path>,
    h2d_gbps: f64,
    dha_gbps: f64,
    json: &std::path::Path,
) -> CliResult<()> {
    let copy = emulated_bus(h2d_gbps, dha_gbps);
    let (program, name, x) = match model_dir {
        Some(dir) => {
            let net = serve::model::load(dir)
                .map_err(|e| fatal(format!("cannot load model {}: {e}", dir.display())))?;
            let serve::Network::Mlp(mlp) = &net else {
                return Err(fatal(format!(
                    "--coldstart runs mlp models on the CPU executor; {} is a {} model",
                    dir.display(),
                    net.kind().name()
                )));
            };
            let name = dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
            (Sequential::from_mlp(mlp), name, vec![0.5; mlp.input_len()])
        }
        None => (model(6), "cpu-transformer".to_string(), input(0)),
    };
    let prof = profile(&program, &name, &x, &copy, 10)?;
    std::fs::write(json, prof.to_json() + "\n")
        .map_err(|e| fatal(format!("cannot write {}: {e}", json.display())))?;
    let load: f64 = prof.layers.iter().map(|l| l.load_ms).sum();
    let exec: f64 = prof.layers.iter().map(|l| l.exec_ms).sum();
    println!(
        "# {name}: {} layers, {} bytes; load {load:.3} ms at {h2d_gbps} GB/s, in memory {exec:.3} ms (CPU, emulated bus)",
        prof.layers.len(),
        prof.bytes()
    );
    println!("# wrote {}", json.display());
    Ok(())
}

/// The executor's rates for an emulated bus of `h2d_gbps` (copies) and `dha_gbps` (DHA reads).
fn emulated_bus(h2d_gbps: f64, dha_gbps: f64) -> ColdOptions {
    ColdOptions { h2d_bytes_per_s: h2d_gbps * 1e9, dha_bytes_per_s: dha_gbps * 1e9, ..ColdOptions::default() }
}

/// An emulated bus rate, GB/s: 0.001 to 10,000.
pub(crate) fn bus_gbps(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (1e-3..=1e4).contains(&v) => Ok(v),
        _ => Err(format!("`{s}`: a rate from 0.001 to 10000 GB/s expected")),
    }
}

/// A request rate, per second: 0.001 to 100,000.
fn request_rate(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (1e-3..=1e5).contains(&v) => Ok(v),
        _ => Err(format!("`{s}`: a rate from 0.001 to 100000 requests/s expected")),
    }
}

pub(crate) fn cmd_bench_coldstart(a: &BenchColdstartArgs) -> CliResult<()> {
    let report = open_report(a.json.as_ref())?;
    let copy = emulated_bus(a.h2d_gbps, a.dha_gbps);
    let program = Arc::new(model(a.blocks));
    let t = Instant::now();
    let prof: ColdProfile = profile(program.as_ref(), "cpu-transformer", &input(0), &copy, 10)?;
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let load: f64 = prof.layers.iter().map(|l| l.load_ms).sum();
    let exec: f64 = prof.layers.iter().map(|l| l.exec_ms).sum();
    println!(
        "# profiled in {:.1} s on this CPU: {} layers, {:.1} MiB, load {:.2} ms at {} GB/s (emulated bus), in-memory exec {:.2} ms",
        t.elapsed().as_secs_f64(),
        prof.layers.len(),
        mib(prof.bytes()),
        load,
        a.h2d_gbps,
        exec
    );
    if let Some(p) = &a.profile_json {
        std::fs::write(p, prof.to_json() + "\n")
            .map_err(|e| fatal(format!("cannot write {}: {e}", p.display())))?;
        println!("# wrote {}", p.display());
    }
    let all = plan(&prof, Strategy::PipeSwitch.options(), None);
    let budget = all.device_bytes * a.budget_instances as u64;
    println!(
        "# device budget {:.1} MiB ({} all-load instances); Poisson {} req/s, {} measured after {}, SLO {} ms, seed {}",
        mib(budget),
        a.budget_instances,
        a.rate,
        a.requests,
        a.warmup,
        a.slo_ms,
        a.seed
    );
    let machine = Machine {
        topology: Topology::single(),
        memory_bytes: budget,
        reserve_bytes: 0,
        forward_ms: 0.0,
        dha_contention: false,
    };
    let mut rows = vec![];
    for strategy in [Strategy::PipeSwitch, Strategy::Dha] {
        let p = plan(&prof, strategy.options(), None);
        println!(
            "{}: cold {:.2} ms planned, {:.1} MiB per instance on the device",
            strategy.name(),
            p.latency_ms,
            mib(p.device_bytes)
        );
        for &n in &a.instances {
            let w =
                Workload { instances: n, rate: a.rate, warmup: a.warmup, measured: a.requests, seed: a.seed };
            let arrivals = w.arrivals();
            let real = run_real(&program, &p, &arrivals, budget, &copy, a.warmup)?;
            let r = Summary::of(&real, &[a.slo_ms]);
            let records = simulate(&machine, &prof, strategy, &arrivals)?;
            let measured: Vec<(f64, bool)> =
                records[a.warmup.min(records.len())..].iter().map(|r| (r.latency_ms(), r.cold)).collect();
            let s = Summary::of(&measured, &[a.slo_ms]);
            println!(
                "  N {n:4}: real p50 {:7.2} p99 {:7.2} ms cold {:5.1}% goodput {:5.1}% | sim p50 {:7.2} p99 {:7.2} ms cold {:5.1}% | sim/real p50 {:.2} p99 {:.2}",
                r.p50_ms,
                r.p99_ms,
                r.cold_pct,
                r.goodput_pct(),
                s.p50_ms,
                s.p99_ms,
                s.cold_pct,
                s.p50_ms / r.p50_ms,
                s.p99_ms / r.p99_ms
            );
            rows.push(json!({
                "policy": strategy.name(), "instances": n, "offered_rps": a.rate,
                "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "cold_pct": r.cold_pct, "goodput_pct": r.goodput_pct(),
                "completed": real.len(),
                "sim": {"p50_ms": s.p50_ms, "p99_ms": s.p99_ms, "cold_pct": s.cold_pct, "goodput_pct": s.goodput_pct()},
            }));
        }
    }
    if let Some((path, file)) = report {
        let v: Value = json!({
            "workload": "coldstart", "backend": "cpu",
            "model": {"name": prof.model, "layers": prof.layers.len(), "bytes": prof.bytes(), "tokens": TOKENS},
            "h2d_gbps": a.h2d_gbps, "dha_gbps": a.dha_gbps, "budget_bytes": budget, "slo_ms": a.slo_ms,
            "results": rows,
        });
        write_report(&path, file, &v)?;
    }
    Ok(())
}

/// Serves `arrivals` on a fresh cold server, open loop; returns (latency ms, cold) of each
/// request after the first `warmup`.
fn run_real(
    program: &Arc<Sequential>,
    p: &serve::plan::deepplan::ColdPlan,
    arrivals: &[Arrival],
    budget: u64,
    copy: &ColdOptions,
    warmup: usize,
) -> CliResult<Vec<(f64, bool)>> {
    let config = ColdServerConfig {
        devices: 1,
        budget_bytes: budget,
        max_queued: arrivals.len().max(1),
        copy: copy.clone(),
    };
    let instances = arrivals.iter().map(|x| x.instance + 1).max().unwrap_or(1);
    let server = ColdServer::new(program.clone(), p.clone(), instances, config)?;
    let start = Instant::now();
    let mut pending = Vec::with_capacity(arrivals.len());
    for (i, x) in arrivals.iter().enumerate() {
        let due = start + Duration::from_secs_f64(x.at_ms / 1e3);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        pending.push(server.submit(x.instance, input(i))?);
    }
    let mut out = Vec::with_capacity(arrivals.len());
    for (i, rx) in pending.into_iter().enumerate() {
        let r = rx.recv().map_err(|_| fatal("a request was never answered"))?;
        r.result?;
        if i >= warmup {
            out.push((r.latency.as_secs_f64() * 1e3, r.cold));
        }
    }
    Ok(out)
}
