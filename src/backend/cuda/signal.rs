//! Completion counters in pinned, mapped host memory (ARCHITECTURE.md §5).
//!
//! Each stream has one 64-bit counter on its own 64-byte line. The signaling kernel, queued on the
//! stream after a task's work, does one system-scope release increment of it; the poller thread
//! reads it with acquire loads ([`CudaSignal::completed`]). One writer per counter; no stream
//! callbacks or host functions.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::driver::CudaDevice;
use super::memory::{PinnedMapped, Pod};
use crate::backend::CompletionSignal;
use crate::error::Result;

/// One counter alone on a 64-byte cache line, so that one stream's signal never shares a line
/// with another's (the device's writes and the poller's reads of one counter do not disturb the
/// others).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterLine {
    pub value: u64,
    _pad: [u64; 7],
}

// SAFETY: `#[repr(C)]` u64 fields filling exactly 64 bytes, the alignment: no padding; any bits
// are valid.
unsafe impl Pod for CounterLine {}

const _: () = assert!(size_of::<CounterLine>() == 64 && align_of::<CounterLine>() == 64);

/// The completion counters of a model's streams, one [`CounterLine`] each, zero at creation.
#[derive(Debug)]
pub struct SignalCounters {
    lines: PinnedMapped<CounterLine>,
}

impl SignalCounters {
    /// `n` counters, all zero.
    pub fn new(device: &CudaDevice, n: usize) -> Result<Arc<SignalCounters>> {
        Ok(Arc::new(SignalCounters { lines: PinnedMapped::new(device, n)? }))
    }

    pub fn len(&self) -> usize {
        self.lines.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lines.is_empty()
    }

    /// The device address of counter `i`'s u64, for the signaling kernel's parameters.
    pub fn device_ptr(&self, i: usize) -> u64 {
        assert!(i < self.len(), "counter {i} of {}", self.len());
        self.lines.device_ptr() + (i * size_of::<CounterLine>()) as u64
    }

    /// Counter `i` as an atomic.
    fn atomic(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len(), "counter {i} of {}", self.len());
        // SAFETY: `i < len` (asserted): the line is inside the allocation.
        let line = unsafe { self.lines.host_ptr().add(i) };
        // `value` is the first field of the #[repr(C)] line: the same address.
        let value = line.cast::<u64>();
        // SAFETY: the invariant of the whole type. `lines` is a live allocation owned by `self`,
        // so `value` is valid for reads and writes for as long as `&self` (the returned lifetime);
        // it starts a 64-byte-aligned line, so it is 8-aligned as AtomicU64 requires, and
        // AtomicU64 has u64's size and layout. Every access to a counter while it is shared is
        // atomic and 8 bytes wide: the device's system-scope release write or increment (one
        // writer per counter), host acquire loads (`completed`) and host release stores (`store`).
        // The non-atomic zeroing at allocation happened before the memory was shared, and nothing
        // ever takes a non-atomic reference to a counter.
        unsafe { AtomicU64::from_ptr(value) }
    }

    /// Tasks completed on stream `i` so far: an acquire load, so whatever the device wrote before
    /// its release increment is visible to the caller once counted.
    pub fn completed(&self, i: usize) -> u64 {
        self.atomic(i).load(Ordering::Acquire)
    }

    /// Host-side store of counter `i` (a release store): resetting before a stream's first task,
    /// and tests. Never while the device may write the counter.
    pub fn store(&self, i: usize, value: u64) {
        self.atomic(i).store(value, Ordering::Release)
    }

    /// The [`CompletionSignal`] of stream `i`, for the poller.
    pub fn signal(self: &Arc<Self>, i: usize) -> Arc<CudaSignal> {
        assert!(i < self.len(), "counter {i} of {}", self.len());
        Arc::new(CudaSignal { counters: self.clone(), index: i })
    }
}

/// One stream's counter as the runtime's [`CompletionSignal`]. Keeps the counters alive.
#[derive(Debug, Clone)]
pub struct CudaSignal {
    counters: Arc<SignalCounters>,
    index: usize,
}

impl CudaSignal {
    /// The device address the signaling kernel increments.
    pub fn device_ptr(&self) -> u64 {
        self.counters.device_ptr(self.index)
    }
}

impl CompletionSignal for CudaSignal {
    fn completed(&self) -> u64 {
        self.counters.completed(self.index)
    }

    /// The device cannot wake a parked thread: the poller spins while it waits on this counter.
    fn notifies(&self) -> bool {
        false
    }
}
