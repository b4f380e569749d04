"""The prepared check for a lent GPU: one command, at most about 8 minutes on an H100 or H200
with compiling, that checks every fused path on the device and times what matters most.

    make gpu-check                                   # on the GPU machine (README: the device command)
    python benchmarks/gpu_check.py --budget_s 400 --json $OUT/gpu_check.json
    python benchmarks/gpu_check.py --tiny            # each kind of path at toy sizes (this CPU; the test)

The work, in order of value; an item whose estimate (scaled by how long the finished ones took
against theirs) does not fit in what is left of --budget_s is skipped and named, as is one
that --only does not name:
  1. checks: each fused path on this device against the fp32 reference on the same bf16
     inputs (computed on the host's CPU: on the GPU, XLA's fusion passes took minutes over
     T5's table of 32 selects), values and gradients (q, k, v, and the gates where a bias has them): 2 rows of
     1,000 tokens (no tile divides it), 4 query heads on 2 kv heads of 64, 3 packed documents
     per row; it passes within twice the error of the reference itself on the bf16 inputs
     (at least 5e-3). cuDNN plain, packed, packed over its segment maximum (the overflow
     branch), the per-key bias channels (FoX with its gates, ALiBi), auto for fox+packed rows
     (the fused kernel: its gates are learned), the fused hook kernel (KERPLE, T5's table,
     TAPA), PaTH-FoX's kernel, the Sessa feedback solve (Sessa runs last, `LAST`: its
     Triton compiles take minutes).
  2. attention: forward + backward of one call, 1 x 16 heads x 128 bf16, 4 packed documents
     per row, at 8,192 then 32,768 tokens: each scheme's auto path against cuDNN plain causal
     softmax without packing (the ceiling); PaTH-FoX's chunked form at 8,192 in one level and
     in two, fp32 and bf16 tiles (chunk, span, tiles: `chunked_attention`), and by kernels in two
     levels (`across`: "chunks", the across-blocks kernel between chunks and between blocks of
     512 or 1,024; "blocks", PaTH's kernel inside blocks of 512 and the across-blocks kernel
     between them; "scan", PaTH's kernel inside blocks of 1,024 and the chunked form across);
     then cuDNN plain at the head dims the bias channels make (136, 144, 152, 192 against 128).
  3. train: tokens/s of the train step (lab.state.make_train_step, as train.py builds it;
     configs/default.py, 4 rows of 8,192, bf16, 4 documents per row), auto against blockwise,
     for rope, alibi, fox, tapa and path_fox.
  4. eval plans: eval.py --dry_run on the device for Llama-3.2-1B, 3B and Llama-3.1-8B's shapes
     (bf16, 4 windows of 2,048 and 4,096 tokens): does evaluating them fit this GPU.
The order run: the checks, every scheme's call at 8,192, the train steps of rope, alibi and fox,
PaTH-FoX's forms, the widened head dims, the calls at 32,768, the train steps of tapa and
path_fox, the eval plans, then the slow-compiling checks (`LAST`).
The json is rewritten after every item (and names the item in flight), so a run the device call
cuts off keeps what it measured. Timings: benchmarks/attention.py's (compiled once, one warm
call, the median of --repeats synchronised calls; XLA's temporary memory beside). It prints a
table per section and writes one json (device, JAX version, commit, the packages the machine
has, every row, what was skipped). Off a GPU, cuDNN's rows say why they cannot run and the Pallas kernels interpret.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from benchmarks.attention import fwd_bwd, timed
from configs.default import get_config
from lab.state import init_state, make_train_step, mesh_and_batch
from lab.provenance import stamped
from models.registry import make_scheme
from positional import vendor
from positional.attention import attention
from positional.feedback import feedback_solve
from positional.fox import forget_bias
from positional.softmax import reference_attention, segment_starts

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_float("budget_s", 400, "seconds of work at most (estimates decide what fits)", flag_values=FLAGS)
flags.DEFINE_string("json", "", "write every row here ('' : $OUT/gpu_check.json where OUT is set, else none)",
                    flag_values=FLAGS)
flags.DEFINE_bool("tiny", False, "toy sizes: the whole script in a minute or two on a CPU", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 10, "timed calls per case (the median is reported)", flag_values=FLAGS)
flags.DEFINE_list("only", [], "run only the items whose 'section: item' contains one of these (e.g. "
                  "'attention: path_fox,train'); the rest are skipped and named", flag_values=FLAGS)

# A fused path passes when its error against the fp32 reference is at most SLACK times the
# reference's own on the same bf16 inputs (or FLOOR): the rounding of bf16, not a wrong mask or tile.
SLACK, FLOOR = 2.0, 5e-3
TRAIN_SCHEMES = ("rope", "alibi", "fox", "tapa", "path_fox")
# Checks whose compile is slow, in seconds on an H200 (jax 0.11.2, commit 7561e56, 2026-11-28;
# every other check took 4-13 s): run after everything else, as on 2026-11-27 the Sessa solve at
# block 128 compiled past 5 minutes and the device call's limit took every later item with it.
# (T5's table took 232 s there, but in its fp32 reference on the GPU, not its kernel: compiled
# for an H100 on the CPU host, jax 0.11.2, the kernel's forward + backward took 6.8 s, the
# reference 437 s; the reference now runs on the host's CPU.)
LAST = {"pallas Sessa solve": 120}
ATTENTION_SCHEMES = ("rope", "alibi", "fox", "rope+fox", "so2_learned_qkv+alibi", "tapa", "kerple_log", "path_fox")


def sizes(tiny: bool) -> dict:
    if tiny:  # every kind of path once (the test's budget), not every scheme
        return dict(check=(2, 40, 4, 2, 16), lengths=(256,), heads=2, head_dim=64, dims=(72,), rows=2, seq_len=128,
                    attention=("rope", "fox", "tapa", "path_fox"), train=("rope", "fox", "path_fox"),
                    models=("tiny",), eval_len=256,
                    path_spans=(("blockwise", 32, 128, "bf16", "scan"), ("pallas", 32, 128, "bf16", "scan"),
                                ("pallas", 32, 128, "bf16", "blocks"), ("pallas", 32, 128, "bf16", "chunks")))
    return dict(check=(2, 1000, 4, 2, 64), lengths=(8192, 32768), heads=16, head_dim=128, dims=(136, 144, 152, 192),
                rows=4, seq_len=8192, attention=ATTENTION_SCHEMES, train=TRAIN_SCHEMES,
                models=("Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"), eval_len=4096,
                path_spans=(("blockwise", 64, 0, "fp32", "scan"), ("pallas", 64, 512, "bf16", "chunks"),
                            ("pallas", 64, 512, "bf16", "blocks"), ("blockwise", 64, 512, "fp32", "scan"),
                            ("blockwise", 64, 512, "bf16", "scan"), ("pallas", 64, 1024, "bf16", "chunks"),
                            ("blockwise", 128, 1024, "bf16", "scan"), ("blockwise", 64, 0, "bf16", "scan"),
                            ("pallas", 64, 1024, "bf16", "scan")))


def packed_ids(b: int, t: int, documents: int) -> jax.Array:
    """Segment ids of `documents` documents of random lengths per row, numbered 1, 2, ..."""
    rng = np.random.default_rng(t)
    rows = []
    for _ in range(b):
        cuts = np.sort(rng.choice(np.arange(1, t), size=documents - 1, replace=False))
        rows.append(np.repeat(np.arange(1, documents + 1), np.diff(np.concatenate([[0], cuts, [t]]))))
    return jnp.asarray(np.stack(rows), jnp.int32)


def positions_of(ids: jax.Array) -> jax.Array:
    """Each token's position in its document (as the data pipeline's)."""
    idx = jnp.arange(ids.shape[1])
    return (idx - jax.lax.cummax(jnp.where(segment_starts(ids), idx, 0), axis=1)).astype(jnp.int32)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---- 1. checks -----------------------------------------------------------------------------

def check_cases(b, t, h, kh, d) -> dict:
    """name -> (ours(q, k, v, gates), reference(q, k, v, gates), whether the gates matter)."""
    seg = packed_ids(b, t, 3)
    pos = positions_of(seg)
    alibi = make_scheme("alibi", num_heads=h, head_dim=d).bias_fn(None, pos)
    kerple = make_scheme("kerple_log", num_heads=h, head_dim=d).bias_fn(
        {"kerple_r1": jnp.linspace(0.5, 2.0, h), "kerple_r2": jnp.linspace(0.1, 1.0, h)}, pos)
    t5 = make_scheme("t5", num_heads=h, head_dim=d).bias_fn(
        {"t5_table": jax.random.normal(jax.random.key(5), (h, 32))}, pos)  # a per-head table, read in the tiles
    key = jax.random.key(3)

    def plain(impl, bias=None, **kw):
        return (lambda q, k, v, lf: attention(q, k, v, impl=impl, bias_fn=bias and bias(lf), **kw),
                lambda q, k, v, lf: reference_attention(q, k, v, bias_fn=bias and bias(lf),
                                                        segment_ids=kw.get("segment_ids")))

    def scheme(name, impl):
        s = make_scheme(name, num_heads=h, head_dim=d)
        return (lambda q, k, v, lf: s.attend(q, k, v, positions=pos, segment_ids=seg, impl=impl, key=key),
                lambda q, k, v, lf: s.attend(q, k, v, positions=pos, segment_ids=seg, impl="reference", key=key))

    def sessa(q, k, v, lf, impl="pallas"):  # rows q[:, :, 0] and keys k[:, :, 0] of the feedback, f = v[:, :, 0]
        gamma = 0.9 * jax.nn.sigmoid(lf[..., 0])
        return feedback_solve(q[:, :, 0], k[:, :, 0], gamma, v[:, :, 0], seg, impl=impl, block_size=64)

    cases = {
        "cudnn plain": (*plain("cudnn"), False),
        "cudnn packed": (*plain("cudnn", segment_ids=seg), False),
        "cudnn packed over max_segments (overflow)": (
            lambda q, k, v, lf: vendor.cudnn_attention(q, k, v, segment_ids=seg, max_segments=2),
            lambda q, k, v, lf: reference_attention(q, k, v, segment_ids=seg), False),
        "cudnn FoX channels, packed": (*plain("cudnn", forget_bias, segment_ids=seg), True),
        "cudnn ALiBi channels, packed": (*plain("cudnn", lambda lf: alibi, segment_ids=seg), False),
        "auto FoX, packed": (*plain("auto", forget_bias, segment_ids=seg), True),
        "pallas KERPLE (hook kernel)": (*plain("pallas", lambda lf: kerple, segment_ids=seg), False),
        "pallas T5 table (hook kernel)": (*plain("pallas", lambda lf: t5, segment_ids=seg), False),
        "pallas TAPA (hook kernel)": (*scheme("tapa", "pallas"), False),
        "pallas PaTH-FoX (its kernel)": (*scheme("path_fox", "pallas"), False),
        "pallas Sessa solve": (sessa, lambda q, k, v, lf: sessa(q, k, v, lf, impl="reference"), True),
    }
    return cases


def run_check(name, ours, ref, gated, shape) -> dict:
    b, t, h, kh, d = shape
    keys = jax.random.split(jax.random.key(len(name)), 5)
    q = jax.random.normal(keys[0], (b, t, h, d))
    k, v = (jax.random.normal(x, (b, t, kh, d)) for x in keys[1:3])
    gates = jax.nn.log_sigmoid(3 * jax.random.normal(keys[3], (b, t, h)))

    def grads(fn, dtype, device=None):
        def loss(q, k, v, lf):
            out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype), lf)
            w = jax.random.normal(keys[4], out.shape)
            return jnp.sum(out.astype(jnp.float32) * w), out
        return jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(*jax.device_put((q, k, v, gates), device))

    want = grads(ref, jnp.float32, jax.devices("cpu")[0])
    names = ("dq", "dk", "dv", "dgates")[:4 if gated else 3]

    def errors(got):
        return {"out": rel(got[1], want[1]), **{n: rel(g, w) for n, g, w in zip(names, got[0], want[0])}}

    ours_err, ref_err = errors(grads(ours, jnp.bfloat16)), errors(grads(ref, jnp.bfloat16))
    ok = all(ours_err[n] <= max(SLACK * ref_err[n], FLOOR) for n in ours_err)
    return {"case": name, "ok": ok, **ours_err, "reference_bf16": ref_err}


# ---- 2. attention ------------------------------------------------------------------------------

def ceiling(q, k, v):
    """cuDNN plain causal softmax, no packing (XLA's off a GPU)."""
    on_gpu = jax.default_backend() == "gpu"
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn" if on_gpu else "xla")


def run_attention(name, t, heads, d, repeats, impl="auto", block_size=512, **options) -> dict:
    keys = jax.random.split(jax.random.key(t), 3)
    q, k, v = (jax.random.normal(x, (1, t, heads, d), jnp.bfloat16) for x in keys)
    seg = packed_ids(1, t, 4)
    pos = positions_of(seg)
    scheme = None if name == "ceiling" else make_scheme(name, num_heads=heads, head_dim=d, **options)

    def fn(q, k, v):
        if scheme is None:
            return ceiling(q, k, v)
        return scheme.attend(q, k, v, positions=pos, segment_ids=seg, impl=impl, block_size=block_size,
                             key=jax.random.key(0))

    seconds, temp = timed(fwd_bwd(fn), (q, k, v), repeats)
    return {"scheme": name, "tokens": t, "head_dim": d, "ms": 1e3 * seconds, "temp_gib": temp / 2 ** 30}


# ---- 3. train ----------------------------------------------------------------------------------

def run_train(name, impl, rows, seq_len, repeats, tiny) -> dict:
    config = get_config(name)
    config.update_from_flattened_dict({"batch_size": rows, "seq_len": seq_len, "model.dtype": "bfloat16",
                                       "model.attention_impl": impl})
    if tiny:
        config.model.update(num_layers=1)
    vocab = 258
    mesh, batch_sharding = mesh_and_batch(config, jax.devices()[:1])
    graphdef, rest, tx, _, state = init_state(config, vocab, mesh)
    step = make_train_step(graphdef, rest, tx, config, jax.tree.map(lambda x: x.sharding, state), batch_sharding)
    seg = packed_ids(rows, seq_len + 1, 4)
    batch = {"tokens": jax.random.randint(jax.random.key(1), (rows, seq_len + 1), 0, vocab, jnp.int32),
             "segment_ids": seg, "positions": positions_of(seg)}
    start = time.perf_counter()
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    return {"scheme": name, "impl": impl, "tokens_per_s": rows * seq_len / statistics.median(times),
            "loss": float(metrics["loss"]), "compile_s": compile_s}


# ---- 4. evaluation plans ------------------------------------------------------------------------

def run_eval_plan(model: str, seq_len: int) -> dict:
    """eval.py --dry_run on this device for a published model's shape (benchmarks/eval_plans.py's
    `host` target): the scoring step of 4 windows at half and all of seq_len, bf16, compiled by
    the device's own compiler (nothing read or allocated). "tiny": a 1-layer model of the 1B's kind."""
    from lab import files
    from lab.hf import PUBLISHED, run_config
    from lab.lengths import plan as eval_plan
    hf = PUBLISHED.get(model) or {**PUBLISHED["Llama-3.2-1B"], "vocab_size": 512, "hidden_size": 64,
                                  "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2,
                                  "num_key_value_heads": 1, "head_dim": 32}
    with tempfile.TemporaryDirectory() as root:
        workdir = os.path.join(root, model)
        config = run_config(hf, f"{model} config.json", workdir, seq_len, "bfloat16")
        files.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
        p = eval_plan(workdir, 1, dtype="bfloat16")
    gib = 2 ** 30
    return {"model": model, "params": p["params"], "device_gib": p["capacity_bytes"] and p["capacity_bytes"] / gib,
            "lengths": [{"length": r["length"], "arguments_gib": r["argument_bytes"] / gib,
                         "temp_gib": r["temp_bytes"] / gib, "total_gib": r["total_bytes"] / gib, "fits": r["fits"]}
                        for r in p["lengths"]]}


# ---- the plan ----------------------------------------------------------------------------------

def plan(tiny: bool) -> list[tuple[str, str, float, object]]:
    """(section, item, estimated seconds on an H100 with compiling, run() -> row), by value."""
    s = sizes(tiny)
    reps = 1 if tiny else FLAGS.repeats
    items = [("checks", name, LAST.get(name, 20 if "PaTH" in name else 10),
              lambda c=case, n=name: run_check(n, *c, s["check"]))
             for name, case in check_cases(*s["check"]).items()]
    last = [x for x in items if x[1] in LAST]
    items = [x for x in items if x[1] not in LAST]
    first, *longer = s["lengths"]

    def attention_items(t):
        return [("attention", f"{n} at {t}", 15 * t / 8192 * (3 if n == "path_fox" else 1),
                 lambda n=n, t=t: run_attention(n, t, s["heads"], s["head_dim"], reps))
                for n in ("ceiling", *s["attention"])]

    def train_items(schemes):
        return [("train", f"{n} {impl}", 60 if n == "path_fox" else 30,
                 lambda n=n, i=impl: run_train(n, i, s["rows"], s["seq_len"], reps, tiny))
                for n in schemes for impl in ("auto", "blockwise")]

    dims = [("attention", f"ceiling at head dim {d}", 10,
             lambda d=d: run_attention("ceiling", first, s["heads"], d, reps)) for d in s["dims"]]
    # PaTH-FoX's chunked form (auto's choice on GPU) at its training chunk, one level and two.
    spans = [("attention", f"path_fox {impl} chunk {c} span {span} {tiles} tiles"
              f"{' across ' + across if across != 'scan' else ''} at {first}",
              (120 if impl == "pallas" else 30) * first / 8192,
              lambda i=impl, c=c, span=span, tiles=tiles, a=across: run_attention(
                  "path_fox", first, s["heads"], s["head_dim"], reps, i, c, span=span, tiles=tiles, across=a))
             for impl, c, span, tiles, across in s["path_spans"]]
    plans = [("eval plan", m, 30, lambda m=m: run_eval_plan(m, s["eval_len"])) for m in s["models"]]
    # The train steps of rope, alibi and fox before PaTH's forms: on the H200 (2026-11-28) the
    # checks' compiles took a 330 s budget and no timing at all was taken.
    return (items + attention_items(first) + train_items(s["train"][:3]) + spans + dims
            + [x for t in longer for x in attention_items(t)] + train_items(s["train"][3:]) + plans + last)


def run(budget_s: float, tiny: bool, path: str = "", only: tuple[str, ...] = ()) -> dict:
    """Every item that fits (and that `only` names, where given), in order; the json at `path`
    is rewritten after each (a run cut off keeps its rows)."""
    start = time.perf_counter()
    rows, skipped, spent, guessed = [], [], 0.0, 0.0

    def result():
        return {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
                "commit": commit(), "modules": modules(), "tiny": tiny, "budget_s": budget_s,
                "elapsed_s": round(time.perf_counter() - start, 1), "rows": rows, "skipped": skipped}

    for section, item, estimate, fn in plan(tiny):
        if only and not any(x in f"{section}: {item}" for x in only):
            skipped.append(f"{section}: {item} (not in --only)")
            continue
        scale = min(max(spent / guessed, 0.5), 3.0) if guessed else 1.0
        left = budget_s - (time.perf_counter() - start)
        if estimate * scale > left:
            skipped.append(f"{section}: {item} (about {estimate * scale:.0f} s, {left:.0f} s left)")
            continue
        if path:  # a run cut off says where
            save({**result(), "in_flight": f"{section}: {item}"}, path)
        t0 = time.perf_counter()
        try:
            row = fn()
        except Exception as e:  # noqa: BLE001 -- one line per failure; the rest goes on
            row = {"failed": " ".join(f"{type(e).__name__}: {e}".split())[:300]}
        took = time.perf_counter() - t0
        spent, guessed = spent + took, guessed + estimate
        rows.append({"section": section, "item": item, "seconds": round(took, 1), **row})
        print(f"[{time.perf_counter() - start:5.0f} s] {section}: {item}: "
              f"{row.get('failed') or {k: v for k, v in row.items() if k not in ('case', 'scheme')}}", flush=True)
        if path:
            save(result(), path)
    return result()


# What a later device call may need to carry: which of these the machine has (their versions).
PROBED = ("orbax.checkpoint", "tensorstore", "grain", "tensorflow_datasets", "matplotlib", "sentencepiece",
          "tokenizers", "torch", "triton", "fla")


@functools.cache
def modules() -> dict:
    """{module: its version, or None where this machine lacks it}, without importing any."""
    from importlib import metadata, util
    found = {}
    for name in PROBED:
        try:
            present = util.find_spec(name) is not None
        except ModuleNotFoundError:  # a parent package is missing
            present = False
        dist = {"orbax.checkpoint": "orbax-checkpoint", "fla": "flash-linear-attention"}.get(name, name)
        try:
            found[name] = metadata.version(dist) if present else None
        except metadata.PackageNotFoundError:
            found[name] = "present" if present else None
    return found


def save(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".part", "w") as f:
        json.dump(stamped(result), f, indent=1)
    os.replace(path + ".part", path)


def commit() -> str:
    """This tree's commit: git's, else $POSITIONAL_COMMIT (the device machine's copy has no .git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("POSITIONAL_COMMIT", "unknown")


def tables(result: dict) -> str:
    rows = result["rows"]
    out = [f"gpu check: {result['device']} ({result['platform']}), jax {result['jax']}, commit {result['commit']}, "
           f"{result['elapsed_s']:.0f} s of {result['budget_s']:.0f}", "",
           "| check (error; the bf16 reference's) | ok | out | dq | dk | dv | dgates |",
           "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["section"] == "checks"):
        if "failed" in r:
            out.append(f"| {r['item']} | - | {r['failed']} |||||")
            continue
        cells = " | ".join(f"{r[n]:.1e} ({r['reference_bf16'][n]:.1e})" if n in r else "-"
                           for n in ("out", "dq", "dk", "dv", "dgates"))
        out.append(f"| {r['item']} | {'yes' if r['ok'] else 'NO'} | {cells} |")
    out += ["", "| attention fwd+bwd | ms | x ceiling throughput | XLA temp GiB |", "|---|---|---|---|"]
    ceilings = {(r["tokens"], r["head_dim"]): r["ms"] for r in rows if r.get("scheme") == "ceiling"}
    base_dim = sizes(result["tiny"])["head_dim"]
    for r in (r for r in rows if r["section"] == "attention"):
        if "failed" in r:
            out.append(f"| {r['item']} | {r['failed']} | | |")
            continue
        base = ceilings.get((r["tokens"], base_dim))
        ratio = f"{base / r['ms']:.2f}" if base else "-"
        out.append(f"| {r['item']} | {r['ms']:.2f} | {ratio} | {r['temp_gib']:.3f} |")
    out += ["", "| train step | tokens/s | x blockwise | loss | compile s |", "|---|---|---|---|---|"]
    blockwise = {r["scheme"]: r["tokens_per_s"] for r in rows if r.get("impl") == "blockwise" and "tokens_per_s" in r}
    for r in (r for r in rows if r["section"] == "train"):
        if "failed" in r:
            out.append(f"| {r['item']} | {r['failed']} | | | |")
            continue
        ratio = f"{r['tokens_per_s'] / blockwise[r['scheme']]:.2f}" if r["scheme"] in blockwise else "-"
        out.append(f"| {r['item']} | {r['tokens_per_s']:,.0f} | {ratio} | {r['loss']:.3f} | {r['compile_s']:.0f} |")
    out += ["", "| eval plan (bf16, 4 windows) | length | arguments GiB | temporaries GiB | total GiB | device GiB "
            "| fits |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in rows if r["section"] == "eval plan"):
        if "failed" in r:
            out.append(f"| {r['item']} | {r['failed']} ||||||")
            continue
        device = f"{r['device_gib']:.1f}" if r["device_gib"] else "?"
        out += [f"| {r['item']} ({r['params'] / 1e9:.2f} B) | {x['length']:,} | {x['arguments_gib']:.2f} | "
                f"{x['temp_gib']:.2f} | {x['total_gib']:.2f} | {device} | {x['fits']} |" for x in r["lengths"]]
    if result["skipped"]:
        out += ["", "skipped: " + "; ".join(result["skipped"])]
    return "\n".join(out)


def benchmark() -> dict:
    path = FLAGS.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else "")
    result = run(FLAGS.budget_s, FLAGS.tiny, path, tuple(FLAGS.only))
    print("\n" + tables(result))
    if path:
        save(result, path)
        print(f"wrote {path}")
    return result


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags only", file=sys.stderr)
        sys.exit(1)
    benchmark()


if __name__ == "__main__":
    app.run(main)
