//! Serving more model instances than fit in device memory (DeepPlan §5.3): a cold server runs
//! requests for the instances of one model on `devices` workers, one request at a time per
//! device, first come first served (as the paper serves: no batching). An instance's home device
//! is `instance mod devices`. A request for a resident instance runs warm from its arena; one for
//! an instance not resident evicts least-recently-used instances of its device until the plan's
//! load set fits the device budget ([`InstanceCache`]: never an instance in flight), then runs
//! cold by the plan ([`run_cold`]: copies pipelined with execution, DHA layers read from the
//! host), and the instance stays resident. Freeing the server cancels what is queued (each
//! request still answered once, `CANCELLED`), joins the workers and frees every arena.
//!
//! On the CPU backend the device arena is host memory filled by throttled copies (the executor
//! of `backend::cpu::cold`), so this is the mechanism — residency, eviction, cold and warm runs,
//! exactly-once answers — with bus times emulated. The instances share the model's host
//! parameters (each instance's device arena is its own).

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, PoisonError, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::backend::cpu::cold::program::LayerProgram;
use crate::backend::cpu::cold::{ColdOptions, Resident, run_cold, run_resident};
use crate::error::{Code, Error, Result};
use crate::plan::deepplan::ColdPlan;
use crate::sched::instances::InstanceCache;

/// Most devices (workers) of a cold server.
pub const MAX_DEVICES: usize = 1024;
/// Most instances of a cold server.
pub const MAX_INSTANCES: usize = 1 << 20;

/// How a cold server runs.
#[derive(Clone, Debug, PartialEq)]
pub struct ColdServerConfig {
    /// Workers, each with its own device budget.
    pub devices: usize,
    /// Bytes of each device instances may occupy.
    pub budget_bytes: u64,
    /// Requests queued per device before `submit` answers BUSY.
    pub max_queued: usize,
    /// Copy and bus rates of the executor.
    pub copy: ColdOptions,
}

/// One request's answer.
#[derive(Debug)]
pub struct ColdReply {
    pub result: Result<Vec<f32>>,
    /// It found its instance out of device memory and ran by the plan.
    pub cold: bool,
    /// From submit to the answer.
    pub latency: Duration,
}

struct Job {
    instance: usize,
    input: Vec<f32>,
    submitted: Instant,
    reply: mpsc::Sender<ColdReply>,
}

struct DeviceState {
    queue: VecDeque<Job>,
    cache: InstanceCache,
    arenas: HashMap<usize, Resident>,
    shutdown: bool,
    /// The most bytes resident at once.
    peak: u64,
}

struct Device {
    state: Mutex<DeviceState>,
    wake: Condvar,
}

impl Device {
    fn lock(&self) -> std::sync::MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The model a cold server serves.
struct Served {
    program: Arc<dyn LayerProgram + Send + Sync>,
    plan: ColdPlan,
    copy: ColdOptions,
}

/// Serves the instances of one model beyond device memory (module docs).
pub struct ColdServer {
    devices: Vec<Arc<Device>>,
    threads: Vec<JoinHandle<()>>,
    instances: usize,
    max_queued: usize,
}

impl ColdServer {
    /// A server of `instances` instances of `program`, each cold-started by `plan`. Refused
    /// (INVALID_ARGUMENT, with the sizes) when the plan's load set exceeds the device budget or
    /// the plan is not of this program.
    pub fn new(
        program: Arc<dyn LayerProgram + Send + Sync>,
        plan: ColdPlan,
        instances: usize,
        config: ColdServerConfig,
    ) -> Result<ColdServer> {
        if !(1..=MAX_DEVICES).contains(&config.devices) || !(1..=MAX_INSTANCES).contains(&instances) {
            return Err(Error::invalid(format!(
                "{} devices and {instances} instances: 1 to {MAX_DEVICES} devices and 1 to {MAX_INSTANCES} instances expected",
                config.devices
            )));
        }
        crate::backend::cpu::cold::check_plan(program.as_ref(), &plan.plan)?;
        config.copy.check()?;
        if config.max_queued == 0 {
            return Err(Error::invalid("max_queued is 0: every request would be refused"));
        }
        if plan.device_bytes > config.budget_bytes {
            return Err(Error::invalid(format!(
                "model `{}` loads {} bytes under its plan, more than the device budget of {} bytes{}",
                plan.model,
                plan.device_bytes,
                config.budget_bytes,
                if plan.host_bytes == 0 { "" } else { " (its DHA layers already stay on the host)" }
            )));
        }
        let served = Arc::new(Served { program, plan, copy: config.copy.clone() });
        let mut devices = vec![];
        let mut threads = vec![];
        for d in 0..config.devices {
            let device = Arc::new(Device {
                state: Mutex::new(DeviceState {
                    queue: VecDeque::new(),
                    cache: InstanceCache::new(config.budget_bytes),
                    arenas: HashMap::new(),
                    shutdown: false,
                    peak: 0,
                }),
                wake: Condvar::new(),
            });
            let (dev, srv) = (Arc::clone(&device), Arc::clone(&served));
            let spawned = std::thread::Builder::new()
                .name(format!("serve-cold-dev{d}"))
                .spawn(move || worker(&dev, &srv));
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    let partial = ColdServer { devices, threads, instances, max_queued: config.max_queued };
                    drop(partial);
                    return Err(Error::internal(format!("cannot start a cold-start worker: {e}")));
                }
            }
            devices.push(device);
        }
        Ok(ColdServer { devices, threads, instances, max_queued: config.max_queued })
    }

    /// Queues a request for `instance`; its answer arrives on the returned receiver, exactly
    /// once. INVALID_ARGUMENT for an instance out of range, BUSY when its device's queue is full.
    pub fn submit(&self, instance: usize, input: Vec<f32>) -> Result<mpsc::Receiver<ColdReply>> {
        if instance >= self.instances {
            return Err(Error::invalid(format!(
                "instance {instance}: the server has {} instances",
                self.instances
            )));
        }
        let device = &self.devices[instance % self.devices.len()];
        let (tx, rx) = mpsc::channel();
        let mut s = device.lock();
        if s.shutdown {
            return Err(Error::new(Code::Shutdown, "the cold server is shutting down"));
        }
        if s.queue.len() >= self.max_queued {
            return Err(Error::new(
                Code::Busy,
                format!("{} requests queued on the instance's device", s.queue.len()),
            ));
        }
        s.queue.push_back(Job { instance, input, submitted: Instant::now(), reply: tx });
        device.wake.notify_one();
        Ok(rx)
    }

    /// Bytes resident on `device` now, and the most ever resident at once (`None`: no such
    /// device).
    pub fn resident_bytes(&self, device: usize) -> Option<(u64, u64)> {
        let s = self.devices.get(device)?.lock();
        Some((s.cache.used(), s.peak))
    }

    /// Instances resident on `device`, least recently used first (empty: no such device).
    pub fn resident(&self, device: usize) -> Vec<usize> {
        self.devices.get(device).map_or_else(Vec::new, |d| d.lock().cache.resident().collect())
    }
}

