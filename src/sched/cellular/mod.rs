//! Cellular batching: BatchMaker (Gao et al., EuroSys'18) §4.2–§4.3, Algorithm 1.
//!
//! Requests are unfolded into graphs of cells ([`CellGraph`]). The *request processor* part of
//! this policy tracks, per request, which nodes are ready, grouping them into **subgraphs**
//! (connected same-type nodes, §4.2): a subgraph becomes schedulable once its external
//! dependencies have finished; inside it, a node is ready once its same-subgraph predecessors have
//! been *submitted* — they run earlier on the same worker, whose stream keeps order.
//!
//! The *scheduler* part is Algorithm 1. Whenever a worker has fewer than `MaxTasksToSubmit` tasks
//! outstanding, `Schedule(worker)` runs:
//!
//! ```text
//! Schedule(worker):
//!   while worker.outstanding < MaxTasksToSubmit:
//!     type ← ChooseCellType(worker); if none: return
//!     task ← FormBatchedTask(type, worker); submit task to worker
//! ChooseCellType(worker):                         (ready = pinned to worker + unpinned)
//!   1. types with ready ≥ MaxBatch(type)         → the highest priority
//!   2. types with nodes pinned to worker ready   → the highest priority
//!   3. otherwise                                 → the type with the most ready nodes
//!   (priority breaks ties in every step; then the lower type index)
//! FormBatchedTask(type, worker):
//!   take ready nodes of `type`: first from subgraphs pinned to worker, then from unpinned
//!   subgraphs (request priority, then arrival order), up to MaxBatch(type); every subgraph
//!   touched is pinned to worker and its pin counter counts the task; pad the batch to the
//!   smallest size in Bsizes(type) that holds it.
//! on task done: pin counters drop; a subgraph whose counter reaches 0 is unpinned.
//! ```
//!
//! New requests join at the next task formed; a request leaves (completes) as soon as its last
//! cell finishes — no request waits for a batch-mate. Cancel, deadline expiry and an early end
//! (Seq2Seq `eos`) take effect at the next cell boundary: the request's unsubmitted cells are
//! dropped, and it completes once none of its cells is running (its state slots may then be
//! reused). Per-request priorities order the unpinned subgraphs; BatchMaker itself has none.

mod request;
#[cfg(test)]
mod tests;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};

use crate::error::{Code, Error, Result};
use crate::sched::graph::MAX_CELL_TYPES;
use crate::sched::{
    Arrival, CellGraph, CellType, Decision, Launch, Policy, RequestId, TaskId, Time, WorkerId,
};

use request::{Bufs, NONE, Req, SgRef, Where};

/// One cell type's batching parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellTypeConfig {
    /// A name for messages ("encoder", "leaf", …).
    pub name: String,
    /// The most nodes one task of this type holds (`MaxBatch`).
    pub max_batch: usize,
    /// Larger is chosen first when ChooseCellType has a tie (decoder over encoder, internal over
    /// leaf).
    pub priority: i32,
    /// Batch sizes a task may have (`Bsizes`), ascending, ending at `max_batch`; a task is padded
    /// to the smallest that holds its nodes. Empty = every size from 1 to `max_batch`.
    pub bsizes: Vec<usize>,
}

impl CellTypeConfig {
    pub fn new(name: &str, max_batch: usize, priority: i32) -> CellTypeConfig {
        CellTypeConfig { name: name.to_string(), max_batch, priority, bsizes: Vec::new() }
    }
}

/// Most recycled buffers kept (request arrays, task rows).
const MAX_SPARE: usize = 256;

/// BatchMaker's default `MaxTasksToSubmit`.
pub const DEFAULT_MAX_TASKS_TO_SUBMIT: usize = 5;

/// Configuration of a [`CellularPolicy`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellularConfig {
    /// Indexed by [`CellType`].
    pub cell_types: Vec<CellTypeConfig>,
    pub workers: usize,
    /// Tasks a worker may have submitted and unfinished (`MaxTasksToSubmit`, ≥ 1).
    pub max_tasks_to_submit: usize,
}

