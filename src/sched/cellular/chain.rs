//! Chain requests (`lstm`, `seq2seq`, fixed-shape): requests whose cell graph is one path, cut
//! into runs of one cell type ([`Run`]). Each run is one subgraph, with one ready node at a time
//! (the node after the last one submitted), so a chain needs no per-node state: a cursor does.
//!
//! While a run is pinned to a worker it lives as a [`Lane`] in that worker's [`Block`] of its
//! cell type — a dense array the scheduler walks once per task, writing one row per lane. The
//! block rests on two facts of Algorithm 1 (see `super`):
//!
//! * FormBatchedTask takes every pinned node before anything else, and the pinned lanes always
//!   fit (they are the continuing lanes of the last task of that type on that worker, which held
//!   at most MaxBatch rows). So every lane of a block is in *every* task of its (worker, type)
//!   since it was pinned, and each lane's pin counter equals its block's count of unfinished
//!   tasks of that (worker, type).
//! * Hence all lanes of a block are unpinned at once — when the worker's last unfinished task of
//!   that type finishes (the block *lapses*) — and a lapsed block is just a run of unpinned
//!   subgraphs in a known order, which FormBatchedTask may take whole.
//!
//! So a task costs one pass over its rows plus work per request that joins or leaves, and
//! unpinning costs nothing per subgraph.

use std::sync::Arc;

use crate::sched::graph::Run;
use crate::sched::{CellGraph, CellType, RequestId, TaskId};

/// Where a chain request is between events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum ChainState {
    /// Its current run is ready and unpinned: an entry in its cell type's unpinned queue.
    Queued,
    /// Its current run is a lane in this worker's block of the run's type.
    Resident(u32),
    /// Its current run has left its block (its last node was submitted, or the request was
    /// doomed while pinned): it waits for the task holding its last submitted node.
    Releasing,
    /// Nothing ready or running: every run is done, or it was doomed while nothing ran.
    Idle,
}

/// A chain request's progress. The current run's bounds are copied out of the graph, so that
/// scheduling touches the graph only when a run ends.
pub(super) struct Chain {
    pub graph: Arc<CellGraph>,
    /// The current run (index into `graph.runs()`), its cell type and one past its last node.
    pub run: u32,
    pub ty: CellType,
    pub end: u32,
    /// One past the last node of the last run.
    pub len: u32,
    /// The next node to submit while [`ChainState::Queued`] (a resident lane keeps its own).
    pub cursor: u32,
    pub state: ChainState,
}

impl Chain {
    pub fn new(graph: Arc<CellGraph>) -> Chain {
        let first = graph.first_run().expect("a chain request has runs");
        let len = graph.len() as u32;
        Chain {
            graph,
            run: 0,
            ty: first.ty,
            end: first.end,
            len,
            cursor: first.start,
            state: ChainState::Queued,
        }
    }

    /// Whether the current run is the last.
    pub fn last_run(&self) -> bool {
        self.end == self.len
    }

    /// Move on to the next run.
    pub fn next_run(&mut self) {
        self.run += 1;
        let Run { ty, start, end } = self.graph.runs().expect("a chain request has runs")[self.run as usize];
        (self.ty, self.cursor, self.end) = (ty, start, end);
    }
}

/// A pinned run: everything a task needs to emit its row, with no access to the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Lane {
    pub id: RequestId,
    pub slot: u32,
    /// The request's generation: the lane is dead once `alive[slot]` differs (the request was
    /// doomed, or completed and the slot reused).
    pub generation: u32,
    /// The node the next task runs.
    pub next: u32,
    /// One past the run's last node.
    pub end: u32,
}

/// The chains of one cell type pinned to one worker (`live`), or unpinned together when its last
/// unfinished task of that type finished (lapsed).
#[derive(Default)]
pub(super) struct Block {
    /// In block order: a joining lane is appended, and in a whole-block pass a lane that leaves
    /// is replaced by the last one. May hold dead lanes, dropped at the next pass.
    pub lanes: Vec<Lane>,
    /// Dead lanes in `lanes`: while there are none, a pass need not check each lane.
    pub dead: usize,
    /// Pinned: the worker has an unfinished task of this type, `last_task` the latest, and every
    /// lane is in it.
    pub live: bool,
    pub last_task: TaskId,
    /// The request priority of every lane that joined since the block was last empty, or
    /// `None` if they differ (a lapsed block of mixed priorities is dispersed into the priority
    /// queues, since its lanes no longer go together). Conservative: lanes that left count too,
    /// so `None` may only cost a dispersal.
    pub priority: Option<i32>,
}

impl Block {
    /// Live lanes (each has one ready node).
    pub fn size(&self) -> usize {
        self.lanes.len() - self.dead
    }

    /// Record the priority of lanes about to join (`None`: mixed), before they are pushed.
    pub fn note_source(&mut self, priority: Option<i32>) {
        if self.lanes.is_empty() {
            self.priority = priority;
        } else if self.priority != priority {
            self.priority = None;
        }
    }
}

/// What a task being formed has taken so far: its rows (request and node of each, the `Launch`
/// vectors) and the slots of the chains whose run leaves with it.
#[derive(Default)]
pub(super) struct Taken {
    pub requests: Vec<RequestId>,
    pub nodes: Vec<u32>,
    pub released: Vec<u32>,
}

