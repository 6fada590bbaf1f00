//! CUDA graphs of task bodies (`backend/cuda/graph.rs`, ARCHITECTURE.md §5.3), opt-in with
//! `SERVE_CUDA_GRAPHS=1`. This binary holds one test, which turns them on for its own process:
//! graphs are not yet safe while other threads use the device (their context-wide calls fail
//! during a capture), so they are tested alone.
//!
//! With no CUDA device the test prints `skipped: no CUDA device` and passes, unless
//! `SERVE_REQUIRE_GPU=1`.

mod common;

use std::sync::Arc;

use common::layer_fixtures::assert_close;
use common::run_ok;
use serve::BackendChoice;
use serve::backend::{RunnerShape, Work};

/// A resnet task's layers are queued eagerly the first time a worker sees its shape, captured
/// into a CUDA graph the second, and replayed from it after: every one of them computes what the
/// CPU backend computes for that task's own input (a replay that read a stale input, or wrote
/// where the host does not read, would fail here), for two batch sizes and a layer range.
#[test]
fn resnet_layers_replayed_from_cuda_graphs_match_the_cpu() {
    let probe = serve::backend::cuda::probe();
    if probe.devices == 0 {
        common::gpu::skip::<()>(&format!("no CUDA device ({})", probe.summary()));
        return;
    }
    // SAFETY: this binary's only test sets the variable before anything reads the environment
    // on another thread (no runtime or backend exists yet).
    unsafe { std::env::set_var("SERVE_CUDA_GRAPHS", "1") };
    let gpu = serve::backend::create(BackendChoice::Cuda, 1).unwrap();
    let cpu = serve::backend::create(BackendChoice::Cpu, 2).unwrap();
    let net = Arc::new(common::small_resnet());
    let len = net.dense_lens().0;
    let layers = net.layers().len();
    let g = gpu.prepare(net.clone(), RunnerShape::fixed(1, 4), Arc::new(|| {})).unwrap();
    let c = cpu.prepare(net.clone(), RunnerShape::fixed(1, 4), Arc::new(|| {})).unwrap();
    let rounds = 4u64;
    for round in 0..rounds {
        for rows in [1, 3] {
            let x = serve::workload::values(rows * len, 1000 + round * 10 + rows as u64, 1.0);
            let got = run_ok(&*g, rows, Work::Dense(x.clone()));
            let want = run_ok(&*c, rows, Work::Dense(x.clone()));
            assert_close(&got, &want, 1e-4, &format!("round {round}, {rows} rows: CUDA vs CPU"));
            let mid = run_ok(&*c, rows, Work::Layers { first: 0, last: 2, input: x });
            let tail = run_ok(&*g, rows, Work::Layers { first: 2, last: layers, input: mid });
            assert_close(&tail, &want, 1e-4, &format!("round {round}, {rows} rows: layers 2.. on CUDA"));
        }
    }
    // Per shape (1 and 3 rows, whole and from layer 2): round 0 eager, round 1 captured, rounds
    // 2 and 3 replayed.
    assert_eq!(g.graph_replays(), 4 * (rounds - 2), "every task from round 2 on was replayed");
    assert_eq!(c.graph_replays(), 0);
}
