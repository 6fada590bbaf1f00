//! TF-Serving style timeout batching (the baseline of BatchMaker §7 and E²bird §8).
//!
//! Parameters: maximum batch size `s`, maximum wait `t`, `workers` identical workers.
//! * A batch is *ready* when `s` requests are queued, or when its oldest request has waited `t`
//!   (`t = 0` is the papers' **NO_Wait** configuration: whatever is queued goes as soon as a worker
//!   is idle). A ready batch starts on the idle worker with the lowest index.
//! * While every worker is busy the batch keeps filling up to `s` (TF-Serving's open batch), so the
//!   `t` timer only makes a batch eligible; it never closes a batch that `s` already closed.
//! * **Static** (`pad_to_max`): every task computes `s` rows, the missing ones being padding.
//! * A *flush* (the caller expects no more arrivals) makes every request queued at that moment
//!   ready at once: the end of an input does not wait out `t`.
//! * Requests are taken by priority (larger first), then by arrival order.
//! * Deadlines are checked while queued (at `tick`) and when the request's task finishes; cancel
//!   removes a queued request at once and a running one when its task finishes.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use crate::error::Code;
use crate::sched::book::Book;
use crate::sched::{
    Arrival, Decision, IdMap, IdTable, Policy, RequestId, TaskId, TaskReport, TaskShape, Time, WorkerId,
    WorkerShape,
};

/// Configuration of [`TimeoutPolicy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimeoutConfig {
    /// `s`: the most requests in one task (≥ 1).
    pub max_batch: usize,
    /// `t`: how long the oldest queued request may wait for a fuller batch.
    pub max_wait: Duration,
    /// Number of workers (≥ 1).
    pub workers: usize,
    /// Static batching: pad every task to `max_batch` rows.
    pub pad_to_max: bool,
}

impl Default for TimeoutConfig {
    fn default() -> Self {
        TimeoutConfig { max_batch: 32, max_wait: Duration::from_micros(500), workers: 1, pad_to_max: false }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Queued,
    Running(TaskId),
}

#[derive(Debug)]
struct Entry {
    arrived: Time,
    deadline: Option<Time>,
    state: State,
    cancelled: bool,
}

/// TF-Serving style batching as a sans-IO state machine. See the module documentation.
#[derive(Debug)]
pub struct TimeoutPolicy {
    cfg: TimeoutConfig,
    requests: IdTable<Entry>,
    /// Queued request ids by priority (largest first), FIFO within a priority. May hold ids that
    /// already left the queue (cancelled / expired); those are skipped and never at a front.
    queues: BTreeMap<Reverse<i32>, VecDeque<RequestId>>,
    /// Outbox, counts, and the deadlines of queued requests (a running request's deadline is
    /// checked when its task ends).
    book: Book,
    idle: BTreeSet<WorkerId>,
    tasks: IdMap<(WorkerId, Vec<RequestId>)>,
    /// The last flush: requests that arrived by then are ready without waiting out `max_wait`.
    flushed: Option<Time>,
}

impl TimeoutPolicy {
    pub fn new(cfg: TimeoutConfig) -> TimeoutPolicy {
        assert!(cfg.max_batch >= 1, "max_batch must be at least 1");
        assert!(cfg.workers >= 1, "workers must be at least 1");
        TimeoutPolicy {
            cfg,
            requests: IdTable::default(),
            queues: BTreeMap::new(),
            book: Book::default(),
            idle: (0..cfg.workers).collect(),
            tasks: IdMap::default(),
            flushed: None,
        }
    }

    pub fn config(&self) -> &TimeoutConfig {
        &self.cfg
    }

    /// Arrival time of the oldest queued request.
    fn oldest(&self) -> Option<Time> {
        self.queues.values().filter_map(|q| q.front()).map(|id| self.requests[id].arrived).min()
    }

    /// Drop ids at the queue fronts that are no longer queued, and empty queues.
    fn tidy(&mut self) {
        let requests = &self.requests;
        self.queues.retain(|_, q| {
            while let Some(id) = q.front() {
                match requests.get(id) {
                    Some(e) if e.state == State::Queued => break,
                    _ => {
                        q.pop_front();
                    }
                }
            }
            !q.is_empty()
        });
        self.book.tidy(|id| requests.get(&id).is_some_and(|e| e.state == State::Queued));
    }

    /// Take a queued request out of the queue and complete it with `code`.
    fn finish_queued(&mut self, id: RequestId, code: Code) {
        if self.requests.remove(&id).is_some() {
            self.book.complete(id, code, false);
        }
    }

