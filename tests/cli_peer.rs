//! The PyTorch peer of `serve bench lstm|seq2seq|treelstm` (issue 19, ARCHITECTURE.md §8.3) end to
//! end. Without PyTorch: a python that does not import torch is one SKIPPED line and libserve's
//! policies run alone; a stand-in python (a shell script) shows what the bench hands the harness
//! (seq2seq, treelstm: the model directory, the exact requests) and how it checks the harness's
//! outputs and reports. With PyTorch (`torch_python`; skipped visibly without one): the harness
//! computes libserve's seq2seq and treelstm functions, and a tiny bench runs the real peer.

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
fn bench_peer_off_and_seq2seq_treelstm_without_torch() {
    let (out, v) = bench("lstm", "off", &["--peer", "off", "--python", "/nonexistent/python"]);
    assert!(!out.contains("PyTorch peer"), "{out}");
    assert_eq!(v["peer"]["status"], "off");
    check_libserve_ran(&v);
    for kind in ["seq2seq", "treelstm"] {
        let (out, v) = bench(kind, kind, &["--python", "/nonexistent/python"]);
        assert!(
            out.contains("# PyTorch peer: SKIPPED (cannot run /nonexistent/python"),
            "{kind} has a peer: {out}"
        );
        assert_eq!(v["peer"]["status"], "skipped");
        check_libserve_ran(&v);
    }
}

