//! Which CPUs the calling thread may run on, and pinning it to one of them (Linux's
//! `sched_getaffinity` / `sched_setaffinity`; elsewhere every CPU is allowed and pinning does
//! nothing). VELTAIR's core leases pin a block's threads to the cores leased to it
//! (`layered.rs`), and `serve profile --versions` pins its product and its antagonist.

/// The CPUs the calling thread may run on — the process's, unless the thread was pinned (a
/// thread starts with its creator's set) — (Linux; elsewhere, `0..available_parallelism`).
pub fn allowed_cpus() -> Vec<usize> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: `set` is a plain bit set, zeroed, then filled by the kernel with at most
        // `size_of::<cpu_set_t>()` bytes; `CPU_ISSET` reads bits below `CPU_SETSIZE` only.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) == 0 {
                return (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect();
            }
        }
    }
    (0..std::thread::available_parallelism().map_or(1, |c| c.get())).collect()
}

/// Pin the calling thread to `core`; whether it worked (never off Linux, nor past
/// `CPU_SETSIZE`, nor on a CPU the process may not use).
pub fn pin(core: usize) -> bool {
    #[cfg(target_os = "linux")]
    {
        if core >= libc::CPU_SETSIZE as usize {
            return false;
        }
        // SAFETY: `set` is a plain bit set, zeroed, with one bit below `CPU_SETSIZE` set (checked
        // above); the call reads `size_of::<cpu_set_t>()` bytes of it and changes only this
        // thread's affinity.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(core, &mut set);
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = core;
        false
    }
}

/// The CPU a thread is pinned to, if it pinned itself: a stream thread that runs leased tasks
/// (the layer runner's, a custom model's) re-pins only when a task's lease starts elsewhere.
#[derive(Debug, Default)]
pub struct PinnedTo(Option<usize>);

impl PinnedTo {
    /// Pin the calling thread to `cpu` unless it is there already (a failed pin is retried next
    /// time).
    pub fn pin(&mut self, cpu: usize) {
        if self.0 != Some(cpu) {
            self.0 = pin(cpu).then_some(cpu);
        }
    }
}

#[cfg(all(test, target_os = "linux", not(miri)))]
mod tests {
    use super::*;

    /// The current CPU of the calling thread.
    fn current_cpu() -> usize {
        // SAFETY: no memory preconditions.
        unsafe { libc::sched_getcpu() as usize }
    }

    #[test]
    fn a_pinned_thread_runs_on_its_core_alone() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        let last = *cpus.last().unwrap();
        std::thread::spawn(move || {
            assert!(pin(last));
            for _ in 0..100 {
                std::thread::yield_now();
                assert_eq!(current_cpu(), last);
            }
            let cpus = allowed_cpus();
            assert_eq!(cpus, vec![last], "pinned: one CPU allowed");
            assert!(!pin(usize::MAX), "past CPU_SETSIZE");
        })
        .join()
        .unwrap();
    }
}
