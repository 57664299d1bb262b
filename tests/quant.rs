//! Quantized weights (`braid::quant`) on the test device: quantizing and dequantizing every
//! scheme and dtype; products against the reference interpreter (dequantize, then multiply in
//! f32) over odd sizes, group boundaries, negative and zero scales, blocks of zeros, the
//! extreme levels, batched and transposed inputs, half-precision inputs and epilogues; moving,
//! saving and loading; the error a scheme makes against the f32 product; and misuse, reported
//! at the caller's line.

mod common;

use braid::nn::{Linear, Module};
use braid::prelude::*;
use braid::quant::{QuantLayout, Scheme};
use common::{Rng, check_recorded, random_values, tensor_from_f64};
use std::panic::{AssertUnwindSafe, catch_unwind};

const SCHEMES: [Scheme; 4] =
    [Scheme::Int8, Scheme::Int4 { group: 32 }, Scheme::Int4 { group: 64 }, Scheme::Int4 { group: 128 }];

fn random(rng: &mut Rng, dims: &[usize], dtype: DType, dev: &Device) -> Tensor {
    let shape = Shape::new(dims);
    tensor_from_f64(&random_values(rng, dtype, shape.numel()), &shape, dtype, dev)
}

/// The float dtypes `dev` holds.
fn floats(dev: &Device) -> Vec<DType> {
    [DType::F32, DType::F16, DType::BF16].into_iter().filter(|&d| dev.target().dtypes.contains(d)).collect()
}

/// Random integer values in the scheme's range (the extremes included), a block of zeros now
/// and then, and random scales: negative, zero and positive.
fn random_parts(rng: &mut Rng, l: &QuantLayout) -> (Vec<i32>, Vec<f32>) {
    let (lo, hi) = if l.scheme == Scheme::Int8 { (-127, 127) } else { (-8, 7) };
    let mut values: Vec<i32> = (0..l.k * l.n)
        .map(|i| match i % 11 {
            0 => lo,
            1 => hi,
            _ => lo + rng.below((hi - lo + 1) as usize) as i32,
        })
        .collect();
    let scales: Vec<f32> = (0..l.n * l.groups())
        .map(|i| match i % 7 {
            3 => 0.0,
            _ => rng.uniform(-0.05, 0.05) as f32,
        })
        .collect();
    // A block of zero values (its scale kept): the first group of the last channel.
    let j = l.n - 1;
    for v in &mut values[j * l.k..j * l.k + l.group().min(l.k)] {
        *v = 0;
    }
    (values, scales)
}

