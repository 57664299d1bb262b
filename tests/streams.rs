//! Streams and events: the API, automatic cross-stream events, user events, frees gated on the
//! streams that read a buffer, in-place updates, the planned peak against the device's peak,
//! deadlocks reported as errors, and a multi-threaded stress test.

use braid::prelude::*;
use braid::testing::set_schedule_hook;
use braid_scheduler::StreamStep;
use serde_json::Value as Json;
use std::sync::Arc;

fn data(dev: &Device, n: usize, scale: f32) -> Tensor {
    Tensor::from_vec((0..n).map(|i| (i as f32 * 0.37).sin() * scale).collect::<Vec<_>>(), [n], dev)
}

fn last_json(dev: &Device) -> Json {
    serde_json::from_str(&dev.last_schedule().expect("a flush ran").to_json()).unwrap()
}

fn steps_of(json: &Json, stream: u64) -> Vec<Json> {
    json["streams"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["id"] == stream)
        .map_or(Vec::new(), |s| s["steps"].as_array().unwrap().clone())
}

fn kinds(steps: &[Json]) -> Vec<String> {
    steps.iter().map(|s| s["kind"].as_str().unwrap().to_string()).collect()
}

#[test]
fn streams_scopes_and_handles() {
    let dev = braid::testing::test_device();
    let s0 = dev.default_stream();
    let s1 = dev.new_stream();
    let s2 = dev.new_stream();
    assert_eq!((s0.id(), Stream::current(&dev)), (0, s0.clone()));
    assert_ne!(s1, s2);
    let x = data(&dev, 8, 1.0);
    let (a, b) = s1.scope(|| {
        assert_eq!(Stream::current(&dev), s1);
        let a = x.exp();
        let b = s2.scope(|| x.sin());
        assert_eq!(Stream::current(&dev), s1, "scopes nest");
        (a, b)
    });
    assert_eq!((a.stream(), b.stream()), (s1.clone(), s2.clone()));
    assert_eq!(Stream::current(&dev), s0);
    // A panic inside a scope still restores the previous stream.
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s2.scope(|| panic!("inside"))));
    assert!(r.is_err());
    assert_eq!(Stream::current(&dev), s0);
    fn handle<T: Clone + PartialEq + std::fmt::Debug + Send + Sync + 'static>() {}
    handle::<Stream>();
    handle::<Event>();
    assert_eq!(format!("{s1:?}"), format!("Stream({}:{})", dev.name(), s1.id()));
}

#[test]
fn cross_stream_reads_get_automatic_events_and_redundant_waits_are_removed() {
    let dev = braid::testing::test_device();
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x = data(&dev, 64, 1.0);
    let (p, q) = s1.scope(|| (x.exp(), x.sin()));
    let y = s2.scope(|| &p * &q);
    let got = y.to_vec::<f32>().unwrap();
    let xs = x.to_vec::<f32>().unwrap();
    for (g, v) in got.iter().zip(&xs) {
        assert!((g - v.exp() * v.sin()).abs() <= 1e-5 * (1.0 + g.abs()));
    }
    let json = last_json(&dev);
    let consumer = kinds(&steps_of(&json, s2.id() as u64));
    assert_eq!(consumer.iter().filter(|k| *k == "wait").count(), 1, "one wait covers both inputs: {consumer:?}");
    let producer = kinds(&steps_of(&json, s1.id() as u64));
    assert_eq!(producer.iter().filter(|k| *k == "record").count(), 1, "one record, after the producers: {producer:?}");
    assert_eq!(producer.last().map(String::as_str), Some("record"));
    assert!(json["events"].as_array().unwrap().iter().all(|e| e["auto"] == true));
}

