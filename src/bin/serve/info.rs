//! `serve info`: version, the backend `auto` picks, CPU features, CUDA driver / devices.

use serve::BackendChoice;
use serve::Runtime;
use serve::backend::{cpu, cuda};

use crate::{CliResult, fatal};

pub(crate) fn cmd_info() -> CliResult<()> {
    println!("libserve {}", serve::VERSION);
    let auto = Runtime::builder().backend(BackendChoice::Auto).build();
    match &auto {
        Ok(rt) => println!("backend (auto): {} — {}", rt.backend_kind(), rt.backend_description()),
        Err(e) => println!("backend (auto): unavailable — {e}"),
    }
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let feats: Vec<String> = cpu::cpu_features()
        .into_iter()
        .map(|(name, on)| if on { name.to_string() } else { format!("-{name}") })
        .collect();
    println!(
        "cpu: {cores} core(s), features: {}",
        if feats.is_empty() { "(none probed)".into() } else { feats.join(" ") }
    );
    let probe = cuda::probe();
    let driver = match (probe.driver_loaded, probe.driver_version) {
        (false, _) => "not found".to_string(),
        (true, Some(v)) => format!("loaded, CUDA {}.{}", v / 1000, (v % 1000) / 10),
        (true, None) => "loaded, version unknown".to_string(),
    };
    println!("cuda driver: {driver}");
    println!("cuda devices: {} ({})", probe.devices, probe.summary());
    if probe.devices > 0 {
        match Runtime::builder().backend(BackendChoice::Cuda).build() {
            Ok(rt) => println!("backend (cuda): {}", rt.backend_description()),
            Err(e) => println!("backend (cuda): unavailable — {e}"),
        }
    }
    auto.map(drop).map_err(|e| fatal(format!("the auto backend cannot start: {e}")))
}
