//! The input ring of a model served by elastic batching (E²bird's memory pool; ARCHITECTURE.md
//! §7.7): `slots` rows of `row_len` values in one pre-allocated, 64-byte-aligned buffer, slot
//! `i` at `i · row_len`. A request's input is copied once, at its arrival, into the slot the
//! policy gave it ([`InputRing::write`]); a batch that is a run of consecutive slots is then
//! read in place ([`RingRows`], a task's [`Work::Ring`](super::Work::Ring)): no gather copy.
//!
//! The buffer is written by the engine's thread and read by the workers' streams at once, on
//! different slots. What keeps that sound is the elastic policy's slot discipline, which the
//! engine relies on and the caller of [`InputRing::write`] promises: a slot is written only
//! while it is free (no launched task covers it: the policy hands a slot to an arriving request
//! only after the batch that last covered it was answered, which is after its task ended), and
//! a run is read only by its task, between its launch and its end. A task a watchdog gave up on
//! may still be reading when its slots are freed: the engine then stops writing into this ring
//! for good (ARCHITECTURE.md §7.7), and the task's [`RingRows`] keeps the buffer alive.
//!
//! A backend may keep the rows somewhere of its own ([`Runner::input_ring`](super::Runner::input_ring)):
//! a ring built with [`InputRing::mirrored`] lives in a [`RingMirror`]'s host memory, and every
//! write is bracketed by the mirror's [`claim`](RingMirror::claim) (what still reads the slot's
//! host row has finished) and [`publish`](RingMirror::publish) (the row goes on, e.g. copied to
//! the device). The CUDA backend's mirror is pinned host memory copied, slot by slot, into a
//! device ring on an input stream, so a task reads its run on the device in place
//! (`backend/cuda/ring.rs`).

use std::any::Any;
use std::cell::UnsafeCell;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::error::{Code, Error, Result};

/// Values per 64-byte line.
const LINE: usize = 16;

/// Most bytes one ring may hold (the runtime refuses a model whose ring would be larger).
pub const MAX_RING_BYTES: usize = 1 << 30;

/// One 64-byte line of the buffer (its alignment aligns the whole buffer).
#[repr(C, align(64))]
struct Line(UnsafeCell<[f32; LINE]>);

impl Line {
    /// Zeroed lines holding at least `values` f32s.
    fn zeroed(values: usize) -> Box<[Line]> {
        (0..values.div_ceil(LINE)).map(|_| Line(UnsafeCell::new([0.0; LINE]))).collect()
    }

    /// The first value of `lines`, writable through a shared reference.
    fn first_value(lines: &[Line]) -> *mut f32 {
        // `Line` is `repr(C)` around an `UnsafeCell<[f32; 16]>` (itself `repr(transparent)`), so
        // the lines are one contiguous run of f32s; `UnsafeCell::raw_get` gives the writable
        // pointer a shared reference allows.
        UnsafeCell::raw_get(lines.as_ptr().cast::<UnsafeCell<[f32; LINE]>>()).cast::<f32>()
    }
}

/// A backend's home for a ring's rows (see the module documentation).
pub trait RingMirror: Any + Send + Sync {
    /// The host rows: at least [`values`](Self::values) f32s from a 64-byte-aligned address,
    /// valid while the mirror lives, written by the host only through [`InputRing::write`].
    fn host(&self) -> NonNull<f32>;
    /// How many f32s [`host`](Self::host) holds.
    fn values(&self) -> usize;
    /// Called before the host writes slot `slot`: return once nothing reads its host row any
    /// more (e.g. the copy of its last write). An error leaves the slot unwritten.
    fn claim(&self, slot: usize) -> Result<()>;
    /// Called after the host wrote slot `slot`: pass the row on. An error means the slot's row
    /// did not reach where tasks read it: the engine then gathers its request's input instead.
    fn publish(&self, slot: usize) -> Result<()>;
}

