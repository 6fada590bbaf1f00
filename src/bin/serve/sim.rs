//! `serve sim lstm|seq2seq|treelstm|mlp --cost NAME|FILE …` (ARCHITECTURE.md §8): the runtime's
//! engine core and policies on virtual time (`serve::sim`), with a cost file from
//! `serve profile` or one shipped with the crate. Same peaks, offered rates, table and JSON as
//! `serve bench`, with `"backend": "sim"`; every figure it prints is simulated.
//!
//! `--compare BENCH.json` checks the simulator against the real runtime: it replays the offered
//! rates and peaks of a `serve bench … --json` report (the same policy options must be given)
//! and prints both side by side with their ratios, against the targets (throughput within 10%,
//! p50/p90 within 20%).

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

use serde_json::{Value, json};

use serve::model::Mlp;
use serve::sim::workload::{Lengths, requests};
use serve::sim::{CostFile, Load, SimOutcome, SimRequest, SimSpec, simulate};
use serve::workload::poisson_arrivals;
use serve::{Network, PaddingConfig, PolicyConfig};

use crate::bench::{
    PolicySpec, RunResult, fmt_ratio, ms, new_hist, open_report, print_header, print_row, ratio, read_capped,
    timeout_spec, write_report,
};
use crate::bench_rnn::{CPU_HIDDEN, RnnKind, padding_defaults_of, policy_specs, random_network};
use crate::plot::latency_svg;
use crate::{CliResult, SimArgs, SimKind, fatal, timeout_policy};

/// Throughput and latency targets of the simulator against the runtime (issue: honest simulator).
const THROUGHPUT_TOLERANCE: f64 = 0.10;
const LATENCY_TOLERANCE: f64 = 0.20;

/// `--lengths`: `wmt` or `fixed:N`.
pub(crate) fn lengths(s: &str) -> Result<Lengths, String> {
    match s.trim() {
        "wmt" => Ok(Lengths::Wmt),
        other => match other.strip_prefix("fixed:").map(str::parse::<usize>) {
            Some(Ok(n)) if (1..=serve::workload::WMT_MAX_LEN).contains(&n) => Ok(Lengths::Fixed(n)),
            _ => Err(format!(
                "`{s}` is neither `wmt` nor `fixed:N` with N in 1..={}",
                serve::workload::WMT_MAX_LEN
            )),
        },
    }
}

/// `out` as a row of the results table, its percentiles from the same histogram `serve bench`
/// records into.
pub(crate) fn run_result(label: &str, offered: f64, out: &SimOutcome) -> CliResult<RunResult> {
    let mut hist = new_hist()?;
    for l in &out.latencies {
        hist.saturating_record((l.as_micros() as u64).max(1));
    }
    let mut error_codes = BTreeMap::new();
    for (code, n) in &out.errors {
        error_codes.insert(code.name(), *n);
    }
    Ok(RunResult {
        policy: label.to_string(),
        offered_rps: offered,
        throughput_rps: out.throughput(),
        p50_ms: ms(hist.value_at_quantile(0.50)),
        p90_ms: ms(hist.value_at_quantile(0.90)),
        p99_ms: ms(hist.value_at_quantile(0.99)),
        mean_batch: out.mean_batch(),
        mean_task_us: out.mean_task_time().map(|t| t.as_secs_f64() * 1e6),
        completed: out.completed(),
        errors: out.error_count(),
        goodput_rps: None,
        error_codes,
        sender_lag_p99_ms: 0.0,
        engine_busy: None,
        steal: None,
        mean_output_tokens: None,
        extra: serde_json::Map::new(),
    })
}

/// The network the simulation serves: the benchmarks' random model of the kind, at the cost
/// file's hidden size unless `--hidden` says otherwise (only its shape matters: cell types,
/// state size, `max_decode`).
fn network(a: &SimArgs, cost: &CostFile) -> CliResult<Network> {
    let hidden = a
        .hidden
        .or_else(|| cost.model.get("hidden").and_then(Value::as_u64).map(|h| h as usize))
        .unwrap_or(CPU_HIDDEN);
    let kind = match a.workload.unwrap_or(SimKind::Lstm) {
        SimKind::Mlp | SimKind::Elastic => return Ok(Network::Mlp(Mlp::random(&[4, 4], a.seed))),
        SimKind::Lstm => RnnKind::Lstm,
        SimKind::Seq2seq => RnnKind::Seq2Seq,
        SimKind::Treelstm => RnnKind::TreeLstm,
    };
    random_network(kind, 16, hidden, 4, a.layers, a.max_decode, a.seed)
}

