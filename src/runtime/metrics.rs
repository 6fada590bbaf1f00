//! A runtime's metrics, exposed in the Prometheus / OpenMetrics text format
//! ([`Runtime::metrics_text`](crate::Runtime::metrics_text), `serve_runtime_metrics` in C).
//!
//! Every series is labelled with the model's name (`model`); see [`METRICS`] for the list. Models
//! loaded under the same name share their series (give models distinct names with
//! `ModelOptions::name` to tell them apart); a name's series are removed when the last model
//! of that name is freed, so a long-lived runtime that loads and frees models keeps no series
//! for models it no longer has.
//!
//! Recording is cheap and happens where the event is known: the submitting thread counts
//! refused submits, the engine thread everything else (a completion: one counter and up to
//! three histogram observations; a task: one histogram observation and one busy-time add).
//! A scrape encodes the current values; it takes the metric families' read locks only, so it
//! never holds up the engine for long.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

use crate::error::Code;
use crate::sched::Time;

/// The series a runtime exposes (`serve_` prefix; counters get OpenMetrics' `_total` suffix):
///
/// | metric | type | labels | what |
/// |---|---|---|---|
/// | `serve_requests_completed_total` | counter | model, code | requests completed, by code |
/// | `serve_requests_rejected_total` | counter | model, code | submits refused at once (BUSY, INVALID_ARGUMENT, …) |
/// | `serve_request_queue_seconds` | histogram | model | submit → first task launched (or completion, if never started) |
/// | `serve_request_service_seconds` | histogram | model | first task launched → completion (started requests) |
/// | `serve_request_latency_seconds` | histogram | model | submit → completion (every completed request) |
/// | `serve_batch_size` | histogram | model | requests (real rows) per launched task |
/// | `serve_queue_depth` | gauge | model | requests queued in the policy, not started |
/// | `serve_in_flight` | gauge | model | requests the engine holds (arrived, not completed) |
/// | `serve_worker_busy_seconds_total` | counter | model, worker | time a worker's stream had a task in hand |
/// | `serve_worker_compute_seconds_total` | counter | model, worker | compute time the backend measured of the worker's tasks |
/// | `serve_worker_stalls_total` | counter | model, worker | times the stall watchdog gave up on the worker's stream |
///
/// A worker counts as busy from a task's launch (or the end of the task before it on the same
/// stream, whichever is later) until the engine learns of the task's completion; of that, the backend
/// measured its compute (the CPU stream times each task on its thread, the CUDA runner with
/// events on its stream): busy minus compute is the engine's hand-off time.
pub const METRICS: &[&str] = &[
    "serve_requests_completed_total",
    "serve_requests_rejected_total",
    "serve_request_queue_seconds",
    "serve_request_service_seconds",
    "serve_request_latency_seconds",
    "serve_batch_size",
    "serve_queue_depth",
    "serve_in_flight",
    "serve_worker_busy_seconds_total",
    "serve_worker_compute_seconds_total",
    "serve_worker_stalls_total",
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabel {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CodeLabels {
    model: String,
    code: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    model: String,
    worker: String,
}

type Seconds = Counter<f64, AtomicU64>;

/// A histogram with one writer (the engine thread) and any number of readers (scrapes):
/// observing is integer arithmetic and a few relaxed atomic loads and stores, no lock and no
/// read-modify-write, where `prometheus_client`'s histogram takes a mutex per observation (which
/// cost the round trip several percent). Values are whole `unit`s (nanoseconds for the time
/// series, rows for batch sizes), summed as integers and scaled at a scrape. Buckets are powers
/// of two from `first` (`le` = first × 2^k units, then `+Inf`). A scrape may see an
/// observation's count before its sum; nothing is lost or counted twice.
#[derive(Clone, Debug)]
pub(crate) struct Histogram(Arc<HistogramInner>);

#[derive(Debug)]
struct HistogramInner {
    /// The first bucket's bound, in units (≥ 1).
    first: u64,
    /// What one unit is in the exposition (1e-9 for seconds counted in nanoseconds).
    unit: f64,
    /// Per-bucket counts; the last is `+Inf`.
    counts: Box<[AtomicU64]>,
    /// The sum, in units (saturating).
    sum: AtomicU64,
}

impl Histogram {
    fn new(first: u64, unit: f64, buckets: usize) -> Histogram {
        let counts = (0..=buckets).map(|_| AtomicU64::new(0)).collect();
        Histogram(Arc::new(HistogramInner { first: first.max(1), unit, counts, sum: AtomicU64::new(0) }))
    }

    /// Record `v` units. One writer only (the engine thread), or counts may be lost.
    fn observe(&self, v: u64) {
        let h = &*self.0;
        let last = h.counts.len() - 1;
        // The first bucket whose bound first × 2^k is ≥ v: n = ceil(v / first) lies in
        // (2^(k-1), 2^k], so k = ceil(log2(n)) = the bits of n - 1 (0 for n ≤ 1).
        let n = v.div_ceil(h.first);
        let bucket = if n <= 1 { 0 } else { ((u64::BITS - (n - 1).leading_zeros()) as usize).min(last) };
        let c = &h.counts[bucket];
        c.store(c.load(Relaxed) + 1, Relaxed);
        h.sum.store(h.sum.load(Relaxed).saturating_add(v), Relaxed);
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> std::fmt::Result {
        let h = &*self.0;
        let last = h.counts.len() - 1;
        let buckets: Vec<(f64, u64)> = h
            .counts
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let bound = if k == last { f64::INFINITY } else { (h.first << k) as f64 * h.unit };
                (bound, c.load(Relaxed))
            })
            .collect();
        let count = buckets.iter().map(|b| b.1).sum();
        let sum = h.sum.load(Relaxed) as f64 * h.unit;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// Histogram buckets of the time metrics: 10 µs × 2^k up to ~42 s (observed in nanoseconds).
#[derive(Clone)]
struct TimeBuckets;
impl MetricConstructor<Histogram> for TimeBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(10_000, 1e-9, 23)
    }
}

/// Histogram buckets of the batch size: 1, 2, 4, … 65,536 (the largest batch a model may have).
#[derive(Clone)]
struct BatchBuckets;
impl MetricConstructor<Histogram> for BatchBuckets {
    fn new_metric(&self) -> Histogram {
        Histogram::new(1, 1.0, 17)
    }
}

/// The metric families of one runtime and the registry that encodes them.
pub(crate) struct Metrics {
    registry: Registry,
    completed: Family<CodeLabels, Counter>,
    rejected: Family<CodeLabels, Counter>,
    queue_seconds: Family<ModelLabel, Histogram, TimeBuckets>,
    service_seconds: Family<ModelLabel, Histogram, TimeBuckets>,
    latency_seconds: Family<ModelLabel, Histogram, TimeBuckets>,
    batch_size: Family<ModelLabel, Histogram, BatchBuckets>,
    queue_depth: Family<ModelLabel, Gauge>,
    in_flight: Family<ModelLabel, Gauge>,
    busy: Family<WorkerLabels, Seconds>,
    compute: Family<WorkerLabels, Seconds>,
    stalls: Family<WorkerLabels, Counter>,
    /// Live models per name, and the most workers a model of that name has had (the busy
    /// series to remove with the name).
    names: Mutex<HashMap<String, (usize, usize)>>,
}

impl Metrics {
    pub(crate) fn new() -> Arc<Metrics> {
        let m = Metrics {
            registry: Registry::default(),
            completed: Family::default(),
            rejected: Family::default(),
            queue_seconds: Family::new_with_constructor(TimeBuckets),
            service_seconds: Family::new_with_constructor(TimeBuckets),
            latency_seconds: Family::new_with_constructor(TimeBuckets),
            batch_size: Family::new_with_constructor(BatchBuckets),
            queue_depth: Family::default(),
            in_flight: Family::default(),
            busy: Family::default(),
            compute: Family::default(),
            stalls: Family::default(),
            names: Mutex::new(HashMap::new()),
        };
        let mut registry = Registry::with_prefix("serve");
        registry.register("requests_completed", "Requests completed, by code", m.completed.clone());
        registry.register("requests_rejected", "Submits refused at once, by code", m.rejected.clone());
        registry.register(
            "request_queue_seconds",
            "Time from submit to the request's first task launch (or its completion, if it never started)",
            m.queue_seconds.clone(),
        );
        registry.register(
            "request_service_seconds",
            "Time from a request's first task launch to its completion",
            m.service_seconds.clone(),
        );
        registry.register(
            "request_latency_seconds",
            "Time from submit to completion",
            m.latency_seconds.clone(),
        );
        registry.register("batch_size", "Requests per launched task", m.batch_size.clone());
        registry.register("queue_depth", "Requests queued in the policy, not started", m.queue_depth.clone());
        registry.register(
            "in_flight",
            "Requests the engine holds: arrived, not completed",
            m.in_flight.clone(),
        );
        registry.register("worker_busy_seconds", "Time a worker's stream had a task in hand", m.busy.clone());
        registry.register(
            "worker_compute_seconds",
            "Compute time the backend measured of the worker's tasks",
            m.compute.clone(),
        );
        registry.register(
            "worker_stalls",
            "Times the stall watchdog gave up on the worker's stream",
            m.stalls.clone(),
        );
        Arc::new(Metrics { registry, ..m })
    }

    /// The handles of one model's series (created at 0 if the name is new).
    pub(crate) fn model(self: &Arc<Self>, name: &str, workers: usize) -> ModelMetrics {
        {
            let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
            let e = names.entry(name.to_string()).or_insert((0, 0));
            e.0 += 1;
            e.1 = e.1.max(workers);
        }
        let model = ModelLabel { model: name.to_string() };
        let worker = |w: usize| WorkerLabels { model: name.to_string(), worker: w.to_string() };
        let by_code = |f: &Family<CodeLabels, Counter>| {
            Code::ALL.map(|c| f.get_or_create_owned(&CodeLabels { model: name.to_string(), code: c.name() }))
        };
        ModelMetrics {
            completed: by_code(&self.completed),
            rejected: by_code(&self.rejected),
            queue_seconds: self.queue_seconds.get_or_create_owned(&model),
            service_seconds: self.service_seconds.get_or_create_owned(&model),
            latency_seconds: self.latency_seconds.get_or_create_owned(&model),
            batch_size: self.batch_size.get_or_create_owned(&model),
            queue_depth: self.queue_depth.get_or_create_owned(&model),
            in_flight: self.in_flight.get_or_create_owned(&model),
            busy: (0..workers).map(|w| self.busy.get_or_create_owned(&worker(w))).collect(),
            compute: (0..workers).map(|w| self.compute.get_or_create_owned(&worker(w))).collect(),
            stalls: (0..workers).map(|w| self.stalls.get_or_create_owned(&worker(w))).collect(),
            gauges_set: Default::default(),
            name: name.to_string(),
            metrics: self.clone(),
        }
    }

    /// The exposition of every series (OpenMetrics text, ending `# EOF`).
    pub(crate) fn encode(&self) -> String {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry)
            .expect("writing to a String cannot fail");
        text
    }

    /// The last model named `name` is gone: drop its series.
    fn release(&self, name: &str) {
        let mut names = self.names.lock().unwrap_or_else(|p| p.into_inner());
        let Some(e) = names.get_mut(name) else { return };
        e.0 -= 1;
        if e.0 > 0 {
            return;
        }
        let workers = e.1;
        names.remove(name);
        let model = ModelLabel { model: name.to_string() };
        for c in Code::ALL {
            let labels = CodeLabels { model: name.to_string(), code: c.name() };
            self.completed.remove(&labels);
            self.rejected.remove(&labels);
        }
        for f in [&self.queue_seconds, &self.service_seconds, &self.latency_seconds] {
            f.remove(&model);
        }
        self.batch_size.remove(&model);
        self.queue_depth.remove(&model);
        self.in_flight.remove(&model);
        for w in 0..workers {
            let labels = WorkerLabels { model: name.to_string(), worker: w.to_string() };
            self.busy.remove(&labels);
            self.compute.remove(&labels);
            self.stalls.remove(&labels);
        }
        // `names` is held to here: a model of this name added meanwhile waits, then creates anew.
    }
}

