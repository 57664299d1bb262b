//! Flush on read: only what a read needs runs, unread tensors never run, values read once are
//! kept, the pending graph is bounded, run-time failures are `Err` and lose no work, memory is
//! accounted truthfully, and recording is safe from many threads.
//!
//! Each test counts kernels on its own CPU device (`braid::testing::test_device()`), so counts are exact
//! even with tests running in parallel; fusion is off where a test counts ops one kernel each.
//! Tests that change the global pending-node limit take turns through `LIMIT`.

use braid::prelude::*;
use std::sync::Mutex;

static LIMIT: Mutex<()> = Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    LIMIT.lock().unwrap_or_else(|p| p.into_inner())
}

/// A fresh CPU device that runs one kernel per op, so kernel counts are op counts.
fn unfused() -> Device {
    let dev = braid::testing::test_device();
    dev.set_fusion(false);
    dev
}

fn data(dev: &Device, n: usize) -> Tensor {
    Tensor::from_vec((0..n).map(|i| i as f32 * 0.5 - 1.0).collect::<Vec<_>>(), [n], dev)
}

#[test]
fn tensors_dropped_unread_are_never_computed() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let x = data(&dev, 1000);
    let y = x.exp().sin() * 3.0;
    let z = y.reshape([1000, 1]).matmul(&y.reshape([1, 1000]));
    drop((y, z));
    dev.sync().unwrap();
    braid::flush().unwrap();
    assert_eq!(dev.kernels_launched(), 0, "nothing read, nothing computed");
    assert_eq!(dev.memory().in_use, 0, "not even the input was uploaded");
    drop(x);
}

#[test]
fn a_read_runs_only_what_it_needs_and_values_are_kept() {
    let _t = turn();
    let dev = unfused();
    let x = data(&dev, 64);
    let a = x.exp();
    let b = x.sin();
    let c = &a + 1.0;
    c.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), 2, "exp and add; sin is not needed");
    assert_eq!(dev.last_schedule().unwrap().kernel_count(), 2);
    c.to_vec::<f32>().unwrap();
    a.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), 2, "a value read once (or computed while held) is kept");
    b.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), 3);
}

#[test]
fn an_unheld_intermediate_needed_later_is_computed_once() {
    let _t = turn();
    let dev = unfused();
    let x = data(&dev, 64);
    let shared = x.exp(); // dropped below, but two results depend on it
    let p = &shared + 1.0;
    let q = &shared * 2.0;
    drop(shared);
    p.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), 2);
    q.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), 3, "exp is not recomputed for q");
    let expect: Vec<f32> = x.to_vec::<f32>().unwrap().iter().map(|v| v.exp() * 2.0).collect();
    // The device's exp may be looser than the table's (WGSL's builtin: its target says).
    let tol = (2e-7 + dev.target().math.extra_epsilons() * f64::from(f32::EPSILON)) as f32;
    for (g, e) in q.to_vec::<f32>().unwrap().iter().zip(&expect) {
        assert!((g - e).abs() <= tol * e.abs(), "{g} vs {e}");
    }
}

#[test]
fn the_pending_graph_is_bounded() {
    let _t = turn();
    let dev = unfused();
    let old = braid::max_pending_nodes();
    braid::set_max_pending_nodes(50);
    let mut x = data(&dev, 16);
    for _ in 0..200 {
        x = &x * 1.01 + 0.01;
    }
    let flushed_while_recording = dev.kernels_launched();
    braid::set_max_pending_nodes(old);
    assert!(flushed_while_recording >= 300, "recording flushed on its own ({flushed_while_recording} kernels)");
    let got = x.to_vec::<f32>().unwrap();
    let mut expect: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 - 1.0).collect();
    for _ in 0..200 {
        expect.iter_mut().for_each(|v| *v = *v * 1.01 + 0.01);
    }
    for (g, e) in got.iter().zip(&expect) {
        assert!((g - e).abs() <= 1e-4 * (1.0 + e.abs()), "{g} vs {e}");
    }
}

#[test]
fn automatic_flushes_that_fail_back_off_and_nothing_is_lost() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let old = braid::max_pending_nodes();
    braid::set_max_pending_nodes(50);
    // Every flush fails (the budget is out of reach): the work stays pending, and the next
    // automatic flush waits for twice as many pending nodes instead of coming at every op.
    dev.set_memory_budget(Some(1));
    let mut x = data(&dev, 16);
    for _ in 0..2_000 {
        x = &x * 1.01 + 0.01;
    }
    let attempts = dev.last_schedule().map_or(0, |s| s.flush());
    braid::set_max_pending_nodes(old);
    assert!((1..=12).contains(&attempts), "{attempts} automatic flushes while recording 4,000 ops");
    assert!(matches!(x.to_vec::<f32>(), Err(Error::MemoryBudget { .. })));
    // Within the budget again, the same tensor computes.
    dev.set_memory_budget(None);
    let got = x.to_vec::<f32>().unwrap();
    let mut expect: Vec<f32> = (0..16).map(|i| i as f32 * 0.5 - 1.0).collect();
    for _ in 0..2_000 {
        expect.iter_mut().for_each(|v| *v = *v * 1.01 + 0.01);
    }
    for (g, e) in got.iter().zip(&expect) {
        assert!((g - e).abs() <= 1e-3 * (1.0 + e.abs()), "{g} vs {e}");
    }
}

