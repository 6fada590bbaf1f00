//! The C example (`ffi_examples/c/example.c`) is a real consumer of the C ABI: this test compiles
//! it against the committed header with `-Wall -Wextra -Werror`, links it twice — against
//! `libserve.a` and against `libserve.so` (run through its SONAME `libserve.so.0`) — and runs each
//! build on a generated mlp model, requiring exit status 0 and its final success line.
//!
//! Environment:
//! * `CC` — the C compiler (default `cc`). A missing compiler fails the test unless
//!   `SERVE_SKIP_C=1`, which makes it print why and pass.
//! * `SERVE_C_SANITIZE=1` — build the static-library variant with
//!   `-fsanitize=address,undefined` and run it with LeakSanitizer on and UBSan halting on error
//!   (what `ffi_examples/c/run_asan.sh` and CI use).
//! * `SERVE_C_FORCE_BUILD=1` — ignore the libraries cargo built for this test and build them with
//!   `cargo build --lib` (the fallback path, normally taken only when they are missing or stale).
//! * `SERVE_C_KEEP=1` — keep the scratch directories (model, expected file, executables) under
//!   `target/tmp` to rerun an example by hand.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use serve::model::Mlp;

const SUCCESS_LINE: &str = "example: all checks passed";
/// What `cargo rustc --lib --crate-type staticlib -- --print native-static-libs` prints on
/// x86_64-unknown-linux-gnu for this crate (std + libc + libloading).
const NATIVE_STATIC_LIBS: &[&str] = &["-ldl", "-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"];
const CFLAGS: &[&str] = &["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread"];
const SANITIZE_FLAGS: &[&str] = &["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"];
/// Generous: the example runs ~1,700 requests; under ASan on a loaded 2-core machine it takes
/// seconds, not minutes.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

fn env_flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| v == "1")
}

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `target/<profile>` (or `target/<triple>/<profile>`): this test binary is
/// `target/<profile>/deps/<test-bin>`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let deps = exe.parent().expect("the test binary has a directory");
    assert_eq!(
        deps.file_name().and_then(|n| n.to_str()),
        Some("deps"),
        "test binary {} is not in target/<profile>/deps",
        exe.display()
    );
    deps.parent().expect("deps has a parent").to_path_buf()
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

/// The rlib this test binary was linked against: `deps/libserve.rlib` (cargo drops the hash from
/// a package that has a cdylib), or the newest `deps/libserve-*.rlib`.
fn linked_rlib(profile: &Path) -> Option<SystemTime> {
    std::fs::read_dir(profile.join("deps"))
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            n.starts_with("libserve") && n.ends_with(".rlib")
        })
        .filter_map(|e| mtime(&e.path()))
        .max()
}

/// A library is current if rustc wrote it in the same invocation as (hence after) the rlib this
/// test links: all of the lib's crate types come out of one rustc run.
fn current(lib: &Path, rlib: Option<SystemTime>) -> bool {
    match (mtime(lib), rlib) {
        (Some(l), Some(r)) => l >= r,
        (Some(_), None) => true,
        _ => false,
    }
}

/// The directory holding current `libserve.a` and `libserve.so`. Cargo builds every crate type of
/// the lib (rlib, cdylib, staticlib) into `target/<profile>/deps` in the single rustc run that also
/// gives this test its rlib, but only `cargo build` copies them up to `target/<profile>`: under
/// `cargo test` the copies there may be missing or stale. So take `target/<profile>` when its
/// copies are current, else `deps/`, else build them with `cargo build --lib`.
fn library_dir() -> PathBuf {
    let profile = profile_dir();
    let rlib = linked_rlib(&profile);
    let fresh = |d: &Path| current(&d.join("libserve.a"), rlib) && current(&d.join("libserve.so"), rlib);
    if !env_flag("SERVE_C_FORCE_BUILD") {
        for dir in [profile.clone(), profile.join("deps")] {
            if fresh(&dir) {
                return dir;
            }
        }
        eprintln!("libserve.a / libserve.so missing or stale in {}: building them", profile.display());
    }
    cargo_build_lib(&profile)
}

/// `cargo build --lib` for the profile (and target triple) this test was built for, into the same
/// target directory.
fn cargo_build_lib(profile: &Path) -> PathBuf {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));
    let name = profile.file_name().and_then(|n| n.to_str()).expect("profile dir name").to_string();
    let parent = profile.parent().expect("profile dir has a parent");
    // target/<profile> or target/<triple>/<profile>: the target root holds CACHEDIR.TAG.
    let (target_root, triple) =
        if parent.join("CACHEDIR.TAG").exists() || parent.join(".rustc_info.json").exists() {
            (parent.to_path_buf(), None)
        } else {
            let root = parent.parent().expect("target/<triple> has a parent").to_path_buf();
            (root, parent.file_name().map(|t| t.to_os_string()))
        };
    let cargo_profile = match name.as_str() {
        "debug" => "dev",
        other => other,
    };
    let mut cmd = Command::new(&cargo);
    cmd.arg("build")
        .arg("--lib")
        .arg("--manifest-path")
        .arg(manifest_dir().join("Cargo.toml"))
        .arg("--profile")
        .arg(cargo_profile)
        .env("CARGO_TARGET_DIR", &target_root);
    if let Some(t) = triple {
        cmd.arg("--target").arg(t);
    }
    eprintln!("running {cmd:?}");
    let status = cmd.status().unwrap_or_else(|e| panic!("cannot run {}: {e}", cargo.to_string_lossy()));
    assert!(status.success(), "`cargo build --lib` failed: {status}");
    for lib in ["libserve.a", "libserve.so"] {
        assert!(
            profile.join(lib).is_file(),
            "`cargo build --lib` did not produce {}",
            profile.join(lib).display()
        );
    }
    profile.to_path_buf()
}

