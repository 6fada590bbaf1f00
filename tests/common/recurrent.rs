//! Recurrent-model checks shared by the CPU tests (tests/recurrent.rs) and the GPU tests
//! (tests/gpu_e2e.rs): the committed fixtures and the exactly-once stress run, on any runtime.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng, rngs::StdRng};
use serve::model::{Lstm, Network, Seq2Seq, TreeLstm};

use super::{Ledger, stress_submit};
use serve::{
    CellularOptions, Code, CompletionQueue, Input, ModelOptions, Output, PaddingConfig, PolicyConfig,
    Runtime, SubmitOptions,
};

/// A committed fixture: under the crate the test was built from, or — for a test binary carried
/// to another machine (a GPU host) and run from a copy of the repository — under the current
/// directory.
pub fn fixture(name: &str) -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata");
    let root = if built.is_dir() { built } else { PathBuf::from("ffi_examples/testdata") };
    root.join(name)
}

/// A fixture's request and expected output (`expected.json`, made with PyTorch semantics by
/// scripts/make_fixtures.py).
pub struct Case {
    pub input: Input,
    pub output: Option<Vec<f32>>,
    pub tokens: Option<Vec<u32>>,
}

pub fn cases(name: &str) -> Vec<Case> {
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
pub fn assert_near(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * w.abs().max(1.0), "{what}: element {i}: {g} vs {w}");
    }
}

/// A served output against a fixture case: floats within 1e-4 relative, tokens exactly.
pub fn check(case: &Case, got: Output, what: &str) {
    match (got, &case.output, &case.tokens) {
        (Output::F32(y), Some(want), _) => assert_near(&y, want, 1e-4, what),
        (Output::Tokens(t), _, Some(want)) => assert_eq!(&t, want, "{what}"),
        (other, _, _) => panic!("{what}: unexpected output {other:?}"),
    }
}

/// The policies every fixture is served under; `types` = the model's cell types.
pub fn policies(types: usize) -> Vec<(&'static str, PolicyConfig)> {
    let small = [3, 2][..types].to_vec();
    vec![
        ("cellular", PolicyConfig::Cellular(CellularOptions::default())),
        (
            "cellular-2w-small",
            PolicyConfig::Cellular(CellularOptions {
                workers: 2,
                max_batch: small,
                max_tasks_to_submit: Some(2),
            }),
        ),
        ("padding", PolicyConfig::Padding(PaddingConfig::default())),
        // One task per level, and tasks of 3 levels (a sequence continued across tasks), instead
        // of a batch of lstm sequences in one task.
        (
            "padding-per-level",
            PolicyConfig::Padding(PaddingConfig { max_steps: 1, ..PaddingConfig::default() }),
        ),
        (
            "padding-3-levels",
            PolicyConfig::Padding(PaddingConfig { max_steps: 3, ..PaddingConfig::default() }),
        ),
        (
            "padding-2w",
            PolicyConfig::Padding(PaddingConfig { workers: 2, max_batch: 3, ..PaddingConfig::default() }),
        ),
    ]
}

/// Serve every fixture under every policy of [`policies`] on `rt`: all requests at once, three
/// times over (so they batch with each other), each checked against its expected output.
pub fn serve_fixtures(rt: &Runtime) {
    for name in ["lstm_small", "seq2seq_small", "treelstm_small"] {
        let cases = cases(name);
        let types = serve::model::load(&fixture(name)).unwrap().cell_types().len();
        // The default folds an LSTM chain's embedding into token-gate tables (the CPU backend);
        // a budget of 0 runs the layers unfolded.
        let configs = policies(types).into_iter().flat_map(|(label, policy)| {
            [(None, "token gates"), (Some(0), "unfolded")]
                .map(|(gates, how)| (format!("{label} / {how}"), policy.clone(), gates))
        });
        for (label, policy, token_gates_bytes) in configs {
            let opts = ModelOptions { policy, token_gates_bytes, ..ModelOptions::default() };
            let model = rt.load_model(fixture(name), opts).unwrap();
            let tickets: Vec<_> = (0..3)
                .flat_map(|_| {
                    cases.iter().map(|c| model.submit(c.input.clone(), SubmitOptions::default()).unwrap())
                })
                .collect();
            for (k, t) in tickets.into_iter().enumerate() {
                let what = format!("{name} / {label} / request {}", k % cases.len());
                check(&cases[k % cases.len()], t.wait().unwrap_or_else(|e| panic!("{what}: {e}")), &what);
            }
        }
    }
}

