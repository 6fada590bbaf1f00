//! `serve sim elastic --cost e2bird-res152 …` (issue 15, ARCHITECTURE.md §8.6): the fixed-shape
//! policies of E²bird and the async-transfer slides against TF-Serving's batching, on virtual
//! time with a whole-model cost file (the shipped Titan RTX figures of E²bird's Table 1, or a
//! `serve profile` of a resnet or mlp). Every figure it prints is simulated.
//!
//! Policies (`--policies`, default all): `no-wait` (TF-Serving, s = MaxBS, t = 0), `opt-wait`
//! (t = `--opt-wait-ms`, the paper's 30 ms for ResNet-152), `static` (opt-wait padded to MaxBS),
//! `nebird`, `eebird` (N-Ebird with `--engine-configs`, default the paper's Table 4 picks for
//! ResNet-152), `adaptive` (two streams, exact formula, the bound = the QoS) and `serial` (the
//! same on one stream).
//!
//! Arrivals (`--arrivals`): `poisson` at `--rate` (default fractions of one full batch's
//! capacity, MaxBS / t(MaxBS)); `step`, the rate stepped from `--low-rps` to `--high-rps` every
//! 150 requests (the paper's motivation); `diurnal`, 150 requests at the low rate then 250 at the
//! high one (Fig. 13; its latency against arrival order goes to `--svg`). Each policy also gets
//! its throughput at QoS: the highest Poisson rate whose p99 stays within `--qos-ms` (bisection).
//!
//! With the equal-share device model (`shared_device` in the cost file) co-running workers end as
//! one batch of their summed rows: any engine configuration costs what a single batch costs, so
//! E-Ebird's measured co-run gain (ResNet-152 {8, 8, 16} in 85.3 ms against 93.7 ms for one 32)
//! cannot appear here without a co-run table, and E-Ebird ≈ N-Ebird.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use clap::ValueEnum;
use plotters::prelude::*;
use serde_json::{Value, json};

use serve::model::Mlp;
use serve::sched::adaptive::{Formula, Streams};
use serve::sim::workload::{Lengths, requests};
use serve::sim::{CostFile, CostModel, Load, SimOutcome, TraceEvent};
use serve::workload::{DIURNAL_HIGH_REQUESTS, DIURNAL_LOW_REQUESTS, diurnal, poisson_arrivals};
use serve::{AdaptiveConfig, ElasticConfig, Network, PolicyConfig, TimeoutConfig};

use crate::bench::{
    RunResult, fmt_ratio, open_report, print_header, print_row, ratio, read_capped, write_report,
};
use crate::sim::{SimRuns, run_result};
use crate::{CliResult, ElasticArrivals, ElasticPolicyArg, ElasticSimArgs, SimArgs, fatal};

/// ResNet-152's engine configurations, E²bird Table 4.
const PAPER_ENGINE_CONFS: [(usize, &[usize]); 4] =
    [(4, &[4]), (8, &[8]), (16, &[4, 4, 8]), (32, &[8, 8, 16])];

/// Largest `--engine-configs` file read.
const MAX_CONFS_BYTES: u64 = 1 << 20;

/// Requests of the diurnal run (`serve::workload::diurnal`): 150 at the low rate, then 250 at
/// the high one.
const DIURNAL: (usize, usize) = (DIURNAL_LOW_REQUESTS, DIURNAL_HIGH_REQUESTS);
/// Requests per rate of the step run.
const STEP_EVERY: usize = 150;

struct Pol {
    /// Its `--policies` name.
    name: String,
    config: PolicyConfig,
}

fn policies(e: &ElasticSimArgs) -> CliResult<Vec<Pol>> {
    let max_bs = e.max_bs;
    let opt_wait = Duration::from_secs_f64(e.opt_wait_ms / 1e3);
    let timeout = |max_wait, pad_to_max| {
        PolicyConfig::Timeout(TimeoutConfig { max_batch: max_bs, max_wait, workers: 1, pad_to_max })
    };
    let adaptive = |streams| {
        PolicyConfig::Adaptive(AdaptiveConfig {
            latency_bound: Duration::from_secs_f64(e.qos_ms / 1e3),
            max_batch: max_bs,
            streams,
            formula: Formula::Exact,
            window: 8,
        })
    };
    let confs = engine_confs(e.engine_configs.as_deref())?;
    let chosen =
        if e.policies.is_empty() { ElasticPolicyArg::value_variants().to_vec() } else { e.policies.clone() };
    Ok(chosen
        .into_iter()
        .map(|p| {
            let config = match p {
                ElasticPolicyArg::NoWait => timeout(Duration::ZERO, false),
                ElasticPolicyArg::OptWait => timeout(opt_wait, false),
                ElasticPolicyArg::Static => timeout(opt_wait, true),
                ElasticPolicyArg::Nebird => {
                    PolicyConfig::Elastic(ElasticConfig { max_inflight: max_bs, ..ElasticConfig::default() })
                }
                ElasticPolicyArg::Eebird => {
                    PolicyConfig::Elastic(ElasticConfig::e_ebird(confs.clone(), max_bs))
                }
                ElasticPolicyArg::Adaptive => adaptive(Streams::Async),
                ElasticPolicyArg::Serial => adaptive(Streams::Serial),
            };
            let name = p.to_possible_value().map_or_else(|| format!("{p:?}"), |v| v.get_name().to_string());
            Pol { name, config }
        })
        .collect())
}

