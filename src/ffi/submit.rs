//! Submitting requests: `serve_submit_options` and the `serve_submit_*` functions.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::ffi::error::serve_error;
use crate::ffi::model::serve_model;
use crate::ffi::queue::serve_queue;
use crate::ffi::{arg, arg_mut, free_handle, into_handle, out_arg, slice_arg, write_out};
use crate::ffi_boundary;
use crate::model::Network;
use crate::runtime::SubmitOptions;
use crate::runtime::recycle::InputRef;

/// Per-request options: deadline and priority. An opaque builder, reusable across submits. Not
/// thread-safe while being set; a `const serve_submit_options *` may be shared by concurrent
/// submits.
pub struct serve_submit_options {
    /// Absolute deadline on CLOCK_MONOTONIC, nanoseconds.
    deadline_ns: Option<u64>,
    /// Relative timeout from the moment of submit, nanoseconds.
    timeout_ns: Option<u64>,
    priority: i32,
}

/// Create submit options: no deadline, priority 0.
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_options_new(out: *mut *mut serve_submit_options) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        let o = serve_submit_options { deadline_ns: None, timeout_ns: None, priority: 0 };
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(o)) };
        Ok(())
    }
}

/// Free submit options. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_options_free(options: *mut serve_submit_options) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_submit_options_new.
        unsafe { free_handle(options) }
    }
}

/// Absolute deadline in CLOCK_MONOTONIC nanoseconds (see `serve_now_ns`); 0 clears it. A request
/// not completed by then completes `SERVE_CODE_DEADLINE_EXCEEDED`; one whose deadline has already
/// passed at submit is refused with that code.
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_options_set_deadline_ns(
    options: *mut serve_submit_options,
    deadline_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity and exclusivity are the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        o.deadline_ns = (deadline_ns != 0).then_some(deadline_ns);
        Ok(())
    }
}

/// Deadline relative to each submit, in nanoseconds; 0 clears it. If both a deadline and a timeout
/// are set, the earlier applies.
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_options_set_timeout_ns(
    options: *mut serve_submit_options,
    timeout_ns: u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity and exclusivity are the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        o.timeout_ns = (timeout_ns != 0).then_some(timeout_ns);
        Ok(())
    }
}

/// Priority: larger is served first; equal priorities in arrival order. Default 0.
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_options_set_priority(
    options: *mut serve_submit_options,
    priority: i32,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity and exclusivity are the caller's contract.
        let o = unsafe { arg_mut(options, "options") }?;
        o.priority = priority;
        Ok(())
    }
}

/// The current CLOCK_MONOTONIC time in nanoseconds, the clock deadlines are expressed in.
#[unsafe(no_mangle)]
pub extern "C" fn serve_now_ns() -> u64 {
    ffi_boundary! { monotonic_ns() }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec to a live local.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(ts.tv_nsec as u64)
}

fn submit_options(o: Option<&serve_submit_options>) -> SubmitOptions {
    let Some(o) = o else { return SubmitOptions::default() };
    let now = Instant::now();
    let absolute = o.deadline_ns.map(|d| {
        let now_ns = monotonic_ns();
        if d <= now_ns {
            // Already passed: any instant not after now is refused at submit.
            now
        } else {
            now + Duration::from_nanos(d - now_ns)
        }
    });
    let relative = o.timeout_ns.and_then(|t| now.checked_add(Duration::from_nanos(t)));
    SubmitOptions { deadline: absolute.into_iter().chain(relative).min(), priority: o.priority }
}

