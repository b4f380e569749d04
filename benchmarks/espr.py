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

import argparse
import platform
import statistics
import time


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import train_throughput  # noqa: E402  (beside this file)
from models.registry import get_entry, make_scheme  # noqa: E402
from models.lm import ModelConfig  # noqa: E402
from positional import espr  # noqa: E402


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


def rf_part(args) -> list[tuple]:
    rf = attention_forward("espr_rf", args.heads, args.head_dim, args.block, num_features=args.features,
                           draw_seed=0)
    exact = attention_forward("espr", args.heads, args.head_dim, args.block)
    rows = []
    print(f"one attention layer, batch 1, {args.heads} heads x {args.head_dim}, n_rf {args.features}, "
          f"block {args.block}\n\n| tokens | espr_rf (s) | exact espr (s) | rf / exact |\n"
          "|---:|---:|---:|---:|",
          flush=True)
    for t in [int(x) for x in args.lengths.split(",")]:
        keys = jax.random.split(jax.random.key(t), 3)
        q, k, v = (jax.random.normal(kk, (1, t, args.heads, args.head_dim)) for kk in keys)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        repeats = 3 if t <= 16384 else 1
        t_rf = time_call(rf, (q, k, v, pos), repeats)
        t_ex = time_call(exact, (q, k, v, pos), repeats) if t <= args.max_exact else float("nan")
        rows.append((t, t_rf, t_ex))
        print(f"| {t:,} | {t_rf:.3f} | {t_ex:.3f} | {t_rf / t_ex:.2f} |", flush=True)
    faster = [t for t, a, b in rows if a < b]
    print(f"\ncrossover: random features faster from {faster[0]:,} tokens (first measured length)"
          if faster else "\ncrossover: not reached at the measured lengths")
    return rows


def cayley_part(args) -> None:
    d = args.head_dim
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
    for _ in range(args.repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(a))
            times[name].append(time.perf_counter() - t0)
    print(f"\nCayley map of a {d} x {d} skew S, forward + backward, {args.repeats} interleaved calls\n\n"
          "| route | median (ms) | max (ms) |\n|---|---:|---:|")
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts) * 1e3:.2f} | {max(ts) * 1e3:.2f} |", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("train", "rf", "cayley", "both"), default="both")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lengths", default="512,1024,2048,4096,8192,16384,32768,65536")
    p.add_argument("--max-exact", type=int, default=32768)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--features", type=int, default=128)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--repeats", type=int, default=50, help="calls per route of the cayley part")
    args = p.parse_args(argv)
    print(f"machine: {platform.machine()}, {jax.devices()[0].platform} ({jax.device_count()} device), "
          f"jax {jax.__version__}", flush=True)
    if args.part in ("train", "both"):
        train_throughput.main(["--schemes", "rope,espr", "--batch", str(args.batch), "--seq-len",
                               str(args.seq_len), "--steps", str(args.steps), "--rounds", str(args.rounds)])
    if args.part in ("rf", "both"):
        rf_part(args)
    if args.part == "cayley":
        cayley_part(args)


if __name__ == "__main__":
    main()
