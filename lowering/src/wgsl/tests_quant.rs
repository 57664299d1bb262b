//! What the quantized-product printer promises without a GPU: one thread per product element,
//! the product in its argument or a scratch binding, the epilogue after it, no `shader-f16`,
//! and refusals of operands the CPU refuses too. `tests/wgsl_kernels.rs` runs the printed
//! kernels on an adapter against the CPU.

use super::*;
use crate::kernel::{Arg, MapLoop, MatmulOperand, QuantMatmulKernel, View};
use braid_graph::expr::ExprBuilder;
use braid_graph::{QuantLayout, Scheme};

/// `x [m, k]` (argument 0, contiguous, of `d`) times a weight of `scheme` with `scale` scales
/// (argument 1), the product in argument 2, or in scratch behind an epilogue `2 * product`
/// stored to argument 2.
fn kernel(d: DType, scheme: Scheme, scale: DType, [m, k, n]: [usize; 3], scratch: bool) -> Kernel {
    let layout = QuantLayout::new(scheme, k, n, scale).unwrap();
    let lhs = MatmulOperand { arg: 0, batch_offsets: vec![0], rs: k as isize, cs: 1 };
    let mut args = vec![Arg { dtype: d, len: m * k }, Arg { dtype: DType::U8, len: layout.bytes() }];
    args.push(Arg { dtype: d, len: m * n });
    let (product, epilogue) = match scratch {
        false => (2, None),
        true => {
            let view = View::contiguous(&braid_graph::Shape::new(&[m, n]));
            let mut b = ExprBuilder::new();
            let p = b.load(0, d);
            let two = b.constant(2.0, d);
            let y = b.mul(p, two);
            let l = MapLoop {
                dims: [m, n].as_slice().into(),
                loads: vec![Load { arg: 3, dtype: d, view: view.clone() }],
                expr: b.finish(),
                stores: vec![Store { arg: 2, dtype: d, view, value: y }],
            };
            (3, Some(l))
        }
    };
    let q = QuantMatmulKernel { dtype: d, lhs, weight: 1, layout, product, m, epilogue };
    Kernel { args, inputs: 2, body: Body::QuantMatmul(q) }
}

fn quant(k: &mut Kernel) -> &mut QuantMatmulKernel {
    match &mut k.body {
        Body::QuantMatmul(q) => q,
        _ => unreachable!(),
    }
}

#[test]
fn one_thread_per_product_element_then_the_epilogue() {
    let f = Features::default();
    let src = print(&kernel(DType::F32, Scheme::Int8, DType::F32, [37, 301, 70], false), &f).unwrap();
    let groups = (37u32 * 70).div_ceil(256);
    assert_eq!(
        src.entries,
        vec![Entry { name: "product".into(), workgroups: [groups, 1, 1], threads: 256, copy: None }]
    );
    // 301 = 75 words of four values and one of one.
    assert!(src.source.contains("c < 75u") && src.source.contains("a1[w0 + g * 75u + 75u]"), "{}", src.source);
    assert_eq!(src.source.matches("acc = acc + ").count(), 5);
    let s = print(&kernel(DType::BF16, Scheme::Int4 { group: 64 }, DType::F16, [5, 128, 9], true), &f).unwrap();
    let names: Vec<&str> = s.entries.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, ["product", "epilogue"]);
    // The product's scratch: 45 bf16 values in 23 words.
    assert_eq!(s.bindings[3], Binding::Scratch { bytes: 92 });
    assert!(s.source.contains("g < 2u") && s.source.contains("c < 8u") && s.source.contains(">> 28u"));
    assert_eq!(s.source.matches("acc = acc + ").count(), 8);
    // Halves are converted in integer arithmetic: no shader-f16.
    assert!(s.source.contains("braid_f16_to_f32(braid_get_half(") && !s.source.contains("enable f16"));
    // Nothing to compute, nothing dispatched.
    assert!(print(&kernel(DType::F32, Scheme::Int8, DType::F32, [0, 3, 4], false), &f).unwrap().entries.is_empty());
    let empty_k = print(&kernel(DType::F16, Scheme::Int8, DType::F16, [2, 0, 4], false), &f).unwrap();
    assert!(!empty_k.source.contains("for (var g"), "{}", empty_k.source);
}

#[test]
fn operands_outside_their_arguments_are_refused() {
    let f = Features::default();
    let base = kernel(DType::F32, Scheme::Int4 { group: 32 }, DType::F32, [3, 64, 5], false);
    let mut short = base.clone();
    short.args[1].len -= 1;
    assert!(print(&short, &f).unwrap_err().contains("bytes"));
    let mut outside = base.clone();
    quant(&mut outside).lhs.batch_offsets[0] = 1;
    assert!(print(&outside, &f).unwrap_err().contains("reaches elements"));
    let mut batches = base.clone();
    quant(&mut batches).lhs.batch_offsets.push(0);
    assert!(print(&batches, &f).unwrap_err().contains("2 batches"));
    let mut group = base.clone();
    quant(&mut group).layout.scheme = Scheme::Int4 { group: 16 };
    assert!(print(&group, &f).unwrap_err().contains("group"));
    let mut ints = base.clone();
    ints.args[0].dtype = DType::I32;
    ints.args[2].dtype = DType::I32;
    quant(&mut ints).dtype = DType::I32;
    assert!(print(&ints, &f).unwrap_err().contains("f32, f16 or bf16"));
    let mut product = base;
    product.args[2].len += 1;
    assert!(print(&product, &f).unwrap_err().contains("quantized product of 15"));
}
