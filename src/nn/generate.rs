//! Building blocks of autoregressive generation: a static key/value cache written at each
//! sequence's own position, attention of one new position over that cache, and sampling of the
//! next token on the device (greedy, temperature, top-k), so that a decode step's shapes never
//! change and it can be captured once as a [`crate::Step`] and replayed for every token, with
//! only the token ids coming back to the host.
//!
//! Positions are tensors (`[batch]`, I32 or I64: wgpu has no 64-bit integers), one per
//! sequence: prompts of different lengths are padded on the right, each sequence's cache is
//! written at its own position and its attention reads only the positions up to it (what lies
//! beyond, padding or stale values, is masked).
//!
//! Everything here records ordinary ops (no kernel of its own). [`cache_update`] writes the new
//! rows into the cache in place (a scatter: one row a sequence and head, never a copy of the
//! cache, also inside a [`crate::Step`], whose argument the cache is); [`cache_write`] is its
//! functional twin (a select of the new row at the position, which fusion joins to the kernel
//! that reads the cache next, but which stores the whole cache again). Attention is a row kernel
//! (the scores), a softmax with the length mask and a column kernel (the weighted values);
//! sampling is a few row kernels. Nothing here reads a value.
//!
//! ```
//! use braid::prelude::*;
//! use braid::nn::generate::{cache_update, cached_attention, sample, CachePositions, Sampling};
//!
//! let cpu = Device::cpu();
//! cpu.seed(1);
//! let (b, h, t, d) = (2, 2, 8, 4);
//! let keys = Tensor::zeros([b, h, t, d], DType::F32, &cpu);
//! let values = Tensor::zeros([b, h, t, d], DType::F32, &cpu);
//! // Sequence 0 is at position 3, sequence 1 at position 5.
//! let pos = CachePositions::new(&Tensor::from_vec(vec![3i32, 5], [b], &cpu), t);
//! let (k, v) = (Tensor::randn([b, h, 1, d], DType::F32, &cpu), Tensor::randn([b, h, 1, d], DType::F32, &cpu));
//! // Written in place: one row a sequence and head.
//! cache_update(&keys, &k, &pos);
//! cache_update(&values, &v, &pos);
//! let q = Tensor::randn([b, h, 1, d], DType::F32, &cpu);
//! let y = cached_attention(&q, &keys, &values, &pos);
//! assert_eq!(y.dims(), &[b, h, 1, d]);
//! let logits = Tensor::from_vec(vec![0.0f32, 3.0, 1.0, 5.0, 4.0, 2.0], [2, 3], &cpu);
//! let next = sample(&logits, Sampling::Greedy, None);
//! assert_eq!(next.to_vec::<i32>().unwrap(), vec![1, 0]);
//! ```

use crate::tensor::Tensor;
use braid_graph::DType;

/// The position axis of a cache `[batch, heads, positions, head width]`.
const POSITIONS: usize = 2;

/// Halvings of the interval that holds a row's k-th largest logit (see [`Sampling::TopK`]).
const TOP_K_HALVINGS: usize = 40;

/// Where each sequence is in a cache of `positions` positions: what a decode step's cache
/// writes and attention share, recorded once a step (not once a layer).
#[derive(Clone, Debug)]
pub struct CachePositions {
    /// `[batch, 1, 1, 1]`: each sequence's position (the index of its cache updates).
    pos: Tensor,
    /// `[1, 1, positions, 1]`: the positions, in the positions' dtype.
    positions: Tensor,
    /// `[batch, 1, positions]`: the positions after each sequence's, which it must not attend to.
    later: Tensor,
}

impl CachePositions {
    /// For `pos` (`[batch]`, I64 or I32: each sequence's position) in caches of `positions`.
    #[track_caller]
    pub fn new(pos: &Tensor, positions: usize) -> CachePositions {
        if pos.rank() != 1 || !matches!(pos.dtype(), DType::I64 | DType::I32) {
            crate::tensor::misuse(
                "CachePositions::new",
                "the positions must be [batch], I64 or I32",
                &[("pos", pos.describe())],
            );
        }
        let b = pos.dims()[0];
        // Compared in the positions' own dtype (I32 for devices without 64-bit integers).
        let at = Tensor::arange_as(0, positions as i64, pos.dtype(), pos.device()).reshape([1, 1, positions, 1]);
        let pos = pos.reshape([b, 1, 1, 1]);
        CachePositions { later: at.gt(&pos).reshape([b, 1, positions]), positions: at, pos }
    }

