use std::collections::HashSet;

use super::workload::{Lengths, requests};
use super::*;
use crate::PaddingConfig;
use crate::model::{Lstm, Seq2Seq, TreeLstm};
use crate::runtime::CellularOptions;
use crate::workload::poisson_arrivals;

fn lstm() -> Network {
    Network::Lstm(Lstm::random(50, 4, 4, 1, 1))
}

fn cost(points: &str, launch_us: f64, report_us: f64) -> CostFile {
    CostFile::parse(&format!(
        r#"{{"name":"t","cells":[{points}],"launch_us":{launch_us},"report_us":{report_us}}}"#
    ))
    .unwrap()
}

fn cellular(max_batch: usize) -> PolicyConfig {
    PolicyConfig::Cellular(CellularOptions {
        workers: 1,
        max_batch: vec![max_batch],
        max_tasks_to_submit: Some(5),
    })
}

fn spec<'a>(net: &'a Network, policy: &'a PolicyConfig, cost: &'a dyn CostModel) -> SimSpec<'a> {
    SimSpec { net, policy, cost, admission_bound: 4096, trace: true }
}

/// A step of 10 µs at one row (12 at two) whose issue takes the engine thread 20 µs.
fn issuing() -> CostFile {
    CostFile::parse(
        r#"{"name":"t","cells":[{"cell":"step","points":[[1,10.0],[2,12.0]],"issue":[[1,20.0]]}],
            "launch_us":3.0,"report_us":2.0}"#,
    )
    .unwrap()
}

/// The traced launches: when each was decided and its rows.
fn launches(out: &SimOutcome) -> Vec<(Time, usize)> {
    out.trace
        .iter()
        .filter_map(|e| match e {
            TraceEvent::Launch { at, rows, .. } => Some((*at, *rows)),
            _ => None,
        })
        .collect()
}

#[test]
fn one_request_takes_its_cells_back_to_back_plus_the_engine_delays() {
    let net = lstm();
    let c = cost(r#"{"cell":"step","points":[[1,10.0],[2,12.0]]}"#, 3.0, 2.0);
    let policy = cellular(8);
    let reqs = requests(&net, Lengths::Fixed(7), 1, 0).unwrap();
    let out =
        simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(vec![Duration::from_micros(100)])).unwrap();
    // MaxTasksToSubmit = 5: five steps go out at once and run back to back; each report lets
    // one more out, which reaches the stream 3 µs later, after the stream has run the queue.
    assert_eq!(out.completed(), 1);
    assert_eq!(out.tasks, 7);
    assert_eq!(out.latencies[0], Duration::from_micros(3 + 7 * 10 + 2));
    assert_eq!(out.mean_batch(), 1.0);
}

/// The engine thread issues tasks one after another: with an issue of 20 µs per task and
/// 10 µs of stream time, five steps decided at once are issued 20 µs apart; each starts on the
/// stream 3 µs after its issue starts and ends no sooner than its issue, and a step decided
/// while earlier ones are being issued waits for the engine thread, not for the stream.
#[test]
fn tasks_queue_for_the_engine_thread_that_issues_them() {
    let net = lstm();
    let c = issuing();
    let policy = cellular(8);
    let reqs = requests(&net, Lengths::Fixed(7), 1, 0).unwrap();
    let out =
        simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(vec![Duration::from_micros(100)])).unwrap();
    // Steps 1–5 (decided at 100) are issued over 100–200 and end at 120, 140, …, 200 (their
    // issues' ends; 10 µs on the stream from 103, 123, …). Steps 1 and 2 are reported at 122
    // and 142, while the engine thread is still issuing: it reads both at 200 and decides steps
    // 6 and 7 then, issued over 200–220 and 220–240; step 7 ends at 240, reported at 242.
    assert_eq!(out.tasks, 7);
    assert_eq!(out.latencies[0], Duration::from_micros(242 - 100));
    let at = |us: u64| (Time::ZERO + Duration::from_micros(us), 1);
    assert_eq!(launches(&out), [at(100), at(100), at(100), at(100), at(100), at(200), at(200)]);
    // Without issue points the same run is the stream's alone: 3 + 7 × 10 + 2.
    let plain = cost(r#"{"cell":"step","points":[[1,10.0],[2,12.0]]}"#, 3.0, 2.0);
    let out =
        simulate(&spec(&net, &policy, &plain), &reqs, &Load::Open(vec![Duration::from_micros(100)])).unwrap();
    assert_eq!(out.latencies[0], Duration::from_micros(3 + 7 * 10 + 2));
}

