//! `resnet`: torchvision's `ResNet` (`torchvision.models.resnet.ResNet`), its `state_dict` names,
//! BatchNorm in eval mode (ARCHITECTURE.md §6).
//!
//! ```text
//! conv1 (7×7, stride 2, pad 3) → bn1 → ReLU → maxpool (3×3, stride 2, pad 1)
//! layer1..layer4: blocks; stage i has width·2^i planes, stride 1 for layer1 and 2 after
//!   basic:      conv1 3×3 (stride) → bn1 → ReLU → conv2 3×3 → bn2   (+ shortcut) → ReLU
//!   bottleneck: conv1 1×1 → bn1 → ReLU → conv2 3×3 (stride) → bn2 → ReLU → conv3 1×1 → bn3
//!               (4× the planes)                                        (+ shortcut) → ReLU
//!   shortcut: the block's input, or `downsample` (1×1 conv, stride, → bn) when the stride or
//!   the channel count changes
//! avgpool (mean over every position) → fc
//! ```
//! `width` (model.toml, default 64 = torchvision) is the stem's channel count; torchvision's
//! models are `width = 64` with `layers` [2,2,2,2] (ResNet-18, basic), [3,4,6,3] (ResNet-34,
//! basic; ResNet-50, bottleneck), [3,4,23,3] (ResNet-101), [3,8,36,3] (ResNet-152). The image is
//! any `C × H × W` large enough that every stage keeps at least one position.
//!
//! The model keeps each convolution and its BatchNorm as exported; backends fold the BatchNorm
//! into the convolution when they prepare the model ([`Conv::folded`], eps 1e-5): no BatchNorm
//! runs at inference.
//!
//! Layers (what a layer-granular backend runs as a unit, [`super::LayerInfo`]): the stem (conv1,
//! bn1, ReLU, maxpool), each block, and the head (avgpool, fc).

use std::path::Path;

use rand::{Rng, SeedableRng, rngs::StdRng};
use serde::Deserialize;

use crate::error::{Error, Result};
use crate::model::LayerInfo;
use crate::model::limits::{
    MAX_IMAGE_CHANNELS, MAX_IMAGE_SIDE, MAX_MLP_WIDTH, MAX_RESNET_BLOCKS, MAX_RESNET_WIDTH, check_size,
};
use crate::model::weights::{Tensor, Weights, write_safetensors};

/// torchvision's BatchNorm2d eps.
pub const BN_EPS: f32 = 1e-5;

/// Keys of model.toml for `kind = "resnet"`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ResNetConfig {
    pub name: Option<String>,
    /// `"basic"` or `"bottleneck"`.
    pub block: String,
    /// Blocks per stage.
    pub layers: [usize; 4],
    pub num_classes: usize,
    /// `[C, H, W]` of the input image.
    pub image: [usize; 3],
    /// Channels of the stem (stage i: `width · 2^i` planes). Default 64, torchvision's.
    pub width: Option<usize>,
}

impl ResNetConfig {
    /// Every key within its limit (FORMAT naming the key); the block kind.
    pub fn check(&self, toml_path: &Path) -> Result<BlockKind> {
        let kind = match self.block.as_str() {
            "basic" => BlockKind::Basic,
            "bottleneck" => BlockKind::Bottleneck,
            other => {
                return Err(Error::format(format!(
                    "{}: block = \"{other}\": expected \"basic\" or \"bottleneck\"",
                    toml_path.display()
                )));
            }
        };
        for (i, &n) in self.layers.iter().enumerate() {
            check_size(toml_path, &format!("layers[{i}]"), n, MAX_RESNET_BLOCKS)?;
        }
        check_size(toml_path, "num_classes", self.num_classes, MAX_MLP_WIDTH)?;
        check_size(toml_path, "image[0] (channels)", self.image[0], MAX_IMAGE_CHANNELS)?;
        check_size(toml_path, "image[1] (height)", self.image[1], MAX_IMAGE_SIDE)?;
        check_size(toml_path, "image[2] (width)", self.image[2], MAX_IMAGE_SIDE)?;
        check_size(toml_path, "width", self.width.unwrap_or(64), MAX_RESNET_WIDTH)?;
        Ok(kind)
    }
}

