//! `serve profile`: measure the real backend into a cost file for the simulator
//! (ARCHITECTURE.md §8, `serve::sim::cost`).
//!
//! * Per cell type and batch size: the time one task holds its worker's stream, measured by
//!   launching a round of tasks at once on a prepared runner (a backlogged worker's stream is
//!   always fed: the engine launches ahead of it) and dividing the round's time by their number. Rows use distinct state slots; tree internal
//!   rows read two children each. The time spent inside the runner's launch calls is the
//!   task's `issue` (the engine thread's own work, a resource all workers share in the
//!   simulator); when it is most of the round (a CUDA task at small batches: the stream waits
//!   for the host between tasks) the stream's time is the backend's own timing of the tasks.
//! * Cold starts (`idle`): tasks of the first cell type (1, 4 and 16 rows) one at a time with the
//!   stream idle for 0.1, 0.3, 1 or 3 ms before each, their compute as the stream times it; the
//!   median factor over no pause, per pause (never decreasing with the pause).
//! * The engine's delays: requests of 1 and of 24 cell steps sent one at a time through a real
//!   runtime, each step waiting for the one before. With the tasks each ran and the compute the
//!   stream measured of them (the runtime's stats), the round trips separate the hand-off each
//!   task pays (`launch_us` + `report_us`, split evenly, beyond a one-row task's issue) from what each request pays once
//!   (`arrival_us` + `delivery_us`: the submit reaching the engine, the completion reaching the
//!   caller, split evenly).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::json;

use serve::backend::{CellRow, CellTask, RunnerShape, TaskData, Work};
use serve::model::{DECODER, INTERNAL, NO_TOKEN};
use serve::runtime::{MAX_BATCH_LIMIT, MAX_CPU_THREADS};
use serve::sim::{CellCost, CostFile};
use serve::{CellularOptions, Input, ModelOptions, Network, PolicyConfig, SubmitOptions};

use crate::bench_coldstart;
use crate::bench_rnn::{RnnKind, random_network};
use crate::{CliResult, RandomRnnArgs, RuntimeArgs, fatal, gemm_shape, in_range, positive};

#[derive(Args, Debug)]
pub(crate) struct ProfileArgs {
    /// Model directory of the model to profile (recurrent: per cell type; mlp, resnet, bert: per
    /// layer).
    #[arg(required_unless_present_any = ["random_kind", "versions", "coldstart"], conflicts_with = "random_kind")]
    pub(crate) model_dir: Option<PathBuf>,
    /// DeepPlan's cold-start profile (per layer: bytes, load, in-memory and DHA times) on the CPU
    /// executor with an emulated bus, of an mlp MODEL_DIR or, without one, `serve bench
    /// coldstart`'s model; written to --json for `serve plan deepplan`.
    #[arg(long, conflicts_with_all = ["random_kind", "versions", "engine_configs"])]
    pub(crate) coldstart: bool,
    /// --coldstart: the emulated host → device copy rate, GB/s.
    #[arg(long, default_value_t = 0.5, value_parser = bench_coldstart::bus_gbps)]
    pub(crate) h2d_gbps: f64,
    /// --coldstart: the emulated direct host read rate, GB/s.
    #[arg(long, default_value_t = 0.5, value_parser = bench_coldstart::bus_gbps)]
    pub(crate) dha_gbps: f64,
    /// Profile the benchmarks' random model of this kind instead (`serve bench`'s defaults).
    #[arg(long = "random", value_enum)]
    pub(crate) random_kind: Option<RnnKind>,
    /// Hidden (= embedding) size of the random model.
    #[arg(long, default_value_t = crate::bench_rnn::CPU_HIDDEN, value_parser = positive())]
    pub(crate) hidden: usize,
    #[command(flatten)]
    pub(crate) random: RandomRnnArgs,
    /// Seed of the random model.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Batch sizes to time (at most 65536 each; default: 1, 2, 4, … 512 for a recurrent model,
    /// 1 and 8 for a layer model).
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = in_range(1, MAX_BATCH_LIMIT))]
    pub(crate) batches: Vec<usize>,
    /// Layer models on the CPU: the core counts to time each layer with (default: 1 and all).
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = in_range(1, MAX_CPU_THREADS))]
    pub(crate) cores: Vec<usize>,
    #[command(flatten)]
    pub(crate) rt: RuntimeArgs,
    /// Where to write the cost file.
    #[arg(long, required_unless_present_any = ["engine_configs", "versions"])]
    pub(crate) json: Option<PathBuf>,
    /// VELTAIR's multi-version kernels of one product `MxKxN` (e.g. 196x2304x256): time every
    /// candidate version (outer tiles, loop order, where the parallelism sits) alone on 1 and 2
    /// cores and on one core beside a memory antagonist at --levels intensities on the other;
    /// print the versions kept and whether the solo-best one loses under interference.
    #[arg(long, value_parser = gemm_shape,
          conflicts_with_all = ["model_dir", "random_kind", "engine_configs", "batches", "cores"])]
    pub(crate) versions: Option<(usize, usize, usize)>,
    /// Antagonist intensities of --versions (level 0: none), 2 to 10.
    #[arg(long, default_value_t = 5, value_parser = in_range(2, 10))]
    pub(crate) levels: usize,
    /// A fixed-shape model: co-run every E-Ebird engine configuration (TotalBS 4, 8, 16, 32:
    /// 252 of them) on the backend and write the least mean latency's per level, with every
    /// score, to this file (for `serve bench elastic`, `serve sim elastic` and the C ABI).
    #[arg(long, conflicts_with_all = ["json", "random_kind", "batches", "cores"])]
    pub(crate) engine_configs: Option<PathBuf>,
}

