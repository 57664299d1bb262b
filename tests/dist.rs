//! Collectives (`braid::dist::Group`) and data-parallel training (`DataParallel`): every
//! collective against a host computation on random inputs, on 2 and 4 devices; one thread
//! driving every rank; ordering across flushes; failures and timeouts as `Err`s on every rank;
//! data-parallel training equal to single-device training. On the CPU the ranks are CPU
//! devices; with `BRAID_DEVICE=cuda` they are GPUs through NCCL (tests that need more GPUs
//! than the machine has say they skipped).

mod common;
#[path = "common/group.rs"]
mod group;

use braid::dist::{DataParallel, Group, Reduce};
use braid::optim::Sgd;
use braid::prelude::*;
use common::Rng;
use group::{close, ranks, serial};
use std::time::{Duration, Instant};

fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-4.0, 4.0) as f32).collect()
}

#[test]
fn every_collective_matches_the_host_on_2_and_4_ranks() {
    let _serial = serial();
    for n in [2, 4] {
        let Some(devices) = ranks(n, "every_collective_matches_the_host") else { continue };
        let group = Group::new(&devices).unwrap();
        let mut rng = Rng::new(n as u64);
        let (rows, cols) = (4 * n, 3);
        let data: Vec<Vec<f32>> = (0..n).map(|_| random(&mut rng, rows * cols)).collect();
        let tensors: Vec<Tensor> =
            (0..n).map(|r| Tensor::from_vec(data[r].clone(), [rows, cols], &devices[r])).collect();
        let fold = |f: fn(f32, f32) -> f32| -> Vec<f32> {
            (0..rows * cols).map(|i| (1..n).fold(data[0][i], |acc, r| f(acc, data[r][i]))).collect()
        };
        let sum = fold(|a, b| a + b);
        let mean: Vec<f32> = sum.iter().map(|s| s / n as f32).collect();
        let cases = [
            (Reduce::Sum, sum.clone()),
            (Reduce::Mean, mean),
            (Reduce::Max, fold(f32::max)),
            (Reduce::Min, fold(f32::min)),
        ];
        for (op, want) in &cases {
            let out = group.all_reduce(&tensors, *op);
            for (r, t) in out.iter().enumerate() {
                assert_eq!(t.device(), &devices[r]);
                close(&t.to_vec::<f32>().unwrap(), want, 1e-6).unwrap_or_else(|e| panic!("{op:?} rank {r}: {e}"));
            }
        }
        let gathered = group.all_gather(&tensors);
        let want: Vec<f32> = data.concat();
        for t in &gathered {
            assert_eq!(t.dims(), &[rows * n, cols]);
            assert_eq!(t.to_vec::<f32>().unwrap(), want);
        }
        let scattered = group.reduce_scatter(&tensors, Reduce::Sum);
        let part = rows / n * cols;
        for (r, t) in scattered.iter().enumerate() {
            assert_eq!(t.dims(), &[rows / n, cols]);
            close(&t.to_vec::<f32>().unwrap(), &sum[r * part..(r + 1) * part], 1e-6).unwrap();
        }
        let root = n - 1;
        for t in group.broadcast(&tensors, root) {
            assert_eq!(t.to_vec::<f32>().unwrap(), data[root]);
        }
        // Integers sum exactly (and wrap like the CPU's sums).
        let ints: Vec<Tensor> =
            (0..n).map(|r| Tensor::from_vec(vec![i32::MAX, r as i32, -7], [3], &devices[r])).collect();
        let total = group.all_reduce(&ints, Reduce::Sum);
        let s = (0..n as i32).sum::<i32>();
        assert_eq!(total[0].to_vec::<i32>().unwrap(), vec![i32::MAX.wrapping_mul(n as i32), s, -7 * n as i32]);
    }
}

