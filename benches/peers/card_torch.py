"""PyTorch peers for the CPU bench card (braid's benches/card.rs runs this in the same command).

Usage: python3 card_torch.py c1|c2|c3|c4|c5. Prints one line per variant: the workload, the
median time (torch eager; torch.compile where BENCH.md lists it) and, for C5, the peak memory of
live tensors during a training step. Each computes what braid's row of the same id holds: the
training steps (C3, C5) every parameter's gradient and the SGD update of every parameter.

PyTorch has no peak counter for CPU memory, so the C5 peak is read off the profiler's memory
events (`profile_memory=True`: every tensor allocation and free, with its size, in order): the
bytes live at the start of a step (parameters, data) plus the highest running sum of the step's
allocations and frees. That is the same quantity as braid's `device.memory().peak` (bytes in
live buffers, parameters included), not the process's resident size.

Exits 1 with a message on stderr when PyTorch is not installed.
"""
import sys

from timing import median

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    sys.stderr.write("torch is not installed (pip install torch)\n")
    sys.exit(1)

torch.set_num_threads(2)
torch.manual_seed(0)


def compiled(f):
    """torch.compile(f), or None with the reason printed when it cannot compile here."""
    try:
        return torch.compile(f)
    except Exception as e:  # noqa: BLE001 - any failure means no compiled peer
        print(f"torch.compile: not run ({type(e).__name__})")
        return None


def c1():
    n = 16 << 20
    x, w = torch.randn(n), torch.randn(n)

    def chain(x, w):
        return F.gelu(x * w + 1.0, approximate="tanh") * torch.sigmoid(x)

    t = median(lambda: chain(x, w))
    print(f"torch eager C1 chain: {t * 1e3:.2f} ms")
    f = compiled(chain)
    if f is not None:
        t = median(lambda: f(x, w))
        print(f"torch.compile C1 chain: {t * 1e3:.2f} ms")


def c2():
    x = torch.randn(2048, 1024)

    def composed(x):
        e = torch.exp(x - x.amax(dim=1, keepdim=True))
        return e / e.sum(dim=1, keepdim=True)

    t = median(lambda: torch.softmax(x, 1), 3, 15)
    print(f"torch.softmax C2 softmax: {t * 1e3:.3f} ms")
    t = median(lambda: composed(x), 3, 15)
    print(f"torch eager composed C2 softmax: {t * 1e3:.3f} ms")
    f = compiled(composed)
    if f is not None:
        t = median(lambda: f(x), 3, 15)
        print(f"torch.compile composed C2 softmax: {t * 1e3:.3f} ms")


def c3():
    h, b, layers, lr = 512, 256, 4, 0.01
    x = torch.randn(b, h)
    params = []
    for _ in range(layers):
        params.append((torch.randn(h, h) * (2.0 / h) ** 0.5).requires_grad_())
        params.append((torch.randn(h) * 0.1).requires_grad_())

    def step():
        y = x
        for l in range(layers):
            y = torch.relu(y @ params[2 * l] + params[2 * l + 1])
        loss = (y * y).mean()
        loss.backward()
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
                p.grad = None
        return loss

    t = median(step, 3, 21)
    print(f"torch eager C3 mlp_step: {t * 1e3:.2f} ms")


def c4():
    def graph(a, b):
        c = a + b
        d = a * b + b ** 3
        c = c + (c + 1)
        c = c + (1 + c + (-a))
        d = d + (d * 2 + (b + a).relu())
        d = d + (3 * d + (b - a).relu())
        e = c - d
        f = e ** 2
        g = f / 2.0
        return g + 10.0 / f

    def step():
        a = torch.tensor(-4.0, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
        g = graph(a, b)
        g.backward()
        return g.item(), a.grad.item(), b.grad.item()

    t = median(step, 200, 2001)
    g, da, db = step()
    print(f"torch eager C4 tiny_graph forward+backward: {t * 1e6:.1f} us (g = {g:.4f}, dg/da = {da:.4f}, dg/db = {db:.4f})")


class MiniGpt(torch.nn.Module):
    """The bench card's mini GPT: 6 layers, 6 heads, context 8, d_model 24, vocabulary 65
    (46,337 parameters), pre-norm, ReLU feed-forward, key/query/value without bias, learned
    positions; the heads are one batched product (no per-head loop)."""

    def __init__(self, vocab=65, ctx=8, d=24, heads=6, layers=6):
        super().__init__()
        self.ctx, self.d, self.heads = ctx, d, heads
        self.tok = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Embedding(ctx, d)
        self.blocks = torch.nn.ModuleList()
        for _ in range(layers):
            block = torch.nn.Module()
            block.ln1, block.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
            block.q = torch.nn.Linear(d, d, bias=False)
            block.k = torch.nn.Linear(d, d, bias=False)
            block.v = torch.nn.Linear(d, d, bias=False)
            block.proj = torch.nn.Linear(d, d)
            block.ff1, block.ff2 = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)
            self.blocks.append(block)
        self.lnf = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)
        for p in self.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
            else:
                torch.nn.init.zeros_(p)
        for m in self.modules():
            if isinstance(m, torch.nn.LayerNorm):
                torch.nn.init.ones_(m.weight)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), -1e9), diagonal=1))

    def forward(self, idx, targets):
        t, hs = self.ctx, self.d // self.heads
        x = self.tok(idx) + self.pos.weight
        split = lambda y: y.view(t, self.heads, hs).transpose(0, 1)
        for b in self.blocks:
            h = b.ln1(x)
            q, k, v = split(b.q(h)), split(b.k(h)), split(b.v(h))
            att = torch.softmax(q @ k.transpose(1, 2) / hs ** 0.5 + self.mask, dim=-1)
            x = x + b.proj((att @ v).transpose(0, 1).reshape(t, self.d))
            x = x + b.ff2(torch.relu(b.ff1(b.ln2(x))))
        return F.cross_entropy(self.head(self.lnf(x)), targets)


def c5():
    ctx, lr = 8, 0.1
    model = MiniGpt()
    count = sum(p.numel() for p in model.parameters())
    data = torch.randint(0, 65, (200,))
    state = {"at": 0}

    def step():
        at = state["at"] = (state["at"] + 7) % (200 - ctx - 1)
        loss = model(data[at:at + ctx], data[at + 1:at + ctx + 1])
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        return loss

    t = median(step, 20, 201)
    peak = step_peak(step, model)
    print(f"torch eager C5 mini_gpt ({count} parameters): {t * 1e3:.2f} ms per step; "
          f"peak tensor memory {peak / 1024:.0f} KiB")


def step_peak(step, model):
    """Peak bytes of live tensors during one `step()`: the parameters and data live before it,
    plus the highest running sum of its allocations (+) and frees (-) in the profiler's memory
    events."""
    live = sum(p.numel() * p.element_size() for p in model.parameters())
    live += sum(b.numel() * b.element_size() for b in model.buffers())
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    deltas = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.device_type() == torch.autograd.DeviceType.CPU and e.name() == "[memory]")
    running = high = 0
    for _, n in deltas:
        running += n
        high = max(high, running)
    return live + high


{"c1": c1, "c2": c2, "c3": c3, "c4": c4, "c5": c5}[sys.argv[1]]()
