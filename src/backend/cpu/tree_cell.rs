//! One cellular-batching step of a Child-Sum TreeLSTM (Tai et al. 2015) on the CPU: a batch of
//! tree nodes whose children were all computed by earlier steps.
//!
//! For a node with input `x` (`E` values) and children `k` with states `(h_k, c_k)`:
//!
//! ```text
//! h̃ = Σ_k h_k
//! [i, o, u] = W_iou x + b_iou + U_iou h̃          (chunks in that order; σ, σ, tanh)
//! f_k = σ(W_f x + b_f + U_f h_k)
//! c = i ⊙ u + Σ_k f_k ⊙ c_k
//! h = o ⊙ tanh(c)
//! ```
//!
//! As the CUDA kernels will: one GEMM does the `x` side of all four gates (`[W_iou; W_f]`, `4H`
//! outputs), one `h̃ · U_iouᵀ` for the batch and one `H_k · U_fᵀ` over every child of the batch
//! (both skipped when no node of the step has children), then a fused pointwise kernel adds the
//! biases, applies the gates, sums over children and scatters `h`, `c` to the nodes' slots. A
//! node's slot holds `h` at `0..H` and `c` at `H..2H`.

use std::ops::Range;

use rayon::prelude::*;

use crate::backend::cpu::activation::{sigmoid, tanh};
use crate::backend::cpu::arena::StateArena;
use crate::backend::cpu::gemm::{PackedWeight, Threads, matmul};
use crate::backend::cpu::lstm_cell::PARALLEL_MIN_VALUES;
use crate::backend::grow;
use crate::backend::size;
use crate::error::{Code, Error, Result};

/// Values each parallel task of the gather / pointwise kernels handles at least.
const TASK_MIN_VALUES: usize = 1 << 12;

fn task_rows(width: usize) -> usize {
    TASK_MIN_VALUES.div_ceil(width.max(1))
}

/// A Child-Sum TreeLSTM cell packed for [`tree_step`].
#[derive(Clone, Debug, PartialEq)]
pub struct TreeCell {
    /// `[W_iou; W_f]`: `[4H, E]`.
    wx: PackedWeight,
    /// `[b_iou; b_f]`: `4H`.
    bx: Vec<f32>,
    /// `U_iou`: `[3H, H]`.
    u_iou: PackedWeight,
    /// `U_f`: `[H, H]`.
    u_f: PackedWeight,
    embed: usize,
    hidden: usize,
}

impl TreeCell {
    /// Pack a cell from PyTorch-layout tensors: `W_iou [3H, E]`, `b_iou [3H]`, `U_iou [3H, H]`,
    /// `W_f [H, E]`, `b_f [H]`, `U_f [H, H]` (`E` = `embed`, `H` = `hidden`).
    ///
    /// Panics if a tensor's length does not match the sizes or `hidden` is 0.
    #[allow(clippy::too_many_arguments)]
    pub fn from_torch(
        w_iou: &[f32],
        b_iou: &[f32],
        u_iou: &[f32],
        w_f: &[f32],
        b_f: &[f32],
        u_f: &[f32],
        embed: usize,
        hidden: usize,
    ) -> TreeCell {
        let (e, h) = (embed, hidden);
        assert!(h > 0, "a TreeLSTM cell needs a hidden size");
        assert_eq!(w_iou.len(), 3 * h * e, "W_iou holds {} values, [{}, {e}] needs", w_iou.len(), 3 * h);
        assert_eq!(b_iou.len(), 3 * h, "b_iou length");
        assert_eq!(u_iou.len(), 3 * h * h, "U_iou holds {} values, [{}, {h}] needs", u_iou.len(), 3 * h);
        assert_eq!(w_f.len(), h * e, "W_f holds {} values, [{h}, {e}] needs", w_f.len());
        assert_eq!(b_f.len(), h, "b_f length");
        assert_eq!(u_f.len(), h * h, "U_f holds {} values, [{h}, {h}] needs", u_f.len());
        let wx: Vec<f32> = w_iou.iter().chain(w_f).copied().collect();
        TreeCell {
            wx: PackedWeight::from_torch(&wx, 4 * h, e),
            bx: b_iou.iter().chain(b_f).copied().collect(),
            u_iou: PackedWeight::from_torch(u_iou, 3 * h, h),
            u_f: PackedWeight::from_torch(u_f, h, h),
            embed,
            hidden,
        }
    }

