"""Ring attention against the partitioner's gather as the sequence axis grows, at a fixed total
length: per-device memory (XLA's memory analysis of the compiled program) and wall time.

    python benchmarks/ring_attention.py --seq-len 8192 --devices 1,2,4,8 --steps 3
    python benchmarks/ring_attention.py --what step --seq-len 4096 --steps 2   # a train step

--what layer (default): forward + backward of one attention call, q, k, v [1, T, H, D] split
over mesh sequence=n, impl "ring" (keys and values round the ring, positional/ring.py) against
impl "blockwise" under the SPMD partitioner (its keys and values gathered). --what step: the
default model's train step, as benchmarks/sequence_parallel.py measures it (its `child`).
Each device count runs in its own process (`--xla_force_host_platform_device_count=n`). The
simulated devices share this host's cores, so times show the programs' overhead and total work
(a gather that makes every device do all the work shows as n times slower), not a real speed-up.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sequence_parallel import child, on_devices  # noqa: E402
IMPLS = ("blockwise", "ring")


def layer(impl: str, seq_len: int, n: int, steps: int, heads: int, head_dim: int, block: int) -> dict:
    import time

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from models.sharding import MESH_AXES, activation_rules
    from positional.attention import attention
    mesh = jax.make_mesh((1, 1, 1, n), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)
    split = NamedSharding(mesh, P(None, "sequence"))
    q, k, v = (jax.device_put(jax.random.normal(key, (1, seq_len, heads, head_dim)), split)
               for key in jax.random.split(jax.random.key(0), 3))

    def loss(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v, impl=impl, block_size=block)))

    with activation_rules(mesh):  # where impl "ring" finds the mesh, as in the train step
        grad = jax.jit(jax.grad(loss, (0, 1, 2)), out_shardings=(split,) * 3).lower(q, k, v).compile()
    mem = grad.memory_analysis()
    out = {"argument_bytes": mem.argument_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
           "total_bytes": mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes}
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        jax.block_until_ready(grad(q, k, v))
        times.append(time.perf_counter() - t0)
    out["seconds"] = sorted(times[1:])[len(times[1:]) // 2] if steps else float("nan")
    return out


def step(impl: str, seq_len: int, n: int, steps: int) -> dict:
    out = child("rope", seq_len, n, impl, steps)
    return {**out, "seconds": out.get("step_seconds", float("nan"))}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--what", choices=("layer", "step"), default="layer")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--devices", default="1,2,4,8")
    p.add_argument("--steps", type=int, default=3, help="timed runs after a warm-up (0: memory only)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        impl, seq_len, n = args.child[0], int(args.child[1]), int(args.child[2])
        out = (layer(impl, seq_len, n, args.steps, args.heads, args.head_dim, args.block_size)
               if args.what == "layer" else step(impl, seq_len, n, args.steps))
        print(json.dumps(out))
        return []
    rows = []
    for n in (int(x) for x in args.devices.split(",")):
        for impl in IMPLS:
            flags = [f"--what={args.what}", f"--steps={args.steps}", f"--heads={args.heads}",
                     f"--head-dim={args.head_dim}", f"--block-size={args.block_size}",
                     "--child", impl, str(args.seq_len), str(n)]
            rows.append({"impl": impl, "devices": n, **on_devices(__file__, n, flags)})
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    what = ("forward + backward of one attention call, q, k, v [1, T, "
            f"{args.heads}, {args.head_dim}] fp32, block {args.block_size}" if args.what == "layer"
            else "the default rope model's train step, one row")
    print(f"\n{what}; {args.seq_len} tokens split over mesh sequence=n; per device\n")
    print("| devices | blockwise total MiB | ring total MiB | ring / blockwise memory | blockwise s | ring s "
          "| ring / blockwise time |")
    print("|---|---|---|---|---|---|---|")
    mib = lambda b: f"{b / 2 ** 20:,.1f}"  # noqa: E731
    for n in sorted({r["devices"] for r in rows}):
        g, r = (next(x for x in rows if x["devices"] == n and x["impl"] == i) for i in IMPLS)
        print(f"| {n} | {mib(g['total_bytes'])} | {mib(r['total_bytes'])} "
              f"| {r['total_bytes'] / g['total_bytes']:.2f} | {g['seconds']:.2f} | {r['seconds']:.2f} "
              f"| {r['seconds'] / g['seconds']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
