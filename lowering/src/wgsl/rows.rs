//! Row kernels: reductions along one axis (or over the whole index space) with the
//! elementwise work around them. [`print_rows`] plans the kernel once (which nodes are
//! constant along a row, which per-element nodes each phase needs, as the CPU's `rows` module
//! does) and prints it in one entry, one workgroup per row, or hands it to `split` when rows
//! are too long for one workgroup and too few to fill the GPU.
//!
//! A "row" is every index that differs only along the axis; its "position" (which row) is
//! the row-major index over the other dimensions. Inside an entry, `d{k}` are the index
//! variables: position dimensions at the top, row dimensions in each sweep over the row.

use super::*;
use crate::kernel::RowKernel;
use braid_graph::ReduceOp;

/// Elements per segment of a split row, and the rows below which long rows are split.
pub(super) const SEGMENT: usize = 4096;
pub(super) const SPLIT_BELOW_ROWS: usize = 128;
/// Threads per workgroup of a row kernel (fewer for short rows; a power of two).
pub const MAX_ROW_THREADS: u32 = 256;

/// What a row kernel looks like from a row's point of view.
pub(super) struct RowPlan<'a> {
    pub r: &'a RowKernel,
    /// Per node: constant along the row.
    pub per_row: Vec<bool>,
    pub live: Vec<bool>,
    pub row_dims: Vec<usize>,
    pub pos_dims: Vec<usize>,
    /// Elements per row, and rows.
    pub len: usize,
    pub rows: usize,
    /// Per store: written once per row (a per-row value through a view constant along it).
    pub row_store: Vec<bool>,
}

impl RowPlan<'_> {
    /// The per-element nodes needed to compute `roots`, in order.
    pub fn needed(&self, roots: &[usize]) -> Vec<usize> {
        let nodes = &self.r.expr.nodes;
        let mut need = vec![false; nodes.len()];
        let mut stack: Vec<usize> = roots.iter().copied().filter(|&x| !self.per_row[x]).collect();
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut need[i], true) {
                stack.extend(nodes[i].op.operands().into_iter().filter(|&o| !self.per_row[o]));
            }
        }
        (0..nodes.len()).filter(|&i| need[i]).collect()
    }

    /// The live reductions, in order: (node, op, operand, operand dtype).
    pub fn reductions(&self) -> Vec<(usize, ReduceOp, usize, DType)> {
        crate::row_passes::live_reductions(&self.r.expr, &self.live)
    }

    /// Declares the position dimensions of row `var`.
    pub fn decompose_position(&self, out: &mut String, var: &str) {
        memory::decompose(out, "  ", var, &self.r.dims, &self.pos_dims);
    }

    /// A sweep over row positions `t` from `start` to `end` (u32 expressions) in steps of
    /// `threads`: declares the row dimensions, the per-element nodes `need`, then `body`.
    pub fn sweep(
        &self,
        out: &mut String,
        written: &[bool],
        [start, end]: [&str; 2],
        threads: u32,
        need: &[usize],
        body: &str,
    ) -> Result<(), String> {
        let _ = writeln!(out, "  for (var t = {start} + lid; t < {end}; t = t + {threads}u) {{");
        memory::decompose(out, "    ", "t", &self.r.dims, &self.row_dims);
        let index = memory::flat_index(&self.r.dims);
        for &i in need {
            let_node(out, "    ", &self.r.expr, &self.r.loads, written, i, &index)?;
        }
        let _ = writeln!(out, "{body}  }}");
        Ok(())
    }

    /// Prints the live per-row nodes before node `upto` that are not printed yet (reductions
    /// excluded: their values come from `reduced`).
    pub fn per_row_values(
        &self,
        out: &mut String,
        written: &[bool],
        upto: usize,
        printed: &mut [bool],
    ) -> Result<(), String> {
        let index = memory::flat_index(&self.r.dims);
        for (i, done) in printed.iter_mut().enumerate().take(upto) {
            let n = &self.r.expr.nodes[i];
            if *done || !self.per_row[i] || !self.live[i] || matches!(n.op, ExprOp::Reduce(..)) {
                continue;
            }
            let_node(out, "  ", &self.r.expr, &self.r.loads, written, i, &index)?;
            *done = true;
        }
        Ok(())
    }
}

