//! The configuration of a [`CellularPolicy`](super::CellularPolicy): per cell type its
//! `MaxBatch`, priority and `Bsizes`, the workers and `MaxTasksToSubmit` (BatchMaker §4.3).

use crate::error::{Error, Result};
use crate::sched::graph::MAX_CELL_TYPES;

/// One cell type's batching parameters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellTypeConfig {
    /// A name for messages ("encoder", "leaf", …).
    pub name: String,
    /// The most nodes one task of this type holds (`MaxBatch`).
    pub max_batch: usize,
    /// Larger is chosen first when ChooseCellType has a tie (decoder over encoder, internal over
    /// leaf).
    pub priority: i32,
    /// Batch sizes a task may have (`Bsizes`), ascending, ending at `max_batch`; a task is padded
    /// to the smallest that holds its nodes. Empty = every size from 1 to `max_batch`.
    pub bsizes: Vec<usize>,
}

impl CellTypeConfig {
    pub fn new(name: &str, max_batch: usize, priority: i32) -> CellTypeConfig {
        CellTypeConfig { name: name.to_string(), max_batch, priority, bsizes: Vec::new() }
    }
}

/// BatchMaker's default `MaxTasksToSubmit`.
pub const DEFAULT_MAX_TASKS_TO_SUBMIT: usize = 5;

/// Configuration of a [`CellularPolicy`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellularConfig {
    /// Indexed by [`CellType`].
    pub cell_types: Vec<CellTypeConfig>,
    pub workers: usize,
    /// Tasks a worker may have submitted and unfinished (`MaxTasksToSubmit`, ≥ 1).
    pub max_tasks_to_submit: usize,
}

impl CellularConfig {
    pub fn check(&self) -> Result<()> {
        if self.cell_types.is_empty() || self.cell_types.len() > MAX_CELL_TYPES {
            return Err(Error::invalid(format!(
                "a cellular policy needs 1..={MAX_CELL_TYPES} cell types, got {}",
                self.cell_types.len()
            )));
        }
        if self.workers == 0 {
            return Err(Error::invalid("a cellular policy needs at least one worker"));
        }
        if self.max_tasks_to_submit == 0 {
            return Err(Error::invalid("MaxTasksToSubmit must be at least 1"));
        }
        for t in &self.cell_types {
            if t.max_batch == 0 {
                return Err(Error::invalid(format!("cell type `{}`: max batch must be at least 1", t.name)));
            }
            if !t.bsizes.is_empty()
                && (t.bsizes.windows(2).any(|w| w[0] >= w[1])
                    || t.bsizes[0] == 0
                    || *t.bsizes.last().unwrap() != t.max_batch)
            {
                return Err(Error::invalid(format!(
                    "cell type `{}`: Bsizes {:?} must ascend strictly from ≥ 1 to the max batch {}",
                    t.name, t.bsizes, t.max_batch
                )));
            }
        }
        Ok(())
    }
}
