//! Fused attention (`Tensor::scaled_dot_product_attention`) on the test device: the output and
//! the gradients of q, k and v against the f64 reference interpreter (causal and not, odd
//! sequence lengths, head dimensions 16 to 128, f32 and the half types the device holds), against
//! the same attention composed of products and a softmax, against finite differences in f64 on
//! the CPU, through views (heads split by a permute), under autocast, and as kernels: the
//! output and its log-sum-exp are one kernel, the key and value gradients another, and a
//! forward pass read before its backward keeps the log-sum-exp for it; and with
//! infinities in rows the causal mask hides, which must not reach the rows that do not see them.
//! (`tests/properties.rs` draws attention in random programs.)

mod common;

use braid::prelude::*;
use common::{Rng, check_recorded, random_values, tensor_from_f64};

/// A random tensor of `dims` in `dtype` (values in [-3, 3), exact in the dtype).
fn random(rng: &mut Rng, dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let shape = Shape::new(dims);
    tensor_from_f64(&random_values(rng, dtype, shape.numel()), &shape, dtype, dev)
}

/// The float dtypes attention runs in on `dev`.
fn dtypes(dev: &Device) -> Vec<DType> {
    [DType::F32, DType::F16, DType::BF16].into_iter().filter(|&d| dev.target().dtypes.contains(d)).collect()
}

/// `(batch dims, sq, sk, d)` cases: odd lengths, one key, queries beyond the keys, no queries
/// (key and value gradients of zeros), keys beyond the queries, head dims 16 to 128.
const SHAPES: &[(&[usize], usize, usize, usize)] = &[
    (&[2, 3], 7, 7, 16),
    (&[1], 1, 1, 16),
    (&[2], 33, 33, 24),
    (&[1, 2], 65, 65, 64),
    (&[3], 17, 40, 32),
    (&[1], 40, 17, 32),
    (&[1, 1], 130, 130, 128),
    (&[2], 0, 5, 16),
    // Causal: the second tile of keys (of 128, tensor cores, d <= 64) lies past every query, so
    // its key and value gradients walk no query tile at all and store zeros.
    (&[1], 32, 160, 32),
];

#[test]
fn output_and_gradients_match_the_reference() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(11);
    for dtype in dtypes(&dev) {
        for &(batch, sq, sk, d) in SHAPES {
            for causal in [false, true] {
                let dims = |s: usize| [batch, &[s, d]].concat();
                let q = random(&mut rng, &dims(sq), dtype, &dev).requires_grad();
                let k = random(&mut rng, &dims(sk), dtype, &dev).requires_grad();
                let v = random(&mut rng, &dims(sk), dtype, &dev).requires_grad();
                let y = q.scaled_dot_product_attention(&k, &v, causal);
                // A weighted sum, so every output element has its own gradient.
                let w = random(&mut rng, &dims(sq), dtype, &dev);
                let loss = (&y * &w).to_dtype(DType::F32).sum();
                let grads = loss.backward().unwrap();
                let (gq, gk, gv) = (grads.get(&q).unwrap(), grads.get(&k).unwrap(), grads.get(&v).unwrap());
                let what = format!("{dtype} {batch:?} sq {sq} sk {sk} d {d} causal {causal}");
                let stats = check_recorded(&[&y, &gq, &gk, &gv]).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(stats.checked > stats.uncertain * 4, "{what}: mostly uncertain ({stats:?})");
            }
        }
    }
}

/// Attention as a user would write it without the op: scores, a mask, a softmax, a product.
fn composed(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool) -> Tensor {
    let (r, d) = (q.rank(), q.dims()[q.rank() - 1]);
    let s = q.matmul(&k.transpose(r - 2, r - 1)) * (1.0 / (d as f64).sqrt());
    let s = if causal {
        let (sq, sk) = (q.dims()[r - 2], k.dims()[r - 2]);
        let rows = Tensor::arange_as(0, sq as i64, DType::I32, q.device()).reshape([sq, 1]);
        let cols = Tensor::arange_as(0, sk as i64, DType::I32, q.device()).reshape([1, sk]);
        let hidden = Tensor::full([1], f64::NEG_INFINITY, s.dtype(), q.device());
        cols.gt(&rows).select(&hidden, &s)
    } else {
        s
    };
    s.softmax(-1).matmul(v)
}

