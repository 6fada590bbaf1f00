//! Cost models: how long the simulator's tasks take.
//!
//! A [`CostModel`] gives the time a task holds its worker as a function of its shape (cell type
//! and rows), and the engine's own delays around it. [`CostFile`] is the one implementation: a
//! table of measured points per cell type, linear between points (and along the nearest
//! segment beyond them), read from JSON — written by `serve profile` on a real backend, or
//! shipped with the crate from a paper's figures ([`CostFile::builtin`]).
//!
//! The file format (fields may be added, never renamed):
//! ```json
//! {"name": "batchmaker-v100", "source": "where the numbers come from", "backend": "v100",
//!  "model": {"kind": "lstm", "hidden": 1024},
//!  "cells": [{"cell": "step", "points": [[64, 185.0], [512, 784.0]]}],
//!  "launch_us": 0.0, "report_us": 0.0, "arrival_us": 0.0, "delivery_us": 0.0}
//! ```
//! `points` are `[rows, microseconds]`, rows ascending; a cell's name is the model's cell type
//! name (`step` for lstm, `encoder`/`decoder` for seq2seq, `leaf`/`internal` for treelstm,
//! `dense` for a fixed-shape model). `launch_us` is the time from a launch decision to the
//! worker's stream taking the task up (the engine gathering the batch and handing it over),
//! `report_us` from the stream finishing a task to the engine learning of it (the completion
//! counter seen by its watcher — the engine itself for a CPU stream, the poller for a CUDA one —
//! and handled by the engine). Once per request, not per task:
//! `arrival_us` from the caller's submit to the engine handling the arrival (the channel, the
//! engine waking), `delivery_us` from the engine completing a request to the caller holding the
//! completion (the queue, the caller waking). `idle` (optional) is how much longer a task's first
//! step takes when its stream was idle before it, as `[idle_us, factor]` points (factor 1 at 0,
//! linear between points, the last factor beyond): a stream that waited for work starts cold (its
//! thread, its pool's threads, its caches), as `serve profile` measures; the steps after the first
//! run warm.
//!
//! A cell may also have `issue` points, `[rows, microseconds]` like `points` (optional; none:
//! nothing): the engine thread's own time to issue one task. One thread issues every worker's
//! tasks, so this time is a resource shared by all workers, not a delay: a CUDA launch's host
//! calls (the staging copy, a handful of kernel launches, the signal) take tens of
//! microseconds, and at small batches tasks of several workers queue for the engine thread
//! while their streams wait. The stream starts a task `launch_us` after its issue starts (a
//! GPU runs the first kernels while the host launches the rest) and the task ends no sooner
//! than its issue. `serve profile` measures it as the time spent in the runner's launch calls.
//! A task of several steps is one issue: a CPU stream takes the whole task in one launch, and
//! the CUDA runner runs one step per task (`max_task_steps` 1).
//!
//! `cores` (optional; absent or 0: not modelled) says the workers are CPU streams sharing one
//! pool of that many compute threads, as the CPU backend's are; a cell's `pool_rows` is the
//! fewest rows of a task that runs on the whole pool (`Runner::task_threads`), smaller tasks
//! running on their stream's thread alone (absent: every task on one thread). Tasks running at
//! once on different workers then share the cores: while the threads they want add up to more
//! than `cores`, each progresses at `cores / Σ threads` of its solo speed (two pool-wide tasks
//! each at half speed; two one-thread tasks on two cores both at full speed).

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// How long simulated work takes.
pub trait CostModel {
    /// The time a task of `rows` rows (padding included) of cell type `cell` (by name) holds
    /// its worker; `None` if the model has no figure for the cell type.
    fn task_time(&self, cell: &str, rows: usize) -> Option<Duration>;
    /// The engine thread's time to issue a task of `rows` rows of `cell` (its launch calls):
    /// tasks are issued one after another, whatever worker they go to; a task reaches its
    /// worker the [`launch_delay`](Self::launch_delay) after its issue starts and ends no
    /// sooner than its issue.
    fn issue_time(&self, cell: &str, rows: usize) -> Duration {
        let _ = (cell, rows);
        Duration::ZERO
    }
    /// From a launch decision (its issue's start) to the worker taking the task up.
    fn launch_delay(&self) -> Duration;
    /// From a task's end on its worker to the engine's `task_done`.
    fn report_delay(&self) -> Duration;
    /// From a caller's submit to the engine handling the arrival.
    fn arrival_delay(&self) -> Duration {
        Duration::ZERO
    }
    /// From the engine completing a request to the caller holding its completion.
    fn delivery_delay(&self) -> Duration {
        Duration::ZERO
    }
    /// Steps one cell task may run (the simulated backend's `Backend::max_task_steps`); a task
    /// of several steps costs [`task_time`](Self::task_time) per step.
    fn max_task_steps(&self) -> u32 {
        1
    }
    /// How much longer a task's first step takes when its worker's stream was idle for `idle`
    /// before it (1: no longer; a factor on one step's [`task_time`](Self::task_time): a task of
    /// several steps is longer by `factor − 1` of one step).
    fn idle_factor(&self, idle: Duration) -> f64 {
        let _ = idle;
        1.0
    }
    /// The workers share one device: tasks running at once progress together as one batch of
    /// their summed rows would (E²bird's co-running workers: each at rate `t(b_w) / t(Σb)`).
    /// `false`: every worker's stream runs at full speed alone (a CPU worker on its own cores).
    fn shared_device(&self) -> bool {
        false
    }
    /// The CPU cores co-running workers share (the compute pool's threads); 0: each worker's
    /// stream runs at full speed whatever the others do.
    fn cores(&self) -> usize {
        0
    }
    /// The threads a task of `rows` rows of `cell` runs on (1 ..= [`cores`](Self::cores)).
    fn task_cores(&self, cell: &str, rows: usize) -> usize {
        let _ = (cell, rows);
        1
    }
}

