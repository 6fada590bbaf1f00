//! `serve`: the libserve command-line tool.
//!
//! * `serve info` — version, the backend `auto` picks, CPU features, CUDA driver / devices.
//! * `serve infer MODEL_DIR --input FILE.jsonl` — DESIGN §6: one request per line, one result line
//!   per request, in input order.
//! * `serve bench mlp …` — DESIGN §8: Poisson open-loop load against an mlp, batched and unbatched.
//! * `serve` / `serve demo` — the main job on the CPU default: a small mlp is written, loaded,
//!   queried with `infer`, then benchmarked briefly.

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, SyncSender, TryRecvError};
use std::time::{Duration, Instant};

use clap::builder::{RangedU64ValueParser, TypedValueParser};
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use serve::backend::{cpu, cuda};
use serve::model::Mlp;
use serve::{
    BackendChoice, BackendKind, Code, Completion, CompletionQueue, Error, Input, Model, ModelOptions,
    Network, Output, PolicyConfig, Runtime, SubmitOptions, TimeoutConfig,
};

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

#[derive(Parser, Debug)]
#[command(
    name = "serve",
    version,
    about = "libserve: batched deep-learning inference (CPU default, CUDA when present)",
    long_about = "libserve: batched deep-learning inference.\n\nWith no command, runs `serve demo`: \
                  the main job on the CPU default (write a small mlp, infer, benchmark briefly)."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Print the version, the backend `auto` selects, CPU features and CUDA availability.
    Info,
    /// Run one request per line of a JSON-lines file; print one result line per request, in order.
    Infer(InferArgs),
    /// Open-loop benchmarks (DESIGN §8).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// The main job on the CPU default: write a small mlp, run `infer` on it, benchmark it briefly.
    Demo,
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Poisson open-loop load against an mlp (a random one unless --model is given).
    Mlp(BenchMlpArgs),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    Auto,
    Cpu,
    Cuda,
}

impl From<BackendArg> for BackendChoice {
    fn from(b: BackendArg) -> BackendChoice {
        match b {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Cpu => BackendChoice::Cpu,
            BackendArg::Cuda => BackendChoice::Cuda,
        }
    }
}

impl fmt::Display for BackendArg {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendArg::Auto => "auto",
            BackendArg::Cpu => "cpu",
            BackendArg::Cuda => "cuda",
        })
    }
}

/// A `usize` option that must be at least 1.
fn positive() -> impl TypedValueParser<Value = usize> {
    RangedU64ValueParser::<usize>::new().range(1..)
}

/// A finite `f64` option that must be greater than 0.
fn positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 { Ok(v) } else { Err(format!("`{s}` must be a positive finite number")) }
}

#[derive(Args, Debug, Clone, Copy)]
struct RuntimeArgs {
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// CPU compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
}

#[derive(Args, Debug)]
struct InferArgs {
    /// Model directory (model.toml + weights.safetensors).
    model_dir: PathBuf,
    /// JSON-lines requests: `{"input":[…]}`, `{"tokens":[…]}` or `{"tokens":[…],"parents":[…]}`.
    /// `-` reads standard input.
    #[arg(long, short = 'i')]
    input: PathBuf,
    #[command(flatten)]
    rt: RuntimeArgs,
    /// Most requests in one batched task.
    #[arg(long, default_value_t = 32, value_parser = positive())]
    max_batch: usize,
    /// How long the oldest queued request may wait for a fuller batch (0 = no wait).
    #[arg(long, default_value_t = 0)]
    max_wait_us: u64,
    /// Admission bound: requests in flight at once (default: the runtime's, 4096). Submits
    /// refused BUSY wait for completions and are retried.
    #[arg(long, value_parser = positive())]
    max_inflight: Option<usize>,
}

