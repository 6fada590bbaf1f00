//! Parallel transmission (DeepPlan §4.2, §4.3.3): the loaded layers are split into `k`
//! contiguous partitions of about equal bytes; partition 1 is copied host → device by the
//! executing (**primary**) GPU, partition `p` by secondary `p` over its own PCIe link at the same
//! time, and each secondary forwards every layer to the primary over NVLink as soon as it lands
//! (the "parallel-pipeline" variant). Execution happens only on the primary.
//!
//! A secondary only helps if it sits under a PCIe switch of its own (two GPUs under one switch
//! share its uplink) and has NVLink to the primary, so `k ≤` the number of switches; with no such
//! GPU, transmission is serial and [`Helpers::reason`] says why. Layers that the planner left on
//! DHA but that fall in partition 2 or later are loaded instead: parallel transmission cannot
//! cut stalls in partition 1, and the paper overrides them (the artifact leaves them on DHA; we
//! follow the paper).

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::planner::{Method, is_loaded};
use super::profile::ColdProfile;
use crate::error::{Error, Result};

/// Most GPUs of a topology.
pub const MAX_GPUS: usize = 1024;
/// Largest topology file.
pub const MAX_TOPOLOGY_BYTES: u64 = 1 << 20;

/// One GPU of a [`Topology`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Gpu {
    /// The device ordinal.
    pub id: u32,
    /// The PCIe switch it sits under (any label; GPUs with equal labels share an uplink).
    pub switch: u32,
}

/// The GPUs of a machine, the PCIe switches they sit under and their NVLink edges:
/// ```json
/// {"gpus": [{"id": 0, "switch": 0}, {"id": 1, "switch": 0}, {"id": 2, "switch": 1}, {"id": 3, "switch": 1}],
///  "nvlink": [[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]],
///  "pcie_gbps": 15.75, "uplink_gbps": 15.75, "nvlink_gbps": 25.0}
/// ```
/// Bandwidths are optional (the simulator's defaults: PCIe 3.0 ×16 and NVLink 2.0) and only the
/// simulator and latency estimates use them. A real machine's topology is discovered through
/// the driver (`nvidia-smi topo -m` gives the same facts); the file is how a planner is told.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    pub gpus: Vec<Gpu>,
    /// Undirected NVLink edges by GPU id.
    #[serde(default)]
    pub nvlink: Vec<[u32; 2]>,
    /// Host → one GPU, GB/s.
    #[serde(default = "default_pcie")]
    pub pcie_gbps: f64,
    /// A switch's uplink to the host, shared by the GPUs under it, GB/s.
    #[serde(default = "default_pcie")]
    pub uplink_gbps: f64,
    /// One NVLink direction, GB/s.
    #[serde(default = "default_nvlink")]
    pub nvlink_gbps: f64,
}

fn default_pcie() -> f64 {
    15.75
}
fn default_nvlink() -> f64 {
    25.0
}

impl Topology {
    /// The paper's machine, AWS p3.8xlarge: 4 V100s, GPUs 0–1 under switch 0 and 2–3 under
    /// switch 1, NVLink between every pair, PCIe 3.0.
    pub fn p3_8xlarge() -> Topology {
        let gpus = (0..4).map(|id| Gpu { id, switch: id / 2 }).collect();
        let nvlink = vec![[0, 1], [0, 2], [0, 3], [1, 2], [1, 3], [2, 3]];
        Topology { gpus, nvlink, pcie_gbps: 15.75, uplink_gbps: 15.75, nvlink_gbps: 25.0 }
    }

    /// One GPU alone.
    pub fn single() -> Topology {
        Topology { gpus: vec![Gpu { id: 0, switch: 0 }], nvlink: vec![], ..Topology::p3_8xlarge() }
    }

    /// Parse and check a topology's JSON.
    pub fn parse(json: &str) -> Result<Topology> {
        let t: Topology = serde_json::from_str(json).map_err(|e| Error::format(format!("topology: {e}")))?;
        t.check()?;
        Ok(t)
    }

