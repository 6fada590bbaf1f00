//! `bert`: Hugging Face `transformers.BertModel` (its `state_dict` names), ARCHITECTURE.md §6.
//!
//! ```text
//! x = LayerNorm(word_embeddings[token] + position_embeddings[pos] + token_type_embeddings[0])
//! per layer:  q, k, v = x·Wᵀ + b (each hidden → hidden), split into `heads` heads of hidden/heads
//!             a = softmax(q·kᵀ / √(hidden/heads)) · v over the request's real tokens only
//!             x = LayerNorm(x + a·W_oᵀ + b_o)
//!             x = LayerNorm(x + GELU(x·W_iᵀ + b_i)·W_o2ᵀ + b_o2)      (GELU exact: erf)
//! pooler_output = tanh(x[0]·W_pᵀ + b_p)
//! ```
//! A request is `1..=seq_len` token ids (token type 0). Attention is over the real tokens only,
//! which is what `BertModel` computes for a batch padded to `seq_len` with an attention mask: a
//! masked key adds `finfo.min` to its score, so its weight is exactly 0, and padded positions
//! never influence real ones. The output is the pooled output (`hidden` values).
//!
//! Layers ([`super::LayerInfo`]): the embeddings, each encoder layer, the pooler.

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::LayerInfo;
use crate::model::limits::{MAX_HEADS, MAX_LAYERS, MAX_SEQ_LEN, MAX_VOCAB, MAX_WIDTH, check_size};
use crate::model::mlp::Linear;
use crate::model::weights::{Tensor, Weights, write_safetensors};

/// Keys of model.toml for `kind = "bert"`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BertConfig {
    pub name: Option<String>,
    pub vocab: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_position: usize,
    pub type_vocab: usize,
    /// Longest request, in tokens (at most `max_position`).
    pub seq_len: usize,
    /// LayerNorm eps (default 1e-12, `BertConfig`'s).
    pub layer_norm_eps: Option<f64>,
}

impl BertConfig {
    /// Every key within its limit and consistent (FORMAT naming the key).
    pub fn check(&self, toml_path: &Path) -> Result<()> {
        check_size(toml_path, "vocab", self.vocab, MAX_VOCAB)?;
        check_size(toml_path, "hidden", self.hidden, MAX_WIDTH)?;
        check_size(toml_path, "intermediate", self.intermediate, MAX_WIDTH)?;
        check_size(toml_path, "layers", self.layers, MAX_LAYERS)?;
        check_size(toml_path, "heads", self.heads, MAX_HEADS)?;
        check_size(toml_path, "max_position", self.max_position, MAX_SEQ_LEN)?;
        check_size(toml_path, "type_vocab", self.type_vocab, MAX_VOCAB)?;
        check_size(toml_path, "seq_len", self.seq_len, MAX_SEQ_LEN)?;
        let bad =
            |key: &str, why: String| Err(Error::format(format!("{}: {key}: {why}", toml_path.display())));
        if !self.hidden.is_multiple_of(self.heads) {
            return bad(
                "heads",
                format!("hidden = {} is not a multiple of heads = {}", self.hidden, self.heads),
            );
        }
        if self.seq_len > self.max_position {
            return bad(
                "seq_len",
                format!("{} is longer than max_position = {}", self.seq_len, self.max_position),
            );
        }
        if let Some(eps) = self.layer_norm_eps
            && !(eps.is_finite() && eps > 0.0 && eps < 1.0)
        {
            return bad("layer_norm_eps", format!("{eps}: expected a number in (0, 1)"));
        }
        Ok(())
    }

    pub fn eps(&self) -> f32 {
        self.layer_norm_eps.unwrap_or(1e-12) as f32
    }

    /// The row a request occupies between layers: `seq_len × hidden` values (its tokens' hidden
    /// states, the positions past its length unused) followed by the request's length.
    pub fn row_len(&self) -> usize {
        self.seq_len * self.hidden + 1
    }
}

/// LayerNorm's `weight` (γ) and `bias` (β).
#[derive(Clone, Debug, PartialEq)]
pub struct Norm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// One `BertLayer`.
#[derive(Clone, Debug, PartialEq)]
pub struct EncoderLayer {
    pub query: Linear,
    pub key: Linear,
    pub value: Linear,
    /// `attention.output.dense` and its LayerNorm.
    pub attn_out: Linear,
    pub attn_norm: Norm,
    /// `intermediate.dense` (GELU after it).
    pub intermediate: Linear,
    /// `output.dense` and its LayerNorm.
    pub output: Linear,
    pub out_norm: Norm,
}