/// A task of several steps is issued once: a CPU stream gets the whole task in one launch (the
/// CUDA runner runs one step per task), so the engine thread's time does not grow with steps.
#[test]
fn a_task_of_several_steps_is_one_issue() {
    let net = lstm();
    let c = CostFile::parse(
        r#"{"name":"t","cells":[{"cell":"step","points":[[1,10.0]],"issue":[[1,20.0]]}],
            "launch_us":3.0,"report_us":2.0,"max_task_steps":7}"#,
    )
    .unwrap();
    let policy = PolicyConfig::Padding(PaddingConfig { max_batch: 1, ..PaddingConfig::default() });
    let reqs = requests(&net, Lengths::Fixed(7), 1, 0).unwrap();
    let out =
        simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(vec![Duration::from_micros(100)])).unwrap();
    // One task of 7 steps: on the stream from 103 for 70 µs (its 20 µs issue long over), reported
    // 2 µs after.
    assert_eq!(out.tasks, 1);
    assert_eq!(out.latencies, [Duration::from_micros(3 + 7 * 10 + 2)]);
}

/// The engine thread reads what came while it was issuing only once the issue is over, and
/// decides once for all of it: two requests arriving during one 20 µs issue share the next task
/// (the threaded engine's "one decision per turn"), where deciding at each arrival would have
/// launched each alone.
#[test]
fn arrivals_during_an_issue_share_the_next_task() {
    let net = lstm();
    let c = issuing();
    let policy = cellular(8);
    let reqs = requests(&net, Lengths::Fixed(1), 3, 0).unwrap();
    let at = [100, 105, 110].map(Duration::from_micros).to_vec();
    let out = simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(at)).unwrap();
    assert_eq!(out.completed(), 3);
    assert_eq!(out.tasks, 2);
    assert_eq!(out.task_rows, 3);
    let t = |us: u64| Time::ZERO + Duration::from_micros(us);
    assert_eq!(launches(&out), [(t(100), 1), (t(120), 2)]);
    // The first: issued 100–120 and ended with its issue; reported at 122, while the engine
    // issues the second task (120–140), so read at 140. The others count from their arrivals,
    // not from when the engine read them: issued 120–140, on the stream 123–135, ended with
    // the issue at 140, reported at 142.
    let mut lat = out.latencies.clone();
    lat.sort();
    assert_eq!(lat, [32, 37, 40].map(Duration::from_micros));
}

/// A request pays its arrival and delivery once: the latency runs from submit to the caller
/// holding the completion, and a closed loop's next request follows that delivery.
#[test]
fn arrival_and_delivery_are_paid_once_per_request() {
    let net = lstm();
    let c = CostFile::parse(
        r#"{"name":"t","cells":[{"cell":"step","points":[[1,10.0],[2,12.0]]}],"launch_us":3.0,
            "report_us":2.0,"arrival_us":40.0,"delivery_us":50.0}"#,
    )
    .unwrap();
    let policy = cellular(8);
    let reqs = requests(&net, Lengths::Fixed(7), 2, 0).unwrap();
    let out = simulate(&spec(&net, &policy, &c), &reqs, &Load::Closed { window: 1 }).unwrap();
    let one = Duration::from_micros(40 + 3 + 7 * 10 + 2 + 50);
    assert_eq!(out.latencies, vec![one, one]);
    assert_eq!(out.completed_at, vec![Time::ZERO + one, Time::ZERO + one + one]);
}

