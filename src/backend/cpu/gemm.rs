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

/// A step whose weights are at least this many bytes streams them from memory (they are past the
/// caches): its task runs on the compute pool even for one row, whose second thread adds memory
/// bandwidth. An h = 1024 LSTM step (2048 × 4096 floats, 32 MiB), one row: 0.90–1.09 ms on two
/// threads against 1.49–1.86 ms on one (`serve bench step --hidden 1024 --batch 1 --threads
/// 1|2`); an h = 256 step's 2 MiB stays on its stream's thread.
pub const STREAMED_WEIGHT_BYTES: usize = 8 << 20;

/// How many threads a product may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Threads(pub usize);

impl Threads {
    fn parallelism(self, macs: usize) -> Parallelism {
        if self.0 <= 1 || macs < PARALLEL_MIN_MACS { Parallelism::None } else { Parallelism::Rayon(self.0) }
    }
}

/// Output columns per block of a [`PackedWeight`].
///
/// `gemm` reads a row-major `Wᵀ [k, n]` with a stride of `n` floats between weight rows, and
/// below 49 rows it does not pack it first: with a weight larger than the L2 cache (h = 1024:
/// `2048 × 4096`), products of 8–48 rows then ran at 28–34 GFLOP/s on one core of the 2-core CI
/// machine against 84 at 64 rows. Handing gemm one block of 64 columns at a time (each block
/// contiguous, `[k][64]`) ran the same products at 47–64 GFLOP/s (h = 256's `256 × 1024`:
/// 72–80 → 94–105), and as fast as the whole `[k, n]` from 64 rows up (scratch probe against
/// gemm 0.19, x86-v4, 16–512 rows). 16-column blocks were slower, 256-column ones no faster.
pub const BLOCK: usize = 64;

/// A `torch.nn.Linear` weight `W [n, k]` kept as `Wᵀ` in column blocks: `[⌈n/64⌉][k][64]`
/// row-major ([`BLOCK`]), the last block zero-padded; gemm gets one block at a time.
#[derive(Clone, Debug, PartialEq)]
pub struct PackedWeight {
    k: usize,
    n: usize,
    blocks: Vec<f32>,
    /// The same weight for products of a few rows ([`with_panels`](Self::with_panels)).
    panels: Option<Vec<f32>>,
}

impl PackedWeight {
    /// Pack a row-major `[n, k]` weight (PyTorch's layout).
    pub fn from_torch(w: &[f32], n: usize, k: usize) -> PackedWeight {
        assert_eq!(w.len(), n * k, "weight holds {} values, [{n}, {k}] needs {}", w.len(), n * k);
        let mut blocks = vec![0.0; n.div_ceil(BLOCK) * k * BLOCK];
        for (j, row) in w.chunks_exact(k.max(1)).enumerate().take(n) {
            let block = &mut blocks[j / BLOCK * k * BLOCK..];
            for (i, &v) in row.iter().enumerate() {
                block[i * BLOCK + j % BLOCK] = v;
            }
        }
        PackedWeight { k, n, blocks, panels: None }
    }

