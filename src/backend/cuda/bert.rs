//! `bert` on CUDA (ARCHITECTURE.md §5.3), as the CPU's `transformer.rs` runs it: every request's
//! real tokens packed back to back (`[tokens, hidden]`), the host writing each token's id,
//! position and request span (and each request's first token) into the staging's descriptor;
//! `serve_bert_embed` (the word table read zero-copy from pinned, mapped host memory) +
//! `serve_layer_norm`; per encoder layer one cuBLAS GEMM for Q, K, V,
//! `serve_attention` (a block per token and head over its own request), the output projection,
//! `serve_layer_norm` with the residual, the intermediate GEMM with `serve_bias_act`'s GELU, the
//! output GEMM and `serve_layer_norm`; the pooler gathers each request's first token
//! (`serve_embedding_gather` as a row gather), one GEMM, tanh, into the staging's mapped output.
//! A layer range ([`Work::Layers`]) takes and gives rows of `seq_len × hidden` values and the
//! request's length, as on the CPU.

use super::abi;
use super::runner::{Ctx, DeviceModel, Needs, Plan, Staging, bias_act_params, dim, host_slice};
use super::{CudaDevice, DeviceBuffer, PinnedMapped, Stream};
use crate::backend::Work;
use crate::error::{Error, Result};
use crate::model::Network;
use crate::model::bert::{BertConfig, task_lens};
use crate::model::mlp::Linear;

struct DenseGpu {
    /// `[out, in]`.
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    inputs: usize,
    outputs: usize,
}

impl DenseGpu {
    fn new(stream: &Stream, parts: &[&Linear]) -> Result<DenseGpu> {
        let w: Vec<f32> = parts.iter().flat_map(|l| l.weight.iter().copied()).collect();
        let b: Vec<f32> = parts.iter().flat_map(|l| l.bias.iter().copied()).collect();
        Ok(DenseGpu {
            w: stream.upload(&w)?,
            b: stream.upload(&b)?,
            inputs: parts[0].in_features,
            outputs: parts.iter().map(|l| l.out_features).sum(),
        })
    }

    /// `dst = act(src · Wᵀ + b)` over `rows` rows.
    fn run(
        &self,
        ctx: &mut Ctx<'_>,
        src: &DeviceBuffer<f32>,
        dst: &mut DeviceBuffer<f32>,
        rows: usize,
        act: u32,
    ) -> Result<()> {
        ctx.blas.gemm_nt(rows, self.outputs, self.inputs, 1.0, src, &self.w, 0.0, dst)?;
        let p = bias_act_params(
            (dst.device_ptr(), dst.device_ptr()),
            self.b.device_ptr(),
            (rows, self.outputs),
            act,
        )?;
        // SAFETY: in place over the GEMM's rows × outputs values (a worker buffer sized for the
        // largest task's tokens), outputs biases. Runner invariants (runner.rs) for lifetimes.
        unsafe { ctx.kernels.bias_act(ctx.stream, &p) }
    }
}

struct NormGpu {
    g: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
}

struct LayerGpu {
    qkv: DenseGpu,
    attn_out: DenseGpu,
    attn_norm: NormGpu,
    intermediate: DenseGpu,
    output: DenseGpu,
    out_norm: NormGpu,
}

/// A BERT prepared on the device.
pub(super) struct BertGpu {
    cfg: BertConfig,
    /// Values per row entering each layer and leaving the last (`Network::layer_bounds`).
    bounds: Vec<usize>,
    /// The word embeddings stay in pinned, mapped host memory (zero-copy, as `serve_embedding_gather`
    /// reads tables): a request reads its tokens' rows only, and the table (94 MB for BERT-base)
    /// takes no device memory.
    word: PinnedMapped<f32>,
    position: DeviceBuffer<f32>,
    type0: DeviceBuffer<f32>,
    embed_norm: NormGpu,
    layers: Vec<LayerGpu>,
    pooler: DenseGpu,
    max_batch: usize,
}

/// A worker's buffers, for `max_batch × seq_len` tokens.
pub(super) struct BertBuffers {
    /// ids, positions, spans (2 per token), each request's first token.
    desc: DeviceBuffer<u32>,
    x: DeviceBuffer<f32>,
    qkv: DeviceBuffer<f32>,
    ctx: DeviceBuffer<f32>,
    tmp: DeviceBuffer<f32>,
    inter: DeviceBuffer<f32>,
    scores: DeviceBuffer<f32>,
    firsts: DeviceBuffer<f32>,
    pooled: DeviceBuffer<f32>,
}

