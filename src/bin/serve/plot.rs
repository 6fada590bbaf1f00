//! `--svg FILE` of `serve bench` and `serve sim`, drawn by one `draw`: latency against
//! throughput (one colour per policy, p50 / p90 / p99 as thick / thinner / thinnest lines with a
//! point per offered rate), and plain lines of named series with an optional reference line.

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
fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

/// One line of a chart: its legend name, colour and stroke width, its points, and whether each
/// point gets a marker.
struct Series {
    name: String,
    colour: RGBColor,
    width: u32,
    points: Vec<(f64, f64)>,
    markers: bool,
}

/// Write the latency–throughput plot of `results` to `path`.
pub(crate) fn latency_svg(path: &Path, title: &str, results: &[RunResult]) -> CliResult<()> {
    let mut policies: Vec<&str> = Vec::new();
    for r in results {
        if !policies.contains(&r.policy.as_str()) {
            policies.push(&r.policy);
        }
    }
    let mut series = Vec::new();
    for (i, policy) in policies.iter().enumerate() {
        let mut rows: Vec<&RunResult> = results.iter().filter(|r| r.policy == *policy).collect();
        rows.sort_by(|a, b| a.offered_rps.total_cmp(&b.offered_rps));
        for (name, width, pick) in [
            ("p50", 3, (|r: &RunResult| r.p50_ms) as fn(&RunResult) -> f64),
            ("p90", 2, |r: &RunResult| r.p90_ms),
            ("p99", 1, |r: &RunResult| r.p99_ms),
        ] {
            series.push(Series {
                name: format!("{policy} {name}"),
                colour: colour(i),
                width,
                points: rows.iter().map(|r| (r.throughput_rps, pick(r))).collect(),
                markers: true,
            });
        }
    }
    draw(
        path,
        title,
        ("throughput (requests/s)", "latency (ms)"),
        &series,
        None,
        SeriesLabelPosition::UpperLeft,
    )?;
    println!("# wrote {}", path.display());
    Ok(())
}

/// Lines through `(x, y)` points, one colour per named series, with an optional horizontal
/// reference line (name, y) in black; both axes start at 0.
pub(crate) fn lines_svg(
    path: &Path,
    title: &str,
    axes: (&str, &str),
    lines: &[(&str, Vec<(f64, f64)>)],
    reference: Option<(&str, f64)>,
) -> CliResult<()> {
    let series: Vec<Series> = lines
        .iter()
        .enumerate()
        .map(|(i, (name, points))| Series {
            name: name.to_string(),
            colour: colour(i),
            width: 2,
            points: points.clone(),
            markers: false,
        })
        .collect();
    draw(path, title, axes, &series, reference, SeriesLabelPosition::MiddleRight)
}

/// The tenant studies' plot (`serve sim tenant`, `serve bench tenant`): each scheme's share of
/// queries within QoS (%) against the offered rate, with the 95% line; says where it wrote.
pub(crate) fn met_share_svg(path: &Path, title: &str, lines: &[(&str, Vec<(f64, f64)>)]) -> CliResult<()> {
    lines_svg(path, title, ("offered rate (queries/s)", "within QoS (%)"), lines, Some(("95%", 95.0)))?;
    println!("# wrote {}", path.display());
    Ok(())
}

/// Draw `series` (points with a non-finite coordinate left out) and the optional black
/// reference line on axes from 0 to a little past the largest value, to an SVG at `path`.
fn draw(
    path: &Path,
    title: &str,
    (x_desc, y_desc): (&str, &str),
    series: &[Series],
    reference: Option<(&str, f64)>,
    legend: SeriesLabelPosition,
) -> CliResult<()> {
    let err = |e: &dyn std::fmt::Display| fatal(format!("cannot draw {}: {e}", path.display()));
    let finite = |s: &Series| -> Vec<(f64, f64)> {
        s.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite()).collect()
    };
    let series: Vec<(&Series, Vec<(f64, f64)>)> = series.iter().map(|s| (s, finite(s))).collect();
    let pts = || series.iter().flat_map(|s| s.1.iter());
    let x_max = pts().map(|p| p.0).fold(1e-9, f64::max) * 1.05;
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
    for (s, points) in series {
        let style = s.colour.stroke_width(s.width);
        chart
            .draw_series(LineSeries::new(points.clone(), style))
            .map_err(|e| err(&e))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        if s.markers {
            let fill = s.colour.filled();
            chart.draw_series(points.into_iter().map(|p| Circle::new(p, 3, fill))).map_err(|e| err(&e))?;
        }
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
        .position(legend)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))
}
