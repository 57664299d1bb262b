//! A character-level language model over a bundled text (the opening of *Alice's Adventures
//! in Wonderland*, public domain), shared by `examples/char_lm.rs` and `tests/nn.rs`.
//!
//! The model reads the previous `context` characters: an `Embedding` per character, the
//! vectors concatenated, a `Linear` layer, `LayerNorm`, GELU and a `Linear` layer to one logit
//! per character of the vocabulary, trained with `cross_entropy` and AdamW on random windows
//! of the text. Everything it uses is public API.

use braid::nn::{Embedding, LayerNorm, Linear, Module, Params};
use braid::optim::{AdamW, Optimizer};
use braid::prelude::*;

/// The training text, embedded so that the example runs from any directory.
pub const TEXT: &str = include_str!("../data/alice.txt");

/// The text as character ids (its distinct characters, sorted).
pub struct Corpus {
    pub chars: Vec<char>,
    pub ids: Vec<i64>,
}

impl Corpus {
    pub fn new(text: &str) -> Corpus {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        let ids = text.chars().map(|c| chars.binary_search(&c).expect("a character of the text") as i64).collect();
        Corpus { chars, ids }
    }

    pub fn vocabulary(&self) -> usize {
        self.chars.len()
    }

    /// `batch` random windows: the ids of `context` characters (`[batch, context]`, row-major)
    /// and of the character after each window.
    pub fn batch(&self, rng: &mut Rng, batch: usize, context: usize) -> (Vec<i64>, Vec<i64>) {
        let (mut x, mut y) = (Vec::with_capacity(batch * context), Vec::with_capacity(batch));
        for _ in 0..batch {
            let at = rng.below(self.ids.len() - context);
            x.extend_from_slice(&self.ids[at..at + context]);
            y.push(self.ids[at + context]);
        }
        (x, y)
    }
}

/// Character ids as a tensor on `device`: i64, or i32 on a device without i64 (wgpu). Every
/// indexing op (`embedding`, `cross_entropy`) takes either.
pub fn ids_tensor(ids: Vec<i64>, shape: impl Into<Shape>, device: &Device) -> Tensor {
    if device.target().dtypes.contains(DType::I64) {
        Tensor::from_vec(ids, shape, device)
    } else {
        Tensor::from_vec(ids.into_iter().map(|i| i as i32).collect::<Vec<i32>>(), shape, device)
    }
}

/// A small deterministic generator (xorshift64*) for windows and sampling.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform on `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Sizes and training settings.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub context: usize,
    pub features: usize,
    pub hidden: usize,
    pub batch: usize,
    pub steps: usize,
    pub lr: f64,
}

impl Config {
    /// The example's settings (about 34,000 parameters).
    pub const EXAMPLE: Config = Config { context: 12, features: 16, hidden: 128, batch: 32, steps: 2500, lr: 3e-3 };
}

pub struct CharLm {
    pub context: usize,
    pub embed: Embedding,
    pub hidden: Linear,
    pub norm: LayerNorm,
    pub out: Linear,
}

impl CharLm {
    /// A model drawn from `device`'s current seed.
    pub fn new(vocabulary: usize, cfg: &Config, device: &Device) -> CharLm {
        CharLm {
            context: cfg.context,
            embed: Embedding::new(vocabulary, cfg.features, device),
            hidden: Linear::new(cfg.context * cfg.features, cfg.hidden, device),
            norm: LayerNorm::new(cfg.hidden, device),
            out: Linear::new(cfg.hidden, vocabulary, device),
        }
    }

    /// Logits `[batch, vocabulary]` for windows of ids `[batch, context]`.
    pub fn logits(&self, ids: &Tensor) -> Tensor {
        let batch = ids.dims()[0];
        let x = self.embed.forward(ids).reshape([batch, self.context * self.embed.weight.dims()[1]]);
        let h = self.norm.forward(&self.hidden.forward(&x)).gelu();
        self.out.forward(&h)
    }

    /// Mean cross-entropy of the next characters.
    pub fn loss(&self, ids: &Tensor, next: &Tensor) -> Tensor {
        self.logits(ids).cross_entropy(next)
    }

    pub fn params(&self) -> Params {
        let mut p = Params::new();
        p.extend("embed", self.embed.params());
        p.extend("hidden", self.hidden.params());
        p.extend("norm", self.norm.params());
        p.extend("out", self.out.params());
        p
    }
}

/// Trains a model drawn from seed 0 for `cfg.steps` AdamW steps; `report(step, loss)` sees
/// every step's training loss.
pub fn train(corpus: &Corpus, cfg: &Config, device: &Device, mut report: impl FnMut(usize, f32)) -> Result<CharLm> {
    device.seed(0);
    let model = CharLm::new(corpus.vocabulary(), cfg, device);
    let params = model.params();
    let mut opt = AdamW::new(cfg.lr);
    let mut rng = Rng::new(1);
    for step in 0..cfg.steps {
        let (x, y) = corpus.batch(&mut rng, cfg.batch, cfg.context);
        let loss = model.loss(&ids_tensor(x, [cfg.batch, cfg.context], device), &ids_tensor(y, [cfg.batch], device));
        let grads = loss.backward()?;
        opt.update(&params, &grads);
        report(step, loss.item::<f32>()?);
    }
    Ok(model)
}

/// The loss on 512 fixed windows (the same for every call).
pub fn eval_loss(model: &CharLm, corpus: &Corpus, device: &Device) -> Result<f32> {
    let (x, y) = corpus.batch(&mut Rng::new(12345), 512, model.context);
    braid::no_grad(|| {
        model.loss(&ids_tensor(x, [512, model.context], device), &ids_tensor(y, [512], device)).item::<f32>()
    })
}

/// `length` characters sampled after `prompt` at temperature 0.8 (softmax on the host).
pub fn sample(model: &CharLm, corpus: &Corpus, device: &Device, prompt: &str, length: usize) -> Result<String> {
    let space = corpus.chars.binary_search(&' ').map_or(0, |i| i as i64);
    let mut ids: Vec<i64> = vec![space; model.context];
    ids.extend(prompt.chars().filter_map(|c| corpus.chars.binary_search(&c).ok().map(|i| i as i64)));
    let mut rng = Rng::new(7);
    let mut out = String::from(prompt);
    for _ in 0..length {
        let window = ids[ids.len() - model.context..].to_vec();
        let logits = braid::no_grad(|| model.logits(&ids_tensor(window, [1, model.context], device)));
        let logits = logits.to_vec::<f32>()?;
        let top = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let weights: Vec<f64> = logits.iter().map(|&l| (((l - top) / 0.8) as f64).exp()).collect();
        let mut pick = rng.unit() * weights.iter().sum::<f64>();
        let mut next = weights.len() - 1;
        for (i, w) in weights.iter().enumerate() {
            if pick < *w {
                next = i;
                break;
            }
            pick -= w;
        }
        ids.push(next as i64);
        out.push(corpus.chars[next]);
    }
    Ok(out)
}
