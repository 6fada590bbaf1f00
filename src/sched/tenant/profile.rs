//! What a tenant scheduler knows of a model (VELTAIR §4.1, the offline profile): per layer its
//! FLOPs and, for each kernel version, its time at every core count `c = 1..=C` and every
//! profiled interference level `I = 0..L` (level 0: solo). From it, once, at load:
//!
//! * the **layer budgets** `b_l = Q_m · F_l / ΣF` (Alg. 1 l. 3): the share of the QoS target a
//!   layer may take when the model runs at exactly its required FLOPS;
//! * the **core need** of a layer `r_l(v, I) = min c with T(l, v, c, I) ≤ b_l` (`C` if none), on
//!   the monotone envelope of the measured curve (a layer given more cores can always use fewer:
//!   the envelope is taken when the profile is built, so every time here is non-increasing in c);
//! * the **version** of each layer at each level: the one that meets its budget on the fewest
//!   cores (ties: the faster there); with no version meeting it, the fastest on all cores. The
//!   "solo-best" version set (baselines, Veltair-AS) is the level-0 choice, used at every level;
//! * `Avg_C_m(I)`, "Core@Model granularity": the uniform core count the whole model needs at
//!   level `I` (the `c_B` of the block of all its layers, [`block_cores`]).

use std::time::Duration;

use crate::error::{Error, Result};

/// Most layers of a tenant model.
pub const MAX_LAYERS: usize = 4096;
/// Most kernel versions of a layer (VELTAIR keeps at most 5).
pub const MAX_VERSIONS: usize = 5;
/// Most cores a profile may cover.
pub const MAX_CORES: usize = 1024;
/// Most interference levels of a profile.
pub const MAX_LEVELS: usize = 16;
/// The range of a profiled time, µs (a nanosecond to about 11 days): outside it a sum of
/// layers, a budget or a token rate could overflow or vanish.
pub const MIN_US: f64 = 1e-3;
pub const MAX_US: f64 = 1e12;
/// Most FLOPs of one layer (their sum over [`MAX_LAYERS`] layers stays finite).
pub const MAX_FLOPS: f64 = 1e18;
/// The longest QoS target a tenant may have: an hour (a target is a per-query latency; the
/// bound keeps a deadline arithmetic in range whatever a caller passes).
pub const MAX_QOS: Duration = Duration::from_secs(3600);

/// One layer's profile.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerProfile {
    pub name: String,
    /// Floating-point operations of one run (the budget is split in proportion to them).
    pub flops: f64,
    /// Per version: microseconds at `[level][cores − 1]`.
    pub versions: Vec<Vec<Vec<f64>>>,
}

/// A model as the tenant scheduler sees it. Build with [`TenantModel::new`].
#[derive(Clone, Debug)]
pub struct TenantModel {
    name: String,
    qos: Duration,
    layers: Vec<LayerProfile>,
    cores: usize,
    levels: usize,
    /// `b_l`, microseconds.
    budgets: Vec<f64>,
    /// `suffix[l]`: the budgets of layers `l..` together.
    suffix: Vec<f64>,
    /// `[level][layer]`: the version multi-version scheduling runs.
    best: Vec<Vec<u8>>,
    /// `[level][layer]`: `r_l` of the multi-version choice, and of the solo-best version.
    need_multi: Vec<Vec<usize>>,
    need_solo: Vec<Vec<usize>>,
    /// `[level]`: `Avg_C` with the multi-version choice, and with the solo-best versions.
    avg_multi: Vec<usize>,
    avg_solo: Vec<usize>,
}

/// A tenant's QoS target is above 0 and at most [`MAX_QOS`].
pub fn check_qos(name: &str, qos: Duration) -> Result<()> {
    if qos.is_zero() || qos > MAX_QOS {
        return Err(Error::invalid(format!(
            "tenant model `{name}`: a QoS target of {qos:?} (above 0, at most {MAX_QOS:?})"
        )));
    }
    Ok(())
}

