//! Fusion as a reader sees it in the dumps: what becomes one kernel, what is refused and why.
//! (That fused results equal the reference is the property suites' job.)

use braid::prelude::*;
use serde_json::Value as Json;

fn data(dev: &Device, shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec((0..n).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect::<Vec<_>>(), shape, dev)
}

fn dump(dev: &Device) -> Json {
    serde_json::from_str(&dev.last_schedule().unwrap().to_json()).unwrap()
}

fn kernels(j: &Json) -> u64 {
    j["fusion"]["kernels"].as_u64().unwrap()
}

fn refusals(j: &Json) -> Vec<String> {
    j["fusion"]["refused"].as_array().unwrap().iter().map(|r| r["reason"].as_str().unwrap().to_string()).collect()
}

#[test]
fn a_chain_of_six_elementwise_ops_is_one_kernel() {
    let dev = braid::testing::test_device();
    let x = data(&dev, &[64, 64]);
    let y = x.exp().sin().neg().sigmoid().square().relu();
    y.to_vec::<f32>().unwrap();
    let j = dump(&dev);
    assert_eq!(kernels(&j), 1, "{}", dev.last_schedule().unwrap().to_text());
    assert_eq!(j["fusion"]["fused_ops"], 6);
    let k = &j["streams"][0]["steps"].as_array().unwrap().iter().find(|s| s["kind"] == "kernel").unwrap().clone();
    assert_eq!(k["ops"].as_array().unwrap().len(), 6, "the dump lists the member ops: {k}");
    assert_eq!(k["nodes"].as_array().unwrap().len(), 6);
}

#[test]
fn a_chain_with_its_middle_on_another_stream_is_split_and_says_why() {
    let dev = braid::testing::test_device();
    let s1 = dev.new_stream();
    let x = data(&dev, &[64, 64]);
    let a = x.exp().sin();
    let b = s1.scope(|| a.neg().sigmoid());
    let y = b.square().relu();
    y.to_vec::<f32>().unwrap();
    let j = dump(&dev);
    assert!(kernels(&j) >= 3, "{}", dev.last_schedule().unwrap().to_text());
    let reasons = refusals(&j);
    assert!(
        reasons.iter().any(|r| r == &format!("different streams (0, {})", s1.id()))
            && reasons.iter().any(|r| r == &format!("different streams ({}, 0)", s1.id())),
        "{reasons:?}"
    );
}

#[test]
fn a_chain_cut_by_a_user_wait_is_two_kernels() {
    let dev = braid::testing::test_device();
    let s1 = dev.new_stream();
    let x = data(&dev, &[64, 64]);
    let a = x.exp().sin().neg();
    let other = s1.scope(|| x.cos());
    let ev = s1.record_event();
    dev.default_stream().wait_event(&ev);
    let y = a.sigmoid().square().relu();
    y.to_vec::<f32>().unwrap();
    let j = dump(&dev);
    let text = dev.last_schedule().unwrap().to_text();
    let on_default: usize = j["streams"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["id"] == 0)
        .map(|s| s["steps"].as_array().unwrap().iter().filter(|st| st["kind"] == "kernel").count())
        .sum();
    assert_eq!(on_default, 2, "{text}");
    assert!(refusals(&j).iter().any(|r| r.contains("event wait")), "{:?}", refusals(&j));
    drop(other);
}

#[test]
fn composed_softmax_and_layer_norm_are_one_kernel_each() {
    let dev = braid::testing::test_device();
    let x = data(&dev, &[32, 100]);
    let m = x.max_dim(1, true);
    let e = (&x - &m).exp();
    let s = e.sum_dim(1, true);
    let y = &e / &s;
    let got = y.to_vec::<f32>().unwrap();
    assert_eq!(kernels(&dump(&dev)), 1, "{}", dev.last_schedule().unwrap().to_text());
    for row in got.chunks(100) {
        assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
    }
    x.layer_norm(1, 1e-5).to_vec::<f32>().unwrap();
    assert_eq!(kernels(&dump(&dev)), 1, "{}", dev.last_schedule().unwrap().to_text());
    x.log_softmax(0).to_vec::<f32>().unwrap();
    assert_eq!(kernels(&dump(&dev)), 1, "{}", dev.last_schedule().unwrap().to_text());
}

