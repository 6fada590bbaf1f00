//! `serve bench step --model lstm …` (ARCHITECTURE.md §8 micro-benchmark): one batched LSTM layer step as
//! the CPU backend runs it for cellular batching — gather `[x | h_prev]` from the state arena,
//! one GEMM against `[W_ih | W_hh]ᵀ`, fused pointwise gates and scatter of `h`, `c` back to the
//! arena ([`lstm_layer_step`]) — and the bare GEMM of the same shape ([`matmul`]), in the same run,
//! on a compute pool of `--threads` threads. GFLOP/s count the GEMM's `2·b·(input+H)·4H`
//! ([`step_flops`]) for both, so their ratio is the cost of gather, gates and scatter.
//!
//! `--backend cuda` (or `auto` when the runtime picks CUDA) times the same step with the CUDA
//! kernels (`serve_lstm_gather`, the cuBLAS GEMM in FP32 with TF32 off, `serve_lstm_pointwise`)
//! against the cuBLAS GEMM alone, as `benches/cuda.rs` (a) does: each round queues `--iters`
//! steps on one stream and times them to the stream's end, five rounds alternating step and GEMM.
//! With no CUDA device, `--backend cuda` fails with the runtime's UNAVAILABLE error.

use std::hint::black_box;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use serde_json::json;

use serve::BackendKind;
use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::gemm::{PackedWeight, Threads, matmul};
use serve::backend::cpu::lstm_cell::{
    LstmLayer, LstmRow, LstmScratch, StepInput, lstm_layer_step, step_flops,
};
use serve::backend::cuda::step_bench::LstmStepBench;
use serve::backend::cuda::{self, CudaDevice, Stream};
use serve::workload::values;

use crate::bench::{open_report, write_report};
use crate::{BackendArg, CliResult, RuntimeArgs, build_runtime, compute_threads, fatal, positive};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum StepModel {
    /// One `torch.nn.LSTM` layer step.
    Lstm,
}

#[derive(Args, Debug)]
pub(crate) struct BenchStepArgs {
    /// The cell to time.
    #[arg(long, value_enum, default_value_t = StepModel::Lstm)]
    pub(crate) model: StepModel,
    /// Hidden size H.
    #[arg(long, default_value_t = 1024, value_parser = positive())]
    pub(crate) hidden: usize,
    /// Rows in the batch.
    #[arg(long, default_value_t = 512, value_parser = positive())]
    pub(crate) batch: usize,
    /// Input features of the layer (default: the hidden size).
    #[arg(long, value_parser = positive())]
    pub(crate) input: Option<usize>,
    /// Timed iterations of each (after one untimed warm-up).
    #[arg(long, default_value_t = 20, value_parser = positive())]
    pub(crate) iters: usize,
    #[command(flatten)]
    pub(crate) rt: RuntimeArgs,
    /// Write `{"results":[…]}` (ARCHITECTURE.md §8) to this file.
    #[arg(long)]
    pub(crate) json: Option<PathBuf>,
}

/// One timed kernel.
struct Timing {
    name: &'static str,
    /// Mean and fastest time per iteration.
    mean: Duration,
    min: Duration,
}

fn time_it(iters: usize, mut f: impl FnMut()) -> (Duration, Duration) {
    f(); // warm-up: pages touched, pool threads awake
    let mut min = Duration::MAX;
    let t0 = Instant::now();
    for _ in 0..iters {
        let t = Instant::now();
        f();
        min = min.min(t.elapsed());
    }
    (t0.elapsed() / iters as u32, min)
}

