//! Printing of fused attention ([`AttentionKernel`]) as CUDA C: one entry per pass, launched as
//! [`Launch::Tiles`] (one block per problem and tile, dynamic shared memory for the tiles).
//!
//! The device code is fixed text (`attention_mma.cu` and `attention_mma_passes.cu` for f16 and
//! bf16 on tensor cores, `attention_simt.cu` for f32 and f64 on CUDA cores); this module prints
//! the preamble it is compiled against: the storage and compute types, the shape (problems,
//! `sq`, `sk`, `d`, causal), the scale, the tiling ([`AttentionTiles`]), and for each operand the
//! element offset of a problem (decomposed over the batch dimensions with the view's strides),
//! its row and column strides, and whether 16-byte copies can read it (a unit column stride
//! and rows, problems and offset at multiples of 16 bytes; the kernel also checks the address
//! when it runs). Then the entry point, which calls the pass's device function with the
//! arguments in their places.
//!
//! Tiling: halves pad the head dimension to a multiple of 16 (the mma's k), f32 and f64 to a
//! multiple of 4 (four threads per row); tiles are chosen per padded head dimension so that the
//! accumulators fit in registers. Must never: print a kernel `check` has not accepted, or a
//! launch whose shared memory exceeds what the tiling declares.

use super::*;
use crate::attention::{AttentionKernel, AttentionPass};
use crate::kernel::Load;

const MMA: &str = include_str!("attention_mma.cu");
const MMA_PASSES: &str = include_str!("attention_mma_passes.cu");
const SIMT: &str = include_str!("attention_simt.cu");

/// Largest head dimension printed.
pub const MAX_HEAD_DIM: usize = 256;

/// How one attention kernel is tiled: `warps` warps of 32 threads per block, each owning `mw`
/// slabs of 16 rows (tensor cores; f32 and f64 blocks are 4 warps of 32 rows of 4 threads);
/// `bq` query rows and `bk` key rows per tile; the blocks per multiprocessor the registers are
/// capped for (`__launch_bounds__`); the head dimension padded to `dp`; whether the
/// exact path (tensor cores, causal: see `attention_mma.cu`) has scratch memory of its own
/// rather than the idle buffer; and the dynamic shared memory a block uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionTiles {
    pub warps: u32,
    pub mw: usize,
    pub bq: usize,
    pub bk: usize,
    pub min_blocks: u32,
    pub dp: usize,
    pub own_scratch: bool,
    pub shared_bytes: usize,
}

/// Which pass a kernel runs, for tiling.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    GradQ,
    GradKv,
}

fn pass_of(a: &AttentionKernel) -> Pass {
    match a.pass {
        AttentionPass::Forward { .. } => Pass::Forward,
        AttentionPass::GradQ { .. } => Pass::GradQ,
        AttentionPass::GradKv { .. } => Pass::GradKv,
    }
}

/// A tiling of fused attention on tensor cores: `warps` warps a block, each owning `mw` slabs
/// of 16 rows of the block's own side (queries, or keys for the key and value gradients),
/// `other` rows of the other side a tile, registers capped for `min_blocks` blocks a
/// multiprocessor. The table in [`attention_tiles`] picks one per pass and head dimension;
/// [`attention_shapes`] offers others to a tuner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    pub warps: u32,
    pub mw: usize,
    pub other: usize,
    pub min_blocks: u32,
}

/// The tiling of `a` (see the module docs); `Err` for a dtype or head dimension not printed.
pub fn attention_tiles(a: &AttentionKernel) -> Result<AttentionTiles, String> {
    attention_tiles_with(a, None)
}

/// The table's shape for a tensor-core pass over a padded head dimension `dp`. Chosen by
/// timing each pass's variants on an H200 (bf16, causal, d 64 and 128; then again by the
/// tuner over [`attention_shapes`], which found 4 warps of two slabs 4-5% faster than 8 of one
/// for the query gradient at d 128 and the key and value gradients at d 64, the same bits);
/// where two blocks are asked for, ptxas spills at most a few words.
fn table_shape(pass: Pass, dp: usize) -> AttentionShape {
    let (warps, mw, other, min_blocks) = match (pass, dp) {
        (Pass::Forward, ..=64) => (4, 2, 128, 1),
        (Pass::Forward, ..=128) => (4, 2, 64, 2),
        (Pass::GradQ, ..=64) => (8, 1, 64, 2),
        (Pass::GradQ, ..=128) => (4, 2, 32, 1),
        (Pass::GradKv, ..=64) => (4, 2, 32, 2),
        (Pass::GradKv, ..=128) => (8, 1, 64, 1),
        (Pass::Forward | Pass::GradQ, _) => (4, 1, 32, 1),
        (Pass::GradKv, _) => (4, 1, 16, 1),
    };
    AttentionShape { warps, mw, other, min_blocks }
}