/// Which versions a scheduler runs: each level's own choice, or the solo-best set throughout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Versions {
    Multi,
    SoloBest,
}

impl TenantModel {
    /// Check and prepare a profile: at least one layer (at most [`MAX_LAYERS`]), each with 1 to
    /// [`MAX_VERSIONS`] versions, every table `levels × cores` alike (1 to [`MAX_LEVELS`] ×
    /// 1 to [`MAX_CORES`]), times finite and positive, FLOPs finite and positive, QoS in (0, [`MAX_QOS`]].
    pub fn new(name: &str, qos: Duration, mut layers: Vec<LayerProfile>) -> Result<TenantModel> {
        let bad = |what: String| Err(Error::invalid(format!("tenant model `{name}`: {what}")));
        check_qos(name, qos)?;
        if layers.is_empty() || layers.len() > MAX_LAYERS {
            return bad(format!("{} layers (1 to {MAX_LAYERS})", layers.len()));
        }
        let (levels, cores) = match layers[0].versions.first() {
            Some(t) => (t.len(), t.first().map_or(0, Vec::len)),
            None => (0, 0),
        };
        if !(1..=MAX_LEVELS).contains(&levels) || !(1..=MAX_CORES).contains(&cores) {
            return bad(format!(
                "tables of {levels} levels × {cores} cores (1 to {MAX_LEVELS} × 1 to {MAX_CORES})"
            ));
        }
        for l in &mut layers {
            if !(l.flops.is_finite() && l.flops > 0.0 && l.flops <= MAX_FLOPS) {
                return bad(format!("layer `{}` has {} FLOPs (at most {MAX_FLOPS})", l.name, l.flops));
            }
            if l.versions.is_empty() || l.versions.len() > MAX_VERSIONS {
                return bad(format!(
                    "layer `{}` has {} versions (1 to {MAX_VERSIONS})",
                    l.name,
                    l.versions.len()
                ));
            }
            for v in &mut l.versions {
                if v.len() != levels || v.iter().any(|row| row.len() != cores) {
                    return bad(format!("layer `{}`: a table that is not {levels} × {cores}", l.name));
                }
                for row in v.iter_mut() {
                    if row.iter().any(|t| !(MIN_US..=MAX_US).contains(t)) {
                        return bad(format!("layer `{}`: a time outside {MIN_US} to {MAX_US} µs", l.name));
                    }
                    // The monotone envelope: c cores can always run as c − 1 would.
                    for c in 1..row.len() {
                        row[c] = row[c].min(row[c - 1]);
                    }
                }
            }
        }
        let mut m = TenantModel {
            name: name.to_string(),
            qos,
            layers,
            cores,
            levels,
            budgets: Vec::new(),
            suffix: Vec::new(),
            best: Vec::new(),
            need_multi: Vec::new(),
            need_solo: Vec::new(),
            avg_multi: Vec::new(),
            avg_solo: Vec::new(),
        };
        m.plan(1.0);
        Ok(m)
    }

    /// Plan to `share` of the QoS target (in (0, 1]) instead of all of it: the budgets sum to
    /// `share · Q_m`, leaving the rest as headroom for queueing and for interference the level
    /// has not caught yet. The paper plans to the whole target (share 1, [`TenantModel::new`]);
    /// then a query runs at its QoS with no slack, and any wait misses it.
    pub fn with_headroom(mut self, share: f64) -> Result<TenantModel> {
        if !(share > 0.0 && share <= 1.0) {
            return Err(Error::invalid(format!("tenant model `{}`: a planning share of {share}", self.name)));
        }
        self.plan(share);
        Ok(self)
    }

