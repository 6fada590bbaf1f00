//! Host → device copies sharing PCIe links, as a fluid: each copy is an amount of work (its
//! profiled `load_ms`, the time it takes alone on an idle link) that progresses at a rate ≤ 1.
//! A copy crosses links — its GPU's own PCIe link and the uplink of the switch above it — and a
//! link of capacity `c` carrying `n` copies gives each `c / n`; a copy runs at the smallest
//! share along its path over the bandwidth it was profiled at, at most 1. Rates are recomputed
//! whenever a copy starts or ends. NVLink forwards do not share (each pair has its own link).

/// Identifies a copy to its owner.
pub type CopyId = u64;

#[derive(Clone, Debug)]
struct Copy {
    id: CopyId,
    /// Work left, ms at full rate.
    left_ms: f64,
    links: [usize; 2],
    rate: f64,
}

/// Links and the copies on them.
#[derive(Clone, Debug)]
pub struct Fabric {
    capacity_gbps: Vec<f64>,
    /// The bandwidth a copy's `load_ms` was measured at (one copy alone on its links).
    profiled_gbps: f64,
    copies: Vec<Copy>,
    /// Per link: other traffic holding one share each (DHA reads, when modelled).
    held: Vec<usize>,
    now: f64,
}

/// Progress below this much work counts as done (floating-point dust).
const EPS_MS: f64 = 1e-12;

impl Fabric {
    pub fn new(capacity_gbps: Vec<f64>, profiled_gbps: f64) -> Fabric {
        let held = vec![0; capacity_gbps.len()];
        Fabric { capacity_gbps, profiled_gbps, copies: vec![], held, now: 0.0 }
    }

    /// Copies in flight on `link`.
    pub fn copies_on(&self, link: usize) -> usize {
        self.copies.iter().filter(|c| c.links.contains(&link)).count()
    }

    /// Other traffic takes (`true`) or gives back (`false`) one share of `link`.
    pub fn hold(&mut self, link: usize, take: bool) {
        if take {
            self.held[link] += 1;
        } else {
            self.held[link] = self.held[link].checked_sub(1).expect("a share held");
        }
        self.rerate();
    }

    /// Starts a copy of `work_ms` over `links` at the current time.
    pub fn start(&mut self, id: CopyId, work_ms: f64, links: [usize; 2]) {
        self.copies.push(Copy { id, left_ms: work_ms, links, rate: 0.0 });
        self.rerate();
    }

    /// Moves the fluid forward to `t` (no copy may end before `t`: call at or before
    /// [`next_end`](Self::next_end)).
    pub fn advance(&mut self, t: f64) {
        let dt = t - self.now;
        debug_assert!(dt >= -1e-9, "time runs forward");
        if dt > 0.0 {
            for c in &mut self.copies {
                c.left_ms -= c.rate * dt;
            }
        }
        self.now = self.now.max(t);
    }

    /// The earliest end among the copies in flight: `(time, id)`.
    pub fn next_end(&self) -> Option<(f64, CopyId)> {
        self.copies
            .iter()
            .map(|c| (self.now + c.left_ms.max(0.0) / c.rate, c.id))
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
    }

    /// Ends copy `id` (it must have finished: the caller advanced to its end).
    pub fn finish(&mut self, id: CopyId) {
        let i = self.copies.iter().position(|c| c.id == id).expect("a copy in flight");
        debug_assert!(
            self.copies[i].left_ms <= 1e-6,
            "copy {id} ended with {} ms left",
            self.copies[i].left_ms
        );
        self.copies.swap_remove(i);
        self.rerate();
    }

    fn rerate(&mut self) {
        let mut load = self.held.clone();
        for c in &self.copies {
            for &l in &c.links {
                load[l] += 1;
            }
        }
        for c in &mut self.copies {
            let share =
                c.links.iter().map(|&l| self.capacity_gbps[l] / load[l] as f64).fold(f64::INFINITY, f64::min);
            c.rate = (share / self.profiled_gbps).min(1.0);
            if c.left_ms < EPS_MS {
                c.left_ms = 0.0;
            }
        }
    }
}
