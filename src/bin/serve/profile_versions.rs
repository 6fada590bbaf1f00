//! `serve profile --versions MxKxN` (issue 16 item 2, ARCHITECTURE.md §7.9): VELTAIR's
//! multi-version kernels of one product, measured on this machine. Every candidate version
//! (`serve::backend::cpu::versions`: outer tiles, loop order, where the parallelism sits) is
//! timed alone on one core and on two, then on one core (core 0) while a memory antagonist on
//! another core streams over 64 MiB at `--levels` intensities (level 0: it sleeps; level L−1: it
//! streams all the time; in between, that share of each millisecond, sleeping the rest). The
//! versions kept follow Alg. 1 (`serve::sched::tenant::versions`: Pareto set over working set and
//! tiles, at most 5 spread by working set, pruned at 90% coverage per level; no layer budget
//! here, so none is dropped for time). It prints whether the version fastest alone loses under
//! the strongest antagonist to one with a smaller working set (the paper's crossover), and
//! whether the pick moves toward smaller tiles as the intensity rises.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::json;

use serve::backend::cpu::affinity::{allowed_cpus, pin};
use serve::backend::cpu::versions::{GemmVersion, candidates};
use serve::sched::tenant::versions::{Candidate, prune, spread};

use crate::bench::{open_report, write_report};
use crate::profile::ProfileArgs;
use crate::{CliResult, fatal};

/// Sweeps over every candidate (and every level), and timed runs per point in each: a point is
/// the median of `SWEEPS × RUNS` runs taken in different sweeps, so that the VM's drift over
/// the measurement falls on every candidate alike.
const SWEEPS: usize = 5;
const RUNS: usize = 3;
/// Bytes the antagonist streams over (past any last-level cache of this machine).
const ANTAGONIST_BYTES: usize = 64 << 20;

/// A thread on `core` that streams over a buffer for `level / (levels − 1)` of each millisecond
/// and sleeps for the rest, until stopped.
struct Antagonist {
    level: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Antagonist {
    /// Start it on `core`; fails if it cannot be pinned there.
    fn start(core: usize, levels: usize) -> CliResult<Antagonist> {
        let level = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (l, s) = (level.clone(), stop.clone());
        let (pinned_tx, pinned_rx) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || {
            let pinned = pin(core);
            let _ = pinned_tx.send(pinned);
            if !pinned {
                return;
            }
            let mut buf = vec![0u64; ANTAGONIST_BYTES / 8];
            let period = Duration::from_millis(1);
            let mut at = 0;
            while !s.load(Ordering::Relaxed) {
                let start = Instant::now();
                let busy = period.mul_f64(l.load(Ordering::Relaxed) as f64 / (levels - 1) as f64);
                while start.elapsed() < busy {
                    // 64 KiB at a time: one read and one write per element, a cache line per 8.
                    let end = (at + 8192).min(buf.len());
                    for x in &mut buf[at..end] {
                        *x = x.wrapping_add(1);
                    }
                    at = if end == buf.len() { 0 } else { end };
                }
                if let Some(rest) = period.checked_sub(start.elapsed()) {
                    std::thread::sleep(rest);
                }
            }
            std::hint::black_box(&buf);
        });
        let a = Antagonist { level, stop, thread: Some(thread) };
        match pinned_rx.recv() {
            Ok(true) => Ok(a),
            _ => Err(fatal(format!("cannot pin the antagonist to CPU {core}"))),
        }
    }
}

