//! `serve_error`: the error object returned by every fallible function.

use std::ffi::{CString, c_char};

use crate::error::{Code, Error};
use crate::ffi_boundary;

/// An error: a stable code and a message. Returned by fallible functions (NULL means success);
/// owned by the caller, who frees it with `serve_error_free`. Immutable: a `const serve_error *`
/// may be read from several threads at once.
pub struct serve_error {
    code: Code,
    message: CString,
}

impl serve_error {
    pub(crate) fn boxed(e: Error) -> *mut serve_error {
        // Interior NULs cannot be represented in C; replace them rather than lose the message.
        let message = CString::new(e.message().replace('\0', "\\0")).unwrap_or_default();
        super::into_handle(serve_error { code: e.code(), message })
    }
}

/// The code of `error`; `SERVE_CODE_OK` when `error` is NULL (so the result of any fallible call
/// can be passed straight in).
#[unsafe(no_mangle)]
pub extern "C" fn serve_error_code(error: *const serve_error) -> Code {
    ffi_boundary! {
        // SAFETY: NULL or a live serve_error (contract).
        unsafe { error.as_ref() }.map_or(Code::Ok, |e| e.code)
    }
}

/// The message of `error`: UTF-8, NUL-terminated, borrowed from `error` (valid until it is
/// freed). Says what was wrong and where. Returns "" when `error` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_error_message(error: *const serve_error) -> *const c_char {
    ffi_boundary! {
        // SAFETY: NULL or a live serve_error (contract).
        unsafe { error.as_ref() }.map_or(c"".as_ptr(), |e| e.message.as_ptr())
    }
}

/// Free an error. NULL is allowed and ignored.
#[unsafe(no_mangle)]
pub extern "C" fn serve_error_free(error: *mut serve_error) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed error returned by libserve (contract).
        unsafe { super::free_handle(error) }
    }
}

/// The name of a code, as used in messages and `serve infer` output (e.g. "INVALID_ARGUMENT");
/// "UNKNOWN" for a value that is not a `serve_code`. Static storage; never NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_code_name(code: u32) -> *const c_char {
    ffi_boundary! {
        match Code::from_u32(code) {
            Some(c) => c.c_name().as_ptr(),
            None => c"UNKNOWN".as_ptr(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn code_names_match_rust_names() {
        for c in Code::ALL {
            let s = unsafe { CStr::from_ptr(serve_code_name(c as u32)) };
            assert_eq!(s.to_str().unwrap(), c.name());
        }
        let s = unsafe { CStr::from_ptr(serve_code_name(999)) };
        assert_eq!(s.to_str().unwrap(), "UNKNOWN");
    }

    #[test]
    fn null_error_is_ok_and_empty() {
        assert_eq!(serve_error_code(std::ptr::null()), Code::Ok);
        assert_eq!(unsafe { CStr::from_ptr(serve_error_message(std::ptr::null())) }.to_bytes(), b"");
        serve_error_free(std::ptr::null_mut());
    }

    #[test]
    fn error_round_trip_with_interior_nul() {
        let e = serve_error::boxed(Error::invalid("bad\0thing"));
        assert_eq!(serve_error_code(e), Code::InvalidArgument);
        let m = unsafe { CStr::from_ptr(serve_error_message(e)) }.to_str().unwrap().to_string();
        assert_eq!(m, "bad\\0thing");
        serve_error_free(e);
    }
}
