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

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

GiB = 2 ** 30
VOCAB = 258
TARGET_LENGTH, TARGET_GIB = 65536, 4.0  # the project's long-context memory target


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


def run_point(args, impl: str, length: int) -> dict:
    """Run `measure` in a fresh interpreter and return its JSON result (or an error note)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", impl, str(length),
           "--scheme", args.scheme, "--batch", str(args.batch), "--block-size", str(args.block_size),
           "--repeats", str(args.repeats)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {args.point_timeout} s"}
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


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scheme", default="rope")
    p.add_argument("--lengths", default="4096,8192,16384,32768,65536")
    p.add_argument("--impls", default="reference,blockwise")
    p.add_argument("--batch", type=int, default=1, help="rows per forward (the eval loop uses 4)")
    p.add_argument("--block-size", type=int, default=512, help="blockwise attention block size")
    p.add_argument("--repeats", type=int, default=1, help="timed calls after compiling; min is kept")
    p.add_argument("--memory-cap-gib", type=float, default=16.0,
                   help="skip reference points whose estimated score memory exceeds this")
    p.add_argument("--point-timeout", type=int, default=900, help="seconds per subprocess")
    p.add_argument("--child", nargs=2, metavar=("IMPL", "LENGTH"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child:
        result = measure(args.scheme, args.child[0], int(args.child[1]), args.batch, args.block_size,
                         args.repeats)
        print(json.dumps(result))
        return [result]

    from configs.default import get_config  # light import: the parent never touches jax arrays
    heads = get_config(args.scheme).model.num_heads
    baseline = run_point(args, "none", 0)
    if "error" in baseline:
        raise SystemExit(f"baseline process failed: {baseline['error']}")
    baseline = baseline["peak"]
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        for impl in args.impls.split(","):
            row = {"length": length, "impl": impl}
            est = reference_estimate_gib(args.batch, heads, length)
            if impl == "reference" and est > args.memory_cap_gib:
                row["skipped"] = f"skipped (est. {est:.0f} GiB)"
            else:
                row.update(run_point(args, impl, length))
                if "peak" in row:
                    row["growth"] = row["peak"] - baseline
            rows.append(row)
            print(f"# {json.dumps(row)}", file=sys.stderr, flush=True)  # progress for long runs

    print(f"scheme {args.scheme}, batch {args.batch}, block size {args.block_size}\n")
    print(table(rows, baseline))
    for impl in args.impls.split(","):
        ratios = growth_per_doubling(rows, impl)
        if ratios:
            print(f"\n{impl}: memory growth per doubling of length: "
                  + ", ".join(f"x{r:.2f}" for r in ratios))
    target = next((r for r in rows if r["length"] == TARGET_LENGTH and r["impl"] == "blockwise"
                   and "peak" in r), None)
    if target is not None and args.batch == 1:
        verdict = "met" if target["peak"] <= TARGET_GIB * GiB else "NOT met"
        print(f"\ntarget: blockwise forward at {TARGET_LENGTH:,} tokens within {TARGET_GIB:.0f} GiB peak "
              f"RSS: {target['peak'] / GiB:.2f} GiB, {verdict}")
    return rows


if __name__ == "__main__":
    main()
