//! Model formats: a directory with `model.toml` and `weights.safetensors` (fp32, PyTorch
//! `state_dict` names). See ARCHITECTURE.md §6.
//!
//! Every size a model directory declares is bounded before anything is allocated from it: the
//! files are opened and checked to be regular files within their size limits before they are read
//! (a FIFO, a device, a directory or a symlink loop is INVALID_ARGUMENT), and every model.toml key
//! and tensor dimension is checked against the documented [`limits`] (FORMAT naming the key).

pub mod bert;
pub mod custom;
pub(crate) mod file;
pub mod limits;
pub mod lstm;
pub mod mlp;
pub mod resnet;
pub mod seq2seq;
pub mod treelstm;
pub mod weights;

use std::ffi::CStr;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use crate::error::{Code, Error, Result};
use crate::sched::{CellGraph, CellType};

pub use bert::Bert;
pub use custom::{CustomCall, CustomExecute, CustomModel};
pub use lstm::Lstm;
pub use mlp::Mlp;
pub use resnet::ResNet;
pub use seq2seq::Seq2Seq;
pub use treelstm::{NO_TOKEN, TreeLstm};

pub const CONFIG_FILE: &str = "model.toml";
pub const WEIGHTS_FILE: &str = "weights.safetensors";

/// The model kinds of ARCHITECTURE.md §6.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    Mlp,
    Lstm,
    Seq2Seq,
    TreeLstm,
    ResNet,
    Bert,
    /// A model registered through the API with the caller's own computation.
    Custom,
}

impl ModelKind {
    pub const ALL: [ModelKind; 7] = [
        ModelKind::Mlp,
        ModelKind::Lstm,
        ModelKind::Seq2Seq,
        ModelKind::TreeLstm,
        ModelKind::ResNet,
        ModelKind::Bert,
        ModelKind::Custom,
    ];

    pub fn name(self) -> &'static str {
        self.c_name().to_str().expect("kind names are ASCII")
    }

    /// [`name`](Self::name) as a NUL-terminated string with static storage (for the C ABI).
    pub fn c_name(self) -> &'static CStr {
        match self {
            ModelKind::Mlp => c"mlp",
            ModelKind::Lstm => c"lstm",
            ModelKind::Seq2Seq => c"seq2seq",
            ModelKind::TreeLstm => c"treelstm",
            ModelKind::ResNet => c"resnet",
            ModelKind::Bert => c"bert",
            ModelKind::Custom => c"custom",
        }
    }

    pub fn parse(s: &str) -> Option<ModelKind> {
        ModelKind::ALL.into_iter().find(|k| k.name() == s)
    }
}

impl fmt::Display for ModelKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A request's input.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A dense vector (`mlp`, custom fixed-shape models). Every element must be finite: NaN or
    /// ±infinity is refused at submit with `INVALID_ARGUMENT` naming the first such element
    /// (a ReLU would otherwise turn NaN into a plausible 0).
    F32(Vec<f32>),
    /// A token sequence (`lstm`, `seq2seq`, `bert`).
    Tokens(Vec<u32>),
    /// A tree: `tokens[i]` with parent `parents[i]` (−1 for the root) (`treelstm`).
    Tree { tokens: Vec<u32>, parents: Vec<i32> },
}

impl Input {
    /// What kind of input this is, for error messages.
    pub fn describe(&self) -> String {
        match self {
            Input::F32(v) => format!("an f32 vector of length {}", v.len()),
            Input::Tokens(t) => format!("a token sequence of length {}", t.len()),
            Input::Tree { tokens, .. } => format!("a tree of {} nodes", tokens.len()),
        }
    }
}

/// A request's output.
#[derive(Clone, Debug, PartialEq)]
pub enum Output {
    F32(Vec<f32>),
    Tokens(Vec<u32>),
}