/// The residual block kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockKind {
    Basic,
    Bottleneck,
}

impl BlockKind {
    /// Output channels per plane.
    pub fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// BatchNorm2d in eval mode: `y = (x − mean) / √(var + eps) · weight + bias`.
#[derive(Clone, Debug, PartialEq)]
pub struct BatchNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub mean: Vec<f32>,
    pub var: Vec<f32>,
}

/// A convolution's shape: channels in and out, the (square) kernel's side, stride and padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub in_c: usize,
    pub out_c: usize,
    pub k: usize,
    pub stride: usize,
    pub pad: usize,
}

impl Geometry {
    /// Output side for an input side.
    pub fn out_side(&self, side: usize) -> usize {
        conv_out(side, self.k, self.stride, self.pad)
    }

    /// Whether the input is its own im2col (1×1, stride 1, no padding): no patches are gathered.
    pub fn direct(&self) -> bool {
        self.k == 1 && self.stride == 1 && self.pad == 0
    }

    /// Values of one image's im2col (its output positions' `k × k × in_c` patches) for an input
    /// of `h × w`; 0 for a [direct](Self::direct) convolution.
    pub fn col_len(&self, h: usize, w: usize) -> usize {
        if self.direct() { 0 } else { self.out_side(h) * self.out_side(w) * self.k * self.k * self.in_c }
    }

    /// Multiply-adds for an output of `out_h × out_w`.
    fn macs(&self, out_h: usize, out_w: usize) -> u64 {
        (out_h * out_w * self.out_c * self.in_c * self.k * self.k) as u64
    }
}

/// A bias-free `Conv2d` (square kernel) and the BatchNorm after it.
#[derive(Clone, Debug, PartialEq)]
pub struct Conv {
    pub g: Geometry,
    /// `[out_c, in_c, k, k]`, as torch stores it.
    pub weight: Vec<f32>,
    pub bn: BatchNorm,
}

impl Conv {
    /// A random convolution of shape `g`: He-normal weights and BatchNorm statistics near
    /// identity (γ in [0.5, 1), β and the mean in [−0.1, 0.1), the variance in [0.8, 1.2)).
    pub fn random(g: Geometry, rng: &mut StdRng) -> Conv {
        let Geometry { in_c, out_c, k, .. } = g;
        let std = (2.0 / (in_c * k * k) as f64).sqrt() as f32;
        Conv {
            g,
            weight: (0..out_c * in_c * k * k).map(|_| normal(rng) * std).collect(),
            bn: BatchNorm {
                weight: (0..out_c).map(|_| rng.random_range(0.5..1.0)).collect(),
                bias: (0..out_c).map(|_| rng.random_range(-0.1..0.1)).collect(),
                mean: (0..out_c).map(|_| rng.random_range(-0.1..0.1)).collect(),
                var: (0..out_c).map(|_| rng.random_range(0.8..1.2)).collect(),
            },
        }
    }

    /// The BatchNorm folded in: the weight scaled per output channel by `γ / √(var + eps)`, as
    /// `[out_c, k, k, in_c]` (channels innermost, as a channels-last im2col reads them), and the
    /// bias `β − mean · γ / √(var + eps)`. Computed in f64.
    pub fn folded(&self) -> (Vec<f32>, Vec<f32>) {
        let Geometry { in_c: ci, out_c, k, .. } = self.g;
        let mut w = vec![0.0f32; self.weight.len()];
        let mut b = vec![0.0f32; out_c];
        for o in 0..out_c {
            let scale = f64::from(self.bn.weight[o]) / (f64::from(self.bn.var[o]) + f64::from(BN_EPS)).sqrt();
            b[o] = (f64::from(self.bn.bias[o]) - f64::from(self.bn.mean[o]) * scale) as f32;
            for c in 0..ci {
                for y in 0..k {
                    for x in 0..k {
                        let v = self.weight[((o * ci + c) * k + y) * k + x];
                        w[((o * k + y) * k + x) * ci + c] = (f64::from(v) * scale) as f32;
                    }
                }
            }
        }
        (w, b)
    }
}

