//! Recurrent models (`lstm`, `seq2seq`, `treelstm`) on CUDA, cell task by cell task for cellular
//! batching — the same [`Work`] in and the same outputs and tokens out as the CPU runner
//! (`backend/cpu/recurrent.rs`), with the structure of ARCHITECTURE.md §5:
//!
//! * chain cells (an lstm step, a seq2seq encoder or decoder step): embedding gather into
//!   `X = [x | h]`, then per layer the gather of `h_{t-1}` from the state arena, **one** cuBLAS GEMM
//!   `G = X · [W_ih | W_hh]ᵀ` and the fused pointwise kernel (both biases, gates, scatter of `h`,
//!   `c` to the slots); a decoder step adds the projection GEMM and the argmax kernel, which writes
//!   the token to the task's output and to the slot, where the next step's embedding gather reads
//!   it (`SERVE_TOKEN_FROM_SLOT`);
//! * tree cells: embedding gather, the children gather, the GEMMs `x · [W_iou; W_f]ᵀ` and (when a
//!   node of the step has children) `h̃ · U_iouᵀ`, `H_k · U_fᵀ`, then the fused tree pointwise.
//!
//! Then the `h` of the rows marked `output` is gathered straight into the task's pinned, mapped
//! output buffer (the embedding kernel as a row gather).
//!
//! The state arena has the CPU runner's slot layout: per layer `h` then `c` (`hidden` values each),
//! and for seq2seq one more word holding the decoder's last token.
//!
//! A task's row descriptors go to the device in one upload from its staging, laid out as
//! `[slot words: B][token ids: B][output rows: B][child starts: B + 1][child slots: children]`
//! with `B` the runner's largest batch; the device copy has the same layout.

use super::abi::{self, DevicePtr};
use super::runner::{Ctx, DeviceModel, Needs, Plan, Staging, dim, host_slice};
use super::{CudaDevice, DeviceBuffer, Stream};
use crate::backend::{CellTask, RunnerShape, Work};
use crate::error::{Error, Result};
use crate::model::lstm::LstmStack;
use crate::model::{DECODER, NO_TOKEN, Network};

/// Output rows a worker's preallocated staging holds (more are allocated when a task needs them).
const TYPICAL_OUTPUT_ROWS: usize = 512;

/// One LSTM layer on the device: `[W_ih | W_hh]` as one `[4H, input + H]` row-major matrix (the
/// `B` of [`Blas::gemm_nt`](super::Blas::gemm_nt): `G = X · Wᵀ`) and `b_ih + b_hh`.
struct Layer {
    w: DeviceBuffer<f32>,
    bias: DeviceBuffer<f32>,
    input: usize,
}

/// An embedding table and the layers of one LSTM stack.
struct Chain {
    embedding: DeviceBuffer<f32>,
    layers: Vec<Layer>,
}

enum Cells {
    Lstm(Chain),
    Seq2Seq {
        encoder: Chain,
        decoder: Chain,
        /// `[vocab, H]` and `[vocab]`.
        proj_w: DeviceBuffer<f32>,
        proj_b: DeviceBuffer<f32>,
        bos: u32,
    },
    Tree {
        embedding: DeviceBuffer<f32>,
        /// `[W_iou; W_f]`: `[4H, E]`, and `[b_iou; b_f]`.
        wx: DeviceBuffer<f32>,
        bx: DeviceBuffer<f32>,
        /// `[3H, H]` and `[H, H]`.
        u_iou: DeviceBuffer<f32>,
        u_f: DeviceBuffer<f32>,
    },
}

/// A recurrent model prepared on the device.
pub(super) struct Recurrent {
    cells: Cells,
    embed: usize,
    hidden: usize,
    /// Rows of the embedding table(s) and of the projection.
    vocab: usize,
    /// `state_slots × width` words, zeroed at prepare.
    arena: DeviceBuffer<f32>,
    slots: usize,
    width: usize,
    token_offset: usize,
    /// The runner's largest task (the layout of the row descriptors).
    max_batch: usize,
    /// How cell tasks become row descriptors.
    rows: Rows,
    /// Children of a tree task the buffers hold at prepare.
    initial_children: usize,
}