/// A model loaded from a directory, on no backend yet.
#[derive(Clone, Debug, PartialEq)]
pub enum Network {
    Mlp(Mlp),
    Lstm(Lstm),
    Seq2Seq(Seq2Seq),
    TreeLstm(TreeLstm),
    ResNet(ResNet),
    Bert(Bert),
    Custom(CustomModel),
}

/// One layer of a layer model (`mlp`, `resnet`, `bert`): the unit a layer-granular backend runs
/// (`[first, last)` ranges), VELTAIR schedules and DeepPlan loads.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerInfo {
    /// The `state_dict` prefix it covers (`layer1.0`, `encoder.layer.3`, `layers.2`, …).
    pub name: String,
    pub kind: &'static str,
    /// Bytes of its weights (fp32) as a backend holds them.
    pub weight_bytes: u64,
    /// Floating-point operations (2 per multiply-add) for one row (one request).
    pub flops_per_row: u64,
    /// Values per row of its output: the next layer's input.
    pub out_len: usize,
}

impl LayerInfo {
    pub fn new(
        name: &str,
        kind: &'static str,
        weight_bytes: u64,
        flops_per_row: u64,
        out_len: usize,
    ) -> LayerInfo {
        LayerInfo { name: name.to_string(), kind, weight_bytes, flops_per_row, out_len }
    }
}

/// A cell type of a recurrent model, as the schedulers see it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CellTypeInfo {
    pub name: &'static str,
    /// ChooseCellType's tie-break: decoder over encoder, internal over leaf.
    pub priority: i32,
}

/// `lstm`: one cell type, a step through every layer.
pub const LSTM_STEP: CellType = 0;
/// `seq2seq`: encoder and decoder steps.
pub const ENCODER: CellType = 0;
pub const DECODER: CellType = 1;
/// `treelstm`: leaves and internal nodes.
pub const LEAF: CellType = 0;
pub const INTERNAL: CellType = 1;

impl Network {
    pub fn kind(&self) -> ModelKind {
        match self {
            Network::Mlp(_) => ModelKind::Mlp,
            Network::Lstm(_) => ModelKind::Lstm,
            Network::Seq2Seq(_) => ModelKind::Seq2Seq,
            Network::TreeLstm(_) => ModelKind::TreeLstm,
            Network::ResNet(_) => ModelKind::ResNet,
            Network::Bert(_) => ModelKind::Bert,
            Network::Custom(_) => ModelKind::Custom,
        }
    }

    /// Check the network's own consistency (for networks built in code rather than loaded).
    pub fn check(&self) -> Result<()> {
        match self {
            Network::Mlp(m) => m.check(),
            Network::Lstm(m) => m.check(),
            Network::Seq2Seq(m) => m.check(),
            Network::TreeLstm(m) => m.check(),
            Network::ResNet(m) => m.check(),
            Network::Bert(m) => m.check(),
            Network::Custom(m) => m.check(),
        }
    }

    /// Where a recurrent request's state slot keeps the Seq2Seq decoder's last token: after every
    /// layer's `h` and `c` (a tree node's `h` and `c`). 0 for a fixed-shape model.
    pub fn token_word(&self) -> usize {
        match self {
            Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => 0,
            Network::Lstm(m) => m.cfg.layers * 2 * m.cfg.hidden,
            Network::Seq2Seq(m) => m.cfg.layers * 2 * m.cfg.hidden,
            Network::TreeLstm(m) => 2 * m.cfg.hidden,
        }
    }

    /// Words (f32, or the token's u32) of one state slot, the layout every backend's arena uses:
    /// the `h` and `c` words, then for Seq2Seq the token word ([`Network::token_word`]).
    pub fn state_width(&self) -> usize {
        self.token_word() + usize::from(matches!(self, Network::Seq2Seq(_)))
    }

