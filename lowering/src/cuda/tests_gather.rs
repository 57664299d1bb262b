//! Printer tests of gathers and scatter-adds (split from `tests.rs`, whose helpers they use).

use super::tests::{args, contiguous, in_order, load, view};
use super::*;
use crate::kernel::{GatherKernel, ScatterKernel};

/// A gather over `src`'s dims from argument 0 (`(dtype, length, view)`), `along` and `extent`
/// the gathered dimension's, by index argument 1 (the same), into argument 2.
fn gather(src: (DType, usize, View), along: isize, extent: usize, index: (DType, usize, View)) -> Kernel {
    let (dims, numel) = (src.2.dims.clone(), src.2.dims.iter().product());
    let a = args(&[(src.0, src.1), (index.0, index.1), (src.0, numel)]);
    let (src, index) = (load(0, src.0, src.2), load(1, index.0, index.2));
    let g = GatherKernel { dims, src, along, extent, index, out: 2 };
    Kernel { args: a, inputs: 2, body: Body::Gather(g) }
}

#[test]
fn a_gather_moves_bits_and_reads_the_source_only_in_range() {
    // An embedding: a [5, 3] f16 table, ids [2] expanded over the features (stride 0, no `d1`);
    // an f16 moves as its 16 bits, never through a float (a NaN keeps its payload).
    let k = gather((DType::F16, 15, view(&[2, 3], &[0, 1], 0)), 3, 5, (DType::I64, 2, view(&[2, 3], &[1, 0], 0)));
    let p = print(&k, "embed").unwrap();
    assert_eq!(p.entries, vec![Entry { name: "embed_gather".into(), launch: Launch::Map { numel: 6, block: 256 } }]);
    in_order(
        &p.source,
        &[
            "void embed_gather(const __half* a0, const long long* a1, __half* a2) {",
            "const long long d1 = (long long)((unsigned int)i % 3u);",
            "const long long j = a1[d0];",
            "unsigned short v = 0;",
            "if (j >= 0 && j < 5LL) v = ((const unsigned short*)a0)[d1 + j * 3LL];",
            "((unsigned short*)a2)[i] = v;",
        ],
    );
    assert!(!p.source.contains("__half2float"), "no conversion of the elements");
    // Every dtype moves as the unsigned type of its size; offsets and a negative `along` (a
    // reversed gathered dimension) fold into the positions.
    for d in DType::ALL {
        let t = match d.size() {
            1 => "char",
            2 => "short",
            4 => "int",
            _ => "long long",
        };
        let k = gather((d, 9, view(&[2], &[1], 7)), -3, 3, (DType::I64, 4, view(&[2], &[2], 1)));
        let (p, t) = (print(&k, "g").unwrap(), format!("unsigned {t}"));
        let read = format!("if (j >= 0 && j < 3LL) v = ((const {t}*)a0)[7 + d0 + j * -3LL];");
        in_order(&p.source, &["const long long j = a1[1 + d0 * 2];", &format!("{t} v = 0;"), &read]);
    }
}

#[test]
fn a_gather_is_checked_before_it_prints() {
    let k = |d, src_len, index_len| {
        gather((DType::F32, src_len, view(&[2, 3], &[0, 1], 0)), 3, 5, (d, index_len, view(&[2, 3], &[1, 0], 0)))
    };
    print(&k(DType::I64, 15, 2), "g").unwrap();
    // An i32 index is read through its own type and widened.
    let narrow = print(&k(DType::I32, 15, 2), "g").unwrap().source;
    in_order(&narrow, &["const int* a1", "const long long j = a1["]);
    for d in [DType::U8, DType::F64] {
        assert!(print(&k(d, 15, 2), "g").unwrap_err().contains("not i64 or i32"), "a {d} index");
    }
    // The source at the last gathered position (4 * 3 + 2) and the index must lie in their
    // arguments.
    assert!(print(&k(DType::I64, 14, 2), "g").unwrap_err().contains("reaches elements 0..=14"));
    assert!(print(&k(DType::I64, 15, 1), "g").unwrap_err().contains("reaches elements 0..=1"));
}

