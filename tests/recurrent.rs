//! Recurrent models (lstm, seq2seq, treelstm) served end to end on the CPU backend under cellular
//! batching and the padding baseline: outputs against the committed fixtures (made by
//! scripts/make_fixtures.py, numpy, PyTorch semantics) and the Rust f64 references, per-request
//! input errors, cancel and deadline at cell boundaries, state-slot back-pressure, and model
//! format errors.

mod common;

use common::recurrent::{
    Stress, cancel_and_deadline_at_cell_boundaries, cases, check, fixture, serve_fixtures, stress,
};

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serve::backend::fault::{FaultKind, FaultPlan};
use serve::model::{Lstm, Network, Seq2Seq, TreeLstm};
use serve::{
    BackendChoice, CellularOptions, Code, Input, ModelOptions, Output, PaddingConfig, PolicyConfig, Runtime,
    SubmitOptions,
};

fn runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap()
}

#[test]
fn fixtures_match_their_expected_outputs_under_every_policy() {
    serve_fixtures(&runtime());
}

#[test]
fn rust_references_agree_with_the_numpy_fixtures() {
    for name in ["lstm_small", "seq2seq_small", "treelstm_small"] {
        let net = serve::model::load(&fixture(name)).unwrap();
        for (i, c) in cases(name).iter().enumerate() {
            let got = match (&net, &c.input) {
                (Network::Lstm(m), Input::Tokens(t)) => Output::F32(m.forward_reference(t)),
                (Network::Seq2Seq(m), Input::Tokens(t)) => Output::Tokens(m.decode_reference(t)),
                (Network::TreeLstm(m), Input::Tree { tokens, parents }) => {
                    Output::F32(m.forward_reference(tokens, parents))
                }
                _ => panic!("fixture {name} does not fit its model"),
            };
            check(c, got, &format!("{name} reference, request {i}"));
        }
    }
}

fn code_of(r: serve::Result<Output>) -> (Code, String) {
    let e = r.unwrap_err();
    (e.code(), e.message().to_string())
}

#[test]
fn bad_inputs_are_refused_per_request_naming_the_problem() {
    let rt = runtime();
    let lstm = rt.load_model(fixture("lstm_small"), ModelOptions::default()).unwrap();
    let tree = rt.load_model(fixture("treelstm_small"), ModelOptions::default()).unwrap();
    let mut short = Lstm::random(10, 4, 8, 1, 3);
    short.cfg.max_len = Some(5);
    let short =
        rt.add_network(Arc::new(Network::Lstm(short)), "short".into(), ModelOptions::default()).unwrap();
    let good = cases("lstm_small");
    // A good request in flight throughout, to show the others are unaffected.
    let ticket = lstm.submit(good[7].input.clone(), SubmitOptions::default()).unwrap();
    let refused = |m: &serve::Model, input: Input| {
        let e = m.submit(input, SubmitOptions::default()).err().expect("refused at submit");
        (e.code(), e.message().to_string())
    };
    let cases_: Vec<(&serve::Model, Input, &str)> = vec![
        (&lstm, Input::Tokens(vec![3, 50, 1]), "token 50 at position 1 is outside the vocabulary"),
        (&lstm, Input::Tokens(vec![]), "empty token sequence"),
        (&short, Input::Tokens(vec![1; 6]), "length 6 is longer than this model's maximum of 5"),
        (
            &lstm,
            Input::F32(vec![1.0]),
            "input is an f32 vector of length 1; a lstm model takes a token sequence",
        ),
        (&tree, Input::Tree { tokens: vec![1, 2], parents: vec![1, 0] }, "no root"),
        (&tree, Input::Tree { tokens: vec![1, 2, 3], parents: vec![-1, 0, -1] }, "two roots: nodes 0 and 2"),
        (&tree, Input::Tree { tokens: vec![1, 2, 3, 4], parents: vec![-1, 2, 3, 1] }, "cycle"),
        (&tree, Input::Tree { tokens: vec![1, 2], parents: vec![-1, 7] }, "node 1 has parent 7"),
        (&tree, Input::Tree { tokens: vec![1, 2], parents: vec![-1] }, "2 tokens but 1 parents"),
        (&tree, Input::Tree { tokens: vec![1, 99], parents: vec![-1, 0] }, "token 99 at node 1"),
        (&tree, Input::Tree { tokens: vec![], parents: vec![] }, "empty tree"),
        (&tree, Input::Tokens(vec![1]), "a treelstm model takes a tree"),
    ];
    for (m, input, want) in cases_ {
        let (code, msg) = refused(m, input);
        assert_eq!(code, Code::InvalidArgument, "{msg}");
        assert!(msg.contains(want), "message {msg:?} should say {want:?}");
    }
    check(&good[7], ticket.wait().unwrap(), "the request in flight");
    // The models keep serving.
    check(
        &good[0],
        lstm.submit(good[0].input.clone(), SubmitOptions::default()).unwrap().wait().unwrap(),
        "after",
    );
    let trees = cases("treelstm_small");
    check(
        &trees[2],
        tree.submit(trees[2].input.clone(), SubmitOptions::default()).unwrap().wait().unwrap(),
        "tree",
    );
}

