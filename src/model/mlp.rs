//! `mlp`: fully connected layers `layers.{k}.weight [out, in]`, `layers.{k}.bias [out]`, ReLU
//! between layers and none after the last (a `torch.nn.Linear` stack exported as a `state_dict`).

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::limits::{MAX_MLP_LAYERS, MAX_MLP_WIDTH};
use crate::model::weights::{Tensor, Weights, write_safetensors};

/// Keys of model.toml for `kind = "mlp"`; sizes come from the tensors, `input` / `output`, when
/// present, are checked against them.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MlpConfig {
    pub name: Option<String>,
    pub input: Option<usize>,
    pub output: Option<usize>,
}

/// One `torch.nn.Linear`: `y = x · Wᵀ + b`.
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    pub in_features: usize,
    pub out_features: usize,
    /// Row-major `[out_features, in_features]`.
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// A loaded mlp.
#[derive(Clone, Debug, PartialEq)]
pub struct Mlp {
    pub layers: Vec<Linear>,
}

impl Mlp {
    pub fn input_len(&self) -> usize {
        self.layers[0].in_features
    }
    pub fn output_len(&self) -> usize {
        self.layers.last().expect("an mlp has a layer").out_features
    }
    /// Widest activation (input included): the size of a row of the activation buffers.
    pub fn max_width(&self) -> usize {
        self.layers.iter().map(|l| l.in_features.max(l.out_features)).max().unwrap_or(0)
    }
    /// Its layers, one per `torch.nn.Linear` (ReLU included).
    pub fn layer_infos(&self) -> Vec<crate::model::LayerInfo> {
        self.layers
            .iter()
            .enumerate()
            .map(|(k, l)| {
                crate::model::LayerInfo::new(
                    &format!("layers.{k}"),
                    "dense",
                    4 * (l.weight.len() + l.bias.len()) as u64,
                    2 * (l.in_features * l.out_features) as u64,
                    l.out_features,
                )
            })
            .collect()
    }

    /// Multiply-adds × 2 for one row.
    pub fn flops_per_row(&self) -> u64 {
        self.layers.iter().map(|l| 2 * (l.in_features * l.out_features) as u64).sum()
    }

    /// Every layer non-empty, shaped as declared, and chained to the previous one.
    pub fn check(&self) -> Result<()> {
        if self.layers.is_empty() {
            return Err(Error::invalid("an mlp needs at least one layer"));
        }
        for (k, l) in self.layers.iter().enumerate() {
            let shaped = l.in_features > 0
                && l.out_features > 0
                && l.weight.len() == l.in_features * l.out_features
                && l.bias.len() == l.out_features;
            if !shaped {
                return Err(Error::invalid(format!(
                    "mlp layer {k} is empty or its tensors do not match its sizes"
                )));
            }
            if k > 0 && self.layers[k - 1].out_features != l.in_features {
                return Err(Error::invalid(format!(
                    "mlp layer {k} takes {} inputs but layer {} gives {}",
                    l.in_features,
                    k - 1,
                    self.layers[k - 1].out_features
                )));
            }
        }
        Ok(())
    }

