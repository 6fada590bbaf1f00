//! Freeing a model releases it (issue 18): once the last handle of a model is dropped (Rust: the
//! last `Model` clone; C: `serve_model_free`) and its pending requests have completed — each
//! exactly once, with its normal result — the runtime releases the model's worker threads, state
//! arena and buffers, so load/free cycles neither leak threads nor grow memory.
//!
//! The checks count the process's threads (`/proc/self/task`) and read its RSS
//! (`/proc/self/statm`), so this file is Linux-only, and its tests run one at a time ([`SERIAL`]):
//! another test's runtime would change both.
#![cfg(target_os = "linux")]

mod common;

use std::collections::HashMap;
use std::ffi::CString;
use std::ptr::{null, null_mut};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::recurrent::{Case, cases, check, fixture};
use serve::ffi::completion::*;
use serve::ffi::error::*;
use serve::ffi::model::*;
use serve::ffi::queue::*;
use serve::ffi::runtime::*;
use serve::ffi::submit::*;
use serve::{
    BackendChoice, CellularOptions, Code, CompletionQueue, Input, ModelOptions, Output, PolicyConfig,
    Runtime, SubmitOptions, TimeoutConfig,
};

/// Held by every test of this file: they measure process-wide threads and memory.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

fn runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap()
}

/// Threads of this process, and how many of them are model workers' stream threads (named
/// `serve-stream-N` by the CPU backend).
fn threads() -> (usize, usize) {
    let (mut all, mut streams) = (0, 0);
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        all += 1;
        // A thread that has just ended has no name left to read: it is not a stream.
        let name = std::fs::read_to_string(t.unwrap().path().join("comm")).unwrap_or_default();
        streams += usize::from(name.starts_with("serve-stream"));
    }
    (all, streams)
}

/// Resident memory of this process, in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * usize::try_from(page).unwrap()
}

/// Threads that may come and go beside the runtime's (the test harness starting the next test's
/// thread, which then waits on [`SERIAL`]; a previous test's compute pool winding down).
const THREAD_SLACK: usize = 3;

