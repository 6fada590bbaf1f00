//! The `serve` binary end to end: `info`, `infer` (ARCHITECTURE.md §6; mlp and the recurrent fixtures),
//! `bench mlp|lstm|seq2seq|treelstm|step` (ARCHITECTURE.md §8), `demo`.

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
        // Tests run in parallel threads of one process: a counter keeps two directories of the
        // same name apart even when the clock reads the same for both (one test's drop would
        // otherwise delete the other's files).
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!("serve-cli-{name}-{}-{n}-{nanos}", std::process::id()));
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
    // Present or absent, the counters are reported (this VM has no `cpu` PMU).
    let has_pmu = std::path::Path::new("/sys/bus/event_source/devices/cpu").exists()
        || std::path::Path::new("/sys/bus/event_source/devices/cpu_core").exists();
    let want = if has_pmu { "PMU present" } else { "hardware counters: absent" };
    assert!(out.contains(want), "{out}");
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
        &["bench", "mlp", "--max-batch", "65537"],
        &["bench", "mlp", "--max-wait-us", "60000001"],
        &["bench", "mlp", "--workers", "257"],
        &["bench", "mlp", "--capacity-s", "1e300"],
        &["bench", "mlp", "--duration-s", "3601"],
        &["bench", "mlp", "--qos-ms", "1e300"],
        &["bench", "lstm", "--capacity-s", "1e300"],
        &["bench", "mlp", "--sizes", "8"],
        &["bench", "mlp", "--model", "/nonexistent/serve-model", "--rate", "10", "--requests", "1"],
        &["bench", "mlp", "--rate", "10", "--requests", "1", "--json", "/nonexistent/serve-dir/out.json"],
    ] {
        let o = serve(args);
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(!stderr(&o).is_empty(), "{args:?} says why");
        assert!(!stderr(&o).contains("panicked"), "{args:?}: {}", stderr(&o));
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

// ---------------------------------------------------------------------------------------------
// Recurrent models: `infer` on the committed fixtures, `bench lstm|seq2seq|treelstm`, `bench step`
// ---------------------------------------------------------------------------------------------

/// A committed fixture model directory (ffi_examples/testdata/NAME).
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata").join(name)
}

/// The fixture's `expected.json` requests: (request line, expected result object).
fn fixture_requests(name: &str) -> Vec<(String, Value)> {
    let text = std::fs::read_to_string(fixture(name).join("expected.json")).expect("read expected.json");
    let v: Value = serde_json::from_str(&text).expect("expected.json is JSON");
    field(&v, "requests")
        .as_array()
        .expect("`requests` is an array")
        .iter()
        .map(|r| {
            let mut req = serde_json::Map::new();
            req.insert("tokens".into(), field(r, "tokens").clone());
            if let Some(p) = r.get("parents") {
                req.insert("parents".into(), p.clone());
            }
            (Value::Object(req).to_string(), r.clone())
        })
        .collect()
}

fn run_infer(model: &Path, lines: &[String], tmp: &TempDir) -> String {
    let file = tmp.path().join("requests.jsonl");
    std::fs::write(&file, lines.iter().map(|l| format!("{l}\n")).collect::<String>()).unwrap();
    let o = serve(&[
        "infer",
        model.to_str().unwrap(),
        "--input",
        file.to_str().unwrap(),
        "--backend",
        "cpu",
        "--threads",
        "2",
    ]);
    check_ok(&o);
    stdout(&o)
}

/// A result line against a fixture's expected object: `output` floats within 1e-4, or
/// `output_tokens` exactly (as `{"tokens":[…]}`).
fn check_fixture_line(line: &str, want: &Value, what: &str) {
    let got: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {line}"));
    if let Some(tokens) = want.get("output_tokens") {
        assert_eq!(got.get("tokens"), Some(tokens), "{what}: decoded tokens; got {line}");
        return;
    }
    let want: Vec<f64> =
        field(want, "output").as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
    let got: Vec<f64> = got
        .get("output")
        .and_then(Value::as_array)
        .unwrap_or_else(|| panic!("{what}: expected {{\"output\":[…]}}, got {line}"))
        .iter()
        .map(|x| x.as_f64().expect("numbers"))
        .collect();
    assert_eq!(got.len(), want.len(), "{what}: output length");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-4, "{what}: output[{i}] = {g}, expected {w}");
    }
}

