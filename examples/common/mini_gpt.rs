//! A decoder-only transformer small enough to train on the CPU one sample at a time (BENCH.md
//! C5): 6 layers, 6 heads, context 8, d_model 24, vocabulary 65, 46,337 parameters, laid out
//! like Karpathy's `gpt.py` (key/query/value without bias, ReLU feed-forward, pre-norm,
//! learned positions), written with `braid::nn` layers (`Linear`, `LayerNorm`, an `Embedding`
//! table, `Params`). Shared by `examples/mini_gpt.rs` and the bench card.

use braid::nn::{Embedding, LayerNorm, Linear, Module, Params, init};
use braid::prelude::*;

pub const VOCAB: usize = 65;
pub const CONTEXT: usize = 8;
pub const D_MODEL: usize = 24;
pub const HEADS: usize = 6;
pub const LAYERS: usize = 6;

struct Layer {
    ln1: LayerNorm,
    query: Linear,
    key: Linear,
    value: Linear,
    proj: Linear,
    ln2: LayerNorm,
    ff1: Linear,
    ff2: Linear,
}

pub struct MiniGpt {
    token_embedding: Embedding,
    position_embedding: Tensor,
    layers: Vec<Layer>,
    ln_final: LayerNorm,
    head: Linear,
    /// `-1e9` above the diagonal: position `i` attends to `0..=i`.
    causal_mask: Tensor,
    device: Device,
}

impl MiniGpt {
    /// Weights ~ N(0, 0.02), biases 0, layer-norm gains 1 (as nanoGPT initialises).
    pub fn new(device: &Device, seed: u64) -> MiniGpt {
        device.seed(seed);
        let weight = |dims: [usize; 2]| init::normal(dims, 0.0, 0.02, DType::F32, device);
        let linear = |i: usize, o: usize, bias: bool| Linear {
            weight: weight([o, i]),
            bias: bias.then(|| init::zeros([o], DType::F32, device)),
        };
        let layers = (0..LAYERS)
            .map(|_| Layer {
                ln1: LayerNorm::new(D_MODEL, device),
                query: linear(D_MODEL, D_MODEL, false),
                key: linear(D_MODEL, D_MODEL, false),
                value: linear(D_MODEL, D_MODEL, false),
                proj: linear(D_MODEL, D_MODEL, true),
                ln2: LayerNorm::new(D_MODEL, device),
                ff1: linear(D_MODEL, 4 * D_MODEL, true),
                ff2: linear(4 * D_MODEL, D_MODEL, true),
            })
            .collect();
        let mask: Vec<f32> =
            (0..CONTEXT * CONTEXT).map(|i| if i % CONTEXT > i / CONTEXT { -1e9 } else { 0.0 }).collect();
        MiniGpt {
            token_embedding: Embedding { weight: weight([VOCAB, D_MODEL]) },
            position_embedding: weight([CONTEXT, D_MODEL]),
            layers,
            ln_final: LayerNorm::new(D_MODEL, device),
            head: linear(D_MODEL, VOCAB, true),
            causal_mask: Tensor::from_vec(mask, [CONTEXT, CONTEXT], device),
            device: device.clone(),
        }
    }

    /// Every parameter, named as PyTorch's module tree would name it.
    pub fn params(&self) -> Params {
        let mut p = Params::new();
        p.extend("token_embedding", self.token_embedding.params());
        p.push("position_embedding", &self.position_embedding);
        for (i, l) in self.layers.iter().enumerate() {
            let parts: [(&str, &dyn Module); 8] = [
                ("ln1", &l.ln1),
                ("query", &l.query),
                ("key", &l.key),
                ("value", &l.value),
                ("proj", &l.proj),
                ("ln2", &l.ln2),
                ("ff1", &l.ff1),
                ("ff2", &l.ff2),
            ];
            for (name, m) in parts {
                p.extend(&format!("layers.{i}.{name}"), m.params());
            }
        }
        p.extend("ln_final", self.ln_final.params());
        p.extend("head", self.head.params());
        p
    }

    /// One-hot rows for token ids. The lookup and the loss are products with these rather than
    /// `Embedding::forward` and `cross_entropy`: at this size (8 tokens, 65 characters) an
    /// uploaded one-hot matrix costs no kernel, where the composites add kernels of their own
    /// (when lookups were one-hot reductions, 4 a step: C5 about 0.2 ms slower).
    fn one_hot(&self, ids: &[usize]) -> Tensor {
        let mut v = vec![0.0f32; ids.len() * VOCAB];
        for (i, &t) in ids.iter().enumerate() {
            v[i * VOCAB + t] = 1.0;
        }
        Tensor::from_vec(v, [ids.len(), VOCAB], &self.device)
    }

    /// Mean cross-entropy of predicting `targets[i]` after `tokens[..=i]` (both `CONTEXT` long).
    pub fn loss(&self, tokens: &[usize], targets: &[usize]) -> Tensor {
        assert_eq!((tokens.len(), targets.len()), (CONTEXT, CONTEXT));
        self.batch_loss(tokens, targets)
    }

    /// The arguments of [`sgd_step`] for `params` (in [`params`](Self::params)' order) and a
    /// window of `tokens` and their `targets`.
    #[allow(dead_code)] // used by the bench card and tests/step.rs, not by the example
    pub fn step_args(&self, params: &[Tensor], tokens: &[usize], targets: &[usize]) -> Vec<Tensor> {
        let mut args = params.to_vec();
        args.extend([self.causal_mask.clone(), self.one_hot(tokens), self.one_hot(targets)]);
        args
    }

