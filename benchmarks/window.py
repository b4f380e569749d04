"""One layer's attention with a sliding window against the same without one, forward + backward.

    python benchmarks/window.py                       # W = 512 at T = 2K, 8K, 32K, on this host
    python benchmarks/window.py --lengths 2048,8192 --window 256 --json benchmarks/results/window.json

RoPE attention (`Scheme.attend`) on q, k, v [1, T, 4, 64] in fp32, once with `sliding_window` W
and once without, by impl "blockwise" (blocks of 512: a windowed query block visits the
ceil((W - 1 + 512) / 512) + 1 key blocks that can reach it) and, up to --reference_max
tokens, impl "reference" (the masked T x T scores, whatever the window). Both sides run in this
process, each compiled once and timed as the median of --repeats calls (benchmarks/attention.py's
`timed`). Printed: forward + backward ms, ms per 1,000 tokens (flat in T where the cost is linear),
the windowed call's speed-up over the full one, and XLA's temporary memory; --json writes the
rows with the environment (lab/provenance.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.attention import fwd_bwd, timed
from lab.provenance import write_results
from models.registry import make_scheme

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "2048,8192,32768", "comma-separated sequence lengths", flag_values=FLAGS)
flags.DEFINE_integer("window", 512, "the sliding window W", flag_values=FLAGS)
flags.DEFINE_integer("reference_max", 8192, "impl reference only up to this length (T x T scores)",
                     flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "timed calls per case (the median is reported)", flag_values=FLAGS)
flags.DEFINE_string("json", "", "write the rows here (with the environment)", flag_values=FLAGS)

HEADS, HEAD_DIM = 4, 64


def attend(window: int, impl: str):
    scheme = make_scheme("rope", num_heads=HEADS, head_dim=HEAD_DIM, sliding_window=window)

    def fn(q, k, v):
        pos = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32), q.shape[:2])
        return scheme.attend(q, k, v, positions=pos, impl=impl, block_size=512)
    return fn


def benchmark() -> list[dict]:
    rows = []
    for t in (int(x) for x in FLAGS.lengths.split(",")):
        q, k, v = (jax.random.normal(key, (1, t, HEADS, HEAD_DIM)) for key in jax.random.split(jax.random.key(0), 3))
        for impl in ("blockwise", "reference") if t <= FLAGS.reference_max else ("blockwise",):
            for window in (FLAGS.window, 0):
                seconds, temp = timed(fwd_bwd(attend(window, impl)), (q, k, v), FLAGS.repeats)
                rows.append({"length": t, "impl": impl, "window": window, "ms": 1e3 * seconds,
                             "temp_mib": temp / 2 ** 20})
                print(rows[-1], flush=True)
    return rows


def table(rows) -> str:
    lines = ["| T | impl | window | fwd+bwd ms | ms per 1K tokens | x full attention (speed) | XLA temp MiB |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        full = next(x["ms"] for x in rows if (x["length"], x["impl"], x["window"]) == (r["length"], r["impl"], 0))
        lines.append(f"| {r['length']} | {r['impl']} | {r['window'] or 'none'} | {r['ms']:.0f} | "
                     f"{1e3 * r['ms'] / r['length']:.1f} | {full / r['ms']:.2f} | {r['temp_mib']:.0f} |")
    return "\n".join(lines)


def main(argv):
    del argv  # flags only
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    rows = benchmark()
    print(table(rows))
    if FLAGS.json:
        write_results(FLAGS.json, {"window": FLAGS.window, "heads": HEADS, "head_dim": HEAD_DIM, "rows": rows})


if __name__ == "__main__":
    app.run(main)
