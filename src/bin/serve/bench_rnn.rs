//! `serve bench lstm|seq2seq|treelstm …` (ARCHITECTURE.md §7, §8): cellular batching against the padding
//! baseline under Poisson open-loop load, with the shared machinery of [`crate::bench`].
//!
//! * Model: made in code at CPU scale by default (hidden 256, embed = hidden, vocab 30 000,
//!   1 layer; GPU scale hidden 1024 on the CUDA backend), or `--model-dir`.
//! * Requests: WMT-like token sequences (lstm, seq2seq sources) or TreeBank-like trees
//!   (treelstm; leaves carry random tokens, internal nodes none) from [`serve::workload`];
//!   [`RNN_INPUTS`] of them, cycled in the same order for every policy and rate.
//! * Peak throughput of each policy: a saturating closed loop (the same window for both).
//! * Offered rates: `--rate`, or else `--fractions` of each policy's peak (plus 50 % of
//!   padding's peak when both policies run: the comparison point); every policy runs at
//!   every rate with the same arrival times and requests, so latencies compare at equal load.
//! * On the CPU: the PyTorch peer ([`crate::bench_peer`]; seq2seq and treelstm: the same model
//!   and requests, and a check of its outputs against libserve's) runs first; every policy also
//!   runs at its offered rates, and the ratios against it are printed.
//!
//! A random seq2seq decoder almost never emits `eos` on its own (greedy decoding settles on a
//! few tokens), so every decode would run to `max_decode`. To make decode lengths vary as in
//! translation, `--eos-bias auto` (the default for a random model) adds a constant to
//! `decoder.proj.bias[eos]`, found by bisection on a sample of sources so that the mean decode
//! is about half of `max_decode`. The model is the same for both policies; the bias is reported.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use serve::model::{DECODER, Lstm, NO_TOKEN, Seq2Seq, TreeLstm};
use serve::runtime::DEFAULT_ADMISSION_BOUND;
use serve::workload::{TREEBANK_MAX_NODES, WMT_MAX_LEN, treebank_trees, wmt_lengths};
use serve::{
    BackendKind, BucketOrder, CellularOptions, Input, ModelKind, ModelOptions, Network, Output,
    PaddingConfig, PolicyConfig, SubmitOptions,
};

use crate::bench::{
    Capacity, PolicySpec, RunResult, Workload, fmt_ratio, measure_capacity, open_report, print_header,
    print_row, ratio, requests_per_run, run_open_loop, start_model, write_report,
};
use crate::bench_alone::measure_alone;
use crate::bench_peer::{self, PeerPlan};
use crate::{
    BenchRnnArgs, CliResult, EosBias, PolicyArg, RnnPolicyArgs, RuntimeArgs, build_runtime, compute_threads,
    fatal,
};

/// Distinct requests generated per benchmark (cycled).
pub(crate) const RNN_INPUTS: usize = 4096;
/// Hidden size at CPU scale (ARCHITECTURE.md §8).
pub(crate) const CPU_HIDDEN: usize = 256;
/// Hidden size at GPU scale (the papers').
pub(crate) const GPU_HIDDEN: usize = 1024;
/// Default seq2seq `bos`, `eos`; sources use tokens from [`FIRST_SOURCE_TOKEN`] on (0 = pad).
const BOS: u32 = 1;
const EOS: u32 = 2;
const FIRST_SOURCE_TOKEN: u32 = 3;
/// Sources decoded per trial of the `eos` bias calibration.
const EOS_SAMPLE: usize = 32;
/// The calibration aims at a mean decode of this fraction of `max_decode`.
const EOS_TARGET_FRACTION: f64 = 0.5;
/// Smallest and largest default closed-loop window (the largest is the admission bound).
const MIN_WINDOW: usize = 256;
/// Warm-up requests (one round) before each measured run.
const WARMUP: usize = 32;

/// The benchmarks' model kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum RnnKind {
    Lstm,
    #[value(name = "seq2seq")]
    Seq2Seq,
    #[value(name = "treelstm")]
    TreeLstm,
}

impl RnnKind {
    fn model_kind(self) -> ModelKind {
        match self {
            RnnKind::Lstm => ModelKind::Lstm,
            RnnKind::Seq2Seq => ModelKind::Seq2Seq,
            RnnKind::TreeLstm => ModelKind::TreeLstm,
        }
    }
    pub(crate) fn name(self) -> &'static str {
        self.model_kind().name()
    }
    pub(crate) fn workload(self) -> &'static str {
        match self {
            RnnKind::Lstm | RnnKind::Seq2Seq => "poisson/wmt",
            RnnKind::TreeLstm => "poisson/treebank",
        }
    }
}

/// Sizes of a recurrent network (layers 0 for a treelstm).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Sizes {
    pub(crate) vocab: usize,
    pub(crate) embed: usize,
    pub(crate) hidden: usize,
    pub(crate) layers: usize,
}

