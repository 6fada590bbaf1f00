//! Unit tests of the PyTorch peer's plan, report and output check.

use serve::model::{Lstm, NO_TOKEN, Seq2Seq, TreeLstm};

use super::*;
use crate::bench_peer_check::{TokenCheck, compare_outputs};

/// A harness report cut down to two configurations and two rates (one given, one a fraction).
const FIXTURE: &str = r#"{
  "tool": "torch_lstm_server.py", "workload": "poisson/wmt", "backend": "torch-cpu",
  "peaks": [
    {"policy": "torch-bucket(b=256,d=10ms,w=10)", "peak_rps": 1000.0, "window": 2048, "mean_batch": 200.0},
    {"policy": "torch-pack(b=256,d=2ms)", "peak_rps": 1100.0, "window": 2048, "mean_batch": 250.0}
  ],
  "best": {"policy": "torch-bucket(b=256,d=10ms,w=10)", "peak_rps": 1000.0, "best_peak_rps": 1100.0,
           "rule": "lowest p90", "screen_rps": 550, "peak_tolerance": 0.1},
  "results": [
    {"policy": "torch-bucket(b=256,d=10ms,w=10)", "offered_rps": 250.0, "throughput_rps": 249.0,
     "p50_ms": 12.5, "p90_ms": 20.0, "p99_ms": 31.0, "mean_batch": 3.5, "completed": 500, "errors": 0,
     "error_codes": {}, "peak_rps": 1000.0, "fraction_of_peak": 0.25, "fraction_of_best_peak": 0.25},
    {"policy": "torch-pack(b=256,d=2ms)", "offered_rps": 250.0, "throughput_rps": 248.0,
     "p50_ms": 3.0, "p90_ms": 5.0, "p99_ms": 8.0, "mean_batch": 1.2, "completed": 500, "errors": 0,
     "error_codes": {}},
    {"policy": "torch-bucket(b=256,d=10ms,w=10)", "offered_rps": 300.0, "throughput_rps": 120.0,
     "p50_ms": null, "p90_ms": null, "p99_ms": null, "mean_batch": 0.0, "completed": 0, "errors": 600,
     "error_codes": {"CANCELLED": 600}}
  ]
}"#;

#[test]
fn a_harness_report_parses_into_rows() {
    let p = parse_report(FIXTURE, RnnKind::Lstm, &[300.0]).unwrap();
    assert_eq!(p.best, ("torch-bucket(b=256,d=10ms,w=10)".to_string(), 1000.0));
    assert_eq!(p.highest, ("torch-pack(b=256,d=2ms)".to_string(), 1100.0));
    assert_eq!(p.rows.len(), 3);
    let r = &p.rows[0];
    assert_eq!(
        (r.offered_rps, r.throughput_rps, r.p50_ms, r.p90_ms, r.p99_ms),
        (250.0, 249.0, 12.5, 20.0, 31.0)
    );
    assert_eq!((r.mean_batch, r.completed, r.errors), (3.5, 500, 0));
    assert_eq!(r.extra["fraction_of_best_peak"], json!(0.25));
    let cancelled = &p.rows[2];
    assert!(cancelled.p50_ms.is_nan() && cancelled.p99_ms.is_nan(), "no percentiles = NaN");
    assert_eq!(cancelled.error_codes.get("CANCELLED"), Some(&600));
    // 300 rps was given (libserve's --rate), 250 is 25% of the chosen configuration's peak.
    assert_eq!(p.fraction_rates(), vec![(250.0, 0.25)]);
    // A given rate that is also a fraction of the peak is one.
    let both = parse_report(FIXTURE, RnnKind::Lstm, &[250.0, 300.0]).unwrap();
    assert_eq!(both.fraction_rates(), vec![(250.0, 0.25)]);
    // Rates not given are fractions (--peer-args may pass its own --fractions).
    let none_given = parse_report(FIXTURE, RnnKind::Lstm, &[]).unwrap();
    assert_eq!(none_given.fraction_rates(), vec![(250.0, 0.25), (300.0, 0.3)]);
}

#[test]
fn a_bad_report_is_an_error_not_a_panic() {
    for (text, want) in [
        ("{", "malformed JSON"),
        ("[]", "best"),
        (r#"{"best": {"policy": "x", "peak_rps": 1}, "results": []}"#, "peaks"),
        (
            r#"{"best": {"policy": "x", "peak_rps": 1}, "peaks": [], "results": [{"policy": 3}]}"#,
            "results[0]",
        ),
        (
            r#"{"best": {"policy": "x", "peak_rps": 1}, "peaks": [],
                "results": [{"policy": "x", "offered_rps": 1, "throughput_rps": "fast"}]}"#,
            "throughput_rps",
        ),
    ] {
        let e = parse_report(text, RnnKind::Lstm, &[]).unwrap_err();
        assert!(e.contains(want), "`{text}`: `{e}` should mention `{want}`");
    }
}

