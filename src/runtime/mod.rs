//! The runtime: model loading, admission, request lifecycle, engine and poller threads.
//!
//! Lifecycle of a request (ARCHITECTURE.md §3): `submit` validates the input and deadline, passes
//! admission (bounded per model; `Busy` when full), and hands the request to the engine thread,
//! whose policy forms batched tasks; a worker stream executes each task and advances its
//! completion counter; the task's watcher sees the counter move (the engine itself for a CPU
//! stream, which rings it; the poller thread, which reports to the engine, for a CUDA one —
//! watch.rs), and the engine completes the task's requests into their tickets or completion queues.

pub(crate) mod admission;
mod blocks;
pub(crate) mod cells;
pub mod coldstart;
pub(crate) mod core;
mod engine;
mod inbox;
mod metrics;
mod poller;
pub mod queue;
pub(crate) mod recycle;
pub mod request;
mod stats;
pub mod tenant;
#[cfg(test)]
mod tests;
mod watch;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::fault::{FaultPlan, FaultyBackend};
use crate::backend::ring::InputRing;
use crate::backend::{self, Backend, BackendChoice, BackendKind, Notify, Runner, RunnerShape};
use crate::error::{Code, Error, Result};
use crate::model::{self, Input, ModelKind, Network};
use crate::sched::adaptive::{AdaptiveConfig, AdaptivePolicy};
use crate::sched::baseline::padding::{PaddingConfig, PaddingPolicy};
use crate::sched::baseline::timeout::{TimeoutConfig, TimeoutPolicy};
use crate::sched::cellular::{CellTypeConfig, CellularConfig, CellularPolicy, DEFAULT_MAX_TASKS_TO_SUBMIT};
use crate::sched::elastic::{ElasticConfig, ElasticPolicy};
use crate::sched::{Policy, RequestId};

use admission::Admission;
use engine::{Engine, EngineGroup, EngineModel, ModelIndices, Pending};
use inbox::{ArrivalRing, EventSender};
use inbox::{ControlBudget, Event, MAX_PENDING_CONTROL};
pub use metrics::METRICS;
use metrics::{Metrics, ModelMetrics};
pub use queue::{Completion, CompletionQueue};
use recycle::InputRef;
use request::{Reply, Sink};
pub use request::{SubmitOptions, Ticket};
pub use stats::StatsSnapshot;
pub use tenant::{Tenant, TenantOptions, TenantSpec};

/// Default admission bound per model: requests accepted whose results the caller has not yet
/// taken (a ticket waited for, a completion dropped).
pub const DEFAULT_ADMISSION_BOUND: usize = 4096;
/// The most requests of one model the runtime reserves its request tables for when the model is
/// added (its admission bound, up to this). Within it, what the runtime holds per request is
/// allocated at load and serving never grows a table, so its memory does not depend on the
/// load's history; a larger bound's tables grow as needed past it.
pub const MAX_RESERVED_REQUESTS: usize = 16_384;

/// The requests a model with admission bound `bound` has its tables and kept records reserved
/// for at load ([`MAX_RESERVED_REQUESTS`]).
pub(crate) fn reserved_requests(bound: usize) -> usize {
    bound.min(MAX_RESERVED_REQUESTS)
}
/// Largest accepted max batch size (rows of one task).
pub const MAX_BATCH_LIMIT: usize = 65_536;
/// Most workers (streams) one model may have.
pub const MAX_WORKERS: usize = 256;
/// Most CPU compute threads.
pub const MAX_CPU_THREADS: usize = 1024;
/// Default stall timeout: how long a worker's oldest task may run before the watchdog declares
/// its stream stalled ([`RuntimeBuilder::stall_timeout`]).
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Checks of the option values above, shared by the builders and the C option setters (which
/// report a bad value as soon as it is set).
pub(crate) mod check {
    use super::{MAX_BATCH_LIMIT, MAX_CPU_THREADS, MAX_WORKERS};
    use crate::error::{Error, Result};

    fn in_range(what: &str, v: usize, max: usize) -> Result<()> {
        if (1..=max).contains(&v) {
            Ok(())
        } else {
            Err(Error::invalid(format!("{what} {v} is outside 1..={max}")))
        }
    }
    pub(crate) fn max_batch(v: usize) -> Result<()> {
        in_range("max batch size", v, MAX_BATCH_LIMIT)
    }
    pub(crate) fn workers(v: usize) -> Result<()> {
        in_range("worker count", v, MAX_WORKERS)
    }
    pub(crate) fn admission_bound(v: usize) -> Result<()> {
        in_range("admission bound", v, usize::MAX)
    }
    /// 0 means one thread per core.
    pub(crate) fn cpu_threads(v: usize) -> Result<()> {
        if v == 0 { Ok(()) } else { in_range("cpu thread count", v, MAX_CPU_THREADS) }
    }
}

/// Builds a [`Runtime`].
#[derive(Clone, Debug)]
pub struct RuntimeBuilder {
    backend: BackendChoice,
    cpu_threads: usize,
    admission_bound: usize,
    stall_timeout: Option<Duration>,
    faults: Option<FaultPlan>,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        RuntimeBuilder {
            backend: BackendChoice::Auto,
            cpu_threads: 0,
            admission_bound: DEFAULT_ADMISSION_BOUND,
            stall_timeout: Some(DEFAULT_STALL_TIMEOUT),
            faults: None,
        }
    }
}

