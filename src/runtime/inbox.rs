//! The engine's inbox: how events and arrivals reach the engine thread (ARCHITECTURE.md §3.2).
//!
//! * **Arrivals** travel through their model's [`ArrivalRing`]: a bounded ring allocated when the
//!   model is added, with a place for every request its admission bound lets be in flight (up
//!   to `MAX_RESERVED_REQUESTS`). A submit writes one pointer into it; nothing is allocated per
//!   arrival, on any thread. (Through std's list channel, which arrivals used before, the
//!   submitting thread allocated a block per 31 events and the engine freed it; under an
//!   overload the blocks alive grew with the backlog, and the allocator's arenas with them:
//!   the 30-minute soak's RSS crept by the pages those blocks first touched, §9.)
//! * **A CPU task's end** is no message at all: its stream rings the engine's bell
//!   ([`StreamBell`]: a flag and a wake-up), and the engine reads the counters it watches
//!   (watch.rs).
//! * **Every other event** (cancels, flushes, models added and removed, shutdown, the poller's
//!   reports of CUDA tasks) goes through the event channel, as does an arrival that finds its
//!   ring full (a model whose bound is larger than the reserved places).
//!
//! The engine never blocks in the channel: it takes what is waiting, and with nothing waiting
//! it parks until its next timer. Everyone who hands it something unparks it afterwards
//! ([`EventSender::wake`], [`StreamBell::ring`]); `unpark` before `park` makes that `park` return at once, so no
//! wake-up is lost between the engine's last look and its park, and an unpark of a running
//! engine costs one atomic swap.
//!
//! **Order.** A request's arrival is in its ring before `submit` returns its id, so a cancel of
//! that id, or a flush or shutdown the caller sends after submitting, is sent after it. The
//! engine takes every arrival already in the rings before it handles such an event
//! ([`Event::follows_arrivals`]), so a cancel never overtakes its own
//! arrival. Arrivals of one model are taken in the order they were written.

use std::sync::atomic::{AtomicBool, Ordering, fence};
use std::sync::mpsc::{SendError, Sender};
use std::sync::{Arc, OnceLock};
use std::thread::Thread;
use std::time::Instant;

use crossbeam_queue::ArrayQueue;

use super::engine::{EngineGroup, Pending};
use crate::error::Error;
use crate::sched::{RequestId, TaskId};

/// Every other event's count is bounded by construction — arrivals (which mostly come through
/// their model's ring, below) by the models' admission bounds, task reports by the tasks in
/// flight (the policies' lookahead × workers), model adds and removes by the model slots — but a
/// caller may cancel or flush in a loop faster than the engine drains them. Each such message takes a place of this budget when sent and gives it
/// back when handled, so the channel's depth is bounded (DESIGN principle 4) while cancels keep
/// their order with the arrivals before them (the engine takes the rings' arrivals before it
/// handles a cancel, **Order** above; a mailbox of pending cancels would lose a cancel that overtook
/// its own arrival).
pub(crate) const MAX_PENDING_CONTROL: usize = 1 << 16;

/// Places for cancel and flush messages in the event channel ([`MAX_PENDING_CONTROL`]).
#[derive(Debug, Default)]
pub(crate) struct ControlBudget(std::sync::atomic::AtomicUsize);

impl ControlBudget {
    /// Take a place for one message; `false` when every place is taken.
    pub(crate) fn take(&self) -> bool {
        use std::sync::atomic::Ordering::AcqRel;
        if self.0.fetch_add(1, AcqRel) >= MAX_PENDING_CONTROL {
            self.0.fetch_sub(1, AcqRel);
            return false;
        }
        true
    }

