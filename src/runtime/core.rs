//! `EngineCore`: the engine with no I/O (ARCHITECTURE.md §3.2). It owns the requests of every
//! model, their state slots and deadlines (as [`Time`]), the tasks in flight, the routing of
//! events to each model's policy, and what a finished task means for its requests (a Seq2Seq
//! row that decoded `eos` ends its request early). It never reads a clock, spawns a thread or
//! touches a backend: events come in with an explicit `now` ([`submit`](EngineCore::submit),
//! [`cancel`](EngineCore::cancel), [`task_done`](EngineCore::task_done),
//! [`tick`](EngineCore::tick), [`flush`](EngineCore::flush)), and what to do comes out of
//! [`poll`](EngineCore::poll) — launch this task on that worker, deliver this request, release
//! this model — plus [`next_wakeup`](EngineCore::next_wakeup).
//!
//! Two drivers share it: the threaded engine (`engine.rs`: wall clock, real backend, poller) and
//! the discrete-event simulator (`crate::sim`: virtual clock, cost model). What the simulator
//! shows is what the runtime decides, because the deciding is this code.
//!
//! `R` is the driver's own per-request data (the real engine's input, reply and result; the
//! simulator's arrival time), carried untouched and handed back at completion; `T` its own
//! per-task data (the real engine's `TaskData`; nothing for the simulator), attached after a
//! launch and dropped with the task.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Code;
use crate::sched::{CellGraph, CellType, Decision, IdMap, Policy, RequestId, TaskId, Time, WorkerId};

/// A request as the core holds it.
pub(crate) struct CoreRequest<R> {
    pub model: usize,
    /// The request unfolded into cells (recurrent models).
    pub graph: Option<Arc<CellGraph>>,
    /// Its state slots (empty while it waits for them, and for fixed-shape requests).
    pub slots: Vec<u32>,
    slots_needed: usize,
    pub deadline: Option<Time>,
    pub priority: i32,
    /// When it was first part of a launched task.
    pub started: Option<Time>,
    pub data: R,
}

/// A request entering the core.
pub(crate) struct Submit<R> {
    pub model: usize,
    pub id: RequestId,
    pub graph: Option<Arc<CellGraph>>,
    /// State slots it needs before its policy may see it (0 for fixed-shape requests).
    pub slots_needed: usize,
    pub deadline: Option<Time>,
    pub priority: i32,
    pub data: R,
}

/// A task in flight, as its policy launched it.
pub(crate) struct CoreTask<T> {
    pub worker: WorkerId,
    pub cell: CellType,
    pub launched: Time,
    /// The request of each real row, and its node (empty for fixed-shape tasks).
    pub requests: Vec<RequestId>,
    pub nodes: Vec<u32>,
    /// Rows computed, padding included.
    pub batch: usize,
    /// The driver's data of the task ([`EngineCore::attach`]).
    pub data: T,
}

/// What one finished row means for its request (the driver reads the backend's output; the
/// core tells the policy).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RowEnd {
    /// Nothing to tell the policy: more cells follow, or this was the request's last cell.
    Continue,
    /// The request's output is complete before its last cell (a decoder emitted `eos`), or the
    /// row failed (its later cells would read bad state): the policy drops its remaining cells.
    Early,
}

/// What the driver learns of a finished task, for its metrics and admission.
pub(crate) struct TaskEnd {
    pub worker: WorkerId,
    /// Real rows.
    pub rows: usize,
    /// How long the task held its worker: from its launch, or from the previous task's end if
    /// it was launched before that.
    pub busy: Duration,
}

/// What the driver is to do next.
pub(crate) enum CoreOutput<R> {
    /// Start the task ([`EngineCore::task`] describes it) on its worker, then report
    /// [`EngineCore::task_done`] exactly once when it is over (also if its launch fails).
    Launch { model: usize, task: TaskId },
    /// The request is complete with `code` (`Ok`: its result, which the driver holds, is to be
    /// delivered).
    Complete { id: RequestId, code: Code, model: usize, started: Option<Time>, data: R },
    /// A closed model has no request and no task left: the driver releases its resources and
    /// may reuse the index.
    Released { model: usize, policy: Box<dyn Policy> },
}

