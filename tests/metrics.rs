//! The runtime's Prometheus / OpenMetrics exposition (issue 18 item 11): parsed strictly
//! (tests/common/openmetrics.rs) and checked against what the test did — requests by model and
//! code, refused submits, latency, batch-size and busy-time series, gauges, and the series of a
//! freed model going away.

mod common;

use std::time::{Duration, Instant};

use common::openmetrics::Exposition;
use common::recurrent::{cases, fixture};
use common::{input, mlp_dir};
use serve::{
    BackendChoice, Code, CompletionQueue, Input, ModelOptions, PolicyConfig, Runtime, SubmitOptions,
    TimeoutConfig,
};

fn runtime() -> Runtime {
    Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap()
}

fn named(name: &str, policy: PolicyConfig) -> ModelOptions {
    ModelOptions { name: Some(name.into()), policy, ..ModelOptions::default() }
}

fn timeout(max_batch: usize, max_wait: Duration) -> PolicyConfig {
    PolicyConfig::Timeout(TimeoutConfig { max_batch, max_wait, workers: 1, pad_to_max: false })
}

fn scrape(rt: &Runtime) -> Exposition {
    Exposition::parse(&rt.metrics_text())
}

#[test]
fn every_metric_is_exposed_with_its_type() {
    let rt = runtime();
    let (dir, _) = mlp_dir("metrics-types", &[4, 3], 1);
    let _m = rt.load_model(&dir, named("m", PolicyConfig::Auto)).unwrap();
    let e = scrape(&rt);
    for (name, ty) in [
        ("serve_requests_completed", "counter"),
        ("serve_requests_rejected", "counter"),
        ("serve_request_queue_seconds", "histogram"),
        ("serve_request_service_seconds", "histogram"),
        ("serve_request_latency_seconds", "histogram"),
        ("serve_batch_size", "histogram"),
        ("serve_queue_depth", "gauge"),
        ("serve_in_flight", "gauge"),
        ("serve_worker_busy_seconds", "counter"),
        ("serve_worker_compute_seconds", "counter"),
        ("serve_worker_stalls", "counter"),
    ] {
        assert_eq!(e.types.get(name).map(String::as_str), Some(ty), "{name}");
    }
    // The documented list names each family's samples.
    assert_eq!(serve::runtime::METRICS.len(), 11);
    for m in serve::runtime::METRICS {
        let family = m.strip_suffix("_total").unwrap_or(m);
        assert!(e.types.contains_key(family), "{m} is listed but not exposed");
    }
    // A new model's series exist at zero for every code, before any request.
    for c in Code::ALL {
        assert_eq!(e.get("serve_requests_completed_total", &[("model", "m"), ("code", c.name())]), Some(0.0));
        assert_eq!(e.get("serve_requests_rejected_total", &[("model", "m"), ("code", c.name())]), Some(0.0));
    }
    assert_eq!(e.histogram("serve_request_latency_seconds", &[("model", "m")]), (0, 0.0));
}

