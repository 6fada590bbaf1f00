//! `weights.safetensors` reading (with validation) and writing.
//!
//! Every tensor must be fp32, except PyTorch's integer buffers ([`IGNORED_BUFFERS`]), which are
//! skipped. Loading checks names, shapes and dtype and says which tensor is wrong.
//!
//! The file is read, not memory-mapped: a mapped file that another process truncates raises
//! SIGBUS in the host process, and a library inside someone's server must never abort it. It is
//! read through a handle checked to be a regular file of at most
//! [`MAX_WEIGHTS_BYTES`](super::limits::MAX_WEIGHTS_BYTES) (see `model::file`): first the header,
//! then each tensor straight into its own `Vec<f32>` (in bounded chunks, so peak memory is the
//! tensor data plus one chunk, not the file twice). The header must describe the file exactly:
//! its data section must end where the file ends (trailing bytes are FORMAT, as is a truncated
//! file), each tensor name must appear once, and every value must be finite (a NaN or infinite
//! weight is FORMAT naming the tensor and the element). Offsets and shapes are checked as the
//! safetensors crate's `Metadata::validate` checks them, with messages that name the tensor.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use safetensors::Dtype;
use safetensors::tensor::TensorInfo;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::error::{Code, Error, Result};
use crate::model::file;
use crate::model::limits::{MAX_HEADER_BYTES, MAX_WEIGHTS_BYTES};

/// A dense fp32 tensor in row-major order.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl Tensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Tensor {
        assert_eq!(shape.iter().product::<usize>(), data.len(), "tensor shape and data disagree");
        Tensor { shape, data }
    }
}

/// The tensors of one safetensors file, taken one by one by a model constructor.
/// [`Weights::finish`] then reports any tensor nobody asked for.
#[derive(Debug)]
pub struct Weights {
    path: PathBuf,
    tensors: BTreeMap<String, Tensor>,
}

/// Bytes read at a time when converting a tensor's data to f32.
const CHUNK: usize = 1 << 16;

/// The safetensors header's tensor entries in file order, each name once (`__metadata__` skipped).
struct Header(Vec<(String, TensorInfo)>);

impl<'de> serde::Deserialize<'de> for Header {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Header, D::Error> {
        struct Entries;
        impl<'de> Visitor<'de> for Entries {
            type Value = Header;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object of tensors")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Header, A::Error> {
                // serde_json keeps the last of two equal keys of a map; the safetensors crate
                // would silently merge two tensors of one name, so names are checked here.
                let mut seen = HashSet::new();
                let mut entries = Vec::new();
                while let Some(name) = map.next_key::<String>()? {
                    if !seen.insert(name.clone()) {
                        return Err(de::Error::custom(format!(
                            "tensor `{name}` appears twice in the header"
                        )));
                    }
                    if name == "__metadata__" {
                        map.next_value::<IgnoredAny>()?;
                        continue;
                    }
                    let info = map
                        .next_value::<TensorInfo>()
                        .map_err(|e| de::Error::custom(format!("tensor `{name}`: {e}")))?;
                    entries.push((name, info));
                }
                Ok(Header(entries))
            }
        }
        d.deserialize_map(Entries)
    }
}

/// The length of the data section `tensors` (sorted by offset) describe, once each tensor is
/// checked to start where the previous one ends and to hold exactly its shape's bytes (what
/// safetensors' `Metadata::validate` checks); else what is wrong, naming the tensor.
fn check_offsets(tensors: &[(String, TensorInfo)]) -> std::result::Result<usize, String> {
    let mut start = 0;
    for (name, info) in tensors {
        let (s, end) = info.data_offsets;
        if end < s {
            return Err(format!("tensor `{name}` has data_offsets [{s}, {end}]: it ends before it starts"));
        }
        if s != start {
            return Err(format!(
                "tensor `{name}` has data_offsets [{s}, {end}]; it must start at byte {start}, where \
                 the previous tensor ends"
            ));
        }
        let bytes = info.shape.iter().try_fold(info.dtype.bitsize(), |a, &d| a.checked_mul(d));
        if bytes.map(|b| b % 8 != 0 || b / 8 != end - s).unwrap_or(true) {
            let size = bytes.map_or("more than the address space".into(), |b| format!("{} bytes", b / 8));
            return Err(format!(
                "tensor `{name}` of dtype {:?} and shape {:?} needs {size}, but its data_offsets \
                 [{s}, {end}] hold {} bytes",
                info.dtype,
                info.shape,
                end - s
            ));
        }
        start = end;
    }
    Ok(start)
}

