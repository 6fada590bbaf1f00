//! Serving within the admission bounds never grows a table (issue 18, soak): the request tables
//! of the engine core and of every policy, and the engine's outbox, are reserved for a model's
//! admission bound when it is added (`Policy::reserve`, `sched::IdTable`), so once a
//! runtime has warmed up, fills to its bounds, overload bursts and drains allocate nothing
//! large. Before the reservation the request tables doubled late and unpredictably (hashbrown
//! doubles a table under churn whenever its live entries exceed half its capacity at the moment
//! its free room runs out), so a 30-minute soak grew its RSS by the 3.4 MiB of a new table an
//! overload episode after its baseline.
//!
//! A counting global allocator records every allocation of at least [`LARGE`] bytes while
//! armed. One test in this file: the allocator counts process-wide.

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serve::{BackendChoice, Code, CompletionQueue, Input, Model, ModelOptions, Runtime, SubmitOptions};

/// An allocation this large while serving is a table or buffer growing (the per-request
/// allocations are a few hundred bytes; a table reserved for 4,096 requests is ~1 MiB).
const LARGE: usize = 256 * 1024;

/// The system allocator, recording large allocations while [`ARMED`].
struct Watch;

static ARMED: AtomicBool = AtomicBool::new(false);
static LARGE_COUNT: AtomicUsize = AtomicUsize::new(0);
static LARGEST: AtomicUsize = AtomicUsize::new(0);

impl Watch {
    fn note(size: usize) {
        if size >= LARGE && ARMED.load(Ordering::Relaxed) {
            LARGE_COUNT.fetch_add(1, Ordering::Relaxed);
            LARGEST.fetch_max(size, Ordering::Relaxed);
        }
    }
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping only
// touches atomics (it never allocates).
unsafe impl GlobalAlloc for Watch {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        Watch::note(layout.size());
        // SAFETY: forwarded with the caller's layout (the caller upholds `alloc`'s contract).
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        Watch::note(layout.size());
        // SAFETY: as in `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        Watch::note(new_size);
        // SAFETY: as in `dealloc`, with the caller's new size.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Watch = Watch;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("ffi_examples/testdata").join(name)
}

/// Drains the queue on its own thread unless paused; stops when told.
struct Consumer {
    paused: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<usize>>,
}

impl Consumer {
    fn start(q: Arc<CompletionQueue>) -> Consumer {
        let paused = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, s) = (paused.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let (mut seen, mut buf) = (0, Vec::with_capacity(256));
            while !s.load(Ordering::Acquire) {
                if p.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_micros(200));
                    continue;
                }
                buf.clear();
                let n = q.next_into(&mut buf, 256, Duration::from_millis(5)).unwrap();
                for c in buf.drain(..) {
                    assert_eq!(
                        c.result.as_ref().map(|_| ()).map_err(|e| e.code()),
                        Ok(()),
                        "request {}",
                        c.id
                    );
                }
                seen += n;
            }
            seen
        });
        Consumer { paused, stop, thread: Some(thread) }
    }

    fn pause(&self, paused: bool) {
        self.paused.store(paused, Ordering::Release);
    }

    fn stop(mut self) -> usize {
        self.stop.store(true, Ordering::Release);
        self.thread.take().unwrap().join().unwrap()
    }
}

/// Submit to the models in turns; `Busy` refusals are counted, anything else fails.
fn offer(models: &[(&Model, Input)], q: &CompletionQueue, tag: &mut u64) -> bool {
    let (m, input) = &models[(*tag % models.len() as u64) as usize];
    *tag += 1;
    match m.submit_to(input.clone(), SubmitOptions::default(), q, *tag) {
        Ok(_) => true,
        Err(e) if e.code() == Code::Busy => false,
        Err(e) => panic!("submit: {e}"),
    }
}

/// Every model to its admission bound at once (the consumer paused), then, once the runtime
/// has completed all of it (every admitted request's completion waiting in the queue), drained.
fn fill_to_bounds(models: &[(&Model, Input)], q: &CompletionQueue, c: &Consumer, tag: &mut u64) {
    c.pause(true);
    let mut refused_in_a_row = 0;
    while refused_in_a_row < 4 * models.len() {
        refused_in_a_row = if offer(models, q, tag) { 0 } else { refused_in_a_row + 1 };
    }
    let give_up = Instant::now() + Duration::from_secs(60);
    while q.len() < models.iter().map(|(m, _)| m.admitted()).sum() {
        assert!(Instant::now() < give_up, "the admitted requests did not complete in 60 s");
        std::thread::sleep(Duration::from_millis(1));
    }
    c.pause(false);
}

/// Submit as fast as one thread can for `d`: the engine falls behind and holds the bounds.
fn overload(models: &[(&Model, Input)], q: &CompletionQueue, d: Duration, tag: &mut u64) {
    let end = Instant::now() + d;
    while Instant::now() < end {
        for _ in 0..64 {
            offer(models, q, tag);
        }
    }
}

#[test]
fn serving_within_the_bounds_allocates_no_larger_table() {
    let rt = Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(2).build().unwrap();
    let mlp = rt.load_model(fixture("mlp_4_8_3"), ModelOptions::default()).unwrap();
    let lstm = rt.load_model(fixture("lstm_small"), ModelOptions::default()).unwrap();
    let models =
        [(&mlp, Input::F32(vec![0.5, -1.0, 0.25, 2.0])), (&lstm, Input::Tokens(vec![1, 2, 3, 4, 5]))];
    let q = Arc::new(CompletionQueue::new().unwrap());
    let consumer = Consumer::start(q.clone());
    let mut tag = 0;

    // Warm-up: every thread has run (thread-local buffers are made on first use), and the
    // completion queue has held every admitted request at once (its capacity is the queue's,
    // not a model's: it grows to the sum of the bounds of the models delivering to it, as the
    // soak program's priming also makes it do).
    overload(&models, &q, Duration::from_millis(300), &mut tag);
    fill_to_bounds(&models, &q, &consumer, &mut tag);
    overload(&models, &q, Duration::from_millis(300), &mut tag);

    // Armed: fills to the bounds and overload bursts, over and over.
    ARMED.store(true, Ordering::SeqCst);
    let accepted_from = tag;
    for _ in 0..4 {
        overload(&models, &q, Duration::from_millis(400), &mut tag);
        fill_to_bounds(&models, &q, &consumer, &mut tag);
    }
    ARMED.store(false, Ordering::SeqCst);
    let offered = tag - accepted_from;

    rt.shutdown(Duration::from_secs(30));
    let seen = consumer.stop();
    let (count, largest) = (LARGE_COUNT.load(Ordering::SeqCst), LARGEST.load(Ordering::SeqCst));
    assert_eq!(
        count, 0,
        "{count} allocation(s) of at least {LARGE} bytes (the largest {largest}) while serving \
         within the bounds ({offered} requests offered, {seen} completions drained)"
    );
    assert!(offered > 20_000, "the armed phase offered only {offered} requests");
}
