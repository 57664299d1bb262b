"""PyTorch peer of braid's benches/optim_step.rs: one AdamW step (lr 1e-3, betas (0.9, 0.999),
eps 1e-8, weight decay 0.01) over GPT-2 small's 148 parameter tensors (124M f32 values; on the
CPU a quarter of the width and 4 blocks, as braid's bench), from gradients set beforehand, with
`foreach=True` (PyTorch's default multi-tensor update on CUDA) and `fused=True`. Each timed run
is `opt.step()` and a synchronisation: every parameter and both moments updated in place, as in
braid's row.

Usage: python3 optim_torch.py [--device cuda|cpu] [--threads N]
Prints one line per variant: median milliseconds of 21 runs after 3 warm-ups.
"""
from timing import median, torch_on_device

torch, dev, sync = torch_on_device()


def gpt2_shapes(width, layers, vocabulary):
    shapes = [(vocabulary, width), (1024, width)]
    for _ in range(layers):
        shapes += [(width,), (width,), (width, 3 * width), (3 * width,), (width, width)]
        shapes += [(width,), (width,), (width,), (width, 4 * width), (4 * width,)]
        shapes += [(4 * width, width), (width,)]
    return shapes + [(width,), (width,)]


shapes = gpt2_shapes(192, 4, 50257) if dev.type == "cpu" else gpt2_shapes(768, 12, 50257)
for variant in ("foreach", "fused"):
    params = [torch.nn.Parameter(torch.randn(s, device=dev) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=dev) * 1e-3
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{variant: True})

    def step():
        opt.step()
        sync()

    numel = sum(p.numel() for p in params)
    print(f"torch AdamW {variant}: {len(params)} tensors, {numel} values: {median(step, 3, 21) * 1e3:.3f} ms a step")
