//! Elastic batching: E²bird (Cui et al., TPDS 2021), N-Ebird (its Algorithm 1) and E-Ebird
//! (Algorithm 2), as a sans-IO state machine.
//!
//! * **Memory-pool ring.** A request's input is copied once, at arrival, into the next slot of a
//!   ring of `ring_slots` slots (slot = arrival serial mod S); the driver reports
//!   [`Policy::input_ready`] when it has landed. A batch is a run of consecutive slots starting
//!   at `DevPtr`, the oldest slot not yet launched, and never wraps past the ring's end. A slot
//!   is freed when its batch is answered; a request arriving while its slot still holds an
//!   unanswered one (the ring is full) is refused `Busy` at once.
//! * **Multi-granularity engine.** Workers of fixed batch sizes (default `[1, 1, 2, 4, 8, 16]`);
//!   a task on a worker covers exactly its batch size in slots (launches are always full). The
//!   idle workers form the queue `Q`, ordered by batch size, largest first (a `BTreeSet`:
//!   O(log M) per decision).
//! * **N-Ebird (Algorithm 1)**, on every event: `N` = ready unscheduled slots from `DevPtr`,
//!   `R = min(N, MaxInf − CurInf)`; walking `Q` from the largest, a worker with `bs ≤ R`
//!   takes slots `[DevPtr, DevPtr + bs)`, and `R`, `N`, `DevPtr`, `CurInf` advance. (The
//!   paper's pseudocode never advances `w` after a launch; it is advanced here. "Smaller than
//!   MaxBS" is read as `≤`.) No timer: a request waits only for a worker, never for a fuller
//!   batch. `CurInf ≤ MaxInf` always, so the running workers together act as one batch of at
//!   most MaxBS.
//! * **E-Ebird (Algorithm 2)**: `EngineConfs[TotalBS]` (profiled offline) names the workers to
//!   use at each load level; MemState = `N + CurInf` (the requests in the pool), level = the
//!   largest TotalBS ≤ MemState (below the smallest: the bs-1 and bs-2 workers alone). When the
//!   level changes, `CurConf` is that level's configuration and `Q` = idle ∩ CurConf; busy
//!   workers outside it finish their task and stay parked. Workers of batch size 1 and 2 are
//!   always in `Q`, so any remainder runs (otherwise `{8, 8, 16}` with R = 5 would stall), but
//!   outside CurConf they take only a *remainder*: slots fewer than CurConf's smallest batch
//!   size (counting the ready run up to the ring's end). Without that rule they starve CurConf
//!   under load: at level 32 with `{32}`, a bs-1 and a bs-2 task overlapping keep CurInf above
//!   0, so R stays below 32 and the bs-32 worker never launches (seen on an H200: E-Ebird's
//!   mean batch 1.5 at overload, a fifth of N-Ebird's throughput). With it, a CurConf worker
//!   that cannot launch waits at most for the tasks in flight to end (one service time).
//!
//! Cancel and deadlines: a request not yet launched completes at once (`Cancelled`,
//! `DeadlineExceeded`), its slot stays in the ring as a dead slot: passed over when it is at
//! `DevPtr`, computed as a padding row when it lies inside a launched run. A launched request
//! completes at its task's end.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use crate::error::{Code, Error, Result};
use crate::sched::book::Book;
use crate::sched::{
    Arrival, Decision, IdMap, IdTable, Policy, RequestId, TaskId, TaskReport, TaskShape, Time, WorkerId,
    WorkerShape,
};

pub mod confs;
#[cfg(test)]
mod tests;

/// Configuration of [`ElasticPolicy`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ElasticConfig {
    /// The batch size of each worker (E²bird's multi-granularity engine).
    pub workers: Vec<usize>,
    /// MaxInf: the most slots running at once over every worker (the paper's MaxBS, the largest
    /// batch one worker runs within the QoS).
    pub max_inflight: usize,
    /// Slots of the input ring.
    pub ring_slots: usize,
    /// E-Ebird: the workers' batch sizes to run at each load level (TotalBS → sizes, as
    /// `serve profile --engine-configs` picks them). Empty: N-Ebird, every worker always.
    pub engine_confs: BTreeMap<usize, Vec<usize>>,
}

