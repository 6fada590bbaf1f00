//! Exact virtual-time tests of cellular batching.

use std::sync::Arc;

use super::*;
use crate::sched::{CellGraph, Launch, drain};

fn us(v: u64) -> Time {
    Time::from_micros(v)
}

fn cfg(types: &[(&str, usize, i32)], workers: usize, max_tasks: usize) -> CellularConfig {
    CellularConfig {
        cell_types: types.iter().map(|&(n, b, p)| CellTypeConfig::new(n, b, p)).collect(),
        workers,
        max_tasks_to_submit: max_tasks,
    }
}

fn lstm_policy(max_batch: usize, workers: usize, max_tasks: usize) -> CellularPolicy {
    CellularPolicy::new(cfg(&[("step", max_batch, 0)], workers, max_tasks)).unwrap()
}

fn chain(len: usize) -> Arc<CellGraph> {
    Arc::new(CellGraph::chains(&[(0, len)]).unwrap())
}

fn seq2seq(enc: usize, dec: usize) -> Arc<CellGraph> {
    Arc::new(CellGraph::chains(&[(0, enc), (1, dec)]).unwrap())
}

/// A tree from parent indices: leaves are type 0, internal nodes type 1.
fn tree(parents: &[i32]) -> Arc<CellGraph> {
    Arc::new(CellGraph::tree_of_parents(parents, 0, 1).unwrap())
}

fn arrive(p: &mut CellularPolicy, now: Time, id: RequestId, g: Arc<CellGraph>) {
    p.arrive(now, Arrival { model: 0, id, deadline: None, priority: 0, cells: Some(g) });
}

/// A launch of `cell` on `worker` with (request, node) rows, unpadded.
fn launch(task: TaskId, worker: WorkerId, cell: CellType, rows: &[(RequestId, u32)]) -> Decision {
    padded(task, worker, cell, rows, rows.len())
}

fn padded(
    task: TaskId,
    worker: WorkerId,
    cell: CellType,
    rows: &[(RequestId, u32)],
    batch: usize,
) -> Decision {
    Decision::Launch(Launch::of_rows(task, worker, cell, rows, batch))
}

fn done(id: RequestId, code: Code) -> Decision {
    Decision::Complete { id, code }
}

#[test]
fn a_new_request_joins_at_the_next_task() {
    let mut p = lstm_policy(8, 1, 1);
    arrive(&mut p, us(0), 1, chain(3));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
    arrive(&mut p, us(1), 2, chain(2));
    assert_eq!(drain(&mut p), vec![], "the worker's only task slot is taken");
    assert_eq!((p.queued(), p.running()), (1, 1));
    p.task_done(us(2), &TaskReport::of(0));
    // The pinned subgraph first, then the newcomer.
    assert_eq!(drain(&mut p), vec![launch(1, 0, 0, &[(1, 1), (2, 0)])]);
    assert_eq!((p.queued(), p.running()), (0, 2));
}

#[test]
fn a_request_leaves_at_its_last_cell() {
    let mut p = lstm_policy(8, 1, 1);
    arrive(&mut p, us(0), 1, chain(3));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
    arrive(&mut p, us(0), 2, chain(1));
    p.task_done(us(5), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![launch(1, 0, 0, &[(1, 1), (2, 0)])]);
    p.task_done(us(6), &TaskReport::of(1));
    // Request 2 is done after its one cell and leaves at once; request 1 carries on alone.
    assert_eq!(drain(&mut p), vec![done(2, Code::Ok), launch(2, 0, 0, &[(1, 2)])]);
    p.task_done(us(7), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![done(1, Code::Ok)]);
    assert_eq!((p.queued(), p.running(), p.next_wakeup()), (0, 0, None));
}

