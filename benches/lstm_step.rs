//! One LSTM layer step of a cellular batch (gather `[x | h_prev]` from the state arena, one GEMM,
//! fused pointwise gates + scatter) against the bare GEMM of the same shape.
//!
//! Shapes: hidden ∈ {256, 1024}, input = hidden, batch ∈ {64, 512}; every row continues a
//! sequence (its state is read from and written back to the arena). Both are run as the runtime
//! runs them, inside the backend pool's `install`. Prints, for each shape, the time per step,
//! its GFLOP/s counting the GEMM's `2·b·(input+H)·4H` flops, the bare GEMM's GFLOP/s and the
//! ratio step / GEMM (1.0 = gather and pointwise are free); the table takes the best of six
//! alternating rounds of each, so that a busy moment of the machine does not skew the ratio.
//!
//! `cargo bench --bench lstm_step` (2 threads; SERVE_BENCH_THREADS=n overrides).

mod common;

use std::hint::black_box;
use std::time::Duration;

use common::time_it;

use criterion::{BenchmarkId, Criterion, Throughput};
use serve::backend::cpu::arena::StateArena;
use serve::backend::cpu::gemm::{PackedWeight, Threads, matmul};
use serve::backend::cpu::lstm_cell::{
    LstmLayer, LstmRow, LstmScratch, StepInput, lstm_layer_step, step_flops,
};
use serve::workload::values;

const SHAPES: [(usize, usize); 4] = [(256, 64), (256, 512), (1024, 64), (1024, 512)];

fn main() {
    let threads: usize = std::env::var("SERVE_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or(2);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
    let mut c =
        Criterion::default().configure_from_args().measurement_time(Duration::from_secs(2)).sample_size(20);
    let mut summary = Vec::new();
    for (hidden, batch) in SHAPES {
        let input = hidden;
        let s = 1.0 / (hidden as f32).sqrt();
        let w_ih = values(4 * hidden * input, 1, s);
        let w_hh = values(4 * hidden * hidden, 2, s);
        let b = values(4 * hidden, 3, s);
        let layer = LstmLayer::from_torch(&w_ih, &w_hh, &b, &b, input, hidden);
        let x = values(batch * input, 4, 1.0);
        // Requests in every other slot of an arena twice the batch, in reverse order.
        let arena = StateArena::new(2 * batch, 2 * hidden).unwrap();
        let rows: Vec<LstmRow> =
            (0..batch).map(|r| LstmRow { slot: (2 * (batch - 1 - r)) as u32, fresh: false }).collect();
        for row in &rows {
            arena.write(row.slot, 0, &values(2 * hidden, row.slot as u64, 0.5));
        }
        let mut scratch = LstmScratch::new();
        scratch.reserve(batch, input, hidden).unwrap();
        let mut h_out = vec![0.0f32; batch * hidden];
        let mut step = || {
            pool.install(|| {
                lstm_layer_step(
                    &layer,
                    StepInput::Values(black_box(&x)),
                    &rows,
                    batch,
                    &arena,
                    0,
                    &mut scratch,
                    &mut h_out,
                    Threads(threads),
                )
            })
        };

        // The bare GEMM: [x | h] · [W_ih | W_hh]ᵀ.
        let wcat: Vec<f32> = (0..4 * hidden)
            .flat_map(|j| {
                w_ih[j * input..(j + 1) * input].iter().chain(&w_hh[j * hidden..(j + 1) * hidden]).copied()
            })
            .collect();
        let packed = PackedWeight::from_torch(&wcat, 4 * hidden, input + hidden);
        let xh = values(batch * (input + hidden), 5, 1.0);
        let mut g = vec![0.0f32; batch * 4 * hidden];
        let mut gemm =
            || pool.install(|| matmul(black_box(&xh), &packed, &mut g, batch, false, Threads(threads)));

        let name = format!("h{hidden}_b{batch}");
        let flops = step_flops(batch, input, hidden);
        let mut grp = c.benchmark_group(format!("lstm_step/{name}"));
        grp.throughput(Throughput::Elements((flops / 2.0) as u64));
        grp.bench_function(BenchmarkId::new("step", threads), |bch| bch.iter(&mut step));
        grp.bench_function(BenchmarkId::new("gemm", threads), |bch| bch.iter(&mut gemm));
        grp.finish();
        // Best of alternating rounds: both see the same machine, and a busy moment is discarded.
        let (mut ts, mut tg) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..6 {
            ts = ts.min(time_it(&mut step, Duration::from_millis(150)));
            tg = tg.min(time_it(&mut gemm, Duration::from_millis(150)));
        }
        summary.push((name, ts, flops / ts * 1e-9, flops / tg * 1e-9));
    }
    println!("\n{threads} thread(s)     time/step   step GFLOP/s   GEMM GFLOP/s   step / GEMM");
    for (name, t, s, g) in summary {
        println!("{name:<14} {:>9.3} ms {s:>14.1} {g:>14.1} {:>12.2}", t * 1e3, s / g);
    }
}
