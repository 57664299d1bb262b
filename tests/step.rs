//! `braid::Step`: a captured function replays with new arguments and gives exactly what running
//! it eagerly gives (which is checked against the reference interpreter); captures that a
//! replay could not honour are refused with `Error::Capture`, and the engine stays usable.
//! `step/graphs.rs`: replays through a backend that records device graphs (CUDA graphs' model).

mod common;
#[path = "step/graphs.rs"]
mod graphs;
#[path = "step/in_place.rs"]
mod in_place;
#[path = "../examples/common/micrograd.rs"]
mod micrograd;
#[path = "../examples/common/mini_gpt.rs"]
mod mini_gpt;

use micrograd::micrograd;

use braid::prelude::*;
use braid::{Step, Stream};
use common::{Rng, check_recorded};

/// Forward and backward of the micrograd graph: g, dg/da, dg/db.
fn micrograd_step(x: &[Tensor]) -> Vec<Tensor> {
    let (a, b) = (x[0].detach().requires_grad(), x[1].detach().requires_grad());
    let g = micrograd(&a, &b);
    let grads = g.backward().unwrap();
    vec![g, grads.get(&a).unwrap(), grads.get(&b).unwrap()]
}

fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F64 => t.to_vec::<f64>().unwrap().iter().map(|v| v.to_bits()).collect(),
        DType::F32 => t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits() as u64).collect(),
        other => panic!("unexpected dtype {other}"),
    }
}

/// A scalar of the widest float `dev` has (f64; f32 on wgpu).
fn scalar(v: f64, dev: &Device) -> Tensor {
    let dtype = if dev.target().dtypes.contains(DType::F64) { DType::F64 } else { DType::F32 };
    common::tensor_from_f64(&[v], &Shape::from(()), dtype, dev)
}

fn value(t: &Tensor) -> f64 {
    match t.dtype() {
        DType::F64 => t.item::<f64>().unwrap(),
        _ => f64::from(t.item::<f32>().unwrap()),
    }
}

#[test]
fn micrograd_forward_and_backward_replays_with_the_known_values() {
    let dev = braid::testing::test_device();
    let step = Step::new(micrograd_step);
    for _ in 0..3 {
        let out = step.call(&[scalar(-4.0, &dev), scalar(2.0, &dev)]).unwrap();
        let v: Vec<f64> = out.iter().map(value).collect();
        let close = |a: f64, b: f64| (a - b).abs() < 1e-4 * b.abs().max(1.0);
        assert!(close(v[0], 24.7041) && close(v[1], 138.8338) && close(v[2], 645.5773), "{v:?}");
        assert!(out.iter().all(|t| !t.needs_grad()));
    }
    assert_eq!(step.captures(), 1);
    let args = [scalar(1.0, &dev), scalar(1.0, &dev)];
    if dev.fusion_enabled() {
        assert_eq!(step.kernel_count(&args), Some(1), "the whole step is one fused kernel");
    }
}

#[test]
fn replays_equal_eager_runs_on_random_arguments() {
    let dev = braid::testing::test_device();
    let step = Step::new(micrograd_step);
    let mut rng = Rng::new(7);
    for _ in 0..20 {
        // Away from the relu kinks and from f = 0.
        let (a, b) = (rng.uniform(-3.0, 3.0), rng.uniform(0.5, 2.5));
        let args = [scalar(a, &dev), scalar(b, &dev)];
        let replayed = step.call(&args).unwrap();
        let eager = micrograd_step(&args);
        let refs: Vec<&Tensor> = eager.iter().collect();
        check_recorded(&refs).unwrap();
        for (r, e) in replayed.iter().zip(&eager) {
            assert_eq!(bits(r), bits(e), "a = {a}, b = {b}");
        }
    }
}

/// One instruction of a random program over `[rows, cols]` f32 values.
#[derive(Clone, Debug)]
enum Instr {
    Unary(usize, usize),
    Binary(usize, usize, usize),
    Scalar(usize, usize, f64),
    /// Row max or sum kept as `[rows, 1]`, then combined with the input (broadcast).
    RowReduce(usize, bool),
    /// Times the `[cols, cols]` argument.
    Matmul(usize),
}

