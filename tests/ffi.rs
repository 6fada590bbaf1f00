//! The C ABI called from Rust: NULL handling, out-parameters untouched on error, error codes,
//! stats. (ffi_examples/c/example.c exercises the same ABI from real C.)

mod common;

use std::ffi::CStr;
use std::ptr::{self, null, null_mut};

use serve::Code;
use serve::ffi::completion::*;
use serve::ffi::error::*;
use serve::ffi::model::*;
use serve::ffi::queue::*;
use serve::ffi::runtime::*;
use serve::ffi::submit::*;

/// Take an error: its code and message, freeing it.
fn take(e: *mut serve_error) -> (Code, String) {
    let code = serve_error_code(e);
    let msg = unsafe { CStr::from_ptr(serve_error_message(e)) }.to_string_lossy().into_owned();
    serve_error_free(e);
    (code, msg)
}

fn ok(e: *mut serve_error) {
    let (code, msg) = take(e);
    assert_eq!(code, Code::Ok, "{msg}");
}

fn cpu_runtime() -> *mut serve_runtime {
    let mut o = null_mut();
    ok(serve_runtime_options_new(&mut o));
    ok(serve_runtime_options_set_backend(o, c"cpu".as_ptr()));
    let mut rt = null_mut();
    ok(serve_runtime_new(o, &mut rt));
    serve_runtime_options_free(o);
    rt
}

#[test]
fn null_arguments_are_invalid_and_out_params_untouched() {
    let sentinel = 0xdead_beef as *mut serve_runtime;
    let mut rt = sentinel;
    let (code, msg) = take(serve_runtime_new(null(), null_mut()));
    assert_eq!(code, Code::InvalidArgument);
    assert!(msg.contains("`out` is NULL"), "{msg}");
    let (code, _) = take(serve_runtime_options_set_backend(null_mut(), c"cpu".as_ptr()));
    assert_eq!(code, Code::InvalidArgument);

    let mut o = null_mut();
    ok(serve_runtime_options_new(&mut o));
    let (code, msg) = take(serve_runtime_options_set_backend(o, c"gpu".as_ptr()));
    assert_eq!(code, Code::InvalidArgument);
    assert!(msg.contains("unknown backend `gpu`"), "{msg}");
    let (code, _) = take(serve_runtime_options_set_admission_bound(o, 0));
    assert_eq!(code, Code::InvalidArgument);
    if serve::backend::cuda::probe().devices == 0 {
        ok(serve_runtime_options_set_backend(o, c"cuda".as_ptr()));
        let (code, msg) = take(serve_runtime_new(o, &mut rt));
        assert_eq!(code, Code::Unavailable, "{msg}");
        assert_eq!(rt, sentinel, "out-parameter untouched on error");
    }
    serve_runtime_options_free(o);

    let rt = cpu_runtime();
    let mut model = 0x10 as *mut serve_model;
    let (code, msg) = take(serve_runtime_load_model(rt, c"/nonexistent/model".as_ptr(), null(), &mut model));
    assert_eq!(code, Code::NotFound, "{msg}");
    assert_eq!(model, 0x10 as *mut serve_model);
    let (code, _) = take(serve_runtime_load_model(rt, null(), null(), &mut model));
    assert_eq!(code, Code::InvalidArgument);
    let (code, _) = take(serve_runtime_cancel(null(), 0));
    assert_eq!(code, Code::InvalidArgument);
    let (code, _) = take(serve_runtime_cancel(rt, 12345));
    assert_eq!(code, Code::InvalidArgument);

    // Every destructor accepts NULL.
    serve_runtime_free(null_mut());
    serve_runtime_options_free(null_mut());
    serve_model_free(null_mut());
    serve_model_options_free(null_mut());
    serve_queue_free(null_mut());
    serve_completion_free(null_mut());
    serve_submit_options_free(null_mut());
    serve_stats_free(null_mut());
    serve_error_free(null_mut());
    serve_runtime_free(rt);
}

