//! The engine thread: drives each model's sans-IO policy with the wall clock and carries out its
//! decisions (launch a task on a worker's stream, complete a request).
//!
//! Every event (arrival, cancel, task done, model added or freed, shutdown) arrives through one
//! channel; the engine owns all request and task state, so nothing here is shared or locked (but
//! the pool of model indices, which submitters' threads take from when they add a model).
//!
//! # Freeing a model
//!
//! When the last handle of a model is dropped, [`Event::RemoveModel`] marks it *closing*. No
//! request can arrive for it any more (every submit went through a handle, and sent its arrival
//! before the handle's drop sent the removal). Its pending requests complete as usual; once it
//! has no request left and no task in flight (the poller has reported every launched task), the
//! engine tells the poller to forget its workers, empties its slot, returns its index to the
//! [`ModelIndices`] pool (a later model may reuse the slot: the engine's per-model storage is as
//! long as the most models ever loaded at once), and hands its policy and runner to the reaper
//! thread, which drops them (joining its stream threads, which by then have nothing left to run,
//! and freeing its arena and buffers) while the engine goes on.

use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backend::{CellTask, Runner, TaskData, Work};
use crate::error::{Code, Error, Result};
use crate::model::{Input, Network, Output};
use crate::runtime::admission::Admission;
use crate::runtime::cells::{Finished, RequestCells, RowOutcome, SlotPool, push_row, slots_needed};
use crate::runtime::metrics::ModelMetrics;
use crate::runtime::poller::PollerCmd;
use crate::runtime::queue::{Completion, QueueShared};
use crate::runtime::request::{Reply, flush, shutdown_cancelled};
use crate::runtime::stats::Stats;
use crate::sched::{Arrival, CellGraph, Decision, IdMap, Launch, Policy, RequestId, TaskId, Time};

/// A request admitted by submit, on its way to the engine.
pub(crate) struct Pending {
    pub model: usize,
    /// When submit accepted it (the metrics' queue and latency times start here).
    pub submitted: Instant,
    /// Its rows of work, as admission counted them (released at completion).
    pub rows: u64,
    pub input: Input,
    /// The request unfolded into cells (recurrent models).
    pub cells: Option<Arc<CellGraph>>,
    pub deadline: Option<Instant>,
    pub priority: i32,
    pub reply: Reply,
}

/// A model as the engine sees it.
pub(crate) struct EngineModel {
    pub net: Arc<Network>,
    pub policy: Box<dyn Policy>,
    pub runner: Arc<dyn Runner>,
    pub metrics: Arc<ModelMetrics>,
    /// Released for every completed request; measures the time per row (admission.rs).
    pub admission: Arc<Admission>,
}

pub(crate) enum Event {
    AddModel(usize, Box<EngineModel>),
    /// The model's last handle was dropped: release it once its requests have completed.
    RemoveModel(usize),
    Arrive(Box<Pending>),
    Cancel(RequestId),
    /// A launched task is over: its count was seen, or (with `failure`) the poller gave up on
    /// it — its stream failed or stalled — and its requests complete with that error.
    TaskDone {
        model: usize,
        task: TaskId,
        failure: Option<Error>,
    },
    /// The stall watchdog gave up on the worker's stream (poller.rs): launch nothing more on it
    /// until it recovers; its tasks complete `BACKEND` at once.
    WorkerStalled {
        model: usize,
        worker: usize,
    },
    /// A stalled worker's stream completed its abandoned tasks after all: usable again.
    WorkerRecovered {
        model: usize,
        worker: usize,
    },
    /// The model's caller expects no more requests soon ([`Policy::flush`]).
    Flush(usize),
    /// Stop accepting; finish what is pending until `drain_until`, then cancel the rest and exit.
    Shutdown {
        drain_until: Instant,
    },
}

/// Events handled back to back before timers are checked and completions delivered.
const MAX_EVENTS_PER_TURN: usize = 256;

struct Request {
    pending: Pending,
    /// The result computed by the request's task(s), set when it is known.
    result: Option<Result<Output>>,
    /// Recurrent requests: state slots and decoding progress.
    cells: Option<RequestCells>,
    /// When the request was first part of a launched task (for the deadline message and the
    /// metrics' service time).
    started: Option<Instant>,
}

struct TaskEntry {
    data: Arc<TaskData>,
    /// The worker it was launched on (for [`Runner::collect`]).
    worker: usize,
    launched: Instant,
    /// The request and node of each real row.
    requests: Vec<RequestId>,
    nodes: Vec<u32>,
}

