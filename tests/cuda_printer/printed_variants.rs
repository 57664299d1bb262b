//! Kernels printed with the autotuner's other options (`braid_devices::cuda::tune::print_variants`:
//! other splits of long rows and columns, narrower vector accesses) against the CPU, as
//! `tests/cuda_kernels.rs` checks the default printings (its helpers and tolerances).

use super::*;

/// Long rows, whole-tensor reductions and long columns printed with the tuner's other splits
/// (`braid_lowering::cuda::PrintOptions`: segments of 2K to 16K elements, columns over 64 to
/// 512 blocks) give the CPU's results, as the default printing does.
#[test]
fn long_rows_printed_with_other_splits_match_the_cpu() {
    let Some(h) = common::cuda_harness("long rows, other splits") else { return };
    let mut rng = Rng::new(0x5E6);
    let shapes: [(Vec<usize>, Option<usize>); 5] = [
        (vec![1 << 20], None),
        (vec![3, 2, 200_000], None),
        (vec![2, 3, 400_000], Some(2)),
        (vec![20_000, 64], Some(0)),
        (vec![100_000, 40], Some(0)),
    ];
    let (mut runs, mut failures) = (0, vec![]);
    for (i, (dims, axis)) in shapes.iter().cycle().take(if quick() { 5 } else { 15 }).enumerate() {
        let case = loop {
            let case = rows_case_over(&mut rng, i, dims, *axis, MathLib::Cuda, false);
            if case.kernel.args[0].dtype.compute() != DType::F32 {
                break case;
            }
        };
        let cpu = run_cpu(&case.kernel, &case.init);
        let compiled = braid_devices::cuda::CudaKernel::new(&h.compiler, &case.kernel).unwrap();
        assert!(!compiled.printed().is_empty(), "{}: no other splits printed", case.label);
        for p in 1..=compiled.printed().len() {
            let options = LaunchOptions { printed: p as u8, ..LaunchOptions::default() };
            let mut args = case.init.clone();
            runs += 1;
            let failure = match run_compiled_on_gpu(&h, &compiled, &mut args, options) {
                Err(e) => Some(format!("{} ({:?}): {e}", case.label, compiled.printed()[p - 1].options)),
                Ok(()) => compare(&case, &cpu, &args).map(|f| format!("{f} ({:?})", compiled.printed()[p - 1].options)),
            };
            failures.extend(failure);
        }
    }
    eprintln!("long rows, other splits: {runs} GPU runs");
    assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
}

/// Large map loops and row kernels printed with narrower vector accesses (8 bytes, none: the
/// tuner's `print_variants`) give the CPU's results, at aligned and unaligned addresses; map
/// loops give the default printing's bytes (the tuner marks them bitwise).
#[test]
fn kernels_printed_with_narrower_vectors_match_the_cpu_and_maps_the_default() {
    let Some(h) = common::cuda_harness("narrower vectors") else { return };
    let mut rng = Rng::new(0x7EC);
    let (mut runs, mut failures) = (0, vec![]);
    for i in 0..if quick() { 4 } else { 12 } {
        let case = match i % 2 {
            0 => map_case_over(&mut rng, i, &[64, 128, 128], MathLib::Cuda),
            // Not f32 sums: the CPU's running sums are the looser side (see long rows).
            _ => loop {
                let case = rows_case_over(&mut rng, i, &[512, 2048], Some(1), MathLib::Cuda, false);
                if case.kernel.args[0].dtype != DType::F32 {
                    break case;
                }
            },
        };
        let cpu = run_cpu(&case.kernel, &case.init);
        let compiled = braid_devices::cuda::CudaKernel::new(&h.compiler, &case.kernel).unwrap();
        for skew in [0, 8] {
            let run = |printed| {
                let mut args = case.init.clone();
                let options = LaunchOptions { printed, skew, ..LaunchOptions::default() };
                run_compiled_on_gpu(&h, &compiled, &mut args, options).map(|()| args)
            };
            let default = run(0).unwrap_or_else(|e| panic!("{}: {e}", case.label));
            for (p, printed) in compiled.printed().iter().enumerate().filter(|(_, p)| p.options.vector_bytes != 16) {
                runs += 1;
                let label = format!("{} ({} vector bytes, skew {skew})", case.label, printed.options.vector_bytes);
                let failure = match run(p as u8 + 1) {
                    Err(e) => Some(format!("{label}: {e}")),
                    Ok(got) if matches!(case.kernel.body, Body::Map(_)) && got != default => {
                        Some(format!("{label}: not the default printing's bytes"))
                    }
                    Ok(got) => compare(&case, &cpu, &got).map(|f| format!("{f} ({label})")),
                };
                failures.extend(failure);
            }
        }
    }
    eprintln!("narrower vectors: {runs} GPU runs");
    assert!(runs > 0, "no kernel was printed with narrower vectors");
    assert!(failures.is_empty(), "{} differ:\n{}", failures.len(), failures.join("\n"));
}
