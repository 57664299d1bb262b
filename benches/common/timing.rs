//! Timing shared by the benches that time a closure themselves (not through criterion).

use std::time::Instant;

/// Median milliseconds of `runs` calls of `f` after `warm` warm-up calls.
pub fn median_ms(warm: usize, runs: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..warm {
        f();
    }
    let mut times: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[times.len() / 2]
}
