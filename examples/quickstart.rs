//! The quickstart: a small computation on the default CPU device, checked by hand.
//!
//! Run with `cargo run --release --example quickstart` (add `RUST_LOG=braid=debug` to see
//! one line per kernel).

#[path = "common/logging.rs"]
mod logging;

use braid::prelude::*;

fn main() -> Result<()> {
    logging::init();
    let cpu = Device::cpu();

    // Recording: nothing runs yet.
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], &cpu);
    let w = Tensor::from_vec(vec![0.5f32, -1.0, 0.25, 2.0, -0.5, 1.0], [3, 2], &cpu);
    let b = Tensor::from_vec(vec![0.1f32, -0.2], [2], &cpu);
    let h = (x.matmul(&w) + &b).relu(); // [2, 2]
    let p = h.softmax(1);
    let total = h.sum();
    println!("recorded: h {:?}, p {:?}, total {:?}", h.shape(), p.shape(), total.shape());

    // Reading flushes what the read needs.
    let h_val = h.to_vec::<f32>()?;
    let p_val = p.to_vec::<f32>()?;
    let total_val = total.item::<f32>()?;
    println!("h = relu(x @ w + b) = {h_val:?}");
    println!("softmax(h, 1)       = {p_val:?}");
    println!("sum(h)              = {total_val}");

    // Checked against the arithmetic done by hand.
    // x @ w = [[1*0.5 + 2*0.25 + 3*-0.5, 1*-1 + 2*2 + 3*1], [4*0.5 + 5*0.25 + 6*-0.5, 4*-1 + 5*2 + 6*1]]
    //       = [[-0.5, 6.0], [0.25, 12.0]]
    let expected_h = [0.0f32, 5.8, 0.35, 11.8];
    let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * (1.0 + b.abs());
    assert!(h_val.iter().zip(&expected_h).all(|(&a, &b)| close(a, b)), "h = {h_val:?}");
    assert!(close(total_val, expected_h.iter().sum()), "sum = {total_val}");
    for row in p_val.chunks(2) {
        assert!(close(row.iter().sum(), 1.0), "softmax rows sum to 1: {row:?}");
    }
    let schedule = cpu.last_schedule().expect("a flush happened");
    println!(
        "last flush ran {} kernels; planned peak {} bytes",
        schedule.kernel_count(),
        schedule.planned_peak_bytes()
    );
    println!("ok: results match the hand computation");
    Ok(())
}
