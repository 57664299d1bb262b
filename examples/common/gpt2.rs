//! GPT-2 (Radford et al. 2019) on `braid`: learned token and position embeddings (the token
//! table tied to the output head), pre-norm blocks of causal self-attention (the fused
//! `scaled_dot_product_attention`) and a GELU feed-forward, a final layer norm. Parameters are
//! named and laid out as Hugging Face's `GPT2Model` stores them (`h.0.attn.c_attn.weight` is
//! `[width, 3 width]`: its `Conv1D` multiplies `x W`), so a downloaded `model.safetensors`
//! loads with `Params::load` and braid's weights load there. Shared by `examples/gpt2.rs` and
//! the benches.

use braid::nn::{LayerNorm, Module, Params, init};
use braid::prelude::*;

/// A model's shape.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub layers: usize,
    pub heads: usize,
    pub width: usize,
    pub context: usize,
    pub vocabulary: usize,
}

impl Config {
    /// GPT-2 small: 124M parameters.
    pub const GPT2_124M: Config = Config { layers: 12, heads: 12, width: 768, context: 1024, vocabulary: 50257 };
    /// A model small enough for a CPU in seconds (bytes as tokens).
    pub const SMALL: Config = Config { layers: 2, heads: 4, width: 64, context: 64, vocabulary: 256 };
}

/// The parameters of one block, in Hugging Face's layout.
struct Block {
    ln_1: LayerNorm,
    c_attn_weight: Tensor,
    c_attn_bias: Tensor,
    attn_proj_weight: Tensor,
    attn_proj_bias: Tensor,
    ln_2: LayerNorm,
    c_fc_weight: Tensor,
    c_fc_bias: Tensor,
    mlp_proj_weight: Tensor,
    mlp_proj_bias: Tensor,
}

pub struct Gpt2 {
    pub cfg: Config,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// The output head quantized (`wte` transposed, `[width, vocabulary]`), when serving with
    /// quantized weights; else the head is `wte` itself.
    lm_head: Option<Tensor>,
}

/// Hugging Face's `Conv1D`, `x W + b` with `W` `[in, out]`: PyTorch's `addmm`, so under
/// autocast the bias is added in the low precision and the result is low (then the residual
/// stream, f32, adds it in f32). A quantized `W` (`braid::quant`) is read by the quantized
/// product, dequantized in registers.
fn conv1d(x: &Tensor, weight: &Tensor, bias: &Tensor) -> Tensor {
    if weight.quant_layout().is_some() {
        let y = x.matmul(weight);
        return &y + &bias.as_dtype(y.dtype());
    }
    x.linear(&weight.t(), Some(bias))
}

/// The residual stream `x [rows, width]` through one block, attending with `attend`.
fn block(blk: &Block, x: Tensor, attend: impl FnOnce(&Tensor) -> Tensor) -> Tensor {
    let qkv = conv1d(&blk.ln_1.forward(&x), &blk.c_attn_weight, &blk.c_attn_bias);
    let y = attend(&qkv);
    let x = &x + &conv1d(&y, &blk.attn_proj_weight, &blk.attn_proj_bias);
    let hidden = conv1d(&blk.ln_2.forward(&x), &blk.c_fc_weight, &blk.c_fc_bias).gelu();
    &x + &conv1d(&hidden, &blk.mlp_proj_weight, &blk.mlp_proj_bias)
}

impl Gpt2 {
    /// GPT-2's initialisation: weights ~ N(0, 0.02), the projections back into the residual
    /// stream ~ N(0, 0.02 / sqrt(2 layers)), biases 0, layer-norm gains 1.
    pub fn new(cfg: Config, device: &Device, seed: u64) -> Gpt2 {
        device.seed(seed);
        let c = cfg.width;
        let normal = |dims: [usize; 2], std: f64| init::normal(dims, 0.0, std, DType::F32, device);
        let zeros = |n: usize| init::zeros([n], DType::F32, device);
        let residual = 0.02 / (2.0 * cfg.layers as f64).sqrt();
        let blocks = (0..cfg.layers)
            .map(|_| Block {
                ln_1: LayerNorm::new(c, device),
                c_attn_weight: normal([c, 3 * c], 0.02),
                c_attn_bias: zeros(3 * c),
                attn_proj_weight: normal([c, c], residual),
                attn_proj_bias: zeros(c),
                ln_2: LayerNorm::new(c, device),
                c_fc_weight: normal([c, 4 * c], 0.02),
                c_fc_bias: zeros(4 * c),
                mlp_proj_weight: normal([4 * c, c], residual),
                mlp_proj_bias: zeros(c),
            })
            .collect();
        Gpt2 {
            cfg,
            wte: normal([cfg.vocabulary, c], 0.02),
            wpe: normal([cfg.context, c], 0.01),
            blocks,
            ln_f: LayerNorm::new(c, device),
            lm_head: None,
        }
    }