struct CoreModel<T> {
    policy: Box<dyn Policy>,
    tasks: IdMap<CoreTask<T>>,
    /// Free state slots, and the requests waiting for slots in arrival order (their policy has
    /// not seen them yet).
    free_slots: Vec<u32>,
    waiting: VecDeque<RequestId>,
    /// Requests held (arrived, not completed).
    requests: usize,
    /// When each worker's last reported task ended.
    worker_free_at: Vec<Time>,
    closing: bool,
}

pub(crate) struct EngineCore<R, T = ()> {
    models: Vec<Option<CoreModel<T>>>,
    requests: IdMap<CoreRequest<R>>,
    /// The latest instant an event carried; decisions taken while draining happen then.
    now: Time,
    /// Models whose policy may have decisions pending, drained by `poll`.
    dirty: Vec<usize>,
    /// Models whose freed slots may admit waiting requests once the decisions in hand are out.
    slots_freed: Vec<usize>,
    /// Completions the core decided itself (cancel or expiry while waiting for slots).
    ready: VecDeque<CoreOutput<R>>,
    closing: usize,
}

impl<R, T> Default for EngineCore<R, T> {
    fn default() -> Self {
        EngineCore {
            models: Vec::new(),
            requests: IdMap::default(),
            now: Time::ZERO,
            dirty: Vec::new(),
            slots_freed: Vec::new(),
            ready: VecDeque::new(),
            closing: 0,
        }
    }
}

impl<R, T: Default> EngineCore<R, T> {
    fn at(&mut self, now: Time) -> Time {
        self.now = self.now.max(now);
        self.now
    }

    fn model_mut(&mut self, model: usize) -> Option<&mut CoreModel<T>> {
        self.models.get_mut(model).and_then(|m| m.as_mut())
    }

    fn model(&self, model: usize) -> Option<&CoreModel<T>> {
        self.models.get(model).and_then(|m| m.as_ref())
    }

    /// Serve a model under index `model` (free: never used, or released) with `policy`,
    /// `state_slots` state slots and `workers` workers.
    pub fn add_model(&mut self, model: usize, policy: Box<dyn Policy>, state_slots: usize, workers: usize) {
        if self.models.len() <= model {
            self.models.resize_with(model + 1, || None);
        }
        debug_assert!(self.models[model].is_none(), "model index {model} reused while taken");
        self.models[model] = Some(CoreModel {
            policy,
            tasks: IdMap::default(),
            free_slots: (0..u32::try_from(state_slots).unwrap_or(u32::MAX)).rev().collect(),
            waiting: VecDeque::new(),
            requests: 0,
            worker_free_at: vec![self.now; workers],
            closing: false,
        });
    }

    /// No request will arrive for the model any more: release it once its requests have
    /// completed and its tasks are reported (a [`CoreOutput::Released`]).
    pub fn close_model(&mut self, model: usize) {
        if let Some(m) = self.model_mut(model)
            && !m.closing
        {
            m.closing = true;
            self.closing += 1;
        }
    }

    /// A request arrives. Returns it if its model is not served (closed or never added).
    pub fn submit(&mut self, now: Time, s: Submit<R>) -> Result<(), R> {
        self.at(now);
        let Some(m) = self.model_mut(s.model).filter(|m| !m.closing) else { return Err(s.data) };
        m.requests += 1;
        let recurrent = s.slots_needed > 0;
        if recurrent {
            // Requests take their state slots in arrival order.
            m.waiting.push_back(s.id);
        }
        let r = CoreRequest {
            model: s.model,
            graph: s.graph,
            slots: Vec::new(),
            slots_needed: s.slots_needed,
            deadline: s.deadline,
            priority: s.priority,
            started: None,
            data: s.data,
        };
        self.requests.insert(s.id, r);
        if recurrent {
            self.admit_waiting(s.model);
        } else {
            self.arrive(s.model, s.id);
        }
        Ok(())
    }

    /// Give a request to its model's policy.
    fn arrive(&mut self, model: usize, id: RequestId) {
        let Some(r) = self.requests.get(&id) else { return };
        let arrival =
            crate::sched::Arrival { id, deadline: r.deadline, priority: r.priority, cells: r.graph.clone() };
        let now = self.now;
        if let Some(m) = self.model_mut(model) {
            m.policy.arrive(now, arrival);
            self.dirty.push(model);
        }
    }

