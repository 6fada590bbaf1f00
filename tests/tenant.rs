//! The runtime's tenant mode (`Runtime::add_tenants`, ARCHITECTURE.md §7.9): layer models sharing
//! the CPU cores under VELTAIR and every baseline, each query run as a chain of layer blocks on
//! pinned core leases. Every scheme must give PyTorch's outputs (the fixtures' `expected.json`),
//! complete every request exactly once, and keep serving through the bad inputs the issue names:
//! a QoS no core count can meet (flagged, served best-effort), a model that cannot be profiled,
//! more tenants than cores, a tenant removed while its blocks run.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::layer_fixtures::{assert_close, fixture, requests};
use serve::sched::tenant::Scheme;
use serve::{BackendChoice, Code, Input, Network, Runtime, SubmitOptions, Tenant, TenantOptions, TenantSpec};

fn runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap()
}

fn spec(name: &str, net: Network, qos_ms: u64) -> TenantSpec {
    TenantSpec::new(Arc::new(net), name, Duration::from_millis(qos_ms))
}

fn fixture_spec(name: &str, qos_ms: u64) -> TenantSpec {
    spec(name, serve::model::load(&fixture(name)).unwrap(), qos_ms)
}

/// Submit every fixture request of each tenant `copies` times, interleaved across tenants, and
/// check each result against PyTorch's.
fn serve_and_check(tenants: &[Tenant], names: &[&str], copies: usize, what: &str) {
    let reqs: Vec<_> = names.iter().map(|n| requests(&fixture(n))).collect();
    let mut tickets = Vec::new();
    for c in 0..copies {
        for (t, (tenant, rs)) in tenants.iter().zip(&reqs).enumerate() {
            for (k, (x, _)) in rs.iter().enumerate() {
                tickets.push((t, k, c, tenant.model.submit(x.clone(), SubmitOptions::default()).unwrap()));
            }
        }
    }
    for (t, k, c, ticket) in tickets {
        let got = ticket.wait().unwrap_or_else(|e| panic!("{what}: {} request {k} copy {c}: {e}", names[t]));
        let got = match got {
            serve::Output::F32(v) => v,
            other => panic!("{what}: {other:?}"),
        };
        assert_close(&got, &reqs[t][k].1, 1e-4, &format!("{what}: {} request {k}", names[t]));
    }
}

/// Every scheme serves a resnet and a bert sharing two cores with PyTorch's results; the
/// layer-granular schemes run more blocks than queries, and every block ran on a lease.
#[test]
fn every_scheme_serves_the_fixtures_with_pytorch_s_results() {
    let rt = runtime();
    let names = ["resnet_small", "bert_small"];
    for scheme in ["veltair", "veltair-as", "veltair-ac", "layer-wise", "model-wise", "fixed-2", "prema"] {
        let before = rt.stats();
        let opts =
            TenantOptions { scheme: Scheme::parse(scheme).unwrap(), cores: 2, ..TenantOptions::default() };
        let tenants = rt.add_tenants(names.iter().map(|n| fixture_spec(n, 1000)).collect(), opts).unwrap();
        assert!(tenants.iter().all(Tenant::feasible), "{scheme}: a second is enough for either");
        assert!(tenants.iter().all(|t| t.solo() > Duration::ZERO && t.solo() < Duration::from_secs(1)));
        serve_and_check(&tenants, &names, 3, scheme);
        let after = rt.stats();
        let queries = after.completed(Code::Ok) - before.completed(Code::Ok);
        let blocks = after.leased_tasks - before.leased_tasks;
        assert_eq!(after.tasks_launched - before.tasks_launched, blocks, "{scheme}: every task on a lease");
        assert!(after.leased_core_ns > before.leased_core_ns, "{scheme}");
        // Every layer of every query, once: 3 copies of each fixture's requests.
        let layer_runs: usize = tenants
            .iter()
            .zip(&names)
            .map(|(t, n)| 3 * requests(&fixture(n)).len() * t.profile.layers().len())
            .sum();
        match scheme {
            // One layer per block (a conflict runs one layer too).
            "layer-wise" | "veltair-ac" | "prema" => assert_eq!(blocks as usize, layer_runs, "{scheme}"),
            // The whole model on its cores: model-wise waits for them.
            "model-wise" => assert_eq!(blocks, queries, "{scheme}: one block per query"),
            _ => assert!(
                blocks >= queries && (blocks as usize) <= layer_runs,
                "{scheme}: {blocks} blocks for {queries} queries of {layer_runs} layers"
            ),
        }
        assert_eq!(after.in_flight(), 0);
    }
}

