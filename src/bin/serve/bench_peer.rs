//! The PyTorch peer of `serve bench lstm` (issue 19; ARCHITECTURE.md §8.3): the server a user
//! would deploy instead of libserve, run in the same bench at the same offered rates.
//!
//! The peer is `scripts/torch_lstm_server.py`, embedded in this binary, written to a temporary
//! directory with the request lengths and run as `PYTHON SCRIPT ARGS`: PyTorch eager
//! (`nn.Embedding` + `nn.LSTM`) behind a dynamic batcher. It screens a grid of configurations
//! (pack / pad / bucket × max batch × max delay), picks the best and sweeps [`PEER_FRACTIONS`]
//! of that configuration's peak. It runs *before* libserve's
//! policies, with libserve's exact request lengths, model sizes, compute threads, seed, closed-loop
//! window, `--capacity-s` and `--duration-s` (or `--requests`); libserve's policies then run at
//! its offered rates too, so every policy and the peer have results at the same rates, and the
//! bench prints the peer's rows in its own table and the ratios against it.
//!
//! `--peer auto` (the default) runs it when `--python` imports torch and numpy, and otherwise says
//! why not in one `# PyTorch peer: SKIPPED (…)` line; a harness that fails is one
//! `# PyTorch peer: FAILED (…)` line. Either way the bench goes on with libserve's own results.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use serve::BackendKind;

use crate::bench::{RunResult, fmt_ratio, print_row, ratio};
use crate::bench_rnn::{RnnKind, Sizes};
use crate::compute_threads;

/// The peer harness (written out and run by `--python`).
const SCRIPT: &str = include_str!("../../../scripts/torch_lstm_server.py");
/// Where it lives in the repository (for messages).
const SCRIPT_PATH: &str = "scripts/torch_lstm_server.py";
/// Fractions of the peer's best peak it offers, and libserve's policies with it.
const PEER_FRACTIONS: [f64; 3] = [0.25, 0.5, 0.75];
/// Largest harness report read.
const MAX_REPORT_BYTES: u64 = 16 << 20;
/// Longest line of the harness's output passed on at once (a longer one comes in pieces).
const MAX_LINE_BYTES: u64 = 64 << 10;
/// Longest wait for `PYTHON -c "import torch, numpy"`.
const IMPORT_TIMEOUT: Duration = Duration::from_secs(120);
/// Issue 19's goals: cellular's peak ≥ 1.3× the peer's, padding's ≥ the peer's, cellular's p50
/// and p90 ≤ 0.5× the peer's at the same offered rate.
const CELLULAR_PEAK_GOAL: f64 = 1.3;
const PADDING_PEAK_GOAL: f64 = 1.0;
const LATENCY_GOAL: f64 = 0.5;
/// How to get a python with torch (CPU wheels).
const VENV_HINT: &str =
    "python3 -m venv v && v/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu numpy";

/// `--peer`: run the PyTorch peer when it can run, or never.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PeerMode {
    Auto,
    Off,
}

/// The options of the PyTorch peer (`serve bench lstm|seq2seq|treelstm`; only lstm on the CPU has
/// one).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PeerArgs {
    /// `bench lstm` on the CPU: first run the PyTorch peer (scripts/torch_lstm_server.py, a dynamic
    /// batcher over torch.nn.LSTM) on the same requests, offer libserve's policies its rates too
    /// and print ratios against it. auto: when --python imports torch; off: never.
    #[arg(long = "peer", value_enum, default_value_t = PeerMode::Auto)]
    pub(crate) mode: PeerMode,
    /// Python interpreter with torch and numpy for the peer (default: $SERVE_TORCH_PYTHON, else
    /// python3).
    #[arg(long)]
    pub(crate) python: Option<PathBuf>,
    /// More arguments for the peer harness, split at whitespace and passed after the bench's own
    /// (a later one wins), e.g. "--max-batch 64,256 --max-delay-ms 2,10 --screen-s 1".
    #[arg(long, allow_hyphen_values = true)]
    pub(crate) peer_args: Option<String>,
}

