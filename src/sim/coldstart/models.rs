//! The eight models of DeepPlan's evaluation as leaf layers in forward order, and their
//! cold-start profiles on the paper's V100 machine, synthesised from the layer shapes.
//!
//! A layer is a leaf module as PyTorch runs it (DeepPlan §1.1 of our spec; dropout skipped):
//! `Embedding`, `Linear` / `Conv1D` (GPT-2's), `LayerNorm`, `Conv2d`, `BatchNorm2d`, and the
//! parameter-free work between them (`ReLU`, pooling, GELU, the attention arithmetic of a
//! self-attention block, `Tanh`), which executes but loads nothing. Shapes follow torchvision
//! (ResNet-50/101 at 224²) and Hugging Face (BERT-Base/Large and RoBERTa-Base/Large at 384
//! tokens, GPT-2 / GPT-2 Medium at 1,024), so BERT-Base comes to 417.6 MiB of parameters with
//! an 89.42 MiB word embedding (the paper's 417 MB and 89.42 MB).
//!
//! **The V100 profile** ([`V100`]), per layer, from its bytes `B`, FLOPs `F`, activation bytes
//! `A` and bus reads under DHA `R`:
//!
//! * `load = copy_ms + B / h2d_gbps` (a fixed cost per copy, then the bus);
//! * `InMem = launch_ms + max(F / flops, A / hbm_gbps)`;
//! * `DHA = launch_ms + max(F / flops, A / hbm_gbps, R / zero_copy_gbps)`: the kernel runs as
//!   in memory, but its parameter reads cross the bus. `R` is what the paper's Table 1 counts:
//!   an embedding reads its `T` looked-up rows (`T·row` bytes, not the table); a convolution
//!   re-reads its weights ≈ 1.8×, a fully connected layer ≈ 12× (per 16-token tile of its
//!   input); LayerNorm reads its two vectors per token; BatchNorm its four per output channel
//!   plane, which the cache serves (≈ 1×).
//!
//! The constants are fitted to the paper's anchors, not measured here: the 15.75 GB/s PCIe 3.0
//! link delivers 11.5 GB/s to pinned copies (Table 2's serial 10.9–11.5 GB/s once per-copy costs
//! are counted), BERT-Base loads in 40 ms and runs warm in 9.35 ms (§3). They are simulated
//! figures: DESIGN's check of the simulator against a real runtime applies to them (ARCHITECTURE
//! §8.7 says which figures were checked where).

use crate::plan::deepplan::{ColdProfile, LayerCost};

/// A layer's shape as the cost synthesis needs it.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub name: String,
    pub kind: &'static str,
    /// Parameter bytes (fp32).
    pub bytes: u64,
    /// Floating-point operations of one run at batch 1.
    pub flops: f64,
    /// Activation bytes read and written in device memory.
    pub act_bytes: f64,
    /// Parameter bytes read over the bus when run by direct host access.
    pub dha_read_bytes: f64,
}

/// The eight models.
pub const MODELS: &[&str] = &[
    "resnet50",
    "resnet101",
    "bert-base",
    "bert-large",
    "roberta-base",
    "roberta-large",
    "gpt2",
    "gpt2-medium",
];

/// The layers of a model of [`MODELS`]; `None` for another name.
pub fn layers(model: &str) -> Option<Vec<Layer>> {
    Some(match model {
        "resnet50" => resnet(&[3, 4, 6, 3]),
        "resnet101" => resnet(&[3, 4, 23, 3]),
        "bert-base" => transformer(&Encoder::bert(768, 12, 30522, 512, 2)),
        "bert-large" => transformer(&Encoder::bert(1024, 24, 30522, 512, 2)),
        "roberta-base" => transformer(&Encoder::bert(768, 12, 50265, 514, 1)),
        "roberta-large" => transformer(&Encoder::bert(1024, 24, 50265, 514, 1)),
        "gpt2" => transformer(&Encoder::gpt2(768, 12)),
        "gpt2-medium" => transformer(&Encoder::gpt2(1024, 24)),
        _ => return None,
    })
}

const F32: u64 = 4;

