//! NVRTC: printed CUDA C to a GPU image for one architecture.
//!
//! The target is chosen from the GPU's compute capability: a CUBIN for `sm_XY` when NVRTC
//! supports that architecture (nothing left to compile when loading), else PTX for the newest
//! `compute_XY` NVRTC knows that the GPU can run (the driver compiles it when loading). The
//! options are the printer's ([`NVRTC_OPTIONS`]: no contraction into fused multiply-adds), the
//! architecture, and the CUDA include directory on `-I` when one is found (for `cuda_fp16.h`
//! and `cuda_bf16.h`): `$CUDA_PATH/include`, `$CUDA_HOME/include`, `/usr/local/cuda/include`,
//! `/opt/cuda/include`, `/usr/include`, the first that has `cuda_fp16.h`.
//!
//! With `BRAID_CUDA_LINEINFO=1` NVRTC also gets `-lineinfo`, so that `compute-sanitizer` and
//! Nsight name the line of the printed source (kept in the kernel cache's entries) where a
//! report points; it is one more option, so such kernels are cached apart.
//!
//! Must never: cache anything (that is [`super::compile`]'s job), load modules, or panic on a
//! source NVRTC rejects (its log comes back in the error).

use crate::DeviceError;
use braid_lowering::cuda::NVRTC_OPTIONS;
use cudarc::nvrtc::sys::{self, nvrtcProgram, nvrtcResult};
use std::ffi::{CStr, CString, c_char, c_int};
use std::path::PathBuf;
use std::sync::OnceLock;

/// What NVRTC produced.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageKind {
    /// Machine code for exactly the GPU's architecture.
    Cubin,
    /// PTX (NUL-terminated), compiled by the driver when loaded.
    Ptx,
}

/// How sources are compiled for one GPU: the architecture option, the image kind and every
/// option, which the cache key includes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// `sm_90`, or `compute_89` when the image is PTX.
    pub arch: String,
    pub kind: ImageKind,
    pub options: Vec<String>,
    /// NVRTC's (major, minor) version.
    pub nvrtc_version: (i32, i32),
}

fn check(r: nvrtcResult, what: &str) -> Result<(), DeviceError> {
    if r == nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string for any result code.
    let text = unsafe { CStr::from_ptr(sys::nvrtcGetErrorString(r)) }.to_string_lossy().into_owned();
    Err(DeviceError::Kernel(format!("{what}: {text}")))
}

/// NVRTC's version and the real architectures it can compile for (e.g. 75, 80, 90).
fn nvrtc_info() -> Result<((i32, i32), Vec<i32>), DeviceError> {
    let (mut major, mut minor, mut count) = (0, 0, 0);
    // SAFETY: out-pointers valid for each call; the array is sized by the count asked first.
    unsafe {
        check(sys::nvrtcVersion(&mut major, &mut minor), "nvrtcVersion")?;
        check(sys::nvrtcGetNumSupportedArchs(&mut count), "nvrtcGetNumSupportedArchs")?;
        let mut archs = vec![0 as c_int; count.max(0) as usize];
        check(sys::nvrtcGetSupportedArchs(archs.as_mut_ptr()), "nvrtcGetSupportedArchs")?;
        Ok(((major, minor), archs))
    }
}

/// The CUDA include directory (see the module docs), looked for once.
pub fn include_dir() -> Option<&'static PathBuf> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let from_env = ["CUDA_PATH", "CUDA_HOME"]
            .iter()
            .filter_map(|k| std::env::var_os(k).filter(|v| !v.is_empty()).map(|v| PathBuf::from(v).join("include")));
        let fixed = ["/usr/local/cuda/include", "/opt/cuda/include", "/usr/include"].map(PathBuf::from);
        from_env.chain(fixed).find(|d| d.join("cuda_fp16.h").is_file())
    })
    .as_ref()
}

