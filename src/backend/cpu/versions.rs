//! Multi-version GEMM kernels (VELTAIR §4.2, issue 16 item 2): versions of one product that
//! differ in cache footprint and parallel structure, not only in thread count, so that under
//! interference a version with a smaller footprint can beat the one that is fastest alone.
//!
//! `gemm` (the crate) derives its own inner blocking from the cache sizes and does not let a
//! caller set it, so the versions are built around it:
//! * **outer tiles** `mt × nt` of the output, one `gemm` call per tile over the whole `K`: the
//!   tile's working set `4(mt·K + K·nt + mt·nt)` bytes is its locality;
//! * the **order** of the tile loops (rows of tiles first, or columns first: which operand's
//!   panel stays warm between calls);
//! * **where the parallelism sits**: inside each call (`gemm` spreads one tile over the
//!   threads), or across bands of `mt` rows (each band on one thread, its calls single-threaded).
//!
//! Every version computes the same product (a test checks each against a reference). The core
//! count is the caller's (the scheduler's lease), not a field of a version.

use rayon::prelude::*;

use super::gemm::{Threads, View, matmul_strided};
use crate::error::{Error, Result};

/// The largest product a version runs (elements of each operand and of the output).
pub const MAX_ELEMENTS: usize = 1 << 26;

/// The order of the outer tile loops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// Rows of tiles outside: `a`'s row panel stays warm across a row of calls.
    RowsFirst,
    /// Columns of tiles outside: `b`'s column panel stays warm across a column of calls.
    ColsFirst,
}

/// Where a version's parallelism sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Inside each tile's `gemm` call.
    Inside,
    /// Across bands of `mt` rows, one band per thread at a time.
    Bands,
}

/// One version of an `m × k` by `k × n` product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GemmVersion {
    pub mt: usize,
    pub nt: usize,
    pub order: Order,
    pub placement: Placement,
}

impl GemmVersion {
    /// Working set of one tile over the whole `k`, bytes (its locality).
    pub fn working_set(&self, k: usize) -> usize {
        4 * (self.mt * k + k * self.nt + self.mt * self.nt)
    }

    /// Independent tiles of an `m × n` output (its parallelism).
    pub fn tiles(&self, m: usize, n: usize) -> usize {
        m.div_ceil(self.mt) * n.div_ceil(self.nt)
    }

    /// A short name: `128x64-rows-inside`.
    pub fn name(&self) -> String {
        let order = if self.order == Order::RowsFirst { "rows" } else { "cols" };
        let place = if self.placement == Placement::Inside { "inside" } else { "bands" };
        format!("{}x{}-{order}-{place}", self.mt, self.nt)
    }

