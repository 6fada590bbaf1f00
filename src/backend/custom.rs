//! The runner of a custom model (`model::custom`, ARCHITECTURE.md §5.4), on every backend: one
//! ordered stream thread per worker (as the CPU backend's), each task one call of the model's
//! [`CustomExecute`] on that thread with the task's rows, its core bound and its layer range.
//! A task with a core lease (the tenant mode) runs with the stream thread pinned to the lease's
//! first CPU, and the call names the leased CPUs, so an engine with threads of its own can place
//! them there.
//! A call that returns an error fails the task's requests with `BACKEND` and `the custom model
//! failed: <its message>`; a panic (a Rust implementation) fails them with `BACKEND` and the
//! panic's message. The next task runs as usual.

use std::sync::{Arc, Mutex};

use crate::backend::cpu::affinity::PinnedTo;
use crate::backend::cpu::stream::{CpuStream, launch_task, task_threads};
use crate::backend::{CompletionSignal, Notify, Runner, TaskData, Work};
use crate::error::{Code, Error, Result};
use crate::model::{CustomCall, CustomModel, Network};

pub(crate) struct CustomRunner {
    model: Arc<CustomModel>,
    /// Each stream's state: the CPU its thread is pinned to, if a leased task pinned it.
    streams: Vec<Mutex<CpuStream<PinnedTo>>>,
    max_batch: usize,
    threads: usize,
}

impl CustomRunner {
    /// `threads`: the cores a task without its own bound may use (the backend's thread count).
    pub(crate) fn new(
        net: &Network,
        workers: usize,
        max_batch: usize,
        threads: usize,
        notify: Notify,
    ) -> Result<CustomRunner> {
        let Network::Custom(m) = net else {
            return Err(Error::internal(format!("a custom runner cannot run a {} model", net.kind())));
        };
        let streams = (0..workers)
            .map(|w| {
                CpuStream::new(format!("serve-custom-{w}"), PinnedTo::default(), notify.clone())
                    .map(Mutex::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CustomRunner { model: Arc::new(m.clone()), streams, max_batch, threads: threads.max(1) })
    }
}

impl Runner for CustomRunner {
    fn workers(&self) -> usize {
        self.streams.len()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        self.streams[worker].lock().unwrap_or_else(|p| p.into_inner()).signal()
    }

    fn io_lens(&self) -> (usize, usize) {
        (self.model.input_len, self.model.output_len)
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        let stream =
            self.streams.get(worker).ok_or_else(|| Error::internal(format!("no worker {worker}")))?;
        let model = self.model.clone();
        let cores = task_threads(&task, self.threads);
        let lease = task.lease.clone();
        launch_task(stream, self.max_batch, task, move |pinned: &mut PinnedTo, io, rows| {
            let n = model.layers.len();
            if n == 0 && matches!(io.work, Work::Layers { .. }) {
                io.error = Some(Error::new(
                    Code::Unsupported,
                    "the custom model declared no layers: it runs whole-model tasks only",
                ));
                return;
            }
            let (layers, input) = match io.work.layer_range(n) {
                Ok(r) => r,
                Err(e) => {
                    io.error = Some(e);
                    return;
                }
            };
            let (inl, outl) = model.io_lens(layers);
            if input.len() != rows * inl {
                io.error = Some(Error::internal(format!(
                    "a task of {rows} rows entering layer {} carries {} values, not {rows} × {inl}",
                    layers.0,
                    input.len()
                )));
                return;
            }
            let mut output = std::mem::take(&mut io.output);
            output.clear();
            output.resize(rows * outl, 0.0);
            // A leased task runs where its lease is (the thread stays there until a task leased
            // elsewhere comes: a pinned thread is moved only when the lease differs).
            if let Some(&first) = lease.first() {
                pinned.pin(first);
            }
            let cores = if lease.is_empty() { cores } else { lease.len() };
            let mut call =
                CustomCall { worker, cores, cpus: &lease, batch: rows, layers, input, output: &mut output };
            match model.exec.execute(&mut call) {
                Ok(()) => io.output = output,
                Err(msg) => {
                    io.error = Some(Error::new(Code::Backend, format!("the custom model failed: {msg}")))
                }
            }
        })
    }
}
