//! Scatter-add cases of the CUDA printer test (`Body::Scatter`, part of [`super`]): random
//! scatter-adds of rank 1 to 3 (some over empty dimensions) along any axis, of every dtype a
//! scatter-add takes (F32, F64, I32, I64 and U8, the integers wrapping), with 0 to 6 output
//! positions and 0 to 8 source positions along the scattered dimension (now and then 15 to 47: rows
//! of several of the CUDA printer's batches), so that many source
//! elements name one output element and the order of each sum's fold shows in float bits. The
//! source, the index and the base (or none: zeros) are read through permuted, padded, reversed
//! and broadcast (stride 0) views with offsets, in a random order of arguments, the base now and
//! then through the source's argument; an index of stride 0 along the scattered dimension sends
//! a whole row to one element, and one of stride 0 along every other dimension is read by every
//! row (the printer's warp path), now and then over more rows and positions than a warp's lanes. Index values are in `-2..extent + 2` (in most cases mostly 0 or
//! 1), now and then far outside (`i64::MIN`, `i64::MAX`), so indices out of range on both sides
//! add nothing. Float sources
//! and bases are finite (moderate values in [-4, 4), now and then much larger ones, whose sums
//! round differently in another order; no NaN, whose bits a GPU's arithmetic does not keep),
//! integers random bits; outputs start as random bits (the kernel zeroes them), and are compared
//! with the CPU's byte for byte ([`super::gathers::differ`]). Scatters (`Body::ScatterWrite`,
//! [`scatter_write_cases`]) take the same shapes, views and indices, in any dtype.

use super::cases::{Case, new_case};
use super::common::Rng;
use super::gathers::index_bytes;
use braid_graph::DType;
use braid_lowering::{Arg, Body, Load, ScatterKernel, ScatterWriteKernel, View};

/// The dtypes a scatter-add takes; case `n` adds `DTYPES[n % 5]`.
const DTYPES: [DType; 5] = [DType::F32, DType::F64, DType::I32, DType::I64, DType::U8];

/// [`super::gathers::layout`] as a view of `dims`, with the length of an argument that holds it.
fn random_layout(rng: &mut Rng, dims: &[usize], zero: &[bool]) -> (View, usize) {
    let (strides, offset, len) = super::gathers::layout(rng, dims, zero);
    (View { dims: dims.into(), strides: strides.into(), offset }, len)
}

/// `n` random elements of dtype `d` as bytes: integers random bits (sums wrap), floats finite,
/// mostly in [-4, 4) with random low bits, now and then scaled up by a power of two (so that a
/// sum's rounding depends on its order), and now and then -0.
fn random_elements(rng: &mut Rng, d: DType, n: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * d.size());
    for _ in 0..n {
        let scale = |rng: &mut Rng, max: usize| match rng.chance(0.15) {
            true => 2f64.powi(1 + rng.below(max) as i32),
            false => 1.0,
        };
        match d {
            DType::F32 => {
                let x = if rng.chance(0.03) { -0.0 } else { rng.uniform(-4.0, 4.0) * scale(rng, 24) };
                out.extend((x as f32).to_le_bytes());
            }
            DType::F64 => {
                let x = if rng.chance(0.03) { -0.0 } else { rng.uniform(-4.0, 4.0) * scale(rng, 53) };
                out.extend(x.to_le_bytes());
            }
            _ => out.extend_from_slice(&rng.next().to_le_bytes()[..d.size()]),
        }
    }
    out
}

/// Random index values for `extent` output positions: mostly in `-2..extent + 2`, now and then
/// far outside it; in most cases mostly 0 or 1 (many source elements to one element).
fn random_index(rng: &mut Rng, extent: usize, n: usize) -> Vec<i64> {
    let far = [i64::MIN, i64::MAX, -(1 << 40), 1 << 40, -1 - extent as i64, 1 + 2 * extent as i64];
    let hot = rng.chance(0.7);
    (0..n)
        .map(|_| match rng.uniform(0.0, 1.0) {
            x if x < 0.06 => *rng.pick(&far),
            x if hot && x < 0.85 => rng.below(extent.clamp(1, 2)) as i64,
            _ => rng.below(extent + 4) as i64 - 2,
        })
        .collect()
}

/// What an input argument of a scatter case holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Input {
    Source,
    Index,
    Base,
}

