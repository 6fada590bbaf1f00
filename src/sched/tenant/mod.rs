//! Multi-tenant CPU serving (VELTAIR, Liu et al., ASPLOS'22; ARCHITECTURE.md §7.9): several
//! models share one machine's `C` cores, each with its own QoS target; a query runs as a chain of
//! **layer blocks**, each on an exclusive lease of `c_B` cores, and the next block is formed only
//! when the previous one ends, from the load and the interference at that moment.
//!
//! One policy serves every tenant model (a policy group: `Arrival::model` indexes
//! [`TenantConfig::models`]). Each running block is a [`TaskShape::Layers`] task of one row on a
//! worker of its own, with [`Exec::cores`] its lease and [`Exec::version`] the interference level
//! whose per-layer kernel versions it runs. There are as many workers as cores: every running
//! block holds at least one core.
//!
//! **Alg. 3, the worker loop, per query:** read the system's interference level `I`; compute
//! `thres_m` from the queries in flight ([`blocks::thresholds`]); take the versions for `I`; form
//! the next block from the layers left ([`blocks::next_block`]); run it on `c_B` cores; when it
//! ends, update `I` and repeat.
//!
//! **Dispatcher** (Alg. 3): queries wait in arrival order (FCFS; a query between two blocks keeps
//! its place, so it comes before every query that arrived after it), and go as cores free up. A
//! query whose next block asks for more cores than are free has a **conflict** (§3.2): it starts
//! its next layer alone on the free cores ([`Exec::conflict`]: the driver charges the
//! thread-start cost) and grows at the layer boundary that follows, when its block is formed
//! again. This holds for a query's first block too: the spec's reading ("admit the head when
//! `c_B` of its first block is free") makes one query that needs the whole machine (BERT-Large
//! in the Mix) stop every query behind it until the machine drains, which the simulator showed
//! costs every spatial scheme most of its throughput. Only model-wise, which holds its cores for
//! the whole query by definition, still waits for them at the head of the line.
//!
//! **Interference level** (the proxy the spec recommends without hardware counters: the observed
//! slowdown, the paper's own definition of `I`): each finished block's measured time is placed on
//! its block's predicted times at the profiled levels (interpolated between them), and `I` is an
//! EWMA of that position over the blocks of every tenant. It lags by one block. Conflicted units
//! are left out: their time includes starting threads, and read as interference it fed a spiral
//! in the simulator (a higher level, larger needs, more conflicts). The predictive
//! proxy (the pressure of the blocks still running, with those about to finish left out) is not
//! built: with no counters it would need per-version pressure figures the profile does not have.
//!
//! **Schemes** ([`Scheme`]), all in this one state machine, differing only in granularity,
//! versions and whether they read `I`:
//!
//! | scheme | blocks | versions | reads `I` |
//! |---|---|---|---|
//! | `veltair` (FULL) | adaptive, cap rule R (or L) | per level | yes |
//! | `veltair-as` | adaptive | solo-best | yes (core needs) |
//! | `veltair-ac` | one layer | per level | yes |
//! | `layer-wise` (Planaria-like) | one layer | solo-best | no |
//! | `fixed-N` | N layers | solo-best | no |
//! | `model-wise` | the whole model on `Avg_C` | solo-best | no |
//! | `prema` | one layer on all `C` cores, one query at a time | solo-best | no |
//!
//! PREMA (temporal sharing; the paper gives no configuration, so the spec's reading): one query
//! at a time runs on every core and may be preempted at any layer boundary; at each boundary
//! the waiting query with the most tokens runs next, tokens being `priority × waited / solo`
//! with priority `∝ 1/QoS` and `waited` the time it has spent waiting, not running (ties: the
//! one that has waited longest).

pub mod blocks;
pub mod profile;
#[cfg(test)]
pub(crate) mod tests;
pub mod versions;

use std::collections::BTreeSet;
use std::fmt;
use std::ops::Bound;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Code, Error, Result};
use crate::sched::book::Book;
use crate::sched::{
    Arrival, Exec, IdMap, IdTable, Launch, ModelId, Policy, RequestId, TaskReport, TaskShape, Time, WorkerId,
    WorkerShape,
};
pub use blocks::CapRule;
pub use profile::{LayerProfile, TenantModel, Versions};