    /// Budgets to `share` of the QoS, and everything derived from them.
    fn plan(&mut self, share: f64) {
        let m = self;
        let total: f64 = m.layers.iter().map(|l| l.flops).sum();
        let q_us = m.qos.as_secs_f64() * 1e6 * share;
        m.budgets = m.layers.iter().map(|l| q_us * (l.flops / total)).collect();
        m.suffix = vec![0.0; m.layers.len() + 1];
        for l in (0..m.layers.len()).rev() {
            m.suffix[l] = m.suffix[l + 1] + m.budgets[l];
        }
        let levels = m.levels;
        (m.best, m.need_multi, m.need_solo, m.avg_multi, m.avg_solo) = Default::default();
        for k in 0..levels {
            let picks: Vec<u8> = (0..m.layers.len()).map(|l| m.pick(l, k)).collect();
            m.best.push(picks);
        }
        for k in 0..levels {
            let multi: Vec<usize> = (0..m.layers.len()).map(|l| m.need(l, m.best[k][l], k)).collect();
            let solo: Vec<usize> = (0..m.layers.len()).map(|l| m.need(l, m.best[0][l], k)).collect();
            m.need_multi.push(multi);
            m.need_solo.push(solo);
            let all = 0..m.layers.len();
            m.avg_multi.push(m.block_cores(all.clone(), Versions::Multi, k));
            m.avg_solo.push(m.block_cores(all, Versions::SoloBest, k));
        }
    }

    /// The budgets of layers `from..` together (µs).
    pub fn budget_from(&self, from: usize) -> f64 {
        self.suffix[from.min(self.layers.len())]
    }

    /// `r_l` at `level` under `versions` with every budget scaled by `scale` (a query's time
    /// left over its remaining layers' budgets).
    pub fn need_scaled(&self, l: usize, versions: Versions, level: usize, scale: f64) -> usize {
        if scale == 1.0 {
            return self.needs(versions, level)[l];
        }
        let k = level.min(self.levels - 1);
        fewest_within(
            &self.layers[l].versions[usize::from(self.version(l, versions, level))][k],
            self.budgets[l] * scale,
        )
    }

    /// `r_l(v, I)`: the fewest cores on which version `v` meets the layer's budget (if none do,
    /// [`fewest_within`]'s fallback).
    fn need(&self, l: usize, v: u8, k: usize) -> usize {
        fewest_within(&self.layers[l].versions[usize::from(v)][k], self.budgets[l])
    }

