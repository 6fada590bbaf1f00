//! Cost of the sans-IO scheduling policies alone, per formed task, in steady state.
//!
//! No runtime, backend or clock: a driver loop feeds a policy on virtual time. `b` requests are in
//! flight on one worker whose max batch is `b`; the worker's stream finishes its tasks in order,
//! and every request that completes is replaced at once by a new arrival, so about `b` requests
//! stay in the system. One step of the loop is `task_done(now, oldest task)` → drain `poll()` →
//! note each `Launch` (its task joins the stream) and answer each `Complete` with an `arrive`
//! (whose decisions are drained too). Timed is everything the policy does — task formation,
//! completion bookkeeping, arrivals (unfolding a request's state) — plus taking the decisions it
//! hands out (a launch's row vectors go back through `Policy::recycle`, as the runtime hands them
//! back once the task has finished). Cell graphs are built before timing and shared through `Arc`;
//! the state reached after a warm-up from the cold start (all `b` requests at t = 0) is what is
//! measured.
//!
//! Workloads (ARCHITECTURE.md §8, `serve::workload`): `lstm` — one chain of WMT-like length (mean 24);
//! `seq2seq` — a WMT-like encoder chain then a WMT-like decoder chain, cell types encoder (max
//! batch `b`, priority 0) and decoder (max batch `b / 2`, priority 1); `treelstm` — TreeBank-like
//! random binary parse trees (mean 19 leaves), cell types leaf (priority 0) and internal
//! (priority 1), max batch `b`. Policies: cellular batching (`CellularPolicy`, MaxTasksToSubmit 1
//! and 5) and the padding baseline (`PaddingPolicy`, same lookahead) at b = 512, cellular LSTM also
//! at b = 64; and `plain`, a policy with no bookkeeping written the plain way, as a reference:
//! for the LSTM rows ([`Plain`]) and, leaner, for the TreeLSTM rows at b = 512 ([`PlainTree`]).
//!
//! Prints criterion's estimates (time per formed task), then a table measured in the same run: µs
//! per formed task (total wall time / tasks formed; also in thread CPU time, which a loaded
//! machine inflates less), ns per node (wall time / real rows launched), mean rows per task, and
//! the node cost relative to the padding baseline (same workload, batch and lookahead) and to the
//! plain policy (same workload and batch). Goal (issue): ≤ 2 µs per formed task for cellular batching at b = 512.
//!
//! `cargo bench --bench scheduler` (about 45 s); `cargo bench --bench scheduler -- cellular/lstm`
//! runs only the cases whose name contains `cellular/lstm`.

use std::collections::VecDeque;
use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput};
use serve::sched::baseline::padding::{BucketOrder, PaddingConfig, PaddingPolicy};
use serve::sched::cellular::{CellTypeConfig, CellularConfig, CellularPolicy};
use serve::sched::{
    Arrival, CellGraph, CellType, Decision, Exec, Launch, Policy, RequestId, TaskId, TaskReport, TaskShape,
    Time, WorkerShape,
};
use serve::workload::{treebank_trees, wmt_lengths};

/// Distinct graphs per workload (a power of two); arrivals cycle through them.
const GRAPHS: usize = 4096;
const _: () = assert!(GRAPHS.is_power_of_two());
/// Tasks run before anything is timed, from the cold start (all `b` requests at t = 0).
const WARMUP_TASKS: u64 = 3000;
/// Minimum time of the table's own measurement per case.
const TABLE_TIME: Duration = Duration::from_millis(400);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Workload {
    Lstm,
    Seq2seq,
    TreeLstm,
}

impl Workload {
    fn name(self) -> &'static str {
        match self {
            Workload::Lstm => "lstm",
            Workload::Seq2seq => "seq2seq",
            Workload::TreeLstm => "treelstm",
        }
    }

    fn graphs(self, seed: u64) -> Vec<Arc<CellGraph>> {
        match self {
            Workload::Lstm => wmt_lengths(GRAPHS, seed)
                .into_iter()
                .map(|n| Arc::new(CellGraph::chains(&[(0, n)]).unwrap()))
                .collect(),
            Workload::Seq2seq => wmt_lengths(GRAPHS, seed)
                .into_iter()
                .zip(wmt_lengths(GRAPHS, seed + 1))
                .map(|(e, d)| Arc::new(CellGraph::chains(&[(0, e), (1, d)]).unwrap()))
                .collect(),
            Workload::TreeLstm => {
                let tree =
                    |parents: &Vec<i32>| CellGraph::tree_of_parents(parents, 0, 1).expect("a valid tree");
                treebank_trees(GRAPHS, seed).iter().map(|parents| Arc::new(tree(parents))).collect()
            }
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Cellular,
    Padding,
    Plain,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Cellular => "cellular",
            Kind::Padding => "padding",
            Kind::Plain => "plain",
        }
    }
}