#[test]
fn user_events_order_work_that_data_does_not() {
    let dev = braid::testing::test_device();
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x = data(&dev, 32, 1.0);
    let a = s1.scope(|| x.exp());
    let ev = s1.record_event();
    s2.wait_event(&ev);
    let b = s2.scope(|| x.cos()); // no data from s1, but ordered after `ev`
    b.to_vec::<f32>().unwrap();
    let json = last_json(&dev);
    assert_eq!(json["streams"].as_array().unwrap().len(), 2, "b's flush includes what the event waits for");
    let waits = kinds(&steps_of(&json, s2.id() as u64));
    assert_eq!(&waits[..1], &["wait".to_string()], "{waits:?}");
    assert!(json["events"].as_array().unwrap().iter().any(|e| e["auto"] == false), "the user's event is in the dump");
    // `a` was computed by that flush (the event needed it) and is kept.
    let before = dev.kernels_launched();
    a.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), before);
    // synchronize() runs what an event depends on.
    let c = s1.scope(|| x.tanh());
    let ev2 = s1.record_event();
    let before = dev.kernels_launched();
    ev2.synchronize().unwrap();
    assert_eq!(dev.kernels_launched(), before + 1);
    let before = dev.kernels_launched();
    c.to_vec::<f32>().unwrap();
    assert_eq!(dev.kernels_launched(), before, "computed by the event's flush");
    ev2.synchronize().unwrap();
}

#[test]
fn a_buffer_read_on_two_streams_is_freed_after_both() {
    let dev = braid::testing::test_device();
    dev.set_poison(true);
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x = data(&dev, 4096, 1.0);
    let shared = x.exp(); // on the default stream
    let a = s1.scope(|| shared.sin());
    let b = s2.scope(|| shared.cos());
    drop(shared); // nothing else reads it: the flush frees it
    let total = &a + &b;
    let got = total.to_vec::<f32>().unwrap();
    let xs = x.to_vec::<f32>().unwrap();
    for (g, v) in got.iter().zip(&xs) {
        let e = v.exp();
        assert!((g - (e.sin() + e.cos())).abs() <= 1e-5 * (1.0 + g.abs()));
    }
    let json = last_json(&dev);
    let frees: Vec<&Json> = json["streams"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["steps"].as_array().unwrap())
        .filter(|s| s["kind"] == "free")
        .collect();
    let exp_buffer = json["buffers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["dtype"] == "f32" && !b["external"].as_bool().unwrap())
        .unwrap()["id"]
        .clone();
    let free = frees.iter().find(|f| f["buffer"] == exp_buffer).expect("the shared value is freed");
    assert_eq!(free["after"].as_array().unwrap().len(), 1, "gated on the other reader's stream: {free}");
    // cos, the last reader, could have overwritten `shared` in place, but sin on the other
    // stream may still read it: the dump says so.
    let text = dev.last_schedule().unwrap().to_text();
    assert!(text.contains("not overwritten in place: stream"), "{text}");
}

#[test]
fn in_place_updates_reuse_the_buffer() {
    // Unfused, so the update is its own kernel: `sub` overwrites exp's buffer, a value this flush
    // computed and nobody else reads.
    let dev = braid::testing::test_device();
    dev.set_fusion(false);
    // Computed, so both are on the device before the flush (a read of host data nothing has
    // used would not upload it).
    let x = Tensor::from_vec(vec![0.0f32; 1 << 16], [1 << 16], &dev) * 1.0;
    let g = Tensor::from_vec(vec![0.5f32; 1 << 16], [1 << 16], &dev) * 1.0;
    x.to_vec::<f32>().unwrap();
    g.to_vec::<f32>().unwrap(); // both now on the device
    let held = dev.memory().in_use;
    dev.reset_peak();
    let w = x.exp();
    w.sub_assign(&g);
    assert!(w.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.5));
    let json = last_json(&dev);
    let kernels: Vec<Json> = steps_of(&json, 0).into_iter().filter(|s| s["kind"] == "kernel").collect();
    let sub = kernels.iter().find(|k| k["ops"][0] == "sub").unwrap();
    assert_eq!(sub["in_place"].as_array().map(Vec::len), Some(1), "the old version of w is overwritten: {sub}");
    assert_eq!(dev.memory().peak, held + (4 << 16), "one buffer for exp, reused by sub");
    // A value from before the flush that no tensor names and nothing else reads (the old version
    // of w now) is handed to the flush, which writes the update over it.
    w.sub_assign(&g);
    assert!(w.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    let json = last_json(&dev);
    let sub = steps_of(&json, 0).into_iter().find(|s| s["kind"] == "kernel").unwrap();
    assert_eq!(sub["in_place"].as_array().map(Vec::len), Some(1), "{sub}");
    // A reader recorded before the update still needs the old version: the update gets a new
    // buffer, and the reader sees the old value.
    let before = &w * 3.0;
    w.sub_assign(&g);
    assert!(w.to_vec::<f32>().unwrap().iter().all(|&v| v == -0.5));
    let json = last_json(&dev);
    let sub = steps_of(&json, 0).into_iter().find(|s| s["kind"] == "kernel").unwrap();
    assert!(sub.get("in_place").is_none(), "{sub}");
    assert!(before.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.0));
    // So does a value a tensor names (g): it is read, never overwritten.
    assert!(g.to_vec::<f32>().unwrap().iter().all(|&v| v == 0.5));
}

