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
//!   subgraphs (request priority, then the order below), up to MaxBatch(type); every subgraph
//!   touched is pinned to worker and its pin counter counts the task; pad the batch to the
//!   smallest size in Bsizes(type) that holds it.
//! on task done: pin counters drop; a subgraph whose counter reaches 0 is unpinned.
//! ```
//!
//! Order among unpinned subgraphs of one request priority: the chains unpinned together on the
//! forming worker (in their block's order, see [`chain`]), then those unpinned on other workers
//! (by worker index), then the rest in the order they became ready. A subgraph that is unpinned was ready
//! before anything that queued since, and keeping it on its worker keeps its state there.
//!
//! New requests join at the next task formed; a request leaves (completes) as soon as its last
//! cell finishes — no request waits for a batch-mate. Cancel, deadline expiry and an early end
//! (Seq2Seq `eos`) take effect at the next cell boundary: the request's unsubmitted cells are
//! dropped, and it completes once none of its cells is running (its state slots may then be
//! reused); an early-ended request whose deadline passes before then completes
//! `DeadlineExceeded`, as its caller gets nothing in time. Per-request priorities order the unpinned subgraphs; BatchMaker itself has none.
//!
//! Three request processors share the queues, each exact for the graphs it takes:
//! * *Chain* requests (`lstm`, `seq2seq`, fixed-shape: one path of cells, see [`chain`]) keep a
//!   cursor per request and, while pinned, a lane in a dense per-(worker, type) block, so forming
//!   a task costs one pass over its rows plus work per request joining or leaving.
//! * *Tree* requests (`treelstm`, and any graph with a [`TreeShape`](crate::sched::graph::TreeShape),
//!   see [`tree`]) keep one queue entry for all their leaves and a cursor into the inner
//!   subgraph's levels, so a task costs work per (request, task) run of rows, not per row.
//! * *Graph* requests (any other shape, see [`request`]) keep per-node dependency counters and
//!   ready lists.
//!
//! The policy relies on a worker's tasks finishing in the order they were launched (a worker is
//! one stream); `task_done` panics otherwise.

mod chain;
mod chain_queue;
mod config;
mod graph_queue;
#[cfg(test)]
mod model_check;
mod request;
#[cfg(test)]
mod tests;
mod tree;
mod tree_queue;

use std::cmp::Reverse;
use std::collections::VecDeque;

use crate::error::{Code, Result};
use crate::sched::book::Book;
use crate::sched::{
    Arrival, CellGraph, CellType, Decision, IdTable, Policy, RequestId, TaskId, TaskReport, TaskShape, Time,
    WorkerId, WorkerShape,
};

pub use config::{CellTypeConfig, CellularConfig, DEFAULT_MAX_TASKS_TO_SUBMIT};

use chain::{Block, Chain, ChainState, Lane, Taken, advance};
use request::{NONE, Req, SgRef, Where};
use tree::{INNER, Inner, LEAVES, Tree};

/// Most recycled buffers kept (request arrays, task rows).
const MAX_SPARE: usize = 256;

/// Empty per-priority queues kept for reuse, per cell type.
const KEPT_PRIORITY_QUEUES: usize = 8;

/// One request in the policy: one cache line, the unit every scheduling step touches per
/// request. (Its deadline lives in `CellularPolicy::deadlines` only.)
#[repr(align(64))]
struct Request {
    id: RequestId,
    generation: u32,
    priority: i32,
    /// Set once the request is to stop at the next boundary, with the code it completes with.
    doomed: Option<Code>,
    /// A cell of it has been launched (it counts as running, no longer queued).
    started: bool,
    body: Body,
}

enum Body {
    Chain(Chain),
    /// Boxed: a graph request's state is large, and keeping `Request` small keeps the chain
    /// requests' records dense.
    Graph(Box<Req>),
    /// Its state is `CellularPolicy::trees[slot]`: dense by slot, so the records the scheduling
    /// steps touch per tree stay close together and are reused with the slot.
    Tree,
}

