//! What a device is like, as fusion, scheduling and lowering need to know it: one [`Target`]
//! per backend, handed to each stage instead of constants written for the CPU.
//!
//! A target says how much one kernel may take on (inputs, reductions), how fast the device
//! computes and copies (the [`CostModel`] the offload placement uses), how it splits work, where
//! its memory is (which decides whether a transfer from another device needs a copy step), and
//! which element types it has. It is plain data: this module decides nothing itself.

use crate::DType;

/// How fast a device computes and copies, for hiding copies behind compute, and how it
/// allocates.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CostModel {
    /// Offload copy bandwidth (device to host and back), bytes per second.
    pub copy_bytes_per_sec: f64,
    /// Bandwidth of elementwise and reduction kernels, bytes per second.
    pub kernel_bytes_per_sec: f64,
    /// Matrix product throughput, flop per second.
    pub flops_per_sec: f64,
    /// Time every kernel takes besides moving its bytes and computing its flops, in seconds:
    /// a GPU's launch and scheduling latency, which dominates small kernels (0 on the CPU).
    pub kernel_overhead_secs: f64,
    /// Allocations take a multiple of this many bytes (what a budget is compared with).
    pub allocation_granularity: u64,
}

impl CostModel {
    /// A two-core CPU copying between two pools in the same memory (64-byte aligned slices).
    pub const CPU: CostModel = CostModel {
        copy_bytes_per_sec: 8e9,
        kernel_bytes_per_sec: 10e9,
        flops_per_sec: 60e9,
        kernel_overhead_secs: 0.0,
        allocation_granularity: 64,
    };

    /// The device memory a buffer of `bytes` takes.
    pub fn allocated(&self, bytes: usize) -> u64 {
        let g = self.allocation_granularity.max(1);
        if bytes == 0 { 0 } else { (bytes as u64).div_ceil(g) * g }
    }
}

/// Where a device's buffers live.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryKind {
    /// Host memory that the host (and every other host-memory device) addresses directly: a
    /// value moves between two such devices without a copy (its readers load it where it is).
    Host,
    /// Memory of its own (a GPU's): a value from another device arrives by a copy step.
    Device,
}

/// A set of element types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DTypes(u16);

impl DTypes {
    pub const ALL: DTypes = DTypes::of(&DType::ALL);

    pub const fn of(dtypes: &[DType]) -> DTypes {
        let mut bits = 0u16;
        let mut i = 0;
        while i < dtypes.len() {
            bits |= 1 << dtypes[i] as u16;
            i += 1;
        }
        DTypes(bits)
    }

    pub const fn contains(self, dtype: DType) -> bool {
        self.0 & (1 << dtype as u16) != 0
    }
}

/// The description of one backend that the pipeline's stages plan for.
/// How far a device's math library may be from correctly rounded results: the reference
/// interpreter widens its bounds by these for the ops a device computes with its platform's
/// builtins (`exp log sin cos tanh sigmoid gelu pow`, and division on a GPU's WGSL).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PlatformMath {
    /// Extra allowance of those ops, in half ulps (a table row's unit).
    pub extra_half_ulps: f64,
    /// `exp` and `pow` bounded as WGSL bounds them for every implementation: `exp` to
    /// `3 + 2|x|` ulps, `pow` as `exp2(y * log2(x))`.
    pub wgsl_bounds: bool,
    /// The builtins are a GPU's WGSL ones: `sin` and `cos` may add `sin_cos_absolute`, `exp`
    /// `2|x|` ulps more, division 2.5 ulps.
    pub gpu_builtins: bool,
    /// An absolute error `sin` and `cos` may add (with `gpu_builtins`).
    pub sin_cos_absolute: f64,
    /// Arithmetic may not keep a NaN: WGSL lets an implementation assume none occurs, and its
    /// compilers fold `x - x` to 0 for a NaN `x` (lavapipe does). A NaN that arithmetic
    /// carries over from a NaN operand is then uncertain.
    pub nan_may_fold: bool,
}

impl PlatformMath {
    /// A math library within the op table's allowances (the CPU's, CUDA's).
    pub const TABLE: PlatformMath = PlatformMath {
        extra_half_ulps: 0.0,
        wgsl_bounds: false,
        gpu_builtins: false,
        sin_cos_absolute: 0.0,
        nan_may_fold: false,
    };

    /// WGSL's builtins: 16 ulps more than the table, `exp` and `pow` as WGSL bounds them, NaNs
    /// that arithmetic may fold away; on a
    /// GPU (not a software adapter such as lavapipe) also `sin`/`cos` off by an absolute 2^-20
    /// (measured within 2^-22 on an H100's Vulkan driver; WGSL allows 2^-11) and `exp` by WGSL's
    /// `2|x|` ulps more.
    pub fn wgsl(gpu: bool) -> PlatformMath {
        let sin_cos_absolute = if gpu { 2f64.powi(-20) } else { 0.0 };
        PlatformMath {
            extra_half_ulps: 32.0,
            wgsl_bounds: true,
            gpu_builtins: gpu,
            sin_cos_absolute,
            nan_may_fold: true,
        }
    }

