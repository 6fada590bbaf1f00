//! `--svg FILE` of `serve bench` and `serve sim`: latency against throughput, one colour per
//! policy, p50 / p90 / p99 as solid / dashed-looking (thinner) / dotted-looking (thinnest) lines
//! with a point per offered rate.

use std::path::Path;

use plotters::prelude::*;

use crate::bench::RunResult;
use crate::{CliResult, fatal};

const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(140, 86, 75),
];

/// The colour of the `i`-th series.
pub(crate) fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// Write the latency–throughput plot of `results` to `path`.
pub(crate) fn latency_svg(path: &Path, title: &str, results: &[RunResult]) -> CliResult<()> {
    let err = |e: &dyn std::fmt::Display| fatal(format!("cannot draw {}: {e}", path.display()));
    let mut policies: Vec<&str> = Vec::new();
    for r in results {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    let x_max = results.iter().map(|r| r.throughput_rps).fold(1.0, f64::max) * 1.05;
    let y_max = results.iter().map(|r| r.p99_ms).filter(|v| v.is_finite()).fold(0.1, f64::max) * 1.05;
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc("throughput (requests/s)")
        .y_desc("latency (ms)")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, policy) in policies.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut rows: Vec<&RunResult> = results.iter().filter(|r| r.policy == *policy).collect();
        rows.sort_by(|a, b| a.offered_rps.total_cmp(&b.offered_rps));
        for (name, width, pick) in [
            ("p50", 3, (|r: &RunResult| r.p50_ms) as fn(&RunResult) -> f64),
            ("p90", 2, |r: &RunResult| r.p90_ms),
            ("p99", 1, |r: &RunResult| r.p99_ms),
        ] {
            let pts: Vec<(f64, f64)> = rows.iter().map(|r| (r.throughput_rps, pick(r))).collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), colour.stroke_width(width)))
                .map_err(|e| err(&e))?
                .label(format!("{policy} {name}"))
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(width))
                });
            chart
                .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, colour.filled())))
                .map_err(|e| err(&e))?;
        }
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    println!("# wrote {}", path.display());
    Ok(())
}

/// Lines through `(x, y)` points, one colour per named series, with an optional horizontal
/// reference line (name, y) in black; both axes start at 0.
pub(crate) fn lines_svg(
    path: &Path,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    lines: &[(&str, Vec<(f64, f64)>)],
    reference: Option<(&str, f64)>,
) -> CliResult<()> {
    let err = |e: &dyn std::fmt::Display| fatal(format!("cannot draw {}: {e}", path.display()));
    let pts = || lines.iter().flat_map(|l| l.1.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let x_max = pts().map(|p| p.0).fold(1e-9, f64::max) * 1.02;
    let y_max = pts().map(|p| p.1).chain(reference.map(|r| r.1)).fold(1e-9, f64::max) * 1.05;
    let root = SVGBackend::new(path, (960, 640)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(|e| err(&e))?;
    chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(|e| err(&e))?;
    for (i, (name, line)) in lines.iter().enumerate() {
        let c = colour(i);
        let line: Vec<(f64, f64)> =
            line.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect();
        chart
            .draw_series(LineSeries::new(line, c.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    if let Some((name, y)) = reference {
        chart
            .draw_series(LineSeries::new(vec![(0.0, y), (x_max, y)], BLACK.stroke_width(1)))
            .map_err(|e| err(&e))?
            .label(name)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK.stroke_width(1)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
