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
//! A **group** is one policy with its workers (as [`Policy::workers`] declares them) serving one
//! or more models: a request is routed to its model's group, a launch names its model, and a
//! task is known by its group and task id. A policy numbers its group's models `0, 1, …` in the
//! order they were added (`Arrival::model`, `Launch::model`: a tenant policy indexes its
//! profiles with them); the core translates to and from the driver's model indices. The
//! threaded engine gives a model loaded alone a group of its own, and the tenants of
//! `Runtime::add_tenants` one group under their tenant policy, as the tenant simulator does.
//! Group indices are the driver's to choose (the engine keeps its own pool of them).
//!
//! `R` is the driver's own per-request data (the real engine's input, reply and result; the
//! simulator's arrival time), carried untouched and handed back at completion; `T` its own
//! per-task data (the real engine's `TaskData`; nothing for the simulator), attached after a
//! launch and dropped with the task.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Code;
use crate::sched::{
    Arrival, CellGraph, CellType, Decision, Exec, IdMap, IdTable, ModelId, Policy, RequestId, TaskId,
    TaskReport, TaskShape, Time, WorkerId, WorkerShape,
};

/// Index of a group (one policy and its workers) in the core.
pub(crate) type GroupId = usize;

/// A request as the core holds it.
pub(crate) struct CoreRequest<R> {
    pub model: ModelId,
    /// The request unfolded into cells (recurrent models).
    pub graph: Option<Arc<CellGraph>>,
    /// Its state slots (empty while it waits for them, and for fixed-shape requests).
    pub slots: Vec<u32>,
    slots_needed: usize,
    pub deadline: Option<Time>,
    pub priority: i32,
    /// When it was first part of a launched task.
    pub started: Option<Time>,
    /// Its input has landed in device memory ([`EngineCore::input_ready`]).
    input_ready: bool,
    /// Its policy has seen it (it is not waiting for state slots).
    arrived: bool,
    /// A task of it was given up on while it may still run on this worker
    /// ([`EngineCore::give_up`]): its slots are held back when it completes.
    given_up_on: Option<WorkerId>,
    pub data: R,
}

/// A request entering the core.
pub(crate) struct Submit<R> {
    pub model: ModelId,
    pub id: RequestId,
    pub graph: Option<Arc<CellGraph>>,
    /// State slots it needs before its policy may see it (0 for fixed-shape requests).
    pub slots_needed: usize,
    pub deadline: Option<Time>,
    pub priority: i32,
    /// Its input is in place already (no input ring to copy it into): the policy hears
    /// [`Policy::input_ready`] with the arrival, with no separate
    /// [`input_ready`](EngineCore::input_ready) event.
    pub input_ready: bool,
    pub data: R,
}

/// A task in flight, as its policy launched it.
pub(crate) struct CoreTask<T> {
    pub worker: WorkerId,
    pub model: ModelId,
    pub shape: TaskShape,
    pub exec: Exec,
    pub launched: Time,
    /// The request of each real row (its node is in `shape` for cell tasks).
    pub requests: Vec<RequestId>,
    /// Rows computed, padding included.
    pub batch: usize,
    /// The driver's data of the task ([`EngineCore::attach`]).
    pub data: T,
}

impl<T> CoreTask<T> {
    /// The cell type of a cell task (0 otherwise).
    pub fn cell(&self) -> CellType {
        self.shape.cell()
    }

    /// The node of each row of a cell task (empty otherwise).
    pub fn nodes(&self) -> &[u32] {
        self.shape.nodes()
    }
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
    pub model: ModelId,
    pub worker: WorkerId,
    /// Real rows.
    pub rows: usize,
    /// How long the task held its worker: from its launch, or from the previous task's end if
    /// it was launched before that.
    pub busy: Duration,
}

