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

import json
import sys
from pathlib import Path

from absl import app, flags

from benchmarks.sequence_parallel import child, on_devices

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("blockwise", "ring")

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_enum("what", "layer", ("layer", "step"), "one attention call, or the model's train step",
                  flag_values=FLAGS)
flags.DEFINE_integer("seq_len", 8192, "tokens in the one row", flag_values=FLAGS)
flags.DEFINE_string("devices", "1,2,4,8", "simulated device counts, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("steps", 3, "timed runs after a warm-up (0: memory only)", flag_values=FLAGS)
flags.DEFINE_integer("heads", 8, "attention heads", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 64, "dimension per head", flag_values=FLAGS)
flags.DEFINE_integer("block_size", 512, "attention block size", flag_values=FLAGS)
flags.DEFINE_string("child", "", "internal: measure this impl on the one device count given, print its "
                    "JSON (the process `on_devices` starts)", flag_values=FLAGS)
flags.DEFINE_alias("seq-len", "seq_len", flag_values=FLAGS)  # as docs and RESULTS.md spell it
flags.DEFINE_alias("head-dim", "head_dim", flag_values=FLAGS)
flags.DEFINE_alias("block-size", "block_size", flag_values=FLAGS)


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


def benchmark() -> list[dict]:
    """One row per (device count, impl), as FLAGS ask; none in a --child process."""
    if FLAGS.child:
        impl, seq_len, n = FLAGS.child, FLAGS.seq_len, int(FLAGS.devices)
        out = (layer(impl, seq_len, n, FLAGS.steps, FLAGS.heads, FLAGS.head_dim, FLAGS.block_size)
               if FLAGS.what == "layer" else step(impl, seq_len, n, FLAGS.steps))
        print(json.dumps(out))
        return []
    rows = []
    for n in (int(x) for x in FLAGS.devices.split(",")):
        for impl in IMPLS:
            point = [f"--what={FLAGS.what}", f"--steps={FLAGS.steps}", f"--heads={FLAGS.heads}",
                     f"--head_dim={FLAGS.head_dim}", f"--block_size={FLAGS.block_size}",
                     f"--seq_len={FLAGS.seq_len}", f"--devices={n}", f"--child={impl}"]
            rows.append({"impl": impl, "devices": n, **on_devices(__file__, n, point)})
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    what = ("forward + backward of one attention call, q, k, v [1, T, "
            f"{FLAGS.heads}, {FLAGS.head_dim}] fp32, block {FLAGS.block_size}" if FLAGS.what == "layer"
            else "the default rope model's train step, one row")
    print(f"\n{what}; {FLAGS.seq_len} tokens split over mesh sequence=n; per device\n")
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


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
