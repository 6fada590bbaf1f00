//! Dense linear algebra on the CPU, on top of the `gemm` crate (chosen over `matrixmultiply` by
//! `cargo bench --bench gemm`: see that benchmark for the comparison).
//!
//! Weights are stored transposed ([`PackedWeight`]: `Wᵀ`, `[k, n]` row-major) once, when a model
//! is prepared: with a row-major output, gemm's kernels then stream the weight contiguously, which
//! is 1.3–2.5× faster than reading PyTorch's `[n, k]` layout in place on the shapes libserve runs.

use gemm::Parallelism;

/// Below this many multiply-adds a product runs on the calling thread: handing a tiny product to
/// the pool costs more than it saves.
pub const PARALLEL_MIN_MACS: usize = 1 << 18;

/// A task runs on the compute pool only from this many multiply-adds (and from
/// [`PARALLEL_MIN_ROWS`] rows); below, on its stream's thread. The pool's threads sleep when the
/// stream has been idle, and waking them costs more the longer they slept: on the 2-core CI
/// machine an h = 256 LSTM step of 2 rows took 44 µs on two threads back to back, 83 µs after a
/// 50 µs pause, 130 µs after 1 ms and 190 µs after 3 ms, against about 60 µs on one thread. Two
/// threads win back that wake-up only on products of this size (an h = 256 step of 32 rows: 313
/// against 427 µs warm); at low load, where tasks are small, the stream is usually idle between
/// them.
pub const PARALLEL_TASK_MIN_MACS: usize = 1 << 24;

/// A task of fewer rows runs on its stream's thread whatever its size: a one-row product is a
/// matrix-vector product, and waking the pool for it costs more than the second core gives (an
/// h = 256 LSTM step of one row: 54 µs on two threads against 34 µs on one). This holds for
/// recurrent cell tasks and mlp rows; a ResNet image or a BERT sequence is a matrix product of
/// its own (its positions or tokens are the rows) and goes to the pool alone.
pub const PARALLEL_MIN_ROWS: usize = 2;

/// How many threads a product may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Threads(pub usize);

impl Threads {
    fn parallelism(self, macs: usize) -> Parallelism {
        if self.0 <= 1 || macs < PARALLEL_MIN_MACS { Parallelism::None } else { Parallelism::Rayon(self.0) }
    }
}

/// A `torch.nn.Linear` weight `W [n, k]` kept as `Wᵀ`: `[k, n]` row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedWeight {
    k: usize,
    n: usize,
    wt: Vec<f32>,
}

impl PackedWeight {
    /// Pack a row-major `[n, k]` weight (PyTorch's layout).
    pub fn from_torch(w: &[f32], n: usize, k: usize) -> PackedWeight {
        assert_eq!(w.len(), n * k, "weight holds {} values, [{n}, {k}] needs {}", w.len(), n * k);
        let mut wt = vec![0.0; n * k];
        for (j, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            for (i, &v) in row.iter().enumerate() {
                wt[i * n + j] = v;
            }
        }
        PackedWeight { k, n, wt }
    }
    /// Input features (columns of `W`).
    pub fn k(&self) -> usize {
        self.k
    }
    /// Output features (rows of `W`).
    pub fn n(&self) -> usize {
        self.n
    }
}

/// `y[rows, n] = x[rows, k] · Wᵀ (+ y if accumulate)`. `x` and `y` are dense row-major.
///
/// Panics if a slice is shorter than its shape says.
pub fn matmul(x: &[f32], w: &PackedWeight, y: &mut [f32], rows: usize, accumulate: bool, threads: Threads) {
    let (k, n) = (w.k, w.n);
    assert!(x.len() >= rows * k, "x holds {} values, needs {}", x.len(), rows * k);
    assert!(y.len() >= rows * n, "y holds {} values, needs {}", y.len(), rows * n);
    if rows == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            y[..rows * n].fill(0.0);
        }
        return;
    }
    // SAFETY: the asserts above (and PackedWeight's construction, wt.len() == k·n) guarantee every
    // element gemm addresses lies inside its slice: dst y (rows × n, row stride n, col stride 1),
    // lhs x (rows × k, row stride k, col stride 1), rhs Wᵀ (k × n, row stride n, col stride 1).
    // `y` is borrowed mutably, so it aliases neither input; gemm reads `y` only when
    // `accumulate` is set, and then only those same rows × n elements.
    unsafe {
        gemm::gemm(
            rows,
            n,
            k,
            y.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            x.as_ptr(),
            1,
            k as isize,
            w.wt.as_ptr(),
            1,
            n as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            threads.parallelism(rows * n * k),
        );
    }
}