/// A random scatter-add (see the module docs): arguments its inputs (the source, the index and
/// the base unless it is none or read through the source's argument) in a random order, then
/// the output.
pub(crate) fn scatter_case(rng: &mut Rng, n: usize) -> Case {
    let d = DTYPES[n % DTYPES.len()];
    // Cases 5 and 11 read one index for every row (an embedding's gradient); 11 over more rows
    // and source positions than a warp has lanes.
    let rank = if n % 12 == 11 { *rng.pick(&[2, 3]) } else { *rng.pick(&[1, 1, 2, 2, 3, 3]) };
    let dim = rng.below(rank);
    let mut out_dims: Vec<usize> = (0..rank).map(|_| if rng.chance(0.05) { 0 } else { 1 + rng.below(5) }).collect();
    if n % 12 == 11 {
        for d in (0..rank).filter(|&d| d != dim) {
            out_dims[d] = if rank == 2 { 33 + rng.below(40) } else { 6 + rng.below(5) };
        }
    }
    // Now and then an empty dimension, no output or no source positions along the scattered
    // one; else mostly more source positions than output ones.
    if n % 12 == 9 && rank > 1 {
        out_dims[(dim + 1) % rank] = 0;
    }
    out_dims[dim] = if n % 12 == 7 { 0 } else { *rng.pick(&[1, 1, 2, 2, 3, 4, 5, 6]) };
    let mut dims = out_dims.clone();
    dims[dim] = match n % 12 {
        8 => 0,
        // Rows of several of the CUDA printer's batches (`SCATTER_BATCH`, 16), ending inside
        // one or at its end.
        4 | 10 => *rng.pick(&[15, 16, 17, 31, 32, 33, 47]),
        11 => *rng.pick(&[33, 40, 47, 64, 65]),
        _ => *rng.pick(&[1, 2, 3, 4, 5, 6, 7, 7, 8, 8, 8]),
    };
    let zero = |rng: &mut Rng, p: f64| (0..rank).map(|_| rng.chance(p)).collect::<Vec<bool>>();
    let z = zero(rng, 0.15);
    let (src_view, src_len) = random_layout(rng, &dims, &z);
    let mut z = zero(rng, 0.2);
    if n % 12 == 5 || n % 12 == 11 {
        (0..rank).filter(|&d| d != dim).for_each(|d| z[d] = true);
    }
    let (index_view, index_len) = random_layout(rng, &dims, &z);
    let with_base = rng.chance(0.7);
    let z = zero(rng, 0.2);
    let (base_view, base_len) = random_layout(rng, &out_dims, &z);
    let shared = with_base && rng.chance(0.2);
    // The inputs in a random order.
    let mut inputs = vec![Input::Source, Input::Index];
    if with_base && !shared {
        inputs.push(Input::Base);
    }
    for i in (1..inputs.len()).rev() {
        inputs.swap(i, rng.below(i + 1));
    }
    let arg_of = |what: Input| inputs.iter().position(|&i| i == what).unwrap() as u16;
    let base = with_base.then(|| {
        let arg = if shared { arg_of(Input::Source) } else { arg_of(Input::Base) };
        Load { arg, dtype: d, view: base_view }
    });
    let base_label = match (&base, shared) {
        (None, _) => "none".to_string(),
        (Some(b), true) => format!("the source's argument at {:?}+{}", b.view.strides.as_slice(), b.view.offset),
        (Some(b), false) => format!("{:?}+{}", b.view.strides.as_slice(), b.view.offset),
    };
    let label = format!(
        "scatter {n} ({d}, {dims:?} along {dim} into {}, source {:?}+{}, index {:?}+{}, base {base_label})",
        out_dims[dim],
        src_view.strides.as_slice(),
        src_view.offset,
        index_view.strides.as_slice(),
        index_view.offset,
    );
    let index_dtype = if rng.chance(0.5) { DType::I64 } else { DType::I32 };
    let mut c = new_case(format!("{label} at {index_dtype}"), inputs.len(), Body::Map(vec![]));
    for &input in &inputs {
        let (arg, init) = match input {
            Input::Source => {
                let len = if shared { src_len.max(base_len) } else { src_len };
                (Arg { dtype: d, len }, random_elements(rng, d, len))
            }
            Input::Index => {
                let values = random_index(rng, out_dims[dim], index_len);
                (Arg { dtype: index_dtype, len: index_len }, index_bytes(index_dtype, &values))
            }
            Input::Base => (Arg { dtype: d, len: base_len }, random_elements(rng, d, base_len)),
        };
        c.kernel.args.push(arg);
        c.init.push(init);
    }
    let numel: usize = out_dims.iter().product();
    c.kernel.args.push(Arg { dtype: d, len: numel });
    c.init.push((0..numel * d.size()).map(|_| rng.next() as u8).collect());
    let s = ScatterKernel {
        dims: dims.as_slice().into(),
        dim,
        src: Load { arg: arg_of(Input::Source), dtype: d, view: src_view },
        index: Load { arg: arg_of(Input::Index), dtype: index_dtype, view: index_view },
        base,
        out_dims: out_dims.as_slice().into(),
        out: inputs.len() as u16,
    };
    let args = &c.kernel.args;
    s.check(|a| args.get(a as usize).map(|a| (a.dtype, a.len)))
        .unwrap_or_else(|e| panic!("{}: the generated scatter-add fails its check: {e}", c.label));
    c.kernel.body = Body::Scatter(s);
    c
}

