//! CUDA graphs per task shape: the cheap issue path for fixed-shape models (ARCHITECTURE.md §5).
//!
//! A task of a deep fixed-shape model is hundreds of launches (ResNet-152: about 500 kernels and
//! GEMMs), each a few microseconds of the engine thread's time: on a fast GPU the engine thread,
//! not the device, then bounds the task rate (measured: 98% busy at 440 ResNet-152 tasks a second
//! on an H200). A model that splits its work ([`DeviceModel::graph_key`]) queues a task in three
//! parts: its **input** into the worker's buffers, its **body** (every layer, reading and writing
//! only the worker's buffers and the shared weights) and its **output** into the task's staging.
//! The body depends only on the worker and its key (padded rows, layer range), so it is recorded
//! once into a CUDA graph and later replayed with one `cuGraphLaunch`.
//!
//! Per worker and key: the first task runs its body eagerly (which also warms cuBLAS: its
//! heuristics and workspace), the second is captured (`cuStreamBeginCapture` in relaxed mode,
//! the body's stream work recorded instead of run), instantiated and launched, and every later
//! task replays it. A capture that fails for any reason makes that key eager for good: a graph
//! is only ever a faster way to queue the same work. At most [`MAX_GRAPHS`] keys per worker get
//! graphs (a worker of a fixed-size elastic worker has one; a timeout-batching worker one per
//! batch size it sees).
//!
//! **Off by default** ([`enabled`]: `SERVE_CUDA_GRAPHS=1` turns it on): in a process where other
//! threads use the same device while a body is captured, their context-wide calls fail
//! (`cuCtxSynchronize`, run when any device buffer is freed, returns
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` while a stream is capturing), and cudarc records such
//! errors on the shared context, to return them from a later call on any thread. The GPU test
//! binary, many runtimes at once, failed that way; a single runtime (`serve bench elastic`) ran
//! with graphs and measured the gain. Safe capture needs every context-wide call of the process
//! excluded while a capture runs; until that is built and verified on a GPU, graphs stay opt-in.
//! With them off, a split model's parts are queued eagerly, one after the other.
//!
//! A stream being captured must not be queried (that would invalidate the capture): the poller's
//! health check ([`StreamSignal`](super::runner::StreamSignal)) takes the worker's capture lock,
//! held by a capture for its duration. Relaxed mode, not thread-local: the body binds the
//! context before each launch, and in the first GPU run of this code, under thread-local capture,
//! that binding failed with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`; cudarc's `end_capture` then
//! failed the same way before ending the capture, and the thread, still capturing, could make no
//! driver call after. So the capture is ended by a raw `cuStreamEndCapture` whatever happened.
//!
//! [`DeviceModel::graph_key`]: super::runner::DeviceModel::graph_key

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaContext;
use cudarc::driver::sys::{self, CUstreamCaptureMode};

use super::driver::{bind, driver_error};
use super::stream::Stream;
use crate::error::{Error, Result};

/// Most graphs one worker keeps.
pub(super) const MAX_GRAPHS: usize = 64;

/// What a task's body is a function of: padded rows and the layer range `[first, last)`.
pub(super) type GraphKey = (usize, usize, usize);

/// How a key's bodies are queued.
enum State {
    /// Its first body ran eagerly; the next one is captured.
    Warm,
    /// Replayed from this graph.
    Ready(Graph),
    /// Queued eagerly for good (its capture failed, or the worker holds [`MAX_GRAPHS`] graphs).
    Eager,
}

/// A captured graph and its instantiation, owned (destroyed in `Drop`).
struct Graph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
    ctx: Arc<CudaContext>,
}

// SAFETY: graph objects may be used from any thread, one at a time (CUDA's graph thread-safety
// rules). A `Graph` lives in its worker's `Graphs`, which is reached only under the worker's
// mutex, so no two threads touch it at once.
unsafe impl Send for Graph {}

impl Graph {
    /// Queue the graph's work on `stream`.
    fn launch(&self, stream: &Stream) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: a live executable graph (owned) of this context (bound), launched on a live
        // stream of the same context (the one it was captured on). The buffers its nodes use are
        // the worker's and the model's, which outlive the worker's graphs (the worker is dropped
        // before the model's weights; buffer drops wait for the device).
        unsafe { sys::cuGraphLaunch(self.exec, stream.raw()) }
            .result()
            .map_err(|e| driver_error("cuGraphLaunch", e))
    }
}