/// A caller's input array, its length checked against the model (`Network::max_input_len`)
/// before the memory is touched: a length the model cannot take is refused without reading, so
/// an over-long `len` (up to `SIZE_MAX`) is `INVALID_ARGUMENT`, never an out-of-bounds read.
///
/// # Safety
/// If `len` is at most the model's maximum, `p` points to `len` readable, initialised `T`s (or
/// is NULL, or `len` is 0).
unsafe fn input_arg<'a, T>(net: &Network, p: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    let max = net.max_input_len();
    if len > max {
        let takes = match net {
            Network::Mlp(_) => format!("this mlp takes exactly {max}"),
            _ => format!("this {} model takes at most {max}", net.kind()),
        };
        return Err(Error::invalid(format!("`{name}` has length {len}; {takes}")));
    }
    // SAFETY: `len` is within what the caller promised readable (contract above).
    unsafe { slice_arg(p, len, name) }
}

/// Shared body of every submit function. `input` borrows the request's input from the
/// caller's arrays, given the model to check their lengths against first ([`input_arg`]); the
/// runtime copies it (into a kept buffer of the model's: runtime/recycle.rs).
fn submit<'a>(
    model: *const serve_model,
    queue: *const serve_queue,
    tag: u64,
    input: impl FnOnce(&Network) -> Result<InputRef<'a>>,
    options: *const serve_submit_options,
    request_id: *mut u64,
) -> Result<()> {
    // SAFETY: pointers NULL-checked; validity is the caller's contract.
    let m = unsafe { arg(model, "model") }?;
    // Refusals from here on are counted in the model's runtime stats.
    let q = unsafe { arg(queue, "queue") }.inspect_err(|e| m.model.record_reject(e.code()))?;
    let input = input(m.model.network()).inspect_err(|e| m.model.record_reject(e.code()))?;
    // SAFETY: NULL or a live options handle.
    let opts = submit_options(unsafe { options.as_ref() });
    let id = m.model.submit_copy_to(input, opts, &q.q, tag)?;
    if !request_id.is_null() {
        // SAFETY: non-NULL; writable by the caller's contract.
        unsafe { write_out(request_id, id) };
    }
    Ok(())
}

/// Submit an f32 vector (`mlp` and other fixed-shape models). `input[0..len]` is copied before
/// this returns. The request's completion goes to `queue` with `tag`. `options` may be NULL.
/// `request_id` may be NULL; otherwise it receives the id for `serve_runtime_cancel`.
///
/// `len` is checked against the model before `input` is read: a `len` over the model's input
/// length (up to `SIZE_MAX`) is refused without touching `input` (a shorter one is read, then
/// refused). Every element must be finite: NaN or ±infinity is refused naming the first such
/// element.
///
/// Errors (returned here; the request is then not submitted and produces no completion):
/// `SERVE_CODE_INVALID_ARGUMENT` (NULL handle, empty or wrong-length input, a non-finite
/// element, input of the wrong kind for the model), `SERVE_CODE_DEADLINE_EXCEEDED` (deadline already passed),
/// `SERVE_CODE_BUSY` (the model's admission bound is full, or — for a request with a deadline —
/// the work queued ahead would not finish in time: retry later, or elsewhere),
/// `SERVE_CODE_SHUTDOWN`. Otherwise exactly one completion is delivered to `queue`.
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_f32(
    model: *const serve_model,
    queue: *const serve_queue,
    tag: u64,
    input: *const f32,
    len: usize,
    options: *const serve_submit_options,
    request_id: *mut u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: `input` has `len` floats when `len` is one the model takes (contract); copied
        // before `submit` returns.
        submit(model, queue, tag, |net| Ok(InputRef::F32(unsafe { input_arg(net, input, len, "input") }?)), options, request_id)
    }
}

/// Submit a token sequence (`lstm`, `seq2seq`): `tokens[0..len]`, copied before this returns.
/// Same contract and errors as `serve_submit_f32`; a token id ≥ the model's vocabulary or a
/// sequence longer than its maximum is `SERVE_CODE_INVALID_ARGUMENT` (a `len` over the maximum is
/// refused before `tokens` is read).
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_tokens(
    model: *const serve_model,
    queue: *const serve_queue,
    tag: u64,
    tokens: *const u32,
    len: usize,
    options: *const serve_submit_options,
    request_id: *mut u64,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: `tokens` has `len` ids when `len` is one the model takes (contract); copied
        // before `submit` returns.
        submit(model, queue, tag, |net| Ok(InputRef::Tokens(unsafe { input_arg(net, tokens, len, "tokens") }?)), options, request_id)
    }
}

