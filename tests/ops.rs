//! Every op of the API on every dtype it accepts, on random inputs, against the reference
//! interpreter; dtypes it rejects must be reported at the call. Then a few hand-computed
//! results a reader can check at a glance (NumPy semantics).

mod common;

use braid::prelude::*;
use braid_graph::table::{BinaryOp, CompareOp, DTypeRule, UnaryOp};
use braid_graph::{Op, ReduceOp, Scalar, infer};
use common::{Harness, Rng, SeedMirror};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Mutex;

/// Tests that draw random numbers from the shared device take turns (see `SeedMirror`).
static DEVICE_RNG: Mutex<()> = Mutex::new(());

/// The dtypes `dev` computes with (all of them on the CPU and CUDA; wgpu has no f64 or i64).
/// Every other one is refused at the call (`dtypes_the_device_lacks_are_refused_at_the_call`).
fn dtypes(dev: &Device) -> Vec<DType> {
    DType::ALL.into_iter().filter(|&d| dev.target().dtypes.contains(d)).collect()
}

/// Reads a float tensor (f64, or f32 on a device without f64) as f64.
fn floats(t: &Tensor) -> Vec<f64> {
    match t.dtype() {
        DType::F64 => t.to_vec::<f64>().unwrap(),
        _ => t.to_vec::<f32>().unwrap().into_iter().map(f64::from).collect(),
    }
}

/// f64 where the device has it, else f32 (for hand-computed checks).
fn widest_float(dev: &Device) -> DType {
    if dev.target().dtypes.contains(DType::F64) { DType::F64 } else { DType::F32 }
}

#[test]
fn dtypes_the_device_lacks_are_refused_at_the_call() {
    let dev = braid::testing::test_device();
    for d in DType::ALL.into_iter().filter(|&d| !dev.target().dtypes.contains(d)) {
        assert_misuse(&format!("zeros of {d}"), || drop(Tensor::zeros([2], d, &dev)));
        let x = Tensor::zeros([2], DType::F32, &dev);
        assert_misuse(&format!("cast to {d}"), || drop(x.to_dtype(d)));
    }
    if !dev.target().dtypes.contains(DType::I64) {
        let x = Tensor::zeros([2, 2], DType::F32, &dev);
        assert_misuse("argmax (i64)", || drop(x.argmax_dim(1, false)));
        assert_misuse("arange (i64)", || drop(Tensor::arange(0, 3, &dev)));
        // Their i32 variants run.
        assert_eq!(x.argmax_dim_as(1, false, DType::I32).to_vec::<i32>().unwrap(), vec![0, 0]);
        assert_eq!(Tensor::arange_as(-1, 2, DType::I32, &dev).to_vec::<i32>().unwrap(), vec![-1, 0, 1]);
    }
}

fn run_checked(h: &mut Harness, nodes: &[usize]) {
    for &n in nodes {
        h.read(n).unwrap_or_else(|e| panic!("read of %{n}: {e}\n{}", h.listing.join("\n")));
    }
    let stats = h.check().unwrap_or_else(|e| panic!("{e}"));
    assert!(stats.checked > 0, "nothing was compared");
}

fn accepts(rule: DTypeRule, d: DType) -> bool {
    match rule {
        DTypeRule::Float => d.is_float(),
        DTypeRule::Numeric => d.is_numeric(),
    }
}

/// Asserts that `f` panics with braid's misuse message.
fn assert_misuse(what: &str, f: impl FnOnce()) {
    let err = catch_unwind(AssertUnwindSafe(f)).expect_err(what);
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.starts_with("braid: invalid"), "{what}: unexpected panic {msg:?}");
}

