//! The CUDA printer's packed kernels: several map loops as one launch (`loops::print_packed`).

use super::tests::{args, contiguous, in_order, load, store};
use super::*;
use crate::kernel::{Kernel, MapLoop};
use braid_graph::expr::ExprBuilder;

#[test]
fn packed_loops_are_one_launch_each_loop_a_range_of_its_blocks() {
    // Two independent loops (a packed kernel): y = x * 2 over 1,000 elements, w = z + 1 over 3.
    let loop_of = |input: u16, output: u16, n: usize, scale: bool| {
        let mut b = ExprBuilder::new();
        let x = b.load(0, DType::F32);
        let c = b.constant(if scale { 2.0 } else { 1.0 }, DType::F32);
        let y = if scale { b.mul(x, c) } else { b.add(x, c) };
        let (ld, st) = (load(input, DType::F32, contiguous(&[n])), store(output, DType::F32, contiguous(&[n]), y));
        MapLoop { dims: [n].as_slice().into(), loads: vec![ld], expr: b.finish(), stores: vec![st] }
    };
    let loops = vec![loop_of(0, 2, 1000, true), loop_of(1, 3, 3, false)];
    let k = Kernel {
        args: args(&[(DType::F32, 1000), (DType::F32, 3), (DType::F32, 1000), (DType::F32, 3)]),
        inputs: 2,
        body: Body::Map(loops),
    };
    let p = print(&k, "upd").unwrap();
    // 1,000 indices in chunks of 4: 250 threads, one block; 3 indices: one block.
    assert_eq!(p.entries, vec![Entry { name: "upd_loops".into(), launch: Launch::Rows { rows: 2, threads: 256 } }]);
    in_order(
        &p.source,
        &[
            // Each loop takes the arguments it uses, under the entry's names.
            "__device__ __forceinline__ void upd_loops_part0(const float* a0, float* a2, long long t0, long long nt) {",
            "for (long long c = t0; c * 4 < vec_end; c += nt) {",
            "for (long long i = vec_end + t0; i < 1000LL; i += nt) {",
            "__device__ __forceinline__ void upd_loops_part1(const float* a1, float* a3, long long t0, long long nt) {",
            "for (long long i = 0 + t0; i < 3LL; i += nt) {",
            "extern \"C\" __global__ void upd_loops(const float* a0, const float* a1, float* a2, float* a3) {",
            "if (b < 1LL) { upd_loops_part0(a0, a2, (b - 0LL) * blockDim.x + threadIdx.x, 1LL * blockDim.x); return; }",
            "if (b < 2LL) { upd_loops_part1(a1, a3, (b - 1LL) * blockDim.x + threadIdx.x, 1LL * blockDim.x); return; }",
        ],
    );
    // A loop of nothing gets no blocks.
    let mut empty = k.clone();
    let Body::Map(loops) = &mut empty.body else { unreachable!() };
    loops[1].dims = [0].as_slice().into();
    loops[1].loads[0].view = contiguous(&[0]);
    loops[1].stores[0].view = contiguous(&[0]);
    let p = print(&empty, "upd").unwrap();
    assert_eq!(p.entries[0].launch, Launch::Rows { rows: 1, threads: 256 });
    assert!(!p.source.contains("upd_loops_part1(a1"), "{}", p.source);
}

#[test]
fn rows_no_multiple_of_the_width_walk_chunks_from_each_rows_start() {
    // A narrow of padded rows (37 of every 48 bf16 elements), times 2: every row starts a
    // chunk of 8; its last chunk (5 elements) goes index by index.
    let (rows, n, padded) = (3usize, 37usize, 48usize);
    let view = |offset: usize| View {
        dims: [rows, n].as_slice().into(),
        strides: [padded as isize, 1].as_slice().into(),
        offset,
    };
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::BF16);
    let two = b.constant(2.0, DType::BF16);
    let y = b.mul(x, two);
    let l = MapLoop {
        dims: [rows, n].as_slice().into(),
        loads: vec![load(0, DType::BF16, view(0))],
        expr: b.finish(),
        stores: vec![store(1, DType::BF16, view(16), y)],
    };
    let k = Kernel {
        args: args(&[(DType::BF16, rows * padded), (DType::BF16, rows * padded + 16)]),
        inputs: 1,
        body: Body::Map(vec![l.clone()]),
    };
    let p = print(&k, "pad").unwrap();
    // 5 chunks a row (4 whole, 1 partial), 15 in all.
    assert_eq!(p.entries[0].launch, Launch::Map { numel: 15, block: 256 });
    in_order(
        &p.source,
        &[
            "8 per thread where the arguments are aligned, chunks starting each row of 37",
            "const long long vec_end = vec ? 111LL : 0LL;",
            "for (long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x; vec && c < 15LL;",
            "const long long row = c / 5LL, k = c % 5LL;",
            "const long long i0 = row * 37LL + k * 8;",
            "if (k == 4LL) {",
            "for (long long i = i0; i < row * 37LL + 37LL; ++i) {",
            "*reinterpret_cast<uint4*>(a1 + at_s0)",
            "for (long long i = vec_end + ",
        ],
    );
    // A view the flat path walks (a contiguous store) keeps the flat path.
    let mut contiguous = l.clone();
    contiguous.stores[0].view = View::contiguous(&braid_graph::Shape::new(&[rows, n]));
    let k = Kernel { body: Body::Map(vec![contiguous]), ..k };
    let p = print(&k, "pad").unwrap();
    assert!(p.source.contains("c * 8 < vec_end") && !p.source.contains("row * 37LL"), "{}", p.source);
}

#[test]
fn vector_bytes_narrow_a_map_loops_chunks_or_leave_none() {
    // y = x * 2 over 1,024 bf16: chunks of 8 (16 bytes) by default, of 4 (`uint2`) at 8 bytes,
    // of 2 (`unsigned int`) at 4 bytes; at 0 every index goes alone.
    let mut b = ExprBuilder::new();
    let x = b.load(0, DType::BF16);
    let two = b.constant(2.0, DType::BF16);
    let y = b.mul(x, two);
    let n = 1024;
    let l = MapLoop {
        dims: [n].as_slice().into(),
        loads: vec![load(0, DType::BF16, contiguous(&[n]))],
        expr: b.finish(),
        stores: vec![store(1, DType::BF16, contiguous(&[n]), y)],
    };
    let k = Kernel { args: args(&[(DType::BF16, n), (DType::BF16, n)]), inputs: 1, body: Body::Map(vec![l]) };
    let printed = |vector_bytes| print_with(&k, "x2", &PrintOptions { vector_bytes, ..PrintOptions::default() });
    for (bytes, width, chunk) in [(16, 8, "uint4"), (8, 4, "uint2"), (4, 2, "unsigned int")] {
        let p = printed(bytes).unwrap();
        assert_eq!(p.entries[0].launch, Launch::Map { numel: n / width, block: 256 }, "{bytes} bytes");
        let read = format!("*reinterpret_cast<{chunk}*>(l0) = *reinterpret_cast<const {chunk}*>(a0 + i0);");
        in_order(&p.source, &[&format!("({width} per thread where the arguments are aligned)"), &read]);
    }
    let scalar = printed(0).unwrap();
    assert_eq!(scalar.entries[0].launch, Launch::Map { numel: n, block: 256 });
    assert!(!scalar.source.contains("vec"), "{}", scalar.source);
}