    /// Every parameter under Hugging Face GPT-2's name (the tied head has none of its own).
    pub fn params(&self) -> Params {
        let mut p = Params::new();
        p.push("wte.weight", &self.wte);
        p.push("wpe.weight", &self.wpe);
        for (i, b) in self.blocks.iter().enumerate() {
            p.extend(&format!("h.{i}.ln_1"), b.ln_1.params());
            p.push(format!("h.{i}.attn.c_attn.weight"), &b.c_attn_weight);
            p.push(format!("h.{i}.attn.c_attn.bias"), &b.c_attn_bias);
            p.push(format!("h.{i}.attn.c_proj.weight"), &b.attn_proj_weight);
            p.push(format!("h.{i}.attn.c_proj.bias"), &b.attn_proj_bias);
            p.extend(&format!("h.{i}.ln_2"), b.ln_2.params());
            p.push(format!("h.{i}.mlp.c_fc.weight"), &b.c_fc_weight);
            p.push(format!("h.{i}.mlp.c_fc.bias"), &b.c_fc_bias);
            p.push(format!("h.{i}.mlp.c_proj.weight"), &b.mlp_proj_weight);
            p.push(format!("h.{i}.mlp.c_proj.bias"), &b.mlp_proj_bias);
        }
        p.extend("ln_f", self.ln_f.params());
        if let Some(head) = &self.lm_head {
            p.push("lm_head.weight", head);
        }
        p
    }

    /// Logits `[batch * seq, vocabulary]` for token ids `[batch, seq]` (i32 or i64).
    pub fn logits(&self, ids: &Tensor) -> Tensor {
        let (b, t) = (ids.dims()[0], ids.dims()[1]);
        let x = self.embed(ids);
        let x = self.blocks(x, |_, qkv| self.causal_attention(qkv, b, t));
        self.head(&x)
    }

    /// Token and position embeddings of `ids [batch, seq]`, as rows `[batch * seq, width]`.
    fn embed(&self, ids: &Tensor) -> Tensor {
        let (b, t) = (ids.dims()[0], ids.dims()[1]);
        assert!(t <= self.cfg.context, "a sequence of {t} tokens is longer than the context ({})", self.cfg.context);
        let positions = self.wpe.narrow(0, 0, t);
        (&ids.embedding(&self.wte) + &positions).reshape([b * t, self.cfg.width])
    }

    /// `[rows, width]` columns `at..at + width` of `qkv` as heads `[batch, heads, seq, head
    /// width]`, read where they lie.
    fn heads(&self, qkv: &Tensor, at: usize, b: usize, t: usize) -> Tensor {
        let (c, h) = (self.cfg.width, self.cfg.heads);
        qkv.narrow(1, at, c).reshape([b, t, h, c / h]).permute(&[0, 2, 1, 3])
    }

    /// Causal self-attention of `qkv [b t, 3 width]` (the fused kernel), as rows `[b t, width]`.
    fn causal_attention(&self, qkv: &Tensor, b: usize, t: usize) -> Tensor {
        let c = self.cfg.width;
        let (q, k, v) = (self.heads(qkv, 0, b, t), self.heads(qkv, c, b, t), self.heads(qkv, 2 * c, b, t));
        q.scaled_dot_product_attention(&k, &v, true).permute(&[0, 2, 1, 3]).reshape([b * t, c])
    }

