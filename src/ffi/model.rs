//! `serve_model` and its options builder.

use std::collections::BTreeMap;
use std::ffi::c_char;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::ffi::error::serve_error;
use crate::ffi::runtime::serve_runtime;
use crate::ffi::slice_arg;
use crate::ffi::{arg, arg_mut, free_handle, into_handle, out_arg, str_arg, write_out};
use crate::ffi_boundary;
use crate::model::Network;
use crate::runtime::{Model, ModelOptions, PolicyConfig, check};
use crate::sched::adaptive::Streams;
use crate::sched::elastic::{MAX_RING_SLOTS, MAX_WORKERS};
use crate::sched::tenant::TenantModel;
use crate::{AdaptiveConfig, CellularOptions, ElasticConfig, PaddingConfig, TimeoutConfig};

/// Options for `serve_runtime_load_model`: an opaque builder. Not thread-safe while being set; a
/// `const serve_model_options *` may be shared.
pub struct serve_model_options {
    opts: ModelOptions,
    knobs: Knobs,
}

/// The batching settings as the C setters record them; they become a [`PolicyConfig`] when the
/// model (and so its kind) is known.
#[derive(Clone, Debug, Default)]
struct Knobs {
    policy: u32,
    max_batch: Option<usize>,
    max_wait: Option<Duration>,
    workers: Option<usize>,
    pad: Option<bool>,
    max_tasks: Option<usize>,
    /// Elastic: worker batch sizes, MaxInf, ring slots, E-Ebird's configurations.
    elastic_workers: Option<Vec<usize>>,
    max_inflight: Option<usize>,
    ring_slots: Option<usize>,
    engine_confs: BTreeMap<usize, Vec<usize>>,
    /// Adaptive: the latency bound and the streams (1: serial, 2: async).
    latency_bound: Option<Duration>,
    streams: Option<Streams>,
}

/// The model kind's own policy: timeout batching (no wait) for `mlp`, cellular batching for
/// `lstm`, `seq2seq` and `treelstm`.
pub const SERVE_POLICY_AUTO: u32 = 0;
/// TF-Serving style timeout batching (fixed-shape models).
pub const SERVE_POLICY_TIMEOUT: u32 = 1;
/// BatchMaker cellular batching (recurrent models).
pub const SERVE_POLICY_CELLULAR: u32 = 2;
/// Graph batching with padding, the TF/MXNet baseline (recurrent models).
pub const SERVE_POLICY_PADDING: u32 = 3;
/// E²bird's elastic batching: workers of fixed batch sizes fed full batches from an input ring,
/// no timer (fixed-shape models).
pub const SERVE_POLICY_ELASTIC: u32 = 4;
/// Adaptive batching on a latency model: the batch size from fitted stage costs, the arrival
/// rate and a latency bound (fixed-shape models).
pub const SERVE_POLICY_ADAPTIVE: u32 = 5;

