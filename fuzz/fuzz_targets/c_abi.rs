//! C-ABI call sequences: a runtime with an mlp, an lstm and a treelstm, two completion queues,
//! and a random sequence of submits (right and wrong kinds, lengths from 0 to `SIZE_MAX`, NULL
//! pointers, non-finite values, malformed trees, past deadlines), cancels (issued and unknown ids),
//! queue drains, model frees and shutdowns, called as a C program would: within the header's
//! contract (no use after free), except that a length over what the model takes may come with a
//! buffer of only a few elements, which the library must refuse unread. Then every queue is
//! drained until each accepted request has completed.
//!
//! For speed the runtime and its models outlive an input when it leaves them usable: an input
//! that shuts the runtime down (or frees a model) has it recreated (or reloaded) for the next,
//! and the last one is freed at process exit, before LeakSanitizer's exit check.
//! Each input still ends with nothing pending, so inputs are independent up to the runtime's
//! counters.
//!
//! Checked: no call panics or answers `SERVE_CODE_INTERNAL`; every accepted submit completes
//! exactly once, into its own queue, with its own tag; nothing else completes; a submit that was
//! refused completes nothing. (libFuzzer runs this under AddressSanitizer, so an out-of-bounds
//! read of a too-long length is a crash too.)

#![no_main]

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use serve::Code;
use serve::ffi::completion::*;
use serve::ffi::error::*;
use serve::ffi::metrics::*;
use serve::ffi::model::*;
use serve::ffi::queue::*;
use serve::ffi::runtime::*;
use serve::ffi::submit::*;

/// A length relative to what the model takes.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Len {
    Exact,
    Zero,
    OneLess,
    OneMore,
    /// `n` elements (a buffer of `n` is passed).
    Small(u8),
    /// Far more than any model takes, with a buffer of only a few elements: the library must
    /// refuse it from the length alone, before reading.
    Huge(u64),
    SizeMax,
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Deadline {
    None,
    Passed,
    TimeoutUs(u16),
}

#[derive(Arbitrary, Debug)]
enum Op {
    F32 { model: u8, queue: bool, len: Len, value: f32, null_ptr: bool, deadline: Deadline },
    Tokens { model: u8, queue: bool, len: Len, token: u32, deadline: Deadline },
    Tree { model: u8, queue: bool, parents: Vec<i8>, token: u32 },
    Cancel { nth: u16, unknown: bool },
    Drain { queue: bool, max: u8 },
    FreeModel { model: u8 },
    Shutdown { drain_us: u16 },
    Stats,
    Metrics,
}

#[derive(Arbitrary, Debug)]
struct Script {
    ops: Vec<Op>,
}

/// Most operations per input, so one input stays fast.
const MAX_OPS: usize = 48;
/// `Huge` lengths are above this (and every model's maximum), with a buffer of 4 elements.
const HUGE_ABOVE: usize = 4096;

fn testdata(name: &str) -> CString {
    static ROOT: OnceLock<std::path::PathBuf> = OnceLock::new();
    let root = ROOT.get_or_init(|| {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../ffi_examples/testdata").canonicalize().unwrap()
    });
    CString::new(root.join(name).to_str().unwrap()).unwrap()
}

/// Take an error: its code, after checking it is not INTERNAL.
fn code_of(e: *mut serve_error, what: &str) -> Code {
    if e.is_null() {
        return Code::Ok;
    }
    let code = serve_error_code(e);
    let msg = unsafe { CStr::from_ptr(serve_error_message(e)) }.to_string_lossy().into_owned();
    serve_error_free(e);
    assert_ne!(code, Code::Internal, "{what} answered INTERNAL: {msg}");
    assert!(!msg.is_empty(), "{what} answered {code:?} with no message");
    code
}