    /// The residual stream `x [rows, width]` through every block, each attending with
    /// `attend(layer, qkv)` (`qkv [rows, 3 width]` -> `[rows, width]`).
    fn blocks(&self, mut x: Tensor, mut attend: impl FnMut(usize, &Tensor) -> Tensor) -> Tensor {
        for (l, blk) in self.blocks.iter().enumerate() {
            x = block(blk, x, |qkv| attend(l, qkv));
        }
        x
    }

    /// Logits of rows `x [rows, width]` of the residual stream.
    fn head(&self, x: &Tensor) -> Tensor {
        // The head tied to the embedding: a linear layer without bias over `wte` (as Hugging
        // Face's GPT-2 ties `lm_head.weight`), so the device may pad its rows in place.
        match &self.lm_head {
            Some(head) => self.ln_f.forward(x).matmul(head),
            None => self.ln_f.forward(x).linear(&self.wte, None),
        }
    }

    /// The mean cross-entropy of predicting `targets [batch, seq]` after each prefix of `ids`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Tensor {
        let n = targets.shape().numel();
        self.logits(ids).cross_entropy(&targets.reshape([n]))
    }
}

/// A batch of `batch` windows of `seq + 1` bytes of `text` starting at pseudo-random offsets
/// (step `step`): the ids `[batch, seq]` and the targets (the same windows shifted by one).
pub fn batch(text: &[u8], batch: usize, seq: usize, step: usize, device: &Device) -> (Tensor, Tensor) {
    let span = text.len() - seq - 1;
    let mut ids = Vec::with_capacity(batch * seq);
    let mut targets = Vec::with_capacity(batch * seq);
    for i in 0..batch {
        let at = ((step * batch + i) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) as usize % span;
        ids.extend(text[at..at + seq].iter().map(|&b| b as i32));
        targets.extend(text[at + 1..at + seq + 1].iter().map(|&b| b as i32));
    }
    (Tensor::from_vec(ids, [batch, seq], device), Tensor::from_vec(targets, [batch, seq], device))
}

impl Gpt2 {
    /// The model over `tensors` (in [`params`](Self::params)' order): how a captured
    /// `braid::Step` builds it from its arguments.
    pub fn from_tensors(cfg: Config, tensors: &[Tensor]) -> Gpt2 {
        let mut next = tensors.iter().cloned();
        let mut take = || next.next().expect("as many tensors as the model has parameters");
        let norm = |take: &mut dyn FnMut() -> Tensor| LayerNorm { weight: take(), bias: take(), eps: 1e-5 };
        let (wte, wpe) = (take(), take());
        let blocks = (0..cfg.layers)
            .map(|_| Block {
                ln_1: norm(&mut take),
                c_attn_weight: take(),
                c_attn_bias: take(),
                attn_proj_weight: take(),
                attn_proj_bias: take(),
                ln_2: norm(&mut take),
                c_fc_weight: take(),
                c_fc_bias: take(),
                mlp_proj_weight: take(),
                mlp_proj_bias: take(),
            })
            .collect();
        let ln_f = norm(&mut take);
        let lm_head = next.next();
        Gpt2 { cfg, wte, wpe, blocks, ln_f, lm_head }
    }
}