fn row(policy: &str, rps: f64, p50: f64, p90: f64) -> RunResult {
    let mut r = parse_row(&json!({"policy": policy, "offered_rps": rps, "throughput_rps": rps})).unwrap();
    (r.p50_ms, r.p90_ms, r.p99_ms) = (p50, p90, p90);
    r
}

#[test]
fn ratios_are_against_the_highest_peak_and_the_chosen_configuration() {
    let peer = Peer::Ran(Box::new(parse_report(FIXTURE, RnnKind::Lstm, &[300.0]).unwrap()));
    assert_eq!(peer.offered_rates(), vec![(250.0, 0.25)]);
    assert_eq!(peer.rows_at(250.2).count(), 2);
    let ours =
        [row("cellular(b=512,k=5)", 250.0, 5.0, 9.0), row("padding(b=64,bucket=10,k=5)", 250.0, 9.0, 30.0)];
    let v =
        peer.summarize(Some(("cellular(b=512,k=5)", Some(1650.0))), Some(("padding", Some(990.0))), &ours);
    assert_eq!(v["cellular_peak"]["ratio"], json!(1.5));
    assert_eq!(v["cellular_peak"]["met"], json!(true));
    assert_eq!(v["padding_peak"]["ratio"], json!(0.9));
    assert_eq!(v["padding_peak"]["met"], json!(false));
    let at = &v["at_rates"][0];
    assert_eq!((at["p50_ratio"].clone(), at["p90_ratio"].clone()), (json!(0.4), json!(0.45)));
    assert_eq!(at["baseline"], json!("torch-bucket(b=256,d=10ms,w=10)"));
    assert_eq!(at["met"], json!(true));
    let report = peer.to_json(v);
    assert_eq!(report["status"], json!("ran"));
    assert_eq!(report["tool"], json!("torch_lstm_server.py"));
    assert!(report["ratios"]["at_rates"].is_array());
    let skipped = Peer::NotRun { status: "skipped", reason: "no torch".into() };
    assert!(skipped.offered_rates().is_empty() && skipped.summarize(None, None, &[]).is_null());
    assert_eq!(skipped.to_json(Value::Null), json!({"status": "skipped", "reason": "no torch"}));
}

/// A plan for `kind` over `net` and `inputs` (libserve's outputs: `outputs`).
fn plan<'a>(
    kind: RnnKind,
    net: &'a Network,
    inputs: &'a [Input],
    outputs: LibserveOutputs<'a>,
) -> PeerPlan<'a> {
    PeerPlan {
        kind,
        backend: BackendKind::Cpu,
        net,
        model_dir: None,
        inputs,
        outputs,
        sizes: Sizes {
            vocab: 64,
            embed: 16,
            hidden: 16,
            layers: if kind == RnnKind::TreeLstm { 0 } else { 2 },
        },
        threads: 2,
        seed: 7,
        window: 256,
        capacity_s: 1.5,
        duration_s: 2.0,
        requests: Some(40),
        rates: &[100.0, 250.5],
    }
}

fn no_outputs(_: usize) -> Result<Vec<Output>, String> {
    Err("not asked for".into())
}

fn files(kind: RnnKind) -> HarnessFiles {
    let lstm = kind == RnnKind::Lstm;
    HarnessFiles {
        requests: PathBuf::from(if lstm { "/t/l.json" } else { "/t/r.json" }),
        model_dir: (!lstm).then(|| PathBuf::from("/t/m")),
        outputs: (!lstm).then(|| PathBuf::from("/t/o.json")),
        report: PathBuf::from("/t/p.json"),
    }
}

#[test]
fn the_harness_gets_libserves_workload_then_the_users_arguments() {
    let net = Network::Lstm(Lstm::random(64, 16, 16, 2, 1));
    let inputs = [Input::Tokens(vec![1, 2, 3]), Input::Tokens(vec![4; 5])];
    let p = plan(RnnKind::Lstm, &net, &inputs, &no_outputs);
    let line = harness_args(&p, &files(RnnKind::Lstm), Some(" --screen-s 1  ")).join(" ");
    for want in [
        "--lengths /t/l.json --vocab 64 --embed 16 --hidden 16 --layers 2 --threads 2 --window 256",
        "--seed 7 --fractions 0.25,0.5,0.75 --capacity-s 1.5 --min-requests 40 --duration-s 0",
        "--rates 100,250.5 --json /t/p.json --screen-s 1",
    ] {
        assert!(line.contains(want), "`{line}` should contain `{want}`");
    }
    assert!(line.ends_with("--screen-s 1"), "--peer-args come last: {line}");
    assert!(!line.contains("--model") && !line.contains("--outputs"), "lstm as before: {line}");
    assert_eq!(requests_json(RnnKind::Lstm, &inputs).unwrap(), "[3,5]");
}