/// One model's series; its last owner (handle side or engine side) releases them.
pub(crate) struct ModelMetrics {
    completed: [Counter; Code::ALL.len()],
    rejected: [Counter; Code::ALL.len()],
    queue_seconds: Histogram,
    service_seconds: Histogram,
    latency_seconds: Histogram,
    batch_size: Histogram,
    queue_depth: Gauge,
    in_flight: Gauge,
    busy: Vec<Seconds>,
    compute: Vec<Seconds>,
    stalls: Vec<Counter>,
    /// The gauge values this model last added (queued, in flight).
    gauges_set: [AtomicI64; 2],
    name: String,
    metrics: Arc<Metrics>,
}

impl ModelMetrics {
    pub(crate) fn rejected(&self, code: Code) {
        self.rejected[code as usize].inc();
    }

    /// A request completed with `code` at `now`; it was submitted at `submitted` and its first
    /// task launched at `started` (if any did). Times are the engine's (nanoseconds on one
    /// clock), so the durations are integer differences.
    pub(crate) fn completed(&self, code: Code, submitted: Time, started: Option<Time>, now: Time) {
        self.completed[code as usize].inc();
        let ns = |from: Time, to: Time| to.0.saturating_sub(from.0);
        self.queue_seconds.observe(ns(submitted, started.unwrap_or(now)));
        if let Some(s) = started {
            self.service_seconds.observe(ns(s, now));
        }
        self.latency_seconds.observe(ns(submitted, now));
    }

