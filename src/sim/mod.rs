//! The discrete-event simulator (ARCHITECTURE.md §8): the runtime's [`EngineCore`] and policies
//! driven on virtual time, with task durations from a [`CostModel`] instead of a backend.
//!
//! It is the engine's second driver. The threaded engine reads the wall clock, launches tasks on
//! a backend's streams and learns of their ends from their counters; the simulator keeps an event
//! heap (arrivals, task ends, policy wakeups) and a clock that jumps from one event to the next.
//! Each worker is one in-order stream: a task is issued by the engine thread
//! ([`CostModel::issue_time`]; one engine thread issues every worker's tasks one after another,
//! so a launch decided while it is still issuing an earlier task waits for it), reaches its
//! stream [`CostModel::launch_delay`] after its issue starts (a GPU runs a task's first kernels
//! while the host is still launching the rest) and starts when the stream's previous task has
//! ended; it cannot end before its issue has (its last launch is the completion signal; on a
//! shared device or shared CPU cores, below, a task's end comes from the running set and this
//! bound is not applied: a GPU's issue overlaps its kernels, a CPU task's issue is a queue push
//! of well under a microsecond),
//! runs for [`CostModel::task_time`] of its cell type and rows per step (padding included; its
//! first step longer by [`CostModel::idle_factor`] when the stream was idle before it), and is
//! reported to the core [`CostModel::report_delay`] after its end. A request reaches the core
//! [`CostModel::arrival_delay`] after its submit, and its caller holds the completion
//! [`CostModel::delivery_delay`] after the core completes it; latencies run from submit to
//! delivery, as `serve bench` measures them. While the engine thread is issuing, what it would
//! read (an arrival, a task's report, a timer) waits until the issue is over, and everything
//! due at one instant is handled before the policy is polled: the threaded engine's turn
//! (engine.rs, "One decision per turn"). Everything between — which
//! requests wait, which rows form a task, when a request completes — is decided by the same
//! code as in the runtime, so a simulated run differs from a real one only by the cost model's
//! error (measured by `serve sim --check`, see the README).
//!
//! With a cost model whose workers share one device ([`CostModel::shared_device`], a GPU's
//! co-running streams), the tasks running at once progress together: each at the same fraction
//! of its work per second, `1 / t(Σ rows)`, so that tasks started together end together, as one
//! batch of their summed rows would (E²bird's equal-share model, rate `t(b_w)/t(Σb)` per task);
//! the running set's predicted end is recomputed whenever a task starts or ends. With a cost
//! model of CPU workers sharing cores ([`CostModel::cores`], the CPU backend's one compute
//! pool), the same machinery shares the cores: while the running tasks want more threads than
//! there are cores, each progresses at `cores / Σ threads` of its solo speed. On both, a task
//! that starts on a worker idle before it starts cold, as on a stream of its own.
//!
//! Deterministic: the same inputs give the identical sequence of decisions (ties in time are
//! broken by the order events were scheduled).

pub mod coldstart;
pub mod cost;
mod device;
pub mod tenant;
pub mod workload;

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::sync::Arc;
use std::time::Duration;

pub use cost::{CellCost, CostFile, CostModel};
use device::{Device, Share};

use crate::error::{Code, Error, Result};
use crate::model::Network;
use crate::runtime::PolicyConfig;
use crate::runtime::core::{CoreOutput, EngineCore, RowEnd, Submit};
use crate::sched::{CellGraph, RequestId, TaskId, TaskReport, Time, WorkerId};

/// One simulated request.
#[derive(Clone, Debug)]
pub struct SimRequest {
    /// The request unfolded into cells (as `Network::unfold` makes it); `None` for a
    /// fixed-shape request.
    pub graph: Option<Arc<CellGraph>>,
    /// The node whose row ends the request before its last cell (a Seq2Seq decode reaching
    /// `eos`), if any.
    pub ends_at: Option<u32>,
}

/// How requests arrive.
#[derive(Clone, Debug)]
pub enum Load {
    /// Open loop: request `i` arrives at `at[i]` (ascending), whatever happens to the others.
    Open(Vec<Duration>),
    /// Closed loop: `window` requests in flight; each completion brings the next request at once.
    Closed { window: usize },
}