    /// Read a topology file.
    pub fn open(path: &Path) -> Result<Topology> {
        let bytes = crate::model::file::read_file(path, MAX_TOPOLOGY_BYTES)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| Error::format(format!("topology {}: not UTF-8", path.display())))?;
        Topology::parse(&text).map_err(|e| e.context(format!("{}", path.display())))
    }

    /// The bounds [`parse`](Self::parse) checks: 1 to [`MAX_GPUS`] GPUs with distinct ids,
    /// NVLink edges between listed GPUs, bandwidths from 0.001 to 10⁶ GB/s.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::format(format!("topology: {what}")));
        if self.gpus.is_empty() || self.gpus.len() > MAX_GPUS {
            return bad(format!("{} GPUs; 1 to {MAX_GPUS} expected", self.gpus.len()));
        }
        for (i, g) in self.gpus.iter().enumerate() {
            if self.gpus[..i].iter().any(|o| o.id == g.id) {
                return bad(format!("GPU {} listed twice", g.id));
            }
        }
        if self.nvlink.len() > MAX_GPUS * MAX_GPUS {
            return bad(format!("{} NVLink edges; at most {}", self.nvlink.len(), MAX_GPUS * MAX_GPUS));
        }
        for &[a, b] in &self.nvlink {
            if a == b || self.index(a).is_none() || self.index(b).is_none() {
                return bad(format!("NVLink edge [{a}, {b}]: two distinct listed GPUs expected"));
            }
        }
        for (k, v) in [
            ("pcie_gbps", self.pcie_gbps),
            ("uplink_gbps", self.uplink_gbps),
            ("nvlink_gbps", self.nvlink_gbps),
        ] {
            if !v.is_finite() || !(1e-3..=1e6).contains(&v) {
                return bad(format!("`{k}` is {v}; a bandwidth from 0.001 to 1e6 GB/s expected"));
            }
        }
        Ok(())
    }

    /// The position of GPU `id` in [`gpus`](Self::gpus).
    pub fn index(&self, id: u32) -> Option<usize> {
        self.gpus.iter().position(|g| g.id == id)
    }

    /// Whether GPUs `a` and `b` share an NVLink edge.
    pub fn nvlinked(&self, a: u32, b: u32) -> bool {
        self.nvlink.iter().any(|&[x, y]| (x, y) == (a, b) || (x, y) == (b, a))
    }

    /// Number of distinct PCIe switches.
    pub fn switches(&self) -> usize {
        let mut s: Vec<u32> = self.gpus.iter().map(|g| g.switch).collect();
        s.sort_unstable();
        s.dedup();
        s.len()
    }

    /// The secondaries a cold start on `primary` uses: one GPU under every other switch that has
    /// one with NVLink to the primary. Under each switch it prefers the GPU at the primary's own
    /// position among its switch's GPUs (on p3.8xlarge, GPU i pairs with GPU (i + 2) mod 4, so
    /// the four GPUs' cold starts spread over distinct partners), else the lowest id.
    pub fn helpers(&self, primary: u32) -> Helpers {
        let Some(pi) = self.index(primary) else {
            return Helpers {
                primary,
                secondaries: vec![],
                reason: Some(format!("GPU {primary} is not in the topology")),
            };
        };
        let home = self.gpus[pi].switch;
        let position = |g: &Gpu| self.gpus.iter().filter(|o| o.switch == g.switch && o.id < g.id).count();
        let my_position = position(&self.gpus[pi]);
        let mut switches: Vec<u32> = self.gpus.iter().map(|g| g.switch).filter(|&s| s != home).collect();
        switches.sort_unstable();
        switches.dedup();
        let mut secondaries = vec![];
        for s in switches {
            let mut under: Vec<&Gpu> =
                self.gpus.iter().filter(|g| g.switch == s && self.nvlinked(primary, g.id)).collect();
            under.sort_by_key(|g| g.id);
            let pick = under.iter().find(|g| position(g) == my_position).or(under.first());
            if let Some(g) = pick {
                secondaries.push(g.id);
            }
        }
        let reason = secondaries.is_empty().then(|| {
            if self.switches() < 2 {
                "parallel transmission off: every GPU sits under one PCIe switch (they would share its uplink)"
                    .to_string()
            } else {
                format!(
                    "parallel transmission off: no GPU under another PCIe switch has NVLink to GPU {primary}"
                )
            }
        });
        Helpers { primary, secondaries, reason }
    }
}

/// The GPUs that carry a cold start's partitions ([`Topology::helpers`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Helpers {
    pub primary: u32,
    /// Secondaries in partition order (partition `p + 1` goes to `secondaries[p]`).
    pub secondaries: Vec<u32>,
    /// Why parallel transmission is off, when it is.
    pub reason: Option<String>,
}

