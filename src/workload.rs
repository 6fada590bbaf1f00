//! The standard workloads of ARCHITECTURE.md §8, defined once for benches, the CLI and tests.
//!
//! Every generator is deterministic per seed: the same arguments give the same sequence on every
//! machine (`StdRng` seeded with [`SeedableRng::seed_from_u64`]).
//!
//! * [`poisson_arrivals`] — Poisson arrivals at rate λ: exponential inter-arrival times.
//! * [`wmt_lengths`] — WMT-like sentence lengths: log-normal, mean 24, clipped to [1, 330],
//!   about 99 % below 100 (BatchMaker Fig. 10).
//! * [`diurnal`] — E²bird §8.2: [`DIURNAL_LOW_REQUESTS`] arrivals at a low rate, then
//!   [`DIURNAL_HIGH_REQUESTS`] at a high rate.
//! * [`treebank_tree`] / [`treebank_trees`] — TreeBank-like trees: random binary parse trees
//!   whose leaf count is log-normal with mean 19 (the Stanford Sentiment Treebank's sentence
//!   length), clipped to [1, 100].
//! * [`values`] — deterministic values in `[-scale, scale)`: weights and inputs of the kernels'
//!   tests and benchmarks (one generator, so CPU and GPU checks can share data by seed).

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Exp, LogNormal};

/// Mean of the WMT-like length distribution.
pub const WMT_MEAN_LEN: f64 = 24.0;
/// Shortest WMT-like length.
pub const WMT_MIN_LEN: usize = 1;
/// Longest WMT-like length.
pub const WMT_MAX_LEN: usize = 330;
/// `σ` of the underlying normal: chosen so that P(length < 100) ≈ 0.99 given the mean 24
/// (solving `μ + σ²/2 = ln 24` and `μ + 2.326·σ = ln 100`).
pub const WMT_SIGMA: f64 = 0.7276;

/// Mean leaf count of a TreeBank-like tree (words per sentence).
pub const TREEBANK_MEAN_LEAVES: f64 = 19.0;
/// Fewest leaves of a TreeBank-like tree.
pub const TREEBANK_MIN_LEAVES: usize = 1;
/// Most leaves of a TreeBank-like tree (so at most `2·100 − 1 = 199` nodes).
pub const TREEBANK_MAX_LEAVES: usize = 100;
/// Most nodes of a TreeBank-like tree.
pub const TREEBANK_MAX_NODES: usize = 2 * TREEBANK_MAX_LEAVES - 1;

/// Arrivals in the low-rate phase of [`diurnal`].
pub const DIURNAL_LOW_REQUESTS: usize = 150;
/// Arrivals in the high-rate phase of [`diurnal`].
pub const DIURNAL_HIGH_REQUESTS: usize = 250;

fn check_rate(rate: f64) {
    assert!(rate.is_finite() && rate > 0.0, "an arrival rate must be positive and finite, got {rate}");
}

/// Append `n` arrivals at `rate` per second to `out`, starting after `from`.
fn extend_poisson(out: &mut Vec<Duration>, rng: &mut StdRng, rate: f64, n: usize, from: f64) {
    // Exp::new fails only for a negative or NaN λ, which check_rate excluded.
    let exp = Exp::new(rate).expect("rate checked positive");
    let mut t = from;
    out.extend((0..n).map(|_| {
        t += rng.sample(exp);
        Duration::from_secs_f64(t)
    }));
}

/// Offsets from the start of a run of `n` Poisson arrivals at `rate` requests per second: the gaps
/// (the first offset included) are independent exponentials of mean `1 / rate`. Non-decreasing.
///
/// # Panics
/// If `rate` is not positive and finite.
pub fn poisson_arrivals(rate: f64, n: usize, seed: u64) -> Vec<Duration> {
    check_rate(rate);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n);
    extend_poisson(&mut out, &mut rng, rate, n, 0.0);
    out
}

/// The diurnal workload of E²bird §8.2: [`DIURNAL_LOW_REQUESTS`] Poisson arrivals at `low_rate`,
/// then [`DIURNAL_HIGH_REQUESTS`] at `high_rate`, as offsets from the start (non-decreasing).
///
/// # Panics
/// If a rate is not positive and finite.
pub fn diurnal(low_rate: f64, high_rate: f64, seed: u64) -> Vec<Duration> {
    check_rate(low_rate);
    check_rate(high_rate);
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(DIURNAL_LOW_REQUESTS + DIURNAL_HIGH_REQUESTS);
    extend_poisson(&mut out, &mut rng, low_rate, DIURNAL_LOW_REQUESTS, 0.0);
    let switch = out.last().map_or(0.0, Duration::as_secs_f64);
    extend_poisson(&mut out, &mut rng, high_rate, DIURNAL_HIGH_REQUESTS, switch);
    out
}