/// The policies to simulate: the command line's, with the padding defaults of the bench report
/// being compared against (a CPU bench sets padding up as a framework would), else the paper's.
fn specs(a: &SimArgs, net: &Network, bench: Option<&Value>) -> CliResult<Vec<PolicySpec>> {
    if net.is_recurrent() {
        let padding = bench.map_or_else(PaddingConfig::default, padding_defaults_of);
        return policy_specs(&a.pol, net, &padding);
    }
    let b = a.pol.max_batch.first().copied().unwrap_or(32);
    let mut spec = timeout_spec(timeout_policy(b, 0, a.pol.workers.unwrap_or(1)));
    spec.window = a.pol.capacity_window.unwrap_or(spec.window);
    Ok(vec![spec])
}

/// The simulated runs of one command: the model, costs and requests they share.
pub(crate) struct SimRuns<'a> {
    pub(crate) net: &'a Network,
    pub(crate) cost: &'a CostFile,
    pub(crate) reqs: Vec<SimRequest>,
    /// Requests simulated so far.
    pub(crate) simulated: u64,
}

impl SimRuns<'_> {
    /// The first `n` requests (all: `None`) under `load`.
    fn run(&mut self, spec: &PolicySpec, load: &Load, n: Option<usize>) -> CliResult<SimOutcome> {
        self.simulate(&spec.label, &spec.config, load, n, false)
    }

    /// The first `n` requests (all: `None`) under `load` and `policy` (named `label` in errors),
    /// every decision recorded when `trace`.
    pub(crate) fn simulate(
        &mut self,
        label: &str,
        policy: &PolicyConfig,
        load: &Load,
        n: Option<usize>,
        trace: bool,
    ) -> CliResult<SimOutcome> {
        let s = SimSpec {
            net: self.net,
            policy,
            cost: self.cost,
            admission_bound: serve::runtime::DEFAULT_ADMISSION_BOUND,
            trace,
        };
        let reqs = &self.reqs[..n.unwrap_or(self.reqs.len()).min(self.reqs.len())];
        let out = simulate(&s, reqs, load).map_err(|e| fatal(format!("{label}: {e}")))?;
        self.simulated += out.completed() + out.error_count();
        Ok(out)
    }

    /// Steady closed-loop throughput with `window` requests in flight (the first fifth and the
    /// final drain not counted, as `serve bench` does not count them).
    fn peak(&mut self, spec: &PolicySpec, window: usize) -> CliResult<f64> {
        let out = self.run(spec, &Load::Closed { window }, None)?;
        let n = out.completed_at.len();
        out.steady_throughput(n / 5, window.min(n / 2)).ok_or_else(|| {
            fatal(format!("{}: too few requests to measure a peak; raise --requests", spec.label))
        })
    }
}