impl Request {
    fn chain(&mut self) -> &mut Chain {
        match &mut self.body {
            Body::Chain(c) => c,
            _ => panic!("request {} is not a chain request", self.id),
        }
    }

    fn graph(&mut self) -> &mut Req {
        match &mut self.body {
            Body::Graph(g) => g,
            _ => panic!("request {} is not a graph request", self.id),
        }
    }
}

/// A submitted, unfinished task.
struct TaskRec {
    task: TaskId,
    ty: CellType,
    /// Rows of graph requests, as (request slot, node).
    rows: Vec<(u32, u32)>,
    /// Slots of the chain requests whose current run leaves with this task (its last node is in
    /// it, or the request was doomed while its lane was in it).
    releases: Vec<u32>,
    /// Tree requests in this task, as (request slot, rows): each has one run of rows.
    trees: Vec<(u32, u32)>,
}

/// A task being formed.
struct Forming {
    /// Rows of graph requests, as (request slot, node).
    rows: Vec<(u32, u32)>,
    /// Tree requests taken from, as (request slot, rows).
    trees: Vec<(u32, u32)>,
    /// Every row, and the chains released.
    out: Taken,
    /// The chains that continue after this task: the worker's block of this type once formed.
    block: Block,
}

/// Unpinned subgraphs of one request priority, in the order they became ready. May be empty.
struct PrioQueue {
    priority: i32,
    q: VecDeque<SgRef>,
}

/// Per cell type: ready subgraphs and ready-node counts.
struct TypeQueues {
    /// Unpinned subgraphs (queued chain runs, graph subgraphs, tree leaves and inner
    /// subgraphs), highest request priority first.
    unpinned: Vec<PrioQueue>,
    /// Ready nodes in `unpinned`.
    ready_unpinned: usize,
    /// Graph subgraphs pinned to each worker.
    pinned: Vec<VecDeque<SgRef>>,
    /// Inner subgraphs of tree requests pinned to each worker, in the order they were pinned. An
    /// entry whose request was unpinned since is stale, and dropped when a pass meets it.
    pinned_trees: Vec<Vec<SgRef>>,
    /// Ready nodes of graph subgraphs and tree inner subgraphs pinned to each worker.
    ready_pinned: Vec<usize>,
    /// Chains pinned to each worker (a live block) or unpinned together (a lapsed one).
    blocks: Vec<Block>,
    /// Ready nodes in lapsed blocks (one per live lane).
    lapsed_ready: usize,
}

/// BatchMaker's cellular batching policy.
pub struct CellularPolicy {
    cfg: CellularConfig,
    reqs: Vec<Option<Request>>,
    /// The state of each slot's tree request (`Body::Tree`).
    trees: Vec<Option<Tree>>,
    /// Generation of each request slot, bumped on reuse (never 0) so stale queue entries are
    /// recognised.
    generations: Vec<u32>,
    /// Per slot: the generation of its request while it lives and is not doomed, else 0. What a
    /// lane checks before emitting a row, in a dense array rather than the request's record.
    alive: Vec<u32>,
    free: Vec<u32>,
    by_id: IdTable<u32>,
    types: Vec<TypeQueues>,
    /// Per worker: its unfinished tasks in launch order.
    streams: Vec<VecDeque<TaskRec>>,
    /// Outbox, counts, task ids, and deadlines by (slot, generation).
    book: Book<(u32, u32)>,
    /// Records of completed graph requests (boxed as in `Body::Graph`, so reusing one allocates
    /// nothing) and buffers of done tasks, for reuse.
    #[allow(clippy::vec_box)]
    spare_reqs: Vec<Box<Req>>,
    spare_rows: Vec<Vec<(u32, u32)>>,
    spare_slots: Vec<Vec<u32>>,
    spare_lanes: Vec<Vec<Lane>>,
    /// Row vectors of launched tasks handed back by the driver (`Policy::recycle`).
    spare_ids: Vec<Vec<RequestId>>,
    spare_nodes: Vec<Vec<u32>>,
    /// Scratch for `task_done`: slots with nothing running any more.
    idle_slots: Vec<u32>,
    /// Scratch for `task_done`: the tree inner subgraphs it unpins, as (request slot, priority,
    /// ready nodes).
    unpinned_trees: Vec<(u32, i32, usize)>,
    /// Scratch for `form_batched_task`: (slot, node) made ready by the task being formed.
    ready_after: Vec<(u32, u32)>,
    /// Numbers each task formation and completion, so per-task counters count a request or a
    /// subgraph once per task however many of its nodes the task holds.
    stamp: u64,
    /// An event may have made work ready since the last schedule: `poll` schedules first. So
    /// the events a driver hands over before it polls (those that came while its engine thread
    /// was busy) are scheduled together, and the nodes they made ready share tasks.
    unscheduled: bool,
}

