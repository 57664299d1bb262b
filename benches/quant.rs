//! g9: the product with a quantized weight alone, batch 1 (`x [1, 4096]` in bf16 times weights
//! `[4096 x 4096]` and `[4096 x 14336]`, int8 per channel and int4 in groups of 32, 64 and 128,
//! f16 scales), as effective bandwidth: the bytes of packed values and scales each product
//! must read, over its kernel's time on the device (the profile's, from the backend's device
//! timestamps), against the copy floor of the same run: a copy kernel over 256 MiB (bf16
//! `neg`, read and written), its bytes over its time.
//!
//! Each row rotates over enough copies of the weight (at least 256 MiB in all) that every
//! product reads its weight from memory, not from the L2 cache of the one before: one captured
//! `braid::Step` takes `x` and every copy and returns their products joined (`cat`, one
//! output), replayed as one CUDA graph that reads the weights where they are; the time of a
//! product is the median of 5 timings of 10 replays (each to the end of the last, synced),
//! divided by the products, so it includes each replay's launch, its `cat` and the copy of its
//! output (a few microseconds a replay: the figures understate the products' bandwidth a
//! little). Also printed: the error each scheme makes against the
//! f32 product on random normal weights (`[4096 x 4096]`, 8 rows; max and mean of
//! `|y_q - y| / mean |y|`), and each row's product checked against the f32 product of its
//! dequantized weight.
//!
//! Run: `BRAID_DEVICE=cuda cargo bench --bench quant` (on the CPU, the default device, at a
//! sixteenth of the sizes).

use braid::Step;
use braid::prelude::*;
use braid::quant::{QuantLayout, Scheme};
use std::time::{Duration, Instant};

const SCHEMES: [Scheme; 4] =
    [Scheme::Int8, Scheme::Int4 { group: 32 }, Scheme::Int4 { group: 64 }, Scheme::Int4 { group: 128 }];

/// The median kernel time of the last flush's kernels whose label contains `what`.
fn kernel_times(dev: &Device, what: &str) -> Vec<Duration> {
    let p = dev.last_profile().expect("profiling is on");
    p.kernels().filter(|k| k.name.contains(what)).map(|k| k.duration).collect()
}

fn median(mut v: Vec<Duration>) -> Duration {
    assert!(!v.is_empty(), "no kernel timed");
    v.sort();
    v[v.len() / 2]
}

/// Random integer values and scales for `l` (a cheap generator: the values only need to vary).
fn parts(l: &QuantLayout, seed: u64) -> (Vec<i32>, Vec<f32>) {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let levels = if l.scheme == Scheme::Int8 { 255 } else { 16 };
    let low = if l.scheme == Scheme::Int8 { -127 } else { -8 };
    let values = (0..l.k * l.n).map(|_| low + (next() % levels) as i32).collect();
    let scales = (0..l.n * l.groups()).map(|_| (next() % 1000) as f32 * 1e-5 + 1e-4).collect();
    (values, scales)
}