    /// The cell types of a recurrent model, indexed by [`CellType`]; empty for fixed-shape models.
    pub fn cell_types(&self) -> &'static [CellTypeInfo] {
        match self {
            Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => &[],
            Network::Lstm(_) => &[CellTypeInfo { name: "step", priority: 0 }],
            Network::Seq2Seq(_) => &[
                CellTypeInfo { name: "encoder", priority: 0 },
                CellTypeInfo { name: "decoder", priority: 1 },
            ],
            Network::TreeLstm(_) => {
                &[CellTypeInfo { name: "leaf", priority: 0 }, CellTypeInfo { name: "internal", priority: 1 }]
            }
        }
    }

    /// Whether requests are unfolded into cells (lstm, seq2seq, treelstm).
    pub fn is_recurrent(&self) -> bool {
        !self.cell_types().is_empty()
    }

    /// Hidden size of a recurrent model (0 for a fixed-shape model).
    pub fn hidden(&self) -> usize {
        match self {
            Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_) => 0,
            Network::Lstm(m) => m.cfg.hidden,
            Network::Seq2Seq(m) => m.cfg.hidden,
            Network::TreeLstm(m) => m.cfg.hidden,
        }
    }

    /// The most elements an input of this model may have: an mlp's or resnet's input length
    /// (exactly that many), the most tokens of an lstm, seq2seq or bert sequence, the most nodes
    /// of a treelstm tree. Callers that copy an input from outside (the C ABI) check its length
    /// against this before touching it.
    pub fn max_input_len(&self) -> usize {
        match self {
            Network::Mlp(m) => m.input_len(),
            Network::ResNet(m) => m.input_len(),
            Network::Bert(m) => m.cfg.seq_len,
            Network::Custom(m) => m.input_len,
            Network::Lstm(m) => m.max_len(),
            Network::Seq2Seq(m) => m.max_len(),
            Network::TreeLstm(m) => m.max_nodes(),
        }
    }

    /// Check a request's input against the model; the error says what is wrong and where.
    /// f32 inputs must be finite (see [`Input::F32`]).
    pub fn validate(&self, input: &Input) -> Result<()> {
        match (self, input) {
            (Network::Mlp(m), Input::F32(v)) if v.len() == m.input_len() => check_finite(v),
            (Network::Mlp(m), Input::F32(v)) if v.is_empty() => Err(Error::invalid(format!(
                "empty input; this mlp takes an f32 vector of length {}",
                m.input_len()
            ))),
            (Network::Mlp(m), Input::F32(v)) => Err(Error::invalid(format!(
                "input has length {}; this mlp takes an f32 vector of length {}",
                v.len(),
                m.input_len()
            ))),
            (Network::ResNet(m), Input::F32(v)) if v.len() == m.input_len() => check_finite(v),
            (Network::ResNet(m), Input::F32(v)) => Err(Error::invalid(format!(
                "input has length {}; this resnet takes an image of {:?} (C × H × W) = {} values",
                v.len(),
                m.cfg.image,
                m.input_len()
            ))),
            (Network::Bert(m), Input::Tokens(t)) => check_tokens(t, m.cfg.vocab, m.cfg.seq_len, "bert"),
            (Network::Custom(m), Input::F32(v)) if v.len() == m.input_len => check_finite(v),
            (Network::Custom(m), Input::F32(v)) => Err(Error::invalid(format!(
                "input has length {}; this custom model takes an f32 vector of length {}",
                v.len(),
                m.input_len
            ))),
            (Network::Lstm(m), Input::Tokens(t)) => m.validate(t),
            (Network::Seq2Seq(m), Input::Tokens(t)) => m.validate(t),
            (Network::TreeLstm(m), Input::Tree { tokens, parents }) => {
                m.validate(tokens, parents).map(|_| ())
            }
            (net, other) => {
                let want = match net {
                    Network::Mlp(m) => format!("an f32 vector of length {}", m.input_len()),
                    Network::ResNet(m) => format!("an f32 image of {} values", m.input_len()),
                    Network::Custom(m) => format!("an f32 vector of length {}", m.input_len),
                    Network::Lstm(_) | Network::Seq2Seq(_) | Network::Bert(_) => {
                        "a token sequence".to_string()
                    }
                    Network::TreeLstm(_) => "a tree (tokens and parents)".to_string(),
                };
                Err(Error::invalid(format!(
                    "input is {}; a {} model takes {want}",
                    other.describe(),
                    net.kind()
                )))
            }
        }
    }

    /// Validate a request (as [`Network::validate`]) and unfold it into its cell graph
    /// (BatchMaker §4.2); `None` for fixed-shape models. Node numbering: lstm — step t; seq2seq —
    /// encoder step t, then decoder step j at `len + j`; treelstm — the request's own node indices.
    pub fn unfold(&self, input: &Input) -> Result<Option<Arc<CellGraph>>> {
        let g = match (self, input) {
            (Network::Lstm(m), Input::Tokens(t)) => {
                m.validate(t)?;
                CellGraph::chains(&[(LSTM_STEP, t.len())])?
            }
            (Network::Seq2Seq(m), Input::Tokens(t)) => {
                m.validate(t)?;
                CellGraph::chains(&[(ENCODER, t.len()), (DECODER, m.cfg.max_decode)])?
            }
            (Network::TreeLstm(m), Input::Tree { tokens, parents }) => {
                let tree = m.validate(tokens, parents)?;
                CellGraph::tree(&tree.children, LEAF, INTERNAL)?
            }
            (Network::Mlp(_) | Network::ResNet(_) | Network::Bert(_) | Network::Custom(_), _) => {
                self.validate(input)?;
                return Ok(None);
            }
            _ => {
                self.validate(input)?;
                return Err(Error::internal("unfold of an input the model does not take"));
            }
        };
        Ok(Some(Arc::new(g)))
    }

    /// The layers of a layer model (`mlp`, `resnet`, `bert`) in order; empty for a recurrent one.
    pub fn layers(&self) -> Vec<LayerInfo> {
        match self {
            Network::Mlp(m) => m.layer_infos(),
            Network::ResNet(m) => m.layers(),
            Network::Bert(m) => m.layers(),
            Network::Custom(m) => m.layers.clone(),
            Network::Lstm(_) | Network::Seq2Seq(_) | Network::TreeLstm(_) => Vec::new(),
        }
    }

    /// Values per row entering each layer of a layer model and leaving its last: `layers().len()
    /// + 1` lengths, the first a whole-model task's input row ([`Network::dense_lens`]), the last
    /// the output. What a `Work::Layers { first, last, .. }` task carries in and gives out per
    /// row: `bounds[first]` and `bounds[last]`. Empty for a model without layers.
    pub fn layer_bounds(&self) -> Vec<usize> {
        let layers = self.layers();
        if layers.is_empty() {
            return Vec::new();
        }
        std::iter::once(self.dense_lens().0).chain(layers.iter().map(|l| l.out_len)).collect()
    }

    /// Values per row of a fixed-shape model's task input ([`Network::dense_row`]) and output;
    /// (0, 0) for a recurrent model.
    pub fn dense_lens(&self) -> (usize, usize) {
        match self {
            Network::Mlp(m) => (m.input_len(), m.output_len()),
            Network::ResNet(m) => (m.input_len(), m.output_len()),
            Network::Bert(m) => (m.cfg.seq_len, m.cfg.hidden),
            Network::Custom(m) => (m.input_len, m.output_len),
            Network::Lstm(_) | Network::Seq2Seq(_) | Network::TreeLstm(_) => (0, 0),
        }
    }

    /// The value of every element of a padding row of a fixed-shape task (a row no request
    /// occupies): 0, or for `bert` −1 (no tokens, so the row costs nothing).
    pub fn dense_padding(&self) -> f32 {
        if let Network::Bert(_) = self { -1.0 } else { 0.0 }
    }

    /// Write a validated request's input into its row of a fixed-shape task (`dense_lens().0`
    /// values): the f32 vector itself, or for `bert` the token ids as f32 (exact: ids are below
    /// 2^22) followed by −1 for every position past the request's length.
    pub fn dense_row(&self, input: &Input, row: &mut [f32]) {
        match input {
            Input::F32(v) => row[..v.len()].copy_from_slice(v),
            Input::Tokens(t) => {
                for (i, r) in row.iter_mut().enumerate() {
                    *r = t.get(i).map_or(-1.0, |&id| id as f32);
                }
            }
            Input::Tree { .. } => {}
        }
    }

    /// Write the network as a model directory (`model.toml` + `weights.safetensors`).
    pub fn save(&self, dir: &Path) -> Result<()> {
        let (toml, tensors) = match self {
            Network::Mlp(m) => return m.save(dir),
            Network::ResNet(m) => return m.save(dir),
            Network::Bert(m) => return m.save(dir),
            Network::Custom(_) => {
                return Err(Error::new(
                    Code::Unsupported,
                    "a custom model's computation is the caller's: it cannot be saved as a model directory",
                ));
            }
            Network::Lstm(m) => (m.toml(), m.tensors()),
            Network::Seq2Seq(m) => (m.toml(), m.tensors()),
            Network::TreeLstm(m) => (m.toml(), m.tensors()),
        };
        create_model_dir(dir, &toml)?;
        let refs: Vec<(&str, &weights::Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
        weights::write_safetensors(&dir.join(WEIGHTS_FILE), &refs)
    }
}

