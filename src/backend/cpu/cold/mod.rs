//! DeepPlan's cold-start executor on the CPU backend (ARCHITECTURE.md §7.10): the coordination
//! a GPU executor does with streams and events, run on threads so that it is tested here.
//!
//! A cold run of a [`LayerProgram`] under a [`ColdPlan`]:
//!
//! * a **device arena** holds one buffer per loaded layer, poisoned with NaN until its copy
//!   lands (so a layer that runs before its parameters arrive shows in the output);
//! * a **launcher** thread issues, partition by partition, each loaded layer's copy on a load
//!   stream and then records the layer's event `E_i` after it. Partition 1 goes host → arena on
//!   the primary's load stream; partition `p ≥ 2` goes host → a staging buffer on secondary
//!   `p`'s load stream (recording `H_i`), and its migration stream waits on `H_i`, copies staging
//!   → arena and records `E_i` — forwarded layer by layer. Copies are throttled to a bandwidth,
//!   so execution really runs ahead of them;
//! * the **execution** (the calling thread) runs the layers in order: before a loaded layer it
//!   waits on `E_i`; a DHA layer reads its parameters from host memory through a line counter;
//!   a parameter-free layer just runs.
//!
//! **The hazard.** A wait on an event whose record has not been issued yet returns at once
//! (CUDA's semantics, reproduced by [`events`]). The execution may reach layer `i` before the
//! launcher has issued `E_i`'s record, so before waiting it blocks until the record is issued
//! (the artifact's guard). [`ColdOptions::unguarded`] removes the guard for the test that shows
//! the poison reaching the output without it.
//!
//! DHA layers stay on the host: the arena holds the load set only ([`ColdRun::device_values`]).

pub mod events;
pub mod profile;
pub mod program;

#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use events::{Event, Stream};
use program::{HostView, LayerProgram, Params, lines_spanned};

use crate::error::{Code, Error, Result};
use crate::plan::deepplan::planner::Method;
use crate::plan::deepplan::{ColdPlan, Partition};

/// How a cold run moves bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct ColdOptions {
    /// Host → device copy rate of each load stream, bytes/s (∞: unthrottled).
    pub h2d_bytes_per_s: f64,
    /// Staging → arena forward rate of each migration stream, bytes/s (∞: unthrottled).
    pub forward_bytes_per_s: f64,
    /// The rate of direct host reads, bytes/s (∞: free): after a DHA layer runs, the execution
    /// waits out the time its counted lines take on such a bus (an emulated zero-copy bus).
    pub dha_bytes_per_s: f64,
    /// The launcher pauses this long before issuing each layer (tests: a launcher that falls
    /// behind the execution).
    pub issue_delay: Duration,
    /// Skip the record-before-wait guard. Only for the test that shows what it prevents.
    pub unguarded: bool,
}

impl ColdOptions {
    /// Every rate positive (∞ allowed), else INVALID_ARGUMENT.
    pub fn check(&self) -> Result<()> {
        for (k, v) in [
            ("h2d_bytes_per_s", self.h2d_bytes_per_s),
            ("forward_bytes_per_s", self.forward_bytes_per_s),
            ("dha_bytes_per_s", self.dha_bytes_per_s),
        ] {
            if v.is_nan() || v <= 0.0 {
                return Err(Error::invalid(format!(
                    "cold-start option `{k}` is {v}; a positive rate expected"
                )));
            }
        }
        Ok(())
    }
}

impl Default for ColdOptions {
    fn default() -> Self {
        ColdOptions {
            h2d_bytes_per_s: f64::INFINITY,
            forward_bytes_per_s: f64::INFINITY,
            dha_bytes_per_s: f64::INFINITY,
            issue_delay: Duration::ZERO,
            unguarded: false,
        }
    }
}

/// What a cold run did.
#[derive(Clone, Debug, PartialEq)]
pub struct ColdRun {
    pub output: Vec<f32>,
    /// 64-byte lines read from host memory by DHA layers.
    pub dha_lines: u64,
    /// 64-byte lines copied host → device by the load streams.
    pub load_lines: u64,
    /// Values the arena holds (the loaded layers' parameters: DHA layers stay on the host).
    pub device_values: usize,
    /// Loaded layers whose parameters had not landed when the execution reached them (it
    /// waited).
    pub waited: usize,
}

