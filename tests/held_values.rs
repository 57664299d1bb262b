//! Values a tensor holds itself, outside the recorded graph: host data from `from_vec` and the
//! outputs of a replayed `Step`. Making, reading and dropping them takes no engine lock; every
//! other use (an op reading one, an in-place update, `detach`, `requires_grad`, a capture, a
//! transfer) records it as a leaf first, and then it behaves exactly as a recorded value:
//! results are checked against the reference interpreter on random inputs, and captures keep
//! refusing what they refused before.

mod common;

use braid::prelude::*;
use braid::{Error, Step, Stream};
use common::{Rng, check_recorded};
use std::sync::mpsc;
use std::time::Duration;

fn random(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect()
}

/// `2x + 1` as a captured step, and a tensor it returned from a replay (so held), with the
/// values it must hold.
fn replayed(dev: &Device, rng: &mut Rng, n: usize) -> (Tensor, Vec<f32>) {
    let step = Step::new(|a: &[Tensor]| vec![&a[0] * 2.0 + 1.0]);
    let data = random(rng, n);
    let x = Tensor::from_vec(data.clone(), [n], dev);
    drop(step.call(std::slice::from_ref(&x)).unwrap()); // the capture
    let out = step.call(std::slice::from_ref(&x)).unwrap().remove(0);
    (out, data.iter().map(|v| v * 2.0 + 1.0).collect())
}

/// Both kinds of held value, each with the values it holds.
fn held_values(dev: &Device, rng: &mut Rng) -> Vec<(&'static str, Tensor, Vec<f32>)> {
    let n = 1 + rng.below(300);
    let data = random(rng, n);
    let (out, want) = replayed(dev, rng, n);
    vec![("from_vec", Tensor::from_vec(data.clone(), [n], dev), data), ("step output", out, want)]
}

/// Runs `f` on another thread while this one holds `dev`'s engine lock: `Some` with its result
/// if it finished without the lock, `None` if it still waited after ten seconds.
fn without_the_engine_lock<R: Send + 'static>(dev: &Device, f: impl FnOnce() -> R + Send + 'static) -> Option<R> {
    let (tx, rx) = mpsc::channel();
    braid::testing::hold_engine_lock(dev, || {
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        rx.recv_timeout(Duration::from_secs(10)).ok()
    })
}

#[test]
fn held_values_are_made_read_and_dropped_without_the_engine_lock() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(1);
    for (what, t, want) in held_values(&dev, &mut rng) {
        let read = without_the_engine_lock(&dev, move || {
            let got = t.to_vec::<f32>().unwrap();
            drop(t);
            got
        });
        assert_eq!(read.as_deref(), Some(&want[..]), "{what}: read while the engine lock was held elsewhere");
    }
    let d = dev.clone();
    let made = without_the_engine_lock(&dev, move || Tensor::from_vec(vec![1.5f32, -2.0], [2], &d).to_vec::<f32>());
    assert_eq!(made.map(Result::unwrap), Some(vec![1.5, -2.0]));
}

#[test]
fn reading_host_data_a_tensor_holds_uploads_nothing() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(9);
    let data = random(&mut rng, 1 << 18);
    let t = Tensor::from_vec(data.clone(), [1 << 18], &dev);
    let before = dev.memory().in_use;
    assert_eq!(t.to_vec::<f32>().unwrap(), data);
    let one = Tensor::from_vec(vec![data[7]], (), &dev);
    assert_eq!(one.item::<f32>().unwrap(), data[7]);
    assert_eq!(dev.memory().in_use, before, "a read of host data allocated device memory");
    // Once an op reads it, it is on the device like any input.
    assert_eq!((&t * 1.0).to_vec::<f32>().unwrap(), data);
    assert_eq!(t.to_vec::<f32>().unwrap(), data);
}

#[test]
fn held_values_read_by_ops_compute_what_the_reference_interpreter_does() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(2);
    for round in 0..20 {
        for (what, t, want) in held_values(&dev, &mut rng) {
            let n = want.len();
            let other = Tensor::from_vec(random(&mut rng, n), [n], &dev);
            let y = match round % 4 {
                0 => (&t * 3.0).exp(),
                1 => (&t + &other).tanh() * &t,
                2 => t.sum(),
                _ => (&t - &other.relu()).max(),
            };
            check_recorded(&[&y]).unwrap_or_else(|e| panic!("{what}, round {round}: {e}"));
            // Recorded as a leaf, it still holds its values.
            assert_eq!(t.to_vec::<f32>().unwrap(), want, "{what}, round {round}");
        }
    }
}

