"""Peak memory and time of one long forward pass: reference vs blockwise attention.

    python benchmarks/long_context.py                      # rope, 4K..64K tokens
    python benchmarks/long_context.py --lengths 4096,8192 --scheme alibi

The default model (configs/default.py, byte vocab 258) scores one row of `length` tokens with
`token_nll`, as the eval loop does. Every (impl, length) point runs in a fresh subprocess, so
its peak RSS (`ru_maxrss`) belongs to that point alone; a baseline process that only imports
jax and builds the model gives the floor, and "growth" is peak minus that floor.
Seconds exclude compilation: the function is compiled ahead of time, then the call is timed.
"XLA temp" is the compiler's planned scratch memory (`memory_analysis`), a cross-check of the
RSS growth that needs no run.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from absl import app, flags

GiB = 2 ** 30
VOCAB = 258
TARGET_LENGTH, TARGET_GIB = 65536, 4.0  # the project's long-context memory target

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("scheme", "rope", "a registered scheme", flag_values=FLAGS)
flags.DEFINE_string("lengths", "4096,8192,16384,32768,65536", "row lengths, comma-separated", flag_values=FLAGS)
flags.DEFINE_string("impls", "reference,blockwise", "attention impls, comma-separated", flag_values=FLAGS)
flags.DEFINE_integer("batch", 1, "rows per forward (the eval loop uses 4)", flag_values=FLAGS)
flags.DEFINE_integer("block_size", 512, "blockwise attention block size", flag_values=FLAGS)
flags.DEFINE_integer("repeats", 1, "timed calls after compiling; min is kept", flag_values=FLAGS)
flags.DEFINE_float("memory_cap_gib", 16.0, "skip reference points whose estimated score memory exceeds this",
                   flag_values=FLAGS)
flags.DEFINE_integer("point_timeout", 900, "seconds per subprocess", flag_values=FLAGS)
flags.DEFINE_string("child", "", "internal: measure this impl at the one length given, print its JSON "
                    "(the process `run_point` starts)", flag_values=FLAGS)
flags.DEFINE_alias("block-size", "block_size", flag_values=FLAGS)  # as docs and RESULTS.md spell it
flags.DEFINE_alias("memory-cap-gib", "memory_cap_gib", flag_values=FLAGS)
flags.DEFINE_alias("point-timeout", "point_timeout", flag_values=FLAGS)


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(scheme: str, impl: str, length: int, batch: int, block_size: int, repeats: int) -> dict:
    """Runs inside the child process. impl 'none' only builds the model (the baseline)."""
    import jax
    from flax import nnx

    from configs.default import get_config
    from models.lm import DecoderLM, ModelConfig, token_nll

    model_dict = {**get_config(scheme).model.to_dict(), "vocab_size": VOCAB, "block_size": block_size}
    model = DecoderLM(ModelConfig.from_dict(model_dict), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    if impl == "none":
        return {"peak": peak_rss_bytes()}
    tokens = jax.random.randint(jax.random.key(1), (batch, length + 1), 0, VOCAB)

    def nll(state, tokens):
        return token_nll(nnx.merge(graphdef, state), tokens, impl=impl, rng=jax.random.key(0))[0]

    t0 = time.perf_counter()
    compiled = jax.jit(nll).lower(state, tokens).compile()
    compile_s = time.perf_counter() - t0
    # XLA's own plan of the scratch buffers: a cross-check of RSS that needs no run.
    xla_temp = compiled.memory_analysis().temp_size_in_bytes
    peak_after_compile = peak_rss_bytes()  # tells compile-time memory apart from run-time memory
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled(state, tokens).block_until_ready()
        times.append(time.perf_counter() - t0)
    return {"seconds": min(times), "compile_s": compile_s, "peak_after_compile": peak_after_compile,
            "peak": peak_rss_bytes(), "xla_temp": xla_temp}


def run_point(impl: str, length: int) -> dict:
    """Run `measure` in a fresh interpreter and return its JSON result (or an error note)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--child={impl}", f"--lengths={length}",
           f"--scheme={FLAGS.scheme}", f"--batch={FLAGS.batch}", f"--block_size={FLAGS.block_size}",
           f"--repeats={FLAGS.repeats}"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FLAGS.point_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {FLAGS.point_timeout} s"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no stderr"])[-1]
        return {"error": f"exit {proc.returncode}: {tail[:120]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def reference_estimate_gib(batch: int, heads: int, length: int) -> float:
    # The [B, H, T, T] fp32 score matrix with ~3 live copies (scores, masked, probabilities) is
    # XLA's plan; measured RSS growth at 16,384 tokens was ~15% above it, hence 3.5.
    return batch * heads * length ** 2 * 4 * 3.5 / GiB


def table(rows: list[dict], baseline: int) -> str:
    lines = [f"baseline (import jax + build model): {baseline / GiB:.2f} GiB peak RSS", "",
             "| length | impl | seconds | peak RSS GiB | growth GiB | XLA temp GiB | "
             "blockwise/reference time | blockwise/reference growth |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    by_key = {(r["length"], r["impl"]): r for r in rows}
    for r in rows:
        if "skipped" in r or "error" in r:
            note = r.get("skipped") or r["error"]
            lines.append(f"| {r['length']:,} | {r['impl']} | {note} | | | | | |")
            continue
        ratio_t = ratio_m = ""
        ref = by_key.get((r["length"], "reference"), {})
        if r["impl"] == "blockwise" and "seconds" in ref:
            ratio_t = f"{r['seconds'] / ref['seconds']:.2f}"
            ratio_m = f"{r['growth'] / ref['growth']:.2f}" if ref["growth"] > 0 else ""
        lines.append(f"| {r['length']:,} | {r['impl']} | {r['seconds']:.2f} | {r['peak'] / GiB:.2f} | "
                     f"{r['growth'] / GiB:.2f} | {r['xla_temp'] / GiB:.2f} | {ratio_t} | {ratio_m} |")
    return "\n".join(lines)


def growth_per_doubling(rows: list[dict], impl: str) -> list[float]:
    """growth(2T) / growth(T) over successive measured lengths: ~2 is linear, ~4 quadratic."""
    g = [r["growth"] for r in rows if r["impl"] == impl and "growth" in r]
    return [b / a for a, b in zip(g, g[1:]) if a > 0]


def benchmark() -> list[dict]:
    """One row per (length, impl), as FLAGS ask; in a --child process, its one measurement."""
    if FLAGS.child:
        result = measure(FLAGS.scheme, FLAGS.child, int(FLAGS.lengths), FLAGS.batch, FLAGS.block_size,
                         FLAGS.repeats)
        print(json.dumps(result))
        return [result]

    from configs.default import get_config  # light import: the parent never touches jax arrays
    heads = get_config(FLAGS.scheme).model.num_heads
    baseline = run_point("none", 0)
    if "error" in baseline:
        raise SystemExit(f"baseline process failed: {baseline['error']}")
    baseline = baseline["peak"]
    rows = []
    for length in (int(x) for x in FLAGS.lengths.split(",")):
        for impl in FLAGS.impls.split(","):
            row = {"length": length, "impl": impl}
            est = reference_estimate_gib(FLAGS.batch, heads, length)
            if impl == "reference" and est > FLAGS.memory_cap_gib:
                row["skipped"] = f"skipped (est. {est:.0f} GiB)"
            else:
                row.update(run_point(impl, length))
                if "peak" in row:
                    row["growth"] = row["peak"] - baseline
            rows.append(row)
            print(f"# {json.dumps(row)}", file=sys.stderr, flush=True)  # progress for long runs

    print(f"scheme {FLAGS.scheme}, batch {FLAGS.batch}, block size {FLAGS.block_size}\n")
    print(table(rows, baseline))
    for impl in FLAGS.impls.split(","):
        ratios = growth_per_doubling(rows, impl)
        if ratios:
            print(f"\n{impl}: memory growth per doubling of length: "
                  + ", ".join(f"x{r:.2f}" for r in ratios))
    target = next((r for r in rows if r["length"] == TARGET_LENGTH and r["impl"] == "blockwise"
                   and "peak" in r), None)
    if target is not None and FLAGS.batch == 1:
        verdict = "met" if target["peak"] <= TARGET_GIB * GiB else "NOT met"
        print(f"\ntarget: blockwise forward at {TARGET_LENGTH:,} tokens within {TARGET_GIB:.0f} GiB peak "
              f"RSS: {target['peak'] / GiB:.2f} GiB, {verdict}")
    return rows


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