#[test]
fn unary_ops_on_every_dtype() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(1);
    for &op in UnaryOp::ALL {
        for d in dtypes(&dev) {
            let mut h = Harness::new(&dev);
            let x = h.random(&mut rng, d, Shape::from([3, 5]));
            if !accepts(op.def().dtypes, d) {
                let t = h.tensors[x].clone().unwrap();
                assert_misuse(&format!("{} on {d}", op.name()), || drop(t.unary(op)));
                continue;
            }
            // Domain-restricted ops also see positive inputs.
            let y = h.op(Op::Unary(op), d, Shape::from([3, 5]), &[x], 0);
            let mut reads = vec![y];
            if d.is_float() {
                let a = h.op(Op::Unary(UnaryOp::Abs), d, Shape::from([3, 5]), &[x], 0);
                let z = h.op(Op::Unary(op), d, Shape::from([3, 5]), &[a], 0);
                reads.push(z);
            }
            run_checked(&mut h, &reads);
        }
    }
}

#[test]
fn binary_ops_broadcast_on_every_dtype() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(2);
    let shapes =
        [(vec![2, 3, 4], vec![3, 1]), (vec![4], vec![2, 1]), (vec![], vec![2, 2]), (vec![3, 1, 2], vec![1, 4, 2])];
    for &op in BinaryOp::ALL {
        for d in dtypes(&dev) {
            for (sa, sb) in &shapes {
                let (sa, sb) = (Shape::from(sa.clone()), Shape::from(sb.clone()));
                let mut h = Harness::new(&dev);
                let a = h.random(&mut rng, d, sa.clone());
                let b = h.random(&mut rng, d, sb.clone());
                match infer::binary(op, (&sa, d), (&sb, d)) {
                    Err(_) => {
                        let (ta, tb) = (h.tensors[a].clone().unwrap(), h.tensors[b].clone().unwrap());
                        assert_misuse(&format!("{} on {d}", op.name()), || drop(ta.binary(op, &tb)));
                    }
                    Ok((shape, dtype)) => {
                        let base = if op == BinaryOp::Pow {
                            let abs = h.op(Op::Unary(UnaryOp::Abs), d, sa.clone(), &[a], 0);
                            h.op(
                                Op::BinaryScalar { op: BinaryOp::Add, scalar: Scalar(0.5), scalar_first: false },
                                d,
                                sa,
                                &[abs],
                                0,
                            )
                        } else {
                            a
                        };
                        let mut reads = Vec::new();
                        for variant in 0..3 {
                            reads.push(h.op(Op::Binary(op), dtype, shape.clone(), &[base, b], variant));
                        }
                        run_checked(&mut h, &reads);
                    }
                }
            }
        }
    }
}

