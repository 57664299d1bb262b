//! Streams and events: two independent chains on two streams, joined on the default stream,
//! a user event ordering work that data does not, and the schedule printed as text.
//!
//! Run with `cargo run --release --example streams` (add `BRAID_DUMP=dumps` to write the
//! schedules, then `cargo run --release -- inspect dumps/flush-000002.json`).

#[path = "common/logging.rs"]
mod logging;

use braid::prelude::*;

fn main() -> Result<()> {
    logging::init();
    let cpu = Device::cpu();
    cpu.seed(7);
    let (s1, s2) = (cpu.new_stream(), cpu.new_stream());
    let a = Tensor::randn([64, 64], DType::F32, &cpu) * 0.125;
    let x = Tensor::randn([64, 64], DType::F32, &cpu);
    cpu.sync()?;

    // Each chain is recorded on its own stream; the two run concurrently when flushed.
    let y1 = s1.scope(|| {
        let mut h = x.clone();
        for _ in 0..4 {
            h = h.matmul(&a).tanh();
        }
        h
    });
    let y2 = s2.scope(|| {
        let mut h = &x * -1.0;
        for _ in 0..4 {
            h = h.matmul(&a).tanh();
        }
        h
    });
    // Reading both on the default stream: braid inserts the events itself.
    let total = (&y1 + &y2).sum();
    println!("sum = {}", total.item::<f32>()?);
    let schedule = cpu.last_schedule().expect("a flush ran");
    print!("{}", schedule.to_text());

    // A user event: work recorded on s2 after the wait runs after everything recorded on s1
    // before the event, even though no data flows between them.
    let before = s1.scope(|| x.exp().sum());
    let ev = s1.record_event();
    s2.wait_event(&ev);
    let after = s2.scope(|| x.cos().sum());
    println!("exp-sum {} then cos-sum {}", before.item::<f32>()?, after.item::<f32>()?);
    ev.synchronize()?;
    Ok(())
}