/// A fresh scratch directory under cargo's per-target tmp dir.
fn scratch(name: &str) -> PathBuf {
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("c_example-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
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

fn compiler() -> OsString {
    std::env::var_os("CC").filter(|c| !c.is_empty()).unwrap_or_else(|| OsString::from("cc"))
}

/// Whether a C compiler can be run. `false` only when `SERVE_SKIP_C=1` allows skipping.
fn have_compiler() -> bool {
    let cc = compiler();
    match Command::new(&cc).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status() {
        Ok(s) if s.success() => true,
        other => {
            let why = match other {
                Ok(s) => format!("`{} --version` failed: {s}", cc.to_string_lossy()),
                Err(e) => format!("cannot run C compiler `{}`: {e}", cc.to_string_lossy()),
            };
            if env_flag("SERVE_SKIP_C") {
                eprintln!("skipped: {why} (SERVE_SKIP_C=1)");
                false
            } else {
                panic!("{why}; install a C compiler, set CC, or set SERVE_SKIP_C=1 to skip the C example");
            }
        }
    }
}

fn compile(out: &Path, extra_before: &[&str], link: &[OsString]) {
    let mut cmd = Command::new(compiler());
    cmd.args(CFLAGS)
        .args(extra_before)
        .arg("-I")
        .arg(manifest_dir().join("include"))
        .arg(manifest_dir().join("ffi_examples/c/example.c"))
        .arg("-o")
        .arg(out)
        .args(link);
    eprintln!("compiling: {cmd:?}");
    let output = cmd.output().expect("run the C compiler");
    assert!(
        output.status.success(),
        "compiling example.c failed ({}):\n{}{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Run the example with a time limit; assert exit 0 and the success line.
fn run(exe: &Path, model_dir: &Path, expected: &Path, env: &[(&str, OsString)], scratch: &Path) {
    let stdout_path = scratch.join("stdout.txt");
    let stderr_path = scratch.join("stderr.txt");
    let mut cmd = Command::new(exe);
    cmd.arg(model_dir)
        .arg(expected)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > RUN_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = std::fs::read_to_string(&stdout_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    eprintln!("--- {} stdout ---\n{stdout}--- stderr ---\n{stderr}---", exe.display());
    let status = status.unwrap_or_else(|| panic!("{} did not finish within {RUN_TIMEOUT:?}", exe.display()));
    assert!(status.success(), "{} failed: {status}", exe.display());
    assert!(
        stdout.lines().any(|l| l == SUCCESS_LINE),
        "{} exited 0 without printing `{SUCCESS_LINE}`",
        exe.display()
    );
    assert!(!stdout.contains("FAIL:"), "{} printed a FAIL line but exited 0", exe.display());
    for report in ["ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"] {
        assert!(!stderr.contains(report), "{} exited 0 after a sanitizer report ({report})", exe.display());
    }
}

fn cleanup(dir: &Path) {
    if env_flag("SERVE_C_KEEP") {
        eprintln!("kept {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn c_example_static_library() {
    if !have_compiler() {
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
    let mut env = Vec::new();
    if sanitize {
        env.push(("ASAN_OPTIONS", OsString::from("detect_leaks=1:abort_on_error=0:strict_string_checks=1")));
        env.push(("UBSAN_OPTIONS", OsString::from("halt_on_error=1:print_stacktrace=1")));
        env.push(("LSAN_OPTIONS", OsString::from("report_objects=1")));
    }
    run(&exe, &model_dir, &expected, &env, &dir);
    cleanup(&dir);
}

#[test]
fn c_example_shared_library() {
    if !have_compiler() {
        return;
    }
    let libs = library_dir();
    let dir = scratch("shared");
    let (model_dir, expected) = write_fixture(&dir, 11);
    // Link against `libserve.so` in one directory; run with only the SONAME `libserve.so.0` in
    // another, so a missing or wrong SONAME makes the dynamic loader fail.
    let link_dir = dir.join("link");
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&link_dir).unwrap();
    std::fs::create_dir_all(&run_dir).unwrap();
    let so = libs.join("libserve.so");
    std::os::unix::fs::symlink(&so, link_dir.join("libserve.so")).unwrap();
    std::os::unix::fs::symlink(&so, run_dir.join(format!("libserve.so.{}", env!("CARGO_PKG_VERSION_MAJOR"))))
        .unwrap();
    let exe = dir.join("example-shared");
    let mut link_flag = OsString::from("-L");
    link_flag.push(&link_dir);
    compile(&exe, &[], &[link_flag, OsString::from("-lserve")]);
    run(&exe, &model_dir, &expected, &[("LD_LIBRARY_PATH", run_dir.into_os_string())], &dir);
    cleanup(&dir);
}
