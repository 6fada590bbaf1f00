//! Adaptive batching with asynchronous transfers (Zhang et al., slides "…Scheduling Algorithm
//! with Asynchronous Data Transfer"), as a sans-IO state machine; [`model`] holds its latency
//! model.
//!
//! * **Fit.** After every task, each stage's cost `T_s(b) = k_s·b + c_s` (upload, compute,
//!   download, from the driver's [`TaskReport`]) is refitted by least squares over the last
//!   `window` tasks (W = 8). A stage the backend does not report (no transfers on the CPU) costs
//!   nothing. Before two batch sizes differ the slope is unseen and kept (0 at first): the
//!   slides' two initial batches "of different sizes" (1 and B_cap here) would hold the second
//!   request back until B_cap arrive at low load, so the sizes come from the load instead.
//! * **Concurrency.** At every close `C ← b / fill time`, the fill time running from the previous
//!   close to the arrival of the batch's last request (close path (a)) or to now (path (b)). A
//!   backlog fills a batch at once: `C` is then unbounded and `b` = `max_batch`, which drains it
//!   (an estimate of the arrival rate alone would keep `b` where the backlog grew).
//! * **Batch size.** `b = clamp(⌈b*(C)⌉, 1, max_batch)`; when `b*(C)` exceeds `b_max(L)` (or `C`
//!   is at or past the capacity) the latency bound is infeasible: flagged, and `b*(C)` kept
//!   (clamped), as the slides show batch size and latency rising at a peak.
//! * **Closing.** The open batch closes (a) as soon as `b` requests wait, or (b) at
//!   `t_close` = the predicted end of the running compute − `T_up(b)`, with the smaller `b'`
//!   that has gathered, so that its upload lands as the compute ends; with nothing running,
//!   `t_close` is now (the device never idles while requests wait). `t_close` is the policy's
//!   [`next_wakeup`](Policy::next_wakeup).
//! * **Streams.** `Async`: two tasks out per worker (one computing, the next uploaded);
//!   `Serial`: one (the slides' baseline, the same server run on one stream).
//!
//! Requests are served in arrival order. Deadlines and cancel: a waiting request completes at
//! once; a launched one at its task's end.

pub mod model;
#[cfg(test)]
mod tests;

use std::collections::VecDeque;
use std::time::Duration;

use crate::error::{Code, Error, Result};
use crate::sched::book::Book;
use crate::sched::{
    Arrival, Decision, IdTable, Policy, RequestId, TaskId, TaskReport, TaskShape, Time, WorkerShape,
};

pub use model::{Formula, Linear, StageFit, Stages, Streams};

/// Configuration of [`AdaptivePolicy`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveConfig {
    /// `L`: the latency bound the batch size is chosen for.
    pub latency_bound: Duration,
    /// `B_cap`: the largest batch.
    pub max_batch: usize,
    pub streams: Streams,
    pub formula: Formula,
    /// Tasks each stage's fit is taken over (W).
    pub window: usize,
}

impl Default for AdaptiveConfig {
    fn default() -> Self {
        AdaptiveConfig {
            latency_bound: Duration::from_millis(100),
            max_batch: 32,
            streams: Streams::Async,
            // The slides' formula swings under steady load (tests: paper vs exact).
            formula: Formula::Exact,
            window: 8,
        }
    }
}

