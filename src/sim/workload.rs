//! The standard workloads (`crate::workload`) as simulated requests: each request unfolded by
//! the same [`Network::unfold`] the runtime uses, so a simulated request has exactly the cells a
//! real one has.

use crate::error::Result;
use crate::model::{Input, NO_TOKEN, Network};
use crate::sim::SimRequest;
use crate::workload::{treebank_trees, wmt_lengths};

/// Request lengths of the recurrent workloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lengths {
    /// WMT-like (log-normal, mean 24; `crate::workload::wmt_lengths`).
    Wmt,
    /// Every request this long.
    Fixed(usize),
}

/// `n` requests for `net` with `seed`.
///
/// * lstm: token sequences of the given lengths;
/// * seq2seq: sources of the given lengths, each decoding as many tokens as its source (clipped
///   to `max_decode`): translation keeps length, and the simulator's decode ends where a real
///   one would emit `eos`;
/// * treelstm: TreeBank-like trees (`lengths` does not apply);
/// * mlp: fixed-shape requests.
pub fn requests(net: &Network, lengths: Lengths, n: usize, seed: u64) -> Result<Vec<SimRequest>> {
    let lens = || match lengths {
        Lengths::Wmt => wmt_lengths(n, seed),
        Lengths::Fixed(l) => vec![l; n],
    };
    let mut out = Vec::with_capacity(n);
    match net {
        Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => {
            out.resize(n, SimRequest { graph: None, ends_at: None })
        }
        Network::Lstm(_) => {
            for len in lens() {
                let graph = net.unfold(&Input::Tokens(vec![0; len]))?;
                out.push(SimRequest { graph, ends_at: None });
            }
        }
        Network::Seq2Seq(m) => {
            for len in lens() {
                let graph =
                    net.unfold(&Input::Tokens(vec![m.cfg.eos.wrapping_add(1) % m.cfg.vocab as u32; len]))?;
                let decode = len.clamp(1, m.cfg.max_decode);
                let ends_at = (decode < m.cfg.max_decode).then(|| (len + decode - 1) as u32);
                out.push(SimRequest { graph, ends_at });
            }
        }
        Network::TreeLstm(_) => {
            for parents in treebank_trees(n, seed) {
                // Leaves carry a token, internal nodes none.
                let mut tokens = vec![0; parents.len()];
                for &p in &parents {
                    if let Some(t) = usize::try_from(p).ok().and_then(|p| tokens.get_mut(p)) {
                        *t = NO_TOKEN;
                    }
                }
                let graph = net.unfold(&Input::Tree { tokens, parents })?;
                out.push(SimRequest { graph, ends_at: None });
            }
        }
    }
    Ok(out)
}
