//! The tenant simulator's cost model: the time of a layer block from its GEMM shapes, its
//! kernel version, its cores and what runs beside it. Every constant here is a reading (the
//! spec's **[E]**): the paper gives no per-layer figures, and this machine has 2 cores, so the
//! simulator extends a fitted form to 64 cores. It yields orderings and trends, not absolute QPS.
//!
//! * **Versions** (VELTAIR Alg. 1 on synthetic candidates): outer tilings `mt × nt` (each of
//!   16…256, clamped to the layer's dims; `kt = min(K, 512)`). Locality is the tile's working
//!   set `ws = 4(mt·kt + kt·nt + mt·nt)` bytes; parallelism is its number of tiles. The kept
//!   ones are chosen by `sched::tenant::versions` (budget, Pareto set, at most 5 spread by
//!   working set, pruned at 90% coverage per level on the layer's lease).
//! * **Solo time** on `c` cores: `f + t1 · ⌈tiles / c⌉ / tiles + o · (c − 1)`, with
//!   `t1 = flops / (rate · eff)`, `eff = ai / (ai + 4)` for the tile's arithmetic intensity
//!   `ai = 2·mt·nt·kt / ws` FLOP/byte (small tiles lose to load/store traffic), `f` a fixed
//!   per-layer cost (the serial part: packing, the call), `o` the per-core synchronisation cost.
//!   Past `tiles` cores nothing is gained, and past some count the synchronisation costs more
//!   than the cores give (a runner then uses fewer: the scheduler's tables are envelopes).
//! * **Interference**: `slowdown = 1 + α_v · P`, `P = Σ_{other running blocks} c_b · π_b / BW`.
//!   A version's sensitivity `α_v` grows with how far its working set overflows the private L2;
//!   its pressure `π_v` (bytes per µs per core reaching the shared L3/DRAM) is its traffic
//!   `rate · eff / ai` times the share of its working set that does not fit in L2.
//! * **Profiled levels** (what the scheduler is given): `L` levels of antagonist pressure
//!   `P_k = k · P_max / (L − 1)`, `P_max` every core running the most pressuring version.
//! * **Conflicts**: a conflicted unit pays a thread-start cost drawn from a lognormal of median
//!   100 µs and σ 1.256 (mean 220 µs), the paper's §3.2 figures.

use std::time::Duration;

use super::models::{LayerShape, ModelShape};
use crate::error::Result;
use crate::sched::tenant::versions::{self, Candidate};
use crate::sched::tenant::{LayerProfile, TenantModel};

/// The simulated machine.
#[derive(Clone, Debug)]
pub struct Machine {
    pub cores: usize,
    /// GFLOP/s of one core on a tile of perfect reuse.
    pub gflops_per_core: f64,
    /// Fixed cost `f` of a layer, µs (its serial part).
    pub fixed_us: f64,
    /// Per-core synchronisation cost `o`, µs.
    pub sync_us: f64,
    /// Private L2 per core, bytes.
    pub l2_bytes: f64,
    /// Shared L3/DRAM bandwidth, bytes per µs.
    pub bandwidth: f64,
    /// Interference levels profiled (`L`, level 0 solo).
    pub levels: usize,
}

impl Machine {
    /// A 64-core AVX2 server of the paper's kind (Threadripper 3990X: 512 KiB L2 per core).
    pub fn threadripper(cores: usize) -> Machine {
        Machine {
            cores,
            gflops_per_core: 70.0,
            fixed_us: 5.0,
            sync_us: 0.5,
            l2_bytes: 512.0 * 1024.0,
            bandwidth: 100_000.0,
            levels: 10,
        }
    }
}

/// One kernel version of a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Version {
    pub mt: usize,
    pub nt: usize,
    pub kt: usize,
    pub tiles: usize,
    /// Working set of a tile, bytes (locality).
    pub ws: f64,
    /// Single-core time, µs.
    pub t1: f64,
    pub alpha: f64,
    /// Bytes per µs per core reaching the shared cache and memory.
    pub pressure: f64,
}

impl Version {
    fn new(m: &Machine, l: &LayerShape, mt: usize, nt: usize) -> Version {
        let kt = l.k.min(512);
        let ws = 4.0 * (mt * kt + kt * nt + mt * nt) as f64;
        let ai = 2.0 * (mt * nt * kt) as f64 / ws;
        let eff = ai / (ai + 4.0);
        let rate = m.gflops_per_core * 1e3 * eff; // FLOP per µs
        let spill = (1.0 - m.l2_bytes / ws).max(0.0);
        Version {
            mt,
            nt,
            kt,
            tiles: l.m.div_ceil(mt) * l.n.div_ceil(nt),
            ws,
            t1: l.flops() / rate,
            alpha: 0.1 + (ws / m.l2_bytes).min(3.0),
            pressure: rate / ai * spill,
        }
    }

    /// Solo µs on `c` cores.
    pub fn solo_us(&self, m: &Machine, c: usize) -> f64 {
        let c = c.max(1);
        let waves = self.tiles.div_ceil(c) as f64;
        m.fixed_us + self.t1 * waves / self.tiles as f64 + m.sync_us * (c - 1) as f64
    }
}

