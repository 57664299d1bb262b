//! NCCL for groups of CUDA devices: one communicator per rank, made for the whole group at once
//! (`ncclCommInitAll`) when one process drives every GPU, or one per process
//! (`ncclCommInitRank`, with the unique id rank 0 hands out through `collective::net`) when
//! the group spans processes; each rank's part of a collective is enqueued on the lane of its
//! braid stream, like any kernel.
//!
//! The ranks first meet at the group's host rendezvous (`crate::collective`): that checks they
//! agree on what the `k`-th collective is, flushes a rank that is late, and turns a failed or
//! missing rank into an `Err` before anything is enqueued, so a broken group never leaves a
//! GPU spinning in an NCCL kernel that waits for a peer that will not come.
//!
//! Loaded at run time like the other CUDA libraries: a missing NCCL is an `Err` when the group
//! is made. Must never: enqueue a collective before every rank has arrived at it.

use super::device::CudaBackend;
use crate::DeviceError;
use crate::collective::RankGroup;
use braid_graph::{Collective, CollectiveKind, DType, ReduceOp};
use cudarc::nccl::{result, sys};

/// The communicators this process holds for a group: (rank, communicator).
pub(crate) struct Comms {
    comms: Vec<(u32, Comm)>,
}

struct Comm(sys::ncclComm_t);

// SAFETY: a communicator is used by one rank's issuing thread at a time (its device's issue
// lock orders the flushes that use it), and destroyed only when no flush holds the group.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: nothing uses the communicator any more (the group is gone); destroying it
        // finalizes what is still enqueued first.
        unsafe {
            let _ = result::comm_destroy(self.0);
        }
    }
}

fn failed(what: &str, e: result::NcclError) -> DeviceError {
    DeviceError::Collective(format!("NCCL {what} failed: {e:?}"))
}

/// Makes the communicators of a group of `backends` (rank `r` is `backends[r]`).
pub fn connect(backends: &[&CudaBackend], group: &RankGroup) -> Result<(), DeviceError> {
    // SAFETY: only looks for the library.
    if !unsafe { sys::is_culib_present() } {
        return Err(DeviceError::Unavailable(
            "NCCL (libnccl.so.2) was not found; CUDA collectives need it (install NCCL or put it on LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let ordinals: Vec<i32> = backends.iter().map(|b| b.pools.gpu.ordinal as i32).collect();
    for (i, o) in ordinals.iter().enumerate() {
        if ordinals[..i].contains(o) {
            return Err(DeviceError::Unavailable(format!(
                "GPU {o} appears twice in the group; NCCL needs one GPU per rank"
            )));
        }
    }
    let mut raw = vec![std::ptr::null_mut(); ordinals.len()];
    // SAFETY: `raw` has room for one communicator per listed device.
    unsafe { result::comm_init_all(raw.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr()) }
        .map_err(|e| failed("ncclCommInitAll", e))?;
    // The NCCL calls may change the thread's current context: braid binds its own before use.
    let comms = raw.into_iter().enumerate().map(|(r, c)| (r as u32, Comm(c))).collect();
    group.set_transport(Box::new(Comms { comms }));
    tracing::debug!(target: "braid::dist", "group {}: NCCL communicators on GPUs {ordinals:?}", group.id());
    Ok(())
}

fn nccl_present() -> Result<(), DeviceError> {
    // SAFETY: only looks for the library.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(DeviceError::Unavailable(
            "NCCL (libnccl.so.2) was not found; CUDA collectives need it (install NCCL or put it on LD_LIBRARY_PATH)"
                .into(),
        ))
    }
}

/// A new NCCL unique id, as the setup token rank 0 hands the other processes of a group.
pub fn unique_id() -> Result<[u8; crate::collective::net::TOKEN_BYTES], DeviceError> {
    nccl_present()?;
    let id = result::get_uniqueid().map_err(|e| failed("ncclGetUniqueId", e))?;
    Ok(id.internal.map(|c| c as u8))
}

