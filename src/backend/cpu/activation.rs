//! Branch-free `exp`, `sigmoid` and `tanh` for the recurrent cells' pointwise kernels.
//!
//! Pure `f32` arithmetic and bit manipulation, with no libm call, no `mul_add` (which is a libm
//! call without the `fma` target feature) and no data-dependent branch, so that a loop applying
//! them over slices auto-vectorizes. `exp` is Cephes' `expf`: range reduction `x = n·ln 2 + r`
//! (`n` rounded with the 1.5·2²³ trick, `ln 2` split in two for an exact `n·C1`), a degree-6
//! polynomial on `|r| ≤ ln 2 / 2`, and `2ⁿ` built from the exponent bits. Arguments are clamped to
//! `±87`, so `2ⁿ` stays a normal number; that only affects results which saturate anyway.
//!
//! Accuracy against `f64` over `[-30, 30]` (tested on a dense grid): `sigmoid` ≤ 2e-7 absolute,
//! `tanh` ≤ 5e-7 absolute; both saturate exactly (`sigmoid(±∞) = 1 / 0`, `tanh(±∞) = ±1`) and
//! propagate NaN.

/// Arguments of [`exp`] are clamped to `[-EXP_LIMIT, EXP_LIMIT]`: `n = round(x / ln 2)` then lies
/// in `[-126, 126]`, so `2ⁿ` is a normal `f32`.
const EXP_LIMIT: f32 = 87.0;
const LOG2E: f32 = std::f32::consts::LOG2_E;
/// `ln 2 = C1 + C2`; `C1` has 9 significant bits, so `n · C1` is exact.
const C1: f32 = 0.693_359_4;
const C2: f32 = -2.121_944_4e-4;
/// 1.5 · 2²³: adding it rounds an `f32` of magnitude < 2²² to an integer (ties to even), which
/// is then the low bits of the sum.
const ROUND: f32 = 12_582_912.0;
const ROUND_BITS: u32 = 0x4B40_0000;
/// Cephes' coefficients, highest degree first (its last one, 5.0000001201e-1, is 0.5 in `f32`).
const P: [f32; 6] = [1.987_569_2e-4, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 1.666_666_5e-1, 0.5];

/// `eˣ` (relative error ≈ 1 ulp), with `x` clamped to `±87`; NaN in, NaN out.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    // Written so that a NaN `x` fails both comparisons and passes through.
    let x = if x > EXP_LIMIT { EXP_LIMIT } else { x };
    let x = if x < -EXP_LIMIT { -EXP_LIMIT } else { x };
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * C1) - n * C2;
    let mut y = P[0];
    y = y * r + P[1];
    y = y * r + P[2];
    y = y * r + P[3];
    y = y * r + P[4];
    y = y * r + P[5];
    let y = y * (r * r) + r + 1.0;
    // 2ⁿ: biased exponent n + 127 (in 1..=253) in bits 23..31. Wrapping, so NaN bits cannot panic.
    let scale = f32::from_bits(t.to_bits().wrapping_sub(ROUND_BITS - 127) << 23);
    y * scale
}

/// The logistic function `1 / (1 + e⁻ˣ)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// The hyperbolic tangent, as `(e²ˣ - 1) / (e²ˣ + 1)`: absolute error ≤ half that of `exp` near 0.
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let e = exp(x + x);
    (e - 1.0) / (e + 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid() -> impl Iterator<Item = f32> {
        // 1.2 million points over [-30, 30] natively; a few hundred under Miri.
        let n: i32 = if cfg!(miri) { 300 } else { 1_200_000 };
        (-n..=n).map(move |i| 30.0 * i as f32 / n as f32)
    }

    fn specials() -> [f32; 12] {
        [0.0, -0.0, 1e-30, -1e-30, 1e-8, -1e-8, 45.0, -45.0, 100.0, -100.0, 1e30, -1e30]
    }

    #[test]
    fn sigmoid_within_2e7_of_f64() {
        let mut worst = (0.0f64, 0.0f32);
        for x in grid().chain(specials()) {
            let want = 1.0 / (1.0 + (-(x as f64)).exp());
            let err = (sigmoid(x) as f64 - want).abs();
            if err > worst.0 {
                worst = (err, x);
            }
        }
        assert!(worst.0 <= 2e-7, "max error {:e} at {}", worst.0, worst.1);
        assert_eq!(sigmoid(f32::INFINITY), 1.0);
        assert!(sigmoid(f32::NEG_INFINITY) <= 2e-38);
        assert_eq!(sigmoid(50.0), 1.0);
        assert_eq!(sigmoid(0.0), 0.5);
        assert!(sigmoid(f32::NAN).is_nan());
    }

    #[test]
    fn tanh_within_5e7_of_f64() {
        let mut worst = (0.0f64, 0.0f32);
        for x in grid().chain(specials()) {
            let want = (x as f64).tanh();
            let err = (tanh(x) as f64 - want).abs();
            if err > worst.0 {
                worst = (err, x);
            }
        }
        assert!(worst.0 <= 5e-7, "max error {:e} at {}", worst.0, worst.1);
        assert_eq!(tanh(f32::INFINITY), 1.0);
        assert_eq!(tanh(f32::NEG_INFINITY), -1.0);
        assert_eq!(tanh(20.0), 1.0);
        assert_eq!(tanh(-20.0), -1.0);
        assert_eq!(tanh(0.0), 0.0);
        assert!(tanh(f32::NAN).is_nan());
    }

    #[test]
    fn exp_relative_error_and_limits() {
        let mut worst = 0.0f64;
        for x in grid().map(|x| x * 2.9) {
            let want = (x as f64).exp();
            worst = worst.max((exp(x) as f64 - want).abs() / want);
        }
        assert!(worst <= 3e-7, "max relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(f32::INFINITY).is_finite() && exp(f32::INFINITY) > 1e37);
        assert!(exp(f32::NEG_INFINITY) > 0.0 && exp(f32::NEG_INFINITY) < 1e-37);
        assert!(exp(f32::NAN).is_nan() && exp(-f32::NAN).is_nan());
    }
}
