//! The fixed-shape policies of issue 15 compared, whatever runs them (ARCHITECTURE.md §8.6): the
//! policy set, Poisson runs with goodput and E6, step / diurnal / burst runs with their phases, E7
//! and Z5, each policy's throughput at QoS by bisection, the latency-by-arrival plot, and the
//! JSON report's fields. Two drivers run a policy over a list of arrival instants: the simulator
//! (`serve sim elastic`, virtual time) and the real runtime (`serve bench elastic`).
//!
//! Policies: `no-wait` (TF-Serving, s = MaxBS, t = 0), `opt-wait` (t = the OPT_Wait time, the
//! paper's 30 ms for ResNet-152), `static` (opt-wait padded to MaxBS), `nebird`, `eebird`
//! (N-Ebird with the engine configurations of a `serve profile --engine-configs`), `adaptive`
//! (two streams, exact formula, the bound = the QoS) and `serial` (the same on one stream).
//!
//! Arrivals: `poisson` at each rate; `step`, the rate stepped from low to high every 150 requests
//! (the paper's motivation); `diurnal`, 150 requests at the low rate then 250 at the high one
//! (Fig. 13); `burst`, the async-transfer slides' 0.3 s burst at twice the rate (Z5: 1 s at the
//! low rate, 0.3 s at the high one, 1 s at the low one).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use serde_json::{Value, json};

use serve::sched::adaptive::{Formula, Streams};
use serve::workload::{DIURNAL_HIGH_REQUESTS, DIURNAL_LOW_REQUESTS, diurnal, poisson_arrivals};
use serve::{AdaptiveConfig, ElasticConfig, PolicyConfig, TimeoutConfig};

use crate::bench::{RunResult, fmt_ratio, print_header, print_row, ratio, write_report};
use crate::{CliResult, ElasticArrivals, ElasticPolicyArg, ElasticSimArgs, fatal};

/// Requests per rate of the step run.
const STEP_EVERY: usize = 150;
/// Most requests of a burst run (its phases are rate × seconds).
const MAX_PHASED_REQUESTS: usize = 10_000_000;
/// The burst run (Z5): seconds at the low rate, of the burst, and at the low rate again.
const BURST_S: (f64, f64, f64) = (1.0, 0.3, 1.0);

/// A policy under comparison.
pub(crate) struct Pol {
    /// Its `--policies` name.
    pub(crate) name: String,
    pub(crate) config: PolicyConfig,
}

/// What the policies are compared with.
pub(crate) struct Setup<'a> {
    pub(crate) chosen: &'a [ElasticPolicyArg],
    pub(crate) max_bs: usize,
    pub(crate) qos_ms: f64,
    pub(crate) opt_wait_ms: f64,
    /// E-Ebird's engine configurations (TotalBS → worker batch sizes).
    pub(crate) engine_confs: BTreeMap<usize, Vec<usize>>,
}

/// The chosen policies (all when none is).
pub(crate) fn policies(s: &Setup<'_>) -> Vec<Pol> {
    let max_bs = s.max_bs;
    let opt_wait = Duration::from_secs_f64(s.opt_wait_ms / 1e3);
    let timeout = |max_wait, pad_to_max| {
        PolicyConfig::Timeout(TimeoutConfig { max_batch: max_bs, max_wait, workers: 1, pad_to_max })
    };
    let adaptive = |streams| {
        PolicyConfig::Adaptive(AdaptiveConfig {
            latency_bound: Duration::from_secs_f64(s.qos_ms / 1e3),
            max_batch: max_bs,
            streams,
            formula: Formula::Exact,
            window: 8,
        })
    };
    let chosen =
        if s.chosen.is_empty() { ElasticPolicyArg::value_variants().to_vec() } else { s.chosen.to_vec() };
    chosen
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
                    PolicyConfig::Elastic(ElasticConfig::e_ebird(s.engine_confs.clone(), max_bs))
                }
                ElasticPolicyArg::Adaptive => adaptive(Streams::Async),
                ElasticPolicyArg::Serial => adaptive(Streams::Serial),
            };
            let name = p.to_possible_value().map_or_else(|| format!("{p:?}"), |v| v.get_name().to_string());
            Pol { name, config }
        })
        .collect()
}

/// One policy's run over a list of arrivals.
pub(crate) struct Run {
    /// Its row, goodput included.
    pub(crate) result: RunResult,
    /// Each request's latency (ms) in arrival order when asked for (NaN: it failed).
    pub(crate) by_arrival: Vec<f64>,
}

