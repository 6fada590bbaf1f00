//! Layer models on the CPU — `mlp`, `resnet`, `bert` (ARCHITECTURE.md §5.2, §6): weights prepared
//! once and shared by every worker (BatchNorm folded, matrices packed for the GEMM), one stream per
//! worker with its own buffers, and any range of layers `[first, last)` run as a task
//! ([`Work::Layers`]) as well as the whole model ([`Work::Dense`]).
//!
//! A task runs on at most its core bound (`TaskData::cores`, 0: the runner's threads). A bound of
//! `c` cores runs on a pool of exactly `c` threads owned by the worker (created at its first
//! use and kept), not on the backend's shared pool: two workers given leases of `c₁` and `c₂`
//! cores compute on `c₁ + c₂` threads and never steal each other's (VELTAIR's core leases).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::conv::{ConvLayer, add_relu, chw_to_hwc, global_avg_pool, max_pool_3x3_s2};
use super::gemm::{PARALLEL_MIN_ROWS, PARALLEL_TASK_MIN_MACS, PackedWeight, Threads, linear};
use super::pool::ComputePool;
use super::stream::{CpuStream, launch_task, task_threads};
use super::transformer::{BertCpu, BertScratch};
use crate::backend::{CompletionSignal, Notify, Runner, TaskData};
use crate::error::{Code, Error, Result};
use crate::model::resnet::ResNet;
use crate::model::{Mlp, Network};

/// Values of the per-stream activation buffers one chunk of a resnet task may use: a task of
/// more images runs in chunks of as many as fit (64 MB at most, at least one image).
const RESNET_CHUNK_VALUES: usize = 16 << 20;

/// A layer model prepared for the CPU.
enum Stack {
    Mlp(MlpCpu),
    ResNet(ResNetCpu),
    Bert(BertCpu),
}

/// A stream's buffers, for its model's kind.
enum Scratch {
    Mlp { a: Vec<f32>, b: Vec<f32> },
    ResNet(ResNetScratch),
    Bert(BertScratch),
}

impl Stack {
    fn new(net: &Network, max_batch: usize) -> Result<(Stack, usize)> {
        Ok(match net {
            Network::Mlp(m) => (Stack::Mlp(MlpCpu::new(m)), max_batch),
            Network::ResNet(m) => {
                let r = ResNetCpu::new(m);
                let chunk = (RESNET_CHUNK_VALUES / r.values_per_image().max(1)).clamp(1, max_batch);
                (Stack::ResNet(r), chunk)
            }
            Network::Bert(m) => (Stack::Bert(BertCpu::new(m)), max_batch),
            other => {
                return Err(Error::internal(format!("a layer runner cannot run a {} model", other.kind())));
            }
        })
    }

    fn num_layers(&self) -> usize {
        match self {
            Stack::Mlp(m) => m.layers.len(),
            Stack::ResNet(m) => m.blocks.len() + 2,
            Stack::Bert(m) => m.num_layers(),
        }
    }

    /// Values per row entering `layer` (`layer == num_layers()`: the output).
    fn in_len(&self, layer: usize) -> usize {
        match self {
            Stack::Mlp(m) => {
                if layer == 0 {
                    m.layers[0].w.k()
                } else {
                    m.layers[layer - 1].w.n()
                }
            }
            Stack::ResNet(m) => m.shapes[layer],
            Stack::Bert(m) => {
                if layer == m.num_layers() {
                    m.out_len(layer - 1)
                } else {
                    m.in_len(layer)
                }
            }
        }
    }

    /// A stream's buffers for tasks of up to `rows` rows (resnet: `rows` is the chunk).
    fn scratch(&self, rows: usize) -> Result<Scratch> {
        Ok(match self {
            Stack::Mlp(m) => Scratch::Mlp { a: zeroed(m.max_width * rows)?, b: zeroed(m.max_width * rows)? },
            Stack::ResNet(m) => Scratch::ResNet(m.scratch(rows)?),
            Stack::Bert(_) => Scratch::Bert(BertScratch::default()),
        })
    }

