//! A CPU "stream": an ordered work queue executed by one thread, with a completion counter.
//!
//! Jobs run in submission order with exclusive access to the stream's state `S` (its reusable
//! activation buffers). After each job the thread increments the counter with a release store and
//! calls the notify hook; readers only do acquire loads (same protocol as the CUDA signal kernel).

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::backend::{CompletionSignal, Notify, TaskData, TaskIo};
use crate::error::{Error, Result};

/// The counter, alone on its cache line so that polling it does not disturb neighbours.
#[repr(align(64))]
#[derive(Debug, Default)]
pub struct CpuSignal(AtomicU64);

impl CpuSignal {
    fn advance(&self) {
        // Single writer (the stream thread): a release increment publishes the job's writes.
        self.0.fetch_add(1, Ordering::Release);
    }
}

impl CompletionSignal for CpuSignal {
    fn completed(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// The stream thread calls its notify after every advance ([`CpuStream::new`]).
    fn notifies(&self) -> bool {
        true
    }
}

/// A job run on the stream with its state. A panic inside is caught and reported through
/// `on_panic`; the counter still advances.
pub struct Job<S> {
    pub run: Box<dyn FnOnce(&mut S) + Send>,
    pub on_panic: Box<dyn FnOnce(Error) + Send>,
}

/// The threads a task runs on: its own bound (`TaskData::cores`), within the runner's `threads`.
pub(crate) fn task_threads(task: &TaskData, threads: usize) -> usize {
    if task.cores == 0 { threads } else { task.cores.min(threads) }
}

/// Enqueue a batched task on `stream`: refuse a row count outside `1..=max_batch`, then run
/// `run(scratch, io, rows)` on the stream with the task's I/O locked, timing it
/// (`TaskIo::stages.compute`); a panic in it becomes the task's error. Returns the counter value that marks the task done.
pub(crate) fn launch_task<S: Send + 'static>(
    stream: &std::sync::Mutex<CpuStream<S>>,
    max_batch: usize,
    task: Arc<TaskData>,
    run: impl FnOnce(&mut S, &mut TaskIo, usize) + Send + 'static,
) -> Result<u64> {
    if task.rows == 0 || task.rows > max_batch {
        return Err(Error::internal(format!(
            "task of {} rows on a runner prepared for at most {max_batch}",
            task.rows
        )));
    }
    let t2 = task.clone();
    let job = Job {
        run: Box::new(move |scratch: &mut S| {
            let mut io = task.io.lock().expect("task io lock");
            let start = std::time::Instant::now();
            run(scratch, &mut io, task.rows);
            io.stages.compute = Some(start.elapsed());
        }),
        on_panic: Box::new(move |e| t2.io.lock().unwrap_or_else(|p| p.into_inner()).error = Some(e)),
    };
    stream.lock().expect("stream lock").enqueue(job)
}

/// An ordered work queue on its own thread. Dropping it finishes queued jobs, then joins.
pub struct CpuStream<S: Send + 'static> {
    tx: Option<mpsc::Sender<Job<S>>>,
    signal: Arc<CpuSignal>,
    enqueued: u64,
    thread: Option<JoinHandle<()>>,
}

impl<S: Send + 'static> CpuStream<S> {
    pub fn new(name: String, mut state: S, notify: Notify) -> Result<CpuStream<S>> {
        let (tx, rx) = mpsc::channel::<Job<S>>();
        let signal = Arc::new(CpuSignal::default());
        let sig = signal.clone();
        let thread = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                for job in rx {
                    let Job { run, on_panic } = job;
                    if let Err(p) = catch_unwind(AssertUnwindSafe(|| run(&mut state))) {
                        on_panic(Error::internal(format!("task panicked: {}", panic_message(&*p))));
                    }
                    sig.advance();
                    // After the count: the engine, woken, reads it (runtime/watch.rs; the
                    // ordering is the bell's, runtime/inbox.rs `StreamBell`).
                    notify();
                }
            })
            .map_err(|e| Error::internal(format!("cannot spawn stream thread: {e}")))?;
        Ok(CpuStream { tx: Some(tx), signal, enqueued: 0, thread: Some(thread) })
    }

    pub fn signal(&self) -> Arc<CpuSignal> {
        self.signal.clone()
    }

    /// Enqueue a job; returns the counter value that means "this job is done".
    pub fn enqueue(&mut self, job: Job<S>) -> Result<u64> {
        let tx = self.tx.as_ref().expect("stream is open until dropped");
        tx.send(job).map_err(|_| Error::internal("stream thread has exited"))?;
        self.enqueued += 1;
        Ok(self.enqueued)
    }
}

impl<S: Send + 'static> Drop for CpuStream<S> {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The text of a caught panic payload.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn jobs_run_in_order_and_count() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut s = CpuStream::new("t".into(), 0u32, Arc::new(|| {})).unwrap();
        let mut last = 0;
        for i in 0..100u32 {
            let log = log.clone();
            last = s
                .enqueue(Job {
                    run: Box::new(move |n: &mut u32| {
                        *n += 1;
                        log.lock().unwrap().push((i, *n));
                    }),
                    on_panic: Box::new(|_| {}),
                })
                .unwrap();
        }
        assert_eq!(last, 100);
        let sig = s.signal();
        drop(s); // drains and joins
        assert_eq!(sig.completed(), 100);
        let log = log.lock().unwrap();
        assert!(log.iter().enumerate().all(|(k, &(i, n))| i as usize == k && n as usize == k + 1));
    }

    #[test]
    fn a_task_s_compute_is_timed_and_its_thread_bound_kept_within_the_runner_s() {
        let stream = Mutex::new(CpuStream::new("t".into(), (), Arc::new(|| {})).unwrap());
        let task = TaskData::with_cores(2, 3, crate::backend::Work::Dense(vec![0.0; 2]));
        assert_eq!((task_threads(&task, 8), task_threads(&task, 2)), (3, 2));
        assert_eq!(task_threads(&TaskData::new(1, crate::backend::Work::Dense(vec![])), 4), 4);
        launch_task(&stream, 4, task.clone(), |_, _, _| {
            std::thread::sleep(std::time::Duration::from_millis(2))
        })
        .unwrap();
        drop(stream); // drains and joins
        let stages = task.io.lock().unwrap().stages;
        assert!(stages.compute.is_some_and(|c| c >= std::time::Duration::from_millis(2)), "{stages:?}");
        assert_eq!((stages.upload, stages.download), (None, None), "no transfers on the CPU");
    }

    #[test]
    fn panicking_job_is_reported_and_still_counted() {
        let err = Arc::new(Mutex::new(None));
        let e2 = err.clone();
        let mut s = CpuStream::new("t".into(), (), Arc::new(|| {})).unwrap();
        s.enqueue(Job {
            run: Box::new(|_: &mut ()| panic!("boom")),
            on_panic: Box::new(move |e| *e2.lock().unwrap() = Some(e)),
        })
        .unwrap();
        let sig = s.signal();
        drop(s);
        assert_eq!(sig.completed(), 1);
        let e = err.lock().unwrap().clone().unwrap();
        assert!(e.message().contains("boom"));
    }
}
