//! The CUDA device as a whole (the suites over `BRAID_DEVICE=cuda` check its results): what
//! only a real GPU shows, with the evidence printed (run with `--nocapture`).
//!
//! - Two independent chains on two streams overlap on the GPU: kernel start and end times from
//!   CUDA timing events, one stream against two.
//! - Pinned host-to-device and device-to-host copies: the bandwidth the cost model's offload
//!   figure stands for.
//! - Cached memory is released and the allocation retried before a read fails with out of
//!   memory; the device stays usable after it does.
//! - A small training program, for the disk cache of compiled kernels: its compile statistics
//!   are printed (run the binary twice with the same `BRAID_CUDA_CACHE`: the second run
//!   compiles nothing; `RUST_LOG=braid=debug` shows each disk hit).
//!
//! Without a GPU (or the CUDA libraries) every test prints `skipped: <reason>` and passes,
//! after checking that `Device::cuda` is a clear `Err`.

#![cfg(feature = "cuda")]

use braid::optim::Sgd;
use braid::prelude::*;
use braid_devices::cuda::{CudaBackend, KernelSpan};

/// Tests here take turns: one fills most of the GPU's memory, others time kernels.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A new CUDA device and this test's turn, or `None` after printing why the test is skipped.
fn gpu(test: &str) -> Option<(Device, std::sync::MutexGuard<'static, ()>)> {
    logging();
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    match Device::new_cuda(0) {
        Ok(d) => Some((d, turn)),
        Err(e) => {
            let why = e.to_string();
            assert!(why.contains("cuda:0"), "the error names the device: {why}");
            assert!(Device::cuda(0).is_err(), "Device::cuda agrees");
            eprintln!("skipped: {test}: {why}");
            None
        }
    }
}

/// Shows braid's events on stderr when `RUST_LOG` asks.
fn logging() {
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
}

fn backend(dev: &Device) -> &CudaBackend {
    braid::testing::backend::<CudaBackend>(dev).expect("a CUDA device")
}

/// Rows of a chain: few rows, so that each kernel (a row kernel, one block per row) leaves
/// most of the GPU to the other stream.
const ROWS: usize = 16;
const COLS: usize = 1 << 20;
const STEPS: usize = 8;

/// `STEPS` row kernels over `x`: each subtracts the row's maximum and exponentiates.
fn chain(x: &Tensor) -> Tensor {
    let mut h = x.clone();
    for _ in 0..STEPS {
        h = (&h - &h.max_dim(1, true)).exp();
    }
    h
}

/// Intervals of time, in microseconds.
type Intervals = Vec<(f64, f64)>;

/// The total length of the union of `spans`' intervals, and the union itself.
fn union(mut spans: Intervals) -> (f64, Intervals) {
    spans.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Intervals = Vec::new();
    for (s, e) in spans {
        match merged.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => merged.push((s, e)),
        }
    }
    (merged.iter().map(|(s, e)| e - s).sum(), merged)
}

/// Microseconds during which both unions run.
fn intersection(a: &[(f64, f64)], b: &[(f64, f64)]) -> f64 {
    let mut total = 0.0;
    for &(s1, e1) in a {
        for &(s2, e2) in b {
            total += (e1.min(e2) - s1.max(s2)).max(0.0);
        }
    }
    total
}

/// Runs both chains (on one stream or two) as one flush; returns the kernels' spans.
fn run_chains(dev: &Device, x: &Tensor, y: &Tensor, two: bool) -> Vec<KernelSpan> {
    let (sa, sb) =
        if two { (dev.new_stream(), dev.new_stream()) } else { (dev.default_stream(), dev.default_stream()) };
    backend(dev).take_timeline().unwrap();
    backend(dev).set_timeline(true);
    let a = sa.scope(|| chain(x));
    let b = sb.scope(|| chain(y));
    dev.sync().unwrap();
    backend(dev).set_timeline(false);
    let spans = backend(dev).take_timeline().unwrap();
    // The results are right, whatever the streams.
    for t in [&a, &b] {
        let top = t.max_dim(1, false).to_vec::<f32>().unwrap();
        assert!(top.iter().all(|&v| (v - 1.0).abs() < 1e-6), "{top:?}");
    }
    spans
}

