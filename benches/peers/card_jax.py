"""JAX peers for the CPU bench card (braid's benches/card.rs runs this in the same command).

Usage: python3 card_jax.py c1|c2|c4. Prints one line: the workload, jax.jit median time.
Exits 1 with a message on stderr when JAX is not installed.
"""
import sys
import time

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    sys.stderr.write("jax is not installed (pip install jax)\n")
    sys.exit(1)

jax.config.update("jax_enable_x64", True)


def median(f, warm=2, runs=9):
    for _ in range(warm):
        f()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2]


def c1():
    n = 16 << 20
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(k1, (n,), jnp.float32)
    w = jax.random.normal(k2, (n,), jnp.float32)
    f = jax.jit(lambda x, w: jax.nn.gelu(x * w + 1.0, approximate=True) * jax.nn.sigmoid(x))
    t = median(lambda: f(x, w).block_until_ready())
    print(f"jax.jit C1 chain: {t * 1e3:.2f} ms")


def c2():
    x = jax.random.normal(jax.random.PRNGKey(0), (2048, 1024), jnp.float32)

    def composed(x):
        e = jnp.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    f = jax.jit(composed)
    t = median(lambda: f(x).block_until_ready(), 3, 15)
    print(f"jax.jit C2 softmax: {t * 1e3:.3f} ms")


def c4():
    def graph(a, b):
        c = a + b
        d = a * b + b ** 3
        c = c + (c + 1)
        c = c + (1 + c + (-a))
        d = d + (d * 2 + jax.nn.relu(b + a))
        d = d + (3 * d + jax.nn.relu(b - a))
        e = c - d
        f = e ** 2
        g = f / 2.0
        return g + 10.0 / f

    f = jax.jit(graph)
    a, b = jnp.float64(-4.0), jnp.float64(2.0)
    t = median(lambda: float(f(a, b)), 200, 2001)
    print(f"jax.jit C4 tiny_graph forward: {t * 1e6:.2f} us (g = {float(f(a, b)):.4f})")


{"c1": c1, "c2": c2, "c4": c4}[sys.argv[1]]()
