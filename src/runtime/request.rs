//! Request-side types: submit options, tickets, and the one-shot reply every request carries.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::error::{Code, Error, Result};
use crate::model::Output;
use crate::runtime::admission::Permit;
use crate::runtime::queue::{Completion, QueueShared};
use crate::runtime::stats::Stats;
use crate::sched::RequestId;

/// Per-request options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SubmitOptions {
    /// Complete with `DeadlineExceeded` rather than deliver a result after this instant. A
    /// deadline already passed at submit is refused at once.
    pub deadline: Option<Instant>,
    /// Larger is served first; equal priorities are served in arrival order.
    pub priority: i32,
}

impl SubmitOptions {
    pub fn with_timeout(timeout: Duration) -> SubmitOptions {
        SubmitOptions { deadline: Instant::now().checked_add(timeout), priority: 0 }
    }
}

#[derive(Default)]
struct SlotState {
    result: Option<Result<Output>>,
    /// Held with the result until the caller takes it (admission.rs).
    permit: Option<Permit>,
    waker: Option<Waker>,
}

impl SlotState {
    /// The result, if delivered; taking it releases the request's admission place.
    fn take(&mut self) -> Option<Result<Output>> {
        let r = self.result.take();
        if r.is_some() {
            self.permit = None;
        }
        r
    }
}

#[derive(Default)]
pub(crate) struct TicketSlot {
    state: Mutex<SlotState>,
    done: Condvar,
}

/// A submitted request's handle: wait for it (blocking, or as a `Future`).
pub struct Ticket {
    id: RequestId,
    slot: Arc<TicketSlot>,
}