/// The index values a scatter-add reads, one per source element (row-major over `dims`).
fn read_indices(c: &Case, s: &ScatterKernel) -> Vec<i64> {
    super::gathers::index_values(&c.init[s.index.arg as usize], s.index.dtype, &s.dims, &s.index.view)
}

/// The most source elements that add to one output element.
fn most_per_element(c: &Case, s: &ScatterKernel) -> usize {
    per_element(c, s).into_iter().max().unwrap_or(0)
}

/// How many source elements add to each output element.
fn per_element(c: &Case, s: &ScatterKernel) -> Vec<usize> {
    let numel: usize = s.out_dims.iter().product();
    let mut count = vec![0; numel];
    let mut at = vec![0usize; s.dims.len()];
    let extent = s.out_dims[s.dim] as i64;
    for (p, j) in read_indices(c, s).into_iter().enumerate() {
        let mut rest = p;
        for d in (0..s.dims.len()).rev() {
            at[d] = rest % s.dims[d];
            rest /= s.dims[d];
        }
        if (0..extent).contains(&j) {
            at[s.dim] = j as usize;
            let o: usize = (0..at.len()).fold(0, |o, d| o * s.out_dims[d] + at[d]);
            count[o] += 1;
        }
    }
    count
}

/// `count` random scatter-adds ([`scatter_case`]), numbered from 0; asserts that they cover
/// what the module docs promise, so that another seed or generator cannot quietly lose a corner.
pub(crate) fn scatter_cases(rng: &mut Rng, count: usize) -> Vec<Case> {
    let cases: Vec<Case> = (0..count).map(|n| scatter_case(rng, n)).collect();
    let scatters: Vec<(&Case, &ScatterKernel)> = (cases.iter())
        .map(|c| match &c.kernel.body {
            Body::Scatter(s) => (c, s),
            _ => unreachable!("scatter cases"),
        })
        .collect();
    let missing = std::cell::RefCell::new(vec![]);
    let any = |what: &str, f: &dyn Fn(&Case, &ScatterKernel) -> bool| {
        if !scatters.iter().any(|(c, s)| f(c, s)) {
            missing.borrow_mut().push(what.to_string());
        }
    };
    let numel = |s: &ScatterKernel| s.out_dims.iter().product::<usize>();
    let permuted = |v: &View| {
        let s: Vec<usize> = v.strides.iter().map(|s| s.unsigned_abs()).filter(|&s| s != 0).collect();
        s.windows(2).any(|w| w[0] < w[1])
    };
    for d in DTYPES {
        any(&format!("of {d} adding three or more to one element"), &|c, s| {
            s.dtype() == d && most_per_element(c, s) >= 3
        });
        any(&format!("of {d} with a base"), &|c, s| s.dtype() == d && s.base.is_some() && most_per_element(c, s) >= 2);
    }
    // Sums of three or more float elements, whose bits depend on the order of the fold.
    let folds: usize = (scatters.iter())
        .filter(|(_, s)| s.dtype().is_float())
        .map(|(c, s)| per_element(c, s).into_iter().filter(|&k| k >= 3).count())
        .sum();
    if folds < 12 {
        missing.borrow_mut().push(format!("folding three or more floats into 12 elements (only {folds})"));
    }
    any("of rank 1", &|c, s| s.dims.len() == 1 && most_per_element(c, s) >= 2);
    any("of rank 3", &|c, s| s.dims.len() == 3 && most_per_element(c, s) >= 2);
    any("along the last dimension of several", &|c, s| {
        s.dims.len() > 1 && s.dim == s.dims.len() - 1 && most_per_element(c, s) >= 2
    });
    any("along a dimension before the last", &|c, s| s.dim + 1 < s.dims.len() && most_per_element(c, s) >= 2);
    any("over an empty dimension other than the scattered one", &|_, s| {
        (0..s.dims.len()).any(|d| d != s.dim && s.dims[d] == 0)
    });
    any("from an empty scattered dimension", &|_, s| s.dims[s.dim] == 0 && numel(s) > 0);
    any("into an empty scattered dimension", &|_, s| s.out_dims[s.dim] == 0 && s.rows() > 0 && s.dims[s.dim] > 0);
    any("without a base", &|c, s| s.base.is_none() && most_per_element(c, s) >= 2);
    any("with a broadcast base", &|_, s| s.base.as_ref().is_some_and(|b| b.view.strides.contains(&0)) && numel(s) > 1);
    any("with a reversed base", &|_, s| s.base.as_ref().is_some_and(|b| b.view.strides.iter().any(|&x| x < 0)));
    any("with a permuted base", &|_, s| s.base.as_ref().is_some_and(|b| permuted(&b.view)));
    any("with a base offset", &|_, s| s.base.as_ref().is_some_and(|b| b.view.offset > 0) && numel(s) > 0);
    any("with the base in the source's argument", &|_, s| s.base.as_ref().is_some_and(|b| b.arg == s.src.arg));
    any("with a broadcast source", &|_, s| s.src.view.strides.contains(&0) && s.rows() * s.dims[s.dim] > 1);
    any("with a source of stride 0 along the scattered dimension", &|_, s| {
        s.src.view.strides[s.dim] == 0 && s.dims[s.dim] > 1 && s.out_dims[s.dim] > 0
    });
    any("with a reversed source", &|_, s| s.src.view.strides.iter().any(|&x| x < 0));
    any("with a permuted source", &|_, s| permuted(&s.src.view));
    any("with a source offset", &|_, s| s.src.view.offset > 0 && s.rows() > 0);
    any("with an index of stride 0 along the scattered dimension", &|c, s| {
        s.index.view.strides[s.dim] == 0 && s.dims[s.dim] > 1 && most_per_element(c, s) >= 2
    });
    any("with an index of stride 0 along another dimension", &|_, s| {
        (0..s.dims.len()).any(|d| d != s.dim && s.index.view.strides[d] == 0 && s.dims[d] > 1)
    });
    // The CUDA printer's warp path: every row reads the same indices.
    let shares = |s: &ScatterKernel| (0..s.dims.len()).all(|d| d == s.dim || s.index.view.strides[d] == 0);
    any("with an index every row shares, over several rows", &|c, s| {
        shares(s) && s.rows() > 1 && most_per_element(c, s) >= 2
    });
    any("with an index every row shares, over more rows and positions than a warp has lanes", &|c, s| {
        shares(s) && s.rows() > 32 && s.dims[s.dim] > 32 && most_per_element(c, s) >= 9
    });
    any("with a reversed index", &|_, s| s.index.view.strides.iter().any(|&x| x < 0));
    any("with an index offset", &|_, s| s.index.view.offset > 0 && s.rows() > 0);
    any("with the index first", &|_, s| s.index.arg == 0);
    any("with the source last", &|_, s| s.src.arg + 1 == s.out);
    any("reading a negative index", &|c, s| read_indices(c, s).iter().any(|&j| j < 0));
    any("reading an index past the end", &|c, s| {
        read_indices(c, s).iter().any(|&j| j >= s.out_dims[s.dim] as i64) && s.out_dims[s.dim] > 0
    });
    any("reading i64::MIN or i64::MAX", &|c, s| read_indices(c, s).iter().any(|&j| j == i64::MIN || j == i64::MAX));
    let missing = missing.into_inner();
    assert!(missing.is_empty(), "no scatter case {}", missing.join("; no scatter case "));
    cases
}

