//! Helpers for the tests that build and run native (non-Rust) consumers of the C ABI: locating
//! current `libserve.a` / `libserve.so`, finding a tool (compiler, pkg-config) or skipping by an
//! environment flag, scratch directories, running a compiler, and running an example program
//! with a time limit.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant, SystemTime};

/// What `cargo rustc --lib --crate-type staticlib -- --print native-static-libs` prints on
/// x86_64-unknown-linux-gnu for this crate (std + libc + libloading). `tests/packaging.rs` checks
/// it, README's Install section and `packaging/libserve.pc.in` against rustc.
pub const NATIVE_STATIC_LIBS: &[&str] =
    &["-ldl", "-lgcc_s", "-lutil", "-lrt", "-lpthread", "-lm", "-ldl", "-lc"];
/// Compiler flags of every C consumer the tests build (example.c, soak.c).
pub const C_FLAGS: &[&str] = &["-std=c11", "-Wall", "-Wextra", "-Werror", "-pthread"];
/// Compiler flags of the sanitized builds (C and C++).
pub const SANITIZE_FLAGS: &[&str] = &["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"];

/// Whether the environment variable `name` is exactly `1`.
pub fn env_flag(name: &str) -> bool {
    std::env::var_os(name).is_some_and(|v| v == "1")
}

pub fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The cargo that runs this test (`CARGO`), else `cargo` from PATH.
pub fn cargo() -> OsString {
    std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"))
}