/// Integer buffers PyTorch keeps in a `state_dict` that carry no weights: BatchNorm's
/// `num_batches_tracked` (a training counter) and a transformer's `position_ids` /
/// `token_type_ids` (`arange` and zeros). A tensor whose name ends in one of these (after a `.`
/// or as the whole name) with an integer dtype is accepted and ignored; any other non-F32
/// tensor is FORMAT.
pub const IGNORED_BUFFERS: [&str; 3] = ["num_batches_tracked", "position_ids", "token_type_ids"];

fn is_ignored_buffer(name: &str, dtype: Dtype) -> bool {
    let integer = matches!(
        dtype,
        Dtype::I8 | Dtype::I16 | Dtype::I32 | Dtype::I64 | Dtype::U8 | Dtype::U16 | Dtype::U32 | Dtype::U64
    );
    let last = name.rsplit('.').next().unwrap_or(name);
    integer && IGNORED_BUFFERS.contains(&last)
}

/// Read past `bytes` bytes of tensor `name` without keeping them.
fn skip(f: &mut File, path: &Path, name: &str, bytes: usize) -> Result<()> {
    let copied = std::io::copy(&mut Read::by_ref(f).take(bytes as u64), &mut std::io::sink())
        .map_err(|e| Error::new(Code::Io, format!("{}: reading tensor `{name}`: {e}", path.display())))?;
    if copied != bytes as u64 {
        return Err(Error::new(
            Code::Io,
            format!("{}: the file shrank while tensor `{name}` was read", path.display()),
        ));
    }
    Ok(())
}

/// Read tensor `name` (`bytes` long, a multiple of 4) from `f` as little-endian f32. A NaN or
/// infinite value is FORMAT naming the element; a file that shrinks while it is read is IO (as
/// one that grows: `model::file`).
fn read_f32(f: &mut File, path: &Path, name: &str, bytes: usize) -> Result<Vec<f32>> {
    let mut data = Vec::with_capacity(bytes / 4);
    let mut chunk = vec![0u8; CHUNK.min(bytes)];
    let mut left = bytes;
    while left > 0 {
        let buf = &mut chunk[..CHUNK.min(left)];
        f.read_exact(buf).map_err(|e| match e.kind() {
            std::io::ErrorKind::UnexpectedEof => Error::new(
                Code::Io,
                format!("{}: the file shrank while tensor `{name}` was read", path.display()),
            ),
            _ => Error::new(Code::Io, format!("{}: reading tensor `{name}`: {e}", path.display())),
        })?;
        for b in buf.chunks_exact(4) {
            let v = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            if !v.is_finite() {
                let what = if v.is_nan() {
                    "NaN"
                } else if v > 0.0 {
                    "+inf"
                } else {
                    "-inf"
                };
                return Err(Error::format(format!(
                    "{}: tensor `{name}` element {} is {what}; weights must be finite",
                    path.display(),
                    data.len()
                )));
            }
            data.push(v);
        }
        left -= buf.len();
    }
    Ok(data)
}

