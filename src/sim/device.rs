//! The simulator's shared device ([`CostModel::shared_device`]: a GPU whose workers' streams
//! run at once). Every running task progresses at the same rate, one step of work per
//! `t(Σ rows)` (the batch the running tasks make together), so tasks started together end
//! together, as one batch of their summed rows would: E²bird's equal-share model, each task at
//! rate `t(b_w)/t(Σb)` in its own time. Whenever a task starts or ends, the running set's next
//! end is predicted again under a new generation; ends predicted under an older one are stale.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::CostModel;
use crate::error::{Error, Result};
use crate::sched::{TaskId, Time, WorkerId};

/// A task on the shared device.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shared {
    pub task: TaskId,
    rows: usize,
    cell: &'static str,
    /// Work left, in steps (its steps when it starts).
    left: f64,
    pub started: Time,
}

/// When the running set is predicted to end next, and under which generation.
pub(super) type NextEnd = Option<(Time, u64)>;

#[derive(Debug)]
pub(super) struct Device {
    /// Launched tasks that have not reached their worker yet (the launch delay), by id.
    reaching: BTreeMap<TaskId, (WorkerId, Shared)>,
    /// Per worker: tasks reached and waiting for the one before, in order.
    waiting: Vec<VecDeque<Shared>>,
    /// Per worker: its running task.
    running: Vec<Option<Shared>>,
    /// `t(Σ rows)` of the running set, in seconds (0 when nothing runs), and when it last
    /// changed.
    batch_time: f64,
    last: Time,
    generation: u64,
}

impl Device {
    pub fn new(workers: usize) -> Device {
        Device {
            reaching: BTreeMap::new(),
            waiting: vec![VecDeque::new(); workers],
            running: vec![None; workers],
            batch_time: 0.0,
            last: Time::ZERO,
            generation: 0,
        }
    }

    /// Task `task` of `rows` rows (padding included) and `steps` steps of cell type `cell` was
    /// launched on `worker`; it reaches the worker at the `reach` event.
    pub fn launch(&mut self, task: TaskId, worker: WorkerId, rows: usize, steps: u32, cell: &'static str) {
        let s = Shared { task, rows, cell, left: f64::from(steps.max(1)), started: Time::ZERO };
        self.reaching.insert(task, (worker, s));
    }

    /// `task` reached its worker at `now`: the next end to put on the heap, if anything runs.
    pub fn reach(&mut self, now: Time, task: TaskId, cost: &dyn CostModel) -> Result<NextEnd> {
        let Some((worker, s)) = self.reaching.remove(&task) else { return Ok(None) };
        self.advance(now);
        self.waiting[worker].push_back(s);
        self.reschedule(now, cost)
    }

    /// The end predicted under `generation` came at `now`: the tasks that ended (none if the
    /// prediction is stale), and the next end.
    pub fn end(
        &mut self,
        now: Time,
        generation: u64,
        cost: &dyn CostModel,
    ) -> Result<(Vec<Shared>, NextEnd)> {
        if generation != self.generation {
            return Ok((Vec::new(), None));
        }
        self.advance(now);
        // Done: less than a nanosecond of work left (the clock's resolution; rounding must not
        // leave a sliver that would end "now" again and again).
        let t = self.batch_time;
        let ended: Vec<Shared> = self
            .running
            .iter_mut()
            .filter(|s| s.is_some_and(|s| s.left * t < 1e-9))
            .filter_map(Option::take)
            .collect();
        Ok((ended, self.reschedule(now, cost)?))
    }

    /// Every running task's progress up to `now` (the running set has not changed since `last`).
    fn advance(&mut self, now: Time) {
        if self.batch_time > 0.0 {
            let done = now.since(self.last).as_secs_f64() / self.batch_time;
            for s in self.running.iter_mut().flatten() {
                s.left -= done;
            }
        }
        self.last = now;
    }

    /// Start waiting tasks on idle workers, take `t(Σ rows)` of the running set (of the cell type
    /// of its widest task, when they differ), and predict its next end under a new generation.
    fn reschedule(&mut self, now: Time, cost: &dyn CostModel) -> Result<NextEnd> {
        for (run, wait) in self.running.iter_mut().zip(&mut self.waiting) {
            if run.is_none()
                && let Some(mut s) = wait.pop_front()
            {
                s.started = now;
                *run = Some(s);
            }
        }
        self.generation += 1;
        let running = || self.running.iter().flatten();
        self.batch_time = match running().max_by_key(|s| s.rows) {
            None => 0.0,
            Some(widest) => {
                let rows = running().map(|s| s.rows).sum();
                let t = cost.task_time(widest.cell, rows).ok_or_else(|| {
                    Error::invalid(format!("the cost model has no time for cell type `{}`", widest.cell))
                })?;
                t.as_secs_f64().max(1e-12)
            }
        };
        let first = running().map(|s| s.left.max(0.0)).min_by(f64::total_cmp);
        // At least a nanosecond on: time always advances.
        Ok(first.map(|left| {
            (
                now + Duration::from_secs_f64(left * self.batch_time).max(Duration::from_nanos(1)),
                self.generation,
            )
        }))
    }
}
