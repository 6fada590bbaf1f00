//! Backends: where batched tasks execute.
//!
//! Every backend offers the same shape (ARCHITECTURE.md §1.2): a model is *prepared* on it as a
//! [`Runner`] with one ordered stream per worker; the runtime launches a task on a worker's stream
//! and learns of its completion only through that worker's [`CompletionSignal`], a counter that
//! the executing side increments once per finished task (a CPU thread's atomic store here; the
//! signaling kernel's system-scope write on CUDA). The runtime reads the counters with acquire
//! loads — the engine thread those of streams that notify, the poller thread the others — and
//! nothing else reports completion.

pub mod cpu;
pub mod cuda;
pub(crate) mod custom;
pub mod fault;
pub mod ring;

use std::fmt;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use crate::error::{Code, Error, Result};
use crate::model::Network;
use crate::sched::CellType;

/// Which backend a runtime should use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// CUDA when a usable device is found and the CUDA backend is built, else the CPU.
    #[default]
    Auto,
    Cpu,
    Cuda,
}

impl BackendChoice {
    pub fn parse(s: &str) -> Option<BackendChoice> {
        match s {
            "auto" => Some(BackendChoice::Auto),
            "cpu" => Some(BackendChoice::Cpu),
            "cuda" => Some(BackendChoice::Cuda),
            _ => None,
        }
    }
}

/// The backend a runtime actually uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl fmt::Display for BackendKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        })
    }
}

/// A per-stream completion counter: the number of tasks finished on the stream so far.
/// One writer (the stream), any number of readers doing acquire loads.
pub trait CompletionSignal: Send + Sync {
    /// Tasks completed so far. An acquire load: the task's outputs are visible once counted.
    fn completed(&self) -> u64;

    /// Whether the stream calls its [`Notify`] after every advance of the counter (CPU streams):
    /// the engine then watches the counter itself, woken by that call (`runtime/watch.rs`). A
    /// signal that does not (a CUDA counter, written by the device) is watched by the poller
    /// thread, which spins on it while tasks are in flight. The answer must not change over a
    /// signal's life (a worker's tasks would be split between two watchers and lose their
    /// order). `false` unless the signal promises it: a signal that says `true` and skips a notify leaves a completion unseen, one that
    /// says `false` only costs the poller's spinning.
    fn notifies(&self) -> bool {
        false
    }

    /// Why the stream can no longer advance the counter (a device fault), or `None` while it
    /// works. The watcher asks at every health pass while it waits on the stream; on
    /// `Some` it reports the stream's pending tasks done, and the runner's
    /// [`collect`](Runner::collect) gives them the stream's error.
    fn failure(&self) -> Option<Error> {
        None
    }
}

/// Called by a stream after it has advanced its counter, so the engine, which watches the
/// counters of streams that notify, wakes at once. (The poller spins instead on signals that do
/// not notify; the counter stays the only source of truth.)
pub type Notify = Arc<dyn Fn() + Send + Sync>;

/// The host-side data of one batched task. The engine fills `work`; the task's results reach
/// `output`, `tokens` (or `error`) by the time the engine has seen the count and called
/// [`Runner::collect`] — written by the stream before it advances its counter (CPU), or copied
/// by `collect` from where the device wrote them (CUDA). The engine reads them after `collect`.
#[derive(Debug)]
pub struct TaskData {
    /// Rows computed (including padding rows).
    pub rows: usize,
    /// CPU threads the task may use (0: the runner's own count; more than it has: its count).
    pub cores: usize,
    /// The CPUs a core lease gives the task (VELTAIR, `runtime::tenant`): its threads run pinned
    /// one to each, `cores` of them. Empty: not pinned (the CPU backend's layer runner reads
    /// it; other runners ignore it).
    pub lease: Vec<usize>,
    pub io: Mutex<TaskIo>,
}

