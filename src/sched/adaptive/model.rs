//! The latency model of adaptive batching with asynchronous transfers (Zhang et al., slides):
//! per-stage linear costs refitted from measured tasks, and the batch size they give for an
//! arrival rate and a latency bound.
//!
//! Every stage `s` ∈ {up, calc, down} takes `T_s(b) = k_s·b + c_s`; `G = ΣT_s = k·b + c`.
//! `C` is the concurrency (arrival rate, requests per second), `F = b/C` the time a batch takes
//! to fill, `L` the latency bound.
//! * **Serial** (one stream): `L_i = max(F_i, G_{i−1}) + G_i`. `F = G` gives
//!   `b*(C) = c·C / (1 − k·C)` (capacity `C < 1/k`); `L = 2G` gives `b_max(L) = (L − 2c) / 2k`.
//! * **Async** (two streams; the download off the critical path):
//!   `L_i = max(F_i + T_up,i, T_calc,i−1) + T_calc,i`. The slides' balance `F + T_up = T_calc`
//!   gives `b*(C) = (c_calc − c_up)·C / (1 − (k_calc − k_up)·C)` ("paper" mode); fills run back
//!   to back, so a stable server needs `b/C ≥ T_calc`, which gives the "exact" mode
//!   `b*(C) = c_calc·C / (1 − k_calc·C)`. `b_max(L) = (L − 2c_calc) / 2k_calc` in both. If
//!   `k_calc ≤ k_up` or `c_calc ≤ c_up` the paper's difference is meaningless: the slower stage
//!   alone is used (as the exact mode does with calc).

use std::collections::VecDeque;
use std::time::Duration;

/// One stage's cost `t(b) = k·b + c`, in seconds.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Linear {
    /// Seconds per row.
    pub k: f64,
    /// Seconds per batch.
    pub c: f64,
}

impl Linear {
    pub fn at(&self, b: f64) -> f64 {
        self.k * b + self.c
    }
}

/// Least-squares fit of one stage over its last `window` measurements (`window` ≥ 2). With every
/// measured batch the same size the slope cannot be seen: the previous slope is kept and the
/// intercept refitted (slope 0 before any).
#[derive(Clone, Debug)]
pub struct StageFit {
    window: usize,
    points: VecDeque<(f64, f64)>,
    fit: Option<Linear>,
}

impl StageFit {
    pub fn new(window: usize) -> StageFit {
        StageFit { window: window.max(2), points: VecDeque::new(), fit: None }
    }

    /// A batch of `rows` rows took `took` in this stage.
    pub fn observe(&mut self, rows: usize, took: Duration) {
        if self.points.len() == self.window {
            self.points.pop_front();
        }
        self.points.push_back((rows as f64, took.as_secs_f64()));
        let n = self.points.len() as f64;
        let (sx, sy) = self.points.iter().fold((0.0, 0.0), |(a, b), &(x, y)| (a + x, b + y));
        let (mx, my) = (sx / n, sy / n);
        let sxx: f64 = self.points.iter().map(|&(x, _)| (x - mx) * (x - mx)).sum();
        let sxy: f64 = self.points.iter().map(|&(x, y)| (x - mx) * (y - my)).sum();
        let k = if sxx > 0.0 { sxy / sxx } else { self.fit.map_or(0.0, |f| f.k) };
        self.fit = Some(Linear { k, c: my - k * mx });
    }

    /// The current fit (`None` before any measurement).
    pub fn fit(&self) -> Option<Linear> {
        self.fit
    }
}

/// One stream (every stage in sequence) or two (the next batch uploads while one computes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Streams {
    Serial,
    Async,
}

/// Which async batch-size formula: the slides' balance, or the back-to-back fills' (see the
/// module documentation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Formula {
    Paper,
    Exact,
}

/// The stage costs of one model.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Stages {
    pub up: Linear,
    pub calc: Linear,
    pub down: Linear,
}

