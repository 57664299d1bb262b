//! Sharded data parallel (`braid::dist::Sharded`): training equal to one device's within 1e-5
//! after 20 AdamW steps on 1, 2 and 4 ranks (one process) and on 2 processes; checkpoints
//! written on 4 ranks read on 2 and on 1; a failed rank and a missing rank as `Err`s on every
//! rank; a memory budget offloading on top of sharding, bit for bit; the schedule a step runs
//! (gathers twice, reduce-scatters once per unit, on the communication stream, the gathers
//! waiting on the compute stream's events, never every full weight at once). On the CPU the
//! ranks are CPU devices; with `BRAID_DEVICE=cuda` they are GPUs through NCCL (tests that need
//! more GPUs than the machine has say they skipped).

mod common;
#[path = "common/group.rs"]
mod group;
#[path = "common/sharded_model.rs"]
mod model;

use braid::dist::{Group, Sharded};
use braid::nn::Params;
use braid::optim::AdamW;
use braid::prelude::*;
use common::Rng;
use group::{ranks, serial};
use model::*;
use std::time::{Duration, Instant};

fn matches_single_device(n: usize) {
    let Some(devices) = ranks(n, &format!("sharded_{n}_ranks")) else { return };
    let group = Group::new(&devices).unwrap();
    train_and_compare(&group, &devices[0], |units| Sharded::new(&group, units));
}

#[test]
fn sharded_training_matches_single_device_on_1_rank() {
    let _serial = serial();
    matches_single_device(1);
}

#[test]
fn sharded_training_matches_single_device_on_2_ranks() {
    let _serial = serial();
    matches_single_device(2);
}

#[test]
fn sharded_training_matches_single_device_on_4_ranks() {
    let _serial = serial();
    matches_single_device(4);
}

#[test]
fn a_step_gathers_each_unit_twice_reduces_it_once_and_never_holds_every_full_weight() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_step_gathers_each_unit_twice") else { return };
    let group = Group::new(&devices).unwrap();
    let (layers, width) = (8, 128);
    let mut rng = Rng::new(5);
    let units = square_units(&mut rng, layers, width, 0.2, &devices[0]);
    let mut sharded = Sharded::new(&group, &units);
    let mut opts: Vec<AdamW> = devices.iter().map(|_| AdamW::new(0.01)).collect();
    for _ in 0..2 {
        let losses: Vec<Tensor> = (0..2)
            .map(|i| {
                let x = Tensor::from_vec(random(&mut rng, 2 * width), [2, width], &devices[i]);
                deep_loss(|u| sharded.gather(i, u), layers, &x)
            })
            .collect();
        let grads = sharded.backward(&losses).unwrap();
        for (i, opt) in opts.iter_mut().enumerate() {
            opt.step(sharded.shards_mut(i), &grads[i]);
        }
        group.sync().unwrap();
    }
    let dump = devices[0].last_schedule().expect("the step's schedule");
    let text = dump.to_text();
    let count = |what: &str| text.matches(what).count();
    assert_eq!(count("all_gather"), 2 * layers, "each unit gathered for forward and again for backward:\n{text}");
    assert_eq!(count("reduce_scatter"), layers, "one reduce-scatter per unit:\n{text}");
    let comm = devices[0].comm_stream().id();
    assert!(text.contains(&format!("stream {comm}:")), "the communication stream is in the dump:\n{text}");
    let json: serde_json::Value = serde_json::from_str(&dump.to_json()).unwrap();
    let comm_steps = json["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == comm)
        .map(|s| s["steps"].as_array().unwrap().clone())
        .unwrap();
    let waits = comm_steps.iter().filter(|s| s["kind"] == "wait").count();
    assert!(waits >= 2 * layers - 4, "the all-gathers wait on the compute stream's events ({waits} waits):\n{text}");
    // The full weights are 8 x 64 KiB; what a rank keeps is 8 x 32 KiB of shards, of AdamW's
    // two moments and of the shards' gradients. The step never holds every unit's full weights:
    // each gathered copy is freed after its last reader (the forward pass's after the forward
    // pass; the backward pass gathers again, one unit ahead).
    let full = (layers * width * width * 4) as u64;
    let states = 4 * full / 2;
    assert!(
        dump.planned_peak_bytes() < states + full / 2,
        "planned peak {} bytes: the states are {states} bytes, the full weights {full}:\n{text}",
        dump.planned_peak_bytes()
    );
    // Without gathering again, the backward pass reads the forward pass's copies.
    let mut kept = Sharded::new(&group, &units).with_regather(false);
    let losses: Vec<Tensor> = (0..2)
        .map(|i| {
            let x = Tensor::from_vec(random(&mut rng, 2 * width), [2, width], &devices[i]);
            deep_loss(|u| kept.gather(i, u), layers, &x)
        })
        .collect();
    let grads = kept.backward(&losses).unwrap();
    drop(losses);
    let g: Vec<Tensor> = (0..2).map(|i| grads[i].get(&kept.shards(i)[0]).unwrap()).collect();
    drop(grads);
    group.sync().unwrap();
    let kept_dump = devices[0].last_schedule().expect("the step's schedule");
    let text = kept_dump.to_text();
    // The trade: the forward pass's copies live until the backward pass read them.
    assert!(kept_dump.planned_peak_bytes() > full * 3 / 4, "{text}");
    assert_eq!(text.matches("all_gather").count(), layers, "one gather per unit:\n{text}");
    assert_eq!(text.matches("reduce_scatter").count(), layers, "{text}");
    assert_eq!(g[0].dims(), &[width * width / 2]);
}