    /// The extra relative error of a platform math op in `f32`, as a multiple of `f32::EPSILON`
    /// (for tests that bound one op's result directly).
    pub fn extra_epsilons(&self) -> f64 {
        self.extra_half_ulps / 2.0
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Target {
    /// The backend's name (`cpu`, `cuda`, ...), for messages.
    pub name: &'static str,
    /// The most distinct input buffers one kernel may read (fusion stops growing a kernel there).
    pub max_kernel_inputs: usize,
    /// The most reductions one row kernel may hold: each one re-reads (and recomputes) its
    /// row, so beyond a few it is cheaper to store values than to recompute them.
    pub max_row_reductions: usize,
    /// Speeds and allocation granularity, for offload placement and memory accounting.
    pub cost: CostModel,
    /// Elements per unit of parallel work (a CPU task, a GPU block's share): loops are split
    /// into pieces of this many indices.
    pub work_granularity: usize,
    /// Where the device's buffers live.
    pub memory: MemoryKind,
    /// Whether the device has a copy engine: transfers from other devices then run on a copy
    /// stream of their own, overlapping compute, instead of on the reading stream.
    pub copy_stream: bool,
    /// Element types its kernels compute with; others are refused where they are recorded.
    pub dtypes: DTypes,
    /// The most nodes one kernel may hold: a backend that compiles every kernel (wgpu) takes
    /// time that grows with a kernel's size, so fusion stops growing a kernel there
    /// (`usize::MAX`: no limit).
    pub max_kernel_nodes: usize,
    /// The most buffers one kernel may bind: its inputs and outputs (a backend keeps room for
    /// one scratch buffer more, a split reduction's partial results, beyond this). A backend that binds every
    /// buffer in a table of fixed size (wgpu: the adapter's storage buffers per shader stage)
    /// or passes their addresses in bounded space (CUDA's kernel parameters) sets it; fusion stops growing a kernel there and a `cat` of more parts is recorded in
    /// pieces (`usize::MAX`: no limit).
    pub max_kernel_buffers: usize,
    /// Whether a transposed view read by a row kernel that writes whole rows (softmax, layer
    /// norm over `x.t()`) or that reduces every element (`x.t().sum()`, `x.t().exp().sum()`) is
    /// written in order first, by a kernel of its own (a copy, or the elementwise work over
    /// it), instead of read by the row kernel in its order (fusion's `fold` and `check`): where
    /// such a row kernel walks its rows across lines, and a transposing loop is cheap (the
    /// CPU's, tile by tile).
    pub copies_transposed_rows: bool,
    /// How its math library rounds (the reference interpreter's bounds for this device).
    pub math: PlatformMath,
    /// Whether work of two streams of one flush can run at the same time on the device (not on
    /// wgpu, which runs every stream on its one queue in issue order).
    pub streams_overlap: bool,
    /// Where the device's library products run at full speed only on aligned dimensions:
    /// large float products whose inner or output dimension is not aligned are recorded padded
    /// (see [`ProductPadding`]); `None` records every product as written.
    pub product_padding: Option<ProductPadding>,
}

/// How a target wants large products padded: the inner dimension (`k`) and the output's last
/// (`n`) rounded up to a multiple of `bytes` of the dtype with zeros, for products of at least
/// `min_flops` (`2 m n k` over the batches). cuBLAS's fast kernels (tensor cores fed by TMA on
/// Hopper) want 16 bytes: GPT-2's language-model head over 50,257 tokens in bf16 runs at 95
/// TFLOP/s as written and several times faster padded to 50,264 (`braid_devices::cuda`'s
/// `row_padding` has the measurements). Recorded padded, the padding is an ordinary `cat` with
/// zeros and the result a `narrow` of the padded product: the zeros add exact zeros, readers
/// read the narrowed view in place, and the backward pass computes on the padded shapes too.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProductPadding {
    pub bytes: usize,
    pub min_flops: f64,
}

impl Target {
    /// The CPU device: these values reproduce the decisions braid made before targets existed.
    pub const CPU: Target = Target {
        name: "cpu",
        max_kernel_inputs: 16,
        max_row_reductions: 4,
        cost: CostModel::CPU,
        work_granularity: 32 * 1024,
        memory: MemoryKind::Host,
        copy_stream: false,
        dtypes: DTypes::ALL,
        max_kernel_nodes: usize::MAX,
        max_kernel_buffers: usize::MAX,
        copies_transposed_rows: true,
        math: PlatformMath::TABLE,
        streams_overlap: true,
        product_padding: None,
    };

    /// Whether this device's kernels read a value held by a device of `source` memory where
    /// it is (otherwise a transfer copies it first).
    pub fn reads_in_place(&self, source: MemoryKind) -> bool {
        self.memory == MemoryKind::Host && source == MemoryKind::Host
    }

    /// `Ok` when kernels of this target compute with `dtype`; otherwise why not.
    #[inline]
    pub fn check_dtype(&self, dtype: DType) -> Result<(), String> {
        if self.dtypes.contains(dtype) {
            Ok(())
        } else {
            Err(format!("{} kernels have no {dtype} (convert with to_dtype first)", self.name))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtype_sets_hold_exactly_their_members() {
        let set = DTypes::of(&[DType::F32, DType::I32]);
        for d in DType::ALL {
            assert_eq!(set.contains(d), matches!(d, DType::F32 | DType::I32), "{d}");
            assert!(DTypes::ALL.contains(d));
        }
        let gpu = Target { dtypes: set, ..Target::CPU };
        assert!(gpu.check_dtype(DType::F32).is_ok());
        assert!(gpu.check_dtype(DType::F64).unwrap_err().contains("f64"));
    }

    #[test]
    fn only_host_memory_is_read_in_place_across_devices() {
        let gpu = Target { memory: MemoryKind::Device, ..Target::CPU };
        assert!(Target::CPU.reads_in_place(MemoryKind::Host));
        assert!(!Target::CPU.reads_in_place(MemoryKind::Device));
        assert!(!gpu.reads_in_place(MemoryKind::Host));
    }
}
