"""Time and memory of one Sessa layer's forward: dense feedback solve vs blocked, 1K..16K tokens.

    python benchmarks/sessa_layer.py                       # 1K..16K, d_model 64, 4 heads
    python benchmarks/sessa_layer.py --lengths 1024,2048 --d_model 128

One macro-block (mixer "sessa", RoPE forward branch on blockwise attention so that only the
solve differs), batch 1. "dense" builds B [T, T] and calls a triangular solve
(`solve_reference`); "blocked" recomputes block x block tiles (`solve_blocked`). Both sides run
in this one process, so memory is the compiler's plan (`memory_analysis`: scratch plus
arguments and outputs), not RSS. Seconds exclude compilation (compiled ahead, then timed, best
of `--repeats`); a dense point whose plan exceeds `--max_dense_gib` is planned but not run.
The Pallas kernel is not timed: interpret mode says nothing about speed.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "1024,2048,4096,8192,16384", "lengths, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("d_model", 64, "model width", flag_values=FLAGS)
flags.DEFINE_integer("heads", 4, "attention heads", flag_values=FLAGS)
flags.DEFINE_integer("block", 256, "block size of the blocked solve", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 2, "timed calls; the best is kept", flag_values=FLAGS)
flags.DEFINE_float("max_dense_gib", 6.0, "skip the dense solve when its plan exceeds this", flag_values=FLAGS)

GiB = 2 ** 30


def layer_fn(solve: str, d_model: int, heads: int, block: int):
    import jax
    from flax import nnx

    from models.lm import ModelConfig
    from models.sessa import MacroBlock

    cfg = ModelConfig(d_model=d_model, num_heads=heads, mixer="sessa", attention_impl="blockwise",
                      block_size=512, mixer_options=(("solve", solve), ("solve_block", block)))
    graphdef, state = nnx.split(MacroBlock(cfg, rngs=nnx.Rngs(0)))

    def forward(state, x):
        positions = jax.numpy.arange(x.shape[1])[None]
        return nnx.merge(graphdef, state)(x, tokens=None, positions=positions)

    return jax.jit(forward), state


def measure(solve, length) -> dict:
    import jax

    fn, state = layer_fn(solve, FLAGS.d_model, FLAGS.heads, FLAGS.block)
    x = jax.random.normal(jax.random.key(0), (1, length, FLAGS.d_model))
    compiled = fn.lower(state, x).compile()
    mem = compiled.memory_analysis()
    plan = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
    row = {"solve": solve, "length": length, "plan_gib": plan / GiB, "seconds": None}
    if solve == "reference" and plan / GiB > FLAGS.max_dense_gib:
        return row
    best = float("inf")
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(state, x))
        best = min(best, time.perf_counter() - start)
    row["seconds"] = best
    return row


def main(argv):
    del argv  # flags only
    print(f"machine: {os.cpu_count()}-core CPU (shared), one Sessa layer forward, batch 1, "
          f"d_model {FLAGS.d_model}, {FLAGS.heads} heads, block {FLAGS.block}")
    print("| tokens | dense s | blocked s | time ratio (blocked/dense) | dense plan GiB | blocked plan GiB "
          "| memory ratio |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for length in map(int, FLAGS.lengths.split(",")):
        dense, blocked = measure("reference", length), measure("blocked", length)
        fmt = lambda s: "not run" if s is None else f"{s:.3f}"  # noqa: E731
        ratio = "" if dense["seconds"] is None else f"{blocked['seconds'] / dense['seconds']:.2f}"
        print(f"| {length:,} | {fmt(dense['seconds'])} | {fmt(blocked['seconds'])} | {ratio} | "
              f"{dense['plan_gib']:.3f} | {blocked['plan_gib']:.3f} | "
              f"{blocked['plan_gib'] / dense['plan_gib']:.3f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
