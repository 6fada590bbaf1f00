//! The CUDA backend's layers (ARCHITECTURE.md §5), and CUDA presence detection.
//!
//! Nothing here is linked against CUDA: the driver, NVRTC and cuBLAS are opened at run time, so
//! libserve builds and runs on machines with no CUDA at all.
//!
//! **Dependency: [`cudarc`]** (driver, nvrtc, cublas; `dynamic-loading`; `cuda-13000`). It is the
//! maintained Rust binding of the CUDA driver API, NVRTC and cuBLAS that builds with no CUDA
//! toolkit or driver present (`cust` needs a full CUDA install to build), loads the libraries with
//! `dlopen` on first use, and brings RAII wrappers for contexts, streams, events and modules that
//! this layer reuses. Its one hazard is that it **panics** when a library or a function is missing,
//! so nothing here calls into it before [`libs`] has checked that the library it will open exists
//! and has every function used (an `Unavailable` error otherwise), and [`probe`] reaches it only
//! after that check.
//!
//! Layers, raw to safe:
//! * [`libs`] — library presence checks (driver, NVRTC, cuBLAS), once per process.
//! * [`driver`] — [`CudaDevice`] (a device's primary context and [`DeviceInfo`]), error mapping
//!   to [`Code::Backend`](crate::error::Code) / `Unavailable` naming the CUDA call.
//! * [`memory`] — [`DeviceBuffer`] and [`PinnedMapped`] (pinned, mapped, not write-combined host
//!   memory), both RAII.
//! * [`stream`] — [`Stream`] (one per worker), [`Event`], kernel launches.
//! * [`signal`] — [`SignalCounters`] / [`CudaSignal`], the completion counters the poller reads.
//! * [`module`] — [`Module`]: a fatbin loaded as is, or sources compiled with NVRTC for the
//!   device (cached per process); [`CudaDevice::kernels`] loads the crate's own kernels.
//! * [`blas`] — [`Blas`], a cuBLAS handle per stream for the LSTM GEMM.
//!
//! On top of them, the backend itself: [`CudaBackend`] (`backend.rs`) prepares models as CUDA
//! runners (`runner.rs`: staging, launch, signal, collect; `recurrent.rs`: lstm, seq2seq and
//! treelstm cell tasks; `mlp.rs`: dense layers; `resnet.rs`, `bert.rs`: the layer models), and
//! [`ring`]: elastic batching's input ring mirrored in device memory, one copy per request at
//! arrival; `graph.rs`: a fixed-shape task's layers replayed from a CUDA graph. [`step_bench`] is one LSTM layer step with its own buffers, for the step benchmarks.

pub mod abi;
pub mod kernels;

mod backend;
mod bert;
pub mod blas;
pub mod driver;
mod graph;
pub mod libs;
pub mod memory;
mod mlp;
pub mod module;
mod recurrent;
mod resnet;
pub mod ring;
mod runner;
pub mod signal;
pub mod step_bench;
pub mod stream;

pub use backend::CudaBackend;
pub use blas::Blas;
pub use driver::{CudaDevice, DeviceInfo};
pub use memory::{DeviceBuffer, PinnedMapped, Pod};
pub use module::{Function, Module};
pub use signal::{CounterLine, CudaSignal, SignalCounters};
pub use stream::{Event, LaunchConfig, Stream};

use std::ffi::c_int;

/// What the probe found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaProbe {
    /// The driver library could be opened.
    pub driver_loaded: bool,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: Option<i32>,
    /// `cuDeviceGetCount` after a successful `cuInit`.
    pub devices: usize,
    /// Why no device was found, when none was.
    pub reason: Option<String>,
    /// Each device, read through the CUDA layer ([`driver::device_info`]) once the driver passed
    /// its check ([`libs::driver`]); empty otherwise.
    pub device_info: Vec<DeviceInfo>,
    /// Why `device_info` is empty or incomplete although devices were counted.
    pub info_error: Option<String>,
}