    /// Input features `E`.
    pub fn embed(&self) -> usize {
        self.embed
    }

    /// Hidden size `H`.
    pub fn hidden(&self) -> usize {
        self.hidden
    }
}

/// A real node of a step: its state slot and its children, a range of the step's `child_slots`
/// (empty for a leaf).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TreeRow {
    /// The arena slot receiving the node's `h` and `c`.
    pub slot: u32,
    /// Indices into `child_slots` of the slots holding the children's states.
    pub children: Range<usize>,
}

/// Buffers of [`tree_step`], reused across steps (one per stream).
#[derive(Clone, Debug, Default)]
pub struct TreeScratch {
    /// `x · [W_iou; W_f]ᵀ`, `padded × 4H`.
    gx: Vec<f32>,
    /// `h̃`, `padded × H`.
    ht: Vec<f32>,
    /// `h̃ · U_iouᵀ`, `padded × 3H`.
    gu: Vec<f32>,
    /// Children's `h`, `c` and `h_k · U_fᵀ`, `children × H` each.
    hc: Vec<f32>,
    cc: Vec<f32>,
    fu: Vec<f32>,
    /// New `c`, `padded × H`.
    c: Vec<f32>,
    /// Per row, its first child's index in `hc` (prefix sums, `padded + 1`).
    start: Vec<usize>,
    /// Slot of each gathered child.
    child: Vec<u32>,
}

impl TreeScratch {
    /// Empty buffers; [`reserve`](Self::reserve) them when the model is prepared.
    pub fn new() -> TreeScratch {
        TreeScratch::default()
    }

    /// Grow the buffers for steps of up to `max_rows` (padded) nodes with up to `max_children`
    /// children in all, or fail with [`Code::Unavailable`] (instead of aborting).
    pub fn reserve(&mut self, max_rows: usize, max_children: usize, hidden: usize) -> Result<()> {
        let what = "TreeLSTM step buffers";
        let h4 = size(4, hidden, what)?;
        grow(&mut self.gx, size(max_rows, h4, what)?, what)?;
        grow(&mut self.ht, size(max_rows, hidden, what)?, what)?;
        grow(&mut self.gu, size(max_rows, size(3, hidden, what)?, what)?, what)?;
        let ch = size(max_children, hidden, what)?;
        for v in [&mut self.hc, &mut self.cc, &mut self.fu] {
            grow(v, ch, what)?;
        }
        grow(&mut self.c, size(max_rows, hidden, what)?, what)?;
        let unavailable = || Error::new(Code::Unavailable, format!("cannot allocate {what}"));
        let rows1 = max_rows.checked_add(1).ok_or_else(unavailable)?;
        self.start.try_reserve(rows1.saturating_sub(self.start.len())).map_err(|_| unavailable())?;
        self.child.try_reserve(max_children.saturating_sub(self.child.len())).map_err(|_| unavailable())
    }
}

fn ensure(v: &mut Vec<f32>, len: usize) {
    if v.len() < len {
        v.resize(len, 0.0);
    }
}