/// `--engine-configs FILE`: `{"4": [4], "8": [8], …}` (TotalBS → worker batch sizes); default the
/// paper's ResNet-152 picks.
fn engine_confs(path: Option<&Path>) -> CliResult<BTreeMap<usize, Vec<usize>>> {
    let Some(path) = path else {
        return Ok(PAPER_ENGINE_CONFS.iter().map(|(t, c)| (*t, c.to_vec())).collect());
    };
    let text = read_capped(path, MAX_CONFS_BYTES).map_err(fatal)?;
    let raw: BTreeMap<String, Vec<usize>> = serde_json::from_str(&text).map_err(|e| {
        fatal(format!("{}: not a {{\"TotalBS\": [batch sizes]}} object: {e}", path.display()))
    })?;
    raw.into_iter()
        .map(|(k, v)| {
            let total = k
                .parse::<usize>()
                .map_err(|_| fatal(format!("{}: `{k}` is not a TotalBS", path.display())))?;
            Ok((total, v))
        })
        .collect()
}

/// One full batch's throughput: MaxBS / t(MaxBS).
fn capacity(cost: &CostFile, max_bs: usize) -> CliResult<f64> {
    let t = cost.task_time("dense", max_bs).ok_or_else(|| {
        fatal(format!(
            "cost `{}` has no `dense` cell: `serve sim elastic` needs a fixed-shape model's costs",
            cost.name
        ))
    })?;
    Ok(max_bs as f64 / t.as_secs_f64())
}

/// `pol` with one request arriving at each offset of `at`.
fn run(runs: &mut SimRuns<'_>, pol: &Pol, at: Vec<Duration>, trace: bool) -> CliResult<SimOutcome> {
    let n = at.len();
    runs.simulate(&pol.name, &pol.config, &Load::Open(at), Some(n), trace)
}