/// The tilings other than the table's that a tuner may time for `a` (tensor cores only, head
/// dimensions up to 128; none otherwise), each fitting in a block's shared memory: the table's
/// tile sizes over other warps, slabs and register caps first (every row computed by the same
/// instructions in the same order: the same bits), then other tile sizes (a row's keys or
/// queries walked in other groups: another order of adds).
pub fn attention_shapes(a: &AttentionKernel) -> Vec<AttentionShape> {
    let Ok(default) = attention_tiles(a) else { return vec![] };
    if !matches!(a.dtype, DType::F16 | DType::BF16) || default.dp > 128 {
        return vec![];
    }
    let table = table_shape(pass_of(a), default.dp);
    let own = table.warps as usize * 16 * table.mw;
    let mut shapes = Vec::new();
    // The same tiles: warps x slabs covering the same rows, either register cap.
    for (warps, mw) in [(4u32, own / 64), (8, own / 128)] {
        for min_blocks in [1, 2] {
            if (1..=2).contains(&mw) && warps as usize * 16 * mw == own {
                shapes.push(AttentionShape { warps, mw, other: table.other, min_blocks });
            }
        }
    }
    // Other tiles: half or twice the other side, half the own side.
    for other in [table.other / 2, table.other * 2] {
        if (16..=128).contains(&other) {
            shapes.push(AttentionShape { other, ..table });
        }
    }
    if table.mw == 2 {
        shapes.push(AttentionShape { mw: 1, ..table });
    } else if table.warps == 8 {
        shapes.push(AttentionShape { warps: 4, ..table });
    }
    shapes.retain(|s| *s != table && attention_tiles_with(a, Some(*s)).is_ok_and(|t| t.shared_bytes <= MAX_SHARED));
    let mut seen = Vec::new();
    shapes.retain(|s| {
        !seen.contains(s) && {
            seen.push(*s);
            true
        }
    });
    shapes
}

/// Dynamic shared memory a block may use (227 KiB on Hopper and Ampere's A100).
const MAX_SHARED: usize = 227 * 1024;

/// [`attention_tiles`] with the tensor-core passes tiled by `shape` rather than the table
/// (`None`: the table; ignored for f32 and f64). `Err` for a shape the kernels cannot run:
/// warps other than 4 or 8, slabs other than 1 or 2, the other side's tile not a multiple
/// of 16 up to 128.
pub fn attention_tiles_with(a: &AttentionKernel, shape: Option<AttentionShape>) -> Result<AttentionTiles, String> {
    if a.d == 0 || a.d > MAX_HEAD_DIM {
        return Err(format!("attention with head dimension {} (CUDA prints 1 to {MAX_HEAD_DIM})", a.d));
    }
    let pass = pass_of(a);
    match a.dtype {
        DType::F16 | DType::BF16 => {
            let dp = a.d.next_multiple_of(16);
            let lds = dp + 8;
            let AttentionShape { warps, mw, other, min_blocks } = shape.unwrap_or_else(|| table_shape(pass, dp));
            let fits = matches!(warps, 4 | 8)
                && matches!(mw, 1 | 2)
                && other % 16 == 0
                && (16..=128).contains(&other)
                && matches!(min_blocks, 1 | 2);
            if !fits {
                return Err(format!("attention tiled {:?}: not a tiling the kernels run", shape));
            }
            let own = warps as usize * 16 * mw;
            let (bq, bk) = if pass == Pass::GradKv { (other, own) } else { (own, other) };
            let elems = match pass {
                Pass::Forward => (bq + 4 * bk) * lds,
                Pass::GradQ => (2 * bq + 4 * bk) * lds,
                Pass::GradKv => (2 * bk + 4 * bq) * lds,
            };
            let stats = if pass == Pass::GradKv { 4 * bq * 4 } else { 0 };
            // The exact path's scratch: 16 rows of the other side's tile per warp, in the idle
            // buffer (a pair of tiles) where it fits.
            let scratch = warps as usize * 16 * other;
            let own_scratch = a.causal && scratch > 2 * other * lds;
            let bytes = elems * 2 + stats + if own_scratch { scratch * 2 } else { 0 };
            Ok(AttentionTiles { warps, mw, bq, bk, min_blocks, dp, own_scratch, shared_bytes: bytes })
        }
        DType::F32 | DType::F64 => {
            let size = a.dtype.size();
            let dp = a.d.next_multiple_of(4);
            let lds = dp + 1;
            let other = if dp * size <= 512 { 32 } else { 16 };
            let (bq, bk) = if pass == Pass::GradKv { (other, 32) } else { (32, other) };
            let elems = match pass {
                Pass::Forward => (32 + 2 * bk) * lds + 32 * (bk + 1),
                Pass::GradQ => (64 + 2 * bk) * lds + 32 * (bk + 1),
                Pass::GradKv => (64 + 2 * bq) * lds + 2 * 32 * (bq + 1) + 2 * bq,
            };
            let shared_bytes = elems * size;
            Ok(AttentionTiles { warps: 4, mw: 1, bq, bk, min_blocks: 1, dp, own_scratch: false, shared_bytes })
        }
        d => Err(format!("attention of {d} is not printed for CUDA (f16, bf16, f32 and f64 are)")),
    }
}