/// On the default backend (`auto`, the CPU where no CUDA device is), a tenant group gets as many
/// cores as the CPU backend has threads: `auto` used to report no compute threads, and a pool of
/// two cores was refused (a default pool got one core).
#[test]
fn the_default_backend_gives_a_tenant_group_all_its_threads() {
    let rt = Runtime::builder().cpu_threads(2).build().unwrap();
    if rt.backend_kind() != serve::BackendKind::Cpu || serve::backend::cpu::affinity::allowed_cpus().len() < 2
    {
        eprintln!("skipped: needs the CPU backend under `auto` and two CPUs");
        return;
    }
    let mlp = serve::model::Mlp::random(&[16, 8, 4], 1);
    let opts = TenantOptions { cores: 2, ..TenantOptions::default() };
    let tenants = rt.add_tenants(vec![spec("mlp", Network::Mlp(mlp), 100)], opts).unwrap();
    let got = tenants[0].model.submit(Input::F32(common::input(16, 0)), SubmitOptions::default()).unwrap();
    assert!(got.wait().is_ok());
}

/// An mlp tenant's blocks chain the activations of the whole model: a layer-wise chain gives
/// the model's own result (served whole under the default policy).
#[test]
fn a_chain_of_blocks_gives_the_whole_model_s_result() {
    let rt = runtime();
    let mlp = serve::model::Mlp::random(&[64, 96, 48, 32, 10], 3);
    let whole =
        rt.add_network(Arc::new(Network::Mlp(mlp.clone())), "whole".into(), Default::default()).unwrap();
    let opts = TenantOptions { scheme: Scheme::LayerWise, ..TenantOptions::default() };
    let tenants = rt.add_tenants(vec![spec("mlp", Network::Mlp(mlp), 100)], opts).unwrap();
    assert_eq!(tenants[0].profile.layers().len(), 4);
    for k in 0..20 {
        let x = Input::F32(common::input(64, k));
        let want = whole.submit(x.clone(), SubmitOptions::default()).unwrap().wait().unwrap();
        let got = tenants[0].model.submit(x, SubmitOptions::default()).unwrap().wait().unwrap();
        match (got, want) {
            (serve::Output::F32(g), serve::Output::F32(w)) => {
                assert_close(&g, &w, 1e-5, &format!("request {k}"));
            }
            other => panic!("{other:?}"),
        }
    }
}

/// A QoS no core count can meet is flagged at load and served best-effort; more tenants than
/// cores all complete; a deadline shorter than a block expires at a block boundary.
#[test]
fn an_infeasible_qos_is_flagged_and_served_and_more_tenants_than_cores_all_complete() {
    let rt = runtime();
    let specs = vec![
        fixture_spec("resnet_small", 1000),
        TenantSpec { qos: Duration::from_nanos(1), ..fixture_spec("bert_small", 1) },
        fixture_spec("resnet_bottleneck_small", 1000),
    ];
    let opts = TenantOptions { cores: 1, ..TenantOptions::default() };
    let tenants = rt.add_tenants(specs, opts).unwrap();
    assert_eq!(tenants.iter().map(Tenant::feasible).collect::<Vec<_>>(), [true, false, true]);
    serve_and_check(&tenants, &["resnet_small", "bert_small", "resnet_bottleneck_small"], 2, "1 core");
    // A deadline of 300 µs behind 20 queries served first on one core (in arrival order, each
    // several blocks of at least one engine round trip): it completes DeadlineExceeded, once.
    let x = requests(&fixture("resnet_small"))[0].0.clone();
    let busy: Vec<_> =
        (0..20).map(|_| tenants[0].model.submit(x.clone(), SubmitOptions::default()).unwrap()).collect();
    let late = tenants[0].model.submit(x, SubmitOptions::with_timeout(Duration::from_micros(300))).unwrap();
    let e = late.wait().expect_err("300 µs behind 20 queries on one core");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    busy.into_iter().for_each(|t| {
        t.wait().unwrap();
    });
    assert_eq!(rt.stats().in_flight(), 0);
}