#[test]
fn kernels_of_two_streams_overlap_on_the_gpu() {
    let Some((dev, _turn)) = gpu("kernels_of_two_streams_overlap_on_the_gpu") else { return };
    dev.seed(11);
    let x = Tensor::randn([ROWS, COLS], DType::F32, &dev);
    let y = Tensor::randn([ROWS, COLS], DType::F32, &dev);
    dev.sync().unwrap();
    // Compile everything first.
    run_chains(&dev, &x, &y, true);
    let mut report = Vec::new();
    for two in [false, true] {
        let spans = run_chains(&dev, &x, &y, two);
        let streams: Vec<u32> = {
            let mut s: Vec<u32> = spans.iter().map(|s| s.stream).collect();
            s.sort_unstable();
            s.dedup();
            s
        };
        let per_stream: Vec<(u32, (f64, Intervals))> = streams
            .iter()
            .map(|&st| (st, union(spans.iter().filter(|s| s.stream == st).map(|s| (s.start_us, s.end_us)).collect())))
            .collect();
        let busy: f64 = spans.iter().map(|s| s.end_us - s.start_us).sum();
        let makespan = spans.iter().map(|s| s.end_us).fold(0.0, f64::max);
        let overlap = if per_stream.len() == 2 { intersection(&per_stream[0].1.1, &per_stream[1].1.1) } else { 0.0 };
        println!(
            "overlap evidence: {} stream(s) {streams:?}: {} kernels, kernel time {busy:.0} us, GPU makespan {makespan:.0} \
             us, both streams running for {overlap:.0} us",
            if two { 2 } else { 1 },
            spans.len()
        );
        for s in spans.iter().take(6) {
            println!("  s{} {:>9.1} .. {:>9.1} us  {}", s.stream, s.start_us, s.end_us, s.label);
        }
        report.push((two, spans.len(), busy, makespan, overlap));
    }
    let (one, two) = (&report[0], &report[1]);
    assert!(one.4 == 0.0, "one stream: nothing overlaps");
    assert!(two.4 > 0.25 * two.3, "two streams: the chains overlap for {:.0} of {:.0} us", two.4, two.3);
    println!(
        "overlap evidence: makespan one stream {:.0} us, two streams {:.0} us ({:.2}x)",
        one.3,
        two.3,
        one.3 / two.3
    );
}

#[test]
fn pinned_copies_run_at_pcie_speed() {
    use braid_devices::cuda::{Event, Stream, memory};
    let Some((dev, _turn)) = gpu("pinned_copies_run_at_pcie_speed") else { return };
    let gpu = backend(&dev).gpu().clone();
    let bytes = 256usize << 20;
    let stream = Stream::new(&gpu).unwrap();
    let host = memory::alloc_host_chunk(&gpu, bytes as u64).unwrap();
    let device = memory::alloc_device_chunk(&gpu, bytes as u64).unwrap();
    let mut figures = Vec::new();
    for (name, dst, src) in [("host to device", device, host as u64), ("device to host", host as u64, device)] {
        let (start, end) = (Event::timing(&gpu).unwrap(), Event::timing(&gpu).unwrap());
        // SAFETY: both chunks hold `bytes` and live until after the synchronisation below.
        unsafe { memory::copy_async(dst, src, bytes, stream.raw()).unwrap() }; // warm up
        start.record(&stream).unwrap();
        for _ in 0..4 {
            // SAFETY: as above.
            unsafe { memory::copy_async(dst, src, bytes, stream.raw()).unwrap() };
        }
        end.record(&stream).unwrap();
        end.synchronize().unwrap();
        let secs = f64::from(end.elapsed_ms_since(&start).unwrap()) / 1e3;
        let gbps = 4.0 * bytes as f64 / secs / 1e9;
        println!("pinned copy {name}: {gbps:.1} GB/s");
        figures.push(gbps);
    }
    // SAFETY: nothing uses them any more (the frees wait for the GPU).
    unsafe {
        memory::free_device_chunk(&gpu, device).unwrap();
        memory::free_host_chunk(&gpu, host).unwrap();
    }
    let model = dev.target().cost.copy_bytes_per_sec / 1e9;
    println!("cost model offload bandwidth: {model:.1} GB/s");
    assert!(figures.iter().all(|&g| g > 2.0), "pinned copies are far too slow: {figures:?}");
}