    /// A message was handled (or never sent): its place is free.
    pub(crate) fn give_back(&self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

pub(crate) enum Event {
    /// Serve these models under this policy.
    AddGroup(Box<EngineGroup>),
    /// The model's last handle was dropped: release it once its requests have completed.
    RemoveModel(usize),
    Arrive(Box<Pending>),
    Cancel(RequestId),
    /// A launched task is over: its count was seen, or (with `failure`) its watcher gave up on
    /// it — its stream failed or stalled — and its requests complete with that error.
    TaskDone {
        model: usize,
        task: TaskId,
        failure: Option<Error>,
    },
    /// The stall watchdog gave up on the worker's stream (watch.rs): launch nothing more on it
    /// until it recovers; its tasks complete `BACKEND` at once.
    WorkerStalled {
        model: usize,
        worker: usize,
    },
    /// A stalled worker's stream completed its abandoned tasks after all: usable again.
    WorkerRecovered {
        model: usize,
        worker: usize,
    },
    /// The model's caller expects no more requests soon ([`Policy::flush`]).
    Flush(usize),
    /// Stop accepting; finish what is pending until `drain_until`, then cancel the rest and exit.
    Shutdown {
        drain_until: Instant,
    },
}

impl Event {
    /// Whether the arrivals already written into the rings are taken before this event is
    /// handled: a caller's cancel, flush, model drop or shutdown follows its submits (inbox.rs).
    /// The watchers' reports concern tasks, which arrivals do not change.
    pub(crate) fn follows_arrivals(&self) -> bool {
        !matches!(self, Event::TaskDone { .. } | Event::WorkerStalled { .. } | Event::WorkerRecovered { .. })
    }
}

/// The arrivals of one model, from the submitting threads to the engine: a ring of boxed
/// records, allocated whole when the model is added. Many writers, one reader (the engine).
///
/// **Closed** once the engine has let the model go (released, or the engine stopped — even by a
/// panic): whatever is in it then, or written into it after, is dropped at once, and a dropped
/// arrival's reply completes its request `Cancelled` (request.rs). So no arrival waits in a
/// ring nobody reads (with the shutdown gate, none is written after a clean stop anyway).
pub(crate) struct ArrivalRing {
    ring: ArrayQueue<Box<Pending>>,
    closed: AtomicBool,
}

impl ArrivalRing {
    /// Places for `places` arrivals in flight (at least one).
    pub(crate) fn new(places: usize) -> ArrivalRing {
        ArrivalRing { ring: ArrayQueue::new(places.max(1)), closed: AtomicBool::new(false) }
    }

    /// Write an arrival; the arrival back when every place is taken.
    pub(crate) fn push(&self, p: Box<Pending>) -> Result<(), Box<Pending>> {
        self.ring.push(p)?;
        // Either this load sees the close, or the close's drain sees the arrival: both sides
        // write, fence, then read (the store-buffer pattern needs the SeqCst fences).
        fence(Ordering::SeqCst);
        if self.closed.load(Ordering::Relaxed) {
            self.drop_all();
        }
        Ok(())
    }

    /// Nobody takes arrivals from this ring any more (see the type's docs).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        self.drop_all();
    }

    fn drop_all(&self) {
        while let Some(p) = self.ring.pop() {
            drop(p);
        }
    }

    /// The oldest arrival not yet taken.
    pub(crate) fn pop(&self) -> Option<Box<Pending>> {
        self.ring.pop()
    }

    /// Arrivals waiting. Every arrival whose write happened before this call is counted (more
    /// may follow).
    pub(crate) fn len(&self) -> usize {
        self.ring.len()
    }
}

/// The sending side of the engine's event channel, which wakes the engine after every send.
/// Cloned for every thread that talks to the engine; dropping a clone wakes it too, so an engine
/// parked without a timer sees its channel close.
pub(crate) struct EventSender {
    /// `None` only inside `drop`, which closes it before the wake-up.
    tx: Option<Sender<Event>>,
    /// The engine's thread, known once it is spawned ([`set_engine`](Self::set_engine)).
    engine: Arc<OnceLock<Thread>>,
}

impl EventSender {
    pub(crate) fn new(tx: Sender<Event>) -> EventSender {
        EventSender { tx: Some(tx), engine: Arc::new(OnceLock::new()) }
    }

    /// Name the engine's thread, for every clone (and every [`StreamBell`]). Called right after
    /// it is spawned, before anything can be handed to it: the runtime's handle does not exist
    /// yet, so no model's stream can ring, and the poller only reports tasks the engine launched
    /// after this.
    pub(crate) fn set_engine(&self, engine: Thread) {
        let _ = self.engine.set(engine);
    }