/// A loaded BERT.
#[derive(Clone, Debug, PartialEq)]
pub struct Bert {
    pub cfg: BertConfig,
    /// `[vocab, hidden]`, `[max_position, hidden]`, `[type_vocab, hidden]`.
    pub word: Vec<f32>,
    pub position: Vec<f32>,
    pub token_type: Vec<f32>,
    pub embed_norm: Norm,
    pub layers: Vec<EncoderLayer>,
    pub pooler: Linear,
}

/// The dense layers of one encoder layer, as (name, in, out).
const DENSES: [(&str, bool); 6] = [
    ("attention.self.query", false),
    ("attention.self.key", false),
    ("attention.self.value", false),
    ("attention.output.dense", false),
    ("intermediate.dense", true),
    ("output.dense", false),
];

impl Bert {
    pub fn hidden(&self) -> usize {
        self.cfg.hidden
    }

    /// The model's layers: the embeddings, each encoder layer, the pooler. FLOPs per row are for
    /// a request of `seq_len` tokens.
    pub fn layers(&self) -> Vec<LayerInfo> {
        let (s, h, i) = (self.cfg.seq_len as u64, self.cfg.hidden as u64, self.cfg.intermediate as u64);
        let row = self.cfg.row_len();
        let mut out = Vec::with_capacity(self.layers.len() + 2);
        let embed_bytes =
            4 * (self.word.len() + self.position.len() + self.token_type.len() + 2 * h as usize);
        out.push(LayerInfo::new("embeddings", "embedding", embed_bytes as u64, 8 * s * h, row));
        for (k, l) in self.layers.iter().enumerate() {
            let bytes: usize = [&l.query, &l.key, &l.value, &l.attn_out, &l.intermediate, &l.output]
                .iter()
                .map(|d| d.weight.len() + d.bias.len())
                .sum::<usize>()
                + 4 * h as usize;
            // Four h×h projections, two h×i, and the two attention products (s×s×h each).
            let flops = 2 * s * (4 * h * h + 2 * h * i) + 4 * s * s * h;
            out.push(LayerInfo::new(
                &format!("encoder.layer.{k}"),
                "transformer",
                4 * bytes as u64,
                flops,
                row,
            ));
        }
        let pooler_bytes = 4 * (self.pooler.weight.len() + self.pooler.bias.len()) as u64;
        out.push(LayerInfo::new("pooler", "dense", pooler_bytes, 2 * h * h, self.cfg.hidden));
        out
    }

    pub fn check(&self) -> Result<()> {
        let c = &self.cfg;
        if !c.hidden.is_multiple_of(c.heads) {
            return Err(Error::invalid(format!(
                "hidden {} is not a multiple of heads {}",
                c.hidden, c.heads
            )));
        }
        if c.seq_len > c.max_position {
            return Err(Error::invalid(format!(
                "seq_len {} is longer than max_position {}",
                c.seq_len, c.max_position
            )));
        }
        Ok(())
    }

