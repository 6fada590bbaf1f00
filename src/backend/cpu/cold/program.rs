//! What the cold-start executor runs: a model as a list of layers, each executed with its
//! parameters read from wherever the plan put them — device memory (the arena) or mapped host
//! memory, read through a 64-byte line counter so that direct host access is measured in the
//! units of DeepPlan's Table 1.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes of one line read over the bus.
pub const LINE_BYTES: usize = 64;

/// Lines of `LINE_BYTES` that bytes `[start, end)` of a line-aligned allocation span.
pub fn lines_spanned(start: usize, end: usize) -> u64 {
    if end <= start { 0 } else { ((end - 1) / LINE_BYTES - start / LINE_BYTES + 1) as u64 }
}

/// Host parameters read by direct access: every read counts the lines it spans, as if the
/// allocation were line-aligned (pinned host allocations are page-aligned).
pub struct HostView<'a> {
    data: &'a [f32],
    lines: &'a AtomicU64,
}

impl<'a> HostView<'a> {
    pub fn new(data: &'a [f32], lines: &'a AtomicU64) -> HostView<'a> {
        HostView { data, lines }
    }
}

/// A layer's parameters as a layer sees them.
pub enum Params<'a> {
    /// A parameter-free layer.
    None,
    /// In device memory (the arena).
    Device(&'a [f32]),
    /// In mapped host memory, read over the bus.
    Host(HostView<'a>),
}

impl Params<'_> {
    /// Values `range` of the layer's parameters (counted in lines when read from the host).
    pub fn read(&self, range: Range<usize>) -> &[f32] {
        match self {
            Params::None => &[],
            Params::Device(d) => &d[range],
            Params::Host(h) => {
                h.lines.fetch_add(lines_spanned(range.start * 4, range.end * 4), Ordering::Relaxed);
                &h.data[range]
            }
        }
    }
}

/// A model the cold-start executor runs layer by layer.
pub trait LayerProgram: Sync {
    /// Layers, in forward order.
    fn layers(&self) -> usize;
    /// Layer `i`'s parameters in host memory (empty for a parameter-free layer).
    fn host_params(&self, i: usize) -> &[f32];
    /// Layer `i`'s kind as a profile names it (`Embedding`, `Linear`, …).
    fn kind(&self, i: usize) -> &str {
        let _ = i;
        "Layer"
    }
    /// Runs layer `i` on activations `x` into `y` (cleared and refilled), reading its
    /// parameters only through `params`.
    fn run(&self, i: usize, params: &Params<'_>, x: &[f32], y: &mut Vec<f32>);
}

/// One layer of a [`Sequential`] program.
#[derive(Clone, Debug, PartialEq)]
pub enum Layer {
    /// Rows of a `[rows, width]` table looked up by token: the input holds token ids (as f32,
    /// exact below 2²⁴); the output is `tokens × width`.
    Embedding { rows: usize, width: usize },
    /// `y = x·Wᵀ + b` per token, `W` `[out, in]` then `b` `[out]` in the parameters.
    Linear { inputs: usize, outputs: usize },
    /// Per token, normalised then scaled and shifted: `γ` `[width]` then `β` `[width]`.
    LayerNorm { width: usize },
    /// `max(x, 0)`; no parameters.
    Relu,
}

impl Layer {
    /// Parameter values of the layer.
    pub fn params(&self) -> usize {
        match *self {
            Layer::Embedding { rows, width } => rows * width,
            Layer::Linear { inputs, outputs } => outputs * inputs + outputs,
            Layer::LayerNorm { width } => 2 * width,
            Layer::Relu => 0,
        }
    }

    /// The kind as a profile names it.
    pub fn kind(&self) -> &'static str {
        match self {
            Layer::Embedding { .. } => "Embedding",
            Layer::Linear { .. } => "Linear",
            Layer::LayerNorm { .. } => "LayerNorm",
            Layer::Relu => "ReLU",
        }
    }
}

