//! One LSTM layer step of a cellular batch (BatchMaker), as the CUDA kernels will do it: a gather
//! kernel builds `X = [x_t | h_{t-1}]` for the batch from the layer input and the state arena
//! (indexed by each request's slot), one GEMM computes `G = X · [W_ih | W_hh]ᵀ`, and a fused
//! pointwise kernel adds both biases, applies the gates (PyTorch's order `i, f, g, o`) and
//! scatters `c_t`, `h_t` back to the arena slots. Also the decoder's helpers: embedding gather and
//! the output projection with a per-row argmax.
//!
//! A batch is `padded` rows, of which the first `rows.len()` are real requests; padding rows are
//! computed like the others (their cost is real on a device too) from a zero state, but never
//! scattered.
//!
//! **Token-gate tables.** A layer that reads an embedding (layer 0 of a chain) may be *folded*
//! ([`LstmLayer::fold_embedding`]): `E · W_ihᵀ + b_ih + b_hh` is computed once, at prepare, for
//! every token of the vocabulary, so a step looks its rows up instead of multiplying — the GEMM
//! shrinks from `[x | h] · [W_ih | W_hh]ᵀ` to `h · W_hhᵀ` (half the work at `input = H`, and half
//! the weight bytes a small batch streams). It trades memory (`vocab × 4H` values) for it; the
//! runner folds only within the model's budget (`ModelOptions::token_gates_bytes`).

use rayon::prelude::*;

use crate::backend::cpu::activation::{sigmoid, tanh};
use crate::backend::cpu::arena::StateArena;
use crate::backend::cpu::gemm::{PackedWeight, Threads, linear, matmul};
use crate::backend::{grow, size};
use crate::error::{Code, Error, Result};

// `NO_TOKEN`: the token id of a row without a token (a padding row, or a request not decoding
// this step); its embedding is a zero row.
use crate::model::NO_TOKEN;

/// Below this many state values (`padded × hidden`) a step's gather and pointwise kernels run on
/// the calling thread even when more threads are allowed.
pub const PARALLEL_MIN_VALUES: usize = 1 << 14;

/// Values each parallel task of the gather / pointwise kernels handles at least.
const TASK_MIN_VALUES: usize = 1 << 12;

/// Floating-point operations of one layer step's GEMM for `batch` rows: `2·b·(input+H)·4H`.
pub fn step_flops(batch: usize, input: usize, hidden: usize) -> f64 {
    2.0 * batch as f64 * (input + hidden) as f64 * 4.0 * hidden as f64
}

/// Rows per parallel task for rows of `width` values.
fn task_rows(width: usize) -> usize {
    TASK_MIN_VALUES.div_ceil(width.max(1))
}

/// One `torch.nn.LSTM` layer, packed for [`lstm_layer_step`]: `[W_ih | W_hh]` (`[4H, input+H]`)
/// as a single [`PackedWeight`] and the summed bias `b_ih + b_hh` — or, folded with its
/// embedding, `W_hh` alone and the token-gate table.
#[derive(Clone, Debug, PartialEq)]
pub struct LstmLayer {
    /// `[W_ih | W_hh]`, or `W_hh` when `token_gates` is set.
    w: PackedWeight,
    bias: Vec<f32>,
    input: usize,
    hidden: usize,
    /// Folded: row `v` (`4H` values) is `embedding[v] · W_ihᵀ + b_ih + b_hh`.
    token_gates: Option<Vec<f32>>,
}

/// Check PyTorch's tensors of one layer against its sizes and return the summed bias
/// `b_ih + b_hh`. Panics if a length does not match or `hidden` is 0.
fn checked_bias(
    w_ih: &[f32],
    w_hh: &[f32],
    b_ih: &[f32],
    b_hh: &[f32],
    input: usize,
    hidden: usize,
) -> Vec<f32> {
    assert!(hidden > 0, "an LSTM layer needs a hidden size");
    let n = 4 * hidden;
    assert_eq!(w_ih.len(), n * input, "weight_ih holds {} values, [{n}, {input}] needs", w_ih.len());
    assert_eq!(w_hh.len(), n * hidden, "weight_hh holds {} values, [{n}, {hidden}] needs", w_hh.len());
    assert_eq!(b_ih.len(), n, "bias_ih length");
    assert_eq!(b_hh.len(), n, "bias_hh length");
    b_ih.iter().zip(b_hh).map(|(a, b)| a + b).collect()
}

