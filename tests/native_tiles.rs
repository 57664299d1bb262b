//! Compiled CPU kernels that transpose against the interpreter, **bit for bit** (but for NaN
//! payloads): map loops whose last two dimensions are a tile that some view walks column-major
//! (a transposed load or store: `x.t().exp()`, `x.t().contiguous()`), which the host C printer
//! computes a whole tile at a time (transposing loads in and stores out of local arrays, 8x8 in
//! AVX registers for 32-bit values). Random loops of every dtype and view kind, one view made
//! column-major; large ones split into tasks that start and end inside tiles; and through a
//! device, transposed views compiled and interpreted.
//!
//! Skipped, with a message, when there is no C compiler.

// The printer test's generators; this test uses the map-loop ones.
#[allow(dead_code)]
#[path = "cuda_printer/cases.rs"]
mod cases;
mod common;

use braid::prelude::*;
use braid_graph::expr::ExprOp;
use braid_lowering::host_c::{HostTarget, print};
use braid_lowering::{Body, View};
use cases::*;
use common::Rng;

fn skip() -> bool {
    no_compiler("native_tiles")
}

/// Makes one view of `case` (a load or a store, at random) walk the loop's last two dimensions
/// column-major, as a transposed view does: stride 1 along the second to last, the tile's
/// (padded) height along the last, the batch dimensions' tiles one after another. Its argument
/// grows to hold the view, with new random values.
fn transpose_one_view(rng: &mut Rng, case: &mut Case) {
    let Body::Map(loops) = &mut case.kernel.body else { unreachable!("a map case") };
    let l = &mut loops[0];
    let rank = l.dims.len();
    let height = l.dims[rank - 2] + rng.below(3);
    let mut strides = vec![0isize; rank];
    strides[rank - 2] = 1;
    strides[rank - 1] = height as isize;
    let mut reach = height * l.dims[rank - 1];
    for d in (0..rank - 2).rev() {
        strides[d] = reach as isize;
        reach *= l.dims[d];
    }
    let offset = rng.below(4);
    let view = View { dims: l.dims.clone(), strides: strides.into(), offset };
    let which = rng.below(l.loads.len() + l.stores.len());
    let arg = if which < l.loads.len() {
        l.loads[which].view = view;
        l.loads[which].arg
    } else {
        let s = &mut l.stores[which - l.loads.len()];
        s.view = view;
        s.arg
    } as usize;
    let a = &mut case.kernel.args[arg];
    if a.len < offset + reach {
        a.len = offset + reach;
        case.init[arg] = encode(a.dtype, &random_values(rng, a.dtype, a.len, false));
    }
}

#[test]
fn transposing_tiles_compute_the_interpreters_bits() {
    if skip() {
        return;
    }
    let mut rng = Rng::new(0x711E);
    let mut cases = Vec::new();
    for n in 0..120 {
        let (a, b) = (2 + rng.below(63), 2 + rng.below(15));
        let dims = if rng.chance(0.5) { vec![a, b] } else { vec![1 + rng.below(3), a, b] };
        cases.push(map_case_over(&mut rng, n, &dims, MathLib::Host));
    }
    // Tasks of 32Ki indices that start and end inside tiles of 40 x 24 (and one of 64 x 16,
    // the CPU's own tile, whose tasks hold whole tiles).
    for (n, dims) in [[100, 40, 24], [90, 37, 20], [8, 64, 16]].into_iter().enumerate() {
        cases.push(map_case_over(&mut rng, 1000 + n, &dims, MathLib::Host));
    }
    cases.iter_mut().for_each(|c| transpose_one_view(&mut rng, c));
    let target = HostTarget { stream_bytes: 1 << 24, f32_lanes: 8 };
    let tiled = |c: &Case| print(&c.kernel, "k", target).is_ok_and(|s| s.source.contains("// A whole "));
    // Loops that read the element index (random numbers) are walked in runs: their values
    // depend on the order.
    let reads_index = |c: &Case| {
        let Body::Map(loops) = &c.kernel.body else { unreachable!("a map case") };
        loops[0].expr.nodes.iter().any(|n| matches!(n.op, ExprOp::Index | ExprOp::Random { .. }))
    };
    let untiled: Vec<&str> = cases.iter().filter(|c| tiled(c) == reads_index(c)).map(|c| c.label.as_str()).collect();
    assert!(untiled.is_empty(), "whole tiles not taken (or taken with the element index) by {untiled:?}");
    let whole_tiles = cases.iter().filter(|c| tiled(c)).count();
    let failures = compiled_differences(&cases);
    eprintln!("native_tiles: {} kernels compared, {whole_tiles} of them computed in whole tiles", cases.len());
    assert!(failures.is_empty(), "{} of {} kernels differ:\n{}", failures.len(), cases.len(), failures.join("\n"));
}