impl Knobs {
    fn policy(&self, net: &Network) -> crate::Result<PolicyConfig> {
        let recurrent = net.is_recurrent();
        let name = match self.policy {
            SERVE_POLICY_TIMEOUT => "timeout",
            SERVE_POLICY_CELLULAR => "cellular",
            SERVE_POLICY_PADDING => "padding",
            SERVE_POLICY_ELASTIC => "elastic",
            SERVE_POLICY_ADAPTIVE => "adaptive",
            _ if recurrent => "cellular",
            _ => "timeout",
        };
        let elastic_set = self.elastic_workers.is_some()
            || self.max_inflight.is_some()
            || self.ring_slots.is_some()
            || !self.engine_confs.is_empty();
        if elastic_set && name != "elastic" {
            return Err(Error::invalid(format!(
                "elastic workers, max in flight, ring slots and engine configurations apply to the elastic \
                 policy; this `{}` model uses {name}",
                net.kind()
            )));
        }
        if (self.latency_bound.is_some() || self.streams.is_some()) && name != "adaptive" {
            return Err(Error::invalid(format!(
                "the latency bound and streams apply to the adaptive policy; this `{}` model uses {name}",
                net.kind()
            )));
        }
        let only_timeout = |what: &str| {
            Error::invalid(format!(
                "{what} applies to the timeout policy; this `{}` model uses {name}",
                net.kind()
            ))
        };
        Ok(match name {
            "timeout" => {
                let mut c = TimeoutConfig { max_wait: Duration::ZERO, ..TimeoutConfig::default() };
                c.max_batch = self.max_batch.unwrap_or(c.max_batch);
                c.max_wait = self.max_wait.unwrap_or(c.max_wait);
                c.workers = self.workers.unwrap_or(c.workers);
                c.pad_to_max = self.pad.unwrap_or(c.pad_to_max);
                if self.max_tasks.is_some() {
                    return Err(Error::invalid(
                        "max tasks to submit applies to the cellular and padding policies",
                    ));
                }
                PolicyConfig::Timeout(c)
            }
            _ if self.max_wait.is_some() => return Err(only_timeout("max wait")),
            _ if self.pad.is_some() => return Err(only_timeout("pad to max")),
            "elastic" | "adaptive" if self.max_tasks.is_some() => {
                return Err(Error::invalid(
                    "max tasks to submit applies to the cellular and padding policies",
                ));
            }
            "elastic" => {
                if self.max_batch.is_some() || self.workers.is_some() {
                    return Err(Error::invalid(
                        "elastic batching takes its workers' batch sizes (serve_model_options_set_elastic_workers) \
                         and max in flight, not a max batch or a worker count",
                    ));
                }
                let max_inflight = self.max_inflight.unwrap_or(ElasticConfig::DEFAULT_MAX_INFLIGHT);
                let mut c = if self.engine_confs.is_empty() {
                    ElasticConfig { max_inflight, ..ElasticConfig::default() }
                } else {
                    ElasticConfig::e_ebird(self.engine_confs.clone(), max_inflight)
                };
                if let Some(w) = &self.elastic_workers {
                    c.workers = w.clone();
                }
                c.ring_slots = self.ring_slots.unwrap_or(c.ring_slots);
                PolicyConfig::Elastic(c)
            }
            "adaptive" => {
                if self.workers.is_some() {
                    return Err(Error::invalid("adaptive batching runs one worker"));
                }
                let mut c = AdaptiveConfig::default();
                c.max_batch = self.max_batch.unwrap_or(c.max_batch);
                c.latency_bound = self.latency_bound.unwrap_or(c.latency_bound);
                c.streams = self.streams.unwrap_or(c.streams);
                PolicyConfig::Adaptive(c)
            }
            "cellular" => {
                let mut c = CellularOptions::default();
                c.workers = self.workers.unwrap_or(c.workers);
                if let Some(b) = self.max_batch {
                    c.max_batch = vec![b; net.cell_types().len().max(1)];
                }
                c.max_tasks_to_submit = self.max_tasks;
                PolicyConfig::Cellular(c)
            }
            _ => {
                let mut c = PaddingConfig::default();
                c.workers = self.workers.unwrap_or(c.workers);
                c.max_batch = self.max_batch.unwrap_or(c.max_batch);
                c.max_tasks_to_submit = self.max_tasks.unwrap_or(c.max_tasks_to_submit);
                PolicyConfig::Padding(c)
            }
        })
    }
}

/// A model loaded into a runtime. Thread-safe: submit to it from any number of threads. Valid
/// until freed with `serve_model_free`, even after its runtime is freed (submits then fail with
/// `SERVE_CODE_SHUTDOWN`).
pub struct serve_model {
    pub(crate) model: Model,
    /// The profile its tenant scheduler plans with, for a model added by
    /// `serve_runtime_add_tenants`.
    pub(crate) tenant: Option<Arc<TenantModel>>,
}

/// Create model options with the defaults: the model kind's own policy (`SERVE_POLICY_AUTO`:
/// timeout batching with max batch 32, max wait 0 and 1 worker for `mlp`; cellular batching with
/// max batch 512 per cell type (256 for the Seq2Seq decoder), 1 worker and 5 tasks submitted
/// ahead for recurrent models), the runtime's admission bound, name = the directory's name.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_new(out: *mut *mut serve_model_options) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        let o = serve_model_options { opts: ModelOptions::default(), knobs: Knobs::default() };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(o)) };
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
    f: impl FnOnce(&mut serve_model_options) -> crate::Result<()>,
) -> crate::Result<()> {
    // SAFETY: checked for NULL; validity and exclusivity are the caller's contract.
    f(unsafe { arg_mut(options, "options") }?)
}

