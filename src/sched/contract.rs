//! The one contract checker: every policy, existing and future, is driven through random runs
//! here and checked against the contract of [`Policy`](super::Policy) (sched/mod.rs) on every
//! decision. A new policy adds one entry to [`policies`]; nothing else.
//!
//! A run: random arrivals (of the requests the policy serves: fixed-shape rows, chains, Seq2Seq,
//! trees, other graphs), cancels of requests in every state, deadlines, early ends of decoder
//! rows, ticks at random and at `next_wakeup`, flushes, and tasks finishing in launch order per
//! worker, each with a report. Checked after every decision and event:
//! * every request completes (or is rejected) exactly once, never while a task holding it is
//!   unfinished, and a reject only before any of it ran;
//! * a launch is on a declared worker, within its `max_batch`, with at most `lookahead` tasks
//!   out, for the model of every row, with no row of a completed, cancelled, ended or expired
//!   request, no node twice, and no node before its predecessors ran or were launched earlier
//!   on the same worker;
//! * `Ok` only before the deadline and, unless the request ended early, after every node ran;
//! * once an event is handled, a cancelled or expired request with nothing running has
//!   completed, and no request waits unstarted past its deadline;
//! * `queued()` and `running()` equal the requests not started and started;
//! * a tenant policy's leases never exceed its cores at once, and a request's layer blocks run
//!   its layers in order, each once, all of them before `Ok`;
//! * at the end (everything finished, time far ahead) nothing is queued, running or due.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::Code;
use crate::sched::adaptive::{AdaptiveConfig, AdaptivePolicy, Formula, Streams};
use crate::sched::baseline::padding::{BucketOrder, PaddingConfig, PaddingPolicy};
use crate::sched::baseline::timeout::{TimeoutConfig, TimeoutPolicy};
use crate::sched::cellular::{CellTypeConfig, CellularConfig, CellularPolicy};
use crate::sched::elastic::{ElasticConfig, ElasticPolicy};
use crate::sched::{
    Arrival, CellGraph, CellType, Decision, ModelId, Policy, RequestId, TaskId, TaskReport, TaskShape, Time,
    WorkerId, WorkerShape,
};

/// What requests a policy under test is given.
#[derive(Clone, Copy, Debug)]
enum Requests {
    /// Fixed-shape requests only.
    Fixed,
    /// Cell graphs over `types` cell types (and fixed-shape requests when `fixed`).
    Cells { types: usize, fixed: bool },
}

/// A policy built from a random configuration, and what it serves.
struct UnderTest {
    policy: Box<dyn Policy>,
    requests: Requests,
    /// Models it serves as one group (`Arrival::model` drawn from `0..n`); `None`: one model,
    /// whose id the run draws.
    models: Option<usize>,
    /// A tenant policy's cores and each model's layer count: its leases must stay within the
    /// cores, and a request's layer blocks must run its layers in order, each once, before `Ok`.
    tenant: Option<(usize, Vec<usize>)>,
}

/// Builds a policy under test from a random configuration drawn from the generator.
type Make = fn(&mut StdRng) -> UnderTest;

