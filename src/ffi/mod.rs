//! The C ABI (`include/libserve.h`, generated from this module by cbindgen).
//!
//! A thin translation over the Rust API: one module per C handle type, every export wrapped in
//! [`ffi_boundary!`](crate::ffi_boundary) (panics become `SERVE_CODE_INTERNAL`, never unwind into C),
//! every pointer checked, out-parameters written only on success.
//!
//! Conventions (also stated in the header's preamble):
//! * Fallible functions return `serve_error *`: NULL on success, else an error the caller frees
//!   with `serve_error_free`.
//! * `**out` parameters transfer ownership to the caller; each constructor has one `_free`,
//!   which accepts NULL.
//! * `const T *` handles may be used from several threads at once; `T *` ones may not.

#![allow(non_camel_case_types)]
// Exports are safe `extern "C" fn`s that dereference caller pointers: their safety contract is
// the C header's (valid or NULL pointers), checked for NULL here, as in rustls-ffi.
#![allow(clippy::not_unsafe_ptr_arg_deref)]

pub mod completion;
pub mod custom;
pub mod error;
pub mod metrics;
pub mod model;
pub mod queue;
pub mod runtime;
pub mod submit;
pub mod tenant;
pub mod version;

use std::ffi::{CStr, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Code, Error, Result};
use error::serve_error;

/// The panic boundary every export goes through. The closure's result is converted to the
/// export's C return type by [`FfiReturn`]; a panic becomes that type's failure value (an
/// `INTERNAL` error for `serve_error *`).
#[macro_export]
#[doc(hidden)]
macro_rules! ffi_boundary {
    ($($body:tt)*) => {
        $crate::ffi::guard(move || { $($body)* })
    };
}

/// A C return type and how a Rust result becomes it.
pub trait FfiReturn: Sized {
    type Body;
    fn from_body(body: Self::Body) -> Self;
    fn on_panic(message: String) -> Self;
}

impl FfiReturn for *mut serve_error {
    type Body = Result<()>;
    fn from_body(body: Result<()>) -> Self {
        match body {
            Ok(()) => std::ptr::null_mut(),
            Err(e) => serve_error::boxed(e),
        }
    }
    fn on_panic(message: String) -> Self {
        serve_error::boxed(Error::internal(format!("libserve panicked: {message}")))
    }
}

macro_rules! plain_return {
    ($($t:ty => $v:expr),*) => {$(
        impl FfiReturn for $t {
            type Body = $t;
            fn from_body(body: $t) -> $t { body }
            fn on_panic(_: String) -> $t { $v }
        }
    )*};
}
plain_return!(() => (), u64 => 0, usize => 0, Code => Code::Internal, *const c_char => c"".as_ptr());

#[doc(hidden)]
pub fn guard<R: FfiReturn>(f: impl FnOnce() -> R::Body) -> R {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(body) => R::from_body(body),
        Err(p) => R::on_panic(crate::backend::cpu::stream::panic_message(&*p)),
    }
}

/// Borrow a `const T *` argument; NULL is `INVALID_ARGUMENT` naming the argument.
///
/// # Safety
/// `p` is NULL or points to a live `T` for the duration of the call.
pub(crate) unsafe fn arg<'a, T>(p: *const T, name: &str) -> Result<&'a T> {
    // SAFETY: the caller's contract (documented on every export) makes non-NULL pointers valid.
    unsafe { p.as_ref() }.ok_or_else(|| null_arg(name))
}

/// Borrow a `T *` argument mutably; NULL is `INVALID_ARGUMENT`.
///
/// # Safety
/// `p` is NULL or points to a live `T` not used by anyone else during the call.
pub(crate) unsafe fn arg_mut<'a, T>(p: *mut T, name: &str) -> Result<&'a mut T> {
    // SAFETY: as above; exclusivity is the documented contract of non-const handles.
    unsafe { p.as_mut() }.ok_or_else(|| null_arg(name))
}

/// Check an out-parameter before any work is done, so a NULL one fails without side effects.
pub(crate) fn out_arg<T>(p: *mut T, name: &str) -> Result<()> {
    if p.is_null() { Err(null_arg(name)) } else { Ok(()) }
}

/// Store `v` through a checked out-parameter.
///
/// # Safety
/// `p` was accepted by [`out_arg`] and points to writable memory for a `T`.
pub(crate) unsafe fn write_out<T>(p: *mut T, v: T) {
    // SAFETY: non-NULL (checked by out_arg) and writable by the caller's contract.
    unsafe { p.write(v) }
}

/// Move a value to the heap and hand the C caller ownership of it.
pub(crate) fn into_handle<T>(v: T) -> *mut T {
    Box::into_raw(Box::new(v))
}

/// Take back ownership of a handle made by [`into_handle`] and drop it; NULL is ignored.
///
/// # Safety
/// `p` is NULL or came from `into_handle::<T>` and has not been freed.
pub(crate) unsafe fn free_handle<T>(p: *mut T) {
    if !p.is_null() {
        // SAFETY: the caller's contract: `p` is an unfreed Box<T> from into_handle.
        drop(unsafe { Box::from_raw(p) });
    }
}

/// Read a NUL-terminated string argument as UTF-8.
///
/// # Safety
/// `p` is NULL or a valid NUL-terminated string.
pub(crate) unsafe fn str_arg<'a>(p: *const c_char, name: &str) -> Result<&'a str> {
    if p.is_null() {
        return Err(null_arg(name));
    }
    // SAFETY: non-NULL and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(p) }.to_str().map_err(|_| Error::invalid(format!("`{name}` is not valid UTF-8")))
}

/// A slice from a (pointer, length) pair; NULL is allowed only with length 0. A length no
/// buffer can have (more than `isize::MAX` bytes, `slice::from_raw_parts`'s precondition) is
/// `INVALID_ARGUMENT` without touching `p`. Callers that know a tighter bound check it first
/// (the submit functions check the model's maximum input length).
///
/// # Safety
/// If `len > 0`, `p` points to `len` readable, initialised `T`s.
pub(crate) unsafe fn slice_arg<'a, T>(p: *const T, len: usize, name: &str) -> Result<&'a [T]> {
    if len == 0 {
        return Ok(&[]);
    }
    if len > isize::MAX as usize / size_of::<T>().max(1) {
        return Err(Error::invalid(format!("`{name}` has length {len}: larger than any buffer can be")));
    }
    if p.is_null() {
        return Err(null_arg(name));
    }
    // SAFETY: non-NULL with `len` elements by the caller's contract; `len * size_of::<T>()` is at
    // most `isize::MAX` (checked above).
    Ok(unsafe { std::slice::from_raw_parts(p, len) })
}

fn null_arg(name: &str) -> Error {
    Error::new(Code::InvalidArgument, format!("`{name}` is NULL"))
}