pub(crate) fn cmd_sim(a: SimArgs) -> CliResult<()> {
    if a.workload.is_none() || a.cost.is_none() {
        return Err(fatal("`serve sim` needs a workload and --cost (see `serve sim --help`)"));
    }
    if a.workload == Some(SimKind::Elastic) {
        return crate::sim_elastic::cmd_sim_elastic(&a);
    }
    let t0 = Instant::now();
    let cost = CostFile::open(a.cost.as_deref().unwrap_or_default())?;
    let net = network(&a, &cost)?;
    let bench = a.compare.as_deref().map(read_bench).transpose()?;
    let specs = specs(&a, &net, bench.as_ref())?;
    let report_file = open_report(a.json.as_ref())?;
    let reqs = requests(&net, a.lengths, a.requests, a.seed)?;
    let mean_cells = reqs.iter().map(|r| r.graph.as_ref().map_or(1, |g| g.len())).sum::<usize>() as f64
        / reqs.len() as f64;
    println!(
        "# serve sim {}: SIMULATED on virtual time with cost `{}` ({}); {} requests per run, mean {mean_cells:.1} cells",
        net.kind(),
        cost.name,
        cost.backend,
        reqs.len()
    );
    if !cost.source.is_empty() {
        println!("# cost source: {}", cost.source);
    }
    let mut runner = SimRuns { net: &net, cost: &cost, reqs, simulated: 0 };
    if let Some(path) = &a.compare {
        return compare(&mut runner, &specs, path, bench.as_ref().expect("read above"), a.seed);
    }

    let mut peaks = Vec::new();
    for spec in &specs {
        let p = runner.peak(spec, spec.window)?;
        println!(
            "# peak throughput {:<w$} {p:>11.1} rps (closed loop, {} in flight)",
            spec.label,
            spec.window,
            w = 30
        );
        peaks.push(p);
    }
    let mut rates: Vec<f64> = if a.rate.is_empty() {
        peaks.iter().flat_map(|p| a.fractions.iter().map(move |f| (f * p).round().max(1.0))).collect()
    } else {
        a.rate.clone()
    };
    rates.sort_by(f64::total_cmp);
    rates.dedup_by(|x, y| (*x - *y).abs() < 0.5);
    print_header(false, false);
    let mut results = Vec::new();
    for (k, &rate) in rates.iter().enumerate() {
        let load = Load::Open(poisson_arrivals(rate, runner.reqs.len(), a.seed.wrapping_add(1 + k as u64)));
        for (spec, peak) in specs.iter().zip(&peaks) {
            let out = runner.run(spec, &load, None)?;
            let mut r = run_result(&spec.label, rate, &out)?;
            r.extra.insert("peak_rps".into(), json!(peak));
            r.extra.insert("fraction_of_peak".into(), json!(rate / peak));
            print_row(&r);
            results.push(r);
        }
    }
    if let [c, p] = peaks[..] {
        println!(
            "# ratio {}/{} peak throughput (simulated): {}",
            short(&specs[0]),
            short(&specs[1]),
            fmt_ratio(ratio(c, p))
        );
    }
    let wall = t0.elapsed().as_secs_f64();
    println!(
        "# simulated {} requests in {wall:.2} s of wall time ({:.2} million simulated requests per second)",
        runner.simulated,
        runner.simulated as f64 / wall / 1e6
    );
    if let Some(svg) = &a.svg {
        latency_svg(svg, &format!("serve sim {} ({}) — simulated", net.kind(), cost.name), &results)?;
    }
    if let Some((path, file)) = report_file {
        let report = json!({
            "workload": format!("{}/{}", "poisson", match a.lengths { Lengths::Wmt => "wmt".to_string(), Lengths::Fixed(n) => format!("fixed:{n}") }),
            "backend": "sim",
            "cost": {"name": cost.name, "source": cost.source, "backend": cost.backend, "model": cost.model},
            "model": {"kind": net.kind().name()},
            "requests": {"per_run": runner.reqs.len(), "mean_cells": mean_cells},
            "peaks": specs.iter().zip(&peaks).map(|(s, p)| json!({"policy": s.label, "peak_rps": p, "window": s.window})).collect::<Vec<_>>(),
            "results": results.iter().map(RunResult::to_json).collect::<Vec<_>>(),
            "simulated_requests": runner.simulated,
            "wall_s": wall,
        });
        write_report(&path, file, &report)?;
    }
    Ok(())
}

fn short(spec: &PolicySpec) -> &str {
    spec.label.split('(').next().unwrap_or("")
}

/// Replay a `serve bench --json` report on the simulator and print both side by side.
/// Largest `serve bench --json` report read.
const MAX_BENCH_REPORT_BYTES: u64 = 64 << 20;

/// A `serve bench … --json` report.
fn read_bench(path: &Path) -> CliResult<Value> {
    let text = read_capped(path, MAX_BENCH_REPORT_BYTES).map_err(fatal)?;
    serde_json::from_str(&text).map_err(|e| fatal(format!("{}: not a JSON report: {e}", path.display())))
}

