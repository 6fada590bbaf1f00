//! The cold-start profile DeepPlan plans from (DESIGN §8): per layer, in forward order, its
//! parameter bytes and three times measured on the target machine —
//!
//! * `load_ms`: host → device copy of its parameters from pinned memory (copies issued back to
//!   back on one stream, timed with events);
//! * `exec_ms`: execution with the parameters in device memory ("InMem");
//! * `dha_ms`: execution with the parameters in mapped pinned host memory, read over the bus by
//!   the kernel ("direct host access").
//!
//! ```json
//! {"model": "bert-base", "layers": [
//!   {"name": "embeddings.word_embeddings", "kind": "Embedding", "bytes": 93763584,
//!    "load_ms": 8.52, "exec_ms": 0.011, "dha_ms": 0.034}, …]}
//! ```
//!
//! A layer with `bytes == 0` is parameter-free (ReLU, pooling, attention arithmetic): it has
//! nothing to load (`load_ms` must be 0), always executes in its `exec_ms`, and its `dha_ms` is
//! ignored. Every time is finite, ≥ 0 and at most [`MAX_MS`]; a missing field, a negative or
//! non-finite time, more than [`MAX_LAYERS`] layers or a file over [`MAX_PROFILE_BYTES`] is a
//! FORMAT error naming the layer and the field.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Most layers of a cold-start profile (the largest models have a few thousand leaf layers;
/// Algorithm 1 costs `O(n² log n)` at worst, about a second here at this bound).
pub const MAX_LAYERS: usize = 10_000;
/// Largest profile file.
pub const MAX_PROFILE_BYTES: u64 = 64 << 20;
/// Largest time of one layer, ms (a day): sums over [`MAX_LAYERS`] layers stay exact enough.
pub const MAX_MS: f64 = 86_400_000.0;
/// Largest parameter size of one layer (1 TiB).
pub const MAX_LAYER_BYTES: u64 = 1 << 40;
/// Longest layer name or kind, bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// One layer of a [`ColdProfile`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerCost {
    pub name: String,
    /// The layer's type as the framework names it (`Embedding`, `Linear`, `LayerNorm`,
    /// `Conv2d`, `BatchNorm2d`, `ReLU`, …). The initial approach keys on it.
    pub kind: String,
    /// Parameter (and buffer) bytes; 0 for a parameter-free layer.
    pub bytes: u64,
    pub load_ms: f64,
    pub exec_ms: f64,
    pub dha_ms: f64,
}

impl LayerCost {
    /// Whether the layer has parameters to place (load or leave on the host).
    pub fn has_params(&self) -> bool {
        self.bytes > 0
    }

    /// `PerfDiff = DHA − InMem` (paper §4.1); negative where direct access is faster.
    pub fn perf_diff(&self) -> f64 {
        self.dha_ms - self.exec_ms
    }
}

/// A model's cold-start profile. Build with [`ColdProfile::new`] or [`ColdProfile::open`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColdProfile {
    pub model: String,
    pub layers: Vec<LayerCost>,
}

impl ColdProfile {
    /// A checked profile.
    pub fn new(model: impl Into<String>, layers: Vec<LayerCost>) -> Result<ColdProfile> {
        let p = ColdProfile { model: model.into(), layers };
        p.check()?;
        Ok(p)
    }

    /// Parse and check a profile's JSON.
    pub fn parse(json: &str) -> Result<ColdProfile> {
        let p: ColdProfile =
            serde_json::from_str(json).map_err(|e| Error::format(format!("cold-start profile: {e}")))?;
        p.check()?;
        Ok(p)
    }

    /// Read a profile file (at most [`MAX_PROFILE_BYTES`]).
    pub fn open(path: &Path) -> Result<ColdProfile> {
        let bytes = crate::model::file::read_file(path, MAX_PROFILE_BYTES)?;
        let text = String::from_utf8(bytes)
            .map_err(|_| Error::format(format!("cold-start profile {}: not UTF-8", path.display())))?;
        ColdProfile::parse(&text).map_err(|e| e.context(format!("{}", path.display())))
    }

    /// The profile as JSON (what [`parse`](Self::parse) reads).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a checked profile serialises")
    }

    /// Total parameter bytes.
    pub fn bytes(&self) -> u64 {
        self.layers.iter().map(|l| l.bytes).sum()
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::format(format!("cold-start profile `{}`: {what}", self.model)));
        if self.layers.is_empty() || self.layers.len() > MAX_LAYERS {
            return bad(format!("{} layers; 1 to {MAX_LAYERS} expected", self.layers.len()));
        }
        if self.model.len() > MAX_NAME_BYTES {
            return bad(format!("model name of {} bytes; at most {MAX_NAME_BYTES}", self.model.len()));
        }
        for (i, l) in self.layers.iter().enumerate() {
            let at = format!("layer {i} (`{}`)", l.name.chars().take(64).collect::<String>());
            if l.name.len() > MAX_NAME_BYTES || l.kind.len() > MAX_NAME_BYTES {
                return bad(format!("{at}: name or kind longer than {MAX_NAME_BYTES} bytes"));
            }
            if l.bytes > MAX_LAYER_BYTES {
                return bad(format!("{at}: {} bytes; at most {MAX_LAYER_BYTES}", l.bytes));
            }
            for (field, v) in [("load_ms", l.load_ms), ("exec_ms", l.exec_ms), ("dha_ms", l.dha_ms)] {
                if !v.is_finite() || !(0.0..=MAX_MS).contains(&v) {
                    return bad(format!("{at}: `{field}` is {v}; a time from 0 to {MAX_MS} ms expected"));
                }
            }
            if !l.has_params() && l.load_ms != 0.0 {
                return bad(format!(
                    "{at}: a parameter-free layer (bytes 0) has `load_ms` {}; it loads nothing, 0 expected",
                    l.load_ms
                ));
            }
        }
        Ok(())
    }
}
