//! The hand-off a layer block pays in the tenant mode (ARCHITECTURE.md §3.5, §7.9): one query at a
//! time through a chain of `LAYERS` (default 16) layers that only copy 4 values, scheduled
//! layer-wise on `CORES` (default 1) core, so each block is one task and nearly all of its time is
//! the engine → stream → engine round trip (two wake-ups: the engine watches CPU streams itself,
//! ARCHITECTURE.md §3.5). Prints the time per query and per layer.
//!
//! `cargo run --release --example block_handoff` (`LAYERS=1` gives one task's round trip;
//! `perf stat -e context-switches` beside it counts the wake-ups).
use serve::model::{CustomCall, CustomExecute, CustomModel, LayerInfo};
use serve::{Input, Network, Runtime, SubmitOptions, TenantOptions, TenantSpec};
use std::sync::Arc;
use std::time::{Duration, Instant};
/// Each layer copies its input.
struct Copy;
impl CustomExecute for Copy {
    fn execute(&self, call: &mut CustomCall<'_>) -> Result<(), String> {
        call.output.copy_from_slice(&call.input[..call.output.len()]);
        Ok(())
    }
}
fn main() {
    let layers = std::env::var("LAYERS").ok().and_then(|v| v.parse().ok()).unwrap_or(16usize);
    let cores = std::env::var("CORES").ok().and_then(|v| v.parse().ok()).unwrap_or(1usize);
    let rt = Runtime::builder().cpu_threads(2).build().unwrap();
    let info: Vec<LayerInfo> = (0..layers)
        .map(|i| LayerInfo {
            name: format!("l{i}"),
            kind: "custom",
            weight_bytes: 0,
            flops_per_row: 1,
            out_len: 4,
        })
        .collect();
    let m = CustomModel { input_len: 4, output_len: 4, layers: info, exec: Arc::new(Copy) };
    let opts = TenantOptions { scheme: serve::sched::tenant::Scheme::LayerWise, cores, ..Default::default() };
    let t = rt
        .add_tenants(vec![TenantSpec::new(Arc::new(Network::Custom(m)), "c", Duration::from_secs(1))], opts)
        .unwrap();
    let model = &t[0].model;
    for _ in 0..200 {
        model.submit(Input::F32(vec![1.0; 4]), SubmitOptions::default()).unwrap().wait().unwrap();
    }
    let n = 1000;
    let start = Instant::now();
    for _ in 0..n {
        model.submit(Input::F32(vec![1.0; 4]), SubmitOptions::default()).unwrap().wait().unwrap();
    }
    let per = start.elapsed().as_secs_f64() * 1e6 / n as f64;
    println!("layers {layers}: {per:.1} us per query, {:.1} us per layer", per / layers as f64);
}
