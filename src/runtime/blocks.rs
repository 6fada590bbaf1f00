//! The threaded engine's side of layer blocks (the tenant mode, ARCHITECTURE.md §7.9): a block's
//! input built from its requests (each row's values entering its first layer: the request's
//! input for its first block, what its previous block left otherwise), and a finished block's
//! rows turned into their next block's input or, after the model's last layer, their result.
//! A one-row block's values move from task to request to task, never copied.

use std::sync::Arc;

use super::core::{EngineCore, RowEnd};
use super::engine::{Pending, short_output};
use super::recycle::Recycler;
use crate::backend::{TaskData, Work};
use crate::error::{Code, Error, Result};
use crate::model::{Network, Output};
use crate::sched::{RequestId, TaskId};

/// The work of block `[first, end)` of `net` (whose layer bounds are `bounds`) over `requests`,
/// padded to `batch` rows (padding rows are zeros). A request no longer held (it cannot be: its
/// task holds it) leaves its row zeroed rather than shift the rows after it.
pub(crate) fn block_work(
    core: &mut EngineCore<Box<Pending>, Option<Arc<TaskData>>>,
    (net, bounds): (&Network, &[usize]),
    requests: &[RequestId],
    (first, end): (usize, usize),
    batch: usize,
) -> Result<Work> {
    let Some(&in_len) = bounds.get(first).filter(|_| first < end && end < bounds.len()) else {
        return Err(Error::internal(format!(
            "layers {first}..{end} of a model of {} layers",
            bounds.len().saturating_sub(1)
        )));
    };
    // The values a request carries into layer `first > 0`, checked.
    let carried = |id: RequestId, act: &mut Vec<f32>| {
        if act.len() == in_len {
            Ok(std::mem::take(act))
        } else {
            Err(Error::internal(format!(
                "request {id} carries {} values into layer {first}, which takes {in_len}",
                act.len()
            )))
        }
    };
    let mut input = match requests {
        [id] if first > 0 => match core.request_mut(*id) {
            Some(r) => carried(*id, &mut r.data.run.activation)?,
            None => Vec::new(),
        },
        _ => {
            let mut input = vec![0.0; batch * in_len];
            for (row, id) in input.chunks_exact_mut(in_len).zip(requests) {
                let Some(r) = core.request_mut(*id) else { continue };
                if first == 0 {
                    net.dense_row(&r.data.input, row);
                } else {
                    row.copy_from_slice(&carried(*id, &mut r.data.run.activation)?);
                }
            }
            input
        }
    };
    input.resize(batch * in_len, 0.0);
    Ok(Work::Layers { first, last: end, input })
}

/// What finished block `task` (rows `rows`, ending before layer `last` of a model of
/// `bounds.len() − 1` layers) means for row `row`'s request: its values go on to its next block
/// (a one-row block's `output` moves there whole), or are its result after the last layer; a
/// failed block ends the row, its error the result.
#[allow(clippy::too_many_arguments)]
pub(crate) fn block_row_done(
    p: &mut Pending,
    row: usize,
    (task, rows, last): (TaskId, usize, usize),
    bounds: &[usize],
    error: Option<&Error>,
    output: &mut Option<Vec<f32>>,
    recycle: &Recycler,
) -> RowEnd {
    let out_len = bounds.get(last).copied().unwrap_or(0);
    let values = output.as_deref().and_then(|o| o.get(row * out_len..(row + 1) * out_len));
    let run = &mut p.run;
    match (error, values) {
        (Some(e), _) => run.result = Some(Err(Error::new(Code::Backend, e.message()))),
        (None, None) => {
            let len = output.as_ref().map_or(0, Vec::len);
            run.result = Some(Err(short_output(task, len, rows, out_len)));
        }
        (None, Some(v)) if last + 1 == bounds.len() => {
            run.result = Some(Ok(Output::F32(recycle.output(v))));
            return RowEnd::Continue;
        }
        (None, Some(_)) if rows == 1 => {
            run.activation = output.take().unwrap_or_default();
            return RowEnd::Continue;
        }
        (None, Some(v)) => {
            run.activation.clear();
            run.activation.extend_from_slice(v);
            return RowEnd::Continue;
        }
    }
    RowEnd::Early
}
