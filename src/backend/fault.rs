//! Fault injection: a backend wrapper that fails launches, stalls a stream, or loses the device
//! at chosen points, for testing how the runtime (and a server above it) handles a failing
//! backend. Install it with [`RuntimeBuilder::inject_faults`](crate::RuntimeBuilder::inject_faults).
//!
//! What the runtime promises under each fault (tests/faults.rs checks it): the requests of the
//! affected tasks complete `Backend`, every other request completes normally, nothing hangs —
//! a stalled stream is given up on by the stall watchdog
//! ([`RuntimeBuilder::stall_timeout`](crate::RuntimeBuilder::stall_timeout)) — and the runtime
//! keeps serving: other models and workers at once, a stalled worker again once its stream
//! catches up.
//!
//! Points are counted in launches: the models prepared on the backend are numbered in order from
//! 0, and each model's launches (over all its workers) from 0.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::backend::{Backend, BackendKind, CompletionSignal, Notify, Runner, RunnerShape, TaskData};
use crate::error::{Code, Error, Result};
use crate::model::Network;

/// What goes wrong at a [`Fault`]'s launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultKind {
    /// The launch fails (as a CUDA launch error would): its task's requests complete `Backend`.
    FailLaunch,
    /// The launch goes ahead, but its worker's stream stalls there: the task and every later task
    /// on the worker look unfinished until `release_after` has passed (`None`: for good).
    Stall { release_after: Option<Duration> },
    /// The device is lost: this launch and every later one fails, every stream of every model on
    /// the backend stops counting and reports the failure, and preparing a model fails
    /// `Unavailable`.
    LoseDevice,
}

/// One injected fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The model it strikes, by preparation order from 0; `None`: every model.
    pub model: Option<usize>,
    /// The launch of that model it strikes, counting from 0.
    pub launch: u64,
    pub kind: FaultKind,
}

/// The faults to inject, and what happened (shared by clones: keep one to observe a runtime
/// built with another).
#[derive(Clone, Debug, Default)]
pub struct FaultPlan {
    faults: Vec<Fault>,
    seen: Arc<Seen>,
}

#[derive(Debug, Default)]
struct Seen {
    fired: AtomicUsize,
    runners_dropped: AtomicUsize,
}

impl FaultPlan {
    pub fn new() -> FaultPlan {
        FaultPlan::default()
    }

    /// Add `kind` at launch `launch` of model `model` (`None`: of every model).
    pub fn at(mut self, model: Option<usize>, launch: u64, kind: FaultKind) -> FaultPlan {
        self.faults.push(Fault { model, launch, kind });
        self
    }

    /// Faults that have struck so far.
    pub fn fired(&self) -> usize {
        self.seen.fired.load(Ordering::SeqCst)
    }

    /// Models' runners released so far (a freed model's, or all at shutdown).
    pub fn runners_dropped(&self) -> usize {
        self.seen.runners_dropped.load(Ordering::SeqCst)
    }
}

/// The backend wrapper; see the module docs.
pub struct FaultyBackend {
    inner: Arc<dyn Backend>,
    plan: FaultPlan,
    prepared: AtomicUsize,
    lost: Arc<AtomicBool>,
}

impl FaultyBackend {
    pub fn new(inner: Arc<dyn Backend>, plan: FaultPlan) -> FaultyBackend {
        FaultyBackend { inner, plan, prepared: AtomicUsize::new(0), lost: Arc::default() }
    }
}

fn device_lost() -> Error {
    Error::new(Code::Backend, "the device was lost (injected fault)")
}

impl Backend for FaultyBackend {
    fn kind(&self) -> BackendKind {
        self.inner.kind()
    }

    fn describe(&self) -> String {
        format!("{} with {} injected fault(s)", self.inner.describe(), self.plan.faults.len())
    }

    fn cpu_threads(&self) -> usize {
        self.inner.cpu_threads()
    }

    fn prepare(&self, net: Arc<Network>, shape: RunnerShape, notify: Notify) -> Result<Box<dyn Runner>> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(Error::new(Code::Unavailable, "the device was lost (injected fault)"));
        }
        let index = self.prepared.fetch_add(1, Ordering::SeqCst);
        let inner = self.inner.prepare(net, shape, notify)?;
        let workers = (0..inner.workers()).map(|_| Arc::new(Mutex::new(WorkerFaults::default()))).collect();
        let faults =
            self.plan.faults.iter().filter(|f| f.model.is_none_or(|m| m == index)).copied().collect();
        Ok(Box::new(FaultyRunner {
            inner,
            faults,
            seen: self.plan.seen.clone(),
            launches: AtomicU64::new(0),
            workers,
            lost: self.lost.clone(),
        }))
    }
}

