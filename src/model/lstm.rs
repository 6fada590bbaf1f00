//! `lstm`: token embedding then a multi-layer `torch.nn.LSTM` (gates i, f, g, o); the output is
//! the top layer's final hidden state. Also the LSTM stack shared with `seq2seq`.

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::limits::{MAX_LAYERS, MAX_LEN, MAX_VOCAB, MAX_WIDTH, check_size};
use crate::model::weights::{Tensor, Weights};
use crate::model::{check_tokens, config_error};

/// Longest token sequence accepted when model.toml sets no `max_len`.
pub const DEFAULT_MAX_LEN: usize = 1024;

/// Keys of model.toml for `kind = "lstm"`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct LstmConfig {
    pub name: Option<String>,
    pub vocab: usize,
    pub embed: usize,
    pub hidden: usize,
    pub layers: usize,
    /// Longest accepted input (tokens); default [`DEFAULT_MAX_LEN`].
    pub max_len: Option<usize>,
}

impl LstmConfig {
    /// Every key within its [`limits`](crate::model::limits) (FORMAT naming the key); the tensor
    /// sizes they imply then cannot overflow.
    pub fn check(&self, toml_path: &Path) -> Result<()> {
        check_lstm_keys(toml_path, self.vocab, self.embed, self.hidden, self.layers, self.max_len)
    }
}

/// The keys an `lstm` and a `seq2seq` share, each within its limit, and the sizes of their
/// largest tensors (`vocab × embed`, `4 × hidden × embed`, `4 × hidden × hidden`) checked.
pub(crate) fn check_lstm_keys(
    toml_path: &Path,
    vocab: usize,
    embed: usize,
    hidden: usize,
    layers: usize,
    max_len: Option<usize>,
) -> Result<()> {
    check_size(toml_path, "vocab", vocab, MAX_VOCAB)?;
    check_size(toml_path, "embed", embed, MAX_WIDTH)?;
    check_size(toml_path, "hidden", hidden, MAX_WIDTH)?;
    check_size(toml_path, "layers", layers, MAX_LAYERS)?;
    if let Some(m) = max_len {
        check_size(toml_path, "max_len", m, MAX_LEN)?;
    }
    Ok(())
}

/// One layer of `torch.nn.LSTM`, PyTorch layouts: `w_ih [4H, input]`, `w_hh [4H, H]`, biases
/// `[4H]`, gate rows in the order i, f, g, o.
#[derive(Clone, Debug, PartialEq)]
pub struct LstmLayerWeights {
    pub input: usize,
    pub w_ih: Vec<f32>,
    pub w_hh: Vec<f32>,
    pub b_ih: Vec<f32>,
    pub b_hh: Vec<f32>,
}

/// A stack of LSTM layers (`{prefix}weight_ih_l{k}` …).
#[derive(Clone, Debug, PartialEq)]
pub struct LstmStack {
    pub hidden: usize,
    pub layers: Vec<LstmLayerWeights>,
}

/// Per layer `(h, c)` in f64, for the reference implementations.
pub type RefState = Vec<(Vec<f64>, Vec<f64>)>;

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

