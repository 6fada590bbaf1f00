//! The device memory of cold-start serving (DeepPlan §5.3, our spec §1.7): a budget of bytes
//! holding whole model instances, evicted least recently used first, never one with a request
//! in flight. Sans-IO: the runtime's cold server and the simulator's engine both keep their
//! resident instances here.
//!
//! An instance is admitted with the bytes its plan loads (DHA layers stay on the host). To make
//! room, the least recently used unpinned instances are evicted until the new one fits (the
//! artifact evicts while `used ≥ capacity`, which can overshoot by an instance; we evict until the
//! incoming load set fits, so the budget is never exceeded).

use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq)]
struct Entry {
    instance: usize,
    bytes: u64,
    /// Requests in flight on it.
    pins: u32,
}

/// Resident instances within a byte budget.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceCache {
    capacity: u64,
    used: u64,
    /// Least recently used first.
    lru: Vec<Entry>,
}

impl InstanceCache {
    pub fn new(capacity: u64) -> InstanceCache {
        InstanceCache { capacity, used: 0, lru: vec![] }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes the resident instances occupy (never above the capacity).
    pub fn used(&self) -> u64 {
        self.used
    }

    /// Resident instances, least recently used first.
    pub fn resident(&self) -> impl Iterator<Item = usize> + '_ {
        self.lru.iter().map(|e| e.instance)
    }

    fn position(&self, instance: usize) -> Option<usize> {
        self.lru.iter().position(|e| e.instance == instance)
    }

    pub fn contains(&self, instance: usize) -> bool {
        self.position(instance).is_some()
    }

    /// A request starts on a resident `instance`: it becomes the most recently used and is
    /// pinned until [`unpin`](Self::unpin). False if it is not resident.
    pub fn pin(&mut self, instance: usize) -> bool {
        let Some(i) = self.position(instance) else { return false };
        let mut e = self.lru.remove(i);
        e.pins += 1;
        self.lru.push(e);
        true
    }

    /// A request on `instance` ended.
    pub fn unpin(&mut self, instance: usize) {
        if let Some(i) = self.position(instance) {
            self.lru[i].pins = self.lru[i].pins.saturating_sub(1);
        }
    }

    /// Makes `instance` resident with `bytes` and pins it, evicting least recently used
    /// unpinned instances until it fits. Returns the evicted instances, oldest first. Refused
    /// (nothing evicted) if it cannot fit: larger than the capacity, or the pinned instances
    /// leave too little room. An instance already resident is just pinned.
    pub fn admit(&mut self, instance: usize, bytes: u64) -> Result<Vec<usize>> {
        if self.pin(instance) {
            return Ok(vec![]);
        }
        if bytes > self.capacity {
            return Err(Error::invalid(format!(
                "instance {instance} needs {bytes} bytes of device memory; the budget is {}",
                self.capacity
            )));
        }
        let pinned: u64 = self.lru.iter().filter(|e| e.pins > 0).map(|e| e.bytes).sum();
        if pinned + bytes > self.capacity {
            return Err(Error::new(
                crate::Code::Busy,
                format!(
                    "instance {instance} needs {bytes} bytes; {pinned} of the {} are held by instances in flight",
                    self.capacity
                ),
            ));
        }
        let mut evicted = vec![];
        while self.used + bytes > self.capacity {
            let i =
                self.lru.iter().position(|e| e.pins == 0).expect("unpinned instances cover the shortfall");
            let e = self.lru.remove(i);
            self.used -= e.bytes;
            evicted.push(e.instance);
        }
        self.used += bytes;
        self.lru.push(Entry { instance, bytes, pins: 1 });
        Ok(evicted)
    }

    /// Drops `instance` if it is resident and unpinned; returns whether it was dropped.
    pub fn evict(&mut self, instance: usize) -> bool {
        match self.position(instance) {
            Some(i) if self.lru[i].pins == 0 => {
                self.used -= self.lru.remove(i).bytes;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn evicts_least_recently_used_until_the_newcomer_fits() {
        let mut c = InstanceCache::new(100);
        assert_eq!(c.admit(1, 40).unwrap(), Vec::<usize>::new());
        assert_eq!(c.admit(2, 40).unwrap(), Vec::<usize>::new());
        c.unpin(1);
        c.unpin(2);
        assert!(c.pin(1)); // 1 is now the most recent
        c.unpin(1);
        assert_eq!(c.admit(3, 40).unwrap(), vec![2], "2 is least recently used");
        c.unpin(3);
        assert_eq!(c.used(), 80);
        assert_eq!(c.admit(4, 100).unwrap(), vec![1, 3]);
        assert_eq!(c.resident().collect::<Vec<_>>(), vec![4]);
    }

    #[test]
    fn nothing_in_flight_is_evicted() {
        let mut c = InstanceCache::new(100);
        c.admit(1, 60).unwrap(); // pinned: in flight
        c.admit(2, 30).unwrap();
        c.unpin(2);
        let e = c.admit(3, 50).unwrap_err();
        assert_eq!(e.code(), crate::Code::Busy);
        assert!(e.message().contains("held by instances in flight"), "{e}");
        assert!(c.contains(1) && c.contains(2), "a refusal evicts nothing");
        assert!(!c.evict(1), "pinned");
        c.unpin(1);
        assert_eq!(c.admit(3, 50).unwrap(), vec![1]);
        let e = c.admit(9, 101).unwrap_err();
        assert_eq!(e.code(), crate::Code::InvalidArgument);
    }

    #[test]
    fn random_runs_keep_the_budget_and_the_pins() {
        let mut rng = StdRng::seed_from_u64(3);
        let mut c = InstanceCache::new(1000);
        let mut pinned = std::collections::HashMap::<usize, u32>::new();
        // Miri (CI runs `sched::` under it) interprets every step: fewer rounds there.
        let rounds = if cfg!(miri) { 300 } else { 20_000 };
        for _ in 0..rounds {
            let m = rng.random_range(0..30);
            if rng.random_bool(0.5) {
                if let Ok(evicted) = c.admit(m, 50 + (m as u64 * 37) % 300) {
                    *pinned.entry(m).or_default() += 1;
                    for e in evicted {
                        assert_eq!(pinned.get(&e).copied().unwrap_or(0), 0, "evicted {e} in flight");
                    }
                }
            } else if let Some(p) = pinned.get_mut(&m).filter(|p| **p > 0) {
                *p -= 1;
                c.unpin(m);
            }
            assert!(c.used() <= c.capacity());
            for (&m, &p) in &pinned {
                assert!(p == 0 || c.contains(m), "{m} in flight but not resident");
            }
        }
    }
}