/// A model slow enough per cell (h = 256, 4 layers) that a long request (20 000 tokens in the
/// cancel/deadline test, 1000 in the slot test) is still running well after submit.
fn slow_lstm() -> Lstm {
    Lstm::random(100, 64, 256, 4, 11)
}

#[test]
fn cancel_and_deadline_stop_a_running_request_at_a_cell_boundary() {
    // 20 000 steps of 4 layers take far longer than 200 ms, in any build.
    cancel_and_deadline_at_cell_boundaries(&runtime(), &slow_lstm(), 20_000);
}

/// One tree request per token list, all of shape `parents`, submitted in order.
fn submit_trees(model: &serve::Model, inputs: &[Vec<u32>], parents: &[i32]) -> Vec<serve::Ticket> {
    inputs
        .iter()
        .map(|t| {
            model
                .submit(
                    Input::Tree { tokens: t.clone(), parents: parents.to_vec() },
                    SubmitOptions::default(),
                )
                .unwrap()
        })
        .collect()
}

#[test]
fn requests_wait_for_state_slots_in_order_and_all_complete() {
    let rt = runtime();
    let net = TreeLstm::random(30, 8, 16, 5);
    // 9 slots: a 5-node tree takes 5, so at most one such tree runs at a time.
    let opts = ModelOptions { state_slots: Some(9), ..ModelOptions::default() };
    let model = rt.add_network(Arc::new(Network::TreeLstm(net.clone())), "t".into(), opts).unwrap();
    let parents = vec![-1, 0, 0, 1, 1];
    let inputs: Vec<Vec<u32>> = (0..20).map(|k| (0..5).map(|i| (k * 5 + i) % 30).collect()).collect();
    let tickets = submit_trees(&model, &inputs, &parents);
    // One waiting request cancelled: it completes at once, the rest are served.
    rt.cancel(tickets[19].id()).unwrap();
    for (k, t) in tickets.into_iter().enumerate() {
        match t.wait() {
            Ok(Output::F32(y)) => common::assert_close(&y, &net.forward_reference(&inputs[k], &parents)),
            Err(e) if k == 19 => assert_eq!(e.code(), Code::Cancelled),
            other => panic!("request {k}: {other:?}"),
        }
    }
    // A tree larger than the whole arena is refused at submit.
    let big = Input::Tree { tokens: vec![1; 10], parents: (0..10).map(|i| i - 1).collect() };
    let e = model.submit(big, SubmitOptions::default()).err().unwrap();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("needs 10 state slots"), "{}", e.message());
}

#[test]
fn seq2seq_from_code_matches_its_reference_under_load() {
    let rt = runtime();
    let net = Seq2Seq::random(20, 8, 16, 2, 1, 2, 9, 21);
    let model =
        rt.add_network(Arc::new(Network::Seq2Seq(net.clone())), "s".into(), ModelOptions::default()).unwrap();
    let inputs: Vec<Vec<u32>> =
        (0..40).map(|k| (0..1 + k % 13).map(|i| ((k * 7 + i * 3) % 17 + 3) as u32).collect()).collect();
    let tickets: Vec<_> = inputs
        .iter()
        .map(|t| model.submit(Input::Tokens(t.clone()), SubmitOptions::default()).unwrap())
        .collect();
    for (k, t) in tickets.into_iter().enumerate() {
        let Output::Tokens(got) = t.wait().unwrap() else { panic!("token output") };
        // The f64 reference may differ only on a near-tie of logits; random weights make that rare
        // and this seed has none.
        assert_eq!(got, net.decode_reference(&inputs[k]), "request {k}");
    }
}

