//! `serve infer` under inputs that could exhaust or stall it: over-long and unending lines,
//! out-of-range options, outputs that overflow to ±inf, and the last partial batch at the end of
//! the input. (The everyday `serve infer` behaviour is in tests/cli.rs.)

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use serve::model::Mlp;
use serve::model::mlp::Linear;

const SERVE: &str = env!("CARGO_BIN_EXE_serve");

fn infer(model: &Path, input: &str, extra: &[&str]) -> Output {
    Command::new(SERVE)
        .args(["infer", model.to_str().unwrap(), "--input", input, "--backend", "cpu", "--threads", "1"])
        .args(extra)
        .output()
        .expect("run serve")
}

fn lines(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "serve failed ({}): {}", o.status, String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn error(v: &Value) -> (&str, &str) {
    let e = v.get("error").unwrap_or_else(|| panic!("expected an error line, got {v}"));
    (e["code"].as_str().unwrap(), e["message"].as_str().unwrap())
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_string()
}

#[test]
fn an_over_long_line_is_an_error_line_and_the_run_goes_on() {
    let (dir, _) = common::mlp_dir("infer-long", &[4, 2], 1);
    let good = r#"{"input":[1,2,3,4]}"#;
    // The limit is 64 bytes: a line of exactly 64 bytes is read, one of 65 is not (nor is one of
    // 10 000, however it is padded); the lines after them are served.
    let at_limit = format!(r#"{{"input":[1,2,3,4]}}{}"#, " ".repeat(64 - good.len()));
    let over = format!(r#"{{"input":[1,2,3,4]}}{}"#, " ".repeat(65 - good.len()));
    let huge = format!(r#"{{"input":[{}1]}}"#, "1,".repeat(5000));
    let file = write(&dir, "in.jsonl", &format!("{good}\n{at_limit}\n{over}\n{huge}\r\n{good}"));
    let out = lines(&infer(&dir, &file, &["--max-line-bytes", "64"]));
    assert_eq!(out.len(), 5, "{out:?}");
    for k in [0, 1, 4] {
        assert!(out[k].get("output").is_some(), "line {}: {}", k + 1, out[k]);
    }
    let (code, msg) = error(&out[2]);
    assert_eq!((code, msg), ("INVALID_ARGUMENT", "line 3 is 65 bytes; the limit is 64 (--max-line-bytes)"));
    let (code, msg) = error(&out[3]);
    assert_eq!(code, "INVALID_ARGUMENT");
    assert!(msg.starts_with(&format!("line 4 is {} bytes;", huge.len() + 1)), "{msg}");
}

#[test]
fn an_unending_line_ends_the_input_with_an_error_line_and_exit_0() {
    // /dev/zero has no newline: it is skipped up to the documented 1 GiB, then reading stops.
    let (dir, _) = common::mlp_dir("infer-zero", &[4, 2], 1);
    let out = lines(&infer(&dir, "/dev/zero", &["--max-line-bytes", "1024"]));
    assert_eq!(out.len(), 1, "{out:?}");
    let (code, msg) = error(&out[0]);
    assert_eq!(code, "INVALID_ARGUMENT");
    assert!(msg.starts_with("line 1 has no newline in its first"), "{msg}");
    assert!(msg.ends_with("(the limit is 1024 (--max-line-bytes)); the input is read no further"), "{msg}");
}

#[test]
fn numeric_options_are_bounded_with_a_precise_error() {
    let (dir, _) = common::mlp_dir("infer-opts", &[4, 2], 1);
    let file = write(&dir, "in.jsonl", "{\"input\":[1,2,3,4]}\n");
    for (opt, bad, range) in [
        ("--max-wait-us", "60000001", "0..=60000000"),
        ("--max-wait-us", "18446744073709551615", "0..=60000000"),
        ("--max-batch", "65537", "1..=65536"),
        ("--max-batch", "0", "1..=65536"),
        ("--max-inflight", "1048577", "1..=1048576"),
        ("--threads", "1025", "0..=1024"),
        ("--max-line-bytes", "0", "1..=1073741824"),
        ("--max-line-bytes", "1073741825", "1..=1073741824"),
    ] {
        let o = Command::new(SERVE)
            .args(["infer", dir.to_str().unwrap(), "--input", &file, opt, bad])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{opt} {bad}: {err}");
        assert!(err.contains(opt) && err.contains(&format!("{bad} is not in {range}")), "{opt} {bad}: {err}");
    }
    // The maxima themselves are accepted.
    let out = lines(&infer(&dir, &file, &["--max-wait-us", "60000000", "--max-batch", "65536"]));
    assert!(out[0].get("output").is_some());
}

#[test]
fn outputs_that_overflow_are_written_as_strings_never_null() {
    // Finite weights and inputs whose products overflow f32: +inf, -inf and inf - inf = NaN.
    let big = 1e38f32;
    let mlp = Mlp {
        layers: vec![Linear {
            in_features: 2,
            out_features: 4,
            weight: vec![big, big, -big, -big, big, -big, 1.0, 1.0],
            bias: vec![0.0; 4],
        }],
    };
    let dir = common::tempdir("infer-inf");
    mlp.save(&dir).unwrap();
    let file = write(&dir, "in.jsonl", "{\"input\":[1e38, 1e38]}\n");
    let o = infer(&dir, &file, &[]);
    let text = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(!text.contains("null"), "{text}");
    let out = lines(&o);
    assert_eq!(out[0]["output"], serde_json::json!(["Infinity", "-Infinity", "NaN", 2e38]), "{text}");
}

#[test]
fn the_last_partial_batch_is_not_held_for_the_max_wait_at_end_of_input() {
    // 3 requests, max batch 8, max wait 60 s: without the end-of-input flush they would wait the
    // full minute. The 30 s limit is only a guard against that (a huge margin, not a timing
    // measurement).
    let (dir, _) = common::mlp_dir("infer-flush", &[4, 2], 1);
    let file = write(&dir, "in.jsonl", &"{\"input\":[1,2,3,4]}\n".repeat(3));
    let mut child = Command::new(SERVE)
        .args(["infer", dir.to_str().unwrap(), "--input", &file, "--backend", "cpu"])
        .args(["--max-batch", "8", "--max-wait-us", "60000000"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            panic!("serve infer still waiting for a fuller batch after the input ended");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success());
    let mut text = String::new();
    child.stdout.take().unwrap().read_to_string(&mut text).unwrap();
    assert_eq!(text.lines().filter(|l| l.starts_with("{\"output\"")).count(), 3, "{text}");
}
