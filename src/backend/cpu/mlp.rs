//! `mlp` on the CPU: one stream per worker, each with two activation buffers sized for the
//! largest batch, allocated once and reused by every task.

use std::sync::{Arc, Mutex};

use crate::backend::cpu::gemm::{Threads, linear};
use crate::backend::cpu::stream::{CpuStream, Job};
use crate::backend::{CompletionSignal, Notify, Runner, TaskData};
use crate::error::{Error, Result};
use crate::model::{Mlp, Network};

/// Ping-pong activation buffers of one stream.
struct Scratch {
    a: Vec<f32>,
    b: Vec<f32>,
}

pub(super) struct MlpRunner {
    net: Arc<Network>,
    streams: Vec<Mutex<CpuStream<Scratch>>>,
    pool: Arc<rayon::ThreadPool>,
    threads: usize,
    max_batch: usize,
}

impl MlpRunner {
    pub(super) fn new(
        net: Arc<Network>,
        workers: usize,
        max_batch: usize,
        pool: Arc<rayon::ThreadPool>,
        threads: usize,
        notify: Notify,
    ) -> Result<MlpRunner> {
        let Network::Mlp(mlp) = &*net;
        let width = mlp.max_width().checked_mul(max_batch).ok_or_else(|| {
            Error::invalid(format!("activation buffers for batch {max_batch} overflow the address space"))
        })?;
        let streams = (0..workers)
            .map(|w| {
                let scratch = Scratch { a: zeroed(width)?, b: zeroed(width)? };
                CpuStream::new(format!("serve-stream-{w}"), scratch, notify.clone()).map(Mutex::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(MlpRunner { net, streams, pool, threads, max_batch })
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
fn forward(mlp: &Mlp, input: &[f32], rows: usize, s: &mut Scratch, out: &mut Vec<f32>, threads: Threads) {
    let last = mlp.layers.len() - 1;
    let mut src_is_input = true;
    for (k, l) in mlp.layers.iter().enumerate() {
        let (src, dst): (&[f32], &mut [f32]) = if src_is_input {
            (input, &mut s.a)
        } else if k % 2 == 1 {
            (&s.a, &mut s.b)
        } else {
            (&s.b, &mut s.a)
        };
        linear(src, &l.weight, &l.bias, dst, rows, l.in_features, l.out_features, k < last, threads);
        src_is_input = false;
    }
    let result = if last % 2 == 0 { &s.a } else { &s.b };
    out.clear();
    out.extend_from_slice(&result[..rows * mlp.output_len()]);
}

impl Runner for MlpRunner {
    fn workers(&self) -> usize {
        self.streams.len()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        self.streams[worker].lock().expect("stream lock").signal()
    }

    fn io_lens(&self) -> (usize, usize) {
        let Network::Mlp(m) = &*self.net;
        (m.input_len(), m.output_len())
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        if task.rows == 0 || task.rows > self.max_batch {
            return Err(Error::internal(format!(
                "task of {} rows on a runner prepared for at most {}",
                task.rows, self.max_batch
            )));
        }
        let net = self.net.clone();
        let pool = self.pool.clone();
        let threads = Threads(self.threads);
        let t2 = task.clone();
        let job = Job {
            run: Box::new(move |scratch: &mut Scratch| {
                let Network::Mlp(mlp) = &*net;
                let mut io = task.io.lock().expect("task io lock");
                let io = &mut *io;
                let macs = task.rows * mlp.flops_per_row() as usize / 2;
                if threads.0 > 1 && macs >= super::gemm::PARALLEL_MIN_MACS {
                    pool.install(|| forward(mlp, &io.input, task.rows, scratch, &mut io.output, threads));
                } else {
                    forward(mlp, &io.input, task.rows, scratch, &mut io.output, Threads(1));
                }
            }),
            on_panic: Box::new(move |e| t2.io.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e)),
        };
        self.streams[worker].lock().expect("stream lock").enqueue(job)
    }
}