impl RuntimeBuilder {
    pub fn backend(mut self, b: BackendChoice) -> Self {
        self.backend = b;
        self
    }
    /// Compute threads of the CPU backend; 0 (the default) = one per core.
    pub fn cpu_threads(mut self, n: usize) -> Self {
        self.cpu_threads = n;
        self
    }
    /// Default admission bound of each model (≥ 1); a model's options may override it.
    pub fn admission_bound(mut self, n: usize) -> Self {
        self.admission_bound = n;
        self
    }

    /// The stall watchdog's limit: a worker whose oldest task has not completed after this long
    /// is declared stalled — its pending tasks' requests complete `Backend` at once, nothing
    /// more is launched on it, and it is used again if its stream catches up. `None` turns the
    /// watchdog off (a stalled stream then holds its requests until shutdown). Default
    /// [`DEFAULT_STALL_TIMEOUT`]; pick a limit well above the longest task a model runs.
    pub fn stall_timeout(mut self, limit: Option<Duration>) -> Self {
        self.stall_timeout = limit;
        self
    }
    /// Run on the backend wrapped in a fault injector (testing: see [`FaultPlan`]).
    pub fn inject_faults(mut self, plan: FaultPlan) -> Self {
        self.faults = Some(plan);
        self
    }

    pub fn build(self) -> Result<Runtime> {
        check::admission_bound(self.admission_bound)?;
        check::cpu_threads(self.cpu_threads)?;
        if self.stall_timeout.is_some_and(|d| d.is_zero()) {
            return Err(Error::invalid(
                "a stall timeout must be longer than zero (None turns the watchdog off)",
            ));
        }
        let mut backend = backend::create(self.backend, self.cpu_threads)?;
        if let Some(plan) = self.faults {
            backend = Arc::new(FaultyBackend::new(backend, plan));
        }
        Runtime::start(backend, self.admission_bound, self.stall_timeout)
    }
}

/// Which policy batches a model's requests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum PolicyConfig {
    /// The model kind's natural policy: timeout batching with no wait (NO_Wait) for fixed-shape
    /// models, cellular batching with default options for recurrent ones.
    #[default]
    Auto,
    /// TF-Serving style: max batch size, max wait (0 = NO_Wait), workers, static padding.
    /// Fixed-shape models only.
    Timeout(TimeoutConfig),
    /// BatchMaker's cellular batching. Recurrent models only.
    Cellular(CellularOptions),
    /// Graph batching with padding (the TF/MXNet baseline). Recurrent models only.
    Padding(PaddingConfig),
    /// E²bird's elastic batching (N-Ebird, or E-Ebird with engine configurations): workers of
    /// fixed batch sizes, full batches from the input ring, no timer. Fixed-shape models only.
    Elastic(ElasticConfig),
    /// Adaptive batching on a latency model (async-transfer slides): the batch size from the
    /// fitted stage costs, the arrival rate and a latency bound. Fixed-shape models only.
    Adaptive(AdaptiveConfig),
}

/// Options of cellular batching for a model; cell types come from the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellularOptions {
    pub workers: usize,
    /// Max batch per cell type, indexed like [`Network::cell_types`]; a missing entry takes
    /// [`CellularOptions::DEFAULT_MAX_BATCH`] (the Seq2Seq decoder: half of it).
    pub max_batch: Vec<usize>,
    /// `MaxTasksToSubmit`; `None`: the model kind's
    /// ([`CellularOptions::default_max_tasks_to_submit`]).
    pub max_tasks_to_submit: Option<usize>,
}

impl CellularOptions {
    pub const DEFAULT_MAX_BATCH: usize = 512;
    /// A Seq2Seq model's `MaxTasksToSubmit`: 2, where every other kind takes
    /// [`DEFAULT_MAX_TASKS_TO_SUBMIT`] (5). A decoder step's batch is formed from the rows
    /// whose previous step has finished; with five tasks submitted ahead on one stream the
    /// decoder's rows are spread over many small tasks each waiting behind the others, and on
    /// the CPU the peak measured 13–30% lower than with two (README, recurrent serving).
    pub const SEQ2SEQ_MAX_TASKS_TO_SUBMIT: usize = 2;

