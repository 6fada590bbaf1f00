//! [`CudaBackend`]: the CUDA [`Backend`] — one device, its kernels and cuBLAS, preparing models as
//! CUDA runners (`runner.rs`: recurrent models in `recurrent.rs`, mlp in `mlp.rs`).

use std::sync::Arc;

use super::bert::BertGpu;
use super::mlp::Dense;
use super::recurrent::Recurrent;
use super::resnet::ResNetGpu;
use super::runner::{CudaRunner, Kernels};
use super::{CudaDevice, Module, libs};
use crate::backend::{Backend, BackendKind, Notify, Runner, RunnerShape};
use crate::error::Result;
use crate::model::Network;

/// The CUDA backend: device `ordinal`'s primary context, the crate's kernels loaded into it, and
/// cuBLAS. Models prepared on it share the device; each worker gets its own stream.
pub struct CudaBackend {
    device: CudaDevice,
    module: Arc<Module>,
    description: String,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend").field("device", &self.device).finish()
    }
}

impl CudaBackend {
    /// Open device `ordinal`, check cuBLAS, and load the kernels (the embedded fatbin, or NVRTC).
    /// `Unavailable` when the driver, the device, cuBLAS or a usable kernel image is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        let device = CudaDevice::open(ordinal)?;
        let blas = libs::cublas()?;
        let module = device.kernels()?;
        Kernels::load(&module)?; // every kernel is there
        let description = format!(
            "cuda: device {}, kernels: {}, cuBLAS {} (FP32, TF32 off)",
            device.info(),
            module.describe(),
            blas.name()
        );
        Ok(CudaBackend { device, module, description })
    }

    pub fn device(&self) -> &CudaDevice {
        &self.device
    }
}

impl Backend for CudaBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Cuda
    }

    fn describe(&self) -> String {
        self.description.clone()
    }

    /// `notify` is used only by a custom model's host streams: the device cannot wake a parked
    /// thread, so CUDA signals say they do not notify and the poller spins while CUDA tasks are in
    /// flight.
    fn prepare(&self, net: Arc<Network>, shape: RunnerShape, notify: Notify) -> Result<Box<dyn Runner>> {
        let stream = self.device.stream()?;
        match &*net {
            Network::ResNet(_) => {
                let model = ResNetGpu::new(&stream, &net, shape.max_batch)?;
                Ok(Box::new(CudaRunner::new(&self.device, &self.module, model, shape)?))
            }
            Network::Bert(_) => {
                let model = BertGpu::new(&self.device, &stream, &net, shape.max_batch)?;
                Ok(Box::new(CudaRunner::new(&self.device, &self.module, model, shape)?))
            }
            Network::Mlp(_) => {
                let model = Dense::new(&stream, &net, shape.max_batch)?;
                Ok(Box::new(CudaRunner::new(&self.device, &self.module, model, shape)?))
            }
            // The caller's engine runs on host threads; a call may use the machine's cores.
            Network::Custom(_) => Ok(Box::new(crate::backend::custom::CustomRunner::new(
                &net,
                shape.workers,
                shape.max_batch,
                std::thread::available_parallelism().map_or(1, |n| n.get()),
                notify,
            )?)),
            Network::Lstm(_) | Network::Seq2Seq(_) | Network::TreeLstm(_) => {
                let model = Recurrent::new(&self.device, &stream, &net, shape)?;
                Ok(Box::new(CudaRunner::new(&self.device, &self.module, model, shape)?))
            }
        }
    }
}
