//! Several devices at once: each has its own engine (graph, lock, plans), so independent devices
//! never wait on one another; values and events cross between them lazily.

mod common;

use braid::prelude::*;
use braid_devices::runtime::Flush;
use braid_devices::{Backend, DeviceError, cpu::CpuDevice};
use braid_scheduler::Schedule;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// While one device's engine lock is held, another device records, flushes and reads.
#[test]
fn a_device_works_while_another_devices_engine_is_locked() {
    let (a, b) = (Device::new_cpu(), Device::new_cpu());
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], [3], &a);
    let done = braid::testing::hold_engine_lock(&a, || {
        let (tx, rx) = mpsc::channel();
        let b = b.clone();
        std::thread::spawn(move || {
            let y = (Tensor::from_vec(vec![1.0f32, 2.0], [2], &b).exp() * 2.0).sum();
            tx.send(y.item::<f32>().unwrap()).unwrap();
        });
        rx.recv_timeout(Duration::from_secs(30))
    });
    let got = done.expect("device b waited for device a's lock");
    assert!((got - 2.0 * (1f32.exp() + 2f32.exp())).abs() < 1e-5);
    assert_eq!((&x + 1.0).to_vec::<f32>().unwrap(), vec![2.0, 3.0, 4.0]);
}

/// A CPU backend whose flushes each wait, inside the runtime, until `expected` flushes are
/// executing at once (or time out): flushes that could not overlap would fail.
struct Rendezvous {
    cpu: CpuDevice,
    arrived: Arc<(Mutex<usize>, Condvar)>,
    expected: usize,
}

impl Backend for Rendezvous {
    fn name(&self) -> String {
        "rendezvous".into()
    }
    common::cpu_backend_methods!();
    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        let (count, cv) = &*self.arrived;
        let mut n = count.lock().unwrap();
        *n += 1;
        cv.notify_all();
        let (n, timeout) = cv.wait_timeout_while(n, Duration::from_secs(30), |n| *n < self.expected).unwrap();
        drop(n);
        if timeout.timed_out() {
            return Err(DeviceError::Internal("the other device's flush never overlapped this one".into()));
        }
        self.cpu.begin(schedule, poison)
    }
}

/// Two devices on two threads, recording and reading at the same time: both flushes are inside
/// their devices' runtimes at once.
#[test]
fn flushes_of_two_devices_on_two_threads_overlap() {
    let arrived = Arc::new((Mutex::new(0), Condvar::new()));
    let devices: Vec<Device> = (0..2)
        .map(|_| {
            let backend = Rendezvous { cpu: CpuDevice::new(), arrived: arrived.clone(), expected: 2 };
            braid::testing::device_with_backend(Arc::new(backend))
        })
        .collect();
    let handles: Vec<_> = devices
        .into_iter()
        .enumerate()
        .map(|(i, dev)| {
            std::thread::spawn(move || {
                let x = Tensor::from_vec((0..1000).map(|v| (v + i) as f32).collect(), [1000], &dev);
                ((&x * 2.0) + 1.0).sum().item::<f32>()
            })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap().expect("both flushes ran at the same time");
        let expected: f32 = (0..1000).map(|v| (v + i) as f32 * 2.0 + 1.0).sum();
        assert!((got - expected).abs() <= 1e-6 * expected, "{got} vs {expected}");
    }
}

/// A value moves between devices lazily: pending work on the source runs when the destination
/// needs it, and in-place updates of the source afterwards do not change what was moved.
#[test]
fn transfers_between_devices_are_lazy_and_see_the_version_they_were_recorded_with() {
    let (a, b) = (Device::new_cpu(), Device::new_cpu());
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [4], &a);
    let y = &x * 10.0; // pending on a
    let moved = y.to_device(&b);
    y.add_assign(&Tensor::ones([4], DType::F32, &a)); // a new version of y on a
    assert_eq!(a.kernels_launched(), 0, "recording ran nothing");
    let z = (&moved + 0.5).to_vec::<f32>().unwrap();
    assert_eq!(z, vec![10.5, 20.5, 30.5, 40.5]);
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![11.0, 21.0, 31.0, 41.0]);
    // Gradients flow back across the move.
    let w = Tensor::from_vec(vec![1.0f64, -2.0], [2], &a).requires_grad();
    let loss = (w.to_device(&b) * 3.0).sum();
    let g = loss.backward().unwrap().get(&w).unwrap();
    assert_eq!(*g.device(), a);
    assert_eq!(g.to_vec::<f64>().unwrap(), vec![3.0, 3.0]);
}

