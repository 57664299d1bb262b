//! Schedule dumps: files written for every flush, the JSON schema, the text and DOT forms, and
//! `braid inspect` (summary plus the validator) on a real two-stream dump, on a corrupted one and
//! on files that are not dumps at all.

use braid::prelude::*;
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The tests of this file take turns: `braid::dump::set_dir` is process-wide, and a flush
/// checks that the dump directory is writable.
fn turn() -> std::sync::MutexGuard<'static, ()> {
    static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());
    TURN.lock().unwrap_or_else(|p| p.into_inner())
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The `braid` binary: where cargo built it, or, where the tests were copied to another machine
/// (the GPU machine's staged binaries), beside this test binary (`bin-braid` or `braid`).
fn braid_binary() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_braid"));
    if built.exists() {
        return built;
    }
    let here = std::env::current_exe().expect("the test binary's path");
    let beside = ["bin-braid", "braid"].iter().map(|name| here.with_file_name(name)).find(|p| p.exists());
    beside.unwrap_or(built)
}

fn inspect(file: &Path) -> (bool, String, String) {
    let out = Command::new(braid_binary()).arg("inspect").arg(file).output().expect("run braid");
    (out.status.success(), String::from_utf8_lossy(&out.stdout).into(), String::from_utf8_lossy(&out.stderr).into())
}

/// Two chains on two streams, joined on the default stream, plus a value read on both streams
/// and then dropped (so its free is gated on the other stream's event).
fn two_stream_flush(dev: &Device) -> Tensor {
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let x = Tensor::from_vec((0..64).map(|i| i as f32 * 0.01).collect::<Vec<_>>(), [8, 8], dev);
    let shared = x.exp();
    let (mut a, mut b) = (s1.scope(|| shared.sin()), s2.scope(|| shared.cos()));
    drop(shared);
    for _ in 0..3 {
        a = s1.scope(|| a.matmul(&x).tanh());
        b = s2.scope(|| b.matmul(&x).tanh());
    }
    &a + &b
}

