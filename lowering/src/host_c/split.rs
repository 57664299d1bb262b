//! Host C printing of row kernels whose few long rows the CPU splits across threads (a
//! whole-tensor reduction, a softmax over one long row: `braid_devices::cpu::split`). The
//! caller keeps what makes the result independent of the thread count: it cuts each row into
//! segments, runs them on its threads, and combines the segments' accumulators in order with
//! the interpreter's own combine. The printed code computes one segment at a time, through
//! entry points of one signature,
//! `void NAME(unsigned char *const *args, long long o, long long from, long long to, const unsigned char *results, unsigned char *state)`:
//!
//! - `NAME_fold{q}`, one per reduction of the kernel (every one, in node order, as
//!   [`RowPasses::phases`](crate::row_passes::RowPasses) lists them), folds row `o`'s positions
//!   `from..to` into a fresh accumulator and writes it to `state`: the value (in the operand's
//!   compute type) at byte 0, a float sum's compensation at byte 8, an argmax's position (`long
//!   long`) at byte 16. The positions are folded as [`super::rows`] folds a whole row (chunks of
//!   [`SPLIT_CHUNK`] from `from`, each in the interpreter's lanes, float sums compensated), so a
//!   segment's accumulator is the interpreter's bit for bit. A dead reduction's entry writes the
//!   identity. The first also writes the per-element stores that need no reduction
//!   ([`EarlyStores`](crate::row_passes::EarlyStores): a prologue the program keeps), as it
//!   computes their values, as the interpreter's first pass does.
//! - `NAME_row` writes row `o`'s per-row stores (`from` and `to` unused).
//! - `NAME_elements` writes the other per-element stores of positions `from..to`.
//!
//! `results` holds the finished value of each reduction before the one being folded (all of
//! them for the stores), 8 bytes each in node order, in the reduction's compute type: the entry
//! computes the per-row values it needs from them as a whole row's code would. `state` is
//! written by the fold entries only.
//!
//! Not printed (an `Err`, and the CPU interprets the kernel): what [`super::rows`] does not
//! print, and rows with positions after the axis (`inner > 1`: a few long column sums), whose
//! split the interpreter keeps. The printer only prints; how rows are segmented and combined is
//! the device's.

use super::array_ctype;
use super::fold::{FOLD_BLOCK, FoldStore, Printer};
use super::rows::Walk;
use crate::cexpr::*;
use crate::kernel::{Kernel, RowKernel};
use crate::row_passes::{SPLIT_CHUNK, early_stores};
use braid_graph::expr::ExprOp;
use std::fmt::Write;

/// Bytes per reduction in `results`, and between the fields of `state`.
pub const SPLIT_SLOT: usize = 8;