impl PeerArgs {
    /// `--python`, else `$SERVE_TORCH_PYTHON`, else `python3`.
    fn python(&self) -> PathBuf {
        self.python
            .clone()
            .or_else(|| std::env::var_os("SERVE_TORCH_PYTHON").filter(|v| !v.is_empty()).map(PathBuf::from))
            .unwrap_or_else(|| PathBuf::from("python3"))
    }
}

/// libserve's side of the comparison: what the peer is run with.
pub(crate) struct PeerPlan<'a> {
    pub(crate) kind: RnnKind,
    pub(crate) backend: BackendKind,
    /// The length of every distinct request, in order.
    pub(crate) lengths: Vec<usize>,
    pub(crate) sizes: Sizes,
    /// libserve's compute threads (0 = one per core).
    pub(crate) threads: usize,
    pub(crate) seed: u64,
    /// The closed-loop window of libserve's peaks.
    pub(crate) window: usize,
    pub(crate) capacity_s: f64,
    pub(crate) duration_s: f64,
    pub(crate) requests: Option<usize>,
    /// `--rate`: offered to the peer as well.
    pub(crate) rates: &'a [f64],
}

/// The outcome of the peer.
pub(crate) enum Peer {
    /// `--peer off`.
    Off,
    /// Not run: `status` is `unavailable`, `skipped` or `failed`.
    NotRun {
        status: &'static str,
        reason: String,
    },
    Ran(Box<PeerReport>),
}

/// The harness's report, read.
#[derive(Debug)]
pub(crate) struct PeerReport {
    /// Its JSON as written.
    raw: Value,
    /// The configuration it chose (its latency comparisons are against this one) and its peak.
    best: (String, f64),
    /// The highest peak of any configuration (the peak comparisons are against this one).
    highest: (String, f64),
    /// Its open-loop results in the table's form.
    rows: Vec<RunResult>,
    /// The rates it was given (libserve's `--rate`), as opposed to fractions of its own peak.
    given_rates: Vec<f64>,
}

/// Run the peer as `args` say, printing its progress; never fails the bench.
pub(crate) fn run(args: &PeerArgs, plan: &PeerPlan<'_>) -> Peer {
    let not_run = |status: &'static str, line: String, reason: String| {
        println!("# PyTorch peer: {line}");
        Peer::NotRun { status, reason }
    };
    if args.mode == PeerMode::Off {
        return Peer::Off;
    }
    if plan.kind != RnnKind::Lstm {
        let why = format!("not available for `bench {}` (only `bench lstm` has one)", plan.kind.name());
        return not_run("unavailable", why.clone(), why);
    }
    if plan.backend != BackendKind::Cpu {
        let why = format!("not available on the {} backend (the peer runs PyTorch on the CPU)", plan.backend);
        return not_run("unavailable", why.clone(), why);
    }
    let python = args.python();
    if let Err(why) = check_torch(&python) {
        let line = format!(
            "SKIPPED ({why}; pass --python a python with torch and numpy, e.g. a venv for {SCRIPT_PATH}: \
             {VENV_HINT})"
        );
        return not_run("skipped", line, why);
    }
    match run_harness(&python, args, plan) {
        Ok(report) => Peer::Ran(Box::new(report)),
        Err(why) => not_run("failed", format!("FAILED ({why}); libserve's results follow alone"), why),
    }
}

