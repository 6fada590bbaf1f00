//! `serve_metrics`: a runtime's metrics as Prometheus / OpenMetrics text.

use std::ffi::{CString, c_char};

use crate::error::Error;
use crate::ffi::error::serve_error;
use crate::ffi::runtime::serve_runtime;
use crate::ffi::{arg, free_handle, into_handle, out_arg, write_out};
use crate::ffi_boundary;

/// A runtime's metrics, encoded when `serve_runtime_metrics` took them. Immutable; may be read
/// from several threads at once.
pub struct serve_metrics {
    text: CString,
}

/// Encode the runtime's metrics in the OpenMetrics text format, which Prometheus scrapes (serve
/// it with the content type `application/openmetrics-text; version=1.0.0; charset=utf-8`). Read
/// the text with `serve_metrics_text`; free it with `serve_metrics_free`.
///
/// Series (each labelled `model`, the model's name; models sharing a name share their series,
/// which are removed when the last model of that name is freed):
/// `serve_requests_completed_total{code}` and `serve_requests_rejected_total{code}` (counters;
/// `code` is a `serve_code` name such as `OK` or `BUSY`), `serve_request_queue_seconds`,
/// `serve_request_service_seconds` and `serve_request_latency_seconds` (histograms: submit →
/// first task launch, first launch → completion, submit → completion), `serve_batch_size`
/// (histogram of requests per launched task), `serve_queue_depth` and `serve_in_flight`
/// (gauges), `serve_worker_busy_seconds_total{worker}` and `serve_worker_stalls_total{worker}`
/// (counters).
#[unsafe(no_mangle)]
pub extern "C" fn serve_runtime_metrics(
    runtime: *const serve_runtime,
    out: *mut *mut serve_metrics,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let r = unsafe { arg(runtime, "runtime") }?;
        out_arg(out, "out")?;
        let text = CString::new(r.rt.metrics_text())
            .map_err(|_| Error::internal("the metrics text contains a NUL byte"))?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_metrics { text })) };
        Ok(())
    }
}

/// The metrics text: NUL-terminated UTF-8, owned by `metrics` and valid until
/// `serve_metrics_free`. Its length in bytes (without the NUL) is stored in `*len` unless `len`
/// is NULL. "" (and length 0) if `metrics` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_metrics_text(metrics: *const serve_metrics, len: *mut usize) -> *const c_char {
    ffi_boundary! {
        // SAFETY: NULL or a live handle (contract).
        let text = unsafe { metrics.as_ref() }.map_or(c"", |m| m.text.as_c_str());
        if !len.is_null() {
            // SAFETY: non-NULL; writable by the caller's contract.
            unsafe { write_out(len, text.count_bytes()) };
        }
        text.as_ptr()
    }
}

/// Free metrics taken by `serve_runtime_metrics`. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_metrics_free(metrics: *mut serve_metrics) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_runtime_metrics.
        unsafe { free_handle(metrics) }
    }
}