pub(crate) fn cmd_bench_step(a: BenchStepArgs) -> CliResult<()> {
    let StepModel::Lstm = a.model;
    // `cuda` with a device: the kernels directly (no runtime needed to time them).
    if a.rt.backend == BackendArg::Cuda && cuda::probe().devices > 0 {
        return cuda_bench_step(a);
    }
    // The backend arguments as everywhere: `cuda` with no device answers why it is not there.
    let (threads, desc) = {
        let rt = build_runtime(a.rt)?;
        if rt.backend_kind() == BackendKind::Cuda {
            drop(rt);
            return cuda_bench_step(a);
        }
        if rt.backend_kind() != BackendKind::Cpu {
            return Err(fatal(format!(
                "bench step times the CPU and CUDA kernels; the {} backend has no LSTM step kernel",
                rt.backend_kind()
            )));
        }
        let threads = compute_threads(a.rt.threads);
        (threads, rt.backend_description())
    };
    let report_file = open_report(a.json.as_ref())?;
    let (hidden, batch) = (a.hidden, a.batch);
    let input = a.input.unwrap_or(hidden);
    let (n, k) = (4 * hidden, input + hidden);
    check_size(hidden, input, batch)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("serve-bench-{i}"))
        .build()
        .map_err(|e| fatal(format!("cannot start the compute pool: {e}")))?;

    let s = 1.0 / (hidden as f32).sqrt();
    let w_ih = values(n * input, 1, s);
    let w_hh = values(n * hidden, 2, s);
    let b_ih = values(n, 3, s);
    let b_hh = values(n, 4, s);
    let layer = LstmLayer::from_torch(&w_ih, &w_hh, &b_ih, &b_hh, input, hidden);
    let x = values(batch * input, 5, 1.0);
    // Every row continues a sequence: its state is read from and written back to the arena.
    // Requests sit in every other slot of an arena twice the batch, in reverse order, as after
    // some churn.
    let arena = StateArena::new(2 * batch, 2 * hidden)?;
    let rows: Vec<LstmRow> =
        (0..batch).map(|r| LstmRow { slot: (2 * (batch - 1 - r)) as u32, fresh: false }).collect();
    for row in &rows {
        arena.write(row.slot, 0, &values(2 * hidden, 100 + u64::from(row.slot), 0.5));
    }
    let mut scratch = LstmScratch::new();
    scratch.reserve(batch, input, hidden)?;
    let mut h_out = vec![0.0f32; batch * hidden];
    let t = Threads(threads);
    // One timed step of `layer` reading `x`, on the pool.
    let mut time_step = |layer: &LstmLayer, x: StepInput<'_>| {
        time_it(a.iters, || {
            pool.install(|| lstm_layer_step(layer, x, &rows, batch, &arena, 0, &mut scratch, &mut h_out, t))
        })
    };
    let (step_mean, step_min) = time_step(&layer, StepInput::Values(black_box(&x)));
    // The same step with the input projection folded into a token-gate table (the CPU runner's
    // layer 0 within its budget): a table of `vocab` tokens, looked up instead of multiplied.
    let vocab = 4096;
    let embedding = values(vocab * input, 7, 1.0);
    let folded =
        pool.install(|| LstmLayer::fold_embedding(&w_ih, &w_hh, &b_ih, &b_hh, &embedding, input, hidden, t))?;
    drop(embedding);
    let ids: Vec<u32> = (0..batch as u32).map(|r| r.wrapping_mul(2_654_435_761) % vocab as u32).collect();
    let (folded_mean, folded_min) = time_step(&folded, StepInput::Tokens(black_box(&ids)));
    drop((scratch, folded));

    // The bare GEMM: [x | h] · [W_ih | W_hh]ᵀ.
    let wcat: Vec<f32> = (0..n)
        .flat_map(|j| {
            w_ih[j * input..(j + 1) * input].iter().chain(&w_hh[j * hidden..(j + 1) * hidden]).copied()
        })
        .collect();
    let packed = PackedWeight::from_torch(&wcat, n, k);
    drop(wcat);
    let xh = values(batch * k, 6, 1.0);
    let mut g = vec![0.0f32; batch * n];
    let (gemm_mean, gemm_min) =
        time_it(a.iters, || pool.install(|| matmul(black_box(&xh), &packed, &mut g, batch, false, t)));

    let flops = step_flops(batch, input, hidden);
    let timings = [
        Timing { name: "lstm_step", mean: step_mean, min: step_min },
        Timing { name: "gemm", mean: gemm_mean, min: gemm_min },
        Timing { name: "lstm_step_folded", mean: folded_mean, min: folded_min },
    ];
    println!("# serve bench step: model lstm, backend {desc}");
    println!(
        "# one layer step, hidden {hidden}, input {input}, batch {batch}: {:.3} GFLOP (2·b·(input+H)·4H); \
         {threads} thread(s), {} timed iteration(s) each",
        flops * 1e-9,
        a.iters
    );
    let r = print_timings(&timings, batch, hidden, flops);
    let folded_ratio = folded_mean.as_secs_f64() / step_mean.as_secs_f64().max(1e-12);
    println!(
        "# ratio folded step/step time: {folded_ratio:.3} (the first layer with its input projection looked up in a \
         token-gate table; its GFLOP/s count the unfolded step's work)"
    );
    if let Some((path, file)) = report_file {
        let results = json_results(
            &timings,
            batch,
            hidden,
            input,
            flops,
            json!({"iters": a.iters, "threads": threads}),
        );
        let report = json!({
            "backend": "cpu",
            "backend_description": desc,
            "model": "lstm",
            "results": results,
            "step_over_gemm": r,
            "folded_over_step": folded_ratio,
        });
        write_report(&path, file, &report)?;
    }
    Ok(())
}

