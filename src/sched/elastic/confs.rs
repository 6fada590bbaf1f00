//! E-Ebird's offline half (E²bird §1.5): every engine configuration of a load level, and the
//! pick among their measured scores. The measuring (co-running each configuration on the real
//! backend) is `serve profile --engine-configs`; this is the part with no I/O.
//!
//! A configuration for `TotalBS` is a multiset of worker batch sizes `2^p` summing to `TotalBS`
//! (the paper's vector `[i..n]`: how many workers of batch size 1, 2, 4, 8, 16, 32). They are
//! the binary partitions of `TotalBS`: 4, 10, 36 and 202 of them for 4, 8, 16 and 32.

use std::collections::BTreeMap;

/// The load levels E-Ebird profiles (TotalBS 1 and 2 are not: a bs-1 and a bs-2 worker are
/// always in the engine).
pub const PROFILED_TOTALS: [usize; 4] = [4, 8, 16, 32];

/// Largest TotalBS [`configurations`] enumerates (1,828 configurations at 64; they grow
/// faster than polynomially beyond).
pub const MAX_PROFILED_TOTAL: usize = 64;

/// Every configuration of `total`, each listed largest batch size first, the configurations in
/// descending lexicographic order (the single worker of batch size `total` first, `total`
/// workers of batch size 1 last). Empty when `total` is 0 or above [`MAX_PROFILED_TOTAL`].
pub fn configurations(total: usize) -> Vec<Vec<usize>> {
    fn walk(left: usize, largest: usize, cur: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
        if left == 0 {
            out.push(cur.clone());
            return;
        }
        let mut bs = largest.min(left);
        // The largest power of two ≤ both.
        bs = 1 << (usize::BITS - 1 - bs.leading_zeros());
        while bs >= 1 {
            cur.push(bs);
            walk(left - bs, bs, cur, out);
            cur.pop();
            bs /= 2;
        }
    }
    let mut out = Vec::new();
    if total == 0 || total > MAX_PROFILED_TOTAL {
        return out;
    }
    walk(total, total, &mut Vec::new(), &mut out);
    out
}

/// One configuration as the profiler measured it.
///
/// E²bird scores a configuration by the mean latency over its workers (not the tail). On a GPU
/// co-running streams share the SMs about equally and end together, so that mean, the mean
/// latency of the configuration's *requests* and the time until the last worker ends are about
/// the same. On a CPU the workers' tasks share a compute pool that does not share equally (tasks
/// launched first run first), so a configuration of many batch-1 workers has a small mean over
/// workers while most of its requests wait: the score picked by is the mean over requests (each
/// worker's latency weighted by its batch size), which is what E²bird's measure stands for.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub workers: Vec<usize>,
    /// Mean latency over the requests (what [`pick`] minimises).
    pub mean_ms: f64,
    /// E²bird's measure: mean latency over the workers.
    pub worker_mean_ms: f64,
    /// Until the last worker's end.
    pub makespan_ms: f64,
}

impl Scored {
    /// The scores of one co-run: `ends[i]` is worker `i`'s latency (ms) with batch size
    /// `workers[i]`.
    pub fn from_ends(workers: Vec<usize>, ends: &[f64]) -> Scored {
        let rows: usize = workers.iter().sum();
        let weighted: f64 = workers.iter().zip(ends).map(|(&bs, e)| bs as f64 * e).sum();
        Scored {
            mean_ms: weighted / rows.max(1) as f64,
            worker_mean_ms: ends.iter().sum::<f64>() / ends.len().max(1) as f64,
            makespan_ms: ends.iter().copied().fold(0.0, f64::max),
            workers,
        }
    }
}

/// `EngineConfs`: for each TotalBS, the configuration of least score (a tie goes to the one
/// listed first; a score that is not a finite number never wins). A level whose scores are all
/// non-finite is left out.
pub fn pick(scored: &BTreeMap<usize, Vec<Scored>>) -> BTreeMap<usize, Vec<usize>> {
    scored
        .iter()
        .filter_map(|(&total, list)| {
            list.iter()
                .filter(|s| s.mean_ms.is_finite())
                .fold(None::<&Scored>, |best, s| match best {
                    Some(b) if b.mean_ms <= s.mean_ms => Some(b),
                    _ => Some(s),
                })
                .map(|best| (total, best.workers.clone()))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_levels_have_the_papers_configuration_counts() {
        // E4: 4 + 10 + 36 + 202 = 252.
        let counts: Vec<usize> = PROFILED_TOTALS.iter().map(|&t| configurations(t).len()).collect();
        assert_eq!(counts, [4, 10, 36, 202]);
        for &t in &PROFILED_TOTALS {
            let all = configurations(t);
            let mut distinct = all.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), all.len(), "TotalBS {t}: a configuration listed twice");
            for c in &all {
                assert_eq!(c.iter().sum::<usize>(), t, "{c:?}");
                assert!(c.iter().all(|bs| bs.is_power_of_two()), "{c:?}");
                assert!(c.windows(2).all(|w| w[0] >= w[1]), "{c:?} not largest first");
            }
            assert_eq!(all.first(), Some(&vec![t]));
            assert_eq!(all.last(), Some(&vec![1; t]));
        }
        // Table 4's picks are among them.
        assert!(configurations(16).contains(&vec![8, 4, 4]));
        assert!(configurations(32).contains(&vec![16, 8, 8]));
        assert!(configurations(0).is_empty());
        assert!(configurations(MAX_PROFILED_TOTAL + 1).is_empty());
        assert_eq!(configurations(3), [vec![2, 1], vec![1, 1, 1]]);
    }

    #[test]
    fn the_pick_is_the_least_mean_latency_per_level() {
        let s = |workers: &[usize], mean_ms: f64| Scored {
            workers: workers.to_vec(),
            mean_ms,
            worker_mean_ms: 0.0,
            makespan_ms: 0.0,
        };
        let scored: BTreeMap<usize, Vec<Scored>> = [
            (4, vec![s(&[4], 3.0), s(&[2, 2], 2.5), s(&[2, 1, 1], 2.5), s(&[1, 1, 1, 1], f64::NAN)]),
            // Fig. 12: {8, 8, 16} in 85.3 ms beats one bs-32 worker's 93.7.
            (32, vec![s(&[32], 93.7), s(&[16, 8, 8], 85.3), s(&[16, 16], 90.0)]),
            (8, vec![s(&[8], f64::NAN), s(&[4, 4], f64::INFINITY)]),
        ]
        .into();
        let picked = pick(&scored);
        assert_eq!(picked.get(&4), Some(&vec![2, 2]), "a tie goes to the first listed; NaN never wins");
        assert_eq!(picked.get(&32), Some(&vec![16, 8, 8]));
        assert_eq!(picked.get(&8), None, "no finite score: the level is left out");
    }

    #[test]
    fn a_co_run_is_scored_per_request() {
        // Two batch-1 workers ending at 1 and 2 ms and a batch-2 worker at 4 ms.
        let s = Scored::from_ends(vec![1, 1, 2], &[1.0, 2.0, 4.0]);
        assert_eq!(s.mean_ms, (1.0 + 2.0 + 2.0 * 4.0) / 4.0);
        assert_eq!(s.worker_mean_ms, 7.0 / 3.0);
        assert_eq!(s.makespan_ms, 4.0);
    }
}