/// Where a ring's rows live.
enum Rows {
    /// On the heap (the CPU backend: its tasks read the rows where they are).
    Heap(Box<[Line]>),
    /// In a backend's mirror.
    Mirrored(Box<dyn RingMirror>),
}

/// A model's input ring.
pub struct InputRing {
    rows: Rows,
    slots: usize,
    row_len: usize,
}

// SAFETY: the buffer is only reached through `write` (one free slot's range, by the engine's
// thread, under the slot discipline in the module comment) and `RingRows::values` (a launched
// run's range, by its task): two threads never touch one slot at once, and the hand-offs between
// them (a launch through the stream's queue, a task's end through its completion counter)
// order a slot's write before its reads and its reads before its next write.
unsafe impl Sync for InputRing {}
// SAFETY: the buffer is owned plain data (f32s), or a mirror (`Send`) that owns it; moving the
// ring moves nothing a thread borrows.
unsafe impl Send for InputRing {}

impl InputRing {
    /// A ring of `slots` rows of `row_len` values, zeroed; `UNAVAILABLE` past [`MAX_RING_BYTES`].
    pub fn new(slots: usize, row_len: usize) -> Result<InputRing> {
        let values = Self::values_of(slots, row_len)?;
        Ok(InputRing { rows: Rows::Heap(Line::zeroed(values)), slots, row_len })
    }

    /// A ring of `slots` rows of `row_len` values kept in `mirror`'s host memory (which must
    /// hold them, from a 64-byte-aligned address: otherwise `INTERNAL`).
    pub fn mirrored(slots: usize, row_len: usize, mirror: Box<dyn RingMirror>) -> Result<InputRing> {
        let values = Self::values_of(slots, row_len)?;
        if mirror.values() < values || !(mirror.host().as_ptr() as usize).is_multiple_of(64) {
            return Err(Error::internal(format!(
                "a ring mirror of {} values at {:p} for {slots} slots × {row_len} values (64-byte aligned)",
                mirror.values(),
                mirror.host()
            )));
        }
        Ok(InputRing { rows: Rows::Mirrored(mirror), slots, row_len })
    }

    /// The values of a ring of `slots` rows of `row_len` values; `UNAVAILABLE` past
    /// [`MAX_RING_BYTES`] (checked before anything is allocated).
    pub fn values_of(slots: usize, row_len: usize) -> Result<usize> {
        slots
            .checked_mul(row_len)
            .filter(|v| v.checked_mul(4).is_some_and(|b| b <= MAX_RING_BYTES))
            .ok_or_else(|| {
                Error::new(
                    Code::Unavailable,
                    format!(
                        "an input ring of {slots} slots × {row_len} values is over the {MAX_RING_BYTES} bytes a ring \
                         may hold"
                    ),
                )
            })
    }

    /// The first value of the buffer.
    fn base(&self) -> *mut f32 {
        match &self.rows {
            Rows::Heap(lines) => Line::first_value(lines),
            Rows::Mirrored(m) => m.host().as_ptr(),
        }
    }

    /// The backend's mirror of the rows, if the ring has one.
    pub fn mirror(&self) -> Option<&dyn RingMirror> {
        match &self.rows {
            Rows::Heap(_) => None,
            Rows::Mirrored(m) => Some(&**m),
        }
    }

