"""The pieces of a GPT-2 124M training step (batch 8 x 1024, bf16) as PyTorch runs them, for
comparison with the kernel list `benches/gpt2_train.rs` writes: each linear layer's three
products, the MLP's GELU-backward product with its pointwise epilogue (eager and compiled), the
cross-entropy over [8192, 50257] bf16 logits (compiled) and a copy of the padded logits. Run on
the GPU machine: `python3 benches/peers/gpt2_pieces_torch.py`."""
import torch, time
torch.backends.cuda.matmul.allow_tf32 = False
dev = "cuda"
M = 8192
def bench(f, n=50):
    for _ in range(5): f()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n
bf = torch.bfloat16
rows = []
for name, k, n in [("qkv", 768, 2304), ("attn_proj", 768, 768), ("fc", 768, 3072), ("mlp_proj", 3072, 768), ("head", 768, 50257), ("head_pad", 768, 50264)]:
    x = torch.randn(M, k, device=dev, dtype=bf)
    w = torch.randn(n, k, device=dev, dtype=bf)  # nn.Linear layout
    dy = torch.randn(M, n, device=dev, dtype=bf)
    fwd = bench(lambda: x @ w.t())
    dx = bench(lambda: dy @ w)
    dw = bench(lambda: dy.t() @ x)
    flops = 2 * M * k * n
    print(f"{name:10s} M={M} K={k} N={n}: fwd {fwd:.4f} ms ({flops/fwd/1e9:.0f} TF/s)  dX {dx:.4f}  dW {dw:.4f}")
# The GELU backward: h = pre-activation [M, 3072], dy [M, 768] @ W [768, 3072] -> dh * gelu'(h)
h = torch.randn(M, 3072, device=dev, dtype=bf)
dy = torch.randn(M, 768, device=dev, dtype=bf)
w = torch.randn(768, 3072, device=dev, dtype=bf)
def gelu_bwd(dy, w, h):
    g = dy @ w
    return torch.ops.aten.gelu_backward(g, h, approximate="tanh")
print(f"gelu-backward product eager {bench(lambda: gelu_bwd(dy, w, h)):.4f} ms, mm alone {bench(lambda: dy @ w):.4f}")
c = torch.compile(gelu_bwd)
print(f"gelu-backward product compiled {bench(lambda: c(dy, w, h)):.4f} ms")
# Cross-entropy over bf16 logits [8192, 50257] (as torch.compile would run it)
logits = torch.randn(M, 50257, device=dev, dtype=bf, requires_grad=True)
t = torch.randint(0, 50257, (M,), device=dev)
def ce(l, t): return torch.nn.functional.cross_entropy(l.float(), t)
cc = torch.compile(ce)
print(f"cross-entropy forward compiled {bench(lambda: cc(logits, t)):.4f} ms")
def ceb():
    l = cc(logits, t); l.backward()
print(f"cross-entropy forward+backward compiled {bench(ceb, 20):.4f} ms")
x = torch.randn(M, 50264, device=dev, dtype=bf)
print(f"copy of [8192, 50264] bf16: {bench(lambda: x.clone()):.4f} ms")
