//! `treelstm`: Child-Sum TreeLSTM (Tai et al. 2015). Per node: h̃ = Σ h_k over its children;
//! [i, o, u] = W_iou x + b_iou + U_iou h̃ (σ, σ, tanh); f_k = σ(W_f x + b_f + U_f h_k);
//! c = i⊙u + Σ f_k⊙c_k; h = o⊙tanh(c). The output is the root's h. Token [`NO_TOKEN`] means the
//! node has no input (x = 0). Leaves and internal nodes are two cell types.

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::config_error;
use crate::model::limits::{MAX_NODES, MAX_VOCAB, MAX_WIDTH, check_size};
use crate::model::lstm::random_embedding;
use crate::model::weights::{Tensor, Weights};

/// A tree node's token meaning "no input" (x = 0).
pub const NO_TOKEN: u32 = u32::MAX;
/// Most nodes accepted per tree when model.toml sets no `max_nodes`.
pub const DEFAULT_MAX_NODES: usize = 1024;

/// Keys of model.toml for `kind = "treelstm"`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TreeLstmConfig {
    pub name: Option<String>,
    pub vocab: usize,
    pub embed: usize,
    pub hidden: usize,
    /// Most nodes per tree; default [`DEFAULT_MAX_NODES`].
    pub max_nodes: Option<usize>,
}

impl TreeLstmConfig {
    /// Every key within its [`limits`](crate::model::limits) (FORMAT naming the key); the tensor
    /// sizes they imply then cannot overflow.
    pub fn check(&self, toml_path: &Path) -> Result<()> {
        check_size(toml_path, "vocab", self.vocab, MAX_VOCAB)?;
        check_size(toml_path, "embed", self.embed, MAX_WIDTH)?;
        check_size(toml_path, "hidden", self.hidden, MAX_WIDTH)?;
        if let Some(m) = self.max_nodes {
            check_size(toml_path, "max_nodes", m, MAX_NODES)?;
        }
        Ok(())
    }
}

/// A loaded `treelstm` model (PyTorch layouts).
#[derive(Clone, Debug, PartialEq)]
pub struct TreeLstm {
    pub cfg: TreeLstmConfig,
    pub embedding: Vec<f32>,
    /// `[3H, E]`, `[3H]`, `[3H, H]`.
    pub w_iou: Vec<f32>,
    pub b_iou: Vec<f32>,
    pub u_iou: Vec<f32>,
    /// `[H, E]`, `[H]`, `[H, H]`.
    pub w_f: Vec<f32>,
    pub b_f: Vec<f32>,
    pub u_f: Vec<f32>,
}

pub use crate::sched::graph::{Tree, validate_tree};

impl TreeLstm {
    /// Build from `cfg`, already checked ([`TreeLstmConfig::check`], which `model::load` runs before it
    /// reads the weights), and its tensors.
    pub(crate) fn from_weights(cfg: TreeLstmConfig, mut w: Weights) -> Result<TreeLstm> {
        let (v, e, h) = (cfg.vocab, cfg.embed, cfg.hidden);
        let embedding = w.take("embedding.weight", &[v, e])?.data;
        let w_iou = w.take("tree.W_iou.weight", &[3 * h, e])?.data;
        let b_iou = w.take("tree.W_iou.bias", &[3 * h])?.data;
        let u_iou = w.take("tree.U_iou.weight", &[3 * h, h])?.data;
        let w_f = w.take("tree.W_f.weight", &[h, e])?.data;
        let b_f = w.take("tree.W_f.bias", &[h])?.data;
        let u_f = w.take("tree.U_f.weight", &[h, h])?.data;
        w.finish()?;
        Ok(TreeLstm { cfg, embedding, w_iou, b_iou, u_iou, w_f, b_f, u_f })
    }

