//! A randomized, model-checked driver of the cellular policy: an independent model of Algorithm 1
//! (what is ready, pinned and where, which cell type and worker come next, when each request must
//! complete) checked against every decision, and the policy's internal counters recounted after
//! every event. Random workers, cell types, max batches and Bsizes, MaxTasksToSubmit, many request
//! priorities, fixed-shape requests, chains, trees and other graphs, cancels in every state,
//! deadlines and early ends.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::sched::CellGraph;
use crate::sched::contract::random_graph;

struct TaskInfo {
    task: TaskId,
    rows: Vec<(RequestId, u32)>,
}

struct ReqInfo {
    g: Arc<CellGraph>,
    sg: Vec<u32>,
    prio: i32,
    deadline: Option<Time>,
    /// code the request must complete with once doomed
    reason: Option<Code>,
    started: bool,
    done: bool,
    inflight: usize,
}

struct Harness {
    cfg: CellularConfig,
    reqs: HashMap<RequestId, ReqInfo>,
    streams: Vec<VecDeque<TaskInfo>>,
    /// (id,node) -> (worker, finished)
    submitted: HashMap<(RequestId, u32), (WorkerId, bool)>,
    /// (id, sg) -> unfinished tasks (worker) holding nodes of it
    sg_tasks: HashMap<(RequestId, u32), Vec<WorkerId>>,
    now: Time,
    seed: u64,
    log: Vec<String>,
}

struct Avail {
    /// per type: pinned-to-w nodes, unpinned nodes (id, node, prio)
    pinned: Vec<Vec<(RequestId, u32)>>,
    unpinned: Vec<Vec<(RequestId, u32, i32)>>,
}

impl Harness {
    fn fail(&self, msg: String) -> ! {
        let tail: Vec<&String> = self.log.iter().rev().take(40).collect();
        let mut t = String::new();
        for l in tail.iter().rev() {
            t.push_str(l);
            t.push('\n');
        }
        panic!("seed {}: {msg}\nlast events:\n{t}", self.seed);
    }

    fn avail(&self, w: WorkerId) -> Avail {
        let nt = self.cfg.cell_types.len();
        let mut a = Avail { pinned: vec![Vec::new(); nt], unpinned: vec![Vec::new(); nt] };
        let mut ids: Vec<&RequestId> = self.reqs.keys().collect();
        ids.sort();
        for &id in ids {
            let r = &self.reqs[&id];
            if r.done || r.reason.is_some() {
                continue;
            }
            let n = r.g.len();
            // sg external deps done?
            let nsg = r.sg.iter().copied().max().unwrap() as usize + 1;
            let mut ext_ok = vec![true; nsg];
            for v in 0..n {
                for p in r.g.preds(v) {
                    if r.sg[p as usize] != r.sg[v] && !self.submitted.get(&(id, p)).is_some_and(|s| s.1) {
                        ext_ok[r.sg[v] as usize] = false;
                    }
                }
            }
            for v in 0..n {
                if self.submitted.contains_key(&(id, v as u32)) {
                    continue;
                }
                let sg = r.sg[v];
                if !ext_ok[sg as usize] {
                    continue;
                }
                let ok = r.g.preds(v).iter().all(|p| match self.submitted.get(&(id, p)) {
                    Some(&(_, true)) => true,
                    Some(&(pw, false)) => r.sg[p as usize] == sg && pw == w,
                    None => false,
                });
                if !ok {
                    continue;
                }
                let ty = r.g.cell_type(v) as usize;
                match self.sg_tasks.get(&(id, sg)).map(|v| v.as_slice()) {
                    None | Some([]) => a.unpinned[ty].push((id, v as u32, r.prio)),
                    Some(ws) => {
                        if ws.iter().all(|&x| x == w) {
                            a.pinned[ty].push((id, v as u32));
                        } else if ws.contains(&w) {
                            self.fail(format!("subgraph ({id},{sg}) has tasks on several workers {ws:?}"));
                        }
                    }
                }
            }
        }
        a
    }