    /// Also keep the weight as panels of 16 output columns (`[⌈n/16⌉][k][16]`, zero-padded; as
    /// much memory again), which products of up to [`SMALL_ROWS`] rows read instead: for weights
    /// multiplied a few rows at a time, such as a recurrent cell's at low load. (The blocks read
    /// 16 columns at a time, 256 bytes apart, took twice as long: an h = 256 step of one row,
    /// 98–113 µs against 50–53.)
    pub fn with_panels(mut self) -> PackedWeight {
        let (k, n) = (self.k, self.n);
        let mut panels = vec![0.0; n.div_ceil(LANES) * k * LANES];
        for (p, panel) in panels.chunks_exact_mut((k * LANES).max(1)).enumerate() {
            let (c0, block) = (p * LANES, &self.blocks[p * LANES / BLOCK * k * BLOCK..]);
            let width = LANES.min(n - c0);
            for (i, row) in panel.chunks_exact_mut(LANES).enumerate() {
                let from = i * BLOCK + c0 % BLOCK;
                row[..width].copy_from_slice(&block[from..from + width]);
            }
        }
        self.panels = Some(panels);
        self
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
    let t = match threads.parallelism(rows * n * k) {
        Parallelism::None => 1,
        _ => threads.0,
    };
    // Panels run on the calling thread: a product given more threads goes to gemm.
    if let (true, 1, Some(panels)) = (rows <= SMALL_ROWS, t, &w.panels) {
        panel_matmul(x, panels, y, rows, k, n, accumulate);
        return;
    }
    let blocks = n.div_ceil(BLOCK);
    // Units of work: a block of columns for a run of rows. Enough blocks keep every thread
    // busy; with few (a narrow layer on many threads) the rows are split as well.
    let row_runs =
        if t == 1 || blocks >= 2 * t { 1 } else { (2 * t).div_ceil(blocks).min(rows.div_ceil(16)) };
    let run_rows = rows.div_ceil(row_runs);
    let dst = SharedOut(y.as_mut_ptr());
    let unit = |u: usize| {
        let (b, r0) = (u % blocks, u / blocks * run_rows);
        let (c0, m) = (b * BLOCK, run_rows.min(rows - r0));
        // SAFETY: `y` holds rows × n values (asserted above) and `x` rows × k; unit `u` covers
        // rows r0..r0 + m (within rows) and columns c0..c0 + width (within n) of `y`, of `x`
        // the same rows, and block b of `blocks` (k × BLOCK values at b·k·BLOCK, inside the
        // vector by construction: ⌈n/BLOCK⌉ blocks). Units are distinct (block, row run) pairs,
        // so no two write the same element of `y`; `x` and the weight are only read, and `y`
        // is borrowed mutably for the whole call, so nothing else reads or writes it meanwhile.
        // gemm reads `y` only when `accumulate` is set, and then only that same unit.
        unsafe {
            block_product(
                x.as_ptr().add(r0 * k),
                &w.blocks[b * k * BLOCK..],
                dst.at(r0 * n + c0),
                m,
                k,
                n,
                BLOCK.min(n - c0),
                accumulate,
            )
        };
    };
    let units = blocks * rows.div_ceil(run_rows);
    if t == 1 {
        (0..units).for_each(unit);
    } else {
        use rayon::prelude::*;
        (0..units).into_par_iter().for_each(unit);
    }
}

/// `y`'s pointer, shared by the units of one [`matmul`], each writing its own elements.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: the units of a matmul write disjoint elements of `y` (see `matmul`), and the call
// borrows `y` mutably until every unit has returned.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The element `offset` past the start (inside `y`: the caller's unit bounds it).
    fn at(self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// `y[m, width] (+)= x[m, k] · block[k, width]` on the calling thread: `x` row stride `k`, `y`
/// row stride `n`, the block's `BLOCK`.
///
/// # Safety
/// `x` points at m × k readable values (row stride k), `y` at m rows of `width` writable values
/// with row stride `n` that nothing else accesses during the call, and `block` holds at least
/// k × BLOCK values.
#[allow(clippy::too_many_arguments)]
unsafe fn block_product(
    x: *const f32,
    block: &[f32],
    y: *mut f32,
    m: usize,
    k: usize,
    n: usize,
    width: usize,
    accumulate: bool,
) {
    debug_assert!(block.len() >= k * BLOCK && width <= BLOCK);
    // SAFETY: the caller's contract: dst y (m × width, row stride n, col stride 1), lhs x
    // (m × k, row stride k, col stride 1), rhs the block (k × width, row stride BLOCK, col
    // stride 1, inside `block`).
    unsafe {
        gemm::gemm(
            m,
            width,
            k,
            y,
            1,
            n as isize,
            accumulate,
            x,
            1,
            k as isize,
            block.as_ptr(),
            1,
            BLOCK as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// Products of at most this many rows use a weight's small-batch panels when it has them
/// ([`PackedWeight::with_panels`], [`panel_matmul`]): a cellular step at low load is one to a few rows, where the time is
/// streaming the weight once, and gemm's kernels (built to pack and tile large products) left
/// most of the bandwidth unused (an h = 256 LSTM step's `1 × 256 · 256 × 1024`: 32 µs on the
/// 2-core CI machine, `serve bench step --batch 1`). Each group of 4 rows is one pass over the
/// weight, so with more rows gemm is as fast or faster again (`serve bench step --threads 1`,
/// h = 256 and 1024: panels ahead at 1–4 rows at h = 256, even at h = 1024, mixed at 8, behind
/// at 20 and 32).
pub const SMALL_ROWS: usize = 4;

/// Output columns per panel.
const LANES: usize = 16;

/// Weight rows per run of a [`panel_matmul`] (its transposed input lives on the stack).
const RUN: usize = 1024;

/// `y[R, n] (+)= x[R, k] · Wᵀ` from `W`'s panels (`[⌈n/16⌉][k][16]`, zero-padded): each panel's
/// 16 columns of every row accumulate in registers while the panel streams by once. Compiled
/// for the baseline target and, chosen at run time, with AVX2 and FMA.
fn panel_matmul(x: &[f32], panels: &[f32], y: &mut [f32], rows: usize, k: usize, n: usize, accumulate: bool) {
    // `U` sets of accumulators over alternating weight rows, so that at least 4 × 2 independent
    // vector sums are in flight (one output row alone would wait on each add's latency).
    // Rows in groups of GROUP, each group one pass over the panels.
    for r0 in (0..rows).step_by(GROUP) {
        let g = GROUP.min(rows - r0);
        let (x, y) = (&x[r0 * k..], &mut y[r0 * n..]);
        match g {
            1 => panel_rows::<1, 2>(x, panels, y, k, n, accumulate),
            2 => panel_rows::<2, 2>(x, panels, y, k, n, accumulate),
            3 => panel_rows::<3, 1>(x, panels, y, k, n, accumulate),
            _ => panel_rows::<GROUP, 1>(x, panels, y, k, n, accumulate),
        }
    }
}

/// Rows sharing one pass over the panels: 4 rows × 16 columns is 8 AVX2 accumulators, half the
/// vector registers.
const GROUP: usize = 4;

/// [`panel_matmul`] for `R` rows with `U` accumulator sets.
fn panel_rows<const R: usize, const U: usize>(
    x: &[f32],
    panels: &[f32],
    y: &mut [f32],
    k: usize,
    n: usize,
    accumulate: bool,
) {
    // x transposed, [k][R]: the entries of one weight row for every output row, side by side.
    let mut xt = [0.0f32; RUN * GROUP];
    // Long inner products are split into runs of up to RUN weight rows (partial sums added).
    for k0 in (0..k).step_by(RUN) {
        let kk = RUN.min(k - k0);
        for (i, xs) in xt.chunks_exact_mut(R).take(kk).enumerate() {
            for (r, v) in xs.iter_mut().enumerate() {
                *v = x[r * k + k0 + i];
            }
        }
        let run = Run { xt: &xt[..kk * R], k, k0, n, overwrite: k0 == 0 && !accumulate };
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: `panel_run_avx2` requires only that the CPU has AVX2 and FMA, checked just
            // above; its body is the safe `panel_run`.
            unsafe { panel_run_avx2::<R, U>(&run, panels, y) };
            continue;
        }
        panel_run::<R, U>(&run, panels, y, |a, w, acc| a * w + acc);
    }
}

/// One run of weight rows `k0..k0 + xt.len() / R` of a [`panel_matmul`] of `R` rows.
struct Run<'a> {
    xt: &'a [f32],
    k: usize,
    k0: usize,
    n: usize,
    /// Write the sums instead of adding them to `y`.
    overwrite: bool,
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
#[target_feature(enable = "avx2,fma")]
fn panel_run_avx2<const R: usize, const U: usize>(run: &Run<'_>, panels: &[f32], y: &mut [f32]) {
    // `mul_add` is one FMA instruction here (elsewhere, without the feature, a libm call).
    panel_run::<R, U>(run, panels, y, f32::mul_add);
}

#[inline(always)]
fn panel_run<const R: usize, const U: usize>(
    run: &Run<'_>,
    panels: &[f32],
    y: &mut [f32],
    fma: impl Fn(f32, f32, f32) -> f32,
) {
    let &Run { xt, k, k0, n, overwrite } = run;
    let kk = xt.len() / R;
    let whole = kk - kk % U;
    for (p, panel) in panels.chunks_exact(k * LANES).enumerate() {
        let panel = &panel[k0 * LANES..(k0 + kk) * LANES];
        let mut acc = [[[0.0f32; LANES]; R]; U];
        // Fixed-size chunks and equal-length zips: no bounds checks, so the loops vectorize.
        let step = |acc: &mut [[f32; LANES]; R], w: &[f32], a: &[f32]| {
            for (acc, &a) in acc.iter_mut().zip(a) {
                for (acc, &w) in acc.iter_mut().zip(w) {
                    *acc = fma(a, w, *acc);
                }
            }
        };
        for (ws, xs) in panel[..whole * LANES].chunks_exact(U * LANES).zip(xt.chunks_exact(U * R)) {
            for ((acc, w), a) in acc.iter_mut().zip(ws.chunks_exact(LANES)).zip(xs.chunks_exact(R)) {
                step(acc, w, a);
            }
        }
        for (w, a) in panel[whole * LANES..].chunks_exact(LANES).zip(xt[whole * R..].chunks_exact(R)) {
            step(&mut acc[0], w, a);
        }
        let c0 = p * LANES;
        let width = LANES.min(n - c0);
        for r in 0..R {
            let sum = |j: usize| acc.iter().map(|a| a[r][j]).sum::<f32>();
            let yr = &mut y[r * n + c0..r * n + c0 + width];
            for (j, y) in yr.iter_mut().enumerate() {
                *y = if overwrite { sum(j) } else { *y + sum(j) };
            }
        }
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
            // ... including row runs split across threads (a single block of columns, 301 rows:
            // four runs, the last shorter) and column blocks that are not full.
            &[
                (1, 1, 1),
                (3, 5, 7),
                (17, 33, 9),
                (64, 128, 96),
                (2, 300, 513),
                (40, 700, 520),
                (301, 64, 40),
            ]
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

    /// Products of up to SMALL_ROWS rows read a weight's panels: every row count around it,
    /// inner products longer than one run, widths that do not fill the last panel, and both
    /// accumulate modes agree with the naive product; more rows use gemm as before.
    #[test]
    fn panel_products_match_naive_for_awkward_shapes() {
        let shapes: &[(usize, usize)] = if cfg!(miri) {
            &[(3, 17), (1, 16)]
        } else {
            &[(1, 1), (3, 17), (300, 16), (1030, 33), (2 * RUN + 5, 40)]
        };
        for &(k, n) in shapes {
            let w: Vec<f32> = (0..n * k).map(|i| ((i * 5 % 11) as f32 - 5.0) / 9.0).collect();
            let packed = PackedWeight::from_torch(&w, n, k).with_panels();
            assert_eq!(packed.blocks.len(), n.div_ceil(BLOCK) * k * BLOCK);
            assert!(packed.panels.as_ref().is_some_and(|p| p.len() == n.div_ceil(LANES) * k * LANES));
            for rows in 1..=SMALL_ROWS + 1 {
                if cfg!(miri) && rows > 2 {
                    continue;
                }
                let x: Vec<f32> = (0..rows * k).map(|i| ((i * 7 % 13) as f32 - 6.0) / 7.0).collect();
                let b: Vec<f32> = (0..n).map(|i| i as f32 * 0.25 - 1.0).collect();
                let want = naive(&x, &w, &b, rows, k, n);
                // Accumulating onto the bias (linear), and overwriting a buffer of NaN.
                let mut y = vec![f32::NAN; rows * n + 3];
                linear(&x, &packed, &b, &mut y, rows, false, Threads(1));
                let mut bare = vec![f32::NAN; rows * n + 3];
                matmul(&x, &packed, &mut bare, rows, false, Threads(1));
                for (j, e) in want.iter().enumerate() {
                    let what = format!("{rows}x{k}x{n} [{j}]");
                    assert!((y[j] - e).abs() <= 1e-4 * (1.0 + e.abs()), "{what}: {} vs {e}", y[j]);
                    let e = e - b[j % n];
                    assert!((bare[j] - e).abs() <= 1e-4 * (1.0 + e.abs()), "{what} bare: {} vs {e}", bare[j]);
                }
                assert!(
                    y[rows * n..].iter().chain(&bare[rows * n..]).all(|v| v.is_nan()),
                    "wrote past the rows"
                );
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
