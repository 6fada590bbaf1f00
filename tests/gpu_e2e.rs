//! End to end on the CUDA backend (DESIGN §5, §9): lstm, seq2seq and treelstm under cellular
//! batching (one and two workers) and the padding baseline against the committed fixtures and
//! against the CPU backend on larger random models, mlp against the CPU backend, cancel and
//! deadline at cell boundaries, and many tasks in flight on several workers completing exactly
//! once.
//!
//! With no CUDA device every test prints `skipped: no CUDA device` and passes, unless
//! `SERVE_REQUIRE_GPU=1`, which makes a missing device (or a CUDA backend that cannot start) a
//! failure.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use serve::model::{Lstm, Mlp, Network, Seq2Seq, TreeLstm};
use serve::{
    BackendChoice, BackendKind, CellularOptions, Code, CompletionQueue, Input, ModelOptions, Output,
    PaddingConfig, PolicyConfig, Runtime, SubmitOptions, TimeoutConfig,
};

/// A runtime on the CUDA backend, or `None` after printing why the test is skipped.
fn cuda_runtime() -> Option<Runtime> {
    let require = std::env::var("SERVE_REQUIRE_GPU").is_ok_and(|v| v == "1");
    let probe = serve::backend::cuda::probe();
    if probe.devices == 0 {
        if require {
            panic!("SERVE_REQUIRE_GPU=1 but there is no CUDA device: {}", probe.summary());
        }
        println!("skipped: no CUDA device ({})", probe.summary());
        return None;
    }
    let rt = Runtime::builder()
        .backend(BackendChoice::Cuda)
        .build()
        .unwrap_or_else(|e| panic!("a CUDA device exists but the CUDA backend cannot start: {e}"));
    assert_eq!(rt.backend_kind(), BackendKind::Cuda);
    println!("backend: {}", rt.backend_description());
    Some(rt)
}

fn cpu_runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(4).build().unwrap()
}

/// A committed fixture: under the crate the test was built from, or — for a test binary carried
/// to another machine (a GPU host) and run from a copy of the repository — under the current
/// directory.
fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata");
    let root = if built.is_dir() { built } else { PathBuf::from("ffi_examples/testdata") };
    root.join(name)
}

/// A fixture's requests and expected outputs (`expected.json`, made with PyTorch semantics).
struct Case {
    input: Input,
    output: Option<Vec<f32>>,
    tokens: Option<Vec<u32>>,
}

fn cases(name: &str) -> Vec<Case> {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let u32s =
        |x: &serde_json::Value| x.as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let tokens: Vec<u32> = u32s(&r["tokens"]);
            let input = match r.get("parents") {
                Some(p) => Input::Tree {
                    tokens,
                    parents: p.as_array().unwrap().iter().map(|x| x.as_i64().unwrap() as i32).collect(),
                },
                None => Input::Tokens(tokens),
            };
            Case {
                input,
                output: r
                    .get("output")
                    .map(|o| o.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()),
                tokens: r.get("output_tokens").map(u32s),
            }
        })
        .collect()
}

/// `got` within `tol · max(1, |want|)` of `want`, element by element.
fn assert_near(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}: element {i}: {g} vs {w}");
    }
}

/// The policies the recurrent models are served under; `types` = the model's cell types.
fn policies(types: usize) -> Vec<(&'static str, PolicyConfig)> {
    let small = vec![3, 2][..types].to_vec();
    vec![
        ("cellular", PolicyConfig::Cellular(CellularOptions::default())),
        (
            "cellular-2w",
            PolicyConfig::Cellular(CellularOptions { workers: 2, max_batch: small, max_tasks_to_submit: 2 }),
        ),
        ("padding", PolicyConfig::Padding(PaddingConfig::default())),
        (
            "padding-2w",
            PolicyConfig::Padding(PaddingConfig { workers: 2, max_batch: 3, ..PaddingConfig::default() }),
        ),
    ]
}

