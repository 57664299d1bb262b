"""JAX peers for the CPU bench card (braid's benches/card.rs runs this in the same command).

Usage: python3 card_jax.py c1|c2|c3|c4|c5. Prints one line: the workload, jax.jit median time.
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


def c3():
    h, b, layers, lr = 512, 256, 4, 0.01
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers + 1)
    x = jax.random.normal(keys[0], (b, h), jnp.float32)
    params = []
    for l in range(layers):
        params.append(jax.random.normal(keys[1 + 2 * l], (h, h), jnp.float32) * (2.0 / h) ** 0.5)
        params.append(jax.random.normal(keys[2 + 2 * l], (h,), jnp.float32) * 0.1)

    def loss(params, x):
        for l in range(layers):
            x = jax.nn.relu(x @ params[2 * l] + params[2 * l + 1])
        return jnp.mean(x * x)

    @jax.jit
    def step(params, x):
        l, g = jax.value_and_grad(loss)(params, x)
        return [p - lr * gp for p, gp in zip(params, g)], l

    state = {"p": params}

    def run():
        state["p"], l = step(state["p"], x)
        l.block_until_ready()

    t = median(run, 3, 21)
    print(f"jax.jit C3 mlp_step: {t * 1e3:.2f} ms")


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
    vg = jax.jit(jax.value_and_grad(graph, argnums=(0, 1)))

    def step():
        g, (da, db) = vg(a, b)
        return float(g), float(da), float(db)

    t = median(step, 200, 2001)
    g, da, db = step()
    print(f"jax.jit C4 tiny_graph forward+backward: {t * 1e6:.2f} us (g = {g:.4f}, dg/da = {da:.4f}, dg/db = {db:.4f})")


{"c1": c1, "c2": c2, "c3": c3, "c4": c4}[sys.argv[1]]()