fn sizes_of(net: &Network) -> Sizes {
    match net {
        Network::Lstm(m) => {
            Sizes { vocab: m.cfg.vocab, embed: m.cfg.embed, hidden: m.cfg.hidden, layers: m.cfg.layers }
        }
        Network::Seq2Seq(m) => {
            Sizes { vocab: m.cfg.vocab, embed: m.cfg.embed, hidden: m.cfg.hidden, layers: m.cfg.layers }
        }
        Network::TreeLstm(m) => {
            Sizes { vocab: m.cfg.vocab, embed: m.cfg.embed, hidden: m.cfg.hidden, layers: 0 }
        }
        Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => {
            Sizes { vocab: 0, embed: 0, hidden: 0, layers: 0 }
        }
    }
}

fn scale_note(hidden: usize) -> String {
    let scale = match hidden {
        CPU_HIDDEN => "CPU scale (hidden 256)".to_string(),
        GPU_HIDDEN => "GPU scale (hidden 1024)".to_string(),
        h => format!("custom scale (hidden {h})"),
    };
    format!(
        "{scale}; ARCHITECTURE.md §8: CPU scale h=256 (the CPU default), GPU scale h=1024 (the papers'; --hidden 1024)"
    )
}

/// Floating-point operations of one LSTM stack step: `2·4H·(in+H)` per layer.
fn lstm_step_flops(embed: usize, hidden: usize, layers: usize) -> f64 {
    (0..layers).map(|l| 8.0 * hidden as f64 * ((if l == 0 { embed } else { hidden }) + hidden) as f64).sum()
}

/// The network under test: from `--model-dir`, or random. Returns it, its name, and where it
/// came from (for the report).
fn build_network(
    kind: RnnKind,
    a: &BenchRnnArgs,
    backend: BackendKind,
) -> CliResult<(Network, String, Value)> {
    let misplaced = |flag: &str, only: &str| {
        Err(fatal(format!("{flag} applies to {only}; `bench {}` does not take it", kind.name())))
    };
    if kind == RnnKind::TreeLstm && a.random.layers.is_some() {
        return misplaced("--layers", "lstm and seq2seq");
    }
    if kind != RnnKind::Seq2Seq && (a.random.max_decode.is_some() || a.eos_bias.is_some()) {
        return misplaced(
            if a.random.max_decode.is_some() { "--max-decode" } else { "--eos-bias" },
            "seq2seq",
        );
    }
    if let Some(dir) = &a.model_dir {
        let net = serve::model::load(dir)
            .map_err(|e| fatal(format!("cannot load model {}: {e}", dir.display())))?;
        if net.kind() != kind.model_kind() {
            return Err(fatal(format!(
                "{} holds a `{}` model; `bench {}` needs a `{}` model",
                dir.display(),
                net.kind(),
                kind.name(),
                kind.name()
            )));
        }
        let name = dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
        let source = json!(dir.display().to_string());
        return Ok((net, name, source));
    }
    let hidden = a.hidden.unwrap_or(if backend == BackendKind::Cuda { GPU_HIDDEN } else { CPU_HIDDEN });
    let net = random_network(
        kind,
        a.random.vocab,
        hidden,
        a.embed.unwrap_or(hidden),
        a.random.layers,
        a.random.max_decode,
        a.seed,
    )?;
    Ok((net, format!("random-{}", kind.name()), json!(format!("random(seed={})", a.seed))))
}

/// The benchmarks' random model of `kind` (`layers` default 1, `max_decode` default
/// [`crate::DEFAULT_MAX_DECODE`]; a treelstm takes TreeBank-like trees).
pub(crate) fn random_network(
    kind: RnnKind,
    vocab: usize,
    hidden: usize,
    embed: usize,
    layers: Option<usize>,
    max_decode: Option<usize>,
    seed: u64,
) -> CliResult<Network> {
    let layers = layers.unwrap_or(1);
    Ok(match kind {
        RnnKind::Lstm => Network::Lstm(Lstm::random(vocab, embed, hidden, layers, seed)),
        RnnKind::Seq2Seq => {
            if vocab <= FIRST_SOURCE_TOKEN as usize {
                return Err(fatal(format!(
                    "--vocab {vocab} is too small for seq2seq: tokens 0 (pad), {BOS} (bos) and {EOS} (eos) are \
                     reserved, sources need at least one more"
                )));
            }
            let max_decode = max_decode.unwrap_or(crate::DEFAULT_MAX_DECODE);
            Network::Seq2Seq(Seq2Seq::random(vocab, embed, hidden, layers, BOS, EOS, max_decode, seed))
        }
        RnnKind::TreeLstm => {
            let mut m = TreeLstm::random(vocab, embed, hidden, seed);
            // Padding sizes its tree buffers for batch × the largest tree up front: say how large
            // the workload's trees get.
            m.cfg.max_nodes = Some(TREEBANK_MAX_NODES);
            Network::TreeLstm(m)
        }
    })
}