/// One step of the cell for a batch of `padded` nodes.
///
/// `x` is `padded × E` (padding rows zero-filled by the caller); `rows` are the real nodes
/// (`rows.len() ≤ padded`), whose children's states are read from the slots
/// `child_slots[row.children]`. Padding rows are computed as leaves but not scattered. Every
/// row's `h` goes to `h_out` (`padded × H`); real rows' `h` and `c` are written to their slot
/// (`h` at `0..H`, `c` at `H..2H`).
///
/// Parallel over `threads` when large enough: call it inside the backend pool's `install`.
/// Panics if a slice is shorter than its shape says, a child range is outside `child_slots`, or a
/// slot is out of range.
#[allow(clippy::too_many_arguments)]
pub fn tree_step(
    cell: &TreeCell,
    x: &[f32],
    rows: &[TreeRow],
    child_slots: &[u32],
    padded: usize,
    arena: &StateArena,
    scratch: &mut TreeScratch,
    h_out: &mut [f32],
    threads: Threads,
) {
    let (e, hd) = (cell.embed, cell.hidden);
    assert!(rows.len() <= padded, "{} rows in a batch padded to {padded}", rows.len());
    assert!(x.len() >= padded * e, "x holds {} values, needs {}", x.len(), padded * e);
    assert!(h_out.len() >= padded * hd, "h_out holds {} values, needs {}", h_out.len(), padded * hd);
    assert!(
        arena.width() >= 2 * hd,
        "TreeLSTM state of 2·{hd} values does not fit slots of {}",
        arena.width()
    );
    if padded == 0 {
        return;
    }
    // Children, flattened in row order.
    scratch.start.clear();
    scratch.child.clear();
    for row in rows {
        assert!(
            row.children.start <= row.children.end && row.children.end <= child_slots.len(),
            "children {:?} outside the {} child slots",
            row.children,
            child_slots.len()
        );
        scratch.start.push(scratch.child.len());
        scratch.child.extend_from_slice(&child_slots[row.children.clone()]);
    }
    let total = scratch.child.len();
    scratch.start.resize(padded + 1, total);
    let parallel = threads.0 > 1 && (padded + total) * hd >= PARALLEL_MIN_VALUES;

    ensure(&mut scratch.gx, padded * 4 * hd);
    ensure(&mut scratch.c, padded * hd);
    let gx = &mut scratch.gx[..padded * 4 * hd];
    matmul(x, &cell.wx, gx, padded, false, threads);

    if total > 0 {
        ensure(&mut scratch.ht, padded * hd);
        ensure(&mut scratch.gu, padded * 3 * hd);
        for v in [&mut scratch.hc, &mut scratch.cc, &mut scratch.fu] {
            ensure(v, total * hd);
        }
        let (hc, cc) = (&mut scratch.hc[..total * hd], &mut scratch.cc[..total * hd]);
        let child = &scratch.child[..];
        let gather = |q: usize, (hr, cr): (&mut [f32], &mut [f32])| {
            arena.read(child[q], 0, hr);
            arena.read(child[q], hd, cr);
        };
        if parallel {
            hc.par_chunks_mut(hd)
                .zip(cc.par_chunks_mut(hd))
                .with_min_len(task_rows(2 * hd))
                .enumerate()
                .for_each(|(q, b)| gather(q, b));
        } else {
            hc.chunks_exact_mut(hd).zip(cc.chunks_exact_mut(hd)).enumerate().for_each(|(q, b)| gather(q, b));
        }
        let hc = &*hc;
        let start = &scratch.start[..];
        let sum = |r: usize, ht: &mut [f32]| {
            ht.fill(0.0);
            for hk in hc[start[r] * hd..start[r + 1] * hd].chunks_exact(hd) {
                ht.iter_mut().zip(hk).for_each(|(a, b)| *a += b);
            }
        };
        let ht = &mut scratch.ht[..padded * hd];
        if parallel {
            ht.par_chunks_mut(hd).with_min_len(task_rows(hd)).enumerate().for_each(|(r, t)| sum(r, t));
        } else {
            ht.chunks_exact_mut(hd).enumerate().for_each(|(r, t)| sum(r, t));
        }
        matmul(ht, &cell.u_iou, &mut scratch.gu[..padded * 3 * hd], padded, false, threads);
        matmul(hc, &cell.u_f, &mut scratch.fu[..total * hd], total, false, threads);
    }

    // Pointwise + scatter.
    let gx = &scratch.gx[..padded * 4 * hd];
    let gu = if total > 0 { Some(&scratch.gu[..padded * 3 * hd]) } else { None };
    let (cc, fu) = (&scratch.cc[..total * hd], &scratch.fu[..total * hd]);
    let start = &scratch.start[..];
    let bx = &cell.bx[..];
    let point = |r: usize, (cr, hr): (&mut [f32], &mut [f32])| {
        let children = start[r] * hd..start[r + 1] * hd;
        tree_pointwise(
            &gx[r * 4 * hd..(r + 1) * 4 * hd],
            gu.map(|gu| &gu[r * 3 * hd..(r + 1) * 3 * hd]),
            bx,
            &fu[children.clone()],
            &cc[children],
            cr,
            hr,
        );
        if let Some(row) = rows.get(r) {
            arena.write(row.slot, 0, hr);
            arena.write(row.slot, hd, cr);
        }
    };
    let c = &mut scratch.c[..padded * hd];
    let h_out = &mut h_out[..padded * hd];
    if parallel {
        c.par_chunks_mut(hd)
            .zip(h_out.par_chunks_mut(hd))
            .with_min_len(task_rows(4 * hd))
            .enumerate()
            .for_each(|(r, b)| point(r, b));
    } else {
        c.chunks_exact_mut(hd).zip(h_out.chunks_exact_mut(hd)).enumerate().for_each(|(r, b)| point(r, b));
    }
}

