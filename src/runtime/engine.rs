//! The engine thread: drives each model's sans-IO policy with the wall clock and carries out its
//! decisions (launch a task on a worker's stream, complete a request).
//!
//! Arrivals come through their model's ring, every other event (cancel, a CUDA task done, model
//! added or freed, shutdown) through one channel (inbox.rs: how they wake the engine, and why a
//! cancel never overtakes its arrival). A CPU task's end is seen here directly: the engine
//! watches the counters of the streams that notify (watch.rs), so a CPU task's hand-off is two
//! wake-ups (engine → stream → engine), not three through the poller. The engine owns all request and task state, so nothing here is
//! shared or locked (but the pool of model indices, which submitters' threads take from when
//! they add a model).
//!
//! # One decision per turn
//!
//! Each turn handles what is waiting, and drains the policies' decisions and carries them out
//! after every [`MAX_EVENTS_PER_DECISION`] events and at the end of the turn, not after each
//! event. The events that came in while the engine was busy — above all while it was issuing a
//! task, which on the CUDA backend is the engine thread's own launch calls, longer than a small
//! task's run — are decided on together: a policy that schedules in `Policy::poll` (the cellular
//! policy) puts the rows they made ready into shared tasks, where scheduling at each event
//! launched one task per task report (ARCHITECTURE.md §3.3, with the figures). How busy the
//! thread is: `StatsSnapshot::engine_busy_ns`.
//!
//! # Freeing a model
//!
//! When the last handle of a model is dropped, [`Event::RemoveModel`] marks it *closing*. No
//! request can arrive for it any more (every submit went through a handle, and sent its arrival
//! before the handle's drop sent the removal). Its pending requests complete as usual; once it
//! has no request left and no task in flight (every launched task was reported), its workers'
//! watches are dropped (the engine's and the poller's), the engine empties its slot, returns its index to the
//! [`ModelIndices`] pool (a later model may reuse the slot: the engine's per-model storage is as
//! long as the most models ever loaded at once), and hands its policy and runner to the reaper
//! thread, which drops them (joining its stream threads, which by then have nothing left to run
//! but a task given up on that still hangs, and freeing its arena and buffers) while the engine
//! goes on.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, TryLockError};
use std::time::{Duration, Instant};

use crate::backend::ring::InputRing;
use crate::backend::{CellTask, Runner, StageTimes, TaskData, TaskIo, Work};
use crate::error::{Code, Error, Result};
use crate::model::{Input, Network, Output};
use crate::runtime::admission::Admission;
use crate::runtime::blocks::{block_row_done, block_work};
use crate::runtime::cells::{Decoding, Finished, RowOutcome, push_path_row, push_row};
use crate::runtime::core::{CoreOutput, EngineCore, RowEnd, Submit};
use crate::runtime::inbox::{ArrivalRing, ControlBudget, Event};
use crate::runtime::metrics::ModelMetrics;
use crate::runtime::poller::PollerHandle;
use crate::runtime::queue::{Completion, QueueShared};
use crate::runtime::request::{Reply, flush, shutdown_cancelled, touch_spare};
use crate::runtime::stats::Stats;
use crate::runtime::watch::Watcher;
use crate::sched::{CellGraph, Policy, RequestId, TaskId, TaskReport, TaskShape, Time};

/// A request admitted by submit. It travels to the engine boxed and stays in that box, carried
/// by the core (`core::CoreRequest::data`) until it completes: the engine's own data of a
/// request moves as one pointer between the channel, the core's maps and the completion.
pub(crate) struct Pending {
    pub model: usize,
    /// When submit accepted it (the metrics' queue and latency times start here).
    pub submitted: Instant,
    /// Its rows of work, as admission counted them (released at completion).
    pub rows: u64,
    pub input: Input,
    /// The request unfolded into cells (recurrent models).
    pub cells: Option<Arc<CellGraph>>,
    /// State slots it needs (`cells::slots_needed`; 0 for a fixed-shape request).
    pub slots_needed: usize,
    pub deadline: Option<Instant>,
    pub priority: i32,
    pub reply: Reply,
    /// What the engine learns while the request runs (empty at submit).
    pub run: Run,
}

/// The engine's record of a request while it runs.
#[derive(Default)]
pub(crate) struct Run {
    /// The result computed by the request's task(s), set when it is known.
    pub(super) result: Option<Result<Output>>,
    /// Seq2Seq: the tokens decoded so far.
    decoding: Decoding,
    /// The slot of its model's input ring its input was copied into at arrival.
    ring_slot: Option<usize>,
    /// A layer model's values leaving its last finished layer block (the next block's input;
    /// the tenant mode runs a request as a chain of blocks).
    pub(super) activation: Vec<f32>,
}

