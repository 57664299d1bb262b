//! Printing of row kernels: one block per row, phases as the CPU's but for the reductions that
//! read none, which fold in one sweep (`print_rows`, `first_pass.rs`), loads that
//! several phases read kept in shared memory while the row fits (`row_keep.rs`), and the plan
//! every entry of a row kernel shares (`RowPlan`), which `split.rs` prints long rows among few
//! rows with, and `short_rows.rs` short rows several a block. Must never: depend on the block size beyond its being a power of two no larger
//! than the printed one (the launcher picks it), or let a thread read a kept element another
//! thread wrote (each thread reads back the positions it loaded itself, so no barrier is
//! needed between the phases' sweeps).

use super::reduce::{reduction, reductions};
use super::row_keep::plan_keep;
use super::row_vector::{plan_peeled_vector, plan_vector};
use super::vector::{Vector, aligned, copy_chunk, declare_chunk, read_chunk};
use super::*;
use std::cell::RefCell;

/// Prints live reduction `i` (`op` of node `x`, of dtype `d`) and returns its value's expression
/// (arguments `out, i, op, x, d`).
pub(super) type Reduced<'f> = dyn FnMut(&mut String, usize, ReduceOp, usize, DType) -> Result<String, String> + 'f;

/// The CPU's plan of a row kernel, shared by its entries.
pub(super) struct RowPlan<'a> {
    pub r: &'a RowKernel,
    /// Dimensions along the row (the axis, or all of them) and across rows.
    pub row_dims: Vec<usize>,
    pub pos_dims: Vec<usize>,
    /// Elements per row, and rows.
    pub len: usize,
    pub rows: usize,
    /// Threads per block printed (the shared arrays' size).
    pub threads: u32,
    /// Per node: constant along the row (computed once per row).
    pub per_row: Vec<bool>,
    /// Per node: read by a store (the others are not printed).
    pub live: Vec<bool>,
    /// Per dimension: whether some view or the flat index needs its index variable.
    pub used: Vec<bool>,
    /// A sweep's thread's first position along the row (`threadIdx.x`; a short-row kernel's
    /// `lane`), and how far it steps (`blockDim.x`; a column kernel's `ys`, a short-row kernel's
    /// `lanes`).
    pub lane: &'static str,
    pub step: &'static str,
    /// Positions a scalar sweep's loop is unrolled by (loads in flight per thread).
    pub unroll: u32,
    /// How its work is split (long rows, long columns).
    pub options: PrintOptions,
    /// A test and the constant `step` equals when it holds (a column kernel launched with the
    /// block size it was printed for): scalar sweeps are then printed twice, once stepping by
    /// the constant (see `scalar_sweep`).
    pub constant_step: Option<(String, String)>,
    /// The flat index of position `t` of the row (for `Index` nodes).
    pub index: String,
    /// The vector path of the sweeps, a plain row kernel's only, taken when the kernel's `vec`
    /// test finds its arguments aligned: each thread visits chunks of `width` neighbouring
    /// positions, `t0 = threadIdx.x * width` (past the row's `head` with a [`Self::peel`]) and
    /// on by `blockDim.x * width` (the same in every sweep, so a thread still reads back only
    /// the kept positions it wrote), reading the row-contiguous loads and writing the
    /// row-contiguous stores a chunk at a time, and its kept values too.
    pub(super) vector: Option<Vector>,
    /// Where a vector path's rows start at other alignments (rows of an odd length at an odd
    /// stride: a language model's logits over 50,257 tokens): the element offset of a row's
    /// first position in its chunked views, which all share its remainder modulo the width.
    /// Each row then walks its first `head` positions and its last ones in scalar sweeps and
    /// the aligned chunks between in the vector sweep (`vec_end` is where they end). Measured
    /// on an H200: the cross-entropy of GPT-2's logits, `[8192, 50257]` bf16, 1.94 ms before,
    /// 0.73 ms with it (its two sweeps over the logits at 2.3 TB/s).
    pub(super) peel: Option<String>,
}

