//! The wgpu device (`Device::new_wgpu`) on the first adapter (lavapipe in CI): what only it
//! has. Its target comes from the adapter's limits; f64 and i64 are refused at the recording
//! line (WGSL has neither; they are not emulated); memory statistics are the pool's; a buffer
//! beyond the adapter's binding limit is `OutOfMemory` and the device goes on working; values
//! move to and from the CPU; with no adapter on the backends asked for, the error names them.
//! The integration and property suites run on it with `BRAID_DEVICE=wgpu`. Without an adapter
//! each test prints `skipped: <reason>` and passes.

use braid::prelude::*;
use std::panic::{AssertUnwindSafe, catch_unwind};

/// A fresh wgpu device, or `None` (printing why) without an adapter.
fn wgpu() -> Option<Device> {
    match Device::new_wgpu() {
        Ok(d) => Some(d),
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

fn panic_message(f: impl FnOnce()) -> String {
    let err = catch_unwind(AssertUnwindSafe(f)).expect_err("expected a misuse panic");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

#[test]
fn the_target_comes_from_the_adapter() {
    let Some(dev) = wgpu() else { return };
    let backend = braid::testing::backend::<braid_devices::wgpu::WgpuBackend>(&dev).expect("a wgpu device");
    let ctx = backend.context();
    println!("adapter: {}", ctx.describe());
    let t = dev.target();
    assert_eq!(t.name, "wgpu");
    // Storage buffers a kernel may bind: the stage's limit, and one less than the stage's
    // limit on all buffers (the kernel's uniform counts there; 29 on Metal).
    let storage = ctx.features.max_storage_buffers_per_stage as usize;
    assert!(storage <= ctx.limits.max_storage_buffers_per_shader_stage as usize);
    assert!(storage < ctx.limits.max_buffers_and_acceleration_structures_per_shader_stage as usize);
    assert_eq!(t.max_kernel_inputs, storage.saturating_sub(8).clamp(1, 16));
    assert_eq!(t.max_kernel_buffers, storage - 1, "one binding is kept for a kernel's scratch");
    for d in [DType::F32, DType::F16, DType::BF16, DType::I32, DType::U8, DType::Bool] {
        assert!(t.dtypes.contains(d), "{d}");
    }
    for d in [DType::F64, DType::I64] {
        assert!(!t.dtypes.contains(d), "{d} is not emulated");
    }
    assert_eq!(t.memory, braid_graph::MemoryKind::Device);
    assert!(t.cost.allocation_granularity >= 64);
}

#[test]
fn f64_and_i64_are_refused_at_the_recording_line() {
    let Some(dev) = wgpu() else { return };
    let line = line!() + 1;
    let msg = panic_message(|| drop(Tensor::zeros([2], DType::F64, &dev)));
    for part in ["f64", "wgpu", &format!("{}:{line}:", file!())] {
        assert!(msg.contains(part), "message should mention {part:?}:\n{msg}");
    }
    let x = Tensor::from_vec(vec![1.0f32, 3.0, 2.0], [3], &dev);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.to_dtype(DType::F64)));
    assert!(msg.contains("f64") && msg.contains(&format!("{}:{line}:", file!())), "{msg}");
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.argmax_dim(0, false)));
    assert!(msg.contains("i64") && msg.contains(&format!("{}:{line}:", file!())), "{msg}");
    assert!(
        msg.contains("argmax_dim_as") && msg.contains("x: [3] f32 on wgpu"),
        "the i32 variant and the operand: {msg}"
    );
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.exp().to_dtype(DType::I64)));
    assert!(msg.contains("i64") && msg.contains(&format!("{}:{line}:", file!())), "{msg}");
    assert!(msg.contains("operands: inputs[0]: [3] f32 on wgpu"), "the operand is named: {msg}");
    let msg = panic_message(|| drop(Tensor::zeros([2], DType::F64, &dev)));
    assert!(!msg.contains("operands"), "a creation has no operand line: {msg}");
    let msg = panic_message(|| drop(Tensor::from_vec(vec![1i64, 2], [2], &dev)));
    assert!(msg.contains("i64"), "{msg}");
    // The device keeps working.
    assert_eq!((&x * 2.0).to_vec::<f32>().unwrap(), vec![2.0, 6.0, 4.0]);
}

