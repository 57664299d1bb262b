//! Generation (`braid::nn::generate` and the GPT-2 example's decode step): decoding over the
//! static cache equals recomputing the whole prefix, for prompts of different lengths, eagerly
//! and as a captured step; sampling on the device picks what it must; misuse at the caller's
//! line. Runs on the device `BRAID_DEVICE` names (the CPU in CI).

#[path = "../examples/common/gpt2.rs"]
#[allow(dead_code)]
mod gpt2;
#[path = "../examples/common/gpt2_generate.rs"]
#[allow(dead_code)]
mod gpt2_generate;

use braid::nn::generate::{CachePositions, Sampling, cache_update, cache_write, cached_attention, sample};
use braid::prelude::*;
use gpt2::{Config, Gpt2};
use gpt2_generate::Generation;

const CFG: Config = Config { layers: 2, heads: 4, width: 32, context: 32, vocabulary: 61 };

fn close(a: &[f32], b: &[f32], tol: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1.0);
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * scale, "{what}[{i}]: {x} vs {y} (scale {scale})");
    }
}

/// Prompts of different lengths (token ids below the vocabulary).
fn prompts() -> Vec<Vec<i32>> {
    vec![vec![3, 17, 42, 5, 9], vec![11, 2, 60, 33, 7, 19, 25, 1, 8], vec![4]]
}

/// The logits after the last token of `seq`, recomputed over the whole sequence alone.
fn recomputed(model: &Gpt2, seq: &[i32], device: &Device) -> Vec<f32> {
    let ids = Tensor::from_vec(seq.to_vec(), [1, seq.len()], device);
    let logits = braid::no_grad(|| model.logits(&ids));
    let v = CFG.vocabulary;
    logits.to_vec::<f32>().unwrap()[(seq.len() - 1) * v..].to_vec()
}

#[test]
fn decoding_over_the_cache_equals_recomputing_the_prefix() {
    let device = braid::testing::test_device();
    let model = Gpt2::new(CFG, &device, 7);
    let prompts = prompts();
    let cache_len = 20;
    let (b, v) = (prompts.len(), CFG.vocabulary);
    let t = prompts.iter().map(Vec::len).max().unwrap();
    let ids: Vec<i32> =
        prompts.iter().flat_map(|p| p.iter().copied().chain(std::iter::repeat_n(0, t - p.len()))).collect();
    let ids = Tensor::from_vec(ids, [b, t], &device);
    let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
    let (logits, caches) = braid::no_grad(|| model.prefill(&ids, &lengths, cache_len));
    let mut seqs = prompts.clone();
    let mut logits = logits.to_vec::<f32>().unwrap();
    for step in 0..8 {
        for (i, seq) in seqs.iter().enumerate() {
            let want = recomputed(&model, seq, &device);
            close(&logits[i * v..(i + 1) * v], &want, 2e-5, &format!("step {step}, sequence {i}"));
        }
        // Feed each sequence a token (not the model's choice: any token must work).
        let next: Vec<i32> = (0..b).map(|i| ((step * 7 + i * 13) % v) as i32).collect();
        let pos: Vec<i32> = seqs.iter().map(|s| s.len() as i32).collect();
        for (seq, &n) in seqs.iter_mut().zip(&next) {
            seq.push(n);
        }
        let tokens = Tensor::from_vec(next, [b, 1], &device);
        let pos = Tensor::from_vec(pos, [b], &device);
        // The caches are updated in place.
        let l = braid::no_grad(|| model.decode(&tokens, &pos, &caches));
        logits = l.to_vec::<f32>().unwrap();
    }
}

#[test]
fn a_captured_decode_step_generates_what_eager_decoding_does() {
    let device = braid::testing::test_device();
    let model = Gpt2::new(CFG, &device, 3);
    for how in [Sampling::Greedy, Sampling::TopK { k: 5, temperature: 0.8 }] {
        let mut runs = Vec::new();
        for captured in [false, true] {
            device.seed(11);
            let mut g = Generation::new(&model, &prompts(), 24, how, None, captured);
            let identities = |g: &Generation| -> Vec<usize> {
                g.caches().iter().map(|c| braid::testing::buffer_identity(c).unwrap()).collect()
            };
            let before = identities(&g);
            for _ in 0..10 {
                g.next().unwrap();
            }
            // Every token's keys and values were written into the caches where they lie.
            assert_eq!(identities(&g), before, "{how:?}, captured {captured}: a cache was copied");
            runs.push(g.tokens().unwrap());
        }
        assert_eq!(runs[0], runs[1], "{how:?}: eager and captured decoding differ");
        assert!(runs[0].iter().all(|s| s.len() == 11 && s.iter().all(|&t| (0..CFG.vocabulary as i32).contains(&t))));
    }
    // Greedy decoding picks each step's largest logit: check the first tokens against the
    // recomputed logits.
    let mut g = Generation::new(&model, &prompts(), 24, Sampling::Greedy, None, true);
    for _ in 0..4 {
        g.next().unwrap();
    }
    for (p, toks) in prompts().iter().zip(g.tokens().unwrap()) {
        let mut seq = p.clone();
        for &tok in &toks {
            let logits = recomputed(&model, &seq, &device);
            let best = logits.iter().enumerate().fold(0, |b, (i, &x)| if x > logits[b] { i } else { b });
            assert_eq!(tok as usize, best, "greedy token after {seq:?}");
            seq.push(tok);
        }
    }
}

