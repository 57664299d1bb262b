//! The matrix products a timed step ran, counted from its schedule (shared by the bench cards).
//!
//! braid is lazy: it computes only what someone holds. A training row that read one gradient
//! of 32 from `Grads` timed a third fewer FLOPs than its peer's `loss.backward()` (G5, issue
//! 41). So every row that multiplies matrices runs its step once through [`one_run`], which
//! counts the products of the flush the step made (`ScheduleDump::product_count`), and
//! [`check_products`] fails the bench, naming the row, when fewer ran than the workload (and
//! its peer) has by construction.

use braid::prelude::*;

/// What one run of a step did on its device.
pub struct Ran {
    /// The device's peak memory during the run over what was live before it.
    pub peak_extra: u64,
    pub kernels: usize,
    /// Matrix products (`matmul` ops) its kernels computed.
    pub products: usize,
}

/// The number of the last flush `dev` made (0 before its first).
fn last_flush(dev: &Device) -> u64 {
    dev.last_schedule().map_or(0, |s| s.flush())
}

/// Runs `f` (one run of `row`'s step, which synchronises `dev`) after finishing what was
/// pending, and returns its result and what it ran. The step must be one flush: a device keeps
/// only its last flush's schedule, so the products of a step split over several could not all
/// be counted (the panic says so, naming the row).
pub fn one_run<T>(row: &str, dev: &Device, f: impl FnOnce() -> T) -> (T, Ran) {
    dev.sync().unwrap();
    let before = dev.memory().in_use;
    dev.reset_peak();
    let first = last_flush(dev);
    let out = f();
    dev.sync().unwrap();
    let peak_extra = dev.memory().peak.saturating_sub(before);
    let flushes = last_flush(dev) - first;
    assert!(
        flushes == 1,
        "{row}: one run of the timed step made {flushes} flushes on {}, where one was expected: \
         its matrix products are counted from one flush's schedule",
        dev.name()
    );
    let schedule = dev.last_schedule().expect("a flush was made");
    (out, Ran { peak_extra, kernels: schedule.kernel_count(), products: schedule.product_count() })
}

/// Fails loudly when `row`'s step ran fewer matrix products than `expected`, the number its
/// workload (and so its peer) has by construction: a lazy engine skipped work nobody held.
/// Returns the figure for the row's check line.
pub fn check_products(row: &str, expected: usize, ran: &Ran) -> String {
    assert!(
        ran.products >= expected,
        "{row}: braid's timed step ran {} matrix products, but the workload (and its peer) has {expected}: \
         a result the peer computes is not held until the sync, so braid skipped its work",
        ran.products
    );
    format!("{}/{expected} products ran", ran.products)
}
