//! The core's own routing: groups of models under one policy, input-ready events, rejects,
//! task reports and worker shapes, with a recording policy.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::*;
use crate::sched::{Launch, TaskShape};

/// What the recording policy saw, shared with the test.
#[derive(Default)]
struct Seen {
    arrivals: Vec<(RequestId, ModelId)>,
    ready: Vec<RequestId>,
    reports: Vec<TaskReport>,
    /// Every `Policy::reserve` the core made.
    reserved: Vec<usize>,
}

/// Launches every request alone, as soon as its input is ready, on the worker of its model's
/// index (workers of batch 1 and 2); refuses ids at or above `refuse_from`.
struct Recorder {
    seen: Arc<Mutex<Seen>>,
    refuse_from: RequestId,
    out: VecDeque<Decision>,
    tasks: IdMap<RequestId>,
    next: TaskId,
    queued: usize,
    running: usize,
}

impl Recorder {
    fn new(refuse_from: RequestId) -> (Recorder, Arc<Mutex<Seen>>) {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let r = Recorder {
            seen: seen.clone(),
            refuse_from,
            out: VecDeque::new(),
            tasks: IdMap::default(),
            next: 0,
            queued: 0,
            running: 0,
        };
        (r, seen)
    }
}

impl Policy for Recorder {
    fn workers(&self) -> Vec<WorkerShape> {
        vec![WorkerShape { max_batch: 1, cores: 1 }, WorkerShape { max_batch: 2, cores: 2 }]
    }
    fn lookahead(&self) -> usize {
        8
    }
    fn reserve(&mut self, requests: usize) {
        self.seen.lock().unwrap().reserved.push(requests);
    }
    fn arrive(&mut self, _: Time, a: Arrival) {
        self.seen.lock().unwrap().arrivals.push((a.id, a.model));
        if a.id >= self.refuse_from {
            self.out.push_back(Decision::Reject { id: a.id, code: Code::Busy, reason: "full" });
        } else {
            self.queued += 1;
        }
    }
    fn input_ready(&mut self, _: Time, id: RequestId) {
        let model = {
            let mut s = self.seen.lock().unwrap();
            s.ready.push(id);
            s.arrivals.iter().find(|a| a.0 == id).map(|a| a.1)
        };
        let Some(model) = model.filter(|_| id < self.refuse_from) else { return };
        let task = self.next;
        self.next += 1;
        self.tasks.insert(task, id);
        self.queued -= 1;
        self.running += 1;
        self.out.push_back(Decision::Launch(Launch {
            task,
            worker: model % 2,
            model,
            shape: TaskShape::Dense,
            exec: Exec { cores: 1, ..Exec::default() },
            requests: vec![id],
            batch: 1,
        }));
    }
    fn cancel(&mut self, _: Time, _: RequestId) {}
    fn task_done(&mut self, _: Time, report: &TaskReport) {
        self.seen.lock().unwrap().reports.push(*report);
        let id = self.tasks.remove(&report.task).unwrap();
        self.running -= 1;
        self.out.push_back(Decision::Complete { id, code: Code::Ok });
    }
    fn end_early(&mut self, _: Time, _: RequestId) {}
    fn tick(&mut self, _: Time) {}
    fn poll(&mut self) -> Option<Decision> {
        self.out.pop_front()
    }
    fn next_wakeup(&self) -> Option<Time> {
        None
    }
    fn queued(&self) -> usize {
        self.queued
    }
    fn running(&self) -> usize {
        self.running
    }
}

fn submit(model: ModelId, id: RequestId, slots_needed: usize) -> Submit<RequestId> {
    Submit { model, id, graph: None, slots_needed, deadline: None, priority: 0, input_ready: false, data: id }
}

fn drain(core: &mut EngineCore<RequestId>) -> Vec<CoreOutput<RequestId>> {
    std::iter::from_fn(|| core.poll()).collect()
}

fn us(v: u64) -> Time {
    Time::from_micros(v)
}

#[test]
fn a_model_without_a_known_bound_reserves_nothing_and_a_released_one_gives_its_bound_back() {
    let (policy, seen) = Recorder::new(u64::MAX);
    let mut core = EngineCore::<RequestId>::default();
    core.add_group(0, Box::new(policy));
    core.add_model(0, 0, 0, 0);
    core.add_model(1, 0, 0, 40);
    assert_eq!(seen.lock().unwrap().reserved, [40]);
    core.close_model(1);
    assert!(matches!(drain(&mut core)[..], [CoreOutput::Released { model: 1, policy: None, .. }]));
    assert_eq!(core.max_requests(), 0);
}