/// AdamW's settings for the training step (PyTorch's `AdamW` arithmetic, weight decay on every
/// parameter).
#[derive(Clone, Copy, Debug)]
pub struct AdamWConfig {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// The bias corrections of AdamW's step `t` (from 1) as a step argument: `[1 / (1 - beta1^t),
/// 1 / sqrt(1 - beta2^t)]`.
pub fn corrections(opt: &AdamWConfig, t: i32, device: &Device) -> Tensor {
    let c = [1.0 / (1.0 - opt.beta1.powi(t)), 1.0 / (1.0 - opt.beta2.powi(t)).sqrt()];
    Tensor::from_vec(c.map(|x| x as f32).to_vec(), [2], device)
}

/// One training step as a pure function of its arguments, for `braid::Step`: `args` are the
/// `n` parameters, their first and second moments (`n` each), the ids and targets, and the
/// bias corrections ([`corrections`]). Under `low`'s autocast: the loss, gradients clipped to
/// norm 1, AdamW. Returns the loss, then the new parameters and moments (the next call's
/// arguments).
pub fn train_step(cfg: Config, args: &[Tensor], low: Option<DType>, opt: &AdamWConfig) -> Vec<Tensor> {
    let n = (args.len() - 3) / 3;
    let params: Vec<Tensor> = args[..n].iter().map(|p| p.detach().requires_grad()).collect();
    let (ids, targets, corr) = (&args[3 * n], &args[3 * n + 1], &args[3 * n + 2]);
    let model = Gpt2::from_tensors(cfg, &params);
    let loss = match low {
        Some(low) => braid::amp::autocast(low, || model.loss(ids, targets)),
        None => model.loss(ids, targets),
    };
    let mut grads = loss.backward().expect("the loss has gradients");
    braid::optim::clip_grad_norm(&params, &mut grads, 1.0);
    let (c1, c2) = (corr.narrow(0, 0, 1), corr.narrow(0, 1, 1));
    let mut out = vec![loss.detach()];
    let (mut new_m, mut new_v) = (vec![], vec![]);
    braid::no_grad(|| {
        for (i, p) in params.iter().enumerate() {
            let g = grads.get(p).expect("a gradient per parameter");
            let m = &(&args[n + i] * opt.beta1) + &(&g * (1.0 - opt.beta1));
            let v = &(&args[2 * n + i] * opt.beta2) + &(&g.square() * (1.0 - opt.beta2));
            let decayed = p * (1.0 - opt.lr * opt.weight_decay);
            let denom = &(&v.sqrt() * &c2) + opt.eps;
            out.push(&decayed - &(&(&m * &c1) / &denom * opt.lr));
            new_m.push(m);
            new_v.push(v);
        }
    });
    out.extend(new_m);
    out.extend(new_v);
    out
}

/// One eager training step: the loss under `low`'s autocast, every gradient, clipping to norm 1
/// and `opt`'s update of `params`, all recorded; returns the loss (reading it runs the forward,
/// the next flush the rest).
pub fn eager_step(
    model: &Gpt2,
    params: &Params,
    opt: &mut braid::optim::AdamW,
    (ids, targets): (&Tensor, &Tensor),
    low: Option<DType>,
) -> Result<Tensor> {
    use braid::optim::Optimizer;
    let loss = match low {
        Some(low) => braid::amp::autocast(low, || model.loss(ids, targets)),
        None => model.loss(ids, targets),
    };
    let mut grads = loss.backward()?;
    braid::optim::clip_grad_norm(params, &mut grads, 1.0);
    opt.update(params, &grads);
    Ok(loss)
}

type StepFn = Box<dyn Fn(&[Tensor]) -> Vec<Tensor>>;

/// The training step ([`train_step`]) captured as a `braid::Step`, with its state: the
/// parameters and both moments, which each call takes and returns.
pub struct CapturedTraining {
    step: braid::Step<StepFn>,
    state: Vec<Tensor>,
    adamw: AdamWConfig,
    steps: i32,
}

impl CapturedTraining {
    /// From the parameters' current values, with moments of zeros.
    pub fn new(cfg: Config, params: &Params, low: Option<DType>, adamw: AdamWConfig) -> CapturedTraining {
        let f: StepFn = Box::new(move |a: &[Tensor]| train_step(cfg, a, low, &adamw));
        let zeros =
            || params.iter().map(|p| Tensor::zeros(p.dims().to_vec(), DType::F32, p.device())).collect::<Vec<_>>();
        let state = params.iter().cloned().chain(zeros()).chain(zeros()).collect();
        CapturedTraining { step: braid::Step::new(f), state, adamw, steps: 0 }
    }

    /// One step on a batch; returns its loss.
    pub fn step(&mut self, ids: Tensor, targets: Tensor) -> Result<Tensor> {
        self.steps += 1;
        let device = ids.device().clone();
        let mut args = self.state.clone();
        args.extend([ids, targets, corrections(&self.adamw, self.steps, &device)]);
        let mut out = self.step.call(&args)?;
        self.state = out.split_off(1);
        Ok(out.remove(0))
    }

