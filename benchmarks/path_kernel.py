"""PaTH attention on a GPU: our Pallas kernel against fla's Triton PaTH and cuDNN softmax.

    python benchmarks/path_kernel.py                          # checks, then 4K..32K, head dims 64/128
    python benchmarks/path_kernel.py --lengths 8192 --head_dims 64 --gates 1 --json out.json

First the checks, on the device: our kernel compiled for it (not interpreted) against PaTH's
reference (the materialised logits in fp32 at highest matmul precision), values and the
gradients of q, k, v, w, beta and the FoX gates, at odd lengths, GQA, segment ids, fp32 and
bf16; and where fla is importable, fla's `parallel_path_attn` on the same inputs against the
same reference, so both implementations' errors sit side by side.

Then the timings, one process, identical inputs (bf16 q, k, v; fp32 w, beta and gates, as fla
requires), batch 1, `--model_dim / head_dim` heads, causal, with and without the PaTH-FoX gate
on the PaTH authors' scale (fla's g is our log_forget):
  - path/pallas <tile>    our kernel (positional/path/kernel.py), each setting of --tiles;
  - path/blockwise <s>    our plain-JAX chunked form with its recomputing backward, each setting of
                          --blockwise (two levels, bf16 tiles, the kernel inside), up to --blockwise_max;
  - fla                   fla's Triton kernels (PyTorch), timed by `triton.testing.do_bench`;
  - cudnn                 plain causal softmax by `jax.nn.dot_product_attention(implementation="cudnn")`:
                          no transport and no gate, the ceiling.
Forward, and forward + backward: the gradient of a weighted sum of the output w.r.t. every input.
Median of --repeats calls after warm-up. Memory: XLA's planned scratch of our compiled forward +
backward (`memory_analysis`), and PyTorch's peak allocation over fla's step minus its inputs.
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # PyTorch shares the device

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.attention import timed
from lab.lowering import max_registers
from lab.provenance import stamped
from positional.fox import forget_bias
from positional.path.chunked import chunked_attention
from positional.path.kernel import TRANSPORT, path_attention
from positional.path.reference import dense_score_fn
from positional.softmax import reference_attention

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("lengths", "4096,8192,16384,32768", "lengths, comma-separated", flag_values=FLAGS)
flags.DEFINE_string("head_dims", "64,128", "head dimensions, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("model_dim", 2048, "heads = model_dim / head_dim", flag_values=FLAGS)
flags.DEFINE_string("gates", "0,1", "without (0) and with (1) the PaTH-FoX gate", flag_values=FLAGS)
flags.DEFINE_string("tiles", "16", "our kernel's settings ('none': no kernel), comma-separated: chunk[/w<warps>][/s<stages>][/g<groups>]"
                    "[/r<registers>][/<transport>], warps and stages one number or forward.backward, r a limit of "
                    "registers per thread (16/w4.8/s2.1/g4/r255/tf32x3)",
                    flag_values=FLAGS)
flags.DEFINE_integer("blockwise_max", 8192, "longest length for our plain-JAX chunked form", flag_values=FLAGS)
flags.DEFINE_string("blockwise", "64", "the chunked form's settings, comma-separated: chunk[/s<span>][/o<outer "
                    "group>][/bf16][/k][/a:blocks|chunks]: two levels with span, bf16 tiles, the kernel inside the "
                    "blocks (k), the across-blocks kernel between them (k/a:blocks) or between chunks too (k/a:chunks)",
                    flag_values=FLAGS)
flags.DEFINE_integer("repeats", 10, "timed calls", flag_values=FLAGS)
flags.DEFINE_bool("check", True, "run the checks first", flag_values=FLAGS)
flags.DEFINE_integer("checks", 6, "run the first this many of CHECKS", flag_values=FLAGS)
flags.DEFINE_bool("fla", True, "include fla (needs torch and flash-linear-attention)", flag_values=FLAGS)
flags.DEFINE_string("json", None, "also write the results to this JSON file", flag_values=FLAGS)
flags.DEFINE_string("tpu", None, "instead of timing: compile each --blockwise setting's forward + backward for "
                    "one chip of this TPU topology (v5e:1x1, ...) with libtpu and print the compiler's temporaries",
                    flag_values=FLAGS)

NAMES = ("q", "k", "v", "w", "beta", "log_forget")
START = time.perf_counter()


def log(*args):
    print(f"[{time.perf_counter() - START:5.0f} s]", *args, flush=True)


def make_inputs(seed, b, t, h, kh, d) -> dict:
    """Host arrays (fp32), one draw for every implementation: w unit, beta in (0, 2), log f < 0."""
    r = np.random.default_rng(seed)
    w = r.standard_normal((b, t, kh, d), np.float32)
    return {"q": r.standard_normal((b, t, h, d), np.float32), "k": r.standard_normal((b, t, kh, d), np.float32),
            "v": r.standard_normal((b, t, kh, d), np.float32), "w": w / np.linalg.norm(w, axis=-1, keepdims=True),
            "beta": r.uniform(0.0, 2.0, (b, t, kh)).astype(np.float32),
            "log_forget": np.log(1 / (1 + np.exp(-r.normal(2.0, 1.0, (b, t, h))))).astype(np.float32)}


def tile(spec: str) -> dict:
    """'64/w4.8/s2/g4/r255/tf32x3' -> {'chunk': 64, 'num_warps': (4, 8), 'num_stages': (2, 2), 'groups': 4,
    'maxnreg': 255, 'transport': 'tf32x3'}; '' -> {} (the kernel's defaults). 'maxnreg' is not the
    kernel's: the caller lowers under lab.lowering.max_registers."""
    if not spec:
        return {}
    chunk, *rest = spec.split("/")
    out = {"chunk": int(chunk)}
    for part in rest:
        if part in TRANSPORT:
            out["transport"] = part
            continue
        if part[0] in "gr":
            out[{"g": "groups", "r": "maxnreg"}[part[0]]] = int(part[1:])
            continue
        numbers = tuple(int(x) for x in part[1:].split("."))
        out[{"w": "num_warps", "s": "num_stages"}[part[0]]] = numbers * (3 - len(numbers))
    return out


def chunked(spec: str) -> dict:
    """'64/s512/o4/bf16/k' -> chunked_attention's {'chunk': 64, 'span': 512, 'outer_group': 4,
    'tiles': 'bf16', 'kernel': {}} (k: PaTH's kernel inside the blocks, its defaults; a:blocks or
    a:chunks: chunked_attention's `across`)."""
    chunk, *rest = spec.split("/")
    out = {"chunk": int(chunk)}
    for part in rest:
        if part in ("bf16", "fp32"):
            out["tiles"] = part
        elif part == "k":
            out["kernel"] = {}
        elif part.startswith("a:"):
            out["across"] = part[2:]
        else:
            out[{"s": "span", "o": "outer_group"}[part[0]]] = int(part[1:])
    return out


def ours(impl: str, gated: bool, seg=None, chunk: int | None = None, blockwise: dict | None = None, **kernel):
    """fn(q, k, v, w, beta, log_forget) -> out, gates on the PaTH authors' scale (as `path_fox`)."""
    def fn(q, k, v, w, beta, log_f):
        d = q.shape[-1]
        bias = forget_bias(log_f, d ** -0.5) if gated else None
        if impl == "reference":
            return reference_attention(q, k, v, bias_fn=bias, segment_ids=seg,
                                       score_fn=dense_score_fn(w, beta, d ** -0.5))
        if impl == "blockwise":
            return chunked_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg,
                                        **(blockwise or {"chunk": chunk or 64}))
        return path_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, chunk=chunk, **kernel)
    return fn