#[test]
fn fixtures_match_their_expected_outputs_on_cuda() {
    let Some(rt) = cuda_runtime() else { return };
    for name in ["lstm_small", "seq2seq_small", "treelstm_small"] {
        let cases = cases(name);
        let types = serve::model::load(&fixture(name)).unwrap().cell_types().len();
        for (label, policy) in policies(types) {
            let model =
                rt.load_model(fixture(name), ModelOptions { policy, ..ModelOptions::default() }).unwrap();
            // Everything at once, three times over, so that requests batch with each other.
            let tickets: Vec<_> = (0..3)
                .flat_map(|_| {
                    cases.iter().map(|c| model.submit(c.input.clone(), SubmitOptions::default()).unwrap())
                })
                .collect();
            for (k, t) in tickets.into_iter().enumerate() {
                let c = &cases[k % cases.len()];
                let what = format!("{name} / {label} / request {}", k % cases.len());
                match (t.wait().unwrap_or_else(|e| panic!("{what}: {e}")), &c.output, &c.tokens) {
                    (Output::F32(y), Some(want), _) => assert_near(&y, want, 1e-4, &what),
                    (Output::Tokens(t), _, Some(want)) => assert_eq!(&t, want, "{what}"),
                    (other, _, _) => panic!("{what}: unexpected output {other:?}"),
                }
            }
        }
    }
}

/// A random tree of `n` nodes (each node's parent comes before it) and its tokens, some absent.
fn tree_input(rng: &mut StdRng, n: usize, vocab: u32) -> Input {
    Input::Tree {
        tokens: (0..n)
            .map(|_| if rng.random_bool(0.1) { u32::MAX } else { rng.random_range(0..vocab) })
            .collect(),
        parents: (0..n).map(|i| if i == 0 { -1 } else { rng.random_range(0..i) as i32 }).collect(),
    }
}

/// Token sequences of WMT-like lengths (log-normal around 24, capped).
fn sentence(rng: &mut StdRng, vocab: u32, max: usize) -> Vec<u32> {
    let len = (24.0 * (rng.random_range(-1.0f64..1.0) * 0.8).exp()).round().clamp(1.0, max as f64) as usize;
    (0..len).map(|_| rng.random_range(0..vocab)).collect()
}

/// `tokens` is a greedy decode of `src` under `m` up to near-ties: at every step the chosen
/// token's logit (f64 reference, fed the chosen tokens) is within `eps` of the best one, and the
/// sequence stops exactly at `eos` or `max_decode`. Used when the CPU and CUDA backends pick
/// different tokens, which only a near-tie of logits may explain.
fn check_near_greedy(m: &Seq2Seq, src: &[u32], tokens: &[u32], what: &str) {
    let (e, h) = (m.cfg.embed, m.cfg.hidden);
    let mut state = m.encoder.zero_state();
    for &t in src {
        m.encoder.step_reference(&m.enc_embedding[t as usize * e..(t as usize + 1) * e], &mut state);
    }
    let mut prev = m.cfg.bos;
    for (i, &t) in tokens.iter().enumerate() {
        m.decoder.step_reference(&m.dec_embedding[prev as usize * e..(prev as usize + 1) * e], &mut state);
        let top = &state.last().unwrap().0;
        let logit = |v: usize| {
            m.proj_bias[v] as f64
                + m.proj_weight[v * h..(v + 1) * h].iter().zip(top).map(|(&w, &x)| w as f64 * x).sum::<f64>()
        };
        let best = (0..m.cfg.vocab).map(logit).fold(f64::NEG_INFINITY, f64::max);
        let chosen = logit(t as usize);
        assert!(
            chosen >= best - 1e-3 * best.abs().max(1.0),
            "{what}: step {i} chose {t} with logit {chosen}, the best is {best}"
        );
        assert!(t != m.cfg.eos || i + 1 == tokens.len(), "{what}: tokens continue past eos");
        prev = t;
    }
    assert!(
        tokens.last() == Some(&m.cfg.eos) || tokens.len() == m.cfg.max_decode,
        "{what}: stopped at {} tokens without eos",
        tokens.len()
    );
}