struct ModelState {
    m: EngineModel,
    tasks: IdMap<TaskEntry>,
    /// Input and output values per row.
    io: (usize, usize),
    /// State slots of a recurrent model, and the requests waiting for them.
    slots: SlotPool,
    /// Requests of the model the engine holds (arrived, not completed).
    requests: usize,
    /// When each worker's last reported task completed (a worker is busy from a task's launch or
    /// this, whichever is later, to the task's completion).
    worker_free_at: Vec<Instant>,
    /// Workers the stall watchdog gave up on and that have not recovered.
    stalled: Vec<bool>,
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
    /// Indexed by model index; `None` for a free index.
    models: Vec<Option<ModelState>>,
    indices: Arc<Mutex<ModelIndices>>,
    /// Closing models (see the module docs), released once idle.
    closing: Vec<usize>,
    /// Keyed with the cheap id hash: looked up for every row of every task.
    requests: IdMap<Request>,
    poller: Sender<PollerCmd>,
    /// Unparked after every watch, so a poller parked between a fast completion and the watch
    /// that announces it does not sleep out its park.
    poller_thread: std::thread::Thread,
    stats: Arc<Stats>,
    outbox: Vec<(Arc<QueueShared>, Completion)>,
    drain_until: Option<Instant>,
    /// Models whose freed state slots may admit waiting requests, once the decisions in hand are
    /// carried out (admitting re-enters the policy).
    admit_waiting_later: Vec<usize>,
    /// Where released models go to be dropped (the reaper thread, see `Runtime::start`).
    reaper: Sender<Box<dyn Send>>,
    /// The current event's instant, once read (see [`instant`](Self::instant)).
    clock: Option<Instant>,
}

impl Engine {
    pub(crate) fn new(
        epoch: Instant,
        poller: Sender<PollerCmd>,
        poller_thread: std::thread::Thread,
        stats: Arc<Stats>,
        indices: Arc<Mutex<ModelIndices>>,
        reaper: Sender<Box<dyn Send>>,
    ) -> Engine {
        Engine {
            epoch,
            models: Vec::new(),
            indices,
            closing: Vec::new(),
            requests: IdMap::default(),
            poller,
            poller_thread,
            stats,
            outbox: Vec::new(),
            drain_until: None,
            admit_waiting_later: Vec::new(),
            reaper,
            clock: None,
        }
    }