/// Tasks timed per round at least, the least time per round, and rounds per point (the
/// median round is kept: one descheduled round on a busy machine does not move it).
const MIN_TASKS: usize = 5;
const MIN_TIME: Duration = Duration::from_millis(40);
/// Most tasks one round launches ahead (their data is built before the round is timed).
const MAX_TASKS: usize = 4096;
const ROUNDS: usize = 5;
/// Untimed tasks before the first point (thread pool and caches warm).
const WARMUP_TASKS: usize = 50;
/// Spreads the profile's tokens over the vocabulary.
const TOKEN_STRIDE: usize = 7919;
/// Odd, so `k * SLOT_STRIDE` visits distinct slots of a power-of-two arena.
const SLOT_STRIDE: usize = 1237;
/// Round trips timed for the engine delays.
const ROUND_TRIPS: usize = 400;
/// Pauses before the cold-start tasks, and tasks timed per pause and size.
const IDLE_PAUSES_US: [u64; 4] = [100, 300, 1000, 3000];
const IDLE_TASKS: usize = 60;
/// Cell steps of the long requests that separate per-task from per-request delays.
const LONG_STEPS: usize = 24;

/// Launching took at least this share of a round: the stream waited for the launch calls
/// between tasks, so the round's time per task is the issuing thread's, not the stream's.
const ISSUE_BOUND: f64 = 0.9;

/// One timed round of back-to-back tasks.
struct Round {
    /// The round's time over its tasks.
    per_task_us: f64,
    /// Time per task inside the runner's launch calls (the engine thread's issue).
    issue_us: f64,
    /// The backend's own timing of each task's work (CUDA events, the CPU stream's clock),
    /// averaged, when it timed every task.
    compute_us: Option<f64>,
}

impl Round {
    fn of(per_task_us: f64, issued: Duration, tasks: &[Arc<TaskData>], count: usize) -> Round {
        let timed: Vec<f64> = tasks
            .iter()
            .filter_map(|t| t.io.lock().ok()?.stages.compute)
            .map(|d| d.as_secs_f64() * 1e6)
            .collect();
        let compute_us = (!timed.is_empty() && timed.len() == tasks.len())
            .then(|| timed.iter().sum::<f64>() / timed.len() as f64);
        Round { per_task_us, issue_us: issued.as_secs_f64() * 1e6 / count.max(1) as f64, compute_us }
    }

    /// The time a task holds its stream: the round's time per task, unless the round was bound
    /// by its launch calls and the backend timed the tasks' work; then that work (the simulator
    /// charges the issue to the engine thread, so counting it on the stream too would be twice).
    fn stream_us(&self) -> f64 {
        match self.compute_us {
            Some(c) if self.issue_us >= ISSUE_BOUND * self.per_task_us => c.min(self.per_task_us),
            _ => self.per_task_us,
        }
    }
}

/// Builds the profile's tasks of one cell type: rows on distinct state slots (an odd stride over
/// the arena from a base that moves on with every task), tokens spread over the vocabulary as
/// real text's are (the embedding rows a task reads are not all in cache), a tree's internal
/// rows reading two children each.
struct CellTasks {
    kind: serve::ModelKind,
    cell: u8,
    slots: usize,
    vocab: usize,
    base: usize,
}

