"""Time of the logit decompositions on one n x n map (the paper's 4,096-token maps), against
the dense 3n x 3n normal-equation solve they replace, in one process.

    python benchmarks/logit_fits.py --lengths 1024,2048,4096 --dense-max 2048

three_axis_fit (conjugate gradients on an O(n) normal-matrix product), fake_distance_fit
(closed form) and explicit_fg (one RoPE head, D = 64, two slow pairs) are compiled first; the
best of --repeats calls is kept. The dense baseline builds X^T X + n G^T G in float64 and
solves it by Cholesky (numpy), for n up to --dense-max; the last column is how far its a, b, c
differ from the fit's.
"""

from __future__ import annotations

import sys
import time


import jax
import jax.numpy as jnp
from absl import app, flags
import numpy as np

from positional.probes import logits
from positional.rope import rope_frequencies

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "1024,2048,4096", "map sizes n, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("dense_max", 2048, "longest n for the dense 3n x 3n solve", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 3, "timed calls; the best is kept", flag_values=FLAGS)
flags.DEFINE_alias("dense-max", "dense_max", flag_values=FLAGS)  # as docs and RESULTS.md spell it


def best_of(fn, repeats):
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return min(times)


def dense_three_axis(w: np.ndarray) -> np.ndarray:
    """The obvious solve: X^T X + n G^T G (3n x 3n, float64) by Cholesky. Returns [a | b | c]."""
    n = w.shape[-1]
    i = np.arange(n)
    below = (i[:, None] >= i[None, :]).astype(np.float64)
    xtx = np.block([[np.diag(n - i), below.T, below[::-1]],
                    [below, np.diag(i + 1.0), below],
                    [below[::-1].T, below.T, np.diag(n - i)]])
    gauge = np.zeros((3, 3 * n))
    gauge[0, :n], gauge[1, :n], gauge[2, 2 * n:] = 1.0, i - (n - 1) / 2, 1.0
    gauge /= np.linalg.norm(gauge, axis=1, keepdims=True)
    wc = np.tril(w)
    dist = i[:, None] - i[None, :]
    by_d = np.bincount(dist[dist >= 0], weights=wc[dist >= 0], minlength=n)
    rhs = np.concatenate([by_d, wc.sum(1), wc.sum(0)])
    factor = np.linalg.cholesky(xtx + n * gauge.T @ gauge)
    return np.linalg.solve(factor.T, np.linalg.solve(factor, rhs))


def benchmark() -> list[dict]:
    """One row of seconds per length, as FLAGS ask."""
    rows = []
    for n in (int(x) for x in FLAGS.lengths.split(",")):
        rng = np.random.default_rng(0)
        d = np.arange(n)
        w = (rng.standard_normal((n, n)) + np.sin(d[:, None] - d[None, :]) + rng.standard_normal(n)[:, None]
             ).astype(np.float32)
        wj = jnp.asarray(w)
        q, k = (jnp.asarray(rng.standard_normal((n, 64)), jnp.float32) for _ in range(2))
        theta = rope_frequencies(64)
        slow = jnp.zeros(32, bool).at[-2:].set(True)
        row = {"n": n,
               "three_axis": best_of(lambda: logits.three_axis_fit(wj)["r"], FLAGS.repeats),
               "fake_distance": best_of(lambda: logits.fake_distance_fit(wj)["r"], FLAGS.repeats),
               "explicit_fg": best_of(lambda: logits.explicit_fg(q, k, theta, slow)["r"], FLAGS.repeats)}
        if n <= FLAGS.dense_max:
            t0 = time.perf_counter()
            sol = dense_three_axis(w.astype(np.float64))
            row["dense"] = time.perf_counter() - t0
            fit = logits.three_axis_fit(wj)
            row["max_diff"] = float(np.abs(np.concatenate([fit["a"], fit["b"], fit["c"]]) - sol).max())
        rows.append(row)
        print(f"# {row}", file=sys.stderr, flush=True)
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; seconds, best of {FLAGS.repeats} "
          "(dense: one call)\n")
    print("| n | three_axis_fit | fake_distance_fit | explicit_fg | dense 3n solve | dense / three_axis | "
          "max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        dense = "- | - | -"
        if "dense" in r:
            dense = f"{r['dense']:.2f} | {r['dense'] / r['three_axis']:.0f}x | {r['max_diff']:.1e}"
        fits = " | ".join(f"{r[key]:.3f}" for key in ("three_axis", "fake_distance", "explicit_fg"))
        print(f"| {r['n']} | {fits} | {dense} |")
    return rows


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
