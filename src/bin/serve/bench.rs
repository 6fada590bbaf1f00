//! `serve bench mlp …` (ARCHITECTURE.md §8): Poisson open-loop load against an mlp, batched and unbatched.
//!
//! Also the open-loop machinery every `serve bench <model>` shares ([`Workload`], [`PolicySpec`],
//! [`measure_capacity`], [`run_open_loop`], the table and the JSON report): a workload is a
//! network and a list of request [`Input`]s, a policy is any [`PolicyConfig`].

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
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
    BackendKind, Code, CompletionQueue, Input, Model, ModelOptions, Network, Output, PolicyConfig, Runtime,
    SubmitOptions, TimeoutConfig,
};

use crate::{BenchMlpArgs, CliResult, RuntimeArgs, build_runtime, fatal, timeout_policy};

/// CPU scale of ARCHITECTURE.md §8: hidden 256.
const CPU_SCALE_SIZES: [usize; 4] = [256, 256, 256, 256];
/// GPU scale of ARCHITECTURE.md §8 (the papers'): hidden 1024.
const GPU_SCALE_SIZES: [usize; 4] = [256, 1024, 1024, 256];
/// Offered rates, as fractions of the measured capacity, when no --rate is given.
const CAPACITY_FRACTIONS: [f64; 4] = [0.25, 0.5, 0.75, 0.9];
/// Distinct random request inputs cycled through by a benchmark.
const BENCH_INPUTS: usize = 64;
/// Most requests in one benchmark run (their arrival times are held in memory).
pub(crate) const MAX_BENCH_REQUESTS: usize = 50_000_000;
/// Latency histogram range, µs.
const HIST_MAX_US: u64 = 3_600_000_000;
/// Width of the policy column of the results table (the PyTorch peer's labels, e.g.
/// `torch-bucket(b=256,d=10ms,w=10)`, are the longest).
const POLICY_COLUMN: usize = 32;

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
    pub(crate) svg: Option<PathBuf>,
    pub(crate) inputs: Vec<Vec<f32>>,
}

// ---------------------------------------------------------------------------------------------
// The shared open-loop machinery
// ---------------------------------------------------------------------------------------------

/// What a benchmark serves and sends, whichever policy batches it.
pub(crate) struct Workload {
    pub(crate) rt: RuntimeArgs,
    pub(crate) net: Arc<Network>,
    pub(crate) name: String,
    /// Request inputs; request `i` of every run sends `inputs[i % len]`, so every policy and
    /// every rate sees the same requests in the same order.
    pub(crate) inputs: Vec<Input>,
    /// Latency target for goodput, if any.
    pub(crate) qos: Option<Duration>,
    /// `ModelOptions::token_gates_bytes` of every policy's model (`None`: the default).
    pub(crate) token_gates_bytes: Option<usize>,
}

impl Workload {
    pub(crate) fn input(&self, i: usize) -> Input {
        self.inputs[i % self.inputs.len()].clone()
    }
}

/// A policy under test.
#[derive(Clone, Debug)]
pub(crate) struct PolicySpec {
    /// The name in tables and JSON, e.g. `timeout(s=32,t=0us)` or `cellular(b=512,k=5)`.
    pub(crate) label: String,
    pub(crate) config: PolicyConfig,
    /// Warm-up before measuring: `warmup_rounds` rounds of `warmup` requests, each round waited for.
    pub(crate) warmup: usize,
    pub(crate) warmup_rounds: usize,
    /// Requests the closed loop of [`measure_capacity`] keeps in flight.
    pub(crate) window: usize,
}

/// One policy at one offered rate.
#[derive(Debug, Clone)]
pub(crate) struct RunResult {
    pub(crate) policy: String,
    pub(crate) offered_rps: f64,
    pub(crate) throughput_rps: f64,
    pub(crate) p50_ms: f64,
    pub(crate) p90_ms: f64,
    pub(crate) p99_ms: f64,
    pub(crate) mean_batch: f64,
    /// Mean compute time of a task, as the backend measured it (the simulator: its cost
    /// model's), when known.
    pub(crate) mean_task_us: Option<f64>,
    pub(crate) completed: u64,
    pub(crate) errors: u64,
    pub(crate) goodput_rps: Option<f64>,
    pub(crate) error_codes: BTreeMap<&'static str, u64>,
    pub(crate) sender_lag_p99_ms: f64,
    /// The engine thread's utilization over the run (`StatsSnapshot::engine_busy_ns` over the
    /// run's wall time), for a run of the real runtime.
    pub(crate) engine_busy: Option<f64>,
    /// The share of the machine's CPU time the hypervisor stole during the run (`steal.rs`), for
    /// a run of the real runtime on Linux.
    pub(crate) steal: Option<f64>,
    /// Mean length of token outputs (seq2seq decodes), when the outputs were tokens.
    pub(crate) mean_output_tokens: Option<f64>,
    /// Fields added to this result's JSON object (e.g. `peak_rps`).
    pub(crate) extra: serde_json::Map<String, Value>,
}