#[derive(Args, Debug)]
struct BenchMlpArgs {
    /// Benchmark the mlp in this model directory instead of a random one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Layer widths of the random mlp, input first. Default: CPU scale 256,256,256,256 (hidden 256)
    /// on the CPU backend, GPU scale 256,1024,1024,256 (hidden 1024) on CUDA (DESIGN §8).
    #[arg(long, value_delimiter = ',', value_parser = positive(), conflicts_with = "model")]
    sizes: Option<Vec<usize>>,
    /// Offered rates in requests per second (several allowed: `--rate 500 1000` or `--rate
    /// 500,1000`). Default: 0.25, 0.5, 0.75 and 0.9 of the capacity measured in a closed loop.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Requests per offered rate (default: rate × --duration-s).
    #[arg(long, value_parser = positive())]
    requests: Option<usize>,
    /// Seconds of arrivals per offered rate, when --requests is not given.
    #[arg(long, default_value_t = 2.0, value_parser = positive_f64)]
    duration_s: f64,
    /// Most requests in one batched task (the policy `timeout(s, t)`).
    #[arg(long, default_value_t = 32, value_parser = positive())]
    max_batch: usize,
    /// Longest the oldest queued request waits for a fuller batch (0 = NO_Wait).
    #[arg(long, default_value_t = 0)]
    max_wait_us: u64,
    /// Workers (concurrent streams) of the policy.
    #[arg(long, default_value_t = 1, value_parser = positive())]
    workers: usize,
    #[command(flatten)]
    rt: RuntimeArgs,
    /// Seed of the random mlp, its inputs and the arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as one JSON object (DESIGN §8) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Latency target in ms: also report goodput (requests per second completed within it).
    #[arg(long, value_parser = positive_f64)]
    qos_ms: Option<f64>,
    /// Also run without batching (max batch 1) at the same offered rates and print the ratios
    /// batched / unbatched.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    compare_batch: bool,
    /// Seconds of closed-loop load used to measure capacity when no --rate is given.
    #[arg(long, default_value_t = 1.0, value_parser = positive_f64)]
    capacity_s: f64,
}

// ---------------------------------------------------------------------------------------------
// Errors and main
// ---------------------------------------------------------------------------------------------

/// A failure that ends the command with a non-zero exit status.
#[derive(Debug)]
struct Fatal(String);

impl From<Error> for Fatal {
    fn from(e: Error) -> Fatal {
        Fatal(e.to_string())
    }
}

fn fatal(msg: impl Into<String>) -> Fatal {
    Fatal(msg.into())
}

type CliResult<T> = Result<T, Fatal>;

fn stdout_err(e: io::Error) -> Fatal {
    fatal(format!("cannot write to standard output: {e}"))
}

