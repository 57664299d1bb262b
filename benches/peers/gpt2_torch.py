"""g6's peer: the GPT-2 training step of benches/gpt2_train.rs in PyTorch, eager and
torch.compile, from the same weights (--weights, the safetensors braid wrote) and the same
batches (windows of the bundled text at gpt2::batch's offsets). A nanoGPT-style model:
F.scaled_dot_product_attention(is_causal=True), torch.autocast(bfloat16), fused AdamW
(lr 6e-4, betas (0.9, 0.95), weight decay 0.1 on every parameter, as braid's AdamW),
clip_grad_norm_(1.0); each step's loss is read back (.item()), as braid's is.

Prints each step's loss and time, the median step (steps 5 and later) as ms, tokens/s, MFU
(nanoGPT's count against 989 TFLOP/s) and peak memory, then the first 20 losses of braid
(--braid-losses) and of each PyTorch run side by side.

Run: python3 benches/peers/gpt2_torch.py --weights OUT/gpt2_init.safetensors \
       --text examples/data/alice.txt --braid-losses OUT/gpt2_braid_losses.json [--steps 30]
"""
import argparse
import json
import math
import time

import torch
import torch.nn.functional as F


def load_file(path):
    """A safetensors file as {name: tensor} (the format is an 8-byte little-endian header
    length, a JSON header of dtype, shape and byte offsets, then the data): read here so the
    peer needs nothing beyond PyTorch."""
    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
              "I64": torch.int64, "I32": torch.int32}
    raw = open(path, "rb").read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    data = bytearray(raw[8 + n:])
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        t = torch.frombuffer(data, dtype=dtypes[meta["dtype"]], count=(hi - lo) // torch.tensor([], dtype=dtypes[meta["dtype"]]).element_size(), offset=lo)
        out[name] = t.reshape(meta["shape"]).clone()
    return out

args = argparse.ArgumentParser()
args.add_argument("--weights", required=True)
args.add_argument("--text", required=True)
args.add_argument("--braid-losses")
args.add_argument("--steps", type=int, default=30)
args.add_argument("--batch", type=int, default=8)
args.add_argument("--seq", type=int, default=1024)
args.add_argument("--no-compile", action="store_true")
args.add_argument("--profile", action="store_true", help="profile one more eager step: its kernels by GPU time")
opts = args.parse_args()
dev = torch.device("cuda")


class Gpt2(torch.nn.Module):
    """Hugging Face GPT-2's parameter layout (Conv1D weights are [in, out]), tied head."""

    def __init__(self, weights):
        super().__init__()
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.clone()) for k, v in weights.items()})
        self.layers = 1 + max(int(k.split(".")[1]) for k in weights if k.startswith("h."))
        self.width = weights["wte.weight"].shape[1]
        self.heads = 12 if self.width == 768 else 4

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def ln(self, x, name):
        return F.layer_norm(x, (x.shape[-1],), self.w(name + ".weight"), self.w(name + ".bias"), 1e-5)

    def forward(self, ids, targets):
        b, t = ids.shape
        c, h = self.width, self.heads
        x = self.w("wte.weight")[ids] + self.w("wpe.weight")[:t]
        for i in range(self.layers):
            a = self.ln(x, f"h.{i}.ln_1") @ self.w(f"h.{i}.attn.c_attn.weight") + self.w(f"h.{i}.attn.c_attn.bias")
            q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in a.split(c, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + y @ self.w(f"h.{i}.attn.c_proj.weight") + self.w(f"h.{i}.attn.c_proj.bias")
            m = F.gelu(self.ln(x, f"h.{i}.ln_2") @ self.w(f"h.{i}.mlp.c_fc.weight") + self.w(f"h.{i}.mlp.c_fc.bias"), approximate="tanh")
            x = x + m @ self.w(f"h.{i}.mlp.c_proj.weight") + self.w(f"h.{i}.mlp.c_proj.bias")
        logits = self.ln(x, "ln_f") @ self.w("wte.weight").t()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))


def batches(text, step, batch, seq):
    span = len(text) - seq - 1
    ids, targets = [], []
    for i in range(batch):
        at = ((step * batch + i) * 0x9E3779B97F4A7C15 % (1 << 64)) % span
        ids.append(list(text[at:at + seq]))
        targets.append(list(text[at + 1:at + seq + 1]))
    return torch.tensor(ids, device=dev), torch.tensor(targets, device=dev)


def run(name, compiled):
    weights = {k: v.to(dev) for k, v in load_file(opts.weights).items()}
    model = Gpt2(weights).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    forward = torch.compile(model) if compiled else model
    text = open(opts.text, "rb").read()
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    def train_step(ids, targets):
        """Forward, backward, clipping and the update; the loss read back."""
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = forward(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        torch.cuda.synchronize()
        return value

    for step in range(opts.steps):
        start = time.perf_counter()
        value = train_step(*batches(text, step, opts.batch, opts.seq))
        ms = (time.perf_counter() - start) * 1e3
        print(f"{name} step {step:>3}: loss {value:.4f}  {ms:.1f} ms", flush=True)
        losses.append(value)
        times.append(ms)
    if opts.profile and not compiled:
        ids, targets = batches(text, 1000, opts.batch, opts.seq)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            train_step(ids, targets)
        events = prof.key_averages()
        key = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
        total = sum(getattr(e, key) for e in events) / 1e3
        print(f"{name} profile of one step: {sum(e.count for e in events)} kernel launches, {total:.1f} ms of kernel time")
        for e in sorted(events, key=lambda e: -getattr(e, key))[:25]:
            print(f"  {getattr(e, key) / 1e3:8.3f} ms  {e.count:4} x  {e.key[:150]}")
    timed = sorted(times[5:])
    ms = timed[len(timed) // 2]
    tokens = opts.batch * opts.seq
    n = sum(p.numel() for p in model.parameters()) - weights["wpe.weight"].numel()
    flops = (6 * n + 12 * model.layers * model.width * opts.seq) * tokens
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"g6 {name}: {ms:.1f} ms a step, {tokens / ms * 1e3:.0f} tokens/s, "
          f"MFU {flops / (ms * 1e-3) / 989e12 * 100:.1f}% (of 989 TFLOP/s), peak {peak:.2f} GiB", flush=True)
    return losses


runs = {"torch eager": run("torch eager", False)}
if not opts.no_compile:
    runs["torch.compile"] = run("torch.compile", True)
if opts.braid_losses:
    runs = {"braid eager": json.load(open(opts.braid_losses)), **runs}
names = list(runs)
print("first 20 losses: step  " + "  ".join(f"{n:>14}" for n in names))
for step in range(min(20, opts.steps)):
    print(f"                 {step:>4}  " + "  ".join(f"{runs[n][step]:>14.4f}" for n in names))
