//! `resnet` on CUDA (ARCHITECTURE.md §5.3), as the CPU's `conv.rs` / `layered.rs` runs it:
//! channels-last activations; each convolution `serve_im2col` (not for a 1×1 of stride 1) then
//! one cuBLAS GEMM against the folded weight `[out_c, k·k·c]` and `serve_bias_act` (the folded
//! BatchNorm bias, ReLU or not); `serve_max_pool`, `serve_add_relu`, `serve_avg_pool`, the fc.
//! A task is the whole model or a layer range ([`Work::Layers`]): its input rows are uploaded
//! from the staging into a worker buffer, and the last layer's result is copied into the
//! staging's pinned, mapped output buffer by `serve_bias_act` (no bias, no activation).

use super::abi;
use super::graph::GraphKey;
use super::runner::{Ctx, DeviceModel, Needs, Plan, Staging, bias_act_params, dim, enqueue_dense_input};
use super::{CudaDevice, DeviceBuffer, Stream};
use crate::backend::Work;
use crate::error::{Error, Result};
use crate::model::Network;
use crate::model::resnet::{Conv, Geometry, Shape, conv_out};

/// A convolution with its BatchNorm folded, on the device.
struct ConvGpu {
    g: Geometry,
    /// `[out_c, k·k·in_c]`, channels innermost.
    w: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
}

impl ConvGpu {
    fn new(stream: &Stream, c: &Conv) -> Result<ConvGpu> {
        let (w, b) = c.folded();
        dim(c.g.out_c, "channels")?;
        dim(c.g.k * c.g.k * c.g.in_c, "patch size")?;
        Ok(ConvGpu { g: c.g, w: stream.upload(&w)?, b: stream.upload(&b)? })
    }
}

struct BlockGpu {
    convs: Vec<ConvGpu>,
    down: Option<ConvGpu>,
}

/// A ResNet prepared on the device.
pub(super) struct ResNetGpu {
    stem: ConvGpu,
    blocks: Vec<BlockGpu>,
    fc_w: DeviceBuffer<f32>,
    fc_b: DeviceBuffer<f32>,
    classes: usize,
    features: usize,
    /// The shape entering each layer, and the output's.
    shapes: Vec<Shape>,
    /// The largest activation and im2col of one image over every step (`ResNet::buffer_sizes`).
    act: usize,
    col: usize,
    max_batch: usize,
}

/// A worker's buffers, each for `max_batch` images.
pub(super) struct ResNetBuffers {
    a: DeviceBuffer<f32>,
    b: DeviceBuffer<f32>,
    t1: DeviceBuffer<f32>,
    t2: DeviceBuffer<f32>,
    sc: DeviceBuffer<f32>,
    col: DeviceBuffer<f32>,
}