#[test]
fn in_place_updates_are_new_versions() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &dev);
    let alias = x.clone();
    let before = &x * 10.0; // recorded before the update: sees the old value
    x.add_assign(&Tensor::ones([3], DType::F32, &dev));
    let after = &x * 10.0;
    let mut y = x.clone();
    y += 1.0;
    assert_eq!(before.to_vec::<f32>().unwrap(), vec![10.0, 20.0, 30.0]);
    assert_eq!(after.to_vec::<f32>().unwrap(), vec![20.0, 30.0, 40.0]);
    assert_eq!(alias.to_vec::<f32>().unwrap(), vec![3.0, 4.0, 5.0], "every clone is the same tensor");
    x.assign(&Tensor::full([1], 7.0, DType::F32, &dev));
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![7.0; 3]);
}

#[test]
fn out_of_memory_is_an_err_and_the_engine_stays_usable() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let small = data(&dev, 8);
    let huge = Tensor::zeros([1usize << 44], DType::F32, &dev); // 64 TiB
    let pending = &huge + 1.0;
    match pending.sum().item::<f32>() {
        Err(Error::Device { source: braid_devices::DeviceError::OutOfMemory { .. }, .. }) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    // No work is lost: the failed values are pending again and fail again, cleanly.
    assert!(pending.sum().item::<f32>().is_err());
    // Everything else still works, and the failed flush left no memory behind.
    assert_eq!((&small * 2.0).sum().item::<f32>().unwrap(), 12.0);
    drop((huge, pending));
    assert_eq!(dev.memory().in_use, 64, "only `small` (32 bytes, rounded to 64) is held");
}

#[test]
fn memory_statistics_are_truthful() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let x = data(&dev, 1 << 16); // 256 KiB
    let y = x.exp();
    y.to_vec::<f32>().unwrap();
    let m = dev.memory();
    assert_eq!(m.in_use, 2 * (4 << 16), "x and y are held");
    assert!(m.reserved >= m.in_use && m.peak >= m.in_use);
    drop(y);
    assert_eq!(dev.memory().in_use, 4 << 16);
    dev.reset_peak();
    assert_eq!(dev.memory().peak, 4 << 16);
    drop(x);
    assert_eq!(dev.memory().in_use, 0);
    dev.trim_memory();
    assert_eq!(dev.memory().reserved, 0);
}

#[test]
fn recording_and_reading_from_many_threads() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let shared = data(&dev, 256);
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mut acc = shared.clone();
                for i in 0..100 {
                    acc = &acc + &(&shared * (t as f64));
                    if i % 10 == 0 {
                        acc.sum().item::<f32>().unwrap();
                    }
                }
                acc.to_vec::<f32>().unwrap()
            })
        })
        .collect();
    let base: Vec<f32> = (0..256).map(|i| i as f32 * 0.5 - 1.0).collect();
    for (t, th) in threads.into_iter().enumerate() {
        let got = th.join().unwrap();
        for (g, b) in got.iter().zip(&base) {
            let mut e = *b;
            for _ in 0..100 {
                e += b * t as f32;
            }
            assert!((g - e).abs() <= 1e-3 * (1.0 + e.abs()), "thread {t}: {g} vs {e}");
        }
    }
}

#[test]
fn handles_are_send_sync_and_static() {
    fn check<T: Clone + std::fmt::Debug + Send + Sync + 'static>() {}
    check::<Tensor>();
    check::<Device>();
    check::<braid::ScheduleDump>();
}

#[test]
fn schedules_and_the_recorded_graph_can_be_inspected() {
    let _t = turn();
    let dev = unfused();
    let x = data(&dev, 4);
    let y = x.exp() + 1.0;
    let dot = braid::dump::recorded_graph_dot();
    assert!(dot.contains("exp") && dot.starts_with("digraph"));
    y.to_vec::<f32>().unwrap();
    let s = dev.last_schedule().unwrap();
    let json: serde_json::Value = serde_json::from_str(&s.to_json()).unwrap();
    assert_eq!(json["schema"], 1);
    assert_eq!(json["device"], dev.name());
    assert_eq!(json["fusion"]["kernels"], 2);
    assert!(s.to_text().contains("exp"), "{}", s.to_text());
    assert!(s.to_dot().contains("cluster_s0"));
}