/// Ok when `python` imports torch and numpy; else why not.
fn check_torch(python: &Path) -> Result<(), String> {
    let child = Command::new(python)
        .args(["-c", "import torch, numpy"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let (status, err) = wait_capped(child, IMPORT_TIMEOUT)
        .map_err(|e| format!("{} -c \"import torch, numpy\": {e}", python.display()))?;
    if status.success() {
        return Ok(());
    }
    Err(format!("{} cannot import torch and numpy: {}", python.display(), last_line(&err)))
}

/// Wait for `child` at most `timeout` (then kill it); its exit status and the first 64 KiB of its
/// standard error.
fn wait_capped(mut child: Child, timeout: Duration) -> Result<(ExitStatus, String), String> {
    let reader = child.stderr.take().map(|e| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = e.take(MAX_LINE_BYTES).read_to_end(&mut bytes);
            String::from_utf8_lossy(&bytes).into_owned()
        })
    });
    let end = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(s)) => break s,
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!("no answer within {} s", timeout.as_secs()));
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    let err = reader.and_then(|r| r.join().ok()).unwrap_or_default();
    Ok((status, err))
}

/// The last non-empty line of `text`, trimmed.
fn last_line(text: &str) -> &str {
    text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim()
}

/// A directory of its own under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> Result<TempDir, String> {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("serve-peer-{}-{nanos}", std::process::id()));
        std::fs::create_dir(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn list(xs: &[f64]) -> String {
    xs.iter().map(f64::to_string).collect::<Vec<_>>().join(",")
}

/// The harness's arguments: libserve's workload and measurement, then `--peer-args`.
fn harness_args(plan: &PeerPlan<'_>, lengths: &Path, report: &Path, extra: Option<&str>) -> Vec<String> {
    let threads = compute_threads(plan.threads);
    let s = plan.sizes;
    let mut args: Vec<String> = vec!["--lengths".into(), lengths.display().to_string()];
    for (flag, v) in [
        ("--vocab", s.vocab),
        ("--embed", s.embed),
        ("--hidden", s.hidden),
        ("--layers", s.layers),
        ("--threads", threads),
        ("--window", plan.window),
    ] {
        args.extend([flag.to_string(), v.to_string()]);
    }
    args.extend(["--seed".into(), plan.seed.to_string()]);
    args.extend(["--fractions".into(), list(&PEER_FRACTIONS)]);
    args.extend(["--capacity-s".into(), plan.capacity_s.to_string()]);
    // Requests per rate as libserve counts them: --requests, else rate × --duration-s.
    let (min_requests, duration) = match plan.requests {
        Some(n) => (n, 0.0),
        None => (1, plan.duration_s),
    };
    args.extend(["--min-requests".into(), min_requests.to_string()]);
    args.extend(["--duration-s".into(), duration.to_string()]);
    if !plan.rates.is_empty() {
        args.extend(["--rates".into(), list(plan.rates)]);
    }
    args.extend(["--json".into(), report.display().to_string()]);
    args.extend(extra.unwrap_or("").split_whitespace().map(str::to_string));
    args
}

/// Calls `f` with each line of `r` (lossy UTF-8, no line end); a line longer than
/// [`MAX_LINE_BYTES`] comes in pieces.
fn for_each_line(r: impl Read, mut f: impl FnMut(&str)) {
    let mut r = BufReader::new(r);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut r).take(MAX_LINE_BYTES).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {
                let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
                f(&String::from_utf8_lossy(line.strip_suffix(b"\r").unwrap_or(line)));
            }
        }
    }
}

