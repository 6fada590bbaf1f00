//! The layer-model fixtures (`ffi_examples/testdata/{resnet_small,resnet_bottleneck_small,bert_small}`,
//! made by `scripts/make_layer_fixtures.py` with PyTorch) and their comparison, for the CPU
//! (`tests/layer_models.rs`) and CUDA (`tests/gpu_e2e.rs`) tests.

use std::path::{Path, PathBuf};

use serde_json::Value;
use serve::{Input, ModelOptions, Output, PolicyConfig, Runtime, SubmitOptions, TimeoutConfig};

pub const FIXTURES: [&str; 3] = ["resnet_small", "resnet_bottleneck_small", "bert_small"];

pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata").join(name)
}

/// A fixture's requests and PyTorch's outputs.
pub fn requests(dir: &Path) -> Vec<(Input, Vec<f32>)> {
    let v: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let floats =
        |x: &Value| x.as_array().unwrap().iter().map(|f| f.as_f64().unwrap() as f32).collect::<Vec<_>>();
    v["requests"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let input = match (r.get("input"), r.get("tokens")) {
                (Some(x), None) => Input::F32(floats(x)),
                (None, Some(t)) => {
                    Input::Tokens(t.as_array().unwrap().iter().map(|i| i.as_u64().unwrap() as u32).collect())
                }
                _ => panic!("a request has an input or tokens"),
            };
            (input, floats(&r["output"]))
        })
        .collect()
}

/// `got` ≈ `want`: every element within `tol` of the row's scale (its largest magnitude), the
/// relative error of a vector (an element near 0 is compared at the row's scale, not its own).
/// Returns the worst relative error.
pub fn assert_close(got: &[f32], want: &[f32], tol: f32, what: &str) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let mut worst = 0.0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let err = (g - w).abs() / scale.max(f32::MIN_POSITIVE);
        assert!(
            err <= tol,
            "{what}: element {i}: libserve {g}, reference {w} (relative to the row's {scale})"
        );
        worst = worst.max(err);
    }
    worst
}

/// Serve every fixture on `rt` in batches of up to 4, alone, and padded to 8 (padding rows are
/// computed and dropped: a bert padding row has no tokens), each output within 1e-4 of PyTorch's
/// (relative to its scale); prints the worst relative error per fixture and batching.
pub fn serve_layer_fixtures(rt: &Runtime, label: &str) {
    for name in FIXTURES {
        let dir = fixture(name);
        let reqs = requests(&dir);
        for (max_batch, pad_to_max) in [(4, false), (1, false), (8, true)] {
            let opts = ModelOptions {
                policy: PolicyConfig::Timeout(TimeoutConfig {
                    max_batch,
                    max_wait: std::time::Duration::from_millis(2),
                    pad_to_max,
                    ..TimeoutConfig::default()
                }),
                ..ModelOptions::default()
            };
            let model = rt.load_model(&dir, opts).unwrap_or_else(|e| panic!("{name}: {e}"));
            let tickets: Vec<_> = reqs
                .iter()
                .map(|(x, _)| model.submit(x.clone(), SubmitOptions::default()).unwrap())
                .collect();
            let mut worst = 0.0f32;
            for (k, (t, (_, want))) in tickets.into_iter().zip(&reqs).enumerate() {
                let Output::F32(got) = t.wait().unwrap_or_else(|e| panic!("{name} request {k}: {e}")) else {
                    panic!("{name}: an f32 output")
                };
                let what = format!("{name} on {label} (batches of ≤ {max_batch}), request {k}");
                worst = worst.max(assert_close(&got, want, 1e-4, &what));
            }
            println!("{name} on {label}, batches of ≤ {max_batch}: worst relative error {worst:.2e}");
        }
    }
}