#[test]
fn a_long_request_keeps_batching_with_successive_short_ones() {
    let mut p = lstm_policy(8, 1, 1);
    arrive(&mut p, us(0), 100, chain(5));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(100, 0)])]);
    for step in 1..5u32 {
        let short = 100 + step as RequestId;
        arrive(&mut p, us(step as u64 * 10), short, chain(1));
        p.task_done(us(step as u64 * 10 + 5), &TaskReport::of(step as TaskId - 1));
        let mut want = Vec::new();
        if step > 1 {
            want.push(done(short - 1, Code::Ok));
        }
        want.push(launch(step as TaskId, 0, 0, &[(100, step), (short, 0)]));
        assert_eq!(drain(&mut p), want, "step {step}");
    }
    p.task_done(us(100), &TaskReport::of(4));
    assert_eq!(drain(&mut p), vec![done(100, Code::Ok), done(104, Code::Ok)]);
}

#[test]
fn max_tasks_to_submit_bounds_the_run_ahead_on_one_worker() {
    let mut p = lstm_policy(8, 1, DEFAULT_MAX_TASKS_TO_SUBMIT);
    arrive(&mut p, us(0), 1, chain(8));
    let first: Vec<Decision> = (0..5).map(|t| launch(t, 0, 0, &[(1, t as u32)])).collect();
    assert_eq!(drain(&mut p), first, "successive cells of a pinned chain go out back to back");
    p.task_done(us(1), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![launch(5, 0, 0, &[(1, 5)])]);
}

#[test]
fn per_type_max_batch_and_bsizes_padding() {
    let mut c = cfg(&[("encoder", 4, 0), ("decoder", 2, 1)], 1, 1);
    c.cell_types[0].bsizes = vec![1, 2, 4];
    let mut p = CellularPolicy::new(c).unwrap();
    p.arrive(us(0), Arrival { model: 0, id: 9, deadline: None, priority: 0, cells: Some(seq2seq(1, 1)) });
    assert_eq!(drain(&mut p), vec![padded(0, 0, 0, &[(9, 0)], 1)]);
    for id in 1..=5 {
        arrive(&mut p, us(1), id, seq2seq(1, 1));
    }
    p.task_done(us(2), &TaskReport::of(0));
    // Encoder nodes (5 ready, max 4) fill a whole batch: step 1 picks the encoder even though the
    // decoder has priority, because the decoder has only one node ready.
    assert_eq!(drain(&mut p), vec![padded(1, 0, 0, &[(1, 0), (2, 0), (3, 0), (4, 0)], 4)]);
    p.task_done(us(3), &TaskReport::of(1));
    // Now 4 decoder nodes (max 2) can fill a batch: step 1, by priority.
    assert_eq!(drain(&mut p), vec![padded(2, 0, 1, &[(9, 1), (1, 1)], 2)]);
    p.task_done(us(4), &TaskReport::of(2));
    assert_eq!(
        drain(&mut p),
        vec![done(9, Code::Ok), done(1, Code::Ok), padded(3, 0, 1, &[(2, 1), (3, 1)], 2)]
    );
    p.task_done(us(5), &TaskReport::of(3));
    // 1 encoder (5) vs 1 decoder (4) ready: step 3 tie, decoder by priority.
    assert_eq!(drain(&mut p), vec![done(2, Code::Ok), done(3, Code::Ok), padded(4, 0, 1, &[(4, 1)], 1)]);
    p.task_done(us(6), &TaskReport::of(4));
    // A lone encoder node: padded to the smallest Bsize holding it.
    assert_eq!(drain(&mut p), vec![done(4, Code::Ok), padded(5, 0, 0, &[(5, 0)], 1)]);
}

#[test]
fn decoder_is_preferred_to_encoder_on_a_tie() {
    let mut p = CellularPolicy::new(cfg(&[("encoder", 8, 0), ("decoder", 8, 1)], 1, 1)).unwrap();
    arrive(&mut p, us(0), 1, seq2seq(1, 1));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
    arrive(&mut p, us(1), 2, seq2seq(1, 1));
    p.task_done(us(2), &TaskReport::of(0));
    // One decoder node (request 1) and one encoder node (request 2) ready.
    assert_eq!(drain(&mut p), vec![launch(1, 0, 1, &[(1, 1)])]);
}

