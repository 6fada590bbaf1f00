//! `serve profile MODEL_DIR --engine-configs FILE` (issue 15 item 3, E4): E-Ebird's offline
//! profile on the real backend. For each TotalBS of 4, 8, 16 and 32, every configuration of
//! workers of batch sizes 2^p summing to it (4 + 10 + 36 + 202, `serve::sched::elastic::confs`)
//! runs co-running: one task of each worker's batch size launched on its own stream at once, the
//! time from the launch to each stream's end taken as that worker's latency. The configuration's
//! score is the mean latency of its requests (each worker's weighted by its batch size; E²bird's
//! unweighted mean over workers is recorded beside it, and why the pick differs from it on a CPU
//! is at `Scored`), the median over rounds. The argmin of each level is written, with every
//! score:
//!
//! ```text
//! {"model": name, "backend": "...", "source": "...",
//!  "engine_confs": {"4": [4], "8": [4, 4], "16": [...], "32": [...]},
//!  "scores": {"4": [{"workers": [4], "mean_ms": 1.2, "worker_mean_ms": 1.2, "makespan_ms": 1.2},
//!             ...], ...}}
//! ```
//!
//! `serve bench elastic`, `serve sim elastic` (`--engine-configs`) and the C ABI
//! (`serve_model_options_add_engine_config`, one call per level) take the picks. On the CPU the
//! workers' streams share the backend's compute pool, so a configuration's workers compete for
//! its cores as co-running GPU streams compete for SMs.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use serve::Network;
use serve::backend::{Runner, RunnerShape, TaskData, Work};
use serve::sched::elastic::confs::{Scored, configurations, pick};

use crate::bench::read_capped;
use crate::profile::layer_batch;
use crate::{CliResult, fatal};

/// Rounds per configuration at least, and the least time they take together (the median
/// round's score is kept).
const MIN_ROUNDS: usize = 3;
const MAX_ROUNDS: usize = 15;
const MIN_TIME: Duration = Duration::from_millis(30);
/// Largest engine-configurations file read.
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Co-run `conf` (one task of each batch size, worker `i` on stream `i`) once: each worker's
/// milliseconds from the common launch to its stream's end.
fn co_run(runner: &dyn Runner, conf: &[usize], inputs: &BTreeMap<usize, Vec<f32>>) -> CliResult<Vec<f64>> {
    let tasks: Vec<Arc<TaskData>> =
        conf.iter().map(|bs| TaskData::new(*bs, Work::Dense(inputs[bs].clone()))).collect();
    let signals: Vec<_> = (0..conf.len()).map(|w| runner.signal(w)).collect();
    let start = Instant::now();
    let mut targets = Vec::with_capacity(conf.len());
    for (w, t) in tasks.iter().enumerate() {
        targets.push(runner.launch(w, t.clone())?);
    }
    let mut ended: Vec<Option<f64>> = vec![None; conf.len()];
    while ended.iter().any(Option::is_none) {
        for (w, e) in ended.iter_mut().enumerate() {
            if e.is_none() && signals[w].completed() >= targets[w] {
                *e = Some(start.elapsed().as_secs_f64() * 1e3);
            }
        }
        // A CPU stream unparks this thread at each task's end; a CUDA counter does not notify.
        std::thread::park_timeout(Duration::from_micros(50));
    }
    for (w, t) in tasks.iter().enumerate() {
        runner.collect(w, t);
    }
    if let Some(e) = tasks.iter().find_map(|t| t.io.lock().unwrap_or_else(|p| p.into_inner()).error.clone()) {
        return Err(fatal(format!("a profiled task failed: {e}")));
    }
    Ok(ended.into_iter().flatten().collect())
}

/// The scores of `conf`'s median round (by the mean request latency).
fn score(runner: &dyn Runner, conf: &[usize], inputs: &BTreeMap<usize, Vec<f32>>) -> CliResult<Scored> {
    co_run(runner, conf, inputs)?; // warm-up: every stream's buffers sized for its batch
    let start = Instant::now();
    let mut rounds = Vec::new();
    while rounds.len() < MIN_ROUNDS || (start.elapsed() < MIN_TIME && rounds.len() < MAX_ROUNDS) {
        rounds.push(Scored::from_ends(conf.to_vec(), &co_run(runner, conf, inputs)?));
    }
    rounds.sort_by(|a, b| a.mean_ms.total_cmp(&b.mean_ms));
    Ok(rounds.swap_remove(rounds.len() / 2))
}

