//! `serve`: the libserve command-line tool.
//!
//! * `serve info` — version, the backend `auto` picks, CPU features, CUDA driver / devices.
//! * `serve infer MODEL_DIR --input FILE.jsonl` — ARCHITECTURE.md §6: one request per line, one result line
//!   per request, in input order.
//! * `serve bench mlp …` — ARCHITECTURE.md §8: Poisson open-loop load against an mlp, batched and unbatched.
//! * `serve bench lstm|seq2seq|treelstm …` — ARCHITECTURE.md §7, §8: cellular batching against the padding
//!   baseline (peak throughput, latency at equal offered rates, their ratios); lstm also against
//!   its PyTorch peer (`bench_peer.rs`).
//! * `serve bench step …` — ARCHITECTURE.md §8 micro-benchmark: one batched LSTM cell step against the
//!   bare GEMM of the same shape.
//! * `serve` / `serve demo` — the main job on the CPU default: a small mlp is written, loaded,
//!   queried with `infer`, then benchmarked briefly.

mod bench;
mod bench_alone;
mod bench_coldstart;
mod bench_elastic;
mod bench_layers;
mod bench_peer;
mod bench_peer_check;
mod bench_rnn;
mod bench_step;
mod bench_tenant;
mod demo;
mod elastic_compare;
mod elastic_memory;
mod infer;
mod info;
mod plan_deepplan;
mod plot;
mod profile;
mod profile_engine;
mod profile_layers;
mod profile_versions;
mod request;
mod sim;
mod sim_coldstart;
mod sim_elastic;
mod sim_tenant;
mod steal;

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::{RangedU64ValueParser, TypedValueParser};
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};

use serve::runtime::{MAX_BATCH_LIMIT, MAX_CPU_THREADS, MAX_WORKERS};
use serve::{BackendChoice, Error, Runtime, TimeoutConfig};

use crate::bench::cmd_bench_mlp;
use crate::bench_layers::{BenchLayersArgs, cmd_bench_layers};
use crate::bench_rnn::{RnnKind, cmd_bench_rnn};
use crate::bench_step::{BenchStepArgs, cmd_bench_step};
use crate::demo::cmd_demo;
use crate::infer::{DEFAULT_MAX_LINE_BYTES, MAX_LINE_BYTES_LIMIT, cmd_infer};
use crate::info::cmd_info;
use crate::profile::{ProfileArgs, cmd_profile};
use crate::sim::cmd_sim;

// ---------------------------------------------------------------------------------------------
// Command line
// ---------------------------------------------------------------------------------------------

#[derive(Parser, Debug)]
#[command(
    name = "serve",
    version,
    about = "libserve: batched deep-learning inference (CPU default, CUDA when present)",
    long_about = "libserve: batched deep-learning inference.\n\nWith no command, runs `serve demo`: \
                  the main job on the CPU default (write a small mlp, infer, benchmark briefly; \
                  then cellular batching vs padding on an LSTM)."
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

