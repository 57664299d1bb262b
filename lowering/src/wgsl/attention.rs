//! Fused attention ([`AttentionKernel`]) as one WGSL entry per pass, tiled as the CPU's
//! `attention` module is: one workgroup per (problem, tile of 16 owned rows), walking the
//! other operand in tiles of 32 rows, 256 threads (16 per owned row).
//!
//! - Forward: the owned rows are queries. Per key tile the workgroup computes the `[16, 32]`
//!   scores; one thread per row finds the tile's maximum and the online softmax's rescaling
//!   factor; every thread turns its scores into probabilities and adds `p v` to its columns of
//!   the output row (columns `lane + 16 r`), keeping the row's sum as it goes.
//! - Query gradient: the owned rows are queries; per key tile `ds = p (dO . v - delta)`, with
//!   `p = exp(s - lse)` recomputed from the saved log-sum-exp, then `dq += ds k`.
//! - Key and value gradients: the owned rows are keys; per query tile `dv += p dO` and
//!   `dk += ds q`.
//!
//! Operand rows are staged in workgroup memory in chunks of `dc` columns (a multiple of 16
//! chosen so that the pass's tiles fit the adapter's workgroup storage; each row padded by a
//! word against bank conflicts), so any head dimension runs. Each thread keeps its output
//! columns in private arrays indexed only by constants (the chunks are unrolled when
//! printed). Everything is computed in f32: f16 and bf16 operands are widened as they are
//! loaded (they are stored packed in u32 words and converted in integer arithmetic, so they
//! need no `shader-f16`), and outputs are rounded to their dtype once, when stored.
//!
//! Masked entries (keys after a query under `causal`, rows past the end) hold a sentinel
//! (`-inf`'s bits) in the score tile and are skipped, never multiplied (a `0 * inf` would be a
//! NaN); as on the CPU, a score that is itself `-inf` counts as masked.
//!
//! Must never: hold more scores than one `[16, 32]` tile (no `[sq, sk]` buffer exists), let
//! two invocations write one output element (no atomics on values: every element is written
//! once, by the thread owning its row and column), or read an operand outside the elements
//! `AttentionKernel::check` verified.

use super::*;
use crate::attention::{AttentionKernel, AttentionPass};
use crate::kernel::View;

/// Rows of the owned operand per workgroup, threads per owned row, rows per tile of the
/// operand walked over, and threads per workgroup.
const OWN: usize = 16;
const LANES: usize = 16;
const ITER: usize = 32;
const THREADS: u32 = (OWN * LANES) as u32;
/// Scores each thread computes per tile (columns `lane + 16 t` of its row).
const PER_THREAD: usize = ITER / LANES;
/// The widest chunk of columns staged at once.
const MAX_CHUNK: usize = 128;

/// A staged operand: its workgroup tile, its load, and which rows a tile holds.
struct Staged<'a> {
    tile: &'static str,
    /// The role (`q`, `k`, `v`, `o`), naming its problem base `base_{role}`.
    role: &'static str,
    load: &'a Load,
    /// Rows in one problem (`sq` or `sk`).
    rows: usize,
    /// Owned (`OWN` rows from `r0`) or walked over (`ITER` rows from `i0`).
    owned: bool,
}

impl Staged<'_> {
    fn tile_rows(&self) -> usize {
        if self.owned { OWN } else { ITER }
    }
}

/// Columns per chunk (`dc`, a multiple of 16), chunks, and accumulators per thread (one per 16
/// columns of the head dimension rounded up to 16).
struct Chunking {
    d: usize,
    dc: usize,
    chunks: usize,
    regs: usize,
}

impl Chunking {
    /// Words per staged row.
    fn pitch(&self) -> usize {
        self.dc + 1
    }
}

/// The chunking of a pass staging `rows` tile rows besides `extra` words of workgroup memory:
/// the widest chunk up to [`MAX_CHUNK`] that fits, balanced over the chunks `d` then needs.
fn chunking(d: usize, rows: usize, extra: usize, limit: u32) -> Result<Chunking, String> {
    let bytes = |dc: usize| 4 * (rows * (dc + 1) + extra);
    let widest = (1..=MAX_CHUNK / 16).rev().map(|n| n * 16).find(|&dc| bytes(dc) <= limit as usize);
    let Some(widest) = widest else {
        return Err(format!(
            "attention needs {} bytes of workgroup memory, over the adapter's max_compute_workgroup_storage_size ({limit})",
            bytes(16)
        ));
    };
    let padded = d.div_ceil(16) * 16;
    let chunks = padded.div_ceil(widest);
    let dc = padded.div_ceil(chunks).div_ceil(16) * 16;
    Ok(Chunking { d, dc, chunks, regs: padded / 16 })
}

