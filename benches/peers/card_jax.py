"""JAX peers for the CPU bench card (braid's benches/card.rs runs this in the same command).

Usage: python3 card_jax.py c1|c2|c3|c4|c5. Prints one line: the workload, jax.jit median time.
Each timed run waits for everything braid's row holds: the training steps (C3, C5) for the loss
and every updated parameter (`jax.value_and_grad` over all of them, SGD applied to all).
Exits 1 with a message on stderr when JAX is not installed.
"""
import sys

from timing import median

try:
    import jax
    import jax.numpy as jnp
except ImportError:
    sys.stderr.write("jax is not installed (pip install jax)\n")
    sys.exit(1)

jax.config.update("jax_enable_x64", True)


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
        # Every updated parameter, not only the loss, is ready before the clock stops.
        jax.block_until_ready((state["p"], l))

    t = median(run, 3, 21)
    print(f"jax.jit C3 mlp_step: {t * 1e3:.2f} ms")


def c5():
    vocab, ctx, d, heads, layers, lr = 65, 8, 24, 6, 6, 0.1
    keys = iter(jax.random.split(jax.random.PRNGKey(0), 200))

    def w(*shape):
        return jax.random.normal(next(keys), shape, jnp.float32) * 0.02

    def lin(i, o):
        return (w(i, o), jnp.zeros((o,), jnp.float32))

    def ln():
        return (jnp.ones((d,), jnp.float32), jnp.zeros((d,), jnp.float32))

    params = {
        "tok": w(vocab, d), "pos": w(ctx, d), "lnf": ln(), "head": lin(d, vocab),
        "layers": [{"ln1": ln(), "q": w(d, d), "k": w(d, d), "v": w(d, d), "proj": lin(d, d),
                    "ln2": ln(), "ff1": lin(d, 4 * d), "ff2": lin(4 * d, d)} for _ in range(layers)],
    }
    count = sum(x.size for x in jax.tree_util.tree_leaves(params))
    mask = jnp.where(jnp.arange(ctx)[None, :] > jnp.arange(ctx)[:, None], -1e9, 0.0)

    def norm(x, gb):
        m = x.mean(-1, keepdims=True)
        v = ((x - m) ** 2).mean(-1, keepdims=True)
        return (x - m) / jnp.sqrt(v + 1e-5) * gb[0] + gb[1]

    def loss(p, idx, tgt):
        x = p["tok"][idx] + p["pos"]
        hs = d // heads
        split = lambda t: t.reshape(ctx, heads, hs).transpose(1, 0, 2)
        for l in p["layers"]:
            h = norm(x, l["ln1"])
            q, k, v = split(h @ l["q"]), split(h @ l["k"]), split(h @ l["v"])
            att = jax.nn.softmax(q @ k.transpose(0, 2, 1) / hs ** 0.5 + mask, axis=-1)
            x = x + (att @ v).transpose(1, 0, 2).reshape(ctx, d) @ l["proj"][0] + l["proj"][1]
            h = norm(x, l["ln2"])
            x = x + jax.nn.relu(h @ l["ff1"][0] + l["ff1"][1]) @ l["ff2"][0] + l["ff2"][1]
        logits = norm(x, p["lnf"]) @ p["head"][0] + p["head"][1]
        return -jax.nn.log_softmax(logits)[jnp.arange(ctx), tgt].mean()

    @jax.jit
    def step(p, idx, tgt):
        l, g = jax.value_and_grad(loss)(p, idx, tgt)
        return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g), l

    data = jax.random.randint(next(keys), (200,), 0, vocab)
    state = {"p": params, "at": 0}

    def run():
        at = state["at"] = (state["at"] + 7) % (200 - ctx - 1)
        state["p"], l = step(state["p"], data[at:at + ctx], data[at + 1:at + ctx + 1])
        jax.block_until_ready((state["p"], l))

    t = median(run, 20, 201)
    print(f"jax.jit C5 mini_gpt ({count} parameters): {t * 1e3:.2f} ms per step")


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


{"c1": c1, "c2": c2, "c3": c3, "c4": c4, "c5": c5}[sys.argv[1]]()