#[test]
fn matmul_epilogues_and_transposed_operands_fuse() {
    let dev = braid::testing::test_device();
    let x = data(&dev, &[16, 32]);
    let w = data(&dev, &[24, 32]);
    let b = data(&dev, &[24]);
    // A transposed operand is read through its strides; bias and activation run on the product.
    let y = (x.matmul(&w.t()) + &b).relu();
    let got = y.to_vec::<f32>().unwrap();
    let j = dump(&dev);
    assert_eq!(kernels(&j), 1, "{}", dev.last_schedule().unwrap().to_text());
    assert_eq!(j["fusion"]["fused_ops"], 3, "matmul, add, relu (the transpose is folded)");
    // Against the same computed without fusion.
    let plain = braid::testing::test_device();
    plain.set_fusion(false);
    let (x2, w2, b2) = (data(&plain, &[16, 32]), data(&plain, &[24, 32]), data(&plain, &[24]));
    let want = (x2.matmul(&w2.t()) + &b2).relu().to_vec::<f32>().unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{g} vs {w}");
    }
    assert!(kernels(&dump(&plain)) >= 4, "unfused: transpose copy, matmul, add, relu");
}

#[test]
fn the_kernel_input_limit_splits_kernels() {
    let dev = braid::testing::test_device();
    let xs: Vec<Tensor> = (0..24).map(|i| data(&dev, &[8]) * (i as f64)).collect();
    dev.sync().unwrap();
    let mut total = xs[0].clone();
    for x in &xs[1..] {
        total = &total + x;
    }
    total.to_vec::<f32>().unwrap();
    let j = dump(&dev);
    assert!(kernels(&j) >= 2);
    assert!(refusals(&j).iter().any(|r| r.contains("kernel input limit 16")), "{:?}", refusals(&j));
}

#[test]
fn fusion_off_runs_every_op_as_its_own_kernel() {
    let dev = braid::testing::test_device();
    dev.set_fusion(false);
    let x = data(&dev, &[64]);
    x.exp().sin().neg().to_vec::<f32>().unwrap();
    let j = dump(&dev);
    assert_eq!(kernels(&j), 3);
    assert!(refusals(&j).is_empty());
}

#[test]
fn many_reductions_of_one_input_split_into_several_row_kernels() {
    let dev = braid::testing::test_device();
    let x = Tensor::from_vec((0..32).map(|i| i as f32).collect::<Vec<_>>(), [4, 8], &dev);
    // Every row's maximum is its last element (index 7; i32 positions, which every device holds).
    let fifth = x.argmax_dim_as(1, false, DType::I32).to_dtype(DType::F32);
    let stats = x.sum_dim(1, false) + x.max_dim(1, false) + x.min_dim(1, false) + x.mean_dim(1, false) + fifth;
    assert_eq!(stats.to_vec::<f32>().unwrap(), vec![45.5, 133.5, 221.5, 309.5]);
    // At most four reductions share a row kernel.
    assert!(kernels(&dump(&dev)) >= 2, "{}", dev.last_schedule().unwrap().to_text());
}

#[test]
fn cross_entropy_is_a_row_kernel_and_embedding_a_gather() {
    let dev = braid::testing::test_device();
    // i32 classes and ids (what wgpu holds; i64 runs the same kernels).
    let logits = data(&dev, &[64, 50]);
    let target = Tensor::from_vec((0..64).map(|i| i * 7 % 50).collect::<Vec<i32>>(), [64], &dev);
    logits.cross_entropy(&target).item::<f32>().unwrap();
    // The class numbers (an arange); then the maximum, the sum of exponentials and the
    // target's logit in one row kernel over the logits; then the losses' mean over rows.
    let text = dev.last_schedule().unwrap().to_text();
    assert_eq!(kernels(&dump(&dev)), 3, "{text}");
    assert!(text.contains(" eq+max+sub+exp+sum+log+select+sum"), "{text}");
    // An embedding lookup: one gather kernel, reading a transposed table through its view and
    // writing the result in the ids' shape (no copy before or after).
    let table = data(&dev, &[8, 20]);
    let ids = Tensor::from_vec((0..12).map(|i| i * 5 % 20).collect::<Vec<i32>>(), [3, 4], &dev);
    let rows = ids.embedding(&table.t());
    assert_eq!(rows.dims(), &[3, 4, 8]);
    let values = rows.to_vec::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert_eq!(kernels(&dump(&dev)), 1, "{text}");
    assert!(text.contains("index_select"), "{text}");
    // Element [0, 1] picked row 5 of the table: column 5 of the stored [8, 20].
    let column: Vec<f32> = (0..8).map(|f| ((((f * 20 + 5) * 37 % 101) as f32) - 50.0) / 25.0).collect();
    assert_eq!(values[8..16], column[..]);
}

