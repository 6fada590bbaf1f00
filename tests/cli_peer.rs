//! `serve bench lstm`'s PyTorch peer (issue 19, ARCHITECTURE.md §8.3) end to end, where no
//! PyTorch is needed: without a python that imports torch, or for a kind or backend that has no
//! peer, the bench says so in one line and runs libserve's policies alone.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

const SERVE: &str = env!("CARGO_BIN_EXE_serve");

/// A tiny `serve bench KIND` at one rate with `extra` arguments; (stdout, JSON report).
fn bench(kind: &str, name: &str, extra: &[&str]) -> (String, Value) {
    let json: PathBuf =
        std::env::temp_dir().join(format!("serve-cli-peer-{}-{name}.json", std::process::id()));
    let json_arg = json.to_str().expect("UTF-8 temp path");
    let mut args =
        vec!["bench", kind, "--backend", "cpu", "--threads", "2", "--hidden", "16", "--vocab", "64"];
    args.extend(["--requests", "20", "--rate", "200", "--json", json_arg]);
    args.extend_from_slice(extra);
    // The peer's python comes from --python here, never from the environment.
    let o: Output =
        Command::new(SERVE).args(&args).env_remove("SERVE_TORCH_PYTHON").output().expect("run serve");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "serve failed: {}\n{out}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("the report")).expect("JSON");
    let _ = std::fs::remove_file(&json);
    (out, v)
}

/// libserve's two policies ran at the one rate.
fn check_libserve_ran(v: &Value) {
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{v}");
    for r in results {
        assert_eq!(r["completed"].as_u64().unwrap() + r["errors"].as_u64().unwrap(), 20, "{r}");
    }
}

#[test]
fn bench_lstm_without_torch_skips_the_peer_and_still_succeeds() {
    let (out, v) = bench("lstm", "skip", &["--peer", "auto", "--python", "/nonexistent/python"]);
    let lines: Vec<&str> = out.lines().filter(|l| l.contains("PyTorch peer")).collect();
    assert_eq!(lines.len(), 1, "one visible line: {out}");
    assert!(lines[0].starts_with("# PyTorch peer: SKIPPED (cannot run /nonexistent/python"), "{out}");
    assert!(lines[0].contains("--python") && lines[0].contains("pip install torch"), "says how: {out}");
    assert!(!out.contains("torch-best"), "no ratios against a peer that did not run: {out}");
    check_libserve_ran(&v);
    assert_eq!(v["peer"]["status"], "skipped", "{v}");
    assert!(v["peer"]["reason"].as_str().unwrap().contains("/nonexistent/python"), "{v}");
}

#[test]
fn bench_peer_off_and_kinds_without_a_peer() {
    let (out, v) = bench("lstm", "off", &["--peer", "off", "--python", "/nonexistent/python"]);
    assert!(!out.contains("PyTorch peer"), "{out}");
    assert_eq!(v["peer"]["status"], "off");
    check_libserve_ran(&v);
    let (out, v) = bench("treelstm", "tree", &["--python", "/nonexistent/python"]);
    assert!(out.contains("# PyTorch peer: not available for `bench treelstm`"), "{out}");
    assert_eq!(v["peer"]["status"], "unavailable");
    check_libserve_ran(&v);
}
