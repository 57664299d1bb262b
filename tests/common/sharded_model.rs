//! The model the sharded suites train (`tests/sharded.rs`, `tests/sharded_hybrid.rs`), included
//! by path: three units of odd sizes (one used first and last, one read transposed), one
//! AdamW step of it on one device and sharded, and the comparison of the two.

use braid::dist::{Group, Reduce, Sharded};
use braid::nn::Params;
use braid::optim::AdamW;
use braid::prelude::*;

use super::common::Rng;
use super::group::close;

pub fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-1.0, 1.0) as f32).collect()
}

/// The model's units: unit 0 the input layer and the output head (used first and last, as
/// tied embeddings are), unit 1 a layer with a gain, unit 2 a layer read transposed. Odd sizes,
/// so that parameters do not split evenly over the ranks.
pub fn init(rng: &mut Rng, device: &Device) -> Vec<Params> {
    let mut t = |name: &str, dims: &[usize]| {
        let n: usize = dims.iter().product();
        (name.to_string(), Tensor::from_vec(random(rng, n), dims, device) * 0.5)
    };
    let units = [
        vec![t("in.w", &[7, 12]), t("in.b", &[12]), t("out.w", &[12, 3])],
        vec![t("h1.w", &[12, 12]), t("h1.b", &[12]), t("h1.gain", &[12])],
        vec![t("h2.w", &[12, 12]), t("h2.b", &[5 + 7])],
    ];
    units
        .into_iter()
        .map(|unit| {
            let mut p = Params::new();
            for (name, t) in unit {
                p.push(name, &t);
            }
            p
        })
        .collect()
}

/// The loss over `x [rows, 7]`, `y [rows, 3]`, the units' parameters coming from `unit(u)`
/// (called where unit `u`'s forward pass starts).
pub fn loss(mut unit: impl FnMut(usize) -> Vec<Tensor>, x: &Tensor, y: &Tensor) -> Tensor {
    let u0 = unit(0);
    let h = (x.matmul(&u0[0]) + &u0[1]).tanh();
    let u1 = unit(1);
    let h = ((h.matmul(&u1[0]) + &u1[1]) * &u1[2]).tanh();
    let u2 = unit(2);
    let h = (h.matmul(&u2[0].t()) + &u2[1]).tanh();
    (h.matmul(&u0[2]) - y).square().mean()
}

/// Every rank's loss on `rows` random rows of its own (one rank per device of `devices`).
pub fn rank_losses(sharded: &mut Sharded, devices: &[Device], rng: &mut Rng, rows: usize) -> Vec<Tensor> {
    (0..devices.len())
        .map(|i| {
            let x = Tensor::from_vec(random(rng, rows * 7), [rows, 7], &devices[i]);
            let y = Tensor::from_vec(random(rng, rows * 3), [rows, 3], &devices[i]);
            loss(|u| sharded.gather(i, u), &x, &y)
        })
        .collect()
}

/// One AdamW step of the whole model on one device over `x [rows, 7]`, `y [rows, 3]` (host
/// values); its loss.
pub fn single_step(single: &[Vec<Tensor>], opt: &mut AdamW, xv: &[f32], yv: &[f32]) -> f32 {
    let device = single[0][0].device();
    let rows = xv.len() / 7;
    let x = Tensor::from_vec(xv.to_vec(), [rows, 7], device);
    let y = Tensor::from_vec(yv.to_vec(), [rows, 3], device);
    let want = loss(|u| single[u].clone(), &x, &y);
    let grads = want.backward().unwrap();
    let mut flat: Vec<Tensor> = single.concat();
    opt.step(&mut flat, &grads);
    want.item::<f32>().unwrap()
}