#[test]
fn seq2seq_and_treelstm_peers_get_the_model_the_requests_and_the_check() {
    let s2s = Network::Seq2Seq(Seq2Seq::random(64, 16, 16, 2, 1, 2, 7, 1));
    let sources = [Input::Tokens(vec![3, 4, 5]), Input::Tokens(vec![9])];
    let p = plan(RnnKind::Seq2Seq, &s2s, &sources, &no_outputs);
    let line = harness_args(&p, &files(RnnKind::Seq2Seq), Some("--modes bucket")).join(" ");
    for want in [
        "--model seq2seq --model-dir /t/m --requests /t/r.json --vocab 64 --embed 16 --hidden 16 --layers 2 \
         --bos 1 --eos 2 --max-decode 7 --threads 2 --window 256 --seed 7",
        "--rates 100,250.5 --outputs /t/o.json --check-requests 2 --json /t/p.json --modes bucket",
    ] {
        assert!(line.contains(want), "`{line}` should contain `{want}`");
    }
    assert!(!line.contains("--lengths"), "{line}");
    assert_eq!(requests_json(RnnKind::Seq2Seq, &sources).unwrap(), r#"{"sources":[[3,4,5],[9]]}"#);

    let tree = Network::TreeLstm(TreeLstm::random(64, 16, 16, 1));
    let trees = [Input::Tree { tokens: vec![NO_TOKEN, 5, 6], parents: vec![-1, 0, 0] }];
    let p = plan(RnnKind::TreeLstm, &tree, &trees, &no_outputs);
    let line = harness_args(&p, &files(RnnKind::TreeLstm), None).join(" ");
    let want = "--model treelstm --model-dir /t/m --requests /t/r.json --vocab 64 --embed 16 --hidden 16 \
                --threads 2";
    assert!(line.contains(want), "`{line}` should contain `{want}`");
    assert!(!line.contains("--layers") && !line.contains("--bos"), "{line}");
    assert!(line.contains("--outputs /t/o.json --check-requests 1 --json /t/p.json"), "{line}");
    assert_eq!(
        requests_json(RnnKind::TreeLstm, &trees).unwrap(),
        r#"{"trees":[{"parents":[-1,0,0],"tokens":[4294967295,5,6]}]}"#
    );
    let e = requests_json(RnnKind::TreeLstm, &sources).unwrap_err();
    assert!(e.contains("request 0 is not a tree"), "{e}");
}

#[test]
fn the_peers_outputs_are_compared_request_by_request() {
    let ours = [Output::Tokens(vec![5, 2]), Output::Tokens(vec![7, 7, 7]), Output::Tokens(vec![2])];
    let same = json!({"tokens": [[5, 2], [7, 7, 7], [2]]});
    let c = compare_outputs(RnnKind::Seq2Seq, &same, &ours).unwrap();
    assert_eq!(
        c,
        OutputCheck::Tokens(TokenCheck {
            requests: 3,
            differ: 0,
            length_differ: 0,
            first_differ: None,
            libserve_mean: 2.0,
            torch_mean: 2.0
        })
    );
    let other = json!({"tokens": [[5, 2], [7, 7, 8], [2, 2]]});
    let c = compare_outputs(RnnKind::Seq2Seq, &other, &ours).unwrap();
    let OutputCheck::Tokens(TokenCheck { differ, length_differ, first_differ, torch_mean, .. }) = c.clone()
    else {
        panic!("{c:?}")
    };
    assert_eq!((differ, length_differ, first_differ), (2, 1, Some(1)));
    assert!((torch_mean - 7.0 / 3.0).abs() < 1e-12);
    assert!(
        c.line().contains("1 identical to libserve's, 2 differ (1 in length; first: request 1)"),
        "{}",
        c.line()
    );

    let h = [Output::F32(vec![0.5, -0.25]), Output::F32(vec![0.0, 1.0])];
    let close = json!({"h": [[0.50001, -0.25], [0.0, 1.0]]});
    let c = compare_outputs(RnnKind::TreeLstm, &close, &h).unwrap();
    let OutputCheck::H { max_abs_diff, over_tolerance, .. } = c else { panic!("{c:?}") };
    assert!((max_abs_diff - 1e-5).abs() < 1e-9 && over_tolerance == 0, "{c:?}");
    let far = json!({"h": [[0.5, -0.25], [0.0, 1.001]]});
    let c = compare_outputs(RnnKind::TreeLstm, &far, &h).unwrap();
    assert!(matches!(c, OutputCheck::H { over_tolerance: 1, .. }), "{c:?}");
    assert!(c.line().contains("NOT met"), "{}", c.line());
    assert_eq!(c.to_json()["met"], json!(false));
    // A NaN (libserve's side: JSON has none) stays the maximum whatever comes after it.
    let nan_first = [Output::F32(vec![f32::NAN, -0.25]), Output::F32(vec![0.0, 1.0])];
    let c = compare_outputs(RnnKind::TreeLstm, &far, &nan_first).unwrap();
    assert!(
        matches!(c, OutputCheck::H { over_tolerance: 2, max_abs_diff, .. } if max_abs_diff.is_nan()),
        "{c:?}"
    );

    for (kind, v, want) in [
        (RnnKind::Seq2Seq, json!({"h": []}), "no `tokens` list"),
        (RnnKind::Seq2Seq, json!({"tokens": [[5, 2]]}), "1 outputs from the peer, 3 from libserve"),
        (RnnKind::Seq2Seq, json!({"tokens": [[5, 2], [7, "x"], [2]]}), "tokens[1][1] is not a number"),
        (RnnKind::Seq2Seq, json!({"tokens": [[5, 2], [7, -1], [2]]}), "tokens[1][1] is not a token"),
        (RnnKind::TreeLstm, json!({"h": [[0.5], [0.0, 1.0]]}), "h[0] has 1 values"),
        (RnnKind::TreeLstm, json!({"h": [[0.5, 1.0], 3]}), "h[1] is not a list"),
    ] {
        let ours: &[Output] = if kind == RnnKind::Seq2Seq { &ours } else { &h };
        let e = compare_outputs(kind, &v, ours).unwrap_err();
        assert!(e.contains(want), "`{v}`: `{e}` should mention `{want}`");
    }
}

#[test]
fn seq2seq_and_treelstm_goals_are_parity_lstms_unchanged() {
    let with_kind = |kind: &str| {
        FIXTURE.replacen(
            r#""backend": "torch-cpu","#,
            &format!(r#""backend": "torch-cpu", "model": {{"kind": "{kind}"}},"#),
            1,
        )
    };
    let e = parse_report(&with_kind("lstm"), RnnKind::Seq2Seq, &[]).unwrap_err();
    assert!(e.contains("of a \"lstm\" model"), "{e}");
    let ours = [row("cellular(b=512,k=5)", 250.0, 10.0, 19.0)];
    for (kind, cellular_goal, latency_goal, met) in [
        (RnnKind::Lstm, 1.3, 0.5, false),
        (RnnKind::Seq2Seq, 1.0, 1.0, true),
        (RnnKind::TreeLstm, 1.0, 1.0, true),
    ] {
        let peer = Peer::Ran(Box::new(parse_report(&with_kind(kind.name()), kind, &[300.0]).unwrap()));
        let v = peer.summarize(Some(("cellular(b=512,k=5)", Some(1210.0))), None, &ours);
        assert_eq!(v["cellular_peak"]["goal"], json!(cellular_goal), "{kind:?}");
        assert_eq!(v["cellular_peak"]["met"], json!(met), "1.1x is parity, not 1.3x: {kind:?}");
        assert_eq!(v["at_rates"][0]["goal"], json!(latency_goal), "{kind:?}");
        // p50 0.8x, p90 0.95x of torch's: at parity, not at half.
        assert_eq!(v["at_rates"][0]["met"], json!(met), "{kind:?}");
    }
    assert_eq!(Goals::of(RnnKind::Lstm).peak_text(1.3), "goal ≥ 1.30x");
    assert_eq!(
        Goals::of(RnnKind::TreeLstm).peak_text(1.0),
        "goal: seq2seq and treelstm at least at parity (≥ 1.00x)"
    );
}

#[test]
fn long_lines_come_in_pieces() {
    let text = format!("a\r\n{}\nb", "x".repeat(MAX_LINE_BYTES as usize + 3));
    let mut lines = Vec::new();
    for_each_line(text.as_bytes(), |l| lines.push(l.len()));
    assert_eq!(lines, [1, MAX_LINE_BYTES as usize, 3, 1]);
}