/// Every policy, each from a random configuration. Add new policies here.
fn policies() -> Vec<(&'static str, Make)> {
    vec![
        ("timeout", |rng| {
            let cfg = TimeoutConfig {
                max_batch: rng.random_range(1..6),
                max_wait: std::time::Duration::from_micros(rng.random_range(0..50)),
                workers: rng.random_range(1..4),
                pad_to_max: rng.random_bool(0.3),
            };
            UnderTest {
                policy: Box::new(TimeoutPolicy::new(cfg)),
                requests: Requests::Fixed,
                models: None,
                tenant: None,
            }
        }),
        ("adaptive", |rng| {
            let cfg = AdaptiveConfig {
                latency_bound: std::time::Duration::from_micros(rng.random_range(1..400)),
                max_batch: rng.random_range(1..=8),
                streams: if rng.random_bool(0.5) { Streams::Serial } else { Streams::Async },
                formula: if rng.random_bool(0.5) { Formula::Paper } else { Formula::Exact },
                window: rng.random_range(2..=8),
            };
            let policy = Box::new(AdaptivePolicy::new(cfg).expect("valid adaptive config"));
            UnderTest { policy, requests: Requests::Fixed, models: None, tenant: None }
        }),
        ("elastic", |rng| {
            // N-Ebird over random worker sizes, or E-Ebird over random level configurations;
            // a small ring, so that it fills and refuses.
            let max_inflight = rng.random_range(1..=8);
            let cfg = if rng.random_bool(0.5) {
                let workers = std::iter::once(1)
                    .chain((0..rng.random_range(0..=3)).map(|_| rng.random_range(1..=max_inflight)))
                    .collect();
                ElasticConfig {
                    workers,
                    max_inflight,
                    ring_slots: rng.random_range(max_inflight..=12),
                    ..Default::default()
                }
            } else {
                let mut confs = std::collections::BTreeMap::new();
                for total in [2usize, 4, 8].into_iter().filter(|&t| t <= max_inflight) {
                    let mut left = total;
                    let mut conf = Vec::new();
                    while left > 0 {
                        let bs = 1 << rng.random_range(0..=left.ilog2());
                        conf.push(bs);
                        left -= bs;
                    }
                    confs.insert(total, conf);
                }
                let mut cfg = ElasticConfig::e_ebird(confs, max_inflight.max(2));
                cfg.ring_slots = rng.random_range(cfg.max_inflight..=12);
                cfg
            };
            let policy = Box::new(ElasticPolicy::new(cfg).expect("valid elastic config"));
            UnderTest { policy, requests: Requests::Fixed, models: None, tenant: None }
        }),
        ("padding", |rng| {
            let cfg = PaddingConfig {
                bucket_width: rng.random_range(1..=10),
                max_batch: rng.random_range(1..=6),
                workers: rng.random_range(1..=3),
                max_tasks_to_submit: rng.random_range(1..=4),
                level_width: MAX_TREE_NODES,
                // One task per level, or a batch of single-run paths in tasks of a few levels.
                max_steps: if rng.random_bool(0.5) { 1 } else { rng.random_range(2..=8) },
                order: if rng.random_bool(0.5) { BucketOrder::RoundRobin } else { BucketOrder::OldestHead },
            };
            let policy = Box::new(PaddingPolicy::new(cfg).expect("valid padding config"));
            UnderTest {
                policy,
                requests: Requests::Cells { types: 2, fixed: false },
                models: None,
                tenant: None,
            }
        }),
        ("cellular", |rng| {
            let types = rng.random_range(1..=3);
            let cell_types = (0..types)
                .map(|i| {
                    let mut c = CellTypeConfig::new(
                        &format!("t{i}"),
                        rng.random_range(1..=8),
                        rng.random_range(-1..=2),
                    );
                    if rng.random_bool(0.3) {
                        c.bsizes = (1..=c.max_batch).filter(|b| b % 2 == 0 || *b == c.max_batch).collect();
                    }
                    c
                })
                .collect();
            let cfg = CellularConfig {
                cell_types,
                workers: rng.random_range(1..=3),
                max_tasks_to_submit: rng.random_range(1..=4),
            };
            let policy = Box::new(CellularPolicy::new(cfg).expect("valid cellular config"));
            UnderTest { policy, requests: Requests::Cells { types, fixed: true }, models: None, tenant: None }
        }),
        ("tenant", |rng| {
            use crate::sched::tenant::tests::random_model;
            use crate::sched::tenant::{CapRule, Scheme, TenantConfig, TenantPolicy};
            let cores = rng.random_range(1..=6);
            let models = rng.random_range(1..=3);
            let levels = rng.random_range(1..=3);
            let profiles: Vec<_> = (0..models).map(|_| Arc::new(random_model(rng, cores, levels))).collect();
            let layers = profiles.iter().map(|p| p.layers().len()).collect();
            let schemes = [
                Scheme::Veltair,
                Scheme::VeltairAs,
                Scheme::VeltairAc,
                Scheme::LayerWise,
                Scheme::ModelWise,
                Scheme::Fixed(2),
                Scheme::Prema,
            ];
            let mut cfg = TenantConfig::new(cores, schemes[rng.random_range(0..schemes.len())], profiles);
            cfg.rule = if rng.random_bool(0.5) { CapRule::Cap } else { CapRule::Literal };
            let policy = Box::new(TenantPolicy::new(cfg).expect("valid tenant config"));
            UnderTest {
                policy,
                requests: Requests::Fixed,
                models: Some(models),
                tenant: Some((cores, layers)),
            }
        }),
    ]
}