impl Run {
    /// The f32 output a request still holds when its record is kept for reuse (it was cancelled
    /// or expired after its task ran), for its buffer to be kept too (recycle.rs).
    pub(crate) fn into_f32_output(self) -> Option<Vec<f32>> {
        match self.result {
            Some(Ok(Output::F32(v))) => Some(v),
            _ => None,
        }
    }
}

/// Models served by one policy, as the engine receives them: a model of its own
/// (`Runtime::add_network`), or the tenants of a core pool (`Runtime::add_tenants`).
pub(crate) struct EngineGroup {
    pub policy: Box<dyn Policy>,
    /// Each model's index and parts.
    pub models: Vec<(usize, EngineModel)>,
    /// The CPUs the group's tasks lease cores from (the tenant mode): a task the policy gives
    /// `Exec::cores` runs pinned to that many of them, none leased twice at once. Empty: tasks
    /// are not pinned.
    pub cpus: Vec<usize>,
}

/// A model as the engine sees it.
pub(crate) struct EngineModel {
    pub net: Arc<Network>,
    pub runner: Arc<dyn Runner>,
    pub metrics: Arc<ModelMetrics>,
    /// Released for every completed request; measures the time per row (admission.rs).
    pub admission: Arc<Admission>,
    /// The policy's input ring ([`Policy::input_ring_slots`]), allocated when the model was
    /// added.
    pub ring: Option<Arc<InputRing>>,
    /// Where its submits write their arrivals (inbox.rs).
    pub arrivals: Arc<ArrivalRing>,
}

/// The most cancels and flushes callers may have in the event channel at once.
///
/// Events handled back to back before timers are checked and completions delivered.
const MAX_EVENTS_PER_TURN: usize = 256;

/// Events handled before the policies' decisions are carried out, at most. Enough for what
/// piles up while the engine issues a task (a few reports and arrivals in a CUDA task's launch
/// calls) to be decided on together; few enough that under a flood of arrivals an idle worker
/// waits a few handlings for its next task, not a whole turn's (with 512 handlings per decision
/// the CPU overload test's workers idled: up to 3.7% of admitted requests missed a deadline the
/// admission had let in, against at most 0.2% deciding after each event).
const MAX_EVENTS_PER_DECISION: usize = 8;

/// The engine's own data of a request, as the core carries it.
type Live = Box<Pending>;

/// The backend side of a model: what the core does not hold.
struct ModelState {
    net: Arc<Network>,
    runner: Arc<dyn Runner>,
    metrics: Arc<ModelMetrics>,
    admission: Arc<Admission>,
    /// Input and output values per row.
    io: (usize, usize),
    /// Values per row entering each layer and leaving the last (a layer model's
    /// `Network::layer_bounds`; empty for other models).
    bounds: Vec<usize>,
    /// Workers the stall watchdog gave up on and that have not recovered.
    stalled: Vec<bool>,
    /// The model's input ring (elastic batching), while the engine may write into it: dropped
    /// for good once a task reading it was given up on (it may still be reading, and its
    /// slots are free again); later launches gather instead.
    ring: Option<Arc<InputRing>>,
    /// Its arrivals on their way (inbox.rs).
    arrivals: Arc<ArrivalRing>,
}

impl Drop for ModelState {
    /// The engine lets the model go (released, or the engine stopped, even by a panic): an
    /// arrival left in its ring, or written into it after, completes `Cancelled` (inbox.rs).
    fn drop(&mut self) {
        self.arrivals.close();
    }
}

/// The error of a task whose output is shorter than its rows need.
pub(super) fn short_output(task: TaskId, len: usize, rows: usize, out_len: usize) -> Error {
    Error::internal(format!("task {task} produced {len} values for {rows} rows of {out_len}"))
}

/// Work of `shape`'s kind with nothing in it (allocates nothing): what the engine reads of a task
/// given up on while its stream still holds the task's io.
fn empty_work(shape: &TaskShape) -> Work {
    match shape {
        TaskShape::Dense => Work::Dense(Vec::new()),
        TaskShape::Cells { .. } => Work::Cells(CellTask::default()),
        &TaskShape::Layers { first, last } => {
            Work::Layers { first: first as usize, last: last as usize + 1, input: Vec::new() }
        }
    }
}

/// The indices of the engine's model slots: taken when a model is added, returned by the engine
/// once the model is released (see the module docs), a free one reused before a new one.
#[derive(Default)]
pub(crate) struct ModelIndices {
    /// One more than the highest index handed out so far.
    next: usize,
    free: Vec<usize>,
}

impl ModelIndices {
    pub(crate) fn take(&mut self) -> usize {
        self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        })
    }

    fn give_back(&mut self, index: usize) {
        self.free.push(index);
    }
}

