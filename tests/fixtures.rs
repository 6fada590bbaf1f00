//! Committed model fixtures used by the non-Rust consumers (Go, C++): a small mlp directory and
//! its expected outputs. `SERVE_UPDATE_FIXTURES=1 cargo test --test fixtures` regenerates them;
//! otherwise this checks that libserve still loads them and computes the stored outputs.

use std::path::{Path, PathBuf};

use serve::model::{Mlp, Network};
use serve::{BackendChoice, Input, ModelOptions, Output, Runtime, SubmitOptions};

const SIZES: [usize; 3] = [4, 8, 3];
const SEED: u64 = 2024;
const INPUTS: usize = 4;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata/mlp_4_8_3")
}

fn inputs() -> Vec<Vec<f32>> {
    (0..INPUTS).map(|k| (0..SIZES[0]).map(|i| (i as f32 - 1.5) * 0.5 + k as f32 * 0.25).collect()).collect()
}

/// `expected.json`: `{"inputs": [[…]…], "outputs": [[…]…]}`.
fn expected_json(mlp: &Mlp) -> String {
    let inputs = inputs();
    let outputs: Vec<Vec<f32>> = inputs.iter().map(|x| mlp.forward_reference(x)).collect();
    serde_json::to_string_pretty(&serde_json::json!({ "inputs": inputs, "outputs": outputs })).unwrap() + "\n"
}

#[test]
fn mlp_fixture_is_current_and_served_correctly() {
    let dir = dir();
    if std::env::var_os("SERVE_UPDATE_FIXTURES").is_some() {
        let mlp = Mlp::random(&SIZES, SEED);
        mlp.save(&dir).unwrap();
        std::fs::write(dir.join("expected.json"), expected_json(&mlp)).unwrap();
    }
    let Network::Mlp(mlp) = serve::model::load(&dir).unwrap() else { panic!("the fixture is an mlp") };
    assert_eq!(mlp, Mlp::random(&SIZES, SEED), "fixture weights differ from the generator");
    let stored = std::fs::read_to_string(dir.join("expected.json")).unwrap();
    assert_eq!(stored, expected_json(&mlp), "expected.json is stale: SERVE_UPDATE_FIXTURES=1");

    let rt = Runtime::builder().backend(BackendChoice::Cpu).build().unwrap();
    let model = rt.load_model(&dir, ModelOptions::default()).unwrap();
    for x in inputs() {
        let Output::F32(y) =
            model.submit(Input::F32(x.clone()), SubmitOptions::default()).unwrap().wait().unwrap()
        else {
            panic!("f32 output expected")
        };
        for (a, b) in y.iter().zip(mlp.forward_reference(&x)) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