/// `y = x · Wᵀ + b` for each of `rows` rows, then ReLU if `relu`.
pub fn linear(
    x: &[f32],
    w: &PackedWeight,
    b: &[f32],
    y: &mut [f32],
    rows: usize,
    relu: bool,
    threads: Threads,
) {
    let n = w.n;
    assert_eq!(b.len(), n, "bias length");
    for row in y[..rows * n].chunks_exact_mut(n) {
        row.copy_from_slice(b);
    }
    matmul(x, w, y, rows, true, threads);
    if relu {
        y[..rows * n].iter_mut().for_each(|v| *v = v.max(0.0));
    }
}

/// A strided view of a row-major-or-not matrix in a slice: element `(i, j)` is
/// `data[offset + i·rs + j·cs]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct View {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl View {
    /// One past the last element it touches (`offset` for an empty view), if that fits a usize
    /// and each stride fits an isize (what gemm takes).
    fn end(&self) -> Option<usize> {
        if self.rs > isize::MAX as usize || self.cs > isize::MAX as usize {
            return None;
        }
        if self.rows == 0 || self.cols == 0 {
            return Some(self.offset);
        }
        let last_row = (self.rows - 1).checked_mul(self.rs)?;
        let last_col = (self.cols - 1).checked_mul(self.cs)?;
        self.offset.checked_add(last_row)?.checked_add(last_col)?.checked_add(1)
    }

    /// No two of its elements are the same: one stride steps over a whole line of the other
    /// (row-major: `rs ≥ cols · cs`, column-major: `cs ≥ rows · rs`), both non-zero.
    fn distinct(&self) -> bool {
        if self.rows <= 1 && self.cols <= 1 {
            return true;
        }
        let rows_apart = self.rows <= 1 || self.rs >= self.cols.saturating_mul(self.cs).max(1);
        let cols_apart = self.cols <= 1 || self.cs >= 1;
        let cols_apart_t = self.cols <= 1 || self.cs >= self.rows.saturating_mul(self.rs).max(1);
        let rows_apart_t = self.rows <= 1 || self.rs >= 1;
        (rows_apart && cols_apart) || (cols_apart_t && rows_apart_t)
    }
}