#[test]
fn internal_is_preferred_to_leaf_on_a_tie() {
    let mut p = CellularPolicy::new(cfg(&[("leaf", 8, 0), ("internal", 8, 1)], 1, 1)).unwrap();
    // Request 1: root 0 with leaves 1, 2. Leaves of one request share a task.
    arrive(&mut p, us(0), 1, tree(&[-1, 0, 0]));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 1), (1, 2)])]);
    // Request 2: root 1 with leaves 0, 2, 3 listed around it.
    arrive(&mut p, us(1), 2, tree(&[1, -1, 1, 1]));
    arrive(&mut p, us(1), 3, tree(&[-1, 0]));
    p.task_done(us(2), &TaskReport::of(0));
    // Ready: internal 1 (request 1's root); leaves: 3 of request 2, 1 of request 3. Step 3 picks
    // the leaf type (4 ready > 1).
    assert_eq!(drain(&mut p), vec![launch(1, 0, 0, &[(2, 0), (2, 2), (2, 3), (3, 1)])]);
    p.task_done(us(3), &TaskReport::of(1));
    // Ready: three internal roots, no leaves.
    assert_eq!(drain(&mut p), vec![launch(2, 0, 1, &[(1, 0), (2, 1), (3, 0)])]);
    let mut p = CellularPolicy::new(cfg(&[("leaf", 8, 0), ("internal", 8, 1)], 1, 1)).unwrap();
    arrive(&mut p, us(0), 1, tree(&[-1, 0]));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 1)])]);
    arrive(&mut p, us(1), 2, tree(&[-1, 0]));
    p.task_done(us(2), &TaskReport::of(0));
    // One internal and one leaf ready: internal by priority.
    assert_eq!(drain(&mut p), vec![launch(1, 0, 1, &[(1, 0)])]);
}

#[test]
fn tree_internal_levels_run_in_order_on_the_pinned_worker() {
    let mut p = CellularPolicy::new(cfg(&[("leaf", 8, 0), ("internal", 8, 1)], 2, 5)).unwrap();
    // 0 root ← 1 ← 2 (internal chain) with leaves 3 (of 2), 4 (of 2), 5 (of 1), 6 (of 0).
    arrive(&mut p, us(0), 1, tree(&[-1, 0, 1, 2, 2, 1, 0]));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 3), (1, 4), (1, 5), (1, 6)])]);
    p.task_done(us(1), &TaskReport::of(0));
    // All leaves done: the internal subgraph runs level by level on one worker, submitted ahead.
    assert_eq!(
        drain(&mut p),
        vec![launch(1, 0, 1, &[(1, 2)]), launch(2, 0, 1, &[(1, 1)]), launch(3, 0, 1, &[(1, 0)])]
    );
    p.task_done(us(2), &TaskReport::of(1));
    p.task_done(us(3), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![]);
    p.task_done(us(4), &TaskReport::of(3));
    assert_eq!(drain(&mut p), vec![done(1, Code::Ok)]);
}

#[test]
fn pinned_subgraphs_stay_on_their_worker_until_unpinned() {
    let mut p = lstm_policy(8, 2, 2);
    arrive(&mut p, us(0), 1, chain(4));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)]), launch(1, 0, 0, &[(1, 1)])]);
    // Worker 1 is idle, but request 1's next cell is pinned to worker 0.
    arrive(&mut p, us(1), 2, chain(1));
    assert_eq!(drain(&mut p), vec![launch(2, 1, 0, &[(2, 0)])]);
    p.task_done(us(2), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![launch(3, 0, 0, &[(1, 2)])]);
    p.task_done(us(3), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![done(2, Code::Ok)]);
    p.task_done(us(4), &TaskReport::of(1));
    p.task_done(us(5), &TaskReport::of(3));
    // Now the subgraph has nothing outstanding: it is unpinned and the least-loaded worker
    // (worker 0 and 1 both idle: the lower index) takes it.
    assert_eq!(drain(&mut p), vec![launch(4, 0, 0, &[(1, 3)])]);
}