#[test]
fn held_values_updated_in_place_detached_and_differentiated_behave_as_recorded_ones() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(3);
    for (what, t, want) in held_values(&dev, &mut rng) {
        let n = want.len();
        // In place: every clone sees the new version; a detached copy keeps the old one.
        let (clone, detached) = (t.clone(), t.detach());
        let delta = random(&mut rng, n);
        t.add_assign(&Tensor::from_vec(delta.clone(), [n], &dev));
        let updated: Vec<f32> = want.iter().zip(&delta).map(|(a, b)| a + b).collect();
        assert_eq!(clone.to_vec::<f32>().unwrap(), updated, "{what}: the clone after add_assign");
        assert_eq!(detached.to_vec::<f32>().unwrap(), want, "{what}: the detached copy");
        // Updating the detached copy leaves the original alone.
        detached.mul_assign(&Tensor::from_vec(vec![2.0f32; n], [n], &dev));
        assert_eq!(t.to_vec::<f32>().unwrap(), updated, "{what}: after the detached copy's update");

        // A held value marked for gradients: d(sum w^2)/dw = 2w.
        let (_, fresh, fresh_want) = held_values(&dev, &mut rng).remove(if what == "from_vec" { 0 } else { 1 });
        let w = fresh.requires_grad();
        let grads = (&w * &w).sum().backward().unwrap();
        let g = grads.get(&w).unwrap().to_vec::<f32>().unwrap();
        assert_eq!(g, fresh_want.iter().map(|v| 2.0 * v).collect::<Vec<_>>(), "{what}: gradient");
    }
}

#[test]
fn held_values_keep_the_stream_they_were_made_on_and_move_between_devices() {
    let dev = braid::testing::test_device();
    let side = dev.new_stream();
    let t = side.scope(|| Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &dev));
    assert_eq!(t.stream().id(), side.id());
    let step = Step::new(|a: &[Tensor]| vec![a[0].exp()]);
    let x = Tensor::from_vec(vec![0.5f32, -1.0], [2], &dev);
    drop(step.call(std::slice::from_ref(&x)).unwrap());
    let out = side.scope(|| step.call(std::slice::from_ref(&x)).unwrap().remove(0));
    assert_eq!(out.stream().id(), side.id());
    assert_eq!(Stream::current(&dev).id(), dev.default_stream().id());

    // To another device and back: the same values.
    let cpu = Device::new_cpu();
    let want = x.exp().to_vec::<f32>().unwrap();
    let moved = out.to_device(&cpu);
    assert_eq!(moved.to_vec::<f32>().unwrap(), want);
    let held_on_cpu = Tensor::from_vec(want.clone(), [2], &cpu);
    assert_eq!(held_on_cpu.to_device(&dev).to_vec::<f32>().unwrap(), want);
}

#[test]
fn a_held_value_used_by_several_threads_at_once_is_recorded_once() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(4);
    for _ in 0..10 {
        for (what, t, want) in held_values(&dev, &mut rng) {
            let sum: f64 = want.iter().map(|&v| f64::from(v)).sum();
            std::thread::scope(|s| {
                for k in 0..6 {
                    let (t, want) = (&t, &want);
                    s.spawn(move || match k % 3 {
                        0 => assert_eq!(t.to_vec::<f32>().unwrap(), *want, "{what}"),
                        1 => {
                            let got = (t + 1.0).to_vec::<f32>().unwrap();
                            assert_eq!(got, want.iter().map(|v| v + 1.0).collect::<Vec<_>>(), "{what}");
                        }
                        _ => {
                            let got = f64::from(t.sum().item::<f32>().unwrap());
                            assert!((got - sum).abs() <= 1e-4 * (1.0 + sum.abs()), "{what}: {got} against {sum}");
                        }
                    });
                }
            });
        }
    }
}

