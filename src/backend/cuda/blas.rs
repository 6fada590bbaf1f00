//! cuBLAS, for the batched LSTM cell's one GEMM per step (ARCHITECTURE.md §5): `G = X · [W_ih | W_hh]ᵀ`.

use cudarc::cublas::result as blas;
use cudarc::cublas::sys::{self as bsys, cublasMath_t, cublasOperation_t};

use super::driver::bind;
use super::libs;
use super::memory::DeviceBuffer;
use super::stream::Stream;
use crate::error::{Code, Error, Result};

/// A cuBLAS handle bound to one stream (one per worker: handles are not for concurrent use).
/// FP32 GEMMs run in full FP32 unless TF32 is switched on.
#[derive(Debug)]
pub struct Blas {
    handle: bsys::cublasHandle_t,
    stream: Stream,
}

// SAFETY: a cuBLAS handle may be used from any thread, one thread at a time; every method that
// uses it takes `&mut self`, so sharing `&Blas` across threads cannot reach it concurrently.
unsafe impl Send for Blas {}
// SAFETY: as above: `&self` methods do not touch the handle.
unsafe impl Sync for Blas {}

fn blas_error(call: &str, e: blas::CublasError) -> Error {
    Error::new(Code::Backend, format!("{call} failed: {:?}", e.0))
}

impl Blas {
    /// A handle issuing its work on `stream`. `Unavailable` when cuBLAS cannot be loaded.
    pub fn new(stream: &Stream) -> Result<Blas> {
        libs::cublas()?;
        bind(stream.cudarc().context())?;
        let handle = blas::create_handle().map_err(|e| blas_error("cublasCreate", e))?;
        let b = Blas { handle, stream: stream.clone() };
        // SAFETY: a live handle; the stream belongs to the context current on this thread and
        // outlives the handle (`b` keeps a clone of it).
        unsafe { blas::set_stream(b.handle, stream.raw().cast()) }
            .map_err(|e| blas_error("cublasSetStream", e))?;
        Ok(b)
    }

    pub fn stream(&self) -> &Stream {
        &self.stream
    }

    /// Allow TF32 tensor-core math for FP32 GEMMs (faster, ~10-bit mantissa products). Off by
    /// default.
    pub fn set_tf32(&mut self, on: bool) -> Result<()> {
        let mode =
            if on { cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH } else { cublasMath_t::CUBLAS_DEFAULT_MATH };
        // SAFETY: a live handle; the mode is a valid enum value.
        unsafe { bsys::cublasSetMathMode(self.handle, mode) }
            .result()
            .map_err(|e| blas_error("cublasSetMathMode", e))
    }

    /// Queue, on the handle's stream, the row-major product `C = alpha · A · Bᵀ + beta · C` with
    /// `A` m×k, `B` n×k and `C` m×n — the shape of `X · Wᵀ` for a batch `X` and PyTorch-layout
    /// weights `W`.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_nt(
        &mut self,
        m: usize,
        n: usize,
        k: usize,
        alpha: f32,
        a: &DeviceBuffer<f32>,
        b: &DeviceBuffer<f32>,
        beta: f32,
        c: &mut DeviceBuffer<f32>,
    ) -> Result<()> {
        let fits = |what: &str, have: usize, need: Option<usize>| match need {
            Some(need) if need <= have => Ok(()),
            _ => Err(Error::invalid(format!("gemm {m}x{n}x{k}: {what} has {have} elements, too few"))),
        };
        fits("A", a.len(), m.checked_mul(k))?;
        fits("B", b.len(), n.checked_mul(k))?;
        fits("C", c.len(), m.checked_mul(n))?;
        let dim =
            |v: usize| i32::try_from(v).map_err(|_| Error::invalid(format!("gemm dimension {v} too large")));
        let (mi, ni, ki) = (dim(m)?, dim(n)?, dim(k)?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        let ctx = self.stream.cudarc().context();
        for (what, buf_ctx) in [("A", a.context()), ("B", b.context()), ("C", c.context())] {
            if **buf_ctx != **ctx {
                return Err(Error::invalid(format!("gemm: {what} belongs to another CUDA context")));
            }
        }
        bind(ctx)?;
        // Row-major C (m×n) is column-major Cᵀ (n×m) = B · Aᵀ: column-major B is Bᵀ (k×n, ld k),
        // so op = T gives B (n×k); column-major A is Aᵀ (k×m, ld k), op = N.
        // SAFETY: a live handle on the buffers' context (bound); the three device ranges were
        // checked to hold m·k, n·k and m·n floats and stay allocated until the GEMM has run
        // (buffers wait for the device before freeing); alpha and beta are host scalars read
        // during the call (default pointer mode).
        let r = unsafe {
            blas::sgemm(
                self.handle,
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                &alpha,
                b.device_ptr() as *const f32,
                ki.max(1),
                a.device_ptr() as *const f32,
                ki.max(1),
                &beta,
                c.device_ptr() as *mut f32,
                ni,
            )
        };
        r.map_err(|e| blas_error("cublasSgemm", e))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let ctx = self.stream.cudarc().context();
        ctx.record_err(ctx.bind_to_thread());
        // SAFETY: the handle was created in `new` and is destroyed only here; cublasDestroy waits
        // for the handle's queued work. A failure leaves nothing to clean up.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}
