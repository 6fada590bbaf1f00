//! Runtime counters, updated lock-free and read as a snapshot.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use crate::error::Code;

#[derive(Debug, Default)]
pub(crate) struct Stats {
    submitted: AtomicU64,
    rejected: AtomicU64,
    completed: [AtomicU64; Code::ALL.len()],
    queued: AtomicU64,
    running: AtomicU64,
    tasks: AtomicU64,
    batched: AtomicU64,
    compute_ns: AtomicU64,
    timed_tasks: AtomicU64,
    ring_copies: AtomicU64,
    gather_copies: AtomicU64,
    engine_busy_ns: AtomicU64,
    leased_tasks: AtomicU64,
    lease_conflicts: AtomicU64,
    leased_core_ns: AtomicU64,
}

/// A snapshot of a runtime's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Requests accepted by submit.
    pub submitted: u64,
    /// Submits refused synchronously (invalid input, BUSY, shutdown, deadline already passed).
    pub rejected: u64,
    /// Completed requests, indexed by `Code as usize`.
    pub completed: [u64; Code::ALL.len()],
    /// Requests in a policy not yet started (no part launched on a backend).
    pub queued: u64,
    /// Requests started on a backend and not yet complete (a recurrent request counts from its
    /// first cell to its completion).
    pub running: u64,
    /// Batched tasks launched on a backend.
    pub tasks_launched: u64,
    /// Requests carried by those tasks (padding rows not counted).
    pub batched_requests: u64,
    /// Compute time the backends measured of finished tasks (`TaskReport::compute`), in
    /// nanoseconds, and how many tasks it covers (the CPU backend times every task on its
    /// thread, the CUDA backend every task with events on its stream).
    pub task_compute_ns: u64,
    pub timed_tasks: u64,
    /// Fixed-shape inputs copied into their model's input ring at arrival (elastic batching:
    /// one per request), read in place by their task.
    pub ring_copies: u64,
    /// Rows copied into a batch's input at launch (every fixed-shape policy but elastic
    /// batching; under it only a run holding a cancelled request's slot is gathered).
    pub gather_copies: u64,
    /// Time the engine thread spent working (handling events, deciding, launching — on the CUDA
    /// backend a launch is the thread's own launch calls — and delivering completions), in
    /// nanoseconds; the rest of the time it was parked. Its growth over a wall-clock interval
    /// is the thread's utilization: near 1, the engine thread is the bottleneck
    /// (ARCHITECTURE.md §3.3).
    pub engine_busy_ns: u64,
    /// Tasks that ran on a core lease (the tenant mode's layer blocks), those of them started
    /// in a core conflict (on fewer cores than their block asked for, `sched::Exec::conflict`),
    /// and the leased core-time of the finished ones (cores × compute time, nanoseconds): over
    /// a wall-clock interval, its growth is the mean cores in use.
    pub leased_tasks: u64,
    pub lease_conflicts: u64,
    pub leased_core_ns: u64,
}

impl StatsSnapshot {
    pub fn completed(&self, code: Code) -> u64 {
        self.completed[code as usize]
    }
    pub fn completed_total(&self) -> u64 {
        self.completed.iter().sum()
    }
    /// Mean requests per launched task (0 before the first task).
    pub fn mean_batch(&self) -> f64 {
        if self.tasks_launched == 0 { 0.0 } else { self.batched_requests as f64 / self.tasks_launched as f64 }
    }
    /// Mean compute time of a timed task, if any was timed.
    pub fn mean_task_compute(&self) -> Option<std::time::Duration> {
        (self.timed_tasks > 0)
            .then(|| std::time::Duration::from_nanos(self.task_compute_ns / self.timed_tasks))
    }
    /// Accepted and not completed yet.
    pub fn in_flight(&self) -> u64 {
        self.submitted.saturating_sub(self.completed_total())
    }
}

impl Stats {
    pub(crate) fn record_submit(&self) {
        self.submitted.fetch_add(1, Relaxed);
    }
    pub(crate) fn record_reject(&self) {
        self.rejected.fetch_add(1, Relaxed);
    }
    pub(crate) fn record_completion(&self, code: Code) {
        self.completed[code as usize].fetch_add(1, Relaxed);
    }
    pub(crate) fn record_task(&self, requests: usize) {
        self.tasks.fetch_add(1, Relaxed);
        self.batched.fetch_add(requests as u64, Relaxed);
    }
    pub(crate) fn record_compute(&self, compute: std::time::Duration) {
        self.compute_ns.fetch_add(u64::try_from(compute.as_nanos()).unwrap_or(u64::MAX), Relaxed);
        self.timed_tasks.fetch_add(1, Relaxed);
    }
    pub(crate) fn record_ring_copy(&self) {
        self.ring_copies.fetch_add(1, Relaxed);
    }
    pub(crate) fn record_gather(&self, rows: usize) {
        self.gather_copies.fetch_add(rows as u64, Relaxed);
    }
    pub(crate) fn record_turn(&self, busy: std::time::Duration) {
        self.engine_busy_ns.fetch_add(u64::try_from(busy.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }
    pub(crate) fn record_lease(&self, conflict: bool) {
        self.leased_tasks.fetch_add(1, Relaxed);
        self.lease_conflicts.fetch_add(u64::from(conflict), Relaxed);
    }
    pub(crate) fn record_leased_time(&self, cores: usize, compute: std::time::Duration) {
        let ns = u64::try_from(compute.as_nanos()).unwrap_or(u64::MAX).saturating_mul(cores as u64);
        self.leased_core_ns.fetch_add(ns, Relaxed);
    }
    pub(crate) fn set_gauges(&self, queued: usize, running: usize) {
        self.queued.store(queued as u64, Relaxed);
        self.running.store(running as u64, Relaxed);
    }
    pub(crate) fn snapshot(&self) -> StatsSnapshot {
        StatsSnapshot {
            submitted: self.submitted.load(Relaxed),
            rejected: self.rejected.load(Relaxed),
            completed: std::array::from_fn(|i| self.completed[i].load(Relaxed)),
            queued: self.queued.load(Relaxed),
            running: self.running.load(Relaxed),
            tasks_launched: self.tasks.load(Relaxed),
            batched_requests: self.batched.load(Relaxed),
            task_compute_ns: self.compute_ns.load(Relaxed),
            timed_tasks: self.timed_tasks.load(Relaxed),
            ring_copies: self.ring_copies.load(Relaxed),
            gather_copies: self.gather_copies.load(Relaxed),
            engine_busy_ns: self.engine_busy_ns.load(Relaxed),
            leased_tasks: self.leased_tasks.load(Relaxed),
            lease_conflicts: self.lease_conflicts.load(Relaxed),
            leased_core_ns: self.leased_core_ns.load(Relaxed),
        }
    }
}
