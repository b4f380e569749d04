"""Forward time per token against length: chunked PaTH against blockwise RoPE, in one process;
with --memory, the training memory of chunked PaTH instead.

    python benchmarks/path_length.py --lengths 1024,2048,4096,8192
    python benchmarks/path_length.py --memory --lengths 2048,4096,8192,16384
    python benchmarks/path_length.py --memory --rss --lengths 2048,4096,8192,16384

The default model (configs/default.py, byte vocab 258) scores one row with `token_nll`, as the
eval loop does: RoPE with blockwise attention (512-token blocks), PaTH with its chunked
algorithm (64-token chunks, configs/default.py). Both are compiled first; then the calls
alternate, `--repeats` times each, and the fastest is kept, so load from other jobs on a
shared machine falls on both. Attention is O(T^2), so time per token grows linearly for both;
the ratio column says whether PaTH's grows faster than attention's.

--memory: XLA's temporary memory (compiled only, nothing runs) for forward + backward of one
layer's PaTH-FoX attention at the default model's shapes (one row, 4 heads of 64, 64-token
chunks), by the chunked form's recomputing backward and by autodiff through its scans.
--memory --rss: the recomputing forward + backward run for real, each length in a fresh process:
its peak RSS (`ru_maxrss`), the part compiling took (the peak once compiled and the inputs made,
minus the process's before) and the part the run added.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path


import jax
from absl import app, flags
from flax import nnx

import jax.numpy as jnp

from configs.default import get_config
from models.lm import DecoderLM, ModelConfig, token_nll
from positional.fox import forget_bias
from positional.path.chunked import chunked_attention

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "1024,2048,4096,8192", "sequence lengths, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 2, "timed calls; the best is kept", flag_values=FLAGS)
flags.DEFINE_bool("memory", False, "print one layer's training memory (recompute vs autodiff) instead of times",
                  flag_values=FLAGS)
flags.DEFINE_bool("rss", False, "with --memory: run the recomputing forward + backward, each length in a fresh "
                  "process, and print its peak RSS", flag_values=FLAGS)
flags.DEFINE_integer("rss_child", 0, "internal: measure this one length and print its JSON", flag_values=FLAGS)

VOCAB = 258
SCHEMES = ("rope", "path")


def compiled_forward(scheme: str, length: int):
    model_dict = {**get_config(scheme).model.to_dict(), "vocab_size": VOCAB}
    if scheme == "rope":
        model_dict["attention_impl"] = "blockwise"
    model = DecoderLM(ModelConfig.from_dict(model_dict), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (1, length + 1), 0, VOCAB)
    fn = jax.jit(lambda state, tokens: token_nll(nnx.merge(graphdef, state), tokens)[0])
    return fn.lower(state, tokens).compile(), state, tokens


def layer_grad(length: int, autodiff: bool):
    """Forward + backward of one layer's PaTH-FoX attention (default model shapes, one row),
    compiled, and its argument shapes."""
    model = get_config("path_fox").model
    h, d = model.num_heads, model.d_model // model.num_heads
    q, kv = (jax.ShapeDtypeStruct((1, length, h, d), jnp.float32) for _ in range(2))
    beta, log_f = (jax.ShapeDtypeStruct((1, length, h), jnp.float32) for _ in range(2))

    def loss(q, k, v, w, beta, log_f):
        return chunked_attention(q, k, v, w, beta, bias_fn=forget_bias(log_f, d ** -0.5), chunk=model.block_size,
                                 autodiff=autodiff).sum()

    args = (q, kv, kv, kv, beta, log_f)
    return jax.jit(jax.grad(loss, argnums=range(6))).lower(*args).compile(), args


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_point(length: int) -> dict:
    """Runs in a fresh process: the recomputing forward + backward at `length`, run once."""
    floor = peak_rss_bytes()
    compiled, shapes = layer_grad(length, autodiff=False)
    keys = jax.random.split(jax.random.key(0), len(shapes))
    args = [jax.random.normal(key, s.shape, s.dtype) for key, s in zip(keys, shapes)]
    args[3] = args[3] / jnp.linalg.norm(args[3], axis=-1, keepdims=True)  # w: unit rows
    args[4], args[5] = jax.nn.sigmoid(args[4]) * 2, jax.nn.log_sigmoid(args[5] + 3)  # beta in (0, 2), log f < 0
    compiled_at = peak_rss_bytes()  # tells compile-time memory apart from run-time memory
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    return {"seconds": time.perf_counter() - t0, "floor": floor, "compiled": compiled_at, "peak": peak_rss_bytes(),
            "xla_temp": compiled.memory_analysis().temp_size_in_bytes}


def rss(lengths: list[int]) -> dict:
    """{length: rss_point's JSON}, each from its own process."""
    table = {}
    for n in lengths:
        cmd = [sys.executable, str(Path(__file__).resolve()), f"--rss_child={n}"]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        table[n] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}: one PaTH-FoX layer's attention, forward + "
          f"recomputing backward, run once per fresh process\n")
    print("| length | seconds | peak RSS MiB | compiling added MiB | the run added MiB | XLA temp MiB |")
    print("|---:|---:|---:|---:|---:|---:|")
    mib = 2 ** 20
    for n, row in table.items():
        print(f"| {n:,} | {row['seconds']:.2f} | {row['peak'] / mib:.0f} | {(row['compiled'] - row['floor']) / mib:.0f} | "
              f"{(row['peak'] - row['compiled']) / mib:.0f} | {row['xla_temp'] / mib:.0f} |")
    return table


