//! Layer models on the CPU — `mlp`, `resnet`, `bert` (ARCHITECTURE.md §5.2, §6): weights prepared
//! once and shared by every worker (BatchNorm folded, matrices packed for the GEMM), one stream per
//! worker with its own buffers, and any range of layers `[first, last)` run as a task
//! ([`Work::Layers`]) as well as the whole model ([`Work::Dense`]).
//!
//! A task runs on at most its core bound (`TaskData::cores`, 0: the runner's threads). A bound of
//! `c` cores runs on a pool of exactly `c` threads owned by the worker (created at its first
//! use and kept), not on the backend's shared pool: two workers given leases of `c₁` and `c₂`
//! cores compute on `c₁ + c₂` threads and never steal each other's (VELTAIR's core leases).
//! A task with a lease of CPUs (`TaskData::lease`, the tenant mode's) runs instead on one of
//! the backend's lease pools of exactly that many threads (`pool.rs`, `LeasePools`: shared by
//! every runner, one task at a time each), its threads pinned one to each leased CPU, and its
//! stream thread pinned to the first (work too small to wake a pool runs there, on one CPU of
//! its lease).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::affinity::PinnedTo;
use super::conv::{ConvLayer, add_relu, chw_to_hwc, global_avg_pool, max_pool_3x3_s2};
use super::gemm::{PARALLEL_MIN_ROWS, PARALLEL_TASK_MIN_MACS, PackedWeight, Threads, linear};
use super::pool::{ComputePool, LeasePools};
use super::stream::{CpuStream, launch_task, task_threads};
use super::transformer::{BertCpu, BertScratch};
use crate::backend::{CompletionSignal, Notify, Runner, TaskData, grow, size};
use crate::error::{Error, Result};
use crate::model::resnet::{ResNet, Shape};
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
                // Five activation buffers and the im2col per image (`ResNetCpu::scratch`).
                let per_image = 5 * r.act + r.col;
                let chunk = (RESNET_CHUNK_VALUES / per_image.max(1)).clamp(1, max_batch);
                (Stack::ResNet(r), chunk)
            }
            Network::Bert(m) => (Stack::Bert(BertCpu::new(m)), max_batch),
            other => {
                return Err(Error::internal(format!("a layer runner cannot run a {} model", other.kind())));
            }
        })
    }

    /// A stream's buffers for tasks of up to `rows` rows (resnet: `rows` is the chunk).
    fn scratch(&self, rows: usize) -> Result<Scratch> {
        Ok(match self {
            Stack::Mlp(m) => Scratch::Mlp { a: zeroed(m.max_width, rows)?, b: zeroed(m.max_width, rows)? },
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
                let (inl, outl) = (m.shapes[range.0].values(), m.shapes[range.1].values());
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

/// A zeroed buffer of `rows × per_row` values, or UNAVAILABLE (not an abort) when memory is
/// short.
fn zeroed(per_row: usize, rows: usize) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    grow(&mut v, size(rows, per_row, "activation buffers")?, "activation buffers")?;
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
    stem: ConvLayer,
    blocks: Vec<BlockCpu>,
    fc: PackedWeight,
    fc_b: Vec<f32>,
    /// The shape entering each layer, and the output's (`num_layers + 1`).
    shapes: Vec<Shape>,
    /// The largest activation and im2col of one image (`ResNet::buffer_sizes`).
    act: usize,
    col: usize,
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
        let (act, col) = m.buffer_sizes();
        ResNetCpu {
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
            shapes: m.shapes(),
            act,
            col,
        }
    }

    fn scratch(&self, n: usize) -> Result<ResNetScratch> {
        Ok(ResNetScratch {
            a: zeroed(self.act, n)?,
            b: zeroed(self.act, n)?,
            t1: zeroed(self.act, n)?,
            t2: zeroed(self.act, n)?,
            sc: zeroed(self.act, n)?,
            col: zeroed(self.col, n)?,
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
        let inl = self.shapes[first].values();
        s.a[..n * inl].copy_from_slice(&input[..n * inl]);
        let mut cur_a = true;
        for layer in first..last {
            let Shape { c, h, w } = self.shapes[layer];
            let (cur, next) = if cur_a { (&mut s.a, &mut s.b) } else { (&mut s.b, &mut s.a) };
            if layer == 0 {
                // Stem: CHW → HWC, conv1 + bn1 + ReLU, max-pool.
                chw_to_hwc(&cur[..n * c * h * w], (n, c, h, w), &mut s.t1);
                let (oh, ow) = self.stem.forward(&s.t1, (n, h, w), &mut s.t2, &mut s.col, true, threads);
                max_pool_3x3_s2(&s.t2, (n, oh, ow, self.stem.g.out_c), next);
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
                let len = n * self.shapes[layer + 1].values();
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
        let outl = self.shapes[last].values();
        let result = if cur_a { &s.a } else { &s.b };
        out[..n * outl].copy_from_slice(&result[..n * outl]);
    }
}

// ---------------------------------------------------------------------------------------------
// The runner

/// One worker: its stream (with the model's scratch) and its core-lease pools.
struct Worker {
    stream: Mutex<CpuStream<StreamState>>,
    /// Pools of exactly `c` threads for tasks bound to `c` cores, created on first use.
    leases: Mutex<HashMap<usize, Arc<ComputePool>>>,
}

/// What a worker's stream thread owns: its buffers, and the CPU it is pinned to (a leased
/// task's first; a task on the same CPU pins nothing again).
struct StreamState {
    scratch: Scratch,
    pinned: PinnedTo,
}

pub(super) struct LayerRunner {
    stack: Arc<Stack>,
    /// Values per row entering each layer and leaving the last (`Network::layer_bounds`).
    bounds: Arc<[usize]>,
    workers: Vec<Worker>,
    pool: Arc<ComputePool>,
    leases: Arc<LeasePools>,
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
        (pool, leases): (Arc<ComputePool>, Arc<LeasePools>),
        threads: usize,
        notify: Notify,
    ) -> Result<LayerRunner> {
        let (stack, chunk) = Stack::new(&net, max_batch)?;
        let workers = (0..workers)
            .map(|w| {
                let state = StreamState { scratch: stack.scratch(chunk)?, pinned: PinnedTo::default() };
                let stream = CpuStream::new(format!("serve-stream-{w}"), state, notify.clone())?;
                Ok(Worker { stream: Mutex::new(stream), leases: Mutex::new(HashMap::new()) })
            })
            .collect::<Result<Vec<_>>>()?;
        let layer_macs = net.layers().iter().map(|l| l.flops_per_row as usize / 2).collect();
        let bounds = net.layer_bounds().into();
        Ok(LayerRunner {
            stack: Arc::new(stack),
            bounds,
            workers,
            pool,
            leases,
            threads,
            max_batch,
            chunk,
            layer_macs,
        })
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
        (self.bounds[0], self.bounds[self.bounds.len() - 1])
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        let w = self.workers.get(worker).ok_or_else(|| Error::internal(format!("no worker {worker}")))?;
        let stack = self.stack.clone();
        // A leased task runs on its lease's CPUs (a lease pool, below), however many threads
        // the backend has; an unleased one within them.
        let lease = task.lease.clone();
        let threads = if lease.is_empty() { task_threads(&task, self.threads) } else { lease.len() };
        let pool = if lease.is_empty() { Some(self.pool_for(worker, task.cores)?) } else { None };
        let leases = self.leases.clone();
        let (chunk, layer_macs, bounds) = (self.chunk, self.layer_macs.clone(), self.bounds.clone());
        launch_task(&w.stream, self.max_batch, task, move |state: &mut StreamState, io, rows| {
            let (range, input) = match io.work.layer_range(bounds.len() - 1) {
                Ok(r) => r,
                Err(e) => {
                    io.error = Some(e);
                    return;
                }
            };
            let (inl, outl) = (bounds[range.0], bounds[range.1]);
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
            if let Some(&first) = lease.first() {
                state.pinned.pin(first);
            }
            let scratch = &mut state.scratch;
            let mut run = |pool: &ComputePool| {
                pool.install(|| stack.run(range, rows, input, &mut output, scratch, chunk, Threads(threads)))
            };
            let done = match (parallel, &pool) {
                (false, _) => stack.run(range, rows, input, &mut output, scratch, chunk, Threads(1)),
                (true, Some(pool)) => run(pool),
                (true, None) => leases.take(lease.len()).and_then(|mut p| {
                    p.pin(&lease);
                    let done = run(&p.pool);
                    leases.give_back(p);
                    done
                }),
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

    fn run_all(
        stack: &Stack,
        bounds: &[usize],
        rows: usize,
        input: &[f32],
        range: (usize, usize),
    ) -> Vec<f32> {
        let mut s = stack.scratch(rows).unwrap();
        let mut out = vec![f32::NAN; rows * bounds[range.1]];
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
            let bounds = net.layer_bounds();
            let n = net.layers().len();
            let rows = 3;
            let input: Vec<f32> = match &net {
                Network::Bert(_) => {
                    let mut v = vec![0.0; rows * 10];
                    for (r, len) in [3usize, 10, 1].into_iter().enumerate() {
                        let ids = (0..len).map(|p| ((r * 7 + p * 3) % 50) as u32).collect();
                        net.dense_row(&crate::Input::Tokens(ids), &mut v[r * 10..(r + 1) * 10]);
                    }
                    v
                }
                _ => crate::workload::values(rows * bounds[0], 11, 1.0),
            };
            let whole = run_all(&stack, &bounds, rows, &input, (0, n));
            assert_eq!(whole.len(), rows * net.dense_lens().1, "{}", net.kind());
            assert!(whole.iter().all(|v| v.is_finite()), "{}", net.kind());
            for split in 1..n {
                let mid = run_all(&stack, &bounds, rows, &input, (0, split));
                let end = run_all(&stack, &bounds, rows, &mid, (split, n));
                assert_eq!(end, whole, "{}: split at layer {split}", net.kind());
            }
            if let Network::Bert(_) = &net {
                // Bad rows handed to the runner are refused, as on CUDA: an id past the vocabulary,
                // a length past seq_len.
                let mut s = stack.scratch(rows).unwrap();
                let mut out = vec![0.0; rows * bounds[n]];
                let mut bad = input.clone();
                bad[1] = 50.0;
                let e = stack.run((0, n), rows, &bad, &mut out, &mut s, rows, Threads(1)).unwrap_err();
                assert!(e.message().contains("token 50 at position 1"), "{e}");
                let mut mid = run_all(&stack, &bounds, rows, &input, (0, 1));
                let row = mid.len() / rows;
                mid[row - 1] = 11.0;
                let e = stack.run((1, n), rows, &mid, &mut out, &mut s, rows, Threads(1)).unwrap_err();
                assert!(e.message().contains("length 11"), "{e}");
            }
        }
    }

    /// A task on a lease of CPUs that computes on a pool runs on a lease pool whose threads
    /// are pinned one to each leased CPU, gives the unpinned task's output, and the pool is
    /// reused (pinned again) by the next lease of its size, on other CPUs, of any worker.
    #[test]
    #[cfg(target_os = "linux")]
    #[cfg_attr(miri, ignore)] // threads and affinity syscalls
    fn a_leased_task_runs_on_the_leased_cpus() {
        use crate::backend::Work;
        use crate::backend::cpu::affinity::allowed_cpus;
        let cpus = allowed_cpus();
        if cpus.len() < 2 {
            return; // one CPU: nothing to choose among
        }
        // Rows of 2 through 512 → 16384 → 8: 2 × (512·16384 + 16384·8) multiply-adds, past the
        // pool's threshold (PARALLEL_TASK_MIN_MACS, checked below).
        let net = Arc::new(Network::Mlp(Mlp::random(&[512, 16384, 8], 2)));
        const { assert!(2 * (512 * 16384 + 16384 * 8) >= PARALLEL_TASK_MIN_MACS) };
        let me = std::thread::current();
        let notify: crate::backend::Notify = Arc::new(move || me.unpark());
        let pools = (Arc::new(ComputePool::new(2).unwrap()), Arc::new(LeasePools::default()));
        let runner = LayerRunner::new(net, 2, 2, pools, 2, notify).unwrap();
        let run = |worker: usize, task: Arc<TaskData>| {
            let target = runner.launch(worker, task.clone()).unwrap();
            while runner.signal(worker).completed() < target {
                std::thread::park_timeout(std::time::Duration::from_millis(1));
            }
            let io = task.io.lock().unwrap();
            assert!(io.error.is_none(), "{:?}", io.error);
            io.output.clone()
        };
        let input = crate::workload::values(2 * 512, 3, 1.0);
        let free = run(0, TaskData::new(2, Work::Dense(input.clone())));
        assert_eq!(runner.leases.idle_threads(), 0, "no lease pool for an unleased task");
        for (worker, lease) in [(0, vec![cpus[1], cpus[0]]), (1, vec![cpus[0], cpus[1]])] {
            let got = run(worker, TaskData::leased(2, 0, lease.clone(), Work::Dense(input.clone())));
            assert_eq!(got, free, "the same output on a lease of {lease:?}");
            assert_eq!(runner.leases.idle_threads(), 2, "one pool of 2, reused");
            let p = runner.leases.take(2).unwrap();
            let want: Vec<Vec<usize>> = lease.iter().map(|&c| vec![c]).collect();
            assert_eq!(p.pool.broadcast(|_| allowed_cpus()), want, "one thread on each of {lease:?}");
            runner.leases.give_back(p);
        }
    }
}
