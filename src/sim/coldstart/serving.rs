//! The cold-start engine on simulated GPUs: requests for model instances served one at a time
//! per GPU, FIFO, as DeepPlan serves (Clockwork-style workers, no batching); a warm instance runs
//! from device memory, a cold one by its plan while its layers arrive.
//!
//! A cold start on GPU `g` runs the plan made for `g` ([`plan`](crate::plan::deepplan::plan)
//! with the topology and primary `g`): partition 1 is copied over `g`'s PCIe link, partition `p`
//! over its secondary's link, each copy sharing the links with every other copy in flight
//! ([`Fabric`]: two GPUs under one switch halve each other's bandwidth; a GPU that is its
//! partner's secondary carries the partner's partition beside its own loads). A secondary's
//! migration stream forwards each landed layer over NVLink (`forward_ms + bytes / nvlink`),
//! one at a time. The execution stream runs the layers in order, a loaded layer when it has
//! arrived (the event wait), a DHA layer at once; Baseline waits for every copy first.
//!
//! Memory: a GPU holds whole instances in `memory − reserve` bytes ([`InstanceCache`]); an
//! instance occupies its plan's device bytes (DHA layers stay on the host, also while warm). A
//! cold start evicts least-recently-used instances of its GPU until its load set fits; the
//! instance running is pinned, never evicted.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::rc::Rc;

use super::fabric::{CopyId, Fabric};
use crate::error::{Error, Result};
use crate::plan::deepplan::planner::{exec_time, is_loaded};
use crate::plan::deepplan::{Algorithm, ColdPlan, ColdProfile, PlanOptions, Topology, plan};
use crate::sched::instances::InstanceCache;

/// How cold requests run (DeepPlan §5's designs and baselines).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Strategy {
    /// Copy the whole model, then execute.
    Baseline,
    /// Load every layer, execute each as soon as it has arrived (per-layer pipelining).
    PipeSwitch,
    /// DeepPlan's Algorithm 1 on one GPU.
    Dha,
    /// The all-load plan with parallel transmission.
    Pt,
    /// Algorithm 1 with parallel transmission.
    PtDha,
    /// Ablation: the initial approach (Embedding/BatchNorm and faster-by-DHA layers on DHA).
    Initial,
}

impl Strategy {
    pub const ALL: [Strategy; 6] = [
        Strategy::Baseline,
        Strategy::PipeSwitch,
        Strategy::Dha,
        Strategy::Pt,
        Strategy::PtDha,
        Strategy::Initial,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Baseline => "baseline",
            Strategy::PipeSwitch => "pipeswitch",
            Strategy::Dha => "dha",
            Strategy::Pt => "pt",
            Strategy::PtDha => "pt+dha",
            Strategy::Initial => "initial",
        }
    }

    pub fn parse(s: &str) -> Option<Strategy> {
        Strategy::ALL.into_iter().find(|x| x.name() == s)
    }

    /// The planner options of its plans.
    pub fn options(self) -> PlanOptions {
        PlanOptions { algorithm: self.algorithm(), ..PlanOptions::default() }
    }

    fn algorithm(self) -> Algorithm {
        match self {
            Strategy::Baseline | Strategy::PipeSwitch | Strategy::Pt => Algorithm::AllLoad,
            Strategy::Dha | Strategy::PtDha => Algorithm::DeepPlan,
            Strategy::Initial => Algorithm::Initial,
        }
    }

    /// Its plan of `profile` for a cold start on GPU `gpu` of `machine` (with parallel
    /// transmission over that GPU's helpers when the strategy uses it).
    pub fn plan_on(self, machine: &Machine, profile: &ColdProfile, gpu: u32) -> ColdPlan {
        plan(profile, self.options(), self.parallel().then_some((&machine.topology, gpu)))
    }

    /// Whether it uses parallel transmission.
    pub fn parallel(self) -> bool {
        matches!(self, Strategy::Pt | Strategy::PtDha)
    }
}

/// The simulated machine.
#[derive(Clone, Debug, PartialEq)]
pub struct Machine {
    pub topology: Topology,
    /// Device memory of each GPU.
    pub memory_bytes: u64,
    /// Device memory kept back from instances (context, workspace, staging).
    pub reserve_bytes: u64,
    /// Fixed cost of one NVLink forward, ms.
    pub forward_ms: f64,
    /// Whether a DHA layer's reads share its GPU's PCIe link with the copies on it (off, as the
    /// paper assumes). On: while it runs, the layer holds one share of the link (the copies on
    /// it slow down), and it runs `1 + copies` times longer if copies were in flight when it
    /// started (its reads get an equal share).
    pub dha_contention: bool,
}

const GIB: u64 = 1 << 30;

