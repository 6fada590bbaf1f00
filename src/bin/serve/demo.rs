//! `serve` / `serve demo`: the main job on the CPU default: a small mlp is written, loaded, queried
//! with `infer`, then benchmarked briefly; then a short LSTM run of cellular batching against the
//! padding baseline.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use serve::model::Mlp;
use serve::{ModelOptions, PolicyConfig};

use crate::bench::{BenchPlan, random_inputs, run_bench, sizes_label};
use crate::infer::{DEFAULT_MAX_LINE_BYTES, infer_stream, open_input};
use crate::{BackendArg, CliResult, RuntimeArgs, build_runtime, fatal, timeout_policy};

const DEMO_SIZES: [usize; 4] = [64, 256, 256, 10];

/// Removes a directory when dropped.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub(crate) fn cmd_demo() -> CliResult<()> {
    let t0 = Instant::now();
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let dir = TempDir(std::env::temp_dir().join(format!("serve-demo-{}-{nanos}", std::process::id())));
    let model_dir = dir.0.join("demo-mlp");
    println!("== libserve {} demo: the main job on the CPU default ==", serve::VERSION);

    let mlp = Mlp::random(&DEMO_SIZES, 42);
    mlp.save(&model_dir)?;
    println!("-- wrote a random mlp (sizes {}) to {}", sizes_label(&DEMO_SIZES), model_dir.display());

    let rt_args = RuntimeArgs { backend: BackendArg::Auto, threads: 0 };
    let rt = build_runtime(rt_args)?;
    let backend = (rt.backend_kind(), rt.backend_description());
    println!("-- backend: {}", backend.1);
    let cfg = timeout_policy(32, 0, 1);
    let model = rt
        .load_model(
            &model_dir,
            ModelOptions { policy: PolicyConfig::Timeout(cfg), ..ModelOptions::default() },
        )
        .map_err(|e| fatal(format!("cannot load the demo model: {e}")))?;

    // A few requests: good ones, then two the server must reject precisely.
    let mut rng = StdRng::seed_from_u64(7);
    let good: Vec<Vec<f32>> = (0..4)
        .map(|_| {
            (0..DEMO_SIZES[0]).map(|_| (rng.random_range(-1.0f32..1.0) * 100.0).round() / 100.0).collect()
        })
        .collect();
    let mut lines: Vec<String> = good.iter().map(|v| json!({ "input": v }).to_string()).collect();
    lines.push(json!({"input": [1.0, 2.0, 3.0]}).to_string());
    lines.push("{\"input\": [1, 2,".to_string());
    let requests = dir.0.join("requests.jsonl");
    std::fs::write(&requests, lines.join("\n") + "\n")
        .map_err(|e| fatal(format!("cannot write {}: {e}", requests.display())))?;
    println!("-- serve infer {} --input {}", model_dir.display(), requests.display());
    let mut captured = Vec::new();
    let summary = infer_stream(&model, open_input(&requests)?, DEFAULT_MAX_LINE_BYTES, &mut captured)?;
    let text = String::from_utf8_lossy(&captured);
    print!("{text}");
    let mut worst = 0.0f64;
    for (line, x) in text.lines().zip(&good) {
        let got: Vec<f64> = serde_json::from_str::<Value>(line)
            .ok()
            .and_then(|v| v.get("output").and_then(Value::as_array).cloned())
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        let want = mlp.forward_reference(x);
        if got.len() != want.len() {
            return Err(fatal(format!("demo: unexpected result line `{line}`")));
        }
        for (g, w) in got.iter().zip(&want) {
            worst = worst.max((g - *w as f64).abs() / (*w as f64).abs().max(1e-3));
        }
    }
    println!(
        "-- {} request(s), {} rejected as expected; outputs match the f64 reference (max rel. error {worst:.1e})",
        summary.lines, summary.errors
    );
    drop(model);
    drop(rt);

    println!("-- serve bench mlp --model {} (short run: 0.5 s per rate)", model_dir.display());
    let net = serve::model::load(&model_dir)?;
    let plan = BenchPlan {
        backend,
        net: Arc::new(net),
        name: "demo-mlp".into(),
        model_json: json!({"kind": "mlp", "sizes": DEMO_SIZES, "source": "demo"}),
        rt: rt_args,
        batched: cfg,
        rates: None,
        fractions: vec![0.25, 0.75],
        requests: None,
        duration_s: 0.5,
        capacity_time: Duration::from_millis(500),
        seed: 1,
        qos: Some(Duration::from_millis(5)),
        compare: true,
        json: None,
        svg: None,
        inputs: random_inputs(DEMO_SIZES[0], 1),
    };
    run_bench(&plan)?;

    // The heart of libserve: cellular batching (BatchMaker) against graph batching with padding.
    let lstm = [
        "bench",
        "lstm",
        "--hidden",
        "128",
        "--capacity-window",
        "256",
        "--capacity-s",
        "1",
        "--fractions",
        "0.5",
        "--duration-s",
        "1",
        "--peer",
        "off",
    ];
    println!("-- serve {} (cellular batching vs the padding baseline, short run)", lstm.join(" "));
    crate::run_args(&lstm)?;
    println!("== demo done in {:.1} s ==", t0.elapsed().as_secs_f64());
    Ok(())
}
