//! The PyTorch peer of `serve bench lstm|seq2seq|treelstm` (issue 19; ARCHITECTURE.md §8.3): the
//! server a user would deploy instead of libserve, run in the same bench at the same offered rates.
//!
//! The peer is `scripts/torch_lstm_server.py`, embedded in this binary, written to a temporary
//! directory with the requests and run as `PYTHON SCRIPT ARGS`: PyTorch eager behind a dynamic
//! batcher. It screens a grid of configurations (batching mode × max batch × max delay), picks the
//! best and sweeps [`PEER_FRACTIONS`] of that configuration's peak. It runs *before* libserve's
//! policies, with libserve's compute threads, seed, closed-loop window, `--capacity-s` and
//! `--duration-s` (or `--requests`); libserve's policies then run at its offered rates too, so
//! every policy and the peer have results at the same rates, and the bench prints the peer's rows
//! in its own table and the ratios against it.
//!
//! * `lstm`: `nn.Embedding` + `nn.LSTM` with libserve's exact request lengths and model sizes
//!   (random weights and tokens of its own).
//! * `seq2seq`, `treelstm`: the same network on the same requests. The bench's model is saved
//!   ([`Network::save`]) into the temporary directory (or, with `--model-dir`, that directory is
//!   passed), its exact requests go in a JSON file, and `scripts/torch_rnn_models.py` (embedded
//!   too, written beside the script) loads both. The harness also writes its outputs of the first
//!   [`CHECK_REQUESTS`] distinct requests; the bench computes libserve's and prints how they
//!   compare ([`OutputCheck`]: seq2seq decodes equal and both mean decode lengths, treelstm root h
//!   within [`H_TOLERANCE`]).
//!
//! `--peer auto` (the default) runs it when `--python` imports torch and numpy, and otherwise says
//! why not in one `# PyTorch peer: SKIPPED (…)` line; a harness that fails is one
//! `# PyTorch peer: FAILED (…)` line. Either way the bench goes on with libserve's own results.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use serve::{BackendKind, Input, Network, Output};

use crate::bench::{RunResult, fmt_ratio, print_row, ratio, read_capped};
use crate::bench_peer_check::{OutputCheck, check_outputs};
use crate::bench_rnn::{RnnKind, Sizes};
use crate::compute_threads;

/// The peer harness (written out and run by `--python`).
const SCRIPT: &str = include_str!("../../../scripts/torch_lstm_server.py");
/// Its seq2seq and treelstm models, written beside it (it imports them).
const MODELS_SCRIPT: &str = include_str!("../../../scripts/torch_rnn_models.py");
/// Where it lives in the repository (for messages).
const SCRIPT_PATH: &str = "scripts/torch_lstm_server.py";
/// Fractions of the peer's best peak it offers, and libserve's policies with it.
const PEER_FRACTIONS: [f64; 3] = [0.25, 0.5, 0.75];
/// Largest harness report read.
const MAX_REPORT_BYTES: u64 = 16 << 20;
/// seq2seq, treelstm: distinct requests whose outputs the harness writes for the check against
/// libserve's (`--check-requests`; `--peer-args` may change it).
const CHECK_REQUESTS: usize = 1024;
/// Largest outputs file read (treelstm: the roots' h as JSON numbers).
const MAX_OUTPUTS_BYTES: u64 = 256 << 20;
/// Longest line of the harness's output passed on at once (a longer one comes in pieces).
const MAX_LINE_BYTES: u64 = 64 << 10;
/// Longest wait for `PYTHON -c "import torch, numpy"`.
const IMPORT_TIMEOUT: Duration = Duration::from_secs(120);
/// Issue 19's goals, per kind ([`Goals::of`]).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Goals {
    cellular_peak: f64,
    padding_peak: f64,
    /// Cellular's p50 and p90 against the peer's at the same offered rate: at most this.
    latency: f64,
    /// seq2seq and treelstm: the goal is parity, and the peak lines say so.
    parity: bool,
}

