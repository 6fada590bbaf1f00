//! C ABI submit → completion round trip for a 1-layer 16×16 mlp, amortized per request.
//!
//! Requests go in windows of `WINDOW`: submit the window through `serve_submit_f32`, then drain
//! it with `serve_queue_next`. Baselines measured in the same run: the same loop through the
//! Rust API (`Model::submit_to` + `CompletionQueue::next_into`), and the model's one linear layer
//! on one row with no runtime at all. Goal (issue #2): ≤ 2 µs per request on a 2-core CPU.
//! And the same layer as a **custom model** (`serve_runtime_add_custom_model`, its execute
//! callback computing the layer for the batch): what a custom engine adds over the built-in mlp
//! per request (goal, issue 14: ≤ 2 µs).
//!
//! `cargo bench --bench roundtrip`

use std::hint::black_box;

use std::ptr;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use serve::backend::cpu::gemm::{PackedWeight, Threads, linear};
use serve::ffi::completion::{serve_completion, serve_completion_free};
use serve::ffi::custom::{
    serve_custom_call, serve_custom_model_options_free, serve_custom_model_options_new,
    serve_runtime_add_custom_model,
};
use serve::ffi::model::{
    serve_model, serve_model_free, serve_model_options_free, serve_model_options_new,
    serve_model_options_set_max_batch, serve_runtime_load_model,
};
use serve::ffi::queue::{serve_queue, serve_queue_free, serve_queue_new, serve_queue_next};
use serve::ffi::runtime::{
    serve_runtime, serve_runtime_free, serve_runtime_new, serve_runtime_options_free,
    serve_runtime_options_new, serve_runtime_options_set_backend, serve_runtime_options_set_cpu_threads,
};
use serve::ffi::submit::serve_submit_f32;
use serve::model::Mlp;
use serve::{
    BackendChoice, CompletionQueue, Input, ModelOptions, PolicyConfig, Runtime, SubmitOptions, TimeoutConfig,
};

const WINDOW: u64 = 1024;
const MAX_BATCH: usize = 64;

fn check(e: *mut serve::ffi::error::serve_error) {
    assert!(e.is_null(), "libserve call failed: code {:?}", serve::ffi::error::serve_error_code(e));
}

struct CHandles {
    rt: *mut serve_runtime,
    model: *mut serve_model,
    queue: *mut serve_queue,
}

fn c_setup(dir: &std::path::Path) -> CHandles {
    let mut ro = ptr::null_mut();
    check(serve_runtime_options_new(&mut ro));
    check(serve_runtime_options_set_backend(ro, c"cpu".as_ptr()));
    check(serve_runtime_options_set_cpu_threads(ro, 1));
    let mut rt = ptr::null_mut();
    check(serve_runtime_new(ro, &mut rt));
    serve_runtime_options_free(ro);
    let mut mo = ptr::null_mut();
    check(serve_model_options_new(&mut mo));
    check(serve_model_options_set_max_batch(mo, MAX_BATCH as u32));
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = ptr::null_mut();
    check(serve_runtime_load_model(rt, path.as_ptr(), mo, &mut model));
    serve_model_options_free(mo);
    let mut queue = ptr::null_mut();
    check(serve_queue_new(&mut queue));
    CHandles { rt, model, queue }
}

/// The custom engine: the mlp's layer, for a batch, in the execute callback.
struct LinearEngine {
    w: PackedWeight,
    b: Vec<f32>,
}

/// The execute callback of the custom model.
///
/// # Safety
/// `user` is the `LinearEngine` registered with it; `call` is libserve's call (its buffers hold
/// `batch × stride` values).
unsafe extern "C" fn execute(user: *mut std::ffi::c_void, call: *const serve_custom_call) -> i32 {
    // SAFETY: the function's contract.
    let (e, c) = unsafe { (&*(user as *const LinearEngine), &*call) };
    // SAFETY: libserve's call contract: input and output hold batch × stride values.
    let (x, y) = unsafe {
        (
            std::slice::from_raw_parts(c.input, c.batch * c.input_stride),
            std::slice::from_raw_parts_mut(c.output, c.batch * c.output_stride),
        )
    };
    linear(x, &e.w, &e.b, y, c.batch, false, Threads(1));
    0
}

/// Frees the engine once libserve is done with it.
///
/// # Safety
/// `user` came from `Box::into_raw` of a `LinearEngine` and is freed once.
unsafe extern "C" fn free_engine(user: *mut std::ffi::c_void) {
    // SAFETY: the function's contract.
    drop(unsafe { Box::from_raw(user as *mut LinearEngine) });
}

/// The mlp's layer as a custom model of `h.rt`, with the same batching.
fn c_custom_model(h: &CHandles, mlp: &Mlp) -> *mut serve_model {
    let l = &mlp.layers[0];
    let engine = Box::new(LinearEngine { w: PackedWeight::from_torch(&l.weight, 16, 16), b: l.bias.clone() });
    let mut co = ptr::null_mut();
    check(serve_custom_model_options_new(
        16,
        16,
        Some(execute),
        Box::into_raw(engine).cast(),
        Some(free_engine),
        &mut co,
    ));
    let mut mo = ptr::null_mut();
    check(serve_model_options_new(&mut mo));
    check(serve_model_options_set_max_batch(mo, MAX_BATCH as u32));
    let mut model = ptr::null_mut();
    check(serve_runtime_add_custom_model(h.rt, c"linear".as_ptr(), co, mo, &mut model));
    serve_model_options_free(mo);
    serve_custom_model_options_free(co);
    model
}