/// Bytes of workgroup memory the declarations in `decls` take (f32 arrays).
pub(super) fn workgroup_bytes(decls: &str) -> usize {
    let words = |l: &str| l.rsplit_once(", ")?.1.trim_end_matches(">;").parse::<usize>().ok();
    decls.lines().filter(|l| l.starts_with("var<workgroup>")).filter_map(words).map(|w| w * 4).sum()
}

/// ` + var * stride` (` - ...` for a negative stride, nothing for 0), in wrapping u32.
fn term(var: &str, stride: isize) -> String {
    match stride {
        0 => String::new(),
        1 => format!(" + {var}"),
        s if s > 0 => format!(" + {var} * {s}u"),
        s => format!(" - {var} * {}u", s.unsigned_abs()),
    }
}

/// The offset of a view's problem: its batch dimensions (`d0, d1, ..`, declared from `b`).
fn problem_base(view: &View, batch: usize) -> String {
    let mut v = view.clone();
    v.dims[batch..].iter_mut().for_each(|e| *e = 1);
    memory::offset(&v)
}

/// Prints one pass's entry body (`out`) and its module-level declarations (`decls`).
struct Printer<'a> {
    a: &'a AttentionKernel,
    written: Vec<bool>,
    ch: Chunking,
    decls: String,
    out: String,
}

