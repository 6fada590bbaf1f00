//! The simulator's shared device: workers whose streams run at once on one resource, each
//! task's speed set by what runs beside it. Two kinds ([`Share`]):
//!
//! * a GPU ([`CostModel::shared_device`]): every running task progresses at the same rate, one
//!   step of work per `t(Σ rows)` (the batch the running tasks make together), so tasks started
//!   together end together, as one batch of their summed rows would: E²bird's equal-share
//!   model, each task at rate `t(b_w)/t(Σb)` in its own time;
//! * CPU cores ([`CostModel::cores`]): a task's work is its solo time, and while the running
//!   tasks want more threads than there are cores (`Σ c > C`) each progresses at `C / Σ c` of
//!   its solo speed, the cores shared evenly among the threads (what they share beyond the
//!   cores, caches and memory bandwidth, is not modelled).
//!
//! A task that starts on a worker idle before it is longer by one step's cold start
//! ([`CostModel::idle_factor`]). Whenever a task starts or ends, the running set's next end is
//! predicted again under a new generation; ends predicted under an older one are stale.

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use super::CostModel;
use super::cost::time_of;
use crate::error::Result;
use crate::sched::{TaskId, Time, WorkerId};

/// How the running tasks share the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Share {
    /// A GPU: all at the rate of one batch of their summed rows.
    Batch,
    /// This many CPU cores, shared evenly among the running tasks' threads.
    Cores(usize),
}

/// A task on the shared device.
#[derive(Clone, Copy, Debug)]
pub(super) struct Shared {
    pub task: TaskId,
    rows: usize,
    cell: &'static str,
    /// Work left, in units of the [`Share`]: steps (a GPU), seconds of solo time (CPU cores).
    left: f64,
    /// One step's work, in the same units (a cold start costs a share of it).
    step: f64,
    /// Threads it runs on (CPU cores).
    threads: usize,
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
    /// Per worker: when its last task ended (it has been idle since, unless one runs).
    free_since: Vec<Time>,
    share: Share,
    /// Seconds one unit of work takes in the running set (a GPU: `t(Σ rows)`; CPU cores: the
    /// slowdown; 0 when nothing runs), and when the set last changed.
    unit_time: f64,
    last: Time,
    generation: u64,
}

impl Device {
    pub fn new(workers: usize, share: Share) -> Device {
        Device {
            reaching: BTreeMap::new(),
            waiting: vec![VecDeque::new(); workers],
            running: vec![None; workers],
            free_since: vec![Time::ZERO; workers],
            share,
            unit_time: 0.0,
            last: Time::ZERO,
            generation: 0,
        }
    }

