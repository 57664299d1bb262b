"""Issue 45's peer: GPT-2 trained with PyTorch FSDP2, the step `bench-data_parallel --sharded`
times on braid. The model of examples/common/gpt2.rs (learned token and position embeddings,
the token table tied to the head, pre-norm blocks of causal F.scaled_dot_product_attention and a
GELU feed-forward, a final layer norm), `fully_shard` on every block and on the root,
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=f32) under torch.autocast(bfloat16) (so
norms and the loss run in f32, as braid's autocast), AdamW (lr 6e-4, betas (0.9, 0.95), weight
decay 0.1, foreach). Each step: forward, backward, optimizer step, every rank's loss read
(.item()). Token ids are bytes (below 256), as braid's batches are.

Prints, from rank 0: the median step after 3 warm-up steps (ms), tokens/s over all ranks, and
the peak memory of rank 0's GPU (torch.cuda.max_memory_allocated).

Run: torchrun --nproc_per_node N benches/peers/fsdp_torch.py --model medium --batch 8 --seq 1024
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

args = argparse.ArgumentParser()
args.add_argument("--model", default="medium")
args.add_argument("--batch", type=int, default=8)
args.add_argument("--seq", type=int, default=1024)
args.add_argument("--steps", type=int, default=10)
opts = args.parse_args()

CONFIGS = {"medium": (24, 16, 1024), "small": (12, 12, 768), "tiny": (2, 4, 64)}
layers, heads, width = CONFIGS[opts.model]
vocabulary, context = 50257, 1024


class Block(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(c)
        self.c_attn = torch.nn.Linear(c, 3 * c)
        self.attn_proj = torch.nn.Linear(c, c)
        self.ln_2 = torch.nn.LayerNorm(c)
        self.c_fc = torch.nn.Linear(c, 4 * c)
        self.mlp_proj = torch.nn.Linear(4 * c, c)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.c_attn(self.ln_1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = torch.nn.Embedding(vocabulary, width)
        self.wpe = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith("proj.weight") else 0.02
                torch.nn.init.normal_(p, 0.0, std)

    def forward(self, ids, targets):
        x = self.wte(ids) + self.wpe.weight[: ids.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        logits = self.ln_f(x) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().view(-1, vocabulary), targets.reshape(-1))


dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
torch.manual_seed(1)
model = Gpt2().cuda()
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for blk in model.blocks:
    fully_shard(blk, mp_policy=policy)
fully_shard(model, mp_policy=policy)
opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
gen = torch.Generator(device="cuda").manual_seed(rank)


def step():
    ids = torch.randint(0, 256, (opts.batch, opts.seq + 1), device="cuda", generator=gen)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


for _ in range(3):
    step()
torch.cuda.reset_peak_memory_stats()
times = []
for _ in range(opts.steps):
    torch.cuda.synchronize()
    t = time.perf_counter()
    loss = step()
    times.append((time.perf_counter() - t) * 1e3)
times.sort()
ms = times[len(times) // 2]
if rank == 0:
    tokens = world * opts.batch * opts.seq / (ms / 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"fsdp2 {opts.model}, {world} rank(s): {ms:.1f} ms/step, {tokens:.0f} tokens/s, peak {peak:.2f} GiB on rank 0, loss {loss:.3f}")
dist.destroy_process_group()