/// The batching policy: one of the `SERVE_POLICY_*` constants. A policy that does not fit the
/// model's kind (timeout, elastic or adaptive for a recurrent model, cellular or padding for a
/// fixed-shape one) makes
/// `serve_runtime_load_model` fail with `SERVE_CODE_UNSUPPORTED`.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_policy(
    options: *mut serve_model_options,
    policy: u32,
) -> *mut serve_error {
    ffi_boundary! {
        if policy > SERVE_POLICY_ADAPTIVE {
            return Err(Error::invalid(format!("unknown policy {policy}; use a SERVE_POLICY_* constant")));
        }
        set(options, |o| {
            o.knobs.policy = policy;
            Ok(())
        })
    }
}

/// Maximum rows per batched task, 1 to 65536: the `s` of timeout batching, the max batch of every
/// cell type under cellular batching, the requests per batch of the padding policy, the largest
/// batch of the adaptive policy. (Elastic batching takes its workers' sizes instead.)
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_max_batch(
    options: *mut serve_model_options,
    max_batch: u32,
) -> *mut serve_error {
    ffi_boundary! {
        check::max_batch(max_batch as usize)?;
        set(options, |o| {
            o.knobs.max_batch = Some(max_batch as usize);
            Ok(())
        })
    }
}

/// Longest time, in nanoseconds, the oldest queued request waits for a fuller batch (the `t` of
/// timeout batching). 0 = no waiting: a batch starts as soon as a worker is idle. Timeout policy
/// only (loading a model under another policy fails with `SERVE_CODE_INVALID_ARGUMENT`).
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_max_wait_ns(
    options: *mut serve_model_options,
    max_wait_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        set(options, |o| {
            o.knobs.max_wait = Some(Duration::from_nanos(max_wait_ns));
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
        check::workers(workers as usize)?;
        set(options, |o| {
            o.knobs.workers = Some(workers as usize);
            Ok(())
        })
    }
}

/// Static batching: every task computes `max_batch` rows, padding the missing ones. Timeout
/// policy only.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_pad_to_max(
    options: *mut serve_model_options,
    pad: bool,
) -> *mut serve_error {
    ffi_boundary! {
        set(options, |o| {
            o.knobs.pad = Some(pad);
            Ok(())
        })
    }
}

/// Tasks a worker may have submitted and unfinished (BatchMaker's `MaxTasksToSubmit`; default
/// 5, cellular batching of a Seq2Seq model 2), at least 1. Cellular and padding policies only.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_max_tasks_to_submit(
    options: *mut serve_model_options,
    max_tasks: u32,
) -> *mut serve_error {
    ffi_boundary! {
        if max_tasks == 0 {
            return Err(Error::invalid("max tasks to submit must be at least 1"));
        }
        set(options, |o| {
            o.knobs.max_tasks = Some(max_tasks as usize);
            Ok(())
        })
    }
}

/// State slots of a recurrent model (one per in-flight sequence, one per node of an in-flight
/// tree; requests wait for slots when all are taken); at least 1. Default: enough for the
/// admission bound within 256 MiB of state.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_state_slots(
    options: *mut serve_model_options,
    slots: u64,
) -> *mut serve_error {
    ffi_boundary! {
        if slots == 0 {
            return Err(Error::invalid("state slots must be at least 1"));
        }
        set(options, |o| {
            o.opts.state_slots = Some(usize::try_from(slots).unwrap_or(usize::MAX));
            Ok(())
        })
    }
}

/// Most bytes of token-gate tables a recurrent model may hold (CPU backend): an LSTM's first
/// layer with its embedding folded into its input projection, `vocab × 4·hidden` floats computed
/// at load, halves a step's multiply-adds at `embed = hidden`. 0 turns folding off; a table that
/// does not fit runs unfolded (same results up to rounding). Default 256 MiB
/// (`DEFAULT_TOKEN_GATES_BYTES`).
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_token_gates_bytes(
    options: *mut serve_model_options,
    bytes: u64,
) -> *mut serve_error {
    ffi_boundary! {
        set(options, |o| {
            o.opts.token_gates_bytes = Some(usize::try_from(bytes).unwrap_or(usize::MAX));
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
            o.opts.admission_bound = Some(bound);
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
            o.opts.name = Some(name);
            Ok(())
        })
    }
}