/// How the rows of a cell task become row descriptors (host only; see the module documentation
/// for the layout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Rows {
    /// `B`: the runner's largest task.
    max_batch: usize,
    /// State slots of the arena.
    slots: usize,
    /// Token ids below this are valid.
    vocab: usize,
    /// A treelstm (children, no fresh rows).
    tree: bool,
    /// Seq2seq: the decoder's first input token.
    bos: Option<u32>,
}

/// What [`Rows::check`] found in a valid task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Counts {
    children: usize,
    out_rows: usize,
    decoder: bool,
}

impl Rows {
    fn ids_at(&self) -> usize {
        self.max_batch
    }
    fn out_at(&self) -> usize {
        2 * self.max_batch
    }
    fn start_at(&self) -> usize {
        3 * self.max_batch
    }
    fn child_at(&self) -> usize {
        4 * self.max_batch + 1
    }
    /// Words of the descriptors to upload for a task with `children` children.
    fn len(&self, children: usize) -> usize {
        if self.tree { self.child_at() + children } else { self.start_at() }
    }

    fn is_decoder(&self, t: &CellTask) -> bool {
        t.cell == DECODER && self.bos.is_some()
    }

    /// Check a cell task of `padded` rows; `Err` names the problem (the engine completes the
    /// task's requests BACKEND).
    fn check(&self, padded: usize, t: &CellTask) -> Result<Counts> {
        if t.rows.len() > padded || padded > self.max_batch {
            return Err(Error::internal(format!(
                "{} rows in a task of {padded} on a runner of at most {}",
                t.rows.len(),
                self.max_batch
            )));
        }
        if t.steps() > 1 {
            // The CUDA backend declares one step per task (`Backend::max_task_steps`).
            return Err(Error::internal(format!(
                "a task of {} steps on a runner of one step per task",
                t.steps()
            )));
        }
        let decoder = self.is_decoder(t);
        let mut children = 0usize;
        for (i, r) in t.rows.iter().enumerate() {
            if r.slot as usize >= self.slots {
                return Err(Error::internal(format!(
                    "row {i}: state slot {} outside the arena of {} slots",
                    r.slot, self.slots
                )));
            }
            if !decoder && r.token != NO_TOKEN && r.token as usize >= self.vocab {
                return Err(Error::internal(format!(
                    "row {i}: token {} outside the vocabulary of {}",
                    r.token, self.vocab
                )));
            }
            if self.tree {
                let (s, e) = (r.children.start as usize, r.children.end as usize);
                let Some(kids) = t.children.get(s..e) else {
                    return Err(Error::internal(format!(
                        "row {i}: children {s}..{e} outside the task's {}",
                        t.children.len()
                    )));
                };
                if let Some(&bad) = kids.iter().find(|&&c| c as usize >= self.slots) {
                    return Err(Error::internal(format!(
                        "row {i}: child slot {bad} outside the arena of {} slots",
                        self.slots
                    )));
                }
                children += kids.len();
            }
        }
        let out_rows = t.rows.iter().filter(|r| r.output).count();
        Ok(Counts { children, out_rows, decoder })
    }

    /// The descriptors of a task [`check`](Self::check)ed with `counts`, into `d`
    /// (`len(children)` words).
    fn write(&self, t: &CellTask, padded: usize, counts: Counts, d: &mut Vec<u32>) {
        d.clear();
        d.resize(self.len(counts.children), 0);
        let (ids, out, start, child) = (self.ids_at(), self.out_at(), self.start_at(), self.child_at());
        d[ids..ids + padded].fill(NO_TOKEN);
        let (mut n_out, mut n_child) = (0, 0);
        for (i, r) in t.rows.iter().enumerate() {
            // A decoder continues from the encoder's state: never fresh; tree nodes have no
            // previous state of their own.
            let fresh = r.first && !counts.decoder && !self.tree;
            d[i] = r.slot | if fresh { abi::SERVE_ROW_FRESH } else { 0 };
            d[ids + i] = match (counts.decoder, r.first) {
                (false, _) => r.token,
                (true, true) => self.bos.unwrap_or(NO_TOKEN),
                (true, false) => abi::SERVE_TOKEN_FROM_SLOT,
            };
            if r.output {
                d[out + n_out] = i as u32;
                n_out += 1;
            }
            if self.tree {
                for &c in &t.children[r.children.start as usize..r.children.end as usize] {
                    d[child + n_child] = c;
                    n_child += 1;
                }
                d[start + i + 1] = n_child as u32;
            }
        }
    }
}

