"""ESPR speed: training throughput against RoPE, and linear-time random-feature attention.

    python benchmarks/espr.py                      # both parts
    python benchmarks/espr.py --part train --batch 8 --steps 5
    python benchmarks/espr.py --part rf --lengths 1024,4096,65536 --max-exact 32768
    python benchmarks/espr.py --part cayley


train: `espr` and `rope` training steps in one process, via benchmarks/train_throughput.py
(interleaved rounds, median), printed as a ratio to RoPE.
rf: the forward time of one attention layer (scheme transform + attention, jitted) of
`espr_rf` (blockwise prefix sums) and of exact `espr` attention (blockwise online softmax)
at each length, their ratio, and the crossover: the first measured length from which the
random-feature form is faster. Exact attention is timed up to --max-exact tokens only.
cayley: one Cayley map P = (I - S)(I + S)^-1 of a head_dim x head_dim skew S, forward +
backward, as `espr.cayley` computes it (Gauss-Jordan in XLA ops) against a LAPACK solve
(`jnp.linalg.solve`), interleaved, median and max.
"""

from __future__ import annotations

import platform
import statistics
import time


import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from benchmarks import train_throughput
from models.registry import get_entry, make_scheme
from models.lm import ModelConfig
from positional import espr

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_enum("part", "both", ("train", "rf", "cayley", "both"), "what to time", flag_values=FLAGS)
flags.DEFINE_integer("batch", 8, "train: rows per step", flag_values=FLAGS)
flags.DEFINE_integer("seq_len", 256, "train: tokens per row", flag_values=FLAGS)
flags.DEFINE_integer("steps", 5, "train: timed steps per scheme per round", flag_values=FLAGS)
flags.DEFINE_integer("rounds", 3, "train: interleaved rounds", flag_values=FLAGS)
flags.DEFINE_string("lengths", "512,1024,2048,4096,8192,16384,32768,65536", "rf: lengths, comma-separated",
                    flag_values=FLAGS)
flags.DEFINE_integer("max_exact", 32768, "rf: longest length for exact attention", flag_values=FLAGS)
flags.DEFINE_integer("heads", 4, "rf: attention heads", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 64, "rf and cayley: dimension per head", flag_values=FLAGS)
flags.DEFINE_integer("features", 128, "rf: random features", flag_values=FLAGS)
flags.DEFINE_integer("block", 512, "rf: attention block size", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 50, "calls per route of the cayley part", flag_values=FLAGS)
flags.DEFINE_alias("seq-len", "seq_len", flag_values=FLAGS)  # as docs and RESULTS.md spell it
flags.DEFINE_alias("max-exact", "max_exact", flag_values=FLAGS)
flags.DEFINE_alias("head-dim", "head_dim", flag_values=FLAGS)


def attention_forward(name: str, heads: int, head_dim: int, block: int, **options):
    """A jitted (q, k, v, positions) -> out of one layer's scheme, features built once."""
    scheme = make_scheme(name, num_heads=heads, head_dim=head_dim, **options)
    cfg = ModelConfig(vocab_size=2, d_model=heads * head_dim, num_heads=heads, scheme=name)
    features = get_entry(name).features(scheme, cfg, rngs=nnx.Rngs(0))
    feats = features(None, tokens=None, index=None, rng=jax.random.key(0))
    return jax.jit(lambda q, k, v, pos: scheme.attend(q, k, v, feats, positions=pos, impl="blockwise",
                                                       block_size=block))


def time_call(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rf_part() -> list[tuple]:
    rf = attention_forward("espr_rf", FLAGS.heads, FLAGS.head_dim, FLAGS.block, num_features=FLAGS.features,
                           draw_seed=0)
    exact = attention_forward("espr", FLAGS.heads, FLAGS.head_dim, FLAGS.block)
    rows = []
    print(f"one attention layer, batch 1, {FLAGS.heads} heads x {FLAGS.head_dim}, n_rf {FLAGS.features}, "
          f"block {FLAGS.block}\n\n| tokens | espr_rf (s) | exact espr (s) | rf / exact |\n"
          "|---:|---:|---:|---:|",
          flush=True)
    for t in [int(x) for x in FLAGS.lengths.split(",")]:
        keys = jax.random.split(jax.random.key(t), 3)
        q, k, v = (jax.random.normal(kk, (1, t, FLAGS.heads, FLAGS.head_dim)) for kk in keys)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        repeats = 3 if t <= 16384 else 1
        t_rf = time_call(rf, (q, k, v, pos), repeats)
        t_ex = time_call(exact, (q, k, v, pos), repeats) if t <= FLAGS.max_exact else float("nan")
        rows.append((t, t_rf, t_ex))
        print(f"| {t:,} | {t_rf:.3f} | {t_ex:.3f} | {t_rf / t_ex:.2f} |", flush=True)
    faster = [t for t, a, b in rows if a < b]
    print(f"\ncrossover: random features faster from {faster[0]:,} tokens (first measured length)"
          if faster else "\ncrossover: not reached at the measured lengths")
    return rows


def cayley_part() -> None:
    d = FLAGS.head_dim
    eye = jnp.eye(d)
    weights = jnp.arange(d * d, dtype=jnp.float32).reshape(d, d)  # a loss that reads every entry
    routes = {"espr.cayley (Gauss-Jordan)": espr.cayley,
              "LAPACK solve": lambda s: jnp.linalg.solve(eye + s, eye - s)}
    fns = {name: jax.jit(jax.grad(lambda a, f=f: jnp.sum(f(espr.skew(a)) * weights)))
           for name, f in routes.items()}
    a = 0.1 * jax.random.normal(jax.random.key(0), (d, d))
    times = {name: [] for name in fns}
    for fn in fns.values():
        jax.block_until_ready(fn(a))
    for _ in range(FLAGS.repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(a))
            times[name].append(time.perf_counter() - t0)
    print(f"\nCayley map of a {d} x {d} skew S, forward + backward, {FLAGS.repeats} interleaved calls\n\n"
          "| route | median (ms) | max (ms) |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} | {max(ts) * 1e3:.2f} |", flush=True)


def main(argv):
    del argv  # flags only
    print(f"machine: {platform.machine()}, {jax.devices()[0].platform} ({jax.device_count()} device), "
          f"jax {jax.__version__}", flush=True)
    if FLAGS.part in ("train", "both"):
        train_throughput.FLAGS(["train_throughput", "--schemes=rope,espr", f"--batch={FLAGS.batch}",
                                f"--seq_len={FLAGS.seq_len}", f"--steps={FLAGS.steps}", f"--rounds={FLAGS.rounds}"])
        train_throughput.benchmark()
    if FLAGS.part in ("rf", "both"):
        rf_part()
    if FLAGS.part == "cayley":
        cayley_part()


if __name__ == "__main__":
    app.run(main)