#[test]
fn a_linear_layers_weight_update_is_the_epilogue_of_its_gradient() {
    use braid::nn::{Linear, Module};
    use braid::optim::{Optimizer, Sgd};
    let dev = braid::testing::test_device();
    dev.seed(1);
    let layer = Linear::with(16, 8, false, DType::F32, &dev);
    let x = data(&dev, &[4, 16]);
    let grads = layer.forward(&x).square().mean().backward().unwrap();
    Sgd::new(0.1).update(layer.params().iter(), &grads);
    drop(grads);
    layer.weight.to_vec::<f32>().unwrap();
    // `x.matmul(&w.t())` differentiates to `g^T x` in the weight's own layout, so the update
    // reads the product in its kernel instead of a stored, transposed gradient.
    let text = dev.last_schedule().unwrap().to_text();
    assert!(text.contains("matmul+mul+sub "), "{text}");
}

#[test]
fn views_before_a_reduction_are_read_in_place() {
    let dev = braid::testing::test_device();
    let x = data(&dev, &[64, 256]);
    // Reshape, transpose, narrow and expand of a stored value fold into the reduction's loads:
    // one kernel, no copy.
    let cases = [
        ("reshape then sum", x.reshape([16384]).sum()),
        ("reshape then row sums", x.reshape([128, 128]).sum_dim(1, false)),
        ("reshape then softmax", x.reshape([32, 512]).softmax(-1)),
        ("transpose then mean", x.t().mean_dim(1, false)),
        ("narrow then max", x.narrow(1, 16, 128).max()),
        ("narrow then min of exp", x.narrow(1, 16, 128).exp().min()),
        ("reshape of a narrow then sum", x.narrow(0, 0, 32).reshape([8192]).sum()),
        ("expand then sum", x.reshape([1, 64, 256]).expand([4, 64, 256]).sum_dim(0, false)),
    ];
    for (name, y) in cases {
        y.to_vec::<f32>().unwrap();
        let j = dump(&dev);
        assert_eq!(kernels(&j), 1, "{name}: {}", dev.last_schedule().unwrap().to_text());
    }
}

#[test]
fn tens_of_thousands_of_views_in_a_row_fold_on_a_spawned_threads_stack() {
    // Folding resolves a chain of views without recursion: 20,000 views in a row, and the
    // backward pass through them, on a spawned thread (2 MiB of stack, where a recursion
    // through 5,000 views overflowed).
    let dev = braid::testing::test_device();
    let run = move || {
        let w = data(&dev, &[2, 3]).requires_grad();
        let mut x = w.clone();
        for _ in 0..5_000 {
            x = x.t().contiguous().reshape([3, 2]).t();
        }
        let y = &x * 2.0;
        let grad = (&y * &y).sum().backward().unwrap().get(&w).unwrap();
        (y.to_vec::<f32>().unwrap(), grad.to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap())
    };
    let (y, grad, w) = std::thread::spawn(run).join().unwrap();
    // The views only move elements around: the same values come out, in some order.
    let sorted = |mut v: Vec<f32>| {
        v.sort_by(f32::total_cmp);
        v
    };
    assert_eq!(sorted(y), sorted(w.iter().map(|v| v * 2.0).collect()));
    assert_eq!(sorted(grad), sorted(w.iter().map(|v| v * 8.0).collect()));
}

