//! WGSL printing of the kernel IR, for the wgpu device: [`print()`] turns a [`Kernel`] into one
//! WGSL module with an entry point per launch.
//!
//! The caller binds argument `i` of the kernel at `@group(0) @binding(i)` and each scratch
//! buffer of [`WgslSource::scratch`] after them, then dispatches [`WgslSource::entries`] in
//! order with the workgroup counts each names (a dispatch must see the previous one's writes).
//! - A map loop is one entry, one thread per index, 256 per workgroup ([`print_with`] prints
//!   other workgroup sizes and several indices per thread, for the device's tuner: the same
//!   bits in another launch shape).
//! - A row kernel (reductions along one axis, or the whole tensor) runs one workgroup per row,
//!   phase after phase as the CPU's `rows` module does: each reduction folds the row in
//!   per-thread accumulators and combines them in a tree in workgroup memory; per-row values
//!   follow; per-row stores are made by one thread; per-element stores in a last sweep. Rows
//!   too long for one workgroup among too few rows (the whole tensor, a column sum of a tall
//!   matrix) are split: per reduction, one entry folds segments into partial results in a
//!   scratch buffer and a second combines them, and a last entry writes the outputs.
//! - A matrix product (there is no vendor library) is a tiled product (16 x 16 outputs per
//!   workgroup, operand tiles in workgroup memory) with any operand strides and per-batch
//!   offsets, written to its product argument or a scratch buffer, then the epilogue entry.
//! - A product with a quantized weight is one thread per output element, reading the packed
//!   int8 or int4 values and their f32 or f16 scales from the weight's u32 words (see
//!   `quant`), written to its product argument or a scratch buffer, then the epilogue entry.
//! - A gather is one entry, a thread per output element; a scatter-add zeroes its output, adds
//!   each row's elements in order (every output element by one thread: no float atomics) and
//!   adds the base (see `indexing`). Their indices are i32.
//! - Attention is one entry per pass (the output and log-sum-exp, the query gradient, or the
//!   key and value gradients): one workgroup per problem and 16 owned rows, walking the other
//!   operand in tiles of 32 rows staged in workgroup memory, with an online softmax forward
//!   (see `attention`); no `[sq, sk]` buffer exists.
//!
//! More workgroups than `max_workgroups_per_dimension` are spread over the y and z dimensions
//! of the dispatch; entries compute their linear workgroup index and skip the excess.
//!
//! Semantics are the CPU evaluator's: integers wrap, integer division truncates with
//! `x / 0 == 0`, float max/min propagate NaN from either side, comparisons with NaN follow IEEE
//! (tested on the bits), float-to-int casts truncate and saturate (NaN gives 0), casts to f32,
//! f16 and bf16 round once to nearest even (in integer arithmetic), argmax takes the first
//! maximum (a NaN counts as the largest), random numbers are `braid_graph::rng`'s (64-bit
//! integer math on u32 pairs), constants have the exact bits of the CPU's. Where agreement is
//! impossible: `exp`, `log`, `sin`, `cos`, `tanh` and `pow` are the platform's (WGSL only
//! bounds their error: `sin`/`cos` to 2^-11 absolute on [-pi, pi], the others to a few ulps,
//! and normal random numbers use `log` and `cos`); float sums, means and matrix products add
//! in another order (a product's `acc + a * b` may also be fused into one rounding); the GPU
//! may flush subnormal f32 values to zero and give NaNs other payloads. Shader compilers
//! otherwise simplify float algebra as if NaN, infinities and signed zeros did not exist
//! (Mesa rewrites `exp(log(x))` to `x`), so every f32 value passes through an identity they
//! cannot see through (see `LAUNDER`). Nodes that no store reads are not printed.
//!
//! Dtypes: f32, i32, u8, bool, f16 and bf16 (stored packed in u32 words and converted exactly
//! in integer arithmetic, so they need no `shader-f16`); i64 values exist inside kernels
//! (indices, argmax, random counters: u32 pairs), but an i64 or f64 argument, and any f64
//! value, is refused by [`supports`], which the engine checks when a tensor is recorded.
//!
//! The printer only prints: it decides nothing about buffers, scheduling or memory, and it
//! never assumes an argument is not aliased by another (every binding is read-write).