    /// Hand state slots to waiting requests, in arrival order, while there are enough.
    fn admit_waiting(&mut self, model: usize) {
        loop {
            let Some(m) = self.models.get_mut(model).and_then(|m| m.as_mut()) else { return };
            let Some(&id) = m.waiting.front() else { return };
            let Some(r) = self.requests.get_mut(&id) else {
                m.waiting.pop_front();
                continue;
            };
            let Some(at) = m.free_slots.len().checked_sub(r.slots_needed) else { return };
            r.slots = m.free_slots.split_off(at);
            m.waiting.pop_front();
            self.arrive(model, id);
        }
    }

    /// The caller asked to cancel `id` (unknown or completed ids are ignored).
    pub fn cancel(&mut self, now: Time, id: RequestId) {
        let now = self.at(now);
        let Some(model) = self.requests.get(&id).map(|r| r.model) else { return };
        let Some(m) = self.model_mut(model) else { return };
        if let Some(at) = m.waiting.iter().position(|&w| w == id) {
            // Still waiting for state slots: its policy never saw it.
            m.waiting.remove(at);
            self.complete(id, Code::Cancelled);
        } else {
            m.policy.cancel(now, id);
            self.dirty.push(model);
        }
    }

    /// The model's caller expects no more requests soon ([`Policy::flush`]).
    pub fn flush(&mut self, now: Time, model: usize) {
        let now = self.at(now);
        if let Some(m) = self.model_mut(model) {
            m.policy.flush(now);
            self.dirty.push(model);
        }
    }

    /// Time has advanced to `now`: requests waiting for slots past their deadline complete
    /// `DeadlineExceeded`, and policies whose wakeup is due are ticked.
    pub fn tick(&mut self, now: Time) {
        let now = self.at(now);
        let mut expired = Vec::new();
        for m in self.models.iter_mut().flatten() {
            let requests = &self.requests;
            m.waiting.retain(|id| {
                let late = requests.get(id).and_then(|r| r.deadline).is_some_and(|d| d <= now);
                if late {
                    expired.push(*id);
                }
                !late
            });
        }
        for id in expired {
            self.complete(id, Code::DeadlineExceeded);
        }
        for (idx, m) in self.models.iter_mut().enumerate() {
            if let Some(m) = m
                && m.policy.next_wakeup().is_some_and(|t| t <= now)
            {
                m.policy.tick(now);
                self.dirty.push(idx);
            }
        }
    }

    /// When the core next needs a [`tick`](Self::tick) if nothing else happens first.
    pub fn next_wakeup(&self) -> Option<Time> {
        let mut wake: Option<Time> = None;
        for m in self.models.iter().flatten() {
            let waiting = m.waiting.iter().filter_map(|id| self.requests.get(id).and_then(|r| r.deadline));
            for t in m.policy.next_wakeup().into_iter().chain(waiting) {
                wake = Some(wake.map_or(t, |w| w.min(t)));
            }
        }
        wake
    }

    /// A launched task is over. `row` interprets each of its real rows for its request (in row
    /// order) and says whether the request ended early; the policy is told of those ends, then
    /// of the task. `None` for an unknown task.
    pub fn task_done(
        &mut self,
        now: Time,
        model: usize,
        task: TaskId,
        mut row: impl FnMut(usize, &mut CoreRequest<R>, Option<u32>) -> RowEnd,
    ) -> Option<TaskEnd> {
        let now = self.at(now);
        let m = self.models.get_mut(model).and_then(|m| m.as_mut())?;
        let entry = m.tasks.remove(&task)?;
        let mut busy = Duration::ZERO;
        if let Some(free_at) = m.worker_free_at.get_mut(entry.worker) {
            busy = now.since(entry.launched.max(*free_at));
            *free_at = now;
        }
        let cells = !entry.nodes.is_empty();
        for (i, id) in entry.requests.iter().enumerate() {
            let Some(r) = self.requests.get_mut(id) else { continue };
            let node = if cells { Some(entry.nodes[i]) } else { None };
            if row(i, r, node) == RowEnd::Early {
                m.policy.end_early(now, *id);
            }
        }
        m.policy.task_done(now, task);
        self.dirty.push(model);
        let done = TaskEnd { worker: entry.worker, rows: entry.requests.len(), busy };
        m.policy.recycle(entry.requests, entry.nodes);
        Some(done)
    }