    /// `MaxTasksToSubmit` of a model of `kind` when none is given.
    pub fn default_max_tasks_to_submit(kind: ModelKind) -> usize {
        if kind == ModelKind::Seq2Seq {
            Self::SEQ2SEQ_MAX_TASKS_TO_SUBMIT
        } else {
            DEFAULT_MAX_TASKS_TO_SUBMIT
        }
    }
}

impl Default for CellularOptions {
    fn default() -> Self {
        CellularOptions { workers: 1, max_batch: Vec::new(), max_tasks_to_submit: None }
    }
}

/// Bytes of recurrent state a model's arena may take by default.
pub const DEFAULT_STATE_BYTES: usize = 256 << 20;

/// Bytes of token-gate tables a recurrent model may hold by default (`ModelOptions::token_gates_bytes`):
/// enough for an h = 256 LSTM over a 30 000-token vocabulary (117 MiB), not for h = 1024 (469 MiB).
pub const DEFAULT_TOKEN_GATES_BYTES: usize = 256 << 20;

/// The policy object for `net` under `cfg` (its workers are [`Policy::workers`]), for a backend
/// that runs at most `max_task_steps` steps in one cell task (`Backend::max_task_steps`).
pub(crate) fn make_policy(net: &Network, cfg: &PolicyConfig, max_task_steps: u32) -> Result<Box<dyn Policy>> {
    let recurrent = net.is_recurrent();
    let kind = net.kind();
    let cfg = match cfg {
        PolicyConfig::Auto if recurrent => PolicyConfig::Cellular(CellularOptions::default()),
        PolicyConfig::Auto => {
            PolicyConfig::Timeout(TimeoutConfig { max_wait: Duration::ZERO, ..TimeoutConfig::default() })
        }
        other => other.clone(),
    };
    let unsupported = |policy: &str, what: &str| {
        Err(Error::new(Code::Unsupported, format!("the {policy} policy batches {what}; `{kind}` is not one")))
    };
    match cfg {
        PolicyConfig::Timeout(_) if recurrent => unsupported("timeout", "fixed-shape models"),
        PolicyConfig::Elastic(_) if recurrent => unsupported("elastic", "fixed-shape models"),
        PolicyConfig::Adaptive(_) if recurrent => unsupported("adaptive", "fixed-shape models"),
        PolicyConfig::Cellular(_) | PolicyConfig::Padding(_) if !recurrent => {
            unsupported("cellular and padding", "recurrent models (lstm, seq2seq, treelstm)")
        }
        PolicyConfig::Timeout(cfg) => {
            check::max_batch(cfg.max_batch)?;
            check::workers(cfg.workers)?;
            Ok(Box::new(TimeoutPolicy::new(cfg)))
        }
        PolicyConfig::Elastic(cfg) => {
            check::workers(cfg.workers.len())?;
            for &bs in &cfg.workers {
                check::max_batch(bs)?;
            }
            Ok(Box::new(ElasticPolicy::new(cfg)?))
        }
        PolicyConfig::Adaptive(cfg) => {
            check::max_batch(cfg.max_batch)?;
            Ok(Box::new(AdaptivePolicy::new(cfg)?))
        }
        PolicyConfig::Cellular(o) => {
            check::workers(o.workers)?;
            let types = net.cell_types();
            if o.max_batch.len() > types.len() {
                return Err(Error::invalid(format!(
                    "{} max batch sizes given; a {kind} model has {} cell type(s)",
                    o.max_batch.len(),
                    types.len()
                )));
            }
            let cell_types = types
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let default = if kind == ModelKind::Seq2Seq && i == usize::from(model::DECODER) {
                        CellularOptions::DEFAULT_MAX_BATCH / 2
                    } else {
                        CellularOptions::DEFAULT_MAX_BATCH
                    };
                    let b = o.max_batch.get(i).copied().unwrap_or(default);
                    check::max_batch(b)?;
                    Ok(CellTypeConfig::new(t.name, b, t.priority))
                })
                .collect::<Result<Vec<_>>>()?;
            let max_tasks_to_submit =
                o.max_tasks_to_submit.unwrap_or_else(|| CellularOptions::default_max_tasks_to_submit(kind));
            let cfg = CellularConfig { cell_types, workers: o.workers, max_tasks_to_submit };
            Ok(Box::new(CellularPolicy::new(cfg)?))
        }
        PolicyConfig::Padding(cfg) => {
            check::workers(cfg.workers)?;
            check::max_batch(cfg.max_batch)?;
            // A tree level is padded to batch × its widest request's node count.
            let level_width = match net {
                Network::TreeLstm(m) => m.max_nodes(),
                _ => 1,
            };
            let max_steps = cfg.max_steps.min(max_task_steps.max(1));
            Ok(Box::new(PaddingPolicy::new(PaddingConfig { level_width, max_steps, ..cfg })?))
        }
        PolicyConfig::Auto => unreachable!("resolved above"),
    }
}

