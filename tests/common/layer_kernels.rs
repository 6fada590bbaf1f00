//! Launch helpers of the layer models' kernels (`cuda/layers.cu`: im2col, layout change,
//! pooling, residual, LayerNorm, attention, BERT embeddings) for `tests/cuda_kernels_layers.rs`,
//! on either target of `common::cuda_kernels` ([`Dev`]). As there, each helper checks on the host
//! that every range the kernel's contract (`cuda/serve_kernels.h`) lets it touch lies inside the
//! buffers passed, then launches with the contract's block size; lifetimes and host access are as
//! the comment above `impl Dev` in `common::cuda_kernels` says.

use serve::backend::cuda::kernels::BLOCK;
use serve::backend::cuda::{LaunchConfig, abi, kernels};
use serve::model::resnet::conv_out;

use super::cuda_kernels::{Buf, Dev, fits, u32_of};

impl Dev {
    /// `serve_im2col` of `n` channels-last images `[n, h, w, c]` for a `k × k` convolution;
    /// returns `(oh, ow)`.
    #[allow(clippy::too_many_arguments)]
    pub fn im2col(
        &self,
        x: &Buf<f32>,
        (n, h, w, c): (usize, usize, usize, usize),
        (k, stride, pad): (usize, usize, usize),
        col: &Buf<f32>,
    ) -> (usize, usize) {
        let (oh, ow) = (conv_out(h, k, stride, pad), conv_out(w, k, stride, pad));
        fits("x", n * h * w * c, x.len());
        fits("col", n * oh * ow * k * k * c, col.len());
        let p = abi::Im2colParams {
            x: x.addr(),
            col: col.addr(),
            n: u32_of(n),
            h: u32_of(h),
            w: u32_of(w),
            c: u32_of(c),
            k: u32_of(k),
            stride: u32_of(stride),
            pad: u32_of(pad),
            oh: u32_of(oh),
            ow: u32_of(ow),
            _pad0: 0,
        };
        // SAFETY: serve_im2col takes one Im2colParams by value; it reads n·h·w·c values of x and
        // writes n·oh·ow·k·k·c of col, both checked above. Lifetimes: see the module comment.
        unsafe { self.launch(kernels::IM2COL, Self::cfg((n * oh * ow * k * k * c) as u64, BLOCK), &p) };
        (oh, ow)
    }

    /// `serve_chw_to_hwc` of `n` images.
    pub fn chw_to_hwc(&self, src: &Buf<f32>, (n, c, h, w): (usize, usize, usize, usize), dst: &Buf<f32>) {
        fits("src", n * c * h * w, src.len());
        fits("dst", n * c * h * w, dst.len());
        let p = abi::ChwToHwcParams {
            src: src.addr(),
            dst: dst.addr(),
            n: u32_of(n),
            c: u32_of(c),
            h: u32_of(h),
            w: u32_of(w),
        };
        // SAFETY: reads and writes n·c·h·w values of src and dst (checked). See the module comment.
        unsafe { self.launch(kernels::CHW_TO_HWC, Self::cfg((n * c * h * w) as u64, BLOCK), &p) };
    }

    /// `serve_max_pool` (3×3, stride 2, pad 1); returns `(oh, ow)`.
    pub fn max_pool(
        &self,
        x: &Buf<f32>,
        (n, h, w, c): (usize, usize, usize, usize),
        out: &Buf<f32>,
    ) -> (usize, usize) {
        let (oh, ow) = (conv_out(h, 3, 2, 1), conv_out(w, 3, 2, 1));
        fits("x", n * h * w * c, x.len());
        fits("out", n * oh * ow * c, out.len());
        let p = abi::MaxPoolParams {
            x: x.addr(),
            out: out.addr(),
            n: u32_of(n),
            h: u32_of(h),
            w: u32_of(w),
            c: u32_of(c),
            oh: u32_of(oh),
            ow: u32_of(ow),
        };
        // SAFETY: reads n·h·w·c of x, writes n·oh·ow·c of out (checked). See the module comment.
        unsafe { self.launch(kernels::MAX_POOL, Self::cfg((n * oh * ow * c) as u64, BLOCK), &p) };
        (oh, ow)
    }

    /// `serve_avg_pool` over `positions` positions.
    pub fn avg_pool(&self, x: &Buf<f32>, (n, positions, c): (usize, usize, usize), out: &Buf<f32>) {
        fits("x", n * positions * c, x.len());
        fits("out", n * c, out.len());
        let p = abi::AvgPoolParams {
            x: x.addr(),
            out: out.addr(),
            n: u32_of(n),
            positions: u32_of(positions),
            c: u32_of(c),
            _pad0: 0,
        };
        // SAFETY: reads n·positions·c of x, writes n·c of out (checked). See the module comment.
        unsafe { self.launch(kernels::AVG_POOL, Self::cfg((n * c) as u64, BLOCK), &p) };
    }

