//! The layer-model fixtures (`ffi_examples/testdata/{resnet_small,resnet_bottleneck_small,bert_small}`,
//! made by `scripts/make_layer_fixtures.py` with PyTorch) and their comparison, for the CPU
//! (`tests/layer_models.rs`) and CUDA (`tests/gpu_e2e.rs`) tests.

use std::path::{Path, PathBuf};

use serde_json::Value;
use serve::Input;

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
