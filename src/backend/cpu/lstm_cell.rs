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
        assert!(hidden > 0, "an LSTM layer needs a hidden size");
        let (n, k) = (4 * hidden, input + hidden);
        assert_eq!(w_ih.len(), n * input, "weight_ih holds {} values, [{n}, {input}] needs", w_ih.len());
        assert_eq!(w_hh.len(), n * hidden, "weight_hh holds {} values, [{n}, {hidden}] needs", w_hh.len());
        assert_eq!(b_ih.len(), n, "bias_ih length");
        assert_eq!(b_hh.len(), n, "bias_hh length");
        let mut w = Vec::with_capacity(n * k);
        for j in 0..n {
            w.extend_from_slice(&w_ih[j * input..(j + 1) * input]);
            w.extend_from_slice(&w_hh[j * hidden..(j + 1) * hidden]);
        }
        LstmLayer {
            w: PackedWeight::from_torch(&w, n, k).with_panels(),
            bias: b_ih.iter().zip(b_hh).map(|(a, b)| a + b).collect(),
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
        let unfolded = LstmLayer::from_torch(w_ih, w_hh, b_ih, b_hh, input, hidden);
        assert!(
            input > 0 && embedding.len() % input == 0,
            "embedding of {} values, rows of {input}",
            embedding.len()
        );
        let vocab = embedding.len() / input;
        let n = 4 * hidden;
        let mut table = Vec::new();
        grow(&mut table, size(vocab, n, "token-gate table")?, "token-gate table")?;
        matmul(embedding, &PackedWeight::from_torch(w_ih, n, input), &mut table, vocab, false, threads);
        for row in table.chunks_exact_mut(n) {
            row.iter_mut().zip(&unfolded.bias).for_each(|(v, b)| *v += b);
        }
        Ok(LstmLayer {
            w: PackedWeight::from_torch(w_hh, n, hidden).with_panels(),
            token_gates: Some(table),
            ..unfolded
        })
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

/// One row's gates: `g` (4H pre-activations without bias), `bias` (4H), `c` (`c_prev` in, `c`
/// out), `h` (out). Compiled twice: for the baseline target and, chosen at run time, with AVX2 and
/// FMA (the pointwise kernel is a third of a large step's time at h = 256 otherwise).
#[inline]
fn lstm_pointwise(g: &[f32], bias: &[f32], c: &mut [f32], h: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
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
    let (gi, rest) = g[..4 * hd].split_at(hd);
    let (gf, rest) = rest.split_at(hd);
    let (gg, go) = rest.split_at(hd);
    let (bi, rest) = bias[..4 * hd].split_at(hd);
    let (bf, rest) = rest.split_at(hd);
    let (bg, bo) = rest.split_at(hd);
    let c = &mut c[..hd];
    // Equal-length zips: no bounds checks, so the loop vectorizes.
    let gates = gi.iter().zip(gf).zip(gg).zip(go);
    let biases = bi.iter().zip(bf).zip(bg).zip(bo);
    for ((((gi, gf), gg), go), ((((bi, bf), bg), bo), (c, h))) in
        gates.zip(biases.zip(c.iter_mut().zip(h.iter_mut())))
    {
        let i = sigmoid(gi + bi);
        let f = sigmoid(gf + bf);
        let gc = tanh(gg + bg);
        let o = sigmoid(go + bo);
        let cj = f * *c + i * gc;
        *c = cj;
        *h = o * tanh(cj);
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
        assert!(weight.len() % vocab == 0, "projection weight of {} values for {vocab} tokens", weight.len());
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
mod tests {
    use super::*;
    use crate::backend::cpu::test_util::{Pool, pool, slot_values};
    use crate::workload::values;

    /// PyTorch's tensors of one layer.
    struct Torch {
        w_ih: Vec<f32>,
        w_hh: Vec<f32>,
        b_ih: Vec<f32>,
        b_hh: Vec<f32>,
        input: usize,
        hidden: usize,
    }

    impl Torch {
        fn new(input: usize, hidden: usize, seed: u64) -> Torch {
            let s = 1.0 / (hidden as f32).sqrt();
            Torch {
                w_ih: values(4 * hidden * input, seed, s),
                w_hh: values(4 * hidden * hidden, seed + 1, s),
                b_ih: values(4 * hidden, seed + 2, s),
                b_hh: values(4 * hidden, seed + 3, s),
                input,
                hidden,
            }
        }
        fn layer(&self) -> LstmLayer {
            LstmLayer::from_torch(&self.w_ih, &self.w_hh, &self.b_ih, &self.b_hh, self.input, self.hidden)
        }

        /// The reference cell in f64: (h, c) from x, h_prev, c_prev.
        fn cell(&self, x: &[f32], h: &[f64], c: &[f64]) -> (Vec<f64>, Vec<f64>) {
            let (inp, hd) = (self.input, self.hidden);
            let gate = |j: usize| {
                let mut acc = self.b_ih[j] as f64 + self.b_hh[j] as f64;
                let wi = &self.w_ih[j * inp..(j + 1) * inp];
                let wh = &self.w_hh[j * hd..(j + 1) * hd];
                acc += wi.iter().zip(x).map(|(&w, &v)| w as f64 * v as f64).sum::<f64>();
                acc += wh.iter().zip(h).map(|(&w, &v)| w as f64 * v).sum::<f64>();
                acc
            };
            let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
            let (mut h2, mut c2) = (vec![0.0; hd], vec![0.0; hd]);
            for j in 0..hd {
                let (i, f, g, o) =
                    (sig(gate(j)), sig(gate(hd + j)), gate(2 * hd + j).tanh(), sig(gate(3 * hd + j)));
                c2[j] = f * c[j] + i * g;
                h2[j] = o * c2[j].tanh();
            }
            (h2, c2)
        }
    }

    fn close(got: f32, want: f64) -> bool {
        (got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0)
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(close(g, w), "{what}[{j}]: got {g}, want {w}");
        }
    }

    /// Several steps of one layer over `n` requests in a `padded` batch, with scrambled slots,
    /// restarts and untouched slots, against the f64 reference.
    fn run_sequence(input: usize, hidden: usize, n: usize, padded: usize, threads: Threads, pool: &Pool) {
        let t = Torch::new(input, hidden, 11 + n as u64);
        let layer = t.layer();
        assert_eq!((layer.input(), layer.hidden()), (input, hidden));
        // State lives at offset 3 of slots of 2H + 5 values; the requests use the first n slots
        // of a scrambled list of 2n + 3, the others must stay untouched.
        let slots = 2 * n + 3;
        let offset = 3;
        let arena = StateArena::new(slots, 2 * hidden + 5).unwrap();
        let sentinel: Vec<Vec<f32>> =
            (0..slots).map(|s| values(arena.width(), 100 + s as u64, 9.0)).collect();
        for (s, v) in sentinel.iter().enumerate() {
            arena.write(s as u32, 0, v);
        }
        let mut order: Vec<u32> = (0..slots as u32).collect();
        order.sort_by_key(|&s| (s as u64 * 2_654_435_761) % 1009);
        let used = &order[..n];
        let mut scratch = LstmScratch::new();
        scratch.reserve(padded, input, hidden).unwrap();
        let mut state: Vec<(Vec<f64>, Vec<f64>)> = vec![(vec![0.0; hidden], vec![0.0; hidden]); n];
        for step in 0..4 {
            // Step 0: everyone fresh; step 2: every third request restarts.
            let fresh: Vec<bool> = (0..n).map(|r| step == 0 || (step == 2 && r % 3 == 1)).collect();
            let rows: Vec<LstmRow> = (0..n).map(|r| LstmRow { slot: used[r], fresh: fresh[r] }).collect();
            let mut x = values(padded * input, 1000 + step, 1.0);
            x[n * input..].fill(0.0);
            let mut h_out = vec![f32::NAN; padded * hidden];
            pool.install(|| {
                lstm_layer_step(
                    &layer,
                    StepInput::Values(&x),
                    &rows,
                    padded,
                    &arena,
                    offset,
                    &mut scratch,
                    &mut h_out,
                    threads,
                )
            });
            for r in 0..padded {
                let zero = vec![0.0; hidden];
                let (hp, cp) = if r < n && !fresh[r] { (&state[r].0, &state[r].1) } else { (&zero, &zero) };
                let (h, c) = t.cell(&x[r * input..(r + 1) * input], hp, cp);
                let what = format!("n={n} padded={padded} {threads:?} step {step} row {r}");
                assert_close(&h_out[r * hidden..(r + 1) * hidden], &h, &format!("{what} h_out"));
                if r < n {
                    let slot = slot_values(&arena, used[r]);
                    assert_close(&slot[offset..offset + hidden], &h, &format!("{what} slot h"));
                    assert_close(&slot[offset + hidden..offset + 2 * hidden], &c, &format!("{what} slot c"));
                    assert_eq!(
                        &slot[..offset],
                        &sentinel[used[r] as usize][..offset],
                        "{what}: before the state"
                    );
                    assert_eq!(
                        &slot[offset + 2 * hidden..],
                        &sentinel[used[r] as usize][offset + 2 * hidden..],
                        "{what}: after the state"
                    );
                    state[r] = (h, c);
                }
            }
            for &s in &order[n..] {
                assert_eq!(slot_values(&arena, s), sentinel[s as usize], "untouched slot {s}");
            }
        }
    }

    #[test]
    fn lstm_step_matches_reference_for_batch_sizes() {
        let pool = pool();
        let sizes: &[(usize, usize)] =
            if cfg!(miri) { &[(1, 1), (3, 4)] } else { &[(1, 1), (3, 4), (17, 24), (64, 64), (64, 67)] };
        for &(n, padded) in sizes {
            for threads in pool.threads() {
                run_sequence(5, 7, n, padded, threads, &pool);
            }
        }
    }

    #[test]
    fn lstm_step_parallel_kernels_match_reference() {
        if cfg!(miri) {
            return;
        }
        // padded × H ≥ PARALLEL_MIN_VALUES: the gather and pointwise kernels run on the pool.
        let pool = pool();
        const { assert!(256 * 64 >= PARALLEL_MIN_VALUES) };
        for threads in pool.threads() {
            run_sequence(24, 64, 250, 256, threads, &pool);
        }
    }

    #[test]
    fn lstm_rows_use_scrambled_slots_and_leave_others_untouched() {
        let (input, hidden) = (3, 4);
        let t = Torch::new(input, hidden, 5);
        let layer = t.layer();
        // Layer 1 of a two-layer model: its state at offset 2H of 4H-value slots.
        let arena = StateArena::new(10, 4 * hidden).unwrap();
        for s in 0..10 {
            arena.write(s, 0, &vec![s as f32 + 0.5; 4 * hidden]);
        }
        let rows = [7, 2, 5].map(|slot| LstmRow { slot, fresh: false });
        let x = values(4 * input, 3, 1.0);
        let mut h_out = vec![0.0; 4 * hidden];
        let mut scratch = LstmScratch::new();
        lstm_layer_step(
            &layer,
            StepInput::Values(&x),
            &rows,
            4,
            &arena,
            2 * hidden,
            &mut scratch,
            &mut h_out,
            Threads(1),
        );
        for (r, row) in rows.iter().enumerate() {
            let prev = vec![row.slot as f64 + 0.5; hidden];
            let (h, c) = t.cell(&x[r * input..(r + 1) * input], &prev, &prev);
            let slot = slot_values(&arena, row.slot);
            assert_eq!(
                &slot[..2 * hidden],
                &vec![row.slot as f32 + 0.5; 2 * hidden][..],
                "layer 0 state kept"
            );
            assert_close(&slot[2 * hidden..3 * hidden], &h, "h");
            assert_close(&slot[3 * hidden..], &c, "c");
            assert_close(&h_out[r * hidden..(r + 1) * hidden], &h, "h_out");
        }
        for s in [0, 1, 3, 4, 6, 8, 9] {
            assert_eq!(slot_values(&arena, s), vec![s as f32 + 0.5; 4 * hidden], "slot {s}");
        }
    }

    #[test]
    fn two_layer_sequence_feeds_h_out_forward() {
        let (embed, hidden, vocab, n, padded) = (6, 5, 9, 3, 4);
        let l0 = Torch::new(embed, hidden, 21);
        let l1 = Torch::new(hidden, hidden, 31);
        let (layer0, layer1) = (l0.layer(), l1.layer());
        let table = values(vocab * embed, 41, 1.0);
        let arena = StateArena::new(6, 4 * hidden).unwrap();
        let slots = [4u32, 0, 3];
        let mut scratch = LstmScratch::new();
        scratch.reserve(padded, embed, hidden).unwrap();
        scratch.reserve(padded, hidden, hidden).unwrap();
        let zero = vec![0.0f64; hidden];
        let mut want: Vec<[(Vec<f64>, Vec<f64>); 2]> =
            vec![[(zero.clone(), zero.clone()), (zero.clone(), zero)]; n];
        let pool = pool();
        let threads = *pool.threads().last().unwrap();
        for step in 0..5u32 {
            // Request 2 joins at step 2; its row is empty (NO_TOKEN) before.
            let ids: Vec<u32> =
                (0..padded as u32)
                    .map(|r| {
                        if r as usize >= n || (r == 2 && step < 2) {
                            NO_TOKEN
                        } else {
                            (r * 5 + step * 3) % 9
                        }
                    })
                    .collect();
            let active = if step < 2 { 2 } else { 3 };
            let rows: Vec<LstmRow> = (0..active)
                .map(|r| LstmRow { slot: slots[r], fresh: step == 0 || (r == 2 && step == 2) })
                .collect();
            let mut x = vec![f32::NAN; padded * embed];
            embed_rows(&table, embed, &ids, &mut x);
            let (mut h0, mut h1) = (vec![0.0; padded * hidden], vec![0.0; padded * hidden]);
            pool.install(|| {
                lstm_layer_step(
                    &layer0,
                    StepInput::Values(&x),
                    &rows,
                    padded,
                    &arena,
                    0,
                    &mut scratch,
                    &mut h0,
                    threads,
                );
                lstm_layer_step(
                    &layer1,
                    StepInput::Values(&h0),
                    &rows,
                    padded,
                    &arena,
                    2 * hidden,
                    &mut scratch,
                    &mut h1,
                    threads,
                );
            });
            for (r, row) in rows.iter().enumerate() {
                if row.fresh {
                    want[r].iter_mut().for_each(|s| s.0.iter_mut().chain(&mut s.1).for_each(|v| *v = 0.0));
                }
                let xr = &table[ids[r] as usize * embed..][..embed];
                let (ha, ca) = l0.cell(xr, &want[r][0].0, &want[r][0].1);
                let ha32: Vec<f32> = ha.iter().map(|&v| v as f32).collect();
                let (hb, cb) = l1.cell(&ha32, &want[r][1].0, &want[r][1].1);
                assert_close(&h0[r * hidden..(r + 1) * hidden], &ha, &format!("step {step} row {r} layer 0"));
                assert_close(&h1[r * hidden..(r + 1) * hidden], &hb, &format!("step {step} row {r} layer 1"));
                want[r] = [(ha, ca), (hb, cb)];
            }
        }
    }

    /// A folded layer 0 (token-gate table) computes what the unfolded layer computes from the
    /// gathered embedding: fresh and continuing rows, a row without a token (zero embedding),
    /// padding rows, scrambled slots, several steps, one thread and the pool.
    #[test]
    fn folded_layer_matches_the_embedding_and_unfolded_layer() {
        let (embed, hidden, vocab, padded) = (6, 5, 11, 5);
        let t = Torch::new(embed, hidden, 51);
        let table = values(vocab * embed, 52, 1.0);
        let pool = pool();
        for threads in pool.threads() {
            let folded = pool
                .install(|| {
                    LstmLayer::fold_embedding(
                        &t.w_ih, &t.w_hh, &t.b_ih, &t.b_hh, &table, embed, hidden, threads,
                    )
                })
                .unwrap();
            assert!(folded.is_folded() && !t.layer().is_folded());
            assert_eq!((folded.input(), folded.hidden()), (embed, hidden));
            let arena = StateArena::new(8, 2 * hidden).unwrap();
            let slots = [6u32, 1, 3];
            let mut want = vec![(vec![0.0f64; hidden], vec![0.0f64; hidden]); 3];
            let mut scratch = LstmScratch::new();
            for step in 0..4u32 {
                // Row 1 has no token at step 1 (its input is a zero embedding).
                let ids: Vec<u32> = (0..padded as u32)
                    .map(|r| match r {
                        3.. => NO_TOKEN,
                        1 if step == 1 => NO_TOKEN,
                        _ => (r * 7 + step * 3) % vocab as u32,
                    })
                    .collect();
                let rows: Vec<LstmRow> = slots
                    .iter()
                    .enumerate()
                    .map(|(r, &slot)| LstmRow { slot, fresh: step == 0 || (r == 2 && step == 2) })
                    .collect();
                let mut h_out = vec![f32::NAN; padded * hidden];
                pool.install(|| {
                    lstm_layer_step(
                        &folded,
                        StepInput::Tokens(&ids),
                        &rows,
                        padded,
                        &arena,
                        0,
                        &mut scratch,
                        &mut h_out,
                        threads,
                    )
                });
                let mut x = vec![0.0; padded * embed];
                embed_rows(&table, embed, &ids, &mut x);
                for r in 0..padded {
                    let zero = vec![0.0; hidden];
                    let fresh = rows.get(r).is_none_or(|row| row.fresh);
                    let (hp, cp) = if fresh { (&zero, &zero) } else { (&want[r].0, &want[r].1) };
                    let (h, c) = t.cell(&x[r * embed..(r + 1) * embed], hp, cp);
                    let what = format!("{threads:?} step {step} row {r}");
                    assert_close(&h_out[r * hidden..(r + 1) * hidden], &h, &what);
                    if r < rows.len() {
                        let slot = slot_values(&arena, slots[r]);
                        assert_close(&slot[..hidden], &h, &format!("{what} slot h"));
                        assert_close(&slot[hidden..], &c, &format!("{what} slot c"));
                        want[r] = (h, c);
                    }
                }
            }
        }
        assert_eq!(LstmLayer::token_gates_bytes(30_000, 256), 30_000 * 4 * 256 * 4);
        assert_eq!(LstmLayer::token_gates_bytes(usize::MAX, 2), usize::MAX);
    }

    /// One step of a small folded layer (vocab 11, input 2, hidden 3) on one fresh row.
    fn folded_step(x: StepInput<'_>) {
        let t = Torch::new(2, 3, 1);
        let layer =
            LstmLayer::fold_embedding(&t.w_ih, &t.w_hh, &t.b_ih, &t.b_hh, &[0.5; 22], 2, 3, Threads(1))
                .unwrap();
        let arena = StateArena::new(1, 6).unwrap();
        let rows = [LstmRow { slot: 0, fresh: true }];
        let mut h = [0.0; 3];
        lstm_layer_step(&layer, x, &rows, 1, &arena, 0, &mut LstmScratch::new(), &mut h, Threads(1));
    }

    #[test]
    #[should_panic(expected = "token id 11 out of range")]
    fn folded_layer_panics_on_a_token_beyond_its_table() {
        folded_step(StepInput::Tokens(&[11]));
    }

    #[test]
    #[should_panic(expected = "a folded layer reads token ids")]
    fn folded_layer_refuses_values() {
        folded_step(StepInput::Values(&[0.0; 2]));
    }

    #[test]
    fn embed_rows_gathers_and_zeroes_no_token() {
        let table: Vec<f32> = (0..12).map(|v| v as f32).collect(); // 4 rows of 3
        let mut out = vec![f32::NAN; 4 * 3];
        embed_rows(&table, 3, &[3, NO_TOKEN, 0, 3], &mut out);
        assert_eq!(out, [9.0, 10.0, 11.0, 0.0, 0.0, 0.0, 0.0, 1.0, 2.0, 9.0, 10.0, 11.0]);
        embed_rows(&table, 0, &[7], &mut []);
    }

    #[test]
    #[should_panic(expected = "token id 4 out of range")]
    fn embed_rows_panics_on_bad_id() {
        embed_rows(&[0.0; 12], 3, &[4], &mut [0.0; 3]);
    }

    #[test]
    fn project_argmax_matches_reference_and_breaks_ties_low() {
        let pool = pool();
        for &(rows, hidden, vocab) in &[(1, 3, 5), (3, 7, 11), (17, 8, 40), (64, 16, 300)] {
            if cfg!(miri) && rows > 3 {
                continue;
            }
            let w = values(vocab * hidden, 7, 1.0);
            let b = values(vocab, 8, 0.5);
            let h = values(rows * hidden, 9, 1.0);
            let p = Projection::from_torch(&w, &b);
            assert_eq!((p.vocab(), p.hidden()), (vocab, hidden));
            for threads in pool.threads() {
                let mut logits = vec![0.0; rows * vocab];
                let mut out = vec![u32::MAX; rows + 1];
                pool.install(|| project_argmax(&p, &h, rows, &mut logits, &mut out, threads));
                assert_eq!(out[rows], u32::MAX, "only `rows` tokens written");
                for r in 0..rows {
                    let l: Vec<f64> = (0..vocab)
                        .map(|v| {
                            b[v] as f64
                                + (0..hidden)
                                    .map(|i| w[v * hidden + i] as f64 * h[r * hidden + i] as f64)
                                    .sum::<f64>()
                        })
                        .collect();
                    let best = (0..vocab).fold(0, |a, v| if l[v] > l[a] { v } else { a });
                    // The f32 winner may differ from f64's only on a near-tie.
                    let got = out[r] as usize;
                    assert!(got == best || (l[best] - l[got]).abs() <= 1e-5, "row {r}: {got} vs {best}");
                }
            }
        }
        // Exact ties: zero weights, equal biases at ids 1, 3 and 4 → 1.
        let p = Projection::from_torch(&[0.0; 10], &[0.0, 2.0, 1.0, 2.0, 2.0]);
        let mut out = [0u32; 2];
        project_argmax(&p, &[1.0, -1.0, 3.0, 4.0], 2, &mut [0.0; 10], &mut out, Threads(1));
        assert_eq!(out, [1, 1]);
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[f32::NAN; 3]), 0);
    }

    #[test]
    fn scratch_reserve_reports_unavailable() {
        let mut s = LstmScratch::new();
        assert_eq!(s.reserve(usize::MAX / 2, 1024, 1024).unwrap_err().code(), Code::Unavailable);
        s.reserve(4, 3, 2).unwrap();
        assert!(s.x.len() >= 20 && s.g.len() >= 32 && s.c.len() >= 8);
    }

    #[test]
    fn step_flops_counts_the_gemm() {
        assert_eq!(step_flops(512, 1024, 1024), 2.0 * 512.0 * 2048.0 * 4096.0);
    }
}