/// A worker's device buffers.
pub(super) struct Buffers {
    /// Row descriptors (see the module documentation), `4B + 1 + children` words.
    desc: DeviceBuffer<u32>,
    /// Children the tree buffers (and `desc`) hold.
    children: usize,
    /// Chains: `X = [x | h]`, `B × (max(E, H) + H)`. Trees: `x`, `B × E`.
    xh: DeviceBuffer<f32>,
    /// Chains: gate pre-activations `B × 4H`. Trees: `gx`, `B × 4H`.
    gates: DeviceBuffer<f32>,
    /// The top layer's `h`, `B × H`.
    h_top: DeviceBuffer<f32>,
    /// Seq2seq: `B × vocab`.
    logits: DeviceBuffer<f32>,
    /// Trees: `h̃` (`B × H`), `h̃ · U_iouᵀ` (`B × 3H`), and the children's `h`, `c`, `h_k · U_fᵀ`
    /// (`children × H` each).
    h_sum: DeviceBuffer<f32>,
    gu: DeviceBuffer<f32>,
    child_h: DeviceBuffer<f32>,
    child_c: DeviceBuffer<f32>,
    fu: DeviceBuffer<f32>,
}

/// `a × b` `f32` values of device memory, or UNAVAILABLE when the size overflows.
fn alloc(device: &CudaDevice, a: usize, b: usize, what: &str) -> Result<DeviceBuffer<f32>> {
    device.alloc(crate::backend::size(a, b, what)?)
}

fn layers(stream: &Stream, s: &LstmStack) -> Result<Vec<Layer>> {
    let h = s.hidden;
    s.layers
        .iter()
        .map(|l| {
            let k = l.input + h;
            let mut w = Vec::with_capacity(4 * h * k);
            for j in 0..4 * h {
                w.extend_from_slice(&l.w_ih[j * l.input..(j + 1) * l.input]);
                w.extend_from_slice(&l.w_hh[j * h..(j + 1) * h]);
            }
            let bias: Vec<f32> = l.b_ih.iter().zip(&l.b_hh).map(|(a, b)| a + b).collect();
            Ok(Layer { w: stream.upload(&w)?, bias: stream.upload(&bias)?, input: l.input })
        })
        .collect()
}

impl Recurrent {
    /// Upload `net`'s weights with `stream` (blocking) and allocate the zeroed state arena.
    pub(super) fn new(
        device: &CudaDevice,
        stream: &Stream,
        net: &Network,
        shape: RunnerShape,
    ) -> Result<Recurrent> {
        let (cells, embed, hidden, vocab) = match net {
            Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => {
                return Err(Error::internal(format!("a recurrent runner cannot run a {} model", net.kind())));
            }
            Network::Lstm(m) => (
                Cells::Lstm(Chain {
                    embedding: stream.upload(&m.embedding)?,
                    layers: layers(stream, &m.stack)?,
                }),
                m.cfg.embed,
                m.cfg.hidden,
                m.cfg.vocab,
            ),
            Network::Seq2Seq(m) => (
                Cells::Seq2Seq {
                    encoder: Chain {
                        embedding: stream.upload(&m.enc_embedding)?,
                        layers: layers(stream, &m.encoder)?,
                    },
                    decoder: Chain {
                        embedding: stream.upload(&m.dec_embedding)?,
                        layers: layers(stream, &m.decoder)?,
                    },
                    proj_w: stream.upload(&m.proj_weight)?,
                    proj_b: stream.upload(&m.proj_bias)?,
                    bos: m.cfg.bos,
                },
                m.cfg.embed,
                m.cfg.hidden,
                m.cfg.vocab,
            ),
            Network::TreeLstm(m) => {
                let wx: Vec<f32> = m.w_iou.iter().chain(&m.w_f).copied().collect();
                let bx: Vec<f32> = m.b_iou.iter().chain(&m.b_f).copied().collect();
                (
                    Cells::Tree {
                        embedding: stream.upload(&m.embedding)?,
                        wx: stream.upload(&wx)?,
                        bx: stream.upload(&bx)?,
                        u_iou: stream.upload(&m.u_iou)?,
                        u_f: stream.upload(&m.u_f)?,
                    },
                    m.cfg.embed,
                    m.cfg.hidden,
                    m.cfg.vocab,
                )
            }
        };
        let (token_offset, width) = (net.token_word(), net.state_width());
        // Everything the kernels index with 32-bit parameters.
        let b = shape.max_batch;
        for (v, what) in [
            (b, "batch size"),
            (embed.max(hidden) + hidden, "layer width"),
            (4 * hidden, "gate width"),
            (vocab, "vocabulary"),
            (width, "state slot width"),
            (shape.state_slots, "state slot count"),
            (4 * b + 1, "row descriptors"),
        ] {
            dim(v, what)?;
        }
        let mut arena = alloc(device, shape.state_slots, width, "state arena")?;
        stream.zero(&mut arena)?;
        stream.synchronize()?;
        let tree = matches!(cells, Cells::Tree { .. });
        let initial_children = if tree { b.min(shape.state_slots) } else { 0 };
        let bos = match &cells {
            Cells::Seq2Seq { bos, .. } => Some(*bos),
            _ => None,
        };
        let rows = Rows { max_batch: b, slots: shape.state_slots, vocab, tree, bos };
        Ok(Recurrent {
            cells,
            embed,
            hidden,
            vocab,
            arena,
            slots: shape.state_slots,
            width,
            token_offset,
            max_batch: b,
            rows,
            initial_children,
        })
    }