#[test]
fn a_subgraph_with_a_full_task_keeps_its_rest_pinned() {
    let mut p = CellularPolicy::new(cfg(&[("leaf", 2, 0), ("internal", 8, 1)], 2, 1)).unwrap();
    // Four leaves under one root: the first task (max 2) takes two leaves of the same request…
    arrive(&mut p, us(0), 1, tree(&[-1, 0, 0, 0, 0]));
    // …each leaf is its own subgraph, so the remaining leaves are free for worker 1.
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 1), (1, 2)]), launch(1, 1, 0, &[(1, 3), (1, 4)])]);
    p.task_done(us(1), &TaskReport::of(1));
    p.task_done(us(2), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![launch(2, 0, 1, &[(1, 0)])]);
    // A chain whose task is full: the chain's next node stays pinned to worker 0.
    let mut p = lstm_policy(1, 2, 1);
    arrive(&mut p, us(0), 1, chain(2));
    arrive(&mut p, us(0), 2, chain(1));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)]), launch(1, 1, 0, &[(2, 0)])]);
    p.task_done(us(1), &TaskReport::of(1));
    assert_eq!(drain(&mut p), vec![done(2, Code::Ok)], "request 1's next cell waits for worker 0");
}

#[test]
fn cancel_queued_completes_at_once_and_running_at_the_next_boundary() {
    let mut p = lstm_policy(8, 1, 2);
    arrive(&mut p, us(0), 1, chain(5));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)]), launch(1, 0, 0, &[(1, 1)])]);
    arrive(&mut p, us(1), 2, chain(3));
    p.cancel(us(2), 2);
    assert_eq!(drain(&mut p), vec![done(2, Code::Cancelled)]);
    p.cancel(us(3), 1);
    assert_eq!(drain(&mut p), vec![], "request 1 has cells running");
    p.task_done(us(4), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![], "its cell 2 is not submitted: no launch, one task still out");
    p.task_done(us(5), &TaskReport::of(1));
    assert_eq!(drain(&mut p), vec![done(1, Code::Cancelled)]);
    p.cancel(us(6), 1);
    p.cancel(us(6), 77);
    assert_eq!(drain(&mut p), vec![]);
    assert_eq!((p.queued(), p.running()), (0, 0));
}

/// Algorithm 1 runs when the driver polls, over everything the events since the last poll
/// made ready: arrivals handed over together share a task, where scheduling at each event
/// would have launched the first alone.
#[test]
fn events_before_a_poll_are_scheduled_together() {
    let mut p = lstm_policy(8, 1, 5);
    for id in 1..=3 {
        arrive(&mut p, us(0), id, chain(1));
    }
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0), (2, 0), (3, 0)])]);
    // Polled after each arrival, the same requests go out one task each.
    let mut q = lstm_policy(8, 1, 5);
    let mut each = Vec::new();
    for id in 1..=3 {
        arrive(&mut q, us(0), id, chain(1));
        each.extend(drain(&mut q));
    }
    assert_eq!(
        each,
        vec![launch(0, 0, 0, &[(1, 0)]), launch(1, 0, 0, &[(2, 0)]), launch(2, 0, 0, &[(3, 0)])]
    );
}

#[test]
fn deadlines_expire_in_the_queue_and_at_a_cell_boundary() {
    let mut p = lstm_policy(8, 1, 1);
    p.arrive(us(0), Arrival { model: 0, id: 9, deadline: None, priority: 0, cells: Some(chain(1)) });
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(9, 0)])]);
    p.arrive(us(0), Arrival { model: 0, id: 1, deadline: Some(us(50)), priority: 0, cells: Some(chain(4)) });
    p.arrive(us(0), Arrival { model: 0, id: 2, deadline: Some(us(500)), priority: 0, cells: Some(chain(1)) });
    assert_eq!(drain(&mut p), vec![], "MaxTasksToSubmit 1: they wait for task 0");
    p.task_done(us(0), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![done(9, Code::Ok), launch(1, 0, 0, &[(1, 0), (2, 0)])]);
    p.arrive(us(1), Arrival { model: 0, id: 3, deadline: Some(us(20)), priority: 0, cells: Some(chain(1)) });
    assert_eq!(p.next_wakeup(), Some(us(20)));
    p.tick(us(20));
    assert_eq!(drain(&mut p), vec![done(3, Code::DeadlineExceeded)]);
    p.task_done(us(60), &TaskReport::of(1));
    assert_eq!(drain(&mut p), vec![done(1, Code::DeadlineExceeded), done(2, Code::Ok)]);
    assert_eq!(p.next_wakeup(), None);
}