type Buffer = Arc<RwLock<Vec<f32>>>;

/// An instance's parameters in the device arena once its cold run has landed them (one buffer
/// per loaded layer): what keeps it warm. Cheap to clone (the buffers are shared).
#[derive(Clone, Debug, Default)]
pub struct Resident {
    buffers: Vec<Option<Buffer>>,
}

impl Resident {
    /// Values held (the load set).
    pub fn values(&self) -> usize {
        self.buffers.iter().flatten().map(|b| b.read().unwrap_or_else(PoisonError::into_inner).len()).sum()
    }
}

/// Waits out the emulated bus time of `lines` direct host reads.
fn bus_time(lines: u64, rate: f64) {
    if lines > 0 && rate.is_finite() && rate > 0.0 {
        let secs = lines as f64 * program::LINE_BYTES as f64 / rate;
        std::thread::sleep(Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX));
    }
}

/// Runs layer `i` on `x` into `y` with its parameters from `device` (the arena, or any copy
/// standing for device memory) or, with none, from the host: a parameter-free layer as it is, a
/// DHA layer through the line counter `lines` and then its bus time at `dha_rate` (∞: none).
fn run_layer(
    program: &dyn LayerProgram,
    i: usize,
    device: Option<&[f32]>,
    lines: &AtomicU64,
    dha_rate: f64,
    x: &[f32],
    y: &mut Vec<f32>,
) {
    let host = program.host_params(i);
    match device {
        Some(d) => program.run(i, &Params::Device(d), x, y),
        None if host.is_empty() => program.run(i, &Params::None, x, y),
        None => {
            let before = lines.load(Ordering::Relaxed);
            program.run(i, &Params::Host(HostView::new(host, lines)), x, y);
            bus_time(lines.load(Ordering::Relaxed) - before, dha_rate);
        }
    }
}

/// Runs `program` warm from `resident` (its cold run's arena): loaded layers from the arena, DHA
/// layers from the host as before (bus time included).
pub fn run_resident(
    program: &dyn LayerProgram,
    plan: &[Method],
    resident: &Resident,
    input: &[f32],
    options: &ColdOptions,
) -> Result<Vec<f32>> {
    check_plan(program, plan)?;
    if resident.buffers.len() != plan.len() {
        return Err(Error::invalid("the resident arena is not of this model"));
    }
    let lines = AtomicU64::new(0);
    let mut x = input.to_vec();
    let mut y = vec![];
    for (i, buffer) in resident.buffers.iter().enumerate() {
        let params = buffer.as_ref().map(|b| b.read().unwrap_or_else(PoisonError::into_inner));
        run_layer(
            program,
            i,
            params.as_deref().map(Vec::as_slice),
            &lines,
            options.dha_bytes_per_s,
            &x,
            &mut y,
        );
        std::mem::swap(&mut x, &mut y);
    }
    Ok(x)
}

fn poisoned(len: usize) -> Buffer {
    Arc::new(RwLock::new(vec![f32::NAN; len]))
}

/// Copies `src` into `dst` taking at least `bytes / rate`.
fn throttled_copy(src: &[f32], dst: &RwLock<Vec<f32>>, rate: f64) {
    let bytes = std::mem::size_of_val(src) as f64;
    if rate.is_finite() && rate > 0.0 {
        std::thread::sleep(Duration::try_from_secs_f64(bytes / rate).unwrap_or(Duration::MAX));
    }
    dst.write().unwrap_or_else(PoisonError::into_inner).copy_from_slice(src);
}

