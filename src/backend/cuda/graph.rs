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
//! heuristics and workspace), the second is captured (`cuStreamBeginCapture` in thread-local
//! mode, the body's calls recorded instead of run), instantiated and launched, and every later
//! task replays it. A capture that fails for any reason makes that key eager for good: a graph
//! is only ever a faster way to queue the same work. At most [`MAX_GRAPHS`] keys per worker get
//! graphs (a worker of a fixed-size elastic worker has one; a timeout-batching worker one per
//! batch size it sees).
//!
//! A stream being captured must not be queried (that would invalidate the capture): the poller's
//! health check ([`StreamSignal`](super::runner::StreamSignal)) takes the worker's capture lock,
//! held by a capture for its duration.
//!
//! [`DeviceModel::graph_key`]: super::runner::DeviceModel::graph_key

use std::collections::HashMap;
use std::sync::Mutex;

use cudarc::driver::CudaGraph;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

use super::driver::check;
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

/// An instantiated graph.
struct Graph(CudaGraph);

// SAFETY: a graph object may be used from any thread, one at a time (CUDA's graph thread-safety
// rules). A `Graph` lives in its worker's `Graphs`, which is reached only under the worker's
// mutex, so no two threads touch it at once.
unsafe impl Send for Graph {}

/// How a body was queued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Queued {
    Eager,
    Captured,
    Replayed,
}

/// One worker's graphs.
#[derive(Default)]
pub(super) struct Graphs {
    states: HashMap<GraphKey, State>,
    graphs: usize,
}

impl Graphs {
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
        match self.states.get(&key) {
            Some(State::Ready(g)) => {
                check("cuGraphLaunch", g.0.launch())?;
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
                let launched = check("cuGraphLaunch", g.0.launch());
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
fn record(stream: &Stream, capture: &Mutex<()>, body: &mut impl FnMut() -> Result<()>) -> Result<Graph> {
    let _capturing = capture.lock().unwrap_or_else(|p| p.into_inner());
    let s = stream.cudarc();
    check("cuStreamBeginCapture", s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL))?;
    let recorded = body();
    // Always end the capture, so the stream leaves capture mode whatever happened.
    let graph = check("cuStreamEndCapture", s.end_capture(CUgraphInstantiate_flags(0)));
    recorded?;
    graph?.map(Graph).ok_or_else(|| Error::internal("a captured task body recorded no work"))
}