    fn expire(&mut self, now: Time) {
        while let Some(id) =
            self.book.due(now, |id| self.requests.get(&id).is_some_and(|e| e.state == State::Queued))
        {
            self.finish_queued(id, Code::DeadlineExceeded);
        }
    }

    fn ready(&self, now: Time) -> bool {
        self.book.queued() >= self.cfg.max_batch
            || self
                .oldest()
                .is_some_and(|t0| now >= t0 + self.cfg.max_wait || self.flushed.is_some_and(|f| t0 <= f))
    }

    /// Start ready batches on idle workers.
    fn dispatch(&mut self, now: Time) {
        self.expire(now);
        self.tidy();
        while self.book.queued() > 0 && !self.idle.is_empty() && self.ready(now) {
            let worker = self.idle.pop_first().expect("checked non-empty");
            let task = self.book.task_id();
            let mut batch = Vec::with_capacity(self.cfg.max_batch.min(self.book.queued()));
            for q in self.queues.values_mut() {
                while batch.len() < self.cfg.max_batch {
                    let Some(id) = q.pop_front() else { break };
                    if let Some(e) = self.requests.get_mut(&id)
                        && e.state == State::Queued
                    {
                        e.state = State::Running(task);
                        batch.push(id);
                    }
                }
            }
            self.book.start(batch.len());
            let rows = if self.cfg.pad_to_max { self.cfg.max_batch } else { batch.len() };
            self.tasks.insert(task, (worker, batch.clone()));
            self.book.launch(task, worker, TaskShape::Dense, batch, rows);
            self.tidy();
        }
    }
}

impl Policy for TimeoutPolicy {
    fn workers(&self) -> Vec<WorkerShape> {
        WorkerShape::uniform(self.cfg.workers, self.cfg.max_batch)
    }

    fn lookahead(&self) -> usize {
        1
    }

    fn reserve(&mut self, requests: usize) {
        let held = self.book.reserve(requests);
        self.requests.reserve_for(held);
    }

    fn arrive(&mut self, now: Time, req: Arrival) {
        let entry = Entry { arrived: now, deadline: req.deadline, state: State::Queued, cancelled: false };
        let previous = self.requests.insert(req.id, entry);
        assert!(previous.is_none(), "request {} arrived twice", req.id);
        self.queues.entry(Reverse(req.priority)).or_default().push_back(req.id);
        self.book.arrive(req.model, req.deadline, req.id);
        self.dispatch(now);
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        match self.requests.get_mut(&id) {
            Some(e) if e.state == State::Queued => {
                self.finish_queued(id, Code::Cancelled);
                self.tidy();
            }
            Some(e) => e.cancelled = true,
            None => {}
        }
        self.dispatch(now);
    }

    fn task_done(&mut self, now: Time, report: &TaskReport) {
        let task = report.task;
        let (worker, ids) = self.tasks.remove(&task).expect("task_done for an unknown task");
        for id in ids {
            let e = self.requests.remove(&id).expect("running request is known");
            debug_assert_eq!(e.state, State::Running(task));
            self.book.finish_running(id, e.cancelled, e.deadline, now);
        }
        self.idle.insert(worker);
        self.dispatch(now);
    }

    fn end_early(&mut self, _now: Time, _id: RequestId) {
        // A fixed-shape request ends with its only task; there is nothing to cut short.
    }

    fn tick(&mut self, now: Time) {
        self.dispatch(now);
    }

    fn flush(&mut self, now: Time) {
        self.flushed = Some(now);
        self.dispatch(now);
    }

    fn poll(&mut self) -> Option<Decision> {
        self.book.poll()
    }

    fn next_wakeup(&self) -> Option<Time> {
        let queued = self.book.queued();
        let batch_timer = if queued > 0 && queued < self.cfg.max_batch && !self.idle.is_empty() {
            self.oldest().map(|t0| t0 + self.cfg.max_wait)
        } else {
            None
        };
        batch_timer.into_iter().chain(self.book.next_deadline()).min()
    }

    fn queued(&self) -> usize {
        self.book.queued()
    }