    pub(crate) fn task_launched(&self, requests: usize) {
        self.batch_size.observe(requests as u64);
    }

    pub(crate) fn worker_compute(&self, worker: usize, compute: Duration) {
        if let Some(c) = self.compute.get(worker) {
            c.inc_by(compute.as_secs_f64());
        }
    }

    pub(crate) fn worker_busy(&self, worker: usize, busy: Duration) {
        if let Some(c) = self.busy.get(worker) {
            c.inc_by(busy.as_secs_f64());
        }
    }

    pub(crate) fn worker_stalled(&self, worker: usize) {
        if let Some(c) = self.stalls.get(worker) {
            c.inc();
        }
    }

    /// This model's current queue depth and in-flight count. The gauges of models sharing a
    /// name hold their sum: each model adds the change since its last values.
    pub(crate) fn set_gauges(&self, queued: usize, in_flight: usize) {
        let queued = i64::try_from(queued).unwrap_or(i64::MAX);
        let in_flight = i64::try_from(in_flight).unwrap_or(i64::MAX);
        let was_queued = self.gauges_set[0].swap(queued, Relaxed);
        let was_in_flight = self.gauges_set[1].swap(in_flight, Relaxed);
        if queued != was_queued {
            self.queue_depth.inc_by(queued - was_queued);
        }
        if in_flight != was_in_flight {
            self.in_flight.inc_by(in_flight - was_in_flight);
        }
    }
}