#[test]
fn softmaxes_and_whole_reductions_over_a_transposed_view_copy_it_first_where_the_target_says_so() {
    let dev = braid::testing::test_device();
    let x = data(&dev, &[64, 256]);
    // A reduction alone reads the transposed view in place.
    let sums = x.t().sum_dim(1, false);
    sums.to_vec::<f32>().unwrap();
    assert_eq!(kernels(&dump(&dev)), 1, "{}", dev.last_schedule().unwrap().to_text());
    // A softmax writes whole rows along the reduced axis: on the CPU the view is copied by a
    // kernel of its own (a tiled transpose) and the row kernel reads the copy's rows in order.
    let y = x.t().softmax(-1);
    let got = y.to_vec::<f32>().unwrap();
    let want = if dev.target().copies_transposed_rows { 2 } else { 1 };
    assert_eq!(kernels(&dump(&dev)), want, "{}", dev.last_schedule().unwrap().to_text());
    let copied = x.t().contiguous().softmax(-1).to_vec::<f32>().unwrap();
    assert!(got.iter().zip(&copied).all(|(a, b)| (a - b).abs() <= 1e-6), "the same softmax either way");
    // A reduction over every element reads in the view's order: directly, the view is copied
    // first; through elementwise work, that work's kernel writes its values in order first.
    let total = x.t().sum();
    let got = total.item::<f32>().unwrap();
    assert_eq!(kernels(&dump(&dev)), want, "{}", dev.last_schedule().unwrap().to_text());
    let copied = x.t().contiguous().sum().item::<f32>().unwrap();
    // The same order: the same bits where both plans copy (elsewhere within rounding).
    let same = |a: f32, b: f32| if want == 2 { a.to_bits() == b.to_bits() } else { (a - b).abs() <= 1e-5 * b.abs() };
    assert!(same(got, copied), "{got} against {copied}");
    let total = x.t().exp().sum();
    let got = total.item::<f32>().unwrap();
    let j = dump(&dev);
    assert_eq!(kernels(&j), want, "{}", dev.last_schedule().unwrap().to_text());
    if dev.target().copies_transposed_rows {
        assert!(refusals(&j).iter().any(|r| r.contains("reads a transposed view")), "{:?}", refusals(&j));
    }
    let copied = x.t().contiguous().exp().sum().item::<f32>().unwrap();
    assert!(same(got, copied), "{got} against {copied}");
}

/// `params` updated by one AdamW step from gradients computed (and read) beforehand, so that
/// the step is a flush of its own; returns the parameters' bits after it.
fn adamw_step(dev: &Device, params: &[Tensor], opt: &mut braid::optim::AdamW) -> Vec<Vec<u32>> {
    use braid::optim::Optimizer;
    let loss = params.iter().map(|p| p.square().sum()).reduce(|a, b| &a + &b).unwrap();
    let grads = loss.backward().unwrap();
    loss.item::<f32>().unwrap();
    params.iter().for_each(|p| drop(grads.get(p).unwrap().to_vec::<f32>().unwrap()));
    opt.update(params, &grads);
    dev.sync().unwrap();
    params.iter().map(|p| p.to_vec::<f32>().unwrap().into_iter().map(f32::to_bits).collect()).collect()
}

#[test]
fn an_optimizer_step_updates_many_parameters_in_few_packed_kernels_in_place() {
    let dev = braid::testing::test_device();
    let shapes: Vec<Vec<usize>> = (0..40).map(|i| if i % 2 == 0 { vec![8 + i, 16] } else { vec![8 + i] }).collect();
    let make = |dev: &Device| -> Vec<Tensor> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, s)| (&data(dev, s) * (1.0 + i as f64 / 40.0)).detach().requires_grad())
            .collect()
    };
    let params = make(&dev);
    let mut opt = braid::optim::AdamW::new(0.01);
    let mut bits = vec![];
    for _ in 0..3 {
        bits.push(adamw_step(&dev, &params, &mut opt));
    }
    // The third step's flush: 40 independent update chains, each one map kernel's worth,
    // packed into a few kernels (at most 32 loops each, fewer where the target binds few
    // buffers: wgpu), every parameter and both moments written in place.
    let j = dump(&dev);
    let text = dev.last_schedule().unwrap().to_text();
    assert!(kernels(&j) <= 13, "40 updates in {} kernels:\n{text}", kernels(&j));
    let in_place: usize =
        text.lines().filter_map(|l| l.split("(in place: ").nth(1)).map(|l| l.split(' ').count()).sum();
    assert_eq!(in_place, 3 * 40, "p, m and v in place:\n{text}");
    assert!(!text.contains("alloc"), "nothing allocated:\n{text}");
    // The same bits as every op run alone.
    let plain = Device::new_from_env().unwrap();
    plain.set_fusion(false);
    let params = make(&plain);
    let mut opt = braid::optim::AdamW::new(0.01);
    for (step, want) in bits.iter().enumerate() {
        assert!(adamw_step(&plain, &params, &mut opt) == *want, "step {step} differs from unfused");
    }
    assert!(kernels(&dump(&plain)) > 40 * 5);
}