// Parsed once at start-up: the size of the bench variants does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
enum Command {
    /// Print the version, the backend `auto` selects, CPU features and CUDA availability.
    Info,
    /// Run one request per line of a JSON-lines file; print one result line per request, in order.
    Infer(InferArgs),
    /// Open-loop benchmarks (ARCHITECTURE.md §8).
    Bench {
        #[command(subcommand)]
        what: BenchCommand,
    },
    /// The main job on the CPU default: write a small mlp, run `infer` on it, benchmark it briefly;
    /// then a short LSTM benchmark of cellular batching against the padding baseline.
    Demo,
    /// Measure the backend per cell type and batch size into a cost file for `serve sim`.
    Profile(ProfileArgs),
    /// Offline planners: `serve plan deepplan` makes a cold-start plan (DeepPlan) from a
    /// per-layer profile.
    Plan {
        #[command(subcommand)]
        what: PlanCommand,
    },
    /// The benchmarks on virtual time: the runtime's engine core and policies with a cost model
    /// (a `serve profile` file or a shipped one: batchmaker-v100). Every figure is simulated.
    /// `serve sim tenant` is VELTAIR's multi-tenant study (`serve sim tenant --help`).
    #[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
    Sim(SimCmd),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
    /// Poisson open-loop load against an mlp (a random one unless --model is given).
    Mlp(BenchMlpArgs),
    /// Cellular batching vs the padding baseline (and the PyTorch peer) on an lstm, WMT-like sentence lengths.
    Lstm(BenchRnnArgs),
    /// Cellular batching vs the padding baseline on a seq2seq (greedy decode), WMT-like sources.
    Seq2seq(BenchRnnArgs),
    /// Cellular batching vs the padding baseline on a Child-Sum TreeLSTM, TreeBank-like trees.
    Treelstm(BenchRnnArgs),
    /// Micro-benchmark: one batched LSTM cell step (gather, GEMM, gates, scatter) vs the bare GEMM.
    Step(BenchStepArgs),
    /// A layer model (ResNet, BERT-base) on the CPU backend against PyTorch on the same machine.
    Layers(BenchLayersArgs),
    /// E²bird's, the async-transfer slides' and TF-Serving's fixed-shape policies on the real
    /// runtime (a random mlp unless MODEL_DIR is given): Poisson, step, diurnal or burst arrivals,
    /// goodput, throughput at QoS.
    Elastic(BenchElasticArgs),
    /// Serving beyond device memory (DeepPlan) on the runtime's cold server with the CPU
    /// executor (emulated bus): PipeSwitch and DHA plans over N instances, with the simulator's
    /// prediction of the same run beside each measurement.
    Coldstart(bench_coldstart::BenchColdstartArgs),
    /// VELTAIR's multi-tenant study on real cores: layer models sharing the CPUs under every
    /// tenant scheme (the runtime's tenant mode), QPS@95% by bisection, latency over solo, core
    /// usage, conflicts.
    Tenant(bench_tenant::BenchTenantArgs),
}

#[derive(Args, Debug)]
struct BenchElasticArgs {
    /// A fixed-shape model directory (mlp, resnet, bert, custom); default a random mlp.
    model_dir: Option<PathBuf>,
    /// Layer widths of the random mlp, input first (default 256,1024,1024,256).
    #[arg(long, value_delimiter = ',', value_parser = positive(), conflicts_with = "model_dir")]
    sizes: Option<Vec<usize>>,
    #[command(flatten)]
    elastic: ElasticSimArgs,
    /// Poisson rates in requests per second (default: 0.05, 0.25, 0.5, 0.75 and 0.9 of one full
    /// batch's capacity).
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Requests per Poisson rate (default: rate × --duration-s).
    #[arg(long, value_parser = positive())]
    requests: Option<usize>,
    /// Seconds of arrivals per Poisson rate, when --requests is not given (at most 3600).
    #[arg(long, default_value_t = 2.0, value_parser = seconds)]
    duration_s: f64,
    /// Seconds of arrivals per probe of the throughput-at-QoS search (at most 3600).
    #[arg(long, default_value_t = 1.0, value_parser = seconds)]
    probe_s: f64,
    #[command(flatten)]
    rt: RuntimeArgs,
    /// Seed of the random mlp and the arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as one JSON object to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Step, diurnal and burst arrivals: draw latency against arrival order into this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
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

/// A `usize` option in `min..=max` (clap names the range when a value is outside it).
fn in_range(min: usize, max: usize) -> impl TypedValueParser<Value = usize> {
    RangedU64ValueParser::<usize>::new().range(min as u64..=max as u64)
}

/// Longest `--max-wait-us`: 60 s (a batching wait is normally well under a millisecond).
const MAX_WAIT_US: u64 = 60_000_000;
/// Most `--max-inflight`: requests (and their inputs) `serve infer` keeps in flight at once.
const MAX_INFLIGHT: usize = 1 << 20;

/// `--max-wait-us`: 0..=[`MAX_WAIT_US`].
fn max_wait_us() -> impl TypedValueParser<Value = u64> {
    clap::value_parser!(u64).range(0..=MAX_WAIT_US)
}

/// A finite `f64` option that must be greater than 0.
/// `MxKxN`: a product's dims, each 1 to 65536.
fn gemm_shape(s: &str) -> Result<(usize, usize, usize), String> {
    let dims: Vec<usize> = s
        .split(['x', 'X'])
        .map(|d| d.trim().parse::<usize>().map_err(|e| format!("`{s}`: `{d}` is not a size: {e}")))
        .collect::<Result<_, _>>()?;
    match dims[..] {
        [m, k, n] if [m, k, n].iter().all(|d| (1..=65536).contains(d)) => Ok((m, k, n)),
        _ => Err(format!("`{s}` is not MxKxN with each of M, K, N from 1 to 65536")),
    }
}

fn positive_f64(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("`{s}` is not a number: {e}"))?;
    if v.is_finite() && v > 0.0 { Ok(v) } else { Err(format!("`{s}` must be a positive finite number")) }
}

