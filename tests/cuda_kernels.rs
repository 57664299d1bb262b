//! Printed CUDA kernels on a real GPU against the CPU runner: random kernels from the printer
//! test's generators (`cuda_printer/cases.rs`) are compiled by NVRTC, run through
//! `braid_devices::cuda::run_kernel_on_gpu_with` (cuBLAS for float matrix products), and compared
//! with `braid_devices::cpu::run_kernel` on the same random inputs (never all zeros). Row
//! kernels run at every block size from 1 thread to the printed one (rows short enough to keep
//! their loads in shared memory between phases, rows just too long for that, and long rows
//! among few rows, split into segments; long rows, of a million elements and more, at every
//! block size the printer emits: 32 to 256; their float inputs in f64, see `long_rows_...`),
//! so the combines of the reductions (warp shuffles, one entry per warp in shared memory) and the
//! split passes are exercised for real. Even cases place their arguments at aligned addresses
//! (kernels with vector paths take them, as in the engine, whose buffers are aligned), odd
//! cases 8 bytes past (their scalar paths run).
//!
//! Tolerances (those of `tests/cuda_printer.rs`): integers and bools exactly, floats bit for bit
//! (NaN equals NaN) unless derived from a transcendental function (CUDA's `exp`, `log`, `sin`,
//! `cos`, `tanh`, `pow` and the normal variates that use them are within a few ulps of the
//! CPU's), a float sum (another order) or a float matrix product (cuBLAS's order): those within
//! 1e-5 relative or 4 ulps of their storage type, whichever is looser; relative to at least 1
//! for row kernels (for `x - mean`) and, for matrix products, to at least `k` times the largest
//! operand magnitudes (the scale of the dot product's terms, against cancellation), plus, where
//! an epilogue reads the product, two ulps of the product's dtype relative to the value (the
//! product is rounded to its dtype first: an f16 or bf16 product summed in another order can
//! round to its neighbour).
//!
//! Gathers and scatter-adds (`cuda_printer/gathers.rs`, `cuda_printer/scatters.rs`) must
//! match the CPU byte for byte.
//!
//! The disk cache of compiled kernels is tested twice: its validation (truncated, corrupt and
//! foreign entries) on any machine, and compile/hit/recompile on a GPU.
//!
//! Without a GPU, NVRTC or cuBLAS, the GPU tests print `skipped: <reason>` and pass.
//! `BRAID_CUDA_TEST_QUICK=1` runs fewer and smaller cases (for compute-sanitizer runs).

// The printer test's generators (its small float products start from the CPU's product).
#[allow(dead_code)]
#[path = "cuda_printer/cases.rs"]
mod cases;
mod common;
#[path = "cuda_printer/gathers.rs"]
mod gathers;
#[path = "cuda_printer/quant_cases.rs"]
mod quant_cases;
#[path = "cuda_printer/scatters.rs"]
mod scatters;
// Kernels printed with the tuner's other options (splits, vector widths).
#[path = "cuda_printer/printed_variants.rs"]
mod printed_variants;
#[path = "cuda_printer/warps.rs"]
mod warps;

use braid_devices::DeviceError;
use braid_devices::cpu::run_kernel;
use braid_devices::cuda::disk_cache::{DiskCache, EntryKey, Lookup};
use braid_devices::cuda::{Compiler, Harness, LaunchOptions, run_compiled_on_gpu, run_kernel_on_gpu_with};
use braid_graph::DType;
use braid_graph::expr::{Expr, ExprOp};
use braid_lowering::cuda::{self, Launch};
use braid_lowering::{Body, Kernel, Store};
use cases::*;
use common::Rng;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

fn quick() -> bool {
    std::env::var_os("BRAID_CUDA_TEST_QUICK").is_some()
}

/// Runs `k` on the CPU over copies of `init`; returns every argument's bytes after.
fn run_cpu(k: &Kernel, init: &[Vec<u8>]) -> Vec<Vec<u8>> {
    run_on_copies(k, init, |args| run_kernel(k, args)).unwrap_or_else(|e| panic!("the CPU rejects a kernel: {e}"))
}

