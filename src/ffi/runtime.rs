//! `serve_runtime`, its options builder, and `serve_stats` snapshots.

use std::ffi::c_char;
use std::time::Duration;

use crate::backend::{BackendChoice, BackendKind};
use crate::error::{Code, Error};
use crate::ffi::error::serve_error;
use crate::ffi::{arg, arg_mut, free_handle, into_handle, out_arg, str_arg, write_out};
use crate::ffi_boundary;
use crate::runtime::{Runtime, RuntimeBuilder, StatsSnapshot, check};

/// Options for `serve_runtime_new`: an opaque builder. Not thread-safe while being set; a
/// `const serve_runtime_options *` may be shared.
pub struct serve_runtime_options {
    builder: RuntimeBuilder,
}

/// A runtime: backend, engine and poller threads, loaded models. Thread-safe: every function
/// taking a `const serve_runtime *` may be called from any thread concurrently.
pub struct serve_runtime {
    pub(crate) rt: Runtime,
}

/// A snapshot of a runtime's counters, taken by `serve_runtime_stats`. Immutable.
pub struct serve_stats {
    s: StatsSnapshot,
}

/// Create runtime options with the defaults: backend "auto", one CPU thread per core, admission
/// bound 4096 requests per model, stall timeout 30 s.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_options_new(out: *mut *mut serve_runtime_options) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        // SAFETY: checked non-NULL; caller provides writable storage.
        unsafe { write_out(out, into_handle(serve_runtime_options { builder: Runtime::builder() })) };
        Ok(())
    }
}

/// Free runtime options. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_options_free(options: *mut serve_runtime_options) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_runtime_options_new.
        unsafe { free_handle(options) }
    }
}

/// Choose the backend: "auto" (CUDA when usable, else CPU), "cpu" or "cuda".
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_options_set_backend(
    options: *mut serve_runtime_options,
    backend: *const c_char,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: pointers checked for NULL; validity is the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        let name = unsafe { str_arg(backend, "backend") }?;
        let choice = BackendChoice::parse(name)
            .ok_or_else(|| Error::invalid(format!("unknown backend `{name}` (expected auto, cpu or cuda)")))?;
        o.builder = o.builder.clone().backend(choice);
        Ok(())
    }
}

/// Compute threads of the CPU backend, at most 1024; 0 = one per core.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_options_set_cpu_threads(
    options: *mut serve_runtime_options,
    threads: u32,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        check::cpu_threads(threads as usize)?;
        o.builder = o.builder.clone().cpu_threads(threads as usize);
        Ok(())
    }
}

/// Default admission bound of each model: how many of its requests may be accepted and not yet
/// finished with — completed and their completion freed (`serve_completion_free`) — before
/// submit answers `SERVE_CODE_BUSY`. Completions left in a queue count, so the memory a model's
/// requests hold stays bounded however slowly the queue is drained. Must be at least 1.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_options_set_admission_bound(
    options: *mut serve_runtime_options,
    bound: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        let bound = usize::try_from(bound).unwrap_or(usize::MAX);
        check::admission_bound(bound)?;
        o.builder = o.builder.clone().admission_bound(bound);
        Ok(())
    }
}

/// The stall watchdog's limit, in nanoseconds: a worker whose oldest task has not completed
/// after this long is declared stalled — the requests of its pending tasks complete
/// `SERVE_CODE_BACKEND` at once, nothing more is launched on it, and it serves again once its
/// stream catches up. 0 turns the watchdog off (a stalled stream then holds its requests until
/// shutdown). Default 30 s; pick a limit well above the longest task a model runs.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_options_set_stall_timeout_ns(
    options: *mut serve_runtime_options,
    timeout_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        let limit = (timeout_ns > 0).then(|| Duration::from_nanos(timeout_ns));
        o.builder = o.builder.clone().stall_timeout(limit);
        Ok(())
    }
}

/// Start a runtime. `options` may be NULL for the defaults; it is only read, and may be freed
/// once this returns. On success `*out` owns the runtime (free it with `serve_runtime_free`).
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_new(
    options: *const serve_runtime_options,
    out: *mut *mut serve_runtime,
) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live options handle (contract).
        let builder = unsafe { options.as_ref() }.map_or_else(Runtime::builder, |o| o.builder.clone());
        let rt = builder.build()?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_runtime { rt })) };
        Ok(())
    }
}

/// Shut down (with no drain: pending requests complete `SERVE_CODE_CANCELLED` into their
/// queues), then free the runtime. Models loaded from it stay valid handles but refuse new
/// requests with `SERVE_CODE_SHUTDOWN`. NULL is allowed. Must not be called while another thread
/// is still using the runtime.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_free(runtime: *mut serve_runtime) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_runtime_new.
        unsafe { free_handle(runtime) }
    }
}