pub(super) fn plan(r: &RowKernel) -> Result<RowPlan<'_>, String> {
    let nodes = &r.expr.nodes;
    let (row_dims, pos_dims) = r.row_and_position_dims()?;
    let along = |v: &View| row_dims.iter().all(|&d| v.strides[d] == 0);
    let mut per_row = vec![false; nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        per_row[i] = match n.op {
            ExprOp::Load(slot) => along(&r.loads[slot as usize].view),
            ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Reduce(..) => true,
            ExprOp::Index => false,
            op => op.operands().iter().all(|&o| per_row[o]),
        };
    }
    for (i, n) in nodes.iter().enumerate() {
        if let ExprOp::Reduce(op, x) = n.op {
            let d = nodes[x as usize].dtype;
            if d == DType::Bool || n.dtype != if op == ReduceOp::ArgMax { DType::I64 } else { d } {
                return Err(format!("node {i}: {op:?} of {d} giving {}", n.dtype));
            }
        }
    }
    let row_store = r.stores.iter().map(|s| per_row[s.value as usize] && along(&s.view)).collect();
    Ok(RowPlan {
        r,
        live: live(&r.expr, &r.stores),
        len: row_dims.iter().map(|&d| r.dims[d]).product(),
        rows: pos_dims.iter().map(|&d| r.dims[d]).product(),
        per_row,
        row_dims,
        pos_dims,
        row_store,
    })
}

use crate::kernel::View;

pub(super) fn print_rows(m: &mut Module<'_>, r: &RowKernel) -> Result<(), String> {
    m.check(&r.loads, &r.stores, &r.expr, &r.dims)?;
    let p = plan(r)?;
    for i in 0..r.expr.nodes.len() {
        if !matches!(r.expr.nodes[i].op, ExprOp::Reduce(..)) {
            map::check_node(&r.expr, i)?;
        }
    }
    if p.rows == 0 {
        return Ok(());
    }
    if (p.rows * p.len) as u64 >= 1 << 32 {
        return Err(format!("a row kernel of {} elements: wgpu kernels index with u32", p.rows * p.len));
    }
    if p.rows < SPLIT_BELOW_ROWS && p.len >= 2 * SEGMENT {
        return super::split::print_split(m, &p);
    }
    let threads = (p.len.next_power_of_two() as u32).clamp(32, MAX_ROW_THREADS);
    let comment = match r.axis {
        Some(a) => format!("One workgroup per row of {:?} along dim {a} ({} elements).", r.dims.as_slice(), p.len),
        None => format!("One workgroup: all of {:?} is one row ({} elements).", r.dims.as_slice(), p.len),
    };
    m.begin_entry("rows", p.rows as u64, threads, &comment)?;
    let written = m.written();
    let mut out = String::new();
    p.decompose_position(&mut out, "wg");
    let mut printed = vec![false; r.expr.nodes.len()];
    let mut shared = String::new();
    for (i, op, x, d) in p.reductions() {
        p.per_row_values(&mut out, &written, i, &mut printed)?;
        declare_shared(&mut shared, i, op, d, threads)?;
        fold(&mut out, &p, &written, i, op, x, d, ["0u", &format!("{}u", p.len)], threads)?;
        tree(&mut out, i, op, d, threads)?;
        let value = match op {
            ReduceOp::ArgMax => format!("vec2<u32>(ridx{i}[0], 0u)"),
            // The mean of nothing is NaN (0 / 0 at run time is not defined to be in WGSL).
            ReduceOp::Mean if d == DType::F32 && p.len == 0 => "bitcast<f32>(braid_opaque(0x7fc00000u))".into(),
            ReduceOp::Mean if d == DType::F32 => format!("red{i}[0] / {}", scalar::f32_const(p.len as f64)),
            _ => format!("red{i}[0]"),
        };
        let _ = writeln!(out, "  let v{i}: {} = {value};", scalar::reg_type(r.expr.nodes[i].dtype)?);
        printed[i] = true;
    }
    p.per_row_values(&mut out, &written, r.expr.nodes.len(), &mut printed)?;
    stores(&mut out, &p, &written, ["0u", &format!("{}u", p.len)], threads, "lid == 0u")?;
    out.push_str("}\n");
    check_shared(m, &shared, threads)?;
    m.body = format!("{shared}{}{out}", m.body);
    Ok(())
}

