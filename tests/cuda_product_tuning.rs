//! Products tuned among cuBLASLt's algorithms (`devices/src/cuda/tune_products.rs`), on a
//! GPU: with `BRAID_AUTOTUNE=exhaustive` and `BRAID_DETERMINISTIC=0` (set in a child process,
//! over a fresh kernel cache, so that no earlier choice is read), an f32 and a bf16 product of
//! 2048 x 2048 by 2048 x 2048, and a batched one of each, are timed in cuBLAS's call and eight
//! of cuBLASLt's algorithms; their results agree with the CPU's; the tunings are counted and
//! logged naming the cuBLASLt candidates; and deterministic settings (the default) give the
//! bits of tuning off, before and after the tuning.
//!
//! Run: `cargo test --test cuda_product_tuning -- --nocapture` (the child's log, with the
//! heuristic's algorithms and the times of each candidate, is printed). Without a GPU (or the
//! CUDA libraries) the test prints `skipped: <reason>` and passes.

#![cfg(feature = "cuda")]

mod common;

use braid::autotune::{self, Mode};
use braid::prelude::*;
use std::io::Write;
use std::process::Command;

fn random(n: usize, seed: u64) -> Vec<f32> {
    common::uniform_f32(n, seed, 1.0)
}

/// The products: (name, dtype, left-hand shape, right-hand shape).
const CASES: [(&str, DType, [usize; 3], [usize; 3]); 4] = [
    ("f32 2048^3", DType::F32, [1, 2048, 2048], [1, 2048, 2048]),
    ("bf16 2048^3", DType::BF16, [1, 2048, 2048], [1, 2048, 2048]),
    ("f32 8 x 512 x 1024 x 512", DType::F32, [8, 512, 1024], [8, 1024, 512]),
    ("bf16 8 x 512 x 1024 x 512", DType::BF16, [8, 512, 1024], [8, 1024, 512]),
];

/// Each case's product on `dev`, as f32 values (each flush a product kernel alone: the operands
/// are uploaded in their dtype, the product read in it), and the variant its dump names.
fn products(dev: &Device) -> (Vec<Vec<f32>>, Vec<String>) {
    let mut variants = Vec::new();
    let values = CASES
        .iter()
        .enumerate()
        .map(|(i, &(_, dtype, l, r))| {
            let make = |shape: [usize; 3], seed: u64| {
                let v = random(shape.iter().product(), seed);
                let dims: Vec<usize> = if shape[0] == 1 { shape[1..].to_vec() } else { shape.to_vec() };
                match dtype {
                    DType::BF16 => Tensor::from_vec(v.into_iter().map(half::bf16::from_f32).collect(), dims, dev),
                    _ => Tensor::from_vec(v, dims, dev),
                }
            };
            let (a, b) = (make(l, 2 * i as u64 + 1), make(r, 2 * i as u64 + 2));
            let p = a.matmul(&b);
            let got = match dtype {
                DType::BF16 => p.to_vec::<half::bf16>().unwrap().into_iter().map(f32::from).collect(),
                _ => p.to_vec::<f32>().unwrap(),
            };
            let text = dev.last_schedule().map(|d| d.to_text()).unwrap_or_default();
            let named = text.split("[variant: ").nth(1).and_then(|t| t.split(']').next());
            variants.push(named.unwrap_or("(default)").to_string());
            got
        })
        .collect();
    (values, variants)
}

fn bits(values: &[Vec<f32>]) -> Vec<Vec<u32>> {
    values.iter().map(|v| v.iter().map(|x| x.to_bits()).collect()).collect()
}

/// The worst difference between `got` and `want`, relative to `want`'s largest magnitude.
fn worst(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(f32::MIN_POSITIVE);
    got.iter().zip(want).fold(0f32, |m, (g, w)| m.max((g - w).abs())) / scale
}

/// What the child process runs (see the module docs); panics on any failed check.
#[test]
#[ignore = "run by `products_are_tuned_among_cublaslt_algorithms` in a child process"]
fn product_tuning_child() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    let dev = Device::new_cuda(0).expect("the parent found a GPU");
    dev.set_compile_mode(braid::CompileMode::Blocking);
    let cpu = Device::new_cpu();
    autotune::set_mode(Mode::Off);
    let reference = products(&cpu).0;
    let off = products(&dev).0;
    // Deterministic (the default): cuBLAS's call only, nothing timed, the bits of tuning off.
    autotune::set_mode(Mode::Exhaustive);
    autotune::set_deterministic(true);
    let before = autotune::tunings();
    assert_eq!(bits(&products(&dev).0), bits(&off), "deterministic settings changed bits");
    // (Products have no bitwise variants: nothing of theirs is timed; a kernel of another kind
    // in these flushes could be.)
    println!("kernels timed under deterministic settings: {}", autotune::tunings() - before);
    let before = autotune::tunings();

    // Tuned freely: each product is timed once, its result right.
    autotune::set_deterministic(false);
    let (tuned, _) = products(&dev);
    let timed = autotune::tunings() - before;
    println!("tunings: {timed} in {:.3} s", autotune::tuning_seconds());
    assert!(timed >= CASES.len() as u64, "{timed} kernels tuned for {} products", CASES.len());
    let (again, chosen) = products(&dev);
    assert_eq!(autotune::tunings() - before, timed, "a product tuned twice");
    for ((name, ..), variant) in CASES.iter().zip(&chosen) {
        println!("{name}: runs {variant}");
    }
    for (i, (name, dtype, _, _)) in CASES.iter().enumerate() {
        let limit = if *dtype == DType::BF16 { 2e-2 } else { 1e-4 };
        for (what, got) in [("tuned", &tuned[i]), ("after tuning", &again[i]), ("tuning off", &off[i])] {
            let w = worst(got, &reference[i]);
            println!("{name}, {what}: worst difference from the CPU {w:.3e} of the largest value");
            assert!(w <= limit, "{name}, {what}: differs from the CPU's by {w:e} of the largest value");
        }
    }
    // Deterministic again: the choices made are not used, the bits are tuning off's.
    autotune::set_deterministic(true);
    assert_eq!(bits(&products(&dev).0), bits(&off), "deterministic settings after tuning changed bits");
}

#[test]
fn products_are_tuned_among_cublaslt_algorithms() {
    if let Err(e) = Device::new_cuda(0) {
        let _ = writeln!(std::io::stderr(), "skipped: products_are_tuned_among_cublaslt_algorithms: {e}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("braid-product-tuning-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "product_tuning_child", "--nocapture", "--test-threads", "1"])
        .env("BRAID_KERNEL_CACHE", &dir)
        .env("BRAID_CUDA_CACHE", &dir)
        .env("BRAID_AUTOTUNE", "exhaustive")
        .env("BRAID_DETERMINISTIC", "0")
        .env_remove("BRAID_TF32")
        .env("RUST_LOG", "braid::autotune=debug,braid::cuda=debug")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let _ = std::fs::remove_dir_all(&dir);
    // The log's lines about tuning and cuBLASLt (the debug log has a line per kernel too).
    for line in text.lines().filter(|l| l.contains("autotune") || l.contains("cuBLASLt") || !l.contains("braid::")) {
        println!("{line}");
    }
    assert!(out.status.success(), "the child failed:\n{text}");
    assert!(text.contains("cublasLt heuristic 0"), "the tunings name cuBLASLt's candidates:\n{text}");
}