#[test]
fn an_early_end_drops_the_rest_of_the_decoder() {
    // Also with the longest decoder a graph can hold: a decode costs what it runs, not its
    // maximum (`max_decode`).
    for dec in [6, CellGraph::MAX_NODES - 1] {
        let mut p = CellularPolicy::new(cfg(&[("encoder", 8, 0), ("decoder", 8, 1)], 1, 2)).unwrap();
        arrive(&mut p, us(0), 1, seq2seq(1, dec));
        assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
        p.task_done(us(1), &TaskReport::of(0));
        assert_eq!(drain(&mut p), vec![launch(1, 0, 1, &[(1, 1)]), launch(2, 0, 1, &[(1, 2)])]);
        // Decoder step 1 emitted eos.
        p.end_early(us(2), 1);
        p.task_done(us(2), &TaskReport::of(1));
        assert_eq!(drain(&mut p), vec![], "step 2 is still running; step 3 is never launched");
        p.task_done(us(3), &TaskReport::of(2));
        assert_eq!(drain(&mut p), vec![done(1, Code::Ok)]);
    }
}

#[test]
fn request_priority_orders_newcomers() {
    let mut p = lstm_policy(1, 1, 1);
    arrive(&mut p, us(0), 1, chain(1));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
    arrive(&mut p, us(1), 2, chain(1));
    p.arrive(us(1), Arrival { model: 0, id: 3, deadline: None, priority: 7, cells: Some(chain(1)) });
    p.task_done(us(2), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![done(1, Code::Ok), launch(1, 0, 0, &[(3, 0)])]);
}

#[test]
fn bad_configurations_are_refused() {
    assert!(CellularPolicy::new(cfg(&[], 1, 1)).is_err());
    assert!(CellularPolicy::new(cfg(&[("a", 0, 0)], 1, 1)).is_err());
    assert!(CellularPolicy::new(cfg(&[("a", 4, 0)], 0, 1)).is_err());
    assert!(CellularPolicy::new(cfg(&[("a", 4, 0)], 1, 0)).is_err());
    let mut c = cfg(&[("a", 4, 0)], 1, 1);
    c.cell_types[0].bsizes = vec![1, 2];
    assert!(CellularPolicy::new(c.clone()).is_err(), "Bsizes must end at the max batch");
    c.cell_types[0].bsizes = vec![2, 1, 4];
    assert!(CellularPolicy::new(c).is_err(), "Bsizes must ascend");
}

#[test]
fn chains_unpinned_together_go_before_newcomers() {
    // MaxTasksToSubmit 1: every task's chains are unpinned when it finishes, and taken again
    // ahead of requests that queued meanwhile. A chain that leaves the block is replaced by the
    // block's last one.
    let mut p = lstm_policy(8, 1, 1);
    arrive(&mut p, us(0), 1, chain(3));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
    arrive(&mut p, us(0), 2, chain(3));
    arrive(&mut p, us(0), 3, chain(3));
    p.task_done(us(1), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![launch(1, 0, 0, &[(1, 1), (2, 0), (3, 0)])]);
    arrive(&mut p, us(2), 4, chain(1));
    p.task_done(us(3), &TaskReport::of(1));
    assert_eq!(drain(&mut p), vec![launch(2, 0, 0, &[(1, 2), (2, 1), (3, 1), (4, 0)])]);
    p.task_done(us(4), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![done(1, Code::Ok), done(4, Code::Ok), launch(3, 0, 0, &[(3, 2), (2, 2)])]);
    p.task_done(us(5), &TaskReport::of(3));
    assert_eq!(drain(&mut p), vec![done(3, Code::Ok), done(2, Code::Ok)]);
}

