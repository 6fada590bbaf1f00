//! The completion poller: watches each stream's completion counter and reports finished tasks.
//!
//! For every stream it keeps the launched tasks in FIFO order with the counter value that marks
//! each one done (streams are ordered, so completions arrive in launch order). It reads counters
//! with acquire loads only. When nothing is pending it blocks on its command channel; while tasks
//! are in flight it spins briefly, then parks for short periods; CPU streams unpark it as soon as
//! they advance a counter, so on the CPU it never waits for a park to time out.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::Duration;

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
    Stop,
}

struct Watched {
    signal: Arc<dyn CompletionSignal>,
    fifo: VecDeque<(u64, TaskId)>,
}

const SPINS: u32 = 64;
const PARK: Duration = Duration::from_micros(200);

pub(crate) fn run(cmds: Receiver<PollerCmd>, engine: Sender<Event>) {
    let mut streams: HashMap<(usize, usize), Watched> = HashMap::new();
    let mut in_flight = 0usize;
    let mut idle_spins = 0u32;
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
                    streams
                        .entry((model, worker))
                        .or_insert_with(|| Watched { signal, fifo: VecDeque::new() })
                        .fifo
                        .push_back((target, task));
                    in_flight += 1;
                }
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
                progressed = true;
                if engine.send(Event::TaskDone { model, task }).is_err() {
                    return;
                }
            }
        }
        if progressed {
            idle_spins = 0;
        } else if idle_spins < SPINS {
            idle_spins += 1;
            std::hint::spin_loop();
        } else {
            std::thread::park_timeout(PARK);
        }
    }
}
