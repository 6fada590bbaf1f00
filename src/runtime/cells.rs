//! The threaded engine's side of cellular execution: how many state slots a request needs (the
//! core hands them out), cell tasks built from a policy's launch (node → state slots, token,
//! children), and a finished task's rows turned back into request results (final `h`, decoded
//! tokens, `eos`).

use super::recycle::Recycler;
use crate::backend::{CellRow, CellTask};
use crate::error::{Error, Result};
use crate::model::{DECODER, Input, NO_TOKEN, Network, Output};
use crate::sched::CellGraph;

/// A Seq2Seq request's decoding progress (the driver's side: the tokens the backend returned).
#[derive(Default)]
pub(crate) struct Decoding {
    /// Tokens decoded so far.
    pub decoded: Vec<u32>,
    /// The output is complete (`eos` or `max_decode`); later decoder rows are ignored.
    pub ended: bool,
}

/// State slots needed by a request of `net` with this graph.
pub(crate) fn slots_needed(net: &Network, graph: &CellGraph) -> usize {
    match net {
        Network::TreeLstm(_) => graph.len(),
        _ => 1,
    }
}

/// Add the row of `node` of a request to `task`.
pub(crate) fn push_row(
    net: &Network,
    input: &Input,
    graph: &CellGraph,
    slots: &[u32],
    node: u32,
    task: &mut CellTask,
) {
    let v = node as usize;
    let row = match (net, input) {
        (Network::Lstm(_), Input::Tokens(t)) => CellRow {
            steps: 1,
            slot: slots[0],
            token: t[v],
            first: v == 0,
            children: 0..0,
            output: v + 1 == t.len(),
        },
        (Network::Seq2Seq(_), Input::Tokens(t)) if v < t.len() => {
            CellRow { steps: 1, slot: slots[0], token: t[v], first: v == 0, children: 0..0, output: false }
        }
        (Network::Seq2Seq(_), Input::Tokens(t)) => CellRow {
            steps: 1,
            slot: slots[0],
            token: NO_TOKEN,
            first: v == t.len(),
            children: 0..0,
            output: false,
        },
        (Network::TreeLstm(_), Input::Tree { tokens, parents }) => {
            let start = task.children.len() as u32;
            task.children.extend(graph.preds(v).iter().map(|c| slots[c as usize]));
            CellRow {
                steps: 1,
                slot: slots[v],
                token: tokens[v],
                first: false,
                children: start..task.children.len() as u32,
                output: parents[v] == -1,
            }
        }
        _ => unreachable!("inputs are validated against their model at submit"),
    };
    task.rows.push(row);
}

/// Add the row of `node` of a request to a task of `task.steps()` steps (a padded batch run in one
/// call): the node and the nodes after it on its run, as many as the task has steps or the run
/// has nodes, with its token at every step ([`NO_TOKEN`] once it is padding). Only `lstm`
/// sequences run so (the padding policy fuses batches of single-run paths); anything else is an
/// INTERNAL error for the task.
pub(crate) fn push_path_row(
    net: &Network,
    input: &Input,
    slots: &[u32],
    node: u32,
    task: &mut CellTask,
) -> Result<()> {
    let (Network::Lstm(_), Input::Tokens(t)) = (net, input) else {
        return Err(Error::internal(format!("a {} request in a task of {} steps", net.kind(), task.steps())));
    };
    let (v, steps) = (node as usize, task.steps() as usize);
    let real = t.len().checked_sub(v).filter(|&n| n > 0).map(|n| n.min(steps));
    let real = real.ok_or_else(|| Error::internal(format!("node {node} of a sequence of {}", t.len())))?;
    task.rows.push(CellRow {
        slot: slots[0],
        token: t[v],
        first: v == 0,
        children: 0..0,
        output: v + real == t.len(),
        steps: real as u32,
    });
    task.tokens.extend((0..steps).map(|s| if s < real { t[v + s] } else { NO_TOKEN }));
    Ok(())
}

