//! `serve_queue`: completion queues, drained in batches or watched through an eventfd, or in
//! callback mode.

use std::ffi::c_void;
use std::time::Duration;

use crate::error::Error;
use crate::ffi::completion::serve_completion;
use crate::ffi::error::serve_error;
use crate::ffi::{arg, free_handle, into_handle, out_arg, write_out};
use crate::ffi_boundary;
use crate::runtime::CompletionQueue;

/// A completion queue, owned by the caller. Thread-safe: any number of threads may submit with it
/// and drain it concurrently. Free it only when no thread uses it; completions still pending
/// then (or arriving later) are discarded.
pub struct serve_queue {
    pub(crate) q: CompletionQueue,
}

/// Called on libserve's completion thread with each completion of a callback queue, in completion
/// order. The callee owns `completion` and frees it with `serve_completion_free` (it may keep it).
/// It must not block: it delays every later completion of the queue. It must not unwind (C++
/// exception) or longjmp out. It may call any libserve function except `serve_queue_free` on its
/// own queue.
pub type serve_completion_callback =
    Option<unsafe extern "C" fn(user_data: *mut c_void, completion: *mut serve_completion)>;

/// Create a completion queue drained with `serve_queue_next` (and, on Linux, watchable through
/// `serve_queue_fd`).
#[unsafe(no_mangle)]
pub extern "C" fn serve_queue_new(out: *mut *mut serve_queue) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        let q = CompletionQueue::new()?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_queue { q })) };
        Ok(())
    }
}

/// `user_data` travels to the callback thread; the caller vouches that it may.
struct UserData(*mut c_void);
// SAFETY: the header's contract for serve_queue_new_callback: user_data must be usable from
// libserve's completion thread. libserve itself never dereferences it.
unsafe impl Send for UserData {}

/// Create a callback-mode queue: each completion is passed to `callback(user_data, completion)`
/// on a thread libserve owns for this queue. `user_data` must stay valid, and be usable from that
/// thread, until `serve_queue_free` returns; after it returns the callback is never called again.
/// Callback queues cannot be drained and have no fd.
#[unsafe(no_mangle)]
pub extern "C" fn serve_queue_new_callback(
    callback: serve_completion_callback,
    user_data: *mut c_void,
    out: *mut *mut serve_queue,
) -> *mut serve_error {
    ffi_boundary! {
        out_arg(out, "out")?;
        let cb = callback.ok_or_else(|| Error::invalid("`callback` is NULL"))?;
        let ud = UserData(user_data);
        let q = CompletionQueue::with_callback(move |c| {
            let ud = &ud;
            let completion = into_handle(serve_completion::from(c));
            // SAFETY: the callback and user_data are valid per the contract above; the callee
            // takes ownership of `completion`.
            unsafe { cb(ud.0, completion) };
        })?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(out, into_handle(serve_queue { q })) };
        Ok(())
    }
}

/// Free a queue. Undelivered completions, and any that arrive later, are discarded; in callback
/// mode this waits for a callback in progress to return, after which the callback is never called
/// again. NULL is allowed.
#[unsafe(no_mangle)]
pub extern "C" fn serve_queue_free(queue: *mut serve_queue) {
    ffi_boundary! {
        // SAFETY: NULL or an unfreed handle from serve_queue_new*.
        unsafe { free_handle(queue) }
    }
}

/// Wait up to `timeout_ns` nanoseconds for at least one completion, then move up to `max` of them
/// into `completions[0..*count]` (the caller owns each one and frees it with
/// `serve_completion_free`). `*count` is 0 on timeout, and at once when `max` is 0. `timeout_ns` 0
/// polls without waiting; `UINT64_MAX` waits without limit. Fails with `SERVE_CODE_INVALID_ARGUMENT` on a callback queue.
#[unsafe(no_mangle)]
pub extern "C" fn serve_queue_next(
    queue: *const serve_queue,
    completions: *mut *mut serve_completion,
    max: usize,
    timeout_ns: u64,
    count: *mut usize,
) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let q = unsafe { arg(queue, "queue") }?;
        out_arg(count, "count")?;
        if max > 0 {
            out_arg(completions, "completions")?;
        }
        let timeout = if timeout_ns == u64::MAX { Duration::MAX } else { Duration::from_nanos(timeout_ns) };
        let mut got = Vec::with_capacity(max.min(1024));
        let n = q.q.next_into(&mut got, max, timeout)?;
        for (i, c) in got.into_iter().enumerate() {
            // SAFETY: `completions` has room for `max` pointers (contract) and i < n <= max.
            unsafe { completions.add(i).write(into_handle(serve_completion::from(c))) };
        }
        // SAFETY: checked non-NULL.
        unsafe { write_out(count, n) };
        Ok(())
    }
}

/// A file descriptor that is readable exactly while completions are pending: add it to
/// epoll / poll / asio / Go's netpoller, then call `serve_queue_next`. Only poll it: never read,
/// write or close it. Owned by the queue; valid until `serve_queue_free`. Fails with
/// `SERVE_CODE_INVALID_ARGUMENT` on a callback queue and `SERVE_CODE_UNSUPPORTED` on platforms
/// without eventfd.
#[unsafe(no_mangle)]
pub extern "C" fn serve_queue_fd(queue: *const serve_queue, fd: *mut i32) -> *mut serve_error {
    ffi_boundary! {
        // SAFETY: checked for NULL; validity is the caller's contract.
        let q = unsafe { arg(queue, "queue") }?;
        out_arg(fd, "fd")?;
        if q.q.is_callback() {
            return Err(Error::invalid("a callback queue has no fd"));
        }
        let raw = q.q.fd().ok_or_else(|| {
            Error::new(crate::Code::Unsupported, "completion fds need Linux eventfd")
        })?;
        // SAFETY: checked non-NULL.
        unsafe { write_out(fd, raw) };
        Ok(())
    }
}