#[test]
fn cached_memory_is_released_before_out_of_memory_and_the_device_stays_usable() {
    let Some((dev, _turn)) = gpu("cached_memory_is_released_before_out_of_memory_and_the_device_stays_usable") else {
        return;
    };
    let (free, _) = backend(&dev).gpu().memory_info().unwrap();
    // Two values that do not fit together: the second needs the first one's memory back.
    let first = (free as f64 * 0.45) as usize / 4;
    let second = (free as f64 * 0.55) as usize / 4;
    let a = Tensor::zeros([first], DType::F32, &dev) + 1.0;
    assert_eq!(a.narrow(0, first - 1, 1).item::<f32>().unwrap(), 1.0);
    drop(a);
    let b = Tensor::zeros([second], DType::F32, &dev) + 2.0;
    assert_eq!(b.narrow(0, second - 1, 1).item::<f32>().unwrap(), 2.0);
    // More than the GPU has: an error, and the device goes on.
    let c = Tensor::zeros([second], DType::F32, &dev) + 3.0;
    match c.sum().item::<f32>() {
        Err(Error::Device { source: braid_devices::DeviceError::OutOfMemory { .. }, .. }) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    drop((b, c));
    let d = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &dev);
    assert_eq!((&d * 2.0).sum().item::<f32>().unwrap(), 12.0);
    dev.sync().unwrap();
    assert_eq!(dev.memory().in_use, 64, "only d is live");
}

/// A small MLP trained for a few steps: the kernels a training program compiles.
#[test]
fn a_training_program_and_its_compiled_kernels() {
    let Some((dev, _turn)) = gpu("a_training_program_and_its_compiled_kernels") else { return };
    dev.seed(3);
    let x = Tensor::randn([256, 32], DType::F32, &dev);
    let mut params: Vec<Tensor> = [32, 64, 16]
        .windows(2)
        .map(|d| braid::no_grad(|| Tensor::randn([d[0], d[1]], DType::F32, &dev) * 0.2).requires_grad())
        .collect();
    let mut losses = Vec::new();
    for step in 0..5 {
        // The last step's kernels on the GPU: what small kernels take (the cost model's floor).
        backend(&dev).set_timeline(step == 4);
        let mut h = x.clone();
        for w in &params {
            h = h.matmul(w).tanh();
        }
        let loss = h.square().mean();
        let grads = loss.backward().unwrap();
        Sgd::new(0.5).step(&mut params, &grads);
        losses.push(loss.item::<f32>().unwrap());
    }
    assert!(losses.last() < losses.first(), "training lowers the loss: {losses:?}");
    backend(&dev).set_timeline(false);
    let mut spans = backend(&dev).take_timeline().unwrap();
    spans.sort_by(|a, b| a.start_us.total_cmp(&b.start_us));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let times = median(spans.iter().map(|s| s.end_us - s.start_us).collect());
    let gaps = median(spans.windows(2).map(|w| (w[1].start_us - w[0].end_us).max(0.0)).collect());
    let makespan = spans.last().map_or(0.0, |s| s.end_us);
    println!(
        "kernel floor evidence: a training step runs {} kernels in {makespan:.0} us on the GPU ({:.1} us each), \
         median kernel {times:.1} us, median gap {gaps:.1} us; cost model floor {:.1} us",
        spans.len(),
        makespan / spans.len().max(1) as f64,
        dev.target().cost.kernel_overhead_secs * 1e6
    );
    let stats = backend(&dev).compile_stats();
    println!(
        "cache evidence: compiled {} sources with NVRTC, {} from the disk cache, {} disk entries rejected (in memory: {})",
        stats.compiled, stats.disk_hits, stats.rejected, stats.memory_hits
    );
}