/// Longest duration option (`--duration-s`, `--capacity-s`): one hour.
const MAX_SECONDS: f64 = 3600.0;

/// A duration in seconds: positive, at most [`MAX_SECONDS`].
fn seconds(s: &str) -> Result<f64, String> {
    let v = positive_f64(s)?;
    if v <= MAX_SECONDS { Ok(v) } else { Err(format!("`{s}` is more than {MAX_SECONDS} s")) }
}

/// A latency target in milliseconds: positive, at most [`MAX_SECONDS`].
fn millis(s: &str) -> Result<f64, String> {
    let v = positive_f64(s)?;
    if v <= MAX_SECONDS * 1e3 { Ok(v) } else { Err(format!("`{s}` is more than {} ms", MAX_SECONDS * 1e3)) }
}

#[derive(Args, Debug, Clone, Copy)]
struct RuntimeArgs {
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendArg::Auto)]
    backend: BackendArg,
    /// CPU compute threads (0 = one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = in_range(0, MAX_CPU_THREADS))]
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
    /// Most requests in one batched task (at most 65536).
    #[arg(long, default_value_t = 32, value_parser = in_range(1, MAX_BATCH_LIMIT))]
    max_batch: usize,
    /// How long the oldest queued request may wait for a fuller batch (0 = no wait; at most
    /// 60000000 = 60 s). The last requests do not wait at the end of the input.
    #[arg(long, default_value_t = 0, value_parser = max_wait_us())]
    max_wait_us: u64,
    /// Admission bound: requests in flight at once (default: the runtime's, 4096; at most
    /// 1048576). Submits refused BUSY wait for completions and are retried.
    #[arg(long, value_parser = in_range(1, MAX_INFLIGHT))]
    max_inflight: Option<usize>,
    /// Longest request line in bytes, not counting its `\n` (a `\r` before it counts; at most
    /// 1073741824 = 1 GiB). A
    /// longer line is skipped without being stored and answered with an INVALID_ARGUMENT error
    /// line; one with no newline within a further 1 GiB (e.g. /dev/zero) ends the input there.
    #[arg(long, default_value_t = DEFAULT_MAX_LINE_BYTES, value_parser = in_range(1, MAX_LINE_BYTES_LIMIT))]
    max_line_bytes: usize,
}