#[test]
fn updates_on_two_streams_are_packed_per_stream() {
    let dev = braid::testing::test_device();
    let (s0, s1) = (dev.new_stream(), dev.new_stream());
    let xs: Vec<Tensor> = (0..6).map(|i| data(&dev, &[4 + i, 8])).collect();
    xs.iter().for_each(|x| drop(x.to_vec::<f32>().unwrap()));
    let ys: Vec<Tensor> =
        (0..6).map(|i| if i % 2 == 0 { s0.scope(|| xs[i].exp()) } else { s1.scope(|| xs[i].sin()) }).collect();
    dev.sync().unwrap();
    let j = dump(&dev);
    assert_eq!(kernels(&j), 2, "one packed kernel per stream:\n{}", dev.last_schedule().unwrap().to_text());
    for (i, y) in ys.iter().enumerate() {
        let want: Vec<f32> =
            xs[i].to_vec::<f32>().unwrap().iter().map(|v| if i % 2 == 0 { v.exp() } else { v.sin() }).collect();
        let got = y.to_vec::<f32>().unwrap();
        assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs())), "output {i}");
    }
}

#[test]
fn a_layer_norms_gradient_is_one_row_kernel() {
    // The derivative of a row's mean or sum is the row's gradient expanded back along the row;
    // read through that view, a reduced value of a row kernel stays in the kernel, so the
    // layer norm's two dependent row sums and its input's gradient are one kernel (they were
    // three, each expanded sum written out and read back).
    let dev = braid::testing::test_device();
    let x = data(&dev, &[32, 48]).requires_grad();
    let w = data(&dev, &[32, 48]).sin();
    let loss = (&x.layer_norm(-1, 1e-5) * &w).sum();
    loss.item::<f32>().unwrap();
    let g = loss.backward().unwrap().get(&x).unwrap();
    g.to_vec::<f32>().unwrap();
    let j = dump(&dev);
    let steps = j["streams"].as_array().unwrap().iter().flat_map(|s| s["steps"].as_array().unwrap());
    let reducing = steps.filter(|s| s["kind"] == "kernel" && s["ops"].as_array().unwrap().iter().any(|o| o == "sum"));
    assert_eq!(reducing.count(), 1, "{}", dev.last_schedule().unwrap().to_text());
}

#[test]
fn a_concatenation_joins_the_map_kernel_that_computes_its_input() {
    let dev = braid::testing::test_device();
    // The gradient of a narrow (a padded product's): zeros beside the narrowed part's gradient,
    // written by the kernel that computes that gradient, into its place.
    let x = data(&dev, &[8, 40]).requires_grad();
    let loss = (x.narrow(1, 0, 37).exp() * 0.5).sum();
    let g = loss.backward().unwrap().get(&x).unwrap().to_vec::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert!(text.contains("exp+mul+mul+cat [") && !text.contains(" cat ["), "{text}");
    let xs = x.to_vec::<f32>().unwrap();
    for (i, (gi, xi)) in g.iter().zip(&xs).enumerate() {
        let want = if i % 40 < 37 { 0.5 * xi.exp() } else { 0.0 };
        assert!((gi - want).abs() <= 1e-6 * want.abs().max(1.0), "dx[{i}] = {gi}, not {want}");
    }
    // A value from outside beside a computed one: copied by a loop of the same kernel.
    let a = data(&dev, &[8, 5]);
    let b = data(&dev, &[8, 3]);
    dev.sync().unwrap();
    let c = Tensor::cat(&[&b, &a.sin(), &b], 1);
    let values = c.to_vec::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert_eq!(kernels(&dump(&dev)), 1, "{text}");
    let (av, bv) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
    for r in 0..8 {
        let row: Vec<f32> = bv[r * 3..r * 3 + 3]
            .iter()
            .copied()
            .chain(av[r * 5..r * 5 + 5].iter().map(|v| v.sin()))
            .chain(bv[r * 3..r * 3 + 3].iter().copied())
            .collect();
        let close = values[r * 11..r * 11 + 11].iter().zip(&row).all(|(v, w)| (v - w).abs() <= 1e-6);
        assert!(close, "row {r}: {:?}, not {row:?}", &values[r * 11..r * 11 + 11]);
    }
    // A computed value a tensor still holds is written anyway: the concatenation copies it in
    // a kernel of its own, and the dump says why.
    let s = a.sin();
    Tensor::cat(&[&s, &b], 1).to_vec::<f32>().unwrap();
    let j = dump(&dev);
    assert_eq!(kernels(&j), 2, "{}", dev.last_schedule().unwrap().to_text());
    assert!(refusals(&j).iter().any(|r| r.ends_with("the kernel writes it anyway")), "{:?}", refusals(&j));
    let held = s.to_vec::<f32>().unwrap();
    assert!(held.iter().zip(&av).all(|(s, a)| (s - a.sin()).abs() <= 1e-6), "{held:?}");
}