/// Keep a recycled buffer unless enough are kept already.
fn recycle<T>(spare: &mut Vec<Vec<T>>, mut v: Vec<T>) {
    if spare.len() < MAX_SPARE {
        v.clear();
        spare.push(v);
    }
}

impl CellularPolicy {
    pub fn new(cfg: CellularConfig) -> Result<CellularPolicy> {
        cfg.check()?;
        let types = (0..cfg.cell_types.len())
            .map(|_| TypeQueues {
                unpinned: Vec::new(),
                ready_unpinned: 0,
                pinned: (0..cfg.workers).map(|_| VecDeque::new()).collect(),
                pinned_trees: (0..cfg.workers).map(|_| Vec::new()).collect(),
                ready_pinned: vec![0; cfg.workers],
                blocks: (0..cfg.workers).map(|_| Block::default()).collect(),
                lapsed_ready: 0,
            })
            .collect();
        Ok(CellularPolicy {
            streams: (0..cfg.workers).map(|_| VecDeque::new()).collect(),
            cfg,
            reqs: Vec::new(),
            trees: Vec::new(),
            generations: Vec::new(),
            alive: Vec::new(),
            free: Vec::new(),
            by_id: IdTable::default(),
            types,
            book: Book::default(),
            spare_reqs: Vec::new(),
            spare_rows: Vec::new(),
            spare_slots: Vec::new(),
            spare_lanes: Vec::new(),
            spare_ids: Vec::new(),
            spare_nodes: Vec::new(),
            idle_slots: Vec::new(),
            unscheduled: false,
            unpinned_trees: Vec::new(),
            ready_after: Vec::new(),
            stamp: 0,
        })
    }

    pub fn config(&self) -> &CellularConfig {
        &self.cfg
    }

    fn req(&self, slot: u32) -> &Request {
        self.reqs[slot as usize].as_ref().expect("live request slot")
    }

    fn req_mut(&mut self, slot: u32) -> &mut Request {
        self.reqs[slot as usize].as_mut().expect("live request slot")
    }

    /// Count the request as running from its first launched cell on.
    fn start(&mut self, slot: u32) {
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        if !r.started {
            r.started = true;
            self.book.start(1);
        }
    }

    /// Queue entry `sg` of request `slot` (of request priority `priority`), standing for `ready`
    /// ready nodes of cell type `ty`, among the unpinned subgraphs of its priority: at the back,
    /// or at the front.
    fn queue_unpinned(&mut self, slot: u32, sg: u32, priority: i32, ty: usize, ready: usize, front: bool) {
        let at = SgRef { slot, generation: self.generations[slot as usize], sg };
        let q = &mut self.types[ty];
        q.ready_unpinned += ready;
        push_unpinned(&mut q.unpinned, priority, at, front);
    }

    // ---- Algorithm 1 -----------------------------------------------------------------------

