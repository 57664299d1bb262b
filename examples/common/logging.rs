//! Logging for the examples: braid only emits `tracing` events and never installs a subscriber,
//! so a program that wants to see them installs one (here: stderr, filtered by `RUST_LOG`, e.g.
//! `RUST_LOG=braid=debug` for one line per kernel).

/// Installs a stderr subscriber filtered by `RUST_LOG`, if the variable is set.
pub fn init() {
    if std::env::var_os("RUST_LOG").is_some() {
        use std::io::IsTerminal;
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_ansi(std::io::stderr().is_terminal())
            .try_init();
    }
}