/// A temporary directory of this test process, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("serve-cli-peer-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stand-in for python (no torch needed): `-c "import torch, numpy"` succeeds; a harness run
/// copies what it was handed (arguments, scripts, model directory, requests) to `$FAKE_KEEP` and
/// writes `$FAKE_REPORT` as its report and `$FAKE_OUTPUTS` as its outputs.
const FAKE_PYTHON: &str = r#"#!/bin/sh
[ "$1" = "-c" ] && exit 0
script="$1"; shift
printf '%s\n' "$*" > "$FAKE_KEEP/args"
cp "$(dirname "$script")"/*.py "$FAKE_KEEP/"
while [ $# -gt 0 ]; do
  case "$1" in
    --json) report="$2"; shift ;;
    --outputs) outputs="$2"; shift ;;
    --model-dir) cp -r "$2" "$FAKE_KEEP/model"; echo "$2" > "$FAKE_KEEP/model_dir"; shift ;;
    --requests) cp "$2" "$FAKE_KEEP/requests.json"; shift ;;
  esac
  shift
done
cp "$FAKE_REPORT" "$report"
[ -n "$outputs" ] && cp "$FAKE_OUTPUTS" "$outputs"
exit 0
"#;

/// A harness report of a `kind` peer: one configuration, peak 400 rps, a row at 100 rps (25%).
fn fake_report(kind: &str) -> String {
    let policy = "torch-bucket(b=16,d=1ms,w=10)";
    serde_json::json!({
        "tool": "torch_lstm_server.py", "model": {"kind": kind},
        "peaks": [{"policy": policy, "peak_rps": 400.0, "window": 256}],
        "best": {"policy": policy, "peak_rps": 400.0},
        "results": [{"policy": policy, "offered_rps": 100.0, "throughput_rps": 99.0, "p50_ms": 20.0,
                     "p90_ms": 40.0, "p99_ms": 50.0, "mean_batch": 2.0, "completed": 20, "errors": 0}],
    })
    .to_string()
}

/// `serve bench KIND` against the fake python, with `outputs` as the peer's outputs; (stdout,
/// report, what the harness was handed).
fn bench_fake(kind: &str, outputs: &str, extra: &[&str]) -> (String, Value, Scratch) {
    bench_fake_report(kind, kind, outputs, extra)
}

/// [`bench_fake`] with the report of a `report_kind` peer.
fn bench_fake_report(
    kind: &str,
    report_kind: &str,
    outputs: &str,
    extra: &[&str],
) -> (String, Value, Scratch) {
    let s = Scratch::new(&format!("fake-{kind}"));
    let keep = s.0.join("keep");
    std::fs::create_dir(&keep).unwrap();
    let python = s.0.join("python");
    std::fs::write(&python, FAKE_PYTHON).unwrap();
    std::fs::set_permissions(&python, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    std::fs::write(s.0.join("report.json"), fake_report(report_kind)).unwrap();
    std::fs::write(s.0.join("outputs.json"), outputs).unwrap();
    let json = s.0.join("bench.json");
    let mut args =
        vec!["bench", kind, "--backend", "cpu", "--threads", "2", "--requests", "20", "--rate", "200"];
    args.extend(["--capacity-s", "0.2", "--policy", "cellular"]);
    args.extend(["--python", python.to_str().unwrap(), "--json", json.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let o = Command::new(SERVE)
        .args(&args)
        .env("FAKE_KEEP", &keep)
        .env("FAKE_REPORT", s.0.join("report.json"))
        .env("FAKE_OUTPUTS", s.0.join("outputs.json"))
        .output()
        .expect("run serve");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "serve failed: {}\n{out}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("the report")).expect("JSON");
    (out, v, s)
}

fn read(path: &std::path::Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn bench_seq2seq_hands_the_peer_its_model_its_requests_and_checks_the_outputs() {
    // Outputs no libserve decode can equal: 21 tokens, max_decode is 20.
    let (out, v, s) = bench_fake(
        "seq2seq",
        r#"{"tokens": [[0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0],
        [0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0], [0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0]]}"#,
        &["--hidden", "16", "--vocab", "64"],
    );
    let keep = s.0.join("keep");
    let args = read(&keep.join("args"));
    assert!(args.starts_with("--model seq2seq --model-dir "), "{args}");
    for want in ["--vocab 64 --embed 16 --hidden 16 --layers 1 --bos 1 --eos 2 --max-decode 20", "--outputs "]
    {
        assert!(args.contains(want), "`{args}` should contain `{want}`");
    }
    assert!(keep.join("torch_rnn_models.py").is_file() && keep.join("torch_lstm_server.py").is_file());
    // The requests are the bench's sources, in its order.
    let req: Value = serde_json::from_str(&read(&keep.join("requests.json"))).unwrap();
    let sources = req["sources"].as_array().expect("sources");
    assert_eq!(sources.len(), 4096);
    assert!(sources.iter().all(|s| !s.as_array().unwrap().is_empty()));
    // The model is the bench's: the random model with the printed eos bias added.
    let net = serve::model::load(&keep.join("model")).expect("a model directory");
    let serve::Network::Seq2Seq(saved) = net else { panic!("a seq2seq model") };
    let random = serve::model::Seq2Seq::random(64, 16, 16, 1, 1, 2, 20, 1);
    let bias: f32 = out
        .split("proj.bias[eos] += ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|b| b.parse().ok())
        .unwrap_or_else(|| panic!("the bench prints its eos bias: {out}"));
    assert!(bias > 0.0);
    assert!(
        (saved.proj_bias[2] - random.proj_bias[2] - bias).abs() < 1e-4,
        "{} vs {bias}",
        saved.proj_bias[2]
    );
    assert_eq!(saved.proj_weight, random.proj_weight);
    // The check compares with libserve's decodes and says how many differ.
    let check = out.lines().find(|l| l.starts_with("# PyTorch peer check: ")).expect("a check line");
    assert!(
        check.contains("first 3 distinct requests: 0 identical to libserve's, 3 differ (3 in length"),
        "{check}"
    );
    assert!(check.contains("torch 21.00 tokens"), "{check}");
    assert_eq!(v["peer"]["status"], "ran", "{v}");
    assert_eq!(v["peer"]["output_check"]["differ"], 3);
    assert!(out.contains("(goal: seq2seq and treelstm at least at parity (≥ 1.00x): "), "{out}");
    assert!(out.contains("# ratio cellular/torch at 100.0 rps (25% of torch's peak): p50 "), "{out}");
    assert!(v["peer"]["ratios"]["at_rates"][0]["p90_ratio"].is_number(), "{v}");
    // libserve also ran at the peer's rate.
    assert!(v["results"].as_array().unwrap().iter().any(|r| r["offered_rps"] == 100.0), "{v}");
}

#[test]
fn bench_treelstm_checks_the_peers_roots_and_model_dir_is_passed_as_it_is() {
    let s = Scratch::new("tree-model");
    let dir = s.0.join("tree");
    serve::Network::TreeLstm(serve::model::TreeLstm::random(50, 8, 16, 3)).save(&dir).unwrap();
    // h is in (-1, 1): 10 is off by far more than the tolerance.
    let (out, v, f) = bench_fake(
        "treelstm",
        &format!(r#"{{"h": [{:?}, {:?}]}}"#, [10.0; 16], [0.0; 16]),
        &["--model-dir", dir.to_str().unwrap()],
    );
    let keep = f.0.join("keep");
    assert_eq!(
        read(&keep.join("model_dir")).trim(),
        dir.to_str().unwrap(),
        "--model-dir itself is handed over"
    );
    let args = read(&keep.join("args"));
    assert!(args.contains("--vocab 50 --embed 8 --hidden 16 --threads 2"), "{args}");
    let req: Value = serde_json::from_str(&read(&keep.join("requests.json"))).unwrap();
    let trees = req["trees"].as_array().expect("trees");
    assert_eq!(trees.len(), 4096);
    let t0 = &trees[0];
    assert_eq!(t0["tokens"].as_array().unwrap().len(), t0["parents"].as_array().unwrap().len());
    assert!(
        t0["tokens"].as_array().unwrap().iter().any(|t| t == u32::MAX),
        "internal nodes carry NO_TOKEN: {t0}"
    );
    let check = out.lines().find(|l| l.starts_with("# PyTorch peer check: ")).expect("a check line");
    assert!(
        check.contains("roots' h of the first 2 distinct requests") && check.contains("NOT met"),
        "{check}"
    );
    assert!(check.contains("1 request(s) above") || check.contains("2 request(s) above"), "{check}");
    assert_eq!(v["peer"]["output_check"]["met"], false, "{v}");
}

#[test]
fn a_peer_whose_outputs_cannot_be_read_fails_visibly_and_the_bench_goes_on() {
    let (out, v, _s) = bench_fake("treelstm", r#"{"h": [[0.5]]}"#, &["--hidden", "16", "--vocab", "64"]);
    let line = out.lines().find(|l| l.starts_with("# PyTorch peer: FAILED (")).expect("a FAILED line");
    assert!(line.contains("outputs.json: h[0] has 1 values, libserve's output 16"), "{line}");
    assert_eq!(v["peer"]["status"], "failed", "{v}");
    assert_eq!(v["results"].as_array().unwrap().len(), 1, "libserve's cellular ran alone: {v}");
    // A report of another kind's peer is refused too.
    let (out, v, _s) =
        bench_fake_report("seq2seq", "lstm", r#"{"tokens": []}"#, &["--hidden", "16", "--vocab", "64"]);
    let line = out.lines().find(|l| l.starts_with("# PyTorch peer: FAILED (")).expect("a FAILED line");
    assert!(line.contains(r#"the report is of a "lstm" model, not of `bench seq2seq`'s seq2seq"#), "{line}");
    assert_eq!(v["peer"]["status"], "failed", "{v}");
}

// ------------------------------------------------------------------------------------------------
// With PyTorch: SERVE_TORCH_PYTHON, else the venv of scripts/make_layer_fixtures.py, else python3.
// Without one that imports torch and numpy these print `skipped: …` and pass, unless
// SERVE_REQUIRE_TORCH=1.
// ------------------------------------------------------------------------------------------------

/// One torch test at a time (each uses every core).
static TORCH: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A python with torch and numpy, or None after printing why the test is skipped.
fn torch_python() -> Option<PathBuf> {
    let venv =
        std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/libserve/torch-venv/bin/python"));
    let python = std::env::var_os("SERVE_TORCH_PYTHON")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or(venv.filter(|p| p.is_file()))
        .unwrap_or_else(|| PathBuf::from("python3"));
    let ok =
        Command::new(&python).args(["-c", "import torch, numpy"]).output().is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    let why = format!("{} does not import torch and numpy (set SERVE_TORCH_PYTHON)", python.display());
    assert!(std::env::var_os("SERVE_REQUIRE_TORCH").is_none_or(|v| v != "1"), "SERVE_REQUIRE_TORCH=1: {why}");
    println!("skipped: {why}");
    None
}

/// Run the harness in the repository with `args` (split at whitespace); its stdout.
fn harness(python: &std::path::Path, args: &str) -> String {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/torch_lstm_server.py");
    let o = Command::new(python).arg(script).args(args.split_whitespace()).output().expect("run the harness");
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(
        o.status.success(),
        "harness failed: {}\n{out}\n{}",
        o.status,
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn the_torch_peer_computes_libserves_seq2seq_and_treelstm() {
    let _one = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(python) = torch_python() else { return };
    use serve::model::{NO_TOKEN, Seq2Seq, TreeLstm};
    use serve::workload::treebank_trees;
    let s = Scratch::new("torch-check");
    let p = |f: &str| s.0.join(f).to_str().unwrap().to_string();
    let mut rng = <rand::rngs::StdRng as rand::SeedableRng>::seed_from_u64(5);
    let tok = |rng: &mut rand::rngs::StdRng, lo: u32, hi: u32| rand::Rng::random_range(rng, lo..hi);

    // seq2seq, 2 layers. Random weights decode almost every source alike; scaled up, they decode
    // them into different sequences, and an eos bias makes rows end at different steps.
    let sources: Vec<Vec<u32>> =
        (0..32).map(|i| (0..1 + (i * 7) % 15).map(|_| tok(&mut rng, 3, 100)).collect()).collect();
    let mut base = Seq2Seq::random(100, 16, 32, 2, 1, 2, 12, 9);
    for l in base.encoder.layers.iter_mut().chain(&mut base.decoder.layers) {
        l.w_ih.iter_mut().chain(&mut l.w_hh).for_each(|w| *w *= 4.0);
    }
    base.proj_weight.iter_mut().chain(&mut base.dec_embedding).for_each(|w| *w *= 4.0);
    let (m, want) = (0..400)
        .map(|k| {
            let mut m = base.clone();
            m.proj_bias[2] += 0.04 * k as f32;
            let want: Vec<Vec<u32>> = sources.iter().map(|x| m.decode_reference(x)).collect();
            (m, want)
        })
        .find(|(_, want)| {
            let lengths: std::collections::BTreeSet<usize> = want.iter().map(Vec::len).collect();
            let distinct: std::collections::BTreeSet<&Vec<u32>> = want.iter().collect();
            lengths.len() >= 5 && distinct.len() >= 20
        })
        .expect("an eos bias for different decodes of several lengths (rows end while others go on)");
    serve::Network::Seq2Seq(m).save(&s.0.join("s2s")).unwrap();
    std::fs::write(s.0.join("s2s.json"), serde_json::json!({ "sources": sources }).to_string()).unwrap();
    for (mode, step) in [("pack", "cell"), ("bucket", "lstm")] {
        let args = format!(
            "--model seq2seq --model-dir {} --requests {} --vocab 100 --embed 16 --hidden 32 --layers 2 --bos 1 \
             --eos 2 --max-decode 12 --modes {mode} --decoder-step {step} --outputs {} --check-requests 32 \
             --check-only",
            p("s2s"),
            p("s2s.json"),
            p("s2s-out.json")
        );
        let out = harness(&python, &args);
        assert!(out.contains("outputs of the first 32 distinct requests"), "{out}");
        let got: Value = serde_json::from_str(&read(&s.0.join("s2s-out.json"))).unwrap();
        let got: Vec<Vec<u32>> = serde_json::from_value(got["tokens"].clone()).unwrap();
        assert_eq!(
            got, want,
            "mode {mode}, step {step}: the peer's greedy decodes are libserve's reference decodes"
        );
    }

    // treelstm on TreeBank-like trees; leaves and some internal nodes carry tokens.
    let m = TreeLstm::random(30, 8, 12, 4);
    let trees: Vec<(Vec<u32>, Vec<i32>)> = treebank_trees(20, 6)
        .into_iter()
        .map(|parents| {
            let tokens = (0..parents.len())
                .map(|v| {
                    let leaf = !parents.contains(&(v as i32));
                    if leaf || v % 3 == 0 { tok(&mut rng, 0, 30) } else { NO_TOKEN }
                })
                .collect();
            (tokens, parents)
        })
        .collect();
    let want: Vec<Vec<f32>> = trees.iter().map(|(t, p)| m.forward_reference(t, p)).collect();
    serve::Network::TreeLstm(m).save(&s.0.join("tree")).unwrap();
    let json_trees: Vec<Value> =
        trees.iter().map(|(t, p)| serde_json::json!({"tokens": t, "parents": p})).collect();
    std::fs::write(s.0.join("trees.json"), serde_json::json!({ "trees": json_trees }).to_string()).unwrap();
    for mode in ["fifo", "bucket"] {
        let args = format!(
            "--model treelstm --model-dir {} --requests {} --vocab 30 --embed 8 --hidden 12 --modes {mode} \
             --outputs {} --check-requests 20 --check-only",
            p("tree"),
            p("trees.json"),
            p("tree-out.json")
        );
        harness(&python, &args);
        let got: Value = serde_json::from_str(&read(&s.0.join("tree-out.json"))).unwrap();
        let got: Vec<Vec<f32>> = serde_json::from_value(got["h"].clone()).unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), 12);
            let d = g.iter().zip(w).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
            assert!(d <= 1e-4, "mode {mode}: tree {i}: the peer's root h is {d} off libserve's reference");
        }
    }
}

#[test]
fn bench_seq2seq_and_treelstm_with_the_torch_peer() {
    let _one = TORCH.lock().unwrap_or_else(|e| e.into_inner());
    let Some(python) = torch_python() else { return };
    let peer_args =
        "--modes bucket --max-batch 8 --max-delay-ms 1 --no-screen --capacity-s 1 --check-requests 64";
    for kind in ["seq2seq", "treelstm"] {
        let (out, v) = bench(
            kind,
            &format!("torch-{kind}"),
            &[
                "--python",
                python.to_str().unwrap(),
                "--capacity-s",
                "0.3",
                "--policy",
                "cellular",
                "--peer-args",
                peer_args,
            ],
        );
        assert_eq!(v["peer"]["status"], "ran", "{kind}: {out}");
        let check = &v["peer"]["output_check"];
        assert_eq!(check["requests"], 64, "{kind}: {check}");
        if kind == "seq2seq" {
            // Same decodes, up to an argmax near-tie in floating point on a request or two.
            assert!(check["differ"].as_u64().unwrap() <= 2, "{check}");
            let (ours, theirs) = (
                check["libserve_mean_decode_tokens"].as_f64().unwrap(),
                check["torch_mean_decode_tokens"].as_f64().unwrap(),
            );
            assert!(ours > 1.0 && (ours - theirs).abs() < 0.5, "{check}");
        } else {
            assert_eq!(check["met"], true, "{check}");
        }
        assert!(out.contains("(goal: seq2seq and treelstm at least at parity (≥ 1.00x): "), "{out}");
        let at = v["peer"]["ratios"]["at_rates"].as_array().expect("at_rates");
        assert_eq!(at.len(), 3, "p50/p90 at 25/50/75% of torch's peak: {v}");
    }
}