fn param(name: String, kind: &'static str, params: u64, flops: f64, act: f64, reads: f64) -> Layer {
    Layer { name, kind, bytes: params * F32, flops, act_bytes: act, dha_read_bytes: reads }
}

fn free(name: String, kind: &'static str, flops: f64, act: f64) -> Layer {
    Layer { name, kind, bytes: 0, flops, act_bytes: act, dha_read_bytes: 0.0 }
}

/// Re-reads of a convolution's weights under DHA (Table 1: 65,891 lines for 2.25 MB ≈ 1.8×).
const CONV_REREAD: f64 = 1.8;
/// Re-reads of a fully connected layer's weights under DHA (Table 1: 446,276 lines for 2.25 MB
/// ≈ 12.7×; 12 for a 16-token tile).
const FC_REREAD: f64 = 12.0;

/// torchvision ResNet with bottleneck blocks at 224×224, batch 1.
fn resnet(blocks: &[usize; 4]) -> Vec<Layer> {
    let mut v = vec![];
    let mut side = 112usize; // after conv1 (stride 2)
    let conv = |v: &mut Vec<Layer>, name: String, cin: usize, cout: usize, k: usize, out_side: usize| {
        let params = (cin * cout * k * k) as u64;
        let flops = 2.0 * (cin * cout * k * k) as f64 * (out_side * out_side) as f64;
        let act = 4.0 * ((cin + cout) * out_side * out_side) as f64;
        v.push(param(name, "Conv2d", params, flops, act, CONV_REREAD * (params * F32) as f64));
    };
    let bn = |v: &mut Vec<Layer>, name: String, c: usize, s: usize| {
        let act = 8.0 * (c * s * s) as f64;
        v.push(param(name, "BatchNorm2d", 4 * c as u64, 2.0 * (c * s * s) as f64, act, 16.0 * c as f64));
    };
    let relu = |v: &mut Vec<Layer>, name: String, c: usize, s: usize| {
        v.push(free(name, "ReLU", (c * s * s) as f64, 8.0 * (c * s * s) as f64));
    };
    conv(&mut v, "conv1".into(), 3, 64, 7, side);
    bn(&mut v, "bn1".into(), 64, side);
    relu(&mut v, "relu".into(), 64, side);
    side = 56;
    v.push(free(
        "maxpool".into(),
        "MaxPool2d",
        9.0 * (64 * side * side) as f64,
        4.0 * 5.0 * (64 * side * side) as f64,
    ));
    let mut cin = 64usize;
    for (stage, &n) in blocks.iter().enumerate() {
        let width = 64usize << stage;
        let cout = width * 4;
        for b in 0..n {
            let p = format!("layer{}.{b}", stage + 1);
            let stride = if b == 0 && stage > 0 { 2 } else { 1 };
            let out = side / stride;
            conv(&mut v, format!("{p}.conv1"), cin, width, 1, side);
            bn(&mut v, format!("{p}.bn1"), width, side);
            relu(&mut v, format!("{p}.relu1"), width, side);
            conv(&mut v, format!("{p}.conv2"), width, width, 3, out);
            bn(&mut v, format!("{p}.bn2"), width, out);
            relu(&mut v, format!("{p}.relu2"), width, out);
            conv(&mut v, format!("{p}.conv3"), width, cout, 1, out);
            bn(&mut v, format!("{p}.bn3"), cout, out);
            if b == 0 {
                conv(&mut v, format!("{p}.downsample.0"), cin, cout, 1, out);
                bn(&mut v, format!("{p}.downsample.1"), cout, out);
            }
            relu(&mut v, format!("{p}.relu3"), cout, out);
            side = out;
            cin = cout;
        }
    }
    v.push(free(
        "avgpool".into(),
        "AdaptiveAvgPool2d",
        (cin * side * side) as f64,
        4.0 * (cin * side * side) as f64,
    ));
    let fc_params = (2048 * 1000 + 1000) as u64;
    v.push(param(
        "fc".into(),
        "Linear",
        fc_params,
        2.0 * 2048.0 * 1000.0,
        4.0 * 3048.0,
        (fc_params * F32) as f64,
    ));
    v
}