    /// Fill slot `slot` with `fill`, given the slot's `row_len` values. A slot outside the ring
    /// is `INTERNAL` (nothing is written); a mirror's error is returned (the slot's row is then
    /// not to be read in place).
    ///
    /// # Safety
    /// `slot` is free: no task reading it is launched, and no other `write` to it runs (the
    /// module comment's slot discipline).
    pub unsafe fn write(&self, slot: usize, fill: impl FnOnce(&mut [f32])) -> Result<()> {
        if slot >= self.slots {
            return Err(Error::internal(format!("input ring slot {slot} of {}", self.slots)));
        }
        if let Some(m) = self.mirror() {
            m.claim(slot)?;
        }
        // SAFETY: the range `[slot·row_len, (slot+1)·row_len)` lies inside the buffer (slot <
        // slots, and the buffer holds slots·row_len values), and the caller promises no one else
        // reads or writes it meanwhile (a mirror's own reader of the row, a copy to the device,
        // is done: `claim` returned), so this is the only reference to it.
        let row =
            unsafe { std::slice::from_raw_parts_mut(self.base().add(slot * self.row_len), self.row_len) };
        fill(row);
        match self.mirror() {
            Some(m) => m.publish(slot),
            None => Ok(()),
        }
    }

    /// The run of `rows` slots from `first`, read in place by a task; `None` when it passes
    /// the ring's end (a run never wraps).
    pub fn rows(self: &Arc<Self>, first: usize, rows: usize) -> Option<RingRows> {
        (first.checked_add(rows)? <= self.slots).then(|| RingRows { ring: self.clone(), first, rows })
    }
}

impl std::fmt::Debug for InputRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InputRing").field("slots", &self.slots).field("row_len", &self.row_len).finish()
    }
}

/// A launched batch's rows in its model's input ring.
#[derive(Debug)]
pub struct RingRows {
    ring: Arc<InputRing>,
    first: usize,
    rows: usize,
}