/// Most tenant models one policy serves.
pub const MAX_TENANTS: usize = 256;

/// A tenant scheduling scheme: VELTAIR and its ablations, and the baselines of its §3 and §6.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Adaptive blocks, versions per level, interference-aware (Veltair-FULL).
    Veltair,
    /// Adaptive blocks with the solo-best versions (Veltair-AS).
    VeltairAs,
    /// Versions per level at layer granularity (Veltair-AC).
    VeltairAc,
    /// One layer per unit, solo-best versions, blind to interference (the Planaria port).
    LayerWise,
    /// The whole model on `Avg_C` cores (FCFS, model-wise).
    ModelWise,
    /// Blocks of a fixed number of layers.
    Fixed(u32),
    /// Temporal sharing: one query at a time on every core, preemptible at layer boundaries.
    Prema,
}

/// How a scheme cuts a query into units.
enum Blocks {
    Adaptive,
    Fixed(usize),
    Temporal,
}

impl Scheme {
    /// The names `serve sim tenant --policy` takes.
    pub const NAMES: &'static str = "veltair, veltair-as, veltair-ac, layer-wise, model-wise, fixed-N, prema";

    /// The schemes of the spec's study (VELTAIR and its ablations, then the baselines), in the
    /// order of its ordering check: what `serve sim tenant` and `serve bench tenant` compare by
    /// default.
    pub fn study() -> Vec<Scheme> {
        vec![
            Scheme::Veltair,
            Scheme::VeltairAc,
            Scheme::VeltairAs,
            Scheme::LayerWise,
            Scheme::ModelWise,
            Scheme::Fixed(6),
            Scheme::Fixed(11),
            Scheme::Prema,
        ]
    }

    pub fn parse(name: &str) -> Result<Scheme> {
        Ok(match name {
            "veltair" => Scheme::Veltair,
            "veltair-as" => Scheme::VeltairAs,
            "veltair-ac" => Scheme::VeltairAc,
            "layer-wise" => Scheme::LayerWise,
            "model-wise" => Scheme::ModelWise,
            "prema" => Scheme::Prema,
            other => match other.strip_prefix("fixed-").map(str::parse::<u32>) {
                Some(Ok(n)) if n >= 1 => Scheme::Fixed(n),
                _ => {
                    return Err(Error::invalid(format!(
                        "unknown tenant policy `{other}` (one of: {})",
                        Scheme::NAMES
                    )));
                }
            },
        })
    }

    fn blocks(self) -> Blocks {
        match self {
            Scheme::Veltair | Scheme::VeltairAs => Blocks::Adaptive,
            Scheme::VeltairAc | Scheme::LayerWise => Blocks::Fixed(1),
            Scheme::Fixed(n) => Blocks::Fixed(n as usize),
            Scheme::ModelWise => Blocks::Fixed(usize::MAX),
            Scheme::Prema => Blocks::Temporal,
        }
    }

    /// Which versions the scheme runs.
    pub fn versions(self) -> Versions {
        match self {
            Scheme::Veltair | Scheme::VeltairAc => Versions::Multi,
            _ => Versions::SoloBest,
        }
    }

    /// Whether the scheme reads the interference level.
    fn aware(self) -> bool {
        matches!(self, Scheme::Veltair | Scheme::VeltairAs | Scheme::VeltairAc)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Scheme::Veltair => f.write_str("veltair"),
            Scheme::VeltairAs => f.write_str("veltair-as"),
            Scheme::VeltairAc => f.write_str("veltair-ac"),
            Scheme::LayerWise => f.write_str("layer-wise"),
            Scheme::ModelWise => f.write_str("model-wise"),
            Scheme::Fixed(n) => write!(f, "fixed-{n}"),
            Scheme::Prema => f.write_str("prema"),
        }
    }
}