impl ElasticConfig {
    /// Workers of the N-Ebird paper: `[1, 1, 2, 4, 8, 16]` (Σ = 32; any R ≤ 32 is a sum of them).
    pub const DEFAULT_WORKERS: [usize; 6] = [1, 1, 2, 4, 8, 16];
    /// MaxBS of the paper (ResNet-152 within a 200 ms QoS on a Titan RTX).
    pub const DEFAULT_MAX_INFLIGHT: usize = 32;
    /// "Several × MaxInf" slots.
    pub const DEFAULT_RING_SLOTS: usize = 128;

    /// E-Ebird from profiled configurations: the engine is the union of the chosen
    /// configurations (for each batch size, the most workers any configuration uses) plus a
    /// worker of batch size 1 and one of 2 (TotalBS 1 and 2 are not profiled).
    pub fn e_ebird(engine_confs: BTreeMap<usize, Vec<usize>>, max_inflight: usize) -> ElasticConfig {
        let mut most: BTreeMap<usize, usize> = [(1, 1), (2, 1)].into();
        for conf in engine_confs.values() {
            let mut count: BTreeMap<usize, usize> = BTreeMap::new();
            for &bs in conf {
                *count.entry(bs).or_default() += 1;
            }
            for (bs, c) in count {
                let m = most.entry(bs).or_default();
                *m = (*m).max(c);
            }
        }
        let workers = most.iter().flat_map(|(&bs, &c)| std::iter::repeat_n(bs, c)).collect();
        ElasticConfig { workers, max_inflight, ring_slots: Self::DEFAULT_RING_SLOTS, engine_confs }
    }

    /// Every size within bounds, and every E-Ebird configuration runnable on the workers.
    pub fn check(&self) -> Result<()> {
        if self.workers.is_empty() || self.workers.len() > MAX_WORKERS {
            return Err(Error::invalid(format!(
                "elastic batching needs 1 to {MAX_WORKERS} workers, got {}",
                self.workers.len()
            )));
        }
        if let Some(&bs) = self.workers.iter().find(|&&bs| bs == 0 || bs > self.max_inflight) {
            return Err(Error::invalid(format!(
                "worker batch size {bs} is outside 1..={} (max in flight)",
                self.max_inflight
            )));
        }
        if !self.workers.contains(&1) {
            return Err(Error::invalid(format!(
                "elastic batching needs a worker of batch size 1 (workers {:?}): launches are always full, so \
                 a remainder smaller than every worker would wait for more arrivals, possibly for ever",
                self.workers
            )));
        }
        if self.max_inflight == 0 || self.max_inflight > self.ring_slots {
            return Err(Error::invalid(format!(
                "max in flight {} must be 1 to the ring's {} slots",
                self.max_inflight, self.ring_slots
            )));
        }
        if self.ring_slots > MAX_RING_SLOTS {
            return Err(Error::invalid(format!("{} ring slots: at most {MAX_RING_SLOTS}", self.ring_slots)));
        }
        for (&total, conf) in &self.engine_confs {
            let sum: usize = conf.iter().sum();
            if sum != total || conf.is_empty() {
                return Err(Error::invalid(format!(
                    "engine configuration for TotalBS {total} sums to {sum}: {conf:?}"
                )));
            }
            let mut have: HashMap<usize, usize> = HashMap::new();
            for &bs in &self.workers {
                *have.entry(bs).or_default() += 1;
            }
            for &bs in conf {
                let left = have.entry(bs).or_default();
                if *left == 0 {
                    return Err(Error::invalid(format!(
                        "engine configuration for TotalBS {total} ({conf:?}) needs more workers of batch size \
                         {bs} than the engine has ({:?})",
                        self.workers
                    )));
                }
                *left -= 1;
            }
        }
        Ok(())
    }
}

impl Default for ElasticConfig {
    fn default() -> Self {
        ElasticConfig {
            workers: Self::DEFAULT_WORKERS.to_vec(),
            max_inflight: Self::DEFAULT_MAX_INFLIGHT,
            ring_slots: Self::DEFAULT_RING_SLOTS,
            engine_confs: BTreeMap::new(),
        }
    }
}

/// Why a request is refused when the ring is full.
pub(crate) const RING_FULL: &str =
    "every slot of the model's input ring holds an unanswered request; retry later";

