//! `serve info`: version, the backend `auto` picks, CPU features, hardware counters, CUDA driver /
//! devices.

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
    println!("hardware counters: {}", counters());
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

/// Whether the kernel exposes the CPU's performance counters (a `cpu`, or hybrid `cpu_core`,
/// PMU under `/sys/bus/event_source/devices`) and how far `perf_event_paranoid` lets this
/// process read them. VELTAIR's interference level (ARCHITECTURE.md §7.9) uses the observed
/// slowdown, which needs no counters; where they exist, L3 counters could feed it too.
fn counters() -> String {
    let dir = std::path::Path::new("/sys/bus/event_source/devices");
    let pmu = ["cpu", "cpu_core"].iter().find(|p| dir.join(p).exists());
    let paranoid = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid").ok();
    let paranoid = paranoid.as_deref().map(str::trim);
    match pmu {
        None => format!(
            "absent (no `cpu` PMU in {}; the tenant scheduler's interference level is the observed slowdown)",
            dir.display()
        ),
        Some(p) => format!(
            "`{p}` PMU present, perf_event_paranoid {} (≤ 2: this process's own counters; ≤ 0: system-wide)",
            paranoid.unwrap_or("unknown")
        ),
    }
}
