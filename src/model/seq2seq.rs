//! `seq2seq`: an LSTM encoder and an LSTM decoder with greedy decoding. The decoder starts from
//! the encoder's final `(h, c)` of every layer and token `bos`; each step feeds the previous
//! output token; next = argmax of `proj(h_top)` (ties → lowest id); the output includes `eos` if
//! emitted and stops there, or at `max_decode` tokens.

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::limits::{MAX_DECODE, check_size};
use crate::model::lstm::{DEFAULT_MAX_LEN, LstmStack, check_lstm_keys, random_embedding};
use crate::model::weights::{Tensor, Weights};
use crate::model::{check_tokens, config_error};

/// Keys of model.toml for `kind = "seq2seq"`.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Seq2SeqConfig {
    pub name: Option<String>,
    pub vocab: usize,
    pub embed: usize,
    pub hidden: usize,
    pub layers: usize,
    pub bos: u32,
    pub eos: u32,
    pub max_decode: usize,
    /// Longest accepted source (tokens); default 1024.
    pub max_len: Option<usize>,
}

impl Seq2SeqConfig {
    /// Every key within its [`limits`](crate::model::limits) (FORMAT naming the key), `bos` and
    /// `eos` in the vocabulary; the tensor sizes the keys imply then cannot overflow.
    pub fn check(&self, toml_path: &Path) -> Result<()> {
        check_lstm_keys(toml_path, self.vocab, self.embed, self.hidden, self.layers, self.max_len)?;
        check_size(toml_path, "max_decode", self.max_decode, MAX_DECODE)?;
        for (key, v) in [("bos", self.bos), ("eos", self.eos)] {
            if v as usize >= self.vocab {
                return Err(Error::format(format!(
                    "{}: {key} = {v} is outside the vocabulary of {}",
                    toml_path.display(),
                    self.vocab
                )));
            }
        }
        Ok(())
    }
}

/// A loaded `seq2seq` model.
#[derive(Clone, Debug, PartialEq)]
pub struct Seq2Seq {
    pub cfg: Seq2SeqConfig,
    pub enc_embedding: Vec<f32>,
    pub encoder: LstmStack,
    pub dec_embedding: Vec<f32>,
    pub decoder: LstmStack,
    /// `[vocab, H]`.
    pub proj_weight: Vec<f32>,
    pub proj_bias: Vec<f32>,
}

impl Seq2Seq {
    /// Build from `cfg`, already checked ([`Seq2SeqConfig::check`], which `model::load` runs before it
    /// reads the weights), and its tensors.
    pub(crate) fn from_weights(cfg: Seq2SeqConfig, mut w: Weights) -> Result<Seq2Seq> {
        let (v, e, h, l) = (cfg.vocab, cfg.embed, cfg.hidden, cfg.layers);
        let enc_embedding = w.take("encoder.embedding.weight", &[v, e])?.data;
        let encoder = LstmStack::take(&mut w, "encoder.lstm.", e, h, l)?;
        let dec_embedding = w.take("decoder.embedding.weight", &[v, e])?.data;
        let decoder = LstmStack::take(&mut w, "decoder.lstm.", e, h, l)?;
        let proj_weight = w.take("decoder.proj.weight", &[v, h])?.data;
        let proj_bias = w.take("decoder.proj.bias", &[v])?.data;
        w.finish()?;
        Ok(Seq2Seq { cfg, enc_embedding, encoder, dec_embedding, decoder, proj_weight, proj_bias })
    }