/// What to simulate.
pub struct SimSpec<'a> {
    /// The model (its kind, cell types and state size; its weights are not used).
    pub net: &'a Network,
    pub policy: &'a PolicyConfig,
    pub cost: &'a dyn CostModel,
    /// Requests admitted and not complete at most; an arrival beyond it is refused `Busy`, as
    /// the runtime's admission bound refuses it.
    pub admission_bound: usize,
    /// Record every decision in [`SimOutcome::trace`].
    pub trace: bool,
}

/// One decision of a simulated run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TraceEvent {
    Arrive { at: Time, id: RequestId },
    Launch { at: Time, task: TaskId, worker: WorkerId, rows: usize, batch: usize },
    Complete { at: Time, id: RequestId, code: Code },
}

/// What a simulated run measured.
#[derive(Clone, Debug, Default)]
pub struct SimOutcome {
    /// Latency (arrival to completion) of each request that completed `Ok`, in completion order.
    pub latencies: Vec<Duration>,
    /// When each of them completed (parallel to `latencies`).
    pub completed_at: Vec<Time>,
    /// Requests that completed with an error (refusals at admission included), by code.
    pub errors: BTreeMap<Code, u64>,
    pub tasks: u64,
    /// Real rows over all tasks (so `task_rows / tasks` is the mean formed batch).
    pub task_rows: u64,
    /// The cost model's time of every task, summed (the compute `serve bench` measures).
    pub task_time: Duration,
    /// First arrival and last completion: the span throughput is measured over.
    pub first_arrival: Time,
    pub last_completion: Time,
    /// Events handled (arrivals, task ends, wakeups).
    pub events: u64,
    pub trace: Vec<TraceEvent>,
}

impl SimOutcome {
    pub fn completed(&self) -> u64 {
        self.latencies.len() as u64
    }

    pub fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }

    /// Requests completed `Ok` per second of simulated time.
    pub fn throughput(&self) -> f64 {
        let span = self.last_completion.since(self.first_arrival).as_secs_f64();
        if span > 0.0 { self.completed() as f64 / span } else { 0.0 }
    }

    /// Throughput between the `skip_front`-th and the last-but-`skip_back` `Ok` completion: a
    /// closed loop's steady state, without its ramp-up and its final drain.
    pub fn steady_throughput(&self, skip_front: usize, skip_back: usize) -> Option<f64> {
        let n = self.completed_at.len();
        let (a, b) = (skip_front, n.checked_sub(skip_back + 1)?);
        let span = self.completed_at.get(b)?.since(*self.completed_at.get(a)?).as_secs_f64();
        (b > a && span > 0.0).then(|| (b - a) as f64 / span)
    }

    pub fn mean_batch(&self) -> f64 {
        if self.tasks == 0 { 0.0 } else { self.task_rows as f64 / self.tasks as f64 }
    }

    /// Mean time of a task, if any ran.
    pub fn mean_task_time(&self) -> Option<Duration> {
        (self.tasks > 0).then(|| self.task_time / u32::try_from(self.tasks).unwrap_or(u32::MAX))
    }
}

/// The simulator's per-request data in the core.
struct Live {
    arrived: Time,
    ends_at: Option<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// Request `i` reaches the engine (its submit plus the arrival delay).
    Arrive(usize),
    /// Request `i`, which reached the engine at the given time while the engine thread was
    /// issuing, is handled now.
    Submit(usize, Time),
    /// A task is reported done, with the compute time its cost model gave it.
    Done(TaskId, Duration),
    Wake,
    /// Shared device: a launched task reaches its worker (after the launch delay).
    Reach(TaskId),
    /// Shared device: the running tasks' earliest end, as predicted under this generation of
    /// the running set (stale once a task started or ended since).
    ShareEnd(u64),
}

/// The model (and group) index the simulator serves its one model under.
const MODEL: usize = 0;