/// Submit a tree (`treelstm`): node `i` has token `tokens[i]` (4294967295 = no input) and parent
/// `parents[i]` (−1 for the root), for `i < len`; any node order. Copied before this returns.
/// Same contract and errors as `serve_submit_f32`; a malformed tree (no root, two roots, a cycle,
/// a parent out of range) is `SERVE_CODE_INVALID_ARGUMENT` naming the node, and so is a `len`
/// over the model's most nodes (refused before either array is read).
#[unsafe(no_mangle)]
pub extern "C" fn serve_submit_tree(
    model: *const serve_model,
    queue: *const serve_queue,
    tag: u64,
    tokens: *const u32,
    parents: *const i32,
    len: usize,
    options: *const serve_submit_options,
    request_id: *mut u64,
) -> *mut serve_error {
    ffi_boundary! {
        submit(model, queue, tag, |net| {
            // SAFETY: both arrays have `len` elements when `len` is one the model takes (contract);
            // copied before `submit` returns.
            let tokens = unsafe { input_arg(net, tokens, len, "tokens") }?;
            // (`len` passed `input_arg` just above.)
            let parents = unsafe { slice_arg(parents, len, "parents") }?;
            Ok(InputRef::Tree { tokens, parents })
        }, options, request_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lengths_over_the_model_maximum_are_refused_without_reading() {
        // Run under Miri in CI: a read past the 3 elements, or a slice of more than isize::MAX
        // bytes, would be reported as UB.
        let lstm = Network::Lstm(crate::model::Lstm::random(8, 2, 2, 1, 1));
        let mlp = Network::Mlp(crate::model::Mlp::random(&[3, 1], 1));
        let three = [1u32, 2, 3];
        for len in [lstm.max_input_len() + 1, usize::MAX / 4 + 1, usize::MAX] {
            // SAFETY: refused before `three` is read (the point of the test).
            let e = unsafe { input_arg(&lstm, three.as_ptr(), len, "tokens") }.unwrap_err();
            assert_eq!(e.code(), crate::Code::InvalidArgument);
            assert!(e.message().contains(&format!("`tokens` has length {len}")), "{e}");
        }
        let x = [0.5f32; 3];
        // SAFETY: as above.
        let e = unsafe { input_arg(&mlp, x.as_ptr(), 4, "input") }.unwrap_err();
        assert!(e.message().contains("this mlp takes exactly 3"), "{e}");
        // SAFETY: `three` has 3 elements.
        assert_eq!(unsafe { input_arg(&lstm, three.as_ptr(), 3, "tokens") }.unwrap(), &three);
        // SAFETY: no element is read for a length no buffer can have.
        let e = unsafe { slice_arg(x.as_ptr(), isize::MAX as usize / 4 + 1, "input") }.unwrap_err();
        assert!(e.message().contains("larger than any buffer"), "{e}");
    }

    #[test]
    fn absolute_deadline_in_the_past_maps_to_now_or_earlier() {
        let o = serve_submit_options { deadline_ns: Some(1), timeout_ns: None, priority: 3 };
        let s = submit_options(Some(&o));
        assert!(s.deadline.unwrap() <= Instant::now());
        assert_eq!(s.priority, 3);
    }

    #[test]
    fn earlier_of_deadline_and_timeout_applies() {
        let far = monotonic_ns() + 60_000_000_000;
        let o = serve_submit_options { deadline_ns: Some(far), timeout_ns: Some(1_000_000), priority: 0 };
        let s = submit_options(Some(&o));
        assert!(s.deadline.unwrap() <= Instant::now() + Duration::from_millis(1));
    }
}
