//! The C ABI called from Rust: NULL handling, out-parameters untouched on error, error codes,
//! stats and metrics. (ffi_examples/c/example.c exercises the same ABI from real C.)

mod common;

use std::ffi::CStr;
use std::ptr::{self, null, null_mut};

use serve::Code;
use serve::ffi::completion::*;
use serve::ffi::error::*;
use serve::ffi::metrics::*;
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
    let (code, _) = take(serve_runtime_options_set_stall_timeout_ns(null_mut(), 1));
    assert_eq!(code, Code::InvalidArgument);
    ok(serve_runtime_options_set_stall_timeout_ns(o, 0)); // watchdog off
    ok(serve_runtime_options_set_stall_timeout_ns(o, u64::MAX));
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
    assert!(serve_stats_engine_busy_ns(stats) > 0, "the engine thread handled the request");
    assert_eq!(serve_stats_engine_busy_ns(null()), 0, "a NULL handle reads 0");
    serve_stats_free(stats);

    // The same counts in the metrics, labelled with the model's name (its directory's) and code.
    let name = dir.file_name().unwrap().to_str().unwrap();
    let mut metrics = null_mut();
    ok(serve_runtime_metrics(rt, &mut metrics));
    let mut len = 0usize;
    let text = serve_metrics_text(metrics, &mut len);
    let text = unsafe { CStr::from_ptr(text) }.to_str().unwrap().to_owned();
    assert_eq!(len, text.len());
    serve_metrics_free(metrics);
    let e = common::openmetrics::Exposition::parse(&text);
    let count = |family: &str, code: Code| e.get(family, &[("model", name), ("code", code.name())]);
    assert_eq!(count("serve_requests_rejected_total", Code::InvalidArgument), Some(4.0));
    assert_eq!(count("serve_requests_rejected_total", Code::DeadlineExceeded), Some(1.0));
    assert_eq!(count("serve_requests_completed_total", Code::Ok), Some(1.0));
    // NULL handling: an error, the out-parameter untouched; a NULL handle's text is empty.
    let mut untouched = ptr::dangling_mut::<serve_metrics>();
    assert_eq!(take(serve_runtime_metrics(null(), &mut untouched)).0, Code::InvalidArgument);
    assert_eq!(untouched, ptr::dangling_mut());
    assert_eq!(take(serve_runtime_metrics(rt, null_mut())).0, Code::InvalidArgument);
    let mut len = 9usize;
    assert_eq!(unsafe { CStr::from_ptr(serve_metrics_text(null(), &mut len)) }.to_bytes(), b"");
    assert_eq!(len, 0);
    serve_metrics_free(null_mut());

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