def weights(shape):
    """The loss's weights on the output: an input of every timed call, not work inside it."""
    return np.cos(np.arange(int(np.prod(shape)), dtype=np.float32)).reshape(shape)


def jax_grads(fn, n):
    """f(*inputs, c): fn's output and the gradients of sum(out * c) w.r.t. its first n inputs."""
    def loss(*args):
        out = fn(*args[:-1])
        return jnp.sum(out.astype(jnp.float32) * args[-1]), out
    return jax.value_and_grad(loss, argnums=tuple(range(n)), has_aux=True)


def rel(a, b):
    a, b = (np.asarray(x, np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))


def to_jax(x, dtype):
    return {n: jnp.asarray(a, dtype if n in ("q", "k", "v") else jnp.float32) for n, a in x.items()}


# ---- fla (PyTorch) ------------------------------------------------------------------------------
def fla_fn():
    """fla's parallel_path_attn, or None where torch or fla is missing."""
    if not FLAGS.fla:
        return None
    try:
        import torch  # noqa: F401
        from fla.ops.path_attn.parallel import parallel_path_attn
    except ImportError as e:
        log("no fla:", e)
        return None
    return parallel_path_attn


def to_torch(x, dtype):
    import torch
    return {n: torch.tensor(a, device="cuda", dtype=dtype if n in ("q", "k", "v") else torch.float32,
                            requires_grad=True) for n, a in x.items()}


def fla_step(attn, xs, gated, c=None):
    """One call of fla: the output, and given the weights c the gradients of the same loss."""
    import torch
    g = xs["log_forget"] if gated else None
    o, _ = attn(xs["q"], xs["k"], xs["v"], xs["w"], xs["beta"], g)
    if c is None:
        return o, None
    inputs = [xs[n] for n in NAMES if gated or n != "log_forget"]
    return o, torch.autograd.grad((o.float() * c).sum(), inputs)


