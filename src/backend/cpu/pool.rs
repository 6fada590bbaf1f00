//! The CPU backend's compute pool: a rayon pool whose threads have all exited once it is
//! dropped. rayon's own drop only asks them to exit; a runtime freed by its owner must leave no
//! thread behind (and a process that exits right after must not find them half torn down).

use std::ops::Deref;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};

/// Threads are named `serve-cpu-N`.
const THREAD_PREFIX: &str = "serve-cpu-";

/// Longest wait for the threads to exit at drop. They exit as soon as they finish the job in
/// hand, and the pool is dropped only once no model uses it, so this bounds a bug, not a wait.
const EXIT_WAIT: Duration = Duration::from_secs(10);

pub(crate) struct ComputePool {
    pool: Option<rayon::ThreadPool>,
    /// Threads not yet exited.
    alive: Arc<(Mutex<usize>, Condvar)>,
}

impl ComputePool {
    pub(crate) fn new(threads: usize) -> Result<ComputePool> {
        let alive = Arc::new((Mutex::new(threads), Condvar::new()));
        let on_exit = alive.clone();
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("{THREAD_PREFIX}{i}"))
            .exit_handler(move |_| {
                let (count, cv) = &*on_exit;
                *count.lock().unwrap_or_else(|p| p.into_inner()) -= 1;
                cv.notify_all();
            })
            .build()
            .map_err(|e| Error::internal(format!("cannot start the CPU thread pool: {e}")))?;
        Ok(ComputePool { pool: Some(pool), alive })
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
        drop(self.pool.take());
        // A pool thread cannot wait for itself (it never holds the pool's last handle: jobs
        // borrow it through `install` from stream threads; this is a guard, not a path).
        if std::thread::current().name().is_some_and(|n| n.starts_with(THREAD_PREFIX)) {
            return;
        }
        let (count, cv) = &*self.alive;
        let left = count.lock().unwrap_or_else(|p| p.into_inner());
        let _ = cv.wait_timeout_while(left, EXIT_WAIT, |n| *n > 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Dropping the pool returns once every thread has exited: none is left named `serve-cpu-`.
    #[test]
    #[cfg_attr(miri, ignore)] // rayon threads under Miri are slow and leak-checked differently
    fn dropping_the_pool_joins_its_threads() {
        let alive = {
            let pool = ComputePool::new(3).unwrap();
            assert_eq!(pool.install(|| 1 + 1), 2);
            pool.alive.clone()
        };
        assert_eq!(*alive.0.lock().unwrap(), 0, "every pool thread has exited when drop returns");
    }
}