    fn is_tree(&self) -> bool {
        self.rows.tree
    }

    /// Embedding error flags in the staging's words (after the decoder's tokens).
    fn errors_at(&self) -> usize {
        self.max_batch
    }

    /// Tree buffers for `children` children (and the descriptors with them).
    fn child_buffers(&self, device: &CudaDevice, b: &mut Buffers, children: usize) -> Result<()> {
        let h = self.hidden;
        b.desc = device.alloc(self.rows.len(children))?;
        b.child_h = alloc(device, children, h, "children's states")?;
        b.child_c = alloc(device, children, h, "children's states")?;
        b.fu = alloc(device, children, h, "children's forget gates")?;
        b.children = children;
        Ok(())
    }

    /// Launch parameters shared by several kernels.
    fn arena_dims(&self) -> (DevicePtr, u32, u32) {
        (self.arena.device_ptr(), self.slots as u32, self.width as u32)
    }

    /// Gather the `h` of the output rows into the staging's output buffer.
    fn outputs(&self, ctx: &Ctx<'_>, b: &Buffers, plan: &Plan, st: &Staging) -> Result<()> {
        if plan.out_rows == 0 {
            return Ok(());
        }
        let h = self.hidden as u32;
        let p = abi::EmbeddingParams {
            table: b.h_top.device_ptr(),
            ids: b.desc.device_ptr_at(self.rows.out_at()),
            slots: 0,
            arena: 0,
            out: st.out.device_ptr(),
            errors: 0,
            table_rows: plan.padded as u32,
            width: h,
            batch: plan.out_rows as u32,
            out_ld: h,
            arena_slots: 0,
            arena_width: 0,
            token_offset: 0,
            _pad0: 0,
        };
        // SAFETY: reads `h_top` (B × H ≥ padded × H) and `out_rows` row indices < padded from the
        // descriptors; writes out_rows × H floats of the task's output staging (planned: needs.out),
        // which the host reads only after the counter (module invariants of runner.rs).
        unsafe { ctx.kernels.embedding(ctx.stream, &p) }
    }