    /// A model with seeded random weights.
    #[allow(clippy::too_many_arguments)]
    pub fn random(
        vocab: usize,
        embed: usize,
        hidden: usize,
        layers: usize,
        bos: u32,
        eos: u32,
        max_decode: usize,
        seed: u64,
    ) -> Seq2Seq {
        let mut rng = StdRng::seed_from_u64(seed);
        let enc_embedding = random_embedding(&mut rng, vocab, embed);
        let encoder = LstmStack::random(&mut rng, embed, hidden, layers);
        let dec_embedding = random_embedding(&mut rng, vocab, embed);
        let decoder = LstmStack::random(&mut rng, embed, hidden, layers);
        let k = 1.0 / (hidden as f32).sqrt();
        let proj_weight = (0..vocab * hidden).map(|_| rng.random_range(-k..k)).collect();
        let proj_bias = (0..vocab).map(|_| rng.random_range(-k..k)).collect();
        let cfg =
            Seq2SeqConfig { name: None, vocab, embed, hidden, layers, bos, eos, max_decode, max_len: None };
        Seq2Seq { cfg, enc_embedding, encoder, dec_embedding, decoder, proj_weight, proj_bias }
    }

    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let c = &self.cfg;
        let mut t = vec![(
            "encoder.embedding.weight".to_string(),
            Tensor::new(vec![c.vocab, c.embed], self.enc_embedding.clone()),
        )];
        t.extend(self.encoder.tensors("encoder.lstm."));
        t.push((
            "decoder.embedding.weight".into(),
            Tensor::new(vec![c.vocab, c.embed], self.dec_embedding.clone()),
        ));
        t.extend(self.decoder.tensors("decoder.lstm."));
        t.push((
            "decoder.proj.weight".into(),
            Tensor::new(vec![c.vocab, c.hidden], self.proj_weight.clone()),
        ));
        t.push(("decoder.proj.bias".into(), Tensor::new(vec![c.vocab], self.proj_bias.clone())));
        t
    }

    pub fn toml(&self) -> String {
        let c = &self.cfg;
        format!(
            "kind = \"seq2seq\"\nvocab = {}\nembed = {}\nhidden = {}\nlayers = {}\nbos = {}\neos = {}\nmax_decode = {}\n",
            c.vocab, c.embed, c.hidden, c.layers, c.bos, c.eos, c.max_decode
        )
    }

    pub fn max_len(&self) -> usize {
        self.cfg.max_len.unwrap_or(DEFAULT_MAX_LEN)
    }

    pub fn check(&self) -> Result<()> {
        let c = &self.cfg;
        let emb = c.vocab * c.embed;
        if c.vocab == 0
            || c.max_decode == 0
            || self.enc_embedding.len() != emb
            || self.dec_embedding.len() != emb
            || self.proj_weight.len() != c.vocab * c.hidden
            || self.proj_bias.len() != c.vocab
            || c.bos as usize >= c.vocab
            || c.eos as usize >= c.vocab
        {
            return Err(config_error("seq2seq tensors or tokens do not match its configuration"));
        }
        self.encoder.check(c.embed)?;
        self.decoder.check(c.embed)
    }

    pub fn validate(&self, tokens: &[u32]) -> Result<()> {
        check_tokens(tokens, self.cfg.vocab, self.max_len(), "seq2seq")
    }

    /// Greedy decode in f64 (the reference).
    pub fn decode_reference(&self, tokens: &[u32]) -> Vec<u32> {
        let (e, h) = (self.cfg.embed, self.cfg.hidden);
        let mut state = self.encoder.zero_state();
        for &t in tokens {
            self.encoder
                .step_reference(&self.enc_embedding[t as usize * e..(t as usize + 1) * e], &mut state);
        }
        let mut out = Vec::new();
        let mut prev = self.cfg.bos;
        while out.len() < self.cfg.max_decode {
            self.decoder
                .step_reference(&self.dec_embedding[prev as usize * e..(prev as usize + 1) * e], &mut state);
            let top = &state.last().expect("layers ≥ 1").0;
            let mut best = (f64::NEG_INFINITY, 0u32);
            for v in 0..self.cfg.vocab {
                let logit = self.proj_bias[v] as f64
                    + self.proj_weight[v * h..(v + 1) * h]
                        .iter()
                        .zip(top)
                        .map(|(&w, &x)| w as f64 * x)
                        .sum::<f64>();
                if logit > best.0 {
                    best = (logit, v as u32);
                }
            }
            prev = best.1;
            out.push(prev);
            if prev == self.cfg.eos {
                break;
            }
        }
        out
    }
}