def memory() -> dict:
    """{length: {"recompute" | "autodiff": temporary bytes}} as FLAGS ask (with --rss: `rss()`'s table)."""
    lengths = [int(x) for x in FLAGS.lengths.split(",")]
    if FLAGS.rss:
        return rss(lengths)
    table = {n: {way: layer_grad(n, way == "autodiff")[0].memory_analysis().temp_size_in_bytes for way in ("recompute", "autodiff")}
             for n in lengths}
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}: one PaTH-FoX layer's attention, forward + "
          f"backward, XLA temp memory\n")
    print("| length | recompute MiB | autodiff MiB | autodiff / recompute |")
    print("|---:|---:|---:|---:|")
    for n, row in table.items():
        r, a = row["recompute"] / 2 ** 20, row["autodiff"] / 2 ** 20
        print(f"| {n:,} | {r:.1f} | {a:.1f} | {a / r:.1f} |")
    return table


def benchmark() -> dict:
    """{length: {scheme: best seconds}} as FLAGS ask (with --memory: `memory()`'s table)."""
    if FLAGS.memory:
        return memory()
    lengths = [int(x) for x in FLAGS.lengths.split(",")]
    seconds = {}
    for length in lengths:
        calls = {s: compiled_forward(s, length) for s in SCHEMES}
        best = {s: float("inf") for s in SCHEMES}
        for _ in range(FLAGS.repeats):
            for s, (fn, state, tokens) in calls.items():
                t0 = time.perf_counter()
                fn(state, tokens).block_until_ready()
                best[s] = min(best[s], time.perf_counter() - t0)
        seconds[length] = best
        print(f"# {length}: {best}", file=sys.stderr, flush=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, best of {FLAGS.repeats}\n")
    print("| length | rope s | path s | rope us/token | path us/token | path / rope |")
    print("|---:|---:|---:|---:|---:|---:|")
    for length, best in seconds.items():
        r, pth = best["rope"], best["path"]
        print(f"| {length:,} | {r:.2f} | {pth:.2f} | {1e6 * r / length:.0f} | {1e6 * pth / length:.0f} | "
              f"{pth / r:.2f} |")
    return seconds


def main(argv):
    del argv  # flags only
    if FLAGS.rss_child:
        print(json.dumps(rss_point(FLAGS.rss_child)))
    else:
        benchmark()


if __name__ == "__main__":
    app.run(main)
