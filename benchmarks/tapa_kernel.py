"""The fused TAPA kernel on an accelerator: correctness, forward + backward speed and memory.

    python benchmarks/tapa_kernel.py                          # 8K..32K tokens, 16 heads x 128
    python benchmarks/tapa_kernel.py --lengths 8192 --json out.json

Compares, in one process and on the same inputs (bf16, causal, batch 1):
  - tapa/pallas   the fused kernel (positional/kernels/flash.py with TAPA's score), several tile shapes;
  - cudnn         `jax.nn.dot_product_attention(..., implementation="cudnn")`: plain softmax
                  attention by cuDNN's flash kernel, the speed target;
  - flash/pallas  JAX's own Pallas (Triton) flash attention for plain softmax attention, the
                  same programming model as ours, so the cost of TAPA's cosine shows apart;
  - tapa/blockwise and tapa/reference, our plain-JAX implementations.
Time is forward + backward (gradient of a weighted sum of the output w.r.t. q, k, v), median of
`--repeats` after warm-up. Memory is XLA's planned scratch (`memory_analysis().temp_size_in_bytes`)
of the compiled forward + backward, which is what grows with length. The correctness check
runs first: the kernel, compiled for the device (not interpreted), against the reference in
fp32 at highest matmul precision, for odd lengths, head dims 64/128/96, GQA and bf16.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
from absl import app, flags

from benchmarks.attention import timed
from lab.provenance import stamped
from positional.attention import blockwise_attention, reference_attention
from positional.tapa import tapa_attention, tapa_score_fn

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "8192,16384,32768", "lengths, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("heads", 16, "attention heads", flag_values=FLAGS)
flags.DEFINE_integer("head_dim", 128, "dimension per head", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 10, "timed calls", flag_values=FLAGS)
flags.DEFINE_string("tiles", "64x64w4,64x64w8,32x64w4,64x32w4,128x64w8,64x64w4a",
                    "kernel tiles block_q x block_k, Triton warps, 'a' for accurate (libdevice) math",
                    flag_values=FLAGS)
flags.DEFINE_integer("reference_max", 8192, "longest length for our plain-JAX reference and blockwise versions",
                     flag_values=FLAGS)
flags.DEFINE_bool("skip_check", False, "skip the kernel-against-reference check", flag_values=FLAGS)
flags.DEFINE_string("json", None, "also write the results to this JSON file", flag_values=FLAGS)


def rel(a, b):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def inputs(key, b, t, h, kh, d, dtype):
    kq, kk, kv = jax.random.split(key, 3)
    return (jax.random.normal(kq, (b, t, h, d), dtype), jax.random.normal(kk, (b, t, kh, d), dtype),
            jax.random.normal(kv, (b, t, kh, d), dtype))


def loss_of(fn):
    def loss(q, k, v):
        out = fn(q, k, v).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))
    return loss


def check(phase: str = "quadratic") -> list[dict]:
    rows = []
    for b, t, h, kh, d, dtype, bq, bk in [(2, 777, 4, 4, 64, jnp.float32, 64, 64),
                                          (1, 1000, 8, 2, 128, jnp.bfloat16, 64, 128),
                                          (1, 300, 4, 1, 96, jnp.bfloat16, 128, 64)]:
        q, k, v = inputs(jax.random.key(t), b, t, h, kh, d, dtype)
        seg = (jnp.arange(t) >= t // 3).astype(jnp.int32)[None].repeat(b, 0)
        kern = functools.partial(tapa_attention, segment_ids=seg, phase=phase, block_q=bq, block_k=bk)
        ref = functools.partial(reference_attention, segment_ids=seg, score_fn=tapa_score_fn(q.shape[-1], phase=phase))
        up = [x.astype(jnp.float32) for x in (q, k, v)]
        with jax.default_matmul_precision("highest"):
            want = jax.jit(ref)(*up)
            want_g = jax.jit(jax.grad(loss_of(ref), (0, 1, 2)))(*up)
        try:
            got = jax.jit(kern)(q, k, v)
            got_g = jax.jit(jax.grad(loss_of(kern), (0, 1, 2)))(q, k, v)
        except Exception as e:  # noqa: BLE001 - report the failure, keep checking the rest
            print(f"check {phase} T{t} D{d} failed: {type(e).__name__}: {e}", flush=True)
            continue
        row = {"shape": f"B{b} T{t} H{h} K{kh} D{d} {jnp.dtype(dtype).name} tiles {bq}x{bk}",
               "out": rel(got, want), **{f"d{n}": rel(g, w) for n, g, w in zip("qkv", got_g, want_g)}}
        rows.append(row)
        print("check", row, flush=True)
    return rows


def contenders(tiles, head_dim):
    out = {f"tapa/pallas {bq}x{bk} w{w}{'' if fast else ' accurate'}":
           functools.partial(tapa_attention, block_q=bq, block_k=bk, num_warps=w, fast_math=fast)
           for bq, bk, w, fast in tiles}
    out["cudnn"] = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation="cudnn")
    try:
        from jax.experimental.pallas.ops.gpu import attention as pallas_flash
        out["flash/pallas"] = lambda q, k, v: pallas_flash.mha(q, k, v, segment_ids=None, causal=True,
                                                               sm_scale=q.shape[-1] ** -0.5)
    except ImportError as e:
        print("no pallas flash attention:", e)
    out["tapa/blockwise"] = functools.partial(blockwise_attention, score_fn=tapa_score_fn(head_dim), block_size=1024)
    out["tapa/reference"] = functools.partial(reference_attention, score_fn=tapa_score_fn(head_dim))
    return out


def bench(lengths, heads, head_dim, repeats, tiles, reference_max):
    rows = []
    for t in lengths:
        q, k, v = inputs(jax.random.key(0), 1, t, heads, heads, head_dim, jnp.bfloat16)
        for name, fn in contenders(tiles, head_dim).items():
            if name in ("tapa/reference", "tapa/blockwise") and t > reference_max:
                continue
            try:
                fwd, _ = timed(fn, (q, k, v), repeats)
                sec, temp = timed(jax.grad(loss_of(fn), (0, 1, 2)), (q, k, v), repeats)
            except Exception as e:  # noqa: BLE001 - report and go on (OOM, unsupported shape)
                print(f"{name} at {t}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            rows.append({"length": t, "impl": name, "fwd_ms": 1e3 * fwd, "ms": 1e3 * sec,
                         "temp_gib": temp / 2 ** 30})
            print(rows[-1], flush=True)
    return rows


def table(rows):
    lines = ["| length | impl | fwd ms | fwd+bwd ms | x cuDNN throughput (fwd+bwd) | XLA temp GiB |",
             "|---|---|---|---|---|---|"]
    for t in sorted({r["length"] for r in rows}):
        at = [r for r in rows if r["length"] == t]
        base = next((r["ms"] for r in at if r["impl"] == "cudnn"), None)
        for r in at:
            ratio = f"{base / r['ms']:.2f}" if base else "-"
            lines.append(f"| {t} | {r['impl']} | {r['fwd_ms']:.2f} | {r['ms']:.2f} | {ratio} "
                         f"| {r['temp_gib']:.3f} |")
    return "\n".join(lines)


def main(argv):
    del argv  # flags only
    print("device:", jax.devices()[0].device_kind, "jax", jax.__version__, flush=True)
    tiles = [(*(int(x) for x in s.rstrip("a").replace("w", "x").split("x")), not s.endswith("a"))
             for s in FLAGS.tiles.split(",")]
    checks = [] if FLAGS.skip_check else check("quadratic") + check("linear")
    rows = bench([int(x) for x in FLAGS.lengths.split(",")], FLAGS.heads, FLAGS.head_dim, FLAGS.repeats,
                 tiles, FLAGS.reference_max)
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(stamped({"device": jax.devices()[0].device_kind, "checks": checks, "rows": rows}), f, indent=1)
    print(table(rows))


if __name__ == "__main__":
    app.run(main)