impl AdaptiveConfig {
    pub fn check(&self) -> Result<()> {
        if self.latency_bound.is_zero() {
            return Err(Error::invalid("the adaptive policy's latency bound must be positive"));
        }
        if self.max_batch == 0 {
            return Err(Error::invalid("the adaptive policy's max batch must be at least 1"));
        }
        if !(2..=1024).contains(&self.window) {
            return Err(Error::invalid(format!("fit window {}: must be 2 to 1024 tasks", self.window)));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Entry {
    arrived: Time,
    deadline: Option<Time>,
    task: Option<TaskId>,
    cancelled: bool,
}

#[derive(Debug)]
struct Running {
    task: TaskId,
    rows: usize,
    launched: Time,
    requests: Vec<RequestId>,
}

/// Adaptive batching on a latency model. See the module documentation.
#[derive(Debug)]
pub struct AdaptivePolicy {
    cfg: AdaptiveConfig,
    book: Book,
    requests: IdTable<Entry>,
    /// Waiting requests in arrival order (ids that left are skipped).
    queue: VecDeque<RequestId>,
    /// Launched tasks in launch order (the worker runs them in order).
    running: VecDeque<Running>,
    fits: [StageFit; 3],
    /// The last close: the open batch has been filling since.
    last_close: Option<Time>,
    /// C, requests per second (0 before the second close; infinite after a batch filled at
    /// once).
    rate: f64,
    infeasible: bool,
    infeasible_closes: u64,
}

impl AdaptivePolicy {
    pub fn new(cfg: AdaptiveConfig) -> Result<AdaptivePolicy> {
        cfg.check()?;
        Ok(AdaptivePolicy {
            book: Book::default(),
            requests: IdTable::default(),
            queue: VecDeque::new(),
            running: VecDeque::new(),
            fits: std::array::from_fn(|_| StageFit::new(cfg.window)),
            last_close: None,
            rate: 0.0,
            infeasible: false,
            infeasible_closes: 0,
            cfg,
        })
    }

    pub fn config(&self) -> &AdaptiveConfig {
        &self.cfg
    }

    /// The fitted stage costs (zero for a stage never measured).
    pub fn stages(&self) -> Stages {
        let f = |i: usize| self.fits[i].fit().unwrap_or_default();
        Stages { up: f(0), calc: f(1), down: f(2) }
    }

    /// C: the concurrency estimated at the last close, requests per second (infinite when the
    /// batch filled at once: a backlog).
    pub fn concurrency(&self) -> f64 {
        self.rate
    }

    /// The batch size the open batch closes at.
    pub fn batch_target(&self) -> usize {
        let b = self.stages().batch_for(self.rate, self.cfg.streams, self.cfg.formula);
        if b.is_finite() { (b.ceil() as usize).clamp(1, self.cfg.max_batch) } else { self.cfg.max_batch }
    }

    /// Whether the latency bound was infeasible at the last close (C at or beyond what the
    /// bound allows); the batch is still served.
    pub fn infeasible(&self) -> bool {
        self.infeasible
    }

    /// Closes at which the bound was infeasible.
    pub fn infeasible_closes(&self) -> u64 {
        self.infeasible_closes
    }

    fn lookahead_tasks(&self) -> usize {
        match self.cfg.streams {
            Streams::Serial => 1,
            Streams::Async => 2,
        }
    }

    /// When the last launched task's compute is predicted to end (tasks upload in launch order
    /// and compute one after another).
    fn compute_end(&self) -> Option<Time> {
        let s = self.stages();
        let mut end: Option<Time> = None;
        for r in &self.running {
            let landed = r.launched + secs(s.up.at(r.rows as f64));
            let start = end.map_or(landed, |e| e.max(landed));
            end = Some(start + secs(s.calc.at(r.rows as f64)));
        }
        end
    }

    /// `t_close`: the upload of a batch of `b` closed then lands as the running compute ends.
    fn close_at(&self, b: usize) -> Option<Time> {
        if self.running.len() >= self.lookahead_tasks() {
            return None;
        }
        let up = secs(self.stages().up.at(b as f64));
        Some(self.compute_end().map_or(Time(0), |end| Time(end.0.saturating_sub(up.as_nanos() as u64))))
    }

    fn tidy(&mut self) {
        let requests = &self.requests;
        while let Some(id) = self.queue.front() {
            if requests.get(id).is_some_and(|e| e.task.is_none()) {
                break;
            }
            self.queue.pop_front();
        }
        self.book.tidy(|id| requests.get(&id).is_some_and(|e| e.task.is_none()));
    }

    fn finish_waiting(&mut self, id: RequestId, code: Code) {
        if self.requests.remove(&id).is_some() {
            self.book.complete(id, code, false);
        }
    }

    fn dispatch(&mut self, now: Time) {
        while let Some(id) = self.book.due(now, |id| self.requests.get(&id).is_some_and(|e| e.task.is_none()))
        {
            self.finish_waiting(id, Code::DeadlineExceeded);
        }
        self.tidy();
        while self.book.queued() > 0 {
            let b = self.batch_target();
            let full = self.book.queued() >= b;
            let due = self.close_at(b).is_some_and(|t| t <= now);
            if !(full || due) || self.running.len() >= self.lookahead_tasks() {
                break;
            }
            self.close(now, b.min(self.book.queued()), full);
        }
    }

    /// Close the open batch with `n` requests (`full`: it reached the batch size; otherwise
    /// `t_close` came first): C updated from its fill time, the bound's feasibility checked,
    /// the task launched.
    fn close(&mut self, now: Time, n: usize, full: bool) {
        let task = self.book.task_id();
        let mut ids = Vec::with_capacity(n);
        let mut last_arrival = now;
        while ids.len() < n {
            let Some(id) = self.queue.pop_front() else { break };
            if let Some(e) = self.requests.get_mut(&id)
                && e.task.is_none()
            {
                e.task = Some(task);
                last_arrival = e.arrived;
                ids.push(id);
            }
        }
        if let Some(opened) = self.last_close {
            let filled = if full { last_arrival.max(opened) } else { now };
            let fill = filled.since(opened).as_secs_f64();
            self.rate = if fill > 0.0 { ids.len() as f64 / fill } else { f64::INFINITY };
        }
        self.last_close = Some(now);
        let s = self.stages();
        let want = s.batch_for(self.rate, self.cfg.streams, self.cfg.formula);
        self.infeasible = want > s.max_batch_within(self.cfg.latency_bound, self.cfg.streams);
        self.infeasible_closes += u64::from(self.infeasible);
        self.book.start(ids.len());
        let rows = ids.len();
        self.running.push_back(Running { task, rows, launched: now, requests: ids.clone() });
        self.book.launch(task, 0, TaskShape::Dense, ids, rows);
        self.tidy();
    }
}

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s.clamp(0.0, 1e6))
}

impl Policy for AdaptivePolicy {
    fn workers(&self) -> Vec<WorkerShape> {
        WorkerShape::uniform(1, self.cfg.max_batch)
    }