impl Drop for Antagonist {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `runs` timings (µs) of `v` on `threads` threads of `pool`, after one untimed run.
fn sample(
    v: &GemmVersion,
    pool: &rayon::ThreadPool,
    threads: usize,
    data: &Data,
    runs: usize,
) -> CliResult<Vec<f64>> {
    let mut c = vec![0.0f32; data.m * data.n];
    let shape = (data.m, data.k, data.n);
    pool.install(|| v.run(&data.a, &data.b, &mut c, shape, threads))?;
    let mut us = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        pool.install(|| v.run(&data.a, &data.b, &mut c, shape, threads))?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    Ok(us)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Data {
    m: usize,
    k: usize,
    n: usize,
    a: Vec<f32>,
    b: Vec<f32>,
}

fn pool(threads: usize) -> CliResult<rayon::ThreadPool> {
    let b = rayon::ThreadPoolBuilder::new().num_threads(threads);
    b.build().map_err(|e| fatal(format!("cannot start a thread pool: {e}")))
}

pub(crate) fn profile_versions((m, k, n): (usize, usize, usize), a: &ProfileArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let cpus = allowed_cpus();
    let cores = cpus.len();
    let (Some(&product_cpu), Some(&antagonist_cpu)) = (cpus.first(), cpus.last()) else {
        return Err(fatal("no CPU to run on"));
    };
    if cores < 2 {
        return Err(fatal("--versions needs 2 CPUs: one for the product, one for the antagonist"));
    }
    let max = serve::backend::cpu::versions::MAX_ELEMENTS;
    if [m * k, k * n, m * n].iter().any(|&e| e > max) {
        return Err(fatal(format!("a {m}x{k}x{n} product is over {max} elements per operand")));
    }
    let data = Data {
        m,
        k,
        n,
        a: (0..m * k).map(|i| ((i * 7 % 13) as f32 - 6.0) * 0.01).collect(),
        b: (0..k * n).map(|i| ((i * 5 % 11) as f32 - 5.0) * 0.01).collect(),
    };
    let levels = a.levels;
    let cands = candidates(m, n);
    println!(
        "# serve profile --versions {m}x{k}x{n}: {} candidate versions, {levels} antagonist levels, {cores} cores",
        cands.len()
    );
    let (one, two) = (pool(1)?, pool(2)?);
    if !one.install(|| pin(product_cpu)) {
        return Err(fatal(format!("cannot pin the product to CPU {product_cpu}")));
    }
    let mut solo1 = vec![Vec::new(); cands.len()];
    let mut solo2 = vec![Vec::new(); cands.len()];
    for _ in 0..SWEEPS {
        for (i, v) in cands.iter().enumerate() {
            solo1[i].extend(sample(v, &one, 1, &data, RUNS)?);
            solo2[i].extend(sample(v, &two, 2, &data, RUNS)?);
        }
    }
    let solo: Vec<(f64, f64)> = solo1.into_iter().zip(solo2).map(|(a, b)| (median(a), median(b))).collect();
    // The antagonist on the last allowed CPU, the product pinned to the first.
    let antagonist = Antagonist::start(antagonist_cpu, levels)?;
    // `samples[level][candidate]`.
    let mut samples = vec![vec![Vec::new(); cands.len()]; levels];
    for _ in 0..SWEEPS {
        for (level, per) in samples.iter_mut().enumerate() {
            antagonist.level.store(level, Ordering::Relaxed);
            std::thread::sleep(Duration::from_millis(5));
            for (v, out) in cands.iter().zip(per.iter_mut()) {
                out.extend(sample(v, &one, 1, &data, RUNS)?);
            }
        }
    }
    drop(antagonist);
    let at_levels: Vec<Vec<f64>> = (0..cands.len())
        .map(|i| samples.iter_mut().map(|per| median(std::mem::take(&mut per[i]))).collect())
        .collect();
    // Alg. 1 on the measurements: no budget here (a bare product has no QoS).
    let described: Vec<Candidate> = cands
        .iter()
        .zip(&solo)
        .map(|(v, (t1, t2))| Candidate {
            ws: v.working_set(k) as f64,
            tiles: v.tiles(m, n),
            fastest: t1.min(*t2),
        })
        .collect();
    // Of the candidates sharing a tile (orders, placements), the fastest alone stands for it.
    let mut best_of_tile: Vec<usize> = Vec::new();
    for i in 0..cands.len() {
        let same =
            best_of_tile.iter().position(|&j| (cands[j].mt, cands[j].nt) == (cands[i].mt, cands[i].nt));
        match same {
            Some(p) if described[i].fastest < described[best_of_tile[p]].fastest => best_of_tile[p] = i,
            Some(_) => {}
            None => best_of_tile.push(i),
        }
    }
    let sub: Vec<Candidate> = best_of_tile.iter().map(|&i| described[i]).collect();
    let spread_kept: Vec<usize> = spread(&sub, f64::INFINITY).into_iter().map(|j| best_of_tile[j]).collect();
    let times: Vec<Vec<f64>> = spread_kept.iter().map(|&i| at_levels[i].clone()).collect();
    let kept: Vec<usize> = prune(&times).into_iter().map(|j| spread_kept[j]).collect();
    println!(
        "{:<24} {:>9} {:>6} {:>10} {:>10}   on 1 core beside the antagonist, levels 0..{} (µs)",
        "version",
        "ws KiB",
        "tiles",
        "1 core",
        "2 cores",
        levels - 1
    );
    for (i, v) in cands.iter().enumerate() {
        let mark = if kept.contains(&i) {
            "*"
        } else if spread_kept.contains(&i) {
            "+"
        } else {
            " "
        };
        let lv: Vec<String> = at_levels[i].iter().map(|t| format!("{t:>9.0}")).collect();
        println!(
            "{mark}{:<23} {:>9.0} {:>6} {:>10.0} {:>10.0}   {}",
            v.name(),
            v.working_set(k) as f64 / 1024.0,
            v.tiles(m, n),
            solo[i].0,
            solo[i].1,
            lv.join(" ")
        );
    }
    println!("# * kept (Alg. 1 steps 3–5), + spread but pruned at 90% coverage");
    let argmin = |set: &[usize], level: usize| {
        set.iter().copied().min_by(|&x, &y| at_levels[x][level].total_cmp(&at_levels[y][level])).unwrap_or(0)
    };
    let all: Vec<usize> = (0..cands.len()).collect();
    let (solo_best, strong_best) = (argmin(&all, 0), argmin(&all, levels - 1));
    let ws = |i: usize| cands[i].working_set(k);
    let crossover = solo_best != strong_best && ws(strong_best) < ws(solo_best);
    println!(
        "# crossover: {} — solo-best {} ({:.0} → {:.0} µs at the strongest level, ×{:.2}); best there {} ({:.0} µs, {:.2}× faster)",
        if crossover { "holds" } else { "does NOT hold" },
        cands[solo_best].name(),
        at_levels[solo_best][0],
        at_levels[solo_best][levels - 1],
        at_levels[solo_best][levels - 1] / at_levels[solo_best][0],
        cands[strong_best].name(),
        at_levels[strong_best][levels - 1],
        at_levels[solo_best][levels - 1] / at_levels[strong_best][levels - 1]
    );
    let picks: Vec<usize> = (0..levels).map(|l| argmin(&kept, l)).collect();
    let monotone = picks.windows(2).all(|w| ws(w[1]) <= ws(w[0]));
    let coverage: Vec<f64> =
        (0..levels).map(|l| at_levels[argmin(&all, l)][l] / at_levels[argmin(&kept, l)][l]).collect();
    println!(
        "# the kept versions' pick by level: {} — working set {} as the level rises; kept best / oracle per level: {}",
        picks.iter().map(|&i| cands[i].name()).collect::<Vec<_>>().join(", "),
        if monotone { "never grows" } else { "grows somewhere" },
        coverage.iter().map(|c| format!("{:.0}%", c * 100.0)).collect::<Vec<_>>().join(" ")
    );
    if let Some((path, file)) = open_report(a.json.as_ref())? {
        let report = json!({
            "shape": [m, k, n],
            "levels": levels,
            "cores": cores,
            "versions": cands.iter().enumerate().map(|(i, v)| json!({
                "name": v.name(), "ws": v.working_set(k), "tiles": v.tiles(m, n),
                "us_1_core": solo[i].0, "us_2_cores": solo[i].1, "us_at_levels": at_levels[i],
                "kept": kept.contains(&i),
            })).collect::<Vec<_>>(),
            "solo_best": cands[solo_best].name(),
            "best_at_strongest": cands[strong_best].name(),
            "crossover": crossover,
            "picks_by_level": picks.iter().map(|&i| cands[i].name()).collect::<Vec<_>>(),
            "pick_working_set_never_grows": monotone,
            "kept_over_oracle": coverage,
        });
        write_report(&path, file, &report)?;
    }
    println!("# done in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