    /// Sequences and positions, `(batch, positions)`.
    fn dims(&self) -> (usize, usize) {
        (self.pos.dims()[0], self.positions.dims()[POSITIONS])
    }
}

/// Checks a cache against the positions.
#[track_caller]
fn check_cache(what: &str, cache: &Tensor, at: &CachePositions) {
    let (b, t) = at.dims();
    if cache.rank() != 4 || cache.dims()[0] != b || cache.dims()[POSITIONS] != t {
        crate::tensor::misuse(
            what,
            &format!(
                "the cache must be [batch, heads, positions, head width] of the positions' {b} sequences and {t} positions"
            ),
            &[("cache", cache.describe())],
        );
    }
}

/// Writes `new [batch, heads, 1, d]` into the cache `[batch, heads, positions, d]` at each
/// sequence's position (`at`), in place: a new version of `cache` (see
/// [`Tensor::scatter_assign`]); a position outside the cache writes nothing. Where nothing else
/// reads the cache's old value (a cache a generation loop owns, or a [`crate::Step`]'s
/// argument), only the new rows are stored, into the cache's own buffer.
#[track_caller]
pub fn cache_update(cache: &Tensor, new: &Tensor, at: &CachePositions) {
    check_new_row("cache_update", cache, new, at);
    let d = cache.dims();
    let index = at.pos.expand([d[0], d[1], 1, d[3]]);
    cache.scatter_assign(POSITIONS, &index, &new.as_dtype(cache.dtype()));
}

/// The cache `[batch, heads, positions, d]` with `new [batch, heads, 1, d]` written at each
/// sequence's position (`at`), as a new tensor (the cache is not changed); a position outside
/// the cache writes nothing. A map over the cache (a select), which fusion joins to the kernel
/// that reads the cache next (the attention's scores): no kernel of its own, but the whole
/// cache is stored again. [`cache_update`] writes only the new rows.
#[track_caller]
pub fn cache_write(cache: &Tensor, new: &Tensor, at: &CachePositions) -> Tensor {
    check_new_row("cache_write", cache, new, at);
    // `[batch, 1, positions, 1]`: the position each sequence writes (joined to the select).
    let write = at.positions.eq(&at.pos);
    write.select(&new.as_dtype(cache.dtype()), cache)
}

/// Checks a cache and a new row against the positions.
#[track_caller]
fn check_new_row(what: &str, cache: &Tensor, new: &Tensor, at: &CachePositions) {
    check_cache(what, cache, at);
    let d = cache.dims();
    if new.dims() != [d[0], d[1], 1, d[3]] {
        crate::tensor::misuse(
            what,
            "the new row must be [batch, heads, 1, head width] of the cache",
            &[("cache", cache.describe()), ("new", new.describe())],
        );
    }
}

/// Attention of one query a sequence, `q [batch, heads, 1, d]`, over the cache's positions up
/// to each sequence's own (`at`; `keys` and `values` `[batch, heads, positions, d]`, the new
/// position already written): `softmax(q k^T / sqrt(d)) v` with later positions masked.
/// Returns `[batch, heads, 1, d]` in q's dtype.
#[track_caller]
pub fn cached_attention(q: &Tensor, keys: &Tensor, values: &Tensor, at: &CachePositions) -> Tensor {
    check_cache("cached_attention", keys, at);
    let d = keys.dims();
    if values.dims() != d || q.dims() != [d[0], d[1], 1, d[3]] {
        crate::tensor::misuse(
            "cached_attention",
            "q must be [batch, heads, 1, d] and the values the keys' shape",
            &[("q", q.describe()), ("keys", keys.describe()), ("values", values.describe())],
        );
    }
    // As reductions, not products: one query row against the cache is a matrix-vector
    // product, bound by reading the keys and values once; a row kernel reads each position's
    // key (its dot product with q), a column kernel the values (their sum weighted by the
    // probabilities). In f32 from the stored precision, like a product's accumulation.
    let f32 = |x: &Tensor| x.as_dtype(DType::F32);
    let scores = (&f32(q) * &f32(keys)).sum_dim(3, false) * (1.0 / (d[3] as f64).sqrt());
    let p = scores.masked_fill(&at.later, f64::NEG_INFINITY).softmax(2).unsqueeze(3);
    (&p * &f32(values)).sum_dim(2, true).as_dtype(q.dtype())
}

