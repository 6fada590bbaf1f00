//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng;
use serve::model::Mlp;
use serve::{Code, CompletionQueue, Input, Model, Runtime, SubmitOptions};

pub mod gpu;
pub mod native;
pub mod recurrent;

/// A fresh, unique directory under the system temp dir.
pub fn tempdir(label: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "serve-test-{label}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Write a random mlp with the given widths and return (dir, model).
pub fn mlp_dir(label: &str, sizes: &[usize], seed: u64) -> (PathBuf, Mlp) {
    let dir = tempdir(label);
    let mlp = Mlp::random(sizes, seed);
    mlp.save(&dir).unwrap();
    (dir, mlp)
}

/// A deterministic input vector.
pub fn input(len: usize, k: u64) -> Vec<f32> {
    (0..len).map(|i| (((i as u64 * 31 + k * 17) % 23) as f32 - 11.0) / 7.0).collect()
}

pub fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "element {i}: got {g}, want {w}");
    }
}

/// One submission of a stress test, through `q` with `tag`: retried while admission control
/// answers BUSY (it is doing its job: back off and retry), and once admitted cancelled at random
/// one time in 20. True if admitted; a refusal must be SHUTDOWN or DEADLINE_EXCEEDED.
pub fn stress_submit(
    rt: &Runtime,
    model: &Model,
    input: impl Fn() -> Input,
    opts: SubmitOptions,
    q: &CompletionQueue,
    tag: u64,
    rng: &mut impl Rng,
) -> bool {
    let mut result = model.submit_to(input(), opts, q, tag);
    while result.as_ref().is_err_and(|e| e.code() == Code::Busy) {
        std::thread::yield_now();
        result = model.submit_to(input(), opts, q, tag);
    }
    match result {
        Ok(id) => {
            if rng.random_bool(0.05) {
                rt.cancel(id).unwrap();
            }
            true
        }
        Err(e) => {
            assert!(matches!(e.code(), Code::Shutdown | Code::DeadlineExceeded), "unexpected refusal {e}");
            false
        }
    }
}