    /// Task `task` of `rows` rows (padding included) and `steps` steps of cell type `cell` was
    /// launched on `worker`; it reaches the worker at the `reach` event.
    pub fn launch(
        &mut self,
        task: TaskId,
        worker: WorkerId,
        (rows, steps, cell): (usize, u32, &'static str),
        cost: &dyn CostModel,
    ) -> Result<()> {
        let steps = f64::from(steps.max(1));
        let (step, threads) = match self.share {
            Share::Batch => (1.0, 1),
            Share::Cores(cores) => {
                (time_of(cost, cell, rows)?.as_secs_f64(), cost.task_cores(cell, rows).clamp(1, cores.max(1)))
            }
        };
        let s = Shared { task, rows, cell, left: step * steps, step, threads, started: Time::ZERO };
        self.reaching.insert(task, (worker, s));
        Ok(())
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
        let t = self.unit_time;
        let mut ended = Vec::new();
        for (w, run) in self.running.iter_mut().enumerate() {
            if run.is_some_and(|s| s.left * t < 1e-9)
                && let Some(s) = run.take()
            {
                self.free_since[w] = now;
                ended.push(s);
            }
        }
        Ok((ended, self.reschedule(now, cost)?))
    }

    /// Every running task's progress up to `now` (the running set has not changed since `last`).
    fn advance(&mut self, now: Time) {
        if self.unit_time > 0.0 {
            let done = now.since(self.last).as_secs_f64() / self.unit_time;
            for s in self.running.iter_mut().flatten() {
                s.left -= done;
            }
        }
        self.last = now;
    }

    /// Start waiting tasks on idle workers (a worker idle before its task starts it cold), take
    /// the running set's time per unit of work (a GPU: `t(Σ rows)`, of the cell type of the
    /// widest task when they differ; CPU cores: the slowdown `max(1, Σ threads / cores)`), and
    /// predict its next end under a new generation.
    fn reschedule(&mut self, now: Time, cost: &dyn CostModel) -> Result<NextEnd> {
        for (w, (run, wait)) in self.running.iter_mut().zip(&mut self.waiting).enumerate() {
            if run.is_none()
                && let Some(mut s) = wait.pop_front()
            {
                s.started = now;
                s.left += s.step * (cost.idle_factor(now.since(self.free_since[w])) - 1.0);
                *run = Some(s);
            }
        }
        self.generation += 1;
        let running = || self.running.iter().flatten();
        self.unit_time = match (running().max_by_key(|s| s.rows), self.share) {
            (None, _) => 0.0,
            (Some(widest), Share::Batch) => {
                let rows = running().map(|s| s.rows).sum();
                time_of(cost, widest.cell, rows)?.as_secs_f64().max(1e-12)
            }
            // The even share: `C / Σ c` of solo speed once the threads outnumber the cores.
            (Some(_), Share::Cores(cores)) => {
                (running().map(|s| s.threads).sum::<usize>() as f64 / cores.max(1) as f64).max(1.0)
            }
        };
        let first = running().map(|s| s.left.max(0.0)).min_by(f64::total_cmp);
        // At least a nanosecond on: time always advances.
        Ok(first.map(|left| {
            (
                now + Duration::from_secs_f64(left * self.unit_time).max(Duration::from_nanos(1)),
                self.generation,
            )
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::CostFile;

    /// A one-thread task and a pool-wide one on two cores: three threads on two cores, each task
    /// at 2/3 of its solo speed until the first ends; the other then has the cores to itself.
    #[test]
    fn tasks_wanting_more_threads_than_cores_share_them_evenly() {
        let cost = CostFile::parse(
            r#"{"name":"t","cells":[{"cell":"step","points":[[1,10.0],[2,20.0]],"pool_rows":2}],"cores":2}"#,
        )
        .unwrap();
        let mut d = Device::new(2, Share::Cores(2));
        let us = |v: f64| Time::ZERO + Duration::from_secs_f64(v * 1e-6);
        d.launch(1, 0, (1, 1, "step"), &cost).unwrap();
        d.launch(2, 1, (2, 1, "step"), &cost).unwrap();
        d.reach(Time::ZERO, 1, &cost).unwrap();
        let (at, generation) = d.reach(Time::ZERO, 2, &cost).unwrap().unwrap();
        // The one-thread task's 10 µs of work at 2/3 speed: 15 µs.
        assert!(at.since(us(15.0)).as_nanos() <= 1 && us(15.0).since(at).as_nanos() <= 1, "{at:?}");
        let (ended, next) = d.end(at, generation, &cost).unwrap();
        assert_eq!(ended.iter().map(|s| s.task).collect::<Vec<_>>(), [1]);
        // The pool task did 10 of its 20 µs and runs the rest at full speed.
        let (at, generation) = next.unwrap();
        assert!(at.since(us(25.0)).as_nanos() <= 1 && us(25.0).since(at).as_nanos() <= 1, "{at:?}");
        let (ended, next) = d.end(at, generation, &cost).unwrap();
        assert_eq!(ended.iter().map(|s| s.task).collect::<Vec<_>>(), [2]);
        assert!(next.is_none());
    }
}