/// One node's gates. `gx`: `x`-side pre-activations (`4H`: i, o, u, f); `gu`: `h̃ · U_iouᵀ`
/// (`3H`) unless no node of the step has children; `bx`: biases (`4H`); `fu`, `cc`: the node's
/// children's `h_k · U_fᵀ` and `c_k` (`children × H`); `c`, `h`: outputs.
fn tree_pointwise(
    gx: &[f32],
    gu: Option<&[f32]>,
    bx: &[f32],
    fu: &[f32],
    cc: &[f32],
    c: &mut [f32],
    h: &mut [f32],
) {
    let hd = h.len();
    let c = &mut c[..hd];
    let (gi, rest) = gx[..4 * hd].split_at(hd);
    let (go, rest) = rest.split_at(hd);
    let (gu_, gf) = rest.split_at(hd);
    let (bi, rest) = bx[..4 * hd].split_at(hd);
    let (bo, rest) = rest.split_at(hd);
    let (bu, bf) = rest.split_at(hd);
    // c = i ⊙ u, and o parked in h.
    match gu {
        Some(gu) => {
            let (ui, rest) = gu[..3 * hd].split_at(hd);
            let (uo, uu) = rest.split_at(hd);
            for j in 0..hd {
                let i = sigmoid(gi[j] + bi[j] + ui[j]);
                h[j] = sigmoid(go[j] + bo[j] + uo[j]);
                c[j] = i * tanh(gu_[j] + bu[j] + uu[j]);
            }
        }
        None => {
            for j in 0..hd {
                let i = sigmoid(gi[j] + bi[j]);
                h[j] = sigmoid(go[j] + bo[j]);
                c[j] = i * tanh(gu_[j] + bu[j]);
            }
        }
    }
    // + Σ_k f_k ⊙ c_k
    for (fk, ck) in fu.chunks_exact(hd).zip(cc.chunks_exact(hd)) {
        let (fk, ck) = (&fk[..hd], &ck[..hd]);
        for j in 0..hd {
            c[j] += sigmoid(gf[j] + bf[j] + fk[j]) * ck[j];
        }
    }
    for j in 0..hd {
        h[j] *= tanh(c[j]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::test_util::{Pool, pool, slot_values};
    use crate::workload::values;

    /// PyTorch-layout tensors and the f64 reference cell.
    struct Torch {
        w_iou: Vec<f32>,
        b_iou: Vec<f32>,
        u_iou: Vec<f32>,
        w_f: Vec<f32>,
        b_f: Vec<f32>,
        u_f: Vec<f32>,
        e: usize,
        h: usize,
    }

    impl Torch {
        fn new(e: usize, h: usize, seed: u64) -> Torch {
            let s = 1.0 / (h as f32).sqrt();
            Torch {
                w_iou: values(3 * h * e, seed, s),
                b_iou: values(3 * h, seed + 1, s),
                u_iou: values(3 * h * h, seed + 2, s),
                w_f: values(h * e, seed + 3, s),
                b_f: values(h, seed + 4, s),
                u_f: values(h * h, seed + 5, s),
                e,
                h,
            }
        }

        fn cell(&self) -> TreeCell {
            TreeCell::from_torch(
                &self.w_iou,
                &self.b_iou,
                &self.u_iou,
                &self.w_f,
                &self.b_f,
                &self.u_f,
                self.e,
                self.h,
            )
        }

        /// (h, c) of a node with input `x` and children states.
        fn node(&self, x: &[f32], children: &[(Vec<f64>, Vec<f64>)]) -> (Vec<f64>, Vec<f64>) {
            let (e, hd) = (self.e, self.h);
            let affine = |w: &[f32], b: &[f32], u: &[f32], j: usize, hv: &[f64]| {
                let mut acc = b[j] as f64;
                for i in 0..e {
                    acc += w[j * e + i] as f64 * x[i] as f64;
                }
                for i in 0..hd {
                    acc += u[j * hd + i] as f64 * hv[i];
                }
                acc
            };
            let sig = |v: f64| 1.0 / (1.0 + (-v).exp());
            let mut htilde = vec![0.0; hd];
            for (hk, _) in children {
                for j in 0..hd {
                    htilde[j] += hk[j];
                }
            }
            let (mut h, mut c) = (vec![0.0; hd], vec![0.0; hd]);
            for j in 0..hd {
                let i = sig(affine(&self.w_iou, &self.b_iou, &self.u_iou, j, &htilde));
                let o = sig(affine(&self.w_iou, &self.b_iou, &self.u_iou, hd + j, &htilde));
                let u = affine(&self.w_iou, &self.b_iou, &self.u_iou, 2 * hd + j, &htilde).tanh();
                c[j] = i * u;
                for (hk, ck) in children {
                    c[j] += sig(affine(&self.w_f, &self.b_f, &self.u_f, j, hk)) * ck[j];
                }
                h[j] = o * c[j].tanh();
            }
            (h, c)
        }
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!((g as f64 - w).abs() <= 1e-5 * w.abs().max(1.0), "{what}[{j}]: got {g}, want {w}");
        }
    }

    /// A step: nodes (slot, input, child node ids) over `padded` rows; checks h_out, the slots,
    /// and that other slots are untouched; records each node's state in `states[slot]`.
    #[allow(clippy::too_many_arguments)]
    fn check_step(
        t: &Torch,
        cell: &TreeCell,
        arena: &StateArena,
        scratch: &mut TreeScratch,
        states: &mut [Option<(Vec<f64>, Vec<f64>)>],
        nodes: &[(u32, Vec<u32>)],
        padded: usize,
        threads: Threads,
        pool: &Pool,
        seed: u64,
    ) {
        let (e, hd) = (t.e, t.h);
        let mut child_slots = vec![99u32]; // an unused leading entry: ranges need not start at 0
        let rows: Vec<TreeRow> = nodes
            .iter()
            .map(|(slot, ch)| {
                let start = child_slots.len();
                child_slots.extend(ch);
                TreeRow { slot: *slot, children: start..child_slots.len() }
            })
            .collect();
        let mut x = values(padded * e, seed, 1.0);
        x[nodes.len() * e..].fill(0.0);
        let before: Vec<Vec<f32>> = (0..arena.slots() as u32).map(|s| slot_values(arena, s)).collect();
        let mut h_out = vec![f32::NAN; padded * hd];
        pool.install(|| {
            tree_step(cell, &x, &rows, &child_slots, padded, arena, scratch, &mut h_out, threads)
        });
        let mut new = Vec::new();
        for r in 0..padded {
            let children: Vec<(Vec<f64>, Vec<f64>)> = match nodes.get(r) {
                Some((_, ch)) => {
                    ch.iter().map(|&k| states[k as usize].clone().expect("child computed")).collect()
                }
                None => Vec::new(),
            };
            let (h, c) = t.node(&x[r * e..(r + 1) * e], &children);
            let what = format!("padded {padded} {threads:?} row {r} ({} children)", children.len());
            assert_close(&h_out[r * hd..(r + 1) * hd], &h, &format!("{what} h_out"));
            if let Some((slot, _)) = nodes.get(r) {
                let v = slot_values(arena, *slot);
                assert_close(&v[..hd], &h, &format!("{what} slot h"));
                assert_close(&v[hd..2 * hd], &c, &format!("{what} slot c"));
                assert_eq!(&v[2 * hd..], &before[*slot as usize][2 * hd..], "{what}: rest of the slot");
                new.push((*slot, (h, c)));
            }
        }
        for s in 0..arena.slots() as u32 {
            if !nodes.iter().any(|n| n.0 == s) {
                assert_eq!(slot_values(arena, s), before[s as usize], "untouched slot {s}");
            }
        }
        for (slot, st) in new {
            states[slot as usize] = Some(st);
        }
    }

    #[test]
    fn tree_of_three_levels_with_a_three_child_node() {
        let (e, hd) = (4, 5);
        let t = Torch::new(e, hd, 3);
        let cell = t.cell();
        assert_eq!((cell.embed(), cell.hidden()), (e, hd));
        let pool = pool();
        for threads in pool.threads() {
            // Slots have room for 2H + 1 values; 10 slots, in scrambled use.
            let arena = StateArena::new(10, 2 * hd + 1).unwrap();
            for s in 0..10 {
                arena.write(s, 0, &values(2 * hd + 1, 50 + s as u64, 3.0));
            }
            let mut states = vec![None; 10];
            let mut scratch = TreeScratch::new();
            scratch.reserve(8, 4, hd).unwrap();
            // Leaves 7, 2, 5, 0 (leaf-only task, padded to 6).
            let leaves = [7, 2, 5, 0].map(|s| (s, vec![]));
            check_step(&t, &cell, &arena, &mut scratch, &mut states, &leaves, 6, threads, &pool, 1);
            // Node 9 with children 7, 2, 5; node 3 with child 0; and a leaf 4 in the same step.
            let mid = [(9, vec![7, 2, 5]), (4, vec![]), (3, vec![0])];
            check_step(&t, &cell, &arena, &mut scratch, &mut states, &mid, 4, threads, &pool, 2);
            // Root 1 over 9 and 3.
            check_step(
                &t,
                &cell,
                &arena,
                &mut scratch,
                &mut states,
                &[(1, vec![9, 3])],
                2,
                threads,
                &pool,
                3,
            );
        }
    }

    #[test]
    fn tree_step_matches_reference_for_batch_sizes() {
        let pool = pool();
        let (e, hd) = (6, 7);
        let t = Torch::new(e, hd, 9);
        let cell = t.cell();
        let sizes: &[usize] = if cfg!(miri) { &[1, 3] } else { &[1, 3, 17, 64] };
        for &n in sizes {
            for threads in pool.threads() {
                let slots = 2 * n + 1;
                let arena = StateArena::new(slots, 2 * hd).unwrap();
                let mut order: Vec<u32> = (0..slots as u32).collect();
                order.sort_by_key(|&s| (s as u64 * 2_654_435_761) % 1009);
                let mut states = vec![None; slots];
                let mut scratch = TreeScratch::new(); // grown on demand
                let leaves: Vec<(u32, Vec<u32>)> = order[..n].iter().map(|&s| (s, vec![])).collect();
                check_step(&t, &cell, &arena, &mut scratch, &mut states, &leaves, n + 2, threads, &pool, 4);
                // Parents with 0..=3 children each, drawn from the leaves (nodes may share children
                // here: the kernel does not care).
                let parents: Vec<(u32, Vec<u32>)> = (0..n)
                    .map(|p| (order[n + p], (0..p % 4).map(|k| order[(p * 5 + k * 3) % n]).collect()))
                    .collect();
                check_step(&t, &cell, &arena, &mut scratch, &mut states, &parents, n + 1, threads, &pool, 5);
            }
        }
    }

    #[test]
    fn tree_step_parallel_kernels_match_reference() {
        if cfg!(miri) {
            return;
        }
        let pool = pool();
        let (e, hd) = (16, 64);
        let t = Torch::new(e, hd, 17);
        let cell = t.cell();
        let n = 260;
        const { assert!((260 + 8) * 64 >= PARALLEL_MIN_VALUES) };
        for threads in pool.threads() {
            let arena = StateArena::new(2 * n, 2 * hd).unwrap();
            let mut states = vec![None; 2 * n];
            let mut scratch = TreeScratch::new();
            scratch.reserve(n + 8, 3 * n, hd).unwrap();
            let leaves: Vec<(u32, Vec<u32>)> = (0..n as u32).map(|s| (2 * s, vec![])).collect();
            check_step(&t, &cell, &arena, &mut scratch, &mut states, &leaves, n + 8, threads, &pool, 6);
            let parents: Vec<(u32, Vec<u32>)> = (0..n as u32)
                .map(|p| (2 * p + 1, (0..p % 4).map(|k| 2 * ((p + 7 * k) % n as u32)).collect()))
                .collect();
            check_step(&t, &cell, &arena, &mut scratch, &mut states, &parents, n + 8, threads, &pool, 7);
        }
    }

    #[test]
    fn scratch_reserve_reports_unavailable() {
        let mut s = TreeScratch::new();
        assert_eq!(s.reserve(usize::MAX / 2, 1, 8).unwrap_err().code(), Code::Unavailable);
        assert_eq!(s.reserve(1, usize::MAX / 2, 8).unwrap_err().code(), Code::Unavailable);
        s.reserve(3, 5, 4).unwrap();
        assert!(s.gx.len() >= 48 && s.hc.len() >= 20);
    }

    #[test]
    #[should_panic(expected = "outside the 2 child slots")]
    fn child_range_outside_child_slots_panics() {
        let t = Torch::new(2, 2, 1);
        let arena = StateArena::new(4, 4).unwrap();
        let rows = [TreeRow { slot: 0, children: 1..3 }];
        tree_step(
            &t.cell(),
            &[0.0; 2],
            &rows,
            &[1, 2],
            1,
            &arena,
            &mut TreeScratch::new(),
            &mut [0.0; 2],
            Threads(1),
        );
    }
}
