//! `serve plan deepplan` and `serve sim coldstart` end to end (issue 17, ARCHITECTURE.md §7.10,
//! §8.7): the plan file's fields, precise refusals of bad profiles and topologies, and the
//! simulator's JSON and SVG.

use std::path::PathBuf;

mod cli_common;

use cli_common::{fails, json, ok, serve};

fn temp(name: &str) -> PathBuf {
    cli_common::temp("cli-coldstart", name)
}

#[test]
fn plan_deepplan_writes_the_plan_file() {
    let out = temp("plan.json");
    let text = ok(&serve(&[
        "plan",
        "deepplan",
        "--profile",
        "deepplan-v100-bert-base",
        "--topology",
        "p3.8xlarge",
        "--gpu",
        "1",
        "--json",
        out.to_str().unwrap(),
    ]));
    assert!(text.contains("embeddings.word_embeddings"), "{text}");
    let v = json(&out);
    let plan = v["plan"].as_array().unwrap();
    assert_eq!(plan.len(), 126);
    assert!(plan.iter().all(|m| m == "load" || m == "dha"));
    assert_eq!(plan[0], "dha", "the word embedding stays on the host");
    let (lat, all) = (v["latency_ms"].as_f64().unwrap(), v["all_load_latency_ms"].as_f64().unwrap());
    assert!(lat < all, "{lat} vs {all}");
    assert_eq!(v["partitions"].as_array().unwrap().len(), 2);
    assert_eq!(v["gpus"], serde_json::json!([1, 3]), "GPU 1 pairs with GPU 3 under the other switch");
    std::fs::remove_file(&out).ok();
}

#[test]
fn plan_deepplan_reads_a_profile_file_and_says_when_transmission_is_off() {
    let profile = temp("profile.json");
    std::fs::write(
        &profile,
        r#"{"model": "tiny", "layers": [
            {"name": "emb", "kind": "Embedding", "bytes": 4000000, "load_ms": 8, "exec_ms": 0.1, "dha_ms": 0.5},
            {"name": "relu", "kind": "ReLU", "bytes": 0, "load_ms": 0, "exec_ms": 0.2, "dha_ms": 0},
            {"name": "fc", "kind": "Linear", "bytes": 1000000, "load_ms": 2, "exec_ms": 1, "dha_ms": 30}]}"#,
    )
    .unwrap();
    let topology = temp("topology.json");
    std::fs::write(
        &topology,
        r#"{"gpus": [{"id": 0, "switch": 0}, {"id": 1, "switch": 0}], "nvlink": [[0, 1]]}"#,
    )
    .unwrap();
    let out = temp("tiny.json");
    let text = ok(&serve(&[
        "plan",
        "deepplan",
        "--profile",
        profile.to_str().unwrap(),
        "--topology",
        topology.to_str().unwrap(),
        "--json",
        out.to_str().unwrap(),
    ]));
    assert!(text.contains("parallel transmission off: every GPU sits under one PCIe switch"), "{text}");
    let v = json(&out);
    assert_eq!(v["plan"], serde_json::json!(["dha", "load", "load"]));
    assert_eq!(v["partitions"].as_array().unwrap().len(), 1);
    // The initial approach as an ablation.
    let text =
        ok(&serve(&["plan", "deepplan", "--profile", profile.to_str().unwrap(), "--algorithm", "initial"]));
    assert!(text.contains("1 on DHA"), "{text}");
    for p in [profile, topology, out] {
        std::fs::remove_file(p).ok();
    }
}

