//! Matrix product cases of the CUDA printer tests (part of [`super`], split off for length):
//! random products over every operand layout cuBLAS reads in place or the printer copies first,
//! with their epilogues.

use super::*;

/// The shape of a random matrix product for [`matmul_case_over`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct MatmulSpec {
    pub(crate) dtype: DType,
    pub(crate) batches: usize,
    pub(crate) m: usize,
    pub(crate) k: usize,
    pub(crate) n: usize,
    /// The product in scratch memory the target provides (needs an epilogue) rather than in an
    /// output argument.
    pub(crate) scratch: bool,
    /// `max(product + bias, 0)` after the product, stored as another output.
    pub(crate) epilogue: bool,
}

/// A small random matrix product (a float one takes its product from the CPU: the printer only
/// prints its epilogue; an integer one prints its product too).
pub(crate) fn matmul_case(rng: &mut Rng, n: usize) -> Case {
    let dtype = *rng.pick(&[DType::F32, DType::F32, DType::I32, DType::I64, DType::U8]);
    let (m, k, nn) = (1 + rng.below(4), 1 + rng.below(4), 1 + rng.below(4));
    let spec = MatmulSpec { dtype, batches: 1 + rng.below(3), m, k, n: nn, scratch: false, epilogue: true };
    let mut c = matmul_case_over(rng, n, spec);
    if dtype.is_float() {
        c.from_cpu = vec![3];
    }
    c
}

/// One operand (`rows x cols` per batch, argument `arg` of dtype `d`) in a random layout:
/// row-major or column-major, padded or not, neither dimension of unit stride, rows reversed
/// (a negative stride) or broadcast (stride 0); batches one after another, all the same
/// matrix (batch stride 0), or in a shuffled order (offsets no progression describes).
fn operand(rng: &mut Rng, arg: u16, rows: usize, cols: usize, batches: usize, d: DType, c: &mut Case) -> MatmulOperand {
    let pad = 1 + rng.below(3);
    let (rs, cs): (isize, isize) = match rng.below(7) {
        0 | 1 => (cols as isize, 1),
        2 => (1, rows as isize),
        3 => ((cols + pad) as isize, 1),
        4 => (1, (rows + pad) as isize),
        5 => ((2 * cols) as isize, 2),
        6 if rng.chance(0.5) => (-(cols as isize), 1),
        _ => (0, 1),
    };
    // Where element (0, 0) sits in a matrix's footprint, and the footprint's size.
    let base = if rs < 0 { rows.saturating_sub(1) * rs.unsigned_abs() } else { 0 };
    let footprint = rows.saturating_sub(1) * rs.unsigned_abs() + cols.saturating_sub(1) * cs.unsigned_abs() + 1;
    let pre = rng.below(3);
    let mut slots: Vec<usize> = (0..batches).collect();
    match rng.below(4) {
        0 => slots.iter_mut().for_each(|s| *s = 0),
        1 => {
            for i in (1..batches).rev() {
                slots.swap(i, rng.below(i + 1));
            }
        }
        _ => {}
    }
    let batch_offsets = slots.iter().map(|s| pre + s * footprint + base).collect();
    let len = pre + batches * footprint + rng.below(2);
    c.kernel.args.push(Arg { dtype: d, len });
    c.init.push(encode(d, &random_values_with(rng, d, len, false, false)));
    MatmulOperand { arg, batch_offsets, rs, cs }
}

/// A batched matrix product of shape `s` with random operand layouts (see [`operand`]), the
/// product in an output argument or scratch memory, and optionally the epilogue
/// `max(product + bias, 0)`. Arguments: `0` lhs, `1` rhs, `2` bias, then the product (unless
/// in scratch) and the epilogue's output.
pub(crate) fn matmul_case_over(rng: &mut Rng, n: usize, s: MatmulSpec) -> Case {
    let d = s.dtype;
    let label = format!("matmul {n} ({d}, {} x [{}, {}] x [{}, {}], {s:?})", s.batches, s.m, s.k, s.k, s.n);
    let inputs = if s.epilogue { 3 } else { 2 };
    let mut c = new_case(label, inputs, Body::Map(vec![]));
    let lhs = operand(rng, 0, s.m, s.k, s.batches, d, &mut c);
    let rhs = operand(rng, 1, s.k, s.n, s.batches, d, &mut c);
    let total = s.batches * s.m * s.n;
    if s.epilogue {
        c.kernel.args.push(Arg { dtype: d, len: s.n });
        c.init.push(encode(d, &random_values_with(rng, d, s.n, false, false)));
    }
    let product = if s.scratch {
        assert!(s.epilogue, "a product in scratch memory is read by an epilogue");
        // One past the last argument, once the epilogue's output is added below.
        inputs as u16 + 1
    } else {
        c.kernel.args.push(Arg { dtype: d, len: total });
        c.init.push(encode(d, &random_values(rng, d, total, false)));
        inputs as u16
    };
    let epilogue = s.epilogue.then(|| {
        let mut b = ExprBuilder::new();
        let (p, bias) = (b.load(0, d), b.load(1, d));
        let sum = b.add(p, bias);
        let zero = if d.is_float() { b.constant(0.0, d.compute()) } else { b.int_constant(0, d) };
        let y = b.max(sum, zero);
        let dims = [s.batches * s.m, s.n];
        let view =
            |strides: [isize; 2]| View { dims: dims.as_slice().into(), strides: strides.as_slice().into(), offset: 0 };
        let loads = vec![
            Load { arg: product, dtype: d, view: view([s.n as isize, 1]) },
            Load { arg: 2, dtype: d, view: view([0, 1]) },
        ];
        let arg = c.kernel.args.len();
        let store = output(rng, b.dtype(y), view([s.n as isize, 1]), total, y, arg, &mut c);
        MapLoop { dims: dims.as_slice().into(), loads, expr: b.finish(), stores: vec![store] }
    });
    c.kernel.body = Body::Matmul(MatmulKernel { dtype: d, lhs, rhs, product, m: s.m, n: s.n, k: s.k, epilogue });
    c
}