fn main() {
    let dev = Device::from_env().expect("the device BRAID_DEVICE names");
    let on_cpu = dev.name().starts_with("cpu");
    let shrink = if on_cpu { 4 } else { 1 };
    dev.seed(9);
    dev.set_profiling(true);
    println!("g9 on {}: quantized products, batch 1, x bf16, f16 scales", dev.name());

    // The copy floor: a bf16 negation over 256 MiB (read and written), best of 5.
    let copy_bytes = (256usize << 20) / (shrink * shrink);
    let src = Tensor::randn([copy_bytes / 2], DType::F32, &dev).to_dtype(DType::BF16);
    dev.sync().unwrap();
    let mut copy = Duration::MAX;
    for _ in 0..5 {
        let y = src.neg();
        dev.sync().unwrap();
        copy = copy.min(median(kernel_times(&dev, "neg")));
        drop(y);
    }
    // Off again: a profiled replay runs as a flush, not as the CUDA graph timed below.
    dev.set_profiling(false);
    let floor = 2.0 * copy_bytes as f64 / copy.as_secs_f64();
    println!(
        "copy floor: {:.1} MiB read and written in {:.1} us = {:.0} GB/s",
        copy_bytes as f64 / 1048576.0,
        copy.as_secs_f64() * 1e6,
        floor / 1e9
    );
    drop(src);

    // Each scheme's error against the f32 product on random normal weights.
    let (k, n) = (4096 / shrink, 4096 / shrink);
    let cpu = Device::cpu();
    cpu.seed(10);
    let w = Tensor::randn([k, n], DType::F32, &cpu);
    let x = Tensor::randn([8, k], DType::F32, &cpu);
    let exact = x.to_device(&dev).matmul(&w.to_device(&dev)).to_vec::<f32>().unwrap();
    let mean = exact.iter().map(|v| v.abs()).sum::<f32>() / exact.len() as f32;
    for scheme in SCHEMES {
        let q = w.quantize_with(scheme, DType::F16).to_device(&dev);
        let got = braid::no_grad(|| x.to_device(&dev).matmul(&q)).to_vec::<f32>().unwrap();
        let errs: Vec<f32> = exact.iter().zip(&got).map(|(a, b)| (a - b).abs() / mean).collect();
        let max = errs.iter().copied().fold(0f32, f32::max);
        let avg = errs.iter().sum::<f32>() / errs.len() as f32;
        println!(
            "error {scheme} (f16 scales) against the f32 product, [8, {k}] x [{k}, {n}]: max {max:.4}, mean {avg:.4} of mean |y| {mean:.2}"
        );
    }

    for (k, n) in [(4096 / shrink, 4096 / shrink), (4096 / shrink, 14336 / shrink)] {
        for scheme in SCHEMES {
            let l = QuantLayout::new(scheme, k, n, DType::F16).unwrap();
            let copies = ((256usize << 20) / (shrink * shrink)).div_ceil(l.bytes()).max(2);
            let (values, scales) = parts(&l, k as u64 * 31 + n as u64);
            let weights: Vec<Tensor> =
                (0..copies).map(|_| Tensor::from_quantized(l, &values, &scales, DType::BF16, &dev)).collect();
            let x = Tensor::randn([1, k], DType::F32, &dev).to_dtype(DType::BF16);
            let step = Step::new(|a: &[Tensor]| {
                let ys: Vec<Tensor> = a[1..].iter().map(|w| a[0].matmul(w)).collect();
                vec![Tensor::cat(&ys.iter().collect::<Vec<_>>(), 0)]
            });
            let args: Vec<Tensor> = std::iter::once(x.clone()).chain(weights.iter().cloned()).collect();
            let mut held = Vec::new();
            // The capture, the replay that records the graph, and a warm-up.
            for _ in 0..3 {
                held = step.call(&args).unwrap();
            }
            dev.sync().unwrap();
            let mut times = Vec::new();
            for _ in 0..5 {
                let start = Instant::now();
                for _ in 0..10 {
                    held = step.call(&args).unwrap();
                }
                dev.sync().unwrap();
                times.push(start.elapsed() / (10 * copies as u32));
            }
            let t = median(times);
            let bw = l.payload_bytes() as f64 / t.as_secs_f64();
            // The first product against the f32 product of the dequantized weight.
            let want = x.to_dtype(DType::F32).matmul(&weights[0].dequantize().unwrap().to_device(&dev));
            let want = want.to_vec::<f32>().unwrap();
            let got = held[0].narrow(0, 0, 1).to_dtype(DType::F32).to_vec::<f32>().unwrap();
            let scale = want.iter().map(|v| v.abs()).fold(0f32, f32::max).max(1e-30);
            let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max) / scale;
            println!(
                "g9 [{k} x {n}] {scheme}: {:.2} MB in {:.2} us = {:.0} GB/s = {:.2} of the copy floor ({copies} weights a replay; max error {err:.1e} of max |y|)",
                l.payload_bytes() as f64 / 1e6,
                t.as_secs_f64() * 1e6,
                bw / 1e9,
                bw / floor
            );
        }
    }
}
