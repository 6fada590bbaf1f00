//! Model formats: a directory with `model.toml` and `weights.safetensors` (fp32, PyTorch
//! `state_dict` names). See DESIGN §6.

pub mod mlp;
pub mod weights;

use std::ffi::CStr;
use std::fmt;
use std::path::Path;

use crate::error::{Code, Error, Result};

pub use mlp::Mlp;

pub const CONFIG_FILE: &str = "model.toml";
pub const WEIGHTS_FILE: &str = "weights.safetensors";

/// The model kinds of DESIGN §6.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModelKind {
    Mlp,
    Lstm,
    Seq2Seq,
    TreeLstm,
}

impl ModelKind {
    pub const ALL: [ModelKind; 4] =
        [ModelKind::Mlp, ModelKind::Lstm, ModelKind::Seq2Seq, ModelKind::TreeLstm];

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
    /// A dense vector (`mlp`, custom fixed-shape models).
    F32(Vec<f32>),
    /// A token sequence (`lstm`, `seq2seq`).
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
}

impl Network {
    pub fn kind(&self) -> ModelKind {
        match self {
            Network::Mlp(_) => ModelKind::Mlp,
        }
    }

    /// Check the network's own consistency (for networks built in code rather than loaded).
    pub fn check(&self) -> Result<()> {
        match self {
            Network::Mlp(m) => m.check(),
        }
    }

    /// Check a request's input against the model; the error says what is wrong and where.
    pub fn validate(&self, input: &Input) -> Result<()> {
        match (self, input) {
            (Network::Mlp(m), Input::F32(v)) if v.len() == m.input_len() => Ok(()),
            (Network::Mlp(m), Input::F32(v)) if v.is_empty() => Err(Error::invalid(format!(
                "empty input; this mlp takes an f32 vector of length {}",
                m.input_len()
            ))),
            (Network::Mlp(m), Input::F32(v)) => Err(Error::invalid(format!(
                "input has length {}; this mlp takes an f32 vector of length {}",
                v.len(),
                m.input_len()
            ))),
            (Network::Mlp(m), other) => Err(Error::invalid(format!(
                "input is {}; an mlp takes an f32 vector of length {}",
                other.describe(),
                m.input_len()
            ))),
        }
    }
}

/// Load a model directory: `model.toml` says the kind, `weights.safetensors` holds the tensors.
pub fn load(dir: &Path) -> Result<Network> {
    if !dir.is_dir() {
        let what = if dir.exists() { "is not a directory" } else { "does not exist" };
        let code = if dir.exists() { Code::InvalidArgument } else { Code::NotFound };
        return Err(Error::new(code, format!("model directory {} {what}", dir.display())));
    }
    let toml_path = dir.join(CONFIG_FILE);
    let text = String::from_utf8(weights::read_file(&toml_path)?)
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
    let weights_path = dir.join(WEIGHTS_FILE);
    match kind {
        ModelKind::Mlp => {
            let cfg: mlp::MlpConfig = table
                .try_into()
                .map_err(|e| Error::format(format!("{}: {}", toml_path.display(), e.message())))?;
            let w = weights::Weights::load(&weights_path)?;
            Ok(Network::Mlp(Mlp::from_weights(&cfg, &toml_path, w)?))
        }
        other => Err(Error::new(
            Code::Unsupported,
            format!("{}: model kind `{other}` is not supported by this build yet", toml_path.display()),
        )),
    }
}

/// Create `dir` (and parents) and write its `model.toml`.
pub(crate) fn create_model_dir(dir: &Path, toml: &str) -> Result<()> {
    let io = |e: std::io::Error| Error::new(Code::Io, format!("{}: {e}", dir.display()));
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join(CONFIG_FILE), toml).map_err(io)
}