/// Most nodes of a random tree (and of the other random graphs).
pub(crate) const MAX_TREE_NODES: usize = 40;

/// A random tree as parent indices: bushy (most nodes under a few) or deep.
pub(crate) fn random_parents(rng: &mut StdRng) -> Vec<i32> {
    let most = if rng.random_bool(0.2) { MAX_TREE_NODES } else { 12 };
    let n: usize = rng.random_range(2..most);
    let bushy = rng.random_bool(0.3);
    let mut parents = vec![-1];
    for i in 1..n {
        let p = if bushy { rng.random_range(0..i.min(3)) } else { rng.random_range(i.saturating_sub(3)..i) };
        parents.push(p as i32);
    }
    parents
}

/// A random request over `nt` cell types: `None` (fixed-shape), a path of runs, a tree (leaves
/// type 0, internal nodes type 1), a tree-shaped DAG, or another graph.
pub(crate) fn random_graph(rng: &mut StdRng, nt: usize) -> Option<Arc<CellGraph>> {
    match rng.random_range(0..9) {
        0 => None,
        6 | 7 if nt >= 2 => Some(Arc::new(CellGraph::tree_of_parents(&random_parents(rng), 0, 1).unwrap())),
        8 if nt >= 2 => {
            // Leaves of one type under inner nodes of a higher one that may have several inner
            // predecessors, so that more nodes can become ready than were submitted.
            let leaf = rng.random_range(0..nt - 1);
            let inner = rng.random_range(leaf + 1..nt);
            let n_inner = rng.random_range(1..10);
            let n_leaves = rng.random_range(1..12);
            let n = n_inner + n_leaves;
            let mut types = vec![leaf as CellType; n_leaves];
            types.extend(vec![inner as CellType; n_inner]);
            let mut preds = vec![Vec::new(); n];
            for l in 0..n_leaves {
                let v = n_leaves + rng.random_range(0..n_inner);
                preds[v].push(l as u32);
            }
            for i in 1..n_inner {
                let v = n_leaves + i;
                for _ in 0..rng.random_range(1..3) {
                    let j = (n_leaves + rng.random_range(0..i)) as u32;
                    if !preds[v].contains(&j) {
                        preds[v].push(j);
                    }
                }
            }
            if preds[n_leaves].is_empty() {
                preds[n_leaves].push(0);
            }
            let g = CellGraph::new(types, &preds).unwrap();
            assert!(g.plan().is_none() || g.tree_shape().is_some(), "a tree-shaped DAG has a tree shape");
            Some(Arc::new(g))
        }
        1 | 2 | 6 => {
            // A path of runs, cell types ascending (lstm, seq2seq).
            let mut runs = Vec::new();
            let mut ty = rng.random_range(0..nt);
            for _ in 0..rng.random_range(1..4) {
                let hi = if rng.random_bool(0.2) { 25 } else { 7 };
                runs.push((ty as CellType, rng.random_range(1..hi)));
                if ty + 1 < nt && rng.random_bool(0.7) {
                    ty += rng.random_range(1..nt - ty);
                }
            }
            Some(Arc::new(CellGraph::chains(&runs).unwrap()))
        }
        _ => {
            let n = rng.random_range(1..12);
            let mut types: Vec<CellType> = (0..n).map(|_| rng.random_range(0..nt) as CellType).collect();
            types.sort();
            let mut preds = vec![Vec::new(); n];
            for i in 1..n {
                for _ in 0..rng.random_range(0..3) {
                    let j = rng.random_range(0..i);
                    if types[j] <= types[i] && !preds[i].contains(&(j as u32)) {
                        preds[i].push(j as u32);
                    }
                }
                if rng.random_bool(0.5) && preds[i].is_empty() {
                    preds[i].push(i as u32 - 1);
                }
            }
            Some(Arc::new(CellGraph::new(types, &preds).unwrap()))
        }
    }
}

