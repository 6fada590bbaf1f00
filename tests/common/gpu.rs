//! Skipping the GPU tests. Without a CUDA device, or a library a GPU test needs, a test prints
//! `skipped: …` and passes, unless `SERVE_REQUIRE_GPU=1` makes that a failure; NVRTC needs no
//! GPU, and `SERVE_REQUIRE_NVRTC=1` makes its absence a failure on its own.

use serve::backend::cuda::{self, CudaDevice, libs};

use super::native::env_flag;

/// Print why the test is skipped and return `None`; under `SERVE_REQUIRE_GPU=1`, fail instead.
pub fn skip<T>(why: &str) -> Option<T> {
    if env_flag("SERVE_REQUIRE_GPU") {
        panic!("SERVE_REQUIRE_GPU=1 but {why}");
    }
    println!("skipped: {why}");
    None
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