fn max_difference(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.to_dtype(DType::F32).to_vec::<f32>().unwrap(), b.to_dtype(DType::F32).to_vec::<f32>().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

#[test]
fn fused_equals_composed_forward_and_backward() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(12);
    for causal in [false, true] {
        let dims = [2, 3, 45, 32];
        let leaf = |rng: &mut Rng| random(rng, &dims, DType::F32, &dev);
        let (q0, k0, v0, w) = (leaf(&mut rng), leaf(&mut rng), leaf(&mut rng), leaf(&mut rng));
        let run = |fused: bool| {
            let (q, k, v) = (q0.detach().requires_grad(), k0.detach().requires_grad(), v0.detach().requires_grad());
            let y = if fused { q.scaled_dot_product_attention(&k, &v, causal) } else { composed(&q, &k, &v, causal) };
            let g = (&y * &w).sum().backward().unwrap();
            [y, g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap()]
        };
        let (fused, plain) = (run(true), run(false));
        for (name, (a, b)) in ["out", "dq", "dk", "dv"].iter().zip(fused.iter().zip(&plain)) {
            let diff = max_difference(a, b);
            assert!(diff < 2e-4, "causal {causal}: {name} differs from the composed attention by {diff}");
        }
    }
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let dev = Device::cpu();
    let mut rng = Rng::new(13);
    for causal in [false, true] {
        let dims = [2, 5, 16];
        let (q, k, v, w) = (
            random(&mut rng, &dims, DType::F64, &dev),
            random(&mut rng, &dims, DType::F64, &dev),
            random(&mut rng, &dims, DType::F64, &dev),
            random(&mut rng, &dims, DType::F64, &dev),
        );
        let loss = |q: &Tensor, k: &Tensor, v: &Tensor| (&q.scaled_dot_product_attention(k, v, causal) * &w).sum();
        let (ql, kl, vl) = (q.detach().requires_grad(), k.detach().requires_grad(), v.detach().requires_grad());
        let grads = loss(&ql, &kl, &vl).backward().unwrap();
        let h = 1e-6;
        for (which, leaf) in [(0, &ql), (1, &kl), (2, &vl)] {
            let analytic = grads.get(leaf).unwrap().to_vec::<f64>().unwrap();
            let base = [&q, &k, &v].map(|t| t.to_vec::<f64>().unwrap());
            for i in (0..analytic.len()).step_by(7) {
                let at = |delta: f64| {
                    let mut ins = base.clone();
                    ins[which][i] += delta;
                    let t: Vec<Tensor> = ins.iter().map(|x| Tensor::from_vec(x.clone(), dims, &dev)).collect();
                    loss(&t[0], &t[1], &t[2]).item::<f64>().unwrap()
                };
                let numeric = (at(h) - at(-h)) / (2.0 * h);
                let err = (numeric - analytic[i]).abs();
                assert!(
                    err <= 1e-6 * (1.0 + numeric.abs()),
                    "causal {causal}: input {which} element {i}: analytic {} numeric {numeric}",
                    analytic[i]
                );
            }
        }
    }
}

