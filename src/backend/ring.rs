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

use std::cell::UnsafeCell;
use std::sync::Arc;

use crate::error::{Code, Error, Result};

/// Values per 64-byte line.
const LINE: usize = 16;

/// Most bytes one ring may hold (the runtime refuses a model whose ring would be larger).
pub const MAX_RING_BYTES: usize = 1 << 30;

/// One 64-byte line of the buffer (its alignment aligns the whole buffer).
#[repr(C, align(64))]
struct Line(UnsafeCell<[f32; LINE]>);

/// A model's input ring.
pub struct InputRing {
    lines: Box<[Line]>,
    slots: usize,
    row_len: usize,
}

// SAFETY: the buffer is only reached through `write` (one free slot's range, by the engine's
// thread, under the slot discipline in the module comment) and `RingRows::values` (a launched
// run's range, by its task): two threads never touch one slot at once, and the hand-offs between
// them (a launch through the stream's queue, a task's end through its completion counter)
// order a slot's write before its reads and its reads before its next write.
unsafe impl Sync for InputRing {}
// SAFETY: the buffer is owned plain data (f32s); moving the ring moves nothing a thread borrows.
unsafe impl Send for InputRing {}

impl InputRing {
    /// A ring of `slots` rows of `row_len` values, zeroed; `UNAVAILABLE` past [`MAX_RING_BYTES`].
    pub fn new(slots: usize, row_len: usize) -> Result<InputRing> {
        let values = slots
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
            })?;
        let lines = (0..values.div_ceil(LINE)).map(|_| Line(UnsafeCell::new([0.0; LINE]))).collect();
        Ok(InputRing { lines, slots, row_len })
    }

    /// The first value of the buffer.
    fn base(&self) -> *mut f32 {
        // `Line` is `repr(C)` around an `UnsafeCell<[f32; 16]>` (itself `repr(transparent)`),
        // so the lines are one contiguous run of f32s; `UnsafeCell::raw_get` gives the
        // writable pointer a shared reference allows.
        UnsafeCell::raw_get(self.lines.as_ptr().cast::<UnsafeCell<[f32; LINE]>>()).cast::<f32>()
    }

    /// Fill slot `slot` with `fill`, given the slot's `row_len` values. A slot outside the ring
    /// is `INTERNAL` (nothing is written).
    ///
    /// # Safety
    /// `slot` is free: no task reading it is launched, and no other `write` to it runs (the
    /// module comment's slot discipline).
    pub unsafe fn write(&self, slot: usize, fill: impl FnOnce(&mut [f32])) -> Result<()> {
        if slot >= self.slots {
            return Err(Error::internal(format!("input ring slot {slot} of {}", self.slots)));
        }
        // SAFETY: the range `[slot·row_len, (slot+1)·row_len)` lies inside the buffer (slot <
        // slots, and the buffer holds slots·row_len values), and the caller promises no one else
        // reads or writes it meanwhile, so this is the only reference to it.
        let row =
            unsafe { std::slice::from_raw_parts_mut(self.base().add(slot * self.row_len), self.row_len) };
        fill(row);
        Ok(())
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
