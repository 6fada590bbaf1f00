//! The completion poller: watches each stream's completion counter and reports finished tasks.
//!
//! For every stream it keeps the launched tasks in FIFO order with the counter value that marks
//! each one done (streams are ordered, so completions arrive in launch order). It reads counters
//! with acquire loads only. When nothing is pending it parks. While tasks are in flight it spins
//! briefly, then:
//! * if every such task is on a stream that notifies (CPU streams unpark the poller as soon as
//!   they advance a counter), parks for short periods — on the CPU it never waits for a park to
//!   time out;
//! * if any is on a stream that does not notify (a CUDA counter, written by the device, which
//!   cannot wake a thread), it keeps spinning — acquire loads and `spin_loop` hints, yielding its
//!   core now and then — until those tasks are done, so a completion is seen within a pass.
//!
//! # Waking it: [`PollerHandle`]
//! The engine hands it commands through a channel and wakes it only when it must
//! ([`PollerHandle::watch`]): a watch of a task on a stream that notifies does not wake it, since
//! the stream will when the task is done — unless the task is done already (or its launch
//! failed). That spares one thread wake-up per task on the CPU (about 15% of a layer block's
//! hand-off on the 2-core VM: 125–132 µs against 137–168 µs, interleaved runs of a tenant chain of
//! trivial layers). The two sides order themselves with a `SeqCst` fence each, as in Dekker's
//! handshake: the engine sends the watch, fences, then reads the counter; the stream advances the
//! counter, fences, then wakes the poller (`backend/cpu/stream.rs`). So if the engine reads the
//! counter short of the task, the stream's wake-up comes after the watch is in the channel, and
//! the poller woken by it finds the watch there. Parked with nothing in flight, the poller still
//! wakes every [`IDLE_PARK`] to notice a closed channel.
//!
//! # Failures and the stall watchdog
//!
//! Every few milliseconds while tasks are in flight (the *health pass*) it asks each stream with
//! pending tasks whether it failed ([`CompletionSignal::failure`]): a failed stream's pending
//! tasks are reported done at once with the stream's error, so no request waits forever on a
//! counter that will never move. The same pass is the **stall watchdog**: a stream whose oldest
//! pending task has not completed within the stall timeout (`RuntimeBuilder::stall_timeout`)
//! is declared stalled — the engine is told first ([`Event::WorkerStalled`], so it launches
//! nothing more there), then every task pending on it is reported done with a `BACKEND` error.
//! The poller keeps reading a stalled stream's counter (also while nothing else is in flight,
//! waking every few milliseconds); once the counter has passed every abandoned task the stream
//! has recovered and the engine is told ([`Event::WorkerRecovered`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::thread::Thread;
use std::time::{Duration, Instant};

use crate::backend::CompletionSignal;
use crate::error::{Code, Error};
use crate::runtime::inbox::Event;
use crate::runtime::inbox::EventSender;
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

/// The engine's side of the poller: its command channel and its thread (module docs, "Waking
/// it").
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

    /// Report `task` of `model` once `signal` reaches `target`, waking the poller only if the
    /// stream will not: it does not notify, or the task is done already.
    pub(crate) fn watch(
        &self,
        (model, worker, task): (usize, usize, TaskId),
        target: u64,
        signal: Arc<dyn CompletionSignal>,
    ) -> Result<(), PollerGone> {
        let quiet = !signal.notifies();
        let probe = if quiet { None } else { Some(signal.clone()) };
        let sent = Instant::now();
        self.tx
            .send(PollerCmd::Watch { model, worker, task, target, signal, sent })
            .map_err(|_| PollerGone)?;
        // Pairs with the stream's fence between its counter and its wake-up (module docs): if
        // this read falls short of `target`, the stream's wake-up follows the watch.
        fence(Ordering::SeqCst);
        if probe.is_none_or(|s| s.completed() >= target) {
            self.thread.unpark();
        }
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

struct Watched {
    signal: Arc<dyn CompletionSignal>,
    /// `signal.notifies()`, read once.
    notifies: bool,
    fifo: VecDeque<(u64, TaskId)>,
    /// Since when the oldest pending task has been the oldest (the watchdog's clock).
    head_since: Instant,
    /// Stalled: the target of the last task abandoned; the stream has recovered once its
    /// counter reaches it.
    abandoned: Option<u64>,
}

/// Passes without progress spent spinning before parking (notifying streams only).
const SPINS: u32 = 64;
const PARK: Duration = Duration::from_micros(200);
/// The park with nothing in flight: every command that needs the poller wakes it, so this only
/// bounds how long a closed channel (the engine gone without a `Stop`) goes unnoticed.
const IDLE_PARK: Duration = Duration::from_millis(100);
/// While waiting on a stream that does not notify: passes between yields of the core.
const YIELD_EVERY: u32 = 256;
/// How often the health pass runs (failures, the stall watchdog, recovery; the clock is read
/// every [`SPINS`] passes).
const HEALTH_EVERY: Duration = Duration::from_millis(5);

/// What the poller does after a pass that found nothing done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Wait {
    Spin,
    Yield,
    Park,
}

