//! `serve bench mlp …` (DESIGN §8): Poisson open-loop load against an mlp, batched and unbatched.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use serve::model::Mlp;
use serve::{
    BackendKind, Code, CompletionQueue, Input, Model, ModelOptions, Network, PolicyConfig, Runtime,
    SubmitOptions, TimeoutConfig,
};

use crate::{BenchMlpArgs, CliResult, RuntimeArgs, build_runtime, fatal, timeout_policy};

/// CPU scale of DESIGN §8: hidden 256.
const CPU_SCALE_SIZES: [usize; 4] = [256, 256, 256, 256];
/// GPU scale of DESIGN §8 (the papers'): hidden 1024.
const GPU_SCALE_SIZES: [usize; 4] = [256, 1024, 1024, 256];
/// Offered rates, as fractions of the measured capacity, when no --rate is given.
const CAPACITY_FRACTIONS: [f64; 4] = [0.25, 0.5, 0.75, 0.9];
/// Distinct random request inputs cycled through by a benchmark.
const BENCH_INPUTS: usize = 64;
/// Most requests in one benchmark run (their arrival times are held in memory).
const MAX_BENCH_REQUESTS: usize = 50_000_000;
/// Latency histogram range, µs.
const HIST_MAX_US: u64 = 3_600_000_000;

/// Everything a benchmark run needs, whoever asked for it (`bench mlp` or the demo).
pub(crate) struct BenchPlan {
    /// The backend the runs get, and its one-line description.
    pub(crate) backend: (BackendKind, String),
    pub(crate) net: Arc<Network>,
    pub(crate) name: String,
    /// The `"model"` object of the JSON report.
    pub(crate) model_json: Value,
    pub(crate) rt: RuntimeArgs,
    pub(crate) batched: TimeoutConfig,
    /// Offered rates; `None` = fractions of the measured capacity.
    pub(crate) rates: Option<Vec<f64>>,
    pub(crate) fractions: Vec<f64>,
    pub(crate) requests: Option<usize>,
    pub(crate) duration_s: f64,
    pub(crate) capacity_time: Duration,
    pub(crate) seed: u64,
    pub(crate) qos: Option<Duration>,
    pub(crate) compare: bool,
    pub(crate) json: Option<PathBuf>,
    pub(crate) inputs: Vec<Vec<f32>>,
}

/// One policy at one offered rate.
#[derive(Debug, Clone)]
struct RunResult {
    policy: String,
    offered_rps: f64,
    throughput_rps: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    mean_batch: f64,
    completed: u64,
    errors: u64,
    goodput_rps: Option<f64>,
    error_codes: BTreeMap<&'static str, u64>,
    sender_lag_p99_ms: f64,
}

impl RunResult {
    fn to_json(&self) -> Value {
        let mut v = json!({
            "policy": self.policy,
            "offered_rps": self.offered_rps,
            "throughput_rps": self.throughput_rps,
            "p50_ms": self.p50_ms,
            "p90_ms": self.p90_ms,
            "p99_ms": self.p99_ms,
            "mean_batch": self.mean_batch,
            "completed": self.completed,
            "errors": self.errors,
            "error_codes": self.error_codes,
            "sender_lag_p99_ms": self.sender_lag_p99_ms,
        });
        if let (Some(g), Some(obj)) = (self.goodput_rps, v.as_object_mut()) {
            obj.insert("goodput_rps".into(), json!(g));
        }
        v
    }
}

fn policy_name(cfg: &TimeoutConfig) -> String {
    if cfg.max_batch == 1 {
        return if cfg.workers == 1 { "unbatched".into() } else { format!("unbatched(w={})", cfg.workers) };
    }
    let mut s = format!("timeout(s={},t={}us", cfg.max_batch, cfg.max_wait.as_micros());
    if cfg.workers != 1 {
        s.push_str(&format!(",w={}", cfg.workers));
    }
    if cfg.pad_to_max {
        s.push_str(",static");
    }
    s.push(')');
    s
}