impl Drop for ModelMetrics {
    /// Take this model's share out of the gauges, then release the name.
    fn drop(&mut self) {
        self.set_gauges(0, 0);
        self.metrics.release(&self.name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(h: &Histogram) -> Vec<u64> {
        h.0.counts.iter().map(|c| c.load(Relaxed)).collect()
    }

    #[test]
    fn observations_land_in_the_first_bucket_whose_bound_holds_them() {
        // Bounds 1, 2, 4, 8, then +Inf.
        let h = Histogram::new(1, 1.0, 4);
        for v in [0, 1, 2, 3, 4, 5, 8, 9, 1 << 40, u64::MAX] {
            h.observe(v);
        }
        assert_eq!(counts(&h), [2, 1, 2, 2, 3]);
        // The sum saturates rather than wrapping.
        assert_eq!(h.0.sum.load(Relaxed), u64::MAX);
        // Time buckets: 10 µs × 2^k, observed in nanoseconds.
        let t = Histogram::new(10_000, 1e-9, 23);
        t.observe(10_000);
        t.observe(15_000);
        t.observe(1_000_000_000); // 10 µs × 2^17 = 1.31 s
        let c = counts(&t);
        assert_eq!((c[0], c[1], c[17]), (1, 1, 1));
        assert_eq!(c.iter().sum::<u64>(), 3);
    }
}