/// What the driver is to do next.
pub(crate) enum CoreOutput<R> {
    /// Start the task ([`EngineCore::task`] describes it: its model, worker and shape) on its
    /// worker, then report [`EngineCore::task_done`] exactly once when it is over (also if its
    /// launch fails).
    Launch { group: GroupId, task: TaskId },
    /// The request is complete with `code` (`Ok`: its result, which the driver holds, is to be
    /// delivered). `rejected`: its policy refused it before any of it ran, and why
    /// ([`Decision::Reject`]).
    Complete {
        id: RequestId,
        code: Code,
        model: ModelId,
        started: Option<Time>,
        rejected: Option<&'static str>,
        data: R,
    },
    /// A closed model has no request and no task left: the driver releases its resources and
    /// may reuse the index. `policy` is its group's policy when it was the group's last model
    /// (the group is gone too).
    Released { model: ModelId, group: GroupId, policy: Option<Box<dyn Policy>> },
}

struct CoreGroup<T> {
    policy: Box<dyn Policy>,
    workers: Vec<WorkerShape>,
    tasks: IdMap<CoreTask<T>>,
    /// When each worker's last reported task ended.
    worker_free_at: Vec<Time>,
    /// Its models not yet released.
    models: usize,
    /// The driver's index of each of its models, by the policy's number for it.
    members: Vec<ModelId>,
}

struct CoreModel {
    group: GroupId,
    /// Its number in its group's policy.
    member: ModelId,
    /// Free state slots, and the requests waiting for slots in arrival order (their policy has
    /// not seen them yet).
    free_slots: Vec<u32>,
    /// Slots of requests a task given up on may still write, by worker: they return to
    /// `free_slots` when that worker's stream catches up ([`EngineCore::worker_caught_up`]).
    held_slots: Vec<(WorkerId, Vec<u32>)>,
    waiting: VecDeque<RequestId>,
    /// Requests held (arrived, not completed), those of them started (a part launched), and
    /// tasks of the model in flight.
    requests: usize,
    started: usize,
    tasks: usize,
    closing: bool,
    /// The most requests the driver holds at once (its admission bound; 0: unknown).
    max_requests: usize,
}

pub(crate) struct EngineCore<R, T = ()> {
    groups: Vec<Option<CoreGroup<T>>>,
    models: Vec<Option<CoreModel>>,
    requests: IdTable<CoreRequest<R>>,
    /// The latest instant an event carried; decisions taken while draining happen then.
    now: Time,
    /// Groups whose policy may have decisions pending, drained by `poll`.
    dirty: Vec<GroupId>,
    /// Models whose freed slots may admit waiting requests once the decisions in hand are out.
    slots_freed: Vec<ModelId>,
    /// Completions the core decided itself (cancel or expiry while waiting for slots).
    ready: VecDeque<CoreOutput<R>>,
    closing: usize,
    /// The sum of the admission bounds of the models served (`requests` is reserved for the
    /// largest it has been: `IdTable`).
    max_requests: usize,
}

impl<R, T> Default for EngineCore<R, T> {
    fn default() -> Self {
        EngineCore {
            groups: Vec::new(),
            models: Vec::new(),
            requests: IdTable::default(),
            now: Time::ZERO,
            dirty: Vec::new(),
            slots_freed: Vec::new(),
            ready: VecDeque::new(),
            closing: 0,
            max_requests: 0,
        }
    }
}

/// Put `v` at `idx` of a vector of optional entries, growing it as needed.
fn place<V>(v: &mut Vec<Option<V>>, idx: usize, value: V) {
    if v.len() <= idx {
        v.resize_with(idx + 1, || None);
    }
    debug_assert!(v[idx].is_none(), "index {idx} reused while taken");
    v[idx] = Some(value);
}

/// Mark group `gid` as having decisions to drain. `poll` drains the last-marked group until its
/// policy has nothing more, so marking the group already on top again would only cost `poll` an
/// empty policy poll.
fn mark(dirty: &mut Vec<GroupId>, gid: GroupId) {
    if dirty.last() != Some(&gid) {
        dirty.push(gid);
    }
}

impl<R, T: Default> EngineCore<R, T> {
    fn at(&mut self, now: Time) -> Time {
        self.now = self.now.max(now);
        self.now
    }

