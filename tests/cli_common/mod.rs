//! Helpers of the tests that run the `serve` binary and read what it wrote.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

pub const SERVE: &str = env!("CARGO_BIN_EXE_serve");

/// Runs `serve` with `args`.
pub fn serve(args: &[&str]) -> Output {
    Command::new(SERVE).args(args).output().expect("run serve")
}

/// Its standard output, after checking it succeeded.
pub fn ok(o: &Output) -> String {
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "serve failed: {}\n{out}\n{}", o.status, String::from_utf8_lossy(&o.stderr));
    out
}

/// Its standard error, after checking it failed.
pub fn fails(o: &Output) -> String {
    assert!(!o.status.success(), "serve succeeded: {}", String::from_utf8_lossy(&o.stdout));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A path in the temporary directory, unique to this process, test file (`prefix`) and `name`.
pub fn temp(prefix: &str, name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("serve-{prefix}-{}-{name}", std::process::id()))
}

/// The JSON file at `path`.
pub fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}