/// This process's communicator in `group`, a group spanning processes (its one local rank, of
/// the group's size), on `backend`'s GPU, from the unique id rank 0 handed out (`token`).
pub fn connect_rank(
    backend: &CudaBackend,
    group: &RankGroup,
    token: [u8; crate::collective::net::TOKEN_BYTES],
) -> Result<(), DeviceError> {
    let (&[rank], world) = (group.local_ranks(), group.size()) else {
        return Err(DeviceError::Internal("a group spanning processes holds one rank here".into()));
    };
    nccl_present()?;
    backend.pools.gpu.bind()?;
    let id = sys::ncclUniqueId { internal: token.map(|b| b as std::ffi::c_char) };
    let mut comm = std::ptr::null_mut();
    // SAFETY: `comm` receives one communicator; every rank passes the same id and world size.
    unsafe { result::comm_init_rank(&mut comm, world as i32, id, rank as i32) }
        .map_err(|e| failed("ncclCommInitRank", e))?;
    group.set_transport(Box::new(Comms { comms: vec![(rank, Comm(comm))] }));
    Ok(())
}

fn data_type(dtype: DType) -> Result<sys::ncclDataType_t, DeviceError> {
    use sys::ncclDataType_t::*;
    Ok(match dtype {
        DType::F32 => ncclFloat32,
        DType::F64 => ncclFloat64,
        DType::F16 => ncclFloat16,
        DType::BF16 => ncclBfloat16,
        DType::I32 => ncclInt32,
        DType::I64 => ncclInt64,
        DType::U8 | DType::Bool => ncclUint8,
    })
}

fn red_op(op: ReduceOp) -> Result<sys::ncclRedOp_t, DeviceError> {
    use sys::ncclRedOp_t::*;
    Ok(match op {
        ReduceOp::Sum => ncclSum,
        ReduceOp::Mean => ncclAvg,
        ReduceOp::Max => ncclMax,
        ReduceOp::Min => ncclMin,
        ReduceOp::ArgMax => return Err(DeviceError::Internal("argmax is not a collective reduction".into())),
    })
}

/// Enqueues rank `c.rank`'s part of `c` on `stream`: `count` elements of `dtype` at `send`
/// (device address), the result at `recv`. Every rank has arrived at the rendezvous.
///
/// # Safety
/// `send` and `recv` are live device buffers of the sizes `c` implies, not accessed by other
/// work until the stream passes this point.
pub(crate) unsafe fn enqueue(
    group: &RankGroup,
    c: &Collective,
    dtype: DType,
    count: usize,
    send: u64,
    recv: u64,
    stream: cudarc::driver::sys::CUstream,
) -> Result<(), DeviceError> {
    let comms = group
        .transport::<Comms>()
        .ok_or_else(|| DeviceError::Internal(format!("group {} has no NCCL communicators", group.id())))?;
    let comm = (comms.comms.iter().find(|(r, _)| *r == c.rank))
        .ok_or_else(|| DeviceError::Internal(format!("this process holds no communicator of rank {}", c.rank)))?
        .1
        .0;
    let (send, recv) = (send as *const std::ffi::c_void, recv as *mut std::ffi::c_void);
    let ty = data_type(dtype)?;
    let stream = stream as sys::cudaStream_t;
    // SAFETY: the caller's contract; the communicator belongs to this rank.
    unsafe {
        match c.kind {
            CollectiveKind::AllReduce(op) => result::all_reduce(send, recv, count, ty, red_op(op)?, comm, stream),
            CollectiveKind::AllGather => result::all_gather(send, recv, count, ty, comm, stream),
            CollectiveKind::ReduceScatter(op) => {
                result::reduce_scatter(send, recv, count / c.size as usize, ty, red_op(op)?, comm, stream)
            }
            CollectiveKind::Broadcast { root } => result::broadcast(send, recv, count, ty, root as i32, comm, stream),
        }
    }
    .map(|_| ())
    .map_err(|e| failed(c.kind.name(), e))
}