/// Most workers of one elastic engine.
pub const MAX_WORKERS: usize = 256;
/// Most ring slots.
pub const MAX_RING_SLOTS: usize = 1 << 16;

/// A ring slot, from the oldest slot not yet freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    /// Holds a request not launched; `ready` once its input has landed.
    Waiting { id: RequestId, ready: bool },
    /// Its request completed before launch (cancel, deadline): nothing to compute.
    Dead,
    /// In a launched task, until the task is answered.
    Running,
    /// Answered; reusable once every older slot is.
    Free,
}

#[derive(Debug)]
struct Request {
    serial: u64,
    deadline: Option<Time>,
    /// Set once launched.
    task: Option<TaskId>,
    cancelled: bool,
}

#[derive(Debug)]
struct Task {
    worker: WorkerId,
    /// Ring serials `[first, first + slots)`.
    first: u64,
    slots: usize,
    requests: Vec<RequestId>,
}

/// E²bird's elastic batching. See the module documentation.
#[derive(Debug)]
pub struct ElasticPolicy {
    cfg: ElasticConfig,
    book: Book,
    requests: IdTable<Request>,
    /// Slots from serial `base` (the oldest not freed) to `next` (the next arrival's).
    ring: VecDeque<Slot>,
    base: u64,
    next: u64,
    /// DevPtr: the serial of the oldest slot not launched.
    dev_ptr: u64,
    /// CurInf: slots in running tasks.
    cur_inf: usize,
    /// Q: idle workers in CurConf, largest batch first.
    idle: BTreeSet<(Reverse<usize>, WorkerId)>,
    busy: Vec<bool>,
    /// In CurConf (every worker under N-Ebird), or a bs-1/bs-2 remainder worker.
    active: Vec<bool>,
    /// E-Ebird: active only as a remainder worker (bs ≤ 2, not in CurConf's sizes).
    remainder: Vec<bool>,
    /// E-Ebird: CurConf's smallest batch size; remainder workers run only fewer slots than it.
    conf_min: usize,
    /// E-Ebird's current level (TotalBS; 0 below the smallest), `None` before the first.
    level: Option<usize>,
    reconfigurations: u64,
    tasks: IdMap<Task>,
}

impl ElasticPolicy {
    pub fn new(cfg: ElasticConfig) -> Result<ElasticPolicy> {
        cfg.check()?;
        let m = cfg.workers.len();
        let mut p = ElasticPolicy {
            book: Book::default(),
            requests: IdTable::default(),
            ring: VecDeque::with_capacity(cfg.ring_slots),
            base: 0,
            next: 0,
            dev_ptr: 0,
            cur_inf: 0,
            idle: BTreeSet::new(),
            busy: vec![false; m],
            active: vec![cfg.engine_confs.is_empty(); m],
            remainder: vec![false; m],
            conf_min: 1,
            level: None,
            reconfigurations: 0,
            tasks: IdMap::default(),
            cfg,
        };
        // N-Ebird: every worker is in Q, for good; E-Ebird: the level of an empty pool.
        p.reconfigure(0);
        p.idle = p.idle_in_conf();
        Ok(p)
    }

    pub fn config(&self) -> &ElasticConfig {
        &self.cfg
    }

    /// How many times E-Ebird changed its configuration (level crossings).
    pub fn reconfigurations(&self) -> u64 {
        self.reconfigurations
    }

    /// CurInf: slots in running tasks.
    pub fn in_flight(&self) -> usize {
        self.cur_inf
    }

    fn slot(&self, serial: u64) -> Slot {
        self.ring[(serial - self.base) as usize]
    }

    fn slot_mut(&mut self, serial: u64) -> &mut Slot {
        &mut self.ring[(serial - self.base) as usize]
    }

    /// N: ready (or dead) slots from DevPtr, in order (an in-order copy stream: the worker waits
    /// on the last one's event).
    fn ready_run(&self) -> usize {
        let from = (self.dev_ptr - self.base) as usize;
        self.ring
            .range(from..)
            .take_while(|s| matches!(s, Slot::Waiting { ready: true, .. } | Slot::Dead))
            .count()
    }

