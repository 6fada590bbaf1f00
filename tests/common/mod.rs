//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use rand::Rng;
use serve::model::Mlp;
use serve::{Code, Completion, CompletionQueue, Input, Model, Runtime, StatsSnapshot, SubmitOptions};

/// A kernel check on both targets (`common::cuda_kernels`): `$gpu` on device 0 (a skip without
/// one) and `$host` on the kernels built for the CPU (`common::kernels_on_host`), each running
/// `$check(dev)` against the CPU backend. The test file imports `gpu` and `host`.
#[macro_export]
macro_rules! on_gpu_and_host {
    ($check:ident($blas:expr): $gpu:ident, $host:ident) => {
        #[test]
        fn $gpu() {
            if let Some(g) = gpu($blas) {
                $check(g)
            }
        }
        #[test]
        fn $host() {
            if let Some(g) = host() {
                $check(g)
            }
        }
    };
}

pub mod cuda_kernels;
pub mod gpu;
pub mod kernels_on_host;
pub mod layer_fixtures;
pub mod layer_kernels;
pub mod native;
pub mod openmetrics;
pub mod recurrent;

/// Launch `task` on worker 0 of `runner`, wait for it (at most a minute) and collect it, as the
/// engine does; its output and error.
pub fn run_task(
    runner: &dyn serve::backend::Runner,
    task: Arc<serve::backend::TaskData>,
) -> (Vec<f32>, Option<serve::Error>) {
    let target = runner.launch(0, task.clone()).unwrap();
    let signal = runner.signal(0);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while signal.completed() < target {
        assert!(std::time::Instant::now() < deadline, "the task never completed");
        std::thread::sleep(Duration::from_micros(50));
    }
    runner.collect(0, &task);
    let io = task.io.lock().unwrap();
    (io.output.clone(), io.error.clone())
}

/// Run `work` as one task of `rows` rows on worker 0 of `runner`; its output (the task must not
/// fail).
pub fn run_ok(runner: &dyn serve::backend::Runner, rows: usize, work: serve::backend::Work) -> Vec<f32> {
    let (out, error) = run_task(runner, serve::backend::TaskData::new(rows, work));
    assert!(error.is_none(), "{error:?}");
    out
}

/// A small random resnet (basic blocks, one per stage, width 8, a 3 × 20 × 18 image, 10
/// classes): a whole model in a few milliseconds on any backend.
pub fn small_resnet() -> serve::model::Network {
    let cfg = serve::model::resnet::ResNetConfig {
        name: None,
        block: "basic".into(),
        layers: [1, 1, 1, 1],
        num_classes: 10,
        image: [3, 20, 18],
        width: Some(8),
    };
    serve::model::Network::ResNet(serve::model::resnet::ResNet::random(&cfg, 11))
}

/// A fresh, unique directory under the system temp dir.
pub fn tempdir(label: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "serve-test-{label}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Write a random mlp with the given widths and return (dir, model).
pub fn mlp_dir(label: &str, sizes: &[usize], seed: u64) -> (PathBuf, Mlp) {
    let dir = tempdir(label);
    let mlp = Mlp::random(sizes, seed);
    mlp.save(&dir).unwrap();
    (dir, mlp)
}

/// A deterministic input vector.
pub fn input(len: usize, k: u64) -> Vec<f32> {
    (0..len).map(|i| (((i as u64 * 31 + k * 17) % 23) as f32 - 11.0) / 7.0).collect()
}

/// `got` ≈ `want` element-wise: |got − want| ≤ 1e-4 · (1 + |want|).
pub fn assert_close(got: &[f32], want: &[f32]) {
    assert_within(got, want, 1e-4, "output");
}

/// `got` ≈ `want` element-wise: |got − want| ≤ tol · (1 + |want|), NaN where NaN.
pub fn assert_within(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = (g - w).abs() <= tol * (1.0 + w.abs()) || (g.is_nan() && w.is_nan());
        assert!(ok, "{what}: element {i}: got {g}, want {w}");
    }
}

