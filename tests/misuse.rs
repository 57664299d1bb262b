//! Misuse is reported at the recording call: a panic naming the operation, both operands
//! (shape, dtype, device) and the caller's file and line. After a caught panic the engine keeps
//! working on that thread and on every other.

use braid::prelude::*;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The device under test (`BRAID_DEVICE`), one for the whole binary.
fn dev() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE.get_or_init(braid::testing::test_device).clone()
}

/// Runs `f`, which must panic, and returns the panic message.
fn panic_message(f: impl FnOnce()) -> String {
    let err = catch_unwind(AssertUnwindSafe(f)).expect_err("expected a misuse panic");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

fn assert_mentions(msg: &str, parts: &[&str]) {
    for p in parts {
        assert!(msg.contains(p), "message should mention {p:?}:\n{msg}");
    }
}

#[test]
fn shape_mismatch_names_both_shapes_and_the_callers_line() {
    let cpu = dev();
    let a = Tensor::zeros([2, 3], DType::F32, &cpu);
    let b = Tensor::zeros([4], DType::F32, &cpu);
    let line = line!() + 1;
    let msg = panic_message(|| drop(&a + &b));
    assert_mentions(&msg, &["add", "[2, 3]", "[4]", "f32", &cpu.name(), &format!("{}:{line}:", file!())]);

    let line = line!() + 1;
    let msg = panic_message(|| drop(a.matmul(&b.reshape([4, 1]))));
    assert_mentions(&msg, &["matmul", "[2, 3]", "[4, 1]", &format!("{}:{line}:", file!())]);
}

#[test]
fn dtype_mismatch_names_both_dtypes_and_the_callers_line() {
    let cpu = dev();
    let a = Tensor::ones([3], DType::F32, &cpu);
    let b = Tensor::ones([3], DType::I32, &cpu);
    let line = line!() + 1;
    let msg = panic_message(|| drop(a.mul(&b)));
    assert_mentions(&msg, &["mul", "f32", "i32", &format!("{}:{line}:", file!())]);

    let line = line!() + 1;
    let msg = panic_message(|| drop(b.exp()));
    assert_mentions(&msg, &["exp", "float", "i32", &format!("{}:{line}:", file!())]);
}

#[test]
fn device_mismatch_names_both_devices_and_the_callers_line() {
    let dev = dev();
    let a = Tensor::ones([3], DType::F32, &dev);
    let other = Device::new_cpu();
    let b = Tensor::ones([3], DType::F32, &other);
    let line = line!() + 1;
    let msg = panic_message(|| drop(&a - &b));
    let on_dev = format!("[3] f32 on {}", dev.name());
    assert_mentions(&msg, &["sub", "different devices", &on_dev, "[3] f32 on cpu", &format!("{}:{line}:", file!())]);
    // Moving one operand makes it valid.
    let sum = (&a + &b.to_device(a.device())).to_vec::<f32>().unwrap();
    assert_eq!(sum, vec![2.0; 3]);
}

#[test]
fn bad_dimensions_and_arguments_are_reported_at_the_call() {
    let cpu = dev();
    let x = Tensor::zeros([2, 3], DType::F32, &cpu);
    type Case<'a> = (u32, Box<dyn FnOnce() + 'a>, &'static str);
    let cases: Vec<Case> = vec![
        (line!(), Box::new(|| drop(x.sum_dim(2, false))), "sum"),
        (line!(), Box::new(|| drop(x.transpose(0, 5))), "transpose"),
        (line!(), Box::new(|| drop(x.reshape([7]))), "reshape"),
        (line!(), Box::new(|| drop(x.narrow(1, 2, 2))), "narrow"),
        (line!(), Box::new(|| drop(x.permute(&[0, 0]))), "permute"),
        (line!(), Box::new(|| drop(x.expand([3, 3]))), "expand"),
        (line!(), Box::new(|| drop(Tensor::from_vec(vec![1.0f32; 5], [2, 3], &dev()))), "from_vec"),
        (line!(), Box::new(|| drop(x.clamp(1.0, 0.0))), "clamp"),
        (line!(), Box::new(|| x.add_assign(&Tensor::zeros([4, 2, 3], DType::F32, &dev()))), "add_assign"),
        (line!(), Box::new(|| drop(&Tensor::zeros([2, 3], DType::U8, &dev()) * -1.0)), "mul"),
    ];
    for (line, f, op) in cases {
        let msg = panic_message(f);
        assert_mentions(&msg, &[op, "[2, 3]", &format!("{}:{line}:", file!())]);
    }
}

#[test]
fn the_engine_keeps_working_after_caught_misuse_on_every_thread() {
    let cpu = dev();
    let stop = Arc::new(AtomicBool::new(false));
    // Other threads compute while this one panics repeatedly.
    let workers: Vec<_> = (0..4)
        .map(|t| {
            let stop = stop.clone();
            let cpu = cpu.clone();
            std::thread::spawn(move || {
                let mut rounds = 0u32;
                while !stop.load(Ordering::Relaxed) || rounds < 20 {
                    let x = Tensor::from_vec(vec![t as f32, 1.0, 2.0], [3], &cpu);
                    let y = (&x * 2.0 + 1.0).sum().item::<f32>().unwrap();
                    assert_eq!(y, 2.0 * (t as f32 + 3.0) + 3.0);
                    rounds += 1;
                }
                rounds
            })
        })
        .collect();
    for _ in 0..50 {
        let a = Tensor::ones([2, 2], DType::F32, &cpu);
        let b = Tensor::ones([3], DType::F32, &cpu);
        panic_message(|| drop(&a + &b));
        panic_message(|| drop(a.argmax_dim(9, false)));
        // The same thread computes right after.
        assert_eq!((&a + &a).sum().item::<f32>().unwrap(), 8.0);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        assert!(w.join().expect("worker thread must not panic") >= 20);
    }
}

#[test]
fn read_errors_are_errs_not_panics() {
    let cpu = dev();
    let x = Tensor::from_vec(vec![1.0f32, 2.0], [2], &cpu);
    match x.to_vec::<f64>() {
        Err(Error::DTypeMismatch { tensor: DType::F32, requested: DType::F64 }) => {}
        other => panic!("expected a dtype mismatch, got {other:?}"),
    }
    match x.item::<f32>() {
        Err(Error::NotAScalar { numel: 2, .. }) => {}
        other => panic!("expected NotAScalar, got {other:?}"),
    }
    assert_eq!(x.sum().item::<f32>().unwrap(), 3.0);
    // A GPU is a device or a clear error, never a panic; a GPU that does not exist is an error.
    for gpu in [Device::cuda(0), Device::wgpu()] {
        match gpu {
            Ok(d) => assert!(d.name() != "cpu"),
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
    assert!(Device::cuda(4096).is_err());
}

#[test]
fn impossible_shapes_are_misuse_not_overflow() {
    let cpu = dev();
    let line = line!() + 1;
    let msg = panic_message(|| drop(Tensor::zeros([1usize << 40, 1 << 40], DType::F32, &cpu)));
    assert_mentions(&msg, &["too large", &format!("{}:{line}:", file!())]);
    let x = Tensor::zeros([4], DType::F32, &cpu);
    let msg = panic_message(|| drop(x.reshape([usize::MAX, 2])));
    assert_mentions(&msg, &["reshape"]);
    let msg = panic_message(|| drop(x.expand([usize::MAX / 2, 4])));
    assert_mentions(&msg, &["too large"]);
}

#[test]
fn indexing_misuse_names_the_op_and_its_operands_at_the_call() {
    let cpu = dev();
    // The ops that give i64 on a device without it (wgpu) point to their i32 variants.
    if !cpu.target().dtypes.contains(DType::I64) {
        let x = Tensor::zeros([3, 4], DType::F32, &cpu);
        let line = line!() + 1;
        let msg = panic_message(|| drop(x.argmin_dim(1, false)));
        assert_mentions(&msg, &["argmin_dim", "has no i64", "argmin_dim_as", &format!("{}:{line}:", file!())]);
        let msg = panic_message(|| drop(x.argmax_dim(1, false)));
        assert_mentions(&msg, &["argmax_dim", "has no i64", "argmax_dim_as"]);
        let msg = panic_message(|| drop(Tensor::arange(0, 3, &cpu)));
        assert_mentions(&msg, &["arange", "has no i64", "arange_as"]);
    }
    let index_dtype = if cpu.target().dtypes.contains(DType::I64) { DType::I64 } else { DType::I32 };
    let x = Tensor::zeros([3, 4], DType::F32, &cpu);
    let float_index = Tensor::zeros([3, 4], DType::F32, &cpu);
    let msg = panic_message(|| drop(x.argmax_dim_as(1, false, DType::U8)));
    assert_mentions(&msg, &["argmax", "i64 or i32", "u8"]);
    let index = Tensor::zeros([3, 4], index_dtype, &cpu);
    let at = |line: u32| format!("{}:{line}:", file!());
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.gather(1, &float_index)));
    assert_mentions(&msg, &["gather", "integer", "[3, 4] f32", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.gather(2, &index)));
    assert_mentions(&msg, &["gather", "dimension 2", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.gather(0, &Tensor::zeros([3, 5], index_dtype, &cpu))));
    assert_mentions(&msg, &["gather", &format!("[3, 5] {index_dtype}"), "[3, 4] f32", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.index_select(-3, &Tensor::zeros([2], DType::I32, &cpu))));
    assert_mentions(&msg, &["index_select", "dimension -3", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.index_select(0, &index)));
    assert_mentions(&msg, &["index_select", "one-dimensional", &format!("[3, 4] {index_dtype}"), &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(float_index.embedding(&x)));
    assert_mentions(&msg, &["embedding", "integer", "ids: [3, 4] f32", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(index.embedding(&Tensor::zeros([4], DType::F32, &cpu))));
    assert_mentions(&msg, &["embedding", "weight: [4] f32", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.scatter_add(0, &index, &Tensor::zeros([2, 4], DType::F32, &cpu))));
    assert_mentions(&msg, &["scatter_add", "one shape", "src: [2, 4] f32", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.scatter_add(1, &index, &Tensor::zeros([3, 4], DType::I32, &cpu))));
    assert_mentions(&msg, &["scatter_add", "dtype", "i32", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.argmin_dim_as(-3, false, index_dtype)));
    assert_mentions(&msg, &["argmin_dim", "dimension -3", &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.cross_entropy(&Tensor::zeros([4], index_dtype, &cpu))));
    let target = format!("target: [4] {index_dtype}");
    assert_mentions(&msg, &["cross_entropy", "logits: [3, 4] f32", &target, &at(line)]);
    let line = line!() + 1;
    let msg = panic_message(|| drop(x.cross_entropy(&Tensor::zeros([3], DType::F32, &cpu))));
    assert_mentions(&msg, &["cross_entropy", "integer", &at(line)]);
}

/// `item` reads one element of every dtype (from the device's buffer, without a vector), the
/// same as `to_vec`; a wrong type is a dtype mismatch, not a misread.
#[test]
fn item_reads_one_element_of_every_dtype() {
    let cpu = dev();
    fn check<T: Element + PartialEq + std::fmt::Debug>(cpu: &Device, v: T) {
        let dtypes = cpu.target().dtypes;
        if !dtypes.contains(T::DTYPE) {
            println!("skipped: {} has no {} (item of it is not tested here)", cpu.name(), T::DTYPE);
            return;
        }
        let x = Tensor::from_vec(vec![v], (), cpu);
        // A kernel's output, not an upload (through a dtype that holds every value below).
        let wide = if dtypes.contains(DType::F64) { DType::F64 } else { DType::F32 };
        let computed = x.to_dtype(wide).to_dtype(T::DTYPE);
        for t in [&x, &computed] {
            assert_eq!(t.item::<T>().unwrap(), v, "{}", T::DTYPE);
            assert_eq!(t.item::<T>().unwrap(), t.to_vec::<T>().unwrap()[0]);
        }
        if T::DTYPE != DType::F64 {
            assert!(matches!(x.item::<f64>(), Err(Error::DTypeMismatch { .. })), "{}", T::DTYPE);
        }
    }
    check(&cpu, -2.5f32);
    check(&cpu, 1.0e300f64);
    check(&cpu, -7i32);
    check(&cpu, -(1i64 << 40));
    check(&cpu, 200u8);
    check(&cpu, true);
    check(&cpu, half::f16::from_f32(-0.375));
    check(&cpu, half::bf16::from_f32(3.5));
    assert!(matches!(Tensor::from_vec(vec![1.0f32], (), &cpu).item::<f64>(), Err(Error::DTypeMismatch { .. })));
}

#[test]
fn handles_cross_catch_unwind_as_they_are() {
    // No `AssertUnwindSafe` needed: devices, tensors, streams and events are `UnwindSafe`, as
    // a caught misuse panic leaves the engine usable.
    let dev = dev();
    let (a, b) = (Tensor::ones([2], DType::F32, &dev), Tensor::ones([3], DType::F32, &dev));
    let stream = dev.new_stream();
    let event = stream.record_event();
    let caught = catch_unwind(|| {
        stream.wait_event(&event);
        &a + &b
    });
    assert!(caught.is_err());
    assert_eq!((&a + &a).to_vec::<f32>().unwrap(), vec![2.0, 2.0]);
    event.synchronize().unwrap();
}

#[test]
fn attention_misuse_names_the_operands_at_the_call() {
    let dev = dev();
    let t = |dims: &[usize], dtype: DType| Tensor::zeros(dims, dtype, &dev);
    let q = t(&[2, 4, 16], DType::F32);
    let cases: [(Tensor, Tensor, &[&str]); 5] = [
        (t(&[2, 4, 8], DType::F32), t(&[2, 4, 8], DType::F32), &["same head dimension", "[2, 4, 8]"]),
        (t(&[3, 4, 16], DType::F32), t(&[3, 4, 16], DType::F32), &["same leading dimensions", "[3, 4, 16]"]),
        (t(&[2, 5, 16], DType::F32), t(&[2, 6, 16], DType::F32), &["same shape", "[2, 6, 16]"]),
        (t(&[2, 0, 16], DType::F32), t(&[2, 0, 16], DType::F32), &["at least one key"]),
        (t(&[2, 4, 16], DType::I32), t(&[2, 4, 16], DType::I32), &["dtypes f32 and i32 differ"]),
    ];
    for (k, v, parts) in cases {
        let line = line!() + 1;
        let msg = panic_message(|| drop(q.scaled_dot_product_attention(&k, &v, true)));
        assert_mentions(&msg, parts);
        assert_mentions(&msg, &["scaled_dot_product_attention", &format!("{}:{line}:", file!())]);
    }
    let ints = t(&[2, 4, 16], DType::I32);
    let msg = panic_message(|| drop(ints.scaled_dot_product_attention(&ints, &ints, false)));
    assert_mentions(&msg, &["needs a float dtype", "i32"]);
    let flat = t(&[16], DType::F32);
    let msg = panic_message(|| drop(flat.scaled_dot_product_attention(&flat, &flat, false)));
    assert_mentions(&msg, &["rank of at least 2"]);
}

#[test]
fn linear_misuse_names_the_operands_at_the_call() {
    let dev = dev();
    let t = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev);
    let x = t(&[4, 8]);
    let cases: [(Tensor, Option<Tensor>, &[&str]); 3] = [
        (t(&[3, 7]), None, &["weight [out, in]", "[3, 7]"]),
        (t(&[8]), None, &["weight [out, in]", "[8]"]),
        (t(&[3, 8]), Some(t(&[8])), &["bias [out]", "[3, 8]", "[8]"]),
    ];
    for (w, b, parts) in cases {
        let line = line!() + 1;
        let msg = panic_message(|| drop(x.linear(&w, b.as_ref())));
        assert_mentions(&msg, parts);
        assert_mentions(&msg, &["linear", &format!("{}:{line}:", file!())]);
    }
}
