//! Products recorded padded (`braid_graph::ProductPadding`), on a CPU device planned for a
//! target that wants them (as CUDA's does, here for products however small): every recorded
//! product is aligned, the reference interpreter agrees with the padded program (backward pass
//! included), values and gradients equal the CPU's as written, and a padded linear layer's
//! transposed weight is read in place rather than kept as a copy. (`tests/cuda_device.rs` runs
//! the padded products on a GPU.)

mod common;

use braid::prelude::*;
use common::{Rng, check_recorded};

/// The CPU device planned for a target whose library products want aligned dimensions, as
/// CUDA's cuBLAS does: every float product with an unaligned inner or output dimension is
/// recorded padded (here however small).
struct PaddedProducts {
    cpu: braid_devices::cpu::CpuDevice,
    target: braid_graph::Target,
}

impl braid_devices::Backend for PaddedProducts {
    fn name(&self) -> String {
        "cpu".into()
    }
    fn target(&self) -> &braid_graph::Target {
        &self.target
    }
    common::cpu_backend_methods!(but_target);
    fn begin<'a>(
        &'a self,
        schedule: &'a braid_scheduler::Schedule,
        poison: bool,
    ) -> Result<Box<dyn braid_devices::runtime::Flush + 'a>, braid_devices::DeviceError> {
        self.cpu.begin(schedule, poison)
    }
}

/// A CPU device whose products are recorded padded (to 16 bytes, however small).
fn padded_device() -> Device {
    let padding = braid_graph::ProductPadding { bytes: 16, min_flops: 0.0 };
    let target = braid_graph::Target { product_padding: Some(padding), ..braid_graph::Target::CPU };
    let cpu = braid_devices::cpu::CpuDevice::new();
    braid::testing::device_with_backend(std::sync::Arc::new(PaddedProducts { cpu, target }))
}

#[test]
fn a_padded_linear_layers_weight_is_kept_once_and_read_transposed_in_place() {
    // `x.linear(&w)` with its output padded reads `cat(w, zeros).t()`, which the product's
    // derivative saves. Read before the backward pass, the flush keeps the padded weight and
    // leaves its transpose a view for the backward pass to read again (it used to write and
    // keep a transposed copy), with the same gradients as without the early read.
    let dev = padded_device();
    let mut rng = Rng::new(9);
    let mut make = |dims: [usize; 2]| {
        let vals = (0..dims[0] * dims[1]).map(|_| rng.uniform(-2.0, 2.0) as f32).collect();
        Tensor::from_vec(vals, dims, &dev).requires_grad()
    };
    let (x, w) = (make([16, 24]), make([37, 24]));
    let loss = x.linear(&w, None).tanh().sum();
    loss.item::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    // (Without fusion every view is a kernel of its own, kept or not.)
    if std::env::var("BRAID_FUSION").as_deref() == Ok("0") {
        println!("skipped: the forward flush's kernels: BRAID_FUSION=0 runs every view as a kernel");
    } else {
        assert!(!text.contains(" permute "), "{text}");
    }
    let g = loss.backward().unwrap();
    let (gx, gw) = (g.get(&x).unwrap(), g.get(&w).unwrap());
    let again = x.linear(&w, None).tanh().sum().backward().unwrap();
    assert_eq!(gx.to_vec::<f32>().unwrap(), again.get(&x).unwrap().to_vec::<f32>().unwrap());
    assert_eq!(gw.to_vec::<f32>().unwrap(), again.get(&w).unwrap().to_vec::<f32>().unwrap());
}