/// The bytes of `t`'s values.
fn bytes(t: &Tensor) -> Vec<u8> {
    fn read<T: Element>(t: &Tensor) -> Vec<u8> {
        let mut out = Vec::new();
        T::write_bytes(&t.to_vec::<T>().unwrap(), &mut out);
        out
    }
    match t.dtype() {
        DType::F32 => read::<f32>(t),
        DType::F64 => read::<f64>(t),
        DType::F16 => read::<half::f16>(t),
        DType::I32 => read::<i32>(t),
        DType::Bool => read::<bool>(t),
        d => panic!("no case makes {d}"),
    }
}

/// Transposed views of every kind a user makes (copies, unary and binary work beside
/// contiguous operands, a permuted batch, casts to and from f16, a comparison, integers, f64)
/// over inputs already computed: their results' bytes, and how many of their kernels ran
/// interpreted. (Each result is made before it is read, so that the view itself, a temporary,
/// is gone by then and folds into its reader's loads.)
fn transposed_work(dev: &Device) -> (Vec<Vec<u8>>, usize) {
    dev.seed(11);
    let x = Tensor::randn([512, 256], DType::F32, dev);
    let y = Tensor::randn([256, 512], DType::F32, dev);
    let z = Tensor::randn([6, 96, 160], DType::F32, dev);
    let (xi, xh) = ((&x * 1000.0).to_dtype(DType::I32), x.to_dtype(DType::F16));
    dev.sync().unwrap();
    let cases: [&dyn Fn() -> Tensor; 9] = [
        &|| x.t().contiguous(),
        &|| x.t().exp(),
        &|| (x.t() + &y) * x.t().tanh(),
        &|| z.permute(&[0, 2, 1]).sigmoid(),
        &|| x.t().to_dtype(DType::F16),
        &|| xh.t().to_dtype(DType::F32) * 2.0,
        &|| x.t().gt(&y),
        &|| xi.t().contiguous(),
        &|| x.t().to_dtype(DType::F64).sqrt(),
    ];
    let mut interpreted = 0;
    let results = cases
        .iter()
        .map(|case| {
            let before = dev.compiled_kernels_launched();
            let result = case();
            let bytes = bytes(&result);
            let kernels = dev.last_schedule().unwrap().kernel_count();
            assert_eq!(kernels, 1, "one kernel, the view folded into it");
            interpreted += kernels - (dev.compiled_kernels_launched() - before) as usize;
            bytes
        })
        .collect();
    (results, interpreted)
}

#[test]
fn transposed_views_give_the_same_bits_compiled_and_interpreted() {
    if skip() {
        return;
    }
    let dev = Device::new_cpu();
    dev.set_compile_mode(CompileMode::Off);
    let (interpreted, _) = transposed_work(&dev);
    assert_eq!(dev.compiled_kernels_launched(), 0);
    // Compiled before their first run: a transposing loop's tiles are long runs, not a small
    // kernel's short ones.
    dev.set_compile_mode(CompileMode::Blocking);
    let (compiled, left) = transposed_work(&dev);
    assert_eq!(left, 0, "kernels of transposed views ran interpreted");
    for (i, (a, b)) in interpreted.iter().zip(&compiled).enumerate() {
        assert!(a == b, "case {i}: compiled and interpreted differ");
    }
}
