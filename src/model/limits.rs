//! Limits on every size a model directory may declare, checked at load before anything is
//! allocated from them. A value over its limit is [`Code::Format`](crate::Code::Format) naming the
//! key (or tensor) and the limit; the limits are chosen so that no size derived from them can
//! overflow (checked at compile time below), so a model file
//! can never make `load` (or a later request) allocate without bound or wrap an integer.
//!
//! | what | limit |
//! |---|---|
//! | `model.toml` | [`MAX_CONFIG_BYTES`] (1 MiB) |
//! | `weights.safetensors` | [`MAX_WEIGHTS_BYTES`] (64 GiB), header [`MAX_HEADER_BYTES`] (100 MB) |
//! | `vocab` | [`MAX_VOCAB`] (4,194,304) |
//! | `embed`, `hidden` | [`MAX_WIDTH`] (65,536) |
//! | `layers` | [`MAX_LAYERS`] (1,024) |
//! | `max_len` | [`MAX_LEN`] (1,048,576 tokens) |
//! | `max_decode` | [`MAX_DECODE`] (65,536 tokens) |
//! | `max_nodes` | [`MAX_NODES`] (1,048,576 nodes) |
//! | mlp layer width (`in`, `out` of `layers.{k}.weight`) | [`MAX_MLP_WIDTH`] (4,194,304) |
//! | mlp layers | [`MAX_MLP_LAYERS`] (1,024) |
//! | resnet `image` side / channels | [`MAX_IMAGE_SIDE`] (4,096) / [`MAX_IMAGE_CHANNELS`] (1,024) |
//! | resnet `layers[i]` / `width` / `num_classes` | [`MAX_RESNET_BLOCKS`] (256) / [`MAX_RESNET_WIDTH`] (1,024) / [`MAX_MLP_WIDTH`] |
//! | bert `vocab`, `hidden`, `intermediate`, `layers` | as `vocab`, `hidden`, `hidden`, `layers` above |
//! | bert `seq_len`, `max_position` / `heads` / `type_vocab` | [`MAX_SEQ_LEN`] (16,384) / [`MAX_HEADS`] (1,024) / [`MAX_VOCAB`] |
//!
//! Every size is at least 1; `bos` and `eos` are below `vocab`. The limits are far above real
//! models of these kinds (vocabularies of a few 100k, hidden sizes up to ~16k, a few hundred
//! layers) and low enough that every size derived from them (`4 × hidden`, `vocab × embed`, a
//! request's cell count) fits the integer types that hold it: token and node ids are `u32`, with
//! [`NO_TOKEN`](super::NO_TOKEN) and the top two node ids reserved (`CellGraph::new`).

use std::path::Path;

use crate::error::{Error, Result};

/// Largest `model.toml`, in bytes.
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;
/// Largest `weights.safetensors`, in bytes (16 G fp32 parameters).
pub const MAX_WEIGHTS_BYTES: u64 = 1 << 36;
/// Largest safetensors JSON header, in bytes (the safetensors crate's own limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// Largest vocabulary (`vocab`).
pub const MAX_VOCAB: usize = 1 << 22;
/// Largest embedding or hidden size (`embed`, `hidden`).
pub const MAX_WIDTH: usize = 1 << 16;
/// Most LSTM layers (`layers`).
pub const MAX_LAYERS: usize = 1 << 10;
/// Largest `max_len` (tokens of one input sequence).
pub const MAX_LEN: usize = 1 << 20;
/// Largest `max_decode` (tokens one Seq2Seq decode may emit).
pub const MAX_DECODE: usize = 1 << 16;
/// Largest `max_nodes` (nodes of one TreeLSTM tree).
pub const MAX_NODES: usize = 1 << 20;
/// Widest mlp layer (inputs or outputs of one `layers.{k}.weight`).
pub const MAX_MLP_WIDTH: usize = 1 << 22;
/// Most mlp layers.
pub const MAX_MLP_LAYERS: usize = 1 << 10;
/// Largest image side (`image[1]`, `image[2]` of a resnet) and channel count (`image[0]`).
pub const MAX_IMAGE_SIDE: usize = 1 << 12;
pub const MAX_IMAGE_CHANNELS: usize = 1 << 10;
/// Most blocks in one resnet stage (`layers[i]`), and the widest stem (`width`).
pub const MAX_RESNET_BLOCKS: usize = 1 << 8;
pub const MAX_RESNET_WIDTH: usize = 1 << 10;
/// Largest bert `seq_len` / `max_position`, and most attention heads.
pub const MAX_SEQ_LEN: usize = 1 << 14;
pub const MAX_HEADS: usize = 1 << 10;

// A request's cell graph (a source of `max_len` tokens then `max_decode` decoder steps, or a tree
// of `max_nodes`) numbers its nodes in u32 below the two reserved top values; token ids are u32
// below NO_TOKEN.
const _: () = assert!(MAX_LEN + MAX_DECODE < u32::MAX as usize - 1);
const _: () = assert!(MAX_NODES < u32::MAX as usize - 1);
const _: () = assert!(MAX_VOCAB < super::NO_TOKEN as usize);
// Every tensor size the keys imply (`vocab × width`, `4 × hidden × width`, an mlp layer's
// `out × in`) fits a usize, so checking each key against its limit is enough.
const _: () = assert!((MAX_VOCAB as u128) * (MAX_WIDTH as u128) <= usize::MAX as u128);
const _: () = assert!(4 * (MAX_WIDTH as u128) * (MAX_WIDTH as u128) <= usize::MAX as u128);
const _: () = assert!((MAX_MLP_WIDTH as u128) * (MAX_MLP_WIDTH as u128) <= usize::MAX as u128);

/// A model.toml size: at least 1 and at most `max`, else FORMAT naming the key.
pub(crate) fn check_size(toml_path: &Path, key: &str, v: usize, max: usize) -> Result<()> {
    if v == 0 {
        Err(Error::format(format!("{}: {key} must be at least 1", toml_path.display())))
    } else if v > max {
        Err(Error::format(format!("{}: {key} = {v} is over the limit of {max}", toml_path.display())))
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Code;

    #[test]
    fn sizes_are_bounded() {
        let p = Path::new("m/model.toml");
        assert!(check_size(p, "hidden", 1, MAX_WIDTH).is_ok());
        assert!(check_size(p, "hidden", MAX_WIDTH, MAX_WIDTH).is_ok());
        let e = check_size(p, "hidden", 1 << 62, MAX_WIDTH).unwrap_err();
        assert_eq!(e.code(), Code::Format);
        assert_eq!(e.message(), "m/model.toml: hidden = 4611686018427387904 is over the limit of 65536");
        let e = check_size(p, "layers", 0, MAX_LAYERS).unwrap_err();
        assert_eq!((e.code(), e.message()), (Code::Format, "m/model.toml: layers must be at least 1"));
    }
}