/// Submit and drain `n` requests through the C ABI; returns the elapsed time.
fn c_round_trips(
    h: &CHandles,
    model: *mut serve_model,
    n: u64,
    input: &[f32],
    out: &mut [*mut serve_completion],
) -> Duration {
    let t0 = Instant::now();
    let mut done = 0;
    while done < n {
        let window = WINDOW.min(n - done);
        for tag in 0..window {
            check(serve_submit_f32(
                model,
                h.queue,
                tag,
                input.as_ptr(),
                input.len(),
                ptr::null(),
                ptr::null_mut(),
            ));
        }
        let mut got = 0;
        while got < window {
            let mut count = 0;
            check(serve_queue_next(h.queue, out.as_mut_ptr(), out.len(), u64::MAX, &mut count));
            for c in &out[..count] {
                serve_completion_free(*c);
            }
            got += count as u64;
        }
        done += window;
    }
    t0.elapsed()
}

fn rust_round_trips(model: &serve::Model, q: &CompletionQueue, n: u64, input: &[f32]) -> Duration {
    let t0 = Instant::now();
    let mut done = 0;
    let mut buf = Vec::with_capacity(WINDOW as usize);
    while done < n {
        let window = WINDOW.min(n - done);
        for tag in 0..window {
            model.submit_to(Input::F32(input.to_vec()), SubmitOptions::default(), q, tag).unwrap();
        }
        let mut got = 0;
        while got < window {
            buf.clear();
            got += q.next_into(&mut buf, WINDOW as usize, Duration::MAX).unwrap() as u64;
        }
        done += window;
    }
    t0.elapsed()
}

fn per_request_ns(mut f: impl FnMut(u64) -> Duration, n: u64, reps: usize) -> f64 {
    let mut v: Vec<f64> = (0..reps).map(|_| f(n).as_nanos() as f64 / n as f64).collect();
    v.sort_by(f64::total_cmp);
    v[reps / 2]
}

fn main() {
    let dir = std::env::temp_dir().join(format!("serve-bench-roundtrip-{}", std::process::id()));
    let mlp = Mlp::random(&[16, 16], 1);
    mlp.save(&dir).unwrap();
    let input: Vec<f32> = (0..16).map(|i| i as f32 / 16.0).collect();

    let h = c_setup(&dir);
    let custom = c_custom_model(&h, &mlp);
    let mut out = vec![ptr::null_mut(); WINDOW as usize];
    let rt = Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(1).build().unwrap();
    let opts = ModelOptions {
        policy: PolicyConfig::Timeout(TimeoutConfig {
            max_batch: MAX_BATCH,
            max_wait: Duration::ZERO,
            workers: 1,
            pad_to_max: false,
        }),
        ..ModelOptions::default()
    };
    let model = rt.load_model(&dir, opts).unwrap();
    let q = CompletionQueue::new().unwrap();

    let mut c = Criterion::default().configure_from_args().measurement_time(Duration::from_secs(3));
    {
        let mut g = c.benchmark_group("roundtrip_mlp16");
        g.throughput(Throughput::Elements(1));
        g.bench_function("c_abi", |b| {
            b.iter_custom(|iters| c_round_trips(&h, h.model, iters, &input, &mut out))
        });
        g.bench_function("c_abi_custom", |b| {
            b.iter_custom(|iters| c_round_trips(&h, custom, iters, &input, &mut out))
        });
        g.bench_function("rust_api", |b| b.iter_custom(|iters| rust_round_trips(&model, &q, iters, &input)));
        let l = &mlp.layers[0];
        let w = PackedWeight::from_torch(&l.weight, 16, 16);
        let mut y = vec![0.0f32; 16];
        g.bench_function("linear_only", |b| {
            b.iter(|| linear(black_box(&input), &w, &l.bias, &mut y, 1, false, Threads(1)))
        });
        g.finish();
    }

    // Ratios measured in this run (medians of 7 runs of 100k requests).
    let n = 100_000;
    let c_ns = per_request_ns(|n| c_round_trips(&h, h.model, n, &input, &mut out), n, 7);
    let custom_ns = per_request_ns(|n| c_round_trips(&h, custom, n, &input, &mut out), n, 7);
    let r_ns = per_request_ns(|n| rust_round_trips(&model, &q, n, &input), n, 7);
    println!("\nround trip per request, amortized over windows of {WINDOW} (max batch {MAX_BATCH}):");
    println!("  C ABI    {:8.0} ns   ({:.2} µs; goal ≤ 2 µs)", c_ns, c_ns / 1000.0);
    println!("  Rust API {:8.0} ns", r_ns);
    println!(
        "  C ABI, the layer as a custom model {:8.0} ns: {:+.0} ns per request over the built-in mlp (goal ≤ +2000 ns)",
        custom_ns,
        custom_ns - c_ns
    );
    let l = &mlp.layers[0];
    let w = PackedWeight::from_torch(&l.weight, 16, 16);
    let mut y = vec![0.0f32; 16];
    let lin_ns = per_request_ns(
        |n| {
            let t0 = Instant::now();
            for _ in 0..n {
                linear(black_box(&input), &w, &l.bias, &mut y, 1, false, Threads(1));
            }
            t0.elapsed()
        },
        n,
        7,
    );
    println!("  linear only (no runtime) {:8.0} ns", lin_ns);
    println!(
        "  C ABI / Rust API = {:.2}×; runtime overhead over the bare layer = {:.1}×",
        c_ns / r_ns,
        c_ns / lin_ns
    );

    serve_queue_free(h.queue);
    serve_model_free(custom);
    serve_model_free(h.model);
    serve_runtime_free(h.rt);
    let _ = std::fs::remove_dir_all(&dir);
}
