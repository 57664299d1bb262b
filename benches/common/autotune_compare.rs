//! Tuning on against tuning off in one run (issue 44's target): each workload runs alternately
//! with `braid::autotune` set to `off` and to `on` (the order swapped every pair, so drift
//! spreads over both), as many pairs as asked; each run times itself as the bench always does
//! (warm-up, then the median of its runs: the first `on` run tunes during its warm-up and
//! checks, never in the timed runs). Reports the median of each side per row, their ratio, and
//! what the first tuning of each workload cost. "On" is `BRAID_AUTOTUNE`'s mode when it is
//! `exhaustive` (every variant timed), else `on` (the short list).

use braid::autotune::{self, Mode};

/// One workload: its name and a run giving `(row id, milliseconds)` for each row it times.
pub type Workload<'a> = (&'a str, Box<dyn FnMut() -> Vec<(String, f64)> + 'a>);

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[s.len() / 2]
}

/// Runs every workload `pairs` times under each setting; the report as Markdown.
pub fn compare(workloads: Vec<Workload<'_>>, pairs: usize) -> String {
    let tuned_mode = if autotune::mode() == Mode::Exhaustive { Mode::Exhaustive } else { Mode::On };
    let mut lines = vec![
        format!(
            "Tuning on: `{:?}` mode, {} (BRAID_DETERMINISTIC={}).\n",
            tuned_mode,
            if autotune::deterministic() { "bitwise variants only" } else { "variants that add in another order too" },
            autotune::deterministic() as u8
        ),
        "| row | tuning off (ms) | tuning on (ms) | on / off | kernels tuned (first on run) | tuning time (s) |"
            .to_string(),
        "|---|---|---|---|---|---|".to_string(),
    ];
    for (name, mut run) in workloads {
        let mut off: Vec<Vec<(String, f64)>> = Vec::new();
        let mut on: Vec<Vec<(String, f64)>> = Vec::new();
        let mut cost = None;
        for pair in 0..pairs {
            for tuned in if pair % 2 == 0 { [false, true] } else { [true, false] } {
                autotune::set_mode(if tuned { tuned_mode } else { Mode::Off });
                let (before, secs) = (autotune::tunings(), autotune::tuning_seconds());
                let rows = run();
                if tuned {
                    cost.get_or_insert((autotune::tunings() - before, autotune::tuning_seconds() - secs));
                    on.push(rows);
                } else {
                    off.push(rows);
                }
                eprintln!("autotune {name}: pair {pair}, tuning {}", if tuned { "on" } else { "off" });
            }
        }
        let (count, secs) = cost.unwrap_or_default();
        for (i, (id, _)) in off[0].iter().enumerate() {
            let o = median(&off.iter().map(|r| r[i].1).collect::<Vec<_>>());
            let n = median(&on.iter().map(|r| r[i].1).collect::<Vec<_>>());
            lines.push(format!("| {id} | {o:.3} | {n:.3} | {:.2} | {count} | {secs:.2} |", n / o));
        }
    }
    autotune::set_mode(tuned_mode);
    lines.join("\n")
}
