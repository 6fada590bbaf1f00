//! `mlp` on CUDA: per layer one cuBLAS GEMM `Y = X · Wᵀ` (PyTorch's `[out, in]` weight is the
//! `B` of [`Blas::gemm_nt`](super::Blas::gemm_nt)) and the `serve_bias_act` kernel (bias, then
//! ReLU between layers, none after the last), as the CPU runner (`backend/cpu/mlp.rs`). The input
//! rows are uploaded from the task's staging; the last layer's bias kernel writes the result
//! straight into the staging's pinned, mapped output buffer.

use super::abi;
use super::runner::{Ctx, DeviceModel, Needs, Plan, Staging, bias_act_params, dim, enqueue_dense_input};
use super::{CudaDevice, DeviceBuffer, Stream};
use crate::backend::Work;
use crate::error::{Error, Result};
use crate::model::Network;

struct Layer {
    /// `[out, in]`, row-major.
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    inputs: usize,
    outputs: usize,
}

/// An mlp prepared on the device.
pub(super) struct Dense {
    layers: Vec<Layer>,
    input_len: usize,
    output_len: usize,
    max_width: usize,
    max_batch: usize,
}

/// A worker's device buffers: the input rows and two activation buffers (ping-pong), each for
/// the largest batch.
pub(super) struct Buffers {
    input: DeviceBuffer<f32>,
    a: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
}

impl Dense {
    pub(super) fn new(stream: &Stream, net: &Network, max_batch: usize) -> Result<Dense> {
        let Network::Mlp(mlp) = net else {
            return Err(Error::internal(format!("an mlp runner cannot run a {} model", net.kind())));
        };
        if mlp.layers.is_empty() {
            return Err(Error::internal("an mlp without layers"));
        }
        dim(max_batch, "batch size")?;
        let layers = mlp
            .layers
            .iter()
            .map(|l| {
                dim(l.in_features, "layer width")?;
                dim(l.out_features, "layer width")?;
                Ok(Layer {
                    w: stream.upload(&l.weight)?,
                    b: stream.upload(&l.bias)?,
                    inputs: l.in_features,
                    outputs: l.out_features,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Dense {
            layers,
            input_len: mlp.input_len(),
            output_len: mlp.output_len(),
            max_width: mlp.max_width(),
            max_batch,
        })
    }
}

impl DeviceModel for Dense {
    type Buffers = Buffers;

    fn io_lens(&self) -> (usize, usize) {
        (self.input_len, self.output_len)
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn typical_needs(&self) -> Needs {
        Needs {
            desc: 0,
            dense: self.max_batch * self.input_len,
            out: self.max_batch * self.output_len,
            words: 0,
        }
    }

    fn buffers(&self, device: &CudaDevice, _stream: &Stream) -> Result<Buffers> {
        let width = crate::backend::size(self.max_batch, self.max_width, "activation buffers")?;
        Ok(Buffers {
            input: device.alloc(crate::backend::size(
                self.max_batch,
                self.input_len,
                "activation buffers",
            )?)?,
            a: device.alloc(width)?,
            b: device.alloc(width)?,
        })
    }

    fn plan(&self, padded: usize, work: &Work) -> Result<Plan> {
        let Some(x) = work.dense_rows() else {
            return Err(Error::internal("an mlp task must carry dense rows"));
        };
        if x.len() != padded * self.input_len {
            return Err(Error::internal(format!(
                "an mlp task of {padded} rows carries {} input values, not {padded} × {}",
                x.len(),
                self.input_len
            )));
        }
        Ok(Plan {
            needs: Needs { desc: 0, dense: x.len(), out: padded * self.output_len, words: 0 },
            padded,
            real: padded,
            outputs: padded * self.output_len,
            ..Plan::default()
        })
    }

    fn reads_ring_on_device(&self) -> bool {
        true
    }

    fn stage(&self, work: &Work, plan: &Plan, st: &mut Staging, _scratch: &mut Vec<u32>) -> Result<()> {
        if plan.ring_input.is_some() {
            return Ok(()); // a device ring's run: copied on the device (`enqueue`)
        }
        let Some(x) = work.dense_rows() else {
            return Err(Error::internal("an mlp task must carry dense rows"));
        };
        st.dense.write(0, x)
    }

    fn enqueue(&self, ctx: Ctx<'_>, bufs: &mut Buffers, plan: &Plan, st: &Staging) -> Result<()> {
        let Buffers { input, a, b } = bufs;
        let rows = plan.padded;
        enqueue_dense_input(ctx.stream, plan, st, input, rows * self.input_len)?;
        let last = self.layers.len() - 1;
        for (k, l) in self.layers.iter().enumerate() {
            let (src, dst): (&DeviceBuffer<f32>, &mut DeviceBuffer<f32>) = if k == 0 {
                (&*input, &mut *a)
            } else if k % 2 == 1 {
                (&*a, &mut *b)
            } else {
                (&*b, &mut *a)
            };
            ctx.blas.gemm_nt(rows, l.outputs, l.inputs, 1.0, src, &l.w, 0.0, dst)?;
            let (out, act) = if k == last {
                (st.out.device_ptr(), abi::SERVE_ACT_NONE)
            } else {
                (dst.device_ptr(), abi::SERVE_ACT_RELU)
            };
            let p = bias_act_params((dst.device_ptr(), out), l.b.device_ptr(), (rows, l.outputs), act)?;
            // SAFETY: reads rows × out of the GEMM's output (a worker buffer of B × max width) and
            // `out` biases; writes the same elements in place, or for the last layer rows × output
            // values of the task's output staging (needs.out), which the host reads only after the
            // counter. Runner invariants (runner.rs) for lifetimes.
            unsafe { ctx.kernels.bias_act(ctx.stream, &p) }?;
        }
        Ok(())
    }
}