#[test]
fn scalar_operands_on_either_side() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(3);
    for &op in BinaryOp::ALL {
        for d in dtypes(&dev) {
            for first in [false, true] {
                for s in [2.0, -3.0, 0.5] {
                    let mut h = Harness::new(&dev);
                    let x = h.random(&mut rng, d, Shape::from([2, 3]));
                    let op_ = Op::BinaryScalar { op, scalar: Scalar(s), scalar_first: first };
                    match infer::binary_scalar(op, &Shape::from([2, 3]), d, s) {
                        Err(_) => {
                            let t = h.tensors[x].clone().unwrap();
                            assert_misuse("scalar op", || drop(t.binary_scalar(op, s, first)));
                        }
                        Ok((shape, dtype)) => {
                            let reads: Vec<usize> =
                                (0..2).map(|v| h.op(op_.clone(), dtype, shape.clone(), &[x], v)).collect();
                            run_checked(&mut h, &reads);
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn comparisons_select_clamp_and_casts() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(4);
    for d in dtypes(&dev) {
        let mut h = Harness::new(&dev);
        let a = h.random(&mut rng, d, Shape::from([4, 3]));
        let b = h.random(&mut rng, d, Shape::from([3]));
        // Equal elements too, so eq/le/ge see ties.
        let a2 = h.op(Op::Contiguous, d, Shape::from([4, 3]), &[a], 0);
        let mut reads = Vec::new();
        for &c in CompareOp::ALL {
            reads.push(h.op(Op::Compare(c), DType::Bool, Shape::from([4, 3]), &[a, b], 0));
            reads.push(h.op(Op::Compare(c), DType::Bool, Shape::from([4, 3]), &[a, a2], 0));
        }
        let cond = h.random(&mut rng, DType::Bool, Shape::from([4, 1]));
        reads.push(h.op(Op::Select, d, Shape::from([4, 3]), &[cond, a, b], 0));
        if d.is_numeric() {
            reads.push(h.op(Op::Clamp { lo: Scalar(0.0), hi: Scalar(2.0) }, d, Shape::from([4, 3]), &[a], 0));
        } else {
            let t = h.tensors[a].clone().unwrap();
            assert_misuse("clamp on bool", || drop(t.clamp(0.0, 1.0)));
        }
        for to in dtypes(&dev) {
            reads.push(h.op(Op::Cast, to, Shape::from([4, 3]), &[a], 0));
        }
        run_checked(&mut h, &reads);
    }
}

#[test]
fn clamp_with_an_infinite_bound_clamps_one_side_of_every_numeric_dtype() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(41);
    for d in dtypes(&dev).into_iter().filter(|d| d.is_numeric()) {
        let values = common::random_values(&mut rng, d, 24);
        let x = common::tensor_from_f64(&values, &Shape::from([24]), d, &dev);
        let (lo, hi) = (values[3], values[7]);
        let cases = [(lo, f64::INFINITY), (f64::NEG_INFINITY, hi), (f64::NEG_INFINITY, f64::INFINITY)];
        for (lo, hi) in cases {
            let got = floats(&x.clamp(lo, hi).to_dtype(widest_float(&dev)));
            let want: Vec<f64> = values.iter().map(|&v| v.max(lo).min(hi)).collect();
            assert_eq!(got, want, "{d}: clamp({lo}, {hi}) of {values:?}");
        }
        if d.is_int() {
            assert_misuse("an infinite lower bound above", || drop(x.clamp(f64::INFINITY, f64::INFINITY)));
            assert_misuse("a bound between integers", || drop(x.clamp(0.5, f64::INFINITY)));
        }
    }
}

#[test]
fn reductions_along_every_dimension() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(5);
    let shape = Shape::from([3, 4, 5]);
    for d in dtypes(&dev) {
        for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max, ReduceOp::Min, ReduceOp::ArgMax] {
            if matches!(op, ReduceOp::ArgMax) && !dev.target().dtypes.contains(DType::I64) {
                continue; // its result is i64
            }
            let mut h = Harness::new(&dev);
            let x = h.random(&mut rng, d, shape.clone());
            let mut dims: Vec<Option<usize>> = (0..3).map(Some).collect();
            if matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
                dims.push(None);
            }
            let mut reads = Vec::new();
            for dim in dims {
                for keepdim in [false, true] {
                    let keepdim = keepdim && dim.is_some();
                    match infer::reduce(op, &shape, d, dim, keepdim) {
                        Ok((s, dt)) => reads.push(h.op(Op::Reduce { op, dim, keepdim }, dt, s, &[x], 0)),
                        Err(_) => {
                            let t = h.tensors[x].clone().unwrap();
                            let op_ = Op::Reduce { op, dim, keepdim };
                            assert_misuse(&format!("{op:?} on {d}"), || {
                                drop(common::call(&op_, &[&t], &shape, d, &dev, 0))
                            });
                        }
                    }
                }
            }
            if !reads.is_empty() {
                run_checked(&mut h, &reads);
            }
        }
    }
}

#[test]
fn dimension_wise_reductions_of_a_scalar_take_dimension_0_or_minus_1_as_pytorch_does() {
    let dev = braid::testing::test_device();
    let f = widest_float(&dev);
    let x = Tensor::full((), -2.5, f, &dev);
    let one = |t: Tensor| {
        assert_eq!(t.dims(), &[] as &[usize], "a scalar result");
        floats(&t)[0]
    };
    for keepdim in [false, true] {
        assert_eq!(one(x.sum_dim(0, keepdim)), -2.5);
        assert_eq!(one(x.mean_dim(-1, keepdim)), -2.5);
        assert_eq!(one(x.max_dim(0, keepdim)), -2.5);
        assert_eq!(one(x.min_dim(-1, keepdim)), -2.5);
    }
    assert_eq!(one(x.softmax(0)), 1.0);
    assert_eq!(one(x.log_softmax(-1)), 0.0);
    assert_eq!(one(x.layer_norm(0, 1e-5)), 0.0);
    if dev.target().dtypes.contains(DType::I64) {
        assert_eq!(x.argmax_dim(0, false).item::<i64>().unwrap(), 0);
        assert_eq!(x.argmin_dim(-1, true).item::<i64>().unwrap(), 0);
    }
    assert_eq!(x.argmax_dim_as(0, false, DType::I32).item::<i32>().unwrap(), 0);
    assert_eq!(x.argmin_dim_as(-1, true, DType::I32).item::<i32>().unwrap(), 0);
    // Gradients flow through: d sum_dim(x, 0) / dx = 1.
    let leaf = x.detach().requires_grad();
    let grads = (leaf.sum_dim(0, false) * 3.0).backward().unwrap();
    assert_eq!(floats(&grads.get(&leaf).unwrap()), vec![3.0]);
    // Other dimensions stay out of range.
    assert_misuse("dimension 1 of a scalar", || drop(x.sum_dim(1, false)));
    assert_misuse("dimension -2 of a scalar", || drop(x.softmax(-2)));
}

#[test]
fn matmul_with_broadcast_batches_on_every_numeric_dtype() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(6);
    let cases = [
        (vec![3, 4], vec![4, 5]),
        (vec![2, 3, 4], vec![4, 2]),
        (vec![2, 1, 3, 4], vec![5, 4, 2]),
        (vec![1, 7], vec![7, 1]),
    ];
    for d in dtypes(&dev) {
        for (sa, sb) in &cases {
            let (sa, sb) = (Shape::from(sa.clone()), Shape::from(sb.clone()));
            let mut h = Harness::new(&dev);
            let a = h.random(&mut rng, d, sa.clone());
            let b = h.random(&mut rng, d, sb.clone());
            match infer::matmul((&sa, d), (&sb, d)) {
                Ok((s, dt)) => {
                    let y = h.op(Op::Matmul, dt, s, &[a, b], 0);
                    run_checked(&mut h, &[y]);
                }
                Err(_) => {
                    let (ta, tb) = (h.tensors[a].clone().unwrap(), h.tensors[b].clone().unwrap());
                    assert_misuse("matmul of bool", || drop(ta.matmul(&tb)));
                }
            }
        }
    }
}

