//! The CPU device: a memory pool, and queues (`queue`) that run each step as the runtime
//! issues it, one stream per thread; kernels use data parallelism (rayon) and `gemm` for matrix
//! products. Kernels of map loops are interpreted (`map`, `eval`) or, once compiled by the
//! system's C compiler, run as machine code (`native`), with the same results.
//!
//! It executes exactly what the runtime issues; it never reorders steps or decides lifetimes.

mod attention;
pub mod eval;
mod gather;
mod graph;
mod keep;
pub mod map;
pub mod matmul;
pub mod native;
mod quant;
mod queue;
mod reduce;
pub mod rows;
mod scatter;
mod scatter_write;
mod split;
mod tile;
pub mod tune;

/// braid's f32 `exp` and `tanh` (defined next to the kernel IR, whose host C printer prints them).
pub use braid_lowering::vmath;

use crate::collective::RankGroup;
use crate::collective::net::TOKEN_BYTES;
use crate::runtime::pool::{HostMemory, Pool, Slice};
use crate::runtime::{Backend, Driver, Flush};
use crate::{Buffer, DeviceBuffer, DeviceError, MemoryStats};
use braid_graph::{MemoryKind, Target};
use braid_lowering::{Arg, Body, Kernel, MapLoop, MatmulKernel, QuantMatmulKernel};
use braid_scheduler::{BufferPlan, Schedule, Space};
use map::ArgPtr;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub use crate::runtime::CompileMode;

/// The CPU as the engine's registry knows it: `cpu` opens a device named `cpu`, `cpu:N` one
/// named `cpu:N` (each a new device with its own pool and statistics).
pub fn registration() -> crate::Registration {
    crate::Registration::new("cpu", |ordinal| {
        Ok(Arc::new(match ordinal {
            None => CpuDevice::new(),
            Some(n) => CpuDevice::named(format!("cpu:{n}")),
        }))
    })
}

impl CompileMode {
    /// The mode `BRAID_CPU_COMPILE` asks for (`1`/`on`/`true` are the default, `Background`;
    /// unset or unknown values give it too: a flush reports unknown ones).
    pub fn from_env() -> CompileMode {
        match std::env::var("BRAID_CPU_COMPILE").map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            Ok("0" | "off" | "false" | "no") => CompileMode::Off,
            Ok("blocking") => CompileMode::Blocking,
            _ => CompileMode::Background,
        }
    }
}

/// A buffer of CPU memory taken from the pool; returned to it when dropped.
pub struct CpuBuffer {
    slice: Option<Slice>,
    bytes: usize,
    pool: Arc<Pool>,
    poison: bool,
    /// Exact-size memory for a parameter.
    exact: bool,
    /// Offload memory (the host pool), not the device's.
    host: bool,
}

// SAFETY: the memory is owned by this buffer until it is dropped; concurrent access is ordered
// by the schedule (validated before execution).
unsafe impl Send for CpuBuffer {}
unsafe impl Sync for CpuBuffer {}

impl CpuBuffer {
    /// Start of the buffer (dangling but aligned when it holds zero bytes).
    pub fn ptr(&self) -> *mut u8 {
        self.slice.as_ref().map_or(NonNull::<u64>::dangling().as_ptr() as *mut u8, |s| s.addr as *mut u8)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The contents (a copy).
    pub fn read(&self) -> Vec<u8> {
        // SAFETY: the buffer holds `bytes` initialised bytes (every buffer is written by the
        // kernel or upload that produced it before anyone reads it).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.bytes).to_vec() }
    }
}

impl DeviceBuffer for CpuBuffer {
    fn bytes(&self) -> usize {
        self.bytes
    }

    fn is_persistent(&self) -> bool {
        self.exact
    }

    fn is_offloaded(&self) -> bool {
        self.host
    }

    fn memory_kind(&self) -> MemoryKind {
        MemoryKind::Host
    }

    fn read_into(&self, dst: &mut [u8]) -> Result<(), DeviceError> {
        if dst.len() != self.bytes {
            return Err(DeviceError::Internal(format!("a read of {} bytes into {}", self.bytes, dst.len())));
        }
        // SAFETY: the buffer holds `bytes` initialised bytes, and the lengths match.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr(), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        if let Some(s) = self.slice.take() {
            if self.poison {
                // SAFETY: the slice is ours until it goes back to the pool below.
                unsafe { std::ptr::write_bytes(s.addr as *mut u8, 0xFF, s.size) };
            }
            self.pool.free(s);
        }
    }
}

impl std::fmt::Debug for CpuBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CpuBuffer({} B at {:p})", self.bytes, self.ptr())
    }
}