impl CellTasks {
    fn make(&mut self, b: usize, first: bool) -> Arc<TaskData> {
        let (base, slots, cell) = (self.base, self.slots, self.cell);
        let slot = |k: usize| ((base + k * SLOT_STRIDE) % slots) as u32;
        let mut t =
            CellTask { cell, rows: Vec::with_capacity(b), children: Vec::new(), ..CellTask::default() };
        for i in 0..b {
            let (token, children) = if self.kind == serve::ModelKind::TreeLstm && cell == INTERNAL {
                let at = t.children.len() as u32;
                t.children.extend([slot(b + 2 * i), slot(b + 2 * i + 1)]);
                (NO_TOKEN, at..at + 2)
            } else if self.kind == serve::ModelKind::Seq2Seq && cell == DECODER {
                (NO_TOKEN, 0..0)
            } else {
                ((((base + i) * TOKEN_STRIDE) % (self.vocab - 3)) as u32 + 3, 0..0)
            };
            t.rows.push(CellRow { steps: 1, slot: slot(i), token, first, children, output: false });
        }
        self.base = (base + 3 * b + 1) % slots;
        TaskData::new(b, Work::Cells(t))
    }
}

/// Requests timed one at a time: the mean round trip, tasks per request, compute per task.
struct RoundTrip {
    micros: f64,
    tasks: f64,
    compute_us: f64,
}