    fn time(&self, at: Instant) -> Time {
        Time(u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX))
    }

    /// The wall clock, read once per event (and once per timer pass): everything one event
    /// causes — a task's end, the launches and completions it leads to — happens at one instant,
    /// for the policies and the metrics alike, and the clock is not read per request.
    fn instant(&mut self) -> Instant {
        *self.clock.get_or_insert_with(Instant::now)
    }

    fn now(&mut self) -> Time {
        let at = self.instant();
        self.time(at)
    }

    /// The engine loop; returns when shut down and every request has completed.
    pub(crate) fn run(mut self, events: Receiver<Event>) {
        loop {
            let wake = self.next_wakeup();
            let ev = match wake {
                None => events.recv().map_err(|_| RecvTimeoutError::Disconnected),
                Some(at) => events.recv_timeout(at.saturating_duration_since(Instant::now())),
            };
            match ev {
                Ok(ev) => {
                    self.handle(ev);
                    // Take what else is already waiting before looking at timers, but never so much
                    // that timers and deliveries starve under a steady stream of arrivals.
                    for _ in 0..MAX_EVENTS_PER_TURN {
                        match events.try_recv() {
                            Ok(ev) => self.handle(ev),
                            Err(_) => break,
                        }
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => self.drain_until = Some(Instant::now()),
            }
            self.tick_due();
            self.admit_deferred();
            self.release_closed();
            self.publish();
            if let Some(until) = self.drain_until {
                if self.requests.is_empty() {
                    break;
                }
                if Instant::now() >= until {
                    self.cancel_everything();
                    break;
                }
            }
        }
        // Requests still in the channel (none, with the submit gate closed first) are dropped with
        // it; their replies complete them `Cancelled`.
        let _ = self.poller.send(PollerCmd::Stop);
        // Policies and runners go now: streams finish the task in hand and their threads end.
        self.models.clear();
        self.publish();
    }

    /// Update the gauges, then deliver: a caller that has seen its completion never reads a
    /// gauge older than it.
    fn publish(&mut self) {
        let (mut queued, mut running) = (0, 0);
        for s in self.models.iter().flatten() {
            let q = s.m.policy.queued();
            queued += q;
            running += s.m.policy.running();
            s.m.metrics.set_gauges(q, s.requests);
        }
        self.stats.set_gauges(queued, running);
        flush(&mut self.outbox);
    }

    fn next_wakeup(&self) -> Option<Instant> {
        let policy = self
            .models
            .iter()
            .flatten()
            .filter_map(|s| s.m.policy.next_wakeup())
            .min()
            .and_then(|t| self.epoch.checked_add(std::time::Duration::from_nanos(t.0)));
        policy.into_iter().chain(self.drain_until).chain(self.waiting_deadline()).min()
    }

    /// The earliest deadline of a request waiting for state slots (the policy has not seen it).
    fn waiting_deadline(&self) -> Option<Instant> {
        self.models
            .iter()
            .flatten()
            .flat_map(|s| s.slots.waiting.iter())
            .filter_map(|id| self.requests.get(id).and_then(|r| r.pending.deadline))
            .min()
    }

    /// Requests whose deadline passed while they waited for state slots complete
    /// `DeadlineExceeded` (they never reached the policy, which would have expired them).
    fn expire_waiting(&mut self) {
        let now = self.instant();
        let mut expired = Vec::new();
        for state in self.models.iter_mut().flatten() {
            let requests = &self.requests;
            state.slots.waiting.retain(|id| {
                let late = requests.get(id).and_then(|r| r.pending.deadline).is_some_and(|d| d <= now);
                if late {
                    expired.push(*id);
                }
                !late
            });
        }
        for id in expired {
            self.complete(id, Code::DeadlineExceeded);
        }
    }

    fn tick_due(&mut self) {
        self.clock = None;
        self.expire_waiting();
        let now = self.now();
        for idx in 0..self.models.len() {
            let due =
                matches!(&self.models[idx], Some(s) if s.m.policy.next_wakeup().is_some_and(|t| t <= now));
            if due {
                self.with_policy(idx, |p| p.tick(now));
            }
        }
    }

    /// Admit requests waiting for state slots that completions freed.
    fn admit_deferred(&mut self) {
        while let Some(model) = self.admit_waiting_later.pop() {
            self.admit_waiting(model);
        }
    }

    fn handle(&mut self, ev: Event) {
        self.clock = None;
        self.handle_event(ev);
        self.admit_deferred();
    }

    fn handle_event(&mut self, ev: Event) {
        match ev {
            Event::AddModel(idx, m) => {
                if self.models.len() <= idx {
                    self.models.resize_with(idx + 1, || None);
                }
                let io = m.runner.io_lens();
                let slots = SlotPool::new(m.runner.state_slots());
                debug_assert!(self.models[idx].is_none(), "model index {idx} reused while taken");
                let workers = m.runner.workers();
                let state = ModelState {
                    m: *m,
                    tasks: IdMap::default(),
                    io,
                    slots,
                    requests: 0,
                    worker_free_at: vec![Instant::now(); workers],
                    stalled: vec![false; workers],
                };
                self.models[idx] = Some(state);
            }
            Event::RemoveModel(idx) => {
                // Sent once, by the last handle's drop; the index is not reused before release.
                debug_assert!(!self.closing.contains(&idx), "model {idx} removed twice");
                if matches!(self.models.get(idx), Some(Some(_))) {
                    self.closing.push(idx);
                }
            }
            Event::Arrive(mut p) => {
                let id = p.reply.id();
                let model = p.model;
                let cells = p.cells.take().map(RequestCells::new);
                let recurrent = cells.is_some();
                // A handle is alive while it submits, so its model is here and not closing;
                // were it not, the dropped reply completes the request `Cancelled`.
                let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
                state.requests += 1;
                self.requests.insert(id, Request { pending: *p, result: None, cells, started: None });
                if recurrent {
                    // Requests take their state slots in arrival order.
                    state.slots.waiting.push_back(id);
                    self.admit_waiting(model);
                } else {
                    self.arrive(model, id);
                }
            }
            Event::Cancel(id) => {
                let Some(model) = self.requests.get(&id).map(|r| r.pending.model) else { return };
                let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
                if let Some(at) = state.slots.waiting.iter().position(|&w| w == id) {
                    // Still waiting for state slots: the policy never saw it.
                    state.slots.waiting.remove(at);
                    self.complete(id, Code::Cancelled);
                } else {
                    let now = self.now();
                    self.with_policy(model, |p| p.cancel(now, id));
                }
            }
            Event::TaskDone { model, task, failure } => self.task_done(model, task, failure),
            Event::WorkerStalled { model, worker } => self.set_stalled(model, worker, true),
            Event::WorkerRecovered { model, worker } => self.set_stalled(model, worker, false),
            Event::Flush(model) => {
                let now = self.now();
                self.with_policy(model, |p| p.flush(now));
            }
            Event::Shutdown { drain_until } => {
                self.drain_until = Some(self.drain_until.map_or(drain_until, |d| d.min(drain_until)));
            }
        }
    }

    /// Give the request to its model's policy.
    fn arrive(&mut self, model: usize, id: RequestId) {
        let r = &self.requests[&id];
        let arrival = Arrival {
            id,
            deadline: r.pending.deadline.map(|d| self.time(d)),
            priority: r.pending.priority,
            cells: r.cells.as_ref().map(|c| c.graph.clone()),
        };
        let now = self.now();
        self.with_policy(model, |pol| pol.arrive(now, arrival));
    }

    /// Hand state slots to waiting requests, in arrival order, while there are enough.
    fn admit_waiting(&mut self, model: usize) {
        loop {
            let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
            let Some(&id) = state.slots.waiting.front() else { return };
            let Some(rc) = self.requests.get_mut(&id).and_then(|r| r.cells.as_mut()) else {
                state.slots.waiting.pop_front();
                continue;
            };
            let Some(slots) = state.slots.take(slots_needed(&state.m.net, &rc.graph)) else { return };
            rc.slots = slots;
            state.slots.waiting.pop_front();
            self.arrive(model, id);
        }
    }

    /// A task finished on its worker (the poller reports a worker's tasks in launch order, those
    /// whose launch failed included): hand out its results, then tell the policy.
    fn task_done(&mut self, model: usize, task: TaskId, failure: Option<Error>) {
        if let Some(ended) = self.collect_results(model, task, failure) {
            let now = self.now();
            self.with_policy(model, |p| {
                for id in ended {
                    p.end_early(now, id);
                }
                p.task_done(now, task)
            });
        }
    }

    /// Split a finished task's output (or error) among its requests. `None` for an unknown task;
    /// otherwise the requests that ended before their last cell (the policy must be told).
    fn collect_results(
        &mut self,
        model: usize,
        task: TaskId,
        failure: Option<Error>,
    ) -> Option<Vec<RequestId>> {
        let done = self.instant();
        let state = self.models.get_mut(model).and_then(|s| s.as_mut())?;
        let entry = state.tasks.remove(&task)?;
        // The time the task held its worker: from its launch, or from the previous task's end if
        // it was launched by then. A task launched while the engine handled the previous one's
        // end carries that event's instant (one clock read per event), so its time includes the
        // turn-around a backlogged worker pays per task; one launched later found it idle.
        let mut busy = Duration::ZERO;
        if let Some(free_at) = state.worker_free_at.get_mut(entry.worker) {
            busy = done.saturating_duration_since(entry.launched.max(*free_at));
            state.m.metrics.worker_busy(entry.worker, busy);
            *free_at = done;
        }
        // The runner makes the results readable (the CUDA runner copies them from pinned memory).
        state.m.runner.collect(entry.worker, &entry.data);
        let out_len = state.io.1;
        let mut io = entry.data.io.lock().unwrap_or_else(|p| p.into_inner());
        // A task given up on never delivers what its stream may still write (the runner's error,
        // if it set one, says more).
        let error = io.error.take().or(failure);
        if error.is_none() {
            // Only tasks that ran measure the time per row: a failed launch took none, and a
            // stalled stream's time says nothing about the next task's.
            state.m.admission.observe_task(busy, entry.requests.len());
        }
        let output = std::mem::take(&mut io.output);
        let mut ended = Vec::new();
        if let Work::Cells(cells) = &io.work {
            let net = &*state.m.net;
            let mut finished =
                Finished { task: cells, tokens: &io.tokens, outputs: output.chunks_exact(out_len.max(1)) };
            for (i, (id, &node)) in entry.requests.iter().zip(&entry.nodes).enumerate() {
                let Some(r) = self.requests.get_mut(id) else { continue };
                let outcome = match &error {
                    Some(e) => Err(Error::new(Code::Backend, e.message())),
                    None => {
                        let rc = r.cells.as_mut().expect("cell rows belong to recurrent requests");
                        finished.row_outcome(net, &r.pending.input, rc, i, node)
                    }
                };
                match outcome {
                    Ok(RowOutcome::Continue) => {}
                    Ok(RowOutcome::Result { output, early }) => {
                        r.result = Some(Ok(output));
                        if early {
                            ended.push(*id);
                        }
                    }
                    Err(e) => {
                        // A failed cell ends the request: its later cells would read bad state.
                        if !matches!(r.result, Some(Err(_))) {
                            r.result = Some(Err(e));
                            ended.push(*id);
                        }
                    }
                }
            }
        } else {
            for (row, id) in entry.requests.iter().enumerate() {
                let Some(r) = self.requests.get_mut(id) else { continue };
                r.result = Some(match &error {
                    Some(e) => Err(Error::new(Code::Backend, e.message())),
                    None => match output.get(row * out_len..(row + 1) * out_len) {
                        Some(v) => Ok(Output::F32(v.to_vec())),
                        None => Err(Error::internal(format!(
                            "task {task} produced {} values for {} rows of {out_len}",
                            output.len(),
                            entry.data.rows
                        ))),
                    },
                });
            }
        }
        drop(io);
        state.m.policy.recycle(entry.requests, entry.nodes);
        Some(ended)
    }

    /// Feed one event to a model's policy and carry out every decision it makes.
    fn with_policy(&mut self, model: usize, f: impl FnOnce(&mut dyn Policy)) {
        let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
        f(&mut *state.m.policy);
        loop {
            let Some(state) = self.models.get_mut(model).and_then(|s| s.as_mut()) else { return };
            let Some(d) = state.m.policy.poll() else { return };
            match d {
                Decision::Launch(l) => self.launch(model, l),
                Decision::Complete { id, code } => self.complete(id, code),
            }
        }
    }

    fn set_stalled(&mut self, model: usize, worker: usize, stalled: bool) {
        if let Some(Some(s)) = self.models.get_mut(model)
            && let Some(w) = s.stalled.get_mut(worker)
        {
            *w = stalled;
            if stalled {
                s.m.metrics.worker_stalled(worker);
            }
        }
    }

    /// Gather the batch input and start it on its worker. A task whose launch fails carries the
    /// error and is watched like any other, with a target reached at once: the poller reports it
    /// after the tasks launched before it on its worker, and policies rely on a worker's tasks
    /// finishing in launch order.
    fn launch(&mut self, model: usize, l: Launch) {
        let now = self.instant();
        let state = self.models[model].as_mut().expect("model present");
        let work = if l.nodes.is_empty() {
            let in_len = state.io.0;
            let mut input = vec![0.0f32; l.batch * in_len];
            for (row, id) in l.requests.iter().enumerate() {
                if let Some(Request { pending: Pending { input: Input::F32(v), .. }, started, .. }) =
                    self.requests.get_mut(id)
                {
                    input[row * in_len..(row + 1) * in_len].copy_from_slice(v);
                    started.get_or_insert(now);
                }
            }
            Work::Dense(input)
        } else {
            let mut cells =
                CellTask { cell: l.cell, rows: Vec::with_capacity(l.requests.len()), children: Vec::new() };
            for (id, &node) in l.requests.iter().zip(&l.nodes) {
                let r = self.requests.get_mut(id).expect("a launched request is pending");
                r.started.get_or_insert(now);
                let rc = r.cells.as_ref().expect("cell rows belong to recurrent requests");
                push_row(&state.m.net, &r.pending.input, rc, node, &mut cells);
            }
            Work::Cells(cells)
        };
        let data = TaskData::new(l.batch, work);
        self.stats.record_task(l.requests.len());
        state.m.metrics.task_launched(l.requests.len());
        let entry = TaskEntry {
            data: data.clone(),
            worker: l.worker,
            launched: now,
            requests: l.requests,
            nodes: l.nodes,
        };
        state.tasks.insert(l.task, entry);
        let launched = if state.stalled.get(l.worker).copied().unwrap_or(false) {
            Err(Error::new(
                Code::Backend,
                format!(
                    "worker {}'s stream is stalled (see the stall timeout); nothing is launched on it",
                    l.worker
                ),
            ))
        } else {
            state.m.runner.launch(l.worker, data.clone())
        };
        let target = match launched {
            Ok(target) => target,
            Err(e) => {
                data.io.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e);
                0
            }
        };
        let signal = state.m.runner.signal(l.worker);
        let cmd = PollerCmd::Watch { model, worker: l.worker, task: l.task, target, signal };
        if self.poller.send(cmd).is_err() {
            // The poller has stopped (the engine is going away, or the poller thread died): the
            // task is never reported, and its requests complete `Cancelled` with the engine.
            return;
        }
        self.poller_thread.unpark();
    }

    fn complete(&mut self, id: RequestId, code: Code) {
        let Some(Request { pending, result: computed, cells, started }) = self.requests.remove(&id) else {
            return;
        };
        if let Some(mut rc) = cells
            && !rc.slots.is_empty()
            && let Some(Some(state)) = self.models.get_mut(pending.model)
        {
            // Nothing of the request runs any more (the policy's contract): its slots are free.
            state.slots.give_back(&mut rc.slots);
            let model = pending.model;
            self.admit_waiting_later.push(model);
        }
        let result = match code {
            Code::Ok => {
                computed.unwrap_or_else(|| Err(Error::internal("request completed without a result")))
            }
            Code::Cancelled => Err(Error::new(Code::Cancelled, "request cancelled")),
            Code::DeadlineExceeded => Err(Error::new(
                Code::DeadlineExceeded,
                if started.is_some() {
                    "the deadline passed while the request was running"
                } else {
                    "the deadline passed while the request was queued"
                },
            )),
            other => Err(Error::new(other, "request failed")),
        };
        self.finish(pending, started, result);
    }

    /// Take the request's rows off the work ahead, record it in the metrics and complete it
    /// (its admission permit goes on with the reply, released when the caller takes the result).
    fn finish(&mut self, p: Pending, started: Option<Instant>, result: Result<Output>) {
        let now = self.instant();
        if let Some(Some(s)) = self.models.get_mut(p.model) {
            s.requests -= 1;
            s.m.admission.finished(p.rows);
            let code = result.as_ref().map_or_else(|e| e.code(), |_| Code::Ok);
            s.m.metrics.completed(code, p.submitted, started, now);
        }
        p.reply.complete(result, &mut self.outbox);
    }

    /// Release every closing model that has no request left and no task in flight: the poller
    /// forgets its workers, its policy and runner are dropped, and its index becomes free.
    ///
    /// The policy and runner are dropped on the reaper thread, so the engine never waits for
    /// them. Dropping the runner joins its stream threads. None has a task left (the poller saw
    /// every task's count, which a stream advances after the task), so each only returns from
    /// its last notify and sees its queue closed: the wait is short and bounded. (A CUDA
    /// runner's drop waits for the device context to be idle, so for the work other models have
    /// in flight: the reason it is not done here.)
    fn release_closed(&mut self) {
        let mut k = 0;
        while k < self.closing.len() {
            let idx = self.closing[k];
            let idle = matches!(&self.models[idx], Some(s) if s.requests == 0 && s.tasks.is_empty());
            if !idle {
                k += 1;
                continue;
            }
            self.closing.swap_remove(k);
            // Sent before the index is free, so it reaches the poller before any watch of a
            // model that reuses the index. (The slot is empty before the index is free, and a
            // model added under it is seen by this thread only after the drop.)
            let _ = self.poller.send(PollerCmd::Forget { model: idx });
            let state = self.models[idx].take();
            self.indices.lock().unwrap_or_else(|p| p.into_inner()).give_back(idx);
            if let Some(state) = state {
                // Dropped by the reaper thread; here only if it is gone.
                let _ = self.reaper.send(Box::new(state));
            }
        }
    }

    /// Shutdown deadline reached: every request still pending completes `Cancelled` now.
    fn cancel_everything(&mut self) {
        let pending: Vec<(Pending, Option<Instant>)> =
            self.requests.drain().map(|(_, r)| (r.pending, r.started)).collect();
        for (p, started) in pending {
            self.finish(p, started, Err(shutdown_cancelled()));
        }
    }
}

impl Drop for Engine {
    /// Deliver what was completed even if the engine thread unwinds; requests still pending
    /// complete `Cancelled` as their replies drop with `requests`.
    fn drop(&mut self) {
        flush(&mut self.outbox);
    }
}
