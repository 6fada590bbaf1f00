//! `serve profile MODEL_DIR` for a layer model (mlp, resnet, bert; ARCHITECTURE.md §8.6): each
//! layer's time on the backend, per batch size and (CPU) core count, as the unit VELTAIR schedules
//! and DeepPlan plans — and on CUDA the time to load the layer's weights into device memory.
//!
//! Each layer runs as `Work::Layers { first: k, last: k + 1 }` tasks on a prepared runner, its
//! input the real activations of the layers before it (a whole batch run through layers
//! `0..k` first), tasks of one round launched back to back and collected after one wait; a
//! point is the median of 5 rounds of at least 20 ms. The cost file:
//!
//! ```text
//! {"model": name, "kind": "resnet", "backend": "...", "source": "...",
//!  "layers": [{"name": "layer1.0", "kind": "block", "bytes": 282624, "flops_per_row": 1.9e8,
//!              "load_ms": 0.12 | null, "points": [{"batch": 1, "cores": 2, "us": 1234.5}, ...]}]}
//! ```
//! `load_ms` (CUDA only) is an upload of the layer's weight bytes from pinned host memory, the
//! load half of DeepPlan's profile; executing with the weights left in host memory (direct host
//! access) is not measured here (`dha_ms` is absent: no backend runs a layer that way yet).

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use serve::backend::{Runner, RunnerShape, TaskData, Work};
use serve::{BackendKind, Network};

use crate::profile::ProfileArgs;
use crate::profile::{layer_batch, run_round};
use crate::{CliResult, compute_threads, fatal};

const ROUNDS: usize = 5;
const MIN_ROUND: Duration = Duration::from_millis(20);

/// Run one task and wait for it; its output.
fn run(runner: &dyn Runner, task: Arc<TaskData>) -> CliResult<Vec<f32>> {
    run_round(runner, std::slice::from_ref(&task))?;
    let mut io = task.io.lock().map_err(|_| fatal("a task's data was poisoned"))?;
    Ok(std::mem::take(&mut io.output))
}

/// Median microseconds per task of `make()` tasks, launched `n` at a time (rounds of at least
/// `MIN_ROUND`).
pub(crate) fn time(runner: &dyn Runner, make: &dyn Fn() -> Arc<TaskData>) -> CliResult<f64> {
    run(runner, make())?; // warm-up
    let once = run_round(runner, &[make()])?;
    let n = (MIN_ROUND.as_secs_f64() / once.as_secs_f64().max(1e-6)).ceil().clamp(1.0, 1000.0) as usize;
    let mut rounds = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let tasks: Vec<_> = (0..n).map(|_| make()).collect();
        rounds.push(run_round(runner, &tasks)?.as_secs_f64() * 1e6 / n as f64);
    }
    rounds.sort_by(f64::total_cmp);
    Ok(rounds[ROUNDS / 2])
}

pub(crate) fn profile_layers(net: Network, name: &str, source: &str, a: &ProfileArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let layers = net.layers();
    if layers.is_empty() {
        return Err(fatal(format!("a `{}` model has no layers to profile", net.kind())));
    }
    let backend = serve::backend::create(a.rt.backend.into(), a.rt.threads)?;
    let cpu = backend.kind() == BackendKind::Cpu;
    let all = compute_threads(a.rt.threads);
    let cores: Vec<usize> = if !cpu {
        if !a.cores.is_empty() {
            return Err(fatal("--cores applies to the CPU backend"));
        }
        vec![0]
    } else if a.cores.is_empty() {
        if all > 1 { vec![1, all] } else { vec![1] }
    } else {
        a.cores.clone()
    };
    let mut batches = if a.batches.is_empty() { vec![1, 8] } else { a.batches.clone() };
    batches.sort_unstable();
    batches.dedup();
    let max_batch = *batches.last().expect("batches");
    let net = Arc::new(net);
    let me = std::thread::current();
    let notify: serve::backend::Notify = Arc::new(move || me.unpark());
    let runner = backend.prepare(net.clone(), RunnerShape::fixed(1, max_batch), notify)?;
    println!("# serve profile `{name}` ({}, {} layers) on {}", net.kind(), layers.len(), backend.describe());
    // Each batch size's activations entering every layer: the real ones, layer by layer.
    let mut entering: Vec<Vec<Vec<f32>>> = Vec::new();
    for &b in &batches {
        let mut acts = vec![layer_batch(&net, b)];
        for k in 0..layers.len() - 1 {
            let input = acts[k].clone();
            acts.push(run(&*runner, TaskData::new(b, Work::Layers { first: k, last: k + 1, input }))?);
        }
        entering.push(acts);
    }
    let mut out = Vec::with_capacity(layers.len());
    for (k, l) in layers.iter().enumerate() {
        let mut points = Vec::new();
        for (bi, &b) in batches.iter().enumerate() {
            for &c in &cores {
                let input = &entering[bi][k];
                let us = time(&*runner, &|| {
                    TaskData::with_cores(b, c, Work::Layers { first: k, last: k + 1, input: input.clone() })
                })?;
                points.push(json!({"batch": b, "cores": if cpu { c } else { 0 }, "us": us}));
                println!(
                    "{:<22} batch {b:>4} cores {:>3}: {us:>11.1} us",
                    l.name,
                    if cpu { c.to_string() } else { "-".into() }
                );
            }
        }
        let load_ms = if cpu { None } else { Some(load_time(l.weight_bytes)?) };
        out.push(json!({
            "name": l.name, "kind": l.kind, "bytes": l.weight_bytes, "flops_per_row": l.flops_per_row,
            "load_ms": load_ms, "points": points,
        }));
    }
    let file = json!({
        "model": name,
        "kind": net.kind().name(),
        "backend": backend.describe(),
        "source": format!("serve profile {source} ({} s)", t0.elapsed().as_secs()),
        "layers": out,
    });
    let text = serde_json::to_string_pretty(&file).map_err(|e| fatal(e.to_string()))?;
    let path = a.json.as_ref().ok_or_else(|| fatal("--json names the cost file to write"))?;
    std::fs::write(path, text + "\n").map_err(|e| fatal(format!("cannot write {}: {e}", path.display())))?;
    println!("# wrote {}", path.display());
    Ok(())
}

/// Milliseconds to upload `bytes` from pinned host memory to device 0 (median of 5).
fn load_time(bytes: u64) -> CliResult<f64> {
    use serve::backend::cuda::CudaDevice;
    let n = (bytes as usize / 4).max(1);
    let dev = CudaDevice::open(0)?;
    let mut host = dev.pinned_mapped::<f32>(n)?;
    host.write(0, &vec![0.5f32; n])?;
    let s = dev.stream()?;
    let mut d = dev.alloc::<f32>(n)?;
    let mut times = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        // SAFETY: `host` is pinned memory of `n` values, written only before this copy and alive
        // until after the stream is synchronised below; `d` holds `n` values.
        unsafe { s.upload_into_async(&mut d, 0, std::slice::from_raw_parts(host.host_ptr(), n)) }?;
        s.synchronize()?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}
