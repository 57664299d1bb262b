//! Generation with GPT-2 ([`super::gpt2`]): a prefill of the prompts with the fused attention,
//! then one decode step a token over static caches, captured once as a `braid::Step` (replayed
//! as one CUDA graph a token on CUDA) with sampling on the device. Shared by
//! `examples/gpt2.rs generate`, the `generate` bench and `tests/generate.rs`.

use super::gpt2::{Config, Gpt2};
use braid::nn::generate::{Sampling, sample};
use braid::prelude::*;

type StepFn = Box<dyn Fn(&[Tensor]) -> Vec<Tensor>>;

/// The decode step as a pure function of its arguments, for `braid::Step`: the model's `n`
/// parameters (in `Gpt2::params`' order), its `2 layers` caches, the tokens `[batch, 1]` (I32),
/// the positions `[batch]` (I32) and, when `how` draws, uniform numbers `[batch, vocabulary]`.
/// Under `low`'s autocast. Updates the caches in place (a replay of the captured step writes
/// the new rows into the caches' buffers) and returns the next tokens `[batch, 1]` and the next
/// positions: the next call's last arguments.
pub fn decode_step(cfg: Config, n: usize, args: &[Tensor], how: Sampling, low: Option<DType>) -> Vec<Tensor> {
    let run = || {
        let model = Gpt2::from_tensors(cfg, &args[..n]);
        let caches = &args[n..n + 2 * cfg.layers];
        let (tokens, pos) = (&args[n + 2 * cfg.layers], &args[n + 2 * cfg.layers + 1]);
        let logits = model.decode(tokens, pos, caches);
        let next = sample(&logits, how, args.get(n + 2 * cfg.layers + 2));
        vec![next.reshape([tokens.dims()[0], 1]), pos + 1.0]
    };
    // Inference: no gradient history (the model's parameters may require gradients).
    braid::no_grad(|| match low {
        Some(low) => braid::amp::autocast(low, run),
        None => run(),
    })
}

/// A batch of sequences being generated: the decode step (captured at its first call) and its
/// state (caches, the last tokens, the positions), with the tokens produced so far kept on the
/// device until they are read.
pub struct Generation {
    cfg: Config,
    params: Vec<Tensor>,
    step: braid::Step<StepFn>,
    state: Vec<Tensor>,
    how: Sampling,
    produced: Vec<Tensor>,
    low: Option<DType>,
    captured: bool,
    /// Positions the caches hold, and the next position of the longest prompt's sequence.
    cache_len: usize,
    next_pos: usize,
}

impl Generation {
    /// Prefills `prompts` (token ids, each at least one) with `model` under `low`'s autocast,
    /// with caches of `cache_len` positions (prompt plus generated tokens), and samples the
    /// first token. `captured`: decode through a captured `braid::Step` (else eagerly, op by op,
    /// the same ops).
    pub fn new(
        model: &Gpt2,
        prompts: &[Vec<i32>],
        cache_len: usize,
        how: Sampling,
        low: Option<DType>,
        captured: bool,
    ) -> Generation {
        let params: Vec<Tensor> = model.params().iter().cloned().collect();
        let device = params.first().expect("a model has parameters").device().clone();
        let b = prompts.len();
        let t = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let lengths: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let ids: Vec<i32> =
            prompts.iter().flat_map(|p| p.iter().copied().chain(std::iter::repeat_n(0, t - p.len()))).collect();
        let ids = Tensor::from_vec(ids, [b, t], &device);
        let prefill = || model.prefill(&ids, &lengths, cache_len);
        let (logits, caches) = braid::no_grad(|| match low {
            Some(low) => braid::amp::autocast(low, prefill),
            None => prefill(),
        });
        let first = sample(&logits, how, uniform(how, &logits).as_ref()).reshape([b, 1]);
        let pos: Vec<i32> = lengths.iter().map(|&l| l as i32).collect();
        let mut state = caches;
        state.extend([first.clone(), Tensor::from_vec(pos, [b], &device)]);
        let (cfg, n) = (model.cfg, params.len());
        let f: StepFn = Box::new(move |args: &[Tensor]| decode_step(cfg, n, args, how, low));
        let (step, produced, next_pos) = (braid::Step::new(f), vec![first], t);
        Generation { cfg, params, step, state, how, produced, low, captured, cache_len, next_pos }
    }

    /// The decode step's arguments: the parameters, the state, and for a draw `uniform(batch,
    /// vocabulary)`.
    fn args(&self, uniform: impl FnOnce(usize, usize) -> Tensor) -> Vec<Tensor> {
        let mut args: Vec<Tensor> = self.params.iter().cloned().chain(self.state.iter().cloned()).collect();
        if self.how != Sampling::Greedy {
            args.push(uniform(self.state[2 * self.cfg.layers].dims()[0], self.cfg.vocabulary));
        }
        args
    }

    /// Decodes one more token of every sequence (nothing is read back). Misuse: a step past the
    /// caches' last position.
    #[track_caller]
    pub fn next(&mut self) -> Result<()> {
        assert!(
            self.next_pos < self.cache_len,
            "the caches hold {} positions: the longest sequence has used them all",
            self.cache_len
        );
        self.next_pos += 1;
        let device = self.params[0].device().clone();
        let args = self.args(|b, v| Tensor::rand([b, v], 0.0, 1.0, DType::F32, &device));
        let out = if self.captured {
            self.step.call(&args)?
        } else {
            let n = self.params.len();
            decode_step(self.cfg, n, &args, self.how, self.low)
        };
        drop(args);
        // The caches were updated in place; the state's tokens and positions are the outputs.
        let [tokens, pos] = <[Tensor; 2]>::try_from(out).expect("a decode step returns tokens and positions");
        self.produced.push(tokens.clone());
        let l = 2 * self.cfg.layers;
        self.state.truncate(l);
        self.state.extend([tokens, pos]);
        Ok(())
    }

    /// The key and value caches, two a layer (updated in place at every token).
    #[allow(dead_code)] // tests/generate.rs watches them; the example and the bench do not
    pub fn caches(&self) -> &[Tensor] {
        &self.state[..2 * self.cfg.layers]
    }

    /// Every token produced so far, per sequence (reads them from the device).
    pub fn tokens(&self) -> Result<Vec<Vec<i32>>> {
        let b = self.state[2 * self.cfg.layers].dims()[0];
        let mut seqs = vec![Vec::with_capacity(self.produced.len()); b];
        let all = Tensor::cat(&self.produced.iter().collect::<Vec<_>>(), 1).to_vec::<i32>()?;
        let steps = self.produced.len();
        for (i, seq) in seqs.iter_mut().enumerate() {
            seq.extend_from_slice(&all[i * steps..(i + 1) * steps]);
        }
        Ok(seqs)
    }

    /// Kernels a replay of the captured decode step runs (`None` before its first call).
    pub fn kernels_per_token(&self) -> Option<usize> {
        let device = self.params[0].device().clone();
        self.step.kernel_count(&self.args(|b, v| Tensor::zeros([b, v], DType::F32, &device)))
    }
}

/// Uniform numbers for a draw of `how` from `logits` (none for greedy).
fn uniform(how: Sampling, logits: &Tensor) -> Option<Tensor> {
    (how != Sampling::Greedy).then(|| Tensor::rand(logits.dims().to_vec(), 0.0, 1.0, DType::F32, logits.device()))
}
