//! `serve bench step --model lstm …` (DESIGN §8 micro-benchmark): one batched LSTM layer step as
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
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use serve::BackendKind;
use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::gemm::{PackedWeight, Threads, matmul};
use serve::backend::cpu::lstm_cell::{LstmLayer, LstmRow, LstmScratch, lstm_layer_step, step_flops};
use serve::backend::cuda::abi::{LstmGatherParams, LstmPointwiseParams};
use serve::backend::cuda::kernels::{self, BLOCK, grid};
use serve::backend::cuda::{self, Blas, CudaDevice, DeviceBuffer, Function, LaunchConfig, Stream};

use crate::bench::{open_report, write_report};
use crate::{BackendArg, BenchStepArgs, CliResult, StepModel, build_runtime, fatal};

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

fn values(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
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
        let threads = if a.rt.threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            a.rt.threads
        };
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

    let mut rng = StdRng::seed_from_u64(1);
    let s = 1.0 / (hidden as f32).sqrt();
    let w_ih = values(&mut rng, n * input, s);
    let w_hh = values(&mut rng, n * hidden, s);
    let b_ih = values(&mut rng, n, s);
    let b_hh = values(&mut rng, n, s);
    let layer = LstmLayer::from_torch(&w_ih, &w_hh, &b_ih, &b_hh, input, hidden);
    let x = values(&mut rng, batch * input, 1.0);
    // Every row continues a sequence: its state is read from and written back to the arena.
    // Requests sit in every other slot of an arena twice the batch, in reverse order, as after
    // some churn.
    let arena = StateArena::new(2 * batch, 2 * hidden)?;
    let rows: Vec<LstmRow> =
        (0..batch).map(|r| LstmRow { slot: (2 * (batch - 1 - r)) as u32, fresh: false }).collect();
    for row in &rows {
        arena.write(row.slot, 0, &values(&mut rng, 2 * hidden, 0.5));
    }
    let mut scratch = LstmScratch::new();
    scratch.reserve(batch, input, hidden)?;
    let mut h_out = vec![0.0f32; batch * hidden];
    let t = Threads(threads);
    let (step_mean, step_min) = time_it(a.iters, || {
        pool.install(|| {
            lstm_layer_step(&layer, black_box(&x), &rows, batch, &arena, 0, &mut scratch, &mut h_out, t)
        })
    });
    drop(scratch);

    // The bare GEMM: [x | h] · [W_ih | W_hh]ᵀ.
    let wcat: Vec<f32> = (0..n)
        .flat_map(|j| {
            w_ih[j * input..(j + 1) * input].iter().chain(&w_hh[j * hidden..(j + 1) * hidden]).copied()
        })
        .collect();
    let packed = PackedWeight::from_torch(&wcat, n, k);
    drop(wcat);
    let xh = values(&mut rng, batch * k, 1.0);
    let mut g = vec![0.0f32; batch * n];
    let (gemm_mean, gemm_min) =
        time_it(a.iters, || pool.install(|| matmul(black_box(&xh), &packed, &mut g, batch, false, t)));

    let flops = step_flops(batch, input, hidden);
    let timings = [
        Timing { name: "lstm_step", mean: step_mean, min: step_min },
        Timing { name: "gemm", mean: gemm_mean, min: gemm_min },
    ];
    println!("# serve bench step: model lstm, backend {desc}");
    println!(
        "# one layer step, hidden {hidden}, input {input}, batch {batch}: {:.3} GFLOP (2·b·(input+H)·4H); \
         {threads} thread(s), {} timed iteration(s) each",
        flops * 1e-9,
        a.iters
    );
    let r = print_timings(&timings, batch, hidden, flops);
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
fn print_timings(timings: &[Timing; 2], batch: usize, hidden: usize, flops: f64) -> f64 {
    println!(
        "{:<10} {:>6} {:>6} {:>12} {:>12} {:>10}",
        "name", "batch", "hidden", "time_us", "min_us", "gflops"
    );
    for t in timings {
        println!(
            "{:<10} {:>6} {:>6} {:>12.1} {:>12.1} {:>10.1}",
            t.name,
            batch,
            hidden,
            t.mean.as_secs_f64() * 1e6,
            t.min.as_secs_f64() * 1e6,
            gflops(flops, t.mean)
        );
    }
    let [step, gemm] = timings;
    let r = step.mean.as_secs_f64() / gemm.mean.as_secs_f64().max(1e-12);
    println!(
        "# ratio step/GEMM time: {r:.3} (1.000 = gather, gates and scatter are free); step {:.1} GFLOP/s vs GEMM \
         {:.1} GFLOP/s",
        gflops(flops, step.mean),
        gflops(flops, gemm.mean)
    );
    r
}