#[derive(Args, Debug)]
struct BenchMlpArgs {
    /// Benchmark the mlp in this model directory instead of a random one.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Layer widths of the random mlp, input first. Default: CPU scale 256,256,256,256 (hidden 256)
    /// on the CPU backend, GPU scale 256,1024,1024,256 (hidden 1024) on CUDA (ARCHITECTURE.md §8).
    #[arg(long, value_delimiter = ',', value_parser = positive(), conflicts_with = "model")]
    sizes: Option<Vec<usize>>,
    /// Offered rates in requests per second (several allowed: `--rate 500 1000` or `--rate
    /// 500,1000`). Default: 0.25, 0.5, 0.75 and 0.9 of the capacity measured in a closed loop.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Requests per offered rate (default: rate × --duration-s).
    #[arg(long, value_parser = positive())]
    requests: Option<usize>,
    /// Seconds of arrivals per offered rate, when --requests is not given (at most 3600).
    #[arg(long, default_value_t = 2.0, value_parser = seconds)]
    duration_s: f64,
    /// Most requests in one batched task (the policy `timeout(s, t)`; at most 65536).
    #[arg(long, default_value_t = 32, value_parser = in_range(1, MAX_BATCH_LIMIT))]
    max_batch: usize,
    /// Longest the oldest queued request waits for a fuller batch (0 = NO_Wait; at most
    /// 60000000 = 60 s).
    #[arg(long, default_value_t = 0, value_parser = max_wait_us())]
    max_wait_us: u64,
    /// Workers (concurrent streams) of the policy (at most 256).
    #[arg(long, default_value_t = 1, value_parser = in_range(1, MAX_WORKERS))]
    workers: usize,
    #[command(flatten)]
    rt: RuntimeArgs,
    /// Seed of the random mlp, its inputs and the arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as one JSON object (ARCHITECTURE.md §8) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw latency (p50/p90/p99) against throughput per policy into this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// Latency target in ms: also report goodput (requests per second completed within it; at
    /// most 3600000).
    #[arg(long, value_parser = millis)]
    qos_ms: Option<f64>,
    /// Also run without batching (max batch 1) at the same offered rates and print the ratios
    /// batched / unbatched.
    #[arg(long, default_value_t = true, action = ArgAction::Set)]
    compare_batch: bool,
    /// Seconds of closed-loop load used to measure capacity when no --rate is given (at most 3600).
    #[arg(long, default_value_t = 1.0, value_parser = seconds)]
    capacity_s: f64,
}

/// Default seq2seq `max_decode` of `serve bench seq2seq`'s random model.
pub(crate) const DEFAULT_MAX_DECODE: usize = 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum PolicyArg {
    /// BatchMaker's cellular batching (ARCHITECTURE.md §7).
    Cellular,
    /// Graph batching padded per bucket (the TF/MXNet baseline).
    Padding,
}

/// `--eos-bias`: `auto` or a number.
#[derive(Clone, Copy, Debug, PartialEq)]
enum EosBias {
    Auto,
    Value(f32),
}

fn eos_bias(s: &str) -> Result<EosBias, String> {
    if s.trim() == "auto" {
        return Ok(EosBias::Auto);
    }
    match s.trim().parse::<f32>() {
        Ok(v) if v.is_finite() => Ok(EosBias::Value(v)),
        _ => Err(format!("`{s}` is neither `auto` nor a finite number")),
    }
}

/// A finite `f64` in (0, 1].
fn fraction(s: &str) -> Result<f64, String> {
    let v = positive_f64(s)?;
    if v <= 1.0 { Ok(v) } else { Err(format!("`{s}` is not a fraction in (0, 1]")) }
}

/// The sizes of the benchmarks' random recurrent model that `serve bench` and `serve profile`
/// share (the hidden size is each command's own: its default differs).
#[derive(Args, Debug, Clone, Copy)]
struct RandomRnnArgs {
    /// Vocabulary of the random model.
    #[arg(long, default_value_t = 30_000, value_parser = positive())]
    vocab: usize,
    /// LSTM layers of the random model (lstm, seq2seq; default 1).
    #[arg(long, value_parser = positive())]
    layers: Option<usize>,
    /// Most decoded tokens of the random seq2seq (default 20).
    #[arg(long, value_parser = positive())]
    max_decode: Option<usize>,
}

