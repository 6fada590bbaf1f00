//! How much a CPU task slows while another worker runs an equal one (ARCHITECTURE.md §8.6, the
//! simulator's shared CPU cores): `serve bench`'s random lstm (h = 256) on a two-worker runner,
//! rounds of tasks of `b` rows on worker 0 alone, then on both workers at once. The simulator
//! shares the cores evenly (`cores / Σ threads`): it predicts 1.0 for two one-thread tasks on two
//! cores and 2.0 for two pool-wide ones; this measures what the machine does.
//!
//! `cargo run --release --example co_run`
use serve::Network;
use serve::backend::{CellRow, CellTask, Runner, RunnerShape, TaskData, Work};
use serve::model::Lstm;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOTS: usize = 4096;
const VOCAB: usize = 30000;

/// Launch `tasks[w]` on worker `w`, interleaved, and wait (looking every 100 µs: the streams do
/// not wake this thread, which would take a core's share from them) until all have run.
fn run(runner: &dyn Runner, tasks: &[Vec<Arc<TaskData>>]) -> Duration {
    let start = Instant::now();
    let mut targets = vec![0; tasks.len()];
    for i in 0..tasks[0].len() {
        for (w, ts) in tasks.iter().enumerate() {
            targets[w] = runner.launch(w, ts[i].clone()).expect("launch");
        }
    }
    for (w, &target) in targets.iter().enumerate() {
        while runner.signal(w).completed() < target {
            std::thread::park_timeout(Duration::from_micros(100));
        }
    }
    start.elapsed()
}

fn main() {
    let net = Arc::new(Network::Lstm(Lstm::random(VOCAB, 256, 256, 1, 1)));
    let backend = serve::backend::create(serve::BackendChoice::Cpu, 0).expect("the CPU backend");
    let shape = RunnerShape { workers: 2, max_batch: 512, state_slots: SLOTS, token_gates_bytes: 256 << 20 };
    let runner = backend.prepare(net, shape, Arc::new(|| {})).expect("prepare");
    println!("# {}", backend.describe());
    let mut base = 0usize;
    let mut task = |b: usize| {
        let rows = (0..b)
            .map(|k| CellRow {
                steps: 1,
                slot: ((base + k * 1237) % SLOTS) as u32,
                token: ((base + k) * 7919 % (VOCAB - 3)) as u32 + 3,
                first: false,
                children: 0..0,
                output: false,
            })
            .collect();
        base += 3 * b + 1;
        TaskData::new(b, Work::Cells(CellTask { cell: 0, rows, children: Vec::new(), ..CellTask::default() }))
    };
    for b in [1usize, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256] {
        let n = (200_000 / (b * 10 + 20)).max(10);
        let (mut alone, mut both) = (Vec::new(), Vec::new());
        for _ in 0..5 {
            let t: Vec<_> = (0..n).map(|_| task(b)).collect();
            alone.push(run(&*runner, &[t]).as_secs_f64() * 1e6 / n as f64);
            let t: Vec<Vec<_>> = (0..2).map(|_| (0..n).map(|_| task(b)).collect()).collect();
            both.push(run(&*runner, &t).as_secs_f64() * 1e6 / n as f64);
        }
        alone.sort_by(f64::total_cmp);
        both.sort_by(f64::total_cmp);
        let (a, c) = (alone[2], both[2]);
        println!(
            "b {b:>4}: alone {a:>8.1} us/task, beside an equal task {c:>8.1} us/task: {:.2}x ({} thread(s); even share {:.1}x)",
            c / a,
            runner.task_threads(0, b),
            ((2 * runner.task_threads(0, b)) as f64 / backend.cpu_threads().max(1) as f64).max(1.0)
        );
    }
}