/// The runtime and models kept from one input to the next.
struct Kept {
    rt: *mut serve_runtime,
    /// The loaded models, by fixture name.
    models: Vec<(&'static str, *mut serve_model)>,
    shut_down: bool,
}

// SAFETY: the handles are `const`-shareable by the header's contract, and libFuzzer runs one
// input at a time (the mutex serialises them anyway).
unsafe impl Send for Kept {}

static KEPT: std::sync::Mutex<Option<Kept>> = std::sync::Mutex::new(None);

const MODELS: [&str; 3] = ["mlp_4_8_3", "lstm_small", "treelstm_small"];

struct Harness {
    kept: Kept,
    queues: [*mut serve_queue; 2],
    /// Accepted submits not yet completed: tag → (queue, request id).
    pending: HashMap<u64, (usize, u64)>,
    ids: Vec<u64>,
    next_tag: u64,
}

fn load(rt: *mut serve_runtime, name: &str) -> Option<*mut serve_model> {
    let mut m = null_mut();
    match code_of(serve_runtime_load_model(rt, testdata(name).as_ptr(), null(), &mut m), "load") {
        Code::Ok => Some(m),
        Code::Shutdown => None,
        other => panic!("loading {name} answered {other:?}"),
    }
}

impl Harness {
    fn new(kept: Option<Kept>) -> Harness {
        let mut kept = kept.unwrap_or_else(|| {
            let mut opts = null_mut();
            assert_eq!(code_of(serve_runtime_options_new(&mut opts), "options_new"), Code::Ok);
            code_of(serve_runtime_options_set_backend(opts, c"cpu".as_ptr()), "set_backend");
            code_of(serve_runtime_options_set_cpu_threads(opts, 1), "set_cpu_threads");
            code_of(serve_runtime_options_set_admission_bound(opts, 8), "set_bound");
            let mut rt = null_mut();
            assert_eq!(code_of(serve_runtime_new(opts, &mut rt), "runtime_new"), Code::Ok);
            serve_runtime_options_free(opts);
            Kept { rt, models: Vec::new(), shut_down: false }
        });
        // Reload what the last input freed.
        for name in MODELS {
            if !kept.models.iter().any(|m| m.0 == name) {
                kept.models.push((name, load(kept.rt, name).expect("a kept runtime serves")));
            }
        }
        let mut queues = [null_mut(); 2];
        for q in &mut queues {
            assert_eq!(code_of(serve_queue_new(q), "queue_new"), Code::Ok);
        }
        Harness { kept, queues, pending: HashMap::new(), ids: Vec::new(), next_tag: 1 }
    }

    fn model(&self, m: u8) -> *const serve_model {
        self.kept.models[m as usize % self.kept.models.len()].1
    }

    fn options(deadline: Deadline) -> *mut serve_submit_options {
        if matches!(deadline, Deadline::None) {
            return null_mut();
        }
        let mut o = null_mut();
        code_of(serve_submit_options_new(&mut o), "submit_options_new");
        match deadline {
            Deadline::None => {}
            Deadline::Passed => {
                code_of(serve_submit_options_set_deadline_ns(o, 1), "set_deadline");
            }
            Deadline::TimeoutUs(us) => {
                code_of(serve_submit_options_set_timeout_ns(o, u64::from(us) * 1000 + 1), "set_timeout");
            }
        }
        o
    }

    /// The length and buffer size for `len` against a model taking `exact` elements.
    fn length(len: Len, exact: usize) -> (usize, usize) {
        let n = match len {
            Len::Exact => exact,
            Len::Zero => 0,
            Len::OneLess => exact.saturating_sub(1),
            Len::OneMore => exact + 1,
            Len::Small(n) => n as usize,
            Len::Huge(n) => return ((HUGE_ABOVE as u64 + 1 + n % (1 << 40)) as usize, 4),
            Len::SizeMax => return (usize::MAX, 4),
        };
        (n, n)
    }

    /// Record the outcome of a submit.
    fn submitted(&mut self, e: *mut serve_error, queue: usize, tag: u64, id: u64, what: &str) {
        if code_of(e, what) == Code::Ok {
            self.pending.insert(tag, (queue, id));
            self.ids.push(id);
        }
    }

