//! BERT's encoder on the CPU (ARCHITECTURE.md §5.2, `model::bert`): the embeddings, encoder
//! layers and pooler over the **real tokens** of each request only.
//!
//! Between layers a request's row is `seq_len × hidden` values (its tokens' hidden states, the
//! positions past its length unused) followed by its length as an f32. A range of encoder layers
//! works on the tokens of every request of the task packed back to back (`[T, hidden]`, `T` the
//! task's total length): every dense layer is one GEMM over all of them, attention runs per
//! request and head over that request's tokens — what `BertModel` computes for a padded batch
//! with an attention mask, without the padding.

use rayon::prelude::*;

use crate::backend::cpu::gemm::{PackedWeight, Threads, View, linear, matmul_strided};
use crate::backend::grow;
use crate::error::Result;
use crate::model::bert::{Bert, BertConfig, Norm, task_lens};
use crate::model::mlp::Linear;

/// Token rows per parallel chunk of the pointwise passes.
const ROWS_PER_CHUNK: usize = 16;

/// A dense layer ready to run.
#[derive(Debug)]
struct Dense {
    w: PackedWeight,
    b: Vec<f32>,
}

impl Dense {
    fn new(l: &Linear) -> Dense {
        Dense { w: PackedWeight::from_torch(&l.weight, l.out_features, l.in_features), b: l.bias.clone() }
    }

    /// `[q; k; v]` as one `3h × h` layer.
    fn stacked(parts: &[&Linear]) -> Dense {
        let w: Vec<f32> = parts.iter().flat_map(|l| l.weight.iter().copied()).collect();
        let b: Vec<f32> = parts.iter().flat_map(|l| l.bias.iter().copied()).collect();
        let n: usize = parts.iter().map(|l| l.out_features).sum();
        Dense { w: PackedWeight::from_torch(&w, n, parts[0].in_features), b }
    }

    fn run(&self, x: &[f32], rows: usize, out: &mut [f32], threads: Threads) {
        linear(x, &self.w, &self.b, out, rows, false, threads);
    }
}

#[derive(Debug)]
struct Layer {
    qkv: Dense,
    attn_out: Dense,
    attn_norm: Norm,
    intermediate: Dense,
    output: Dense,
    out_norm: Norm,
}

/// A BERT prepared for the CPU.
#[derive(Debug)]
pub struct BertCpu {
    cfg: BertConfig,
    word: Vec<f32>,
    position: Vec<f32>,
    token_type0: Vec<f32>,
    embed_norm: Norm,
    layers: Vec<Layer>,
    pooler: Dense,
}

/// Buffers of one stream, grown to the largest task seen: each at most `max_batch × seq_len`
/// token rows of the model's widths (the activations themselves), the attention's scores one
/// `seq_len²` block per compute thread.
#[derive(Default)]
pub struct BertScratch {
    x: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    tmp: Vec<f32>,
    inter: Vec<f32>,
    /// Each (request, head)'s attention output, before it goes into `ctx`.
    scores: Vec<f32>,
}

/// The first `n` values of `v`, grown to hold them (UNAVAILABLE, not an abort, when memory is
/// short).
fn part<'a>(v: &'a mut Vec<f32>, n: usize, what: &str) -> Result<&'a mut [f32]> {
    grow(v, n, what)?;
    Ok(&mut v[..n])
}

impl BertCpu {
    pub fn new(m: &Bert) -> BertCpu {
        let h = m.cfg.hidden;
        BertCpu {
            cfg: m.cfg.clone(),
            word: m.word.clone(),
            position: m.position.clone(),
            token_type0: m.token_type[..h].to_vec(),
            embed_norm: m.embed_norm.clone(),
            layers: m
                .layers
                .iter()
                .map(|l| Layer {
                    qkv: Dense::stacked(&[&l.query, &l.key, &l.value]),
                    attn_out: Dense::new(&l.attn_out),
                    attn_norm: l.attn_norm.clone(),
                    intermediate: Dense::new(&l.intermediate),
                    output: Dense::new(&l.output),
                    out_norm: l.out_norm.clone(),
                })
                .collect(),
            pooler: Dense::new(&m.pooler),
        }
    }