/// One sharded AdamW step over the same rows, each rank of `world` (this process's ranks in
/// `sharded`'s order) given its equal share of them (from the host: not moved from another
/// rank's device, see `braid::dist`); the mean of the ranks' losses.
pub fn sharded_step(world: &Group, sharded: &mut Sharded, opts: &mut [AdamW], xv: &[f32], yv: &[f32]) -> f32 {
    let local = world.devices().to_vec();
    let rows = xv.len() / 7 / world.size();
    let losses: Vec<Tensor> = (0..local.len())
        .map(|i| {
            let r = world.ranks()[i];
            let xs = Tensor::from_vec(xv[r * rows * 7..(r + 1) * rows * 7].to_vec(), [rows, 7], &local[i]);
            let ys = Tensor::from_vec(yv[r * rows * 3..(r + 1) * rows * 3].to_vec(), [rows, 3], &local[i]);
            loss(|u| sharded.gather(i, u), &xs, &ys)
        })
        .collect();
    let grads = sharded.backward(&losses).unwrap();
    for (i, opt) in opts.iter_mut().enumerate() {
        opt.step(sharded.shards_mut(i), &grads[i]);
    }
    world.all_reduce(&losses, Reduce::Mean)[0].item::<f32>().unwrap()
}

/// Asserts that every parameter of `sharded`, gathered on each of its ranks, is within 1e-5
/// of `single`'s (the units `units` laid out as the model's).
pub fn assert_same_params(sharded: &Sharded, single: &[Vec<Tensor>], units: &[Params], after: &str) {
    let gathered = sharded.params();
    for (u, unit) in single.iter().enumerate() {
        for (k, p) in unit.iter().enumerate() {
            let want = p.to_vec::<f32>().unwrap();
            for (i, params) in gathered.iter().enumerate() {
                let (name, t) = params.named().nth(units[..u].iter().map(Params::len).sum::<usize>() + k).unwrap();
                assert_eq!(t.dims(), p.dims(), "{name}");
                close(&t.to_vec::<f32>().unwrap(), &want, 1e-5)
                    .unwrap_or_else(|e| panic!("{name} on rank {} {after}: {e}", sharded.group().ranks()[i]));
            }
        }
    }
}

/// Trains for 20 AdamW steps on `reference` (one device, the whole batch) and sharded over
/// `world` as `shard` shards the model (this process's ranks given their rows), comparing
/// losses at every step and every parameter at the end; returns the sharded model.
pub fn train_and_compare(world: &Group, reference: &Device, shard: impl FnOnce(&[Params]) -> Sharded) -> Sharded {
    let n = world.size();
    let mut rng = Rng::new(11);
    let units = init(&mut rng, reference);
    let single: Vec<Vec<Tensor>> = units.iter().map(|u| u.iter().map(|t| t.requires_grad()).collect()).collect();
    let mut sharded = shard(&units);
    let mut opt_single = AdamW::new(0.01);
    let mut opts: Vec<AdamW> = world.devices().iter().map(|_| AdamW::new(0.01)).collect();
    let rows = 4;
    for step in 0..20 {
        let (xv, yv) = (random(&mut rng, n * rows * 7), random(&mut rng, n * rows * 3));
        let want = single_step(&single, &mut opt_single, &xv, &yv);
        let mean = sharded_step(world, &mut sharded, &mut opts, &xv, &yv);
        assert!((mean - want).abs() <= 1e-5 * (1.0 + want.abs()), "step {step}: loss {mean} vs {want}");
    }
    assert_same_params(&sharded, &single, &units, "after 20 steps");
    sharded
}

/// `layers` units of one random `[width, width]` weight each (scaled by `scale`), for
/// [`deep_loss`].
pub fn square_units(rng: &mut Rng, layers: usize, width: usize, scale: f64, device: &Device) -> Vec<Params> {
    (0..layers)
        .map(|l| {
            let mut p = Params::new();
            p.push(
                format!("layer{l}.w"),
                &(Tensor::from_vec(random(rng, width * width), [width, width], device) * scale),
            );
            p
        })
        .collect()
}

/// A stack of `layers` units of one `[width, width]` weight each, read transposed by every
/// other layer.
pub fn deep_loss(mut unit: impl FnMut(usize) -> Vec<Tensor>, layers: usize, x: &Tensor) -> Tensor {
    let mut h = x.clone();
    for l in 0..layers {
        let w = &unit(l)[0];
        h = if l % 2 == 0 { h.matmul(w) } else { h.matmul(&w.t()) }.tanh();
    }
    h.square().mean()
}