impl RingRows {
    /// The ring's first slot of the run, and its number of slots.
    pub fn first(&self) -> usize {
        self.first
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The ring the run is in.
    pub fn ring(&self) -> &InputRing {
        &self.ring
    }

    /// The rows, `rows × row_len` values, row-major.
    pub fn values(&self) -> &[f32] {
        // SAFETY: `InputRing::rows` checked `first + rows ≤ slots`, so the range lies inside the
        // buffer; its slots belong to this launched task, which nobody writes until the task has
        // ended (the slot discipline), so no `&mut` to them exists while this borrow lives.
        unsafe {
            std::slice::from_raw_parts(
                self.ring.base().add(self.first * self.ring.row_len),
                self.rows * self.ring.row_len,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fill(ring: &InputRing, slot: usize, v: f32) {
        // SAFETY: single-threaded test, no run of these slots is read meanwhile.
        unsafe { ring.write(slot, |row| row.fill(v)) }.unwrap();
    }

    #[test]
    fn slots_are_written_once_and_read_in_place() {
        let ring = Arc::new(InputRing::new(8, 3).unwrap());
        assert_eq!(ring.base() as usize % 64, 0, "64-byte aligned");
        for s in 0..8 {
            fill(&ring, s, s as f32);
        }
        let run = ring.rows(2, 3).unwrap();
        assert_eq!(run.values(), [2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 4.0, 4.0, 4.0]);
        assert!(ring.rows(6, 3).is_none(), "a run never wraps");
        assert!(ring.rows(usize::MAX, 2).is_none());
        assert_eq!(ring.rows(8, 0).unwrap().values(), [] as [f32; 0]);
        // SAFETY: as above.
        assert_eq!(unsafe { ring.write(8, |_| unreachable!()) }.unwrap_err().code(), Code::Internal);
    }

    /// A mirror on the heap that logs its calls and can be told to fail.
    struct LogMirror {
        lines: Box<[Line]>,
        log: std::sync::Mutex<Vec<String>>,
        fail_publish: std::sync::atomic::AtomicBool,
    }

    impl LogMirror {
        fn new(values: usize) -> LogMirror {
            LogMirror {
                lines: Line::zeroed(values),
                log: Default::default(),
                fail_publish: Default::default(),
            }
        }
    }

    // SAFETY: the rows are reached only through the ring's `write` and `RingRows::values`,
    // under the slot discipline (as `InputRing`'s own heap rows); the log is a Mutex.
    unsafe impl Sync for LogMirror {}

    impl RingMirror for LogMirror {
        fn host(&self) -> NonNull<f32> {
            NonNull::new(Line::first_value(&self.lines)).unwrap()
        }
        fn values(&self) -> usize {
            self.lines.len() * LINE
        }
        fn claim(&self, slot: usize) -> Result<()> {
            self.log.lock().unwrap().push(format!("claim {slot}"));
            Ok(())
        }
        fn publish(&self, slot: usize) -> Result<()> {
            // SAFETY: the slot was just written and nothing writes it during this call.
            let first = unsafe { *self.host().as_ptr().add(slot * 3) };
            self.log.lock().unwrap().push(format!("publish {slot} {first}"));
            if self.fail_publish.load(std::sync::atomic::Ordering::Relaxed) {
                return Err(Error::new(Code::Backend, "the copy could not be queued"));
            }
            Ok(())
        }
    }

    /// A mirrored ring keeps its rows in the mirror and brackets each write by claim and
    /// publish (publish sees the written row); a mirror too small is refused; a failed publish
    /// is the write's error.
    #[test]
    fn a_mirrored_ring_claims_writes_and_publishes_each_slot() {
        let ring = Arc::new(InputRing::mirrored(4, 3, Box::new(LogMirror::new(12))).unwrap());
        fill(&ring, 2, 7.0);
        fill(&ring, 0, 5.0);
        let m = ring.mirror().expect("a mirror");
        let log = (m as &dyn Any).downcast_ref::<LogMirror>().unwrap();
        assert_eq!(*log.log.lock().unwrap(), ["claim 2", "publish 2 7", "claim 0", "publish 0 5"]);
        assert_eq!(ring.rows(2, 1).unwrap().values(), [7.0; 3]);
        // SAFETY: the rows are the mirror's host memory, read while nothing writes them.
        let host = unsafe { std::slice::from_raw_parts(m.host().as_ptr(), 12) };
        assert_eq!(host[6..9], [7.0; 3]);
        assert_eq!(ring.rows(0, 1).unwrap().ring().mirror().map(|m| m.values()), Some(16));
        log.fail_publish.store(true, std::sync::atomic::Ordering::Relaxed);
        // SAFETY: single-threaded test, no run of the slot is read meanwhile.
        let e = unsafe { ring.write(1, |row| row.fill(1.0)) }.unwrap_err();
        assert_eq!(e.code(), Code::Backend);
        assert!(InputRing::new(4, 3).unwrap().mirror().is_none());
        let small = InputRing::mirrored(4, 5, Box::new(LogMirror::new(16))).unwrap_err();
        assert_eq!(small.code(), Code::Internal, "{small}");
    }

    #[test]
    fn a_ring_past_its_bound_is_refused() {
        let e = InputRing::new(usize::MAX / 2, 4).unwrap_err();
        assert_eq!(e.code(), Code::Unavailable);
        assert!(InputRing::new(MAX_RING_BYTES / 4 + 1, 1).is_err());
    }

    /// A writer thread fills free slots while a reader reads a launched run, as the engine and a
    /// stream do (Miri checks the accesses never overlap).
    #[test]
    fn a_writer_and_a_reader_on_different_slots() {
        let ring = Arc::new(InputRing::new(16, 5).unwrap());
        for s in 0..4 {
            fill(&ring, s, 1.0);
        }
        let run = ring.rows(0, 4).unwrap();
        let writer = {
            let ring = ring.clone();
            std::thread::spawn(move || {
                for round in 0..20 {
                    for s in 4..16 {
                        fill(&ring, s, round as f32);
                    }
                }
            })
        };
        let sum: f32 = (0..20).map(|_| run.values().iter().sum::<f32>()).sum();
        writer.join().unwrap();
        assert_eq!(sum, 20.0 * 20.0);
        assert!(ring.rows(4, 12).unwrap().values().iter().all(|&v| v == 19.0));
    }
}