impl Helpers {
    /// Partitions a cold start is split into (1: serial transmission).
    pub fn k(&self) -> usize {
        1 + self.secondaries.len()
    }
}

/// One partition of the loaded layers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    /// Layer indices, ascending and contiguous among the loaded layers.
    pub layers: Vec<usize>,
    pub bytes: u64,
}

/// Splits the loaded layers of `plan` into at most `k` contiguous partitions of about equal
/// bytes (the artifact's rule): with `block = bytes / k`, layers fill the current partition
/// greedily; the layer that would overflow it opens the next; the remainder goes to the last.
/// Fewer than `k` partitions come back when there are fewer loaded layers.
pub fn partition(profile: &ColdProfile, plan: &[Method], k: usize) -> Vec<Partition> {
    let loaded: Vec<usize> = (0..plan.len()).filter(|&i| is_loaded(&profile.layers[i], plan[i])).collect();
    let total: u64 = loaded.iter().map(|&i| profile.layers[i].bytes).sum();
    let k = k.max(1);
    let block = total / k as u64;
    let mut parts: Vec<Partition> = vec![];
    for i in loaded {
        let b = profile.layers[i].bytes;
        let open_next = match parts.last() {
            None => true,
            Some(p) => p.bytes + b > block && !p.layers.is_empty() && parts.len() < k,
        };
        if open_next {
            parts.push(Partition { layers: vec![], bytes: 0 });
        }
        let p = parts.last_mut().expect("a partition is open");
        p.layers.push(i);
        p.bytes += b;
    }
    parts
}

/// Parallel transmission over `k` GPUs for `plan`: layers on DHA from partition 2's first
/// layer on are loaded (the paper's override), and the new load set is partitioned again, until
/// no DHA layer lies in partition 2 or later (each round only moves layers from DHA to load, so
/// it ends). Returns the overridden plan and its partitions, about equal in bytes; `k ≤ 1`
/// leaves the plan as is, with one partition.
pub fn parallel(profile: &ColdProfile, plan: &[Method], k: usize) -> (Vec<Method>, Vec<Partition>) {
    let mut plan = plan.to_vec();
    loop {
        let parts = partition(profile, &plan, k);
        if parts.len() < 2 {
            return (plan, parts);
        }
        let mut changed = false;
        for (i, m) in plan.iter_mut().enumerate().skip(parts[1].layers[0]) {
            if *m == Method::Dha && profile.layers[i].has_params() {
                *m = Method::Load;
                changed = true;
            }
        }
        if !changed {
            return (plan, parts);
        }
    }
}

/// When each layer is ready on the primary under serial or parallel transmission, with no
/// contention (each link carries one transfer): partition 1's layers back to back over the
/// primary's link from t = 0, taking their profiled `load_ms`; partition `p ≥ 2`'s over its
/// secondary's link, in parallel, each then forwarded over NVLink (`bytes / nvlink_gbps`) by
/// the secondary's migration stream, in order, as soon as it lands. `None` for layers not
/// loaded. `nvlink_gbps` is only used when there are two or more partitions.
pub fn arrivals(profile: &ColdProfile, parts: &[Partition], nvlink_gbps: f64) -> Vec<Option<f64>> {
    let mut ready = vec![None; profile.layers.len()];
    for (p, part) in parts.iter().enumerate() {
        let mut h2d = 0.0f64;
        let mut fwd = 0.0f64;
        for &i in &part.layers {
            let l = &profile.layers[i];
            h2d += l.load_ms;
            if p == 0 {
                ready[i] = Some(h2d);
            } else {
                fwd = fwd.max(h2d) + l.bytes as f64 / (nvlink_gbps * 1e6);
                ready[i] = Some(fwd);
            }
        }
    }
    ready
}

/// Serial execution that waits for each loaded layer's arrival: `e_i = max(e_{i−1}, ready_i) +
/// exec_i`. With [`arrivals`] of one partition this is the stall model's latency.
pub fn latency_with_arrivals(profile: &ColdProfile, plan: &[Method], ready: &[Option<f64>]) -> f64 {
    let mut end = 0.0f64;
    for (i, l) in profile.layers.iter().enumerate() {
        let start = match ready[i] {
            Some(r) if is_loaded(l, plan[i]) => end.max(r),
            _ => end,
        };
        end = start + super::planner::exec_time(l, plan[i]);
    }
    end
}