impl Stages {
    /// `G`: every stage of a batch of `b`.
    pub fn total(&self) -> Linear {
        Linear { k: self.up.k + self.calc.k + self.down.k, c: self.up.c + self.calc.c + self.down.c }
    }

    /// The (k, c) the batch size is balanced on: serial G; async calc − up (paper) or calc
    /// (exact), the slower of up and calc when the difference is not positive.
    fn balance(&self, streams: Streams, formula: Formula) -> Linear {
        match (streams, formula) {
            (Streams::Serial, _) => self.total(),
            (Streams::Async, Formula::Exact) => self.slower(),
            (Streams::Async, Formula::Paper) => {
                let (k, c) = (self.calc.k - self.up.k, self.calc.c - self.up.c);
                if k > 0.0 && c > 0.0 { Linear { k, c } } else { self.slower() }
            }
        }
    }

    fn slower(&self) -> Linear {
        if self.up.k > self.calc.k && self.up.c > self.calc.c { self.up } else { self.calc }
    }

    /// The stage that bounds latency: serial G, async calc.
    fn critical(&self, streams: Streams) -> Linear {
        match streams {
            Streams::Serial => self.total(),
            Streams::Async => self.calc,
        }
    }

    /// `b*(C)`: the batch whose fill time matches the server's cycle at `c_rps` arrivals per
    /// second; infinite at or beyond the capacity.
    ///
    /// An unbounded `C` (a backlog filled the batch at once) is infinite whatever the fit: with
    /// the slope still unseen (k = 0) the formula would read `0·∞ = NaN`, and a NaN taken as 0
    /// would keep every batch at 1, so the slope stays unseen and the backlog is never drained.
    pub fn batch_for(&self, c_rps: f64, streams: Streams, formula: Formula) -> f64 {
        if c_rps.is_nan() || c_rps == f64::INFINITY {
            return f64::INFINITY;
        }
        let Linear { k, c } = self.balance(streams, formula);
        let denom = 1.0 - k * c_rps;
        if denom <= 0.0 { f64::INFINITY } else { (c * c_rps / denom).max(0.0) }
    }

    /// The arrival rate beyond which no batch keeps up: `1/k` of the balanced stage.
    pub fn capacity(&self, streams: Streams, formula: Formula) -> f64 {
        let k = self.balance(streams, formula).k;
        if k > 0.0 { 1.0 / k } else { f64::INFINITY }
    }

    /// `b_max(L)`: the largest batch whose latency stays within `bound` (0 when none does).
    pub fn max_batch_within(&self, bound: Duration, streams: Streams) -> f64 {
        let Linear { k, c } = self.critical(streams);
        let l = bound.as_secs_f64();
        if k <= 0.0 {
            return if l >= 2.0 * c { f64::INFINITY } else { 0.0 };
        }
        ((l - 2.0 * c) / (2.0 * k)).max(0.0)
    }

    /// `C_max(L)`: the highest arrival rate served within `bound` (serial `1/k − 2c/(kL)`;
    /// async, the general form `(L − 2c_calc) / ((k_calc − k_up)·L + 2(c_calc·k_up − k_calc·c_up))`,
    /// the slides' `1/(k_calc − k_up) − 2c_calc/((k_calc − k_up)L)` when `c_up/k_up = c_calc/k_calc`).
    pub fn max_rate_within(&self, bound: Duration, streams: Streams) -> f64 {
        let l = bound.as_secs_f64();
        let (num, den) = match streams {
            Streams::Serial => {
                let Linear { k, c } = self.total();
                (l - 2.0 * c, k * l)
            }
            Streams::Async => {
                let (u, x) = (self.up, self.calc);
                (l - 2.0 * x.c, (x.k - u.k) * l + 2.0 * (x.c * u.k - x.k * u.c))
            }
        };
        if num <= 0.0 {
            0.0
        } else if den <= 0.0 {
            f64::INFINITY
        } else {
            num / den
        }
    }
}
