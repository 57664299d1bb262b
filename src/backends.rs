//! The backends this build of braid can create devices on, behind their cargo features. Each
//! function returns the runtime of one device, or an `Err` saying why there is none (never a
//! panic): the feature is off, a library is missing, the hardware is absent.

use crate::error::{Error, Result};
use braid_devices::Backend;
use std::sync::Arc;

/// The runtime of CUDA GPU `ordinal`.
#[cfg(feature = "cuda")]
pub(crate) fn cuda(ordinal: usize) -> Result<Arc<dyn Backend>> {
    match braid_devices::cuda::CudaBackend::open(ordinal) {
        Ok(backend) => Ok(Arc::new(backend)),
        Err(e) => Err(Error::Unavailable(format!("cuda:{ordinal} is unavailable: {e}"))),
    }
}

/// The runtime of CUDA GPU `ordinal`.
#[cfg(not(feature = "cuda"))]
pub(crate) fn cuda(ordinal: usize) -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable(format!(
        "cuda:{ordinal} is unavailable: this build of braid has no CUDA backend (build with the `cuda` feature)"
    )))
}

/// The runtime of the first wgpu adapter (of the backends `WGPU_BACKEND` names, every one
/// compiled in when unset).
#[cfg(feature = "wgpu")]
pub(crate) fn wgpu() -> Result<Arc<dyn Backend>> {
    match braid_devices::wgpu::WgpuBackend::open() {
        Ok(backend) => Ok(Arc::new(backend)),
        Err(e) => Err(Error::Unavailable(format!("wgpu is unavailable: {e}"))),
    }
}

/// The runtime of the first wgpu adapter.
#[cfg(not(feature = "wgpu"))]
pub(crate) fn wgpu() -> Result<Arc<dyn Backend>> {
    Err(Error::Unavailable(
        "wgpu is unavailable: this build of braid has no wgpu backend (build with the `wgpu` feature)".into(),
    ))
}

/// Sets up the transport of a new group of `devices`: CPU devices meet at the host rendezvous
/// alone; CUDA devices also get NCCL communicators. `Err(Unavailable)` for anything else.
pub(crate) fn connect_group(
    devices: &[crate::Device],
    group: &Arc<braid_devices::collective::RankGroup>,
) -> std::result::Result<(), braid_devices::DeviceError> {
    let backends: Vec<&dyn Backend> = devices.iter().map(|d| d.engine().backend.as_ref()).collect();
    if backends.iter().all(|b| b.as_any().is::<braid_devices::cpu::CpuDevice>()) {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    {
        let cuda: Vec<&braid_devices::cuda::CudaBackend> =
            backends.iter().filter_map(|b| b.as_any().downcast_ref()).collect();
        if cuda.len() == backends.len() {
            #[cfg(feature = "nccl")]
            return braid_devices::cuda::nccl::connect(&cuda, group);
            #[cfg(not(feature = "nccl"))]
            return Err(braid_devices::DeviceError::Unavailable(
                "collectives between CUDA devices need NCCL: build braid with the `nccl` feature".into(),
            ));
        }
    }
    let _ = group;
    let names: Vec<String> = devices.iter().map(|d| d.name()).collect();
    Err(braid_devices::DeviceError::Unavailable(format!(
        "collectives run between CPU devices or between CUDA devices, not over {}",
        names.join(", ")
    )))
}

/// The setup token rank `rank` of a group spanning processes offers the others: rank 0 of a
/// CUDA group makes the NCCL unique id; everything else offers zeros.
pub(crate) fn spanning_token(
    device: &crate::Device,
    rank: u32,
) -> std::result::Result<[u8; braid_devices::collective::net::TOKEN_BYTES], braid_devices::DeviceError> {
    let backend = device.engine().backend.as_any();
    if backend.is::<braid_devices::cpu::CpuDevice>() {
        return Ok([0; braid_devices::collective::net::TOKEN_BYTES]);
    }
    #[cfg(feature = "nccl")]
    if backend.is::<braid_devices::cuda::CudaBackend>() {
        return if rank == 0 {
            braid_devices::cuda::nccl::unique_id()
        } else {
            Ok([0; braid_devices::collective::net::TOKEN_BYTES])
        };
    }
    let _ = rank;
    Err(braid_devices::DeviceError::Unavailable(format!(
        "groups spanning processes run on CPU devices or, with the `nccl` feature, CUDA devices; not on {}",
        device.name()
    )))
}

/// Sets up this process's transport in a group spanning processes, once every process has
/// joined and rank 0's `token` arrived.
pub(crate) fn connect_spanning(
    device: &crate::Device,
    group: &Arc<braid_devices::collective::RankGroup>,
    rank: u32,
    world: u32,
    token: [u8; braid_devices::collective::net::TOKEN_BYTES],
) -> std::result::Result<(), braid_devices::DeviceError> {
    #[cfg(feature = "nccl")]
    if let Some(cuda) = device.engine().backend.as_any().downcast_ref::<braid_devices::cuda::CudaBackend>() {
        return braid_devices::cuda::nccl::connect_rank(cuda, group, rank, world, token);
    }
    let _ = (device, group, rank, world, token);
    Ok(())
}