    /// Build from the tensors of a `BertModel` `state_dict`.
    pub fn from_weights(cfg: &BertConfig, toml_path: &Path, mut w: Weights) -> Result<Bert> {
        cfg.check(toml_path)?;
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let word = w.take("embeddings.word_embeddings.weight", &[cfg.vocab, h])?.data;
        let position = w.take("embeddings.position_embeddings.weight", &[cfg.max_position, h])?.data;
        let token_type = w.take("embeddings.token_type_embeddings.weight", &[cfg.type_vocab, h])?.data;
        let embed_norm = take_norm(&mut w, "embeddings.LayerNorm", h)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for k in 0..cfg.layers {
            let p = format!("encoder.layer.{k}");
            let mut dense =
                |name: &str, inp: usize, out: usize| take_linear(&mut w, &format!("{p}.{name}"), inp, out);
            let query = dense(DENSES[0].0, h, h)?;
            let key = dense(DENSES[1].0, h, h)?;
            let value = dense(DENSES[2].0, h, h)?;
            let attn_out = dense(DENSES[3].0, h, h)?;
            let intermediate = dense(DENSES[4].0, h, i)?;
            let output = dense(DENSES[5].0, i, h)?;
            let attn_norm = take_norm(&mut w, &format!("{p}.attention.output.LayerNorm"), h)?;
            let out_norm = take_norm(&mut w, &format!("{p}.output.LayerNorm"), h)?;
            layers.push(EncoderLayer {
                query,
                key,
                value,
                attn_out,
                attn_norm,
                intermediate,
                output,
                out_norm,
            });
        }
        if w.contains(&format!("encoder.layer.{}.attention.self.query.weight", cfg.layers)) {
            return Err(Error::format(format!(
                "{}: tensor `encoder.layer.{}.attention.self.query.weight`: model.toml says layers = {}",
                w.path().display(),
                cfg.layers,
                cfg.layers
            )));
        }
        let pooler = take_linear(&mut w, "pooler.dense", h, h)?;
        w.finish()?;
        let net = Bert { cfg: cfg.clone(), word, position, token_type, embed_norm, layers, pooler };
        net.check().map_err(|e| Error::format(format!("{}: {}", toml_path.display(), e.message())))?;
        Ok(net)
    }

    /// A random BERT of `cfg` (normal(0, 0.02) weights as `BertModel` initialises them, zero
    /// biases perturbed slightly, LayerNorm γ ≈ 1).
    pub fn random(cfg: &BertConfig, seed: u64) -> Bert {
        let mut rng = StdRng::seed_from_u64(seed);
        let (h, i) = (cfg.hidden, cfg.intermediate);
        let mut vals = |n: usize, s: f32| -> Vec<f32> { (0..n).map(|_| rng.random_range(-s..s)).collect() };
        let mut dense = |inp: usize, out: usize| Linear {
            in_features: inp,
            out_features: out,
            weight: vals(inp * out, 0.035),
            bias: vals(out, 0.01),
        };
        let norm = |rng: &mut StdRng| Norm {
            weight: (0..h).map(|_| rng.random_range(0.9..1.1)).collect(),
            bias: (0..h).map(|_| rng.random_range(-0.05..0.05)).collect(),
        };
        let layers_dense: Vec<[Linear; 6]> = (0..cfg.layers)
            .map(|_| [dense(h, h), dense(h, h), dense(h, h), dense(h, h), dense(h, i), dense(i, h)])
            .collect();
        let pooler = dense(h, h);
        let mut rng2 = StdRng::seed_from_u64(seed ^ 0x5EED);
        let mut table = |n: usize| -> Vec<f32> { (0..n).map(|_| rng2.random_range(-0.05..0.05)).collect() };
        let word = table(cfg.vocab * h);
        let position = table(cfg.max_position * h);
        let token_type = table(cfg.type_vocab * h);
        let mut rng3 = StdRng::seed_from_u64(seed ^ 0x0A0A);
        let embed_norm = norm(&mut rng3);
        let layers = layers_dense
            .into_iter()
            .map(|[query, key, value, attn_out, intermediate, output]| EncoderLayer {
                query,
                key,
                value,
                attn_out,
                attn_norm: norm(&mut rng3),
                intermediate,
                output,
                out_norm: norm(&mut rng3),
            })
            .collect();
        Bert { cfg: cfg.clone(), word, position, token_type, embed_norm, layers, pooler }
    }

