//! Printer tests of fused attention: every pass, dtype and head-dimension class prints one
//! entry of the expected launch shape whose source holds the pass's device code, the operands'
//! offsets and strides, and balanced braces; misuse is refused. (Numbers come from
//! `tests/attention.rs` on a GPU.) With `BRAID_CUDA_SOURCES` naming a directory, the printed
//! sources are also written there, for compiling them with NVRTC off the test.

use super::tests::{args, contiguous, in_order, load, view};
use super::*;
use crate::attention::{AttentionGradInputs, AttentionKernel, AttentionPass};
use crate::kernel::{Body, Kernel};

/// Attention over `[batch, rows, d]` contiguous operands: arguments q, k, v (and for a backward
/// pass d_out, lse, delta) in order, then the outputs.
fn kernel(dtype: DType, pass: u8, batch: &[usize], sq: usize, sk: usize, d: usize, causal: bool) -> Kernel {
    let problems: usize = batch.iter().product();
    let dims = |rows: usize, cols: Option<usize>| [batch, &[rows], cols.as_slice()].concat();
    let stats = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
    let mut a = vec![(dtype, problems * sq * d), (dtype, problems * sk * d), (dtype, problems * sk * d)];
    let ld = |arg: u16, dt: DType, dims: Vec<usize>| load(arg, dt, contiguous(&dims));
    let (q, k, v) = (ld(0, dtype, dims(sq, Some(d))), ld(1, dtype, dims(sk, Some(d))), ld(2, dtype, dims(sk, Some(d))));
    let grads = |a: &mut Vec<(DType, usize)>| {
        a.extend([(dtype, problems * sq * d), (stats, problems * sq), (stats, problems * sq)]);
        AttentionGradInputs {
            d_out: ld(3, dtype, dims(sq, Some(d))),
            lse: ld(4, stats, dims(sq, None)),
            delta: ld(5, stats, dims(sq, None)),
        }
    };
    let pass = match pass {
        0 => {
            a.extend([(dtype, problems * sq * d), (stats, problems * sq)]);
            AttentionPass::Forward { out: Some(3), lse: Some(4) }
        }
        1 => {
            let g = grads(&mut a);
            a.push((dtype, problems * sq * d));
            AttentionPass::GradQ { grads: g, dq: 6 }
        }
        _ => {
            let g = grads(&mut a);
            a.extend([(dtype, problems * sk * d), (dtype, problems * sk * d)]);
            AttentionPass::GradKv { grads: g, dk: Some(6), dv: Some(7) }
        }
    };
    let inputs = if matches!(pass, AttentionPass::Forward { .. }) { 3 } else { 6 };
    let body = AttentionKernel { dtype, causal, batch: batch.into(), sq, sk, d, q, k, v, pass };
    Kernel { args: args(&a), inputs, body: Body::Attention(Box::new(body)) }
}

fn attention(k: &Kernel) -> &AttentionKernel {
    match &k.body {
        Body::Attention(a) => a,
        _ => unreachable!(),
    }
}

/// Writes `source` to `$BRAID_CUDA_SOURCES/<name>.cu` when that variable is set.
fn keep(name: &str, source: &str) {
    if let Some(dir) = std::env::var_os("BRAID_CUDA_SOURCES") {
        std::fs::write(std::path::Path::new(&dir).join(format!("{name}.cu")), source).unwrap();
    }
}

