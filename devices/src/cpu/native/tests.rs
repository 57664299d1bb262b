//! The compiled kernels' own unit tests (the suites in `tests/native_*.rs` run whole kernels).

use super::*;

#[test]
fn a_source_the_compiler_rejects_is_an_error_naming_it() {
    if let Err(e) = compile::available() {
        eprintln!("native: SKIPPED, no C compiler: {e}");
        return;
    }
    let source = host_c::HostSource {
        source: "this is not C;\n".into(),
        entries: vec!["f".into()],
        row_scratch: None,
        split_rows: false,
    };
    let err = NativeKernel::load(&source).err().expect("a compile error");
    assert!(err.contains("failed") && err.contains("error"), "{err}");
    // A slot whose compile failed stays failed (and its kernel interpreted), without retrying.
    let slot = Slot { source, built: OnceLock::new(), queued: AtomicBool::new(false), runs: AtomicU64::new(0) };
    assert!(slot.build().is_err());
    assert!(slot.build().is_err());
}

#[test]
fn a_library_without_the_entry_point_is_an_error() {
    if compile::available().is_err() {
        eprintln!("native: SKIPPED, no C compiler");
        return;
    }
    let source = host_c::HostSource {
        source: "void g(void) {}\n".into(),
        entries: vec!["f".into()],
        row_scratch: None,
        split_rows: false,
    };
    let err = NativeKernel::load(&source).err().expect("a missing entry point");
    assert!(err.contains("entry f not found"), "{err}");
}