/// The requests: WMT-like token sequences or TreeBank-like trees within the model's limits.
fn make_inputs(net: &Network, seed: u64) -> CliResult<Vec<Input>> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7e57_1a9e);
    let seq = |vocab: usize, first: u32, max_len: usize, rng: &mut StdRng| -> Vec<Input> {
        let first = if vocab > first as usize { first } else { 0 };
        wmt_lengths(RNN_INPUTS, seed)
            .into_iter()
            .map(|len| {
                Input::Tokens((0..len.min(max_len)).map(|_| rng.random_range(first..vocab as u32)).collect())
            })
            .collect()
    };
    let inputs = match net {
        Network::Lstm(m) => seq(m.cfg.vocab, 0, m.max_len(), &mut rng),
        Network::Seq2Seq(m) => seq(m.cfg.vocab, FIRST_SOURCE_TOKEN, m.max_len(), &mut rng),
        Network::TreeLstm(m) => treebank_trees(RNN_INPUTS, seed)
            .into_iter()
            .filter(|parents| parents.len() <= m.max_nodes())
            .map(|parents| {
                let mut leaf = vec![true; parents.len()];
                for &p in &parents {
                    if p >= 0 {
                        leaf[p as usize] = false;
                    }
                }
                let tokens = leaf
                    .iter()
                    .map(|&l| if l { rng.random_range(0..m.cfg.vocab as u32) } else { NO_TOKEN })
                    .collect();
                Input::Tree { tokens, parents }
            })
            .collect(),
        Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => Vec::new(),
    };
    if inputs.is_empty() {
        return Err(fatal("no request of the workload fits the model (its max_nodes is too small)"));
    }
    Ok(inputs)
}

/// Cells a request unfolds into, and (trees) leaves.
fn input_size(input: &Input) -> (usize, usize) {
    match input {
        Input::Tokens(t) => (t.len(), t.len()),
        Input::Tree { tokens, .. } => (tokens.len(), tokens.len().div_ceil(2)),
        Input::F32(_) => (0, 0),
    }
}

/// The padding baseline as a framework's bucketing server on `threads` CPU threads would run it,
/// the honest baseline of issue 19 (`serve bench` on the CPU; the simulator and CUDA keep
/// [`PaddingConfig::default`], the BatchMaker paper's: one worker, round-robin buckets, 64): the
/// bucket whose first request came first, up to 256 requests (the PyTorch peer's largest), and
/// one worker per thread. A padded batch of fewer than 64 h = 256 rows runs on its worker's
/// thread alone (waking the pool costs more: `gemm::PARALLEL_TASK_MIN_MACS`), so one worker left
/// the second core idle and fell behind from half of PyTorch's peak (measured on 2 cores, 3,400
/// req/s: p50 26–50 ms with one worker, 1.4–3.9 ms with two).
pub(crate) fn cpu_framework_padding(threads: usize) -> PaddingConfig {
    PaddingConfig {
        workers: threads.max(1),
        max_batch: 256,
        order: BucketOrder::OldestHead,
        ..PaddingConfig::default()
    }
}

/// The padding defaults a bench ran with, as its JSON report records them (`padding_defaults`).
fn padding_defaults_json(d: &PaddingConfig) -> Value {
    json!({"workers": d.workers, "max_batch": d.max_batch, "oldest_first": d.order == BucketOrder::OldestHead})
}

/// The padding defaults recorded in a bench report (`serve sim --compare`); a report without
/// them ran the paper's.
pub(crate) fn padding_defaults_of(report: &Value) -> PaddingConfig {
    let paper = PaddingConfig::default();
    let Some(d) = report.get("padding_defaults") else { return paper };
    PaddingConfig {
        workers: d["workers"].as_u64().map_or(paper.workers, |w| w as usize),
        max_batch: d["max_batch"].as_u64().map_or(paper.max_batch, |b| b as usize),
        order: if d["oldest_first"].as_bool() == Some(true) { BucketOrder::OldestHead } else { paper.order },
        ..paper
    }
}

