//! Saving and loading named tensors (safetensors): every dtype round-trips bit for bit, onto
//! the device under test; files braid writes load in Python's `safetensors` (with NumPy) and
//! files Python writes load in braid (run when Python has them, skipped with a message
//! otherwise); truncated or lying files are errors.

mod common;

use braid::prelude::*;
use common::{Rng, random_values, read, tensor_from_f64};

#[test]
fn every_dtype_round_trips_bit_for_bit() {
    let dev = braid::testing::test_device();
    let mut rng = Rng::new(7);
    let dtypes: Vec<DType> = DType::ALL.into_iter().filter(|&d| dev.target().dtypes.contains(d)).collect();
    let shapes = [Shape::from([2, 3]), Shape::from([5]), Shape::from(()), Shape::from([0, 4])];
    let mut originals = Vec::new();
    for (i, &d) in dtypes.iter().enumerate() {
        let shape = shapes[i % shapes.len()].clone();
        let t = tensor_from_f64(&random_values(&mut rng, d, shape.numel()), &shape, d, &dev);
        originals.push((format!("t{i}.{}", d.name()), t.contiguous())); // computed on the device
    }
    let named: Vec<(&str, &Tensor)> = originals.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let bytes = braid::io::save_to_bytes(&named).unwrap();
    let loaded = braid::io::load_from_bytes(&bytes, &dev).unwrap();
    assert_eq!(loaded.len(), originals.len());
    for (name, t) in &originals {
        let back = &loaded[name];
        assert_eq!((back.dtype(), back.shape()), (t.dtype(), t.shape()), "{name}");
        assert_eq!(format!("{:?}", read(back).unwrap()), format!("{:?}", read(t).unwrap()), "{name}");
    }
    // The same through a file.
    let dir = std::env::temp_dir().join(format!("braid-io-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("weights.safetensors");
    braid::io::save(&path, &named).unwrap();
    assert_eq!(braid::io::load(&path, &dev).unwrap().len(), originals.len());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn truncated_lying_and_duplicate_inputs_are_errors() {
    let dev = braid::testing::test_device();
    let w = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0], [4], &dev);
    let bytes = braid::io::save_to_bytes(&[("w", &w)]).unwrap();
    for cut in [0, 4, 8, bytes.len() / 2, bytes.len() - 1] {
        match braid::io::load_from_bytes(&bytes[..cut], &dev) {
            Err(Error::Io(msg)) => assert!(!msg.is_empty()),
            other => panic!("a file cut at {cut} of {} bytes loaded: {other:?}", bytes.len()),
        }
    }
    // A header that claims more data than the file has.
    let mut lying = bytes.clone();
    let text = String::from_utf8_lossy(&lying[8..]).to_string();
    let patched = text.replacen("[4]", "[9]", 1);
    assert_ne!(text, patched);
    lying.truncate(8);
    lying.extend_from_slice(patched.as_bytes());
    assert!(matches!(braid::io::load_from_bytes(&lying, &dev), Err(Error::Io(_))));
    assert!(
        matches!(braid::io::save_to_bytes(&[("w", &w), ("w", &w)]), Err(Error::Io(m)) if m.contains("two tensors"))
    );
    assert!(
        matches!(braid::io::load("/nonexistent/braid.safetensors", &dev), Err(Error::Io(m)) if m.contains("cannot read"))
    );
    // Nothing broke.
    assert_eq!(w.sum().item::<f32>().unwrap(), 10.0);
}

/// `python3` with `safetensors` and `numpy`, or why not.
fn python() -> Result<(), String> {
    let out = std::process::Command::new("python3")
        .args(["-c", "import numpy, safetensors.numpy"])
        .output()
        .map_err(|e| format!("no python3 ({e})"))?;
    if out.status.success() { Ok(()) } else { Err("python3 lacks numpy or safetensors".into()) }
}

#[test]
fn files_round_trip_through_python_safetensors() {
    if let Err(why) = python() {
        println!("skipped: {why} (pip install numpy safetensors to run this test)");
        return;
    }
    let dev = braid::testing::test_device();
    if common::skip_without_i64(&dev, "files_round_trip_through_python_safetensors") {
        return;
    }
    let dir = std::env::temp_dir().join(format!("braid-py-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (ours, theirs) = (dir.join("braid.safetensors"), dir.join("python.safetensors"));
    let a = Tensor::from_vec(vec![0.5f32, -1.25, 3.0, 1e-3, -7.0, 2.5], [2, 3], &dev);
    let b = Tensor::from_vec(vec![-3i64, 9, 1 << 40], [3], &dev);
    let c = Tensor::from_vec(vec![true, false, true, true], [2, 2], &dev);
    braid::io::save(&ours, &[("a", &a), ("b", &b), ("c", &c)]).unwrap();
    // Python checks our values and writes a file of its own (a doubled, b negated, a new one).
    let script = r#"
import sys, numpy as np
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
assert t["a"].dtype == np.float32 and t["a"].shape == (2, 3), t["a"]
assert np.array_equal(t["a"], np.array([[0.5, -1.25, 3.0], [1e-3, -7.0, 2.5]], dtype=np.float32))
assert t["b"].dtype == np.int64 and list(t["b"]) == [-3, 9, 1 << 40]
assert t["c"].dtype == np.bool_ and t["c"].tolist() == [[True, False], [True, True]]
save_file({"a2": t["a"] * 2, "nb": -t["b"], "h": np.arange(6, dtype=np.float16).reshape(3, 2)}, sys.argv[2])
"#;
    let out = std::process::Command::new("python3").args(["-c", script]).arg(&ours).arg(&theirs).output().unwrap();
    assert!(out.status.success(), "python: {}", String::from_utf8_lossy(&out.stderr));
    let back = braid::io::load(&theirs, &dev).unwrap();
    assert_eq!(back["a2"].to_vec::<f32>().unwrap(), (&a * 2.0).to_vec::<f32>().unwrap());
    assert_eq!(back["nb"].to_vec::<i64>().unwrap(), vec![3, -9, -(1 << 40)]);
    assert_eq!(back["h"].dims(), &[3, 2]);
    assert_eq!(back["h"].to_dtype(DType::F32).to_vec::<f32>().unwrap(), vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    std::fs::remove_dir_all(&dir).unwrap();
}
