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
