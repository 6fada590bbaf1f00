//! The CUDA [`Runner`]: the machinery shared by the recurrent and mlp runners (ARCHITECTURE.md §5).
//!
//! A prepared model ([`DeviceModel`]: weights uploaded once to device memory, shared by every
//! worker) runs on `workers` workers, each with its own [`Stream`], cuBLAS handle bound to that
//! stream, device activation buffers allocated once at prepare, and a completion counter (one
//! [`SignalCounters`] allocation for all workers). [`Runner::launch`] runs on the engine thread:
//! it checks the task, writes its host-side inputs into a pinned **staging** buffer, queues the
//! upload, the kernels and GEMMs, then the signal kernel, and returns at once with the counter
//! value that marks the task done. Outputs are written by the kernels straight into the staging's
//! pinned, mapped output buffers (zero-copy); after the poller has seen the counter, the engine
//! calls [`Runner::collect`], which copies them into [`TaskIo`]. Nothing calls back from the GPU.
//! A task of elastic batching whose batch is a run of its model's device ring (`ring.rs`) stages
//! no input: its stream waits for the run's copies, made at the requests' arrivals, and the
//! model reads the rows in the ring ([`Plan::ring_input`]).
//!
//! # Staging ownership
//!
//! A [`Staging`] (pinned, mapped host memory: row descriptors and dense inputs the stream copies
//! to the device, outputs the kernels write) is owned by exactly one of:
//! * the worker's free list — nobody uses it;
//! * one launched task (an [`InFlight`] record) — from `launch` until **both** the worker's
//!   counter has reached the task's target (the device has finished every copy and kernel that
//!   touches it: the signal kernel runs after them in stream order) **and** `collect` has copied
//!   its outputs out. Only then does it return to the free list. Between the launch and the
//!   counter, the host never writes it (so uploads queued from it read what launch wrote) and never
//!   reads its outputs (so it never races the kernels writing them);
//! * the worker's retired list — a launch queued device work that may read or write it but could
//!   not queue the signal that would tell when that work is done: it is never reused, and freed
//!   with the runner (whose drop waits for the device).
//!
//! Staging is taken per task from the free list (allocated when none fits), so a task's inputs and
//! outputs are never overwritten by a later task of the same worker, however far the host runs
//! ahead of the device.
//!
//! # Device buffers
//!
//! Every address a kernel or copy receives belongs to memory owned by the runner (weights, the
//! state arena, the worker's activation buffers, its counter) or by the task's staging, sized at
//! prepare (or grown, see `recurrent.rs`) for the largest task, and checked against the task by
//! [`DeviceModel::plan`] before anything is queued. Device memory and pinned memory are freed only
//! in their `Drop`, which first waits for the whole context (`cuCtxSynchronize`), so queued work
//! never touches freed memory. A worker's activation buffers are reused by its next task without
//! waiting: both run on the worker's stream, in order. The state arena is shared by all workers:
//! tasks in flight at once never share a slot (the scheduler's contract), and a task reading a
//! slot an earlier task wrote (on any worker) is only launched after the poller has seen that
//! task's counter with an acquire load — the earlier kernels have completed, and kernels launched
//! after that see their writes.
//!
//! # Completion and errors
//!
//! Completion is the worker's counter ([`StreamSignal`], which never notifies: the poller spins
//! while CUDA tasks are in flight). A CUDA error while queuing a task becomes the task's error
//! (the engine completes its requests `BACKEND`) as long as the signal could still be queued; if
//! not, `launch` returns the error. A device fault that stops a stream (its counter would never
//! reach the target) is reported by [`StreamSignal::failure`]; the poller then reports the
//! stream's tasks done and `collect` gives each the stream's error.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::result::DriverError;
use cudarc::driver::sys::{self as cusys, CUresult};

use super::abi;
use super::driver::{bind, driver_error};
use super::graph::{self, GraphKey, Graphs, Queued};
use super::kernels::{self, BLOCK};
use super::memory::Pod;
use super::ring::DeviceRing;
use super::{
    Blas, CudaDevice, CudaSignal, DeviceBuffer, Event, Function, LaunchConfig, Module, PinnedMapped,
    SignalCounters, Stream,
};
use crate::backend::ring::InputRing;
use crate::backend::{CompletionSignal, Runner, RunnerShape, TaskData, TaskIo, Work};
use crate::error::{Code, Error, Result};

/// Staging buffers allocated per worker at prepare (more are allocated when tasks in flight need
/// them).
const PREALLOCATED_STAGING: usize = 2;