/// Most rows a runner's task may have (its buffers are allocated up front): a padded tree level
/// wider than this fails at launch rather than sizing every worker's buffers for it.
const MAX_TASK_ROWS: usize = 1 << 16;

/// Workers and the largest task (rows, at most [`MAX_TASK_ROWS`]) to prepare a runner with for
/// `policy`. Backends size every worker's buffers alike, for the largest.
fn runner_size(policy: &dyn Policy) -> (usize, usize) {
    let workers = policy.workers();
    let max = workers.iter().map(|w| w.max_batch).max().unwrap_or(1);
    (workers.len(), max.min(MAX_TASK_ROWS))
}

/// State slots for a recurrent model: enough for `bound` requests and for one request of the
/// largest size, but never more than [`DEFAULT_STATE_BYTES`] hold (and at least one). A model
/// file's `max_nodes` therefore never sizes the arena past its budget: a tree larger than the
/// arena is refused at submit ("needs N state slots"); `ModelOptions::state_slots` sets more.
pub(crate) fn default_state_slots(net: &Network, bound: usize) -> usize {
    let (per_request, most) = match net {
        Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => return 0,
        Network::Lstm(_) | Network::Seq2Seq(_) => (1, 1),
        Network::TreeLstm(m) => (64, m.max_nodes()),
    };
    let budget = DEFAULT_STATE_BYTES / (net.state_width() * 4).max(1);
    bound.saturating_mul(per_request).max(most).min(budget).max(1)
}

/// Options for [`Runtime::load_model`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelOptions {
    pub policy: PolicyConfig,
    /// Overrides the runtime's default admission bound for this model.
    pub admission_bound: Option<usize>,
    /// A name for messages and stats; defaults to the directory's name.
    pub name: Option<String>,
    /// State slots of a recurrent model's arena (one per in-flight request; one per node of an
    /// in-flight tree). Requests wait for slots in arrival order when all are taken. Default:
    /// enough for the admission bound within 256 MiB.
    pub state_slots: Option<usize>,
    /// Most bytes of **token-gate tables** the model may hold (default
    /// [`DEFAULT_TOKEN_GATES_BYTES`]; 0 turns them off). On the CPU backend an LSTM chain's first
    /// layer reads a token's embedding; folding the embedding into that layer's input projection
    /// (`vocab × 4·hidden` values, computed at load) halves a step's multiply-adds at
    /// `embed = hidden`, at the price of that memory. A chain whose table does not fit the budget
    /// runs unfolded (same results up to rounding).
    pub token_gates_bytes: Option<usize>,
}

/// What every handle of a model shares; dropped with the last one.
struct ModelShared {
    index: usize,
    name: String,
    net: Arc<Network>,
    admission: Arc<Admission>,
    /// State slots of a recurrent model (0 otherwise).
    state_slots: usize,
    metrics: Arc<ModelMetrics>,
    /// Where submits write their arrivals for the engine (inbox.rs).
    arrivals: Arc<ArrivalRing>,
    rt: Arc<Shared>,
}

impl Drop for ModelShared {
    /// The last handle is gone: the engine releases the model once its pending requests have
    /// completed (engine.rs, "Freeing a model"). Every submit through a handle has sent its
    /// arrival before this. A runtime already stopped has released every model.
    fn drop(&mut self) {
        let _ = self.rt.events.send(Event::RemoveModel(self.index));
    }
}

struct Shared {
    epoch: Instant,
    backend: Arc<dyn Backend>,
    events: EventSender,
    /// `true` while submits are accepted. Submits hold it shared while they enqueue, so once
    /// shutdown has flipped it no arrival can follow the shutdown event.
    gate: RwLock<bool>,
    next_id: AtomicU64,
    stats: Arc<stats::Stats>,
    metrics: Arc<Metrics>,
    default_bound: usize,
    /// The engine's model slots in use and free (a released model's index is reused).
    model_indices: Arc<Mutex<ModelIndices>>,
    /// What the models' streams call after advancing their counters (the runners' `Notify`).
    bell: inbox::StreamBell,
    /// Bounds the cancels and flushes in the event channel (inbox.rs, `MAX_PENDING_CONTROL`).
    control: Arc<ControlBudget>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    /// The `Notify` a model's runner gets: its streams ring the engine's bell after advancing
    /// their counters (watch.rs).
    fn notify(&self) -> Notify {
        let bell = self.bell.clone();
        Arc::new(move || bell.ring())
    }
}