    /// Run layers `first..last` over `rows` rows of `input` into `out` (resnet: `chunk` images
    /// at a time).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        range: (usize, usize),
        rows: usize,
        input: &[f32],
        out: &mut [f32],
        s: &mut Scratch,
        chunk: usize,
        threads: Threads,
    ) -> Result<()> {
        match (self, s) {
            (Stack::Mlp(m), Scratch::Mlp { a, b }) => m.run(range, rows, input, out, (a, b), threads),
            (Stack::ResNet(m), Scratch::ResNet(s)) => {
                let (inl, outl) = (m.shapes[range.0], m.shapes[range.1]);
                for start in (0..rows).step_by(chunk) {
                    let n = chunk.min(rows - start);
                    let (i, o) =
                        (&input[start * inl..(start + n) * inl], &mut out[start * outl..(start + n) * outl]);
                    m.run(range, n, i, o, s, threads);
                }
            }
            (Stack::Bert(m), Scratch::Bert(s)) => return m.run(range, rows, input, out, s, threads),
            _ => return Err(Error::internal("a stream's scratch is made for another model")),
        }
        Ok(())
    }
}

/// A zeroed buffer, or UNAVAILABLE (not an abort) when memory is short.
fn zeroed(len: usize) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::new(
            Code::Unavailable,
            format!("cannot allocate {} MiB of activation buffers", len / (1 << 18)),
        )
    })?;
    v.resize(len, 0.0);
    Ok(v)
}

// ---------------------------------------------------------------------------------------------
// mlp

struct MlpLayer {
    w: PackedWeight,
    b: Vec<f32>,
}

struct MlpCpu {
    layers: Vec<MlpLayer>,
    max_width: usize,
}

impl MlpCpu {
    fn new(m: &Mlp) -> MlpCpu {
        MlpCpu {
            layers: m
                .layers
                .iter()
                .map(|l| MlpLayer {
                    w: PackedWeight::from_torch(&l.weight, l.out_features, l.in_features),
                    b: l.bias.clone(),
                })
                .collect(),
            max_width: m.max_width(),
        }
    }