/// A stream of one device waits for an event of another: work after the wait runs only once
/// the other device reached the event.
#[test]
fn a_stream_waits_for_another_devices_event() {
    let (a, b) = (Device::new_cpu(), Device::new_cpu());
    let x = Tensor::from_vec(vec![2.0f32; 8], [8], &a);
    let y = x.exp();
    let event = a.default_stream().record_event();
    b.default_stream().wait_event(&event);
    let z = Tensor::from_vec(vec![1.0f32; 8], [8], &b) * 3.0;
    assert_eq!(a.kernels_launched(), 0, "recording ran nothing");
    assert_eq!(z.to_vec::<f32>().unwrap(), vec![3.0; 8]);
    // Reading z needed the event: y was computed on a by then.
    assert_eq!(a.kernels_launched(), 1);
    event.synchronize().unwrap();
    assert!((y.to_vec::<f32>().unwrap()[0] - 2f32.exp()).abs() < 1e-6);
}

/// Another CPU device's value read in place (both address host memory, so `to_device` copies
/// nothing) lives in that device's memory: it counts in neither this device's planned peak nor
/// its budget, the dump says so (`"space": "remote"`), and this device never frees, overwrites
/// or offloads it. Here `b` holds `exp(x)` and the product (524,288 bytes) besides `x`
/// (262,144 bytes, `a`'s): a budget of 600,000 is reachable only without `x`.
#[test]
fn another_cpu_devices_value_read_in_place_takes_none_of_this_devices_memory() {
    let (a, b) = (Device::new_cpu(), Device::new_cpu());
    b.set_fusion(true);
    a.seed(4);
    let x = Tensor::randn([256, 256], DType::F32, &a);
    let want = x.to_vec::<f32>().unwrap();
    let y = {
        // Dropped before the flush: no tensor names the moved value, so nothing copies it.
        let moved = x.to_device(&b);
        (moved.exp().matmul(&moved) + &moved).sum()
    };
    b.set_memory_budget(Some(600_000));
    b.reset_peak();
    let got = y.item::<f32>().unwrap_or_else(|e| panic!("{e}"));
    let schedule = b.last_schedule().unwrap();
    let text = schedule.to_text();
    assert_eq!(schedule.planned_peak_bytes(), 2 * 262_144, "{text}");
    assert!(b.memory().peak <= 600_000, "measured {}\n{text}", b.memory().peak);
    let dump: serde_json::Value = serde_json::from_str(&schedule.to_json()).unwrap();
    let foreign: Vec<&serde_json::Value> =
        dump["buffers"].as_array().unwrap().iter().filter(|buf| buf["external"] == true).collect();
    assert_eq!(foreign.len(), 1, "{text}");
    assert_eq!(foreign[0]["space"], "remote", "{text}");
    // Read by the kernels where it is: no step frees it, copies it or writes over it.
    let id = foreign[0]["id"].as_str().unwrap();
    for step in dump["streams"].as_array().unwrap().iter().flat_map(|s| s["steps"].as_array().unwrap()) {
        assert!(step["kind"] != "free" || step["buffer"] != id, "{text}");
        assert!(step["kind"] != "copy", "{text}");
        assert!(step["outputs"].as_array().is_none_or(|o| !o.iter().any(|b| b == id)), "{text}");
    }
    assert!(schedule.dump().inconsistencies().is_empty(), "{text}");
    // `a` still holds x, and the result is what one device gives.
    assert_eq!(x.to_vec::<f32>().unwrap(), want);
    b.set_memory_budget(None);
    let alone = Tensor::from_vec(want, [256, 256], &b);
    let expected = (alone.exp().matmul(&alone) + &alone).sum().item::<f32>().unwrap();
    assert_eq!(got, expected);
}