    /// The version that meets layer `l`'s budget at level `k` on the fewest cores; ties go to the
    /// faster there. With none meeting it, the fastest on all cores.
    fn pick(&self, l: usize, k: usize) -> u8 {
        let vs = &self.layers[l].versions;
        let key = |v: usize| {
            let c = self.need(l, v as u8, k);
            (c, vs[v][k][c - 1])
        };
        (0..vs.len())
            .min_by(|&a, &b| key(a).0.cmp(&key(b).0).then(key(a).1.total_cmp(&key(b).1)))
            .unwrap_or(0) as u8
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn qos(&self) -> Duration {
        self.qos
    }

    pub fn layers(&self) -> &[LayerProfile] {
        &self.layers
    }

    /// Cores the profile covers (`C`).
    pub fn cores(&self) -> usize {
        self.cores
    }

    /// Interference levels the profile covers (`L`, level 0 solo).
    pub fn levels(&self) -> usize {
        self.levels
    }

    /// `b_l` of every layer, microseconds (they sum to the QoS target).
    pub fn budgets(&self) -> &[f64] {
        &self.budgets
    }

    /// The version layer `l` runs at level `level` under `versions`.
    pub fn version(&self, l: usize, versions: Versions, level: usize) -> u8 {
        match versions {
            Versions::Multi => self.best[level.min(self.levels - 1)][l],
            Versions::SoloBest => self.best[0][l],
        }
    }

    /// `r_l` of every layer at `level` under `versions`.
    pub fn needs(&self, versions: Versions, level: usize) -> &[usize] {
        let k = level.min(self.levels - 1);
        match versions {
            Versions::Multi => &self.need_multi[k],
            Versions::SoloBest => &self.need_solo[k],
        }
    }

    /// `Avg_C` at `level` under `versions`.
    pub fn avg_cores(&self, versions: Versions, level: usize) -> usize {
        let k = level.min(self.levels - 1);
        match versions {
            Versions::Multi => self.avg_multi[k],
            Versions::SoloBest => self.avg_solo[k],
        }
    }

    /// Microseconds of layer `l` in version `v` on `cores` cores at profiled level `level`.
    pub fn time(&self, l: usize, v: u8, cores: usize, level: usize) -> f64 {
        let row = &self.layers[l].versions[usize::from(v)][level.min(self.levels - 1)];
        row[cores.clamp(1, self.cores) - 1]
    }

    /// Predicted microseconds of layers `range` on `cores` cores with the versions `versions`
    /// runs at `pick_level`, timed at profiled level `level`.
    pub fn block_time(
        &self,
        range: std::ops::Range<usize>,
        versions: Versions,
        pick_level: usize,
        cores: usize,
        level: usize,
    ) -> f64 {
        range.map(|l| self.time(l, self.version(l, versions, pick_level), cores, level)).sum()
    }

    /// `c_B` of a block (Alg. 2): the fewest uniform cores on which its layers, in the versions
    /// chosen for `level` and timed at `level`, meet the sum of their budgets (`C` if none).
    pub fn block_cores(&self, range: std::ops::Range<usize>, versions: Versions, level: usize) -> usize {
        let mut acc = BlockSums::new(self.cores);
        for l in range {
            acc.add(self, l, versions, level, 1.0);
        }
        acc.cores()
    }

    /// Whether the whole model meets its QoS target solo on all `C` cores in some version set:
    /// a model that cannot is flagged at load and served best-effort.
    pub fn feasible(&self) -> bool {
        let all = 0..self.layers.len();
        let t = self.block_time(all.clone(), Versions::Multi, 0, self.cores, 0).min(self.block_time(
            all,
            Versions::SoloBest,
            0,
            self.cores,
            0,
        ));
        t <= self.qos.as_secs_f64() * 1e6
    }

    /// The whole model's time alone on all `C` cores with the solo-best versions (the
    /// profile's solo latency).
    pub fn solo(&self) -> Duration {
        let us = self.block_time(0..self.layers.len(), Versions::SoloBest, 0, self.cores, 0);
        Duration::from_secs_f64(us.clamp(0.0, MAX_US) * 1e-6)
    }
}

/// The fewest cores on which a non-increasing time curve (`row[c − 1]`) is within `budget`; if
/// none is, the fewest on which it is fastest (where its envelope stops falling). The spec's
/// reading says `C` for the latter; but a layer whose budget no core count meets (a tiny layer:
/// budgets are in proportion to FLOPs, and per-layer fixed costs are not) gains nothing from
/// cores past that point, and asking for all of them would make it a pivot of the whole machine.
fn fewest_within(row: &[f64], budget: f64) -> usize {
    let c = row.partition_point(|&t| t > budget);
    if c < row.len() {
        return c + 1;
    }
    let fastest = row[row.len() - 1];
    row.partition_point(|&t| t > fastest) + 1
}

/// A block being formed, layer by layer: its time at every core count and its budget, so that
/// `c_B` after each added layer costs `O(C)` to keep and `O(log C)` to read.
pub(crate) struct BlockSums {
    sums: Vec<f64>,
    budget: f64,
}

impl BlockSums {
    pub fn new(cores: usize) -> BlockSums {
        BlockSums { sums: vec![0.0; cores], budget: 0.0 }
    }

    /// Add layer `l`, its budget scaled by `scale`.
    pub fn add(&mut self, m: &TenantModel, l: usize, versions: Versions, level: usize, scale: f64) {
        let k = level.min(m.levels - 1);
        let row = &m.layers[l].versions[usize::from(m.version(l, versions, level))][k];
        for (s, t) in self.sums.iter_mut().zip(row) {
            *s += t;
        }
        self.budget += m.budgets[l] * scale;
    }

    /// `c_B`: the sums are non-increasing in c (each row is its monotone envelope).
    pub fn cores(&self) -> usize {
        fewest_within(&self.sums, self.budget)
    }
}