/// Larger random models (h = 256), many concurrent requests, every policy: the CUDA backend's
/// result of each request against the CPU backend's.
#[test]
fn larger_random_models_match_the_cpu_backend_request_by_request() {
    let Some(gpu) = cuda_runtime() else { return };
    let cpu = cpu_runtime();
    let mut rng = StdRng::seed_from_u64(7);
    let mut lstm = Lstm::random(1000, 128, 256, 2, 1);
    lstm.cfg.max_len = Some(200);
    let s2s = Seq2Seq::random(500, 64, 256, 2, 1, 2, 24, 2);
    let tree = TreeLstm::random(300, 64, 256, 3);
    let nets: Vec<(&str, Network, Vec<Input>)> = vec![
        (
            "lstm",
            Network::Lstm(lstm),
            (0..300).map(|_| Input::Tokens(sentence(&mut rng, 1000, 200))).collect(),
        ),
        (
            "seq2seq",
            Network::Seq2Seq(s2s.clone()),
            (0..200).map(|_| Input::Tokens(sentence(&mut rng, 500, 60))).collect(),
        ),
        (
            "treelstm",
            Network::TreeLstm(tree),
            (0..200)
                .map(|_| {
                    let n = rng.random_range(1..60);
                    tree_input(&mut rng, n, 300)
                })
                .collect(),
        ),
    ];
    for (name, net, inputs) in nets {
        let net = Arc::new(net);
        let types = net.cell_types().len();
        let cpu_model = cpu.add_network(net.clone(), format!("{name}-cpu"), ModelOptions::default()).unwrap();
        let tickets: Vec<_> =
            inputs.iter().map(|x| cpu_model.submit(x.clone(), SubmitOptions::default()).unwrap()).collect();
        let want: Vec<Output> = tickets.into_iter().map(|t| t.wait().unwrap()).collect();
        let mut policies = policies(types);
        policies.push((
            "cellular-4w-64",
            PolicyConfig::Cellular(CellularOptions {
                workers: 4,
                max_batch: vec![64; types],
                max_tasks_to_submit: 5,
            }),
        ));
        for (label, policy) in policies {
            let opts = ModelOptions { policy, admission_bound: Some(10_000), ..ModelOptions::default() };
            let model = gpu.add_network(net.clone(), format!("{name}-{label}"), opts).unwrap();
            let tickets: Vec<_> =
                inputs.iter().map(|x| model.submit(x.clone(), SubmitOptions::default()).unwrap()).collect();
            let mut differ = 0;
            for (k, t) in tickets.into_iter().enumerate() {
                let what = format!("{name} / {label} / request {k}");
                match (t.wait().unwrap_or_else(|e| panic!("{what}: {e}")), &want[k]) {
                    (Output::F32(y), Output::F32(w)) => assert_near(&y, w, 5e-4, &what),
                    (Output::Tokens(t), Output::Tokens(w)) if &t == w => {}
                    (Output::Tokens(t), Output::Tokens(_)) => {
                        let Input::Tokens(src) = &inputs[k] else { unreachable!() };
                        check_near_greedy(&s2s, src, &t, &what);
                        differ += 1;
                    }
                    (got, w) => panic!("{what}: {got:?} vs the CPU's {w:?}"),
                }
            }
            // Near-ties are rare: a systematic difference is a bug even if each step is close.
            assert!(differ * 20 <= inputs.len(), "{name} / {label}: {differ} decodes differ from the CPU's");
        }
    }
}

#[test]
fn mlp_matches_the_cpu_backend() {
    let Some(gpu) = cuda_runtime() else { return };
    let cpu = cpu_runtime();
    let mlp = Arc::new(Network::Mlp(Mlp::random(&[64, 256, 256, 10], 5)));
    let inputs: Vec<Vec<f32>> = (0..400).map(|k| common::input(64, k)).collect();
    let cpu_model = cpu.add_network(mlp.clone(), "mlp-cpu".into(), ModelOptions::default()).unwrap();
    let want: Vec<Output> = inputs
        .iter()
        .map(|x| cpu_model.submit(Input::F32(x.clone()), SubmitOptions::default()).unwrap())
        .collect::<Vec<_>>()
        .into_iter()
        .map(|t| t.wait().unwrap())
        .collect();
    for (label, policy) in [
        ("no-wait", PolicyConfig::Auto),
        (
            "timeout-2w-32",
            PolicyConfig::Timeout(TimeoutConfig {
                max_batch: 32,
                workers: 2,
                max_wait: Duration::from_millis(1),
                ..TimeoutConfig::default()
            }),
        ),
        (
            "static-16",
            PolicyConfig::Timeout(TimeoutConfig {
                max_batch: 16,
                pad_to_max: true,
                ..TimeoutConfig::default()
            }),
        ),
    ] {
        let opts = ModelOptions { policy, ..ModelOptions::default() };
        let model = gpu.add_network(mlp.clone(), format!("mlp-{label}"), opts).unwrap();
        let tickets: Vec<_> = inputs
            .iter()
            .map(|x| model.submit(Input::F32(x.clone()), SubmitOptions::default()).unwrap())
            .collect();
        for (k, t) in tickets.into_iter().enumerate() {
            let what = format!("mlp / {label} / request {k}");
            match (t.wait().unwrap_or_else(|e| panic!("{what}: {e}")), &want[k]) {
                (Output::F32(y), Output::F32(w)) => assert_near(&y, w, 1e-4, &what),
                (got, _) => panic!("{what}: unexpected output {got:?}"),
            }
        }
    }
}