    fn expected_type(&self, a: &Avail) -> Option<usize> {
        let n = self.cfg.cell_types.len();
        let prio = |ty: usize| self.cfg.cell_types[ty].priority;
        let avail = |ty: usize| a.pinned[ty].len() + a.unpinned[ty].len();
        let best = |keep: &dyn Fn(usize) -> bool| {
            (0..n).filter(|&ty| keep(ty)).min_by_key(|&ty| (std::cmp::Reverse(prio(ty)), ty))
        };
        best(&|ty| avail(ty) >= self.cfg.cell_types[ty].max_batch)
            .or_else(|| best(&|ty| !a.pinned[ty].is_empty()))
            .or_else(|| {
                (0..n)
                    .filter(|&ty| avail(ty) > 0)
                    .min_by_key(|&ty| (std::cmp::Reverse(avail(ty)), std::cmp::Reverse(prio(ty)), ty))
            })
    }

    fn any_avail(&self, w: WorkerId) -> bool {
        let a = self.avail(w);
        a.pinned.iter().any(|v| !v.is_empty()) || a.unpinned.iter().any(|v| !v.is_empty())
    }

    fn on_decision(&mut self, d: Decision) {
        match d {
            Decision::Launch(l) => {
                self.log.push(format!(
                    "  launch task {} w{} ty{} rows {:?}",
                    l.task,
                    l.worker,
                    l.cell(),
                    l.requests.iter().zip(l.nodes()).collect::<Vec<_>>()
                ));
                let w = l.worker;
                let max = self.cfg.cell_types[l.cell() as usize].max_batch;
                if l.requests.is_empty() || l.requests.len() > max || l.requests.len() != l.nodes().len() {
                    self.fail(format!("bad row count in {l:?}"));
                }
                let bs = &self.cfg.cell_types[l.cell() as usize].bsizes;
                let want_batch =
                    bs.iter().copied().find(|&b| b >= l.requests.len()).unwrap_or(l.requests.len());
                if l.batch != want_batch {
                    self.fail(format!("batch {} want {want_batch}", l.batch));
                }
                if self.streams[w].len() >= self.cfg.max_tasks_to_submit {
                    self.fail(format!("worker {w} over MaxTasksToSubmit"));
                }
                // Worker choice: least loaded with room and work.
                let want_w = (0..self.cfg.workers)
                    .filter(|&x| self.streams[x].len() < self.cfg.max_tasks_to_submit)
                    .filter(|&x| self.any_avail(x))
                    .min_by_key(|&x| (self.streams[x].len(), x));
                if want_w != Some(w) {
                    self.fail(format!("launch on worker {w}, expected {want_w:?}"));
                }
                let a = self.avail(w);
                let ty = l.cell() as usize;
                let want_ty = self.expected_type(&a);
                if want_ty != Some(ty) {
                    self.fail(format!(
                        "ChooseCellType: got {ty}, expected {want_ty:?}; avail {:?} {:?}",
                        a.pinned.iter().map(Vec::len).collect::<Vec<_>>(),
                        a.unpinned.iter().map(Vec::len).collect::<Vec<_>>()
                    ));
                }
                let pinned: HashSet<(RequestId, u32)> = a.pinned[ty].iter().copied().collect();
                let unpinned: HashMap<(RequestId, u32), i32> =
                    a.unpinned[ty].iter().map(|&(i, v, p)| ((i, v), p)).collect();
                let rows: Vec<(RequestId, u32)> =
                    l.requests.iter().copied().zip(l.nodes().iter().copied()).collect();
                let rowset: HashSet<(RequestId, u32)> = rows.iter().copied().collect();
                if rowset.len() != rows.len() {
                    self.fail("duplicate row".into());
                }
                let mut seen_unpinned = false;
                let mut last_prio = i32::MAX;
                let mut min_unp = None;
                for &(id, v) in &rows {
                    if pinned.contains(&(id, v)) {
                        if seen_unpinned {
                            self.fail(format!("pinned row ({id},{v}) after an unpinned row"));
                        }
                    } else if let Some(&p) = unpinned.get(&(id, v)) {
                        seen_unpinned = true;
                        if p > last_prio {
                            self.fail(format!("unpinned row ({id},{v}) prio {p} after prio {last_prio}"));
                        }
                        last_prio = p;
                        min_unp = Some(p);
                    } else {
                        self.fail(format!("row ({id},{v}) not available to worker {w}"));
                    }
                }
                if seen_unpinned && pinned.iter().any(|x| !rowset.contains(x)) {
                    self.fail("a pinned node was left behind while unpinned ones were taken".into());
                }
                if rows.len() < max {
                    if pinned.iter().chain(unpinned.keys()).any(|x| !rowset.contains(x)) {
                        self.fail(format!(
                            "task not full but a node is left: pinned {pinned:?} unpinned {unpinned:?}"
                        ));
                    }
                } else if let Some(pm) = min_unp
                    && let Some((x, p)) = unpinned.iter().find(|(x, p)| **p > pm && !rowset.contains(x))
                {
                    self.fail(format!("unpinned {x:?} prio {p} left behind for prio {pm}"));
                }
                // register
                for &(id, v) in &rows {
                    let r = self.reqs.get_mut(&id).unwrap();
                    r.started = true;
                    self.submitted.insert((id, v), (w, false));
                    let sg = r.sg[v as usize];
                    self.sg_tasks.entry((id, sg)).or_default().push(w);
                }
                let ids: HashSet<RequestId> = rows.iter().map(|r| r.0).collect();
                for id in ids {
                    self.reqs.get_mut(&id).unwrap().inflight += 1;
                }
                self.streams[w].push_back(TaskInfo { task: l.task, rows });
            }
            Decision::Reject { id, code, .. } => self.fail(format!("request {id} rejected ({code:?})")),
            Decision::Complete { id, code } => {
                self.log.push(format!("  complete {id} {code:?}"));
                let Some(r) = self.reqs.get(&id) else { self.fail(format!("complete of unknown {id}")) };
                if r.done {
                    self.fail(format!("request {id} completed twice"));
                }
                if r.inflight > 0 {
                    self.fail(format!("request {id} completed with {} unfinished tasks", r.inflight));
                }
                let want = match r.reason {
                    Some(c) => c,
                    None => {
                        let all =
                            (0..r.g.len() as u32).all(|v| self.submitted.get(&(id, v)).is_some_and(|s| s.1));
                        if !all {
                            self.fail(format!("request {id} completed {code:?} with nodes not run"));
                        }
                        Code::Ok
                    }
                };
                if want != code {
                    self.fail(format!("request {id} completed {code:?}, expected {want:?}"));
                }
                self.reqs.get_mut(&id).unwrap().done = true;
            }
        }
    }

