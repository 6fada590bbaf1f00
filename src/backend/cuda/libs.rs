//! Presence checks for the CUDA libraries cudarc opens at run time.
//!
//! cudarc (feature `dynamic-loading`) opens a library on the first call into it and **panics** when
//! no candidate name loads; it resolves each function on that function's first call and panics when
//! the symbol is missing. So before the first call into a library libserve checks here that the
//! library cudarc will open — the first loadable name of cudarc's own candidate list
//! ([`cudarc::get_lib_name_candidates`], tried in the same order) — exists and exports every
//! function this backend calls. A failed check is a [`Code::Unavailable`] error naming the library
//! and what was missing. Each check runs once per process; the opened library stays loaded.
//!
//! The lists below must name every function the CUDA layer calls through cudarc, directly or inside
//! cudarc's safe wrappers it uses (`CudaContext`, `CudaStream`, `CudaEvent`, `CudaModule`).

use std::ffi::c_void;
use std::sync::OnceLock;

use crate::error::{Code, Error, Result};

/// Driver API functions called by the CUDA layer (and by the cudarc wrappers it uses).
pub const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuGetErrorString",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceTotalMem_v2",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuCtxSynchronize",
    "cuMemGetInfo_v2",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemsetD8Async",
    "cuMemsetD32Async",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuLaunchKernel",
    // CUDA graphs of task bodies (graph.rs).
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
];

/// Driver functions used only by optional features, checked at their call
/// ([`Library::has`]): event timing needs a CUDA 12.8+ driver with the CUDA 13 bindings.
pub const DRIVER_EVENT_ELAPSED: &str = "cuEventElapsedTime_v2";

/// NVRTC functions called by the kernel compiler (`module.rs`).
pub const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcVersion",
    "nvrtcGetErrorString",
    "nvrtcGetNumSupportedArchs",
    "nvrtcGetSupportedArchs",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcDestroyProgram",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
];

/// cuBLAS functions called by [`super::blas::Blas`].
pub const CUBLAS_SYMBOLS: &[&str] =
    &["cublasCreate_v2", "cublasDestroy_v2", "cublasSetStream_v2", "cublasSetMathMode", "cublasSgemm_v2"];

/// A library that passed its check: the name it was opened by, kept loaded for the process.
#[derive(Debug)]
pub struct Library {
    what: &'static str,
    name: String,
    lib: libloading::Library,
}

impl Library {
    /// What the library is ("CUDA driver", "NVRTC", "cuBLAS").
    pub fn what(&self) -> &'static str {
        self.what
    }

    /// The file name it was opened by (the same one cudarc opens).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Whether the library exports `symbol`.
    pub fn has(&self, symbol: &str) -> bool {
        // SAFETY: the symbol is only looked up, never called or dereferenced; `*const c_void`
        // makes no claim about its type.
        unsafe { self.lib.get::<*const c_void>(symbol.as_bytes()) }.is_ok()
    }
}

/// The CUDA driver (`libcuda.so*`), checked once per process.
pub fn driver() -> Result<&'static Library> {
    static LIB: OnceLock<Result<Library>> = OnceLock::new();
    LIB.get_or_init(|| check("CUDA driver", &["cuda", "nvcuda"], DRIVER_SYMBOLS))
        .as_ref()
        .map_err(Clone::clone)
}

/// NVRTC (`libnvrtc.so*`, `libnvrtc.so.13` for CUDA 13), checked once per process.
pub fn nvrtc() -> Result<&'static Library> {
    static LIB: OnceLock<Result<Library>> = OnceLock::new();
    LIB.get_or_init(|| check("NVRTC", &["nvrtc"], NVRTC_SYMBOLS)).as_ref().map_err(Clone::clone)
}

/// cuBLAS (`libcublas.so*`, `libcublas.so.13` for CUDA 13), checked once per process.
pub fn cublas() -> Result<&'static Library> {
    static LIB: OnceLock<Result<Library>> = OnceLock::new();
    LIB.get_or_init(|| check("cuBLAS", &["cublas"], CUBLAS_SYMBOLS)).as_ref().map_err(Clone::clone)
}

/// The file names cudarc tries for library `stems` (e.g. `["nvrtc"]`), in cudarc's order.
pub fn candidates(stems: &[&str]) -> Vec<String> {
    stems.iter().flat_map(|s| cudarc::get_lib_name_candidates(s)).collect()
}

