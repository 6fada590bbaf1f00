//! `serve_completion`: one finished request, with its output or error.

use std::ffi::{CString, c_char};

use crate::error::{Code, Error};
use crate::ffi::error::serve_error;
use crate::ffi::{arg, free_handle, out_arg, write_out};
use crate::ffi_boundary;
use crate::model::Output;
use crate::runtime::Completion;
use crate::runtime::admission::Permit;

/// A finished request: its tag and id, a code, and its output (on success) or error message.
/// Owned by the caller, who frees it with `serve_completion_free`; outputs and messages borrowed
/// from it are valid until then. Immutable: a `const serve_completion *` may be read from several
/// threads.
pub struct serve_completion {
    id: u64,
    tag: u64,
    code: Code,
    output: Option<Output>,
    message: Option<CString>,
    /// The request's admission place, released by `serve_completion_free`.
    permit: Option<Permit>,
}

impl Drop for serve_completion {
    /// The output's buffer goes back to its model for a later request (runtime/recycle.rs).
    fn drop(&mut self) {
        if let (Some(Output::F32(v)), Some(p)) = (self.output.take(), &self.permit) {
            p.recycler().put_output(v);
        }
    }
}

impl From<Completion> for serve_completion {
    fn from(c: Completion) -> Self {
        let (code, output, message) = match c.result {
            Ok(o) => (Code::Ok, Some(o), None),
            Err(e) => (e.code(), None, CString::new(e.message().replace('\0', "\\0")).ok()),
        };
        serve_completion { id: c.id, tag: c.tag, code, output, message, permit: c.permit }
    }
}

/// The tag given at submit; 0 if `completion` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_tag(completion: *const serve_completion) -> u64 {
    // SAFETY: NULL or a live completion (contract).
    ffi_boundary! { unsafe { completion.as_ref() }.map_or(0, |c| c.tag) }
}

/// The request id submit returned; 0 if `completion` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_request_id(completion: *const serve_completion) -> u64 {
    // SAFETY: NULL or a live completion (contract).
    ffi_boundary! { unsafe { completion.as_ref() }.map_or(0, |c| c.id) }
}

/// `SERVE_CODE_OK`, or the code the request failed with (`SERVE_CODE_CANCELLED`,
/// `SERVE_CODE_DEADLINE_EXCEEDED`, `SERVE_CODE_BACKEND`, …). `SERVE_CODE_INVALID_ARGUMENT` if
/// `completion` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_code(completion: *const serve_completion) -> Code {
    // SAFETY: NULL or a live completion (contract).
    ffi_boundary! { unsafe { completion.as_ref() }.map_or(Code::InvalidArgument, |c| c.code) }
}

/// The error message of a failed request (borrowed, NUL-terminated); NULL when it succeeded or
/// `completion` is NULL.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_message(completion: *const serve_completion) -> *const c_char {
    ffi_boundary! {
        // SAFETY: NULL or a live completion (contract).
        unsafe { completion.as_ref() }
            .and_then(|c| c.message.as_ref())
            .map_or(std::ptr::null(), |m| m.as_ptr())
    }
}

/// The f32 output of a successful request (`mlp`, `lstm`, `treelstm`): `*data` points to `*len`
/// values borrowed from `completion`. Fails with the request's own code if it failed, and with
/// `SERVE_CODE_INVALID_ARGUMENT` if its output is tokens.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_output_f32(
    completion: *const serve_completion,
    data: *mut *const f32,
    len: *mut usize,
) -> *mut serve_error {
    ffi_boundary! {
        borrow_output(completion, data, len, |o| match o {
            Output::F32(v) => Ok(v),
            Output::Tokens(_) => Err("this completion's output is tokens; use serve_completion_output_tokens"),
        })
    }
}

/// The token output of a successful request (`seq2seq`): `*data` points to `*len` token ids
/// borrowed from `completion`. Fails with the request's own code if it failed, and with
/// `SERVE_CODE_INVALID_ARGUMENT` if its output is f32 values.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_output_tokens(
    completion: *const serve_completion,
    data: *mut *const u32,
    len: *mut usize,
) -> *mut serve_error {
    ffi_boundary! {
        borrow_output(completion, data, len, |o| match o {
            Output::Tokens(v) => Ok(v),
            Output::F32(_) => Err("this completion's output is f32 values; use serve_completion_output_f32"),
        })
    }
}

/// Lend the completion's output of the kind `pick` selects through `(data, len)`.
fn borrow_output<T>(
    completion: *const serve_completion,
    data: *mut *const T,
    len: *mut usize,
    pick: impl FnOnce(&Output) -> Result<&Vec<T>, &'static str>,
) -> crate::Result<()> {
    // SAFETY: checked for NULL; validity is the caller's contract.
    let c = unsafe { arg(completion, "completion") }?;
    out_arg(data, "data")?;
    out_arg(len, "len")?;
    let v = pick(output(c)?).map_err(Error::invalid)?;
    // SAFETY: both checked non-NULL; the pointer borrows from `completion`, as documented.
    unsafe {
        write_out(data, v.as_ptr());
        write_out(len, v.len());
    }
    Ok(())
}

fn output(c: &serve_completion) -> crate::Result<&Output> {
    c.output.as_ref().ok_or_else(|| {
        let msg = c.message.as_ref().map_or_else(String::new, |m| m.to_string_lossy().into_owned());
        Error::new(c.code, format!("the request failed: {msg}"))
    })
}

/// Free a completion and the output it holds, and release the request's place under its
/// model's admission bound. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_completion_free(completion: *mut serve_completion) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed completion handed out by libserve.
        unsafe { free_handle(completion) }
    }
}
