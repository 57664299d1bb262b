//! The CUDA device runtime: [`CudaBackend`] implements the runtime's [`Backend`] for one GPU,
//! driven [`Driver::IssueThreads`]: each braid stream's steps are issued onto its CUDA stream
//! (`super::queue`) by a host thread of its own (a wait only once its record is issued), and
//! the GPU runs them behind. Issuing a small kernel costs more host time (a cuBLAS call alone
//! about 9 us on the H200's host) than the GPU takes to run it, so streams issued by one
//! thread in turns could not overlap.
//!
//! What a device has: the GPU's primary context and one [`Compiler`] per GPU for the process
//! (shared by every device on that GPU, so a kernel compiles once per process and, through
//! the disk cache, once per machine); its memory and lanes (`super::pools`,
//! `super::lanes`); an issue lock, so that two threads flushing the same device take turns
//! (each flush also waits, on the GPU, for everything enqueued before it, because a schedule
//! orders only its own steps); the kernels it has prepared, by the identity of the engine's
//! interned kernels.
//!
//! Host transfers outside flushes go on the transfer lane through pinned staging: an upload
//! returns at once (flushes and reads wait for it on the GPU), a download waits for everything
//! enqueued before it (the value's writer among it) and is the one place the host blocks.
//!
//! Must never: plan, fuse or reorder anything; use the legacy default stream; panic on a
//! run-time failure (every CUDA error is an `Err`, and the device stays usable).

use super::compile::{CompileStats, Compiler};
use super::context::{Event, Gpu};
use super::lanes::{TRANSFER, lock};
use super::launch::CudaKernel;
use super::pools::{CudaBuffer, CudaPools, Mem};
use super::queue::CudaFlush;
use crate::collective::RankGroup;
use crate::collective::net::TOKEN_BYTES;
use crate::runtime::tune::Tuner;
use crate::runtime::{Backend, Driver, Flush, Graph, Job};
use crate::{Buffer, DeviceBuffer, DeviceError, MemoryStats};
use braid_graph::{CostModel, DTypes, MemoryKind, Target};
use braid_lowering::Kernel;
use braid_scheduler::Schedule;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What an H100 (SXM, 80 GB HBM3) is like, for fusion, scheduling and offload placement.
///
/// The speeds are measured on the project's GPU machine, not datasheet figures: device memory
/// 2.85 TB/s (a device-to-device copy in PyTorch 2.11, read and write bytes counted) and f32
/// matrix products (no TF32) 51 TFLOP/s (both `../shared/gpu/README.md`); offload copies from
/// and to pinned host memory 53 GB/s both ways (256 MiB copies timed by CUDA events, printed by
/// the `cuda_device` test: PCIe 5.0 x16); and a floor of a few microseconds that every kernel
/// takes (launch and scheduling; the same test prints what a training step's small kernels
/// take), without which a copy would seem never hidden by small kernels. Buffers are slices of
/// the pool's chunks at its 64-byte alignment.
pub const CUDA_TARGET: Target = Target {
    name: "cuda",
    max_kernel_inputs: 16,
    max_row_reductions: 4,
    cost: CostModel {
        copy_bytes_per_sec: 50e9,
        kernel_bytes_per_sec: 2.8e12,
        flops_per_sec: 50e12,
        kernel_overhead_secs: 3e-6,
        allocation_granularity: crate::runtime::pool::ALIGN as u64,
    },
    work_granularity: 256,
    memory: MemoryKind::Device,
    copy_stream: true,
    dtypes: DTypes::ALL,
    // NVRTC compiles every kernel, in time that grows with its size (a chain of 2,000 fused
    // additions took 1.2 s), and a chain of 20,000 overflowed the printer's stack: as on wgpu.
    max_kernel_nodes: 512,
    // One device address per buffer in 4 KiB of kernel parameters (512, one kept for scratch;
    // drivers since CUDA 12.1 take 32 KiB on Volta and later, the smaller is assumed).
    max_kernel_buffers: 511,
    // Not measured on a GPU: the row kernel reads the view as it is.
    copies_transposed_rows: false,
    math: braid_graph::PlatformMath::TABLE,
    streams_overlap: true,
    // Large products with unaligned dimensions are recorded padded, so that readers and the
    // backward pass use the padded layout; `row_padding` pads at run time what is left (rows
    // of a transposed operand, odd `m`).
    product_padding: Some(braid_graph::ProductPadding {
        bytes: super::row_padding::ROW_BYTES,
        min_flops: super::row_padding::MIN_FLOPS,
    }),
};