struct Sim<'a> {
    spec: &'a SimSpec<'a>,
    cell_names: Vec<&'static str>,
    core: EngineCore<Live>,
    heap: BinaryHeap<Reverse<(Time, u64, Ev)>>,
    seq: u64,
    /// When each worker's stream finishes the last task launched on it.
    stream_free: Vec<Time>,
    /// When the engine thread has issued the last task decided (tasks are issued in turn).
    engine_free: Time,
    /// The shared device, when the cost model has one (then `stream_free` is not used).
    device: Option<Device>,
    /// The wakeup already on the heap, if any.
    wake: Option<Time>,
    out: SimOutcome,
    next_id: RequestId,
}

/// Run `requests` under `load` and return what was measured. Fails if the policy does not fit
/// the model, or the cost model has no figure for a cell type a task runs.
pub fn simulate(spec: &SimSpec<'_>, requests: &[SimRequest], load: &Load) -> Result<SimOutcome> {
    if requests.is_empty() {
        return Err(Error::invalid("a simulation needs at least one request"));
    }
    if let Load::Open(at) = load
        && at.len() != requests.len()
    {
        return Err(Error::invalid(format!("{} arrival times for {} requests", at.len(), requests.len())));
    }
    // As the simulated backend runs them; a task of several steps costs each (`carry_out`).
    let policy = crate::runtime::make_policy(spec.net, spec.policy, spec.cost.max_task_steps())?;
    let slots = if spec.net.is_recurrent() {
        crate::runtime::default_state_slots(spec.net, spec.admission_bound)
    } else {
        0
    };
    let mut core = EngineCore::default();
    core.add_group(MODEL, policy);
    core.add_model(MODEL, MODEL, slots, crate::runtime::reserved_requests(spec.admission_bound));
    let workers = core.workers_of(MODEL).len();
    let cell_names = if spec.net.is_recurrent() {
        spec.net.cell_types().iter().map(|t| t.name).collect()
    } else {
        vec!["dense"]
    };
    let mut sim = Sim {
        spec,
        cell_names,
        core,
        heap: BinaryHeap::new(),
        seq: 0,
        stream_free: vec![Time::ZERO; workers],
        engine_free: Time::ZERO,
        device: if spec.cost.shared_device() {
            Some(Device::new(workers, Share::Batch))
        } else if spec.cost.cores() > 0 {
            Some(Device::new(workers, Share::Cores(spec.cost.cores())))
        } else {
            None
        },
        wake: None,
        out: SimOutcome::default(),
        next_id: 0,
    };
    // Arrive events are when the core handles an arrival: the submit plus the arrival delay.
    let (entry, delivery) = (spec.cost.arrival_delay(), spec.cost.delivery_delay());
    match load {
        // Arrivals enter the heap one at a time (each brings the next): the heap holds what is
        // in flight, not the whole schedule.
        Load::Open(at) => sim.push(Time::ZERO + at[0] + entry, Ev::Arrive(0)),
        Load::Closed { window } => {
            for i in 0..(*window).clamp(1, requests.len()) {
                sim.push(Time::ZERO + entry, Ev::Arrive(i));
            }
        }
    }
    // Throughput is measured from time zero (an open loop's schedule starts there, as the
    // benchmark's does) to the last completion.
    sim.out.first_arrival = Time::ZERO;
    let mut next_closed = match load {
        Load::Closed { window } => (*window).clamp(1, requests.len()),
        Load::Open(_) => requests.len(),
    };
    while let Some(Reverse((now, _, ev))) = sim.heap.pop() {
        let completed_before = sim.out.completed() + sim.out.error_count();
        // As the engine's turn: every event due at this instant is handled, then the policy
        // decides once (engine.rs, "One decision per turn").
        let mut next = Some(ev);
        while let Some(ev) = next.take() {
            sim.out.events += 1;
            sim.handle(now, ev, requests, load)?;
            if sim.heap.peek().is_some_and(|Reverse((t, ..))| *t == now) {
                next = sim.heap.pop().map(|Reverse((_, _, ev))| ev);
            }
        }
        // Still issuing: the engine decides nothing before it is done (what it must see was put
        // off until then, `handle`).
        if now < sim.engine_free {
            continue;
        }
        if sim.core.next_wakeup().is_some_and(|w| w <= now) {
            sim.core.tick(now);
        }
        sim.carry_out(now)?;
        // Closed loop: every completion the caller holds lets its next request in.
        let finished = sim.out.completed() + sim.out.error_count() - completed_before;
        for _ in 0..finished {
            if next_closed < requests.len() {
                sim.push(now + delivery + entry, Ev::Arrive(next_closed));
                next_closed += 1;
            }
        }
        sim.schedule_wake(now);
    }
    if !sim.core.is_empty() {
        return Err(Error::internal("the simulation ended with requests still pending (a policy stalled)"));
    }
    Ok(sim.out)
}