/// Runs `program` warm: every loaded layer's parameters already in device memory, DHA layers
/// still read from the host (DeepPlan keeps them there). The reference of a cold run's output.
pub fn run_warm(program: &dyn LayerProgram, plan: &[Method], input: &[f32]) -> Result<Vec<f32>> {
    check_plan(program, plan)?;
    let lines = AtomicU64::new(0);
    let mut x = input.to_vec();
    let mut y = vec![];
    for (i, &m) in plan.iter().enumerate() {
        let host = program.host_params(i);
        let device = (m == Method::Load && !host.is_empty()).then_some(host);
        run_layer(program, i, device, &lines, f64::INFINITY, &x, &mut y);
        std::mem::swap(&mut x, &mut y);
    }
    Ok(x)
}

/// A plan of one method per layer of `program`, else INVALID_ARGUMENT.
pub fn check_plan(program: &dyn LayerProgram, plan: &[Method]) -> Result<()> {
    if plan.len() != program.layers() {
        return Err(Error::invalid(format!(
            "a plan of {} layers for a model of {}",
            plan.len(),
            program.layers()
        )));
    }
    Ok(())
}

/// Runs `program` cold under `plan` (module docs); returns what it did and the arena it filled
/// (the instance, now warm).
pub fn run_cold(
    program: &dyn LayerProgram,
    plan: &ColdPlan,
    input: &[f32],
    options: &ColdOptions,
) -> Result<(ColdRun, Resident)> {
    let methods = &plan.plan;
    check_plan(program, methods)?;
    options.check()?;
    let n = methods.len();
    let loaded = |i: usize| methods[i] == Method::Load && !program.host_params(i).is_empty();
    for (p, part) in plan.partitions.iter().enumerate() {
        if let Some(&i) = part.layers.iter().find(|&&i| i >= n || !loaded(i)) {
            return Err(Error::invalid(format!(
                "partition {} lists layer {i}, which the plan does not load",
                p + 1
            )));
        }
    }
    let mut listed = vec![false; n];
    for &i in plan.partitions.iter().flat_map(|p| &p.layers) {
        if std::mem::replace(&mut listed[i], true) {
            return Err(Error::invalid(format!("layer {i} is in the partitions twice")));
        }
    }
    if let Some(i) = (0..n).find(|&i| loaded(i) && !listed[i]) {
        return Err(Error::invalid(format!("the plan loads layer {i} but no partition carries it")));
    }
    let arena: Vec<Option<Buffer>> =
        (0..n).map(|i| loaded(i).then(|| poisoned(program.host_params(i).len()))).collect();
    let device_values = (0..n).filter(|&i| loaded(i)).map(|i| program.host_params(i).len()).sum();
    let landed: Vec<Event> = (0..n).map(|_| Event::new()).collect();
    let dha_lines = AtomicU64::new(0);
    let load_lines = AtomicU64::new(0);
    let copy_failed = AtomicBool::new(false);
    let mut waited = 0;

    let output = std::thread::scope(|scope| -> Result<Vec<f32>> {
        let spawn = |name: &str| {
            Stream::spawn(scope, name)
                .map_err(|e| Error::internal(format!("cannot start a copy stream: {e}")))
        };
        // Per partition: its load stream; from the second on, a migration stream too.
        let mut streams = vec![];
        for p in 0..plan.partitions.len() {
            let load = spawn(&format!("load{p}"))?;
            let migrate = if p == 0 { None } else { Some(spawn(&format!("migrate{p}"))?) };
            streams.push((load, migrate));
        }
        let (arena, landed, load_lines, copy_failed) = (&arena, &landed, &load_lines, &copy_failed);
        let launcher = std::thread::Builder::new()
            .name("serve-cold-launch".into())
            .spawn_scoped(scope, move || {
                // Whatever happens to the launcher, no event stays waited for in vain.
                let _abandon = Abandon(landed);
                let copies = Copies { arena, landed, load_lines, failed: copy_failed };
                launch(program, &plan.partitions, streams, &copies, options);
            })
            .map_err(|e| Error::internal(format!("cannot start the load launcher: {e}")))?;

        let mut x = input.to_vec();
        let mut y = vec![];
        let mut failed = None;
        for (i, &m) in methods.iter().enumerate() {
            if let Some(buffer) = &arena[i] {
                let event = &landed[i];
                // Never wait on an event not yet recorded: block until the launcher issues it.
                if !options.unguarded && !event.wait_recorded() {
                    failed =
                        Some(Error::new(Code::Backend, format!("the copy of layer {i} was never issued")));
                    break;
                }
                if !event.is_completed() {
                    waited += 1;
                }
                event.synchronize();
                let params = buffer.read().unwrap_or_else(PoisonError::into_inner);
                run_layer(program, i, Some(&params), &dha_lines, options.dha_bytes_per_s, &x, &mut y);
            } else {
                debug_assert!(m == Method::Dha || program.host_params(i).is_empty());
                run_layer(program, i, None, &dha_lines, options.dha_bytes_per_s, &x, &mut y);
            }
            std::mem::swap(&mut x, &mut y);
        }
        launcher.join().map_err(|_| Error::internal("the load launcher panicked"))?;
        if copy_failed.load(Ordering::Acquire) {
            return Err(Error::new(Code::Backend, "a layer's copy failed; its parameters never landed"));
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(x),
        }
    })?;
    let run = ColdRun {
        output,
        dha_lines: dha_lines.load(Ordering::Relaxed),
        load_lines: load_lines.load(Ordering::Relaxed),
        device_values,
        waited,
    };
    Ok((run, Resident { buffers: arena }))
}