    /// Ready nodes of `ty` pinned to `worker`.
    fn pinned_ready(&self, ty: usize, worker: WorkerId) -> usize {
        let t = &self.types[ty];
        let b = &t.blocks[worker];
        t.ready_pinned[worker] + if b.live { b.size() } else { 0 }
    }

    /// Ready nodes of `ty` that a task on `worker` may take.
    fn available(&self, ty: usize, worker: WorkerId) -> usize {
        let t = &self.types[ty];
        self.pinned_ready(ty, worker) + t.ready_unpinned + t.lapsed_ready
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
            .or_else(|| best(&|ty| self.pinned_ready(ty, worker) > 0))
            // Step 3: the type with the most ready nodes.
            .or_else(|| {
                (0..n)
                    .filter(|&ty| self.available(ty, worker) > 0)
                    .min_by_key(|&ty| (Reverse(self.available(ty, worker)), Reverse(prio(ty)), ty))
            })
    }

    /// The highest request priority below `below` (any, if `None`) with unpinned subgraphs of
    /// `ty`: queued, or in a lapsed block.
    fn next_priority(&self, ty: usize, below: Option<i32>) -> Option<i32> {
        let t = &self.types[ty];
        let under = |p: &i32| below.is_none_or(|b| *p < b);
        let queued = t.unpinned.iter().filter(|q| !q.q.is_empty()).map(|q| q.priority).find(under);
        let lapsed = t
            .blocks
            .iter()
            .filter(|b| !b.live && b.size() > 0)
            .filter_map(|b| b.priority)
            .filter(under)
            .max();
        queued.max(lapsed)
    }