#[test]
fn memory_statistics_are_the_pools() {
    let Some(dev) = wgpu() else { return };
    dev.sync().unwrap();
    let before = dev.memory();
    let x = Tensor::rand([1 << 20], -1.0, 1.0, DType::F32, &dev);
    let y = (&x * 2.0).exp();
    y.sync_value();
    let during = dev.memory();
    assert!(during.in_use >= before.in_use + (8 << 20), "two 4 MiB values live: {before:?} -> {during:?}");
    assert!(during.peak >= during.in_use && during.reserved >= during.in_use, "{during:?}");
    drop((x, y));
    dev.sync().unwrap();
    let after = dev.memory();
    assert!(after.in_use <= before.in_use, "{before:?} -> {after:?}");
    dev.reset_peak();
    assert_eq!(dev.memory().peak, dev.memory().in_use);
}

trait SyncValue {
    fn sync_value(&self);
}

impl SyncValue for Tensor {
    /// Computes the value (by reading one element of it).
    fn sync_value(&self) {
        self.reshape([self.numel()]).narrow(0, 0, 1).to_vec::<f32>().unwrap();
    }
}

#[test]
fn a_buffer_beyond_the_adapters_limit_is_out_of_memory_and_the_device_goes_on() {
    let Some(dev) = wgpu() else { return };
    let limit = braid::testing::backend::<braid_devices::wgpu::WgpuBackend>(&dev)
        .unwrap()
        .context()
        .limits
        .max_storage_buffer_binding_size;
    let n = (limit / 4 + 1024) as usize;
    let huge = Tensor::zeros([n], DType::F32, &dev);
    match (&huge + 1.0).sum().item::<f32>() {
        Err(Error::Device { source: braid_devices::DeviceError::OutOfMemory { .. }, .. }) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    drop(huge);
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [2, 2], &dev);
    assert_eq!(x.matmul(&x).to_vec::<f32>().unwrap(), vec![7.0, 10.0, 15.0, 22.0]);
}

#[test]
fn values_move_between_the_cpu_and_wgpu() {
    let Some(dev) = wgpu() else { return };
    let cpu = Device::new_cpu();
    let a = Tensor::from_vec((0..12).map(|i| i as f32).collect(), [3, 4], &cpu);
    let on_gpu = (a.to_device(&dev) * 2.0).sum_dim(1, false);
    assert_eq!(on_gpu.to_vec::<f32>().unwrap(), vec![12.0, 44.0, 76.0]);
    let back = (on_gpu.to_device(&cpu) + 1.0).to_vec::<f32>().unwrap();
    assert_eq!(back, vec![13.0, 45.0, 77.0]);
    // Between two wgpu devices (separate memory, one adapter).
    let other = wgpu().unwrap();
    let moved = (on_gpu.to_device(&other) - 2.0).to_vec::<f32>().unwrap();
    assert_eq!(moved, vec![10.0, 42.0, 74.0]);
}

/// With `WGPU_BACKEND` naming a backend this build lacks, `Device::new_wgpu` is an `Err` that
/// names what was tried. Run in a child process, since the adapter is opened once per process.
#[test]
fn no_adapter_is_an_err_naming_what_was_tried() {
    if std::env::var("BRAID_WGPU_CHILD").is_ok() {
        match Device::new_wgpu() {
            Ok(_) => println!("child: got a device"),
            Err(e) => println!("child: {e}"),
        }
        return;
    }
    let missing = if cfg!(target_os = "macos") { "dx12" } else { "metal" };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["no_adapter_is_an_err_naming_what_was_tried", "--exact", "--nocapture", "--test-threads=1"])
        .env("BRAID_WGPU_CHILD", "1")
        .env("WGPU_BACKEND", missing)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let at = stdout.find("child:").unwrap_or_else(|| panic!("no child output:\n{stdout}"));
    let line = stdout[at..].lines().next().unwrap_or_default();
    println!("{line}");
    assert!(line.contains("unavailable") && line.to_lowercase().contains(missing), "{line}");
}

