//! Sans-IO scheduling policies.
//!
//! A policy is a state machine in the style of `quinn-proto`: it never sleeps, spawns threads,
//! touches memory on a device or reads a clock. It is fed events with explicit timestamps
//! ([`Policy::arrive`], [`Policy::task_done`], [`Policy::cancel`], [`Policy::tick`]) and answers
//! with [`Decision`]s drained through [`Policy::poll`]. [`Policy::next_wakeup`] says when the policy
//! wants a `tick` if nothing else happens first. The same policy object is driven by the real
//! runtime (wall clock, real backend) and by the simulator (virtual clock, cost model), so tests of
//! scheduling logic run on virtual time and are exact.
//!
//! Contract shared by every policy (checked for every policy, on random runs, by the one
//! contract checker in `contract.rs`; a new policy is added to its list):
//! * every request passed to `arrive` leaves through exactly one [`Decision::Complete`] or
//!   [`Decision::Reject`] (a reject only before any of it ran), and never while a task holding
//!   it is unfinished (its state slots are then reused);
//! * a task runs on one of the policy's [`workers`](Policy::workers), within that worker's
//!   `max_batch`, and the worker has at most [`lookahead`](Policy::lookahead) unfinished tasks;
//!   every row of a task belongs to the task's model;
//! * a fixed-shape request is in one task (or one task per layer block, in order); a recurrent
//!   request's cells may be in several tasks at once: the cells of one subgraph on one worker,
//!   later after earlier in stream order, and independent cells (a tree's leaves, say) on any
//!   worker; no node runs twice, and none before its predecessors have run or been launched
//!   earlier on the same worker;
//! * a request whose deadline is `<= now` at a boundary completes `DeadlineExceeded`, and none
//!   still waits in a queue past its deadline once `tick` is called at `next_wakeup`; a cancelled
//!   one completes `Cancelled` at the next boundary (at once if it is still queued) and is in no
//!   task launched after the cancel;
//! * `queued()` and `running()` count exactly the requests not started and started;
//! * `task_done` is called exactly once for every launched task, and a worker's tasks finish in
//!   the order they were launched (a worker is one stream).
//!
//! The bookkeeping every policy needs to keep that contract (its decision outbox, deadline heap,
//! queued/running counts, task ids, the model it serves) is written once, in [`book`].

pub mod adaptive;
pub mod baseline;
pub(crate) mod book;
pub mod cellular;
#[cfg(test)]
mod contract;
pub mod elastic;
pub mod graph;
pub mod instances;
pub mod tenant;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::ops::{Add, Sub};
use std::sync::Arc;
use std::time::Duration;

use crate::error::Code;
pub use graph::{CellGraph, CellType};

/// A point in (real or virtual) time: nanoseconds since the driver's epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Time(pub u64);

impl Time {
    pub const ZERO: Time = Time(0);
    pub const fn from_nanos(ns: u64) -> Time {
        Time(ns)
    }
    pub const fn from_micros(us: u64) -> Time {
        Time(us * 1_000)
    }
    pub const fn from_millis(ms: u64) -> Time {
        Time(ms * 1_000_000)
    }
    pub const fn as_nanos(self) -> u64 {
        self.0
    }
    pub fn as_secs_f64(self) -> f64 {
        self.0 as f64 * 1e-9
    }
    /// Time elapsed since `earlier`, zero if `earlier` is later.
    pub fn since(self, earlier: Time) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }
}

impl Add<Duration> for Time {
    type Output = Time;
    fn add(self, d: Duration) -> Time {
        Time(self.0.saturating_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)))
    }
}

impl Sub<Time> for Time {
    type Output = Duration;
    fn sub(self, rhs: Time) -> Duration {
        self.since(rhs)
    }
}

/// Identifies a request within one runtime (or one simulation).
pub type RequestId = u64;

/// A map keyed by request or task ids, hashed with one multiplication (see [`IdHasher`]).
pub(crate) type IdMap<V> = HashMap<RequestId, V, BuildHasherDefault<IdHasher>>;