#[test]
fn heads_split_by_a_permute_are_read_in_place() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(14);
    let (b, t, h, d) = (2, 19, 3, 16);
    // [b, t, 3 h d] -> q, k, v as [b, h, t, d] views: no copies before the kernel.
    let qkv = random(&mut rng, &[b, t, 3 * h * d], DType::F32, &dev);
    let head = |i: usize| qkv.narrow(2, i * h * d, h * d).reshape([b, t, h, d]).permute(&[0, 2, 1, 3]);
    let (q, k, v) = (head(0), head(1), head(2));
    let y = q.scaled_dot_product_attention(&k, &v, true);
    let dense = q.contiguous().scaled_dot_product_attention(&k.contiguous(), &v.contiguous(), true);
    assert_eq!(
        y.to_vec::<f32>().unwrap(),
        dense.to_vec::<f32>().unwrap(),
        "a strided view gives other values than its copy"
    );
    check_recorded(&[&y]).unwrap();
}

#[test]
fn the_output_and_its_statistics_are_one_kernel_and_so_are_the_key_and_value_gradients() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(15);
    let dims = [2, 2, 24, 16];
    let q = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
    let k = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
    let v = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
    // Kernels between the output and the backward pass's log-sum-exp (products, each a kernel of
    // its own), as a model's later layers put there: the sibling is found however far back.
    let w = random(&mut rng, &[16, 16], DType::F32, &dev);
    let mut y = q.scaled_dot_product_attention(&k, &v, true);
    for _ in 0..12 {
        y = y.matmul(&w).tanh();
    }
    let loss = y.square().sum();
    let g = loss.backward().unwrap();
    let (gq, gk, gv) = (g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap());
    dev.sync().unwrap();
    assert_eq!(
        attention_kernels(&dev),
        [&["attention", "attention_lse"][..], &["attention_grad_k", "attention_grad_v"], &["attention_grad_q"]]
    );
    drop((gq, gk, gv));
}

/// The attention kernels of `dev`'s last schedule: each one's attention ops, sorted.
fn attention_kernels(dev: &Device) -> Vec<Vec<String>> {
    let dump: serde_json::Value = serde_json::from_str(&dev.last_schedule().expect("a schedule").to_json()).unwrap();
    let mut kernels: Vec<Vec<String>> = (dump["streams"].as_array().unwrap().iter())
        .flat_map(|s| s["steps"].as_array().unwrap().iter())
        .filter(|step| step["kind"] == "kernel")
        .map(|k| {
            let ops = k["ops"].as_array().unwrap().iter().map(|o| o.as_str().unwrap().to_string());
            let mut ops: Vec<String> = ops.filter(|o| o.starts_with("attention")).collect();
            ops.sort();
            ops
        })
        .filter(|ops| !ops.is_empty())
        .collect();
    kernels.sort();
    kernels
}

#[test]
fn a_forward_read_before_its_backward_keeps_the_log_sum_exp() {
    // An eager training step reads the loss before recording the backward pass: the forward
    // flush computes the output and its log-sum-exp in one kernel and keeps the statistics, so
    // the backward flush runs only the gradient kernels (it used to run the scores again).
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(16);
    let dims = [2, 3, 20, 16];
    let q = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
    let k = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
    let v = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
    let loss = q.scaled_dot_product_attention(&k, &v, true).tanh().sum();
    loss.item::<f32>().unwrap();
    assert_eq!(attention_kernels(&dev), [["attention", "attention_lse"]]);
    let g = loss.backward().unwrap();
    let (gq, gk, gv) = (g.get(&q).unwrap(), g.get(&k).unwrap(), g.get(&v).unwrap());
    dev.sync().unwrap();
    assert_eq!(attention_kernels(&dev), [&["attention_grad_k", "attention_grad_v"][..], &["attention_grad_q"]]);
    // The same gradients as when the whole step is one flush.
    let again = q.scaled_dot_product_attention(&k, &v, true).tanh().sum().backward().unwrap();
    for (a, b) in [(&gq, &q), (&gk, &k), (&gv, &v)] {
        assert_eq!(a.to_vec::<f32>().unwrap(), again.get(b).unwrap().to_vec::<f32>().unwrap());
    }
    // Without gradients nothing but the output is computed.
    let y = braid::no_grad(|| q.scaled_dot_product_attention(&k, &v, false));
    y.to_vec::<f32>().unwrap();
    assert_eq!(attention_kernels(&dev), [["attention"]]);
}

