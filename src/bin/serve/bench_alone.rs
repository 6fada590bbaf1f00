//! Where one request's time goes with nothing else in flight (`serve bench lstm|seq2seq|treelstm`,
//! before the peaks): requests served one at a time, each submitted when the previous one has
//! completed. The runtime's stats give the compute its tasks measured on their stream; the rest
//! of its latency is outside compute — per task, the engine ↔ stream hand-offs, and
//! once per request the submit and the caller's wake-up. At low load this is what a request's
//! latency is made of.

use std::time::Instant;

use serde_json::{Value, json};

use serve::SubmitOptions;

use crate::CliResult;
use crate::bench::{PolicySpec, Workload, start_model};

/// Requests served one at a time per policy.
const ALONE_REQUESTS: usize = 200;

/// One request at a time, on average.
pub(crate) struct Alone {
    pub(crate) requests: usize,
    pub(crate) latency_us: f64,
    pub(crate) tasks: f64,
    pub(crate) compute_us: f64,
}

impl Alone {
    /// Time outside compute per task.
    pub(crate) fn outside_per_task_us(&self) -> f64 {
        (self.latency_us - self.compute_us) / self.tasks.max(1.0)
    }

    pub(crate) fn print(&self, label: &str) {
        println!(
            "# alone {label}: {} requests one at a time: mean latency {:.0} us = compute {:.0} us ({:.1} tasks of {:.1} \
             us) + {:.0} us outside compute ({:.1} us per task: hand-offs, submit, wake-up)",
            self.requests,
            self.latency_us,
            self.compute_us,
            self.tasks,
            self.compute_us / self.tasks.max(1.0),
            self.latency_us - self.compute_us,
            self.outside_per_task_us(),
        );
    }

    pub(crate) fn to_json(&self, label: &str) -> Value {
        json!({
            "policy": label, "requests": self.requests, "latency_us": self.latency_us,
            "tasks_per_request": self.tasks, "compute_us": self.compute_us,
            "outside_per_task_us": self.outside_per_task_us(),
        })
    }
}

/// Serve [`ALONE_REQUESTS`] of `work`'s requests one at a time under `policy` (after its warm-up).
pub(crate) fn measure_alone(work: &Workload, policy: &PolicySpec) -> CliResult<Alone> {
    let (rt, model) = start_model(work, policy)?;
    let before = rt.stats();
    let t0 = Instant::now();
    for i in 0..ALONE_REQUESTS {
        model.submit(work.input(i), SubmitOptions::default())?.wait()?;
    }
    let wall = t0.elapsed().as_secs_f64() * 1e6;
    let after = rt.stats();
    let n = ALONE_REQUESTS as f64;
    Ok(Alone {
        requests: ALONE_REQUESTS,
        latency_us: wall / n,
        tasks: (after.tasks_launched - before.tasks_launched) as f64 / n,
        compute_us: (after.task_compute_ns - before.task_compute_ns) as f64 / 1e3 / n,
    })
}
