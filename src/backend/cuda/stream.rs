//! Streams (one per worker) and events.
//!
//! A [`Stream`] is an ordered queue of device work, like the CPU backend's `CpuStream`. Copies that
//! read or write host memory the caller keeps borrowing are blocking ([`Stream::upload_into`],
//! [`Stream::download_into`]): they return once the copy — and everything queued before it — is
//! done. Their asynchronous forms are `unsafe`, because the host memory must outlive a copy the
//! borrow checker cannot see. Device-only work (zeroing, device-to-device copies) is asynchronous
//! and safe: buffers wait for the device before they are freed.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys::{self, CUevent_flags};
use cudarc::driver::{CudaEvent, CudaStream};

use super::driver::{CudaDevice, bind, check, driver_error};
use super::libs;
use super::memory::{DeviceBuffer, Pod};
use super::module::Function;
use crate::error::{Code, Error, Result};

/// A CUDA stream. Cheap to clone (clones name the same stream); usable from any thread.
#[derive(Clone, Debug)]
pub struct Stream {
    inner: Arc<CudaStream>,
}

/// Grid and block shape of a kernel launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, in bytes.
    pub shared_mem_bytes: u32,
}

impl LaunchConfig {
    /// A 1-D launch of `blocks` blocks of `threads` threads, no dynamic shared memory.
    pub fn linear(blocks: u32, threads: u32) -> LaunchConfig {
        LaunchConfig { grid: (blocks, 1, 1), block: (threads, 1, 1), shared_mem_bytes: 0 }
    }
}

impl Stream {
    /// A new non-blocking stream on `device` (no implicit ordering with the legacy default stream).
    pub fn new(device: &CudaDevice) -> Result<Stream> {
        Ok(Stream { inner: check("cuStreamCreate", device.context().new_stream())? })
    }

    /// The raw handle (for cuBLAS and launches by the layers above). Do not destroy it.
    pub fn raw(&self) -> sys::CUstream {
        self.inner.cu_stream()
    }

    pub(crate) fn cudarc(&self) -> &Arc<CudaStream> {
        &self.inner
    }

    fn bind(&self) -> Result<()> {
        bind(self.inner.context())
    }

    /// `dst` belongs to this stream's context.
    fn same_context<T: Pod>(&self, what: &str, buf: &DeviceBuffer<T>) -> Result<()> {
        if **buf.context() == **self.inner.context() {
            Ok(())
        } else {
            Err(Error::invalid(format!("{what} buffer belongs to another CUDA context than the stream")))
        }
    }

    /// Block until everything queued so far has finished.
    pub fn synchronize(&self) -> Result<()> {
        check("cuStreamSynchronize", self.inner.synchronize())
    }

    /// Make later work on this stream wait until `event`'s recorded work is done (device-side).
    pub fn wait(&self, event: &Event) -> Result<()> {
        check("cuStreamWaitEvent", self.inner.wait(&event.inner))
    }

    /// Record `event` at the current end of this stream.
    pub fn record(&self, event: &Event) -> Result<()> {
        event.record(self)
    }

    /// A new device buffer holding `src`. Blocking.
    pub fn upload<T: Pod>(&self, src: &[T]) -> Result<DeviceBuffer<T>> {
        let mut buf = DeviceBuffer::alloc_in(self.inner.context(), src.len())?;
        self.upload_into(&mut buf, 0, src)?;
        Ok(buf)
    }

    /// Copy `src` into `dst[offset..]`, after the work queued before it. Blocking: returns when
    /// the copy is done.
    pub fn upload_into<T: Pod>(&self, dst: &mut DeviceBuffer<T>, offset: usize, src: &[T]) -> Result<()> {
        // SAFETY: `src` stays borrowed until the stream is synchronised below, i.e. until the copy
        // has finished reading it.
        unsafe { self.upload_into_async(dst, offset, src) }?;
        self.synchronize()
    }