#[test]
fn every_pass_dtype_and_head_dimension_prints_one_entry() {
    let passes = [("att_forward<true, true>(a0, a1, a2, a3, a4)", 0), ("att_grad_q(a0, a1, a2, a3, a4, a5, a6)", 1)];
    let passes = passes.into_iter().chain([("att_grad_kv<true, true>(a0, a1, a2, a3, a4, a5, a6, a7)", 2)]);
    for (call, pass) in passes {
        for dtype in [DType::F16, DType::BF16, DType::F32, DType::F64] {
            for d in [1, 16, 24, 33, 64, 80, 128, 200, 256] {
                for causal in [false, true] {
                    let k = kernel(dtype, pass, &[2, 3], 70, 45, d, causal);
                    let tiles = attention_tiles(attention(&k)).unwrap();
                    let p = print(&k, "att").unwrap_or_else(|e| panic!("{dtype} d {d} pass {pass}: {e}"));
                    keep(&format!("att_{pass}_{dtype}_{d}_{}", causal as u8), &p.source);
                    let own = if pass == 2 { 45usize.div_ceil(tiles.bk) } else { 70usize.div_ceil(tiles.bq) };
                    let threads = tiles.warps * 32;
                    let launch = Launch::Tiles { blocks: 6 * own, threads, shared_bytes: tiles.shared_bytes as u32 };
                    assert_eq!(p.entries, vec![Entry { name: "att".into(), launch }], "{dtype} d {d} pass {pass}");
                    assert!(tiles.dp >= d && tiles.shared_bytes <= 227 * 1024, "{tiles:?}");
                    let tensor = matches!(dtype, DType::F16 | DType::BF16);
                    assert_eq!(p.source.contains("mma.sync.aligned.m16n8k16"), tensor, "{dtype}: tensor cores");
                    in_order(
                        &p.source,
                        &[
                            &format!("constexpr int ATT_D = {d};"),
                            &format!("constexpr bool ATT_CAUSAL = {causal};"),
                            "long long att_at_q(long long b)",
                            &format!("__launch_bounds__({threads}, {}) att(", tiles.min_blocks),
                            call,
                        ],
                    );
                    let balance = |o: char, c: char| p.source.matches(o).count() == p.source.matches(c).count();
                    assert!(balance('{', '}') && balance('(', ')') && balance('[', ']'), "unbalanced source");
                    // Only the pass's own device code is printed.
                    let others = ["void att_forward", "void att_grad_q", "void att_grad_kv"];
                    let printed: Vec<bool> = others.iter().map(|f| p.source.contains(f)).collect();
                    assert_eq!(printed.iter().filter(|&&b| b).count(), 1, "{printed:?}");
                }
            }
        }
    }
}

#[test]
fn tiles_give_the_exact_path_scratch_and_cover_the_warps() {
    for dtype in [DType::F16, DType::BF16] {
        for d in 1..=MAX_HEAD_DIM {
            for pass in 0..3 {
                let k = kernel(dtype, pass, &[1], 8, 8, d, true);
                let t = attention_tiles(attention(&k)).unwrap();
                let lds = t.dp + 8;
                // The exact path's per-warp scratch (16 rows of the other side's tile) lives
                // in the idle buffer pair where it fits, else in memory of its own.
                let (other, pair) = if pass == 2 { (t.bq, 2 * t.bq * lds) } else { (t.bk, 2 * t.bk * lds) };
                assert_eq!(t.warps as usize * 16 * other > pair, t.own_scratch, "{dtype} d {d} pass {pass}: {t:?}");
                assert_eq!(t.dp % 16, 0);
                assert_eq!(if pass == 2 { t.bk } else { t.bq }, t.warps as usize * 16 * t.mw);
            }
        }
    }
}

#[test]
fn views_print_their_offsets_strides_and_vector_paths() {
    // q: heads split by a permute of [b=2, t=19, h=3, d=16] (strides [912, 16, 48, 1] over
    // [b, h, t, d]); k: a column stride of 2 (no 16-byte copies); v: contiguous.
    let mut k = kernel(DType::BF16, 0, &[2, 3], 19, 19, 16, true);
    let Body::Attention(a) = &mut k.body else { unreachable!() };
    a.q = load(0, DType::BF16, view(&[2, 3, 19, 16], &[912, 16, 48, 1], 8));
    a.k = load(1, DType::BF16, view(&[2, 3, 19, 16], &[1824, 608, 32, 2], 0));
    k.args[0].len = 2 * 19 * 48 + 8;
    k.args[1].len = 2 * 1824;
    let p = print(&k, "att").unwrap().source;
    in_order(
        &p,
        &[
            "long long att_at_q(long long b) {",
            "long long at = 8LL;",
            "at += (b % 3LL) * 16LL;",
            "b /= 3LL;",
            "at += (b % 2LL) * 912LL;",
            "constexpr long long ATT_Q_RS = 48LL;",
            "constexpr bool ATT_Q_VEC = true;",
            "constexpr long long ATT_K_CS = 2LL;",
            "constexpr bool ATT_K_VEC = false;",
            "constexpr bool ATT_V_VEC = true;",
        ],
    );
    // A head dimension that is not a multiple of 8 is never copied 16 bytes at a time.
    let p = print(&kernel(DType::F16, 0, &[1], 9, 9, 33, false), "att").unwrap().source;
    assert!(p.contains("constexpr bool ATT_Q_VEC = false;") && p.contains("constexpr int ATT_DP = 48;"));
}