/// Bad tenants are refused naming what is wrong, and the runtime goes on serving.
#[test]
fn bad_tenants_are_refused_precisely() {
    let rt = runtime();
    let lstm = serve::model::load(&common::recurrent::fixture("lstm_small")).unwrap();
    let cases: Vec<(Vec<TenantSpec>, TenantOptions, &str)> = vec![
        (vec![], TenantOptions::default(), "0 tenant models"),
        (vec![spec("lstm", lstm, 10)], TenantOptions::default(), "is a lstm model"),
        (
            vec![fixture_spec("resnet_small", 10)],
            TenantOptions { cores: 4096, ..TenantOptions::default() },
            "a pool of 4096 cores",
        ),
        (
            vec![fixture_spec("resnet_small", 10)],
            TenantOptions { levels: 0, ..TenantOptions::default() },
            "0 interference levels",
        ),
        (
            vec![fixture_spec("resnet_small", 10)],
            TenantOptions { plan_share: 0.0, ..TenantOptions::default() },
            "planning share",
        ),
        (
            vec![fixture_spec("resnet_small", 10)],
            TenantOptions { level_step: f64::NAN, ..TenantOptions::default() },
            "a level step of NaN",
        ),
        (
            vec![TenantSpec { qos: Duration::ZERO, ..fixture_spec("resnet_small", 10) }],
            TenantOptions::default(),
            "QoS target of 0ns",
        ),
        (
            vec![TenantSpec { qos: Duration::from_secs(7200), ..fixture_spec("resnet_small", 10) }],
            TenantOptions::default(),
            "QoS target of 7200s (above 0, at most 3600s)",
        ),
    ];
    for (specs, opts, want) in cases {
        let e = rt.add_tenants(specs, opts).err().unwrap_or_else(|| panic!("`{want}` was accepted"));
        assert_eq!(e.code(), Code::InvalidArgument, "{e}");
        assert!(e.message().contains(want), "`{e}` does not say `{want}`");
    }
    let ok = rt.add_tenants(vec![fixture_spec("resnet_small", 1000)], TenantOptions::default()).unwrap();
    serve_and_check(&ok, &["resnet_small"], 1, "after the refusals");
}

/// A layer that fails when profiled fails the load, naming the layer; the runtime serves on.
#[test]
fn a_model_whose_layers_cannot_be_profiled_is_refused() {
    use serve::model::{CustomCall, CustomExecute, CustomModel, LayerInfo};
    struct Broken;
    impl CustomExecute for Broken {
        fn execute(&self, call: &mut CustomCall<'_>) -> Result<(), String> {
            if call.layers.0 == 1 {
                return Err("layer 1 is out of order".into());
            }
            let n = call.output.len();
            call.output.copy_from_slice(&call.input[..n]);
            Ok(())
        }
    }
    let rt = runtime();
    let layers =
        vec![LayerInfo::new("fine", "linear", 16, 32, 4), LayerInfo::new("broken", "linear", 16, 32, 4)];
    let custom = CustomModel { input_len: 4, output_len: 4, layers, exec: Arc::new(Broken) };
    let e = rt
        .add_tenants(vec![spec("custom", Network::Custom(custom), 10)], TenantOptions::default())
        .err()
        .expect("a failing layer is refused");
    assert!(e.message().contains("layer `broken` cannot be profiled"), "{e}");
    let ok = rt.add_tenants(vec![fixture_spec("resnet_small", 1000)], TenantOptions::default()).unwrap();
    serve_and_check(&ok, &["resnet_small"], 1, "after the refusal");
}

/// A tenant whose last handle is dropped while its blocks run finishes the queries it has (each
/// once, with its result) and is released; the other tenant goes on, and a new group can be
/// added after and serves.
#[test]
fn a_tenant_removed_while_its_blocks_run_finishes_them_and_the_others_go_on() {
    let rt = runtime();
    let names = ["resnet_small", "bert_small"];
    let opts = TenantOptions { scheme: Scheme::LayerWise, ..TenantOptions::default() };
    let mut tenants =
        rt.add_tenants(names.iter().map(|n| fixture_spec(n, 1000)).collect(), opts.clone()).unwrap();
    let reqs = requests(&fixture("bert_small"));
    let bert = tenants.pop().unwrap();
    let tickets: Vec<_> = (0..10)
        .map(|k| bert.model.submit(reqs[k % reqs.len()].0.clone(), SubmitOptions::default()).unwrap())
        .collect();
    drop(bert);
    for (k, t) in tickets.into_iter().enumerate() {
        let got = t.wait().unwrap();
        let serve::Output::F32(got) = got else { panic!() };
        assert_close(&got, &reqs[k % reqs.len()].1, 1e-4, "the removed tenant's request");
    }
    serve_and_check(&tenants, &names[..1], 3, "the tenant left");
    drop(tenants);
    // Every tenant of the group dropped: a new group serves.
    let again = rt.add_tenants(vec![fixture_spec("bert_small", 1000)], opts).unwrap();
    serve_and_check(&again, &["bert_small"], 2, "a later group");
    assert_eq!(rt.stats().in_flight(), 0);
}