/// The recurrent policies under test and their options (`serve bench` and `serve sim` alike).
#[derive(Args, Debug, Clone)]
struct RnnPolicyArgs {
    /// Policies to compare (default: cellular,padding).
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1..)]
    policy: Vec<PolicyArg>,
    /// Workers (streams) of each policy (at most 256). Default: cellular 1; padding one per
    /// compute thread on `serve bench` with the CPU backend (a framework's CPU server keeps every
    /// core busy; see `serve bench lstm --help`), else 1.
    #[arg(long, value_parser = in_range(1, MAX_WORKERS))]
    workers: Option<usize>,
    /// Max batch. Cellular: per cell type (`512,256` for a seq2seq's encoder, decoder; one value
    /// = every type; default 512, the seq2seq decoder 256). Padding: requests per batch, one
    /// value (default 256 on `serve bench` with the CPU backend, as the PyTorch peer's largest;
    /// else 64, the BatchMaker paper's). At most 65536.
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = in_range(1, MAX_BATCH_LIMIT))]
    max_batch: Vec<usize>,
    /// Tasks a worker may have submitted and unfinished (MaxTasksToSubmit), both policies.
    /// Default: cellular the model kind's (5; a seq2seq model 2), padding 5.
    #[arg(long, value_parser = positive())]
    max_tasks_to_submit: Option<usize>,
    /// Width of padding's size buckets, in cells.
    #[arg(long, default_value_t = 10, value_parser = positive())]
    bucket_width: usize,
    /// Which bucket padding serves next: `round-robin` (the BatchMaker paper's baseline) or
    /// `oldest` (the bucket whose first request came first, as a framework's bucketing batcher).
    /// Default: `oldest` on `serve bench` with the CPU backend, else `round-robin`.
    #[arg(long, value_enum)]
    bucket_order: Option<BucketOrderArg>,
    /// Most levels of a padded batch of lstm sequences one task runs (default: all of them, as
    /// frameworks do; 1: one task per level, the engine round trip per step).
    #[arg(long, default_value_t = u32::MAX, value_parser = clap::value_parser!(u32).range(1..))]
    padding_steps: u32,
    /// Requests kept in flight while measuring peaks (default: 4× the largest max batch, at least
    /// 256, at most the admission bound 4096; the same for every policy).
    #[arg(long, value_parser = positive())]
    capacity_window: Option<usize>,
}

/// `--bucket-order`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum BucketOrderArg {
    RoundRobin,
    Oldest,
}

impl From<BucketOrderArg> for serve::BucketOrder {
    fn from(a: BucketOrderArg) -> serve::BucketOrder {
        match a {
            BucketOrderArg::RoundRobin => serve::BucketOrder::RoundRobin,
            BucketOrderArg::Oldest => serve::BucketOrder::OldestHead,
        }
    }
}