    fn model(&self, model: ModelId) -> Option<&CoreModel> {
        self.models.get(model).and_then(|m| m.as_ref())
    }

    fn group_of(&mut self, model: ModelId) -> Option<(GroupId, &mut CoreGroup<T>)> {
        let g = self.model(model)?.group;
        Some((g, self.groups.get_mut(g)?.as_mut()?))
    }

    /// Install `policy` as group `group` (free: never used, or released), with the workers it
    /// declares.
    pub fn add_group(&mut self, group: GroupId, policy: Box<dyn Policy>) {
        let workers = policy.workers();
        let g = CoreGroup {
            worker_free_at: vec![self.now; workers.len()],
            workers,
            policy,
            tasks: IdMap::default(),
            models: 0,
            members: Vec::new(),
        };
        place(&mut self.groups, group, g);
    }

    /// Serve model `model` (a free index) in group `group` (installed), with `state_slots` state
    /// slots. The driver holds at most `max_requests` of its requests at once (its admission
    /// bound; 0: no bound known): the request tables, here and in the group's policy
    /// ([`Policy::reserve`]), are reserved for it now, so serving never grows them later.
    pub fn add_model(&mut self, model: ModelId, group: GroupId, state_slots: usize, max_requests: usize) {
        let member = if let Some(g) = self.groups.get_mut(group).and_then(|g| g.as_mut()) {
            g.models += 1;
            g.members.push(model);
            if max_requests > 0 {
                g.policy.reserve(max_requests);
            }
            g.members.len() - 1
        } else {
            debug_assert!(false, "model {model} added to group {group}, which is not installed");
            return;
        };
        self.max_requests = self.max_requests.saturating_add(max_requests);
        self.requests.reserve_for(self.max_requests);
        let waiting = if state_slots > 0 { max_requests } else { 0 };
        let m = CoreModel {
            group,
            member,
            free_slots: (0..u32::try_from(state_slots).unwrap_or(u32::MAX)).rev().collect(),
            held_slots: Vec::new(),
            waiting: VecDeque::with_capacity(waiting),
            requests: 0,
            started: 0,
            tasks: 0,
            closing: false,
            max_requests,
        };
        place(&mut self.models, model, m);
    }

    /// The sum of the admission bounds of the models served (as given to `add_model`).
    pub fn max_requests(&self) -> usize {
        self.max_requests
    }

    /// The group a model is served by (while it is: added and not yet released).
    pub fn group(&self, model: ModelId) -> Option<GroupId> {
        self.model(model).map(|m| m.group)
    }

    /// The workers of the group a model is served by.
    pub fn workers_of(&self, model: ModelId) -> &[WorkerShape] {
        let g = self.model(model).and_then(|m| self.groups.get(m.group)).and_then(|g| g.as_ref());
        g.map_or(&[], |g| &g.workers)
    }

    /// No request will arrive for the model any more: release it once its requests have
    /// completed and its tasks are reported (a [`CoreOutput::Released`]).
    pub fn close_model(&mut self, model: ModelId) {
        if let Some(m) = self.models.get_mut(model).and_then(|m| m.as_mut())
            && !m.closing
        {
            m.closing = true;
            self.closing += 1;
        }
    }