/// An inconsistent network built in code.
pub(crate) fn config_error(what: &str) -> Error {
    Error::invalid(what.to_string())
}

/// Every element of an f32 input is finite; the error names the first that is not.
fn check_finite(v: &[f32]) -> Result<()> {
    // One branch-free pass over the whole input, which vectorises (an exponent of all ones is
    // ±inf or NaN); the element is looked for only once one is known to be bad.
    const EXP: u32 = 0x7f80_0000;
    if !v.iter().fold(false, |bad, x| bad | (x.to_bits() & EXP == EXP)) {
        return Ok(());
    }
    let i = v.iter().position(|x| !x.is_finite()).unwrap_or(0);
    Err(Error::invalid(format!("input element {i} is {}; inputs must be finite", v[i])))
}

/// A token sequence: non-empty, not longer than `max_len`, every id below `vocab`.
pub(crate) fn check_tokens(tokens: &[u32], vocab: usize, max_len: usize, kind: &str) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::invalid(format!("empty token sequence; a {kind} model needs at least one token")));
    }
    if tokens.len() > max_len {
        return Err(Error::invalid(format!(
            "token sequence of length {} is longer than this model's maximum of {max_len}",
            tokens.len()
        )));
    }
    if let Some((i, &t)) = tokens.iter().enumerate().find(|&(_, &t)| t as usize >= vocab) {
        return Err(Error::invalid(format!(
            "token {t} at position {i} is outside the vocabulary (0..{vocab})"
        )));
    }
    Ok(())
}