impl BertGpu {
    pub(super) fn new(
        device: &CudaDevice,
        stream: &Stream,
        net: &Network,
        max_batch: usize,
    ) -> Result<BertGpu> {
        let Network::Bert(m) = net else {
            return Err(Error::internal(format!("a bert runner cannot run a {} model", net.kind())));
        };
        let c = &m.cfg;
        dim(max_batch * c.seq_len * 4, "tokens of a task")?;
        let norm = |n: &crate::model::bert::Norm| -> Result<NormGpu> {
            Ok(NormGpu { g: stream.upload(&n.weight)?, b: stream.upload(&n.bias)? })
        };
        Ok(BertGpu {
            cfg: c.clone(),
            bounds: net.layer_bounds(),
            word: {
                let mut w = device.pinned_mapped(m.word.len())?;
                w.write(0, &m.word)?;
                w
            },
            position: stream.upload(&m.position)?,
            type0: stream.upload(&m.token_type[..c.hidden])?,
            embed_norm: norm(&m.embed_norm)?,
            layers: m
                .layers
                .iter()
                .map(|l| {
                    Ok(LayerGpu {
                        qkv: DenseGpu::new(stream, &[&l.query, &l.key, &l.value])?,
                        attn_out: DenseGpu::new(stream, &[&l.attn_out])?,
                        attn_norm: norm(&l.attn_norm)?,
                        intermediate: DenseGpu::new(stream, &[&l.intermediate])?,
                        output: DenseGpu::new(stream, &[&l.output])?,
                        out_norm: norm(&l.out_norm)?,
                    })
                })
                .collect::<Result<_>>()?,
            pooler: DenseGpu::new(stream, &[&m.pooler])?,
            max_batch,
        })
    }

    fn layer_count(&self) -> usize {
        self.bounds.len() - 1
    }

    /// `serve_layer_norm` of `rows × h`: `dst = LN(x + residual)`.
    fn norm(
        &self,
        ctx: &Ctx<'_>,
        n: &NormGpu,
        (x, residual, dst): (u64, u64, u64),
        rows: usize,
    ) -> Result<()> {
        let p = abi::LayerNormParams {
            x,
            residual,
            gamma: n.g.device_ptr(),
            beta: n.b.device_ptr(),
            dst,
            rows: rows as u32,
            cols: self.cfg.hidden as u32,
            eps: self.cfg.eps(),
            _pad0: 0,
        };
        // SAFETY: rows × h values of x, residual and dst (worker buffers sized for the largest
        // task), h of gamma and beta; dst may be x or residual (the kernel's contract).
        unsafe { ctx.kernels.layer_norm(ctx.stream, &p) }
    }

    fn encoder(&self, ctx: &mut Ctx<'_>, l: &LayerGpu, b: &mut BertBuffers, tokens: usize) -> Result<()> {
        let BertBuffers { desc, x, qkv, ctx: attn, tmp, inter, scores, .. } = b;
        l.qkv.run(ctx, x, qkv, tokens, abi::SERVE_ACT_NONE)?;
        let d = self.cfg.hidden / self.cfg.heads;
        let p = abi::AttentionParams {
            qkv: qkv.device_ptr(),
            spans: desc.device_ptr_at(2 * tokens),
            scores: scores.device_ptr(),
            ctx: attn.device_ptr(),
            tokens: tokens as u32,
            heads: self.cfg.heads as u32,
            head_dim: d as u32,
            max_len: self.cfg.seq_len as u32,
            scale: 1.0 / (d as f32).sqrt(),
            _pad0: 0,
        };
        // SAFETY: spans (written by `stage`, uploaded before) name each token's request within
        // the task's tokens, lengths ≤ seq_len; qkv holds tokens × 3h, scores tokens · heads ×
        // seq_len and ctx tokens × h (worker buffers sized for max_batch × seq_len tokens).
        unsafe { ctx.kernels.attention(ctx.stream, &p) }?;
        l.attn_out.run(ctx, attn, tmp, tokens, abi::SERVE_ACT_NONE)?;
        self.norm(ctx, &l.attn_norm, (tmp.device_ptr(), x.device_ptr(), x.device_ptr()), tokens)?;
        l.intermediate.run(ctx, x, inter, tokens, abi::SERVE_ACT_GELU)?;
        l.output.run(ctx, inter, tmp, tokens, abi::SERVE_ACT_NONE)?;
        self.norm(ctx, &l.out_norm, (tmp.device_ptr(), x.device_ptr(), x.device_ptr()), tokens)
    }
}

