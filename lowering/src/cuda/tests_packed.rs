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
