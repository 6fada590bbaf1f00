//! End to end on the CUDA backend (ARCHITECTURE.md §5, §9): lstm, seq2seq and treelstm under cellular
//! batching (one and two workers) and the padding baseline against the committed fixtures and
//! against the CPU backend on larger random models, mlp against the CPU backend, cancel and
//! deadline at cell boundaries, many tasks in flight on several workers completing exactly
//! once, models freed and loaded again while the runtime serves (a CUDA runner dropped
//! mid-run, its index reused), and elastic batching's device ring (each input copied to the
//! device once, at arrival; a batch copied from there on the device, no gather or upload at launch).
//!
//! With no CUDA device every test prints `skipped: no CUDA device` and passes, unless
//! `SERVE_REQUIRE_GPU=1`, which makes a missing device (or a CUDA backend that cannot start) a
//! failure.

mod common;

use common::layer_fixtures::{assert_close, serve_layer_fixtures};
use common::recurrent::{
    Stress, assert_near, cancel_and_deadline_at_cell_boundaries, check_near_greedy, policies, serve_fixtures,
    stress,
};
use common::run_ok;

use std::sync::Arc;
use std::time::Duration;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serve::backend::{RunnerShape, Work};
use serve::model::bert::{Bert, BertConfig};
use serve::model::resnet::{ResNet, ResNetConfig};
use serve::model::{Lstm, Mlp, Network, Seq2Seq, TreeLstm};
use serve::{
    BackendChoice, BackendKind, CellularOptions, Code, ElasticConfig, Input, ModelOptions, Output,
    PolicyConfig, Runtime, SubmitOptions, TimeoutConfig,
};