#[derive(Args, Debug)]
struct BenchRnnArgs {
    /// Benchmark the model in this directory instead of a random one.
    #[arg(long, conflicts_with_all = ["hidden", "embed", "vocab", "layers", "max_decode", "eos_bias"])]
    model_dir: Option<PathBuf>,
    /// Hidden size of the random model. Default: CPU scale 256 on the CPU backend, GPU scale 1024
    /// on CUDA (ARCHITECTURE.md §8).
    #[arg(long, value_parser = positive())]
    hidden: Option<usize>,
    /// Embedding size of the random model (default: the hidden size).
    #[arg(long, value_parser = positive())]
    embed: Option<usize>,
    #[command(flatten)]
    random: RandomRnnArgs,
    /// Added to the random seq2seq's `decoder.proj.bias[eos]` so decodes end at eos at varied
    /// lengths: a number, or `auto` (default): calibrated for a mean decode of half max_decode.
    #[arg(long, value_parser = eos_bias)]
    eos_bias: Option<EosBias>,
    /// MiB of token-gate tables the model may hold (CPU backend: an LSTM's embedding folded into
    /// its first layer, vocab × 4·hidden floats; 0 = off). Default: the runtime's, 256 MiB.
    #[arg(long, value_parser = in_range(0, 1 << 20))]
    token_gates_mib: Option<usize>,
    #[command(flatten)]
    pol: RnnPolicyArgs,
    /// Offered rates in requests per second (`--rate 100 200` or `--rate 100,200`). Default:
    /// --fractions of every policy's measured peak throughput (and half of padding's).
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Fractions of each policy's peak throughput to offer when no --rate is given.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = fraction,
          default_values_t = [0.25, 0.5, 0.75, 0.9])]
    fractions: Vec<f64>,
    /// Measure every policy's peak throughput (default: yes unless --rate is given).
    #[arg(long, action = ArgAction::Set)]
    measure_peak: Option<bool>,
    /// Seconds of saturating closed-loop load per policy to measure its peak throughput (at most
    /// 3600).
    #[arg(long, default_value_t = 3.0, value_parser = seconds)]
    capacity_s: f64,
    /// Requests per offered rate (default: rate × --duration-s).
    #[arg(long, value_parser = positive())]
    requests: Option<usize>,
    /// Seconds of arrivals per offered rate, when --requests is not given (at most 3600).
    #[arg(long, alias = "duration", default_value_t = 2.0, value_parser = seconds)]
    duration_s: f64,
    /// Latency target in ms: also report goodput (requests per second completed within it; at
    /// most 3600000).
    #[arg(long, value_parser = millis)]
    qos_ms: Option<f64>,
    #[command(flatten)]
    rt: RuntimeArgs,
    /// Seed of the random model, the requests and the arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as one JSON object (ARCHITECTURE.md §8) to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw latency (p50/p90/p99) against throughput per policy into this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
    #[command(flatten)]
    peer: crate::bench_peer::PeerArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum SimKind {
    Lstm,
    Seq2seq,
    Treelstm,
    Mlp,
    /// A fixed-shape model under E²bird's, the async-transfer slides' and TF-Serving's policies
    /// (issue 15; `--policies`, `--arrivals`, `--qos-ms`).
    Elastic,
}

/// `serve sim elastic`'s policies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ElasticPolicyArg {
    /// TF-Serving, no wait (s = MaxBS, t = 0).
    NoWait,
    /// TF-Serving, t = --opt-wait-ms.
    OptWait,
    /// OPT_Wait padded to MaxBS.
    Static,
    /// E²bird's N-Ebird.
    Nebird,
    /// E²bird's E-Ebird (--engine-configs).
    Eebird,
    /// Adaptive batching, two streams.
    Adaptive,
    /// Adaptive batching, one stream (the slides' serial server).
    Serial,
}

/// `serve sim elastic --arrivals`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ElasticArrivals {
    /// Poisson at each --rate.
    Poisson,
    /// The rate stepped from --low-rps to --high-rps every 150 requests.
    Step,
    /// 150 requests at --low-rps, then 250 at --high-rps (E²bird's Fig. 13).
    Diurnal,
    /// 1 s at --low-rps (default half of one full batch's capacity), a 0.3 s burst at --high-rps
    /// (default twice the low rate), 1 s at the low rate (the async-transfer slides' Z5).
    Burst,
}

