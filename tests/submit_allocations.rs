//! A submit through the C ABI allocates nothing on the caller's thread once its model has warmed
//! up (issue 18, soak): the request's record and input buffer are kept from load
//! (`runtime/recycle.rs`), and its arrival reaches the engine through the model's ring, which is
//! allocated with the model (`runtime/inbox.rs`). Before the ring, std's channel made the
//! submitting thread allocate a block per 31 arrivals, freed by the engine: memory allocated on
//! one thread and freed on another in proportion to the backlog, which made the allocator's
//! arenas creep for as long as a soak ran.
//!
//! A counting global allocator counts the allocations of the one thread that arms it. One test
//! in this file.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::ffi::CString;
use std::path::PathBuf;
use std::ptr::{null, null_mut};

use serve::ffi::completion::*;
use serve::ffi::error::*;
use serve::ffi::model::*;
use serve::ffi::queue::*;
use serve::ffi::runtime::*;
use serve::ffi::submit::*;

struct PerThread;

thread_local! {
    /// Allocations of this thread while armed (`None`: not armed). Const-initialised, so
    /// reading it never allocates.
    static COUNT: Cell<Option<usize>> = const { Cell::new(None) };
}

impl PerThread {
    fn note() {
        // `try_with`: the allocator runs during thread teardown too.
        let _ = COUNT.try_with(|c| {
            if let Some(n) = c.get() {
                c.set(Some(n + 1));
            }
        });
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping touches a
// const-initialised thread-local cell only (it never allocates).
unsafe impl GlobalAlloc for PerThread {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        PerThread::note();
        // SAFETY: forwarded with the caller's layout (the caller upholds `alloc`'s contract).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        PerThread::note();
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        PerThread::note();
        // SAFETY: as in `dealloc`, with the caller's new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: PerThread = PerThread;

fn ok(e: *mut serve_error) {
    assert!(e.is_null(), "libserve error: code {:?}", serve_error_code(e));
}

/// Take every completion the runtime owes, `n` of them, checking each is OK.
fn drain(q: *const serve_queue, mut n: usize) {
    let mut out = vec![null_mut(); 256];
    while n > 0 {
        let mut got = 0;
        ok(serve_queue_next(q, out.as_mut_ptr(), out.len(), 10_000_000_000, &mut got));
        assert!(got > 0, "no completion in 10 s, {n} owed");
        for &c in &out[..got] {
            assert_eq!(serve_completion_code(c), serve::Code::Ok, "a completion failed");
            serve_completion_free(c);
        }
        n -= got;
    }
}

#[test]
fn a_warm_submit_allocates_nothing_on_the_callers_thread() {
    let mut o = null_mut();
    ok(serve_runtime_options_new(&mut o));
    ok(serve_runtime_options_set_backend(o, c"cpu".as_ptr()));
    let mut rt = null_mut();
    ok(serve_runtime_new(o, &mut rt));
    serve_runtime_options_free(o);
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata/mlp_4_8_3");
    let dir = CString::new(dir.to_str().unwrap()).unwrap();
    let mut model = null_mut();
    ok(serve_runtime_load_model(rt, dir.as_ptr(), null(), &mut model));
    let mut q = null_mut();
    ok(serve_queue_new(&mut q));
    let input = [0.5f32, -1.0, 0.25, 2.0];
    let mut id = 0u64;
    let mut burst = |n: usize| {
        for tag in 0..n as u64 {
            ok(serve_submit_f32(model, q, tag, input.as_ptr(), input.len(), null(), &mut id));
        }
    };

    // Warm-up: bursts as large as the armed ones, so every record and buffer a burst needs has
    // been handed back once and this thread's lazily made state exists.
    const BURST: usize = 2_000;
    for _ in 0..3 {
        burst(BURST);
        drain(q, BURST);
    }

    // Armed: bursts of submits with no drain in between, so arrivals pile up behind the engine.
    let mut allocations = 0;
    for _ in 0..5 {
        COUNT.with(|c| c.set(Some(0)));
        burst(BURST);
        allocations += COUNT.with(|c| c.replace(None)).unwrap();
        drain(q, BURST);
    }
    assert_eq!(
        allocations,
        0,
        "{allocations} allocations on the submitting thread over {} warm submits",
        5 * BURST
    );

    ok(serve_runtime_shutdown(rt, 5_000_000_000));
    serve_queue_free(q);
    serve_model_free(model);
    serve_runtime_free(rt);
}