fn random_program(rng: &mut Rng, len: usize) -> Vec<(Instr, bool)> {
    let mut n = 2; // the first two values are the [rows, cols] arguments
    (0..len)
        .map(|_| {
            let i = rng.below(n);
            let instr = match rng.below(5) {
                0 => Instr::Unary(rng.below(5), i),
                1 => Instr::Binary(rng.below(4), i, rng.below(n)),
                2 => Instr::Scalar(rng.below(3), i, rng.uniform(-2.0, 2.0)),
                3 => Instr::RowReduce(i, rng.chance(0.5)),
                _ => Instr::Matmul(i),
            };
            n += 1;
            // Some work goes to a second stream.
            (instr, rng.chance(0.3))
        })
        .collect()
}

fn run_program(program: &[(Instr, bool)], args: &[Tensor], side: &Stream, grad: bool) -> Vec<Tensor> {
    let x = if grad { args[0].detach().requires_grad() } else { args[0].clone() };
    let mut vals = vec![x.clone(), args[1].clone()];
    for (instr, on_side) in program {
        let apply = || match *instr {
            Instr::Unary(k, i) => {
                let v = &vals[i];
                [v.tanh(), v.sigmoid(), v.relu(), v.neg(), v.sin()][k].clone()
            }
            Instr::Binary(k, i, j) => {
                let (a, b) = (&vals[i], &vals[j]);
                [a + b, a - b, a * b, a.maximum(b)][k].clone()
            }
            Instr::Scalar(k, i, s) => [&vals[i] * s, &vals[i] + s, s - &vals[i]][k].clone(),
            Instr::RowReduce(i, max) => {
                let v = &vals[i];
                let r = if max { v.max_dim(1, true) } else { v.sum_dim(1, true) * 0.25 };
                v - &r
            }
            Instr::Matmul(i) => vals[i].matmul(&args[2]).tanh(),
        };
        let v = if *on_side { side.scope(apply) } else { apply() };
        vals.push(v);
    }
    let last = vals.last().unwrap().clone();
    let mut outs = vec![last.clone(), vals[vals.len() / 2].clone()];
    if grad {
        // The loss always depends on x, whatever the program reads.
        let loss = (&last * &last).mean() + (&x * &x).sum() * 0.01;
        outs.push(loss.backward().unwrap().get(&x).unwrap());
    }
    outs
}

fn random_args(rng: &mut Rng, dev: &Device, rows: usize, cols: usize) -> Vec<Tensor> {
    let mut t = |shape: [usize; 2]| {
        let v: Vec<f32> = (0..shape[0] * shape[1]).map(|_| rng.uniform(-1.5, 1.5) as f32).collect();
        Tensor::from_vec(v, shape, dev)
    };
    vec![t([rows, cols]), t([rows, cols]), t([cols, cols])]
}

#[test]
fn random_programs_replay_like_eager_runs_across_streams_and_budgets() {
    let mut offloads = 0;
    for seed in 0..24u64 {
        let dev = braid::testing::test_device();
        let side = dev.new_stream();
        let mut rng = Rng::new(1000 + seed);
        let len = 3 + rng.below(10);
        let program = random_program(&mut rng, len);
        let grad = rng.chance(0.5);
        let (rows, cols) = (1 + rng.below(6), 1 + rng.below(9));
        let step = Step::new(|args: &[Tensor]| run_program(&program, args, &side, grad));
        for call in 0..3 {
            // Every other program runs under a budget of 60% of its planned peak from its
            // second call on (a new budget captures again).
            if seed % 2 == 1 && call == 1 {
                let peak = dev.last_schedule().unwrap().dump().planned_peak_bytes;
                dev.set_memory_budget(Some(peak * 6 / 10));
            }
            let args = random_args(&mut rng, &dev, rows, cols);
            let replayed = match step.call(&args) {
                Ok(r) => r,
                // A budget below what offloading can reach is reported, as a flush reports it;
                // the lowest reachable peak it names is then the budget.
                Err(Error::MemoryBudget { min_peak, .. }) => {
                    dev.set_memory_budget(Some(min_peak));
                    step.call(&args).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{program:?}"))
                }
                Err(e) => panic!("seed {seed}: {e}\n{program:?}"),
            };
            offloads += dev.last_schedule().unwrap().dump().offloads.len();
            let eager = run_program(&program, &args, &side, grad);
            let refs: Vec<&Tensor> = eager.iter().collect();
            check_recorded(&refs).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{program:?}"));
            for (r, e) in replayed.iter().zip(&eager) {
                assert_eq!(bits(r), bits(e), "seed {seed}, call {call}: {program:?}");
            }
        }
        assert!(step.captures() >= 1);
    }
    assert!(offloads > 0, "no budget made a step offload");
}