/// What a task computes.
#[derive(Debug)]
pub enum Work {
    /// Fixed-shape rows: `rows × input_len` values, row-major; padding rows are zeros.
    Dense(Vec<f32>),
    /// Fixed-shape rows read in place from the model's input ring (elastic batching: the batch
    /// is a run of consecutive slots, each request's input copied there once at its arrival).
    Ring(ring::RingRows),
    /// One batched step of a recurrent model's cell type.
    Cells(CellTask),
    /// Layers `first..last` of a layer model (`Network::layers`) over the task's rows: `input`
    /// holds each row's values entering layer `first` (`rows ×` that layer's input length; for
    /// `first == 0` the rows a `Dense` task carries), and the task's output is each row's values
    /// leaving layer `last − 1` (the model's output when `last` is its layer count).
    Layers { first: usize, last: usize, input: Vec<f32> },
}

/// One batched cell step (cellular batching): rows of one cell type, each naming the state slots
/// it reads and writes. Rows beyond `rows.len()` up to the task's row count are padding.
#[derive(Debug, Default)]
pub struct CellTask {
    pub cell: CellType,
    pub rows: Vec<CellRow>,
    /// Children's state slots of tree rows (`CellRow::children` indexes this).
    pub children: Vec<u32>,
    /// Steps of a multi-step task (a padded batch of paths run in one call, `TaskShape::Cells`
    /// with `steps`); 0 and 1 both mean one step ([`steps`](Self::steps)). Only backends whose
    /// [`Backend::max_task_steps`] allows it receive more.
    pub steps: u32,
    /// A multi-step task's input tokens, `rows × steps` row-major: row `r`'s token at step `s`
    /// (its first at step 0, like `CellRow::token`). Empty for a one-step task.
    pub tokens: Vec<u32>,
}

impl CellTask {
    /// The steps every row runs (rows whose `CellRow::steps` is fewer are padding after them).
    pub fn steps(&self) -> u32 {
        self.steps.max(1)
    }

    /// The real steps of `row` in this task (`CellRow::steps`, 0 read as all of them).
    pub fn row_steps(&self, row: &CellRow) -> u32 {
        if row.steps == 0 { self.steps() } else { row.steps.min(self.steps()) }
    }

    /// Cells the task runs for its real rows (its rows' real steps, summed).
    pub fn cells(&self) -> usize {
        self.rows.iter().map(|r| self.row_steps(r) as usize).sum()
    }
}

/// A real row of a cell task.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellRow {
    /// The state slot the node writes (chains: the request's slot, holding every layer; trees:
    /// the node's own slot).
    pub slot: u32,
    /// The node's input token (`u32::MAX`: none). Decoder rows after the first read the token
    /// their previous step produced from the state slot instead.
    pub token: u32,
    /// First node of its chain: the previous state is zero (encoder / lstm), or the decoder's
    /// first step (input token `bos`).
    pub first: bool,
    /// Tree rows: the range of `CellTask::children` holding the children's slots.
    pub children: Range<u32>,
    /// The node's output is wanted (the last lstm step, a tree root): its top-layer `h` is
    /// appended to `TaskIo::output`. In a multi-step task: the `h` after the row's last step.
    pub output: bool,
    /// A multi-step task's real steps of this row (`1..=CellTask::steps()`): after them the row is
    /// padding (computed, its state no longer written). 0 is read as all of them.
    pub steps: u32,
}

#[derive(Debug)]
pub struct TaskIo {
    pub work: Work,
    /// Dense: `rows × output_len` values. Cells: `output_len` values for each row marked
    /// `output`, in row order.
    pub output: Vec<f32>,
    /// Decoder cells: the token each real row produced.
    pub tokens: Vec<u32>,
    /// Set when the task failed; every request of the task then completes with it.
    pub error: Option<Error>,
    /// What the stream measured of the task (the engine's `TaskReport` to the policy).
    pub stages: StageTimes,
}

