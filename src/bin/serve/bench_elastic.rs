//! `serve bench elastic [MODEL_DIR]` (issue 15 item 7, ARCHITECTURE.md §8.6): the fixed-shape
//! policies of `elastic_compare.rs` (TF-Serving's no-wait / opt-wait / static, N-Ebird, E-Ebird,
//! adaptive and serial) on the real runtime and backend, a random mlp (GPU scale 256, 1024, 1024,
//! 256) unless a model directory (mlp, resnet, bert, custom) is given.
//!
//! The paper's constants are for ResNet-152 on a Titan RTX (QoS 200 ms and OPT_Wait 30 ms
//! against 93.7 ms for one batch of 32); here they default to the same multiples of this model's
//! measured t(MaxBS), the time of one whole-model task of MaxBS rows on one worker, which also
//! gives the capacity the rates are fractions of (MaxBS / t(MaxBS), as in `serve sim elastic`).
//! E-Ebird's engine configurations come from `--engine-configs`, else the model directory's
//! `engine_configs.json`, else a `serve profile --engine-configs` run in place (printed).
//! Throughput at QoS probes each rate for `--probe-s` seconds of arrivals.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;

use serve::backend::{RunnerShape, TaskData, Work};
use serve::model::Mlp;
use serve::sched::elastic::confs::PROFILED_TOTALS;
use serve::{ElasticConfig, Input, Network, PolicyConfig};

use crate::bench::{PolicySpec, Workload, open_report, requests_per_run, run_arrivals};
use crate::elastic_compare::{Driver, Plan, Pol, Run, Setup, compare, policies};
use crate::profile::layer_batch;
use crate::{BenchElasticArgs, CliResult, ElasticPolicyArg, fatal};

/// GPU scale of ARCHITECTURE.md §8 (hidden 1024): one full batch of 32 takes milliseconds on a
/// CPU, so the QoS scaled from the paper's is not down at thread hand-off times.
const DEFAULT_SIZES: [usize; 4] = [256, 1024, 1024, 256];
/// The paper's QoS and OPT_Wait as multiples of one full batch's time (200 ms, 30 ms; ResNet-152
/// at 32 in 93.7 ms, E²bird Table 1).
const PAPER_BATCH_MS: f64 = 93.7;
const PAPER_QOS_MS: f64 = 200.0;
const PAPER_OPT_WAIT_MS: f64 = 30.0;
/// Most input values of one MaxBS batch, and most weights of the random mlp (1 GiB of f32 each),
/// checked before anything is built.
const MAX_BATCH_VALUES: usize = 1 << 28;
/// Distinct request inputs cycled through.
const INPUTS: usize = 64;
/// Requests of one throughput-at-QoS probe: at least, at most.
const PROBE_REQUESTS: (usize, usize) = (100, 50_000);
/// The engine-configurations file `serve bench elastic` looks for in a model directory.
pub(crate) const ENGINE_CONFIGS_FILE: &str = "engine_configs.json";

/// The real runtime as the comparison's driver.
struct RuntimeDriver {
    work: Workload,
    max_bs: usize,
    requests: Option<usize>,
    duration_s: f64,
    probe_s: f64,
}

impl Driver for RuntimeDriver {
    fn run(&mut self, pol: &Pol, at: &[Duration], rate: f64, _qos: f64, keep: bool) -> CliResult<Run> {
        let spec = PolicySpec {
            label: pol.name.clone(),
            config: pol.config.clone(),
            warmup: self.max_bs,
            warmup_rounds: 3,
            window: 2 * self.max_bs,
        };
        let (result, by_arrival) = run_arrivals(&self.work, &spec, rate, at, keep)?;
        Ok(Run { result, by_arrival })
    }

    fn probe_requests(&self, rate: f64) -> usize {
        ((rate * self.probe_s).ceil() as usize).clamp(PROBE_REQUESTS.0, PROBE_REQUESTS.1)
    }

    fn run_requests(&self, rate: f64) -> CliResult<usize> {
        requests_per_run(self.requests, self.duration_s, rate)
    }

    fn tag(&self) -> &'static str {
        ""
    }
}

/// MaxBS rows of `in_len` input values fit in [`MAX_BATCH_VALUES`].
fn check_batch(max_bs: usize, in_len: usize) -> CliResult<()> {
    if max_bs.checked_mul(in_len).is_none_or(|v| v > MAX_BATCH_VALUES) {
        return Err(fatal(format!(
            "--max-bs {max_bs} rows of {in_len} input values is over the {MAX_BATCH_VALUES} values one batch may hold \
             here"
        )));
    }
    Ok(())
}

/// Milliseconds of one whole-model task of each of `rows` rows, on one worker of `backend`
/// (one runner, prepared once, sized for the largest).
fn batch_ms(
    backend: &dyn serve::backend::Backend,
    net: &Arc<Network>,
    rows: [usize; 2],
) -> CliResult<[f64; 2]> {
    let me = std::thread::current();
    let notify: serve::backend::Notify = Arc::new(move || me.unpark());
    let runner = backend.prepare(net.clone(), RunnerShape::fixed(1, rows[0].max(rows[1])), notify)?;
    let mut ms = [0.0; 2];
    for (m, &n) in ms.iter_mut().zip(&rows) {
        let input = layer_batch(net, n);
        *m = crate::profile_layers::time(&*runner, &|| TaskData::new(n, Work::Dense(input.clone())))? / 1e3;
    }
    Ok(ms)
}