/// `floor((side + 2·pad − k) / stride) + 1`, or 0 when the kernel does not fit.
pub fn conv_out(side: usize, k: usize, stride: usize, pad: usize) -> usize {
    (side + 2 * pad).checked_sub(k).map_or(0, |d| d / stride + 1)
}

/// An image's `(height, width)`.
pub type Sides = (usize, usize);

/// One residual block.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// basic: conv1, conv2; bottleneck: conv1, conv2, conv3.
    pub convs: Vec<Conv>,
    pub downsample: Option<Conv>,
}

impl Block {
    /// Each convolution of the block for an input of `h × w`, with the side it is given and the
    /// side it gives: the main path in order, then the downsample (given the block's input).
    pub fn walk(&self, (h, w): Sides) -> Vec<(Geometry, Sides, Sides)> {
        let mut out = Vec::with_capacity(self.convs.len() + 1);
        let mut side = (h, w);
        for c in &self.convs {
            let next = (c.g.out_side(side.0), c.g.out_side(side.1));
            out.push((c.g, side, next));
            side = next;
        }
        out.extend(self.downsample.as_ref().map(|d| (d.g, (h, w), (d.g.out_side(h), d.g.out_side(w)))));
        out
    }

    /// The side the block gives for an input of `h × w` (its main path's last output).
    pub fn out_sides(&self, hw: Sides) -> Sides {
        self.walk(hw)[self.convs.len() - 1].2
    }
}

/// A loaded ResNet.
#[derive(Clone, Debug, PartialEq)]
pub struct ResNet {
    pub cfg: ResNetConfig,
    pub kind: BlockKind,
    pub stem: Conv,
    /// Every block of the four stages, in order.
    pub blocks: Vec<Block>,
    /// `fc.weight` `[num_classes, features]`, `fc.bias`.
    pub fc_weight: Vec<f32>,
    pub fc_bias: Vec<f32>,
}

/// A tensor shape `[C, H, W]` between layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub c: usize,
    pub h: usize,
    pub w: usize,
}

impl Shape {
    /// Values of one image of this shape.
    pub fn values(&self) -> usize {
        self.c * self.h * self.w
    }
}

impl ResNet {
    pub fn width(&self) -> usize {
        self.cfg.width.unwrap_or(64)
    }

    pub fn input_len(&self) -> usize {
        self.cfg.image.iter().product()
    }

    pub fn output_len(&self) -> usize {
        self.cfg.num_classes
    }

    /// Features the head averages: the last stage's channels.
    pub fn features(&self) -> usize {
        8 * self.width() * self.kind.expansion()
    }

    /// The shape entering each layer and the output's: `layers().len() + 1` shapes (the last is
    /// `[num_classes, 1, 1]`).
    pub fn shapes(&self) -> Vec<Shape> {
        let [c, h, w] = self.cfg.image;
        let mut s = Shape { c, h, w };
        let mut out = vec![s];
        // Stem: conv1 then the 3×3 / 2 max-pool (pad 1).
        let (h1, w1) = (self.stem.g.out_side(s.h), self.stem.g.out_side(s.w));
        s = Shape { c: self.stem.g.out_c, h: conv_out(h1, 3, 2, 1), w: conv_out(w1, 3, 2, 1) };
        out.push(s);
        for b in &self.blocks {
            let (h, w) = b.out_sides((s.h, s.w));
            s = Shape { c: b.convs.last().expect("a block has convolutions").g.out_c, h, w };
            out.push(s);
        }
        out.push(Shape { c: self.cfg.num_classes, h: 1, w: 1 });
        out
    }