/// Stage times a backend measured of one task; `None` for a stage it cannot measure or the
/// task did not have. The CPU stream times the task's compute on its thread (no transfers: the
/// rows are read where they lie); the CUDA runner times the task's work on its stream with two
/// CUDA events (compute: its input rows are read from pinned mapped memory by the kernels, so
/// there is no separate upload or download to time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageTimes {
    pub upload: Option<std::time::Duration>,
    pub compute: Option<std::time::Duration>,
    pub download: Option<std::time::Duration>,
}

impl Work {
    /// The rows of a whole-model task (`Dense`, or a `Ring` run read in place); `None` for other
    /// work.
    pub fn dense_rows(&self) -> Option<&[f32]> {
        match self {
            Work::Dense(x) => Some(x),
            Work::Ring(r) => Some(r.values()),
            Work::Cells(_) | Work::Layers { .. } => None,
        }
    }

    /// The layers `[first, last)` a layer-model task runs and the rows entering `first`: a
    /// `Dense` task is the whole model, `(0, layers)`. A range outside the model's `layers` is
    /// `INVALID_ARGUMENT`; a cell task is `INTERNAL` (no layer model receives one).
    pub fn layer_range(&self, layers: usize) -> Result<((usize, usize), &[f32])> {
        match self {
            Work::Dense(x) => Ok(((0, layers), x)),
            Work::Ring(r) => Ok(((0, layers), r.values())),
            Work::Layers { first, last, input } if first < last && *last <= layers => {
                Ok(((*first, *last), input))
            }
            Work::Layers { first, last, .. } => {
                Err(Error::invalid(format!("layers {first}..{last} of a model of {layers} layers")))
            }
            Work::Cells(_) => Err(Error::internal("a layer model's task must carry rows, not cells")),
        }
    }
}

impl TaskData {
    pub fn new(rows: usize, work: Work) -> Arc<TaskData> {
        TaskData::with_cores(rows, 0, work)
    }

    /// A task that runs on at most `cores` threads (0: the runner's own count).
    pub fn with_cores(rows: usize, cores: usize, work: Work) -> Arc<TaskData> {
        TaskData::leased(rows, cores, Vec::new(), work)
    }

    /// A task on the CPUs of a core lease: `lease.len()` threads, pinned one to each (an empty
    /// lease: `cores` threads, not pinned).
    pub fn leased(rows: usize, cores: usize, lease: Vec<usize>, work: Work) -> Arc<TaskData> {
        let cores = if lease.is_empty() { cores } else { lease.len() };
        Arc::new(TaskData {
            rows,
            cores,
            lease,
            io: Mutex::new(TaskIo {
                work,
                output: Vec::new(),
                tokens: Vec::new(),
                error: None,
                stages: StageTimes::default(),
            }),
        })
    }
}