#[test]
fn quantizing_rounds_each_weight_to_the_nearest_level_of_its_block() {
    let cpu = Device::cpu();
    let mut rng = Rng::new(1);
    for scheme in SCHEMES {
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            for scale in [DType::F32, DType::F16] {
                let (k, n) = (256, 9);
                let w = random(&mut rng, &[k, n], dtype, &cpu);
                let q = w.quantize_with(scheme, scale);
                assert_eq!((q.dims(), q.dtype()), (&[k, n][..], dtype));
                let layout = q.quant_layout().unwrap();
                assert_eq!(layout, QuantLayout::new(scheme, k, n, scale).unwrap());
                let back = q.dequantize().unwrap().to_vec::<f32>().unwrap();
                let w32 = w.to_dtype(DType::F32).to_vec::<f32>().unwrap();
                // What the layout's own host functions make of the same weight.
                assert_eq!(back, layout.dequantize(&layout.quantize(&w32)), "{scheme} {dtype} {scale}");
                for i in 0..k {
                    for j in 0..n {
                        let block = (i / layout.group() * layout.group()
                            ..((i / layout.group() + 1) * layout.group()).min(k))
                            .map(|r| w32[r * n + j].abs())
                            .fold(0f32, f32::max);
                        let step = block / scheme.max_level() as f32;
                        let err = (back[i * n + j] - w32[i * n + j]).abs();
                        assert!(
                            err <= step * 0.5 * 1.01 + 1e-6,
                            "{scheme} {dtype} {scale} ({i}, {j}): {err} > {step}/2"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn parts_round_trip_through_a_quantized_tensor() {
    let cpu = Device::cpu();
    let mut rng = Rng::new(2);
    for scheme in SCHEMES {
        for scale in [DType::F32, DType::F16] {
            let layout = QuantLayout::new(scheme, 128, 5, scale).unwrap();
            let (values, scales) = random_parts(&mut rng, &layout);
            let q = Tensor::from_quantized(layout, &values, &scales, DType::BF16, &cpu);
            let back = q.dequantize().unwrap().to_vec::<f32>().unwrap();
            for i in 0..layout.k {
                for j in 0..layout.n {
                    let s = scales[j * layout.groups() + i / layout.group()];
                    let s = if scale == DType::F16 { half::f16::from_f32(s).to_f32() } else { s };
                    assert_eq!(back[i * layout.n + j], values[j * layout.k + i] as f32 * s);
                }
            }
        }
    }
}

#[test]
fn quantized_products_match_the_reference() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(3);
    let mut cases = 0;
    for scheme in SCHEMES {
        let group = if let Scheme::Int4 { group } = scheme { group } else { 1 };
        // Inner sizes across group and vector boundaries (odd for int8).
        let ks: Vec<usize> =
            if group == 1 { vec![1, 7, 129, 300] } else { vec![group, 3 * group, 256usize.max(group) * 2] };
        for (c, &k) in ks.iter().enumerate() {
            for dtype in floats(&dev) {
                let scale = if c % 2 == 0 { DType::F32 } else { DType::F16 };
                let (m, n) = ([1, 3, 17, 40][(c + cases) % 4], [1, 5, 33, 64][(c * 3 + cases) % 4]);
                let layout = QuantLayout::new(scheme, k, n, scale).unwrap();
                let (values, scales) = random_parts(&mut rng, &layout);
                let q = Tensor::from_quantized(layout, &values, &scales, DType::F32, &dev);
                let x = random(&mut rng, &[m, k], dtype, &dev);
                let bias = random(&mut rng, &[n], dtype, &dev);
                let (y, z) = braid::no_grad(|| {
                    let y = x.matmul(&q);
                    // An epilogue: a bias and an activation.
                    let z = (&y + &bias).relu();
                    (y, z)
                });
                let what = format!("{scheme} {scale} scales, x {dtype} [{m}, {k}] x [{k}, {n}]");
                check_recorded(&[&y, &z]).unwrap_or_else(|e| panic!("{what}: {e}"));
                cases += 1;
            }
        }
    }
    assert!(cases >= 16);
}

#[test]
fn quantized_products_read_batched_and_transposed_inputs() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(4);
    let layout = QuantLayout::new(Scheme::Int4 { group: 32 }, 64, 24, DType::F16).unwrap();
    let (values, scales) = random_parts(&mut rng, &layout);
    let q = Tensor::from_quantized(layout, &values, &scales, DType::F32, &dev);
    let x = random(&mut rng, &[2, 3, 64], DType::F32, &dev);
    let xt = random(&mut rng, &[64, 5], DType::F32, &dev);
    let (y, yt) = braid::no_grad(|| (x.matmul(&q), xt.t().matmul(&q)));
    assert_eq!((y.dims(), yt.dims()), (&[2, 3, 24][..], &[5, 24][..]));
    check_recorded(&[&y, &yt]).unwrap();
    // No inputs at all (k = 0): every row's sum is empty.
    let empty = Tensor::from_quantized(
        QuantLayout::new(Scheme::Int8, 0, 4, DType::F32).unwrap(),
        &[],
        &[1.0; 4],
        DType::F32,
        &dev,
    );
    let y0 = braid::no_grad(|| Tensor::zeros([2, 3, 0], DType::F32, &dev).matmul(&empty));
    assert_eq!((y0.dims(), y0.to_vec::<f32>().unwrap()), (&[2, 3, 4][..], vec![0.0; 24]));
}

#[test]
fn quantized_weights_move_save_and_load() {
    let cpu = Device::cpu();
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(5);
    let w = random(&mut rng, &[96, 10], DType::F32, &cpu);
    let b = random(&mut rng, &[10], DType::F32, &cpu);
    let x = random(&mut rng, &[4, 96], DType::F32, &cpu);
    for scheme in SCHEMES.into_iter().filter(|s| !matches!(s, Scheme::Int4 { group: 64 | 128 })) {
        let q = w.quantize(scheme);
        let here = braid::no_grad(|| x.matmul(&q)).to_vec::<f32>().unwrap();
        let bytes = braid::io::save_to_bytes(&[("layer.weight", &q), ("layer.bias", &b)]).unwrap();
        let loaded = braid::io::load_from_bytes(&bytes, &dev).unwrap();
        assert_eq!(loaded.len(), 2, "{:?}", loaded.keys().collect::<Vec<_>>());
        let lq = &loaded["layer.weight"];
        assert_eq!((lq.quant_layout(), lq.dims(), lq.dtype()), (q.quant_layout(), q.dims(), q.dtype()));
        // On the device after the trip, and moved back: on the CPU the same bits; on the device
        // within two summation orders of the 96 f32 terms (`k 2^-23 sum |x w|`).
        let there = braid::no_grad(|| x.to_device(&dev).matmul(lq)).to_vec::<f32>().unwrap();
        let back = braid::no_grad(|| x.matmul(&lq.to_device(&cpu))).to_vec::<f32>().unwrap();
        assert_eq!(here, back, "{scheme}: a moved weight multiplies as before");
        let magnitude = x.abs().matmul(&q.dequantize().unwrap().abs()).to_vec::<f32>().unwrap();
        for ((a, b), m) in here.iter().zip(&there).zip(&magnitude) {
            let bound = 96.0 * 2f32.powi(-23) * m;
            assert!((a - b).abs() <= bound, "{scheme}: {a} on the CPU, {b} on {} (bound {bound})", dev.name());
        }
        // The file's names are the documented ones.
        let plain = braid::io::load_from_bytes(&strip_metadata(&bytes), &cpu).unwrap();
        assert!(plain.contains_key("layer.weight.qweight") && plain.contains_key("layer.weight.scales"));
    }
}

/// A safetensors file's bytes with its metadata dropped (what a reader unaware of braid sees).
fn strip_metadata(bytes: &[u8]) -> Vec<u8> {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header.as_object_mut().unwrap().remove("__metadata__");
    let mut text = serde_json::to_vec(&header).unwrap();
    while !text.len().is_multiple_of(8) {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    out
}

#[test]
fn each_scheme_stays_close_to_the_f32_product() {
    // The error a scheme makes on random weights (normal, as trained weights roughly are)
    // against the f32 product; printed, and bounded loosely.
    let cpu = Device::cpu();
    cpu.seed(7);
    let (k, n, m) = (1024, 256, 8);
    let w = Tensor::randn([k, n], DType::F32, &cpu);
    let x = Tensor::randn([m, k], DType::F32, &cpu);
    let exact = x.matmul(&w).to_vec::<f32>().unwrap();
    let scale = exact.iter().map(|v| v.abs()).sum::<f32>() / exact.len() as f32;
    for (scheme, worst_allowed) in
        [(Scheme::Int8, 0.1), (Scheme::Int4 { group: 32 }, 0.8), (Scheme::Int4 { group: 128 }, 0.8)]
    {
        let got = braid::no_grad(|| x.matmul(&w.quantize(scheme))).to_vec::<f32>().unwrap();
        let errs: Vec<f32> = exact.iter().zip(&got).map(|(a, b)| (a - b).abs() / scale).collect();
        let (max, mean) = (errs.iter().copied().fold(0f32, f32::max), errs.iter().sum::<f32>() / errs.len() as f32);
        eprintln!(
            "{scheme}: error against the f32 product, relative to its mean magnitude: max {max:.4}, mean {mean:.4}"
        );
        assert!(max < worst_allowed, "{scheme}: max relative error {max}");
    }
}

#[test]
fn a_quantized_linear_layer_serves_like_the_trained_one() {
    let dev = braid::testing::test_device();
    dev.seed(8);
    let layer = Linear::new(128, 16, &dev);
    let x = Tensor::randn([3, 128], DType::F32, &dev);
    let served = layer.quantize(Scheme::Int8);
    assert_eq!(served.weight.dims(), &[128, 16]);
    let (want, got) = braid::no_grad(|| (layer.forward(&x), served.forward(&x)));
    let (want, got) = (want.to_vec::<f32>().unwrap(), got.to_vec::<f32>().unwrap());
    for (a, b) in want.iter().zip(&got) {
        assert!((a - b).abs() < 0.02, "{a} vs {b}");
    }
}

/// The message of `f`'s panic.
fn panic_message(f: impl FnOnce()) -> String {
    let e = catch_unwind(AssertUnwindSafe(f)).expect_err("misuse panics");
    e.downcast_ref::<String>().cloned().unwrap_or_default()
}

#[test]
fn misuse_is_reported_at_the_callers_line() {
    let cpu = Device::cpu();
    let w = Tensor::ones([48, 4], DType::F32, &cpu);
    let m = panic_message(|| {
        w.quantize(Scheme::Int4 { group: 32 });
    });
    assert!(m.contains("does not divide") && m.contains("tests/quant.rs"), "{m}");
    let m = panic_message(|| {
        w.quantize(Scheme::Int4 { group: 24 });
    });
    assert!(m.contains("32, 64 or 128"), "{m}");
    let q = Tensor::ones([64, 4], DType::F32, &cpu).quantize(Scheme::Int8);
    for (what, f) in [
        ("add", Box::new(|| drop(&q + 1.0)) as Box<dyn Fn()>),
        ("reshape", Box::new(|| drop(q.reshape([4, 64])))),
        ("lhs", Box::new(|| drop(q.t().matmul(&q)))),
        ("requires_grad", Box::new(|| drop(q.requires_grad()))),
        ("linear", Box::new(|| drop(Tensor::ones([2, 4], DType::F32, &cpu).linear(&q, None)))),
        ("assign", Box::new(|| q.assign(&Tensor::ones([64, 4], DType::F32, &cpu)))),
    ] {
        let m = panic_message(f);
        assert!(m.contains("tests/quant.rs") && m.contains("quantized"), "{what}: {m}");
    }
    // A product that would need a gradient.
    let x = Tensor::ones([2, 64], DType::F32, &cpu).requires_grad();
    let m = panic_message(|| drop(x.matmul(&q)));
    assert!(m.contains("no gradient") && m.contains("tests/quant.rs"), "{m}");
    // Reads are errors, not panics; the engine goes on.
    assert!(matches!(q.to_vec::<f32>(), Err(Error::Quantized(_))));
    let y = braid::no_grad(|| Tensor::ones([2, 64], DType::F32, &cpu).matmul(&q));
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![64.0; 8]);
}