#[derive(Debug, Default)]
struct WorkerFaults {
    /// Stalled: the counter is held below this target until the instant (if any).
    stall: Option<(u64, Option<Instant>)>,
    /// The counter's value when the device was lost (as first seen since).
    frozen: Option<u64>,
}

struct FaultyRunner {
    inner: Box<dyn Runner>,
    /// This model's faults.
    faults: Vec<Fault>,
    seen: Arc<Seen>,
    launches: AtomicU64,
    workers: Vec<Arc<Mutex<WorkerFaults>>>,
    lost: Arc<AtomicBool>,
}

fn lock(w: &Mutex<WorkerFaults>) -> MutexGuard<'_, WorkerFaults> {
    w.lock().unwrap_or_else(|p| p.into_inner())
}

impl Runner for FaultyRunner {
    fn workers(&self) -> usize {
        self.inner.workers()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        // A stall holds the counter back after the stream has advanced it and notified, and
        // releases it later with no notify at all: such a signal cannot promise a notify after
        // every advance (runtime/watch.rs), so it says it does not notify (the poller watches it).
        let holds = self.faults.iter().any(|f| matches!(f.kind, FaultKind::Stall { .. }));
        Arc::new(FaultySignal {
            inner: self.inner.signal(worker),
            faults: self.workers[worker].clone(),
            lost: self.lost.clone(),
            holds,
        })
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        if self.lost.load(Ordering::SeqCst) {
            return Err(device_lost());
        }
        let n = self.launches.fetch_add(1, Ordering::SeqCst);
        let mut stall = None;
        for f in self.faults.iter().filter(|f| f.launch == n) {
            self.seen.fired.fetch_add(1, Ordering::SeqCst);
            match f.kind {
                FaultKind::FailLaunch => {
                    return Err(Error::new(Code::Backend, format!("injected launch failure (launch {n})")));
                }
                FaultKind::LoseDevice => {
                    self.lost.store(true, Ordering::SeqCst);
                    return Err(device_lost());
                }
                FaultKind::Stall { release_after } => stall = Some(release_after),
            }
        }
        let Some(release_after) = stall else { return self.inner.launch(worker, task) };
        // Held while launching: the signal reads the counter under this lock, so it cannot see
        // the task counted before the stall is in place.
        let w = self.workers.get(worker).ok_or_else(|| Error::internal(format!("no worker {worker}")))?;
        let mut faults = lock(w);
        let target = self.inner.launch(worker, task)?;
        faults.stall = Some((target, release_after.and_then(|d| Instant::now().checked_add(d))));
        Ok(target)
    }

    fn collect(&self, worker: usize, task: &TaskData) {
        self.inner.collect(worker, task)
    }

    fn io_lens(&self) -> (usize, usize) {
        self.inner.io_lens()
    }

    fn input_ring(&self, slots: usize, row_len: usize) -> Result<super::ring::InputRing> {
        self.inner.input_ring(slots, row_len)
    }

    fn task_threads(&self, cell: crate::sched::CellType, rows: usize) -> usize {
        self.inner.task_threads(cell, rows)
    }

    fn graph_replays(&self) -> u64 {
        self.inner.graph_replays()
    }

    fn state_slots(&self) -> usize {
        self.inner.state_slots()
    }
}

impl Drop for FaultyRunner {
    fn drop(&mut self) {
        self.seen.runners_dropped.fetch_add(1, Ordering::SeqCst);
    }
}

struct FaultySignal {
    inner: Arc<dyn CompletionSignal>,
    faults: Arc<Mutex<WorkerFaults>>,
    lost: Arc<AtomicBool>,
    /// The model has a stall fault, which may hold the counter back.
    holds: bool,
}

impl CompletionSignal for FaultySignal {
    fn completed(&self) -> u64 {
        let mut f = lock(&self.faults);
        let count = self.inner.completed();
        if self.lost.load(Ordering::SeqCst) {
            return *f.frozen.get_or_insert(count);
        }
        match f.stall {
            Some((_, Some(until))) if Instant::now() >= until => {
                f.stall = None;
                count
            }
            Some((target, _)) => count.min(target.saturating_sub(1)),
            None => count,
        }
    }

    fn notifies(&self) -> bool {
        self.inner.notifies() && !self.holds
    }

    fn failure(&self) -> Option<Error> {
        if self.lost.load(Ordering::SeqCst) { Some(device_lost()) } else { self.inner.failure() }
    }
}