#[test]
fn movement_on_every_dtype() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(7);
    for d in dtypes(&dev) {
        let mut h = Harness::new(&dev);
        let x = h.random(&mut rng, d, Shape::from([2, 3, 4]));
        let y = h.random(&mut rng, d, Shape::from([2, 1, 4]));
        let reads = vec![
            h.op(Op::Reshape, d, Shape::from([4, 6]), &[x], 0),
            h.op(Op::Permute([2, 0, 1].as_slice().into()), d, Shape::from([4, 2, 3]), &[x], 0),
            h.op(Op::Permute([0, 2, 1].as_slice().into()), d, Shape::from([2, 4, 3]), &[x], 0),
            h.op(Op::Expand, d, Shape::from([5, 2, 3, 4]), &[x], 0),
            h.op(Op::Expand, d, Shape::from([2, 6, 4]), &[y], 0),
            h.op(Op::Narrow { dim: 1, start: 1, len: 2 }, d, Shape::from([2, 2, 4]), &[x], 0),
            h.op(Op::Narrow { dim: 2, start: 3, len: 1 }, d, Shape::from([2, 3, 1]), &[x], 0),
            h.op(Op::Cat { dim: 1 }, d, Shape::from([2, 5, 4]), &[x, y, y], 0),
            h.op(Op::Cat { dim: 0 }, d, Shape::from([4, 3, 4]), &[x, x], 0),
            h.op(Op::Contiguous, d, Shape::from([2, 3, 4]), &[x], 0),
            h.op(Op::ToDevice, d, Shape::from([2, 3, 4]), &[x], 0),
        ];
        run_checked(&mut h, &reads);
    }
}