/// The `len` batch sizes at `sizes` (1 to 256 entries, each 1 to 65536).
///
/// # Safety
/// `sizes` points at `len` readable `uint32_t`s (NULL only with `len` 0, which is refused).
unsafe fn read_batch_sizes(sizes: *const u32, len: usize, name: &str) -> crate::Result<Vec<usize>> {
    if !(1..=MAX_WORKERS).contains(&len) {
        return Err(Error::invalid(format!("`{name}` has {len} entries: 1 to {MAX_WORKERS}")));
    }
    // SAFETY: the caller's contract; the length is bounded above.
    let sizes = unsafe { slice_arg(sizes, len, name) }?;
    sizes
        .iter()
        .map(|&b| {
            check::max_batch(b as usize)?;
            Ok(b as usize)
        })
        .collect()
}

/// Elastic policy: the batch size of each worker (`len` entries, 1 to 256, each 1 to 65536;
/// one must be 1). Default: N-Ebird's `{1, 1, 2, 4, 8, 16}`, or with engine configurations the
/// union of them plus a worker of 1 and one of 2. Copied.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_elastic_workers(
    options: *mut serve_model_options,
    batch_sizes: *const u32,
    len: usize,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: the caller's contract (the header's).
        let sizes = unsafe { read_batch_sizes(batch_sizes, len, "batch_sizes") }?;
        set(options, |o| {
            o.knobs.elastic_workers = Some(sizes);
            Ok(())
        })
    }
}

/// Elastic policy: the most rows running at once over every worker (E²bird's MaxInf = MaxBS, the
/// largest batch one worker runs within the QoS), 1 to 65536, at most the ring slots. Default 32.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_max_inflight(
    options: *mut serve_model_options,
    max_inflight: u32,
) -> *mut serve_error {
    ffi_boundary! {
        check::max_batch(max_inflight as usize)?;
        set(options, |o| {
            o.knobs.max_inflight = Some(max_inflight as usize);
            Ok(())
        })
    }
}

/// Elastic policy: slots of the input ring, 1 to 65536 (default 128). A request arriving while
/// every slot holds an unanswered one completes `SERVE_CODE_BUSY` at once.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_ring_slots(
    options: *mut serve_model_options,
    slots: u32,
) -> *mut serve_error {
    ffi_boundary! {
        if slots == 0 || slots as usize > MAX_RING_SLOTS {
            return Err(Error::invalid(format!("{slots} ring slots: 1 to {MAX_RING_SLOTS}")));
        }
        set(options, |o| {
            o.knobs.ring_slots = Some(slots as usize);
            Ok(())
        })
    }
}

/// Elastic policy, E-Ebird: at load level `total_batch` (requests in the pool), run the workers of
/// these batch sizes (`len` entries summing to `total_batch`), e.g. as `serve profile
/// --engine-configs` picked them. Adding any turns N-Ebird into E-Ebird; a level given twice
/// keeps the last. Copied.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_add_engine_config(
    options: *mut serve_model_options,
    total_batch: u32,
    batch_sizes: *const u32,
    len: usize,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: the caller's contract (the header's).
        let sizes = unsafe { read_batch_sizes(batch_sizes, len, "batch_sizes") }?;
        let sum: usize = sizes.iter().sum();
        if sum != total_batch as usize {
            return Err(Error::invalid(format!(
                "engine configuration {sizes:?} sums to {sum}, not its total batch {total_batch}"
            )));
        }
        set(options, |o| {
            if o.knobs.engine_confs.len() >= MAX_WORKERS && !o.knobs.engine_confs.contains_key(&sum) {
                return Err(Error::invalid(format!("more than {MAX_WORKERS} engine configurations")));
            }
            o.knobs.engine_confs.insert(sum, sizes);
            Ok(())
        })
    }
}

/// Adaptive policy: the latency bound, in nanoseconds (> 0), the batch size is chosen for. A
/// bound the load makes infeasible is served anyway (the batch size follows the load). Default
/// 100 ms.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_latency_bound_ns(
    options: *mut serve_model_options,
    bound_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        if bound_ns == 0 {
            return Err(Error::invalid("the latency bound must be positive"));
        }
        set(options, |o| {
            o.knobs.latency_bound = Some(Duration::from_nanos(bound_ns));
            Ok(())
        })
    }
}

/// Adaptive policy: 2 (default) uploads the next batch while one computes; 1 runs one batch at
/// a time (the serial server).
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_options_set_streams(
    options: *mut serve_model_options,
    streams: u32,
) -> *mut serve_error {
    ffi_boundary! {
        let streams = match streams {
            1 => Streams::Serial,
            2 => Streams::Async,
            n => return Err(Error::invalid(format!("{n} streams: 1 (serial) or 2 (async)"))),
        };
        set(options, |o| {
            o.knobs.streams = Some(streams);
            Ok(())
        })
    }
}