/// A language model's head in miniature: products over an odd width (rows of 601 elements are
/// not 16-byte aligned, which sends cuBLAS to kernels several times slower) large enough that
/// the CUDA device pads them (`devices/src/cuda/row_padding.rs`), with a batch of three
/// dimensions times a broadcast weight (folded into one product), under bf16 autocast and
/// through the backward (a padded copy of the gradient in both orientations): the logits and
/// both gradients agree with the CPU's within bf16's rounding.
#[test]
fn large_products_over_odd_widths_match_the_cpu() {
    let Some((dev, _turn)) = gpu("large_products_over_odd_widths_match_the_cpu") else { return };
    let cpu = Device::new_cpu();
    // 601 outputs through `matmul` (recorded padded to 608 on the GPU), and 2,601 through
    // `linear` (padded by the weight's rows; the gradient's padded copy has lines of 5,202
    // bytes at odd offsets, which the driver's 2-D copies move).
    for (outputs, linear) in [(601, false), (2601, true)] {
        let run = |d: &Device| {
            d.seed(7);
            let x = Tensor::randn([2, 512, 1000], DType::F32, d).requires_grad();
            let w = (Tensor::randn([outputs, 1000], DType::F32, d) * 0.03).detach().requires_grad();
            let r = Tensor::randn([2, 512, outputs], DType::F32, d);
            let logits =
                braid::amp::autocast(DType::BF16, || if linear { x.linear(&w, None) } else { x.matmul(&w.t()) });
            let grads = (&logits.to_dtype(DType::F32) * &r).sum().backward().unwrap();
            let logits = logits.to_dtype(DType::F32);
            [logits, grads.get(&x).unwrap(), grads.get(&w).unwrap()].map(|t| t.to_vec::<f32>().unwrap())
        };
        let (gpu_out, cpu_out) = (run(&dev), run(&cpu));
        for (name, (g, c)) in ["logits", "x's gradient", "w's gradient"].iter().zip(gpu_out.iter().zip(&cpu_out)) {
            let scale = c.iter().fold(0f32, |m, v| m.max(v.abs()));
            let worst = g.iter().zip(c).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(worst <= 2e-2 * scale, "{outputs} {name}: worst difference {worst} against values up to {scale}");
            println!("{outputs} outputs, {name}: worst difference {worst:.3e} against values up to {scale:.3e}");
        }
    }
}

/// A program that makes two new streams every step, each running a product, keeps a few CUDA
/// streams and cuBLAS handles (not two more of each, with 32 MiB of workspace, per step), and
/// its results stay right while the lanes pass from stream to stream.
#[test]
fn new_streams_every_step_reuse_a_few_cuda_streams() {
    let Some((dev, _turn)) = gpu("new_streams_every_step_reuse_a_few_cuda_streams") else { return };
    let cpu = Device::new_cpu();
    let setup = |d: &Device| {
        d.seed(11);
        (Tensor::randn([128, 128], DType::F32, d) * 0.1, Tensor::randn([128, 128], DType::F32, d))
    };
    let ((a, x), (ca, cx)) = (setup(&dev), setup(&cpu));
    let step = |a: &Tensor, x: &Tensor, d: &Device| {
        let (s1, s2) = (d.new_stream(), d.new_stream());
        let p = s1.scope(|| x.matmul(a).tanh().matmul(a));
        let q = s2.scope(|| (x * 0.5).matmul(a).sigmoid());
        (&p + &q).to_vec::<f32>().unwrap()
    };
    let expected = step(&ca, &cx, &cpu);
    for i in 0..40 {
        let got = step(&a, &x, &dev);
        let worst = got.iter().zip(&expected).fold(0f32, |m, (g, e)| m.max((g - e).abs()));
        assert!(worst < 1e-3, "step {i}: differs from the CPU by {worst}");
    }
    let (streams, handles) = backend(&dev).cuda_streams();
    assert!(streams <= 8 && handles <= 8, "80 braid streams kept {streams} CUDA streams and {handles} cuBLAS handles");
    println!("80 braid streams over 40 steps: {streams} CUDA streams, {handles} cuBLAS handles");
}

