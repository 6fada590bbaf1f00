//! Reuse of the request path's allocations, per model, so that steady serving does not call
//! the allocator per request.
//!
//! A request's record ([`Pending`], with its copy of the input) is allocated on the caller's
//! thread and freed on the engine's; its output is allocated on the engine's thread and freed
//! on the consumer's. Under glibc's per-thread arenas that pattern made RSS creep for as long as
//! a soak ran (the heap in use flat, its arenas fragmenting: ARCHITECTURE §9), and every
//! allocation costs the round trip time besides. So each model keeps, up to its admission bound
//! (a request holds at most one of each), the records of completed requests with their input
//! buffers, and the output buffers C completions hand back when freed; a submit takes a record
//! and copies the caller's input into its buffer, the engine writes an output into a kept
//! buffer. Chain requests (`lstm`, `seq2seq`) share their cell graph by input length: it
//! depends on nothing else.
//!
//! Allocated at load, like the request tables (ARCHITECTURE §3.1): `keep` records (the model's
//! admission bound, up to `MAX_RESERVED_REQUESTS`), each with an input buffer of the model's
//! input length (a token model's: [`SPARE_TOKENS`]; none over [`MAX_KEPT_ELEMENTS`]), and
//! `keep` output buffers of its output length (none over it). Serving within the bound then
//! allocates none of them, so the memory the model holds does not depend on the load's history
//! (a lazily filled pool grows whenever a stall puts more requests in the engine at once than
//! ever before). A buffer that had to grow for a longer input is freed when its record comes
//! back, not kept: so each kept buffer stays at its size at load. A request whose input does not
//! fit its buffer, or a model's with inputs or outputs over the limit, allocates as before.

use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

use crate::error::Result;
use crate::model::{Input, Network};
use crate::sched::CellGraph;

use super::engine::Pending;
use super::request::Reply;
use super::stats::Stats;

/// Largest input or output (elements) whose buffers are kept.
pub(crate) const MAX_KEPT_ELEMENTS: usize = 1024;
/// Longest chain request whose cell graph is shared (longer ones are unfolded per request).
const MAX_SHARED_CHAIN: usize = 1024;
/// Capacity of a kept record's input buffer for a model of variable-length input (tokens,
/// trees), allocated at load.
pub(crate) const SPARE_TOKENS: usize = 64;

pub(crate) struct Recycler {
    /// The most records, and the most outputs, kept.
    keep: usize,
    /// Elements of a kept input buffer (each of a tree's two): a larger one is not kept.
    spare: usize,
    /// Records of completed requests: spent replies, no cell graph, their input buffers kept.
    /// Stacks, so the one reused is the one last handed back, still in cache (a queue cycling
    /// through thousands of them measured 15–30% slower round trips than malloc's reuse).
    #[allow(clippy::vec_box)]
    records: Mutex<Vec<Box<Pending>>>,
    outputs: Mutex<Vec<Vec<f32>>>,
    /// Chain models: the cell graph of each input length up to [`MAX_SHARED_CHAIN`] (or the
    /// model's longest input), made by its first request; empty for other models.
    chains: Box<[OnceLock<Arc<CellGraph>>]>,
}

impl Recycler {
    /// For a model of `net` with admission bound `keep` (capped by the caller) and f32 outputs
    /// of `out_len` values: `keep` records and outputs allocated now. `stats` is the runtime's
    /// (a spent reply holds it).
    pub(crate) fn new(net: &Network, keep: usize, out_len: usize, stats: &Arc<Stats>) -> Recycler {
        let chains = match net {
            Network::Lstm(_) | Network::Seq2Seq(_) => net.max_input_len().min(MAX_SHARED_CHAIN) + 1,
            _ => 0,
        };
        let spare = match net {
            Network::Mlp(_) | Network::ResNet(_) | Network::Custom(_) => net.max_input_len(),
            _ => net.max_input_len().min(SPARE_TOKENS),
        };
        let spare = if spare > MAX_KEPT_ELEMENTS { 0 } else { spare };
        let spare_input = || match net {
            Network::Mlp(_) | Network::ResNet(_) | Network::Custom(_) => {
                Input::F32(Vec::with_capacity(spare))
            }
            Network::Lstm(_) | Network::Seq2Seq(_) | Network::Bert(_) => {
                Input::Tokens(Vec::with_capacity(spare))
            }
            Network::TreeLstm(_) => {
                Input::Tree { tokens: Vec::with_capacity(spare), parents: Vec::with_capacity(spare) }
            }
        };
        let mut records = Vec::with_capacity(keep);
        for _ in 0..keep {
            records.push(Box::new(Pending {
                model: 0,
                submitted: Instant::now(),
                rows: 0,
                input: spare_input(),
                cells: None,
                slots_needed: 0,
                deadline: None,
                priority: 0,
                reply: Reply::spent(stats.clone()),
                run: Default::default(),
            }));
        }
        // Seq2Seq's outputs are tokens: nothing to keep.
        let outputs = match net {
            Network::Seq2Seq(_) => 0,
            _ if out_len > MAX_KEPT_ELEMENTS => 0,
            _ => keep,
        };
        let mut kept_outputs = Vec::with_capacity(keep);
        kept_outputs.extend((0..outputs).map(|_| Vec::with_capacity(out_len)));
        Recycler {
            keep,
            spare,
            records: Mutex::new(records),
            outputs: Mutex::new(kept_outputs),
            chains: (0..chains).map(|_| OnceLock::new()).collect(),
        }
    }