#[test]
fn bad_profiles_and_topologies_are_refused_precisely() {
    let profile = temp("bad-profile.json");
    std::fs::write(
        &profile,
        r#"{"model": "m", "layers": [{"name": "fc", "kind": "Linear", "bytes": 4, "load_ms": -1, "exec_ms": 1, "dha_ms": 2}]}"#,
    )
    .unwrap();
    let err = fails(&serve(&["plan", "deepplan", "--profile", profile.to_str().unwrap()]));
    assert!(err.contains("layer 0 (`fc`): `load_ms` is -1"), "{err}");
    std::fs::write(&profile, r#"{"model": "m", "layers": [{"name": "fc", "kind": "Linear", "bytes": 4}]}"#)
        .unwrap();
    let err = fails(&serve(&["plan", "deepplan", "--profile", profile.to_str().unwrap()]));
    assert!(err.contains("missing field `load_ms`"), "{err}");
    let err = fails(&serve(&["plan", "deepplan", "--profile", "/nonexistent/profile.json"]));
    assert!(err.contains("does not exist") && err.contains("deepplan-v100-bert-base"), "{err}");
    let err = fails(&serve(&[
        "plan",
        "deepplan",
        "--profile",
        "deepplan-v100-gpt2",
        "--topology",
        "p3.8xlarge",
        "--gpu",
        "7",
    ]));
    assert!(err.contains("--gpu 7: not a GPU of the topology"), "{err}");
    std::fs::remove_file(profile).ok();
}

#[test]
fn sim_coldstart_writes_json_and_svg() {
    let out = temp("sim.json");
    let svg = temp("sim.svg");
    let text = ok(&serve(&[
        "sim",
        "coldstart",
        "--instances",
        "40,160",
        "--measured",
        "1500",
        "--warmup",
        "500",
        "--json",
        out.to_str().unwrap(),
        "--svg",
        svg.to_str().unwrap(),
    ]));
    assert!(text.contains("simulated"), "{text}");
    let v = json(&out);
    assert_eq!(v["backend"], "sim");
    let single = v["single"].as_array().unwrap();
    assert_eq!(single.len(), 8);
    for row in single {
        let (b, ps, d, pd) = (
            row["baseline"].as_f64().unwrap(),
            row["pipeswitch"].as_f64().unwrap(),
            row["dha"].as_f64().unwrap(),
            row["pt+dha"].as_f64().unwrap(),
        );
        assert!(b > ps && ps > d && d > pd, "{row}");
    }
    let results = v["serving"]["results"].as_array().unwrap();
    assert_eq!(results.len(), 6, "three strategies at two instance counts");
    for r in results {
        assert_eq!(r["goodput"].as_array().unwrap().len(), 2, "two SLOs");
        let cold = r["cold_pct"].as_f64().unwrap();
        if r["instances"] == 40 {
            assert_eq!(cold, 0.0, "40 instances fit: {r}");
        } else {
            assert!(cold > 0.0, "160 instances do not fit: {r}");
        }
    }
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
    std::fs::remove_file(out).ok();
    std::fs::remove_file(svg).ok();
}

/// `serve profile --coldstart` measures a cold-start profile on the CPU executor that `serve plan
/// deepplan` reads; `serve bench coldstart` serves beyond device memory on the real cold server
/// and prints the simulator's prediction beside each measurement.
#[test]
fn profile_and_bench_coldstart_on_the_cpu() {
    let prof = temp("cpu-profile.json");
    ok(&serve(&["profile", "--coldstart", "--json", prof.to_str().unwrap()]));
    let v = json(&prof);
    let layers = v["layers"].as_array().unwrap();
    assert_eq!(layers[0]["kind"], "Embedding");
    assert!(layers.iter().all(|l| l["load_ms"].as_f64().unwrap() >= 0.0));
    let text = ok(&serve(&["plan", "deepplan", "--profile", prof.to_str().unwrap()]));
    assert!(text.contains("0:Embedding"), "the embedding goes to DHA: {text}");
    let err = fails(&serve(&[
        "profile",
        "ffi_examples/testdata/lstm_small",
        "--coldstart",
        "--json",
        prof.to_str().unwrap(),
    ]));
    assert!(err.contains("runs mlp models"), "{err}");

    let out = temp("bench.json");
    let text = ok(&serve(&[
        "bench",
        "coldstart",
        "--instances",
        "6",
        "--requests",
        "20",
        "--warmup",
        "4",
        "--rate",
        "30",
        "--blocks",
        "2",
        "--budget-instances",
        "2",
        "--json",
        out.to_str().unwrap(),
    ]));
    assert!(text.contains("sim/real"), "{text}");
    let v = json(&out);
    let results = v["results"].as_array().unwrap();
    assert_eq!(results.len(), 2, "PipeSwitch and DHA");
    for r in results {
        assert_eq!(r["completed"], 20);
        assert!(r["sim"]["p50_ms"].as_f64().unwrap() > 0.0);
    }
    // Six instances over a budget of two all-load instances: PipeSwitch starts cold often, the
    // DHA plan (the embedding on the host) fits them all after their first request.
    let cold = |p: &str| results.iter().find(|r| r["policy"] == p).unwrap()["cold_pct"].as_f64().unwrap();
    assert!(cold("pipeswitch") > cold("dha"), "{results:?}");
    std::fs::remove_file(prof).ok();
    std::fs::remove_file(out).ok();
}