/// A policy with no bookkeeping, for chains on one worker with one task out: every live chain
/// puts its next cell in the next task (arrival order, up to the max batch), and a chain's state
/// is one counter — no dependency tracking, queues, pinning, cancel or deadlines — written the
/// plain way (one `retain` over the live chains per task). A reference for what cellular
/// batching's bookkeeping costs, not a lower bound: the cellular policy's row pass is tighter.
struct Plain {
    max_batch: usize,
    /// (request, next node, length), in arrival order; the first `in_task` are in the running task.
    live: Vec<(RequestId, u32, u32)>,
    in_task: usize,
    next_task: TaskId,
    out: VecDeque<Decision>,
}

impl Plain {
    fn new(max_batch: usize) -> Plain {
        Plain { max_batch, live: Vec::new(), in_task: 0, next_task: 0, out: VecDeque::new() }
    }

    fn launch(&mut self) {
        let k = self.live.len().min(self.max_batch);
        self.in_task = k;
        if k > 0 {
            let rows = &self.live[..k];
            self.out.push_back(Decision::Launch(Launch {
                task: self.next_task,
                worker: 0,
                model: 0,
                shape: TaskShape::Cells { cell: 0, nodes: rows.iter().map(|r| r.1).collect(), steps: 1 },
                exec: Exec::default(),
                requests: rows.iter().map(|r| r.0).collect(),
                batch: k,
            }));
            self.next_task += 1;
        }
    }
}

impl Policy for Plain {
    fn workers(&self) -> Vec<WorkerShape> {
        WorkerShape::uniform(1, self.max_batch)
    }
    fn lookahead(&self) -> usize {
        1
    }
    fn reserve(&mut self, requests: usize) {
        self.live.reserve(requests);
    }
    fn arrive(&mut self, _: Time, a: Arrival) {
        let len = a.cells.map_or(1, |g| g.len()) as u32;
        self.live.push((a.id, 0, len));
        if self.in_task == 0 {
            self.launch();
        }
    }
    fn cancel(&mut self, _: Time, _: RequestId) {}
    fn task_done(&mut self, _: Time, _: &TaskReport) {
        let mut i = 0;
        self.live.retain_mut(|r| {
            i += 1;
            if i > self.in_task {
                return true;
            }
            r.1 += 1;
            if r.1 < r.2 {
                return true;
            }
            self.out.push_back(Decision::Complete { id: r.0, code: serve::Code::Ok });
            false
        });
        self.launch();
    }
    fn end_early(&mut self, _: Time, _: RequestId) {}
    fn tick(&mut self, _: Time) {}
    fn poll(&mut self) -> Option<Decision> {
        self.out.pop_front()
    }
    fn next_wakeup(&self) -> Option<Time> {
        None
    }
    fn queued(&self) -> usize {
        self.live.len() - self.in_task
    }
    fn running(&self) -> usize {
        self.in_task
    }
}

/// A lean tree scheduler, as a reference for the cellular policy's tree rows: on one worker with
/// one task out, with none of cellular batching's bookkeeping (no pinning, priorities, cancel,
/// deadlines, several workers or split levels). Leaves wait in one FIFO of trees, each with a
/// cursor into its leaf list; a tree whose ready inner level (its shape's next level, ready once
/// the task holding the previous one has finished) awaits a task is a *lane*, and an inner task
/// walks the lanes in order, taking each whole level that fits (a level that does not waits for
/// the next inner task). The task's cell type is one whose ready nodes fill a batch (internal
/// first), else the one with more ready nodes (Algorithm 1's first and last steps). What is left
/// is what any tree scheduler does: copy each request's shape on arrival, emit its rows a level
/// at a time, complete it.
struct PlainTree {
    max_batch: usize,
    /// Live trees by slot, and free slots.
    trees: Vec<Option<PlainTreeReq>>,
    free: Vec<u32>,
    /// Trees with leaves not yet submitted, in arrival order.
    leaf_queue: VecDeque<u32>,
    /// Trees whose current inner level is ready and not submitted.
    lanes: Vec<u32>,
    /// Ready nodes: leaves (in `leaf_queue`), inner nodes (in `lanes`).
    ready: [usize; 2],
    /// The running task: whether it is an inner task, and the slots of its trees.
    running: Option<(bool, Vec<u32>)>,
    /// Buffers for reuse: shape lists, a task's trees, row vectors handed back.
    spare_lists: Vec<Vec<u32>>,
    spare_held: Vec<u32>,
    spare_rows: Vec<(Vec<RequestId>, Vec<u32>)>,
    next_task: TaskId,
    out: VecDeque<Decision>,
}