    /// A task in flight.
    pub fn task(&self, model: usize, task: TaskId) -> Option<&CoreTask<T>> {
        self.model(model)?.tasks.get(&task)
    }

    /// Attach the driver's data to a task in flight (after its launch).
    pub fn attach(&mut self, model: usize, task: TaskId, data: T) {
        if let Some(t) = self.model_mut(model).and_then(|m| m.tasks.get_mut(&task)) {
            t.data = data;
        }
    }

    pub fn request(&self, id: RequestId) -> Option<&CoreRequest<R>> {
        self.requests.get(&id)
    }

    /// Requests held, all models.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Requests of the model held (arrived, not completed).
    pub fn requests_of(&self, model: usize) -> usize {
        self.model(model).map_or(0, |m| m.requests)
    }

    /// The model's requests not started (waiting for slots, or queued in its policy).
    pub fn queued(&self, model: usize) -> usize {
        self.model(model).map_or(0, |m| m.waiting.len() + m.policy.queued())
    }

    /// The model's requests started and not complete.
    pub fn running(&self, model: usize) -> usize {
        self.model(model).map_or(0, |m| m.policy.running())
    }

    /// Every request still held completes now, its data handed back (shutdown's deadline).
    pub fn drain_requests(&mut self) -> Vec<(usize, Option<Time>, R)> {
        let out: Vec<_> = self.requests.drain().map(|(_, r)| (r.model, r.started, r.data)).collect();
        for m in self.models.iter_mut().flatten() {
            m.requests = 0;
            m.waiting.clear();
        }
        out
    }

    /// Take a request out, give its slots back and build its completion.
    fn complete(&mut self, id: RequestId, code: Code) -> Option<()> {
        let r = self.requests.remove(&id)?;
        if let Some(m) = self.models.get_mut(r.model).and_then(|m| m.as_mut()) {
            m.requests -= 1;
            if !r.slots.is_empty() {
                // Nothing of the request runs any more (the policy's contract): its slots are free.
                let mut slots = r.slots;
                m.free_slots.append(&mut slots);
                self.slots_freed.push(r.model);
            }
        }
        self.ready.push_back(CoreOutput::Complete {
            id,
            code,
            model: r.model,
            started: r.started,
            data: r.data,
        });
        Some(())
    }

    /// The next thing for the driver to do. Drain until `None` after every event: the
    /// decisions of a policy are taken out one at a time, so a launch is handed out before
    /// anything decided after it happens.
    pub fn poll(&mut self) -> Option<CoreOutput<R>> {
        loop {
            if let Some(out) = self.ready.pop_front() {
                return Some(out);
            }
            if let Some(&model) = self.dirty.last() {
                let Some(m) = self.models.get_mut(model).and_then(|m| m.as_mut()) else {
                    self.dirty.pop();
                    continue;
                };
                match m.policy.poll() {
                    Some(Decision::Launch(l)) => {
                        let now = self.now;
                        for id in &l.requests {
                            if let Some(r) = self.requests.get_mut(id) {
                                r.started.get_or_insert(now);
                            }
                        }
                        let task = CoreTask {
                            worker: l.worker,
                            cell: l.cell,
                            launched: now,
                            requests: l.requests,
                            nodes: l.nodes,
                            batch: l.batch,
                            data: T::default(),
                        };
                        m.tasks.insert(l.task, task);
                        return Some(CoreOutput::Launch { model, task: l.task });
                    }
                    Some(Decision::Complete { id, code }) => {
                        self.complete(id, code);
                    }
                    None => {
                        self.dirty.pop();
                    }
                }
                continue;
            }
            if let Some(model) = self.slots_freed.pop() {
                self.admit_waiting(model);
                continue;
            }
            return self.release_closed();
        }
    }

    /// A closing model with no request and no task left, taken out.
    fn release_closed(&mut self) -> Option<CoreOutput<R>> {
        if self.closing == 0 {
            return None;
        }
        let idx = self
            .models
            .iter()
            .position(|m| matches!(m, Some(m) if m.closing && m.requests == 0 && m.tasks.is_empty()))?;
        let m = self.models[idx].take()?;
        self.closing -= 1;
        Some(CoreOutput::Released { model: idx, policy: m.policy })
    }
}