impl Drop for ColdServer {
    fn drop(&mut self) {
        for d in &self.devices {
            d.lock().shutdown = true;
            d.wake.notify_all();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn worker(device: &Device, served: &Served) {
    loop {
        let (job, warm) = {
            let mut s = device.lock();
            while s.queue.is_empty() && !s.shutdown {
                s = device.wake.wait(s).unwrap_or_else(PoisonError::into_inner);
            }
            if s.shutdown {
                for job in s.queue.drain(..) {
                    let _ = job.reply.send(ColdReply {
                        result: Err(Error::new(Code::Cancelled, "the cold server shut down")),
                        cold: false,
                        latency: job.submitted.elapsed(),
                    });
                }
                s.arenas.clear();
                return;
            }
            let job = s.queue.pop_front().expect("not empty");
            let warm = if s.cache.pin(job.instance) {
                s.arenas.get(&job.instance).cloned()
            } else {
                match s.cache.admit(job.instance, served.plan.device_bytes) {
                    Ok(evicted) => {
                        for e in evicted {
                            s.arenas.remove(&e); // its arena is freed here
                        }
                        None
                    }
                    Err(e) => {
                        // Checked at construction; one request at a time: cannot happen.
                        let _ = job.reply.send(ColdReply {
                            result: Err(e),
                            cold: true,
                            latency: job.submitted.elapsed(),
                        });
                        continue;
                    }
                }
            };
            s.peak = s.peak.max(s.cache.used());
            (job, warm)
        };
        let cold = warm.is_none();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &warm {
            Some(resident) => {
                run_resident(served.program.as_ref(), &served.plan.plan, resident, &job.input, &served.copy)
                    .map(|o| (o, None))
            }
            None => run_cold(served.program.as_ref(), &served.plan, &job.input, &served.copy)
                .map(|(run, resident)| (run.output, Some(resident))),
        }))
        .unwrap_or_else(|_| Err(Error::internal("a layer panicked")));
        let result = {
            let mut s = device.lock();
            let result = match run {
                Ok((output, landed)) => {
                    if let Some(r) = landed {
                        s.arenas.insert(job.instance, r);
                    }
                    Ok(output)
                }
                Err(e) => {
                    s.cache.unpin(job.instance);
                    if cold {
                        s.cache.evict(job.instance); // nothing landed to keep
                    }
                    let _ =
                        job.reply.send(ColdReply { result: Err(e), cold, latency: job.submitted.elapsed() });
                    continue;
                }
            };
            s.cache.unpin(job.instance);
            result
        };
        let _ = job.reply.send(ColdReply { result, cold, latency: job.submitted.elapsed() });
    }
}

#[cfg(test)]
mod tests;
