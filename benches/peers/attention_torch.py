"""PyTorch peer of braid's benches/attention.rs: `scaled_dot_product_attention` with the flash
backend, bf16, causal, [8, 12, 1024, 64] and [4, 16, 2048, 128]: the forward pass, and the
forward and backward passes of `(y * w).float().sum()`, each the median of 31 runs after 5
warm-ups and a synchronisation. TFLOP/s count a forward pass as 4 b h s^2 d flops halved for the
causal mask, a backward pass as 2.5 forward passes.

Usage: python3 attention_torch.py [--device cuda]
"""
import argparse

from timing import median, torch_or_exit

torch = torch_or_exit()
args = argparse.ArgumentParser()
args.add_argument("--device", default="cuda")
dev = torch.device(args.parse_args().device)
torch.manual_seed(1)
sync = torch.cuda.synchronize
try:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flash = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # noqa: E731
except ImportError:
    flash = lambda: torch.backends.cuda.sdp_kernel(enable_flash=True, enable_math=False, enable_mem_efficient=False)  # noqa: E731
sdpa = torch.nn.functional.scaled_dot_product_attention
REPS = 10

for b, h, s, d in ((8, 12, 1024, 64), (4, 16, 2048, 128)):
    q, k, v, w = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
    held = []

    def forward():
        with flash():
            y = sdpa(q, k, v, is_causal=True)
        sync()
        held[:] = [y]

    fwd = median(forward, 5, 31)
    ql, kl, vl = (t.detach().requires_grad_() for t in (q, k, v))

    def both():
        with flash():
            y = sdpa(ql, kl, vl, is_causal=True)
        gq, gk, gv = torch.autograd.grad((y * w).float().sum(), (ql, kl, vl))
        sync()
        held[:] = [gq, gk, gv]

    bwd = median(both, 5, 31)

    # Back to back: REPS calls before one synchronisation (the kernels' throughput).
    def forward_b2b():
        with flash():
            ys = [sdpa(q, k, v, is_causal=True) for _ in range(REPS)]
        sync()
        held[:] = ys

    def both_b2b():
        gs = []
        for _ in range(REPS):
            with flash():
                y = sdpa(ql, kl, vl, is_causal=True)
            gs.extend(torch.autograd.grad((y * w).float().sum(), (ql, kl, vl)))
        sync()
        held[:] = gs

    fwd_b2b = median(forward_b2b, 2, 11) / REPS
    bwd_b2b = median(both_b2b, 2, 11) / REPS
    flops = 4.0 * b * h * s * s * d / 2
    print(
        f"torch sdpa (flash) bf16 causal [{b}, {h}, {s}, {d}]: forward {fwd * 1e3:.3f} ms ({flops / fwd / 1e12:.1f} TFLOP/s), "
        f"forward+backward {bwd * 1e3:.3f} ms ({3.5 * flops / bwd / 1e12:.1f} TFLOP/s)"
    )
    print(
        f"torch sdpa (flash) bf16 causal [{b}, {h}, {s}, {d}] back to back ({REPS} calls a sync): "
        f"forward {fwd_b2b * 1e3:.3f} ms ({flops / fwd_b2b / 1e12:.1f} TFLOP/s), "
        f"forward+backward {bwd_b2b * 1e3:.3f} ms ({3.5 * flops / bwd_b2b / 1e12:.1f} TFLOP/s)"
    )