/// [`CostModel::task_time`], or INVALID_ARGUMENT naming the cell type the model has no figure for.
pub(crate) fn time_of(cost: &dyn CostModel, cell: &str, rows: usize) -> Result<Duration> {
    cost.task_time(cell, rows)
        .ok_or_else(|| Error::invalid(format!("the cost model has no time for cell type `{cell}`")))
}

/// Most points one cell type may have, and most cell types in a file (files come from outside).
const MAX_POINTS: usize = 4096;
const MAX_CELLS: usize = 64;
/// Most cores a cost file may share among its workers (the runtime's thread limit).
const MAX_CORES: usize = crate::runtime::MAX_CPU_THREADS;
/// Largest size of a cost file read from disk.
pub const MAX_COST_FILE_BYTES: u64 = 16 << 20;

/// One cell type's measured times.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CellCost {
    pub cell: String,
    /// `[rows, microseconds]`, rows strictly ascending.
    pub points: Vec<(usize, f64)>,
    /// The engine thread's time to issue a task, `[rows, microseconds]` (see the module docs);
    /// empty: none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub issue: Vec<(usize, f64)>,
    /// The fewest rows of a task that runs on all the file's `cores` (see the module docs);
    /// absent: every task runs on one thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool_rows: Option<usize>,
}

/// A cost table (see the module docs).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct CostFile {
    pub name: String,
    #[serde(default)]
    pub source: String,
    #[serde(default)]
    pub backend: String,
    /// What was measured (kind, sizes), free-form.
    #[serde(default)]
    pub model: serde_json::Value,
    pub cells: Vec<CellCost>,
    #[serde(default)]
    pub launch_us: f64,
    #[serde(default)]
    pub report_us: f64,
    #[serde(default)]
    pub arrival_us: f64,
    #[serde(default)]
    pub delivery_us: f64,
    /// `[idle_us, factor]`, idle ascending (see the module docs); empty: no cold starts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub idle: Vec<(f64, f64)>,
    /// Steps one cell task may run on the measured backend (`Backend::max_task_steps`: the
    /// padding policy's batch of lstm sequences in one task); 1 when absent (one step per task,
    /// as the shipped GPU figures are).
    #[serde(default = "one_step")]
    pub max_task_steps: u32,
    /// The workers share one device ([`CostModel::shared_device`]); absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub shared_device: bool,
    /// CPU cores the workers share ([`CostModel::cores`]); absent: 0, not modelled.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cores: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn one_step() -> u32 {
    1
}

/// The cost files shipped with the crate: `(name, JSON)`.
const BUILTIN: &[(&str, &str)] = &[
    ("batchmaker-v100", include_str!("../../costs/batchmaker-v100.json")),
    ("e2bird-titanrtx-resnet50", include_str!("../../costs/e2bird-titanrtx-resnet50.json")),
    ("e2bird-titanrtx-resnet101", include_str!("../../costs/e2bird-titanrtx-resnet101.json")),
    ("e2bird-titanrtx-resnet152", include_str!("../../costs/e2bird-titanrtx-resnet152.json")),
    ("h200-lstm-h1024", include_str!("../../costs/h200-lstm-h1024.json")),
];

