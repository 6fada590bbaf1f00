//! `custom`: a fixed-shape model whose computation is the caller's (ARCHITECTURE.md §6). A C/C++
//! server registers its own engine (`serve_runtime_add_custom_model`, or [`Runtime::add_custom`]
//! in Rust) with its input and output sizes, an execute callback and, optionally, its layers; libserve
//! batches its requests under any fixed-shape policy and calls the engine once per batched task.
//!
//! [`Runtime::add_custom`]: crate::Runtime::add_custom

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::LayerInfo;
use crate::model::limits::{MAX_MLP_LAYERS, MAX_MLP_WIDTH};

/// One batched call of a custom model.
#[derive(Debug)]
pub struct CustomCall<'a> {
    /// The worker (stream) running the task: calls of one worker never overlap; calls of
    /// different workers may.
    pub worker: usize,
    /// The cores the task may use (its policy's bound, or the backend's thread count).
    pub cores: usize,
    /// The CPUs a core lease gives the task (the tenant mode, `Runtime::add_tenants`): `cores`
    /// of them, leased to no other call of the tenant group until this one returns (unless the
    /// stall watchdog gives up on it first); on Linux the calling thread runs pinned to the
    /// first when the system allows it. Empty when the task has no lease (every other policy).
    pub cpus: &'a [usize],
    /// Rows (requests, padding included) of the task.
    pub batch: usize,
    /// The layers `[first, last)` to run; `(0, layers)` (with `layers` the count the model
    /// declared, 0 when it declared none) is the whole model.
    pub layers: (usize, usize),
    /// `batch ×` the values entering layer `first` (the model's input for the whole model).
    pub input: &'a [f32],
    /// `batch ×` the values leaving layer `last − 1` (the model's output for the whole model),
    /// zeroed before the call.
    pub output: &'a mut [f32],
}

/// A custom model's computation. `execute` returns `Err(message)` to fail every request of the
/// task with `BACKEND` and that message; the model keeps serving. A call that does not return is
/// given up on by the stall watchdog (its requests complete `BACKEND`, the runtime keeps
/// serving), but the model's worker thread is joined: releasing the model and dropping the
/// runtime wait until that call returns.
pub trait CustomExecute: Send + Sync + 'static {
    fn execute(&self, call: &mut CustomCall<'_>) -> std::result::Result<(), String>;
}

/// A custom model: its sizes, its optional layers and its computation.
#[derive(Clone)]
pub struct CustomModel {
    pub input_len: usize,
    pub output_len: usize,
    /// Its layers in order (may be empty: then only whole-model tasks run); the last one's
    /// `out_len` is the model's output length.
    pub layers: Vec<LayerInfo>,
    pub exec: Arc<dyn CustomExecute>,
}

impl fmt::Debug for CustomModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CustomModel")
            .field("input_len", &self.input_len)
            .field("output_len", &self.output_len)
            .field("layers", &self.layers)
            .finish_non_exhaustive()
    }
}

impl PartialEq for CustomModel {
    /// The same sizes and layers and the same computation (the same object).
    fn eq(&self, o: &CustomModel) -> bool {
        self.input_len == o.input_len
            && self.output_len == o.output_len
            && self.layers == o.layers
            && Arc::ptr_eq(&self.exec, &o.exec)
    }
}

impl CustomModel {
    /// Input and output lengths of 1 ..= 4,194,304 values (`INVALID_ARGUMENT` naming the wrong
    /// one).
    pub fn check_sizes(input_len: usize, output_len: usize) -> Result<()> {
        for (what, v) in [("input length", input_len), ("output length", output_len)] {
            if v == 0 || v > MAX_MLP_WIDTH {
                return Err(Error::invalid(format!(
                    "a custom model's {what} is {v}; it must be 1 to {MAX_MLP_WIDTH}"
                )));
            }
        }
        Ok(())
    }

    /// [Sizes](Self::check_sizes) in bounds, at most 1,024 layers each giving at least one
    /// value, the last giving the output (`INVALID_ARGUMENT` naming what is wrong).
    pub fn check(&self) -> Result<()> {
        Self::check_sizes(self.input_len, self.output_len)?;
        if self.layers.len() > MAX_MLP_LAYERS {
            return Err(Error::invalid(format!(
                "a custom model has {} layers; at most {MAX_MLP_LAYERS}",
                self.layers.len()
            )));
        }
        if let Some((k, l)) =
            self.layers.iter().enumerate().find(|(_, l)| l.out_len == 0 || l.out_len > MAX_MLP_WIDTH)
        {
            return Err(Error::invalid(format!(
                "layer {k} (`{}`) of a custom model gives {} values; it must be 1 to {MAX_MLP_WIDTH}",
                l.name, l.out_len
            )));
        }
        if let Some(last) = self.layers.last()
            && last.out_len != self.output_len
        {
            return Err(Error::invalid(format!(
                "the last layer of a custom model gives {} values, its output length is {}",
                last.out_len, self.output_len
            )));
        }
        Ok(())
    }

    /// Values per row entering layer `layer` (0: the input; `layers.len()`: the output, also
    /// for a model without layers, whose only "layer range" is the whole model `(0, 0)`).
    pub fn in_len(&self, layer: usize) -> usize {
        if layer == self.layers.len() {
            self.output_len
        } else if layer == 0 {
            self.input_len
        } else {
            self.layers[layer - 1].out_len
        }
    }

    /// Values per row entering a task of layers `(first, last)` and leaving it.
    pub fn io_lens(&self, (first, last): (usize, usize)) -> (usize, usize) {
        (if first == 0 { self.input_len } else { self.in_len(first) }, self.in_len(last))
    }
}
