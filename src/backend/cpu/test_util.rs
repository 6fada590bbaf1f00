//! Helpers shared by the CPU kernels' unit tests.

use crate::backend::cpu::arena::StateArena;
use crate::backend::cpu::gemm::Threads;

/// Deterministic values in [-scale, scale).
pub(crate) fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Every value of `slot`.
pub(crate) fn slot_values(arena: &StateArena, slot: u32) -> Vec<f32> {
    let mut v = vec![0.0; arena.width()];
    arena.read(slot, 0, &mut v);
    v
}

/// A 2-thread pool, and the thread counts to test with it. None under Miri, where rayon's
/// pool is out of reach (Stacked Borrows): the kernels then run single-threaded.
pub(crate) struct Pool(Option<rayon::ThreadPool>);

impl Pool {
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        match &self.0 {
            Some(p) => p.install(f),
            None => f(),
        }
    }
    pub(crate) fn threads(&self) -> Vec<Threads> {
        if self.0.is_some() { vec![Threads(1), Threads(2)] } else { vec![Threads(1)] }
    }
}

pub(crate) fn pool() -> Pool {
    Pool((!cfg!(miri)).then(|| rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap()))
}