/// A scatter-add of [2, 3] source elements of dtype `d` (argument 0) along dimension 1 into a
/// [2, 4] output, by index argument 1 of dtype `index`, onto a base (argument 2, broadcast over
/// the rows) if `base`; the output last.
fn scatter(d: DType, index: DType, base: bool) -> (Kernel, ScatterKernel) {
    let mut a = vec![(d, 6), (index, 6)];
    if base {
        a.push((d, 4));
    }
    a.push((d, 8));
    let s = ScatterKernel {
        dims: [2, 3].as_slice().into(),
        dim: 1,
        src: load(0, d, contiguous(&[2, 3])),
        index: load(1, index, view(&[2, 3], &[3, 1], 0)),
        base: base.then(|| load(2, d, view(&[2, 4], &[0, 1], 0))),
        out_dims: [2, 4].as_slice().into(),
        out: a.len() as u16 - 1,
    };
    (Kernel { args: args(&a), inputs: a.len() - 1, body: Body::Scatter(s.clone()) }, s)
}

#[test]
fn a_scatter_adds_rows_in_order_after_zeroing_and_before_the_base() {
    let map = |name: &str, numel| Entry { name: name.into(), launch: Launch::Map { numel, block: MAP_BLOCK } };
    let (k, _) = scatter(DType::F32, DType::I64, true);
    let p = print(&k, "sa").unwrap();
    let (zero, rows, base) = (map("sa_scatter_zero", 8), map("sa_scatter_scatter", 8), map("sa_scatter_base", 8));
    assert_eq!(p.entries, vec![zero.clone(), rows.clone(), base]);
    // Four threads per row (the output's extent along the dimension), each folding in order the
    // elements whose index is its own modulo 4, a batch at a time (here the row's 3), the next
    // batch's indices and values loaded ahead; an index outside the output's extent adds nothing.
    in_order(
        &p.source,
        &[
            "void sa_scatter_zero(const float* a0, const long long* a1, const float* a2, float* a3) {",
            "a3[i] = 0;",
            "void sa_scatter_scatter(",
            "t < 8LL;",
            "const long long r = t % 2LL;",
            "const long long part = t / 2LL;",
            "const long long src_at = d0 * 3;",
            "const long long out_at = d0 * 4;",
            "next_j[b] = n < 3LL ? a1[index_at + n * 1LL] : -1;",
            "next_v[b] = n < 3LL && (next_j[b] & 3LL) == part ? a0[src_at + n * 1LL] : (float)0;",
            "for (long long n0 = 0; n0 < 3LL; n0 += 3) {",
            "const long long n = n0 + 3 + b;",
            "if (j[b] >= 0 && j[b] < 4LL && (j[b] & 3LL) == part) a3[out_at + j[b] * 1LL] = a3[out_at + j[b] * 1LL] + v[b];",
            "void sa_scatter_base(",
            "a3[i] = a2[d1] + a3[i];",
        ],
    );
    // A base of zeros: no third entry.
    let p = print(&scatter(DType::F32, DType::I64, false).0, "sa").unwrap();
    assert_eq!(p.entries, vec![zero, rows]);
    assert!(!p.source.contains("sa_scatter_base"), "{}", p.source);
    in_order(
        &p.source,
        &[
            "void sa_scatter_scatter(const float* a0, const long long* a1, float* a2) {",
            "if (j[b] >= 0 && j[b] < 4LL && (j[b] & 3LL) == part) a2[out_at + j[b] * 1LL] = a2[out_at + j[b] * 1LL] + v[b];",
        ],
    );
    // Integers wrap: they add as unsigned types (no signed overflow).
    let p = print(&scatter(DType::I32, DType::I64, true).0, "sa").unwrap();
    in_order(
        &p.source,
        &[
            "a3[out_at + j[b] * 1LL] = (int)((unsigned int)(a3[out_at + j[b] * 1LL]) + (unsigned int)(v[b]));",
            "a3[i] = (int)((unsigned int)(a2[d1]) + (unsigned int)(a3[i]));",
        ],
    );
    // Halves (added in f32 by the graph) and an index of another dtype are refused.
    let kernel_args = |k: &Kernel| k.args.iter().map(|a| (a.dtype, a.len)).collect::<Vec<_>>();
    for (d, index, error) in
        [(DType::F16, DType::I64, "a scatter-add of f16"), (DType::F32, DType::U8, "not i64 or i32")]
    {
        let (k, s) = scatter(d, index, true);
        let a = kernel_args(&k);
        let e = s.check(|i| a.get(i as usize).copied()).unwrap_err();
        assert!(e.contains(error), "{e}");
        assert!(print(&k, "sa").unwrap_err().contains(error));
    }
}