#[test]
fn policies_that_do_not_fit_the_model_kind_are_unsupported() {
    let rt = runtime();
    let opts = ModelOptions { policy: PolicyConfig::Timeout(Default::default()), ..ModelOptions::default() };
    let e = rt.load_model(fixture("lstm_small"), opts).err().unwrap();
    assert_eq!(e.code(), Code::Unsupported);
    let opts = ModelOptions {
        policy: PolicyConfig::Cellular(CellularOptions::default()),
        ..ModelOptions::default()
    };
    let e = rt.load_model(fixture("mlp_4_8_3"), opts).err().unwrap();
    assert_eq!(e.code(), Code::Unsupported);
}

fn copy_fixture(name: &str) -> PathBuf {
    let dir = common::tempdir(name);
    for f in ["model.toml", "weights.safetensors"] {
        std::fs::copy(fixture(name).join(f), dir.join(f)).unwrap();
    }
    dir
}

#[test]
fn model_format_errors_name_the_key_or_tensor() {
    // A tensor missing, extra or misshaped: rewrite the weights from a loaded model.
    let Network::Lstm(m) = serve::model::load(&fixture("lstm_small")).unwrap() else { panic!() };
    let mut tensors = m.tensors();
    let write = |dir: &Path, tensors: &[(String, serve::model::weights::Tensor)]| {
        let refs: Vec<(&str, &serve::model::weights::Tensor)> =
            tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        serve::model::weights::write_safetensors(&dir.join("weights.safetensors"), &refs).unwrap();
    };
    let dir = copy_fixture("lstm_small");
    let removed = tensors.pop().unwrap();
    write(&dir, &tensors);
    let e = serve::model::load(&dir).unwrap_err();
    assert_eq!(e.code(), Code::Format);
    assert!(e.message().contains(&removed.0), "{}", e.message());
    tensors.push(removed);
    tensors.push(("extra.weight".into(), serve::model::weights::Tensor::new(vec![1], vec![0.0])));
    write(&dir, &tensors);
    assert!(serve::model::load(&dir).unwrap_err().message().contains("unexpected tensor `extra.weight`"));
    tensors.pop();
    tensors[0].1 = serve::model::weights::Tensor::new(vec![2, 2], vec![0.0; 4]);
    write(&dir, &tensors);
    let e = serve::model::load(&dir).unwrap_err();
    assert!(e.message().contains("`embedding.weight` has shape [2, 2]"), "{}", e.message());

    // model.toml problems.
    let dir = copy_fixture("seq2seq_small");
    let toml = std::fs::read_to_string(dir.join("model.toml")).unwrap();
    for (edit, want) in [
        (toml.replace("eos = 2", "eos = 40"), "eos = 40 is outside the vocabulary"),
        (toml.replace("layers = 2", "layers = 0"), "layers must be at least 1"),
        (toml.clone() + "dropout = 0.1\n", "unknown field `dropout`"),
        (toml.replace("max_decode = 12\n", ""), "missing field `max_decode`"),
    ] {
        std::fs::write(dir.join("model.toml"), edit).unwrap();
        let e = serve::model::load(&dir).unwrap_err();
        assert_eq!(e.code(), Code::Format, "{}", e.message());
        assert!(e.message().contains(want), "{} should say {want}", e.message());
    }
}

#[test]
fn saved_models_load_back_identically() {
    for net in [
        Network::Lstm(Lstm::random(12, 4, 6, 2, 1)),
        Network::Seq2Seq(Seq2Seq::random(12, 4, 6, 2, 1, 2, 5, 2)),
        Network::TreeLstm(TreeLstm::random(12, 4, 6, 3)),
    ] {
        let dir = common::tempdir("save");
        net.save(&dir).unwrap();
        assert_eq!(serve::model::load(&dir).unwrap(), net);
    }
}