#[test]
fn sources_and_random_numbers() {
    let _turn = DEVICE_RNG.lock().unwrap_or_else(|p| p.into_inner());
    let dev = braid::testing::test_device();
    let mut seeds = SeedMirror::reseed(&dev, 42);
    for d in dtypes(&dev) {
        let mut h = Harness::new(&dev);
        let mut reads = vec![
            h.op(Op::Full(Scalar(1.0)), d, Shape::from([2, 3]), &[], 0),
            h.op(Op::Full(Scalar(0.0)), d, Shape::from([]), &[], 0),
        ];
        if dev.target().dtypes.contains(DType::I64) {
            reads.push(h.op(Op::Arange { start: -3 }, DType::I64, Shape::from([7]), &[], 0));
        }
        if d.is_float() {
            let (s1, s2) = (seeds.next(), seeds.next());
            reads.push(h.op(Op::Rand { lo: Scalar(-1.0), hi: Scalar(2.0), seed: s1 }, d, Shape::from([3000]), &[], 0));
            reads.push(h.op(Op::Randn { seed: s2 }, d, Shape::from([40, 50]), &[], 0));
        } else {
            assert_misuse("rand of ints", || drop(Tensor::rand([2], 0.0, 1.0, d, &dev)));
            assert_misuse("randn of ints", || drop(Tensor::randn([2], d, &dev)));
        }
        run_checked(&mut h, &reads);
    }
    // Seeding makes random tensors reproducible.
    dev.seed(7);
    let a = Tensor::randn([100], DType::F32, &dev).to_vec::<f32>().unwrap();
    dev.seed(7);
    let b = Tensor::randn([100], DType::F32, &dev).to_vec::<f32>().unwrap();
    assert_eq!(a, b);
    let c = Tensor::randn([100], DType::F32, &dev).to_vec::<f32>().unwrap();
    assert_ne!(a, c, "a second call draws new numbers");
}

#[test]
fn composites_match_the_formulas() {
    let dev = braid::testing::test_device();
    let dt = widest_float(&dev);
    let tol = if dt == DType::F64 { 1e-12 } else { 1e-6 };
    let x = common::tensor_from_f64(&[1.0, 2.0, 3.0, -1.0, 0.0, 1.0], &Shape::from([2, 3]), dt, &dev);
    let sm = floats(&x.softmax(1));
    let lsm = floats(&x.log_softmax(1));
    let ln = floats(&x.layer_norm(1, 1e-5));
    for (r, row) in [[1.0f64, 2.0, 3.0], [-1.0, 0.0, 1.0]].iter().enumerate() {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = row.iter().map(|v| (v - m).exp()).sum();
        let mean = row.iter().sum::<f64>() / 3.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 3.0;
        for (c, &v) in row.iter().enumerate() {
            let i = r * 3 + c;
            assert!((sm[i] - (v - m).exp() / z).abs() < tol);
            assert!((lsm[i] - (v - m - z.ln())).abs() < tol);
            assert!((ln[i] - (v - mean) / (var + 1e-5).sqrt()).abs() < tol);
        }
    }
}