/// One submission of a stress test, through `q` with `tag`: retried while admission control
/// answers BUSY (it is doing its job: back off and retry), and once admitted cancelled at random
/// one time in 20. True if admitted; a refusal must be SHUTDOWN or DEADLINE_EXCEEDED.
pub fn stress_submit(
    rt: &Runtime,
    model: &Model,
    input: impl Fn() -> Input,
    opts: SubmitOptions,
    q: &CompletionQueue,
    tag: u64,
    rng: &mut impl Rng,
) -> bool {
    let mut result = model.submit_to(input(), opts, q, tag);
    while result.as_ref().is_err_and(|e| e.code() == Code::Busy) {
        std::thread::yield_now();
        result = model.submit_to(input(), opts, q, tag);
    }
    match result {
        Ok(id) => {
            if rng.random_bool(0.05) {
                rt.cancel(id).unwrap();
            }
            true
        }
        Err(e) => {
            assert!(matches!(e.code(), Code::Shutdown | Code::DeadlineExceeded), "unexpected refusal {e}");
            false
        }
    }
}

/// The total number of requests of a stress test, across its threads: `SERVE_STRESS_REQUESTS`
/// when set (scripts/stress.sh runs 10^6 in release mode), else `default` (sized for `cargo test`).
pub fn stress_requests(default: u64) -> u64 {
    match std::env::var("SERVE_STRESS_REQUESTS") {
        Ok(v) => {
            v.trim().parse().unwrap_or_else(|_| panic!("SERVE_STRESS_REQUESTS={v:?} is not a request count"))
        }
        Err(_) => default,
    }
}

/// The exactly-once ledger of a stress test with tags `0..n`: two bytes per tag whatever the
/// number of requests (10^6 takes 2 MB), shared by the submitting and the draining threads.
pub struct Ledger {
    /// Per tag: 0 not submitted yet, else [`ADMITTED`] or [`REFUSED`].
    submit: Vec<AtomicU8>,
    /// Per tag: 0 not completed, else 1 + the completion's code.
    done: Vec<AtomicU8>,
}

const ADMITTED: u8 = 1;
const REFUSED: u8 = 2;

impl Ledger {
    pub fn new(n: u64) -> Ledger {
        let slots = || (0..n).map(|_| AtomicU8::new(0)).collect();
        Ledger { submit: slots(), done: slots() }
    }

    fn slot(v: &[AtomicU8], tag: u64) -> &AtomicU8 {
        v.get(tag as usize).unwrap_or_else(|| panic!("tag {tag} is out of range 0..{}", v.len()))
    }

    /// Records the outcome of `tag`'s submission (admitted or refused). Each tag is submitted once.
    pub fn submitted(&self, tag: u64, admitted: bool) {
        let prev =
            Self::slot(&self.submit, tag).swap(if admitted { ADMITTED } else { REFUSED }, Ordering::Relaxed);
        assert_eq!(prev, 0, "tag {tag} submitted twice");
    }

    /// Records a completion of `tag`; panics on its second one.
    pub fn completed(&self, tag: u64, code: Code) {
        let prev = Self::slot(&self.done, tag).swap(code as u8 + 1, Ordering::Relaxed);
        assert!(
            prev == 0,
            "tag {tag} completed twice: {} then {code}",
            Code::from_u32(prev as u32 - 1).unwrap()
        );
    }