/// A libserve runtime. Thread-safe; share it by reference or `Arc`. Dropping it shuts it down
/// with no drain: pending requests complete `Cancelled`.
pub struct Runtime {
    shared: Arc<Shared>,
}

/// A model loaded into a runtime. Cheap to clone; thread-safe. Submitting after the runtime has
/// shut down fails with `Shutdown`.
///
/// Dropping the last clone frees the model: requests already submitted still complete as usual
/// (each exactly once, with its normal result), and once they have, the runtime releases the
/// model's worker threads, state and buffers. A handle may outlive its runtime.
#[derive(Clone)]
pub struct Model {
    m: Arc<ModelShared>,
}

impl Runtime {
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    fn start(
        backend: Arc<dyn Backend>,
        default_bound: usize,
        stall_timeout: Option<Duration>,
    ) -> Result<Runtime> {
        let spawn_err = |e: std::io::Error| Error::internal(format!("cannot spawn a runtime thread: {e}"));
        let stats = Arc::new(stats::Stats::default());
        let (ev_tx, ev_rx) = mpsc::channel();
        let ev_tx = EventSender::new(ev_tx);
        let (poll_tx, poll_rx) = mpsc::channel();
        let poller_events = ev_tx.clone();
        let poller = std::thread::Builder::new()
            .name("serve-poller".into())
            .spawn(move || poller::run(poll_rx, poller_events, stall_timeout))
            .map_err(spawn_err)?;
        let epoch = Instant::now();
        let model_indices = Arc::new(Mutex::new(ModelIndices::default()));
        // Freed models are dropped here, off the engine thread: a runner's drop may wait (a CUDA
        // context synchronises), and the engine must not stall other models meanwhile.
        let (reap_tx, reap_rx) = mpsc::channel::<Box<dyn Send>>();
        let control = Arc::new(ControlBudget::default());
        let reaper = std::thread::Builder::new()
            .name("serve-reaper".into())
            .spawn(move || reap_rx.into_iter().for_each(drop))
            .map_err(spawn_err)?;
        let advanced = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let bell = ev_tx.bell(advanced.clone());
        let engine = Engine::new(
            epoch,
            (
                poller::PollerHandle::new(poll_tx, poller.thread().clone()),
                watch::Watcher::new(stall_timeout),
                advanced,
            ),
            stats.clone(),
            model_indices.clone(),
            reap_tx,
            control.clone(),
        );
        let engine_thread = std::thread::Builder::new()
            .name("serve-engine".into())
            .spawn(move || engine.run(ev_rx))
            .map_err(spawn_err)?;
        // Before anything can be sent to it (inbox.rs).
        ev_tx.set_engine(engine_thread.thread().clone());
        let shared = Arc::new(Shared {
            epoch,
            backend,
            events: ev_tx,
            gate: RwLock::new(true),
            next_id: AtomicU64::new(0),
            stats,
            metrics: Metrics::new(),
            default_bound,
            model_indices,
            bell,
            control,
            threads: Mutex::new(vec![engine_thread, poller, reaper]),
        });
        Ok(Runtime { shared })
    }

    pub fn backend_kind(&self) -> BackendKind {
        self.shared.backend.kind()
    }

    pub fn backend_description(&self) -> String {
        self.shared.backend.describe()
    }

    /// Load the model in `dir` (ARCHITECTURE.md §6) and prepare it on the backend.
    pub fn load_model(&self, dir: impl AsRef<Path>, opts: ModelOptions) -> Result<Model> {
        self.load_model_with(dir, opts, |_, _| Ok(()))
    }

