//! Streams and events with CUDA's semantics, on threads: the CPU analog the cold-start executor
//! is tested on.
//!
//! A [`Stream`] runs its operations one at a time, in order, on its own thread. An [`Event`] is
//! *recorded* on a stream by the host ([`Stream::record`]: the record is issued now and
//! completes when the stream reaches it); a stream or the host *waits* on it. As in CUDA
//! (`cudaStreamWaitEvent`, `cudaEventSynchronize`), a wait captures the event's most recent
//! record **when the wait is issued**: waiting on an event that has not been recorded yet
//! returns at once — the hazard DeepPlan's executor guards against by blocking its launcher
//! until the record is issued ([`Event::wait_recorded`]).

use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::Scope;

#[derive(Debug, Default)]
struct State {
    /// Records issued by the host so far.
    issued: u64,
    /// Records the stream has reached.
    completed: u64,
    /// The host will never issue a record (its launcher failed): waiting for one fails.
    abandoned: bool,
}

/// An event (cheap to clone: clones are the same event).
#[derive(Clone, Debug, Default)]
pub struct Event(Arc<(Mutex<State>, Condvar)>);

impl Event {
    pub fn new() -> Event {
        Event::default()
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether a record of the event has been issued.
    pub fn is_recorded(&self) -> bool {
        self.state().issued > 0
    }

    /// Whether a record has been issued and the latest one has completed (`cudaEventQuery`).
    pub fn is_completed(&self) -> bool {
        let s = self.state();
        s.issued > 0 && s.completed >= s.issued
    }

    /// Blocks until a record has been issued (the launcher's guard); false if the event was
    /// [abandoned](Self::abandon) first.
    pub fn wait_recorded(&self) -> bool {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        while s.issued == 0 && !s.abandoned {
            s = cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.issued > 0
    }

    /// Says that no record will be issued if none has been (the launcher is gone), waking whoever
    /// waits for one.
    pub fn abandon(&self) {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        s.abandoned = true;
        cv.notify_all();
    }

    /// The record a wait issued now waits for (0: none, the wait is a no-op).
    fn capture(&self) -> u64 {
        self.state().issued
    }

    /// Blocks until record `target` has completed.
    fn wait_for(&self, target: u64) {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        while s.completed < target {
            s = cv.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// `cudaEventSynchronize` on the calling thread: waits for the most recent record issued so
    /// far; returns at once if none was.
    pub fn synchronize(&self) {
        let target = self.capture();
        self.wait_for(target);
    }

    fn issue(&self) -> u64 {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        s.issued += 1;
        cv.notify_all();
        s.issued
    }

    fn complete(&self, n: u64) {
        let (lock, cv) = &*self.0;
        let mut s = lock.lock().unwrap_or_else(PoisonError::into_inner);
        s.completed = s.completed.max(n);
        cv.notify_all();
    }
}

type Op<'scope> = Box<dyn FnOnce() + Send + 'scope>;

/// An in-order work queue on its own scoped thread (operations may borrow what outlives the
/// scope). Dropping it lets the thread finish what was enqueued; the scope joins it.
pub struct Stream<'scope> {
    tx: mpsc::Sender<Op<'scope>>,
}

impl<'scope> Stream<'scope> {
    pub fn spawn<'env>(scope: &'scope Scope<'scope, 'env>, name: &str) -> std::io::Result<Stream<'scope>> {
        let (tx, rx) = mpsc::channel::<Op<'scope>>();
        std::thread::Builder::new().name(format!("serve-cold-{name}")).spawn_scoped(scope, move || {
            for op in rx {
                // A failed operation must not stop the stream: later records still complete, so
                // nothing waiting on them hangs (what the operation should have written stays
                // as it was: NaN in a poisoned buffer).
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(op));
            }
        })?;
        Ok(Stream { tx })
    }

    /// Enqueues `op`.
    pub fn enqueue(&self, op: impl FnOnce() + Send + 'scope) {
        // The receiver lives until this sender is dropped, so sending cannot fail.
        let _ = self.tx.send(Box::new(op));
    }

    /// Issues a record of `event` (`cudaEventRecord`): it completes when the stream reaches it.
    pub fn record(&self, event: &Event) {
        let n = event.issue();
        let e = event.clone();
        self.enqueue(move || e.complete(n));
    }

    /// Makes the stream wait for `event`'s most recent record issued so far
    /// (`cudaStreamWaitEvent`); a no-op if none was.
    pub fn wait(&self, event: &Event) {
        let target = event.capture();
        if target > 0 {
            let e = event.clone();
            self.enqueue(move || e.wait_for(target));
        }
    }
}