#[test]
fn a_reshape_merging_permuted_heads_is_copied_once_by_the_concatenation_that_reads_it() {
    let dev = braid::testing::test_device();
    // Heads [b, h, t, d] back to rows [b * t, h * d] (no view of the permute), concatenated
    // with another block of rows: one copy kernel, each element moved once.
    let (b, h, t, d) = (2, 3, 4, 5);
    let heads = data(&dev, &[b, h, t, d]);
    let other = data(&dev, &[b * t, 7]);
    dev.sync().unwrap();
    let joined = Tensor::cat(&[&other, &heads.permute(&[0, 2, 1, 3]).reshape([b * t, h * d])], 1);
    let joined = joined.to_vec::<f32>().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert_eq!(kernels(&dump(&dev)), 1, "{text}");
    assert!(text.contains(" cat [") && !text.contains("reshape"), "{text}");
    let (hv, ov) = (heads.to_vec::<f32>().unwrap(), other.to_vec::<f32>().unwrap());
    for r in 0..b * t {
        let (bi, ti) = (r / t, r % t);
        let mut want = ov[r * 7..r * 7 + 7].to_vec();
        for hi in 0..h {
            want.extend_from_slice(&hv[((bi * h + hi) * t + ti) * d..][..d]);
        }
        assert_eq!(joined[r * (7 + h * d)..][..7 + h * d], want[..], "row {r}");
    }
}

#[test]
fn a_reduction_does_not_join_a_kernel_that_writes_a_concatenation() {
    let dev = braid::testing::test_device();
    let x = data(&dev, &[4, 8]);
    dev.sync().unwrap();
    // `exp` and the concatenation of it, then `cos` and its row sums, in one flush: the sums
    // would turn the map kernel into a row kernel, which writes no regions.
    let c = Tensor::cat(&[&x.exp(), &Tensor::zeros([4, 2], DType::F32, &dev)], 1);
    let s = x.cos().sum_dim(1, false);
    dev.sync().unwrap();
    let reasons = refusals(&dump(&dev));
    assert!(
        reasons.iter().any(|r| r.ends_with("would make a row kernel of one that writes a concatenation")),
        "{reasons:?}"
    );
    let (xv, cv, sv) = (x.to_vec::<f32>().unwrap(), c.to_vec::<f32>().unwrap(), s.to_vec::<f32>().unwrap());
    for r in 0..4 {
        for k in 0..10 {
            let want = if k < 8 { xv[r * 8 + k].exp() } else { 0.0 };
            assert!((cv[r * 10 + k] - want).abs() <= 1e-6 * want.abs().max(1.0), "c[{r}][{k}]");
        }
        let want: f32 = xv[r * 8..r * 8 + 8].iter().map(|v| v.cos()).sum();
        assert!((sv[r] - want).abs() <= 1e-5, "s[{r}] = {}, not {want}", sv[r]);
    }
}

#[test]
fn a_concatenation_nobody_reads_before_a_user_event_is_still_written_by_its_kernel() {
    // The event orders the concatenation before it, so the flush runs it though its tensor is
    // gone; fused into the kernel of `exp` and `sin` (which reads the same input), it is stored
    // region by region, so the kernel writes it (and the plan frees it at once).
    let dev = braid::testing::test_device();
    let x = data(&dev, &[2, 2]);
    let b = data(&dev, &[2, 1]);
    dev.sync().unwrap();
    let k = x.exp();
    let c = Tensor::cat(&[&x.sin(), &b], 1);
    let event = dev.default_stream().record_event();
    drop(c);
    event.synchronize().unwrap();
    let text = dev.last_schedule().unwrap().to_text();
    assert!(text.contains("exp+sin+cat"), "{text}");
    let (kv, xv) = (k.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap());
    assert!(kv.iter().zip(&xv).all(|(k, x)| (k - x.exp()).abs() <= 1e-6 * x.exp()), "{kv:?}");
}
