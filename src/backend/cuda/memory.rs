//! Device memory and pinned, mapped host memory, both RAII.
//!
//! Host code never holds a Rust reference into memory the device may write: device memory is only
//! reached through copies on a [`Stream`](super::stream::Stream), and pinned mapped memory through
//! raw-pointer copies ([`PinnedMapped::write`], [`PinnedMapped::read`]) or atomics
//! ([`SignalCounters`](super::signal::SignalCounters)).
//!
//! Freeing waits for the context to go idle (`cuCtxSynchronize`) first, so work still queued on any
//! stream can never touch freed memory. Buffers are allocated when a model is prepared and freed
//! when it is dropped, so the wait costs nothing in steady state.

use std::marker::PhantomData;
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::{CudaContext, sys};

use super::driver::{CudaDevice, bind, check};
use crate::error::{Error, Result};

/// Plain data that can be copied byte for byte between host and device memory.
///
/// # Safety
/// Implementors must have no padding bytes (copies read every byte), hold no references or host
/// pointers, and every bit pattern must be a valid value (device memory is whatever the device
/// wrote, or never initialised).
pub unsafe trait Pod: Copy + Send + Sync + 'static {}

// SAFETY: primitive numbers: no padding, every bit pattern valid.
unsafe impl Pod for u8 {}
// SAFETY: as above.
unsafe impl Pod for i8 {}
// SAFETY: as above.
unsafe impl Pod for u16 {}
// SAFETY: as above.
unsafe impl Pod for i16 {}
// SAFETY: as above.
unsafe impl Pod for u32 {}
// SAFETY: as above.
unsafe impl Pod for i32 {}
// SAFETY: as above.
unsafe impl Pod for u64 {}
// SAFETY: as above.
unsafe impl Pod for i64 {}
// SAFETY: as above.
unsafe impl Pod for f32 {}
// SAFETY: as above.
unsafe impl Pod for f64 {}
// SAFETY: an array of Pod has no padding between elements (size is a multiple of alignment).
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

/// `len` elements of `T` in bytes, or an error when that overflows.
fn byte_len<T>(len: usize) -> Result<usize> {
    len.checked_mul(size_of::<T>())
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| Error::invalid(format!("{len} elements of {} bytes overflow", size_of::<T>())))
}

/// `Vec<T>` in device memory. Not tied to a stream: copies and kernels name the stream they run
/// on; ordering between streams is the caller's (events).
pub struct DeviceBuffer<T: Pod> {
    ptr: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
    _t: PhantomData<T>,
}

impl<T: Pod> std::fmt::Debug for DeviceBuffer<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DeviceBuffer<{}>[{}] @ {:#x}", std::any::type_name::<T>(), self.len, self.ptr)
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// `len` elements with unspecified contents (`cuMemAlloc`).
    pub fn alloc(device: &CudaDevice, len: usize) -> Result<DeviceBuffer<T>> {
        Self::alloc_in(device.context(), len)
    }

    pub(crate) fn alloc_in(ctx: &Arc<CudaContext>, len: usize) -> Result<DeviceBuffer<T>> {
        let bytes = byte_len::<T>(len)?;
        bind(ctx)?;
        let ptr = if bytes == 0 {
            0 // cuMemAlloc rejects 0 bytes; an empty buffer owns nothing.
        } else {
            // SAFETY: the device's context is current (bind above); the driver returns a fresh
            // allocation of `bytes` bytes, freed exactly once in Drop.
            check("cuMemAlloc", unsafe { cu::malloc_sync(bytes) })?
        };
        Ok(DeviceBuffer { ptr, len, ctx: ctx.clone(), _t: PhantomData })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * size_of::<T>()
    }

    /// The device address, for kernel parameters. Using it is up to an `unsafe` launch, whose
    /// contract requires the buffer to outlive the kernel.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device address of element `i` (`i <= len`).
    pub fn device_ptr_at(&self, i: usize) -> u64 {
        assert!(i <= self.len, "element {i} of a buffer of {}", self.len);
        self.ptr + (i * size_of::<T>()) as u64
    }

    pub(crate) fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr == 0 {
            return;
        }
        // Errors cannot be returned from drop; cudarc records them on the context and the next
        // call on it reports them.
        self.ctx.record_err(self.ctx.bind_to_thread());
        // Wait for queued work that may still use the memory (see the module doc).
        self.ctx.record_err(cu::ctx::synchronize());
        // SAFETY: `ptr` came from cuMemAlloc in this context, is freed only here, and no queued
        // work can use it any more (synchronised above).
        self.ctx.record_err(unsafe { cu::free_sync(self.ptr) });
    }
}

/// Pinned host memory mapped into the device's address space: `cuMemHostAlloc(DEVICEMAP |
/// PORTABLE)`, deliberately **not** write-combined, since the host reads it (completion counters,
/// error flags); write-combined memory is uncached for host reads.
///
/// Kernels reach it through [`device_ptr`](Self::device_ptr) (`cuMemHostGetDevicePointer`) with no
/// copy: completion counters written by the signal kernel, embedding tables read in place
/// (zero-copy). The allocation is page-aligned, so element 0 is aligned for any `T` up to 4 KiB.
pub struct PinnedMapped<T: Pod> {
    host: NonNull<T>,
    dev: sys::CUdeviceptr,
    len: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the allocation is owned by this value alone (like a Box<[T]>); it is pinned host memory,
// valid on any thread, and freed in Drop with the owning context bound to the dropping thread.
unsafe impl<T: Pod> Send for PinnedMapped<T> {}
// SAFETY: `&self` methods only copy out of the memory through raw pointers or hand out addresses;
// concurrent copies out are reads and cannot conflict. Writes need `&mut self`.
unsafe impl<T: Pod> Sync for PinnedMapped<T> {}

impl<T: Pod> std::fmt::Debug for PinnedMapped<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PinnedMapped<{}>[{}] host {:p} device {:#x}",
            std::any::type_name::<T>(),
            self.len,
            self.host,
            self.dev
        )
    }
}