/// The crate's kernels, looked up once per runner, with one launch method per kernel.
///
/// # Safety (every launch method)
/// Every nonzero address in the parameters must be memory of the stream's context holding at
/// least what the kernel's contract in `cuda/serve_kernels.h` reads and writes for the sizes in
/// the parameters, and it must stay allocated until the kernel has run; the host must not access
/// memory the kernel writes (nor write memory it reads) until the task's completion counter has
/// been seen. In this module: the buffer invariant and staging ownership of the module
/// documentation.
pub(super) struct Kernels {
    signal: Function,
    embedding: Function,
    lstm_gather: Function,
    lstm_pointwise: Function,
    argmax: Function,
    tree_gather: Function,
    tree_pointwise: Function,
    bias_act: Function,
    im2col: Function,
    chw_to_hwc: Function,
    max_pool: Function,
    avg_pool: Function,
    add_relu: Function,
    layer_norm: Function,
    attention: Function,
    bert_embed: Function,
}

/// A 1-D launch of blocks of [`BLOCK`] threads covering `units` units of `per_block` per block.
fn linear(units: u64, per_block: u32) -> LaunchConfig {
    LaunchConfig::linear(kernels::grid(units, per_block), BLOCK)
}

impl Kernels {
    pub(super) fn load(module: &Module) -> Result<Kernels> {
        Ok(Kernels {
            signal: module.function(kernels::SIGNAL)?,
            embedding: module.function(kernels::EMBEDDING_GATHER)?,
            lstm_gather: module.function(kernels::LSTM_GATHER)?,
            lstm_pointwise: module.function(kernels::LSTM_POINTWISE)?,
            argmax: module.function(kernels::ARGMAX)?,
            tree_gather: module.function(kernels::TREE_GATHER)?,
            tree_pointwise: module.function(kernels::TREE_POINTWISE)?,
            bias_act: module.function(kernels::BIAS_ACT)?,
            im2col: module.function(kernels::IM2COL)?,
            chw_to_hwc: module.function(kernels::CHW_TO_HWC)?,
            max_pool: module.function(kernels::MAX_POOL)?,
            avg_pool: module.function(kernels::AVG_POOL)?,
            add_relu: module.function(kernels::ADD_RELU)?,
            layer_norm: module.function(kernels::LAYER_NORM)?,
            attention: module.function(kernels::ATTENTION)?,
            bert_embed: module.function(kernels::BERT_EMBED)?,
        })
    }

    /// `serve_signal`: grid 1, block 1.
    ///
    /// # Safety
    /// See [`Kernels`].
    unsafe fn signal(&self, s: &Stream, p: &abi::SignalParams) -> Result<()> {
        // SAFETY: the contract of [`Kernels`]; `SignalParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.signal, LaunchConfig::linear(1, 1), p) }
    }

