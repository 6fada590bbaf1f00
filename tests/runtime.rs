//! End-to-end behaviour of the Rust runtime API on the CPU backend: outputs, batching, bad input,
//! admission, deadlines, cancel, shutdown, and exactly-once completion under stress.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use common::{Ledger, assert_close, input, mlp_dir, stress_requests, stress_submit, tempdir};
use serve::model::weights::{Tensor, write_safetensors};
use serve::{
    BackendChoice, Code, CompletionQueue, Input, ModelOptions, Output, PolicyConfig, Runtime, SubmitOptions,
    TimeoutConfig,
};

fn runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap()
}

fn timeout_opts(max_batch: usize, max_wait: Duration, workers: usize) -> ModelOptions {
    ModelOptions {
        policy: PolicyConfig::Timeout(TimeoutConfig { max_batch, max_wait, workers, pad_to_max: false }),
        ..ModelOptions::default()
    }
}

fn f32_out(r: serve::Result<Output>) -> Vec<f32> {
    match r.expect("request succeeds") {
        Output::F32(v) => v,
        other => panic!("unexpected output {other:?}"),
    }
}

#[test]
fn mlp_outputs_match_reference_under_batching() {
    let (dir, mlp) = mlp_dir("e2e", &[16, 64, 32, 8], 1);
    let started = Instant::now();
    let rt = runtime();
    for pad in [false, true] {
        let mut opts = timeout_opts(8, Duration::from_micros(200), 2);
        let PolicyConfig::Timeout(c) = &mut opts.policy else { unreachable!("timeout_opts") };
        c.pad_to_max = pad;
        let model = rt.load_model(&dir, opts).unwrap();
        assert_eq!(model.kind(), serve::ModelKind::Mlp);
        let tickets: Vec<_> = (0..100)
            .map(|k| (k, model.submit(Input::F32(input(16, k)), SubmitOptions::default()).unwrap()))
            .collect();
        for (k, t) in tickets {
            assert_close(&f32_out(t.wait()), &mlp.forward_reference(&input(16, k)));
        }
    }
    let s = rt.stats();
    assert_eq!(s.submitted, 200);
    assert_eq!(s.completed(Code::Ok), 200);
    assert!(s.tasks_launched < 200, "requests were batched: {} tasks", s.tasks_launched);
    assert_eq!(s.batched_requests, 200);
    // The engine thread worked (it handled 200 arrivals), never longer than the runtime has
    // existed, and is not counted busy while parked: after 80 ms with nothing to do, the turns
    // that serve one more request add their own time, which lies between the submit and the
    // moment their time is read — not the park's, which lies before the submit.
    let busy = Duration::from_nanos(s.engine_busy_ns);
    assert!(!busy.is_zero() && busy <= started.elapsed(), "engine busy {busy:?}");
    let model = rt.load_model(&dir, timeout_opts(8, Duration::ZERO, 1)).unwrap();
    std::thread::sleep(Duration::from_millis(80));
    let (before, submitted) = (rt.stats().engine_busy_ns, Instant::now());
    model.submit(Input::F32(input(16, 0)), SubmitOptions::default()).unwrap().wait().unwrap();
    // A turn's time is counted when the turn ends, which may be just after the completion.
    let grew = loop {
        let now = rt.stats().engine_busy_ns;
        if now > before {
            break Duration::from_nanos(now - before);
        }
        std::thread::sleep(Duration::from_millis(1));
    };
    let window = submitted.elapsed();
    assert!(grew <= window, "busy {grew:?} for one request served within {window:?}, after 80 ms parked");
}

#[test]
fn large_batches_use_the_thread_pool_and_stay_correct() {
    let (dir, mlp) = mlp_dir("big", &[256, 512, 256], 2);
    let rt = runtime();
    let model = rt.load_model(&dir, timeout_opts(64, Duration::from_millis(5), 1)).unwrap();
    let q = CompletionQueue::new().unwrap();
    for k in 0..256 {
        model.submit_to(Input::F32(input(256, k)), SubmitOptions::default(), &q, k).unwrap();
    }
    let mut seen = 0;
    while seen < 256 {
        for c in q.next(64, Duration::from_secs(10)).unwrap() {
            let Ok(Output::F32(v)) = c.result else { panic!("failed: {:?}", c.result) };
            assert_close(&v, &mlp.forward_reference(&input(256, c.tag)));
            seen += 1;
        }
    }
    assert!(rt.stats().mean_batch() > 1.0);
}

