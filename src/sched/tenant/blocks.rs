//! Layer-block formation (VELTAIR Alg. 2, §4.3), as pure functions of the profile, the load and
//! the interference level.
//!
//! * **Threshold** (§4.3): `idle = C − Σ Avg_C` over the active queries (every query in flight,
//!   the caller included), clamped at 0, split in proportion to average need:
//!   `thres_m = idle · Avg_C_m / Σ Avg_C` (64 − (12 + 12 + 24) = 16 → 4, 4, 8). Alg. 3 l. 12
//!   writes the unsplit idle; the split is the text's, and with it `Σ K_m = C`, so blocks within
//!   their caps cannot conflict.
//! * **Pivot**: a layer with `r_l ≥ K_m = Avg_C_m + thres_m` ("conflict-prone").
//! * **Formation of the next block only**, from the first layer not yet run:
//!   - rule **R** (the cap, the reading implemented; [`CapRule::Cap`]): a block that starts at a
//!     non-pivot runs to the next pivot (its `c_B` is then below `K_m`: every layer in it meets
//!     its budget on fewer cores); a block that starts at a pivot absorbs the layers after it,
//!     pivots included, until its `c_B ≤ K_m` or the model ends. Lower `thres` ⇒ longer pivot
//!     blocks ⇒ core usage closer to the average.
//!   - rule **L** (the paper's literal cut, kept as an ablation; [`CapRule::Literal`]): the
//!     block runs from its first layer to the next pivot, whatever its `c_B`. (The paper's code
//!     drops the pivot and loops for ever with no pivot; a pivot here begins a block, as its text
//!     says.)
//!
//! Formation is `O(N · C)` in the block's length (each added layer updates the block's time at
//! every core count once).

use super::profile::{BlockSums, TenantModel, Versions};

/// How a block that starts at a pivot ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CapRule {
    /// R: absorb later layers until `c_B ≤ K_m`.
    Cap,
    /// L: cut at the next pivot.
    Literal,
}

/// `thres_m` of each active query, given each one's `Avg_C` (the split of §4.3).
pub fn thresholds(cores: usize, avg: &[usize]) -> Vec<f64> {
    let total: usize = avg.iter().sum();
    let idle = cores.saturating_sub(total) as f64;
    if total == 0 {
        return vec![0.0; avg.len()];
    }
    avg.iter().map(|&a| idle * a as f64 / total as f64).collect()
}

/// The next block of a query of `m` from layer `start`: its end (exclusive) and `c_B`, under cap
/// `cap = K_m` (`f64::INFINITY`: no cap, the block runs to the end of the model), every budget
/// scaled by `scale` (1: the profile's).
pub fn next_block(
    m: &TenantModel,
    start: usize,
    cap: f64,
    rule: CapRule,
    (versions, level): (Versions, usize),
    scale: f64,
) -> (usize, usize) {
    let n = m.layers().len();
    let pivot = |l: usize| m.need_scaled(l, versions, level, scale) as f64 >= cap;
    let mut sums = BlockSums::new(m.cores());
    let mut end = start;
    let from_pivot = pivot(start);
    let mut neediest = 0;
    loop {
        sums.add(m, end, versions, level, scale);
        neediest = neediest.max(m.need_scaled(end, versions, level, scale));
        end += 1;
        if end == n {
            break;
        }
        let stop = if from_pivot && rule == CapRule::Cap { sums.cores() as f64 <= cap } else { pivot(end) };
        if stop {
            break;
        }
    }
    // A block of layers that each meet their budget on `neediest` cores meets its own there;
    // one with a layer no core count lets meet its budget gains nothing past the cores where
    // its neediest layer is fastest either.
    let cores = if from_pivot { sums.cores() } else { sums.cores().min(neediest) };
    (end, cores)
}

/// A block of the next `len` layers from `start` (fixed-size blocks, layer-wise with `len` 1,
/// model-wise with `len ≥ N`): its end and `c_B`, budgets scaled by `scale`.
pub fn fixed_block(
    m: &TenantModel,
    start: usize,
    len: usize,
    (versions, level): (Versions, usize),
    scale: f64,
) -> (usize, usize) {
    let end = start.saturating_add(len.max(1)).min(m.layers().len());
    let mut sums = BlockSums::new(m.cores());
    for l in start..end {
        sums.add(m, l, versions, level, scale);
    }
    (end, sums.cores())
}