mod attention;
mod helpers;
mod indexing;
mod map;
mod matmul;
mod memory;
mod quant;
mod rows;
mod scalar;
mod split;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_attention;
#[cfg(test)]
mod tests_quant;

pub use memory::binding_bytes;

use crate::cexpr::check_printable;
use crate::kernel::{Body, Kernel, Load, Store};
use braid_graph::DType;
use braid_graph::expr::{Expr, ExprOp};
use std::fmt::Write;

/// What the printer needs to know about the adapter (from its limits and features).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Features {
    /// The adapter has `shader-f16` (recorded for the device's report; f16 does not need it).
    pub shader_f16: bool,
    pub max_workgroups_per_dimension: u32,
    /// Storage buffers one kernel may bind: the stage's limit on them, and one fewer than its
    /// limit on buffers of every kind where it has one (Metal's: the kernel's uniform counts).
    pub max_storage_buffers_per_stage: u32,
    pub max_storage_buffer_binding_size: u64,
    pub max_workgroup_storage_size: u32,
    pub max_invocations_per_workgroup: u32,
}

impl Default for Features {
    /// WebGPU's default limits, which every adapter meets.
    fn default() -> Features {
        Features {
            shader_f16: false,
            max_workgroups_per_dimension: 65_535,
            max_storage_buffers_per_stage: 8,
            max_storage_buffer_binding_size: 128 << 20,
            max_workgroup_storage_size: 16_384,
            max_invocations_per_workgroup: 256,
        }
    }
}

/// A printed kernel.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgslSource {
    pub source: String,
    /// The entry points, in launch order (none when there is nothing to compute).
    pub entries: Vec<Entry>,
    /// Per binding, in binding order: the kernel's arguments (`@binding(i)` is argument `i`),
    /// then the scratch buffers the caller provides (any contents; the kernel writes them
    /// before it reads them), then a uniform buffer of zeros.
    pub bindings: Vec<Binding>,
}

/// One `@compute` entry point and its dispatch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub name: String,
    /// Workgroups along x, y, z (each at most `max_workgroups_per_dimension`).
    pub workgroups: [u32; 3],
    /// Threads per workgroup (the entry's `@workgroup_size`).
    pub threads: u32,
    /// For an entry that copies argument `.0` into argument `.1` (a scatter's base): not
    /// dispatched when both are bound to the same bytes of one buffer (the scatter written
    /// over its base in place).
    pub copy: Option<(u16, u16)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Binding {
    /// Argument `arg` of the kernel: the buffer holds its elements from byte 0, and the
    /// binding covers `bytes` ([`binding_bytes`]: whole words, at least one).
    Arg { arg: u16, bytes: u64 },
    /// A scratch buffer of `bytes` bytes (a multiple of 4).
    Scratch { bytes: u64 },
    /// A uniform buffer of 16 zero bytes (always the last binding; see `LAUNDER`).
    Zero,
}

impl Binding {
    /// The bytes the binding covers (its buffer may be larger).
    pub fn bytes(&self) -> u64 {
        match *self {
            Binding::Arg { bytes, .. } | Binding::Scratch { bytes } => bytes,
            Binding::Zero => 16,
        }
    }
}

/// Whether wgpu kernels can hold values of `dtype`: `Err` says why not (for the engine to
/// report where such a tensor is recorded).
pub fn supports(dtype: DType, _features: &Features) -> Result<(), String> {
    match dtype {
        DType::F32 | DType::F16 | DType::BF16 | DType::I32 | DType::U8 | DType::Bool => Ok(()),
        DType::F64 | DType::I64 => Err(refusal(dtype)),
    }
}

