//! Admission control of one model: which submits are accepted, and which are refused `Busy` at
//! once, before they reach a queue.
//!
//! Two limits apply (ARCHITECTURE.md §3.1):
//! * **The admission bound** — at most `bound` requests accepted whose results the caller has
//!   not taken yet. A request holds its place through a [`Permit`] that travels with its result
//!   and is released when the caller takes it: a ticket waited for, a completion dropped (C:
//!   `serve_completion_free`). So results a slow consumer leaves in its queue count too, and the
//!   memory a model's requests hold, queued, running or done, stays bounded.
//! * **Deadline-aware shedding** — a request with a deadline is refused when the work already
//!   accepted would not finish before it. Under overload a queue that only grows makes every
//!   request late; refusing the requests that cannot make it keeps the admitted ones within
//!   their deadlines and tells the rest at once (a server answers 503 and the client retries
//!   elsewhere) instead of after their deadline.
//!
//! The estimate: the work ahead is counted in *rows* (a fixed-shape request is one row; a
//! recurrent request one row per cell of its graph as submitted), and the time one row takes
//! is measured on the model's own tasks: a moving average of the time a task held its worker
//! (the engine's busy time, which includes the turn-around between back-to-back tasks) divided
//! by its real rows, so it follows the batch sizes the load produces (large batches
//! under overload make a row cheap). The wait for a new request is then
//! `(rows ahead + its rows) × time per row ÷ workers`, plus one task (the batch it ends up in
//! runs whole), and it is admitted if that takes at most 70% of its time to its deadline (the
//! rest absorbs the estimate's error: task times vary with the batches formed and the load).
//! Until a first task has been measured nothing is refused for its deadline, nor is a request
//! that finds no work ahead of it; a sample is taken at most at four times the
//! average, so one hiccup (a preempted thread, a page fault storm) moves the estimate little.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::recycle::Recycler;
use crate::error::{Code, Error, Result};

/// Weight of a new task in the moving averages: 1/8.
const EWMA_SHIFT: u32 = 3;
/// The share of a request's time to its deadline the expected wait may take.
const SPARE: f64 = 0.7;

/// Fold `sample` into the moving average `avg` (0: none yet). One writer (the engine).
fn average(avg: &AtomicU64, sample: u64) {
    let old = avg.load(Ordering::Relaxed);
    let sample = if old == 0 { sample } else { sample.min(old.saturating_mul(4)) };
    let new = if old == 0 { sample } else { old - (old >> EWMA_SHIFT) + (sample >> EWMA_SHIFT) };
    avg.store(new.max(1), Ordering::Relaxed);
}

pub(crate) struct Admission {
    bound: usize,
    /// The allocations the model's requests hand back for reuse (recycle.rs): a request holds
    /// at most one of each, under the same bound.
    recycle: Recycler,
    workers: u64,
    /// Requests accepted whose permits are not yet released.
    admitted: AtomicUsize,
    /// Rows of the accepted requests not yet completed (the work ahead).
    rows: AtomicU64,
    /// The moving average of one row's time on a worker, in picoseconds (0: not measured yet).
    row_ps: AtomicU64,
    /// The moving average of a task's time, in nanoseconds.
    task_ns: AtomicU64,
}

impl Admission {
    pub(crate) fn new(bound: usize, workers: usize, recycle: Recycler) -> Admission {
        Admission {
            bound,
            recycle,
            workers: workers.max(1) as u64,
            admitted: AtomicUsize::new(0),
            rows: AtomicU64::new(0),
            row_ps: AtomicU64::new(0),
            task_ns: AtomicU64::new(0),
        }
    }

    pub(crate) fn recycler(&self) -> &Recycler {
        &self.recycle
    }

    /// The most requests admitted at once.
    pub(crate) fn bound(&self) -> usize {
        self.bound
    }

    pub(crate) fn admitted(&self) -> usize {
        self.admitted.load(Ordering::Acquire)
    }

    /// Accept a request of `rows` rows due by `deadline` (if any), or refuse it `Busy` naming
    /// `model`. An accepted request's rows are released by [`finished`](Self::finished) when it
    /// completes, its place by the returned permit's drop.
    pub(crate) fn admit(
        self: &Arc<Self>,
        model: &str,
        rows: u64,
        deadline: Option<Instant>,
        now: Instant,
    ) -> Result<Permit> {
        let prev = self.admitted.fetch_add(1, Ordering::AcqRel);
        if prev >= self.bound {
            self.admitted.fetch_sub(1, Ordering::AcqRel);
            return Err(Error::new(
                Code::Busy,
                format!(
                    "model `{model}` has {} requests pending (its admission bound); retry later",
                    self.bound
                ),
            ));
        }
        let permit = Permit(self.clone());
        let ahead = self.rows.fetch_add(rows, Ordering::AcqRel);
        // A request with no work ahead is never refused for its deadline: its task then measures
        // the time per row afresh, so an estimate inflated by a hiccup cannot shut the model out.
        let Some(deadline) = deadline.filter(|_| ahead > 0) else { return Ok(permit) };
        let wait = self.expected_wait(ahead.saturating_add(rows));
        let budget = deadline.saturating_duration_since(now);
        if wait > budget.mul_f64(SPARE) {
            self.finished(rows); // and the permit's drop gives the place back
            return Err(Error::new(
                Code::Busy,
                format!(
                    "model `{model}` has about {:.1} ms of work queued ({prev} requests), more than the {:.1} ms \
                     left before the request's deadline; retry later",
                    wait.as_secs_f64() * 1e3,
                    budget.as_secs_f64() * 1e3
                ),
            ));
        }
        Ok(permit)
    }