/// The text of `src` before its first `// @@` marker, then the section that `// @@name` opens.
fn sections(src: &'static str, name: &str) -> String {
    let head = src.find("// @@").unwrap_or(src.len());
    let marker = format!("// @@{name}\n");
    let body = src.find(&marker).map_or("", |at| {
        let rest = &src[at..];
        let end = rest[marker.len()..].find("// @@").map_or(rest.len(), |e| e + marker.len());
        &rest[..end]
    });
    format!("{}{body}", &src[..head])
}

pub(super) fn print_attention(
    out: &mut String,
    a: &AttentionKernel,
    name: &str,
    params: &[Param],
    options: &PrintOptions,
) -> Result<Vec<Entry>, String> {
    a.check(|i| params.get(i as usize).map(|p| (p.dtype, p.len)))?;
    let tiles = attention_tiles_with(a, options.attention)?;
    let (outputs, grads) = match &a.pass {
        AttentionPass::Forward { out, lse } => ([*out, *lse], None),
        AttentionPass::GradQ { grads, dq } => ([Some(*dq), None], Some(grads)),
        AttentionPass::GradKv { grads, dk, dv } => ([*dk, *dv], Some(grads)),
    };
    if outputs.into_iter().flatten().any(|o| !params[o as usize].writable) {
        return Err("an attention kernel's outputs must be writable arguments".into());
    }
    if a.sq > i32::MAX as usize / 2 || a.sk > i32::MAX as usize / 2 {
        return Err(format!("attention over {} queries and {} keys: more rows than a kernel indexes", a.sq, a.sk));
    }
    let pass = pass_of(a);
    let own_rows = if pass == Pass::GradKv { (a.sk, tiles.bk) } else { (a.sq, tiles.bq) };
    let blocks = a.problems() * own_rows.0.div_ceil(own_rows.1);
    if blocks == 0 {
        return Ok(vec![]); // no problem, or no row to write
    }
    let halves = matches!(a.dtype, DType::F16 | DType::BF16);
    let stats = a.stats_dtype();
    let _ = writeln!(
        out,
        "\n// Attention ({}): {} over problems {:?}, {} queries, {} keys, head dimension {}{}; tiles {tiles:?}.",
        match pass {
            Pass::Forward => "forward",
            Pass::GradQ => "query gradient",
            Pass::GradKv => "key and value gradients",
        },
        a.dtype,
        a.batch.as_slice(),
        a.sq,
        a.sk,
        a.d,
        if a.causal { ", causal" } else { "" },
    );
    let _ = writeln!(out, "typedef {} att_t;\ntypedef {} att_r;", storage_ctype(a.dtype), ctype(stats));
    let lit = |v: f64| float_literal(v, stats);
    let consts = [
        format!("constexpr int ATT_D = {};", a.d),
        format!("constexpr int ATT_DP = {};", tiles.dp),
        format!("constexpr int ATT_SQ = {};", a.sq),
        format!("constexpr int ATT_SK = {};", a.sk),
        format!("constexpr long long ATT_PROBLEMS = {}LL;", a.problems()),
        format!("constexpr bool ATT_CAUSAL = {};", a.causal),
        format!("constexpr att_r ATT_SCALE = {};", lit(a.scale())),
        format!("constexpr att_r ATT_SCALE_LOG2 = {};", lit(a.scale() * std::f64::consts::LOG2_E)),
        format!("constexpr att_r ATT_LOG2E = {};", lit(std::f64::consts::LOG2_E)),
        format!("#define ATT_NEG_INF (-{})", lit(f64::INFINITY)),
        format!("constexpr int ATT_WARPS = {};", tiles.warps),
        format!("constexpr int ATT_MW = {};", tiles.mw),
        format!("constexpr int ATT_BQ = {};", tiles.bq),
        format!("constexpr int ATT_BK = {};", tiles.bk),
    ];
    out.push_str(&consts.join("\n"));
    out.push('\n');
    if halves {
        let _ = writeln!(out, "constexpr int ATT_LDS = {};", tiles.dp + 8);
        let _ = writeln!(out, "constexpr bool ATT_SCRATCH_OWN = {};", tiles.own_scratch);
        let _ = writeln!(out, "#define ATT_BF16 {}", (a.dtype == DType::BF16) as u8);
    }
    let mut operands: Vec<(&str, &Load)> = vec![("Q", &a.q), ("K", &a.k), ("V", &a.v)];
    if let Some(g) = grads {
        operands.extend([("DO", &g.d_out), ("LSE", &g.lse), ("DELTA", &g.delta)]);
    }
    for (what, load) in operands {
        print_operand(out, a, what, load, halves);
    }
    let section = match pass {
        Pass::Forward => "forward",
        Pass::GradQ => "grad_q",
        Pass::GradKv => "grad_kv",
    };
    if halves {
        out.push_str(MMA);
        out.push_str(&sections(MMA_PASSES, section));
    } else {
        out.push_str(&sections(SIMT, section));
    }
    let arg = |o: Option<u16>, t: &str| o.map_or(format!("({t}*)nullptr"), |a| format!("a{a}"));
    let (q, k, v) = (a.q.arg, a.k.arg, a.v.arg);
    let call = match &a.pass {
        AttentionPass::Forward { out, lse } => format!(
            "att_forward<{}, {}>(a{q}, a{k}, a{v}, {}, {})",
            out.is_some(),
            lse.is_some(),
            arg(*out, "att_t"),
            arg(*lse, "att_r")
        ),
        AttentionPass::GradQ { grads: g, dq } => {
            format!("att_grad_q(a{q}, a{k}, a{v}, a{}, a{}, a{}, a{dq})", g.d_out.arg, g.lse.arg, g.delta.arg)
        }
        AttentionPass::GradKv { grads: g, dk, dv } => format!(
            "att_grad_kv<{}, {}>(a{q}, a{k}, a{v}, a{}, a{}, a{}, {}, {})",
            dk.is_some(),
            dv.is_some(),
            g.d_out.arg,
            g.lse.arg,
            g.delta.arg,
            arg(*dk, "att_t"),
            arg(*dv, "att_t")
        ),
    };
    let threads = tiles.warps * 32;
    let _ = writeln!(
        out,
        "\nextern \"C\" __global__ void __launch_bounds__({threads}, {}) {name}({}) {{\n  {call};\n}}",
        tiles.min_blocks,
        param_list(params)
    );
    let shared_bytes = u32::try_from(tiles.shared_bytes).map_err(|e| e.to_string())?;
    Ok(vec![Entry { name: name.into(), launch: Launch::Tiles { blocks, threads, shared_bytes } }])
}