#[test]
fn a_checkpoint_written_on_4_ranks_loads_on_2_and_on_1() {
    let _serial = serial();
    let Some(four) = ranks(4, "a_checkpoint_written_on_4_ranks") else { return };
    let group = Group::new(&four).unwrap();
    let mut rng = Rng::new(3);
    let units = init(&mut rng, &four[0]);
    let mut sharded = Sharded::new(&group, &units);
    // One step, so that the saved values are not the initial ones.
    let mut opts: Vec<AdamW> = four.iter().map(|_| AdamW::new(0.05)).collect();
    let losses = rank_losses(&mut sharded, &four, &mut rng, 2);
    let grads = sharded.backward(&losses).unwrap();
    for (i, opt) in opts.iter_mut().enumerate() {
        opt.step(sharded.shards_mut(i), &grads[i]);
    }
    let dir = std::env::temp_dir().join(format!("braid-sharded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    sharded.save(&dir).unwrap();
    let want: Vec<(String, Vec<f32>)> =
        sharded.params()[0].named().map(|(n, t)| (n.to_string(), t.to_vec::<f32>().unwrap())).collect();
    assert_ne!(want[0].1, units[0].iter().next().unwrap().to_vec::<f32>().unwrap(), "the step changed the weights");
    drop((sharded, group));
    for n in [2, 1] {
        let devices: Vec<Device> = four[..n].to_vec();
        let group = Group::new(&devices).unwrap();
        let loaded = Sharded::load(&group, &dir).unwrap();
        assert!(loaded.shards(0)[0].numel() * n >= 7 * 12 + 12 + 12 * 3);
        for params in loaded.params() {
            let got: Vec<(String, Vec<f32>)> =
                params.named().map(|(n, t)| (n.to_string(), t.to_vec::<f32>().unwrap())).collect();
            assert_eq!(got, want, "the checkpoint of 4 ranks read on {n}");
        }
    }
    // A damaged checkpoint is an Err naming the file.
    std::fs::remove_file(dir.join("shard-00003-of-00004.safetensors")).unwrap();
    let group = Group::new(&four[..2]).unwrap();
    let e = Sharded::load(&group, &dir).expect_err("a rank's file is missing").to_string();
    assert!(e.contains("shard-00003-of-00004"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// 10 AdamW steps on 4 ranks, a checkpoint with the optimizers' states, then 10 steps on 2
/// ranks from it: the same as 20 steps on one device (a run restarted with fresh moments
/// would take Adam's first, largest steps again and miss).
#[test]
fn a_run_saved_with_its_optimizers_on_4_ranks_continues_on_2() {
    let _serial = serial();
    let Some(four) = ranks(4, "a_run_saved_with_its_optimizers") else { return };
    let mut rng = Rng::new(5);
    let units = init(&mut rng, &four[0]);
    let single: Vec<Vec<Tensor>> = units.iter().map(|u| u.iter().map(|t| t.requires_grad()).collect()).collect();
    let mut opt_single = AdamW::new(0.01);
    let mut sharded = Sharded::new(&Group::new(&four).unwrap(), &units);
    let mut opts: Vec<AdamW> = four.iter().map(|_| AdamW::new(0.01)).collect();
    let dir = std::env::temp_dir().join(format!("braid-sharded-optim-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for step in 0..20 {
        if step == 10 {
            sharded.save_with_optimizers(&dir, &opts).unwrap();
            drop((sharded, opts));
            let two = Group::new(&four[..2]).unwrap();
            sharded = Sharded::load(&two, &dir).unwrap();
            opts = vec![AdamW::new(0.01), AdamW::new(0.01)];
            sharded.load_optimizers(&dir, &mut opts).unwrap();
            for (i, opt) in opts.iter().enumerate() {
                for shard in sharded.shards(i) {
                    let state = opt.state(shard).expect("every unit's state restored");
                    assert_eq!((state.step, state.exp_avg.dims()), (10, shard.dims()));
                }
            }
        }
        let (xv, yv) = (random(&mut rng, 8 * 7), random(&mut rng, 8 * 3));
        let want = single_step(&single, &mut opt_single, &xv, &yv);
        let mean = sharded_step(&sharded.group().clone(), &mut sharded, &mut opts, &xv, &yv);
        assert!((mean - want).abs() <= 1e-5 * (1.0 + want.abs()), "step {step}: loss {mean} vs {want}");
    }
    assert_same_params(&sharded, &single, &units, "after 10 steps on 4 ranks and 10 on 2");
    // A checkpoint of parameters only has no states to load.
    let plain = dir.join("plain");
    sharded.save(&plain).unwrap();
    let e = sharded.load_optimizers(&plain, &mut opts).expect_err("no optimizer states").to_string();
    assert!(e.contains("no optimizer states"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ranks recorded on threads of their own (`Sharded::record_ranks`) train to the same bits as
/// ranks recorded one after another, sharded plainly and hybrid (2 replicas of 2).
#[test]
fn ranks_recorded_on_threads_of_their_own_give_the_same_bits() {
    let _serial = serial();
    let Some(devices) = ranks(4, "ranks_recorded_on_threads") else { return };
    let group = Group::new(&devices).unwrap();
    let units = init(&mut Rng::new(13), &devices[0]);
    type Make<'a> = &'a dyn Fn() -> Sharded;
    let plain = || Sharded::new(&group, &units);
    let hybrid = || Sharded::hybrid(&group, 2, &units).unwrap();
    for (what, make) in [("plain", &plain as Make<'_>), ("hybrid", &hybrid as Make<'_>)] {
        let train = |threads: bool| -> Vec<Vec<u32>> {
            let mut sharded = make();
            let mut opts: Vec<AdamW> = devices.iter().map(|_| AdamW::new(0.01)).collect();
            let mut rng = Rng::new(17);
            for _ in 0..3 {
                let data: Vec<(Vec<f32>, Vec<f32>)> =
                    (0..4).map(|_| (random(&mut rng, 2 * 7), random(&mut rng, 2 * 3))).collect();
                let batch = |r: usize| {
                    let x = Tensor::from_vec(data[r].0.clone(), [2, 7], &devices[r]);
                    (x, Tensor::from_vec(data[r].1.clone(), [2, 3], &devices[r]))
                };
                let grads = if threads {
                    sharded
                        .record_ranks(|rank| {
                            let (x, y) = batch(rank.rank());
                            loss(|u| rank.gather(u), &x, &y)
                        })
                        .map(|(_, grads)| grads)
                } else {
                    let losses: Vec<Tensor> = (0..4)
                        .map(|r| {
                            let (x, y) = batch(r);
                            loss(|u| sharded.gather(r, u), &x, &y)
                        })
                        .collect();
                    sharded.backward(&losses)
                };
                let grads = grads.unwrap();
                for (i, opt) in opts.iter_mut().enumerate() {
                    opt.step(sharded.shards_mut(i), &grads[i]);
                }
            }
            (0..4)
                .flat_map(|i| sharded.shards(i).to_vec())
                .map(|t| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        assert_eq!(train(true), train(false), "{what}: threads against one thread");
    }
    // Mixing both ways in one step is misuse.
    let mut sharded = Sharded::new(&group, &units);
    let _ = sharded.gather(0, 0);
    let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = sharded.record_ranks(|rank| rank.gather(0)[0].sum());
    }))
    .expect_err("gathered already");
    let m = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(m.contains("Sharded::record_ranks") && m.contains("tests/sharded.rs"), "{m}");
}

/// `record_ranks` flushes each rank's forward pass before recording its backward pass, while
/// autograd still holds the gathered weights (and `w.t()`) for the derivatives. The backward
/// pass gathers them again, so that flush frees each unit's copy after its last reader instead
/// of keeping every unit's full weights to its end; the step's results are the same bits.
#[test]
fn a_forward_pass_flushed_before_its_backward_frees_each_gathered_unit_after_its_readers() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_forward_pass_flushed_before_its_backward") else { return };
    let group = Group::new(&devices).unwrap();
    let (layers, width) = (8, 128);
    let units = square_units(&mut Rng::new(9), layers, width, 0.2, &devices[0]);
    let inputs: Vec<Vec<f32>> = {
        let mut rng = Rng::new(10);
        (0..2).map(|_| random(&mut rng, 2 * width)).collect()
    };
    let step = |sharded: &mut Sharded, threads: bool| -> (u64, Vec<Vec<u32>>) {
        let x = |r: usize| Tensor::from_vec(inputs[r].clone(), [2, width], &devices[r]);
        let (grads, peak) = if threads {
            let (_, grads) = sharded
                .record_ranks(|rank| {
                    let x = x(rank.rank());
                    deep_loss(|u| rank.gather(u), layers, &x)
                })
                .unwrap();
            // The last flush is rank 0's forward pass (the backward pass is recorded, not run).
            (grads, devices[0].last_schedule().expect("the forward pass's schedule").planned_peak_bytes())
        } else {
            let losses: Vec<Tensor> = (0..2).map(|r| deep_loss(|u| sharded.gather(r, u), layers, &x(r))).collect();
            (sharded.backward(&losses).unwrap(), 0)
        };
        let bits = (0..2)
            .map(|r| grads[r].get(&sharded.shards(r)[3]).unwrap().to_vec::<f32>().unwrap())
            .map(|g| g.iter().map(|v| v.to_bits()).collect())
            .collect();
        (peak, bits)
    };
    let (peak, bits) = step(&mut Sharded::new(&group, &units), true);
    let (_, want) = step(&mut Sharded::new(&group, &units), false);
    assert_eq!(bits, want, "the same gradients as a step recorded whole");
    // Every unit's full weight is 64 KiB, its shard 32 KiB (the flush's inputs, counted in its
    // peak); the activations are 2 rows. Kept to the flush's end, the copies would be 512 KiB
    // on top of the shards; freed after their readers, about one unit's at a time.
    let full = (layers * width * width * 4) as u64;
    let shards = full / 2;
    assert!(
        peak < shards + full / 4,
        "the forward flush's planned peak is {peak} bytes: the shards are {shards}, every unit's full weights {full}"
    );
    // Kept without gathering again: the forward pass's copies are what the backward pass reads.
    let (kept_peak, kept_bits) = step(&mut Sharded::new(&group, &units).with_regather(false), true);
    assert!(kept_peak >= shards + full, "without gathering again the copies stay: {kept_peak} bytes");
    assert_eq!(kept_bits, want);
}

#[test]
fn a_failed_rank_mid_step_is_an_err_on_every_rank_and_the_devices_go_on() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_failed_rank_mid_step") else { return };
    let group = Group::new(&devices).unwrap();
    group.set_timeout(Duration::from_secs(60));
    let mut rng = Rng::new(9);
    let units = init(&mut rng, &devices[0]);
    let mut sharded = Sharded::new(&group, &units);
    let losses = rank_losses(&mut sharded, &devices, &mut rng, 4);
    let grads = sharded.backward(&losses).unwrap();
    // Rank 1's flush fails at a kernel in the middle of its step.
    braid::testing::fail_next_flush_at(&devices[1], 6);
    let start = Instant::now();
    let shard_grads: Vec<Tensor> = (0..2).map(|i| grads[i].get(&sharded.shards(i)[1]).unwrap()).collect();
    let e0 = shard_grads[0].to_vec::<f32>().expect_err("rank 0 cannot finish without rank 1").to_string();
    let e1 = shard_grads[1].to_vec::<f32>().expect_err("rank 1 failed").to_string();
    assert!(start.elapsed() < Duration::from_secs(30), "Errs, well before the timeout");
    assert!(e0.contains("rank 1"), "{e0}");
    assert!(e1.contains("failure injected") || e1.contains("broken"), "{e1}");
    assert!(group.broken().is_some());
    // The failed step's values are lost for good; the devices stay usable, and a new group
    // over them trains (its collectives on the same communication streams do not wait for the
    // failed step's events).
    drop((shard_grads, grads, losses, sharded));
    let x = Tensor::from_vec(random(&mut rng, 4), [4], &devices[1]);
    assert_eq!((&x * 0.0).sum().item::<f32>().unwrap(), 0.0);
    let fresh = Group::new(&devices).unwrap();
    let mut sharded = Sharded::new(&fresh, &units);
    let losses = rank_losses(&mut sharded, &devices, &mut rng, 4);
    let grads = sharded.backward(&losses).unwrap();
    let g = grads[1].get(&sharded.shards(1)[0]).unwrap().to_vec::<f32>().unwrap();
    assert!(g.iter().all(|v| v.is_finite()) && g.iter().any(|&v| v != 0.0));
    assert!(fresh.broken().is_none());
}

#[test]
fn a_rank_that_never_arrives_times_out_on_every_rank() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_rank_that_never_arrives") else { return };
    let group = Group::new(&devices).unwrap();
    group.set_timeout(Duration::from_millis(500));
    let mut rng = Rng::new(4);
    let units = init(&mut rng, &devices[0]);
    let mut sharded = Sharded::new(&group, &units);
    let x = Tensor::from_vec(random(&mut rng, 4 * 7), [4, 7], &devices[0]);
    let y = Tensor::from_vec(random(&mut rng, 4 * 3), [4, 3], &devices[0]);
    let l0 = loss(|u| sharded.gather(0, u), &x, &y);
    // Rank 1 is busy (its engine lock held) for longer than the timeout.
    let err = braid::testing::hold_engine_lock(&devices[1], || {
        let start = Instant::now();
        let e = l0.item::<f32>().expect_err("rank 1 cannot arrive");
        assert!(start.elapsed() < Duration::from_secs(20));
        e
    });
    let m = err.to_string();
    assert!(m.contains("waited") && m.contains("rank(s) 1"), "{m}");
}

/// One rank of a group spanning processes (run by
/// `sharded_training_across_processes_matches_single_device`).
#[test]
#[ignore = "a worker process: run by sharded_training_across_processes_matches_single_device"]
fn sharded_worker_process() {
    let _serial = serial();
    let rank: usize = std::env::var("RANK").expect("RANK").parse().unwrap();
    let cuda = std::env::var("BRAID_DEVICE").unwrap_or_default().starts_with("cuda");
    let device = if cuda { Device::new_cuda(rank).unwrap() } else { Device::new_cpu() };
    let group = Group::from_env(&device).expect("every process joins");
    // Each process trains the reference itself, from the same seed.
    let reference = if cuda { device.clone() } else { Device::new_cpu() };
    train_and_compare(&group, &reference, |units| Sharded::new(&group, units));
    println!("sharded worker {rank}: ok");
}

#[test]
fn sharded_training_across_processes_matches_single_device() {
    let _serial = serial();
    group::run_workers("sharded_worker_process", "sharded worker", "sharded_training_across_processes");
}

#[test]
fn a_memory_budget_still_offloads_activations_on_top_of_sharding() {
    let _serial = serial();
    let Some(devices) = ranks(2, "a_memory_budget_still_offloads") else { return };
    let (layers, width, rows) = (6, 64, 512);
    let mut rng = Rng::new(21);
    let units = square_units(&mut rng, layers, width, 0.3, &devices[0]);
    let inputs: Vec<Vec<f32>> = (0..2).map(|_| random(&mut rng, rows * width)).collect();
    // One step of each run: the planned peak and every rank's new shards.
    let run = |budget: Option<u64>| -> ((u64, usize), Vec<Vec<f32>>) {
        let group = Group::new(&devices).unwrap();
        let mut sharded = Sharded::new(&group, &units);
        for d in &devices {
            d.set_memory_budget(budget);
        }
        let losses: Vec<Tensor> = (0..2)
            .map(|i| {
                let x = Tensor::from_vec(inputs[i].clone(), [rows, width], &devices[i]);
                deep_loss(|u| sharded.gather(i, u), layers, &x)
            })
            .collect();
        let grads = sharded.backward(&losses).unwrap();
        let mut opts: Vec<AdamW> = devices.iter().map(|_| AdamW::new(0.01)).collect();
        for (i, opt) in opts.iter_mut().enumerate() {
            opt.step(sharded.shards_mut(i), &grads[i]);
        }
        drop((losses, grads));
        group.sync().unwrap();
        let dump = devices[0].last_schedule().expect("the step's schedule");
        let offloads = serde_json::from_str::<serde_json::Value>(&dump.to_json()).unwrap()["offloads"]
            .as_array()
            .map_or(0, Vec::len);
        let peak = (dump.planned_peak_bytes(), offloads);
        for d in &devices {
            d.set_memory_budget(None);
        }
        (peak, (0..2).map(|i| sharded.shards(i)[0].to_vec::<f32>().unwrap()).collect())
    };
    let ((free_peak, _), free_shards) = run(None);
    let budget = free_peak * 3 / 4;
    let ((peak, offloads), shards) = run(Some(budget));
    assert!(peak <= budget, "planned peak {peak} under a budget of {budget} (without one: {free_peak})");
    assert!(offloads > 0, "the budgeted step offloads");
    assert_eq!(shards, free_shards, "the budget changes where values live, not what the step computes");
}

#[test]
fn misuse_is_reported_at_the_call() {
    let _serial = serial();
    let Some(devices) = ranks(2, "sharded_misuse") else { return };
    let group = Group::new(&devices).unwrap();
    let mut rng = Rng::new(2);
    let units = init(&mut rng, &devices[0]);
    let message = |f: &mut dyn FnMut()| {
        let p = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("misuse panics");
        let m = p.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(m.contains("tests/sharded.rs"), "names the caller's line: {m}");
        m
    };
    let mut sharded = Sharded::new(&group, &units);
    assert!(message(&mut || drop(sharded.gather(2, 0))).contains("rank 2"));
    assert!(message(&mut || drop(sharded.gather(0, 3))).contains("unit 3"));
    drop(sharded.gather(0, 1));
    assert!(message(&mut || drop(sharded.gather(0, 1))).contains("gathered already"));
    assert!(message(&mut || drop(sharded.backward(&[]))).contains("losses"));
    let ints = {
        let mut p = Params::new();
        p.push("i", &Tensor::zeros([4], DType::I32, &devices[0]));
        p
    };
    assert!(message(&mut || drop(Sharded::new(&group, std::slice::from_ref(&ints)))).contains("floating-point"));
    assert!(message(&mut || drop(Sharded::new(&group, &[Params::new()]))).contains("at least one"));
}