/// Per-row stores (made by the thread where `first` holds), then a sweep over row positions
/// `range` for the per-element stores.
pub(super) fn stores(
    out: &mut String,
    p: &RowPlan<'_>,
    written: &[bool],
    range: [&str; 2],
    threads: u32,
    first: &str,
) -> Result<(), String> {
    let row: Vec<&Store> = p.r.stores.iter().zip(&p.row_store).filter(|(_, r)| **r).map(|(s, _)| s).collect();
    let elem: Vec<&Store> = p.r.stores.iter().zip(&p.row_store).filter(|(_, r)| !**r).map(|(s, _)| s).collect();
    if !row.is_empty() {
        let _ = writeln!(out, "  if ({first}) {{");
        for s in row {
            let _ = writeln!(out, "    {}", memory::store_of(s)?);
        }
        let _ = writeln!(out, "  }}");
    }
    if !elem.is_empty() {
        let roots: Vec<usize> = elem.iter().map(|s| s.value as usize).collect();
        let mut body = String::new();
        for s in &elem {
            let _ = writeln!(body, "    {}", memory::store_of(s)?);
        }
        p.sweep(out, written, range, threads, &p.needed(&roots), &body)?;
    }
    Ok(())
}

/// Declares the workgroup arrays of reduction `i` (its values, and positions for argmax).
pub(super) fn declare_shared(
    shared: &mut String,
    i: usize,
    op: ReduceOp,
    d: DType,
    threads: u32,
) -> Result<(), String> {
    let _ = writeln!(shared, "var<workgroup> red{i}: array<{}, {threads}>;", scalar::reg_type(d)?);
    if op == ReduceOp::ArgMax {
        let _ = writeln!(shared, "var<workgroup> ridx{i}: array<u32, {threads}>;");
    }
    Ok(())
}

/// Errs when the declared workgroup arrays exceed the adapter's workgroup storage.
pub(super) fn check_shared(m: &Module<'_>, shared: &str, threads: u32) -> Result<(), String> {
    let per_entry: u64 = shared.lines().map(|l| if l.contains("vec2<u32>") { 8 } else { 4 } * threads as u64).sum();
    if per_entry > m.features.max_workgroup_storage_size as u64 {
        return Err(format!(
            "{per_entry} bytes of workgroup memory exceed the adapter's max_compute_workgroup_storage_size ({})",
            m.features.max_workgroup_storage_size
        ));
    }
    Ok(())
}