pub(crate) fn cmd_bench_elastic(a: BenchElasticArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let e = &a.elastic;
    let (net, name, source) = match &a.model_dir {
        Some(dir) => {
            let net = serve::model::load(dir)
                .map_err(|err| fatal(format!("cannot load model {}: {err}", dir.display())))?;
            let name = dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned());
            (net, name, dir.display().to_string())
        }
        None => {
            let sizes = a.sizes.clone().unwrap_or_else(|| DEFAULT_SIZES.to_vec());
            if sizes.len() < 2 {
                return Err(fatal("--sizes needs at least an input and an output width"));
            }
            let weights = sizes.windows(2).try_fold(0usize, |n, w| n.checked_add(w[0].checked_mul(w[1])?));
            if weights.is_none_or(|n| n > MAX_BATCH_VALUES) {
                return Err(fatal(format!(
                    "--sizes {sizes:?}: over the {MAX_BATCH_VALUES} weights a random mlp may hold"
                )));
            }
            check_batch(e.max_bs, sizes[0])?;
            let net = Network::Mlp(Mlp::random(&sizes, a.seed));
            (net, "random-mlp".to_string(), format!("random(seed={}, sizes {sizes:?})", a.seed))
        }
    };
    if net.is_recurrent() {
        return Err(fatal(format!(
            "`serve bench elastic` serves a fixed-shape model (mlp, resnet, bert, custom); {} is a {} model \
             (try `serve bench {}`)",
            source,
            net.kind(),
            net.kind()
        )));
    }
    check_batch(e.max_bs, net.dense_lens().0)?;
    let net = Arc::new(net);
    let backend = serve::backend::create(a.rt.backend.into(), a.rt.threads)?;
    let report_file = open_report(a.json.as_ref())?;
    println!("# serve bench elastic `{name}` ({}, {source}) on {}", net.kind(), backend.describe());
    let [t1, t_max] = batch_ms(&*backend, &net, [1, e.max_bs])?;
    let cap = e.max_bs as f64 / (t_max / 1e3);
    let qos = e.qos_ms.unwrap_or(t_max * PAPER_QOS_MS / PAPER_BATCH_MS);
    let opt_wait_ms = e.opt_wait_ms.unwrap_or(t_max * PAPER_OPT_WAIT_MS / PAPER_BATCH_MS);
    println!(
        "# one task: t(1) {t1:.3} ms, t({}) {t_max:.3} ms; one full batch's capacity {cap:.1} req/s; QoS {qos:.3} ms, \
         OPT_Wait {opt_wait_ms:.3} ms{}",
        e.max_bs,
        if e.qos_ms.is_none() { " (the paper's 200 and 30 ms per 93.7 ms batch, scaled)" } else { "" }
    );
    let wants_eebird = e.policies.is_empty() || e.policies.contains(&ElasticPolicyArg::Eebird);
    let engine_confs = if !wants_eebird {
        BTreeMap::new()
    } else if let Some(path) = &e.engine_configs {
        crate::profile_engine::read_engine_configs(path)?
    } else if let Some(path) =
        a.model_dir.as_ref().map(|d| d.join(ENGINE_CONFIGS_FILE)).filter(|p| p.is_file())
    {
        println!("# E-Ebird's engine configurations from {}", path.display());
        crate::profile_engine::read_engine_configs(&path)?
    } else {
        let totals: Vec<usize> = PROFILED_TOTALS.iter().copied().filter(|&t| t <= e.max_bs).collect();
        crate::profile_engine::profile_engine_configs(net.clone(), &name, &source, &*backend, &totals, None)?
    };
    let pols =
        policies(&Setup { chosen: &e.policies, max_bs: e.max_bs, qos_ms: qos, opt_wait_ms, engine_confs });
    for p in &pols {
        if let PolicyConfig::Elastic(c) = &p.config {
            c.check().map_err(|err| fatal(format!("{}: {err}", p.name)))?;
        }
    }
    if let Some(PolicyConfig::Elastic(c)) = pols.iter().find(|p| p.name == "eebird").map(|p| &p.config) {
        println!("# E-Ebird's engine: workers {:?}, configurations {:?}", c.workers, c.engine_confs);
    } else {
        println!("# N-Ebird's workers {:?}", ElasticConfig::DEFAULT_WORKERS);
    }
    let (input_len, _) = net.dense_lens();
    let values = layer_batch(&net, INPUTS);
    let inputs = values.chunks(input_len.max(1)).map(|row| Input::F32(row.to_vec())).collect();
    let work = Workload {
        rt: a.rt,
        net: net.clone(),
        name: name.clone(),
        inputs,
        qos: Some(Duration::from_secs_f64(qos / 1e3)),
        token_gates_bytes: None,
    };
    let memory = crate::elastic_memory::measure(&*backend, &net, &ElasticConfig::DEFAULT_WORKERS)?;
    let report = json!({
        "memory": memory,
        "workload": format!("{:?}", e.arrivals).to_lowercase(),
        "backend": backend.kind().to_string(),
        "backend_description": backend.describe(),
        "model": {"name": name, "kind": net.kind().name(), "source": source},
        "max_bs": e.max_bs, "opt_wait_ms": opt_wait_ms, "t1_ms": t1, "t_max_bs_ms": t_max,
    });
    let mut driver = RuntimeDriver {
        work,
        max_bs: e.max_bs,
        requests: a.requests,
        duration_s: a.duration_s,
        probe_s: a.probe_s,
    };
    let plan = Plan {
        e,
        rates: &a.rate,
        cap,
        qos,
        seed: a.seed,
        svg: a.svg.as_deref().map(|p| (p, format!("{name} on {}: latency by arrival order", backend.kind()))),
        json: report_file,
    };
    compare(&mut driver, &pols, plan, report, t0)
}