    /// FormBatchedTask (Algorithm 1) for cell type `ty` on `worker`, then submit it.
    fn form_batched_task(&mut self, ty: usize, worker: WorkerId) {
        let max = self.cfg.cell_types[ty].max_batch;
        let task = self.book.task_id();
        self.stamp += 1;
        let stamp = self.stamp;
        let room = max.min(self.available(ty, worker));
        let mut f = Forming {
            rows: self.spare_rows.pop().unwrap_or_default(),
            trees: self.spare_rows.pop().unwrap_or_default(),
            out: Taken {
                requests: self.spare_ids.pop().unwrap_or_default(),
                nodes: self.spare_nodes.pop().unwrap_or_default(),
                released: self.spare_slots.pop().unwrap_or_default(),
            },
            block: Block { lanes: self.spare_lanes.pop().unwrap_or_default(), ..Block::default() },
        };
        f.out.requests.reserve(room);
        f.out.nodes.reserve(room);
        // 1. Chains pinned here: all of them, in block order — they were all in this worker's
        //    last task of this type, so they fit.
        let own = &mut self.types[ty].blocks[worker];
        let own_lapsed = !own.live;
        if own.live {
            // Advanced in place, the block's lanes become the task's block.
            std::mem::swap(&mut f.block.lanes, &mut own.lanes);
            f.block.priority = own.priority;
            let kept = advance(&mut f.block.lanes, &mut own.dead, &self.alive, max, &mut f.out);
            debug_assert!(kept == f.block.lanes.len() && own.dead == 0, "a live block fits its task");
        }
        // 2. Graph subgraphs pinned here. With no ready node pinned here, every entry of the
        //    pinned queue is stale: the loop below would pop them all without taking anything,
        //    so drop them at once.
        if self.types[ty].ready_pinned[worker] == 0 {
            self.types[ty].pinned[worker].clear();
        }
        while f.out.requests.len() < max {
            let Some(&at) = self.types[ty].pinned[worker].front() else { break };
            if self.take_from(at, Where::Pinned(worker as u32), ty, worker, stamp, max, &mut f) {
                self.types[ty].pinned[worker].pop_front();
            }
        }
        //    Then tree inner subgraphs pinned here, in the order they were pinned; stale entries
        //    met are dropped.
        let mut list = std::mem::take(&mut self.types[ty].pinned_trees[worker]);
        let mut kept = 0;
        for i in 0..list.len() {
            let at = list[i];
            if f.out.requests.len() < max
                && self.take_tree(at, Where::Pinned(worker as u32), worker, task, max, &mut f)
            {
                continue;
            }
            list[kept] = at;
            kept += 1;
        }
        list.truncate(kept);
        self.types[ty].pinned_trees[worker] = list;
        // 3. Unpinned subgraphs, by request priority: at each priority, the chains unpinned on
        //    this worker, then those unpinned on other workers, then the queue.
        let mut below = None;
        while f.out.requests.len() < max {
            let Some(p) = self.next_priority(ty, below) else { break };
            below = Some(p);
            let lapsed_at = |t: &TypeQueues, w: usize| {
                let b = &t.blocks[w];
                !b.live && b.size() > 0 && b.priority == Some(p)
            };
            if own_lapsed && lapsed_at(&self.types[ty], worker) {
                self.take_lapsed(ty, worker, worker, max, &mut f);
            }
            for from in (0..self.cfg.workers).filter(|&w| w != worker) {
                if f.out.requests.len() < max && lapsed_at(&self.types[ty], from) {
                    self.take_lapsed(ty, from, worker, max, &mut f);
                }
            }
            let levels = &self.types[ty].unpinned;
            let Ok(level) = levels.binary_search_by_key(&Reverse(p), |q| Reverse(q.priority)) else {
                continue;
            };
            while f.out.requests.len() < max {
                let Some(&at) = self.types[ty].unpinned[level].q.front() else { break };
                let used = if tree::is_tree_entry(at.sg) {
                    self.take_tree(at, Where::Unpinned, worker, task, max, &mut f)
                } else {
                    match self.reqs.get(at.slot as usize) {
                        Some(Some(Request { body: Body::Chain(_), .. })) => {
                            self.take_chain(at, ty, worker, &mut f)
                        }
                        Some(Some(Request { body: Body::Graph(_), .. })) => {
                            self.take_from(at, Where::Unpinned, ty, worker, stamp, max, &mut f)
                        }
                        // The request has completed (and its slot may hold a tree request now).
                        _ => true,
                    }
                };
                if used {
                    self.types[ty].unpinned[level].q.pop_front();
                }
            }
        }
        // Emptied queues are kept for the next requests of their priority (and rewound, so those
        // land in memory still in cache), unless many priorities are in use.
        let levels = &mut self.types[ty].unpinned;
        if levels.len() > KEPT_PRIORITY_QUEUES {
            levels.retain(|p| !p.q.is_empty());
        }
        for level in levels.iter_mut().filter(|p| p.q.is_empty()) {
            level.q.clear();
        }
        // Chains unpinned on this worker and not taken now join the queues: the worker's block
        // is the task's continuing chains from here on.
        if own_lapsed && !self.types[ty].blocks[worker].lanes.is_empty() {
            self.disperse(ty, worker);
        }
        debug_assert!(!f.out.requests.is_empty(), "ChooseCellType picked a type with nothing ready");
        for &slot in &f.out.released {
            self.req_mut(slot).chain().state = ChainState::Releasing;
        }
        let own = &mut self.types[ty].blocks[worker];
        let emptied = std::mem::replace(&mut own.lanes, std::mem::take(&mut f.block.lanes));
        recycle(&mut self.spare_lanes, emptied);
        own.priority = f.block.priority;
        debug_assert_eq!(own.dead, 0);
        own.live = !own.lanes.is_empty();
        own.last_task = task;
        // Same-subgraph successors of the submitted graph nodes become ready now, in row order:
        // they will run after this task on the same stream. (Not before: they could not share
        // the task.)
        let mut ready = std::mem::take(&mut self.ready_after);
        for &(slot, node) in &ready {
            self.push_ready(slot, node);
        }
        ready.clear();
        self.ready_after = ready;
        let real = f.out.requests.len();
        let batch = self.cfg.cell_types[ty].bsizes.iter().copied().find(|&b| b >= real).unwrap_or(real);
        self.streams[worker].push_back(TaskRec {
            task,
            ty: ty as CellType,
            rows: f.rows,
            releases: f.out.released,
            trees: f.trees,
        });
        let shape = TaskShape::Cells { cell: ty as CellType, nodes: f.out.nodes, steps: 1 };
        self.book.launch(task, worker, shape, f.out.requests, batch);
    }

