//! The `serve` binary end to end: `info`, `infer` (DESIGN §6), `bench mlp` (DESIGN §8), `demo`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;
use serve::model::Mlp;

const SERVE: &str = env!("CARGO_BIN_EXE_serve");

/// A directory under the system temp dir, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("serve-cli-{name}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("create temp dir");
        TempDir(dir)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serve(args: &[&str]) -> Output {
    Command::new(SERVE).args(args).output().expect("run serve")
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("stdout is UTF-8")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn check_ok(o: &Output) {
    assert!(
        o.status.success(),
        "serve failed ({}):\nstdout:\n{}\nstderr:\n{}",
        o.status,
        stdout(o),
        stderr(o)
    );
}

/// A random mlp written as a model directory.
fn mlp_model(dir: &Path, sizes: &[usize], seed: u64) -> (Mlp, PathBuf) {
    let mlp = Mlp::random(sizes, seed);
    let model_dir = dir.join("mlp");
    mlp.save(&model_dir).expect("save mlp");
    (mlp, model_dir)
}

/// A deterministic input vector of length `n` (distinct per `k`).
fn vector(n: usize, k: usize) -> Vec<f32> {
    (0..n).map(|i| (((i * 7 + k * 13) % 17) as f32 - 8.0) / 8.0).collect()
}

fn input_line(v: &[f32]) -> String {
    serde_json::json!({ "input": v }).to_string()
}

fn assert_matches_reference(line: &str, mlp: &Mlp, x: &[f32], what: &str) {
    let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {line}"));
    let got: Vec<f64> = v
        .get("output")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("{what}: expected {{\"output\":[…]}}, got {line}"))
        .iter()
        .map(|x| x.as_f64().expect("output values are numbers"))
        .collect();
    let want = mlp.forward_reference(x);
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max((*w as f64).abs())).max(1e-6);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let w = *w as f64;
        assert!((g - w).abs() <= 1e-4 * w.abs().max(scale), "{what}: output[{i}] = {g}, reference {w}");
    }
}

/// `{"error":{"code":…,"message":…}}` → (code, message).
fn error_of(line: &str) -> Option<(String, String)> {
    let v: Value = serde_json::from_str(line).ok()?;
    let e = v.get("error")?;
    Some((e.get("code")?.as_str()?.to_string(), e.get("message")?.as_str()?.to_string()))
}

#[test]
fn info_exits_zero_and_names_the_backend() {
    let o = serve(&["info"]);
    check_ok(&o);
    let out = stdout(&o);
    assert!(out.contains(&format!("libserve {}", serve::VERSION)), "{out}");
    assert!(out.contains("backend (auto): cpu") || out.contains("backend (auto): cuda"), "{out}");
    assert!(out.contains("cuda devices:"), "{out}");
}

/// What one line of the mixed input file is expected to produce.
enum Expect {
    Output(Vec<f32>),
    Error { code: &'static str, contains: &'static str },
}