fn main() -> ExitCode {
    // Die quietly on a closed stdout (`serve infer … | head`) like other command-line tools,
    // instead of failing every later write. Only the binary does this; the library installs no
    // signal handlers (DESIGN §4).
    #[cfg(unix)]
    // SAFETY: resetting SIGPIPE to its default disposition has no memory-safety preconditions; no
    // other thread exists yet.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    let result = match cli.command.unwrap_or(Command::Demo) {
        Command::Info => cmd_info(),
        Command::Infer(a) => cmd_infer(a),
        Command::Bench { what: BenchCommand::Mlp(a) } => cmd_bench_mlp(a),
        Command::Demo => cmd_demo(),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal(msg)) => {
            eprintln!("serve: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

fn build_runtime(rt: RuntimeArgs) -> CliResult<Runtime> {
    Runtime::builder()
        .backend(rt.backend.into())
        .cpu_threads(rt.threads)
        .build()
        .map_err(|e| fatal(format!("cannot start the runtime on backend `{}`: {e}", rt.backend)))
}

fn timeout_policy(max_batch: usize, max_wait_us: u64, workers: usize) -> TimeoutConfig {
    TimeoutConfig { max_batch, max_wait: Duration::from_micros(max_wait_us), workers, pad_to_max: false }
}

// ---------------------------------------------------------------------------------------------
// serve info
// ---------------------------------------------------------------------------------------------

fn cmd_info() -> CliResult<()> {
    println!("libserve {}", serve::VERSION);
    let auto = Runtime::builder().backend(BackendChoice::Auto).build();
    match &auto {
        Ok(rt) => println!("backend (auto): {} — {}", rt.backend_kind(), rt.backend_description()),
        Err(e) => println!("backend (auto): unavailable — {e}"),
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let feats: Vec<String> = cpu::cpu_features()
        .into_iter()
        .map(|(name, on)| if on { name.to_string() } else { format!("-{name}") })
        .collect();
    println!(
        "cpu: {cores} core(s), features: {}",
        if feats.is_empty() { "(none probed)".into() } else { feats.join(" ") }
    );
    let probe = cuda::probe();
    let driver = match (probe.driver_loaded, probe.driver_version) {
        (false, _) => "not found".to_string(),
        (true, Some(v)) => format!("loaded, CUDA {}.{}", v / 1000, (v % 1000) / 10),
        (true, None) => "loaded, version unknown".to_string(),
    };
    println!("cuda driver: {driver}");
    println!("cuda devices: {} ({})", probe.devices, probe.summary());
    if probe.devices > 0 {
        match Runtime::builder().backend(BackendChoice::Cuda).build() {
            Ok(rt) => println!("backend (cuda): {}", rt.backend_description()),
            Err(e) => println!("backend (cuda): unavailable — {e}"),
        }
    }
    auto.map(drop).map_err(|e| fatal(format!("the auto backend cannot start: {e}")))
}

// ---------------------------------------------------------------------------------------------
// serve infer
// ---------------------------------------------------------------------------------------------

fn cmd_infer(a: InferArgs) -> CliResult<()> {
    let reader = open_input(&a.input)?;
    let rt = build_runtime(a.rt)?;
    let opts = ModelOptions {
        policy: PolicyConfig::Timeout(timeout_policy(a.max_batch, a.max_wait_us, 1)),
        admission_bound: a.max_inflight,
        name: None,
    };
    let model = rt
        .load_model(&a.model_dir, opts)
        .map_err(|e| fatal(format!("cannot load model {}: {e}", a.model_dir.display())))?;
    let stdout = io::stdout();
    let mut out = BufWriter::new(stdout.lock());
    let summary = infer_stream(&model, reader, &mut out);
    out.flush().map_err(stdout_err)?;
    let summary = summary?;
    if io::stderr().is_terminal() {
        eprintln!("serve infer: {} request(s), {} error(s)", summary.lines, summary.errors);
    }
    Ok(())
}

/// Open `--input`: a file, or standard input for `-`.
fn open_input(path: &Path) -> CliResult<Box<dyn BufRead + Send>> {
    if path.as_os_str() == "-" {
        return Ok(Box::new(BufReader::new(io::stdin())));
    }
    let cant = |e: &dyn fmt::Display| fatal(format!("cannot read input {}: {e}", path.display()));
    let meta = std::fs::metadata(path).map_err(|e| cant(&e))?;
    if meta.is_dir() {
        return Err(cant(&"is a directory"));
    }
    let f = File::open(path).map_err(|e| cant(&e))?;
    Ok(Box::new(BufReader::with_capacity(1 << 16, f)))
}

/// What [`infer_stream`] did.
#[derive(Debug, Default, Clone, Copy)]
struct InferSummary {
    lines: usize,
    errors: usize,
}

enum LineMsg {
    Line(Vec<u8>),
    Failed(io::Error),
}

/// Reads lines (without their `\n` / `\r\n`) and hands them over until end of input, a read
/// error, or the receiver hanging up.
fn read_lines(mut r: Box<dyn BufRead + Send>, tx: SyncSender<LineMsg>) {
    loop {
        let mut buf = Vec::new();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) => return,
            Ok(_) => {
                if buf.last() == Some(&b'\n') {
                    buf.pop();
                    if buf.last() == Some(&b'\r') {
                        buf.pop();
                    }
                }
                if tx.send(LineMsg::Line(buf)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(LineMsg::Failed(e));
                return;
            }
        }
    }
}

/// Output lines by input index, written out as soon as every earlier line is known.
struct Ordered<'a> {
    out: &'a mut dyn Write,
    /// Index of `pending[0]`.
    next: usize,
    pending: VecDeque<Option<String>>,
    errors: usize,
}

impl Ordered<'_> {
    fn set(&mut self, index: usize, line: String, is_error: bool) {
        let k = index - self.next;
        if self.pending.len() <= k {
            self.pending.resize(k + 1, None);
        }
        self.pending[k] = Some(line);
        self.errors += usize::from(is_error);
    }

    fn write_ready(&mut self) -> CliResult<()> {
        while let Some(Some(_)) = self.pending.front() {
            if let Some(Some(line)) = self.pending.pop_front() {
                writeln!(self.out, "{line}").map_err(stdout_err)?;
            }
            self.next += 1;
        }
        Ok(())
    }
}

fn error_line(code: Code, message: &str) -> String {
    json!({"error": {"code": code.name(), "message": message}}).to_string()
}