/// Load a model directory: `model.toml` says the kind, `weights.safetensors` holds the tensors.
pub fn load(dir: &Path) -> Result<Network> {
    file::check_dir(dir)?;
    let toml_path = dir.join(CONFIG_FILE);
    let text = String::from_utf8(file::read_file(&toml_path, limits::MAX_CONFIG_BYTES)?)
        .map_err(|_| Error::format(format!("{}: not UTF-8", toml_path.display())))?;
    let mut table: toml::Table =
        text.parse().map_err(|e| Error::format(format!("{}: {e}", toml_path.display())))?;
    let kind = match table.remove("kind") {
        Some(toml::Value::String(s)) => s,
        Some(other) => {
            return Err(Error::format(format!(
                "{}: `kind` must be a string, found {}",
                toml_path.display(),
                other.type_str()
            )));
        }
        None => return Err(Error::format(format!("{}: missing key `kind`", toml_path.display()))),
    };
    let Some(kind) = ModelKind::parse(&kind) else {
        let known: Vec<&str> = ModelKind::ALL.iter().map(|k| k.name()).collect();
        return Err(Error::format(format!(
            "{}: unknown model kind `{kind}` (known: {})",
            toml_path.display(),
            known.join(", ")
        )));
    };
    // The keys are checked against their limits before the weights are read.
    let weights = || weights::Weights::load(&dir.join(WEIGHTS_FILE));
    Ok(match kind {
        ModelKind::Mlp => {
            let cfg: mlp::MlpConfig = parse_config(table, &toml_path)?;
            Network::Mlp(Mlp::from_weights(&cfg, &toml_path, weights()?)?)
        }
        ModelKind::Lstm => {
            let cfg: lstm::LstmConfig = parse_config(table, &toml_path)?;
            cfg.check(&toml_path)?;
            Network::Lstm(Lstm::from_weights(cfg, weights()?)?)
        }
        ModelKind::Seq2Seq => {
            let cfg: seq2seq::Seq2SeqConfig = parse_config(table, &toml_path)?;
            cfg.check(&toml_path)?;
            Network::Seq2Seq(Seq2Seq::from_weights(cfg, weights()?)?)
        }
        ModelKind::TreeLstm => {
            let cfg: treelstm::TreeLstmConfig = parse_config(table, &toml_path)?;
            cfg.check(&toml_path)?;
            Network::TreeLstm(TreeLstm::from_weights(cfg, weights()?)?)
        }
        ModelKind::ResNet => {
            let cfg: resnet::ResNetConfig = parse_config(table, &toml_path)?;
            cfg.check(&toml_path)?;
            Network::ResNet(ResNet::from_weights(&cfg, &toml_path, weights()?)?)
        }
        ModelKind::Bert => {
            let cfg: bert::BertConfig = parse_config(table, &toml_path)?;
            cfg.check(&toml_path)?;
            Network::Bert(Bert::from_weights(&cfg, &toml_path, weights()?)?)
        }
        ModelKind::Custom => {
            return Err(Error::format(format!(
                "{}: kind `custom` is registered through the API (serve_runtime_add_custom_model), \
                 not loaded from a directory",
                toml_path.display()
            )));
        }
    })
}