/// Marks the events the launcher never issued as abandoned when it ends, normally or not.
struct Abandon<'a>(&'a [Event]);

impl Drop for Abandon<'_> {
    fn drop(&mut self) {
        for e in self.0 {
            e.abandon();
        }
    }
}

/// Where a run's copies land and what they count.
struct Copies<'a> {
    arena: &'a [Option<Buffer>],
    landed: &'a [Event],
    load_lines: &'a AtomicU64,
    /// Set by a copy that failed (its buffer keeps its poison).
    failed: &'a AtomicBool,
}

/// A copy that records its failure instead of passing for done.
fn guarded_copy(src: &[f32], dst: &RwLock<Vec<f32>>, rate: f64, failed: &AtomicBool) {
    let ok =
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| throttled_copy(src, dst, rate))).is_ok();
    if !ok {
        failed.store(true, Ordering::Release);
    }
}

/// The launcher: issues every partition's copies and records (module docs). Dropping the
/// streams at the end lets their threads finish and be joined by the scope.
fn launch<'scope>(
    program: &'scope dyn LayerProgram,
    partitions: &'scope [Partition],
    streams: Vec<(Stream<'scope>, Option<Stream<'scope>>)>,
    c: &Copies<'scope>,
    options: &'scope ColdOptions,
) {
    let (arena, landed, load_lines, failed) = (c.arena, c.landed, c.load_lines, c.failed);
    let (h2d, forward) = (options.h2d_bytes_per_s, options.forward_bytes_per_s);
    for (part, (load, migrate)) in partitions.iter().zip(&streams) {
        for &i in &part.layers {
            if !options.issue_delay.is_zero() {
                std::thread::sleep(options.issue_delay);
            }
            let host = program.host_params(i);
            let dst = Arc::clone(arena[i].as_ref().expect("a loaded layer has a buffer"));
            let count = move || {
                load_lines.fetch_add(lines_spanned(0, std::mem::size_of_val(host)), Ordering::Relaxed);
            };
            match migrate {
                None => {
                    load.enqueue(move || {
                        count();
                        guarded_copy(host, &dst, h2d, failed);
                    });
                    load.record(&landed[i]);
                }
                Some(migrate) => {
                    // Host → the secondary's staging buffer, then forwarded to the arena.
                    let staging = poisoned(host.len());
                    let on_secondary = Event::new();
                    let s = Arc::clone(&staging);
                    load.enqueue(move || {
                        count();
                        guarded_copy(host, &s, h2d, failed);
                    });
                    load.record(&on_secondary);
                    migrate.wait(&on_secondary);
                    migrate.enqueue(move || {
                        let src = staging.read().unwrap_or_else(PoisonError::into_inner);
                        guarded_copy(&src, &dst, forward, failed);
                    });
                    migrate.record(&landed[i]);
                }
            }
        }
    }
    drop(streams);
}