#[test]
fn ticket_is_a_future() {
    use std::future::Future;
    use std::pin::pin;
    use std::task::{Context, Poll, Wake, Waker};

    struct ThreadWaker(std::thread::Thread);
    impl Wake for ThreadWaker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let (dir, mlp) = mlp_dir("future", &[4, 3], 3);
    let rt = runtime();
    let model = rt.load_model(&dir, ModelOptions::default()).unwrap();
    let mut fut = pin!(model.submit(Input::F32(vec![1.0, 2.0, 3.0, 4.0]), SubmitOptions::default()).unwrap());
    let waker = Waker::from(Arc::new(ThreadWaker(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let deadline = Instant::now() + Duration::from_secs(10);
    let out = loop {
        match fut.as_mut().poll(&mut cx) {
            Poll::Ready(r) => break r,
            Poll::Pending => {
                assert!(Instant::now() < deadline, "future never completed");
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
    };
    assert_close(&f32_out(out), &mlp.forward_reference(&[1.0, 2.0, 3.0, 4.0]));
}

#[test]
fn bad_inputs_get_precise_errors_and_the_runtime_keeps_serving() {
    let (dir, mlp) = mlp_dir("bad", &[4, 2], 4);
    let rt = runtime();
    let model = rt.load_model(&dir, ModelOptions::default()).unwrap();
    let cases: Vec<(Input, &str)> = vec![
        (Input::F32(vec![]), "empty input"),
        (Input::F32(vec![1.0; 5]), "input has length 5; this mlp takes an f32 vector of length 4"),
        (Input::F32(vec![1.0; 3]), "input has length 3"),
        (Input::Tokens(vec![1, 2]), "input is a token sequence of length 2"),
        (Input::Tree { tokens: vec![1], parents: vec![-1] }, "input is a tree of 1 nodes"),
    ];
    for (inp, msg) in cases {
        let e = model.submit(inp, SubmitOptions::default()).err().expect("rejected");
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains(msg), "{e}");
    }
    let past = SubmitOptions { deadline: Some(Instant::now() - Duration::from_millis(1)), priority: 0 };
    let e = model.submit(Input::F32(vec![0.0; 4]), past).err().unwrap();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(e.message().contains("already passed"), "{e}");
    // Still serving.
    let out = model.submit(Input::F32(vec![1.0; 4]), SubmitOptions::default()).unwrap().wait();
    assert_close(&f32_out(out), &mlp.forward_reference(&[1.0; 4]));
    let s = rt.stats();
    assert_eq!((s.rejected, s.submitted, s.completed(Code::Ok)), (6, 1, 1));
    assert!(rt.cancel(u64::MAX).is_err_and(|e| e.code() == Code::InvalidArgument));
}

#[test]
fn full_admission_answers_busy_at_once() {
    let (dir, _) = mlp_dir("busy", &[4, 2], 5);
    let rt = runtime();
    let mut opts = timeout_opts(64, Duration::from_secs(30), 1);
    opts.admission_bound = Some(4);
    let model = rt.load_model(&dir, opts).unwrap();
    let tickets: Vec<_> =
        (0..4).map(|_| model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).unwrap()).collect();
    let t0 = Instant::now();
    let e = model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).err().unwrap();
    assert_eq!(e.code(), Code::Busy);
    assert!(t0.elapsed() < Duration::from_secs(10), "BUSY must not wait for the 30 s batch timer");
    assert_eq!(model.admitted(), 4);
    rt.shutdown(Duration::ZERO);
    for t in tickets {
        assert_eq!(t.wait().unwrap_err().code(), Code::Cancelled);
    }
    assert_eq!(model.admitted(), 0, "completions release admission");
}

/// A request holds its place under the admission bound until the caller takes its result: the
/// completions a slow consumer leaves in its queue (or tickets not yet waited for) count, so
/// the memory they hold is bounded too.
#[test]
fn results_not_yet_taken_count_against_the_admission_bound() {
    let (dir, _) = mlp_dir("busy-undrained", &[4, 2], 5);
    let rt = runtime();
    let mut opts = timeout_opts(64, Duration::ZERO, 1);
    opts.admission_bound = Some(3);
    let model = rt.load_model(&dir, opts).unwrap();
    let q = CompletionQueue::new().unwrap();
    for tag in 0..2 {
        model.submit_to(Input::F32(vec![0.0; 4]), SubmitOptions::default(), &q, tag).unwrap();
    }
    let ticket = model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).unwrap();
    // All three complete; none is taken yet.
    let give_up = Instant::now() + Duration::from_secs(20);
    while q.len() < 2 || !ticket.is_done() {
        assert!(Instant::now() < give_up, "the requests did not complete");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(model.admitted(), 3);
    let e = model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).err().unwrap();
    assert_eq!(e.code(), Code::Busy, "{e}");
    // Taking a queued completion frees one place, waiting for the ticket another.
    let taken = q.next(1, Duration::from_secs(10)).unwrap();
    assert_eq!(model.admitted(), 3, "a completion held by the caller still counts");
    drop(taken);
    assert_eq!(model.admitted(), 2);
    ticket.wait().unwrap();
    assert_eq!(model.admitted(), 1);
    model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).unwrap().wait().unwrap();
    drop(q); // the completion left in it is dropped with it
    assert_eq!(model.admitted(), 0);
}