fn compare(
    runner: &mut SimRuns<'_>,
    specs: &[PolicySpec],
    path: &Path,
    bench: &Value,
    seed: u64,
) -> CliResult<()> {
    let find = |label: &str| {
        specs.iter().find(|s| s.label == label).ok_or_else(|| {
            fatal(format!(
                "the bench ran `{label}`; give `serve sim` the same policy options (it has: {})",
                specs.iter().map(|s| s.label.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })
    };
    let num = |v: &Value, k: &str| v.get(k).and_then(Value::as_f64);
    // The real run's CPU time taken by the hypervisor, which the simulator knows nothing of.
    let stolen = |v: &Value| {
        num(v, "steal").map_or(String::new(), |s| format!(" (real run: {:.1}% stolen)", s * 100.0))
    };
    println!(
        "# simulator vs runtime ({}): targets throughput within {:.0}%, p50/p90 within {:.0}%",
        path.display(),
        THROUGHPUT_TOLERANCE * 100.0,
        LATENCY_TOLERANCE * 100.0
    );
    let mut misses = 0;
    for p in bench.get("peaks").and_then(Value::as_array).into_iter().flatten() {
        let (Some(label), Some(real)) = (p.get("policy").and_then(Value::as_str), num(p, "peak_rps")) else {
            continue;
        };
        let spec = find(label)?;
        let window = p.get("window").and_then(Value::as_u64).map_or(spec.window, |w| w as usize);
        let sim = runner.peak(spec, window)?;
        let r = sim / real;
        let ok = (r - 1.0).abs() <= THROUGHPUT_TOLERANCE;
        misses += usize::from(!ok);
        println!(
            "peak {label:<30} real {real:>9.1} rps  sim {sim:>9.1} rps  sim/real {r:.2}  {}{}",
            if ok { "ok" } else { "MISS" },
            stolen(p)
        );
    }
    println!(
        "{:<30} {:>9} {:>17} {:>17} {:>17} {:>17} {:>15} {:>17}",
        "policy",
        "offered",
        "throughput r|s",
        "p50_ms r|s",
        "p90_ms r|s",
        "p99_ms r|s",
        "batch r|s",
        "task_us r|s"
    );
    let mut rates: Vec<f64> = Vec::new();
    for (i, r) in bench.get("results").and_then(Value::as_array).into_iter().flatten().enumerate() {
        let (Some(label), Some(offered)) = (r.get("policy").and_then(Value::as_str), num(r, "offered_rps"))
        else {
            continue;
        };
        let spec = find(label)?;
        let n = (num(r, "completed").unwrap_or(0.0) + num(r, "errors").unwrap_or(0.0)) as usize;
        let n = n.clamp(1, runner.reqs.len());
        if !rates.iter().any(|x| (x - offered).abs() < 0.5) {
            rates.push(offered);
        }
        let k = rates.iter().position(|x| (x - offered).abs() < 0.5).unwrap_or(i);
        // The arrival seeds `serve bench` uses with the same --seed.
        let arrivals = poisson_arrivals(offered, n, seed.wrapping_add(1 + k as u64));
        let out = runner.run(spec, &Load::Open(arrivals), Some(n))?;
        let sim = run_result(label, offered, &out)?;
        let pair = |k: &str, s: f64| -> (String, bool, f64) {
            let real = num(r, k).unwrap_or(f64::NAN);
            let q = s / real;
            let tol = if k == "throughput_rps" { THROUGHPUT_TOLERANCE } else { LATENCY_TOLERANCE };
            (format!("{real:>7.2}|{s:<7.2}"), (q - 1.0).abs() <= tol, q)
        };
        let (t, t_ok, _) = pair("throughput_rps", sim.throughput_rps);
        let (p50, p50_ok, q50) = pair("p50_ms", sim.p50_ms);
        let (p90, p90_ok, q90) = pair("p90_ms", sim.p90_ms);
        let (p99, _, _) = pair("p99_ms", sim.p99_ms);
        // Why the two differ, where they do: the batches formed, and what a task took (the real
        // runtime's measured compute against the cost model's time for the simulated tasks).
        let batch = format!("{:>6.1}|{:<6.1}", num(r, "mean_batch").unwrap_or(f64::NAN), sim.mean_batch);
        let task = format!(
            "{:>7.1}|{:<7.1}",
            num(r, "mean_task_us").unwrap_or(f64::NAN),
            sim.mean_task_us.unwrap_or(f64::NAN)
        );
        let ok = t_ok && p50_ok && p90_ok;
        misses += usize::from(!ok);
        let steal = stolen(r);
        println!(
            "{label:<30} {offered:>9.1} {t:>17} {p50:>17} {p90:>17} {p99:>17} {batch:>15} {task:>17}  p50 s/r {q50:.2} \
             p90 s/r {q90:.2} {}{steal}",
            if ok { "ok" } else { "MISS" }
        );
    }
    println!("# {misses} comparison(s) outside the targets");
    Ok(())
}