/// What a recorded graph keeps for one of its kernels between launches (see
/// `CpuDevice::run_keeping`).
#[derive(Default)]
pub(crate) struct KeptKernel {
    /// Its compiled library, once it has one.
    compiled: std::sync::OnceLock<Arc<native::NativeKernel>>,
    /// Whether a compiled run checked the library's accesses against the arguments.
    checked: AtomicBool,
    /// Its tuned task size (`tune`), once settled.
    task: std::sync::OnceLock<usize>,
}

/// The CPU device runtime. Its pool is the device memory that `memory()` reports and budgets
/// cap; offloaded values go to a separate host pool.
pub struct CpuDevice {
    name: String,
    pool: Arc<Pool>,
    host_pool: Arc<Pool>,
    kernels: AtomicU64,
    /// Replays run as CPU graphs ([`graph`]).
    graph_launches: AtomicU64,
    prepared: std::sync::Mutex<Prepared>,
    native: native::Native,
}

impl Default for CpuDevice {
    fn default() -> CpuDevice {
        CpuDevice {
            name: "cpu".into(),
            pool: Arc::new(Pool::new(HostMemory)),
            host_pool: Arc::new(Pool::new(HostMemory)),
            kernels: AtomicU64::new(0),
            graph_launches: AtomicU64::new(0),
            prepared: Default::default(),
            native: Default::default(),
        }
    }
}

impl CpuDevice {
    pub fn new() -> CpuDevice {
        CpuDevice::default()
    }

    /// A CPU device called `name` in messages and dumps (independent CPU devices are told
    /// apart this way: `cpu:1`, `cpu:2`, ...).
    pub fn named(name: impl Into<String>) -> CpuDevice {
        CpuDevice { name: name.into(), ..CpuDevice::default() }
    }

    /// How many replayed steps ran as CPU graphs (without the walker; see [`graph`]).
    pub fn graph_launches(&self) -> u64 {
        self.graph_launches.load(Ordering::Relaxed)
    }

    /// [`CpuDevice::run`] with the task size the thread has set.
    fn run_untuned(&self, kernel: &Arc<Kernel>, args: &[ArgPtr]) -> Result<(), String> {
        match &kernel.body {
            Body::Matmul(m) => return self.run_matmul(kernel, m, args),
            Body::QuantMatmul(q) => return self.run_quant_matmul(kernel, q, args),
            _ => {}
        }
        let reordered;
        let kernel = match &kernel.body {
            Body::Map(loops) if loops.iter().any(tile::reorders) => {
                reordered = self.reordered_map(kernel);
                &reordered
            }
            _ => kernel,
        };
        let plan = match &kernel.body {
            Body::Rows(r) => {
                let key = Arc::as_ptr(kernel) as usize;
                let mut prep = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
                if prep.rows.len() >= MAX_PREPARED {
                    prep.rows.clear();
                }
                Some((r, prep.rows.entry(key).or_insert_with(|| (kernel.clone(), Arc::new(rows::plan(r)))).1.clone()))
            }
            _ => None,
        };
        // Rows split across threads are compiled in their split form (`split` keeps the
        // segments and their combine).
        let planned_rows = plan.as_ref().map(|(r, p)| native::PlannedRows { kernel: p.kernel(r), split: p.splits() });
        if let Some(lib) = self.native.library(kernel, planned_rows) {
            // SAFETY: `library` gives the library printed from this very kernel (its rows as
            // planned: split when its plan splits them).
            return unsafe {
                match (planned_rows, &plan) {
                    (Some(r), Some((_, p))) if r.split => lib.run_split_rows(r.kernel, p, args),
                    (Some(r), _) => lib.run_rows(r.kernel, args),
                    _ => lib.run(kernel, args),
                }
            };
        }
        run_prepared(kernel, plan.as_ref().map(|(_, p)| &**p), args)
    }

    /// `kernel` (map loops, some of which [`tile::reorders`]) in the order it runs in on the
    /// CPU, prepared once per interned kernel.
    fn reordered_map(&self, kernel: &Arc<Kernel>) -> Arc<Kernel> {
        let Body::Map(loops) = &kernel.body else { return kernel.clone() };
        let key = Arc::as_ptr(kernel) as usize;
        let mut prep = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        if prep.maps.len() >= MAX_PREPARED {
            prep.maps.clear();
        }
        let entry = prep.maps.entry(key).or_insert_with(|| {
            let loops = loops.iter().map(|l| tile::map_loop(l).unwrap_or_else(|| l.clone())).collect();
            (kernel.clone(), Arc::new(Kernel { body: Body::Map(loops), ..(**kernel).clone() }))
        });
        entry.1.clone()
    }