/// Run the harness, passing its output on as `# peer: …` lines, and read its report.
fn run_harness(python: &Path, args: &PeerArgs, plan: &PeerPlan<'_>) -> Result<PeerReport, String> {
    let tmp = TempDir::new()?;
    let [script, lengths, report] =
        ["torch_lstm_server.py", "lengths.json", "peer.json"].map(|f| tmp.0.join(f));
    let text = serde_json::to_string(&plan.lengths).map_err(|e| format!("cannot encode the lengths: {e}"))?;
    for (path, text) in [(&script, SCRIPT), (&lengths, &text)] {
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    let hargs = harness_args(plan, &lengths, &report, args.peer_args.as_deref());
    println!("# PyTorch peer: {} {SCRIPT_PATH} {} (run first)", python.display(), hargs.join(" "));
    let mut child = Command::new(python)
        .arg(&script)
        .args(&hargs)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", python.display()))?;
    let (out, err) = (child.stdout.take(), child.stderr.take());
    let last_err = std::thread::scope(|s| {
        let errs = s.spawn(move || {
            let mut last = String::new();
            if let Some(e) = err {
                for_each_line(e, |l| {
                    eprintln!("peer: {l}");
                    if !l.trim().is_empty() {
                        last = l.trim().to_string();
                    }
                });
            }
            last
        });
        if let Some(o) = out {
            for_each_line(o, |l| println!("# peer: {}", l.strip_prefix("# ").unwrap_or(l)));
        }
        errs.join().unwrap_or_default()
    });
    let status = child.wait().map_err(|e| format!("{}: {e}", python.display()))?;
    if !status.success() {
        let why = if last_err.is_empty() { "no message" } else { &last_err };
        return Err(format!("{SCRIPT_PATH} exited with {status}: {why}"));
    }
    let text = read_capped(&report)?;
    parse_report(&text, plan.rates).map_err(|e| format!("{}: {e}", report.display()))
}

/// `path`'s text, at most [`MAX_REPORT_BYTES`].
fn read_capped(path: &Path) -> Result<String, String> {
    let f = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let mut bytes = Vec::new();
    f.take(MAX_REPORT_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    if bytes.len() as u64 > MAX_REPORT_BYTES {
        return Err(format!("{} is larger than {} MiB", path.display(), MAX_REPORT_BYTES >> 20));
    }
    String::from_utf8(bytes).map_err(|e| format!("{} is not UTF-8: {e}", path.display()))
}

/// A number of `v`: `Ok(None)` when absent or null.
fn number(v: &Value, key: &str) -> Result<Option<f64>, String> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x.as_f64().map(Some).ok_or_else(|| format!("`{key}` is not a number: {x}")),
    }
}

fn required(v: &Value, key: &str) -> Result<f64, String> {
    number(v, key)?.ok_or_else(|| format!("`{key}` is missing"))
}

fn label(v: &Value, key: &str) -> Result<String, String> {
    v.get(key).and_then(Value::as_str).map(str::to_string).ok_or_else(|| format!("`{key}` is not a string"))
}

/// One open-loop result of the harness as a row of the table (no percentile = NaN).
fn parse_row(v: &Value) -> Result<RunResult, String> {
    let count = |key: &str| v.get(key).and_then(Value::as_u64).unwrap_or(0);
    let mut error_codes = BTreeMap::new();
    if let Some(codes) = v.get("error_codes").and_then(Value::as_object) {
        for (code, n) in codes {
            // The harness's only code is CANCELLED (the backlog left at the end).
            let name = if code == "CANCELLED" { "CANCELLED" } else { "OTHER" };
            *error_codes.entry(name).or_default() += n.as_u64().unwrap_or(0);
        }
    }
    let mut extra = serde_json::Map::new();
    for key in ["peak_rps", "fraction_of_peak", "fraction_of_best_peak"] {
        if let Some(x) = number(v, key)? {
            extra.insert(key.into(), json!(x));
        }
    }
    let pct = |key: &str| number(v, key).map(|x| x.unwrap_or(f64::NAN));
    Ok(RunResult {
        policy: label(v, "policy")?,
        offered_rps: required(v, "offered_rps")?,
        throughput_rps: required(v, "throughput_rps")?,
        p50_ms: pct("p50_ms")?,
        p90_ms: pct("p90_ms")?,
        p99_ms: pct("p99_ms")?,
        mean_batch: number(v, "mean_batch")?.unwrap_or(0.0),
        mean_task_us: None,
        completed: count("completed"),
        errors: count("errors"),
        goodput_rps: None,
        error_codes,
        sender_lag_p99_ms: 0.0,
        mean_output_tokens: None,
        extra,
    })
}