#[test]
fn the_planned_peak_matches_the_device_peak() {
    for fusion in [false, true] {
        planned_peak(fusion);
    }
}

fn planned_peak(fusion: bool) {
    let dev = braid::testing::test_device();
    dev.set_fusion(fusion);
    let x = data(&dev, 1 << 14, 1.0); // 64 KiB
    x.to_vec::<f32>().unwrap();
    dev.reset_peak();
    let y = ((x.exp() + 1.0).sin() * 2.0).sum_dim(0, false);
    y.to_vec::<f32>().unwrap();
    let planned = dev.last_schedule().unwrap().planned_peak_bytes();
    let peak = dev.memory().peak;
    // Buffer sizes are multiples of the pool's 64-byte alignment except the 4-byte sum.
    assert!(peak >= planned && peak <= planned + 64, "device peak {peak}, planned {planned}");
    if fusion {
        // One row kernel: x and the result.
        assert_eq!(planned, (4 << 14) + 4);
    } else {
        // exp, +1, sin and *2 each overwrite their input in place: x, one temporary, the result.
        assert_eq!(planned, 2 * (4 << 14) + 4);
    }
}

#[test]
fn auto_streams_spread_independent_branches() {
    let dev = braid::testing::test_device();
    dev.set_auto_streams(2);
    let a = data(&dev, 256, 1.0);
    let b = data(&dev, 256, 2.0);
    let mut x = a.clone();
    let mut y = b.clone();
    for _ in 0..4 {
        x = x.tanh() * 1.5;
        y = y.sin() + 0.5;
    }
    let z = &x + &y;
    let got = z.to_vec::<f32>().unwrap();
    assert_eq!(last_json(&dev)["streams"].as_array().unwrap().len(), 2);
    dev.set_auto_streams(1);
    let again = (&x + &y).to_vec::<f32>().unwrap();
    assert_eq!(got, again);
}

#[test]
fn unreachable_waits_are_errors_not_hangs() {
    let dev = braid::testing::test_device();
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x = data(&dev, 16, 1.0);
    // Drop every record: waits refer to events nobody records.
    set_schedule_hook(
        &dev,
        Some(Arc::new(|s: &mut braid_scheduler::Schedule| {
            for st in &mut s.streams {
                st.steps.retain(|step| !matches!(step, StreamStep::Record(_)));
            }
        })),
    );
    let p = s1.scope(|| x.exp());
    let q = s2.scope(|| &p + 1.0);
    match q.to_vec::<f32>() {
        Err(Error::Deadlock(msg)) => assert!(msg.contains("waits for event e0") && msg.contains("stream"), "{msg}"),
        other => panic!("expected a deadlock error, got {other:?}"),
    }
    // A cycle: each stream waits first for the other's record.
    set_schedule_hook(
        &dev,
        Some(Arc::new(|s: &mut braid_scheduler::Schedule| {
            let n = s.events.len() as u32;
            if s.streams.len() == 2 {
                let extra = braid_scheduler::EventId(n);
                s.events.push(braid_scheduler::EventPlan {
                    id: extra,
                    stream: s.streams[1].stream,
                    auto: true,
                    user_node: None,
                });
                s.streams[0].steps.insert(0, StreamStep::Wait(extra));
                s.streams[1].steps.push(StreamStep::Record(extra));
            }
        })),
    );
    match q.to_vec::<f32>() {
        Err(Error::Deadlock(msg)) => assert!(msg.contains("cycle") || msg.contains("never"), "{msg}"),
        other => panic!("expected a deadlock error, got {other:?}"),
    }
    // The engine is fine afterwards.
    set_schedule_hook(&dev, None);
    let xs = x.to_vec::<f32>().unwrap();
    let got = q.to_vec::<f32>().unwrap();
    assert!(got.iter().zip(&xs).all(|(g, v)| (g - (v.exp() + 1.0)).abs() < 1e-5));
}