pub(crate) fn cmd_profile(a: ProfileArgs) -> CliResult<()> {
    if let Some(shape) = a.versions {
        return crate::profile_versions::profile_versions(shape, &a);
    }
    if a.coldstart {
        let json = a.json.as_ref().ok_or_else(|| fatal("--coldstart writes its profile to --json FILE"))?;
        return crate::bench_coldstart::profile_coldstart(
            a.model_dir.as_deref(),
            a.h2d_gbps,
            a.dha_gbps,
            json,
        );
    }
    let t0 = Instant::now();
    let (net, name, source) = match (&a.model_dir, a.random_kind) {
        (Some(dir), None) => {
            let net = serve::model::load(dir)
                .map_err(|e| fatal(format!("cannot load model {}: {e}", dir.display())))?;
            let name = dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
            (net, name, dir.display().to_string())
        }
        (None, Some(kind)) => {
            let net = random_network(
                kind,
                a.random.vocab,
                a.hidden,
                a.hidden,
                a.random.layers,
                a.random.max_decode,
                a.seed,
            )?;
            (net, format!("random-{}", kind.name()), format!("random(seed={})", a.seed))
        }
        _ => return Err(fatal("give a MODEL_DIR or --random KIND (one of them)")),
    };
    if let Some(path) = &a.engine_configs {
        let backend = serve::backend::create(a.rt.backend.into(), a.rt.threads)?;
        let totals = serve::sched::elastic::confs::PROFILED_TOTALS;
        crate::profile_engine::profile_engine_configs(
            Arc::new(net),
            &name,
            &source,
            &*backend,
            &totals,
            Some(path),
        )?;
        return Ok(());
    }
    if !net.is_recurrent() {
        return crate::profile_layers::profile_layers(net, &name, &source, &a);
    }
    if !a.cores.is_empty() {
        return Err(fatal("--cores applies to layer models; a recurrent model is profiled per cell type"));
    }
    let backend = serve::backend::create(a.rt.backend.into(), a.rt.threads)?;
    let mut batches =
        if a.batches.is_empty() { vec![1, 2, 4, 8, 16, 32, 64, 128, 256, 512] } else { a.batches.clone() };
    batches.sort_unstable();
    batches.dedup();
    let max_batch = batches.last().copied().unwrap_or(1);
    let net = Arc::new(net);
    let me = std::thread::current();
    let notify: serve::backend::Notify = Arc::new(move || me.unpark());
    // As many state slots as the runtime gives a model by default, rows spread over them as
    // live requests' slots are (a task gathers and scatters state from all over the arena).
    let slots = (3 * max_batch).max(serve::runtime::DEFAULT_ADMISSION_BOUND);
    // Token-gate tables as a model gets them by default, so that the costs are the runtime's.
    let shape = RunnerShape {
        workers: 1,
        max_batch,
        state_slots: slots,
        token_gates_bytes: serve::runtime::DEFAULT_TOKEN_GATES_BYTES,
    };
    let runner = backend.prepare(net.clone(), shape, notify)?;
    println!("# serve profile `{name}` ({}) on {}", net.kind(), backend.describe());
    let vocab = match &*net {
        Network::Lstm(m) => m.cfg.vocab,
        Network::Seq2Seq(m) => m.cfg.vocab,
        Network::TreeLstm(m) => m.cfg.vocab,
        Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => 4,
    }
    .max(4);
    let mut cells = Vec::new();
    for (c, info) in net.cell_types().iter().enumerate() {
        let cell = c as u8;
        let mut points = Vec::new();
        let mut issue = Vec::new();
        let mut tasks_of = CellTasks { kind: net.kind(), cell, slots, vocab, base: 0 };
        for &b in &batches {
            let mut task = |first: bool| tasks_of.make(b, first);
            // Warm up, then time rounds of back-to-back tasks until both minimums are met.
            // The warm-up starts every slot's state (first steps), the timed tasks continue it.
            let warmup = if points.is_empty() && cells.is_empty() { WARMUP_TASKS } else { 2 };
            let tasks: Vec<_> = (0..warmup).map(|_| task(true)).collect();
            run_round(&*runner, &tasks)?;
            // Rounds keep the stream fed, as a backlogged worker is (the engine launches ahead of
            // it, up to the lookahead): a round's tasks are all launched before the one wait for
            // the last, so waking this thread is paid once per round, not once per few tasks. The
            // first round (MIN_TASKS tasks, not kept) sizes the others to about MIN_TIME.
            // The second round (not kept either) runs that many once, so the runner's per-task
            // buffers (a CUDA task's pinned staging) have grown to a round's worth before any
            // round is timed; the count then stays fixed.
            let mut rounds: Vec<Round> = Vec::with_capacity(ROUNDS);
            let mut count = MIN_TASKS;
            for round in 0..ROUNDS + 2 {
                let tasks: Vec<_> = (0..count).map(|_| task(false)).collect();
                let (took, issued) = run_round_issued(&*runner, &tasks)?;
                let per_task = took.as_secs_f64() * 1e6 / count as f64;
                if round == 0 {
                    count = ((MIN_TIME.as_secs_f64() * 1e6 / per_task.max(1.0)) as usize)
                        .clamp(MIN_TASKS, MAX_TASKS);
                } else if round > 1 {
                    rounds.push(Round::of(per_task, issued, &tasks, count));
                }
            }
            rounds.sort_by(|x, y| x.per_task_us.total_cmp(&y.per_task_us));
            let r = &rounds[ROUNDS / 2];
            let us = r.stream_us();
            println!(
                "{:<10} batch {b:>5}: {us:>10.1} us per task{} ({:.1} us issuing)",
                info.name,
                if us < r.per_task_us {
                    format!(" on the stream, {:.1} us issue-bound", r.per_task_us)
                } else {
                    String::new()
                },
                r.issue_us
            );
            points.push((b, us));
            issue.push((b, r.issue_us));
        }
        // The fewest rows that run on the whole compute pool (CPU: its threads are shared with
        // co-running workers, `cores` below); none on a device or a one-thread pool.
        let pool_rows = (1..=max_batch).find(|&rows| runner.task_threads(cell, rows) > 1);
        cells.push(CellCost { cell: info.name.to_string(), points, issue, pool_rows });
    }
    // Cold starts: tasks of the first cell type one at a time, the stream idle for a pause
    // before each, their compute as the stream times it; the factor over no pause, the median
    // over a few sizes.
    let mut idle = Vec::new();
    let cold = |rows: usize, pause: Duration, seed: usize| -> CliResult<f64> {
        let mut times = Vec::with_capacity(IDLE_TASKS);
        for i in 0..IDLE_TASKS + 10 {
            let base = seed * 7 + i * 3 * rows;
            let cells = (0..rows)
                .map(|k| CellRow {
                    steps: 1,
                    slot: ((base + k * SLOT_STRIDE) % slots) as u32,
                    token: (((base + k) * TOKEN_STRIDE) % (vocab - 3)) as u32 + 3,
                    first: false,
                    children: 0..0,
                    output: false,
                })
                .collect();
            let t = TaskData::new(
                rows,
                Work::Cells(CellTask { cell: 0, rows: cells, children: Vec::new(), ..CellTask::default() }),
            );
            run_round(&*runner, std::slice::from_ref(&t))?;
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
            let compute = t.io.lock().map_err(|_| fatal("a task's data was poisoned"))?.stages.compute;
            if i >= 10 {
                times.push(compute.unwrap_or_default().as_secs_f64());
            }
        }
        times.sort_by(f64::total_cmp);
        Ok(times[times.len() / 2])
    };
    let sizes: Vec<usize> = [1, 4, 16].into_iter().filter(|&r| r <= max_batch).collect();
    let warm: Vec<f64> = sizes.iter().map(|&r| cold(r, Duration::ZERO, 1)).collect::<CliResult<_>>()?;
    for pause_us in IDLE_PAUSES_US {
        let mut factors: Vec<f64> = Vec::new();
        for (k, &r) in sizes.iter().enumerate() {
            factors.push(cold(r, Duration::from_micros(pause_us), 2)? / warm[k].max(1e-9));
        }
        factors.sort_by(f64::total_cmp);
        let f = factors[factors.len() / 2].max(idle.last().map_or(1.0, |p: &(f64, f64)| p.1));
        idle.push((pause_us as f64, f));
    }
    println!(
        "# cold starts: a task after the stream idled {} us takes {} × as long",
        IDLE_PAUSES_US.map(|p| p.to_string()).join(" / "),
        idle.iter().map(|p| format!("{:.2}", p.1)).collect::<Vec<_>>().join(" / ")
    );
    drop(runner);
    let mut file = CostFile {
        name: format!("profile-{name}"),
        source: String::new(),
        backend: backend.describe(),
        model: model_json(&net),
        cells,
        launch_us: 0.0,
        report_us: 0.0,
        arrival_us: 0.0,
        delivery_us: 0.0,
        idle,
        max_task_steps: backend.max_task_steps(),
        // The CPU backend's workers are streams of their own whose tasks run on the stream's
        // thread or the compute pool, sharing the backend's cores; a device's are not. The
        // pool's threads are the cores shared (with the default `--threads 0`, one per core).
        shared_device: false,
        cores: backend.cpu_threads(),
    };

    // Engine delays: requests one at a time through a real runtime, each cell step waiting for
    // the one before (MaxTasksToSubmit 1), so every task pays the whole hand-off. A request's
    // round trip is its arrival and delivery once, plus launch + compute + report per task; the
    // stats give the tasks each request ran and the compute the stream measured of them, so two
    // request lengths separate the per-task hand-off from the per-request part.
    let rt = crate::build_runtime(a.rt)?;
    let input = |len: usize| match &*net {
        Network::TreeLstm(_) => {
            Input::Tree { tokens: vec![3; len], parents: (0..len as i32).map(|i| i - 1).collect() }
        }
        _ => Input::Tokens(vec![3; len]),
    };
    let opts = ModelOptions {
        policy: PolicyConfig::Cellular(CellularOptions {
            workers: 1,
            max_tasks_to_submit: Some(1),
            ..CellularOptions::default()
        }),
        ..ModelOptions::default()
    };
    let model = rt.add_network(net.clone(), name.clone(), opts)?;
    let timed = |input: &Input, n: usize| -> CliResult<RoundTrip> {
        for _ in 0..20 {
            model.submit(input.clone(), SubmitOptions::default())?.wait()?;
        }
        let before = rt.stats();
        let start = Instant::now();
        for _ in 0..n {
            model.submit(input.clone(), SubmitOptions::default())?.wait()?;
        }
        let micros = start.elapsed().as_secs_f64() * 1e6 / n as f64;
        let after = rt.stats();
        let tasks = after.tasks_launched.saturating_sub(before.tasks_launched) as f64;
        let timed = after.timed_tasks.saturating_sub(before.timed_tasks) as f64;
        let compute = after.task_compute_ns.saturating_sub(before.task_compute_ns) as f64 * 1e-3;
        Ok(RoundTrip { micros, tasks: tasks / n as f64, compute_us: compute / timed.max(1.0) })
    };
    let short = timed(&input(1), ROUND_TRIPS)?;
    let long = timed(&input(LONG_STEPS), ROUND_TRIPS / 4)?;
    // r = entry_exit + tasks × (hand-off + compute), for both lengths.
    let own = |r: &RoundTrip| r.micros - r.tasks * r.compute_us;
    let hand_off = if long.tasks > short.tasks + 0.5 {
        ((own(&long) - own(&short)) / (long.tasks - short.tasks)).max(0.0)
    } else {
        0.0
    };
    let entry_exit = (own(&short) - short.tasks * hand_off).max(0.0);
    // A lone task ends when both its issue and its work have (the simulator's reading), so
    // the part of a one-row issue beyond the task's compute is in the hand-off measured here,
    // and the simulator adds it from the `issue` points: the delays are the rest.
    let issue_one = file.cells.first().map_or(0.0, |c| file.issue_micros(&c.cell, 1));
    let beyond = (hand_off - (issue_one - short.compute_us).max(0.0)).max(0.0);
    println!(
        "# engine: round trip {:.1} us for {:.1} task(s) of {:.1} us compute, {:.1} us for {:.1} of {:.1} us: \
         {hand_off:.1} us hand-off per task (a one-row issue {issue_one:.1}; launch_us = report_us = {:.1}), \
         {entry_exit:.1} us per request (arrival_us = delivery_us = {:.1})",
        short.micros,
        short.tasks,
        short.compute_us,
        long.micros,
        long.tasks,
        long.compute_us,
        beyond / 2.0,
        entry_exit / 2.0,
    );
    file.launch_us = beyond / 2.0;
    file.report_us = beyond / 2.0;
    file.arrival_us = entry_exit / 2.0;
    file.delivery_us = entry_exit / 2.0;
    file.source = format!("serve profile {source} ({} s)", t0.elapsed().as_secs());
    let text = serde_json::to_string_pretty(&file).map_err(|e| fatal(e.to_string()))?;
    let path = a.json.as_ref().ok_or_else(|| fatal("--json names the cost file to write"))?;
    std::fs::write(path, text + "\n").map_err(|e| fatal(format!("cannot write {}: {e}", path.display())))?;
    println!("# wrote {}", path.display());
    Ok(())
}