#[test]
fn a_steps_held_outputs_feed_its_next_replays_as_an_eager_loop_does() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(5);
    let update = |w: &Tensor, x: &Tensor| {
        let loss = (&w.matmul(x) - 1.0).powf(2.0).mean();
        let g = loss.backward().unwrap().get(w).unwrap();
        (w.detach() - g * 0.1, loss)
    };
    let step = Step::new(|a: &[Tensor]| {
        let (w, loss) = update(&a[0].detach().requires_grad(), &a[1]);
        vec![w, loss]
    });
    let w0 = random(&mut rng, 12);
    let x = Tensor::from_vec(random(&mut rng, 8), [4, 2], &dev);
    let (mut w, mut eager) = (Tensor::from_vec(w0.clone(), [3, 4], &dev), Tensor::from_vec(w0, [3, 4], &dev));
    for i in 0..6 {
        let out = step.call(&[w.clone(), x.clone()]).unwrap();
        let (next, loss) = update(&eager.detach().requires_grad(), &x);
        assert_eq!(out[1].item::<f32>().unwrap().to_bits(), loss.item::<f32>().unwrap().to_bits(), "loss {i}");
        assert_eq!(out[0].to_vec::<f32>().unwrap(), next.to_vec::<f32>().unwrap(), "weights {i}");
        (w, eager) = (out[0].clone(), next);
    }
    assert_eq!(step.captures(), 1);
}

#[test]
fn a_held_output_passed_twice_is_one_aliased_argument() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(6);
    let step = Step::new(|a: &[Tensor]| vec![&a[0] * &a[1] + &a[0]]);
    let (h, want) = replayed(&dev, &mut rng, 16);
    let (h2, want2) = replayed(&dev, &mut rng, 16);
    let square: Vec<f32> = want.iter().map(|v| v * v + v).collect();
    assert_eq!(step.call(&[h.clone(), h.clone()]).unwrap()[0].to_vec::<f32>().unwrap(), square);
    // Replayed with the same aliasing, then captured again for two different values.
    let (h3, want3) = replayed(&dev, &mut rng, 16);
    let square3: Vec<f32> = want3.iter().map(|v| v * v + v).collect();
    assert_eq!(step.call(&[h3.clone(), h3]).unwrap()[0].to_vec::<f32>().unwrap(), square3);
    assert_eq!(step.captures(), 1);
    let mixed: Vec<f32> = want.iter().zip(&want2).map(|(a, b)| a * b + a).collect();
    assert_eq!(step.call(&[h, h2]).unwrap()[0].to_vec::<f32>().unwrap(), mixed);
    assert_eq!(step.captures(), 2);
}

#[test]
fn captures_refuse_held_values_from_outside_as_they_refuse_recorded_ones() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(7);
    for (what, t, want) in held_values(&dev, &mut rng) {
        let n = want.len();
        let arg = Tensor::from_vec(random(&mut rng, n), [n], &dev);
        // Read inside without being an argument.
        let outside = t.clone();
        let step = Step::new(move |a: &[Tensor]| vec![&a[0] + &outside]);
        match step.call(std::slice::from_ref(&arg)) {
            Err(Error::Capture(m)) => assert!(m.contains("not one of its arguments"), "{what}: {m}"),
            other => panic!("{what}: a step reading a held value from outside gave {other:?}"),
        }
        // Updated in place inside: refused, and the value is as it was.
        let outside = t.clone();
        let step = Step::new(move |a: &[Tensor]| {
            outside.add_assign(&a[0]);
            vec![a[0].exp()]
        });
        match step.call(std::slice::from_ref(&arg)) {
            Err(Error::Capture(m)) => assert!(m.contains("in-place update"), "{what}: {m}"),
            other => panic!("{what}: a step updating a held value from outside gave {other:?}"),
        }
        assert_eq!(t.to_vec::<f32>().unwrap(), want, "{what}");
        // Host data made inside the step is a constant of it, as before.
        let step = Step::new(|a: &[Tensor]| {
            vec![&a[0] + &Tensor::from_vec(vec![1.0f32; a[0].numel()], [a[0].numel()], a[0].device())]
        });
        for _ in 0..2 {
            let got = step.call(std::slice::from_ref(&arg)).unwrap()[0].to_vec::<f32>().unwrap();
            assert_eq!(got, arg.to_vec::<f32>().unwrap().iter().map(|v| v + 1.0).collect::<Vec<_>>());
        }
    }
}

#[test]
fn held_values_give_their_memory_back_when_dropped_unread() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(8);
    let (first, _) = replayed(&dev, &mut rng, 1000);
    drop(first);
    let before = dev.memory().in_use;
    for _ in 0..5 {
        let (out, _) = replayed(&dev, &mut rng, 1000);
        drop(out);
        drop(Tensor::from_vec(random(&mut rng, 1000), [1000], &dev));
    }
    assert_eq!(dev.memory().in_use, before);
}
