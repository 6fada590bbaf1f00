//! The bookkeeping every policy keeps, written once: the decisions waiting for
//! [`Policy::poll`](super::Policy::poll), the deadline heap, the queued and running counts, task
//! ids and the model the policy serves. A policy owns a [`Book`] and keeps only what is its own
//! (its queues, its batches, its workers' state).
//!
//! The deadline heap is lazy: entries of requests that have completed or are already stopping
//! stay in it until they reach the top, where [`Book::due`] and [`Book::tidy`] drop them (a
//! policy says which keys are live). So a cancel never searches the heap, and
//! [`Book::next_deadline`] is exact once the policy has tidied.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use crate::error::Code;
use crate::sched::{Decision, Exec, Launch, ModelId, RequestId, TaskId, TaskShape, Time, WorkerId};

/// Shared policy bookkeeping; `K` is how the policy names a request in its deadline heap (its
/// id, or a slot and generation).
#[derive(Debug)]
pub(crate) struct Book<K: Ord + Copy = RequestId> {
    out: VecDeque<Decision>,
    deadlines: BinaryHeap<Reverse<(Time, K)>>,
    queued: usize,
    running: usize,
    next_task: TaskId,
    /// The model of the requests (policies that serve one model: every arrival's).
    model: ModelId,
    /// The most requests the drivers may hold at once: the sum of the admission bounds given
    /// to [`Policy::reserve`](super::Policy::reserve) (0: unknown).
    bound: usize,
}

impl<K: Ord + Copy> Default for Book<K> {
    fn default() -> Self {
        Book {
            out: VecDeque::new(),
            deadlines: BinaryHeap::new(),
            queued: 0,
            running: 0,
            next_task: 0,
            model: 0,
            bound: 0,
        }
    }
}

impl<K: Ord + Copy> Book<K> {
    /// `requests` more may be held at once (a model joined with that admission bound): reserve
    /// the deadline heap for the new bound, and return it, for the policy to reserve its own
    /// tables (see [`Policy::reserve`](super::Policy::reserve)). A deadline entry lives until
    /// its request ends or it reaches the top, so the heap holds at most one per held request
    /// plus the stale ones not yet at the top.
    pub fn reserve(&mut self, requests: usize) -> usize {
        self.bound = self.bound.saturating_add(requests);
        self.deadlines.reserve(self.bound.saturating_sub(self.deadlines.len()));
        self.bound
    }

    /// A request of `model` arrived: it is queued, and its deadline (if any) watched under
    /// `key`.
    pub fn arrive(&mut self, model: ModelId, deadline: Option<Time>, key: K) {
        self.model = model;
        self.queued += 1;
        if let Some(d) = deadline {
            self.deadlines.push(Reverse((d, key)));
        }
    }

    /// `n` queued requests started (their first cells or rows are in a launched task).
    pub fn start(&mut self, n: usize) {
        debug_assert!(n <= self.queued, "starting {n} of {} queued requests", self.queued);
        self.queued -= n;
        self.running += n;
    }

    /// The request completes with `code`; `started` says which count it leaves.
    pub fn complete(&mut self, id: RequestId, code: Code, started: bool) {
        if started {
            self.running -= 1;
        } else {
            self.queued -= 1;
        }
        self.out.push_back(Decision::Complete { id, code });
    }

    /// A started request of a fixed-shape policy whose task has finished at `now` completes:
    /// `Cancelled` if it was cancelled while running, `DeadlineExceeded` if its deadline has
    /// passed, else `Ok`.
    pub fn finish_running(&mut self, id: RequestId, cancelled: bool, deadline: Option<Time>, now: Time) {
        let code = if cancelled {
            Code::Cancelled
        } else if deadline.is_some_and(|d| d <= now) {
            Code::DeadlineExceeded
        } else {
            Code::Ok
        };
        self.complete(id, code, true);
    }

    /// A queued request is refused with `code`, for `reason` ([`Decision::Reject`]): E²bird's
    /// full ring.
    pub fn reject(&mut self, id: RequestId, code: Code, reason: &'static str) {
        self.queued -= 1;
        self.out.push_back(Decision::Reject { id, code, reason });
    }

    /// A fresh task id.
    pub fn task_id(&mut self) -> TaskId {
        let t = self.next_task;
        self.next_task += 1;
        t
    }

    /// Launch `task` (from [`task_id`](Self::task_id)) on `worker` for the model served, with
    /// the default [`Exec`].
    pub fn launch(
        &mut self,
        task: TaskId,
        worker: WorkerId,
        shape: TaskShape,
        requests: Vec<RequestId>,
        batch: usize,
    ) {
        let model = self.model;
        self.out.push_back(Decision::Launch(Launch {
            task,
            worker,
            model,
            shape,
            exec: Exec::default(),
            requests,
            batch,
        }));
    }