/// Runs a policy over arrival instants: the simulator or the real runtime.
pub(crate) trait Driver {
    /// `pol` with one request due at each offset of `at` (offered as `rate` req/s), each
    /// request's latency kept when `by_arrival`.
    fn run(&mut self, pol: &Pol, at: &[Duration], rate: f64, qos: f64, by_arrival: bool) -> CliResult<Run>;
    /// Requests of one probe of the throughput-at-QoS search at `rate`.
    fn probe_requests(&self, rate: f64) -> usize;
    /// Requests of one Poisson run at `rate`.
    fn run_requests(&self, rate: f64) -> CliResult<usize>;
    /// `" (simulated)"` or empty, for the lines that quote the paper.
    fn tag(&self) -> &'static str;
}

/// One comparison's settings, from either command's arguments.
pub(crate) struct Plan<'a> {
    pub(crate) e: &'a ElasticSimArgs,
    /// Poisson rates (empty: fractions of `cap`).
    pub(crate) rates: &'a [f64],
    /// One full batch's throughput, MaxBS / t(MaxBS).
    pub(crate) cap: f64,
    pub(crate) qos: f64,
    pub(crate) seed: u64,
    /// A phased run's plot, and its title.
    pub(crate) svg: Option<(&'a Path, String)>,
    /// The JSON report's file (`open_report`), written at the end.
    pub(crate) json: Option<(PathBuf, File)>,
}

/// The whole comparison: the `--arrivals` runs, each policy's throughput at QoS, the ratio
/// lines, the wall time since `t0`; `report` completed and written to the plan's file.
pub(crate) fn compare(
    driver: &mut dyn Driver,
    pols: &[Pol],
    plan: Plan<'_>,
    mut report: Value,
    t0: Instant,
) -> CliResult<()> {
    let Plan { e, rates, cap, qos, seed, svg, json } = plan;
    let report = &mut report;
    report["policies"] = json!(pols.iter().map(|p| p.name.as_str()).collect::<Vec<_>>());
    report["qos_ms"] = json!(qos);
    report["capacity_rps"] = json!(cap);
    let (low, high) = (e.low_rps, e.high_rps);
    let results = match e.arrivals {
        ElasticArrivals::Poisson => {
            let rates: Vec<f64> = if rates.is_empty() {
                [0.05, 0.25, 0.5, 0.75, 0.9].iter().map(|f| (f * cap).round().max(1.0)).collect()
            } else {
                rates.to_vec()
            };
            poisson_runs(driver, pols, &rates, seed, qos, report)?
        }
        ElasticArrivals::Step | ElasticArrivals::Diurnal | ElasticArrivals::Burst => {
            let (lo, hi) = if e.arrivals == ElasticArrivals::Burst {
                let lo = low.unwrap_or(0.5 * cap);
                (lo, high.unwrap_or(2.0 * lo))
            } else {
                (low.unwrap_or(0.25 * cap), high.unwrap_or(0.95 * cap))
            };
            let curves = phase_runs(driver, pols, e.arrivals, (lo, hi), seed, qos, report)?;
            if let Some((path, title)) = &svg {
                let curves: Vec<(&str, Vec<f64>)> =
                    curves.into_iter().map(|(p, l)| (p.name.as_str(), l)).collect();
                arrival_svg(path, title, &curves, qos)?;
                println!("# wrote {}", path.display());
            }
            Vec::new()
        }
    };
    let mut at_qos = serde_json::Map::new();
    for p in pols {
        let t = throughput_at_qos(driver, p, qos, cap, seed.wrapping_add(99))?;
        println!("# throughput at QoS ({qos} ms p99) {:<10} {t:>9.1} req/s{}", p.name, driver.tag());
        at_qos.insert(p.name.clone(), json!(t));
    }
    let get = |k: &str| at_qos.get(k).and_then(Value::as_f64);
    if let (Some(n), Some(o)) = (get("nebird"), get("opt-wait")) {
        println!(
            "# ratio nebird/opt-wait throughput at QoS: {}{} (paper: +34.4% on average)",
            fmt_ratio(ratio(n, o)),
            driver.tag()
        );
    }
    if let (Some(ee), Some(n)) = (get("eebird"), get("nebird")) {
        println!(
            "# ratio eebird/nebird throughput at QoS: {}{} (paper +9.9%)",
            fmt_ratio(ratio(ee, n)),
            driver.tag()
        );
    }
    report["throughput_at_qos_rps"] = Value::Object(at_qos);
    report["results"] = Value::Array(results.iter().map(RunResult::to_json).collect());
    println!("# {:.1} s wall{}", t0.elapsed().as_secs_f64(), driver.tag());
    if let Some((path, file)) = json {
        write_report(&path, file, report)?;
    }
    Ok(())
}