impl ResNetGpu {
    pub(super) fn new(stream: &Stream, net: &Network, max_batch: usize) -> Result<ResNetGpu> {
        let Network::ResNet(m) = net else {
            return Err(Error::internal(format!("a resnet runner cannot run a {} model", net.kind())));
        };
        dim(max_batch, "batch size")?;
        let (act, col) = m.buffer_sizes();
        dim(act, "activation size")?;
        let blocks = m
            .blocks
            .iter()
            .map(|b| {
                Ok(BlockGpu {
                    convs: b.convs.iter().map(|c| ConvGpu::new(stream, c)).collect::<Result<_>>()?,
                    down: b.downsample.as_ref().map(|c| ConvGpu::new(stream, c)).transpose()?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ResNetGpu {
            stem: ConvGpu::new(stream, &m.stem)?,
            blocks,
            fc_w: stream.upload(&m.fc_weight)?,
            fc_b: stream.upload(&m.fc_bias)?,
            classes: m.cfg.num_classes,
            features: m.features(),
            shapes: m.shapes(),
            act,
            col,
            max_batch,
        })
    }

    /// `dst = act(conv(src))` for `n` images of `h × w`; returns `(oh, ow)`.
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &self,
        ctx: &mut Ctx<'_>,
        c: &ConvGpu,
        src: &DeviceBuffer<f32>,
        (n, h, w): (usize, usize, usize),
        dst: &mut DeviceBuffer<f32>,
        col: &mut DeviceBuffer<f32>,
        relu: bool,
    ) -> Result<(usize, usize)> {
        let g = c.g;
        let (oh, ow) = (g.out_side(h), g.out_side(w));
        let rows = n * oh * ow;
        if g.direct() {
            ctx.blas.gemm_nt(rows, g.out_c, g.in_c, 1.0, src, &c.w, 0.0, dst)?;
        } else {
            let p = abi::Im2colParams {
                x: src.device_ptr(),
                col: col.device_ptr(),
                n: n as u32,
                h: h as u32,
                w: w as u32,
                c: g.in_c as u32,
                k: g.k as u32,
                stride: g.stride as u32,
                pad: g.pad as u32,
                oh: oh as u32,
                ow: ow as u32,
                _pad0: 0,
            };
            // SAFETY: reads n·h·w·in_c values of src and writes n·col_len of col: both worker
            // buffers sized for max_batch images of the largest activation / im2col (`new`),
            // n ≤ max_batch (plan). Runner invariants (runner.rs) for lifetimes.
            unsafe { ctx.kernels.im2col(ctx.stream, &p) }?;
            ctx.blas.gemm_nt(rows, g.out_c, g.k * g.k * g.in_c, 1.0, col, &c.w, 0.0, dst)?;
        }
        let act = if relu { abi::SERVE_ACT_RELU } else { abi::SERVE_ACT_NONE };
        let p =
            bias_act_params((dst.device_ptr(), dst.device_ptr()), c.b.device_ptr(), (rows, g.out_c), act)?;
        // SAFETY: in place over the GEMM's rows × out_c values (a worker buffer sized for the
        // largest activation), out_c biases.
        unsafe { ctx.kernels.bias_act(ctx.stream, &p) }?;
        Ok((oh, ow))
    }
}

impl DeviceModel for ResNetGpu {
    type Buffers = ResNetBuffers;

    fn io_lens(&self) -> (usize, usize) {
        (self.shapes[0].values(), self.classes)
    }

    fn state_slots(&self) -> usize {
        0
    }

    fn typical_needs(&self) -> Needs {
        Needs { desc: 0, dense: self.shapes[0].values(), out: self.classes, words: 0 }
    }

    fn reads_ring_on_device(&self) -> bool {
        true
    }

    fn buffers(&self, device: &CudaDevice, _stream: &Stream) -> Result<ResNetBuffers> {
        let act = crate::backend::size(self.max_batch, self.act, "resnet activation buffers")?;
        let col = crate::backend::size(self.max_batch, self.col.max(1), "resnet im2col buffer")?;
        Ok(ResNetBuffers {
            a: device.alloc(act)?,
            b: device.alloc(act)?,
            t1: device.alloc(act)?,
            t2: device.alloc(act)?,
            sc: device.alloc(act)?,
            col: device.alloc(col)?,
        })
    }

    fn plan(&self, padded: usize, work: &Work) -> Result<Plan> {
        let (range, input) = work.layer_range(self.shapes.len() - 1)?;
        let (inl, outl) = (self.shapes[range.0].values(), self.shapes[range.1].values());
        if input.len() != padded * inl || padded > self.max_batch {
            return Err(Error::internal(format!(
                "a resnet task of {padded} rows entering layer {} carries {} values, not {padded} × {inl}",
                range.0,
                input.len()
            )));
        }
        Ok(Plan {
            needs: Needs { desc: 0, dense: input.len(), out: padded * outl, words: 0 },
            padded,
            real: padded,
            outputs: padded * outl,
            layers: range,
            ..Plan::default()
        })
    }

    fn stage(&self, work: &Work, plan: &Plan, st: &mut Staging, _scratch: &mut Vec<u32>) -> Result<()> {
        match work {
            Work::Dense(x) | Work::Layers { input: x, .. } => st.dense.write(0, x),
            // A device ring's run is copied on the device (`enqueue_input`): nothing to stage.
            Work::Ring(_) if plan.ring_input.is_some() => Ok(()),
            Work::Ring(r) => st.dense.write(0, r.values()),
            Work::Cells(_) => Err(Error::internal("a resnet task must carry rows, not cells")),
        }
    }

    fn graph_key(&self, plan: &Plan) -> Option<GraphKey> {
        Some((plan.padded, plan.layers.0, plan.layers.1))
    }

    /// The values entering the task's first layer into the worker's `a`.
    fn enqueue_input(&self, ctx: Ctx<'_>, bufs: &mut ResNetBuffers, plan: &Plan, st: &Staging) -> Result<()> {
        enqueue_dense_input(
            ctx.stream,
            plan,
            st,
            &mut bufs.a,
            plan.padded * self.shapes[plan.layers.0].values(),
        )
    }

    /// The layers `[first, last)`, from `a`; the result ends in `a` after an even number of
    /// layers, in `b` after an odd one.
    fn enqueue_body(&self, mut ctx: Ctx<'_>, bufs: &mut ResNetBuffers, plan: &Plan) -> Result<()> {
        let ResNetBuffers { a, b, t1, t2, sc, col } = bufs;
        let n = plan.padded;
        let (first, last) = plan.layers;
        let head = self.blocks.len() + 1;
        let mut cur_a = true;
        for layer in first..last {
            let Shape { c, h, w } = self.shapes[layer];
            let (cur, next): (&DeviceBuffer<f32>, &mut DeviceBuffer<f32>) =
                if cur_a { (&*a, &mut *b) } else { (&*b, &mut *a) };
            if layer == 0 {
                let p = abi::ChwToHwcParams {
                    src: cur.device_ptr(),
                    dst: t1.device_ptr(),
                    n: n as u32,
                    c: c as u32,
                    h: h as u32,
                    w: w as u32,
                };
                // SAFETY: n images of c·h·w values in and out, within the worker buffers.
                unsafe { ctx.kernels.chw_to_hwc(ctx.stream, &p) }?;
                let (oh, ow) = self.conv(&mut ctx, &self.stem, t1, (n, h, w), t2, col, true)?;
                let p = abi::MaxPoolParams {
                    x: t2.device_ptr(),
                    out: next.device_ptr(),
                    n: n as u32,
                    h: oh as u32,
                    w: ow as u32,
                    c: self.stem.g.out_c as u32,
                    oh: conv_out(oh, 3, 2, 1) as u32,
                    ow: conv_out(ow, 3, 2, 1) as u32,
                };
                // SAFETY: reads the stem's output and writes the pooled images, within the worker
                // buffers (both at most the largest activation per image).
                unsafe { ctx.kernels.max_pool(ctx.stream, &p) }?;
            } else if layer == head {
                let p = abi::AvgPoolParams {
                    x: cur.device_ptr(),
                    out: t1.device_ptr(),
                    n: n as u32,
                    positions: (h * w) as u32,
                    c: c as u32,
                    _pad0: 0,
                };
                // SAFETY: reads n·h·w·c, writes n·c values of worker buffers.
                unsafe { ctx.kernels.avg_pool(ctx.stream, &p) }?;
                ctx.blas.gemm_nt(n, self.classes, self.features, 1.0, t1, &self.fc_w, 0.0, next)?;
                let (logits, bias) = (next.device_ptr(), self.fc_b.device_ptr());
                let p = bias_act_params((logits, logits), bias, (n, self.classes), abi::SERVE_ACT_NONE)?;
                // SAFETY: in place over n × classes logits (a worker buffer: the largest
                // activation counts the logits), classes biases.
                unsafe { ctx.kernels.bias_act(ctx.stream, &p) }?;
            } else {
                let blk = &self.blocks[layer - 1];
                match &blk.convs[..] {
                    [c1, c2] => {
                        let (oh, ow) = self.conv(&mut ctx, c1, cur, (n, h, w), t1, col, true)?;
                        self.conv(&mut ctx, c2, t1, (n, oh, ow), next, col, false)?;
                    }
                    [c1, c2, c3] => {
                        let (oh, ow) = self.conv(&mut ctx, c1, cur, (n, h, w), t1, col, true)?;
                        let (oh, ow) = self.conv(&mut ctx, c2, t1, (n, oh, ow), t2, col, true)?;
                        self.conv(&mut ctx, c3, t2, (n, oh, ow), next, col, false)?;
                    }
                    _ => return Err(Error::internal("a block has two or three convolutions")),
                }
                let len = n * self.shapes[layer + 1].values();
                let shortcut = match &blk.down {
                    Some(d) => {
                        self.conv(&mut ctx, d, cur, (n, h, w), sc, col, false)?;
                        sc.device_ptr()
                    }
                    None => cur.device_ptr(),
                };
                let p = abi::AddReluParams {
                    a: next.device_ptr(),
                    b: shortcut,
                    dst: next.device_ptr(),
                    n: len as u64,
                };
                // SAFETY: len values of the block's output, its shortcut and the output again.
                unsafe { ctx.kernels.add_relu(ctx.stream, &p) }?;
            }
            cur_a = !cur_a;
        }
        Ok(())
    }

    fn enqueue_output(
        &self,
        ctx: Ctx<'_>,
        bufs: &mut ResNetBuffers,
        plan: &Plan,
        st: &Staging,
    ) -> Result<()> {
        let (first, last) = plan.layers;
        let result = if (last - first).is_multiple_of(2) { &bufs.a } else { &bufs.b };
        let outl = self.shapes[last].values();
        let p = bias_act_params(
            (result.device_ptr(), st.out.device_ptr()),
            0,
            (plan.padded, outl),
            abi::SERVE_ACT_NONE,
        )?;
        // SAFETY: a copy of n × outl values from a worker buffer into the task's output staging
        // (needs.out = n × outl), which the host reads only after the task's counter.
        unsafe { ctx.kernels.bias_act(ctx.stream, &p) }
    }
}