/// Options of `serve sim elastic` (ignored by the other workloads).
#[derive(Args, Debug, Clone)]
struct ElasticSimArgs {
    /// Policies to compare (default: all).
    #[arg(long, value_enum, value_delimiter = ',', num_args = 1..)]
    policies: Vec<ElasticPolicyArg>,
    #[arg(long, value_enum, default_value_t = ElasticArrivals::Poisson)]
    arrivals: ElasticArrivals,
    /// The QoS: latency bound of throughput at QoS, goodput and the adaptive policy (sim: default
    /// the paper's 200 ms; bench: 200/93.7 of one full batch's time, the paper's ratio).
    #[arg(long, value_parser = positive_f64)]
    qos_ms: Option<f64>,
    /// OPT_Wait's (and Static's) max wait (sim: default the paper's 30 ms for ResNet-152; bench:
    /// 30/93.7 of one full batch's time).
    #[arg(long, value_parser = positive_f64)]
    opt_wait_ms: Option<f64>,
    /// MaxBS: TF-Serving's max batch, N-Ebird's max in flight, the adaptive max batch.
    #[arg(long, default_value_t = 32, value_parser = in_range(1, 65536))]
    max_bs: usize,
    /// E-Ebird's engine configurations, `{"TotalBS": [batch sizes], …}` (default: the paper's
    /// Table 4 for ResNet-152).
    #[arg(long)]
    engine_configs: Option<PathBuf>,
    /// Step/diurnal low rate (default: a quarter of one full batch's capacity).
    #[arg(long, value_parser = positive_f64)]
    low_rps: Option<f64>,
    /// Step/diurnal high rate (default: 0.95 of one full batch's capacity).
    #[arg(long, value_parser = positive_f64)]
    high_rps: Option<f64>,
}

/// Most requests per simulated run.
const MAX_SIM_REQUESTS: usize = 10_000_000;

/// `serve sim`: a workload with its options, or the tenant study.
#[derive(Args, Debug)]
struct SimCmd {
    #[command(subcommand)]
    sub: Option<SimSub>,
    #[command(flatten)]
    args: SimArgs,
}

#[derive(Subcommand, Debug)]
enum PlanCommand {
    /// DeepPlan's cold-start plan: per layer, load it (pipelined with execution) or execute it
    /// by direct host access, by Algorithm 1 over the profile's stall model; with --topology,
    /// parallel transmission over GPUs under distinct PCIe switches with NVLink.
    Deepplan(plan_deepplan::DeepplanArgs),
}

#[derive(Subcommand, Debug)]
enum SimSub {
    /// Multi-tenant CPU serving (VELTAIR): the spec's seven models on `--cores` cores, every
    /// scheduling scheme's QPS@95% (the highest Poisson rate with ≥ 95% of queries within their
    /// model's QoS, by bisection with the seed fixed), latency over solo, core usage and conflict
    /// rate. Block times come from the simulator's GEMM cost model (ARCHITECTURE.md §7.9), fitted
    /// to a `serve profile` layer file with --cost. Every figure is simulated.
    Tenant(sim_tenant::TenantArgs),
    /// Cold-start serving (DeepPlan) on the paper's machine (4 V100s, 2 PCIe switches, NVLink):
    /// one cold inference of each model under Baseline / PipeSwitch / DHA / PT / PT+DHA, and
    /// the serving experiment (Poisson arrivals over N model instances, goodput under the SLO,
    /// cold rate, p99). Every figure is simulated.
    Coldstart(sim_coldstart::ColdstartArgs),
}