fn model_json(net: &Network) -> serde_json::Value {
    let kind = net.kind().name();
    match net {
        Network::Lstm(m) => {
            json!({"kind": kind, "hidden": m.cfg.hidden, "embed": m.cfg.embed, "layers": m.cfg.layers})
        }
        Network::Seq2Seq(m) => {
            json!({"kind": kind, "hidden": m.cfg.hidden, "embed": m.cfg.embed, "layers": m.cfg.layers,
                   "vocab": m.cfg.vocab, "max_decode": m.cfg.max_decode})
        }
        Network::TreeLstm(m) => json!({"kind": kind, "hidden": m.cfg.hidden, "embed": m.cfg.embed}),
        Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => json!({"kind": kind}),
    }
}

/// The rows of a whole-model task of `rows` requests of a layer model, for the benchmarks and
/// profiles: random vectors / images, or for bert `seq_len` token ids (every request full length).
pub(crate) fn layer_batch(net: &Network, rows: usize) -> Vec<f32> {
    match net {
        Network::Bert(m) => (0..rows * m.cfg.seq_len).map(|i| ((i * 7919) % m.cfg.vocab) as f32).collect(),
        _ => serve::workload::values(rows * net.dense_lens().0, rows as u64, 1.0),
    }
}

/// Launch `tasks` on worker 0 back to back, wait until the stream has run them all, and
/// collect each, as the engine does; the time from the first launch until the last task is
/// counted (the benchmarks and profiles time rounds with it). Collection matters beyond the
/// outputs: a collected task's buffers are reused by the next ones (an uncollected CUDA task
/// keeps its pinned staging, and every later launch would allocate new, about a millisecond
/// each). A task that failed fails the round, naming the error.
pub(crate) fn run_round(runner: &dyn serve::backend::Runner, tasks: &[Arc<TaskData>]) -> CliResult<Duration> {
    run_round_issued(runner, tasks).map(|(took, _)| took)
}

/// [`run_round`], and the time this thread spent inside the runner's launch calls (what the
/// engine thread pays to issue the tasks: the simulator's `issue` points).
pub(crate) fn run_round_issued(
    runner: &dyn serve::backend::Runner,
    tasks: &[Arc<TaskData>],
) -> CliResult<(Duration, Duration)> {
    let start = Instant::now();
    let mut target = 0;
    let mut issued = Duration::ZERO;
    for t in tasks {
        let call = Instant::now();
        target = runner.launch(0, t.clone())?;
        issued += call.elapsed();
    }
    // A CPU stream unparks this thread after each task; a CUDA stream does not notify, so the
    // sleep is short (no spinning, which would take a core from the stream on a small machine).
    let signal = runner.signal(0);
    while signal.completed() < target {
        std::thread::park_timeout(Duration::from_micros(100));
    }
    let took = start.elapsed();
    for t in tasks {
        runner.collect(0, t);
    }
    // A task whose work panicked poisoned its lock and holds the panic as its error.
    if let Some(e) = tasks.iter().find_map(|t| t.io.lock().unwrap_or_else(|p| p.into_inner()).error.clone()) {
        return Err(fatal(format!("a benchmarked task failed: {e}")));
    }
    Ok((took, issued))
}