#[test]
fn submit_errors_are_counted_and_produce_no_completion() {
    let (dir, _) = common::mlp_dir("ffi-submit", &[4, 2], 1);
    let rt = cpu_runtime();
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = null_mut();
    ok(serve_runtime_load_model(rt, path.as_ptr(), null(), &mut model));
    assert_eq!(unsafe { CStr::from_ptr(serve_model_kind(model)) }.to_str().unwrap(), "mlp");
    assert_eq!((serve_model_input_len(model), serve_model_output_len(model)), (4, 2));
    let mut q = null_mut();
    ok(serve_queue_new(&mut q));
    let x = [1.0f32; 4];
    let mut id = 77u64;

    let (code, msg) = take(serve_submit_f32(model, q, 1, null(), 4, null(), &mut id));
    assert_eq!(code, Code::InvalidArgument);
    assert!(msg.contains("`input` is NULL"), "{msg}");
    let (code, msg) = take(serve_submit_f32(model, q, 1, x.as_ptr(), 3, null(), &mut id));
    assert_eq!(code, Code::InvalidArgument);
    assert!(msg.contains("length 3"), "{msg}");
    let (code, _) = take(serve_submit_f32(model, null(), 1, x.as_ptr(), 4, null(), &mut id));
    assert_eq!(code, Code::InvalidArgument);
    let (code, _) = take(serve_submit_f32(null(), q, 1, x.as_ptr(), 4, null(), &mut id));
    assert_eq!(code, Code::InvalidArgument);
    let (code, _) = take(serve_submit_tokens(model, q, 1, [1u32, 2].as_ptr(), 2, null(), &mut id));
    assert_eq!(code, Code::InvalidArgument);
    let mut so = null_mut();
    ok(serve_submit_options_new(&mut so));
    ok(serve_submit_options_set_deadline_ns(so, serve_now_ns() - 1));
    let (code, _) = take(serve_submit_f32(model, q, 1, x.as_ptr(), 4, so, &mut id));
    assert_eq!(code, Code::DeadlineExceeded);
    assert_eq!(id, 77, "request id untouched on error");

    ok(serve_submit_options_set_deadline_ns(so, 0));
    ok(serve_submit_options_set_priority(so, 3));
    ok(serve_submit_f32(model, q, 9, x.as_ptr(), 4, so, &mut id));
    serve_submit_options_free(so);
    let mut out = [null_mut(); 4];
    let mut n = 0;
    ok(serve_queue_next(q, out.as_mut_ptr(), 4, 10_000_000_000, &mut n));
    assert_eq!(n, 1, "only the good request completes");
    assert_eq!((serve_completion_tag(out[0]), serve_completion_request_id(out[0])), (9, id));
    assert_eq!(serve_completion_code(out[0]), Code::Ok);
    assert!(serve_completion_message(out[0]).is_null());
    let (mut data, mut len) = (ptr::null::<f32>(), 0usize);
    ok(serve_completion_output_f32(out[0], &mut data, &mut len));
    assert_eq!(len, 2);
    let (mut toks, mut tlen) = (ptr::null::<u32>(), 5usize);
    let (code, _) = take(serve_completion_output_tokens(out[0], &mut toks, &mut tlen));
    assert_eq!(code, Code::InvalidArgument);
    assert_eq!(tlen, 5, "out-parameter untouched on error");
    serve_completion_free(out[0]);

    let mut stats = null_mut();
    ok(serve_runtime_stats(rt, &mut stats));
    // Counted: NULL input, wrong length, NULL queue, tokens, deadline (a NULL model has no runtime).
    assert_eq!(serve_stats_rejected(stats), 5);
    assert_eq!(serve_stats_submitted(stats), 1);
    assert_eq!(serve_stats_completed(stats, Code::Ok as u32), 1);
    assert_eq!(serve_stats_completed(stats, 999), 0);
    assert_eq!(serve_stats_in_flight(stats), 0);
    serve_stats_free(stats);

    ok(serve_runtime_shutdown(rt, 0));
    let (code, _) = take(serve_submit_f32(model, q, 1, x.as_ptr(), 4, null(), null_mut()));
    assert_eq!(code, Code::Shutdown);
    serve_queue_free(q);
    serve_model_free(model);
    serve_runtime_free(rt);
}

#[test]
fn callback_queues_cannot_be_drained_or_polled() {
    unsafe extern "C" fn cb(_: *mut std::ffi::c_void, c: *mut serve_completion) {
        serve_completion_free(c);
    }
    let mut q = null_mut();
    let (code, _) = take(serve_queue_new_callback(None, null_mut(), &mut q));
    assert_eq!(code, Code::InvalidArgument);
    assert!(q.is_null());
    ok(serve_queue_new_callback(Some(cb), null_mut(), &mut q));
    let mut n = 0;
    let (code, _) = take(serve_queue_next(q, null_mut(), 0, 0, &mut n));
    assert_eq!(code, Code::InvalidArgument);
    let mut fd = -7;
    let (code, _) = take(serve_queue_fd(q, &mut fd));
    assert_eq!(code, Code::InvalidArgument);
    assert_eq!(fd, -7);
    serve_queue_free(q);
}