impl<'a> RowPlan<'a> {
    pub fn new(r: &'a RowKernel, params: &[Param]) -> Result<RowPlan<'a>, String> {
        check_io(&r.loads, &r.stores, &r.expr, &r.dims, params)?;
        let nodes = &r.expr.nodes;
        let (row_dims, pos_dims) = r.row_and_position_dims()?;
        let len: usize = row_dims.iter().map(|&d| r.dims[d]).product();
        let rows: usize = pos_dims.iter().map(|&d| r.dims[d]).product();
        let threads = (len.next_power_of_two() as u32).clamp(32, MAX_ROW_THREADS);
        let mut plan = RowPlan {
            r,
            row_dims,
            pos_dims,
            len,
            rows,
            threads,
            per_row: vec![false; nodes.len()],
            live: vec![],
            used: vec![],
            lane: "threadIdx.x",
            step: "blockDim.x",
            unroll: 4,
            options: PrintOptions::default(),
            constant_step: None,
            index: String::new(),
            vector: None,
            peel: None,
        };
        // Constant along the row: the CPU's plan, node by node and store by store.
        for (i, n) in nodes.iter().enumerate() {
            plan.per_row[i] = match n.op {
                ExprOp::Load(slot) => plan.along(&r.loads[slot as usize].view),
                ExprOp::Const(_) | ExprOp::ConstInt(_) | ExprOp::Reduce(..) => true,
                ExprOp::Index => false,
                op => op.operands().iter().all(|&o| plan.per_row[o]),
            };
        }
        let (live, views) = live(&r.expr, &r.loads, &r.stores);
        let has_index = nodes.iter().zip(&live).any(|(n, &l)| l && n.op == ExprOp::Index);
        plan.used = used_dims(&r.dims, &views, has_index);
        plan.live = live;
        let flat = View { dims: r.dims.clone(), strides: Shape::new(&r.dims).contiguous_strides(), offset: 0 };
        plan.index = if r.axis.is_none() { "t".to_string() } else { offset_expr(&flat) };
        Ok(plan)
    }

    /// Whether view `v` is constant along the row.
    fn along(&self, v: &View) -> bool {
        self.row_dims.iter().all(|&d| v.strides[d] == 0)
    }

    /// The per-element nodes that `roots` need, in order.
    pub fn needed(&self, roots: &[usize]) -> Vec<usize> {
        self.needed_given(roots, &|_| false)
    }

    /// The per-element nodes that `roots` need when the values for which `given` holds are
    /// at hand (read back from shared memory, so none of their operands is needed), in order.
    pub fn needed_given(&self, roots: &[usize], given: &dyn Fn(usize) -> bool) -> Vec<usize> {
        let (nodes, per_row) = (&self.r.expr.nodes, &self.per_row);
        let mut need = vec![false; nodes.len()];
        let mut stack: Vec<usize> = roots.iter().copied().filter(|&x| !per_row[x]).collect();
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut need[i], true) && !given(i) {
                stack.extend(nodes[i].op.operands().into_iter().filter(|&o| !per_row[o]));
            }
        }
        (0..nodes.len()).filter(|&i| need[i]).collect()
    }

    /// The stores of one value per row, and the stores of one value per element.
    pub fn stores(&self) -> (Vec<&'a Store>, Vec<&'a Store>) {
        self.r.stores.iter().partition(|s| self.per_row[s.value as usize] && self.along(&s.view))
    }

    /// The live reductions: (node, op, operand, operand's dtype).
    pub fn reductions(&self) -> Vec<(usize, ReduceOp, usize, DType)> {
        crate::row_passes::live_reductions(&self.r.expr, &self.live)
    }

    /// Declares the index variables across rows of row `var` (when some view needs them).
    pub fn position(&self, out: &mut String, var: &str) {
        if self.pos_dims.iter().any(|&d| self.used[d]) {
            if var != "row" {
                let _ = writeln!(out, "  const long long row = {var};");
            }
            decompose(out, "  ", "row", &self.r.dims, &self.pos_dims, &self.used);
        }
    }

    /// Prints the nodes before `upto` that are constant along the row, in order: reductions
    /// through `reduced` (which prints and returns the value's expression), the others as
    /// expressions (checked even when dead: the CPU evaluates every per-row node).
    pub fn per_row_values(&self, out: &mut String, upto: usize, reduced: &mut Reduced<'_>) -> Result<(), String> {
        (0..upto).try_for_each(|i| self.per_row_value(out, i, reduced))
    }

    /// Node `i` as [`Self::per_row_values`] prints it (nothing unless it is constant along the
    /// row and live).
    pub fn per_row_value(&self, out: &mut String, i: usize, reduced: &mut Reduced<'_>) -> Result<(), String> {
        let n = &self.r.expr.nodes[i];
        let ExprOp::Reduce(op, x) = n.op else {
            if self.per_row[i] {
                let e = node_expr(Dialect::Cuda, &self.r.expr, &self.r.loads, i, &offset_expr, &self.index)?;
                if self.live[i] {
                    let _ = writeln!(out, "  const {} v{i} = {e};", ctype(n.dtype));
                }
            }
            return Ok(());
        };
        let d = self.r.expr.nodes[x as usize].dtype;
        if d == DType::Bool || n.dtype != if op == ReduceOp::ArgMax { DType::I64 } else { d } {
            return Err(format!("node {i}: {op:?} of {d} giving {}", n.dtype));
        }
        if self.live[i] {
            let value = reduced(out, i, op, x as usize, d)?;
            let _ = writeln!(out, "  const {} v{i} = {value};", ctype(n.dtype));
        }
        Ok(())
    }

    /// A sweep over positions `t` of the row from `from` to `to` (C expressions) in steps of
    /// the block: the per-element nodes `roots` need, the per-element `stores`, then `body`; it
    /// declares the index variables along the row that these read. With `keep`, a kept value
    /// is read from global memory (or computed) by the first sweep that needs it, from
    /// `keep<i>` after. With a vector path, the kernel's `vec` picks it or this loop.
    pub fn sweep(
        &self,
        out: &mut String,
        range: [&str; 2],
        roots: &[usize],
        stores: &[&Store],
        body: &str,
        keep: Option<&Keep>,
    ) -> Result<(), String> {
        let Some(v) = &self.vector else {
            return self.scalar_sweep(out, range, roots, stores, body, keep);
        };
        // Both paths print the same kept values as written: the state after one is the state
        // before the other.
        let before = keep.map(|k| k.written.borrow().clone());
        out.push_str("  if (vec) {\n");
        if self.peel.is_some() {
            // Nothing is kept with a peel (`plan_peeled_vector`): the three sweeps share no state.
            let lane = self.lane;
            self.scalar_sweep(out, [lane, "head"], roots, stores, body, None)?;
            let start = format!("head + {lane} * {}", v.width);
            self.vector_sweep(out, v, [&start, "vec_end"], roots, stores, body, None)?;
            self.scalar_sweep(out, [&format!("vec_end + {lane}"), range[1]], roots, stores, body, None)?;
        } else {
            let start = format!("{} * {}", self.lane, v.width);
            self.vector_sweep(out, v, [&start, range[1]], roots, stores, body, keep)?;
        }
        if let (Some(k), Some(b)) = (keep, before) {
            *k.written.borrow_mut() = b;
        }
        out.push_str("  } else {\n");
        self.scalar_sweep(out, range, roots, stores, body, keep)?;
        out.push_str("  }\n");
        Ok(())
    }

    /// What a sweep computes: the nodes `roots` need given the values read back from shared
    /// memory (for which the returned test holds), and the loads among them.
    fn sweep_needs(&self, roots: &[usize], keep: Option<&Keep>) -> (Vec<usize>, impl Fn(usize) -> bool, Vec<usize>) {
        let k = keep.map(|k| (k.kept.clone(), k.written.borrow().clone()));
        let from_keep = move |i: usize| k.as_ref().is_some_and(|(kept, written)| kept[i] && written[i]);
        // A value read back from shared memory needs none of its operands in this sweep.
        let need = self.needed_given(roots, &from_keep);
        let loads: Vec<usize> = need
            .iter()
            .copied()
            .filter(|&i| !from_keep(i) && matches!(self.r.expr.nodes[i].op, ExprOp::Load(_)))
            .collect();
        (need, from_keep, loads)
    }

    /// The scalar path of a sweep (the only one without a vector path): one position per
    /// thread a step, from `from` to `to` by the block.
    fn scalar_sweep(
        &self,
        out: &mut String,
        [from, to]: [&str; 2],
        roots: &[usize],
        stores: &[&Store],
        body: &str,
        keep: Option<&Keep>,
    ) -> Result<(), String> {
        let (r, nodes) = (self.r, &self.r.expr.nodes);
        let (need, from_keep, loads) = self.sweep_needs(roots, keep);
        let views: Vec<&View> =
            (loads.iter().map(|&i| self.load_view(i))).chain(stores.iter().map(|s| &s.view)).collect();
        let flat = need.iter().any(|&i| nodes[i].op == ExprOp::Index);
        let ty = self.position_type();
        let mut inner = String::new();
        let out_loop = out;
        let out = &mut inner;
        decompose(out, "    ", "t", &r.dims, &self.row_dims, &used_dims(&r.dims, &views, flat));
        for &i in &need {
            let ty = ctype(nodes[i].dtype);
            if from_keep(i) {
                let _ = writeln!(out, "    const {ty} v{i} = keep{i}[t];");
                continue;
            }
            let e = node_expr(Dialect::Cuda, &r.expr, &r.loads, i, &offset_expr, &self.index)?;
            let _ = writeln!(out, "    const {ty} v{i} = {e};");
            if let Some(k) = keep.filter(|k| k.kept[i]) {
                let _ = writeln!(out, "    keep{i}[t] = v{i};");
                k.written.borrow_mut()[i] = true;
            }
        }
        for s in stores {
            let _ = writeln!(out, "    {}", store_stmt(s, &offset_expr(&s.view)));
        }
        let header = |step: &str| {
            format!("  #pragma unroll {}\n  for ({ty} t = {from}; t < {to}; t += {step}) {{\n", self.unroll)
        };
        match &self.constant_step {
            // The same loop twice: NVRTC unrolls (and so overlaps the loads of) a loop whose step
            // is a constant, but not one whose step is known at run time only.
            Some((test, step)) => {
                let _ = write!(out_loop, "  if ({test}) {{\n{}{inner}{body}  }}\n  }} else {{\n", header(step));
                let _ = write!(out_loop, "{}{inner}{body}  }}\n  }}\n", header(self.step));
            }
            None => {
                let _ = writeln!(out_loop, "{}{inner}{body}  }}", header(self.step));
            }
        }
        Ok(())
    }

    /// The vector path of a sweep from `from` (a thread's first chunk) to `to`, a chunk at a
    /// time: the chunks of its vectorised loads and kept values read first, then per position
    /// of the chunk what [`Self::scalar_sweep`] prints (vectorised values from their chunks),
    /// then the chunks of its vectorised stores and newly kept values written.
    #[allow(clippy::too_many_arguments)]
    fn vector_sweep(
        &self,
        out: &mut String,
        v: &Vector,
        [from, to]: [&str; 2],
        roots: &[usize],
        stores: &[&Store],
        body: &str,
        keep: Option<&Keep>,
    ) -> Result<(), String> {
        let (r, nodes, w) = (self.r, &self.r.expr.nodes, v.width);
        let (need, from_keep, loads) = self.sweep_needs(roots, keep);
        let store_at = |s: &Store| r.stores.iter().position(|x| std::ptr::eq(x, s)).expect("a store of this kernel");
        let chunked_store = |s: &Store| v.stores[store_at(s)];
        let scalar_views: Vec<&View> = (loads.iter().filter(|&&i| !v.loads[i]).map(|&i| self.load_view(i)))
            .chain(stores.iter().filter(|s| !chunked_store(s)).map(|s| &s.view))
            .collect();
        let flat = need.iter().any(|&i| nodes[i].op == ExprOp::Index);
        let ty = self.position_type();
        let _ = writeln!(out, "  #pragma unroll 2\n  for ({ty} t0 = {from}; t0 < {to}; t0 += {} * {w}) {{", self.step);
        // The chunks' addresses: position `t0` along the row.
        let axis = self.row_dims[0];
        if loads.iter().any(|&i| v.loads[i]) || stores.iter().any(|s| chunked_store(s)) {
            let _ = writeln!(out, "    const long long d{axis} = t0;");
        }
        for &i in loads.iter().filter(|&&i| v.loads[i]) {
            let ExprOp::Load(slot) = nodes[i].op else { unreachable!("loads are loads") };
            let ld = &r.loads[slot as usize];
            let from = format!("a{} + {}", ld.arg, offset_expr(&ld.view));
            read_chunk(out, "    ", &format!("l{i}"), (storage_ctype(ld.dtype), ld.dtype.size()), w, &from);
        }
        let kept_here = |i: usize| keep.is_some_and(|k| k.kept[i]) && !from_keep(i);
        for &i in &need {
            let (ty, size) = (ctype(nodes[i].dtype), nodes[i].dtype.size());
            if from_keep(i) {
                read_chunk(out, "    ", &format!("r{i}"), (ty, size), w, &format!("keep{i} + t0"));
            } else if kept_here(i) {
                declare_chunk(out, "    ", &format!("w{i}"), ty, w);
            }
        }
        for s in stores.iter().filter(|s| chunked_store(s)) {
            declare_chunk(out, "    ", &format!("s{}", store_at(s)), storage_ctype(s.dtype), w);
        }
        let _ = writeln!(out, "    #pragma unroll\n    for (int e = 0; e < {w}; ++e) {{\n    const {ty} t = t0 + e;");
        decompose(out, "    ", "t", &r.dims, &self.row_dims, &used_dims(&r.dims, &scalar_views, flat));
        for &i in &need {
            let ty = ctype(nodes[i].dtype);
            let e = match nodes[i].op {
                _ if from_keep(i) => format!("r{i}[e]"),
                ExprOp::Load(slot) if v.loads[i] => load_value(r.loads[slot as usize].dtype, &format!("l{i}[e]")),
                _ => node_expr(Dialect::Cuda, &r.expr, &r.loads, i, &offset_expr, &self.index)?,
            };
            let _ = writeln!(out, "    const {ty} v{i} = {e};");
            if kept_here(i) {
                let _ = writeln!(out, "    w{i}[e] = v{i};");
            }
        }
        for s in stores {
            let _ = match chunked_store(s) {
                true => writeln!(out, "    s{}[e] = {};", store_at(s), stored_value(s)),
                false => writeln!(out, "    {}", store_stmt(s, &offset_expr(&s.view))),
            };
        }
        let _ = writeln!(out, "{body}    }}");
        for &i in need.iter().filter(|&&i| kept_here(i)) {
            copy_chunk(out, "    ", &format!("keep{i} + t0"), &format!("w{i}"), nodes[i].dtype.size() * w);
            keep.expect("kept").written.borrow_mut()[i] = true;
        }
        for s in stores.iter().filter(|s| chunked_store(s)) {
            let at = store_at(s);
            let to = format!("a{} + {}", s.arg, offset_expr(&s.view));
            copy_chunk(out, "    ", &to, &format!("s{at}"), s.dtype.size() * w);
        }
        out.push_str("  }\n");
        Ok(())
    }

    /// With a vector path, declares `vec` (whether the kernel takes it) and with a peel this
    /// row's `head` and `vec_end`.
    pub fn declare_vector_path(&self, out: &mut String) {
        let (r, len) = (self.r, self.len);
        let Some(v) = &self.vector else { return };
        let _ = writeln!(
            out,
            "  const bool vec = {}; // the vector path's arguments aligned",
            aligned(&v.args(&r.expr, &r.loads, &r.stores))
        );
        if let Some(first) = &self.peel {
            let (w, ty) = (v.width, self.position_type());
            let _ = writeln!(
                out,
                "  // This row's positions before its first aligned chunk, and after its last.\n  const {ty} head = ({ty})(({w}LL - ({first}) % {w}LL) % {w}LL);\n  const {ty} vec_end = head + ({len} - head) / {w} * {w};"
            );
        }
    }

    /// The view of load node `i`.
    fn load_view(&self, i: usize) -> &View {
        match self.r.expr.nodes[i].op {
            ExprOp::Load(slot) => &self.r.loads[slot as usize].view,
            _ => unreachable!("node {i} is not a load"),
        }
    }

    /// The C type of positions along the row: 32-bit where the row allows (fewer instructions
    /// per element).
    pub fn position_type(&self) -> &'static str {
        if self.len <= i32::MAX as usize { "int" } else { "long long" }
    }

    /// The per-row stores, by the thread for which `who` holds, then the per-element stores in
    /// a sweep over `range`.
    pub fn print_stores(
        &self,
        out: &mut String,
        who: &str,
        range: [&str; 2],
        keep: Option<&Keep>,
    ) -> Result<(), String> {
        self.print_stores_of(out, who, range, keep, &|_| true)
    }

    /// [`Self::print_stores`] of the per-row stores and the per-element ones that `elem` picks.
    pub fn print_stores_of(
        &self,
        out: &mut String,
        who: &str,
        range: [&str; 2],
        keep: Option<&Keep>,
        elem: &dyn Fn(&Store) -> bool,
    ) -> Result<(), String> {
        let (row_stores, mut elem_stores) = self.stores();
        elem_stores.retain(|s| elem(s));
        if !row_stores.is_empty() {
            let _ = writeln!(out, "  if ({who}) {{");
            for s in row_stores {
                let _ = writeln!(out, "    {}", store_stmt(s, &offset_expr(&s.view)));
            }
            let _ = writeln!(out, "  }}");
        }
        if !elem_stores.is_empty() {
            let roots: Vec<usize> = elem_stores.iter().map(|s| s.value as usize).collect();
            self.sweep(out, range, &roots, &elem_stores, "", keep)?;
        }
        Ok(())
    }
}

