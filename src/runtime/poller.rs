//! The completion poller: watches each stream's completion counter and reports finished tasks.
//!
//! For every stream it keeps the launched tasks in FIFO order with the counter value that marks
//! each one done (streams are ordered, so completions arrive in launch order). It reads counters
//! with acquire loads only. When nothing is pending it blocks on its command channel. While tasks
//! are in flight it spins briefly, then:
//! * if every such task is on a stream that notifies (CPU streams unpark the poller as soon as
//!   they advance a counter), parks for short periods — on the CPU it never waits for a park to
//!   time out;
//! * if any is on a stream that does not notify (a CUDA counter, written by the device, which
//!   cannot wake a thread), it keeps spinning — acquire loads and `spin_loop` hints, yielding its
//!   core now and then — until those tasks are done, so a completion is seen within a pass.
//!   Every few milliseconds without progress it also asks those streams whether they failed
//!   ([`CompletionSignal::failure`]); a failed stream's pending tasks are reported done at once
//!   (the runner's `collect` gives them the stream's error), so no request waits forever on a
//!   counter that will never move.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use crate::backend::CompletionSignal;
use crate::runtime::engine::Event;
use crate::sched::TaskId;

pub(crate) enum PollerCmd {
    /// Report `task` of `model` once `signal` reaches `target`.
    Watch {
        model: usize,
        worker: usize,
        task: TaskId,
        target: u64,
        signal: Arc<dyn CompletionSignal>,
    },
    /// Drop the workers of a released model (their signals keep CUDA counters and streams
    /// alive). The engine sends it once every task of the model has been reported, and before
    /// the model's index can be reused.
    Forget {
        model: usize,
    },
    Stop,
}

struct Watched {
    signal: Arc<dyn CompletionSignal>,
    /// `signal.notifies()`, read once.
    notifies: bool,
    fifo: VecDeque<(u64, TaskId)>,
}

/// Passes without progress spent spinning before parking (notifying streams only).
const SPINS: u32 = 64;
const PARK: Duration = Duration::from_micros(200);
/// While waiting on a stream that does not notify: passes between yields of the core.
const YIELD_EVERY: u32 = 256;
/// ... and how often to ask those streams whether they failed (looked at every [`SPINS`] passes).
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
        if idle % YIELD_EVERY == 0 { Wait::Yield } else { Wait::Spin }
    } else if idle <= SPINS {
        Wait::Spin
    } else {
        Wait::Park
    }
}

pub(crate) fn run(cmds: Receiver<PollerCmd>, engine: Sender<Event>) {
    run_with(cmds, engine, std::thread::park_timeout)
}

