//! Round-trip cost per request under a full pipeline: windows of 1024 requests submitted to a
//! completion queue and drained, on a 1-layer 16×16 mlp (timeout policy, no wait, batches up to
//! 64, one CPU thread). The model is tiny, so the figure is the runtime's own cost per request
//! (submit, admission, engine, policy, stream, delivery), the number the "no
//! regression" checks compare between revisions.
//!
//! `cargo run --release --example throughput_probe [WINDOWS] [rust|c|lstm]` (default 200 windows
//! through the Rust API; `c`: the same through the C ABI, `serve_submit_f32` and
//! `serve_queue_next`, as a C server calls it; `lstm`: the recurrent path, an lstm of hidden 4
//! under cellular batching, sentences of 1 to 47 tokens, mean 24, so that the runtime's cost
//! per cell, not the arithmetic, is what is measured).
//!
//! The probe does a fixed amount of work, so it can also run under
//! `valgrind --tool=callgrind`: the instructions per request are then the difference between
//! two window counts divided by the extra requests, a figure this machine's timing noise does
//! not move (ARCHITECTURE.md §9).

use std::ptr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serve::ffi::completion::serve_completion_free;
use serve::ffi::model::{
    serve_model_free, serve_model_options_free, serve_model_options_new, serve_model_options_set_max_batch,
    serve_runtime_load_model,
};
use serve::ffi::queue::{serve_queue_free, serve_queue_new, serve_queue_next};
use serve::ffi::runtime::{
    serve_runtime_free, serve_runtime_new, serve_runtime_options_free, serve_runtime_options_new,
    serve_runtime_options_set_backend, serve_runtime_options_set_cpu_threads,
};
use serve::ffi::submit::serve_submit_f32;
use serve::model::{Lstm, Mlp};
use serve::{
    BackendChoice, CompletionQueue, Input, ModelOptions, Network, PolicyConfig, Runtime, SubmitOptions,
    TimeoutConfig,
};

const W: u64 = 1024;

fn main() {
    let mut args = std::env::args().skip(1);
    let windows: usize = args.next().map_or(200, |s| s.parse().expect("WINDOWS is a count"));
    let api = args.next().unwrap_or_else(|| "rust".into());
    let elapsed = match api.as_str() {
        "rust" => rust(windows),
        "c" => c_abi(windows),
        "lstm" => lstm(windows),
        other => panic!("unknown API {other:?}: rust, c or lstm"),
    };
    let n = windows as f64 * W as f64;
    println!(
        "{n} requests ({api}) in {:.3} s: {:.3} us/request",
        elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / n
    );
}

/// The mlp through the Rust API.
fn rust(windows: usize) -> Duration {
    let net = Network::Mlp(Mlp::random(&[16, 16], 1));
    let policy = PolicyConfig::Timeout(TimeoutConfig {
        max_batch: 64,
        max_wait: Duration::ZERO,
        workers: 1,
        pad_to_max: false,
    });
    rust_windows(net, ModelOptions { policy, ..Default::default() }, windows, |_| Input::F32(vec![0.5; 16]))
}

/// The lstm (cellular batching, the default policy of a recurrent model) through the Rust API.
fn lstm(windows: usize) -> Duration {
    let net = Network::Lstm(Lstm::random(100, 4, 4, 1, 1));
    rust_windows(net, ModelOptions::default(), windows, |i| {
        Input::Tokens((0..1 + i % 47).map(|t| ((i + t) % 100) as u32).collect())
    })
}

/// `windows` windows of `W` requests (request `i` of a window takes `input(i)`) submitted to one
/// completion queue and drained, on a one-thread CPU runtime; the time taken.
fn rust_windows(net: Network, opts: ModelOptions, windows: usize, input: impl Fn(u64) -> Input) -> Duration {
    let rt = Runtime::builder()
        .backend(BackendChoice::Cpu)
        .cpu_threads(1)
        .admission_bound(1 << 20)
        .build()
        .expect("runtime");
    let model = rt.add_network(Arc::new(net), "probe".into(), opts).expect("model");
    let q = CompletionQueue::new().expect("queue");
    let mut out = Vec::new();
    let t0 = Instant::now();
    for _ in 0..windows {
        for i in 0..W {
            model.submit_to(input(i), SubmitOptions::default(), &q, i).expect("submit");
        }
        let mut got = 0;
        while got < W as usize {
            out.clear();
            q.next_into(&mut out, 1024, Duration::from_secs(10)).expect("drain");
            got += out.len();
        }
    }
    t0.elapsed()
}

fn check(e: *mut serve::ffi::error::serve_error) {
    assert!(e.is_null(), "libserve call failed: code {:?}", serve::ffi::error::serve_error_code(e));
}

/// The same loop through the C ABI, on the same mlp loaded from a model directory (the C ABI's
/// default policy is timeout batching with no wait).
fn c_abi(windows: usize) -> Duration {
    let dir = std::env::temp_dir().join(format!("serve-throughput-probe-{}", std::process::id()));
    Mlp::random(&[16, 16], 1).save(&dir).expect("model directory");
    let mut ro = ptr::null_mut();
    check(serve_runtime_options_new(&mut ro));
    check(serve_runtime_options_set_backend(ro, c"cpu".as_ptr()));
    check(serve_runtime_options_set_cpu_threads(ro, 1));
    let mut rt = ptr::null_mut();
    check(serve_runtime_new(ro, &mut rt));
    serve_runtime_options_free(ro);
    let mut mo = ptr::null_mut();
    check(serve_model_options_new(&mut mo));
    check(serve_model_options_set_max_batch(mo, 64));
    let path = std::ffi::CString::new(dir.to_str().expect("a UTF-8 temporary path")).expect("no NUL");
    let mut model = ptr::null_mut();
    check(serve_runtime_load_model(rt, path.as_ptr(), mo, &mut model));
    serve_model_options_free(mo);
    let mut queue = ptr::null_mut();
    check(serve_queue_new(&mut queue));
    let input = [0.5f32; 16];
    let mut out = vec![ptr::null_mut(); W as usize];
    let t0 = Instant::now();
    for _ in 0..windows {
        for tag in 0..W {
            check(serve_submit_f32(
                model,
                queue,
                tag,
                input.as_ptr(),
                input.len(),
                ptr::null(),
                ptr::null_mut(),
            ));
        }
        let mut got = 0;
        while got < W as usize {
            let mut count = 0;
            check(serve_queue_next(queue, out.as_mut_ptr(), out.len(), u64::MAX, &mut count));
            for c in &out[..count] {
                serve_completion_free(*c);
            }
            got += count;
        }
    }
    let elapsed = t0.elapsed();
    serve_model_free(model);
    serve_queue_free(queue);
    serve_runtime_free(rt);
    let _ = std::fs::remove_dir_all(&dir);
    elapsed
}