/// The policies under test, in `--policy` order (default: cellular, then padding).
pub(crate) fn policy_specs(
    a: &RnnPolicyArgs,
    net: &Network,
    padding: &PaddingConfig,
) -> CliResult<Vec<PolicySpec>> {
    let mut policies = a.policy.clone();
    if policies.is_empty() {
        policies = vec![PolicyArg::Cellular, PolicyArg::Padding];
    }
    // Each policy once, in the order first given.
    let mut seen = Vec::new();
    policies.retain(|p| {
        !seen.contains(p) && {
            seen.push(*p);
            true
        }
    });
    let types = net.cell_types();
    let mut specs = Vec::new();
    for p in &policies {
        let (label, config, biggest) = match p {
            PolicyArg::Cellular => {
                let per_type: Vec<usize> = match a.max_batch.len() {
                    0 => (0..types.len())
                        .map(|i| {
                            if net.kind() == ModelKind::Seq2Seq && i == usize::from(DECODER) {
                                CellularOptions::DEFAULT_MAX_BATCH / 2
                            } else {
                                CellularOptions::DEFAULT_MAX_BATCH
                            }
                        })
                        .collect(),
                    1 => vec![a.max_batch[0]; types.len()],
                    n if n == types.len() => a.max_batch.clone(),
                    n => {
                        return Err(fatal(format!(
                            "--max-batch has {n} values; cellular batching of a {} takes one per cell type ({}: {})",
                            net.kind(),
                            types.len(),
                            types.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")
                        )));
                    }
                };
                let b = if per_type.windows(2).all(|w| w[0] == w[1]) {
                    per_type.first().map_or_else(String::new, usize::to_string)
                } else {
                    per_type.iter().map(usize::to_string).collect::<Vec<_>>().join("/")
                };
                let workers = a.workers.unwrap_or(1);
                let k = a
                    .max_tasks_to_submit
                    .unwrap_or_else(|| CellularOptions::default_max_tasks_to_submit(net.kind()));
                let mut label = format!("cellular(b={b},k={k}");
                if workers != 1 {
                    label.push_str(&format!(",w={workers}"));
                }
                label.push(')');
                let biggest = per_type.iter().copied().max().unwrap_or(1) * workers;
                let opts = CellularOptions { workers, max_batch: per_type, max_tasks_to_submit: Some(k) };
                (label, PolicyConfig::Cellular(opts), biggest)
            }
            PolicyArg::Padding => {
                let max_batch = match a.max_batch[..] {
                    [] => padding.max_batch,
                    [b] => b,
                    _ => {
                        return Err(fatal(
                            "padding batches whole requests: --max-batch takes a single value with --policy padding \
                             (per-cell-type lists are for cellular)",
                        ));
                    }
                };
                let workers = a.workers.unwrap_or(padding.workers);
                let k = a.max_tasks_to_submit.unwrap_or(padding.max_tasks_to_submit);
                let cfg = PaddingConfig {
                    bucket_width: a.bucket_width,
                    max_batch,
                    workers,
                    max_tasks_to_submit: k,
                    // Set from the model (its widest tree level) when the runtime builds the policy.
                    level_width: 1,
                    // All of a batch's steps in one task where the backend runs them so.
                    max_steps: a.padding_steps,
                    order: a.bucket_order.map_or(padding.order, Into::into),
                };
                let mut label = format!("padding(b={max_batch},bucket={},k={k}", a.bucket_width);
                if cfg.order == BucketOrder::OldestHead {
                    label.push_str(",oldest");
                }
                if a.padding_steps != u32::MAX {
                    label.push_str(&format!(",steps={}", a.padding_steps));
                }
                if workers != 1 {
                    label.push_str(&format!(",w={workers}"));
                }
                label.push(')');
                (label, PolicyConfig::Padding(cfg), max_batch * workers)
            }
        };
        specs.push((label, config, biggest));
    }
    // One closed-loop window for every policy: 4× the largest batch, within the admission bound.
    let window = match a.capacity_window {
        Some(w) => w,
        None => specs
            .iter()
            .map(|s| 4 * s.2)
            .max()
            .unwrap_or(MIN_WINDOW)
            .clamp(MIN_WINDOW, DEFAULT_ADMISSION_BOUND),
    };
    if window > DEFAULT_ADMISSION_BOUND {
        return Err(fatal(format!(
            "--capacity-window {window} is more than the admission bound of {DEFAULT_ADMISSION_BOUND} requests"
        )));
    }
    Ok(specs
        .into_iter()
        .map(|(label, config, _)| PolicySpec { label, config, warmup: WARMUP, warmup_rounds: 1, window })
        .collect())
}

/// Mean decode length of the first sources of `inputs` with `bias` added to `proj.bias[eos]`.
fn mean_decode(base: &Seq2Seq, bias: f32, rt: RuntimeArgs, inputs: &[Input]) -> CliResult<f64> {
    let mut m = base.clone();
    m.proj_bias[m.cfg.eos as usize] += bias;
    let rt = build_runtime(rt)?;
    let model =
        rt.add_network(Arc::new(Network::Seq2Seq(m)), "eos-calibration".into(), ModelOptions::default())?;
    let tickets = inputs
        .iter()
        .take(EOS_SAMPLE)
        .map(|x| model.submit(x.clone(), SubmitOptions::default()))
        .collect::<serve::Result<Vec<_>>>()?;
    let mut total = 0usize;
    let n = tickets.len().max(1);
    for t in tickets {
        match t.wait().map_err(|e| fatal(format!("eos calibration request failed: {e}")))? {
            Output::Tokens(t) => total += t.len(),
            Output::F32(_) => return Err(fatal("a seq2seq model returned floats")),
        }
    }
    Ok(total as f64 / n as f64)
}

