//! One batched LSTM layer step on the device with its own buffers and seeded random weights: what
//! `serve bench step --backend cuda` and `benches/cuda.rs` (a) time, exactly as the CUDA runner
//! runs a cellular-batching step — `serve_lstm_gather` (`[x | h_prev]` from a state arena),
//! the cuBLAS GEMM `X · [W_ih | W_hh]ᵀ` and `serve_lstm_pointwise` (gates, scatter of h and c) —
//! and the GEMM alone, for the ratio.
//!
//! Every row continues a sequence (state read from and written back to the arena), in every other
//! slot of an arena twice the batch, in reverse order, as the CPU benchmark lays it out.

use crate::backend::cpu::lstm_cell::step_flops;
use crate::backend::cuda::abi::{LstmGatherParams, LstmPointwiseParams};
use crate::backend::cuda::kernels::{self, BLOCK, grid};
use crate::backend::cuda::{Blas, CudaDevice, DeviceBuffer, Function, LaunchConfig, Stream};
use crate::error::{Error, Result};
use crate::workload::values;

/// The device buffers and kernels of one LSTM layer step.
pub struct LstmStepBench {
    batch: usize,
    input: usize,
    hidden: usize,
    gather: Function,
    pointwise: Function,
    x: DeviceBuffer<f32>,
    slots: DeviceBuffer<u32>,
    arena: DeviceBuffer<f32>,
    xh: DeviceBuffer<f32>,
    w: DeviceBuffer<f32>,
    bias: DeviceBuffer<f32>,
    gates: DeviceBuffer<f32>,
    h_out: DeviceBuffer<f32>,
}

impl LstmStepBench {
    /// Buffers for a step of `batch` rows of a layer `input → hidden`, uploaded on `s`; weights
    /// uniform in ±1/√hidden from `seed`. Fails with INVALID_ARGUMENT for sizes the kernels'
    /// 32-bit fields cannot hold.
    pub fn new(
        dev: &CudaDevice,
        s: &Stream,
        input: usize,
        hidden: usize,
        batch: usize,
        seed: u64,
    ) -> Result<LstmStepBench> {
        if batch == 0 || hidden == 0 || input == 0 {
            return Err(Error::invalid("batch, hidden and input must be at least 1"));
        }
        for (what, v) in [("batch", 2 * batch), ("hidden", 2 * hidden), ("input", input + hidden)] {
            if u32::try_from(v).is_err() {
                return Err(Error::invalid(format!("{what} does not fit the kernels' 32-bit sizes")));
            }
        }
        let m = dev.kernels()?;
        // `workload::values`, one seed per buffer.
        let mut next = seed.wrapping_mul(16);
        let mut data = |n: usize, scale: f32| {
            next += 1;
            values(n, next, scale)
        };
        let sc = 1.0 / (hidden as f32).sqrt();
        let (n, k) = (4 * hidden, input + hidden);
        let bias: Vec<f32> = data(n, sc).iter().zip(data(n, sc)).map(|(a, b)| a + b).collect();
        let words: Vec<u32> = (0..batch).map(|r| (2 * (batch - 1 - r)) as u32).collect();
        Ok(LstmStepBench {
            batch,
            input,
            hidden,
            gather: m.function(kernels::LSTM_GATHER)?,
            pointwise: m.function(kernels::LSTM_POINTWISE)?,
            x: s.upload(&data(batch * input, 1.0))?,
            slots: s.upload(&words)?,
            arena: s.upload(&data(2 * batch * 2 * hidden, 0.5))?,
            xh: s.upload(&data(batch * k, 1.0))?,
            // `[W_ih | W_hh]` as one [4H, input + H] matrix, the operand the runner packs.
            w: s.upload(&data(n * k, sc))?,
            bias: s.upload(&bias)?,
            gates: dev.alloc::<f32>(batch * n)?,
            h_out: dev.alloc::<f32>(batch * hidden)?,
        })
    }

    /// Floating-point operations of the step's GEMM: `2·b·(input+H)·4H`.
    pub fn flops(&self) -> f64 {
        step_flops(self.batch, self.input, self.hidden)
    }

    /// Queue the full step on `s`: gather `[x | h_prev]`, the GEMM (`blas` is bound to `s`),
    /// gates + scatter.
    pub fn step(&mut self, s: &Stream, blas: &mut Blas) -> Result<()> {
        let (b, input, h) = (self.batch as u32, self.input as u32, self.hidden as u32);
        let p = LstmGatherParams {
            x: self.x.device_ptr(),
            slots: self.slots.device_ptr(),
            arena: self.arena.device_ptr(),
            xh: self.xh.device_ptr(),
            input,
            hidden: h,
            rows: b,
            padded: b,
            x_ld: input,
            arena_slots: 2 * b,
            arena_width: 2 * h,
            offset: 0,
        };
        let units = (self.batch * (self.input + self.hidden)) as u64;
        // SAFETY: serve_lstm_gather takes one LstmGatherParams by value. By construction (`new`)
        // x is batch × input, slots holds batch words naming slots < 2·batch, the arena is
        // 2·batch slots of 2·hidden words, xh is batch × (input + hidden), and all sizes fit u32.
        // Every buffer is a field of `self`, which outlives the kernel (a buffer's drop
        // synchronises the context first); the host reaches them only through copies on `s`.
        unsafe { s.launch_with(&self.gather, LaunchConfig::linear(grid(units, BLOCK), BLOCK), &p) }?;
        self.gemm(blas)?;
        let p = LstmPointwiseParams {
            gates: self.gates.device_ptr(),
            bias: self.bias.device_ptr(),
            slots: self.slots.device_ptr(),
            arena: self.arena.device_ptr(),
            h_out: self.h_out.device_ptr(),
            hidden: h,
            rows: b,
            padded: b,
            h_out_ld: h,
            arena_slots: 2 * b,
            arena_width: 2 * h,
            offset: 0,
            _pad0: 0,
        };
        let units = (self.batch * self.hidden) as u64;
        // SAFETY: serve_lstm_pointwise takes one LstmPointwiseParams by value: gates
        // batch × 4·hidden, bias 4·hidden, batch slot words < 2·batch, the arena as above (words
        // 0..2·hidden of those slots written), h_out batch × hidden, all by construction;
        // lifetimes and host access as for the gather.
        unsafe { s.launch_with(&self.pointwise, LaunchConfig::linear(grid(units, BLOCK), BLOCK), &p) }
    }

    /// Queue the GEMM alone: `gates = xh · [W_ih | W_hh]ᵀ`.
    pub fn gemm(&mut self, blas: &mut Blas) -> Result<()> {
        let (n, k) = (4 * self.hidden, self.input + self.hidden);
        blas.gemm_nt(self.batch, n, k, 1.0, &self.xh, &self.w, 0.0, &mut self.gates)
    }
}