    /// Send `ev` and wake the engine.
    pub(crate) fn send(&self, ev: Event) -> Result<(), SendError<Event>> {
        let sent = match &self.tx {
            Some(tx) => tx.send(ev),
            None => Err(SendError(ev)),
        };
        self.wake();
        sent
    }

    /// Wake the engine: it has something new to take (an arrival written into a ring).
    pub(crate) fn wake(&self) {
        if let Some(t) = self.engine.get() {
            t.unpark();
        }
    }
}

impl EventSender {
    /// The bell the engine's watched streams ring ([`StreamBell`]), raising `advanced`.
    pub(crate) fn bell(&self, advanced: Arc<AtomicBool>) -> StreamBell {
        StreamBell { advanced, engine: self.engine.clone() }
    }
}

/// What a stream that notifies calls after advancing its completion counter (the runtime's
/// `Notify` for its runners): it raises the engine's *advanced* flag, then wakes the engine,
/// which reads the counters of the streams it watches (watch.rs). Holds no sender, so the
/// runners that keep it never hold the event channel open.
///
/// No advance is missed. Each stream raises the flag with a release swap after its counter, and
/// the engine lowers it with an acquire swap before it reads the counters. Every raise is a
/// read-modify-write, so it continues the release sequence of the raises before it: whichever
/// raise the engine's swap reads, it sees the counters of all of them. An advance the engine did
/// not see raises the flag again after that swap, and `unpark` before `park` makes that `park`
/// return at once. (A plain store would not do: reading another stream's later store, the engine
/// could miss the first stream's count.) Every raise unparks, also one that finds the flag up:
/// the stream that raised it may not have unparked yet (an unpark of a running engine is one
/// atomic swap).
#[derive(Clone)]
pub(crate) struct StreamBell {
    advanced: Arc<AtomicBool>,
    engine: Arc<OnceLock<Thread>>,
}

impl StreamBell {
    pub(crate) fn ring(&self) {
        self.advanced.swap(true, Ordering::Release);
        if let Some(t) = self.engine.get() {
            t.unpark();
        }
    }
}

impl Clone for EventSender {
    fn clone(&self) -> EventSender {
        EventSender { tx: self.tx.clone(), engine: self.engine.clone() }
    }
}

impl Drop for EventSender {
    /// Close this sender, then wake the engine: woken first, it could look at the channel
    /// while this sender still held it open, and park again for good.
    fn drop(&mut self) {
        drop(self.tx.take());
        self.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::{self, TryRecvError};
    use std::time::{Duration, Instant};

    use crate::model::Input;
    use crate::runtime::request::Reply;
    use crate::runtime::stats::Stats;

    /// An arrival of `model`, told apart by `id` (carried as its rows).
    fn pending(model: usize, id: u64) -> Box<Pending> {
        let stats = Arc::new(Stats::default());
        Box::new(Pending {
            model,
            submitted: Instant::now(),
            rows: id,
            input: Input::F32(vec![1.0]),
            cells: None,
            slots_needed: 0,
            deadline: None,
            priority: 0,
            reply: Reply::spent(stats),
            run: Default::default(),
        })
    }

    #[test]
    fn a_full_ring_hands_the_arrival_back_and_keeps_its_order() {
        let ring = ArrivalRing::new(3);
        for id in 0..3 {
            assert!(ring.push(pending(0, id)).is_ok());
        }
        let back = ring.push(pending(0, 3)).expect_err("three places");
        assert_eq!(back.rows, 3);
        assert_eq!(ring.len(), 3);
        let ids: Vec<u64> = std::iter::from_fn(|| ring.pop()).map(|p| p.rows).collect();
        assert_eq!(ids, [0, 1, 2]);
        assert!(ring.push(pending(0, 4)).is_ok(), "a place taken is free again");
        assert_eq!(ArrivalRing::new(0).ring.capacity(), 1, "never zero places");
    }

    /// A request whose reply completes into a ticket, for watching what a ring does with it.
    fn ticketed(id: u64) -> (Box<Pending>, crate::runtime::Ticket) {
        let stats = Arc::new(Stats::default());
        let (ticket, slot) = crate::runtime::Ticket::new(id);
        let admission = Arc::new(crate::runtime::admission::Admission::new(
            4,
            1,
            crate::runtime::recycle::Recycler::none(),
        ));
        let permit = admission.admit("m", 1, None, Instant::now()).unwrap();
        let mut p = pending(0, id);
        p.reply = Reply::new(id, crate::runtime::request::Sink::Ticket(slot), stats, permit);
        (p, ticket)
    }

    #[test]
    fn a_closed_ring_cancels_what_it_holds_and_what_is_written_after() {
        let ring = ArrivalRing::new(4);
        let (held, held_ticket) = ticketed(1);
        assert!(ring.push(held).is_ok());
        ring.close();
        assert_eq!(ring.len(), 0);
        assert_eq!(held_ticket.wait().unwrap_err().code(), crate::Code::Cancelled);
        let (late, late_ticket) = ticketed(2);
        assert!(ring.push(late).is_ok(), "taken, then dropped");
        assert_eq!(ring.len(), 0);
        assert_eq!(late_ticket.wait().unwrap_err().code(), crate::Code::Cancelled);
    }

    /// The engine's side of the protocol, as the engine loop runs it: take what is waiting,
    /// park when nothing is. Several writers write into the ring and send events; every one of
    /// them is taken, in each writer's order, and the engine never sleeps out a park with work
    /// waiting (its park has no timer, so a lost wake-up hangs the test).
    #[test]
    fn no_arrival_or_event_waits_for_a_wake_up_that_was_lost() {
        const WRITERS: u64 = 4;
        const EACH: u64 = 2_000;
        let ring = Arc::new(ArrivalRing::new(64));
        let (tx, rx) = mpsc::channel();
        let events = EventSender::new(tx);
        let (seen_tx, seen_rx) = mpsc::channel();
        let taker = ring.clone();
        let engine = std::thread::spawn(move || {
            let (mut arrivals, mut flushes) = (Vec::new(), 0);
            let mut closed = false;
            while !closed {
                let mut took = false;
                loop {
                    match rx.try_recv() {
                        Ok(Event::Flush(_)) => flushes += 1,
                        Ok(_) => unreachable!("only flushes are sent"),
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            closed = true;
                            break;
                        }
                    }
                    took = true;
                }
                while let Some(p) = taker.pop() {
                    arrivals.push((p.model, p.rows));
                    took = true;
                }
                if !took && !closed {
                    std::thread::park();
                }
            }
            seen_tx.send((arrivals, flushes)).unwrap();
        });
        events.set_engine(engine.thread().clone());
        let writers: Vec<_> = (0..WRITERS)
            .map(|w| {
                let (ring, events) = (ring.clone(), events.clone());
                std::thread::spawn(move || {
                    for id in 0..EACH {
                        let mut p = pending(w as usize, id);
                        // A full ring is the caller's admission bound reached: wait for room.
                        while let Err(back) = ring.push(p) {
                            p = back;
                            events.wake();
                            std::thread::yield_now();
                        }
                        events.wake();
                        if id % 100 == 0 {
                            events.send(Event::Flush(0)).unwrap();
                        }
                        if id % 500 == 0 {
                            // Let the engine run dry and park between bursts.
                            std::thread::sleep(Duration::from_micros(300));
                        }
                    }
                })
            })
            .collect();
        writers.into_iter().for_each(|w| w.join().unwrap());
        drop(events);
        let (arrivals, flushes) = seen_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the engine took everything and saw the close");
        engine.join().unwrap();
        assert_eq!(flushes, WRITERS * EACH / 100);
        assert_eq!(arrivals.len() as u64, WRITERS * EACH);
        for w in 0..WRITERS as usize {
            let ids: Vec<u64> = arrivals.iter().filter(|a| a.0 == w).map(|a| a.1).collect();
            assert_eq!(ids, (0..EACH).collect::<Vec<_>>(), "writer {w}'s arrivals in its order");
        }
    }
}

#[cfg(test)]
mod control_tests {
    use super::*;

    #[test]
    fn the_control_budget_refuses_past_its_bound_and_frees_places_as_they_are_handled() {
        let b = ControlBudget::default();
        assert!((0..MAX_PENDING_CONTROL).all(|_| b.take()));
        assert!(!b.take(), "every place is taken");
        assert!(!b.take(), "a refused take holds no place");
        b.give_back();
        assert!(b.take());
        assert!(!b.take());
    }
}