impl Weights {
    /// Load `path`: a regular file whose header describes it exactly, every tensor fp32 and finite.
    pub fn load(path: &Path) -> Result<Weights> {
        let (mut f, len) = file::open_regular(path, MAX_WEIGHTS_BYTES)?;
        let bad =
            |what: String| Error::format(format!("{}: not a valid safetensors file: {what}", path.display()));
        let io = |e: std::io::Error| Error::new(Code::Io, format!("{}: {e}", path.display()));
        let mut n = [0u8; 8];
        if len < 8 {
            return Err(bad(format!("{len} bytes, too short for the 8-byte header length")));
        }
        f.read_exact(&mut n).map_err(io)?;
        let n = u64::from_le_bytes(n);
        if n > MAX_HEADER_BYTES {
            return Err(bad(format!("a header of {n} bytes is over the limit of {MAX_HEADER_BYTES}")));
        }
        if n > len - 8 {
            return Err(bad(format!("truncated: a header of {n} bytes in a file of {len} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        f.read_exact(&mut header).map_err(io)?;
        let Header(mut entries) =
            serde_json::from_slice(&header).map_err(|e| bad(format!("invalid header: {e}")))?;
        drop(header);
        entries.sort_by_key(|(_, info)| info.data_offsets);
        let data_len = check_offsets(&entries).map_err(bad)? as u64;
        if let Some((name, info)) = entries
            .iter()
            .find(|(name, info)| info.dtype != Dtype::F32 && !is_ignored_buffer(name, info.dtype))
        {
            return Err(Error::format(format!(
                "{}: tensor `{name}` has dtype {:?}; libserve models are F32 (the only other tensors \
                 accepted are PyTorch's integer buffers {IGNORED_BUFFERS:?}, which are ignored)",
                path.display(),
                info.dtype
            )));
        }
        let file_data = len - 8 - n;
        if data_len > file_data {
            return Err(bad(format!(
                "truncated: the header describes {data_len} bytes of tensor data, the file holds {file_data}"
            )));
        }
        if data_len < file_data {
            return Err(bad(format!(
                "{} bytes after the last tensor: the header describes {data_len} bytes of tensor data, \
                 the file holds {file_data}",
                file_data - data_len
            )));
        }
        let mut tensors = BTreeMap::new();
        // The tensors in offset order are the data section, front to back (`check_offsets`).
        for (name, info) in entries {
            let bytes = info.data_offsets.1 - info.data_offsets.0;
            if info.dtype != Dtype::F32 {
                // An ignored integer buffer: skipped unread (its size was checked above).
                skip(&mut f, path, &name, bytes)?;
                continue;
            }
            let data = read_f32(&mut f, path, &name, bytes)?;
            tensors.insert(name, Tensor { shape: info.shape, data });
        }
        if f.read(&mut [0u8]).map_err(io)? > 0 {
            return Err(Error::new(Code::Io, format!("{}: the file grew while it was read", path.display())));
        }
        Ok(Weights { path: path.to_path_buf(), tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The names of the tensors not taken yet, sorted.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Take tensor `name`, whatever its shape.
    pub fn take_any(&mut self, name: &str) -> Result<Tensor> {
        self.tensors
            .remove(name)
            .ok_or_else(|| Error::format(format!("{}: missing tensor `{name}`", self.path.display())))
    }

    /// Take tensor `name`, which must have exactly `shape`.
    pub fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self.take_any(name)?;
        if t.shape != shape {
            return Err(Error::format(format!(
                "{}: tensor `{name}` has shape {:?}, expected {:?}",
                self.path.display(),
                t.shape,
                shape
            )));
        }
        Ok(t)
    }

    /// Fail if any tensor was not taken.
    pub fn finish(self) -> Result<()> {
        match self.tensors.keys().next() {
            None => Ok(()),
            Some(name) => Err(Error::format(format!(
                "{}: unexpected tensor `{name}` ({} tensor(s) not used by the model)",
                self.path.display(),
                self.tensors.len()
            ))),
        }
    }
}

/// Write fp32 tensors to a safetensors file (used to make demo models, fixtures and benchmarks).
pub fn write_safetensors(path: &Path, tensors: &[(&str, &Tensor)]) -> Result<()> {
    let bytes: Vec<(String, Vec<u8>, Vec<usize>)> = tensors
        .iter()
        .map(|(name, t)| {
            (name.to_string(), t.data.iter().flat_map(|v| v.to_le_bytes()).collect(), t.shape.clone())
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(name, data, shape)| {
            safetensors::tensor::TensorView::new(Dtype::F32, shape.clone(), data)
                .map(|v| (name.clone(), v))
                .map_err(|e| Error::internal(format!("tensor `{name}`: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    safetensors::serialize_to_file(views, None, path)
        .map_err(|e| Error::new(Code::Io, format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_validation() {
        let dir = tempdir();
        let path = dir.join("w.safetensors");
        let a = Tensor::new(vec![2, 3], vec![1., 2., 3., 4., 5., 6.]);
        let b = Tensor::new(vec![3], vec![-1., 0., 1.]);
        write_safetensors(&path, &[("a", &a), ("b", &b)]).unwrap();

        let mut w = Weights::load(&path).unwrap();
        assert_eq!(w.take("a", &[2, 3]).unwrap(), a);
        let e = w.take("b", &[4]).unwrap_err();
        assert_eq!(e.code(), Code::Format);
        assert!(e.message().contains("tensor `b` has shape [3], expected [4]"), "{e}");

        let mut w = Weights::load(&path).unwrap();
        w.take_any("a").unwrap();
        let e = w.finish().unwrap_err();
        assert!(e.message().contains("unexpected tensor `b`"), "{e}");

        let mut w = Weights::load(&path).unwrap();
        let e = w.take_any("c").unwrap_err();
        assert!(e.message().contains("missing tensor `c`"), "{e}");
    }

    fn tempdir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("serve-weights-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