struct PlainTreeReq {
    id: RequestId,
    /// Leaves, then inner nodes by level, then level ends (a one-node tree: one leaf).
    lists: Vec<u32>,
    leaves: u32,
    inner: u32,
    leaf_next: u32,
    /// The current level is `order[head..tail]` (indices into the inner part of `lists`).
    head: u32,
    tail: u32,
    level: u32,
}

impl PlainTree {
    fn new(max_batch: usize) -> PlainTree {
        PlainTree {
            max_batch,
            trees: Vec::new(),
            free: Vec::new(),
            leaf_queue: VecDeque::new(),
            lanes: Vec::new(),
            ready: [0; 2],
            running: None,
            spare_lists: Vec::new(),
            spare_held: Vec::new(),
            spare_rows: Vec::new(),
            next_task: 0,
            out: VecDeque::new(),
        }
    }

    fn launch(&mut self) {
        let [leaf, inner] = self.ready;
        if leaf + inner == 0 {
            return;
        }
        let inner = inner >= self.max_batch || (leaf < self.max_batch && inner >= leaf);
        let (mut requests, mut nodes) = self.spare_rows.pop().unwrap_or_default();
        let mut held = std::mem::take(&mut self.spare_held);
        if inner {
            let mut kept = 0;
            for i in 0..self.lanes.len() {
                let slot = self.lanes[i];
                let t = self.trees[slot as usize].as_mut().expect("a lane is a live tree");
                let k = (t.tail - t.head) as usize;
                if requests.len() + k > self.max_batch {
                    self.lanes[kept] = slot;
                    kept += 1;
                    continue;
                }
                let at = (t.leaves + t.head) as usize;
                push_rows(t.id, &t.lists[at..at + k], &mut requests, &mut nodes);
                t.head = t.tail;
                held.push(slot);
            }
            self.lanes.truncate(kept);
        } else {
            while let Some(&slot) = self.leaf_queue.front() {
                let room = self.max_batch - requests.len();
                if room == 0 {
                    break;
                }
                let t = self.trees[slot as usize].as_mut().expect("a queued tree is live");
                let (from, k) = (t.leaf_next as usize, room.min((t.leaves - t.leaf_next) as usize));
                push_rows(t.id, &t.lists[from..from + k], &mut requests, &mut nodes);
                t.leaf_next += k as u32;
                held.push(slot);
                if t.leaf_next == t.leaves {
                    self.leaf_queue.pop_front();
                }
            }
        }
        assert!(!requests.is_empty(), "every tree level fits a task");
        self.ready[usize::from(inner)] -= requests.len();
        let batch = requests.len();
        self.out.push_back(Decision::Launch(Launch {
            task: self.next_task,
            worker: 0,
            model: 0,
            shape: TaskShape::Cells { cell: CellType::from(inner), nodes, steps: 1 },
            exec: Exec::default(),
            requests,
            batch,
        }));
        self.next_task += 1;
        self.running = Some((inner, held));
    }

    /// Tree `slot` has finished: complete it and free its slot.
    fn complete(&mut self, slot: u32) {
        let t = self.trees[slot as usize].take().expect("a live tree");
        self.out.push_back(Decision::Complete { id: t.id, code: serve::Code::Ok });
        let mut lists = t.lists;
        lists.clear();
        self.spare_lists.push(lists);
        self.free.push(slot);
    }
}