#[test]
fn the_cache_is_written_at_each_sequences_position_and_attended_up_to_it() {
    let device = braid::testing::test_device();
    device.seed(5);
    let (b, h, t, d) = (3, 2, 6, 4);
    let cache = Tensor::randn([b, h, t, d], DType::F32, &device);
    let new = Tensor::randn([b, h, 1, d], DType::F32, &device);
    let pos = [2usize, 0, 5];
    let pos_t = Tensor::from_vec(pos.iter().map(|&p| p as i32).collect::<Vec<_>>(), [b], &device);
    let pos_t = CachePositions::new(&pos_t, t);
    let written = cache_write(&cache, &new, &pos_t);
    // The same rows written in place, into a cache of the same value.
    let updated = cache.detach();
    cache_update(&updated, &new, &pos_t);
    assert_eq!(updated.to_vec::<f32>().unwrap(), written.to_vec::<f32>().unwrap());
    let (c, n, w) = (cache.to_vec::<f32>().unwrap(), new.to_vec::<f32>().unwrap(), written.to_vec::<f32>().unwrap());
    for i in 0..b {
        for j in 0..h {
            for p in 0..t {
                for e in 0..d {
                    let at = ((i * h + j) * t + p) * d + e;
                    let want = if p == pos[i] { n[(i * h + j) * d + e] } else { c[at] };
                    assert_eq!(w[at], want, "[{i}, {j}, {p}, {e}]");
                }
            }
        }
    }
    // Attention over positions 0..=pos[i] equals the causal attention's last row over that
    // prefix alone.
    let values = Tensor::randn([b, h, t, d], DType::F32, &device);
    let q = Tensor::randn([b, h, 1, d], DType::F32, &device);
    let y = cached_attention(&q, &written, &values, &pos_t).to_vec::<f32>().unwrap();
    for (i, &p) in pos.iter().enumerate() {
        let prefix = |x: &Tensor| x.narrow(0, i, 1).narrow(2, 0, p + 1);
        let want = q.narrow(0, i, 1).scaled_dot_product_attention(&prefix(&written), &prefix(&values), false);
        close(&y[i * h * d..(i + 1) * h * d], &want.to_vec::<f32>().unwrap(), 1e-5, &format!("sequence {i}"));
    }
}

#[test]
fn sampling_draws_from_the_softmax_of_the_kept_logits() {
    let device = braid::testing::test_device();
    device.seed(9);
    // One row of logits, repeated: every row is an independent draw.
    let row = [0.5f32, 2.0, -1.0, 1.5, 0.0, 2.5, -3.0, 1.0];
    let (rows, v) = (4000, row.len());
    let logits = Tensor::from_vec(row.repeat(rows), [rows, v], &device);
    let greedy = sample(&logits, Sampling::Greedy, None).to_vec::<i32>().unwrap();
    assert!(greedy.iter().all(|&t| t == 5), "greedy picks the largest logit");
    let softmax = |kept: &[usize], temp: f32| -> Vec<f64> {
        let z: f64 = kept.iter().map(|&i| ((row[i] / temp) as f64).exp()).sum();
        (0..v).map(|i| if kept.contains(&i) { ((row[i] / temp) as f64).exp() / z } else { 0.0 }).collect()
    };
    let cases = [
        (Sampling::Temperature(1.0), softmax(&(0..v).collect::<Vec<_>>(), 1.0)),
        (Sampling::Temperature(0.5), softmax(&(0..v).collect::<Vec<_>>(), 0.5)),
        (Sampling::TopK { k: 3, temperature: 1.0 }, softmax(&[5, 1, 3], 1.0)),
        (Sampling::TopK { k: 1, temperature: 2.0 }, softmax(&[5], 2.0)),
    ];
    for (how, want) in cases {
        let u = Tensor::rand([rows, v], 0.0, 1.0, DType::F32, &device);
        let drawn = sample(&logits, how, Some(&u)).to_vec::<i32>().unwrap();
        let mut freq = vec![0f64; v];
        for &t in &drawn {
            freq[t as usize] += 1.0 / rows as f64;
        }
        for i in 0..v {
            // Five standard deviations of a frequency of `rows` draws; none outside the kept.
            let sd = (want[i] * (1.0 - want[i]) / rows as f64).sqrt();
            assert!(
                (freq[i] - want[i]).abs() <= 5.0 * sd + 1e-9,
                "{how:?}: token {i} drawn {} of the time, not {}",
                freq[i],
                want[i]
            );
        }
    }
    // Top-k over rows of different values: each row keeps its own k largest.
    let k = 4;
    let data: Vec<f32> = (0..64 * 50).map(|i| ((i * 7919 % 1009) as f32 - 500.0) / 37.0).collect();
    let logits = Tensor::from_vec(data.clone(), [64, 50], &device);
    let u = Tensor::rand([64, 50], 0.0, 1.0, DType::F32, &device);
    let drawn = sample(&logits, Sampling::TopK { k, temperature: 1.0 }, Some(&u)).to_vec::<i32>().unwrap();
    for (r, &t) in drawn.iter().enumerate() {
        let row = &data[r * 50..(r + 1) * 50];
        let above = row.iter().filter(|&&x| x > row[t as usize]).count();
        assert!(above < k, "row {r}: token {t} has {above} larger logits");
    }
}