pub(crate) fn random_inputs(len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_1a7e);
    (0..BENCH_INPUTS).map(|_| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()).collect()
}

/// The mlp inside `net`; `None` for other kinds.
#[allow(irrefutable_let_patterns)] // Network has only the mlp variant so far.
fn as_mlp(net: &Network) -> Option<&Mlp> {
    if let Network::Mlp(m) = net { Some(m) } else { None }
}

/// Layer widths of an mlp network (input first); `None` for other kinds.
fn mlp_sizes(net: &Network) -> Option<Vec<usize>> {
    as_mlp(net)
        .map(|m| std::iter::once(m.input_len()).chain(m.layers.iter().map(|l| l.out_features)).collect())
}

pub(crate) fn sizes_label(sizes: &[usize]) -> String {
    sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",")
}

fn scale_note(sizes: &[usize]) -> String {
    let hidden = &sizes[1..sizes.len() - 1];
    let h = hidden.iter().max().copied();
    let scale = match h {
        Some(256) => "CPU scale (hidden 256)",
        Some(1024) => "GPU scale (hidden 1024)",
        _ => "custom scale",
    };
    format!(
        "{scale}; DESIGN §8: CPU scale hidden 256 = 256,256,256,256, GPU scale hidden 1024 = 256,1024,1024,256"
    )
}

pub(crate) fn cmd_bench_mlp(a: BenchMlpArgs) -> CliResult<()> {
    // The backend decides the default model scale, so find out which one `--backend` gives.
    let backend = {
        let rt = build_runtime(a.rt)?;
        (rt.backend_kind(), rt.backend_description())
    };
    let (net, name, model_json) = match &a.model {
        Some(dir) => {
            let net = serve::model::load(dir)
                .map_err(|e| fatal(format!("cannot load model {}: {e}", dir.display())))?;
            let sizes = mlp_sizes(&net).ok_or_else(|| {
                fatal(format!("{} holds a {} model; `bench mlp` needs an mlp", dir.display(), net.kind()))
            })?;
            let name = dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
            let j = json!({"kind": "mlp", "source": dir.display().to_string(), "sizes": sizes,
                           "scale": scale_note(&sizes)});
            (net, name, j)
        }
        None => {
            let sizes = match (&a.sizes, backend.0) {
                (Some(s), _) => s.clone(),
                (None, BackendKind::Cpu) => CPU_SCALE_SIZES.to_vec(),
                (None, BackendKind::Cuda) => GPU_SCALE_SIZES.to_vec(),
            };
            if sizes.len() < 2 {
                return Err(fatal("--sizes needs at least an input and an output width"));
            }
            let net = Network::Mlp(Mlp::random(&sizes, a.seed));
            let j = json!({"kind": "mlp", "source": format!("random(seed={})", a.seed), "sizes": sizes,
                           "scale": scale_note(&sizes)});
            (net, "random-mlp".to_string(), j)
        }
    };
    let input_len = mlp_sizes(&net).map_or(0, |s| s[0]);
    let plan = BenchPlan {
        backend,
        net: Arc::new(net),
        name,
        model_json,
        rt: a.rt,
        batched: timeout_policy(a.max_batch, a.max_wait_us, a.workers),
        rates: if a.rate.is_empty() { None } else { Some(a.rate) },
        fractions: CAPACITY_FRACTIONS.to_vec(),
        requests: a.requests,
        duration_s: a.duration_s,
        capacity_time: Duration::from_secs_f64(a.capacity_s),
        seed: a.seed,
        qos: a.qos_ms.map(|ms| Duration::from_secs_f64(ms / 1e3)),
        compare: a.compare_batch,
        json: a.json,
        inputs: random_inputs(input_len, a.seed),
    };
    run_bench(&plan)
}

fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite() && b.is_finite()).then(|| a / b)
}

fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        None => "n/a".into(),
        Some(r) if r >= 0.1 => format!("{r:.2}x"),
        Some(r) => format!("{r:.4}x"),
    }
}

fn print_header(qos: bool) {
    println!(
        "{:<24} {:>11} {:>14} {:>8} {:>8} {:>8} {:>10} {:>9} {:>7}{}",
        "policy",
        "offered_rps",
        "throughput_rps",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "mean_batch",
        "completed",
        "errors",
        if qos { "  goodput_rps" } else { "" }
    );
}

fn print_row(r: &RunResult) {
    let goodput = r.goodput_rps.map_or(String::new(), |g| format!("  {g:>11.1}"));
    println!(
        "{:<24} {:>11.1} {:>14.1} {:>8.3} {:>8.3} {:>8.3} {:>10.2} {:>9} {:>7}{goodput}",
        r.policy,
        r.offered_rps,
        r.throughput_rps,
        r.p50_ms,
        r.p90_ms,
        r.p99_ms,
        r.mean_batch,
        r.completed,
        r.errors
    );
    if !r.error_codes.is_empty() {
        let codes: Vec<String> = r.error_codes.iter().map(|(c, n)| format!("{c}={n}")).collect();
        println!("{:<24}   errors: {}", "", codes.join(" "));
    }
}

/// Requests in one run at `rate`: `--requests`, else rate × duration.
fn requests_per_run(plan: &BenchPlan, rate: f64) -> CliResult<usize> {
    match plan.requests {
        Some(n) if n > MAX_BENCH_REQUESTS => {
            Err(fatal(format!("--requests {n} is more than the {MAX_BENCH_REQUESTS} a run may hold")))
        }
        Some(n) => Ok(n),
        None => {
            let n = (rate * plan.duration_s).ceil().max(1.0);
            if n > MAX_BENCH_REQUESTS as f64 {
                return Err(fatal(format!(
                    "{rate} rps for {} s is {n} requests, more than the {MAX_BENCH_REQUESTS} a run may hold; \
                     lower --rate or --duration-s, or pass --requests",
                    plan.duration_s
                )));
            }
            Ok(n as usize)
        }
    }
}