fn code_of(r: serve::Result<Output>) -> (Code, String) {
    let e = r.unwrap_err();
    (e.code(), e.message().to_string())
}

#[test]
fn cancel_and_deadline_stop_a_running_request_at_a_cell_boundary_on_cuda() {
    let Some(rt) = cuda_runtime() else { return };
    // Thousands of steps of 4 layers: far longer than the 10-20 ms below on any GPU (every step
    // is a few dependent kernel launches).
    let mut net = Lstm::random(100, 256, 1024, 4, 11);
    net.cfg.max_len = Some(8000);
    for policy in
        [PolicyConfig::Cellular(CellularOptions::default()), PolicyConfig::Padding(PaddingConfig::default())]
    {
        let label = format!("{policy:?}");
        let model = rt
            .add_network(
                Arc::new(Network::Lstm(net.clone())),
                "slow".into(),
                ModelOptions { policy, ..Default::default() },
            )
            .unwrap();
        let long: Vec<u32> = (0..8000).map(|i| i % 100).collect();
        let short: Vec<u32> = vec![5, 6, 7];
        let started = Instant::now();
        let timed = model
            .submit(Input::Tokens(long.clone()), SubmitOptions::with_timeout(Duration::from_millis(20)))
            .unwrap();
        let victim = model.submit(Input::Tokens(long.clone()), SubmitOptions::default()).unwrap();
        let other = model.submit(Input::Tokens(short.clone()), SubmitOptions::default()).unwrap();
        std::thread::sleep(Duration::from_millis(10));
        rt.cancel(victim.id()).unwrap();
        let (code, msg) = code_of(victim.wait());
        assert_eq!(code, Code::Cancelled, "{label}: {msg}");
        let (code, msg) = code_of(timed.wait());
        assert_eq!(code, Code::DeadlineExceeded, "{label}: {msg}");
        assert!(msg.contains("while the request was running"), "{label}: {msg}");
        let Output::F32(y) = other.wait().unwrap() else { panic!("f32 output") };
        assert_near(&y, &net.forward_reference(&short), 1e-4, &label);
        // The freed slots serve new requests, with the right state (nothing left of the stopped
        // requests).
        let Output::F32(y) = model
            .submit(Input::Tokens(long[..40].to_vec()), SubmitOptions::default())
            .unwrap()
            .wait()
            .unwrap()
        else {
            panic!("f32 output")
        };
        assert_near(&y, &net.forward_reference(&long[..40]), 1e-4, &label);
        assert!(started.elapsed() < Duration::from_secs(120));
    }
}