#[test]
fn one_thread_drives_every_rank_and_results_chain() {
    let _serial = serial();
    let Some(devices) = ranks(2, "one_thread_drives_every_rank") else { return };
    let group = Group::new(&devices).unwrap();
    let a = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &devices[0]);
    let b = Tensor::from_vec(vec![10.0f32, 20.0, 30.0], [3], &devices[1]);
    // Work before, between and after two collectives, recorded on every rank; only rank 0 is
    // read: rank 1's part is flushed when rank 0 waits for it.
    let first = group.all_reduce(&[a.exp().log(), &b * 2.0], Reduce::Sum);
    let again = group.all_reduce(&[&first[0] + 1.0, &first[1] - 1.0], Reduce::Max);
    assert_eq!(again[0].to_vec::<f32>().unwrap(), vec![22.0, 43.0, 64.0]);
    assert_eq!(again[1].to_vec::<f32>().unwrap(), vec![22.0, 43.0, 64.0]);
    // Reading the later collective first runs the earlier one first on every rank; a rank's
    // result that nobody holds any more still runs (the others wait for it).
    let x = group.all_reduce(&[a.clone(), b.clone()], Reduce::Sum);
    let y = group.all_reduce(&[a.clone(), b.clone()], Reduce::Min);
    drop(x);
    let y1 = y[1].clone();
    drop(y);
    assert_eq!(y1.to_vec::<f32>().unwrap(), vec![1.0, 2.0, 3.0]);
    // The results carry no gradient, and the group stays whole.
    assert!(!y1.needs_grad());
    assert!(group.broken().is_none());
}

#[test]
fn collectives_run_on_the_comm_stream_and_schedules_show_them() {
    let _serial = serial();
    let Some(devices) = ranks(2, "collectives_run_on_the_comm_stream") else { return };
    let group = Group::new(&devices).unwrap();
    let xs: Vec<Tensor> = devices.iter().map(|d| Tensor::randn([64, 64], DType::F32, d)).collect();
    let reduced = group.all_reduce(&[xs[0].tanh(), xs[1].tanh()], Reduce::Mean);
    let out = &reduced[0] * 2.0;
    out.to_vec::<f32>().unwrap();
    let dump = devices[0].last_schedule().expect("a schedule");
    let text = dump.to_text();
    assert!(text.contains("all_reduce"), "{text}");
    let comm = devices[0].comm_stream().id();
    assert_ne!(comm, 0);
    assert!(text.contains(&format!("stream {comm}:")), "the collective's stream {comm} is in the dump:\n{text}");
}

#[test]
fn misuse_is_reported_at_the_call() {
    let _serial = serial();
    let Some(devices) = ranks(2, "misuse_is_reported_at_the_call") else { return };
    let group = Group::new(&devices).unwrap();
    let a = Tensor::zeros([4], DType::F32, &devices[0]);
    let b = Tensor::zeros([4], DType::F32, &devices[1]);
    let c = Tensor::zeros([5], DType::F32, &devices[1]);
    let i = Tensor::zeros([4], DType::I32, &devices[0]);
    let j = Tensor::zeros([4], DType::I32, &devices[1]);
    let message = |f: &dyn Fn()| {
        let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("misuse panics");
        let m = p.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(m.contains("tests/dist.rs"), "names the caller's line: {m}");
        m
    };
    assert!(message(&|| drop(group.all_reduce(std::slice::from_ref(&a), Reduce::Sum))).contains("one per rank"));
    assert!(message(&|| drop(group.all_reduce(&[b.clone(), a.clone()], Reduce::Sum))).contains("rank 0"));
    assert!(message(&|| drop(group.all_reduce(&[a.clone(), c.clone()], Reduce::Sum))).contains("same shape"));
    assert!(message(&|| drop(group.all_reduce(&[i.clone(), j.clone()], Reduce::Mean))).contains("floating-point"));
    let odd = [Tensor::zeros([3], DType::F32, &devices[0]), Tensor::zeros([3], DType::F32, &devices[1])];
    assert!(message(&|| drop(group.reduce_scatter(&odd, Reduce::Sum))).contains("equal parts"));
    assert!(message(&|| drop(group.broadcast(&[a.clone(), b.clone()], 2))).contains("root 2"));
    // A device twice is an Err, not a group; so is a group spanning processes without its
    // environment.
    assert!(Group::new(&[devices[0].clone(), devices[0].clone()]).is_err());
    if std::env::var("RANK").is_err() {
        let e = Group::from_env(&devices[0]).expect_err("RANK is not set").to_string();
        assert!(e.contains("RANK"), "{e}");
    }
}