impl CellularConfig {
    pub fn check(&self) -> Result<()> {
        if self.cell_types.is_empty() || self.cell_types.len() > MAX_CELL_TYPES {
            return Err(Error::invalid(format!(
                "a cellular policy needs 1..={MAX_CELL_TYPES} cell types, got {}",
                self.cell_types.len()
            )));
        }
        if self.workers == 0 {
            return Err(Error::invalid("a cellular policy needs at least one worker"));
        }
        if self.max_tasks_to_submit == 0 {
            return Err(Error::invalid("MaxTasksToSubmit must be at least 1"));
        }
        for t in &self.cell_types {
            if t.max_batch == 0 {
                return Err(Error::invalid(format!("cell type `{}`: max batch must be at least 1", t.name)));
            }
            if !t.bsizes.is_empty()
                && (t.bsizes.windows(2).any(|w| w[0] >= w[1])
                    || t.bsizes[0] == 0
                    || *t.bsizes.last().unwrap() != t.max_batch)
            {
                return Err(Error::invalid(format!(
                    "cell type `{}`: Bsizes {:?} must ascend strictly from ≥ 1 to the max batch {}",
                    t.name, t.bsizes, t.max_batch
                )));
            }
        }
        Ok(())
    }
}

/// A submitted task: its worker and its rows as (request slot, node).
struct TaskRec {
    worker: WorkerId,
    rows: Vec<(u32, u32)>,
}

/// A task being formed: its rows as (request slot, node), and the `Launch` vectors.
struct Forming {
    rows: Vec<(u32, u32)>,
    requests: Vec<RequestId>,
    nodes: Vec<u32>,
}

/// Unpinned subgraphs of one request priority, in the order they became ready.
struct PrioQueue {
    priority: i32,
    q: VecDeque<SgRef>,
}

/// Per cell type: ready subgraphs and ready-node counts.
struct TypeQueues {
    /// Unpinned subgraphs, highest request priority first.
    unpinned: Vec<PrioQueue>,
    ready_unpinned: usize,
    /// Subgraphs pinned to each worker.
    pinned: Vec<VecDeque<SgRef>>,
    ready_pinned: Vec<usize>,
}

/// BatchMaker's cellular batching policy.
pub struct CellularPolicy {
    cfg: CellularConfig,
    reqs: Vec<Option<Req>>,
    /// Generation of each request slot, bumped on reuse so stale queue entries are recognised.
    generations: Vec<u32>,
    free: Vec<u32>,
    by_id: HashMap<RequestId, u32>,
    types: Vec<TypeQueues>,
    /// Tasks submitted and unfinished per worker.
    outstanding: Vec<usize>,
    tasks: HashMap<TaskId, TaskRec>,
    next_task: TaskId,
    deadlines: BinaryHeap<Reverse<(Time, u32, u32)>>,
    /// Buffers of completed requests and of done tasks' rows, for reuse.
    spare_reqs: Vec<Bufs>,
    spare_rows: Vec<Vec<(u32, u32)>>,
    /// Scratch for `task_done`: slots whose last running task this was.
    idle_slots: Vec<u32>,
    /// Scratch for `form_batched_task`: (slot, node) made ready by the task being formed.
    ready_after: Vec<(u32, u32)>,
    /// Numbers each task formation and completion, so per-task counters count a request or a
    /// subgraph once per task however many of its nodes the task holds.
    stamp: u64,
    out: VecDeque<Decision>,
    queued: usize,
    running: usize,
}

impl CellularPolicy {
    pub fn new(cfg: CellularConfig) -> Result<CellularPolicy> {
        cfg.check()?;
        let types = (0..cfg.cell_types.len())
            .map(|_| TypeQueues {
                unpinned: Vec::new(),
                ready_unpinned: 0,
                pinned: (0..cfg.workers).map(|_| VecDeque::new()).collect(),
                ready_pinned: vec![0; cfg.workers],
            })
            .collect();
        Ok(CellularPolicy {
            outstanding: vec![0; cfg.workers],
            cfg,
            reqs: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            by_id: HashMap::new(),
            types,
            tasks: HashMap::new(),
            next_task: 0,
            deadlines: BinaryHeap::new(),
            spare_reqs: Vec::new(),
            spare_rows: Vec::new(),
            idle_slots: Vec::new(),
            ready_after: Vec::new(),
            stamp: 0,
            out: VecDeque::new(),
            queued: 0,
            running: 0,
        })
    }

    pub fn config(&self) -> &CellularConfig {
        &self.cfg
    }

    fn req(&self, slot: u32) -> &Req {
        self.reqs[slot as usize].as_ref().expect("live request slot")
    }