/// Most kernels prepared per device before the table starts over (compiled modules stay with
/// the compiler).
const MAX_PREPARED: usize = 4096;

/// One kernel's run on the GPU, from CUDA event timestamps (see [`CudaBackend::set_timeline`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSpan {
    pub label: String,
    /// The braid stream it ran on.
    pub stream: u32,
    /// Microseconds from the start of the earliest span taken.
    pub start_us: f64,
    pub end_us: f64,
}

/// Timing events around kernels, when asked for.
#[derive(Default)]
pub(crate) struct Timeline {
    pub(crate) on: AtomicBool,
    pub(crate) spans: Mutex<Vec<(String, u32, Event, Event)>>,
}

/// The runtime of one CUDA GPU (see the module docs).
pub struct CudaBackend {
    name: String,
    pub(crate) pools: Arc<CudaPools>,
    pub(crate) compiler: Arc<Compiler>,
    /// The GPU's kernel variants chosen (`super::tune`), shared by its devices.
    pub(crate) tuner: Arc<Tuner>,
    /// Held by a flush from `begin` to its end.
    pub(crate) issue: Mutex<()>,
    prepared: Mutex<Prepared>,
    pub(crate) launched: AtomicU64,
    pub(crate) timeline: Timeline,
    /// Whether replayed steps are recorded into CUDA graphs (`BRAID_CUDA_GRAPHS=0`: not).
    pub(crate) graphs: AtomicBool,
    /// CUDA graphs launched since the device was created.
    pub(crate) graph_launches: AtomicU64,
}

/// Kernels ready to launch, by the address of the engine's interned kernel (held, so the
/// address is not reused while it is a key).
type Prepared = HashMap<usize, (Arc<Kernel>, Arc<CudaKernel>)>;

/// A GPU opened by this process, its compiler and its tuner.
type Shared = (Arc<Gpu>, Arc<Compiler>, Arc<Tuner>);

/// GPU `ordinal`, its compiler and its tuner, opened once per process.
fn open_gpu(ordinal: usize) -> Result<Shared, DeviceError> {
    static OPEN: Mutex<Vec<(usize, Shared)>> = Mutex::new(Vec::new());
    let mut open = lock(&OPEN);
    if let Some((_, shared)) = open.iter().find(|(o, _)| *o == ordinal) {
        return Ok(shared.clone());
    }
    let gpu = Gpu::open(ordinal)?;
    let compiler = Arc::new(Compiler::new(&gpu)?);
    let tuner = Arc::new(open_tuner(&gpu));
    open.push((ordinal, (gpu.clone(), compiler.clone(), tuner.clone())));
    Ok((gpu, compiler, tuner))
}

/// The tuner of `gpu`: its file in the kernel cache directory, under the GPU's name, its
/// architecture and multiprocessors, the driver's version and braid's (a new braid may print
/// kernels that tune otherwise).
fn open_tuner(gpu: &Gpu) -> Tuner {
    let (major, minor) = gpu.compute_capability;
    let device = format!(
        "{} (sm_{major}{minor}, {} SMs), driver {}, braid {}",
        gpu.name,
        gpu.multiprocessors,
        gpu.driver_version,
        env!("CARGO_PKG_VERSION")
    );
    let dir = super::disk_cache::DiskCache::default_dir()
        .and_then(|d| super::disk_cache::DiskCache::open(d).ok())
        .map(|c| c.dir().to_path_buf());
    Tuner::open(device, dir)
}