/// Check the library cudarc would open for `stems`: the first of [`candidates`] that loads must
/// export every one of `symbols`.
pub fn check(what: &'static str, stems: &[&str], symbols: &[&str]) -> Result<Library> {
    check_names(what, &candidates(stems), symbols)
}

/// [`check`] over an explicit list of file names, tried in order.
pub fn check_names(what: &'static str, names: &[String], symbols: &[&str]) -> Result<Library> {
    let mut failures = Vec::new();
    for name in names {
        // SAFETY: opening a shared library runs its ELF initialisers. These are the names cudarc
        // itself opens (NVIDIA's libraries); their initialisers have no preconditions.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => {
                let lib = Library { what, name: name.clone(), lib };
                let missing: Vec<&str> = symbols.iter().copied().filter(|s| !lib.has(s)).collect();
                if !missing.is_empty() {
                    return Err(Error::new(
                        Code::Unavailable,
                        format!(
                            "the {what} library {name} lacks {} (older than the CUDA 13 API this build \
                             uses, or not the real library)",
                            missing.join(", ")
                        ),
                    ));
                }
                return Ok(lib);
            }
            Err(e) => failures.push((name, e)),
        }
    }
    // A candidate that exists but fails to load (a missing dependency such as libcublasLt, a
    // wrong architecture) says more than the names that are simply absent.
    let broken: Vec<String> = failures
        .iter()
        .map(|(name, e)| (name, dl_message(e)))
        .filter(|(name, m)| !m.starts_with(&format!("{name}: cannot open shared object file")))
        .map(|(_, m)| m)
        .collect();
    let why = if broken.is_empty() { String::new() } else { format!(" ({})", broken.join("; ")) };
    let mut tried: Vec<&str> = Vec::new();
    for (name, _) in &failures {
        if !tried.contains(&name.as_str()) {
            tried.push(name); // cudarc's list repeats some names
        }
    }
    Err(Error::new(
        Code::Unavailable,
        format!(
            "no {what} library could be loaded{why}; tried {}. Install it or add its directory to \
             LD_LIBRARY_PATH",
            tried.join(", ")
        ),
    ))
}

/// The dynamic loader's own message (libloading's `Display` says only "dlopen failed").
fn dl_message(e: &libloading::Error) -> String {
    std::error::Error::source(e).map(|s| s.to_string()).unwrap_or_else(|| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn candidates_follow_cudarc_and_include_the_cuda13_sonames() {
        let names = candidates(&["nvrtc"]);
        assert_eq!(names, cudarc::get_lib_name_candidates("nvrtc"));
        assert!(names.iter().any(|n| n == "libnvrtc.so.13"), "{names:?}");
        assert!(candidates(&["cublas"]).iter().any(|n| n == "libcublas.so.13"));
        assert!(candidates(&["cuda", "nvcuda"]).iter().any(|n| n == "libcuda.so.1"));
    }

    #[test]
    fn missing_library_is_unavailable_and_names_what_was_tried() {
        let names = vec!["libserve-no-such-lib.so.13".to_string(), "libserve-no-such-lib.so".to_string()];
        let e = check_names("NVRTC", &names, NVRTC_SYMBOLS).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        let m = e.message();
        assert!(m.contains("no NVRTC library could be loaded"), "{m}");
        assert!(m.contains("libserve-no-such-lib.so.13, libserve-no-such-lib.so"), "{m}");
        assert!(m.contains("LD_LIBRARY_PATH"), "{m}");
    }

    #[test]
    fn missing_symbol_is_unavailable_and_names_the_symbol() {
        // libc is always loadable and certainly has no cuBLAS.
        let names = vec!["libc.so.6".to_string()];
        let e = check_names("cuBLAS", &names, &["malloc", "cublasSgemm_v2"]).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(e.message().contains("libc.so.6 lacks cublasSgemm_v2"), "{}", e.message());
        assert!(!e.message().contains("malloc"));
        let ok = check_names("libc", &names, &["malloc", "free"]).unwrap();
        assert_eq!(ok.name(), "libc.so.6");
        assert!(ok.has("free") && !ok.has("cuInit"));
    }
}