    /// A model with seeded random weights.
    pub fn random(vocab: usize, embed: usize, hidden: usize, seed: u64) -> TreeLstm {
        let mut rng = StdRng::seed_from_u64(seed);
        let embedding = random_embedding(&mut rng, vocab, embed);
        let k = 1.0 / (hidden as f32).sqrt();
        let mut u = |n: usize| (0..n).map(|_| rng.random_range(-k..k)).collect::<Vec<f32>>();
        let (e, h) = (embed, hidden);
        TreeLstm {
            cfg: TreeLstmConfig { name: None, vocab, embed, hidden, max_nodes: None },
            embedding,
            w_iou: u(3 * h * e),
            b_iou: u(3 * h),
            u_iou: u(3 * h * h),
            w_f: u(h * e),
            b_f: u(h),
            u_f: u(h * h),
        }
    }

    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let (v, e, h) = (self.cfg.vocab, self.cfg.embed, self.cfg.hidden);
        vec![
            ("embedding.weight".into(), Tensor::new(vec![v, e], self.embedding.clone())),
            ("tree.W_iou.weight".into(), Tensor::new(vec![3 * h, e], self.w_iou.clone())),
            ("tree.W_iou.bias".into(), Tensor::new(vec![3 * h], self.b_iou.clone())),
            ("tree.U_iou.weight".into(), Tensor::new(vec![3 * h, h], self.u_iou.clone())),
            ("tree.W_f.weight".into(), Tensor::new(vec![h, e], self.w_f.clone())),
            ("tree.W_f.bias".into(), Tensor::new(vec![h], self.b_f.clone())),
            ("tree.U_f.weight".into(), Tensor::new(vec![h, h], self.u_f.clone())),
        ]
    }

    pub fn toml(&self) -> String {
        let c = &self.cfg;
        format!("kind = \"treelstm\"\nvocab = {}\nembed = {}\nhidden = {}\n", c.vocab, c.embed, c.hidden)
    }

    pub fn max_nodes(&self) -> usize {
        self.cfg.max_nodes.unwrap_or(DEFAULT_MAX_NODES)
    }

    pub fn check(&self) -> Result<()> {
        let (v, e, h) = (self.cfg.vocab, self.cfg.embed, self.cfg.hidden);
        let ok = v > 0
            && e > 0
            && h > 0
            && self.embedding.len() == v * e
            && self.w_iou.len() == 3 * h * e
            && self.b_iou.len() == 3 * h
            && self.u_iou.len() == 3 * h * h
            && self.w_f.len() == h * e
            && self.b_f.len() == h
            && self.u_f.len() == h * h;
        if ok { Ok(()) } else { Err(config_error("treelstm tensors do not match vocab, embed and hidden")) }
    }

    /// Check a request: lengths agree, tokens in the vocabulary (or [`NO_TOKEN`]), a well-formed
    /// tree. Returns the tree.
    pub fn validate(&self, tokens: &[u32], parents: &[i32]) -> Result<Tree> {
        if tokens.len() != parents.len() {
            return Err(Error::invalid(format!(
                "tree has {} tokens but {} parents; they must have the same length",
                tokens.len(),
                parents.len()
            )));
        }
        let tree = validate_tree(parents, self.max_nodes())?;
        if let Some((i, &t)) =
            tokens.iter().enumerate().find(|&(_, &t)| t != NO_TOKEN && t as usize >= self.cfg.vocab)
        {
            return Err(Error::invalid(format!(
                "token {t} at node {i} is outside the vocabulary (0..{}, or {NO_TOKEN} for no input)",
                self.cfg.vocab
            )));
        }
        Ok(tree)
    }

    /// The root's h, computed recursively in f64 (the reference).
    pub fn forward_reference(&self, tokens: &[u32], parents: &[i32]) -> Vec<f32> {
        let tree = validate_tree(parents, usize::MAX).expect("a valid tree");
        let (e, h) = (self.cfg.embed, self.cfg.hidden);
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let dot = |w: &[f32], row: usize, k: usize, x: &[f64]| -> f64 {
            w[row * k..(row + 1) * k].iter().zip(x).map(|(&a, &b)| a as f64 * b).sum()
        };
        // Post-order without recursion: children before parents.
        let mut order = Vec::with_capacity(tokens.len());
        let mut stack = vec![(tree.root, false)];
        while let Some((v, expanded)) = stack.pop() {
            if expanded {
                order.push(v);
            } else {
                stack.push((v, true));
                stack.extend(tree.children[v as usize].iter().map(|&c| (c, false)));
            }
        }
        let mut hc: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); tokens.len()];
        for v in order {
            let t = tokens[v as usize];
            let x: Vec<f64> = if t == NO_TOKEN {
                vec![0.0; e]
            } else {
                self.embedding[t as usize * e..(t as usize + 1) * e].iter().map(|&a| a as f64).collect()
            };
            let kids = &tree.children[v as usize];
            let mut hsum = vec![0.0f64; h];
            for &k in kids {
                for (s, &a) in hsum.iter_mut().zip(&hc[k as usize].0) {
                    *s += a;
                }
            }
            let mut c = vec![0.0f64; h];
            let mut hv = vec![0.0f64; h];
            for u in 0..h {
                let pre = |r: usize| {
                    self.b_iou[r] as f64 + dot(&self.w_iou, r, e, &x) + dot(&self.u_iou, r, h, &hsum)
                };
                let (i, o, uu) = (sig(pre(u)), sig(pre(h + u)), pre(2 * h + u).tanh());
                let mut cu = i * uu;
                for &k in kids {
                    let f = sig(self.b_f[u] as f64
                        + dot(&self.w_f, u, e, &x)
                        + dot(&self.u_f, u, h, &hc[k as usize].0));
                    cu += f * hc[k as usize].1[u];
                }
                c[u] = cu;
                hv[u] = o * cu.tanh();
            }
            hc[v as usize] = (hv, c);
        }
        hc[tree.root as usize].0.iter().map(|&v| v as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_trees_are_refused_with_where() {
        let msg = |p: &[i32]| validate_tree(p, 100).unwrap_err().message().to_string();
        assert!(msg(&[]).contains("empty tree"));
        assert!(msg(&[0, 0]).contains("node 0 is its own parent"));
        assert!(msg(&[1, 0]).contains("no root"));
        assert!(msg(&[-1, 0, -1]).contains("two roots: nodes 0 and 2"));
        assert!(msg(&[-1, 5]).contains("node 1 has parent 5"));
        assert!(msg(&[-1, -2]).contains("node 1 has parent -2"));
        let m = msg(&[-1, 2, 3, 1]);
        assert!(
            m.contains("cycle") && (m.contains("node 1") || m.contains("node 2") || m.contains("node 3")),
            "{m}"
        );
        assert!(validate_tree(&[-1; 1], 0).unwrap_err().message().contains("larger than"));
        let t = validate_tree(&[2, 2, -1], 10).unwrap();
        assert_eq!((t.root, t.children[2].clone()), (2, vec![0, 1]));
    }
}