/// A transformer encoder (BERT, RoBERTa) or decoder stack (GPT-2).
struct Encoder {
    hidden: usize,
    layers: usize,
    vocab: usize,
    positions: usize,
    /// Token-type embeddings (BERT 2, RoBERTa 1, GPT-2 none).
    types: usize,
    tokens: usize,
    gpt: bool,
}

impl Encoder {
    fn bert(hidden: usize, layers: usize, vocab: usize, positions: usize, types: usize) -> Encoder {
        Encoder { hidden, layers, vocab, positions, types, tokens: 384, gpt: false }
    }

    fn gpt2(hidden: usize, layers: usize) -> Encoder {
        Encoder { hidden, layers, vocab: 50257, positions: 1024, types: 0, tokens: 1024, gpt: true }
    }
}

fn transformer(e: &Encoder) -> Vec<Layer> {
    let (h, t) = (e.hidden, e.tokens);
    let tf = t as f64;
    let mut v = vec![];
    let embedding = |v: &mut Vec<Layer>, name: &str, rows: usize| {
        let reads = (t.min(rows) * h * 4) as f64; // the looked-up rows
        v.push(param(name.into(), "Embedding", (rows * h) as u64, 0.0, 8.0 * tf * h as f64, reads));
    };
    let linear = |v: &mut Vec<Layer>, name: String, kind: &'static str, i: usize, o: usize| {
        let params = (i * o + o) as u64;
        let act = 4.0 * tf * (i + o) as f64;
        v.push(param(name, kind, params, 2.0 * tf * (i * o) as f64, act, FC_REREAD * (params * F32) as f64));
    };
    let norm = |v: &mut Vec<Layer>, name: String| {
        v.push(param(
            name,
            "LayerNorm",
            2 * h as u64,
            8.0 * tf * h as f64,
            8.0 * tf * h as f64,
            8.0 * tf * h as f64,
        ));
    };
    // Attention arithmetic (scores, softmax, weighted sum) between the projections.
    let attention = |v: &mut Vec<Layer>, name: String| {
        let flops = 4.0 * tf * tf * h as f64 + 5.0 * tf * tf * (h / 64) as f64;
        let act = 4.0 * (3.0 * tf * h as f64 + 2.0 * tf * tf * (h / 64) as f64);
        v.push(free(name, "Attention", flops, act));
    };
    let gelu = |v: &mut Vec<Layer>, name: String| {
        v.push(free(name, "GELU", 8.0 * tf * (4 * h) as f64, 8.0 * tf * (4 * h) as f64));
    };
    if e.gpt {
        embedding(&mut v, "wte", e.vocab);
        embedding(&mut v, "wpe", e.positions);
        for l in 0..e.layers {
            let p = format!("h.{l}");
            norm(&mut v, format!("{p}.ln_1"));
            linear(&mut v, format!("{p}.attn.c_attn"), "Conv1D", h, 3 * h);
            attention(&mut v, format!("{p}.attn"));
            linear(&mut v, format!("{p}.attn.c_proj"), "Conv1D", h, h);
            norm(&mut v, format!("{p}.ln_2"));
            linear(&mut v, format!("{p}.mlp.c_fc"), "Conv1D", h, 4 * h);
            gelu(&mut v, format!("{p}.mlp.act"));
            linear(&mut v, format!("{p}.mlp.c_proj"), "Conv1D", 4 * h, h);
        }
        norm(&mut v, "ln_f".into());
    } else {
        embedding(&mut v, "embeddings.word_embeddings", e.vocab);
        embedding(&mut v, "embeddings.position_embeddings", e.positions);
        embedding(&mut v, "embeddings.token_type_embeddings", e.types);
        norm(&mut v, "embeddings.LayerNorm".into());
        for l in 0..e.layers {
            let p = format!("encoder.layer.{l}");
            for proj in ["query", "key", "value"] {
                linear(&mut v, format!("{p}.attention.self.{proj}"), "Linear", h, h);
            }
            attention(&mut v, format!("{p}.attention.self"));
            linear(&mut v, format!("{p}.attention.output.dense"), "Linear", h, h);
            norm(&mut v, format!("{p}.attention.output.LayerNorm"));
            linear(&mut v, format!("{p}.intermediate.dense"), "Linear", h, 4 * h);
            gelu(&mut v, format!("{p}.intermediate.intermediate_act_fn"));
            linear(&mut v, format!("{p}.output.dense"), "Linear", 4 * h, h);
            norm(&mut v, format!("{p}.output.LayerNorm"));
        }
        // The pooler reads the first token only.
        let params = (h * h + h) as u64;
        v.push(param(
            "pooler.dense".into(),
            "Linear",
            params,
            2.0 * (h * h) as f64,
            8.0 * h as f64,
            (params * F32) as f64,
        ));
        v.push(free("pooler.activation".into(), "Tanh", h as f64, 8.0 * h as f64));
    }
    v
}