#[test]
fn the_same_inputs_give_the_identical_decision_trace() {
    let net = lstm();
    let c = CostFile::builtin("batchmaker-v100").unwrap();
    let policy = cellular(64);
    let reqs = requests(&net, Lengths::Wmt, 2000, 7).unwrap();
    let load = Load::Open(poisson_arrivals(20_000.0, 2000, 7));
    let a = simulate(&spec(&net, &policy, &c), &reqs, &load).unwrap();
    let b = simulate(&spec(&net, &policy, &c), &reqs, &load).unwrap();
    assert!(a.trace.len() > 2000);
    assert_eq!(a.trace, b.trace);
    let other =
        simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(poisson_arrivals(20_000.0, 2000, 8))).unwrap();
    assert_ne!(a.trace, other.trace, "another arrival seed decides differently");
}

#[test]
fn every_request_completes_exactly_once_and_tasks_respect_the_batch_limit() {
    for (net, policy) in [
        (lstm(), cellular(16)),
        (lstm(), PolicyConfig::Padding(PaddingConfig { max_batch: 16, ..PaddingConfig::default() })),
        (Network::Seq2Seq(Seq2Seq::random(10, 4, 4, 1, 1, 2, 30, 1)), PolicyConfig::Auto),
        (
            {
                let mut m = TreeLstm::random(50, 4, 4, 1);
                m.cfg.max_nodes = Some(crate::workload::TREEBANK_MAX_NODES);
                Network::TreeLstm(m)
            },
            PolicyConfig::Auto,
        ),
    ] {
        let cells = net
            .cell_types()
            .iter()
            .map(|t| format!(r#"{{"cell":"{}","points":[[1,20.0],[64,100.0]]}}"#, t.name))
            .collect::<Vec<_>>()
            .join(",");
        let c = cost(&cells, 5.0, 5.0);
        let reqs = requests(&net, Lengths::Wmt, 500, 3).unwrap();
        let out = simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(poisson_arrivals(5_000.0, 500, 3)))
            .unwrap();
        let mut seen = HashSet::new();
        for e in &out.trace {
            match e {
                TraceEvent::Complete { id, code, .. } => {
                    assert!(seen.insert(*id), "{id} completed twice");
                    assert_eq!(*code, Code::Ok);
                }
                TraceEvent::Launch { rows, batch, .. } => assert!(rows <= batch && *batch <= 512),
                TraceEvent::Arrive { .. } => {}
            }
        }
        assert_eq!(seen.len(), 500, "{}", net.kind());
    }
}

#[test]
fn a_decode_that_ends_early_runs_fewer_decoder_steps() {
    let net = Network::Seq2Seq(Seq2Seq::random(10, 4, 4, 1, 1, 2, 30, 1));
    let c =
        cost(r#"{"cell":"encoder","points":[[1,10.0]]},{"cell":"decoder","points":[[1,10.0]]}"#, 0.0, 0.0);
    let policy = PolicyConfig::Auto;
    let reqs = requests(&net, Lengths::Fixed(4), 1, 0).unwrap();
    assert_eq!(reqs[0].ends_at, Some(7), "4 source steps, then 4 decoded tokens");
    let out = simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(vec![Duration::ZERO])).unwrap();
    assert_eq!(out.completed(), 1);
    // 4 encoder steps and 4 decoder steps, then the request ends; decoder steps launched ahead
    // (MaxTasksToSubmit) may still run.
    assert!(out.latencies[0] >= Duration::from_micros(80), "{:?}", out.latencies[0]);
    assert!(out.latencies[0] < Duration::from_micros(30 * 10), "{:?}", out.latencies[0]);
}

#[test]
fn the_admission_bound_refuses_what_the_runtime_would() {
    let net = lstm();
    let c = cost(r#"{"cell":"step","points":[[1,1000.0]]}"#, 0.0, 0.0);
    let policy = cellular(4);
    let reqs = requests(&net, Lengths::Fixed(2), 10, 0).unwrap();
    let s = SimSpec { admission_bound: 4, ..spec(&net, &policy, &c) };
    let out = simulate(&s, &reqs, &Load::Open(vec![Duration::ZERO; 10])).unwrap();
    assert_eq!(out.completed(), 4);
    assert_eq!(out.errors.get(&Code::Busy), Some(&6));
}

/// BatchMaker at V100 scale: fixed length 24, b_max 512, saturated. The ideal is one full
/// batch per step time: 512 / (784 µs × 24) ≈ 27,211 requests/s.
#[test]
fn batchmaker_v100_fixed_length_approaches_the_ideal() {
    let net = lstm();
    let c = CostFile::builtin("batchmaker-v100").unwrap();
    let policy = cellular(512);
    let reqs = requests(&net, Lengths::Fixed(24), 20_000, 0).unwrap();
    let out =
        simulate(&SimSpec { trace: false, ..spec(&net, &policy, &c) }, &reqs, &Load::Closed { window: 2048 })
            .unwrap();
    let ideal = 512.0 / (784e-6 * 24.0);
    let r = out.throughput() / ideal;
    assert!((0.9..=1.0).contains(&r), "throughput {:.0} = {r:.3} of the ideal {ideal:.0}", out.throughput());
}

#[test]
fn closed_loop_keeps_the_window_in_flight() {
    let net = lstm();
    let c = cost(r#"{"cell":"step","points":[[1,10.0],[512,100.0]]}"#, 0.0, 0.0);
    let policy = cellular(512);
    let reqs = requests(&net, Lengths::Fixed(3), 100, 0).unwrap();
    let out = simulate(&spec(&net, &policy, &c), &reqs, &Load::Closed { window: 10 }).unwrap();
    assert_eq!(out.completed(), 100);
    let (mut in_flight, mut most) = (0i64, 0);
    for e in &out.trace {
        match e {
            TraceEvent::Arrive { .. } => in_flight += 1,
            TraceEvent::Complete { .. } => in_flight -= 1,
            TraceEvent::Launch { .. } => {}
        }
        most = most.max(in_flight);
    }
    assert_eq!(most, 10);
    assert!(out.mean_batch() > 2.0, "{}", out.mean_batch());
}

/// The shipped E²bird tables reproduce Table 1's throughputs: full batches of b back to back on
/// one worker serve b / t(b) requests per second (Res152 at 32: 341 req/s; at 4: 231).
#[test]
fn e2bird_titan_rtx_tables_reproduce_table_1() {
    let net = Network::Mlp(crate::model::Mlp::random(&[4, 4], 0));
    for (name, batch, paper_rps) in [
        ("e2bird-titanrtx-resnet152", 32, 341.0),
        ("e2bird-titanrtx-resnet152", 4, 231.0),
        ("e2bird-titanrtx-resnet101", 16, 441.0),
        ("e2bird-titanrtx-resnet50", 8, 661.0),
    ] {
        let c = CostFile::builtin(name).unwrap();
        let policy = PolicyConfig::Timeout(crate::TimeoutConfig {
            max_batch: batch,
            max_wait: Duration::from_secs(1),
            workers: 1,
            pad_to_max: false,
        });
        let reqs = requests(&net, Lengths::Fixed(1), 50 * batch, 0).unwrap();
        let spec = SimSpec { trace: false, ..spec(&net, &policy, &c) };
        let out = simulate(&spec, &reqs, &Load::Closed { window: 4 * batch }).unwrap();
        assert_eq!(out.mean_batch(), batch as f64, "{name}: full batches only");
        let r = out.throughput() / paper_rps;
        assert!(
            (0.99..=1.01).contains(&r),
            "{name} b={batch}: {:.1} req/s vs the paper's {paper_rps}",
            out.throughput()
        );
    }
}

/// A task on a stream that was idle before it takes longer by the cost file's idle factor
/// (linear from 1 at no idle to the points, the last beyond): the cold starts `serve profile`
/// measures.
#[test]
fn a_task_after_an_idle_stream_takes_its_idle_factor_longer() {
    let net = lstm();
    let c = CostFile::parse(
        r#"{"name":"t","cells":[{"cell":"step","points":[[1,10.0],[2,12.0]]}],"idle":[[1000.0,2.0],[3000.0,3.0]]}"#,
    )
    .unwrap();
    assert_eq!(c.idle_factor(Duration::ZERO), 1.0);
    assert_eq!(c.idle_factor(Duration::from_micros(500)), 1.5);
    assert_eq!(c.idle_factor(Duration::from_micros(2000)), 2.5);
    assert_eq!(c.idle_factor(Duration::from_secs(1)), 3.0);
    let policy = cellular(8);
    let reqs = requests(&net, Lengths::Fixed(1), 3, 0).unwrap();
    let at = vec![Duration::ZERO, Duration::from_micros(510), Duration::from_millis(10)];
    let out = simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(at)).unwrap();
    // The first task starts on a stream that never ran (idle 0); the second after 500 µs idle
    // (factor 1.5); the third after ~10 ms (factor 3).
    let us = |v: u64| Duration::from_micros(v);
    assert_eq!(out.latencies, vec![us(10), us(15), us(30)]);
}

/// A shared device (E²bird's GPU): N-Ebird splits 32 requests that arrive together over its six
/// workers (16, 8, 4, 2, 1, 1), which run at once and end together, as one batch of 32 would:
/// t(32) = 93.7 ms on ResNet-152. Run as independent streams instead, the bs-16 worker's task
/// would end at t(16) = 49.5 ms.
#[test]
fn co_running_workers_on_a_shared_device_end_as_one_batch() {
    let net = Network::Mlp(crate::model::Mlp::random(&[4, 4], 0));
    let policy = PolicyConfig::Elastic(crate::ElasticConfig::default());
    let reqs = requests(&net, Lengths::Fixed(1), 32, 0).unwrap();
    let shared = CostFile::builtin("e2bird-titanrtx-resnet152").unwrap();
    assert!(shared.shared_device);
    let at = Load::Open(vec![Duration::ZERO; 32]);
    let out = simulate(&spec(&net, &policy, &shared), &reqs, &at).unwrap();
    assert_eq!((out.completed(), out.tasks), (32, 6));
    for l in &out.latencies {
        assert!((l.as_secs_f64() - 0.0937).abs() < 1e-6, "{l:?}");
    }
    let alone = CostFile { shared_device: false, ..shared.clone() };
    let out = simulate(&spec(&net, &policy, &alone), &reqs, &at).unwrap();
    let worst = out.latencies.iter().max().unwrap().as_secs_f64();
    assert!((worst - 0.0495).abs() < 1e-6, "{worst}");
    // A task joining later shares what is left: 16 at 0, then 16 more at 20 ms (on the bs-8, -4,
    // -2, -1, -1 workers... and the bs-16 busy: 8 + 4 + 2 + 1 + 1 = 16). The first task's
    // work left at 20 ms is 1 − 20/49.5; from then all progress at 1/t(32) per second.
    let mut at = vec![Duration::ZERO; 16];
    at.extend(vec![Duration::from_millis(20); 16]);
    let reqs = requests(&net, Lengths::Fixed(1), 32, 0).unwrap();
    let out = simulate(&spec(&net, &policy, &shared), &reqs, &Load::Open(at)).unwrap();
    let first_end = 0.020 + (1.0 - 0.020 / 0.0495) * 0.0937;
    let firsts: Vec<f64> = out.latencies.iter().map(|l| l.as_secs_f64()).filter(|l| *l < 0.07).collect();
    assert_eq!(firsts.len(), 0, "no task ends before the shared ones: {:?}", out.latencies);
    assert!(
        out.latencies.iter().any(|l| (l.as_secs_f64() - first_end).abs() < 1e-6),
        "{first_end} in {:?}",
        out.latencies
    );
}

/// A cold start slows a task's start, not each of its steps: a padded task of 7 steps of 10 µs
/// on a stream idle for 5 ms (factor 2) is longer by one step, 10 µs (not 70), whether the
/// workers run alone or share CPU cores.
#[test]
fn a_cold_start_lengthens_one_step_of_a_task_not_every_step() {
    let net = lstm();
    let policy = PolicyConfig::Padding(PaddingConfig { max_batch: 1, ..PaddingConfig::default() });
    let reqs = requests(&net, Lengths::Fixed(7), 1, 0).unwrap();
    for cores in ["", r#","cores":2"#] {
        let c = CostFile::parse(&format!(
            r#"{{"name":"t","cells":[{{"cell":"step","points":[[1,10.0]]}}],"launch_us":3.0,"report_us":2.0,
                "max_task_steps":7,"idle":[[1000.0,2.0]]{cores}}}"#
        ))
        .unwrap();
        let out =
            simulate(&spec(&net, &policy, &c), &reqs, &Load::Open(vec![Duration::from_millis(5)])).unwrap();
        assert_eq!(out.tasks, 1);
        assert_eq!(out.latencies, [Duration::from_micros(3 + 7 * 10 + 10 + 2)], "cores: `{cores}`");
    }
}