    /// Run layers `first..last` (0 the embeddings, `1..=L` the encoder layers, `L + 1` the
    /// pooler) over `rows` rows of `input` into `out`, each row as `Network::layer_bounds` says:
    /// `seq_len` token ids (−1 past the request's end) entering the embeddings, a
    /// [`BertConfig::row_len`] row between layers, `hidden` values leaving the pooler.
    pub fn run(
        &self,
        (first, last): (usize, usize),
        rows: usize,
        input: &[f32],
        out: &mut [f32],
        s: &mut BertScratch,
        threads: Threads,
    ) -> Result<()> {
        let h = self.cfg.hidden;
        let row_len = self.cfg.row_len();
        let pooler = self.layers.len() + 1;
        // Each row's length (checked as on CUDA) and where its tokens start in the packed `x`.
        let lens = task_lens(&self.cfg, first, rows, input)?;
        let starts: Vec<usize> = lens
            .iter()
            .scan(0, |acc, &l| {
                let s = *acc;
                *acc += l;
                Some(s)
            })
            .collect();
        let tokens: usize = lens.iter().sum();
        let x = part(&mut s.x, tokens * h, "bert activations")?;
        if first == 0 {
            self.embed(input, &lens, &starts, x);
        } else {
            for r in 0..rows {
                x[starts[r] * h..(starts[r] + lens[r]) * h]
                    .copy_from_slice(&input[r * row_len..r * row_len + lens[r] * h]);
            }
        }
        for layer in first.max(1)..last.min(pooler) {
            self.encoder_layer(&self.layers[layer - 1], &lens, &starts, s, threads)?;
        }
        let x = &s.x[..tokens * h];
        if last == pooler + 1 {
            // The pooler: each request's first token.
            // (A padding row — no tokens — pools a zero vector; its output is never delivered.)
            let mut firsts = vec![0.0f32; rows * h];
            for r in (0..rows).filter(|&r| lens[r] > 0) {
                firsts[r * h..(r + 1) * h].copy_from_slice(&x[starts[r] * h..(starts[r] + 1) * h]);
            }
            self.pooler.run(&firsts, rows, &mut out[..rows * h], threads);
            out[..rows * h].iter_mut().for_each(|v| *v = v.tanh());
        } else {
            for r in 0..rows {
                let row = &mut out[r * row_len..(r + 1) * row_len];
                row[..lens[r] * h].copy_from_slice(&x[starts[r] * h..(starts[r] + lens[r]) * h]);
                row[lens[r] * h..].fill(0.0);
                row[row_len - 1] = lens[r] as f32;
            }
        }
        Ok(())
    }

    /// word + position + token type 0, then LayerNorm, for every real token.
    fn embed(&self, ids: &[f32], lens: &[usize], starts: &[usize], x: &mut [f32]) {
        let h = self.cfg.hidden;
        for (r, (&len, &start)) in lens.iter().zip(starts).enumerate() {
            for p in 0..len {
                let id = ids[r * self.cfg.seq_len + p] as usize;
                let dst = &mut x[(start + p) * h..(start + p + 1) * h];
                let (w, pos) = (&self.word[id * h..(id + 1) * h], &self.position[p * h..(p + 1) * h]);
                for j in 0..h {
                    dst[j] = w[j] + pos[j] + self.token_type0[j];
                }
                layer_norm(dst, &self.embed_norm, self.cfg.eps());
            }
        }
    }

    fn encoder_layer(
        &self,
        l: &Layer,
        lens: &[usize],
        starts: &[usize],
        s: &mut BertScratch,
        threads: Threads,
    ) -> Result<()> {
        let (h, heads, eps) = (self.cfg.hidden, self.cfg.heads, self.cfg.eps());
        let d = h / heads;
        let tokens: usize = lens.iter().sum();
        let x = &s.x[..tokens * h];
        let qkv = part(&mut s.qkv, tokens * 3 * h, "bert q, k, v")?;
        l.qkv.run(x, tokens, qkv, threads);
        let qkv: &[f32] = qkv;
        let longest = lens.iter().copied().max().unwrap_or(0);
        // Attention per (request, head): the scores q·kᵀ / √d (`len × len`, in a block of the
        // thread's own), softmax over the keys, then p·v (`len × d`) into the pair's own part of
        // `heads_out` (request after request, head after head: `tokens × hidden` values in all),
        // copied into the request's rows and the head's columns of `ctx` once every pair is done.
        let pairs: Vec<(usize, usize)> =
            (0..lens.len()).flat_map(|r| (0..heads).map(move |hd| (r, hd))).collect();
        let heads_out = part(&mut s.scores, tokens * h, "bert attention")?;
        let mut parts: Vec<&mut [f32]> = Vec::with_capacity(pairs.len());
        let mut rest: &mut [f32] = heads_out;
        for &(r, _) in &pairs {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(lens[r] * d);
            parts.push(part);
            rest = tail;
        }
        let scale = 1.0 / (d as f32).sqrt();
        let attend = |sc: &mut Vec<f32>, (&(r, hd), out): (&(usize, usize), &mut &mut [f32])| {
            let (len, start) = (lens[r], starts[r]);
            if len == 0 {
                return;
            }
            sc.resize(len * len, 0.0);
            let sc = &mut sc[..len * len];
            let q = View { offset: start * 3 * h + hd * d, rows: len, cols: d, rs: 3 * h, cs: 1 };
            let kt = View { offset: start * 3 * h + h + hd * d, rows: d, cols: len, rs: 1, cs: 3 * h };
            let sv = View { offset: 0, rows: len, cols: len, rs: len, cs: 1 };
            matmul_strided((qkv, q), (qkv, kt), (&mut *sc, sv), scale, Threads(1));
            for row in sc.chunks_exact_mut(len) {
                softmax(row);
            }
            let v = View { offset: start * 3 * h + 2 * h + hd * d, rows: len, cols: d, rs: 3 * h, cs: 1 };
            let ov = View { offset: 0, rows: len, cols: d, rs: d, cs: 1 };
            matmul_strided((&*sc, sv), (qkv, v), (&mut **out, ov), 1.0, Threads(1));
        };
        let block = longest * longest;
        if threads.0 > 1 {
            pairs.par_iter().zip(parts.par_iter_mut()).for_each_init(|| Vec::with_capacity(block), attend);
        } else {
            let mut sc = Vec::with_capacity(block);
            pairs.iter().zip(parts.iter_mut()).for_each(|p| attend(&mut sc, p));
        }
        let ctx = part(&mut s.ctx, tokens * h, "bert attention")?;
        let mut at = 0;
        for &(r, hd) in &pairs {
            let (len, start) = (lens[r], starts[r]);
            let out = &s.scores[at..at + len * d];
            for t in 0..len {
                ctx[(start + t) * h + hd * d..][..d].copy_from_slice(&out[t * d..(t + 1) * d]);
            }
            at += len * d;
        }
        let x = &mut s.x[..tokens * h];
        // x = LN(x + ctx·W_oᵀ + b_o)
        let tmp = part(&mut s.tmp, tokens * h, "bert activations")?;
        l.attn_out.run(ctx, tokens, tmp, threads);
        add_norm(x, tmp, &l.attn_norm, eps, h, threads);
        // x = LN(x + GELU(x·W_iᵀ + b_i)·W_o2ᵀ + b_o2)
        let inter = part(&mut s.inter, tokens * self.cfg.intermediate, "bert intermediate")?;
        l.intermediate.run(x, tokens, inter, threads);
        gelu_all(inter, threads);
        l.output.run(inter, tokens, tmp, threads);
        add_norm(x, tmp, &l.out_norm, eps, h, threads);
        Ok(())
    }
}

