//! `serve sim coldstart` (issue 17, ARCHITECTURE.md §8.7): DeepPlan's evaluation on virtual
//! time. Part 1, one cold inference per model on an idle p3.8xlarge (Fig. 11, Table 4): Baseline,
//! PipeSwitch, DHA, PT, PT+DHA, the initial approach, and PT+DHA with the partner GPU cold-starting
//! at the same time. Part 2, the serving experiment (Fig. 13): Poisson arrivals at `--rate` over
//! each instance count, per strategy the instances that fit, goodput under each SLO, cold rate
//! and p99, and the p99 knee. Every figure is simulated (the V100 profiles are synthesised from
//! the layer shapes, `serve::sim::coldstart::models`).

use std::path::PathBuf;

use clap::Args;
use serde_json::{Value, json};

use serve::plan::deepplan::ColdProfile;
use serve::sim::coldstart::models::{MODELS, V100};
use serve::sim::coldstart::{Machine, Strategy, Workload, experiment, fit, single};

use crate::bench::{open_report, write_report};
use crate::plan_deepplan::open_profile;
use crate::{CliResult, fatal, in_range, positive_f64};

/// Most instances of the serving experiment.
const MAX_INSTANCES: usize = 100_000;

#[derive(Args, Debug)]
pub(crate) struct ColdstartArgs {
    /// The serving experiment's model: a shipped V100 profile (`deepplan-v100-bert-base`, …) or
    /// a profile file.
    #[arg(long, default_value = "deepplan-v100-bert-base")]
    profile: String,
    /// Instance counts of the serving experiment.
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [20, 40, 60, 80, 100, 120, 140, 160, 180, 200], value_parser = in_range(1, MAX_INSTANCES))]
    instances: Vec<usize>,
    /// Total Poisson arrival rate, requests/s.
    #[arg(long, default_value_t = 100.0, value_parser = positive_f64)]
    rate: f64,
    /// SLOs, ms (goodput is reported for each; the knee uses the first).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [100.0, 50.0], value_parser = positive_f64)]
    slo: Vec<f64>,
    /// Strategies of the serving experiment (baseline, pipeswitch, dha, pt, pt+dha, initial).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values = ["pipeswitch", "dha", "pt+dha"],
          value_parser = |s: &str| Strategy::parse(s).ok_or_else(|| format!("`{s}`: one of baseline, pipeswitch, dha, pt, pt+dha, initial")))]
    strategy: Vec<Strategy>,
    /// Requests measured per run (the artifact: 100·λ).
    #[arg(long, default_value_t = 10_000, value_parser = in_range(1, 10_000_000))]
    measured: usize,
    /// Requests served before measuring.
    #[arg(long, default_value_t = 2000, value_parser = in_range(0, 10_000_000))]
    warmup: usize,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Let DHA reads share the PCIe link with copies (the paper ignores it).
    #[arg(long)]
    dha_contention: bool,
    /// Skip part 1 (single cold inferences of the eight models).
    #[arg(long)]
    no_single: bool,
    /// Write the results as one JSON object.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw each strategy's p99 against the instance count into this SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
}

pub(crate) fn cmd_sim_coldstart(a: &ColdstartArgs) -> CliResult<()> {
    let report = open_report(a.json.as_ref())?;
    let machine = Machine { dha_contention: a.dha_contention, ..Machine::p3_8xlarge() };
    println!(
        "# simulated: AWS p3.8xlarge (4 V100-16GB, GPUs 0-1 and 2-3 under two PCIe 3.0 switches, NVLink), \
         {:.1} GiB per GPU for instances; DHA/copy contention {}",
        machine.capacity() as f64 / (1u64 << 30) as f64,
        if a.dha_contention { "on" } else { "off (as the paper)" }
    );
    let singles = if a.no_single { Value::Null } else { single_inference(&machine)? };
    let profile = open_profile(&a.profile)?;
    let serving = serving(&machine, &profile, a)?;
    if let Some((path, file)) = report {
        let v = json!({
            "backend": "sim",
            "machine": "p3.8xlarge (simulated)",
            "dha_contention": a.dha_contention,
            "single": singles,
            "serving": serving,
        });
        write_report(&path, file, &v)?;
    }
    Ok(())
}