    /// Write model.toml and weights.safetensors (`BertModel`'s names).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let c = &self.cfg;
        let mut toml = format!(
            "kind = \"bert\"\nvocab = {}\nhidden = {}\nlayers = {}\nheads = {}\nintermediate = {}\n\
             max_position = {}\ntype_vocab = {}\nseq_len = {}\n",
            c.vocab, c.hidden, c.layers, c.heads, c.intermediate, c.max_position, c.type_vocab, c.seq_len
        );
        if let Some(eps) = c.layer_norm_eps {
            toml.push_str(&format!("layer_norm_eps = {eps:e}\n"));
        }
        if let Some(n) = &c.name {
            toml.push_str(&format!("name = {n:?}\n"));
        }
        crate::model::create_model_dir(dir, &toml)?;
        let h = c.hidden;
        let mut t: Vec<(String, Tensor)> = vec![
            ("embeddings.word_embeddings.weight".into(), Tensor::new(vec![c.vocab, h], self.word.clone())),
            (
                "embeddings.position_embeddings.weight".into(),
                Tensor::new(vec![c.max_position, h], self.position.clone()),
            ),
            (
                "embeddings.token_type_embeddings.weight".into(),
                Tensor::new(vec![c.type_vocab, h], self.token_type.clone()),
            ),
        ];
        push_norm(&mut t, "embeddings.LayerNorm", &self.embed_norm);
        for (k, l) in self.layers.iter().enumerate() {
            let p = format!("encoder.layer.{k}");
            for ((name, _), d) in
                DENSES.iter().zip([&l.query, &l.key, &l.value, &l.attn_out, &l.intermediate, &l.output])
            {
                push_linear(&mut t, &format!("{p}.{name}"), d);
            }
            push_norm(&mut t, &format!("{p}.attention.output.LayerNorm"), &l.attn_norm);
            push_norm(&mut t, &format!("{p}.output.LayerNorm"), &l.out_norm);
        }
        push_linear(&mut t, "pooler.dense", &self.pooler);
        let refs: Vec<(&str, &Tensor)> = t.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&dir.join(crate::model::WEIGHTS_FILE), &refs)
    }
}

/// Each row's length in a task of `rows` rows entering layer `first` (`input`: token ids as f32,
/// −1 past the end, for layer 0; else `seq_len × hidden` values and the length), checked as every
/// backend must before computing: ids are whole numbers below `vocab`, lengths whole numbers up
/// to `seq_len`; `INVALID_ARGUMENT` naming the row otherwise. (Requests are validated at submit;
/// this guards tasks handed to a runner directly.)
pub fn task_lens(cfg: &BertConfig, first: usize, rows: usize, input: &[f32]) -> Result<Vec<usize>> {
    let row_len = if first == 0 { cfg.seq_len } else { cfg.row_len() };
    if input.len() < rows * row_len {
        return Err(Error::invalid(format!(
            "a bert task of {rows} rows entering layer {first} carries {} values, not {rows} × {row_len}",
            input.len()
        )));
    }
    (0..rows)
        .map(|r| {
            let row = &input[r * row_len..(r + 1) * row_len];
            if first == 0 {
                let len = row.iter().position(|&t| t < 0.0).unwrap_or(cfg.seq_len);
                match row[..len].iter().position(|&t| t >= cfg.vocab as f32 || t.fract() != 0.0) {
                    Some(p) => Err(Error::invalid(format!(
                        "row {r} of a bert task: token {} at position {p} is not an id below {}",
                        row[p], cfg.vocab
                    ))),
                    None => Ok(len),
                }
            } else {
                let l = row[row_len - 1];
                if (0.0..=cfg.seq_len as f32).contains(&l) && l.fract() == 0.0 {
                    Ok(l as usize)
                } else {
                    Err(Error::invalid(format!(
                        "row {r} of a bert task: length {l} is not in 0..={}",
                        cfg.seq_len
                    )))
                }
            }
        })
        .collect()
}

fn take_linear(w: &mut Weights, name: &str, inp: usize, out: usize) -> Result<Linear> {
    let weight = w.take(&format!("{name}.weight"), &[out, inp])?.data;
    let bias = w.take(&format!("{name}.bias"), &[out])?.data;
    Ok(Linear { in_features: inp, out_features: out, weight, bias })
}

fn take_norm(w: &mut Weights, name: &str, h: usize) -> Result<Norm> {
    Ok(Norm {
        weight: w.take(&format!("{name}.weight"), &[h])?.data,
        bias: w.take(&format!("{name}.bias"), &[h])?.data,
    })
}

fn push_linear(t: &mut Vec<(String, Tensor)>, name: &str, d: &Linear) {
    t.push((format!("{name}.weight"), Tensor::new(vec![d.out_features, d.in_features], d.weight.clone())));
    t.push((format!("{name}.bias"), Tensor::new(vec![d.out_features], d.bias.clone())));
}

fn push_norm(t: &mut Vec<(String, Tensor)>, name: &str, n: &Norm) {
    t.push((format!("{name}.weight"), Tensor::new(vec![n.weight.len()], n.weight.clone())));
    t.push((format!("{name}.bias"), Tensor::new(vec![n.bias.len()], n.bias.clone())));
}