/// Each thread folds the row positions it strides over in `range` into `acc{i}` (and
/// `arg{i}`, the position of its argmax), with the per-element nodes operand `x` needs.
#[allow(clippy::too_many_arguments)]
pub(super) fn fold(
    out: &mut String,
    p: &RowPlan<'_>,
    written: &[bool],
    i: usize,
    op: ReduceOp,
    x: usize,
    d: DType,
    range: [&str; 2],
    threads: u32,
) -> Result<(), String> {
    let _ = writeln!(out, "  // Reduction: v{i} = {} of v{x} along the row.", op.name());
    let _ = writeln!(out, "  var acc{i}: {} = {};", scalar::reg_type(d)?, scalar::identity(op, d)?);
    if op == ReduceOp::ArgMax {
        let _ = writeln!(out, "  var arg{i}: u32 = 0u;");
    }
    let (acc, v) = (format!("acc{i}"), format!("v{x}"));
    let body = match op {
        ReduceOp::Sum | ReduceOp::Mean => format!("    {acc} = {};\n", scalar::binary(PrimBinary::Add, d, &acc, &v)?),
        ReduceOp::ArgMax => {
            format!("    if ({}) {{ {acc} = {v}; arg{i} = t; }}\n", wins(op, d, [&acc, &v, &format!("arg{i}"), "t"]))
        }
        _ => format!("    if ({}) {{ {acc} = {v}; }}\n", wins(op, d, [&acc, &v, "0u", "0u"])),
    };
    p.sweep(out, written, range, threads, &p.needed(&[x]), &body)
}

/// Stores each thread's `acc{i}` (and `arg{i}`) in `red{i}` (and `ridx{i}`) and combines them
/// in a tree: the result is in element 0.
pub(super) fn tree(out: &mut String, i: usize, op: ReduceOp, d: DType, threads: u32) -> Result<(), String> {
    let arg = op == ReduceOp::ArgMax;
    let _ = writeln!(
        out,
        "  red{i}[lid] = acc{i};{}",
        if arg { format!(" ridx{i}[lid] = arg{i};") } else { String::new() }
    );
    let _ = writeln!(out, "  workgroupBarrier();");
    let _ = writeln!(out, "  for (var s = {}u; s > 0u; s = s >> 1u) {{\n    if (lid < s) {{", threads / 2);
    let (a, b) = (format!("red{i}[lid]"), format!("red{i}[lid + s]"));
    match op {
        ReduceOp::Sum | ReduceOp::Mean => {
            let _ = writeln!(out, "      {a} = {};", scalar::binary(PrimBinary::Add, d, &a, &b)?);
        }
        _ => {
            let (ia, ib) = (format!("ridx{i}[lid]"), format!("ridx{i}[lid + s]"));
            let take = if arg { format!(" {ia} = {ib};") } else { String::new() };
            let w = wins(op, d, [&a, &b, if arg { &ia } else { "0u" }, if arg { &ib } else { "0u" }]);
            let _ = writeln!(out, "      if ({w}) {{ {a} = {b};{take} }}");
        }
    }
    let _ = writeln!(out, "    }}\n    workgroupBarrier();\n  }}");
    Ok(())
}

use braid_graph::expr::PrimBinary;

/// Whether candidate `b` (at row position `ib`) replaces the running `a` (at `ia`): the CPU's
/// rules (NaN wins and sticks; the first of equal maxima wins), independent of the order in
/// which partial results combine.
pub(super) fn wins(op: ReduceOp, d: DType, [a, b, ia, ib]: [&str; 4]) -> String {
    let better = match (op, d) {
        (ReduceOp::Min, DType::I64) => format!("braid_i64_lt({b}, {a})"),
        (_, DType::I64) => format!("braid_i64_lt({a}, {b})"),
        (ReduceOp::Min, _) => format!("{b} < {a}"),
        _ => format!("{b} > {a}"),
    };
    let equal = if d == DType::I64 { format!("all({b} == {a})") } else { format!("{b} == {a}") };
    match (op, d == DType::F32) {
        (ReduceOp::ArgMax, true) => format!(
            "select(!braid_isnan({a}) && ({better} || ({equal} && {ib} < {ia})), !braid_isnan({a}) || {ib} < {ia}, braid_isnan({b}))"
        ),
        (ReduceOp::ArgMax, false) => format!("{better} || ({equal} && {ib} < {ia})"),
        (_, true) => format!("!braid_isnan({a}) && ({better} || braid_isnan({b}))"),
        (_, false) => better,
    }
}