    /// Schedule (Algorithm 1) on every worker with room, least loaded first.
    fn schedule(&mut self) {
        loop {
            let Some(worker) = (0..self.cfg.workers)
                .filter(|&w| self.streams[w].len() < self.cfg.max_tasks_to_submit)
                .filter(|&w| (0..self.types.len()).any(|ty| self.available(ty, w) > 0))
                .min_by_key(|&w| (self.streams[w].len(), w))
            else {
                return;
            };
            let ty = self.choose_cell_type(worker).expect("the worker has ready nodes");
            self.form_batched_task(ty, worker);
        }
    }

    // ---- request lifecycle -----------------------------------------------------------------

    /// Whether a launched, unfinished task holds a cell of the request in `slot`.
    fn is_running(&self, slot: u32) -> bool {
        match &self.req(slot).body {
            Body::Graph(g) => g.inflight > 0,
            Body::Tree => self.trees[slot as usize].as_ref().expect("live tree request").inflight > 0,
            Body::Chain(c) => match c.state {
                ChainState::Releasing => true,
                ChainState::Resident(w) => self.types[c.ty as usize].blocks[w as usize].live,
                ChainState::Queued | ChainState::Idle => false,
            },
        }
    }

    /// Complete the request in `slot` if it is finished and nothing of it runs.
    fn maybe_complete(&mut self, slot: u32) {
        if self.is_running(slot) {
            return;
        }
        let r = self.req(slot);
        let finished = match &r.body {
            Body::Graph(g) => g.done_nodes as usize == g.nodes.len(),
            Body::Tree => {
                let t = self.trees[slot as usize].as_ref().expect("live tree request");
                t.leaves_left == 0 && t.inner == Inner::Drained
            }
            Body::Chain(c) => c.state == ChainState::Idle,
        };
        // A finished request past its deadline was doomed by `expire`, which runs first at every
        // boundary.
        let code = match r.doomed {
            Some(code) => code,
            None if finished => Code::Ok,
            None => return,
        };
        // Read in place and dropped in place: moving the record out costs a copy per request.
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        let (id, started) = (r.id, r.started);
        match &mut r.body {
            Body::Graph(_) => {
                // Moved out whole, box and buffers, for the next graph request (the record is
                // dropped just below).
                if let Body::Graph(g) = std::mem::replace(&mut r.body, Body::Tree)
                    && g.worth_keeping()
                    && self.spare_reqs.len() < MAX_SPARE
                {
                    self.spare_reqs.push(g);
                }
            }
            Body::Tree => {
                let t = self.trees[slot as usize].take().expect("live tree request");
                recycle(&mut self.spare_slots, t.into_lists());
            }
            Body::Chain(_) => {}
        }
        self.reqs[slot as usize] = None;
        self.by_id.remove(&id);
        self.free.push(slot);
        self.alive[slot as usize] = 0;
        self.book.complete(id, code, started);
    }

    /// Stop the request at the next cell boundary with `code`.
    fn doom(&mut self, slot: u32, code: Code) {
        if self.req(slot).doomed.is_some() {
            return;
        }
        match self.req(slot).body {
            Body::Graph(_) => self.drop_ready(slot),
            Body::Tree => self.drop_tree(slot),
            Body::Chain(_) => self.drop_chain(slot),
        }
        self.req_mut(slot).doomed = Some(code);
        self.alive[slot as usize] = 0;
        self.maybe_complete(slot);
    }