#[test]
fn a_group_serves_several_models_and_is_released_with_its_last_model() {
    let (policy, seen) = Recorder::new(u64::MAX);
    let mut core = EngineCore::<RequestId>::default();
    core.add_group(7, Box::new(policy));
    core.add_model(0, 7, 0, 300);
    core.add_model(3, 7, 0, 500);
    // Each model's admission bound reaches the group's policy, and the core's own table is
    // reserved for them all.
    assert_eq!(seen.lock().unwrap().reserved, [300, 500]);
    assert_eq!(core.max_requests(), 800);
    assert!(core.requests.capacity() >= 2 * 800, "{}", core.requests.capacity());
    assert_eq!(core.workers_of(3).len(), 2, "the workers the group's policy declares");
    assert_eq!(core.workers_of(3)[1], WorkerShape { max_batch: 2, cores: 2 });
    for (model, id) in [(0, 10), (3, 11), (3, 12)] {
        core.submit(us(1), submit(model, id, 0)).unwrap();
        core.input_ready(us(1), id);
    }
    let launches: Vec<(GroupId, TaskId)> = drain(&mut core)
        .into_iter()
        .map(|o| match o {
            CoreOutput::Launch { group, task } => (group, task),
            _ => panic!("only launches yet"),
        })
        .collect();
    // The policy numbers its models in the order they were added (model 3 is its 1); its
    // launches name them so, and the core hands the driver its own indices.
    assert_eq!(seen.lock().unwrap().arrivals, vec![(10, 0), (11, 1), (12, 1)]);
    let models: Vec<(ModelId, WorkerId, usize)> = launches
        .iter()
        .map(|&(g, t)| {
            let t = core.task(g, t).unwrap();
            (t.model, t.worker, t.exec.cores)
        })
        .collect();
    assert_eq!(models, vec![(0, 0, 1), (3, 1, 1), (3, 1, 1)]);
    assert_eq!((core.requests_of(0), core.requests_of(3)), (1, 2));
    // Each model's gauges are its own, not its group's.
    assert_eq!((core.running(0), core.running(3), core.queued(0), core.queued(3)), (1, 2, 0, 0));
    // Model 0 closes: released alone once its request is done; the group stays for model 3.
    core.close_model(0);
    let (g, t) = launches[0];
    let report = TaskReport { compute: Some(Duration::from_micros(5)), ..TaskReport::of(t) };
    let end = core.task_done(us(9), g, &report, |_, _, _| RowEnd::Continue).unwrap();
    assert_eq!((end.model, end.worker, end.rows), (0, 0, 1));
    assert_eq!(seen.lock().unwrap().reports, vec![report], "the driver's report reaches the policy");
    let out = drain(&mut core);
    assert!(matches!(out[0], CoreOutput::Complete { id: 10, code: Code::Ok, model: 0, rejected: None, .. }));
    assert!(matches!(out[1], CoreOutput::Released { model: 0, policy: None, .. }));
    assert!(core.submit(us(10), submit(0, 13, 0)).is_err(), "a released model takes nothing");
    core.close_model(3);
    for &(g, t) in &launches[1..] {
        core.task_done(us(11), g, &TaskReport::of(t), |_, _, _| RowEnd::Continue);
    }
    let out = drain(&mut core);
    assert_eq!(out.len(), 3);
    assert!(matches!(out[2], CoreOutput::Released { model: 3, policy: Some(_), .. }), "the group goes last");
}

#[test]
fn a_reject_completes_at_once_and_says_so() {
    let (policy, _) = Recorder::new(20);
    let mut core = EngineCore::<RequestId>::default();
    core.add_group(0, Box::new(policy));
    core.add_model(0, 0, 0, 0);
    core.submit(us(0), submit(0, 20, 0)).unwrap();
    let out = drain(&mut core);
    assert_eq!(out.len(), 1);
    let CoreOutput::Complete { id, code, started, rejected, .. } = &out[0] else { panic!("a completion") };
    assert_eq!((*id, *code, *started, *rejected), (20, Code::Busy, None, Some("full")));
    assert!(core.is_empty());
}