    /// `serve_embedding_gather`: a warp per row.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn embedding(&self, s: &Stream, p: &abi::EmbeddingParams) -> Result<()> {
        let cfg = linear(u64::from(p.batch), BLOCK / 32);
        // SAFETY: the contract of [`Kernels`]; `EmbeddingParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.embedding, cfg, p) }
    }

    /// `serve_lstm_gather`: a thread per element of `[x | h]`.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn lstm_gather(&self, s: &Stream, p: &abi::LstmGatherParams) -> Result<()> {
        let cfg = linear(u64::from(p.padded) * (u64::from(p.input) + u64::from(p.hidden)), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `LstmGatherParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.lstm_gather, cfg, p) }
    }

    /// `serve_lstm_pointwise`: a thread per (row, unit).
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn lstm_pointwise(&self, s: &Stream, p: &abi::LstmPointwiseParams) -> Result<()> {
        let cfg = linear(u64::from(p.padded) * u64::from(p.hidden), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `LstmPointwiseParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.lstm_pointwise, cfg, p) }
    }

    /// `serve_argmax`: a block per row.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn argmax(&self, s: &Stream, p: &abi::ArgmaxParams) -> Result<()> {
        let cfg = LaunchConfig::linear(kernels::grid(u64::from(p.rows), 1), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `ArgmaxParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.argmax, cfg, p) }
    }

    /// `serve_tree_gather`: a thread per (row, unit).
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn tree_gather(&self, s: &Stream, p: &abi::TreeGatherParams) -> Result<()> {
        let cfg = linear(u64::from(p.padded) * u64::from(p.hidden), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `TreeGatherParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.tree_gather, cfg, p) }
    }

    /// `serve_tree_pointwise`: a thread per (row, unit).
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn tree_pointwise(&self, s: &Stream, p: &abi::TreePointwiseParams) -> Result<()> {
        let cfg = linear(u64::from(p.padded) * u64::from(p.hidden), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `TreePointwiseParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.tree_pointwise, cfg, p) }
    }

    /// `serve_bias_act`: a thread per element.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn bias_act(&self, s: &Stream, p: &abi::BiasActParams) -> Result<()> {
        let cfg = linear(u64::from(p.rows) * u64::from(p.cols), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `BiasActParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.bias_act, cfg, p) }
    }

    /// `serve_im2col`: a thread per element of the patches.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn im2col(&self, s: &Stream, p: &abi::Im2colParams) -> Result<()> {
        let units =
            u64::from(p.n) * u64::from(p.oh) * u64::from(p.ow) * u64::from(p.k * p.k) * u64::from(p.c);
        // SAFETY: the contract of [`Kernels`]; `Im2colParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.im2col, linear(units, BLOCK), p) }
    }

    /// `serve_chw_to_hwc`: a thread per element.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn chw_to_hwc(&self, s: &Stream, p: &abi::ChwToHwcParams) -> Result<()> {
        let units = u64::from(p.n) * u64::from(p.c) * u64::from(p.h) * u64::from(p.w);
        // SAFETY: the contract of [`Kernels`]; `ChwToHwcParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.chw_to_hwc, linear(units, BLOCK), p) }
    }

    /// `serve_max_pool`: a thread per output element.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn max_pool(&self, s: &Stream, p: &abi::MaxPoolParams) -> Result<()> {
        let units = u64::from(p.n) * u64::from(p.oh) * u64::from(p.ow) * u64::from(p.c);
        // SAFETY: the contract of [`Kernels`]; `MaxPoolParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.max_pool, linear(units, BLOCK), p) }
    }

    /// `serve_avg_pool`: a thread per (image, channel).
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn avg_pool(&self, s: &Stream, p: &abi::AvgPoolParams) -> Result<()> {
        // SAFETY: the contract of [`Kernels`]; `AvgPoolParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.avg_pool, linear(u64::from(p.n) * u64::from(p.c), BLOCK), p) }
    }

    /// `serve_add_relu`: a thread per element.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn add_relu(&self, s: &Stream, p: &abi::AddReluParams) -> Result<()> {
        // SAFETY: the contract of [`Kernels`]; `AddReluParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.add_relu, linear(p.n, BLOCK), p) }
    }

    /// `serve_layer_norm`: a block per row.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn layer_norm(&self, s: &Stream, p: &abi::LayerNormParams) -> Result<()> {
        let cfg = LaunchConfig::linear(kernels::grid(u64::from(p.rows), 1), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `LayerNormParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.layer_norm, cfg, p) }
    }

    /// `serve_attention`: a block per (token, head).
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn attention(&self, s: &Stream, p: &abi::AttentionParams) -> Result<()> {
        let cfg = LaunchConfig::linear(kernels::grid(u64::from(p.tokens) * u64::from(p.heads), 1), BLOCK);
        // SAFETY: the contract of [`Kernels`]; `AttentionParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.attention, cfg, p) }
    }

    /// `serve_bert_embed`: a thread per element.
    ///
    /// # Safety
    /// See [`Kernels`].
    pub(super) unsafe fn bert_embed(&self, s: &Stream, p: &abi::BertEmbedParams) -> Result<()> {
        let units = u64::from(p.tokens) * u64::from(p.hidden);
        // SAFETY: the contract of [`Kernels`]; `BertEmbedParams` is the kernel's parameter.
        unsafe { s.launch_with(&self.bert_embed, linear(units, BLOCK), p) }
    }
}

/// `v` as a kernel parameter: below 2³¹ (so that the kernels' 32-bit index arithmetic on it and
/// on a slot id with the fresh bit cannot overflow), or UNSUPPORTED naming `what`.
pub(super) fn dim(v: usize, what: &str) -> Result<u32> {
    u32::try_from(v).ok().filter(|&d| d <= abi::SERVE_SLOT_MASK).ok_or_else(|| {
        Error::new(
            Code::Unsupported,
            format!("{what} of {v} is too large for the CUDA kernels (at most 2^31 - 1)"),
        )
    })
}