    /// A recycler that keeps nothing (tests of admission alone).
    #[cfg(test)]
    pub(crate) fn none() -> Recycler {
        Recycler {
            keep: 0,
            spare: 0,
            records: Mutex::default(),
            outputs: Mutex::default(),
            chains: Box::new([]),
        }
    }

    /// A kept record, if any, to overwrite with a new request.
    pub(crate) fn record(&self) -> Option<Box<Pending>> {
        lock(&self.records).pop()
    }

    /// Keep a completed (or refused) request's record, its reply spent. Its cell graph goes now;
    /// a result it still holds (a request cancelled or expired after its task ran) gives its
    /// buffer back; its input buffer stays for the next request unless it grew past its size
    /// at load.
    pub(crate) fn put_record(&self, mut r: Box<Pending>) {
        r.cells = None;
        if let Some(v) = std::mem::take(&mut r.run).into_f32_output() {
            self.put_output(v);
        }
        if input_capacity(&r.input) > self.spare {
            r.input = Input::F32(Vec::new());
        }
        // Beyond the bound (a record made while the kept ones were all in use) it is freed.
        let mut records = lock(&self.records);
        if records.len() < self.keep {
            records.push(r);
        }
    }

    /// `values` in a kept buffer (or a new one).
    pub(crate) fn output(&self, values: &[f32]) -> Vec<f32> {
        let mut v = lock(&self.outputs).pop().unwrap_or_default();
        v.clear();
        v.extend_from_slice(values);
        v
    }

    /// Keep an output buffer its completion is done with.
    pub(crate) fn put_output(&self, v: Vec<f32>) {
        if v.capacity() == 0 || v.capacity() > MAX_KEPT_ELEMENTS {
            return;
        }
        let mut outputs = lock(&self.outputs);
        if outputs.len() < self.keep {
            outputs.push(v);
        }
    }

