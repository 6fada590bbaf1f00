//! Completion queues: where finished requests are delivered.
//!
//! A queue is owned by the caller and shared by any number of submitting threads. Completions are
//! drained in batches with [`CompletionQueue::next`]; on Linux [`CompletionQueue::fd`] is an
//! eventfd that is readable exactly while completions are pending, for epoll / asio / Go's
//! netpoller. In callback mode completions are instead handed, in order, to a callback running on
//! a thread of the queue's own.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{JoinHandle, ThreadId};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::model::Output;
use crate::runtime::admission::Permit;
use crate::sched::RequestId;

/// A finished request.
#[derive(Debug)]
pub struct Completion {
    pub id: RequestId,
    /// The caller's tag from submit.
    pub tag: u64,
    pub result: Result<Output>,
    /// The request's place under its model's admission bound, released when the completion is
    /// dropped (so results left in a queue count against the bound).
    pub(crate) permit: Option<Permit>,
}

type Callback = Box<dyn Fn(Completion) + Send + 'static>;

#[derive(Default)]
struct State {
    items: VecDeque<Completion>,
    closed: bool,
    /// The eventfd currently holds a non-zero count.
    fd_armed: bool,
}

/// The part of a queue the runtime holds for pending requests.
pub(crate) struct QueueShared {
    state: Mutex<State>,
    ready: Condvar,
    fd: Option<EventFd>,
    callback_tx: Mutex<Option<mpsc::Sender<Completion>>>,
}

impl QueueShared {
    /// Deliver completions (in order). After the queue is closed they are dropped.
    pub(crate) fn push_all(&self, batch: impl IntoIterator<Item = Completion>) {
        if let Some(tx) = &*self.callback_tx.lock().unwrap_or_else(|p| p.into_inner()) {
            for c in batch {
                let _ = tx.send(c);
            }
            return;
        }
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.closed {
            return;
        }
        let before = st.items.len();
        st.items.extend(batch);
        if st.items.len() == before {
            return;
        }
        if !st.fd_armed
            && let Some(fd) = &self.fd
        {
            fd.raise();
            st.fd_armed = true;
        }
        drop(st);
        self.ready.notify_all();
    }
}

/// A completion queue. Dropping it discards undelivered completions, and in callback mode waits
/// for a callback in progress to return (unless dropped from inside the callback).
pub struct CompletionQueue {
    shared: Arc<QueueShared>,
    callback_thread: Option<(JoinHandle<()>, ThreadId)>,
    /// Set when the queue is dropped: the callback thread discards what is left.
    callback_closed: Arc<AtomicBool>,
}

impl CompletionQueue {
    /// A queue drained with [`next`](Self::next) (and, on Linux, watched through [`fd`](Self::fd)).
    pub fn new() -> Result<CompletionQueue> {
        let fd = EventFd::new()?;
        Ok(CompletionQueue {
            shared: Arc::new(QueueShared {
                state: Mutex::new(State::default()),
                ready: Condvar::new(),
                fd,
                callback_tx: Mutex::new(None),
            }),
            callback_thread: None,
            callback_closed: Arc::new(AtomicBool::new(false)),
        })
    }

    /// A queue that hands each completion to `callback` on a thread of its own, in completion
    /// order. The callback must not block for long: it delays every later completion of the queue.
    /// A panic in the callback is caught; the completion is dropped. Once the queue is dropped the
    /// callback is never called again (a call in progress is waited for, unless the drop happens
    /// inside the callback itself).
    pub fn with_callback(callback: impl Fn(Completion) + Send + 'static) -> Result<CompletionQueue> {
        let (tx, rx) = mpsc::channel::<Completion>();
        let callback: Callback = Box::new(callback);
        let closed = Arc::new(AtomicBool::new(false));
        let closed2 = closed.clone();
        let thread = std::thread::Builder::new()
            .name("serve-callback".into())
            .spawn(move || {
                for c in rx {
                    if closed2.load(Ordering::Acquire) {
                        continue; // the queue was freed: discard, never call back
                    }
                    let _ = catch_unwind(AssertUnwindSafe(|| callback(c)));
                }
            })
            .map_err(|e| Error::internal(format!("cannot spawn the callback thread: {e}")))?;
        let id = thread.thread().id();
        Ok(CompletionQueue {
            shared: Arc::new(QueueShared {
                state: Mutex::new(State::default()),
                ready: Condvar::new(),
                fd: None,
                callback_tx: Mutex::new(Some(tx)),
            }),
            callback_thread: Some((thread, id)),
            callback_closed: closed,
        })
    }

    pub(crate) fn shared(&self) -> &Arc<QueueShared> {
        &self.shared
    }

    pub fn is_callback(&self) -> bool {
        self.callback_thread.is_some()
    }

    /// Wait up to `timeout` for at least one completion, then move up to `max` of them into `out`.
    /// Returns how many were moved (0 on timeout). `Duration::ZERO` polls; `Duration::MAX` waits
    /// for ever. Fails with `InvalidArgument` on a callback queue.
    pub fn next_into(&self, out: &mut Vec<Completion>, max: usize, timeout: Duration) -> Result<usize> {
        if self.is_callback() {
            return Err(Error::invalid("this queue delivers through its callback; it cannot be drained"));
        }
        if max == 0 {
            return Ok(0);
        }
        let deadline = Instant::now().checked_add(timeout);
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        while st.items.is_empty() {
            let wait = match deadline {
                None => Duration::from_secs(3600),
                Some(d) => d.saturating_duration_since(Instant::now()),
            };
            if wait.is_zero() {
                return Ok(0);
            }
            st = self.shared.ready.wait_timeout(st, wait).unwrap_or_else(|p| p.into_inner()).0;
        }
        let n = st.items.len().min(max);
        out.extend(st.items.drain(..n));
        if st.items.is_empty()
            && st.fd_armed
            && let Some(fd) = &self.shared.fd
        {
            fd.clear();
            st.fd_armed = false;
        }
        Ok(n)
    }

