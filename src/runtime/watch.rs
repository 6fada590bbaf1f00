//! One stream's launched tasks, watched until its completion counter passes them — with no
//! thread and no clock of its own (the watcher passes the time in).
//!
//! Two watchers use it (ARCHITECTURE.md §3.5):
//! * **the engine**, for streams that notify (CPU streams): a stream's notify raises the
//!   engine's *advanced* flag and wakes it, and the engine reads the counters of its watched
//!   streams itself. A CPU task's hand-off is then two wake-ups (engine → stream → engine), not
//!   three through the poller;
//! * **the poller** (poller.rs), for streams that do not notify (CUDA counters, written by the
//!   device): it spins on them while tasks are in flight.
//!
//! Each stream has exactly one watcher, so a task is reported once, by whoever watches its
//! stream, in launch order: streams are ordered, so completions arrive in launch order.
//!
//! # Failures and the stall watchdog
//!
//! Every [`HEALTH_EVERY`] while tasks are in flight the watcher runs a *health pass*
//! ([`StreamWatch::check`]): it asks each stream with pending tasks whether it failed
//! ([`CompletionSignal::failure`]); a failed stream's pending tasks are reported done at once
//! with the stream's error, so no request waits forever on a counter that will never move. The
//! same pass is the **stall watchdog**: a stream whose oldest pending task has not completed
//! within the stall timeout (`RuntimeBuilder::stall_timeout`) is declared stalled — the engine
//! hears it first ([`Event::WorkerStalled`], so it launches nothing more there), then every task
//! pending on it is reported done with a `BACKEND` error. A stalled stream's counter is still
//! read at every health pass, also with nothing else in flight; once it has passed every
//! abandoned task the stream has recovered ([`Event::WorkerRecovered`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::CompletionSignal;
use crate::error::{Code, Error};
use crate::runtime::inbox::Event;
use crate::sched::TaskId;

/// How often a watcher runs its health pass while tasks are in flight or a stream is stalled.
pub(crate) const HEALTH_EVERY: Duration = Duration::from_millis(5);

/// The streams one watcher watches, by (model, worker), with its tasks in flight, its stalled
/// streams and its health-pass timer.
pub(crate) struct Watcher {
    streams: HashMap<(usize, usize), StreamWatch>,
    /// Tasks pending on all streams.
    in_flight: usize,
    /// Streams stalled and not yet recovered.
    stalled: usize,
    /// The stall watchdog's limit (`None`: no watchdog).
    stall_timeout: Option<Duration>,
    /// The next health pass: set while a task is in flight or a stream is stalled, with or
    /// without a watchdog. It also bounds how late the engine sees a raised bell whose unpark
    /// comes late: it wakes for the pass and looks at the flag.
    next_health: Option<Instant>,
}

impl Watcher {
    pub(crate) fn new(stall_timeout: Option<Duration>) -> Watcher {
        Watcher { streams: HashMap::new(), in_flight: 0, stalled: 0, stall_timeout, next_health: None }
    }

    /// Watch `task` of `worker` of `model`, done once `signal` reaches `target`, launched at
    /// `sent`.
    pub(crate) fn watch(
        &mut self,
        (model, worker, task): (usize, usize, TaskId),
        target: u64,
        signal: &Arc<dyn CompletionSignal>,
        sent: Instant,
    ) {
        self.next_health.get_or_insert(sent + HEALTH_EVERY);
        let w = self.streams.entry((model, worker)).or_insert_with(|| StreamWatch::new(signal.clone(), sent));
        w.push(target, task, sent);
        self.in_flight += 1;
    }

    /// Tasks pending on all streams.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether a stream is stalled and not yet recovered.
    pub(crate) fn any_stalled(&self) -> bool {
        self.stalled > 0
    }

    /// Report every task whose stream's counter has passed it, as `done(model, task)`, each
    /// stream's in launch order; returns how many.
    pub(crate) fn take_done(&mut self, mut done: impl FnMut(usize, TaskId)) -> usize {
        if self.in_flight == 0 {
            return 0;
        }
        // One clock read per pass that finds tasks done (the watchdog's clock starts there).
        let mut stamp = None;
        let mut n = 0;
        for (&(model, _), w) in self.streams.iter_mut() {
            n += w.take_done(&mut stamp, |task| done(model, task));
        }
        self.in_flight -= n;
        n
    }