    fn run(&mut self, op: &Op) {
        let tag = self.next_tag;
        self.next_tag += 1;
        let mut id = u64::MAX;
        match *op {
            Op::F32 { model, queue, len, value, null_ptr, deadline } => {
                let m = self.model(model);
                let (n, buf) = Self::length(len, serve_model_input_len(m).max(1));
                let data = vec![value; buf];
                let o = Self::options(deadline);
                let p = if null_ptr { null() } else { data.as_ptr() };
                let e = serve_submit_f32(m, self.queues[queue as usize], tag, p, n, o, &mut id);
                serve_submit_options_free(o);
                self.submitted(e, queue as usize, tag, id, "submit_f32");
            }
            Op::Tokens { model, queue, len, token, deadline } => {
                let m = self.model(model);
                let (n, buf) = Self::length(len, 5);
                let data = vec![token % 64; buf];
                let o = Self::options(deadline);
                let e = serve_submit_tokens(m, self.queues[queue as usize], tag, data.as_ptr(), n, o, &mut id);
                serve_submit_options_free(o);
                self.submitted(e, queue as usize, tag, id, "submit_tokens");
            }
            Op::Tree { model, queue, ref parents, token } => {
                let m = self.model(model);
                let parents: Vec<i32> = parents.iter().take(64).map(|&p| i32::from(p)).collect();
                let tokens = vec![token % 64; parents.len()];
                let e = serve_submit_tree(
                    m,
                    self.queues[queue as usize],
                    tag,
                    tokens.as_ptr(),
                    parents.as_ptr(),
                    parents.len(),
                    null(),
                    &mut id,
                );
                self.submitted(e, queue as usize, tag, id, "submit_tree");
            }
            Op::Cancel { nth, unknown } => {
                let id = match (unknown, self.ids.is_empty()) {
                    (false, false) => self.ids[nth as usize % self.ids.len()],
                    _ => u64::MAX - u64::from(nth),
                };
                code_of(serve_runtime_cancel(self.kept.rt, id), "cancel");
            }
            Op::Drain { queue, max } => self.drain(queue as usize, max as usize % 17, 0),
            Op::FreeModel { model } => {
                // Never the last: later submits need a model (the next input reloads it).
                let k = &mut self.kept;
                if k.models.len() > 1 {
                    serve_model_free(k.models.swap_remove(model as usize % k.models.len()).1);
                }
            }
            Op::Shutdown { drain_us } => {
                code_of(serve_runtime_shutdown(self.kept.rt, u64::from(drain_us) * 1000), "shutdown");
                self.kept.shut_down = true;
            }
            Op::Stats => {
                let mut s = null_mut();
                code_of(serve_runtime_stats(self.kept.rt, &mut s), "stats");
                serve_stats_free(s);
            }
            Op::Metrics => {
                let mut m = null_mut();
                if code_of(serve_runtime_metrics(self.kept.rt, &mut m), "metrics") == Code::Ok {
                    let mut len = 0;
                    let text = unsafe { CStr::from_ptr(serve_metrics_text(m, &mut len)) }.to_bytes();
                    assert_eq!(text.len(), len);
                    assert!(text.ends_with(b"# EOF\n"), "the metrics text does not end with # EOF");
                }
                serve_metrics_free(m);
            }
        }
    }

    /// Take up to `max` completions of queue `q`, waiting up to `timeout_ns`, and check each.
    fn drain(&mut self, q: usize, max: usize, timeout_ns: u64) {
        let mut out = vec![null_mut::<serve_completion>(); max];
        let mut count = 0;
        code_of(serve_queue_next(self.queues[q], out.as_mut_ptr(), max, timeout_ns, &mut count), "queue_next");
        assert!(count <= max);
        for &c in &out[..count] {
            let tag = serve_completion_tag(c);
            let code = serve_completion_code(c);
            let Some((queue, id)) = self.pending.remove(&tag) else {
                panic!("completion with tag {tag} that is not pending (twice, or never accepted)");
            };
            assert_eq!(queue, q, "tag {tag} completed into the other queue");
            assert_eq!(serve_completion_request_id(c), id, "tag {tag} carries another request's id");
            assert_ne!(code, Code::Internal, "request {id} completed INTERNAL");
            serve_completion_free(c);
        }
    }

    /// Drain until every accepted request has completed; hand back what stays usable.
    fn finish(mut self) -> Option<Kept> {
        let start = Instant::now();
        while !self.pending.is_empty() {
            assert!(start.elapsed() < Duration::from_secs(20), "lost completions: {:?}", self.pending);
            for q in 0..2 {
                self.drain(q, 64, 1_000_000);
            }
        }
        for q in 0..2 {
            self.drain(q, 64, 0);
            serve_queue_free(self.queues[q]);
        }
        if !self.kept.shut_down {
            return Some(self.kept);
        }
        for (_, m) in self.kept.models.drain(..) {
            serve_model_free(m);
        }
        serve_runtime_free(self.kept.rt);
        None
    }
}

unsafe extern "C" {
    fn atexit(callback: extern "C" fn()) -> i32;
}

/// At process exit (libFuzzer ends with `exit`), free the kept runtime and its models, so that
/// LeakSanitizer's exit check sees what a C program that frees its handles leaves: nothing.
extern "C" fn free_kept() {
    let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(k) = kept {
        for (_, m) in k.models {
            serve_model_free(m);
        }
        serve_runtime_free(k.rt);
    }
}

fuzz_target!(|script: Script| {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    // SAFETY: `free_kept` is a plain function that never unwinds out (it only frees handles).
    AT_EXIT.call_once(|| assert_eq!(unsafe { atexit(free_kept) }, 0));
    let mut kept = KEPT.lock().unwrap_or_else(|p| p.into_inner());
    let mut h = Harness::new(kept.take());
    for op in script.ops.iter().take(MAX_OPS) {
        h.run(op);
    }
    *kept = h.finish();
});
