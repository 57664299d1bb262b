//! What the attention printer promises without a GPU: one entry per pass with one workgroup
//! per (problem, tile of 16 owned rows), workgroup memory within the adapter's limit for any
//! head dimension, refusals naming the limit they hit. `tests/attention.rs` runs the printed
//! kernels on an adapter against the reference interpreter.

use super::*;
use crate::attention::{AttentionGradInputs, AttentionKernel, AttentionPass};
use crate::kernel::{Arg, View};
use smallvec::SmallVec;

fn view(dims: &[usize]) -> View {
    View::contiguous(&braid_graph::Shape::new(dims))
}

fn load(arg: u16, dtype: DType, dims: &[usize]) -> Load {
    Load { arg, dtype, view: view(dims) }
}

#[derive(Clone, Copy, PartialEq, Debug)]
enum Pass {
    Forward,
    GradQ,
    GradKv,
}

/// An attention kernel of `pass` over `batch` problems of `sq` queries and `sk` keys with head
/// dimension `d`, every operand its own contiguous argument (q, k, v, then for a backward pass
/// d_out, lse, delta), then its outputs.
fn kernel(pass: Pass, dtype: DType, causal: bool, batch: &[usize], sq: usize, sk: usize, d: usize) -> Kernel {
    let dims = |rows: usize, cols: Option<usize>| [batch, &[rows], cols.as_slice()].concat();
    let numel = |dims: &[usize]| dims.iter().product::<usize>();
    let mut args = vec![];
    let mut operand = |dtype: DType, dims: Vec<usize>| {
        args.push(Arg { dtype, len: numel(&dims) });
        load(args.len() as u16 - 1, dtype, &dims)
    };
    let (q, k, v) =
        (operand(dtype, dims(sq, Some(d))), operand(dtype, dims(sk, Some(d))), operand(dtype, dims(sk, Some(d))));
    let mut grads = || AttentionGradInputs {
        d_out: operand(dtype, dims(sq, Some(d))),
        lse: operand(DType::F32, dims(sq, None)),
        delta: operand(DType::F32, dims(sq, None)),
    };
    let (pass, outs) = match pass {
        Pass::Forward => {
            (AttentionPass::Forward { out: Some(3), lse: Some(4) }, vec![(dtype, sq * d), (DType::F32, sq)])
        }
        Pass::GradQ => (AttentionPass::GradQ { grads: grads(), dq: 6 }, vec![(dtype, sq * d)]),
        Pass::GradKv => {
            (AttentionPass::GradKv { grads: grads(), dk: Some(6), dv: Some(7) }, vec![(dtype, sk * d), (dtype, sk * d)])
        }
    };
    let inputs = args.len();
    let problems: usize = batch.iter().product();
    args.extend(outs.into_iter().map(|(dtype, n)| Arg { dtype, len: n * problems }));
    let a = AttentionKernel { dtype, causal, batch: SmallVec::from_slice(batch), sq, sk, d, q, k, v, pass };
    Kernel { args, inputs, body: Body::Attention(Box::new(a)) }
}

#[test]
fn every_pass_prints_one_entry_per_problem_and_tile_within_the_workgroup_memory() {
    let f = Features::default();
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for pass in [Pass::Forward, Pass::GradQ, Pass::GradKv] {
            for d in [1, 16, 24, 64, 100, 128, 256, 300] {
                for causal in [false, true] {
                    let (sq, sk) = (33, 17);
                    let src = print(&kernel(pass, dtype, causal, &[2, 3], sq, sk, d), &f)
                        .unwrap_or_else(|e| panic!("{pass:?} {dtype} d {d}: {e}"));
                    let owned = if pass == Pass::GradKv { sk } else { sq };
                    assert_eq!(src.entries.len(), 1, "{pass:?}");
                    let e = &src.entries[0];
                    assert_eq!((e.threads, e.workgroups), (256, [6 * owned.div_ceil(16) as u32, 1, 1]), "{pass:?}");
                    let bytes = attention::workgroup_bytes(&src.source);
                    assert!(bytes > 0 && bytes <= 16_384, "{pass:?} {dtype} d {d}: {bytes} bytes\n{}", src.source);
                    // Each thread's accumulators are indexed by constants only.
                    assert!(!src.source.contains("acc[r]") && src.source.contains("workgroupBarrier()"));
                }
            }
        }
    }
}