impl Sim<'_> {
    fn push(&mut self, at: Time, ev: Ev) {
        self.seq += 1;
        self.heap.push(Reverse((at, self.seq, ev)));
    }

    /// Handle one event. What the engine thread sees (an arrival, a task's report, a timer)
    /// while it is still issuing a task waits until the issue is over: the real engine makes
    /// its launch calls on its own thread and reads what came in afterwards, all together.
    fn handle(&mut self, now: Time, ev: Ev, requests: &[SimRequest], load: &Load) -> Result<()> {
        let busy = now < self.engine_free;
        match ev {
            Ev::Arrive(i) => {
                // The schedule goes on whatever the engine does.
                if let Load::Open(at) = load
                    && let Some(&next) = at.get(i + 1)
                {
                    self.push(Time::ZERO + next + self.spec.cost.arrival_delay(), Ev::Arrive(i + 1));
                }
                if busy {
                    self.push(self.engine_free, Ev::Submit(i, now));
                } else {
                    self.arrive(now, now, &requests[i])?
                }
            }
            Ev::Submit(i, reached) => self.arrive(now, reached, &requests[i])?,
            Ev::Done(..) if busy => self.push(self.engine_free, ev),
            Ev::Wake if busy => {
                if self.wake == Some(now) {
                    self.wake = Some(self.engine_free);
                }
                self.push(self.engine_free, ev)
            }
            Ev::Done(task, compute) => self.done(now, task, compute),
            Ev::Reach(task) => self.reach(now, task)?,
            Ev::ShareEnd(generation) => self.share_end(now, generation)?,
            Ev::Wake => {
                if self.wake == Some(now) {
                    self.wake = None;
                }
            }
        }
        Ok(())
    }

    /// Request `r` is handled by the core at `now`; it reached the engine at `reached` (its
    /// submit plus the arrival delay; earlier than `now` if the engine was issuing).
    fn arrive(&mut self, now: Time, reached: Time, r: &SimRequest) -> Result<()> {
        let id = self.next_id;
        self.next_id += 1;
        if self.core.requests_of(MODEL) >= self.spec.admission_bound {
            *self.out.errors.entry(Code::Busy).or_default() += 1;
            self.out.last_completion = now;
            return Ok(());
        }
        if self.spec.trace {
            self.out.trace.push(TraceEvent::Arrive { at: now, id });
        }
        let slots_needed =
            r.graph.as_ref().map_or(0, |g| crate::runtime::cells::slots_needed(self.spec.net, g));
        let s = Submit {
            model: MODEL,
            id,
            graph: r.graph.clone(),
            slots_needed,
            deadline: None,
            priority: 0,
            // Inputs are where the cost model's task times assume them: ready at once.
            input_ready: true,
            // Submitted by its caller the arrival delay earlier.
            data: Live {
                arrived: Time(reached.0.saturating_sub(self.spec.cost.arrival_delay().as_nanos() as u64)),
                ends_at: r.ends_at,
            },
        };
        self.core.submit(now, s).map_err(|_| Error::internal("the simulated model is not served"))?;
        Ok(())
    }

    fn done(&mut self, now: Time, task: TaskId, compute: Duration) {
        let report = TaskReport { compute: Some(compute), ..TaskReport::of(task) };
        self.core.task_done(now, MODEL, &report, |_, r, node| {
            if node.is_some() && node == r.data.ends_at { RowEnd::Early } else { RowEnd::Continue }
        });
    }

    fn carry_out(&mut self, now: Time) -> Result<()> {
        while let Some(out) = self.core.poll() {
            match out {
                CoreOutput::Launch { group, task } => {
                    let t = self.core.task(group, task).expect("a launched task is in flight");
                    let cell = self.cell_names.get(usize::from(t.cell())).copied().unwrap_or("?");
                    let step = cost::time_of(self.spec.cost, cell, t.batch)?;
                    // A task of several steps (a padded batch run in one call) costs each of them.
                    let run = step * t.shape.steps();
                    let (worker, rows, batch, steps) = (t.worker, t.requests.len(), t.batch, t.shape.steps());
                    self.out.tasks += 1;
                    self.out.task_rows += rows as u64;
                    // The engine thread issues it once it has issued the tasks decided before.
                    let issuing = self.engine_free.max(now);
                    self.engine_free = issuing + self.spec.cost.issue_time(cell, batch);
                    let issued = self.engine_free;
                    let reaches = issuing + self.spec.cost.launch_delay();
                    if let Some(d) = self.device.as_mut() {
                        // Its time depends on what runs beside it: known when it ends.
                        d.launch(task, worker, (batch, steps, cell), self.spec.cost)?;
                        self.push(reaches, Ev::Reach(task));
                    } else {
                        let free = &mut self.stream_free[worker];
                        let start = reaches.max(*free);
                        // A stream that waited for this task starts it cold: its first step is
                        // longer (what a cold start slows is the start, not every step after).
                        let cold = self.spec.cost.idle_factor(start.since(*free)) - 1.0;
                        let run = run + step.mul_f64(cold);
                        *free = (start + run).max(issued);
                        let report = *free + self.spec.cost.report_delay();
                        self.push(report, Ev::Done(task, run));
                        self.out.task_time += run;
                    }
                    if self.spec.trace {
                        self.out.trace.push(TraceEvent::Launch { at: now, task, worker, rows, batch });
                    }
                }
                CoreOutput::Complete { id, code, data, .. } => {
                    // The caller holds it once delivered.
                    let held = now + self.spec.cost.delivery_delay();
                    if code == Code::Ok {
                        self.out.latencies.push(held.since(data.arrived));
                        self.out.completed_at.push(held);
                    } else {
                        *self.out.errors.entry(code).or_default() += 1;
                    }
                    self.out.last_completion = held;
                    if self.spec.trace {
                        self.out.trace.push(TraceEvent::Complete { at: now, id, code });
                    }
                }
                CoreOutput::Released { .. } => {}
            }
        }
        Ok(())
    }

    /// Shared device: a launched task reached its worker.
    fn reach(&mut self, now: Time, task: TaskId) -> Result<()> {
        let cost = self.spec.cost;
        let Some(d) = self.device.as_mut() else { return Ok(()) };
        if let Some((at, generation)) = d.reach(now, task, cost)? {
            self.push(at, Ev::ShareEnd(generation));
        }
        Ok(())
    }

    /// Shared device: the running set's predicted end, if still current: the tasks whose work
    /// is done end (reported after the report delay), the next on their workers start.
    fn share_end(&mut self, now: Time, generation: u64) -> Result<()> {
        let cost = self.spec.cost;
        let Some(d) = self.device.as_mut() else { return Ok(()) };
        let (ended, next) = d.end(now, generation, cost)?;
        for s in ended {
            let run = now.since(s.started);
            self.out.task_time += run;
            self.push(now + cost.report_delay(), Ev::Done(s.task, run));
        }
        if let Some((at, generation)) = next {
            self.push(at, Ev::ShareEnd(generation));
        }
        Ok(())
    }

    /// Put the core's next wakeup on the heap unless one at or before it is there already.
    fn schedule_wake(&mut self, now: Time) {
        let Some(w) = self.core.next_wakeup() else { return };
        // A wakeup due now was handled above; one the policy still asks for at `now` comes a
        // nanosecond later, so time always advances.
        let w = w.max(Time(now.0 + 1));
        if self.wake.is_none_or(|cur| w < cur) {
            self.wake = Some(w);
            self.push(w, Ev::Wake);
        }
    }
}

#[cfg(test)]
mod tests;
