//! GEMM crate choice (ARCHITECTURE.md §5: "`gemm` or `matrixmultiply`; pick by benchmark").
//!
//! Times `y[b, n] += x[b, k] · Wᵀ` (a `torch.nn.Linear` / LSTM gate product) with both crates on
//! the shapes libserve runs: tiny mlp rows, CPU-scale layers (h = 256), and the LSTM step of
//! issue #3 (h = 1024, b = 512: x = [512, 2048], W = [4096, 2048]). `gemm` is called exactly as
//! the CPU backend calls it (weights packed as `Wᵀ`, small products on the calling thread, large
//! ones on an explicit rayon pool); `matrixmultiply` uses its own threading with the same thread
//! count and is given whichever weight layout (PyTorch's `W` or `Wᵀ`) is faster for it. Prints
//! GFLOP/s and the ratio gemm / matrixmultiply for each shape.
//!
//! `cargo bench --bench gemm` (SERVE_BENCH_THREADS=1 for single-threaded).

mod common;

use std::hint::black_box;
use std::time::Duration;

use common::time_it;

use criterion::{BenchmarkId, Criterion, Throughput};
use serve::backend::cpu::gemm::{PARALLEL_MIN_MACS, PackedWeight, Threads, matmul};

const SHAPES: [(&str, usize, usize, usize); 5] = [
    ("mlp16_b1", 1, 16, 16),
    ("mlp16_b64", 64, 16, 16),
    ("h256_b32", 32, 256, 256),
    ("lstm_h256_b64", 64, 512, 1024),
    ("lstm_h1024_b512", 512, 2048, 4096),
];

/// matrixmultiply on `W` `[n, k]` (`transposed = false`) or on `Wᵀ` `[k, n]` (`true`).
fn mm(x: &[f32], w: &[f32], transposed: bool, y: &mut [f32], rows: usize, k: usize, n: usize) {
    let (rsw, csw) = if transposed { (n as isize, 1) } else { (1, k as isize) };
    // SAFETY: slices are exactly rows×k, n×k and rows×n; the strides describe them.
    unsafe {
        matrixmultiply::sgemm(
            rows,
            k,
            n,
            1.0,
            x.as_ptr(),
            k as isize,
            1,
            w.as_ptr(),
            rsw,
            csw,
            1.0,
            y.as_mut_ptr(),
            n as isize,
            1,
        )
    }
}

fn main() {
    let threads = std::env::var("SERVE_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    // matrixmultiply's threading reads this at first use.
    // SAFETY: set before any other thread of this process exists.
    unsafe { std::env::set_var("MATMUL_NUM_THREADS", threads.to_string()) };
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();

    let mut c =
        Criterion::default().configure_from_args().measurement_time(Duration::from_secs(2)).sample_size(20);
    let mut summary = Vec::new();
    for (name, rows, k, n) in SHAPES {
        let x: Vec<f32> = (0..rows * k).map(|i| (i % 7) as f32 * 0.1).collect();
        let w: Vec<f32> = (0..n * k).map(|i| (i % 5) as f32 * 0.1).collect();
        let packed = PackedWeight::from_torch(&w, n, k);
        let wt: Vec<f32> = (0..k * n).map(|idx| w[(idx % n) * k + idx / n]).collect();
        let mut y = vec![0.0f32; rows * n];
        let flops = 2.0 * (rows * k * n) as f64;
        // As the runtime does: small products stay on the calling thread, large ones go to the pool.
        let parallel = threads > 1 && rows * k * n >= PARALLEL_MIN_MACS;
        let run_gemm = |y: &mut [f32]| {
            if parallel {
                pool.install(|| matmul(&x, &packed, y, rows, true, Threads(threads)))
            } else {
                matmul(&x, &packed, y, rows, true, Threads(1))
            }
        };
        let mut g = c.benchmark_group(format!("gemm/{name}"));
        g.throughput(Throughput::Elements((rows * k * n) as u64));
        g.bench_function(BenchmarkId::new("gemm", threads), |b| b.iter(|| run_gemm(black_box(&mut y))));
        let tm_w = time_it(|| mm(&x, &w, false, &mut y, rows, k, n), Duration::from_millis(300));
        let tm_wt = time_it(|| mm(&x, &wt, true, &mut y, rows, k, n), Duration::from_millis(300));
        let (mw, mt) = if tm_wt < tm_w { (&wt, true) } else { (&w, false) };
        g.bench_function(BenchmarkId::new("matrixmultiply", threads), |b| {
            b.iter(|| mm(black_box(&x), mw, mt, &mut y, rows, k, n))
        });
        g.finish();
        let tg = time_it(|| run_gemm(&mut y), Duration::from_millis(500));
        let tm = time_it(|| mm(&x, mw, mt, &mut y, rows, k, n), Duration::from_millis(500));
        summary.push((name, flops / tg * 1e-9, flops / tm * 1e-9));
    }
    println!("\n{threads} thread(s)        gemm GFLOP/s   matrixmultiply GFLOP/s   gemm / matrixmultiply");
    for (name, g, m) in summary {
        println!("{name:<18} {g:>12.1} {m:>24.1} {:>22.2}×", g / m);
    }
}