    /// Drop deadline entries of requests that have completed or are already stopping, so the
    /// earliest entry is a live one (`next_wakeup` reads it).
    fn tidy_deadlines(&mut self) {
        let reqs = &self.reqs;
        self.book.tidy(|(slot, generation)| deadline_live(reqs, slot, generation));
    }

    fn expire(&mut self, now: Time) {
        while let Some((slot, _)) =
            self.book.due(now, |(slot, generation)| deadline_live(&self.reqs, slot, generation))
        {
            let r = self.req_mut(slot);
            if r.doomed == Some(Code::Ok) {
                // Ended early, its last cells still running: it completes past its deadline.
                r.doomed = Some(Code::DeadlineExceeded);
            } else {
                self.doom(slot, Code::DeadlineExceeded);
            }
        }
        // `due` stopped at a live entry (or none): nothing left to tidy.
    }
}

/// Whether the request of a deadline entry still has its deadline watched: it lives (the
/// generation matches) and is not stopping for another reason (an early end still is: it
/// completes `DeadlineExceeded` if the deadline passes before its last running cell ends).
fn deadline_live(reqs: &[Option<Request>], slot: u32, generation: u32) -> bool {
    reqs.get(slot as usize)
        .and_then(|r| r.as_ref())
        .is_some_and(|r| r.generation == generation && matches!(r.doomed, None | Some(Code::Ok)))
}

/// Queue `at` among the unpinned subgraphs of its request priority (at the front or the back).
fn push_unpinned(levels: &mut Vec<PrioQueue>, priority: i32, at: SgRef, front: bool) {
    if let [only] = &mut levels[..]
        && only.priority == priority
    {
        // One priority in use, the common case.
        if front {
            only.q.push_front(at)
        } else {
            only.q.push_back(at)
        }
        return;
    }
    match levels.binary_search_by_key(&Reverse(priority), |p| Reverse(p.priority)) {
        Ok(i) if front => levels[i].q.push_front(at),
        Ok(i) => levels[i].q.push_back(at),
        Err(i) => levels.insert(i, PrioQueue { priority, q: VecDeque::from([at]) }),
    }
}

impl Policy for CellularPolicy {
    fn workers(&self) -> Vec<WorkerShape> {
        let max = self.cfg.cell_types.iter().map(|t| t.max_batch).max().unwrap_or(1);
        WorkerShape::uniform(self.cfg.workers, max)
    }

    fn lookahead(&self) -> usize {
        self.cfg.max_tasks_to_submit
    }

    fn reserve(&mut self, requests: usize) {
        // A request holds one slot of each slab from arrival to its end.
        let held = self.book.reserve(requests);
        let more = held.saturating_sub(self.reqs.len());
        self.reqs.reserve(more);
        self.trees.reserve(more);
        self.generations.reserve(more);
        self.alive.reserve(more);
        self.free.reserve(held.saturating_sub(self.free.len()));
        self.by_id.reserve_for(held);
    }