    /// When the next health pass is due (`None`: nothing to look at).
    pub(crate) fn next_health(&self) -> Option<Instant> {
        self.next_health
    }

    /// The health pass, if it is due at `now`: each event it leads to goes to `emit` (see
    /// [`Health::events`]); returns how many tasks it gave up on.
    pub(crate) fn health(&mut self, now: Instant, mut emit: impl FnMut(Event)) -> usize {
        if self.next_health.is_none_or(|at| now < at) {
            return 0;
        }
        let mut reported = 0;
        for (&(model, worker), w) in self.streams.iter_mut() {
            if !w.needs_health() {
                continue;
            }
            let was_stalled = w.is_stalled();
            let health = w.check(worker, now, self.stall_timeout);
            reported += health.reported();
            self.stalled = (self.stalled + usize::from(w.is_stalled())) - usize::from(was_stalled);
            health.events(model, worker).for_each(&mut emit);
        }
        self.in_flight -= reported;
        self.next_health = (self.in_flight > 0 || self.stalled > 0).then_some(now + HEALTH_EVERY);
        reported
    }

    /// Drop the streams of `model` (released: every task of it was reported).
    pub(crate) fn forget(&mut self, model: usize) {
        self.streams.retain(|&(m, _), w| {
            if m == model {
                // Empty by the engine's contract; never leave counts for dropped tasks.
                debug_assert_eq!(w.pending(), 0, "model {model} forgotten with tasks in flight");
                self.in_flight -= w.pending();
                self.stalled -= usize::from(w.is_stalled());
            }
            m != model
        });
    }
}

/// One stream's pending tasks, oldest first, with the counter value that marks each one done.
pub(crate) struct StreamWatch {
    signal: Arc<dyn CompletionSignal>,
    fifo: VecDeque<(u64, TaskId)>,
    /// Since when the oldest pending task has been the oldest (the watchdog's clock).
    head_since: Instant,
    /// Stalled: the target of the last task abandoned; the stream has recovered once its
    /// counter reaches it.
    abandoned: Option<u64>,
}

/// What a health pass found on one stream, for the watcher to report (in this order:
/// `recovered`, `stalled`, then every task of `failed` with its error) and to count.
#[derive(Default)]
pub(crate) struct Health {
    /// The stream caught up with the tasks abandoned when it stalled.
    pub recovered: bool,
    /// The stream was declared stalled in this pass (it was not stalled before).
    pub stalled: bool,
    /// Pending tasks given up on (the stream failed or stalled), oldest first, and why.
    pub failed: Option<(Error, Vec<TaskId>)>,
}

impl Health {
    /// The events that report it for `worker` of `model`, in their order (see the type).
    pub(crate) fn events(self, model: usize, worker: usize) -> impl Iterator<Item = Event> {
        let recovered = self.recovered.then_some(Event::WorkerRecovered { model, worker });
        let stalled = self.stalled.then_some(Event::WorkerStalled { model, worker });
        let failed = self.failed.into_iter().flat_map(move |(e, tasks)| {
            tasks.into_iter().map(move |task| Event::TaskDone { model, task, failure: Some(e.clone()) })
        });
        recovered.into_iter().chain(stalled).chain(failed)
    }

    /// Tasks it gives up on.
    pub(crate) fn reported(&self) -> usize {
        self.failed.as_ref().map_or(0, |(_, t)| t.len())
    }
}

impl StreamWatch {
    pub(crate) fn new(signal: Arc<dyn CompletionSignal>, now: Instant) -> StreamWatch {
        StreamWatch { signal, fifo: VecDeque::new(), head_since: now, abandoned: None }
    }

    /// Watch `task`, done once the counter reaches `target`; `sent` is when it was launched
    /// (the watchdog's clock starts there).
    pub(crate) fn push(&mut self, target: u64, task: TaskId, sent: Instant) {
        if self.fifo.is_empty() {
            self.head_since = sent;
        }
        self.fifo.push_back((target, task));
    }