fn mixed_requests(n_in: usize) -> Vec<(String, Expect)> {
    use Expect::*;
    let inv = |contains| Error { code: "INVALID_ARGUMENT", contains };
    let mut lines = Vec::new();
    for k in 0..3 {
        lines.push((input_line(&vector(n_in, k)), Output(vector(n_in, k))));
    }
    lines.extend([
        (r#"{"input":[1,2,3]}"#.to_string(), inv("input has length 3")),
        (r#"{"input":[1, 2,"#.to_string(), inv("malformed JSON")),
        (r#"{"tokens":[1, 1.5]}"#.to_string(), inv("`tokens[1]` = 1.5")),
        (r#"{"tokens":[-1]}"#.to_string(), inv("`tokens[0]` = -1")),
        (r#"{"tokens":["a"]}"#.to_string(), inv("`tokens[0]` is a string")),
        (r#"{"tokens":[4294967296]}"#.to_string(), inv("`tokens[0]` = 4294967296")),
        // Well-formed token requests reach the model, which takes f32 vectors only.
        (r#"{"tokens":[1, 2]}"#.to_string(), inv("token sequence")),
        (r#"{"tokens":[1, 2],"parents":[-1, 0]}"#.to_string(), inv("tree")),
        (r#"{"tokens":[1],"parents":[true]}"#.to_string(), inv("`parents[0]` is a boolean")),
        (r#"{"tokens":[1],"parents":"0"}"#.to_string(), inv("`parents` must be an array")),
        ("{}".to_string(), inv("missing key")),
        (r#"{"input":"x"}"#.to_string(), inv("`input` must be an array")),
        (r#"{"input":[1, "2"]}"#.to_string(), inv("`input[1]` is a string")),
        ("[1, 2]".to_string(), inv("expected a JSON object")),
        (String::new(), inv("empty line")),
    ]);
    // Enough good requests after the bad ones that several batches form.
    for k in 3..40 {
        lines.push((input_line(&vector(n_in, k)), Output(vector(n_in, k))));
    }
    lines
}

fn check_infer_output(out: &str, mlp: &Mlp, requests: &[(String, Expect)]) {
    let got: Vec<&str> = out.lines().collect();
    assert_eq!(got.len(), requests.len(), "one output line per input line:\n{out}");
    for (i, (line, (req, expect))) in got.iter().zip(requests).enumerate() {
        let what = format!("line {} (`{req}`)", i + 1);
        match expect {
            Expect::Output(x) => assert_matches_reference(line, mlp, x, &what),
            Expect::Error { code, contains } => {
                let (c, m) =
                    error_of(line).unwrap_or_else(|| panic!("{what}: expected an error, got {line}"));
                assert_eq!(&c, code, "{what}: {m}");
                assert!(m.contains(contains), "{what}: message `{m}` should mention `{contains}`");
                assert!(m.starts_with(&format!("line {}: ", i + 1)), "{what}: message `{m}` names its line");
            }
        }
    }
}

#[test]
fn infer_writes_one_line_per_request_in_order() {
    let tmp = TempDir::new("infer");
    let (mlp, model) = mlp_model(tmp.path(), &[8, 16, 4], 3);
    let requests = mixed_requests(8);
    let file = tmp.path().join("requests.jsonl");
    let text: String = requests.iter().map(|(l, _)| format!("{l}\n")).collect();
    std::fs::write(&file, text).unwrap();
    let o = serve(&[
        "infer",
        model.to_str().unwrap(),
        "--input",
        file.to_str().unwrap(),
        "--backend",
        "cpu",
        "--threads",
        "2",
        "--max-batch",
        "8",
    ]);
    check_ok(&o);
    check_infer_output(&stdout(&o), &mlp, &requests);
}

#[test]
fn infer_reads_stdin_with_dash_and_handles_crlf_and_a_missing_final_newline() {
    let tmp = TempDir::new("stdin");
    let (mlp, model) = mlp_model(tmp.path(), &[5, 7, 3], 9);
    let requests = mixed_requests(5);
    let mut text: String = requests.iter().map(|(l, _)| format!("{l}\r\n")).collect();
    text.truncate(text.len() - 2);
    let mut child = Command::new(SERVE)
        .args(["infer", model.to_str().unwrap(), "--input", "-", "--backend", "cpu"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn serve");
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(text.as_bytes()));
    let o = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    check_ok(&o);
    check_infer_output(&stdout(&o), &mlp, &requests);
}

#[test]
fn infer_retries_busy_submits_when_the_admission_bound_is_small() {
    let tmp = TempDir::new("busy");
    let (mlp, model) = mlp_model(tmp.path(), &[6, 32, 32, 2], 5);
    let xs: Vec<Vec<f32>> = (0..300).map(|k| vector(6, k)).collect();
    let file = tmp.path().join("requests.jsonl");
    std::fs::write(&file, xs.iter().map(|x| input_line(x) + "\n").collect::<String>()).unwrap();
    let o = serve(&[
        "infer",
        model.to_str().unwrap(),
        "--input",
        file.to_str().unwrap(),
        "--backend",
        "cpu",
        "--max-inflight",
        "3",
        "--max-batch",
        "2",
    ]);
    check_ok(&o);
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), xs.len());
    for (k, (line, x)) in lines.iter().zip(&xs).enumerate() {
        assert_matches_reference(line, &mlp, x, &format!("line {}", k + 1));
    }
}

#[test]
fn infer_fails_when_the_model_cannot_be_loaded() {
    let tmp = TempDir::new("nomodel");
    let file = tmp.path().join("requests.jsonl");
    std::fs::write(&file, "{\"input\":[1]}\n").unwrap();
    let missing = tmp.path().join("no-such-model");
    let o = serve(&["infer", missing.to_str().unwrap(), "--input", file.to_str().unwrap()]);
    assert!(!o.status.success(), "a missing model directory must fail");
    assert!(stdout(&o).is_empty(), "no result lines: {}", stdout(&o));
    let err = stderr(&o);
    assert!(err.contains("no-such-model") && err.contains("NOT_FOUND"), "{err}");

    // A directory that is not a model: a FORMAT / NOT_FOUND error, still fatal.
    let o = serve(&["infer", tmp.path().to_str().unwrap(), "--input", file.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("cannot load model"), "{}", stderr(&o));
}

#[test]
fn infer_fails_when_the_input_cannot_be_read() {
    let tmp = TempDir::new("noinput");
    let (_, model) = mlp_model(tmp.path(), &[2, 2], 1);
    let missing = tmp.path().join("missing.jsonl");
    let o = serve(&["infer", model.to_str().unwrap(), "--input", missing.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("missing.jsonl"), "{}", stderr(&o));
    let o = serve(&["infer", model.to_str().unwrap(), "--input", tmp.path().to_str().unwrap()]);
    assert!(!o.status.success(), "a directory is not an input file");
}

fn field<'a>(v: &'a Value, key: &str) -> &'a Value {
    v.get(key).unwrap_or_else(|| panic!("missing field `{key}` in {v}"))
}

fn check_result_fields(r: &Value) {
    assert!(field(r, "policy").is_string(), "{r}");
    for k in ["offered_rps", "throughput_rps", "p50_ms", "p90_ms", "p99_ms", "mean_batch"] {
        let x = field(r, k).as_f64().unwrap_or_else(|| panic!("`{k}` is a number in {r}"));
        assert!(x.is_finite() && x >= 0.0, "`{k}` = {x}");
    }
    for k in ["completed", "errors"] {
        assert!(field(r, k).is_u64(), "`{k}` is an unsigned integer in {r}");
    }
    let (p50, p90, p99) = (field(r, "p50_ms"), field(r, "p90_ms"), field(r, "p99_ms"));
    assert!(p50.as_f64() <= p90.as_f64() && p90.as_f64() <= p99.as_f64(), "{r}");
}

#[test]
fn bench_mlp_writes_the_design_json() {
    let tmp = TempDir::new("bench");
    let json = tmp.path().join("bench.json");
    let o = serve(&[
        "bench",
        "mlp",
        "--requests",
        "200",
        "--rate",
        "500",
        "--json",
        json.to_str().unwrap(),
        "--backend",
        "cpu",
    ]);
    check_ok(&o);
    let out = stdout(&o);
    assert!(out.contains("ratio batched/unbatched at 500.0 rps"), "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    assert_eq!(field(&v, "workload"), "poisson");
    assert_eq!(field(&v, "backend"), "cpu");
    let sizes: Vec<u64> =
        field(field(&v, "model"), "sizes").as_array().unwrap().iter().map(|s| s.as_u64().unwrap()).collect();
    assert_eq!(sizes, [256, 256, 256, 256], "CPU scale by default");
    let results = field(&v, "results").as_array().unwrap();
    assert_eq!(results.len(), 2, "batched and unbatched at the one rate");
    assert_eq!(field(&results[0], "policy"), "timeout(s=32,t=0us)");
    assert_eq!(field(&results[1], "policy"), "unbatched");
    for r in results {
        check_result_fields(r);
        assert_eq!(field(r, "offered_rps").as_f64(), Some(500.0));
        let (c, e) = (field(r, "completed").as_u64().unwrap(), field(r, "errors").as_u64().unwrap());
        assert_eq!(c + e, 200, "every request accounted for: {r}");
        assert!(c > 0, "{r}");
    }
    assert_eq!(field(&results[1], "mean_batch").as_f64(), Some(1.0), "unbatched tasks carry one request");
}

#[test]
fn bench_mlp_on_a_model_dir_with_qos_and_no_comparison() {
    let tmp = TempDir::new("benchdir");
    let (_, model) = mlp_model(tmp.path(), &[16, 32, 4], 2);
    let json = tmp.path().join("out.json");
    let o = serve(&[
        "bench",
        "mlp",
        "--model",
        model.to_str().unwrap(),
        "--rate",
        "300,600",
        "--requests",
        "60",
        "--compare-batch",
        "false",
        "--qos-ms",
        "1000",
        "--max-batch",
        "8",
        "--max-wait-us",
        "200",
        "--json",
        json.to_str().unwrap(),
    ]);
    check_ok(&o);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    let sizes: Vec<u64> =
        field(field(&v, "model"), "sizes").as_array().unwrap().iter().map(|s| s.as_u64().unwrap()).collect();
    assert_eq!(sizes, [16, 32, 4]);
    let results = field(&v, "results").as_array().unwrap();
    assert_eq!(results.len(), 2, "one result per rate, no unbatched runs");
    for (r, rate) in results.iter().zip([300.0, 600.0]) {
        check_result_fields(r);
        assert_eq!(field(r, "policy"), "timeout(s=8,t=200us)");
        assert_eq!(field(r, "offered_rps").as_f64(), Some(rate));
        assert!(field(r, "goodput_rps").as_f64().is_some(), "goodput with --qos-ms: {r}");
    }
}

#[test]
fn bench_rejects_bad_arguments() {
    for args in [
        &["bench", "mlp", "--rate", "0"][..],
        &["bench", "mlp", "--rate", "-5"],
        &["bench", "mlp", "--max-batch", "0"],
        &["bench", "mlp", "--sizes", "8"],
        &["bench", "mlp", "--model", "/nonexistent/serve-model", "--rate", "10", "--requests", "1"],
        &["bench", "mlp", "--rate", "10", "--requests", "1", "--json", "/nonexistent/serve-dir/out.json"],
    ] {
        let o = serve(args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(!stderr(&o).is_empty(), "{args:?} says why");
    }
}

#[test]
fn demo_is_the_default_command_and_finishes() {
    let o = serve(&[]);
    check_ok(&o);
    let out = stdout(&o);
    assert!(out.contains("outputs match the f64 reference"), "{out}");
    assert!(out.contains("ratio batched/unbatched"), "{out}");
    assert!(out.contains("demo done"), "{out}");
}