#[test]
fn products_recorded_padded_give_the_gradients_of_the_products_written() {
    // A tied language-model head (a linear layer over a vocabulary of 37: `n` unaligned) and a
    // product over those 37 logits (`k` unaligned), in f32 (4 to 16 bytes): recorded padded to
    // 40, with the padding's zeros, narrows and concatenations in the graph; values and every
    // gradient as on the CPU as written, and the reference interpreter agrees with the padded
    // program, backward pass included.
    let padded = padded_device();
    let run = |dev: &Device| {
        let mut rng = Rng::new(47);
        let mut make = |dims: &[usize]| {
            let n = dims.iter().product();
            Tensor::from_vec((0..n).map(|_| rng.uniform(-2.0, 2.0) as f32).collect(), dims, dev)
        };
        let (x, w, v) = (make(&[2, 5, 12]).requires_grad(), make(&[37, 12]).requires_grad(), make(&[37, 9]));
        let v = v.requires_grad();
        let logits = x.linear(&w, None);
        let loss = (&logits.matmul(&v).tanh().sum() + &logits.square().mean()).reshape(());
        let g = loss.backward().unwrap();
        let grads = [g.get(&x).unwrap(), g.get(&w).unwrap(), g.get(&v).unwrap()];
        (loss, logits, grads)
    };
    let (loss, logits, grads) = run(&padded);
    // The products the padded device recorded: every inner and output dimension aligned.
    let (program, _) = braid::testing::recorded_program(&[&loss, &grads[1], &grads[2]]).unwrap();
    let mut products = 0;
    for node in &program {
        if let braid::testing::RecordedNode::Op { op: braid_graph::Op::Matmul, shape, inputs, .. } = node {
            let inner = match &program[inputs[1]] {
                braid::testing::RecordedNode::Op { shape, .. } | braid::testing::RecordedNode::Data { shape, .. } => {
                    shape.dims()[shape.rank() - 2]
                }
            };
            assert!(shape.dims()[shape.rank() - 1] % 4 == 0 && inner % 4 == 0, "a product {shape} over {inner}");
            products += 1;
        }
    }
    assert!(products >= 4, "{products} products");
    check_recorded(&[&loss, &logits, &grads[0], &grads[1], &grads[2]]).unwrap();
    let (want_loss, want_logits, want_grads) = run(&Device::cpu());
    assert_eq!(logits.shape(), want_logits.shape());
    let close = |a: &Tensor, b: &Tensor| {
        let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
        assert_eq!(a.len(), b.len());
        a.iter().zip(&b).all(|(x, y)| (x - y).abs() <= 1e-5 * (1.0 + y.abs()))
    };
    assert!(close(&loss, &want_loss) && close(&logits, &want_logits));
    for (got, want) in grads.iter().zip(&want_grads) {
        assert_eq!(got.shape(), want.shape());
        assert!(close(got, want), "{got:?} {want:?}");
    }
}

#[test]
fn a_padded_heads_logit_gradient_is_written_padded_by_the_kernel_computing_it() {
    // A language-model head over a vocabulary of 37 (padded to 40) under a cross-entropy: the
    // logits' gradient (the padded product's, zeros beside the 37 columns) is written into its
    // padded place by the cross-entropy's backward kernel, not written and then copied by a
    // concatenation of its own; the gradients are the CPU's as written.
    let run = |dev: &Device| {
        let mut rng = Rng::new(31);
        let mut make = |dims: [usize; 2]| {
            let vals = (0..dims[0] * dims[1]).map(|_| rng.uniform(-2.0, 2.0) as f32).collect();
            Tensor::from_vec(vals, dims, dev).requires_grad()
        };
        let (x, w) = (make([16, 12]), make([37, 12]));
        let target = Tensor::from_vec((0..16).map(|i| (i * 7 % 37) as i64).collect::<Vec<_>>(), [16], dev);
        let g = x.linear(&w, None).cross_entropy(&target).backward().unwrap();
        let (gx, gw) = (g.get(&x).unwrap(), g.get(&w).unwrap());
        dev.sync().unwrap(); // one flush for the whole step
        let text = dev.last_schedule().unwrap().to_text();
        (gx.to_vec::<f32>().unwrap(), gw.to_vec::<f32>().unwrap(), text)
    };
    let (gx, gw, text) = run(&padded_device());
    if std::env::var("BRAID_FUSION").as_deref() == Ok("0") {
        println!("skipped: the backward flush's kernels: BRAID_FUSION=0 runs the concatenation alone");
    } else {
        // (The one concatenation of its own pads the weight, which the step does not compute.)
        assert!(text.contains("+cat [") && text.matches(" cat [").count() == 1, "{text}");
    }
    let (want_gx, want_gw, _) = run(&Device::cpu());
    for (got, want) in [(&gx, &want_gx), (&gw, &want_gw)] {
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}