    /// The model's layers: the stem, every block, the head.
    pub fn layers(&self) -> Vec<LayerInfo> {
        let shapes = self.shapes();
        let mut out = Vec::with_capacity(self.blocks.len() + 2);
        let conv_bytes = |c: &Conv| 4 * (c.weight.len() + c.g.out_c) as u64;
        let [_, h, w] = self.cfg.image;
        let stem = self.stem.g;
        let stem_macs = stem.macs(stem.out_side(h), stem.out_side(w));
        out.push(LayerInfo::new("stem", "conv", conv_bytes(&self.stem), 2 * stem_macs, shapes[1].values()));
        let mut stage_block = [0usize; 4];
        let mut stage = 0;
        for (i, b) in self.blocks.iter().enumerate() {
            while stage_block[stage] == self.cfg.layers[stage] {
                stage += 1;
            }
            let name = format!("layer{}.{}", stage + 1, stage_block[stage]);
            stage_block[stage] += 1;
            let (inp, outp) = (shapes[i + 1], shapes[i + 2]);
            let macs = b.walk((inp.h, inp.w)).iter().map(|(g, _, (oh, ow))| g.macs(*oh, *ow)).sum::<u64>();
            let bytes = b.convs.iter().chain(&b.downsample).map(conv_bytes).sum();
            out.push(LayerInfo::new(&name, "block", bytes, 2 * macs, outp.values()));
        }
        let feats = self.features();
        out.push(LayerInfo::new(
            "head",
            "pool+fc",
            4 * (self.fc_weight.len() + self.fc_bias.len()) as u64,
            2 * (feats * self.cfg.num_classes) as u64,
            self.cfg.num_classes,
        ));
        out
    }

    /// The most values one image occupies, over the whole model, in an activation buffer (the
    /// input, the stem's output before pooling, every convolution's output, the logits) and in
    /// the im2col buffer: what a backend sizes its per-image buffers by.
    pub fn buffer_sizes(&self) -> (usize, usize) {
        let [c, h, w] = self.cfg.image;
        let stem = self.stem.g;
        let mut act =
            (c * h * w).max(stem.out_c * stem.out_side(h) * stem.out_side(w)).max(self.cfg.num_classes);
        let mut col = stem.col_len(h, w);
        for (b, s) in self.blocks.iter().zip(&self.shapes()[1..]) {
            for (g, (ih, iw), (oh, ow)) in b.walk((s.h, s.w)) {
                col = col.max(g.col_len(ih, iw));
                act = act.max(g.out_c * oh * ow);
            }
        }
        (act, col)
    }

