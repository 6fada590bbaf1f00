//! Helpers shared by the benchmarks that time with their own loop (`mod common;`).

use std::time::{Duration, Instant};

/// Seconds per call of `f`: one warm-up call, then calls until `min` has passed (at least 3).
pub fn time_it(mut f: impl FnMut(), min: Duration) -> f64 {
    f();
    let mut reps = 0u32;
    let t0 = Instant::now();
    while t0.elapsed() < min || reps < 3 {
        f();
        reps += 1;
    }
    t0.elapsed().as_secs_f64() / reps as f64
}