/// Cancel and deadline stop running requests at a cell boundary, under cellular batching and
/// padding, on `rt`: a long request with a 200 ms deadline (first in, so it runs at once under
/// both policies) expires while running, a second long one is cancelled after 100 ms, and a short
/// one and a later one are served correctly from the freed slots. `net` with `len`-token requests
/// must take far longer than 200 ms per request (the stopped requests cost only until they stop;
/// the margins are wide so that a loaded machine still starts the timed request before its
/// deadline).
pub fn cancel_and_deadline_at_cell_boundaries(rt: &Runtime, net: &Lstm, len: usize) {
    let mut net = net.clone();
    net.cfg.max_len = Some(len);
    let net = &net;
    // Padding runs a batch of lstm sequences in tasks of several levels (stopping at a task's
    // end; all of them in one task, the default, would run the whole long request), or one task
    // per level (stopping at the next level).
    for policy in [
        PolicyConfig::Cellular(CellularOptions::default()),
        PolicyConfig::Padding(PaddingConfig { max_steps: 16, ..PaddingConfig::default() }),
        PolicyConfig::Padding(PaddingConfig { max_steps: 1, ..PaddingConfig::default() }),
    ] {
        let label = format!("{policy:?}");
        let opts = ModelOptions { policy, ..Default::default() };
        let model = rt.add_network(Arc::new(Network::Lstm(net.clone())), "slow".into(), opts).unwrap();
        let long: Vec<u32> = (0..len as u32).map(|i| i % 100).collect();
        let short: Vec<u32> = vec![5, 6, 7];
        // A warm-up request first, so that the timed one starts at once (no first-task set-up
        // within its deadline).
        model.submit(Input::Tokens(short.clone()), SubmitOptions::default()).unwrap().wait().unwrap();
        let timed = model
            .submit(Input::Tokens(long.clone()), SubmitOptions::with_timeout(Duration::from_millis(200)))
            .unwrap();
        let victim = model.submit(Input::Tokens(long.clone()), SubmitOptions::default()).unwrap();
        let other = model.submit(Input::Tokens(short.clone()), SubmitOptions::default()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        rt.cancel(victim.id()).unwrap();
        let e = victim.wait().unwrap_err();
        assert_eq!(e.code(), Code::Cancelled, "{label}: {e}");
        let e = timed.wait().unwrap_err();
        assert_eq!(e.code(), Code::DeadlineExceeded, "{label}: {e}");
        assert!(e.message().contains("while the request was running"), "{label}: {e}");
        // Stopped at cell boundaries, they leave the others unaffected ...
        let Output::F32(y) = other.wait().unwrap() else { panic!("f32 output") };
        assert_near(&y, &net.forward_reference(&short), 1e-4, &label);
        // ... and the freed slots serve new requests, with nothing left of the stopped ones.
        let tail = long[..40].to_vec();
        let Output::F32(y) =
            model.submit(Input::Tokens(tail.clone()), SubmitOptions::default()).unwrap().wait().unwrap()
        else {
            panic!("f32 output")
        };
        assert_near(&y, &net.forward_reference(&tail), 1e-4, &label);
    }
}

/// How [`stress`] sizes its models and checks Seq2Seq decodes.
pub struct Stress {
    pub hidden: usize,
    /// Workers of the lstm, seq2seq and treelstm models.
    pub workers: [usize; 3],
    pub max_tasks_to_submit: usize,
    /// Requests in all, across the submitting threads (at least 3000).
    pub requests: u64,
    /// Accept a Seq2Seq decode that differs from the f64 reference's when it is greedy up to
    /// near-ties of logits ([`check_near_greedy`]); otherwise only its shape is checked (length,
    /// eos last) — fp32 against f64 may break a near-tie either way.
    pub near_greedy: bool,
}

/// The request with `tag`: an lstm, seq2seq or treelstm input (by `tag % 3`), drawn from `tag`
/// alone, so that the drainer can check the output without keeping the input.
fn stress_input(tag: u64) -> Input {
    let mut rng = StdRng::seed_from_u64(tag);
    let n = rng.random_range(1..30);
    match tag % 3 {
        0 | 1 => Input::Tokens((0..n).map(|_| rng.random_range(0..40)).collect()),
        _ => Input::Tree {
            tokens: (0..n).map(|_| rng.random_range(0..40)).collect(),
            parents: (0..n).map(|i| if i == 0 { -1 } else { rng.random_range(0..i) }).collect(),
        },
    }
}

/// Many concurrent recurrent requests of all three kinds under cellular batching on `rt`, with
/// random cancels, deadlines, state-slot back-pressure and a shutdown in the middle: every
/// accepted request completes exactly once, with OK (and then the reference output), CANCELLED
/// or DEADLINE_EXCEEDED; refused ones never complete. Memory stays bounded however many requests
/// (a [`Ledger`] of two bytes per request; completions are checked and dropped as they come).
pub fn stress(rt: Arc<Runtime>, s: Stress) {
    const THREADS: u64 = 3;
    let n = s.requests;
    assert!(n >= 3000, "{n} requests: the recurrent stress test needs at least 3000");
    let h = s.hidden;
    let lstm = Lstm::random(40, 8, h, 2, 1);
    let s2s = Seq2Seq::random(40, 8, h, 1, 1, 2, 6, 2);
    let tree = TreeLstm::random(40, 8, h, 3);
    let cellular = |workers, types: usize| ModelOptions {
        policy: PolicyConfig::Cellular(CellularOptions {
            workers,
            max_batch: [16, 8][..types].to_vec(),
            max_tasks_to_submit: Some(s.max_tasks_to_submit),
        }),
        state_slots: Some(200),
        ..ModelOptions::default()
    };
    let models = [
        rt.add_network(Arc::new(Network::Lstm(lstm.clone())), "lstm".into(), cellular(s.workers[0], 1))
            .unwrap(),
        rt.add_network(Arc::new(Network::Seq2Seq(s2s.clone())), "s2s".into(), cellular(s.workers[1], 2))
            .unwrap(),
        rt.add_network(Arc::new(Network::TreeLstm(tree.clone())), "tree".into(), cellular(s.workers[2], 2))
            .unwrap(),
    ];
    let q = Arc::new(CompletionQueue::new().unwrap());
    let ledger = Arc::new(Ledger::new(n));
    let served: Arc<[AtomicU64; 3]> = Arc::default();
    let near_greedy = s.near_greedy;
    let served_by_drainer = served.clone();
    let t0 = Instant::now();
    let drainer = ledger.drain(q.clone(), move |c| {
        let Ok(out) = &c.result else { return };
        let what = format!("tag {}", c.tag);
        match (c.tag % 3, stress_input(c.tag), out) {
            (0, Input::Tokens(t), Output::F32(y)) => assert_near(y, &lstm.forward_reference(&t), 1e-4, &what),
            (1, Input::Tokens(src), Output::Tokens(t)) => {
                assert!(!t.is_empty() && t.len() <= 6, "{what}: {t:?}");
                assert!(t[..t.len() - 1].iter().all(|&x| x != 2), "{what}: tokens continue past eos: {t:?}");
                if near_greedy && *t != s2s.decode_reference(&src) {
                    check_near_greedy(&s2s, &src, t, &what);
                }
            }
            (2, Input::Tree { tokens, parents }, Output::F32(y)) => {
                assert_near(y, &tree.forward_reference(&tokens, &parents), 1e-4, &what)
            }
            (_, _, other) => panic!("{what}: unexpected output {other:?}"),
        }
        served_by_drainer[(c.tag % 3) as usize].fetch_add(1, Ordering::Relaxed);
    });
    // Thread t submits tags t·n/3 .. (t+1)·n/3, the last third of them once the shutdown began.
    let range = move |t: u64| t * n / THREADS..(t + 1) * n / THREADS;
    let pivot = move |t: u64| range(t).start + (range(t).end - range(t).start) * 2 / 3;
    let attempted = Arc::new(AtomicU64::new(0));
    let submitters: Vec<_> = (0..THREADS)
        .map(|t| {
            let (models, q, rt, ledger, attempted) =
                (models.clone(), q.clone(), rt.clone(), ledger.clone(), attempted.clone());
            std::thread::spawn(move || {
                let mut rng = StdRng::seed_from_u64(100 + t);
                for tag in range(t) {
                    if tag == pivot(t) {
                        // The rest is submitted once the shutdown has begun: some of the
                        // requests are refused, whatever the threads' timing.
                        while !rt.is_shut_down() {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    let opts = if rng.random_bool(0.03) {
                        SubmitOptions::with_timeout(Duration::from_micros(rng.random_range(1..2000)))
                    } else {
                        SubmitOptions::default()
                    };
                    let model = &models[(tag % 3) as usize];
                    let admitted = stress_submit(&rt, model, || stress_input(tag), opts, &q, tag, &mut rng);
                    ledger.submitted(tag, admitted);
                    attempted.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    // Every thread has tried its first two thirds: shut down, in the middle.
    let first_two_thirds: u64 = (0..THREADS).map(|t| pivot(t) - range(t).start).sum();
    while attempted.load(Ordering::Relaxed) < first_two_thirds {
        std::thread::sleep(Duration::from_millis(1));
    }
    rt.shutdown(Duration::from_millis(300));
    for t in submitters {
        t.join().unwrap();
    }
    drainer.finish();
    let elapsed = t0.elapsed();
    let tally = ledger.check();
    tally.report(&format!("recurrent ({})", rt.backend_kind()), elapsed);
    assert!(tally.refused > 0, "the shutdown happened in the middle");
    tally.check_stats(&rt.stats());
    for (kind, served) in served.iter().enumerate() {
        let ok = served.load(Ordering::Relaxed);
        assert!(ok >= 50, "kind {kind}: only {ok} requests served before the shutdown");
    }
}

/// `tokens` is a greedy decode of `src` under `m` up to near-ties: at every step the chosen
/// token's logit (f64 reference, fed the chosen tokens) is within `eps` of the best one, and the
/// sequence stops exactly at `eos` or `max_decode`. Used when the CPU and CUDA backends pick
/// different tokens, which only a near-tie of logits may explain.
pub fn check_near_greedy(m: &Seq2Seq, src: &[u32], tokens: &[u32], what: &str) {
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