#[derive(Args, Debug)]
struct SimArgs {
    /// The workload (the model kind of `serve bench`). Required (an option only so that
    /// `serve sim tenant` parses without it).
    #[arg(value_enum, required = true)]
    workload: Option<SimKind>,
    /// Cost model: a shipped name (batchmaker-v100) or a cost file from `serve profile`.
    #[arg(long, required = true)]
    cost: Option<String>,
    #[command(flatten)]
    pol: RnnPolicyArgs,
    /// Request lengths (lstm, seq2seq): `wmt` (log-normal, mean 24) or `fixed:N`.
    #[arg(long, default_value = "wmt", value_parser = crate::sim::lengths)]
    lengths: serve::sim::workload::Lengths,
    /// Offered rates in requests per second. Default: --fractions of every policy's simulated peak.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Fractions of each policy's peak to offer when no --rate is given.
    #[arg(long, num_args = 1.., value_delimiter = ',', value_parser = fraction,
          default_values_t = [0.25, 0.5, 0.75, 0.9])]
    fractions: Vec<f64>,
    /// Requests per run (at most 10000000).
    #[arg(long, default_value_t = 20_000, value_parser = in_range(1, MAX_SIM_REQUESTS))]
    requests: usize,
    /// Hidden size of the model (default: the cost file's, else 256); sizes the state arena.
    #[arg(long, value_parser = positive())]
    hidden: Option<usize>,
    /// LSTM layers (lstm, seq2seq; default 1).
    #[arg(long, value_parser = positive())]
    layers: Option<usize>,
    /// Most decoded tokens (seq2seq; default 20).
    #[arg(long, value_parser = positive())]
    max_decode: Option<usize>,
    /// Seed of the requests and arrival times.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as one JSON object (ARCHITECTURE.md §8, `"backend": "sim"`).
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw latency (p50/p90/p99) against throughput per policy into this SVG file.
    #[arg(long)]
    svg: Option<PathBuf>,
    /// A `serve bench … --json` report to check the simulator against: replay its peaks and
    /// offered rates and print both side by side.
    #[arg(long)]
    compare: Option<PathBuf>,
    #[command(flatten)]
    elastic: ElasticSimArgs,
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
    // signal handlers (ARCHITECTURE.md §4).
    #[cfg(unix)]
    // SAFETY: resetting SIGPIPE to its default disposition has no memory-safety preconditions; no
    // other thread exists yet.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    let cli = Cli::parse();
    match run(cli.command.unwrap_or(Command::Demo)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Fatal(msg)) => {
            eprintln!("serve: error: {msg}");
            ExitCode::FAILURE
        }
    }
}

/// Run `serve ARGS…` from inside the binary (the demo runs benchmarks this way).
pub(crate) fn run_args(args: &[&str]) -> CliResult<()> {
    let cli = Cli::try_parse_from(std::iter::once("serve").chain(args.iter().copied()))
        .map_err(|e| fatal(format!("serve {}: {e}", args.join(" "))))?;
    run(cli.command.ok_or_else(|| fatal("run_args needs a command"))?)
}

fn run(command: Command) -> CliResult<()> {
    match command {
        Command::Info => cmd_info(),
        Command::Infer(a) => cmd_infer(a),
        Command::Bench { what: BenchCommand::Mlp(a) } => cmd_bench_mlp(a),
        Command::Bench { what: BenchCommand::Lstm(a) } => cmd_bench_rnn(RnnKind::Lstm, a),
        Command::Bench { what: BenchCommand::Seq2seq(a) } => cmd_bench_rnn(RnnKind::Seq2Seq, a),
        Command::Bench { what: BenchCommand::Treelstm(a) } => cmd_bench_rnn(RnnKind::TreeLstm, a),
        Command::Bench { what: BenchCommand::Step(a) } => cmd_bench_step(a),
        Command::Bench { what: BenchCommand::Layers(a) } => cmd_bench_layers(a),
        Command::Bench { what: BenchCommand::Elastic(a) } => bench_elastic::cmd_bench_elastic(a),
        Command::Bench { what: BenchCommand::Coldstart(a) } => bench_coldstart::cmd_bench_coldstart(&a),
        Command::Bench { what: BenchCommand::Tenant(a) } => bench_tenant::cmd_bench_tenant(a),
        Command::Demo => cmd_demo(),
        Command::Profile(a) => cmd_profile(a),
        Command::Sim(SimCmd { sub: Some(SimSub::Tenant(t)), .. }) => sim_tenant::cmd_sim_tenant(&t),
        Command::Sim(SimCmd { sub: Some(SimSub::Coldstart(c)), .. }) => sim_coldstart::cmd_sim_coldstart(&c),
        Command::Plan { what: PlanCommand::Deepplan(a) } => plan_deepplan::cmd_plan_deepplan(&a),
        Command::Sim(SimCmd { args, .. }) => cmd_sim(args),
    }
}

/// The CPU compute threads `--threads N` gives (0: one per available core, as the CPU backend reads it).
fn compute_threads(requested: usize) -> usize {
    match requested {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        t => t,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