/// Per argument: whether its values may differ from the CPU's by rounding; the magnitude
/// below which differences are measured absolutely; and the relative difference a float
/// product's own rounding allows (see the module docs).
fn tolerance(case: &Case) -> (Vec<bool>, f64, f64) {
    let k = &case.kernel;
    let mut approx = vec![false; k.args.len() + 1];
    // Marks the arguments whose stores depend on an approximate node (or a `tainted` one).
    fn mark(approx: &mut [bool], expr: &Expr, stores: &[Store], tainted: &dyn Fn(usize) -> bool) {
        let mut t = approximate(expr, MathLib::Cuda);
        for (i, n) in expr.nodes.iter().enumerate() {
            t[i] |= tainted(i) || n.op.operands().iter().any(|&o| t[o]);
        }
        stores.iter().for_each(|s| approx[s.arg as usize] |= t[s.value as usize]);
    }
    match &k.body {
        // Gathers move bits; scatter-adds fold each sum in the CPU's order.
        Body::Gather(_) | Body::Scatter(_) | Body::ScatterWrite(_) => return (approx, 0.0, 0.0),
        Body::Attention(_) => unreachable!("the generators make no attention kernels (tests/attention.rs checks them)"),
        Body::Map(loops) => loops.iter().for_each(|l| mark(&mut approx, &l.expr, &l.stores, &|_| false)),
        Body::Rows(r) => {
            mark(&mut approx, &r.expr, &r.stores, &|_| false);
            return (approx, 1.0, 0.0);
        }
        Body::Matmul(m) => {
            if !m.dtype.is_float() {
                return (approx, 0.0, 0.0);
            }
            approx[m.product as usize] = true;
            if let Some(e) = &m.epilogue {
                let reads_product =
                    |i: usize| matches!(e.expr.nodes[i].op, ExprOp::Load(s) if e.loads[s as usize].arg == m.product);
                mark(&mut approx, &e.expr, &e.stores, &reads_product);
            }
            let largest = |a: u16| {
                let (d, b) = (k.args[a as usize].dtype, &case.init[a as usize]);
                (0..b.len() / d.size()).filter_map(|i| element(d, b, i).ok()).fold(0f64, |acc, v| acc.max(v.abs()))
            };
            // The product is rounded to its dtype before the epilogue reads it: sums in another
            // order can round to a neighbouring value, an ulp of the product's dtype apart
            // (2 epsilon relative; twice that, for an epilogue that adds a bias of the other
            // sign). A bf16 product of 36.33 on the CPU was 36.08 through cuBLAS.
            let rounding = if m.epilogue.is_some() { 4.0 * m.dtype.epsilon() } else { 0.0 };
            return (approx, m.k as f64 * largest(m.lhs.arg) * largest(m.rhs.arg), rounding);
        }
        Body::QuantMatmul(q) => {
            approx[q.product as usize] = true;
            if let Some(e) = &q.epilogue {
                let reads_product =
                    |i: usize| matches!(e.expr.nodes[i].op, ExprOp::Load(s) if e.loads[s as usize].arg == q.product);
                mark(&mut approx, &e.expr, &e.stores, &reads_product);
            }
            let (d, x) = (k.args[q.lhs.arg as usize].dtype, &case.init[q.lhs.arg as usize]);
            let largest_x =
                (0..x.len() / d.size()).filter_map(|i| element(d, x, i).ok()).fold(0f64, |a, v| a.max(v.abs()));
            let w = q.layout.dequantize(&case.init[q.weight as usize]);
            let largest_w = w.iter().fold(0f64, |a, v| a.max(v.abs() as f64));
            // Sums in another order (the scales applied to partial sums), then one rounding
            // to the product's dtype, which may land an ulp away (and an epilogue's bias).
            return (approx, q.layout.k as f64 * largest_x * largest_w, 4.0 * q.dtype.epsilon());
        }
        Body::Collective(_) | Body::Quantize(_) => unreachable!("the generators make no collectives or quantizations"),
    }
    (approx, 0.0, 0.0)
}

