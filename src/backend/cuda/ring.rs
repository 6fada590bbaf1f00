//! The device ring: E²bird's memory pool on CUDA (ARCHITECTURE.md §7.7).
//!
//! A model whose runner reads its input on the device (resnet, mlp) gets an input ring whose
//! rows live here, as a [`RingMirror`] of the engine's [`InputRing`]:
//!
//! * **host rows** in pinned memory (`cuMemHostAlloc`): the engine writes a request's input into
//!   its slot once, at arrival;
//! * **publish**: that slot's row is copied into the same slot of a **device ring** on the
//!   ring's own **input stream** (`cuMemcpyHtoDAsync` from pinned memory: the engine thread does
//!   not wait for it), and the slot's **event** is recorded after the copy;
//! * **a task** whose batch is a run of consecutive slots makes its worker's stream wait for the
//!   run's copies ([`DeviceRing::wait`]: one `cuStreamWaitEvent`, on the event of the run's
//!   slot written last: the input stream runs its copies in order, so that one finishing means
//!   all of them have) and copies them, on the device, from [`DeviceRing::device_ptr`] into the
//!   worker's input buffer: no host gather and no upload at launch;
//! * **claim**: before the engine rewrites a slot's host row, the copy of its last write must
//!   have read it (`cuEventSynchronize` on the slot's event; long done in practice, since the
//!   slot was freed only after the batch that read it was answered).
//!
//! The device slot itself is rewritten only after the task that read it ended (the elastic
//! policy frees a slot when its batch is answered, which is after the worker's counter passed
//! the task): that host-observed order puts the next copy after the read. A task the stall
//! watchdog gave up on may still be reading: the engine then never writes into the ring again.

use std::any::Any;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use cudarc::driver::result as cu;

use super::driver::{CudaDevice, bind, check};
use super::memory::{DeviceBuffer, PinnedMapped};
use super::stream::{Event, Stream};
use crate::backend::ring::{InputRing, RingMirror, RingRows};
use crate::error::{Error, Result};

/// The pinned host rows, the device ring they are copied into, the input stream and one event
/// per slot.
pub struct DeviceRing {
    host: PinnedMapped<f32>,
    dev: DeviceBuffer<f32>,
    /// Copies only, in the order the engine published the slots.
    stream: Stream,
    /// Per slot: recorded on `stream` after the slot's last copy.
    events: Vec<Event>,
    /// Per slot: the number of the publish that last wrote it (0: never written), so that a
    /// run's wait can pick its slot written last.
    written: Vec<AtomicU64>,
    published: AtomicU64,
    row_len: usize,
    /// Runs read on the device ([`DeviceRing::wait`] calls that queued their wait).
    reads: AtomicU64,
}

impl std::fmt::Debug for DeviceRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRing")
            .field("slots", &self.events.len())
            .field("row_len", &self.row_len)
            .field("copies", &self.copies())
            .field("device_reads", &self.device_reads())
            .finish()
    }
}

impl DeviceRing {
    /// An input ring of `slots` rows of `row_len` values whose rows are mirrored on `device`.
    /// The size is bounded ([`InputRing::values_of`]) before anything is allocated.
    pub fn input_ring(device: &CudaDevice, slots: usize, row_len: usize) -> Result<InputRing> {
        let values = InputRing::values_of(slots, row_len)?;
        // Pinned rows come page-aligned from the driver (InputRing::mirrored checks 64 bytes).
        let host = device.pinned_mapped(values)?;
        let stream = device.stream()?;
        let dev = device.alloc(values)?;
        let events = (0..slots).map(|_| device.event()).collect::<Result<Vec<_>>>()?;
        let written = (0..slots).map(|_| AtomicU64::new(0)).collect();
        let ring = DeviceRing {
            host,
            dev,
            stream,
            events,
            written,
            published: AtomicU64::new(0),
            row_len,
            reads: AtomicU64::new(0),
        };
        InputRing::mirrored(slots, row_len, Box::new(ring))
    }

