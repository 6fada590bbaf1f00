//! `serve sim tenant` (issue 16, ARCHITECTURE.md §7.9): VELTAIR's multi-tenant study on virtual
//! time. The seven models of the paper's workloads share `--cores` cores; every scheme of
//! `serve::sched::tenant` serves the same Poisson arrivals (one seed), and for each the highest
//! rate with ≥ 95% of queries within their model's QoS is found by bisection (QPS@95%). At a
//! common rate (75% of layer-wise's QPS@95%) it reports each scheme's core usage against
//! layer-wise's, conflict rate and latency over solo; then the spec's orderings, each as holds /
//! does not hold. Every figure is simulated: block times come from the simulator's GEMM cost
//! model (`serve::sim::tenant::cost`), whose per-core rate and serial fraction `--cost` fits to a
//! `serve profile` of a layer model on this machine (c = 1 and 2 points).

use std::path::PathBuf;
use std::time::Instant;

use clap::{Args, ValueEnum};
use serde_json::{Value, json};

use serve::sched::tenant::{CapRule, Scheme, Versions};
use serve::sim::tenant::cost::Machine;
use serve::sim::tenant::{MAX_QUERIES, Run, Setup, TenantOutcome, Workload, qps_at_95, simulate};

use crate::bench::{open_report, write_report};
use crate::{CliResult, fatal, in_range, positive_f64};

/// `--rule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum RuleArg {
    /// R: a block that starts at a pivot absorbs later layers until its cores are within the cap.
    Cap,
    /// L: the paper's literal cut at every pivot (ablation).
    Literal,
}

#[derive(Args, Debug)]
pub(crate) struct TenantArgs {
    /// Cores the tenants share (1 to 1024).
    #[arg(long, default_value_t = 64, value_parser = in_range(1, 1024))]
    cores: usize,
    /// The workload: light, medium, heavy (the class's models at equal rates) or mix (all seven,
    /// rates ∝ 1/QoS).
    #[arg(long, default_value = "mix", value_parser = |s: &str| Workload::parse(s).map_err(|e| e.to_string()))]
    workload: Workload,
    /// Schemes to compare (default: all of veltair, veltair-ac, veltair-as, layer-wise,
    /// model-wise, fixed-6, fixed-11, prema).
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = |s: &str| Scheme::parse(s).map_err(|e| e.to_string()))]
    policy: Vec<Scheme>,
    /// How veltair's and veltair-as's blocks that start at a pivot end.
    #[arg(long, value_enum, default_value_t = RuleArg::Cap)]
    rule: RuleArg,
    /// Plan the interference-aware schemes' blocks to their static budgets (Alg. 1's), not to
    /// the time each query has left (the default; see ARCHITECTURE.md §7.9).
    #[arg(long)]
    static_budgets: bool,
    /// Queries per simulated run (the spec's figures: at least 30000).
    #[arg(long, default_value_t = 30_000, value_parser = in_range(1, MAX_QUERIES))]
    queries: usize,
    /// Seed of the arrivals (the same for every scheme and probe).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Halvings of the QPS@95% bisection.
    #[arg(long, default_value_t = 10, value_parser = in_range(1, 30))]
    steps: usize,
    /// A `serve profile MODEL_DIR --json FILE` of a layer model (CPU, cores 1 and 2): fit the cost
    /// model's per-core rate and serial fraction to it.
    #[arg(long)]
    cost: Option<PathBuf>,
    /// Also run every scheme at these rates (queries/s, all models together).
    #[arg(long, value_delimiter = ',', num_args = 1.., value_parser = positive_f64)]
    rate: Vec<f64>,
    /// Write the results as one JSON object.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Draw each scheme's share of queries within QoS against the offered rate into this SVG.
    #[arg(long)]
    svg: Option<PathBuf>,
}

/// Fit the machine's per-core rate and fixed per-layer cost to a `serve profile` layer file, as
/// medians over its layers: with `t(c) = f + p / c`, the two points give `f = 2·t(2) − t(1)`
/// (clamped at 0) and `p = t(1) − f`; the rate is FLOPs / `p` with the largest tiles'
/// efficiency (0.9) taken out.
fn fit(m: &mut Machine, path: &PathBuf) -> CliResult<String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| fatal(format!("cannot read {}: {e}", path.display())))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| fatal(format!("{}: not JSON: {e}", path.display())))?;
    let layers =
        v["layers"].as_array().ok_or_else(|| fatal(format!("{}: no `layers` array", path.display())))?;
    let (mut rates, mut fixed) = (Vec::new(), Vec::new());
    for l in layers {
        let flops = l["flops_per_row"].as_f64().unwrap_or(0.0);
        let at = |c: u64| {
            l["points"].as_array().and_then(|ps| {
                ps.iter().find(|p| p["batch"].as_u64() == Some(1) && p["cores"].as_u64() == Some(c))?["us"].as_f64()
            })
        };
        if let (Some(t1), true) = (at(1), flops > 0.0) {
            let f = at(2).map_or(0.0, |t2| (2.0 * t2 - t1).clamp(0.0, 0.5 * t1));
            rates.push(flops / (t1 - f) / 1e3 / 0.9);
            fixed.push(f);
        }
    }
    let median = |mut v: Vec<f64>| {
        v.retain(|x| x.is_finite());
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied()
    };
    let Some(rate) = median(rates).filter(|r| *r > 0.0) else {
        return Err(fatal(format!("{}: no layer with FLOPs and a batch-1, 1-core time", path.display())));
    };
    m.gflops_per_core = rate;
    if let Some(f) = median(fixed) {
        m.fixed_us = f;
    }
    Ok(format!(
        "fitted to {}: {:.1} GFLOP/s per core, {:.1} µs fixed per layer",
        path.display(),
        m.gflops_per_core,
        m.fixed_us
    ))
}