impl CostFile {
    /// Names of the shipped cost files.
    pub fn builtin_names() -> impl Iterator<Item = &'static str> {
        BUILTIN.iter().map(|(n, _)| *n)
    }

    /// A shipped cost file by name (the E²bird files also as `e2bird-res50|101|152`).
    pub fn builtin(name: &str) -> Option<CostFile> {
        let name = match name {
            "e2bird-res50" => "e2bird-titanrtx-resnet50",
            "e2bird-res101" => "e2bird-titanrtx-resnet101",
            "e2bird-res152" => "e2bird-titanrtx-resnet152",
            other => other,
        };
        BUILTIN.iter().find(|(n, _)| *n == name).map(|(_, json)| {
            CostFile::parse(json).unwrap_or_else(|e| panic!("shipped cost file `{name}` is invalid: {e}"))
        })
    }

    /// A shipped cost file by name, or else the file at that path.
    pub fn open(name_or_path: &str) -> Result<CostFile> {
        if let Some(c) = CostFile::builtin(name_or_path) {
            return Ok(c);
        }
        let path = Path::new(name_or_path);
        let text = crate::model::file::read_file(path, MAX_COST_FILE_BYTES).map_err(|e| {
            e.context(format!(
                "cost `{name_or_path}` (neither a shipped cost — {} — nor a readable file)",
                CostFile::builtin_names().collect::<Vec<_>>().join(", ")
            ))
        })?;
        let text = String::from_utf8(text)
            .map_err(|_| Error::format(format!("cost file {}: not UTF-8", path.display())))?;
        CostFile::parse(&text).map_err(|e| e.context(format!("cost file {}", path.display())))
    }

    /// Parse and check a cost file.
    pub fn parse(json: &str) -> Result<CostFile> {
        let c: CostFile = serde_json::from_str(json).map_err(|e| Error::format(format!("cost file: {e}")))?;
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::format(format!("cost file `{}`: {what}", self.name)));
        if self.cells.is_empty() || self.cells.len() > MAX_CELLS {
            return bad(format!("{} cell types; 1 to {MAX_CELLS} expected", self.cells.len()));
        }
        let delays = [
            ("launch_us", self.launch_us),
            ("report_us", self.report_us),
            ("arrival_us", self.arrival_us),
            ("delivery_us", self.delivery_us),
        ];
        for (k, v) in delays {
            if !v.is_finite() || v < 0.0 {
                return bad(format!("`{k}` is {v}; a finite time ≥ 0 expected"));
            }
        }
        if self.cores > MAX_CORES {
            return bad(format!("`cores` is {}; at most {MAX_CORES}", self.cores));
        }
        if self.cores > 0 && self.shared_device {
            return bad(
                "`cores` (CPU workers sharing cores) and `shared_device` (a GPU) exclude each other".into()
            );
        }
        if self.idle.len() > MAX_POINTS {
            return bad(format!("{} idle points; at most {MAX_POINTS}", self.idle.len()));
        }
        for (i, &(us, factor)) in self.idle.iter().enumerate() {
            let ascending = i == 0 || us > self.idle[i - 1].0;
            if !us.is_finite() || us < 0.0 || !factor.is_finite() || factor < 1.0 || !ascending {
                return bad(format!(
                    "idle point [{us}, {factor}]: idle times ascending and ≥ 0, factors finite and ≥ 1 expected"
                ));
            }
        }
        for c in &self.cells {
            if c.points.is_empty() || c.points.len() > MAX_POINTS {
                return bad(format!(
                    "cell `{}` has {} points; 1 to {MAX_POINTS} expected",
                    c.cell,
                    c.points.len()
                ));
            }
            for w in c.points.windows(2) {
                if w[1].0 <= w[0].0 {
                    return bad(format!(
                        "cell `{}`: rows {} then {}; strictly ascending expected",
                        c.cell, w[0].0, w[1].0
                    ));
                }
            }
            for &(rows, us) in &c.points {
                if rows == 0 || !us.is_finite() || us <= 0.0 {
                    return bad(format!(
                        "cell `{}`: point [{rows}, {us}]; rows ≥ 1 and a finite time > 0 expected",
                        c.cell
                    ));
                }
            }
            if c.pool_rows == Some(0) {
                return bad(format!("cell `{}`: `pool_rows` 0; at least 1 expected", c.cell));
            }
            if c.issue.len() > MAX_POINTS {
                return bad(format!(
                    "cell `{}` has {} issue points; at most {MAX_POINTS}",
                    c.cell,
                    c.issue.len()
                ));
            }
            for (i, &(rows, us)) in c.issue.iter().enumerate() {
                let ascending = i == 0 || rows > c.issue[i - 1].0;
                if rows == 0 || !us.is_finite() || us < 0.0 || !ascending {
                    return bad(format!(
                        "cell `{}`: issue point [{rows}, {us}]; rows ≥ 1 strictly ascending and a finite \
                         time ≥ 0 expected",
                        c.cell
                    ));
                }
            }
        }
        Ok(())
    }

    /// Microseconds for `rows` rows of `cell`: linear between the two points around `rows`,
    /// along the nearest segment beyond the ends (a single point scales in proportion to rows),
    /// never below the smallest measured time's share of one row.
    pub fn micros(&self, cell: &str, rows: usize) -> Option<f64> {
        let pts = &self.cells.iter().find(|c| c.cell == cell)?.points;
        let floor = pts[0].1 / pts[0].0 as f64;
        if pts.len() == 1 {
            return Some(pts[0].1 * rows as f64 / pts[0].0 as f64);
        }
        Some(along(pts, rows).max(floor))
    }

    /// Microseconds the engine thread spends issuing a task of `rows` rows of `cell`: linear
    /// between the `issue` points and flat beyond them (an issue is mostly fixed calls); 0
    /// without points.
    pub fn issue_micros(&self, cell: &str, rows: usize) -> f64 {
        let Some(pts) = self.cells.iter().find(|c| c.cell == cell).map(|c| &c.issue) else { return 0.0 };
        match pts[..] {
            [] => 0.0,
            [(_, us)] => us,
            _ if rows <= pts[0].0 => pts[0].1,
            _ if rows >= pts[pts.len() - 1].0 => pts[pts.len() - 1].1,
            _ => along(pts, rows).max(0.0),
        }
    }
}

