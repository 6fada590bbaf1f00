//! `serve_tenants` and `serve_runtime_add_tenants`: several layer models sharing the CPU cores
//! under one VELTAIR-style tenant scheduler, each with its own QoS target (ARCHITECTURE.md §7.9,
//! [`Runtime::add_tenants`](crate::Runtime::add_tenants)).

use std::ffi::c_char;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;
use crate::ffi::custom::serve_custom_model_options;
use crate::ffi::error::serve_error;
use crate::ffi::model::{path_arg, serve_model};
use crate::ffi::runtime::serve_runtime;
use crate::ffi::{arg, arg_mut, free_handle, into_handle, out_arg, str_arg, write_out};
use crate::ffi_boundary;
use crate::model::Network;
use crate::sched::tenant::profile::{MAX_LEVELS, check_qos};
use crate::sched::tenant::{MAX_TENANTS, Scheme, TenantModel};
use crate::{TenantOptions, TenantSpec};

/// A group of tenant models and how they share the cores: an opaque builder, filled with
/// `serve_tenants_add_*` and `serve_tenants_set_*`, then given to `serve_runtime_add_tenants`.
/// Not thread-safe while being filled; a `const serve_tenants *` may be shared.
pub struct serve_tenants {
    specs: Vec<TenantSpec>,
    opts: TenantOptions,
}

impl serve_tenants {
    /// Add the tenant `net` makes, once the group has room and the QoS is in range (so a refused
    /// model directory is not loaded first).
    fn push(
        &mut self,
        name: String,
        qos_ns: u64,
        net: impl FnOnce() -> crate::Result<Network>,
    ) -> crate::Result<()> {
        if self.specs.len() >= MAX_TENANTS {
            return Err(Error::invalid(format!("more than {MAX_TENANTS} tenant models")));
        }
        let qos = Duration::from_nanos(qos_ns);
        check_qos(&name, qos)?;
        let net = net()?;
        net.check()?;
        self.specs.push(TenantSpec::new(Arc::new(net), &name, qos));
        Ok(())
    }
}

/// Create an empty group of tenants with the defaults: scheme `"veltair"`, every CPU this thread
/// may run on (at most the CPU backend's compute threads), 5 interference levels 0.25 apart,
/// layer budgets summing to 0.85 of each QoS target, the runtime's admission bound.
/// On success `*out` owns the group.
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_new(out: *mut *mut serve_tenants) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_tenants { specs: Vec::new(), opts: TenantOptions::default() })) };
        Ok(())
    }
}

/// Free a group of tenants (NULL is ignored). Models already added keep serving.
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_free(tenants: *mut serve_tenants) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_tenants_new.
        unsafe { free_handle(tenants) }
    }
}

/// Add the layer model in directory `dir` (mlp, resnet or bert; loaded now) as a tenant named
/// `name` (copied; NULL: the directory's name) whose queries should complete within `qos_ns`
/// nanoseconds (1 ns to one hour). The QoS target plans its blocks; submit with a deadline to
/// enforce it. Errors: those of `serve_runtime_load_model` for the directory,
/// `SERVE_CODE_INVALID_ARGUMENT` for a QoS out of range or more than 256 tenants. A recurrent model loads here and is refused by `serve_runtime_add_tenants`.
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_add_model(
    tenants: *mut serve_tenants,
    dir: *const c_char,
    name: *const c_char,
    qos_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: NULL-checked; validity and exclusivity are the caller's contract.
        let t = unsafe { arg_mut(tenants, "tenants") }?;
        // SAFETY: as above (NUL-terminated).
        let dir = unsafe { path_arg(dir) }?;
        let name = match name.is_null() {
            // SAFETY: non-NULL, NUL-terminated by contract.
            false => unsafe { str_arg(name, "name") }?.to_string(),
            true => dir.file_name().map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned()),
        };
        t.push(name, qos_ns, || crate::model::load(dir))
    }
}

/// Add a custom model (`serve_custom_model_options`, with its layers declared) as a tenant named
/// `name` (copied) with QoS target `qos_ns` (as `serve_tenants_add_model`). Its callback runs
/// layer ranges on core leases: `serve_custom_call.cpus` names the leased CPUs. The options may
/// be freed after this call (the group shares their callback and user data).
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_add_custom_model(
    tenants: *mut serve_tenants,
    options: *const serve_custom_model_options,
    name: *const c_char,
    qos_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: pointers NULL-checked; validity and exclusivity are the caller's contract.
        let t = unsafe { arg_mut(tenants, "tenants") }?;
        // SAFETY: as above.
        let o = unsafe { arg(options, "options") }?;
        // SAFETY: as above.
        let name = unsafe { str_arg(name, "name") }?.to_string();
        t.push(name, qos_ns, || Ok(Network::Custom(o.model())))
    }
}

/// The scheme sharing the cores: `"veltair"` (default), `"veltair-as"`, `"veltair-ac"`,
/// `"layer-wise"`, `"model-wise"`, `"fixed-N"` (blocks of N layers, N ≥ 1) or `"prema"`.
/// `SERVE_CODE_INVALID_ARGUMENT` for any other name.
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_set_scheme(
    tenants: *mut serve_tenants,
    scheme: *const c_char,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: pointers NULL-checked; validity and exclusivity are the caller's contract.
        let t = unsafe { arg_mut(tenants, "tenants") }?;
        // SAFETY: as above.
        t.opts.scheme = Scheme::parse(unsafe { str_arg(scheme, "scheme") }?)?;
        Ok(())
    }
}

