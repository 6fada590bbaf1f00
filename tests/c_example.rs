//! The C example (`ffi_examples/c/example.c`) is a real consumer of the C ABI: this test compiles
//! it against the committed header with `-Wall -Wextra -Werror`, links it twice — against
//! `libserve.a` and against `libserve.so` (run through its SONAME `libserve.so.0`) — and runs each
//! build on a generated mlp model and the committed lstm and treelstm fixtures
//! (`ffi_examples/testdata`), requiring exit status 0 and its final success line.
//!
//! Environment:
//! * `CC` — the C compiler (default `cc`). A missing compiler fails the test unless
//!   `SERVE_SKIP_C=1`, which makes it print why and pass.
//! * `SERVE_C_SANITIZE=1` — build the static-library variant with
//!   `-fsanitize=address,undefined` and run it with LeakSanitizer on and UBSan halting on error
//!   (what `ffi_examples/c/run_asan.sh` and CI use).
//! * `SERVE_C_VALGRIND=1` — run the shared-library variant under valgrind's memcheck (memory
//!   errors and definite leaks fail it; what CI runs against the release `libserve.so` with
//!   `cargo test --release`). A missing valgrind then fails the test.
//! * `SERVE_C_FORCE_BUILD=1` — ignore the libraries cargo built for this test and build them with
//!   `cargo build --lib` (the fallback path, normally taken only when they are missing or stale).
//! * `SERVE_C_KEEP=1` — keep the scratch directories (model, expected file, executables) under
//!   `target/tmp` to rerun an example by hand.

mod common;

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::native::{self, C_COMPILER, C_FLAGS, NATIVE_STATIC_LIBS, SANITIZE_FLAGS, env_flag, manifest_dir};
use serve::model::Mlp;

const SUCCESS_LINE: &str = "example: all checks passed";
/// Generous: the example runs ~1,700 requests; under ASan on a loaded 2-core machine it takes
/// seconds, under valgrind a few minutes.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

fn library_dir() -> PathBuf {
    native::library_dir(env_flag("SERVE_C_FORCE_BUILD"))
}

/// A fresh scratch directory under cargo's per-target tmp dir.
fn scratch(name: &str) -> PathBuf {
    native::scratch(&format!("c_example-{name}"))
}

/// Write the mlp model dir and the expected-output file (format: top of example.c).
fn write_fixture(dir: &Path, seed: u64) -> (PathBuf, PathBuf) {
    const SIZES: [usize; 3] = [16, 32, 8];
    const K: usize = 8;
    let mlp = Mlp::random(&SIZES, seed);
    let model_dir = dir.join("mlp");
    mlp.save(&model_dir).expect("save the mlp");
    let mut text = format!("{} {} {K}\n", SIZES[0], SIZES[2]);
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    for _ in 0..K {
        let x: Vec<f32> = (0..SIZES[0])
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32) * 4.0 - 2.0
            })
            .collect();
        let y = mlp.forward_reference(&x);
        assert_eq!(y.len(), SIZES[2]);
        // `{:?}` prints the shortest string that reads back as the same f32 (strtof rounds
        // correctly), so C sees exactly these inputs.
        for v in &x {
            write!(text, "{v:?} ").unwrap();
        }
        text.push_str("  ");
        for v in &y {
            write!(text, "{v:?} ").unwrap();
        }
        text.push('\n');
    }
    let expected = dir.join("expected.txt");
    std::fs::write(&expected, text).unwrap();
    (model_dir, expected)
}

/// The recurrent-model arguments: fixture directories and their expected outputs.
fn recurrent_args(dir: &Path) -> Vec<OsString> {
    native::recurrent_fixture_args(dir, &[("LSTM", "lstm_small"), ("TREE", "treelstm_small")])
}

fn compile(out: &Path, extra_before: &[&str], link: &[OsString]) {
    let mut cmd = Command::new(C_COMPILER.program());
    cmd.args(C_FLAGS)
        .args(extra_before)
        .arg("-I")
        .arg(manifest_dir().join("include"))
        .arg(manifest_dir().join("ffi_examples/c/example.c"))
        .arg("-o")
        .arg(out)
        .args(link);
    native::run_compiler(&mut cmd, "compiling example.c");
}

/// Run the example (through `launcher`, if any) with a time limit; assert exit 0 and the success
/// line.
fn run(
    launcher: &[&str],
    exe: &Path,
    model_dir: &Path,
    expected: &Path,
    env: &[(&str, OsString)],
    scratch: &Path,
) {
    let recurrent = recurrent_args(scratch);
    let mut args = vec![model_dir.as_os_str(), expected.as_os_str()];
    args.extend(recurrent.iter().map(|a| a.as_os_str()));
    native::run_example(launcher, exe, &args, env, scratch, SUCCESS_LINE, RUN_TIMEOUT);
}

fn cleanup(dir: &Path) {
    native::cleanup(dir, env_flag("SERVE_C_KEEP"));
}

#[test]
fn c_example_static_library() {
    if !C_COMPILER.available() {
        return;
    }
    let libs = library_dir();
    let dir = scratch("static");
    let (model_dir, expected) = write_fixture(&dir, 7);
    let sanitize = env_flag("SERVE_C_SANITIZE");
    let exe = dir.join("example-static");
    let mut link = vec![libs.join("libserve.a").into_os_string()];
    link.extend(NATIVE_STATIC_LIBS.iter().map(OsString::from));
    compile(&exe, if sanitize { SANITIZE_FLAGS } else { &[] }, &link);
    let env = if sanitize { native::sanitizer_env() } else { Vec::new() };
    run(&[], &exe, &model_dir, &expected, &env, &dir);
    cleanup(&dir);
}

#[test]
fn c_example_shared_library() {
    if !C_COMPILER.available() {
        return;
    }
    let libs = library_dir();
    let dir = scratch("shared");
    let (model_dir, expected) = write_fixture(&dir, 11);
    let (link, run_dir) = native::shared_library_link(&libs, &dir);
    let exe = dir.join("example-shared");
    compile(&exe, &[], &link);
    let launcher = if env_flag("SERVE_C_VALGRIND") { native::VALGRIND } else { &[] };
    run(launcher, &exe, &model_dir, &expected, &[("LD_LIBRARY_PATH", run_dir)], &dir);
    cleanup(&dir);
}