/// A cancelled query completes once, `Cancelled` (at its next block boundary) or with its
/// result if it had finished.
#[test]
fn a_query_cancelled_mid_chain_completes_once() {
    let rt = runtime();
    let opts = TenantOptions { scheme: Scheme::LayerWise, ..TenantOptions::default() };
    let tenants = rt.add_tenants(vec![fixture_spec("resnet_small", 1000)], opts).unwrap();
    let x = requests(&fixture("resnet_small"))[0].0.clone();
    let tickets: Vec<_> =
        (0..20).map(|_| tenants[0].model.submit(x.clone(), SubmitOptions::default()).unwrap()).collect();
    for t in &tickets[10..] {
        rt.cancel(t.id()).unwrap();
    }
    let mut cancelled = 0;
    for t in tickets {
        match t.wait() {
            Ok(_) => {}
            Err(e) => {
                assert_eq!(e.code(), Code::Cancelled, "{e}");
                cancelled += 1;
            }
        }
    }
    assert!(cancelled > 0, "some of the 10 cancelled queries were still waiting");
    let s = rt.stats();
    assert_eq!((s.in_flight(), s.completed_total()), (0, 20));
}

/// A profile measured at one load is reused at the next (no profiling: the same tables), and
/// one that does not fit the model or the pool is refused naming both shapes.
#[test]
fn a_profile_is_reused_and_one_that_does_not_fit_is_refused() {
    let rt = runtime();
    let first = rt.add_tenants(vec![fixture_spec("resnet_small", 50)], TenantOptions::default()).unwrap();
    let tables = first[0].profile.layers().to_vec();
    let again = TenantSpec { layers: Some(tables.clone()), ..fixture_spec("resnet_small", 80) };
    let second = rt.add_tenants(vec![again], TenantOptions::default()).unwrap();
    assert_eq!(second[0].profile.layers(), &tables[..], "the given tables, not a new measurement");
    assert_eq!(second[0].profile.qos(), Duration::from_millis(80), "the spec's QoS");
    serve_and_check(&second, &["resnet_small"], 1, "a reused profile");
    let short = TenantSpec { layers: Some(tables[1..].to_vec()), ..fixture_spec("resnet_small", 80) };
    let e = rt.add_tenants(vec![short], TenantOptions::default()).err().unwrap();
    assert!(e.message().contains("its given profile has"), "{e}");
    let other_levels = TenantSpec { layers: Some(tables), ..fixture_spec("resnet_small", 80) };
    let e = rt
        .add_tenants(vec![other_levels], TenantOptions { levels: 3, ..TenantOptions::default() })
        .err()
        .unwrap();
    assert!(e.message().contains("3 levels"), "{e}");
}

/// A block that fails while serving ends its query with the error (once, `BACKEND`), runs none
/// of its later blocks, and the group serves on.
#[test]
fn a_block_that_fails_while_serving_ends_its_query_and_the_group_serves_on() {
    use serve::model::{CustomCall, CustomExecute, CustomModel, LayerInfo};
    use std::sync::atomic::{AtomicUsize, Ordering};
    /// Identity layers; layer 1 fails on a row that starts with 999, and layer 2 counts its runs.
    struct FailsOn999(AtomicUsize);
    impl CustomExecute for FailsOn999 {
        fn execute(&self, call: &mut CustomCall<'_>) -> Result<(), String> {
            let (first, last) = call.layers;
            if (first..last).contains(&1) && call.input[0] == 999.0 {
                return Err("layer 1 refuses 999".into());
            }
            if (first..last).contains(&2) {
                self.0.fetch_add(1, Ordering::Relaxed);
            }
            let n = call.output.len();
            call.output.copy_from_slice(&call.input[..n]);
            Ok(())
        }
    }
    let rt = runtime();
    let exec = Arc::new(FailsOn999(AtomicUsize::new(0)));
    let layers = (0..3).map(|k| LayerInfo::new(&format!("l{k}"), "linear", 16, 32, 4)).collect();
    let custom = CustomModel { input_len: 4, output_len: 4, layers, exec: exec.clone() };
    let opts = TenantOptions { scheme: Scheme::LayerWise, ..TenantOptions::default() };
    let tenants = rt.add_tenants(vec![spec("custom", Network::Custom(custom), 100)], opts).unwrap();
    let before = exec.0.load(Ordering::Relaxed);
    let submit = |v: f32| {
        tenants[0].model.submit(Input::F32(vec![v, 1.0, 2.0, 3.0]), SubmitOptions::default()).unwrap()
    };
    let (good, bad, after) = (submit(5.0), submit(999.0), submit(6.0));
    let e = bad.wait().expect_err("layer 1 fails it");
    assert_eq!(e.code(), Code::Backend, "{e}");
    assert!(e.message().contains("layer 1 refuses 999"), "{e}");
    for (t, v) in [(good, 5.0), (after, 6.0)] {
        let serve::Output::F32(y) = t.wait().unwrap() else { panic!() };
        assert_eq!(y, [v, 1.0, 2.0, 3.0], "identity layers");
    }
    assert_eq!(exec.0.load(Ordering::Relaxed) - before, 2, "layer 2 ran for the two good queries only");
    let s = rt.stats();
    assert_eq!((s.in_flight(), s.completed(Code::Backend), s.completed(Code::Ok)), (0, 1, 2));
}