/// Configuration of [`TenantPolicy`].
#[derive(Clone, Debug)]
pub struct TenantConfig {
    /// `C`: the cores the tenants share (every model's profile covers exactly these).
    pub cores: usize,
    pub scheme: Scheme,
    /// How adaptive blocks that start at a pivot end (R, or the literal L as an ablation).
    pub rule: CapRule,
    /// The tenant models, indexed by `Arrival::model`.
    pub models: Vec<Arc<TenantModel>>,
    /// Weight of the newest block in the interference EWMA, in (0, 1].
    pub ewma: f64,
    /// The interference-aware schemes (veltair, veltair-as, veltair-ac) plan a query's remaining
    /// layers to the time it has left rather than to their static budgets (an extension of the
    /// paper, which re-forms blocks from the load and the level but keeps Alg. 1's budgets): a
    /// query that waited or ran slow gets more cores, one ahead of plan fewer.
    pub time_left: bool,
}

/// Bounds of the time-left scale of the budgets: a query far behind plan asks for its fastest
/// cores (a scale near 0 does), one far ahead for few.
const MIN_SCALE: f64 = 0.01;
const MAX_SCALE: f64 = 4.0;

impl TenantConfig {
    pub fn new(cores: usize, scheme: Scheme, models: Vec<Arc<TenantModel>>) -> TenantConfig {
        TenantConfig { cores, scheme, rule: CapRule::Cap, models, ewma: 0.2, time_left: true }
    }
}

/// A query in the policy.
#[derive(Debug)]
struct Query {
    model: ModelId,
    arrived: Time,
    deadline: Option<Time>,
    /// The first layer not yet run.
    next: usize,
    started: bool,
    running: bool,
    cancelled: bool,
    /// Its output is complete before its last layer (the driver says so: a block of it failed,
    /// and its error is its result): it completes `Ok` at its block's end, running no more.
    ended: bool,
    /// When it would have arrived had it waited all along without running: `now − waited`
    /// when it (re-)enters the waiting queries. PREMA's tokens grow from here.
    since: Time,
}

/// A block running on its lease.
#[derive(Debug)]
struct Run {
    query: RequestId,
    worker: WorkerId,
    cores: usize,
    first: usize,
    end: usize,
    /// The level whose versions it runs.
    pick: usize,
    launched: Time,
    conflict: bool,
}

/// VELTAIR's tenant scheduler and its baselines as one sans-IO state machine. See the module
/// documentation.
#[derive(Debug)]
pub struct TenantPolicy {
    cfg: TenantConfig,
    book: Book,
    queries: IdTable<Query>,
    /// Queries waiting for cores (not started, or between blocks), by arrival.
    waiting: BTreeSet<(Time, RequestId)>,
    /// The same per model, by [`Query::since`] (PREMA's pick reads the one of each model that
    /// has waited longest).
    waiting_by_model: Vec<BTreeSet<(Time, RequestId)>>,
    runs: IdMap<Run>,
    idle: Vec<WorkerId>,
    free: usize,
    /// Started queries per model (`Σ Avg_C` over the queries in flight is read from these).
    started: Vec<usize>,
    /// The interference level, as a fractional position among the profiled levels (EWMA).
    level: f64,
    /// PREMA's tokens per second waited, per model: priority (the tightest QoS over the
    /// model's) over its solo time on every core.
    token_rate: Vec<f64>,
}