impl Goals {
    /// lstm: cellular's peak ≥ 1.3× the peer's, padding's ≥ the peer's, cellular's p50 and p90 ≤
    /// 0.5× the peer's; seq2seq and treelstm: at least at parity (peaks ≥ 1×, p50 and p90 ≤ 1×).
    fn of(kind: RnnKind) -> Goals {
        match kind {
            RnnKind::Lstm => Goals { cellular_peak: 1.3, padding_peak: 1.0, latency: 0.5, parity: false },
            RnnKind::Seq2Seq | RnnKind::TreeLstm => {
                Goals { cellular_peak: 1.0, padding_peak: 1.0, latency: 1.0, parity: true }
            }
        }
    }

    /// The goal of a peak line, e.g. `goal ≥ 1.30x` (lstm) or `goal: seq2seq and treelstm at least
    /// at parity (≥ 1.00x)`.
    fn peak_text(&self, goal: f64) -> String {
        if self.parity {
            format!("goal: seq2seq and treelstm at least at parity (≥ {goal:.2}x)")
        } else {
            format!("goal ≥ {goal:.2}x")
        }
    }
}
/// How to get a python with torch (CPU wheels).
const VENV_HINT: &str =
    "python3 -m venv v && v/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu numpy";

/// `--peer`: run the PyTorch peer when it can run, or never.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PeerMode {
    Auto,
    Off,
}