    /// Build from validated tensors: at most [`MAX_MLP_LAYERS`] layers `0..L` contiguous, each
    /// at most [`MAX_MLP_WIDTH`] wide, each weight 2-D, each bias matching,
    /// each layer's input equal to the previous layer's output.
    /// `toml_path` names the model.toml the sizes in `cfg` come from, for messages.
    pub fn from_weights(cfg: &MlpConfig, toml_path: &Path, mut w: Weights) -> Result<Mlp> {
        let path = w.path().display().to_string();
        let mut layers = Vec::new();
        while w.contains(&format!("layers.{}.weight", layers.len())) {
            let k = layers.len();
            if k == MAX_MLP_LAYERS {
                return Err(Error::format(format!(
                    "{path}: tensor `layers.{k}.weight`: an mlp has at most {MAX_MLP_LAYERS} layers"
                )));
            }
            let weight = w.take_any(&format!("layers.{k}.weight"))?;
            let [out_features, in_features] = weight.shape[..] else {
                return Err(Error::format(format!(
                    "{path}: tensor `layers.{k}.weight` has shape {:?}, expected [out, in]",
                    weight.shape
                )));
            };
            if out_features == 0 || in_features == 0 {
                return Err(Error::format(format!(
                    "{path}: tensor `layers.{k}.weight` has an empty dimension {:?}",
                    weight.shape
                )));
            }
            if out_features.max(in_features) > MAX_MLP_WIDTH {
                return Err(Error::format(format!(
                    "{path}: tensor `layers.{k}.weight` has shape {:?}, over the limit of {MAX_MLP_WIDTH} \
                     inputs or outputs per layer",
                    weight.shape
                )));
            }
            if let Some(prev) = layers.last().map(|l: &Linear| l.out_features)
                && prev != in_features
            {
                return Err(Error::format(format!(
                    "{path}: tensor `layers.{k}.weight` has shape {:?}, expected [_, {prev}] \
                     (layer {} outputs {prev})",
                    weight.shape,
                    k - 1
                )));
            }
            let bias = w.take(&format!("layers.{k}.bias"), &[out_features])?;
            layers.push(Linear { in_features, out_features, weight: weight.data, bias: bias.data });
        }
        if layers.is_empty() {
            return Err(Error::format(format!("{path}: missing tensor `layers.0.weight`")));
        }
        w.finish()?;
        let mlp = Mlp { layers };
        for (key, want, have) in
            [("input", cfg.input, mlp.input_len()), ("output", cfg.output, mlp.output_len())]
        {
            if let Some(want) = want
                && want != have
            {
                return Err(Error::format(format!(
                    "{}: {key} = {want} but the tensors give {have}",
                    toml_path.display()
                )));
            }
        }
        Ok(mlp)
    }

    /// An mlp with the given layer widths (`sizes[0]` = input) and seeded uniform weights in
    /// ±1/√in, like `torch.nn.Linear`'s initialisation.
    pub fn random(sizes: &[usize], seed: u64) -> Mlp {
        assert!(sizes.len() >= 2, "an mlp needs at least an input and an output size");
        let mut rng = StdRng::seed_from_u64(seed);
        let layers = sizes
            .windows(2)
            .map(|io| {
                let (i, o) = (io[0], io[1]);
                let bound = 1.0 / (i as f32).sqrt();
                Linear {
                    in_features: i,
                    out_features: o,
                    weight: (0..i * o).map(|_| rng.random_range(-bound..bound)).collect(),
                    bias: (0..o).map(|_| rng.random_range(-bound..bound)).collect(),
                }
            })
            .collect();
        Mlp { layers }
    }

    /// Write this mlp as a model directory (`model.toml` + `weights.safetensors`).
    pub fn save(&self, dir: &Path) -> Result<()> {
        crate::model::create_model_dir(
            dir,
            &format!("kind = \"mlp\"\ninput = {}\noutput = {}\n", self.input_len(), self.output_len()),
        )?;
        let tensors: Vec<(String, Tensor)> = self
            .layers
            .iter()
            .enumerate()
            .flat_map(|(k, l)| {
                [
                    (
                        format!("layers.{k}.weight"),
                        Tensor::new(vec![l.out_features, l.in_features], l.weight.clone()),
                    ),
                    (format!("layers.{k}.bias"), Tensor::new(vec![l.out_features], l.bias.clone())),
                ]
            })
            .collect();
        let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&dir.join(crate::model::WEIGHTS_FILE), &refs)
    }

    /// Straightforward f64 forward pass of one row: the reference the backends are tested against.
    pub fn forward_reference(&self, x: &[f32]) -> Vec<f32> {
        let mut act: Vec<f64> = x.iter().map(|&v| v as f64).collect();
        for (k, l) in self.layers.iter().enumerate() {
            let mut y: Vec<f64> = (0..l.out_features)
                .map(|o| {
                    let row = &l.weight[o * l.in_features..(o + 1) * l.in_features];
                    l.bias[o] as f64 + row.iter().zip(&act).map(|(&w, &a)| w as f64 * a).sum::<f64>()
                })
                .collect();
            if k + 1 < self.layers.len() {
                y.iter_mut().for_each(|v| *v = v.max(0.0));
            }
            act = y;
        }
        act.into_iter().map(|v| v as f32).collect()
    }
}