/// A successful result line. Serialized straight from the `f32`s (not through `Value`, which
/// would widen them to `f64` and print digits the model never computed).
#[derive(serde::Serialize)]
enum ResultLine<'a> {
    #[serde(rename = "output")]
    F32(&'a [f32]),
    #[serde(rename = "tokens")]
    Tokens(&'a [u32]),
}

fn render(index: usize, result: serve::Result<Output>) -> (String, bool) {
    let encoded = match &result {
        Ok(Output::F32(v)) => serde_json::to_string(&ResultLine::F32(v)),
        Ok(Output::Tokens(t)) => serde_json::to_string(&ResultLine::Tokens(t)),
        Err(e) => return (error_line(e.code(), &format!("line {}: {}", index + 1, e.message())), true),
    };
    match encoded {
        Ok(line) => (line, false),
        Err(e) => {
            (error_line(Code::Internal, &format!("line {}: cannot encode the output: {e}", index + 1)), true)
        }
    }
}

/// Run every line of `reader` as a request of `model` and write one line per request to `out`,
/// in input order. Requests are submitted as they are read (so they batch); completions arrive
/// on one completion queue tagged with the line index. Only an unreadable input is fatal.
fn infer_stream(
    model: &Model,
    reader: Box<dyn BufRead + Send>,
    out: &mut dyn Write,
) -> CliResult<InferSummary> {
    let (tx, rx) = mpsc::sync_channel::<LineMsg>(1024);
    std::thread::Builder::new()
        .name("serve-infer-reader".into())
        .spawn(move || read_lines(reader, tx))
        .map_err(|e| fatal(format!("cannot start the input reader thread: {e}")))?;
    let queue = CompletionQueue::new()?;
    let mut ordered = Ordered { out, next: 0, pending: VecDeque::new(), errors: 0 };
    let mut in_flight = 0usize;
    let mut lines = 0usize;
    let mut read_error: Option<io::Error> = None;
    let mut eof = false;
    let mut batch: Vec<Completion> = Vec::with_capacity(256);

    // Move finished requests into `ordered`, waiting up to `wait` for the first one.
    let mut drain = |ordered: &mut Ordered<'_>, in_flight: &mut usize, wait: Duration| -> CliResult<()> {
        if *in_flight == 0 {
            return ordered.write_ready();
        }
        batch.clear();
        queue.next_into(&mut batch, 1024, wait)?;
        for c in batch.drain(..) {
            *in_flight -= 1;
            let (line, is_err) = render(c.tag as usize, c.result);
            ordered.set(c.tag as usize, line, is_err);
        }
        ordered.write_ready()
    };

    loop {
        drain(&mut ordered, &mut in_flight, Duration::ZERO)?;
        if eof {
            if in_flight == 0 {
                break;
            }
            drain(&mut ordered, &mut in_flight, Duration::from_millis(100))?;
            continue;
        }
        let msg = if in_flight == 0 {
            ordered.out.flush().map_err(stdout_err)?;
            rx.recv().ok()
        } else {
            match rx.try_recv() {
                Ok(m) => Some(m),
                Err(TryRecvError::Disconnected) => None,
                Err(TryRecvError::Empty) => {
                    // Input is slow (a terminal, a pipe): show what is done, then wait briefly
                    // for completions before looking for more input.
                    ordered.out.flush().map_err(stdout_err)?;
                    drain(&mut ordered, &mut in_flight, Duration::from_millis(2))?;
                    continue;
                }
            }
        };
        let bytes = match msg {
            None => {
                eof = true;
                continue;
            }
            Some(LineMsg::Failed(e)) => {
                read_error = Some(e);
                eof = true;
                continue;
            }
            Some(LineMsg::Line(bytes)) => bytes,
        };
        let index = lines;
        lines += 1;
        let input = match parse_request(&bytes) {
            Ok(input) => input,
            Err(msg) => {
                ordered.set(
                    index,
                    error_line(Code::InvalidArgument, &format!("line {}: {msg}", index + 1)),
                    true,
                );
                continue;
            }
        };
        loop {
            match model.submit_to(input.clone(), SubmitOptions::default(), &queue, index as u64) {
                Ok(_) => {
                    in_flight += 1;
                    break;
                }
                Err(e) if e.code() == Code::Busy => {
                    // The admission bound is full: let some requests finish, then retry. (With
                    // none of ours in flight, the bound is catching up with completions we
                    // already drained: pause briefly rather than spin.)
                    if in_flight == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    drain(&mut ordered, &mut in_flight, Duration::from_millis(10))?;
                }
                Err(e) => {
                    ordered.set(
                        index,
                        error_line(e.code(), &format!("line {}: {}", index + 1, e.message())),
                        true,
                    );
                    break;
                }
            }
        }
    }
    ordered.write_ready()?;
    ordered.out.flush().map_err(stdout_err)?;
    if let Some(e) = read_error {
        return Err(fatal(format!("cannot read input after line {lines}: {e}")));
    }
    Ok(InferSummary { lines, errors: ordered.errors })
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn json_array<'v>(key: &str, v: &'v Value, what: &str) -> Result<&'v Vec<Value>, String> {
    match v {
        Value::Array(a) => Ok(a),
        other => Err(format!("`{key}` must be an array of {what}, found {}", json_kind(other))),
    }
}

