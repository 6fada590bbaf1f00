//! Offline planners: decisions taken once per model and machine, before serving, from a
//! profile. Like the schedulers in [`crate::sched`] they do no I/O of their own: a planner is a
//! function from a profile (and a topology) to a plan, so the same plan drives the executor, the
//! simulator and the tests.
//!
//! * [`deepplan`] — DeepPlan (EuroSys'23): per layer, load-then-execute or direct host access,
//!   and parallel transmission over GPUs under distinct PCIe switches.

pub mod deepplan;