/// Rows `(id, v)` for each node `v` of `from`, one loop for both (a tree's run is a few nodes).
fn push_rows(id: RequestId, from: &[u32], requests: &mut Vec<RequestId>, nodes: &mut Vec<u32>) {
    for &v in from {
        requests.push(id);
        nodes.push(v);
    }
}

impl Policy for PlainTree {
    fn workers(&self) -> Vec<WorkerShape> {
        WorkerShape::uniform(1, self.max_batch)
    }
    fn lookahead(&self) -> usize {
        1
    }
    fn reserve(&mut self, requests: usize) {
        self.trees.reserve(requests);
        self.free.reserve(requests);
    }
    fn arrive(&mut self, _: Time, a: Arrival) {
        let graph = a.cells.expect("a tree request has a graph");
        let mut lists = self.spare_lists.pop().unwrap_or_default();
        let (leaves, inner) = match graph.tree_shape() {
            Some(s) => {
                lists.extend_from_slice(s.lists());
                (s.leaves().len() as u32, s.order().len() as u32)
            }
            None => {
                assert_eq!(graph.len(), 1, "a graph with no tree shape is a one-node tree");
                lists.push(0);
                (1, 0)
            }
        };
        let t = PlainTreeReq { id: a.id, lists, leaves, inner, leaf_next: 0, head: 0, tail: 0, level: 0 };
        let slot = match self.free.pop() {
            Some(slot) => {
                self.trees[slot as usize] = Some(t);
                slot
            }
            None => {
                self.trees.push(Some(t));
                (self.trees.len() - 1) as u32
            }
        };
        self.leaf_queue.push_back(slot);
        self.ready[0] += leaves as usize;
        if self.running.is_none() {
            self.launch();
        }
    }
    fn cancel(&mut self, _: Time, _: RequestId) {}
    fn task_done(&mut self, _: Time, _: &TaskReport) {
        let (inner, mut held) = self.running.take().expect("a task is running");
        for &slot in &held {
            let t = self.trees[slot as usize].as_mut().expect("a tree in a task is live");
            // The tree's next inner level is ready, if it has one: the first once its leaves are
            // done.
            let next = if inner {
                t.level += 1;
                Some(t.level)
            } else {
                // With one task out, every leaf submitted so far has finished.
                (t.leaf_next == t.leaves).then_some(0)
            };
            let Some(level) = next else { continue };
            match t.lists.get((t.leaves + t.inner + level) as usize) {
                Some(&end) => {
                    t.tail = end;
                    self.ready[1] += (t.tail - t.head) as usize;
                    self.lanes.push(slot);
                }
                _ => self.complete(slot),
            }
        }
        held.clear();
        self.spare_held = held;
        self.launch();
    }
    fn end_early(&mut self, _: Time, _: RequestId) {}
    fn tick(&mut self, _: Time) {}
    fn recycle(&mut self, mut requests: Vec<RequestId>, shape: TaskShape) {
        let TaskShape::Cells { mut nodes, .. } = shape else { return };
        requests.clear();
        nodes.clear();
        if self.spare_rows.len() < 2 {
            self.spare_rows.push((requests, nodes));
        }
    }
    fn poll(&mut self) -> Option<Decision> {
        self.out.pop_front()
    }
    fn next_wakeup(&self) -> Option<Time> {
        None
    }
    fn queued(&self) -> usize {
        // Trees none of whose cells has launched: in the leaf queue, bar a front one partly taken.
        let partly = self
            .leaf_queue
            .front()
            .is_some_and(|&slot| self.trees[slot as usize].as_ref().is_some_and(|t| t.leaf_next > 0));
        self.leaf_queue.len() - usize::from(partly)
    }
    fn running(&self) -> usize {
        self.trees.len() - self.free.len() - self.queued()
    }
}

#[derive(Clone, Copy)]
struct Case {
    kind: Kind,
    workload: Workload,
    batch: usize,
    max_tasks: usize,
}

impl Case {
    fn name(&self) -> String {
        format!("{}/{}/b{}/mtts{}", self.kind.name(), self.workload.name(), self.batch, self.max_tasks)
    }
}

fn cellular(case: &Case) -> CellularPolicy {
    let b = case.batch;
    let cell_types = match case.workload {
        Workload::Lstm => vec![CellTypeConfig::new("step", b, 0)],
        Workload::Seq2seq => {
            vec![CellTypeConfig::new("encoder", b, 0), CellTypeConfig::new("decoder", b / 2, 1)]
        }
        Workload::TreeLstm => vec![CellTypeConfig::new("leaf", b, 0), CellTypeConfig::new("internal", b, 1)],
    };
    CellularPolicy::new(CellularConfig { cell_types, workers: 1, max_tasks_to_submit: case.max_tasks })
        .unwrap()
}

