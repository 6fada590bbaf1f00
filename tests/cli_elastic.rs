//! `serve profile --engine-configs` and `serve bench elastic` end to end (issue 15; ARCHITECTURE.md
//! §8.6): E-Ebird's 252 configurations co-run on the CPU backend, their picks feeding the
//! simulator; every fixed-shape policy served by the real runtime.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

const SERVE: &str = env!("CARGO_BIN_EXE_serve");

fn serve(args: &[&str]) -> Output {
    Command::new(SERVE).args(args).output().expect("run serve")
}

fn ok(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "serve failed: {}\n{out}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    out
}

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("serve-cli-elastic-{}-{name}", std::process::id()))
}

fn json(path: &PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
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
    let out = temp("confs.json");
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
    let (j, svg) = (temp("bench.json"), temp("burst.svg"));
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
