//! Isolated-request latency: one request at a time (no batching possible) through the Rust API,
//! submit → completion queue, on a 1-layer 16×16 mlp. Measures the runtime's fixed path (engine,
//! stream and queue hand-offs), the floor under any batching policy's latency.
//!
//! `cargo run --release --example latency_probe`

use std::sync::Arc;
use std::time::{Duration, Instant};

use serve::model::Mlp;
use serve::{BackendChoice, CompletionQueue, Input, ModelOptions, Network, Runtime, SubmitOptions};

fn main() {
    const N: usize = 5000;
    let rt = Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(1).build().expect("runtime");
    let net = Arc::new(Network::Mlp(Mlp::random(&[16, 16], 1)));
    let model = rt.add_network(net, "mlp16".into(), ModelOptions::default()).expect("model");
    let q = CompletionQueue::new().expect("queue");
    let mut us = Vec::with_capacity(N);
    for i in 0..N {
        let t0 = Instant::now();
        model.submit_to(Input::F32(vec![0.5; 16]), SubmitOptions::default(), &q, i as u64).expect("submit");
        let done = q.next(1, Duration::from_secs(10)).expect("drain");
        assert_eq!(done.len(), 1, "request {i} did not complete");
        us.push(t0.elapsed().as_secs_f64() * 1e6);
    }
    us.sort_by(f64::total_cmp);
    let p = |q: f64| us[((N as f64 * q) as usize).min(N - 1)];
    println!(
        "isolated round trip over {N} requests: p50 {:.1} µs, p90 {:.1} µs, p99 {:.1} µs",
        p(0.5),
        p(0.9),
        p(0.99)
    );
}
