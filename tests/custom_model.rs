//! Custom models through the Rust API (ARCHITECTURE.md §6, `Runtime::add_custom`): the caller's
//! computation batched by libserve — outputs per request, failing and panicking calls (the
//! affected requests complete BACKEND, the model keeps serving), layer-range calls through the
//! runner, bad registrations, and the computation dropped once the model is freed.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serve::backend::{RunnerShape, TaskData, Work};
use serve::model::{CustomCall, CustomExecute, CustomModel, LayerInfo, Network};
use serve::{
    BackendChoice, Code, Input, ModelOptions, Output, PolicyConfig, Runtime, SubmitOptions, TimeoutConfig,
};

/// y = [Σx, 2·x₀] per row (with layers: layer 0 gives Σx, layer 1 [x₀, 2·x₀] of its input);
/// fails a batch holding a negative first input, panics on a first input of 666.
struct Affine {
    calls: AtomicUsize,
    drops: Arc<AtomicUsize>,
}

impl Drop for Affine {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Ordering::SeqCst);
    }
}

impl CustomExecute for Affine {
    fn execute(&self, call: &mut CustomCall<'_>) -> Result<(), String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let (inl, outl) = (call.input.len() / call.batch, call.output.len() / call.batch);
        for r in 0..call.batch {
            let x = &call.input[r * inl..(r + 1) * inl];
            if x[0] == 666.0 {
                panic!("the engine broke on row {r}");
            }
            if x[0] < 0.0 {
                return Err(format!("row {r} is negative"));
            }
            let y = &mut call.output[r * outl..(r + 1) * outl];
            if outl == 1 {
                // Layer 0 of the layered model: the sum alone.
                y[0] = x.iter().sum();
            } else if call.layers.0 == 1 {
                y[0] = x[0];
                y[1] = x[0] * 2.0;
            } else {
                y[0] = x.iter().sum();
                y[1] = x[0] * 2.0;
            }
        }
        Ok(())
    }
}

fn model(drops: &Arc<AtomicUsize>, layers: Vec<LayerInfo>) -> (CustomModel, Arc<Affine>) {
    let exec = Arc::new(Affine { calls: AtomicUsize::new(0), drops: drops.clone() });
    (CustomModel { input_len: 3, output_len: 2, layers, exec: exec.clone() }, exec)
}

#[test]
fn custom_models_batch_fail_and_keep_serving() {
    let rt = Runtime::builder().backend(BackendChoice::Cpu).build().unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let (m, exec) = model(&drops, Vec::new());
    let opts = ModelOptions {
        policy: PolicyConfig::Timeout(TimeoutConfig {
            max_batch: 8,
            max_wait: Duration::from_millis(2),
            ..TimeoutConfig::default()
        }),
        ..ModelOptions::default()
    };
    let model_h = rt.add_custom(m, "affine", opts).unwrap();
    let inputs: Vec<Vec<f32>> = (0..200)
        .map(|k| {
            let first = match k {
                50 => -1.0,
                120 => 666.0,
                _ => k as f32,
            };
            vec![first, 1.0, 2.0]
        })
        .collect();
    let tickets: Vec<_> = inputs
        .iter()
        .map(|x| model_h.submit(Input::F32(x.clone()), SubmitOptions::default()).unwrap())
        .collect();
    let mut failed = Vec::new();
    for (k, t) in tickets.into_iter().enumerate() {
        match t.wait() {
            Ok(Output::F32(y)) => {
                let x = &inputs[k];
                assert_eq!(y, vec![x.iter().sum::<f32>(), x[0] * 2.0], "request {k}");
            }
            Ok(other) => panic!("request {k}: {other:?}"),
            Err(e) => {
                assert_eq!(e.code(), Code::Backend, "request {k}: {e}");
                assert!(
                    e.message().contains("the custom model failed: row")
                        || e.message().contains("the engine broke on row"),
                    "request {k}: {e}"
                );
                failed.push(k);
            }
        }
    }
    assert!(failed.contains(&50) && failed.contains(&120), "{failed:?}");
    assert!(failed.len() <= 16, "only the two poisoned batches fail: {failed:?}");
    let calls = exec.calls.load(Ordering::SeqCst);
    assert!(calls < 200, "batching: {calls} calls for 200 requests");
    // Still serving, and freeing the model drops the computation once its requests are done.
    let y =
        model_h.submit(Input::F32(vec![1.0, 2.0, 3.0]), SubmitOptions::default()).unwrap().wait().unwrap();
    assert_eq!(y, Output::F32(vec![6.0, 2.0]));
    drop(exec);
    drop(model_h);
    rt.shutdown(Duration::from_secs(5));
    drop(rt);
    assert_eq!(drops.load(Ordering::SeqCst), 1, "the computation is dropped once");
}