/// The dtypes of the scatter (`Body::ScatterWrite`) cases: it moves bits, so any; case `n`
/// writes `WRITE_DTYPES[n % 6]`.
const WRITE_DTYPES: [DType; 6] = [DType::F32, DType::BF16, DType::I32, DType::I64, DType::U8, DType::F64];

/// A random scatter (`Body::ScatterWrite`): as [`scatter_case`]'s shapes, views and indices
/// (many source elements naming one output element, so the last write must win), with a base
/// always read (a third of the cases contiguous, as the engine's in-place scatters read it),
/// arguments in a random order, then the output.
pub(crate) fn scatter_write_case(rng: &mut Rng, n: usize) -> Case {
    let d = WRITE_DTYPES[n % WRITE_DTYPES.len()];
    let rank = *rng.pick(&[1, 2, 2, 3, 3]);
    let dim = rng.below(rank);
    let mut out_dims: Vec<usize> = (0..rank).map(|_| if rng.chance(0.05) { 0 } else { 1 + rng.below(5) }).collect();
    out_dims[dim] = *rng.pick(&[1, 2, 3, 4, 6, 9]);
    let mut dims = out_dims.clone();
    dims[dim] = *rng.pick(&[0, 1, 1, 2, 3, 5, 8, 17]);
    let zero = |rng: &mut Rng, p: f64| (0..rank).map(|_| rng.chance(p)).collect::<Vec<bool>>();
    let z = zero(rng, 0.15);
    let (src_view, src_len) = random_layout(rng, &dims, &z);
    let z = zero(rng, 0.2);
    let (index_view, index_len) = random_layout(rng, &dims, &z);
    let (base_view, base_len) = if n.is_multiple_of(3) {
        let numel = out_dims.iter().product::<usize>();
        (View::contiguous(&braid_graph::Shape::new(&out_dims)), numel.max(1))
    } else {
        let z = zero(rng, 0.2);
        random_layout(rng, &out_dims, &z)
    };
    let mut inputs = vec![Input::Source, Input::Index, Input::Base];
    for i in (1..inputs.len()).rev() {
        inputs.swap(i, rng.below(i + 1));
    }
    let arg_of = |what: Input| inputs.iter().position(|&i| i == what).unwrap() as u16;
    let label = format!(
        "scatter write {n} ({d}, {dims:?} along {dim} into {}, source {:?}+{}, index {:?}+{}, base {:?}+{})",
        out_dims[dim],
        src_view.strides.as_slice(),
        src_view.offset,
        index_view.strides.as_slice(),
        index_view.offset,
        base_view.strides.as_slice(),
        base_view.offset,
    );
    let index_dtype = if rng.chance(0.5) { DType::I64 } else { DType::I32 };
    let mut c = new_case(format!("{label} at {index_dtype}"), inputs.len(), Body::Map(vec![]));
    for &input in &inputs {
        let (arg, init) = match input {
            Input::Source => (Arg { dtype: d, len: src_len }, random_elements(rng, d, src_len)),
            Input::Index => {
                let values = random_index(rng, out_dims[dim], index_len);
                (Arg { dtype: index_dtype, len: index_len }, index_bytes(index_dtype, &values))
            }
            Input::Base => (Arg { dtype: d, len: base_len }, random_elements(rng, d, base_len)),
        };
        c.kernel.args.push(arg);
        c.init.push(init);
    }
    let numel: usize = out_dims.iter().product();
    c.kernel.args.push(Arg { dtype: d, len: numel });
    c.init.push((0..numel * d.size()).map(|_| rng.next() as u8).collect());
    let s = ScatterWriteKernel {
        dims: dims.as_slice().into(),
        dim,
        src: Load { arg: arg_of(Input::Source), dtype: d, view: src_view },
        index: Load { arg: arg_of(Input::Index), dtype: index_dtype, view: index_view },
        base: Load { arg: arg_of(Input::Base), dtype: d, view: base_view },
        out_dims: out_dims.as_slice().into(),
        out: inputs.len() as u16,
    };
    let args = &c.kernel.args;
    s.check(|a| args.get(a as usize).map(|a| (a.dtype, a.len)))
        .unwrap_or_else(|e| panic!("{}: the generated scatter fails its check: {e}", c.label));
    c.kernel.body = Body::ScatterWrite(s);
    c
}