pub(crate) fn run_bench(plan: &BenchPlan) -> CliResult<()> {
    let t0 = Instant::now();
    // Fail before the runs, not after them, when the report cannot be written.
    let json_file = match &plan.json {
        Some(path) => Some((
            path,
            File::create(path).map_err(|e| fatal(format!("cannot write {}: {e}", path.display())))?,
        )),
        None => None,
    };
    let (backend, backend_desc) = &plan.backend;
    let sizes = mlp_sizes(&plan.net).unwrap_or_default();
    let mflop = as_mlp(&plan.net).map_or(0.0, |m| m.flops_per_row() as f64 / 1e6);
    println!("# serve bench mlp: workload poisson (open loop), backend {backend_desc}");
    println!(
        "# model: mlp `{}` sizes {} ({:.2} MFLOP/request); {}",
        plan.name,
        sizes_label(&sizes),
        mflop,
        scale_note(&sizes)
    );
    let unbatched = TimeoutConfig { max_batch: 1, max_wait: Duration::ZERO, ..plan.batched };
    let compare = plan.compare && plan.batched.max_batch > 1;
    if plan.compare && !compare {
        println!("# --max-batch 1 is already unbatched: no batched/unbatched comparison");
    }

    let mut capacity = None;
    let rates = match &plan.rates {
        Some(r) => r.clone(),
        None => {
            let cap = measure_capacity(plan)?;
            println!(
                "# capacity: {cap:.1} rps ({}, closed loop, {:.1} s); offered rates at {} of it",
                policy_name(&plan.batched),
                plan.capacity_time.as_secs_f64(),
                plan.fractions.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(", ")
            );
            capacity = Some(cap);
            plan.fractions.iter().map(|f| (f * cap).round().max(1.0)).collect()
        }
    };

    let counts = rates.iter().map(|&rate| requests_per_run(plan, rate)).collect::<CliResult<Vec<_>>>()?;
    print_header(plan.qos.is_some());
    let mut results = Vec::new();
    let mut comparisons = Vec::new();
    let mut ratio_lines = Vec::new();
    for (k, (&rate, &n)) in rates.iter().zip(&counts).enumerate() {
        let seed = plan.seed.wrapping_add(1 + k as u64);
        let b = run_open_loop(plan, plan.batched, rate, n, seed)?;
        print_row(&b);
        if compare {
            let u = run_open_loop(plan, unbatched, rate, n, seed)?;
            print_row(&u);
            let (tr, pr) = (ratio(b.throughput_rps, u.throughput_rps), ratio(b.p99_ms, u.p99_ms));
            ratio_lines.push(format!(
                "# ratio batched/unbatched at {rate:.1} rps: throughput {}, p99 {}",
                fmt_ratio(tr),
                fmt_ratio(pr)
            ));
            comparisons.push(json!({"offered_rps": rate, "policy": b.policy, "baseline": u.policy,
                                    "throughput_ratio": tr, "p99_ratio": pr}));
            results.push(b);
            results.push(u);
        } else {
            results.push(b);
        }
    }
    for l in &ratio_lines {
        println!("{l}");
    }
    println!("# {} run(s) in {:.1} s", results.len(), t0.elapsed().as_secs_f64());

    if let Some((path, mut file)) = json_file {
        let report = json!({
            "workload": "poisson",
            "backend": backend.to_string(),
            "backend_description": backend_desc,
            "model": plan.model_json,
            "capacity_rps": capacity,
            "qos_ms": plan.qos.map(|q| q.as_secs_f64() * 1e3),
            "results": results.iter().map(RunResult::to_json).collect::<Vec<_>>(),
            "comparisons": comparisons,
        });
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| fatal(format!("cannot encode the JSON report: {e}")))?;
        file.write_all((text + "\n").as_bytes())
            .map_err(|e| fatal(format!("cannot write {}: {e}", path.display())))?;
        println!("# wrote {}", path.display());
    }
    Ok(())
}

/// A runtime serving the plan's network under `cfg`, warmed up (buffers touched, threads started).
fn start_model(plan: &BenchPlan, cfg: TimeoutConfig) -> CliResult<(Runtime, Model)> {
    let rt = build_runtime(plan.rt)?;
    let opts = ModelOptions { policy: PolicyConfig::Timeout(cfg), ..ModelOptions::default() };
    let model = rt.add_network(plan.net.clone(), plan.name.clone(), opts)?;
    for _ in 0..3 {
        let tickets = (0..cfg.max_batch * cfg.workers)
            .map(|i| {
                model.submit(Input::F32(plan.inputs[i % plan.inputs.len()].clone()), SubmitOptions::default())
            })
            .collect::<serve::Result<Vec<_>>>()?;
        for t in tickets {
            t.wait().map_err(|e| fatal(format!("warm-up request failed: {e}")))?;
        }
    }
    Ok((rt, model))
}

fn new_hist() -> CliResult<Histogram<u64>> {
    Histogram::new_with_bounds(1, HIST_MAX_US, 3).map_err(|e| fatal(format!("histogram: {e}")))
}

/// A progress bar on stderr (a spinner when `len` is unknown); hidden unless stderr is a terminal.
fn progress(len: Option<u64>, label: String) -> ProgressBar {
    if !io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let (pb, template) = match len {
        Some(n) => (ProgressBar::new(n), "{msg:32} [{bar:30}] {pos}/{len} {elapsed}"),
        None => (ProgressBar::new_spinner(), "{spinner} {msg:32} {pos} completed {elapsed}"),
    };
    let pb = pb.with_message(label);
    match ProgressStyle::with_template(template) {
        Ok(style) => pb.with_style(style.progress_chars("=> ")),
        Err(_) => pb,
    }
}