    /// [`load_model`](Self::load_model), with the options finished by `configure` once the
    /// network is known (e.g. to pick the policy for its kind).
    pub fn load_model_with(
        &self,
        dir: impl AsRef<Path>,
        mut opts: ModelOptions,
        configure: impl FnOnce(&Network, &mut ModelOptions) -> Result<()>,
    ) -> Result<Model> {
        let dir = dir.as_ref();
        let net = Arc::new(model::load(dir)?);
        configure(&net, &mut opts)?;
        let name = opts.name.clone().unwrap_or_else(|| {
            dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into())
        });
        self.add_network(net, name, opts)
    }

    /// Serve a custom model (ARCHITECTURE.md §6): the caller's own computation, batched by
    /// libserve under any fixed-shape policy (timeout batching by default) and called once per
    /// batched task on the model's worker threads. `INVALID_ARGUMENT` for zero or oversized
    /// sizes or inconsistent layers.
    pub fn add_custom(
        &self,
        model: crate::model::CustomModel,
        name: &str,
        opts: ModelOptions,
    ) -> Result<Model> {
        self.add_network(Arc::new(Network::Custom(model)), name.to_string(), opts)
    }

    /// Serve an already-built network (e.g. one made in code rather than loaded from disk).
    pub fn add_network(&self, net: Arc<Network>, name: String, opts: ModelOptions) -> Result<Model> {
        net.check()?;
        let bound = opts.admission_bound.unwrap_or(self.shared.default_bound);
        check::admission_bound(bound)?;
        let policy = make_policy(&net, &opts.policy, self.shared.backend.max_task_steps())?;
        let (workers, max_batch) = runner_size(&*policy);
        let state_slots = match opts.state_slots {
            Some(0) => return Err(Error::invalid("state slots must be at least 1")),
            Some(n) => n,
            None => default_state_slots(&net, bound),
        };
        let notify = self.shared.notify();
        let shape = match net.is_recurrent() {
            true => RunnerShape {
                workers,
                max_batch,
                state_slots,
                token_gates_bytes: opts.token_gates_bytes.unwrap_or(DEFAULT_TOKEN_GATES_BYTES),
            },
            false => RunnerShape::fixed(workers, max_batch),
        };
        let runner = self.shared.backend.prepare(net.clone(), shape, notify)?;
        let ring = match policy.input_ring_slots() {
            0 => None,
            slots => Some(Arc::new(runner.input_ring(slots, net.dense_lens().0)?)),
        };
        let gate = self.shared.gate.read().unwrap_or_else(|p| p.into_inner());
        if !*gate {
            return Err(Error::new(Code::Shutdown, "the runtime is shut down"));
        }
        let (index, em, model) = self.register(net, name, Arc::from(runner), ring, bound);
        let group = EngineGroup { policy, models: vec![(index, em)], cpus: Vec::new() };
        self.add_group(group)?;
        drop(gate);
        Ok(model)
    }

    /// A prepared model's index, its parts for the engine and its handle (the caller holds the
    /// submit gate open, and sends the parts in a group).
    fn register(
        &self,
        net: Arc<Network>,
        name: String,
        runner: Arc<dyn Runner>,
        ring: Option<Arc<InputRing>>,
        bound: usize,
    ) -> (usize, EngineModel, Model) {
        let workers = runner.workers();
        let state_slots = runner.state_slots();
        let recycle =
            recycle::Recycler::new(&net, reserved_requests(bound), runner.io_lens().1, &self.shared.stats);
        let admission = Arc::new(Admission::new(bound, workers, recycle));
        let arrivals = Arc::new(ArrivalRing::new(reserved_requests(bound)));
        let index = self.shared.model_indices.lock().unwrap_or_else(|p| p.into_inner()).take();
        let metrics = Arc::new(self.shared.metrics.model(&name, workers));
        let em = EngineModel {
            net: net.clone(),
            ring,
            runner,
            metrics: metrics.clone(),
            admission: admission.clone(),
            arrivals: arrivals.clone(),
        };
        let shared = ModelShared {
            index,
            name,
            net,
            admission,
            state_slots,
            metrics,
            arrivals,
            rt: self.shared.clone(),
        };
        (index, em, Model { m: Arc::new(shared) })
    }

    /// Hand a group of registered models to the engine.
    fn add_group(&self, group: EngineGroup) -> Result<()> {
        self.shared
            .events
            .send(Event::AddGroup(Box::new(group)))
            .map_err(|_| Error::new(Code::Shutdown, "the runtime is shut down"))
    }

    /// Ask for request `id` to be cancelled. A queued request completes `Cancelled` at once, a
    /// running one at its next cell / layer-block boundary; a request already completed is left as
    /// it is. Fails for an id this runtime never issued, and with `Busy` while callers have
    /// 65,536 cancels and flushes waiting for the engine (a loop of cancels cannot grow the
    /// engine's queue without bound; retry once some are handled).
    pub fn cancel(&self, id: RequestId) -> Result<()> {
        if id >= self.shared.next_id.load(Ordering::Acquire) {
            return Err(Error::invalid(format!("unknown request id {id}")));
        }
        if !self.shared.control.take() {
            return Err(Error::new(
                Code::Busy,
                format!("{MAX_PENDING_CONTROL} cancels and flushes are already waiting for the engine"),
            ));
        }
        if self.shared.events.send(Event::Cancel(id)).is_err() {
            self.shared.control.give_back();
        }
        Ok(())
    }

    /// Stop accepting requests, let pending ones finish for up to `drain`, then complete whatever
    /// is left `Cancelled`, and stop the runtime's threads. Idempotent.
    pub fn shutdown(&self, drain: Duration) {
        {
            let mut gate = self.shared.gate.write().unwrap_or_else(|p| p.into_inner());
            *gate = false;
            // Every call sends its drain limit (the engine keeps the earliest), even a second one.
            let until = Instant::now()
                .checked_add(drain)
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(86400 * 365));
            let _ = self.shared.events.send(Event::Shutdown { drain_until: until });
        }
        // Joined under the lock: a concurrent caller waits here until the threads have ended.
        // (Called from the engine thread itself, e.g. by a waker, it cannot join itself.)
        let mut threads = self.shared.threads.lock().unwrap_or_else(|p| p.into_inner());
        let me = std::thread::current().id();
        for t in threads.drain(..) {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }

    pub fn is_shut_down(&self) -> bool {
        !*self.shared.gate.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// The runtime's metrics in the OpenMetrics text format (which Prometheus scrapes; serve it
    /// with the content type `application/openmetrics-text; version=1.0.0; charset=utf-8`),
    /// ending with `# EOF`. The series are listed in [`METRICS`].
    pub fn metrics_text(&self) -> String {
        self.shared.metrics.encode()
    }

    /// Nanoseconds since the runtime started (the clock the engine runs policies on).
    pub fn uptime(&self) -> Duration {
        self.shared.epoch.elapsed()
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.shutdown(Duration::ZERO);
    }
}

