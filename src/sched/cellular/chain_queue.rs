//! Cellular batching's scheduler side for chain requests (their state is
//! [`Chain`](super::chain::Chain), pinned runs live as lanes of a [`Block`](super::chain::Block)):
//! queueing a run, a worker's block lapsing and dispersing, taking lanes and queued runs into a
//! forming task (FormBatchedTask, Algorithm 1) and dropping a chain when the request stops.

use super::*;

impl CellularPolicy {
    /// Queue chain request `slot`'s current run as an unpinned subgraph, at the back of its
    /// priority (it became ready now) or at the front (it was unpinned).
    pub(super) fn queue_chain(&mut self, slot: u32, front: bool) {
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
    pub(super) fn lapse(&mut self, ty: usize, worker: WorkerId) {
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
    pub(super) fn disperse(&mut self, ty: usize, worker: WorkerId) {
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
    pub(super) fn take_lapsed(
        &mut self,
        ty: usize,
        from: WorkerId,
        worker: WorkerId,
        max: usize,
        f: &mut Forming,
    ) {
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
    pub(super) fn take_chain(&mut self, at: SgRef, ty: usize, worker: WorkerId, f: &mut Forming) -> bool {
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
    pub(super) fn drop_chain(&mut self, slot: u32) {
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

    // ---- task_done -------------------------------------------------------------------------

    /// Chains whose run left with a finished task (`task_done`).
    pub(super) fn chain_runs_done(&mut self, releases: &[u32], idle: &mut Vec<u32>) {
        // Chains whose run left with this task: the next run (its external dependency is this
        // run's last node) is ready now, or the request is finished.
        for &slot in releases {
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
    }
}