#[test]
fn products_of_broadcast_batches_compute_their_offsets() {
    // [40, 1] batches against [1, 40] ones: 1,600 products whose operand offsets the shader
    // computes from the batch index (a table of them per invocation made 900 batches lose the
    // device on lavapipe).
    let Some(gpu) = wgpu() else { return };
    let cpu = Device::new_cpu();
    let n = 40;
    let a: Vec<f32> = (0..n * 6).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
    let b: Vec<f32> = (0..n * 6).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
    let product = |d: &Device| {
        let x = Tensor::from_vec(a.clone(), [n, 1, 2, 3], d);
        let y = Tensor::from_vec(b.clone(), [1, n, 3, 2], d);
        x.matmul(&y).to_vec::<f32>().unwrap()
    };
    // Small integers: every product and sum is exact, so the two devices agree exactly.
    assert_eq!(product(&gpu), product(&cpu));
}

#[test]
fn pow_has_cs_special_cases_and_exact_squares() {
    let Some(gpu) = wgpu() else { return };
    let cpu = Device::new_cpu();
    let (inf, nan) = (f32::INFINITY, f32::NAN);
    let xs = [-inf, inf, -0.0, 0.0, -1.0, 1.0, -2.5, 2.5, nan, f32::MAX, 1e19, -3.0e-3];
    let ys = [-inf, -2.5, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 2.5, 3.0, inf, nan];
    let (x, y): (Vec<f32>, Vec<f32>) = xs.iter().flat_map(|&x| ys.iter().map(move |&y| (x, y))).unzip();
    let pow = |d: &Device| {
        let (a, b) = (Tensor::from_vec(x.clone(), [x.len()], d), Tensor::from_vec(y.clone(), [y.len()], d));
        a.pow(&b).to_vec::<f32>().unwrap()
    };
    let (want, got) = (pow(&cpu), pow(&gpu));
    for i in 0..x.len() {
        let (w, g) = (want[i], got[i]);
        // Zeros, infinities, NaN, and x^1, x^2 exactly; other values within WGSL's few ulps,
        // and a subnormal result may be flushed to zero (WGSL allows it).
        let exact = w.is_nan() || w == 0.0 || w.is_infinite() || y[i] == 1.0 || y[i] == 2.0;
        let ok = if exact {
            w.to_bits() == g.to_bits() || (w.is_nan() && g.is_nan())
        } else {
            (g - w).abs() <= 1e-5 * w.abs() || (w.abs() < f32::MIN_POSITIVE && g == 0.0)
        };
        assert!(ok, "pow({}, {}): cpu {w}, wgpu {g}", x[i], y[i]);
    }
}

#[test]
fn kernels_bind_no_more_buffers_than_the_adapter_allows() {
    // 40 values of one input, all read afterwards, would be one horizontally fused kernel of
    // 41 buffers, and a cat of 40 parts one kernel of 41; lavapipe and Metal bind about 32.
    let Some(gpu) = wgpu() else { return };
    let cpu = Device::new_cpu();
    let run = |d: &Device| {
        let x = Tensor::from_vec((0..96).map(|i| i as f32 * 0.5 - 20.0).collect(), [96], d);
        let scaled: Vec<Tensor> = (1..=40).map(|i| &x * i as f64).collect();
        let joined = Tensor::cat(&scaled.iter().collect::<Vec<_>>(), 0);
        let joined = joined.to_vec::<f32>().unwrap();
        let sums: Vec<f32> = scaled.iter().map(|s| s.sum().item::<f32>().unwrap()).collect();
        (joined, sums)
    };
    // Multiples of halves: exact on both devices.
    assert_eq!(run(&gpu), run(&cpu));
}
