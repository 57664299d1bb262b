//! Gather cases of the CUDA printer test (`Body::Gather`, part of [`super`]): random gathers
//! with outputs of rank 0 to 3 (some over empty dimensions), of every element size (U8 and
//! Bool, F16 and BF16, F32 and I32, F64 and I64) and gathered dimensions of 0 to 6 positions.
//! The source is read through permuted, padded and reversed strides with an offset, stride 0
//! where an output dimension is the index's alone (an index select), and the gathered dimension
//! anywhere in its layout (`along` the largest stride, the smallest, negative, now and then 0);
//! the index through a view with an offset and stride 0 where an output dimension is the
//! source's alone (an embedding's expanded ids), in i64 or i32. Index values are in `-2..extent + 2`, now and
//! then far outside, so reads out of range on both sides (zero bits) happen. Sources are random
//! bits (no element all zero; floats also NaNs with random payloads); outputs start as random
//! bits too, and are compared with the CPU's byte for byte ([`differ`]).

use super::cases::{Case, new_case};
use super::common::Rng;
use braid_graph::DType;
use braid_lowering::{Arg, Body, GatherKernel, Load, View};

/// Element dtypes, two of each size; case `n` gathers `DTYPES[n % 8]`.
const DTYPES: [DType; 8] =
    [DType::U8, DType::Bool, DType::F16, DType::BF16, DType::F32, DType::I32, DType::F64, DType::I64];

/// How an output dimension reaches the source and the index (stride 0 where it does not).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Role {
    /// The source's alone: the index is the same along it (an embedding's feature dimension).
    Source,
    /// The index's alone: the source is the same along it (an index select's index dimensions).
    Index,
    /// Both (a `gather` along an axis: the index has the output's shape).
    Both,
    /// Neither: every element along it is the same.
    Neither,
}

/// Index values as the bytes of an index argument of `dtype` (i64, or i32: far-out values wrap,
/// and the CPU reads the same bits).
pub(super) fn index_bytes(dtype: DType, values: &[i64]) -> Vec<u8> {
    match dtype {
        DType::I32 => values.iter().flat_map(|&j| (j as i32).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|j| j.to_le_bytes()).collect(),
    }
}

/// A random layout of `dims`: strides in a random order (a transpose), some dimensions padded,
/// some reversed (a negative stride, the offset moved to their far end), stride 0 where
/// `zero`; with the view's offset and a length of the argument that holds it (a little more
/// than it reaches). Empty dimensions are laid out as if of one element.
pub(super) fn layout(rng: &mut Rng, dims: &[usize], zero: &[bool]) -> (Vec<isize>, usize, usize) {
    let rank = dims.len();
    let mut order: Vec<usize> = (0..rank).collect();
    if rng.chance(0.5) {
        for i in (1..rank).rev() {
            order.swap(i, rng.below(i + 1));
        }
    }
    let mut strides = vec![0isize; rank];
    let mut acc = 1;
    for &d in order.iter().rev() {
        if zero[d] {
            continue;
        }
        strides[d] = acc as isize;
        acc *= dims[d].max(1) + if rng.chance(0.25) { 1 + rng.below(2) } else { 0 };
    }
    let mut offset = if rng.chance(0.5) { 1 + rng.below(4) } else { 0 };
    for d in 0..rank {
        if strides[d] != 0 && rng.chance(0.25) {
            offset += (dims[d].max(1) - 1) * strides[d] as usize;
            strides[d] = -strides[d];
        }
    }
    let reach: usize = (0..rank).filter(|&d| strides[d] > 0).map(|d| (dims[d].max(1) - 1) * strides[d] as usize).sum();
    (strides, offset, offset + reach + 1 + rng.below(3))
}

/// `n` random elements of dtype `d` as bytes, none all zero bits; floats also NaNs with random
/// payloads and signs (quiet and signalling), which a gather must move unchanged.
fn random_bits(rng: &mut Rng, d: DType, n: usize) -> Vec<u8> {
    let size = d.size();
    let mut out = Vec::with_capacity(n * size);
    for _ in 0..n {
        let mut bits = rng.next() & (u64::MAX >> (64 - 8 * size));
        if d.is_float() && rng.chance(0.15) {
            // All exponent bits set, a nonzero mantissa.
            let mantissa = 8 * size - 1 - exponent_bits(d);
            let exponent = ((1u64 << exponent_bits(d)) - 1) << mantissa;
            bits = (bits & !exponent) | exponent | (1 + rng.below(3)) as u64;
        }
        if bits == 0 {
            bits = 1 + rng.below(255) as u64;
        }
        out.extend_from_slice(&bits.to_le_bytes()[..size]);
    }
    out
}