/// A request table ([`IdMap`]) that remembers the bound it is reserved for: every table kept
/// per request (the core's and each policy's) is one, so the reservation rule lives here alone.
///
/// A hash table under churn (inserts and removals forever, as request tables see) grows by
/// hashbrown's rule: when its removed entries use up the free room, it rehashes in place if the
/// live entries are at most half its capacity, and doubles otherwise. So a table whose live count
/// stays under a bound still doubles, late and unpredictably, whenever that count happens to be
/// above half its capacity at such a moment — under an overload an hour into a run. Reserved at
/// twice the bound (plus one for the insert in hand), it only ever rehashes in place: the
/// memory it holds is fixed when the bound is known (a model added with its admission bound)
/// instead of depending on the load's history.
///
/// [`reserve_for`](IdTable::reserve_for) reserves only when the bound grows past every bound
/// before: a table's `capacity` counts only the room its tombstones leave, so after churn a
/// table reserved for the bound looks short of it, and reserving again would double it.
#[derive(Debug)]
pub(crate) struct IdTable<V> {
    map: IdMap<V>,
    reserved_for: usize,
}

impl<V> Default for IdTable<V> {
    fn default() -> Self {
        IdTable { map: IdMap::default(), reserved_for: 0 }
    }
}

impl<V> IdTable<V> {
    /// Up to `held` entries may be in the table at once: reserve for them, unless it already is
    /// for as many (see the type's documentation).
    pub(crate) fn reserve_for(&mut self, held: usize) {
        if held <= self.reserved_for {
            return;
        }
        self.reserved_for = held;
        let want = held.saturating_mul(2).saturating_add(2);
        if self.map.capacity() < want {
            self.map.reserve(want - self.map.len());
        }
    }
}

impl<V> std::ops::Deref for IdTable<V> {
    type Target = IdMap<V>;
    fn deref(&self) -> &IdMap<V> {
        &self.map
    }
}

impl<V> std::ops::DerefMut for IdTable<V> {
    fn deref_mut(&mut self) -> &mut IdMap<V> {
        &mut self.map
    }
}

/// Hashes integer ids for hashbrown's tables: the low bits, which pick the bucket, are the id's
/// own; the top 7, hashbrown's tag, come from one multiplication by an odd constant. The ids are
/// counters the runtime assigns (never chosen by a caller), and those in flight are a window of
/// nearly consecutive ones: they sit in consecutive buckets, so there are no collisions among
/// them, and the entries in use stay together however large the table (a table reserved for
/// the admission bound while a few hundred requests are in flight: a hash spreading them over
/// all its buckets measured a quarter slower round trips, every lookup a cache miss). The tags
/// still differ, so a probe compares few keys. SipHash cost as much as the rest of an arrival on
/// the scheduling path.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

/// hashbrown's tag: the top 7 bits of the hash as a `usize` (bits 57–63; 25–31 on a 32-bit
/// target, where the hash is truncated).
const TAG_BITS: u64 = 0x7F << (if usize::BITS < 64 { usize::BITS } else { 64 } - 7);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    /// Other integer widths arrive here as their bytes: gathered into one `u64` per 8 bytes,
    /// so the bucket bits still come from the whole value.
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut b = [0u8; 8];
            b[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        let x = self.0 ^ v;
        self.0 = (x.wrapping_mul(0x9E37_79B9_7F4A_7C15) & TAG_BITS) | (x & !TAG_BITS);
    }
}
/// Identifies a batched task; unique per policy instance.
pub type TaskId = u64;
/// Index of a worker (one stream of the backend) of a policy.
pub type WorkerId = usize;
/// Identifies a model within one engine (the runtime, or one simulation).
pub type ModelId = usize;

/// What a policy learns about a request when it arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    pub id: RequestId,
    /// The model the request is for (a policy may serve a group of models).
    pub model: ModelId,
    /// The request must complete by then, or complete `DeadlineExceeded`.
    pub deadline: Option<Time>,
    /// Larger is served first; requests of equal priority are served in arrival order.
    pub priority: i32,
    /// The request unfolded into cells (recurrent models); `None` for a fixed-shape request,
    /// which is one row of one task (or of one task per layer block).
    pub cells: Option<Arc<CellGraph>>,
}

impl Arrival {
    /// A fixed-shape request for model 0 with no deadline and priority 0.
    pub fn fixed(id: RequestId) -> Arrival {
        Arrival { id, model: 0, deadline: None, priority: 0, cells: None }
    }
}

/// A worker as its policy declares it ([`Policy::workers`]): workers of one policy may differ
/// (E²bird's multi-granularity engine runs workers of batch sizes 1, 2, 4, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerShape {
    /// The most rows (padding included) of a task on this worker.
    pub max_batch: usize,
    /// CPU cores the worker's tasks run with (0: the backend's own choice).
    pub cores: usize,
}