/// The bias on `proj.bias[eos]` for which the mean decode is about `target` tokens: doubling
/// then bisection on [`mean_decode`] (which falls as the bias grows).
fn calibrate_eos_bias(
    base: &Seq2Seq,
    rt: RuntimeArgs,
    inputs: &[Input],
    target: f64,
) -> CliResult<(f32, f64)> {
    let mut lo = 0.0f32;
    let mut lo_len = mean_decode(base, lo, rt, inputs)?;
    if lo_len <= target {
        return Ok((0.0, lo_len));
    }
    let mut hi = 0.25f32;
    let mut hi_len = mean_decode(base, hi, rt, inputs)?;
    while hi_len > target && hi < 64.0 {
        (lo, lo_len) = (hi, hi_len);
        hi *= 2.0;
        hi_len = mean_decode(base, hi, rt, inputs)?;
    }
    for _ in 0..5 {
        let mid = (lo + hi) / 2.0;
        let len = mean_decode(base, mid, rt, inputs)?;
        if len > target {
            (lo, lo_len) = (mid, len);
        } else {
            (hi, hi_len) = (mid, len);
        }
    }
    Ok(if (lo_len - target).abs() < (hi_len - target).abs() { (lo, lo_len) } else { (hi, hi_len) })
}

/// libserve's outputs of the first `n` distinct requests under `spec` (the PyTorch peer's check).
fn libserve_outputs(work: &Workload, spec: &PolicySpec, n: usize) -> CliResult<Vec<Output>> {
    let (rt, model) = start_model(work, spec)?;
    let mut out = Vec::with_capacity(n);
    for chunk in work.inputs[..n.min(work.inputs.len())].chunks(spec.window.max(1)) {
        let tickets = chunk
            .iter()
            .map(|x| model.submit(x.clone(), SubmitOptions::default()))
            .collect::<serve::Result<Vec<_>>>()?;
        for t in tickets {
            out.push(t.wait().map_err(|e| fatal(format!("request for the peer's check failed: {e}")))?);
        }
    }
    drop(model);
    drop(rt);
    Ok(out)
}

/// One offered rate and why it is in the list.
struct Rate {
    rps: f64,
    notes: Vec<String>,
}