/// `target/<profile>` (or `target/<triple>/<profile>`): this test binary is
/// `target/<profile>/deps/<test-bin>`.
pub fn profile_dir() -> PathBuf {
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

/// The target directory this test was built in, and the target triple if it was built with
/// `--target`: `target/<profile>` or `target/<triple>/<profile>`; the root holds CACHEDIR.TAG.
pub fn target_root() -> (PathBuf, Option<OsString>) {
    let profile = profile_dir();
    let parent = profile.parent().expect("profile dir has a parent");
    if parent.join("CACHEDIR.TAG").exists() || parent.join(".rustc_info.json").exists() {
        (parent.to_path_buf(), None)
    } else {
        let root = parent.parent().expect("target/<triple> has a parent").to_path_buf();
        (root, parent.file_name().map(|t| t.to_os_string()))
    }
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
/// copies are current, else `deps/`, else (or when `force_build`) build them with
/// `cargo build --lib`.
pub fn library_dir(force_build: bool) -> PathBuf {
    let profile = profile_dir();
    let rlib = linked_rlib(&profile);
    let fresh = |d: &Path| current(&d.join("libserve.a"), rlib) && current(&d.join("libserve.so"), rlib);
    if !force_build {
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
    let cargo = cargo();
    let name = profile.file_name().and_then(|n| n.to_str()).expect("profile dir name").to_string();
    let (target_root, triple) = target_root();
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

/// Link against `libserve.so` in `libs` the way an installed consumer runs: returns the linker
/// flags (`-L <dir>/link -lserve`, a directory holding only a `libserve.so` link) and the
/// `LD_LIBRARY_PATH` to run with (`<dir>/run`, holding only the SONAME `libserve.so.<major>`), so
/// a missing or wrong SONAME makes the dynamic loader fail.
pub fn shared_library_link(libs: &Path, dir: &Path) -> (Vec<OsString>, OsString) {
    let link_dir = dir.join("link");
    let run_dir = dir.join("run");
    std::fs::create_dir_all(&link_dir).unwrap();
    std::fs::create_dir_all(&run_dir).unwrap();
    let so = libs.join("libserve.so");
    std::os::unix::fs::symlink(&so, link_dir.join("libserve.so")).unwrap();
    std::os::unix::fs::symlink(&so, run_dir.join(format!("libserve.so.{}", env!("CARGO_PKG_VERSION_MAJOR"))))
        .unwrap();
    let mut link_flag = OsString::from("-L");
    link_flag.push(&link_dir);
    (vec![link_flag, OsString::from("-lserve")], run_dir.into_os_string())
}

/// A fresh scratch directory `<label>-<pid>-<nanos>` under cargo's per-target tmp dir.
pub fn scratch(label: &str) -> PathBuf {
    let nanos = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap().as_nanos();
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{label}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Remove a scratch directory, or keep it (and say where) when `keep`.
pub fn cleanup(dir: &Path, keep: bool) {
    if keep {
        eprintln!("kept {}", dir.display());
    } else {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// An external program a test needs: the environment variable that overrides it, its default
/// name, the flag (`<skip_env>=1`) that lets the test pass without it, and what to install.
pub struct Tool {
    pub env: &'static str,
    pub default: &'static str,
    pub skip_env: &'static str,
    pub what: &'static str,
}

pub const C_COMPILER: Tool =
    Tool { env: "CC", default: "cc", skip_env: "SERVE_SKIP_C", what: "a C compiler" };

pub const CXX_COMPILER: Tool =
    Tool { env: "CXX", default: "c++", skip_env: "SERVE_SKIP_CPP", what: "a C++ compiler" };

impl Tool {
    /// The program to run: `$<env>` if set and non-empty, else the default.
    pub fn program(&self) -> OsString {
        std::env::var_os(self.env).filter(|c| !c.is_empty()).unwrap_or_else(|| OsString::from(self.default))
    }

    /// Whether `<program> --version` runs. When it does not: `false` (after saying why) if
    /// `<skip_env>=1`, else a panic saying what to install.
    pub fn available(&self) -> bool {
        let prog = self.program();
        match Command::new(&prog).arg("--version").stdout(Stdio::null()).stderr(Stdio::null()).status() {
            Ok(s) if s.success() => true,
            other => {
                let why = match other {
                    Ok(s) => format!("`{} --version` failed: {s}", prog.to_string_lossy()),
                    Err(e) => format!("cannot run {} `{}`: {e}", self.what, prog.to_string_lossy()),
                };
                if env_flag(self.skip_env) {
                    eprintln!("skipped: {why} ({}=1)", self.skip_env);
                    false
                } else {
                    panic!(
                        "{why}; install {}, set {}, or set {}=1 to skip this test",
                        self.what, self.env, self.skip_env
                    );
                }
            }
        }
    }
}

/// Assert that a finished command succeeded, showing its output if not.
pub fn assert_success(output: &Output, what: &str) {
    assert!(
        output.status.success(),
        "{what} failed ({}):\n--- stdout ---\n{}--- stderr ---\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Run a compiler (or linker) command and assert that it succeeds, showing its output if not.
pub fn run_compiler(cmd: &mut Command, what: &str) {
    eprintln!("{what}: {cmd:?}");
    let output = cmd.output().unwrap_or_else(|e| panic!("{what}: cannot run {:?}: {e}", cmd.get_program()));
    assert_success(&output, what);
}

/// The environment of a sanitized run: LeakSanitizer on, UBSan halting on error.
pub fn sanitizer_env() -> Vec<(&'static str, OsString)> {
    vec![
        ("ASAN_OPTIONS", OsString::from("detect_leaks=1:abort_on_error=0:strict_string_checks=1")),
        ("UBSAN_OPTIONS", OsString::from("halt_on_error=1:print_stacktrace=1")),
        ("LSAN_OPTIONS", OsString::from("report_objects=1")),
    ]
}

/// Valgrind's memcheck as an example's launcher: any memory error, or a definite leak, makes the
/// run exit [`VALGRIND_ERROR_EXIT`] (the `--error-exitcode` below).
pub const VALGRIND: &[&str] = &[
    "valgrind",
    "--quiet",
    "--error-exitcode=97",
    "--leak-check=full",
    "--show-leak-kinds=definite",
    "--errors-for-leak-kinds=definite",
];
const VALGRIND_ERROR_EXIT: i32 = 97;

/// Run an example program with `args` and extra `env`, at most `timeout`, through `launcher`
/// (e.g. [`VALGRIND`]; empty: directly); its output goes to files in `scratch` and is printed.
/// Asserts exit 0, a stdout line equal to `success_line`, no `FAIL:` line, and no sanitizer
/// report on stderr.
pub fn run_example(
    launcher: &[&str],
    exe: &Path,
    args: &[&OsStr],
    env: &[(&str, OsString)],
    scratch: &Path,
    success_line: &str,
    timeout: Duration,
) {
    let stdout_path = scratch.join("stdout.txt");
    let stderr_path = scratch.join("stderr.txt");
    let mut cmd = match launcher.split_first() {
        Some((program, flags)) => {
            let mut cmd = Command::new(program);
            cmd.args(flags).arg(exe);
            cmd
        }
        None => Command::new(exe),
    };
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&stdout_path).unwrap())
        .stderr(std::fs::File::create(&stderr_path).unwrap());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child =
        cmd.spawn().unwrap_or_else(|e| panic!("cannot run {} ({launcher:?}): {e}", exe.display()));
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let stdout = std::fs::read_to_string(&stdout_path).unwrap_or_default();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap_or_default();
    eprintln!("--- {} stdout ---\n{stdout}--- stderr ---\n{stderr}---", exe.display());
    let status = status.unwrap_or_else(|| panic!("{} did not finish within {timeout:?}", exe.display()));
    assert!(
        launcher != VALGRIND || status.code() != Some(VALGRIND_ERROR_EXIT),
        "valgrind found memory errors or definite leaks in {} (see its stderr above)",
        exe.display()
    );
    assert!(status.success(), "{} failed: {status}", exe.display());
    assert!(
        stdout.lines().any(|l| l == success_line),
        "{} exited 0 without printing `{success_line}`",
        exe.display()
    );
    assert!(!stdout.contains("FAIL:"), "{} printed a FAIL line but exited 0", exe.display());
    for report in ["ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:"] {
        assert!(!stderr.contains(report), "{} exited 0 after a sanitizer report ({report})", exe.display());
    }
}

/// The recurrent-fixture arguments of the C and C++ examples: the fixture directories of `kinds`
/// (`("LSTM", "lstm_small")`, `("TREE", "treelstm_small")`, `("SEQ2SEQ", "seq2seq_small")`, in
/// that order), then a text file in `dir` with their requests and expected outputs in the format
/// at the top of ffi_examples/c/example.c, written from the fixtures' expected.json.
pub fn recurrent_fixture_args(dir: &Path, kinds: &[(&str, &str)]) -> Vec<OsString> {
    use std::fmt::Write as _;
    let testdata = manifest_dir().join("ffi_examples/testdata");
    let mut text = String::new();
    for &(label, name) in kinds {
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(testdata.join(name).join("expected.json")).unwrap(),
        )
        .unwrap();
        let reqs = json["requests"].as_array().unwrap();
        assert!(!reqs.is_empty(), "{name}/expected.json has no requests");
        writeln!(text, "{label} {}", reqs.len()).unwrap();
        for r in reqs {
            let list = |k: &str| -> Vec<String> {
                r[k].as_array().map(|a| a.iter().map(|v| v.to_string()).collect()).unwrap_or_default()
            };
            let tokens = list("tokens");
            write!(text, "{} {}", tokens.len(), tokens.join(" ")).unwrap();
            if label == "TREE" {
                write!(text, " {}", list("parents").join(" ")).unwrap();
            }
            let out: Vec<String> = if label == "SEQ2SEQ" {
                list("output_tokens")
            } else {
                // `{:?}` of the f32 reads back as exactly that f32.
                r["output"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| format!("{:?}", v.as_f64().unwrap() as f32))
                    .collect()
            };
            assert!(!out.is_empty(), "{name}/expected.json: a request without an output");
            writeln!(text, "  {} {}", out.len(), out.join(" ")).unwrap();
        }
    }
    let file = dir.join("recurrent.txt");
    std::fs::write(&file, text).unwrap();
    kinds
        .iter()
        .map(|(_, name)| testdata.join(name).into_os_string())
        .chain([file.into_os_string()])
        .collect()
}
