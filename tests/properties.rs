//! Property tests: random programs (random ops, shapes with broadcasting, every dtype,
//! movement, reductions, matrix products, in-place updates, reads in the middle, dropped
//! tensors) run on the CPU device and compared with the f64 reference interpreter.
//!
//! Programs on streams run a quarter of the time twice: the second run makes new streams, so
//! its flushes reuse the first run's plans renamed to them (the plan cache keys streams by rank).
//!
//! `BRAID_PROPTEST_CASES` overrides the number of programs (default 5,000).

mod common;

use braid::Tensor;
use braid_devices::{Backend, DeviceError, cpu::CpuDevice, runtime::Flush};
use braid_graph::Target;
use braid_scheduler::Schedule;
use common::program::{self, Config};
use proptest::prelude::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

fn cases() -> u32 {
    std::env::var("BRAID_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(5000)
}

/// Runs `cases` programs of `config`, asserting each matches the reference and that the
/// comparisons are not vacuous.
fn run_suite(cases: u32, config: &Config, fusion: bool) {
    // Each suite has its own device (programs predict the seeds `rand` draws from it), with
    // poison mode on: a buffer freed or reused too early shows up as a wrong result.
    let dev = braid::testing::test_device();
    dev.set_poison(true);
    dev.set_fusion(fusion);
    // `BRAID_PROPTEST_SEED=N` replays one program (the seed a failure reports) and prints it.
    if let Some(seed) = std::env::var("BRAID_PROPTEST_SEED").ok().and_then(|v| v.parse().ok()) {
        let stats = program::run(seed, &dev, config).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
        println!("seed {seed}: {stats:?}");
        return;
    }
    // Totals, and each program's share of its elements compared (with its size and seed), so
    // that the vacuity check below weighs programs equally.
    let checked = AtomicUsize::new(0);
    let uncertain = AtomicUsize::new(0);
    let programs = AtomicUsize::new(0);
    let (reruns, rerun_hits) = (AtomicUsize::new(0), AtomicUsize::new(0));
    let decidable_share = Mutex::new(Vec::new());
    let proptest_config = ProptestConfig { cases, failure_persistence: None, ..ProptestConfig::default() };
    proptest!(proptest_config, |(seed in any::<u64>())| {
        let stats = program::run(seed, &dev, config).map_err(|e| TestCaseError::fail(format!("seed {seed}: {e}")))?;
        checked.fetch_add(stats.checked, Ordering::Relaxed);
        uncertain.fetch_add(stats.uncertain, Ordering::Relaxed);
        programs.fetch_add(1, Ordering::Relaxed);
        if config.streams > 0 && seed % 4 == 0 {
            let (hits, _) = dev.plan_cache_stats();
            program::run(seed, &dev, config).map_err(|e| TestCaseError::fail(format!("seed {seed}, run again on new streams: {e}")))?;
            reruns.fetch_add(1, Ordering::Relaxed);
            rerun_hits.fetch_add((dev.plan_cache_stats().0 - hits) as usize, Ordering::Relaxed);
        }
        let seen = stats.checked + stats.uncertain;
        if seen > 0 {
            decidable_share.lock().unwrap().push((stats.checked as f64 / seen as f64, seen, seed));
        }
    });
    let (c, u, p) = (checked.into_inner(), uncertain.into_inner(), programs.into_inner());
    let mut shares = decidable_share.into_inner().unwrap();
    shares.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mean_share = shares.iter().map(|s| s.0).sum::<f64>() / shares.len().max(1) as f64;
    println!("{p} programs: {c} elements compared, {u} skipped as uncertain");
    println!(
        "share of a program's elements compared: mean {mean_share:.3}; lowest {:?} (share, elements, seed)",
        &shares[..shares.len().min(3)]
    );
    assert_eq!(p, cases as usize);
    let (reruns, rerun_hits) = (reruns.into_inner(), rerun_hits.into_inner());
    if reruns > 0 {
        println!("{reruns} programs run again on new streams: {rerun_hits} flushes reused a plan");
        assert!(
            rerun_hits >= reruns / 2,
            "programs run again on new streams reused {rerun_hits} plans in {reruns} runs"
        );
    }
    // The comparison must not be vacuous: most elements are decidable. Programs weigh equally:
    // one large program whose values overflow can skip 100,000 elements at once, a quarter of
    // all that a suite of 40 large programs compares (CI's wgpu run once failed a bound on the
    // totals that way), while on average a program compares over 98% of what it reads.
    assert!(
        !shares.is_empty() && mean_share >= 0.8,
        "too many uncertain elements: {c} compared, {u} uncertain; a program compares {mean_share:.3} of its elements on average"
    );
}

/// Small shapes (up to 4 dimensions of up to 5): every op, dtype and edge case, many times.
#[test]
fn random_programs_match_the_reference() {
    run_suite(cases(), &Config::default(), true);
}

/// The same with fusion off (`BRAID_FUSION=0`): one kernel per op.
#[test]
fn random_programs_match_the_reference_without_fusion() {
    run_suite(cases() / 2, &Config::default(), false);
}

/// Work on several streams with user events (record, wait, synchronize) between them; every
/// schedule passes the validator (it runs on every flush in debug builds, and a hazard fails the
/// read) and matches the reference under poison mode.
#[test]
fn random_programs_on_streams_with_events_match_the_reference() {
    let config = Config { streams: 2, events: true, max_ops: 30, reads_in_middle: false, ..Config::default() };
    run_suite(cases(), &config, true);
}

/// Streams and events with fusion off.
#[test]
fn random_programs_on_streams_match_the_reference_without_fusion() {
    let config = Config { streams: 2, events: true, max_ops: 30, reads_in_middle: false, ..Config::default() };
    run_suite(cases() / 2, &config, false);
}

/// Random budgets (and offload hints) on random programs, on streams with user events:
/// offloaded schedules give the reference's results and plan within the budget, and budgets out
/// of reach are errors the engine recovers from.
#[test]
fn random_programs_under_memory_budgets_match_the_reference() {
    // Longer programs without fusion: more kernels, so values sit idle between their uses.
    let config = Config { streams: 2, events: true, budgets: true, max_ops: 32, ..Config::default() };
    run_suite(cases(), &config, false);
    let [offloaded, out_of_reach, left, copied_in] =
        program::BUDGET_STATS.each_ref().map(|s| s.load(Ordering::Relaxed));
    println!(
        "reads whose flush offloaded: {offloaded}; budgets out of reach (then raised): {out_of_reach}; \
         flushes leaving a value in host memory: {left}, copying one back in: {copied_in}"
    );
    // Not vacuous: some flushes offloaded, some budgets were out of reach, some values stayed
    // in host memory across flushes and came back. Per 1,000 programs on the CPU: about 53
    // reads offloaded, 220 budgets out of reach, 28 flushes leaving a value in host memory and
    // 35 copying one back in (15-33 reads offloaded on wgpu, lavapipe, and 155 out of reach).
    let least = (cases() / 200) as usize;
    assert!(
        offloaded >= least && out_of_reach >= least && left >= least && copied_in >= least,
        "too little exercised: {offloaded} reads offloaded, {out_of_reach} budgets out of reach, {left} left a \
         value in host memory, {copied_in} copied one in (want {least} each)"
    );
}

/// Larger shapes, so kernels run several chunks and parallel tasks.
#[test]
fn random_programs_with_large_shapes_match_the_reference() {
    let config = Config { max_rank: 3, max_dim: 48, max_ops: 10, ..Config::default() };
    run_suite((cases() / 25).max(40), &config, true);
}

/// The CPU device planned for a target that binds at most `target.max_kernel_buffers` buffers
/// per kernel (like wgpu on Metal or lavapipe, but tighter): a flush whose schedule has a
/// kernel binding more fails.
struct FewBindings {
    cpu: CpuDevice,
    target: Target,
}

impl Backend for FewBindings {
    fn name(&self) -> String {
        "cpu".into()
    }
    fn target(&self) -> &Target {
        &self.target
    }
    common::cpu_backend_methods!(but_target);
    fn begin<'a>(&'a self, schedule: &'a Schedule, poison: bool) -> Result<Box<dyn Flush + 'a>, DeviceError> {
        let limit = self.target.max_kernel_buffers;
        if let Some(k) = schedule.kernels.iter().find(|k| k.inputs.len() + k.outputs.len() > limit) {
            let segment = &schedule.fusion.segments[k.segment];
            return Err(DeviceError::Internal(format!(
                "kernel {:?} binds {} inputs and {} outputs, over the limit of {limit}: {segment:?}",
                k.id,
                k.inputs.len(),
                k.outputs.len()
            )));
        }
        self.cpu.begin(schedule, poison)
    }
}

/// Under a target's limit on a kernel's buffers, fusion stops growing kernels there (however
/// many of their values are read outside) and `cat` joins many parts in pieces; results still
/// match the reference.
#[test]
fn random_programs_on_a_target_with_few_bindings_match_the_reference() {
    let target = Target { max_kernel_buffers: 4, ..Target::CPU };
    let dev = braid::testing::device_with_backend(Arc::new(FewBindings { cpu: CpuDevice::new(), target }));
    dev.set_poison(true);
    let config = Config { max_ops: 24, ..Config::default() };
    for seed in 0..(cases() / 10).max(50) as u64 {
        program::run(seed, &dev, &config).unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
    // Many values of one kernel read afterwards, and a cat of many parts.
    let x = Tensor::from_vec((0..64).map(|i| i as f32 * 0.25 - 8.0).collect(), [64], &dev);
    let powers: Vec<Tensor> = (1..=12).map(|i| &x * i as f64).collect();
    let joined = Tensor::cat(&powers.iter().collect::<Vec<_>>(), 0);
    let got = joined.to_vec::<f32>().unwrap();
    let want: Vec<f32> = (1..=12).flat_map(|i| (0..64).map(move |j| (j as f32 * 0.25 - 8.0) * i as f32)).collect();
    assert_eq!(got, want);
    for p in &powers {
        assert_eq!(p.to_vec::<f32>().unwrap().len(), 64);
    }
}