#[test]
fn autocast_runs_attention_in_low_precision_with_f32_gradients() {
    let dev = braid::testing::test_device();
    for low in [DType::BF16, DType::F16] {
        if !dev.target().dtypes.contains(low) {
            eprintln!("skipped: autocast attention in {low}: {} has no {low}", dev.name());
            continue;
        }
        let mut rng = Rng::new(16);
        let dims = [1, 2, 20, 32];
        let q = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
        let k = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
        let v = random(&mut rng, &dims, DType::F32, &dev).requires_grad();
        let y = braid::amp::autocast(low, || q.scaled_dot_product_attention(&k, &v, true));
        assert_eq!(y.dtype(), low);
        let g = y.to_dtype(DType::F32).sum().backward().unwrap();
        let gq = g.get(&q).unwrap();
        assert_eq!(gq.dtype(), DType::F32, "an f32 parameter's gradient is f32");
        check_recorded(&[&y, &gq]).unwrap();
    }
}

/// Infinities in rows that the causal mask hides from some queries: those queries' outputs and
/// gradients must not see them (a kernel that multiplies a masked probability of zero by an
/// infinite value gets NaN there; the reference marks only the rows that see them uncertain).
/// Case 1: query row 5 infinite (the key and value gradients of later keys multiply the query
/// and output-gradient rows of their tile); case 2: key and value row 30 infinite (the output
/// and the query gradient of earlier queries multiply the value and key rows of their tile).
#[test]
fn infinities_behind_the_causal_mask_stay_hidden() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(17);
    let dims = [1, 2, 40, 16];
    let shape = Shape::new(&dims);
    for dtype in dtypes(&dev) {
        for case in [1, 2] {
            let mut values = || random_values(&mut rng, dtype, shape.numel());
            let (mut qv, mut kv, mut vv, w) = (values(), values(), values(), values());
            let row = |values: &mut Vec<f64>, r: usize| {
                for h in 0..2 {
                    values[(h * 40 + r) * 16..(h * 40 + r + 1) * 16].fill(f64::INFINITY);
                }
            };
            if case == 1 {
                row(&mut qv, 5);
            } else {
                row(&mut kv, 30);
                row(&mut vv, 30);
            }
            let leaf = |v: &[f64]| tensor_from_f64(v, &shape, dtype, &dev).requires_grad();
            let (q, k, v) = (leaf(&qv), leaf(&kv), leaf(&vv));
            let y = q.scaled_dot_product_attention(&k, &v, true);
            let w = tensor_from_f64(&w, &shape, dtype, &dev);
            let grads = (&y * &w).to_dtype(DType::F32).sum().backward().unwrap();
            let (gq, gk, gv) = (grads.get(&q).unwrap(), grads.get(&k).unwrap(), grads.get(&v).unwrap());
            let what = format!("{dtype} case {case}");
            // Case 2's key and value gradients see the infinite rows' NaN statistics everywhere.
            let targets: Vec<&Tensor> = if case == 1 { vec![&y, &gq, &gk, &gv] } else { vec![&y, &gq] };
            let stats = check_recorded(&targets).unwrap_or_else(|e| panic!("{what}: {e}"));
            assert!(stats.checked > stats.uncertain, "{what}: mostly uncertain ({stats:?})");
            // The hidden rows' outputs are finite.
            let out = y.to_dtype(DType::F32).to_vec::<f32>().unwrap();
            let finite_rows: Vec<usize> =
                if case == 1 { (0..40).filter(|&r| r != 5).collect() } else { (0..30).collect() };
            for h in 0..2 {
                for &r in &finite_rows {
                    let at = (h * 40 + r) * 16;
                    assert!(out[at..at + 16].iter().all(|x| x.is_finite()), "{what}: head {h} row {r} is not finite");
                }
            }
        }
    }
}
