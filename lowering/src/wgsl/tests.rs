//! What the printer promises without a GPU: dispatch shapes, refusals with reasons, limits
//! named in errors, the bindings it asks for. `tests/wgsl_kernels.rs` runs the printed
//! kernels on an adapter and compares them with the CPU.

use super::*;
use crate::kernel::{Arg, MapLoop, View};
use braid_graph::expr::ExprBuilder;

fn view(dims: &[usize]) -> View {
    View::contiguous(&braid_graph::Shape::new(dims))
}

/// `out = in * 2` (a copy for bool) over `dims`, of `d`.
fn double(d: DType, dims: &[usize]) -> Kernel {
    let n = dims.iter().product();
    let mut b = ExprBuilder::new();
    let x = b.load(0, d);
    let y = match d {
        DType::Bool => x,
        _ => {
            let two = b.constant(2.0, d);
            b.mul(x, two)
        }
    };
    let l = MapLoop {
        dims: dims.into(),
        loads: vec![Load { arg: 0, dtype: d, view: view(dims) }],
        expr: b.finish(),
        stores: vec![Store { arg: 1, dtype: d, view: view(dims), value: y }],
    };
    Kernel { args: vec![Arg { dtype: d, len: n }; 2], inputs: 1, body: Body::Map(vec![l]) }
}

#[test]
fn dispatches_spread_over_dimensions_and_cover_every_workgroup() {
    for (groups, max) in [(1u64, 65_535u32), (65_535, 65_535), (65_536, 65_535), (1 << 31, 65_535), (27, 3), (5, 5)] {
        let [x, y, z] = split_workgroups(groups, max).unwrap();
        assert!(x <= max && y <= max && z <= max, "{groups} over {max}: {x} {y} {z}");
        let covered = x as u64 * y as u64 * z as u64;
        assert!(covered >= groups && covered - groups < (x as u64) * (y as u64), "{groups}: {x} {y} {z}");
    }
    assert!(split_workgroups(28, 3).unwrap_err().contains("3 per dimension"));
}

#[test]
fn dtypes_wgsl_lacks_are_refused_with_a_reason() {
    let f = Features::default();
    for d in [DType::F32, DType::F16, DType::BF16, DType::I32, DType::U8, DType::Bool] {
        assert!(supports(d, &f).is_ok());
        assert!(print(&double(d, &[3, 5]), &f).is_ok(), "{d}");
    }
    for d in [DType::F64, DType::I64] {
        let e = supports(d, &f).unwrap_err();
        assert!(e.starts_with(&format!("{d} is not supported on wgpu")) && e.contains("WGSL has no 64-bit"), "{e}");
        assert!(print(&double(d, &[3]), &f).unwrap_err().contains("not supported on wgpu"));
    }
}

#[test]
fn limits_are_named_when_a_kernel_exceeds_them() {
    let k = double(DType::F32, &[1000]);
    let f = Features { max_storage_buffers_per_stage: 1, ..Features::default() };
    assert!(print(&k, &f).unwrap_err().contains("max_storage_buffers_per_stage (1)"));
    let f = Features { max_storage_buffer_binding_size: 1024, ..Features::default() };
    assert!(print(&k, &f).unwrap_err().contains("max_storage_buffer_binding_size (1024)"));
    let f = Features { max_workgroups_per_dimension: 1, ..Features::default() };
    assert!(print(&k, &f).unwrap_err().contains("1 per dimension"));
}