    /// Drains `q` into the ledger on a thread of its own, calling `check` on every completion,
    /// until [`Drainer::finish`]. Completions are dropped as they are counted: memory stays bounded
    /// however many requests run.
    pub fn drain(
        self: &Arc<Self>,
        q: Arc<CompletionQueue>,
        check: impl Fn(&Completion) + Send + 'static,
    ) -> Drainer {
        let stop = Arc::new(AtomicBool::new(false));
        let (ledger, stopping) = (self.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut batch = Vec::new();
            loop {
                // Read before polling: an empty poll after the stop means nothing is left.
                let last = stopping.load(Ordering::Acquire);
                batch.clear();
                q.next_into(&mut batch, 256, Duration::from_millis(20)).unwrap();
                if batch.is_empty() && last {
                    return;
                }
                for c in &batch {
                    ledger.completed(c.tag, c.result.as_ref().err().map_or(Code::Ok, |e| e.code()));
                    check(c);
                }
            }
        });
        Drainer { stop, thread }
    }

    /// Once every submitter and the drainer have finished: every tag was submitted; every admitted
    /// one completed exactly once with OK, CANCELLED or DEADLINE_EXCEEDED; no refused one did.
    pub fn check(&self) -> Tally {
        let mut t = Tally { admitted: 0, refused: 0, completed: [0; Code::ALL.len()] };
        for (tag, (s, d)) in self.submit.iter().zip(&self.done).enumerate() {
            let done = d.load(Ordering::Relaxed).checked_sub(1).map(|c| Code::from_u32(c as u32).unwrap());
            match (s.load(Ordering::Relaxed), done) {
                (ADMITTED, Some(code)) => {
                    assert!(
                        matches!(code, Code::Ok | Code::Cancelled | Code::DeadlineExceeded),
                        "tag {tag}: {code}"
                    );
                    t.admitted += 1;
                    t.completed[code as usize] += 1;
                }
                (ADMITTED, None) => panic!("tag {tag} was admitted and never completed"),
                (REFUSED, None) => t.refused += 1,
                (REFUSED, Some(code)) => panic!("tag {tag} was refused and completed ({code})"),
                (_, done) => panic!("tag {tag} was never submitted (completed: {done:?})"),
            }
        }
        t
    }
}

/// The thread of [`Ledger::drain`].
pub struct Drainer {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl Drainer {
    /// Call once every request has completed (the runtime's shutdown has returned and the
    /// submitters have stopped): drains what is left, stops, and passes on the drainer's panic.
    pub fn finish(self) {
        self.stop.store(true, Ordering::Release);
        if let Err(panic) = self.thread.join() {
            std::panic::resume_unwind(panic);
        }
    }
}

/// What a stress run's [`Ledger`] counted.
pub struct Tally {
    pub admitted: u64,
    pub refused: u64,
    pub completed: [u64; Code::ALL.len()],
}

impl Tally {
    pub fn completed(&self, code: Code) -> u64 {
        self.completed[code as usize]
    }

    /// The runtime's own counters agree with the ledger, and nothing is left queued or running.
    pub fn check_stats(&self, s: &StatsSnapshot) {
        assert_eq!(s.submitted, self.admitted, "runtime stats: submitted");
        for code in Code::ALL {
            assert_eq!(s.completed(code), self.completed(code), "runtime stats: completed {code}");
        }
        assert_eq!((s.queued, s.running), (0, 0), "runtime stats: queued, running");
    }

    /// Prints the run's figures (seen with `--nocapture`): requests, rates, completions by code.
    pub fn report(&self, label: &str, elapsed: Duration) {
        let s = elapsed.as_secs_f64();
        let total = self.admitted + self.refused;
        println!(
            "stress {label}: {self} in {s:.2} s: {:.0} requests/s submitted, {:.0} admitted requests/s completed",
            total as f64 / s,
            self.admitted as f64 / s,
        );
    }
}

impl fmt::Display for Tally {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} requests, {} admitted, {} refused; every admitted one completed exactly once:",
            self.admitted + self.refused,
            self.admitted,
            self.refused
        )?;
        for code in Code::ALL.into_iter().filter(|&c| self.completed(c) > 0) {
            write!(f, " {code} {}", self.completed(code))?;
        }
        Ok(())
    }
}