    /// `c = a · b` (`a` `m × k`, `b` `k × n`, `c` `m × n`, all row-major), on at most `threads`
    /// threads of the current rayon pool. Fails on lengths that disagree with the shape or a
    /// product over [`MAX_ELEMENTS`].
    pub fn run(
        &self,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        (m, k, n): (usize, usize, usize),
        threads: usize,
    ) -> Result<()> {
        let sizes = [m.checked_mul(k), k.checked_mul(n), m.checked_mul(n)];
        if sizes.iter().any(|s| s.is_none_or(|s| s > MAX_ELEMENTS)) {
            return Err(Error::invalid(format!("a {m}×{k}×{n} product is over {MAX_ELEMENTS} elements")));
        }
        if a.len() != m * k || b.len() != k * n || c.len() != m * n || self.mt == 0 || self.nt == 0 {
            return Err(Error::invalid(format!(
                "version {} of a {m}×{k}×{n} product given {}, {} and {} values",
                self.name(),
                a.len(),
                b.len(),
                c.len()
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            c.fill(0.0);
            return Ok(());
        }
        let a_rows = |i0: usize, rows: usize| View { offset: i0 * k, rows, cols: k, rs: k, cs: 1 };
        let b_cols = |j0: usize, cols: usize| View { offset: j0, rows: k, cols, rs: n, cs: 1 };
        let row_tiles: Vec<usize> = (0..m).step_by(self.mt).collect();
        let col_tiles: Vec<usize> = (0..n).step_by(self.nt).collect();
        match self.placement {
            Placement::Inside => {
                let mut tile = |i0: usize, j0: usize| {
                    let (rows, cols) = (self.mt.min(m - i0), self.nt.min(n - j0));
                    let cv = View { offset: i0 * n + j0, rows, cols, rs: n, cs: 1 };
                    matmul_strided(
                        (a, a_rows(i0, rows)),
                        (b, b_cols(j0, cols)),
                        (c, cv),
                        1.0,
                        Threads(threads),
                    );
                };
                match self.order {
                    Order::RowsFirst => {
                        row_tiles.iter().for_each(|&i| col_tiles.iter().for_each(|&j| tile(i, j)))
                    }
                    Order::ColsFirst => {
                        col_tiles.iter().for_each(|&j| row_tiles.iter().for_each(|&i| tile(i, j)))
                    }
                }
            }
            Placement::Bands => {
                // The bands of `mt` rows go in `threads` groups, one task each: at most
                // `threads` run at once. Each group is its own slice of `c`, so groups on
                // different threads share no element.
                let mt = self.mt.min(m);
                let bands = m.div_ceil(mt);
                let group_rows = mt * bands.div_ceil(threads.max(1));
                c.par_chunks_mut(group_rows * n).enumerate().with_max_len(1).for_each(|(g, out)| {
                    let rows_in_group = out.len() / n;
                    for b0 in (0..rows_in_group).step_by(mt) {
                        let (i0, rows) = (g * group_rows + b0, mt.min(rows_in_group - b0));
                        for &j0 in &col_tiles {
                            let cols = self.nt.min(n - j0);
                            let cv = View { offset: b0 * n + j0, rows, cols, rs: n, cs: 1 };
                            let (av, bv) = (a_rows(i0, rows), b_cols(j0, cols));
                            matmul_strided((a, av), (b, bv), (&mut *out, cv), 1.0, Threads(1));
                        }
                    }
                });
            }
        }
        Ok(())
    }
}

/// The candidate versions of an `m × k × n` product: tiles of 32…512 (and the whole dimension),
/// each loop order, each placement (rows-first only for bands, whose order is one row of tiles).
pub fn candidates(m: usize, n: usize) -> Vec<GemmVersion> {
    let sides = |d: usize| {
        let mut s: Vec<usize> = [32, 64, 128, 256, 512].iter().copied().filter(|&t| t < d).collect();
        s.push(d.max(1));
        s
    };
    let mut out = Vec::new();
    for &mt in &sides(m) {
        for &nt in &sides(n) {
            for order in [Order::RowsFirst, Order::ColsFirst] {
                out.push(GemmVersion { mt, nt, order, placement: Placement::Inside });
            }
            out.push(GemmVersion { mt, nt, order: Order::RowsFirst, placement: Placement::Bands });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(a: &[f32], b: &[f32], (m, k, n): (usize, usize, usize)) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] =
                    (0..k).map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j])).sum::<f64>() as f32;
            }
        }
        c
    }

    #[test]
    fn every_version_computes_the_same_product() {
        let (m, k, n) = (70, 33, 90);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.1).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.1).collect();
        let want = reference(&a, &b, (m, k, n));
        let versions = candidates(m, n);
        assert!(versions.len() >= 12, "tiles × orders × placements: {}", versions.len());
        for v in versions {
            for threads in [1, 2, 3] {
                let mut c = vec![f32::NAN; m * n];
                v.run(&a, &b, &mut c, (m, k, n), threads).unwrap();
                let worst = c.iter().zip(&want).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max);
                assert!(worst < 1e-4, "{} on {threads} threads: off by {worst}", v.name());
            }
        }
    }

    #[test]
    fn locality_and_parallelism_trade_off() {
        let small = GemmVersion { mt: 32, nt: 32, order: Order::RowsFirst, placement: Placement::Inside };
        let big = GemmVersion { mt: 256, nt: 256, ..small };
        assert!(small.working_set(2304) < big.working_set(2304));
        assert!(small.tiles(196, 256) > big.tiles(196, 256));
        assert_eq!(big.tiles(196, 256), 1);
    }

    #[test]
    fn an_empty_reduction_is_a_zero_product() {
        for v in candidates(70, 90) {
            let mut c = vec![f32::NAN; 70 * 90];
            v.run(&[], &[], &mut c, (70, 0, 90), 2).unwrap();
            assert!(c.iter().all(|&x| x == 0.0), "{}", v.name());
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let v = candidates(4, 4)[0];
        let mut c = vec![0.0; 16];
        assert!(v.run(&[0.0; 15], &[0.0; 16], &mut c, (4, 4, 4), 1).is_err());
        assert!(v.run(&[], &[], &mut [], (1 << 14, 1 << 14, 1), 1).is_err(), "over the size bound");
    }
}