#[test]
fn unpinned_chains_of_mixed_priority_are_taken_by_priority() {
    let mut p = lstm_policy(2, 1, 1);
    arrive(&mut p, us(0), 1, chain(3));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)])]);
    arrive(&mut p, us(0), 2, chain(3));
    p.arrive(us(1), Arrival { model: 0, id: 3, deadline: None, priority: 5, cells: Some(chain(2)) });
    p.task_done(us(2), &TaskReport::of(0));
    // Request 1 is unpinned; request 3 outranks it, request 1 outranks request 2 (queued later).
    assert_eq!(drain(&mut p), vec![launch(1, 0, 0, &[(3, 0), (1, 1)])]);
    arrive(&mut p, us(3), 4, chain(1));
    p.task_done(us(4), &TaskReport::of(1));
    // Unpinned now: 3 (priority 5) and 1, ahead of 2 and 4.
    assert_eq!(drain(&mut p), vec![launch(2, 0, 0, &[(3, 1), (1, 2)])]);
    p.task_done(us(5), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![done(3, Code::Ok), done(1, Code::Ok), launch(3, 0, 0, &[(2, 0), (4, 0)])]);
    p.task_done(us(6), &TaskReport::of(3));
    assert_eq!(drain(&mut p), vec![done(4, Code::Ok), launch(4, 0, 0, &[(2, 1)])]);
    p.task_done(us(7), &TaskReport::of(4));
    assert_eq!(drain(&mut p), vec![launch(5, 0, 0, &[(2, 2)])]);
    p.task_done(us(8), &TaskReport::of(5));
    assert_eq!(drain(&mut p), vec![done(2, Code::Ok)]);
    assert_eq!((p.queued(), p.running()), (0, 0));
}

#[test]
fn an_idle_worker_takes_chains_unpinned_on_another() {
    let mut p = lstm_policy(1, 2, 1);
    arrive(&mut p, us(0), 1, chain(1));
    arrive(&mut p, us(0), 2, chain(3));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 0)]), launch(1, 1, 0, &[(2, 0)])]);
    p.task_done(us(1), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![done(1, Code::Ok)], "request 2 is pinned to worker 1");
    p.task_done(us(2), &TaskReport::of(1));
    // Unpinned, request 2 goes to the least-loaded worker: both idle, the lower index.
    assert_eq!(drain(&mut p), vec![launch(2, 0, 0, &[(2, 1)])]);
    arrive(&mut p, us(3), 3, chain(1));
    assert_eq!(drain(&mut p), vec![launch(3, 1, 0, &[(3, 0)])], "request 2 is pinned to worker 0 now");
    p.task_done(us(4), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![launch(4, 0, 0, &[(2, 2)])]);
    p.task_done(us(5), &TaskReport::of(3));
    p.task_done(us(6), &TaskReport::of(4));
    assert_eq!(drain(&mut p), vec![done(3, Code::Ok), done(2, Code::Ok)]);
}

#[test]
fn a_chain_cancelled_while_unpinned_completes_at_once_though_its_worker_is_busy() {
    // One worker, MaxTasksToSubmit 2, max batch 1: request 1's encoder chain is unpinned (its
    // last task finished) while request 2's decoder tasks run.
    let mut p = CellularPolicy::new(cfg(&[("encoder", 1, 0), ("decoder", 1, 1)], 1, 2)).unwrap();
    arrive(&mut p, us(0), 2, seq2seq(1, 2));
    arrive(&mut p, us(0), 1, seq2seq(3, 1));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(2, 0)]), launch(1, 0, 0, &[(1, 0)])]);
    p.task_done(us(1), &TaskReport::of(0));
    // Both types can fill a batch: the decoder, by priority.
    assert_eq!(drain(&mut p), vec![launch(2, 0, 1, &[(2, 1)])]);
    p.task_done(us(2), &TaskReport::of(1));
    assert_eq!(drain(&mut p), vec![launch(3, 0, 1, &[(2, 2)])]);
    p.cancel(us(3), 1);
    assert_eq!(drain(&mut p), vec![done(1, Code::Cancelled)], "nothing of request 1 runs");
    p.task_done(us(4), &TaskReport::of(2));
    p.task_done(us(5), &TaskReport::of(3));
    assert_eq!(drain(&mut p), vec![done(2, Code::Ok)]);
    assert_eq!((p.queued(), p.running()), (0, 0));
}