/// The first difference between the GPU's arguments after the run and the CPU's, if any.
fn compare(case: &Case, cpu: &[Vec<u8>], gpu: &[Vec<u8>]) -> Option<String> {
    if matches!(case.kernel.body, Body::Gather(_) | Body::Scatter(_)) {
        // Byte for byte (a gather's NaN payloads included), the arguments one after another.
        let offsets: Vec<usize> = (0..gpu.len()).map(|a| gpu[..a].iter().map(Vec::len).sum()).collect();
        return gathers::differ(case, &offsets, cpu, &gpu.concat());
    }
    let (approx, floor, rounding) = tolerance(case);
    for a in case.kernel.inputs..case.kernel.args.len() {
        let d = case.kernel.args[a].dtype;
        for e in 0..case.kernel.args[a].len {
            let (w, g) = (element(d, &cpu[a], e), element(d, &gpu[a], e));
            let ok = match (w, g) {
                (Ok(w), Ok(g)) if w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan()) => true,
                (Ok(w), Ok(g)) => {
                    let tol = 1e-5f64.max(8.0 * d.epsilon());
                    let scale = w.abs().max(g.abs());
                    approx[a] && (w - g).abs() <= tol * scale.max(floor) + rounding * scale
                }
                (w, g) => w == g,
            };
            if !ok {
                return Some(format!("{}: argument a{a} ({d}) element {e}: cpu {w:?}, gpu {g:?}", case.label));
            }
        }
    }
    None
}

