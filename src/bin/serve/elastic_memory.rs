//! E²bird's memory figure (spec E8: the elastic engine in at most half the device memory of
//! running its workers without sharing), measured on a CUDA device for `serve bench elastic`.
//!
//! Two ways to hold the same workers, each measured as the drop in the device's free memory
//! (`cuMemGetInfo`) while its runners are alive:
//! * **shared**: one runner with every worker (how the runtime prepares an elastic model):
//!   the weights once, a stream, cuBLAS handle and activation buffers per worker;
//! * **one instance per worker** (E²bird's NM-Ebird, "no sharing"): a runner of one worker per
//!   batch size, each with its own copy of the weights.
//!
//! Neither counts the input ring (both would hold one). The CUDA runner sizes every worker's
//! buffers for the model's largest task, not for the worker's own batch size (per-worker arenas
//! are not built), which this figure shows.

use std::sync::Arc;

use serde_json::{Value, json};
use serve::backend::cuda::CudaDevice;
use serve::backend::{Backend, BackendKind, RunnerShape};
use serve::model::Network;

use crate::CliResult;

const MIB: f64 = 1024.0 * 1024.0;

/// Device memory the runners made by `make` hold, in bytes (the free memory's drop while they
/// live).
fn held(
    device: &CudaDevice,
    make: impl FnOnce() -> CliResult<Vec<Box<dyn serve::backend::Runner>>>,
) -> CliResult<u64> {
    device.synchronize()?;
    let (before, _) = device.memory()?;
    let runners = make()?;
    device.synchronize()?;
    let (after, _) = device.memory()?;
    drop(runners);
    device.synchronize()?;
    Ok(before.saturating_sub(after))
}

/// On a CUDA backend: the memory of `workers` (batch sizes) shared in one runner and as one
/// runner each, printed and returned as JSON; `None` on any other backend.
pub(crate) fn measure(
    backend: &dyn Backend,
    net: &Arc<Network>,
    workers: &[usize],
) -> CliResult<Option<Value>> {
    if backend.kind() != BackendKind::Cuda || workers.is_empty() {
        return Ok(None);
    }
    let device = CudaDevice::open(0)?;
    let notify: serve::backend::Notify = Arc::new(|| {});
    let largest = workers.iter().copied().max().unwrap_or(1);
    let shared = held(&device, || {
        Ok(vec![backend.prepare(net.clone(), RunnerShape::fixed(workers.len(), largest), notify.clone())?])
    })?;
    let separate = held(&device, || {
        workers
            .iter()
            .map(|&bs| Ok(backend.prepare(net.clone(), RunnerShape::fixed(1, bs), notify.clone())?))
            .collect()
    })?;
    let ratio = if separate > 0 { shared as f64 / separate as f64 } else { f64::NAN };
    println!(
        "# E8 memory, workers {workers:?}: shared engine {:.1} MiB, one instance per worker {:.1} MiB: {ratio:.2}× \
         (goal ≤ 0.5×; no per-worker arenas: every worker's buffers hold the largest task)",
        shared as f64 / MIB,
        separate as f64 / MIB
    );
    Ok(Some(json!({
        "workers": workers,
        "shared_bytes": shared,
        "one_instance_per_worker_bytes": separate,
        "ratio": ratio,
    })))
}