    /// Validate `input` and unfold it into its cell graph, as [`Network::unfold`] does; a chain
    /// request's graph is shared with every other of its length.
    pub(crate) fn unfold(&self, net: &Network, input: &Input) -> Result<Option<Arc<CellGraph>>> {
        let Input::Tokens(t) = input else { return net.unfold(input) };
        let Some(shared) = self.chains.get(t.len()) else { return net.unfold(input) };
        if let Some(g) = shared.get() {
            net.validate(input)?;
            return Ok(Some(g.clone()));
        }
        let g = net.unfold(input)?;
        if let Some(g) = &g {
            let _ = shared.set(g.clone());
        }
        Ok(g)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn input_capacity(input: &Input) -> usize {
    match input {
        Input::F32(v) => v.capacity(),
        Input::Tokens(t) => t.capacity(),
        Input::Tree { tokens, parents } => tokens.capacity().max(parents.capacity()),
    }
}

/// A caller's input, borrowed, to be copied into a request's record (reusing the buffer of a
/// kept one: [`Recycler::record`]).
#[derive(Clone, Copy)]
pub(crate) enum InputRef<'a> {
    F32(&'a [f32]),
    Tokens(&'a [u32]),
    Tree { tokens: &'a [u32], parents: &'a [i32] },
}

impl InputRef<'_> {
    /// The input as an owned [`Input`], in `spare`'s buffers where they are of the same kind.
    pub(crate) fn copy_into(self, spare: Input) -> Input {
        fn fill<T: Copy>(mut v: Vec<T>, from: &[T]) -> Vec<T> {
            v.clear();
            v.extend_from_slice(from);
            v
        }
        match (self, spare) {
            (InputRef::F32(x), Input::F32(v)) => Input::F32(fill(v, x)),
            (InputRef::Tokens(x), Input::Tokens(v)) => Input::Tokens(fill(v, x)),
            (InputRef::Tree { tokens, parents }, Input::Tree { tokens: t, parents: p }) => {
                Input::Tree { tokens: fill(t, tokens), parents: fill(p, parents) }
            }
            (InputRef::F32(x), _) => Input::F32(x.to_vec()),
            (InputRef::Tokens(x), _) => Input::Tokens(x.to_vec()),
            (InputRef::Tree { tokens, parents }, _) => {
                Input::Tree { tokens: tokens.to_vec(), parents: parents.to_vec() }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Lstm, Mlp};
    use crate::runtime::admission::Admission;
    use crate::runtime::request::{Reply, Sink, Ticket};

    /// A spent record (its reply completed) of an `mlp` request with `input`.
    fn spent_record(input: Input) -> Box<Pending> {
        let admission = Arc::new(Admission::new(8, 1, Recycler::none()));
        let permit = admission.admit("m", 1, None, Instant::now()).unwrap();
        let (_ticket, slot) = Ticket::new(1);
        let mut reply = Reply::new(1, Sink::Ticket(slot), Default::default(), permit);
        reply.complete(Ok(crate::model::Output::F32(vec![1.0])), &mut Vec::new());
        Box::new(Pending {
            model: 0,
            submitted: Instant::now(),
            rows: 1,
            input,
            cells: Some(CellGraph::single()),
            slots_needed: 0,
            deadline: None,
            priority: 0,
            reply,
            run: Default::default(),
        })
    }

    #[test]
    fn records_and_outputs_are_allocated_at_load_and_kept_up_to_the_bound() {
        let mlp = Network::Mlp(Mlp::random(&[4, 2], 1));
        let r = Recycler::new(&mlp, 2, 2, &Default::default());
        // Two of each at load, with buffers of the model's lengths.
        let (a, b) = (r.record().unwrap(), r.record().unwrap());
        assert!(r.record().is_none());
        for rec in [&a, &b] {
            assert!(matches!(&rec.input, Input::F32(v) if v.is_empty() && v.capacity() == 4));
        }
        let (o1, o2) = (r.output(&[1.0, 2.0]), r.output(&[3.0, 4.0]));
        assert!(lock(&r.outputs).is_empty());
        let at = o2.as_ptr();
        // Handed back, up to the bound; the third of each is freed.
        r.put_output(o1);
        r.put_output(o2);
        r.put_output(vec![0.0; 2]);
        assert_eq!(lock(&r.outputs).len(), 2);
        let kept_at = match &a.input {
            Input::F32(v) => v.as_ptr(),
            _ => unreachable!(),
        };
        r.put_record(a);
        r.put_record(spent_record(Input::F32(vec![0.0; MAX_KEPT_ELEMENTS + 1])));
        r.put_record(b);
        let (big, a) = (r.record().unwrap(), r.record().unwrap());
        assert!(r.record().is_none(), "the third record was freed");
        assert!(big.cells.is_none(), "a kept record holds no cell graph");
        // The oversized buffer was not kept; a copy lands in the buffer allocated at load.
        assert!(matches!(&big.input, Input::F32(v) if v.capacity() == 0));
        let Input::F32(v) = InputRef::F32(&[1.0, 2.0, 3.0, 4.0]).copy_into(a.input) else { panic!() };
        assert_eq!((v.as_slice(), v.as_ptr()), (&[1.0, 2.0, 3.0, 4.0][..], kept_at));
        // A copy of another kind allocates its own buffers.
        let t = InputRef::Tree { tokens: &[1, 2], parents: &[-1, 0] }.copy_into(Input::F32(v));
        assert!(matches!(t, Input::Tree { tokens, parents } if tokens == [1, 2] && parents == [-1, 0]));
        // Outputs come from the kept buffers (the last handed back first); an oversized one is
        // not kept.
        let again = r.output(&[5.0]);
        assert_eq!((again.as_slice(), again.as_ptr()), (&[5.0][..], at));
        r.put_output(vec![0.0; MAX_KEPT_ELEMENTS + 1]);
        assert_eq!(lock(&r.outputs).len(), 1, "an oversized buffer is not kept");
    }

    #[test]
    fn token_models_keep_token_buffers_and_seq2seq_no_outputs() {
        let lstm = Network::Lstm(Lstm::random(8, 2, 2, 1, 1));
        let r = Recycler::new(&lstm, 3, 2, &Default::default());
        let rec = r.record().unwrap();
        let want = lstm.max_input_len().min(SPARE_TOKENS);
        assert!(matches!(&rec.input, Input::Tokens(t) if t.capacity() == want), "{want}");
        assert_eq!(lock(&r.outputs).len(), 3);
        let s2s = Network::Seq2Seq(crate::model::Seq2Seq::random(8, 2, 2, 1, 1, 2, 4, 1));
        assert!(lock(&Recycler::new(&s2s, 3, 2, &Default::default()).outputs).is_empty());
    }

    /// Through a runtime: a borrowed input lands in a kept record whatever that record held
    /// before (longer, shorter, a buffer dropped for having grown), with the result an owned
    /// input gets; a refused submit hands its record back.
    #[test]
    fn c_style_submits_reuse_kept_records_and_refusals_hand_them_back() {
        use std::time::Duration;

        use crate::runtime::{CompletionQueue, ModelOptions, Runtime, SubmitOptions};
        use crate::{BackendChoice, Code};

        let rt = Runtime::builder().backend(BackendChoice::Cpu).cpu_threads(1).build().unwrap();
        let net = Arc::new(Network::Lstm(Lstm::random(50, 4, 8, 1, 3)));
        let opts = ModelOptions { admission_bound: Some(2), ..Default::default() };
        let m = rt.add_network(net, "lstm".into(), opts).unwrap();
        let kept = || lock(&m.m.admission.recycler().records).len();
        assert_eq!(kept(), 2, "the bound's records, allocated at load");
        let q = CompletionQueue::new().unwrap();
        let next = || q.next(1, Duration::from_secs(20)).unwrap().pop().expect("a completion");
        let long = vec![7u32; SPARE_TOKENS + 6];
        for tokens in [&[1u32, 2, 3][..], &long, &[5], &[6, 7], &long[..SPARE_TOKENS]] {
            let owned = m.submit(Input::Tokens(tokens.to_vec()), SubmitOptions::default()).unwrap();
            let want = owned.wait().unwrap();
            m.submit_copy_to(InputRef::Tokens(tokens), SubmitOptions::default(), &q, 0).unwrap();
            let got = next().result.unwrap();
            assert_eq!(got, want, "{} tokens", tokens.len());
        }
        // Settle: every record back (the engine hands it back as the request completes).
        let give_up = std::time::Instant::now() + Duration::from_secs(20);
        while kept() < 2 {
            assert!(std::time::Instant::now() < give_up, "records not handed back");
            std::thread::sleep(Duration::from_millis(1));
        }
        // Refusals: an invalid token, then BUSY with both places held by undrained completions.
        let bad = m.submit_copy_to(InputRef::Tokens(&[1, 50]), SubmitOptions::default(), &q, 0).unwrap_err();
        assert_eq!(bad.code(), Code::InvalidArgument, "{bad}");
        assert_eq!(kept(), 2, "an invalid input hands its record back");
        let held: Vec<_> = (0..2)
            .map(|_| {
                m.submit_copy_to(InputRef::Tokens(&[1, 2]), SubmitOptions::default(), &q, 0).unwrap();
                next()
            })
            .collect();
        let before = kept();
        let busy = m.submit_copy_to(InputRef::Tokens(&[3]), SubmitOptions::default(), &q, 0).unwrap_err();
        assert_eq!(busy.code(), Code::Busy, "{busy}");
        assert_eq!(kept(), before, "a refused submit hands its record back");
        drop(held);
    }

    #[test]
    fn chain_requests_share_their_graph_by_length_and_are_still_validated() {
        let lstm = Network::Lstm(Lstm::random(8, 2, 2, 1, 1));
        let r = Recycler::new(&lstm, 4, 2, &Default::default());
        let a = r.unfold(&lstm, &Input::Tokens(vec![1, 2, 3])).unwrap().unwrap();
        let b = r.unfold(&lstm, &Input::Tokens(vec![4, 5, 6])).unwrap().unwrap();
        let c = r.unfold(&lstm, &Input::Tokens(vec![4, 5])).unwrap().unwrap();
        assert!(Arc::ptr_eq(&a, &b), "same length, same graph");
        assert_eq!((a.len(), c.len()), (3, 2));
        // A cached length does not skip validation: token 8 is outside the vocabulary of 8.
        let e = r.unfold(&lstm, &Input::Tokens(vec![1, 8, 2])).unwrap_err();
        assert_eq!(e.code(), crate::Code::InvalidArgument, "{e}");
        // Other kinds unfold as before.
        let mlp = Network::Mlp(Mlp::random(&[4, 2], 1));
        assert!(
            Recycler::new(&mlp, 4, 2, &Default::default())
                .unfold(&mlp, &Input::F32(vec![0.5; 4]))
                .unwrap()
                .is_none()
        );
    }
}
