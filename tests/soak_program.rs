//! The soak program (`ffi_examples/c/soak.c`, run for 30 minutes by `scripts/soak.sh`, not in CI)
//! must not rot: this test compiles it against the committed header with `-Wall -Wextra -Werror`,
//! links it against `libserve.so` (run through its SONAME), and runs it for a few seconds on the
//! committed mlp and lstm fixtures with tiny settings and a growth limit no short run can miss
//! (the RSS figures of a 3-second run mean nothing): exit 0, the summary line, and every request
//! completed OK. Also: bad command-line values and a missing model directory are refused with exit
//! status 2 and a message saying which (the model's with libserve's code and message).
//!
//! Environment: `CC` (default `cc`); `SERVE_SKIP_C=1` passes without a C compiler, as
//! `tests/c_example.rs`. Run in release, where the library is already built:
//! `cargo test --release --test soak_program`.

mod common;

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::native::{self, C_COMPILER, C_FLAGS, env_flag, manifest_dir};

const SUCCESS_LINE: &str = "soak: ok";
/// Generous: the run itself takes ~5 s (1 s calibration per model, 3 s of load, the drain).
const RUN_TIMEOUT: Duration = Duration::from_secs(300);

fn fixture(name: &str) -> OsString {
    manifest_dir().join("ffi_examples/testdata").join(name).into_os_string()
}

/// Compile soak.c against the shared library; the executable and the `LD_LIBRARY_PATH` to run it.
fn build(dir: &Path) -> (PathBuf, OsString) {
    let libs = native::library_dir(false);
    let (link, run_dir) = native::shared_library_link(&libs, dir);
    let exe = dir.join("soak");
    let mut cmd = Command::new(C_COMPILER.program());
    cmd.args(C_FLAGS)
        .arg("-I")
        .arg(manifest_dir().join("include"))
        .arg(manifest_dir().join("ffi_examples/c/soak.c"))
        .arg("-o")
        .arg(&exe)
        .args(&link)
        .arg("-lm");
    native::run_compiler(&mut cmd, "compiling soak.c");
    (exe, run_dir)
}

#[test]
fn soak_program_runs_briefly_and_settles_every_request() {
    if !C_COMPILER.available() {
        return;
    }
    let dir = native::scratch("soak_program");
    let (exe, run_dir) = build(&dir);
    let args: Vec<OsString> = [
        "--seconds",
        "3",
        "--calibrate-seconds",
        "1",
        "--warmup-seconds",
        "1",
        "--sample-seconds",
        "1",
        "--max-growth",
        "1000",
        "--cpu-threads",
        "2",
    ]
    .iter()
    .map(OsString::from)
    .chain([fixture("mlp_4_8_3"), fixture("lstm_small")])
    .collect();
    let args: Vec<&OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    native::run_example(&[], &exe, &args, &[("LD_LIBRARY_PATH", run_dir)], &dir, SUCCESS_LINE, RUN_TIMEOUT);

    let stdout = std::fs::read_to_string(dir.join("stdout.txt")).unwrap();
    let summary = stdout
        .lines()
        .find(|l| l.starts_with("soak summary: capacity "))
        .unwrap_or_else(|| panic!("no `soak summary:` line in\n{stdout}"));
    for part in ["completions: OK ", "ledger violations 0, bad outputs 0", "growth "] {
        assert!(summary.contains(part), "summary line lacks `{part}`: {summary}");
    }
    // Only OK completions: after the completion list comes the `(soak …)` split.
    let codes = summary.split("completions:").nth(1).unwrap().split(" (soak").next().unwrap();
    assert!(
        codes.trim().starts_with("OK ") && !codes.trim()["OK ".len()..].contains(' '),
        "a code other than OK in: {codes}"
    );
    assert!(stdout.lines().any(|l| l.starts_with("sample t=")), "no sample line in\n{stdout}");
    assert!(stdout.lines().any(|l| l.starts_with("warm-up done at t=")), "no warm-up line in\n{stdout}");
    native::cleanup(&dir, env_flag("SERVE_C_KEEP"));
}

fn run_refused(exe: &Path, run_dir: &OsStr, args: &[&str]) -> Output {
    Command::new(exe).args(args).env("LD_LIBRARY_PATH", run_dir).output().expect("run soak")
}

#[test]
fn soak_program_refuses_bad_settings_with_a_message() {
    if !C_COMPILER.available() {
        return;
    }
    let dir = native::scratch("soak_program-refusals");
    let (exe, run_dir) = build(&dir);
    let missing = dir.join("no-such-model");
    let missing = missing.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (&["--load", "0"], &["--load", "\"0\"", "not a number in"]),
        (&["--load", "nan"], &["--load", "\"nan\""]),
        (&["--seconds", "1e30"], &["--seconds", "not a number in"]),
        (&["--window", "-1"], &["--window", "not an integer in"]),
        (&["--window", "18446744073709551616"], &["--window", "not an integer in"]),
        (&["--window", "5000", "--admission-bound", "4096"], &["--window 5000", "admission bound 4096"]),
        (&["--seconds", "5", "--warmup-seconds", "5"], &["--warmup-seconds 5", "shorter than"]),
        (&["--max-seq", "0"], &["--max-seq"]),
        (&["--seconds"], &["--seconds needs a value"]),
        (&["--bogus", "1"], &["unknown option --bogus"]),
        (&["--backend", "tpu", missing], &["--backend: INVALID_ARGUMENT"]),
        (&["--seconds", "1", missing], &["loading ", "no-such-model", "NOT_FOUND"]),
    ];
    for (args, want) in cases {
        let out = run_refused(&exe, &run_dir, args);
        let text =
            format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert_eq!(out.status.code(), Some(2), "soak {args:?}: exit {} with\n{text}", out.status);
        for w in *want {
            assert!(text.contains(w), "soak {args:?}: no `{w}` in\n{text}");
        }
        assert!(!text.contains("soak: ok"), "soak {args:?} printed success:\n{text}");
    }
    native::cleanup(&dir, env_flag("SERVE_C_KEEP"));
}