    /// The parameters' latest values (in [`Gpt2::params`]' order).
    #[allow(dead_code)] // the example saves them; the bench does not
    pub fn params(&self) -> &[Tensor] {
        &self.state[..self.state.len() / 3]
    }
}

/// Serving: what generation adds to the model (not every program that includes this file
/// generates).
#[allow(dead_code)]
impl Gpt2 {
    /// Prefill for generation: runs prompts `ids [batch, seq]` (padded on the right; sequence
    /// `i` is `lengths[i]` tokens, at least 1) with the fused causal attention. Returns the
    /// logits after each prompt's last token (`[batch, vocabulary]`) and every layer's keys and
    /// values as a static cache of `cache_len` positions (`[batch, heads, cache_len, head
    /// width]`, layer by layer, keys then values; positions from a prompt's length on hold
    /// padding, which decoding overwrites or masks).
    pub fn prefill(&self, ids: &Tensor, lengths: &[usize], cache_len: usize) -> (Tensor, Vec<Tensor>) {
        let (b, t) = (ids.dims()[0], ids.dims()[1]);
        assert!(lengths.len() == b && lengths.iter().all(|&l| 1 <= l && l <= t), "lengths {lengths:?} of [{b}, {t}]");
        assert!(t <= cache_len && cache_len <= self.cfg.context, "a cache of {cache_len} for prompts of {t}");
        let c = self.cfg.width;
        let mut caches = Vec::with_capacity(2 * self.cfg.layers);
        let x = self.blocks(self.embed(ids), |_, qkv| {
            for at in [c, 2 * c] {
                let heads = self.heads(qkv, at, b, t);
                let pad = [b, self.cfg.heads, cache_len - t, c / self.cfg.heads];
                caches.push(Tensor::cat(&[&heads, &Tensor::zeros(pad, heads.dtype(), heads.device())], 2));
            }
            self.causal_attention(qkv, b, t)
        });
        let last: Vec<i32> = lengths.iter().enumerate().map(|(i, &l)| (i * t + l - 1) as i32).collect();
        let last = Tensor::from_vec(last, [b], ids.device());
        (self.head(&x.index_select(0, &last)), caches)
    }

    /// One decode step: the logits `[batch, vocabulary]` after token `tokens [batch, 1]` at
    /// positions `pos [batch]` (I32 or I64) of each sequence, attending over the static caches
    /// ([`prefill`](Self::prefill)'s layout), whose new keys and values are written at `pos` in
    /// place (`cache_update`: one row a sequence and head).
    pub fn decode(&self, tokens: &Tensor, pos: &Tensor, caches: &[Tensor]) -> Tensor {
        use braid::nn::generate::{CachePositions, cache_update, cached_attention};
        let b = tokens.dims()[0];
        let (c, h) = (self.cfg.width, self.cfg.heads);
        let x = (&tokens.embedding(&self.wte) + &pos.reshape([b, 1]).embedding(&self.wpe)).reshape([b, c]);
        let at = CachePositions::new(pos, caches[0].dims()[2]);
        let x = self.blocks(x, |l, qkv| {
            let heads = |at: usize| qkv.narrow(1, at, c).reshape([b, h, 1, c / h]);
            let (keys, values) = (&caches[2 * l], &caches[2 * l + 1]);
            cache_update(keys, &heads(c), &at);
            cache_update(values, &heads(2 * c), &at);
            cached_attention(&heads(0), keys, values, &at).reshape([b, c])
        });
        self.head(&x)
    }

