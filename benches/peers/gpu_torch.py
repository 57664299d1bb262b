"""PyTorch peers for the GPU bench card (braid's benches/gpu_card.rs runs this in the same command).

Usage: python3 gpu_torch.py --device cuda|cpu --scale full|small --only g1,g2,...
Prints one JSON object per line: {"id": "g1", "variant": "eager", "ms": ..., "peak_extra_bytes": ...}
and first {"id": "copy", "variant": "clone", "ms": GB/s}: the device-to-device copy bandwidth
(read + write counted) measured in this run, the floor braid's bandwidth is compared with.

Timing: the median of 21 runs after 3 warm-ups, each run synchronised before its outputs are
let go (torch.cuda.synchronize), TF32 off. Each workload computes what braid's row of the same
id holds: G3 every parameter's gradient and the SGD update of all of them, G5 every weight's
gradient (held until the sync), G4 both chains. Peak memory: torch.cuda.max_memory_allocated over what
was allocated before the run. Rows "g4-host" and "g4-2s-host" carry, in "ms", the host's cost of
enqueueing G4 without waiting, in us per product and its tanh. Exits 1 with a message on stderr when
PyTorch is missing.
"""
import argparse
import json
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    sys.stderr.write("torch is not installed (pip install torch)\n")
    sys.exit(1)

args = argparse.ArgumentParser()
args.add_argument("--device", default="cuda")
args.add_argument("--scale", default="full")
args.add_argument("--only", default="g1,g2,g3,g4,g5")
opts = args.parse_args()
dev = torch.device(opts.device)
full = opts.scale == "full"
cuda = dev.type == "cuda"
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)


def sync():
    if cuda:
        torch.cuda.synchronize()


def median_ms(f, warm=3, runs=21):
    for _ in range(warm):
        out = f()
        sync()
        del out
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        out = f()
        sync()
        ts.append((time.perf_counter() - t) * 1e3)
        del out
    ts.sort()
    return ts[len(ts) // 2]


def peak_extra(f):
    """Bytes the device allocated at the peak of one run, over what was allocated before."""
    if not cuda:
        return None
    sync()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = f()
    sync()
    peak = torch.cuda.max_memory_allocated() - before
    del out
    return peak


def host_us(f, per):
    """Host time to enqueue `f` without waiting for the GPU, in us per `per`: the median of 21
    runs after 3 warm-ups, each synchronised after the clock stops."""
    ts = []
    for i in range(24):
        sync()
        t = time.perf_counter()
        out = f()
        if i >= 3:
            ts.append((time.perf_counter() - t) * 1e6 / per)
        sync()
        del out
    ts.sort()
    return ts[len(ts) // 2]


def emit(id_, variant, f):
    row = {"id": id_, "variant": variant, "ms": median_ms(f), "peak_extra_bytes": peak_extra(f)}
    print(json.dumps(row), flush=True)


def compiled(f):
    try:
        return torch.compile(f)
    except Exception as e:  # noqa: BLE001 - any failure means no compiled peer
        sys.stderr.write(f"torch.compile unavailable: {type(e).__name__}\n")
        return None


def copy_floor():
    n = (64 << 20) if full else (1 << 22)
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x))
    print(json.dumps({"id": "copy", "variant": "clone", "ms": 2 * 4 * n / ms / 1e6}), flush=True)


def g1():
    n = (64 << 20) if full else (1 << 20)
    x, w = torch.randn(n, device=dev), torch.randn(n, device=dev)

    def chain(x, w):
        return F.gelu(x * w + 1.0, approximate="tanh") * torch.sigmoid(x)

    emit("g1", "eager", lambda: chain(x, w))
    f = compiled(chain)
    if f is not None:
        emit("g1", "compile", lambda: f(x, w))


def g2():
    r, c = (8192, 4096) if full else (512, 256)
    x = torch.randn(r, c, device=dev)

    def composed(x):
        e = torch.exp(x - x.amax(dim=1, keepdim=True))
        return e / e.sum(dim=1, keepdim=True)

    emit("g2", "eager", lambda: composed(x))
    emit("g2", "softmax", lambda: torch.softmax(x, dim=1))
    emit("g2", "sum0", lambda: x.sum(dim=0))  # braid's g2-axis0
    f = compiled(composed)
    if f is not None:
        emit("g2", "compile", lambda: f(x))


def g3():
    h, b = (4096, 4096) if full else (256, 256)
    ws = [(torch.randn(h, h, device=dev) * (2.0 / h) ** 0.5).requires_grad_() for _ in range(4)]
    bs = [(torch.rand(h, device=dev) * 0.2 - 0.1).requires_grad_() for _ in range(4)]
    x = torch.randn(b, h, device=dev)

    def step():
        hh = x
        for w, bb in zip(ws, bs):
            hh = torch.relu(hh @ w + bb)
        loss = (hh * hh).mean()
        loss.backward()
        with torch.no_grad():
            for p in ws + bs:
                p -= 0.01 * p.grad
                p.grad = None
        return loss

    emit("g3", "eager", step)


def g4():
    n, steps = (256, 64) if full else (64, 16)
    a = torch.randn(n, n, device=dev) / n**0.5
    x = torch.randn(n, n, device=dev)

    def chain():
        h = x
        for _ in range(steps):
            h = torch.tanh(h @ a)
        return h

    emit("g4", "one_stream", lambda: (chain(), chain()))
    # The host's cost of the same work, beside braid's "host records and issues" figure: us per
    # product and its tanh (what one braid kernel does), enqueued without waiting.
    host = {"id": "g4-host", "variant": "eager", "ms": host_us(lambda: (chain(), chain()), 2 * steps)}
    print(json.dumps(host), flush=True)
    if cuda:
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def two():
            cur = torch.cuda.current_stream()
            s1.wait_stream(cur)
            s2.wait_stream(cur)
            with torch.cuda.stream(s1):
                r1 = chain()
            with torch.cuda.stream(s2):
                r2 = chain()
            cur.wait_stream(s1)
            cur.wait_stream(s2)
            return r1, r2

        emit("g4", "two_streams", two)
        host = {"id": "g4-2s-host", "variant": "eager", "ms": host_us(two, 2 * steps)}
        print(json.dumps(host), flush=True)


def g5():
    blocks, b, d = (16, 8192, 2048) if full else (4, 256, 64)
    w1 = [(torch.randn(d, 4 * d, device=dev) / d**0.5).requires_grad_() for _ in range(blocks)]
    w2 = [(torch.randn(4 * d, d, device=dev) * 0.5 / (4 * d) ** 0.5).requires_grad_() for _ in range(blocks)]
    x = torch.randn(b, d, device=dev)

    def step():
        h = x
        for a, c in zip(w1, w2):
            h = h + F.gelu(h @ a, approximate="tanh") @ c
        loss = (h * h).mean()
        loss.backward()
        # Every weight's gradient, held until the sync as braid's G5 holds them.
        grads = [p.grad for p in w1 + w2]
        for p in w1 + w2:
            p.grad = None
        return loss, grads

    emit("g5", "plain", step)
    if cuda:

        def offloaded():
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return step()

        emit("g5", "save_on_cpu", offloaded)


copy_floor()
for which in opts.only.split(","):
    {"g1": g1, "g2": g2, "g3": g3, "g4": g4, "g5": g5}[which.strip()]()
    if cuda:
        torch.cuda.empty_cache()