impl CudaBackend {
    /// A new device on GPU `ordinal`: `Err(Unavailable)` naming what is missing when the CUDA
    /// libraries or the GPU are not there. f32 products use TF32 when `BRAID_TF32=1`; replayed
    /// steps run as CUDA graphs unless `BRAID_CUDA_GRAPHS=0`.
    pub fn open(ordinal: usize) -> Result<CudaBackend, DeviceError> {
        let (gpu, compiler, tuner) = open_gpu(ordinal)?;
        let tf32 = std::env::var("BRAID_TF32").is_ok_and(|v| v.trim() == "1");
        let pools = CudaPools::new(&gpu, tf32)?;
        Ok(CudaBackend {
            name: format!("cuda:{ordinal}"),
            pools,
            compiler,
            tuner,
            issue: Mutex::new(()),
            prepared: Mutex::new(HashMap::new()),
            launched: AtomicU64::new(0),
            timeline: Timeline::default(),
            graphs: AtomicBool::new(std::env::var("BRAID_CUDA_GRAPHS").map_or(true, |v| v.trim() != "0")),
            graph_launches: AtomicU64::new(0),
        })
    }

    /// Whether replays of steps captured from now on are recorded into CUDA graphs (on unless
    /// `BRAID_CUDA_GRAPHS=0`); graphs recorded already stay.
    pub fn set_graphs(&self, on: bool) {
        self.graphs.store(on, Ordering::Relaxed);
    }

    /// CUDA graphs launched so far (replays of recorded steps).
    pub fn graph_launches(&self) -> u64 {
        self.graph_launches.load(Ordering::Relaxed)
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.pools.gpu
    }

    /// What the GPU's compiler did (compiled, cache hits, rejected disk entries) in this
    /// process, over every device on the GPU.
    pub fn compile_stats(&self) -> CompileStats {
        self.compiler.stats()
    }

    /// The CUDA streams this device keeps for braid's streams (its lanes, `super::lanes`):
    /// at most `KEPT_LANES` (8) however many braid streams the program makes, unless one flush
    /// uses more, and the cuBLAS handles with them.
    pub fn cuda_streams(&self) -> (usize, usize) {
        let st = self.pools.state();
        (st.lanes.lanes.len() - 1, st.blas.len())
    }

    /// Pinned host memory (offloaded values, staging).
    pub fn pinned_memory(&self) -> MemoryStats {
        self.pools.pinned_stats()
    }

    /// Records CUDA timing events around every kernel from now on (`true`), or stops.
    pub fn set_timeline(&self, on: bool) {
        self.timeline.on.store(on, Ordering::SeqCst);
    }

    /// The kernels run since the timeline was turned on or last taken, with their times on
    /// the GPU; waits for the GPU first.
    pub fn take_timeline(&self) -> Result<Vec<KernelSpan>, DeviceError> {
        let spans = std::mem::take(&mut *lock(&self.timeline.spans));
        self.pools.gpu.synchronize()?;
        let Some((_, _, base, _)) = spans.first() else { return Ok(Vec::new()) };
        let mut out = Vec::with_capacity(spans.len());
        for (label, stream, start, end) in &spans {
            let at = |e: &Event| e.elapsed_ms_since(base).map(|ms| f64::from(ms) * 1e3);
            out.push(KernelSpan { label: label.clone(), stream: *stream, start_us: at(start)?, end_us: at(end)? });
        }
        let t0 = out.iter().map(|s| s.start_us).fold(f64::INFINITY, f64::min);
        for s in &mut out {
            s.start_us -= t0;
            s.end_us -= t0;
        }
        Ok(out)
    }

    /// `kernel` ready to launch: prepared once per interned kernel (the compiler caches by
    /// structure and source behind this).
    pub(crate) fn prepared(&self, kernel: &Arc<Kernel>) -> Result<Arc<CudaKernel>, DeviceError> {
        let key = Arc::as_ptr(kernel) as usize;
        if let Some((_, k)) = lock(&self.prepared).get(&key) {
            return Ok(k.clone());
        }
        let compiled = self.compiler.kernel(kernel)?;
        let mut prepared = lock(&self.prepared);
        if prepared.len() >= MAX_PREPARED {
            prepared.clear();
        }
        // The table holds the kernel, so its address is not reused while the key is there.
        prepared.insert(key, (kernel.clone(), compiled.clone()));
        Ok(compiled)
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn target(&self) -> &Target {
        &CUDA_TARGET
    }

    fn driver(&self) -> Driver {
        Driver::IssueThreads
    }

    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        Ok(Box::new(CudaFlush::begin(self, schedule, poison)?))
    }