#[test]
fn a_failed_rank_is_an_err_on_every_rank_not_a_hang() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_failed_rank_is_an_err_on_every_rank") else { return };
    let group = Group::new(&devices).unwrap();
    group.set_timeout(Duration::from_secs(60));
    let xs: Vec<Tensor> = devices.iter().map(|d| Tensor::randn([256], DType::F32, d)).collect();
    // Rank 1's flush fails at its first kernel, before its part of the collective.
    let inputs = [xs[0].exp(), xs[1].exp()];
    let out = group.all_reduce(&inputs, Reduce::Sum);
    braid::testing::fail_next_flush_at(&devices[1], 0);
    let start = Instant::now();
    let e0 = out[0].to_vec::<f32>().expect_err("rank 0 cannot finish without rank 1");
    assert!(start.elapsed() < Duration::from_secs(30), "an Err, well before the timeout");
    assert!(e0.to_string().contains("rank 1 failed"), "{e0}");
    let e1 = out[1].to_vec::<f32>().expect_err("the group is broken");
    assert!(e1.to_string().contains("broken"), "{e1}");
    assert!(group.broken().is_some());
    // Every later collective of the group is an Err too; the devices themselves go on.
    let later = group.all_reduce(&xs, Reduce::Sum);
    assert!(later[0].to_vec::<f32>().is_err());
    assert_eq!((&xs[1] * 0.0).sum().item::<f32>().unwrap(), 0.0);
    let fresh = Group::new(&devices).unwrap();
    let ok = fresh.all_reduce(&xs, Reduce::Sum);
    assert_eq!(ok[0].to_vec::<f32>().unwrap().len(), 256);
}

#[test]
fn a_rank_that_never_arrives_times_out_with_a_clear_err() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_rank_that_never_arrives_times_out") else { return };
    let group = Group::new(&devices).unwrap();
    group.set_timeout(Duration::from_millis(500));
    let xs: Vec<Tensor> = devices.iter().map(|d| Tensor::randn([16], DType::F32, d)).collect();
    let out = group.all_reduce(&xs, Reduce::Sum);
    // Rank 1's engine is busy (its lock held) for longer than the timeout: rank 0 gives up.
    let err = braid::testing::hold_engine_lock(&devices[1], || {
        let start = Instant::now();
        let e = out[0].to_vec::<f32>().expect_err("rank 1 cannot arrive");
        assert!(start.elapsed() < Duration::from_secs(20));
        e
    });
    let m = err.to_string();
    assert!(m.contains("waited") && m.contains("rank(s) 1"), "{m}");
}

/// A two-layer MLP's loss on `x`, `y` with parameters `p` = [w1, b1, w2, b2].
fn mlp_loss(p: &[Tensor], x: &Tensor, y: &Tensor) -> Tensor {
    let h = (x.matmul(&p[0]) + &p[1]).tanh();
    let out = h.matmul(&p[2]) + &p[3];
    (out - y).square().mean()
}

fn init(rng: &mut Rng, device: &Device) -> Vec<Tensor> {
    let shapes: [&[usize]; 4] = [&[8, 32], &[32], &[32, 4], &[4]];
    shapes.iter().map(|s| Tensor::from_vec(random(rng, s.iter().product()), *s, device) * 0.1).collect()
}

/// Trains the MLP for 20 SGD steps on `reference` (one device, the whole batch) and
/// data-parallel over `group` (with buckets small enough that there are several; this process's
/// ranks get their shards) and compares every parameter of this process's ranks.
fn train_and_compare(group: &Group, reference: &Device) {
    let local = group.devices().to_vec();
    let n = group.size();
    let mut rng = Rng::new(7);
    let mut single: Vec<Tensor> = init(&mut rng, reference).iter().map(|t| t.requires_grad()).collect();
    let start: Vec<Tensor> =
        single.iter().map(|t| Tensor::from_vec(t.to_vec::<f32>().unwrap(), t.dims(), &local[0])).collect();
    let mut dp = DataParallel::new(group, &start).with_bucket_bytes(1024);
    let mut opt_single = Sgd::new(0.1);
    let mut opts: Vec<Sgd> = local.iter().map(|_| Sgd::new(0.1)).collect();
    let batch = 8 * n;
    for step in 0..20 {
        let x = Tensor::from_vec(random(&mut rng, batch * 8), [batch, 8], reference);
        let y = Tensor::from_vec(random(&mut rng, batch * 4), [batch, 4], reference);
        let loss = mlp_loss(&single, &x, &y);
        let grads = loss.backward().unwrap();
        opt_single.step(&mut single, &grads);
        let (xs, ys) = (dp.scatter(&x), dp.scatter(&y));
        let losses: Vec<Tensor> = (0..local.len()).map(|i| mlp_loss(dp.params(i), &xs[i], &ys[i])).collect();
        let grads = dp.backward(&losses).unwrap();
        for (i, opt) in opts.iter_mut().enumerate() {
            opt.step(dp.params_mut(i), &grads[i]);
        }
        // The ranks' mean loss (itself a collective) is the single device's loss.
        let mean = group.all_reduce(&losses, Reduce::Mean)[0].item::<f32>().unwrap();
        let want = loss.item::<f32>().unwrap();
        assert!((mean - want).abs() <= 1e-5 * (1.0 + want.abs()), "step {step}: loss {mean} vs {want}");
    }
    for (i, p) in single.iter().enumerate() {
        let want = p.to_vec::<f32>().unwrap();
        for (l, rank) in group.ranks().into_iter().enumerate() {
            let got = dp.params(l)[i].to_vec::<f32>().unwrap();
            close(&got, &want, 1e-5).unwrap_or_else(|e| panic!("parameter {i} on rank {rank} after 20 steps: {e}"));
        }
    }
}