pub(crate) fn refusal(d: DType) -> String {
    let why = match d {
        DType::F64 => "WGSL has no 64-bit floats, and emulating them would be slow and inexact",
        _ => "WGSL has no 64-bit integers, and braid keeps i64 tensors off wgpu rather than emulate their storage",
    };
    format!("{d} is not supported on wgpu: {why}; cast to f32 or i32 first, or use the CPU or CUDA device")
}

/// Threads per workgroup of map loops and of the elementwise passes.
pub const MAP_THREADS: u32 = 256;

/// How a kernel is printed where the printer has a choice that cannot change a result: the
/// device's tuner times them ([`print_with`]). Every choice prints the same statements for
/// each element, so every printing gives the default's bytes, NaNs aside: each printing is
/// compiled anew, and a driver may give a NaN another sign or payload (lavapipe's LLVM, where
/// it orders an addition's operands otherwise), as WGSL allows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgslOptions {
    /// Threads per workgroup of map loops (at most the adapter's
    /// `max_invocations_per_workgroup`, which printing checks).
    pub map_threads: u32,
    /// Indices each thread of a map loop computes, one after another: a workgroup covers
    /// `map_threads * map_elements` consecutive indices, thread `t` those `t` modulo
    /// `map_threads` apart (neighbouring threads touch neighbouring elements).
    pub map_elements: u32,
}

impl Default for WgslOptions {
    /// [`MAP_THREADS`] threads, one index each: what [`print()`] prints.
    fn default() -> WgslOptions {
        WgslOptions { map_threads: MAP_THREADS, map_elements: 1 }
    }
}

/// A parameter of the printed module: an argument or a scratch buffer.
pub(crate) struct Param {
    pub dtype: DType,
    pub len: usize,
    /// Written by the kernel (an output or scratch).
    pub writable: bool,
}

/// The module under construction: declarations, entry points, bindings.
pub(crate) struct Module<'a> {
    pub features: &'a Features,
    pub options: WgslOptions,
    pub params: Vec<Param>,
    /// Scratch bindings beyond the parameters (raw u32 words, for split row kernels).
    pub words: Vec<u64>,
    pub body: String,
    pub entries: Vec<Entry>,
}

impl Module<'_> {
    /// Per parameter: whether it is written (its sub-word elements are atomics).
    pub fn written(&self) -> Vec<bool> {
        self.params.iter().map(|p| p.writable).collect()
    }

    /// [`check_printable`] against the parameters.
    pub fn check(&self, loads: &[Load], stores: &[Store], expr: &Expr, dims: &[usize]) -> Result<(), String> {
        check_printable(loads, stores, expr, dims, |a| {
            self.params.get(a as usize).map(|p| (p.dtype, p.len, p.writable))
        })?;
        // Values WGSL cannot hold are refused wherever they appear.
        if let Some(n) = expr.nodes.iter().find(|n| n.dtype == DType::F64) {
            return Err(format!("{:?}: {}", n.op, refusal(DType::F64)));
        }
        Ok(())
    }

    /// Marks the entry begun last as a copy of argument `from` into `to` ([`Entry::copy`]).
    pub fn skip_when_one_buffer(&mut self, from: u16, to: u16) {
        if let Some(e) = self.entries.last_mut() {
            e.copy = Some((from, to));
        }
    }

    /// Adds an entry of `groups` workgroups of `threads` threads: its header and the linear
    /// workgroup index `wg`, returning early past `groups` (a uniform branch).
    pub fn begin_entry(&mut self, name: &str, groups: u64, threads: u32, comment: &str) -> Result<(), String> {
        let workgroups = split_workgroups(groups, self.features.max_workgroups_per_dimension)?;
        self.entries.push(Entry { name: name.into(), workgroups, threads, copy: None });
        let _ = write!(
            self.body,
            "\n// {comment}\n@compute @workgroup_size({threads})\nfn {name}(@builtin(workgroup_id) wid: vec3<u32>, \
             @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{\n  \
             let wg = wid.x + nwg.x * (wid.y + nwg.y * wid.z);\n  if (wg >= {groups}u) {{ return; }}\n  {LAUNDER}\n"
        );
        Ok(())
    }
}