#[test]
fn queued_request_expires_at_its_deadline() {
    let (dir, _) = mlp_dir("deadline", &[4, 2], 6);
    let rt = runtime();
    let model = rt.load_model(&dir, timeout_opts(64, Duration::from_secs(30), 1)).unwrap();
    let t0 = Instant::now();
    let t = model
        .submit(Input::F32(vec![0.0; 4]), SubmitOptions::with_timeout(Duration::from_millis(50)))
        .unwrap();
    let e = t.wait().unwrap_err();
    assert_eq!(e.code(), Code::DeadlineExceeded);
    assert!(e.message().contains("queued"), "{e}");
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(50) && waited < Duration::from_secs(10), "{waited:?}");
}

#[test]
fn cancel_of_a_queued_request_completes_it_cancelled() {
    let (dir, _) = mlp_dir("cancel", &[4, 2], 7);
    let rt = runtime();
    let model = rt.load_model(&dir, timeout_opts(64, Duration::from_secs(30), 1)).unwrap();
    let q = CompletionQueue::new().unwrap();
    let id = model.submit_to(Input::F32(vec![0.0; 4]), SubmitOptions::default(), &q, 42).unwrap();
    rt.cancel(id).unwrap();
    let c = q.next(1, Duration::from_secs(10)).unwrap().pop().expect("completion");
    assert_eq!((c.id, c.tag), (id, 42));
    assert_eq!(c.result.unwrap_err().code(), Code::Cancelled);
    rt.cancel(id).unwrap(); // already complete: no effect, no second completion
    assert!(q.next(1, Duration::from_millis(50)).unwrap().is_empty());
}

/// A cancel sent right after its submit is never overtaken by it: the arrival is in its model's
/// ring before the id is returned, and the engine takes the rings' arrivals before a cancel
/// (inbox.rs). Every request waits 30 s for a fuller batch, so one the cancel missed would
/// complete OK, late.
#[test]
fn a_cancel_right_after_its_submit_always_finds_the_request() {
    let (dir, _) = mlp_dir("cancel_race", &[4, 2], 7);
    let rt = runtime();
    let model = rt.load_model(&dir, timeout_opts(1024, Duration::from_secs(30), 1)).unwrap();
    let q = CompletionQueue::new().unwrap();
    let n = 500;
    for tag in 0..n {
        let id = model.submit_to(Input::F32(vec![0.0; 4]), SubmitOptions::default(), &q, tag).unwrap();
        rt.cancel(id).unwrap();
    }
    let (mut seen, give_up) = (0, std::time::Instant::now() + Duration::from_secs(10));
    while seen < n {
        assert!(std::time::Instant::now() < give_up, "{seen} of {n} cancels completed in 10 s");
        for c in q.next(64, Duration::from_millis(100)).unwrap() {
            assert_eq!(c.result.unwrap_err().code(), Code::Cancelled, "request {}", c.id);
            seen += 1;
        }
    }
}

#[test]
fn shutdown_drains_then_refuses() {
    let (dir, mlp) = mlp_dir("drain", &[4, 2], 8);
    let rt = runtime();
    let model = rt.load_model(&dir, timeout_opts(64, Duration::from_millis(100), 1)).unwrap();
    let tickets: Vec<_> = (0..10)
        .map(|k| (k, model.submit(Input::F32(input(4, k)), SubmitOptions::default()).unwrap()))
        .collect();
    rt.shutdown(Duration::from_secs(10));
    assert!(rt.is_shut_down());
    for (k, t) in tickets {
        assert_close(&f32_out(t.wait()), &mlp.forward_reference(&input(4, k)));
    }
    let e = model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).err().unwrap();
    assert_eq!(e.code(), Code::Shutdown);
    let e = rt.load_model(&dir, ModelOptions::default()).err().unwrap();
    assert_eq!(e.code(), Code::Shutdown);
    rt.shutdown(Duration::ZERO); // idempotent
}