    /// A request of `rows` rows accepted by [`admit`](Self::admit) has completed: its work is no
    /// longer ahead of anyone (its place is held until its permit goes).
    pub(crate) fn finished(&self, rows: u64) {
        self.rows.fetch_sub(rows, Ordering::AcqRel);
    }

    /// A task of `rows` real rows held its worker for `busy` (engine thread only).
    pub(crate) fn observe_task(&self, busy: Duration, rows: usize) {
        if rows == 0 {
            return;
        }
        let ns = u64::try_from(busy.as_nanos()).unwrap_or(u64::MAX);
        average(&self.row_ps, ns.saturating_mul(1000) / rows as u64);
        average(&self.task_ns, ns);
    }

    /// How long until `rows` rows are done on the model's workers, by the current estimate:
    /// their share of the workers' time, and the task the last of them runs in.
    fn expected_wait(&self, rows: u64) -> Duration {
        let ps =
            u128::from(self.row_ps.load(Ordering::Relaxed)) * u128::from(rows) / u128::from(self.workers);
        let ns = u64::try_from(ps / 1000).unwrap_or(u64::MAX);
        Duration::from_nanos(ns.saturating_add(self.task_ns.load(Ordering::Relaxed)))
    }
}

/// A request's place under its model's admission bound, released on drop (see the module docs).
pub(crate) struct Permit(Arc<Admission>);

impl Permit {
    /// Where the request's allocations go back to (its model's recycler).
    pub(crate) fn recycler(&self) -> &Recycler {
        &self.0.recycle
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.admitted.fetch_sub(1, Ordering::AcqRel);
    }
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Permit")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_refuses_busy_and_completions_free_room() {
        let a = Arc::new(Admission::new(2, 1, Recycler::none()));
        let now = Instant::now();
        let first = a.admit("m", 1, None, now).unwrap();
        let _second = a.admit("m", 1, None, now).unwrap();
        let e = a.admit("m", 1, None, now).unwrap_err();
        assert_eq!(e.code(), Code::Busy);
        assert!(e.message().contains("admission bound"), "{e}");
        // Completing is not enough: the place is the permit's until the caller takes the result.
        a.finished(1);
        assert!(a.admit("m", 1, None, now).is_err());
        drop(first);
        let _third = a.admit("m", 1, None, now).unwrap();
        assert_eq!(a.admitted(), 2);
    }

    #[test]
    fn deadlines_the_queued_work_cannot_meet_are_refused_at_once() {
        let a = Arc::new(Admission::new(1000, 2, Recycler::none()));
        let now = Instant::now();
        let in_ms = |ms| Some(now + Duration::from_millis(ms));
        // Unmeasured: nothing refused for its deadline.
        let mut held: Vec<Permit> = (0..10).map(|_| a.admit("m", 1, in_ms(1), now).unwrap()).collect();
        // 1 ms per row on a worker, two workers, 4 ms a task: the 10 rows ahead and its own
        // take 5.5 ms, plus 4 ms for its task: 9.5 ms, which must fit in 70% of its budget.
        a.observe_task(Duration::from_millis(4), 4);
        let e = a.admit("m", 1, in_ms(13), now).unwrap_err();
        assert_eq!(e.code(), Code::Busy);
        assert!(e.message().contains("deadline") && e.message().contains("9.5 ms"), "{e}");
        assert_eq!(a.admitted(), 10, "a refused request holds nothing");
        held.push(a.admit("m", 1, in_ms(14), now).unwrap());
        held.push(a.admit("m", 1, None, now).unwrap()); // no deadline: only the bound applies
        // A recurrent request of 20 rows: (12 + 20) / 2 + 4 = 20 ms.
        assert!(a.admit("m", 20, in_ms(28), now).is_err());
        held.push(a.admit("m", 20, in_ms(29), now).unwrap());
        // Completions shorten the wait: (22 + 1) / 2 + 4 = 15.5 ms.
        for _ in 0..10 {
            a.finished(1);
        }
        held.push(a.admit("m", 1, in_ms(23), now).unwrap());
        assert_eq!(a.admitted(), 14);
    }

    #[test]
    fn an_idle_model_admits_and_one_hiccup_moves_the_estimate_little() {
        let a = Arc::new(Admission::new(100, 1, Recycler::none()));
        let now = Instant::now();
        let soon = Some(now + Duration::from_millis(1));
        a.observe_task(Duration::from_micros(10), 1);
        a.observe_task(Duration::from_secs(10), 1); // a hiccup: counted as 40 µs at most
        // (10 + (40 - 10) / 8) µs a row, and as much for the task: 2 × 13.75 µs for one row.
        assert_eq!(a.expected_wait(1), Duration::from_nanos(2 * 13_750));
        // Even with a deadline it could not meet, a request finding nothing ahead is admitted.
        a.observe_task(Duration::from_secs(1), 1);
        let _p = a.admit("m", 1, soon, now).unwrap();
        assert_eq!(a.admit("m", 1000, soon, now).unwrap_err().code(), Code::Busy);
    }

    #[test]
    fn the_time_per_row_follows_the_batches_the_load_forms() {
        let a = Arc::new(Admission::new(10, 1, Recycler::none()));
        a.observe_task(Duration::from_micros(100), 1); // 100 µs a row at batch 1
        for _ in 0..100 {
            a.observe_task(Duration::from_micros(320), 32); // 10 µs a row at batch 32
        }
        let per_row = a.expected_wait(1000).as_secs_f64() / 1000.0;
        assert!((per_row - 10e-6).abs() < 0.5e-6, "{per_row}");
    }
}