/// What a layer step reads as its input `x`.
#[derive(Clone, Copy, Debug)]
pub enum StepInput<'a> {
    /// `padded × input` values: an embedding gathered by [`embed_rows`], or the layer below's `h`
    /// (an unfolded layer).
    Values(&'a [f32]),
    /// `padded` token ids ([`NO_TOKEN`] for none: a zero embedding), looked up in a folded
    /// layer's token-gate table.
    Tokens(&'a [u32]),
}

impl LstmLayer {
    /// Pack a layer from PyTorch's tensors: `weight_ih [4H, input]`, `weight_hh [4H, H]`,
    /// `bias_ih [4H]`, `bias_hh [4H]` (gate chunks in the order `i, f, g, o`).
    ///
    /// Panics if a tensor's length does not match the sizes or `hidden` is 0.
    pub fn from_torch(
        w_ih: &[f32],
        w_hh: &[f32],
        b_ih: &[f32],
        b_hh: &[f32],
        input: usize,
        hidden: usize,
    ) -> LstmLayer {
        let bias = checked_bias(w_ih, w_hh, b_ih, b_hh, input, hidden);
        let (n, k) = (4 * hidden, input + hidden);
        let mut w = Vec::with_capacity(n * k);
        for j in 0..n {
            w.extend_from_slice(&w_ih[j * input..(j + 1) * input]);
            w.extend_from_slice(&w_hh[j * hidden..(j + 1) * hidden]);
        }
        LstmLayer {
            w: PackedWeight::from_torch(&w, n, k).with_panels(),
            bias,
            input,
            hidden,
            token_gates: None,
        }
    }

    /// Pack a layer whose input is row `token` of `embedding` (`[vocab, input]`), folding the
    /// input projection into a token-gate table (`vocab × 4H` values, computed here on the
    /// calling thread's rayon pool with up to `threads` threads). Fails with
    /// [`Code::Unavailable`] when the table cannot be allocated.
    ///
    /// Panics as [`from_torch`](Self::from_torch) does, or if `embedding` is not `vocab × input`.
    #[allow(clippy::too_many_arguments)]
    pub fn fold_embedding(
        w_ih: &[f32],
        w_hh: &[f32],
        b_ih: &[f32],
        b_hh: &[f32],
        embedding: &[f32],
        input: usize,
        hidden: usize,
        threads: Threads,
    ) -> Result<LstmLayer> {
        let bias = checked_bias(w_ih, w_hh, b_ih, b_hh, input, hidden);
        assert!(
            input > 0 && embedding.len().is_multiple_of(input),
            "embedding of {} values, rows of {input}",
            embedding.len()
        );
        let vocab = embedding.len() / input;
        let n = 4 * hidden;
        let mut table = Vec::new();
        grow(&mut table, size(vocab, n, "token-gate table")?, "token-gate table")?;
        matmul(embedding, &PackedWeight::from_torch(w_ih, n, input), &mut table, vocab, false, threads);
        for row in table.chunks_exact_mut(n) {
            row.iter_mut().zip(&bias).for_each(|(v, b)| *v += b);
        }
        let w = PackedWeight::from_torch(w_hh, n, hidden).with_panels();
        Ok(LstmLayer { w, bias, input, hidden, token_gates: Some(table) })
    }

    /// Bytes of the token-gate table folding a `vocab`-token embedding into a layer of hidden
    /// size `hidden` would take (saturating).
    pub fn token_gates_bytes(vocab: usize, hidden: usize) -> usize {
        vocab.saturating_mul(hidden).saturating_mul(16)
    }

    /// Whether the layer reads token ids ([`StepInput::Tokens`]) through its token-gate table.
    pub fn is_folded(&self) -> bool {
        self.token_gates.is_some()
    }

    /// Input features.
    pub fn input(&self) -> usize {
        self.input
    }

    /// Hidden size `H`.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

/// A real row of a step: the request's state slot, and whether this is its first step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LstmRow {
    /// The arena slot holding the request's `h` and `c`.
    pub slot: u32,
    /// First step of the sequence: the previous `h` and `c` are zero (the slot is not read).
    pub fresh: bool,
}

/// Buffers of [`lstm_layer_step`], reused across steps (one per stream).
#[derive(Clone, Debug, Default)]
pub struct LstmScratch {
    /// `X = [x | h_prev]`, `padded × (input + H)`.
    x: Vec<f32>,
    /// Gate pre-activations without bias, `padded × 4H`.
    g: Vec<f32>,
    /// `c_prev`, then `c`, `padded × H`.
    c: Vec<f32>,
}

impl LstmScratch {
    /// Empty buffers; [`reserve`](Self::reserve) them when the model is prepared.
    pub fn new() -> LstmScratch {
        LstmScratch::default()
    }

    /// Grow the buffers for steps of up to `max_rows` (padded) rows of a layer with these sizes,
    /// or fail with [`Code::Unavailable`] (instead of aborting) when memory is short. Calling it
    /// for each layer of a model sizes the buffers for all of them.
    pub fn reserve(&mut self, max_rows: usize, input: usize, hidden: usize) -> Result<()> {
        let what = "LSTM step buffers";
        let k = input.checked_add(hidden).ok_or_else(|| Error::new(Code::Unavailable, "LSTM too wide"))?;
        grow(&mut self.x, size(max_rows, k, what)?, what)?;
        grow(&mut self.g, size(max_rows, size(4, hidden, what)?, what)?, what)?;
        grow(&mut self.c, size(max_rows, hidden, what)?, what)
    }
}

/// Make sure `v` holds `len` values (steps not covered by a `reserve` grow on demand).
fn ensure(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// One step of one LSTM layer for a batch of `padded` rows.
///
/// `x` is `padded × input` values (the caller zero-fills padding rows), or, for a folded layer,
/// `padded` token ids (padding rows [`NO_TOKEN`]); `rows` are the real rows
/// (`rows.len() ≤ padded`), in batch order. Row `r`'s previous state is read from slot
/// `rows[r].slot` of `arena` — `h` at `offset..offset+H`, `c` at `offset+H..offset+2H` — or is
/// zero when `fresh`; padding rows start from zero. Every row's new `h` goes to `h_out`
/// (`padded × H`, the next layer's input); real rows' `h` and `c` are written back to their slot.
///
/// Parallel over `threads` when the batch is large enough: call it inside the backend pool's
/// `install`. Panics if a slice is shorter than its shape says or a slot is out of range.
#[allow(clippy::too_many_arguments)]
pub fn lstm_layer_step(
    layer: &LstmLayer,
    x: StepInput<'_>,
    rows: &[LstmRow],
    padded: usize,
    arena: &StateArena,
    offset: usize,
    scratch: &mut LstmScratch,
    h_out: &mut [f32],
    threads: Threads,
) {
    let hd = layer.hidden;
    // Values of `x` each row of X starts with: none when the input comes through the table.
    let (input, x, ids) = match (x, &layer.token_gates) {
        (StepInput::Values(x), None) => {
            assert!(
                x.len() >= padded * layer.input,
                "x holds {} values, needs {}",
                x.len(),
                padded * layer.input
            );
            (layer.input, x, &[][..])
        }
        (StepInput::Tokens(ids), Some(table)) => {
            assert!(ids.len() >= padded, "{} token ids for {padded} rows", ids.len());
            let vocab = table.len() / (4 * hd);
            if let Some(&bad) = ids[..padded].iter().find(|&&t| t != NO_TOKEN && t as usize >= vocab) {
                panic!("token id {bad} out of range: the token-gate table has {vocab} rows");
            }
            (0, &[][..], ids)
        }
        (StepInput::Values(_), Some(_)) => panic!("a folded layer reads token ids"),
        (StepInput::Tokens(_), None) => panic!("an unfolded layer reads values"),
    };
    let k = input + hd;
    assert!(rows.len() <= padded, "{} rows in a batch padded to {padded}", rows.len());
    assert!(h_out.len() >= padded * hd, "h_out holds {} values, needs {}", h_out.len(), padded * hd);
    assert!(
        offset.checked_add(2 * hd).is_some_and(|end| end <= arena.width()),
        "LSTM state {offset}..{offset}+2·{hd} does not fit slots of {} values",
        arena.width()
    );
    if padded == 0 {
        return;
    }
    ensure(&mut scratch.x, padded * k);
    ensure(&mut scratch.g, padded * 4 * hd);
    ensure(&mut scratch.c, padded * hd);
    let xs = &mut scratch.x[..padded * k];
    let g = &mut scratch.g[..padded * 4 * hd];
    let c = &mut scratch.c[..padded * hd];
    let h_out = &mut h_out[..padded * hd];
    let parallel = threads.0 > 1 && padded * hd >= PARALLEL_MIN_VALUES;

    // Gather: X = [x | h_prev], c_prev.
    let gather = |r: usize, (xr, cr): (&mut [f32], &mut [f32])| {
        let (xin, hprev) = xr.split_at_mut(input);
        xin.copy_from_slice(&x[r * input..(r + 1) * input]);
        match rows.get(r) {
            Some(row) if !row.fresh => {
                arena.read(row.slot, offset, hprev);
                arena.read(row.slot, offset + hd, cr);
            }
            _ => {
                hprev.fill(0.0);
                cr.fill(0.0);
            }
        }
    };
    if parallel {
        xs.par_chunks_mut(k)
            .zip(c.par_chunks_mut(hd))
            .with_min_len(task_rows(k))
            .enumerate()
            .for_each(|(r, bufs)| gather(r, bufs));
    } else {
        xs.chunks_exact_mut(k).zip(c.chunks_exact_mut(hd)).enumerate().for_each(|(r, bufs)| gather(r, bufs));
    }

    // G = X · [W_ih | W_hh]ᵀ, or h_prev · W_hhᵀ folded (the biases, or the token's gates, are
    // added by the pointwise kernel).
    matmul(xs, &layer.w, g, padded, false, threads);

    // Pointwise + scatter.
    let gates = |r: usize| match (&layer.token_gates, ids.get(r)) {
        (Some(table), Some(&t)) if t != NO_TOKEN => &table[t as usize * 4 * hd..][..4 * hd],
        _ => &layer.bias[..],
    };
    let point = |r: usize, ((gr, cr), hr): ((&[f32], &mut [f32]), &mut [f32])| {
        lstm_pointwise(gr, gates(r), cr, hr);
        if let Some(row) = rows.get(r) {
            arena.write(row.slot, offset, hr);
            arena.write(row.slot, offset + hd, cr);
        }
    };
    if parallel {
        g.par_chunks(4 * hd)
            .zip(c.par_chunks_mut(hd))
            .zip(h_out.par_chunks_mut(hd))
            .with_min_len(task_rows(4 * hd))
            .enumerate()
            .for_each(|(r, bufs)| point(r, bufs));
    } else {
        g.chunks_exact(4 * hd)
            .zip(c.chunks_exact_mut(hd))
            .zip(h_out.chunks_exact_mut(hd))
            .enumerate()
            .for_each(|(r, bufs)| point(r, bufs));
    }
}

/// The narrowest hidden size the AVX2 build of the pointwise kernel is used for. Its loop is
/// vectorised 8 lanes wide, so a narrower row never fills a vector and runs the polynomial `exp`
/// scalar, while the baseline build's 4 lanes still fill: at h = 4 the step cost 26.3k
/// instructions per request through the AVX2 build against 18.0k through the baseline build
/// (callgrind, `throughput_probe 10|20 lstm`; ARCHITECTURE.md §8.5).
const AVX2_MIN_HIDDEN: usize = 8;

/// One row's gates: `g` (4H pre-activations without bias), `bias` (4H), `c` (`c_prev` in, `c`
/// out), `h` (out). Compiled twice: for the baseline target and, chosen at run time for rows of
/// at least [`AVX2_MIN_HIDDEN`], with AVX2 and FMA (the pointwise kernel is a third of a large
/// step's time at h = 256 otherwise).
#[inline]
fn lstm_pointwise(g: &[f32], bias: &[f32], c: &mut [f32], h: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if h.len() >= AVX2_MIN_HIDDEN
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: `lstm_pointwise_avx2` requires only that the CPU has AVX2 and FMA, checked
        // just above; its body is the safe `lstm_pointwise_rows`.
        unsafe { lstm_pointwise_avx2(g, bias, c, h) };
        return;
    }
    lstm_pointwise_rows(g, bias, c, h);
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2,fma")]
fn lstm_pointwise_avx2(g: &[f32], bias: &[f32], c: &mut [f32], h: &mut [f32]) {
    lstm_pointwise_rows(g, bias, c, h);
}

#[inline(always)]
fn lstm_pointwise_rows(g: &[f32], bias: &[f32], c: &mut [f32], h: &mut [f32]) {
    let hd = h.len();
    // Every slice cut to exactly `hd` up front: the indexed loop below then has no bounds checks
    // and vectorizes, and a row costs no iterator set-up (a zip of ten slices cost more than the
    // arithmetic at h = 4).
    let (gi, gf, gg, go) = (&g[..hd], &g[hd..2 * hd], &g[2 * hd..3 * hd], &g[3 * hd..4 * hd]);
    let (bi, bf, bg, bo) = (&bias[..hd], &bias[hd..2 * hd], &bias[2 * hd..3 * hd], &bias[3 * hd..4 * hd]);
    let c = &mut c[..hd];
    for j in 0..hd {
        let i = sigmoid(gi[j] + bi[j]);
        let f = sigmoid(gf[j] + bf[j]);
        let gc = tanh(gg[j] + bg[j]);
        let o = sigmoid(go[j] + bo[j]);
        let cj = f * c[j] + i * gc;
        c[j] = cj;
        h[j] = o * tanh(cj);
    }
}

/// Embedding gather: row `r` of `out` (`ids.len() × width`) is row `ids[r]` of `table`
/// (`[vocab, width]` row-major), or zeros for [`NO_TOKEN`].
///
/// Ids are validated by the caller: panics on an id beyond the table.
pub fn embed_rows(table: &[f32], width: usize, ids: &[u32], out: &mut [f32]) {
    assert!(out.len() >= ids.len() * width, "out holds {} values, needs {}", out.len(), ids.len() * width);
    if width == 0 {
        return;
    }
    for (&id, o) in ids.iter().zip(out.chunks_exact_mut(width)) {
        if id == NO_TOKEN {
            o.fill(0.0);
        } else {
            let start = id as usize * width;
            assert!(
                start + width <= table.len(),
                "token id {id} out of range: the embedding table has {} rows",
                table.len() / width
            );
            o.copy_from_slice(&table[start..start + width]);
        }
    }
}

/// An output projection `torch.nn.Linear(H, vocab)`, for [`project_argmax`].
#[derive(Clone, Debug, PartialEq)]
pub struct Projection {
    w: PackedWeight,
    b: Vec<f32>,
}

impl Projection {
    /// Pack PyTorch's `weight [vocab, H]` and `bias [vocab]`; `vocab` is `bias.len()`.
    ///
    /// Panics if `bias` is empty, `vocab` does not fit a `u32` token id, or `weight` is not
    /// `vocab × H` values.
    pub fn from_torch(weight: &[f32], bias: &[f32]) -> Projection {
        let vocab = bias.len();
        assert!(vocab > 0 && vocab < NO_TOKEN as usize, "projection vocabulary of {vocab} tokens");
        assert!(
            weight.len().is_multiple_of(vocab),
            "projection weight of {} values for {vocab} tokens",
            weight.len()
        );
        let hidden = weight.len() / vocab;
        Projection { w: PackedWeight::from_torch(weight, vocab, hidden), b: bias.to_vec() }
    }

    /// Output tokens.
    pub fn vocab(&self) -> usize {
        self.w.n()
    }

    /// Input features `H`.
    pub fn hidden(&self) -> usize {
        self.w.k()
    }
}

/// `logits = h · Wᵀ + b` for `rows` rows of `h` (`rows × H`), then each row's argmax (the lowest
/// id among equal maxima; NaN logits are ignored) into `out_tokens[..rows]`. `logits` is scratch
/// of at least `rows × vocab` values.
///
/// Parallel over `threads` when large enough: call it inside the backend pool's `install`.
pub fn project_argmax(
    p: &Projection,
    h: &[f32],
    rows: usize,
    logits: &mut [f32],
    out_tokens: &mut [u32],
    threads: Threads,
) {
    let vocab = p.vocab();
    assert!(out_tokens.len() >= rows, "out_tokens holds {} ids, needs {rows}", out_tokens.len());
    assert!(logits.len() >= rows * vocab, "logits hold {} values, needs {}", logits.len(), rows * vocab);
    linear(h, &p.w, &p.b, logits, rows, false, threads);
    let logits = &logits[..rows * vocab];
    let out = &mut out_tokens[..rows];
    if threads.0 > 1 && rows * vocab >= PARALLEL_MIN_VALUES {
        out.par_iter_mut()
            .zip(logits.par_chunks(vocab))
            .with_min_len(task_rows(vocab))
            .for_each(|(t, l)| *t = argmax(l));
    } else {
        out.iter_mut().zip(logits.chunks_exact(vocab)).for_each(|(t, l)| *t = argmax(l));
    }
}

/// Index of the first maximum, ignoring NaN (0 if every value is NaN or −∞): the decoder's
/// greedy choice, which the CUDA kernel reproduces.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = (0usize, f32::NEG_INFINITY);
    for (i, &x) in v.iter().enumerate() {
        if x > best.1 {
            best = (i, x);
        }
    }
    best.0 as u32
}

#[cfg(test)]
mod tests;
