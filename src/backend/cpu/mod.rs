//! The CPU backend: the embedded default and what CI exercises.
//!
//! A real backend, not a mock: GEMM from the `gemm` crate on a thread pool with an explicit core
//! count, one ordered stream thread per worker, and per-stream completion counters read by the
//! same watcher code the CUDA backend's are (runtime/watch.rs; the engine reads these, woken by
//! each stream's notify).

pub mod activation;
pub mod affinity;
pub mod arena;
pub mod cold;
pub mod conv;
pub mod gemm;
mod layered;
pub mod lstm_cell;
mod pool;
mod recurrent;
pub mod stream;
#[cfg(test)]
mod test_util;
pub mod transformer;
pub mod tree_cell;
pub mod versions;

use std::sync::Arc;

use crate::backend::{Backend, BackendKind, Notify, Runner, RunnerShape};
use crate::error::Result;
use crate::model::Network;

use pool::ComputePool;

pub use stream::{CpuSignal, CpuStream, Job};

/// CPU features relevant to the GEMM kernels, as `name: bool` pairs.
pub fn cpu_features() -> Vec<(&'static str, bool)> {
    #[cfg(target_arch = "x86_64")]
    {
        vec![
            ("sse4.2", std::arch::is_x86_feature_detected!("sse4.2")),
            ("avx", std::arch::is_x86_feature_detected!("avx")),
            ("avx2", std::arch::is_x86_feature_detected!("avx2")),
            ("fma", std::arch::is_x86_feature_detected!("fma")),
            ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
        ]
    }
    #[cfg(target_arch = "aarch64")]
    {
        vec![("neon", std::arch::is_aarch64_feature_detected!("neon"))]
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        Vec::new()
    }
}

/// The CPU backend: a compute pool of `threads` threads shared by every model and worker.
pub struct CpuBackend {
    pool: Arc<ComputePool>,
    threads: usize,
    /// The pools of tasks on core leases (the tenant mode), shared by every runner.
    leases: Arc<pool::LeasePools>,
}

impl CpuBackend {
    /// `threads` = 0 means one per available core.
    pub fn new(threads: usize) -> Result<CpuBackend> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
        } else {
            threads
        };
        Ok(CpuBackend {
            pool: Arc::new(ComputePool::new(threads)?),
            threads,
            leases: Arc::new(pool::LeasePools::default()),
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }
}

impl Backend for CpuBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cpu
    }

    fn describe(&self) -> String {
        let feats: Vec<&str> = cpu_features().into_iter().filter(|f| f.1).map(|f| f.0).collect();
        format!("cpu: {} compute thread(s), features [{}]", self.threads, feats.join(" "))
    }

    fn cpu_threads(&self) -> usize {
        self.threads
    }

    /// The recurrent runner runs a padded batch of `lstm` sequences in one task.
    fn max_task_steps(&self) -> u32 {
        u32::MAX
    }

    fn prepare(&self, net: Arc<Network>, shape: RunnerShape, notify: Notify) -> Result<Box<dyn Runner>> {
        if let Network::Custom(_) = &*net {
            let r = crate::backend::custom::CustomRunner::new(
                &net,
                shape.workers,
                shape.max_batch,
                self.threads,
                notify,
            )?;
            return Ok(Box::new(r));
        }
        if net.is_recurrent() {
            let r = recurrent::RecurrentRunner::new(net, shape, self.pool.clone(), self.threads, notify)?;
            return Ok(Box::new(r));
        }
        let r = layered::LayerRunner::new(
            net,
            shape.workers,
            shape.max_batch,
            (self.pool.clone(), self.leases.clone()),
            self.threads,
            notify,
        )?;
        Ok(Box::new(r))
    }
}
