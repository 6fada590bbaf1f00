//! Build script. Never fails for lack of CUDA: nothing here needs a GPU or a CUDA toolkit.
//!
//! * Gives the shared library the SONAME `libserve.so.<major>`: the C ABI major version is the
//!   crate's major version (`SERVE_VERSION_MAJOR`).
//! * Compiles the hand-written kernels (`cuda/*.cu`, ARCHITECTURE.md §5) into one fatbin when nvcc is
//!   found: SASS for sm_80 and sm_90 plus compute_90 PTX (JIT-compiled by the driver on newer
//!   GPUs). The kernels are compiled as one translation unit (the same program NVRTC compiles at
//!   run time otherwise) and the fatbin is written to `OUT_DIR`; the crate embeds it with
//!   `include_bytes!` under `cfg(serve_fatbin)`, its path in the `SERVE_KERNELS_FATBIN` env var
//!   (src/backend/cuda/kernels.rs). No cudart is linked, nothing of CUDA is needed at run time
//!   beyond the driver. Without nvcc the crate embeds the sources instead, for NVRTC at first use.
//!
//! Where nvcc is looked for, first found wins:
//! 1. `NVCC`: the compiler's path. Set but not runnable: a warning, then the NVRTC fallback.
//! 2. `nvcc` on `PATH`.
//! 3. `CUDA_HOME/bin/nvcc`, `CUDA_PATH/bin/nvcc`, `/usr/local/cuda/bin/nvcc`.
//! 4. NVIDIA's pip wheels (`nvidia-cuda-nvcc` and friends, ARCHITECTURE.md §5), which put nvcc at
//!    `site-packages/nvidia/cu13/bin/nvcc`: looked for only in the active virtual environment
//!    (`VIRTUAL_ENV/lib/python3.*/site-packages`), a cheap directory listing — python itself is
//!    never run.
//!
//! nvcc runs with its own `nvcc.profile` (the wheels' profile finds cicc, libdevice, the CUDA
//! headers and the CCCL headers of `nvidia-cuda-cccl`), gcc / `NVCC_CCBIN` as host compiler, and
//! any extra flags in `SERVE_NVCC_FLAGS` (whitespace-separated). A compile error in our kernels
//! fails the build with nvcc's output; only a missing nvcc falls back. `SERVE_REQUIRE_NVCC=1`
//! makes a missing nvcc an error too (CI sets it, so every CI run proves the kernels compile for
//! sm_80 and sm_90).

use std::env;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernel sources, in the order they are compiled (one translation unit).
const KERNELS: [&str; 5] = ["signal.cu", "embedding.cu", "lstm.cu", "dense.cu", "layers.cu"];

/// Targets of the fatbin: SASS for A100-class (sm_80; also runs on sm_86 / sm_89) and H100-class
/// (sm_90) GPUs, and compute_90 PTX for anything newer.
const GENCODE: [&str; 3] =
    ["arch=compute_80,code=sm_80", "arch=compute_90,code=sm_90", "arch=compute_90,code=compute_90"];

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let target_os = env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let major = env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
    if target_os == "linux" {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libserve.so.{major}");
    }
    kernels();
}