/// One pass of FormBatchedTask over a block's `lanes` (holding `dead` dead lanes), in order:
/// each live lane adds its next node as a row to `out` until `room` rows are taken; a lane whose
/// run ends with that node is released; dead lanes are dropped (and `dead` counts those left).
/// In place: afterwards `lanes` holds the advanced lanes that continue, then the lanes not
/// reached for want of room; returns how many continue.
pub(super) fn advance(
    lanes: &mut Vec<Lane>,
    dead: &mut usize,
    alive: &[u32],
    room: usize,
    out: &mut Taken,
) -> usize {
    let Taken { requests, nodes, released } = out;
    if *dead == 0 && lanes.len() <= room {
        // The common case, a whole block with no dead lane: every lane emits its row; those
        // whose run ends leave, their places taken by lanes from the end (the block's order is
        // not kept: it only orders a task's rows).
        debug_assert!(lanes.iter().all(|l| alive[l.slot as usize] == l.generation));
        // One fused pass writing into zeroed space (no capacity check per row).
        let (r0, n0, first) = (requests.len(), nodes.len(), released.len());
        requests.resize(r0 + lanes.len(), 0);
        nodes.resize(n0 + lanes.len(), 0);
        let rows = requests[r0..].iter_mut().zip(&mut nodes[n0..]);
        for (i, (lane, (request, node))) in lanes.iter_mut().zip(rows).enumerate() {
            *request = lane.id;
            *node = lane.next;
            lane.next += 1;
            if lane.next == lane.end {
                released.push(i as u32);
            }
        }
        // Back to front, so no lane moved into a place is one that leaves; `released` stays in
        // row order.
        for k in (first..released.len()).rev() {
            released[k] = lanes.swap_remove(released[k] as usize).slot;
        }
        return lanes.len();
    }
    let (mut kept, mut taken) = (0, 0);
    let mut reached = lanes.len();
    for i in 0..lanes.len() {
        let lane = lanes[i];
        if alive[lane.slot as usize] != lane.generation {
            *dead -= 1;
            continue;
        }
        if taken == room {
            reached = i;
            break;
        }
        taken += 1;
        requests.push(lane.id);
        nodes.push(lane.next);
        if lane.next + 1 == lane.end {
            released.push(lane.slot);
        } else {
            lanes[kept] = Lane { next: lane.next + 1, ..lane };
            kept += 1;
        }
    }
    lanes.drain(kept..reached);
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lane(id: RequestId, slot: u32, next: u32, end: u32) -> Lane {
        Lane { id, slot, generation: 1, next, end }
    }

    #[test]
    fn a_pass_emits_one_row_per_live_lane_and_releases_ended_runs() {
        let all = vec![lane(10, 0, 3, 5), lane(11, 1, 7, 8), lane(12, 2, 0, 2), lane(13, 3, 1, 9)];
        for (alive, dead) in [([1, 1, 1, 1], 0), ([1, 1, 0, 1], 1)] {
            // With and without a dead lane (slot 2 doomed): the two paths of `advance`.
            let (mut lanes, mut left) = (all.clone(), dead);
            let mut out = Taken::default();
            let kept = advance(&mut lanes, &mut left, &alive, 8, &mut out);
            let Taken { requests: req, nodes, released: rel } = out;
            // Without dead lanes the pass fills a leaver's place with the last lane.
            let mut want = (vec![10, 11, 12, 13], vec![3, 7, 0, 1], vec![1], vec![4, 2, 1]);
            if dead == 1 {
                want = (vec![10, 11, 13], vec![3, 7, 1], vec![1], vec![4, 2]);
            }
            assert_eq!((req, nodes, rel, left), (want.0, want.1, want.2, 0));
            assert_eq!(kept, lanes.len());
            assert_eq!(lanes.iter().map(|l| l.next).collect::<Vec<_>>(), want.3);
        }
    }

    #[test]
    fn a_pass_stops_at_the_room_left_and_keeps_the_rest_in_order() {
        let all = vec![lane(10, 0, 3, 5), lane(11, 1, 0, 1), lane(12, 2, 0, 2), lane(14, 4, 0, 2)];
        let alive = [1, 1, 1, 0, 1];
        let mut out = Taken::default();
        let (mut lanes, mut dead) = (all.clone(), 0);
        assert_eq!(advance(&mut lanes, &mut dead, &alive, 2, &mut out), 1);
        assert_eq!((&out.requests[..], &out.released[..]), (&[10, 11][..], &[1][..]));
        assert_eq!(lanes, vec![lane(10, 0, 4, 5), all[2], all[3]], "continuing, then not reached");
        let mut lanes = all.clone();
        assert_eq!(advance(&mut lanes, &mut dead, &alive, 0, &mut out), 0);
        assert_eq!((lanes, out.requests.len()), (all, 2));
    }

    #[test]
    fn block_priority_is_shared_or_none() {
        let mut b = Block::default();
        b.note_source(Some(3));
        b.lanes.push(lane(1, 0, 0, 2));
        b.note_source(Some(3));
        assert_eq!(b.priority, Some(3));
        b.note_source(Some(1));
        assert_eq!(b.priority, None);
        b.note_source(Some(1));
        assert_eq!(b.priority, None, "mixed stays mixed");
        b.lanes.clear();
        b.note_source(Some(1));
        assert_eq!(b.priority, Some(1));
    }
}