impl WorkerShape {
    /// `n` identical workers of `max_batch` rows on the backend's cores.
    pub fn uniform(n: usize, max_batch: usize) -> Vec<WorkerShape> {
        vec![WorkerShape { max_batch, cores: 0 }; n]
    }
}

/// What a task computes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TaskShape {
    /// The whole fixed-shape model, one row per request.
    Dense,
    /// Batched steps of a recurrent model: every row runs cell type `cell`, row `i` being node
    /// `nodes[i]` of its request's cell graph. With `steps > 1` (a padded batch of paths run the
    /// way frameworks run it: all its steps in one call) row `i` then runs the nodes after it on
    /// its path's run of `cell`, `steps` in all or as many as the run has (a row whose run ends
    /// sooner is padding for the remaining steps); only for paths (`CellGraph::runs`).
    Cells { cell: CellType, nodes: Vec<u32>, steps: u32 },
    /// Layers `first..=last` of a layered model, one row per request (a request runs its layer
    /// blocks in order, each a task).
    Layers { first: u32, last: u32 },
}

impl TaskShape {
    /// The cell type of a cell task (0 for every other shape).
    pub fn cell(&self) -> CellType {
        match self {
            TaskShape::Cells { cell, .. } => *cell,
            _ => 0,
        }
    }

    /// The node of each row of a cell task (empty for every other shape).
    pub fn nodes(&self) -> &[u32] {
        match self {
            TaskShape::Cells { nodes, .. } => nodes,
            _ => &[],
        }
    }

    /// The steps of a cell task (1 for every other shape).
    pub fn steps(&self) -> u32 {
        match self {
            TaskShape::Cells { steps, .. } => *steps,
            _ => 1,
        }
    }
}

/// How a task runs beyond its shape: the cores it uses and the version of its kernels (VELTAIR's
/// multi-version layers). The default is the worker's cores and the backend's kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exec {
    /// CPU cores (0: the worker's [`WorkerShape::cores`]).
    pub cores: usize,
    /// Kernel version (0: the default). A layered task of a tenant scheduler
    /// ([`tenant`]) names the interference level whose per-layer versions it runs
    /// ([`tenant::TenantModel::version`]).
    pub version: u32,
    /// The task got fewer cores than it asked for (a VELTAIR core conflict): it starts on the
    /// cores that were free, and its runner starts their threads then; drivers charge the
    /// thread-start cost.
    pub conflict: bool,
}

/// A batched task to start on a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub task: TaskId,
    pub worker: WorkerId,
    /// The model every row belongs to.
    pub model: ModelId,
    pub shape: TaskShape,
    pub exec: Exec,
    /// The request of each real row, in batch-row order. A request appears once per node it has
    /// in a cell task (several nodes of one tree may share a task).
    pub requests: Vec<RequestId>,
    /// Rows the task computes: `requests.len()`, or more when the policy pads the batch (padding
    /// rows come last and belong to no request).
    pub batch: usize,
}

impl Launch {
    /// The cell type every row runs (0 for tasks that are not cell tasks).
    pub fn cell(&self) -> CellType {
        self.shape.cell()
    }

    /// The node of each row of a cell task, parallel to `requests` (empty otherwise).
    pub fn nodes(&self) -> &[u32] {
        self.shape.nodes()
    }
}

#[cfg(test)]
impl Launch {
    /// A cell task of model 0 from its (request, node) rows (for the policies' tests).
    pub(crate) fn of_rows(
        task: TaskId,
        worker: WorkerId,
        cell: CellType,
        rows: &[(RequestId, u32)],
        batch: usize,
    ) -> Launch {
        Launch {
            task,
            worker,
            model: 0,
            shape: TaskShape::Cells { cell, nodes: rows.iter().map(|r| r.1).collect(), steps: 1 },
            exec: Exec::default(),
            requests: rows.iter().map(|r| r.0).collect(),
            batch,
        }
    }

    /// A dense task of model 0 (for the policies' tests).
    pub(crate) fn dense(task: TaskId, worker: WorkerId, requests: &[RequestId], batch: usize) -> Launch {
        Launch {
            task,
            worker,
            model: 0,
            shape: TaskShape::Dense,
            exec: Exec::default(),
            requests: requests.to_vec(),
            batch,
        }
    }
}

