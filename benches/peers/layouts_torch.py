"""PyTorch peer of braid's benches/layouts.rs: over `x.t()` for `x` a [4096, 1024] f32 matrix, a
copy (`.contiguous()`), an `exp`, a row sum and a softmax along the transposed rows, each beside
the same op over `x` itself.

Usage: python3 layouts_torch.py [--device cpu|cuda] [--threads N]
Prints one line per case: side, name, median milliseconds (21 runs after 3 warm-ups, each
synchronised). Exits 1 with a message on stderr when PyTorch is missing.
"""
from timing import median, torch_on_device

torch, dev, sync = torch_on_device()
x = torch.randn(4096, 1024, device=dev)


cases = [
    ("copy", lambda x: x.t().contiguous(), lambda x: x * 1.0),
    ("exp", lambda x: x.t().exp(), lambda x: x.exp()),
    ("sum_dim(1)", lambda x: x.t().sum(1), lambda x: x.sum(1)),
    ("softmax(-1)", lambda x: x.t().softmax(-1), lambda x: x.softmax(-1)),
]
for name, transposed, plain in cases:
    for side, f in (("x.t()", transposed), ("x", plain)):

        def run():
            f(x)
            sync()

        print(f"torch {side} {name} {median(run, 3, 21) * 1e3:.3f} ms")
