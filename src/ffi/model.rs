//! `serve_model` and its options builder.

use std::ffi::c_char;
use std::path::Path;
use std::time::Duration;

use crate::TimeoutConfig;
use crate::error::Error;
use crate::ffi::error::serve_error;
use crate::ffi::runtime::serve_runtime;
use crate::ffi::{arg, arg_mut, free_handle, into_handle, out_arg, str_arg, write_out};
use crate::ffi_boundary;
use crate::model::Network;
use crate::runtime::{Model, ModelOptions, PolicyConfig, check};

/// Options for `serve_runtime_load_model`: an opaque builder. Not thread-safe while being set; a
/// `const serve_model_options *` may be shared.
pub struct serve_model_options {
    opts: ModelOptions,
}

/// A model loaded into a runtime. Thread-safe: submit to it from any number of threads. Valid
/// until freed, even after its runtime is freed (submits then fail with `SERVE_CODE_SHUTDOWN`).
pub struct serve_model {
    pub(crate) model: Model,
}

/// Create model options with the defaults: timeout batching with max batch 32, max wait 0 (take
/// whatever is queued as soon as a worker is idle), 1 worker, no padding, the runtime's admission
/// bound, name = the directory's name.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_new(out: *mut *mut serve_model_options) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_model_options { opts: ModelOptions::default() })) };
        Ok(())
    }
}

/// Free model options. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_free(options: *mut serve_model_options) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_model_options_new.
        unsafe { free_handle(options) }
    }
}

fn set(
    options: *mut serve_model_options,
    f: impl FnOnce(&mut ModelOptions) -> crate::Result<()>,
) -> crate::Result<()> {
    // SAFETY: checked for NULL; validity and exclusivity are the caller's contract.
    f(&mut unsafe { arg_mut(options, "options") }?.opts)
}

/// Set a field of the timeout-batching policy.
fn set_timeout(
    options: *mut serve_model_options,
    f: impl FnOnce(&mut TimeoutConfig) -> crate::Result<()>,
) -> crate::Result<()> {
    set(options, |o| {
        let PolicyConfig::Timeout(c) = &mut o.policy;
        f(c)
    })
}

/// Maximum requests per batched task (the `s` of timeout batching); 1 to 65536.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_max_batch(
    options: *mut serve_model_options,
    max_batch: u32,
) -> *mut serve_error {
    ffi_boundary! {
        set_timeout(options, |c| {
            check::max_batch(max_batch as usize)?;
            c.max_batch = max_batch as usize;
            Ok(())
        })
    }
}

/// Longest time, in nanoseconds, the oldest queued request waits for a fuller batch (the `t` of
/// timeout batching). 0 = no waiting: a batch starts as soon as a worker is idle.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_max_wait_ns(
    options: *mut serve_model_options,
    max_wait_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        set_timeout(options, |c| {
            c.max_wait = Duration::from_nanos(max_wait_ns);
            Ok(())
        })
    }
}

/// Number of workers (backend streams) executing this model's tasks concurrently; 1 to 256.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_workers(
    options: *mut serve_model_options,
    workers: u32,
) -> *mut serve_error {
    ffi_boundary! {
        set_timeout(options, |c| {
            check::workers(workers as usize)?;
            c.workers = workers as usize;
            Ok(())
        })
    }
}

/// Static batching: every task computes `max_batch` rows, padding the missing ones.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_pad_to_max(
    options: *mut serve_model_options,
    pad: bool,
) -> *mut serve_error {
    ffi_boundary! {
        set_timeout(options, |c| {
            c.pad_to_max = pad;
            Ok(())
        })
    }
}

/// This model's admission bound (overrides the runtime's); at least 1.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_admission_bound(
    options: *mut serve_model_options,
    bound: u64,
) -> *mut serve_error {
    ffi_boundary! {
        set(options, |o| {
            let bound = usize::try_from(bound).unwrap_or(usize::MAX);
            check::admission_bound(bound)?;
            o.admission_bound = Some(bound);
            Ok(())
        })
    }
}

/// The model's name in messages (copied).
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_name(
    options: *mut serve_model_options,
    name: *const c_char,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: NULL-checked string (contract: NUL-terminated).
        let name = unsafe { str_arg(name, "name") }?.to_string();
        set(options, |o| {
            o.name = Some(name);
            Ok(())
        })
    }
}

/// Load the model directory `dir` (model.toml + weights.safetensors) into `runtime`. `options`
/// may be NULL for the defaults. Errors: `SERVE_CODE_NOT_FOUND` (no such directory or file),
/// `SERVE_CODE_FORMAT` (bad model.toml; missing, extra or misshaped tensor; non-f32 dtype;
/// truncated file; unknown kind), `SERVE_CODE_SHUTDOWN`. On success `*out` owns the model.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_load_model(
    runtime: *const serve_runtime,
    dir: *const c_char,
    options: *const serve_model_options,
    out: *mut *mut serve_model,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: pointers NULL-checked; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        let dir = unsafe { path_arg(dir) }?;
        out_arg(out, "out")?;
        // SAFETY: NULL or a live options handle.
        let opts = unsafe { options.as_ref() }.map(|o| o.opts.clone()).unwrap_or_default();
        let model = r.rt.load_model(dir, opts)?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_model { model })) };
        Ok(())
    }
}

/// A path argument: any bytes on Unix, UTF-8 elsewhere.
unsafe fn path_arg<'a>(p: *const c_char) -> crate::Result<&'a Path> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        if p.is_null() {
            return Err(Error::invalid("`dir` is NULL"));
        }
        // SAFETY: non-NULL, NUL-terminated by contract.
        let bytes = unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes();
        Ok(Path::new(std::ffi::OsStr::from_bytes(bytes)))
    }
    #[cfg(not(unix))]
    {
        // SAFETY: forwarded contract.
        Ok(Path::new(unsafe { str_arg(p, "dir") }?))
    }
}

/// Release a model handle. Requests already submitted still complete. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_free(model: *mut serve_model) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_runtime_load_model.
        unsafe { free_handle(model) }
    }
}

/// The model's kind: "mlp", "lstm", "seq2seq" or "treelstm" (static storage); "" if NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_kind(model: *const serve_model) -> *const c_char {
    ffi_boundary! {
        // SAFETY: NULL or a live model (contract).
        unsafe { model.as_ref() }.map_or(c"".as_ptr(), |m| m.model.kind().c_name().as_ptr())
    }
}

/// Values in one request's input for fixed-shape models (`mlp`); 0 for sequence and tree models
/// and for NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_input_len(model: *const serve_model) -> usize {
    ffi_boundary! {
        // SAFETY: NULL or a live model (contract).
        unsafe { model.as_ref() }.map_or(0, |m| match m.model.network() {
            Network::Mlp(n) => n.input_len(),
        })
    }
}

/// Values in one request's output for models with a fixed output size; 0 for NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_output_len(model: *const serve_model) -> usize {
    ffi_boundary! {
        // SAFETY: NULL or a live model (contract).
        unsafe { model.as_ref() }.map_or(0, |m| match m.model.network() {
            Network::Mlp(n) => n.output_len(),
        })
    }
}
