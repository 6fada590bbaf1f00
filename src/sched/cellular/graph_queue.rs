//! Cellular batching's scheduler side for graph requests (any cell graph that is neither a path
//! nor tree-shaped; their state is [`Req`](super::request::Req)): making nodes ready, queueing
//! and unpinning their subgraphs, taking ready nodes into a forming task (FormBatchedTask,
//! Algorithm 1) and dropping them when the request stops.

use super::*;

impl CellularPolicy {
    /// Make `node` of graph request `slot` ready: append it to its subgraph's ready list and
    /// queue the subgraph where it belongs (pinned worker or unpinned) if it is not queued yet.
    pub(super) fn push_ready(&mut self, slot: u32, node: u32) {
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
    pub(super) fn unpin(&mut self, slot: u32, sg: u32) {
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
    pub(super) fn drop_ready(&mut self, slot: u32) {
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

    // ---- FormBatchedTask (Algorithm 1) -----------------------------------------------------

    /// Move ready nodes of the graph subgraph `at` (found in queue `from`) into the task,
    /// pinning it to `worker`; their same-subgraph successors that this makes ready go to
    /// `ready_after`. True when the queue entry is used up (stale, or no ready nodes left).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn take_from(
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

    // ---- task_done -------------------------------------------------------------------------

    /// Graph rows of a finished task (`task_done`): nodes done, pin counters dropped once per
    /// subgraph and task (`stamp`), requests with nothing left running into `idle`, and
    /// subgraphs whose last external dependency finished made schedulable.
    pub(super) fn graph_rows_done(&mut self, rows: &[(u32, u32)], stamp: u64, idle: &mut Vec<u32>) {
        for &(slot, node) in rows {
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
    }
}