/// Sets `braid_zero`, a zero the shader compiler cannot see: read from the uniform buffer of
/// [`Binding::Zero`]. Every f32 node's value passes through `braid_launder`, an exclusive or
/// with it, so that no compiler rewrites an expression across nodes with algebra that ignores
/// NaN, infinities and signed zeros (Mesa turns `exp(log(x))` into `x` and `x + 0.0` into
/// `x`), nor contracts `a * b + c` into a fused multiply-add: WGSL offers no way to ask for
/// IEEE semantics, and naga emits no SPIR-V float controls. (A zero computed in the shader,
/// such as a buffer's length shifted right by 31, is folded away: Mesa proves it zero.)
const LAUNDER: &str = "braid_zero = braid_zero_uniform.x;";

/// `groups` workgroups as a dispatch of at most `max` per dimension (x * y * z >= groups).
pub fn split_workgroups(groups: u64, max: u32) -> Result<[u32; 3], String> {
    let max = max.max(1) as u64;
    if groups > max * max * max || groups >= 1 << 32 {
        return Err(format!("{groups} workgroups: more than one dispatch holds ({max} per dimension)"));
    }
    let z = groups.div_ceil(max * max).max(1);
    let y = groups.div_ceil(max * z).max(1);
    let x = groups.div_ceil(y * z).max(1);
    Ok([x as u32, y as u32, z as u32])
}

/// Prints `kernel` as one WGSL module for an adapter with `features`. Errors on IR the CPU
/// would reject too (ill-typed expressions, views outside their arguments), on views whose
/// dims differ from their loop's, on dtypes [`supports`] refuses, and on kernels beyond the
/// adapter's limits (each error names the limit).
pub fn print(kernel: &Kernel, features: &Features) -> Result<WgslSource, String> {
    print_with(kernel, features, &WgslOptions::default())
}