impl Machine {
    /// The paper's AWS p3.8xlarge: four V100-16GB on two PCIe 3.0 switches with NVLink; the
    /// artifact keeps 5.5 GiB of each GPU from instances.
    pub fn p3_8xlarge() -> Machine {
        Machine {
            topology: Topology::p3_8xlarge(),
            memory_bytes: 16 * GIB,
            reserve_bytes: 11 * GIB / 2,
            forward_ms: 0.02,
            dha_contention: false,
        }
    }

    /// Bytes of each GPU instances may occupy.
    pub fn capacity(&self) -> u64 {
        self.memory_bytes.saturating_sub(self.reserve_bytes)
    }

    /// A valid topology and a finite forward cost ≥ 0.
    pub fn check(&self) -> Result<()> {
        self.topology.check()?;
        if !self.forward_ms.is_finite() || self.forward_ms < 0.0 {
            return Err(Error::invalid(format!(
                "forward_ms is {}; a finite time ≥ 0 expected",
                self.forward_ms
            )));
        }
        Ok(())
    }
}

/// One request: it arrives at `at_ms` for `instance` (home GPU `instance mod GPUs`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arrival {
    pub at_ms: f64,
    pub instance: usize,
}

/// What happened to one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Record {
    pub arrival: Arrival,
    pub start_ms: f64,
    pub end_ms: f64,
    /// It found its instance out of device memory and ran by the plan.
    pub cold: bool,
}

impl Record {
    pub fn latency_ms(&self) -> f64 {
        self.end_ms - self.arrival.at_ms
    }
}

/// The plans of one strategy on every GPU, and what they cost.
struct Plans {
    by_gpu: Vec<Rc<ColdPlan>>,
    /// Per GPU, the execution time of a warm request (DHA layers still by DHA).
    warm_ms: Vec<f64>,
    parallel: bool,
    pipelined: bool,
}

impl Plans {
    fn new(machine: &Machine, profile: &ColdProfile, strategy: Strategy) -> Result<Plans> {
        let by_gpu: Vec<Rc<ColdPlan>> =
            machine.topology.gpus.iter().map(|g| Rc::new(strategy.plan_on(machine, profile, g.id))).collect();
        for (g, p) in machine.topology.gpus.iter().zip(&by_gpu) {
            if p.device_bytes > machine.capacity() {
                return Err(Error::invalid(format!(
                    "model `{}` needs {} bytes of device memory under {}, more than GPU {}'s {} bytes for instances \
                     ({} minus a reserve of {})",
                    profile.model,
                    p.device_bytes,
                    strategy.name(),
                    g.id,
                    machine.capacity(),
                    machine.memory_bytes,
                    machine.reserve_bytes
                )));
            }
        }
        let warm_ms = by_gpu
            .iter()
            .map(|p| profile.layers.iter().zip(&p.plan).map(|(l, &m)| exec_time(l, m)).sum())
            .collect();
        Ok(Plans {
            by_gpu,
            warm_ms,
            parallel: strategy.parallel(),
            pipelined: strategy != Strategy::Baseline,
        })
    }
}

/// A cold start in progress on one GPU.
struct Job {
    record: usize,
    plan: Rc<ColdPlan>,
    ready: Vec<bool>,
    loads_left: usize,
    next_exec: usize,
    executing: bool,
    /// The layer executing is a DHA layer holding a share of the GPU's link.
    holding: bool,
    /// Per partition: the next position in its layer list to copy.
    copy_next: Vec<usize>,
    /// Per partition ≥ 2: layers landed on the secondary, waiting for the migration stream.
    forward_queue: Vec<VecDeque<usize>>,
    forwarding: Vec<bool>,
}

enum Running {
    /// A warm request, by record.
    Warm(usize),
    Cold(Box<Job>),
}