impl LstmStack {
    /// Take `{prefix}weight_ih_l{k}` … for `layers` layers from `w` (sizes checked by
    /// [`check_lstm_keys`]).
    pub fn take(
        w: &mut Weights,
        prefix: &str,
        input: usize,
        hidden: usize,
        layers: usize,
    ) -> Result<LstmStack> {
        let g = 4 * hidden;
        let layers = (0..layers)
            .map(|k| {
                let inp = if k == 0 { input } else { hidden };
                Ok(LstmLayerWeights {
                    input: inp,
                    w_ih: w.take(&format!("{prefix}weight_ih_l{k}"), &[g, inp])?.data,
                    w_hh: w.take(&format!("{prefix}weight_hh_l{k}"), &[g, hidden])?.data,
                    b_ih: w.take(&format!("{prefix}bias_ih_l{k}"), &[g])?.data,
                    b_hh: w.take(&format!("{prefix}bias_hh_l{k}"), &[g])?.data,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(LstmStack { hidden, layers })
    }

    /// Uniform weights in ±1/√H, as `torch.nn.LSTM` initialises them.
    pub fn random(rng: &mut StdRng, input: usize, hidden: usize, layers: usize) -> LstmStack {
        let k = 1.0 / (hidden as f32).sqrt();
        let mut u = |n: usize| (0..n).map(|_| rng.random_range(-k..k)).collect::<Vec<f32>>();
        let layers = (0..layers)
            .map(|l| {
                let inp = if l == 0 { input } else { hidden };
                LstmLayerWeights {
                    input: inp,
                    w_ih: u(4 * hidden * inp),
                    w_hh: u(4 * hidden * hidden),
                    b_ih: u(4 * hidden),
                    b_hh: u(4 * hidden),
                }
            })
            .collect();
        LstmStack { hidden, layers }
    }

    /// The stack's tensors under `prefix`, for saving.
    pub fn tensors(&self, prefix: &str) -> Vec<(String, Tensor)> {
        let (h, g) = (self.hidden, 4 * self.hidden);
        let mut out = Vec::new();
        for (k, l) in self.layers.iter().enumerate() {
            out.push((format!("{prefix}weight_ih_l{k}"), Tensor::new(vec![g, l.input], l.w_ih.clone())));
            out.push((format!("{prefix}weight_hh_l{k}"), Tensor::new(vec![g, h], l.w_hh.clone())));
            out.push((format!("{prefix}bias_ih_l{k}"), Tensor::new(vec![g], l.b_ih.clone())));
            out.push((format!("{prefix}bias_hh_l{k}"), Tensor::new(vec![g], l.b_hh.clone())));
        }
        out
    }

    /// Shapes consistent with `input` and `hidden`.
    pub fn check(&self, input: usize) -> Result<()> {
        let (h, g) = (self.hidden, 4 * self.hidden);
        if h == 0 || self.layers.is_empty() {
            return Err(Error::invalid("an LSTM stack needs a hidden size and at least one layer"));
        }
        for (k, l) in self.layers.iter().enumerate() {
            let want = if k == 0 { input } else { h };
            if l.input != want
                || l.w_ih.len() != g * want
                || l.w_hh.len() != g * h
                || l.b_ih.len() != g
                || l.b_hh.len() != g
            {
                return Err(Error::invalid(format!(
                    "LSTM layer {k} does not match input {want}, hidden {h}"
                )));
            }
        }
        Ok(())
    }

    /// Zero `(h, c)` for every layer.
    pub fn zero_state(&self) -> RefState {
        vec![(vec![0.0; self.hidden], vec![0.0; self.hidden]); self.layers.len()]
    }

    /// One time step through every layer, in f64 (the reference the kernels are tested against).
    pub fn step_reference(&self, x: &[f32], state: &mut RefState) {
        let h = self.hidden;
        let mut input: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (l, (hs, cs)) in self.layers.iter().zip(state.iter_mut()) {
            let mut gates = vec![0.0f64; 4 * h];
            for (j, gate) in gates.iter_mut().enumerate() {
                let mut acc = l.b_ih[j] as f64 + l.b_hh[j] as f64;
                acc += l.w_ih[j * l.input..(j + 1) * l.input]
                    .iter()
                    .zip(&input)
                    .map(|(&w, &v)| w as f64 * v)
                    .sum::<f64>();
                acc += l.w_hh[j * h..(j + 1) * h]
                    .iter()
                    .zip(hs.iter())
                    .map(|(&w, &v)| w as f64 * v)
                    .sum::<f64>();
                *gate = acc;
            }
            for u in 0..h {
                let (i, f, g, o) = (
                    sigmoid(gates[u]),
                    sigmoid(gates[h + u]),
                    gates[2 * h + u].tanh(),
                    sigmoid(gates[3 * h + u]),
                );
                cs[u] = f * cs[u] + i * g;
                hs[u] = o * cs[u].tanh();
            }
            input = hs.clone();
        }
    }
}

/// A loaded `lstm` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Lstm {
    pub cfg: LstmConfig,
    /// `[vocab, embed]`.
    pub embedding: Vec<f32>,
    pub stack: LstmStack,
}

impl Lstm {
    /// Build from `cfg`, already checked ([`LstmConfig::check`], which `model::load` runs before it
    /// reads the weights), and its tensors.
    pub(crate) fn from_weights(cfg: LstmConfig, mut w: Weights) -> Result<Lstm> {
        let embedding = w.take("embedding.weight", &[cfg.vocab, cfg.embed])?.data;
        let stack = LstmStack::take(&mut w, "lstm.", cfg.embed, cfg.hidden, cfg.layers)?;
        w.finish()?;
        Ok(Lstm { cfg, embedding, stack })
    }

    /// A model with seeded random weights (embeddings ~ N(0, 1), LSTM uniform in ±1/√H).
    pub fn random(vocab: usize, embed: usize, hidden: usize, layers: usize, seed: u64) -> Lstm {
        let mut rng = StdRng::seed_from_u64(seed);
        let embedding = random_embedding(&mut rng, vocab, embed);
        let stack = LstmStack::random(&mut rng, embed, hidden, layers);
        Lstm { cfg: LstmConfig { name: None, vocab, embed, hidden, layers, max_len: None }, embedding, stack }
    }

    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut t = vec![(
            "embedding.weight".to_string(),
            Tensor::new(vec![self.cfg.vocab, self.cfg.embed], self.embedding.clone()),
        )];
        t.extend(self.stack.tensors("lstm."));
        t
    }

    pub fn toml(&self) -> String {
        let c = &self.cfg;
        format!(
            "kind = \"lstm\"\nvocab = {}\nembed = {}\nhidden = {}\nlayers = {}\n",
            c.vocab, c.embed, c.hidden, c.layers
        )
    }

    pub fn max_len(&self) -> usize {
        self.cfg.max_len.unwrap_or(DEFAULT_MAX_LEN)
    }

    pub fn check(&self) -> Result<()> {
        let c = &self.cfg;
        if c.vocab == 0 || c.embed == 0 || self.embedding.len() != c.vocab * c.embed {
            return Err(config_error("lstm embedding does not match vocab × embed"));
        }
        self.stack.check(c.embed)
    }

    pub fn validate(&self, tokens: &[u32]) -> Result<()> {
        check_tokens(tokens, self.cfg.vocab, self.max_len(), "lstm")
    }

    /// The top layer's final hidden state, in f64 then rounded (the reference).
    pub fn forward_reference(&self, tokens: &[u32]) -> Vec<f32> {
        let mut state = self.stack.zero_state();
        let e = self.cfg.embed;
        for &t in tokens {
            self.stack.step_reference(&self.embedding[t as usize * e..(t as usize + 1) * e], &mut state);
        }
        state.last().expect("layers ≥ 1").0.iter().map(|&v| v as f32).collect()
    }
}

/// `[vocab, embed]` values ~ N(0, 1), like `torch.nn.Embedding`.
pub(crate) fn random_embedding(rng: &mut StdRng, vocab: usize, embed: usize) -> Vec<f32> {
    use rand_distr::{Distribution, StandardNormal};
    (0..vocab * embed).map(|_| StandardNormal.sample(rng)).collect()
}
