//! Devices and their contexts; CUDA error mapping.
//!
//! A [`CudaDevice`] owns a retained primary context of one device (cudarc's `CudaContext`, released
//! when the last handle — the device or anything allocated from it — is dropped). Every call that
//! reaches the driver first binds that context to the calling thread, so devices, streams and
//! buffers can be used from any thread.

use std::fmt;
use std::sync::{Arc, Mutex};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys::{CUdevice_attribute, CUresult};
use cudarc::driver::{CudaContext, sys};

use super::blas::Blas;
use super::libs;
use super::memory::{DeviceBuffer, PinnedMapped, Pod};
use super::module::Module;
use super::signal::SignalCounters;
use super::stream::{Event, Stream};
use crate::error::{Code, Error, Result};

/// Turn a driver error from `call` (the CUDA function's name) into a libserve error.
///
/// Errors that mean "no usable device or driver here" are [`Code::Unavailable`]; everything else
/// is [`Code::Backend`]. The message names the call, the CUDA error and its description.
pub fn driver_error(call: &str, e: DriverError) -> Error {
    use CUresult::*;
    let code = match e.0 {
        CUDA_ERROR_NO_DEVICE
        | CUDA_ERROR_INVALID_DEVICE
        | CUDA_ERROR_STUB_LIBRARY
        | CUDA_ERROR_SYSTEM_DRIVER_MISMATCH
        | CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE
        | CUDA_ERROR_DEVICE_UNAVAILABLE
        | CUDA_ERROR_NOT_SUPPORTED
        | CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        | CUDA_ERROR_NO_BINARY_FOR_GPU => Code::Unavailable,
        _ => Code::Backend,
    };
    // cuGetErrorString is in the checked symbol list; a driver error implies the driver is loaded.
    let what = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    if what.is_empty() {
        Error::new(code, format!("{call} failed: {:?}", e.0))
    } else {
        Error::new(code, format!("{call} failed: {:?} ({what})", e.0))
    }
}

/// `r` with its driver error mapped by [`driver_error`].
pub(crate) fn check<T>(call: &str, r: std::result::Result<T, DriverError>) -> Result<T> {
    r.map_err(|e| driver_error(call, e))
}

/// What a device is, read without creating a context.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// (major, minor), e.g. (9, 0) for an H100 / H200.
    pub compute_capability: (u32, u32),
    /// Device memory in bytes.
    pub total_memory: u64,
    pub multiprocessors: u32,
    /// Host memory can be mapped into the device's address space (needed for the completion
    /// counters and zero-copy tables).
    pub can_map_host_memory: bool,
    /// Host and device share one virtual address space (UVA).
    pub unified_addressing: bool,
}

impl DeviceInfo {
    /// `sm_XY`, the architecture name kernels are compiled for.
    pub fn sm(&self) -> String {
        format!("sm_{}{}", self.compute_capability.0, self.compute_capability.1)
    }
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} ({}, {:.1} GiB, {} SMs)",
            self.ordinal,
            self.name,
            self.sm(),
            self.total_memory as f64 / (1u64 << 30) as f64,
            self.multiprocessors
        )
    }
}

/// Number of CUDA devices. `Unavailable` when the driver library is missing or incomplete.
pub fn device_count() -> Result<usize> {
    libs::driver()?;
    check("cuInit", cu::init())?;
    Ok(check("cuDeviceGetCount", cu::device::get_count())?.max(0) as usize)
}

/// The driver's CUDA version, e.g. 13000 for 13.0.
pub fn driver_version() -> Result<i32> {
    libs::driver()?;
    let mut v = 0;
    // SAFETY: `v` is a valid out-pointer for the call's duration; the symbol was checked.
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) }.result())?;
    Ok(v)
}

/// Describe device `ordinal` without creating a context (cheap: no device memory is used).
pub fn device_info(ordinal: usize) -> Result<DeviceInfo> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(Error::new(
            Code::Unavailable,
            format!("CUDA device {ordinal} does not exist ({count} device(s))"),
        ));
    }
    let dev = check("cuDeviceGet", cu::device::get(ordinal as i32))?;
    let attr = |a: CUdevice_attribute| -> Result<i32> {
        // SAFETY: `dev` is a device handle just returned by cuDeviceGet; attributes are plain
        // integer queries.
        check("cuDeviceGetAttribute", unsafe { cu::device::get_attribute(dev, a) })
    };
    use CUdevice_attribute::*;
    Ok(DeviceInfo {
        ordinal,
        name: check("cuDeviceGetName", cu::device::get_name(dev))?,
        compute_capability: (
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)? as u32,
            attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)? as u32,
        ),
        // SAFETY: as above; the call writes one size_t.
        total_memory: check("cuDeviceTotalMem", unsafe { cu::device::total_mem(dev) })? as u64,
        multiprocessors: attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32,
        can_map_host_memory: attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? != 0,
        unified_addressing: attr(CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0,
    })
}

/// One CUDA device with its (primary) context. Cheap to clone; the context lives as long as any
/// clone or anything allocated from it.
#[derive(Clone)]
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    info: Arc<DeviceInfo>,
    /// The crate's kernels, loaded at the first [`CudaDevice::kernels`] (shared by clones).
    kernels: Arc<Mutex<Option<Arc<Module>>>>,
}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaDevice").field("info", &self.info).finish()
    }
}

