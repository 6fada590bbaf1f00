//! Convolutions and pooling on the CPU, channels-last (ARCHITECTURE.md §5.2): a batch of images is
//! `[n, h, w, c]` (NHWC), so that a convolution is one GEMM over every output position of the
//! batch — `out[pos, o] = col[pos, (ky, kx, c)] · W[o, (ky, kx, c)]ᵀ + b[o]` — with the
//! BatchNorm already folded into `W` and `b` (`model::resnet::Conv::folded`). A 1×1 convolution of
//! stride 1 reads its input as it lies; every other one first gathers each output position's
//! patch (`im2col`, zeros outside the image).

use rayon::prelude::*;

use crate::backend::cpu::gemm::{PackedWeight, Threads, linear};
use crate::model::resnet::{Conv, Geometry, conv_out};

/// Positions per parallel chunk of the pointwise passes.
const CHUNK: usize = 4096;

/// A convolution with its BatchNorm folded, ready to run.
#[derive(Debug)]
pub struct ConvLayer {
    pub g: Geometry,
    w: PackedWeight,
    b: Vec<f32>,
}

impl ConvLayer {
    pub fn new(c: &Conv) -> ConvLayer {
        let (w, b) = c.folded();
        let g = c.g;
        ConvLayer { g, w: PackedWeight::from_torch(&w, g.out_c, g.k * g.k * g.in_c), b }
    }

    /// `out = act(conv(x))` for `n` images `[n, h, w, in_c]`; `out` gets `[n, oh, ow, out_c]`,
    /// `col` holds at least `n ×` [`Geometry::col_len`] values. Returns `(oh, ow)`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        x: &[f32],
        (n, h, w): (usize, usize, usize),
        out: &mut [f32],
        col: &mut [f32],
        relu: bool,
        threads: Threads,
    ) -> (usize, usize) {
        let g = self.g;
        let (oh, ow) = (g.out_side(h), g.out_side(w));
        let rows = n * oh * ow;
        let out = &mut out[..rows * g.out_c];
        if g.direct() {
            linear(&x[..rows * g.in_c], &self.w, &self.b, out, rows, relu, threads);
        } else {
            let col = &mut col[..n * g.col_len(h, w)];
            im2col(g, x, (h, w), (oh, ow), col, threads);
            linear(col, &self.w, &self.b, out, rows, relu, threads);
        }
        (oh, ow)
    }
}

/// Each output position's `k × k × c` patch (zeros where it leaves the image), position after
/// position.
fn im2col(
    l: Geometry,
    x: &[f32],
    (h, w): (usize, usize),
    (oh, ow): (usize, usize),
    col: &mut [f32],
    threads: Threads,
) {
    let (c, k) = (l.in_c, l.k);
    let kk = k * k * c;
    let fill = |(pos, patch): (usize, &mut [f32])| {
        let img = pos / (oh * ow);
        let (oy, ox) = ((pos / ow) % oh, pos % ow);
        let base = img * h * w * c;
        for ky in 0..k {
            let iy = (oy * l.stride + ky) as isize - l.pad as isize;
            for kx in 0..k {
                let ix = (ox * l.stride + kx) as isize - l.pad as isize;
                let dst = &mut patch[(ky * k + kx) * c..(ky * k + kx + 1) * c];
                if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                    dst.fill(0.0);
                } else {
                    let at = base + (iy as usize * w + ix as usize) * c;
                    dst.copy_from_slice(&x[at..at + c]);
                }
            }
        }
    };
    if threads.0 > 1 {
        col.par_chunks_mut(kk).enumerate().for_each(fill);
    } else {
        col.chunks_mut(kk).enumerate().for_each(fill);
    }
}

/// 3×3 max-pool, stride 2, padding 1 (padded positions never win, as PyTorch's −∞ padding):
/// `[n, h, w, c]` → `[n, oh, ow, c]`. Returns `(oh, ow)`.
pub fn max_pool_3x3_s2(
    x: &[f32],
    (n, h, w, c): (usize, usize, usize, usize),
    out: &mut [f32],
) -> (usize, usize) {
    let (oh, ow) = (conv_out(h, 3, 2, 1), conv_out(w, 3, 2, 1));
    for img in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                let dst = &mut out[((img * oh + oy) * ow + ox) * c..][..c];
                dst.fill(f32::NEG_INFINITY);
                for ky in 0..3 {
                    let iy = (oy * 2 + ky) as isize - 1;
                    if iy < 0 || iy as usize >= h {
                        continue;
                    }
                    for kx in 0..3 {
                        let ix = (ox * 2 + kx) as isize - 1;
                        if ix < 0 || ix as usize >= w {
                            continue;
                        }
                        let src = &x[((img * h + iy as usize) * w + ix as usize) * c..][..c];
                        for (d, &s) in dst.iter_mut().zip(src) {
                            // NaN propagates, as torch's max-pool does.
                            if s > *d || s.is_nan() {
                                *d = s;
                            }
                        }
                    }
                }
            }
        }
    }
    (oh, ow)
}

/// The mean over every position of each image and channel: `[n, h, w, c]` → `[n, c]`.
pub fn global_avg_pool(x: &[f32], (n, h, w, c): (usize, usize, usize, usize), out: &mut [f32]) {
    let positions = h * w;
    for img in 0..n {
        let dst = &mut out[img * c..(img + 1) * c];
        let mut acc = vec![0.0f64; c];
        for p in 0..positions {
            let src = &x[(img * positions + p) * c..][..c];
            acc.iter_mut().zip(src).for_each(|(a, &s)| *a += f64::from(s));
        }
        for (d, a) in dst.iter_mut().zip(acc) {
            *d = (a / positions as f64) as f32;
        }
    }
}

