//! The `nn` module: layers compute what their formulas say, initialisers draw from the right
//! distributions (repeatably under a seed), parameters save and load by name, and a training
//! loop over `Params` with an `Optimizer` lowers the loss.

use braid::nn::{LayerNorm, Linear, Module, Params, init};
use braid::optim::{AdamW, Optimizer};
use braid::prelude::*;

fn close(a: &[f32], b: &[f32], tol: f32) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()))
}

#[test]
fn layers_compute_their_formulas() {
    let dev = braid::testing::test_device();
    dev.seed(1);
    let lin = Linear::new(3, 2, &dev);
    let x = Tensor::from_vec(vec![1.0f32, 2.0, -1.0, 0.5, 0.0, 3.0], [2, 3], &dev);
    let (w, b) = (lin.weight.to_vec::<f32>().unwrap(), lin.bias.as_ref().unwrap().to_vec::<f32>().unwrap());
    assert!(w.iter().chain(&b).all(|v| v.abs() <= 1.0 / 3f32.sqrt()), "PyTorch's default bound: {w:?}");
    let xs = x.to_vec::<f32>().unwrap();
    let (xr, wr, br) = (&xs, &w, &b);
    let want: Vec<f32> = (0..2)
        .flat_map(|r| (0..2).map(move |o| (0..3).map(|i| xr[r * 3 + i] * wr[o * 3 + i]).sum::<f32>() + br[o]))
        .collect();
    assert!(close(&lin.forward(&x).to_vec::<f32>().unwrap(), &want, 1e-6));
    let ln = LayerNorm::new(3, &dev);
    let y = ln.forward(&x).to_vec::<f32>().unwrap();
    for r in 0..2 {
        let row = &xs[r * 3..r * 3 + 3];
        let mean = row.iter().sum::<f32>() / 3.0;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f32>() / 3.0;
        let want: Vec<f32> = row.iter().map(|v| (v - mean) / (var + 1e-5).sqrt()).collect();
        assert!(close(&y[r * 3..r * 3 + 3], &want, 1e-5), "{y:?} vs {want:?}");
    }
    let p = lin.params();
    assert_eq!(p.named().map(|(n, _)| n.to_string()).collect::<Vec<_>>(), ["weight", "bias"]);
}

#[test]
fn initialisers_follow_their_distributions_and_the_device_seed() {
    let dev = braid::testing::test_device();
    let draw = |seed: u64| {
        dev.seed(seed);
        init::kaiming_uniform([256, 64], DType::F32, &dev).to_vec::<f32>().unwrap()
    };
    let (a, b, c) = (draw(3), draw(3), draw(4));
    assert_eq!(a, b, "the same seed draws the same values");
    assert_ne!(a, c);
    let bound = (6.0f32 / 64.0).sqrt();
    assert!(a.iter().all(|v| v.abs() <= bound) && a.iter().any(|v| v.abs() > 0.9 * bound));
    let n = init::xavier_normal([300, 200], DType::F32, &dev).to_vec::<f32>().unwrap();
    let var = n.iter().map(|v| v * v).sum::<f32>() / n.len() as f32;
    let want = 2.0 / 500.0;
    assert!((var - want).abs() < 0.05 * want, "xavier normal variance {var} vs {want}");
    assert_eq!(init::fans(&Shape::from([8, 4, 3, 3])), (36, 72));
    assert!(init::zeros([2], DType::F32, &dev).needs_grad());
}