impl Printer<'_> {
    /// The register value of row `r` (and column `c`) of `l`, whose problem base is
    /// `base_{role}`.
    fn load(&self, role: &str, l: &Load, r: &str, c: Option<&str>) -> Result<String, String> {
        let n = self.a.batch.len();
        let mut at = format!("base_{role}{}", term(r, l.view.strides[n]));
        if let Some(c) = c {
            at += &term(c, l.view.strides[n + 1]);
        }
        memory::load(l.arg, l.dtype, self.written[l.arg as usize], &at)
    }

    /// Declares the workgroup arrays and the entry's common values: the problem `b` and its
    /// batch indices, the first owned row `r0`, this thread's `row`, `lane` and owned row
    /// `own`, each operand's problem base, the scale and the sentinel `att_neg`.
    fn prologue(&mut self, tiles: usize, staged: &[&Staged], extra: &[(&str, usize)], others: &[(&str, &Load)]) {
        let pitch = self.ch.pitch();
        for s in staged {
            let _ = writeln!(self.decls, "var<workgroup> {}: array<f32, {}>;", s.tile, s.tile_rows() * pitch);
        }
        for (name, words) in extra {
            let _ = writeln!(self.decls, "var<workgroup> {name}: array<f32, {words}>;");
        }
        let _ = writeln!(
            self.decls,
            "// Whether a score-tile entry is masked (holds -inf's bits).\n\
             fn att_skip(x: f32) -> bool {{ return bitcast<u32>(x) == 0xff800000u; }}"
        );
        let o = &mut self.out;
        let _ = writeln!(o, "  let b = wg / {tiles}u;\n  let r0 = (wg % {tiles}u) * {OWN}u;");
        let batch: Vec<usize> = (0..self.a.batch.len()).collect();
        memory::decompose(o, "  ", "b", &self.a.batch, &batch);
        let _ = writeln!(o, "  let row = lid / {LANES}u;\n  let lane = lid % {LANES}u;\n  let own = r0 + row;");
        let roles = staged.iter().map(|s| (s.role, s.load)).chain(others.iter().copied());
        for (role, l) in roles {
            let _ = writeln!(o, "  let base_{role} = {};", problem_base(&l.view, batch.len()));
        }
        let _ = writeln!(
            o,
            "  let scale = {};\n  let att_neg = bitcast<f32>(braid_opaque(0xff800000u));",
            scalar::f32_const(self.a.scale())
        );
    }

    /// Loads columns `c0 ..` (a u32 expression) of the tile's rows into `s.tile`, zeros past
    /// the operand's rows and columns.
    fn load_tile(&mut self, s: &Staged, c0: &str) -> Result<(), String> {
        let (dc, pitch, d) = (self.ch.dc, self.ch.pitch(), self.ch.d);
        let start = if s.owned { "r0" } else { "i0" };
        let value = self.load(s.role, s.load, "gr", Some("gc"))?;
        let _ = writeln!(
            self.out,
            "  for (var e = lid; e < {n}u; e = e + {THREADS}u) {{\n    let tr = e / {dc}u;\n    let tc = e % {dc}u;\n    \
             let gr = {start} + tr;\n    let gc = {c0} + tc;\n    var x = 0.0;\n    \
             if (gr < {rows}u && gc < {d}u) {{ x = {value}; }}\n    {tile}[tr * {pitch}u + tc] = x;\n  }}",
            n = s.tile_rows() * dc,
            rows = s.rows,
            tile = s.tile,
        );
        Ok(())
    }

    /// Declares `{acc}{t}` for each of `pairs` and accumulates over every chunk of columns the
    /// dot products of this thread's owned row of `own_tile` with rows `lane + 16 t` of
    /// `iter_tile`. Owned tiles are loaded per chunk unless `hoisted` (loaded once already).
    fn scores(
        &mut self,
        owned: &[&Staged],
        iter: &[&Staged],
        pairs: &[(&str, &str, &str)],
        hoisted: bool,
    ) -> Result<(), String> {
        let (dc, pitch, d) = (self.ch.dc, self.ch.pitch(), self.ch.d);
        for (_, _, acc) in pairs {
            for t in 0..PER_THREAD {
                let _ = writeln!(self.out, "  var {acc}{t} = 0.0;");
            }
        }
        let one = self.ch.chunks == 1;
        self.out += if one { "  {\n  let c0 = 0u;\n" } else { "" };
        if !one {
            let _ = writeln!(self.out, "  for (var c0 = 0u; c0 < {d}u; c0 = c0 + {dc}u) {{");
        }
        if !hoisted {
            owned.iter().try_for_each(|s| self.load_tile(s, "c0"))?;
        }
        iter.iter().try_for_each(|s| self.load_tile(s, "c0"))?;
        let cn = if one { format!("{d}u") } else { format!("min({dc}u, {d}u - c0)") };
        let _ = writeln!(self.out, "  workgroupBarrier();\n  let oa = row * {pitch}u;");
        for t in 0..PER_THREAD {
            let _ = writeln!(self.out, "  let ia{t} = (lane + {}u) * {pitch}u;", t * LANES);
        }
        let _ = writeln!(self.out, "  for (var c = 0u; c < {cn}; c = c + 1u) {{");
        for (k, (own_tile, iter_tile, acc)) in pairs.iter().enumerate() {
            let _ = writeln!(self.out, "    let x{k} = {own_tile}[oa + c];");
            for t in 0..PER_THREAD {
                let _ = writeln!(self.out, "    {acc}{t} = {acc}{t} + x{k} * {iter_tile}[ia{t} + c];");
            }
        }
        self.out += "  }\n  workgroupBarrier();\n  }\n";
        Ok(())
    }

    /// For every walked-over row `j < ni` whose first weight is not masked: `extra` (in the
    /// first chunk), then `acc[..] += weight * tile[j][columns]` for each `(acc, weight,
    /// tile)` of `terms`, chunk by chunk, (re)loading the `reload` tiles for each chunk. The
    /// weights `(name, array)` are read from the `[16, 32]` score tiles.
    fn accumulate(
        &mut self,
        reload: &[&Staged],
        weights: &[(&str, &str)],
        terms: &[(&str, &str, &str)],
        extra: &str,
    ) -> Result<(), String> {
        let (dc, pitch, padded) = (self.ch.dc, self.ch.pitch(), self.ch.regs * 16);
        let chunks = if terms.is_empty() { 1 } else { self.ch.chunks };
        for k in 0..chunks {
            let c0 = k * dc;
            if !terms.is_empty() && !reload.is_empty() {
                reload.iter().try_for_each(|s| self.load_tile(s, &format!("{c0}u")))?;
                self.out += "  workgroupBarrier();\n";
            }
            let _ = writeln!(self.out, "  for (var j = 0u; j < ni; j = j + 1u) {{");
            for (w, (name, array)) in weights.iter().enumerate() {
                let _ = writeln!(self.out, "    let {name} = {array}[row * {ITER}u + j];");
                if w == 0 {
                    let _ = writeln!(self.out, "    if (att_skip({name})) {{ continue; }}");
                }
            }
            if k == 0 && !extra.is_empty() {
                let _ = writeln!(self.out, "    {extra}");
            }
            if !terms.is_empty() {
                let _ = writeln!(self.out, "    let at = j * {pitch}u + lane;");
            }
            for g in 0..(dc.min(padded - c0) / 16) {
                let r = c0 / 16 + g;
                for (acc, weight, tile) in terms {
                    let _ = writeln!(self.out, "    {acc}[{r}] = {acc}[{r}] + {weight} * {tile}[at + {}u];", g * 16);
                }
            }
            self.out += "  }\n  workgroupBarrier();\n";
        }
        Ok(())
    }

    /// Stores `value(r)` (accumulator `r`: column `lane + 16 r`) of the owned row to the
    /// contiguous `[batch, rows, d]` argument `arg`.
    fn store_row(&mut self, arg: u16, rows: usize, value: impl Fn(usize) -> String) -> Result<(), String> {
        let d = self.ch.d;
        let _ = writeln!(self.out, "  if (own < {rows}u) {{\n    let at = (b * {rows}u + own) * {d}u + lane;");
        for r in 0..self.ch.regs {
            let store = memory::store(arg, self.a.dtype, &format!("at + {}u", r * 16), &value(r))?;
            match (r + 1) * 16 <= d {
                true => writeln!(self.out, "    {store}"),
                false => writeln!(self.out, "    if (lane + {}u < {d}u) {{ {store} }}", r * 16),
            }
            .expect("writing to a String");
        }
        self.out += "  }\n";
        Ok(())
    }

    /// Declares, for each of this thread's scores `t`: its column `j{t}` in the score tile,
    /// its walked-over row `it{t}` (a key when `keys_walked`, else a query), and `masked{t}`
    /// (past the last row, or hidden by the causal mask).
    fn mask(&mut self, keys_walked: bool) {
        let a = self.a;
        for t in 0..PER_THREAD {
            let (bound, causal) = match keys_walked {
                true => (a.sk, format!("it{t} > own")),
                false => (a.sq, format!("own > it{t}")),
            };
            let causal = if a.causal { format!(" || {causal}") } else { String::new() };
            let _ = writeln!(
                self.out,
                "  let j{t} = lane + {}u;\n  let it{t} = i0 + j{t};\n  let masked{t} = it{t} >= {bound}u{causal};",
                t * LANES
            );
        }
    }
}

