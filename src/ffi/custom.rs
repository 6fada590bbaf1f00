//! `serve_custom_model_options` and `serve_runtime_add_custom_model`: a C/C++ server's own engine
//! under libserve's batching (ARCHITECTURE.md §6, `model::custom`).

use std::ffi::{c_char, c_void};
use std::sync::Arc;

use crate::error::Error;
use crate::ffi::error::serve_error;
use crate::ffi::model::{resolve_options, serve_model, serve_model_options};
use crate::ffi::runtime::serve_runtime;
use crate::ffi::{arg, arg_mut, free_handle, into_handle, out_arg, str_arg, write_out};
use crate::ffi_boundary;
use crate::model::{CustomCall, CustomExecute, CustomModel, LayerInfo, Network};

/// Bytes of the message buffer a failing call may fill (`serve_custom_call.message`).
pub const SERVE_CUSTOM_MESSAGE_CAPACITY: usize = 256;

/// One batched call of a custom model's execute callback. Valid only during the call.
#[repr(C)]
pub struct serve_custom_call {
    /// The worker (stream) running the call: calls of one worker never overlap; calls of
    /// different workers of the model may run at the same time.
    pub worker: usize,
    /// The cores the call may use (the task's core bound, or the CPU backend's thread count).
    pub cores: usize,
    /// Rows of the batch (requests, padding rows included).
    pub batch: usize,
    /// The layers `[first_layer, last_layer)` to run. `first_layer == 0` and `last_layer` equal
    /// to the model's layer count (0 when it declared none) is the whole model.
    pub first_layer: usize,
    pub last_layer: usize,
    /// `batch × input_stride` values: each row's values entering `first_layer` (the model's
    /// input for the whole model). Read-only.
    pub input: *const f32,
    pub input_stride: usize,
    /// `batch × output_stride` values, zeroed: write each row's values leaving
    /// `last_layer − 1` (the model's output for the whole model).
    pub output: *mut f32,
    pub output_stride: usize,
    /// On failure, the callback may write a NUL-terminated UTF-8 message here (at most
    /// `message_capacity` bytes, NUL included); it becomes the requests' error message.
    pub message: *mut c_char,
    pub message_capacity: usize,
    /// The CPUs a core lease gives the call (a tenant model, `serve_runtime_add_tenants`):
    /// `cpu_count` CPU numbers (as `sched_setaffinity` numbers them), equal to `cores`. Within
    /// its tenant group no other call is leased them until this one returns (unless the stall
    /// watchdog gives up on it first; another group shares the same CPUs). On Linux the calling
    /// thread runs pinned to `cpus[0]` (when the system allows it), and an engine with threads of
    /// its own may place them on the others. `cpu_count` is 0 (and `cpus`
    /// NULL) for a call without a lease (a model added with `serve_runtime_add_custom_model`).
    /// Read-only, valid during the call.
    pub cpus: *const usize,
    pub cpu_count: usize,
}

/// A custom model's computation: return 0 when every row's output is written, any other value
/// to fail every request of the batch with `SERVE_CODE_BACKEND` (the value and the message, if
/// any, in the error). Called on libserve's worker thread; must not throw or unwind.
pub type serve_custom_execute_fn =
    Option<unsafe extern "C" fn(user_data: *mut c_void, call: *const serve_custom_call) -> i32>;

/// Frees a custom model's user data, once, when nothing can call the model any more.
pub type serve_custom_free_fn = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// The C callback and its user data.
struct CExecute {
    execute: unsafe extern "C" fn(*mut c_void, *const serve_custom_call) -> i32,
    user_data: *mut c_void,
    free: serve_custom_free_fn,
}

// SAFETY: the header's contract: `user_data` may be used from any thread by the callback (calls
// come from libserve's worker threads, one at a time per worker), and `free` may run on any thread.
unsafe impl Send for CExecute {}
// SAFETY: as above; libserve itself never touches `user_data` but to pass it back.
unsafe impl Sync for CExecute {}

impl Drop for CExecute {
    fn drop(&mut self) {
        if let Some(free) = self.free {
            // SAFETY: the last reference is gone: no call is running or will run (the options and
            // every model holding this object have been freed); the header's contract for `free`.
            unsafe { free(self.user_data) };
        }
    }
}

impl CustomExecute for CExecute {
    fn execute(&self, call: &mut CustomCall<'_>) -> std::result::Result<(), String> {
        let mut message = [0u8; SERVE_CUSTOM_MESSAGE_CAPACITY];
        let c = serve_custom_call {
            worker: call.worker,
            cores: call.cores,
            batch: call.batch,
            first_layer: call.layers.0,
            last_layer: call.layers.1,
            input: call.input.as_ptr(),
            input_stride: call.input.len() / call.batch.max(1),
            output: call.output.as_mut_ptr(),
            output_stride: call.output.len() / call.batch.max(1),
            message: message.as_mut_ptr().cast(),
            message_capacity: message.len(),
            cpus: if call.cpus.is_empty() { std::ptr::null() } else { call.cpus.as_ptr() },
            cpu_count: call.cpus.len(),
        };
        // SAFETY: `c` and the buffers it points to live for the call; the callback's contract
        // (header) is to read `input`, write `output` and `message` within their stated sizes.
        let code = unsafe { (self.execute)(self.user_data, &c) };
        if code == 0 {
            return Ok(());
        }
        // The message up to its NUL, within the buffer whatever the callback did.
        let end = message.iter().position(|&b| b == 0).unwrap_or(message.len());
        let text = String::from_utf8_lossy(&message[..end]);
        Err(if text.is_empty() {
            format!("execute returned {code}")
        } else {
            format!("execute returned {code}: {text}")
        })
    }
}