/// What a finished row means for its request.
pub(crate) enum RowOutcome {
    /// Nothing to deliver yet.
    Continue,
    /// The request's result is ready; `early` when it ended before its last cell (the policy is
    /// told, so the rest of its cells are dropped).
    Result { output: Output, early: bool },
}

/// A finished cell task's results, read row by row.
pub(crate) struct Finished<'a> {
    pub task: &'a CellTask,
    /// Decoder tasks: the token of each real row.
    pub tokens: &'a [u32],
    /// The `output` rows' values, `hidden` each, consumed in row order.
    pub outputs: std::slice::ChunksExact<'a, f32>,
    /// Where a result's buffer comes from (the model's kept outputs).
    pub recycle: &'a Recycler,
}

impl Finished<'_> {
    /// Interpret row `i` (node `node`) for its request.
    pub fn row_outcome(
        &mut self,
        net: &Network,
        input: &Input,
        rc: &mut Decoding,
        i: usize,
        node: u32,
    ) -> Result<RowOutcome> {
        let row = &self.task.rows[i];
        if row.output {
            let h = self
                .outputs
                .next()
                .ok_or_else(|| Error::internal("a cell task returned fewer outputs than rows"))?;
            return Ok(RowOutcome::Result { output: Output::F32(self.recycle.output(h)), early: false });
        }
        match (net, input) {
            (Network::Seq2Seq(m), Input::Tokens(src)) if self.task.cell == DECODER => {
                if rc.ended {
                    return Ok(RowOutcome::Continue); // decoded past eos by a task submitted ahead
                }
                let t = *self
                    .tokens
                    .get(i)
                    .ok_or_else(|| Error::internal("a decoder task returned too few tokens"))?;
                rc.decoded.push(t);
                let last = node as usize + 1 == src.len() + m.cfg.max_decode;
                if t == m.cfg.eos || last {
                    rc.ended = true;
                    return Ok(RowOutcome::Result {
                        output: Output::Tokens(std::mem::take(&mut rc.decoded)),
                        early: !last,
                    });
                }
                Ok(RowOutcome::Continue)
            }
            _ => Ok(RowOutcome::Continue),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Code;
    use crate::model::{Lstm, Seq2Seq};

    /// A row of a multi-step task: its steps within the task (as many as its sequence has left),
    /// its token at each step (none once it is padding), and its output when its last node is in
    /// the task; anything but an lstm request is refused.
    #[test]
    fn path_rows_carry_their_steps_and_tokens() {
        let net = Network::Lstm(Lstm::random(20, 3, 4, 1, 1));
        let input = Input::Tokens(vec![5, 6, 7, 8, 9]);
        let mut task = CellTask { steps: 4, ..CellTask::default() };
        push_path_row(&net, &input, &[7], 2, &mut task).unwrap();
        push_path_row(&net, &input, &[3], 0, &mut task).unwrap();
        let (a, b) = (&task.rows[0], &task.rows[1]);
        assert_eq!((a.slot, a.steps, a.first, a.output), (7, 3, false, true));
        assert_eq!((b.slot, b.steps, b.first, b.output), (3, 4, true, false));
        assert_eq!(task.tokens, [7, 8, 9, NO_TOKEN, 5, 6, 7, 8]);
        let e = push_path_row(&net, &input, &[3], 5, &mut task).unwrap_err();
        assert_eq!(e.code(), Code::Internal, "{e}");
        let s2s = Network::Seq2Seq(Seq2Seq::random(20, 3, 4, 1, 1, 2, 5, 1));
        let e = push_path_row(&s2s, &input, &[3], 0, &mut task).unwrap_err();
        assert!(e.code() == Code::Internal && e.message().contains("seq2seq"), "{e}");
        assert_eq!(task.rows.len(), 2, "a refused row is not added");
    }
}