#[test]
fn requests_are_counted_by_model_and_code_and_timed() {
    let rt = runtime();
    let (dir, _) = mlp_dir("metrics-mlp", &[4, 8, 3], 2);
    // Batches of up to 8 that wait up to 20 ms to fill: 20 concurrent requests form few tasks.
    let mlp = rt.load_model(&dir, named("mlp", timeout(8, Duration::from_millis(20)))).unwrap();
    let lstm = rt.load_model(fixture("lstm_small"), named("lstm", PolicyConfig::Auto)).unwrap();
    let slow = rt.load_model(&dir, named("slow", timeout(64, Duration::from_secs(60)))).unwrap();

    let tickets: Vec<_> =
        (0..20).map(|k| mlp.submit(Input::F32(input(4, k)), SubmitOptions::default()).unwrap()).collect();
    for t in tickets {
        t.wait().unwrap();
    }
    for bad in [vec![0.0; 3], vec![0.0; 5], vec![f32::NAN; 4]] {
        assert_eq!(
            mlp.submit(Input::F32(bad), SubmitOptions::default()).err().unwrap().code(),
            Code::InvalidArgument
        );
    }
    let past = SubmitOptions { deadline: Some(Instant::now()), priority: 0 };
    assert_eq!(mlp.submit(Input::F32(input(4, 0)), past).err().unwrap().code(), Code::DeadlineExceeded);
    let lstm_cases = cases("lstm_small");
    for c in &lstm_cases {
        lstm.submit(c.input.clone(), SubmitOptions::default()).unwrap().wait().unwrap();
    }
    // Queued behind a 60 s batch timer, then cancelled: completes CANCELLED without starting.
    let q = CompletionQueue::new().unwrap();
    let id = slow.submit_to(Input::F32(input(4, 1)), SubmitOptions::default(), &q, 0).unwrap();
    rt.cancel(id).unwrap();
    assert_eq!(
        q.next(1, Duration::from_secs(20)).unwrap().pop().unwrap().result.unwrap_err().code(),
        Code::Cancelled
    );

    let e = scrape(&rt);
    let completed =
        |m: &str, c: Code| e.get("serve_requests_completed_total", &[("model", m), ("code", c.name())]);
    let rejected =
        |m: &str, c: Code| e.get("serve_requests_rejected_total", &[("model", m), ("code", c.name())]);
    assert_eq!(completed("mlp", Code::Ok), Some(20.0));
    assert_eq!(rejected("mlp", Code::InvalidArgument), Some(3.0));
    assert_eq!(rejected("mlp", Code::DeadlineExceeded), Some(1.0));
    assert_eq!(completed("lstm", Code::Ok), Some(lstm_cases.len() as f64));
    assert_eq!(completed("slow", Code::Cancelled), Some(1.0));
    assert_eq!(completed("slow", Code::Ok), Some(0.0));

    // Every completed request has a queue and a total time; only started ones a service time.
    let mlp_l = [("model", "mlp")];
    let (n, total) = e.histogram("serve_request_latency_seconds", &mlp_l);
    assert_eq!(n, 20);
    assert!(total > 0.0);
    assert_eq!(e.histogram("serve_request_queue_seconds", &mlp_l).0, 20);
    assert_eq!(e.histogram("serve_request_service_seconds", &mlp_l).0, 20);
    let slow_l = [("model", "slow")];
    assert_eq!(e.histogram("serve_request_latency_seconds", &slow_l).0, 1);
    assert_eq!(e.histogram("serve_request_queue_seconds", &slow_l).0, 1);
    assert_eq!(e.histogram("serve_request_service_seconds", &slow_l).0, 0, "the cancelled request never ran");
    // Queue + service of each request is its total, so the sums add up (to rounding).
    let queue = e.histogram("serve_request_queue_seconds", &mlp_l).1;
    let service = e.histogram("serve_request_service_seconds", &mlp_l).1;
    assert!((queue + service - total).abs() <= 1e-6 * 20.0 + 1e-9 * total, "{queue} + {service} vs {total}");

    // Batch sizes: the tasks carried the 20 requests, in batches of at most 8.
    let (tasks, rows) = e.histogram("serve_batch_size", &mlp_l);
    assert_eq!(rows, 20.0);
    assert!((3..=20).contains(&tasks), "{tasks} tasks");
    assert_eq!(e.get("serve_batch_size_bucket", &[("model", "mlp"), ("le", "8.0")]), Some(tasks as f64));
    let (lstm_tasks, lstm_rows) = e.histogram("serve_batch_size", &[("model", "lstm")]);
    assert!(lstm_tasks > 0 && lstm_rows >= lstm_cases.len() as f64);

    // One worker each; it was busy while tasks ran, never longer than the test.
    let busy = e.get("serve_worker_busy_seconds_total", &[("model", "mlp"), ("worker", "0")]).unwrap();
    assert!(busy > 0.0 && busy < rt.uptime().as_secs_f64(), "busy {busy}");
    assert_eq!(e.get("serve_worker_busy_seconds_total", &[("model", "slow"), ("worker", "0")]), Some(0.0));
    // Of that, the CPU stream measured the compute: positive, and within the busy time.
    let compute = e.get("serve_worker_compute_seconds_total", &[("model", "mlp"), ("worker", "0")]).unwrap();
    assert!(compute > 0.0 && compute <= busy, "compute {compute}, busy {busy}");

    // Idle now: nothing queued or in flight.
    for m in ["mlp", "lstm", "slow"] {
        assert_eq!(e.get("serve_queue_depth", &[("model", m)]), Some(0.0), "{m}");
        assert_eq!(e.get("serve_in_flight", &[("model", m)]), Some(0.0), "{m}");
    }
    // The totals agree with the stats snapshot.
    let s = rt.stats();
    let sum = |name: &str| e.matching(name, &[]).iter().map(|(_, v)| v).sum::<f64>();
    assert_eq!(sum("serve_requests_completed_total"), s.completed_total() as f64);
    assert_eq!(sum("serve_requests_rejected_total"), s.rejected as f64);
    // Every task ran on the CPU backend, which timed it; the sums agree.
    assert_eq!(s.timed_tasks, s.tasks_launched);
    let compute = sum("serve_worker_compute_seconds_total");
    assert!((compute - s.task_compute_ns as f64 * 1e-9).abs() < 1e-6, "{compute} vs {}", s.task_compute_ns);
    assert!(s.mean_task_compute().is_some_and(|c| c > Duration::ZERO));
}