    fn expire(&mut self) {
        let now = self.now;
        for r in self.reqs.values_mut() {
            // An early end (reason Ok) still waits on its running cells, and its deadline.
            let open = matches!(r.reason, None | Some(Code::Ok));
            if !r.done && open && r.deadline.is_some_and(|d| d <= now) {
                r.reason = Some(Code::DeadlineExceeded);
            }
        }
    }

    fn after_event(&mut self, p: &mut CellularPolicy) {
        while let Some(d) = p.poll() {
            self.on_decision(d);
        }
        // liveness
        for (&id, r) in &self.reqs {
            if r.done || r.inflight > 0 {
                continue;
            }
            let all = (0..r.g.len() as u32).all(|v| self.submitted.get(&(id, v)).is_some_and(|s| s.1));
            if r.reason.is_some() || all {
                self.fail(format!("request {id} should have completed (reason {:?}, all {all})", r.reason));
            }
        }
        // work-conserving
        for w in 0..self.cfg.workers {
            if self.streams[w].len() < self.cfg.max_tasks_to_submit && self.any_avail(w) {
                self.fail(format!("worker {w} has room and available work but nothing launched"));
            }
        }
        let queued = self.reqs.values().filter(|r| !r.done && !r.started).count();
        let running = self.reqs.values().filter(|r| !r.done && r.started).count();
        if (p.queued(), p.running()) != (queued, running) {
            self.fail(format!("queued/running {:?} want {:?}", (p.queued(), p.running()), (queued, running)));
        }
        self.check_internal(p);
    }