/// Closed-loop capacity: keep twice a full round of batches in flight for `capacity_time`, count
/// completions after a 20 % settling period.
fn measure_capacity(plan: &BenchPlan) -> CliResult<f64> {
    let (rt, model) = start_model(plan, plan.batched)?;
    let queue = CompletionQueue::new()?;
    let window = (plan.batched.max_batch * plan.batched.workers * 2).max(4);
    let pb = progress(None, format!("capacity {}", policy_name(&plan.batched)));
    let start = Instant::now();
    let settle = start + plan.capacity_time / 5;
    let end = start + plan.capacity_time;
    let mut next = 0usize;
    let submit = |i: usize| {
        let input = Input::F32(plan.inputs[i % plan.inputs.len()].clone());
        model.submit_to(input, SubmitOptions::default(), &queue, i as u64)
    };
    let mut in_flight = 0usize;
    for _ in 0..window {
        submit(next)?;
        next += 1;
        in_flight += 1;
    }
    let (mut counted, mut failed) = (0u64, 0u64);
    let mut measured_from = None;
    let mut last = start;
    let mut batch = Vec::with_capacity(window);
    while in_flight > 0 {
        batch.clear();
        queue.next_into(&mut batch, window, Duration::from_millis(100))?;
        let now = Instant::now();
        for c in batch.drain(..) {
            in_flight -= 1;
            pb.inc(1);
            if now >= settle && now <= end {
                let from = *measured_from.get_or_insert(now);
                if c.result.is_ok() && now > from {
                    counted += 1;
                    last = now;
                }
            }
            if c.result.is_err() {
                failed += 1;
            }
            if now < end {
                submit(next)?;
                next += 1;
                in_flight += 1;
            }
        }
    }
    pb.finish_and_clear();
    drop(rt);
    let span = measured_from.map_or(0.0, |from| (last - from).as_secs_f64());
    if counted == 0 || span <= 0.0 {
        return Err(fatal(format!(
            "could not measure capacity: {counted} request(s) completed in the measuring window, {failed} failed; \
             pass --rate explicitly or a longer --capacity-s"
        )));
    }
    Ok(counted as f64 / span)
}

