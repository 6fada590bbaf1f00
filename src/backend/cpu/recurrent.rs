//! Recurrent models (`lstm`, `seq2seq`, `treelstm`) on the CPU, executed cell task by cell task
//! for cellular batching: weights packed once and shared by every worker; one state arena (a slot
//! per in-flight request — per tree node for `treelstm` — holding `h` and `c` of every layer);
//! one stream per worker with its own step buffers, allocated at prepare and reused.
//!
//! A cell task runs the structure the CUDA kernels mirror (ARCHITECTURE.md §5): embedding gather into the
//! batch input, then per layer one gather of `[x_t | h_{t-1}]`, one GEMM against
//! `[W_ih | W_hh]`, and a fused pointwise + scatter back to the slots; a decoder step adds the
//! projection and the argmax, whose token is fed back through the slot to the next step.

use super::pool::ComputePool;
use std::sync::{Arc, Mutex};

use crate::backend::cpu::arena::StateArena;
use crate::backend::cpu::gemm::{PARALLEL_MIN_ROWS, PARALLEL_TASK_MIN_MACS, STREAMED_WEIGHT_BYTES, Threads};
use crate::backend::cpu::lstm_cell::{
    LstmLayer, LstmRow, LstmScratch, Projection, StepInput, embed_rows, lstm_layer_step, project_argmax,
};
use crate::backend::cpu::stream::{CpuStream, launch_task};
use crate::backend::cpu::tree_cell::{TreeCell, TreeRow, TreeScratch, tree_step};
use crate::backend::{CellTask, CompletionSignal, Notify, Runner, RunnerShape, TaskData, Work, grow, size};
use crate::error::{Error, Result};
use crate::model::lstm::LstmStack;
use crate::model::{DECODER, NO_TOKEN, Network};
use crate::sched::CellType;

/// An LSTM stack and its embedding `[vocab, E]`: `lstm`, or one of `seq2seq`'s two halves. With
/// its layer 0 folded (a token-gate table, lstm_cell.rs) the embedding is not kept: the table
/// replaces it.
struct Chain {
    embedding: Vec<f32>,
    layers: Vec<LstmLayer>,
}

impl Chain {
    /// Pack `stack`, folding `embedding` into layer 0 when its token-gate table fits `budget`
    /// (bytes; what it takes is deducted).
    fn new(embedding: &[f32], stack: &LstmStack, budget: &mut usize, threads: usize) -> Result<Chain> {
        let vocab = embedding.len() / stack.layers[0].input.max(1);
        let bytes = LstmLayer::token_gates_bytes(vocab, stack.hidden);
        let fold = bytes <= *budget;
        let layers = stack
            .layers
            .iter()
            .enumerate()
            .map(|(k, l)| match k {
                0 if fold => LstmLayer::fold_embedding(
                    &l.w_ih,
                    &l.w_hh,
                    &l.b_ih,
                    &l.b_hh,
                    embedding,
                    l.input,
                    stack.hidden,
                    Threads(threads),
                ),
                _ => Ok(LstmLayer::from_torch(&l.w_ih, &l.w_hh, &l.b_ih, &l.b_hh, l.input, stack.hidden)),
            })
            .collect::<Result<Vec<_>>>()?;
        if fold {
            *budget -= bytes;
        }
        let embedding = if fold { Vec::new() } else { embedding.to_vec() };
        Ok(Chain { embedding, layers })
    }
}

/// The packed cells of a model.
enum Cells {
    Lstm(Chain),
    /// `seq2seq`: encoder (cell 0), decoder (cell 1) with its projection.
    Seq2Seq {
        encoder: Chain,
        decoder: Chain,
        proj: Projection,
        bos: u32,
    },
    Tree {
        embedding: Vec<f32>,
        cell: TreeCell,
    },
}

/// The prepared model, shared by the streams.
struct Prepared {
    cells: Cells,
    embed: usize,
    hidden: usize,
    /// Decoder vocabulary (seq2seq; 0 otherwise), for the logits buffer.
    vocab: usize,
    arena: StateArena,
    /// Where a decoder slot keeps its last token (after every layer's `h`, `c`).
    token_offset: usize,
    /// Multiply-adds of one row of a step, by cell type (to decide whether to use the thread
    /// pool): each is also the weights one row of the step streams.
    macs_per_row: Vec<usize>,
}

impl Prepared {
    /// Whether a task of `rows` rows of cell type `cell` runs on the compute pool (given more
    /// than one thread) rather than on its stream's thread alone: big enough to be worth waking
    /// the pool, or a step whose weights stream from memory (which gains a thread's bandwidth
    /// even for one row).
    fn pooled(&self, cell: CellType, rows: usize) -> bool {
        let macs = self.macs_per_row.get(usize::from(cell)).copied().unwrap_or(0);
        let big = rows >= PARALLEL_MIN_ROWS && rows * macs >= PARALLEL_TASK_MIN_MACS;
        big || macs * size_of::<f32>() >= STREAMED_WEIGHT_BYTES
    }
}