/// CPU workers share the backend's cores (`cores` in the cost file): two one-thread tasks on two
/// cores both run at full speed (on one core, at half); two tasks that each run on the whole pool
/// (`pool_rows`) get half of it each and take twice as long, where independent streams would not.
#[test]
fn co_running_cpu_workers_share_the_cores() {
    let net = lstm();
    // Four requests at once: padding starts one 1-row task on each of its two workers.
    let policy =
        PolicyConfig::Padding(PaddingConfig { max_batch: 2, workers: 2, ..PaddingConfig::default() });
    let reqs = requests(&net, Lengths::Fixed(1), 4, 0).unwrap();
    let file = |pool_rows: usize, cores: &str| {
        CostFile::parse(&format!(
            r#"{{"name":"t","cells":[{{"cell":"step","points":[[1,10.0],[2,20.0]],"pool_rows":{pool_rows}}}],
                "launch_us":3.0,"report_us":2.0{cores}}}"#
        ))
        .unwrap()
    };
    let firsts = |c: &CostFile| {
        let out = simulate(&spec(&net, &policy, c), &reqs, &Load::Open(vec![Duration::ZERO; 4])).unwrap();
        assert_eq!(out.completed(), 4);
        let first: Vec<usize> = launches(&out).iter().take(2).map(|l| l.1).collect();
        assert_eq!((first, launches(&out)[1].0), (vec![1, 1], Time::ZERO), "one row on each worker at once");
        out.latencies[..2].to_vec()
    };
    let us = |v: u64| vec![Duration::from_micros(v); 2];
    let (one_thread, pool_wide) = (file(2, r#","cores":2"#), file(1, r#","cores":2"#));
    assert_eq!((one_thread.task_cores("step", 1), one_thread.task_cores("step", 2)), (1, 2));
    assert_eq!(pool_wide.task_cores("step", 1), 2);
    assert_eq!(file(1, "").task_cores("step", 2), 1, "no cores: one thread each");
    assert_eq!(firsts(&one_thread), us(3 + 10 + 2));
    // The same one-thread tasks on one core: each at half speed.
    assert_eq!(firsts(&file(2, r#","cores":1"#)), us(3 + 2 * 10 + 2));
    assert_eq!(firsts(&pool_wide), us(3 + 2 * 10 + 2));
    assert_eq!(firsts(&file(1, "")), us(3 + 10 + 2), "independent streams");
}

#[test]
fn a_cost_file_shares_cores_or_a_device_not_both() {
    let base = r#""name":"t","cells":[{"cell":"step","points":[[1,10.0]]POOL}]"#;
    let parse =
        |pool: &str, more: &str| CostFile::parse(&format!("{{{}{more}}}", base.replace("POOL", pool)));
    assert!(parse("", r#","cores":4"#).is_ok());
    let both = parse("", r#","cores":4,"shared_device":true"#).unwrap_err();
    assert!(both.to_string().contains("exclude each other"), "{both}");
    let zero = parse(r#","pool_rows":0"#, "").unwrap_err();
    assert!(zero.to_string().contains("`pool_rows` 0"), "{zero}");
    let many = parse("", r#","cores":100000"#).unwrap_err();
    assert!(many.to_string().contains("at most 1024"), "{many}");
}