#[test]
fn gauges_show_queued_requests() {
    let rt = runtime();
    let (dir, _) = mlp_dir("metrics-gauges", &[4, 3], 3);
    let m = rt.load_model(&dir, named("waiting", timeout(64, Duration::from_secs(60)))).unwrap();
    let q = CompletionQueue::new().unwrap();
    let ids: Vec<_> = (0..5)
        .map(|k| m.submit_to(Input::F32(input(4, k)), SubmitOptions::default(), &q, k).unwrap())
        .collect();
    // The gauges are published by the engine after it has handled the arrivals.
    let give_up = Instant::now() + Duration::from_secs(20);
    let e = loop {
        let e = scrape(&rt);
        if e.get("serve_queue_depth", &[("model", "waiting")]) == Some(5.0) || Instant::now() > give_up {
            break e;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(e.get("serve_queue_depth", &[("model", "waiting")]), Some(5.0));
    assert_eq!(e.get("serve_in_flight", &[("model", "waiting")]), Some(5.0));
    for id in ids {
        rt.cancel(id).unwrap();
    }
    let mut got = 0;
    while got < 5 {
        let batch = q.next(5, Duration::from_secs(20)).unwrap();
        assert!(!batch.is_empty(), "cancelled requests did not complete");
        got += batch.len();
    }
    let e = scrape(&rt);
    assert_eq!(e.get("serve_queue_depth", &[("model", "waiting")]), Some(0.0));
    assert_eq!(
        e.get("serve_requests_completed_total", &[("model", "waiting"), ("code", "CANCELLED")]),
        Some(5.0)
    );
}

#[test]
fn models_sharing_a_name_share_series_which_go_when_the_last_is_freed() {
    let rt = runtime();
    let (dir, _) = mlp_dir("metrics-free", &[4, 3], 4);
    let a = rt.load_model(&dir, named("shared", PolicyConfig::Auto)).unwrap();
    let b = rt.load_model(&dir, named("shared", PolicyConfig::Auto)).unwrap();
    let other = rt.load_model(&dir, named("other", PolicyConfig::Auto)).unwrap();
    for m in [&a, &b, &b, &other] {
        m.submit(Input::F32(input(4, 0)), SubmitOptions::default()).unwrap().wait().unwrap();
    }
    let ok =
        |e: &Exposition, m: &str| e.get("serve_requests_completed_total", &[("model", m), ("code", "OK")]);
    assert_eq!(ok(&scrape(&rt), "shared"), Some(3.0));
    drop(a);
    // b still serves under the name: the series stay and keep counting.
    b.submit(Input::F32(input(4, 1)), SubmitOptions::default()).unwrap().wait().unwrap();
    assert_eq!(ok(&scrape(&rt), "shared"), Some(4.0));
    drop(b);
    // The engine releases the model once idle; then no series names it.
    let give_up = Instant::now() + Duration::from_secs(20);
    while scrape(&rt).label_values("model").contains(&"shared".to_string()) {
        assert!(Instant::now() < give_up, "the freed model's series were not removed");
        std::thread::sleep(Duration::from_millis(5));
    }
    let e = scrape(&rt);
    assert_eq!(e.label_values("model"), ["other"]);
    assert_eq!(ok(&e, "other"), Some(1.0));
    // A new model under the freed name starts from zero.
    let c = rt.load_model(&dir, named("shared", PolicyConfig::Auto)).unwrap();
    assert_eq!(ok(&scrape(&rt), "shared"), Some(0.0));
    drop((c, other));
}