/// Wait until the thread counts `(all, stream threads)` satisfy `ok`: a freed model is released
/// on the engine thread a moment after the caller saw its last request complete, and a new
/// thread shows its name a moment after it is spawned. (The limit is generous, only so that a
/// leak fails instead of hanging.)
fn wait_threads(ok: impl Fn((usize, usize)) -> bool, want: &str, what: &str) {
    let give_up = Instant::now() + Duration::from_secs(60);
    loop {
        let now = threads();
        if ok(now) {
            return;
        }
        assert!(
            Instant::now() < give_up,
            "{what}: {} threads ({} stream threads), expected {want}",
            now.0,
            now.1
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Wait until the process has at most `all` threads, at most `streams` of them stream threads.
fn settle(all: usize, streams: usize, what: &str) {
    wait_threads(|(a, s)| a <= all && s <= streams, &format!("at most {all} ({streams})"), what);
}

/// Wait until exactly `n` stream threads show.
fn until_streams(n: usize, what: &str) {
    wait_threads(|(_, s)| s == n, &format!("{n} stream threads"), what);
}

fn mlp_fixture() -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let text = std::fs::read_to_string(fixture("mlp_4_8_3").join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let rows = |k: &str| -> Vec<Vec<f32>> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect())
            .collect()
    };
    (rows("inputs"), rows("outputs"))
}

/// Load, use once and free an mlp and an lstm model.
fn cycle(rt: &Runtime, mlp_in: &[f32], lstm_case: &Case) {
    let mlp = rt.load_model(fixture("mlp_4_8_3"), ModelOptions::default()).unwrap();
    mlp.submit(Input::F32(mlp_in.to_vec()), SubmitOptions::default()).unwrap().wait().unwrap();
    drop(mlp);
    let lstm = rt.load_model(fixture("lstm_small"), ModelOptions::default()).unwrap();
    lstm.submit(lstm_case.input.clone(), SubmitOptions::default()).unwrap().wait().unwrap();
    drop(lstm);
}

#[test]
fn load_free_cycles_release_threads_and_memory() {
    let _serial = serial();
    let rt = runtime();
    let (inputs, _) = mlp_fixture();
    let lstm_cases = cases("lstm_small");
    let streams0 = threads().1;
    // Warm up (allocator arenas, lazily made statics), then measure.
    for _ in 0..20 {
        cycle(&rt, &inputs[0], &lstm_cases[0]);
    }
    settle(usize::MAX, streams0, "warm-up");
    let (threads0, rss0) = (threads().0, rss());
    for k in 0..300 {
        cycle(&rt, &inputs[k % inputs.len()], &lstm_cases[k % lstm_cases.len()]);
    }
    settle(threads0 + THREAD_SLACK, streams0, "after 300 load/free cycles of an mlp and an lstm");
    let grown = rss().saturating_sub(rss0);
    // Unreleased, each cycle costs about 1.4 MB (≈ 430 MB over the loop); released, the loop
    // leaves no more than allocator noise.
    assert!(grown < 30 << 20, "RSS grew by {} MiB over 300 load/free cycles", grown >> 20);
    assert_eq!(rt.stats().completed(Code::Ok), 2 * 320);
}

#[test]
fn a_model_freed_with_requests_in_flight_completes_them_then_is_released() {
    let _serial = serial();
    let rt = runtime();
    let streams0 = threads().1;
    let q = CompletionQueue::new().unwrap();
    // An mlp whose requests wait in its queue for a fuller batch when it is freed, and an lstm
    // with two workers and four state slots, so that most of its requests still wait for slots.
    let (inputs, outputs) = mlp_fixture();
    let slow_batch =
        TimeoutConfig { max_batch: 64, max_wait: Duration::from_millis(300), workers: 2, pad_to_max: false };
    let mlp = rt
        .load_model(
            fixture("mlp_4_8_3"),
            ModelOptions { policy: PolicyConfig::Timeout(slow_batch), ..ModelOptions::default() },
        )
        .unwrap();
    let lstm_cases = cases("lstm_small");
    let lstm = rt
        .load_model(
            fixture("lstm_small"),
            ModelOptions {
                policy: PolicyConfig::Cellular(CellularOptions { workers: 2, ..CellularOptions::default() }),
                state_slots: Some(4),
                ..ModelOptions::default()
            },
        )
        .unwrap();
    until_streams(streams0 + 4, "each worker has a stream thread");
    let mut expected = HashMap::new();
    for k in 0..40u64 {
        let i = k as usize % inputs.len();
        mlp.submit_to(Input::F32(inputs[i].clone()), SubmitOptions::default(), &q, k).unwrap();
        expected.insert(k, Err(i));
    }
    // Freed while its 40 requests wait in its queue for a fuller batch (300 ms).
    drop(mlp);
    for k in 40..440u64 {
        let i = k as usize % lstm_cases.len();
        lstm.submit_to(lstm_cases[i].input.clone(), SubmitOptions::default(), &q, k).unwrap();
        expected.insert(k, Ok(i));
    }
    // A clone keeps the model: only the last handle's drop frees it.
    let lstm2 = lstm.clone();
    drop(lstm);
    while !expected.is_empty() {
        for c in q.next(64, Duration::from_secs(60)).unwrap() {
            let what = format!("request {}", c.tag);
            let case = expected.remove(&c.tag).unwrap_or_else(|| panic!("{what} completed twice"));
            let output = c.result.unwrap_or_else(|e| panic!("{what}: {e}"));
            match (case, output) {
                (Err(i), Output::F32(y)) => common::assert_close(&y, &outputs[i]),
                (Ok(i), y) => check(&lstm_cases[i], y, &what),
                (_, y) => panic!("{what}: unexpected output {y:?}"),
            }
        }
    }
    // The mlp is gone; the lstm (still held by its clone) keeps serving.
    let t = lstm2.submit(lstm_cases[0].input.clone(), SubmitOptions::default()).unwrap();
    check(&lstm_cases[0], t.wait().unwrap(), "after the first handle's drop");
    settle(usize::MAX, streams0 + 2, "the freed mlp's two stream threads");
    drop(lstm2);
    settle(usize::MAX, streams0, "both models freed");
    let extra: Vec<_> = q.next(1, Duration::ZERO).unwrap().into_iter().map(|c| (c.tag, c.result)).collect();
    assert!(extra.is_empty(), "no completion is delivered twice: {extra:?}");
}

#[test]
fn shutdown_with_a_freed_model_pending_and_a_model_outliving_its_runtime() {
    let _serial = serial();
    let (inputs, outputs) = mlp_fixture();
    let base = threads();
    let q = CompletionQueue::new().unwrap();
    let keep;
    {
        let rt = runtime();
        let hold = TimeoutConfig {
            max_batch: 64,
            max_wait: Duration::from_secs(3600),
            workers: 1,
            pad_to_max: false,
        };
        let freed = rt
            .load_model(
                fixture("mlp_4_8_3"),
                ModelOptions { policy: PolicyConfig::Timeout(hold), ..ModelOptions::default() },
            )
            .unwrap();
        keep = rt.load_model(fixture("mlp_4_8_3"), ModelOptions::default()).unwrap();
        for k in 0..8 {
            freed.submit_to(Input::F32(inputs[0].clone()), SubmitOptions::default(), &q, k).unwrap();
        }
        drop(freed);
        let t = keep.submit(Input::F32(inputs[1].clone()), SubmitOptions::default()).unwrap();
        common::assert_close(
            &match t.wait().unwrap() {
                Output::F32(v) => v,
                other => panic!("{other:?}"),
            },
            &outputs[1],
        );
        // Dropping the runtime (no drain) completes the freed model's waiting requests
        // `Cancelled`, each once.
    }
    let mut got = Vec::new();
    while got.len() < 8 {
        for c in q.next(8, Duration::from_secs(60)).unwrap() {
            assert_eq!(c.result.unwrap_err().code(), Code::Cancelled);
            got.push(c.tag);
        }
    }
    got.sort();
    assert_eq!(got, (0..8).collect::<Vec<_>>());
    // A model handle outliving its runtime refuses submits, and dropping it later is harmless.
    let refused = keep.submit(Input::F32(inputs[0].clone()), SubmitOptions::default());
    assert_eq!(refused.err().map(|e| e.code()), Some(Code::Shutdown));
    drop(keep);
    settle(base.0 + THREAD_SLACK, base.1, "runtime and models gone");
}

// The same through the C ABI.

fn ok(e: *mut serve_error) {
    if !e.is_null() {
        let msg = unsafe { std::ffi::CStr::from_ptr(serve_error_message(e)) }.to_string_lossy().into_owned();
        serve_error_free(e);
        panic!("{msg}");
    }
}

fn c_load(rt: *mut serve_runtime, name: &str, opts: *const serve_model_options) -> *mut serve_model {
    let dir = CString::new(fixture(name).to_str().unwrap()).unwrap();
    let mut model = null_mut();
    ok(serve_runtime_load_model(rt, dir.as_ptr(), opts, &mut model));
    model
}

#[test]
fn serve_model_free_completes_pending_requests_then_releases_the_model() {
    let _serial = serial();
    let (inputs, outputs) = mlp_fixture();
    let mut o = null_mut();
    ok(serve_runtime_options_new(&mut o));
    ok(serve_runtime_options_set_backend(o, c"cpu".as_ptr()));
    ok(serve_runtime_options_set_cpu_threads(o, 2));
    let mut rt = null_mut();
    ok(serve_runtime_new(o, &mut rt));
    serve_runtime_options_free(o);
    let mut q = null_mut();
    ok(serve_queue_new(&mut q));

    // Warm up, then load/free cycles leave no thread behind.
    let x = &inputs[0];
    let one = |model: *mut serve_model, tag: u64| {
        ok(serve_submit_f32(model, q, tag, x.as_ptr(), x.len(), null(), null_mut()));
    };
    let mut completions = vec![null_mut(); 64];
    let mut drain = |n: usize| -> Vec<(u64, Code, Vec<f32>)> {
        let mut got = Vec::new();
        while got.len() < n {
            let mut count = 0;
            ok(serve_queue_next(q, completions.as_mut_ptr(), completions.len(), 60_000_000_000, &mut count));
            assert!(count > 0, "no completion within a minute");
            for &c in &completions[..count] {
                let (mut data, mut len) = (null::<f32>(), 0usize);
                let code = serve_completion_code(c);
                if code == Code::Ok {
                    ok(serve_completion_output_f32(c, &mut data, &mut len));
                }
                let v = if len == 0 {
                    Vec::new()
                } else {
                    unsafe { std::slice::from_raw_parts(data, len) }.to_vec()
                };
                got.push((serve_completion_tag(c), code, v));
                serve_completion_free(c);
            }
        }
        got
    };
    let streams0 = threads().1;
    for k in 0..5 {
        let m = c_load(rt, "mlp_4_8_3", null());
        one(m, k);
        drain(1);
        serve_model_free(m);
    }
    settle(usize::MAX, streams0, "warm-up");
    let threads0 = threads().0;
    for k in 0..100 {
        let m = c_load(rt, "mlp_4_8_3", null());
        one(m, k);
        drain(1);
        serve_model_free(m);
    }
    settle(threads0 + THREAD_SLACK, streams0, "after 100 serve_model_free");

    // Requests waiting for a fuller batch when the model is freed complete normally, each once.
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_workers(mo, 2));
    ok(serve_model_options_set_max_batch(mo, 64));
    ok(serve_model_options_set_max_wait_ns(mo, 300_000_000));
    let m = c_load(rt, "mlp_4_8_3", mo);
    serve_model_options_free(mo);
    until_streams(streams0 + 2, "each worker has a stream thread");
    for k in 0..32u64 {
        let x = &inputs[k as usize % inputs.len()];
        ok(serve_submit_f32(m, q, k, x.as_ptr(), x.len(), null(), null_mut()));
    }
    serve_model_free(m);
    let mut got = drain(32);
    got.sort_by_key(|g| g.0);
    for (k, (tag, code, v)) in got.into_iter().enumerate() {
        assert_eq!((tag, code), (k as u64, Code::Ok));
        common::assert_close(&v, &outputs[k % outputs.len()]);
    }
    settle(threads0 + THREAD_SLACK, streams0, "the freed model's stream threads");
    let mut count = 7;
    ok(serve_queue_next(q, completions.as_mut_ptr(), completions.len(), 0, &mut count));
    assert_eq!(count, 0, "no completion is delivered twice");
    serve_queue_free(q);
    serve_runtime_free(rt);
}