#[test]
fn bindings_are_the_arguments_then_scratch_then_zero() {
    let src = print(&double(DType::U8, &[7]), &Features::default()).unwrap();
    assert_eq!(src.bindings, vec![Binding::Arg { arg: 0, bytes: 8 }, Binding::Arg { arg: 1, bytes: 8 }, Binding::Zero]);
    // Written sub-word elements are atomics; constants reach the shader as opaque bits.
    assert!(src.source.contains("var<storage, read_write> a1: array<atomic<u32>>"));
    assert!(src.source.contains("atomicOr(&a1["));
    assert_eq!(
        src.entries,
        vec![Entry { name: "loop0".into(), workgroups: [1, 1, 1], threads: MAP_THREADS, copy: None }]
    );
    let f = print(&double(DType::F32, &[7]), &Features::default()).unwrap();
    assert!(f.source.contains("bitcast<f32>(braid_opaque(0x40000000u))"), "{}", f.source);
    assert!(f.source.contains("braid_zero = braid_zero_uniform.x;"));
    // An empty loop has nothing to dispatch.
    assert!(print(&double(DType::F32, &[0]), &Features::default()).unwrap().entries.is_empty());
}

#[test]
fn batch_offsets_of_broadcast_products_are_computed_not_tabled() {
    // [n, 1] x [1, n] batches of 2 x 2 matrices: the left operand repeats each matrix n times,
    // the right one cycles; a transposed batch steps backwards; a prime count stays one level.
    let n = 30;
    let lhs: Vec<usize> = (0..n * n).map(|b| (b / n) * 4).collect();
    let rhs: Vec<usize> = (0..n * n).map(|b| (b % n) * 4).collect();
    let flipped: Vec<usize> = (0..6 * 5).map(|b| 100 - (b / 5) * 12 + (b % 5) * 2).collect();
    let prime: Vec<usize> = (0..7).map(|b| 3 + b * 5).collect();
    for offsets in [lhs, rhs, flipped, prime, vec![9]] {
        let (first, levels) = matmul::batch_levels(&offsets).expect("a broadcast batch has levels");
        assert!(levels.len() <= 2, "{levels:?}");
        for (b, &want) in offsets.iter().enumerate() {
            let got = levels.iter().fold(first as i128, |o, &(div, n, step)| o + ((b / div) % n) as i128 * step);
            assert_eq!(got, want as i128, "batch {b} of {levels:?}");
        }
        let mut decls = String::new();
        let e = matmul::batch_offset(&mut decls, "lhs_batch", &offsets);
        assert!(decls.is_empty() && !e.contains('['), "{e}\n{decls}");
    }
}

#[test]
fn map_loops_print_in_other_launch_shapes_on_request() {
    let k = double(DType::F16, &[1000, 3]);
    let f = Features::default();
    assert_eq!(print_with(&k, &f, &WgslOptions::default()).unwrap(), print(&k, &f).unwrap());
    for (threads, per) in [(64, 1), (128, 1), (256, 2), (64, 4)] {
        let o = WgslOptions { map_threads: threads, map_elements: per };
        let p = print_with(&k, &f, &o).unwrap();
        let groups = 3000u32.div_ceil(threads * per);
        assert_eq!(p.entries.len(), 1);
        assert_eq!((p.entries[0].threads, p.entries[0].workgroups), (threads, [groups, 1, 1]), "{o:?}");
        assert!(p.source.contains(&format!("@workgroup_size({threads})")), "{}", p.source);
        assert_eq!(p.source.contains("for (var k = 0u;"), per > 1, "{}", p.source);
        assert_eq!(p.bindings, print(&k, &f).unwrap().bindings);
    }
    // More threads than the adapter allows, none, or spans past u32 indices are refused.
    let o = WgslOptions { map_threads: 512, map_elements: 1 };
    assert!(print_with(&k, &f, &o).unwrap_err().contains("max_compute_invocations_per_workgroup (256)"));
    assert!(print_with(&k, &f, &WgslOptions { map_threads: 0, map_elements: 1 }).is_err());
    let huge = double(DType::U8, &[(1 << 32) - 100]);
    let o = WgslOptions { map_threads: 256, map_elements: 4 };
    let f = Features { max_storage_buffer_binding_size: 1 << 33, ..f };
    assert!(print_with(&huge, &f, &o).unwrap_err().contains("passes u32"));
}