/// The options of the PyTorch peer (`serve bench lstm|seq2seq|treelstm` on the CPU).
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PeerArgs {
    /// On the CPU: first run the PyTorch peer (scripts/torch_lstm_server.py, a dynamic batcher
    /// over the same model in PyTorch eager; seq2seq and treelstm: the bench's weights) on the same
    /// requests, offer libserve's policies its rates too and print ratios against it. auto: when
    /// --python imports torch; off: never.
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

/// libserve's outputs of the first n distinct requests (for [`OutputCheck`]).
pub(crate) type LibserveOutputs<'a> = &'a dyn Fn(usize) -> Result<Vec<Output>, String>;

/// libserve's side of the comparison: what the peer is run with.
pub(crate) struct PeerPlan<'a> {
    pub(crate) kind: RnnKind,
    pub(crate) backend: BackendKind,
    /// The bench's network (seq2seq, treelstm: the peer gets its weights).
    pub(crate) net: &'a Network,
    /// A directory that holds exactly `net`'s weights (`--model-dir`); else they are saved for
    /// the peer.
    pub(crate) model_dir: Option<&'a Path>,
    /// Every distinct request, in order (lstm: the peer gets their lengths).
    pub(crate) inputs: &'a [Input],
    /// seq2seq, treelstm: libserve's outputs, compared with the peer's.
    pub(crate) outputs: LibserveOutputs<'a>,
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
    /// The bench's kind (sets the goals).
    kind: RnnKind,
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
    /// seq2seq, treelstm: its outputs against libserve's.
    check: Option<OutputCheck>,
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

/// The files the harness reads and writes.
struct HarnessFiles {
    /// lstm: the request lengths; seq2seq, treelstm: the requests ([`requests_json`]).
    requests: PathBuf,
    /// seq2seq, treelstm: the model directory whose weights it loads.
    model_dir: Option<PathBuf>,
    /// seq2seq, treelstm: where it writes its outputs for [`OutputCheck`].
    outputs: Option<PathBuf>,
    report: PathBuf,
}

/// The harness's arguments: libserve's workload and measurement, then `--peer-args`.
fn harness_args(plan: &PeerPlan<'_>, files: &HarnessFiles, extra: Option<&str>) -> Vec<String> {
    let threads = compute_threads(plan.threads);
    let s = plan.sizes;
    let path = |p: &Path| p.display().to_string();
    let mut args: Vec<String> = Vec::new();
    if plan.kind == RnnKind::Lstm {
        args.extend(["--lengths".into(), path(&files.requests)]);
    } else {
        args.extend(["--model".into(), plan.kind.name().into()]);
        if let Some(dir) = &files.model_dir {
            args.extend(["--model-dir".into(), path(dir)]);
        }
        args.extend(["--requests".into(), path(&files.requests)]);
    }
    let mut sizes = vec![("--vocab", s.vocab), ("--embed", s.embed), ("--hidden", s.hidden)];
    if plan.kind != RnnKind::TreeLstm {
        sizes.push(("--layers", s.layers));
    }
    if let Network::Seq2Seq(m) = plan.net {
        sizes.extend([("--bos", m.cfg.bos as usize), ("--eos", m.cfg.eos as usize)]);
        sizes.push(("--max-decode", m.cfg.max_decode));
    }
    sizes.extend([("--threads", threads), ("--window", plan.window)]);
    for (flag, v) in sizes {
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
    if let Some(out) = &files.outputs {
        args.extend(["--outputs".into(), path(out)]);
        args.extend(["--check-requests".into(), CHECK_REQUESTS.min(plan.inputs.len()).to_string()]);
    }
    args.extend(["--json".into(), path(&files.report)]);
    args.extend(extra.unwrap_or("").split_whitespace().map(str::to_string));
    args
}

/// The requests file of the harness: lstm, the lengths (`[n, …]`); seq2seq, the sources
/// (`{"sources": [[token, …], …]}`); treelstm, the trees (`{"trees": [{"tokens", "parents"}, …]}`,
/// token [`serve::model::NO_TOKEN`] = no input). All in libserve's order.
fn requests_json(kind: RnnKind, inputs: &[Input]) -> Result<String, String> {
    let mismatch =
        |i: usize, want: &str| format!("request {i} is not {want}, as `bench {}` sends", kind.name());
    let v = match kind {
        RnnKind::Lstm | RnnKind::Seq2Seq => {
            let sources = inputs
                .iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Input::Tokens(t) => Ok(t),
                    _ => Err(mismatch(i, "a token sequence")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            if kind == RnnKind::Lstm {
                json!(sources.iter().map(|t| t.len()).collect::<Vec<_>>())
            } else {
                json!({ "sources": sources })
            }
        }
        RnnKind::TreeLstm => {
            let trees = inputs
                .iter()
                .enumerate()
                .map(|(i, x)| match x {
                    Input::Tree { tokens, parents } => Ok(json!({"tokens": tokens, "parents": parents})),
                    _ => Err(mismatch(i, "a tree")),
                })
                .collect::<Result<Vec<_>, _>>()?;
            json!({ "trees": trees })
        }
    };
    serde_json::to_string(&v).map_err(|e| format!("cannot encode the requests: {e}"))
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
    let lstm = plan.kind == RnnKind::Lstm;
    let [script, models, report] =
        ["torch_lstm_server.py", "torch_rnn_models.py", "peer.json"].map(|f| tmp.0.join(f));
    let requests = tmp.0.join(if lstm { "lengths.json" } else { "requests.json" });
    let text = requests_json(plan.kind, plan.inputs)?;
    let mut files = vec![(&script, SCRIPT), (&requests, text.as_str())];
    if !lstm {
        files.push((&models, MODELS_SCRIPT));
    }
    for (path, text) in files {
        std::fs::write(path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    // seq2seq, treelstm: the bench's own weights, from --model-dir or saved here.
    let model_dir = match (lstm, plan.model_dir) {
        (true, _) => None,
        (false, Some(dir)) => Some(dir.to_path_buf()),
        (false, None) => {
            let dir = tmp.0.join("model");
            plan.net.save(&dir).map_err(|e| format!("cannot save the model for the peer: {e}"))?;
            Some(dir)
        }
    };
    let files =
        HarnessFiles { requests, model_dir, outputs: (!lstm).then(|| tmp.0.join("outputs.json")), report };
    let hargs = harness_args(plan, &files, args.peer_args.as_deref());
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
    let text = read_capped(&files.report, MAX_REPORT_BYTES)?;
    let mut report =
        parse_report(&text, plan.kind, plan.rates).map_err(|e| format!("{}: {e}", files.report.display()))?;
    if let Some(path) = &files.outputs {
        let text = read_capped(path, MAX_OUTPUTS_BYTES)?;
        let check = check_outputs(plan, &text).map_err(|e| format!("{}: {e}", path.display()))?;
        println!("# PyTorch peer check: {}", check.line());
        report.check = Some(check);
    }
    Ok(report)
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
        engine_busy: None,
        steal: None,
        mean_output_tokens: None,
        extra,
    })
}

/// Read the harness's JSON report of a `kind` model (its `model.kind`, when given, must be that);
/// `given_rates` are the `--rates` it was passed.
pub(crate) fn parse_report(text: &str, kind: RnnKind, given_rates: &[f64]) -> Result<PeerReport, String> {
    let raw: Value = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
    if let Some(k) = raw.get("model").and_then(|m| m.get("kind"))
        && k.as_str() != Some(kind.name())
    {
        return Err(format!(
            "the report is of a {k} model, not of `bench {}`'s {}",
            kind.name(),
            kind.name()
        ));
    }
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
    Ok(PeerReport { kind, raw, best, highest, rows, given_rates: given_rates.to_vec(), check: None })
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
        let goals = Goals::of(p.kind);
        let (hi_label, hi_peak) = &p.highest;
        let peak_line = |name: &str, side: Side<'_>, goal: f64| -> Value {
            let Some((_, peak)) = side else { return Value::Null };
            let r = peak.and_then(|x| ratio(x, *hi_peak));
            let met = verdict(r, |x| x >= goal);
            println!(
                "# ratio {name}/torch-best peak throughput: {} ({}: {met}) [torch's highest peak: {hi_label} \
                 {hi_peak:.1} rps]",
                fmt_ratio(r),
                goals.peak_text(goal)
            );
            json!({"ratio": r, "goal": goal, "met": r.map(|x| x >= goal)})
        };
        if let Some(c) = &p.check {
            println!("# PyTorch peer check: {}", c.line());
        }
        let cellular_peak = peak_line("cellular", cellular, goals.cellular_peak);
        let padding_peak = peak_line("padding", padding, goals.padding_peak);
        let mut at_rates = Vec::new();
        if let Some((c_label, _)) = cellular {
            for (rps, f) in p.fraction_rates() {
                let find = |policy: &str, rows: &[RunResult]| -> Option<RunResult> {
                    rows.iter().find(|r| r.policy == policy && same_rate(r.offered_rps, rps)).cloned()
                };
                let (Some(c), Some(t)) = (find(c_label, results), find(&p.best.0, &p.rows)) else { continue };
                let (r50, r90) = (ratio(c.p50_ms, t.p50_ms), ratio(c.p90_ms, t.p90_ms));
                let worst = r50.zip(r90).map(|(a, b)| a.max(b));
                let goal = goals.latency;
                let met = verdict(worst, |x| x <= goal);
                println!(
                    "# ratio cellular/torch at {rps:.1} rps ({:.0}% of torch's peak): p50 {}, p90 {} (goal ≤ \
                     {goal:.2}x: {met}) [vs {}]",
                    f * 100.0,
                    fmt_ratio(r50),
                    fmt_ratio(r90),
                    p.best.0
                );
                at_rates.push(json!({
                    "offered_rps": rps, "fraction_of_torch_peak": f, "policy": c.policy, "baseline": t.policy,
                    "throughput_ratio": ratio(c.throughput_rps, t.throughput_rps), "p50_ratio": r50,
                    "p90_ratio": r90, "p99_ratio": ratio(c.p99_ms, t.p99_ms), "goal": goal,
                    "met": worst.map(|x| x <= goal),
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
                    if let Some(c) = &p.check {
                        obj.insert("output_check".into(), c.to_json());
                    }
                }
                v
            }
        }
    }
}

#[cfg(test)]
mod tests;