/// `serve_bias_act`'s parameters over `rows × cols` contiguous values from `src` to `dst`
/// (addresses; `dst` may be `src`): `dst = act(src + bias)`, `bias` the address of `cols` values
/// or 0 for none, `act` one of `abi::SERVE_ACT_*` (none, with no bias: a copy).
pub(super) fn bias_act_params(
    (src, dst): (u64, u64),
    bias: u64,
    (rows, cols): (usize, usize),
    act: u32,
) -> Result<abi::BiasActParams> {
    let ld = dim(cols, "columns")?;
    Ok(abi::BiasActParams {
        src,
        bias,
        dst,
        rows: dim(rows, "rows")?,
        cols: ld,
        src_ld: ld,
        dst_ld: ld,
        act,
        _pad0: 0,
    })
}

/// Sizes (elements) of the pinned buffers a task's staging needs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Needs {
    /// Row descriptors (`u32`) uploaded to the device.
    pub desc: usize,
    /// Dense input values uploaded to the device.
    pub dense: usize,
    /// Output values written by the kernels.
    pub out: usize,
    /// Output words (decoder tokens, embedding error flags) written by the kernels.
    pub words: usize,
}

impl Needs {
    fn max(self, o: Needs) -> Needs {
        Needs {
            desc: self.desc.max(o.desc),
            dense: self.dense.max(o.dense),
            out: self.out.max(o.out),
            words: self.words.max(o.words),
        }
    }
}

/// A task's pinned, mapped host buffers (see the module documentation for who may touch them
/// when).
pub(super) struct Staging {
    pub desc: PinnedMapped<u32>,
    pub dense: PinnedMapped<f32>,
    pub out: PinnedMapped<f32>,
    pub words: PinnedMapped<u32>,
    /// Timing events recorded before and after the task's work on its stream: the task's
    /// device time (`TaskIo::stages.compute`), read at `collect` once the counter has passed it.
    begin: Event,
    end: Event,
}

impl Staging {
    fn new(device: &CudaDevice, n: Needs) -> Result<Staging> {
        Ok(Staging {
            desc: device.pinned_mapped(n.desc)?,
            dense: device.pinned_mapped(n.dense)?,
            out: device.pinned_mapped(n.out)?,
            words: device.pinned_mapped(n.words)?,
            begin: device.timing_event()?,
            end: device.timing_event()?,
        })
    }

    fn fits(&self, n: &Needs) -> bool {
        self.desc.len() >= n.desc
            && self.dense.len() >= n.dense
            && self.out.len() >= n.out
            && self.words.len() >= n.words
    }
}

/// The first `n` elements of `p` as a host slice, for an upload queued from pinned memory.
///
/// # Safety
/// Nothing may write the elements while the slice lives: host writes need `&mut` of `p`, so it is
/// enough that the device never writes them (staging that only copies read).
pub(super) unsafe fn host_slice<T: Pod>(p: &PinnedMapped<T>, n: usize) -> &[T] {
    assert!(n <= p.len(), "{n} elements of a pinned buffer of {}", p.len());
    if n == 0 {
        return &[];
    }
    // SAFETY: `n <= len` elements from the start of a live allocation owned by `p` (borrowed for
    // the slice's lifetime), initialised (zeroed at allocation; any bits are a valid `T`), and not
    // written while the slice lives (the caller's contract).
    unsafe { std::slice::from_raw_parts(p.host_ptr(), n) }
}

/// What a launched task computes and how `collect` reads its results.
#[derive(Clone, Debug, Default)]
pub(super) struct Plan {
    pub needs: Needs,
    /// Rows computed (padding included) and real rows.
    pub padded: usize,
    pub real: usize,
    /// Values copied from `Staging::out` into `TaskIo::output`.
    pub outputs: usize,
    /// Decoder tokens copied from `Staging::words[0..]` into `TaskIo::tokens`.
    pub tokens: usize,
    /// Embedding error flags at `Staging::words[errors_at..errors_at + errors]`.
    pub errors_at: usize,
    pub errors: usize,
    /// Recurrent models: rows whose `h` is an output, children of the task's tree rows, and
    /// whether the task is a seq2seq decoder step.
    pub out_rows: usize,
    pub children: usize,
    pub decoder: bool,
    /// Layer models: the layers `[first, last)` the task runs, and (bert) each row's length.
    pub layers: (usize, usize),
    pub lens: Vec<u32>,
    /// The device address of the task's input rows when its batch is a run of the model's
    /// device ring (ring.rs): then nothing is staged or uploaded for the input (`needs.dense`
    /// is 0) and the model reads the rows there. Set by the runner, not by `DeviceModel::plan`.
    pub ring_input: Option<u64>,
}