    /// The model for serving with weight-only quantized products (`braid::quant`): the four
    /// matrices of every block and the output head (`wte` transposed) quantized with `scheme`
    /// from their f32 values, the embeddings and biases in `dtype` (bf16 for serving), the layer
    /// norms as they are.
    pub fn quantized(&self, scheme: braid::quant::Scheme, dtype: DType) -> Gpt2 {
        let q = |w: &Tensor| w.as_dtype(DType::F32).quantize(scheme);
        let blocks = (self.blocks.iter())
            .map(|b| Block {
                ln_1: b.ln_1.clone(),
                c_attn_weight: q(&b.c_attn_weight),
                c_attn_bias: b.c_attn_bias.as_dtype(dtype),
                attn_proj_weight: q(&b.attn_proj_weight),
                attn_proj_bias: b.attn_proj_bias.as_dtype(dtype),
                ln_2: b.ln_2.clone(),
                c_fc_weight: q(&b.c_fc_weight),
                c_fc_bias: b.c_fc_bias.as_dtype(dtype),
                mlp_proj_weight: q(&b.mlp_proj_weight),
                mlp_proj_bias: b.mlp_proj_bias.as_dtype(dtype),
            })
            .collect();
        Gpt2 {
            cfg: self.cfg,
            wte: self.wte.as_dtype(dtype),
            wpe: self.wpe.as_dtype(dtype),
            blocks,
            ln_f: self.ln_f.clone(),
            lm_head: Some(q(&self.wte.t())),
        }
    }

    /// The model with every matrix (the products' weights, both embeddings) and the products'
    /// biases in `dtype`, the layer norms as they are: for serving under `dtype`'s autocast,
    /// whose products then read half the bytes and cast nothing at each step.
    pub fn with_matrices_in(&self, dtype: DType) -> Gpt2 {
        assert!(self.lm_head.is_none(), "a quantized model's matrices stay as they are");
        let tensors: Vec<Tensor> = (self.params().named())
            .map(|(name, p)| if p.rank() == 2 || !name.contains("ln_") { p.as_dtype(dtype) } else { p.clone() })
            .collect();
        Gpt2::from_tensors(self.cfg, &tensors)
    }
}

// Used by `benches/data_parallel/sharded.rs` only (the other users of this module do not shard).
#[allow(dead_code)]
impl Gpt2 {
    /// The units a sharded run gathers one at a time (`braid::dist::Sharded`): unit 0 the
    /// embeddings and the final norm (the tied head reads `wte` again at the end), then one
    /// unit per block; parameters named as [`Gpt2::params`] names them.
    pub fn units(&self) -> Vec<Params> {
        let all = self.params();
        let named: Vec<(&str, &Tensor)> = all.named().collect();
        let mut root = Params::new();
        for (n, t) in named.iter().filter(|(n, _)| !n.starts_with("h.")) {
            root.push(*n, t);
        }
        let mut units = vec![root];
        for l in 0..self.cfg.layers {
            let mut unit = Params::new();
            let prefix = format!("h.{l}.");
            for (n, t) in named.iter().filter(|(n, _)| n.starts_with(&prefix)) {
                unit.push(*n, t);
            }
            units.push(unit);
        }
        units
    }
}

/// The mean cross-entropy of a model in [`Gpt2::units`]' layout whose unit `u` comes from
/// `unit(u)`, called where the unit's forward pass starts (`Sharded::gather`).
#[allow(dead_code)]
pub fn unit_loss(cfg: Config, ids: &Tensor, targets: &Tensor, mut unit: impl FnMut(usize) -> Vec<Tensor>) -> Tensor {
    let (b, t) = (ids.dims()[0], ids.dims()[1]);
    let root = unit(0);
    let norm = |w: &Tensor, bias: &Tensor| LayerNorm { weight: w.clone(), bias: bias.clone(), eps: 1e-5 };
    let shell = Gpt2 {
        cfg,
        wte: root[0].clone(),
        wpe: root[1].clone(),
        blocks: Vec::new(),
        ln_f: norm(&root[2], &root[3]),
        lm_head: None,
    };
    let mut x = shell.embed(ids);
    for l in 0..cfg.layers {
        let p = unit(l + 1);
        let blk = Block {
            ln_1: norm(&p[0], &p[1]),
            c_attn_weight: p[2].clone(),
            c_attn_bias: p[3].clone(),
            attn_proj_weight: p[4].clone(),
            attn_proj_bias: p[5].clone(),
            ln_2: norm(&p[6], &p[7]),
            c_fc_weight: p[8].clone(),
            c_fc_bias: p[9].clone(),
            mlp_proj_weight: p[10].clone(),
            mlp_proj_bias: p[11].clone(),
        };
        x = block(&blk, x, |qkv| shell.causal_attention(qkv, b, t));
    }
    shell.head(&x).cross_entropy(&targets.reshape([targets.numel()]))
}