#[test]
fn dropping_the_runtime_cancels_pending_requests() {
    let (dir, _) = mlp_dir("drop", &[4, 2], 9);
    let rt = runtime();
    let model = rt.load_model(&dir, timeout_opts(64, Duration::from_secs(30), 1)).unwrap();
    let t = model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).unwrap();
    drop(rt);
    assert_eq!(t.wait().unwrap_err().code(), Code::Cancelled);
    assert_eq!(
        model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).err().unwrap().code(),
        Code::Shutdown
    );
}

/// Write a model dir with the given model.toml and tensors.
fn write_dir(label: &str, toml: &str, tensors: &[(&str, Tensor)]) -> std::path::PathBuf {
    let dir = tempdir(label);
    std::fs::write(dir.join("model.toml"), toml).unwrap();
    let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (*n, t)).collect();
    write_safetensors(&dir.join("weights.safetensors"), &refs).unwrap();
    dir
}

fn t(shape: &[usize]) -> Tensor {
    Tensor::new(shape.to_vec(), vec![0.5; shape.iter().product()])
}

#[test]
fn model_directory_errors_name_the_problem() {
    let rt = runtime();
    let load = |dir: &std::path::Path| rt.load_model(dir, ModelOptions::default()).err().expect("load fails");

    let e = load(&tempdir("none").join("missing"));
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("does not exist"), "{e}");

    let e = load(&tempdir("empty"));
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("model.toml"), "{e}");

    let good = [("layers.0.weight", t(&[2, 4])), ("layers.0.bias", t(&[2]))];
    let e = load(&write_dir("kind", "kind = \"gru\"\n", &good));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("unknown model kind `gru`"), "{e}");

    let e = load(&write_dir("nokind", "hidden = 3\n", &good));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("missing key `kind`"), "{e}");

    let e = load(&write_dir("badkey", "kind = \"mlp\"\nhiden = 3\n", &good));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("hiden"), "{e}");

    let e = load(&write_dir("badtoml", "kind = \"mlp\n", &good));
    assert_eq!(e.code(), Code::Format);

    let e = load(&write_dir("missing", "kind = \"mlp\"\n", &[("layers.0.weight", t(&[2, 4]))]));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("missing tensor `layers.0.bias`"), "{e}");

    let extra = [("layers.0.weight", t(&[2, 4])), ("layers.0.bias", t(&[2])), ("layers.5.bias", t(&[2]))];
    let e = load(&write_dir("extra", "kind = \"mlp\"\n", &extra));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("unexpected tensor `layers.5.bias`"), "{e}");

    let bad_bias = [("layers.0.weight", t(&[2, 4])), ("layers.0.bias", t(&[3]))];
    let e = load(&write_dir("shape", "kind = \"mlp\"\n", &bad_bias));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("tensor `layers.0.bias` has shape [3], expected [2]"), "{e}");

    let chain = [
        ("layers.0.weight", t(&[2, 4])),
        ("layers.0.bias", t(&[2])),
        ("layers.1.weight", t(&[3, 5])),
        ("layers.1.bias", t(&[3])),
    ];
    let e = load(&write_dir("chain", "kind = \"mlp\"\n", &chain));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("tensor `layers.1.weight` has shape [3, 5], expected [_, 2]"), "{e}");

    let e = load(&write_dir("sizes", "kind = \"mlp\"\ninput = 5\n", &good));
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("input = 5 but the tensors give 4"), "{e}");

    // Non-f32 dtype.
    let dir = tempdir("dtype");
    std::fs::write(dir.join("model.toml"), "kind = \"mlp\"\n").unwrap();
    let half = vec![0u8; 2 * 4 * 2];
    let bias = vec![0u8; 2 * 4];
    let views = vec![
        (
            "layers.0.weight".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F16, vec![2, 4], &half).unwrap(),
        ),
        (
            "layers.0.bias".to_string(),
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &bias).unwrap(),
        ),
    ];
    safetensors::serialize_to_file(views, None, &dir.join("weights.safetensors")).unwrap();
    let e = load(&dir);
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("tensor `layers.0.weight` has dtype F16"), "{e}");

    // Truncated file.
    let dir = write_dir("trunc", "kind = \"mlp\"\n", &good);
    let path = dir.join("weights.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
    let e = load(&dir);
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains("not a valid safetensors file"), "{e}");

    // Missing weights file.
    let dir = write_dir("noweights", "kind = \"mlp\"\n", &good);
    std::fs::remove_file(dir.join("weights.safetensors")).unwrap();
    let e = load(&dir);
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("weights.safetensors"), "{e}");

    // Still serving after all of that.
    let ok = rt.load_model(write_dir("ok", "kind = \"mlp\"\n", &good), ModelOptions::default()).unwrap();
    assert_eq!(
        f32_out(ok.submit(Input::F32(vec![1.0; 4]), SubmitOptions::default()).unwrap().wait()).len(),
        2
    );
}