#[test]
fn wider_workgroup_memory_stages_wider_chunks() {
    let (small, large) = (Features::default(), Features { max_workgroup_storage_size: 65_536, ..Features::default() });
    let k = kernel(Pass::GradKv, DType::F32, true, &[1], 40, 40, 128);
    let pitch = |f: &Features| {
        let src = print(&k, f).unwrap().source;
        let decl = src.lines().find(|l| l.starts_with("var<workgroup> att_k:")).unwrap().to_string();
        decl.trim_end_matches(">;").rsplit_once(", ").unwrap().1.parse::<usize>().unwrap() / 16
    };
    // A row of 16 columns (and its pad word) under 16 KiB; the whole head dimension under 64.
    assert_eq!((pitch(&small), pitch(&large)), (17, 129));
}

#[test]
fn limits_are_named_when_attention_exceeds_them() {
    let k = kernel(Pass::GradKv, DType::F32, false, &[2], 9, 9, 32);
    let f = Features { max_storage_buffers_per_stage: 7, ..Features::default() };
    let e = print(&k, &f).unwrap_err();
    assert!(e.contains("8 storage buffers") && e.contains("max_storage_buffers_per_stage (7)"), "{e}");
    let f = Features { max_workgroup_storage_size: 4096, ..Features::default() };
    let e = print(&k, &f).unwrap_err();
    assert!(e.contains("max_compute_workgroup_storage_size (4096)"), "{e}");
    let f = Features { max_workgroups_per_dimension: 1, ..Features::default() };
    assert!(print(&k, &f).unwrap_err().contains("1 per dimension"));
    let e = print(&kernel(Pass::Forward, DType::F64, false, &[1], 4, 4, 8), &Features::default()).unwrap_err();
    assert!(e.contains("not supported on wgpu"), "{e}");
}

#[test]
fn strided_operands_are_read_where_they_lie_and_empty_problems_print_nothing() {
    // q, k and v as heads of one [b, t, 3 h d] buffer: [b, h, t, d] views at three offsets.
    let (b, t, h, d) = (2, 5, 3, 4);
    let strided = |i: usize| View {
        dims: SmallVec::from_slice(&[b, h, t, d]),
        strides: SmallVec::from_slice(&[(t * 3 * h * d) as isize, d as isize, (3 * h * d) as isize, 1]),
        offset: i * h * d,
    };
    let mut k = kernel(Pass::Forward, DType::F32, true, &[b, h], t, t, d);
    let Body::Attention(a) = &mut k.body else { unreachable!() };
    for (i, l) in [&mut a.q, &mut a.k, &mut a.v].into_iter().enumerate() {
        *l = Load { arg: 0, dtype: DType::F32, view: strided(i) };
    }
    a.pass = AttentionPass::Forward { out: Some(1), lse: None };
    let n = b * h * t * d;
    k.args = vec![Arg { dtype: DType::F32, len: 3 * n }, Arg { dtype: DType::F32, len: n }];
    k.inputs = 1;
    let src = print(&k, &Features::default()).unwrap();
    assert!(src.source.contains("let base_k = 12u + d0 * 180u + d1 * 4u;"), "{}", src.source);
    assert!(src.source.contains("a0[base_q + gr * 36u + gc]"), "{}", src.source);
    // Without the log-sum-exp, nothing writes it; without problems, nothing is dispatched.
    assert!(!src.source.contains("log("));
    assert!(
        print(&kernel(Pass::GradQ, DType::F32, false, &[0], 3, 3, 8), &Features::default()).unwrap().entries.is_empty()
    );
}