/// The values a row kernel keeps in shared memory (`keep<i>[t]`), and which of them a sweep
/// has written yet.
pub(super) struct Keep {
    kept: Vec<bool>,
    /// A computed value kept in the array of a kept load (`over[j] = Some(i)`): load `i`'s last
    /// reader is the sweep that computes `j`, where each thread reads `v<i>` at position `t`
    /// before it writes `v<j>` there.
    over: Vec<Option<usize>>,
    written: RefCell<Vec<bool>>,
}

/// Prints a row kernel: one entry, one block per row, or for long rows among few rows the
/// entries of `split.rs`. Returns the entries and the scratch bytes they need (0 but split).
pub(super) fn print_rows(
    out: &mut String,
    r: &RowKernel,
    name: &str,
    params: &mut Vec<Param>,
    options: &PrintOptions,
) -> Result<(Vec<Entry>, usize), String> {
    let mut p = RowPlan::new(r, params)?;
    p.options = *options;
    if super::split::splits(&p) {
        return super::split::print_split(out, &p, name, params);
    }
    if super::columns::columns(&p) {
        return super::columns::print_columns(out, &mut p, name, params);
    }
    if let Some(printed) = super::short_rows::print_short_rows(out, &mut p, name, params)? {
        return Ok(printed);
    }
    if p.rows > i32::MAX as usize {
        return Err(format!("{} rows: more blocks than one launch has", p.rows));
    }
    let (kept, over) = plan_keep(&p);
    (p.vector, p.peel) = match plan_vector(&p, &kept) {
        Some(v) => (Some(v), None),
        None => plan_peeled_vector(&p, &kept).map_or((None, None), |(v, first)| (Some(v), Some(first))),
    };
    if let Some(v) = &p.vector {
        // A thread per chunk of the row (the scalar path, if taken, strides over the same block).
        p.threads = ((p.len / v.width).next_power_of_two() as u32).clamp(32, MAX_ROW_THREADS);
    }
    let (len, rows, threads) = (p.len, p.rows, p.threads);
    let keep = Keep { kept, over, written: RefCell::new(vec![false; r.expr.nodes.len()]) };
    let dims = r.dims.as_slice();
    let _ = match r.axis {
        Some(a) => writeln!(out, "\n// One block per row of {dims:?} along dim {a} ({len} elements)."),
        None => writeln!(out, "\n// One block: all of {dims:?} is one row ({len} elements)."),
    };
    let _ = writeln!(out, "{} {{", signature(name, params));
    p.position(out, "blockIdx.x");
    for i in (0..keep.kept.len()).filter(|&i| keep.kept[i]) {
        let ty = ctype(r.expr.nodes[i].dtype);
        let _ = match keep.over[i] {
            None => writeln!(out, "  __shared__ __align__(16) {ty} keep{i}[{len}]; // v{i}, kept for later phases"),
            Some(l) => writeln!(out, "  {ty}* const keep{i} = keep{l}; // v{i}, kept over v{l} once v{l} is read"),
        };
    }
    p.declare_vector_path(out);
    let end = format!("{len}LL");
    let whole = ["threadIdx.x", end.as_str()];
    let merged = &mut |out: &mut String, first: &[super::first_pass::Reduction]| {
        let roots: Vec<usize> = first.iter().map(|&(_, _, x, _)| x).collect();
        reductions(out, first, [len, threads as usize], &|out, body| {
            p.sweep(out, whole, &roots, &[], body, Some(&keep))
        })
    };
    p.per_row_values_merged(out, merged, &mut |out, i, op, x, d| {
        reduction(out, i, op, x, d, [len, threads as usize], &|out, body| {
            p.sweep(out, whole, &[x], &[], body, Some(&keep))
        })
    })?;
    p.print_stores(out, "threadIdx.x == 0", whole, Some(&keep))?;
    out.push_str("}\n");
    Ok((vec![Entry { name: name.into(), launch: Launch::Rows { rows, threads } }], 0))
}