fn parse_f32s(key: &str, v: &Value) -> Result<Vec<f32>, String> {
    json_array(key, v, "numbers")?
        .iter()
        .enumerate()
        .map(|(j, x)| match x.as_f64() {
            Some(f) if (f as f32).is_finite() => Ok(f as f32),
            Some(_) => Err(format!("`{key}[{j}]` = {x} is outside the f32 range")),
            None => Err(format!("`{key}[{j}]` is {}, expected a number", json_kind(x))),
        })
        .collect()
}

fn parse_tokens(v: &Value) -> Result<Vec<u32>, String> {
    json_array("tokens", v, "token ids")?
        .iter()
        .enumerate()
        .map(|(j, x)| match x {
            Value::Number(n) => n.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| {
                format!("`tokens[{j}]` = {n} is not a token id (an integer in 0..={})", u32::MAX)
            }),
            other => Err(format!("`tokens[{j}]` is {}, expected an integer token id", json_kind(other))),
        })
        .collect()
}

fn parse_parents(v: &Value) -> Result<Vec<i32>, String> {
    json_array("parents", v, "parent indices")?
        .iter()
        .enumerate()
        .map(|(j, x)| match x {
            Value::Number(n) => {
                n.as_i64().and_then(|p| i32::try_from(p).ok()).filter(|&p| p >= -1).ok_or_else(|| {
                    format!("`parents[{j}]` = {n} is not a parent index (-1 for the root, else a node index)")
                })
            }
            other => Err(format!("`parents[{j}]` is {}, expected an integer parent index", json_kind(other))),
        })
        .collect()
}

/// Parse one request line: `{"input":[…]}`, `{"tokens":[…]}` or `{"tokens":[…],"parents":[…]}`.
/// The error says what is wrong and where within the line (the caller adds the line number).
fn parse_request(bytes: &[u8]) -> Result<Input, String> {
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not valid UTF-8 ({e})"))?;
    if text.trim().is_empty() {
        return Err("empty line; expected a JSON object such as {\"input\":[…]} or {\"tokens\":[…]}".into());
    }
    let v: Value = serde_json::from_str(text).map_err(|e| {
        let full = e.to_string();
        let suffix = format!(" at line {} column {}", e.line(), e.column());
        format!("malformed JSON at column {}: {}", e.column(), full.strip_suffix(&suffix).unwrap_or(&full))
    })?;
    let Value::Object(map) = v else {
        return Err(format!("expected a JSON object, found {}", json_kind(&v)));
    };
    if let Some(k) = map.keys().find(|k| !matches!(k.as_str(), "input" | "tokens" | "parents")) {
        return Err(format!(
            "unknown key `{k}` (a request has `input`, or `tokens` and optionally `parents`)"
        ));
    }
    match (map.get("input"), map.get("tokens"), map.get("parents")) {
        (Some(_), Some(_), _) => Err("a request has `input` or `tokens`, not both".into()),
        (Some(_), None, Some(_)) => Err("`parents` goes with `tokens`, not with `input`".into()),
        (Some(x), None, None) => Ok(Input::F32(parse_f32s("input", x)?)),
        (None, Some(t), None) => Ok(Input::Tokens(parse_tokens(t)?)),
        (None, Some(t), Some(p)) => {
            let tokens = parse_tokens(t)?;
            let parents = parse_parents(p)?;
            if tokens.len() != parents.len() {
                return Err(format!(
                    "`tokens` has {} entries but `parents` has {}; a tree needs one parent per node",
                    tokens.len(),
                    parents.len()
                ));
            }
            Ok(Input::Tree { tokens, parents })
        }
        (None, None, Some(_)) => Err("missing key `tokens` (`parents` needs the tree's `tokens`)".into()),
        (None, None, None) => {
            Err("missing key: a request needs `input` (mlp) or `tokens` (lstm, seq2seq, treelstm)".into())
        }
    }
}