pub(super) fn print_attention(m: &mut Module<'_>, a: &AttentionKernel) -> Result<(), String> {
    a.check(|i| m.params.get(i as usize).map(|p| (p.dtype, p.len)))?;
    if !matches!(a.dtype, DType::F32 | DType::F16 | DType::BF16) || a.stats_dtype() != DType::F32 {
        return Err(format!("attention of {}: {}", a.dtype, refusal(a.dtype)));
    }
    let outputs: Vec<u16> = match &a.pass {
        AttentionPass::Forward { out, lse } => [out, lse].into_iter().flatten().copied().collect(),
        AttentionPass::GradQ { dq, .. } => vec![*dq],
        AttentionPass::GradKv { dk, dv, .. } => [dk, dv].into_iter().flatten().copied().collect(),
    };
    if let Some(o) = outputs.iter().find(|&&o| !m.params[o as usize].writable) {
        return Err(format!("attention writes argument {o}, an input of the kernel"));
    }
    let limit = m.features.max_storage_buffers_per_stage as usize;
    if m.params.len() > limit {
        return Err(format!(
            "attention binds {} storage buffers (its operands and outputs), over the adapter's \
             max_storage_buffers_per_stage ({limit})",
            m.params.len()
        ));
    }
    let (owned_rows, walked_rows) = match a.pass {
        AttentionPass::GradKv { .. } => (a.sk, a.sq),
        _ => (a.sq, a.sk),
    };
    if a.problems() == 0 || owned_rows == 0 {
        return Ok(());
    }
    let largest = a.problems() * a.d * owned_rows.max(walked_rows);
    if largest as u64 >= 1 << 32 {
        return Err(format!("attention over {largest} elements: wgpu kernels index with u32"));
    }
    let tiles = owned_rows.div_ceil(OWN);
    let limit = m.features.max_workgroup_storage_size;
    let (name, staged_rows, extra) = match a.pass {
        AttentionPass::Forward { .. } => ("attention_forward", OWN + ITER, OWN * ITER + 2 * OWN),
        AttentionPass::GradQ { .. } => ("attention_grad_q", 2 * (OWN + ITER), OWN * ITER),
        AttentionPass::GradKv { .. } => ("attention_grad_kv", 2 * (OWN + ITER), 2 * OWN * ITER),
    };
    let ch = chunking(a.d, staged_rows, extra, limit)?;
    let comment = format!(
        "Attention ({name}, {}causal) over {} problems of {} queries and {} keys, head dimension {}: one workgroup \
         per problem and {OWN} owned rows, {} columns staged at a time.",
        if a.causal { "" } else { "not " },
        a.problems(),
        a.sq,
        a.sk,
        a.d,
        ch.dc
    );
    m.begin_entry(name, (a.problems() * tiles) as u64, THREADS, &comment)?;
    let mut p = Printer { a, written: m.written(), ch, decls: String::new(), out: String::new() };
    match &a.pass {
        AttentionPass::Forward { out, lse } => forward(&mut p, tiles, *out, *lse)?,
        AttentionPass::GradQ { dq, .. } => grad_q(&mut p, tiles, *dq)?,
        AttentionPass::GradKv { dk, dv, .. } => grad_kv(&mut p, tiles, *dk, *dv)?,
    }
    p.out += "}\n";
    if workgroup_bytes(&p.decls) > limit as usize {
        return Err(format!(
            "attention needs {} bytes of workgroup memory, over the adapter's max_compute_workgroup_storage_size ({limit})",
            workgroup_bytes(&p.decls)
        ));
    }
    m.body = format!("{}{}{}", p.decls, m.body, p.out);
    Ok(())
}