    /// The structure is consistent (for a network built in code): as many blocks as `layers`
    /// says, each convolution taking the channels the one before gives, the fc taking the last
    /// stage's. (Any image of at least 1×1 keeps a position through every stage: each
    /// convolution and the max-pool pad enough.)
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::invalid(format!("inconsistent resnet: {what}")));
        if self.blocks.len() != self.cfg.layers.iter().sum::<usize>() {
            return bad(format!("{} blocks for layers {:?}", self.blocks.len(), self.cfg.layers));
        }
        if self.stem.g.in_c != self.cfg.image[0] {
            return bad(format!(
                "the stem takes {} channels, the image has {}",
                self.stem.g.in_c, self.cfg.image[0]
            ));
        }
        let mut c = self.stem.g.out_c;
        for (i, b) in self.blocks.iter().enumerate() {
            for conv in &b.convs {
                let g = conv.g;
                if g.in_c != c || conv.weight.len() != g.out_c * g.in_c * g.k * g.k {
                    return bad(format!("block {i}: a convolution takes {} channels, gets {c}", g.in_c));
                }
                c = g.out_c;
            }
        }
        if self.fc_weight.len() != self.cfg.num_classes * c || self.fc_bias.len() != self.cfg.num_classes {
            return bad(format!("the fc does not map {c} features to {} classes", self.cfg.num_classes));
        }
        Ok(())
    }

    /// Build from the tensors of a torchvision `state_dict`, checking every size against
    /// model.toml and the [limits](crate::model::limits).
    pub fn from_weights(cfg: &ResNetConfig, toml_path: &Path, mut w: Weights) -> Result<ResNet> {
        let kind = cfg.check(toml_path)?;
        let (stem, blocks, inplanes) = structure(cfg, kind, |c: &ConvSpec| take_conv(&mut w, c))?;
        let blocks = blocks.into_iter().map(|(convs, downsample)| Block { convs, downsample }).collect();
        let fc_weight = w.take("fc.weight", &[cfg.num_classes, inplanes])?.data;
        let fc_bias = w.take("fc.bias", &[cfg.num_classes])?.data;
        w.finish()?;
        let net = ResNet { cfg: cfg.clone(), kind, stem, blocks, fc_weight, fc_bias };
        net.check().map_err(|e| Error::format(format!("{}: {}", toml_path.display(), e.message())))?;
        Ok(net)
    }

    /// A random ResNet of `cfg` (He-normal convolutions, random BatchNorm statistics, a small fc).
    pub fn random(cfg: &ResNetConfig, seed: u64) -> ResNet {
        let mut rng = StdRng::seed_from_u64(seed);
        let kind = if cfg.block == "bottleneck" { BlockKind::Bottleneck } else { BlockKind::Basic };
        let (stem, blocks, inplanes) = structure(cfg, kind, |c: &ConvSpec| Ok(Conv::random(c.g, &mut rng)))
            .expect("a random convolution never fails");
        let blocks = blocks.into_iter().map(|(convs, downsample)| Block { convs, downsample }).collect();
        let s = 1.0 / (inplanes as f32).sqrt();
        let fc_weight = (0..cfg.num_classes * inplanes).map(|_| rng.random_range(-s..s)).collect();
        let fc_bias = (0..cfg.num_classes).map(|_| rng.random_range(-s..s)).collect();
        ResNet { cfg: cfg.clone(), kind, stem, blocks, fc_weight, fc_bias }
    }

    /// Write model.toml and weights.safetensors (torchvision's names; `num_batches_tracked`
    /// is not written: it carries nothing).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let c = &self.cfg;
        let mut toml = format!(
            "kind = \"resnet\"\nblock = \"{}\"\nlayers = [{}, {}, {}, {}]\nnum_classes = {}\nimage = [{}, {}, {}]\n",
            c.block,
            c.layers[0],
            c.layers[1],
            c.layers[2],
            c.layers[3],
            c.num_classes,
            c.image[0],
            c.image[1],
            c.image[2]
        );
        if let Some(w) = c.width {
            toml.push_str(&format!("width = {w}\n"));
        }
        if let Some(n) = &c.name {
            toml.push_str(&format!("name = {n:?}\n"));
        }
        crate::model::create_model_dir(dir, &toml)?;
        let mut tensors: Vec<(String, Tensor)> = Vec::new();
        let mut push_conv = |conv: &str, bn: &str, cv: &Conv| {
            tensors.push((
                format!("{conv}.weight"),
                Tensor::new(vec![cv.g.out_c, cv.g.in_c, cv.g.k, cv.g.k], cv.weight.clone()),
            ));
            for (n, v) in [
                ("weight", &cv.bn.weight),
                ("bias", &cv.bn.bias),
                ("running_mean", &cv.bn.mean),
                ("running_var", &cv.bn.var),
            ] {
                tensors.push((format!("{bn}.{n}"), Tensor::new(vec![cv.g.out_c], v.clone())));
            }
        };
        // The names in torchvision's order, the convolutions in the same order.
        let (stem, blocks, _) = structure(c, self.kind, |spec| Ok((spec.conv.clone(), spec.bn.clone())))?;
        let names = std::iter::once(stem)
            .chain(blocks.into_iter().flat_map(|(convs, down)| convs.into_iter().chain(down)));
        let convs = std::iter::once(&self.stem)
            .chain(self.blocks.iter().flat_map(|b| b.convs.iter().chain(&b.downsample)));
        for ((conv, bn), cv) in names.zip(convs) {
            push_conv(&conv, &bn, cv);
        }
        let feats = self.features();
        tensors.push(("fc.weight".into(), Tensor::new(vec![c.num_classes, feats], self.fc_weight.clone())));
        tensors.push(("fc.bias".into(), Tensor::new(vec![c.num_classes], self.fc_bias.clone())));
        let refs: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        write_safetensors(&dir.join(crate::model::WEIGHTS_FILE), &refs)
    }
}