    fn req_mut(&mut self, slot: u32) -> &mut Req {
        self.reqs[slot as usize].as_mut().expect("live request slot")
    }

    // ---- ready-node bookkeeping ------------------------------------------------------------

    /// Make `node` of request `slot` ready: append it to its subgraph's ready list and queue the
    /// subgraph where it belongs (pinned worker or unpinned) if it is not queued yet.
    fn push_ready(&mut self, slot: u32, node: u32) {
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        let sg = r.nodes[node as usize].sg;
        r.push_ready(sg, node);
        let s = &mut r.sgs[sg as usize];
        let ty = s.ty as usize;
        let (priority, generation) = (r.priority, r.generation);
        let place = if s.pinned == NONE { Where::Unpinned } else { Where::Pinned(s.pinned) };
        let was = s.queued;
        s.queued = place;
        let t = &mut self.types[ty];
        match place {
            Where::Pinned(w) => t.ready_pinned[w as usize] += 1,
            _ => t.ready_unpinned += 1,
        }
        if was == Where::Nowhere {
            let at = SgRef { slot, generation, sg };
            match place {
                Where::Pinned(w) => t.pinned[w as usize].push_back(at),
                _ => push_unpinned(&mut t.unpinned, priority, at, false),
            }
        }
    }

    /// A subgraph's ready nodes move from `pinned` to the unpinned queues (its pin counter fell
    /// to 0). The stale entry in the pinned queue is skipped when met.
    fn unpin(&mut self, slot: u32, sg: u32) {
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        let (priority, generation) = (r.priority, r.generation);
        let s = &mut r.sgs[sg as usize];
        let w = std::mem::replace(&mut s.pinned, NONE);
        if w == NONE {
            return;
        }
        if s.queued == Where::Pinned(w) {
            let n = s.ready_len as usize;
            s.queued = Where::Unpinned;
            let t = &mut self.types[s.ty as usize];
            t.ready_pinned[w as usize] -= n;
            t.ready_unpinned += n;
            // It was ready before anything queued since: it goes first among its priority.
            push_unpinned(&mut t.unpinned, priority, SgRef { slot, generation, sg }, true);
        }
    }

    /// Drop every ready node of a request (cancel, deadline, early end).
    fn drop_ready(&mut self, slot: u32) {
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        for s in r.sgs.iter_mut() {
            let n = s.ready_len as usize;
            let t = &mut self.types[s.ty as usize];
            match s.queued {
                Where::Pinned(w) => t.ready_pinned[w as usize] -= n,
                Where::Unpinned => t.ready_unpinned -= n,
                Where::Nowhere => {}
            }
            s.queued = Where::Nowhere;
            s.ready_head = request::NONE;
            s.ready_len = 0;
        }
    }

    // ---- Algorithm 1 -----------------------------------------------------------------------

    /// Ready nodes of `ty` that a task on `worker` may take.
    fn available(&self, ty: usize, worker: WorkerId) -> usize {
        self.types[ty].ready_pinned[worker] + self.types[ty].ready_unpinned
    }

    /// ChooseCellType (Algorithm 1): the three steps, priority breaking ties.
    fn choose_cell_type(&self, worker: WorkerId) -> Option<usize> {
        let n = self.cfg.cell_types.len();
        let prio = |ty: usize| self.cfg.cell_types[ty].priority;
        // Highest priority, then lowest index, among the types `keep` accepts.
        let best = |keep: &dyn Fn(usize) -> bool| {
            (0..n).filter(|&ty| keep(ty)).min_by_key(|&ty| (Reverse(prio(ty)), ty))
        };
        // Step 1: a type that can fill a whole batch.
        best(&|ty| self.available(ty, worker) >= self.cfg.cell_types[ty].max_batch)
            // Step 2: keep the subgraphs pinned to this worker moving.
            .or_else(|| best(&|ty| self.types[ty].ready_pinned[worker] > 0))
            // Step 3: the type with the most ready nodes.
            .or_else(|| {
                (0..n)
                    .filter(|&ty| self.available(ty, worker) > 0)
                    .min_by_key(|&ty| (Reverse(self.available(ty, worker)), Reverse(prio(ty)), ty))
            })
    }