    /// Tasks launched and not yet reported.
    pub(crate) fn pending(&self) -> usize {
        self.fifo.len()
    }

    /// Stalled and not yet recovered.
    pub(crate) fn is_stalled(&self) -> bool {
        self.abandoned.is_some()
    }

    /// Whether it has pending tasks or is stalled: a health pass has something to look at.
    pub(crate) fn needs_health(&self) -> bool {
        !self.fifo.is_empty() || self.is_stalled()
    }

    /// Report the tasks the counter has passed, oldest first, to `done`; returns how many.
    /// `stamp` is the clock read once per pass that finds tasks done (shared by the streams of
    /// one pass): the next task's watchdog clock starts there.
    pub(crate) fn take_done(&mut self, stamp: &mut Option<Instant>, mut done: impl FnMut(TaskId)) -> usize {
        let Some(&(first, _)) = self.fifo.front() else { return 0 };
        let count = self.signal.completed();
        if first > count {
            return 0;
        }
        let mut n = 0;
        while let Some(&(target, task)) = self.fifo.front() {
            if target > count {
                break;
            }
            self.fifo.pop_front();
            n += 1;
            done(task);
        }
        self.head_since = *stamp.get_or_insert_with(Instant::now);
        n
    }

    /// The health pass at `now` for `worker`'s stream, with `stall_timeout` the watchdog's
    /// limit (`None`: no watchdog). See the module docs.
    pub(crate) fn check(&mut self, worker: usize, now: Instant, stall_timeout: Option<Duration>) -> Health {
        let mut health = Health::default();
        if let Some(last) = self.abandoned
            && self.signal.completed() >= last
        {
            self.abandoned = None;
            health.recovered = true;
        }
        if self.fifo.is_empty() {
            return health;
        }
        let failure = match self.signal.failure() {
            Some(e) => e,
            // The oldest task's count came since the watcher last looked: it is not stalled (its
            // watcher reports it next).
            None if self.fifo.front().is_some_and(|&(t, _)| t <= self.signal.completed()) => return health,
            None => match stall_timeout {
                Some(limit) if now.saturating_duration_since(self.head_since) >= limit => {
                    // The counter may still move, late: remember how far, to see it recover.
                    // The highest target, not the last one: a failed launch's target 0 may be
                    // queued behind the task that hangs.
                    let last = self.fifo.iter().map(|&(t, _)| t).max().unwrap_or(0);
                    health.stalled = self.abandoned.is_none();
                    self.abandoned = Some(self.abandoned.map_or(last, |a| a.max(last)));
                    Error::new(
                        Code::Backend,
                        format!(
                            "worker {worker}'s stream stalled: its task did not complete within the \
                             stall timeout of {limit:?}"
                        ),
                    )
                }
                _ => return health,
            },
        };
        // The counter will not reach these targets (or not in time): report them now.
        health.failed = Some((failure, self.fifo.drain(..).map(|(_, task)| task).collect()));
        health
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

    #[derive(Default)]
    struct Counter {
        count: AtomicU64,
        failed: AtomicBool,
    }

    impl CompletionSignal for Counter {
        fn completed(&self) -> u64 {
            self.count.load(Ordering::Acquire)
        }
        fn failure(&self) -> Option<Error> {
            self.failed.load(Ordering::Acquire).then(|| Error::new(Code::Backend, "device fault"))
        }
    }

    fn watch(t0: Instant) -> (Arc<Counter>, StreamWatch) {
        let c = Arc::new(Counter::default());
        (c.clone(), StreamWatch::new(c, t0))
    }

    fn done(w: &mut StreamWatch) -> Vec<TaskId> {
        let mut got = Vec::new();
        w.take_done(&mut None, |t| got.push(t));
        got
    }

    #[test]
    fn tasks_are_reported_in_launch_order_once_the_counter_passes_them() {
        let t0 = Instant::now();
        let (c, mut w) = watch(t0);
        w.push(1, 10, t0);
        w.push(2, 11, t0);
        // A failed launch's target 0 waits behind the tasks launched before it on the stream.
        w.push(0, 12, t0);
        w.push(3, 13, t0);
        assert!(done(&mut w).is_empty());
        c.count.store(1, Ordering::Release);
        assert_eq!(done(&mut w), [10]);
        c.count.store(2, Ordering::Release);
        assert_eq!(done(&mut w), [11, 12]);
        assert_eq!(w.pending(), 1);
        c.count.store(3, Ordering::Release);
        assert_eq!(done(&mut w), [13]);
        assert!(done(&mut w).is_empty(), "nothing is reported twice");
        assert!(!w.needs_health());
    }

    #[test]
    fn a_failed_stream_gives_up_its_pending_tasks_with_its_error() {
        let t0 = Instant::now();
        let (c, mut w) = watch(t0);
        for (target, task) in [(1, 1), (2, 2), (3, 3)] {
            w.push(target, task, t0);
        }
        c.count.store(1, Ordering::Release);
        assert_eq!(done(&mut w), [1]);
        assert!(w.check(0, t0, None).failed.is_none(), "healthy");
        c.failed.store(true, Ordering::Release);
        let h = w.check(0, t0, None);
        assert!(!h.stalled && !h.recovered);
        let (e, tasks) = h.failed.expect("given up on");
        assert_eq!((e.code(), e.message()), (Code::Backend, "device fault"));
        assert_eq!(tasks, [2, 3]);
        assert_eq!(w.pending(), 0);
    }

    #[test]
    fn the_watchdog_gives_up_on_a_stalled_stream_and_sees_it_recover() {
        let limit = Some(Duration::from_millis(50));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let (c, mut w) = watch(t0);
        w.push(1, 1, t0);
        w.push(2, 2, at(10));
        assert!(w.check(0, at(49), limit).failed.is_none(), "fired before the stall timeout");
        // The oldest task has waited 50 ms: both are given up on, the engine hears of the stall
        // first.
        let h = w.check(3, at(50), limit);
        assert!(h.stalled && !h.recovered);
        let events: Vec<Event> = h.events(7, 3).collect();
        assert!(matches!(events[0], Event::WorkerStalled { model: 7, worker: 3 }));
        for (ev, want) in events[1..].iter().zip([1, 2]) {
            let Event::TaskDone { model: 7, task, failure: Some(e) } = ev else {
                panic!("not a failed task")
            };
            assert_eq!((*task, e.code()), (want, Code::Backend));
            assert!(e.message().contains("stalled") && e.message().contains("worker 3"), "{e}");
        }
        assert_eq!(events.len(), 3);
        // Still watched with nothing pending; recovered only once every abandoned task counted.
        assert!(w.needs_health());
        c.count.store(1, Ordering::Release);
        assert!(!w.check(3, at(60), limit).recovered, "recovered before task 2 counted");
        c.count.store(2, Ordering::Release);
        let h = w.check(3, at(65), limit);
        assert!(h.recovered && !h.stalled && h.failed.is_none());
        assert!(!w.needs_health());
        // Usable again: a new task is reported normally, its clock starting at its launch.
        w.push(3, 4, at(100));
        assert!(w.check(3, at(140), limit).failed.is_none());
        c.count.store(3, Ordering::Release);
        assert_eq!(done(&mut w), [4]);
    }

    #[test]
    fn the_watchdog_clock_restarts_when_the_oldest_task_completes() {
        let limit = Some(Duration::from_millis(50));
        let t0 = Instant::now();
        let (c, mut w) = watch(t0);
        w.push(1, 1, t0);
        w.push(2, 2, t0);
        c.count.store(1, Ordering::Release);
        let mut stamp = Some(t0 + Duration::from_millis(40));
        assert_eq!(w.take_done(&mut stamp, |_| {}), 1);
        // Task 2 became the oldest at 40 ms: at 80 ms it has waited 40, not 80.
        assert!(w.check(0, t0 + Duration::from_millis(80), limit).failed.is_none());
        assert!(w.check(0, t0 + Duration::from_millis(90), limit).stalled);
    }

    #[test]
    fn a_failed_launch_behind_a_hanging_task_does_not_make_the_stream_recover() {
        let limit = Some(Duration::from_millis(50));
        let t0 = Instant::now();
        let (c, mut w) = watch(t0);
        w.push(1, 1, t0);
        // A launch on the stream failed: its target is 0, reached at once, but it waits its turn.
        w.push(0, 2, t0);
        let (_, tasks) = w.check(0, t0 + Duration::from_millis(50), limit).failed.expect("stalled");
        assert_eq!(tasks, [1, 2]);
        assert!(!w.check(0, t0 + Duration::from_millis(60), limit).recovered, "still hangs");
        c.count.store(1, Ordering::Release);
        assert!(w.check(0, t0 + Duration::from_millis(70), limit).recovered);
    }

    #[test]
    fn a_count_that_came_since_the_last_look_is_not_a_stall() {
        let limit = Some(Duration::from_millis(50));
        let t0 = Instant::now();
        let (c, mut w) = watch(t0);
        w.push(1, 1, t0);
        c.count.store(1, Ordering::Release);
        let h = w.check(0, t0 + Duration::from_secs(1), limit);
        assert!(!h.stalled && h.failed.is_none());
        assert_eq!(done(&mut w), [1]);
    }

    #[test]
    fn a_watcher_counts_its_tasks_and_stalls_and_times_its_health_passes() {
        let limit = Some(Duration::from_millis(50));
        let t0 = Instant::now();
        let at = |ms| t0 + Duration::from_millis(ms);
        let mut w = Watcher::new(limit);
        assert_eq!(w.next_health(), None, "nothing to look at");
        let (a, b) = (Arc::new(Counter::default()), Arc::new(Counter::default()));
        let (sa, sb): (Arc<dyn CompletionSignal>, Arc<dyn CompletionSignal>) = (a.clone(), b.clone());
        w.watch((0, 0, 1), 1, &sa, t0);
        w.watch((0, 0, 2), 2, &sa, t0);
        w.watch((1, 0, 3), 1, &sb, t0);
        assert_eq!(w.in_flight(), 3);
        assert_eq!(w.next_health(), Some(at(5)));
        // Not due yet: nothing looked at.
        assert_eq!(w.health(at(4), |_| panic!("no event before the pass is due")), 0);
        b.count.store(1, Ordering::Release);
        let mut got = Vec::new();
        assert_eq!(w.take_done(|m, t| got.push((m, t))), 1);
        assert_eq!((got, w.in_flight()), (vec![(1, 3)], 2));
        // Model 0's stream hangs: its two tasks are given up on at the pass after 50 ms.
        assert_eq!(w.health(at(5), |_| panic!("not stalled yet")), 0);
        assert_eq!(w.next_health(), Some(at(10)));
        let mut events = Vec::new();
        assert_eq!(w.health(at(50), |ev| events.push(ev)), 2);
        assert!(matches!(events[0], Event::WorkerStalled { model: 0, worker: 0 }));
        assert_eq!((events.len(), w.in_flight()), (3, 0));
        assert!(w.any_stalled());
        // Stalled with nothing in flight: still timed, until it recovers.
        assert_eq!(w.next_health(), Some(at(55)));
        a.count.store(2, Ordering::Release);
        let mut events = Vec::new();
        w.health(at(55), |ev| events.push(ev));
        assert!(matches!(events[..], [Event::WorkerRecovered { model: 0, worker: 0 }]));
        assert!(!w.any_stalled());
        assert_eq!(w.next_health(), None, "nothing left to look at");
        // A released model's streams are dropped, with their signals.
        w.forget(0);
        assert_eq!(Arc::strong_count(&a), 2, "the watcher let model 0's signal go");
        assert_eq!(Arc::strong_count(&b), 3, "model 1's is kept");
    }

    #[test]
    fn without_a_watchdog_a_slow_stream_is_waited_for() {
        let t0 = Instant::now();
        let (c, mut w) = watch(t0);
        w.push(1, 1, t0);
        assert!(w.check(0, t0 + Duration::from_secs(3600), None).failed.is_none());
        c.count.store(1, Ordering::Release);
        assert_eq!(done(&mut w), [1]);
    }
}