fn data_parallel_matches_single_device(n: usize) {
    let Some(devices) = ranks(n, &format!("data_parallel_mlp_{n}_ranks")) else { return };
    let group = Group::new(&devices).unwrap();
    train_and_compare(&group, &devices[0]);
}

/// One rank of a group spanning processes (run by `processes_form_a_group_and_train_like_one`
/// with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set).
#[test]
#[ignore = "a worker process: run by processes_form_a_group_and_train_like_one"]
fn worker_process() {
    let _serial = serial();
    let rank: usize = std::env::var("RANK").expect("RANK").parse().unwrap();
    let cuda = std::env::var("BRAID_DEVICE").unwrap_or_default().starts_with("cuda");
    let device = if cuda { Device::new_cuda(rank).unwrap() } else { Device::new_cpu() };
    let group = Group::from_env(&device).expect("every process joins");
    assert_eq!((group.size(), group.ranks()), (2, vec![rank]));
    // Collectives across the processes.
    let mine = Tensor::from_vec(vec![rank as f32 + 1.0, 10.0 * rank as f32], [2], &device);
    assert_eq!(group.all_reduce(std::slice::from_ref(&mine), Reduce::Sum)[0].to_vec::<f32>().unwrap(), vec![3.0, 10.0]);
    assert_eq!(group.all_gather(std::slice::from_ref(&mine))[0].to_vec::<f32>().unwrap(), vec![1.0, 0.0, 2.0, 10.0]);
    assert_eq!(group.broadcast(std::slice::from_ref(&mine), 1)[0].to_vec::<f32>().unwrap(), vec![2.0, 10.0]);
    // Data-parallel training over the processes equals one device's (each process trains the
    // reference itself, from the same seed).
    let reference = if cuda { device.clone() } else { Device::new_cpu() };
    train_and_compare(&group, &reference);
    // Rank 1 fails before a collective: both processes get an Err naming it, not a hang.
    let xs = [Tensor::randn([64], DType::F32, &device).exp()];
    let out = group.all_reduce(&xs, Reduce::Sum);
    if rank == 1 {
        braid::testing::fail_next_flush_at(&device, 0);
    }
    let e = out[0].to_vec::<f32>().expect_err("rank 1 failed").to_string();
    let expected = if rank == 1 { "failure injected" } else { "rank 1 failed" };
    assert!(e.contains(expected), "rank {rank}: {e}");
    println!("worker {rank}: ok");
}

#[test]
fn processes_form_a_group_and_train_like_one() {
    let _serial = serial();
    group::run_workers("worker_process", "worker", "processes_form_a_group");
}

#[test]
fn data_parallel_mlp_matches_single_device_on_1_rank() {
    let _serial = serial();
    data_parallel_matches_single_device(1);
}

#[test]
fn data_parallel_mlp_matches_single_device_on_2_ranks() {
    let _serial = serial();
    data_parallel_matches_single_device(2);
}

#[test]
fn data_parallel_mlp_matches_single_device_on_4_ranks() {
    let _serial = serial();
    data_parallel_matches_single_device(4);
}