fn padding(case: &Case) -> PaddingPolicy {
    PaddingPolicy::new(PaddingConfig {
        bucket_width: 10,
        max_batch: case.batch,
        workers: 1,
        max_tasks_to_submit: case.max_tasks,
        // Declares the workers' size; treebank trees are far narrower.
        level_width: 1024,
        // One task per level: the scheduling work per cell this benchmark measures.
        max_steps: 1,
        order: BucketOrder::RoundRobin,
    })
    .unwrap()
}

/// The steady-state driver: one worker, a new request for every completed one.
struct Driver<P> {
    policy: P,
    graphs: Vec<Arc<CellGraph>>,
    next_id: RequestId,
    /// The worker's stream: launched, unfinished tasks in launch order, with their row vectors.
    stream: VecDeque<(TaskId, Vec<RequestId>, TaskShape)>,
    now: u64,
    tasks: u64,
    rows: u64,
}

impl<P: Policy> Driver<P> {
    fn new(policy: P, graphs: Vec<Arc<CellGraph>>, in_flight: usize) -> Driver<P> {
        let mut d = Driver { policy, graphs, next_id: 0, stream: VecDeque::new(), now: 0, tasks: 0, rows: 0 };
        for _ in 0..in_flight {
            d.arrive();
        }
        d.drain();
        d.run(WARMUP_TASKS);
        d
    }

    fn arrive(&mut self) {
        // `GRAPHS` is a power of two: a mask, not a division, picks the graph.
        let g = self.graphs[self.next_id as usize & (GRAPHS - 1)].clone();
        let a = Arrival { id: self.next_id, model: 0, deadline: None, priority: 0, cells: Some(g) };
        self.next_id += 1;
        self.policy.arrive(Time(self.now), a);
    }

    fn drain(&mut self) {
        while let Some(d) = self.policy.poll() {
            match d {
                Decision::Launch(l) => {
                    self.tasks += 1;
                    self.rows += l.requests.len() as u64;
                    let l = black_box(l);
                    self.stream.push_back((l.task, l.requests, l.shape));
                }
                Decision::Complete { .. } | Decision::Reject { .. } => self.arrive(),
            }
        }
    }

    /// Finish the oldest task and take the policy's answers.
    fn step(&mut self) {
        let (task, requests, shape) = self.stream.pop_front().expect("steady state keeps the worker busy");
        // As the runtime does once a task has finished: its row vectors go back to the policy.
        self.policy.recycle(requests, shape);
        self.now += 1_000;
        self.policy.task_done(Time(self.now), &TaskReport::of(task));
        self.drain();
    }

    /// Steps until at least `tasks` more tasks have been formed; returns (tasks, rows) formed.
    fn run(&mut self, tasks: u64) -> (u64, u64) {
        let (t0, r0) = (self.tasks, self.rows);
        while self.tasks - t0 < tasks {
            self.step();
        }
        (self.tasks - t0, self.rows - r0)
    }
}

/// CPU time of the calling thread (unlike wall time, not inflated when other processes take the
/// core).
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID) failed");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Time for `iters` formed tasks (scaled when a step formed more than one).
fn timed<P: Policy>(d: &mut Driver<P>, iters: u64) -> Duration {
    let t0 = Instant::now();
    let (tasks, _) = d.run(iters);
    t0.elapsed().mul_f64(iters as f64 / tasks as f64)
}

struct Row {
    case: Case,
    us_per_task: f64,
    cpu_us_per_task: f64,
    ns_per_node: f64,
    rows_per_task: f64,
}

