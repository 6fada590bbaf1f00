//! Graph batching with padding: the TensorFlow / MXNet baseline of the BatchMaker paper (§2.2, §7).
//!
//! Requests wait in **buckets** by size (graph nodes; width 10: sizes 1–10, 11–20, …). Whenever a
//! worker is idle, the next non-empty bucket in **round-robin** order gives it a batch of up to
//! `max_batch` requests — at once, with no batching timeout. The batch then runs as one padded
//! graph: for each cell type in order and each level within it, one task holds that level's node
//! of every request, padded as if every request were as large as the batch's largest (its
//! longest sequence, its widest tree level). A request cannot join a batch that has started, and
//! every request of a batch completes together when the batch ends — which is what cellular
//! batching improves on. Seq2Seq decoding stops when every request of the batch has emitted
//! `eos` (or at `max_decode`), like TF's `dynamic_decode`.
//!
//! A batch of single-run paths (`lstm` sequences) runs as frameworks run it: all its levels in
//! **one task** (`TaskShape::Cells` with `steps`), one call on its worker with no engine round
//! trip per step — up to `max_steps` levels per task, where the backend can (the runtime sets the
//! backend's bound). Other batches (Seq2Seq, whose decoder ends on `eos`; trees) run one task per
//! level and keep up to `max_tasks_to_submit` of them submitted ahead on the worker's stream.
//! Cancel and deadline take effect at the next task boundary: the request's later rows become
//! padding and it completes once none of its rows is running.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use crate::error::{Code, Error, Result};
use crate::sched::book::Book;
use crate::sched::{
    Arrival, CellGraph, CellType, Decision, IdMap, IdTable, Policy, RequestId, TaskId, TaskReport, TaskShape,
    Time, WorkerId, WorkerShape,
};

/// Which non-empty bucket an idle worker takes its batch from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BucketOrder {
    /// The next after the bucket served last (the BatchMaker paper's description of the
    /// TF/MXNet baseline, and the default): every bucket gets a turn however few it holds.
    #[default]
    RoundRobin,
    /// The bucket whose first request arrived earliest (a framework's bucketing batcher with its
    /// batches ready: TF's `bucket_by_sequence_length`, the PyTorch peer of `serve bench lstm`):
    /// buckets are served about in proportion to their traffic.
    OldestHead,
}

/// Configuration of a [`PaddingPolicy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PaddingConfig {
    /// Width of a size bucket (the papers use 10).
    pub bucket_width: usize,
    /// Most requests in one batch.
    pub max_batch: usize,
    pub workers: usize,
    /// Level tasks a batch may have submitted and unfinished.
    pub max_tasks_to_submit: usize,
    /// The most nodes one request has at one level: 1 for chains (lstm, seq2seq), the model's
    /// `max_nodes` for trees. A level task holds `max_batch × level_width` rows at most, the
    /// size its workers are declared with.
    pub level_width: usize,
    /// Most levels one task runs for a batch of single-run paths (lstm): frameworks run a padded
    /// batch's steps in one call (default: all of them); 1 runs one task per level. The runtime
    /// lowers it to what its backend executes (`Backend::max_task_steps`).
    pub max_steps: u32,
    /// Which bucket a worker serves next.
    pub order: BucketOrder,
}

impl Default for PaddingConfig {
    fn default() -> Self {
        PaddingConfig {
            bucket_width: 10,
            max_batch: 64,
            workers: 1,
            max_tasks_to_submit: 5,
            level_width: 1,
            max_steps: u32::MAX,
            order: BucketOrder::RoundRobin,
        }
    }
}

impl PaddingConfig {
    pub fn check(&self) -> Result<()> {
        let sizes = [
            self.bucket_width,
            self.max_batch,
            self.workers,
            self.max_tasks_to_submit,
            self.level_width,
            self.max_steps as usize,
        ];
        if sizes.contains(&0) {
            return Err(Error::invalid(format!(
                "padding policy: bucket width, max batch, workers, tasks to submit, level width and max steps \
                 must be ≥ 1 ({self:?})"
            )));
        }
        Ok(())
    }
}