    #[allow(clippy::too_many_arguments)]
    fn chain(
        &self,
        ctx: &mut Ctx<'_>,
        b: &mut Buffers,
        plan: &Plan,
        st: &Staging,
        chain: &Chain,
        projection: Option<(&DeviceBuffer<f32>, &DeviceBuffer<f32>)>,
    ) -> Result<()> {
        let (e, h) = (self.embed, self.hidden);
        let (arena, arena_slots, arena_width) = self.arena_dims();
        let slots = b.desc.device_ptr();
        let (padded, real) = (plan.padded as u32, plan.real as u32);
        let emb = abi::EmbeddingParams {
            table: chain.embedding.device_ptr(),
            ids: b.desc.device_ptr_at(self.rows.ids_at()),
            slots,
            arena,
            out: b.xh.device_ptr(),
            errors: st.words.device_ptr() + (self.errors_at() * 4) as u64,
            table_rows: self.vocab as u32,
            width: e as u32,
            batch: padded,
            out_ld: (e + h) as u32,
            arena_slots,
            arena_width,
            token_offset: self.token_offset as u32,
            _pad0: 0,
        };
        // SAFETY: reads vocab × E of the table, padded ids and slot words of the descriptors and
        // token words of the arena; writes padded × (E + H) ≤ B × (max(E, H) + H) of `xh` and padded
        // error flags of the task's staging words (needs.words covers errors_at + padded). Runner
        // invariants for lifetimes and host access.
        unsafe { ctx.kernels.embedding(ctx.stream, &emb) }?;
        let last = chain.layers.len() - 1;
        for (k, layer) in chain.layers.iter().enumerate() {
            let offset = (k * 2 * h) as u32;
            let input = layer.input;
            let gather = abi::LstmGatherParams {
                x: 0,
                slots,
                arena,
                xh: b.xh.device_ptr(),
                input: input as u32,
                hidden: h as u32,
                rows: real,
                padded,
                x_ld: 0,
                arena_slots,
                arena_width,
                offset,
            };
            // SAFETY: writes padded × (input + H) of `xh` (sized for the widest layer), reads `real`
            // slot words and layer k's h of those slots (offset + H ≤ width). Runner invariants.
            unsafe { ctx.kernels.lstm_gather(ctx.stream, &gather) }?;
            ctx.blas.gemm_nt(plan.padded, 4 * h, input + h, 1.0, &b.xh, &layer.w, 0.0, &mut b.gates)?;
            let (h_out, h_out_ld) =
                if k == last { (b.h_top.device_ptr(), h) } else { (b.xh.device_ptr(), 2 * h) };
            let point = abi::LstmPointwiseParams {
                gates: b.gates.device_ptr(),
                bias: layer.bias.device_ptr(),
                slots,
                arena,
                h_out,
                hidden: h as u32,
                rows: real,
                padded,
                h_out_ld: h_out_ld as u32,
                arena_slots,
                arena_width,
                offset,
                _pad0: 0,
            };
            // SAFETY: reads padded × 4H gates and 4H biases; writes padded rows of H at stride
            // h_out_ld into `h_top` (B × H) or `xh` (the next layer's input columns, B × 2H fits)
            // and the real rows' h, c of layer k in their slots. Runner invariants.
            unsafe { ctx.kernels.lstm_pointwise(ctx.stream, &point) }?;
        }
        if let Some((w, bias)) = projection {
            ctx.blas.gemm_nt(plan.real, self.vocab, h, 1.0, &b.h_top, w, 0.0, &mut b.logits)?;
            let p = abi::ArgmaxParams {
                logits: b.logits.device_ptr(),
                bias: bias.device_ptr(),
                slots,
                arena,
                tokens: st.words.device_ptr(),
                rows: real,
                vocab: self.vocab as u32,
                arena_slots,
                arena_width,
                token_offset: self.token_offset as u32,
                _pad0: 0,
            };
            // SAFETY: reads real × vocab logits, vocab biases and real slot words; writes `real`
            // tokens at the start of the task's staging words (needs.words ≥ B ≥ real) and the
            // token word of each real row's slot. Runner invariants.
            unsafe { ctx.kernels.argmax(ctx.stream, &p) }?;
        }
        self.outputs(ctx, b, plan, st)
    }