/// A worker's launched, unfinished tasks in order, with their (request, node) rows.
type Stream = VecDeque<(TaskId, Vec<(RequestId, Option<u32>)>)>;

/// What the driver has seen, and the checks made on every decision.
struct Checker {
    name: &'static str,
    seed: u64,
    /// The model of each request.
    models: HashMap<RequestId, ModelId>,
    tenant: Option<(usize, Vec<usize>)>,
    /// Tenant policies: each request's next layer, the cores each task leased, their sum.
    next_layer: HashMap<RequestId, u32>,
    task_cores: HashMap<TaskId, usize>,
    leased: usize,
    workers: Vec<WorkerShape>,
    lookahead: usize,
    graphs: HashMap<RequestId, Option<Arc<CellGraph>>>,
    deadlines: HashMap<RequestId, Time>,
    /// Cancelled by the driver; and cancelled or ended early (no launch may follow).
    cancelled: HashSet<RequestId>,
    stopped: HashSet<RequestId>,
    /// Requests in some launched task.
    started: HashSet<RequestId>,
    streams: Vec<Stream>,
    /// Rows of each request in launched, unfinished tasks.
    running_rows: HashMap<RequestId, usize>,
    finished: HashSet<(RequestId, u32)>,
    launched: HashMap<(RequestId, u32), WorkerId>,
    completed: HashMap<RequestId, Code>,
}

impl Checker {
    fn fail(&self, msg: String) -> ! {
        panic!("policy {} seed {}: {msg}", self.name, self.seed)
    }