/// Sets a flag when dropped, so a sender that panics still ends the drain loop.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Open loop: `n` Poisson arrivals at `rate`; a sender thread submits each at its scheduled
/// instant, this thread drains the completion queue and records latency from the *scheduled*
/// arrival (so a late sender shows up as latency, not as a lighter load).
fn run_open_loop(
    plan: &BenchPlan,
    cfg: TimeoutConfig,
    rate: f64,
    n: usize,
    seed: u64,
) -> CliResult<RunResult> {
    let policy = policy_name(&cfg);
    let (rt, model) = start_model(plan, cfg)?;
    let offsets = serve::workload::poisson_arrivals(rate, n, seed);
    let queue = CompletionQueue::new()?;
    let accepted = AtomicU64::new(0);
    let sender_done = AtomicBool::new(false);
    let pb = progress(Some(n as u64), format!("{policy} @ {rate:.0} rps"));
    let mut hist = new_hist()?;
    let lag_hist = new_hist()?;
    let before = rt.stats();
    let span = offsets.last().copied().unwrap_or_default();
    // After the last arrival, wait this long for the backlog before cancelling what is left.
    let drain_limit = span.max(Duration::from_secs(1));
    let start = Instant::now() + Duration::from_millis(2);

    let (mut ok, mut failed, mut good, mut missing) = (0u64, 0u64, 0u64, 0u64);
    let mut codes: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut last_done = start;
    let (lag_hist, rejected) = std::thread::scope(|s| -> CliResult<(Histogram<u64>, Vec<Code>)> {
        let sender = s.spawn(|| {
            let _done = SetOnDrop(&sender_done);
            let mut lag = lag_hist;
            let mut rejected = Vec::new();
            for (i, off) in offsets.iter().enumerate() {
                let due = start + *off;
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let input = Input::F32(plan.inputs[i % plan.inputs.len()].clone());
                let submitted = Instant::now();
                lag.saturating_record(submitted.saturating_duration_since(due).as_micros() as u64);
                match model.submit_to(input, SubmitOptions::default(), &queue, i as u64) {
                    Ok(_) => {
                        accepted.fetch_add(1, Ordering::Release);
                    }
                    Err(e) => {
                        rejected.push(e.code());
                        pb.inc(1);
                    }
                }
            }
            (lag, rejected)
        });
        let mut batch = Vec::with_capacity(1024);
        let mut seen = 0u64;
        let mut drain_deadline: Option<Instant> = None;
        let mut cancelled_at: Option<Instant> = None;
        loop {
            batch.clear();
            queue.next_into(&mut batch, 1024, Duration::from_millis(20))?;
            let now = Instant::now();
            for c in batch.drain(..) {
                seen += 1;
                pb.inc(1);
                match c.result {
                    Ok(_) => {
                        let due = start + offsets[c.tag as usize];
                        let latency = now.saturating_duration_since(due);
                        hist.saturating_record((latency.as_micros() as u64).max(1));
                        ok += 1;
                        good += u64::from(plan.qos.is_some_and(|q| latency <= q));
                        last_done = now;
                    }
                    Err(e) => {
                        failed += 1;
                        *codes.entry(e.code().name()).or_default() += 1;
                    }
                }
            }
            if !sender_done.load(Ordering::Acquire) {
                continue;
            }
            let total = accepted.load(Ordering::Acquire);
            if seen >= total {
                break;
            }
            let deadline = *drain_deadline.get_or_insert(now + drain_limit);
            match cancelled_at {
                None if now >= deadline => {
                    // Overloaded past the drain limit: shutting down completes the backlog
                    // CANCELLED, counted as errors.
                    rt.shutdown(Duration::ZERO);
                    cancelled_at = Some(now);
                }
                Some(t) if now >= t + Duration::from_secs(5) => {
                    // Never expected (every request completes exactly once): do not hang.
                    missing = total - seen;
                    break;
                }
                _ => {}
            }
        }
        sender.join().map_err(|_| fatal("the benchmark's sender thread panicked"))
    })?;
    pb.finish_and_clear();
    let after = rt.stats();
    drop(model);
    drop(rt);

    for c in &rejected {
        *codes.entry(c.name()).or_default() += 1;
    }
    if missing > 0 {
        codes.insert("MISSING", missing);
    }
    let elapsed = last_done.saturating_duration_since(start).as_secs_f64();
    let per_s = |count: u64| if elapsed > 0.0 { count as f64 / elapsed } else { 0.0 };
    let tasks = after.tasks_launched.saturating_sub(before.tasks_launched);
    let batched = after.batched_requests.saturating_sub(before.batched_requests);
    Ok(RunResult {
        policy,
        offered_rps: rate,
        throughput_rps: per_s(ok),
        p50_ms: ms(hist.value_at_quantile(0.50)),
        p90_ms: ms(hist.value_at_quantile(0.90)),
        p99_ms: ms(hist.value_at_quantile(0.99)),
        mean_batch: if tasks == 0 { 0.0 } else { batched as f64 / tasks as f64 },
        completed: ok,
        errors: failed + rejected.len() as u64 + missing,
        goodput_rps: plan.qos.map(|_| per_s(good)),
        error_codes: codes,
        sender_lag_p99_ms: ms(lag_hist.value_at_quantile(0.99)),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policy_names() {
        assert_eq!(policy_name(&timeout_policy(32, 0, 1)), "timeout(s=32,t=0us)");
        assert_eq!(policy_name(&timeout_policy(8, 250, 2)), "timeout(s=8,t=250us,w=2)");
        assert_eq!(policy_name(&timeout_policy(1, 0, 1)), "unbatched");
    }
}
