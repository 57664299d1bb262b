//! The tuner's choices, checks and file, with made-up trials (the backends' tests run real
//! kernels through it).

use super::*;

fn variants() -> Vec<Variant> {
    let v = |name: &str, bitwise, short_list| Variant { name: name.into(), bitwise, short_list };
    vec![
        v("threads 256", true, true),
        v("threads 128", false, true),
        v("blocks 4", true, true),
        v("threads 64", false, false),
    ]
}

fn key(kernel: u64) -> TuneKey {
    TuneKey::new(kernel, &[8192, 4096], [DType::F32, DType::F32])
}

fn out(values: &[f32]) -> Vec<Output> {
    vec![Output { dtype: DType::F32, bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect() }]
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-tune-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A trial whose candidate `c` takes `times[c]` seconds and gives `outputs(c)`.
fn trials(times: [f64; 4], outputs: impl Fn(usize) -> Vec<Output>) -> impl FnMut(usize) -> Result<Trial, String> {
    move |c| Ok(Trial { seconds: vec![times[c]; 3], outputs: outputs(c), compared: None })
}

#[test]
fn buckets_are_exact_when_small_and_powers_of_two_above() {
    assert_eq!((bucket(3), bucket(64), bucket(65), bucket(4096), bucket(5000)), (3, 64, 128, 4096, 8192));
    assert_eq!(key(1).shape, vec![8192, 4096]);
    assert_eq!(key(1).dtypes, "f32,f32");
}

#[test]
fn the_fastest_agreeing_variant_is_kept_and_then_used() {
    let t = Tuner::open("test device", None);
    let (k, v) = (key(1), variants());
    let Plan::Tune(c) = t.plan_with(&k, &v, Mode::On, false) else { panic!("nothing chosen yet") };
    assert_eq!(c, vec![0, 1, 2], "the short list, the default first");
    let tuned = t.tune(&k, &v, &c, trials([1.0, 0.5, 0.8, 0.1], |c| out(&[1.0, 2.0 + c as f32 * 1e-5]))).unwrap();
    assert_eq!(tuned.chosen, 1, "{}", tuned.why);
    assert_eq!(t.plan_with(&k, &v, Mode::On, false), Plan::Use(1));
    // Deterministic mode never runs a variant that adds in another order: it times the
    // bitwise ones (the choice above was made among others).
    assert_eq!(t.plan_with(&k, &v, Mode::On, true), Plan::Tune(vec![0, 2]));
    assert_eq!(t.plan_with(&k, &v, Mode::Off, false), Plan::Use(0));
}

#[test]
fn a_variant_within_the_noise_does_not_replace_the_default() {
    let t = Tuner::open("test device", None);
    let (k, v) = (key(2), variants());
    let tuned = t.tune(&k, &v, &[0, 2], trials([1.0, 1.0, 0.99, 1.0], |_| out(&[1.0]))).unwrap();
    assert_eq!(tuned.chosen, 0, "{}", tuned.why);
}

#[test]
fn disagreeing_variants_are_rejected_with_the_reason() {
    let t = Tuner::open("test device", None);
    let (k, v) = (key(3), variants());
    // Candidate 2 is marked bitwise and differs in the last bit; candidate 1 (non-bitwise)
    // is far outside the tolerance; candidate 3 fails to launch.
    let outputs = |c: usize| match c {
        1 => out(&[1.0, 2.5]),
        2 => out(&[1.0, f32::from_bits(2.0f32.to_bits() + 1)]),
        _ => out(&[1.0, 2.0]),
    };
    let mut run = trials([1.0, 0.1, 0.1, 0.1], outputs);
    let tuned =
        t.tune(&k, &v, &[0, 1, 2, 3], |c| if c == 3 { Err("out of resources".to_string()) } else { run(c) }).unwrap();
    assert_eq!(tuned.chosen, 0);
    let rejected: Vec<usize> = tuned.rejected.iter().map(|r| r.0).collect();
    assert_eq!(rejected, vec![1, 2, 3], "{:?}", tuned.rejected);
    assert!(tuned.rejected[1].1.contains("same bits"), "{:?}", tuned.rejected);
    assert!(tuned.rejected[2].1.contains("out of resources"));
    assert!(tuned.why.contains("3 rejected"), "{}", tuned.why);
}

#[test]
fn tolerance_is_relative_to_the_largest_output_and_nan_must_match() {
    assert!(agree(&out(&[1000.0, 1.0]), &out(&[1000.0, 1.01]), false).is_ok());
    assert!(agree(&out(&[1.0, 1.0]), &out(&[1.0, 1.01]), false).is_err());
    assert!(agree(&out(&[f32::NAN]), &out(&[f32::NAN]), false).is_ok());
    assert!(agree(&out(&[f32::NAN]), &out(&[0.0]), false).is_err());
    assert!(agree(&out(&[f32::INFINITY]), &out(&[f32::INFINITY]), true).is_ok());
    let ints = |v: i32| vec![Output { dtype: DType::I32, bytes: v.to_le_bytes().to_vec() }];
    assert!(agree(&ints(7), &ints(8), false).is_err(), "integers agree only exactly");
}

#[test]
fn a_new_variant_set_times_the_kernel_again() {
    let t = Tuner::open("test device", None);
    let (k, v) = (key(4), variants());
    t.tune(&k, &v, &[0, 1], trials([1.0, 0.5, 1.0, 1.0], |_| out(&[1.0]))).unwrap();
    let mut more = v.clone();
    more.push(Variant { name: "threads 512".into(), bitwise: false, short_list: true });
    assert!(matches!(t.plan_with(&k, &more, Mode::On, false), Plan::Tune(_)));
}

#[test]
fn choices_survive_in_the_file_and_a_second_tuner_times_nothing() {
    let d = dir("reopen");
    let (k, v) = (key(5), variants());
    {
        let t = Tuner::open("gpu A / driver 1", Some(d.clone()));
        let Plan::Tune(c) = t.plan_with(&k, &v, Mode::On, false) else { panic!("nothing chosen yet") };
        t.tune(&k, &v, &c, trials([1.0, 1.0, 0.5, 1.0], |_| out(&[1.0]))).unwrap();
        t.save();
    }
    let again = Tuner::open("gpu A / driver 1", Some(d.clone()));
    assert_eq!(again.plan_with(&k, &v, Mode::On, false), Plan::Use(2));
    assert!(again.why(&k).unwrap().contains("blocks 4"));
    // Another device (or driver) never reads it.
    let other = Tuner::open("gpu B / driver 1", Some(d.clone()));
    assert!(matches!(other.plan_with(&k, &v, Mode::On, false), Plan::Tune(_)));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_corrupt_or_foreign_file_is_ignored_and_rewritten() {
    let d = dir("corrupt");
    let (k, v) = (key(6), variants());
    let device = "gpu A / driver 1";
    let path = store::Store::new(&d, device).path().to_path_buf();
    let foreign = TuneFile::new("gpu Z / driver 9", vec![]).to_bytes().unwrap();
    let mut flipped = TuneFile::new(device, vec![]).to_bytes().unwrap();
    let last = flipped.len() - 1;
    flipped[last] ^= 0x55;
    for bad in [b"not an archive at all".to_vec(), foreign, flipped, vec![]] {
        std::fs::write(&path, &bad).unwrap();
        let s = store::Store::new(&d, device);
        assert!(s.load().is_err(), "{bad:?} was trusted");
        let t = Tuner::open(device, Some(d.clone()));
        assert!(matches!(t.plan_with(&k, &v, Mode::On, false), Plan::Tune(_)));
        t.tune(&k, &v, &[0, 2], trials([1.0, 1.0, 0.5, 1.0], |_| out(&[1.0]))).unwrap();
        t.save();
        let file = s.load().expect("rewritten").expect("a file");
        assert_eq!(file.choices.len(), 1);
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_write_keeps_what_another_process_wrote_meanwhile() {
    let d = dir("merge");
    let v = variants();
    let device = "gpu A / driver 1";
    let (a, b) = (Tuner::open(device, Some(d.clone())), Tuner::open(device, Some(d.clone())));
    a.tune(&key(7), &v, &[0, 2], trials([1.0, 1.0, 0.5, 1.0], |_| out(&[1.0]))).unwrap();
    b.tune(&key(8), &v, &[0, 1], trials([1.0, 0.5, 1.0, 1.0], |_| out(&[1.0]))).unwrap();
    a.save();
    b.save();
    let file = store::Store::new(&d, device).load().unwrap().unwrap();
    assert_eq!(file.choices.len(), 2, "{file:?}");
    let _ = std::fs::remove_dir_all(&d);
}