/// `n` WMT-like sentence lengths: log-normal with mean [`WMT_MEAN_LEN`] and σ [`WMT_SIGMA`]
/// (about 99 % below 100), rounded to the nearest integer and clipped to
/// [[`WMT_MIN_LEN`], [`WMT_MAX_LEN`]].
pub fn wmt_lengths(n: usize, seed: u64) -> Vec<usize> {
    let mu = WMT_MEAN_LEN.ln() - WMT_SIGMA * WMT_SIGMA / 2.0;
    let dist = LogNormal::new(mu, WMT_SIGMA).expect("constant parameters are valid");
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let x: f64 = rng.sample(dist);
            // `as` saturates; the clamp then bounds it.
            (x.round() as usize).clamp(WMT_MIN_LEN, WMT_MAX_LEN)
        })
        .collect()
}

/// The number of leaves of one TreeBank-like tree: log-normal with mean
/// [`TREEBANK_MEAN_LEAVES`] and the same shape (σ = [`WMT_SIGMA`]) as the WMT-like lengths,
/// rounded and clipped to [[`TREEBANK_MIN_LEAVES`], [`TREEBANK_MAX_LEAVES`]] (clipping moves the
/// mean by well under 1 %).
pub fn treebank_leaves<R: Rng + ?Sized>(rng: &mut R) -> usize {
    let mu = TREEBANK_MEAN_LEAVES.ln() - WMT_SIGMA * WMT_SIGMA / 2.0;
    let dist = LogNormal::new(mu, WMT_SIGMA).expect("constant parameters are valid");
    let x: f64 = rng.sample(dist);
    (x.round() as usize).clamp(TREEBANK_MIN_LEAVES, TREEBANK_MAX_LEAVES)
}

/// One TreeBank-like tree as parent indices (`-1` for the root; the `parents` of a `treelstm`
/// request, ARCHITECTURE.md §6).
///
/// The leaf count comes from [`treebank_leaves`]; the shape is a random binary parse of the
/// sentence: starting from the leaves as single-word spans, two *adjacent* spans chosen uniformly
/// at random are merged under a new internal node until one span (the root) is left. So a tree
/// of `L` leaves has `2L − 1` nodes, every internal node has exactly two children, and the leaves
/// read left to right are the sentence in order.
///
/// Nodes are numbered in **post-order** (left subtree, right subtree, node): children come before
/// their parent, the root is the last node, and the leaves appear in sentence order.
pub fn treebank_tree<R: Rng + ?Sized>(rng: &mut R) -> Vec<i32> {
    let leaves = treebank_leaves(rng);
    // Build with leaves 0..L and internal nodes L.. in merge order; `kids[i - L]` are the two
    // children of internal node i.
    let mut spans: Vec<usize> = (0..leaves).collect();
    let mut kids: Vec<[usize; 2]> = Vec::with_capacity(leaves.saturating_sub(1));
    while spans.len() > 1 {
        let i = rng.random_range(0..spans.len() - 1);
        let node = leaves + kids.len();
        kids.push([spans[i], spans[i + 1]]);
        spans[i] = node;
        spans.remove(i + 1);
    }
    let root = spans[0];
    // Post-order numbering by an explicit stack (trees may be 100 levels deep).
    let n = leaves + kids.len();
    let mut order = vec![usize::MAX; n];
    let mut parent_of = vec![-1i64; n];
    let mut next = 0usize;
    let mut stack = vec![(root, false)];
    while let Some((v, expanded)) = stack.pop() {
        if v < leaves || expanded {
            order[v] = next;
            next += 1;
        } else {
            let [l, r] = kids[v - leaves];
            parent_of[l] = v as i64;
            parent_of[r] = v as i64;
            stack.push((v, true));
            stack.push((r, false));
            stack.push((l, false));
        }
    }
    let mut parents = vec![-1i32; n];
    for v in 0..n {
        if parent_of[v] >= 0 {
            parents[order[v]] = order[parent_of[v] as usize] as i32;
        }
    }
    parents
}