/// Refuse shapes whose buffers exceed 16 GiB.
fn check_size(hidden: usize, input: usize, batch: usize) -> CliResult<()> {
    let (n, k) = (4 * hidden, input + hidden);
    let bytes = (n * k + batch * (k + 4 * hidden + 4 * hidden) + 2 * batch * 2 * hidden) as f64 * 4.0;
    if bytes > 16.0 * (1u64 << 30) as f64 {
        return Err(fatal(format!(
            "--hidden {hidden} --input {input} --batch {batch} needs {:.1} GiB of buffers; this benchmark takes at \
             most 16 GiB",
            bytes / (1u64 << 30) as f64
        )));
    }
    Ok(())
}

fn gflops(flops: f64, d: Duration) -> f64 {
    flops / d.as_secs_f64().max(1e-12) * 1e-9
}

/// The table of timings and the ratio line; returns step / GEMM (mean times).
fn print_timings(timings: &[Timing], batch: usize, hidden: usize, flops: f64) -> f64 {
    println!(
        "{:<16} {:>6} {:>6} {:>12} {:>12} {:>10}",
        "name", "batch", "hidden", "time_us", "min_us", "gflops"
    );
    for t in timings {
        println!(
            "{:<16} {:>6} {:>6} {:>12.1} {:>12.1} {:>10.1}",
            t.name,
            batch,
            hidden,
            t.mean.as_secs_f64() * 1e6,
            t.min.as_secs_f64() * 1e6,
            gflops(flops, t.mean)
        );
    }
    let [step, gemm, ..] = timings else { unreachable!("the step and the GEMM are timed first") };
    let r = step.mean.as_secs_f64() / gemm.mean.as_secs_f64().max(1e-12);
    println!(
        "# ratio step/GEMM time: {r:.3} (1.000 = gather, gates and scatter are free); step {:.1} GFLOP/s vs GEMM \
         {:.1} GFLOP/s",
        gflops(flops, step.mean),
        gflops(flops, gemm.mean)
    );
    r
}

