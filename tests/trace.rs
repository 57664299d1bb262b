//! Profiles and trace files: `BRAID_TRACE` (here `braid::profile::set_trace_file`) writes trace
//! events in the Chrome/Perfetto format, one track per stream; two streams that ran at the same
//! time show overlapping events on their two tracks; a device's last profile lists its kernels.

use braid::prelude::*;
use serde_json::Value as Json;

#[test]
fn a_trace_of_two_streams_shows_them_overlapping() {
    if !braid::testing::test_device().target().streams_overlap {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "skipped: a_trace_of_two_streams_shows_them_overlapping: this device runs every stream on one queue, in issue order (wgpu), so kernels never overlap there"
        );
        return;
    }
    let path = std::env::temp_dir().join(format!("braid-trace-{}.json", std::process::id()));
    braid::profile::set_trace_file(Some(path.clone()));
    let dev = braid::testing::test_device();
    dev.set_fusion(true);
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    // Products of about 0.2 ms on the device (n = 256 on the CPU, 2048 on an H100), so that
    // each outlasts the time the host takes to issue the next one on the other stream.
    let flops = dev.target().cost.flops_per_sec;
    let n = ((flops * 2e-4 / 2.0).cbrt() as usize).next_power_of_two().clamp(256, 4096);
    let a = Tensor::randn([n, n], DType::F32, &dev) * (1.0 / (n as f64).sqrt());
    let x = Tensor::randn([n, n], DType::F32, &dev);
    dev.sync().unwrap();
    let chain = |s: &Stream| {
        s.scope(|| {
            let mut h = x.clone();
            for _ in 0..24 {
                h = h.matmul(&a).tanh();
            }
            h
        })
    };
    let (y1, y2) = (chain(&s1), chain(&s2));
    (&y1 + &y2).sum().item::<f32>().unwrap();
    braid::profile::set_trace_file(None);

    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    // The array is left open, as the trace event format allows; closed here to parse it.
    let body = text.trim_end().trim_end_matches(',');
    let events: Vec<Json> = serde_json::from_str(&format!("{body}]")).expect("a JSON array of trace events");
    let complete: Vec<&Json> = events.iter().filter(|e| e["ph"] == "X").collect();
    for e in &complete {
        for field in ["name", "cat", "pid", "tid", "ts", "dur"] {
            assert!(!e[field].is_null(), "event without {field}: {e}");
        }
        assert!(e["dur"].as_f64().unwrap() >= 0.0 && e["ts"].as_f64().unwrap() >= 0.0);
    }
    assert!(events.iter().any(|e| e["ph"] == "M" && e["name"] == "thread_name"), "tracks are named");
    let on = |tid: u32| -> Vec<(f64, f64)> {
        complete
            .iter()
            .filter(|e| e["tid"] == tid && e["cat"] == "kernel")
            .map(|e| (e["ts"].as_f64().unwrap(), e["ts"].as_f64().unwrap() + e["dur"].as_f64().unwrap()))
            .collect()
    };
    let (t1, t2) = (on(s1.id()), on(s2.id()));
    assert!(t1.len() >= 24 && t2.len() >= 24, "{} and {} kernels traced", t1.len(), t2.len());
    let overlap = t1.iter().any(|&(a0, a1)| t2.iter().any(|&(b0, b1)| a0 < b1 && b0 < a1));
    assert!(overlap, "the two streams' kernels never overlapped in the trace");
}

#[test]
fn a_profile_lists_the_kernels_of_the_last_flush() {
    let dev = Device::new_cpu();
    dev.set_profiling(true);
    let x = Tensor::randn([64, 64], DType::F32, &dev);
    let y = (x.matmul(&x).relu() + 1.0).sum();
    y.item::<f32>().unwrap();
    let p = dev.last_profile().unwrap();
    let kernels = dev.last_schedule().unwrap().kernel_count();
    assert_eq!(p.kernels().count(), kernels);
    assert!(p.kernels().all(|k| k.bytes > 0 && k.name.starts_with('k')));
    assert!(p.wall >= p.kernels().map(|k| k.duration).max().unwrap());
    let text = p.to_text();
    assert!(text.contains("kernels: ") && text.contains("GB/s"), "{text}");
    dev.set_profiling(false);
}