/// A layer and the versions kept for it.
#[derive(Clone, Debug)]
pub struct LayerCost {
    pub shape: LayerShape,
    pub versions: Vec<Version>,
}

/// A model's costs: its layers' versions, and the profile its scheduler is given.
#[derive(Clone, Debug)]
pub struct ModelCost {
    pub name: String,
    pub qos: Duration,
    pub layers: Vec<LayerCost>,
    /// The pressure of each profiled level.
    pub level_pressure: Vec<f64>,
}

/// The share of the QoS every scheme plans to (its budgets' sum), the rest headroom for
/// queueing and unforeseen interference: planned to the whole QoS a query has no slack at all.
pub const PLAN_SHARE: f64 = 0.85;

/// Tile sides of the candidates.
const SIDES: [usize; 5] = [16, 32, 64, 128, 256];

/// The most pressure the machine sees: every core on the most pressuring version of any layer.
fn max_pressure(m: &Machine, shapes: &[&ModelShape]) -> f64 {
    let worst = shapes
        .iter()
        .flat_map(|s| &s.layers)
        .flat_map(|l| candidates(m, l))
        .map(|v| v.pressure)
        .fold(0.0, f64::max);
    m.cores as f64 * worst / m.bandwidth
}

/// A layer's candidate versions: every pair of tile sides, clamped to its dims, once each.
fn candidates(m: &Machine, l: &LayerShape) -> Vec<Version> {
    let mut cands: Vec<Version> = Vec::new();
    for &a in &SIDES {
        for &b in &SIDES {
            let v = Version::new(m, l, a.min(l.m), b.min(l.n));
            if !cands.iter().any(|c| (c.mt, c.nt) == (v.mt, v.nt)) {
                cands.push(v);
            }
        }
    }
    cands
}

/// The costs of `shape` on `m`, with the levels' pressures spread up to the pressure of every
/// core running the most pressuring version of any layer of `all` (the models sharing it).
pub fn model_cost(m: &Machine, shape: &ModelShape, all: &[&ModelShape]) -> ModelCost {
    let p_max = max_pressure(m, all);
    let levels = m.levels.max(1);
    let level_pressure: Vec<f64> =
        (0..levels).map(|k| if levels == 1 { 0.0 } else { p_max * k as f64 / (levels - 1) as f64 }).collect();
    let total: f64 = shape.layers.iter().map(LayerShape::flops).sum();
    let qos_us = shape.qos_ms * 1e3;
    let layers = shape
        .layers
        .iter()
        .map(|l| {
            // The budget the scheduler plans to (its profile's, `PLAN_SHARE` of the QoS).
            let budget = PLAN_SHARE * qos_us * (l.flops() / total);
            LayerCost { shape: l.clone(), versions: select(m, l, budget, &level_pressure) }
        })
        .collect();
    ModelCost {
        name: shape.name.to_string(),
        qos: Duration::from_secs_f64(shape.qos_ms * 1e-3),
        layers,
        level_pressure,
    }
}

/// Alg. 1 steps 2–5 ([`versions`]) on the tiling candidates of one layer.
fn select(m: &Machine, l: &LayerShape, budget: f64, levels: &[f64]) -> Vec<Version> {
    let cands = candidates(m, l);
    // Its fastest solo time over every core count (more cores can cost more than they give).
    let fastest = |v: &Version| (1..=m.cores).map(|c| v.solo_us(m, c)).fold(f64::INFINITY, f64::min);
    let described: Vec<Candidate> =
        cands.iter().map(|v| Candidate { ws: v.ws, tiles: v.tiles, fastest: fastest(v) }).collect();
    let kept: Vec<Version> = versions::spread(&described, budget).into_iter().map(|i| cands[i]).collect();
    // Step 5 on the layer's lease: the fewest cores on which a kept version meets its budget.
    let c = (1..=m.cores).find(|&c| kept.iter().any(|v| v.solo_us(m, c) <= budget)).unwrap_or(m.cores);
    let times: Vec<Vec<f64>> = kept
        .iter()
        .map(|v| levels.iter().map(|&p| v.solo_us(m, c) * (1.0 + v.alpha * p)).collect())
        .collect();
    versions::prune(&times).into_iter().map(|i| kept[i]).collect()
}

impl ModelCost {
    /// The profile the scheduler is given: every kept version's time at every core count and
    /// profiled level, planned to [`PLAN_SHARE`] of the QoS.
    pub fn profile(&self, m: &Machine) -> Result<TenantModel> {
        let layers = self
            .layers
            .iter()
            .map(|l| LayerProfile {
                name: l.shape.name.clone(),
                flops: l.shape.flops(),
                versions: l
                    .versions
                    .iter()
                    .map(|v| {
                        self.level_pressure
                            .iter()
                            .map(|&p| (1..=m.cores).map(|c| v.solo_us(m, c) * (1.0 + v.alpha * p)).collect())
                            .collect()
                    })
                    .collect(),
            })
            .collect();
        TenantModel::new(&self.name, self.qos, layers)?.with_headroom(PLAN_SHARE)
    }
}
