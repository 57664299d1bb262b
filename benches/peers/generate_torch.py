"""g8's peer: decode tokens/s of GPT-2 in PyTorch with a static key/value cache, greedy.

The same model as braid's (`examples/common/gpt2.rs`: pre-norm blocks, Conv1D weights
`[in, out]`, tied head), random weights in bf16, prompts of 16 tokens, 8 warm-up steps, then 100
timed decode steps and the read of every token at the end (`torch.cuda.synchronize` after
`.cpu()`). Each step: embeddings at each sequence's position, per block layer norm, the qkv
product, the new keys and values written into the static caches in place at each sequence's
position (indexed assignment), SDPA over the cache with the length mask, projections, the MLP, the
final norm and head, greedy argmax. Eager, and `torch.compile(mode="reduce-overhead")` (CUDA
graphs). int8: `torch._weight_int8pack_mm` (per-channel int8 weights, bf16 activations) for
every block matrix and the head, eager only (compiled where it works).

Run: `python3 benches/peers/generate_torch.py [NAME,...] [--prompt N]` (on a CUDA machine; names
of models or weights select rows; prompts of N tokens, 16 by default).
"""
import math
import sys
import time

import torch
import torch.nn.functional as F

PROMPT, WARM, TIMED = 16, 8, 100
MODELS = [("gpt2-124m", 12, 12, 768), ("gpt2-1.5b-shape", 48, 25, 1600)]
VOCAB = 50257


