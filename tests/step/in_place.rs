//! Steps that update their arguments in place (`scatter_assign`, `add_assign`, ... on an
//! argument inside the function): every replay updates the argument again, as calling the
//! function would; where nothing else reads the argument's value the update is written where it
//! lies (a key/value cache's new row a token, never a copy of the cache), and otherwise on a
//! private copy, so that other readers keep the old value.

use braid::Step;
use braid::prelude::*;
use braid::testing::buffer_identity;

/// `cache [4, 3]` with row `new [1, 3]` written at position `at [1, 3]` (I32), and the rows'
/// sums: a decode step's shape in small.
fn write_and_read(a: &[Tensor]) -> Vec<Tensor> {
    a[0].scatter_assign(0, &a[1], &a[2]);
    vec![a[0].sum_dim(1, false)]
}

fn at(p: i32, dev: &Device) -> Tensor {
    Tensor::from_vec(vec![p; 3], [1, 3], dev)
}

#[test]
fn an_argument_updated_in_place_is_written_where_it_lies_at_every_replay() {
    let dev = braid::testing::test_device();
    let step = Step::new(write_and_read);
    let cache = Tensor::from_vec((0..12).map(|v| v as f32).collect(), [4, 3], &dev);
    // The same updates made by the function called directly, on another tensor.
    let eager = Tensor::from_vec((0..12).map(|v| v as f32).collect(), [4, 3], &dev);
    let first = buffer_identity(&cache).unwrap();
    for (p, v) in [(2, 10.0f32), (0, -1.0), (3, 0.5), (2, 7.0)] {
        let row = Tensor::from_vec(vec![v, v + 1.0, v + 2.0], [1, 3], &dev);
        let sums = step.call(&[cache.clone(), at(p, &dev), row.clone()]).unwrap();
        let expected = write_and_read(&[eager.clone(), at(p, &dev), row]);
        assert_eq!(sums[0].to_vec::<f32>().unwrap(), expected[0].to_vec::<f32>().unwrap());
        assert_eq!(cache.to_vec::<f32>().unwrap(), eager.to_vec::<f32>().unwrap());
        assert_eq!(buffer_identity(&cache).unwrap(), first, "the cache was copied, not updated where it lies");
    }
    assert_eq!(step.captures(), 1);
    // A scatter and a reduction: the copy of the base is skipped at run time, not planned away.
    assert_eq!(step.kernel_count(&[cache.clone(), at(0, &dev), at(0, &dev).to_dtype(DType::F32)]), Some(2));
}

#[test]
fn an_argument_whose_value_is_read_elsewhere_is_updated_on_a_copy() {
    let dev = braid::testing::test_device();
    let step = Step::new(write_and_read);
    let cache = Tensor::from_vec((0..12).map(|v| v as f32).collect(), [4, 3], &dev);
    let row = Tensor::from_vec(vec![-5.0f32; 3], [1, 3], &dev);
    for call in 0..3 {
        // Another tensor of the argument's value, and a reader recorded before the call.
        let backup = cache.detach();
        let before = backup.to_vec::<f32>().unwrap();
        let pending_sum = cache.sum();
        let identity = buffer_identity(&cache).unwrap();
        step.call(&[cache.clone(), at(call, &dev), row.clone()]).unwrap();
        assert_eq!(backup.to_vec::<f32>().unwrap(), before, "call {call}: the old value was written over");
        let old_sum: f32 = before.iter().sum();
        assert_eq!(pending_sum.item::<f32>().unwrap(), old_sum);
        assert_ne!(buffer_identity(&cache).unwrap(), identity);
        let mut expected = before.clone();
        expected[call as usize * 3..call as usize * 3 + 3].copy_from_slice(&[-5.0; 3]);
        assert_eq!(cache.to_vec::<f32>().unwrap(), expected);
    }
}

#[test]
fn a_training_step_updates_its_parameters_in_place_as_the_function_would() {
    let dev = braid::testing::test_device();
    dev.seed(3);
    // SGD on a least-squares fit, the update inside the step (as an optimizer's `step` is).
    let train = |a: &[Tensor]| {
        let w = a[0].detach().requires_grad();
        let loss = (&a[1].matmul(&w) - &a[2]).powf(2.0).mean();
        let grads = loss.backward().unwrap();
        braid::no_grad(|| a[0].sub_assign(&(&grads.get(&w).unwrap() * 0.1)));
        vec![loss]
    };
    let step = Step::new(train);
    let x = Tensor::randn([8, 4], DType::F32, &dev);
    let y = Tensor::randn([8, 2], DType::F32, &dev);
    let w = Tensor::randn([4, 2], DType::F32, &dev);
    let eager = w.detach();
    for _ in 0..5 {
        let loss = step.call(&[w.clone(), x.clone(), y.clone()]).unwrap();
        let expected = train(&[eager.clone(), x.clone(), y.clone()]);
        assert_eq!(loss[0].item::<f32>().unwrap(), expected[0].item::<f32>().unwrap());
        assert_eq!(w.to_vec::<f32>().unwrap(), eager.to_vec::<f32>().unwrap());
    }
    assert_eq!(step.captures(), 1);
}