/// What a model's enqueue needs of its worker.
pub(super) struct Ctx<'a> {
    pub device: &'a CudaDevice,
    pub kernels: &'a Kernels,
    pub stream: &'a Stream,
    pub blas: &'a mut Blas,
}

/// A model prepared on the device: weights uploaded once, shared by every worker.
pub(super) trait DeviceModel: Send + Sync + 'static {
    /// A worker's device activation buffers.
    type Buffers: Send + 'static;

    /// Values per input row and per output row (as [`Runner::io_lens`]).
    fn io_lens(&self) -> (usize, usize);
    fn state_slots(&self) -> usize;
    /// Staging of a typical task (allocated per worker at prepare).
    fn typical_needs(&self) -> Needs;
    /// Whether the model reads a ring run's input rows on the device when the plan gives their
    /// address (`Plan::ring_input`): its elastic-batching ring is then a device ring.
    fn reads_ring_on_device(&self) -> bool {
        false
    }
    /// A worker's activation buffers, for tasks of up to `max_batch` rows.
    fn buffers(&self, device: &CudaDevice, stream: &Stream) -> Result<Self::Buffers>;
    /// Check `work` for a task of `padded` rows (host only: nothing is queued) and plan it.
    fn plan(&self, padded: usize, work: &Work) -> Result<Plan>;
    /// Write the task's host-side inputs into `staging` (host only), which fits `plan.needs`;
    /// `scratch` is the worker's reusable host buffer.
    fn stage(&self, work: &Work, plan: &Plan, staging: &mut Staging, scratch: &mut Vec<u32>) -> Result<()>;
    /// Queue the task's uploads, kernels and GEMMs on `ctx.stream`, outputs into `staging`. The
    /// default queues the three parts of a model that splits its work (`graph_key`).
    fn enqueue(&self, ctx: Ctx<'_>, bufs: &mut Self::Buffers, plan: &Plan, staging: &Staging) -> Result<()> {
        let Ctx { device, kernels, stream, blas } = ctx;
        self.enqueue_input(Ctx { device, kernels, stream, blas }, bufs, plan, staging)?;
        self.enqueue_body(Ctx { device, kernels, stream, blas }, bufs, plan)?;
        self.enqueue_output(Ctx { device, kernels, stream, blas }, bufs, plan, staging)
    }
    /// For a model that splits a task's work for CUDA graphs (graph.rs): the key its body is a
    /// function of. The runner then queues `enqueue_input`, the body (`enqueue_body`, replayed
    /// from a graph once captured) and `enqueue_output` itself. `None` (the default): the model
    /// implements `enqueue` whole, and not the three parts.
    fn graph_key(&self, plan: &Plan) -> Option<GraphKey> {
        let _ = plan;
        None
    }
    /// The task's input into the worker's buffers (from the staging, or the device ring).
    fn enqueue_input(&self, _: Ctx<'_>, _: &mut Self::Buffers, _: &Plan, _: &Staging) -> Result<()> {
        Err(not_split())
    }
    /// The task's layers: reads and writes only the worker's buffers and the model's weights,
    /// every address and size a function of the worker and `graph_key` alone.
    fn enqueue_body(&self, _: Ctx<'_>, _: &mut Self::Buffers, _: &Plan) -> Result<()> {
        Err(not_split())
    }
    /// The task's result from the worker's buffers into the staging.
    fn enqueue_output(&self, _: Ctx<'_>, _: &mut Self::Buffers, _: &Plan, _: &Staging) -> Result<()> {
        Err(not_split())
    }
}

/// What the parts of [`DeviceModel::enqueue`] give for a model that implements it whole.
fn not_split() -> Error {
    Error::internal("this model does not split its work into input, body and output")
}

/// Queue a fixed-shape task's `values` input values into `dst`, the worker's input buffer: copied
/// on the device from the task's run of the device ring (`Plan::ring_input`), or uploaded from
/// the staging's dense input.
pub(super) fn enqueue_dense_input(
    stream: &Stream,
    plan: &Plan,
    st: &Staging,
    dst: &mut DeviceBuffer<f32>,
    values: usize,
) -> Result<()> {
    match plan.ring_input {
        // SAFETY: the task's run of the device ring holds its `values` values in the ring's
        // device memory (this context: `DeviceRing::device_ptr` checked), not rewritten before
        // the task's counter is seen (ring.rs); the copy checks that `dst` holds them.
        Some(p) => unsafe { stream.copy_from_address(p, dst, values) },
        // SAFETY: the staging's input values are written only by `stage` (before this) and read
        // only by this copy; the staging belongs to the task until its counter is seen, so it
        // stays allocated and unmodified until the copy has run. `host_slice` checks `values`
        // against the staging, the copy against `dst`.
        None => unsafe { stream.upload_into_async(dst, 0, host_slice(&st.dense, values)) },
    }
}