#[test]
fn eight_threads_on_their_own_streams_with_cross_stream_tensors() {
    let dev = braid::testing::test_device();
    dev.set_poison(true);
    let shared: Vec<Tensor> = (0..8).map(|t| data(&dev, 64, t as f32 + 1.0)).collect();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let dev = dev.clone();
            let shared = shared.clone();
            std::thread::spawn(move || {
                let mine = dev.new_stream();
                let mut acc = mine.scope(|| shared[t].clone() * 0.0);
                for i in 0..500 {
                    // Read a tensor another thread's stream produced, and publish nothing.
                    let other = &shared[(t + i) % 8];
                    acc = mine.scope(|| &acc + &other.sin());
                    if i % 50 == 49 {
                        acc.sum().item::<f32>().unwrap();
                    }
                }
                (t, acc.to_vec::<f32>().unwrap())
            })
        })
        .collect();
    let base: Vec<Vec<f32>> = shared.iter().map(|s| s.sin().to_vec::<f32>().unwrap()).collect();
    for th in threads {
        let (t, got) = th.join().expect("no panic, no deadlock");
        for (k, g) in got.iter().enumerate() {
            let mut e = 0.0f32;
            for i in 0..500 {
                e += base[(t + i) % 8][k];
            }
            assert!((g - e).abs() <= 1e-3 * (1.0 + e.abs()), "thread {t} element {k}: {g} vs {e}");
        }
    }
}

#[test]
fn a_wait_left_on_a_stream_that_records_nothing_more_is_released_once_its_event_is_reached() {
    // A stream made for one piece of work, waiting for an event and then dropped: waiting for
    // a reached event orders nothing, so the wait list lets the event go when it is reached
    // (it held the event node forever: a leak of one node a stream).
    let dev = braid::testing::test_device();
    let x = data(&dev, 64, 1.0);
    dev.sync().unwrap();
    let abandon = || {
        let y = &x + 1.0;
        let event = dev.default_stream().record_event();
        let s = dev.new_stream();
        s.wait_event(&event);
        event.synchronize().unwrap();
        y.to_vec::<f32>().unwrap();
    };
    // (The first use of x records it as a leaf of the graph: one node from then on.)
    abandon();
    let before = braid::testing::graph_nodes(&dev);
    for _ in 0..50 {
        abandon();
    }
    let after = braid::testing::graph_nodes(&dev);
    assert_eq!(after, before, "nodes before and after 50 abandoned waits");
}

#[test]
fn a_scatter_over_a_value_another_stream_reads_comes_after_that_read() {
    // The cache is computed by the flush and read by a sum on a side stream; the scatter that
    // updates it in place may write over its buffer only once that read is done (the
    // validator, run on every schedule here, checks the events), and the sum sees the old rows.
    let dev = braid::testing::test_device();
    let side = dev.new_stream();
    let (rows, cols) = (64, 64);
    let values: Vec<f32> = (0..rows * cols).map(|i| (i % 7) as f32).collect();
    let old_sum: f32 = values.iter().sum();
    let cache = Tensor::from_vec(values, [rows, cols], &dev) * 1.0;
    let total = side.scope(|| cache.sum());
    let at = Tensor::from_vec(vec![3i32; cols], [1, cols], &dev);
    cache.scatter_assign(0, &at, &Tensor::full([1, cols], 100.0, DType::F32, &dev));
    dev.sync().unwrap(); // one flush of all of it
    let json = last_json(&dev);
    let (new, sum) = (cache.to_vec::<f32>().unwrap(), total.item::<f32>().unwrap());
    assert_eq!(sum, old_sum, "the side stream's sum saw the scatter");
    assert!(new[3 * cols..4 * cols].iter().all(|&v| v == 100.0));
    assert_eq!(
        new[..3 * cols].iter().sum::<f32>() + new[4 * cols..].iter().sum::<f32>(),
        old_sum - (0..cols).map(|j| ((3 * cols + j) % 7) as f32).sum::<f32>()
    );
    // The scatter is in place only after a wait for the side stream, or not in place at all.
    let main = steps_of(&json, 0);
    let at_scatter =
        main.iter().position(|s| s["kind"] == "kernel" && s["ops"][0] == "scatter").expect("a scatter kernel");
    if main[at_scatter].get("in_place").is_some() {
        assert!(
            main[..at_scatter].iter().any(|s| s["kind"] == "wait"),
            "in place before the side stream's read is done: {json}"
        );
    }
}
