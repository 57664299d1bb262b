//! braid is a library: it emits `tracing` events and never installs a subscriber, so a program
//! can install its own after creating devices, whatever `RUST_LOG` says.

use braid::prelude::*;

#[test]
fn a_program_installs_its_own_subscriber_after_braid_ran_with_rust_log_set() {
    // SAFETY: this test binary runs this one test, so no other thread reads the environment.
    unsafe { std::env::set_var("RUST_LOG", "braid=debug") };
    let dev = Device::new_cpu();
    let y = (Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev) * 2.0).to_vec::<f32>().unwrap();
    assert_eq!(y, vec![2.0, 4.0]);
    let _ = Device::cpu();
    tracing_subscriber::fmt()
        .with_env_filter("braid=debug")
        .with_test_writer()
        .try_init()
        .expect("braid installed a global subscriber of its own (a library must not)");
    // And braid's events reach it.
    let z = (Tensor::from_vec(vec![3.0f32], [1], &dev) + 1.0).to_vec::<f32>().unwrap();
    assert_eq!(z, vec![4.0]);
}