enum State {
    Queued,
    InBatch,
}

struct Req {
    /// Arrival order (for [`BucketOrder::OldestHead`]).
    seq: u64,
    deadline: Option<Time>,
    graph: Arc<CellGraph>,
    state: State,
    /// A row of it has been launched (it counts as running from then on).
    started: bool,
    /// Submitted level tasks holding rows of this request, not yet done.
    inflight: u32,
    /// Stopped at a boundary (cancel, deadline): completes with this code once nothing runs.
    doomed: Option<Code>,
    /// Its output is complete (Seq2Seq `eos`): later rows are padding; completes with the batch.
    ended: bool,
}

/// A member of a running batch: where its nodes are, level by level.
enum Member {
    /// A path (`lstm`, `seq2seq`): at level `k` of a cell type, the node `k` into its run of that
    /// type. Nothing per node, so a Seq2Seq decoder of `max_decode` steps costs nothing up front.
    Path(RequestId, Arc<CellGraph>),
    /// Any other graph: its nodes sorted by (cell type, level, node).
    Nodes(RequestId, Vec<(CellType, u32, u32)>),
}

impl Member {
    fn id(&self) -> RequestId {
        match self {
            Member::Path(id, _) | Member::Nodes(id, _) => *id,
        }
    }

    /// Its nodes at (`cell`, `level`), ascending.
    fn nodes_at(&self, cell: CellType, level: u32) -> impl Iterator<Item = u32> + '_ {
        let (path, listed) = match self {
            Member::Path(_, graph) => {
                let runs = graph.runs().expect("a path member has runs");
                let node = runs.iter().find(|r| r.ty == cell).filter(|r| (level as usize) < r.len());
                (node.map(|r| r.start + level), &[][..])
            }
            Member::Nodes(_, nodes) => {
                let from = nodes.partition_point(|&(c, l, _)| (c, l) < (cell, level));
                let to = nodes.partition_point(|&(c, l, _)| (c, l) <= (cell, level));
                (None, &nodes[from..to])
            }
        };
        path.into_iter().chain(listed.iter().map(|n| n.2))
    }
}

/// The levels of a batch, walked in order: cell types ascending, then levels ascending; a level
/// runs the nodes every member has at it, padded as if each had as many as the widest.
struct Batch {
    members: Vec<Member>,
    /// Levels of each cell type: the most any member has.
    depth: Vec<u32>,
    /// The next (cell type, level) to submit; `None` once every level has been.
    next: Option<(CellType, u32)>,
    outstanding: VecDeque<TaskId>,
    /// Every member is a single-run path: its levels run `max_steps` to a task.
    fused: bool,
}

impl Batch {
    /// The first level with nodes at or after (`cell`, `level`).
    fn level_from(depth: &[u32], cell: usize, level: u32) -> Option<(CellType, u32)> {
        let first = (cell..depth.len()).find(|&c| depth[c] > if c == cell { level } else { 0 })?;
        Some((first as CellType, if first == cell { level } else { 0 }))
    }
}

/// The padding (graph batching) baseline.
pub struct PaddingPolicy {
    cfg: PaddingConfig,
    reqs: IdTable<Req>,
    buckets: BTreeMap<usize, VecDeque<RequestId>>,
    /// The bucket served last (round-robin continues after it).
    cursor: Option<usize>,
    /// Arrivals so far (the next request's `seq`).
    arrivals: u64,
    batches: Vec<Option<Batch>>,
    /// Requests of each task (rows may repeat a request).
    tasks: IdMap<(WorkerId, Vec<RequestId>)>,
    book: Book,
}

impl PaddingPolicy {
    pub fn new(cfg: PaddingConfig) -> Result<PaddingPolicy> {
        cfg.check()?;
        Ok(PaddingPolicy {
            batches: (0..cfg.workers).map(|_| None).collect(),
            cfg,
            reqs: IdTable::default(),
            buckets: BTreeMap::new(),
            cursor: None,
            arrivals: 0,
            tasks: IdMap::default(),
            book: Book::default(),
        })
    }