    fn tree(&self, ctx: &mut Ctx<'_>, b: &mut Buffers, plan: &Plan, st: &Staging) -> Result<()> {
        let Cells::Tree { embedding, wx, bx, u_iou, u_f } = &self.cells else {
            return Err(Error::internal("not a tree model"));
        };
        let (e, h) = (self.embed, self.hidden);
        let (arena, arena_slots, arena_width) = self.arena_dims();
        let (padded, real) = (plan.padded as u32, plan.real as u32);
        let child_start = b.desc.device_ptr_at(self.rows.start_at());
        let emb = abi::EmbeddingParams {
            table: embedding.device_ptr(),
            ids: b.desc.device_ptr_at(self.rows.ids_at()),
            slots: 0,
            arena: 0,
            out: b.xh.device_ptr(),
            errors: st.words.device_ptr() + (self.errors_at() * 4) as u64,
            table_rows: self.vocab as u32,
            width: e as u32,
            batch: padded,
            out_ld: e as u32,
            arena_slots: 0,
            arena_width: 0,
            token_offset: 0,
            _pad0: 0,
        };
        // SAFETY: reads vocab × E of the table and padded ids; writes padded × E of `xh` and padded
        // error flags of the task's staging words. Runner invariants.
        unsafe { ctx.kernels.embedding(ctx.stream, &emb) }?;
        let gather = abi::TreeGatherParams {
            child_start,
            child_slots: b.desc.device_ptr_at(self.rows.child_at()),
            arena,
            h_sum: b.h_sum.device_ptr(),
            child_h: b.child_h.device_ptr(),
            child_c: b.child_c.device_ptr(),
            hidden: h as u32,
            rows: real,
            padded,
            arena_slots,
            arena_width,
            _pad0: 0,
        };
        // SAFETY: reads real + 1 prefix sums and `children` child slot words (within the
        // descriptors, grown for this task) and their h, c; writes padded × H of `h_sum` and
        // children × H of `child_h`, `child_c` (grown to hold them). Runner invariants.
        unsafe { ctx.kernels.tree_gather(ctx.stream, &gather) }?;
        ctx.blas.gemm_nt(plan.padded, 4 * h, e, 1.0, &b.xh, wx, 0.0, &mut b.gates)?;
        let gu = if plan.children > 0 {
            ctx.blas.gemm_nt(plan.padded, 3 * h, h, 1.0, &b.h_sum, u_iou, 0.0, &mut b.gu)?;
            ctx.blas.gemm_nt(plan.children, h, h, 1.0, &b.child_h, u_f, 0.0, &mut b.fu)?;
            b.gu.device_ptr()
        } else {
            0
        };
        let point = abi::TreePointwiseParams {
            gx: b.gates.device_ptr(),
            gu,
            bias: bx.device_ptr(),
            child_start,
            fu: b.fu.device_ptr(),
            child_c: b.child_c.device_ptr(),
            slots: b.desc.device_ptr(),
            arena,
            h_out: b.h_top.device_ptr(),
            hidden: h as u32,
            rows: real,
            padded,
            h_out_ld: h as u32,
            arena_slots,
            arena_width,
        };
        // SAFETY: reads padded × 4H of gx, padded × 3H of gu (when present), 4H biases, the
        // children's fu and c (children × H) and real slot words; writes padded × H of `h_top` and
        // the real rows' h, c in their slots. Runner invariants.
        unsafe { ctx.kernels.tree_pointwise(ctx.stream, &point) }?;
        self.outputs(ctx, b, plan, st)
    }
}

impl DeviceModel for Recurrent {
    type Buffers = Buffers;

    fn io_lens(&self) -> (usize, usize) {
        (0, self.hidden)
    }

    fn state_slots(&self) -> usize {
        self.slots
    }

    fn typical_needs(&self) -> Needs {
        Needs {
            desc: self.rows.len(self.initial_children),
            dense: 0,
            out: self.max_batch.min(TYPICAL_OUTPUT_ROWS) * self.hidden,
            words: 2 * self.max_batch,
        }
    }

    fn buffers(&self, device: &CudaDevice, stream: &Stream) -> Result<Buffers> {
        let (bt, e, h) = (self.max_batch, self.embed, self.hidden);
        let tree = self.is_tree();
        let vocab = if matches!(self.cells, Cells::Seq2Seq { .. }) { self.vocab } else { 0 };
        let mut b = Buffers {
            desc: device.alloc(self.rows.len(0))?,
            children: 0,
            xh: alloc(device, bt, if tree { e } else { e.max(h) + h }, "step inputs")?,
            gates: alloc(device, bt, 4 * h, "gate buffers")?,
            h_top: alloc(device, bt, h, "hidden states")?,
            logits: alloc(device, bt, vocab, "logits")?,
            h_sum: alloc(device, if tree { bt } else { 0 }, h, "child sums")?,
            gu: alloc(device, if tree { bt } else { 0 }, 3 * h, "child gates")?,
            child_h: device.alloc(0)?,
            child_c: device.alloc(0)?,
            fu: device.alloc(0)?,
        };
        if tree {
            self.child_buffers(device, &mut b, self.initial_children)?;
        }
        // Defined contents for the padding rows' first reads (the kernels overwrite them anyway).
        stream.zero(&mut b.xh)?;
        Ok(b)
    }

