//! Compiled modules for one GPU: printed CUDA C in, loaded `CUmodule`s out, each source
//! compiled at most once per process (an in-memory cache by source) and, across processes, once
//! per machine (the [`super::disk_cache`]).
//!
//! A lookup goes memory, then disk, then NVRTC. A disk hit is logged at debug level, a rejected
//! entry (corrupt, truncated, foreign) at warn level before it is recompiled and overwritten, a
//! disk that cannot be used at warn level once; all with target `braid::cuda`. [`CompileStats`]
//! counts what happened, for tests and logs.
//!
//! Must never: run or launch anything, trust a disk entry the cache did not validate, or
//! unload a module while the compiler lives (queued launches may still use it: modules are
//! kept for the compiler's lifetime).

use super::context::Gpu;
use super::disk_cache::{DiskCache, EntryKey, Lookup};
use super::launch::CudaKernel;
use super::nvrtc::{self, Target};
use super::{DriverResult, TRACE_TARGET, driver_error};
use crate::DeviceError;
use braid_lowering::Kernel;
use cudarc::driver::result as cu;
use cudarc::driver::sys::{CUfunction, CUmodule};
use std::collections::HashMap;
use std::ffi::CString;
use std::sync::{Arc, Mutex};

/// A loaded module and its entry points by name.
#[derive(Debug)]
pub struct Module {
    raw: CUmodule,
    functions: HashMap<String, CUfunction>,
    gpu: Arc<Gpu>,
}

// SAFETY: module and function handles are driver handles usable from any thread with the
// context current (launchers bind it).
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// The entry point `name` (an `extern "C" __global__` function of the source).
    pub fn function(&self, name: &str) -> Result<CUfunction, DeviceError> {
        self.functions
            .get(name)
            .copied()
            .ok_or_else(|| DeviceError::Internal(format!("no entry `{name}` in the module")))
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: loaded by `load` and unloaded once; the compiler keeps modules alive
            // while launches may be queued.
            let _ = unsafe { cu::module::unload(self.raw) };
        }
    }
}

/// Loads `image` and looks up `entries`.
fn load(gpu: &Arc<Gpu>, image: &[u8], entries: &[&str]) -> Result<Module, DeviceError> {
    gpu.bind()?;
    // SAFETY: the image is a CUBIN or a NUL-terminated PTX from NVRTC (or a validated cache
    // entry holding one); the driver copies it.
    let raw = unsafe { cu::module::load_data(image.as_ptr() as *const std::ffi::c_void) }
        .map_err(|e| driver_error("loading a compiled module (cuModuleLoadData)", e, 0))?;
    let mut module = Module { raw, functions: HashMap::new(), gpu: gpu.clone() };
    for &name in entries {
        let c = CString::new(name).map_err(|_| DeviceError::Internal(format!("entry name {name:?}")))?;
        // SAFETY: the module is loaded; `c` is a valid C string.
        let f = unsafe { cu::module::get_function(module.raw, c) }
            .or_device(&format!("entry `{name}` (cuModuleGetFunction)"))?;
        module.functions.insert(name.to_string(), f);
    }
    Ok(module)
}

/// What a compiler did since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CompileStats {
    /// Sources compiled by NVRTC.
    pub compiled: u64,
    /// Sources found in the in-memory cache.
    pub memory_hits: u64,
    /// Sources loaded from the disk cache.
    pub disk_hits: u64,
    /// Disk entries rejected (and recompiled).
    pub rejected: u64,
}

/// Compiles printed sources for one GPU (see the module docs).
pub struct Compiler {
    gpu: Arc<Gpu>,
    target: Target,
    disk: Option<DiskCache>,
    modules: Mutex<HashMap<String, Arc<Module>>>,
    kernels: Mutex<HashMap<Kernel, Arc<CudaKernel>>>,
    stats: Mutex<CompileStats>,
}

impl Compiler {
    /// A compiler for `gpu` with the disk cache the environment names
    /// ([`DiskCache::default_dir`]); a cache that cannot be used is logged and left out.
    pub fn new(gpu: &Arc<Gpu>) -> Result<Compiler, DeviceError> {
        let disk = DiskCache::default_dir().and_then(|dir| match DiskCache::open(&dir) {
            Ok(c) => Some(c),
            Err(why) => {
                tracing::warn!(target: TRACE_TARGET, "{why}; compiled kernels are kept in memory only");
                None
            }
        });
        Compiler::with_cache(gpu, disk)
    }