    fn running(&self) -> usize {
        self.book.running()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::{Launch, drain};

    fn us(v: u64) -> Time {
        Time::from_micros(v)
    }

    fn policy(s: usize, t_us: u64, workers: usize) -> TimeoutPolicy {
        TimeoutPolicy::new(TimeoutConfig {
            max_batch: s,
            max_wait: Duration::from_micros(t_us),
            workers,
            pad_to_max: false,
        })
    }

    fn arrive(p: &mut TimeoutPolicy, now: Time, id: RequestId) {
        p.arrive(now, Arrival::fixed(id));
    }

    fn launch(task: TaskId, worker: WorkerId, requests: &[RequestId], batch: usize) -> Decision {
        Decision::Launch(Launch::dense(task, worker, requests, batch))
    }

    fn ok(id: RequestId) -> Decision {
        Decision::Complete { id, code: Code::Ok }
    }

    #[test]
    fn batch_closes_at_max_batch_size_without_waiting() {
        let mut p = policy(3, 1000, 1);
        arrive(&mut p, us(0), 1);
        arrive(&mut p, us(10), 2);
        assert!(drain(&mut p).is_empty());
        assert_eq!(p.next_wakeup(), Some(us(1000)));
        arrive(&mut p, us(20), 3);
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1, 2, 3], 3)]);
        assert_eq!(p.next_wakeup(), None, "the closed batch's timer must not survive it");
    }

    #[test]
    fn batch_closes_at_max_wait_after_first_arrival() {
        let mut p = policy(8, 1000, 1);
        arrive(&mut p, us(100), 1);
        arrive(&mut p, us(600), 2);
        assert_eq!(p.next_wakeup(), Some(us(1100)));
        p.tick(us(1099));
        assert!(drain(&mut p).is_empty());
        p.tick(us(1100));
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1, 2], 2)]);
    }

    #[test]
    fn flush_launches_what_is_queued_without_waiting_and_later_arrivals_wait_again() {
        let mut p = policy(8, 1_000_000, 1);
        arrive(&mut p, us(0), 1);
        arrive(&mut p, us(10), 2);
        assert!(drain(&mut p).is_empty());
        p.flush(us(20));
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1, 2], 2)]);
        // Queued while the worker is busy, before and after a second flush.
        arrive(&mut p, us(30), 3);
        p.flush(us(40));
        arrive(&mut p, us(50), 4);
        assert!(drain(&mut p).is_empty());
        p.task_done(us(60), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![ok(1), ok(2), launch(1, 0, &[3, 4], 2)]);
        // Arrived after the last flush: waits for its batch again.
        p.task_done(us(70), &TaskReport::of(1));
        arrive(&mut p, us(80), 5);
        assert_eq!(drain(&mut p), vec![ok(3), ok(4)]);
        assert_eq!(p.next_wakeup(), Some(us(1_000_080)));
    }

    #[test]
    fn size_close_does_not_leave_a_timer_for_the_next_batch() {
        // Batch 1 closes at s at t=20; batch 2's timer counts from its own first arrival (t=30),
        // not from batch 1's (t=0): "closes at s or at t, never both".
        let mut p = policy(2, 1000, 2);
        arrive(&mut p, us(0), 1);
        arrive(&mut p, us(20), 2);
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1, 2], 2)]);
        arrive(&mut p, us(30), 3);
        assert_eq!(p.next_wakeup(), Some(us(1030)));
        p.tick(us(1000));
        assert!(drain(&mut p).is_empty());
        p.tick(us(1030));
        assert_eq!(drain(&mut p), vec![launch(1, 1, &[3], 1)]);
    }

    #[test]
    fn no_wait_launches_whatever_is_queued_when_a_worker_is_idle() {
        let mut p = policy(4, 0, 1);
        arrive(&mut p, us(0), 1);
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1], 1)]);
        // worker busy: requests accumulate up to s
        for id in 2..=7 {
            arrive(&mut p, us(id), id);
        }
        assert!(drain(&mut p).is_empty());
        assert_eq!(p.next_wakeup(), None, "no idle worker, nothing to wake for");
        p.task_done(us(50), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![ok(1), launch(1, 0, &[2, 3, 4, 5], 4)]);
        p.task_done(us(60), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![ok(2), ok(3), ok(4), ok(5), launch(2, 0, &[6, 7], 2)]);
    }

    #[test]
    fn full_batch_waits_for_a_worker_and_keeps_filling_only_to_s() {
        let mut p = policy(2, 100, 1);
        arrive(&mut p, us(0), 1);
        arrive(&mut p, us(1), 2);
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1, 2], 2)]);
        for id in 3..=5 {
            arrive(&mut p, us(id), id);
        }
        p.tick(us(500));
        assert!(drain(&mut p).is_empty(), "no worker idle");
        p.task_done(us(600), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![ok(1), ok(2), launch(1, 0, &[3, 4], 2)]);
        assert_eq!(p.queued(), 1);
        assert_eq!(p.running(), 2);
    }

    #[test]
    fn static_batching_pads_to_s() {
        let mut p = TimeoutPolicy::new(TimeoutConfig {
            max_batch: 4,
            max_wait: Duration::ZERO,
            workers: 1,
            pad_to_max: true,
        });
        arrive(&mut p, us(0), 9);
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[9], 4)]);
    }

    #[test]
    fn lowest_idle_worker_is_used_and_freed_workers_return() {
        let mut p = policy(1, 0, 3);
        for id in 0..3 {
            arrive(&mut p, us(id), id);
        }
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[0], 1), launch(1, 1, &[1], 1), launch(2, 2, &[2], 1)]);
        p.task_done(us(10), &TaskReport::of(1));
        arrive(&mut p, us(11), 3);
        assert_eq!(drain(&mut p), vec![ok(1), launch(3, 1, &[3], 1)]);
    }

    #[test]
    fn priority_orders_the_batch() {
        let mut p = policy(2, 0, 1);
        arrive(&mut p, us(0), 0); // occupies the worker
        drain(&mut p);
        p.arrive(us(1), Arrival { model: 0, id: 1, deadline: None, priority: 0, cells: None });
        p.arrive(us(2), Arrival { model: 0, id: 2, deadline: None, priority: 5, cells: None });
        p.arrive(us(3), Arrival { model: 0, id: 3, deadline: None, priority: 0, cells: None });
        p.arrive(us(4), Arrival { model: 0, id: 4, deadline: None, priority: 5, cells: None });
        p.task_done(us(5), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![ok(0), launch(1, 0, &[2, 4], 2)]);
    }

    #[test]
    fn queued_request_expires_at_its_deadline_without_running() {
        let mut p = policy(4, 1000, 1);
        p.arrive(us(0), Arrival { model: 0, id: 1, deadline: Some(us(300)), priority: 0, cells: None });
        arrive(&mut p, us(10), 2);
        assert_eq!(p.next_wakeup(), Some(us(300)));
        p.tick(us(300));
        assert_eq!(drain(&mut p), vec![Decision::Complete { id: 1, code: Code::DeadlineExceeded }]);
        // The batch timer now counts from request 2, the oldest left.
        assert_eq!(p.next_wakeup(), Some(us(1010)));
        p.tick(us(1010));
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[2], 1)]);
    }

    #[test]
    fn deadline_passing_while_running_completes_deadline_exceeded() {
        let mut p = policy(2, 0, 1);
        p.arrive(us(0), Arrival { model: 0, id: 1, deadline: Some(us(100)), priority: 0, cells: None });
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1], 1)]);
        assert_eq!(p.next_wakeup(), None, "running requests are checked at their boundary");
        p.task_done(us(100), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![Decision::Complete { id: 1, code: Code::DeadlineExceeded }]);
    }

    #[test]
    fn cancel_queued_completes_at_once_and_running_at_task_end() {
        let mut p = policy(2, 0, 1);
        arrive(&mut p, us(0), 1);
        assert_eq!(drain(&mut p), vec![launch(0, 0, &[1], 1)]);
        arrive(&mut p, us(1), 2);
        arrive(&mut p, us(2), 3);
        p.cancel(us(3), 2);
        assert_eq!(drain(&mut p), vec![Decision::Complete { id: 2, code: Code::Cancelled }]);
        p.cancel(us(4), 1);
        assert!(drain(&mut p).is_empty(), "running request waits for its boundary");
        p.cancel(us(4), 77); // unknown: ignored
        p.task_done(us(9), &TaskReport::of(0));
        assert_eq!(
            drain(&mut p),
            vec![Decision::Complete { id: 1, code: Code::Cancelled }, launch(1, 0, &[3], 1)]
        );
        p.task_done(us(12), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![ok(3)]);
        assert_eq!((p.queued(), p.running()), (0, 0));
        p.cancel(us(13), 3); // already complete: ignored
        assert!(drain(&mut p).is_empty());
    }

    #[test]
    fn cancelled_front_does_not_hold_the_timer() {
        let mut p = policy(4, 1000, 1);
        arrive(&mut p, us(0), 1);
        arrive(&mut p, us(500), 2);
        p.cancel(us(600), 1);
        drain(&mut p);
        assert_eq!(p.next_wakeup(), Some(us(1500)));
    }
}