    /// Layers `first..last`, ReLU after every layer but the model's last.
    fn run(
        &self,
        (first, last): (usize, usize),
        rows: usize,
        input: &[f32],
        out: &mut [f32],
        (a, b): (&mut [f32], &mut [f32]),
        threads: Threads,
    ) {
        let end = self.layers.len() - 1;
        // Where the activation entering layer k is: the input, `a` or `b`.
        let mut in_a: Option<bool> = None;
        for k in first..last {
            let l = &self.layers[k];
            let n = l.w.n();
            let (src, dst): (&[f32], &mut [f32]) = match (in_a, k + 1 == last) {
                (None, true) => (input, &mut *out),
                (None, false) => (input, &mut *a),
                (Some(true), true) => (&*a, &mut *out),
                (Some(true), false) => (&*a, &mut *b),
                (Some(false), true) => (&*b, &mut *out),
                (Some(false), false) => (&*b, &mut *a),
            };
            linear(src, &l.w, &l.b, &mut dst[..rows * n], rows, k < end, threads);
            in_a = Some(in_a != Some(true));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// resnet

struct BlockCpu {
    convs: Vec<ConvLayer>,
    down: Option<ConvLayer>,
}

struct ResNetCpu {
    /// `[C, H, W]` of the input.
    image: [usize; 3],
    stem: ConvLayer,
    blocks: Vec<BlockCpu>,
    fc: PackedWeight,
    fc_b: Vec<f32>,
    /// Values per image entering each layer, and the output's (`num_layers + 1`).
    shapes: Vec<usize>,
    /// `(c, h, w)` entering each layer.
    dims: Vec<(usize, usize, usize)>,
}

struct ResNetScratch {
    a: Vec<f32>,
    b: Vec<f32>,
    t1: Vec<f32>,
    t2: Vec<f32>,
    sc: Vec<f32>,
    col: Vec<f32>,
}

impl ResNetCpu {
    fn new(m: &ResNet) -> ResNetCpu {
        let shapes = m.shapes();
        ResNetCpu {
            image: m.cfg.image,
            stem: ConvLayer::new(&m.stem),
            blocks: m
                .blocks
                .iter()
                .map(|b| BlockCpu {
                    convs: b.convs.iter().map(ConvLayer::new).collect(),
                    down: b.downsample.as_ref().map(ConvLayer::new),
                })
                .collect(),
            fc: PackedWeight::from_torch(&m.fc_weight, m.cfg.num_classes, m.features()),
            fc_b: m.fc_bias.clone(),
            dims: shapes.iter().map(|s| (s.c, s.h, s.w)).collect(),
            shapes: shapes.iter().map(|s| s.values()).collect(),
        }
    }

    /// The largest activation and im2col per image over every step, and their sum over the
    /// buffers a chunk holds.
    fn sizes(&self) -> (usize, usize) {
        let [c, h, w] = self.image;
        let (sh, sw) = (self.stem.out_side(h), self.stem.out_side(w));
        let mut act = (self.stem.out_c * sh * sw).max(c * h * w);
        let mut col = self.stem.col_len(1, h, w);
        for (i, b) in self.blocks.iter().enumerate() {
            let (_, h0, w0) = self.dims[i + 1];
            let (mut hh, mut ww) = (h0, w0);
            for conv in &b.convs {
                col = col.max(conv.col_len(1, hh, ww));
                (hh, ww) = (conv.out_side(hh), conv.out_side(ww));
                act = act.max(conv.out_c * hh * ww);
            }
            if let Some(d) = &b.down {
                col = col.max(d.col_len(1, h0, w0));
                act = act.max(d.out_c * d.out_side(h0) * d.out_side(w0));
            }
        }
        // The head writes the logits (more than any activation when the image is tiny and the
        // classes many).
        (act.max(self.fc.n()), col)
    }

    fn values_per_image(&self) -> usize {
        let (act, col) = self.sizes();
        5 * act + col
    }

    fn scratch(&self, n: usize) -> Result<ResNetScratch> {
        let (act, col) = self.sizes();
        Ok(ResNetScratch {
            a: zeroed(n * act)?,
            b: zeroed(n * act)?,
            t1: zeroed(n * act)?,
            t2: zeroed(n * act)?,
            sc: zeroed(n * act)?,
            col: zeroed(n * col)?,
        })
    }

    /// Layers `first..last` for `n` images: layer 0 the stem, `1..=blocks` the blocks, then the
    /// head. Between layers an image is channels-last `[h, w, c]`.
    fn run(
        &self,
        (first, last): (usize, usize),
        n: usize,
        input: &[f32],
        out: &mut [f32],
        s: &mut ResNetScratch,
        threads: Threads,
    ) {
        let head = self.blocks.len() + 1;
        // The current activation lives in `a` (cur_a) or `b`.
        let inl = self.shapes[first];
        s.a[..n * inl].copy_from_slice(&input[..n * inl]);
        let mut cur_a = true;
        for layer in first..last {
            let (c, h, w) = self.dims[layer];
            let (cur, next) = if cur_a { (&mut s.a, &mut s.b) } else { (&mut s.b, &mut s.a) };
            if layer == 0 {
                // Stem: CHW → HWC, conv1 + bn1 + ReLU, max-pool.
                chw_to_hwc(&cur[..n * c * h * w], (n, c, h, w), &mut s.t1);
                let (oh, ow) = self.stem.forward(&s.t1, (n, h, w), &mut s.t2, &mut s.col, true, threads);
                max_pool_3x3_s2(&s.t2, (n, oh, ow, self.stem.out_c), next);
            } else if layer == head {
                global_avg_pool(&cur[..n * c * h * w], (n, h, w, c), &mut s.t1);
                linear(&s.t1[..n * c], &self.fc, &self.fc_b, &mut next[..n * self.fc.n()], n, false, threads);
            } else {
                let b = &self.blocks[layer - 1];
                let col = &mut s.col;
                // basic: conv1 (ReLU) → t1, conv2 → next; bottleneck: conv1 (ReLU) → t1,
                // conv2 (ReLU) → t2, conv3 → next. The shortcut is added, then ReLU.
                match &b.convs[..] {
                    [c1, c2] => {
                        let (oh, ow) = c1.forward(cur, (n, h, w), &mut s.t1, col, true, threads);
                        c2.forward(&s.t1, (n, oh, ow), next, col, false, threads);
                    }
                    [c1, c2, c3] => {
                        let (oh, ow) = c1.forward(cur, (n, h, w), &mut s.t1, col, true, threads);
                        let (oh, ow) = c2.forward(&s.t1, (n, oh, ow), &mut s.t2, col, true, threads);
                        c3.forward(&s.t2, (n, oh, ow), next, col, false, threads);
                    }
                    _ => unreachable!("a block has two or three convolutions"),
                }
                let len = n * self.shapes[layer + 1];
                match &b.down {
                    Some(d) => {
                        d.forward(cur, (n, h, w), &mut s.sc, &mut s.col, false, threads);
                        add_relu(&mut next[..len], &s.sc[..len], threads);
                    }
                    None => add_relu(&mut next[..len], &cur[..len], threads),
                }
            }
            cur_a = !cur_a;
        }
        let outl = self.shapes[last];
        let result = if cur_a { &s.a } else { &s.b };
        out[..n * outl].copy_from_slice(&result[..n * outl]);
    }
}

// ---------------------------------------------------------------------------------------------
// The runner

/// One worker: its stream (with the model's scratch) and its core-lease pools.
struct Worker {
    stream: Mutex<CpuStream<Scratch>>,
    /// Pools of exactly `c` threads for tasks bound to `c` cores, created on first use.
    leases: Mutex<HashMap<usize, Arc<ComputePool>>>,
}

pub(super) struct LayerRunner {
    stack: Arc<Stack>,
    workers: Vec<Worker>,
    pool: Arc<ComputePool>,
    threads: usize,
    max_batch: usize,
    chunk: usize,
    /// Multiply-adds of one row through each layer (for the threshold of parallel work).
    layer_macs: Arc<[usize]>,
}

impl LayerRunner {
    pub(super) fn new(
        net: Arc<Network>,
        workers: usize,
        max_batch: usize,
        pool: Arc<ComputePool>,
        threads: usize,
        notify: Notify,
    ) -> Result<LayerRunner> {
        let (stack, chunk) = Stack::new(&net, max_batch)?;
        let workers = (0..workers)
            .map(|w| {
                let scratch = stack.scratch(chunk)?;
                let stream = CpuStream::new(format!("serve-stream-{w}"), scratch, notify.clone())?;
                Ok(Worker { stream: Mutex::new(stream), leases: Mutex::new(HashMap::new()) })
            })
            .collect::<Result<Vec<_>>>()?;
        let layer_macs = net.layers().iter().map(|l| l.flops_per_row as usize / 2).collect();
        Ok(LayerRunner { stack: Arc::new(stack), workers, pool, threads, max_batch, chunk, layer_macs })
    }

    /// The pool a task bound to `cores` cores runs on: the worker's own pool of that many
    /// threads, or the backend's pool for an unbound task.
    fn pool_for(&self, worker: usize, cores: usize) -> Result<Arc<ComputePool>> {
        if cores == 0 || cores >= self.threads {
            return Ok(self.pool.clone());
        }
        let mut leases = self.workers[worker].leases.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(p) = leases.get(&cores) {
            return Ok(p.clone());
        }
        let p = Arc::new(ComputePool::new(cores)?);
        leases.insert(cores, p.clone());
        Ok(p)
    }
}

impl Runner for LayerRunner {
    fn workers(&self) -> usize {
        self.workers.len()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        self.workers[worker].stream.lock().expect("stream lock").signal()
    }

    fn io_lens(&self) -> (usize, usize) {
        (self.stack.in_len(0), self.stack.in_len(self.stack.num_layers()))
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        let w = self.workers.get(worker).ok_or_else(|| Error::internal(format!("no worker {worker}")))?;
        let stack = self.stack.clone();
        let threads = task_threads(&task, self.threads);
        let pool = self.pool_for(worker, task.cores)?;
        let (chunk, layer_macs) = (self.chunk, self.layer_macs.clone());
        launch_task(&w.stream, self.max_batch, task, move |scratch: &mut Scratch, io, rows| {
            let layers = stack.num_layers();
            let (range, input) = match io.work.layer_range(layers) {
                Ok(r) => r,
                Err(e) => {
                    io.error = Some(e);
                    return;
                }
            };
            let (inl, outl) = (stack.in_len(range.0), stack.in_len(range.1));
            if input.len() < rows * inl {
                io.error = Some(Error::internal(format!(
                    "a task of {rows} rows entering layer {} needs {} values, it carries {}",
                    range.0,
                    rows * inl,
                    input.len()
                )));
                return;
            }
            let mut output = std::mem::take(&mut io.output);
            output.clear();
            output.resize(rows * outl, 0.0);
            // The pool is woken for tasks of at least PARALLEL_TASK_MIN_MACS multiply-adds over
            // the layers they run. An mlp row is a matrix-vector product, so a one-row mlp task
            // stays on the stream's thread (PARALLEL_MIN_ROWS); one image or one sequence is a
            // matrix product of its own (positions or tokens are its rows) and uses the pool.
            let task_macs = rows.saturating_mul(layer_macs[range.0..range.1].iter().sum::<usize>());
            let parallel = threads > 1
                && task_macs >= PARALLEL_TASK_MIN_MACS
                && (rows >= PARALLEL_MIN_ROWS || !matches!(*stack, Stack::Mlp(_)));
            let done = if parallel {
                pool.install(|| stack.run(range, rows, input, &mut output, scratch, chunk, Threads(threads)))
            } else {
                stack.run(range, rows, input, &mut output, scratch, chunk, Threads(1))
            };
            match done {
                Ok(()) => io.output = output,
                Err(e) => io.error = Some(e),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::bert::{Bert, BertConfig};
    use crate::model::resnet::ResNetConfig;

    fn run_all(stack: &Stack, rows: usize, input: &[f32], range: (usize, usize)) -> Vec<f32> {
        let mut s = stack.scratch(rows).unwrap();
        let mut out = vec![f32::NAN; rows * stack.in_len(range.1)];
        stack.run(range, rows, input, &mut out, &mut s, rows, Threads(1)).unwrap();
        out
    }

    /// Running the layers in any split into ranges gives the whole model's output exactly: the
    /// ranges hand each other the same activations the whole run keeps.
    #[test]
    fn layer_ranges_compose_to_the_whole_model() {
        let resnet = Network::ResNet(ResNet::random(
            &ResNetConfig {
                name: None,
                block: "bottleneck".into(),
                layers: [1, 2, 1, 1],
                num_classes: 5,
                image: [3, 21, 19],
                width: Some(4),
            },
            3,
        ));
        let bert = Network::Bert(Bert::random(
            &BertConfig {
                name: None,
                vocab: 50,
                hidden: 16,
                layers: 3,
                heads: 4,
                intermediate: 24,
                max_position: 12,
                type_vocab: 2,
                seq_len: 10,
                layer_norm_eps: None,
            },
            4,
        ));
        let mlp = Network::Mlp(Mlp::random(&[6, 9, 7, 4], 5));
        for net in [resnet, bert, mlp] {
            let (stack, _) = Stack::new(&net, 4).unwrap();
            let n = stack.num_layers();
            assert_eq!(n, net.layers().len(), "{}", net.kind());
            for (k, l) in net.layers().iter().enumerate() {
                assert_eq!(stack.in_len(k + 1), l.out_len, "{} layer {k}", net.kind());
            }
            let rows = 3;
            let input: Vec<f32> = match &net {
                Network::Bert(_) => {
                    let mut v = vec![-1.0; rows * 10];
                    for (r, len) in [3usize, 10, 1].into_iter().enumerate() {
                        for p in 0..len {
                            v[r * 10 + p] = ((r * 7 + p * 3) % 50) as f32;
                        }
                    }
                    v
                }
                _ => crate::workload::values(rows * stack.in_len(0), 11, 1.0),
            };
            let whole = run_all(&stack, rows, &input, (0, n));
            assert!(whole.iter().all(|v| v.is_finite()), "{}", net.kind());
            for split in 1..n {
                let mid = run_all(&stack, rows, &input, (0, split));
                let end = run_all(&stack, rows, &mid, (split, n));
                assert_eq!(end, whole, "{}: split at layer {split}", net.kind());
            }
            if let Network::Bert(_) = &net {
                // Bad rows handed to the runner are refused, as on CUDA: an id past the vocabulary,
                // a length past seq_len.
                let mut s = stack.scratch(rows).unwrap();
                let mut out = vec![0.0; rows * stack.in_len(n)];
                let mut bad = input.clone();
                bad[1] = 50.0;
                let e = stack.run((0, n), rows, &bad, &mut out, &mut s, rows, Threads(1)).unwrap_err();
                assert!(e.message().contains("token 50 at position 1"), "{e}");
                let mut mid = run_all(&stack, rows, &input, (0, 1));
                let row = mid.len() / rows;
                mid[row - 1] = 11.0;
                let e = stack.run((1, n), rows, &mid, &mut out, &mut s, rows, Threads(1)).unwrap_err();
                assert!(e.message().contains("length 11"), "{e}");
            }
        }
    }
}
