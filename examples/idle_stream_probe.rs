//! Task compute after the stream has been idle: h = 256 LSTM steps of 1 to 32 rows launched one
//! at a time on a bare CPU runner, with a pause of 0 to 3 ms between them, timed by the stream
//! (`TaskIo::stages.compute`, median of 250). The figures behind `PARALLEL_TASK_MIN_MACS`
//! (src/backend/cpu/gemm.rs): a compute pool that slept while the stream idled costs its
//! wake-up in the next task, so small tasks run on the stream's own thread.
//!
//! `cargo run --release --example idle_stream_probe [THREADS]` (default 2)

use std::sync::Arc;
use std::time::Duration;

use serve::Network;
use serve::backend::{BackendChoice, CellRow, CellTask, RunnerShape, TaskData, Work};
use serve::model::Lstm;

fn main() {
    let threads: usize = std::env::args().nth(1).map_or(2, |s| s.parse().expect("THREADS is a count"));
    let net = Arc::new(Network::Lstm(Lstm::random(30000, 256, 256, 1, 1)));
    let backend = serve::backend::create(BackendChoice::Cpu, threads).expect("CPU backend");
    let me = std::thread::current();
    let shape = RunnerShape { workers: 1, max_batch: 32, state_slots: 4096, token_gates_bytes: 0 };
    let runner = backend.prepare(net, shape, Arc::new(move || me.unpark())).expect("runner");
    let signal = runner.signal(0);
    println!("# {}; median compute per task (us) by rows, after a pause of", backend.describe());
    for pause_us in [0u64, 50, 200, 1000, 3000] {
        print!("pause {pause_us:>5} us:");
        for rows in [1usize, 2, 4, 8, 16, 32] {
            let mut times = Vec::new();
            for i in 0..300u32 {
                let cells = (0..rows as u32)
                    .map(|k| CellRow {
                        steps: 1,
                        slot: (i * 37 + k * 97) % 4096,
                        token: 3 + (i * 31 + k * 7) % 29000,
                        first: false,
                        children: 0..0,
                        output: false,
                    })
                    .collect();
                let task = TaskData::new(
                    rows,
                    Work::Cells(CellTask {
                        cell: 0,
                        rows: cells,
                        children: Vec::new(),
                        ..CellTask::default()
                    }),
                );
                let target = runner.launch(0, task.clone()).expect("launch");
                while signal.completed() < target {
                    std::thread::park_timeout(Duration::from_millis(1));
                }
                if pause_us > 0 {
                    std::thread::sleep(Duration::from_micros(pause_us));
                }
                if i >= 50 {
                    let compute = task.io.lock().expect("task io").stages.compute.unwrap_or_default();
                    times.push(compute.as_secs_f64() * 1e6);
                }
            }
            times.sort_by(f64::total_cmp);
            print!("  {rows}: {:>6.1}", times[times.len() / 2]);
        }
        println!();
    }
}