    /// FormBatchedTask (Algorithm 1) for cell type `ty` on `worker`, then submit it.
    fn form_batched_task(&mut self, ty: usize, worker: WorkerId) {
        let max = self.cfg.cell_types[ty].max_batch;
        let task = self.next_task;
        self.next_task += 1;
        self.stamp += 1;
        let stamp = self.stamp;
        let room = max.min(self.available(ty, worker));
        let mut f = Forming {
            rows: self.spare_rows.pop().unwrap_or_default(),
            requests: Vec::with_capacity(room),
            nodes: Vec::with_capacity(room),
        };
        f.rows.reserve(room);
        // Pinned subgraphs first (they hold state on this worker), then unpinned ones. With no
        // ready node pinned here, every entry of the pinned queue is stale: the loop below would
        // pop them all without taking anything, so drop them at once.
        if self.types[ty].ready_pinned[worker] == 0 {
            self.types[ty].pinned[worker].clear();
        }
        while f.rows.len() < max {
            let Some(&at) = self.types[ty].pinned[worker].front() else { break };
            if self.take_from(at, Where::Pinned(worker as u32), ty, worker, stamp, max, &mut f) {
                self.types[ty].pinned[worker].pop_front();
            }
        }
        let mut level = 0;
        while f.rows.len() < max && level < self.types[ty].unpinned.len() {
            let Some(&at) = self.types[ty].unpinned[level].q.front() else {
                level += 1;
                continue;
            };
            if self.take_from(at, Where::Unpinned, ty, worker, stamp, max, &mut f) {
                self.types[ty].unpinned[level].q.pop_front();
            }
        }
        self.types[ty].unpinned.retain(|p| !p.q.is_empty());
        debug_assert!(!f.rows.is_empty(), "ChooseCellType picked a type with nothing ready");
        // Same-subgraph successors of the submitted nodes become ready now, in row order: they
        // will run after this task on the same stream. (Not before: they could not share the
        // task.)
        let mut ready = std::mem::take(&mut self.ready_after);
        for &(slot, node) in &ready {
            self.push_ready(slot, node);
        }
        ready.clear();
        self.ready_after = ready;
        let real = f.rows.len();
        let batch = self.cfg.cell_types[ty].bsizes.iter().copied().find(|&b| b >= real).unwrap_or(real);
        self.outstanding[worker] += 1;
        self.tasks.insert(task, TaskRec { worker, rows: f.rows });
        self.out.push_back(Decision::Launch(Launch {
            task,
            worker,
            cell: ty as CellType,
            requests: f.requests,
            nodes: f.nodes,
            batch,
        }));
    }

    /// Move ready nodes of the subgraph `at` (found in queue `from`) into the task, pinning it to
    /// `worker`; their same-subgraph successors that this makes ready go to `ready_after`. True
    /// when the queue entry is used up (stale, or no ready nodes left).
    #[allow(clippy::too_many_arguments)]
    fn take_from(
        &mut self,
        at: SgRef,
        from: Where,
        ty: usize,
        worker: WorkerId,
        stamp: u64,
        max: usize,
        f: &mut Forming,
    ) -> bool {
        let Some(Some(r)) = self.reqs.get_mut(at.slot as usize) else { return true };
        if r.generation != at.generation || r.sgs[at.sg as usize].queued != from {
            return true; // stale entry: the subgraph moved, was dropped, or the slot was reused
        }
        let t = &mut self.types[ty];
        if r.stamp != stamp {
            r.stamp = stamp;
            r.inflight += 1;
            if r.inflight == 1 {
                self.queued -= 1;
                self.running += 1;
            }
        }
        let s = &mut r.sgs[at.sg as usize];
        if s.stamp != stamp {
            s.stamp = stamp;
            s.outstanding += 1;
        }
        s.pinned = worker as u32;
        while f.rows.len() < max {
            let Some(node) = r.pop_ready(at.sg) else { break };
            f.rows.push((at.slot, node));
            f.requests.push(r.id);
            f.nodes.push(node);
            match from {
                Where::Pinned(w) => t.ready_pinned[w as usize] -= 1,
                _ => t.ready_unpinned -= 1,
            }
            // Counted now, queued once the task is formed (`form_batched_task`).
            for k in r.internal_successors(node) {
                let s = r.edges[k];
                let succ = &mut r.nodes[s as usize];
                succ.internal_left -= 1;
                if succ.internal_left == 0 && r.sgs[at.sg as usize].external_left == 0 {
                    self.ready_after.push((at.slot, s));
                }
            }
        }
        let s = &mut r.sgs[at.sg as usize];
        if s.ready_len == 0 {
            s.queued = Where::Nowhere;
            return true;
        }
        if from == Where::Unpinned {
            // The task is full but the subgraph has more: it is pinned now, so its remaining
            // ready nodes wait at the front of this worker's pinned queue.
            let n = s.ready_len as usize;
            s.queued = Where::Pinned(worker as u32);
            t.ready_unpinned -= n;
            t.ready_pinned[worker] += n;
            t.pinned[worker].push_front(at);
            return true;
        }
        false
    }