    fn plan(&self, padded: usize, work: &Work) -> Result<Plan> {
        let Work::Cells(t) = work else {
            return Err(Error::internal("a recurrent model's task must carry cells"));
        };
        let Counts { children, out_rows, decoder } = self.rows.check(padded, t)?;
        dim(children, "children of a task")?;
        let real = t.rows.len();
        Ok(Plan {
            needs: Needs {
                desc: self.rows.len(children),
                dense: 0,
                out: out_rows * self.hidden,
                words: self.errors_at() + padded,
            },
            padded,
            real,
            outputs: out_rows * self.hidden,
            tokens: if decoder { real } else { 0 },
            errors_at: self.errors_at(),
            errors: padded,
            out_rows,
            children,
            decoder,
            ..Plan::default()
        })
    }

    fn stage(&self, work: &Work, plan: &Plan, st: &mut Staging, scratch: &mut Vec<u32>) -> Result<()> {
        let Work::Cells(t) = work else {
            return Err(Error::internal("a recurrent model's task must carry cells"));
        };
        let counts = Counts { children: plan.children, out_rows: plan.out_rows, decoder: plan.decoder };
        self.rows.write(t, plan.padded, counts, scratch);
        st.desc.write(0, scratch)
    }

    fn enqueue(&self, mut ctx: Ctx<'_>, b: &mut Buffers, plan: &Plan, st: &Staging) -> Result<()> {
        if plan.children > b.children {
            // Grown rarely (a task with more children than any before); dropping the old buffers
            // waits for the device, so no queued work still uses them.
            let grown = plan.children.max(b.children.saturating_mul(2)).min(plan.children.max(self.slots));
            self.child_buffers(ctx.device, b, grown)?;
        }
        // SAFETY: the staging's descriptors are written only by `stage` (before this) and read
        // only by this copy; the staging belongs to the task until its counter is seen, so it stays
        // allocated and unmodified until the copy has run. `needs.desc` ≤ its length and ≤ the
        // device descriptors (4B + 1 + children).
        unsafe { ctx.stream.upload_into_async(&mut b.desc, 0, host_slice(&st.desc, plan.needs.desc)) }?;
        match &self.cells {
            Cells::Lstm(chain) => self.chain(&mut ctx, b, plan, st, chain, None),
            Cells::Seq2Seq { encoder, decoder, proj_w, proj_b, .. } => {
                if plan.decoder {
                    self.chain(&mut ctx, b, plan, st, decoder, Some((proj_w, proj_b)))
                } else {
                    self.chain(&mut ctx, b, plan, st, encoder, None)
                }
            }
            Cells::Tree { .. } => self.tree(&mut ctx, b, plan, st),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CellRow;
    use crate::model::ENCODER;

    fn row(slot: u32, token: u32, first: bool, output: bool) -> CellRow {
        CellRow { steps: 1, slot, token, first, children: 0..0, output }
    }

    const B: usize = 4;

    fn chain(bos: Option<u32>) -> Rows {
        Rows { max_batch: B, slots: 10, vocab: 20, tree: false, bos }
    }

    #[test]
    fn chain_rows_carry_slots_fresh_bits_tokens_and_output_rows() {
        let rows = chain(None);
        let t = CellTask {
            cell: ENCODER,
            rows: vec![row(3, 7, true, false), row(9, 19, false, true), row(0, NO_TOKEN, false, true)],
            children: Vec::new(),
            ..CellTask::default()
        };
        let counts = rows.check(4, &t).unwrap();
        assert_eq!(counts, Counts { children: 0, out_rows: 2, decoder: false });
        let mut d = vec![99; 50];
        rows.write(&t, 4, counts, &mut d);
        assert_eq!(d.len(), 3 * B, "chains upload slots, ids and output rows");
        assert_eq!(&d[..3], &[3 | abi::SERVE_ROW_FRESH, 9, 0]);
        // The padding row reads no token.
        assert_eq!(&d[B..2 * B], &[7, 19, NO_TOKEN, NO_TOKEN]);
        assert_eq!(&d[2 * B..2 * B + 2], &[1, 2]);
    }

    #[test]
    fn decoder_rows_start_from_bos_then_read_their_token_from_the_slot() {
        let rows = chain(Some(1));
        let t = CellTask {
            cell: DECODER,
            // Decoder rows carry no token (NO_TOKEN), or an out-of-vocabulary one: never read.
            rows: vec![row(2, NO_TOKEN, true, false), row(5, 12345, false, false)],
            children: Vec::new(),
            ..CellTask::default()
        };
        let counts = rows.check(3, &t).unwrap();
        assert!(counts.decoder);
        let mut d = Vec::new();
        rows.write(&t, 3, counts, &mut d);
        // The decoder continues from the encoder's state: no fresh bit.
        assert_eq!(&d[..2], &[2, 5]);
        assert_eq!(&d[B..B + 3], &[1, abi::SERVE_TOKEN_FROM_SLOT, NO_TOKEN]);
        // The same model's encoder rows are ordinary chain rows.
        let enc = CellTask {
            cell: ENCODER,
            rows: vec![row(2, 4, true, false)],
            children: Vec::new(),
            ..CellTask::default()
        };
        let counts = rows.check(1, &enc).unwrap();
        assert!(!counts.decoder);
        rows.write(&enc, 1, counts, &mut d);
        assert_eq!((d[0], d[B]), (2 | abi::SERVE_ROW_FRESH, 4));
    }

    #[test]
    fn tree_rows_flatten_children_in_row_order_with_prefix_sums() {
        let rows = Rows { max_batch: B, slots: 10, vocab: 20, tree: true, bos: None };
        let mut a = row(6, 3, false, false);
        a.children = 2..4;
        let leaf = row(7, NO_TOKEN, false, false);
        let mut root = row(8, 5, false, true);
        root.children = 0..2;
        let t = CellTask {
            cell: 1,
            rows: vec![a, leaf, root],
            children: vec![0, 1, 2, 3],
            ..CellTask::default()
        };
        let counts = rows.check(4, &t).unwrap();
        assert_eq!(counts, Counts { children: 4, out_rows: 1, decoder: false });
        let mut d = Vec::new();
        rows.write(&t, 4, counts, &mut d);
        assert_eq!(d.len(), 4 * B + 1 + 4);
        assert_eq!(&d[..3], &[6, 7, 8], "tree nodes are never fresh");
        assert_eq!(&d[B..2 * B], &[3, NO_TOKEN, 5, NO_TOKEN]);
        assert_eq!(d[2 * B], 2);
        assert_eq!(&d[3 * B..3 * B + 4], &[0, 2, 2, 4]);
        assert_eq!(&d[4 * B + 1..], &[2, 3, 0, 1]);
    }

    #[test]
    fn bad_tasks_are_refused_before_anything_is_queued() {
        let rows = Rows { max_batch: B, slots: 10, vocab: 20, tree: true, bos: None };
        let msg = |t: &CellTask, padded| rows.check(padded, t).unwrap_err().message().to_string();
        let one = |r: CellRow, children: Vec<u32>| CellTask {
            cell: 0,
            rows: vec![r],
            children,
            ..CellTask::default()
        };
        assert!(msg(&one(row(10, 1, false, false), vec![]), 1).contains("state slot 10 outside"));
        assert!(msg(&one(row(1, 20, false, false), vec![]), 1).contains("token 20 outside"));
        let mut r = row(1, 1, false, false);
        r.children = 0..3;
        assert!(msg(&one(r.clone(), vec![1, 2]), 1).contains("children 0..3 outside"));
        assert!(msg(&one(r, vec![1, 2, 11]), 1).contains("child slot 11 outside"));
        let two = CellTask {
            cell: 0,
            rows: vec![row(1, 1, false, false); 2],
            children: vec![],
            ..CellTask::default()
        };
        assert!(msg(&two, 1).contains("2 rows in a task of 1"));
        assert!(msg(&two, B + 1).contains("at most 4"));
    }
}