/// Why `stream` can no longer complete work (a device fault; the context is then unusable), or
/// `None` while it works (busy or idle).
pub(super) fn stream_failure(stream: &Stream) -> Option<Error> {
    if let Err(e) = bind(stream.cudarc().context()) {
        return Some(e);
    }
    // SAFETY: a live stream (kept by `stream`) of the context bound above; the call only queries
    // its state. `cuStreamQuery` is in the checked symbol list (libs.rs).
    match unsafe { cusys::cuStreamQuery(stream.raw()) } {
        CUresult::CUDA_SUCCESS | CUresult::CUDA_ERROR_NOT_READY => None,
        other => Some(driver_error("cuStreamQuery", DriverError(other))),
    }
}

/// A worker's completion counter as the poller sees it: never notifies (the device cannot wake a
/// parked thread), and reports a stream that stopped for good.
pub(super) struct StreamSignal {
    signal: Arc<CudaSignal>,
    stream: Stream,
    /// The worker's capture lock: the stream is not queried while a graph is captured on it.
    capture: Arc<Mutex<()>>,
}

impl CompletionSignal for StreamSignal {
    fn completed(&self) -> u64 {
        self.signal.completed()
    }

    fn notifies(&self) -> bool {
        false
    }

    fn failure(&self) -> Option<Error> {
        let _not_capturing = self.capture.lock().unwrap_or_else(|p| p.into_inner());
        stream_failure(&self.stream)
    }
}

/// A launched task (see Staging ownership in the module documentation).
struct InFlight {
    task: Arc<TaskData>,
    target: u64,
    staging: Staging,
    plan: Plan,
    collected: bool,
    /// Both timing events were recorded around the task's work.
    timed: bool,
}

/// One worker: its stream and everything only its tasks use.
struct Worker<B> {
    stream: Stream,
    blas: Blas,
    signal: Arc<CudaSignal>,
    /// Signals queued so far: the counter's value once they have all run.
    launched: u64,
    free: Vec<Staging>,
    in_flight: VecDeque<InFlight>,
    retired: Vec<Staging>,
    /// Host scratch for building a task's row descriptors.
    scratch: Vec<u32>,
    bufs: B,
    /// Task bodies replayed from CUDA graphs, and the lock a capture holds (graph.rs).
    graphs: Graphs,
    capture: Arc<Mutex<()>>,
}

impl<B> Worker<B> {
    /// Return to the free list the staging of tasks both collected and counted.
    fn reclaim(&mut self) {
        let done = self.signal.completed();
        let mut i = 0;
        while i < self.in_flight.len() {
            let f = &self.in_flight[i];
            if f.collected && done >= f.target {
                if let Some(f) = self.in_flight.remove(i) {
                    self.free.push(f.staging);
                }
            } else {
                i += 1;
            }
        }
    }

    /// Free staging that fits `needs` (the smallest such), or a new one.
    fn take_staging(&mut self, device: &CudaDevice, needs: Needs, typical: Needs) -> Result<Staging> {
        let best = self
            .free
            .iter()
            .enumerate()
            .filter(|(_, s)| s.fits(&needs))
            .min_by_key(|(_, s)| (s.desc.len(), s.dense.len(), s.out.len(), s.words.len()))
            .map(|(i, _)| i);
        match best {
            Some(i) => Ok(self.free.swap_remove(i)),
            // Room for the typical task too, so that the new buffers are useful afterwards.
            None => Staging::new(device, needs.max(typical)),
        }
    }
}

/// The CUDA runner of one model.
pub(super) struct CudaRunner<M: DeviceModel> {
    model: Arc<M>,
    kernels: Kernels,
    device: CudaDevice,
    workers: Vec<Mutex<Worker<M::Buffers>>>,
    signals: Vec<Arc<StreamSignal>>,
    max_batch: usize,
    /// The model's typical task needs (the staging buffers' starting size), asked once.
    typical: Needs,
    /// Task bodies replayed from a CUDA graph so far (graph.rs).
    graph_replays: AtomicU64,
}

