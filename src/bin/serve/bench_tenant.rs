//! `serve bench tenant` (issue 16, ARCHITECTURE.md §7.9): VELTAIR's multi-tenant study on real
//! cores. The runtime's tenant mode (`Runtime::add_tenants`) serves a workload's models sharing
//! `--cores` CPUs under each scheme in turn — the same runtime, the same models and the same
//! profile (measured once, at the first load), the same seeded Poisson arrivals — and for each
//! scheme the highest rate at which ≥ 95% of the queries complete within their model's QoS is
//! found by bisection (QPS@95%). Every figure here is measured, none simulated.
//!
//! The models are small random ones of the paper's kinds, sized for a machine of a few cores
//! (the paper's ResNet-50 … BERT-Large at a QoS of 10–130 ms need its 64): `mlp` and `resnet`
//! (light), `resnet-b` (bottleneck blocks, medium) and `bert` (heavy). A model's QoS is
//! `--qos-factor` × its profiled solo latency on every core. The workloads: a class's models at
//! equal rates, or all four with rates ∝ 1/QoS (mix). A query is submitted with its QoS as its
//! deadline, so an overloaded probe drops late queries at a block boundary instead of building
//! a backlog; a dropped query counts as missed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use serve::model::bert::{Bert, BertConfig};
use serve::model::resnet::{ResNet, ResNetConfig};
use serve::sched::tenant::Scheme;
use serve::{
    BackendChoice, CompletionQueue, Input, Network, Runtime, SubmitOptions, Tenant, TenantOptions, TenantSpec,
};

use crate::bench::{open_report, write_report};
use crate::{CliResult, fatal, in_range, positive_f64};

/// `--workload`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum TenantWorkload {
    Light,
    Medium,
    Heavy,
    Mix,
}

#[derive(Args, Debug)]
pub(crate) struct BenchTenantArgs {
    /// Cores the tenants share (0: every CPU this process may run on).
    #[arg(long, default_value_t = 0, value_parser = in_range(0, 1024))]
    cores: usize,
    #[arg(long, value_enum, default_value_t = TenantWorkload::Mix)]
    workload: TenantWorkload,
    /// Schemes to compare (default: veltair, veltair-ac, veltair-as, layer-wise, model-wise,
    /// fixed-6, fixed-11, prema).
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = |s: &str| Scheme::parse(s).map_err(|e| e.to_string()))]
    policy: Vec<Scheme>,
    /// A model's QoS target as a multiple of its solo latency on every core.
    #[arg(long, default_value_t = 4.0, value_parser = positive_f64)]
    qos_factor: f64,
    /// Seconds of arrivals per probe.
    #[arg(long, default_value_t = 2.0, value_parser = positive_f64)]
    duration_s: f64,
    /// Halvings of the QPS@95% bisection.
    #[arg(long, default_value_t = 6, value_parser = in_range(1, 20))]
    steps: usize,
    /// Also probe every scheme at these rates (queries/s, all models together), after its
    /// search: latency and core usage at a common load.
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Seed of the arrivals (the same for every scheme and probe).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Write the results as one JSON object.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw each scheme's share of queries within QoS against the offered rate into this SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// The bench's models: name, network, class.
fn models(w: TenantWorkload) -> Vec<(&'static str, Network)> {
    let resnet = |block: &str, width, image| ResNetConfig {
        name: None,
        block: block.into(),
        layers: [1, 1, 1, 1],
        num_classes: 10,
        image,
        width: Some(width),
    };
    let light = vec![
        ("mlp", Network::Mlp(serve::model::Mlp::random(&[1024, 2048, 2048, 1024, 10], 1))),
        ("resnet", Network::ResNet(ResNet::random(&resnet("basic", 32, [3, 64, 64]), 2))),
    ];
    let medium =
        vec![("resnet-b", Network::ResNet(ResNet::random(&resnet("bottleneck", 16, [3, 96, 96]), 3)))];
    let bert = BertConfig {
        name: None,
        vocab: 1000,
        hidden: 256,
        layers: 4,
        heads: 4,
        intermediate: 1024,
        max_position: 128,
        type_vocab: 2,
        seq_len: 128,
        layer_norm_eps: None,
    };
    let heavy = vec![("bert", Network::Bert(Bert::random(&bert, 4)))];
    match w {
        TenantWorkload::Light => light,
        TenantWorkload::Medium => medium,
        TenantWorkload::Heavy => heavy,
        TenantWorkload::Mix => light.into_iter().chain(medium).chain(heavy).collect(),
    }
}