impl RunResult {
    pub(crate) fn to_json(&self) -> Value {
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
        if let Some(obj) = v.as_object_mut() {
            if let Some(t) = self.mean_task_us {
                obj.insert("mean_task_us".into(), json!(t));
            }
            if let Some(g) = self.goodput_rps {
                obj.insert("goodput_rps".into(), json!(g));
            }
            if let Some(b) = self.engine_busy {
                obj.insert("engine_busy".into(), json!(b));
            }
            if let Some(s) = self.steal {
                obj.insert("steal".into(), json!(s));
            }
            if let Some(t) = self.mean_output_tokens {
                obj.insert("mean_output_tokens".into(), json!(t));
            }
            obj.extend(self.extra.clone());
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

/// The timeout policy `cfg` as a policy under test (warm-up: three rounds of full batches).
pub(crate) fn timeout_spec(cfg: TimeoutConfig) -> PolicySpec {
    PolicySpec {
        label: policy_name(&cfg),
        config: PolicyConfig::Timeout(cfg),
        warmup: cfg.max_batch * cfg.workers,
        warmup_rounds: 3,
        window: (cfg.max_batch * cfg.workers * 2).max(4),
    }
}

pub(crate) fn random_inputs(len: usize, seed: u64) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_1a7e);
    (0..BENCH_INPUTS).map(|_| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()).collect()
}

/// The mlp inside `net`; `None` for other kinds.
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
        "{scale}; ARCHITECTURE.md §8: CPU scale hidden 256 = 256,256,256,256, GPU scale hidden 1024 = 256,1024,1024,256"
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
                fatal(format!(
                    "{} holds a {} model; `bench mlp` needs an mlp (try `serve bench {}`)",
                    dir.display(),
                    net.kind(),
                    net.kind()
                ))
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
        svg: a.svg,
        inputs: random_inputs(input_len, a.seed),
    };
    run_bench(&plan)
}

pub(crate) fn ms(us: u64) -> f64 {
    us as f64 / 1e3
}

pub(crate) fn ratio(a: f64, b: f64) -> Option<f64> {
    (b > 0.0 && a.is_finite() && b.is_finite()).then(|| a / b)
}

pub(crate) fn fmt_ratio(r: Option<f64>) -> String {
    match r {
        None => "n/a".into(),
        Some(r) if r >= 0.1 => format!("{r:.2}x"),
        Some(r) => format!("{r:.4}x"),
    }
}

/// The results table's header; `qos` adds goodput, `tokens` the mean output length. The last
/// columns, the engine thread's utilization and the CPU time the hypervisor stole (a virtual
/// machine's host running something else), are `-` where not measured (the simulator, a peer).
pub(crate) fn print_header(qos: bool, tokens: bool) {
    println!(
        "{:<w$} {:>11} {:>14} {:>8} {:>8} {:>8} {:>10} {:>9} {:>7}{}{}  engine  steal",
        "policy",
        "offered_rps",
        "throughput_rps",
        "p50_ms",
        "p90_ms",
        "p99_ms",
        "mean_batch",
        "completed",
        "errors",
        if qos { "  goodput_rps" } else { "" },
        if tokens { "  out_tokens" } else { "" },
        w = POLICY_COLUMN,
    );
}

pub(crate) fn print_row(r: &RunResult) {
    let goodput = r.goodput_rps.map_or(String::new(), |g| format!("  {g:>11.1}"));
    let tokens = r.mean_output_tokens.map_or(String::new(), |t| format!("  {t:>10.2}"));
    let engine = r.engine_busy.map_or("-".to_string(), |b| format!("{:.0}%", b * 100.0));
    let steal = r.steal.map_or("-".to_string(), |s| format!("{:.1}%", s * 100.0));
    println!(
        "{:<w$} {:>11.1} {:>14.1} {:>8.3} {:>8.3} {:>8.3} {:>10.2} {:>9} {:>7}{goodput}{tokens}  {engine:>6} {steal:>6}",
        r.policy,
        r.offered_rps,
        r.throughput_rps,
        r.p50_ms,
        r.p90_ms,
        r.p99_ms,
        r.mean_batch,
        r.completed,
        r.errors,
        w = POLICY_COLUMN,
    );
    if !r.error_codes.is_empty() {
        let codes: Vec<String> = r.error_codes.iter().map(|(c, n)| format!("{c}={n}")).collect();
        println!("{:<w$}   errors: {}", "", codes.join(" "), w = POLICY_COLUMN);
    }
}