    /// Runs `kernel` as [`CpuDevice::run`] does, but for a kernel of map loops keeps its compiled
    /// library in `kept` once there is one and runs it from there (a replayed step runs the
    /// same kernels thousands of times: looking the library up each time is a lock and a hash),
    /// its accesses checked against the arguments at the first compiled run only: every call
    /// with the same `kept` passes arguments of the same dtypes and lengths (a recorded graph's
    /// buffers, planned once).
    fn run_keeping(&self, kernel: &Arc<Kernel>, args: &[ArgPtr], kept: &KeptKernel) -> Result<(), String> {
        let plain = matches!(&kernel.body, Body::Map(loops) if !loops.iter().any(tile::reorders));
        if !plain || self.native.mode() == CompileMode::Off {
            return self.run(kernel, args);
        }
        // Until its task size is settled (`tune`: timed at its first compiled run), the kernel
        // runs as an eager flush runs it.
        let task = match kept.task.get() {
            _ if tune::mode_is_off() => map::TASK,
            Some(&task) => task,
            None if !tune::tunable(kernel) => *kept.task.get_or_init(|| map::TASK),
            None => match self.task_of(kernel) {
                Some(task) => *kept.task.get_or_init(|| task),
                None => return self.run(kernel, args),
            },
        };
        let lib = match kept.compiled.get() {
            Some(lib) => {
                self.native.count_launch();
                lib
            }
            None => match self.native.library(kernel, None) {
                Some(lib) => kept.compiled.get_or_init(|| lib),
                None => return run_prepared(kernel, None, args),
            },
        };
        let check = !kept.checked.load(Ordering::Relaxed);
        // SAFETY: the library was printed from this very kernel (`library` gave it for it), and
        // unchecked only after a checked run with arguments like these (the caller's promise).
        map::with_task_size(task, || unsafe { lib.run_checking(kernel, args, check) })?;
        kept.checked.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Runs a matrix-product kernel; its epilogue runs as compiled code once the map kernel
    /// made of it (`matmul::epilogue_kernel`, prepared once per interned kernel) is compiled,
    /// interpreted until then.
    fn run_matmul(&self, kernel: &Arc<Kernel>, m: &MatmulKernel, args: &[ArgPtr]) -> Result<(), String> {
        let Some(l) = &m.epilogue else { return matmul::run_matmul(m, args) };
        let product = Arg { dtype: m.dtype, len: m.lhs.batch_offsets.len() * m.m * m.n };
        let epilogue = self.epilogue(kernel, product, m.product, l);
        matmul::run_matmul_with(m, args, |l, all| self.run_epilogue(epilogue, m.product, l, args, all))
    }

    /// [`CpuDevice::run_matmul`] for a product with a quantized weight.
    fn run_quant_matmul(&self, kernel: &Arc<Kernel>, q: &QuantMatmulKernel, args: &[ArgPtr]) -> Result<(), String> {
        let epilogue = match &q.epilogue {
            Some(l) => self.epilogue(kernel, Arg { dtype: q.dtype, len: q.numel() }, q.product, l),
            None => None,
        };
        quant::run_quant_matmul_with(q, args, |l, all| self.run_epilogue(epilogue, q.product, l, args, all))
    }

    /// The epilogue `l` of product kernel `kernel` as a map kernel of its own (prepared once
    /// per interned kernel), or `None` when it stays interpreted.
    fn epilogue(&self, kernel: &Arc<Kernel>, product: Arg, product_arg: u16, l: &MapLoop) -> Option<Arc<Kernel>> {
        let key = Arc::as_ptr(kernel) as usize;
        let mut prep = self.prepared.lock().unwrap_or_else(|p| p.into_inner());
        if prep.epilogues.len() >= MAX_PREPARED {
            prep.epilogues.clear();
        }
        let entry = (prep.epilogues.entry(key)).or_insert_with(|| {
            (kernel.clone(), matmul::epilogue_kernel(kernel, product, product_arg, l).map(Arc::new))
        });
        entry.1.clone()
    }

    /// Runs a product's epilogue: compiled once its library is, else interpreted over `all`
    /// (the kernel's arguments `args`, then the product's scratch if any).
    fn run_epilogue(
        &self,
        epilogue: Option<Arc<Kernel>>,
        product_arg: u16,
        l: &MapLoop,
        args: &[ArgPtr],
        all: &[ArgPtr],
    ) -> Result<(), String> {
        let compiled = epilogue.as_ref().and_then(|e| Some((e, self.native.library(e, None)?)));
        match compiled {
            Some((e, lib)) => {
                // The epilogue kernel's arguments: the product, then the matrix kernel's.
                let product = *all.get(product_arg as usize).ok_or("matmul product missing")?;
                let with_product: Vec<ArgPtr> = std::iter::once(product).chain(args.iter().copied()).collect();
                // SAFETY: `library` gives the library printed from this very kernel.
                unsafe { lib.run(e, &with_product) }
            }
            None => map::run_loop(l, all),
        }
    }

    /// A buffer of `bytes`; with `poison`, its memory is filled with 0xFF bytes (NaN for floats)
    /// when it is freed, so a read after free shows up as a wrong result.
    fn alloc(&self, bytes: usize, poison: bool) -> Result<Arc<CpuBuffer>, DeviceError> {
        alloc_from(&self.pool, bytes, poison, false, false)
    }

    /// A buffer of exact-size memory for a parameter.
    fn alloc_persistent(&self, bytes: usize, poison: bool) -> Result<Arc<CpuBuffer>, DeviceError> {
        alloc_from(&self.pool, bytes, poison, true, false)
    }

    /// A buffer in the host pool (offload space).
    fn alloc_host(&self, bytes: usize, poison: bool) -> Result<Arc<CpuBuffer>, DeviceError> {
        alloc_from(&self.host_pool, bytes, poison, false, true)
    }

    /// A device buffer of `bytes` whose contents are unspecified (for test backends that
    /// write it later, as a device would).
    pub fn alloc_unwritten(&self, bytes: usize, poison: bool) -> Result<Buffer, DeviceError> {
        Ok(Buffer::new(self.alloc(bytes, poison)?))
    }

    /// A buffer for `plan`: device memory (exact-size for a parameter) or offload space.
    pub fn alloc_planned(&self, plan: &BufferPlan, poison: bool) -> Result<Buffer, DeviceError> {
        let buffer = match plan.space {
            Space::Device if plan.persistent => self.alloc_persistent(plan.bytes, poison)?,
            Space::Device => self.alloc(plan.bytes, poison)?,
            Space::Host => self.alloc_host(plan.bytes, poison)?,
            Space::Remote => {
                return Err(DeviceError::Internal("another device's buffer is never allocated here".into()));
            }
        };
        Ok(Buffer::new(buffer))
    }

    /// A device buffer holding a copy of `bytes`.
    fn upload_bytes(&self, bytes: &[u8], poison: bool) -> Result<Arc<CpuBuffer>, DeviceError> {
        let buf = self.alloc(bytes.len(), poison)?;
        // SAFETY: the fresh buffer holds bytes.len() bytes and nobody else has it yet.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr(), bytes.len()) };
        Ok(buf)
    }

    /// Bytes in use in the host (offload) pool, and its peak.
    pub fn host_memory(&self) -> MemoryStats {
        self.host_pool.stats()
    }
}

/// A buffer of `bytes` from `pool` (from its exact-size chunks when `exact`; `host`: the pool is
/// the offload pool).
fn alloc_from(
    pool: &Arc<Pool>,
    bytes: usize,
    poison: bool,
    exact: bool,
    host: bool,
) -> Result<Arc<CpuBuffer>, DeviceError> {
    let slice = if bytes == 0 {
        None
    } else {
        let slice = if exact { pool.alloc_exact(bytes) } else { pool.alloc(bytes) };
        Some(slice.ok_or_else(|| {
            let s = pool.stats();
            DeviceError::OutOfMemory { requested: bytes as u64, in_use: s.in_use, reserved: s.reserved }
        })?)
    };
    Ok(Arc::new(CpuBuffer { slice, bytes, pool: pool.clone(), poison, exact, host }))
}

/// Runs one kernel over its arguments.
pub fn run_kernel(kernel: &Kernel, args: &[ArgPtr]) -> Result<(), String> {
    run_prepared(kernel, None, args)
}

fn run_prepared(kernel: &Kernel, row_plan: Option<&rows::Plan>, args: &[ArgPtr]) -> Result<(), String> {
    if args.len() != kernel.args.len() {
        return Err(format!("{} arguments for a kernel of {}", args.len(), kernel.args.len()));
    }
    match &kernel.body {
        Body::Map(loops) => loops.iter().try_for_each(|l| map::run_loop(l, args)),
        Body::Rows(r) => match row_plan {
            Some(p) => rows::run_rows(r, p, args),
            None => rows::run_rows(r, &rows::plan(r), args),
        },
        Body::Matmul(m) => matmul::run_matmul(m, args),
        Body::QuantMatmul(q) => quant::run_quant_matmul_with(q, args, map::run_loop),
        Body::Quantize(q) => quant::run_quantize(q, args),
        Body::Gather(g) => gather::run_gather(g, args),
        Body::Scatter(s) => scatter::run_scatter(s, args),
        Body::ScatterWrite(s) => scatter_write::run_scatter_write(s, args),
        Body::Attention(a) => attention::run_attention(a, args),
        Body::Collective(c) => Err(format!("{} runs through the queue's rendezvous, not as a kernel", c.kind.name())),
    }
}

/// Per-kernel preparation kept across runs (the plans of row kernels, reordered map kernels),
/// keyed by the identity of the interned kernel, which the cache holds so the key cannot be
/// reused.
#[derive(Default)]
struct Prepared {
    rows: hashbrown::HashMap<usize, (Arc<Kernel>, Arc<rows::Plan>)>,
    /// Map kernels in the order they run in (`tile::map_loop`).
    maps: hashbrown::HashMap<usize, (Arc<Kernel>, Arc<Kernel>)>,
    /// Matrix-product kernels' epilogues as kernels of their own (`matmul::epilogue_kernel`).
    epilogues: hashbrown::HashMap<usize, (Arc<Kernel>, Option<Arc<Kernel>>)>,
    /// The task size tuned for each kernel (`tune`).
    tasks: hashbrown::HashMap<usize, (Arc<Kernel>, usize)>,
}

const MAX_PREPARED: usize = 4096;

impl Backend for CpuDevice {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn target(&self) -> &Target {
        &Target::CPU
    }