    /// The device ring behind `ring`, if its rows are mirrored on a CUDA device.
    pub fn of(ring: &InputRing) -> Option<&DeviceRing> {
        let m: &dyn Any = ring.mirror()?;
        m.downcast_ref::<DeviceRing>()
    }

    /// Slot copies queued to the device so far (one per published write).
    pub fn copies(&self) -> u64 {
        self.published.load(Ordering::Relaxed)
    }

    /// Runs tasks read on the device so far.
    pub fn device_reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// The device address of `rows`' first value. `INTERNAL` if `rows` is not a run of this
    /// ring, or the ring lives in another CUDA context than `stream`.
    pub fn device_ptr(&self, rows: &RingRows, stream: &Stream) -> Result<u64> {
        let ours = Self::of(rows.ring()).is_some_and(|d| std::ptr::eq(d, self));
        if !ours || **self.dev.context() != **stream.cudarc().context() {
            return Err(Error::internal("a ring run read on the device of another ring or CUDA context"));
        }
        Ok(self.dev.device_ptr_at(rows.first() * self.row_len))
    }

    /// Make `stream`'s later work wait until the copies of `rows`' slots have landed. `INTERNAL`
    /// for a slot never published (its request's input never reached the device).
    pub fn wait(&self, rows: &RingRows, stream: &Stream) -> Result<()> {
        let range = rows.first()..rows.first() + rows.rows();
        let Some(slots) = self.written.get(range.clone()) else {
            return Err(Error::internal(format!(
                "ring run {range:?} of a ring of {} slots",
                self.written.len()
            )));
        };
        // The run's slot published last: the input stream ran every earlier copy before it.
        let mut last: Option<(u64, usize)> = None;
        for (i, w) in slots.iter().enumerate() {
            let n = w.load(Ordering::Acquire);
            if n == 0 {
                return Err(Error::internal(format!(
                    "ring run {range:?} holds slot {} never copied to the device",
                    range.start + i
                )));
            }
            if last.is_none_or(|(m, _)| n > m) {
                last = Some((n, i));
            }
        }
        let Some((_, last)) = last else { return Ok(()) };
        stream.wait(&self.events[range.start + last])?;
        self.reads.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

impl RingMirror for DeviceRing {
    fn host(&self) -> NonNull<f32> {
        NonNull::new(self.host.host_ptr()).unwrap_or(NonNull::dangling())
    }

    fn values(&self) -> usize {
        self.host.len()
    }

    fn claim(&self, slot: usize) -> Result<()> {
        let event = self
            .events
            .get(slot)
            .ok_or_else(|| Error::internal(format!("ring slot {slot} of {}", self.events.len())))?;
        // An event never recorded is complete: a first write does not wait.
        event.synchronize()
    }

    fn publish(&self, slot: usize) -> Result<()> {
        let (Some(event), Some(written)) = (self.events.get(slot), self.written.get(slot)) else {
            return Err(Error::internal(format!("ring slot {slot} of {}", self.events.len())));
        };
        let at = slot * self.row_len;
        bind(self.stream.cudarc().context())?;
        // SAFETY: `slot < slots`, so `[at, at + row_len)` lies inside both the pinned rows and the
        // device ring (each holds slots · row_len values), which live in this stream's context
        // (bound). The copy reads the host row after this call returns: the row stays allocated
        // (the ring owns it) and unwritten until `claim` has seen the copy's event, which every
        // rewrite of the slot waits for first; the device slot is not read by a task meanwhile
        // (the module comment's slot discipline).
        let r = unsafe {
            let row = std::slice::from_raw_parts(self.host.host_ptr().add(at), self.row_len);
            cu::memcpy_htod_async(self.dev.device_ptr_at(at), row, self.stream.raw())
        };
        check("cuMemcpyHtoDAsync", r)?;
        event.record(&self.stream)?;
        let n = self.published.fetch_add(1, Ordering::Relaxed) + 1;
        written.store(n, Ordering::Release);
        Ok(())
    }
}