    /// Queue a copy of `src` into `dst[offset..]` and return at once.
    ///
    /// # Safety
    /// `src` must stay valid and unmodified until the copy has run (synchronise the stream, or an
    /// event recorded after it). From pageable memory the driver stages `src` before returning,
    /// but from pinned memory the copy reads it later.
    pub unsafe fn upload_into_async<T: Pod>(
        &self,
        dst: &mut DeviceBuffer<T>,
        offset: usize,
        src: &[T],
    ) -> Result<()> {
        self.same_context("destination", dst)?;
        check_range("destination", offset, src.len(), dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the destination range lies inside `dst` (checked) in this stream's context
        // (checked, bound); the caller keeps `src` alive until the copy has run.
        let r = unsafe { cu::memcpy_htod_async(dst.device_ptr_at(offset), src, self.raw()) };
        check("cuMemcpyHtoDAsync", r)
    }

    /// The contents of `src`, copied to the host after the work queued before. Blocking.
    pub fn download<T: Pod>(&self, src: &DeviceBuffer<T>) -> Result<Vec<T>> {
        // SAFETY: all-zero bytes are a valid T (Pod).
        let mut v = vec![unsafe { std::mem::zeroed::<T>() }; src.len()];
        self.download_into(src, 0, &mut v)?;
        Ok(v)
    }

    /// Copy `src[offset..offset + dst.len()]` into `dst`, after the work queued before. Blocking.
    pub fn download_into<T: Pod>(&self, src: &DeviceBuffer<T>, offset: usize, dst: &mut [T]) -> Result<()> {
        // SAFETY: `dst` stays exclusively borrowed until the stream is synchronised below, i.e.
        // until the copy has finished writing it.
        unsafe { self.download_into_async(src, offset, dst) }?;
        self.synchronize()
    }

    /// Queue a copy of `src[offset..offset + dst.len()]` into `dst` and return at once.
    ///
    /// # Safety
    /// `dst` must stay valid, and be neither read nor written by the host, until the copy has run
    /// (synchronise the stream, or an event recorded after it).
    pub unsafe fn download_into_async<T: Pod>(
        &self,
        src: &DeviceBuffer<T>,
        offset: usize,
        dst: &mut [T],
    ) -> Result<()> {
        self.same_context("source", src)?;
        check_range("source", offset, dst.len(), src.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the source range lies inside `src` (checked) in this stream's context (checked,
        // bound); the caller keeps `dst` alive and untouched until the copy has run.
        let r = unsafe { cu::memcpy_dtoh_async(dst, src.device_ptr_at(offset), self.raw()) };
        check("cuMemcpyDtoHAsync", r)
    }

    /// Queue zeroing all of `dst`.
    pub fn zero<T: Pod>(&self, dst: &mut DeviceBuffer<T>) -> Result<()> {
        self.same_context("destination", dst)?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the whole allocation of `dst`, in this stream's context (checked, bound); all-zero
        // bytes are a valid T; the buffer is not freed before queued work ends (its Drop waits).
        let r = unsafe { cu::memset_d8_async(dst.device_ptr(), 0, dst.bytes(), self.raw()) };
        check("cuMemsetD8Async", r)
    }

    /// Queue a copy of `src[src_offset..src_offset + n]` to `dst[dst_offset..]`.
    pub fn copy<T: Pod>(
        &self,
        src: &DeviceBuffer<T>,
        src_offset: usize,
        dst: &mut DeviceBuffer<T>,
        dst_offset: usize,
        n: usize,
    ) -> Result<()> {
        self.same_context("source", src)?;
        self.same_context("destination", dst)?;
        check_range("source", src_offset, n, src.len())?;
        check_range("destination", dst_offset, n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: both ranges lie inside their buffers (checked), which are distinct allocations
        // (`&` and `&mut` cannot alias) of this context; neither is freed before the copy ends.
        let r = unsafe {
            cu::memcpy_dtod_async(
                dst.device_ptr_at(dst_offset),
                src.device_ptr_at(src_offset),
                n * size_of::<T>(),
                self.raw(),
            )
        };
        check("cuMemcpyDtoDAsync", r)
    }

    /// Queue a copy of the `n` elements at device address `src` into `dst[..n]`.
    ///
    /// # Safety
    /// `src` must be the address of `n` elements of `T` in memory of this stream's context that
    /// stays allocated, and is not written, until the copy has run.
    pub unsafe fn copy_from_address<T: Pod>(
        &self,
        src: u64,
        dst: &mut DeviceBuffer<T>,
        n: usize,
    ) -> Result<()> {
        self.same_context("destination", dst)?;
        check_range("destination", 0, n, dst.len())?;
        if n == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the destination range lies inside `dst` (checked) of this context (checked,
        // bound); the caller guarantees the source range.
        let r = unsafe { cu::memcpy_dtod_async(dst.device_ptr(), src, n * size_of::<T>(), self.raw()) };
        check("cuMemcpyDtoDAsync", r)
    }

    /// Queue setting `count` 32-bit words at device address `dst` to `value` (`cuMemsetD32Async`).
    ///
    /// # Safety
    /// `dst` must be 4-byte aligned and `count` words from it must be memory of this stream's
    /// context (device memory, or mapped host memory by its device address) that stays allocated
    /// until the memset has run, and no host code may access it meanwhile.
    pub unsafe fn memset_d32(&self, dst: u64, value: u32, count: usize) -> Result<()> {
        self.bind()?;
        // SAFETY: the caller guarantees the range; the context is bound.
        let r = unsafe { sys::cuMemsetD32Async(dst, value, count, self.raw()) }.result();
        check("cuMemsetD32Async", r)
    }

    /// Launch `function` with raw kernel arguments (`cuLaunchKernel`): `args[i]` points to the
    /// value of the kernel's i-th parameter. The values are copied at launch; the pointers need
    /// not outlive this call.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list exactly (count, order, and each pointee's
    /// type and size). Every address the kernel uses must stay valid until it has finished, and
    /// host code must not access memory the kernel writes until then (or memory it reads, for
    /// host writes) — order such access through this stream or an event.
    pub unsafe fn launch(
        &self,
        function: &Function,
        cfg: LaunchConfig,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        if **function.context() != **self.inner.context() {
            return Err(Error::invalid(format!(
                "kernel {} was loaded in another CUDA context than the stream",
                function.name()
            )));
        }
        self.bind()?;
        let (g, b) = (cfg.grid, cfg.block);
        // SAFETY: the function belongs to this context (checked, bound); the caller guarantees
        // the arguments and the lifetime of everything the kernel touches.
        let r = unsafe {
            sys::cuLaunchKernel(
                function.raw(),
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                cfg.shared_mem_bytes,
                self.raw(),
                args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result();
        // The call's name is formatted only on failure: this runs for every kernel launch.
        r.map_err(|e| driver_error(&format!("cuLaunchKernel({})", function.name()), e))
    }

    /// Launch a kernel whose single parameter is a launch-parameter struct passed by value (the
    /// convention of `cuda/serve_kernels.h`).
    ///
    /// # Safety
    /// As [`launch`](Self::launch): the kernel's only parameter must be a `P` with the same layout
    /// (the bindgen mirror in `abi.rs`), and every address inside it must stay valid until the
    /// kernel has finished.
    pub unsafe fn launch_with<P: Copy>(
        &self,
        function: &Function,
        cfg: LaunchConfig,
        params: &P,
    ) -> Result<()> {
        let mut args = [(params as *const P).cast_mut().cast::<c_void>()];
        // SAFETY: forwarded contract; the driver only reads `*params`, during this call.
        unsafe { self.launch(function, cfg, &mut args) }
    }
}

fn check_range(what: &str, offset: usize, n: usize, len: usize) -> Result<()> {
    match offset.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::invalid(format!(
            "{what} elements {offset}..{offset}+{n} are outside a buffer of {len}"
        ))),
    }
}

/// A CUDA event: a point in a stream's work, to wait for or query.
#[derive(Debug)]
pub struct Event {
    inner: CudaEvent,
    timing: bool,
}

impl Event {
    /// A new event; `timing` events also record timestamps (slightly more expensive).
    pub fn new(device: &CudaDevice, timing: bool) -> Result<Event> {
        let flags =
            if timing { CUevent_flags::CU_EVENT_DEFAULT } else { CUevent_flags::CU_EVENT_DISABLE_TIMING };
        Ok(Event { inner: check("cuEventCreate", device.context().new_event(Some(flags)))?, timing })
    }

    /// Record the current end of `stream`'s work into this event.
    pub fn record(&self, stream: &Stream) -> Result<()> {
        check("cuEventRecord", self.inner.record(stream.cudarc()))
    }

    /// Whether the recorded work has finished (`cuEventQuery`; never blocks). An event never
    /// recorded counts as finished.
    pub fn query(&self) -> Result<bool> {
        check("cuEventQuery", self.inner.try_is_complete())
    }

    /// Block until the recorded work has finished.
    pub fn synchronize(&self) -> Result<()> {
        check("cuEventSynchronize", self.inner.synchronize())
    }

    /// Milliseconds from this event to `end` (both timing events, both recorded); waits for both.
    pub fn elapsed_ms(&self, end: &Event) -> Result<f32> {
        if !self.timing || !end.timing {
            return Err(Error::invalid("elapsed time needs two timing events (CudaDevice::timing_event)"));
        }
        let lib = libs::driver()?;
        if !lib.has(libs::DRIVER_EVENT_ELAPSED) {
            return Err(Error::new(
                Code::Unavailable,
                format!(
                    "the CUDA driver {} lacks {} (needs CUDA 12.8+)",
                    lib.name(),
                    libs::DRIVER_EVENT_ELAPSED
                ),
            ));
        }
        check("cuEventElapsedTime", self.inner.elapsed_ms(&end.inner))
    }
}
