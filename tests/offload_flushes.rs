//! Offloads that outlive their flush: under a memory budget, a value that later flushes still
//! need (pending work reads it) can end a flush in host memory and come back when a later
//! flush reads it. Reading a model's gradients one at a time (each read a flush of its own)
//! then meets the same budget as one flush computing them all, with the same bits.

mod common;

use braid::prelude::*;
use serde_json::Value as Json;

/// A device with fusion on (the budgets here are fractions of the fused plan's peak), as in
/// `tests/offload.rs`.
fn device() -> Device {
    let dev = braid::testing::test_device();
    dev.set_fusion(true);
    dev
}

/// Eight layers `h = h + gelu(h @ W)` of [384, 96] @ [96, 96], loss `mean(h^2)`; the gradients
/// of every weight, read one at a time (a flush each) in the order `order` gives; the device's
/// peak over what was in use before the step, and each read's schedule as JSON.
fn gradients_one_at_a_time(dev: &Device, order: &[usize]) -> Result<(Vec<Vec<f32>>, u64, Vec<Json>)> {
    dev.seed(41);
    let x = Tensor::randn([384, 96], DType::F32, dev);
    let ws: Vec<Tensor> =
        (0..8).map(|_| braid::no_grad(|| Tensor::randn([96, 96], DType::F32, dev) * 0.1).requires_grad()).collect();
    dev.sync()?;
    let before = dev.memory().in_use;
    dev.reset_peak();
    let grads = {
        let mut h = x.clone();
        for w in &ws {
            h = &h + &h.matmul(w).gelu();
        }
        let loss = h.square().mean();
        let grads = loss.backward()?;
        ws.iter().map(|w| grads.get(w).expect("a gradient for every weight")).collect::<Vec<_>>()
    };
    let mut values = vec![Vec::new(); grads.len()];
    let mut dumps = Vec::new();
    for &i in order {
        values[i] = grads[i].to_vec::<f32>()?;
        dumps.push(serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap());
    }
    Ok((values, dev.memory().peak.saturating_sub(before), dumps))
}

/// Offloads in a dump that leave their value in host memory for a later flush.
fn left_on_host(dump: &Json) -> usize {
    let offloads = dump["offloads"].as_array().unwrap();
    offloads.iter().filter(|o| o["back_before"] == braid::dump::LATER_FLUSH).count()
}

/// Inputs of a flush that an earlier one left in host memory (copied in before their reader).
fn copied_in(dump: &Json) -> usize {
    let buffers = dump["buffers"].as_array().unwrap();
    buffers.iter().filter(|b| b["external"] == true && b["space"] == "host").count()
}

/// The program: each read computes one gradient, and the activations the other
/// gradients need outlive that flush. Under half the unbudgeted peak they end it in host
/// memory and come back when a later read needs them; the gradients are the same bits.
#[test]
fn gradients_read_one_at_a_time_meet_half_the_peak_with_the_same_bits() {
    for order in [(0..8).collect::<Vec<_>>(), (0..8).rev().collect(), vec![3, 0, 7, 1, 6, 2, 5, 4]] {
        let dev = device();
        let (want, peak, plain) = gradients_one_at_a_time(&dev, &order).unwrap();
        assert!(plain.iter().all(|d| left_on_host(d) == 0 && copied_in(d) == 0), "no budget, no offloads");
        dev.set_memory_budget(Some(dev.memory().in_use + peak / 2));
        let (got, budgeted, dumps) = gradients_one_at_a_time(&dev, &order)
            .unwrap_or_else(|e| panic!("order {order:?}: half of the peak ({peak} bytes) refused: {e}"));
        assert!(budgeted <= peak / 2, "order {order:?}: peak {budgeted} over half of {peak}");
        assert_eq!(got, want, "order {order:?}: gradients differ under the budget");
        // The first read leaves activations in host memory; later reads copy them back in.
        assert!(left_on_host(&dumps[0]) > 0, "order {order:?}: {}", dumps[0]["offloads"]);
        assert!(dumps[1..].iter().any(|d| copied_in(d) > 0), "order {order:?}: nothing copied back in");
        for d in &dumps {
            let text = serde_json::to_string(d).unwrap();
            let dump = braid::ScheduleDump::from_json(&text).unwrap();
            assert!(dump.dump().inconsistencies().is_empty(), "{:?}", dump.dump().inconsistencies());
        }
    }
}