/// `count` `T`s ending exactly at a page boundary followed by an inaccessible page: reading one
/// element past them faults, so a submit that reads beyond what it was given crashes the test
/// instead of passing by luck. Returns the elements' pointer and the mapping (to unmap).
fn guarded<T: Copy>(values: &[T]) -> (*const T, *mut libc::c_void, usize) {
    // SAFETY: plain libc calls on a fresh private anonymous mapping of two pages; the values are
    // written inside the first page, which is readable and writable.
    unsafe {
        let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
        let bytes = std::mem::size_of_val(values);
        assert!(bytes <= page);
        let base = libc::mmap(
            null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(base, libc::MAP_FAILED);
        assert_eq!(libc::mprotect(base.cast::<u8>().add(page).cast(), page, libc::PROT_NONE), 0);
        let p = base.cast::<u8>().add(page - bytes).cast::<T>();
        ptr::copy_nonoverlapping(values.as_ptr(), p, values.len());
        (p, base, 2 * page)
    }
}

fn load(rt: *mut serve_runtime, dir: &std::path::Path) -> *mut serve_model {
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = null_mut();
    ok(serve_runtime_load_model(rt, path.as_ptr(), null(), &mut model));
    model
}

fn refused(e: *mut serve_error, want: &[&str]) {
    let (code, msg) = take(e);
    assert_eq!(code, Code::InvalidArgument, "{msg}");
    for w in want {
        assert!(msg.contains(w), "`{w}` not in: {msg}");
    }
}

#[test]
fn submit_lengths_are_checked_against_the_model_before_the_input_is_read() {
    let rt = cpu_runtime();
    let (dir, _) = common::mlp_dir("ffi-len", &[4, 2], 1);
    let mlp = load(rt, &dir);
    let testdata = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata");
    let lstm = load(rt, &testdata.join("lstm_small"));
    let tree = load(rt, &testdata.join("treelstm_small"));
    let max_len = 1024; // lstm.rs DEFAULT_MAX_LEN and treelstm.rs DEFAULT_MAX_NODES (no key set)
    let mut q = null_mut();
    ok(serve_queue_new(&mut q));

    // SIZE_MAX: refused naming the argument, the length and the model's maximum (it used to be
    // UB: `slice::from_raw_parts` with more than isize::MAX bytes).
    let x = [1.0f32; 4];
    let max = usize::MAX.to_string();
    refused(
        serve_submit_f32(mlp, q, 1, x.as_ptr(), usize::MAX, null(), null_mut()),
        &["`input`", &max, "exactly 4"],
    );
    let t = [1u32; 4];
    refused(
        serve_submit_tokens(lstm, q, 1, t.as_ptr(), usize::MAX, null(), null_mut()),
        &["`tokens`", &max, "at most 1024"],
    );
    let p = [-1i32, 0, 0, 0];
    refused(
        serve_submit_tree(tree, q, 1, t.as_ptr(), p.as_ptr(), usize::MAX, null(), null_mut()),
        &["`tokens`", &max, "at most 1024"],
    );
    refused(
        serve_submit_f32(lstm, q, 1, x.as_ptr(), usize::MAX, null(), null_mut()),
        &["`input`", &max, "at most 1024"],
    );

    // The model's maximum + 1, with a buffer that really has that many elements.
    let tokens = vec![1u32; max_len + 1];
    let parents: Vec<i32> = (0..=max_len as i32).map(|i| i - 1).collect();
    refused(
        serve_submit_tokens(lstm, q, 1, tokens.as_ptr(), max_len + 1, null(), null_mut()),
        &["`tokens` has length 1025", "at most 1024"],
    );
    refused(
        serve_submit_tree(tree, q, 1, tokens.as_ptr(), parents.as_ptr(), max_len + 1, null(), null_mut()),
        &["has length 1025", "at most 1024"],
    );
    let x5 = [1.0f32; 5];
    refused(
        serve_submit_f32(mlp, q, 1, x5.as_ptr(), 5, null(), null_mut()),
        &["`input` has length 5", "exactly 4"],
    );

    // A length beyond the buffer: the pointer is valid for 3 elements only, and the page after
    // them is inaccessible. Sound only because nothing is read: the length is refused first (a
    // read past the 3 elements would fault).
    let (tp, map, map_len) = guarded(&[1u32, 2, 3]);
    let (pp, pmap, pmap_len) = guarded(&[-1i32, 0, 0]);
    let (xp, xmap, xmap_len) = guarded(&[1.0f32, 2.0, 3.0]);
    refused(serve_submit_tokens(lstm, q, 1, tp, max_len + 1, null(), null_mut()), &["has length 1025"]);
    refused(serve_submit_tree(tree, q, 1, tp, pp, 1 << 40, null(), null_mut()), &["at most 1024"]);
    refused(serve_submit_f32(mlp, q, 1, xp, 5, null(), null_mut()), &["has length 5"]);
    // The same buffers with their true lengths are read (and the mlp's is 1 short).
    let mut id = 0;
    ok(serve_submit_tokens(lstm, q, 2, tp, 3, null(), &mut id));
    ok(serve_submit_tree(tree, q, 3, tp, pp, 3, null(), &mut id));
    refused(serve_submit_f32(mlp, q, 1, xp, 3, null(), null_mut()), &["input has length 3"]);

    // len 0 with a non-NULL pointer is the empty-input error, as with NULL.
    refused(serve_submit_f32(mlp, q, 1, x.as_ptr(), 0, null(), null_mut()), &["empty input"]);
    refused(serve_submit_tokens(lstm, q, 1, t.as_ptr(), 0, null(), null_mut()), &["empty token sequence"]);
    refused(serve_submit_tree(tree, q, 1, t.as_ptr(), p.as_ptr(), 0, null(), null_mut()), &["empty"]);

    let mut out = [null_mut(); 4];
    let (mut got, mut n) = (0, 0);
    while got < 2 {
        ok(serve_queue_next(q, out.as_mut_ptr(), 4, 10_000_000_000, &mut n));
        for c in &out[..n] {
            assert_eq!(serve_completion_code(*c), Code::Ok);
            serve_completion_free(*c);
        }
        got += n;
    }
    // Every other submit was refused: none of them can complete later.
    let mut stats = null_mut();
    ok(serve_runtime_stats(rt, &mut stats));
    assert_eq!(serve_stats_submitted(stats), 2, "only the two good requests were accepted");
    serve_stats_free(stats);
    // SAFETY: the mappings made by `guarded`, no longer used.
    unsafe {
        libc::munmap(map, map_len);
        libc::munmap(pmap, pmap_len);
        libc::munmap(xmap, xmap_len);
    }
    serve_queue_free(q);
    for m in [mlp, lstm, tree] {
        serve_model_free(m);
    }
    serve_runtime_free(rt);
}

#[test]
fn non_finite_inputs_are_refused_through_the_c_abi_and_the_rust_api() {
    let (dir, _) = common::mlp_dir("ffi-nan", &[4, 2], 1);
    let rt = cpu_runtime();
    let model = load(rt, &dir);
    let mut q = null_mut();
    ok(serve_queue_new(&mut q));
    for (i, bad, name) in [(3, f32::NAN, "NaN"), (0, f32::INFINITY, "inf"), (2, f32::NEG_INFINITY, "-inf")] {
        let mut x = [0.5f32; 4];
        x[i] = bad;
        let want = format!("input element {i} is {name}; inputs must be finite");
        refused(serve_submit_f32(model, q, 1, x.as_ptr(), 4, null(), null_mut()), &[&want]);
    }
    let mut stats = null_mut();
    ok(serve_runtime_stats(rt, &mut stats));
    assert_eq!((serve_stats_rejected(stats), serve_stats_submitted(stats)), (3, 0));
    serve_stats_free(stats);
    serve_queue_free(q);
    serve_model_free(model);
    serve_runtime_free(rt);

    let rt = serve::Runtime::builder().backend(serve::BackendChoice::Cpu).build().unwrap();
    let model = rt.load_model(&dir, serve::ModelOptions::default()).unwrap();
    let Err(e) = model.submit(serve::Input::F32(vec![1.0, 2.0, 3.0, f32::NAN]), Default::default()) else {
        panic!("a NaN input was accepted")
    };
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("input element 3 is NaN; inputs must be finite"), "{e}");
    // The model keeps serving.
    let y = model.submit(serve::Input::F32(vec![1.0; 4]), Default::default()).unwrap().wait().unwrap();
    assert!(matches!(y, serve::Output::F32(v) if v.iter().all(|x| x.is_finite())));
}