/// A model prepared on a backend: weights in place, one stream and its buffers per worker.
pub trait Runner: Send + Sync {
    fn workers(&self) -> usize;
    /// The completion counter of `worker`'s stream.
    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal>;
    /// Enqueue `task` on `worker`'s stream. Returns the value the worker's counter reaches when
    /// the task has completed (successfully or with `TaskIo::error` set).
    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64>;
    /// Make a finished task's results readable in its [`TaskIo`]. The engine calls it once for
    /// each task it handed to [`launch`](Runner::launch) on `worker` (also when the launch failed:
    /// then there is nothing to do), after its count was seen (or its watcher reported the
    /// stream failed or stalled), before it reads `output`, `tokens` and `error`. A task reported
    /// without its count (a failed stream, or one the stall watchdog gave up on) may still be
    /// running: `collect` must then set its error and free nothing the stream may still use
    /// (the engine gives the task's requests an error either way). Tasks still in flight at
    /// shutdown are never collected: the runner releases what they hold when it is dropped. A
    /// runner whose stream writes `TaskIo` itself (the CPU) has nothing to do; the CUDA runner
    /// copies the results from the task's pinned buffers, sets the error of a task whose stream
    /// failed, and recycles the buffers only once the counter has passed them.
    fn collect(&self, worker: usize, task: &TaskData) {
        let _ = (worker, task);
    }
    /// Values per input row and per output row (recurrent models: 0 and `hidden`).
    fn io_lens(&self) -> (usize, usize);
    /// State slots of the model's arena (recurrent models; 0 for fixed-shape ones). The engine
    /// hands them out to requests and names them in [`CellRow`]s.
    fn state_slots(&self) -> usize;
    /// The model's input ring for elastic batching: `slots` rows of `row_len` values, each
    /// written once at its request's arrival and read in place by the task whose run covers it
    /// ([`Work::Ring`]). The default keeps the rows on the heap, where a CPU stream reads them;
    /// the CUDA runner of a model that reads its input on the device mirrors them into device
    /// memory, one copy per write, so that a task reads its run there (`cuda/ring.rs`).
    fn input_ring(&self, slots: usize, row_len: usize) -> Result<ring::InputRing> {
        ring::InputRing::new(slots, row_len)
    }
    /// Threads a task of `rows` rows of cell type `cell` runs on when it may use all the
    /// backend's: 1 when it runs on its stream's thread alone, the compute pool's when a CPU
    /// recurrent task is big enough for it. Co-running CPU workers share the pool's cores, and
    /// the simulator's CPU cost model (`serve profile`, `sim::cost`'s `cores`) shares them as the
    /// backend does. Runners that do not say answer 1: device runners (the device is not made of
    /// host threads), and the CPU layer and custom runners, whose tasks `serve profile` does not
    /// time per cell type.
    fn task_threads(&self, cell: CellType, rows: usize) -> usize {
        let _ = (cell, rows);
        1
    }
    /// Tasks whose layers were replayed from a CUDA graph (the CUDA runner of a fixed-shape
    /// model, `cuda/graph.rs`); 0 on every other runner.
    fn graph_replays(&self) -> u64 {
        0
    }
}

/// A backend that can prepare models.
pub trait Backend: Send + Sync {
    fn kind(&self) -> BackendKind;
    /// One line describing the backend (device, threads, features).
    fn describe(&self) -> String;
    /// Most steps of one cell task its recurrent runners execute (`CellTask::steps`): 1 unless
    /// the backend runs a padded batch's steps in one task.
    fn max_task_steps(&self) -> u32 {
        1
    }
    /// Prepare `net` with `workers` streams for batches of up to `max_batch` rows and, for a
    /// recurrent model, an arena of `state_slots` state slots.
    fn prepare(&self, net: Arc<Network>, shape: RunnerShape, notify: Notify) -> Result<Box<dyn Runner>>;
    /// The compute threads of a CPU backend (the most cores one task runs on); 0 for a device.
    fn cpu_threads(&self) -> usize {
        0
    }
}

/// How a model is prepared on a backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RunnerShape {
    pub workers: usize,
    /// Most rows (padding included) of one task.
    pub max_batch: usize,
    /// State slots of a recurrent model's arena.
    pub state_slots: usize,
    /// Most bytes of token-gate tables a recurrent model may hold (an LSTM layer 0 with its
    /// embedding folded into it, lstm_cell.rs; the CPU backend). 0: none.
    pub token_gates_bytes: usize,
}

impl RunnerShape {
    /// A shape of `workers` streams for tasks of up to `max_batch` rows, with no state arena and
    /// no token-gate tables (a fixed-shape model).
    pub fn fixed(workers: usize, max_batch: usize) -> RunnerShape {
        RunnerShape { workers, max_batch, state_slots: 0, token_gates_bytes: 0 }
    }
}

/// The number of `a × b` 4-byte values, or UNAVAILABLE naming `what` when it (or its size in
/// bytes) overflows: how both backends size their buffers.
pub(crate) fn size(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).filter(|n| n.checked_mul(4).is_some_and(|b| b <= isize::MAX as usize)).ok_or_else(|| {
        Error::new(Code::Unavailable, format!("{what} of {a} × {b} values overflows the address space"))
    })
}