#[test]
fn generation_misuse_is_reported_at_the_callers_line() {
    let device = braid::testing::test_device();
    let logits = Tensor::zeros([2, 5], DType::F32, &device);
    let message = |f: &dyn Fn()| {
        let e = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).expect_err("misuse panics");
        e.downcast_ref::<String>().cloned().unwrap_or_default()
    };
    let m = message(&|| drop(sample(&logits, Sampling::Temperature(1.0), None)));
    assert!(m.contains("uniform") && m.contains("tests/generate.rs"), "{m}");
    let u = Tensor::zeros([2, 5], DType::F32, &device);
    let m = message(&|| drop(sample(&logits, Sampling::TopK { k: 0, temperature: 1.0 }, Some(&u))));
    assert!(m.contains("k = 0") && m.contains("tests/generate.rs"), "{m}");
    let m = message(&|| drop(sample(&logits, Sampling::Temperature(0.0), Some(&u))));
    assert!(m.contains("temperature"), "{m}");
    let cache = Tensor::zeros([2, 1, 4, 3], DType::F32, &device);
    let pos = CachePositions::new(&Tensor::from_vec(vec![0i32, 1, 2], [3], &device), 4);
    let m = message(&|| drop(cache_write(&cache, &Tensor::zeros([2, 1, 1, 3], DType::F32, &device), &pos)));
    assert!(m.contains("cache_write") && m.contains("tests/generate.rs"), "{m}");
    let m = message(&|| cache_update(&cache, &Tensor::zeros([3, 1, 2, 3], DType::F32, &device), &pos));
    assert!(m.contains("cache_update") && m.contains("tests/generate.rs"), "{m}");
    let m = message(&|| drop(CachePositions::new(&Tensor::zeros([3], DType::F32, &device), 4)));
    assert!(m.contains("CachePositions::new") && m.contains("tests/generate.rs"), "{m}");
    // Decoding past the caches' last position is refused, not written nowhere.
    let model = Gpt2::new(CFG, &device, 2);
    let mut g = Generation::new(&model, &prompts(), 10, Sampling::Greedy, None, true);
    g.next().unwrap();
    let full = std::sync::Mutex::new(g);
    let m = message(&|| drop(full.lock().unwrap_or_else(|p| p.into_inner()).next()));
    assert!(m.contains("hold 10 positions"), "{m}");
}

#[test]
fn a_quantized_decode_step_runs_as_many_kernels_as_a_bf16_one() {
    // The quantized products take their bias adds as epilogues, as the bf16 products do: no
    // cast or copy of a bias a step (`to_dtype` of a bias already bf16 was one kernel each).
    let device = braid::testing::test_device();
    let model = Gpt2::new(CFG, &device, 1);
    let kernels = |m: &Gpt2| {
        let mut g = Generation::new(m, &prompts(), 16, Sampling::Greedy, Some(DType::BF16), true);
        g.next().unwrap();
        g.kernels_per_token().expect("captured")
    };
    let bf16 = kernels(&model.with_matrices_in(DType::BF16));
    for scheme in [braid::quant::Scheme::Int8, braid::quant::Scheme::Int4 { group: 32 }] {
        assert_eq!(kernels(&model.quantized(scheme, DType::BF16)), bf16, "{scheme:?}");
    }
}