/// Rows of step buffers allocated when a model is prepared.
const PREALLOCATED_ROWS: usize = 1024;

/// Step buffers of one stream.
#[derive(Default)]
struct Scratch {
    ids: Vec<u32>,
    x: Vec<f32>,
    h_a: Vec<f32>,
    h_b: Vec<f32>,
    lstm: LstmScratch,
    tree: TreeScratch,
    lstm_rows: Vec<LstmRow>,
    tree_rows: Vec<TreeRow>,
    logits: Vec<f32>,
}

pub(super) struct RecurrentRunner {
    model: Arc<Prepared>,
    streams: Vec<Mutex<CpuStream<Scratch>>>,
    pool: Arc<ComputePool>,
    threads: usize,
    max_batch: usize,
}

impl Scratch {
    /// Buffers for tasks of `rows` rows (and, for trees, `children` children in all).
    fn ensure(&mut self, p: &Prepared, rows: usize, children: usize) -> Result<()> {
        let wide = p.embed.max(p.hidden);
        grow(&mut self.ids, rows, "token ids")?;
        grow(&mut self.x, size(rows, wide, "step inputs")?, "step inputs")?;
        grow(&mut self.h_a, size(rows, p.hidden, "hidden states")?, "hidden states")?;
        grow(&mut self.h_b, size(rows, p.hidden, "hidden states")?, "hidden states")?;
        grow(&mut self.logits, size(rows, p.vocab, "logits")?, "logits")?;
        match &p.cells {
            Cells::Tree { .. } => self.tree.reserve(rows, children, p.hidden),
            _ => {
                self.lstm.reserve(rows, p.embed, p.hidden)?;
                self.lstm.reserve(rows, p.hidden, p.hidden)
            }
        }
    }
}

