//! The user contract (`shared/API.md`, sections Devices, Tensors, Operations, Reading) written
//! out name by name: if any of these names changed, this file would stop compiling. Values are
//! checked against hand-computed NumPy results.

use braid::prelude::*;

fn close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len()
        && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()) || (x.is_nan() && y.is_nan()))
}

#[test]
fn every_name_of_the_contract_compiles_and_computes() -> Result<()> {
    // Devices.
    let cpu: Device = Device::cpu();
    let _maybe: Result<Device> = Device::cuda(0);
    let _maybe: Result<Device> = Device::wgpu();
    let from_env = Device::from_env()?; // the device BRAID_DEVICE names: the CPU when unset
    assert_eq!(from_env, Device::from_env()?, "the same device on every call");
    match std::env::var("BRAID_DEVICE").unwrap_or_default().trim() {
        "" | "cpu" => assert_eq!(from_env, cpu),
        _ => assert_ne!(from_env, cpu),
    }
    cpu.seed(3);
    cpu.sync()?;
    let stats: MemoryStats = cpu.memory();
    let (_a, _b, _c): (u64, u64, u64) = (stats.in_use, stats.peak, stats.reserved);
    cpu.reset_peak();

    // Tensors: creation and metadata.
    let a = Tensor::from_vec(vec![1.0f32, -2.0, 3.0, -4.0, 5.0, -6.0], [2, 3], &cpu);
    let b = Tensor::from_slice(&[0.5f32, 1.0, 2.0], vec![3], &cpu);
    let s = Tensor::from_vec(vec![2.5f32], (), &cpu);
    let _z = Tensor::zeros(&[2, 3][..], DType::F32, &cpu);
    let o = Tensor::ones([2, 3], DType::F32, &cpu);
    let f = Tensor::full([3], 7.0, DType::I32, &cpu);
    let r = Tensor::arange(2, 6, &cpu);
    let u = Tensor::rand([4], -1.0, 1.0, DType::F64, &cpu);
    let n = Tensor::randn([4], DType::BF16, &cpu);
    let shape: &Shape = a.shape();
    assert_eq!(shape.dims(), &[2, 3]);
    assert_eq!((a.dtype(), a.device(), a.rank(), a.numel()), (DType::F32, &cpu, 2, 6));
    let _all = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I32, DType::I64, DType::U8, DType::Bool];
    let _h = Tensor::from_vec(vec![half::f16::ONE, half::f16::ZERO], [2], &cpu);
    let _bh = Tensor::from_vec(vec![half::bf16::ONE], [1], &cpu);
    let _i = Tensor::from_vec(vec![1i64, 2], [2], &cpu);
    let _u8 = Tensor::from_vec(vec![1u8, 2], [2], &cpu);
    let _bool = Tensor::from_vec(vec![true, false], [2], &cpu);

    // Operations: elementwise unary.
    let x = Tensor::from_vec(vec![0.25f32, 1.0, 4.0], [3], &cpu);
    for t in [
        x.neg(),
        x.exp(),
        x.log(),
        x.sqrt(),
        x.rsqrt(),
        x.abs(),
        x.sin(),
        x.cos(),
        x.tanh(),
        x.sigmoid(),
        x.relu(),
        x.gelu(),
        x.recip(),
        x.square(),
    ] {
        assert_eq!(t.to_vec::<f32>()?.len(), 3);
    }
    assert!(close(&x.sqrt().to_vec::<f32>()?, &[0.5, 1.0, 2.0]));
    // Binary with broadcasting, operators on owned and borrowed tensors and f64 scalars.
    assert!(close(&a.add(&b).to_vec::<f32>()?, &[1.5, -1.0, 5.0, -3.5, 6.0, -4.0]));
    assert!(close(&a.sub(&b).to_vec::<f32>()?, &[0.5, -3.0, 1.0, -4.5, 4.0, -8.0]));
    assert!(close(&a.mul(&b).to_vec::<f32>()?, &[0.5, -2.0, 6.0, -2.0, 5.0, -12.0]));
    assert!(close(&a.div(&b).to_vec::<f32>()?, &[2.0, -2.0, 1.5, -8.0, 5.0, -3.0]));
    assert!(close(&b.pow(&b).to_vec::<f32>()?, &[0.5f32.powf(0.5), 1.0, 4.0]));
    assert!(close(&a.maximum(&b).to_vec::<f32>()?, &[1.0, 1.0, 3.0, 0.5, 5.0, 2.0]));
    assert!(close(&a.minimum(&b).to_vec::<f32>()?, &[0.5, -2.0, 2.0, -4.0, 1.0, -6.0]));
    let sum1 = &a + &b;
    let sum2 = a.clone() + b.clone();
    let sum3 = &a + b.clone();
    let sum4 = a.clone() + &b;
    for t in [&sum1, &sum2, &sum3, &sum4] {
        assert_eq!(t.to_vec::<f32>()?, sum1.to_vec::<f32>()?);
    }
    assert!(close(&(&a * 2.0).to_vec::<f32>()?, &[2.0, -4.0, 6.0, -8.0, 10.0, -12.0]));
    assert!(close(&(1.0 - &b).to_vec::<f32>()?, &[0.5, 0.0, -1.0]));
    assert!(close(&(2.0 / b.clone()).to_vec::<f32>()?, &[4.0, 2.0, 1.0]));
    assert!(close(&(-&b - 1.0).to_vec::<f32>()?, &[-1.5, -2.0, -3.0]));
    // Comparisons, select, clamp, powf.
    let gt = a.gt(&b);
    assert_eq!(gt.dtype(), DType::Bool);
    assert_eq!(gt.to_vec::<bool>()?, vec![true, false, true, false, true, false]);
    for c in [a.eq(&b), a.ne(&b), a.lt(&b), a.le(&b), a.ge(&b)] {
        assert_eq!(c.numel(), 6);
    }
    assert!(close(&gt.select(&a, &o).to_vec::<f32>()?, &[1.0, 1.0, 3.0, 1.0, 5.0, 1.0]));
    assert!(close(&a.clamp(-1.0, 2.0).to_vec::<f32>()?, &[1.0, -1.0, 2.0, -1.0, 2.0, -1.0]));
    assert!(close(&b.powf(2.0).to_vec::<f32>()?, &[0.25, 1.0, 4.0]));
    // Reductions.
    assert_eq!(a.sum().item::<f32>()?, -3.0);
    assert_eq!(a.mean().item::<f32>()?, -0.5);
    assert!(close(&a.sum_dim(0, false).to_vec::<f32>()?, &[-3.0, 3.0, -3.0]));
    assert_eq!(a.sum_dim(1, true).dims(), &[2, 1]);
    assert!(close(&a.mean_dim(1, false).to_vec::<f32>()?, &[2.0 / 3.0, -5.0 / 3.0]));
    assert!(close(&a.max_dim(1, false).to_vec::<f32>()?, &[3.0, 5.0]));
    assert!(close(&a.min_dim(0, false).to_vec::<f32>()?, &[-4.0, -2.0, -6.0]));
    assert_eq!(a.argmax_dim(1, false).to_vec::<i64>()?, vec![2, 1]);
    // Matrix products with broadcast batches.
    let m = a.matmul(&a.t());
    assert!(close(&m.to_vec::<f32>()?, &[14.0, -32.0, -32.0, 77.0]));
    let batched = a.reshape([1, 2, 3]).expand([4, 2, 3]).matmul(&b.reshape([3, 1]));
    assert_eq!(batched.dims(), &[4, 2, 1]);
    // Movement.
    assert_eq!(a.reshape([3, 2]).dims(), &[3, 2]);
    assert_eq!(a.permute(&[1, 0]).to_vec::<f32>()?, vec![1.0, -4.0, -2.0, 5.0, 3.0, -6.0]);
    assert_eq!(a.transpose(0, 1).to_vec::<f32>()?, a.t().to_vec::<f32>()?);
    assert_eq!(b.expand([2, 3]).to_vec::<f32>()?, vec![0.5, 1.0, 2.0, 0.5, 1.0, 2.0]);
    assert_eq!(a.narrow(1, 1, 2).to_vec::<f32>()?, vec![-2.0, 3.0, 5.0, -6.0]);
    assert_eq!(Tensor::cat(&[&a, &o], 0).dims(), &[4, 3]);
    assert_eq!(a.contiguous().to_vec::<f32>()?, a.to_vec::<f32>()?);
    assert_eq!(f.to_dtype(DType::F64).to_vec::<f64>()?, vec![7.0; 3]);
    assert_eq!(r.to_device(&cpu).to_vec::<i64>()?, vec![2, 3, 4, 5]);
    // Composites.
    let e: Vec<f32> = [0.5f32, 1.0, 2.0].iter().map(|v| v.exp()).collect();
    let z: f32 = e.iter().sum();
    assert!(close(&b.softmax(0).to_vec::<f32>()?, &[e[0] / z, e[1] / z, e[2] / z]));
    assert_eq!(s.item::<f32>()?, 2.5);
    assert_eq!(a.log_softmax(1).dims(), &[2, 3]);
    assert_eq!(a.layer_norm(1, 1e-5).dims(), &[2, 3]);
    // In place: new versions.
    let acc = Tensor::zeros([3], DType::F32, &cpu);
    let seen_before = &acc + 0.0;
    acc.assign(&b);
    acc.add_assign(&b);
    acc.sub_assign(&Tensor::ones([3], DType::F32, &cpu));
    acc.mul_assign(&b);
    let mut acc2 = acc.clone();
    acc2 += &b;
    acc2 -= 1.0;
    acc2 *= 2.0;
    acc2 /= &Tensor::full([1], 2.0, DType::F32, &cpu);
    assert_eq!(seen_before.to_vec::<f32>()?, vec![0.0; 3]);
    // acc2 is a clone of acc: the same tensor, so both saw every update.
    assert!(close(&acc.to_vec::<f32>()?, &[-0.5, 1.0, 7.0]));
    // Reading.
    assert!(a.to_vec::<f64>().is_err());
    assert!(a.item::<f32>().is_err());
    assert_eq!(u.dtype(), DType::F64);
    assert_eq!(n.to_vec::<half::bf16>()?.len(), 4);
    braid::flush()?;
    let _last: Option<braid::ScheduleDump> = cpu.last_schedule();
    let _: Error = a.to_vec::<i32>().unwrap_err();
    Ok(())
}