/// A query's input for `net` (deterministic per seed).
fn input(net: &Network, seed: u64) -> Input {
    match net {
        Network::Bert(b) => {
            Input::Tokens((0..b.cfg.seq_len as u64).map(|i| ((i * 7919 + seed) % 1000) as u32).collect())
        }
        other => Input::F32(serve::workload::values(other.dense_lens().0, seed, 1.0)),
    }
}

/// Fewest queries of a probe (a low rate runs longer): 95% of fewer says little.
const MIN_QUERIES: usize = 200;
/// Longest a probe is stretched to reach [`MIN_QUERIES`].
const MAX_PROBE: Duration = Duration::from_secs(10);

/// What one probe at one rate measured.
#[derive(Clone, Debug, Default)]
struct Probe {
    rate: f64,
    queries: usize,
    met: usize,
    /// Per model: queries, and those within QoS.
    per_model: Vec<(usize, usize)>,
    /// Mean over the completed queries of latency / the model's solo latency.
    latency_over_solo: f64,
    /// Leased cores in use, on average over the probe.
    mean_cores: f64,
    conflict_rate: f64,
}

impl Probe {
    fn met_share(&self) -> f64 {
        if self.queries == 0 { 0.0 } else { self.met as f64 / self.queries as f64 }
    }
}

/// The served workload: tenants, their inputs and arrival shares.
struct Served<'a> {
    rt: &'a Runtime,
    tenants: Vec<Tenant>,
    nets: &'a [(&'static str, Network)],
    shares: &'a [f64],
    /// Each model's profiled solo latency (the same profile for every scheme), seconds.
    solo_s: &'a [f64],
}

/// Poisson arrivals at `rate` for `duration`, each query of a model drawn by the shares, every
/// one submitted with its QoS as its deadline; waits for all of them.
fn probe(s: &Served, rate: f64, duration: Duration, seed: u64) -> CliResult<Probe> {
    // At least MIN_QUERIES, unless that takes over MAX_PROBE; never under 20.
    let floor = ((rate * MAX_PROBE.as_secs_f64()) as usize).clamp(20, MIN_QUERIES);
    let n = ((rate * duration.as_secs_f64()).round() as usize).clamp(floor, 1_000_000);
    let offsets = serve::workload::poisson_arrivals(rate, n, seed);
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let pick: Vec<usize> = (0..n)
        .map(|_| {
            let mut u: f64 = rng.random();
            s.shares
                .iter()
                .position(|&p| {
                    u -= p;
                    u < 0.0
                })
                .unwrap_or(s.shares.len() - 1)
        })
        .collect();
    let inputs: Vec<Input> = (0..n).map(|i| input(&s.nets[pick[i]].1, i as u64)).collect();
    let queue = CompletionQueue::new()?;
    let before = s.rt.stats();
    let start = Instant::now() + Duration::from_millis(5);
    let mut out = Probe { rate, queries: n, per_model: vec![(0, 0); s.tenants.len()], ..Probe::default() };
    for &m in &pick {
        out.per_model[m].0 += 1;
    }
    let mut ratio_sum = 0.0;
    let mut completed = 0usize;
    let mut last = start;
    std::thread::scope(|scope| -> CliResult<()> {
        let mut sender = Some(scope.spawn(|| {
            let mut refused = 0usize;
            for (i, off) in offsets.iter().enumerate() {
                let due = start + *off;
                let now = Instant::now();
                if due > now {
                    std::thread::sleep(due - now);
                }
                let t = &s.tenants[pick[i]];
                let opts = SubmitOptions { deadline: Some(due + t.profile.qos()), priority: 0 };
                if t.model.submit_to(inputs[i].clone(), opts, &queue, i as u64).is_err() {
                    refused += 1;
                }
            }
            refused
        }));
        let mut batch = Vec::with_capacity(256);
        let mut seen = 0usize;
        let mut refused = None;
        while refused.is_none_or(|r| seen + r < n) {
            batch.clear();
            queue.next_into(&mut batch, 256, Duration::from_millis(20))?;
            let now = Instant::now();
            for c in batch.drain(..) {
                seen += 1;
                last = now;
                let i = c.tag as usize;
                let t = &s.tenants[pick[i]];
                if c.result.is_ok() {
                    let latency = now.saturating_duration_since(start + offsets[i]);
                    completed += 1;
                    ratio_sum += latency.as_secs_f64() / s.solo_s[pick[i]];
                    let met = usize::from(latency <= t.profile.qos());
                    out.met += met;
                    out.per_model[pick[i]].1 += met;
                }
            }
            if let Some(h) = sender.take_if(|h| h.is_finished()) {
                refused = Some(h.join().map_err(|_| fatal("the sender thread panicked"))?);
            }
        }
        Ok(())
    })?;
    let after = s.rt.stats();
    let span = last.saturating_duration_since(start).as_secs_f64().max(1e-9);
    out.latency_over_solo = if completed == 0 { f64::NAN } else { ratio_sum / completed as f64 };
    out.mean_cores = (after.leased_core_ns - before.leased_core_ns) as f64 * 1e-9 / span;
    let blocks = after.leased_tasks - before.leased_tasks;
    out.conflict_rate = if blocks == 0 {
        0.0
    } else {
        (after.lease_conflicts - before.lease_conflicts) as f64 / blocks as f64
    };
    Ok(out)
}