impl CudaDevice {
    /// Open device `ordinal`: retain its primary context. `Unavailable` with no driver, no such
    /// device, or a device that cannot map host memory (the completion counters need it).
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        let info = device_info(ordinal)?;
        if !info.can_map_host_memory || !info.unified_addressing {
            return Err(Error::new(
                Code::Unavailable,
                format!("CUDA device {info} cannot map host memory with unified addressing"),
            ));
        }
        let ctx = check("cuDevicePrimaryCtxRetain", CudaContext::new(ordinal))?;
        Ok(CudaDevice { ctx, info: Arc::new(info), kernels: Arc::default() })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    pub fn ordinal(&self) -> usize {
        self.info.ordinal
    }

    /// (free, total) device memory in bytes.
    pub fn memory(&self) -> Result<(u64, u64)> {
        let (free, total) = check("cuMemGetInfo", self.ctx.mem_get_info())?;
        Ok((free as u64, total as u64))
    }

    /// Wait for all work on all streams of the device's context.
    pub fn synchronize(&self) -> Result<()> {
        check("cuCtxSynchronize", self.ctx.synchronize())
    }

    /// A new stream (non-blocking: it does not synchronise with the legacy default stream).
    pub fn stream(&self) -> Result<Stream> {
        Stream::new(self)
    }

    /// A new event without timing (the cheap kind, for ordering and completion queries).
    pub fn event(&self) -> Result<Event> {
        Event::new(self, false)
    }

    /// A new event that records timestamps ([`Event::elapsed_ms`]).
    pub fn timing_event(&self) -> Result<Event> {
        Event::new(self, true)
    }

    /// `len` elements of device memory with unspecified contents (any bits are a valid `T`).
    pub fn alloc<T: Pod>(&self, len: usize) -> Result<DeviceBuffer<T>> {
        DeviceBuffer::alloc(self, len)
    }

    /// `len` zeroed elements of pinned, mapped host memory ([`PinnedMapped`]).
    pub fn pinned_mapped<T: Pod>(&self, len: usize) -> Result<PinnedMapped<T>> {
        PinnedMapped::new(self, len)
    }

    /// `n` zeroed completion counters in pinned mapped memory, one per stream.
    pub fn signal_counters(&self, n: usize) -> Result<Arc<SignalCounters>> {
        SignalCounters::new(self, n)
    }

    /// Compile CUDA C++ sources with NVRTC for this device and load them ([`Module::compile`]).
    pub fn compile_module(&self, files: &[(&str, &str)], options: &[&str]) -> Result<Module> {
        Module::compile(self, files, options)
    }

    /// The crate's own kernels ([`kernels::image`](super::kernels::image)) loaded into this device:
    /// the embedded fatbin, or — without one, or when the driver cannot use it for this device —
    /// the sources compiled with NVRTC. Loaded at the first call, then shared.
    pub fn kernels(&self) -> Result<Arc<Module>> {
        let mut slot = self.kernels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(m) = slot.as_ref() {
            return Ok(m.clone());
        }
        let m = Arc::new(super::module::load_kernels(self)?);
        *slot = Some(m.clone());
        Ok(m)
    }

    /// A cuBLAS handle issuing its work on `stream`.
    pub fn blas(&self, stream: &Stream) -> Result<Blas> {
        Blas::new(stream)
    }

    /// The cudarc context (for the layers built on this one).
    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Bind the context to the calling thread before a raw driver call.
    pub(crate) fn bind(&self) -> Result<()> {
        bind(&self.ctx)
    }
}

/// Make `ctx` current on this thread (cudarc's safe calls do this themselves; raw calls must).
///
/// Not through cudarc's `bind_to_thread`: that first returns (and clears) any error cudarc
/// recorded on the shared context from an earlier call on any thread — a buffer's drop, say —
/// which says nothing about the call at hand. Through it, such an error failed an unrelated
/// task, or made the poller's health check report a working stream failed (its tasks' requests
/// then completed, their state slots reused while its kernels still ran).
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    let current = check("cuCtxGetCurrent", cu::ctx::get_current())?;
    if current != Some(ctx.cu_ctx()) {
        // SAFETY: a live context (kept by `ctx`); the call only makes it current on this thread.
        check("cuCtxSetCurrent", unsafe { cu::ctx::set_current(ctx.cu_ctx()) })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_info_displays_arch_and_memory() {
        let d = DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            compute_capability: (9, 0),
            total_memory: 150_000_000_000,
            multiprocessors: 132,
            can_map_host_memory: true,
            unified_addressing: true,
        };
        assert_eq!(d.sm(), "sm_90");
        assert_eq!(d.to_string(), "0: NVIDIA H200 (sm_90, 139.7 GiB, 132 SMs)");
    }

    #[test]
    fn without_a_driver_the_device_queries_are_unavailable_not_panics() {
        if libs::driver().is_ok() {
            return; // a driver is present: covered by tests/cuda_layer.rs
        }
        for e in [device_count().unwrap_err(), device_info(0).unwrap_err(), CudaDevice::open(0).unwrap_err()]
        {
            assert_eq!(e.code(), Code::Unavailable);
            assert!(e.message().contains("CUDA driver"), "{}", e.message());
        }
    }
}