    fn check(&mut self, now: Time, d: Decision) {
        match d {
            Decision::Launch(l) => {
                let Some(shape) = self.workers.get(l.worker) else {
                    self.fail(format!("task {} on undeclared worker {}", l.task, l.worker))
                };
                if l.requests.is_empty() || l.batch < l.requests.len() || l.batch > shape.max_batch {
                    self.fail(format!(
                        "task {}: {} rows in a batch of {} on a worker of at most {}",
                        l.task,
                        l.requests.len(),
                        l.batch,
                        shape.max_batch
                    ));
                }
                if let Some((id, m)) = l
                    .requests
                    .iter()
                    .filter_map(|&id| Some((id, *self.models.get(&id)?)))
                    .find(|&(_, m)| m != l.model)
                {
                    self.fail(format!("task {} is for model {}, its row {id} for {m}", l.task, l.model));
                }
                let nodes = l.nodes();
                if !nodes.is_empty() && nodes.len() != l.requests.len() {
                    self.fail(format!(
                        "task {}: {} nodes for {} rows",
                        l.task,
                        nodes.len(),
                        l.requests.len()
                    ));
                }
                let mut rows = Vec::with_capacity(l.requests.len());
                for (i, &id) in l.requests.iter().enumerate() {
                    let Some(g) = self.graphs.get(&id) else {
                        self.fail(format!("launch of unknown request {id}"))
                    };
                    if self.completed.contains_key(&id) || self.stopped.contains(&id) {
                        self.fail(format!("launch of request {id}, completed, cancelled or ended"));
                    }
                    if self.deadlines.get(&id).is_some_and(|&d| d <= now) {
                        self.fail(format!("launch of request {id} past its deadline"));
                    }
                    let node = match (g, nodes.get(i)) {
                        (None, None) => None,
                        (Some(g), Some(&node)) => {
                            if g.cell_type(node as usize) != l.cell() {
                                self.fail(format!("request {id} node {node} in a task of cell {}", l.cell()));
                            }
                            for pr in g.preds(node as usize) {
                                let ok = self.finished.contains(&(id, pr))
                                    || self.launched.get(&(id, pr)) == Some(&l.worker);
                                if !ok {
                                    self.fail(format!(
                                        "request {id} node {node} launched before its predecessor {pr}"
                                    ));
                                }
                            }
                            Some(node)
                        }
                        (Some(g), None) if g.len() == 1 => Some(0),
                        // A fixed-shape request in a cell task: the single node of a one-cell graph.
                        (None, Some(&0)) if l.cell() == 0 => Some(0),
                        _ => self.fail(format!("request {id}: task shape {:?} does not fit it", l.shape)),
                    };
                    rows.push((id, node));
                    // A task of several steps: the row's later nodes on its run, as far as it goes.
                    if let (Some(g), Some(node), steps @ 2..) = (g, node, l.shape.steps()) {
                        let Some(run) =
                            g.runs().and_then(|runs| runs.iter().find(|r| r.start <= node && node < r.end))
                        else {
                            self.fail(format!("task {}: {steps} steps for request {id}, not a path", l.task))
                        };
                        let end = run.end.min(node.saturating_add(steps));
                        rows.extend((node + 1..end).map(|v| (id, Some(v))));
                    }
                }
                for &(id, node) in &rows {
                    if let Some(node) = node
                        && self.launched.insert((id, node), l.worker).is_some()
                    {
                        self.fail(format!("request {id} node {node} launched twice"));
                    }
                    self.started.insert(id);
                    *self.running_rows.entry(id).or_default() += 1;
                }
                if let Some((cores, layers)) = &self.tenant {
                    let TaskShape::Layers { first, last } = l.shape else {
                        self.fail(format!("task {}: a tenant task that is not a layer block", l.task))
                    };
                    let id = l.requests[0];
                    let next = self.next_layer.get(&id).copied().unwrap_or(0);
                    let n = layers.get(l.model).copied().unwrap_or(0) as u32;
                    if l.requests.len() != 1 || first != next || last < first || last >= n {
                        self.fail(format!(
                            "task {}: layers {first}..={last} of request {id} (next {next} of {n}, {} rows)",
                            l.task,
                            l.requests.len()
                        ));
                    }
                    self.next_layer.insert(id, last + 1);
                    self.leased += l.exec.cores;
                    if l.exec.cores == 0 || self.leased > *cores {
                        self.fail(format!("task {}: {} cores leased of {cores}", l.task, self.leased));
                    }
                    self.task_cores.insert(l.task, l.exec.cores);
                }
                self.streams[l.worker].push_back((l.task, rows));
                let out = self.streams[l.worker].len();
                if out > self.lookahead {
                    self.fail(format!(
                        "worker {} has {out} tasks out, lookahead {}",
                        l.worker, self.lookahead
                    ));
                }
            }
            Decision::Complete { id, code } | Decision::Reject { id, code, .. } => {
                let reject = matches!(d, Decision::Reject { .. });
                if !self.graphs.contains_key(&id) {
                    self.fail(format!("completion of unknown request {id}"));
                }
                if let Some(first) = self.completed.insert(id, code) {
                    self.fail(format!("request {id} completed twice ({first:?}, then {code:?})"));
                }
                if self.running_rows.get(&id).copied().unwrap_or(0) > 0 {
                    self.fail(format!("request {id} completed while a task holding it runs"));
                }
                if reject && (self.started.contains(&id) || code == Code::Ok) {
                    self.fail(format!("request {id} rejected ({code:?}) after it started"));
                }
                if code == Code::Ok {
                    if self.deadlines.get(&id).is_some_and(|&d| d <= now) {
                        self.fail(format!(
                            "request {id} completed Ok past its deadline {:?} at {now:?} (ended early: {})",
                            self.deadlines[&id],
                            self.stopped.contains(&id)
                        ));
                    }
                    let all_layers = match &self.tenant {
                        Some((_, layers)) => {
                            let n = layers.get(self.models[&id]).copied().unwrap_or(0) as u32;
                            self.next_layer.get(&id) == Some(&n)
                        }
                        None => true,
                    };
                    let ran_all = match &self.graphs[&id] {
                        None => self.started.contains(&id) && all_layers,
                        Some(g) => (0..g.len() as u32).all(|v| self.finished.contains(&(id, v))),
                    };
                    if !ran_all && !self.stopped.contains(&id) {
                        self.fail(format!("request {id} completed Ok without running every node"));
                    }
                }
            }
        }
    }