    /// Schedule (Algorithm 1) on every worker with room, least loaded first.
    fn schedule(&mut self) {
        loop {
            let Some(worker) = (0..self.cfg.workers)
                .filter(|&w| self.outstanding[w] < self.cfg.max_tasks_to_submit)
                .filter(|&w| (0..self.types.len()).any(|ty| self.available(ty, w) > 0))
                .min_by_key(|&w| (self.outstanding[w], w))
            else {
                return;
            };
            let ty = self.choose_cell_type(worker).expect("the worker has ready nodes");
            self.form_batched_task(ty, worker);
        }
    }

    // ---- request lifecycle -----------------------------------------------------------------

    /// Complete the request in `slot` if it is finished and nothing of it runs.
    fn maybe_complete(&mut self, slot: u32, now: Time) {
        let r = self.req(slot);
        if r.inflight > 0 {
            return;
        }
        let code = match r.doomed {
            Some(code) => code,
            None if r.done_nodes as usize == r.nodes.len() => {
                if r.deadline.is_some_and(|d| d <= now) {
                    Code::DeadlineExceeded
                } else {
                    Code::Ok
                }
            }
            None => return,
        };
        let r = self.reqs[slot as usize].take().expect("live request slot");
        let id = r.id;
        self.by_id.remove(&id);
        self.free.push(slot);
        self.queued -= 1;
        self.out.push_back(Decision::Complete { id, code });
        let bufs = r.into_bufs();
        if bufs.worth_keeping() && self.spare_reqs.len() < MAX_SPARE {
            self.spare_reqs.push(bufs);
        }
    }

    /// Stop the request at the next cell boundary with `code`.
    fn doom(&mut self, slot: u32, code: Code, now: Time) {
        if self.req(slot).doomed.is_some() {
            return;
        }
        self.drop_ready(slot);
        self.req_mut(slot).doomed = Some(code);
        self.maybe_complete(slot, now);
    }

    /// Drop deadline entries of requests that have completed or are already stopping, so the
    /// earliest entry is a live one (`next_wakeup` reads it).
    fn tidy_deadlines(&mut self) {
        while let Some(&Reverse((_, slot, generation))) = self.deadlines.peek() {
            if matches!(self.reqs.get(slot as usize), Some(Some(r)) if r.generation == generation && r.doomed.is_none())
            {
                return;
            }
            self.deadlines.pop();
        }
    }

    fn expire(&mut self, now: Time) {
        while let Some(&Reverse((d, slot, generation))) = self.deadlines.peek() {
            let live = matches!(self.reqs.get(slot as usize), Some(Some(r))
                if r.generation == generation && r.doomed.is_none());
            if live && d > now {
                break;
            }
            self.deadlines.pop();
            if live {
                self.doom(slot, Code::DeadlineExceeded, now);
            }
        }
        self.tidy_deadlines();
    }
}

/// Queue `at` among the unpinned subgraphs of its request priority (at the front or the back).
fn push_unpinned(levels: &mut Vec<PrioQueue>, priority: i32, at: SgRef, front: bool) {
    match levels.binary_search_by_key(&Reverse(priority), |p| Reverse(p.priority)) {
        Ok(i) if front => levels[i].q.push_front(at),
        Ok(i) => levels[i].q.push_back(at),
        Err(i) => levels.insert(i, PrioQueue { priority, q: VecDeque::from([at]) }),
    }
}