/// Requests in one run at `rate`: `requests` when given, else rate × `duration_s`.
pub(crate) fn requests_per_run(requests: Option<usize>, duration_s: f64, rate: f64) -> CliResult<usize> {
    match requests {
        Some(n) if n > MAX_BENCH_REQUESTS => {
            Err(fatal(format!("--requests {n} is more than the {MAX_BENCH_REQUESTS} a run may hold")))
        }
        Some(n) => Ok(n),
        None => {
            let n = (rate * duration_s).ceil().max(1.0);
            if n > MAX_BENCH_REQUESTS as f64 {
                return Err(fatal(format!(
                    "{rate} rps for {duration_s} s is {n} requests, more than the {MAX_BENCH_REQUESTS} a run \
                     may hold; lower --rate or --duration-s, or pass --requests"
                )));
            }
            Ok(n as usize)
        }
    }
}

/// Create the JSON report's file before the runs, so a bad path fails before, not after, them.
pub(crate) fn open_report(path: Option<&PathBuf>) -> CliResult<Option<(PathBuf, File)>> {
    path.map(|p| {
        File::create(p)
            .map(|f| (p.clone(), f))
            .map_err(|e| fatal(format!("cannot write {}: {e}", p.display())))
    })
    .transpose()
}

/// Write `report` (pretty JSON) to the file [`open_report`] created.
pub(crate) fn write_report(path: &Path, mut file: File, report: &Value) -> CliResult<()> {
    let text = serde_json::to_string_pretty(report)
        .map_err(|e| fatal(format!("cannot encode the JSON report: {e}")))?;
    file.write_all((text + "\n").as_bytes())
        .map_err(|e| fatal(format!("cannot write {}: {e}", path.display())))?;
    println!("# wrote {}", path.display());
    Ok(())
}

