use std::time::Duration;

use super::program::sizes_profile;
use super::program::{Layer, LayerProgram, Params, Sequential};
use super::*;
use crate::plan::deepplan::planner::Method::{Dha, Load};
use crate::plan::deepplan::{Algorithm, plan_given};

/// A small transformer-like stack: embedding, norm, two linears around a ReLU, norm.
fn model() -> Sequential {
    Sequential::random(
        vec![
            Layer::Embedding { rows: 500, width: 32 },
            Layer::LayerNorm { width: 32 },
            Layer::Linear { inputs: 32, outputs: 64 },
            Layer::Relu,
            Layer::Linear { inputs: 64, outputs: 32 },
            Layer::LayerNorm { width: 32 },
            Layer::Linear { inputs: 32, outputs: 32 },
        ],
        7,
    )
}

fn tokens() -> Vec<f32> {
    (0..24).map(|t| ((t * 37) % 500) as f32).collect()
}

/// A plan of `methods` split into `k` partitions (the planner's partitioning and override).
fn cold_plan(m: &Sequential, methods: Vec<Method>, k: usize) -> ColdPlan {
    plan_given(&sizes_profile(m, "tiny").unwrap(), Algorithm::DeepPlan, methods, k).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn slow() -> ColdOptions {
    // ~64 KB layers at 2 MB/s: each copy takes ~30 ms, far longer than a layer runs even in a
    // debug build on a loaded 2-core CI machine (at 20 MB/s, a few ms per copy, a CI run once
    // saw the execution never wait: the copies outran an unoptimised, preempted execution).
    ColdOptions { h2d_bytes_per_s: 2e6, forward_bytes_per_s: 4e6, ..ColdOptions::default() }
}

/// Acceptance check 4: all-load, DHA, PT and PT+DHA runs, with copies slower than execution,
/// give outputs bit-identical to the warm run; the execution did wait for loads.
#[test]
fn cold_outputs_equal_the_warm_run_bit_for_bit() {
    let m = model();
    let all = vec![Load; 7];
    let dha = vec![Dha, Load, Load, Load, Load, Load, Load];
    for (name, methods, k) in
        [("all-load", all.clone(), 1), ("dha", dha.clone(), 1), ("pt", all, 2), ("pt+dha", dha, 3)]
    {
        let plan = cold_plan(&m, methods, k);
        assert_eq!(plan.partitions.len(), k.min(5), "{name}");
        let warm = run_warm(&m, &plan.plan, &tokens()).unwrap();
        assert!(warm.iter().all(|v| v.is_finite()));
        let cold = run_cold(&m, &plan, &tokens(), &slow()).unwrap().0;
        assert_eq!(bits(&cold.output), bits(&warm), "{name}");
        assert!(cold.waited > 0, "{name}: the execution ran ahead of the copies and waited");
    }
}

/// The guard: with a launcher that falls behind the execution, the guarded run still equals the
/// warm one; without the guard, waits on events not yet recorded return at once and the NaN
/// poison of unlanded buffers reaches the output.
#[test]
fn waiting_on_an_unrecorded_event_is_guarded() {
    let m = model();
    let plan = cold_plan(&m, vec![Load; 7], 1);
    let warm = run_warm(&m, &plan.plan, &tokens()).unwrap();
    let late = ColdOptions { issue_delay: Duration::from_millis(20), ..ColdOptions::default() };
    let guarded = run_cold(&m, &plan, &tokens(), &late).unwrap().0;
    assert_eq!(bits(&guarded.output), bits(&warm));
    let unguarded = run_cold(&m, &plan, &tokens(), &ColdOptions { unguarded: true, ..late }).unwrap().0;
    assert!(unguarded.output.iter().any(|v| v.is_nan()), "without the guard the poison shows");
}

/// DHA layers stay on the host: the arena holds the load set only, and the host reads are
/// counted in lines.
#[test]
fn device_values_are_the_load_set() {
    let m = model();
    let plan = cold_plan(&m, vec![Dha, Dha, Load, Load, Load, Load, Load], 1);
    let (run, resident) = run_cold(&m, &plan, &tokens(), &ColdOptions::default()).unwrap();
    assert_eq!(resident.values(), run.device_values);
    let warm = run_resident(&m, &plan.plan, &resident, &tokens(), &ColdOptions::default()).unwrap();
    assert_eq!(bits(&warm), bits(&run.output), "the resident instance runs warm to the same output");
    let loaded: usize = (2..7).map(|i| m.host_params(i).len()).sum();
    assert_eq!(run.device_values, loaded);
    assert_eq!(run.device_values as u64 * 4, plan.device_bytes);
    // 24 tokens × a row of 32 floats (2 lines) + LayerNorm's γ and β of 32 floats (2 lines
    // each) per token.
    assert_eq!(run.dha_lines, 24 * 2 + 24 * 4);
    assert_eq!(run.load_lines, (2..7).map(|i| (m.host_params(i).len() * 4).div_ceil(64) as u64).sum::<u64>());
}

/// Acceptance check 5: BERT-Base's word embedding (30,522 × 768) looked up for 384 tokens reads
/// exactly 18,432 lines by DHA; loading it copies table/64 = 1,465,056 lines.
#[test]
fn bert_base_embedding_reads_18432_lines() {
    let m = Sequential {
        layers: vec![Layer::Embedding { rows: 30522, width: 768 }],
        params: vec![vec![0.25; 30522 * 768]],
    };
    let tokens: Vec<f32> = (0..384).map(|t| ((t * 7919) % 30522) as f32).collect();
    let dha = cold_plan(&m, vec![Dha], 1);
    assert_eq!(run_cold(&m, &dha, &tokens, &ColdOptions::default()).unwrap().0.dha_lines, 18_432);
    let load = cold_plan(&m, vec![Load], 1);
    let run = run_cold(&m, &load, &tokens, &ColdOptions::default()).unwrap().0;
    assert_eq!((run.load_lines, run.dha_lines), (1_465_056, 0));
}

#[test]
fn a_plan_that_does_not_fit_the_model_is_refused() {
    let m = model();
    let mut plan = cold_plan(&m, vec![Load; 7], 1);
    plan.plan.pop();
    let e = run_cold(&m, &plan, &tokens(), &ColdOptions::default()).unwrap_err();
    assert!(e.message().contains("a plan of 6 layers for a model of 7"), "{e}");
    let mut plan = cold_plan(&m, vec![Load; 7], 1);
    plan.plan[0] = Dha; // partition 1 still lists layer 0
    let e = run_cold(&m, &plan, &tokens(), &ColdOptions::default()).unwrap_err();
    assert!(e.message().contains("lists layer 0, which the plan does not load"), "{e}");
}

/// A program whose launcher-side reads misbehave: `host_params` panics, or returns a slice of
/// another length, when the load launcher asks (the execution's own reads are fine).
struct Treacherous {
    inner: Sequential,
    panics: bool,
}

impl LayerProgram for Treacherous {
    fn layers(&self) -> usize {
        self.inner.layers()
    }
    fn host_params(&self, i: usize) -> &[f32] {
        let p = self.inner.host_params(i);
        if std::thread::current().name() == Some("serve-cold-launch") && i == 2 {
            assert!(!self.panics, "launcher-side failure");
            return &p[..p.len() / 2];
        }
        p
    }
    fn run(&self, i: usize, params: &Params<'_>, x: &[f32], y: &mut Vec<f32>) {
        self.inner.run(i, params, x, y)
    }
}

/// A launcher that dies, a copy that fails and partitions that miss a layer are errors, never
/// a hang or a poisoned output passed off as a result.
#[test]
fn launcher_and_copy_failures_are_errors_not_hangs() {
    let m = model();
    let plan = cold_plan(&m, vec![Load; 7], 1);
    for panics in [true, false] {
        let t = Treacherous { inner: m.clone(), panics };
        let e = run_cold(&t, &plan, &tokens(), &ColdOptions::default()).unwrap_err();
        assert!(matches!(e.code(), crate::Code::Internal | crate::Code::Backend), "{e}");
    }
    let mut twice = plan.clone();
    twice.partitions[0].layers[1] = twice.partitions[0].layers[0];
    let e = run_cold(&m, &twice, &tokens(), &ColdOptions::default()).unwrap_err();
    assert!(e.message().contains("twice"), "{e}");
    let mut missing = plan.clone();
    missing.partitions[0].layers.pop();
    let e = run_cold(&m, &missing, &tokens(), &ColdOptions::default()).unwrap_err();
    assert!(e.message().contains("no partition carries it"), "{e}");
    let bad = ColdOptions { h2d_bytes_per_s: -1.0, ..ColdOptions::default() };
    assert!(run_cold(&m, &plan, &tokens(), &bad).unwrap_err().message().contains("h2d_bytes_per_s"));
}
