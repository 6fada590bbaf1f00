//! The C++ example (`ffi_examples/cpp/example.cpp`) is a real consumer of the header-only C++
//! wrapper `ffi_examples/cpp/serve.hpp`: this test compiles it, together with
//! `ffi_examples/cpp/include_twice.cpp` (a second translation unit including `libserve.h` and
//! `serve.hpp` twice each), with `-std=c++17 -Wall -Wextra -Werror -pthread`, links `libserve.a`
//! and its native libraries, and runs it on the committed fixtures `ffi_examples/testdata/mlp_4_8_3`
//! and `{lstm,treelstm,seq2seq}_small` (their requests and expected outputs rewritten from
//! expected.json into the text file example.cpp reads), requiring exit status 0 and its final
//! success line.
//!
//! Environment:
//! * `CXX` — the C++ compiler (default `c++`). A missing compiler fails the test unless
//!   `SERVE_SKIP_CPP=1`, which makes it print why and pass.
//! * `SERVE_CPP_SANITIZE=1` — build with `-fsanitize=address,undefined` and run with
//!   LeakSanitizer on and UBSan halting on error (CI does this too).
//! * `SERVE_CPP_FORCE_BUILD=1` — ignore the libraries cargo built for this test and build them
//!   with `cargo build --lib`.
//! * `SERVE_CPP_KEEP=1` — keep the scratch directory (executable, output) under `target/tmp`.

mod common;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use common::native::{self, CXX_COMPILER as CXX, NATIVE_STATIC_LIBS, SANITIZE_FLAGS, env_flag, manifest_dir};

const SUCCESS_LINE: &str = "example.cpp: all checks passed";
const CXXFLAGS: &[&str] = &["-Wall", "-Wextra", "-Werror", "-pthread"];
const SOURCES: &[&str] = &[
    "ffi_examples/cpp/example.cpp",
    "ffi_examples/cpp/example_recurrent.cpp",
    "ffi_examples/cpp/include_twice.cpp",
];
/// Generous: the example takes well under a second natively and seconds under ASan.
const RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// `$CXX -std=<std> <CXXFLAGS> -I include -I ffi_examples/cpp`.
fn cxx(std: &str) -> Command {
    let mut cmd = Command::new(CXX.program());
    cmd.arg(format!("-std={std}")).args(CXXFLAGS);
    for dir in ["include", "ffi_examples/cpp"] {
        cmd.arg("-I").arg(manifest_dir().join(dir));
    }
    cmd
}

/// The recurrent-model arguments: fixture directories and their expected outputs.
fn recurrent_args(dir: &Path) -> Vec<OsString> {
    native::recurrent_fixture_args(
        dir,
        &[("LSTM", "lstm_small"), ("TREE", "treelstm_small"), ("SEQ2SEQ", "seq2seq_small")],
    )
}

#[test]
fn cpp_example_static_library() {
    if !CXX.available() {
        return;
    }
    let libs = native::library_dir(env_flag("SERVE_CPP_FORCE_BUILD"));
    let sanitize = env_flag("SERVE_CPP_SANITIZE");
    let dir = native::scratch(if sanitize { "cpp_example-sanitized" } else { "cpp_example" });
    let exe = dir.join("example-cpp");

    let mut cmd = cxx("c++17");
    if sanitize {
        cmd.args(SANITIZE_FLAGS);
    }
    cmd.args(SOURCES.iter().map(|s| manifest_dir().join(s)));
    cmd.arg("-o").arg(&exe).arg(libs.join("libserve.a")).args(NATIVE_STATIC_LIBS);
    native::run_compiler(&mut cmd, "compiling the C++ example");

    let env = if sanitize { native::sanitizer_env() } else { Vec::new() };
    let fixture = manifest_dir().join("ffi_examples/testdata/mlp_4_8_3");
    let recurrent = recurrent_args(&dir);
    let mut args = vec![fixture.as_os_str()];
    args.extend(recurrent.iter().map(|a| a.as_os_str()));
    native::run_example(&[], &exe, &args, &env, &dir, SUCCESS_LINE, RUN_TIMEOUT);
    native::cleanup(&dir, env_flag("SERVE_CPP_KEEP"));
}

/// Write `files` (name, text) into a fresh scratch directory; returns it and the paths.
fn scratch_sources(label: &str, files: &[(&str, String)]) -> (PathBuf, Vec<PathBuf>) {
    let dir = native::scratch(label);
    let paths = files
        .iter()
        .map(|(name, text)| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        })
        .collect();
    (dir, paths)
}

/// The include guards hold on their own, in both orders, without linking anything.
#[test]
fn headers_compile_when_included_twice_in_either_order() {
    if !CXX.available() {
        return;
    }
    let files = [("c_first.cpp", "libserve.h", "serve.hpp"), ("cpp_first.cpp", "serve.hpp", "libserve.h")]
        .map(|(name, first, second)| {
            let text = format!(
                "#include \"{first}\"\n#include \"{second}\"\n#include \"{first}\"\n#include \"{second}\"\n\
                 #ifndef SERVE_VERSION_MAJOR\n#error \"version macros missing\"\n#endif\n\
                 int probe() {{ return static_cast<int>(serve::Code::SERVE_CODE_BUSY); }}\n"
            );
            (name, text)
        });
    let (dir, sources) = scratch_sources("cpp_include_order", &files);
    for src in &sources {
        let mut cmd = cxx("c++17");
        cmd.args(["-Wpedantic", "-fsyntax-only"]).arg(src);
        native::run_compiler(&mut cmd, &format!("compiling {}", src.display()));
    }
    native::cleanup(&dir, env_flag("SERVE_CPP_KEEP"));
}

/// serve.hpp refuses to compile as C++14 with a clear message, rather than with template noise.
#[test]
fn wrapper_requires_cpp17() {
    if !CXX.available() {
        return;
    }
    let (dir, sources) = scratch_sources("cpp14", &[("old.cpp", "#include \"serve.hpp\"\n".to_owned())]);
    let output = cxx("c++14").arg("-fsyntax-only").args(&sources).output().expect("run the C++ compiler");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "serve.hpp compiled as C++14");
    assert!(stderr.contains("serve.hpp needs C++17"), "unexpected C++14 diagnostics:\n{stderr}");
    native::cleanup(&dir, env_flag("SERVE_CPP_KEEP"));
}