struct GpuState {
    queue: VecDeque<usize>,
    running: Option<Running>,
    resident: InstanceCache,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Event {
    Arrive(usize),
    ExecDone(usize),
    WarmDone(usize),
    Forwarded { gpu: usize, part: usize, layer: usize },
}

/// Time-ordered events; ties in insertion order.
#[derive(Default)]
struct Events {
    heap: BinaryHeap<Reverse<(Time, u64, Event)>>,
    seq: u64,
}

/// Milliseconds, totally ordered.
#[derive(Clone, Copy, Debug)]
struct Time(f64);
impl PartialEq for Time {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}
impl Eq for Time {}
impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl Events {
    fn push(&mut self, t: f64, e: Event) {
        self.seq += 1;
        self.heap.push(Reverse((Time(t), self.seq, e)));
    }
    fn peek(&self) -> Option<f64> {
        self.heap.peek().map(|Reverse((t, _, _))| t.0)
    }
    fn pop(&mut self) -> Option<Event> {
        self.heap.pop().map(|Reverse((_, _, e))| e)
    }
}

// A copy id packs the GPU (12 bits), the partition (12 bits: at most one per GPU) and the layer
// (32 bits); the topology's and the profile's bounds keep each in its field.
const _: () = assert!(crate::plan::deepplan::transmission::MAX_GPUS <= 1 << 12);
const _: () = assert!(crate::plan::deepplan::profile::MAX_LAYERS <= 1 << 32);

fn copy_id(gpu: usize, part: usize, layer: usize) -> CopyId {
    ((gpu as u64) << 44) | ((part as u64) << 32) | layer as u64
}

fn split_copy_id(id: CopyId) -> (usize, usize, usize) {
    ((id >> 44) as usize, ((id >> 32) & 0xfff) as usize, (id & 0xffff_ffff) as usize)
}

struct Sim<'a> {
    machine: &'a Machine,
    profile: &'a ColdProfile,
    plans: Plans,
    gpus: Vec<GpuState>,
    fabric: Fabric,
    events: Events,
    records: Vec<Record>,
    now: f64,
}

/// Serves `arrivals` (in time order) with `strategy` and returns one record per request, in
/// arrival order. Fails only when the model cannot fit a GPU at all.
pub fn serve(
    machine: &Machine,
    profile: &ColdProfile,
    strategy: Strategy,
    arrivals: &[Arrival],
) -> Result<Vec<Record>> {
    let plans = Plans::new(machine, profile, strategy)?;
    let n = machine.topology.gpus.len();
    let mut links = vec![machine.topology.pcie_gbps; n];
    links.extend(std::iter::repeat_n(machine.topology.uplink_gbps, n));
    let mut sim = Sim {
        machine,
        profile,
        plans,
        gpus: (0..n)
            .map(|_| GpuState {
                queue: VecDeque::new(),
                running: None,
                resident: InstanceCache::new(machine.capacity()),
            })
            .collect(),
        fabric: Fabric::new(links, machine.topology.pcie_gbps),
        events: Events::default(),
        records: Vec::with_capacity(arrivals.len()),
        now: 0.0,
    };
    for (i, a) in arrivals.iter().enumerate() {
        sim.records.push(Record { arrival: *a, start_ms: f64::NAN, end_ms: f64::NAN, cold: false });
        sim.events.push(a.at_ms, Event::Arrive(i));
    }
    sim.run();
    Ok(sim.records)
}