    pub fn config(&self) -> &PaddingConfig {
        &self.cfg
    }

    /// The bucket to serve next: the next non-empty one after the cursor, wrapping around, or
    /// the one whose head arrived first.
    fn next_bucket(&self) -> Option<usize> {
        if self.cfg.order == BucketOrder::OldestHead {
            let head = |q: &VecDeque<RequestId>| q.front().map(|id| self.reqs[id].seq);
            return self.buckets.iter().filter_map(|(&b, q)| Some((head(q)?, b))).min().map(|(_, b)| b);
        }
        let after = self.cursor.map_or(0, |c| c + 1);
        self.buckets
            .range(after..)
            .chain(self.buckets.range(..after))
            .find(|(_, q)| !q.is_empty())
            .map(|(&b, _)| b)
    }

    /// Give every idle worker a batch, round-robin over the buckets.
    fn start_batches(&mut self) {
        for worker in 0..self.cfg.workers {
            if self.batches[worker].is_some() {
                continue;
            }
            let Some(bucket) = self.next_bucket() else { return };
            self.cursor = Some(bucket);
            let q = self.buckets.get_mut(&bucket).expect("bucket exists");
            let take = q.len().min(self.cfg.max_batch);
            let members: Vec<RequestId> = q.drain(..take).collect();
            if q.is_empty() {
                self.buckets.remove(&bucket);
            }
            for id in &members {
                self.reqs.get_mut(id).expect("queued request").state = State::InBatch;
            }
            let batch = self.plan(members);
            self.batches[worker] = Some(batch);
            self.submit(worker);
        }
    }

    /// A batch of `members`, at its first level.
    fn plan(&self, members: Vec<RequestId>) -> Batch {
        let types = members.iter().map(|id| self.reqs[id].graph.max_type() as usize + 1).max().unwrap_or(0);
        let mut depth = vec![0u32; types];
        let mut deepen = |cell: CellType, levels: u32| {
            depth[cell as usize] = depth[cell as usize].max(levels);
        };
        let members: Vec<Member> = members
            .into_iter()
            .map(|id| {
                let g = &self.reqs[&id].graph;
                if let Some(runs) = g.runs() {
                    for r in runs {
                        deepen(r.ty, r.len() as u32);
                    }
                    return Member::Path(id, g.clone());
                }
                let mut nodes: Vec<(CellType, u32, u32)> =
                    g.levels().into_iter().enumerate().map(|(v, l)| (g.cell_type(v), l, v as u32)).collect();
                nodes.sort_unstable();
                for &(cell, level, _) in &nodes {
                    deepen(cell, level + 1);
                }
                Member::Nodes(id, nodes)
            })
            .collect();
        let next = Batch::level_from(&depth, 0, 0);
        let single_run =
            |m: &Member| matches!(m, Member::Path(_, g) if g.runs().is_some_and(|r| r.len() == 1));
        let fused = self.cfg.max_steps > 1 && members.iter().all(single_run);
        Batch { members, depth, next, outstanding: VecDeque::new(), fused }
    }

    /// Whether `id` still takes rows (not stopped, not ended, not completed).
    fn alive(&self, id: RequestId) -> bool {
        self.reqs.get(&id).is_some_and(|r| r.doomed.is_none() && !r.ended)
    }