/// A stack of [`Layer`]s with their host parameters: a small real model for the executor's
/// tests and the CPU cold-start profile.
#[derive(Clone, Debug)]
pub struct Sequential {
    pub layers: Vec<Layer>,
    pub params: Vec<Vec<f32>>,
}

impl Sequential {
    /// Layers with parameters drawn from `seed` (uniform in ±0.5).
    pub fn random(layers: Vec<Layer>, seed: u64) -> Sequential {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let params = layers
            .iter()
            .map(|l| (0..l.params()).map(|_| rng.random_range(-0.5f32..0.5)).collect())
            .collect();
        Sequential { layers, params }
    }
}

impl Sequential {
    /// An mlp model's layers (a ReLU between linears, none after the last), its weights copied.
    pub fn from_mlp(mlp: &crate::model::Mlp) -> Sequential {
        let mut layers = vec![];
        let mut params = vec![];
        for (k, l) in mlp.layers.iter().enumerate() {
            if k > 0 {
                layers.push(Layer::Relu);
                params.push(vec![]);
            }
            layers.push(Layer::Linear { inputs: l.in_features, outputs: l.out_features });
            params.push(l.weight.iter().chain(&l.bias).copied().collect());
        }
        Sequential { layers, params }
    }
}

/// A cold-start profile of `program`'s sizes alone (every time 1 ms, a parameter-free layer's
/// load 0), for plans chosen by hand ([`plan_given`](crate::plan::deepplan::plan_given)).
pub fn sizes_profile(
    program: &dyn LayerProgram,
    name: &str,
) -> crate::error::Result<crate::plan::deepplan::ColdProfile> {
    let layers = (0..program.layers())
        .map(|i| {
            let bytes = std::mem::size_of_val(program.host_params(i)) as u64;
            crate::plan::deepplan::LayerCost {
                name: format!("{i}:{}", program.kind(i)),
                kind: program.kind(i).into(),
                bytes,
                load_ms: if bytes == 0 { 0.0 } else { 1.0 },
                exec_ms: 1.0,
                dha_ms: 1.0,
            }
        })
        .collect();
    crate::plan::deepplan::ColdProfile::new(name, layers)
}

impl LayerProgram for Sequential {
    fn layers(&self) -> usize {
        self.layers.len()
    }

    fn host_params(&self, i: usize) -> &[f32] {
        &self.params[i]
    }

    fn kind(&self, i: usize) -> &str {
        self.layers[i].kind()
    }

    fn run(&self, i: usize, p: &Params<'_>, x: &[f32], y: &mut Vec<f32>) {
        y.clear();
        match self.layers[i] {
            Layer::Embedding { rows, width } => {
                for &t in x {
                    // Token ids are checked by the caller; one that is not a row index
                    // (negative, fractional, NaN, ≥ rows) gives a row of zeros, never a read
                    // out of bounds.
                    if t >= 0.0 && t.fract() == 0.0 && (t as usize) < rows {
                        let r = t as usize;
                        y.extend_from_slice(p.read(r * width..(r + 1) * width));
                    } else {
                        y.extend(std::iter::repeat_n(0.0, width));
                    }
                }
            }
            Layer::Linear { inputs, outputs } => {
                let w = p.read(0..outputs * inputs);
                let b = p.read(outputs * inputs..outputs * inputs + outputs);
                for token in x.chunks_exact(inputs) {
                    for o in 0..outputs {
                        let row = &w[o * inputs..(o + 1) * inputs];
                        let dot: f32 = row.iter().zip(token).map(|(a, b)| a * b).sum();
                        y.push(dot + b[o]);
                    }
                }
            }
            Layer::LayerNorm { width } => {
                for token in x.chunks_exact(width) {
                    let g = p.read(0..width);
                    let b = p.read(width..2 * width);
                    let mean = token.iter().sum::<f32>() / width as f32;
                    let var = token.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / width as f32;
                    let inv = 1.0 / (var + 1e-5).sqrt();
                    y.extend(token.iter().enumerate().map(|(k, v)| (v - mean) * inv * g[k] + b[k]));
                }
            }
            Layer::Relu => y.extend(x.iter().map(|v| v.max(0.0))),
        }
    }
}