/// A request's input as submit receives it: owned (the Rust API), or borrowed from a C caller
/// and copied at submit.
enum InputSource<'a> {
    Owned(Input),
    Copy(InputRef<'a>),
}

impl Model {
    pub fn name(&self) -> &str {
        &self.m.name
    }
    pub fn kind(&self) -> ModelKind {
        self.m.net.kind()
    }
    pub fn network(&self) -> &Network {
        &self.m.net
    }
    /// Requests of this model accepted whose results the caller has not yet taken (waited for a
    /// ticket, dropped a completion): what the admission bound limits.
    pub fn admitted(&self) -> usize {
        self.m.admission.admitted()
    }

    /// Submit a request; wait on the returned ticket.
    pub fn submit(&self, input: Input, opts: SubmitOptions) -> Result<Ticket> {
        let mut ticket = None;
        self.enqueue(InputSource::Owned(input), opts, |id| {
            let (t, slot) = Ticket::new(id);
            ticket = Some(t);
            Sink::Ticket(slot)
        })?;
        Ok(ticket.expect("sink made on success"))
    }

    /// Submit a request whose completion goes to `queue` with `tag`. Returns the request id
    /// (for [`Runtime::cancel`]).
    pub fn submit_to(
        &self,
        input: Input,
        opts: SubmitOptions,
        queue: &CompletionQueue,
        tag: u64,
    ) -> Result<RequestId> {
        self.enqueue(InputSource::Owned(input), opts, |_| Sink::Queue { queue: queue.shared().clone(), tag })
    }

    /// [`submit_to`](Self::submit_to) with the input borrowed: it is copied into the buffer of
    /// a completed request's record where the model has one kept (the C ABI's submits).
    pub(crate) fn submit_copy_to(
        &self,
        input: InputRef<'_>,
        opts: SubmitOptions,
        queue: &CompletionQueue,
        tag: u64,
    ) -> Result<RequestId> {
        self.enqueue(InputSource::Copy(input), opts, |_| Sink::Queue { queue: queue.shared().clone(), tag })
    }

    /// A hint that no more requests are coming soon (the end of an input): the requests already
    /// submitted do not wait for a fuller batch (timeout batching's max wait); later ones batch
    /// as usual. Only the timeout policy holds requests back, so for the others it changes
    /// nothing. A hint: dropped while callers have 65,536 cancels and flushes waiting for the
    /// engine.
    pub fn flush(&self) {
        let rt = &self.m.rt;
        if rt.control.take() && rt.events.send(Event::Flush(self.m.index)).is_err() {
            rt.control.give_back();
        }
    }

    /// Count a submit refused before it reached the model (e.g. a NULL input pointer in the C ABI).
    pub(crate) fn record_reject(&self, code: Code) {
        self.m.rt.stats.record_reject();
        self.m.metrics.rejected(code);
    }

    fn enqueue(
        &self,
        input: InputSource<'_>,
        opts: SubmitOptions,
        sink: impl FnOnce(RequestId) -> Sink,
    ) -> Result<RequestId> {
        let r = self.try_enqueue(input, opts, sink);
        if let Err(e) = &r {
            self.record_reject(e.code());
        }
        r
    }