    fn driver(&self) -> Driver {
        Driver::Threads
    }

    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        Ok(Box::new(queue::CpuFlush::new(self, schedule, poison)))
    }

    fn upload(&self, bytes: &[u8], poison: bool) -> Result<Buffer, DeviceError> {
        self.upload_bytes(bytes, poison).map(Buffer::new)
    }

    fn download(&self, buffer: &Buffer) -> Result<Vec<u8>, DeviceError> {
        Ok(queue::cpu_buffer(buffer)?.read())
    }

    fn download_into(&self, buffer: &Buffer, dst: &mut [u8]) -> Result<(), DeviceError> {
        queue::cpu_buffer(buffer)?;
        buffer.read_into(dst)
    }

    fn memory(&self) -> MemoryStats {
        self.pool.stats()
    }

    fn reset_peak(&self) {
        self.pool.reset_peak()
    }

    fn kernels_launched(&self) -> u64 {
        self.kernels.load(Ordering::Relaxed)
    }

    fn trim(&self) {
        self.pool.trim();
        self.host_pool.trim();
    }

    fn persistent_memory(&self) -> u64 {
        self.pool.persistent()
    }

    /// (A CPU graph reads its inputs where they are at every launch: `bound` changes nothing.)
    fn kernel_variant(&self, kernel: &Arc<Kernel>) -> Option<String> {
        if tune::mode_is_off() {
            return None;
        }
        tune::variant_name(self.task_of(kernel)?)
    }

