//! `serve profile` and `serve sim` end to end (ARCHITECTURE.md §8.6): a cost file measured on
//! the CPU backend drives the simulator; its JSON, SVG and bench comparison. And issue 15's
//! fixed-shape policies: E-Ebird's 252 configurations co-run on the CPU backend
//! (`serve profile --engine-configs`), their picks feeding the simulator, and every policy
//! served by the real runtime (`serve bench elastic`).

use std::path::PathBuf;

use serve::sim::CostFile;

mod cli_common;

use cli_common::{json, ok, serve};

fn temp(name: &str) -> PathBuf {
    cli_common::temp("cli-sim", name)
}

#[test]
fn a_profiled_cost_file_drives_the_simulator_and_the_comparison() {
    let cost = temp("cost.json");
    let c = cost.to_str().unwrap();
    ok(&serve(&[
        "profile",
        "--random",
        "lstm",
        "--hidden",
        "8",
        "--vocab",
        "50",
        "--batches",
        "4,1",
        "--json",
        c,
    ]));
    let file = CostFile::open(c).expect("serve profile writes a valid cost file");
    let step = &file.cells[0];
    assert_eq!(step.cell, "step");
    assert_eq!(step.points.iter().map(|p| p.0).collect::<Vec<_>>(), [1, 4], "batches sorted");
    assert!(step.points.iter().all(|p| p.1 > 0.0));
    assert!(file.launch_us >= 0.0 && file.launch_us == file.report_us);

    let (report, svg) = (temp("sim.json"), temp("sim.svg"));
    let out = ok(&serve(&[
        "sim",
        "lstm",
        "--cost",
        c,
        "--requests",
        "400",
        "--fractions",
        "0.5",
        "--json",
        report.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    assert!(out.contains("SIMULATED"), "{out}");
    let r = json(&report);
    assert_eq!(r["backend"], "sim");
    assert_eq!(r["peaks"].as_array().unwrap().len(), 2, "cellular and padding");
    let results = r["results"].as_array().unwrap();
    assert_eq!(results.len(), 4, "two rates (half of each peak) × two policies");
    for x in results {
        assert_eq!(x["completed"].as_u64().unwrap() + x["errors"].as_u64().unwrap(), 400);
        let (p50, p99) = (x["p50_ms"].as_f64().unwrap(), x["p99_ms"].as_f64().unwrap());
        assert!(p50 > 0.0 && p50 <= p99, "{x}");
    }
    let drawing = std::fs::read_to_string(&svg).unwrap();
    assert!(drawing.contains("<svg") && drawing.contains("cellular"), "an SVG with the policies' lines");

    // The comparison against a real run of the same workload.
    let bench = temp("bench.json");
    ok(&serve(&[
        "bench",
        "lstm",
        "--hidden",
        "8",
        "--vocab",
        "50",
        "--rate",
        "200",
        "--requests",
        "200",
        "--json",
        bench.to_str().unwrap(),
    ]));
    let out = ok(&serve(&["sim", "lstm", "--cost", c, "--compare", bench.to_str().unwrap()]));
    assert!(out.contains("cellular(b=512,k=5)") && out.contains("padding("), "{out}");
    assert!(out.contains("comparison(s) outside the targets"), "{out}");
    // Other policy options than the bench's are refused, naming the bench's policy.
    let o = serve(&[
        "sim",
        "lstm",
        "--cost",
        c,
        "--max-batch",
        "64",
        "--policy",
        "cellular",
        "--compare",
        bench.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("the bench ran"));
    for p in [cost, report, svg, bench] {
        let _ = std::fs::remove_file(p);
    }
}

/// The simulator against the real runtime it was checked on: the H200 profile it ships
/// (`h200-lstm-h1024`, `serve profile --random lstm --hidden 1024 --backend cuda`) replaying the
/// real runtime's cellular run on that GPU (`costs/h200-bench-lstm-cellular.json`, commit
/// efb3aa8, 1,000 to 6,930 req/s, where the engine thread's launch calls bound the task rate).
/// Both are fixed files and the simulator is deterministic, so the bounds guard the model's
/// fidelity as measured when shipped: throughput within 0.2%, p50 0.73–0.85×, p90 0.70–0.89× of
/// the real run's (the real run's own spread between two rounds: up to 10% at p50).
#[test]
fn the_simulator_tracks_the_h200_runtime_it_was_checked_against() {
    let bench = concat!(env!("CARGO_MANIFEST_DIR"), "/costs/h200-bench-lstm-cellular.json");
    let out = ok(&serve(&["sim", "lstm", "--cost", "h200-lstm-h1024", "--compare", bench]));
    let rows: Vec<&str> = out.lines().filter(|l| l.starts_with("cellular(b=512,k=5)")).collect();
    assert_eq!(rows.len(), 4, "{out}");
    // `… throughput r|s … p50 s/r X p90 s/r Y ok|MISS`
    let ratio = |row: &str, what: &str| -> f64 {
        let at = row.find(what).unwrap_or_else(|| panic!("no `{what}` in {row}")) + what.len();
        row[at..].split_whitespace().next().unwrap().parse().unwrap()
    };
    for row in rows {
        let fields: Vec<&str> = row.split_whitespace().collect();
        let (real, sim) = fields[2].split_once('|').unwrap();
        let (real, sim): (f64, f64) = (real.parse().unwrap(), sim.parse().unwrap());
        assert!((sim / real - 1.0).abs() < 0.02, "throughput: {row}");
        let (p50, p90) = (ratio(row, "p50 s/r "), ratio(row, "p90 s/r "));
        assert!((0.72..=1.25).contains(&p50), "p50: {row}");
        assert!((0.68..=1.25).contains(&p90), "p90: {row}");
    }
}

#[test]
fn the_shipped_v100_costs_reproduce_the_fixed_length_ideal() {
    let out = ok(&serve(&[
        "sim",
        "lstm",
        "--cost",
        "batchmaker-v100",
        "--lengths",
        "fixed:24",
        "--policy",
        "cellular",
        "--requests",
        "20000",
        "--rate",
        "1000",
    ]));
    let peak: f64 = out
        .lines()
        .find(|l| l.starts_with("# peak throughput cellular"))
        .and_then(|l| l.split_whitespace().rev().nth(6)?.parse().ok())
        .unwrap_or_else(|| panic!("no peak line in:\n{out}"));
    let ideal = 512.0 / (784e-6 * 24.0);
    assert!(peak > 0.9 * ideal && peak <= ideal * 1.001, "peak {peak} against the ideal {ideal}");
}

#[test]
fn bad_sim_arguments_are_refused_precisely() {
    let o = serve(&["sim", "lstm", "--cost", "no-such-cost"]);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("batchmaker-v100"), "the shipped costs are named: {e}");
    let o = serve(&["sim", "lstm", "--cost", "batchmaker-v100", "--lengths", "fixed:0"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("fixed:N"));
    // The V100 table has no decoder cells: a seq2seq simulation says which figure is missing.
    let o = serve(&["sim", "seq2seq", "--cost", "batchmaker-v100", "--requests", "50", "--rate", "10"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("no time for cell type `encoder`"));
    // A burst too large to hold is refused before its arrivals are drawn.
    let o = serve(&["sim", "elastic", "--cost", "e2bird-res152", "--arrivals", "burst", "--low-rps", "1e9"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("a phased run may hold"));
    // The tenant study: unknown schemes and workloads are named.
    let o = serve(&["sim", "tenant", "--policy", "veltair,fifo"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown tenant policy `fifo`"));
    let o = serve(&["sim", "tenant", "--workload", "huge"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("light, medium, heavy, mix"));
    let o = serve(&["sim", "tenant", "--policy", "fixed-0"]);
    assert!(!o.status.success());
    let o = serve(&["sim"]);
    assert!(!o.status.success());
}

/// `serve profile` of a layer model: one entry per layer (stem, blocks, head) with a point per
/// batch size and core count, every time positive; `--cores` on a recurrent model is refused.
#[test]
fn a_layer_model_is_profiled_layer_by_layer() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata/resnet_small");
    let out = temp("layers.json");
    let o = out.to_str().unwrap();
    ok(&serve(&["profile", dir.to_str().unwrap(), "--batches", "2,1", "--cores", "1,2", "--json", o]));
    let v = json(&out);
    assert_eq!(v["kind"], "resnet");
    let net = serve::model::load(&dir).unwrap();
    let layers = v["layers"].as_array().unwrap();
    let names: Vec<&str> = layers.iter().map(|l| l["name"].as_str().unwrap()).collect();
    let want: Vec<String> = net.layers().iter().map(|l| l.name.clone()).collect();
    assert_eq!(names, want, "one entry per layer, in order");
    assert_eq!(names.first(), Some(&"stem"));
    for l in layers {
        let points: Vec<(u64, u64)> = l["points"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["batch"].as_u64().unwrap(), p["cores"].as_u64().unwrap()))
            .collect();
        assert_eq!(points, [(1, 1), (1, 2), (2, 1), (2, 2)], "{}", l["name"]);
        assert!(l["points"].as_array().unwrap().iter().all(|p| p["us"].as_f64().unwrap() > 0.0));
        assert!(l["bytes"].as_u64().unwrap() > 0 && l["flops_per_row"].as_u64().unwrap() > 0);
        assert!(l["load_ms"].is_null(), "no load time on the CPU");
    }
    // The profile fits the tenant simulator's per-core rate and fixed cost (issue 16).
    let report = temp("tenant.json");
    let r = report.to_str().unwrap();
    let text = ok(&serve(&[
        "sim",
        "tenant",
        "--cores",
        "16",
        "--workload",
        "medium",
        "--policy",
        "veltair,layer-wise,fixed-3",
        "--queries",
        "400",
        "--steps",
        "3",
        "--cost",
        o,
        "--json",
        r,
    ]));
    assert!(text.contains("fitted to"), "{text}");
    let t = json(&report);
    assert_eq!(t["backend"], "sim");
    assert_eq!(t["cores"], 16);
    let fitted = t["machine"]["gflops_per_core"].as_f64().unwrap();
    assert!(fitted > 0.0 && fitted != 70.0, "the rate is the profile's, not the built-in: {fitted}");
    let results = t["results"].as_array().unwrap();
    let names: Vec<&str> = results.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["veltair", "layer-wise", "fixed-3"]);
    assert!(results.iter().all(|r| r["qps_at_95"].as_f64().unwrap() >= 0.0));
    assert_eq!(t["models"].as_array().unwrap().len(), 2, "medium: resnet50 and googlenet");
    let _ = std::fs::remove_file(&report);
    let _ = std::fs::remove_file(&out);
    let lstm = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata/lstm_small");
    let e = serve(&["profile", lstm.to_str().unwrap(), "--cores", "1", "--json", o]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("--cores applies to layer models"));
}

/// `serve profile --versions`: every candidate version of a product timed alone and beside the
/// antagonist at each level, at most five kept, the crossover and the pick by level reported
/// (their values are this machine's: not asserted).
#[test]
fn multi_version_kernels_are_profiled_beside_an_antagonist() {
    if std::thread::available_parallelism().map_or(1, |c| c.get()) < 2 {
        return; // the antagonist needs a core of its own (CI and this VM have 2)
    }
    let out = temp("versions.json");
    let o = out.to_str().unwrap();
    let text = ok(&serve(&["profile", "--versions", "64x96x80", "--levels", "3", "--json", o]));
    assert!(text.contains("# crossover:"), "{text}");
    let v = json(&out);
    assert_eq!(v["shape"], serde_json::json!([64, 96, 80]));
    let versions = v["versions"].as_array().unwrap();
    // Tiles {32, 64} × {32, 64, 80}, each in two loop orders inside and once in bands.
    assert_eq!(versions.len(), 2 * 3 * 3);
    let kept = versions.iter().filter(|x| x["kept"] == true).count();
    assert!((1..=5).contains(&kept), "{kept} kept");
    for x in versions {
        assert_eq!(x["us_at_levels"].as_array().unwrap().len(), 3);
        assert!(x["us_1_core"].as_f64().unwrap() > 0.0 && x["ws"].as_u64().unwrap() > 0);
    }
    assert_eq!(v["picks_by_level"].as_array().unwrap().len(), 3);
    let cover = v["kept_over_oracle"].as_array().unwrap();
    assert!(cover.iter().all(|c| c.as_f64().unwrap() > 0.0 && c.as_f64().unwrap() <= 1.0 + 1e-9));
    let _ = std::fs::remove_file(&out);
    // A shape that is not one.
    let e = serve(&["profile", "--versions", "64x0x8"]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("MxKxN"));
}

/// `serve sim elastic` on E²bird's ResNet-152 figures (shared device): every policy at Poisson
/// rates with goodput and throughput at QoS, E6 (N-Ebird's low-load latency at least 44% below
/// OPT_Wait's), and the diurnal run's phases (E7's ordering) with its latency-by-arrival plot.
#[test]
fn sim_elastic_compares_the_fixed_shape_policies() {
    let (j, svg) = (temp("elastic.json"), temp("diurnal.svg"));
    let out = ok(&serve(&[
        "sim",
        "elastic",
        "--cost",
        "e2bird-res152",
        "--requests",
        "800",
        "--json",
        j.to_str().unwrap(),
    ]));
    assert!(out.contains("SIMULATED") && out.contains("workers share the device"), "{out}");
    let v = json(&j);
    let at_qos = v["throughput_at_qos_rps"].as_object().unwrap();
    for p in ["no-wait", "opt-wait", "static", "nebird", "eebird", "adaptive", "serial"] {
        assert!(at_qos[p].as_f64().unwrap() > 0.0, "{p}: {v}");
    }
    assert!(v["e6_low_load_cut"].as_f64().unwrap() >= 0.44, "E6: {}", v["e6_low_load_cut"]);
    let rows = v["results"].as_array().unwrap();
    assert_eq!(rows.len(), 5 * 7, "five rates × seven policies");
    assert!(rows.iter().all(|r| r["goodput_rps"].as_f64().is_some() && r["errors"] == 0), "{v}");

    ok(&serve(&[
        "sim",
        "elastic",
        "--cost",
        "e2bird-res152",
        "--arrivals",
        "diurnal",
        "--policies",
        "opt-wait,nebird",
        "--requests",
        "400",
        "--json",
        j.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    let v = json(&j);
    let high = |p: &str| v["phases"][p]["high_mean_ms"].as_f64().unwrap();
    assert!(high("nebird") < high("opt-wait"), "E7: N-Ebird below OPT_Wait at high load: {v}");
    assert!(
        v["phases"]["nebird"]["low_mean_ms"].as_f64().unwrap()
            < v["phases"]["opt-wait"]["low_mean_ms"].as_f64().unwrap()
    );
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    // A cost file without a whole-model cell is refused, naming the problem.
    let o = serve(&["sim", "elastic", "--cost", "batchmaker-v100"]);
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("no `dense` cell"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for f in [j, svg] {
        let _ = std::fs::remove_file(f);
    }
}

fn testdata(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata").join(name)
}

const POLICIES: [&str; 7] = ["no-wait", "opt-wait", "static", "nebird", "eebird", "adaptive", "serial"];

/// E4: 4 + 10 + 36 + 202 configurations measured, each level's pick the least mean request
/// latency among its scores; the file drives `serve sim elastic --engine-configs`; a recurrent
/// model is refused.
#[test]
fn engine_configurations_are_profiled_co_running() {
    let out = temp("engine-confs.json");
    let o = out.to_str().unwrap();
    let text = ok(&serve(&["profile", testdata("mlp_4_8_3").to_str().unwrap(), "--engine-configs", o]));
    assert!(text.contains("252 configurations co-running"), "{text}");
    let v = json(&out);
    let scores = v["scores"].as_object().unwrap();
    let counts: Vec<(String, usize)> =
        scores.iter().map(|(k, l)| (k.clone(), l.as_array().unwrap().len())).collect();
    let mut counts = counts;
    counts.sort_by_key(|(k, _)| k.parse::<usize>().unwrap());
    assert_eq!(counts, [("4".into(), 4), ("8".into(), 10), ("16".into(), 36), ("32".into(), 202)]);
    for (total, list) in scores {
        let total: u64 = total.parse().unwrap();
        let list = list.as_array().unwrap();
        let pick: Vec<u64> = v["engine_confs"][total.to_string()]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap())
            .collect();
        assert_eq!(pick.iter().sum::<u64>(), total, "{pick:?}");
        let best = list.iter().map(|s| s["mean_ms"].as_f64().unwrap()).fold(f64::INFINITY, f64::min);
        let picked = list
            .iter()
            .find(|s| {
                s["workers"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap()).eq(pick.iter().copied())
            })
            .unwrap();
        assert_eq!(picked["mean_ms"].as_f64().unwrap(), best, "TotalBS {total}: the argmin");
        for s in list {
            let (mean, worker_mean, makespan) = (
                s["mean_ms"].as_f64().unwrap(),
                s["worker_mean_ms"].as_f64().unwrap(),
                s["makespan_ms"].as_f64().unwrap(),
            );
            assert!(mean > 0.0 && worker_mean > 0.0 && mean <= makespan && worker_mean <= makespan, "{s}");
        }
    }
    let text = ok(&serve(&[
        "sim",
        "elastic",
        "--cost",
        "e2bird-res152",
        "--engine-configs",
        o,
        "--policies",
        "nebird,eebird",
        "--requests",
        "300",
        "--rate",
        "50",
    ]));
    assert!(text.contains("throughput at QoS"), "{text}");
    let _ = std::fs::remove_file(&out);

    let e = serve(&["profile", testdata("lstm_small").to_str().unwrap(), "--engine-configs", o]);
    assert!(!e.status.success());
    let err = String::from_utf8_lossy(&e.stderr);
    assert!(err.contains("--engine-configs profiles a fixed-shape model"), "{err}");
    let e = serve(&["profile", testdata("mlp_4_8_3").to_str().unwrap(), "--engine-configs", o, "--json", o]);
    assert!(!e.status.success(), "--engine-configs with --json is refused");
}

/// Every policy served by the real runtime at a Poisson rate (all complete, goodput and
/// throughput at QoS reported, E-Ebird's engine from an in-place profile); a burst run's phases
/// and plot; a recurrent model refused.
#[test]
fn bench_elastic_serves_every_policy_on_the_runtime() {
    let (j, svg) = (temp("bench-elastic.json"), temp("bench-burst.svg"));
    let dir = testdata("mlp_4_8_3");
    let text = ok(&serve(&[
        "bench",
        "elastic",
        dir.to_str().unwrap(),
        "--rate",
        "300",
        "--requests",
        "120",
        "--probe-s",
        "0.05",
        "--json",
        j.to_str().unwrap(),
    ]));
    assert!(text.contains("252 configurations co-running"), "E-Ebird profiled in place: {text}");
    let v = json(&j);
    assert!(v["t_max_bs_ms"].as_f64().unwrap() > 0.0 && v["qos_ms"].as_f64().unwrap() > 0.0);
    let rows = v["results"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, POLICIES);
    for r in rows {
        assert_eq!((r["completed"].as_u64(), r["errors"].as_u64()), (Some(120), Some(0)), "{r}");
        assert!(r["goodput_rps"].as_f64().is_some(), "{r}");
    }
    for p in POLICIES {
        assert!(v["throughput_at_qos_rps"][p].as_f64().is_some_and(|t| t >= 0.0), "{p}: {v}");
    }

    ok(&serve(&[
        "bench",
        "elastic",
        dir.to_str().unwrap(),
        "--policies",
        "opt-wait,nebird,adaptive,serial",
        "--arrivals",
        "burst",
        "--low-rps",
        "100",
        "--high-rps",
        "400",
        "--probe-s",
        "0.05",
        "--qos-ms",
        "50",
        "--json",
        j.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    let v = json(&j);
    for p in ["opt-wait", "nebird", "adaptive", "serial"] {
        let ph = &v["phases"][p];
        assert!(ph["peak_ms"].as_f64().unwrap() > 0.0 && ph["errors"] == 0, "{p}: {ph}");
    }
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    let _ = (std::fs::remove_file(&j), std::fs::remove_file(&svg));

    let e = serve(&["bench", "elastic", testdata("lstm_small").to_str().unwrap()]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("serves a fixed-shape model"));
    // A batch too large to build is refused before anything is allocated.
    let e = serve(&["bench", "elastic", "--sizes", "4194304,4", "--max-bs", "128"]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("values one batch may hold"), "{e:?}");
    let e = serve(&["bench", "elastic", "--sizes", "100000,100000"]);
    assert!(!e.status.success());
    assert!(String::from_utf8_lossy(&e.stderr).contains("weights a random mlp may hold"), "{e:?}");
}

/// `serve bench tenant` (issue 16): the runtime's tenant mode on this machine's cores, every
/// scheme asked for searched for its QPS@95% on the same profile and arrivals; the JSON carries
/// each scheme's figures and probes, and the SVG is drawn. (The figures are this machine's: the
/// bisection's logic is what is asserted.)
#[test]
fn the_tenant_bench_serves_every_scheme_on_real_cores() {
    let report = temp("bench-tenant.json");
    let svg = temp("bench-tenant.svg");
    let text = ok(&serve(&[
        "bench",
        "tenant",
        "--workload",
        "light",
        "--policy",
        "veltair,prema",
        "--duration-s",
        "0.2",
        "--steps",
        "2",
        "--json",
        report.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    assert!(text.contains("## veltair") && text.contains("## prema"), "{text}");
    let t = json(&report);
    assert_eq!((t["bench"].as_str(), t["measured"].as_bool()), (Some("tenant"), Some(true)));
    assert_eq!(t["models"].as_array().unwrap().len(), 2, "light: mlp and resnet");
    for m in t["models"].as_array().unwrap() {
        let (solo, qos) = (m["solo_ms"].as_f64().unwrap(), m["qos_ms"].as_f64().unwrap());
        assert!(solo > 0.0 && (qos / solo - 4.0).abs() < 1e-6, "QoS is 4 × solo: {m}");
    }
    let results = t["results"].as_array().unwrap();
    assert_eq!(
        results.iter().map(|r| r["policy"].as_str().unwrap()).collect::<Vec<_>>(),
        ["veltair", "prema"]
    );
    for r in results {
        let probes = r["probes"].as_array().unwrap();
        assert_eq!(probes.len(), 2, "{r}");
        // The result is the highest passing probe (0 if none passed), and the second probe
        // went up after a pass and down after a miss.
        let (p0, p1) = (&probes[0], &probes[1]);
        let pass = |p: &serde_json::Value| p["met_share"].as_f64().unwrap() >= 0.95;
        let (r0, r1) = (p0["rate"].as_f64().unwrap(), p1["rate"].as_f64().unwrap());
        assert!(if pass(p0) { r1 > r0 } else { r1 < r0 }, "{r}");
        let best = probes.iter().filter(|p| pass(p)).map(|p| p["rate"].as_f64().unwrap()).fold(0.0, f64::max);
        assert_eq!(r["qps_at_95"].as_f64().unwrap(), best, "{r}");
        // Leases never exceed the pool: the leased core-time over the probe's span is at most
        // its cores (a little over for the span's rounding).
        let cores = t["cores"].as_f64().unwrap();
        assert!(probes.iter().all(|p| p["queries"].as_u64().unwrap() >= 20), "{r}");
        assert!(probes.iter().all(|p| p["mean_cores"].as_f64().unwrap() <= cores * 1.05), "{r}");
    }
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    let _ = std::fs::remove_file(&report);
    let _ = std::fs::remove_file(&svg);
}