impl Policy for CellularPolicy {
    fn arrive(&mut self, now: Time, a: Arrival) {
        assert!(!self.by_id.contains_key(&a.id), "request {} arrived twice", a.id);
        let single;
        let graph: &CellGraph = match &a.cells {
            Some(g) => g,
            None => {
                single = CellGraph::chains(&[(0, 1)]);
                &single
            }
        };
        assert!(!graph.is_empty(), "request {} has an empty cell graph", a.id);
        assert!(
            graph.types().iter().all(|&t| (t as usize) < self.cfg.cell_types.len()),
            "request {} uses a cell type this policy was not configured for",
            a.id
        );
        let slot = self.free.pop().unwrap_or_else(|| {
            self.reqs.push(None);
            self.generations.push(0);
            (self.reqs.len() - 1) as u32
        });
        self.generations[slot as usize] = self.generations[slot as usize].wrapping_add(1);
        let generation = self.generations[slot as usize];
        let bufs = self.spare_reqs.pop().unwrap_or_default();
        let req = Req::new(a.id, generation, a.priority, a.deadline, graph, bufs);
        let n = req.nodes.len();
        self.reqs[slot as usize] = Some(req);
        self.by_id.insert(a.id, slot);
        self.queued += 1;
        if let Some(d) = a.deadline {
            self.deadlines.push(Reverse((d, slot, generation)));
        }
        for node in 0..n {
            if self.req(slot).is_initially_ready(node) {
                self.push_ready(slot, node as u32);
            }
        }
        self.expire(now);
        self.schedule();
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        if let Some(&slot) = self.by_id.get(&id) {
            self.doom(slot, Code::Cancelled, now);
            self.tidy_deadlines();
            self.schedule();
        }
    }

    fn end_early(&mut self, now: Time, id: RequestId) {
        if let Some(&slot) = self.by_id.get(&id) {
            self.doom(slot, Code::Ok, now);
            self.tidy_deadlines();
        }
    }

    fn task_done(&mut self, now: Time, task: TaskId) {
        let rec = self.tasks.remove(&task).expect("task_done for an unknown task");
        self.outstanding[rec.worker] -= 1;
        self.stamp += 1;
        let stamp = self.stamp;
        let mut idle = std::mem::take(&mut self.idle_slots);
        for &(slot, node) in &rec.rows {
            let r = self.req_mut(slot);
            r.done_nodes += 1;
            let sg = r.nodes[node as usize].sg;
            if r.sgs[sg as usize].stamp != stamp {
                // First row of this subgraph in the task: the pin counter drops once per task.
                r.sgs[sg as usize].stamp = stamp;
                r.sgs[sg as usize].outstanding -= 1;
                if r.sgs[sg as usize].outstanding == 0 {
                    self.unpin(slot, sg);
                }
            }
            let r = self.req_mut(slot);
            if r.stamp != stamp {
                r.stamp = stamp;
                r.inflight -= 1;
                if r.inflight == 0 {
                    self.running -= 1;
                    self.queued += 1;
                    idle.push(slot);
                }
            }
            if self.req(slot).doomed.is_some() {
                continue;
            }
            // External successors: a subgraph whose last external dependency finished becomes
            // schedulable, with its nodes that have no same-subgraph predecessor.
            for k in self.req(slot).external_successors(node) {
                let r = self.req_mut(slot);
                let s = r.edges[k];
                let ssg = r.nodes[s as usize].sg;
                r.sgs[ssg as usize].external_left -= 1;
                if r.sgs[ssg as usize].external_left == 0 {
                    for i in r.subgraph_roots(ssg) {
                        let v = self.req(slot).edges[i];
                        self.push_ready(slot, v);
                    }
                }
            }
        }
        // Deadlines are checked at this boundary first: a request past its deadline stops here.
        self.expire(now);
        // Only a request with nothing running may complete: those whose last running task this
        // was, in the order of their first row.
        for &slot in &idle {
            if self.reqs[slot as usize].is_some() {
                self.maybe_complete(slot, now);
            }
        }
        idle.clear();
        self.idle_slots = idle;
        let mut rows = rec.rows;
        rows.clear();
        if self.spare_rows.len() < MAX_SPARE {
            self.spare_rows.push(rows);
        }
        self.tidy_deadlines();
        self.schedule();
    }

    fn tick(&mut self, now: Time) {
        self.expire(now);
        self.schedule();
    }

    fn poll(&mut self) -> Option<Decision> {
        self.out.pop_front()
    }

    fn next_wakeup(&self) -> Option<Time> {
        self.deadlines.peek().map(|Reverse((d, _, _))| *d)
    }

    fn queued(&self) -> usize {
        self.queued
    }

    fn running(&self) -> usize {
        self.running
    }
}