fn measure<P: Policy>(c: &mut Criterion, case: Case, policy: P) -> Row {
    let graphs = case.workload.graphs(42);
    let mut d = Driver::new(policy, graphs, case.batch);
    let mut g = c.benchmark_group("scheduler");
    g.throughput(Throughput::Elements(1));
    g.bench_function(BenchmarkId::from_parameter(case.name()), |b| {
        b.iter_custom(|iters| timed(&mut d, iters))
    });
    g.finish();
    // The table's own numbers: one long run from the same (warm) state.
    let (t0, cpu0) = (Instant::now(), thread_cpu_time());
    let (mut tasks, mut rows) = (0, 0);
    while t0.elapsed() < TABLE_TIME {
        let (t, r) = d.run(200);
        tasks += t;
        rows += r;
    }
    let (total, cpu) = (t0.elapsed().as_secs_f64(), (thread_cpu_time() - cpu0).as_secs_f64());
    Row {
        case,
        us_per_task: total / tasks as f64 * 1e6,
        cpu_us_per_task: cpu / tasks as f64 * 1e6,
        ns_per_node: total / rows as f64 * 1e9,
        rows_per_task: rows as f64 / tasks as f64,
    }
}

fn main() {
    let mut cases = Vec::new();
    for kind in [Kind::Cellular, Kind::Padding] {
        for workload in [Workload::Lstm, Workload::Seq2seq, Workload::TreeLstm] {
            for max_tasks in [1, 5] {
                cases.push(Case { kind, workload, batch: 512, max_tasks });
                if kind == Kind::Cellular && workload == Workload::Lstm {
                    cases.push(Case { kind, workload, batch: 64, max_tasks });
                }
            }
        }
    }
    for batch in [512, 64] {
        cases.push(Case { kind: Kind::Plain, workload: Workload::Lstm, batch, max_tasks: 1 });
    }
    cases.push(Case { kind: Kind::Plain, workload: Workload::TreeLstm, batch: 512, max_tasks: 1 });
    // `cargo bench --bench scheduler -- cellular/lstm` runs only the cases whose name matches.
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    cases.retain(|c| filter.as_ref().is_none_or(|f| c.name().contains(f.as_str())));
    let mut c = Criterion::default()
        .configure_from_args()
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(1))
        .sample_size(20);
    let mut table = Vec::new();
    for case in cases {
        let row = match case.kind {
            Kind::Cellular => measure(&mut c, case, cellular(&case)),
            Kind::Padding => measure(&mut c, case, padding(&case)),
            Kind::Plain if case.workload == Workload::TreeLstm => {
                measure(&mut c, case, PlainTree::new(case.batch))
            }
            Kind::Plain => measure(&mut c, case, Plain::new(case.batch)),
        };
        table.push(row);
    }

    // Node costs relative to baselines of the same run: padding on the same workload, batch and
    // lookahead; the plain policy on the same workload and batch.
    let ratio = |r: &Row, kind: Kind, same_mtts: bool| {
        let base = table.iter().find(|p| {
            p.case.kind == kind
                && p.case.workload == r.case.workload
                && p.case.batch == r.case.batch
                && (!same_mtts || p.case.max_tasks == r.case.max_tasks)
        });
        match base {
            Some(p) if r.case.kind == Kind::Cellular => format!("{:.2}×", r.ns_per_node / p.ns_per_node),
            _ => "-".to_string(),
        }
    };
    println!(
        "\npolicy    workload  batch  mtts  µs/task  cpu µs/task  ns/node  rows/task  node cost: vs padding  vs plain"
    );
    for r in &table {
        println!(
            "{:<9} {:<9} {:>5} {:>5} {:>8.2} {:>12.2} {:>8.1} {:>10.1} {:>22} {:>9}",
            r.case.kind.name(),
            r.case.workload.name(),
            r.case.batch,
            r.case.max_tasks,
            r.us_per_task,
            r.cpu_us_per_task,
            r.ns_per_node,
            r.rows_per_task,
            ratio(r, Kind::Padding, true),
            ratio(r, Kind::Plain, false),
        );
    }
    println!("\ngoal (issue): ≤ 2 µs per formed task, cellular at b = 512:");
    for r in table.iter().filter(|r| r.case.kind == Kind::Cellular && r.case.batch == 512) {
        let verdict = if r.us_per_task <= 2.0 { "met" } else { "NOT met" };
        println!("  {:<32} {:>7.2} µs  {verdict}", r.case.name(), r.us_per_task);
    }
    for f in table.iter().filter(|r| r.case.kind == Kind::Plain && r.case.batch == 512) {
        println!(
            "  (the plain {} policy takes {:.2} µs per task of {:.0} rows)",
            f.case.workload.name(),
            f.us_per_task,
            f.rows_per_task
        );
    }
}
