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
//! Contract shared by every policy:
//! * every request passed to `arrive` leaves through exactly one [`Decision::Complete`];
//! * a task runs on one worker, which has at most the policy's lookahead of unfinished tasks; a
//!   fixed-shape request is in one task, a recurrent request's cells may be in several tasks at
//!   once: the cells of one subgraph on one worker, later after earlier in stream order, and
//!   independent cells (a tree's leaves, say) on any worker;
//! * a request whose deadline is `<= now` at a boundary completes `DeadlineExceeded`; a cancelled
//!   one completes `Cancelled` at the next boundary (at once if it is still queued);
//! * `task_done` is called exactly once for every launched task, and a worker's tasks finish in
//!   the order they were launched (a worker is one stream).

pub mod baseline;
pub mod cellular;
pub mod graph;

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

/// Hashes integer ids with one multiplication by an odd constant. The ids are counters the
/// runtime assigns (never chosen by a caller), and for consecutive ids the product's low bits,
/// which pick the bucket, are all distinct: no collisions among the ids in flight. SipHash cost
/// as much as the rest of an arrival on the scheduling path.
#[derive(Default, Clone, Copy)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 = (self.0 ^ v).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}
/// Identifies a batched task; unique per policy instance.
pub type TaskId = u64;
/// Index of a worker (one stream of the backend) of a model.
pub type WorkerId = usize;

/// What a policy learns about a request when it arrives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Arrival {
    pub id: RequestId,
    /// The request must complete by then, or complete `DeadlineExceeded`.
    pub deadline: Option<Time>,
    /// Larger is served first; requests of equal priority are served in arrival order.
    pub priority: i32,
    /// The request unfolded into cells (recurrent models); `None` for a fixed-shape request,
    /// which is one row of one task.
    pub cells: Option<Arc<CellGraph>>,
}

impl Arrival {
    /// A fixed-shape request with no deadline and priority 0.
    pub fn fixed(id: RequestId) -> Arrival {
        Arrival { id, deadline: None, priority: 0, cells: None }
    }
}

/// A batched task to start on a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Launch {
    pub task: TaskId,
    pub worker: WorkerId,
    /// The cell type every row runs (0 for fixed-shape models).
    pub cell: CellType,
    /// The request of each real row, in batch-row order. A request appears once per node it has
    /// in the task (several nodes of one tree may share a task).
    pub requests: Vec<RequestId>,
    /// The node of each row within its request's cell graph, parallel to `requests`; empty for
    /// fixed-shape requests.
    pub nodes: Vec<u32>,
    /// Rows the task computes: `requests.len()`, or more when the policy pads the batch (padding
    /// rows come last and belong to no request).
    pub batch: usize,
}

#[cfg(test)]
impl Launch {
    /// A cell task from its (request, node) rows (for the policies' tests).
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
            cell,
            requests: rows.iter().map(|r| r.0).collect(),
            nodes: rows.iter().map(|r| r.1).collect(),
            batch,
        }
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
}

/// The interface every sans-IO policy offers its drivers (runtime engine, simulator).
pub trait Policy: Send {
    /// A request was admitted at `now`.
    fn arrive(&mut self, now: Time, req: Arrival);
    /// The caller asked to cancel `id` (unknown or finished ids are ignored).
    fn cancel(&mut self, now: Time, id: RequestId);
    /// A task launched earlier has finished on its worker.
    fn task_done(&mut self, now: Time, task: TaskId);
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
    /// The next decision, if any. Drain until `None` after every event.
    fn poll(&mut self) -> Option<Decision>;
    /// When the policy next needs a `tick` if no other event arrives first.
    fn next_wakeup(&self) -> Option<Time>;
    /// The row vectors of a launched task (`Launch::requests`, `Launch::nodes`), handed back
    /// once the driver is done with them, for the policy to reuse in a later task (optional;
    /// the default drops them).
    fn recycle(&mut self, requests: Vec<RequestId>, nodes: Vec<u32>) {
        drop((requests, nodes));
    }
    /// Requests admitted and not started: no cell of theirs launched yet.
    fn queued(&self) -> usize;
    /// Requests started and not complete (a recurrent request counts as running from its first
    /// cell to its completion, also between its tasks).
    fn running(&self) -> usize;
}