/// A custom model's description: an opaque builder. Not thread-safe while being set; a
/// `const serve_custom_model_options *` may be shared.
pub struct serve_custom_model_options {
    input_len: usize,
    output_len: usize,
    exec: Arc<CExecute>,
    layers: Vec<LayerInfo>,
}

impl serve_custom_model_options {
    /// The model these options describe (sharing their callback).
    pub(crate) fn model(&self) -> CustomModel {
        CustomModel {
            input_len: self.input_len,
            output_len: self.output_len,
            layers: self.layers.clone(),
            exec: self.exec.clone(),
        }
    }
}

/// Describe a custom model: `input_len` f32 values in and `output_len` out per request (each 1 ..
/// 4,194,304), computed by `execute(user_data, call)` once per batched task. `user_data` is
/// passed back untouched; `free_user_data` (may be NULL) is called with it exactly once, when
/// these options and every model added with them have been freed (possibly on a libserve
/// thread). On error (a NULL `execute`, a bad size) nothing is kept and `free_user_data` is not
/// called. On success `*out` owns the options.
#[unsafe(no_mangle)]
pub extern "C" fn serve_custom_model_options_new(
    input_len: usize,
    output_len: usize,
    execute: serve_custom_execute_fn,
    user_data: *mut c_void,
    free_user_data: serve_custom_free_fn,
    out: *mut *mut serve_custom_model_options,
) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        let execute = execute.ok_or_else(|| Error::invalid("`execute` is NULL"))?;
        CustomModel::check_sizes(input_len, output_len)?;
        let exec = Arc::new(CExecute { execute, user_data, free: free_user_data });
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_custom_model_options { input_len, output_len, exec, layers: Vec::new() })) };
        Ok(())
    }
}

/// Declare the model's next layer (`name` copied; `weight_bytes` and `flops_per_row` for the
/// schedulers and planners; `out_len` values per row leaving it). With layers declared, the
/// callback may also be called with a layer range (`serve_custom_call.first_layer` /
/// `last_layer`); the last layer's `out_len` must be the model's output length.
#[unsafe(no_mangle)]
pub extern "C" fn serve_custom_model_options_add_layer(
    options: *mut serve_custom_model_options,
    name: *const c_char,
    weight_bytes: u64,
    flops_per_row: u64,
    out_len: usize,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: NULL-checked; validity and exclusivity are the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        // SAFETY: NULL-checked string (contract: NUL-terminated).
        let name = unsafe { str_arg(name, "name") }?.to_string();
        o.layers.push(LayerInfo { name, kind: "custom", weight_bytes, flops_per_row, out_len });
        Ok(())
    }
}

/// Free custom model options (NULL is ignored). Models already added keep their description.
#[unsafe(no_mangle)]
pub extern "C" fn serve_custom_model_options_free(options: *mut serve_custom_model_options) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_custom_model_options_new.
        unsafe { free_handle(options) }
    }
}

/// Add a custom model to `runtime` under `name` (copied), batched as `model_options` say (NULL:
/// the defaults, timeout batching with no wait). Errors: `SERVE_CODE_INVALID_ARGUMENT` (NULL
/// arguments; layers whose last output is not the model's output; an option the policy does not
/// have), `SERVE_CODE_UNSUPPORTED` (a recurrent policy), `SERVE_CODE_SHUTDOWN`. On success
/// `*out` owns the model; its requests are `serve_submit_f32` vectors of the input length.
///
/// Threading: the callback runs on the model's worker threads (one per worker of its policy),
/// never twice at once on one worker; with several workers, calls of different workers overlap.
/// Lifetime: the callback may be called until `serve_model_free` has returned and the model's
/// last request has completed; `free_user_data` runs after its last call. A call that does not
/// return is given up on by the stall watchdog (its requests complete `SERVE_CODE_BACKEND`, the
/// runtime keeps serving), but the model's worker threads are joined, so releasing the model and
/// `serve_runtime_free` wait until that call returns. Calls queued on that worker behind it
/// before the watchdog fired still run once it returns (their requests completed `BACKEND`
/// already), then `free_user_data`.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_add_custom_model(
    runtime: *const serve_runtime,
    name: *const c_char,
    options: *const serve_custom_model_options,
    model_options: *const serve_model_options,
    out: *mut *mut serve_model,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: pointers NULL-checked; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        // SAFETY: as above.
        let name = unsafe { str_arg(name, "name") }?.to_string();
        // SAFETY: as above.
        let o = unsafe { arg(options, "options") }?;
        out_arg(out, "out")?;
        let model = o.model();
        let net = Network::Custom(model.clone());
        // SAFETY: NULL or a live options handle (contract).
        let opts = unsafe { resolve_options(model_options, &net) }?;
        let model = r.rt.add_custom(model, &name, opts)?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_model { model, tenant: None })) };
        Ok(())
    }
}