pub(crate) fn run_bench(plan: &BenchPlan) -> CliResult<()> {
    let t0 = Instant::now();
    let report_file = open_report(plan.json.as_ref())?;
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
    let work = Workload {
        rt: plan.rt,
        net: plan.net.clone(),
        name: plan.name.clone(),
        inputs: plan.inputs.iter().map(|v| Input::F32(v.clone())).collect(),
        qos: plan.qos,
        token_gates_bytes: None,
    };
    let batched = timeout_spec(plan.batched);
    let unbatched = timeout_spec(TimeoutConfig { max_batch: 1, max_wait: Duration::ZERO, ..plan.batched });
    let compare = plan.compare && plan.batched.max_batch > 1;
    if plan.compare && !compare {
        println!("# --max-batch 1 is already unbatched: no batched/unbatched comparison");
    }

    let mut capacity = None;
    let rates = match &plan.rates {
        Some(r) => r.clone(),
        None => {
            let Capacity { rps: cap, steal } = measure_capacity(&work, &batched, plan.capacity_time)?;
            println!(
                "# capacity: {cap:.1} rps ({}, closed loop, {:.1} s{}); offered rates at {} of it",
                batched.label,
                plan.capacity_time.as_secs_f64(),
                crate::steal::note(steal),
                plan.fractions.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(", ")
            );
            capacity = Some(cap);
            plan.fractions.iter().map(|f| (f * cap).round().max(1.0)).collect()
        }
    };

    let counts = rates
        .iter()
        .map(|&rate| requests_per_run(plan.requests, plan.duration_s, rate))
        .collect::<CliResult<Vec<_>>>()?;
    print_header(plan.qos.is_some(), false);
    let mut results = Vec::new();
    let mut comparisons = Vec::new();
    let mut ratio_lines = Vec::new();
    for (k, (&rate, &n)) in rates.iter().zip(&counts).enumerate() {
        let seed = plan.seed.wrapping_add(1 + k as u64);
        let b = run_open_loop(&work, &batched, rate, n, seed)?;
        print_row(&b);
        if compare {
            let u = run_open_loop(&work, &unbatched, rate, n, seed)?;
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
    if let Some(svg) = &plan.svg {
        crate::plot::latency_svg(svg, &format!("serve bench mlp ({backend_desc})"), &results)?;
    }

    if let Some((path, file)) = report_file {
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
        write_report(&path, file, &report)?;
    }
    Ok(())
}

/// A runtime serving the workload's network under `policy`, warmed up (buffers touched, threads
/// started).
pub(crate) fn start_model(work: &Workload, policy: &PolicySpec) -> CliResult<(Runtime, Model)> {
    let rt = build_runtime(work.rt)?;
    let opts = ModelOptions {
        policy: policy.config.clone(),
        token_gates_bytes: work.token_gates_bytes,
        ..ModelOptions::default()
    };
    let model = rt
        .add_network(work.net.clone(), work.name.clone(), opts)
        .map_err(|e| fatal(format!("cannot serve `{}` under {}: {e}", work.name, policy.label)))?;
    for _ in 0..policy.warmup_rounds {
        let tickets = (0..policy.warmup)
            .map(|i| model.submit(work.input(i), SubmitOptions::default()))
            .collect::<serve::Result<Vec<_>>>()?;
        for t in tickets {
            t.wait().map_err(|e| fatal(format!("warm-up request failed: {e}")))?;
        }
    }
    Ok((rt, model))
}

pub(crate) fn new_hist() -> CliResult<Histogram<u64>> {
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

/// A closed-loop capacity and the share of the CPU the hypervisor stole while it was measured
/// (`steal.rs`).
pub(crate) struct Capacity {
    pub(crate) rps: f64,
    pub(crate) steal: Option<f64>,
}

/// Closed-loop capacity: keep `policy.window` requests in flight for `time` (each completion is
/// replaced by a new request at once), count the completions after a 20 % settling period; the
/// backlog left at the end is cancelled, not waited for.
pub(crate) fn measure_capacity(work: &Workload, policy: &PolicySpec, time: Duration) -> CliResult<Capacity> {
    let (rt, model) = start_model(work, policy)?;
    let cpu_before = crate::steal::now();
    let queue = CompletionQueue::new()?;
    let window = policy.window.max(1);
    let pb = progress(None, format!("capacity {}", policy.label));
    let start = Instant::now();
    let settle = start + time / 5;
    let end = start + time;
    let mut next = 0usize;
    let submit = |i: usize| model.submit_to(work.input(i), SubmitOptions::default(), &queue, i as u64);
    let mut in_flight = 0usize;
    for _ in 0..window {
        submit(next)?;
        next += 1;
        in_flight += 1;
    }
    let (mut counted, mut failed) = (0u64, 0u64);
    let mut measured_from = None;
    let mut last = start;
    let mut batch = Vec::with_capacity(window.min(4096));
    while in_flight > 0 {
        batch.clear();
        queue.next_into(&mut batch, window.min(4096), Duration::from_millis(100))?;
        let now = Instant::now();
        if now > end {
            // Measured: the backlog is not waited for (dropping the runtime cancels it).
            break;
        }
        for c in batch.drain(..) {
            in_flight -= 1;
            pb.inc(1);
            let ok = c.result.is_ok();
            // A completion holds its request's admission place until it is dropped: with a window
            // of the whole admission bound, the replacement would be refused BUSY.
            drop(c);
            if now >= settle {
                let from = *measured_from.get_or_insert(now);
                if ok && now > from {
                    counted += 1;
                    last = now;
                }
            }
            if !ok {
                failed += 1;
            }
            submit(next)?;
            next += 1;
            in_flight += 1;
        }
    }
    pb.finish_and_clear();
    let steal = crate::steal::share(cpu_before, crate::steal::now());
    drop(model);
    drop(rt);
    let span = measured_from.map_or(0.0, |from| (last - from).as_secs_f64());
    if counted == 0 || span <= 0.0 {
        return Err(fatal(format!(
            "could not measure the capacity of {}: {counted} request(s) completed in the measuring window, \
             {failed} failed; pass --rate explicitly or a longer --capacity-s",
            policy.label
        )));
    }
    Ok(Capacity { rps: counted as f64 / span, steal })
}

/// Sets a flag when dropped, so a sender that panics still ends the drain loop.
struct SetOnDrop<'a>(&'a AtomicBool);

impl Drop for SetOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Open loop: `n` Poisson arrivals at `rate` ([`run_arrivals`]).
pub(crate) fn run_open_loop(
    work: &Workload,
    policy: &PolicySpec,
    rate: f64,
    n: usize,
    seed: u64,
) -> CliResult<RunResult> {
    let offsets = serve::workload::poisson_arrivals(rate, n, seed);
    Ok(run_arrivals(work, policy, rate, &offsets, false)?.0)
}

/// Open loop: one request due at each of `offsets` (from the start), offered as `rate` in the
/// result. A sender thread submits each at its due instant, this thread drains the completion
/// queue and records latency from the *due* instant (so a late sender shows up as latency, not
/// as a lighter load). The mean batch is the runtime's requests (rows, padding not counted) per
/// launched task over the run. With `by_arrival`, also each request's latency (ms) in arrival
/// order (NaN: it failed).
pub(crate) fn run_arrivals(
    work: &Workload,
    policy: &PolicySpec,
    rate: f64,
    offsets: &[Duration],
    by_arrival: bool,
) -> CliResult<(RunResult, Vec<f64>)> {
    let n = offsets.len();
    let (rt, model) = start_model(work, policy)?;
    let mut latencies = if by_arrival { vec![f64::NAN; n] } else { Vec::new() };
    let queue = CompletionQueue::new()?;
    let accepted = AtomicU64::new(0);
    let sender_done = AtomicBool::new(false);
    let pb = progress(Some(n as u64), format!("{} @ {rate:.0} rps", policy.label));
    let mut hist = new_hist()?;
    let lag_hist = new_hist()?;
    let before = rt.stats();
    let cpu_before = crate::steal::now();
    let run_start = Instant::now();
    let span = offsets.last().copied().unwrap_or_default();
    // After the last arrival, wait this long for the backlog before cancelling what is left.
    let drain_limit = span.max(Duration::from_secs(1));
    let start = Instant::now() + Duration::from_millis(2);

    let (mut ok, mut failed, mut good, mut missing) = (0u64, 0u64, 0u64, 0u64);
    let (mut token_outputs, mut tokens_out) = (0u64, 0u64);
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
                let input = work.input(i);
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
                    Ok(out) => {
                        let due = start + offsets[c.tag as usize];
                        let latency = now.saturating_duration_since(due);
                        if let Some(l) = latencies.get_mut(c.tag as usize) {
                            *l = latency.as_secs_f64() * 1e3;
                        }
                        hist.saturating_record((latency.as_micros() as u64).max(1));
                        ok += 1;
                        good += u64::from(work.qos.is_some_and(|q| latency <= q));
                        last_done = now;
                        if let Output::Tokens(t) = &out {
                            token_outputs += 1;
                            tokens_out += t.len() as u64;
                        }
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
    let steal = crate::steal::share(cpu_before, crate::steal::now());
    let run_wall = run_start.elapsed();
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
    let result = RunResult {
        policy: policy.label.clone(),
        offered_rps: rate,
        throughput_rps: per_s(ok),
        p50_ms: ms(hist.value_at_quantile(0.50)),
        p90_ms: ms(hist.value_at_quantile(0.90)),
        p99_ms: ms(hist.value_at_quantile(0.99)),
        mean_batch: if tasks == 0 { 0.0 } else { batched as f64 / tasks as f64 },
        mean_task_us: {
            let timed = after.timed_tasks.saturating_sub(before.timed_tasks);
            let ns = after.task_compute_ns.saturating_sub(before.task_compute_ns);
            (timed > 0).then(|| ns as f64 / timed as f64 / 1e3)
        },
        completed: ok,
        errors: failed + rejected.len() as u64 + missing,
        goodput_rps: work.qos.map(|_| per_s(good)),
        error_codes: codes,
        sender_lag_p99_ms: ms(lag_hist.value_at_quantile(0.99)),
        engine_busy: {
            let ns = after.engine_busy_ns.saturating_sub(before.engine_busy_ns);
            let wall = run_wall.as_nanos() as f64;
            (wall > 0.0).then(|| ns as f64 / wall)
        },
        steal,
        mean_output_tokens: (token_outputs > 0).then(|| tokens_out as f64 / token_outputs as f64),
        extra: serde_json::Map::new(),
    };
    Ok((result, latencies))
}

/// `path`'s text, at most `cap` bytes.
pub(crate) fn read_capped(path: &Path, cap: u64) -> Result<String, String> {
    let f = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    f.take(cap + 1).read_to_end(&mut bytes).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > cap {
        return Err(format!("{} is larger than {} MiB", path.display(), cap >> 20));
    }
    String::from_utf8(bytes).map_err(|e| format!("{} is not UTF-8: {e}", path.display()))
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

    #[test]
    fn requests_per_run_uses_the_count_or_the_duration() {
        assert_eq!(requests_per_run(Some(7), 2.0, 100.0).unwrap(), 7);
        assert_eq!(requests_per_run(None, 2.0, 100.5).unwrap(), 201);
        assert_eq!(requests_per_run(None, 0.001, 1.0).unwrap(), 1);
        assert!(requests_per_run(None, 1e9, 1e9).is_err());
    }
}