    /// Submit level tasks of `worker`'s batch up to the lookahead; end the batch when done.
    fn submit(&mut self, worker: WorkerId) {
        let Some(mut batch) = self.batches[worker].take() else { return };
        while batch.outstanding.len() < self.cfg.max_tasks_to_submit {
            let Some((cell, level)) = batch.next else { break };
            if !batch.members.iter().any(|m| self.alive(m.id())) {
                batch.next = None;
                break;
            }
            // A fused batch runs the rest of its levels (all of one cell type) in one task.
            let steps = match batch.fused {
                true => (batch.depth[cell as usize] - level).min(self.cfg.max_steps),
                false => 1,
            };
            batch.next = Batch::level_from(&batch.depth, cell as usize, level + steps);
            // Rows member by member; the level is padded to the widest member, dead or alive.
            let (mut rows, mut widest) = (Vec::new(), 0);
            for m in &batch.members {
                let id = m.id();
                let alive = self.alive(id);
                let mut count = 0;
                for node in m.nodes_at(cell, level) {
                    count += 1;
                    if alive {
                        rows.push((id, node));
                    }
                }
                widest = widest.max(count);
            }
            if rows.is_empty() {
                continue;
            }
            let task = self.book.task_id();
            let mut distinct: Vec<RequestId> = rows.iter().map(|r| r.0).collect();
            distinct.dedup();
            for id in &distinct {
                let r = self.reqs.get_mut(id).expect("member");
                r.inflight += 1;
                if !r.started {
                    r.started = true;
                    self.book.start(1);
                }
            }
            batch.outstanding.push_back(task);
            self.tasks.insert(task, (worker, distinct));
            let nodes = rows.iter().map(|r| r.1).collect();
            let requests = rows.iter().map(|r| r.0).collect();
            self.book.launch(
                task,
                worker,
                TaskShape::Cells { cell, nodes, steps },
                requests,
                batch.members.len() * widest,
            );
        }
        if batch.outstanding.is_empty() && batch.next.is_none() {
            for m in batch.members {
                if self.reqs.contains_key(&m.id()) {
                    self.complete(m.id(), None);
                }
            }
        } else {
            self.batches[worker] = Some(batch);
        }
    }

    /// Complete `id` with `code`, or with its own outcome (`None`: doomed code, deadline, Ok).
    fn complete(&mut self, id: RequestId, now: Option<Time>) {
        let r = self.reqs.remove(&id).expect("live request");
        let code = match (r.doomed, now) {
            (Some(code), _) => code,
            (None, Some(now)) if r.deadline.is_some_and(|d| d <= now) => Code::DeadlineExceeded,
            _ => Code::Ok,
        };
        self.book.complete(id, code, r.started);
    }

    /// The bucket of a request of this graph: its length over the bucket width.
    fn bucket(cfg: &PaddingConfig, graph: &CellGraph) -> usize {
        (graph.len() - 1) / cfg.bucket_width
    }

    /// Stop `id` at the next boundary with `code`.
    fn doom(&mut self, id: RequestId, code: Code) {
        let Some(r) = self.reqs.get_mut(&id) else { return };
        if r.doomed.is_some() {
            return;
        }
        r.doomed = Some(code);
        match r.state {
            State::Queued => {
                let bucket = Self::bucket(&self.cfg, &r.graph);
                if let Some(q) = self.buckets.get_mut(&bucket) {
                    q.retain(|&x| x != id);
                    if q.is_empty() {
                        self.buckets.remove(&bucket);
                    }
                }
                self.complete(id, None);
            }
            State::InBatch if r.inflight == 0 => self.complete(id, None),
            State::InBatch => {}
        }
    }

    /// Stop every request whose deadline has passed, and drop deadline entries of requests that
    /// have completed or are stopping, so the earliest entry is a live one.
    fn expire(&mut self, now: Time) {
        while let Some(id) = self.book.due(now, |id| self.reqs.get(&id).is_some_and(|r| r.doomed.is_none())) {
            self.doom(id, Code::DeadlineExceeded);
        }
    }
}

impl Policy for PaddingPolicy {
    fn workers(&self) -> Vec<WorkerShape> {
        WorkerShape::uniform(self.cfg.workers, self.cfg.max_batch.saturating_mul(self.cfg.level_width))
    }

    fn lookahead(&self) -> usize {
        self.cfg.max_tasks_to_submit
    }

    fn reserve(&mut self, requests: usize) {
        let held = self.book.reserve(requests);
        self.reqs.reserve_for(held);
    }