    /// E-Ebird: the level for MemState = `load` (the requests in the pool, N + CurInf), and
    /// `Q` = idle ∩ CurConf rebuilt when it changed (Algorithm 2). N-Ebird has no levels.
    fn reconfigure(&mut self, load: usize) {
        if self.cfg.engine_confs.is_empty() {
            return;
        }
        let level = self.cfg.engine_confs.range(..=load).next_back().map_or(0, |(&t, _)| t);
        if self.level == Some(level) {
            return;
        }
        if self.level.is_some() {
            self.reconfigurations += 1;
        }
        self.level = Some(level);
        // CurConf: for each size in the level's configuration, the first workers of that size.
        let mut want: HashMap<usize, usize> = HashMap::new();
        for &bs in self.cfg.engine_confs.get(&level).into_iter().flatten() {
            *want.entry(bs).or_default() += 1;
        }
        // Below the smallest level CurConf is {1, 2} itself: nothing is a remainder there.
        self.conf_min = want.keys().copied().min().unwrap_or(1);
        let has_conf = !want.is_empty();
        for (w, &bs) in self.cfg.workers.iter().enumerate() {
            let take = want.get_mut(&bs).filter(|c| **c > 0);
            self.active[w] = bs <= 2 || take.is_some();
            self.remainder[w] = bs <= 2 && take.is_none() && has_conf;
            if let Some(c) = take {
                *c -= 1;
            }
        }
        self.idle = self.idle_in_conf();
    }

    /// Q from scratch: the idle workers of CurConf.
    fn idle_in_conf(&self) -> BTreeSet<(Reverse<usize>, WorkerId)> {
        (0..self.cfg.workers.len())
            .filter(|&w| !self.busy[w] && self.active[w])
            .map(|w| (Reverse(self.cfg.workers[w]), w))
            .collect()
    }

    /// Complete a request that was never launched: its slot becomes dead.
    fn finish_waiting(&mut self, id: RequestId, code: Code) {
        let Some(r) = self.requests.remove(&id) else { return };
        debug_assert!(r.task.is_none());
        *self.slot_mut(r.serial) = Slot::Dead;
        self.book.complete(id, code, false);
    }

    fn expire(&mut self, now: Time) {
        while let Some(id) = self.book.due(now, |id| self.requests.get(&id).is_some_and(|r| r.task.is_none()))
        {
            self.finish_waiting(id, Code::DeadlineExceeded);
        }
        let requests = &self.requests;
        self.book.tidy(|id| requests.get(&id).is_some_and(|r| r.task.is_none()));
    }

    /// Free answered slots at the ring's start, and pass over dead slots at DevPtr; returns how
    /// many dead slots it passed.
    fn advance(&mut self) -> usize {
        let from = self.dev_ptr;
        while self.dev_ptr < self.next && self.slot(self.dev_ptr) == Slot::Dead {
            *self.slot_mut(self.dev_ptr) = Slot::Free;
            self.dev_ptr += 1;
        }
        while self.ring.front() == Some(&Slot::Free) {
            self.ring.pop_front();
            self.base += 1;
        }
        (self.dev_ptr - from) as usize
    }

    /// Algorithm 1 (and 2's reconfiguration first): launch full batches on idle workers, the
    /// largest that fits first.
    fn dispatch(&mut self, now: Time) {
        self.expire(now);
        self.advance();
        // N: counted once, then advanced with DevPtr as Algorithm 1 does.
        let mut n = self.ready_run();
        self.reconfigure(n + self.cur_inf);
        loop {
            let to_end = self.cfg.ring_slots - (self.dev_ptr % self.cfg.ring_slots as u64) as usize;
            let avail = n.min(to_end);
            let r = avail.min(self.cfg.max_inflight - self.cur_inf);
            if r == 0 {
                break;
            }
            // The largest idle worker with bs ≤ R: Q is ordered by Reverse(bs), so the first at
            // or after (Reverse(R), 0); E-Ebird's remainder workers only for a remainder (at most
            // two of them are passed over).
            let remainder_ok = avail < self.conf_min;
            let Some(&(Reverse(bs), w)) =
                self.idle.range((Reverse(r), 0)..).find(|&&(_, w)| remainder_ok || !self.remainder[w])
            else {
                break;
            };
            self.idle.remove(&(Reverse(bs), w));
            self.launch(w, bs);
            n -= bs + self.advance();
        }
        debug_assert_eq!(n, self.ready_run());
    }