/// Many concurrent recurrent requests of all three kinds with random cancels, deadlines, slot
/// back-pressure and a shutdown in the middle: every accepted request completes exactly once.
#[test]
fn every_recurrent_request_completes_exactly_once_under_stress() {
    let rt = Arc::new(runtime());
    stress(
        rt,
        Stress {
            hidden: 16,
            workers: [2, 1, 2],
            max_tasks_to_submit: 3,
            requests: common::stress_requests(100_000),
            near_greedy: false,
        },
    );
}

/// A padded tree level can hold far more rows than any cellular task (batch × the widest level):
/// the CPU runner grows its step buffers for it instead of allocating that much up front.
#[test]
fn padded_tree_levels_larger_than_the_preallocated_buffers_are_served() {
    // The first tree's first task holds its stream for a second (an injected stall), and one
    // task at a time is submitted: the other 63 trees queue meanwhile, whatever the machine's
    // speed, and run as one batch. (Submitted as they came, on a loaded machine they split into
    // many small batches.)
    let plan =
        FaultPlan::new().at(Some(0), 0, FaultKind::Stall { release_after: Some(Duration::from_secs(1)) });
    let rt = Runtime::builder()
        .backend(BackendChoice::Cpu)
        .cpu_threads(2)
        .inject_faults(plan.clone())
        .build()
        .unwrap();
    let net = TreeLstm::random(50, 8, 8, 9);
    let opts = ModelOptions {
        policy: PolicyConfig::Padding(PaddingConfig {
            max_batch: 64,
            max_tasks_to_submit: 1,
            ..PaddingConfig::default()
        }),
        ..ModelOptions::default()
    };
    let model = rt.add_network(Arc::new(Network::TreeLstm(net.clone())), "wide".into(), opts).unwrap();
    // Stars: a root with 40 leaves, so one leaf level of 63 trees pads to 63 × 40 = 2520 rows.
    let parents: Vec<i32> = std::iter::once(-1).chain(std::iter::repeat_n(0, 40)).collect();
    let inputs: Vec<Vec<u32>> = (0..64).map(|k| (0..41).map(|i| (k + i) % 50).collect()).collect();
    let tickets = submit_trees(&model, &inputs, &parents);
    for (k, t) in tickets.into_iter().enumerate() {
        let Output::F32(y) = t.wait().unwrap() else { panic!("f32 output") };
        common::assert_close(&y, &net.forward_reference(&inputs[k], &parents));
    }
    assert_eq!(plan.fired(), 1);
    let s = rt.stats();
    assert_eq!(s.batched_requests, 64 * 41);
    // The lone first tree (leaves, root), then the other 63 (leaves: 2520 rows, root).
    assert_eq!(s.tasks_launched, 4, "two batches of two levels each");
}

/// A request waiting for a state slot (the arena is full) still expires at its deadline, without
/// waiting for a slot to free up.
#[test]
fn a_request_waiting_for_a_state_slot_expires_at_its_deadline() {
    let rt = runtime();
    let net = slow_lstm();
    let opts = ModelOptions { state_slots: Some(1), ..ModelOptions::default() };
    let model = rt.add_network(Arc::new(Network::Lstm(net.clone())), "one-slot".into(), opts).unwrap();
    let long: Vec<u32> = (0..1000).map(|i| i % 100).collect();
    let holder = model.submit(Input::Tokens(long.clone()), SubmitOptions::default()).unwrap();
    let started = Instant::now();
    let waiting = model
        .submit(Input::Tokens(vec![1, 2, 3]), SubmitOptions::with_timeout(Duration::from_millis(20)))
        .unwrap();
    let (code, msg) = code_of(waiting.wait());
    let waited = started.elapsed();
    assert_eq!(code, Code::DeadlineExceeded, "{msg}");
    assert!(msg.contains("queued"), "{msg}");
    // The holder of the only slot is still running: the expiry did not wait for the slot.
    assert_eq!(rt.stats().running, 1, "expired after {waited:?}, before the slot was free");
    rt.cancel(holder.id()).unwrap();
    assert_eq!(code_of(holder.wait()).0, Code::Cancelled);
    // The freed slot serves the next request.
    let Output::F32(y) =
        model.submit(Input::Tokens(vec![4, 5]), SubmitOptions::default()).unwrap().wait().unwrap()
    else {
        panic!("f32 output")
    };
    common::assert_close(&y, &net.forward_reference(&[4, 5]));
}