/// Grow `v` to at least `len` values (default-filled), or fail with [`Code::Unavailable`] (never
/// abort).
pub(crate) fn grow<T: Clone + Default>(v: &mut Vec<T>, len: usize, what: &str) -> Result<()> {
    if v.len() < len {
        v.try_reserve_exact(len - v.len()).map_err(|_| {
            let bytes = len as u128 * std::mem::size_of::<T>() as u128;
            Error::new(
                Code::Unavailable,
                format!("cannot allocate {} MiB of {what}", bytes.div_ceil(1 << 20)),
            )
        })?;
        v.resize(len, T::default());
    }
    Ok(())
}

/// Create the backend for `choice`. `cpu_threads` = 0 means all cores.
///
/// `Cuda`: CUDA device 0, or `Unavailable` (no device, or the driver, cuBLAS or the kernels
/// cannot be used). `Auto`: CUDA device 0 when it is usable, otherwise the CPU, whose
/// [`describe`](Backend::describe) says why CUDA is not used.
pub fn create(choice: BackendChoice, cpu_threads: usize) -> Result<Arc<dyn Backend>> {
    match choice {
        BackendChoice::Cpu => Ok(Arc::new(cpu::CpuBackend::new(cpu_threads)?)),
        BackendChoice::Cuda => {
            let probe = cuda::probe();
            if probe.devices == 0 {
                return Err(Error::new(Code::Unavailable, format!("no CUDA device: {}", probe.summary())));
            }
            Ok(Arc::new(cuda::CudaBackend::new(0)?))
        }
        BackendChoice::Auto => {
            let probe = cuda::probe();
            let why = if probe.devices == 0 {
                format!("no CUDA device: {}", probe.summary())
            } else {
                match cuda::CudaBackend::new(0) {
                    Ok(b) => return Ok(Arc::new(b)),
                    Err(e) => format!("CUDA device unusable: {}", e.message()),
                }
            };
            Ok(Arc::new(CpuFallback { cpu: cpu::CpuBackend::new(cpu_threads)?, why }))
        }
    }
}

/// `auto` on the CPU: the CPU backend, remembering why CUDA is not used (for `serve info`).
struct CpuFallback {
    cpu: cpu::CpuBackend,
    why: String,
}

impl Backend for CpuFallback {
    fn kind(&self) -> BackendKind {
        self.cpu.kind()
    }

    fn describe(&self) -> String {
        format!("{} (CUDA not used: {})", self.cpu.describe(), self.why)
    }

    fn max_task_steps(&self) -> u32 {
        self.cpu.max_task_steps()
    }

    fn prepare(&self, net: Arc<Network>, shape: RunnerShape, notify: Notify) -> Result<Box<dyn Runner>> {
        self.cpu.prepare(net, shape, notify)
    }

    fn cpu_threads(&self) -> usize {
        self.cpu.cpu_threads()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `auto` without a CUDA device (`CpuFallback`, built here whatever the machine has) is the
    /// CPU backend in all the runtime asks of it: its compute threads size a tenant pool and the
    /// simulator's shared cores (it used to answer 0, so a tenant pool on the default backend got
    /// one core).
    #[test]
    fn auto_on_the_cpu_is_the_cpu_backend_with_its_threads() {
        let b = CpuFallback { cpu: cpu::CpuBackend::new(2).unwrap(), why: "no CUDA device (test)".into() };
        let cpu = create(BackendChoice::Cpu, 2).unwrap();
        assert_eq!((b.kind(), b.cpu_threads()), (BackendKind::Cpu, 2));
        assert_eq!(b.max_task_steps(), cpu.max_task_steps());
        assert_eq!(create(BackendChoice::Cpu, 3).unwrap().cpu_threads(), 3);
    }
}