/// What the driver measured of a finished task, given to [`Policy::task_done`]. Stages the
/// backend cannot measure, or that the task did not have (no transfer on the CPU backend), are
/// `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TaskReport {
    pub task: TaskId,
    /// Moving the task's input to the device.
    pub upload: Option<Duration>,
    /// Running the task's kernels, from their start on the worker (after its earlier tasks).
    pub compute: Option<Duration>,
    /// Moving the task's output back to the host.
    pub download: Option<Duration>,
}

impl TaskReport {
    /// A report of `task` with no measured stage.
    pub fn of(task: TaskId) -> TaskReport {
        TaskReport { task, ..TaskReport::default() }
    }
}

/// Every decision `p` has pending (for the policies' tests).
#[cfg(test)]
pub(crate) fn drain(p: &mut dyn Policy) -> Vec<Decision> {
    std::iter::from_fn(|| p.poll()).collect()
}

/// What a policy asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Start this task on its worker, then report `task_done` once it has finished.
    Launch(Launch),
    /// The request is finished: `Code::Ok` when its output (computed by its last task) is to be
    /// delivered, or the error it completes with.
    Complete { id: RequestId, code: Code },
    /// The policy refuses a request it has not started (its pool is full: `Busy`; it cannot be
    /// served within its bound: `ResourceExhausted`). It completes with `code` at once; the
    /// driver counts it as refused, not failed.
    Reject { id: RequestId, code: Code, reason: &'static str },
}

/// The interface every sans-IO policy offers its drivers (runtime engine, simulator).
pub trait Policy: Send {
    /// The workers this policy launches on, by [`WorkerId`] (asked once, when it is installed).
    fn workers(&self) -> Vec<WorkerShape>;
    /// Tasks a worker may have launched and unfinished at once (BatchMaker's
    /// `MaxTasksToSubmit`; 1 for a policy that waits for each task).
    fn lookahead(&self) -> usize;
    /// Make room for `requests` more requests held at once: a model joined the policy's group
    /// with that admission bound (the drivers never hold more of its requests). Called once per
    /// model as it joins; the tables are not shrunk when one leaves (the threaded engine gives
    /// each model a group of its own, released with it). A policy
    /// reserves whatever it keeps per request (tables keyed by request: see [`IdTable`]), so
    /// that serving within the bounds never allocates a larger table later and the memory it
    /// holds does not depend on the load's history. 0: no bound known (the simulator's open
    /// loop); the tables grow as needed.
    fn reserve(&mut self, requests: usize);
    /// A request was admitted at `now`.
    fn arrive(&mut self, now: Time, req: Arrival);
    /// The request's input has landed in device memory (drivers that copy inputs at arrival
    /// report it at once). Policies that launch only requests whose input is ready (E²bird's
    /// ring) wait for it; the others ignore it (the default).
    fn input_ready(&mut self, now: Time, id: RequestId) {
        let _ = (now, id);
    }
    /// Slots of the policy's input ring (E²bird's memory pool; 0: it keeps none, the default).
    /// The driver allocates the ring's memory once, `slots × input values`.
    fn input_ring_slots(&self) -> usize {
        0
    }
    /// The slot of the policy's input ring that `id`'s input is to be copied into, for a policy
    /// that keeps one (E²bird's ring: the driver copies the input there at arrival, and a batch
    /// of consecutive slots is read in place); `None` otherwise (the default), or when `id` holds
    /// no slot (refused, or not waiting in the ring).
    fn input_slot(&self, id: RequestId) -> Option<usize> {
        let _ = id;
        None
    }
    /// The caller asked to cancel `id` (unknown or finished ids are ignored).
    fn cancel(&mut self, now: Time, id: RequestId);
    /// A task launched earlier has finished on its worker, with what the driver measured of it.
    fn task_done(&mut self, now: Time, report: &TaskReport);
    /// The request's output ended before its last cell (a Seq2Seq decoder emitted `eos`): its
    /// cells not yet launched are dropped, and it completes `Ok` once no task of it is running.
    /// Given before the `task_done` of the task that produced the end. Fixed-shape policies
    /// never see it (their requests end with their only task).
    fn end_early(&mut self, now: Time, id: RequestId);
    /// Time has advanced to `now` (timers, deadlines).
    fn tick(&mut self, now: Time);
    /// The caller expects no more requests soon (its input ended): requests queued at `now` need
    /// not wait for a fuller batch. Policies that never hold a request back for batching ignore
    /// it (the default).
    fn flush(&mut self, now: Time) {
        let _ = now;
    }
    /// The next decision, if any. Drain until `None` after every event, or after a run of
    /// events (a driver that handles everything waiting before it decides). A policy may form
    /// its decisions here rather than in the event handlers: then the events of one run are
    /// decided on together (the cellular policy does, so the rows they make ready share tasks).
    fn poll(&mut self) -> Option<Decision>;
    /// When the policy next needs a `tick` if no other event arrives first.
    fn next_wakeup(&self) -> Option<Time>;
    /// The row vectors of a launched task (`Launch::requests`, its shape's nodes), handed back
    /// once the driver is done with them, for the policy to reuse in a later task (optional;
    /// the default drops them).
    fn recycle(&mut self, requests: Vec<RequestId>, shape: TaskShape) {
        drop((requests, shape));
    }
    /// Requests admitted and not started: no cell of theirs launched yet.
    fn queued(&self) -> usize;
    /// Requests started and not complete (a recurrent request counts as running from its first
    /// cell to its completion, also between its tasks).
    fn running(&self) -> usize;
}