/// One scheme's results.
struct Row {
    scheme: Scheme,
    qps: f64,
    at_qps: Option<TenantOutcome>,
    /// Met share against rate, from a sweep (for the plot).
    curve: Vec<(f64, f64)>,
}

fn outcome_json(setup: &Setup, o: &TenantOutcome, queries: usize) -> Value {
    json!({
        "met": o.met_share(),
        "latency_over_solo": o.latency_over_solo(setup),
        "mean_cores": o.mean_cores(),
        "peak_cores": o.peak_cores,
        "conflict_rate": o.conflict_rate(),
        "units": o.units,
        "decide_us_per_query": o.decide.as_secs_f64() * 1e6 / queries.max(1) as f64,
    })
}

pub(crate) fn cmd_sim_tenant(a: &TenantArgs) -> CliResult<()> {
    let t0 = Instant::now();
    let mut machine = Machine::threadripper(a.cores);
    let fitted = a.cost.as_ref().map(|p| fit(&mut machine, p)).transpose()?;
    let rule = if a.rule == RuleArg::Cap { CapRule::Cap } else { CapRule::Literal };
    let setup = Setup::new(machine, a.workload)?;
    let schemes = if a.policy.is_empty() { Scheme::study() } else { a.policy.clone() };
    println!(
        "# serve sim tenant: {:?} workload on {} cores, {} queries per run, seed {} (simulated)",
        a.workload, a.cores, a.queries, a.seed
    );
    println!("# cost model: {}", fitted.unwrap_or_else(|| "the built-in 64-core AVX2 constants".into()));
    let mut models = Vec::new();
    for (i, p) in setup.profiles.iter().enumerate() {
        let kept: usize = setup.costs[i].layers.iter().map(|l| l.versions.len()).sum();
        let solo = setup.solo(i).as_secs_f64() * 1e3;
        println!(
            "#   {:<16} {:>3} layers, {:.1} versions/layer, QoS {:>5.1} ms, solo {:>7.2} ms, Avg_C {:>3}{}, share {:.3}",
            p.name(),
            p.layers().len(),
            kept as f64 / p.layers().len() as f64,
            p.qos().as_secs_f64() * 1e3,
            solo,
            p.avg_cores(Versions::SoloBest, 0),
            if p.feasible() { "" } else { " (QoS infeasible: served best-effort)" },
            setup.shares[i]
        );
        models.push(
            json!({"model": p.name(), "layers": p.layers().len(), "qos_ms": p.qos().as_secs_f64() * 1e3,
                           "solo_ms": solo, "avg_cores": p.avg_cores(Versions::SoloBest, 0),
                           "feasible": p.feasible(), "share": setup.shares[i]}),
        );
    }
    let base = |scheme: Scheme, rate: f64| Run {
        scheme,
        rule,
        rate,
        queries: a.queries,
        seed: a.seed,
        trace: false,
        time_left: !a.static_budgets,
    };
    let mut rows = Vec::new();
    for &scheme in &schemes {
        let (qps, at_qps) = qps_at_95(&setup, &base(scheme, 50.0), a.steps as u32)?;
        match &at_qps {
            Some(o) => println!(
                "{:<12} QPS@95% {:>9.1}   met {:>5.1}%  latency/solo {:>5.2}  cores {:>5.1} (peak {:>3})  conflicts {:>5.1}%  decide {:>5.1} µs/query",
                scheme.to_string(),
                qps,
                o.met_share() * 100.0,
                o.latency_over_solo(&setup),
                o.mean_cores(),
                o.peak_cores,
                o.conflict_rate() * 100.0,
                o.decide.as_secs_f64() * 1e6 / a.queries as f64
            ),
            None => println!(
                "{:<12} QPS@95% 0: fewer than 95% of queries meet their QoS at any rate tried",
                scheme.to_string()
            ),
        }
        rows.push(Row { scheme, qps, at_qps, curve: Vec::new() });
    }
    let qps_of = |s: Scheme| rows.iter().find(|r| r.scheme == s).map(|r| r.qps);
    let lw = qps_of(Scheme::LayerWise);
    // Core usage at a common load: 75% of layer-wise's QPS@95% (of the best scheme's without it).
    let reference = lw.unwrap_or_else(|| rows.iter().map(|r| r.qps).fold(0.0, f64::max));
    let mut at75 = Vec::new();
    let mut extra = Vec::new();
    if reference > 0.0 {
        let rate = 0.75 * reference;
        println!(
            "# at {rate:.1} q/s (75% of {}'s QPS@95%):",
            if lw.is_some() { "layer-wise" } else { "the best" }
        );
        let outs: Vec<(Scheme, TenantOutcome)> =
            schemes.iter().map(|&s| Ok((s, simulate(&setup, &base(s, rate))?))).collect::<CliResult<_>>()?;
        let lw_cores = outs.iter().find(|(s, _)| *s == Scheme::LayerWise).map(|(_, o)| o.mean_cores());
        for (s, o) in &outs {
            let gap = lw_cores.map(|c| (o.mean_cores() - c) / c * 100.0);
            println!(
                "  {:<12} met {:>5.1}%  cores {:>5.1}{}  conflicts {:>5.1}%  latency/solo {:>5.2}",
                s.to_string(),
                o.met_share() * 100.0,
                o.mean_cores(),
                gap.map_or(String::new(), |g| format!(" ({g:+.1}% vs layer-wise)")),
                o.conflict_rate() * 100.0,
                o.latency_over_solo(&setup)
            );
            let mut j = outcome_json(&setup, o, a.queries);
            j["policy"] = json!(s.to_string());
            j["rate"] = json!(rate);
            j["core_gap_vs_layer_wise"] = json!(gap.map(|g| g / 100.0));
            at75.push(j);
        }
    }
    for &rate in &a.rate {
        for &s in &schemes {
            let o = simulate(&setup, &base(s, rate))?;
            let by: Vec<String> = o
                .by_model
                .iter()
                .zip(&setup.profiles)
                .map(|((n, met), p)| format!("{} {:.0}%", p.name(), *met as f64 * 100.0 / (*n).max(1) as f64))
                .collect();
            println!(
                "  {:<12} at {rate:>8.1} q/s: met {:>5.1}%  cores {:>5.1}  conflicts {:>5.1}%  [{}]",
                s.to_string(),
                o.met_share() * 100.0,
                o.mean_cores(),
                o.conflict_rate() * 100.0,
                by.join(", ")
            );
            let mut j = outcome_json(&setup, &o, a.queries);
            j["policy"] = json!(s.to_string());
            j["rate"] = json!(rate);
            extra.push(j);
        }
    }
    // The spec's orderings.
    let mut checks = Vec::new();
    let mut check = |name: &str, holds: Option<bool>, detail: String| {
        let verdict = match holds {
            Some(true) => "holds",
            Some(false) => "does NOT hold",
            None => "not measured (a scheme it needs was not run)",
        };
        println!("# check: {name}: {verdict} ({detail})");
        checks.push(json!({"check": name, "holds": holds, "detail": detail}));
    };
    let order = [Scheme::Veltair, Scheme::VeltairAc, Scheme::VeltairAs, Scheme::LayerWise, Scheme::Prema];
    let q: Option<Vec<f64>> = order.iter().map(|&s| qps_of(s)).collect();
    check(
        "QPS@95% FULL > AC > AS > layer-wise > PREMA",
        q.as_ref().map(|q| q.windows(2).all(|w| w[0] > w[1])),
        q.as_ref().map_or(String::new(), |q| {
            format!("{:.1} / {:.1} / {:.1} / {:.1} / {:.1}", q[0], q[1], q[2], q[3], q[4])
        }),
    );
    if let (Some(full), Some(lw)) = (qps_of(Scheme::Veltair), lw) {
        let paper = match a.workload {
            Workload::Light => 71,
            Workload::Medium => 62,
            Workload::Heavy => 44,
            Workload::Mix => 68,
        };
        let gain = if lw > 0.0 { (full / lw - 1.0) * 100.0 } else { f64::INFINITY };
        check(
            "FULL gains over layer-wise (the Planaria port)",
            Some(gain > 0.0),
            format!("{gain:+.0}% here, +{paper}% in the paper"),
        );
    }
    let full = rows.iter().find(|r| r.scheme == Scheme::Veltair).and_then(|r| r.at_qps.as_ref());
    check(
        "FULL's latency at its QPS@95% within ~1.2× solo",
        full.map(|o| o.latency_over_solo(&setup) <= 1.2),
        full.map_or(String::new(), |o| format!("{:.2}× (paper 1.1×)", o.latency_over_solo(&setup))),
    );
    let gap =
        |s: &str| at75.iter().find(|j| j["policy"] == s).and_then(|j| j["core_gap_vs_layer_wise"].as_f64());
    if let (Some(v), Some(m)) = (gap("veltair"), gap("model-wise")) {
        check(
            "core-usage gap vs layer-wise at 75% load: FULL < 10%, model-wise ≫ 10%",
            Some(v.abs() < 0.10 && m.abs() > 0.10),
            format!("FULL {:+.1}%, model-wise {:+.1}% (paper < 10% / 47%)", v * 100.0, m * 100.0),
        );
    }
    if let Some(lw) = lw.filter(|q| *q > 0.0) {
        // Layer-wise's outcome at its QPS@95% is the bisection's last passing probe (the runs are
        // deterministic for a seed), so only FULL is simulated at that rate.
        let lw_at = rows.iter().find(|r| r.scheme == Scheme::LayerWise).and_then(|r| r.at_qps.as_ref());
        if let (true, Some(lw_at)) = (schemes.contains(&Scheme::Veltair), lw_at) {
            let (l, v) =
                (lw_at.conflict_rate(), simulate(&setup, &base(Scheme::Veltair, lw))?.conflict_rate());
            check(
                "layer-wise's conflict rate ≫ FULL's at high QPS",
                Some(l > 2.0 * v),
                format!(
                    "{:.1}% vs {:.1}% at {lw:.1} q/s (paper: layer-wise 23.8% at 300 QPS)",
                    l * 100.0,
                    v * 100.0
                ),
            );
        }
        if schemes.contains(&Scheme::Fixed(6)) && schemes.contains(&Scheme::Fixed(11)) {
            let met = |s: Scheme, r: f64| simulate(&setup, &base(s, r)).map(|o| o.met_share());
            let (lo, hi) = (0.5 * lw, 1.25 * lw);
            let (a6, a11, b6, b11) = (
                met(Scheme::Fixed(6), lo)?,
                met(Scheme::Fixed(11), lo)?,
                met(Scheme::Fixed(6), hi)?,
                met(Scheme::Fixed(11), hi)?,
            );
            check(
                "the best fixed block size grows with QPS (6 at low load, 11 at high)",
                Some(a6 >= a11 && b11 >= b6),
                format!(
                    "met at {lo:.0} q/s: fixed-6 {:.1}%, fixed-11 {:.1}%; at {hi:.0} q/s: {:.1}%, {:.1}%",
                    a6 * 100.0,
                    a11 * 100.0,
                    b6 * 100.0,
                    b11 * 100.0
                ),
            );
        }
    }
    if let Some(path) = &a.svg {
        let top = rows.iter().map(|r| r.qps).fold(0.0, f64::max).max(1.0);
        for r in &mut rows {
            for k in 1..=8 {
                let rate = top * 0.2 * k as f64;
                r.curve.push((rate, simulate(&setup, &base(r.scheme, rate))?.met_share() * 100.0));
            }
        }
        let names: Vec<String> = rows.iter().map(|r| r.scheme.to_string()).collect();
        let lines: Vec<(&str, Vec<(f64, f64)>)> =
            rows.iter().zip(&names).map(|(r, n)| (n.as_str(), r.curve.clone())).collect();
        let title = format!("{:?} on {} cores (simulated): queries within QoS", a.workload, a.cores);
        crate::plot::met_share_svg(path, &title, &lines)?;
    }
    if let Some((path, file)) = open_report(a.json.as_ref())? {
        let results: Vec<Value> = rows
            .iter()
            .map(|r| {
                let mut j = r.at_qps.as_ref().map_or(json!({}), |o| outcome_json(&setup, o, a.queries));
                j["policy"] = json!(r.scheme.to_string());
                j["qps_at_95"] = json!(r.qps);
                j["curve"] =
                    json!(r.curve.iter().map(|(x, y)| json!({"rate": x, "met_pct": y})).collect::<Vec<_>>());
                j
            })
            .collect();
        let report = json!({
            "backend": "sim",
            "what": "tenant",
            "workload": format!("{:?}", a.workload).to_lowercase(),
            "cores": a.cores,
            "rule": format!("{:?}", a.rule).to_lowercase(),
            "queries": a.queries,
            "seed": a.seed,
            "machine": {"gflops_per_core": setup.machine.gflops_per_core, "fixed_us": setup.machine.fixed_us,
                        "sync_us": setup.machine.sync_us},
            "models": models,
            "results": results,
            "at_75_pct_of_layer_wise": at75,
            "at_rates": extra,
            "checks": checks,
        });
        write_report(&path, file, &report)?;
    }
    println!("# done in {:.1} s", t0.elapsed().as_secs_f64());
    Ok(())
}