#[test]
fn new_shapes_and_aliased_arguments_capture_again() {
    let dev = braid::testing::test_device();
    let step = Step::new(|a: &[Tensor]| vec![&a[0] * &a[1] + 1.0]);
    let x = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev);
    let y = Tensor::from_vec(vec![3.0f32, 4.0], [2], &dev);
    assert_eq!(step.call(&[x.clone(), x.clone()]).unwrap()[0].to_vec::<f32>().unwrap(), vec![2.0, 5.0]);
    // The same shapes, but two different values: not the aliased capture.
    assert_eq!(step.call(&[x.clone(), y.clone()]).unwrap()[0].to_vec::<f32>().unwrap(), vec![4.0, 9.0]);
    assert_eq!(step.captures(), 2);
    let z = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &dev);
    assert_eq!(step.call(&[z.clone(), z]).unwrap()[0].to_vec::<f32>().unwrap(), vec![2.0, 5.0, 10.0]);
    assert_eq!(step.captures(), 3);
    assert_eq!(step.call(&[y, x]).unwrap()[0].to_vec::<f32>().unwrap(), vec![4.0, 9.0]);
    assert_eq!(step.captures(), 3);
}

#[test]
fn outputs_that_need_no_work_are_returned_as_they_are() {
    let dev = braid::testing::test_device();
    let step = Step::new(|a: &[Tensor]| vec![a[0].clone(), Tensor::from_vec(vec![7i32], [1], a[0].device())]);
    for v in [1.0f32, 2.0] {
        let out = step.call(&[Tensor::from_vec(vec![v], [1], &dev)]).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![v]);
        assert_eq!(out[1].to_vec::<i32>().unwrap(), vec![7]);
    }
    // Host data created inside and read by the work is uploaded at each replay.
    let step = Step::new(|a: &[Tensor]| vec![&a[0] * &Tensor::from_vec(vec![2.0f32, 3.0], [2], a[0].device())]);
    for v in [1.0f32, -1.0] {
        let out = step.call(&[Tensor::from_vec(vec![v, v], [2], &dev)]).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), vec![2.0 * v, 3.0 * v]);
    }
}

fn capture_error(r: Result<Vec<Tensor>>) -> String {
    match r {
        Err(Error::Capture(why)) => why,
        Err(e) => panic!("expected a capture error, got {e}"),
        Ok(_) => panic!("expected a capture error, got outputs"),
    }
}

#[test]
fn captures_a_replay_could_not_honour_are_refused_and_the_engine_stays_usable() {
    let dev = braid::testing::test_device();
    let x = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev);
    let w = Tensor::from_vec(vec![3.0f32, 4.0], [2], &dev);

    // Reading a value while captured (even if the function ignores the error).
    let reads = Step::new(|a: &[Tensor]| {
        let _ = a[0].to_vec::<f32>();
        vec![&a[0] * 2.0]
    });
    assert!(capture_error(reads.call(std::slice::from_ref(&x))).contains("a read"));
    let syncs = Step::new(|a: &[Tensor]| {
        let _ = a[0].device().sync();
        vec![&a[0] * 2.0]
    });
    assert!(capture_error(syncs.call(std::slice::from_ref(&x))).contains("sync"));

    // A tensor that is not an argument (a replay would reuse its old value).
    let closes_over = Step::new(|a: &[Tensor]| vec![&a[0] * &w]);
    assert!(capture_error(closes_over.call(std::slice::from_ref(&x))).contains("not one of its arguments"));
    let pending = &w + 1.0;
    let closes_over_pending = Step::new(|a: &[Tensor]| vec![&a[0] * &pending]);
    assert!(capture_error(closes_over_pending.call(std::slice::from_ref(&x))).contains("recorded before it"));

    // An argument updated in place by a capture that fails (here by a read after it): the
    // update is undone.
    let updates = Step::new(|a: &[Tensor]| {
        a[0].add_assign(&(&a[0] * 2.0));
        let _ = a[0].to_vec::<f32>();
        vec![&a[0] + 1.0]
    });
    let u = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev);
    assert!(capture_error(updates.call(std::slice::from_ref(&u))).contains("a read"));

    // Calls that do not name a device.
    let empty = Step::new(|_: &[Tensor]| Vec::new());
    assert!(capture_error(empty.call(&[])).contains("at least one argument"));

    // Nothing was kept, and the engine computes as before.
    assert_eq!(reads.captures() + closes_over.captures() + updates.captures(), 0);
    assert_eq!((&x * &w).to_vec::<f32>().unwrap(), vec![3.0, 8.0]);
    assert_eq!(pending.to_vec::<f32>().unwrap(), vec![4.0, 5.0]);
    assert_eq!(u.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    let ok = Step::new(|a: &[Tensor]| vec![&a[0] * &a[1]]);
    assert_eq!(ok.call(&[x, w]).unwrap()[0].to_vec::<f32>().unwrap(), vec![3.0, 8.0]);
}