#[cfg(test)]
mod reserve_tests {
    use super::*;

    /// Churn as a request table sees it: ids ever increasing, requests ending in any order (a
    /// short request overtakes a long one), the live count kept between `low` and `held`.
    /// Returns every capacity the map had; stops early after a round that leaves a capacity
    /// `stop` accepts.
    fn churn(
        map: &mut IdMap<[u64; 4]>,
        held: usize,
        low: usize,
        rounds: usize,
        stop: impl Fn(usize) -> bool,
    ) -> Vec<usize> {
        let mut caps = vec![map.capacity()];
        let (mut next, mut live, mut rng) = (0u64, Vec::new(), 0x9E37_79B9_7F4A_7C15u64);
        for r in 0..rounds {
            // Up to `held` (the first round: a fill to the bound), then down to `low`; later
            // rounds peak anywhere in between.
            let peak = if r == 0 { held } else { low + (r * 7919) % (held - low + 1) };
            while live.len() < peak {
                map.insert(next, [next; 4]);
                live.push(next);
                next += 1;
            }
            while live.len() > low {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                let id = live.swap_remove((rng % live.len() as u64) as usize);
                map.remove(&id);
            }
            caps.push(map.capacity());
            if stop(map.capacity()) {
                break;
            }
        }
        caps
    }

    #[test]
    fn a_reserved_table_never_grows_under_churn_within_its_bound() {
        // (Smaller under Miri, which interprets ~1000× slower.)
        let (held, rounds) = if cfg!(miri) { (100, 200) } else { (1000, 2000) };
        let mut reserved = IdTable::default();
        reserved.reserve_for(held);
        let before = reserved.capacity();
        assert!(before >= 2 * held + 2, "{before}");
        // (`capacity` is what fits before the table must grow: it dips as removed entries
        // leave tombstones, until a rehash in place clears them; a table that grew would hold
        // more than it did when reserved.)
        let caps = churn(&mut reserved, held, held * 9 / 10, rounds, |_| false);
        assert!(caps.iter().all(|&c| c <= before), "a reserved table grew: {caps:?}");

        // A bound it already holds reserves nothing more: churned until its room is short of
        // the bound (tombstones), a table reserved again for that bound would double.
        let want = 2 * held + 2;
        let mut short = IdTable::default();
        short.reserve_for(held);
        churn(&mut short, held, held * 9 / 10, rounds, |c| c < want);
        let room = short.capacity();
        assert!(room < want, "the churn never left the table's room short of the bound: {room}");
        short.reserve_for(held);
        assert_eq!(short.capacity(), room, "reserved again for a bound it held");
        short.reserve_for(held + 1);
        assert!(short.capacity() >= want + 2, "a larger bound is reserved: {}", short.capacity());

        // Without it, the same churn doubles the table after the first fill to the bound has
        // sized it for every live entry: the growth a soak saw long after its baseline.
        let mut grown = IdMap::default();
        let caps = churn(&mut grown, held, held * 9 / 10, rounds, |_| false);
        let (first, most) = (caps[1], caps.iter().copied().max().unwrap());
        assert!(first >= held && most >= 2 * first, "{caps:?}");
    }
}
