//! The plan cache: a flush structurally identical to an earlier one reuses its plan (and the
//! results stay right); anything that changes the structure is planned anew.

use braid::prelude::*;

fn step(dev: &Device, w: &Tensor, x: &[f32]) -> f32 {
    let xt = Tensor::from_vec(x.to_vec(), [4, 8], dev);
    let h = (xt.matmul(w) + 0.5).relu();
    h.softmax(1).sum().item::<f32>().unwrap() + h.sum().item::<f32>().unwrap()
}

#[test]
fn repeated_flushes_reuse_their_plan_and_stay_correct() {
    let dev = braid::testing::test_device();
    let w = Tensor::from_vec((0..64).map(|i| (i as f32 * 0.1).sin()).collect::<Vec<_>>(), [8, 8], &dev);
    w.to_vec::<f32>().unwrap();
    let inputs: Vec<Vec<f32>> = (0..5).map(|k| (0..32).map(|i| ((i + 7 * k) as f32 * 0.37).cos()).collect()).collect();
    let (h0, m0) = dev.plan_cache_stats();
    let cached: Vec<f32> = inputs.iter().map(|x| step(&dev, &w, x)).collect();
    let (h1, m1) = dev.plan_cache_stats();
    assert!(h1 - h0 >= 8, "later iterations hit the cache ({} hits, {} misses)", h1 - h0, m1 - m0);
    assert!(m1 - m0 <= 2, "only the first iteration plans ({} misses)", m1 - m0);
    // The same computations on a device without history give the same numbers.
    for (x, got) in inputs.iter().zip(&cached) {
        let fresh = braid::testing::test_device();
        let wf = Tensor::from_vec(w.to_vec::<f32>().unwrap(), [8, 8], &fresh);
        assert_eq!(step(&fresh, &wf, x), *got);
    }
}

#[test]
fn a_different_structure_or_constant_is_planned_anew() {
    let dev = braid::testing::test_device();
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &dev);
    x.to_vec::<f32>().unwrap();
    assert_eq!((&x * 2.0).to_vec::<f32>().unwrap(), vec![2.0, 4.0, 6.0]);
    let (_, m0) = dev.plan_cache_stats();
    assert_eq!((&x * 3.0).to_vec::<f32>().unwrap(), vec![3.0, 6.0, 9.0], "a new constant is a new plan");
    assert_eq!((&x + 3.0).to_vec::<f32>().unwrap(), vec![4.0, 5.0, 6.0]);
    let (h1, m1) = dev.plan_cache_stats();
    assert_eq!(m1 - m0, 2);
    assert_eq!((&x * 3.0).to_vec::<f32>().unwrap(), vec![3.0, 6.0, 9.0]);
    assert_eq!(dev.plan_cache_stats().0, h1 + 1);
}