#[test]
fn tree_inner_subgraphs_queue_in_the_order_they_become_schedulable() {
    // Leaves (max 2) outrank internal nodes (max 1), so leaf tasks go first while leaves fill one.
    let mut p = CellularPolicy::new(cfg(&[("leaf", 2, 2), ("internal", 1, 1)], 1, 1)).unwrap();
    arrive(&mut p, us(0), 1, tree(&[-1, 0, 0]));
    arrive(&mut p, us(0), 2, tree(&[-1, 0, 0]));
    arrive(&mut p, us(0), 3, tree(&[-1, 0, 0, 0, 0, 0, 0]));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 1), (1, 2)])]);
    p.task_done(us(1), &TaskReport::of(0)); // 1's inner subgraph is schedulable
    assert_eq!(drain(&mut p), vec![launch(1, 0, 0, &[(2, 1), (2, 2)])]);
    p.task_done(us(2), &TaskReport::of(1)); // then 2's
    assert_eq!(drain(&mut p), vec![launch(2, 0, 0, &[(3, 1), (3, 2)])]);
    p.task_done(us(3), &TaskReport::of(2));
    assert_eq!(drain(&mut p), vec![launch(3, 0, 0, &[(3, 3), (3, 4)])]);
    p.task_done(us(4), &TaskReport::of(3));
    assert_eq!(drain(&mut p), vec![launch(4, 0, 0, &[(3, 5), (3, 6)])]);
    p.task_done(us(5), &TaskReport::of(4));
    // Three roots ready, room for one: the first to become ready.
    assert_eq!(drain(&mut p), vec![launch(5, 0, 1, &[(1, 0)])]);
}

#[test]
fn an_unpinned_tree_inner_subgraph_goes_before_those_queued_since() {
    let mut p = CellularPolicy::new(cfg(&[("leaf", 2, 2), ("internal", 1, 1)], 2, 1)).unwrap();
    // 1: 0 ← 1 ← {2, 3}: inner levels {1}, {0}.
    arrive(&mut p, us(0), 1, tree(&[-1, 0, 1, 1]));
    arrive(&mut p, us(0), 2, tree(&[-1, 0, 0]));
    assert_eq!(drain(&mut p), vec![launch(0, 0, 0, &[(1, 2), (1, 3)]), launch(1, 1, 0, &[(2, 1), (2, 2)])]);
    p.task_done(us(1), &TaskReport::of(0));
    assert_eq!(drain(&mut p), vec![launch(2, 0, 1, &[(1, 1)])], "1's node 0 is now pinned to worker 0");
    arrive(&mut p, us(2), 3, tree(&[-1, 0, 0, 0, 0, 0, 0]));
    p.task_done(us(3), &TaskReport::of(1)); // 2's root is queued; worker 1 prefers a full leaf task
    assert_eq!(drain(&mut p), vec![launch(3, 1, 0, &[(3, 1), (3, 2)])]);
    p.task_done(us(4), &TaskReport::of(2)); // 1 is unpinned: it was ready before 2's root
    assert_eq!(drain(&mut p), vec![launch(4, 0, 0, &[(3, 3), (3, 4)])]);
    p.task_done(us(5), &TaskReport::of(3));
    assert_eq!(drain(&mut p), vec![launch(5, 1, 0, &[(3, 5), (3, 6)])]);
    p.task_done(us(6), &TaskReport::of(4));
    assert_eq!(drain(&mut p), vec![launch(6, 0, 1, &[(1, 0)])]);
}