/// `count` random scatters ([`scatter_write_case`]); asserts that some write several source
/// elements to one output element (the last must win), read a contiguous base, and read
/// indices out of range.
pub(crate) fn scatter_write_cases(rng: &mut Rng, count: usize) -> Vec<Case> {
    let cases: Vec<Case> = (0..count).map(|n| scatter_write_case(rng, n)).collect();
    let writes: Vec<(&Case, &ScatterWriteKernel)> = (cases.iter())
        .map(|c| match &c.kernel.body {
            Body::ScatterWrite(s) => (c, s),
            _ => unreachable!("scatter cases"),
        })
        .collect();
    let as_add = |s: &ScatterWriteKernel| ScatterKernel {
        dims: s.dims.clone(),
        dim: s.dim,
        src: s.src.clone(),
        index: s.index.clone(),
        base: None,
        out_dims: s.out_dims.clone(),
        out: s.out,
    };
    let colliding = writes.iter().filter(|(c, s)| most_per_element(c, &as_add(s)) >= 2).count();
    assert!(colliding >= count / 4, "only {colliding} scatters write two elements to one");
    assert!(writes.iter().any(|(_, s)| s.base_in_place() && s.rows() > 0), "no scatter reads a contiguous base");
    let outside = |c: &Case, s: &ScatterWriteKernel| {
        read_indices(c, &as_add(s)).iter().any(|&j| j < 0 || j >= s.out_dims[s.dim] as i64)
    };
    assert!(writes.iter().any(|(c, s)| outside(c, s)), "no scatter reads an index out of range");
    cases
}
