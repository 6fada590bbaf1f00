//! Tree requests (`treelstm`, and any graph with a
//! [`TreeShape`](crate::sched::graph::TreeShape)): leaves that are subgraphs of their own, ready
//! on arrival, under one inner subgraph. Per-node state is not needed for either part in the
//! common case:
//!
//! * A leaf subgraph is one node: once that node is submitted the subgraph has nothing ready, so
//!   pinning it changes nothing. The leaves that became ready on arrival sit next to each other
//!   in their queue, in node order, so one queue entry stands for all of them — a cursor into
//!   the shape's leaf list — and a task takes a run of them at once.
//! * The inner subgraph's ready nodes (Algorithm 1: those whose same-subgraph predecessors have
//!   all been submitted) are exactly the next level of the shape while every task takes all of
//!   them: a cursor into the shape's level order. Only when a task takes part of them (it filled
//!   up) does the subgraph switch to per-node counters ([`General`]), for the rest of its life.
//!
//! A request's rows in a task are one run, and what the task's completion does for them (leaves
//! finished, the inner subgraph's pin dropped) is per run, not per row.

use std::sync::Arc;

use crate::sched::graph::SubgraphPlan;
use crate::sched::{CellGraph, CellType, RequestId, TaskId};

/// The queue entry (`SgRef::sg`) of a tree request's leaves …
pub(super) const LEAVES: u32 = u32::MAX;
/// … and of its inner subgraph (in an unpinned queue or a pinned tree list). Both lie above any
/// subgraph or run index (a cell graph has fewer than `u32::MAX - 1` nodes), so an entry says by
/// itself that it is a tree request's, without a look at the request.
pub(super) const INNER: u32 = u32::MAX - 1;

/// Whether queue entry `sg` is a tree request's.
pub(super) fn is_tree_entry(sg: u32) -> bool {
    sg >= INNER
}

/// Where a tree request's inner subgraph is between events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Inner {
    /// Some leaf has not finished: not schedulable yet.
    Waiting,
    /// Ready nodes, unpinned: an entry in its cell type's unpinned queue.
    Queued,
    /// Pinned to this worker, with ready nodes: an entry in that worker's pinned tree list. That
    /// list holds no other live entry of the request: re-pinning to a worker happens only in a
    /// task with room for unpinned subgraphs, after a pass over the worker's whole list has
    /// dropped its stale entries (those of requests no longer pinned there).
    Pinned(u32),
    /// Every node submitted, or the request doomed: nothing more to schedule.
    Drained,
}

/// Per-node readiness of an inner subgraph after a task took part of a level.
pub(super) struct General {
    /// The inner nodes in the order they became ready; `queue[head..tail]` are ready.
    queue: Vec<u32>,
    /// Per node: inner predecessors not yet submitted.
    left: Vec<u32>,
}

/// A tree request's progress.
pub(super) struct Tree {
    pub id: RequestId,
    /// The request's priority (a copy of its record's, which scheduling a tree need not read).
    pub priority: i32,
    pub graph: Arc<CellGraph>,
    /// The shape's lists, copied on arrival so that scheduling reads only this record and this
    /// buffer (the graph is read again only to go node by node): the leaves, then the inner
    /// nodes by level (`order`), then each level's end in `order`.
    lists: Vec<u32>,
    leaves: u32,
    inner_nodes: u32,
    pub leaf_type: CellType,
    pub inner_type: CellType,
    /// The next leaf to submit (index into the shape's `leaves`).
    pub leaf_next: u32,
    /// Leaves not finished yet.
    pub leaves_left: u32,
    pub inner: Inner,
    /// Ready inner nodes: `order[head..tail]` of the shape, or of `general` once there.
    pub head: u32,
    pub tail: u32,
    /// While aligned (`general` is `None`): the level ending at `tail`.
    pub level: u32,
    pub general: Option<Box<General>>,
    /// Unfinished tasks holding nodes of it.
    pub inflight: u32,
    /// The latest task holding nodes of it (`TaskId::MAX`: none yet, the request has not
    /// started): a task being formed takes from it once, and its
    /// pinned inner subgraph is unpinned when that task finishes (tasks on a worker finish in
    /// order, and only the pinned worker takes from it).
    pub last_task: TaskId,
}

impl Tree {
    /// The state of request `id` (of priority `priority`) with graph `graph`, built in `lists`
    /// (a recycled buffer).
    pub fn new(id: RequestId, priority: i32, graph: Arc<CellGraph>, mut lists: Vec<u32>) -> Tree {
        let shape = graph.tree_shape().expect("a tree request has a tree shape");
        lists.clear();
        lists.extend_from_slice(shape.lists());
        let (leaves, inner_nodes) = (shape.leaves().len() as u32, shape.order().len() as u32);
        let (leaf_type, inner_type) = (shape.leaf_type, shape.inner_type);
        Tree {
            id,
            priority,
            graph,
            lists,
            leaves,
            inner_nodes,
            leaf_type,
            inner_type,
            leaf_next: 0,
            leaves_left: leaves,
            inner: Inner::Waiting,
            head: 0,
            tail: 0,
            level: 0,
            general: None,
            inflight: 0,
            last_task: TaskId::MAX,
        }
    }