    /// A request arrives. Returns it if its model is not served (closed or never added).
    pub fn submit(&mut self, now: Time, s: Submit<R>) -> Result<(), R> {
        self.at(now);
        let Some(m) = self.models.get_mut(s.model).and_then(|m| m.as_mut()).filter(|m| !m.closing) else {
            return Err(s.data);
        };
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
            input_ready: s.input_ready,
            arrived: false,
            given_up_on: None,
            data: s.data,
        };
        self.requests.insert(s.id, r);
        if recurrent {
            self.admit_waiting(s.model);
        } else {
            self.arrive(s.id);
        }
        Ok(())
    }

    /// Give a request to its group's policy (with its input-ready event if that came first).
    fn arrive(&mut self, id: RequestId) {
        let now = self.now;
        let Some(r) = self.requests.get_mut(&id) else { return };
        r.arrived = true;
        let model = r.model;
        let Some(member) = self.models.get(model).and_then(|m| m.as_ref()).map(|m| m.member) else { return };
        let arrival =
            Arrival { id, model: member, deadline: r.deadline, priority: r.priority, cells: r.graph.clone() };
        let ready = r.input_ready;
        if let Some((gid, g)) = self.group_of(model) {
            g.policy.arrive(now, arrival);
            if ready {
                g.policy.input_ready(now, id);
            }
            mark(&mut self.dirty, gid);
        }
    }

    /// Hand state slots to waiting requests, in arrival order, while there are enough.
    fn admit_waiting(&mut self, model: ModelId) {
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
            self.arrive(id);
        }
    }

    /// The request's input has landed in device memory ([`Policy::input_ready`]); told to its
    /// policy now, or as it arrives there if it still waits for state slots.
    pub fn input_ready(&mut self, now: Time, id: RequestId) {
        let now = self.at(now);
        let Some(r) = self.requests.get_mut(&id) else { return };
        r.input_ready = true;
        if r.arrived {
            let model = r.model;
            if let Some((gid, g)) = self.group_of(model) {
                g.policy.input_ready(now, id);
                mark(&mut self.dirty, gid);
            }
        }
    }

    /// The slot of its policy's input ring `id`'s input goes to ([`Policy::input_slot`]).
    pub fn input_slot(&mut self, id: RequestId) -> Option<usize> {
        let model = self.requests.get(&id)?.model;
        self.group_of(model).and_then(|(_, g)| g.policy.input_slot(id))
    }

    /// The caller asked to cancel `id` (unknown or completed ids are ignored).
    pub fn cancel(&mut self, now: Time, id: RequestId) {
        let now = self.at(now);
        let Some(model) = self.requests.get(&id).map(|r| r.model) else { return };
        let Some(m) = self.models.get_mut(model).and_then(|m| m.as_mut()) else { return };
        if let Some(at) = m.waiting.iter().position(|&w| w == id) {
            // Still waiting for state slots: its policy never saw it.
            m.waiting.remove(at);
            self.complete(id, Code::Cancelled, None);
        } else if let Some((gid, g)) = self.group_of(model) {
            g.policy.cancel(now, id);
            mark(&mut self.dirty, gid);
        }
    }

    /// The model's caller expects no more requests soon ([`Policy::flush`]).
    pub fn flush(&mut self, now: Time, model: ModelId) {
        let now = self.at(now);
        if let Some((gid, g)) = self.group_of(model) {
            g.policy.flush(now);
            mark(&mut self.dirty, gid);
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
            self.complete(id, Code::DeadlineExceeded, None);
        }
        for (idx, g) in self.groups.iter_mut().enumerate() {
            if let Some(g) = g
                && g.policy.next_wakeup().is_some_and(|t| t <= now)
            {
                g.policy.tick(now);
                mark(&mut self.dirty, idx);
            }
        }
    }

    /// When the core next needs a [`tick`](Self::tick) if nothing else happens first.
    pub fn next_wakeup(&self) -> Option<Time> {
        let policies = self.groups.iter().flatten().filter_map(|g| g.policy.next_wakeup());
        let waiting = self
            .models
            .iter()
            .flatten()
            .flat_map(|m| m.waiting.iter())
            .filter_map(|id| self.requests.get(id).and_then(|r| r.deadline));
        policies.chain(waiting).min()
    }

    /// A launched task of `group` is over, with what the driver measured of it. `row`
    /// interprets each of its real rows for its request (in row order) and says whether the
    /// request ended early; the policy is told of those ends, then of the task. `None` for an
    /// unknown task.
    pub fn task_done(
        &mut self,
        now: Time,
        group: GroupId,
        report: &TaskReport,
        mut row: impl FnMut(usize, &mut CoreRequest<R>, Option<u32>) -> RowEnd,
    ) -> Option<TaskEnd> {
        let now = self.at(now);
        let g = self.groups.get_mut(group).and_then(|g| g.as_mut())?;
        let entry = g.tasks.remove(&report.task)?;
        let mut busy = Duration::ZERO;
        if let Some(free_at) = g.worker_free_at.get_mut(entry.worker) {
            busy = now.since(entry.launched.max(*free_at));
            *free_at = now;
        }
        let nodes = entry.shape.nodes();
        for (i, id) in entry.requests.iter().enumerate() {
            let Some(r) = self.requests.get_mut(id) else { continue };
            if row(i, r, nodes.get(i).copied()) == RowEnd::Early {
                g.policy.end_early(now, *id);
            }
        }
        g.policy.task_done(now, report);
        mark(&mut self.dirty, group);
        let done = TaskEnd { model: entry.model, worker: entry.worker, rows: entry.requests.len(), busy };
        g.policy.recycle(entry.requests, entry.shape);
        if let Some(m) = self.models.get_mut(done.model).and_then(|m| m.as_mut()) {
            m.tasks -= 1;
        }
        Some(done)
    }

    /// The driver gives up on task `task` (its stream failed, or stalled past the watchdog)
    /// before reporting it done: its kernels may still run and write its requests' state slots,
    /// so those slots are held back when the requests complete, not handed to new requests,
    /// until [`worker_caught_up`](Self::worker_caught_up) says the worker's stream has passed
    /// the task (a failed device never does: the slots stay held).
    pub fn give_up(&mut self, group: GroupId, task: TaskId) {
        let Some(t) = self.groups.get(group).and_then(|g| g.as_ref()).and_then(|g| g.tasks.get(&task)) else {
            return;
        };
        let worker = t.worker;
        for id in &t.requests {
            if let Some(r) = self.requests.get_mut(id) {
                r.given_up_on = Some(worker);
            }
        }
    }

    /// Worker `worker` of model `model`'s group has run every task launched on it: the slots
    /// held for tasks given up on there are free again.
    pub fn worker_caught_up(&mut self, model: ModelId, worker: WorkerId) {
        let Some(m) = self.models.get_mut(model).and_then(|m| m.as_mut()) else { return };
        let before = m.free_slots.len();
        m.held_slots.retain_mut(|(w, slots)| {
            let keep = *w != worker;
            if !keep {
                m.free_slots.append(slots);
            }
            keep
        });
        if m.free_slots.len() > before {
            self.slots_freed.push(model);
            mark(&mut self.dirty, m.group);
        }
    }

    /// A task in flight.
    pub fn task(&self, group: GroupId, task: TaskId) -> Option<&CoreTask<T>> {
        self.groups.get(group)?.as_ref()?.tasks.get(&task)
    }

    /// Attach the driver's data to a task in flight (after its launch).
    pub fn attach(&mut self, group: GroupId, task: TaskId, data: T) {
        if let Some(t) =
            self.groups.get_mut(group).and_then(|g| g.as_mut()).and_then(|g| g.tasks.get_mut(&task))
        {
            t.data = data;
        }
    }

    pub fn request(&self, id: RequestId) -> Option<&CoreRequest<R>> {
        self.requests.get(&id)
    }

    pub fn request_mut(&mut self, id: RequestId) -> Option<&mut CoreRequest<R>> {
        self.requests.get_mut(&id)
    }

    /// Requests held, all models.
    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// Requests of the model held (arrived, not completed).
    pub fn requests_of(&self, model: ModelId) -> usize {
        self.model(model).map_or(0, |m| m.requests)
    }

    /// The model's requests not started (waiting for slots, or queued in its policy).
    pub fn queued(&self, model: ModelId) -> usize {
        self.model(model).map_or(0, |m| m.requests - m.started)
    }

    /// The model's requests started (a part of them launched) and not complete.
    pub fn running(&self, model: ModelId) -> usize {
        self.model(model).map_or(0, |m| m.started)
    }

    /// Every request still held completes now, its data handed back (shutdown's deadline).
    pub fn drain_requests(&mut self) -> Vec<(ModelId, Option<Time>, R)> {
        let out: Vec<_> = self.requests.drain().map(|(_, r)| (r.model, r.started, r.data)).collect();
        for m in self.models.iter_mut().flatten() {
            m.requests = 0;
            m.started = 0;
            m.waiting.clear();
        }
        out
    }

    /// Take a request out, give its slots back and build its completion.
    fn complete(&mut self, id: RequestId, code: Code, rejected: Option<&'static str>) -> Option<()> {
        let r = self.requests.remove(&id)?;
        if let Some(m) = self.models.get_mut(r.model).and_then(|m| m.as_mut()) {
            m.requests -= 1;
            m.started -= usize::from(r.started.is_some());
            if !r.slots.is_empty() {
                match r.given_up_on {
                    // A task given up on may still write them: held until its stream catches up.
                    Some(worker) => m.held_slots.push((worker, r.slots)),
                    // Nothing of the request runs any more (the policy's contract): its slots
                    // are free.
                    None => {
                        let mut slots = r.slots;
                        m.free_slots.append(&mut slots);
                        self.slots_freed.push(r.model);
                    }
                }
            }
        }
        self.ready.push_back(CoreOutput::Complete {
            id,
            code,
            model: r.model,
            started: r.started,
            rejected,
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
            if let Some(&gid) = self.dirty.last() {
                let Some(g) = self.groups.get_mut(gid).and_then(|g| g.as_mut()) else {
                    self.dirty.pop();
                    continue;
                };
                match g.policy.poll() {
                    Some(Decision::Launch(mut l)) => {
                        // The policy's number of the model, as the driver's index (an unknown
                        // one stays out of range: no request of it is found below).
                        debug_assert!(
                            l.model < g.members.len(),
                            "a launch for model {} of {:?}",
                            l.model,
                            g.members
                        );
                        l.model = g.members.get(l.model).copied().unwrap_or(usize::MAX);
                        debug_assert!(
                            g.workers.get(l.worker).is_some_and(|w| l.batch <= w.max_batch),
                            "task {} of {} rows on worker {} of {:?}",
                            l.task,
                            l.batch,
                            l.worker,
                            g.workers
                        );
                        let now = self.now;
                        let mut first_started = 0;
                        for id in &l.requests {
                            if let Some(r) = self.requests.get_mut(id) {
                                debug_assert_eq!(r.model, l.model, "request {id} launched for another model");
                                if r.started.is_none() {
                                    r.started = Some(now);
                                    first_started += 1;
                                }
                            }
                        }
                        if let Some(m) = self.models.get_mut(l.model).and_then(|m| m.as_mut()) {
                            m.tasks += 1;
                            m.started += first_started;
                        }
                        let task = CoreTask {
                            worker: l.worker,
                            model: l.model,
                            shape: l.shape,
                            exec: l.exec,
                            launched: now,
                            requests: l.requests,
                            batch: l.batch,
                            data: T::default(),
                        };
                        g.tasks.insert(l.task, task);
                        return Some(CoreOutput::Launch { group: gid, task: l.task });
                    }
                    Some(Decision::Complete { id, code }) => {
                        self.complete(id, code, None);
                    }
                    Some(Decision::Reject { id, code, reason }) => {
                        debug_assert!(self.requests.get(&id).is_none_or(|r| r.started.is_none()));
                        self.complete(id, code, Some(reason));
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

    /// A closing model with no request and no task left, taken out (with its group's policy
    /// if it was the group's last model).
    fn release_closed(&mut self) -> Option<CoreOutput<R>> {
        if self.closing == 0 {
            return None;
        }
        let idx = self
            .models
            .iter()
            .position(|m| matches!(m, Some(m) if m.closing && m.requests == 0 && m.tasks == 0))?;
        let m = self.models[idx].take()?;
        self.max_requests -= m.max_requests;
        self.closing -= 1;
        let g = self.groups.get_mut(m.group).and_then(|g| g.as_mut())?;
        g.models -= 1;
        let policy = if g.models == 0 { self.groups[m.group].take().map(|g| g.policy) } else { None };
        Some(CoreOutput::Released { model: idx, group: m.group, policy })
    }
}

#[cfg(test)]
#[path = "core_tests.rs"]
mod tests;