#[test]
fn input_ready_before_the_policy_sees_a_request_is_given_as_it_arrives() {
    let (policy, seen) = Recorder::new(u64::MAX);
    let mut core = EngineCore::<RequestId>::default();
    core.add_group(0, Box::new(policy));
    core.add_model(0, 0, 2, 0);
    // Request 1 takes both state slots; request 2 waits for them, its input already ready.
    core.submit(us(0), submit(0, 1, 2)).unwrap();
    core.submit(us(0), submit(0, 2, 2)).unwrap();
    core.input_ready(us(1), 2);
    assert!(seen.lock().unwrap().ready.is_empty(), "request 2's policy has not seen it yet");
    core.input_ready(us(1), 1);
    let Some(CoreOutput::Launch { group, task }) = core.poll() else { panic!("request 1 launches") };
    assert!(core.poll().is_none());
    core.task_done(us(2), group, &TaskReport::of(task), |_, _, _| RowEnd::Continue);
    let out = drain(&mut core);
    assert!(matches!(out[0], CoreOutput::Complete { id: 1, .. }));
    assert!(matches!(out[1], CoreOutput::Launch { .. }), "request 2 arrives with its input ready");
    assert_eq!(seen.lock().unwrap().ready, vec![1, 2]);
}

#[test]
fn a_submit_whose_input_is_in_place_is_ready_with_its_arrival() {
    let (policy, seen) = Recorder::new(u64::MAX);
    let mut core = EngineCore::<RequestId>::default();
    core.add_group(0, Box::new(policy));
    core.add_model(0, 0, 2, 0);
    // Fixed-shape (no slots): ready at once, with no input_ready event.
    core.submit(us(0), Submit { input_ready: true, ..submit(0, 1, 0) }).unwrap();
    // Recurrent, waiting for slots behind request 3: told it is ready when it gets them.
    core.submit(us(0), submit(0, 3, 2)).unwrap();
    core.submit(us(0), Submit { input_ready: true, ..submit(0, 2, 2) }).unwrap();
    assert_eq!(seen.lock().unwrap().ready, vec![1]);
    let Some(CoreOutput::Launch { group, task }) = core.poll() else { panic!("request 1 launches") };
    assert!(core.poll().is_none(), "request 3's input is not ready");
    core.task_done(us(1), group, &TaskReport::of(task), |_, _, _| RowEnd::Continue);
    assert!(matches!(drain(&mut core)[..], [CoreOutput::Complete { id: 1, .. }]));
    core.input_ready(us(2), 3);
    let Some(CoreOutput::Launch { group, task }) = core.poll() else { panic!("request 3 launches") };
    core.task_done(us(3), group, &TaskReport::of(task), |_, _, _| RowEnd::Continue);
    let out = drain(&mut core);
    assert!(matches!(out[0], CoreOutput::Complete { id: 3, .. }));
    assert!(matches!(out[1], CoreOutput::Launch { .. }), "request 2 arrives with its input ready");
    assert_eq!(seen.lock().unwrap().ready, vec![1, 3, 2]);
}

/// A task given up on (its stream failed or stalled past the watchdog) may still write its
/// requests' state slots: when those requests complete, their slots are held back — a request
/// waiting for slots does not get them — until the worker's stream catches up.
#[test]
fn slots_of_a_task_given_up_on_are_held_until_its_worker_catches_up() {
    let (policy, _) = Recorder::new(u64::MAX);
    let mut core = EngineCore::<RequestId>::default();
    core.add_group(0, Box::new(policy));
    core.add_model(0, 0, 1, 10); // one state slot
    core.submit(us(1), submit(0, 1, 1)).unwrap();
    core.input_ready(us(1), 1);
    let launch = drain(&mut core);
    let [CoreOutput::Launch { group, task }] = launch[..] else { panic!("{}", launch.len()) };
    // A second request waits for the only slot.
    core.submit(us(2), submit(0, 2, 1)).unwrap();
    core.input_ready(us(2), 2);
    assert!(drain(&mut core).is_empty(), "no slot for request 2 yet");
    core.give_up(group, task);
    core.task_done(us(3), group, &TaskReport::of(task), |_, _, _| RowEnd::Continue);
    let out = drain(&mut core);
    assert!(matches!(out[..], [CoreOutput::Complete { id: 1, .. }]), "request 1 ends, alone");
    assert_eq!(core.queued(0), 1, "request 2 still waits: the slot is held");
    core.worker_caught_up(0, 1); // another worker: nothing changes
    assert!(drain(&mut core).is_empty());
    core.worker_caught_up(0, 0);
    let out = drain(&mut core);
    assert!(matches!(out[..], [CoreOutput::Launch { .. }]), "request 2 gets the slot and runs");
    assert_eq!(core.queued(0), 0);
}