/// The `results` of DESIGN §8 (`name`, `batch`, `hidden`, `time_us`, `gflops`), with `input`,
/// `min_time_us` and the fields of `extra`.
fn json_results(
    timings: &[Timing; 2],
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

/// One LSTM layer step's device buffers, laid out as the CPU benchmark's: every row continues a
/// sequence, in every other slot of an arena twice the batch, in reverse order.
struct CudaStep {
    batch: usize,
    input: usize,
    hidden: usize,
    gather: Function,
    pointwise: Function,
    x: DeviceBuffer<f32>,
    slots: DeviceBuffer<u32>,
    arena: DeviceBuffer<f32>,
    xh: DeviceBuffer<f32>,
    w: DeviceBuffer<f32>,
    bias: DeviceBuffer<f32>,
    gates: DeviceBuffer<f32>,
    h_out: DeviceBuffer<f32>,
}

impl CudaStep {
    /// Queue the full step on `s`: gather `[x | h_prev]`, the GEMM, gates + scatter.
    fn step(&mut self, s: &Stream, blas: &mut Blas) -> serve::Result<()> {
        let (b, input, h) = (self.batch as u32, self.input as u32, self.hidden as u32);
        let p = LstmGatherParams {
            x: self.x.device_ptr(),
            slots: self.slots.device_ptr(),
            arena: self.arena.device_ptr(),
            xh: self.xh.device_ptr(),
            input,
            hidden: h,
            rows: b,
            padded: b,
            x_ld: input,
            arena_slots: 2 * b,
            arena_width: 2 * h,
            offset: 0,
        };
        let units = (self.batch * (self.input + self.hidden)) as u64;
        // SAFETY: serve_lstm_gather takes one serve_lstm_gather_params (LstmGatherParams) by value.
        // By construction (cuda_bench_step) x is batch × input, slots holds batch words naming
        // slots < 2·batch, the arena is 2·batch slots of 2·hidden words, xh is
        // batch × (input + hidden). Every buffer is a field of `self`, which outlives the kernel
        // (a buffer's drop synchronises the context first), and the host reaches them only
        // through copies on this stream.
        unsafe { s.launch_with(&self.gather, LaunchConfig::linear(grid(units, BLOCK), BLOCK), &p) }?;
        self.gemm(blas)?;
        let p = LstmPointwiseParams {
            gates: self.gates.device_ptr(),
            bias: self.bias.device_ptr(),
            slots: self.slots.device_ptr(),
            arena: self.arena.device_ptr(),
            h_out: self.h_out.device_ptr(),
            hidden: h,
            rows: b,
            padded: b,
            h_out_ld: h,
            arena_slots: 2 * b,
            arena_width: 2 * h,
            offset: 0,
            _pad0: 0,
        };
        let units = (self.batch * self.hidden) as u64;
        // SAFETY: serve_lstm_pointwise takes one serve_lstm_pointwise_params (LstmPointwiseParams)
        // by value: gates batch × 4·hidden, bias 4·hidden, batch slot words < 2·batch, the arena
        // as above (words 0..2·hidden of those slots written), h_out batch × hidden, all by
        // construction; lifetimes and host access as for the gather.
        unsafe { s.launch_with(&self.pointwise, LaunchConfig::linear(grid(units, BLOCK), BLOCK), &p) }
    }

    /// Queue the GEMM alone: `gates = xh · [W_ih | W_hh]ᵀ`.
    fn gemm(&mut self, blas: &mut Blas) -> serve::Result<()> {
        let (n, k) = (4 * self.hidden, self.input + self.hidden);
        blas.gemm_nt(self.batch, n, k, 1.0, &self.xh, &self.w, 0.0, &mut self.gates)
    }
}

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
    let too_big = |what: &str| fatal(format!("{what} does not fit the kernels' 32-bit sizes"));
    for (what, v) in [("--batch", 2 * batch), ("--hidden", 2 * hidden), ("--input", input + hidden)] {
        u32::try_from(v).map_err(|_| too_big(what))?;
    }
    let dev = CudaDevice::open(0).map_err(fail)?;
    let m = dev.kernels().map_err(fail)?;
    let s = dev.stream().map_err(fail)?;
    let mut blas = dev.blas(&s).map_err(fail)?;
    blas.set_tf32(false).map_err(fail)?;
    let desc = format!("cuda ({}; kernels: {})", dev.info(), m.describe());

    let mut rng = StdRng::seed_from_u64(1);
    let sc = 1.0 / (hidden as f32).sqrt();
    let (n, k) = (4 * hidden, input + hidden);
    let w_ih = values(&mut rng, n * input, sc);
    let w_hh = values(&mut rng, n * hidden, sc);
    let wcat: Vec<f32> = (0..n)
        .flat_map(|j| {
            w_ih[j * input..(j + 1) * input].iter().chain(&w_hh[j * hidden..(j + 1) * hidden]).copied()
        })
        .collect();
    drop((w_ih, w_hh));
    let bias: Vec<f32> =
        values(&mut rng, n, sc).iter().zip(values(&mut rng, n, sc)).map(|(a, b)| a + b).collect();
    let words: Vec<u32> = (0..batch).map(|r| (2 * (batch - 1 - r)) as u32).collect();
    let up = |v: &[f32]| s.upload(v).map_err(fail);
    let mut st = CudaStep {
        batch,
        input,
        hidden,
        gather: m.function(kernels::LSTM_GATHER).map_err(fail)?,
        pointwise: m.function(kernels::LSTM_POINTWISE).map_err(fail)?,
        x: up(&values(&mut rng, batch * input, 1.0))?,
        slots: s.upload(&words).map_err(fail)?,
        arena: up(&values(&mut rng, 2 * batch * 2 * hidden, 0.5))?,
        xh: up(&values(&mut rng, batch * k, 1.0))?,
        w: up(&wcat)?,
        bias: up(&bias)?,
        gates: dev.alloc::<f32>(batch * n).map_err(fail)?,
        h_out: dev.alloc::<f32>(batch * hidden).map_err(fail)?,
    };
    drop(wcat);

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
    let flops = step_flops(batch, input, hidden);
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