fn kernels() {
    println!("cargo::rustc-check-cfg=cfg(serve_fatbin)");
    println!("cargo:rerun-if-changed=cuda");
    for var in [
        "NVCC",
        "NVCC_CCBIN",
        "SERVE_NVCC_FLAGS",
        "SERVE_REQUIRE_NVCC",
        "PATH",
        "CUDA_HOME",
        "CUDA_PATH",
        "VIRTUAL_ENV",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let require = env::var("SERVE_REQUIRE_NVCC").is_ok_and(|v| v == "1");
    let Some(nvcc) = find_nvcc() else {
        if require {
            panic!(
                "SERVE_REQUIRE_NVCC=1 but no nvcc was found (NVCC, PATH, CUDA_HOME, CUDA_PATH, \
                 /usr/local/cuda, VIRTUAL_ENV's nvidia-cuda-nvcc wheel)"
            );
        }
        // The sources are embedded unconditionally (kernels.rs); NVRTC compiles them at first use.
        return;
    };
    let root = PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let cuda = root.join("cuda");
    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    // One translation unit, as kernels::nvrtc_program builds it for NVRTC.
    let unit = out.join("serve_kernels.cu");
    let text: String = KERNELS.iter().map(|k| format!("#include \"{k}\"\n")).collect();
    fs::write(&unit, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", unit.display()));
    let fatbin = out.join("serve_kernels.fatbin");
    let mut cmd = Command::new(&nvcc);
    cmd.arg("--fatbin").args(["-std=c++17", "-Xptxas=-warn-spills"]);
    for g in GENCODE {
        cmd.arg("-gencode").arg(g);
    }
    cmd.arg("-I").arg(&cuda).arg("-o").arg(&fatbin).arg(&unit);
    if let Ok(flags) = env::var("SERVE_NVCC_FLAGS") {
        cmd.args(flags.split_whitespace());
    }
    let shown = format!("{cmd:?}");
    let output = cmd.output().unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let log =
        format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    if !output.status.success() {
        panic!("nvcc failed to compile the CUDA kernels ({}):\n{shown}\n{log}", output.status);
    }
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        println!("cargo:warning=nvcc: {line}");
    }
    let size = fs::metadata(&fatbin).map(|m| m.len()).unwrap_or(0);
    if size == 0 {
        panic!("nvcc succeeded but wrote no fatbin at {}:\n{shown}", fatbin.display());
    }
    println!("cargo:rustc-env=SERVE_KERNELS_FATBIN={}", fatbin.display());
    println!("cargo:rustc-cfg=serve_fatbin");
}

/// `path` if it names a file that `--version` runs.
fn runnable(path: &Path) -> bool {
    path.is_file() && Command::new(path).arg("--version").output().is_ok_and(|o| o.status.success())
}

fn find_nvcc() -> Option<PathBuf> {
    if let Some(nvcc) = env::var_os("NVCC").filter(|v| !v.is_empty()) {
        let nvcc = PathBuf::from(nvcc);
        // A bare name is looked up on PATH.
        let found =
            if nvcc.components().count() == 1 { on_path(nvcc.as_os_str()) } else { Some(nvcc.clone()) };
        match found.filter(|p| runnable(p)) {
            Some(p) => return Some(p),
            None => {
                println!(
                    "cargo:warning=NVCC={} is not a runnable nvcc: the CUDA kernels are embedded as \
                     sources for NVRTC instead",
                    nvcc.display()
                );
                return None;
            }
        }
    }
    if let Some(p) = on_path("nvcc".as_ref()).filter(|p| runnable(p)) {
        return Some(p);
    }
    let homes = ["CUDA_HOME", "CUDA_PATH"].into_iter().filter_map(env::var_os).map(PathBuf::from);
    for home in homes.chain([PathBuf::from("/usr/local/cuda")]) {
        let p = home.join("bin").join("nvcc");
        if runnable(&p) {
            return Some(p);
        }
    }
    wheel_nvcc()
}

fn on_path(name: &std::ffi::OsStr) -> Option<PathBuf> {
    let path: OsString = env::var_os("PATH")?;
    env::split_paths(&path).map(|dir| dir.join(name)).find(|p| p.is_file())
}

/// nvcc of the `nvidia-cuda-nvcc` wheel in the active virtual environment.
fn wheel_nvcc() -> Option<PathBuf> {
    let lib = PathBuf::from(env::var_os("VIRTUAL_ENV")?).join("lib");
    let mut pythons: Vec<PathBuf> = fs::read_dir(&lib)
        .ok()?
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .map(|e| e.path())
        .collect();
    pythons.sort();
    pythons.into_iter().rev().map(|p| p.join("site-packages/nvidia/cu13/bin/nvcc")).find(|p| runnable(p))
}