    fn arrive(&mut self, now: Time, a: Arrival) {
        let graph = a.cells.unwrap_or_else(CellGraph::single);
        assert!(!graph.is_empty(), "request {} has an empty cell graph", a.id);
        assert!(
            (graph.max_type() as usize) < self.cfg.cell_types.len(),
            "request {} uses a cell type this policy was not configured for",
            a.id
        );
        let slot = self.free.pop().unwrap_or_else(|| {
            self.reqs.push(None);
            self.trees.push(None);
            self.generations.push(0);
            self.alive.push(0);
            (self.reqs.len() - 1) as u32
        });
        let generation = match self.generations[slot as usize].wrapping_add(1) {
            0 => 1,
            g => g,
        };
        self.generations[slot as usize] = generation;
        let body = if graph.first_run().is_some() {
            Body::Chain(Chain::new(graph))
        } else if graph.tree_shape().is_some() {
            let lists = self.spare_slots.pop().unwrap_or_default();
            self.trees[slot as usize] = Some(Tree::new(a.id, a.priority, graph, lists));
            Body::Tree
        } else {
            let mut req = self.spare_reqs.pop().unwrap_or_default();
            req.reset(&graph);
            Body::Graph(req)
        };
        self.reqs[slot as usize] =
            Some(Request { id: a.id, generation, priority: a.priority, doomed: None, started: false, body });
        self.alive[slot as usize] = generation;
        assert!(self.by_id.insert(a.id, slot).is_none(), "request {} arrived twice", a.id);
        self.book.arrive(a.model, a.deadline, (slot, generation));
        match self.req(slot).body {
            Body::Chain(_) => self.queue_chain(slot, false),
            Body::Tree => self.queue_leaves(slot),
            Body::Graph(_) => {
                let n = self.req_mut(slot).graph().nodes.len();
                for node in 0..n {
                    if self.req_mut(slot).graph().is_initially_ready(node) {
                        self.push_ready(slot, node as u32);
                    }
                }
            }
        }
        self.expire(now);
        self.unscheduled = true;
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        if let Some(&slot) = self.by_id.get(&id) {
            self.doom(slot, Code::Cancelled);
            // Like every event that may launch: requests past their deadline stop first.
            self.expire(now);
            self.unscheduled = true;
        }
    }

    fn end_early(&mut self, _now: Time, id: RequestId) {
        if let Some(&slot) = self.by_id.get(&id) {
            self.doom(slot, Code::Ok);
            self.tidy_deadlines();
        }
    }

    fn task_done(&mut self, now: Time, report: &TaskReport) {
        let task = report.task;
        let worker = (0..self.cfg.workers)
            .find(|&w| self.streams[w].front().is_some_and(|t| t.task == task))
            .unwrap_or_else(|| {
                panic!("task_done({task}): not the oldest unfinished task of a worker (tasks finish in launch order)")
            });
        let rec = self.streams[worker].pop_front().expect("found above");
        let ty = rec.ty as usize;
        // The worker's last unfinished task of this type (every task of the type on the worker
        // becomes its block's `last_task`, and they finish in order): its chains are unpinned.
        if self.types[ty].blocks[worker].last_task == task {
            self.lapse(ty, worker);
        }
        self.stamp += 1;
        let stamp = self.stamp;
        let mut idle = std::mem::take(&mut self.idle_slots);
        self.graph_rows_done(&rec.rows, stamp, &mut idle);
        self.tree_rows_done(&rec.trees, ty, task, &mut idle);
        self.chain_runs_done(&rec.releases, &mut idle);
        // Deadlines are checked at this boundary first: a request past its deadline stops here.
        self.expire(now);
        // Only a request with nothing running may complete: those whose last running task this
        // was, in row order.
        for &slot in &idle {
            if self.reqs[slot as usize].is_some() {
                self.maybe_complete(slot);
            }
        }
        idle.clear();
        self.idle_slots = idle;
        recycle(&mut self.spare_rows, rec.rows);
        recycle(&mut self.spare_rows, rec.trees);
        recycle(&mut self.spare_slots, rec.releases);
        self.tidy_deadlines();
        self.unscheduled = true;
    }

    fn tick(&mut self, now: Time) {
        self.expire(now);
        self.unscheduled = true;
    }

    fn recycle(&mut self, requests: Vec<RequestId>, shape: TaskShape) {
        // Up to a worker's worth of tasks in flight each way is plenty.
        if self.spare_ids.len() < self.cfg.max_tasks_to_submit * self.cfg.workers + 1 {
            recycle(&mut self.spare_ids, requests);
            if let TaskShape::Cells { nodes, .. } = shape {
                recycle(&mut self.spare_nodes, nodes);
            }
        }
    }

    fn poll(&mut self) -> Option<Decision> {
        // Algorithm 1 runs at the first poll after events, over everything they made ready.
        if std::mem::take(&mut self.unscheduled) {
            self.schedule();
        }
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
