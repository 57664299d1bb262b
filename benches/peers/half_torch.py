"""PyTorch peer of braid's benches/half.rs: over [4096, 1024] f16 and bf16 tensors, an add, an
`exp`, casts to and from f32, a row sum, a softmax and a [512, 1024] x [1024, 1024] matrix
product, each beside the same op in f32.

Usage: python3 half_torch.py [--device cpu|cuda] [--threads N]
Prints one line per case: dtype, name, median milliseconds (21 runs after 3 warm-ups, each
synchronised). Exits 1 with a message on stderr when PyTorch is missing.
"""
from timing import median, torch_on_device

torch, dev, sync = torch_on_device()

cases = [
    ("a + b", lambda a, b, w: a + b),
    ("exp", lambda a, b, w: a.exp()),
    ("cast to f32", lambda a, b, w: a.float()),
    ("cast from f32", lambda a, b, w: w.to(a.dtype)),
    ("sum_dim(1)", lambda a, b, w: a.sum(1)),
    ("softmax(-1)", lambda a, b, w: a.softmax(-1)),
    ("matmul", lambda a, b, w: a[:512] @ b[:1024]),
]
for name, dtype in (("f16", torch.float16), ("bf16", torch.bfloat16), ("f32", torch.float32)):
    a = torch.randn(4096, 1024, device=dev).to(dtype)
    b = torch.randn(4096, 1024, device=dev).to(dtype)
    w = a.float()
    for case, f in cases:
        if dtype == torch.float32 and case.startswith("cast"):
            continue

        def run():
            f(a, b, w)
            sync()

        print(f"torch {name} {case} {median(run, 3, 21) * 1e3:.3f} ms")