pub(crate) struct Engine {
    epoch: Instant,
    /// Requests, slots, policies and tasks in flight (with their `TaskData`): the decisions
    /// (core.rs).
    core: EngineCore<Live, Option<Arc<TaskData>>>,
    /// Indexed by model index; `None` for a free index.
    models: Vec<Option<ModelState>>,
    indices: Arc<Mutex<ModelIndices>>,
    /// The core's group indices (this thread's own: groups are added and released here).
    group_ids: ModelIndices,
    /// Each group's free CPUs to lease (tenant groups; empty for the others), by group index.
    free_cpus: Vec<Vec<usize>>,
    poller: PollerHandle,
    /// The launched tasks of the streams that notify, watched here rather than by the poller
    /// (watch.rs).
    watcher: Watcher,
    /// Raised by those streams after they advance their counters ([`StreamBell`]).
    ///
    /// [`StreamBell`]: crate::runtime::inbox::StreamBell
    advanced: Arc<AtomicBool>,
    /// A task was watched here whose target may be reached without a notify (a failed launch):
    /// look at the counters in the next turn.
    recheck: bool,
    /// The tasks found done in a look at the counters, before they are handled (kept for reuse).
    reaped: Vec<(usize, TaskId)>,
    stats: Arc<Stats>,
    outbox: Vec<(Arc<QueueShared>, Completion)>,
    drain_until: Option<Instant>,
    /// Where released models go to be dropped (the reaper thread, see `Runtime::start`).
    reaper: Sender<Box<dyn Send>>,
    /// The current event's time, once read (see [`now`](Self::now)).
    clock: Option<Time>,
    /// Given back as each cancel and flush is handled.
    control: Arc<ControlBudget>,
    /// The model whose ring is looked at first in the next turn (they take turns).
    next_ring: usize,
    /// Events handled since the decisions were last carried out.
    undecided: usize,
}

impl Engine {
    pub(crate) fn new(
        epoch: Instant,
        (poller, watcher, advanced): (PollerHandle, Watcher, Arc<AtomicBool>),
        stats: Arc<Stats>,
        indices: Arc<Mutex<ModelIndices>>,
        reaper: Sender<Box<dyn Send>>,
        control: Arc<ControlBudget>,
    ) -> Engine {
        Engine {
            epoch,
            core: EngineCore::default(),
            models: Vec::new(),
            indices,
            group_ids: ModelIndices::default(),
            free_cpus: Vec::new(),
            poller,
            watcher,
            advanced,
            recheck: false,
            reaped: Vec::new(),
            stats,
            outbox: Vec::new(),
            drain_until: None,
            reaper,
            clock: None,
            control,
            next_ring: 0,
            undecided: 0,
        }
    }