/// Exponent bits of a float dtype.
fn exponent_bits(d: DType) -> usize {
    match d {
        DType::F16 => 5,
        DType::BF16 | DType::F32 => 8,
        _ => 11,
    }
}

/// Random index values for a gathered dimension of `extent` positions: mostly in
/// `-2..extent + 2`, now and then far outside it; never all zero.
fn random_index(rng: &mut Rng, extent: usize, n: usize) -> Vec<i64> {
    let far = [i64::MIN, i64::MAX, -(1 << 40), 1 << 40, -1 - extent as i64, 1 + 2 * extent as i64];
    let mut v: Vec<i64> = (0..n)
        .map(|_| match rng.chance(0.05) {
            true => *rng.pick(&far),
            false => rng.below(extent + 4) as i64 - 2,
        })
        .collect();
    if v.iter().all(|&j| j == 0) {
        v[0] = -1;
    }
    v
}

/// A random gather (see the module docs): arguments the source and the index (in a random
/// order), then the output.
pub(crate) fn gather_case(rng: &mut Rng, n: usize) -> Case {
    use Role::*;
    let d = DTYPES[n % DTYPES.len()];
    let rank = *rng.pick(&[0, 1, 1, 2, 2, 3, 3]);
    let dims: Vec<usize> = (0..rank).map(|_| if rng.chance(0.08) { 0 } else { 1 + rng.below(5) }).collect();
    let extent = rng.below(7);
    let roles: Vec<Role> = (0..rank).map(|_| *rng.pick(&[Source, Source, Index, Both, Both, Neither])).collect();
    // The source's layout: the output's dimensions and the gathered one, in any order.
    let mut full = dims.clone();
    full.push(extent);
    let mut zero: Vec<bool> = roles.iter().map(|&r| matches!(r, Index | Neither)).collect();
    zero.push(rng.chance(0.05));
    let (mut src_strides, src_offset, src_len) = layout(rng, &full, &zero);
    let along = src_strides.pop().unwrap();
    let zero: Vec<bool> = roles.iter().map(|&r| matches!(r, Source | Neither)).collect();
    let (index_strides, index_offset, index_len) = layout(rng, &dims, &zero);
    let numel: usize = dims.iter().product();
    let (src_arg, index_arg) = if rng.chance(0.3) { (1, 0) } else { (0, 1) };
    let mut c = new_case(String::new(), 2, Body::Map(vec![]));
    let src = (Arg { dtype: d, len: src_len }, random_bits(rng, d, src_len));
    let index_values = random_index(rng, extent, index_len);
    let index_dtype = if rng.chance(0.5) { DType::I64 } else { DType::I32 };
    c.label =
        format!("gather {n} ({d} at {index_dtype}, dims {dims:?}, roles {roles:?}, extent {extent}, along {along})");
    let index = (Arg { dtype: index_dtype, len: index_len }, index_bytes(index_dtype, &index_values));
    let inputs = if src_arg == 0 { [src, index] } else { [index, src] };
    for (arg, init) in inputs {
        c.kernel.args.push(arg);
        c.init.push(init);
    }
    c.kernel.args.push(Arg { dtype: d, len: numel });
    c.init.push(random_bits(rng, d, numel));
    let view = |strides: &[isize], offset| View { dims: dims.as_slice().into(), strides: strides.into(), offset };
    let g = GatherKernel {
        dims: dims.as_slice().into(),
        src: Load { arg: src_arg, dtype: d, view: view(&src_strides, src_offset) },
        along,
        extent,
        index: Load { arg: index_arg, dtype: index_dtype, view: view(&index_strides, index_offset) },
        out: 2,
    };
    let args = &c.kernel.args;
    g.check(|a| args.get(a as usize).map(|a| (a.dtype, a.len)))
        .unwrap_or_else(|e| panic!("{}: the generated gather fails its check: {e}", c.label));
    c.kernel.body = Body::Gather(g);
    c
}

/// The index values a gather reads, one per output element.
fn read_indices(c: &Case) -> Vec<i64> {
    let Body::Gather(g) = &c.kernel.body else { unreachable!("a gather case") };
    index_values(&c.init[g.index.arg as usize], g.index.dtype, &g.dims, &g.index.view)
}