/// The cores shared: the first `cores` CPUs the thread calling `serve_runtime_add_tenants` may
/// run on; 0 (default) for all of them, at most the CPU backend's compute threads. A count above
/// that is refused by `serve_runtime_add_tenants`.
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_set_cores(tenants: *mut serve_tenants, cores: usize) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: NULL-checked; validity and exclusivity are the caller's contract.
        let t = unsafe { arg_mut(tenants, "tenants") }?;
        t.opts.cores = cores;
        Ok(())
    }
}

/// Interference levels of the profile, 1 to 16 (default 5), and the slowdown one level adds,
/// 0 to 10 (default 0.25: level 4 is twice the solo time).
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_set_levels(
    tenants: *mut serve_tenants,
    levels: usize,
    level_step: f64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: NULL-checked; validity and exclusivity are the caller's contract.
        let t = unsafe { arg_mut(tenants, "tenants") }?;
        if !(1..=MAX_LEVELS).contains(&levels) {
            return Err(Error::invalid(format!("{levels} interference levels (1 to {MAX_LEVELS})")));
        }
        if !(level_step.is_finite() && (0.0..=10.0).contains(&level_step)) {
            return Err(Error::invalid(format!("a level step of {level_step} (0 to 10)")));
        }
        t.opts.levels = levels;
        t.opts.level_step = level_step;
        Ok(())
    }
}

/// Each tenant's admission bound (requests queued or running; default: the runtime's).
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_set_admission_bound(
    tenants: *mut serve_tenants,
    bound: usize,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: NULL-checked; validity and exclusivity are the caller's contract.
        let t = unsafe { arg_mut(tenants, "tenants") }?;
        crate::runtime::check::admission_bound(bound)?;
        t.opts.admission_bound = Some(bound);
        Ok(())
    }
}

/// Tenant models in the group (NULL: 0).
#[unsafe(no_mangle)]
pub extern "C" fn serve_tenants_len(tenants: *const serve_tenants) -> usize {
    ffi_boundary! {
        // SAFETY: NULL or a live handle (contract).
        unsafe { tenants.as_ref() }.map_or(0, |t| t.specs.len())
    }
}

/// Serve the group's models as tenants of `runtime` sharing its CPU cores (the CPU backend
/// only). Each model is profiled first (every layer at every core count, one row: the call takes
/// milliseconds to seconds), then all start serving together. `models` points to `models_len`
/// slots (NULL when 0), which must equal `serve_tenants_len(tenants)`; on success slot `i` owns the `i`-th
/// model added (free each with `serve_model_free`; submit with `serve_submit_f32`). Errors:
/// `SERVE_CODE_UNSUPPORTED` (a device backend), `SERVE_CODE_INVALID_ARGUMENT` (NULL arguments,
/// no tenant, `models_len` not the group's size, a model without layers, a pool of more cores
/// than this thread may run on), an error naming the layer when one cannot be profiled (a custom
/// callback that fails), `SERVE_CODE_SHUTDOWN`. On error no slot is written and nothing serves.
///
/// A model whose whole chain of layers cannot meet its QoS alone on every core is still served
/// (best-effort) and flagged: `serve_model_tenant_feasible`. More tenants than cores is allowed.
/// The group may be freed or reused after the call.
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_add_tenants(
    runtime: *const serve_runtime,
    tenants: *const serve_tenants,
    models: *mut *mut serve_model,
    models_len: usize,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: pointers NULL-checked; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        // SAFETY: as above.
        let t = unsafe { arg(tenants, "tenants") }?;
        if models_len != t.specs.len() {
            return Err(Error::invalid(format!(
                "`models_len` is {models_len}; the group has {} tenant models",
                t.specs.len()
            )));
        }
        if models_len > 0 {
            out_arg(models, "models")?;
        }
        let added = r.rt.add_tenants(t.specs.clone(), t.opts.clone())?;
        for (i, tenant) in added.into_iter().enumerate() {
            let handle = into_handle(serve_model { model: tenant.model, tenant: Some(tenant.profile) });
            // SAFETY: `i < models_len` slots, writable by contract.
            unsafe { write_out(models.add(i), handle) };
        }
        Ok(())
    }
}

/// The tenant profile of `model`, or `SERVE_CODE_INVALID_ARGUMENT` for a model not added by
/// `serve_runtime_add_tenants`.
///
/// # Safety
/// `model` is NULL or a live handle for `'a` (the calling export's duration).
unsafe fn profile<'a>(model: *const serve_model) -> crate::Result<&'a TenantModel> {
    // SAFETY: the function's contract.
    let m = unsafe { arg(model, "model") }?;
    m.tenant.as_deref().ok_or_else(|| Error::invalid("the model is not a tenant (serve_runtime_add_tenants)"))
}

/// Whether tenant `model`'s whole chain of layers meets its QoS target alone on every core of
/// the pool (as profiled); when not, it is served best-effort. `SERVE_CODE_INVALID_ARGUMENT` for
/// a model that is not a tenant.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_tenant_feasible(model: *const serve_model, out: *mut bool) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle (contract).
        let feasible = unsafe { profile(model) }?.feasible();
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, feasible) };
        Ok(())
    }
}

/// Tenant `model`'s profiled time alone on every core of the pool, its whole chain of layers,
/// in nanoseconds. `SERVE_CODE_INVALID_ARGUMENT` for a model that is not a tenant.
#[unsafe(no_mangle)]
pub extern "C" fn serve_model_tenant_solo_ns(model: *const serve_model, out: *mut u64) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        // SAFETY: NULL or a live handle (contract).
        let solo = unsafe { profile(model) }?.solo();
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, u64::try_from(solo.as_nanos()).unwrap_or(u64::MAX)) };
        Ok(())
    }
}
