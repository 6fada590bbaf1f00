//! Custom models through the C ABI (ARCHITECTURE.md §6, `serve_runtime_add_custom_model`): a C
//! engine (`ffi_examples/c/custom_model.c`) and a C++ engine (`ffi_examples/cpp/custom_model.cpp`)
//! registered with libserve, and a C server sharing the cores among tenant models
//! (`ffi_examples/c/tenants.c`, `serve_runtime_add_tenants`: an mlp directory and two C engines),
//! compiled with `-Wall -Wextra -Werror` against the committed header, linked against
//! `libserve.a` and run; each checks its outputs, failing batches or core leases, bad
//! registrations and the user data's lifetime itself and ends with its success line.
//!
//! `SERVE_C_SANITIZE=1` / `SERVE_CPP_SANITIZE=1` build them with AddressSanitizer + UBSan (as CI
//! does for the examples); a missing compiler fails the test unless `SERVE_SKIP_C=1` /
//! `SERVE_SKIP_CPP=1`.

mod common;

use std::ffi::OsString;
use std::process::Command;
use std::time::Duration;

use common::native::{
    self, C_COMPILER, C_FLAGS, CXX_COMPILER, NATIVE_STATIC_LIBS, SANITIZE_FLAGS, env_flag, manifest_dir,
};

const RUN_TIMEOUT: Duration = Duration::from_secs(600);

fn build_and_run(cxx: bool) {
    build_and_run_with(cxx, None, |_| Vec::new());
}

/// Build `source` (or the custom-model example of the language) and run it with the arguments
/// `args` makes in its scratch directory.
fn build_and_run_with(
    cxx: bool,
    c_source: Option<(&str, &str)>,
    args: impl FnOnce(&std::path::Path) -> Vec<OsString>,
) {
    let (tool, sanitize_env, source, flags, success): (_, _, _, &[&str], _) =
        if let Some((source, success)) = c_source {
            (&C_COMPILER, "SERVE_C_SANITIZE", source, C_FLAGS, success)
        } else if cxx {
            (
                &CXX_COMPILER,
                "SERVE_CPP_SANITIZE",
                "ffi_examples/cpp/custom_model.cpp",
                &["-std=c++17", "-Wall", "-Wextra", "-Werror", "-pthread"],
                "custom_model.cpp: all checks passed",
            )
        } else {
            (
                &C_COMPILER,
                "SERVE_C_SANITIZE",
                "ffi_examples/c/custom_model.c",
                C_FLAGS,
                "custom_model: all checks passed",
            )
        };
    if !tool.available() {
        return;
    }
    let libs = native::library_dir(env_flag("SERVE_C_FORCE_BUILD"));
    let sanitize = env_flag(sanitize_env);
    let name = std::path::Path::new(source).file_stem().unwrap().to_string_lossy().into_owned();
    let dir = native::scratch(&format!("{name}_{}", if cxx { "cpp" } else { "c" }));
    let exe = dir.join(&name);
    let mut cmd = Command::new(tool.program());
    cmd.args(flags);
    if sanitize {
        cmd.args(SANITIZE_FLAGS);
    }
    cmd.arg("-I")
        .arg(manifest_dir().join("include"))
        .arg("-I")
        .arg(manifest_dir().join("ffi_examples/c"))
        .arg(manifest_dir().join(source))
        .arg("-o")
        .arg(&exe)
        .arg(libs.join("libserve.a"))
        .args(NATIVE_STATIC_LIBS);
    native::run_compiler(&mut cmd, &format!("compiling {source}"));
    let env: Vec<(&str, OsString)> = if sanitize { native::sanitizer_env() } else { Vec::new() };
    let args = args(&dir);
    let args: Vec<&std::ffi::OsStr> = args.iter().map(|a| a.as_os_str()).collect();
    native::run_example(&[], &exe, &args, &env, &dir, success, RUN_TIMEOUT);
    native::cleanup(&dir, env_flag("SERVE_C_KEEP"));
}

#[test]
fn a_c_engine_runs_under_libserve_batching() {
    build_and_run(false);
}

#[test]
fn a_cpp_engine_runs_under_libserve_batching() {
    build_and_run(true);
}

#[test]
fn a_c_server_shares_the_cores_among_tenant_models() {
    build_and_run_with(false, Some(("ffi_examples/c/tenants.c", "tenants: all checks passed")), |dir| {
        let mlp = dir.join("mlp");
        serve::model::Mlp::random(&[16, 32, 24, 8], 7).save(&mlp).expect("save the mlp");
        vec![mlp.into_os_string()]
    });
}