/// Read the harness's JSON report; `given_rates` are the `--rates` it was passed.
pub(crate) fn parse_report(text: &str, given_rates: &[f64]) -> Result<PeerReport, String> {
    let raw: Value = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
    let best_v = raw.get("best").ok_or("no `best` object")?;
    let best = (label(best_v, "policy")?, required(best_v, "peak_rps")?);
    let mut highest = best.clone();
    for p in raw.get("peaks").and_then(Value::as_array).ok_or("no `peaks` list")? {
        let peak = required(p, "peak_rps").map_err(|e| format!("peaks: {e}"))?;
        if peak > highest.1 {
            highest = (label(p, "policy")?, peak);
        }
    }
    let rows = raw
        .get("results")
        .and_then(Value::as_array)
        .ok_or("no `results` list")?
        .iter()
        .enumerate()
        .map(|(i, r)| parse_row(r).map_err(|e| format!("results[{i}]: {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(PeerReport { raw, best, highest, rows, given_rates: given_rates.to_vec() })
}

/// Two offered rates are the same run's (the bench rounds fractions to whole rps, the harness
/// given rates to 0.1).
fn same_rate(a: f64, b: f64) -> bool {
    (a - b).abs() < 0.5
}

impl PeerReport {
    /// The rates the peer offered as fractions of its best peak: (rps, fraction), ascending. A
    /// rate is one when it is [`PEER_FRACTIONS`] of the peak (rounded to whole rps, as the harness
    /// does), or when it was not given (`--peer-args` may pass other `--fractions`).
    fn fraction_rates(&self) -> Vec<(f64, f64)> {
        let is_fraction = |rps: f64| {
            PEER_FRACTIONS.iter().any(|f| same_rate((f * self.best.1).round(), rps))
                || !self.given_rates.iter().any(|&g| (g - rps).abs() <= 0.05 + 1e-6)
        };
        let mut out: Vec<(f64, f64)> = self
            .rows
            .iter()
            .filter(|r| r.policy == self.best.0 && is_fraction(r.offered_rps))
            .map(|r| (r.offered_rps, r.offered_rps / self.best.1))
            .collect();
        out.sort_by(|x, y| x.0.total_cmp(&y.0));
        out.dedup_by(|x, y| x.0 == y.0);
        out
    }
}

/// `met`, `NOT met` or `n/a` for ratio `r` against `goal`.
fn verdict(r: Option<f64>, met: impl Fn(f64) -> bool) -> &'static str {
    match r {
        Some(x) if met(x) => "met",
        Some(_) => "NOT met",
        None => "n/a",
    }
}

/// A libserve policy in the comparison: its label and peak (when measured).
pub(crate) type Side<'a> = Option<(&'a str, Option<f64>)>;

impl Peer {
    fn report(&self) -> Option<&PeerReport> {
        if let Peer::Ran(r) = self { Some(r) } else { None }
    }

    /// The rates libserve's policies must run at too: (rps, fraction of the peer's best peak).
    pub(crate) fn offered_rates(&self) -> Vec<(f64, f64)> {
        self.report().map(PeerReport::fraction_rates).unwrap_or_default()
    }

    /// The peer's rows at offered rate `rps`.
    pub(crate) fn rows_at(&self, rps: f64) -> impl Iterator<Item = &RunResult> {
        self.report().into_iter().flat_map(|p| &p.rows).filter(move |r| same_rate(r.offered_rps, rps))
    }

    /// Print the peer's rows at none of `rates` (after libserve's table).
    pub(crate) fn print_rows_apart(&self, rates: &[f64]) {
        for r in self.report().into_iter().flat_map(|p| &p.rows) {
            if !rates.iter().any(|&x| same_rate(r.offered_rps, x)) {
                print_row(r);
            }
        }
    }

    /// The chosen configuration's rows (for the plot).
    pub(crate) fn best_rows(&self) -> Vec<RunResult> {
        self.report()
            .map_or_else(Vec::new, |p| p.rows.iter().filter(|r| r.policy == p.best.0).cloned().collect())
    }

    /// Print the ratios against the peer and return them for the report (null when it did not run).
    pub(crate) fn summarize(&self, cellular: Side<'_>, padding: Side<'_>, results: &[RunResult]) -> Value {
        let Some(p) = self.report() else { return Value::Null };
        let (hi_label, hi_peak) = &p.highest;
        let peak_line = |name: &str, side: Side<'_>, goal: f64| -> Value {
            let Some((_, peak)) = side else { return Value::Null };
            let r = peak.and_then(|x| ratio(x, *hi_peak));
            let met = verdict(r, |x| x >= goal);
            println!(
                "# ratio {name}/torch-best peak throughput: {} (goal ≥ {goal:.2}x: {met}) [torch's highest peak: \
                 {hi_label} {hi_peak:.1} rps]",
                fmt_ratio(r)
            );
            json!({"ratio": r, "goal": goal, "met": r.map(|x| x >= goal)})
        };
        let cellular_peak = peak_line("cellular", cellular, CELLULAR_PEAK_GOAL);
        let padding_peak = peak_line("padding", padding, PADDING_PEAK_GOAL);
        let mut at_rates = Vec::new();
        if let Some((c_label, _)) = cellular {
            for (rps, f) in p.fraction_rates() {
                let find = |policy: &str, rows: &[RunResult]| -> Option<RunResult> {
                    rows.iter().find(|r| r.policy == policy && same_rate(r.offered_rps, rps)).cloned()
                };
                let (Some(c), Some(t)) = (find(c_label, results), find(&p.best.0, &p.rows)) else { continue };
                let (r50, r90) = (ratio(c.p50_ms, t.p50_ms), ratio(c.p90_ms, t.p90_ms));
                let worst = r50.zip(r90).map(|(a, b)| a.max(b));
                let met = verdict(worst, |x| x <= LATENCY_GOAL);
                println!(
                    "# ratio cellular/torch at {rps:.1} rps ({:.0}% of torch's peak): p50 {}, p90 {} (goal ≤ \
                     {LATENCY_GOAL:.2}x: {met}) [vs {}]",
                    f * 100.0,
                    fmt_ratio(r50),
                    fmt_ratio(r90),
                    p.best.0
                );
                at_rates.push(json!({
                    "offered_rps": rps, "fraction_of_torch_peak": f, "policy": c.policy, "baseline": t.policy,
                    "throughput_ratio": ratio(c.throughput_rps, t.throughput_rps), "p50_ratio": r50,
                    "p90_ratio": r90, "p99_ratio": ratio(c.p99_ms, t.p99_ms), "goal": LATENCY_GOAL,
                    "met": worst.map(|x| x <= LATENCY_GOAL),
                }));
            }
        }
        json!({
            "torch_best": {"policy": p.best.0, "peak_rps": p.best.1},
            "torch_highest_peak": {"policy": hi_label, "peak_rps": hi_peak},
            "cellular_peak": cellular_peak,
            "padding_peak": padding_peak,
            "at_rates": at_rates,
        })
    }

    /// The report's `peer` object: the harness's JSON and the ratios, or why it did not run.
    pub(crate) fn to_json(&self, ratios: Value) -> Value {
        match self {
            Peer::Off => json!({"status": "off"}),
            Peer::NotRun { status, reason } => json!({"status": status, "reason": reason}),
            Peer::Ran(p) => {
                let mut v = p.raw.clone();
                if let Some(obj) = v.as_object_mut() {
                    obj.insert("status".into(), json!("ran"));
                    obj.insert("ratios".into(), ratios);
                }
                v
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A harness report cut down to two configurations and two rates (one given, one a fraction).
    const FIXTURE: &str = r#"{
      "tool": "torch_lstm_server.py", "workload": "poisson/wmt", "backend": "torch-cpu",
      "peaks": [
        {"policy": "torch-bucket(b=256,d=10ms,w=10)", "peak_rps": 1000.0, "window": 2048, "mean_batch": 200.0},
        {"policy": "torch-pack(b=256,d=2ms)", "peak_rps": 1100.0, "window": 2048, "mean_batch": 250.0}
      ],
      "best": {"policy": "torch-bucket(b=256,d=10ms,w=10)", "peak_rps": 1000.0, "best_peak_rps": 1100.0,
               "rule": "lowest p90", "screen_rps": 550, "peak_tolerance": 0.1},
      "results": [
        {"policy": "torch-bucket(b=256,d=10ms,w=10)", "offered_rps": 250.0, "throughput_rps": 249.0,
         "p50_ms": 12.5, "p90_ms": 20.0, "p99_ms": 31.0, "mean_batch": 3.5, "completed": 500, "errors": 0,
         "error_codes": {}, "peak_rps": 1000.0, "fraction_of_peak": 0.25, "fraction_of_best_peak": 0.25},
        {"policy": "torch-pack(b=256,d=2ms)", "offered_rps": 250.0, "throughput_rps": 248.0,
         "p50_ms": 3.0, "p90_ms": 5.0, "p99_ms": 8.0, "mean_batch": 1.2, "completed": 500, "errors": 0,
         "error_codes": {}},
        {"policy": "torch-bucket(b=256,d=10ms,w=10)", "offered_rps": 300.0, "throughput_rps": 120.0,
         "p50_ms": null, "p90_ms": null, "p99_ms": null, "mean_batch": 0.0, "completed": 0, "errors": 600,
         "error_codes": {"CANCELLED": 600}}
      ]
    }"#;

    #[test]
    fn a_harness_report_parses_into_rows() {
        let p = parse_report(FIXTURE, &[300.0]).unwrap();
        assert_eq!(p.best, ("torch-bucket(b=256,d=10ms,w=10)".to_string(), 1000.0));
        assert_eq!(p.highest, ("torch-pack(b=256,d=2ms)".to_string(), 1100.0));
        assert_eq!(p.rows.len(), 3);
        let r = &p.rows[0];
        assert_eq!(
            (r.offered_rps, r.throughput_rps, r.p50_ms, r.p90_ms, r.p99_ms),
            (250.0, 249.0, 12.5, 20.0, 31.0)
        );
        assert_eq!((r.mean_batch, r.completed, r.errors), (3.5, 500, 0));
        assert_eq!(r.extra["fraction_of_best_peak"], json!(0.25));
        let cancelled = &p.rows[2];
        assert!(cancelled.p50_ms.is_nan() && cancelled.p99_ms.is_nan(), "no percentiles = NaN");
        assert_eq!(cancelled.error_codes.get("CANCELLED"), Some(&600));
        // 300 rps was given (libserve's --rate), 250 is 25% of the chosen configuration's peak.
        assert_eq!(p.fraction_rates(), vec![(250.0, 0.25)]);
        // A given rate that is also a fraction of the peak is one.
        let both = parse_report(FIXTURE, &[250.0, 300.0]).unwrap();
        assert_eq!(both.fraction_rates(), vec![(250.0, 0.25)]);
        // Rates not given are fractions (--peer-args may pass its own --fractions).
        let none_given = parse_report(FIXTURE, &[]).unwrap();
        assert_eq!(none_given.fraction_rates(), vec![(250.0, 0.25), (300.0, 0.3)]);
    }

    #[test]
    fn a_bad_report_is_an_error_not_a_panic() {
        for (text, want) in [
            ("{", "malformed JSON"),
            ("[]", "best"),
            (r#"{"best": {"policy": "x", "peak_rps": 1}, "results": []}"#, "peaks"),
            (
                r#"{"best": {"policy": "x", "peak_rps": 1}, "peaks": [], "results": [{"policy": 3}]}"#,
                "results[0]",
            ),
            (
                r#"{"best": {"policy": "x", "peak_rps": 1}, "peaks": [],
                    "results": [{"policy": "x", "offered_rps": 1, "throughput_rps": "fast"}]}"#,
                "throughput_rps",
            ),
        ] {
            let e = parse_report(text, &[]).unwrap_err();
            assert!(e.contains(want), "`{text}`: `{e}` should mention `{want}`");
        }
    }

    fn row(policy: &str, rps: f64, p50: f64, p90: f64) -> RunResult {
        let mut r = parse_row(&json!({"policy": policy, "offered_rps": rps, "throughput_rps": rps})).unwrap();
        (r.p50_ms, r.p90_ms, r.p99_ms) = (p50, p90, p90);
        r
    }

    #[test]
    fn ratios_are_against_the_highest_peak_and_the_chosen_configuration() {
        let peer = Peer::Ran(Box::new(parse_report(FIXTURE, &[300.0]).unwrap()));
        assert_eq!(peer.offered_rates(), vec![(250.0, 0.25)]);
        assert_eq!(peer.rows_at(250.2).count(), 2);
        let ours = [
            row("cellular(b=512,k=5)", 250.0, 5.0, 9.0),
            row("padding(b=64,bucket=10,k=5)", 250.0, 9.0, 30.0),
        ];
        let v = peer.summarize(
            Some(("cellular(b=512,k=5)", Some(1650.0))),
            Some(("padding", Some(990.0))),
            &ours,
        );
        assert_eq!(v["cellular_peak"]["ratio"], json!(1.5));
        assert_eq!(v["cellular_peak"]["met"], json!(true));
        assert_eq!(v["padding_peak"]["ratio"], json!(0.9));
        assert_eq!(v["padding_peak"]["met"], json!(false));
        let at = &v["at_rates"][0];
        assert_eq!((at["p50_ratio"].clone(), at["p90_ratio"].clone()), (json!(0.4), json!(0.45)));
        assert_eq!(at["baseline"], json!("torch-bucket(b=256,d=10ms,w=10)"));
        assert_eq!(at["met"], json!(true));
        let report = peer.to_json(v);
        assert_eq!(report["status"], json!("ran"));
        assert_eq!(report["tool"], json!("torch_lstm_server.py"));
        assert!(report["ratios"]["at_rates"].is_array());
        let skipped = Peer::NotRun { status: "skipped", reason: "no torch".into() };
        assert!(skipped.offered_rates().is_empty() && skipped.summarize(None, None, &[]).is_null());
        assert_eq!(skipped.to_json(Value::Null), json!({"status": "skipped", "reason": "no torch"}));
    }

    #[test]
    fn the_harness_gets_libserves_workload_then_the_users_arguments() {
        let plan = PeerPlan {
            kind: RnnKind::Lstm,
            backend: BackendKind::Cpu,
            lengths: vec![3, 5],
            sizes: Sizes { vocab: 64, embed: 16, hidden: 16, layers: 2 },
            threads: 2,
            seed: 7,
            window: 256,
            capacity_s: 1.5,
            duration_s: 2.0,
            requests: Some(40),
            rates: &[100.0, 250.5],
        };
        let args =
            harness_args(&plan, Path::new("/t/l.json"), Path::new("/t/p.json"), Some(" --screen-s 1  "));
        let line = args.join(" ");
        for want in [
            "--lengths /t/l.json --vocab 64 --embed 16 --hidden 16 --layers 2 --threads 2 --window 256",
            "--seed 7 --fractions 0.25,0.5,0.75 --capacity-s 1.5 --min-requests 40 --duration-s 0",
            "--rates 100,250.5 --json /t/p.json --screen-s 1",
        ] {
            assert!(line.contains(want), "`{line}` should contain `{want}`");
        }
        assert!(line.ends_with("--screen-s 1"), "--peer-args come last: {line}");
    }

    #[test]
    fn long_lines_come_in_pieces() {
        let text = format!("a\r\n{}\nb", "x".repeat(MAX_LINE_BYTES as usize + 3));
        let mut lines = Vec::new();
        for_each_line(text.as_bytes(), |l| lines.push(l.len()));
        assert_eq!(lines, [1, MAX_LINE_BYTES as usize, 3, 1]);
    }
}