impl TenantPolicy {
    /// Fails on no model (or more than [`MAX_TENANTS`]), 0 cores, a model profiled for another
    /// core count, or an EWMA weight outside (0, 1].
    pub fn new(cfg: TenantConfig) -> Result<TenantPolicy> {
        if cfg.models.is_empty() || cfg.models.len() > MAX_TENANTS {
            return Err(Error::invalid(format!("{} tenant models (1 to {MAX_TENANTS})", cfg.models.len())));
        }
        if cfg.cores == 0 || cfg.cores > profile::MAX_CORES {
            return Err(Error::invalid(format!("{} cores (1 to {})", cfg.cores, profile::MAX_CORES)));
        }
        if let Some(m) = cfg.models.iter().find(|m| m.cores() != cfg.cores) {
            return Err(Error::invalid(format!(
                "tenant model `{}` is profiled on {} cores, the policy shares {}",
                m.name(),
                m.cores(),
                cfg.cores
            )));
        }
        if let Some(m) = cfg.models.iter().find(|m| m.levels() != cfg.models[0].levels()) {
            return Err(Error::invalid(format!(
                "tenant model `{}` is profiled at {} interference levels, `{}` at {}: the level is shared",
                m.name(),
                m.levels(),
                cfg.models[0].name(),
                cfg.models[0].levels()
            )));
        }
        if !(cfg.ewma > 0.0 && cfg.ewma <= 1.0) {
            return Err(Error::invalid(format!("an interference EWMA weight of {} (in (0, 1])", cfg.ewma)));
        }
        let cores = cfg.cores;
        let best_qos = cfg.models.iter().map(|m| m.qos()).min().unwrap_or(Duration::ZERO).as_secs_f64();
        let token_rate = cfg
            .models
            .iter()
            .map(|m| {
                let solo = m.block_time(0..m.layers().len(), Versions::SoloBest, 0, cores, 0) * 1e-6;
                best_qos / m.qos().as_secs_f64() / solo
            })
            .collect();
        let n = cfg.models.len();
        Ok(TenantPolicy {
            cfg,
            book: Book::default(),
            queries: IdTable::default(),
            waiting: BTreeSet::new(),
            waiting_by_model: vec![BTreeSet::new(); n],
            runs: IdMap::default(),
            idle: (0..cores).rev().collect(),
            free: cores,
            started: vec![0; n],
            level: 0.0,
            token_rate,
        })
    }

    /// The interference level the scheduler reads now (0 for the schemes blind to it).
    pub fn level(&self) -> usize {
        if self.cfg.scheme.aware() { self.level.round() as usize } else { 0 }
    }

    /// Cores not leased to a running block.
    pub fn free_cores(&self) -> usize {
        self.free
    }

    /// The next unit of query `id` at `now` and `level`: its end (exclusive) and the cores it
    /// asks for.
    fn plan(&self, now: Time, id: RequestId, level: usize) -> (usize, usize) {
        let q = &self.queries[&id];
        let m = &self.cfg.models[q.model];
        let versions = self.cfg.scheme.versions();
        // The schemes that re-plan from the current state plan the remaining layers to the time
        // left: the budgets of layers `next..` stretched or shrunk to end at the planned deadline.
        let scale = if self.cfg.scheme.aware() && self.cfg.time_left {
            let planned = m.budget_from(0);
            let left = planned - now.since(q.arrived).as_secs_f64() * 1e6;
            (left / m.budget_from(q.next)).clamp(MIN_SCALE, MAX_SCALE)
        } else {
            1.0
        };
        match self.cfg.scheme.blocks() {
            Blocks::Fixed(n) => blocks::fixed_block(m, q.next, n, (versions, level), scale),
            Blocks::Temporal => (q.next + 1, self.cfg.cores),
            Blocks::Adaptive => {
                // Every query in flight counts, the caller included.
                let own = m.avg_cores(versions, level);
                let all: usize = self
                    .started
                    .iter()
                    .zip(&self.cfg.models)
                    .map(|(n, m)| n * m.avg_cores(versions, level))
                    .sum();
                let others = if q.started { all - own } else { all };
                let thres = blocks::thresholds(self.cfg.cores, &[own, others])[0];
                let cap = own as f64 + thres;
                // The free cores are the load now: a block formed under them, where the layers
                // allow, starts at once instead of in conflict (a pivot needing more still
                // conflicts).
                let formed = cap.min(self.free as f64 + 0.5);
                let (end, need) =
                    blocks::next_block(m, q.next, formed, self.cfg.rule, (versions, level), scale);
                // Under R, K_m is a cap: the last block, which may end above it with nothing left
                // to absorb, runs on K_m cores (slower than its budget) rather than take cores
                // other queries' caps count on.
                let need = if self.cfg.rule == CapRule::Cap {
                    need.min((cap.floor() as usize).max(1))
                } else {
                    need
                };
                (end, need)
            }
        }
    }