#[test]
fn what_a_replay_would_not_do_again_is_refused_and_leaves_the_outside_as_it_was() {
    let dev = braid::testing::test_device();
    let p = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev);
    let outside = Tensor::from_vec(vec![10.0f32, 20.0], [2], &dev);

    // An argument's value from before the step updates it, returned: a replay writes over it.
    let returns_old = Step::new(|a: &[Tensor]| {
        let old = a[0].detach();
        a[0].add_assign(&old);
        vec![old]
    });
    assert!(capture_error(returns_old.call(std::slice::from_ref(&p))).contains("from before it updates"));
    // The same tensor passed twice, and updated.
    let twice = Step::new(|a: &[Tensor]| {
        a[0].add_assign(&a[1]);
        vec![&a[1] * 2.0]
    });
    assert!(capture_error(twice.call(&[p.clone(), p.clone()])).contains("passed as another argument"));
    // A tensor from outside, updated in place and not returned.
    let leaks = Step::new(|a: &[Tensor]| {
        outside.add_assign(&a[0]);
        vec![&a[0] * 2.0]
    });
    assert!(capture_error(leaks.call(std::slice::from_ref(&p))).contains("from outside the step"));

    // Random tensors: every replay would draw the capture's numbers. The device's sequence
    // does not move, so the next draw is the one a fresh seed gives.
    dev.seed(7);
    let draws = Step::new(|a: &[Tensor]| vec![&Tensor::randn([2], DType::F32, a[0].device()) + &a[0]]);
    assert!(capture_error(draws.call(std::slice::from_ref(&p))).contains("randn inside a step"));
    let uniform = Step::new(|a: &[Tensor]| vec![&Tensor::rand([2], 0.0, 1.0, DType::F32, a[0].device()) + &a[0]]);
    assert!(capture_error(uniform.call(std::slice::from_ref(&p))).contains("rand inside a step"));
    let after = Tensor::randn([3], DType::F32, &dev).to_vec::<f32>().unwrap();
    dev.seed(7);
    assert_eq!(after, Tensor::randn([3], DType::F32, &dev).to_vec::<f32>().unwrap());

    // User events: a replay records and waits for none; a refused wait is not done.
    let side = dev.new_stream();
    let records = Step::new(|a: &[Tensor]| {
        let _ = a[0].stream().record_event();
        vec![&a[0] * 2.0]
    });
    assert!(capture_error(records.call(std::slice::from_ref(&p))).contains("recording a user event"));
    let never = side.record_event();
    let waits = Step::new(|a: &[Tensor]| {
        Stream::current(a[0].device()).wait_event(&never);
        vec![&a[0] * 2.0]
    });
    assert!(capture_error(waits.call(std::slice::from_ref(&p))).contains("waiting for an event"));

    // Nothing outside changed, nothing was kept, and the default stream waits for no event.
    assert_eq!(p.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
    assert_eq!(outside.to_vec::<f32>().unwrap(), vec![10.0, 20.0]);
    let steps = [
        &returns_old.captures(),
        &twice.captures(),
        &leaks.captures(),
        &draws.captures(),
        &records.captures(),
        &waits.captures(),
    ];
    assert!(steps.iter().all(|&&c| c == 0));
    let later = &p * 3.0;
    assert_eq!(later.to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
    let schedule = dev.last_schedule().unwrap();
    assert!(schedule.dump().events.is_empty(), "the refused wait was done:\n{}", schedule.to_text());
}

#[test]
fn a_failed_replay_is_an_error_and_the_next_one_runs() {
    let dev = braid::testing::test_device();
    let step = Step::new(|a: &[Tensor]| vec![(&a[0] * 3.0).exp().sum()]);
    let x = Tensor::from_vec(vec![0.0f32, 0.0], [2], &dev);
    assert_eq!(step.call(std::slice::from_ref(&x)).unwrap()[0].item::<f32>().unwrap(), 2.0);
    braid::testing::fail_next_flush_at(&dev, 0);
    assert!(matches!(step.call(std::slice::from_ref(&x)), Err(Error::Device { .. })));
    assert_eq!(step.call(std::slice::from_ref(&x)).unwrap()[0].item::<f32>().unwrap(), 2.0);
}

/// On the CPU, a replay of one stream runs as a CPU graph (its steps in order, without the
/// walker) and gives the eager bits; a step of two streams keeps running through the walker,
/// whose threads run its streams at the same time.
#[test]
fn cpu_replays_of_one_stream_run_as_graphs() {
    let dev = Device::new_cpu();
    let launches = || braid::testing::backend::<braid_devices::cpu::CpuDevice>(&dev).unwrap().graph_launches();
    let step = Step::new(micrograd_step);
    let mut rng = Rng::new(5);
    for call in 0..5 {
        let args = [scalar(rng.uniform(-3.0, 3.0), &dev), scalar(rng.uniform(-3.0, 3.0), &dev)];
        let before = launches();
        let out = step.call(&args).unwrap();
        // The first call captures (and runs the flush); every later one launches the graph.
        assert_eq!(launches() - before, (call > 0) as u64, "call {call}");
        let eager = micrograd_step(&args);
        for (r, e) in out.iter().zip(&eager) {
            assert_eq!(bits(r), bits(e), "call {call}");
        }
    }
    let side = dev.new_stream();
    let two = Step::new(|a: &[Tensor]| {
        let h = side.scope(|| (&a[0] * 2.0).exp());
        vec![&h + &(&a[1] * 3.0)]
    });
    let before = launches();
    for _ in 0..3 {
        let args = [scalar(rng.uniform(-1.0, 1.0), &dev), scalar(rng.uniform(-1.0, 1.0), &dev)];
        let out = two.call(&args).unwrap();
        let want = (value(&args[0]) * 2.0).exp() + value(&args[1]) * 3.0;
        assert!((value(&out[0]) - want).abs() <= 1e-12 * want.abs());
    }
    assert!(dev.last_schedule().unwrap().dump().streams.len() >= 2, "the step used two streams");
    assert_eq!(launches(), before, "a step of two streams runs through the walker");
}

/// One step called from several threads at once: every replay gets its own arguments' results
/// (a device graph is launched outside the capture's lock, so replays may overlap).
#[test]
fn replays_of_one_step_from_several_threads_keep_their_results_apart() {
    let dev = braid::testing::test_device();
    let step = Step::new(|a: &[Tensor]| vec![(&a[0] * 2.0 + &a[1]).exp().sum_dim(1, false)]);
    let shape = [8, 64];
    let make = |seed: u64| {
        let mut rng = Rng::new(seed);
        let mut t = || {
            let v: Vec<f32> = (0..shape[0] * shape[1]).map(|_| rng.uniform(-1.0, 1.0) as f32).collect();
            Tensor::from_vec(v, shape, &dev)
        };
        [t(), t()]
    };
    drop(step.call(&make(1)).unwrap());
    std::thread::scope(|scope| {
        for thread in 0..4u64 {
            let (step, make) = (&step, &make);
            scope.spawn(move || {
                for call in 0..25 {
                    let args = make(100 * thread + call);
                    let out = step.call(&args).unwrap();
                    let eager = (&args[0] * 2.0 + &args[1]).exp().sum_dim(1, false);
                    assert_eq!(bits(&out[0]), bits(&eager), "thread {thread}, call {call}");
                }
            });
        }
    });
}

#[test]
fn replays_hold_no_memory_once_their_outputs_are_dropped() {
    let dev = braid::testing::test_device();
    let step = Step::new(|a: &[Tensor]| vec![(&a[0] * 2.0).tanh() + &a[0]]);
    let x = Tensor::rand([64, 64], -1.0, 1.0, DType::F32, &dev);
    // The capture, and the first replay (where a device records the plan into a graph that
    // keeps its memory while the step lives: CUDA).
    for _ in 0..2 {
        drop(step.call(std::slice::from_ref(&x)).unwrap());
    }
    let before = dev.memory().in_use;
    for _ in 0..10 {
        let out = step.call(std::slice::from_ref(&x)).unwrap();
        assert_eq!(out[0].dims(), &[64, 64]);
    }
    assert_eq!(dev.memory().in_use, before);
    // The dump of a replay is the captured schedule.
    assert_eq!(Some(dev.last_schedule().unwrap().kernel_count()), step.kernel_count(std::slice::from_ref(&x)));
}

/// A training step of a real model captured: the mini GPT's forward, backward and SGD update as
/// one `Step` (parameters in, loss and updated parameters out, as `jax.jit` steps are written)
/// gives the losses of the same steps run op by op with `braid::optim::Sgd`, captured once.
#[test]
fn a_captured_transformer_training_step_gives_the_op_by_op_losses() {
    let dev = braid::testing::test_device();
    let (tokens, ctx) = (mini_gpt::tokens(), mini_gpt::CONTEXT);
    let window = |i: usize| (&tokens[7 * i..7 * i + ctx], &tokens[7 * i + 1..7 * i + ctx + 1]);
    let model = mini_gpt::MiniGpt::new(&dev, 5);
    let params = model.params();
    let mut opt = braid::optim::Sgd::new(0.1);
    let eager: Vec<f32> = (0..4)
        .map(|i| {
            let loss = model.loss(window(i).0, window(i).1);
            let grads = loss.backward().unwrap();
            braid::optim::Optimizer::update(&mut opt, &params, &grads);
            loss.item::<f32>().unwrap()
        })
        .collect();

    let model = mini_gpt::MiniGpt::new(&dev, 5);
    let mut params: Vec<Tensor> = model.params().iter().cloned().collect();
    let n = params.len();
    let step = Step::new(move |args: &[Tensor]| mini_gpt::sgd_step(args, n, 0.1));
    let captured: Vec<f32> = (0..4)
        .map(|i| {
            let mut out = step.call(&model.step_args(&params, window(i).0, window(i).1)).unwrap();
            params = out.split_off(1);
            out[0].item::<f32>().unwrap()
        })
        .collect();
    assert_eq!(step.captures(), 1);
    assert!(eager[3] < eager[0], "the loss falls: {eager:?}");
    for (e, c) in eager.iter().zip(&captured) {
        assert!((e - c).abs() <= 1e-5 * e.abs(), "op by op {eager:?}, captured {captured:?}");
    }
}

/// Every replay publishes its own dump as the device's last schedule (a replay renumbers the
/// previous one in place when nobody holds it); a dump the program holds keeps its number.
#[test]
fn each_replay_is_the_last_schedule_with_its_own_flush_number() {
    let dev = braid::testing::test_device();
    let step = Step::new(|x: &[Tensor]| vec![(&x[0] * 2.0).exp()]);
    let x = scalar(0.5, &dev);
    step.call(std::slice::from_ref(&x)).unwrap();
    step.call(std::slice::from_ref(&x)).unwrap();
    let held = dev.last_schedule().unwrap();
    let (n, json) = (held.flush(), held.to_json());
    step.call(std::slice::from_ref(&x)).unwrap();
    let next = dev.last_schedule().unwrap();
    assert_eq!((held.flush(), held.to_json()), (n, json.clone()), "a held dump keeps its number and text");
    assert_eq!(next.flush(), n + 1);
    assert_eq!(next.kernel_count(), held.kernel_count());
    drop((held, next));
    for k in 2..5 {
        step.call(std::slice::from_ref(&x)).unwrap();
        let last = dev.last_schedule().unwrap();
        assert_eq!(last.flush(), n + k);
        let renumbered = json.replace(&format!("\"flush\": {n},"), &format!("\"flush\": {},", n + k));
        assert_ne!(renumbered, json, "the JSON names the flush");
        assert_eq!(last.to_json(), renumbered, "only the number changes");
    }
}
