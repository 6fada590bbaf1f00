//! Which kernel versions of a layer to keep (VELTAIR Alg. 1, steps 2–5), from candidates that
//! were measured (`serve profile --versions`) or modelled (the tenant simulator's cost model).
//! A candidate is described by its locality (the working set of one tile, bytes) and its
//! parallelism (independent tiles); the steps:
//!
//! 2. keep those within the layer's budget on all cores (the fastest one if none is);
//! 3. the Pareto set: drop a candidate when another has both a smaller working set and fewer
//!    tiles;
//! 4. at most [`MAX_VERSIONS`], evenly spaced by working set (indices `round(k(n−1)/(V−1))`);
//! 5. with each kept version timed at every interference level (on the layer's lease), drop
//!    versions greedily while the others still reach 90% of the kept set's best at every level.
//!
//! Steps 2–4 are [`spread`], step 5 [`prune`]: the caller times the versions [`spread`] kept.

use super::profile::MAX_VERSIONS;

/// A candidate version as steps 2–4 see it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Candidate {
    /// Working set of one tile, bytes.
    pub ws: f64,
    /// Independent tiles.
    pub tiles: usize,
    /// Its fastest time on all cores, solo (µs).
    pub fastest: f64,
}

/// Steps 2–4: the indices of the candidates kept, by ascending working set.
pub fn spread(cands: &[Candidate], budget: f64) -> Vec<usize> {
    let mut within: Vec<usize> = (0..cands.len()).filter(|&i| cands[i].fastest <= budget).collect();
    if within.is_empty() {
        within.extend((0..cands.len()).min_by(|&a, &b| cands[a].fastest.total_cmp(&cands[b].fastest)));
    }
    let mut pareto: Vec<usize> = within
        .iter()
        .copied()
        .filter(|&i| !within.iter().any(|&o| cands[o].ws < cands[i].ws && cands[o].tiles < cands[i].tiles))
        .collect();
    pareto.sort_by(|&a, &b| cands[a].ws.total_cmp(&cands[b].ws).then(cands[a].tiles.cmp(&cands[b].tiles)));
    pareto.dedup_by(|a, b| cands[*a].ws == cands[*b].ws && cands[*a].tiles == cands[*b].tiles);
    let n = pareto.len();
    if n <= MAX_VERSIONS {
        return pareto;
    }
    let mut kept: Vec<usize> = (0..MAX_VERSIONS)
        .map(|k| pareto[(k * (n - 1) + (MAX_VERSIONS - 1) / 2) / (MAX_VERSIONS - 1)])
        .collect();
    kept.dedup();
    kept
}

/// Step 5: given each kept version's time at every level (`times[v][level]`, µs), the indices
/// into `times` of the versions that stay.
pub fn prune(times: &[Vec<f64>]) -> Vec<usize> {
    let levels = times.iter().map(Vec::len).min().unwrap_or(0);
    let best = |set: &[usize], k: usize| set.iter().map(|&v| times[v][k]).fold(f64::INFINITY, f64::min);
    let all: Vec<usize> = (0..times.len()).collect();
    let mut kept = all.clone();
    let mut i = 0;
    while i < kept.len() && kept.len() > 1 {
        let mut rest = kept.clone();
        rest.remove(i);
        if (0..levels).all(|k| best(&all, k) >= 0.9 * best(&rest, k)) {
            kept = rest;
        } else {
            i += 1;
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(ws: f64, tiles: usize, fastest: f64) -> Candidate {
        Candidate { ws, tiles, fastest }
    }

    #[test]
    fn the_budget_then_the_pareto_set_then_five_evenly_spaced() {
        // A trade-off curve of 9 (bigger tiles, fewer of them), one dominated point, one too slow.
        let mut cands: Vec<Candidate> = (0..9).map(|i| c(1e3 * (i + 1) as f64, 90 - 10 * i, 10.0)).collect();
        cands.push(c(5e3, 80, 10.0)); // dominated by (4e3, 60)
        cands.push(c(0.5e3, 100, 500.0)); // over the budget
        let kept = spread(&cands, 100.0);
        assert_eq!(kept.len(), MAX_VERSIONS);
        assert_eq!(kept, vec![0, 2, 4, 6, 8], "evenly spaced along the curve, ends included");
        assert!(kept.windows(2).all(|w| cands[w[0]].ws < cands[w[1]].ws));
        // None within the budget: the fastest alone.
        assert_eq!(spread(&[c(1.0, 1, 50.0), c(2.0, 2, 40.0)], 10.0), vec![1]);
        assert!(spread(&[], 10.0).is_empty());
    }

    #[test]
    fn prune_keeps_a_version_only_where_it_is_needed() {
        // Big tiles win solo and lose under interference; a middle one is never 10% better.
        let times = vec![vec![10.0, 30.0, 60.0], vec![12.0, 25.0, 40.0], vec![14.0, 14.5, 16.0]];
        assert_eq!(prune(&times), vec![0, 2], "the middle version is covered by the other two");
        // One version within 10% everywhere covers the rest.
        assert_eq!(prune(&[vec![10.0, 20.0], vec![10.5, 20.5]]).len(), 1);
        assert_eq!(prune(&[vec![1.0]]), vec![0]);
    }
}
