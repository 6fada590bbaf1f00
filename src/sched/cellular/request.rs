//! The request processor of cellular batching (BatchMaker §4.2): per-request dependency and
//! subgraph tracking, with no allocation per scheduling step.

use std::sync::Arc;

use crate::error::Code;
use crate::sched::{CellGraph, RequestId, Time, WorkerId};

/// "No node" in the intrusive ready lists.
pub(super) const NONE: u32 = u32::MAX;

/// Which queue a subgraph with ready nodes sits in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Where {
    Nowhere,
    Unpinned,
    Pinned(WorkerId),
}

/// A queue entry naming one subgraph of one request. Entries go stale when the subgraph moves
/// queue or the request leaves; they are skipped when met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SgRef {
    pub slot: u32,
    pub generation: u32,
    pub sg: u32,
}

/// A subgraph: connected nodes of one cell type.
pub(super) struct Subgraph {
    pub ty: u8,
    /// Dependencies from outside the subgraph not yet finished.
    pub external_left: u32,
    /// Ready, unsubmitted nodes: an intrusive FIFO through `Req::next_ready`.
    pub ready_head: u32,
    pub ready_tail: u32,
    pub ready_len: u32,
    /// The worker this subgraph is pinned to while it has tasks outstanding.
    pub pinned: Option<WorkerId>,
    /// The pin counter: tasks holding nodes of this subgraph, not yet done.
    pub outstanding: u32,
    pub queued: Where,
    /// Marks the subgraph as counted by the operation (task formation or completion) in hand.
    pub stamp: u64,
}

/// One request in the policy.
pub(super) struct Req {
    pub id: RequestId,
    pub generation: u32,
    pub priority: i32,
    pub deadline: Option<Time>,
    pub graph: Arc<CellGraph>,
    pub node_sg: Vec<u32>,
    /// Same-subgraph predecessors not yet submitted.
    pub internal_left: Vec<u32>,
    pub next_ready: Vec<u32>,
    pub succ_start: Vec<u32>,
    pub succs: Vec<u32>,
    pub sgs: Vec<Subgraph>,
    pub done_nodes: usize,
    /// Tasks holding nodes of this request, not yet done.
    pub inflight: u32,
    /// Set once the request is to stop at the next boundary, with the code it completes with.
    pub doomed: Option<Code>,
    pub stamp: u64,
}

impl Req {
    /// The request and its initially ready nodes.
    pub fn new(
        id: RequestId,
        generation: u32,
        priority: i32,
        deadline: Option<Time>,
        graph: Arc<CellGraph>,
    ) -> (Req, Vec<u32>) {
        let n = graph.len();
        let (succ_start, succs) = graph.successors();
        let (node_sg, count) = graph.subgraphs();
        let mut sgs: Vec<Subgraph> = (0..count)
            .map(|_| Subgraph {
                ty: 0,
                external_left: 0,
                ready_head: NONE,
                ready_tail: NONE,
                ready_len: 0,
                pinned: None,
                outstanding: 0,
                queued: Where::Nowhere,
                stamp: 0,
            })
            .collect();
        let mut internal_left = vec![0u32; n];
        for v in 0..n {
            let sg = node_sg[v] as usize;
            sgs[sg].ty = graph.cell_type(v);
            for &p in graph.preds(v) {
                if node_sg[p as usize] as usize == sg {
                    internal_left[v] += 1;
                } else {
                    sgs[sg].external_left += 1;
                }
            }
        }
        let ready = (0..n as u32)
            .filter(|&v| {
                internal_left[v as usize] == 0 && sgs[node_sg[v as usize] as usize].external_left == 0
            })
            .collect();
        let req = Req {
            id,
            generation,
            priority,
            deadline,
            graph,
            node_sg,
            internal_left,
            next_ready: vec![NONE; n],
            succ_start,
            succs,
            sgs,
            done_nodes: 0,
            inflight: 0,
            doomed: None,
            stamp: 0,
        };
        (req, ready)
    }

    pub fn push_ready(&mut self, sg: u32, node: u32) {
        let s = &mut self.sgs[sg as usize];
        self.next_ready[node as usize] = NONE;
        if s.ready_tail == NONE {
            s.ready_head = node;
        } else {
            self.next_ready[s.ready_tail as usize] = node;
        }
        s.ready_tail = node;
        s.ready_len += 1;
    }

    pub fn pop_ready(&mut self, sg: u32) -> Option<u32> {
        let s = &mut self.sgs[sg as usize];
        let node = s.ready_head;
        if node == NONE {
            return None;
        }
        s.ready_head = self.next_ready[node as usize];
        if s.ready_head == NONE {
            s.ready_tail = NONE;
        }
        s.ready_len -= 1;
        Some(node)
    }

    /// Nodes of subgraph `sg` with no same-subgraph predecessor (ready once its external
    /// dependencies have finished).
    pub fn subgraph_roots(&self, sg: u32) -> Vec<u32> {
        (0..self.graph.len() as u32)
            .filter(|&v| self.node_sg[v as usize] == sg && self.internal_left[v as usize] == 0)
            .collect()
    }
}
