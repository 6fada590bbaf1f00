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
#[cfg(test)]
mod model_check;
mod request;
#[cfg(test)]
mod tests;
mod tree;

use std::cmp::Reverse;
use std::collections::VecDeque;

use crate::error::{Code, Error, Result};
use crate::sched::book::Book;
use crate::sched::graph::MAX_CELL_TYPES;
use crate::sched::{
    Arrival, CellGraph, CellType, Decision, IdMap, Policy, RequestId, TaskId, TaskReport, TaskShape, Time,
    WorkerId, WorkerShape,
};

use chain::{Block, Chain, ChainState, Lane, Taken, advance};
use request::{NONE, Req, SgRef, Where};
use tree::{INNER, Inner, LEAVES, Tree};
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

/// Empty per-priority queues kept for reuse, per cell type.
const KEPT_PRIORITY_QUEUES: usize = 8;

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
    by_id: IdMap<u32>,
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
            by_id: IdMap::default(),
            types,
            book: Book::default(),
            spare_reqs: Vec::new(),
            spare_rows: Vec::new(),
            spare_slots: Vec::new(),
            spare_lanes: Vec::new(),
            spare_ids: Vec::new(),
            spare_nodes: Vec::new(),
            idle_slots: Vec::new(),
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

    // ---- graph requests: ready-node bookkeeping --------------------------------------------

    /// Make `node` of graph request `slot` ready: append it to its subgraph's ready list and
    /// queue the subgraph where it belongs (pinned worker or unpinned) if it is not queued yet.
    fn push_ready(&mut self, slot: u32, node: u32) {
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        let (priority, generation) = (r.priority, r.generation);
        let g = r.graph();
        let sg = g.nodes[node as usize].sg;
        g.push_ready(sg, node);
        let s = &mut g.sgs[sg as usize];
        let ty = s.ty as usize;
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

    /// A graph subgraph's ready nodes move from `pinned` to the unpinned queues (its pin counter
    /// fell to 0). The stale entry in the pinned queue is skipped when met.
    fn unpin(&mut self, slot: u32, sg: u32) {
        let r = self.reqs[slot as usize].as_mut().expect("live request slot");
        let (priority, generation) = (r.priority, r.generation);
        let s = &mut r.graph().sgs[sg as usize];
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

    /// Drop every ready node of a graph request (cancel, deadline, early end).
    fn drop_ready(&mut self, slot: u32) {
        let g = self.reqs[slot as usize].as_mut().expect("live request slot").graph();
        for s in g.sgs.iter_mut() {
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

    // ---- tree requests ----------------------------------------------------------------------

    /// Drop every ready node of a tree request (cancel, deadline, early end).
    fn drop_tree(&mut self, slot: u32) {
        let t = self.trees[slot as usize].as_mut().expect("live tree request");
        let was = t.inner;
        let (leaf_type, inner_type) = (t.leaf_type as usize, t.inner_type as usize);
        let (leaves, inner) = t.drop_ready();
        self.types[leaf_type].ready_unpinned -= leaves;
        let q = &mut self.types[inner_type];
        match was {
            Inner::Queued => q.ready_unpinned -= inner,
            Inner::Pinned(w) => q.ready_pinned[w as usize] -= inner,
            Inner::Waiting | Inner::Drained => debug_assert_eq!(inner, 0),
        }
    }

    /// Queue tree request `slot`'s leaves, ready on arrival, as one entry.
    fn queue_leaves(&mut self, slot: u32) {
        let t = self.trees[slot as usize].as_ref().expect("live tree request");
        let (priority, ty, ready) = (t.priority, t.leaf_type as usize, t.leaves_ready());
        self.queue_unpinned(slot, LEAVES, priority, ty, ready, false);
    }

    /// Queue tree request `slot`'s inner subgraph, schedulable now, as unpinned (at the back of
    /// its priority).
    fn queue_inner(&mut self, slot: u32) {
        let t = self.trees[slot as usize].as_mut().expect("live tree request");
        t.inner = Inner::Queued;
        let (priority, ty, ready) = (t.priority, t.inner_type as usize, t.inner_ready());
        self.queue_unpinned(slot, INNER, priority, ty, ready, false);
    }

    // ---- chain requests ---------------------------------------------------------------------

    /// Queue chain request `slot`'s current run as an unpinned subgraph, at the back of its
    /// priority (it became ready now) or at the front (it was unpinned).
    fn queue_chain(&mut self, slot: u32, front: bool) {
        let r = self.req_mut(slot);
        let priority = r.priority;
        let c = r.chain();
        c.state = ChainState::Queued;
        let (run, ty) = (c.run, c.ty as usize);
        self.queue_unpinned(slot, run, priority, ty, 1, front);
    }

    /// The worker's last unfinished task of `ty` finished: its chains' pin counters are all 0.
    /// They stay together as a lapsed block — unless their priorities differ, in which case they
    /// join the priority queues one by one.
    fn lapse(&mut self, ty: usize, worker: WorkerId) {
        let t = &mut self.types[ty];
        let b = &mut t.blocks[worker];
        if !b.live {
            return;
        }
        b.live = false;
        t.lapsed_ready += b.size();
        if b.size() == 0 || b.priority.is_none() {
            self.disperse(ty, worker);
        }
    }

    /// The lanes of a lapsed block go to the unpinned queues, in order, each at the front of its
    /// priority.
    fn disperse(&mut self, ty: usize, worker: WorkerId) {
        let b = &mut self.types[ty].blocks[worker];
        debug_assert!(!b.live);
        let size = b.size();
        let lanes = std::mem::take(&mut b.lanes);
        b.dead = 0;
        self.types[ty].lapsed_ready -= size;
        for lane in lanes.iter().rev() {
            if self.alive[lane.slot as usize] == lane.generation {
                self.req_mut(lane.slot).chain().cursor = lane.next;
                self.queue_chain(lane.slot, true);
            }
        }
        recycle(&mut self.spare_lanes, lanes);
    }

    /// Take lanes of `from`'s lapsed block into the task on `worker`, in order, as room allows.
    /// Those taken are pinned to `worker` again; the rest stay in the block.
    fn take_lapsed(&mut self, ty: usize, from: WorkerId, worker: WorkerId, max: usize, f: &mut Forming) {
        let b = &mut self.types[ty].blocks[from];
        debug_assert!(!b.live && b.priority.is_some());
        f.block.note_source(b.priority);
        let rows = f.out.requests.len();
        let kept = if from == worker && f.block.lanes.is_empty() {
            // This worker's own block: advanced in place, it becomes the task's block.
            std::mem::swap(&mut f.block.lanes, &mut b.lanes);
            let kept = advance(&mut f.block.lanes, &mut b.dead, &self.alive, max - rows, &mut f.out);
            // The lanes not reached stay in the block, in the buffer swapped in above.
            b.lanes.extend(f.block.lanes.drain(kept..));
            kept
        } else {
            let kept = advance(&mut b.lanes, &mut b.dead, &self.alive, max - rows, &mut f.out);
            let start = f.block.lanes.len();
            f.block.lanes.extend(b.lanes.drain(..kept));
            if from != worker {
                for i in start..f.block.lanes.len() {
                    let slot = f.block.lanes[i].slot;
                    self.req_mut(slot).chain().state = ChainState::Resident(worker as u32);
                }
            }
            kept
        };
        let taken = f.out.requests.len() - rows;
        debug_assert!(kept <= taken);
        self.types[ty].lapsed_ready -= taken;
    }

    /// Take the queued chain run `at` (one node) into the task on `worker`. True: the queue
    /// entry is used up (always — a chain has one ready node).
    fn take_chain(&mut self, at: SgRef, ty: usize, worker: WorkerId, f: &mut Forming) -> bool {
        let Some(Some(r)) = self.reqs.get_mut(at.slot as usize) else { return true };
        let (id, priority) = (r.id, r.priority);
        if r.generation != at.generation || r.doomed.is_some() {
            return true;
        }
        let first = !r.started;
        let c = r.chain();
        if c.state != ChainState::Queued || c.run != at.sg {
            debug_assert!(!first, "a request that never started has one live queue entry");
            return true; // stale: taken through another entry since, or dropped
        }
        let (node, end) = (c.cursor, c.end);
        f.out.requests.push(id);
        f.out.nodes.push(node);
        if node + 1 == end {
            c.state = ChainState::Releasing;
            f.out.released.push(at.slot);
        } else {
            c.state = ChainState::Resident(worker as u32);
            f.block.note_source(Some(priority));
            f.block.lanes.push(Lane { id, slot: at.slot, generation: at.generation, next: node + 1, end });
        }
        self.types[ty].ready_unpinned -= 1;
        // As `start`, without looking the request up again.
        if first {
            r.started = true;
            self.book.start(1);
        }
        true
    }

    /// Drop a chain request's ready node (cancel, deadline, early end). A lane in a live block
    /// is in that block's last task, so the request is released when that task finishes.
    fn drop_chain(&mut self, slot: u32) {
        let c = self.reqs[slot as usize].as_mut().expect("live request slot").chain();
        let ty = c.ty as usize;
        match c.state {
            ChainState::Queued => {
                c.state = ChainState::Idle;
                self.types[ty].ready_unpinned -= 1;
            }
            ChainState::Resident(w) => {
                // Its lane stays in the block, dead, until the next pass drops it.
                let b = &mut self.types[ty].blocks[w as usize];
                b.dead += 1;
                if b.live {
                    c.state = ChainState::Releasing;
                    let last = b.last_task;
                    let rec = self.streams[w as usize]
                        .iter_mut()
                        .rev()
                        .find(|t| t.task == last)
                        .expect("a live block's last task is unfinished");
                    rec.releases.push(slot);
                } else {
                    c.state = ChainState::Idle;
                    self.types[ty].lapsed_ready -= 1;
                }
            }
            ChainState::Releasing | ChainState::Idle => {}
        }
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
        let shape = TaskShape::Cells { cell: ty as CellType, nodes: f.out.nodes };
        self.book.launch(task, worker, shape, f.out.requests, batch);
    }

    /// Move ready nodes of the graph subgraph `at` (found in queue `from`) into the task,
    /// pinning it to `worker`; their same-subgraph successors that this makes ready go to
    /// `ready_after`. True when the queue entry is used up (stale, or no ready nodes left).
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
        let id = r.id;
        if r.generation != at.generation {
            return true; // stale entry: the slot was reused
        }
        let g = r.graph();
        if g.sgs[at.sg as usize].queued != from {
            return true; // stale entry: the subgraph moved or was dropped
        }
        let t = &mut self.types[ty];
        if g.stamp != stamp {
            g.stamp = stamp;
            g.inflight += 1;
        }
        let s = &mut g.sgs[at.sg as usize];
        if s.stamp != stamp {
            s.stamp = stamp;
            s.outstanding += 1;
        }
        s.pinned = worker as u32;
        while f.out.requests.len() < max {
            let Some(node) = g.pop_ready(at.sg) else { break };
            f.rows.push((at.slot, node));
            f.out.requests.push(id);
            f.out.nodes.push(node);
            match from {
                Where::Pinned(w) => t.ready_pinned[w as usize] -= 1,
                _ => t.ready_unpinned -= 1,
            }
            // Counted now, queued once the task is formed (`form_batched_task`).
            for k in g.internal_successors(node) {
                let s = g.edges[k];
                let succ = &mut g.nodes[s as usize];
                succ.internal_left -= 1;
                if succ.internal_left == 0 && g.sgs[at.sg as usize].external_left == 0 {
                    self.ready_after.push((at.slot, s));
                }
            }
        }
        let s = &mut g.sgs[at.sg as usize];
        let used = if s.ready_len == 0 {
            s.queued = Where::Nowhere;
            true
        } else if from == Where::Unpinned {
            // The task is full but the subgraph has more: it is pinned now, so its remaining
            // ready nodes wait at the front of this worker's pinned queue.
            let n = s.ready_len as usize;
            s.queued = Where::Pinned(worker as u32);
            t.ready_unpinned -= n;
            t.ready_pinned[worker] += n;
            t.pinned[worker].push_front(at);
            true
        } else {
            false
        };
        self.start(at.slot);
        used
    }

    /// Take from the tree request of entry `at` (found in queue `from`: its leaves or its inner
    /// subgraph, unpinned, or its inner subgraph pinned to `worker`) into `task` on `worker`. An
    /// inner subgraph with nodes left ready (the task is full) or made ready is pinned to
    /// `worker`. True when the entry is used up (stale, or nothing of it left where it was).
    fn take_tree(
        &mut self,
        at: SgRef,
        from: Where,
        worker: WorkerId,
        task: TaskId,
        max: usize,
        f: &mut Forming,
    ) -> bool {
        // Only a live request that is not doomed is alive with the entry's generation.
        if self.alive.get(at.slot as usize) != Some(&at.generation) {
            return true;
        }
        let t = self.trees[at.slot as usize].as_mut().expect("live tree request");
        let first = t.last_task == TaskId::MAX;
        let room = max - f.out.requests.len();
        let (taken, used) = if from == Where::Unpinned && at.sg == LEAVES {
            if t.leaves_ready() == 0 {
                return true; // stale: dropped
            }
            let k = t.take_leaves(room, &mut f.out.requests, &mut f.out.nodes);
            self.types[t.leaf_type as usize].ready_unpinned -= k;
            (k, t.leaves_ready() == 0)
        } else {
            let live = match from {
                Where::Pinned(w) => t.inner == Inner::Pinned(w),
                _ => t.inner == Inner::Queued,
            };
            if !live {
                return true; // stale: unpinned, pinned again, drained or dropped since
            }
            let before = t.inner_ready();
            let k = t.take_inner(room, &mut f.out.requests, &mut f.out.nodes);
            // Left ready, or made ready by this take.
            let left = t.inner_ready();
            let q = &mut self.types[t.inner_type as usize];
            match from {
                Where::Pinned(w) => q.ready_pinned[w as usize] -= before,
                _ => q.ready_unpinned -= before,
            }
            q.ready_pinned[worker] += left;
            if left == 0 {
                // Every node is submitted (a node none of whose predecessors is left unsubmitted
                // would be ready).
                debug_assert!(t.inner_submitted());
                t.inner = Inner::Drained;
                (k, true)
            } else if from == Where::Unpinned {
                t.inner = Inner::Pinned(worker as u32);
                q.pinned_trees[worker].push(at);
                (k, true)
            } else {
                (k, false)
            }
        };
        // One run of rows per request and task: a tree's entries are never live twice at once.
        debug_assert_ne!(t.last_task, task);
        t.last_task = task;
        t.inflight += 1;
        f.trees.push((at.slot, taken as u32));
        if first {
            self.start(at.slot);
        }
        used
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
        self.schedule();
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        if let Some(&slot) = self.by_id.get(&id) {
            self.doom(slot, Code::Cancelled);
            // Like every event that may launch: requests past their deadline stop first.
            self.expire(now);
            self.schedule();
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
        for &(slot, node) in &rec.rows {
            let r = self.req_mut(slot);
            let doomed = r.doomed.is_some();
            let g = r.graph();
            g.done_nodes += 1;
            let sg = g.nodes[node as usize].sg;
            if g.sgs[sg as usize].stamp != stamp {
                // First row of this subgraph in the task: the pin counter drops once per task.
                g.sgs[sg as usize].stamp = stamp;
                g.sgs[sg as usize].outstanding -= 1;
                if g.sgs[sg as usize].outstanding == 0 {
                    self.unpin(slot, sg);
                }
            }
            let g = self.req_mut(slot).graph();
            if g.stamp != stamp {
                g.stamp = stamp;
                g.inflight -= 1;
                if g.inflight == 0 {
                    idle.push(slot);
                }
            }
            if doomed {
                continue;
            }
            // External successors: a subgraph whose last external dependency finished becomes
            // schedulable, with its nodes that have no same-subgraph predecessor.
            let g = self.req_mut(slot).graph();
            for k in g.external_successors(node) {
                let g = self.req_mut(slot).graph();
                let s = g.edges[k];
                let ssg = g.nodes[s as usize].sg;
                g.sgs[ssg as usize].external_left -= 1;
                if g.sgs[ssg as usize].external_left == 0 {
                    for i in g.subgraph_roots(ssg) {
                        let v = self.req_mut(slot).graph().edges[i];
                        self.push_ready(slot, v);
                    }
                }
            }
        }
        // Tree requests: finished leaves count towards opening the inner subgraph, and an inner
        // subgraph whose last task this was is unpinned: its pin counter is 0. Unpinned ready
        // nodes were ready before anything queued since, so they go first among their priority,
        // in row order (hence queued back to front, once the pass is over).
        let mut unpinned = std::mem::take(&mut self.unpinned_trees);
        for &(slot, rows) in &rec.trees {
            // Doomed requests are not alive.
            let doomed = self.alive[slot as usize] == 0;
            let t = self.trees[slot as usize].as_mut().expect("live tree request");
            t.inflight -= 1;
            if t.inflight == 0 {
                idle.push(slot);
            }
            if rec.ty == t.leaf_type {
                t.leaves_left -= rows;
                if t.leaves_left == 0 && !doomed {
                    // The inner subgraph's external dependencies have all finished.
                    t.open_inner();
                    self.queue_inner(slot);
                }
            } else if let Inner::Pinned(w) = t.inner
                && t.last_task == task
            {
                // Its rows here are inner nodes: `ty` is its inner type.
                t.inner = Inner::Queued;
                let ready = t.inner_ready();
                self.types[ty].ready_pinned[w as usize] -= ready;
                unpinned.push((slot, t.priority, ready));
            }
        }
        for &(slot, priority, ready) in unpinned.iter().rev() {
            self.queue_unpinned(slot, INNER, priority, ty, ready, true);
        }
        unpinned.clear();
        self.unpinned_trees = unpinned;
        // Chains whose run left with this task: the next run (its external dependency is this
        // run's last node) is ready now, or the request is finished.
        for &slot in &rec.releases {
            let r = self.req_mut(slot);
            let doomed = r.doomed.is_some();
            let c = r.chain();
            debug_assert_eq!(c.state, ChainState::Releasing);
            if doomed || c.last_run() {
                c.state = ChainState::Idle;
                idle.push(slot);
            } else {
                c.next_run();
                self.queue_chain(slot, false);
            }
        }
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
        self.schedule();
    }

    fn tick(&mut self, now: Time) {
        self.expire(now);
        self.schedule();
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