    fn arrive(&mut self, now: Time, a: Arrival) {
        assert!(!self.reqs.contains_key(&a.id), "request {} arrived twice", a.id);
        let graph = a.cells.unwrap_or_else(CellGraph::single);
        assert!(!graph.is_empty(), "request {} has an empty cell graph", a.id);
        let bucket = Self::bucket(&self.cfg, &graph);
        self.reqs.insert(
            a.id,
            Req {
                seq: self.arrivals,
                deadline: a.deadline,
                graph,
                state: State::Queued,
                started: false,
                inflight: 0,
                doomed: None,
                ended: false,
            },
        );
        self.arrivals += 1;
        self.buckets.entry(bucket).or_default().push_back(a.id);
        self.book.arrive(a.model, a.deadline, a.id);
        self.expire(now);
        self.start_batches();
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        self.doom(id, Code::Cancelled);
        self.expire(now);
        self.start_batches();
    }

    fn end_early(&mut self, now: Time, id: RequestId) {
        if let Some(r) = self.reqs.get_mut(&id) {
            r.ended = true;
        }
        self.expire(now);
    }

    fn task_done(&mut self, now: Time, report: &TaskReport) {
        let task = report.task;
        let (worker, ids) = self.tasks.remove(&task).expect("task_done for an unknown task");
        let batch = self.batches[worker].as_mut().expect("a task's batch is running");
        let front = batch.outstanding.pop_front();
        debug_assert_eq!(front, Some(task), "a worker's tasks finish in stream order");
        self.expire(now);
        for id in ids {
            let Some(r) = self.reqs.get_mut(&id) else { continue };
            r.inflight -= 1;
            if r.inflight == 0 && r.doomed.is_some() {
                self.complete(id, Some(now));
            }
        }
        self.submit(worker);
        self.start_batches();
        self.expire(now);
    }

    fn tick(&mut self, now: Time) {
        self.expire(now);
        for w in 0..self.cfg.workers {
            self.submit(w);
        }
        self.start_batches();
    }

    fn poll(&mut self) -> Option<Decision> {
        self.book.poll()
    }

    fn next_wakeup(&self) -> Option<Time> {
        self.book.next_deadline()
    }

    fn queued(&self) -> usize {
        self.book.queued()
    }

