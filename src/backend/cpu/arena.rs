//! The recurrent-state arena of cellular batching: one fixed-size slot of `width` `f32` values per
//! in-flight request (an LSTM's `h` and `c` for every layer, a TreeLSTM node's `h` and `c`, …),
//! addressed by the slot id the scheduler gives the request.
//!
//! Values are kept as `f32` bits in [`AtomicU32`]s accessed with `Relaxed` loads and stores, so
//! that the streams of different workers may touch different slots of one shared arena at the same
//! time in safe Rust. A relaxed access compiles to a plain load or store. The arena itself orders
//! nothing: a step that reads a slot written by an earlier step (of any worker) sees those writes
//! because the runtime only launches it after observing the earlier task's completion signal, which
//! the writing stream advances with a release increment after its job and the engine reads with an
//! acquire load (the protocol of [`CpuSignal`](super::stream::CpuSignal)); launching then hands the
//! task over through a channel, itself a release/acquire pair. Two tasks in flight at once must
//! not share a slot (the scheduler never gives one slot to two requests).

use std::fmt;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::error::{Code, Error, Result};

/// Recurrent state in `slots` slots of `width` `f32` values each, zero-initialised.
pub struct StateArena {
    slots: usize,
    width: usize,
    cells: Box<[AtomicU32]>,
}

impl StateArena {
    /// A zeroed arena of `slots × width` values, or [`Code::Unavailable`] when the memory cannot
    /// be allocated (or its size overflows the address space).
    pub fn new(slots: usize, width: usize) -> Result<StateArena> {
        let len = slots.checked_mul(width);
        let bytes = len.and_then(|l| l.checked_mul(size_of::<AtomicU32>()));
        let unavailable = || {
            let mib = match bytes {
                Some(b) => (b as u128).div_ceil(1 << 20),
                None => (slots as u128 * width as u128 * 4).div_ceil(1 << 20),
            };
            Error::new(
                Code::Unavailable,
                format!("cannot allocate {mib} MiB of recurrent state ({slots} slots of {width} values)"),
            )
        };
        let (Some(len), Some(bytes)) = (len, bytes) else { return Err(unavailable()) };
        if bytes > isize::MAX as usize {
            return Err(unavailable());
        }
        let mut cells = Vec::new();
        cells.try_reserve_exact(len).map_err(|_| unavailable())?;
        cells.extend((0..len).map(|_| AtomicU32::new(0)));
        Ok(StateArena { slots, width, cells: cells.into_boxed_slice() })
    }

    /// Number of slots.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Values per slot.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The cells `offset..offset + len` of `slot`; panics with a message when out of range.
    fn cells(&self, slot: u32, offset: usize, len: usize) -> &[AtomicU32] {
        let s = slot as usize;
        assert!(s < self.slots, "state slot {slot} out of range: the arena has {} slots", self.slots);
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= self.width),
            "state range {offset}..{offset}+{len} out of range: slots hold {} values",
            self.width
        );
        let start = s * self.width + offset;
        &self.cells[start..start + len]
    }

    /// Copy `out.len()` values of `slot`, starting at `offset`, into `out`.
    ///
    /// Panics if `slot` or the range is out of bounds.
    pub fn read(&self, slot: u32, offset: usize, out: &mut [f32]) {
        let cells = self.cells(slot, offset, out.len());
        for (o, c) in out.iter_mut().zip(cells) {
            *o = f32::from_bits(c.load(Ordering::Relaxed));
        }
    }

    /// Store `values` into `slot` starting at `offset`.
    ///
    /// Panics if `slot` or the range is out of bounds.
    pub fn write(&self, slot: u32, offset: usize, values: &[f32]) {
        for (c, v) in self.cells(slot, offset, values.len()).iter().zip(values) {
            c.store(v.to_bits(), Ordering::Relaxed);
        }
    }

    /// The raw 32 bits at `offset` of `slot` (for integer state such as a decoder's last token).
    ///
    /// Panics if `slot` or `offset` is out of bounds.
    pub fn read_u32(&self, slot: u32, offset: usize) -> u32 {
        self.cells(slot, offset, 1)[0].load(Ordering::Relaxed)
    }

    /// Store raw 32 bits at `offset` of `slot`.
    ///
    /// Panics if `slot` or `offset` is out of bounds.
    pub fn write_u32(&self, slot: u32, offset: usize, v: u32) {
        self.cells(slot, offset, 1)[0].store(v, Ordering::Relaxed);
    }
}

impl fmt::Debug for StateArena {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StateArena").field("slots", &self.slots).field("width", &self.width).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arena_starts_zeroed_and_round_trips() {
        let a = StateArena::new(4, 6).unwrap();
        assert_eq!((a.slots(), a.width()), (4, 6));
        let mut out = [1.0f32; 6];
        a.read(3, 0, &mut out);
        assert_eq!(out, [0.0; 6]);
        a.write(2, 1, &[1.5, -2.0, f32::INFINITY]);
        a.write_u32(2, 5, 0xdead_beef);
        a.read(2, 0, &mut out);
        assert_eq!(&out[..5], &[0.0, 1.5, -2.0, f32::INFINITY, 0.0]);
        assert_eq!(a.read_u32(2, 5), 0xdead_beef);
        assert_eq!(a.read_u32(2, 1), 1.5f32.to_bits());
        for s in [0, 1, 3] {
            a.read(s, 0, &mut out);
            assert_eq!(out, [0.0; 6], "slot {s} untouched");
        }
        let mut two = [9.0; 3];
        a.read(2, 1, &mut two);
        assert_eq!(two, [1.5, -2.0, f32::INFINITY]);
        // Empty ranges at the end of a slot are fine.
        a.read(3, 6, &mut []);
        assert!(format!("{a:?}").contains("slots: 4"));
    }

    #[test]
    fn concurrent_writers_of_different_slots() {
        let a = StateArena::new(8, 16).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u32 {
                let a = &a;
                s.spawn(move || {
                    for slot in [t, t + 4] {
                        a.write(slot, 0, &[slot as f32; 16]);
                    }
                });
            }
        });
        for slot in 0..8u32 {
            let mut out = [0.0; 16];
            a.read(slot, 0, &mut out);
            assert_eq!(out, [slot as f32; 16]);
        }
    }

    #[test]
    fn huge_arena_is_unavailable_not_an_abort() {
        // (Miri treats a failed multi-exabyte allocation as resource exhaustion: skip that one.)
        let cases: &[(usize, usize)] = if cfg!(miri) {
            &[(usize::MAX, 2), (usize::MAX / 4, 1)]
        } else {
            &[(usize::MAX, 2), (1 << 40, 1 << 20), (usize::MAX / 4, 1)]
        };
        for &(slots, width) in cases {
            let e = StateArena::new(slots, width).unwrap_err();
            assert_eq!(e.code(), Code::Unavailable);
            assert!(e.message().contains("MiB of recurrent state"), "{}", e.message());
        }
        let empty = StateArena::new(0, 10).unwrap();
        assert_eq!(empty.slots(), 0);
    }

    #[test]
    #[should_panic(expected = "state slot 4 out of range")]
    fn slot_out_of_range_panics() {
        StateArena::new(4, 2).unwrap().write(4, 0, &[0.0]);
    }

    #[test]
    #[should_panic(expected = "out of range: slots hold 2 values")]
    fn offset_out_of_range_panics() {
        StateArena::new(4, 2).unwrap().read(0, 1, &mut [0.0; 2]);
    }
}