fn forward(p: &mut Printer<'_>, tiles: usize, out: Option<u16>, lse: Option<u16>) -> Result<(), String> {
    let a = p.a;
    let q = Staged { tile: "att_q", role: "q", load: &a.q, rows: a.sq, owned: true };
    let k = Staged { tile: "att_kv", role: "k", load: &a.k, rows: a.sk, owned: false };
    let v = Staged { tile: "att_kv", role: "v", load: &a.v, rows: a.sk, owned: false };
    // K and V take turns in one tile (declared here, not as a staged operand's).
    let extra = [("att_kv", ITER * p.ch.pitch()), ("att_s", OWN * ITER), ("att_m", OWN), ("att_alpha", OWN)];
    p.prologue(tiles, &[&q], &extra, &[("k", &a.k), ("v", &a.v)]);
    let regs = p.ch.regs;
    if out.is_some() {
        let _ = writeln!(p.out, "  var acc: array<f32, {regs}>;");
    }
    let _ = writeln!(p.out, "  var l = 0.0;\n  var m_run = att_neg;");
    let hoisted = p.ch.chunks == 1;
    if hoisted {
        p.load_tile(&q, "0u")?;
    }
    let last = if a.causal { format!("min(r0 + {OWN}u, {}u)", a.sk) } else { format!("{}u", a.sk) };
    let _ = writeln!(
        p.out,
        "  let last = {last};\n  for (var i0 = 0u; i0 < last; i0 = i0 + {ITER}u) {{\n  let ni = min({ITER}u, last - i0);"
    );
    p.scores(&[&q], &[&k], &[("att_q", "att_kv", "s")], hoisted)?;
    p.mask(true);
    for t in 0..PER_THREAD {
        let _ = writeln!(
            p.out,
            "  var w{t} = att_neg;\n  if (!masked{t}) {{ w{t} = s{t} * scale; }}\n  att_s[row * {ITER}u + j{t}] = w{t};"
        );
    }
    // One thread per row: the new running maximum (masked entries never count; a NaN score
    // makes the row NaN, through the maximum or its own probability) and the factor that
    // rescales what was summed before (exactly 1 when the maximum stays).
    let _ = writeln!(
        p.out,
        "  workgroupBarrier();\n  if (lid < {OWN}u) {{\n    var mx = m_run;\n    \
         for (var j = 0u; j < {ITER}u; j = j + 1u) {{\n      let x = att_s[lid * {ITER}u + j];\n      \
         if (!att_skip(x) && (att_skip(mx) || x > mx)) {{ mx = x; }}\n    }}\n    var alpha = 1.0;\n    \
         if (!att_skip(m_run) && mx != m_run) {{ alpha = exp(m_run - mx); }}\n    m_run = mx;\n    \
         att_m[lid] = mx;\n    att_alpha[lid] = alpha;\n  }}\n  workgroupBarrier();"
    );
    for t in 0..PER_THREAD {
        let _ = writeln!(
            p.out,
            "  {{\n    let x = att_s[row * {ITER}u + j{t}];\n    \
             if (!att_skip(x)) {{ att_s[row * {ITER}u + j{t}] = exp(x - att_m[row]); }}\n  }}"
        );
    }
    let _ = writeln!(p.out, "  workgroupBarrier();\n  let alpha = att_alpha[row];\n  l = l * alpha;");
    if out.is_some() {
        for r in 0..regs {
            let _ = writeln!(p.out, "  acc[{r}] = acc[{r}] * alpha;");
        }
        p.accumulate(&[&v], &[("pw", "att_s")], &[("acc", "pw", "att_kv")], "l = l + pw;")?;
    } else {
        p.accumulate(&[], &[("pw", "att_s")], &[], "l = l + pw;")?;
    }
    p.out += "  }\n";
    if let Some(arg) = out {
        p.store_row(arg, a.sq, |r| format!("acc[{r}] / l"))?;
    }
    if let Some(arg) = lse {
        let at = format!("b * {}u + own", a.sq);
        let store = memory::store(arg, DType::F32, &at, "att_m[row] + log(l)")?;
        let _ = writeln!(p.out, "  if (own < {}u && lane == 0u) {{ {store} }}", a.sq);
    }
    Ok(())
}