    fn record_graph(
        &self,
        job: crate::runtime::Job<'_>,
        _bound: &[Option<Buffer>],
    ) -> Option<Result<Box<dyn crate::runtime::Graph>, DeviceError>> {
        graph::record(self, job)
    }

    fn set_compile_mode(&self, mode: CompileMode) {
        self.native.set_mode(mode)
    }

    fn compiled_kernels_launched(&self) -> u64 {
        self.native.launches()
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// CPU devices meet at the host rendezvous: nothing to set up.
    fn connect_group(&self, _members: &[&dyn Backend], _group: &Arc<RankGroup>) -> Result<(), DeviceError> {
        Ok(())
    }

    /// The host exchange needs no token.
    fn spanning_token(&self, _rank: u32) -> Result<[u8; TOKEN_BYTES], DeviceError> {
        Ok([0; TOKEN_BYTES])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poisoned_buffers_are_filled_with_0xff_when_freed() {
        let dev = CpuDevice::new();
        for poison in [true, false] {
            let buf = dev.upload(&[1u8, 2, 3, 4], poison).unwrap().arc::<CpuBuffer>().expect("a CPU buffer");
            let ptr = buf.ptr();
            drop(buf);
            // The pool still owns the memory; nothing else has taken it.
            let after = unsafe { std::slice::from_raw_parts(ptr, 4) }.to_vec();
            if poison {
                assert_eq!(after, vec![0xFF; 4]);
            } else {
                assert_eq!(after, vec![1, 2, 3, 4]);
            }
        }
        assert_eq!(dev.memory().in_use, 0);
    }
}