/// A completion holds its request's place under the admission bound until it is freed: drained
/// but not freed still counts.
#[test]
fn a_completion_holds_its_admission_place_until_freed() {
    let (dir, _) = common::mlp_dir("ffi-permit", &[4, 2], 2);
    let rt = cpu_runtime();
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_admission_bound(mo, 1));
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = null_mut();
    ok(serve_runtime_load_model(rt, path.as_ptr(), mo, &mut model));
    serve_model_options_free(mo);
    let mut q = null_mut();
    ok(serve_queue_new(&mut q));
    let x = [1.0f32; 4];
    let mut id = 0;
    ok(serve_submit_f32(model, q, 1, x.as_ptr(), 4, null(), &mut id));
    let mut out = [null_mut(); 1];
    let mut n = 0;
    ok(serve_queue_next(q, out.as_mut_ptr(), 1, 10_000_000_000, &mut n));
    assert_eq!(n, 1);
    let (code, msg) = take(serve_submit_f32(model, q, 2, x.as_ptr(), 4, null(), &mut id));
    assert_eq!(code, Code::Busy, "drained but not freed still holds the place: {msg}");
    serve_completion_free(out[0]);
    ok(serve_submit_f32(model, q, 3, x.as_ptr(), 4, null(), &mut id));
    ok(serve_queue_next(q, out.as_mut_ptr(), 1, 10_000_000_000, &mut n));
    assert_eq!((n, serve_completion_tag(out[0])), (1, 3));
    serve_completion_free(out[0]);
    serve_queue_free(q);
    serve_model_free(model);
    serve_runtime_free(rt);
}

