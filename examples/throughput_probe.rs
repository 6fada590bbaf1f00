//! Round-trip cost per request through the Rust API under a full pipeline: windows of 1024
//! requests submitted to a completion queue and drained, on a 1-layer 16×16 mlp (timeout policy,
//! no wait, batches up to 64, one CPU thread). The model is tiny, so the figure is the runtime's
//! own cost per request (submit, admission, engine, policy, stream, poller, delivery), the
//! number the "no regression" checks compare between revisions.
//!
//! `cargo run --release --example throughput_probe [WINDOWS]` (default 200)

use std::sync::Arc;
use std::time::{Duration, Instant};

use serve::model::Mlp;
use serve::{
    BackendChoice, CompletionQueue, Input, ModelOptions, Network, PolicyConfig, Runtime, SubmitOptions,
    TimeoutConfig,
};

fn main() {
    let windows: usize = std::env::args().nth(1).map_or(200, |s| s.parse().expect("WINDOWS is a count"));
    const W: u64 = 1024;
    let rt = Runtime::builder()
        .backend(BackendChoice::Cpu)
        .cpu_threads(1)
        .admission_bound(1 << 20)
        .build()
        .expect("runtime");
    let net = Arc::new(Network::Mlp(Mlp::random(&[16, 16], 1)));
    let policy = PolicyConfig::Timeout(TimeoutConfig {
        max_batch: 64,
        max_wait: Duration::ZERO,
        workers: 1,
        pad_to_max: false,
    });
    let model =
        rt.add_network(net, "mlp16".into(), ModelOptions { policy, ..Default::default() }).expect("model");
    let q = CompletionQueue::new().expect("queue");
    let mut out = Vec::new();
    let t0 = Instant::now();
    for _ in 0..windows {
        for i in 0..W {
            model.submit_to(Input::F32(vec![0.5; 16]), SubmitOptions::default(), &q, i).expect("submit");
        }
        let mut got = 0;
        while got < W as usize {
            out.clear();
            q.next_into(&mut out, 1024, Duration::from_secs(10)).expect("drain");
            got += out.len();
        }
    }
    let e = t0.elapsed();
    let n = windows as f64 * W as f64;
    println!("{n} requests in {:.3} s: {:.3} us/request", e.as_secs_f64(), e.as_secs_f64() * 1e6 / n);
}