fn grad_q(p: &mut Printer<'_>, tiles: usize, dq: u16) -> Result<(), String> {
    let a = p.a;
    let AttentionPass::GradQ { grads, .. } = &a.pass else { unreachable!("a query gradient pass") };
    let q = Staged { tile: "att_q", role: "q", load: &a.q, rows: a.sq, owned: true };
    let o = Staged { tile: "att_o", role: "o", load: &grads.d_out, rows: a.sq, owned: true };
    let k = Staged { tile: "att_k", role: "k", load: &a.k, rows: a.sk, owned: false };
    let v = Staged { tile: "att_v", role: "v", load: &a.v, rows: a.sk, owned: false };
    let others = [("lse", &grads.lse), ("delta", &grads.delta)];
    p.prologue(tiles, &[&q, &o, &k, &v], &[("att_s", OWN * ITER)], &others);
    let (lse, delta) = (p.load("lse", &grads.lse, "own", None)?, p.load("delta", &grads.delta, "own", None)?);
    let _ = writeln!(
        p.out,
        "  var acc: array<f32, {}>;\n  var lse_i = 0.0;\n  var delta_i = 0.0;\n  \
         if (own < {}u) {{ lse_i = {lse}; delta_i = {delta}; }}",
        p.ch.regs, a.sq
    );
    let hoisted = p.ch.chunks == 1;
    if hoisted {
        p.load_tile(&q, "0u")?;
        p.load_tile(&o, "0u")?;
    }
    let last = if a.causal { format!("min(r0 + {OWN}u, {}u)", a.sk) } else { format!("{}u", a.sk) };
    let _ = writeln!(
        p.out,
        "  let last = {last};\n  for (var i0 = 0u; i0 < last; i0 = i0 + {ITER}u) {{\n  let ni = min({ITER}u, last - i0);"
    );
    p.scores(&[&q, &o], &[&k, &v], &[("att_q", "att_k", "s"), ("att_o", "att_v", "dp")], hoisted)?;
    p.mask(true);
    for t in 0..PER_THREAD {
        let _ = writeln!(
            p.out,
            "  var w{t} = att_neg;\n  let sc{t} = s{t} * scale;\n  \
             if (!masked{t} && !att_skip(sc{t})) {{ w{t} = exp(sc{t} - lse_i) * (dp{t} - delta_i); }}\n  \
             att_s[row * {ITER}u + j{t}] = w{t};"
        );
    }
    p.out += "  workgroupBarrier();\n";
    let reload: Vec<&Staged> = if hoisted { vec![] } else { vec![&k] };
    p.accumulate(&reload, &[("ds", "att_s")], &[("acc", "ds", "att_k")], "")?;
    p.out += "  }\n";
    p.store_row(dq, a.sq, |r| format!("acc[{r}] * scale"))
}