#[test]
fn a_training_loop_over_params_saves_and_loads_by_name() {
    let dev = braid::testing::test_device();
    dev.seed(2);
    let (l1, l2) = (Linear::new(4, 8, &dev), Linear::new(8, 1, &dev));
    let mut params = Params::new();
    params.extend("l1", l1.params());
    params.extend("l2", l2.params());
    assert_eq!(params.len(), 4);
    assert_eq!(params.numel(), 4 * 8 + 8 + 8 + 1);
    let x = Tensor::randn([32, 4], DType::F32, &dev);
    let target = x.sum_dim(1, true);
    let loss = |params_used: &[&Linear]| {
        (params_used[1].forward(&params_used[0].forward(&x).relu()) - &target).square().mean()
    };
    let mut opt = AdamW::new(0.01);
    let first = loss(&[&l1, &l2]).item::<f32>().unwrap();
    for _ in 0..50 {
        let grads = loss(&[&l1, &l2]).backward().unwrap();
        opt.update(&params, &grads);
    }
    let trained = loss(&[&l1, &l2]).item::<f32>().unwrap();
    assert!(trained < 0.5 * first, "{first} -> {trained}");
    let path = std::env::temp_dir().join(format!("braid-nn-{}.safetensors", std::process::id()));
    params.save(&path).unwrap();
    // Fresh layers, loaded: the same loss.
    let (m1, m2) = (Linear::new(4, 8, &dev), Linear::new(8, 1, &dev));
    let mut fresh = Params::new();
    fresh.extend("l1", m1.params());
    fresh.extend("l2", m2.params());
    fresh.load(&path).unwrap();
    assert_eq!(loss(&[&m1, &m2]).item::<f32>().unwrap(), trained);
    // A parameter the file does not have is an error, and nothing changes.
    let mut other = Params::new();
    other.push("missing", &m1.weight);
    assert!(matches!(other.load(&path), Err(Error::Io(m)) if m.contains("missing")));
    // No parameters: the file is still read, so a missing one is an error too.
    assert!(Params::new().load(&path).is_ok());
    std::fs::remove_file(&path).unwrap();
    assert!(matches!(Params::new().load(&path), Err(Error::Io(m)) if m.contains("cannot read")));
}

#[path = "../examples/common/char_lm.rs"]
mod char_lm;

#[test]
fn the_char_lm_example_learns_and_reloads_to_the_same_loss() {
    let dev = braid::testing::test_device();
    let corpus = char_lm::Corpus::new(char_lm::TEXT);
    let cfg = char_lm::Config { steps: 60, batch: 16, ..char_lm::Config::EXAMPLE };
    let mut losses = Vec::new();
    let model = char_lm::train(&corpus, &cfg, &dev, |_, loss| losses.push(loss)).unwrap();
    let (first, last) = (losses[..10].iter().sum::<f32>() / 10.0, losses[50..].iter().sum::<f32>() / 10.0);
    assert!(last < first - 0.5, "training loss {first} -> {last}");
    let loss = char_lm::eval_loss(&model, &corpus, &dev).unwrap();
    assert!(loss < first, "held loss {loss}");
    let path = std::env::temp_dir().join(format!("braid-char-lm-test-{}.safetensors", std::process::id()));
    model.params().save(&path).unwrap();
    dev.seed(99);
    let fresh = char_lm::CharLm::new(corpus.vocabulary(), &cfg, &dev);
    assert_ne!(char_lm::eval_loss(&fresh, &corpus, &dev).unwrap(), loss);
    fresh.params().load(&path).unwrap();
    assert_eq!(char_lm::eval_loss(&fresh, &corpus, &dev).unwrap().to_bits(), loss.to_bits());
    std::fs::remove_file(&path).unwrap();
    let text = char_lm::sample(&model, &corpus, &dev, "Alice ", 20).unwrap();
    assert_eq!(text.chars().count(), 26);
}

#[test]
fn an_embedding_layer_looks_up_rows_of_a_seeded_table() {
    let dev = braid::testing::test_device();
    dev.seed(5);
    let e = braid::nn::Embedding::new(7, 3, &dev);
    assert_eq!((e.weight.dims(), e.weight.needs_grad()), (&[7, 3][..], true));
    let w = e.weight.to_vec::<f32>().unwrap();
    let ids = char_lm::ids_tensor(vec![6, 0, 6, 2], [2, 2], &dev);
    let rows = e.forward(&ids);
    assert_eq!(rows.dims(), &[2, 2, 3]);
    let want: Vec<f32> = [6, 0, 6, 2].iter().flat_map(|&i| w[i * 3..i * 3 + 3].to_vec()).collect();
    assert_eq!(rows.to_vec::<f32>().unwrap(), want);
    dev.seed(5);
    assert_eq!(braid::nn::Embedding::new(7, 3, &dev).weight.to_vec::<f32>().unwrap(), w, "seeded by the device");
    assert_eq!(e.params().named().map(|(n, _)| n).collect::<Vec<_>>(), vec!["weight"]);
}