/// `c = scale · a · b` over strided views (`a` is m × k, `b` k × n, `c` m × n), overwriting `c`.
/// Panics when the shapes disagree, a view leaves its slice (checked arithmetic), a stride is
/// over `isize::MAX`, or `c`'s view names an element twice (gemm's threads would race on it).
pub(crate) fn matmul_strided(
    a: (&[f32], View),
    b: (&[f32], View),
    c: (&mut [f32], View),
    scale: f32,
    threads: Threads,
) {
    let ((a, av), (b, bv), (c, cv)) = (a, b, c);
    assert_eq!((av.cols, av.rows, bv.cols), (bv.rows, cv.rows, cv.cols), "matmul_strided shapes");
    let inside = |v: &View, len: usize| v.end().is_some_and(|end| end <= len);
    assert!(inside(&av, a.len()) && inside(&bv, b.len()) && inside(&cv, c.len()), "a view leaves its slice");
    assert!(cv.distinct(), "the output view names an element twice");
    let (m, n, k) = (cv.rows, cv.cols, av.cols);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        for i in 0..m {
            for j in 0..n {
                c[cv.offset + i * cv.rs + j * cv.cs] = 0.0;
            }
        }
        return;
    }
    // SAFETY: every element gemm reads or writes is (i, j) of a view, inside its slice (checked
    // above with checked arithmetic: the view's last element is in bounds, the strides are
    // non-negative and fit an isize, so (i, j) ≤ that last element); `c` is borrowed mutably and
    // does not alias `a` or `b` (distinct borrows), and its view names each element once, so
    // gemm's threads write disjoint elements.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr().add(cv.offset),
            cv.cs as isize,
            cv.rs as isize,
            false,
            a.as_ptr().add(av.offset),
            av.cs as isize,
            av.rs as isize,
            b.as_ptr().add(bv.offset),
            bv.cs as isize,
            bv.rs as isize,
            0.0,
            scale,
            false,
            false,
            false,
            threads.parallelism(m * n * k),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], w: &[f32], b: &[f32], rows: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![0.0; rows * n];
        for r in 0..rows {
            for j in 0..n {
                let mut acc = b[j] as f64;
                for i in 0..k {
                    acc += x[r * k + i] as f64 * w[j * k + i] as f64;
                }
                y[r * n + j] = acc as f32;
            }
        }
        y
    }

    #[test]
    fn linear_matches_naive_for_awkward_shapes() {
        for &(rows, k, n) in
            &[(1, 1, 1), (3, 5, 7), (17, 33, 9), (64, 128, 96), (2, 300, 513), (40, 700, 520)]
        {
            let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0).collect();
            let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            let want = naive(&x, &w, &b, rows, k, n);
            let packed = PackedWeight::from_torch(&w, n, k);
            assert_eq!((packed.k(), packed.n()), (k, n));
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
            for threads in [Threads(1), Threads(2)] {
                let mut y = vec![f32::NAN; rows * n];
                pool.install(|| linear(&x, &packed, &b, &mut y, rows, false, threads));
                for (a, e) in y.iter().zip(&want) {
                    assert!((a - e).abs() <= 1e-4 * (1.0 + e.abs()), "{rows}x{k}x{n}: {a} vs {e}");
                }
            }
        }
    }

    /// Strided views (a transposed operand, row offsets, a column block of the output) against
    /// the naive product; views that leave their slice, wrap, or name an output twice panic.
    #[test]
    fn strided_products_match_and_bad_views_are_refused() {
        // a: 3 × 4 row-major at offset 2; b: the transpose of a 5 × 4 row-major matrix; c: a 3 × 5
        // block at columns 1.. of a 3 × 7 matrix.
        let a: Vec<f32> = (0..14).map(|i| i as f32 * 0.5 - 2.0).collect();
        let bt: Vec<f32> = (0..20).map(|i| (i % 7) as f32 - 3.0).collect();
        let av = View { offset: 2, rows: 3, cols: 4, rs: 4, cs: 1 };
        let bv = View { offset: 0, rows: 4, cols: 5, rs: 1, cs: 4 };
        let cv = View { offset: 1, rows: 3, cols: 5, rs: 7, cs: 1 };
        let mut c = vec![f32::NAN; 21];
        matmul_strided((&a, av), (&bt, bv), (&mut c, cv), 0.5, Threads(1));
        for i in 0..3 {
            for j in 0..5 {
                let want: f32 = (0..4).map(|p| a[2 + i * 4 + p] * bt[j * 4 + p]).sum::<f32>() * 0.5;
                assert_eq!(c[1 + i * 7 + j], want, "({i}, {j})");
            }
            assert!(c[i * 7].is_nan() && c[i * 7 + 6].is_nan(), "columns outside the block untouched");
        }
        let refused = |cv: View, len: usize| {
            std::panic::catch_unwind(|| {
                let mut c = vec![0.0; len];
                matmul_strided((&a, av), (&bt, bv), (&mut c, cv), 1.0, Threads(1));
            })
            .is_err()
        };
        assert!(!refused(View { offset: 1, rows: 3, cols: 5, rs: 7, cs: 1 }, 20), "ends at the last element");
        assert!(refused(View { offset: 1, rows: 3, cols: 5, rs: 7, cs: 1 }, 19), "one past the end");
        assert!(
            refused(View { offset: 100, rows: 3, cols: 5, rs: 0usize.wrapping_sub(100), cs: 1 }, 21),
            "a wrapped stride"
        );
        assert!(refused(View { offset: 0, rows: 3, cols: 5, rs: 0, cs: 1 }, 21), "rows on top of each other");
        assert!(refused(View { offset: 0, rows: 3, cols: 5, rs: 2, cs: 1 }, 21), "overlapping rows");
    }

    #[test]
    fn relu_clamps_and_accumulate_adds() {
        let x = [1.0, -2.0];
        let w = PackedWeight::from_torch(&[1.0, 1.0, -1.0, 0.0], 2, 2); // rows: (1,1), (-1,0)
        let mut y = [0.0; 2];
        linear(&x, &w, &[0.0, 0.0], &mut y, 1, true, Threads(1));
        assert_eq!(y, [0.0, 0.0]); // (-1 → 0, -1 → 0)
        let mut y = [10.0, 10.0];
        matmul(&x, &w, &mut y, 1, true, Threads(1));
        assert_eq!(y, [9.0, 9.0]);
        matmul(&x, &w, &mut y, 1, false, Threads(1));
        assert_eq!(y, [-1.0, -1.0]);
    }
}