/// The rest of model.toml (after `kind`) as a model's config; unknown or missing keys are FORMAT.
fn parse_config<T: serde::de::DeserializeOwned>(table: toml::Table, toml_path: &Path) -> Result<T> {
    table
        .try_into()
        .map_err(|e: toml::de::Error| Error::format(format!("{}: {}", toml_path.display(), e.message())))
}

/// Create `dir` (and parents) and write its `model.toml`.
pub(crate) fn create_model_dir(dir: &Path, toml: &str) -> Result<()> {
    let io = |e: std::io::Error| Error::new(Code::Io, format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join(CONFIG_FILE), toml).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f32_inputs_must_be_finite_and_the_error_names_the_element() {
        let net = Network::Mlp(Mlp::random(&[4, 2], 1));
        assert!(net.validate(&Input::F32(vec![0.0, -1.0, 1e38, f32::MIN_POSITIVE])).is_ok());
        for (i, bad, name) in
            [(3, f32::NAN, "NaN"), (1, f32::INFINITY, "inf"), (0, f32::NEG_INFINITY, "-inf")]
        {
            let mut x = vec![0.5; 4];
            x[i] = bad;
            let e = net.validate(&Input::F32(x)).unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            assert_eq!(e.message(), format!("input element {i} is {name}; inputs must be finite"));
        }
    }

    #[test]
    fn max_input_len_is_what_validate_accepts() {
        let mlp = Network::Mlp(Mlp::random(&[5, 3], 1));
        assert_eq!(mlp.max_input_len(), 5);
        let lstm = Network::Lstm(Lstm::random(10, 4, 4, 1, 1));
        let n = lstm.max_input_len();
        assert!(lstm.validate(&Input::Tokens(vec![1; n])).is_ok());
        assert!(lstm.validate(&Input::Tokens(vec![1; n + 1])).is_err());
    }
}
