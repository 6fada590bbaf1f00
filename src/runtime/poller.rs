//! The completion poller: watches the completion counters of the streams that do not notify
//! (CUDA counters, written by the device, which cannot wake a thread) and reports finished tasks.
//! Streams that notify (CPU streams) are watched by the engine itself (watch.rs).
//!
//! For every such stream it keeps the launched tasks in FIFO order with the counter value that
//! marks each one done (`watch.rs`'s `StreamWatch`). It reads counters with acquire loads only. When nothing
//! is pending it parks; while tasks are in flight it spins — acquire loads and `spin_loop` hints,
//! yielding its core now and then — until they are done, so a completion is seen within a pass.
//! Every few milliseconds it runs the health pass (failures, the stall watchdog, recovery;
//! watch.rs), and while a stream is stalled it wakes for it with nothing else in flight.
//!
//! The engine hands it commands through a channel and wakes it for each ([`PollerHandle`]).

use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::backend::CompletionSignal;
use crate::runtime::inbox::Event;
use crate::runtime::inbox::EventSender;
use crate::runtime::watch::Watcher;
use crate::sched::TaskId;

pub(crate) enum PollerCmd {
    /// Report `task` of `model` once `signal` reaches `target`.
    Watch {
        model: usize,
        worker: usize,
        task: TaskId,
        target: u64,
        signal: Arc<dyn CompletionSignal>,
        /// When it was sent: the watchdog's clock for the task starts here, not when a parked
        /// poller takes the watch up.
        sent: Instant,
    },
    /// Drop the workers of a released model (their signals keep CUDA counters and streams
    /// alive). The engine sends it once every task of the model has been reported, and before
    /// the model's index can be reused.
    Forget {
        model: usize,
    },
    Stop,
}

/// The engine's side of the poller: its command channel and its thread.
pub(crate) struct PollerHandle {
    tx: Sender<PollerCmd>,
    thread: Thread,
}

/// The poller has stopped (the engine is going away, or the poller thread died).
pub(crate) struct PollerGone;

impl PollerHandle {
    pub(crate) fn new(tx: Sender<PollerCmd>, thread: Thread) -> PollerHandle {
        PollerHandle { tx, thread }
    }

    /// Report `task` of `model` once `signal` (a stream that does not notify) reaches `target`.
    pub(crate) fn watch(
        &self,
        (model, worker, task): (usize, usize, TaskId),
        target: u64,
        signal: Arc<dyn CompletionSignal>,
    ) -> Result<(), PollerGone> {
        let sent = Instant::now();
        self.tx
            .send(PollerCmd::Watch { model, worker, task, target, signal, sent })
            .map_err(|_| PollerGone)?;
        self.thread.unpark();
        Ok(())
    }

    /// Drop the workers of a released model (see [`PollerCmd::Forget`]).
    pub(crate) fn forget(&self, model: usize) {
        let _ = self.tx.send(PollerCmd::Forget { model });
        self.thread.unpark();
    }

    pub(crate) fn stop(&self) {
        let _ = self.tx.send(PollerCmd::Stop);
        self.thread.unpark();
    }
}

/// The park with nothing in flight: every command wakes the poller, so this only bounds how long
/// a closed channel (the engine gone without a `Stop`) goes unnoticed.
const IDLE_PARK: Duration = Duration::from_millis(100);
/// Passes without progress between yields of the core.
const YIELD_EVERY: u32 = 256;
/// Passes between clock reads (for the health pass) while tasks are in flight.
const CLOCK_EVERY: u32 = 64;

/// Run the poller; `stall_timeout` is the watchdog's limit (`None`: no watchdog).
pub(crate) fn run(cmds: Receiver<PollerCmd>, engine: EventSender, stall_timeout: Option<Duration>) {
    run_with(cmds, engine, stall_timeout, std::thread::park_timeout)
}