/// [`print()`] with `options` (the default's printing for [`WgslOptions::default`]): map loops
/// of other workgroup sizes and indices per thread. Errors as [`print()`] does, and on
/// options no adapter could run (no threads, or a map loop whose last workgroup would reach
/// past u32 indices).
pub fn print_with(kernel: &Kernel, features: &Features, options: &WgslOptions) -> Result<WgslSource, String> {
    if options.map_threads == 0 || options.map_elements == 0 {
        return Err(format!("{options:?}: a map loop needs threads and indices per thread"));
    }
    let mut m = Module {
        features,
        options: *options,
        params: (kernel.args.iter().enumerate())
            .map(|(i, a)| Param { dtype: a.dtype, len: a.len, writable: i >= kernel.inputs })
            .collect(),
        words: vec![],
        body: String::new(),
        entries: vec![],
    };
    for (i, a) in kernel.args.iter().enumerate() {
        supports(a.dtype, features).map_err(|e| format!("argument {i}: {e}"))?;
    }
    match &kernel.body {
        Body::Map(loops) => {
            for (k, l) in loops.iter().enumerate() {
                map::print_loop(&mut m, l, &format!("loop{k}"))?;
            }
        }
        Body::Rows(r) => rows::print_rows(&mut m, r)?,
        Body::Matmul(mm) => matmul::print_matmul(&mut m, mm)?,
        Body::QuantMatmul(q) => quant::print_quant_matmul(&mut m, q)?,
        Body::Quantize(q) => return Err(format!("a {} quantization runs on the CPU, not as a WGSL kernel", q.layout)),
        Body::Collective(c) => return Err(format!("{}: the wgpu device runs no collectives", c.kind.name())),
        Body::Gather(g) => indexing::print_gather(&mut m, g)?,
        Body::Scatter(s) => indexing::print_scatter(&mut m, s)?,
        Body::ScatterWrite(s) => indexing::print_scatter_write(&mut m, s)?,
        Body::Attention(a) => attention::print_attention(&mut m, a)?,
    }
    let mut bindings: Vec<Binding> = vec![];
    let mut decls = String::new();
    for (b, p) in m.params.iter().enumerate() {
        memory::declare(&mut decls, b, p.dtype, p.writable)?;
        let bytes = binding_bytes(p.dtype, p.len);
        if bytes > features.max_storage_buffer_binding_size {
            return Err(format!(
                "binding {b} of {bytes} bytes exceeds the adapter's max_storage_buffer_binding_size ({})",
                features.max_storage_buffer_binding_size
            ));
        }
        bindings.push(match b < kernel.args.len() {
            true => Binding::Arg { arg: b as u16, bytes },
            false => Binding::Scratch { bytes },
        });
    }
    for (j, &words) in m.words.iter().enumerate() {
        let b = m.params.len() + j;
        let _ = writeln!(decls, "@group(0) @binding({b}) var<storage, read_write> a{b}: array<u32>;");
        let bytes = words.max(1) * 4;
        if bytes > features.max_storage_buffer_binding_size {
            return Err(format!(
                "scratch binding {b} of {bytes} bytes exceeds the adapter's max_storage_buffer_binding_size ({})",
                features.max_storage_buffer_binding_size
            ));
        }
        bindings.push(Binding::Scratch { bytes });
    }
    if bindings.len() > features.max_storage_buffers_per_stage as usize {
        return Err(format!(
            "{} storage buffers exceed the adapter's max_storage_buffers_per_stage ({})",
            bindings.len(),
            features.max_storage_buffers_per_stage
        ));
    }
    if let Some(e) = m.entries.iter().find(|e| e.threads > features.max_invocations_per_workgroup) {
        return Err(format!(
            "entry {} has {} threads per workgroup, over the adapter's max_compute_invocations_per_workgroup ({})",
            e.name, e.threads, features.max_invocations_per_workgroup
        ));
    }
    let _ = writeln!(decls, "@group(0) @binding({}) var<uniform> braid_zero_uniform: vec4<u32>;", bindings.len());
    bindings.push(Binding::Zero);
    let mut source = String::from("// braid kernel: WGSL for wgpu.\n");
    source.push_str(&decls);
    source.push('\n');
    source.push_str(&helpers::used(&m.body));
    source.push_str(&m.body);
    Ok(WgslSource { source, entries: m.entries, bindings })
}

/// Per node, whether a store depends on it (the others cannot change an output and are not
/// printed).
pub(crate) fn live(expr: &Expr, stores: &[Store]) -> Vec<bool> {
    let mut live = vec![false; expr.nodes.len()];
    stores.iter().for_each(|s| live[s.value as usize] = true);
    for i in (0..live.len()).rev() {
        if live[i] {
            expr.nodes[i].op.operands().into_iter().for_each(|o| live[o] = true);
        }
    }
    live
}

/// `let v{i}: T = ...;` for node `i` of `expr` (a load, or a node [`scalar::node_expr`] prints).
pub(crate) fn let_node(
    out: &mut String,
    indent: &str,
    expr: &Expr,
    loads: &[Load],
    written: &[bool],
    i: usize,
    index: &str,
) -> Result<(), String> {
    let n = &expr.nodes[i];
    let value = match n.op {
        ExprOp::Load(slot) => memory::load_of(&loads[slot as usize], written)?,
        _ => scalar::node_expr(expr, i, index)?,
    };
    let _ = match n.dtype {
        // See `LAUNDER`.
        DType::F32 => writeln!(out, "{indent}let v{i}: f32 = braid_launder({value});"),
        d => writeln!(out, "{indent}let v{i}: {} = {value};", scalar::reg_type(d)?),
    };
    Ok(())
}