/// One line of a probe's figures.
fn describe(p: &Probe) -> String {
    let per: Vec<String> = p.per_model.iter().map(|(n, m)| format!("{m}/{n}")).collect();
    format!(
        "{:>9.1} q/s: {:>5.1}% within QoS ({}), latency/solo {:.2}, cores {:.2}, conflicts {:.1}%",
        p.rate,
        p.met_share() * 100.0,
        per.join(" "),
        p.latency_over_solo,
        p.mean_cores,
        p.conflict_rate * 100.0
    )
}

/// QPS@95%: bisection between 0 and `hi` for `steps` halvings; the highest passing probe (a
/// zero-rate one when none passes) and every probe taken.
fn qps_at_95(
    s: &Served,
    hi: f64,
    steps: usize,
    duration: Duration,
    seed: u64,
) -> CliResult<(Probe, Vec<Probe>)> {
    let (mut lo, mut hi) = (0.0, hi);
    let mut best = Probe::default();
    let mut probes = Vec::new();
    for _ in 0..steps {
        let mid = (lo + hi) / 2.0;
        let p = probe(s, mid, duration, seed)?;
        println!("    {}", describe(&p));
        if p.met_share() >= 0.95 {
            lo = mid;
            best = p.clone();
        } else {
            hi = mid;
        }
        probes.push(p);
    }
    Ok((best, probes))
}