/// [`run`], parking with `park` (tests count the parks).
fn run_with(
    cmds: Receiver<PollerCmd>,
    engine: EventSender,
    stall_timeout: Option<Duration>,
    mut park: impl FnMut(Duration),
) {
    let mut watcher = Watcher::new(stall_timeout);
    let mut idle = 0u32;
    let mut passes = 0u32;
    loop {
        // Take new watches; park only when nothing is in flight (and, while a stream is stalled,
        // only until the next health pass).
        loop {
            let cmd = match cmds.try_recv() {
                Ok(c) => c,
                Err(TryRecvError::Empty) if watcher.in_flight() == 0 => {
                    let wait = match watcher.next_health() {
                        Some(at) if watcher.any_stalled() => at.saturating_duration_since(Instant::now()),
                        _ => IDLE_PARK,
                    };
                    park(wait);
                    match cmds.try_recv() {
                        Ok(c) => c,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => return,
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return,
            };
            match cmd {
                PollerCmd::Watch { model, worker, task, target, signal, sent } => {
                    watcher.watch((model, worker, task), target, &signal, sent)
                }
                PollerCmd::Forget { model } => watcher.forget(model),
                PollerCmd::Stop => return,
            }
        }
        let mut gone = false;
        let mut progressed = watcher.take_done(|model, task| {
            gone |= engine.send(Event::TaskDone { model, task, failure: None }).is_err();
        }) > 0;
        passes = passes.wrapping_add(1);
        if passes.is_multiple_of(CLOCK_EVERY) || watcher.in_flight() == 0 {
            progressed |= watcher.health(Instant::now(), |ev| gone |= engine.send(ev).is_err()) > 0;
        }
        if gone {
            return;
        }
        if progressed {
            idle = 0;
            continue;
        }
        idle = idle.wrapping_add(1).max(1);
        if idle.is_multiple_of(YIELD_EVERY) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Code, Error};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::mpsc;

    /// A counter advanced by a test thread without notifying anyone, as a device writes it.
    #[derive(Default)]
    struct FakeSignal {
        count: AtomicU64,
        polls: AtomicU64,
        failed: AtomicBool,
    }

    impl CompletionSignal for FakeSignal {
        fn completed(&self) -> u64 {
            self.polls.fetch_add(1, Ordering::Relaxed);
            self.count.load(Ordering::Acquire)
        }
        fn notifies(&self) -> bool {
            false
        }
        fn failure(&self) -> Option<Error> {
            self.failed.load(Ordering::Acquire).then(|| Error::new(Code::Backend, "device fault"))
        }
    }

    struct Poller {
        handle: PollerHandle,
        events: Receiver<Event>,
        parks: Arc<AtomicUsize>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Poller {
        fn start() -> Poller {
            Poller::with_watchdog(None)
        }

        fn with_watchdog(stall_timeout: Option<Duration>) -> Poller {
            let (cmds, cmd_rx) = mpsc::channel();
            let (ev_tx, events) = mpsc::channel();
            let parks = Arc::new(AtomicUsize::new(0));
            let p = parks.clone();
            let thread = std::thread::spawn(move || {
                run_with(cmd_rx, EventSender::new(ev_tx), stall_timeout, |d| {
                    p.fetch_add(1, Ordering::SeqCst);
                    std::thread::park_timeout(d);
                })
            });
            let handle = PollerHandle::new(cmds, thread.thread().clone());
            Poller { handle, events, parks, thread: Some(thread) }
        }

        fn watch(&self, worker: usize, task: TaskId, target: u64, signal: &Arc<FakeSignal>) {
            self.watch_as(0, worker, task, target, signal);
        }

        fn watch_as(&self, model: usize, worker: usize, task: TaskId, target: u64, signal: &Arc<FakeSignal>) {
            let signal: Arc<dyn CompletionSignal> = signal.clone();
            assert!(self.handle.watch((model, worker, task), target, signal).is_ok());
        }

        /// The next reported task (generous limit: only so that a bug fails instead of hanging).
        fn done(&self) -> TaskId {
            match self.done_with_failure() {
                (task, None) => task,
                (task, Some(e)) => panic!("task {task} reported failed: {e}"),
            }
        }

        /// The next reported task of model 0 and its failure, if any.
        fn done_with_failure(&self) -> (TaskId, Option<Error>) {
            match self.next() {
                Event::TaskDone { model: 0, task, failure } => (task, failure),
                _ => panic!("unexpected event"),
            }
        }

        fn next(&self) -> Event {
            self.events.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|e| panic!("no event: {e}"))
        }
    }

    impl Drop for Poller {
        fn drop(&mut self) {
            self.handle.stop();
            if let Some(t) = self.thread.take() {
                let _ = t.join();
            }
        }
    }

    /// Wait for `cond`; fail (instead of hanging) after 60 s, as `done` does.
    fn until(cond: impl Fn() -> bool) {
        let give_up = std::time::Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(std::time::Instant::now() < give_up, "condition not reached within 60 s");
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_counter_advanced_without_notify_is_observed_without_parking() {
        let p = Poller::start();
        let sig = Arc::new(FakeSignal::default());
        p.watch(0, 7, 1, &sig);
        p.watch(0, 8, 2, &sig);
        // Another thread advances the counter without notifying, once the poller has polled it
        // many times, and counts the poller's parks meanwhile (before the watches and after the
        // last report, with nothing in flight, it may park).
        let (s, parks) = (sig.clone(), p.parks.clone());
        let writer = std::thread::spawn(move || {
            until(|| s.polls.load(Ordering::Relaxed) >= 5_000);
            let parked = parks.load(Ordering::SeqCst);
            s.count.store(1, Ordering::Release);
            let seen = s.polls.load(Ordering::Relaxed);
            until(|| s.polls.load(Ordering::Relaxed) >= seen + 5_000);
            let parked_in_flight = parks.load(Ordering::SeqCst) - parked;
            s.count.store(2, Ordering::Release);
            parked_in_flight
        });
        assert_eq!(p.done(), 7);
        assert_eq!(p.done(), 8);
        assert_eq!(writer.join().unwrap(), 0, "the poller parked while a stream had work");
    }

    #[test]
    fn a_forgotten_model_s_signals_are_dropped_and_others_still_watched() {
        let p = Poller::start();
        let freed = Arc::new(FakeSignal::default());
        let kept = Arc::new(FakeSignal::default());
        p.watch(0, 1, 1, &freed);
        p.watch_as(1, 0, 2, 1, &kept);
        freed.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 1);
        p.handle.forget(0);
        // The poller holds no clone of the freed model's signal any more (a CUDA signal keeps the
        // model's stream and counters alive).
        until(|| Arc::strong_count(&freed) == 1);
        assert_eq!(Arc::strong_count(&kept), 2, "model 1 is still watched");
        kept.count.store(1, Ordering::Release);
        match p.events.recv_timeout(Duration::from_secs(60)) {
            Ok(Event::TaskDone { model: 1, task: 2, .. }) => {}
            _ => panic!("model 1's task not reported"),
        }
    }

    #[test]
    fn a_failed_stream_reports_its_pending_tasks_once() {
        let p = Poller::start();
        let sig = Arc::new(FakeSignal::default());
        let other = Arc::new(FakeSignal::default());
        for (task, target) in [(1, 1), (2, 2), (3, 3)] {
            p.watch(0, task, target, &sig);
        }
        p.watch(1, 9, 1, &other);
        sig.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 1);
        // The device faults: tasks 2 and 3 will never be counted.
        sig.failed.store(true, Ordering::Release);
        let got = [p.done_with_failure(), p.done_with_failure()];
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [2, 3], "in launch order");
        for (_, failure) in got {
            assert_eq!(failure.map(|e| e.message().to_string()).as_deref(), Some("device fault"));
        }
        // The healthy stream is unaffected, and nothing is reported twice.
        other.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 9);
        assert!(p.events.recv_timeout(Duration::from_millis(20)).is_err());
    }

    #[test]
    fn the_watchdog_gives_up_on_a_stalled_stream_and_sees_it_recover() {
        let p = Poller::with_watchdog(Some(Duration::from_millis(50)));
        let stuck = Arc::new(FakeSignal::default());
        let fine = Arc::new(FakeSignal::default());
        let start = std::time::Instant::now();
        // Done before it is watched, and watched first: reported at the first pass, long
        // before any stall.
        fine.count.store(1, Ordering::Release);
        p.watch(1, 3, 1, &fine);
        p.watch(0, 1, 1, &stuck);
        p.watch(0, 2, 2, &stuck);
        // The healthy stream's task is reported as usual, before the watchdog fires.
        assert!(matches!(p.next(), Event::TaskDone { model: 0, task: 3, failure: None }));
        // The engine hears of the stall first, then both pending tasks fail BACKEND.
        assert!(matches!(p.next(), Event::WorkerStalled { model: 0, worker: 0 }));
        assert!(start.elapsed() >= Duration::from_millis(50), "fired before the stall timeout");
        for want in [1, 2] {
            let (task, failure) = p.done_with_failure();
            assert_eq!(task, want);
            let e = failure.expect("an abandoned task carries an error");
            assert_eq!(e.code(), Code::Backend);
            assert!(e.message().contains("stalled"), "{e}");
        }
        // Nothing else is in flight: the poller still watches the stalled stream, and sees it
        // catch up with the abandoned tasks.
        stuck.count.store(1, Ordering::Release);
        assert!(p.events.recv_timeout(Duration::from_millis(30)).is_err(), "recovered before task 2 counted");
        stuck.count.store(2, Ordering::Release);
        assert!(matches!(p.next(), Event::WorkerRecovered { model: 0, worker: 0 }));
        // Usable again: a new task is reported normally.
        p.watch(0, 4, 3, &stuck);
        stuck.count.store(3, Ordering::Release);
        assert_eq!(p.done(), 4);
    }
}