/// The highest Poisson rate (to 1%) whose p99 stays within `qos`, between 1 req/s and `hi`; 0
/// when even 1 req/s misses it.
fn throughput_at_qos(
    runs: &mut SimRuns<'_>,
    pol: &Pol,
    qos: f64,
    hi: f64,
    n: usize,
    seed: u64,
) -> CliResult<f64> {
    let mut within = |rate: f64| -> CliResult<bool> {
        let out = run(runs, pol, poisson_arrivals(rate, n, seed), false)?;
        let r = run_result(&pol.name, rate, &out)?;
        Ok(out.error_count() == 0 && r.p99_ms <= qos)
    };
    let (mut lo, mut hi) = (1.0, hi);
    if !within(lo)? {
        return Ok(0.0);
    }
    while hi / lo > 1.01 {
        let mid = (lo * hi).sqrt();
        if within(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

/// Latency of every request in arrival order, from a traced run.
fn by_arrival(out: &SimOutcome) -> Vec<f64> {
    let mut arrived = BTreeMap::new();
    let mut done = BTreeMap::new();
    for ev in &out.trace {
        match ev {
            TraceEvent::Arrive { at, id } => {
                arrived.insert(*id, *at);
            }
            TraceEvent::Complete { at, id, .. } => {
                done.insert(*id, *at);
            }
            TraceEvent::Launch { .. } => {}
        }
    }
    arrived.iter().filter_map(|(id, a)| done.get(id).map(|d| d.since(*a).as_secs_f64() * 1e3)).collect()
}

fn goodput(out: &SimOutcome, qos: f64) -> f64 {
    let span = out.last_completion.since(out.first_arrival).as_secs_f64();
    let good = out.latencies.iter().filter(|l| l.as_secs_f64() * 1e3 <= qos).count();
    if span > 0.0 { good as f64 / span } else { 0.0 }
}

pub(crate) fn cmd_sim_elastic(a: &SimArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let e = &a.elastic;
    let cost = CostFile::open(&a.cost)?;
    let cap = capacity(&cost, e.max_bs)?;
    let pols = policies(e)?;
    let report_file = open_report(a.json.as_ref())?;
    let net = Network::Mlp(Mlp::random(&[4, 4], a.seed));
    let n = a.requests.max(DIURNAL.0 + DIURNAL.1);
    let mut runs =
        SimRuns { net: &net, cost: &cost, reqs: requests(&net, Lengths::Fixed(1), n, a.seed)?, simulated: 0 };
    println!(
        "# serve sim elastic: SIMULATED on virtual time with cost `{}` ({}{}); MaxBS {}, one full batch's \
         capacity {cap:.1} req/s; QoS {} ms",
        cost.name,
        cost.backend,
        if cost.shared_device() { ", workers share the device" } else { "" },
        e.max_bs,
        e.qos_ms
    );
    if !cost.source.is_empty() {
        println!("# cost source: {}", cost.source);
    }
    let qos = e.qos_ms;
    let mut report = json!({
        "backend": "sim", "cost": cost.name, "qos_ms": qos, "max_bs": e.max_bs,
        "opt_wait_ms": e.opt_wait_ms, "capacity_rps": cap,
        "policies": pols.iter().map(|p| p.name.as_str()).collect::<Vec<_>>(),
    });
    let results = match e.arrivals {
        ElasticArrivals::Poisson => {
            let rates: Vec<f64> = if a.rate.is_empty() {
                [0.05, 0.25, 0.5, 0.75, 0.9].iter().map(|f| (f * cap).round().max(1.0)).collect()
            } else {
                a.rate.clone()
            };
            poisson_runs(&mut runs, &pols, &rates, a.requests, a.seed, qos, &mut report)?
        }
        ElasticArrivals::Step | ElasticArrivals::Diurnal => {
            let (low, high) = (e.low_rps.unwrap_or(0.25 * cap), e.high_rps.unwrap_or(0.95 * cap));
            let curves = phase_runs(&mut runs, &pols, e.arrivals, (low, high), a.seed, qos, &mut report)?;
            if let Some(path) = &a.svg {
                let title = format!("{}: latency by arrival order (simulated)", cost.name);
                let curves: Vec<(&str, Vec<f64>)> =
                    curves.into_iter().map(|(p, l)| (p.name.as_str(), l)).collect();
                arrival_svg(path, &title, &curves, qos)?;
                println!("# wrote {}", path.display());
            }
            Vec::new()
        }
    };
    // Throughput at QoS, per policy (Poisson, bisection).
    let mut at_qos = serde_json::Map::new();
    for p in &pols {
        let t =
            throughput_at_qos(&mut runs, p, qos, 2.0 * cap, a.requests.min(5000), a.seed.wrapping_add(99))?;
        println!("# throughput at QoS ({qos} ms p99) {:<10} {t:>9.1} req/s", p.name);
        at_qos.insert(p.name.clone(), json!(t));
    }
    let get = |k: &str| at_qos.get(k).and_then(Value::as_f64);
    if let (Some(n), Some(o)) = (get("nebird"), get("opt-wait")) {
        println!(
            "# ratio nebird/opt-wait throughput at QoS: {} (paper: +34.4% on average)",
            fmt_ratio(ratio(n, o))
        );
    }
    if let (Some(ee), Some(n)) = (get("eebird"), get("nebird")) {
        println!(
            "# ratio eebird/nebird throughput at QoS: {} (paper +9.9%; with the equal-share device model every \
             configuration costs one batch's time, so no co-run gain is simulated)",
            fmt_ratio(ratio(ee, n))
        );
    }
    report["throughput_at_qos_rps"] = Value::Object(at_qos);
    report["results"] = Value::Array(results.iter().map(RunResult::to_json).collect());
    println!("# {:.1} s wall (simulated)", t0.elapsed().as_secs_f64());
    if let Some((path, file)) = report_file {
        write_report(&path, file, &report)?;
    }
    Ok(())
}

/// Every policy at each Poisson rate: the table with goodput, and E6 (N-Ebird's latency at the
/// lowest rate against OPT_Wait's) into `report`.
fn poisson_runs(
    runs: &mut SimRuns<'_>,
    pols: &[Pol],
    rates: &[f64],
    requests: usize,
    seed: u64,
    qos: f64,
    report: &mut Value,
) -> CliResult<Vec<RunResult>> {
    print_header(true, false);
    let mut results = Vec::new();
    for (k, &rate) in rates.iter().enumerate() {
        let at = poisson_arrivals(rate, requests, seed.wrapping_add(1 + k as u64));
        for p in pols {
            let out = run(runs, p, at.clone(), false)?;
            let mut r = run_result(&p.name, rate, &out)?;
            r.goodput_rps = Some(goodput(&out, qos));
            print_row(&r);
            results.push(r);
        }
    }
    let at_low = |name: &str| results.iter().find(|r| r.policy == name && r.offered_rps == rates[0]);
    if let (Some(n), Some(o)) = (at_low("nebird"), at_low("opt-wait")) {
        let cut = 1.0 - n.p50_ms / o.p50_ms;
        println!(
            "# E6: at {:.0} req/s N-Ebird's p50 {:.1} ms against OPT_Wait's {:.1} ms: {:.1}% lower (paper: \
             44.6–70.9% at low load; goal ≥ 44%: {})",
            rates[0],
            n.p50_ms,
            o.p50_ms,
            100.0 * cut,
            if cut >= 0.44 { "met" } else { "NOT met" }
        );
        report["e6_low_load_cut"] = json!(cut);
    }
    Ok(results)
}

/// Every policy under step or diurnal arrivals from `low` to `high` req/s: the mean latency of
/// each phase into `report`, E7 (N-Ebird's high-phase latency against OPT_Wait's), and each
/// policy's latencies in arrival order.
fn phase_runs<'p>(
    runs: &mut SimRuns<'_>,
    pols: &'p [Pol],
    arrivals: ElasticArrivals,
    (low, high): (f64, f64),
    seed: u64,
    qos: f64,
    report: &mut Value,
) -> CliResult<Vec<(&'p Pol, Vec<f64>)>> {
    let (name, at, split) = if arrivals == ElasticArrivals::Diurnal {
        ("diurnal", diurnal(low, high, seed), DIURNAL.0)
    } else {
        let steps = 4;
        let rates: Vec<(f64, usize)> =
            (0..steps).map(|i| (low + (high - low) * i as f64 / (steps - 1) as f64, STEP_EVERY)).collect();
        ("step", phases(&rates, seed), STEP_EVERY * (steps - 1))
    };
    println!(
        "# {name} arrivals: {low:.1} req/s, then {high:.1} req/s from request {split} ({} requests)",
        at.len()
    );
    println!(
        "{:<10} {:>14} {:>14} {:>14} {:>12}",
        "policy", "low_mean_ms", "high_mean_ms", "high_max_ms", "over_qos"
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let mut curves = Vec::new();
    let mut high_means = BTreeMap::new();
    for p in pols {
        let lat = by_arrival(&run(runs, p, at.clone(), true)?);
        let (lo, hi) = lat.split_at(split.min(lat.len()));
        let over = lat.iter().filter(|l| **l > qos).count();
        let max = hi.iter().cloned().fold(0.0, f64::max);
        println!("{:<10} {:>14.2} {:>14.2} {:>14.2} {:>12}", p.name, mean(lo), mean(hi), max, over);
        report["phases"][p.name.as_str()] =
            json!({"low_mean_ms": mean(lo), "high_mean_ms": mean(hi), "high_max_ms": max, "over_qos": over});
        high_means.insert(p.name.as_str(), mean(hi));
        curves.push((p, lat));
    }
    if let (Some(&n), Some(&o)) = (high_means.get("nebird"), high_means.get("opt-wait")) {
        println!(
            "# E7: high-load mean latency N-Ebird {n:.1} ms against OPT_Wait {o:.1} ms: {} (paper: 7.4–53.1% lower)",
            fmt_ratio(ratio(n, o))
        );
    }
    Ok(curves)
}

/// Poisson arrivals through consecutive phases of `(rate, requests)` (the step workload).
fn phases(phases: &[(f64, usize)], seed: u64) -> Vec<Duration> {
    let mut at = Vec::new();
    let mut start = Duration::ZERO;
    for (i, &(rate, n)) in phases.iter().enumerate() {
        let gaps = poisson_arrivals(rate, n, seed.wrapping_add(i as u64));
        at.extend(gaps.iter().map(|t| start + *t));
        start = at.last().copied().unwrap_or(start);
    }
    at
}

/// Latency against arrival order, one line per policy, the QoS as a horizontal line (Fig. 13).
fn arrival_svg(path: &Path, title: &str, curves: &[(&str, Vec<f64>)], qos: f64) -> CliResult<()> {
    let err = |e: &dyn std::fmt::Display| fatal(format!("cannot draw {}: {e}", path.display()));
    let n = curves.iter().map(|c| c.1.len()).max().unwrap_or(1);
    let y_max = curves.iter().flat_map(|c| c.1.iter()).cloned().fold(qos, f64::max) * 1.05;
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..n as f64, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("request (arrival order)")
        .y_desc("latency (ms)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, (name, lat)) in curves.iter().enumerate() {
        let colour = crate::plot::colour(i);
        let pts: Vec<(f64, f64)> = lat.iter().enumerate().map(|(k, l)| (k as f64, *l)).collect();
        chart
            .draw_series(LineSeries::new(pts, colour.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2)));
    }
    chart
        .draw_series(LineSeries::new(vec![(0.0, qos), (n as f64, qos)], BLACK.stroke_width(1)))
        .map_err(|e| err(&e))?
        .label("QoS")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(1)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