/// A step of two streams (a product and row reductions on one, an elementwise chain on the
/// other) returning two values.
fn two_stream_step(args: &[Tensor], side: &braid::Stream) -> Vec<Tensor> {
    let h = args[0].matmul(&args[1]).tanh();
    let g = side.scope(|| (&args[0] * 0.5).exp() - &args[0]);
    let r = &h - &h.max_dim(1, true);
    vec![&r + &g.sum_dim(1, true), (&g * &h).sum()]
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// `gpu(test)`, unless graphs are off (then the test says it skipped and why).
fn gpu_with_graphs(test: &str) -> Option<(Device, std::sync::MutexGuard<'static, ()>)> {
    let got = gpu(test)?;
    if std::env::var("BRAID_CUDA_GRAPHS").is_ok_and(|v| v.trim() == "0") {
        eprintln!("skipped: {test}: BRAID_CUDA_GRAPHS=0 turns graphs off");
        return None;
    }
    Some(got)
}

#[test]
fn replayed_steps_run_as_cuda_graphs() {
    let Some((dev, _turn)) = gpu_with_graphs("replayed_steps_run_as_cuda_graphs") else { return };
    dev.seed(11);
    let side = dev.new_stream();
    let step = braid::Step::new(|a: &[Tensor]| two_stream_step(a, &side));
    let w = Tensor::randn([64, 64], DType::F32, &dev);
    let before = backend(&dev).graph_launches();
    let mut held = Vec::new();
    for call in 0..6 {
        let x = Tensor::randn([32, 64], DType::F32, &dev);
        let out = step.call(&[x.clone(), w.clone()]).unwrap();
        let eager = two_stream_step(&[x, w.clone()], &side);
        let expected: Vec<Vec<u32>> = eager.iter().map(bits).collect();
        assert_eq!(out.iter().map(bits).collect::<Vec<_>>(), expected, "call {call}: a replay equals the eager run");
        held.push((out, expected));
        if call == 3 {
            // The cuBLAS workspaces go back: the graph is stale, the plan runs, and the next
            // replay records a new graph.
            dev.trim_memory();
        }
    }
    // Calls 1-3 and 5 launched a graph; call 4 ran the plan (its graph was stale).
    assert_eq!(backend(&dev).graph_launches() - before, 4, "graph launches");
    // Every launch gave fresh outputs: the ones held from earlier calls were not overwritten.
    for (call, (out, expected)) in held.iter().enumerate() {
        assert_eq!(&out.iter().map(bits).collect::<Vec<_>>(), expected, "call {call}'s outputs, read later");
    }
    drop(held);
    let in_use = dev.memory().in_use;
    drop(step);
    let freed = in_use - dev.memory().in_use;
    println!("graph evidence: 4 of 6 calls launched a CUDA graph; dropping the step freed {freed} bytes it held");
    assert!(freed > 0, "the graph's memory is given back with the step");
}

#[test]
fn cuda_graphs_read_arguments_passed_again_in_place() {
    let Some((dev, _turn)) = gpu_with_graphs("cuda_graphs_read_arguments_passed_again_in_place") else { return };
    dev.seed(12);
    let f = |a: &[Tensor]| vec![a[0].matmul(&a[1]).tanh(), a[1].sum()];
    let step = braid::Step::new(f);
    // A weight of 16 MiB, the same tensor at every call: the graph reads it where it is.
    let w = Tensor::randn([2048, 2048], DType::F32, &dev);
    let before = backend(&dev).graph_launches();
    for call in 0..6 {
        if call == 3 {
            // A new version (a new buffer: the graph holds the old one): the graph is recorded
            // again, at the call after, with the new buffer.
            braid::no_grad(|| w.add_assign(&Tensor::full([2048, 2048], 0.25, DType::F32, &dev)));
        }
        let x = Tensor::randn([4, 2048], DType::F32, &dev);
        let out = step.call(&[x.clone(), w.clone()]).unwrap();
        let eager = f(&[x, w.clone()]);
        assert_eq!(out.iter().map(bits).collect::<Vec<_>>(), eager.iter().map(bits).collect::<Vec<_>>(), "call {call}");
    }
    // Calls 1, 2, 4 and 5 launched a graph; call 3 (another buffer for the weight) ran the plan.
    assert_eq!(backend(&dev).graph_launches() - before, 4, "graph launches");
}

#[test]
fn kernels_of_thousands_of_buffers_are_split_to_fit_the_parameter_space() {
    // 4,200 kept values of one input would be one horizontally fused kernel, and their cat one
    // kernel of 4,201 buffers: more device addresses than kernel parameters hold (32 KiB since
    // CUDA 12.1 on Volta and later, 4 KiB before). Each is split into kernels of at most 511.
    let Some((gpu, _turn)) = gpu("kernels_of_thousands_of_buffers_are_split_to_fit_the_parameter_space") else {
        return;
    };
    let cpu = Device::new_cpu();
    let run = |d: &Device| {
        let x = Tensor::from_vec((0..8).map(|i| i as f32 * 0.5 - 2.0).collect(), [8], d);
        let scaled: Vec<Tensor> = (0..4200).map(|i| &x * (i % 7) as f64).collect();
        let joined = Tensor::cat(&scaled.iter().collect::<Vec<_>>(), 0).to_vec::<f32>().unwrap();
        let kernels = d.last_schedule().unwrap().kernel_count();
        (joined, scaled[4199].to_vec::<f32>().unwrap(), kernels)
    };
    // Multiples of halves: exact on both devices.
    let (want, got) = (run(&cpu), run(&gpu));
    assert_eq!((&got.0, &got.1), (&want.0, &want.1));
    // At least 9 kernels of products (4,200 outputs, 510 a kernel) and 9 of cat pieces.
    assert!(got.2 >= 18, "{} kernels", got.2);
    println!(
        "4,200 outputs of one input and a cat of 4,200 parts: {} kernels",
        gpu.last_schedule().unwrap().kernel_count()
    );
}

#[test]
fn a_chain_of_twenty_thousand_ops_runs_as_kernels_of_bounded_size() {
    // One fused kernel of 20,000 nodes overflowed the stack of the CUDA printer (a process
    // abort) and would take NVRTC minutes; kernels hold at most 512 nodes, as on wgpu.
    let Some((gpu, _turn)) = gpu("a_chain_of_twenty_thousand_ops_runs_as_kernels_of_bounded_size") else {
        return;
    };
    let cpu = Device::new_cpu();
    let run = |d: &Device| {
        let mut x = Tensor::from_vec((0..64).map(|i| i as f32 * 0.25 - 8.0).collect(), [64], d);
        for i in 0..20_000 {
            x = if i % 2 == 0 { &x + 1.0 } else { &x * 0.5 };
        }
        let started = std::time::Instant::now();
        let values = x.to_vec::<f32>().unwrap();
        (values, started.elapsed())
    };
    let (want, got) = (run(&cpu), run(&gpu));
    // x -> (x + 1) / 2 converges to 1; every step is exact in f32 until it rounds the same way
    // on both devices (one add, one multiply by a power of two).
    assert_eq!(got.0, want.0);
    println!("20,000 ops: {:.2?} on the GPU (first read, compiles included), {:.2?} on the CPU", got.1, want.1);
}