impl RecurrentRunner {
    pub(super) fn new(
        net: Arc<Network>,
        shape: RunnerShape,
        pool: Arc<ComputePool>,
        threads: usize,
        notify: Notify,
    ) -> Result<RecurrentRunner> {
        // Token-gate tables are computed on the backend's pool, within the model's budget.
        let mut budget = shape.token_gates_bytes;
        let mut chain = |embedding: &[f32], stack: &LstmStack| {
            pool.install(|| Chain::new(embedding, stack, &mut budget, threads))
        };
        let (cells, embed, hidden, layers, vocab) = match &*net {
            Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => {
                return Err(Error::internal(format!("a recurrent runner cannot run a {} model", net.kind())));
            }
            Network::Lstm(m) => {
                (Cells::Lstm(chain(&m.embedding, &m.stack)?), m.cfg.embed, m.cfg.hidden, m.cfg.layers, 0)
            }
            Network::Seq2Seq(m) => (
                Cells::Seq2Seq {
                    encoder: chain(&m.enc_embedding, &m.encoder)?,
                    decoder: chain(&m.dec_embedding, &m.decoder)?,
                    proj: Projection::from_torch(&m.proj_weight, &m.proj_bias),
                    bos: m.cfg.bos,
                },
                m.cfg.embed,
                m.cfg.hidden,
                m.cfg.layers,
                m.cfg.vocab,
            ),
            Network::TreeLstm(m) => (
                Cells::Tree {
                    embedding: m.embedding.clone(),
                    cell: TreeCell::from_torch(
                        &m.w_iou,
                        &m.b_iou,
                        &m.u_iou,
                        &m.w_f,
                        &m.b_f,
                        &m.u_f,
                        m.cfg.embed,
                        m.cfg.hidden,
                    ),
                },
                m.cfg.embed,
                m.cfg.hidden,
                1,
                0,
            ),
        };
        let token_offset = net.token_word();
        let arena = StateArena::new(shape.state_slots, net.state_width())?;
        let lstm = layers * (embed.max(hidden) + hidden) * 4 * hidden;
        let macs_per_row = match &*net {
            Network::TreeLstm(_) => vec![(embed * 4 + hidden * 4) * hidden; 2],
            // The encoder's steps, and the decoder's with its projection to the vocabulary.
            Network::Seq2Seq(_) => vec![lstm, lstm + vocab * hidden],
            _ => vec![lstm],
        };
        let model = Arc::new(Prepared { cells, embed, hidden, vocab, arena, token_offset, macs_per_row });
        // Buffers for the rows a task usually has, allocated now; a padded tree level can be far
        // larger than any cellular task (batch × widest tree level), so those grow on demand.
        let rows = shape.max_batch.min(PREALLOCATED_ROWS);
        let streams = (0..shape.workers)
            .map(|w| {
                let mut scratch = Scratch::default();
                scratch.ensure(&model, rows, rows)?;
                CpuStream::new(format!("serve-stream-{w}"), scratch, notify.clone()).map(Mutex::new)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(RecurrentRunner { model, streams, pool, threads, max_batch: shape.max_batch })
    }
}

/// Run the layers of a chain cell over the task's rows; leaves the top layer's `h` in `s.h_a`.
fn run_chain(
    p: &Prepared,
    Chain { embedding, layers }: &Chain,
    padded: usize,
    s: &mut Scratch,
    threads: Threads,
) {
    let (e, h) = (p.embed, p.hidden);
    if !layers[0].is_folded() {
        embed_rows(embedding, e, &s.ids[..padded], &mut s.x[..padded * e]);
    }
    for (k, layer) in layers.iter().enumerate() {
        // Layer 0 reads the embeddings (through its token-gate table when folded), the others
        // the layer below; each writes `h_b`, which becomes the next layer's input.
        let input = match k {
            0 if layer.is_folded() => StepInput::Tokens(&s.ids[..padded]),
            0 => StepInput::Values(&s.x),
            _ => StepInput::Values(&s.h_a),
        };
        lstm_layer_step(
            layer,
            input,
            &s.lstm_rows,
            padded,
            &p.arena,
            k * 2 * h,
            &mut s.lstm,
            &mut s.h_b,
            threads,
        );
        std::mem::swap(&mut s.h_a, &mut s.h_b);
    }
}

/// Execute a multi-step task of an `lstm` (a padded batch run in one call, as frameworks do):
/// `task.steps()` steps of all `padded` rows; at each step the rows whose sequence goes on are the
/// real rows, the others (padding, and rows past their last step) are computed from zero state
/// and not written back, so a row's slot holds its state after its last real step. The `h` of
/// each `output` row is read from its slot at the end.
fn run_steps(
    p: &Prepared,
    chain: &Chain,
    task: &CellTask,
    padded: usize,
    s: &mut Scratch,
    out: &mut Vec<f32>,
    threads: Threads,
) {
    let (h, steps) = (p.hidden, task.steps() as usize);
    for step in 0..steps {
        s.lstm_rows.clear();
        s.ids[..padded].fill(NO_TOKEN);
        for (i, r) in task.rows.iter().enumerate() {
            if step < task.row_steps(r) as usize {
                s.ids[s.lstm_rows.len()] = task.tokens[i * steps + step];
                s.lstm_rows.push(LstmRow { slot: r.slot, fresh: r.first && step == 0 });
            }
        }
        run_chain(p, chain, padded, s, threads);
    }
    let top = (chain.layers.len() - 1) * 2 * h;
    out.clear();
    for r in task.rows.iter().filter(|r| r.output) {
        let at = out.len();
        out.resize(at + h, 0.0);
        p.arena.read(r.slot, top, &mut out[at..]);
    }
}

/// Execute one cell task: outputs of rows marked `output` go to `out`, decoder tokens to `tokens`.
fn run(
    p: &Prepared,
    task: &CellTask,
    padded: usize,
    s: &mut Scratch,
    out: &mut Vec<f32>,
    tokens: &mut Vec<u32>,
    threads: Threads,
) {
    let h = p.hidden;
    s.ids[..padded].fill(NO_TOKEN);
    match &p.cells {
        Cells::Tree { .. } | Cells::Seq2Seq { .. } if task.steps() > 1 => {
            unreachable!("the runner refuses a tree or seq2seq task of several steps at launch")
        }
        Cells::Tree { embedding, cell } => {
            s.tree_rows.clear();
            for (i, r) in task.rows.iter().enumerate() {
                s.ids[i] = r.token;
                s.tree_rows.push(TreeRow {
                    slot: r.slot,
                    children: r.children.start as usize..r.children.end as usize,
                });
            }
            embed_rows(embedding, p.embed, &s.ids[..padded], &mut s.x[..padded * p.embed]);
            tree_step(
                cell,
                &s.x,
                &s.tree_rows,
                &task.children,
                padded,
                &p.arena,
                &mut s.tree,
                &mut s.h_a,
                threads,
            );
        }
        Cells::Lstm(chain) if task.steps() > 1 => {
            run_steps(p, chain, task, padded, s, out, threads);
            return;
        }
        Cells::Lstm(chain) => {
            s.lstm_rows.clear();
            for (i, r) in task.rows.iter().enumerate() {
                s.ids[i] = r.token;
                s.lstm_rows.push(LstmRow { slot: r.slot, fresh: r.first });
            }
            run_chain(p, chain, padded, s, threads);
        }
        Cells::Seq2Seq { encoder, decoder, proj, bos } => {
            let decoding = task.cell == DECODER;
            s.lstm_rows.clear();
            for (i, r) in task.rows.iter().enumerate() {
                s.ids[i] = if !decoding {
                    r.token
                } else if r.first {
                    *bos
                } else {
                    p.arena.read_u32(r.slot, p.token_offset)
                };
                // A decoder continues from the encoder's state: never fresh.
                s.lstm_rows.push(LstmRow { slot: r.slot, fresh: r.first && !decoding });
            }
            run_chain(p, if decoding { decoder } else { encoder }, padded, s, threads);
            if decoding {
                let n = task.rows.len();
                tokens.clear();
                tokens.resize(n, 0);
                project_argmax(proj, &s.h_a, n, &mut s.logits, tokens, threads);
                for (r, &t) in task.rows.iter().zip(tokens.iter()) {
                    p.arena.write_u32(r.slot, p.token_offset, t);
                }
            }
        }
    }
    out.clear();
    for (i, r) in task.rows.iter().enumerate() {
        if r.output {
            out.extend_from_slice(&s.h_a[i * h..(i + 1) * h]);
        }
    }
}

/// A task of several steps must be an `lstm`'s, with a token for every row at every step.
fn check_steps(p: &Prepared, task: &CellTask) -> Result<()> {
    let steps = task.steps() as usize;
    if steps == 1 {
        return Ok(());
    }
    if !matches!(p.cells, Cells::Lstm(_)) {
        return Err(Error::internal(format!("a task of {steps} steps for a model other than an lstm")));
    }
    if task.tokens.len() != task.rows.len().saturating_mul(steps) {
        return Err(Error::internal(format!(
            "a task of {} rows and {steps} steps carries {} tokens",
            task.rows.len(),
            task.tokens.len()
        )));
    }
    Ok(())
}

impl Runner for RecurrentRunner {
    fn workers(&self) -> usize {
        self.streams.len()
    }

    fn signal(&self, worker: usize) -> Arc<dyn CompletionSignal> {
        self.streams[worker].lock().expect("stream lock").signal()
    }

    fn io_lens(&self) -> (usize, usize) {
        (0, self.model.hidden)
    }

    fn state_slots(&self) -> usize {
        self.model.arena.slots()
    }

    fn task_threads(&self, cell: CellType, rows: usize) -> usize {
        if self.threads > 1 && self.model.pooled(cell, rows) { self.threads } else { 1 }
    }

    fn launch(&self, worker: usize, task: Arc<TaskData>) -> Result<u64> {
        let model = self.model.clone();
        let pool = self.pool.clone();
        let threads = super::stream::task_threads(&task, self.threads);
        launch_task(&self.streams[worker], self.max_batch, task, move |scratch: &mut Scratch, io, rows| {
            let Work::Cells(cells) = &io.work else {
                io.error = Some(Error::internal("a recurrent model's task must carry cells"));
                return;
            };
            if let Err(e) = scratch.ensure(&model, rows, cells.children.len()) {
                io.error = Some(e);
                return;
            }
            if let Err(e) = check_steps(&model, cells) {
                io.error = Some(e);
                return;
            }
            let (out, tokens) = (&mut io.output, &mut io.tokens);
            if threads > 1 && model.pooled(cells.cell, rows) {
                pool.install(|| run(&model, cells, rows, scratch, out, tokens, Threads(threads)));
            } else {
                run(&model, cells, rows, scratch, out, tokens, Threads(1));
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, RunnerShape};
    use crate::model::{Lstm, Network};

    /// The threads a task runs on (what `serve profile` writes as `pool_rows` for the
    /// simulator): its stream's thread below the pool's threshold, the whole pool above it, and
    /// never more than one on a one-thread backend.
    #[test]
    fn a_task_runs_on_the_pool_only_when_big_enough() {
        let net = Arc::new(Network::Lstm(Lstm::random(64, 256, 256, 1, 1)));
        let shape = RunnerShape { workers: 1, max_batch: 512, state_slots: 8, token_gates_bytes: 0 };
        let runner =
            |threads| CpuBackend::new(threads).unwrap().prepare(net.clone(), shape, Arc::new(|| {})).unwrap();
        let (two, one) = (runner(2), runner(1));
        assert_eq!((two.task_threads(0, 1), two.task_threads(0, 512)), (1, 2));
        let first = (1..=512).find(|&r| two.task_threads(0, r) > 1).unwrap();
        assert!(first > 1 && (first..=512).all(|r| two.task_threads(0, r) == 2), "from {first} rows on");
        assert!((1..=512).all(|r| one.task_threads(0, r) == 1));
    }
}