    fn running(&self) -> usize {
        self.book.running()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{Launch, drain};

    fn us(v: u64) -> Time {
        Time::from_micros(v)
    }

    fn policy(max_batch: usize, workers: usize, lookahead: usize) -> PaddingPolicy {
        PaddingPolicy::new(PaddingConfig {
            bucket_width: 10,
            max_batch,
            workers,
            max_tasks_to_submit: lookahead,
            level_width: 4,
            max_steps: 1,
            order: BucketOrder::RoundRobin,
        })
        .unwrap()
    }

    fn chain(len: usize) -> Arc<CellGraph> {
        Arc::new(CellGraph::chains(&[(0, len)]).unwrap())
    }

    fn arrive(p: &mut PaddingPolicy, id: RequestId, g: Arc<CellGraph>) {
        p.arrive(us(0), Arrival { model: 0, id, deadline: None, priority: 0, cells: Some(g) });
    }

    fn launch(
        task: TaskId,
        worker: WorkerId,
        cell: CellType,
        rows: &[(RequestId, u32)],
        batch: usize,
    ) -> Decision {
        Decision::Launch(Launch::of_rows(task, worker, cell, rows, batch))
    }

    fn done(id: RequestId) -> Decision {
        Decision::Complete { id, code: Code::Ok }
    }

    #[test]
    fn a_batch_starts_at_once_and_pads_to_its_longest_request() {
        let mut p = policy(4, 1, 8);
        arrive(&mut p, 1, chain(3));
        // The worker was idle: request 1 starts alone, without waiting for company.
        assert_eq!(
            drain(&mut p),
            vec![launch(0, 0, 0, &[(1, 0)], 1), launch(1, 0, 0, &[(1, 1)], 1), launch(2, 0, 0, &[(1, 2)], 1)]
        );
        arrive(&mut p, 2, chain(2));
        arrive(&mut p, 3, chain(4));
        assert_eq!(drain(&mut p), vec![], "no joining a running batch");
        for t in 0..3 {
            p.task_done(us(1 + t), &TaskReport::of(t));
        }
        // Both in bucket 0: one batch, 4 levels, every level padded to 2 rows.
        assert_eq!(
            drain(&mut p),
            vec![
                done(1),
                launch(3, 0, 0, &[(2, 0), (3, 0)], 2),
                launch(4, 0, 0, &[(2, 1), (3, 1)], 2),
                launch(5, 0, 0, &[(3, 2)], 2),
                launch(6, 0, 0, &[(3, 3)], 2),
            ]
        );
        for t in 3..7 {
            p.task_done(us(10 + t), &TaskReport::of(t));
        }
        // The short request waited for the long one: they complete together.
        assert_eq!(drain(&mut p), vec![done(2), done(3)]);
    }

    fn fused(task: TaskId, rows: &[(RequestId, u32)], steps: u32, batch: usize) -> Decision {
        let mut l = Launch::of_rows(task, 0, 0, rows, batch);
        l.shape = TaskShape::Cells { cell: 0, nodes: rows.iter().map(|r| r.1).collect(), steps };
        Decision::Launch(l)
    }

    /// A batch of lstm sequences runs as frameworks run it: all its levels in one task (or tasks
    /// of `max_steps` levels), padded to the batch; a cancel takes effect at the task's end; a
    /// Seq2Seq batch still runs level by level.
    #[test]
    fn a_batch_of_single_run_paths_runs_its_levels_in_one_task() {
        let mut p = PaddingPolicy::new(PaddingConfig { max_batch: 4, ..PaddingConfig::default() }).unwrap();
        arrive(&mut p, 1, chain(3));
        assert_eq!(drain(&mut p), vec![fused(0, &[(1, 0)], 3, 1)]);
        arrive(&mut p, 2, chain(2));
        arrive(&mut p, 3, chain(5));
        p.task_done(us(1), &TaskReport::of(0));
        // One task of the longest request's 5 steps for both (request 2 is padding after 2).
        assert_eq!(drain(&mut p), vec![done(1), fused(1, &[(2, 0), (3, 0)], 5, 2)]);
        p.cancel(us(2), 3);
        assert_eq!(drain(&mut p), vec![], "a running request stops at the task's end");
        p.task_done(us(3), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![Decision::Complete { id: 3, code: Code::Cancelled }, done(2)]);

        // At most `max_steps` levels a task, the next submitted ahead.
        let mut p =
            PaddingPolicy::new(PaddingConfig { max_batch: 4, max_steps: 2, ..PaddingConfig::default() })
                .unwrap();
        arrive(&mut p, 1, chain(5));
        assert_eq!(
            drain(&mut p),
            vec![fused(0, &[(1, 0)], 2, 1), fused(1, &[(1, 2)], 2, 1), fused(2, &[(1, 4)], 1, 1)]
        );
        // Seq2Seq (two runs: its decoder may end on eos) is not fused.
        let mut p = PaddingPolicy::new(PaddingConfig::default()).unwrap();
        arrive(&mut p, 1, Arc::new(CellGraph::chains(&[(0, 2), (1, 2)]).unwrap()));
        let levels =
            [(0, 0), (1, 0), (2, 1), (3, 1)].map(|(t, cell)| launch(t, 0, cell, &[(1, t as u32)], 1));
        assert_eq!(drain(&mut p), levels);
        assert_eq!(
            PaddingConfig { max_steps: 0, ..PaddingConfig::default() }.check().unwrap_err().code(),
            Code::InvalidArgument
        );
    }

    #[test]
    fn a_decoder_as_long_as_node_ids_allow_is_walked_not_planned() {
        // Seq2Seq with the longest decoder a graph can hold: the batch is planned per run, not per
        // node (rows for every level up front would be ~64 GB here), and ends when both decodes do.
        let mut p = policy(4, 1, 2);
        let g = Arc::new(CellGraph::chains(&[(0, 2), (1, CellGraph::MAX_NODES - 2)]).unwrap());
        arrive(&mut p, 1, g.clone());
        arrive(&mut p, 2, g);
        let first = drain(&mut p);
        assert_eq!(first, vec![launch(0, 0, 0, &[(1, 0)], 1), launch(1, 0, 0, &[(1, 1)], 1)]);
        p.task_done(us(1), &TaskReport::of(0));
        p.task_done(us(1), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![launch(2, 0, 1, &[(1, 2)], 1), launch(3, 0, 1, &[(1, 3)], 1)]);
        p.end_early(us(2), 1);
        p.task_done(us(2), &TaskReport::of(2));
        p.task_done(us(2), &TaskReport::of(3));
        assert_eq!(
            drain(&mut p),
            vec![done(1), launch(4, 0, 0, &[(2, 0)], 1), launch(5, 0, 0, &[(2, 1)], 1)]
        );
        for t in 4..6 {
            p.task_done(us(3), &TaskReport::of(t));
        }
        assert_eq!(drain(&mut p), vec![launch(6, 0, 1, &[(2, 2)], 1), launch(7, 0, 1, &[(2, 3)], 1)]);
        p.end_early(us(4), 2);
        p.task_done(us(4), &TaskReport::of(6));
        p.task_done(us(4), &TaskReport::of(7));
        assert_eq!(drain(&mut p), vec![done(2)]);
    }

    #[test]
    fn buckets_are_served_round_robin() {
        let mut p = policy(8, 1, 1);
        arrive(&mut p, 1, chain(25));
        assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)], 1)]);
        arrive(&mut p, 2, chain(5)); // bucket 0
        arrive(&mut p, 3, chain(15)); // bucket 1
        arrive(&mut p, 4, chain(7)); // bucket 0
        arrive(&mut p, 5, chain(35)); // bucket 3
        for t in 0..25 {
            p.task_done(us(t + 1), &TaskReport::of(t));
        }
        // Last served bucket 2 (request 1): next is bucket 3, then wrap to 0, then 1.
        let after =
            |d: &[Decision], id: RequestId| d[d.iter().position(|x| *x == done(id)).unwrap() + 1].clone();
        assert_eq!(after(&drain(&mut p), 1), launch(25, 0, 0, &[(5, 0)], 1));
        for t in 25..60 {
            p.task_done(us(100 + t), &TaskReport::of(t));
        }
        assert_eq!(after(&drain(&mut p), 5), launch(60, 0, 0, &[(2, 0), (4, 0)], 2));
        for t in 60..67 {
            p.task_done(us(200 + t), &TaskReport::of(t));
        }
        assert_eq!(after(&drain(&mut p), 4), launch(67, 0, 0, &[(3, 0)], 1));
    }

    #[test]
    fn oldest_head_serves_the_bucket_whose_first_request_came_first() {
        let cfg = PaddingConfig {
            max_batch: 8,
            max_steps: 1,
            order: BucketOrder::OldestHead,
            ..policy(8, 1, 1).cfg
        };
        let mut p = PaddingPolicy::new(cfg).unwrap();
        arrive(&mut p, 1, chain(25));
        assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)], 1)]);
        arrive(&mut p, 2, chain(35)); // bucket 3
        arrive(&mut p, 3, chain(15)); // bucket 1
        arrive(&mut p, 4, chain(5)); // bucket 0
        arrive(&mut p, 5, chain(36)); // bucket 3
        for t in 0..25 {
            p.task_done(us(t + 1), &TaskReport::of(t));
        }
        // Round-robin would go on from bucket 2 to 3 as well; here bucket 3 because request 2
        // came first, both of its requests in one batch; then bucket 1 (3), then 0 (4).
        let after =
            |d: &[Decision], id: RequestId| d[d.iter().position(|x| *x == done(id)).unwrap() + 1].clone();
        assert_eq!(after(&drain(&mut p), 1), launch(25, 0, 0, &[(2, 0), (5, 0)], 2));
        for t in 25..61 {
            p.task_done(us(100 + t), &TaskReport::of(t));
        }
        assert_eq!(after(&drain(&mut p), 5), launch(61, 0, 0, &[(3, 0)], 1));
        for t in 61..76 {
            p.task_done(us(200 + t), &TaskReport::of(t));
        }
        assert_eq!(after(&drain(&mut p), 3), launch(76, 0, 0, &[(4, 0)], 1));
    }

    #[test]
    fn decoding_stops_when_every_request_has_ended() {
        let mut p = policy(4, 1, 1);
        let g = Arc::new(CellGraph::chains(&[(0, 1), (1, 5)]).unwrap());
        arrive(&mut p, 1, g.clone());
        assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)], 1)]);
        arrive(&mut p, 2, g.clone());
        arrive(&mut p, 3, g);
        p.task_done(us(1), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![launch(1, 0, 1, &[(1, 1)], 1)]);
        p.end_early(us(2), 1);
        p.task_done(us(2), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![done(1), launch(2, 0, 0, &[(2, 0), (3, 0)], 2)]);
        p.task_done(us(3), &TaskReport::of(2));
        p.end_early(us(4), 2);
        p.task_done(us(4), &TaskReport::of(3));
        // Request 2 ended: its row is padding from now on; the batch goes on for request 3.
        assert_eq!(drain(&mut p), vec![launch(3, 0, 1, &[(2, 1), (3, 1)], 2), launch(4, 0, 1, &[(3, 2)], 2)]);
        p.end_early(us(5), 3);
        p.task_done(us(5), &TaskReport::of(4));
        assert_eq!(drain(&mut p), vec![done(2), done(3)]);
    }

    #[test]
    fn tree_levels_pad_to_the_widest_request() {
        let mut p = policy(4, 1, 8);
        // Request 1: root 0, leaves 1, 2, 3. Request 2: root 0 with internal 1 with leaf 2.
        let t1 =
            Arc::new(CellGraph::new(vec![1, 0, 0, 0], &[vec![1, 2, 3], vec![], vec![], vec![]]).unwrap());
        let t2 = Arc::new(CellGraph::new(vec![1, 1, 0], &[vec![1], vec![2], vec![]]).unwrap());
        arrive(&mut p, 9, chain(1));
        let _ = drain(&mut p);
        arrive(&mut p, 1, t1);
        arrive(&mut p, 2, t2);
        p.task_done(us(1), &TaskReport::of(0));
        assert_eq!(
            drain(&mut p),
            vec![
                done(9),
                launch(1, 0, 0, &[(1, 1), (1, 2), (1, 3), (2, 2)], 6),
                launch(2, 0, 1, &[(1, 0), (2, 1)], 2),
                launch(3, 0, 1, &[(2, 0)], 2),
            ]
        );
    }

    #[test]
    fn cancel_and_deadline_stop_a_member_at_a_level_boundary() {
        let mut p = policy(4, 1, 1);
        p.arrive(us(0), Arrival { model: 0, id: 1, deadline: None, priority: 0, cells: Some(chain(3)) });
        p.arrive(
            us(0),
            Arrival { model: 0, id: 2, deadline: Some(us(5)), priority: 0, cells: Some(chain(3)) },
        );
        assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)], 1)]);
        p.arrive(
            us(1),
            Arrival { model: 0, id: 3, deadline: Some(us(3)), priority: 0, cells: Some(chain(3)) },
        );
        p.tick(us(3));
        assert_eq!(drain(&mut p), vec![Decision::Complete { id: 3, code: Code::DeadlineExceeded }]);
        p.cancel(us(4), 1);
        assert_eq!(drain(&mut p), vec![]);
        p.task_done(us(4), &TaskReport::of(0));
        // Request 1 stops at the boundary; the batch of 1 ends. Request 2 starts.
        assert_eq!(
            drain(&mut p),
            vec![Decision::Complete { id: 1, code: Code::Cancelled }, launch(1, 0, 0, &[(2, 0)], 1)]
        );
        p.task_done(us(6), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![Decision::Complete { id: 2, code: Code::DeadlineExceeded }]);
        assert_eq!((p.queued(), p.running()), (0, 0));
    }
}