    /// Start what can start, in the dispatcher's order.
    fn pump(&mut self, now: Time) {
        if matches!(self.cfg.scheme.blocks(), Blocks::Temporal) {
            return self.pump_temporal(now);
        }
        let level = self.level();
        // In arrival order; every pass launches (taking a core), expires the query, or stops.
        let mut after: Option<(Time, RequestId)> = None;
        while self.free > 0 {
            let range = match after {
                Some(key) => self.waiting.range((Bound::Excluded(key), Bound::Unbounded)),
                None => self.waiting.range(..),
            };
            let Some(&key) = range.into_iter().next() else { break };
            after = Some(key);
            let id = key.1;
            if self.expire_if_due(now, id) {
                continue;
            }
            let (end, need) = self.plan(now, id, level);
            let next = self.queries[&id].next;
            if need <= self.free {
                self.launch(now, id, next..end, need, level, false);
            } else if matches!(self.cfg.scheme, Scheme::ModelWise) {
                // Model-wise holds its cores for the whole query: the head waits for them.
                break;
            } else {
                // A conflict: the next layer alone, on the free cores.
                self.launch(now, id, next..next + 1, self.free, level, true);
            }
        }
    }

    /// PREMA: when nothing runs, the waiting query with the most tokens runs its next layer on
    /// every core.
    fn pump_temporal(&mut self, now: Time) {
        while self.runs.is_empty() {
            // Tokens grow with the time waited: each model's longest-waiting query has its most.
            let mut pick: Option<(f64, Time, RequestId)> = None;
            for (m, w) in self.waiting_by_model.iter().enumerate() {
                let Some(&(since, id)) = w.first() else { continue };
                let t = now.since(since).as_secs_f64() * self.token_rate[m];
                if pick.is_none_or(|(best, at, _)| t > best || (t == best && since < at)) {
                    pick = Some((t, since, id));
                }
            }
            let Some((_, _, id)) = pick else { return };
            if self.expire_if_due(now, id) {
                continue;
            }
            let next = self.queries[&id].next;
            self.launch(now, id, next..next + 1, self.cfg.cores, 0, false);
        }
    }

    /// Complete `id` `DeadlineExceeded` if its deadline has come (it is not running).
    fn expire_if_due(&mut self, now: Time, id: RequestId) -> bool {
        let q = &self.queries[&id];
        if q.deadline.is_none_or(|d| d > now) {
            return false;
        }
        self.finish(id, Code::DeadlineExceeded);
        true
    }

    fn launch(
        &mut self,
        now: Time,
        id: RequestId,
        layers: std::ops::Range<usize>,
        cores: usize,
        pick: usize,
        conflict: bool,
    ) {
        let Some(worker) = self.idle.pop() else { return };
        let q = self.queries.get_mut(&id).expect("a waiting query is known");
        self.waiting.remove(&(q.arrived, id));
        self.waiting_by_model[q.model].remove(&(q.since, id));
        if !q.started {
            q.started = true;
            self.started[q.model] += 1;
            self.book.start(1);
        }
        q.running = true;
        let model = q.model;
        self.free -= cores;
        let task = self.book.task_id();
        let (first, end) = (layers.start, layers.end);
        self.runs.insert(task, Run { query: id, worker, cores, first, end, pick, launched: now, conflict });
        self.book.push_launch(Launch {
            task,
            worker,
            model,
            shape: TaskShape::Layers { first: first as u32, last: (end - 1) as u32 },
            exec: Exec { cores, version: pick as u32, conflict },
            requests: vec![id],
            batch: 1,
        });
    }

    /// The query leaves with `code`.
    fn finish(&mut self, id: RequestId, code: Code) {
        let Some(q) = self.queries.remove(&id) else { return };
        self.waiting.remove(&(q.arrived, id));
        self.waiting_by_model[q.model].remove(&(q.since, id));
        if q.started {
            self.started[q.model] -= 1;
        }
        self.book.complete(id, code, q.started);
    }

    /// Place a finished block's measured time among its predicted times at the profiled levels,
    /// and fold that position into the interference EWMA.
    fn observe(&mut self, run: &Run, took: Duration) {
        let m = &self.cfg.models[self.queries[&run.query].model];
        let versions = self.cfg.scheme.versions();
        let us = took.as_secs_f64() * 1e6;
        let at = |k: usize| m.block_time(run.first..run.end, versions, run.pick, run.cores, k);
        let mut pos = (m.levels() - 1) as f64;
        let mut below = at(0);
        if us <= below {
            pos = 0.0;
        } else {
            for k in 1..m.levels() {
                let above = at(k);
                if us <= above {
                    let span = above - below;
                    pos = (k - 1) as f64 + if span > 0.0 { (us - below) / span } else { 1.0 };
                    break;
                }
                below = above;
            }
        }
        self.level += self.cfg.ewma * (pos - self.level);
    }