/// How [`sample`] picks the next token from a row of logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sampling {
    /// The largest logit (the first of equal ones).
    Greedy,
    /// A draw from `softmax(logits / temperature)`.
    Temperature(f64),
    /// A draw from `softmax(logits / temperature)` over the `k` largest logits of the row (and
    /// any below the k-th by less than `(2 range + 1) / 2^40`, the row's range of scaled
    /// logits: ties at the precision of the search that finds it). The logits must be finite
    /// (a masked vocabulary's `-inf` would make the search's interval infinite); the search
    /// costs 40 small row reductions.
    TopK { k: usize, temperature: f64 },
}

/// The next token of each row of `logits [batch, vocabulary]`: `[batch]` I32 ids, computed on
/// the device. A draw (temperature, top-k) takes `uniform`, numbers in `[0, 1)` of the logits'
/// shape (F32; `Tensor::rand` outside a captured step, passed to it as an argument), and picks
/// the largest `logit / temperature - ln(-ln(u))` (the Gumbel-max trick: a draw from the
/// softmax without normalising it).
///
/// Misuse (at the caller's line): logits that are not `[batch, vocabulary]`, a draw without
/// `uniform` or with a shape other than the logits', a temperature that is not positive, `k`
/// of 0 or above the vocabulary.
#[track_caller]
pub fn sample(logits: &Tensor, how: Sampling, uniform: Option<&Tensor>) -> Tensor {
    let describe = || vec![("logits", logits.describe())];
    if logits.rank() != 2 || !logits.dtype().is_float() {
        crate::tensor::misuse("sample", "the logits must be [batch, vocabulary], floating point", &describe());
    }
    let logits = logits.as_dtype(DType::F32);
    let (temperature, k) = match how {
        Sampling::Greedy => return logits.argmax_dim_as(1, false, DType::I32),
        Sampling::Temperature(t) => (t, None),
        Sampling::TopK { k, temperature } => (temperature, Some(k)),
    };
    if !(temperature > 0.0 && temperature.is_finite()) {
        crate::tensor::misuse("sample", &format!("a temperature of {temperature} (it must be positive)"), &describe());
    }
    let Some(u) = uniform.filter(|u| u.dims() == logits.dims() && u.dtype() == DType::F32) else {
        let problem = "a draw needs uniform numbers in [0, 1), F32, of the logits' shape";
        let mut operands = describe();
        operands.extend(uniform.map(|u| ("uniform", u.describe())));
        crate::tensor::misuse("sample", problem, &operands);
    };
    let mut scaled = &logits * (1.0 / temperature);
    if let Some(k) = k {
        if k == 0 || k > logits.dims()[1] {
            crate::tensor::misuse("sample", &format!("top-k with k = {k}"), &describe());
        }
        let kth = kth_largest(&scaled, k);
        scaled = scaled.masked_fill(&scaled.lt(&kth), f64::NEG_INFINITY);
    }
    let gumbel = u.log().neg().log().neg();
    (&scaled + &gumbel).argmax_dim_as(1, false, DType::I32)
}

/// Each row's k-th largest value of `x [batch, n]` (F32), as `[batch, 1]`: found by halving an
/// interval `[lo, hi]` whose `lo` has at least `k` values at or above it (a row's minimum to
/// start) and whose `hi` has fewer (above the maximum, unless the maximum itself has `k`).
/// The interval starts `2 range + 1` wide; after [`TOP_K_HALVINGS`] halvings, `lo` is the k-th
/// largest or below it by less than that width over 2^40, and the values kept at or above it
/// are the top k and such near-ties.
fn kth_largest(x: &Tensor, k: usize) -> Tensor {
    let count_at_least = |t: &Tensor| x.ge(t).to_dtype(DType::F32).sum_dim(1, true);
    let k_f = Tensor::full((), k as f64, DType::F32, x.device());
    let mut lo = x.min_dim(1, true);
    let max = x.max_dim(1, true);
    // Where the maximum itself is held by k values, it is the answer and the search is empty.
    let max_enough = count_at_least(&max).ge(&k_f);
    let mut hi = &max + &(&(&max - &lo).abs() + 1.0);
    for _ in 0..TOP_K_HALVINGS {
        let mid = &lo + &((&hi - &lo) * 0.5);
        let enough = count_at_least(&mid).ge(&k_f);
        lo = enough.select(&mid, &lo);
        hi = enough.select(&hi, &mid);
    }
    max_enough.select(&max, &lo)
}