/// The values (i64, or i32 by `dtype`) `view` reads from `bytes` over `dims`, row-major.
pub(super) fn index_values(bytes: &[u8], dtype: DType, dims: &[usize], view: &View) -> Vec<i64> {
    let mut at = vec![0usize; dims.len()];
    (0..dims.iter().product())
        .map(|p| {
            let mut rest = p;
            for d in (0..dims.len()).rev() {
                at[d] = rest % dims[d];
                rest /= dims[d];
            }
            let o = view.offset_of(&at) as usize * dtype.size();
            match dtype {
                DType::I32 => i32::from_le_bytes(bytes[o..o + 4].try_into().unwrap()) as i64,
                _ => i64::from_le_bytes(bytes[o..o + 8].try_into().unwrap()),
            }
        })
        .collect()
}

/// `count` random gathers ([`gather_case`]), numbered from 0; asserts that they cover what the
/// module docs promise, so that another seed or generator cannot quietly lose a corner.
pub(crate) fn gather_cases(rng: &mut Rng, count: usize) -> Vec<Case> {
    let cases: Vec<Case> = (0..count).map(|n| gather_case(rng, n)).collect();
    let gathers: Vec<(&Case, &GatherKernel)> = (cases.iter())
        .map(|c| match &c.kernel.body {
            Body::Gather(g) => (c, g),
            _ => unreachable!("gather cases"),
        })
        .collect();
    let any = |what: &str, f: &dyn Fn(&Case, &GatherKernel) -> bool| {
        assert!(gathers.iter().any(|(c, g)| f(c, g)), "no gather case {what}");
    };
    let smallest = |g: &GatherKernel| g.src.view.strides.iter().filter(|&&s| s != 0).map(|s| s.unsigned_abs()).min();
    for d in DTYPES {
        any(&format!("of {d}"), &|_, g| g.src.dtype == d && g.numel() > 0 && g.extent > 0);
    }
    any("of rank 0", &|_, g| g.dims.is_empty());
    any("of rank 3", &|_, g| g.dims.len() == 3 && g.numel() > 0);
    any("over an empty dimension", &|_, g| g.dims.contains(&0));
    any("from an empty gathered dimension", &|_, g| g.extent == 0 && g.numel() > 0);
    any("with a negative `along`", &|_, g| g.along < 0 && g.numel() > 0 && g.extent > 1);
    any("transposed (`along` the smallest stride)", &|_, g| {
        g.extent > 1 && g.numel() > 1 && smallest(g).is_some_and(|s| g.along.unsigned_abs() < s)
    });
    any("with a source offset", &|_, g| g.src.view.offset > 0 && g.numel() > 0);
    any("with a broadcast source", &|_, g| g.src.view.strides.contains(&0) && g.numel() > 1);
    any("with a permuted source", &|_, g| {
        let s: Vec<usize> = g.src.view.strides.iter().map(|s| s.unsigned_abs()).filter(|&s| s != 0).collect();
        s.windows(2).any(|w| w[0] < w[1])
    });
    any("with an expanded index", &|_, g| g.index.view.strides.contains(&0) && g.numel() > 1);
    any("with an index offset", &|_, g| g.index.view.offset > 0 && g.numel() > 0);
    any("with the index first", &|_, g| g.index.arg == 0);
    any("reading a negative index", &|c, _| read_indices(c).iter().any(|&j| j < 0));
    any("reading an index past the end", &|c, g| read_indices(c).iter().any(|&j| j >= g.extent as i64 && g.extent > 0));
    any("reading in range", &|c, g| read_indices(c).iter().filter(|&&j| j >= 0 && j < g.extent as i64).count() > 3);
    cases
}

/// The first output element whose bits differ between the CPU's run (`cpu`, per argument) and
/// the printed kernel's (`got`, the case's file, argument `a` at `offsets[a]`), if any: a
/// gather moves bits, so every byte must be equal (NaN payloads included).
pub(crate) fn differ(c: &Case, offsets: &[usize], cpu: &[Vec<u8>], got: &[u8]) -> Option<String> {
    for a in c.kernel.inputs..c.kernel.args.len() {
        let size = c.kernel.args[a].dtype.size();
        let got = &got[offsets[a]..offsets[a] + c.init[a].len()];
        for (e, (w, g)) in cpu[a].chunks(size).zip(got.chunks(size)).enumerate() {
            if w != g {
                return Some(format!("{}: argument a{a} element {e}: cpu bytes {w:02x?}, printed {g:02x?}", c.label));
            }
        }
    }
    None
}