#[test]
fn a_failed_flush_leaves_its_inputs_intact() {
    let _t = turn();
    let dev = braid::testing::test_device();
    // y's input has no handle of its own; the flush below fails (out of memory) after computing
    // y, and y must come out right when it is retried.
    let y = Tensor::from_vec(vec![1.0f32; 4], [4], &dev) + 1.0;
    let huge = Tensor::zeros([1usize << 44], DType::F32, &dev);
    let big = &huge + 1.0;
    assert!(braid::flush().is_err());
    drop((big, huge));
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![2.0; 4]);
}

#[test]
fn concurrent_updates_and_reads_see_whole_versions() {
    let _t = turn();
    let dev = braid::testing::test_device();
    let x = Tensor::from_vec(vec![0.0f32; 4], [4], &dev);
    let one = Tensor::ones([4], DType::F32, &dev);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (xb, ob, sb) = (x.clone(), one.clone(), stop.clone());
    let writer = std::thread::spawn(move || {
        while !sb.load(std::sync::atomic::Ordering::Relaxed) {
            xb.add_assign(&ob);
            xb.to_vec::<f32>().unwrap();
        }
    });
    // Every read of 2x sees one whole version of x: four equal, even values.
    for _ in 0..20_000 {
        let v = (&x * 2.0).to_vec::<f32>().unwrap();
        assert!(v.iter().all(|&e| e == v[0]) && v[0] % 2.0 == 0.0, "{v:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    writer.join().unwrap();
}

/// A download in progress holds the version it reads: an update that could otherwise write the
/// new version over the old one in place (no tensor names the old version any more, and the
/// update is a kernel of its own) gets a new buffer, so the reader never sees a torn value.
#[test]
fn a_download_in_progress_is_never_overwritten_by_an_update() {
    let dev = unfused();
    let n = 1 << 18;
    let x = Tensor::from_vec(vec![1.0f32; n], [n], &dev);
    let one = Tensor::ones([n], DType::F32, &dev);
    dev.sync().unwrap();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (xb, ob, sb, db) = (x.clone(), one.clone(), stop.clone(), dev.clone());
    let writer = std::thread::spawn(move || {
        let mut updates = 0;
        while !sb.load(std::sync::atomic::Ordering::Relaxed) {
            xb.add_assign(&ob);
            db.sync().unwrap();
            updates += 1;
        }
        updates
    });
    for _ in 0..400 {
        let v = x.to_vec::<f32>().unwrap();
        let first = v[0];
        assert!(v.iter().all(|&e| e == first), "a torn read: {first} and {:?}", v.iter().find(|&&e| e != first));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let updates = writer.join().unwrap();
    assert!(updates > 0);
    // The updates did run in place when nobody was reading.
    x.add_assign(&one);
    dev.sync().unwrap();
    assert!(dev.last_schedule().unwrap().to_text().contains("in place"));
}

#[test]
fn a_view_a_tensor_still_names_is_computed_only_if_it_is_read() {
    let _t = turn();
    // Kernel counts of the CPU's plans (the engine's choice is the same on every device).
    let dev = Device::new_cpu();
    let values: Vec<f32> = (0..4096).map(|i| (i % 97) as f32 / 16.0 - 3.0).collect();
    let x = Tensor::from_vec(values.clone(), [64, 64], &dev);
    x.to_vec::<f32>().unwrap();
    // The temporary `x.reshape(..)` names the view until the end of the statement, after the
    // read: the view folds into the sum's loads, nothing copies `x`.
    let s = x.reshape([4096]).sum().item::<f32>().unwrap();
    assert_eq!(dev.last_schedule().unwrap().kernel_count(), 1, "{}", dev.last_schedule().unwrap().to_text());
    assert!((s - values.iter().sum::<f32>()).abs() < 1e-2);
    // A view that outlives its reader, over a value no tensor names any more: the reader's
    // read leaves the view pending and its input held (never handed to the flush to free).
    let v = {
        let a = &x * 2.0;
        a.to_vec::<f32>().unwrap();
        a.t()
    };
    let before = dev.kernels_launched();
    let sums = v.exp().sum_dim(1, false).to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched() - before, 1, "the row sums alone");
    let want: Vec<f32> = (0..64).map(|c| (0..64).map(|r| (2.0 * values[r * 64 + c]).exp()).sum()).collect();
    assert!(sums.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-4 * b.abs()), "{sums:?}");
    // Read, the view is computed then, from the input it held.
    let transposed = v.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched() - before, 2);
    assert!((0..4096).all(|i| transposed[i] == 2.0 * values[(i % 64) * 64 + i / 64]));
    // A sync computes every pending value, views included.
    let w = x.narrow(0, 8, 16);
    dev.sync().unwrap();
    let synced = dev.kernels_launched();
    assert_eq!(w.to_vec::<f32>().unwrap(), values[8 * 64..24 * 64]);
    assert_eq!(dev.kernels_launched(), synced, "computed by the sync");
}