/// `out = relu(out + shortcut)` elementwise (a residual block's end).
pub fn add_relu(out: &mut [f32], shortcut: &[f32], threads: Threads) {
    let f = |(o, s): (&mut [f32], &[f32])| {
        o.iter_mut().zip(s).for_each(|(o, &s)| *o = (*o + s).max(0.0));
    };
    if threads.0 > 1 {
        out.par_chunks_mut(CHUNK).zip(shortcut.par_chunks(CHUNK)).for_each(f);
    } else {
        out.chunks_mut(CHUNK).zip(shortcut.chunks(CHUNK)).for_each(f);
    }
}

/// `n` images from CHW (the request's layout, torchvision's) to HWC.
pub fn chw_to_hwc(x: &[f32], (n, c, h, w): (usize, usize, usize, usize), out: &mut [f32]) {
    for img in 0..n {
        let src = &x[img * c * h * w..(img + 1) * c * h * w];
        let dst = &mut out[img * c * h * w..(img + 1) * c * h * w];
        for ch in 0..c {
            for p in 0..h * w {
                dst[p * c + ch] = src[ch * h * w + p];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{SeedableRng, rngs::StdRng};

    use super::*;

    /// A direct NCHW convolution in f64, the textbook loop.
    fn naive(x: &[f32], c: &Conv, n: usize, h: usize, w: usize) -> Vec<f64> {
        let Geometry { in_c, out_c, k, stride, pad } = c.g;
        let (oh, ow) = (c.g.out_side(h), c.g.out_side(w));
        let mut out = vec![0.0; n * out_c * oh * ow];
        for img in 0..n {
            for o in 0..out_c {
                let s = f64::from(c.bn.weight[o]) / (f64::from(c.bn.var[o]) + 1e-5).sqrt();
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = 0.0f64;
                        for ci in 0..in_c {
                            for ky in 0..k {
                                for kx in 0..k {
                                    let iy = (oy * stride + ky) as isize - pad as isize;
                                    let ix = (ox * stride + kx) as isize - pad as isize;
                                    if iy < 0 || ix < 0 || iy as usize >= h || ix as usize >= w {
                                        continue;
                                    }
                                    let xv = x[((img * in_c + ci) * h + iy as usize) * w + ix as usize];
                                    let wv = c.weight[((o * in_c + ci) * k + ky) * k + kx];
                                    acc += f64::from(xv) * f64::from(wv);
                                }
                            }
                        }
                        let v = (acc - f64::from(c.bn.mean[o])) * s + f64::from(c.bn.bias[o]);
                        out[((img * out_c + o) * oh + oy) * ow + ox] = v;
                    }
                }
            }
        }
        out
    }

    /// Every geometry the ResNets use (7×7/2, 3×3/1, 3×3/2, 1×1/1, 1×1/2) on odd image sizes,
    /// against the textbook convolution with the BatchNorm applied after it.
    #[test]
    fn folded_channels_last_convolution_matches_the_textbook_one() {
        let mut rng = StdRng::seed_from_u64(1);
        for (in_c, out_c, k, stride, pad, h, w) in [
            (3, 4, 7, 2, 3, 13, 11),
            (5, 6, 3, 1, 1, 7, 9),
            (4, 8, 3, 2, 1, 9, 6),
            (6, 3, 1, 1, 0, 5, 4),
            (6, 5, 1, 2, 0, 7, 8),
        ] {
            let n = 2;
            let c = Conv::random(Geometry { in_c, out_c, k, stride, pad }, &mut rng);
            let x = crate::workload::values(n * in_c * h * w, 9, 1.0);
            let want = naive(&x, &c, n, h, w);
            let l = ConvLayer::new(&c);
            let mut hwc = vec![0.0; x.len()];
            chw_to_hwc(&x, (n, in_c, h, w), &mut hwc);
            let (oh, ow) = (c.g.out_side(h), c.g.out_side(w));
            let mut out = vec![f32::NAN; n * oh * ow * out_c];
            let mut col = vec![f32::NAN; n * c.g.col_len(h, w)];
            for threads in [Threads(1), Threads(2)] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
                pool.install(|| l.forward(&hwc, (n, h, w), &mut out, &mut col, false, threads));
                for img in 0..n {
                    for o in 0..out_c {
                        for p in 0..oh * ow {
                            let got = out[(img * oh * ow + p) * out_c + o];
                            let want = want[(img * out_c + o) * oh * ow + p];
                            assert!(
                                (f64::from(got) - want).abs() <= 1e-4 * (1.0 + want.abs()),
                                "{k}x{k}/{stride}: {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn max_pool_ignores_padding_and_average_pool_means() {
        // One image 3×3, one channel: every 3×3/2 window with padding 1 → 2×2 outputs.
        let x = [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0];
        let mut out = [0.0; 4];
        assert_eq!(max_pool_3x3_s2(&x, (1, 3, 3, 1), &mut out), (2, 2));
        assert_eq!(out, [-1.0, -2.0, -4.0, -5.0]); // all negative: padding (−∞) never wins
        let mut avg = [0.0; 2];
        global_avg_pool(&[1.0, 10.0, 3.0, 20.0], (1, 2, 1, 2), &mut avg);
        assert_eq!(avg, [2.0, 15.0]);
    }
}