    fn lookahead(&self) -> usize {
        self.lookahead_tasks()
    }

    fn reserve(&mut self, requests: usize) {
        let held = self.book.reserve(requests);
        self.requests.reserve_for(held);
    }

    fn arrive(&mut self, now: Time, req: Arrival) {
        let entry = Entry { arrived: now, deadline: req.deadline, task: None, cancelled: false };
        let previous = self.requests.insert(req.id, entry);
        assert!(previous.is_none(), "request {} arrived twice", req.id);
        self.queue.push_back(req.id);
        self.book.arrive(req.model, req.deadline, req.id);
        self.dispatch(now);
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        match self.requests.get_mut(&id) {
            Some(e) if e.task.is_none() => {
                self.finish_waiting(id, Code::Cancelled);
                self.tidy();
            }
            Some(e) => e.cancelled = true,
            None => {}
        }
        self.dispatch(now);
    }

    fn task_done(&mut self, now: Time, report: &TaskReport) {
        let at =
            self.running.iter().position(|r| r.task == report.task).expect("task_done for an unknown task");
        let r = self.running.remove(at).expect("found above");
        for (fit, took) in self.fits.iter_mut().zip([report.upload, report.compute, report.download]) {
            if let Some(took) = took {
                fit.observe(r.rows, took);
            }
        }
        for id in r.requests {
            let e = self.requests.remove(&id).expect("running request is known");
            self.book.finish_running(id, e.cancelled, e.deadline, now);
        }
        self.dispatch(now);
    }

    fn end_early(&mut self, _now: Time, _id: RequestId) {
        // A fixed-shape request ends with its only task.
    }

    fn tick(&mut self, now: Time) {
        self.dispatch(now);
    }

    fn poll(&mut self) -> Option<Decision> {
        self.book.poll()
    }

    fn next_wakeup(&self) -> Option<Time> {
        let close = if self.book.queued() > 0 { self.close_at(self.batch_target()) } else { None };
        close.into_iter().chain(self.book.next_deadline()).min()
    }

    fn queued(&self) -> usize {
        self.book.queued()
    }

    fn running(&self) -> usize {
        self.book.running()
    }
}
