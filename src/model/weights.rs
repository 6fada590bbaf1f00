//! `weights.safetensors` reading (with validation) and writing.
//!
//! Every tensor must be fp32. Loading checks names, shapes and dtype and says which tensor is wrong.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};

use crate::error::{Code, Error, Result};

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

/// Read a whole file, mapping "does not exist" to `NotFound` and other failures to `Io`.
pub(crate) fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| {
        let code = if e.kind() == std::io::ErrorKind::NotFound { Code::NotFound } else { Code::Io };
        Error::new(code, format!("{}: {e}", path.display()))
    })
}

impl Weights {
    /// Load and validate the dtype of every tensor in `path`.
    pub fn load(path: &Path) -> Result<Weights> {
        let bytes = read_file(path)?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::format(format!("{}: not a valid safetensors file: {e}", path.display())))?;
        let mut tensors = BTreeMap::new();
        for (name, view) in st.iter() {
            if view.dtype() != Dtype::F32 {
                return Err(Error::format(format!(
                    "{}: tensor `{name}` has dtype {:?}; libserve models are F32",
                    path.display(),
                    view.dtype()
                )));
            }
            let data: Vec<f32> =
                view.data().chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
            tensors.insert(name.to_string(), Tensor { shape: view.shape().to_vec(), data });
        }
        Ok(Weights { path: path.to_path_buf(), tensors })
    }

    pub fn path(&self) -> &Path {
        &self.path
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
