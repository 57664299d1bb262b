//! The micrograd example graph (BENCH.md C4), shared by the bench card and the tests.

use braid::Tensor;

/// g of the micrograd example graph over leaves a and b (at a = -4, b = 2: g = 24.7041,
/// dg/da = 138.8338, dg/db = 645.5773).
pub fn micrograd(a: &Tensor, b: &Tensor) -> Tensor {
    let mut c = a + b;
    let mut d = a * b + b.powf(3.0);
    c = &c + &(&c + 1.0);
    c = &c + &(1.0 + &c + (-a));
    d = &d + &(&d * 2.0 + (b + a).relu());
    d = &d + &(3.0 * &d + (b - a).relu());
    let e = &c - &d;
    let f = e.powf(2.0);
    let g = &f / 2.0;
    &g + &(10.0 / &f)
}