/// Part 1: one cold inference per model and strategy on GPU 0 of an idle machine.
fn single_inference(machine: &Machine) -> CliResult<Value> {
    println!("\n## one cold inference, batch 1, ms (ratio: PipeSwitch / strategy)");
    println!(
        "{:14} {:>9} {:>11} {:>9} {:>9} {:>9} {:>9} {:>12} {:>7} {:>7}",
        "model", "baseline", "pipeswitch", "dha", "pt", "pt+dha", "initial", "pt+dha(2)", "dha×", "pt+dha×"
    );
    let mut rows = vec![];
    for m in MODELS {
        let p = V100.profile(m).expect("a shipped model");
        let mut v = serde_json::Map::new();
        v.insert("model".into(), json!(m));
        let mut at = |s: Strategy| -> CliResult<f64> {
            let l = single(machine, &p, s, &[0])?[0];
            v.insert(s.name().into(), json!(l));
            Ok(l)
        };
        let ms: Vec<f64> = Strategy::ALL.iter().map(|&s| at(s)).collect::<CliResult<_>>()?;
        let two = single(machine, &p, Strategy::PtDha, &[0, 2])?;
        v.insert("pt+dha(2)".into(), json!(two[0]));
        println!(
            "{m:14} {:9.2} {:11.2} {:9.2} {:9.2} {:9.2} {:9.2} {:12.2} {:7.2} {:7.2}",
            ms[0],
            ms[1],
            ms[2],
            ms[3],
            ms[4],
            ms[5],
            two[0],
            ms[1] / ms[2],
            ms[1] / ms[4]
        );
        rows.push(Value::Object(v));
    }
    Ok(Value::Array(rows))
}

/// Part 2: the serving experiment.
fn serving(machine: &Machine, profile: &ColdProfile, a: &ColdstartArgs) -> CliResult<Value> {
    println!(
        "\n## serving {}: Poisson {} req/s over N instances (home GPU = id mod 4), {} requests measured after {}, seed {}",
        profile.model, a.rate, a.measured, a.warmup, a.seed
    );
    let mut results = vec![];
    let mut lines: Vec<(String, Vec<(f64, f64)>)> = vec![];
    for &s in &a.strategy {
        let fits = fit(machine, profile, s);
        println!("{}: {fits} instances fit", s.name());
        let mut points = vec![];
        let mut knee = None;
        for &n in &a.instances {
            let w =
                Workload { instances: n, rate: a.rate, warmup: a.warmup, measured: a.measured, seed: a.seed };
            let o = experiment(machine, profile, s, &w, &a.slo)?;
            let sum = &o.summary;
            if knee.is_none() && sum.p99_ms > a.slo[0] {
                knee = Some(n);
            }
            let good: Vec<String> =
                sum.goodput.iter().map(|g| format!("{:.1}%≤{}ms", g.goodput_pct, g.slo_ms)).collect();
            println!(
                "  N {n:5}: goodput {}  cold {:5.1}%  p50 {:7.2} ms  p99 {:8.2} ms",
                good.join(" "),
                sum.cold_pct,
                sum.p50_ms,
                sum.p99_ms
            );
            points.push((n as f64, sum.p99_ms));
            results.push(serde_json::to_value(&o).map_err(|e| fatal(format!("cannot encode: {e}")))?);
        }
        match knee {
            Some(n) => println!("  knee: p99 passes {} ms first at N = {n}", a.slo[0]),
            None => println!(
                "  knee: p99 stays within {} ms up to N = {}",
                a.slo[0],
                a.instances.iter().max().unwrap_or(&0)
            ),
        }
        lines.push((s.name().to_string(), points));
    }
    if let Some(svg) = &a.svg {
        let named: Vec<(&str, Vec<(f64, f64)>)> =
            lines.iter().map(|(n, p)| (n.as_str(), p.clone())).collect();
        crate::plot::lines_svg(
            svg,
            &format!("{}: p99 vs instances (simulated p3.8xlarge, λ = {})", profile.model, a.rate),
            ("instances", "p99 latency (ms)"),
            &named,
            Some(("SLO", a.slo[0])),
        )?;
        println!("# wrote {}", svg.display());
    }
    Ok(json!({"model": profile.model, "rate": a.rate, "results": results}))
}
