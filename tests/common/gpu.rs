//! Skipping the GPU tests. Without a CUDA device, or a library a GPU test needs, a test prints
//! `skipped: …` and passes, unless `SERVE_REQUIRE_GPU=1` makes that a failure; NVRTC needs no
//! GPU, and `SERVE_REQUIRE_NVRTC=1` makes its absence a failure on its own.

use std::io::Write;
use std::path::{Path, PathBuf};

use serve::backend::cuda::{self, CudaDevice, libs};

use super::native::env_flag;

/// Print why the test is skipped and return `None`; under `SERVE_REQUIRE_GPU=1`, fail instead.
/// The skip is also recorded for the run's summary line (`tests/zz_gpu_summary.rs`).
pub fn skip<T>(why: &str) -> Option<T> {
    if env_flag("SERVE_REQUIRE_GPU") {
        panic!("SERVE_REQUIRE_GPU=1 but {why}");
    }
    println!("skipped: {why}");
    record_skip(why);
    None
}

/// The file where the test binaries of one `cargo test` run record their GPU skips: named by
/// the parent process (cargo), which every test binary of the run shares.
pub fn skips_file() -> PathBuf {
    let run = std::os::unix::process::parent_id();
    Path::new(env!("CARGO_TARGET_TMPDIR")).join("gpu-skips").join(format!("{run}.txt"))
}

/// Append `binary<TAB>test<TAB>why` to [`skips_file`]: one short line in one `write` to a file
/// opened for appending, so that test threads and binaries never interleave their lines.
fn record_skip(why: &str) {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|s| s.rsplit_once('-').map_or(s.clone(), |(name, _hash)| name.to_string()))
        .unwrap_or_else(|| "?".into());
    let test = std::thread::current().name().unwrap_or("?").to_string();
    let line = format!("{binary}\t{test}\t{}\n", why.replace(['\t', '\n'], " "));
    let file = skips_file();
    let written = std::fs::create_dir_all(file.parent().expect("a parent"))
        .and_then(|()| std::fs::OpenOptions::new().create(true).append(true).open(&file))
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = written {
        println!("(could not record the skip in {}: {e})", file.display());
    }
}

/// Device 0, or `None` after printing why the test is skipped (no CUDA device).
pub fn device() -> Option<CudaDevice> {
    let probe = cuda::probe();
    if probe.devices == 0 {
        return skip(&format!("no CUDA device ({})", probe.summary()));
    }
    Some(CudaDevice::open(0).unwrap_or_else(|e| panic!("cannot open CUDA device 0: {e}")))
}

/// Whether NVRTC can be used. If not: a failure under `SERVE_REQUIRE_NVRTC=1` (and, for a test
/// that needs a GPU as well, under `SERVE_REQUIRE_GPU=1`); otherwise prints why and says no.
pub fn have_nvrtc(gpu_test: bool) -> bool {
    let Err(e) = libs::nvrtc() else { return true };
    let why = format!("no NVRTC library ({})", e.message());
    if env_flag("SERVE_REQUIRE_NVRTC") {
        panic!("SERVE_REQUIRE_NVRTC=1 but {why}");
    }
    if gpu_test {
        skip::<()>(&why);
    } else {
        println!("skipped: {why}");
    }
    false
}