/// The value at `rows` on the line through the two points around it (the nearest segment
/// beyond the ends); `pts` has at least two points, rows strictly ascending.
fn along(pts: &[(usize, f64)], rows: usize) -> f64 {
    let i = pts.partition_point(|p| p.0 < rows).clamp(1, pts.len() - 1);
    let ((x0, y0), (x1, y1)) = (pts[i - 1], pts[i]);
    let (x, x0, x1) = (rows as f64, x0 as f64, x1 as f64);
    y0 + (y1 - y0) * (x - x0) / (x1 - x0)
}

fn micros(us: f64) -> Duration {
    Duration::from_nanos((us * 1e3).round() as u64)
}

impl CostModel for CostFile {
    fn task_time(&self, cell: &str, rows: usize) -> Option<Duration> {
        self.micros(cell, rows).map(micros)
    }
    fn issue_time(&self, cell: &str, rows: usize) -> Duration {
        micros(self.issue_micros(cell, rows))
    }
    fn shared_device(&self) -> bool {
        self.shared_device
    }
    fn cores(&self) -> usize {
        self.cores
    }
    fn task_cores(&self, cell: &str, rows: usize) -> usize {
        let pool_rows = self.cells.iter().find(|c| c.cell == cell).and_then(|c| c.pool_rows);
        if self.cores > 1 && pool_rows.is_some_and(|p| rows >= p) { self.cores } else { 1 }
    }
    fn max_task_steps(&self) -> u32 {
        self.max_task_steps.max(1)
    }
    fn launch_delay(&self) -> Duration {
        micros(self.launch_us)
    }
    fn report_delay(&self) -> Duration {
        micros(self.report_us)
    }
    fn arrival_delay(&self) -> Duration {
        micros(self.arrival_us)
    }
    fn delivery_delay(&self) -> Duration {
        micros(self.delivery_us)
    }
    fn idle_factor(&self, idle: Duration) -> f64 {
        let x = idle.as_secs_f64() * 1e6;
        let Some(&(last_us, last)) = self.idle.last() else { return 1.0 };
        if x >= last_us {
            return last;
        }
        // From (0, 1) through the points.
        let mut prev = (0.0, 1.0);
        for &(us, f) in &self.idle {
            if x < us {
                return prev.1 + (f - prev.1) * (x - prev.0) / (us - prev.0);
            }
            prev = (us, f);
        }
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batchmaker_v100_matches_the_paper_and_is_linear_between() {
        let c = CostFile::builtin("batchmaker-v100").unwrap();
        assert_eq!(c.micros("step", 64), Some(185.0));
        assert_eq!(c.micros("step", 512), Some(784.0));
        let mid = c.micros("step", 288).unwrap();
        assert!((mid - (185.0 + 784.0) / 2.0).abs() < 1e-9, "{mid}");
        // Below 64 rows the same line goes on (toward its intercept).
        let one = c.micros("step", 1).unwrap();
        assert!(one > 90.0 && one < 185.0, "{one}");
        assert_eq!(c.micros("decoder", 1), None);
    }

    #[test]
    fn bad_files_are_format_errors_naming_the_problem() {
        let e =
            CostFile::parse(r#"{"name":"x","cells":[{"cell":"a","points":[[4,1.0],[2,2.0]]}]}"#).unwrap_err();
        assert_eq!(e.code(), crate::Code::Format);
        assert!(e.message().contains("ascending"), "{e}");
        let e = CostFile::parse(r#"{"name":"x","cells":[{"cell":"a","points":[[4,-1.0]]}]}"#).unwrap_err();
        assert!(e.message().contains("[4, -1]"), "{e}");
        let e = CostFile::parse(r#"{"name":"x","cells":[]}"#).unwrap_err();
        assert!(e.message().contains("0 cell types"), "{e}");
        assert!(CostFile::open("no-such-cost").unwrap_err().message().contains("batchmaker-v100"));
    }

    #[test]
    fn one_point_scales_in_proportion() {
        let c = CostFile::parse(r#"{"name":"x","cells":[{"cell":"a","points":[[10,100.0]]}]}"#).unwrap();
        assert_eq!(c.micros("a", 20), Some(200.0));
        assert_eq!(c.task_time("a", 1), Some(Duration::from_micros(10)));
    }

    #[test]
    fn issue_points_interpolate_inside_and_stay_flat_beyond() {
        let c = CostFile::parse(
            r#"{"name":"x","cells":[{"cell":"a","points":[[1,10.0]],"issue":[[2,40.0],[10,60.0]]},
                                     {"cell":"b","points":[[1,10.0]]}]}"#,
        )
        .unwrap();
        assert_eq!(c.issue_micros("a", 1), 40.0);
        assert_eq!(c.issue_micros("a", 6), 50.0);
        assert_eq!(c.issue_micros("a", 500), 60.0);
        assert_eq!(c.issue_time("a", 6), Duration::from_micros(50));
        assert_eq!(c.issue_micros("b", 6), 0.0, "no issue points: no issue time");
        assert_eq!(c.issue_micros("zz", 6), 0.0);
        for bad in [r#"[[2,1.0],[2,3.0]]"#, r#"[[0,1.0]]"#, r#"[[1,-1.0]]"#] {
            let text =
                format!(r#"{{"name":"x","cells":[{{"cell":"a","points":[[1,10.0]],"issue":{bad}}}]}}"#);
            let e = CostFile::parse(&text).unwrap_err();
            assert_eq!(e.code(), crate::Code::Format, "{bad}");
            assert!(e.message().contains("issue point"), "{bad}: {e}");
        }
        // Written only when there are points: older readers see the files they know.
        let plain = CostFile::builtin("batchmaker-v100").unwrap();
        assert!(!serde_json::to_string(&plain).unwrap().contains("issue"));
    }

    #[test]
    fn idle_points_must_ascend_with_factors_of_at_least_one() {
        let file = |idle: &str| {
            format!(r#"{{"name":"t","cells":[{{"cell":"step","points":[[1,1.0]]}}],"idle":{idle}}}"#)
        };
        assert!(CostFile::parse(&file("[[100.0,1.2],[300.0,1.5]]")).is_ok());
        for bad in ["[[300.0,1.2],[100.0,1.5]]", "[[100.0,0.5]]", "[[-1.0,1.2]]"] {
            let e = CostFile::parse(&file(bad)).unwrap_err();
            assert_eq!(e.code(), crate::error::Code::Format, "{bad}");
            assert!(e.message().contains("idle point"), "{bad}: {e}");
        }
    }
}