    /// The buffer, for the next request.
    pub fn into_lists(self) -> Vec<u32> {
        self.lists
    }

    fn plan(&self) -> &SubgraphPlan {
        self.graph.plan().expect("a tree request has a plan")
    }

    fn order(&self) -> &[u32] {
        &self.lists[self.leaves as usize..(self.leaves + self.inner_nodes) as usize]
    }

    /// The end in `order` of level `k`, if there is such a level.
    fn level_end(&self, k: u32) -> Option<u32> {
        self.lists.get((self.leaves + self.inner_nodes + k) as usize).copied()
    }

    /// Leaves not yet submitted.
    pub fn leaves_ready(&self) -> usize {
        (self.leaves - self.leaf_next) as usize
    }

    /// Inner nodes ready now.
    pub fn inner_ready(&self) -> usize {
        (self.tail - self.head) as usize
    }

    /// Up to `room` leaves as rows, in order; returns how many.
    pub fn take_leaves(&mut self, room: usize, requests: &mut Vec<RequestId>, nodes: &mut Vec<u32>) -> usize {
        let from = self.leaf_next as usize;
        let k = room.min(self.leaves_ready());
        push_rows(self.id, &self.lists[from..from + k], requests, nodes);
        self.leaf_next += k as u32;
        k
    }

    /// Every leaf has finished: the inner subgraph's first level is ready (the caller queues it).
    pub fn open_inner(&mut self) {
        debug_assert_eq!(self.inner, Inner::Waiting);
        self.tail = self.level_end(0).expect("a tree request has inner nodes");
    }

    /// Up to `room` ready inner nodes as rows, in ready order; returns how many. The nodes this
    /// makes ready (their inner predecessors all submitted now) are ready from the next task on:
    /// [`Tree::inner_ready`] counts them with those left.
    pub fn take_inner(&mut self, room: usize, requests: &mut Vec<RequestId>, nodes: &mut Vec<u32>) -> usize {
        let (head, tail) = (self.head as usize, self.tail as usize);
        let k = room.min(tail - head);
        if k == 0 {
            return 0;
        }
        self.head += k as u32;
        let Some(g) = &mut self.general else {
            push_rows(self.id, &self.order()[head..head + k], requests, nodes);
            if head + k == tail {
                // The whole level: the next one is ready.
                self.level += 1;
                if let Some(end) = self.level_end(self.level) {
                    self.tail = end;
                }
                return k;
            }
            // Part of a level: from here on, node by node. Submitted are `order[..head + k]`.
            let (plan, order) = (self.plan(), self.order());
            let mut left = plan.internal_preds.clone();
            for &v in &order[..head + k] {
                for &s in plan.internal_successors(v) {
                    left[s as usize] -= 1;
                }
            }
            // Ready now: the rest of this level, then the nodes of the next level whose inner
            // predecessors are all submitted (any further level waits on the next one).
            let mut queue = order[..tail].to_vec();
            if let Some(end) = self.level_end(self.level + 1) {
                queue.extend(order[tail..end as usize].iter().filter(|&&v| left[v as usize] == 0));
            }
            self.tail = queue.len() as u32;
            self.general = Some(Box::new(General { queue, left }));
            return k;
        };
        push_rows(self.id, &g.queue[head..head + k], requests, nodes);
        let plan = self.graph.plan().expect("a tree request has a plan");
        for i in head..head + k {
            for &s in plan.internal_successors(g.queue[i]) {
                g.left[s as usize] -= 1;
                if g.left[s as usize] == 0 {
                    g.queue.push(s);
                }
            }
        }
        self.tail = g.queue.len() as u32;
        k
    }

    /// Whether every inner node has been submitted.
    pub fn inner_submitted(&self) -> bool {
        self.head == self.inner_nodes
    }

    /// Drop every ready node (the request stops). Returns (leaves, inner nodes) dropped.
    pub fn drop_ready(&mut self) -> (usize, usize) {
        let dropped = (self.leaves_ready(), self.inner_ready());
        self.leaf_next = self.leaves;
        self.head = self.tail;
        self.inner = Inner::Drained;
        dropped
    }
}

