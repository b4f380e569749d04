"""The pair rotation of RoPE / SO(2) / ESPR: `rope.rotate` against the plain formula, in one process.

    python benchmarks/rotation.py                          # [16, 256, 4, 64], angles shared by heads
    python benchmarks/rotation.py --shape 8,1024,8,128 --repeats 20

"plain" is the rotation written as jnp expressions and differentiated by JAX (what
`rope.rotate` was before its written-out VJP and its once-per-angle cos/sin); "rotate" is
`rope.rotate`. Each is timed forward, forward + backward into x (fixed angles: RoPE), and
forward + backward into x and the angles (learned angles: SO(2), ESPR), for a layer's Q/K/V
use: q, k and v rotated, then the head output rotated back. Calls alternate between the two
and the fastest of `--repeats` is kept, so load from other jobs falls on both.
"""

from __future__ import annotations

import functools
import time


import jax
import jax.numpy as jnp
from absl import app, flags

from positional.rope import rotate

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("shape", "16,256,4,64", "B,T,H,D of q, k, v", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 30, "timed calls; the fastest is kept", flag_values=FLAGS)


def plain_rotate(x, angles, layout="half", inverse=False):
    """The reference: half-layout rotation as jnp expressions, JAX's own gradient."""
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    sin = -sin if inverse else sin
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def layer(rot, q, k, v, angles, g):
    """Q/K/V transport around a stand-in for attention (a sum over heads keeps it cheap)."""
    q, k, v = rot(q, angles), rot(k, angles), rot(v, angles, inverse=True)
    out = q * k.mean(2, keepdims=True) + v
    return jnp.sum(rot(out, angles) * g)


def compiled(rot, argnums):
    """The layer's forward (argnums None) or its gradient in `argnums`, jitted."""
    fn = functools.partial(layer, rot)
    return jax.jit(fn if argnums is None else jax.grad(fn, argnums))


def benchmark() -> dict:
    """{case: {"plain": best seconds, "rotate": best seconds}}, as FLAGS ask."""
    b, t, h, d = map(int, FLAGS.shape.split(","))
    keys = jax.random.split(jax.random.key(0), 5)
    q, k, v, g = (jax.random.normal(key, (b, t, h, d)) for key in keys[:4])
    angles = jax.random.uniform(keys[4], (b, t, 1, d // 2), minval=-3.0, maxval=3.0)
    inputs = (q, k, v, angles, g)
    cases = {"forward": None, "fwd + bwd (x)": (0, 1, 2), "fwd + bwd (x, angles)": (0, 1, 2, 3)}
    print(f"q, k, v [{b}, {t}, {h}, {d}], angles [{b}, {t}, 1, {d // 2}]; jax {jax.__version__} on "
          f"{jax.devices()[0].platform}; fastest of {FLAGS.repeats}\n")
    print("| case | plain ms | rotate ms | plain / rotate |\n|---|---:|---:|---:|")
    rows = {}
    for name, argnums in cases.items():
        fns = {"plain": compiled(plain_rotate, argnums), "rotate": compiled(rotate, argnums)}
        for f in fns.values():  # compile both before timing either
            jax.block_until_ready(f(*inputs))
        best = {n: float("inf") for n in fns}
        for _ in range(FLAGS.repeats):  # alternate, so load falls on both
            for n, f in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*inputs))
                best[n] = min(best[n], time.perf_counter() - t0)
        rows[name] = best
        print(f"| {name} | {best['plain'] * 1e3:.2f} | {best['rotate'] * 1e3:.2f} | "
              f"{best['plain'] / best['rotate']:.2f} |")
    return rows


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