impl Ticket {
    pub(crate) fn new(id: RequestId) -> (Ticket, Arc<TicketSlot>) {
        let slot = Arc::new(TicketSlot::default());
        (Ticket { id, slot: slot.clone() }, slot)
    }

    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Block until the request completes.
    pub fn wait(self) -> Result<Output> {
        let mut st = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(r) = st.take() {
                return r;
            }
            st = self.slot.done.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Block up to `timeout`; `Err(self)` if the request has not completed by then.
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<Output>, Ticket> {
        let Some(deadline) = Instant::now().checked_add(timeout) else { return Ok(self.wait()) };
        {
            let mut st = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
            loop {
                if let Some(r) = st.take() {
                    return Ok(r);
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    break;
                }
                st = self.slot.done.wait_timeout(st, left).unwrap_or_else(|p| p.into_inner()).0;
            }
        }
        Err(self)
    }

    pub fn is_done(&self) -> bool {
        self.slot.state.lock().unwrap_or_else(|p| p.into_inner()).result.is_some()
    }
}

impl Future for Ticket {
    type Output = Result<Output>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Output>> {
        let mut st = self.slot.state.lock().unwrap_or_else(|p| p.into_inner());
        match st.take() {
            Some(r) => Poll::Ready(r),
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// Where a request's completion goes.
pub(crate) enum Sink {
    Ticket(Arc<TicketSlot>),
    Queue { queue: Arc<QueueShared>, tag: u64 },
}

/// The one-shot reply of a request. Completing it spends it (a second completion does nothing);
/// dropping it uncompleted (which only a runtime being torn down does) completes the request
/// `Cancelled`, so every submitted request completes exactly once whatever path it takes.
pub(crate) struct Reply {
    id: RequestId,
    sink: Option<Sink>,
    stats: Arc<Stats>,
    /// The request's admission place, handed on with its result.
    permit: Option<Permit>,
}

impl Reply {
    pub(crate) fn new(id: RequestId, sink: Sink, stats: Arc<Stats>, permit: Permit) -> Reply {
        Reply { id, sink: Some(sink), stats, permit: Some(permit) }
    }

    /// A reply already spent: what a kept record (recycle.rs) holds until a submit overwrites
    /// it. Completing or dropping it does nothing.
    pub(crate) fn spent(stats: Arc<Stats>) -> Reply {
        Reply { id: 0, sink: None, stats, permit: None }
    }

    pub(crate) fn id(&self) -> RequestId {
        self.id
    }

    /// Complete the request. Queue completions are appended to `outbox` (flushed in batches by
    /// the caller with [`flush`]); ticket completions are delivered at once. The reply is spent
    /// afterwards (a second call, or its drop, does nothing): its record may be reused.
    pub(crate) fn complete(
        &mut self,
        result: Result<Output>,
        outbox: &mut Vec<(Arc<QueueShared>, Completion)>,
    ) {
        self.deliver(result, outbox);
    }

    /// Hand `result` to the sink (which is then gone, so a reply delivers once).
    fn deliver(&mut self, result: Result<Output>, outbox: &mut Vec<(Arc<QueueShared>, Completion)>) {
        let Some(sink) = self.sink.take() else { return };
        self.stats.record_completion(result.as_ref().err().map_or(Code::Ok, Error::code));
        match sink {
            Sink::Ticket(slot) => {
                let waker = {
                    let mut st = slot.state.lock().unwrap_or_else(|p| p.into_inner());
                    st.result = Some(result);
                    st.permit = self.permit.take();
                    st.waker.take()
                };
                slot.done.notify_all();
                if let Some(w) = waker {
                    w.wake();
                }
            }
            Sink::Queue { queue, tag } => {
                let c = Completion { id: self.id, tag, result, permit: self.permit.take() };
                outbox.push((queue, c));
            }
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if self.sink.is_some() {
            let mut outbox = Vec::new();
            self.deliver(Err(shutdown_cancelled()), &mut outbox);
            flush(&mut outbox);
        }
    }
}

/// The error of a request still pending when the runtime stops.
pub(crate) fn shutdown_cancelled() -> Error {
    Error::new(Code::Cancelled, "the runtime shut down before the request completed")
}

/// Deliver queued completions, one lock per run of completions bound for the same queue.
pub(crate) fn flush(outbox: &mut Vec<(Arc<QueueShared>, Completion)>) {
    let mut items = outbox.drain(..).peekable();
    while let Some((queue, first)) = items.next() {
        // The run is moved straight into the queue (no intermediate vector to grow).
        let rest = std::iter::from_fn(|| items.next_if(|(q, _)| Arc::ptr_eq(q, &queue)).map(|(_, c)| c));
        queue.push_all(std::iter::once(first).chain(rest));
    }
}

/// Write every element of `v`'s spare capacity, so that the memory reserved for it is resident
/// from now on. The outbox is filled from its start every turn, so left untouched its pages
/// became resident one by one, whenever a turn completed more requests than any turn before:
/// memory that grew with the load's history (the one-arena 30-minute soak found +124 KiB of
/// the outbox's 580 KiB touched after warm-up, ARCHITECTURE.md §9). Tables that requests cycle
/// through (the rings, the request tables) are all touched within the first turns of ids.
pub(crate) fn touch_spare<T>(v: &mut Vec<T>) {
    v.spare_capacity_mut().iter_mut().for_each(|slot| *slot = std::mem::MaybeUninit::zeroed());
    // The writes are never read: keep the optimiser from dropping them.
    std::hint::black_box(v.spare_capacity_mut().as_mut_ptr());
}

#[cfg(all(test, target_os = "linux", not(miri)))]
mod touch_tests {
    use super::touch_spare;

    /// Of the pages spanned by `len` bytes from `ptr`: how many are resident (`mincore`), and
    /// how many there are.
    fn resident_pages(ptr: *const u8, len: usize) -> (usize, usize) {
        // SAFETY: sysconf has no memory preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let start = ptr as usize & !(page - 1);
        let pages = (ptr as usize + len - start).div_ceil(page);
        let mut flags = vec![0u8; pages];
        // SAFETY: [start, start + pages·page) is page-aligned and lies within one live
        // allocation's mapping (a Vec of many pages, mmapped by the allocator, owned by the
        // caller for the call), and `flags` has one byte per page, as mincore writes.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, pages * page, flags.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        (flags.iter().filter(|f| **f & 1 == 1).count(), pages)
    }

    #[test]
    fn touching_the_spare_capacity_makes_it_resident() {
        // 8 MiB: the allocator maps it fresh, so nothing of it is resident before it is written.
        let mut v: Vec<[u64; 9]> = Vec::with_capacity((8 << 20) / size_of::<[u64; 9]>());
        v.push([1; 9]);
        let bytes = v.capacity() * size_of::<[u64; 9]>();
        let (before, pages) = resident_pages(v.as_ptr().cast(), bytes);
        touch_spare(&mut v);
        let (after, _) = resident_pages(v.as_ptr().cast(), bytes);
        assert!(before < 16, "{before} of {pages} pages resident before any write");
        assert_eq!(after, pages, "resident after touching");
        assert_eq!(v, [[1; 9]], "the elements are untouched");
    }
}