/// Rows `(id, v)` for each node `v` of `from`, appended to the task's row vectors. One loop
/// pushing both: a request's run is a few nodes, and for so few a copy routine's call costs more
/// than the copy.
fn push_rows(id: RequestId, from: &[u32], requests: &mut Vec<RequestId>, nodes: &mut Vec<u32>) {
    for &v in from {
        requests.push(id);
        nodes.push(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn take(t: &mut Tree, room: usize) -> (Vec<u32>, usize) {
        let (mut requests, mut nodes) = (Vec::new(), Vec::new());
        let before = t.inner_ready();
        let k = t.take_inner(room, &mut requests, &mut nodes);
        assert_eq!((requests, k), (vec![t.id; nodes.len()], nodes.len()));
        // Nodes made ready: those ready now but for the ones left from before.
        (nodes, t.inner_ready() - (before - k))
    }

    #[test]
    fn leaves_go_as_runs_and_the_inner_subgraph_level_by_level() {
        // Root 0 over 1 and 2 (internal), each over two leaves: levels {1, 2}, then {0}.
        let g = Arc::new(CellGraph::tree_of_parents(&[-1, 0, 0, 1, 1, 2, 2], 0, 1).unwrap());
        let mut t = Tree::new(7, 0, g, vec![99; 3]);
        assert_eq!((t.leaves_ready(), t.inner_ready(), t.inner), (4, 0, Inner::Waiting));
        let (mut requests, mut nodes) = (Vec::new(), Vec::new());
        assert_eq!(t.take_leaves(3, &mut requests, &mut nodes), 3);
        assert_eq!(t.take_leaves(3, &mut requests, &mut nodes), 1);
        assert_eq!((requests, nodes, t.leaves_ready()), (vec![7; 4], vec![3, 4, 5, 6], 0));
        t.open_inner();
        assert_eq!(t.inner_ready(), 2);
        assert_eq!(take(&mut t, 8), (vec![1, 2], 1), "the whole level: the next one is ready");
        assert!(t.general.is_none());
        assert_eq!(take(&mut t, 8), (vec![0], 0));
        assert!(t.inner_submitted());
        assert_eq!(t.drop_ready(), (0, 0));
    }

    #[test]
    fn part_of_a_level_switches_to_node_by_node_readiness() {
        // Inner levels {1, 2, 3}, then {4 (over 1, 2), 5 (over 3)}, then {0}; leaves 6..=11.
        let parents = [-1, 4, 4, 5, 0, 0, 1, 1, 2, 2, 3, 3];
        let g = Arc::new(CellGraph::tree_of_parents(&parents, 0, 1).unwrap());
        let mut t = Tree::new(1, 0, g, Vec::new());
        t.take_leaves(6, &mut Vec::new(), &mut Vec::new());
        t.open_inner();
        assert_eq!(t.inner_ready(), 3);
        // Room for two of three: 1 and 2 go, which makes 4 ready; 5 waits for 3.
        assert_eq!(take(&mut t, 2), (vec![1, 2], 1));
        assert!(t.general.is_some());
        assert_eq!(t.inner_ready(), 2);
        assert_eq!(take(&mut t, 8), (vec![3, 4], 1), "3 is left from before, then 4; 5 is made ready");
        assert_eq!(take(&mut t, 8), (vec![5], 1));
        assert_eq!(take(&mut t, 8), (vec![0], 0));
        assert!(t.inner_submitted());
    }

    #[test]
    fn an_inner_node_with_several_inner_predecessors_waits_for_all() {
        // A DAG of tree shape: leaves 0, 1; inner 2 (over 0), 3 (over 1), 4 (over 2, 3), 5 (over 2).
        let preds = [vec![], vec![], vec![0], vec![1], vec![2, 3], vec![2]];
        let g = Arc::new(CellGraph::new(vec![0, 0, 1, 1, 1, 1], &preds).unwrap());
        let mut t = Tree::new(1, 0, g, Vec::new());
        t.take_leaves(2, &mut Vec::new(), &mut Vec::new());
        t.open_inner();
        assert_eq!(t.inner_ready(), 2);
        // Only 2 goes: 5 is ready (its one predecessor is submitted), 4 is not (3 is not).
        assert_eq!(take(&mut t, 1), (vec![2], 1));
        assert_eq!(take(&mut t, 8), (vec![3, 5], 1));
        assert_eq!(take(&mut t, 8), (vec![4], 0));
        assert!(t.inner_submitted());
    }

    #[test]
    fn dropping_drops_every_ready_node() {
        let g = Arc::new(CellGraph::tree_of_parents(&[-1, 0, 0], 0, 1).unwrap());
        let mut t = Tree::new(1, 0, g, Vec::new());
        t.take_leaves(1, &mut Vec::new(), &mut Vec::new());
        assert_eq!(t.drop_ready(), (1, 0));
        assert_eq!((t.leaves_ready(), t.inner), (0, Inner::Drained));
    }
}