    fn check_internal(&self, p: &CellularPolicy) {
        let nt = p.cfg.cell_types.len();
        let workers = p.cfg.workers;
        // Unfinished tasks per (type, worker); the latest is its block's `last_task`.
        let outstanding = |ty: usize, w: usize| p.streams[w].iter().filter(move |t| t.ty as usize == ty);
        for ty in 0..nt {
            for w in 0..workers {
                let last = p.types[ty].blocks[w].last_task;
                if outstanding(ty, w).next_back().is_some_and(|t| t.task != last) {
                    self.fail(format!("block ({ty},{w}) last task {last} is not its latest unfinished"));
                }
            }
        }
        // requests
        let mut queued_chains = vec![0usize; nt];
        let mut unp_graph = vec![0usize; nt];
        let mut pin_graph = vec![vec![0usize; workers]; nt];
        let mut resident: HashMap<u32, (usize, u32)> = HashMap::new();
        for (slot, r) in p.reqs.iter().enumerate() {
            let slot = slot as u32;
            let Some(r) = r else {
                if p.alive[slot as usize] != 0 {
                    self.fail(format!("alive[{slot}] set for a free slot"));
                }
                continue;
            };
            let want_alive = if r.doomed.is_none() { r.generation } else { 0 };
            if p.alive[slot as usize] != want_alive {
                self.fail(format!("alive[{slot}] = {} want {want_alive}", p.alive[slot as usize]));
            }
            if p.by_id.get(&r.id) != Some(&slot) {
                self.fail(format!("by_id of {}", r.id));
            }
            let h = &self.reqs[&r.id];
            if h.done {
                self.fail(format!("request {} completed but still in the policy", r.id));
            }
            if r.started != h.started {
                self.fail(format!("request {} started {} harness {}", r.id, r.started, h.started));
            }
            match &r.body {
                Body::Chain(c) => match c.state {
                    ChainState::Queued => {
                        queued_chains[c.ty as usize] += 1;
                        // exactly one valid entry
                        let t = &p.types[c.ty as usize];
                        let mut n = 0;
                        for lvl in &t.unpinned {
                            for e in &lvl.q {
                                if e.slot == slot && e.generation == r.generation && e.sg == c.run {
                                    if lvl.priority != r.priority {
                                        self.fail(format!("entry of {} at wrong priority", r.id));
                                    }
                                    n += 1;
                                }
                            }
                        }
                        if n != 1 {
                            self.fail(format!("queued chain {} has {n} valid entries", r.id));
                        }
                        if r.doomed.is_some() {
                            self.fail(format!("doomed chain {} is Queued", r.id));
                        }
                    }
                    ChainState::Resident(w) => {
                        resident.insert(slot, (c.ty as usize, w));
                        if r.doomed.is_some() {
                            self.fail(format!("doomed chain {} is Resident", r.id));
                        }
                    }
                    ChainState::Releasing => {
                        let n: usize = p
                            .streams
                            .iter()
                            .flat_map(|s| s.iter())
                            .map(|t| t.releases.iter().filter(|&&s| s == slot).count())
                            .sum();
                        if n != 1 {
                            self.fail(format!("releasing chain {} in {n} release lists", r.id));
                        }
                    }
                    ChainState::Idle => self.fail(format!("chain {} idle between events", r.id)),
                },
                Body::Tree => {
                    let t = p.trees[slot as usize].as_ref().unwrap();
                    let shape = t.graph.tree_shape().unwrap();
                    let (lt, it) = (shape.leaf_type as usize, shape.inner_type as usize);
                    if t.inflight as usize != h.inflight {
                        self.fail(format!("tree {} inflight {} want {}", r.id, t.inflight, h.inflight));
                    }
                    let generation = r.generation;
                    let entries = |q: &mut dyn Iterator<Item = &SgRef>, sg: u32| {
                        q.filter(|e| e.slot == slot && e.generation == generation && e.sg == sg).count()
                    };
                    let in_queues = |ty: usize, sg: u32| {
                        p.types[ty]
                            .unpinned
                            .iter()
                            .map(|l| {
                                let n = entries(&mut l.q.iter(), sg);
                                if n > 0 && l.priority != r.priority {
                                    self.fail(format!("entry of tree {} at wrong priority", r.id));
                                }
                                n
                            })
                            .sum::<usize>()
                    };
                    if t.leaves_ready() > 0 {
                        unp_graph[lt] += t.leaves_ready();
                        if in_queues(lt, tree::LEAVES) != 1 {
                            self.fail(format!("tree {} with leaves ready has no single entry", r.id));
                        }
                    }
                    let submitted_leaves =
                        shape.leaves().iter().filter(|&&v| self.submitted.contains_key(&(r.id, v)));
                    if r.doomed.is_none() && submitted_leaves.count() != t.leaf_next as usize {
                        self.fail(format!("tree {} leaf cursor {}", r.id, t.leaf_next));
                    }
                    let ready = t.inner_ready();
                    match t.inner {
                        Inner::Waiting => {
                            if t.leaves_left == 0 || ready != 0 {
                                self.fail(format!("tree {} waiting with leaves done or ready nodes", r.id));
                            }
                        }
                        Inner::Queued => {
                            unp_graph[it] += ready;
                            if ready == 0 || in_queues(it, tree::INNER) != 1 {
                                self.fail(format!("queued tree {} has {ready} ready, not one entry", r.id));
                            }
                        }
                        Inner::Pinned(w) => {
                            pin_graph[it][w as usize] += ready;
                            let n = entries(&mut p.types[it].pinned_trees[w as usize].iter(), tree::INNER);
                            if ready == 0 || n != 1 {
                                self.fail(format!(
                                    "tree {} pinned to {w} with {ready} ready, {n} entries",
                                    r.id
                                ));
                            }
                        }
                        Inner::Drained => {
                            if ready != 0 || (r.doomed.is_none() && !t.inner_submitted()) {
                                self.fail(format!("tree {} drained with nodes left", r.id));
                            }
                        }
                    }
                }
                Body::Graph(g) => {
                    for s in &g.sgs {
                        match s.queued {
                            request::Where::Unpinned => unp_graph[s.ty as usize] += s.ready_len as usize,
                            request::Where::Pinned(w) => {
                                pin_graph[s.ty as usize][w as usize] += s.ready_len as usize
                            }
                            request::Where::Nowhere => {
                                if s.ready_len != 0 {
                                    self.fail(format!("graph {} sg with ready nodes nowhere", r.id));
                                }
                            }
                        }
                    }
                }
            }
        }
        for ty in 0..nt {
            let t = &p.types[ty];
            if t.ready_unpinned != queued_chains[ty] + unp_graph[ty] {
                self.fail(format!(
                    "ready_unpinned[{ty}] = {} want {} + {}",
                    t.ready_unpinned, queued_chains[ty], unp_graph[ty]
                ));
            }
            for (w, &want) in pin_graph[ty].iter().enumerate() {
                if t.ready_pinned[w] != want {
                    self.fail(format!("ready_pinned[{ty}][{w}]"));
                }
            }
            if t.unpinned.windows(2).any(|x| x[0].priority <= x[1].priority) {
                self.fail("priority levels not strictly descending".into());
            }
            let mut lapsed = 0;
            for w in 0..workers {
                let b = &t.blocks[w];
                let mut alive = 0;
                let mut dead = 0;
                for lane in &b.lanes {
                    if p.alive[lane.slot as usize] == lane.generation {
                        alive += 1;
                        if resident.remove(&lane.slot) != Some((ty, w as u32)) {
                            self.fail(format!(
                                "lane of {} in block ({ty},{w}) not resident there (or twice)",
                                lane.id
                            ));
                        }
                        let r = p.reqs[lane.slot as usize].as_ref().unwrap();
                        let Body::Chain(c) = &r.body else { unreachable!() };
                        if lane.end != c.end || lane.next >= lane.end || lane.id != r.id {
                            self.fail(format!("lane of {} bad bounds", lane.id));
                        }
                        // previous node submitted, this one not
                        if lane.next > 0 && !self.submitted.contains_key(&(r.id, lane.next - 1)) {
                            self.fail(format!("lane {} next {} but previous not submitted", r.id, lane.next));
                        }
                        if self.submitted.contains_key(&(r.id, lane.next)) {
                            self.fail(format!("lane {} next {} already submitted", r.id, lane.next));
                        }
                        if b.live {
                            // (`check_internal` has checked `last_task` is the latest such task.)
                            let task = self.streams[w].iter().find(|t| t.task == b.last_task).unwrap();
                            if !task.rows.contains(&(r.id, lane.next - 1)) {
                                self.fail(format!("live lane {} not in its block's last task", r.id));
                            }
                        } else {
                            if b.priority != Some(r.priority) {
                                self.fail(format!(
                                    "lapsed block ({ty},{w}) priority {:?} lane prio {}",
                                    b.priority, r.priority
                                ));
                            }
                            if outstanding(ty, w).next().is_some() {
                                self.fail(format!(
                                    "lapsed block ({ty},{w}) with live lanes while tasks outstanding"
                                ));
                            }
                        }
                    } else {
                        dead += 1;
                    }
                }
                if (alive, dead) != (b.size(), b.dead) {
                    self.fail(format!(
                        "block ({ty},{w}) size/dead {:?} want {:?}",
                        (b.size(), b.dead),
                        (alive, dead)
                    ));
                }
                if b.live {
                    if outstanding(ty, w).next().is_none() {
                        self.fail(format!("live block ({ty},{w}) without outstanding tasks"));
                    }
                    if b.lanes.len() > p.cfg.cell_types[ty].max_batch {
                        self.fail("live block larger than max batch".into());
                    }
                } else {
                    lapsed += b.size();
                }
            }
            if t.lapsed_ready != lapsed {
                self.fail(format!("lapsed_ready[{ty}] = {} want {lapsed}", t.lapsed_ready));
            }
        }
        if let Some((slot, _)) = resident.iter().next() {
            self.fail(format!("resident chain in slot {slot} has no lane"));
        }
    }
}