/// The target for a GPU of compute capability `(major, minor)`.
pub fn target(compute_capability: (i32, i32)) -> Result<Target, DeviceError> {
    let (version, archs) = nvrtc_info()?;
    let want = compute_capability.0 * 10 + compute_capability.1;
    let (arch, kind) = if archs.contains(&want) {
        (format!("sm_{want}"), ImageKind::Cubin)
    } else {
        // A GPU newer than this NVRTC: PTX of the newest architecture both know.
        let best = archs.iter().copied().filter(|&a| a <= want).max().ok_or_else(|| {
            DeviceError::Unavailable(format!(
                "NVRTC {}.{} cannot compile for compute capability {}.{} (it supports {archs:?})",
                version.0, version.1, compute_capability.0, compute_capability.1
            ))
        })?;
        (format!("compute_{best}"), ImageKind::Ptx)
    };
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    if let Some(dir) = include_dir() {
        options.push(format!("-I{}", dir.display()));
    }
    if line_info() {
        // Source lines for compute-sanitizer and profilers; the same machine code otherwise.
        options.push("-lineinfo".into());
    }
    Ok(Target { arch, kind, options, nvrtc_version: version })
}

/// Destroys the program when dropped (on every path out of [`compile`]).
struct Program(nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram and destroyed once.
        let _ = unsafe { sys::nvrtcDestroyProgram(&mut self.0) };
    }
}

/// Compiles `source` for `target`: the image (a PTX image ends with its NUL). A source NVRTC
/// rejects is `Err(Kernel)` with the compile log.
pub fn compile(source: &str, name: &str, target: &Target) -> Result<Vec<u8>, DeviceError> {
    let c = |s: &str, what: &str| CString::new(s).map_err(|_| DeviceError::Kernel(format!("{what} holds a NUL byte")));
    let (src, file) = (c(source, "the kernel source")?, c(&format!("{name}.cu"), "the kernel name")?);
    let options: Vec<CString> = target.options.iter().map(|o| c(o, "an NVRTC option")).collect::<Result<_, _>>()?;
    let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
    let mut raw: nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; no headers are passed in memory.
    check(
        unsafe {
            sys::nvrtcCreateProgram(&mut raw, src.as_ptr(), file.as_ptr(), 0, std::ptr::null(), std::ptr::null())
        },
        "nvrtcCreateProgram",
    )?;
    let program = Program(raw);
    // SAFETY: the program is alive and the option array holds live C strings.
    let compiled = unsafe { sys::nvrtcCompileProgram(program.0, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
    if compiled != nvrtcResult::NVRTC_SUCCESS {
        let log = program_log(&program).unwrap_or_default();
        return Err(DeviceError::Kernel(format!(
            "NVRTC rejected kernel `{name}` ({}):\n{log}",
            target.options.join(" ")
        )));
    }
    let mut size = 0usize;
    let mut image;
    // SAFETY: the program compiled; the buffer is sized by the size asked first.
    unsafe {
        match target.kind {
            ImageKind::Cubin => {
                check(sys::nvrtcGetCUBINSize(program.0, &mut size), "nvrtcGetCUBINSize")?;
                image = vec![0u8; size];
                check(sys::nvrtcGetCUBIN(program.0, image.as_mut_ptr() as *mut c_char), "nvrtcGetCUBIN")?;
            }
            ImageKind::Ptx => {
                check(sys::nvrtcGetPTXSize(program.0, &mut size), "nvrtcGetPTXSize")?;
                image = vec![0u8; size];
                check(sys::nvrtcGetPTX(program.0, image.as_mut_ptr() as *mut c_char), "nvrtcGetPTX")?;
            }
        }
    }
    if image.is_empty() {
        return Err(DeviceError::Kernel(format!("NVRTC produced an empty image for `{name}`")));
    }
    Ok(image)
}

fn program_log(program: &Program) -> Result<String, DeviceError> {
    let mut size = 0usize;
    // SAFETY: the program is alive; the buffer is sized by the size asked first.
    unsafe {
        check(sys::nvrtcGetProgramLogSize(program.0, &mut size), "nvrtcGetProgramLogSize")?;
        let mut log = vec![0u8; size.max(1)];
        check(sys::nvrtcGetProgramLog(program.0, log.as_mut_ptr() as *mut c_char), "nvrtcGetProgramLog")?;
        Ok(String::from_utf8_lossy(&log).trim_end_matches('\0').to_string())
    }
}

/// `BRAID_CUDA_LINEINFO=1` (read once): compile with `-lineinfo`.
fn line_info() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("BRAID_CUDA_LINEINFO").is_ok_and(|v| v == "1"))
}