    fn time(&self, at: Instant) -> Time {
        Time(u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX))
    }

    fn instant_of(&self, t: Time) -> Instant {
        self.epoch + Duration::from_nanos(t.0)
    }

    /// The wall clock, read once per event (and once per timer pass): everything one event
    /// causes — a task's end, the launches and completions it leads to — happens at one instant,
    /// for the policies and the metrics alike, and the clock is not read per request.
    fn now(&mut self) -> Time {
        match self.clock {
            Some(t) => t,
            None => *self.clock.insert(self.time(Instant::now())),
        }
    }

    /// The engine loop; returns when shut down and every request has completed.
    pub(crate) fn run(mut self, events: Receiver<Event>) {
        loop {
            let mut turn = Instant::now();
            // Nothing waiting: park until the next timer, or until someone hands the engine
            // something (inbox.rs: an unpark before the park makes it return at once).
            if self.take_waiting(&events) == 0 {
                match self.next_wakeup() {
                    None => std::thread::park(),
                    Some(at) => {
                        let d = at.saturating_duration_since(turn);
                        if !d.is_zero() {
                            std::thread::park_timeout(d);
                        }
                    }
                }
                turn = Instant::now();
                self.take_waiting(&events);
            }
            self.check_streams(turn);
            self.clock = None;
            let now = self.now();
            self.core.tick(now);
            self.carry_out();
            self.publish();
            self.stats.record_turn(turn.elapsed());
            if let Some(until) = self.drain_until {
                if self.core.is_empty() {
                    break;
                }
                if Instant::now() >= until {
                    self.cancel_everything();
                    break;
                }
            }
        }
        // Requests still in the channel or a ring (none, with the submit gate closed first) are
        // dropped with it; their replies complete them `Cancelled`.
        self.poller.stop();
        // Policies and runners go now: streams finish the task in hand and their threads end.
        self.core = EngineCore::default();
        self.models.clear();
        self.publish();
    }

    /// Handle what is waiting — the CPU tasks done, events from the channel, arrivals from the
    /// rings — but never so much that timers and deliveries starve under a steady stream: at most
    /// [`MAX_EVENTS_PER_TURN`] each of events and arrivals (tasks done are bounded by the tasks in
    /// flight). Returns how many were handled. A closed channel (every
    /// sender gone) stops the engine at once.
    fn take_waiting(&mut self, events: &Receiver<Event>) -> usize {
        let reported = self.take_done_streams();
        let mut taken = 0;
        while taken < MAX_EVENTS_PER_TURN {
            match events.try_recv() {
                Ok(ev) => {
                    if ev.follows_arrivals() {
                        self.take_all_arrivals();
                    }
                    self.handle(ev);
                    taken += 1;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    self.drain_until = Some(Instant::now());
                    break;
                }
            }
        }
        reported + taken + self.take_arrivals(MAX_EVENTS_PER_TURN)
    }

    /// Report the tasks of the streams watched here (those that notify) whose counters passed
    /// them, once one of those streams has rung ([`StreamBell`]) or a failed launch was
    /// watched; returns how many.
    ///
    /// [`StreamBell`]: crate::runtime::inbox::StreamBell
    fn take_done_streams(&mut self) -> usize {
        // Lowered before the counters are read: an advance after this rings again (inbox.rs).
        let rung = self.advanced.swap(false, Ordering::Acquire);
        let recheck = std::mem::take(&mut self.recheck);
        if !(rung || recheck) {
            return 0;
        }
        let mut reaped = std::mem::take(&mut self.reaped);
        self.watcher.take_done(|model, task| reaped.push((model, task)));
        let n = reaped.len();
        for (model, task) in reaped.drain(..) {
            self.handle(Event::TaskDone { model, task, failure: None });
        }
        self.reaped = reaped;
        n
    }

    /// The health pass over the streams watched here (failures, the stall watchdog, recovery;
    /// watch.rs), when it is due.
    fn check_streams(&mut self, now: Instant) {
        let mut events = Vec::new();
        self.watcher.health(now, |ev| events.push(ev));
        for ev in events {
            self.handle(ev);
        }
    }

    /// Take up to `budget` arrivals, the models' rings taking turns at going first.
    fn take_arrivals(&mut self, budget: usize) -> usize {
        let n = self.models.len();
        let mut taken = 0;
        for k in 0..n {
            taken += self.take_from((self.next_ring + k) % n, budget - taken);
        }
        self.next_ring = (self.next_ring + 1) % n.max(1);
        taken
    }

    /// Take every arrival written before this call (what each ring held when looked at; later
    /// ones may be taken too).
    fn take_all_arrivals(&mut self) {
        for idx in 0..self.models.len() {
            let waiting = self.models[idx].as_ref().map_or(0, |s| s.arrivals.len());
            self.take_from(idx, waiting);
        }
    }

    /// Handle up to `most` arrivals from model `idx`'s ring; returns how many.
    fn take_from(&mut self, idx: usize, most: usize) -> usize {
        let mut taken = 0;
        while taken < most {
            let Some(p) = self.models[idx].as_ref().and_then(|s| s.arrivals.pop()) else { break };
            self.handle(Event::Arrive(p));
            taken += 1;
        }
        taken
    }

    /// Update the gauges, then deliver: a caller that has seen its completion never reads a
    /// gauge older than it.
    fn publish(&mut self) {
        let (mut queued, mut running) = (0, 0);
        for (idx, s) in self.models.iter().enumerate() {
            let Some(s) = s else { continue };
            let q = self.core.queued(idx);
            queued += q;
            running += self.core.running(idx);
            s.metrics.set_gauges(q, self.core.requests_of(idx));
        }
        self.stats.set_gauges(queued, running);
        flush(&mut self.outbox);
    }

    fn next_wakeup(&self) -> Option<Instant> {
        let core = self.core.next_wakeup().map(|t| self.instant_of(t));
        core.into_iter().chain(self.drain_until).chain(self.watcher.next_health()).min()
    }

    /// Handle one event. What it leads policies to decide is carried out once everything waiting
    /// has been handled (the loop in [`run`](Self::run)), or after [`MAX_EVENTS_PER_DECISION`]
    /// events if more are waiting.
    fn handle(&mut self, ev: Event) {
        self.clock = None;
        self.handle_event(ev);
        self.undecided += 1;
        if self.undecided >= MAX_EVENTS_PER_DECISION {
            self.carry_out();
        }
    }

    fn handle_event(&mut self, ev: Event) {
        match ev {
            Event::AddGroup(g) => {
                let EngineGroup { policy, models, cpus } = *g;
                let group = self.group_ids.take();
                if self.free_cpus.len() <= group {
                    self.free_cpus.resize_with(group + 1, Vec::new);
                }
                self.free_cpus[group] = cpus;
                self.core.add_group(group, policy);
                for (idx, m) in models {
                    self.add_model(idx, group, m);
                }
            }
            // Sent once, by the last handle's drop; the index is not reused before release.
            Event::RemoveModel(idx) => self.core.close_model(idx),
            Event::Arrive(mut data) => {
                let (model, id, cells) = (data.model, data.reply.id(), data.cells.take());
                let (slots_needed, priority) = (data.slots_needed, data.priority);
                let deadline = data.deadline.map(|d| self.time(d));
                let now = self.now();
                // The input was copied into host memory at submit, where both backends gather it
                // from when the task launches: ready with the arrival. A model with an input
                // ring has it copied into its slot first (the slot is known once the policy has
                // seen the request): ready right after.
                let has_ring =
                    self.models.get(model).and_then(|s| s.as_ref()).is_some_and(|s| s.ring.is_some());
                let s = Submit {
                    model,
                    id,
                    graph: cells,
                    slots_needed,
                    deadline,
                    priority,
                    input_ready: !has_ring,
                    data,
                };
                // A handle is alive while it submits, so its model is here and not closing; were
                // it not, the request completes `Cancelled`.
                match self.core.submit(now, s) {
                    Ok(()) if has_ring => {
                        self.copy_into_ring(model, id);
                        self.core.input_ready(now, id);
                    }
                    Ok(()) => {}
                    Err(live) => {
                        let freed = Err(Error::new(Code::Cancelled, "the model was freed"));
                        self.finish(model, None, live, freed, false);
                    }
                }
            }
            Event::Cancel(id) => {
                self.control.give_back();
                let now = self.now();
                self.core.cancel(now, id);
            }
            Event::TaskDone { model, task, failure } => self.task_done(model, task, failure),
            Event::WorkerStalled { model, worker } => self.set_stalled(model, worker, true),
            Event::WorkerRecovered { model, worker } => self.set_stalled(model, worker, false),
            Event::Flush(model) => {
                self.control.give_back();
                let now = self.now();
                self.core.flush(now, model);
            }
            Event::Shutdown { drain_until } => {
                self.drain_until = Some(self.drain_until.map_or(drain_until, |d| d.min(drain_until)));
            }
        }
    }

    /// Carry out everything the core has decided.
    fn carry_out(&mut self) {
        self.undecided = 0;
        while let Some(out) = self.core.poll() {
            match out {
                CoreOutput::Launch { group, task } => self.launch(group, task),
                CoreOutput::Complete { id: _, code, model, started, rejected, data } => {
                    self.complete(model, code, started, rejected, data)
                }
                CoreOutput::Released { model, group, policy } => self.release(model, group, policy),
            }
        }
    }

    /// A task finished on its worker (its watcher reports a worker's tasks in launch order, those
    /// whose launch failed included): split its output (or error) among its requests, then the
    /// core tells the policy.
    fn task_done(&mut self, model: usize, task: TaskId, failure: Option<Error>) {
        let now = self.now();
        let Some(group) = self.core.group(model) else { return };
        let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
        let Some((worker, Some(data))) = self.core.task(group, task).map(|t| (t.worker, t.data.clone()))
        else {
            return;
        };
        // Its leased CPUs go back to the group's pool. (A task given up on may still run on
        // them: the pool lends them again regardless, as the policy does its cores.)
        if let Some(free) = self.free_cpus.get_mut(group) {
            free.extend_from_slice(&data.lease);
        }
        // The runner makes the results readable (the CUDA runner copies them from pinned memory).
        state.runner.collect(worker, &data);
        let out_len = state.io.1;
        // A CPU stream holds the task's io while it runs it. A task given up on may still be
        // running (a computation that hangs): the engine never waits for it, and reads a stand-in
        // of the same kind with nothing in it (its requests complete with `failure`).
        let (mut held, mut stand_in);
        let io: &mut TaskIo = match data.io.try_lock() {
            Ok(g) => {
                held = g;
                &mut held
            }
            Err(TryLockError::Poisoned(p)) => {
                held = p.into_inner();
                &mut held
            }
            Err(TryLockError::WouldBlock) if failure.is_some() => {
                // Built only here, off the hot path (the task is still in the core).
                let kind =
                    self.core.task(group, task).map_or(Work::Dense(Vec::new()), |t| empty_work(&t.shape));
                if matches!(kind, Work::Dense(_)) {
                    // It may be reading ring slots, which its policy frees now (see below).
                    state.ring = None;
                }
                let stages = StageTimes::default();
                stand_in = TaskIo { work: kind, output: Vec::new(), tokens: Vec::new(), error: None, stages };
                &mut stand_in
            }
            Err(TryLockError::WouldBlock) => {
                held = data.io.lock().unwrap_or_else(|p| p.into_inner());
                &mut held
            }
        };
        // A task given up on never delivers what its stream may still write (the runner's error,
        // if it set one, says more).
        if failure.is_some() && matches!(io.work, Work::Ring(_)) {
            // Given up on, the task may still be reading its slots, which its policy frees now:
            // nothing is written into this ring again.
            state.ring = None;
        }
        if failure.is_some() {
            // ... and may still write its requests' state slots: they are held back until its
            // stream catches up (a failed one never does).
            self.core.give_up(group, task);
        }
        let error = io.error.take().or(failure);
        let output = std::mem::take(&mut io.output);
        let s = io.stages;
        let report = TaskReport { task, upload: s.upload, compute: s.compute, download: s.download };
        let net = &*state.net;
        let done = if let Work::Cells(cells) = &io.work {
            let mut finished = Finished {
                task: cells,
                tokens: &io.tokens,
                outputs: output.chunks_exact(out_len.max(1)),
                recycle: state.admission.recycler(),
            };
            self.core.task_done(now, group, &report, |i, r, node| {
                let outcome = match &error {
                    Some(e) => Err(Error::new(Code::Backend, e.message())),
                    None => finished.row_outcome(
                        net,
                        &r.data.input,
                        &mut r.data.run.decoding,
                        i,
                        node.expect("cell tasks have nodes"),
                    ),
                };
                match outcome {
                    Ok(RowOutcome::Continue) => RowEnd::Continue,
                    Ok(RowOutcome::Result { output, early }) => {
                        r.data.run.result = Some(Ok(output));
                        if early { RowEnd::Early } else { RowEnd::Continue }
                    }
                    // A failed cell ends the request: its later cells would read bad state.
                    Err(e) if !matches!(r.data.run.result, Some(Err(_))) => {
                        r.data.run.result = Some(Err(e));
                        RowEnd::Early
                    }
                    Err(_) => RowEnd::Continue,
                }
            })
        } else if let Work::Layers { last, .. } = io.work {
            let (bounds, recycle, error) = (&state.bounds, state.admission.recycler(), error.as_ref());
            let mut output = Some(output);
            let block = (task, data.rows, last);
            self.core.task_done(now, group, &report, |row, r, _| {
                block_row_done(&mut r.data, row, block, bounds, error, &mut output, recycle)
            })
        } else {
            let rows = data.rows;
            let recycle = state.admission.recycler();
            self.core.task_done(now, group, &report, |row, r, _| {
                r.data.run.result = Some(match &error {
                    Some(e) => Err(Error::new(Code::Backend, e.message())),
                    None => match output.get(row * out_len..(row + 1) * out_len) {
                        Some(v) => Ok(Output::F32(recycle.output(v))),
                        None => Err(short_output(task, output.len(), rows, out_len)),
                    },
                });
                RowEnd::Continue
            })
        };
        // Admission counts work in cells: a task of several steps ran each of its rows' steps.
        let cells_run = match &io.work {
            Work::Cells(c) => Some(c.cells()),
            _ => None,
        };
        // A layer block is a part of its rows' work, not a row's: it does not measure the time
        // per row (the tenant policy expires its queries at block boundaries itself).
        let block = matches!(io.work, Work::Layers { .. });
        if let Some(done) = done {
            state.metrics.worker_busy(done.worker, done.busy);
            if let Some(c) = report.compute {
                state.metrics.worker_compute(done.worker, c);
                self.stats.record_compute(c);
                self.stats.record_leased_time(data.lease.len(), c);
            }
            // Only tasks that ran measure the time per row: a failed launch took none, and a
            // stalled stream's time says nothing about the next task's.
            if error.is_none() && !block {
                state.admission.observe_task(done.busy, cells_run.unwrap_or(done.rows));
            }
        }
    }

    /// Serve model `idx` in group `group` (installed).
    fn add_model(&mut self, idx: usize, group: usize, m: EngineModel) {
        if self.models.len() <= idx {
            self.models.resize_with(idx + 1, || None);
        }
        debug_assert!(self.models[idx].is_none(), "model index {idx} reused while taken");
        let EngineModel { net, runner, metrics, admission, ring, arrivals } = m;
        let workers = runner.workers();
        // The request tables (and the outbox, which never holds more completions than there
        // are requests) are reserved for the admission bound now: serving never grows them
        // later (`Policy::reserve`).
        let held = super::reserved_requests(admission.bound());
        self.core.add_model(idx, group, runner.state_slots(), held);
        self.outbox.reserve(self.core.max_requests().saturating_sub(self.outbox.len()));
        touch_spare(&mut self.outbox);
        let bounds = net.layer_bounds();
        self.models[idx] = Some(ModelState {
            net,
            io: runner.io_lens(),
            bounds,
            runner,
            metrics,
            admission,
            stalled: vec![false; workers],
            ring,
            arrivals,
        });
    }

    fn set_stalled(&mut self, model: usize, worker: usize, stalled: bool) {
        if let Some(Some(s)) = self.models.get_mut(model)
            && let Some(w) = s.stalled.get_mut(worker)
        {
            *w = stalled;
            if stalled {
                s.metrics.worker_stalled(worker);
            } else {
                // The stream has run every task launched on it, those given up on included: the
                // state slots held for them are free again.
                self.core.worker_caught_up(model, worker);
            }
        }
    }

    /// E²bird's one copy per request: the input into the slot its policy gave it, in the
    /// model's input ring (a model without a ring, or a request refused a slot: nothing).
    fn copy_into_ring(&mut self, model: usize, id: RequestId) {
        let Some(state) = self.models.get(model).and_then(|s| s.as_ref()) else { return };
        let Some(ring) = &state.ring else { return };
        let Some(slot) = self.core.input_slot(id) else { return };
        let Some(r) = self.core.request_mut(id) else { return };
        let net = &state.net;
        // SAFETY: the slot is free: the elastic policy gives an arriving request slot
        // `serial mod S` only once the batch that held serial − S was answered (its task ended
        // and was reported with its count, or the ring was dropped above, `task_done`), and
        // this thread is the ring's only writer.
        if unsafe { ring.write(slot, |row| net.dense_row(&r.data.input, row)) }.is_ok() {
            r.data.run.ring_slot = Some(slot);
            self.stats.record_ring_copy();
        }
    }

    /// Gather the batch input and start it on its worker. A task whose launch fails carries the
    /// error and is watched like any other, with a target reached at once: it is reported
    /// after the tasks launched before it on its worker, and policies rely on a worker's tasks
    /// finishing in launch order.
    fn launch(&mut self, group: usize, task: TaskId) {
        let Some(t) = self.core.task(group, task) else { return };
        let model = t.model;
        let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
        // Why the task's work cannot be built (it then fails like a failed launch).
        let mut unrunnable = None;
        let work = if let TaskShape::Layers { first, last } = t.shape {
            let (first, end) = (first as usize, last as usize + 1);
            let (requests, batch) = (t.requests.clone(), t.batch);
            let model = (&*state.net, &state.bounds[..]);
            block_work(&mut self.core, model, &requests, (first, end), batch).unwrap_or_else(|e| {
                unrunnable = Some(e);
                Work::Layers { first, last: end, input: Vec::new() }
            })
        } else if t.nodes().is_empty() {
            // A run of consecutive ring slots, every one a live request's: read in place.
            let slot_of =
                |i: usize| t.requests.get(i).and_then(|id| self.core.request(*id)?.data.run.ring_slot);
            let in_ring = state.ring.as_ref().and_then(|ring| {
                let first = slot_of(0)?;
                let run = t.requests.len() == t.batch && (1..t.batch).all(|i| slot_of(i) == Some(first + i));
                if run { ring.rows(first, t.batch) } else { None }
            });
            match in_ring {
                Some(rows) => Work::Ring(rows),
                None => {
                    let in_len = state.io.0;
                    let mut input = vec![state.net.dense_padding(); t.batch * in_len];
                    for (row, id) in t.requests.iter().enumerate() {
                        if let Some(r) = self.core.request(*id) {
                            state.net.dense_row(&r.data.input, &mut input[row * in_len..(row + 1) * in_len]);
                        }
                    }
                    self.stats.record_gather(t.requests.len());
                    Work::Dense(input)
                }
            }
        } else {
            let mut cells = CellTask {
                cell: t.cell(),
                rows: Vec::with_capacity(t.requests.len()),
                steps: t.shape.steps(),
                ..CellTask::default()
            };
            for (id, &node) in t.requests.iter().zip(t.nodes()) {
                let r = self.core.request(*id).expect("a launched request is pending");
                let graph = r.graph.as_ref().expect("cell rows belong to recurrent requests");
                if cells.steps() == 1 {
                    push_row(&state.net, &r.data.input, graph, &r.slots, node, &mut cells);
                } else if let Err(e) = push_path_row(&state.net, &r.data.input, &r.slots, node, &mut cells) {
                    unrunnable.get_or_insert(e);
                }
            }
            Work::Cells(cells)
        };
        let Some(t) = self.core.task(group, task) else { return };
        let (worker, rows) = (t.worker, t.requests.len());
        // The policy's thread bound for the task (0: the worker's), on CPUs leased from its
        // group's pool when it has one: the policy leases at most the cores it has free, which
        // are the CPUs free here (both change at the same launches and reports). Kernel
        // versions are not served yet, so `exec.version` is the default kernel's.
        let free = self.free_cpus.get_mut(group).filter(|c| !c.is_empty());
        let lease = match free {
            Some(free) if t.exec.cores > 0 => {
                debug_assert!(free.len() >= t.exec.cores, "{} cores leased of {free:?}", t.exec.cores);
                free.split_off(free.len().saturating_sub(t.exec.cores))
            }
            _ => Vec::new(),
        };
        if !lease.is_empty() {
            self.stats.record_lease(t.exec.conflict);
        }
        let data = TaskData::leased(t.batch, t.exec.cores, lease, work);
        self.stats.record_task(rows);
        state.metrics.task_launched(rows);
        self.core.attach(group, task, Some(data.clone()));
        let launched = if let Some(e) = unrunnable {
            Err(e)
        } else if state.stalled.get(worker).copied().unwrap_or(false) {
            Err(Error::new(
                Code::Backend,
                format!(
                    "worker {worker}'s stream is stalled (see the stall timeout); nothing is launched on it"
                ),
            ))
        } else {
            state.runner.launch(worker, data.clone())
        };
        let target = match launched {
            Ok(target) => target,
            Err(e) => {
                data.io.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e);
                0
            }
        };
        // A stream that notifies is watched here; one that does not, by the poller. If the poller
        // has stopped (the engine is going away, or the poller thread died), the task is never
        // reported, and its requests complete `Cancelled` with the engine.
        let signal = state.runner.signal(worker);
        if signal.notifies() {
            self.watcher.watch((model, worker, task), target, &signal, Instant::now());
            // A failed launch's target is reached with no notify to say so.
            self.recheck |= target == 0;
        } else {
            let _ = self.poller.watch((model, worker, task), target, signal);
        }
    }

    fn complete(
        &mut self,
        model: usize,
        code: Code,
        started: Option<Time>,
        rejected: Option<&'static str>,
        mut live: Live,
    ) {
        let result = match (code, rejected) {
            (Code::Ok, _) => live
                .run
                .result
                .take()
                .unwrap_or_else(|| Err(Error::internal("request completed without a result"))),
            (Code::Cancelled, _) => Err(Error::new(Code::Cancelled, "request cancelled")),
            (Code::DeadlineExceeded, _) => Err(Error::new(
                Code::DeadlineExceeded,
                if started.is_some() {
                    "the deadline passed while the request was running"
                } else {
                    "the deadline passed while the request was queued"
                },
            )),
            (other, Some(reason)) => {
                Err(Error::new(other, format!("the model's policy refused the request: {reason}")))
            }
            (other, None) => Err(Error::new(other, "request failed")),
        };
        self.finish(model, started, live, result, rejected.is_some());
    }

    /// Take the request's rows off the work ahead, record it in the metrics (as refused when
    /// `rejected`) and complete it (its admission permit goes on with the reply, released when
    /// the caller takes the result).
    fn finish(
        &mut self,
        model: usize,
        started: Option<Time>,
        mut live: Live,
        result: Result<Output>,
        rejected: bool,
    ) {
        let now = self.now();
        let submitted = self.time(live.submitted);
        let state = self.models.get_mut(model).and_then(|s| s.as_mut());
        if let Some(s) = &state {
            s.admission.finished(live.rows);
            let code = result.as_ref().map_or_else(|e| e.code(), |_| Code::Ok);
            if rejected {
                s.metrics.rejected(code);
            } else {
                s.metrics.completed(code, submitted, started, now);
            }
        }
        live.reply.complete(result, &mut self.outbox);
        if let Some(s) = state {
            // The spent record goes back to its model for the next submit (recycle.rs).
            s.admission.recycler().put_record(live);
        }
    }

    /// The core released a closing model (no request left, every task reported): its workers'
    /// watches are forgotten, its policy and runner are dropped, and its index becomes free.
    ///
    /// The policy and runner are dropped on the reaper thread, so the engine never waits for
    /// them. Dropping the runner joins its stream threads. None has a task left (every task's
    /// count was seen, which a stream advances after the task), so each only returns from
    /// its last notify and sees its queue closed: the wait is short and bounded — unless a
    /// stream still runs a task given up on (a custom call that hangs): then the reaper waits
    /// for that call, and the models released after this one wait their turn behind it. (A CUDA
    /// runner's drop waits for the device context to be idle, so for the work other models have
    /// in flight: the reason it is not done here.)
    fn release(&mut self, idx: usize, group: usize, policy: Option<Box<dyn Policy>>) {
        if policy.is_some() {
            // The group went with its last model.
            if let Some(cpus) = self.free_cpus.get_mut(group) {
                cpus.clear();
            }
            self.group_ids.give_back(group);
        }
        // Sent before the index is free, so it reaches the poller before any watch of a model
        // that reuses the index. (The slot is empty before the index is free, and a model added
        // under it is seen by this thread only after the drop.)
        self.poller.forget(idx);
        self.watcher.forget(idx);
        let state = self.models.get_mut(idx).and_then(|s| s.take());
        self.indices.lock().unwrap_or_else(|p| p.into_inner()).give_back(idx);
        // Dropped by the reaper thread; here only if it is gone.
        let _ = self.reaper.send(Box::new((state, policy)));
    }

    /// Shutdown deadline reached: every request still pending completes `Cancelled` now.
    fn cancel_everything(&mut self) {
        for (model, started, live) in self.core.drain_requests() {
            self.finish(model, started, live, Err(shutdown_cancelled()), false);
        }
    }
}

impl Drop for Engine {
    /// Deliver what was completed even if the engine thread unwinds; requests still pending
    /// complete `Cancelled` as their replies drop with the core.
    fn drop(&mut self) {
        flush(&mut self.outbox);
    }
}