impl<M: DeviceModel> CudaRunner<M> {
    pub(super) fn new(
        device: &CudaDevice,
        module: &Module,
        model: M,
        shape: RunnerShape,
    ) -> Result<CudaRunner<M>> {
        let kernels = Kernels::load(module)?;
        let counters: Arc<SignalCounters> = device.signal_counters(shape.workers)?;
        let typical = model.typical_needs();
        let mut workers = Vec::with_capacity(shape.workers);
        let mut signals = Vec::with_capacity(shape.workers);
        for w in 0..shape.workers {
            let stream = device.stream()?;
            let mut blas = device.blas(&stream)?;
            blas.set_tf32(false)?;
            let bufs = model.buffers(device, &stream)?;
            let free =
                (0..PREALLOCATED_STAGING).map(|_| Staging::new(device, typical)).collect::<Result<_>>()?;
            let signal = counters.signal(w);
            let capture = Arc::new(Mutex::new(()));
            signals.push(Arc::new(StreamSignal {
                signal: signal.clone(),
                stream: stream.clone(),
                capture: capture.clone(),
            }));
            workers.push(Mutex::new(Worker {
                stream,
                blas,
                signal,
                launched: 0,
                free,
                in_flight: VecDeque::new(),
                retired: Vec::new(),
                scratch: Vec::new(),
                bufs,
                graphs: Graphs::new(graph::enabled()),
                capture,
            }));
        }
        // Buffers zeroed on the workers' streams are ready before the first task.
        device.synchronize()?;
        Ok(CudaRunner {
            model: Arc::new(model),
            kernels,
            device: device.clone(),
            workers,
            signals,
            max_batch: shape.max_batch,
            typical,
            graph_replays: AtomicU64::new(0),
        })
    }

    /// Queue a task of a model that splits its work: input, body (from a graph when it can),
    /// output.
    fn enqueue_split(
        &self,
        w: &mut Worker<M::Buffers>,
        key: GraphKey,
        plan: &Plan,
        st: &Staging,
    ) -> Result<()> {
        let Worker { stream, blas, bufs, graphs, capture, .. } = w;
        let (device, kernels) = (&self.device, &self.kernels);
        self.model.enqueue_input(Ctx { device, kernels, stream, blas }, bufs, plan, st)?;
        let queued = graphs.queue(key, stream, capture, || {
            self.model.enqueue_body(Ctx { device, kernels, stream, blas }, bufs, plan)
        })?;
        if queued == Queued::Replayed {
            self.graph_replays.fetch_add(1, Ordering::Relaxed);
        }
        self.model.enqueue_output(Ctx { device, kernels, stream, blas }, bufs, plan, st)
    }

