//! `serve bench layers resnet50|bert-base|…` (ARCHITECTURE.md §8): a layer model's time per batch
//! on libserve's CPU backend (or CUDA with `--backend cuda`) against PyTorch's on the same machine
//! and device, in the same run, with the same thread count, batch sizes and input shapes (random
//! weights: the time does not depend on them). On CUDA both sides compute in FP32 with TF32 off.
//!
//! libserve's side prepares the model on a CPU backend of `--threads` threads and times whole-model
//! tasks on one worker (launched back to back, a round waited for once, collected: the backend's
//! compute, no scheduling); PyTorch's side is `scripts/torch_layer_bench.py`, embedded in this
//! binary and run as `PYTHON - ARGS` (torchvision's ResNet / transformers' `BertModel` in eval
//! mode under `torch.inference_mode()`). The order is libserve, PyTorch, libserve again, and
//! libserve's figure is the mean of its two passes, so a drifting machine affects both sides
//! alike. The ratio printed is throughput (requests per second), libserve over PyTorch.
//! Without a python that imports torch (and torchvision / transformers) the PyTorch column says
//! why it is missing and no ratio is printed.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, ValueEnum};
use serde_json::{Value, json};

use serve::backend::{RunnerShape, TaskData, Work};
use serve::model::bert::{Bert, BertConfig};
use serve::model::resnet::{ResNet, ResNetConfig};
use serve::runtime::MAX_CPU_THREADS;
use serve::{BackendChoice, Network};

use crate::bench::{open_report, write_report};
use crate::profile::{layer_batch, run_round};
use crate::{BackendArg, CliResult, compute_threads, fatal, in_range, seconds};

/// The layer models `serve bench layers` times (torchvision's and Hugging Face's configurations).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LayerModelArg {
    Resnet18,
    Resnet34,
    Resnet50,
    Resnet101,
    Resnet152,
    BertBase,
}

impl LayerModelArg {
    /// torchvision's function name, or `bert-base`.
    pub(crate) fn torch_name(self) -> &'static str {
        match self {
            LayerModelArg::Resnet18 => "resnet18",
            LayerModelArg::Resnet34 => "resnet34",
            LayerModelArg::Resnet50 => "resnet50",
            LayerModelArg::Resnet101 => "resnet101",
            LayerModelArg::Resnet152 => "resnet152",
            LayerModelArg::BertBase => "bert-base",
        }
    }
}

/// `C,H,W` of an image (each 1..=4096, C ≤ 1024).
fn image_dims(s: &str) -> Result<[usize; 3], String> {
    let v: Vec<usize> = s
        .split(',')
        .map(|p| p.trim().parse::<usize>().map_err(|e| format!("`{p}`: {e}")))
        .collect::<Result<_, _>>()?;
    match v[..] {
        [c, h, w] if (1..=1024).contains(&c) && (1..=4096).contains(&h) && (1..=4096).contains(&w) => {
            Ok([c, h, w])
        }
        _ => Err(format!("`{s}`: expected C,H,W with C in 1..=1024 and H, W in 1..=4096")),
    }
}