    /// After an event at `now`: a cancelled or expired request with nothing running has
    /// completed, no request waits unstarted past its deadline, and the counts are exact.
    fn after_event(&self, now: Time, p: &dyn Policy) {
        let past = self.deadlines.iter().filter(|&(_, &d)| d <= now).map(|(id, _)| id);
        for id in self.cancelled.iter().chain(past) {
            let idle = self.running_rows.get(id).copied().unwrap_or(0) == 0;
            if idle && !self.completed.contains_key(id) {
                self.fail(format!("request {id} should have completed by {now:?}"));
            }
        }
        let live = || self.graphs.keys().filter(|id| !self.completed.contains_key(id));
        let queued = live().filter(|id| !self.started.contains(id)).count();
        let running = live().filter(|id| self.started.contains(id)).count();
        if (p.queued(), p.running()) != (queued, running) {
            self.fail(format!(
                "queued/running {:?}, the requests say {:?}",
                (p.queued(), p.running()),
                (queued, running)
            ));
        }
    }
}

/// One random run of the policy `make` builds.
fn run(name: &'static str, make: Make, seed: u64, n_req: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let UnderTest { mut policy, requests, models, tenant } = make(&mut rng);
    let p = policy.as_mut();
    let workers = p.workers();
    let model = rng.random_range(0..4);
    // Sometimes reserved for a bound (which the run may exceed: tables then grow as needed).
    if rng.random_bool(0.5) {
        p.reserve(rng.random_range(1..=n_req as usize));
    }
    let mut c = Checker {
        name,
        seed,
        models: HashMap::new(),
        tenant,
        next_layer: HashMap::new(),
        task_cores: HashMap::new(),
        leased: 0,
        lookahead: p.lookahead(),
        streams: vec![VecDeque::new(); workers.len()],
        workers,
        graphs: HashMap::new(),
        deadlines: HashMap::new(),
        cancelled: HashSet::new(),
        stopped: HashSet::new(),
        started: HashSet::new(),
        running_rows: HashMap::new(),
        finished: HashSet::new(),
        launched: HashMap::new(),
        completed: HashMap::new(),
    };
    let (mut now, mut next_id) = (0u64, 0);
    loop {
        now += rng.random_range(1..20);
        let mut t = Time::from_micros(now);
        match rng.random_range(0..12) {
            0..3 if next_id < n_req => {
                let id = next_id;
                next_id += 1;
                let cells = match requests {
                    Requests::Fixed => None,
                    Requests::Cells { types, fixed } => loop {
                        let g = random_graph(&mut rng, types);
                        if (g.is_some() || fixed) && g.as_ref().is_none_or(|g| g.len() <= MAX_TREE_NODES) {
                            break g;
                        }
                    },
                };
                c.graphs.insert(id, cells.clone());
                let model = models.map_or(model, |n| rng.random_range(0..n));
                c.models.insert(id, model);
                let deadline =
                    rng.random_bool(0.1).then(|| Time::from_micros(now + rng.random_range(1..300)));
                if let Some(d) = deadline {
                    c.deadlines.insert(id, d);
                }
                p.arrive(t, Arrival { id, model, deadline, priority: rng.random_range(0..3), cells });
                p.input_ready(t, id);
            }
            3 if next_id > 0 => {
                let id = rng.random_range(0..next_id);
                if !c.completed.contains_key(&id) {
                    c.cancelled.insert(id);
                    c.stopped.insert(id);
                }
                p.cancel(t, id);
            }
            4 => p.tick(t),
            5 => {
                // Time passes to the policy's own wakeup.
                if let Some(w) = p.next_wakeup() {
                    now = now.max(w.as_nanos().div_ceil(1_000));
                    t = Time::from_micros(now);
                }
                p.tick(t);
            }
            6 if rng.random_bool(0.2) => p.flush(t),
            _ => {
                let busy: Vec<usize> = (0..c.streams.len()).filter(|&w| !c.streams[w].is_empty()).collect();
                if let Some(&w) = busy.get(rng.random_range(0..busy.len().max(1))) {
                    let (task, rows) = c.streams[w].pop_front().expect("busy worker");
                    c.leased -= c.task_cores.remove(&task).unwrap_or(0);
                    for &(id, node) in &rows {
                        if let Some(node) = node {
                            c.finished.insert((id, node));
                        }
                        *c.running_rows.get_mut(&id).expect("running row") -= 1;
                        // A decoder row (type 1 after type 0) occasionally "emits eos", given
                        // before its task_done.
                        let decoder = match (&c.graphs[&id], node) {
                            (Some(g), Some(v)) => g.runs().is_some() && g.cell_type(v as usize) == 1,
                            _ => false,
                        };
                        if decoder && !c.stopped.contains(&id) && rng.random_range(0..4) == 0 {
                            c.stopped.insert(id);
                            p.end_early(t, id);
                        }
                    }
                    let report = TaskReport {
                        task,
                        compute: Some(std::time::Duration::from_micros(rng.random_range(1..50))),
                        ..TaskReport::of(task)
                    };
                    p.task_done(t, &report);
                } else if next_id < n_req {
                    continue;
                } else {
                    // Nothing runs and nothing more arrives: let every deadline and timer pass.
                    t = Time::from_micros(now + 10_000_000);
                    p.flush(t);
                    p.tick(t);
                }
            }
        }
        // As the engine does after every event: a policy whose wakeup is due is ticked.
        for round in 0.. {
            while let Some(d) = p.poll() {
                c.check(t, d);
            }
            if p.next_wakeup().is_none_or(|w| w > t) {
                break;
            }
            if round == 100 {
                c.fail(format!("next_wakeup stays at {:?} after ticks at {t:?}", p.next_wakeup()));
            }
            p.tick(t);
        }
        c.after_event(t, p);
        if next_id == n_req && c.completed.len() == n_req as usize {
            break;
        }
    }
    if c.streams.iter().any(|s| !s.is_empty()) {
        c.fail("tasks out after the last completion".into());
    }
    if (p.queued(), p.running(), p.next_wakeup()) != (0, 0, None) {
        c.fail(format!("left queued/running/wakeup {:?}", (p.queued(), p.running(), p.next_wakeup())));
    }
}

#[test]
fn every_policy_keeps_the_contract_on_random_runs() {
    // Miri interprets ~1000× slower: a couple of short runs still cover every path there.
    let (seeds, n_req) = if cfg!(miri) { (1, 12) } else { (60, 150) };
    for (name, make) in policies() {
        for seed in 0..seeds {
            run(name, make, seed, n_req);
        }
    }
}