/// Runs every case on the GPU (row kernels at each block size `blocks` allows, from the
/// printed one down) and compares it with the CPU; panics naming the differences.
fn check_cases(h: &Harness, what: &str, cases: &[Case], blocks: impl Fn(&Case, u32) -> Vec<u32>) {
    let start = std::time::Instant::now();
    let (mut failures, mut runs) = (vec![], 0);
    for (n, case) in cases.iter().enumerate() {
        // Odd cases place their arguments 8 bytes past aligned addresses: kernels with vector
        // paths take their scalar paths there.
        let skew = if n % 2 == 1 { 8 } else { 0 };
        let mut init = case.init.clone();
        let cpu = run_cpu(&case.kernel, &init);
        case.from_cpu.iter().for_each(|&a| init[a] = cpu[a].clone());
        let printed = cuda::print(&case.kernel, "k").unwrap_or_else(|e| panic!("{}: {e}", case.label));
        let threads = printed.entries.iter().find_map(|e| match e.launch {
            Launch::Rows { threads, .. } => Some(threads),
            Launch::Map { .. } | Launch::Copy { .. } | Launch::Tiles { .. } => None,
        });
        let sizes: Vec<Option<u32>> = match threads {
            Some(t) => blocks(case, t).into_iter().map(Some).collect(),
            None => vec![None],
        };
        for (i, row_threads) in sizes.into_iter().enumerate() {
            let mut args = init.clone();
            runs += 1;
            // Map loops under the tuner's launch variants too (`devices/src/cuda/tune.rs`):
            // blocks of 128 to 512 threads, grids of 4 to 32 blocks a multiprocessor.
            let (map_block, per_sm) =
                [(None, None), (Some(128), Some(4)), (Some(512), Some(8)), (Some(256), Some(16))][(n + i) % 4];
            let options =
                LaunchOptions { row_threads, skew, map_block, map_blocks_per_sm: per_sm, printed: 0, blas_algo: 0 };
            let r = run_kernel_on_gpu_with(h, &case.kernel, &mut args, options);
            let failure = match r {
                Err(e) => Some(format!("{} ({options:?}): {e}", case.label)),
                Ok(()) => compare(case, &cpu, &args).map(|f| format!("{f} ({options:?})")),
            };
            if let Some(f) = failure {
                if failures.len() < 3 {
                    eprintln!("--- {}\n{:#?}\n{}", case.label, case.kernel, printed.source);
                }
                failures.push(f);
                break;
            }
        }
    }
    eprintln!("{what}: {} kernels, {runs} GPU runs in {:.2?}", cases.len(), start.elapsed());
    assert!(
        failures.is_empty(),
        "{what}: {} of {} kernels differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

/// Every power of two from `lo` to `threads`.
fn powers(lo: u32, threads: u32) -> Vec<u32> {
    (0..=8).map(|p| 1 << p).filter(|&t| t >= lo && t <= threads).collect()
}

#[test]
fn opening_a_missing_gpu_is_an_error_not_a_panic() {
    let e = braid_devices::cuda::Gpu::open(1 << 20).unwrap_err();
    let DeviceError::Unavailable(why) = e else { panic!("not Unavailable: {e}") };
    assert!(why.contains("libcuda") || why.contains("no CUDA GPU 1048576"), "{why}");
    if let Ok(n) = braid_devices::cuda::device_count() {
        assert!(why.contains(&format!("{n} GPU")) || n == 0, "{why}");
    }
}

#[test]
fn map_loops_concatenations_and_edges_match_the_cpu() {
    let Some(h) = common::cuda_harness("map loops") else { return };
    let mut rng = Rng::new(0x6A9);
    let mut cases = vec![edges_case()];
    let n = if quick() { 40 } else { 300 };
    cases.extend((0..n).map(|i| map_case(&mut rng, i, MathLib::Cuda)));
    cases.extend((0..12).map(|i| concat_case(&mut rng, i)));
    let big: &[&[usize]] =
        if quick() { &[&[70_001]] } else { &[&[1000, 37], &[1 << 20], &[7, 300, 5], &[3, 1, 65_537]] };
    for (i, dims) in big.iter().enumerate() {
        cases.extend((0..3).map(|j| map_case_over(&mut rng, 1000 + 3 * i + j, dims, MathLib::Cuda)));
    }
    check_cases(&h, "map loops", &cases, |_, _| vec![]);
}

#[test]
fn row_kernels_match_the_cpu_at_every_block_size() {
    let Some(h) = common::cuda_harness("row kernels") else { return };
    let mut rng = Rng::new(0x20_55);
    let n = if quick() { 40 } else { 150 };
    let mut cases: Vec<Case> = (0..n).map(|i| rows_case(&mut rng, i, MathLib::Cuda)).collect();
    cases.push(warps::warps_case());
    let lengths: &[usize] = if quick() {
        &[1, 33, 257, 4097, 8192]
    } else {
        &[1, 2, 31, 32, 33, 100, 255, 256, 257, 1000, 4097, 8192, 8193, 70_001]
    };
    // Few rows (fewer than `cuda::SPLIT_BELOW_ROWS`): up to 8191 elements one block per row,
    // longer ones split into segments through scratch memory.
    for &len in lengths {
        let shapes: [(Vec<usize>, Option<usize>); 4] =
            [(vec![3, len], Some(1)), (vec![len, 3], Some(0)), (vec![2, len, 2], Some(1)), (vec![len], None)];
        for (dims, axis) in shapes {
            let specials = len <= 256;
            cases.push(rows_case_over(&mut rng, cases.len(), &dims, axis, MathLib::Cuda, specials));
        }
    }
    // Enough rows not to split: rows kept in shared memory between phases (`cuda::ROW_KEEP_BYTES`:
    // up to 8192 elements of 4 bytes, 4096 of 8) and rows one element over, which each phase
    // reads from global memory.
    let edges: &[usize] = if quick() { &[8192, 8193] } else { &[4096, 4097, 8192, 8193] };
    for &len in edges {
        let rows = cuda::SPLIT_BELOW_ROWS;
        for (dims, axis) in [(vec![rows, len], Some(1)), (vec![len, rows], Some(0))] {
            cases.push(rows_case_over(&mut rng, cases.len(), &dims, axis, MathLib::Cuda, false));
        }
    }
    // Rows too long to keep at odd strides: each row's chunks start at its own head.
    cases.extend(peeled_row_cases(&mut Rng::new(0xC4C5), cases.len(), MathLib::Cuda));
    // Many short rows: several a block, a segment of a warp's lanes each.
    cases.extend(short_row_cases(&mut Rng::new(0x5407), cases.len(), MathLib::Cuda));
    check_cases(&h, "row kernels", &cases, |_, threads| powers(1, threads));
}

#[test]
fn long_rows_and_whole_tensor_reductions_match_the_cpu() {
    let Some(h) = common::cuda_harness("long rows") else { return };
    let mut rng = Rng::new(0x10_0000);
    let shapes: Vec<(Vec<usize>, Option<usize>)> = if quick() {
        vec![(vec![1 << 20], None)]
    } else {
        vec![
            (vec![1 << 20], None),
            (vec![1024, 1025], None),
            (vec![3, 2, 200_000], None),
            (vec![1 << 20, 2], Some(0)),
            (vec![2, 3, 400_000], Some(2)),
            (vec![1100, 1000], Some(1)),
            (vec![1000, 1100], Some(0)),
            (vec![256, 40_000], Some(1)),
            // Few long columns: a column kernel split into 39 segments through scratch memory.
            (vec![20_000, 64], Some(0)),
        ]
    };
    // Float inputs in f64 only: the CPU's f32 sums of a million elements are off by up to
    // about 1e-3 (summed one by one, a running sum of similar values rounds the same way each
    // time; the GPU's compensated sums are exact to a few ulps, which the first run on an H100
    // showed: a mean of 2^20 copies of -2.39453125 is -2.39998 on the CPU), so in f32 the
    // reference, not the kernel, would miss the tolerance.
    let mut cases = vec![];
    for (dims, axis) in &shapes {
        while cases.len() % 3 != 0
            || cases.iter().filter(|c: &&Case| c.label.contains(&format!("{dims:?}"))).count() < 3
        {
            let case = rows_case_over(&mut rng, cases.len(), dims, *axis, MathLib::Cuda, false);
            if case.kernel.args[0].dtype.compute() != DType::F32 {
                cases.push(case);
            }
        }
    }
    check_cases(&h, "long rows", &cases, |_, threads| powers(32, threads));
}

#[test]
fn matrix_products_match_the_cpu() {
    let Some(h) = common::cuda_harness("matrix products") else { return };
    let mut rng = Rng::new(0x3A7);
    let mut cases = vec![];
    let dtypes = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8];
    let n = if quick() { 20 } else { 120 };
    for i in 0..n {
        let dtype = dtypes[i % dtypes.len()];
        let dim = |rng: &mut Rng| 1 + rng.below(17);
        let (m, k, nn) = (dim(&mut rng), if i % 29 == 0 { 0 } else { dim(&mut rng) }, dim(&mut rng));
        let epilogue = rng.chance(0.7);
        let scratch = epilogue && rng.chance(0.5);
        let spec = MatmulSpec { dtype, batches: 1 + rng.below(4), m, k, n: nn, scratch, epilogue };
        cases.push(matmul_case_over(&mut rng, i, spec));
    }
    if !quick() {
        for (i, &dtype) in dtypes.iter().enumerate() {
            let spec = MatmulSpec { dtype, batches: 3, m: 64, k: 300, n: 48, scratch: i % 2 == 0, epilogue: true };
            cases.push(matmul_case_over(&mut rng, 1000 + i, spec));
        }
    }
    // Products large enough for padded rows (`devices/src/cuda/row_padding.rs`: over 2^30
    // FLOPs, rows not 16-byte aligned): operands copied into padded rows, the product computed
    // into padded scratch rows, read by the epilogue or copied into its argument.
    let large = [(DType::BF16, 1, true, true), (DType::F32, 1, false, true), (DType::F16, 2, false, false)];
    for (i, &(dtype, batches, scratch, epilogue)) in large.iter().enumerate() {
        let m = 1024 / batches;
        let spec = MatmulSpec { dtype, batches, m, k: 1001, n: 523, scratch, epilogue };
        cases.push(matmul_case_over(&mut rng, 2000 + i, spec));
    }
    check_cases(&h, "matrix products", &cases, |_, _| vec![]);
}

#[test]
fn quantized_products_match_the_cpu() {
    use braid_graph::{QuantLayout, Scheme};
    let mut rng = Rng::new(0x9A47);
    let mut cases: Vec<Case> =
        (0..if quick() { 20 } else { 60 }).map(|n| quant_cases::quant_case(&mut rng, n).0).collect();
    // Serving's shapes: one to sixteen rows (the few-rows path, vector loads of the inputs)
    // and more (the tiled path) over long rows of weights.
    let int4 = |group| Scheme::Int4 { group };
    let shapes = [
        (DType::BF16, int4(32), DType::F16, 1, 4096, 256),
        (DType::BF16, Scheme::Int8, DType::F16, 1, 4096, 96),
        (DType::F32, int4(128), DType::F32, 8, 1024, 200),
        (DType::F16, Scheme::Int8, DType::F32, 16, 768, 130),
        (DType::BF16, int4(64), DType::F16, 17, 768, 70),
        (DType::BF16, Scheme::Int8, DType::F16, 130, 1001, 65),
    ];
    for (i, &(d, scheme, scale, m, k, n)) in shapes.iter().enumerate() {
        let layout = QuantLayout::new(scheme, k, n, scale).unwrap();
        cases.push(quant_cases::quant_case_of(&mut rng, 1000 + i, d, layout, m).0);
    }
    let Some(h) = common::cuda_harness("quantized products") else { return };
    check_cases(&h, "quantized products", &cases, |_, _| vec![]);
}

#[test]
fn gathers_and_scatter_adds_match_the_cpu_bit_for_bit() {
    // Generated first, so that their coverage is checked on any machine (quick runs too: at
    // fewer cases, some seeds miss a corner).
    let mut rng = Rng::new(0x6A7E);
    let n = if quick() { 100 } else { 300 };
    let mut cases = gathers::gather_cases(&mut rng, n);
    cases.extend(scatters::scatter_cases(&mut rng, n));
    cases.extend(scatters::scatter_write_cases(&mut Rng::new(0x5CA7), n));
    let Some(h) = common::cuda_harness("gathers and scatter-adds") else { return };
    check_cases(&h, "gathers and scatter-adds", &cases, |_, _| vec![]);
}

/// Collects formatted tracing events (the library installs no subscriber; a test may).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// Runs `f` with this thread's tracing events (debug and up) written into the returned text.
fn capture<T>(f: impl FnOnce() -> T) -> (T, String) {
    let out = Captured::default();
    let sink = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let r = tracing::subscriber::with_default(subscriber, f);
    (r, out.text())
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid_cuda_cache_{name}_{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn key(source: &str) -> EntryKey {
    EntryKey {
        source: source.into(),
        arch: "sm_90".into(),
        options: vec!["--fmad=false".into()],
        nvrtc_version: [13, 0],
        driver_version: 13000,
        braid_version: "0.1.0".into(),
    }
}

#[test]
fn the_disk_cache_trusts_only_valid_entries_of_their_own_key() {
    let cache = DiskCache::open(temp_dir("validation")).unwrap();
    let (a, b) = (key("kernel a"), key("kernel b"));
    let image: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
    assert!(matches!(cache.load(&a), Lookup::Miss));
    cache.store(&a, &image).unwrap();
    assert!(matches!(cache.load(&a), Lookup::Hit(i) if i == image));
    // Another key's file copied over: bytecheck passes, the key does not.
    std::fs::copy(cache.path(&a), cache.path(&b)).unwrap();
    assert!(matches!(cache.load(&b), Lookup::Rejected(why) if why.contains("another kernel")));
    // A driver update is another key too.
    let newer = EntryKey { driver_version: 13010, ..a.clone() };
    std::fs::copy(cache.path(&a), cache.path(&newer)).unwrap();
    assert!(matches!(cache.load(&newer), Lookup::Rejected(_)));
    // Truncated at every length that matters: never trusted.
    let whole = std::fs::read(cache.path(&a)).unwrap();
    for len in [0, 1, 8, whole.len() / 2, whole.len() - 1] {
        std::fs::write(cache.path(&a), &whole[..len]).unwrap();
        assert!(matches!(cache.load(&a), Lookup::Rejected(_)), "truncated to {len} of {} bytes", whole.len());
    }
    // One flipped byte in the image: the checksum catches it.
    let mut flipped = whole.clone();
    let at = whole.windows(16).position(|w| w == &image[1000..1016]).unwrap();
    flipped[at] ^= 0x40;
    std::fs::write(cache.path(&a), &flipped).unwrap();
    assert!(matches!(cache.load(&a), Lookup::Rejected(why) if why.contains("checksum")));
    // Rewritten, it is trusted again; no temporary files are left behind.
    cache.store(&a, &image).unwrap();
    assert!(matches!(cache.load(&a), Lookup::Hit(i) if i == image));
    let names: Vec<String> = std::fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| n.ends_with(".rkyv")), "{names:?}");
    let _ = std::fs::remove_dir_all(cache.dir());
}

#[test]
fn compiled_kernels_come_back_from_disk_and_bad_entries_are_recompiled() {
    let Some(h) = common::cuda_harness("disk cache") else { return };
    let dir = temp_dir("gpu");
    let mut rng = Rng::new(0xD15C);
    let (ka, kb) = (map_case(&mut rng, 0, MathLib::Cuda), rows_case(&mut rng, 1, MathLib::Cuda));
    let fresh = || Compiler::with_cache(&h.gpu, Some(DiskCache::open(&dir).unwrap())).unwrap();
    let first = fresh();
    first.kernel(&ka.kernel).unwrap();
    first.kernel(&kb.kernel).unwrap();
    assert_eq!((first.stats().compiled, first.stats().disk_hits), (2, 0));
    // A new process (a new compiler): both from disk, nothing compiled, the hit logged.
    let second = fresh();
    let (r, log) = capture(|| second.kernel(&ka.kernel));
    let compiled = r.unwrap();
    assert_eq!((second.stats().compiled, second.stats().disk_hits), (0, 1), "{log}");
    assert!(log.contains("disk cache hit") && log.contains("braid::cuda"), "{log}");
    // The image from disk computes what the CPU computes.
    let mut args = ka.init.clone();
    run_compiled_on_gpu(&h, &compiled, &mut args, LaunchOptions::default()).unwrap();
    assert_eq!(compare(&ka, &run_cpu(&ka.kernel, &ka.init), &args), None);
    // Truncated: recompiled, with a warning, and the entry repaired.
    let source_a = cuda::print(&ka.kernel, "braid").unwrap().source;
    let path_a = first.disk_cache().unwrap().path(&first.key(&source_a));
    let bytes = std::fs::read(&path_a).unwrap();
    std::fs::write(&path_a, &bytes[..bytes.len() / 2]).unwrap();
    let third = fresh();
    let (r, log) = capture(|| third.kernel(&ka.kernel));
    r.unwrap();
    assert_eq!((third.stats().compiled, third.stats().rejected), (1, 1), "{log}");
    assert!(log.contains("WARN") && log.contains("not trusted"), "{log}");
    let fifth = fresh();
    fifth.kernel(&ka.kernel).unwrap();
    assert_eq!((fifth.stats().compiled, fifth.stats().disk_hits), (0, 1), "the entry was rewritten");
    // A foreign entry (another kernel's file under this kernel's name): not trusted.
    let source_b = cuda::print(&kb.kernel, "braid").unwrap().source;
    let path_b = first.disk_cache().unwrap().path(&first.key(&source_b));
    std::fs::copy(&path_a, &path_b).unwrap();
    let fourth = fresh();
    let (r, log) = capture(|| fourth.kernel(&kb.kernel));
    let compiled = r.unwrap();
    assert_eq!((fourth.stats().compiled, fourth.stats().rejected, fourth.stats().disk_hits), (1, 1, 0), "{log}");
    assert!(log.contains("another kernel"), "{log}");
    let mut args = kb.init.clone();
    run_compiled_on_gpu(&h, &compiled, &mut args, LaunchOptions::default()).unwrap();
    assert_eq!(compare(&kb, &run_cpu(&kb.kernel, &kb.init), &args), None);
    let _ = std::fs::remove_dir_all(&dir);
}