impl<T: Pod> PinnedMapped<T> {
    /// `len` zeroed elements.
    pub fn new(device: &CudaDevice, len: usize) -> Result<PinnedMapped<T>> {
        let bytes = byte_len::<T>(len)?;
        let ctx = device.context().clone();
        if bytes == 0 {
            return Ok(PinnedMapped { host: NonNull::dangling(), dev: 0, len, ctx });
        }
        device.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: the context is current; the driver returns `bytes` bytes of fresh pinned memory
        // (or an error), owned by the value built below and freed exactly once in its Drop.
        let raw = check("cuMemHostAlloc", unsafe { cu::malloc_host(bytes, flags) })?;
        let Some(host) = NonNull::new(raw.cast::<T>()) else {
            return Err(Error::internal("cuMemHostAlloc returned a null pointer"));
        };
        // From here on the allocation is owned (and freed on the error paths by Drop).
        let mut mem = PinnedMapped { host, dev: 0, len, ctx };
        if !host.as_ptr().is_aligned() {
            return Err(Error::internal(format!(
                "cuMemHostAlloc returned {host:p}, not aligned for {}",
                std::any::type_name::<T>()
            )));
        }
        // SAFETY: `host` points to `bytes` writable bytes that nothing else references yet;
        // all-zero bytes are a valid `T` (Pod).
        unsafe { std::ptr::write_bytes(host.as_ptr().cast::<u8>(), 0, bytes) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: `raw` is the start of a DEVICEMAP allocation of this context (current); `dev`
        // is a valid out-pointer; flags must be 0.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, raw, 0) }.result();
        check("cuMemHostGetDevicePointer", r)?;
        mem.dev = dev;
        Ok(mem)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The address kernels use for element 0. Using it is up to an `unsafe` launch, whose
    /// contract requires the memory to outlive the kernel and host access not to race with it.
    pub fn device_ptr(&self) -> u64 {
        self.dev
    }

    /// The host address of element 0, for atomics and other raw access by the layers above.
    pub fn host_ptr(&self) -> *mut T {
        self.host.as_ptr()
    }

    /// Copy `src` to elements `offset..offset + src.len()`.
    ///
    /// Host writes do not order themselves against device work: write before launching the
    /// kernels that read the range (launch contracts require it).
    pub fn write(&mut self, offset: usize, src: &[T]) -> Result<()> {
        self.check_range(offset, src.len())?;
        // SAFETY: `offset + src.len() <= len` (checked): in bounds of the allocation.
        let dst = unsafe { self.host.as_ptr().add(offset) };
        // SAFETY: `src.len()` elements from `dst` are inside the allocation (checked); `&mut self`
        // excludes every other host access; `src` is a distinct host slice, so no overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        Ok(())
    }

    /// Copy elements `offset..offset + dst.len()` out to `dst`.
    pub fn read(&self, offset: usize, dst: &mut [T]) -> Result<()> {
        self.check_range(offset, dst.len())?;
        // SAFETY: `offset + dst.len() <= len` (checked): in bounds of the allocation.
        let src = unsafe { self.host.as_ptr().add(offset) };
        // SAFETY: `dst.len()` elements from `src` are inside the allocation (checked) and
        // initialised (zeroed at allocation; any bits are a valid T); `dst` is a distinct,
        // exclusively borrowed slice.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// The whole contents, copied out.
    pub fn to_vec(&self) -> Vec<T> {
        let mut v = Vec::with_capacity(self.len);
        // SAFETY: as in `read`, for all `len` elements, into `v`'s spare capacity of `len`.
        unsafe { std::ptr::copy_nonoverlapping(self.host.as_ptr(), v.as_mut_ptr(), self.len) };
        // SAFETY: the copy above initialised all `len` elements.
        unsafe { v.set_len(self.len) };
        v
    }

    fn check_range(&self, offset: usize, n: usize) -> Result<()> {
        match offset.checked_add(n) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::invalid(format!(
                "elements {offset}..{offset}+{n} are outside a pinned buffer of {}",
                self.len
            ))),
        }
    }
}

impl<T: Pod> Drop for PinnedMapped<T> {
    fn drop(&mut self) {
        if self.len == 0 || size_of::<T>() == 0 {
            return;
        }
        self.ctx.record_err(self.ctx.bind_to_thread());
        // Kernels may still read or write the memory through its device address.
        self.ctx.record_err(cu::ctx::synchronize());
        // SAFETY: `host` came from cuMemHostAlloc, is freed only here, and no queued work can
        // use it any more (synchronised above).
        self.ctx.record_err(unsafe { cu::free_host(self.host.as_ptr().cast()) });
    }
}
