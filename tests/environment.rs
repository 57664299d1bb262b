//! `BRAID_*` variables are read when a flush starts: a value braid does not understand, or a
//! dump directory it cannot write, is an error naming the variable and what it accepts, and
//! nothing is lost (the read succeeds once the variable is fixed).

use braid::prelude::*;

#[test]
fn unknown_values_and_unwritable_dump_directories_are_errors_of_the_read() {
    let dev = Device::new_cpu();
    let y = Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev) * 3.0;
    // SAFETY (every set_var/remove_var below): this binary runs this one test, on one thread.
    let cases = [
        ("BRAID_FUSION", "maybe", "expected 1 or 0"),
        ("BRAID_RECOMPUTE", "later", "expected 1 or 0"),
        ("BRAID_POISON", "2", "expected 1 or 0"),
        ("BRAID_CPU_COMPILE", "sometimes", "off, background (also on, 1) or blocking"),
        ("BRAID_DUMP", "/proc/braid-cannot-write-here", "cannot be written"),
        ("BRAID_TRACE", "/proc/braid-cannot-write-here/trace.json", "cannot be written"),
    ];
    for (name, value, accepted) in cases {
        unsafe { std::env::set_var(name, value) };
        match y.to_vec::<f32>() {
            Err(Error::Environment { name: n, reason, .. }) => {
                assert_eq!(n, name);
                assert!(reason.contains(accepted), "{name}: {reason}");
            }
            other => panic!("{name}={value}: expected an environment error, got {other:?}"),
        }
        unsafe { std::env::remove_var(name) };
    }
    assert_eq!(y.to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
    // `BRAID_CPU_COMPILE` takes the yes/no spellings of the other variables too (`1` is the
    // default, background).
    for value in ["1", "on", "no"] {
        unsafe { std::env::set_var("BRAID_CPU_COMPILE", value) };
        assert_eq!((&y + 1.0).to_vec::<f32>().unwrap(), vec![4.0, 7.0], "BRAID_CPU_COMPILE={value}");
    }
    unsafe { std::env::remove_var("BRAID_CPU_COMPILE") };

    // A replayed step is a flush too: it reads the variables a replay uses (`BRAID_POISON`,
    // `BRAID_DUMP`, `BRAID_TRACE`) once, when it starts.
    let step = braid::Step::new(|x: &[Tensor]| vec![&x[0] * 3.0]);
    let arg = || Tensor::from_vec(vec![1.0f32, 2.0], [2], &dev);
    assert_eq!(step.call(&[arg()]).unwrap()[0].to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
    for (name, value, accepted) in cases.into_iter().filter(|c| matches!(c.0, "BRAID_POISON" | "BRAID_DUMP")) {
        unsafe { std::env::set_var(name, value) };
        match step.call(&[arg()]) {
            Err(Error::Environment { name: n, reason, .. }) => {
                assert_eq!(n, name);
                assert!(reason.contains(accepted), "step, {name}: {reason}");
            }
            other => panic!("step, {name}={value}: expected an environment error, got {other:?}"),
        }
        unsafe { std::env::remove_var(name) };
    }
    assert_eq!(step.call(&[arg()]).unwrap()[0].to_vec::<f32>().unwrap(), vec![3.0, 6.0]);
    assert_eq!(step.captures(), 1, "the failed calls kept the captured plan");
}
