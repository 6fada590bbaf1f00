//! Helpers shared by the CPU kernels' unit tests.

use crate::backend::cpu::arena::StateArena;
use crate::backend::cpu::gemm::Threads;

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