impl Sim<'_> {
    fn run(&mut self) {
        loop {
            let copy = self.fabric.next_end();
            let event = self.events.peek();
            match (copy, event) {
                (None, None) => break,
                (Some((t, id)), e) if e.is_none_or(|e| t < e) => {
                    self.fabric.advance(t);
                    self.now = t;
                    self.fabric.finish(id);
                    self.copied(id);
                }
                (_, Some(t)) => {
                    self.fabric.advance(t);
                    self.now = t;
                    let e = self.events.pop().expect("peeked");
                    self.handle(e);
                }
                (Some(_), None) => unreachable!("matched by the first arm"),
            }
        }
    }

    fn home(&self, instance: usize) -> usize {
        instance % self.gpus.len()
    }

    /// The link indices a copy to GPU (by position) `g` crosses.
    fn links(&self, g: usize) -> [usize; 2] {
        let t = &self.machine.topology;
        let switch = t.gpus[g].switch;
        let first_under = t.gpus.iter().position(|x| x.switch == switch).expect("its own switch");
        [g, t.gpus.len() + first_under]
    }

    fn handle(&mut self, e: Event) {
        match e {
            Event::Arrive(r) => {
                let g = self.home(self.records[r].arrival.instance);
                self.gpus[g].queue.push_back(r);
                self.next(g);
            }
            Event::WarmDone(g) => self.complete(g),
            Event::ExecDone(g) => {
                let link = self.links(g)[0];
                let Some(Running::Cold(job)) = &mut self.gpus[g].running else { unreachable!("a cold job") };
                job.executing = false;
                if std::mem::take(&mut job.holding) {
                    self.fabric.hold(link, false);
                }
                job.next_exec += 1;
                if job.next_exec == self.profile.layers.len() {
                    self.complete(g);
                } else {
                    self.try_exec(g);
                }
            }
            Event::Forwarded { gpu, part, layer } => {
                let Some(Running::Cold(job)) = &mut self.gpus[gpu].running else {
                    unreachable!("a cold job")
                };
                job.ready[layer] = true;
                job.loads_left -= 1;
                job.forwarding[part] = false;
                self.try_forward(gpu, part);
                self.try_exec(gpu);
            }
        }
    }

    /// Starts GPU `g`'s next queued request, if it is idle.
    fn next(&mut self, g: usize) {
        if self.gpus[g].running.is_some() {
            return;
        }
        let Some(r) = self.gpus[g].queue.pop_front() else { return };
        let instance = self.records[r].arrival.instance;
        self.records[r].start_ms = self.now;
        let gpu = &mut self.gpus[g];
        if gpu.resident.pin(instance) {
            gpu.running = Some(Running::Warm(r));
            self.events.push(self.now + self.plans.warm_ms[g], Event::WarmDone(g));
            return;
        }
        self.records[r].cold = true;
        let plan = Rc::clone(&self.plans.by_gpu[g]);
        // Plans::new refused a load set over the budget, and the only instance in flight on
        // this GPU is the one arriving: admission cannot fail.
        gpu.resident.admit(instance, plan.device_bytes).expect("the load set fits the budget");
        let parts = plan.partitions.len();
        let loads = plan.partitions.iter().map(|p| p.layers.len()).sum();
        let job = Job {
            record: r,
            ready: vec![false; self.profile.layers.len()],
            loads_left: loads,
            next_exec: 0,
            executing: false,
            holding: false,
            copy_next: vec![0; parts],
            forward_queue: vec![VecDeque::new(); parts],
            forwarding: vec![false; parts],
            plan,
        };
        gpu.running = Some(Running::Cold(Box::new(job)));
        for p in 0..parts {
            self.start_copy(g, p);
        }
        self.try_exec(g);
    }

    /// The GPU (by position) that carries partition `p` of a cold start on `g`.
    fn carrier(&self, g: usize, plan: &ColdPlan, p: usize) -> usize {
        if !self.plans.parallel || p == 0 {
            return g;
        }
        self.machine.topology.index(plan.gpus[p]).expect("helpers are GPUs of the topology")
    }

    fn start_copy(&mut self, g: usize, p: usize) {
        let Some(Running::Cold(job)) = &mut self.gpus[g].running else { return };
        let Some(&layer) = job.plan.partitions[p].layers.get(job.copy_next[p]) else { return };
        job.copy_next[p] += 1;
        let plan = Rc::clone(&job.plan);
        let links = self.links(self.carrier(g, &plan, p));
        self.fabric.start(copy_id(g, p, layer), self.profile.layers[layer].load_ms, links);
    }

    fn copied(&mut self, id: CopyId) {
        let (g, p, layer) = split_copy_id(id);
        {
            let Some(Running::Cold(job)) = &mut self.gpus[g].running else { unreachable!("a cold job") };
            if p == 0 {
                job.ready[layer] = true;
                job.loads_left -= 1;
            } else {
                job.forward_queue[p].push_back(layer);
            }
        }
        self.start_copy(g, p);
        if p > 0 {
            self.try_forward(g, p);
        }
        self.try_exec(g);
    }

    fn try_forward(&mut self, g: usize, p: usize) {
        let Some(Running::Cold(job)) = &mut self.gpus[g].running else { return };
        if job.forwarding[p] {
            return;
        }
        let Some(layer) = job.forward_queue[p].pop_front() else { return };
        job.forwarding[p] = true;
        let bytes = self.profile.layers[layer].bytes as f64;
        let t = self.now + self.machine.forward_ms + bytes / (self.machine.topology.nvlink_gbps * 1e6);
        self.events.push(t, Event::Forwarded { gpu: g, part: p, layer });
    }

    fn try_exec(&mut self, g: usize) {
        let link = self.links(g)[0];
        let copies = self.fabric.copies_on(link);
        let Some(Running::Cold(job)) = &mut self.gpus[g].running else { return };
        if job.executing || job.next_exec >= self.profile.layers.len() {
            return;
        }
        if !self.plans.pipelined && job.loads_left > 0 {
            return;
        }
        let i = job.next_exec;
        let (layer, method) = (&self.profile.layers[i], job.plan.plan[i]);
        if is_loaded(layer, method) && !job.ready[i] {
            return; // the execution stream waits on the layer's event
        }
        let mut t = exec_time(layer, method);
        let dha = !is_loaded(layer, method) && layer.has_params();
        if dha && self.machine.dha_contention {
            t *= 1.0 + copies as f64;
            job.holding = true;
            self.fabric.hold(link, true);
        }
        job.executing = true;
        self.events.push(self.now + t, Event::ExecDone(g));
    }

    fn complete(&mut self, g: usize) {
        let r = match self.gpus[g].running.take() {
            Some(Running::Cold(job)) => {
                debug_assert_eq!(job.loads_left, 0, "every load landed before the last layer ran");
                job.record
            }
            Some(Running::Warm(r)) => r,
            None => unreachable!("a running request"),
        };
        self.records[r].end_ms = self.now;
        self.gpus[g].resident.unpin(self.records[r].arrival.instance);
        self.next(g);
    }
}
