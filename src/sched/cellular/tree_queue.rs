//! Cellular batching's scheduler side for tree requests (their state is
//! [`Tree`](super::tree::Tree)): queueing their leaves and inner subgraph, taking runs of rows
//! into a forming task (FormBatchedTask, Algorithm 1) and dropping them when the request stops.

use super::*;

impl CellularPolicy {
    /// Drop every ready node of a tree request (cancel, deadline, early end).
    pub(super) fn drop_tree(&mut self, slot: u32) {
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
    pub(super) fn queue_leaves(&mut self, slot: u32) {
        let t = self.trees[slot as usize].as_ref().expect("live tree request");
        let (priority, ty, ready) = (t.priority, t.leaf_type as usize, t.leaves_ready());
        self.queue_unpinned(slot, LEAVES, priority, ty, ready, false);
    }

    /// Queue tree request `slot`'s inner subgraph, schedulable now, as unpinned (at the back of
    /// its priority).
    pub(super) fn queue_inner(&mut self, slot: u32) {
        let t = self.trees[slot as usize].as_mut().expect("live tree request");
        t.inner = Inner::Queued;
        let (priority, ty, ready) = (t.priority, t.inner_type as usize, t.inner_ready());
        self.queue_unpinned(slot, INNER, priority, ty, ready, false);
    }

    // ---- FormBatchedTask (Algorithm 1) -----------------------------------------------------

    /// Take from the tree request of entry `at` (found in queue `from`: its leaves or its inner
    /// subgraph, unpinned, or its inner subgraph pinned to `worker`) into `task` on `worker`. An
    /// inner subgraph with nodes left ready (the task is full) or made ready is pinned to
    /// `worker`. True when the entry is used up (stale, or nothing of it left where it was).
    pub(super) fn take_tree(
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

    // ---- task_done -------------------------------------------------------------------------

    /// Tree rows of a finished task of cell type `ty` (`task_done`), one run per request.
    pub(super) fn tree_rows_done(
        &mut self,
        trees: &[(u32, u32)],
        ty: usize,
        task: TaskId,
        idle: &mut Vec<u32>,
    ) {
        // Tree requests: finished leaves count towards opening the inner subgraph, and an inner
        // subgraph whose last task this was is unpinned: its pin counter is 0. Unpinned ready
        // nodes were ready before anything queued since, so they go first among their priority,
        // in row order (hence queued back to front, once the pass is over).
        let mut unpinned = std::mem::take(&mut self.unpinned_trees);
        for &(slot, rows) in trees {
            // Doomed requests are not alive.
            let doomed = self.alive[slot as usize] == 0;
            let t = self.trees[slot as usize].as_mut().expect("live tree request");
            t.inflight -= 1;
            if t.inflight == 0 {
                idle.push(slot);
            }
            if ty as CellType == t.leaf_type {
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
    }
}