/// A random tree, of any fan-out, as parent indices (the root's is -1).
fn run_seed(seed: u64, n_req: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let nt = rng.random_range(1..=3);
    let workers = rng.random_range(1..=4);
    let cell_types: Vec<CellTypeConfig> = (0..nt)
        .map(|i| {
            let mb = if rng.random_bool(0.2) { rng.random_range(6..=16) } else { rng.random_range(1..=6) };
            let mut c = CellTypeConfig::new(&format!("t{i}"), mb, rng.random_range(-1..=2));
            if mb > 1 && rng.random_bool(0.3) {
                let mut b: Vec<usize> = (1..mb).filter(|_| rng.random_bool(0.5)).collect();
                b.push(mb);
                c.bsizes = b;
            }
            c
        })
        .collect();
    let cfg = CellularConfig { cell_types, workers, max_tasks_to_submit: rng.random_range(1..=5) };
    let mut p = CellularPolicy::new(cfg.clone()).unwrap();
    let nprio = if rng.random_bool(0.2) { rng.random_range(8..=14) } else { rng.random_range(1..=4) };
    let mut h = Harness {
        cfg,
        reqs: HashMap::new(),
        streams: (0..workers).map(|_| VecDeque::new()).collect(),
        submitted: HashMap::new(),
        sg_tasks: HashMap::new(),
        now: Time::ZERO,
        seed,
        log: Vec::new(),
    };
    let mut next_id: RequestId = 0;
    let mut now = 0u64;
    let p_arrive = rng.random_range(0.15..0.5);
    let p_cancel = rng.random_range(0.0..0.15);
    let p_eos = rng.random_range(0.0..0.2);
    loop {
        now += rng.random_range(0..20);
        let t = Time::from_micros(now);
        h.now = t;
        let x: f64 = rng.random();
        if x < p_arrive && next_id < n_req {
            let id = next_id;
            next_id += 1;
            let g = random_graph(&mut rng, nt);
            let graph = g.clone().unwrap_or_else(CellGraph::single);
            let deadline = rng.random_bool(0.1).then(|| Time::from_micros(now + rng.random_range(0..200)));
            let prio = rng.random_range(0..nprio) - 2;
            let (sg, _) = graph.subgraphs();
            h.reqs.insert(
                id,
                ReqInfo {
                    g: graph,
                    sg,
                    prio,
                    deadline,
                    reason: None,
                    started: false,
                    done: false,
                    inflight: 0,
                },
            );
            h.log.push(format!(
                "t={now} arrive {id} prio {prio} deadline {deadline:?} graph {:?}",
                g.as_ref()
                    .map(|g| (g.types(), (0..g.len()).map(|v| g.preds(v).to_vec()).collect::<Vec<_>>()))
            ));
            h.expire();
            p.arrive(t, Arrival { model: 0, id, deadline, priority: prio, cells: g });
        } else if x < p_arrive + p_cancel && next_id > 0 {
            let id = rng.random_range(0..next_id + 2);
            h.log.push(format!("t={now} cancel {id}"));
            let live = h.reqs.get(&id).is_some_and(|r| !r.done);
            if let Some(r) = h.reqs.get_mut(&id)
                && !r.done
                && r.reason.is_none()
            {
                r.reason = Some(Code::Cancelled);
            }
            if live {
                // A cancel of a live request is a boundary: deadlines are checked there too.
                h.expire();
            }
            p.cancel(t, id);
        } else if x < p_arrive + p_cancel + 0.05 {
            h.log.push(format!("t={now} tick"));
            h.expire();
            p.tick(t);
        } else {
            let busy: Vec<usize> = (0..workers).filter(|&w| !h.streams[w].is_empty()).collect();
            if busy.is_empty() {
                if next_id >= n_req {
                    now += 1_000_000;
                    h.now = Time::from_micros(now);
                    h.log.push(format!("t={now} final tick"));
                    h.expire();
                    p.tick(Time::from_micros(now));
                    h.after_event(&mut p);
                    if h.streams.iter().all(|s| s.is_empty()) {
                        break;
                    }
                }
                continue;
            }
            let w = busy[rng.random_range(0..busy.len())];
            let task = h.streams[w].pop_front().unwrap();
            h.log.push(format!("t={now} task_done {} (w{w})", task.task));
            let mut ended = HashSet::new();
            for &(id, v) in &task.rows {
                if rng.random_bool(p_eos) && ended.insert(id) {
                    let r = h.reqs.get_mut(&id).unwrap();
                    if !r.done && r.reason.is_none() {
                        r.reason = Some(Code::Ok);
                    }
                    h.log.push(format!("t={now} end_early {id} (node {v})"));
                    p.end_early(t, id);
                }
            }
            for &(id, v) in &task.rows {
                h.submitted.get_mut(&(id, v)).unwrap().1 = true;
                let sg = h.reqs[&id].sg[v as usize];
                let ws = h.sg_tasks.get_mut(&(id, sg)).unwrap();
                let i = ws.iter().position(|&x| x == w).unwrap();
                ws.remove(i);
            }
            let ids: HashSet<RequestId> = task.rows.iter().map(|r| r.0).collect();
            for id in ids {
                h.reqs.get_mut(&id).unwrap().inflight -= 1;
            }
            h.expire();
            p.task_done(t, &TaskReport::of(task.task));
        }
        h.after_event(&mut p);
    }
    assert!(h.reqs.values().all(|r| r.done), "seed {seed}");
    assert_eq!((p.queued(), p.running()), (0, 0));
}

#[test]
fn random_runs_match_a_model_of_algorithm_1() {
    // `SERVE_MODEL_CHECK_SEEDS=N` runs more seeds (e.g. in release mode, after a change here).
    let default = if cfg!(miri) { 1 } else { 60 };
    let seeds = std::env::var("SERVE_MODEL_CHECK_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(default);
    let n_req = if cfg!(miri) { 8 } else { 120 };
    for seed in 0..seeds {
        run_seed(seed, n_req);
    }
}