impl CudaProbe {
    pub fn summary(&self) -> String {
        match (&self.reason, self.driver_version) {
            (Some(r), _) => r.clone(),
            (None, v) => {
                let mut s = match v {
                    Some(v) => {
                        format!("CUDA driver {}.{}, {} device(s)", v / 1000, (v % 1000) / 10, self.devices)
                    }
                    None => format!("{} device(s)", self.devices),
                };
                let devices: Vec<String> = self.device_info.iter().map(|d| d.to_string()).collect();
                if !devices.is_empty() {
                    s.push_str(": ");
                    s.push_str(&devices.join("; "));
                }
                if let Some(e) = &self.info_error {
                    s.push_str(&format!(" (details unavailable: {e})"));
                }
                s
            }
        }
    }
}

const DRIVER_LIBS: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Look for a CUDA driver and devices without requiring either. Never panics.
pub fn probe() -> CudaProbe {
    let mut p = probe_libs(&DRIVER_LIBS);
    if p.devices > 0 {
        // Details through the CUDA layer, only once the library cudarc opens passed its check.
        match libs::driver() {
            Ok(_) => {
                for ordinal in 0..p.devices {
                    match driver::device_info(ordinal) {
                        Ok(d) => p.device_info.push(d),
                        Err(e) => {
                            p.info_error = Some(e.message().to_string());
                            break;
                        }
                    }
                }
            }
            Err(e) => p.info_error = Some(e.message().to_string()),
        }
    }
    p
}

/// The probe's first step: open the first of `names` that loads and count devices with its own
/// `cuInit` / `cuDeviceGetCount` (no cudarc). Public for tests of the no-driver path.
pub fn probe_libs(names: &[&str]) -> CudaProbe {
    let mut p = CudaProbe {
        driver_loaded: false,
        driver_version: None,
        devices: 0,
        reason: None,
        device_info: Vec::new(),
        info_error: None,
    };
    // SAFETY: loading the NVIDIA driver library runs its initialisers, which have no preconditions.
    let lib = names.iter().find_map(|name| unsafe { libloading::Library::new(*name) }.ok());
    let Some(lib) = lib else {
        p.reason = Some(format!("no CUDA driver library ({}) found", names.join(", ")));
        return p;
    };
    p.driver_loaded = true;
    type InitFn = unsafe extern "C" fn(u32) -> c_int;
    type IntOutFn = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: this symbol, and the two below, have these C signatures in every CUDA driver API
    // version (cuda.h); the functions are only called while `lib` is loaded.
    let version = unsafe { lib.get::<IntOutFn>(b"cuDriverGetVersion\0") };
    if let Ok(version) = version {
        let mut v: c_int = 0;
        // SAFETY: a valid pointer to a local int.
        if unsafe { version(&mut v) } == 0 {
            p.driver_version = Some(v);
        }
    }
    // SAFETY: see above.
    let init = unsafe { lib.get::<InitFn>(b"cuInit\0") };
    // SAFETY: see above.
    let count = unsafe { lib.get::<IntOutFn>(b"cuDeviceGetCount\0") };
    let (Ok(init), Ok(count)) = (init, count) else {
        p.reason = Some("CUDA driver library lacks cuInit / cuDeviceGetCount".into());
        return p;
    };
    // SAFETY: cuInit(0) has no preconditions (0 is the only valid flag value).
    let rc = unsafe { init(0) };
    if rc != 0 {
        p.reason = Some(format!("cuInit failed with CUresult {rc}"));
        return p;
    }
    let mut n: c_int = 0;
    // SAFETY: a valid pointer to a local int, after a successful cuInit.
    let rc = unsafe { count(&mut n) };
    if rc != 0 {
        p.reason = Some(format!("cuDeviceGetCount failed with CUresult {rc}"));
        return p;
    }
    p.devices = n.max(0) as usize;
    if p.devices == 0 {
        p.reason = Some("CUDA driver present but no device".into());
    }
    p
}

#[cfg(test)]
mod tests {
    #[test]
    fn probe_never_panics_and_is_consistent() {
        let p = super::probe();
        if p.devices == 0 {
            assert!(p.reason.is_some());
        }
        if !p.driver_loaded {
            assert_eq!(p.devices, 0);
        }
        assert!(!p.summary().is_empty());
    }
}