/// Softmax of one row in place (max subtracted first).
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    row.iter_mut().for_each(|v| *v *= inv);
}

/// LayerNorm of one row in place: `(x − mean) / √(var + eps) · γ + β` (biased variance; sums in
/// f64).
pub fn layer_norm(x: &mut [f32], n: &Norm, eps: f32) {
    let len = x.len() as f64;
    let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / len;
    let var = x.iter().map(|&v| (f64::from(v) - mean).powi(2)).sum::<f64>() / len;
    let inv = 1.0 / (var + f64::from(eps)).sqrt();
    for ((v, &g), &b) in x.iter_mut().zip(&n.weight).zip(&n.bias) {
        *v = ((f64::from(*v) - mean) * inv) as f32 * g + b;
    }
}

/// `x = LN(x + y)` row by row.
fn add_norm(x: &mut [f32], y: &[f32], n: &Norm, eps: f32, h: usize, threads: Threads) {
    let f = |(xr, yr): (&mut [f32], &[f32])| {
        for row in 0..xr.len() / h {
            let (xs, ys) = (&mut xr[row * h..(row + 1) * h], &yr[row * h..(row + 1) * h]);
            xs.iter_mut().zip(ys).for_each(|(a, &b)| *a += b);
            layer_norm(xs, n, eps);
        }
    };
    let chunk = ROWS_PER_CHUNK * h;
    if threads.0 > 1 {
        x.par_chunks_mut(chunk).zip(y.par_chunks(chunk)).for_each(f);
    } else {
        x.chunks_mut(chunk).zip(y.chunks(chunk)).for_each(f);
    }
}

/// GELU, exact: `0.5 · x · (1 + erf(x / √2))`.
pub fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + libm::erff(x * std::f32::consts::FRAC_1_SQRT_2))
}

fn gelu_all(v: &mut [f32], threads: Threads) {
    if threads.0 > 1 {
        v.par_chunks_mut(4096).for_each(|c| c.iter_mut().for_each(|x| *x = gelu(*x)));
    } else {
        v.iter_mut().for_each(|x| *x = gelu(*x));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_softmax_and_layer_norm_match_their_definitions() {
        // erf(1/√2) = 0.682689492…: GELU(1) = 0.841344746…
        assert!((gelu(1.0) - 0.841_344_7).abs() < 1e-6);
        assert!((gelu(-1.0) + 0.158_655_3).abs() < 1e-6);
        assert_eq!(gelu(0.0), 0.0);
        let mut r = [1.0, 2.0, 3.0, 1000.0];
        softmax(&mut r);
        assert!((r[3] - 1.0).abs() < 1e-6 && r[0] >= 0.0, "{r:?}");
        let mut r = [0.0, (2.0f32).ln()];
        softmax(&mut r);
        assert!((r[0] - 1.0 / 3.0).abs() < 1e-6 && (r[1] - 2.0 / 3.0).abs() < 1e-6);
        let mut x = [1.0, 2.0, 3.0, 4.0];
        layer_norm(&mut x, &Norm { weight: vec![2.0; 4], bias: vec![1.0; 4] }, 0.0);
        // mean 2.5, var 1.25: (x − 2.5)/√1.25 · 2 + 1
        let want = [1.0, 2.0, 3.0, 4.0].map(|v: f64| ((v - 2.5) / 1.25f64.sqrt() * 2.0 + 1.0) as f32);
        for (a, b) in x.iter().zip(want) {
            assert!((a - b).abs() < 1e-6, "{x:?}");
        }
    }
}