#[test]
fn misuse_is_refused_not_printed() {
    let err = |k: &Kernel| print(k, "att").unwrap_err();
    // A head dimension past the largest printed.
    assert!(err(&kernel(DType::BF16, 0, &[1], 4, 4, 300, false)).contains("head dimension 300"));
    // An output argument the wrong size, and an output that is an input.
    let mut k = kernel(DType::F16, 0, &[2], 8, 8, 16, false);
    k.args[3].len -= 1;
    err(&k);
    let mut k = kernel(DType::F16, 1, &[2], 8, 8, 16, false);
    let Body::Attention(a) = &mut k.body else { unreachable!() };
    a.pass = AttentionPass::GradQ { grads: grads_of(a), dq: 0 };
    assert!(err(&k).contains("arguments of their own"));
    // A read-only output.
    let mut k = kernel(DType::F32, 2, &[1], 8, 8, 16, false);
    k.inputs = 8;
    assert!(err(&k).contains("writable"));
    // A view reaching past its argument.
    let mut k = kernel(DType::F32, 0, &[1], 8, 8, 16, false);
    k.args[1].len = 100;
    err(&k);
}

fn grads_of(a: &AttentionKernel) -> AttentionGradInputs {
    match &a.pass {
        AttentionPass::GradQ { grads, .. } | AttentionPass::GradKv { grads, .. } => grads.clone(),
        AttentionPass::Forward { .. } => unreachable!(),
    }
}

#[test]
fn nothing_to_launch_without_problems_or_rows() {
    let k = kernel(DType::BF16, 0, &[0], 8, 8, 16, false);
    assert!(print(&k, "att").unwrap().entries.is_empty());
    let k = kernel(DType::F32, 1, &[2], 0, 8, 16, false);
    assert!(print(&k, "att").unwrap().entries.is_empty());
    // No query: the key and value gradients are still written (zeros).
    let k = kernel(DType::F32, 2, &[2], 0, 8, 16, true);
    assert_eq!(print(&k, "att").unwrap().entries.len(), 1);
}

#[test]
fn tuning_shapes_print_other_tilings_that_fit() {
    for dtype in [DType::F16, DType::BF16] {
        for pass in 0..3 {
            for d in [16, 64, 80, 128] {
                for causal in [false, true] {
                    let k = kernel(dtype, pass, &[2], 300, 200, d, causal);
                    let a = attention(&k);
                    let table = attention_tiles(a).unwrap();
                    let shapes = attention_shapes(a);
                    assert!(shapes.len() >= 3, "{dtype} pass {pass} d {d}: {shapes:?}");
                    let same_tiles = shapes.iter().filter(|s| {
                        let t = attention_tiles_with(a, Some(**s)).unwrap();
                        (t.bq, t.bk) == (table.bq, table.bk)
                    });
                    assert!(same_tiles.count() >= 1, "{dtype} pass {pass} d {d}: no shape keeps the tiles");
                    let default = print(&k, "att").unwrap();
                    for s in &shapes {
                        let t = attention_tiles_with(a, Some(*s)).unwrap();
                        assert_ne!(t, table, "{s:?} is the table's tiling");
                        assert!(t.shared_bytes <= 227 * 1024, "{s:?}: {t:?}");
                        let options = PrintOptions { attention: Some(*s), ..PrintOptions::default() };
                        let p = print_with(&k, "att", &options).unwrap();
                        assert_ne!(p.source, default.source);
                        let own = if pass == 2 { 200usize.div_ceil(t.bk) } else { 300usize.div_ceil(t.bq) };
                        let launch = Launch::Tiles {
                            blocks: 2 * own,
                            threads: s.warps * 32,
                            shared_bytes: t.shared_bytes as u32,
                        };
                        assert_eq!(p.entries[0].launch, launch, "{s:?}");
                        assert!(p.source.contains(&format!("constexpr int ATT_BK = {};", t.bk)));
                        assert!(p.source.contains(&format!("__launch_bounds__({}, {})", s.warps * 32, s.min_blocks)));
                    }
                }
            }
        }
    }
    // No other tilings for CUDA cores, nor past a head dimension of 128; shapes the kernels
    // cannot run are refused.
    assert!(attention_shapes(attention(&kernel(DType::F32, 0, &[2], 30, 20, 64, false))).is_empty());
    assert!(attention_shapes(attention(&kernel(DType::BF16, 0, &[2], 30, 20, 200, false))).is_empty());
    let k = kernel(DType::BF16, 0, &[2], 30, 20, 64, false);
    for bad in [(3, 1, 64, 1), (4, 3, 64, 1), (4, 1, 40, 1), (4, 1, 256, 1)] {
        let (warps, mw, other, min_blocks) = bad;
        let attention = Some(AttentionShape { warps, mw, other, min_blocks });
        assert!(print_with(&k, "att", &PrintOptions { attention, ..PrintOptions::default() }).is_err(), "{bad:?}");
    }
}
