//! CUDA presence detection.
//!
//! The driver library is opened at run time (never linked), so libserve builds and runs on
//! machines with no CUDA at all; nothing CUDA-related is touched before this probe has found the
//! library.

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
}

impl CudaProbe {
    pub fn summary(&self) -> String {
        match (&self.reason, self.driver_version) {
            (Some(r), _) => r.clone(),
            (None, Some(v)) => {
                format!("CUDA driver {}.{}, {} device(s)", v / 1000, (v % 1000) / 10, self.devices)
            }
            (None, None) => format!("{} device(s)", self.devices),
        }
    }
}

const DRIVER_LIBS: [&str; 2] = ["libcuda.so.1", "libcuda.so"];

/// Look for a CUDA driver and devices without requiring either.
pub fn probe() -> CudaProbe {
    let mut p = CudaProbe { driver_loaded: false, driver_version: None, devices: 0, reason: None };
    // SAFETY: loading the NVIDIA driver library runs its initialisers, which have no preconditions.
    let lib = DRIVER_LIBS.iter().find_map(|name| unsafe { libloading::Library::new(*name) }.ok());
    let Some(lib) = lib else {
        p.reason = Some("no CUDA driver library (libcuda.so.1) found".into());
        return p;
    };
    p.driver_loaded = true;
    type InitFn = unsafe extern "C" fn(u32) -> c_int;
    type IntOutFn = unsafe extern "C" fn(*mut c_int) -> c_int;
    // SAFETY: the symbols have these C signatures in every CUDA driver API version (cuda.h);
    // each call gets a valid pointer to a local int.
    unsafe {
        if let Ok(version) = lib.get::<IntOutFn>(b"cuDriverGetVersion\0") {
            let mut v: c_int = 0;
            if version(&mut v) == 0 {
                p.driver_version = Some(v);
            }
        }
        let (Ok(init), Ok(count)) =
            (lib.get::<InitFn>(b"cuInit\0"), lib.get::<IntOutFn>(b"cuDeviceGetCount\0"))
        else {
            p.reason = Some("CUDA driver library lacks cuInit / cuDeviceGetCount".into());
            return p;
        };
        let rc = init(0);
        if rc != 0 {
            p.reason = Some(format!("cuInit failed with CUresult {rc}"));
            return p;
        }
        let mut n: c_int = 0;
        let rc = count(&mut n);
        if rc != 0 {
            p.reason = Some(format!("cuDeviceGetCount failed with CUresult {rc}"));
            return p;
        }
        p.devices = n.max(0) as usize;
        if p.devices == 0 {
            p.reason = Some("CUDA driver present but no device".into());
        }
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