/// One convolution of a ResNet as torchvision lays it out: its `state_dict` prefixes and shape.
struct ConvSpec {
    conv: String,
    bn: String,
    g: Geometry,
}

impl ConvSpec {
    fn new(
        conv: String,
        bn: String,
        (in_c, out_c, k, stride, pad): (usize, usize, usize, usize, usize),
    ) -> ConvSpec {
        ConvSpec { conv, bn, g: Geometry { in_c, out_c, k, stride, pad } }
    }
}

/// A block as [`structure`] makes it: its main path and its downsample.
type BlockOf<T> = (Vec<T>, Option<T>);

/// Walk torchvision's ResNet structure for `cfg` (the stem, then each stage's blocks: stride 2
/// on the first block of every stage but the first, a downsample where the stride or the channel
/// count changes), making each convolution with `make`; the stem, the blocks and the features
/// the fc takes.
fn structure<T>(
    cfg: &ResNetConfig,
    kind: BlockKind,
    mut make: impl FnMut(&ConvSpec) -> Result<T>,
) -> Result<(T, Vec<BlockOf<T>>, usize)> {
    let width = cfg.width.unwrap_or(64);
    let stem = make(&ConvSpec::new("conv1".into(), "bn1".into(), (cfg.image[0], width, 7, 2, 3)))?;
    let mut blocks = Vec::new();
    let mut inplanes = width;
    for (stage, &n) in cfg.layers.iter().enumerate() {
        let planes = width << stage;
        for i in 0..n {
            let stride = if stage > 0 && i == 0 { 2 } else { 1 };
            let p = format!("layer{}.{i}", stage + 1);
            let out_c = planes * kind.expansion();
            let geometries = match kind {
                BlockKind::Basic => vec![(inplanes, planes, 3, stride, 1), (planes, planes, 3, 1, 1)],
                BlockKind::Bottleneck => {
                    vec![
                        (inplanes, planes, 1, 1, 0),
                        (planes, planes, 3, stride, 1),
                        (planes, out_c, 1, 1, 0),
                    ]
                }
            };
            let convs = geometries
                .into_iter()
                .enumerate()
                .map(|(j, g)| {
                    make(&ConvSpec::new(format!("{p}.conv{}", j + 1), format!("{p}.bn{}", j + 1), g))
                })
                .collect::<Result<Vec<_>>>()?;
            let downsample = if stride != 1 || inplanes != out_c {
                let spec = ConvSpec::new(
                    format!("{p}.downsample.0"),
                    format!("{p}.downsample.1"),
                    (inplanes, out_c, 1, stride, 0),
                );
                Some(make(&spec)?)
            } else {
                None
            };
            blocks.push((convs, downsample));
            inplanes = out_c;
        }
    }
    Ok((stem, blocks, inplanes))
}

/// A standard normal sample (Box–Muller).
fn normal(rng: &mut StdRng) -> f32 {
    let u: f64 = rng.random_range(f64::EPSILON..1.0);
    let v: f64 = rng.random_range(0.0..1.0);
    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
}

/// The convolution `spec` names (weight `[out_c, in_c, k, k]`) and its BatchNorm, checked.
fn take_conv(w: &mut Weights, spec: &ConvSpec) -> Result<Conv> {
    let (Geometry { in_c, out_c, k, .. }, bn) = (spec.g, &spec.bn);
    let weight = w.take(&format!("{}.weight", spec.conv), &[out_c, in_c, k, k])?.data;
    let mut v = |n: &str| w.take(&format!("{bn}.{n}"), &[out_c]).map(|t| t.data);
    let norm = BatchNorm {
        weight: v("weight")?,
        bias: v("bias")?,
        mean: v("running_mean")?,
        var: v("running_var")?,
    };
    if let Some(i) = norm.var.iter().position(|&x| x < 0.0) {
        return Err(Error::format(format!(
            "{}: tensor `{bn}.running_var` element {i} is negative ({}): a variance is at least 0",
            w.path().display(),
            norm.var[i],
        )));
    }
    Ok(Conv { g: spec.g, weight, bn: norm })
}