/// A runtime on the CUDA backend, or `None` after printing why the test is skipped.
fn cuda_runtime() -> Option<Runtime> {
    let probe = serve::backend::cuda::probe();
    if probe.devices == 0 {
        return common::gpu::skip(&format!("no CUDA device ({})", probe.summary()));
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

#[test]
fn fixtures_match_their_expected_outputs_on_cuda() {
    let Some(rt) = cuda_runtime() else { return };
    serve_fixtures(&rt);
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

/// Larger random models (h = 256), many concurrent requests, every policy: the CUDA backend's
/// result of each request against the CPU backend's.
#[test]
fn larger_random_models_match_the_cpu_backend_request_by_request() {
    let Some(gpu) = cuda_runtime() else { return };
    let started = std::time::Instant::now();
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
                max_tasks_to_submit: Some(5),
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
        // The CUDA runner times every task's work on its stream (two events around it): each
        // finished task reports a device time, which is not zero (the events bracket the work)
        // and cannot exceed the time since the runtime started.
        let s = gpu.stats();
        assert_eq!(s.timed_tasks, s.tasks_launched, "{name}: every CUDA task is timed: {s:?}");
        let mean = s.mean_task_compute().expect("timed tasks");
        assert!(mean > Duration::ZERO && mean <= started.elapsed(), "{name}: mean task device time {mean:?}");
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

#[test]
fn cancel_and_deadline_stop_a_running_request_at_a_cell_boundary_on_cuda() {
    let Some(rt) = cuda_runtime() else { return };
    // 100 000 steps of 4 layers: far longer than 200 ms on any GPU (every step is a few
    // dependent kernel launches).
    let net = Lstm::random(100, 256, 1024, 4, 11);
    cancel_and_deadline_at_cell_boundaries(&rt, &net, 100_000);
}

/// Many tasks in flight on several workers (MaxTasksToSubmit 5), with random cancels, deadlines
/// and a shutdown in the middle: every accepted request completes exactly once, with OK (and then
/// the right output), CANCELLED or DEADLINE_EXCEEDED.
#[test]
fn many_tasks_in_flight_on_several_workers_complete_exactly_once() {
    let Some(rt) = cuda_runtime() else { return };
    stress(
        Arc::new(rt),
        Stress {
            hidden: 32,
            workers: [4, 3, 2],
            max_tasks_to_submit: 5,
            requests: common::stress_requests(6000),
            near_greedy: true,
        },
    );
}

/// The backend choice: with a usable device, `cuda` and `auto` both give the CUDA backend (`auto`
/// picked the CPU until this backend had passed these tests on a GPU, an H200).
#[test]
fn backend_choice_with_a_device() {
    let Some(rt) = cuda_runtime() else { return };
    assert_eq!(rt.backend_kind(), BackendKind::Cuda);
    assert!(rt.backend_description().starts_with("cuda: device 0: "), "{}", rt.backend_description());
    drop(rt);
    let auto = Runtime::builder().backend(BackendChoice::Auto).build().unwrap();
    assert_eq!(auto.backend_kind(), BackendKind::Cuda, "{}", auto.backend_description());
    assert!(auto.backend_description().starts_with("cuda: device 0: "), "{}", auto.backend_description());
}

/// Load, serve and free an lstm and an mlp on CUDA 20 times in one runtime, freeing each while
/// its requests are in flight: every request completes with the CPU backend's answer, and a
/// model loaded after the last free still serves (the freed runners dropped mid-run, their
/// indices reused).
#[test]
fn models_freed_and_loaded_again_keep_serving_on_cuda() {
    let Some(gpu) = cuda_runtime() else { return };
    let cpu = cpu_runtime();
    let lstm = Arc::new(Network::Lstm(Lstm::random(100, 32, 64, 2, 7)));
    let mlp = Arc::new(Network::Mlp(Mlp::random(&[16, 64, 8], 3)));
    let mut rng = StdRng::seed_from_u64(11);
    let sentences: Vec<Vec<u32>> = (0..16).map(|_| sentence(&mut rng, 100, 60)).collect();
    let vectors: Vec<Vec<f32>> = (0..16).map(|k| common::input(16, k)).collect();
    let answers = |rt: &Runtime, net: &Arc<Network>, inputs: Vec<Input>| -> Vec<Output> {
        let m = rt.add_network(net.clone(), "m".into(), ModelOptions::default()).unwrap();
        let tickets: Vec<_> =
            inputs.into_iter().map(|x| m.submit(x, SubmitOptions::default()).unwrap()).collect();
        drop(m); // freed with its requests in flight
        tickets.into_iter().map(|t| t.wait().unwrap()).collect()
    };
    let lstm_in = || sentences.iter().map(|t| Input::Tokens(t.clone())).collect::<Vec<_>>();
    let mlp_in = || vectors.iter().map(|x| Input::F32(x.clone())).collect::<Vec<_>>();
    let (want_lstm, want_mlp) = (answers(&cpu, &lstm, lstm_in()), answers(&cpu, &mlp, mlp_in()));
    for cycle in 0..20 {
        for (net, inputs, want) in [(&lstm, lstm_in(), &want_lstm), (&mlp, mlp_in(), &want_mlp)] {
            for (k, (got, want)) in answers(&gpu, net, inputs).into_iter().zip(want).enumerate() {
                match (got, want) {
                    (Output::F32(y), Output::F32(w)) => {
                        assert_near(&y, w, 1e-4, &format!("cycle {cycle}, {k}"))
                    }
                    (got, _) => panic!("cycle {cycle}, request {k}: unexpected output {got:?}"),
                }
            }
        }
    }
}

/// The PyTorch fixtures of the layer models (resnet basic and bottleneck, bert) served on CUDA
/// under timeout batching: PyTorch's outputs within 1e-4 of each output's scale (FP32 GEMMs,
/// TF32 off), as on the CPU (tests/layer_models.rs).
#[test]
fn layer_model_fixtures_match_pytorch_on_cuda() {
    let Some(rt) = cuda_runtime() else { return };
    serve_layer_fixtures(&rt, "CUDA");
}

/// Larger random layer models on both backends through their runners: the whole model on CUDA
/// against the CPU backend, and on CUDA every split into two layer ranges (`Work::Layers`, the
/// first range's output the second's input) against the whole model.
#[test]
fn layer_ranges_on_cuda_match_the_cpu_backend() {
    if cuda_runtime().is_none() {
        return;
    }
    let gpu = serve::backend::create(BackendChoice::Cuda, 1).unwrap();
    let cpu = serve::backend::create(BackendChoice::Cpu, 2).unwrap();
    let resnet = Network::ResNet(ResNet::random(
        &ResNetConfig {
            name: None,
            block: "bottleneck".into(),
            layers: [1, 2, 1, 1],
            num_classes: 10,
            image: [3, 40, 36],
            width: Some(8),
        },
        5,
    ));
    let bert = Network::Bert(Bert::random(
        &BertConfig {
            name: None,
            vocab: 500,
            hidden: 48,
            layers: 3,
            heads: 4,
            intermediate: 96,
            max_position: 16,
            type_vocab: 2,
            seq_len: 12,
            layer_norm_eps: None,
        },
        6,
    ));
    // Logits outnumbering every activation (a tiny image, many classes).
    let wide = Network::ResNet(ResNet::random(
        &ResNetConfig {
            name: None,
            block: "basic".into(),
            layers: [1, 1, 1, 1],
            num_classes: 3000,
            image: [3, 6, 5],
            width: Some(4),
        },
        8,
    ));
    let rows = 3;
    for net in [resnet, bert, wide] {
        let net = Arc::new(net);
        let kind = net.kind();
        let input: Vec<f32> = match &*net {
            Network::Bert(_) => {
                let mut v = vec![0.0; rows * 12];
                for (r, len) in [5usize, 12, 1].into_iter().enumerate() {
                    let ids = (0..len).map(|p| ((r * 131 + p * 17) % 500) as u32).collect();
                    net.dense_row(&Input::Tokens(ids), &mut v[r * 12..(r + 1) * 12]);
                }
                v
            }
            _ => serve::workload::values(rows * net.dense_lens().0, 3, 1.0),
        };
        let shape = RunnerShape::fixed(1, rows);
        let g = gpu.prepare(net.clone(), shape, Arc::new(|| {})).unwrap();
        let c = cpu.prepare(net.clone(), shape, Arc::new(|| {})).unwrap();
        let whole = run_ok(&*g, rows, Work::Dense(input.clone()));
        let want = run_ok(&*c, rows, Work::Dense(input.clone()));
        for r in 0..rows {
            let n = whole.len() / rows;
            assert_close(
                &whole[r * n..(r + 1) * n],
                &want[r * n..(r + 1) * n],
                1e-4,
                &format!("{kind} row {r}: CUDA vs CPU"),
            );
        }
        let layers = net.layers().len();
        for split in 1..layers {
            let mid = run_ok(&*g, rows, Work::Layers { first: 0, last: split, input: input.clone() });
            let cpu_mid = run_ok(&*c, rows, Work::Layers { first: 0, last: split, input: input.clone() });
            assert_close(&mid, &cpu_mid, 1e-4, &format!("{kind}: layers 0..{split} on CUDA vs CPU"));
            let end = run_ok(&*g, rows, Work::Layers { first: split, last: layers, input: mid });
            assert_close(&end, &whole, 1e-5, &format!("{kind}: split at layer {split}"));
        }
    }
}

/// A small resnet and an mlp, the two models whose CUDA runners read a ring run on the device.
fn ring_models() -> Vec<Arc<Network>> {
    vec![Arc::new(common::small_resnet()), Arc::new(Network::Mlp(Mlp::random(&[48, 96, 10], 12)))]
}

/// E²bird's memory pool on CUDA, through a runner: the ring of a resnet or an mlp is mirrored on
/// the device, each write one copy there; a task whose batch is a run of slots reads them on the
/// device (no staging, no upload at launch) and computes what the same rows compute uploaded;
/// slots written again (after the task that read them ended) carry the new rows. A bert reads its
/// tokens on the host, so its ring stays on the heap.
#[test]
fn ring_runs_are_read_in_the_device_ring() {
    if cuda_runtime().is_none() {
        return;
    }
    use serve::backend::cuda::ring::DeviceRing;
    let gpu = serve::backend::create(BackendChoice::Cuda, 1).unwrap();
    for net in ring_models() {
        let kind = net.kind();
        let len = net.dense_lens().0;
        let runner = gpu.prepare(net.clone(), RunnerShape::fixed(1, 4), Arc::new(|| {})).unwrap();
        let ring = Arc::new(runner.input_ring(8, len).unwrap());
        let device = DeviceRing::of(&ring).unwrap_or_else(|| panic!("{kind}: the ring is not on the device"));
        for round in 0..3u64 {
            let rows: Vec<f32> = serve::workload::values(8 * len, 100 + round, 1.0);
            for s in 0..8 {
                // SAFETY: no task reading the ring is in flight (run_task waits for each).
                unsafe { ring.write(s, |row| row.copy_from_slice(&rows[s * len..(s + 1) * len])) }.unwrap();
            }
            for (first, n) in [(0, 4), (4, 3), (7, 1)] {
                let got = run_ok(&*runner, n, Work::Ring(ring.rows(first, n).unwrap()));
                let want = run_ok(&*runner, n, Work::Dense(rows[first * len..(first + n) * len].to_vec()));
                assert_close(
                    &got,
                    &want,
                    1e-6,
                    &format!("{kind} round {round}: slots {first}..+{n} on the device"),
                );
            }
        }
        assert_eq!(device.copies(), 3 * 8, "{kind}: one copy per write");
        assert_eq!(device.device_reads(), 3 * 3, "{kind}: every ring task read its run on the device");
    }
    let bert = Arc::new(Network::Bert(Bert::random(
        &BertConfig {
            name: None,
            vocab: 50,
            hidden: 16,
            layers: 1,
            heads: 2,
            intermediate: 32,
            max_position: 8,
            type_vocab: 2,
            seq_len: 8,
            layer_norm_eps: None,
        },
        13,
    )));
    let runner = gpu.prepare(bert.clone(), RunnerShape::fixed(1, 4), Arc::new(|| {})).unwrap();
    let ring = runner.input_ring(8, bert.dense_lens().0).unwrap();
    assert!(DeviceRing::of(&ring).is_none() && ring.mirror().is_none(), "a bert ring stays on the host");
}

/// Elastic batching (N-Ebird) on CUDA serves a resnet and an mlp as the CPU backend does, with
/// one input copy per request (into the device ring, at arrival) and no batch gathered.
#[test]
fn elastic_batching_on_cuda_copies_each_input_once_and_matches_the_cpu() {
    let Some(gpu) = cuda_runtime() else { return };
    let cpu = cpu_runtime();
    let n = 100;
    for (i, net) in ring_models().into_iter().enumerate() {
        let kind = net.kind();
        let len = net.dense_lens().0;
        let inputs: Vec<Vec<f32>> = (0..n).map(|k| common::input(len, k)).collect();
        let serve_all = |rt: &Runtime, name: String, opts: ModelOptions| -> Vec<Vec<f32>> {
            let m = rt.add_network(net.clone(), name, opts).unwrap();
            let tickets: Vec<_> = inputs
                .iter()
                .map(|x| m.submit(Input::F32(x.clone()), SubmitOptions::default()).unwrap())
                .collect();
            tickets
                .into_iter()
                .map(|t| match t.wait() {
                    Ok(Output::F32(y)) => y,
                    other => panic!("{kind}: {other:?}"),
                })
                .collect()
        };
        let before = gpu.stats();
        let elastic =
            ModelOptions { policy: PolicyConfig::Elastic(ElasticConfig::default()), ..Default::default() };
        let got = serve_all(&gpu, format!("ring-{i}"), elastic);
        let want = serve_all(&cpu, format!("ring-{i}"), ModelOptions::default());
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_close(g, w, 1e-4, &format!("{kind} request {k}: elastic on CUDA vs the CPU"));
        }
        let s = gpu.stats();
        assert_eq!(s.completed(Code::Ok) - before.completed(Code::Ok), n);
        assert_eq!(
            (s.ring_copies - before.ring_copies, s.gather_copies - before.gather_copies),
            (n, 0),
            "{kind}: one copy per request into the device ring, none at launch"
        );
    }
}
