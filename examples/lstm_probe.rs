use serve::backend::{CellRow, CellTask, RunnerShape, TaskData, Work};
use serve::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
fn main() {
    let net = Arc::new(Network::Lstm(serve::model::Lstm::random(30000, 256, 256, 1, 1)));
    let backend = serve::backend::create(BackendChoice::Cpu, 2).unwrap();
    let me = std::thread::current();
    let runner = backend
        .prepare(
            net.clone(),
            RunnerShape { workers: 1, max_batch: 64, state_slots: 4096 },
            Arc::new(move || me.unpark()),
        )
        .unwrap();
    let sig = runner.signal(0);
    for gap_us in [0u64, 50, 200, 1000, 3000] {
        for b in [1usize, 2, 4, 8] {
            let mut v = Vec::new();
            for i in 0..300u32 {
                let rows = (0..b as u32)
                    .map(|k| CellRow {
                        slot: (i * 8 + k * 97) % 4096,
                        token: 3 + k,
                        first: false,
                        children: 0..0,
                        output: false,
                    })
                    .collect();
                let t = TaskData::new(b, Work::Cells(CellTask { cell: 0, rows, children: vec![] }));
                let target = runner.launch(0, t.clone()).unwrap();
                while sig.completed() < target {
                    std::thread::park_timeout(Duration::from_millis(1));
                }
                if gap_us > 0 {
                    std::thread::sleep(Duration::from_micros(gap_us));
                }
                if i >= 50 {
                    v.push(t.io.lock().unwrap().stages.compute.unwrap().as_secs_f64() * 1e6);
                }
            }
            v.sort_by(f64::total_cmp);
            print!("gap {gap_us:>4} us batch {b}: {:>6.1}   ", v[v.len() / 2]);
        }
        println!();
    }
    let _ = Instant::now();
}
