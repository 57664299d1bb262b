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

/// One step on two streams made for it: a product on one, a map on the other, joined on the
/// default stream; returns the result and the last flush's dump.
fn step_on_new_streams(dev: &Device, w: &Tensor, x: &Tensor, swap: bool) -> (Vec<f32>, serde_json::Value, [u32; 2]) {
    let (mut s1, mut s2) = (dev.new_stream(), dev.new_stream());
    if swap {
        std::mem::swap(&mut s1, &mut s2);
    }
    let a = s1.scope(|| x.matmul(w).tanh());
    let b = s2.scope(|| (x * 2.0).exp().neg());
    let y = (&a + &b).to_vec::<f32>().unwrap();
    let dump = serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap();
    (y, dump, [s1.id(), s2.id()])
}

#[test]
fn new_streams_every_step_reuse_the_plan_on_the_new_streams() {
    let dev = braid::testing::test_device();
    let w = Tensor::from_vec((0..64).map(|i| (i as f32 * 0.3).sin()).collect::<Vec<_>>(), [8, 8], &dev);
    let x = Tensor::from_vec((0..32).map(|i| (i as f32 * 0.7).cos()).collect::<Vec<_>>(), [4, 8], &dev);
    w.to_vec::<f32>().unwrap();
    x.to_vec::<f32>().unwrap();
    let (first, _, _) = step_on_new_streams(&dev, &w, &x, false);
    let (h0, m0) = dev.plan_cache_stats();
    for _ in 0..4 {
        let (y, dump, [s1, s2]) = step_on_new_streams(&dev, &w, &x, false);
        assert_eq!(y, first, "a reused plan computes the same values");
        let streams: Vec<u64> = dump["streams"].as_array().unwrap().iter().map(|s| s["id"].as_u64().unwrap()).collect();
        assert!(
            streams.contains(&(s1 as u64)) && streams.contains(&(s2 as u64)),
            "the dump shows this step's streams {s1} and {s2}: {streams:?}"
        );
        let reasons: Vec<&str> =
            dump["fusion"]["refused"].as_array().unwrap().iter().map(|r| r["reason"].as_str().unwrap()).collect();
        assert!(
            reasons.iter().all(|r| !r.starts_with("different streams")
                || r.contains(&s1.to_string())
                || r.contains(&s2.to_string())),
            "refusals name this step's streams: {reasons:?}"
        );
    }
    let (h1, m1) = dev.plan_cache_stats();
    assert_eq!(m1 - m0, 0, "steps on new streams are not planned anew ({} hits)", h1 - h0);
    // The product on the second-made stream and the map on the first: another structure,
    // planned anew and right.
    let (swapped, _, _) = step_on_new_streams(&dev, &w, &x, true);
    assert_eq!(dev.plan_cache_stats().1, m1 + 1, "streams in another order are another plan");
    assert_eq!(swapped, first);
}