#[test]
fn dumps_show_streams_events_and_gated_frees_and_inspect_validates_them() {
    let _t = turn();
    let dir = tmp_dir("dump");
    let dev = braid::testing::test_device();
    braid::dump::set_dir(Some(dir.clone()));
    let y = two_stream_flush(&dev);
    y.to_vec::<f32>().unwrap();
    braid::dump::set_dir(None);
    let last = dev.last_schedule().unwrap();
    let stem = dir.join(braid::dump::file_stem(&dev, last.flush()));
    let json_path = stem.with_extension("json");
    let text = std::fs::read_to_string(&json_path).expect("the dump file was written");
    assert_eq!(text, last.to_json(), "the file and last_schedule() agree");
    assert!(stem.with_extension("txt").exists() && stem.with_extension("dot").exists());

    let json: Json = serde_json::from_str(&text).unwrap();
    assert_eq!(json["schema"], 1);
    assert_eq!(json["streams"].as_array().unwrap().len(), 3, "the default stream and both chains");
    let events = json["events"].as_array().unwrap();
    assert!(!events.is_empty() && events.iter().all(|e| e["auto"] == true), "automatic events: {events:?}");
    let frees: Vec<&Json> = json["streams"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| s["steps"].as_array().unwrap())
        .filter(|s| s["kind"] == "free")
        .collect();
    assert!(!frees.is_empty() && frees.iter().all(|f| f["after"].is_array()), "every free lists its gating events");
    assert!(frees.iter().any(|f| !f["after"].as_array().unwrap().is_empty()), "a free is gated on another stream");
    for key in ["buffers", "fusion", "planned_peak_bytes", "offloads", "device", "flush"] {
        assert!(json.get(key).is_some(), "schema field {key}");
    }
    let dot = last.to_dot();
    assert!(dot.matches("subgraph cluster_s").count() == 3 && dot.contains("style=dashed"), "{dot}");

    let (ok, out, err) = inspect(&json_path);
    assert!(ok, "braid inspect failed: {out}{err}");
    for part in ["streams: 3", "kernels:", "events:", "buffers:", "planned peak:", "fusion refusals:", "validator: ok"]
    {
        assert!(out.contains(part), "inspect output lacks {part:?}:\n{out}");
    }

    // A corrupted dump: drop every wait. The validator names the hazard; the exit status is 1.
    let mut bad: Json = json.clone();
    for s in bad["streams"].as_array_mut().unwrap() {
        s["steps"].as_array_mut().unwrap().retain(|st| st["kind"] != "wait");
    }
    let bad_path = dir.join("bad.json");
    std::fs::write(&bad_path, serde_json::to_string(&bad).unwrap()).unwrap();
    let (ok, out, err) = inspect(&bad_path);
    assert!(!ok && out.contains("hazard") && out.contains("stream"), "{out}{err}");
    assert!(!err.contains("panicked"), "{err}");

    // Dumps that contradict themselves (edited by hand, written by something else): each is
    // named, and the exit status is 1.
    type Edit = fn(&mut Json);
    let edits: [(&str, Edit); 5] = [
        ("does not list", |j| j["buffers"] = Json::Array(vec![])),
        ("is listed twice", |j| {
            let first = j["buffers"][0].clone();
            j["buffers"].as_array_mut().unwrap().push(first);
        }),
        ("which the dump does not have", |j| j["events"][0]["stream"] = 77.into()),
        ("fusion summary counts", |j| j["fusion"]["kernels"] = 99.into()),
        ("names kernel k99", |j| {
            let offload = serde_json::json!({"buffer": "b0", "to": "b1", "back_before": "k99"});
            j["offloads"] = Json::Array(vec![offload]);
        }),
    ];
    for (expect, edit) in edits {
        let mut edited = json.clone();
        edit(&mut edited);
        std::fs::write(&bad_path, serde_json::to_string(&edited).unwrap()).unwrap();
        let (ok, out, err) = inspect(&bad_path);
        assert!(!ok && out.contains("inconsistenc") && out.contains(expect), "{expect}: {out}{err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inspect_rejects_files_that_are_not_dumps_without_panicking() {
    let _t = turn();
    let dir = tmp_dir("foreign");
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        ("missing.json", None, "cannot read"),
        ("text.json", Some("this is not json"), "not JSON"),
        ("other.json", Some(r#"{"name": "a package manifest"}"#), "not a braid schedule dump"),
        ("future.json", Some(r#"{"schema": 2}"#), "schema version 2"),
        ("broken.json", Some(r#"{"schema": 1, "flush": 1}"#), "malformed"),
    ];
    for (name, content, expect) in cases {
        let path = dir.join(name);
        if let Some(c) = content {
            std::fs::write(&path, c).unwrap();
        }
        let (ok, out, err) = inspect(&path);
        assert!(!ok, "{name} should fail: {out}");
        assert!(err.contains(expect) && !err.contains("panicked"), "{name}: {err}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a reader of a dump needs to tell apart: a flush refused for its budget says it did not
/// run; braid's own streams have names; user events are marked; fusion refusals read as
/// sentences.
#[test]
fn dumps_say_what_did_not_run_and_name_streams_events_and_reasons() {
    let _t = turn();
    let dev = braid::testing::test_device();
    // A budget out of reach: the flush is dumped, marked as not run.
    dev.set_memory_budget(Some(64));
    let x = Tensor::from_vec((0..4096).map(|i| i as f32).collect(), [64, 64], &dev);
    let y = (x.exp() + 1.0).sum();
    let r = y.to_vec::<f32>();
    assert!(matches!(r, Err(Error::MemoryBudget { .. })), "{r:?}");
    let dump = dev.last_schedule().unwrap();
    assert!(dump.not_run().is_some_and(|w| w.contains("memory budget")), "{:?}", dump.not_run());
    assert!(dump.to_text().starts_with("NOT RUN: memory budget"), "{}", dump.to_text());
    assert!(dump.to_json().contains("\"not_run\""));
    dev.set_memory_budget(None);
    // A user event between two streams, and an offload (whose stream is named).
    let (s1, s2) = (dev.new_stream(), dev.new_stream());
    let a = s1.scope(|| x.exp());
    let ev = s1.record_event();
    s2.wait_event(&ev);
    // Unfused, so that b sits idle for several kernels and its hint moves it out meanwhile.
    dev.set_fusion(false);
    let big = Tensor::rand([256, 256], -1.0, 1.0, DType::F32, &dev);
    let b = s2.scope(|| big.sin().offload_hint());
    let mut chain = s2.scope(|| &b * 2.0);
    for _ in 0..8 {
        chain = s2.scope(|| chain.matmul(&big).tanh());
    }
    let c = s2.scope(|| (&chain + &b).sum());
    let text = {
        (a.sum() + &c).to_vec::<f32>().unwrap();
        dev.last_schedule().unwrap().to_text()
    };
    assert!(text.contains("(user event)"), "{text}");
    assert!(text.contains("stream offload:") && !text.contains("4294967295"), "{text}");
    // Reasons in words, not debug output.
    let r = x.sum_dim(0, false) + x.sum_dim(1, false);
    r.to_vec::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert!(!text.contains("Some(") && !text.contains("None"), "{text}");
}

#[test]
fn devices_sharing_a_dump_directory_keep_their_own_files() {
    let _t = turn();
    let dir = tmp_dir("two-devices");
    let (a, b) = (braid::testing::test_device(), braid::testing::test_device());
    braid::dump::set_dir(Some(dir.clone()));
    (Tensor::ones([4], DType::F32, &a) * 2.0).to_vec::<f32>().unwrap();
    (Tensor::ones([8], DType::F32, &b).exp().sum()).to_vec::<f32>().unwrap();
    braid::dump::set_dir(None);
    // Flush numbers count per device: both devices' first flushes have the same number here,
    // and each keeps its files.
    let (da, db) = (a.last_schedule().unwrap(), b.last_schedule().unwrap());
    let (sa, sb) = (braid::dump::file_stem(&a, da.flush()), braid::dump::file_stem(&b, db.flush()));
    assert_ne!(sa, sb);
    for (stem, dump) in [(sa, da), (sb, db)] {
        let text = std::fs::read_to_string(dir.join(&stem).with_extension("json")).unwrap();
        assert_eq!(text, dump.to_json(), "{stem}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `ScheduleDump::product_count` counts the matrix products a flush ran: for a 3-layer
/// training step whose input needs no gradient, 3 forward + 3 weight-gradient + 2
/// input-gradient products with every gradient held; fewer when only the last layer's gradient
/// is held (a lazy engine computes nothing else); the same with fusion off (a product fused
/// with its bias and activation is still one product), read back from JSON, and 0 for a flush
/// that did not run.
#[test]
fn product_count_counts_the_matrix_products_a_flush_ran() {
    let _t = turn();
    let dev = braid::testing::test_device();
    dev.seed(7);
    let x = Tensor::randn([16, 32], DType::F32, &dev);
    let layers: Vec<(Tensor, Tensor)> = (0..3)
        .map(|_| {
            let w = (Tensor::randn([32, 32], DType::F32, &dev) * 0.2).detach().requires_grad();
            (w, Tensor::zeros([32], DType::F32, &dev).requires_grad())
        })
        .collect();
    dev.sync().unwrap();
    // Holds the gradients of the weights `held` names until the sync; the flush's dump.
    let step = |held: &[usize]| {
        let mut h = x.clone();
        for (w, b) in &layers {
            h = (h.matmul(w) + b).relu();
        }
        let grads = h.square().mean().backward().unwrap();
        let kept: Vec<Tensor> = held.iter().map(|&i| grads.get(&layers[i].0).unwrap()).collect();
        drop(grads);
        dev.sync().unwrap();
        drop(kept);
        dev.last_schedule().unwrap()
    };
    let all = step(&[0, 1, 2]);
    assert_eq!(all.product_count(), 8, "3 forward, 3 weight and 2 input gradients:\n{}", all.to_text());
    assert!(all.product_count() < all.kernel_count(), "not every kernel is a product");
    let last = step(&[2]);
    assert_eq!(last.product_count(), 4, "3 forward and the last weight's gradient:\n{}", last.to_text());
    let first = step(&[0]);
    assert_eq!(first.product_count(), 6, "3 forward, 2 input gradients, the first weight's:\n{}", first.to_text());
    dev.set_fusion(false);
    let unfused = step(&[0, 1, 2]);
    dev.set_fusion(true);
    assert_eq!(unfused.product_count(), 8);
    assert!(unfused.kernel_count() > all.kernel_count());
    let read_back = braid::ScheduleDump::from_json(&all.to_json()).unwrap();
    assert_eq!(read_back.product_count(), 8);
    assert_eq!(read_back.kernel_count(), all.kernel_count());
    // A flush refused for its budget ran nothing.
    dev.set_memory_budget(Some(64));
    let refused = (x.matmul(&layers[0].0)).sum().to_vec::<f32>();
    dev.set_memory_budget(None);
    assert!(matches!(refused, Err(Error::MemoryBudget { .. })), "{refused:?}");
    let dump = dev.last_schedule().unwrap();
    assert!(dump.not_run().is_some() && dump.product_count() == 0, "{}", dump.to_text());
}
