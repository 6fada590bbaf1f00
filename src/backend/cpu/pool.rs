//! The CPU backend's compute pool: a rayon pool whose threads have all exited (been joined) once
//! it is dropped. rayon's own drop only asks them to exit; a runtime freed by its owner must leave
//! no thread behind (and a process that exits right after must not find them half torn down).

use std::ops::Deref;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::error::{Error, Result};

pub(crate) struct ComputePool {
    pool: Option<rayon::ThreadPool>,
    /// The pool's threads, spawned by us (rayon's `spawn_handler`) so that they can be joined.
    threads: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl ComputePool {
    pub(crate) fn new(threads: usize) -> Result<ComputePool> {
        let handles = Arc::new(Mutex::new(Vec::with_capacity(threads)));
        let spawned = handles.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("serve-cpu-{i}"))
            .spawn_handler(move |thread| {
                let mut b = std::thread::Builder::new();
                if let Some(name) = thread.name() {
                    b = b.name(name.to_owned());
                }
                let handle = b.spawn(|| thread.run())?;
                spawned.lock().unwrap_or_else(|p| p.into_inner()).push(handle);
                Ok(())
            })
            .build()
            .map_err(|e| Error::internal(format!("cannot start the CPU thread pool: {e}")))?;
        Ok(ComputePool { pool: Some(pool), threads: handles })
    }
}

/// The pools that tasks on core leases run on (VELTAIR's tenant mode, `TaskData::lease`), shared
/// by every runner of the backend: a task of `c` leased CPUs takes an idle pool of `c` threads
/// (or starts one: the thread-start cost of a conflict), pins its threads one to each leased CPU
/// unless they are pinned there already, runs, and gives the pool back. A pool is held by one
/// task at a time, so no two blocks share threads; as many pools of `c` threads exist as blocks
/// of `c` cores ever ran at once (at most `C / c` on a pool of `C` CPUs), kept until the backend
/// is dropped.
#[derive(Default)]
pub(crate) struct LeasePools {
    idle: Mutex<std::collections::HashMap<usize, Vec<PinnedPool>>>,
}

/// A lease pool and the CPUs its threads are pinned to (by thread index).
pub(crate) struct PinnedPool {
    pub pool: ComputePool,
    pinned: Vec<usize>,
}

impl PinnedPool {
    /// Pin the threads one to each CPU of `lease` (as many as the pool has threads) unless they
    /// are there already. A CPU that cannot be pinned to (outside the process's set) leaves its
    /// thread where it was, and the pool is pinned again next time.
    pub fn pin(&mut self, lease: &[usize]) {
        if self.pinned == lease || lease.is_empty() {
            return;
        }
        let all = self.pool.broadcast(|ctx| super::affinity::pin(lease[ctx.index() % lease.len()]));
        self.pinned = if all.iter().all(|&ok| ok) { lease.to_vec() } else { Vec::new() };
    }
}

impl LeasePools {
    /// An idle pool of `threads` threads, or a new one.
    pub fn take(&self, threads: usize) -> Result<PinnedPool> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&threads).and_then(Vec::pop);
        match idle {
            Some(p) => Ok(p),
            None => Ok(PinnedPool { pool: ComputePool::new(threads)?, pinned: Vec::new() }),
        }
    }

    /// Give a pool taken by [`take`](Self::take) back.
    pub fn give_back(&self, p: PinnedPool) {
        let threads = p.pool.current_num_threads();
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).entry(threads).or_default().push(p);
    }

    /// Threads of the pools now idle (tests).
    #[cfg(test)]
    pub fn idle_threads(&self) -> usize {
        self.idle.lock().unwrap().iter().map(|(t, v)| t * v.len()).sum()
    }
}

impl Deref for ComputePool {
    type Target = rayon::ThreadPool;
    fn deref(&self) -> &rayon::ThreadPool {
        self.pool.as_ref().expect("the pool lives until dropped")
    }
}

impl Drop for ComputePool {
    fn drop(&mut self) {
        let Some(pool) = self.pool.take() else { return };
        // A thread of this pool cannot join itself (it never holds the pool's last handle: jobs
        // borrow it through `install` from stream threads; this is a guard, not a path).
        let inside = pool.current_thread_index().is_some();
        drop(pool);
        if inside {
            return;
        }
        // Dropping the pool told its threads to exit; each ends once its job in hand is done.
        for t in std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner())) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dropping the pool returns once every thread has finished, its thread-locals destroyed
    /// included (what a thread still exiting would not have done yet).
    #[test]
    #[cfg_attr(miri, ignore)] // rayon's threads are too slow to interpret
    fn dropping_the_pool_joins_its_threads() {
        thread_local! {
            static HELD: std::cell::RefCell<Option<Arc<()>>> = const { std::cell::RefCell::new(None) };
        }
        let marker = Arc::new(());
        let pool = ComputePool::new(3).unwrap();
        pool.broadcast(|_| HELD.with(|h| *h.borrow_mut() = Some(marker.clone())));
        assert_eq!(Arc::strong_count(&marker), 4, "each of the 3 threads holds the marker");
        drop(pool);
        assert_eq!(Arc::strong_count(&marker), 1, "every thread has exited when drop returns");
    }
}