    /// Launch a task described in full: a policy serving several models, or one that sets the
    /// task's [`Exec`].
    pub fn push_launch(&mut self, launch: Launch) {
        self.out.push_back(Decision::Launch(launch));
    }

    /// The next request whose deadline is `<= now` and that `live` still counts, taken off the
    /// heap; entries that are no longer live are dropped on the way. `None` once the earliest
    /// live deadline is later than `now`.
    pub fn due(&mut self, now: Time, mut live: impl FnMut(K) -> bool) -> Option<K> {
        while let Some(&Reverse((d, key))) = self.deadlines.peek() {
            let is_live = live(key);
            if is_live && d > now {
                return None;
            }
            self.deadlines.pop();
            if is_live {
                return Some(key);
            }
        }
        None
    }

    /// Drop entries at the top of the deadline heap that are no longer live, so that
    /// [`next_deadline`](Self::next_deadline) is a live request's.
    pub fn tidy(&mut self, mut live: impl FnMut(K) -> bool) {
        while let Some(&Reverse((_, key))) = self.deadlines.peek() {
            if live(key) {
                return;
            }
            self.deadlines.pop();
        }
    }

    /// The earliest deadline watched (a live request's after [`tidy`](Self::tidy) or
    /// [`due`](Self::due)).
    pub fn next_deadline(&self) -> Option<Time> {
        self.deadlines.peek().map(|Reverse((d, _))| *d)
    }

    /// The next decision, for [`Policy::poll`](super::Policy::poll).
    pub fn poll(&mut self) -> Option<Decision> {
        let d = self.out.pop_front();
        if self.out.is_empty() {
            // Back to the start of the buffer: the next decisions land in memory still in cache
            // rather than further round the ring.
            self.out.clear();
        }
        d
    }

    pub fn queued(&self) -> usize {
        self.queued
    }

    pub fn running(&self) -> usize {
        self.running
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::Arrival;

    fn arrival(id: RequestId, deadline: Option<u64>) -> Arrival {
        Arrival { deadline: deadline.map(Time::from_micros), ..Arrival::fixed(id) }
    }

    #[test]
    fn counts_follow_arrivals_starts_and_completions() {
        let mut b: Book = Book::default();
        for id in 0..4 {
            let a = arrival(id, None);
            b.arrive(a.model, a.deadline, id);
        }
        b.start(2);
        assert_eq!((b.queued(), b.running()), (2, 2));
        b.complete(0, Code::Ok, true);
        b.complete(2, Code::Cancelled, false);
        b.reject(3, Code::Busy, "full");
        assert_eq!((b.queued(), b.running()), (0, 1));
        let out: Vec<_> = std::iter::from_fn(|| b.poll()).collect();
        assert_eq!(
            out,
            vec![
                Decision::Complete { id: 0, code: Code::Ok },
                Decision::Complete { id: 2, code: Code::Cancelled },
                Decision::Reject { id: 3, code: Code::Busy, reason: "full" },
            ]
        );
    }

    #[test]
    fn due_returns_live_deadlines_in_order_and_drops_dead_ones() {
        let mut b: Book = Book::default();
        for (id, d) in [(1, 30), (2, 10), (3, 20), (4, 40)] {
            let a = arrival(id, Some(d));
            b.arrive(a.model, a.deadline, id);
        }
        let live = |k: RequestId| k != 2;
        assert_eq!(b.due(Time::from_micros(25), live), Some(3));
        assert_eq!(b.due(Time::from_micros(25), live), None);
        assert_eq!(b.next_deadline(), Some(Time::from_micros(30)));
        b.tidy(|k| k == 4);
        assert_eq!(b.next_deadline(), Some(Time::from_micros(40)));
        assert_eq!(b.due(Time::from_micros(100), |_| true), Some(4));
        assert_eq!(b.next_deadline(), None);
    }

    #[test]
    fn launches_carry_the_model_of_the_arrivals_and_fresh_task_ids() {
        let mut b: Book = Book::default();
        b.arrive(7, None, 1);
        let (t0, t1) = (b.task_id(), b.task_id());
        assert_ne!(t0, t1);
        b.launch(t1, 2, TaskShape::Dense, vec![1], 4);
        let Some(Decision::Launch(l)) = b.poll() else { panic!("a launch") };
        assert_eq!((l.task, l.worker, l.model, l.batch, l.requests), (t1, 2, 7, 4, vec![1]));
    }
}
