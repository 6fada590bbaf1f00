//! The PyTorch peer's outputs against libserve's on the same requests (`serve bench
//! seq2seq|treelstm`, [`crate::bench_peer`]): seq2seq decodes equal and both mean decode lengths,
//! treelstm roots' h within [`H_TOLERANCE`].

use serde_json::{Value, json};

use serve::Output;

use crate::bench_peer::PeerPlan;
use crate::bench_rnn::RnnKind;

/// Largest |libserve − torch| of a treelstm root's h for the same function.
pub(crate) const H_TOLERANCE: f64 = 1e-4;

/// The peer's outputs against libserve's on the same requests.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum OutputCheck {
    /// seq2seq decodes.
    Tokens(TokenCheck),
    /// treelstm: the largest |libserve − torch| of any root's h entry over `requests`, and how
    /// many requests are above [`H_TOLERANCE`].
    H { requests: usize, max_abs_diff: f64, over_tolerance: usize },
}

/// seq2seq: `differ` of `requests` decodes are not identical (`length_differ` of them in length;
/// the first is `first_differ`), and both mean decode lengths.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TokenCheck {
    pub(crate) requests: usize,
    pub(crate) differ: usize,
    pub(crate) length_differ: usize,
    pub(crate) first_differ: Option<usize>,
    pub(crate) libserve_mean: f64,
    pub(crate) torch_mean: f64,
}

/// The peer's outputs (`text`, its `--outputs` file) against libserve's on the same requests.
pub(crate) fn check_outputs(plan: &PeerPlan<'_>, text: &str) -> Result<OutputCheck, String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("malformed JSON: {e}"))?;
    let n = peer_outputs(plan.kind, &v)?.1.len();
    if n > plan.inputs.len() {
        return Err(format!("{n} outputs for {} distinct requests", plan.inputs.len()));
    }
    let ours = (plan.outputs)(n).map_err(|e| format!("libserve's outputs for the check: {e}"))?;
    compare_outputs(plan.kind, &v, &ours)
}

/// The larger of `a` and `b`, NaN if either is (`f64::max` would drop it, and a NaN output would
/// pass for a match).
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

/// The peer's output list in `v` and its key: `tokens` (seq2seq) or `h` (treelstm).
fn peer_outputs(kind: RnnKind, v: &Value) -> Result<(&'static str, &Vec<Value>), String> {
    let key = if kind == RnnKind::Seq2Seq { "tokens" } else { "h" };
    Ok((key, v.get(key).and_then(Value::as_array).ok_or_else(|| format!("no `{key}` list"))?))
}

/// Compare the peer's outputs `v` (`{"tokens": [[…], …]}` or `{"h": [[…], …]}`) with libserve's
/// `ours`, request by request.
pub(crate) fn compare_outputs(kind: RnnKind, v: &Value, ours: &[Output]) -> Result<OutputCheck, String> {
    let (key, theirs) = peer_outputs(kind, v)?;
    if theirs.len() != ours.len() {
        return Err(format!("{} outputs from the peer, {} from libserve", theirs.len(), ours.len()));
    }
    let row = |i: usize, x: &Value| -> Result<Vec<f64>, String> {
        let xs = x.as_array().ok_or_else(|| format!("{key}[{i}] is not a list"))?;
        xs.iter()
            .enumerate()
            .map(|(j, y)| y.as_f64().ok_or_else(|| format!("{key}[{i}][{j}] is not a number: {y}")))
            .collect()
    };
    let requests = ours.len();
    match kind {
        RnnKind::Seq2Seq => {
            let (mut differ, mut length_differ, mut first_differ) = (0, 0, None);
            let (mut our_len, mut their_len) = (0usize, 0usize);
            for (i, (t, o)) in theirs.iter().zip(ours).enumerate() {
                let Output::Tokens(o) = o else { return Err(format!("libserve's output {i} is not tokens")) };
                let t = row(i, t)?;
                if let Some((j, y)) = t.iter().enumerate().find(|(_, y)| y.fract() != 0.0 || **y < 0.0) {
                    return Err(format!("tokens[{i}][{j}] is not a token: {y}"));
                }
                (our_len, their_len) = (our_len + o.len(), their_len + t.len());
                if t.len() != o.len() || t.iter().zip(o).any(|(&a, &b)| a != f64::from(b)) {
                    differ += 1;
                    length_differ += usize::from(t.len() != o.len());
                    first_differ.get_or_insert(i);
                }
            }
            let mean = |total: usize| if requests == 0 { 0.0 } else { total as f64 / requests as f64 };
            Ok(OutputCheck::Tokens(TokenCheck {
                requests,
                differ,
                length_differ,
                first_differ,
                libserve_mean: mean(our_len),
                torch_mean: mean(their_len),
            }))
        }
        RnnKind::TreeLstm | RnnKind::Lstm => {
            let (mut max_abs_diff, mut over_tolerance) = (0.0f64, 0);
            for (i, (t, o)) in theirs.iter().zip(ours).enumerate() {
                let Output::F32(o) = o else { return Err(format!("libserve's output {i} is not floats")) };
                let t = row(i, t)?;
                if t.len() != o.len() {
                    return Err(format!("{key}[{i}] has {} values, libserve's output {}", t.len(), o.len()));
                }
                let d = t.iter().zip(o).map(|(&a, &b)| (a - f64::from(b)).abs()).fold(0.0, nan_max);
                // NaN anywhere counts as over the tolerance.
                if d.is_nan() || d > H_TOLERANCE {
                    over_tolerance += 1;
                }
                max_abs_diff = nan_max(max_abs_diff, d);
            }
            Ok(OutputCheck::H { requests, max_abs_diff, over_tolerance })
        }
    }
}

impl OutputCheck {
    /// Its one line (after `# PyTorch peer check: `).
    pub(crate) fn line(&self) -> String {
        match *self {
            OutputCheck::Tokens(ref t) => {
                let first = t.first_differ.map_or_else(String::new, |i| format!("; first: request {i}"));
                format!(
                    "seq2seq decodes of the first {} distinct requests: {} identical to libserve's, {} differ ({} in \
                     length{first}); mean decode length libserve {:.2}, torch {:.2} tokens",
                    t.requests,
                    t.requests - t.differ,
                    t.differ,
                    t.length_differ,
                    t.libserve_mean,
                    t.torch_mean
                )
            }
            OutputCheck::H { requests, max_abs_diff, over_tolerance } => format!(
                "treelstm roots' h of the first {requests} distinct requests: max |libserve - torch| {max_abs_diff:.2e} \
                 (tolerance {H_TOLERANCE:.0e}: {}, {over_tolerance} request(s) above)",
                if over_tolerance == 0 { "met" } else { "NOT met: not the same function" }
            ),
        }
    }

    pub(crate) fn to_json(&self) -> Value {
        match *self {
            OutputCheck::Tokens(ref t) => {
                json!({"requests": t.requests, "identical": t.requests - t.differ, "differ": t.differ,
                       "length_differ": t.length_differ, "first_differ": t.first_differ,
                       "libserve_mean_decode_tokens": t.libserve_mean, "torch_mean_decode_tokens": t.torch_mean})
            }
            OutputCheck::H { requests, max_abs_diff, over_tolerance } => {
                json!({"requests": requests, "max_abs_diff": max_abs_diff, "tolerance": H_TOLERANCE,
                       "over_tolerance": over_tolerance, "met": over_tolerance == 0})
            }
        }
    }
}