/// Load the model directory `dir` (model.toml + weights.safetensors) into `runtime`. `options`
/// may be NULL for the defaults. Errors: `SERVE_CODE_NOT_FOUND` (no such directory or file),
/// `SERVE_CODE_FORMAT` (bad model.toml; missing, extra, duplicate or misshaped tensor; non-f32
/// dtype; truncated file or bytes after the last tensor; NaN or infinite weight; a size over its
/// limit, README "Models"; unknown kind), `SERVE_CODE_UNSUPPORTED` (a policy that does not fit the
/// kind), `SERVE_CODE_INVALID_ARGUMENT` (an option the policy does not have; a model file that is
/// not a regular file, e.g. a FIFO or a device; a symlink loop),
/// `SERVE_CODE_SHUTDOWN`. On success `*out` owns the model.
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
        let (opts, knobs) = unsafe { options.as_ref() }
            .map(|o| (o.opts.clone(), o.knobs.clone()))
            .unwrap_or_default();
        let model = r.rt.load_model_with(dir, opts, |net, opts| {
            opts.policy = knobs.policy(net)?;
            Ok(())
        })?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_model { model, tenant: None })) };
        Ok(())
    }
}

/// The model options behind `options` (NULL: the defaults) with the policy resolved for `net`.
///
/// # Safety
/// `options` is NULL or a live options handle.
pub(crate) unsafe fn resolve_options(
    options: *const serve_model_options,
    net: &Network,
) -> crate::Result<ModelOptions> {
    // SAFETY: the caller's contract.
    let (mut opts, knobs) =
        unsafe { options.as_ref() }.map(|o| (o.opts.clone(), o.knobs.clone())).unwrap_or_default();
    opts.policy = knobs.policy(net)?;
    Ok(opts)
}

/// A path argument: any bytes on Unix, UTF-8 elsewhere.
pub(crate) unsafe fn path_arg<'a>(p: *const c_char) -> crate::Result<&'a Path> {
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

/// Free a model. Requests already submitted to it still complete as usual (each exactly once,
/// with its normal result, into its queue); once they have, the runtime releases the model's
/// worker threads, state and buffers. The handle is invalid as soon as this is called: it must
/// not be used again, nor be in use by another thread (a submit in progress). Never blocks on the
/// model's requests. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_free(model: *mut serve_model) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_runtime_load_model.
        unsafe { free_handle(model) }
    }
}

/// The model's kind: "mlp", "lstm", "seq2seq", "treelstm", "resnet", "bert" or "custom" (static
/// storage); "" if NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_kind(model: *const serve_model) -> *const c_char {
    ffi_boundary! {
        // SAFETY: NULL or a live model (contract).
        unsafe { model.as_ref() }.map_or(c"".as_ptr(), |m| m.model.kind().c_name().as_ptr())
    }
}

/// Values in one request's input for models with a fixed input size (`mlp`, `resnet`, `custom`:
/// its f32 input); 0 for sequence and tree models (`bert` included: tokens) and for NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_input_len(model: *const serve_model) -> usize {
    ffi_boundary! {
        // SAFETY: NULL or a live model (contract).
        unsafe { model.as_ref() }.map_or(0, |m| match m.model.network() {
            Network::Mlp(n) => n.input_len(),
            Network::ResNet(n) => n.input_len(),
            Network::Custom(n) => n.input_len,
            _ => 0,
        })
    }
}

/// Values in one request's output for models with a fixed output size (`mlp`: its output;
/// `resnet`: its classes; `lstm`, `treelstm`, `bert`: the hidden size; `custom`: its output
/// length); 0 for `seq2seq` (token outputs) and for NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_output_len(model: *const serve_model) -> usize {
    ffi_boundary! {
        // SAFETY: NULL or a live model (contract).
        unsafe { model.as_ref() }.map_or(0, |m| match m.model.network() {
            Network::Mlp(n) => n.output_len(),
            Network::Lstm(n) => n.cfg.hidden,
            Network::TreeLstm(n) => n.cfg.hidden,
            Network::ResNet(n) => n.output_len(),
            Network::Bert(n) => n.cfg.hidden,
            Network::Custom(n) => n.output_len,
            Network::Seq2Seq(_) => 0,
        })
    }
}
