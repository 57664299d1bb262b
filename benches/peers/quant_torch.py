"""g9's peer lines: PyTorch's products at batch 1 beside braid's quantized ones
(`benches/quant.rs`), timed the same way: `x [1, k]` (bf16) times each of enough copies of the
weight (at least 256 MiB in all, so each is read from memory, not the L2 cache), all of them
captured in one CUDA graph, the graph replayed 10 times to the end and synced, the time of a
product the median of 5 such timings divided by the products. Rows: bf16 weights (`F.linear`,
cuBLAS) and, where this PyTorch has it on CUDA, int8 per-channel weights
(`torch._weight_int8pack_mm`); and the copy floor (a 256 MiB device copy, read and written).

Run: `python3 benches/peers/quant_torch.py` (needs a CUDA GPU)."""
import statistics
import time

from timing import torch_or_exit

torch = torch_or_exit()
F = torch.nn.functional
dev = torch.device("cuda")
torch.manual_seed(1)


def graph_time(fn, products):
    """Seconds per product: `fn` (which runs `products` products) captured in a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            g.replay()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / (10 * products))
    return statistics.median(times)


copy_bytes = 256 << 20
src = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
dst = torch.empty_like(src)
best = float("inf")
for _ in range(5):
    torch.cuda.synchronize()
    t = time.perf_counter()
    dst.copy_(src)
    torch.cuda.synchronize()
    best = min(best, time.perf_counter() - t)
floor = 2 * copy_bytes / best
print(f"torch copy floor: 256 MiB read and written in {best * 1e6:.1f} us = {floor / 1e9:.0f} GB/s")
del src, dst

for k, n in [(4096, 4096), (4096, 14336)]:
    x = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
    nbytes = k * n * 2
    copies = max(2, -(-copy_bytes // nbytes))
    ws = [torch.randn(n, k, dtype=torch.bfloat16, device=dev) for _ in range(copies)]
    outs = []

    def bf16():
        outs.clear()
        outs.extend(F.linear(x, w) for w in ws)

    t = graph_time(bf16, copies)
    print(f"torch [{k} x {n}] bf16 F.linear: {nbytes / 1e6:.2f} MB in {t * 1e6:.2f} us = {nbytes / t / 1e9:.0f} GB/s = {nbytes / t / floor:.2f} of the copy floor ({copies} weights a replay)")
    del ws
    nbytes = k * n + n * 2
    copies = max(2, -(-copy_bytes // nbytes))
    w8 = [torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev) for _ in range(copies)]
    scales = torch.rand(n, dtype=torch.bfloat16, device=dev)
    try:
        torch._weight_int8pack_mm(x, w8[0], scales)

        def int8():
            outs.clear()
            outs.extend(torch._weight_int8pack_mm(x, w, scales) for w in w8)

        t = graph_time(int8, copies)
        print(f"torch [{k} x {n}] int8 _weight_int8pack_mm: {nbytes / 1e6:.2f} MB in {t * 1e6:.2f} us = {nbytes / t / 1e9:.0f} GB/s = {nbytes / t / floor:.2f} of the copy floor ({copies} weights a replay)")
    except (RuntimeError, NotImplementedError) as e:
        print(f"torch [{k} x {n}] int8 _weight_int8pack_mm: not on CUDA in this PyTorch ({str(e).splitlines()[0][:100]})")
    del w8