/// Elastic (N-Ebird, E-Ebird) and adaptive batching chosen and set through the C ABI, and every
/// bad setting refused with a message naming it.
#[test]
fn elastic_and_adaptive_policies_through_the_c_abi() {
    let (dir, _) = common::mlp_dir("ffi-elastic", &[4, 2], 3);
    let path = std::ffi::CString::new(dir.to_str().unwrap()).unwrap();
    let rt = cpu_runtime();
    let serve_with = |mo: *mut serve_model_options| {
        let mut model = null_mut();
        ok(serve_runtime_load_model(rt, path.as_ptr(), mo, &mut model));
        serve_model_options_free(mo);
        let mut q = null_mut();
        ok(serve_queue_new(&mut q));
        let x = [0.5f32; 4];
        let mut id = 0;
        for tag in 0..40 {
            ok(serve_submit_f32(model, q, tag, x.as_ptr(), 4, null(), &mut id));
        }
        let mut out = [null_mut(); 40];
        let mut seen = 0;
        while seen < 40 {
            let mut n = 0;
            ok(serve_queue_next(q, out.as_mut_ptr(), 40, 10_000_000_000, &mut n));
            for c in &out[..n] {
                if serve_completion_code(*c) != Code::Ok {
                    let msg = unsafe { CStr::from_ptr(serve_completion_message(*c)) };
                    panic!("{:?}: {msg:?}", serve_completion_code(*c));
                }
                serve_completion_free(*c);
            }
            seen += n;
        }
        serve_queue_free(q);
        serve_model_free(model);
    };
    // N-Ebird over workers {1, 2, 4}, MaxInf 4, a ring of 64 (all 40 requests fit).
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_policy(mo, SERVE_POLICY_ELASTIC));
    ok(serve_model_options_set_elastic_workers(mo, [1u32, 2, 4].as_ptr(), 3));
    ok(serve_model_options_set_max_inflight(mo, 4));
    ok(serve_model_options_set_ring_slots(mo, 64));
    serve_with(mo);
    // E1: each input copied once, into the ring; every batch read there in place.
    let mut stats = null_mut();
    ok(serve_runtime_stats(rt, &mut stats));
    assert_eq!((serve_stats_ring_copies(stats), serve_stats_gather_copies(stats)), (40, 0));
    serve_stats_free(stats);
    // E-Ebird from two levels (the engine: their union plus 1 and 2).
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_policy(mo, SERVE_POLICY_ELASTIC));
    ok(serve_model_options_add_engine_config(mo, 4, [2u32, 2].as_ptr(), 2));
    ok(serve_model_options_add_engine_config(mo, 8, [4u32, 4].as_ptr(), 2));
    ok(serve_model_options_set_max_inflight(mo, 8));
    serve_with(mo);
    // Adaptive, serial and async.
    for streams in [1, 2] {
        let mut mo = null_mut();
        ok(serve_model_options_new(&mut mo));
        ok(serve_model_options_set_policy(mo, SERVE_POLICY_ADAPTIVE));
        ok(serve_model_options_set_latency_bound_ns(mo, 20_000_000));
        ok(serve_model_options_set_streams(mo, streams));
        ok(serve_model_options_set_max_batch(mo, 8));
        serve_with(mo);
    }

    // Bad settings: refused by the setter, or at load for a policy that lacks the option.
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    refused(serve_model_options_set_policy(mo, 6), &["unknown policy 6"]);
    refused(serve_model_options_set_elastic_workers(mo, null(), 2), &["batch_sizes"]);
    refused(serve_model_options_set_elastic_workers(mo, [1u32].as_ptr(), 0), &["0 entries"]);
    refused(serve_model_options_set_elastic_workers(mo, [1u32; 300].as_ptr(), 300), &["300 entries"]);
    refused(serve_model_options_set_elastic_workers(mo, [1u32, 0].as_ptr(), 2), &["max batch"]);
    refused(serve_model_options_add_engine_config(mo, 8, [4u32, 2].as_ptr(), 2), &["sums to 6"]);
    refused(serve_model_options_set_ring_slots(mo, 0), &["ring slots"]);
    refused(serve_model_options_set_latency_bound_ns(mo, 0), &["latency bound"]);
    refused(serve_model_options_set_streams(mo, 3), &["3 streams"]);
    let load_refused = |mo: *mut serve_model_options, want: &[&str]| {
        let mut model = null_mut();
        refused(serve_runtime_load_model(rt, path.as_ptr(), mo, &mut model), want);
        assert!(model.is_null());
        serve_model_options_free(mo);
    };
    // A latency bound under the elastic policy; elastic workers under the timeout policy; a max
    // batch under elastic; elastic workers without a batch size 1.
    ok(serve_model_options_set_policy(mo, SERVE_POLICY_ELASTIC));
    ok(serve_model_options_set_latency_bound_ns(mo, 1_000_000));
    load_refused(mo, &["adaptive policy", "uses elastic"]);
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_elastic_workers(mo, [1u32].as_ptr(), 1));
    load_refused(mo, &["elastic policy", "uses timeout"]);
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_policy(mo, SERVE_POLICY_ELASTIC));
    ok(serve_model_options_set_max_batch(mo, 8));
    load_refused(mo, &["batch sizes"]);
    let mut mo = null_mut();
    ok(serve_model_options_new(&mut mo));
    ok(serve_model_options_set_policy(mo, SERVE_POLICY_ELASTIC));
    ok(serve_model_options_set_elastic_workers(mo, [2u32, 4].as_ptr(), 2));
    load_refused(mo, &["batch size 1"]);
    serve_runtime_free(rt);
}