/// The `results` of ARCHITECTURE.md §8 (`name`, `batch`, `hidden`, `time_us`, `gflops`), with `input`,
/// `min_time_us` and the fields of `extra`.
fn json_results(
    timings: &[Timing],
    batch: usize,
    hidden: usize,
    input: usize,
    flops: f64,
    extra: serde_json::Value,
) -> Vec<serde_json::Value> {
    timings
        .iter()
        .map(|t| {
            let mut v = json!({
                "name": t.name, "batch": batch, "hidden": hidden, "input": input,
                "time_us": t.mean.as_secs_f64() * 1e6, "min_time_us": t.min.as_secs_f64() * 1e6,
                "gflops": gflops(flops, t.mean),
            });
            if let (Some(v), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
                v.extend(extra.clone());
            }
            v
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The CUDA step.

/// `iters` calls of `f` queued on `s`, timed from an idle stream to its end.
fn time_queued(s: &Stream, iters: usize, mut f: impl FnMut() -> serve::Result<()>) -> CliResult<Duration> {
    s.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        f()?;
    }
    s.synchronize()?;
    Ok(t0.elapsed())
}

/// Alternating rounds of each.
const CUDA_ROUNDS: usize = 5;

fn cuda_bench_step(a: BenchStepArgs) -> CliResult<()> {
    let fail = |e: serve::Error| fatal(format!("cannot run bench step on backend `cuda`: {e}"));
    let report_file = open_report(a.json.as_ref())?;
    let (hidden, batch) = (a.hidden, a.batch);
    let input = a.input.unwrap_or(hidden);
    check_size(hidden, input, batch)?;
    let dev = CudaDevice::open(0).map_err(fail)?;
    let m = dev.kernels().map_err(fail)?;
    let s = dev.stream().map_err(fail)?;
    let mut blas = dev.blas(&s).map_err(fail)?;
    blas.set_tf32(false).map_err(fail)?;
    let desc = format!("cuda ({}; kernels: {})", dev.info(), m.describe());
    let mut st = LstmStepBench::new(&dev, &s, input, hidden, batch, 1).map_err(fail)?;

    // Warm-up (kernels loaded, cuBLAS's kernel chosen, clocks up), then alternating rounds.
    time_queued(&s, 3, || st.step(&s, &mut blas))?;
    time_queued(&s, 3, || st.gemm(&mut blas))?;
    let (mut step_total, mut gemm_total) = (Duration::ZERO, Duration::ZERO);
    let (mut step_min, mut gemm_min) = (Duration::MAX, Duration::MAX);
    for _ in 0..CUDA_ROUNDS {
        let t = time_queued(&s, a.iters, || st.step(&s, &mut blas))? / a.iters as u32;
        step_total += t;
        step_min = step_min.min(t);
        let t = time_queued(&s, a.iters, || st.gemm(&mut blas))? / a.iters as u32;
        gemm_total += t;
        gemm_min = gemm_min.min(t);
    }
    let timings = [
        Timing { name: "lstm_step", mean: step_total / CUDA_ROUNDS as u32, min: step_min },
        Timing { name: "gemm", mean: gemm_total / CUDA_ROUNDS as u32, min: gemm_min },
    ];
    let flops = st.flops();
    println!("# serve bench step: model lstm, backend {desc}");
    println!(
        "# one layer step, hidden {hidden}, input {input}, batch {batch}: {:.3} GFLOP (2·b·(input+H)·4H); FP32 \
         cuBLAS GEMM, TF32 off; {CUDA_ROUNDS} alternating rounds of {} queued iteration(s) each (min_us: best round)",
        flops * 1e-9,
        a.iters
    );
    let r = print_timings(&timings, batch, hidden, flops);
    println!("# goal: step ≤ 1.10 × GEMM: {}", if r <= 1.10 { "met" } else { "not met" });
    if let Some((path, file)) = report_file {
        let extra = json!({"iters": a.iters, "rounds": CUDA_ROUNDS, "tf32": false});
        let results = json_results(&timings, batch, hidden, input, flops, extra);
        let report = json!({
            "backend": "cuda",
            "backend_description": desc,
            "model": "lstm",
            "results": results,
            "step_over_gemm": r,
        });
        write_report(&path, file, &report)?;
    }
    Ok(())
}