/// A random program of `tests/step.rs` whose step also updates its state argument in place (an
/// add, an assign, or a row written by a scatter), replayed against the same function run op by
/// op on a twin of the state: outputs and states equal bit for bit at every call, with work on
/// two streams; now and then another tensor holds the state's old value across a call, which
/// must keep it.
#[test]
fn random_steps_that_update_their_state_replay_like_eager_runs() {
    use super::{Rng, bits, random_args, random_program, run_program};
    for seed in 0..24u64 {
        let dev = braid::testing::test_device();
        let side = dev.new_stream();
        let mut rng = Rng::new(5000 + seed);
        let len = 2 + rng.below(8);
        let program = random_program(&mut rng, len);
        let (grad, update) = (rng.chance(0.5), rng.below(3));
        let (rows, cols) = (1 + rng.below(6), 1 + rng.below(9));
        // Arguments: x, the state, the [cols, cols] matrix, the row to write.
        let f = |a: &[Tensor]| {
            let outs = run_program(&program, &a[..3], &side, grad);
            let last = &outs[0];
            // Without gradient history, as a state (an optimizer's moments, a cache) is kept.
            braid::no_grad(|| match update {
                0 => a[1].add_assign(&(last * 0.5)),
                1 => a[1].assign(&last.tanh()),
                _ => a[1].scatter_assign(0, &a[3], &last.narrow(0, 0, 1)),
            });
            outs
        };
        let step = Step::new(f);
        let init = random_args(&mut rng, &dev, rows, cols).swap_remove(1);
        let (state, twin) = (init.detach(), init.detach());
        drop(init);
        for call in 0..4 {
            let mut args = random_args(&mut rng, &dev, rows, cols);
            let row = rng.below(rows) as i32;
            let at = Tensor::from_vec(vec![row; cols], [1, cols], &dev);
            let held = rng.chance(0.3).then(|| (state.detach(), state.to_vec::<f32>().unwrap()));
            args[1] = state.clone();
            args.push(at.clone());
            let replayed = step.call(&args).unwrap_or_else(|e| panic!("seed {seed}: {e}\n{program:?}"));
            args[1] = twin.clone();
            let eager = f(&args);
            for (r, e) in replayed.iter().zip(&eager) {
                assert_eq!(bits(r), bits(e), "seed {seed}, call {call}, update {update}: {program:?}");
            }
            assert_eq!(bits(&state), bits(&twin), "seed {seed}, call {call}, update {update}: the states differ");
            if let Some((old, values)) = held {
                assert_eq!(old.to_vec::<f32>().unwrap(), values, "seed {seed}, call {call}: a held value changed");
            }
        }
        assert_eq!(step.captures(), 1, "seed {seed}");
    }
}

/// An argument updated with a value that has gradient history (not under `no_grad`): the step
/// captures (autograd's kept values are released, not a tensor the step leaks), and the
/// argument carries no history after any call, as outputs carry none.
#[test]
fn an_argument_updated_with_a_differentiable_value_keeps_no_history() {
    let dev = braid::testing::test_device();
    let step = Step::new(|a: &[Tensor]| {
        let w = a[0].detach().requires_grad();
        let y = (&w * 2.0).tanh();
        a[1].assign(&y);
        vec![y.sum().backward().unwrap().get(&w).unwrap()]
    });
    let state = Tensor::zeros([3], DType::F32, &dev);
    for v in [0.5f32, -1.0, 0.25] {
        let x = Tensor::from_vec(vec![v, 2.0 * v, -v], [3], &dev);
        let grad = step.call(&[x, state.clone()]).unwrap();
        assert!(!state.needs_grad());
        let want: Vec<f32> = [v, 2.0 * v, -v].iter().map(|x| (2.0 * x).tanh()).collect();
        // Within a few ulps: a device's tanh is not Rust's.
        let near = |got: Vec<f32>, want: &[f32]| got.iter().zip(want).all(|(g, w)| (g - w).abs() < 1e-6);
        assert!(near(state.to_vec::<f32>().unwrap(), &want));
        let d: Vec<f32> = want.iter().map(|t| 2.0 * (1.0 - t * t)).collect();
        assert!(near(grad[0].to_vec::<f32>().unwrap(), &d));
    }
    assert_eq!(step.captures(), 1);
}