/// `a` (256 KiB, named by a tensor, idle after its sum) and `c` (512 KiB) are what the flush
/// leaves; under a budget below both, `a` stays in host memory. Returns `a`, `c` and the flush's dump.
fn left_behind(dev: &Device, budget: Option<u64>) -> (Tensor, Tensor, Json) {
    dev.seed(3);
    dev.set_memory_budget(budget);
    let n = 1 << 16;
    let a = Tensor::randn([n], DType::F32, dev).exp();
    // Of another shape than `a`, so not fused into `a`'s kernel: `a` is idle while it runs.
    let c = (Tensor::randn([2 * n], DType::F32, dev) * &a.sum()).tanh();
    c.to_vec::<f32>().unwrap();
    let dump = serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap();
    dev.set_memory_budget(None);
    (a, c, dump)
}

/// A value a tensor names, left in host memory by a flush over the budget, is the same value
/// everywhere afterwards: read, read by kernels on two streams of a later flush (copied in on
/// the first reader's stream, the other waiting for the copy), passed to a captured step, and
/// moved to another device; it takes no device memory until a flush copies it in.
#[test]
fn a_tensor_left_in_host_memory_is_the_same_value_everywhere() {
    let dev = device();
    let (plain_a, plain_c, plain) = left_behind(&dev, None);
    assert_eq!(left_on_host(&plain), 0);
    let (want_a, want_c) = (plain_a.to_vec::<f32>().unwrap(), plain_c.to_vec::<f32>().unwrap());
    drop((plain_a, plain_c));
    dev.sync().unwrap();
    let base = dev.memory().in_use;
    let bytes = 4 << 16;
    let (a, c, dump) = left_behind(&dev, Some(base + 2 * bytes + bytes / 2));
    assert_eq!(left_on_host(&dump), 1, "{}", dump["offloads"]);
    assert!(dev.memory().in_use < base + 3 * bytes, "`a` takes no device memory: {}", dev.memory().in_use);
    assert_eq!(a.to_vec::<f32>().unwrap(), want_a);
    assert_eq!(c.to_vec::<f32>().unwrap(), want_c);
    // Two streams read it in one flush.
    let side = dev.new_stream();
    let on_side = side.scope(|| a.sqrt());
    let here = &a * 2.0;
    let both = (&on_side + &here).to_vec::<f32>().unwrap();
    let next = dev.last_schedule().unwrap();
    assert_eq!(copied_in(&serde_json::from_str(&next.to_json()).unwrap()), 1, "{}", next.to_text());
    // The same kernels over the same value fresh from the host (not the host's sqrt: WGSL's
    // need not round as the host's does).
    let fresh = Tensor::from_vec(want_a.clone(), [1 << 16], &dev);
    let expect = (&side.scope(|| fresh.sqrt()) + &(&fresh * 2.0)).to_vec::<f32>().unwrap();
    assert_eq!(both, expect);
    let near = want_a.iter().zip(&expect).all(|(v, e)| (v.sqrt() + v * 2.0 - e).abs() <= 1e-5 * e.abs());
    assert!(near, "the two streams' sum is sqrt(a) + 2a");
    // A captured step, and another device.
    let step = braid::Step::new(|args: &[Tensor]| vec![&args[0] * 3.0]);
    for _ in 0..3 {
        let out = step.call(std::slice::from_ref(&a)).unwrap();
        assert_eq!(out[0].to_vec::<f32>().unwrap(), want_a.iter().map(|v| v * 3.0).collect::<Vec<_>>());
    }
    let other = Device::new_cpu();
    assert_eq!(a.to_device(&other).to_vec::<f32>().unwrap(), want_a);
    // Still in host memory: every flush above read a copy.
    let again = (&a + 0.0).to_vec::<f32>().unwrap();
    assert_eq!(again, want_a);
    assert_eq!(copied_in(&serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap()), 1);
}