#[test]
fn half_precision_composites_compute_in_f32_and_rows_of_nothing_give_empty_results() {
    let dev = braid::testing::test_device();
    let read = |t: &Tensor| t.to_dtype(DType::F32).to_vec::<f32>().unwrap();
    let of = |v: &[f32], dt: DType| Tensor::from_vec(v.to_vec(), [v.len()], &dev).to_dtype(dt);
    if dev.target().dtypes.contains(DType::F16) {
        // A deviation of 500 squares past f16's largest value (65,504): computed in f16, the
        // variance is infinite and the row 0. PyTorch gives [-1, 1].
        assert_eq!(read(&of(&[0.0, 1000.0], DType::F16).layer_norm(0, 1e-5)), vec![-1.0, 1.0]);
        // 70,000 equal values: their sum of exponentials overflows f16 (PyTorch: 1.4305e-5 each).
        let p = read(&Tensor::zeros([1, 70_000], DType::F16, &dev).softmax(1));
        assert!(p.iter().all(|&p| (p - 1.4305115e-5).abs() < 1e-8), "{:?}", &p[..4]);
        let lp = read(&Tensor::zeros([1, 70_000], DType::F16, &dev).log_softmax(1));
        assert!(lp.iter().all(|&l| (l - (1.0f32 / 70_000.0).ln()).abs() < 1e-2), "{:?}", &lp[..4]);
        if dev.target().dtypes.contains(DType::I64) {
            let target = Tensor::from_vec(vec![3i64, 5], [2], &dev);
            let loss = read(&Tensor::zeros([2, 70_000], DType::F16, &dev).cross_entropy(&target))[0];
            assert!((loss - 70_000f32.ln()).abs() < 1e-2, "{loss}");
        }
    }
    if dev.target().dtypes.contains(DType::BF16) {
        // [1000, 1001, 1002, 1003] is [1000, 1000, 1000, 1004] in bf16; a bf16 mean (1000) would
        // skew the centring. PyTorch: [-0.5781, -0.5781, -0.5781, 1.7344].
        let ln = read(&of(&[1000.0, 1001.0, 1002.0, 1003.0], DType::BF16).layer_norm(0, 1e-5));
        assert_eq!(ln, vec![-0.578125, -0.578125, -0.578125, 1.734375]);
    }
    // Softmax over rows of no values: an empty result of the same shape (the maximum of no
    // values does not exist), as in PyTorch.
    let empty = Tensor::zeros([3, 0], DType::F32, &dev);
    assert_eq!(empty.softmax(1).dims(), &[3, 0]);
    assert_eq!(empty.t().log_softmax(0).dims(), &[0, 3]);
    assert!(empty.softmax(-1).to_vec::<f32>().unwrap().is_empty());
}