/// [`run`], parking with `park` (tests count the parks).
fn run_with(cmds: Receiver<PollerCmd>, engine: Sender<Event>, mut park: impl FnMut(Duration)) {
    let mut streams: HashMap<(usize, usize), Watched> = HashMap::new();
    let mut in_flight = 0usize;
    // Tasks in flight on streams that do not notify.
    let mut quiet = 0usize;
    let mut idle = 0u32;
    let mut passes = 0u32;
    let mut next_health = Instant::now() + HEALTH_EVERY;
    loop {
        // Take new watches; block only when nothing is in flight.
        loop {
            let cmd = if in_flight == 0 {
                match cmds.recv() {
                    Ok(c) => c,
                    Err(_) => return,
                }
            } else {
                match cmds.try_recv() {
                    Ok(c) => c,
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            };
            match cmd {
                PollerCmd::Watch { model, worker, task, target, signal } => {
                    let w = streams.entry((model, worker)).or_insert_with(|| Watched {
                        notifies: signal.notifies(),
                        signal,
                        fifo: VecDeque::new(),
                    });
                    w.fifo.push_back((target, task));
                    in_flight += 1;
                    if !w.notifies {
                        if quiet == 0 {
                            next_health = Instant::now() + HEALTH_EVERY;
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
                    }
                    m != model
                }),
                PollerCmd::Stop => return,
            }
        }
        let mut progressed = false;
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
                in_flight -= 1;
                quiet -= usize::from(!w.notifies);
                progressed = true;
                if engine.send(Event::TaskDone { model, task }).is_err() {
                    return;
                }
            }
        }
        passes = passes.wrapping_add(1);
        if quiet > 0 && passes % SPINS == 0 && Instant::now() >= next_health {
            next_health = Instant::now() + HEALTH_EVERY;
            for (&(model, _), w) in streams.iter_mut() {
                if w.notifies || w.fifo.is_empty() || w.signal.failure().is_none() {
                    continue;
                }
                // The counter will never reach these targets: report them now.
                while let Some((_, task)) = w.fifo.pop_front() {
                    in_flight -= 1;
                    quiet -= 1;
                    progressed = true;
                    if engine.send(Event::TaskDone { model, task }).is_err() {
                        return;
                    }
                }
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
        cmds: Sender<PollerCmd>,
        events: Receiver<Event>,
        parks: Arc<AtomicUsize>,
        thread: Option<std::thread::JoinHandle<()>>,
    }

    impl Poller {
        fn start() -> Poller {
            let (cmds, cmd_rx) = mpsc::channel();
            let (ev_tx, events) = mpsc::channel();
            let parks = Arc::new(AtomicUsize::new(0));
            let p = parks.clone();
            let thread = std::thread::spawn(move || {
                run_with(cmd_rx, ev_tx, |d| {
                    p.fetch_add(1, Ordering::SeqCst);
                    std::thread::park_timeout(d);
                })
            });
            Poller { cmds, events, parks, thread: Some(thread) }
        }

        fn watch(&self, worker: usize, task: TaskId, target: u64, signal: &Arc<FakeSignal>) {
            let signal: Arc<dyn CompletionSignal> = signal.clone();
            self.cmds.send(PollerCmd::Watch { model: 0, worker, task, target, signal }).unwrap();
        }

        /// The next reported task (generous limit: only so that a bug fails instead of hanging).
        fn done(&self) -> TaskId {
            match self.events.recv_timeout(Duration::from_secs(60)) {
                Ok(Event::TaskDone { model: 0, task }) => task,
                Ok(_) => panic!("unexpected event"),
                Err(e) => panic!("no completion reported: {e}"),
            }
        }
    }

    impl Drop for Poller {
        fn drop(&mut self) {
            let _ = self.cmds.send(PollerCmd::Stop);
            if let Some(t) = self.thread.take() {
                t.thread().unpark();
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
        // many times (far more than the spins before a park would allow if it parked).
        let s = sig.clone();
        let writer = std::thread::spawn(move || {
            until(|| s.polls.load(Ordering::Relaxed) >= 5_000);
            s.count.store(1, Ordering::Release);
            let seen = s.polls.load(Ordering::Relaxed);
            until(|| s.polls.load(Ordering::Relaxed) >= seen + 5_000);
            s.count.store(2, Ordering::Release);
        });
        assert_eq!(p.done(), 7);
        assert_eq!(p.done(), 8);
        writer.join().unwrap();
        assert_eq!(p.parks.load(Ordering::SeqCst), 0, "the poller parked while a quiet stream had work");
    }

    #[test]
    fn notifying_streams_still_let_the_poller_park() {
        let p = Poller::start();
        let sig = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        p.watch(0, 1, 1, &sig);
        until(|| p.parks.load(Ordering::SeqCst) > 0);
        sig.count.store(1, Ordering::Release);
        p.thread.as_ref().unwrap().thread().unpark(); // the notify
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
        sig.count.store(2, Ordering::Release);
        p.thread.as_ref().unwrap().thread().unpark();
        assert_eq!(p.done(), 3);
    }

    #[test]
    fn a_forgotten_model_s_signals_are_dropped_and_others_still_watched() {
        let p = Poller::start();
        let freed = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        let kept = Arc::new(FakeSignal { notifies: true, ..FakeSignal::default() });
        p.watch(0, 1, 1, &freed);
        let signal: Arc<dyn CompletionSignal> = kept.clone();
        p.cmds.send(PollerCmd::Watch { model: 1, worker: 0, task: 2, target: 1, signal }).unwrap();
        freed.count.store(1, Ordering::Release);
        p.thread.as_ref().unwrap().thread().unpark();
        assert_eq!(p.done(), 1);
        p.cmds.send(PollerCmd::Forget { model: 0 }).unwrap();
        // The poller holds no clone of the freed model's signal any more (a CUDA signal keeps the
        // model's stream and counters alive).
        until(|| Arc::strong_count(&freed) == 1);
        assert_eq!(Arc::strong_count(&kept), 2, "model 1 is still watched");
        kept.count.store(1, Ordering::Release);
        p.thread.as_ref().unwrap().thread().unpark();
        match p.events.recv_timeout(Duration::from_secs(60)) {
            Ok(Event::TaskDone { model: 1, task: 2 }) => {}
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
        let mut got = vec![p.done(), p.done()];
        got.sort();
        assert_eq!(got, [2, 3]);
        // The healthy stream is unaffected, and nothing is reported twice.
        other.count.store(1, Ordering::Release);
        assert_eq!(p.done(), 9);
        assert!(p.events.recv_timeout(Duration::from_millis(20)).is_err());
    }
}