#[test]
fn bad_custom_models_are_refused_precisely() {
    let rt = Runtime::builder().backend(BackendChoice::Cpu).build().unwrap();
    let drops = Arc::new(AtomicUsize::new(0));
    let cases: Vec<(CustomModel, &str)> = vec![
        (CustomModel { input_len: 0, ..model(&drops, Vec::new()).0 }, "input length is 0"),
        (CustomModel { output_len: 0, ..model(&drops, Vec::new()).0 }, "output length is 0"),
        (CustomModel { input_len: 1 << 23, ..model(&drops, Vec::new()).0 }, "input length is 8388608"),
        (
            model(&drops, vec![LayerInfo::new("a", "custom", 0, 0, 5)]).0,
            "last layer of a custom model gives 5 values",
        ),
        (
            model(
                &drops,
                vec![LayerInfo::new("a", "custom", 0, 0, 0), LayerInfo::new("b", "custom", 0, 0, 2)],
            )
            .0,
            "layer 0 (`a`)",
        ),
    ];
    for (m, want) in cases {
        let e = rt.add_custom(m, "bad", ModelOptions::default()).err().expect("refused");
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains(want), "`{e}` should say `{want}`");
    }
    // A recurrent policy does not fit.
    let e = rt
        .add_custom(
            model(&drops, Vec::new()).0,
            "c",
            ModelOptions { policy: PolicyConfig::Cellular(Default::default()), ..ModelOptions::default() },
        )
        .err()
        .expect("refused");
    assert_eq!(e.code(), Code::Unsupported, "{e}");
}

/// Layer ranges reach the computation through the runner (`Work::Layers`): `(0, 1)` then `(1, 2)`
/// with the first call's output as the second's input; a model without layers refuses them.
#[test]
fn layer_range_calls_reach_the_computation() {
    let drops = Arc::new(AtomicUsize::new(0));
    let layers = vec![LayerInfo::new("sum", "custom", 12, 6, 1), LayerInfo::new("pair", "custom", 8, 4, 2)];
    let (m, _) = model(&drops, layers);
    let backend = serve::backend::create(BackendChoice::Cpu, 1).unwrap();
    let run = |net: Network, work: Work| {
        let runner = backend.prepare(Arc::new(net), RunnerShape::fixed(1, 2), Arc::new(|| {})).unwrap();
        common::run_task(&*runner, TaskData::new(2, work))
    };
    let (mid, e) = run(
        Network::Custom(m.clone()),
        Work::Layers { first: 0, last: 1, input: vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0] },
    );
    assert!(e.is_none(), "{e:?}");
    assert_eq!(mid, vec![6.0, 15.0]);
    let (end, e) = run(Network::Custom(m.clone()), Work::Layers { first: 1, last: 2, input: mid });
    assert!(e.is_none(), "{e:?}");
    assert_eq!(end, vec![6.0, 12.0, 15.0, 30.0]);
    let (_, e) = run(Network::Custom(m), Work::Layers { first: 1, last: 3, input: vec![0.0; 2] });
    assert_eq!(e.map(|e| e.code()), Some(Code::InvalidArgument));
    let (bare, _) = model(&drops, Vec::new());
    let (_, e) = run(Network::Custom(bare), Work::Layers { first: 0, last: 1, input: vec![0.0; 6] });
    assert_eq!(e.map(|e| e.code()), Some(Code::Unsupported));
}

/// Holds its stream while `hold` is set (at most 30 s, so a bug fails instead of hanging), and
/// answers [Σx, 2·x₀] otherwise.
struct Holding {
    hold: Arc<std::sync::atomic::AtomicBool>,
    /// Calls that have returned.
    returned: AtomicUsize,
}