    fn try_enqueue(
        &self,
        source: InputSource<'_>,
        opts: SubmitOptions,
        sink: impl FnOnce(RequestId) -> Sink,
    ) -> Result<RequestId> {
        // A borrowed input is copied into the buffer of a completed request's record, kept by
        // the model, and the record is overwritten (recycle.rs); a refused request hands it
        // back. An owned input comes with its own buffer: it gets a new record, as a kept one
        // would have nothing to offer it (and taking one measured slower: the record's old
        // buffer freed on the caller's thread).
        let recycle = self.m.admission.recycler();
        let (input, record) = match source {
            InputSource::Owned(input) => (input, None),
            InputSource::Copy(input) => {
                let mut record = recycle.record();
                let spare = record.as_mut().map_or(Input::F32(Vec::new()), |r| {
                    std::mem::replace(&mut r.input, Input::F32(Vec::new()))
                });
                (input.copy_into(spare), record)
            }
        };
        let gate = self.m.rt.gate.read().unwrap_or_else(|p| p.into_inner());
        let accepted = match self.accept(&input, &opts, *gate) {
            Ok(accepted) => accepted,
            Err(e) => {
                if let Some(mut r) = record {
                    r.input = input;
                    recycle.put_record(r);
                }
                return Err(e);
            }
        };
        let Accepted { cells, slots_needed, rows, permit, now } = accepted;
        let id = self.m.rt.next_id.fetch_add(1, Ordering::AcqRel);
        self.m.rt.stats.record_submit();
        let reply = Reply::new(id, sink(id), self.m.rt.stats.clone(), permit);
        let pending = Pending {
            model: self.m.index,
            submitted: now,
            rows,
            input,
            cells,
            slots_needed,
            deadline: opts.deadline,
            priority: opts.priority,
            reply,
            run: Default::default(),
        };
        let pending = match record {
            Some(mut r) => {
                *r = pending;
                r
            }
            None => Box::new(pending),
        };
        // Into the model's ring (inbox.rs); through the channel only past the places reserved
        // for a bound larger than `MAX_RESERVED_REQUESTS`.
        let sent = match self.m.arrivals.push(pending) {
            Ok(()) => {
                self.m.rt.events.wake();
                Ok(())
            }
            Err(pending) => self.m.rt.events.send(Event::Arrive(pending)),
        };
        if let Err(mpsc::SendError(ev)) = sent {
            // The engine is gone (it cannot be while the gate is open, but never lose a request):
            // the reply completes the request `Cancelled` when dropped here.
            // (Its permit goes with it.)
            self.m.admission.finished(rows);
            drop(ev);
        }
        drop(gate);
        Ok(id)
    }

    /// Every check of `try_enqueue` up to admission, in order (ARCHITECTURE §3.1): the input
    /// against the model (and its cell graph), its state slots, its deadline, the shutdown
    /// gate (`open`: read under the gate's lock, held until the arrival is sent), admission.
    fn accept(&self, input: &Input, opts: &SubmitOptions, open: bool) -> Result<Accepted> {
        let recycle = self.m.admission.recycler();
        let cells =
            recycle.unfold(&self.m.net, input).map_err(|e| e.context(format!("model `{}`", self.m.name)))?;
        // State slots it needs before its policy may see it (0 for a fixed-shape request).
        let slots_needed = cells.as_ref().map_or(0, |g| cells::slots_needed(&self.m.net, g));
        if slots_needed > self.m.state_slots {
            return Err(Error::invalid(format!(
                "model `{}`: the request needs {slots_needed} state slots; the model has {}",
                self.m.name, self.m.state_slots
            )));
        }
        let now = Instant::now();
        if let Some(d) = opts.deadline
            && d <= now
        {
            return Err(Error::new(Code::DeadlineExceeded, "the deadline had already passed at submit"));
        }
        if !open {
            return Err(Error::new(Code::Shutdown, "the runtime is shut down"));
        }
        // Rows of work: one for a fixed-shape request, one per cell of a recurrent one.
        let rows = cells.as_ref().map_or(1, |g| g.len() as u64);
        let permit = self.m.admission.admit(&self.m.name, rows, opts.deadline, now)?;
        Ok(Accepted { cells, slots_needed, rows, permit, now })
    }
}

/// A request that passed [`Model::accept`]: what its record is made of.
struct Accepted {
    cells: Option<Arc<crate::sched::CellGraph>>,
    slots_needed: usize,
    rows: u64,
    permit: admission::Permit,
    now: Instant,
}