/// Profile every configuration of `totals` on `backend` and write the picks and scores to
/// `path`, if given; the picks.
pub(crate) fn profile_engine_configs(
    net: Arc<Network>,
    name: &str,
    source: &str,
    backend: &dyn serve::backend::Backend,
    totals: &[usize],
    path: Option<&Path>,
) -> CliResult<BTreeMap<usize, Vec<usize>>> {
    if net.is_recurrent() {
        return Err(fatal(format!(
            "--engine-configs profiles a fixed-shape model (mlp, resnet, bert, custom), not a {}",
            net.kind()
        )));
    }
    let t0 = Instant::now();
    let largest = totals.iter().copied().max().unwrap_or(1);
    // The most workers any configuration runs: `largest` workers of batch size 1.
    let me = std::thread::current();
    let notify: serve::backend::Notify = Arc::new(move || me.unpark());
    let runner = backend.prepare(net.clone(), RunnerShape::fixed(largest, largest), notify)?;
    let mut inputs = BTreeMap::new();
    let mut bs = 1;
    while bs <= largest {
        inputs.insert(bs, layer_batch(&net, bs));
        bs *= 2;
    }
    println!(
        "# serve profile --engine-configs `{name}` ({}) on {}: {} configurations co-running",
        net.kind(),
        backend.describe(),
        totals.iter().map(|&t| configurations(t).len()).sum::<usize>()
    );
    let mut scored: BTreeMap<usize, Vec<Scored>> = BTreeMap::new();
    for &total in totals {
        let mut list = Vec::new();
        for conf in configurations(total) {
            list.push(score(&*runner, &conf, &inputs)?);
        }
        scored.insert(total, list);
    }
    let picks = pick(&scored);
    for (total, list) in &scored {
        let single = list.iter().find(|s| s.workers == [*total]);
        let worst = list.iter().map(|s| s.mean_ms).fold(f64::NAN, f64::max);
        let best = picks.get(total).and_then(|b| list.iter().find(|s| &s.workers == b));
        let (Some(best), Some(single)) = (best, single) else { continue };
        println!(
            "TotalBS {total:>2}: {:>3} configurations, best {:?} {:.3} ms mean request latency (last worker \
             {:.3} ms); one bs-{total} worker {:.3} ms ({:.2}×); worst {worst:.3} ms",
            list.len(),
            best.workers,
            best.mean_ms,
            best.makespan_ms,
            single.mean_ms,
            single.mean_ms / best.mean_ms
        );
    }
    let scores: serde_json::Map<String, Value> = scored
        .iter()
        .map(|(t, list)| {
            let v = list
                .iter()
                .map(|s| {
                    json!({"workers": s.workers, "mean_ms": s.mean_ms, "worker_mean_ms": s.worker_mean_ms,
                           "makespan_ms": s.makespan_ms})
                })
                .collect();
            (t.to_string(), Value::Array(v))
        })
        .collect();
    let file = json!({
        "model": name,
        "backend": backend.describe(),
        "source": format!("serve profile --engine-configs {source} ({} s)", t0.elapsed().as_secs()),
        "engine_confs": picks.iter().map(|(t, c)| (t.to_string(), json!(c))).collect::<serde_json::Map<_, _>>(),
        "scores": scores,
    });
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(&file).map_err(|e| fatal(e.to_string()))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| fatal(format!("cannot write {}: {e}", path.display())))?;
        println!("# wrote {}", path.display());
    }
    Ok(picks)
}

/// An engine-configurations file: `serve profile --engine-configs`'s (its `engine_confs`) or a
/// bare `{"TotalBS": [batch sizes], …}` object.
pub(crate) fn read_engine_configs(path: &Path) -> CliResult<BTreeMap<usize, Vec<usize>>> {
    let text = read_capped(path, MAX_FILE_BYTES).map_err(fatal)?;
    let v: Value = serde_json::from_str(&text).map_err(|e| fatal(format!("{}: {e}", path.display())))?;
    let confs = v.get("engine_confs").unwrap_or(&v);
    let raw: BTreeMap<String, Vec<usize>> = serde_json::from_value(confs.clone()).map_err(|e| {
        fatal(format!(
            "{}: not an engine-configurations file ({{\"engine_confs\": {{\"TotalBS\": [batch sizes]}}}} or the \
             inner object): {e}",
            path.display()
        ))
    })?;
    raw.into_iter()
        .map(|(k, v)| {
            let total = k
                .parse::<usize>()
                .map_err(|_| fatal(format!("{}: `{k}` is not a TotalBS", path.display())))?;
            Ok((total, v))
        })
        .collect()
}