/// Many requests of all three kinds from several threads on models with several workers and
/// several tasks in flight per worker, with random cancels and deadlines and a shutdown in the
/// middle: every accepted request completes exactly once, with OK (and then the right output),
/// CANCELLED or DEADLINE_EXCEEDED.
#[test]
fn many_tasks_in_flight_on_several_workers_complete_exactly_once() {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};

    let Some(rt) = cuda_runtime() else { return };
    let rt = Arc::new(rt);
    const THREADS: u64 = 3;
    const PER_THREAD: u64 = 2000;
    let lstm = Lstm::random(40, 8, 32, 2, 1);
    let s2s = Seq2Seq::random(40, 8, 32, 1, 1, 2, 6, 2);
    let tree = TreeLstm::random(40, 8, 32, 3);
    let cellular = |workers, types: usize| ModelOptions {
        policy: PolicyConfig::Cellular(CellularOptions {
            workers,
            max_batch: vec![16, 8][..types].to_vec(),
            max_tasks_to_submit: 5,
        }),
        state_slots: Some(400),
        ..ModelOptions::default()
    };
    let models = [
        rt.add_network(Arc::new(Network::Lstm(lstm.clone())), "lstm".into(), cellular(4, 1)).unwrap(),
        rt.add_network(Arc::new(Network::Seq2Seq(s2s.clone())), "s2s".into(), cellular(3, 2)).unwrap(),
        rt.add_network(Arc::new(Network::TreeLstm(tree.clone())), "tree".into(), cellular(2, 2)).unwrap(),
    ];
    let q = Arc::new(CompletionQueue::new().unwrap());
    let submitted = Arc::new(AtomicU64::new(0));
    let input_of = |tag: u64| -> Input {
        let mut rng = StdRng::seed_from_u64(tag);
        let n = rng.random_range(1..30);
        match tag % 3 {
            0 | 1 => Input::Tokens((0..n).map(|_| rng.random_range(0..40)).collect()),
            _ => tree_input(&mut rng, n, 40),
        }
    };
    let submitters: Vec<_> = (0..THREADS)
        .map(|t| {
            let (models, q, rt, submitted) = (models.clone(), q.clone(), rt.clone(), submitted.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(100 + t);
                let (mut accepted, mut refused) = (Vec::new(), Vec::new());
                for i in 0..PER_THREAD {
                    let tag = t * PER_THREAD + i;
                    let opts = if rng.random_bool(0.03) {
                        SubmitOptions::with_timeout(Duration::from_micros(rng.random_range(1..2000)))
                    } else {
                        SubmitOptions::default()
                    };
                    let model = &models[(tag % 3) as usize];
                    let mut result = model.submit_to(input_of(tag), opts, &q, tag);
                    while result.as_ref().is_err_and(|e| e.code() == Code::Busy) {
                        std::thread::yield_now();
                        result = model.submit_to(input_of(tag), opts, &q, tag);
                    }
                    match result {
                        Ok(id) => {
                            accepted.push(tag);
                            submitted.fetch_add(1, Ordering::Relaxed);
                            if rng.random_bool(0.05) {
                                rt.cancel(id).unwrap();
                            }
                        }
                        Err(e) => {
                            assert!(matches!(e.code(), Code::Shutdown | Code::DeadlineExceeded), "{e}");
                            refused.push(tag);
                        }
                    }
                }
                (accepted, refused)
            })
        })
        .collect();
    while submitted.load(Ordering::Relaxed) < THREADS * PER_THREAD * 2 / 3 {
        std::thread::sleep(Duration::from_millis(1));
    }
    rt.shutdown(Duration::from_millis(300));
    let (mut accepted, mut refused) = (Vec::new(), Vec::new());
    for s in submitters {
        let (a, r) = s.join().unwrap();
        accepted.extend(a);
        refused.extend(r);
    }
    let mut seen: HashMap<u64, Code> = HashMap::new();
    loop {
        let batch = q.next(256, Duration::from_millis(50)).unwrap();
        if batch.is_empty() {
            break;
        }
        for c in batch {
            let code = c.result.as_ref().err().map_or(Code::Ok, |e| e.code());
            assert!(seen.insert(c.tag, code).is_none(), "tag {} completed twice", c.tag);
            if let Ok(out) = &c.result {
                let what = format!("tag {}", c.tag);
                match (c.tag % 3, input_of(c.tag), out) {
                    (0, Input::Tokens(t), Output::F32(y)) => {
                        assert_near(y, &lstm.forward_reference(&t), 1e-4, &what)
                    }
                    (1, Input::Tokens(src), Output::Tokens(t)) => {
                        if *t != s2s.decode_reference(&src) {
                            check_near_greedy(&s2s, &src, t, &what);
                        }
                    }
                    (2, Input::Tree { tokens, parents }, Output::F32(y)) => {
                        assert_near(y, &tree.forward_reference(&tokens, &parents), 1e-4, &what)
                    }
                    (_, _, other) => panic!("{what}: unexpected output {other:?}"),
                }
            }
        }
    }
    assert!(!refused.is_empty(), "the shutdown happened in the middle");
    assert_eq!(seen.len(), accepted.len(), "every accepted request completes");
    for tag in &accepted {
        let code = seen.get(tag).unwrap_or_else(|| panic!("tag {tag} never completed"));
        assert!(matches!(code, Code::Ok | Code::Cancelled | Code::DeadlineExceeded), "tag {tag}: {code}");
    }
    assert!(refused.iter().all(|t| !seen.contains_key(t)));
    for kind in 0..3 {
        let ok = seen.iter().filter(|&(t, &c)| t % 3 == kind && c == Code::Ok).count();
        assert!(ok >= 50, "kind {kind}: only {ok} requests served before the shutdown");
    }
}

/// The backend choice: `cuda` gives the CUDA backend when a device exists; `auto` keeps the CPU
/// until this backend has been verified on a GPU (then flip `AUTO_PICKS_CUDA` in
/// src/backend/mod.rs and make this test expect CUDA).
#[test]
fn backend_choice_with_a_device() {
    let Some(rt) = cuda_runtime() else { return };
    assert_eq!(rt.backend_kind(), BackendKind::Cuda);
    assert!(rt.backend_description().starts_with("cuda: device 0: "), "{}", rt.backend_description());
    drop(rt);
    let auto = Runtime::builder().backend(BackendChoice::Auto).build().unwrap();
    assert_eq!(auto.backend_kind(), BackendKind::Cpu, "{}", auto.backend_description());
    assert!(auto.backend_description().contains("not yet verified"), "{}", auto.backend_description());
}
