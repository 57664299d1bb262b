//! The `braid` command: tools around the engine.
//!
//! `braid inspect FILE.json` prints a summary of a schedule dump (written with
//! `BRAID_DUMP=DIR`), checks that it does not contradict itself and re-runs the validator on
//! it; exit status 1 if the file cannot be read as a dump, contradicts itself, or the validator
//! finds a hazard.

use braid::ScheduleDump;
use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "braid", version, about = "Tools for the braid tensor engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Summarise a schedule dump (flush-NNNNNN.json).
    Inspect {
        /// The dump file.
        file: std::path::PathBuf,
        /// Also print the full step listing.
        #[arg(long)]
        steps: bool,
    },
}

fn main() -> ExitCode {
    // braid emits `tracing` events; the binary shows them on stderr when `RUST_LOG` asks.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .try_init();
    }
    match Cli::parse().command {
        Command::Inspect { file, steps } => match inspect(&file, steps) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("braid inspect: {}: {e}", file.display());
                ExitCode::FAILURE
            }
        },
    }
}

fn inspect(file: &std::path::Path, steps: bool) -> Result<(), String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("cannot read: {e}"))?;
    let dump = ScheduleDump::from_json(&text)?;
    let d = dump.dump();
    println!("flush {} on {}", d.flush, d.device);
    if let Some(why) = &d.not_run {
        println!("NOT RUN: {why}");
    }
    println!("streams: {}", d.streams.len());
    for s in &d.streams {
        let kernels = s.steps.iter().filter(|st| matches!(st, braid_scheduler::dump::DumpStep::Kernel { .. })).count();
        let name = braid_scheduler::dump::stream_name(s.id);
        println!("  stream {name}: {} steps, {} kernels", s.steps.len(), kernels);
    }
    println!("kernels: {} ({} ops)", d.fusion.kernels, d.fusion.fused_ops);
    println!("events: {} ({} automatic)", d.events.len(), d.events.iter().filter(|e| e.auto).count());
    println!("buffers: {} ({} bytes)", d.buffers.len(), d.buffers.iter().map(|b| b.bytes).sum::<u64>());
    println!("planned peak: {} bytes", d.planned_peak_bytes);
    println!("fusion refusals: {}", d.fusion.refused.len());
    for r in &d.fusion.refused {
        println!("  n{} | n{}: {}", r.a, r.b, r.reason);
    }
    if steps {
        print!("{}", d.to_text());
    }
    let inconsistent = d.inconsistencies();
    if !inconsistent.is_empty() {
        println!("dump: {} inconsistenc{}", inconsistent.len(), if inconsistent.len() == 1 { "y" } else { "ies" });
        for i in &inconsistent {
            println!("  {i}");
        }
        return Err(format!("the dump contradicts itself in {} place(s)", inconsistent.len()));
    }
    let program = braid_scheduler::Program::from_dump(d)?;
    match braid_scheduler::validate::check(&program) {
        Ok(()) => {
            match &d.not_run {
                None => println!("validator: ok"),
                Some(_) => println!("validator: ok (the plan is sound, but it did not run)"),
            }
            Ok(())
        }
        Err(hazards) => {
            println!("validator: {} hazard(s)", hazards.len());
            for h in &hazards {
                println!("  {h}");
            }
            Err(format!("the schedule has {} hazard(s)", hazards.len()))
        }
    }
}