    fn launch(&mut self, worker: WorkerId, bs: usize) {
        let task = self.book.task_id();
        let first = self.dev_ptr;
        let mut ids = Vec::with_capacity(bs);
        for serial in first..first + bs as u64 {
            if let Slot::Waiting { id, .. } = self.slot(serial) {
                ids.push(id);
                self.requests.get_mut(&id).expect("waiting request").task = Some(task);
            }
            *self.slot_mut(serial) = Slot::Running;
        }
        self.dev_ptr += bs as u64;
        self.cur_inf += bs;
        self.busy[worker] = true;
        self.book.start(ids.len());
        self.tasks.insert(task, Task { worker, first, slots: bs, requests: ids.clone() });
        // Exactly full: dead slots inside the run are padding rows (they come last).
        self.book.launch(task, worker, TaskShape::Dense, ids, bs);
    }
}

impl Policy for ElasticPolicy {
    fn workers(&self) -> Vec<WorkerShape> {
        self.cfg.workers.iter().map(|&bs| WorkerShape { max_batch: bs, cores: 0 }).collect()
    }

    fn lookahead(&self) -> usize {
        1
    }

    fn reserve(&mut self, requests: usize) {
        let held = self.book.reserve(requests);
        self.requests.reserve_for(held);
    }

    fn arrive(&mut self, now: Time, req: Arrival) {
        assert!(!self.requests.contains_key(&req.id), "request {} arrived twice", req.id);
        self.book.arrive(req.model, req.deadline, req.id);
        self.advance();
        if self.next - self.base >= self.cfg.ring_slots as u64 {
            // The slot this request would take still holds an unanswered one.
            self.book.reject(req.id, Code::Busy, RING_FULL);
            return;
        }
        let serial = self.next;
        self.next += 1;
        self.ring.push_back(Slot::Waiting { id: req.id, ready: false });
        self.requests
            .insert(req.id, Request { serial, deadline: req.deadline, task: None, cancelled: false });
        self.dispatch(now);
    }

    fn input_ring_slots(&self) -> usize {
        self.cfg.ring_slots
    }

    /// Slot = serial mod S. A request is accepted only when the slot's last holder (serial − S)
    /// has been answered, so the driver's copy never lands in a slot a running task reads.
    fn input_slot(&self, id: RequestId) -> Option<usize> {
        let r = self.requests.get(&id)?;
        r.task.is_none().then(|| (r.serial % self.cfg.ring_slots as u64) as usize)
    }

    fn input_ready(&mut self, now: Time, id: RequestId) {
        if let Some(r) = self.requests.get(&id)
            && r.task.is_none()
        {
            let serial = r.serial;
            if let Slot::Waiting { ready, .. } = self.slot_mut(serial) {
                *ready = true;
            }
            self.dispatch(now);
        }
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        match self.requests.get_mut(&id) {
            Some(r) if r.task.is_none() => self.finish_waiting(id, Code::Cancelled),
            Some(r) => r.cancelled = true,
            None => {}
        }
        self.dispatch(now);
    }

    fn task_done(&mut self, now: Time, report: &TaskReport) {
        let t = self.tasks.remove(&report.task).expect("task_done for an unknown task");
        for id in t.requests {
            let r = self.requests.remove(&id).expect("running request is known");
            self.book.finish_running(id, r.cancelled, r.deadline, now);
        }
        for serial in t.first..t.first + t.slots as u64 {
            *self.slot_mut(serial) = Slot::Free;
        }
        self.cur_inf -= t.slots;
        self.busy[t.worker] = false;
        if self.active[t.worker] {
            self.idle.insert((Reverse(self.cfg.workers[t.worker]), t.worker));
        }
        self.dispatch(now);
    }

    fn end_early(&mut self, _now: Time, _id: RequestId) {
        // A fixed-shape request ends with its only task.
    }

    fn tick(&mut self, now: Time) {
        self.dispatch(now);
    }

    fn poll(&mut self) -> Option<Decision> {
        self.book.poll()
    }

    fn next_wakeup(&self) -> Option<Time> {
        // No batching timer: only the deadlines of requests not launched.
        self.book.next_deadline()
    }

    fn queued(&self) -> usize {
        self.book.queued()
    }

    fn running(&self) -> usize {
        self.book.running()
    }
}