/// `n` TreeBank-like trees ([`treebank_tree`]), deterministic per `seed`.
pub fn treebank_trees(n: usize, seed: u64) -> Vec<Vec<i32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n).map(|_| treebank_tree(&mut rng)).collect()
}

/// `n` deterministic values in `[-scale, scale)` from `seed` (a 64-bit LCG: fast, and the same
/// on every machine), for kernels' test and benchmark data.
pub fn values(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(offsets: &[Duration]) -> Vec<f64> {
        let mut prev = 0.0;
        offsets
            .iter()
            .map(|d| {
                let t = d.as_secs_f64();
                let g = t - prev;
                prev = t;
                g
            })
            .collect()
    }

    fn mean(v: &[f64]) -> f64 {
        v.iter().sum::<f64>() / v.len() as f64
    }

    #[test]
    fn poisson_gaps_are_exponential_with_the_right_mean() {
        let rate = 1000.0;
        let a = poisson_arrivals(rate, 20_000, 7);
        assert_eq!(a.len(), 20_000);
        assert!(a.windows(2).all(|w| w[0] <= w[1]), "offsets are non-decreasing");
        let g = gaps(&a);
        let m = mean(&g);
        // Standard error of the mean is 1/(rate·√n) ≈ 0.7 %; allow 3 %.
        assert!((m * rate - 1.0).abs() < 0.03, "mean gap {m}");
        // An exponential has standard deviation equal to its mean (coefficient of variation 1).
        let sd = (g.iter().map(|x| (x - m).powi(2)).sum::<f64>() / g.len() as f64).sqrt();
        assert!((sd / m - 1.0).abs() < 0.05, "coefficient of variation {}", sd / m);
        // Memoryless: P(gap > mean) = e^-1.
        let above = g.iter().filter(|&&x| x > 1.0 / rate).count() as f64 / g.len() as f64;
        assert!((above - (-1.0f64).exp()).abs() < 0.02, "P(gap > mean) = {above}");
    }

    #[test]
    fn poisson_is_deterministic_per_seed() {
        assert_eq!(poisson_arrivals(250.0, 100, 3), poisson_arrivals(250.0, 100, 3));
        assert_ne!(poisson_arrivals(250.0, 100, 3), poisson_arrivals(250.0, 100, 4));
        assert!(poisson_arrivals(250.0, 0, 3).is_empty());
    }

    #[test]
    #[should_panic(expected = "positive and finite")]
    fn poisson_rejects_a_zero_rate() {
        poisson_arrivals(0.0, 10, 1);
    }

    #[test]
    fn wmt_lengths_match_the_published_shape() {
        let l = wmt_lengths(100_000, 11);
        assert!(l.iter().all(|&x| (WMT_MIN_LEN..=WMT_MAX_LEN).contains(&x)), "clipping respected");
        let m = l.iter().sum::<usize>() as f64 / l.len() as f64;
        assert!((m - WMT_MEAN_LEN).abs() < 0.5, "mean length {m}");
        let below_100 = l.iter().filter(|&&x| x < 100).count() as f64 / l.len() as f64;
        assert!((0.985..0.995).contains(&below_100), "P(len < 100) = {below_100}");
        assert!(l.iter().any(|&x| x <= 3) && l.iter().any(|&x| x >= 100), "both tails present");
        assert_eq!(wmt_lengths(50, 5), wmt_lengths(50, 5));
        assert_ne!(wmt_lengths(50, 5), wmt_lengths(50, 6));
    }

    #[test]
    fn wmt_lengths_reach_the_minimum_and_stay_bounded() {
        // A sample large enough to draw values that round to 0 and (rarely) exceed the maximum:
        // none may escape the bounds.
        let l = wmt_lengths(200_000, 1);
        assert_eq!(l.iter().min(), Some(&WMT_MIN_LEN));
        assert!(*l.iter().max().unwrap() <= WMT_MAX_LEN);
    }

    #[test]
    fn diurnal_has_a_low_then_a_high_phase() {
        let (low, high) = (100.0, 1000.0);
        // Pool several seeds so the phase means are tight (3000 and 5000 gaps).
        let (mut lo, mut hi) = (Vec::new(), Vec::new());
        for seed in 0..20 {
            let a = diurnal(low, high, seed);
            assert_eq!(a.len(), DIURNAL_LOW_REQUESTS + DIURNAL_HIGH_REQUESTS);
            assert!(a.windows(2).all(|w| w[0] <= w[1]), "offsets are non-decreasing");
            let g = gaps(&a);
            lo.extend_from_slice(&g[..DIURNAL_LOW_REQUESTS]);
            hi.extend_from_slice(&g[DIURNAL_LOW_REQUESTS..]);
        }
        let (ml, mh) = (mean(&lo), mean(&hi));
        assert!((ml * low - 1.0).abs() < 0.06, "low-phase mean gap {ml}");
        assert!((mh * high - 1.0).abs() < 0.06, "high-phase mean gap {mh}");
        assert_eq!(diurnal(low, high, 9), diurnal(low, high, 9));
    }

    /// Leaves of a valid tree given as parents, or a panic saying what is wrong.
    fn check_tree(parents: &[i32]) -> usize {
        let n = parents.len();
        let roots: Vec<usize> = (0..n).filter(|&i| parents[i] == -1).collect();
        assert_eq!(roots.len(), 1, "exactly one root: {parents:?}");
        let mut children = vec![0usize; n];
        for (i, &p) in parents.iter().enumerate() {
            if p != -1 {
                assert!((0..n as i32).contains(&p), "parent in range: {parents:?}");
                // Post-order: a parent comes after its children.
                assert!(p as usize > i, "node {i} before its parent {p}: {parents:?}");
                children[p as usize] += 1;
            }
        }
        assert_eq!(roots[0], n - 1, "the root is the last node in post-order");
        assert!(children.iter().all(|&c| c == 0 || c == 2), "binary: {children:?}");
        let leaves = children.iter().filter(|&&c| c == 0).count();
        assert_eq!(n, 2 * leaves - 1, "2·leaves − 1 nodes");
        // Every node reaches the root (no cycles): parents increase, so the walk ends.
        for start in 0..n {
            let (mut v, mut steps) = (start, 0);
            while parents[v] != -1 {
                v = parents[v] as usize;
                steps += 1;
                assert!(steps <= n, "cycle");
            }
            assert_eq!(v, roots[0]);
        }
        leaves
    }

    #[test]
    fn treebank_trees_are_valid_binary_parse_trees_with_mean_19_leaves() {
        let trees = treebank_trees(20_000, 5);
        let leaves: Vec<usize> = trees.iter().map(|t| check_tree(t)).collect();
        let m = leaves.iter().sum::<usize>() as f64 / leaves.len() as f64;
        // σ of the sample mean is about 0.1 leaves; allow 3 %.
        assert!((m / TREEBANK_MEAN_LEAVES - 1.0).abs() < 0.03, "mean leaves {m}");
        assert!(leaves.iter().all(|l| (TREEBANK_MIN_LEAVES..=TREEBANK_MAX_LEAVES).contains(l)));
        assert!(leaves.contains(&1), "single-word sentences occur");
        assert!(leaves.iter().any(|&l| l >= 60), "long sentences occur");
        assert!(trees.iter().all(|t| t.len() <= TREEBANK_MAX_NODES));
        // Shapes vary: not every tree of a given size is a chain (depth = leaves − 1).
        let depth = |t: &[i32]| {
            (0..t.len())
                .map(|mut v| {
                    let mut d = 0;
                    while t[v] != -1 {
                        v = t[v] as usize;
                        d += 1;
                    }
                    d
                })
                .max()
                .unwrap_or(0)
        };
        let big: Vec<&Vec<i32>> = trees.iter().filter(|t| t.len() >= 39).take(200).collect();
        assert!(big.iter().any(|t| depth(t) < t.len().div_ceil(2) - 1), "some trees are bushy");
        assert_eq!(treebank_trees(30, 9), treebank_trees(30, 9));
        assert_ne!(treebank_trees(30, 9), treebank_trees(30, 10));
    }

    #[test]
    fn treebank_trees_pass_the_model_validation() {
        for t in treebank_trees(200, 3) {
            let tree = crate::model::treelstm::validate_tree(&t, TREEBANK_MAX_NODES).expect("valid tree");
            assert_eq!(tree.root as usize, t.len() - 1);
            assert!(tree.children.iter().all(|c| c.is_empty() || c.len() == 2));
        }
    }
}