fn grad_kv(p: &mut Printer<'_>, tiles: usize, dk: Option<u16>, dv: Option<u16>) -> Result<(), String> {
    let a = p.a;
    let AttentionPass::GradKv { grads, .. } = &a.pass else { unreachable!("a key/value gradient pass") };
    let k = Staged { tile: "att_k", role: "k", load: &a.k, rows: a.sk, owned: true };
    let v = Staged { tile: "att_v", role: "v", load: &a.v, rows: a.sk, owned: true };
    let q = Staged { tile: "att_q", role: "q", load: &a.q, rows: a.sq, owned: false };
    let o = Staged { tile: "att_o", role: "o", load: &grads.d_out, rows: a.sq, owned: false };
    let others = [("lse", &grads.lse), ("delta", &grads.delta)];
    p.prologue(tiles, &[&k, &v, &q, &o], &[("att_p", OWN * ITER), ("att_s", OWN * ITER)], &others);
    let regs = p.ch.regs;
    for (acc, wanted) in [("dk", dk), ("dv", dv)] {
        if wanted.is_some() {
            let _ = writeln!(p.out, "  var {acc}: array<f32, {regs}>;");
        }
    }
    let hoisted = p.ch.chunks == 1;
    if hoisted {
        p.load_tile(&k, "0u")?;
        p.load_tile(&v, "0u")?;
    }
    // Causal: queries before the tile's first key see none of it.
    let first = if a.causal { format!("(min(r0, {sq}u) / {ITER}u) * {ITER}u", sq = a.sq) } else { "0u".into() };
    let _ = writeln!(
        p.out,
        "  for (var i0 = {first}; i0 < {sq}u; i0 = i0 + {ITER}u) {{\n  let ni = min({ITER}u, {sq}u - i0);",
        sq = a.sq
    );
    p.scores(&[&k, &v], &[&q, &o], &[("att_k", "att_q", "s"), ("att_v", "att_o", "dp")], hoisted)?;
    p.mask(false);
    for t in 0..PER_THREAD {
        let it = format!("it{t}");
        let (lse, delta) = (p.load("lse", &grads.lse, &it, None)?, p.load("delta", &grads.delta, &it, None)?);
        let _ = writeln!(
            p.out,
            "  var pw{t} = att_neg;\n  var dw{t} = att_neg;\n  let sc{t} = s{t} * scale;\n  \
             if (!masked{t} && !att_skip(sc{t})) {{\n    pw{t} = exp(sc{t} - {lse});\n    \
             dw{t} = pw{t} * (dp{t} - {delta});\n  }}\n  \
             att_p[row * {ITER}u + j{t}] = pw{t};\n  att_s[row * {ITER}u + j{t}] = dw{t};"
        );
    }
    p.out += "  workgroupBarrier();\n";
    let reload: Vec<&Staged> = if hoisted { vec![] } else { vec![&q, &o] };
    let mut terms = vec![];
    if dv.is_some() {
        terms.push(("dv", "pw", "att_o"));
    }
    if dk.is_some() {
        terms.push(("dk", "ds", "att_q"));
    }
    p.accumulate(&reload, &[("pw", "att_p"), ("ds", "att_s")], &terms, "")?;
    p.out += "  }\n";
    if let Some(arg) = dk {
        p.store_row(arg, a.sk, |r| format!("dk[{r}] * scale"))?;
    }
    if let Some(arg) = dv {
        p.store_row(arg, a.sk, |r| format!("dv[{r}]"))?;
    }
    Ok(())
}