#[test]
fn infer_runs_the_recurrent_fixtures() {
    for name in ["lstm_small", "seq2seq_small", "treelstm_small"] {
        let tmp = TempDir::new(name);
        let requests = fixture_requests(name);
        assert!(!requests.is_empty(), "{name}: requests");
        let lines: Vec<String> = requests.iter().map(|(l, _)| l.clone()).collect();
        let out = run_infer(&fixture(name), &lines, &tmp);
        let got: Vec<&str> = out.lines().collect();
        assert_eq!(got.len(), requests.len(), "{name}: one line per request:\n{out}");
        for (i, (line, (req, want))) in got.iter().zip(&requests).enumerate() {
            check_fixture_line(line, want, &format!("{name} line {} (`{req}`)", i + 1));
        }
    }
}

/// What one line of a recurrent model's input is expected to produce.
enum Want<'a> {
    /// A fixture's expected result object.
    Fixture(&'a Value),
    /// INVALID_ARGUMENT with a message containing this.
    Invalid(&'static str),
}

#[test]
fn infer_rejects_non_integer_tokens_per_line() {
    let tmp = TempDir::new("tokens");
    let requests = fixture_requests("lstm_small");
    let mut lines: Vec<(String, Want)> = vec![(requests[0].0.clone(), Want::Fixture(&requests[0].1))];
    for (bad, contains) in [
        (r#"{"tokens":[1.5]}"#, "`tokens[0]` = 1.5"),
        (r#"{"tokens":[3, 2.5]}"#, "`tokens[1]` = 2.5"),
        (r#"{"tokens":["a"]}"#, "`tokens[0]` is a string"),
        (r#"{"tokens":[4, -1]}"#, "`tokens[1]` = -1"),
        (r#"{"tokens":[4294967296]}"#, "`tokens[0]` = 4294967296"),
        (r#"{"tokens":[1e3]}"#, "`tokens[0]`"),
        (r#"{"tokens":[null]}"#, "`tokens[0]` is null"),
        // Well-formed but outside the fixture's vocabulary of 50: the model says where.
        (r#"{"tokens":[1, 2, 50]}"#, "position 2"),
        (r#"{"tokens":[]}"#, "empty"),
        (r#"{"tokens":[1, 2],"parents":[-1, 0]}"#, "tree"),
    ] {
        lines.push((bad.to_string(), Want::Invalid(contains)));
    }
    for (l, want) in &requests[1..] {
        lines.push((l.clone(), Want::Fixture(want)));
    }
    let text: Vec<String> = lines.iter().map(|(l, _)| l.clone()).collect();
    let out = run_infer(&fixture("lstm_small"), &text, &tmp);
    let got: Vec<&str> = out.lines().collect();
    assert_eq!(got.len(), lines.len(), "one line per request:\n{out}");
    for (i, (line, (req, want))) in got.iter().zip(&lines).enumerate() {
        let what = format!("line {} (`{req}`)", i + 1);
        match want {
            Want::Invalid(contains) => {
                let (c, m) =
                    error_of(line).unwrap_or_else(|| panic!("{what}: expected an error, got {line}"));
                assert_eq!(c, "INVALID_ARGUMENT", "{what}: {m}");
                assert!(m.contains(contains), "{what}: message `{m}` should mention `{contains}`");
                assert!(m.starts_with(&format!("line {}: ", i + 1)), "{what}: message `{m}` names its line");
            }
            Want::Fixture(want) => check_fixture_line(line, want, &what),
        }
    }
}

/// `serve bench KIND` with tiny sizes and `extra` arguments, without the PyTorch peer (its own
/// tests are in cli_peer.rs); returns (stdout, JSON report).
fn bench_rnn(kind: &str, extra: &[&str]) -> (String, Value) {
    let tmp = TempDir::new(&format!("bench-{kind}"));
    let json = tmp.path().join("bench.json");
    let mut args = vec![
        "bench",
        kind,
        "--backend",
        "cpu",
        "--threads",
        "2",
        "--peer",
        "off",
        "--json",
        json.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let o = serve(&args);
    check_ok(&o);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    (stdout(&o), v)
}

const TINY: [&str; 4] = ["--hidden", "16", "--vocab", "64"];

/// Both policies at each rate of `rates`, every request accounted for.
fn check_rnn_results(v: &Value, rates: &[f64], requests: u64) {
    assert_eq!(field(v, "backend"), "cpu");
    let results = field(v, "results").as_array().unwrap();
    assert_eq!(results.len(), 2 * rates.len(), "both policies at every rate: {v}");
    for (pair, &rate) in results.chunks(2).zip(rates) {
        assert!(field(&pair[0], "policy").as_str().unwrap().starts_with("cellular("), "{}", pair[0]);
        assert!(field(&pair[1], "policy").as_str().unwrap().starts_with("padding("), "{}", pair[1]);
        for r in pair {
            check_result_fields(r);
            assert_eq!(field(r, "offered_rps").as_f64(), Some(rate), "{r}");
            let (c, e) = (field(r, "completed").as_u64().unwrap(), field(r, "errors").as_u64().unwrap());
            assert_eq!(c + e, requests, "every request accounted for: {r}");
            assert!(c > 0, "{r}");
            assert!(field(r, "mean_batch").as_f64().unwrap() >= 1.0, "{r}");
        }
    }
    let comparisons = field(v, "comparisons").as_array().unwrap();
    assert_eq!(comparisons.len(), rates.len());
    for c in comparisons {
        for k in ["throughput_ratio", "p90_ratio"] {
            assert!(field(c, k).as_f64().is_some_and(|x| x > 0.0), "`{k}` in {c}");
        }
    }
}

#[test]
fn bench_lstm_compares_cellular_and_padding_in_the_design_json() {
    let mut args = TINY.to_vec();
    args.extend(["--requests", "40", "--rate", "300"]);
    let (out, v) = bench_rnn("lstm", &args);
    assert!(out.contains("ratio cellular/padding at 300.0 rps"), "{out}");
    assert!(out.contains("custom scale (hidden 16)") && out.contains("GPU scale h=1024"), "{out}");
    assert_eq!(field(&v, "workload"), "poisson/wmt");
    let model = field(&v, "model");
    assert_eq!(field(model, "kind"), "lstm");
    assert_eq!(field(model, "hidden").as_u64(), Some(16));
    assert_eq!(field(model, "layers").as_u64(), Some(1));
    check_rnn_results(&v, &[300.0], 40);
    assert!(field(&v, "peaks").as_array().unwrap().is_empty(), "no peaks measured with --rate");
    // One request at a time, per policy: latency = compute + time outside compute.
    assert!(out.contains("# alone cellular(") && out.contains("# alone padding("), "{out}");
    let alone = field(&v, "alone").as_array().unwrap();
    assert_eq!(alone.len(), 2, "{v}");
    for a in alone {
        let num = |k: &str| field(a, k).as_f64().unwrap();
        assert!(num("latency_us") > num("compute_us") && num("compute_us") > 0.0, "{a}");
        assert!(num("tasks_per_request") >= 1.0, "{a}");
    }
}

/// A closed loop may keep the whole admission bound in flight: a completion's place is free once
/// the bench has read it, so its replacement is never refused BUSY.
#[test]
fn bench_peak_with_the_whole_admission_bound_in_flight() {
    let mut args = TINY.to_vec();
    args.extend([
        "--policy",
        "cellular",
        "--capacity-s",
        "0.3",
        "--capacity-window",
        "4096",
        "--rate",
        "200",
        "--measure-peak",
        "true",
        "--requests",
        "30",
    ]);
    let (_, v) = bench_rnn("lstm", &args);
    let peaks = field(&v, "peaks").as_array().unwrap();
    assert!(field(&peaks[0], "peak_rps").as_f64().unwrap() > 0.0, "{v}");
}

#[test]
fn bench_lstm_offers_fractions_of_each_policys_peak() {
    let mut args = TINY.to_vec();
    args.extend(["--capacity-s", "0.3", "--capacity-window", "64", "--fractions", "0.5", "--requests", "30"]);
    let (out, v) = bench_rnn("lstm", &args);
    assert!(out.contains("ratio cellular/padding peak throughput"), "{out}");
    assert!(out.contains("p90 cellular/padding at 50% of padding's peak"), "{out}");
    let peaks = field(&v, "peaks").as_array().unwrap();
    assert_eq!(peaks.len(), 2, "{v}");
    let peak = |i: usize| field(&peaks[i], "peak_rps").as_f64().unwrap();
    assert!(peak(0) > 0.0 && peak(1) > 0.0);
    let r = field(&v, "peak_ratio").as_f64().unwrap();
    assert!((r - peak(0) / peak(1)).abs() < 1e-9, "peak ratio cellular/padding");
    assert!(field(&v, "p90_ratio_at_half_padding_peak").as_f64().is_some(), "{v}");
    // Half of each peak (merged when they round to the same rate), both policies at each.
    let mut rates: Vec<f64> = [peak(0), peak(1)].iter().map(|p| (0.5 * p).round().max(1.0)).collect();
    rates.sort_by(f64::total_cmp);
    rates.dedup_by(|a, b| (*a - *b).abs() < 0.5);
    check_rnn_results(&v, &rates, 30);
    for r in field(&v, "results").as_array().unwrap() {
        assert!(field(r, "peak_rps").as_f64().is_some(), "{r}");
    }
}

#[test]
fn bench_seq2seq_reports_decode_lengths() {
    let mut args = TINY.to_vec();
    args.extend(["--max-decode", "6", "--requests", "30", "--rate", "200"]);
    let (out, v) = bench_rnn("seq2seq", &args);
    assert!(out.contains("proj.bias[eos] +="), "{out}");
    let model = field(&v, "model");
    assert_eq!(field(model, "max_decode").as_u64(), Some(6));
    assert!(field(model, "eos_bias").as_f64().is_some(), "{model}");
    check_rnn_results(&v, &[200.0], 30);
    for r in field(&v, "results").as_array().unwrap() {
        let t = field(r, "mean_output_tokens").as_f64().unwrap();
        assert!((1.0..=6.0).contains(&t), "mean decode length {t} within max_decode: {r}");
    }
}

#[test]
fn bench_treelstm_uses_treebank_trees() {
    let mut args = TINY.to_vec();
    args.extend(["--requests", "30", "--rate", "200", "--max-batch", "64"]);
    let (out, v) = bench_rnn("treelstm", &args);
    assert!(out.contains("TreeBank-like trees"), "{out}");
    assert_eq!(field(&v, "workload"), "poisson/treebank");
    assert_eq!(field(field(&v, "model"), "kind"), "treelstm");
    check_rnn_results(&v, &[200.0], 30);
    let results = field(&v, "results").as_array().unwrap();
    assert_eq!(field(&results[0], "policy"), "cellular(b=64,k=5)");
    // On the CPU, padding is a framework's bucketing server: oldest bucket first, one worker
    // per compute thread.
    assert_eq!(field(&results[1], "policy"), "padding(b=64,bucket=10,k=5,oldest,w=2)");
}

#[test]
fn bench_lstm_on_a_model_dir_and_one_policy() {
    let (_, v) = bench_rnn(
        "lstm",
        &[
            "--model-dir",
            fixture("lstm_small").to_str().unwrap(),
            "--policy",
            "padding",
            "--rate",
            "100",
            "--requests",
            "20",
        ],
    );
    let model = field(&v, "model");
    assert!(field(model, "source").as_str().unwrap().ends_with("lstm_small"), "{model}");
    assert_eq!(field(model, "vocab").as_u64(), Some(50));
    let results = field(&v, "results").as_array().unwrap();
    assert_eq!(results.len(), 1);
    assert!(field(&results[0], "policy").as_str().unwrap().starts_with("padding("));
    check_result_fields(&results[0]);
    assert!(field(&v, "comparisons").as_array().unwrap().is_empty());
}

#[test]
fn bench_step_writes_the_micro_benchmark_json() {
    let tmp = TempDir::new("step");
    let json = tmp.path().join("step.json");
    let o = serve(&[
        "bench",
        "step",
        "--hidden",
        "32",
        "--batch",
        "8",
        "--iters",
        "3",
        "--threads",
        "2",
        "--json",
        json.to_str().unwrap(),
    ]);
    check_ok(&o);
    let out = stdout(&o);
    assert!(out.contains("ratio step/GEMM") && out.contains("ratio folded step/step"), "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).expect("valid JSON");
    let results = field(&v, "results").as_array().unwrap();
    let names: Vec<&str> = results.iter().map(|r| field(r, "name").as_str().unwrap()).collect();
    assert_eq!(names, ["lstm_step", "gemm", "lstm_step_folded"]);
    assert!(field(&v, "folded_over_step").as_f64().is_some_and(|x| x.is_finite() && x > 0.0));
    for r in results {
        assert_eq!(field(r, "batch").as_u64(), Some(8), "{r}");
        assert_eq!(field(r, "hidden").as_u64(), Some(32), "{r}");
        for k in ["time_us", "gflops"] {
            assert!(field(r, k).as_f64().is_some_and(|x| x.is_finite() && x > 0.0), "`{k}` in {r}");
        }
    }
}

#[test]
fn bench_rnn_and_step_reject_bad_arguments() {
    let lstm_dir = fixture("lstm_small");
    let tree_dir = fixture("treelstm_small");
    let small = ["--hidden", "8", "--vocab", "16", "--rate", "10", "--requests", "1"];
    fn with(head: &[&str], tail: &[&str]) -> Vec<String> {
        head.iter().chain(tail).map(|s| s.to_string()).collect()
    }
    let cases: Vec<(Vec<String>, &str)> = vec![
        (with(&["bench", "lstm", "--max-batch", "0"], &small), "--max-batch"),
        (with(&["bench", "lstm", "--policy", "nope"], &small), "--policy"),
        (with(&["bench", "lstm", "--rate", "0"], &[]), "--rate"),
        (with(&["bench", "lstm", "--fractions", "1.5"], &[]), "--fractions"),
        (with(&["bench", "lstm", "--measure-peak", "false"], &["--hidden", "8", "--vocab", "16"]), "--rate"),
        (with(&["bench", "treelstm", "--layers", "2"], &small), "--layers"),
        (with(&["bench", "lstm", "--max-decode", "5"], &small), "--max-decode"),
        (with(&["bench", "seq2seq", "--eos-bias", "x"], &small), "--eos-bias"),
        (with(&["bench", "lstm", "--max-batch", "8,8"], &small), "cell type"),
        (with(&["bench", "seq2seq", "--policy", "padding", "--max-batch", "8,8"], &small), "single value"),
        (with(&["bench", "seq2seq", "--vocab", "3", "--hidden", "8", "--rate", "10"], &[]), "too small"),
        (
            with(&["bench", "lstm", "--model-dir", tree_dir.to_str().unwrap_or("")], &["--rate", "10"]),
            "treelstm",
        ),
        (
            with(&["bench", "lstm", "--model-dir", lstm_dir.to_str().unwrap_or(""), "--hidden", "8"], &[]),
            "--hidden",
        ),
        (
            with(&["bench", "lstm", "--model-dir", "/nonexistent/serve-model"], &["--rate", "10"]),
            "serve-model",
        ),
        (with(&["bench", "lstm", "--json", "/nonexistent/serve-dir/out.json"], &small), "out.json"),
        (with(&["bench", "lstm", "--capacity-window", "5000"], &small), "admission bound"),
        (with(&["bench", "step", "--hidden", "0"], &[]), "--hidden"),
        (with(&["bench", "step", "--model", "gru"], &[]), "--model"),
    ];
    let mut cases = cases;
    if serve::backend::cuda::probe().devices == 0 {
        // Without a device the CUDA backend is refused, naming it (with one, this step runs).
        cases.push((
            with(&["bench", "step", "--backend", "cuda", "--hidden", "8", "--batch", "2"], &[]),
            "cuda",
        ));
    }
    for (args, mention) in &cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = serve(&args);
        assert!(!o.status.success(), "{args:?} should fail");
        let err = stderr(&o);
        assert!(
            err.to_lowercase().contains(&mention.to_lowercase()),
            "{args:?}: `{err}` should mention `{mention}`"
        );
    }
}
