//! The request processor of cellular batching (BatchMaker §4.2) for graph requests (any cell
//! graph that is neither one path — a `chain` request — nor tree-shaped — a `tree` request, such
//! as `treelstm`'s): per-request dependency and subgraph tracking, with no allocation per
//! scheduling step.
//!
//! A request's state ([`Req`]: three arrays, nodes, edges and subgraphs) is recycled whole, box
//! and buffers, from completed requests ([`Req::reset`]), so an arrival in steady state allocates
//! nothing either.
//! Everything a task touches per row (a node's subgraph, dependency counter, ready link and
//! successor range) sits in one [`Node`] record: one cache line serves several rows.

use crate::sched::CellGraph;

/// "No node" in the intrusive ready lists; "not pinned" in [`Subgraph::pinned`].
pub(super) const NONE: u32 = u32::MAX;

/// Which queue a subgraph with ready nodes sits in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Where {
    Nowhere,
    Unpinned,
    /// The pinned queue of this worker.
    Pinned(u32),
}

/// A queue entry naming one subgraph of one request: for a chain its run, for a graph request
/// its subgraph, for a tree request `tree::LEAVES` (all its ready leaves) or `tree::INNER` (its
/// inner subgraph). Entries go stale when the subgraph moves queue or the request leaves; they
/// are skipped when met.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct SgRef {
    pub slot: u32,
    pub generation: u32,
    pub sg: u32,
}

/// One node of a request.
#[derive(Clone, Copy, Debug)]
pub(super) struct Node {
    /// Its subgraph.
    pub sg: u32,
    /// Same-subgraph predecessors not yet submitted.
    pub internal_left: u32,
    /// The next node in its subgraph's ready list.
    pub next_ready: u32,
    /// Its successors, ascending, in `Req::edges`: those in its subgraph at `succ..succ_ext`,
    /// those in other subgraphs at `succ_ext..succ_end`.
    pub succ: u32,
    pub succ_ext: u32,
    pub succ_end: u32,
}

/// A subgraph: connected nodes of one cell type.
#[derive(Clone, Copy, Debug)]
pub(super) struct Subgraph {
    pub ty: u8,
    /// Dependencies from outside the subgraph not yet finished.
    pub external_left: u32,
    /// Ready, unsubmitted nodes: an intrusive FIFO through `Node::next_ready`.
    pub ready_head: u32,
    pub ready_tail: u32,
    pub ready_len: u32,
    /// The worker this subgraph is pinned to while it has tasks outstanding, or [`NONE`].
    pub pinned: u32,
    /// The pin counter: tasks holding nodes of this subgraph, not yet done.
    pub outstanding: u32,
    pub queued: Where,
    /// Its roots (nodes with no same-subgraph predecessor), ascending, are
    /// `Req::edges[roots..]` up to the next subgraph's `roots` (or the end).
    pub roots: u32,
    /// Marks the subgraph as counted by the operation (task formation or completion) in hand.
    pub stamp: u64,
}

/// The dependency state of one graph request.
#[derive(Default)]
pub(super) struct Req {
    pub nodes: Vec<Node>,
    /// Successor lists of every node (CSR, see [`Node`]), then the roots of every subgraph.
    pub edges: Vec<u32>,
    pub sgs: Vec<Subgraph>,
    pub done_nodes: u32,
    /// Tasks holding nodes of this request, not yet done.
    pub inflight: u32,
    /// Marks the request as counted by the operation (task formation or completion) in hand.
    pub stamp: u64,
}

impl Req {
    /// Buffers this large are freed rather than kept for reuse.
    const KEEP_MAX: usize = 4096;

    /// Make this (a new or recycled record) the state of a request with graph `graph`, built from
    /// the graph's subgraph plan (a copy: the analysis was done when the graph was built). Its
    /// initially ready nodes are those with `is_initially_ready`.
    pub fn reset(&mut self, graph: &CellGraph) {
        let plan = graph.plan().expect("a graph request's graph is not a path, so it has a plan");
        let Req { nodes, edges, sgs, .. } = self;
        nodes.clear();
        edges.clear();
        sgs.clear();
        let n = graph.len();
        nodes.extend((0..n).map(|v| Node {
            sg: plan.node_sg[v],
            internal_left: plan.internal_preds[v],
            next_ready: NONE,
            succ: plan.succ_start[v],
            succ_ext: plan.succ_ext[v],
            succ_end: plan.succ_start[v + 1],
        }));
        // Successor lists, then the roots of every subgraph.
        edges.extend_from_slice(&plan.succ);
        edges.extend_from_slice(&plan.roots);
        let roots_at = plan.succ.len() as u32;
        sgs.extend(plan.sg_type.iter().zip(&plan.external_preds).zip(&plan.roots_start).map(
            |((&ty, &ext), &r)| Subgraph {
                ty,
                external_left: ext,
                ready_head: NONE,
                ready_tail: NONE,
                ready_len: 0,
                pinned: NONE,
                outstanding: 0,
                queued: Where::Nowhere,
                roots: roots_at + r,
                stamp: 0,
            },
        ));
        (self.done_nodes, self.inflight, self.stamp) = (0, 0, 0);
    }

    /// Whether to keep this record for the next request, rather than free it.
    pub fn worth_keeping(&self) -> bool {
        self.nodes.capacity() <= Self::KEEP_MAX
            && self.edges.capacity() <= 2 * Self::KEEP_MAX
            && self.sgs.capacity() <= Self::KEEP_MAX
    }

    /// Whether `node` is ready on arrival: no same-subgraph predecessor and no external
    /// dependency.
    pub fn is_initially_ready(&self, node: usize) -> bool {
        let v = &self.nodes[node];
        v.internal_left == 0 && self.sgs[v.sg as usize].external_left == 0
    }

    pub fn push_ready(&mut self, sg: u32, node: u32) {
        let s = &mut self.sgs[sg as usize];
        self.nodes[node as usize].next_ready = NONE;
        if s.ready_tail == NONE {
            s.ready_head = node;
        } else {
            self.nodes[s.ready_tail as usize].next_ready = node;
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
        s.ready_head = self.nodes[node as usize].next_ready;
        if s.ready_head == NONE {
            s.ready_tail = NONE;
        }
        s.ready_len -= 1;
        Some(node)
    }

    /// Index range in `edges` of the roots of subgraph `sg`: its nodes with no same-subgraph
    /// predecessor (ready once its external dependencies have finished), ascending.
    pub fn subgraph_roots(&self, sg: u32) -> std::ops::Range<usize> {
        let end = self.sgs.get(sg as usize + 1).map_or(self.edges.len(), |s| s.roots as usize);
        self.sgs[sg as usize].roots as usize..end
    }

    /// Index range in `edges` of the successors of `node` in its own subgraph.
    pub fn internal_successors(&self, node: u32) -> std::ops::Range<usize> {
        let v = &self.nodes[node as usize];
        v.succ as usize..v.succ_ext as usize
    }

    /// Index range in `edges` of the successors of `node` in other subgraphs.
    pub fn external_successors(&self, node: u32) -> std::ops::Range<usize> {
        let v = &self.nodes[node as usize];
        v.succ_ext as usize..v.succ_end as usize
    }
}