impl CustomExecute for Holding {
    fn execute(&self, call: &mut CustomCall<'_>) -> Result<(), String> {
        let give_up = std::time::Instant::now() + Duration::from_secs(30);
        while self.hold.load(Ordering::SeqCst) && std::time::Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.returned.fetch_add(1, Ordering::SeqCst);
        for (x, y) in call.input.chunks(3).zip(call.output.chunks_mut(2)) {
            y.copy_from_slice(&[x.iter().sum(), x[0] * 2.0]);
        }
        Ok(())
    }
}

/// A CPU stream notifies, so the engine watches it itself (not the poller): its stall watchdog
/// still gives up on a custom computation that hangs, the other models keep serving, and once
/// the computation returns the worker recovers and serves again.
#[test]
fn the_watchdog_gives_up_on_a_hanging_custom_computation_and_sees_it_recover() {
    // Long enough that the other model's tasks are not taken for stalled on a loaded machine.
    let timeout = Duration::from_millis(500);
    let rt = Runtime::builder().backend(BackendChoice::Cpu).stall_timeout(Some(timeout)).build().unwrap();
    let hold = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let exec = Arc::new(Holding { hold: hold.clone(), returned: AtomicUsize::new(0) });
    let custom = |exec: Arc<Holding>| CustomModel { input_len: 3, output_len: 2, layers: Vec::new(), exec };
    let one = |max_batch| ModelOptions {
        policy: PolicyConfig::Timeout(TimeoutConfig {
            max_batch,
            max_wait: Duration::from_micros(1),
            ..TimeoutConfig::default()
        }),
        ..ModelOptions::default()
    };
    let stuck = rt.add_custom(custom(exec.clone()), "stuck", one(1)).unwrap();
    let free = Arc::new(Holding {
        hold: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        returned: AtomicUsize::new(0),
    });
    let fine = rt.add_custom(custom(free), "fine", one(1)).unwrap();
    let input = |x: f32| Input::F32(vec![x, 1.0, 1.0]);

    let t0 = std::time::Instant::now();
    let held = stuck.submit(input(1.0), SubmitOptions::default()).unwrap();
    // Served within 10 s (the hanging call gives up after 30: a bug fails instead of waiting).
    let served = |t: serve::Ticket| t.wait_timeout(Duration::from_secs(10)).ok().expect("served in time");
    // While it hangs, the other model serves.
    for k in 0..20 {
        let out = served(fine.submit(input(k as f32), SubmitOptions::default()).unwrap()).unwrap();
        assert_eq!(out, Output::F32(vec![k as f32 + 2.0, 2.0 * k as f32]));
    }
    let e = served(held).expect_err("the hanging call's request fails");
    assert_eq!(e.code(), Code::Backend, "{e}");
    assert!(e.message().contains("stalled"), "{e}");
    assert!(t0.elapsed() >= timeout, "given up on before the stall timeout: {:?}", t0.elapsed());
    let stalls = |rt: &Runtime| {
        let text = rt.metrics_text();
        text.lines()
            .any(|l| l.starts_with("serve_worker_stalls_total{") && l.contains("stuck") && l.ends_with(" 1"))
    };
    assert!(stalls(&rt), "{}", rt.metrics_text());
    // The call still hangs (its stream holds the task): the engine does not wait for it, the
    // other model serves, and the stalled worker's model fails at once.
    for k in 0..5 {
        let out = served(fine.submit(input(k as f32), SubmitOptions::default()).unwrap()).unwrap();
        assert_eq!(out, Output::F32(vec![k as f32 + 2.0, 2.0 * k as f32]));
    }
    let e = served(stuck.submit(input(2.0), SubmitOptions::default()).unwrap()).expect_err("stalled");
    assert!(e.message().contains("stalled"), "{e}");
    assert_eq!(exec.returned.load(Ordering::SeqCst), 0, "the call returned already: nothing was shown");

    // The call returns: the worker catches up and its model serves again.
    hold.store(false, Ordering::SeqCst);
    let give_up = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        match served(stuck.submit(input(3.0), SubmitOptions::default()).unwrap()) {
            Ok(out) => {
                assert_eq!(out, Output::F32(vec![5.0, 6.0]));
                break;
            }
            Err(e) => {
                assert_eq!(e.code(), Code::Backend, "{e}");
                assert!(std::time::Instant::now() < give_up, "never recovered: {e}");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    rt.shutdown(Duration::from_secs(5));
}