#[test]
fn numpy_semantics_pinned_by_hand() {
    let dev = braid::testing::test_device();
    let i = |v: Vec<i32>, s: &[usize]| Tensor::from_vec(v, s, &dev);
    // Integer division truncates towards zero; x / 0 is 0.
    let q = i(vec![7, -7, 7, 5], &[4]) / i(vec![2, 2, -2, 0], &[4]);
    assert_eq!(q.to_vec::<i32>().unwrap(), vec![3, -3, -3, 0]);
    // Integer arithmetic wraps.
    let w = i(vec![i32::MAX], &[1]) + 1.0;
    assert_eq!(w.to_vec::<i32>().unwrap(), vec![i32::MIN]);
    // Broadcasting a column against a row.
    let col = Tensor::from_vec(vec![1.0f32, 2.0], [2, 1], &dev);
    let row = Tensor::from_vec(vec![10.0f32, 20.0, 30.0], [3], &dev);
    assert_eq!((&col + &row).to_vec::<f32>().unwrap(), vec![11.0, 21.0, 31.0, 12.0, 22.0, 32.0]);
    // argmax takes the first maximum; NaN wins.
    let a = Tensor::from_vec(vec![1.0f32, 3.0, 3.0, f32::NAN, 0.0, 9.0], [2, 3], &dev);
    let has_i64 = dev.target().dtypes.contains(DType::I64);
    if has_i64 {
        assert_eq!(a.argmax_dim(1, false).to_vec::<i64>().unwrap(), vec![1, 0]);
    }
    assert_eq!(a.argmax_dim_as(1, false, DType::I32).to_vec::<i32>().unwrap(), vec![1, 0]);
    assert_eq!(a.argmin_dim_as(1, false, DType::I32).to_vec::<i32>().unwrap(), vec![0, 0]);
    // max propagates NaN.
    let m = a.max_dim(1, false).to_vec::<f32>().unwrap();
    assert_eq!(m[0], 3.0);
    assert!(m[1].is_nan());
    // Float to integer casts truncate and saturate; NaN becomes 0.
    let f = Tensor::from_vec(vec![300.7f32, -2.9, f32::NAN, -1e20], [4], &dev);
    assert_eq!(f.to_dtype(DType::U8).to_vec::<u8>().unwrap(), vec![255, 0, 0, 0]);
    assert_eq!(f.to_dtype(DType::I32).to_vec::<i32>().unwrap(), vec![300, -2, 0, i32::MIN]);
    // Casts to floats round once: through f64, 2^60 + 2^36 + 1 would become 2^60 as an f32.
    if has_i64 {
        let big = Tensor::from_vec(vec![(1i64 << 60) + (1 << 36) + 1], [1], &dev);
        assert_eq!(big.to_dtype(DType::F32).to_vec::<f32>().unwrap(), vec![((1u64 << 60) + (1 << 37)) as f32]);
    }
    let dt = widest_float(&dev);
    let x = common::tensor_from_f64(&[f32::from_bits(0x3F80_8001) as f64], &Shape::from([1]), dt, &dev);
    assert_eq!(x.to_dtype(DType::BF16).to_vec::<half::bf16>().unwrap()[0].to_bits(), 0x3F81);
    // Transpose and matmul.
    let m2 = common::tensor_from_f64(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &Shape::from([2, 3]), dt, &dev);
    assert_eq!(floats(&m2.t()), vec![1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
    assert_eq!(floats(&m2.matmul(&m2.t())), vec![14.0, 32.0, 32.0, 77.0]);
    // cat, narrow, arange, comparisons and select.
    if has_i64 {
        let r = Tensor::arange(0, 5, &dev);
        assert_eq!(r.narrow(0, 1, 3).to_vec::<i64>().unwrap(), vec![1, 2, 3]);
        assert_eq!(Tensor::cat(&[&r, &r.narrow(0, 0, 2)], 0).to_vec::<i64>().unwrap(), vec![0, 1, 2, 3, 4, 0, 1]);
        let two = Tensor::full([1], 2.0, DType::I64, &dev);
        let picked = r.gt(&two).select(&r, &(&r * -1.0));
        assert_eq!(picked.to_vec::<i64>().unwrap(), vec![0, -1, -2, 3, 4]);
    }
    let r = i(vec![0, 1, 2, 3, 4], &[5]);
    let two = i(vec![2], &[1]);
    let picked = r.gt(&two).select(&r, &(&r * -1.0));
    assert_eq!(picked.to_vec::<i32>().unwrap(), vec![0, -1, -2, 3, 4]);
    // Reductions of the whole tensor and of a dimension.
    assert_eq!(floats(&m2.sum()), vec![21.0]);
    assert_eq!(floats(&m2.mean_dim(0, true)), vec![2.5, 3.5, 4.5]);
    assert_eq!(m2.mean_dim(0, true).dims(), &[1, 3]);
    // Unary ops on floats and integers.
    assert_eq!(i(vec![-3, 4], &[2]).abs().to_vec::<i32>().unwrap(), vec![3, 4]);
    assert_eq!(Tensor::from_vec(vec![4.0f32, 0.25], [2], &dev).rsqrt().to_vec::<f32>().unwrap(), vec![0.5, 2.0]);
}

/// Reductions along an axis with few rows before it and a wide last dimension (bias gradients,
/// column softmax) run re-tiled into column blocks; they must still equal the reference,
/// with elementwise work before and after, several reductions, argmax and odd widths.
#[test]
fn reductions_over_few_wide_rows_equal_the_reference() {
    let dev = braid::testing::test_device();
    dev.seed(21);
    for dims in [vec![256, 512], vec![3, 40, 128], vec![5, 72], vec![2, 7, 24, 40], vec![300, 100]] {
        let x = Tensor::randn(dims.clone(), DType::F32, &dev);
        let y = Tensor::randn(dims.clone(), DType::F32, &dev);
        let axis = if dims.len() > 2 { 1 } else { 0 };
        let z = &x * &y;
        let col_sum = z.relu().sum_dim(axis, false);
        let soft = z.softmax(axis);
        let norm = x.layer_norm(axis, 1e-5);
        let mean = (&x.mean_dim(axis, true) * 2.0) - 1.0;
        let arg = match dev.target().dtypes.contains(DType::I64) {
            true => x.argmax_dim(axis, true),
            false => x.argmax_dim_as(axis, true, DType::I32),
        };
        let targets = vec![&col_sum, &soft, &norm, &mean, &arg];
        let stats = common::check_recorded(&targets).unwrap_or_else(|e| panic!("{dims:?}: {e}"));
        assert!(stats.checked > 0);
    }
}