    /// A compiler for `gpu` with the given disk cache (`None`: memory only).
    pub fn with_cache(gpu: &Arc<Gpu>, disk: Option<DiskCache>) -> Result<Compiler, DeviceError> {
        let target = nvrtc::target(gpu.compute_capability)?;
        tracing::debug!(target: TRACE_TARGET, arch = %target.arch, include = ?nvrtc::include_dir(), "NVRTC target");
        Ok(Compiler {
            gpu: gpu.clone(),
            target,
            disk,
            modules: Mutex::new(HashMap::new()),
            kernels: Mutex::new(HashMap::new()),
            stats: Mutex::new(CompileStats::default()),
        })
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    pub fn target(&self) -> &Target {
        &self.target
    }

    pub fn disk_cache(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    pub fn stats(&self) -> CompileStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn count(&self, f: impl FnOnce(&mut CompileStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// The disk cache key of `source` on this GPU.
    pub fn key(&self, source: &str) -> EntryKey {
        EntryKey {
            source: source.to_string(),
            arch: self.target.arch.clone(),
            options: self.target.options.clone(),
            nvrtc_version: [self.target.nvrtc_version.0, self.target.nvrtc_version.1],
            driver_version: self.gpu.driver_version,
            braid_version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// The loaded module of `source` (named `name` in NVRTC's messages), with `entries` looked
    /// up: from memory, else from disk, else compiled now (and stored on disk).
    pub fn module(&self, source: &str, name: &str, entries: &[&str]) -> Result<Arc<Module>, DeviceError> {
        if let Some(m) = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(source) {
            self.count(|s| s.memory_hits += 1);
            return Ok(m.clone());
        }
        let key = self.key(source);
        let from_disk = match self.disk.as_ref().map(|d| d.load(&key)) {
            Some(Lookup::Hit(image)) => match load(&self.gpu, &image, entries) {
                Ok(m) => {
                    tracing::debug!(target: TRACE_TARGET, kernel = name, path = %self.disk.as_ref().map(|d| d.path(&key).display().to_string()).unwrap_or_default(), "disk cache hit: not compiled");
                    self.count(|s| s.disk_hits += 1);
                    Some(m)
                }
                Err(e) => {
                    tracing::warn!(target: TRACE_TARGET, kernel = name, "a cached image does not load ({e}); compiling it again");
                    self.count(|s| s.rejected += 1);
                    None
                }
            },
            Some(Lookup::Rejected(why)) => {
                tracing::warn!(target: TRACE_TARGET, kernel = name, "disk cache entry not trusted: {why}; compiling it again");
                self.count(|s| s.rejected += 1);
                None
            }
            Some(Lookup::Miss) | None => None,
        };
        let module = match from_disk {
            Some(m) => m,
            None => {
                let start = std::time::Instant::now();
                let image = nvrtc::compile(source, name, &self.target)?;
                self.count(|s| s.compiled += 1);
                tracing::debug!(target: TRACE_TARGET, kernel = name, arch = %self.target.arch, elapsed = ?start.elapsed(), "compiled by NVRTC");
                let module = load(&self.gpu, &image, entries)?;
                if let Some(disk) = &self.disk
                    && let Err(why) = disk.store(&key, &image)
                {
                    tracing::warn!(target: TRACE_TARGET, kernel = name, "{why}; the kernel stays compiled in memory only");
                }
                module
            }
        };
        let module = Arc::new(module);
        self.modules.lock().unwrap_or_else(|p| p.into_inner()).insert(source.to_string(), module.clone());
        Ok(module)
    }

    /// `kernel` printed, compiled and ready to launch (cached by the kernel's structure, and
    /// its source by text).
    pub fn kernel(&self, kernel: &Kernel) -> Result<Arc<CudaKernel>, DeviceError> {
        if let Some(k) = self.kernels.lock().unwrap_or_else(|p| p.into_inner()).get(kernel) {
            return Ok(k.clone());
        }
        let compiled = Arc::new(CudaKernel::new(self, kernel)?);
        self.kernels.lock().unwrap_or_else(|p| p.into_inner()).insert(kernel.clone(), compiled.clone());
        Ok(compiled)
    }
}