pub(crate) fn cmd_bench_rnn(kind: RnnKind, a: BenchRnnArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let measure_peak = a.measure_peak.unwrap_or(a.rate.is_empty());
    if !measure_peak && a.rate.is_empty() {
        return Err(fatal(
            "--measure-peak false needs --rate (offered rates are fractions of the peaks otherwise)",
        ));
    }
    let report_file = open_report(a.json.as_ref())?;
    let (backend, backend_desc) = {
        let rt = build_runtime(a.rt)?;
        (rt.backend_kind(), rt.backend_description())
    };
    let (mut net, name, source) = build_network(kind, &a, backend)?;
    let inputs = make_inputs(&net, a.seed)?;
    let sizes = sizes_of(&net);
    let padding_defaults = match backend {
        BackendKind::Cpu => cpu_framework_padding(compute_threads(a.rt.threads)),
        _ => PaddingConfig::default(),
    };
    let specs = policy_specs(&a.pol, &net, &padding_defaults)?;

    println!("# serve bench {}: workload poisson arrivals (open loop), backend {backend_desc}", kind.name());
    let n_inputs = inputs.len() as f64;
    let mean_cells = inputs.iter().map(|x| input_size(x).0).sum::<usize>() as f64 / n_inputs;
    let step_mflop = lstm_step_flops(sizes.embed, sizes.hidden, sizes.layers.max(1)) / 1e6;
    let mut model_json = json!({
        "kind": kind.name(), "source": source, "vocab": sizes.vocab, "embed": sizes.embed,
        "hidden": sizes.hidden, "scale": scale_note(sizes.hidden),
    });
    match kind {
        RnnKind::Lstm | RnnKind::Seq2Seq => {
            println!(
                "# requests: WMT-like source lengths (log-normal mean 24, clipped to [1, {WMT_MAX_LEN}]); {} \
                 distinct, mean length {mean_cells:.1}",
                inputs.len()
            );
            model_json["layers"] = json!(sizes.layers);
        }
        RnnKind::TreeLstm => {
            let leaves = inputs.iter().map(|x| input_size(x).1).sum::<usize>() as f64 / n_inputs;
            println!(
                "# requests: TreeBank-like trees (random binary parse trees, leaves log-normal mean 19, clipped \
                 to [1, 100]; leaves carry tokens, internal nodes none); {} distinct, mean {leaves:.1} leaves, \
                 {mean_cells:.1} nodes",
                inputs.len()
            );
        }
    }
    // Seq2seq: make decodes end at eos now and then (see the module comment).
    if let Network::Seq2Seq(m) = &mut net {
        let bias = match (a.eos_bias, a.model_dir.is_some()) {
            (Some(EosBias::Value(b)), _) => Some((b, None)),
            (_, true) => None,
            (None | Some(EosBias::Auto), false) => {
                let target = EOS_TARGET_FRACTION * m.cfg.max_decode as f64;
                let (b, len) = calibrate_eos_bias(m, a.rt, &inputs, target)?;
                Some((b, Some(len)))
            }
        };
        if let Some((b, calibrated)) = bias {
            m.proj_bias[m.cfg.eos as usize] += b;
            let how = match calibrated {
                Some(len) => format!(
                    "calibrated on {EOS_SAMPLE} sources for a mean decode of ~{:.0}% of max_decode: {len:.1} tokens",
                    EOS_TARGET_FRACTION * 100.0
                ),
                None => "--eos-bias".to_string(),
            };
            println!(
                "# seq2seq: bos {}, eos {}, max_decode {}; proj.bias[eos] += {b:.4} ({how}) so decodes vary in \
                 length; random weights alone rarely emit eos",
                m.cfg.bos, m.cfg.eos, m.cfg.max_decode
            );
            model_json["eos_bias"] = json!(b);
        } else {
            println!(
                "# seq2seq: bos {}, eos {}, max_decode {} (the model's own weights, no eos bias)",
                m.cfg.bos, m.cfg.eos, m.cfg.max_decode
            );
        }
        model_json["bos"] = json!(m.cfg.bos);
        model_json["eos"] = json!(m.cfg.eos);
        model_json["max_decode"] = json!(m.cfg.max_decode);
    }
    let work = Workload {
        rt: a.rt,
        net: Arc::new(net),
        name: name.clone(),
        inputs,
        qos: a.qos_ms.map(|ms| Duration::from_secs_f64(ms / 1e3)),
        token_gates_bytes: a.token_gates_mib.map(|m| m.saturating_mul(1 << 20)),
    };
    let gates = work.token_gates_bytes.unwrap_or(serve::runtime::DEFAULT_TOKEN_GATES_BYTES);
    if work.net.kind() != ModelKind::TreeLstm {
        println!(
            "# token-gate tables: up to {} MiB (CPU backend: a chain's embedding folded into its first layer where \
             its vocab × 4·hidden floats fit; --token-gates-mib)",
            gates >> 20
        );
    }
    let cost = match &*work.net {
        Network::Lstm(_) => format!(" layers {} (LSTM step {step_mflop:.2} MFLOP/row)", sizes.layers),
        Network::Seq2Seq(m) => format!(
            " layers {} (LSTM step {step_mflop:.2} MFLOP/row; a decode step adds the {:.2} MFLOP/row projection)",
            sizes.layers,
            2.0 * (m.cfg.hidden * m.cfg.vocab) as f64 / 1e6
        ),
        _ => String::new(),
    };
    println!(
        "# model: {} `{name}` vocab {} embed {} hidden {}{cost}; {}",
        kind.name(),
        sizes.vocab,
        sizes.embed,
        sizes.hidden,
        scale_note(sizes.hidden)
    );

    // The PyTorch peer first (issue 19, `bench_peer.rs`): its offered rates join libserve's below.
    // Its outputs are checked against cellular's (the policy the comparison is about).
    let check_spec =
        specs.iter().find(|s| matches!(s.config, PolicyConfig::Cellular(_))).unwrap_or(&specs[0]);
    let outputs = |n: usize| libserve_outputs(&work, check_spec, n).map_err(|e| e.0);
    let peer = bench_peer::run(
        &a.peer,
        &PeerPlan {
            kind,
            backend,
            net: &work.net,
            // --model-dir never takes an eos bias: its weights are the bench's.
            model_dir: a.model_dir.as_deref(),
            inputs: &work.inputs,
            outputs: &outputs,
            sizes,
            threads: a.rt.threads,
            seed: a.seed,
            window: specs.first().map_or(MIN_WINDOW, |s| s.window),
            capacity_s: a.capacity_s,
            duration_s: a.duration_s,
            requests: a.requests,
            rates: &a.rate,
        },
    );

    // One request at a time: where a request's time goes at low load.
    let mut alone = Vec::new();
    for spec in &specs {
        let r = measure_alone(&work, spec)?;
        r.print(&spec.label);
        alone.push(r.to_json(&spec.label));
    }

    // Peak throughput of every policy.
    let capacity_time = Duration::from_secs_f64(a.capacity_s);
    let mut peaks: Vec<Option<f64>> = vec![None; specs.len()];
    // The share of the CPU the hypervisor stole while each peak was measured (`steal.rs`).
    let mut peak_steal: Vec<Option<f64>> = vec![None; specs.len()];
    if measure_peak {
        for ((spec, peak), stolen) in specs.iter().zip(&mut peaks).zip(&mut peak_steal) {
            let Capacity { rps: p, steal } = measure_capacity(&work, spec, capacity_time)?;
            *stolen = steal;
            println!(
                "# peak throughput {:<w$} {p:>9.1} rps (closed loop, {} requests in flight, {:.1} s{})",
                spec.label,
                spec.window,
                a.capacity_s,
                crate::steal::note(steal),
                w = 30
            );
            *peak = Some(p);
        }
    }
    let cellular = specs.iter().position(|s| matches!(s.config, PolicyConfig::Cellular(_)));
    let padding = specs.iter().position(|s| matches!(s.config, PolicyConfig::Padding(_)));
    let pair = cellular.zip(padding);
    let peak_ratio = pair.and_then(|(c, p)| peaks[c].zip(peaks[p])).and_then(|(c, p)| ratio(c, p));
    if let Some(r) = peak_ratio {
        println!("# ratio cellular/padding peak throughput: {}", fmt_ratio(Some(r)));
    }

    // Offered rates.
    let mut rates: Vec<Rate> = Vec::new();
    let mut add_rate = |rps: f64, note: Option<String>| {
        let rps = if note.is_some() { rps.round().max(1.0) } else { rps };
        match rates.iter_mut().find(|r| (r.rps - rps).abs() < 0.5) {
            Some(r) => r.notes.extend(note),
            None => rates.push(Rate { rps, notes: note.into_iter().collect() }),
        }
    };
    if a.rate.is_empty() {
        for (spec, peak) in specs.iter().zip(&peaks) {
            let peak = peak.expect("peaks measured without --rate");
            let short = spec.label.split('(').next().unwrap_or("");
            for f in &a.fractions {
                add_rate(f * peak, Some(format!("{f}×{short} peak")));
            }
        }
    } else {
        for &r in &a.rate {
            add_rate(r, None);
        }
    }
    for (rps, f) in peer.offered_rates() {
        add_rate(rps, Some(format!("{}×torch peak", (f * 100.0).round() / 100.0)));
    }
    // The comparison point: half of padding's peak.
    let half_padding = pair.and_then(|(_, p)| peaks[p]).map(|p| (0.5 * p).round().max(1.0));
    if let Some(h) = half_padding
        && a.rate.is_empty()
    {
        add_rate(h, Some("0.5×padding peak".into()));
        for r in &mut rates {
            r.notes.dedup();
        }
    }
    rates.sort_by(|x, y| x.rps.total_cmp(&y.rps));
    let counts = rates
        .iter()
        .map(|r| requests_per_run(a.requests, a.duration_s, r.rps))
        .collect::<CliResult<Vec<_>>>()?;
    let rate_list: Vec<String> = rates
        .iter()
        .map(|r| {
            if r.notes.is_empty() {
                format!("{:.1}", r.rps)
            } else {
                format!("{:.1} ({})", r.rps, r.notes.join(", "))
            }
        })
        .collect();
    println!("# offered rates (rps): {}", rate_list.join("; "));

    print_header(work.qos.is_some(), kind == RnnKind::Seq2Seq);
    let mut results: Vec<RunResult> = Vec::new();
    let mut comparisons = Vec::new();
    let mut ratio_lines = Vec::new();
    let mut p90_at_half = None;
    for (k, (rate, &n)) in rates.iter().zip(&counts).enumerate() {
        let seed = a.seed.wrapping_add(1 + k as u64);
        let mut row: Vec<RunResult> = Vec::new();
        for (spec, peak) in specs.iter().zip(&peaks) {
            let mut r = run_open_loop(&work, spec, rate.rps, n, seed)?;
            if let Some(p) = peak {
                r.extra.insert("peak_rps".into(), json!(p));
                r.extra.insert("fraction_of_peak".into(), json!(rate.rps / p));
            }
            print_row(&r);
            row.push(r);
        }
        peer.rows_at(rate.rps).for_each(print_row);
        if let Some((c, p)) = pair {
            let (cr, pr) = (&row[c], &row[p]);
            let tr = ratio(cr.throughput_rps, pr.throughput_rps);
            let (r50, r90, r99) =
                (ratio(cr.p50_ms, pr.p50_ms), ratio(cr.p90_ms, pr.p90_ms), ratio(cr.p99_ms, pr.p99_ms));
            let note =
                if rate.notes.is_empty() { String::new() } else { format!(" ({})", rate.notes.join(", ")) };
            ratio_lines.push(format!(
                "# ratio cellular/padding at {:.1} rps{note}: throughput {}, p50 {}, p90 {}, p99 {}",
                rate.rps,
                fmt_ratio(tr),
                fmt_ratio(r50),
                fmt_ratio(r90),
                fmt_ratio(r99)
            ));
            if half_padding.is_some_and(|h| (h - rate.rps).abs() < 0.5) {
                p90_at_half = Some((rate.rps, r90));
            }
            comparisons.push(json!({
                "offered_rps": rate.rps, "policy": cr.policy, "baseline": pr.policy, "throughput_ratio": tr,
                "p50_ratio": r50, "p90_ratio": r90, "p99_ratio": r99, "rate_notes": rate.notes,
            }));
        }
        results.extend(row);
    }
    for l in &ratio_lines {
        println!("{l}");
    }
    if let Some(r) = peak_ratio {
        println!(
            "# summary: peak throughput cellular/padding {} (goal ≥ 1.30x: {})",
            fmt_ratio(Some(r)),
            if r >= 1.3 { "met" } else { "NOT met" }
        );
    }
    if let Some((rps, r90)) = p90_at_half {
        let verdict = match r90 {
            Some(x) if x <= 0.5 => "met",
            Some(_) => "NOT met",
            None => "n/a",
        };
        println!(
            "# summary: p90 cellular/padding at 50% of padding's peak ({rps:.1} rps) {} (goal ≤ 0.50x: {verdict})",
            fmt_ratio(r90)
        );
    }
    peer.print_rows_apart(&rates.iter().map(|r| r.rps).collect::<Vec<_>>());
    let side = |i: Option<usize>| i.map(|i| (specs[i].label.as_str(), peaks[i]));
    let peer_ratios = peer.summarize(side(cellular), side(padding), &results);
    println!("# {} run(s) in {:.1} s", results.len(), t0.elapsed().as_secs_f64());
    if let Some(svg) = &a.svg {
        let plotted: Vec<RunResult> = results.iter().cloned().chain(peer.best_rows()).collect();
        crate::plot::latency_svg(svg, &format!("serve bench {} ({backend_desc})", kind.name()), &plotted)?;
    }

    if let Some((path, file)) = report_file {
        let peaks_json: Vec<Value> = specs
            .iter()
            .zip(peaks.iter().zip(&peak_steal))
            .filter_map(|(s, (p, stolen))| {
                let mut v = json!({"policy": s.label, "peak_rps": (*p)?, "window": s.window});
                if let (Some(stolen), Some(obj)) = (stolen, v.as_object_mut()) {
                    obj.insert("steal".into(), json!(stolen));
                }
                Some(v)
            })
            .collect();
        let report = json!({
            "workload": kind.workload(),
            "backend": backend.to_string(),
            "backend_description": backend_desc,
            // The padding baseline's defaults follow from these (`serve sim --compare` reads them).
            "padding_defaults": padding_defaults_json(&padding_defaults),
            "model": model_json,
            "requests": {"distinct": work.inputs.len(), "mean_cells": mean_cells},
            "qos_ms": a.qos_ms,
            "peaks": peaks_json,
            "alone": alone,
            "peak_ratio": peak_ratio,
            "p90_ratio_at_half_padding_peak": p90_at_half.and_then(|x| x.1),
            "results": results.iter().map(RunResult::to_json).collect::<Vec<_>>(),
            "comparisons": comparisons,
            "peer": peer.to_json(peer_ratios),
        });
        write_report(&path, file, &report)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_flops_count_every_layer() {
        assert_eq!(lstm_step_flops(256, 256, 1), 8.0 * 256.0 * 512.0);
        assert_eq!(lstm_step_flops(128, 256, 2), 8.0 * 256.0 * 384.0 + 8.0 * 256.0 * 512.0);
    }

    #[test]
    fn inputs_follow_the_workloads() {
        let lstm = Network::Lstm(Lstm::random(50, 4, 4, 1, 1));
        let xs = make_inputs(&lstm, 3).unwrap();
        assert_eq!(xs.len(), RNN_INPUTS);
        let mean = xs.iter().map(|x| input_size(x).0).sum::<usize>() as f64 / xs.len() as f64;
        assert!((mean - 24.0).abs() < 1.5, "mean length {mean}");
        for x in &xs {
            lstm.validate(x).unwrap();
        }
        let tree = {
            let mut m = TreeLstm::random(50, 4, 4, 1);
            m.cfg.max_nodes = Some(TREEBANK_MAX_NODES);
            Network::TreeLstm(m)
        };
        let ts = make_inputs(&tree, 3).unwrap();
        for t in &ts {
            tree.validate(t).unwrap();
            let Input::Tree { tokens, parents } = t else { panic!("a tree") };
            for (i, tok) in tokens.iter().enumerate() {
                let is_leaf = !parents.contains(&(i as i32));
                assert_eq!(*tok == NO_TOKEN, !is_leaf, "leaves carry tokens, internal nodes none");
            }
        }
        let s2s = Network::Seq2Seq(Seq2Seq::random(10, 4, 4, 1, BOS, EOS, 5, 1));
        for x in make_inputs(&s2s, 1).unwrap() {
            let Input::Tokens(t) = x else { panic!("tokens") };
            assert!(t.iter().all(|v| (FIRST_SOURCE_TOKEN..10).contains(v)));
        }
    }
}