impl Drop for Graph {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: both handles (where not null) were created by `record`, are owned by this value
        // and destroyed only here; a launched graph's work keeps running after its exec is destroyed (CUDA
        // defers the release).
        unsafe {
            if !self.exec.is_null() {
                let _ = sys::cuGraphExecDestroy(self.exec);
            }
            if !self.graph.is_null() {
                let _ = sys::cuGraphDestroy(self.graph);
            }
        }
    }
}

/// How a body was queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Queued {
    Eager,
    Captured,
    Replayed,
}

/// Whether task bodies are captured into graphs: only with `SERVE_CUDA_GRAPHS=1` in the
/// environment (read once per process). Off by default: see the module documentation.
pub(super) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("SERVE_CUDA_GRAPHS").is_some_and(|v| v == "1"))
}

/// One worker's graphs.
pub(super) struct Graphs {
    states: HashMap<GraphKey, State>,
    graphs: usize,
    /// Off: every body is queued eagerly.
    enabled: bool,
}

impl Graphs {
    pub(super) fn new(enabled: bool) -> Graphs {
        Graphs { states: HashMap::new(), graphs: 0, enabled }
    }

    /// Queue `body` for `key` on `stream`: replayed from its graph, captured into one (then
    /// launched), or run eagerly. `capture` is the worker's capture lock (module documentation).
    /// An error is the body's own, or the launch of its graph.
    pub(super) fn queue(
        &mut self,
        key: GraphKey,
        stream: &Stream,
        capture: &Mutex<()>,
        mut body: impl FnMut() -> Result<()>,
    ) -> Result<Queued> {
        if !self.enabled {
            body()?;
            return Ok(Queued::Eager);
        }
        match self.states.get(&key) {
            Some(State::Ready(g)) => {
                g.launch(stream)?;
                return Ok(Queued::Replayed);
            }
            Some(State::Eager) => {
                body()?;
                return Ok(Queued::Eager);
            }
            None => {
                let state = if self.graphs < MAX_GRAPHS { State::Warm } else { State::Eager };
                self.states.insert(key, state);
                body()?;
                return Ok(Queued::Eager);
            }
            Some(State::Warm) => {}
        }
        match record(stream, capture, &mut body) {
            Ok(g) => {
                let launched = g.launch(stream);
                self.graphs += 1;
                self.states.insert(key, State::Ready(g));
                launched.map(|()| Queued::Captured)
            }
            Err(_) => {
                // Nothing of the body ran: run it now, and never try to capture this key again.
                self.states.insert(key, State::Eager);
                body()?;
                Ok(Queued::Eager)
            }
        }
    }
}

/// Record `body`'s work on `stream` into an instantiated graph (nothing runs).
///
/// Relaxed capture mode: the body's own driver calls that are not stream work (binding the
/// context before each launch) stay legal, and no other thread is affected. The capture is always
/// ended, whatever the body did, so the stream never stays in capture mode.
fn record(stream: &Stream, capture: &Mutex<()>, body: &mut impl FnMut() -> Result<()>) -> Result<Graph> {
    let _capturing = capture.lock().unwrap_or_else(|p| p.into_inner());
    let ctx = stream.cudarc().context().clone();
    bind(&ctx)?;
    let mode = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: a live stream of the bound context, not capturing (only `record` captures, under
    // the worker's lock, and always ends its capture).
    unsafe { sys::cuStreamBeginCapture_v2(stream.raw(), mode) }
        .result()
        .map_err(|e| driver_error("cuStreamBeginCapture", e))?;
    let recorded = body();
    let mut graph: sys::CUgraph = std::ptr::null_mut();
    // SAFETY: the stream is capturing (begun above, on this thread); `graph` is a valid out
    // pointer. Called whatever the body did.
    let ended = unsafe { sys::cuStreamEndCapture(stream.raw(), &mut graph) }.result();
    // Owned from here (a null handle is not destroyed).
    let mut g = Graph { graph, exec: std::ptr::null_mut(), ctx };
    recorded?;
    ended.map_err(|e| driver_error("cuStreamEndCapture", e))?;
    if g.graph.is_null() {
        return Err(Error::internal("a captured task body recorded no work"));
    }
    // SAFETY: `graph` is the live graph just captured; `g.exec` is a valid out pointer.
    unsafe { sys::cuGraphInstantiateWithFlags(&mut g.exec, g.graph, 0) }
        .result()
        .map_err(|e| driver_error("cuGraphInstantiate", e))?;
    Ok(g)
}