/// The highest Poisson rate (to 1%) whose p99 stays within `qos` with no error, searched
/// between 2% and twice `cap`; 0 when even the lowest misses it.
fn throughput_at_qos(driver: &mut dyn Driver, pol: &Pol, qos: f64, cap: f64, seed: u64) -> CliResult<f64> {
    let mut within = |rate: f64| -> CliResult<bool> {
        let at = poisson_arrivals(rate, driver.probe_requests(rate), seed);
        let r = driver.run(pol, &at, rate, qos, false)?.result;
        Ok(r.errors == 0 && r.p99_ms <= qos)
    };
    let (mut lo, mut hi) = ((0.02 * cap).max(1e-3), 2.0 * cap);
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

/// Every policy at each Poisson rate: the table with goodput, and E6 (N-Ebird's latency at the
/// lowest rate against OPT_Wait's) into `report`.
fn poisson_runs(
    driver: &mut dyn Driver,
    pols: &[Pol],
    rates: &[f64],
    seed: u64,
    qos: f64,
    report: &mut Value,
) -> CliResult<Vec<RunResult>> {
    print_header(true, false);
    let mut results = Vec::new();
    for (k, &rate) in rates.iter().enumerate() {
        let at = poisson_arrivals(rate, driver.run_requests(rate)?, seed.wrapping_add(1 + k as u64));
        for p in pols {
            let r = driver.run(p, &at, rate, qos, false)?.result;
            print_row(&r);
            results.push(r);
        }
    }
    let at_low = |name: &str| results.iter().find(|r| r.policy == name && r.offered_rps == rates[0]);
    if let (Some(n), Some(o)) = (at_low("nebird"), at_low("opt-wait")) {
        let cut = 1.0 - n.p50_ms / o.p50_ms;
        println!(
            "# E6: at {:.0} req/s N-Ebird's p50 {:.2} ms against OPT_Wait's {:.2} ms: {:.1}% lower{} (paper: \
             44.6–70.9% at low load; goal ≥ 44%: {})",
            rates[0],
            n.p50_ms,
            o.p50_ms,
            100.0 * cut,
            driver.tag(),
            if cut >= 0.44 { "met" } else { "NOT met" }
        );
        report["e6_low_load_cut"] = json!(cut);
    }
    Ok(results)
}

/// The arrivals of a phased run from `low` to `high` req/s, and the range of requests arriving
/// in its high phase.
fn phased_arrivals(
    arrivals: ElasticArrivals,
    (low, high): (f64, f64),
    seed: u64,
) -> CliResult<(Vec<Duration>, (usize, usize))> {
    Ok(match arrivals {
        ElasticArrivals::Diurnal => {
            (diurnal(low, high, seed), (DIURNAL_LOW_REQUESTS, DIURNAL_LOW_REQUESTS + DIURNAL_HIGH_REQUESTS))
        }
        ElasticArrivals::Burst => {
            // Requests of a phase: its rate × its seconds, bounded before anything is allocated.
            let total = low * (BURST_S.0 + BURST_S.2) + high * BURST_S.1;
            if !total.is_finite() || total > MAX_PHASED_REQUESTS as f64 {
                return Err(fatal(format!(
                    "a burst run at {low} and {high} req/s is {total:.0} requests, over the {MAX_PHASED_REQUESTS} a \
                     phased run may hold: lower --low-rps / --high-rps"
                )));
            }
            let count = |rate: f64, s: f64| ((rate * s).round() as usize).max(1);
            let (before, burst, after) =
                (count(low, BURST_S.0), count(high, BURST_S.1), count(low, BURST_S.2));
            (phases(&[(low, before), (high, burst), (low, after)], seed), (before, before + burst))
        }
        ElasticArrivals::Step | ElasticArrivals::Poisson => {
            let steps = 4;
            let rates: Vec<(f64, usize)> = (0..steps)
                .map(|i| (low + (high - low) * i as f64 / (steps - 1) as f64, STEP_EVERY))
                .collect();
            (phases(&rates, seed), (STEP_EVERY * (steps - 1), STEP_EVERY * steps))
        }
    })
}

/// Every policy under step, diurnal or burst arrivals from `low` to `high` req/s: per phase the
/// mean latency, and the peak from the high phase on, into `report`; E7 (N-Ebird's high-phase
/// latency against OPT_Wait's) and Z5 (the adaptive policy's peak against the serial one's); each
/// policy's latencies in arrival order.
fn phase_runs<'p>(
    driver: &mut dyn Driver,
    pols: &'p [Pol],
    arrivals: ElasticArrivals,
    (low, high): (f64, f64),
    seed: u64,
    qos: f64,
    report: &mut Value,
) -> CliResult<Vec<(&'p Pol, Vec<f64>)>> {
    let (at, (from, to)) = phased_arrivals(arrivals, (low, high), seed)?;
    let name = arrivals.to_possible_value().map_or_else(String::new, |v| v.get_name().to_string());
    println!(
        "# {name} arrivals: {low:.1} req/s, {high:.1} req/s for requests {from}..{to} ({} requests)",
        at.len()
    );
    println!(
        "{:<10} {:>14} {:>14} {:>14} {:>10} {:>8}",
        "policy", "low_mean_ms", "high_mean_ms", "peak_ms", "over_qos", "errors"
    );
    // Failed requests (NaN) are counted apart, not averaged.
    let mean = |v: &[f64]| {
        let ok: Vec<f64> = v.iter().copied().filter(|l| l.is_finite()).collect();
        ok.iter().sum::<f64>() / ok.len().max(1) as f64
    };
    let mut curves = Vec::new();
    let (mut high_means, mut peaks) = (BTreeMap::new(), BTreeMap::new());
    let rate = at.len() as f64 / at.last().map_or(1.0, |t| t.as_secs_f64().max(1e-9));
    for p in pols {
        let run = driver.run(p, &at, rate, qos, true)?;
        let errors = run.result.errors;
        let lat = run.by_arrival;
        if lat.len() != at.len() {
            return Err(fatal(format!("{}: {} latencies for {} arrivals", p.name, lat.len(), at.len())));
        }
        let (lo, hi) = (&lat[..from], &lat[from..to]);
        let over = lat.iter().filter(|l| **l > qos).count();
        let peak = lat[from..].iter().copied().filter(|l| l.is_finite()).fold(0.0, f64::max);
        println!(
            "{:<10} {:>14.2} {:>14.2} {:>14.2} {:>10} {:>8}",
            p.name,
            mean(lo),
            mean(hi),
            peak,
            over,
            errors
        );
        report["phases"][p.name.as_str()] = json!({"low_mean_ms": mean(lo), "high_mean_ms": mean(hi),
                                                    "peak_ms": peak, "over_qos": over, "errors": errors});
        high_means.insert(p.name.clone(), mean(hi));
        peaks.insert(p.name.clone(), peak);
        curves.push((p, lat));
    }
    if let (Some(&n), Some(&o)) = (high_means.get("nebird"), high_means.get("opt-wait")) {
        println!(
            "# E7: high-load mean latency N-Ebird {n:.2} ms against OPT_Wait {o:.2} ms: {}{} (paper: 7.4–53.1% \
             lower)",
            fmt_ratio(ratio(n, o)),
            driver.tag()
        );
    }
    if let (Some(&a), Some(&s)) = (peaks.get("adaptive"), peaks.get("serial")) {
        println!(
            "# Z5: peak latency from the high phase on, adaptive {a:.2} ms against serial {s:.2} ms: {}{} (slides: \
             16% lower in the 0.3 s burst)",
            fmt_ratio(ratio(a, s)),
            driver.tag()
        );
    }
    Ok(curves)
}

/// Poisson arrivals through consecutive phases of `(rate, requests)`.
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
    let lines: Vec<(&str, Vec<(f64, f64)>)> = curves
        .iter()
        .map(|(name, lat)| {
            let pts =
                lat.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(k, l)| (k as f64, *l)).collect();
            (*name, pts)
        })
        .collect();
    crate::plot::lines_svg(
        path,
        title,
        ("request (arrival order)", "latency (ms)"),
        &lines,
        Some(("QoS", qos)),
    )
}