    fn tidy(&mut self) {
        let queries = &self.queries;
        self.book.tidy(|id| queries.contains_key(&id));
    }
}

impl Policy for TenantPolicy {
    fn workers(&self) -> Vec<WorkerShape> {
        WorkerShape::uniform(self.cfg.cores, 1)
    }

    fn lookahead(&self) -> usize {
        1
    }

    fn reserve(&mut self, requests: usize) {
        let held = self.book.reserve(requests);
        self.queries.reserve_for(held);
    }

    fn arrive(&mut self, now: Time, req: Arrival) {
        self.book.arrive(req.model, req.deadline, req.id);
        if req.model >= self.cfg.models.len() {
            self.book.reject(req.id, Code::InvalidArgument, "no tenant model of that index");
            return self.tidy();
        }
        let q = Query {
            model: req.model,
            arrived: now,
            deadline: req.deadline,
            next: 0,
            started: false,
            running: false,
            cancelled: false,
            ended: false,
            since: now,
        };
        self.queries.insert(req.id, q);
        self.waiting.insert((now, req.id));
        self.waiting_by_model[req.model].insert((now, req.id));
        self.pump(now);
        self.tidy();
    }

    fn cancel(&mut self, now: Time, id: RequestId) {
        let Some(q) = self.queries.get_mut(&id) else { return };
        if q.running {
            q.cancelled = true;
        } else {
            self.finish(id, Code::Cancelled);
            self.pump(now);
        }
        self.tidy();
    }

    fn task_done(&mut self, now: Time, report: &TaskReport) {
        let Some(run) = self.runs.remove(&report.task) else { return };
        self.free += run.cores;
        self.idle.push(run.worker);
        // A conflicted unit's time includes starting its threads, which is not interference.
        if !run.conflict {
            self.observe(&run, report.compute.unwrap_or_else(|| now.since(run.launched)));
        }
        let q = self.queries.get_mut(&run.query).expect("a running query is known");
        q.running = false;
        q.next = run.end;
        // It waited `run.launched − since` before this block: it resumes waiting from there.
        let waited = run.launched.since(q.since).as_nanos();
        q.since = Time(now.as_nanos().saturating_sub(u64::try_from(waited).unwrap_or(u64::MAX)));
        let layers = self.cfg.models[q.model].layers().len();
        if q.cancelled {
            self.finish(run.query, Code::Cancelled);
        } else if q.deadline.is_some_and(|d| d <= now) {
            self.finish(run.query, Code::DeadlineExceeded);
        } else if q.next >= layers || q.ended {
            self.finish(run.query, Code::Ok);
        } else {
            self.waiting.insert((q.arrived, run.query));
            self.waiting_by_model[q.model].insert((q.since, run.query));
        }
        self.pump(now);
        self.tidy();
    }

    /// Told before the `task_done` of the block that ended it (the only time a driver says so:
    /// the query is running): it completes at that block's end.
    fn end_early(&mut self, _now: Time, id: RequestId) {
        if let Some(q) = self.queries.get_mut(&id) {
            q.ended = true;
        }
    }

    fn tick(&mut self, now: Time) {
        let queries = &self.queries;
        let mut due = Vec::new();
        while let Some(id) = self.book.due(now, |id| queries.contains_key(&id)) {
            due.push(id);
        }
        for id in due {
            // A running query ends at its block's boundary (task_done).
            if !self.queries[&id].running {
                self.finish(id, Code::DeadlineExceeded);
            }
        }
        self.pump(now);
        self.tidy();
    }

    fn poll(&mut self) -> Option<crate::sched::Decision> {
        self.book.poll()
    }

    fn next_wakeup(&self) -> Option<Time> {
        self.book.next_deadline()
    }

    fn queued(&self) -> usize {
        self.book.queued()
    }

    fn running(&self) -> usize {
        self.book.running()
    }
}
