//! A decoder-only transformer small enough to train on the CPU one sample at a time (BENCH.md
//! C5): 6 layers, 6 heads, context 8, d_model 24, vocabulary 65, 46,337 parameters, laid out
//! like Karpathy's `gpt.py` (key/query/value without bias, ReLU feed-forward, pre-norm,
//! learned positions). Shared by `examples/mini_gpt.rs` and the bench card.

use braid::prelude::*;

pub const VOCAB: usize = 65;
pub const CONTEXT: usize = 8;
pub const D_MODEL: usize = 24;
pub const HEADS: usize = 6;
pub const LAYERS: usize = 6;

struct Layer {
    ln1: (Tensor, Tensor),
    query: Tensor,
    key: Tensor,
    value: Tensor,
    proj: (Tensor, Tensor),
    ln2: (Tensor, Tensor),
    ff1: (Tensor, Tensor),
    ff2: (Tensor, Tensor),
}

pub struct MiniGpt {
    token_embedding: Tensor,
    position_embedding: Tensor,
    layers: Vec<Layer>,
    ln_final: (Tensor, Tensor),
    head: (Tensor, Tensor),
    /// `-1e9` above the diagonal: position `i` attends to `0..=i`.
    causal_mask: Tensor,
    device: Device,
}

impl MiniGpt {
    /// Weights ~ N(0, 0.02), biases 0, layer-norm gains 1 (as nanoGPT initialises).
    pub fn new(device: &Device, seed: u64) -> MiniGpt {
        device.seed(seed);
        let weight =
            |dims: &[usize]| braid::no_grad(|| Tensor::randn(dims.to_vec(), DType::F32, device) * 0.02).requires_grad();
        let zeros = |n: usize| Tensor::zeros([n], DType::F32, device).requires_grad();
        let ones = |n: usize| Tensor::ones([n], DType::F32, device).requires_grad();
        let linear = |i: usize, o: usize| (weight(&[i, o]), zeros(o));
        let layers = (0..LAYERS)
            .map(|_| Layer {
                ln1: (ones(D_MODEL), zeros(D_MODEL)),
                query: weight(&[D_MODEL, D_MODEL]),
                key: weight(&[D_MODEL, D_MODEL]),
                value: weight(&[D_MODEL, D_MODEL]),
                proj: linear(D_MODEL, D_MODEL),
                ln2: (ones(D_MODEL), zeros(D_MODEL)),
                ff1: linear(D_MODEL, 4 * D_MODEL),
                ff2: linear(4 * D_MODEL, D_MODEL),
            })
            .collect();
        let mask: Vec<f32> =
            (0..CONTEXT * CONTEXT).map(|i| if i % CONTEXT > i / CONTEXT { -1e9 } else { 0.0 }).collect();
        MiniGpt {
            token_embedding: weight(&[VOCAB, D_MODEL]),
            position_embedding: weight(&[CONTEXT, D_MODEL]),
            layers,
            ln_final: (ones(D_MODEL), zeros(D_MODEL)),
            head: linear(D_MODEL, VOCAB),
            causal_mask: Tensor::from_vec(mask, [CONTEXT, CONTEXT], device),
            device: device.clone(),
        }
    }

    /// Every parameter (for the optimizer).
    pub fn parameters(&self) -> Vec<Tensor> {
        let mut p = vec![self.token_embedding.clone(), self.position_embedding.clone()];
        for l in &self.layers {
            for t in [&l.ln1.0, &l.ln1.1, &l.query, &l.key, &l.value, &l.proj.0, &l.proj.1, &l.ln2.0, &l.ln2.1] {
                p.push(t.clone());
            }
            for t in [&l.ff1.0, &l.ff1.1, &l.ff2.0, &l.ff2.1] {
                p.push(t.clone());
            }
        }
        p.extend([self.ln_final.0.clone(), self.ln_final.1.clone(), self.head.0.clone(), self.head.1.clone()]);
        p
    }

    /// One-hot rows for token ids (the embedding lookup is a product with this).
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

    /// The mean loss over a batch of sequences, concatenated (`CONTEXT` tokens each).
    pub fn batch_loss(&self, tokens: &[usize], targets: &[usize]) -> Tensor {
        assert!(tokens.len() == targets.len() && tokens.len().is_multiple_of(CONTEXT) && !tokens.is_empty());
        let (b, t) = (tokens.len() / CONTEXT, CONTEXT);
        let head_size = D_MODEL / HEADS;
        let norm = |x: &Tensor, (g, bias): &(Tensor, Tensor)| &(&x.layer_norm(1, 1e-5) * g) + bias;
        // [b * t, d] -> [b, heads, t, head_size]
        let heads = |x: &Tensor| x.reshape([b, t, HEADS, head_size]).permute(&[0, 2, 1, 3]);
        let positions = self.position_embedding.expand([b, t, D_MODEL]).reshape([b * t, D_MODEL]);
        let mut x = &self.one_hot(tokens).matmul(&self.token_embedding) + &positions;
        for l in &self.layers {
            let h = norm(&x, &l.ln1);
            let (q, k, v) = (heads(&h.matmul(&l.query)), heads(&h.matmul(&l.key)), heads(&h.matmul(&l.value)));
            let scores = &(&q.matmul(&k.transpose(2, 3)) * (1.0 / (head_size as f64).sqrt())) + &self.causal_mask;
            let attended = scores.softmax(3).matmul(&v).permute(&[0, 2, 1, 3]).reshape([b * t, D_MODEL]);
            x = &x + &(&attended.matmul(&l.proj.0) + &l.proj.1);
            let h = norm(&x, &l.ln2);
            let ff = (&h.matmul(&l.ff1.0) + &l.ff1.1).relu();
            x = &x + &(&ff.matmul(&l.ff2.0) + &l.ff2.1);
        }
        let logits = &norm(&x, &self.ln_final).matmul(&self.head.0) + &self.head.1;
        let picked = &self.one_hot(targets) * &logits.log_softmax(1);
        picked.sum() * (-1.0 / (b * t) as f64)
    }
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