    /// Like [`next_into`](Self::next_into), returning a new vector.
    pub fn next(&self, max: usize, timeout: Duration) -> Result<Vec<Completion>> {
        let mut v = Vec::new();
        self.next_into(&mut v, max, timeout)?;
        Ok(v)
    }

    /// Completions waiting to be drained.
    pub fn len(&self) -> usize {
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A file descriptor readable exactly while completions are pending (Linux eventfd). Poll it;
    /// never read or write it. `None` for callback queues and on platforms without eventfd.
    pub fn fd(&self) -> Option<i32> {
        self.shared.fd.as_ref().map(|f| f.raw())
    }
}

impl Drop for CompletionQueue {
    fn drop(&mut self) {
        self.callback_closed.store(true, Ordering::Release);
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).closed = true;
        let tx = self.shared.callback_tx.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(tx);
        if let Some((thread, id)) = self.callback_thread.take()
            && id != std::thread::current().id()
        {
            let _ = thread.join();
        }
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner()).items.clear();
    }
}

/// A Linux eventfd used as a level-style readiness flag (raised on empty → non-empty, cleared by
/// the drain that empties the queue, both under the queue lock).
struct EventFd(std::os::fd::OwnedFd);

impl EventFd {
    #[cfg(target_os = "linux")]
    fn new() -> Result<Option<EventFd>> {
        use std::os::fd::FromRawFd;
        // SAFETY: eventfd has no memory preconditions; a non-negative result is a new descriptor
        // that nothing else owns, so OwnedFd may take it.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(Error::new(
                crate::error::Code::Io,
                format!("eventfd: {}", std::io::Error::last_os_error()),
            ));
        }
        Ok(Some(EventFd(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })))
    }

    #[cfg(not(target_os = "linux"))]
    fn new() -> Result<Option<EventFd>> {
        Ok(None)
    }

    fn raw(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.0.as_raw_fd()
    }

    fn raise(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to a descriptor we own. A full counter (EAGAIN)
        // still leaves the fd readable, which is all that is needed.
        unsafe { libc::write(self.raw(), (&one as *const u64).cast(), 8) };
    }

    fn clear(&self) {
        let mut v: u64 = 0;
        // SAFETY: reads at most 8 bytes into a live u64 from a descriptor we own (non-blocking).
        unsafe { libc::read(self.raw(), (&mut v as *mut u64).cast(), 8) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;

    fn c(id: u64) -> Completion {
        Completion { id, tag: id * 10, result: Ok(Output::F32(vec![id as f32])), permit: None }
    }

    #[cfg(target_os = "linux")]
    fn readable(fd: i32) -> bool {
        let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut p, 1, 0) == 1 }
    }

    #[test]
    fn drains_in_batches_in_order_and_times_out() {
        let q = CompletionQueue::new().unwrap();
        assert_eq!(q.next(8, Duration::from_millis(5)).unwrap().len(), 0);
        q.shared().push_all((0..5).map(c));
        let a = q.next(3, Duration::ZERO).unwrap();
        assert_eq!(a.iter().map(|c| c.id).collect::<Vec<_>>(), vec![0, 1, 2]);
        let b = q.next(8, Duration::ZERO).unwrap();
        assert_eq!(b.iter().map(|c| (c.id, c.tag)).collect::<Vec<_>>(), vec![(3, 30), (4, 40)]);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn fd_is_readable_exactly_while_events_are_pending() {
        let q = CompletionQueue::new().unwrap();
        let fd = q.fd().unwrap();
        assert!(!readable(fd));
        q.shared().push_all([c(1), c(2)]);
        assert!(readable(fd));
        q.next(1, Duration::ZERO).unwrap();
        assert!(readable(fd), "one event still pending");
        q.shared().push_all([c(3)]);
        q.next(8, Duration::ZERO).unwrap();
        assert!(!readable(fd));
    }

    #[test]
    fn waiting_consumer_wakes_on_push() {
        let q = Arc::new(CompletionQueue::new().unwrap());
        let q2 = q.clone();
        let t = std::thread::spawn(move || q2.next(4, Duration::MAX).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        q.shared().push_all([c(7)]);
        assert_eq!(t.join().unwrap()[0].id, 7);
    }

    #[test]
    fn callback_mode_delivers_in_order_and_refuses_draining() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s2 = seen.clone();
        let q = CompletionQueue::with_callback(move |c| s2.lock().unwrap().push(c.id)).unwrap();
        assert_eq!(q.next(1, Duration::ZERO).unwrap_err().code(), Code::InvalidArgument);
        assert!(q.fd().is_none());
        q.shared().push_all((0..100).map(c));
        let t0 = Instant::now();
        while seen.lock().unwrap().len() < 100 && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(*seen.lock().unwrap(), (0..100).collect::<Vec<_>>());
        let shared = q.shared().clone();
        drop(q); // joins the callback thread
        shared.push_all([c(1000)]); // after close: discarded, never called back
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(seen.lock().unwrap().len(), 100);
    }
}