/// Prints row kernel `r` of `kernel` in its split form, entry points named after `name`;
/// returns the entry points: one fold per reduction (in node order), then the row stores, then
/// the element stores.
pub(super) fn print_split(
    out: &mut String,
    r: &RowKernel,
    kernel: &Kernel,
    name: &str,
    stream_bytes: usize,
) -> Result<Vec<String>, String> {
    let w = Walk::new(r, kernel)?;
    if w.inner > 1 {
        return Err(format!("split rows with {} positions after the axis (interpreted)", w.inner));
    }
    let nodes = &r.expr.nodes;
    let phases: Vec<usize> = w.passes.phases.iter().map(|&(q, _)| q).collect();
    let live_phases: Vec<usize> = phases.iter().copied().filter(|&q| w.live[q]).collect();
    w.check_reductions(&live_phases)?;
    // No row is widened into scratch: a segment converts its f16 loads as it reads them.
    let exprs = w.exprs(|_| false)?;
    let p = Printer { r, exprs: &exprs, len: w.len, width: SPLIT_CHUNK };
    let _ = writeln!(
        out,
        "\n// rows of {} positions over dims {:?} along axis {:?}, split: one segment per call, in chunks of {SPLIT_CHUNK}.",
        w.len,
        r.dims.as_slice(),
        r.axis
    );
    // Per-element stores that need no reduction are written by the first fold as it computes
    // them (see `EarlyStores`), the others by the element pass.
    let early = early_stores(r, &w.passes);
    // Large f32 outputs are streamed a block at a time, as the element pass streams them.
    let fold_store = |s: usize| match w.streams(s, stream_bytes) {
        true => FoldStore {
            at: format!("t{s}[j] = v{};", r.stores[s].value),
            flush: Some(format!("braid_stream_f32(a{} + w{s} + c + t, t{s}, {});", r.stores[s].arg, FoldStore::COUNT)),
        },
        false => FoldStore { at: w.store_at_p(s), flush: None },
    };
    let (first_need, first_stores, last_need): (&[usize], Vec<FoldStore>, &[usize]) = match &early {
        Some(e) => (&e.first_pass, e.stores.iter().map(|&s| fold_store(s)).collect(), &e.last_pass),
        None => (&[], vec![], &w.passes.last_phase),
    };
    let mut entries = Vec::new();
    for (q, &red) in phases.iter().enumerate() {
        let entry = format!("{name}_fold{q}");
        begin(out, &w, &entry, &exprs, &phases[..q], red);
        p.declare_acc(out, red);
        match q {
            0 if early.is_some() => {
                let streamed = early.iter().flat_map(|e| &e.stores).filter(|&&s| w.streams(s, stream_bytes));
                for &s in streamed {
                    let t = array_ctype(nodes[r.stores[s].value as usize].dtype);
                    let _ = writeln!(out, "    {t} t{s}[{FOLD_BLOCK}] __attribute__((aligned(64)));");
                }
                p.fold(out, red, (first_need, &[], &[]), ("from", "to"), &first_stores);
                if first_stores.iter().any(|s| s.flush.is_some()) {
                    // Non-temporal stores are weakly ordered: fenced before the caller goes on.
                    out.push_str("#if defined(__SSE__)\n    _mm_sfence();\n#endif\n");
                }
            }
            _ if w.live[red] => p.fold(out, red, (&w.passes.phases[q].1, &[], &[]), ("from", "to"), &[]),
            _ => {}
        }
        let ExprOp::Reduce(_, x) = nodes[red].op else { unreachable!("phases are reductions") };
        let t = ctype(nodes[x as usize].dtype);
        let _ = writeln!(
            out,
            "    __builtin_memcpy(state, &acc{red}, sizeof({t}));\n    __builtin_memcpy(state + {SPLIT_SLOT}, &comp{red}, sizeof({t}));\n    __builtin_memcpy(state + {}, &at{red}, 8);\n}}",
            2 * SPLIT_SLOT
        );
        entries.push(entry);
    }
    let entry = format!("{name}_row");
    begin(out, &w, &entry, &exprs, &phases, nodes.len());
    for (s, store) in r.stores.iter().enumerate().filter(|&(s, _)| w.passes.row_stores[s]) {
        let _ = writeln!(out, "    {}", store_stmt(store, &format!("w{s}")));
    }
    out.push_str("}\n");
    entries.push(entry);
    let entry = format!("{name}_elements");
    begin(out, &w, &entry, &exprs, &phases, nodes.len());
    let late: Vec<usize> = (0..r.stores.len())
        .filter(|&s| !w.passes.row_stores[s] && early.as_ref().is_none_or(|e| !e.stores.contains(&s)))
        .collect();
    if w.element_pass(out, &p, ((last_need, &[], &[]), &late), ("from", "to"), stream_bytes) {
        // Non-temporal stores are weakly ordered: fence them before the caller reports done.
        out.push_str("#if defined(__SSE__)\n  _mm_sfence();\n#endif\n");
    }
    out.push_str("}\n");
    entries.push(entry);
    Ok(entries)
}

/// Opens entry point `entry` of a split row kernel: its arguments, row `o`'s starts, the
/// finished reductions `done` (from `results`), and the per-row values below node `upto`.
fn begin(out: &mut String, w: &Walk, entry: &str, exprs: &[String], done: &[usize], upto: usize) {
    let _ = writeln!(
        out,
        "void {entry}(unsigned char *const *args, long long o, long long from, long long to, const unsigned char *results, unsigned char *state) {{"
    );
    w.declare_args(out);
    out.push_str("  (void)from;\n  (void)to;\n  (void)results;\n  (void)state;\n");
    w.declare_row_starts(out, "    ");
    let nodes = &w.r.expr.nodes;
    for (q, &red) in done.iter().enumerate() {
        let t = ctype(nodes[red].dtype);
        let _ =
            writeln!(out, "    {t} v{red};\n    __builtin_memcpy(&v{red}, results + {}, sizeof({t}));", q * SPLIT_SLOT);
        let _ = writeln!(out, "    (void)v{red};");
    }
    // The per-row values in node order, as a whole row's code computes them.
    for i in (0..upto).filter(|&i| w.per_row_value(i)) {
        let _ = writeln!(out, "    const {} v{i} = {};", ctype(nodes[i].dtype), exprs[i]);
    }
}