pub(crate) fn cmd_bench_tenant(a: BenchTenantArgs) -> CliResult<()> {
    let cpus = serve::backend::cpu::affinity::allowed_cpus().len();
    let cores = if a.cores == 0 { cpus } else { a.cores };
    let rt = Runtime::builder()
        .backend(BackendChoice::Cpu)
        .cpu_threads(cores)
        .build()
        .map_err(|e| fatal(format!("cannot start the runtime: {e}")))?;
    let nets = models(a.workload);
    let schemes = if a.policy.is_empty() { Scheme::study() } else { a.policy.clone() };
    let base = TenantOptions { cores, ..TenantOptions::default() };
    // The profile, once: every scheme plans with the same tables.
    let t0 = Instant::now();
    let profiled = rt.add_tenants(
        nets.iter()
            .map(|(n, net)| TenantSpec::new(Arc::new(net.clone()), n, Duration::from_secs(1)))
            .collect(),
        base.clone(),
    )?;
    let solo: Vec<Duration> = profiled.iter().map(Tenant::solo).collect();
    let solo_s: Vec<f64> = solo.iter().map(Duration::as_secs_f64).collect();
    let specs: Vec<TenantSpec> = nets
        .iter()
        .zip(&profiled)
        .zip(&solo)
        .map(|(((n, net), t), solo)| TenantSpec {
            layers: Some(t.profile.layers().to_vec()),
            ..TenantSpec::new(Arc::new(net.clone()), n, solo.mul_f64(a.qos_factor))
        })
        .collect();
    drop(profiled);
    let weights: Vec<f64> = match a.workload {
        TenantWorkload::Mix => specs.iter().map(|s| 1.0 / s.qos.as_secs_f64()).collect(),
        _ => vec![1.0; specs.len()],
    };
    let total: f64 = weights.iter().sum();
    let shares: Vec<f64> = weights.iter().map(|w| w / total).collect();
    println!(
        "# serve bench tenant: {:?} on {cores} cores (of {cpus} CPUs), QoS = {} × solo, {} s probes, seed {} \
         (profiled in {:.1} s)",
        a.workload,
        a.qos_factor,
        a.duration_s,
        a.seed,
        t0.elapsed().as_secs_f64()
    );
    for ((s, solo), share) in specs.iter().zip(&solo).zip(&shares) {
        println!(
            "#   {:<9} {:>3} layers, solo {:>7.2} ms, QoS {:>7.2} ms, {:>4.1}% of arrivals",
            s.name,
            s.layers.as_ref().map_or(0, Vec::len),
            solo.as_secs_f64() * 1e3,
            s.qos.as_secs_f64() * 1e3,
            share * 100.0
        );
    }
    // The upper end of the search: every core busy with single-core work, perfectly packed.
    let one_core: f64 = specs
        .iter()
        .zip(&shares)
        .map(|(s, p)| {
            let layers = s.layers.as_ref().expect("profiled");
            p * layers.iter().map(|l| l.versions[0][0][0]).sum::<f64>() * 1e-6
        })
        .sum();
    let hi = cores as f64 / one_core.max(1e-9);
    let duration = Duration::from_secs_f64(a.duration_s);
    let mut rows = Vec::new();
    for &scheme in &schemes {
        println!("## {scheme}");
        let tenants = rt.add_tenants(specs.clone(), TenantOptions { scheme, ..base.clone() })?;
        let served = Served { rt: &rt, tenants, nets: &nets, shares: &shares, solo_s: &solo_s };
        let (best, mut probes) = qps_at_95(&served, hi, a.steps, duration, a.seed)?;
        for &rate in &a.rate {
            let p = probe(&served, rate, duration, a.seed)?;
            println!("    at {}", describe(&p));
            probes.push(p);
        }
        rows.push((scheme, best, probes));
    }
    println!();
    println!(
        "{:<11} {:>10} {:>12} {:>9} {:>13} {:>11} {:>10}",
        "policy", "qps_at_95", "vs layer-w.", "met", "latency/solo", "mean cores", "conflicts"
    );
    let of = |s: Scheme| rows.iter().find(|r| r.0 == s).map(|r| r.1.rate);
    let layer_wise = of(Scheme::LayerWise);
    for (scheme, best, _) in &rows {
        let vs = layer_wise.filter(|&l| l > 0.0).map(|l| format!("{:+.0}%", (best.rate / l - 1.0) * 100.0));
        println!(
            "{:<11} {:>10.1} {:>12} {:>8.1}% {:>13.2} {:>11.2} {:>9.1}%",
            scheme.to_string(),
            best.rate,
            vs.unwrap_or_else(|| "-".into()),
            best.met_share() * 100.0,
            best.latency_over_solo,
            best.mean_cores,
            best.conflict_rate * 100.0
        );
    }
    // The spec's ordering, as measured (Veltair-FULL runs the solo-best versions in the
    // runtime: one kernel version per layer, so FULL and AS plan alike).
    let chain = [Scheme::Veltair, Scheme::VeltairAc, Scheme::VeltairAs, Scheme::LayerWise, Scheme::Prema];
    let rates: Option<Vec<f64>> = chain.iter().map(|&s| of(s)).collect();
    if let Some(r) = rates {
        let holds = r.windows(2).all(|w| w[0] > w[1]);
        println!(
            "# ordering FULL > AC > AS > layer-wise > PREMA ({}): {}",
            r.iter().map(|x| format!("{x:.1}")).collect::<Vec<_>>().join(" / "),
            if holds { "holds" } else { "does NOT hold" }
        );
    }
    if let Some(path) = &a.svg {
        let names: Vec<String> = rows.iter().map(|r| r.0.to_string()).collect();
        let lines: Vec<(&str, Vec<(f64, f64)>)> = rows
            .iter()
            .zip(&names)
            .map(|(r, n)| {
                let mut pts: Vec<(f64, f64)> = r.2.iter().map(|p| (p.rate, p.met_share() * 100.0)).collect();
                pts.sort_by(|x, y| x.0.total_cmp(&y.0));
                (n.as_str(), pts)
            })
            .collect();
        let title = format!("{:?} on {cores} cores (measured): queries within QoS", a.workload);
        crate::plot::met_share_svg(path, &title, &lines)?;
    }
    if let Some((path, file)) = open_report(a.json.as_ref())? {
        let probe_json = |p: &Probe| {
            json!({"rate": p.rate, "queries": p.queries, "met_share": p.met_share(),
                   "latency_over_solo": p.latency_over_solo, "mean_cores": p.mean_cores,
                   "conflict_rate": p.conflict_rate})
        };
        let results: Vec<Value> = rows
            .iter()
            .map(|(s, best, probes)| {
                json!({"policy": s.to_string(), "qps_at_95": best.rate, "at_qps": probe_json(best),
                       "probes": probes.iter().map(probe_json).collect::<Vec<_>>()})
            })
            .collect();
        let models: Vec<Value> = specs
            .iter()
            .zip(&solo)
            .zip(&shares)
            .map(|((s, solo), share)| {
                json!({"name": s.name, "solo_ms": solo.as_secs_f64() * 1e3,
                       "qos_ms": s.qos.as_secs_f64() * 1e3, "share": share})
            })
            .collect();
        let report = json!({
            "bench": "tenant", "measured": true, "cores": cores, "workload": format!("{:?}", a.workload).to_lowercase(),
            "qos_factor": a.qos_factor, "duration_s": a.duration_s, "steps": a.steps, "seed": a.seed,
            "models": models, "results": results,
        });
        write_report(&path, file, &report)?;
    }
    Ok(())
}