/// The wait after the `idle`-th pass in a row without progress (`idle` ≥ 1), with `quiet` tasks
/// in flight on streams that do not notify.
fn wait_after(idle: u32, quiet: usize) -> Wait {
    if quiet > 0 {
        if idle.is_multiple_of(YIELD_EVERY) { Wait::Yield } else { Wait::Spin }
    } else if idle <= SPINS {
        Wait::Spin
    } else {
        Wait::Park
    }
}

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
    let mut streams: HashMap<(usize, usize), Watched> = HashMap::new();
    let mut in_flight = 0usize;
    // Tasks in flight on streams that do not notify.
    let mut quiet = 0usize;
    // Streams stalled and not yet recovered.
    let mut stalled = 0usize;
    let mut idle = 0u32;
    let mut passes = 0u32;
    let mut next_health = Instant::now() + HEALTH_EVERY;
    loop {
        // Take new watches; park only when nothing is in flight (and, while a stream is stalled,
        // only until the next health pass).
        loop {
            let cmd = match cmds.try_recv() {
                Ok(c) => c,
                Err(TryRecvError::Empty) if in_flight == 0 => {
                    let wait = match stalled {
                        0 => IDLE_PARK,
                        _ => next_health.saturating_duration_since(Instant::now()),
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
                    let now = Instant::now();
                    let w = streams.entry((model, worker)).or_insert_with(|| Watched {
                        notifies: signal.notifies(),
                        signal,
                        fifo: VecDeque::new(),
                        head_since: sent,
                        abandoned: None,
                    });
                    if w.fifo.is_empty() {
                        w.head_since = sent;
                    }
                    w.fifo.push_back((target, task));
                    in_flight += 1;
                    if !w.notifies {
                        if quiet == 0 {
                            next_health = now + HEALTH_EVERY;
                        }
                        quiet += 1;
                    }
                }
                PollerCmd::Forget { model } => streams.retain(|&(m, _), w| {
                    if m == model {
                        // Empty by the engine's contract; never leave counts for dropped tasks.
                        debug_assert!(w.fifo.is_empty(), "model {model} forgotten with tasks in flight");
                        in_flight -= w.fifo.len();
                        quiet -= if w.notifies { 0 } else { w.fifo.len() };
                        stalled -= usize::from(w.abandoned.is_some());
                    }
                    m != model
                }),
                PollerCmd::Stop => return,
            }
        }
        let mut progressed = false;
        // One clock read per pass that finds tasks done (the watchdog's clock starts there).
        let mut stamp = None;
        for (&(model, _), w) in streams.iter_mut() {
            if w.fifo.is_empty() {
                continue;
            }
            let done = w.signal.completed();
            while let Some(&(target, task)) = w.fifo.front() {
                if target > done {
                    break;
                }
                w.fifo.pop_front();
                w.head_since = *stamp.get_or_insert_with(Instant::now);
                in_flight -= 1;
                quiet -= usize::from(!w.notifies);
                progressed = true;
                if engine.send(Event::TaskDone { model, task, failure: None }).is_err() {
                    return;
                }
            }
        }
        passes = passes.wrapping_add(1);
        let now = if passes.is_multiple_of(SPINS) || in_flight == 0 { Some(Instant::now()) } else { None };
        if let Some(now) = now.filter(|&n| n >= next_health) {
            next_health = now + HEALTH_EVERY;
            let pass = Health { engine: &engine, stall_timeout, now };
            for (&(model, worker), w) in streams.iter_mut() {
                let Ok(change) = pass.check(model, worker, w) else { return };
                in_flight -= change.reported;
                quiet -= if w.notifies { 0 } else { change.reported };
                stalled = (stalled + change.stalled) - change.recovered;
                progressed |= change.reported > 0;
            }
        }
        if progressed {
            idle = 0;
            continue;
        }
        idle = idle.wrapping_add(1).max(1);
        match wait_after(idle, quiet) {
            Wait::Spin => std::hint::spin_loop(),
            Wait::Yield => std::thread::yield_now(),
            Wait::Park => park(PARK),
        }
    }
}