    /// `serve_add_relu`: `dst = max(a + b, 0)` over `n` values (`dst` may be `a`).
    pub fn add_relu(&self, a: &Buf<f32>, b: &Buf<f32>, dst: &Buf<f32>, n: usize) {
        fits("a", n, a.len());
        fits("b", n, b.len());
        fits("dst", n, dst.len());
        let p = abi::AddReluParams { a: a.addr(), b: b.addr(), dst: dst.addr(), n: n as u64 };
        // SAFETY: reads n values of a and b, writes n of dst (checked; dst may alias a, elementwise).
        // See the module comment.
        unsafe { self.launch(kernels::ADD_RELU, Self::cfg(n as u64, BLOCK), &p) };
    }

    /// `serve_layer_norm` of `rows × cols` (with an optional residual; `dst` may be `x`).
    #[allow(clippy::too_many_arguments)]
    pub fn layer_norm(
        &self,
        x: &Buf<f32>,
        residual: Option<&Buf<f32>>,
        (gamma, beta): (&Buf<f32>, &Buf<f32>),
        dst: &Buf<f32>,
        (rows, cols): (usize, usize),
        eps: f32,
    ) {
        fits("x", rows * cols, x.len());
        fits("dst", rows * cols, dst.len());
        fits("gamma", cols, gamma.len());
        fits("beta", cols, beta.len());
        if let Some(r) = residual {
            fits("residual", rows * cols, r.len());
        }
        let p = abi::LayerNormParams {
            x: x.addr(),
            residual: residual.map_or(0, |r| r.addr()),
            gamma: gamma.addr(),
            beta: beta.addr(),
            dst: dst.addr(),
            rows: u32_of(rows),
            cols: u32_of(cols),
            eps,
            _pad0: 0,
        };
        // SAFETY: reads rows·cols of x (and residual) and cols of gamma and beta, writes rows·cols
        // of dst (checked; dst may be x: each row is read in full before it is written). See the module comment.
        unsafe { self.launch(kernels::LAYER_NORM, LaunchConfig::linear(u32_of(rows.max(1)), BLOCK), &p) };
    }

    /// `serve_attention` over `spans` (start, length per token), `heads` heads of `head_dim`.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        qkv: &Buf<f32>,
        spans: &Buf<u32>,
        (tokens, heads, head_dim, max_len): (usize, usize, usize, usize),
        scores: &Buf<f32>,
        ctx: &Buf<f32>,
    ) {
        fits("qkv", tokens * 3 * heads * head_dim, qkv.len());
        fits("spans", 2 * tokens, spans.len());
        // Every span names rows of this task, no longer than the scores rows.
        let host = self.download(spans).unwrap();
        for t in 0..tokens {
            let (start, len) = (host[2 * t] as usize, host[2 * t + 1] as usize);
            assert!(start + len <= tokens && len <= max_len, "token {t}: span {start}+{len}");
        }
        fits("scores", tokens * heads * max_len, scores.len());
        fits("ctx", tokens * heads * head_dim, ctx.len());
        let p = abi::AttentionParams {
            qkv: qkv.addr(),
            spans: spans.addr(),
            scores: scores.addr(),
            ctx: ctx.addr(),
            tokens: u32_of(tokens),
            heads: u32_of(heads),
            head_dim: u32_of(head_dim),
            max_len: u32_of(max_len),
            scale: 1.0 / (head_dim as f32).sqrt(),
            _pad0: 0,
        };
        // SAFETY: the spans name rows start..start+len ≤ tokens with len ≤ max_len (checked above);
        // the kernel reads those qkv rows, writes each (token, head)'s scores row and the token's
        // ctx row (sizes checked). See the module comment.
        unsafe {
            self.launch(kernels::ATTENTION, LaunchConfig::linear(u32_of((tokens * heads).max(1)), BLOCK), &p)
        };
    }

    /// `serve_bert_embed` of `tokens` tokens.
    #[allow(clippy::too_many_arguments)]
    pub fn bert_embed(
        &self,
        (ids, positions): (&Buf<u32>, &Buf<u32>),
        (word, position, type0): (&Buf<f32>, &Buf<f32>, &Buf<f32>),
        x: &Buf<f32>,
        (tokens, hidden, vocab, max_position): (usize, usize, usize, usize),
    ) {
        fits("ids", tokens, ids.len());
        fits("positions", tokens, positions.len());
        fits("word", vocab * hidden, word.len());
        fits("position", max_position * hidden, position.len());
        fits("type0", hidden, type0.len());
        fits("x", tokens * hidden, x.len());
        let p = abi::BertEmbedParams {
            ids: ids.addr(),
            positions: positions.addr(),
            word: word.addr(),
            position: position.addr(),
            type0: type0.addr(),
            x: x.addr(),
            tokens: u32_of(tokens),
            hidden: u32_of(hidden),
            vocab: u32_of(vocab),
            max_position: u32_of(max_position),
        };
        // SAFETY: reads tokens ids and positions, table rows only at range-checked indices, hidden
        // values of type0, writes tokens·hidden of x (checked). See the module comment.
        unsafe { self.launch(kernels::BERT_EMBED, Self::cfg((tokens * hidden) as u64, BLOCK), &p) };
    }
}