/// `SERVE_STRESS_REQUESTS` requests (10^5 by default, 10^6 from scripts/stress.sh) from 4
/// threads, random cancels and deadlines, shutdown in the middle: every accepted request completes
/// exactly once with a valid code, and refused ones never complete.
#[test]
fn every_request_completes_exactly_once_under_stress() {
    use rand::{Rng, SeedableRng, rngs::StdRng};
    const THREADS: u64 = 4;
    let n = stress_requests(100_000);
    assert!(n >= 1000, "SERVE_STRESS_REQUESTS={n}: the stress test needs at least 1000 requests");
    let (dir, _) = mlp_dir("stress", &[16, 16], 10);
    let rt = Arc::new(runtime());
    let model = rt.load_model(&dir, timeout_opts(32, Duration::ZERO, 2)).unwrap();
    let q = Arc::new(CompletionQueue::new().unwrap());
    let ledger = Arc::new(Ledger::new(n));
    let submitted = Arc::new(AtomicU64::new(0));
    let start = Arc::new(Barrier::new(THREADS as usize + 1));
    let drainer = ledger.drain(q.clone(), |_| {});
    let submitters: Vec<_> = (0..THREADS)
        .map(|t| {
            let (model, q, rt, ledger, submitted, start) =
                (model.clone(), q.clone(), rt.clone(), ledger.clone(), submitted.clone(), start.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(t);
                start.wait();
                for tag in t * n / THREADS..(t + 1) * n / THREADS {
                    let opts = if rng.random_bool(0.02) {
                        SubmitOptions::with_timeout(Duration::from_micros(rng.random_range(1..200)))
                    } else {
                        SubmitOptions::default()
                    };
                    let admitted =
                        stress_submit(&rt, &model, || Input::F32(vec![0.25; 16]), opts, &q, tag, &mut rng);
                    ledger.submitted(tag, admitted);
                    if admitted {
                        submitted.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    while submitted.load(Ordering::Relaxed) < n / 2 {
        std::thread::sleep(Duration::from_millis(1));
    }
    rt.shutdown(Duration::from_millis(5));
    for s in submitters {
        s.join().unwrap();
    }
    drainer.finish();
    let elapsed = t0.elapsed();
    let tally = ledger.check();
    tally.report("mlp", elapsed);
    // (At least half were admitted: the shutdown waited for them.)
    assert!(tally.refused > 0, "the shutdown happened in the middle");
    tally.check_stats(&rt.stats());
    assert!(tally.completed(Code::Ok) > 0 && tally.completed(Code::Cancelled) > 0);
}

#[test]
fn concurrent_shutdowns_both_wait_and_the_shorter_drain_wins() {
    let (dir, _) = mlp_dir("concurrent-shutdown", &[4, 2], 11);
    let rt = Arc::new(runtime());
    let model = rt.load_model(&dir, timeout_opts(64, Duration::from_secs(30), 1)).unwrap();
    let tickets: Vec<_> =
        (0..8).map(|_| model.submit(Input::F32(vec![0.0; 4]), SubmitOptions::default()).unwrap()).collect();
    let t0 = Instant::now();
    let callers: Vec<_> = [Duration::from_secs(60), Duration::from_millis(20)]
        .into_iter()
        .map(|drain| {
            let rt = rt.clone();
            std::thread::spawn(move || {
                rt.shutdown(drain);
                t0.elapsed()
            })
        })
        .collect();
    let returned: Vec<Duration> = callers.into_iter().map(|c| c.join().unwrap()).collect();
    // Both returned only once the runtime had stopped, well before the long drain.
    assert!(returned.iter().all(|d| *d < Duration::from_secs(30)), "{returned:?}");
    for t in tickets {
        assert!(t.is_done(), "every request completed before shutdown returned");
        assert_eq!(t.wait().unwrap_err().code(), Code::Cancelled);
    }
}