    fn worker(&self, worker: usize) -> Result<MutexGuard<'_, Worker<M::Buffers>>> {
        let w = self.workers.get(worker).ok_or_else(|| {
            Error::internal(format!("worker {worker} of a runner with {} workers", self.workers.len()))
        })?;
        Ok(w.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

/// Copy a completed task's results out of its staging.
fn read_outputs(st: &Staging, plan: &Plan, io: &mut TaskIo) -> Result<()> {
    if plan.errors > 0 {
        let mut flags = vec![0u32; plan.errors];
        st.words.read(plan.errors_at, &mut flags)?;
        if let Some(row) = flags.iter().position(|&f| f != abi::SERVE_ROW_OK) {
            return Err(Error::new(
                Code::Backend,
                format!("row {row} of the task has a token id outside the embedding table"),
            ));
        }
    }
    io.output.clear();
    io.output.resize(plan.outputs, 0.0);
    st.out.read(0, &mut io.output)?;
    if plan.decoder {
        io.tokens.clear();
        io.tokens.resize(plan.tokens, 0);
        st.words.read(0, &mut io.tokens)?;
    }
    Ok(())
}

impl<M: DeviceModel> Runner for CudaRunner<M> {
    fn workers(&self) -> usize {
        self.workers.len()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        self.signals[worker].clone()
    }

    fn io_lens(&self) -> (usize, usize) {
        self.model.io_lens()
    }

    fn state_slots(&self) -> usize {
        self.model.state_slots()
    }

    fn graph_replays(&self) -> u64 {
        self.graph_replays.load(Ordering::Relaxed)
    }

    fn input_ring(&self, slots: usize, row_len: usize) -> Result<InputRing> {
        if self.model.reads_ring_on_device() {
            DeviceRing::input_ring(&self.device, slots, row_len)
        } else {
            InputRing::new(slots, row_len)
        }
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        if task.rows == 0 || task.rows > self.max_batch {
            return Err(Error::internal(format!(
                "task of {} rows on a runner prepared for at most {}",
                task.rows, self.max_batch
            )));
        }
        let mut guard = self.worker(worker)?;
        let w = &mut *guard;
        // Host side: check, take staging, write the inputs. Nothing is queued yet, so an error here
        // leaves the stream and the staging as they were.
        let (plan, staging) = {
            let io = task.io.lock().unwrap_or_else(|p| p.into_inner());
            let mut plan = self.model.plan(task.rows, &io.work)?;
            // A run of the device ring: its rows are read where they are (nothing staged), once
            // their copies have landed.
            let ring = match &io.work {
                Work::Ring(rows) => DeviceRing::of(rows.ring()).map(|ring| (ring, rows)),
                _ => None,
            };
            if let Some((ring, rows)) = ring {
                plan.ring_input = Some(ring.device_ptr(rows, &w.stream)?);
                plan.needs.dense = 0;
            }
            w.reclaim();
            let mut staging = w.take_staging(&self.device, plan.needs, self.typical)?;
            if let Err(e) = self.model.stage(&io.work, &plan, &mut staging, &mut w.scratch) {
                w.free.push(staging);
                return Err(e);
            }
            // The first thing queued for the task: the stream waits for the run's copies.
            if let Some((ring, rows)) = ring
                && let Err(e) = ring.wait(rows, &w.stream)
            {
                w.free.push(staging);
                return Err(e);
            }
            (plan, staging)
        };
        // Device side: the task's work between its timing events, then its signal. A task whose
        // events could not be recorded runs untimed.
        let begun = staging.begin.record(&w.stream).is_ok();
        let queued = match self.model.graph_key(&plan) {
            Some(key) => self.enqueue_split(w, key, &plan, &staging),
            None => {
                let ctx = Ctx {
                    device: &self.device,
                    kernels: &self.kernels,
                    stream: &w.stream,
                    blas: &mut w.blas,
                };
                self.model.enqueue(ctx, &mut w.bufs, &plan, &staging)
            }
        };
        let timed = begun && queued.is_ok() && staging.end.record(&w.stream).is_ok();
        let params = abi::SignalParams { counter: w.signal.device_ptr() };
        // SAFETY: the counter is a live pinned, mapped allocation owned by the runner's
        // `SignalCounters` (kept by `w.signal`), freed only after the context is synchronised; the
        // host only does atomic loads of it; this stream is its only writer.
        let signalled = unsafe { self.kernels.signal(&w.stream, &params) };
        match signalled {
            Ok(()) => {
                w.launched += 1;
                if let Err(e) = queued {
                    // Counted all the same: the engine completes the task with this error.
                    task.io.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e);
                }
                let target = w.launched;
                w.in_flight.push_back(InFlight { task, target, staging, plan, collected: false, timed });
                Ok(target)
            }
            Err(e) => {
                // Work may be queued that uses the staging, and nothing will tell when it is done.
                w.retired.push(staging);
                Err(queued.err().unwrap_or(e))
            }
        }
    }

    fn collect(&self, worker: usize, task: &TaskData) {
        let Ok(mut w) = self.worker(worker) else { return };
        let Some(i) = w.in_flight.iter().position(|f| std::ptr::eq(&*f.task, task) && !f.collected) else {
            return; // not launched (the launch failed): nothing to read
        };
        w.in_flight[i].collected = true;
        // Acquire: the kernels' writes to the staging are visible once counted.
        let done = w.signal.completed();
        let f = &w.in_flight[i];
        let mut io = task.io.lock().unwrap_or_else(|p| p.into_inner());
        if io.error.is_none() {
            if done >= f.target {
                if let Err(e) = read_outputs(&f.staging, &f.plan, &mut io) {
                    io.error = Some(e);
                }
                // Both events ran before the signal, so this does not wait. A driver without
                // cuEventElapsedTime_v2 leaves the task untimed.
                if f.timed {
                    io.stages.compute = f
                        .staging
                        .begin
                        .elapsed_ms(&f.staging.end)
                        .ok()
                        .map(|ms| std::time::Duration::from_secs_f64(f64::from(ms.max(0.0)) * 1e-3));
                }
            } else {
                // Reported done without its count: the stream failed (or the poller stopped).
                let why = stream_failure(&w.stream).map(|e| e.message().to_string());
                io.error = Some(Error::new(
                    Code::Backend,
                    format!(
                        "the CUDA stream of worker {worker} stopped before the task completed{}",
                        why.map(|m| format!(": {m}")).unwrap_or_default()
                    ),
                ));
            }
        }
        drop(io);
        w.reclaim();
    }
}