/// One health pass over the streams (see the module docs).
struct Health<'a> {
    engine: &'a EventSender,
    stall_timeout: Option<Duration>,
    now: Instant,
}

/// What a health pass did to one stream.
#[derive(Default)]
struct Change {
    /// Pending tasks reported done (failed or abandoned).
    reported: usize,
    stalled: usize,
    recovered: usize,
}

/// The engine has gone away: the poller stops.
struct EngineGone;

impl Health<'_> {
    fn check(&self, model: usize, worker: usize, w: &mut Watched) -> Result<Change, EngineGone> {
        let send = |ev| self.engine.send(ev).map_err(|_| EngineGone);
        let mut change = Change::default();
        if let Some(last) = w.abandoned
            && w.signal.completed() >= last
        {
            w.abandoned = None;
            change.recovered = 1;
            send(Event::WorkerRecovered { model, worker })?;
        }
        if w.fifo.is_empty() {
            return Ok(change);
        }
        let failure = match w.signal.failure() {
            Some(e) => e,
            None => match self.stall_timeout {
                Some(limit) if self.now.saturating_duration_since(w.head_since) >= limit => {
                    // The counter may still move, late: remember how far, to see it recover.
                    let last = w.fifo.back().map(|&(t, _)| t).unwrap_or(0);
                    change.stalled = usize::from(w.abandoned.is_none());
                    w.abandoned = Some(w.abandoned.map_or(last, |a| a.max(last)));
                    send(Event::WorkerStalled { model, worker })?;
                    Error::new(
                        Code::Backend,
                        format!(
                            "worker {worker}'s stream stalled: its task did not complete within the \
                             stall timeout of {limit:?}"
                        ),
                    )
                }
                _ => return Ok(change),
            },
        };
        // The counter will not reach these targets (or not in time): report them now.
        while let Some((_, task)) = w.fifo.pop_front() {
            change.reported += 1;
            send(Event::TaskDone { model, task, failure: Some(failure.clone()) })?;
        }
        Ok(change)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::{Code, Error};
    use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
    use std::sync::mpsc;

    /// A counter advanced by a test thread, which may or may not notify the poller.
    #[derive(Default)]
    struct FakeSignal {
        count: AtomicU64,
        polls: AtomicU64,
        notifies: bool,
        failed: AtomicBool,
    }

    impl CompletionSignal for FakeSignal {
        fn completed(&self) -> u64 {
            self.polls.fetch_add(1, Ordering::Relaxed);
            self.count.load(Ordering::Acquire)
        }
        fn notifies(&self) -> bool {
            self.notifies
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
            Poller::with(None, IDLE_PARK)
        }

        fn with_watchdog(stall_timeout: Option<Duration>) -> Poller {
            Poller::with(stall_timeout, IDLE_PARK)
        }

        /// A poller whose park with nothing in flight lasts `idle_park` (long: only a wake-up
        /// ends it).
        fn with(stall_timeout: Option<Duration>, idle_park: Duration) -> Poller {
            let (cmds, cmd_rx) = mpsc::channel();
            let (ev_tx, events) = mpsc::channel();
            let parks = Arc::new(AtomicUsize::new(0));
            let p = parks.clone();
            let thread = std::thread::spawn(move || {
                run_with(cmd_rx, EventSender::new(ev_tx), stall_timeout, |d| {
                    p.fetch_add(1, Ordering::SeqCst);
                    std::thread::park_timeout(if d == IDLE_PARK { idle_park } else { d });
                })
            });
            let handle = PollerHandle::new(cmds, thread.thread().clone());
            Poller { handle, events, parks, thread: Some(thread) }
        }

        /// Watch as the engine does (waking the poller only when it must).
        fn watch(&self, worker: usize, task: TaskId, target: u64, signal: &Arc<FakeSignal>) {
            self.watch_as(0, worker, task, target, signal);
        }

        fn watch_as(&self, model: usize, worker: usize, task: TaskId, target: u64, signal: &Arc<FakeSignal>) {
            let signal: Arc<dyn CompletionSignal> = signal.clone();
            assert!(self.handle.watch((model, worker, task), target, signal).is_ok());
        }

        /// Advance a notifying signal's counter as a CPU stream does: count, fence, wake.
        fn advance(&self, signal: &FakeSignal, to: u64) {
            signal.count.store(to, Ordering::Release);
            fence(Ordering::SeqCst);
            self.thread.as_ref().unwrap().thread().unpark();
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

    /// Wait (without a clock) until `cond` holds.
    /// Wait for `cond`; fail (instead of hanging) after 60 s, as `done` does.
    fn until(cond: impl Fn() -> bool) {
        let give_up = std::time::Instant::now() + Duration::from_secs(60);
        while !cond() {
            assert!(std::time::Instant::now() < give_up, "condition not reached within 60 s");
            std::thread::yield_now();
        }
    }

    #[test]
    fn waiting_on_a_signal_that_does_not_notify_never_parks() {
        for idle in 1..10_000 {
            assert_ne!(wait_after(idle, 1), Wait::Park, "pass {idle}");
        }
        assert_eq!(wait_after(YIELD_EVERY, 3), Wait::Yield);
        assert_eq!(wait_after(1, 0), Wait::Spin);
        assert_eq!(wait_after(SPINS, 0), Wait::Spin);
        assert_eq!(wait_after(SPINS + 1, 0), Wait::Park);
    }

    #[test]
    fn a_counter_advanced_without_notify_is_still_observed() {
        let p = Poller::start();
        let sig = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        p.watch(0, 7, 1, &sig);
        p.watch(0, 8, 2, &sig);
        // Another thread advances the counter without notifying, once the poller has polled it
        // many times (far more than the spins before a park would allow if it parked), and
        // counts the poller's parks meanwhile (before the watches and after the last report,
        // with nothing in flight, it may park).
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
        assert_eq!(writer.join().unwrap(), 0, "the poller parked while a quiet stream had work");
    }

    #[test]
    fn notifying_streams_still_let_the_poller_park() {
        let p = Poller::start();
        let sig = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        // A quiet task first, so the poller is awake and takes the notifying watch up at once;
        // once it has polled that one (beyond the watch's own read), it parks with it in flight.
        let waker = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        waker.count.store(1, Ordering::Release);
        p.watch_as(2, 0, 9, 1, &waker);
        p.watch(0, 1, 1, &sig);
        assert!(matches!(p.next(), Event::TaskDone { model: 2, task: 9, failure: None }));
        until(|| sig.polls.load(Ordering::Relaxed) >= 2);
        let parks = p.parks.load(Ordering::SeqCst);
        until(|| p.parks.load(Ordering::SeqCst) > parks);
        p.advance(&sig, 1); // the stream's notify
        assert_eq!(p.done(), 1);
        // Mixed: a quiet stream in flight keeps it spinning even with a notifying one idle.
        let quiet = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        p.watch(1, 2, 1, &quiet);
        p.watch(0, 3, 2, &sig);
        // Once the poller has polled the quiet stream, it has its watch and must not park again.
        until(|| quiet.polls.load(Ordering::Relaxed) >= 1);
        let parks = p.parks.load(Ordering::SeqCst);
        until(|| quiet.polls.load(Ordering::Relaxed) >= 5_000);
        assert_eq!(p.parks.load(Ordering::SeqCst), parks, "parked while the quiet stream had work");
        quiet.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 2);
        // Only the notifying stream has work now: parking is fine again.
        p.advance(&sig, 2);
        assert_eq!(p.done(), 3);
    }

    /// A watch on a stream that notifies does not wake the poller (the stream's own wake-up
    /// reports it), unless its task is done already; one on a stream that does not notify does.
    #[test]
    fn only_watches_nobody_else_will_announce_wake_the_poller() {
        // Parked with nothing in flight, this poller sleeps until woken.
        let p = Poller::with(None, Duration::from_secs(3600));
        let sig = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        until(|| p.parks.load(Ordering::SeqCst) > 0);
        p.watch(0, 1, 1, &sig);
        assert_eq!(sig.polls.load(Ordering::Relaxed), 1, "the watch reads the counter once");
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(sig.polls.load(Ordering::Relaxed), 1, "the poller woke for the watch");
        assert!(p.events.try_recv().is_err());
        p.advance(&sig, 1);
        assert_eq!(p.done(), 1);
        // Done before its watch (a fast task, or a failed launch's target 0): the watch wakes it.
        sig.count.store(2, Ordering::Release);
        p.watch(0, 2, 2, &sig);
        assert_eq!(p.done(), 2);
        // A stream that does not notify: always woken.
        let quiet = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        quiet.count.store(5, Ordering::Release);
        p.watch_as(1, 0, 3, 6, &quiet);
        quiet.count.store(6, Ordering::Release);
        match p.next() {
            Event::TaskDone { model: 1, task: 3, failure: None } => {}
            _ => panic!("the quiet stream's task not reported"),
        }
    }

    #[test]
    fn a_forgotten_model_s_signals_are_dropped_and_others_still_watched() {
        let p = Poller::start();
        let freed = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        let kept = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        p.watch(0, 1, 1, &freed);
        p.watch_as(1, 0, 2, 1, &kept);
        p.advance(&freed, 1);
        assert_eq!(p.done(), 1);
        p.handle.forget(0);
        // The poller holds no clone of the freed model's signal any more (a CUDA signal keeps the
        // model's stream and counters alive).
        until(|| Arc::strong_count(&freed) == 1);
        assert_eq!(Arc::strong_count(&kept), 2, "model 1 is still watched");
        p.advance(&kept, 1);
        match p.events.recv_timeout(Duration::from_secs(60)) {
            Ok(Event::TaskDone { model: 1, task: 2, .. }) => {}
            _ => panic!("model 1's task not reported"),
        }
    }

    #[test]
    fn a_failed_stream_reports_its_pending_tasks_once() {
        let p = Poller::start();
        let sig = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        let other = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        for (task, target) in [(1, 1), (2, 2), (3, 3)] {
            p.watch(0, task, target, &sig);
        }
        p.watch(1, 9, 1, &other);
        sig.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 1);
        // The device faults: tasks 2 and 3 will never be counted.
        sig.failed.store(true, Ordering::Release);
        let mut got = vec![p.done_with_failure(), p.done_with_failure()];
        got.sort_by_key(|g| g.0);
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [2, 3]);
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
        for notifies in [false, true] {
            let p = Poller::with_watchdog(Some(Duration::from_millis(50)));
            let stuck = Arc::new(FakeSignal { notifies, ..FakeSignal::default() });
            let fine = Arc::new(FakeSignal { notifies, ..FakeSignal::default() });
            let start = std::time::Instant::now();
            p.watch(0, 1, 1, &stuck);
            p.watch(0, 2, 2, &stuck);
            p.watch(1, 3, 1, &fine);
            p.advance(&fine, 1);
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
            // Nothing else is in flight: the poller still watches the stalled stream, and sees
            // it catch up with the abandoned tasks.
            stuck.count.store(1, Ordering::Release);
            assert!(
                p.events.recv_timeout(Duration::from_millis(30)).is_err(),
                "recovered before task 2 counted"
            );
            stuck.count.store(2, Ordering::Release);
            assert!(matches!(p.next(), Event::WorkerRecovered { model: 0, worker: 0 }));
            // Usable again: a new task is reported normally.
            p.watch(0, 4, 3, &stuck);
            p.advance(&stuck, 3);
            assert_eq!(p.done(), 4);
        }
    }

    #[test]
    fn without_a_watchdog_a_slow_stream_is_waited_for() {
        let p = Poller::start();
        let slow = Arc::new(FakeSignal { notifies: false, ..FakeSignal::default() });
        p.watch(0, 1, 1, &slow);
        assert!(p.events.recv_timeout(Duration::from_millis(100)).is_err());
        slow.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 1);
    }
}