/// Stop accepting requests (submit then fails with `SERVE_CODE_SHUTDOWN`), let pending requests
/// finish for up to `drain_timeout_ns` nanoseconds, complete whatever is left with
/// `SERVE_CODE_CANCELLED`, and stop the runtime's threads. Blocks until done. Idempotent.
/// `UINT64_MAX` drains without a time limit.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_shutdown(
    runtime: *const serve_runtime,
    drain_timeout_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        let drain = if drain_timeout_ns == u64::MAX { Duration::MAX } else { Duration::from_nanos(drain_timeout_ns) };
        r.rt.shutdown(drain);
        Ok(())
    }
}

/// Ask for request `request_id` to be cancelled. A queued request completes
/// `SERVE_CODE_CANCELLED` promptly; a running one at its next boundary (the next cell step for
/// sequence models — under the padding policy on the CPU, the end of the task that runs its
/// batch's steps; the end of its batched task for fixed-shape models such as `mlp`, whose task is
/// one forward pass); one that has already completed is unaffected (its completion stands). Fails with
/// `SERVE_CODE_INVALID_ARGUMENT` for an id this runtime never issued, and with `SERVE_CODE_BUSY` while
/// 65,536 cancels are already waiting for the engine (the engine's queue stays bounded however fast a
/// caller cancels; retry later).
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_cancel(runtime: *const serve_runtime, request_id: u64) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        r.rt.cancel(request_id)
    }
}

/// The backend in use: "cpu" or "cuda" (static storage). "" if `runtime` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_backend(runtime: *const serve_runtime) -> *const c_char {
    ffi_boundary! {
        // SAFETY: NULL or a live runtime (contract).
        match unsafe { runtime.as_ref() }.map(|r| r.rt.backend_kind()) {
            Some(BackendKind::Cpu) => c"cpu".as_ptr(),
            Some(BackendKind::Cuda) => c"cuda".as_ptr(),
            None => c"".as_ptr(),
        }
    }
}

/// Take a snapshot of the runtime's counters; free it with `serve_stats_free`.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_stats(
    runtime: *const serve_runtime,
    out: *mut *mut serve_stats,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        out_arg(out, "out")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_stats { s: r.rt.stats() })) };
        Ok(())
    }
}

/// Free a stats snapshot. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_free(stats: *mut serve_stats) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_runtime_stats.
        unsafe { free_handle(stats) }
    }
}

fn stat(stats: *const serve_stats, f: impl FnOnce(&StatsSnapshot) -> u64) -> u64 {
    // SAFETY: NULL or a live snapshot (contract).
    unsafe { stats.as_ref() }.map_or(0, |s| f(&s.s))
}

/// Requests accepted by submit. 0 if `stats` is NULL (as for every `serve_stats_*` getter).
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_submitted(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.submitted) }
}

/// Submits refused synchronously (invalid input, busy, shut down, deadline already passed).
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_rejected(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.rejected) }
}

/// Requests completed with `code` (a `serve_code` value); 0 for an unknown code.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_completed(stats: *const serve_stats, code: u32) -> u64 {
    ffi_boundary! { stat(stats, |s| Code::from_u32(code).map_or(0, |c| s.completed(c))) }
}

/// Requests completed, whatever their code.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_completed_total(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.completed_total()) }
}

/// Requests in a scheduler not yet started (no part of them launched on the backend).
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_queued(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.queued) }
}

/// Requests started on the backend and not yet complete (a recurrent request counts from its
/// first cell to its completion).
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_running(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.running) }
}

/// Requests accepted and not yet completed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_in_flight(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.in_flight()) }
}

/// Batched tasks launched on the backend.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_tasks_launched(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.tasks_launched) }
}

/// Requests carried by launched tasks (padding excluded); divided by the task count it is the
/// mean formed batch size.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_batched_requests(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.batched_requests) }
}

/// Fixed-shape inputs copied into their model's input ring at arrival (`SERVE_POLICY_ELASTIC`:
/// one per accepted request), read in place by their task.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_ring_copies(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.ring_copies) }
}

/// Rows copied into a batch's input at launch (every fixed-shape policy but
/// `SERVE_POLICY_ELASTIC`, which gathers only a run holding a cancelled request's slot).
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_gather_copies(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.gather_copies) }
}

/// Nanoseconds the engine thread spent working (handling events, deciding, launching tasks —
/// on the CUDA backend the launch calls themselves — and delivering completions); it is parked
/// the rest of the time. Its growth over an interval of wall-clock time is the thread's
/// utilization: near 1, the engine thread is the runtime's bottleneck.
#[unsafe(no_mangle)]
pub extern "C" fn serve_stats_engine_busy_ns(stats: *const serve_stats) -> u64 {
    ffi_boundary! { stat(stats, |s| s.engine_busy_ns) }
}
