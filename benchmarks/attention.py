"""One attention call per scheme, forward + backward, against cuDNN plain softmax.

    python benchmarks/attention.py                                    # 8K, 16K, 32K tokens
    python benchmarks/attention.py --schemes rope,alibi,fox --lengths 8192 --impls auto,blockwise

Each scheme attends bf16 q, k, v [1, T, 16, 128] (batch 1, 16 heads of 128) at its default
features (`Scheme.attend` with features None: what a notebook call gets) through each of
--impls ("auto" by default: what a model picks on this platform); the baseline is plain causal
softmax by `jax.nn.dot_product_attention` with implementation "cudnn" on a GPU ("xla"
elsewhere, and the table says so). Both sides run in this process; each call is compiled once
and timed as the median of --repeats calls. Reported: forward ms, forward + backward ms (the
gradient of sum(out * c) w.r.t. q, k, v), throughput as a ratio to the baseline's (> 1 is
faster), and the compiled program's temporary memory (XLA's memory analysis), which shows a
T x T buffer at once.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from models.registry import make_scheme

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("schemes", "rope,alibi,fox,kerple_log,tapa,rope+alibi,so2_learned_qkv+alibi",
                    "comma-separated registry names", flag_values=FLAGS)
flags.DEFINE_string("lengths", "8192,16384,32768", "comma-separated sequence lengths", flag_values=FLAGS)
flags.DEFINE_string("impls", "auto", "comma-separated attention impls per scheme", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "query heads (and kv heads)", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 128, "dimension per head", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 10, "timed calls per case (the median is reported)", flag_values=FLAGS)


def timed(fn, args, repeats: int) -> tuple[float, int]:
    """(median seconds of one call, temporary bytes of the compiled program)."""
    compiled = jax.jit(fn).lower(*args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), temp


def fwd_bwd(fn):
    def loss(q, k, v):
        out = fn(q, k, v).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))
    return jax.grad(loss, (0, 1, 2))


def contenders(t: int) -> dict:
    """name -> fn(q, k, v): the baseline, then every scheme x impl."""
    on_gpu = jax.default_backend() == "gpu"
    out = {f"softmax/{'cudnn' if on_gpu else 'xla'}": lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn" if on_gpu else "xla")}
    positions = jnp.arange(t, dtype=jnp.int32)[None]
    for name in FLAGS.schemes.split(","):
        scheme = make_scheme(name, num_heads=FLAGS.heads, head_dim=FLAGS.head_dim)
        for impl in FLAGS.impls.split(","):
            out[f"{name}/{impl}"] = (lambda q, k, v, s=scheme, i=impl: s.attend(
                q, k, v, positions=positions, impl=i, key=jax.random.key(0)))
    return out


def benchmark() -> list[dict]:
    rows = []
    for t in (int(x) for x in FLAGS.lengths.split(",")):
        keys = jax.random.split(jax.random.key(t), 3)
        q, k, v = (jax.random.normal(key, (1, t, FLAGS.heads, FLAGS.head_dim), jnp.bfloat16) for key in keys)
        for name, fn in contenders(t).items():
            try:
                fwd, _ = timed(fn, (q, k, v), FLAGS.repeats)
                both, temp = timed(fwd_bwd(fn), (q, k, v), FLAGS.repeats)
            except Exception as e:  # noqa: BLE001 - report and go on (out of memory, an unsupported shape)
                print(f"{name} at {t}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"length": t, "impl": name, "fwd_ms": 1e3 * fwd, "ms": 1e3 * both, "temp_gib": temp / 2 ** 30})
            print(rows[-1], flush=True)
    print(table(rows))
    return rows


def table(rows) -> str:
    lines = ["| length | scheme/impl | fwd ms | fwd+bwd ms | x baseline throughput (fwd+bwd) | XLA temp GiB |",
             "|---|---|---|---|---|---|"]
    for t in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == t]
        base = next((r["ms"] for r in at if r["impl"].startswith("softmax/")), None)
        for r in at:
            ratio = f"{base / r['ms']:.2f}" if base else "-"
            lines.append(f"| {t} | {r['impl']} | {r['fwd_ms']:.2f} | {r['ms']:.2f} | {ratio} | {r['temp_gib']:.3f} |")
    return "\n".join(lines)


def main(argv):
    del argv  # flags only
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    benchmark()


if __name__ == "__main__":
    app.run(main)