# ---- checks ---------------------------------------------------------------------------------------
CHECKS = [  # b, t, h, kh, d, dtype, kernel settings (as --tiles; "" the defaults), gated, packed
    (2, 777, 4, 2, 64, "float32", "", True, True),
    (2, 777, 4, 2, 64, "float32", "16/g4", True, True),
    (2, 777, 4, 2, 64, "float32", "16/g4/tf32x3", True, True),
    (1, 1000, 8, 2, 128, "bfloat16", "16/g4", True, False),  # and fla, on the same inputs
    (1, 300, 4, 4, 48, "bfloat16", "32", False, True),
    (1, 1000, 4, 4, 64, "bfloat16", "", False, False),
]


def check() -> list[dict]:
    attn = fla_fn()
    rows = []
    for b, t, h, kh, d, dtype, settings, gated, packed in CHECKS[:FLAGS.checks]:
        x = make_inputs(t, b, t, h, kh, d)
        seg = jnp.asarray((np.arange(t) >= t // 3).astype(np.int32)[None].repeat(b, 0)) if packed else None
        n = 6 if gated else 5
        with jax.default_matmul_precision("highest"):
            (_, want), want_g = jax.jit(jax_grads(ours("reference", gated, seg), n))(*to_jax(x, jnp.float32).values(),
                                                                                     weights(x["q"].shape))
        name = (f"B{b} T{t} H{h} K{kh} D{d} {dtype} {settings or 'default'}{' gate' if gated else ''}"
                f"{' segments' if packed else ''}")
        try:
            (_, got), got_g = jax.jit(jax_grads(ours("pallas", gated, seg, **tile(settings)), n))(*to_jax(x, dtype).values(),
                                                                                      weights(x["q"].shape))
        except Exception as e:  # noqa: BLE001 - report the failure, keep checking the rest
            log(f"check {name}: ours failed: {type(e).__name__}: {str(e)[:2000]}")
            continue
        row = {"case": name, "impl": "ours", "out": rel(got, want),
               **{f"d{m}": rel(g, w) for m, g, w in zip(NAMES, got_g, want_g)}}
        rows.append(row)
        log("check", row)
        if attn is not None and not packed and dtype == "bfloat16" and d in (16, 32, 64, 128):
            import torch
            try:
                c = torch.tensor(weights(x["q"].shape), device="cuda")
                o, g = fla_step(attn, to_torch(x, getattr(torch, dtype)), gated, c)
            except Exception as e:  # noqa: BLE001 - report the failure, keep checking the rest
                log(f"check {name}: fla failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            row = {"case": name, "impl": "fla", "out": rel(o.float().cpu(), want),
                   **{f"d{m}": rel(gi.float().cpu(), w) for m, gi, w in zip(NAMES, g, want_g)}}
            rows.append(row)
            log("check", row)
    return rows


# ---- timings --------------------------------------------------------------------------------------
def bench() -> list[dict]:
    attn = fla_fn()
    rows = []
    for d in (int(s) for s in FLAGS.head_dims.split(",")):
        h = FLAGS.model_dim // d
        for t in (int(s) for s in FLAGS.lengths.split(",")):
            x = make_inputs(0, 1, t, h, h, d)
            xj, c = tuple(to_jax(x, jnp.bfloat16).values()), jnp.asarray(weights(x["q"].shape))
            for i, gated in enumerate(bool(int(s)) for s in FLAGS.gates.split(",")):
                n = 6 if gated else 5
                kernels = {f"path/pallas {s}": tile(s) for s in FLAGS.tiles.split(",") if FLAGS.tiles != "none"}
                limits = {name: kernel.pop("maxnreg", None) for name, kernel in kernels.items()}
                contenders = {name: ours("pallas", gated, **kernel) for name, kernel in kernels.items()}
                if t <= FLAGS.blockwise_max:
                    contenders |= {f"path/blockwise {s}": ours("blockwise", gated, blockwise=chunked(s))
                                   for s in FLAGS.blockwise.split(",")}
                if i == 0:  # once per length: no gate, no transport
                    contenders["cudnn"] = lambda q, k, v, *_: jax.nn.dot_product_attention(
                        q, k, v, is_causal=True, implementation="cudnn")
                for name, fn in contenders.items():
                    try:
                        with max_registers(limits.get(name)):
                            fwd, _ = timed(fn, xj, FLAGS.repeats)
                            both, temp = timed(jax_grads(fn, 3 if name == "cudnn" else n), (*xj, c), FLAGS.repeats)
                    except Exception as e:  # noqa: BLE001 - report and go on (OOM, unsupported shape)
                        log(f"{name} D{d} T{t}: failed: {type(e).__name__}: {str(e)[:300]}")
                        continue
                    rows.append({"head_dim": d, "length": t, "gate": gated, "impl": name, "fwd_ms": 1e3 * fwd,
                                 "ms": 1e3 * both, "mem_gib": temp / 2 ** 30})
                    log(rows[-1])
                if attn is not None:
                    rows += bench_fla(attn, x, d, t, gated)
    return rows


def bench_fla(attn, x, d, t, gated) -> list[dict]:
    import torch
    from triton.testing import do_bench
    xs, c = to_torch(x, torch.bfloat16), torch.tensor(weights(x["q"].shape), device="cuda")
    try:
        fwd = do_bench(lambda: fla_step(attn, xs, gated), warmup=25, rep=100, return_mode="median")
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()  # the inputs and the weights
        torch.cuda.reset_peak_memory_stats()
        both = do_bench(lambda: fla_step(attn, xs, gated, c), warmup=25, rep=100, return_mode="median")
        peak = torch.cuda.max_memory_allocated() - base
    except Exception as e:  # noqa: BLE001 - report and go on
        log(f"fla D{d} T{t}: failed: {type(e).__name__}: {str(e)[:300]}")
        return []
    row = {"head_dim": d, "length": t, "gate": gated, "impl": "fla", "fwd_ms": fwd, "ms": both,
           "mem_gib": peak / 2 ** 30}
    log(row)
    return [row]


def table(rows) -> str:
    lines = ["| head dim | tokens | gate | impl | fwd ms | fwd+bwd ms | fla's time / ours (fwd+bwd) "
             "| cuDNN's time / ours | memory GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted({(r["head_dim"], r["length"], r["gate"]) for r in rows}):
        at = [r for r in rows if (r["head_dim"], r["length"], r["gate"]) == key]
        fla = next((r["ms"] for r in at if r["impl"] == "fla"), None)
        cudnn = next((r["ms"] for r in rows if (r["head_dim"], r["length"]) == key[:2] and r["impl"] == "cudnn"), None)
        for r in at:
            ratio = lambda base: f"{base / r['ms']:.2f}" if base else "-"  # noqa: E731
            lines.append(f"| {key[0]} | {key[1]} | {'yes' if key[2] else 'no'} | {r['impl']} | {r['fwd_ms']:.2f} "
                         f"| {r['ms']:.2f} | {ratio(fla)} | {ratio(cudnn)} | {r['mem_gib']:.3f} |")
    return "\n".join(lines)


def tpu_memory() -> list[dict]:
    """Each --blockwise setting compiled for one chip of --tpu (nothing runs): the TPU
    compiler's temporaries of forward + backward, bf16 q, k, v, one row, packed documents."""
    from lab.lowering import compiled_for
    rows = []
    for d in (int(s) for s in FLAGS.head_dims.split(",")):
        h = FLAGS.model_dim // d
        for t in (int(s) for s in FLAGS.lengths.split(",")):
            seg = jnp.asarray((np.arange(t) >= t // 3).astype(np.int32)[None])
            x = {n: jax.ShapeDtypeStruct(a.shape, a.dtype) for n, a in to_jax(make_inputs(0, 1, 8, h, h, d),
                                                                              jnp.bfloat16).items()}
            x = {n: jax.ShapeDtypeStruct((1, t, *a.shape[2:]), a.dtype) for n, a in x.items()}
            for gated in (bool(int(s)) for s in FLAGS.gates.split(",")):
                for s in FLAGS.blockwise.split(","):
                    n = 6 if gated else 5
                    fn = jax_grads(ours("blockwise", gated, seg, blockwise=chunked(s)), n)
                    start = time.perf_counter()
                    compiled = compiled_for(fn, *x.values(), jax.ShapeDtypeStruct(x["q"].shape, jnp.float32),
                                                topology=FLAGS.tpu)
                    rows.append({"topology": FLAGS.tpu, "head_dim": d, "length": t, "gate": gated,
                                 "impl": f"path/blockwise {s}", "temp_gib": compiled.memory_analysis().temp_size_in_bytes
                                 / 2 ** 30, "compile_s": time.perf_counter() - start})
                    log(rows[-1])
    return rows


def benchmark() -> dict:
    if FLAGS.tpu:
        rows = tpu_memory()
        print("| head dim | tokens | gate | impl | TPU temporaries GiB | compile s |\n|---|---|---|---|---|---|")
        print("\n".join(f"| {r['head_dim']} | {r['length']} | {'yes' if r['gate'] else 'no'} | {r['impl']} | "
                        f"{r['temp_gib']:.2f} | {r['compile_s']:.0f} |" for r in rows))
        result = {"topology": FLAGS.tpu, "jax": jax.__version__, "rows": rows}
    else:
        result = timings()
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(stamped(result), f, indent=1)
    return result


def timings() -> dict:
    log("device:", jax.devices()[0].device_kind, "jax", jax.__version__)
    checks = check() if FLAGS.check else []
    rows = bench()
    print(table(rows))
    return {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "checks": checks, "rows": rows}


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