/// An operand's offset function `att_at_<what>(problem)`, its row and column strides, and (for
/// halves) whether its rows can be copied 16 bytes at a time.
fn print_operand(out: &mut String, a: &AttentionKernel, what: &str, load: &Load, halves: bool) {
    let v = &load.view;
    let n = a.batch.len();
    let lower = what.to_lowercase();
    let _ = writeln!(
        out,
        "// {lower}: argument a{} over {:?}, strides {:?}, offset {}.",
        load.arg,
        v.dims.as_slice(),
        v.strides.as_slice(),
        v.offset
    );
    let _ = writeln!(out, "__device__ __forceinline__ long long att_at_{lower}(long long b) {{");
    let _ = writeln!(out, "  long long at = {}LL;", v.offset);
    for d in (0..n).rev() {
        let (e, s) = (a.batch[d], v.strides[d]);
        if e <= 1 {
            continue;
        }
        if s != 0 {
            let _ = writeln!(out, "  at += (b % {e}LL) * {s}LL;");
        }
        if d > 0 {
            let _ = writeln!(out, "  b /= {e}LL;");
        }
    }
    out.push_str("  return at;\n}\n");
    let rs = v.strides[n];
    let cs = v.strides.get(n + 1).copied().unwrap_or(0);
    let _ = writeln!(out, "constexpr long long ATT_{what}_RS = {rs}LL;");
    if v.strides.len() > n + 1 {
        let _ = writeln!(out, "constexpr long long ATT_{what}_CS = {cs}LL;");
        if halves {
            // 16 bytes are 8 halves: every step between rows and problems a multiple of 8.
            let rows = v.dims[n];
            let eights = |x: isize| x % 8 == 0;
            let batch_ok = (0..n).all(|d| a.batch[d] <= 1 || eights(v.strides[d]));
            let vec =
                cs == 1 && a.d.is_multiple_of(8) && (rows <= 1 || eights(rs)) && batch_ok && eights(v.offset as isize);
            let _ = writeln!(out, "constexpr bool ATT_{what}_VEC = {vec};");
        }
    }
}