impl DeviceModel for BertGpu {
    type Buffers = BertBuffers;

    fn io_lens(&self) -> (usize, usize) {
        (self.bounds[0], self.bounds[self.layer_count()])
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn typical_needs(&self) -> Needs {
        Needs { desc: 4 * self.cfg.seq_len + 1, dense: 0, out: self.cfg.hidden, words: 0 }
    }

    fn buffers(&self, device: &CudaDevice, _stream: &Stream) -> Result<BertBuffers> {
        let c = &self.cfg;
        let (tokens, h) = (self.max_batch * c.seq_len, c.hidden);
        let f = |n: usize, w: usize, what: &str| device.alloc::<f32>(crate::backend::size(n, w, what)?);
        Ok(BertBuffers {
            desc: device.alloc(4 * tokens + self.max_batch)?,
            x: f(tokens, h, "bert activations")?,
            qkv: f(tokens, 3 * h, "bert q, k, v")?,
            ctx: f(tokens, h, "bert attention")?,
            tmp: f(tokens, h, "bert activations")?,
            inter: f(tokens, c.intermediate, "bert intermediate")?,
            scores: f(tokens * c.heads, c.seq_len, "bert attention scores")?,
            firsts: f(self.max_batch, h, "bert pooler input")?,
            pooled: f(self.max_batch, h, "bert pooler output")?,
        })
    }

    fn plan(&self, padded: usize, work: &Work) -> Result<Plan> {
        let (range, input) = work.layer_range(self.layer_count())?;
        let inl = self.bounds[range.0];
        if input.len() != padded * inl || padded > self.max_batch {
            return Err(Error::internal(format!(
                "a bert task of {padded} rows entering layer {} carries {} values, not {padded} × {inl}",
                range.0,
                input.len()
            )));
        }
        let lens: Vec<u32> =
            task_lens(&self.cfg, range.0, padded, input)?.into_iter().map(|l| l as u32).collect();
        let tokens: usize = lens.iter().map(|&l| l as usize).sum();
        let outl = self.bounds[range.1];
        Ok(Plan {
            needs: Needs {
                desc: 4 * tokens + padded,
                dense: if range.0 == 0 { 0 } else { tokens * self.cfg.hidden },
                out: padded * outl,
                words: 0,
            },
            padded,
            real: padded,
            outputs: padded * outl,
            layers: range,
            lens,
            ..Plan::default()
        })
    }

    fn stage(&self, work: &Work, plan: &Plan, st: &mut Staging, scratch: &mut Vec<u32>) -> Result<()> {
        let input: &[f32] = match work {
            Work::Dense(input) | Work::Layers { input, .. } => input,
            Work::Ring(r) => r.values(),
            Work::Cells(_) => return Err(Error::internal("a bert task must carry rows, not cells")),
        };
        let (first, last) = plan.layers;
        let tokens: usize = plan.lens.iter().map(|&l| l as usize).sum();
        let (inl, h) = (self.bounds[first], self.cfg.hidden);
        // The descriptor: ids, positions, spans, each row's first token (NO_TOKEN for an empty
        // padding row: the gather writes it a zero row).
        scratch.clear();
        scratch.resize(4 * tokens + plan.padded, 0);
        let (ids, rest) = scratch.split_at_mut(tokens);
        let (pos, rest) = rest.split_at_mut(tokens);
        let (spans, firsts) = rest.split_at_mut(2 * tokens);
        let mut t = 0;
        for (r, &len) in plan.lens.iter().enumerate() {
            let len = len as usize;
            firsts[r] = if len == 0 { abi::SERVE_NO_TOKEN } else { t as u32 };
            for p in 0..len {
                if first == 0 {
                    ids[t + p] = input[r * inl + p] as u32;
                }
                pos[t + p] = p as u32;
                spans[2 * (t + p)] = t as u32;
                spans[2 * (t + p) + 1] = len as u32;
            }
            t += len;
        }
        st.desc.write(0, scratch)?;
        if first > 0 {
            let mut t = 0;
            for (r, &len) in plan.lens.iter().enumerate() {
                let n = len as usize * h;
                st.dense.write(t, &input[r * inl..r * inl + n])?;
                t += n;
            }
        }
        if last < self.layer_count() {
            // Rows out: zeros past each request's tokens (written here) and its length; the
            // kernels write the tokens' values.
            let row = self.cfg.row_len();
            let mut blank = vec![0.0f32; row];
            for (r, &len) in plan.lens.iter().enumerate() {
                blank[row - 1] = len as f32;
                st.out.write(r * row, &blank)?;
            }
        }
        Ok(())
    }

    fn enqueue(&self, mut ctx: Ctx<'_>, b: &mut BertBuffers, plan: &Plan, st: &Staging) -> Result<()> {
        let (first, last) = plan.layers;
        let tokens: usize = plan.lens.iter().map(|&l| l as usize).sum();
        let rows = plan.padded;
        // SAFETY (both uploads): staging written only by `stage` before this, read only by these
        // copies, owned by the task until its counter is seen (runner.rs); needs.desc ≤ 4 ·
        // max_batch · seq_len + max_batch and needs.dense ≤ that many tokens × h: the buffers.
        unsafe { ctx.stream.upload_into_async(&mut b.desc, 0, host_slice(&st.desc, plan.needs.desc)) }?;
        if tokens > 0 {
            if first == 0 {
                let p = abi::BertEmbedParams {
                    ids: b.desc.device_ptr(),
                    positions: b.desc.device_ptr_at(tokens),
                    word: self.word.device_ptr(),
                    position: self.position.device_ptr(),
                    type0: self.type0.device_ptr(),
                    x: b.x.device_ptr(),
                    tokens: tokens as u32,
                    hidden: self.cfg.hidden as u32,
                    vocab: self.cfg.vocab as u32,
                    max_position: self.cfg.max_position as u32,
                };
                // SAFETY: tokens ids and positions (the descriptor), range-checked table rows,
                // tokens × h values of x.
                unsafe { ctx.kernels.bert_embed(ctx.stream, &p) }?;
                let x = b.x.device_ptr();
                self.norm(&ctx, &self.embed_norm, (x, 0, x), tokens)?;
            } else {
                // SAFETY: as the upload above.
                unsafe {
                    ctx.stream.upload_into_async(&mut b.x, 0, host_slice(&st.dense, plan.needs.dense))
                }?;
            }
            for layer in first.max(1)..last.min(self.layers.len() + 1) {
                self.encoder(&mut ctx, &self.layers[layer - 1], b, tokens)?;
            }
        }
        let h = self.cfg.hidden;
        if last == self.layer_count() {
            let p = abi::EmbeddingParams {
                table: b.x.device_ptr(),
                ids: b.desc.device_ptr_at(4 * tokens),
                out: b.firsts.device_ptr(),
                table_rows: tokens as u32,
                width: h as u32,
                batch: rows as u32,
                out_ld: h as u32,
                ..abi::EmbeddingParams::default()
            };
            // SAFETY: a row gather of `rows` first-token rows (ids < tokens, or NO_TOKEN: a zero
            // row) from x into firsts (max_batch × h).
            unsafe { ctx.kernels.embedding(ctx.stream, &p) }?;
            self.pooler.run(&mut ctx, &b.firsts, &mut b.pooled, rows, abi::SERVE_ACT_TANH)?;
            let p = bias_act_params(
                (b.pooled.device_ptr(), st.out.device_ptr()),
                0,
                (rows, h),
                abi::SERVE_ACT_NONE,
            )?;
            // SAFETY: rows × h values from pooled into the task's output staging (needs.out).
            unsafe { ctx.kernels.bias_act(ctx.stream, &p) }?;
        } else {
            let row = self.cfg.row_len();
            let mut t = 0;
            for (r, &len) in plan.lens.iter().enumerate() {
                let len = len as usize;
                if len > 0 {
                    let (src, dst) = (b.x.device_ptr_at(t * h), st.out.device_ptr() + (r * row * 4) as u64);
                    let p = bias_act_params((src, dst), 0, (len, h), abi::SERVE_ACT_NONE)?;
                    // SAFETY: the request's len × h token values into its output row (rows × row
                    // values of the staging: needs.out).
                    unsafe { ctx.kernels.bias_act(ctx.stream, &p) }?;
                }
                t += len;
            }
        }
        Ok(())
    }
}