def make_model(layers, width, int8):
    g = torch.Generator(device="cuda").manual_seed(0)

    def normal(*shape, std=0.02):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(torch.bfloat16)

    def matrix(k, n, std=0.02):
        w = normal(k, n, std=std)
        if not int8:
            return ("dense", w)
        # Per output channel, symmetric: _weight_int8pack_mm takes [n, k] int8 and [n] scales.
        wt = w.t().float()
        scale = wt.abs().amax(dim=1).clamp(min=1e-8) / 127.0
        q = torch.round(wt / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return ("int8", q, scale.to(torch.bfloat16))

    blocks = []
    for _ in range(layers):
        c = width
        blocks.append(dict(
            ln1=(torch.ones(c, device="cuda"), torch.zeros(c, device="cuda")),
            attn=matrix(c, 3 * c), attn_b=torch.zeros(3 * c, device="cuda", dtype=torch.bfloat16),
            proj=matrix(c, c), proj_b=torch.zeros(c, device="cuda", dtype=torch.bfloat16),
            ln2=(torch.ones(c, device="cuda"), torch.zeros(c, device="cuda")),
            fc=matrix(c, 4 * c), fc_b=torch.zeros(4 * c, device="cuda", dtype=torch.bfloat16),
            mlp=matrix(4 * c, c), mlp_b=torch.zeros(c, device="cuda", dtype=torch.bfloat16),
        ))
    wte = normal(VOCAB, width)
    wpe = normal(1024, width, std=0.01)
    head = matrix(width, VOCAB) if int8 else ("dense", wte.t())
    lnf = (torch.ones(width, device="cuda"), torch.zeros(width, device="cuda"))
    return dict(blocks=blocks, wte=wte, wpe=wpe, head=head, lnf=lnf)


def product(x, w):
    if w[0] == "dense":
        return x @ w[1]
    return torch._weight_int8pack_mm(x, w[1], w[2])


def layer_norm(x, p):
    return F.layer_norm(x.float(), (x.shape[-1],), p[0], p[1], 1e-5)


def decode(m, heads, tokens, pos, caches):
    """One step: tokens [b] at positions pos [b]; caches [L, 2, b, h, T, d] written in place."""
    b = tokens.shape[0]
    x = (m["wte"][tokens] + m["wpe"][pos]).float()  # [b, c], the residual stream in f32
    c = x.shape[1]
    d = c // heads
    T = caches.shape[4]
    mask = torch.arange(T, device="cuda")[None, :] <= pos[:, None]  # [b, T]
    rows = torch.arange(b, device="cuda")
    for l, blk in enumerate(m["blocks"]):
        h = layer_norm(x, blk["ln1"]).to(torch.bfloat16)
        qkv = product(h, blk["attn"]) + blk["attn_b"]
        q, k, v = qkv.view(b, 3, heads, d).unbind(1)
        caches[l, 0][rows, :, pos] = k
        caches[l, 1][rows, :, pos] = v
        y = F.scaled_dot_product_attention(q[:, :, None], caches[l, 0], caches[l, 1], attn_mask=mask[:, None, None, :])
        y = y.reshape(b, c)
        x = x + (product(y, blk["proj"]) + blk["proj_b"]).float()
        h = layer_norm(x, blk["ln2"]).to(torch.bfloat16)
        h = F.gelu(product(h, blk["fc"]) + blk["fc_b"], approximate="tanh")
        x = x + (product(h, blk["mlp"]) + blk["mlp_b"]).float()
    logits = product(layer_norm(x, m["lnf"]).to(torch.bfloat16), m["head"])
    return logits.argmax(dim=-1), pos + 1


def rate(m, layers, heads, width, batch, step):
    d = width // heads
    T = PROMPT + 1 + WARM + TIMED
    caches = torch.zeros(layers, 2, batch, heads, T, d, device="cuda", dtype=torch.bfloat16)
    # Written in place at every step: a static address, as Hugging Face's StaticCache marks its
    # tensors, so that the CUDA graphs of reduce-overhead take it as it is.
    torch._dynamo.mark_static_address(caches)
    # The prompt's positions hold random keys and values (a prefill's work is not timed).
    caches[:, :, :, :, :PROMPT].normal_()
    tokens = torch.randint(0, 256, (batch,), device="cuda")
    pos = torch.full((batch,), PROMPT, device="cuda", dtype=torch.long)
    out = []
    for _ in range(WARM):
        tokens, pos = step(m, heads, tokens, pos, caches)
        tokens, pos = tokens.clone(), pos.clone()
        out.append(tokens)
    torch.cuda.synchronize()
    out = []
    start = time.perf_counter()
    for _ in range(TIMED):
        tokens, pos = step(m, heads, tokens, pos, caches)
        tokens, pos = tokens.clone(), pos.clone()
        out.append(tokens)
    torch.stack(out).cpu()
    torch.cuda.synchronize()
    return batch * TIMED / (time.perf_counter() - start)


def main():
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    print(f"g8 peer: torch {torch.__version__} on {torch.cuda.get_device_name()}")
    compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
    global PROMPT
    argv = sys.argv[1:]
    if "--prompt" in argv:
        i = argv.index("--prompt")
        PROMPT = int(argv[i + 1])
        del argv[i : i + 2]
    print(f"g8 peer: prompts of {PROMPT}, {TIMED} timed steps")
    only = argv[0].split(",") if argv else []
    wanted = lambda n: not only or n in only  # noqa: E731
    for name, layers, heads, width in MODELS:
        if not wanted(name):
            continue
        for weights in ["bf16", "int8"]:
            if not wanted(weights):
                continue
            try:
                m = make_model(layers, width, weights == "int8")
            except Exception as e:  # noqa: BLE001
                print(f"g8 {name} {weights}: skipped ({e})")
                continue
            for batch in [1, 8]:
                for mode, step in [("eager", decode), ("compile-reduce-overhead", compiled)]:
                    try:
                        with torch.no_grad():
                            r = rate(m, layers, heads, width, batch, step)
                        print(f"g8 {name} {weights} batch {batch}: torch {mode} {r:.0f} tokens/s")
                    except Exception as e:  # noqa: BLE001
                        msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                        print(f"g8 {name} {weights} batch {batch}: torch {mode} failed ({msg})")
                    sys.stdout.flush()
            del m
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
