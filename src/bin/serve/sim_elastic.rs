//! `serve sim elastic --cost e2bird-res152 …` (issue 15, ARCHITECTURE.md §8.6): the fixed-shape
//! policies of E²bird and the async-transfer slides against TF-Serving's batching, on virtual
//! time with a whole-model cost file (the shipped Titan RTX figures of E²bird's Table 1, or a
//! `serve profile` of a resnet or mlp). Every figure it prints is simulated.
//!
//! The policies, arrivals and figures are `elastic_compare.rs`'s (shared with `serve bench
//! elastic`); this is its simulator driver. `--engine-configs` defaults to the paper's Table 4
//! picks for ResNet-152, the QoS to 200 ms and OPT_Wait to 30 ms (the paper's); Poisson rates
//! default to fractions of one full batch's capacity, MaxBS / t(MaxBS) from the cost file.
//!
//! With the equal-share device model (`shared_device` in the cost file) co-running workers end as
//! one batch of their summed rows: any engine configuration costs what a single batch costs, so
//! E-Ebird's measured co-run gain (ResNet-152 {8, 8, 16} in 85.3 ms against 93.7 ms for one 32)
//! cannot appear here without a co-run table, and E-Ebird ≈ N-Ebird.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::json;

use serve::Network;
use serve::model::Mlp;
use serve::sim::workload::{Lengths, requests};
use serve::sim::{CostFile, CostModel, Load, SimOutcome, TraceEvent};
use serve::workload::{DIURNAL_HIGH_REQUESTS, DIURNAL_LOW_REQUESTS};

use crate::bench::open_report;
use crate::elastic_compare::{Driver, Plan, Pol, Run, Setup, compare, policies};
use crate::sim::{SimRuns, run_result};
use crate::{CliResult, SimArgs, fatal};

/// ResNet-152's engine configurations, E²bird Table 4.
const PAPER_ENGINE_CONFS: [(usize, &[usize]); 4] =
    [(4, &[4]), (8, &[8]), (16, &[4, 4, 8]), (32, &[8, 8, 16])];
/// The paper's QoS and OPT_Wait time (ResNet-152 on a Titan RTX).
const PAPER_QOS_MS: f64 = 200.0;
const PAPER_OPT_WAIT_MS: f64 = 30.0;
/// Requests of one throughput-at-QoS probe at most.
const PROBE_REQUESTS: usize = 5000;

/// `--engine-configs FILE` (`serve profile --engine-configs`'s); default the paper's ResNet-152
/// picks.
fn engine_confs(path: Option<&Path>) -> CliResult<BTreeMap<usize, Vec<usize>>> {
    match path {
        Some(path) => crate::profile_engine::read_engine_configs(path),
        None => Ok(PAPER_ENGINE_CONFS.iter().map(|(t, c)| (*t, c.to_vec())).collect()),
    }
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

/// Latency of every request in arrival order (NaN: it did not complete), from a traced run.
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
    arrived.iter().map(|(id, a)| done.get(id).map_or(f64::NAN, |d| d.since(*a).as_secs_f64() * 1e3)).collect()
}

fn goodput(out: &SimOutcome, qos: f64) -> f64 {
    let span = out.last_completion.since(out.first_arrival).as_secs_f64();
    let good = out.latencies.iter().filter(|l| l.as_secs_f64() * 1e3 <= qos).count();
    if span > 0.0 { good as f64 / span } else { 0.0 }
}

/// The simulator as the comparison's driver.
struct SimDriver<'a> {
    runs: SimRuns<'a>,
    requests: usize,
}

impl Driver for SimDriver<'_> {
    fn run(&mut self, pol: &Pol, at: &[Duration], rate: f64, qos: f64, keep: bool) -> CliResult<Run> {
        let out =
            self.runs.simulate(&pol.name, &pol.config, &Load::Open(at.to_vec()), Some(at.len()), keep)?;
        let mut result = run_result(&pol.name, rate, &out)?;
        result.goodput_rps = Some(goodput(&out, qos));
        Ok(Run { result, by_arrival: if keep { by_arrival(&out) } else { Vec::new() } })
    }

    fn probe_requests(&self, _rate: f64) -> usize {
        self.requests.min(PROBE_REQUESTS)
    }

    fn run_requests(&self, _rate: f64) -> CliResult<usize> {
        Ok(self.requests)
    }

    fn tag(&self) -> &'static str {
        " (simulated)"
    }
}

pub(crate) fn cmd_sim_elastic(a: &SimArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let e = &a.elastic;
    let cost = CostFile::open(a.cost.as_deref().unwrap_or_default())?;
    let cap = capacity(&cost, e.max_bs)?;
    let (qos, opt_wait_ms) = (e.qos_ms.unwrap_or(PAPER_QOS_MS), e.opt_wait_ms.unwrap_or(PAPER_OPT_WAIT_MS));
    let pols = policies(&Setup {
        chosen: &e.policies,
        max_bs: e.max_bs,
        qos_ms: qos,
        opt_wait_ms,
        engine_confs: engine_confs(e.engine_configs.as_deref())?,
    });
    let report_file = open_report(a.json.as_ref())?;
    let net = Network::Mlp(Mlp::random(&[4, 4], a.seed));
    let n = a.requests.max(DIURNAL_LOW_REQUESTS + DIURNAL_HIGH_REQUESTS);
    let runs =
        SimRuns { net: &net, cost: &cost, reqs: requests(&net, Lengths::Fixed(1), n, a.seed)?, simulated: 0 };
    println!(
        "# serve sim elastic: SIMULATED on virtual time with cost `{}` ({}{}); MaxBS {}, one full batch's \
         capacity {cap:.1} req/s; QoS {qos} ms, OPT_Wait {opt_wait_ms} ms",
        cost.name,
        cost.backend,
        if cost.shared_device() { ", workers share the device" } else { "" },
        e.max_bs,
    );
    if !cost.source.is_empty() {
        println!("# cost source: {}", cost.source);
    }
    if cost.shared_device() {
        println!(
            "# with the equal-share device model co-running workers end as one batch of their summed rows: every \
             engine configuration costs one batch's time, so E-Ebird's co-run gain cannot appear (E-Ebird ≈ N-Ebird)"
        );
    }
    let report = json!({
        "backend": "sim", "cost": cost.name, "max_bs": e.max_bs, "opt_wait_ms": opt_wait_ms,
    });
    let mut driver = SimDriver { runs, requests: a.requests };
    let plan = Plan {
        e,
        rates: &a.rate,
        cap,
        qos,
        seed: a.seed,
        svg: a.svg.as_deref().map(|p| (p, format!("{}: latency by arrival order (simulated)", cost.name))),
        json: report_file,
    };
    compare(&mut driver, &pols, plan, report, t0)
}