    /// The same model over `tensors` (in [`params`](Self::params)' order) with the causal mask
    /// `mask`: how a captured `braid::Step` builds the model from its arguments.
    #[allow(dead_code)] // used by `sgd_step`, not by the example
    pub fn from_tensors(tensors: &[Tensor], mask: &Tensor) -> MiniGpt {
        let mut next = tensors.iter().cloned();
        let mut take = || next.next().expect("as many tensors as the model has parameters");
        let token_embedding = Embedding { weight: take() };
        let position_embedding = take();
        let norm = |take: &mut dyn FnMut() -> Tensor| LayerNorm { weight: take(), bias: take(), eps: 1e-5 };
        let linear = |take: &mut dyn FnMut() -> Tensor, bias: bool| Linear { weight: take(), bias: bias.then(take) };
        let layers = (0..LAYERS)
            .map(|_| Layer {
                ln1: norm(&mut take),
                query: linear(&mut take, false),
                key: linear(&mut take, false),
                value: linear(&mut take, false),
                proj: linear(&mut take, true),
                ln2: norm(&mut take),
                ff1: linear(&mut take, true),
                ff2: linear(&mut take, true),
            })
            .collect();
        let ln_final = norm(&mut take);
        let head = linear(&mut take, true);
        let device = mask.device().clone();
        MiniGpt { token_embedding, position_embedding, layers, ln_final, head, causal_mask: mask.clone(), device }
    }

    /// The mean loss over a batch of sequences, concatenated (`CONTEXT` tokens each).
    pub fn batch_loss(&self, tokens: &[usize], targets: &[usize]) -> Tensor {
        assert!(tokens.len() == targets.len() && tokens.len().is_multiple_of(CONTEXT) && !tokens.is_empty());
        self.loss_of_one_hot(&self.one_hot(tokens), &self.one_hot(targets))
    }

    /// The mean loss over a batch given as one-hot rows of its tokens and targets (`[b * CONTEXT,
    /// VOCAB]` each).
    pub fn loss_of_one_hot(&self, tokens: &Tensor, targets: &Tensor) -> Tensor {
        let (b, t) = (tokens.shape().dims()[0] / CONTEXT, CONTEXT);
        let head_size = D_MODEL / HEADS;
        // [b * t, d] -> [b, heads, t, head_size]
        let heads = |x: &Tensor| x.reshape([b, t, HEADS, head_size]).permute(&[0, 2, 1, 3]);
        let positions = self.position_embedding.expand([b, t, D_MODEL]).reshape([b * t, D_MODEL]);
        let mut x = &tokens.matmul(&self.token_embedding.weight) + &positions;
        for l in &self.layers {
            let h = l.ln1.forward(&x);
            let (q, k, v) = (heads(&l.query.forward(&h)), heads(&l.key.forward(&h)), heads(&l.value.forward(&h)));
            let scores = &(&q.matmul(&k.transpose(2, 3)) * (1.0 / (head_size as f64).sqrt())) + &self.causal_mask;
            let attended = scores.softmax(3).matmul(&v).permute(&[0, 2, 1, 3]).reshape([b * t, D_MODEL]);
            x = &x + &l.proj.forward(&attended);
            let ff = l.ff1.forward(&l.ln2.forward(&x)).relu();
            x = &x + &l.ff2.forward(&ff);
        }
        let logits = self.head.forward(&self.ln_final.forward(&x));
        let picked = targets * &logits.log_softmax(1);
        picked.sum() * (-1.0 / (b * t) as f64)
    }
}

/// One SGD step as a function of its arguments, to capture in a `braid::Step` (the counterpart of
/// a `jax.jit`-compiled step): `args` are the `n` parameters, the causal mask and one-hot tokens
/// and targets ([`MiniGpt::step_args`]); returns the loss and every parameter updated to
/// `p - lr * grad`, which the next call takes.
#[allow(dead_code)] // used by the bench card and tests/step.rs, not by the example
pub fn sgd_step(args: &[Tensor], n: usize, lr: f64) -> Vec<Tensor> {
    let params: Vec<Tensor> = args[..n].iter().map(|p| p.detach().requires_grad()).collect();
    let model = MiniGpt::from_tensors(&params, &args[n]);
    let loss = model.loss_of_one_hot(&args[n + 1], &args[n + 2]);
    let grads = loss.backward().expect("the loss has gradients");
    let updated: Vec<Tensor> =
        braid::no_grad(|| params.iter().map(|p| p - &(grads.get(p).expect("a gradient per parameter") * lr)).collect());
    std::iter::once(loss.detach()).chain(updated).collect()
}

/// Text to learn from (public domain: the opening of Shakespeare's sonnet 18 and of Hamlet's
/// soliloquy), and its characters as token ids.
pub const TEXT: &str = "Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n\
Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n\
To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n\
The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n";

/// The text as token ids (each distinct character gets one, in order of first use).
pub fn tokens() -> Vec<usize> {
    let mut vocab: Vec<char> = Vec::new();
    TEXT.chars()
        .map(|c| match vocab.iter().position(|&v| v == c) {
            Some(i) => i,
            None => {
                vocab.push(c);
                assert!(vocab.len() <= VOCAB, "the text has more than {VOCAB} distinct characters");
                vocab.len() - 1
            }
        })
        .collect()
}
