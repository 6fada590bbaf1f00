//! The Go bindings (`ffi_examples/go`, module `libserve`) are a real consumer of the C ABI: this
//! test builds `target/release/libserve.a` (what their cgo flags link), then runs `go vet ./...`
//! and `go test -race -count=1 ./...` in the module — the package's tests (concurrency, cancel,
//! deadline, shutdown, bad input, exactly-once delivery) and the `net/http` example server's tests
//! over loopback.
//!
//! Environment:
//! * `GO` — the go command (default: `go` on `PATH`, then `/usr/local/go/bin/go`). A missing Go
//!   toolchain fails the test unless `SERVE_SKIP_GO=1`, which makes it print why and pass.
//! * `CARGO` — set by cargo; runs `cargo build --release --lib` into `<repo>/target` (the path
//!   the cgo flags name), a no-op when the library is fresh. It does not wait on the `cargo test`
//!   running this test: cargo releases its build lock before it runs test binaries (a nested
//!   build of the test's own profile does not block either).
//!
//! The Go build cache is the user's (`go env GOCACHE`); only when neither `GOCACHE`,
//! `XDG_CACHE_HOME` nor `HOME` is set are the cache and `GOPATH` put under `target/`. The first
//! run compiles the race-enabled standard library (about a minute on two cores); later runs take
//! seconds.

mod common;

use common::native::{cargo, env_flag, manifest_dir};
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Per go command: generous for a cold build cache on a loaded 2-core machine.
const GO_TIMEOUT: Duration = Duration::from_secs(240);
/// Passed to `go test -timeout`, so a hung test binary panics with its goroutine dump first.
const GO_TEST_TIMEOUT: &str = "180s";

fn go_module() -> PathBuf {
    manifest_dir().join("ffi_examples/go")
}

/// The target directory the Go package links from: `${SRCDIR}/../../target` in link_static.go.
fn go_target_dir() -> PathBuf {
    manifest_dir().join("target")
}

/// The go command, or `None` (after printing why) when it is missing and `SERVE_SKIP_GO=1`.
fn find_go() -> Option<OsString> {
    let candidates: Vec<OsString> = match std::env::var_os("GO").filter(|g| !g.is_empty()) {
        Some(g) => vec![g],
        None => vec![OsString::from("go"), OsString::from("/usr/local/go/bin/go")],
    };
    let mut why = Vec::new();
    for go in &candidates {
        match Command::new(go).arg("version").stdin(Stdio::null()).output() {
            Ok(out) if out.status.success() => {
                eprintln!("using {}: {}", go.to_string_lossy(), String::from_utf8_lossy(&out.stdout).trim());
                return Some(go.clone());
            }
            Ok(out) => why.push(format!("`{} version` failed: {}", go.to_string_lossy(), out.status)),
            Err(e) => why.push(format!("cannot run `{}`: {e}", go.to_string_lossy())),
        }
    }
    let why = why.join("; ");
    if env_flag("SERVE_SKIP_GO") {
        eprintln!("skipped: no Go toolchain ({why}) (SERVE_SKIP_GO=1)");
        None
    } else {
        panic!(
            "no Go toolchain: {why}. Install Go 1.24 or later (https://go.dev/dl), set GO to the go \
             command, or set SERVE_SKIP_GO=1 to skip the Go bindings test"
        );
    }
}

/// Make `target/release/libserve.a` exist and match the sources, with `cargo build --release
/// --lib`. Returns its path.
fn build_static_library() -> PathBuf {
    let target = go_target_dir();
    let lib = target.join("release/libserve.a");
    let cargo = cargo();
    let mut cmd = Command::new(&cargo);
    cmd.args(["build", "--release", "--lib", "--manifest-path"])
        .arg(manifest_dir().join("Cargo.toml"))
        .env("CARGO_TARGET_DIR", &target)
        .stdin(Stdio::null());
    eprintln!("running {cmd:?}");
    let start = Instant::now();
    let status = cmd.status().unwrap_or_else(|e| panic!("cannot run {}: {e}", cargo.to_string_lossy()));
    assert!(status.success(), "`cargo build --release --lib` failed: {status}");
    eprintln!("cargo build --release --lib: {:.1?}", start.elapsed());
    assert!(lib.is_file(), "`cargo build --release --lib` did not produce {}", lib.display());
    lib
}

/// Environment for the go commands.
fn go_env(cmd: &mut Command) {
    // cgo is required; never fetch another toolchain (go.mod says `go 1.24`).
    cmd.env("CGO_ENABLED", "1").env("GOTOOLCHAIN", "local");
    let unset = |k: &str| std::env::var_os(k).is_none_or(|v| v.is_empty());
    if unset("GOCACHE") && unset("XDG_CACHE_HOME") && unset("HOME") {
        let base = go_target_dir().join("go");
        cmd.env("GOCACHE", base.join("cache")).env("GOPATH", base.join("path"));
    }
}

/// Run a go command in the module with a time limit; the output, printed, on success.
fn run_go(go: &OsString, args: &[&str]) -> Output {
    let mut cmd = Command::new(go);
    cmd.args(args)
        .current_dir(go_module())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    go_env(&mut cmd);
    // Its own process group, so a timeout kills the test binaries go started too.
    cmd.process_group(0);
    eprintln!("running go {}", args.join(" "));
    let start = Instant::now();
    let child = cmd.spawn().unwrap_or_else(|e| panic!("cannot run {}: {e}", go.to_string_lossy()));
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(GO_TIMEOUT) {
        Ok(out) => out.expect("wait for go"),
        Err(_) => {
            // SAFETY: signals the process group we created above; no memory is involved.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
            let out = rx.recv().expect("go was killed").expect("wait for go");
            panic!(
                "go {} did not finish within {GO_TIMEOUT:?}:\n{}{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("--- go {} ({:.1?}, {}) ---\n{stdout}{stderr}---", args.join(" "), start.elapsed(), out.status);
    assert!(out.status.success(), "go {} failed: {}", args.join(" "), out.status);
    out
}

#[test]
fn go_bindings_vet_and_race_tests() {
    let Some(go) = find_go() else { return };
    let lib = build_static_library();
    eprintln!("linking {}", lib.display());
    run_go(&go, &["vet", "./..."]);
    let out = run_go(&go, &["test", "-race", "-count=1", "-timeout", GO_TEST_TIMEOUT, "./..."]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    // Both packages ran (and none was skipped for lack of test files).
    for pkg in ["libserve", "libserve/cmd/serve-http"] {
        assert!(
            stdout.lines().any(|l| l.starts_with("ok") && l.split_whitespace().nth(1) == Some(pkg)),
            "go test did not report `ok {pkg}`"
        );
    }
}
