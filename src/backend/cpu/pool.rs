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