// ---------------------------------------------------------------------------------------------
// serve bench mlp
// ---------------------------------------------------------------------------------------------

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
struct BenchPlan {
    /// The backend the runs get, and its one-line description.
    backend: (BackendKind, String),
    net: Arc<Network>,
    name: String,
    /// The `"model"` object of the JSON report.
    model_json: Value,
    rt: RuntimeArgs,
    batched: TimeoutConfig,
    /// Offered rates; `None` = fractions of the measured capacity.
    rates: Option<Vec<f64>>,
    fractions: Vec<f64>,
    requests: Option<usize>,
    duration_s: f64,
    capacity_time: Duration,
    seed: u64,
    qos: Option<Duration>,
    compare: bool,
    json: Option<PathBuf>,
    inputs: Vec<Vec<f32>>,
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

fn random_inputs(len: usize, seed: u64) -> Vec<Vec<f32>> {
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

fn sizes_label(sizes: &[usize]) -> String {
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

fn cmd_bench_mlp(a: BenchMlpArgs) -> CliResult<()> {
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

fn run_bench(plan: &BenchPlan) -> CliResult<()> {
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
    let opts = ModelOptions { policy: PolicyConfig::Timeout(cfg), admission_bound: None, name: None };
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

// ---------------------------------------------------------------------------------------------
// serve demo (and `serve` with no arguments)
// ---------------------------------------------------------------------------------------------

const DEMO_SIZES: [usize; 4] = [64, 256, 256, 10];

/// Removes a directory when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn cmd_demo() -> CliResult<()> {
    let t0 = Instant::now();
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let dir = TempDir(std::env::temp_dir().join(format!("serve-demo-{}-{nanos}", std::process::id())));
    let model_dir = dir.0.join("demo-mlp");
    println!("== libserve {} demo: the main job on the CPU default ==", serve::VERSION);

    let mlp = Mlp::random(&DEMO_SIZES, 42);
    mlp.save(&model_dir)?;
    println!("-- wrote a random mlp (sizes {}) to {}", sizes_label(&DEMO_SIZES), model_dir.display());

    let rt_args = RuntimeArgs { backend: BackendArg::Auto, threads: 0 };
    let rt = build_runtime(rt_args)?;
    let backend = (rt.backend_kind(), rt.backend_description());
    println!("-- backend: {}", backend.1);
    let cfg = timeout_policy(32, 0, 1);
    let model = rt
        .load_model(
            &model_dir,
            ModelOptions { policy: PolicyConfig::Timeout(cfg), ..ModelOptions::default() },
        )
        .map_err(|e| fatal(format!("cannot load the demo model: {e}")))?;

    // A few requests: good ones, then two the server must reject precisely.
    let mut rng = StdRng::seed_from_u64(7);
    let good: Vec<Vec<f32>> = (0..4)
        .map(|_| {
            (0..DEMO_SIZES[0]).map(|_| (rng.random_range(-1.0f32..1.0) * 100.0).round() / 100.0).collect()
        })
        .collect();
    let mut lines: Vec<String> = good.iter().map(|v| json!({ "input": v }).to_string()).collect();
    lines.push(json!({"input": [1.0, 2.0, 3.0]}).to_string());
    lines.push("{\"input\": [1, 2,".to_string());
    let requests = dir.0.join("requests.jsonl");
    std::fs::write(&requests, lines.join("\n") + "\n")
        .map_err(|e| fatal(format!("cannot write {}: {e}", requests.display())))?;
    println!("-- serve infer {} --input {}", model_dir.display(), requests.display());
    let mut captured = Vec::new();
    let summary = infer_stream(&model, open_input(&requests)?, &mut captured)?;
    let text = String::from_utf8_lossy(&captured);
    print!("{text}");
    let mut worst = 0.0f64;
    for (line, x) in text.lines().zip(&good) {
        let got: Vec<f64> = serde_json::from_str::<Value>(line)
            .ok()
            .and_then(|v| v.get("output").and_then(Value::as_array).cloned())
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        let want = mlp.forward_reference(x);
        if got.len() != want.len() {
            return Err(fatal(format!("demo: unexpected result line `{line}`")));
        }
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - *w as f64).abs() / (*w as f64).abs().max(1e-3));
        }
    }
    println!(
        "-- {} request(s), {} rejected as expected; outputs match the f64 reference (max rel. error {worst:.1e})",
        summary.lines, summary.errors
    );
    drop(model);
    drop(rt);

    println!("-- serve bench mlp --model {} (short run: 0.5 s per rate)", model_dir.display());
    let net = serve::model::load(&model_dir)?;
    let plan = BenchPlan {
        backend,
        net: Arc::new(net),
        name: "demo-mlp".into(),
        model_json: json!({"kind": "mlp", "sizes": DEMO_SIZES, "source": "demo"}),
        rt: rt_args,
        batched: cfg,
        rates: None,
        fractions: vec![0.25, 0.75],
        requests: None,
        duration_s: 0.5,
        capacity_time: Duration::from_millis(500),
        seed: 1,
        qos: Some(Duration::from_millis(5)),
        compare: true,
        json: None,
        inputs: random_inputs(DEMO_SIZES[0], 1),
    };
    run_bench(&plan)?;
    println!("== demo done in {:.1} s ==", t0.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(s: &str) -> Result<Input, String> {
        parse_request(s.as_bytes())
    }

    #[test]
    fn parses_the_three_request_shapes() {
        assert_eq!(parse(r#"{"input":[1, 2.5, -3e2]}"#), Ok(Input::F32(vec![1.0, 2.5, -300.0])));
        assert_eq!(parse(r#"{"tokens":[0, 4294967295]}"#), Ok(Input::Tokens(vec![0, u32::MAX])));
        assert_eq!(
            parse(r#" {"parents":[-1,0], "tokens":[5,6]} "#),
            Ok(Input::Tree { tokens: vec![5, 6], parents: vec![-1, 0] })
        );
    }

    #[test]
    fn rejects_bad_lines_saying_where() {
        let err = |s: &str| parse(s).unwrap_err();
        assert!(err(r#"{"tokens":[1, 1.5]}"#).contains("`tokens[1]` = 1.5"));
        assert!(err(r#"{"tokens":[-1]}"#).contains("`tokens[0]` = -1"));
        assert!(err(r#"{"tokens":[4294967296]}"#).contains("`tokens[0]` = 4294967296"));
        assert!(err(r#"{"tokens":["a"]}"#).contains("`tokens[0]` is a string"));
        assert!(err(r#"{"tokens":[1],"parents":["x"]}"#).contains("`parents[0]` is a string"));
        assert!(err(r#"{"tokens":[1],"parents":[-2]}"#).contains("`parents[0]` = -2"));
        assert!(err(r#"{"tokens":[1,2],"parents":[-1]}"#).contains("one parent per node"));
        assert!(err(r#"{"tokens":[1],"parents":{}}"#).contains("`parents` must be an array"));
        assert!(err(r#"{"input":[1e39]}"#).contains("outside the f32 range"));
        assert!(err(r#"{"input":[null]}"#).contains("`input[0]` is null"));
        assert!(err(r#"{"input":[1], "tokens":[1]}"#).contains("not both"));
        assert!(err(r#"{"inputs":[1]}"#).contains("unknown key `inputs`"));
        assert!(err("{}").contains("missing key"));
        assert!(err("[1,2]").contains("expected a JSON object"));
        assert!(err("").contains("empty line"));
        let m = err(r#"{"input": [1, 2"#);
        assert!(m.starts_with("malformed JSON at column"), "{m}");
        assert!(!m.contains("at line"), "{m}");
        assert!(parse_request(b"{\"input\":[1]}\xff").unwrap_err().contains("UTF-8"));
    }

    #[test]
    fn policy_names() {
        assert_eq!(policy_name(&timeout_policy(32, 0, 1)), "timeout(s=32,t=0us)");
        assert_eq!(policy_name(&timeout_policy(8, 250, 2)), "timeout(s=8,t=250us,w=2)");
        assert_eq!(policy_name(&timeout_policy(1, 0, 1)), "unbatched");
    }

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
