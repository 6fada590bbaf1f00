//! `mlp` on the CPU: weights packed once and shared by every worker; one stream per worker,
//! each with two activation buffers sized for the largest batch, allocated once and reused.

use super::pool::ComputePool;
use std::sync::{Arc, Mutex};

use crate::backend::cpu::gemm::{PackedWeight, Threads, linear};
use crate::backend::cpu::stream::{CpuStream, launch_task};
use crate::backend::{CompletionSignal, Notify, Runner, TaskData, Work};
use crate::error::{Error, Result};
use crate::model::Network;

/// Ping-pong activation buffers of one stream.
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
}

/// One layer as the CPU computes it.
struct Layer {
    w: PackedWeight,
    b: Vec<f32>,
}

/// The prepared model: packed layers (shared by all workers) and its sizes.
struct Prepared {
    layers: Vec<Layer>,
    input_len: usize,
    output_len: usize,
    flops_per_row: usize,
}

pub(super) struct MlpRunner {
    model: Arc<Prepared>,
    streams: Vec<Mutex<CpuStream<Scratch>>>,
    pool: Arc<ComputePool>,
    threads: usize,
    max_batch: usize,
}

impl MlpRunner {
    pub(super) fn new(
        net: Arc<Network>,
        workers: usize,
        max_batch: usize,
        pool: Arc<ComputePool>,
        threads: usize,
        notify: Notify,
    ) -> Result<MlpRunner> {
        let Network::Mlp(mlp) = &*net else {
            return Err(Error::internal(format!("an mlp runner cannot run a {} model", net.kind())));
        };
        let model = Arc::new(Prepared {
            layers: mlp
                .layers
                .iter()
                .map(|l| Layer {
                    w: PackedWeight::from_torch(&l.weight, l.out_features, l.in_features),
                    b: l.bias.clone(),
                })
                .collect(),
            input_len: mlp.input_len(),
            output_len: mlp.output_len(),
            flops_per_row: mlp.flops_per_row() as usize,
        });
        let width = mlp.max_width().checked_mul(max_batch).ok_or_else(|| {
            Error::invalid(format!("activation buffers for batch {max_batch} overflow the address space"))
        })?;
        let streams = (0..workers)
            .map(|w| {
                let scratch = Scratch { a: zeroed(width)?, b: zeroed(width)? };
                CpuStream::new(format!("serve-stream-{w}"), scratch, notify.clone()).map(Mutex::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MlpRunner { model, streams, pool, threads, max_batch })
    }
}

/// A zeroed buffer, or an error (not an abort) when memory is short.
fn zeroed(len: usize) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::new(
            crate::error::Code::Unavailable,
            format!("cannot allocate {} MiB of activation buffers", len * 4 / (1 << 20)),
        )
    })?;
    v.resize(len, 0.0);
    Ok(v)
}

/// Run the layers over `rows` rows of `input`, leaving the result in `out`.
fn forward(m: &Prepared, input: &[f32], rows: usize, s: &mut Scratch, out: &mut Vec<f32>, threads: Threads) {
    let last = m.layers.len() - 1;
    let mut src_is_input = true;
    for (k, l) in m.layers.iter().enumerate() {
        let (src, dst): (&[f32], &mut [f32]) = if src_is_input {
            (input, &mut s.a)
        } else if k % 2 == 1 {
            (&s.a, &mut s.b)
        } else {
            (&s.b, &mut s.a)
        };
        linear(src, &l.w, &l.b, dst, rows, k < last, threads);
        src_is_input = false;
    }
    let result = if last % 2 == 0 { &s.a } else { &s.b };
    out.clear();
    out.extend_from_slice(&result[..rows * m.output_len]);
}

impl Runner for MlpRunner {
    fn workers(&self) -> usize {
        self.streams.len()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        self.streams[worker].lock().expect("stream lock").signal()
    }

    fn io_lens(&self) -> (usize, usize) {
        (self.model.input_len, self.model.output_len)
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        let model = self.model.clone();
        let pool = self.pool.clone();
        let threads = Threads(super::stream::task_threads(&task, self.threads));
        launch_task(&self.streams[worker], self.max_batch, task, move |scratch: &mut Scratch, io, rows| {
            let Work::Dense(input) = &io.work else {
                io.error = Some(Error::internal("an mlp task must carry dense rows"));
                return;
            };
            let macs = rows * model.flops_per_row / 2;
            if threads.0 > 1
                && rows >= super::gemm::PARALLEL_MIN_ROWS
                && macs >= super::gemm::PARALLEL_TASK_MIN_MACS
            {
                pool.install(|| forward(&model, input, rows, scratch, &mut io.output, threads));
            } else {
                forward(&model, input, rows, scratch, &mut io.output, Threads(1));
            }
        })
    }
}