#[derive(Args, Debug)]
pub(crate) struct BenchLayersArgs {
    /// The model (random weights).
    #[arg(value_enum)]
    pub(crate) model: LayerModelArg,
    /// Batch sizes to time (at most 1024 each).
    #[arg(long, value_delimiter = ',', num_args = 1.., default_values_t = [1, 8], value_parser = in_range(1, 1024))]
    pub(crate) batches: Vec<usize>,
    /// ResNet input image `C,H,W`.
    #[arg(long, default_value = "3,224,224", value_parser = image_dims)]
    pub(crate) image: [usize; 3],
    /// BERT request length in tokens (every request this long).
    #[arg(long, default_value_t = 128)]
    pub(crate) seq_len: usize,
    /// Compute threads of both sides (0 = one per core; at most 1024).
    #[arg(long, default_value_t = 0, value_parser = in_range(0, MAX_CPU_THREADS))]
    pub(crate) threads: usize,
    /// Seconds of timed rounds per batch size and side (at most 3600).
    #[arg(long, default_value_t = 2.0, value_parser = seconds)]
    pub(crate) min_time: f64,
    /// The Python interpreter with torch (and torchvision, transformers) for PyTorch's side.
    #[arg(long, default_value = "python3")]
    pub(crate) python: PathBuf,
    /// Time libserve only.
    #[arg(long)]
    pub(crate) no_torch: bool,
    /// The backend of both sides: cpu, or cuda (device 0; PyTorch on the same GPU).
    #[arg(long, value_enum, default_value_t = BackendArg::Cpu)]
    pub(crate) backend: BackendArg,
    /// Write the results as one JSON object to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

/// PyTorch's side, run by `PYTHON -`.
const TORCH_SCRIPT: &str = include_str!("../../../scripts/torch_layer_bench.py");

/// Timed rounds per batch size (the median is kept).
const ROUNDS: usize = 5;

/// The random model of a named configuration.
fn network(a: &BenchLayersArgs) -> CliResult<Network> {
    let resnet = |block: &str, layers: [usize; 4]| -> CliResult<Network> {
        let cfg = ResNetConfig {
            name: None,
            block: block.into(),
            layers,
            num_classes: 1000,
            image: a.image,
            width: None,
        };
        cfg.check(std::path::Path::new("--image")).map_err(|e| fatal(e.to_string()))?;
        Ok(Network::ResNet(ResNet::random(&cfg, 1)))
    };
    Ok(match a.model {
        LayerModelArg::Resnet18 => resnet("basic", [2, 2, 2, 2])?,
        LayerModelArg::Resnet34 => resnet("basic", [3, 4, 6, 3])?,
        LayerModelArg::Resnet50 => resnet("bottleneck", [3, 4, 6, 3])?,
        LayerModelArg::Resnet101 => resnet("bottleneck", [3, 4, 23, 3])?,
        LayerModelArg::Resnet152 => resnet("bottleneck", [3, 8, 36, 3])?,
        LayerModelArg::BertBase => {
            if a.seq_len == 0 || a.seq_len > 512 {
                return Err(fatal(format!(
                    "--seq-len {} is outside 1..=512 (bert-base's positions)",
                    a.seq_len
                )));
            }
            Network::Bert(Bert::random(
                &BertConfig {
                    name: None,
                    vocab: 30522,
                    hidden: 768,
                    layers: 12,
                    heads: 12,
                    intermediate: 3072,
                    max_position: 512,
                    type_vocab: 2,
                    seq_len: a.seq_len,
                    layer_norm_eps: None,
                },
                1,
            ))
        }
    })
}

/// libserve's median milliseconds per batch, for each batch size.
fn time_libserve(
    net: &Arc<Network>,
    batches: &[usize],
    (choice, threads): (BackendChoice, usize),
    min_time: f64,
) -> CliResult<Vec<f64>> {
    let backend = serve::backend::create(choice, threads)?;
    let me = std::thread::current();
    let notify: serve::backend::Notify = Arc::new(move || me.unpark());
    let max_batch = batches.iter().copied().max().unwrap_or(1);
    let runner = backend.prepare(net.clone(), RunnerShape::fixed(1, max_batch), notify)?;
    let run = |rows: usize, input: &[f32], n: usize| -> CliResult<Duration> {
        let tasks: Vec<_> = (0..n).map(|_| TaskData::new(rows, Work::Dense(input.to_vec()))).collect();
        run_round(&*runner, &tasks)
    };
    let mut out = Vec::new();
    for &b in batches {
        let input = layer_batch(net, b);
        let run = |n: usize| run(b, &input, n);
        let once = run(1)?.as_secs_f64();
        let per_round = ((min_time / ROUNDS as f64) / once.max(1e-6)).ceil().max(1.0) as usize;
        let mut rounds: Vec<f64> = (0..ROUNDS)
            .map(|_| run(per_round).map(|d| d.as_secs_f64() * 1e3 / per_round as f64))
            .collect::<CliResult<_>>()?;
        rounds.sort_by(f64::total_cmp);
        out.push(rounds[ROUNDS / 2]);
    }
    Ok(out)
}

/// PyTorch's milliseconds per batch, or why there are none.
fn time_torch(a: &BenchLayersArgs, threads: usize) -> Result<(String, Vec<f64>), String> {
    let model = a.model.torch_name();
    let image = a.image.map(|v| v.to_string()).join(",");
    let batches = a.batches.iter().map(|b| b.to_string()).collect::<Vec<_>>().join(",");
    let mut child = Command::new(&a.python)
        .args(["-", "--model", model, "--image", &image, "--seq-len", &a.seq_len.to_string()])
        .args([
            "--batches",
            &batches,
            "--threads",
            &threads.to_string(),
            "--min-time",
            &a.min_time.to_string(),
        ])
        .args(["--device", if a.backend == BackendArg::Cuda { "cuda" } else { "cpu" }])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {}: {e}", a.python.display()))?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(TORCH_SCRIPT.as_bytes())
        .map_err(|e| format!("cannot send the script to {}: {e}", a.python.display()))?;
    let out = child.wait_with_output().map_err(|e| format!("{}: {e}", a.python.display()))?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        let last = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim();
        return Err(format!("{} failed ({}): {last}", a.python.display(), out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(text.lines().last().unwrap_or(""))
        .map_err(|e| format!("unreadable output from the PyTorch script: {e}"))?;
    let ms: Vec<f64> =
        v["results"].as_array().ok_or("no results")?.iter().filter_map(|r| r["ms"].as_f64()).collect();
    if ms.len() != a.batches.len() {
        return Err("the PyTorch script timed a different set of batches".into());
    }
    Ok((format!("torch {}", v["torch"].as_str().unwrap_or("?")), ms))
}

pub(crate) fn cmd_bench_layers(a: BenchLayersArgs) -> CliResult<()> {
    let report_file = open_report(a.json.as_ref())?;
    let threads = compute_threads(a.threads);
    let net = Arc::new(network(&a)?);
    let gflop = net.layers().iter().map(|l| l.flops_per_row).sum::<u64>() as f64 / 1e9;
    println!(
        "# serve bench layers {}: {} layers, {:.2} GFLOP per request ({}), {threads} thread(s), batches {:?}",
        a.model.torch_name(),
        net.layers().len(),
        gflop,
        match &*net {
            Network::Bert(m) => format!("{} tokens", m.cfg.seq_len),
            _ => format!("image {:?}", a.image),
        },
        a.batches
    );
    let choice = if a.backend == BackendArg::Cuda { BackendChoice::Cuda } else { BackendChoice::Cpu };
    let backend = serve::backend::create(choice, threads)?.describe();
    println!("# libserve backend: {backend}");
    let first = time_libserve(&net, &a.batches, (choice, threads), a.min_time)?;
    let torch = if a.no_torch { Err("--no-torch".to_string()) } else { time_torch(&a, threads) };
    let second = time_libserve(&net, &a.batches, (choice, threads), a.min_time)?;
    let ours: Vec<f64> = first.iter().zip(&second).map(|(x, y)| (x + y) / 2.0).collect();
    let torch_label = match &torch {
        Ok((v, _)) => v.clone(),
        Err(why) => format!("PyTorch not measured: {why}"),
    };
    println!("# PyTorch: {torch_label}");
    println!(
        "{:>6} {:>14} {:>14} {:>12} {:>12} {:>10} {:>14}",
        "batch", "libserve_ms", "pytorch_ms", "libserve_rps", "pytorch_rps", "ratio", "libserve_GF/s"
    );
    let mut results = Vec::new();
    for (k, &b) in a.batches.iter().enumerate() {
        let t = torch.as_ref().ok().map(|(_, ms)| ms[k]);
        let (rps, trps) = (b as f64 * 1e3 / ours[k], t.map(|t| b as f64 * 1e3 / t));
        let ratio = trps.map(|tr| rps / tr);
        println!(
            "{b:>6} {:>14.2} {:>14} {rps:>12.2} {:>12} {:>10} {:>14.1}",
            ours[k],
            t.map_or("-".into(), |t| format!("{t:.2}")),
            trps.map_or("-".into(), |r| format!("{r:.2}")),
            ratio.map_or("-".into(), |r| format!("{r:.3}x")),
            gflop * b as f64 * 1e3 / ours[k]
        );
        results.push(json!({
            "name": a.model.torch_name(), "batch": b, "libserve_ms": ours[k], "libserve_passes_ms": [first[k], second[k]],
            "pytorch_ms": t, "ratio": ratio, "gflops": gflop * b as f64 * 1e3 / ours[k],
        }));
    }
    if torch.is_ok() {
        println!(
            "# ratio: throughput libserve / PyTorch, same threads and shapes (goal ≥ 1.0x, target 1.2x)"
        );
    }
    if let Some((path, file)) = report_file {
        let report = json!({
            "workload": "layers",
            "backend": if choice == BackendChoice::Cuda { "cuda" } else { "cpu" },
            "backend_description": backend,
            "threads": threads,
            "pytorch": torch_label,
            "results": results,
        });
        write_report(&path, file, &report)?;
    }
    Ok(())
}
