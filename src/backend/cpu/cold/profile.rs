//! The cold-start profile of a [`LayerProgram`] on the CPU executor (`serve profile
//! --coldstart`): per layer, the time of its throttled copy (load), of running it from device
//! memory (in memory) and from host memory with its bus time (DHA), each the mean of `runs`
//! after as many warm-up runs (the artifact's 10 and 10), on the activations a warm run feeds it.

use std::sync::RwLock;
use std::sync::atomic::AtomicU64;
use std::time::Instant;

use super::program::{LayerProgram, Params};
use super::{ColdOptions, run_layer, throttled_copy};
use crate::error::Result;
use crate::plan::deepplan::{ColdProfile, LayerCost};

/// Profiles `program` on `input` with the copy and bus rates of `options`.
pub fn profile(
    program: &dyn LayerProgram,
    name: &str,
    input: &[f32],
    options: &ColdOptions,
    runs: usize,
) -> Result<ColdProfile> {
    let runs = runs.max(1);
    // The input of every layer, from one warm run.
    let mut inputs = vec![input.to_vec()];
    let mut y = vec![];
    for i in 0..program.layers() {
        let host = program.host_params(i);
        let params = if host.is_empty() { Params::None } else { Params::Device(host) };
        program.run(i, &params, inputs.last().expect("one per layer"), &mut y);
        inputs.push(std::mem::take(&mut y));
    }
    let mean_ms = |f: &mut dyn FnMut()| {
        for _ in 0..runs {
            f();
        }
        let t = Instant::now();
        for _ in 0..runs {
            f();
        }
        t.elapsed().as_secs_f64() * 1e3 / runs as f64
    };
    let mut layers = vec![];
    for (i, x) in inputs.iter().take(program.layers()).enumerate() {
        let host = program.host_params(i);
        let mut y = vec![];
        let bytes = std::mem::size_of_val(host) as u64;
        if host.is_empty() {
            let exec_ms = mean_ms(&mut || program.run(i, &Params::None, x, &mut y));
            layers.push(LayerCost {
                name: format!("{i}:{}", program.kind(i)),
                kind: program.kind(i).into(),
                bytes: 0,
                load_ms: 0.0,
                exec_ms,
                dha_ms: exec_ms,
            });
            continue;
        }
        let arena = RwLock::new(vec![0.0f32; host.len()]);
        let load_ms = mean_ms(&mut || throttled_copy(host, &arena, options.h2d_bytes_per_s));
        let device = arena.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
        let exec_ms = mean_ms(&mut || program.run(i, &Params::Device(&device), x, &mut y));
        let lines = AtomicU64::new(0);
        let dha_ms = mean_ms(&mut || run_layer(program, i, None, &lines, options.dha_bytes_per_s, x, &mut y));
        layers.push(LayerCost {
            name: format!("{i}:{}", program.kind(i)),
            kind: program.kind(i).into(),
            bytes,
            load_ms,
            exec_ms,
            dha_ms,
        });
    }
    ColdProfile::new(name, layers)
}
