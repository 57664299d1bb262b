//! The WGSL functions printed kernels call where plain WGSL differs from braid: 64-bit integer
//! arithmetic on `vec2<u32>` (low, high) pairs, exact conversions between f32, f16, bf16 and
//! the integers, NaN-aware float operations, division with braid's rules, and the
//! counter-based random numbers of `braid_graph::rng` (SplitMix64's finaliser, ported to
//! 32-bit words). [`used`] appends only the helpers a source calls, with what they call.
//!
//! These are definitions, nothing else: no bindings, no entry points.

/// (name, source) of every helper; a helper may call helpers listed before it.
const HELPERS: &[(&str, &str)] = &[
    (
        "braid_launder",
        "// An f32 passed through an integer operation with a zero the compiler cannot see
// (`braid_zero`, set at the start of each entry): the compiler cannot relate it to the
// expression that produced it.
var<private> braid_zero: u32;
fn braid_launder(x: f32) -> f32 { return bitcast<f32>(bitcast<u32>(x) ^ braid_zero); }",
    ),
    (
        "braid_opaque",
        "// The identity, as a call: naga never constant-folds through it.
fn braid_opaque(x: u32) -> u32 { return x; }",
    ),
    ("braid_isnan", "fn braid_isnan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }"),
    (
        "braid_fmax",
        "// NaN-propagating maximum and minimum (NumPy's), whichever operand is NaN.
fn braid_fmax(a: f32, b: f32) -> f32 { return select(b, a, braid_isnan(a) || (!braid_isnan(b) && a > b)); }",
    ),
    (
        "braid_fmin",
        "fn braid_fmin(a: f32, b: f32) -> f32 { return select(b, a, braid_isnan(a) || (!braid_isnan(b) && a < b)); }",
    ),
    (
        "braid_tanh",
        "// tanh saturates to +-1 from |x| = 10 on (where it rounds to 1 in f32): some tanh
// implementations compute exp(2x) and give NaN for large x.
fn braid_tanh(x: f32) -> f32 {
  if (abs(x) >= 10.0) { return bitcast<f32>((bitcast<u32>(x) & 0x80000000u) | 0x3f800000u); }
  // Near 0 a platform's tanh may lose all precision to (e^2x - 1) / (e^2x + 1) (lavapipe's
  // does): its Taylor series there, whose next term is below 2^-40 of the result.
  if (abs(x) < 0.0625) {
    let x2 = x * x;
    return x + x * x2 * (-0.33333333 + x2 * (0.13333333 + x2 * -0.053968254));
  }
  return tanh(x);
}",
    ),
    (
        "braid_pow",
        "// C's powf special cases (negative bases with integer exponents, pow(x, 0) = 1,
// pow(1, y) = 1) around WGSL's pow, which is only defined for positive bases.
fn braid_pow(x: f32, y: f32) -> f32 {
  if (y == 0.0 || x == 1.0) { return 1.0; }
  if (braid_isnan(x) || braid_isnan(y)) { return x + y; }
  // Exact, as C's are (WGSL's pow is exp2(y log2 x), a few ulps off and infinite near MAX).
  if (y == 1.0) { return x; }
  if (y == 2.0) { return x * x; }
  let ay = abs(y);
  let ax = abs(x);
  let integer = ay >= 16777216.0 || (ay < 16777216.0 && trunc(y) == y);
  let odd = ay < 16777216.0 && integer && (u32(ay) & 1u) == 1u;
  let negative = (bitcast<u32>(x) >> 31u) == 1u;
  // A finite negative base to a finite non-integer power; -inf to one is +inf or +0.
  let inf = bitcast<f32>(0x7f800000u);
  if (negative && x != 0.0 && ax != inf && !integer && ay != inf) { return bitcast<f32>(0x7fc00000u); }
  var r: f32;
  if (ax == 0.0) {
    r = select(0.0, inf, y < 0.0);
  } else if (ax == inf) {
    r = select(inf, 0.0, y < 0.0);
  } else if (ay == inf) {
    r = select(select(0.0, inf, (ax > 1.0) == (y > 0.0)), 1.0, ax == 1.0);
  } else {
    r = pow(ax, y);
  }
  return select(r, -r, negative && odd);
}",
    ),
    (
        "braid_div_i32",
        "// Truncating, wrapping (MIN / -1 == MIN), and x / 0 == 0.
fn braid_div_i32(a: i32, b: i32) -> i32 {
  if (b == 0i) { return 0i; }
  if (b == -1i) { return bitcast<i32>(0u - bitcast<u32>(a)); }
  return a / b;
}",
    ),
    ("braid_div_u32", "fn braid_div_u32(a: u32, b: u32) -> u32 { return select(a / max(b, 1u), 0u, b == 0u); }"),
    (
        "braid_f2i32",
        "// Float to integer: truncate towards zero, saturate, NaN gives 0.
fn braid_f2i32(x: f32) -> i32 {
  if (braid_isnan(x)) { return 0i; }
  if (x <= -2147483648.0) { return bitcast<i32>(0x80000000u); }
  if (x >= 2147483648.0) { return 2147483647i; }
  return i32(x);
}",
    ),
    (
        "braid_f2u8",
        "fn braid_f2u8(x: f32) -> u32 {
  if (braid_isnan(x) || x <= 0.0) { return 0u; }
  if (x >= 255.0) { return 255u; }
  return u32(x);
}",
    ),
    (
        "braid_f16_to_f32",
        "// f16 bits (the low 16) to f32, exactly.
fn braid_f16_to_f32(h: u32) -> f32 {
  let s = (h & 0x8000u) << 16u;
  let e = (h >> 10u) & 0x1fu;
  let m = h & 0x3ffu;
  if (e == 0x1fu) { return bitcast<f32>(s | 0x7f800000u | (m << 13u)); }
  if (e != 0u) { return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u)); }
  // Zero or subnormal: m * 2^-24, exact in f32.
  return bitcast<f32>(s | bitcast<u32>(f32(m) * bitcast<f32>(0x33800000u)));
}",
    ),
    (
        "braid_f32_to_f16",
        "// f32 to f16 bits, rounded to nearest, ties to even (half's f16::from_f32).
fn braid_f32_to_f16(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  let s = (b >> 16u) & 0x8000u;
  let a = b & 0x7fffffffu;
  if (a > 0x7f800000u) { return s | 0x7e00u | ((a >> 13u) & 0x3ffu); }
  if (a >= 0x477ff000u) { return s | 0x7c00u; }
  if (a >= 0x38800000u) {
    let r = a - 0x38000000u;
    return s | ((r + 0xfffu + ((r >> 13u) & 1u)) >> 13u);
  }
  let e = a >> 23u;
  if (e < 102u) { return s; }
  // |x| = mant * 2^(e - 150); the f16 subnormal step is 2^-24.
  let mant = (a & 0x7fffffu) | 0x800000u;
  let shift = 126u - e;
  let q = mant >> shift;
  let rem = mant & ((1u << shift) - 1u);
  let half = 1u << (shift - 1u);
  let up = rem > half || (rem == half && (q & 1u) == 1u);
  return s | (q + select(0u, 1u, up));
}",
    ),
    ("braid_bf16_to_f32", "fn braid_bf16_to_f32(h: u32) -> f32 { return bitcast<f32>(h << 16u); }"),
    (
        "braid_f32_to_bf16",
        "// f32 to bf16 bits, rounded to nearest, ties to even; NaN stays NaN (half's bf16::from_f32).
fn braid_f32_to_bf16(x: f32) -> u32 {
  let b = bitcast<u32>(x);
  if ((b & 0x7fffffffu) > 0x7f800000u) { return (b >> 16u) | 0x40u; }
  return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}",
    ),
    (
        "braid_i64_add",
        "// 64-bit integers as vec2<u32>(low, high), two's complement, wrapping.
fn braid_i64_add(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  let lo = a.x + b.x;
  return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}",
    ),
    (
        "braid_i64_sub",
        "fn braid_i64_sub(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  return vec2<u32>(a.x - b.x, a.y - b.y - select(0u, 1u, a.x < b.x));
}",
    ),
    ("braid_i64_neg", "fn braid_i64_neg(a: vec2<u32>) -> vec2<u32> { return braid_i64_sub(vec2<u32>(0u, 0u), a); }"),
    (
        "braid_i64_lt",
        "fn braid_i64_lt(a: vec2<u32>, b: vec2<u32>) -> bool {
  if (a.y != b.y) { return bitcast<i32>(a.y) < bitcast<i32>(b.y); }
  return a.x < b.x;
}",
    ),
    (
        "braid_i64_from_i32",
        "fn braid_i64_from_i32(x: i32) -> vec2<u32> { return vec2<u32>(bitcast<u32>(x), select(0u, 0xffffffffu, x < 0i)); }",
    ),
    (
        "braid_mul32",
        "// The full 64-bit product of two u32, from 16-bit halves.
fn braid_mul32(a: u32, b: u32) -> vec2<u32> {
  let a0 = a & 0xffffu;
  let a1 = a >> 16u;
  let b0 = b & 0xffffu;
  let b1 = b >> 16u;
  let p00 = a0 * b0;
  let p01 = a0 * b1;
  let p10 = a1 * b0;
  let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
  return vec2<u32>((p00 & 0xffffu) | (mid << 16u), a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u));
}",
    ),
    (
        "braid_i64_mul",
        "fn braid_i64_mul(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  let p = braid_mul32(a.x, b.x);
  return vec2<u32>(p.x, p.y + a.x * b.y + a.y * b.x);
}",
    ),
    (
        "braid_shl64",
        "// Shifts by 0..=63.
fn braid_shl64(a: vec2<u32>, s: u32) -> vec2<u32> {
  if (s == 0u) { return a; }
  if (s >= 32u) { return vec2<u32>(0u, a.x << (s - 32u)); }
  return vec2<u32>(a.x << s, (a.y << s) | (a.x >> (32u - s)));
}",
    ),
    (
        "braid_shr64",
        "fn braid_shr64(a: vec2<u32>, s: u32) -> vec2<u32> {
  if (s == 0u) { return a; }
  if (s >= 32u) { return vec2<u32>(a.y >> (s - 32u), 0u); }
  return vec2<u32>((a.x >> s) | (a.y << (32u - s)), a.y >> s);
}",
    ),
    (
        "braid_u64_div",
        "// Unsigned 64-bit quotient (d != 0), by shift and subtract.
fn braid_u64_div(n: vec2<u32>, d: vec2<u32>) -> vec2<u32> {
  if (n.y == 0u && d.y == 0u) { return vec2<u32>(n.x / d.x, 0u); }
  var q = vec2<u32>(0u, 0u);
  var r = vec2<u32>(0u, 0u);
  for (var i = 63i; i >= 0i; i = i - 1i) {
    let bit = select((n.x >> u32(i)) & 1u, (n.y >> u32(i - 32i)) & 1u, i >= 32i);
    r = braid_shl64(r, 1u) | vec2<u32>(bit, 0u);
    if (r.y > d.y || (r.y == d.y && r.x >= d.x)) {
      r = braid_i64_sub(r, d);
      q = q | braid_shl64(vec2<u32>(1u, 0u), u32(i));
    }
  }
  return q;
}",
    ),
    (
        "braid_i64_div",
        "// Truncating, wrapping (MIN / -1 == MIN), and x / 0 == 0.
fn braid_i64_div(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
  if (b.x == 0u && b.y == 0u) { return vec2<u32>(0u, 0u); }
  let na = (a.y >> 31u) == 1u;
  let nb = (b.y >> 31u) == 1u;
  let q = braid_u64_div(select(a, braid_i64_neg(a), na), select(b, braid_i64_neg(b), nb));
  return select(q, braid_i64_neg(q), na != nb);
}",
    ),
    (
        "braid_i64_to_f32",
        "// An i64 as f32 in one rounding: to nearest even, or to odd (`odd`), which a second
// rounding to f16 or bf16 turns into the correctly rounded value.
fn braid_i64_to_f32(v: vec2<u32>, odd: bool) -> f32 {
  let negative = (v.y >> 31u) == 1u;
  let a = select(v, braid_i64_neg(v), negative);
  var r: f32;
  if (a.y == 0u && a.x < 0x1000000u) {
    r = f32(a.x);
  } else {
    let lz = select(countLeadingZeros(a.x) + 32u, countLeadingZeros(a.y), a.y != 0u);
    let t = braid_shl64(a, lz);
    let rest = t.y & 0xffu;
    var m = t.y >> 8u;
    if (odd) {
      m = m | select(0u, 1u, rest != 0u || t.x != 0u);
    } else if (rest > 0x80u || (rest == 0x80u && (t.x != 0u || (m & 1u) == 1u))) {
      m = m + 1u;
    }
    r = bitcast<f32>(((63u - lz + 127u) << 23u) + (m - 0x800000u));
  }
  return select(r, -r, negative);
}",
    ),
    (
        "braid_f2i64",
        "fn braid_f2i64(x: f32) -> vec2<u32> {
  let b = bitcast<u32>(x);
  let a = b & 0x7fffffffu;
  if (a > 0x7f800000u) { return vec2<u32>(0u, 0u); }
  let negative = (b >> 31u) == 1u;
  if (a >= 0x5f000000u) { return select(vec2<u32>(0xffffffffu, 0x7fffffffu), vec2<u32>(0u, 0x80000000u), negative); }
  let e = a >> 23u;
  if (e < 127u) { return vec2<u32>(0u, 0u); }
  let m = (a & 0x7fffffu) | 0x800000u;
  let p = e - 127u;
  var r = vec2<u32>(0u, 0u);
  if (p <= 23u) { r = vec2<u32>(m >> (23u - p), 0u); } else { r = braid_shl64(vec2<u32>(m, 0u), p - 23u); }
  return select(r, braid_i64_neg(r), negative);
}",
    ),
    (
        "braid_mix64",
        "// braid_graph::rng: SplitMix64's finaliser.
fn braid_mix64(z0: vec2<u32>) -> vec2<u32> {
  var z = braid_i64_add(z0, vec2<u32>(0x7f4a7c15u, 0x9e3779b9u));
  z = braid_i64_mul(z ^ braid_shr64(z, 30u), vec2<u32>(0x1ce4e5b9u, 0xbf58476du));
  z = braid_i64_mul(z ^ braid_shr64(z, 27u), vec2<u32>(0x133111ebu, 0x94d049bbu));
  return z ^ braid_shr64(z, 31u);
}",
    ),
    (
        "braid_uniform24",
        "// Uniform on [0, 1) with 24 random bits (exact in f32).
fn braid_uniform24(seed: vec2<u32>, i: vec2<u32>) -> f32 {
  let bits = braid_mix64(seed ^ braid_mix64(i));
  return f32(bits.y >> 8u) * bitcast<f32>(0x33800000u);
}",
    ),
    (
        "braid_normal_f32",
        "// Box-Muller on uniforms 2i (u1 = 1 - w in (0, 1]) and 2i + 1, in f32. WGSL bounds log
// only absolutely near 1 and cos only inside [-pi, pi] (a GPU's log(1 - 2^-24) can be off by
// far more than the value): -log(1 - w) by its series for small w, and
// cos(2 pi u2) = -cos(2 pi u2 - pi), whose argument lies in [-pi, pi).
fn braid_normal_f32(seed: vec2<u32>, i: vec2<u32>) -> f32 {
  let i2 = braid_shl64(i, 1u);
  let w = braid_uniform24(seed, i2);
  let u2 = braid_uniform24(seed, i2 | vec2<u32>(1u, 0u));
  var nl = -log(1.0 - w);
  if (w < 0.03125) {
    nl = w * (1.0 + w * (0.5 + w * (0.33333334 + w * (0.25 + w * 0.2))));
  }
  return sqrt(2.0 * nl) * -cos(fma(bitcast<f32>(0x40c90fdbu), u2, -bitcast<f32>(0x40490fdbu)));
}",
    ),
    (
        "braid_get_byte",
        "// Byte e % 4 of a word, and half e % 2 (sub-word elements are packed little-endian).
fn braid_get_byte(word: u32, e: u32) -> u32 { return (word >> ((e & 3u) * 8u)) & 0xffu; }",
    ),
    ("braid_get_half", "fn braid_get_half(word: u32, e: u32) -> u32 { return (word >> ((e & 1u) * 16u)) & 0xffffu; }"),
];

/// The helpers `body` calls, with the helpers they call, in definition order.
pub(super) fn used(body: &str) -> String {
    let mut need = vec![false; HELPERS.len()];
    let calls =
        |text: &str, name: &str| text.match_indices(name).any(|(at, _)| text[at + name.len()..].starts_with('('));
    for (i, (name, _)) in HELPERS.iter().enumerate() {
        need[i] = calls(body, name);
    }
    // Every entry sets `braid_zero`.
    need[0] = true;
    // Helpers only call earlier helpers: one pass from the back closes the set.
    for i in (0..HELPERS.len()).rev() {
        if need[i] {
            for (j, (name, _)) in HELPERS[..i].iter().enumerate() {
                need[j] |= calls(HELPERS[i].1, name);
            }
        }
    }
    let mut out = String::new();
    for (i, (_, src)) in HELPERS.iter().enumerate() {
        if need[i] {
            out.push_str(src);
            out.push_str("\n\n");
        }
    }
    out
}