/// A GPU's costs for the profile synthesis (module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gpu {
    /// Fixed cost of one host → device copy, ms.
    pub copy_ms: f64,
    /// Pinned host → device copy bandwidth, GB/s.
    pub h2d_gbps: f64,
    /// Kernel launch and tail per layer, ms.
    pub launch_ms: f64,
    /// Sustained fp32 FLOP/s of the layers' kernels.
    pub flops: f64,
    /// Device memory bandwidth, GB/s.
    pub hbm_gbps: f64,
    /// Bandwidth of streaming kernel reads from mapped host memory (an embedding's rows, a
    /// norm's vectors), GB/s.
    pub zero_copy_gbps: f64,
    /// Bandwidth of the tiled, re-reading weight loads of convolution and GEMM kernels from
    /// mapped host memory, GB/s: few bytes in flight per request against the bus latency.
    pub zero_copy_tiled_gbps: f64,
    /// Sustained FLOP/s of convolutions at batch 1 (cuDNN's small-image kernels).
    pub conv_flops: f64,
}

/// The paper's V100-16GB on PCIe 3.0 (the constants are fitted; module docs).
pub const V100: Gpu = Gpu {
    copy_ms: 0.02,
    h2d_gbps: 11.5,
    launch_ms: 0.02,
    flops: 10.0e12,
    hbm_gbps: 750.0,
    zero_copy_gbps: 11.0,
    zero_copy_tiled_gbps: 5.0,
    conv_flops: 4.5e12,
};

impl Gpu {
    /// The cost of one layer.
    pub fn cost(&self, l: &Layer) -> LayerCost {
        let ms = |bytes: f64, gbps: f64| bytes / (gbps * 1e6);
        let tiled = matches!(l.kind, "Conv2d" | "Linear" | "Conv1D");
        let rate = if l.kind == "Conv2d" { self.conv_flops } else { self.flops };
        let compute = (l.flops / rate * 1e3).max(ms(l.act_bytes, self.hbm_gbps));
        let exec_ms = self.launch_ms + compute;
        let (load_ms, dha_ms) = if l.bytes == 0 {
            (0.0, exec_ms)
        } else {
            let load = self.copy_ms + ms(l.bytes as f64, self.h2d_gbps);
            let zero_copy = if tiled { self.zero_copy_tiled_gbps } else { self.zero_copy_gbps };
            (load, self.launch_ms + compute.max(ms(l.dha_read_bytes, zero_copy)))
        };
        LayerCost { name: l.name.clone(), kind: l.kind.to_string(), bytes: l.bytes, load_ms, exec_ms, dha_ms }
    }

    /// The cold-start profile of a model of [`MODELS`].
    pub fn profile(&self, model: &str) -> Option<ColdProfile> {
        let layers = layers(model)?.iter().map(|l| self.cost(l)).collect();
        Some(ColdProfile::new(model, layers).expect("synthesised profiles are within bounds"))
    }
}

/// The shipped V100 profile of a model as `deepplan-v100-<model>` names it, e.g.
/// `deepplan-v100-bert-base`.
pub fn builtin_profile(name: &str) -> Option<ColdProfile> {
    V100.profile(name.strip_prefix("deepplan-v100-")?)
}