    fn upload(&self, bytes: &[u8], poison: bool) -> Result<Buffer, DeviceError> {
        let pools = &self.pools;
        pools.gpu.bind()?;
        let buffer = pools.buffer(Some(TRANSFER), bytes.len(), Mem::Device, false, poison)?;
        pools.write(TRANSFER, buffer.addr(), bytes.len(), |dst| {
            dst.copy_from_slice(bytes);
            Ok(())
        })?;
        // A marker after the copy: flushes and reads wait for it, and the staging memory
        // returns once it is reached.
        let marker = pools.events.get()?;
        pools.state().lanes.record(TRANSFER, marker)?;
        Ok(Buffer::new(Arc::new(buffer)))
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError> {
        match buffer.get::<CudaBuffer>() {
            Some(b) if Arc::ptr_eq(b.pools(), &self.pools) => {
                let mut bytes = vec![0u8; b.bytes()];
                b.read_into(&mut bytes)?;
                Ok(bytes)
            }
            _ => Err(DeviceError::Internal(format!(
                "{} cannot download a buffer of another device ({buffer:?})",
                self.name
            ))),
        }
    }

    fn synchronize(&self) -> Result<(), DeviceError> {
        self.pools.synchronize()
    }

    fn memory(&self) -> MemoryStats {
        let (in_use, peak, reserved) = self.pools.stats();
        MemoryStats { in_use, peak, reserved }
    }

    fn reset_peak(&self) {
        self.pools.reset_peak()
    }

    fn kernels_launched(&self) -> u64 {
        self.launched.load(Ordering::Relaxed)
    }

    fn trim(&self) {
        // No flush may run meanwhile: the cuBLAS workspaces go back too.
        let _issue = lock(&self.issue);
        let trimmed = self.pools.quiesce().map(|()| {
            self.pools.drop_blas();
            self.pools.quiesce()
        });
        if let Err(e) | Ok(Err(e)) = trimmed {
            tracing::warn!(target: super::TRACE_TARGET, "trimming {}: {e}", self.name);
        }
    }

    fn persistent_memory(&self) -> u64 {
        self.pools.persistent()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// NCCL communicators between the members (all CUDA devices), with the `nccl` feature.
    fn connect_group(&self, members: &[&dyn Backend], group: &Arc<RankGroup>) -> Result<(), DeviceError> {
        let cuda: Vec<&CudaBackend> = members.iter().filter_map(|b| b.as_any().downcast_ref()).collect();
        if cuda.len() != members.len() {
            return Err(DeviceError::Internal("a CUDA group with a member of another backend".into()));
        }
        #[cfg(feature = "nccl")]
        return super::nccl::connect(&cuda, group);
        #[cfg(not(feature = "nccl"))]
        {
            let _ = group;
            Err(DeviceError::Unavailable(
                "collectives between CUDA devices need NCCL: build braid with the `nccl` feature".into(),
            ))
        }
    }

    /// Rank 0 makes the NCCL unique id; the others offer zeros.
    fn spanning_token(&self, rank: u32) -> Result<[u8; TOKEN_BYTES], DeviceError> {
        #[cfg(feature = "nccl")]
        return if rank == 0 { super::nccl::unique_id() } else { Ok([0; TOKEN_BYTES]) };
        #[cfg(not(feature = "nccl"))]
        {
            let _ = rank;
            Err(DeviceError::Unavailable(
                "groups of CUDA devices spanning processes need NCCL: build braid with the `nccl` feature".into(),
            ))
        }
    }

    #[cfg(feature = "nccl")]
    fn connect_spanning(&self, group: &Arc<RankGroup>, token: [u8; TOKEN_BYTES]) -> Result<(), DeviceError> {
        super::nccl::connect_rank(self, group, token)
    }

    fn record_graph(&self, job: Job<'_>, bound: &[Option<Buffer>]) -> Option<Result<Box<dyn Graph>, DeviceError>> {
        super::graph::record(self, job, bound)
    }

    fn kernel_variant(&self, kernel: &Arc<Kernel>) -> Option<String> {
        let compiled = lock(&self.prepared).get(&(Arc::as_ptr(kernel) as usize))?.1.clone();
        let v = compiled.variants()?;
        // The default (variant 0: `default`, a product's `cublas`) is not named.
        let chosen = self.tuner.chosen(&v.key, &v.variants);
        (chosen != 0).then(|| v.variants[chosen].name.clone())
    }
}
