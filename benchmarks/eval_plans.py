"""eval.py --dry_run for published model shapes, without their weights: will evaluating them fit?

    python benchmarks/eval_plans.py [--models Llama-3.2-1B,Llama-3.2-3B,Llama-3.1-8B] \
        [--targets host,v5p:1x1x1] [--seq_len 4096] [--json benchmarks/results/eval_plans.jsonl]

For each model of `lab.hf.PUBLISHED` asked, a run directory holding only the config.json that
import_checkpoint.py would write (parameters bf16 as published, training length --seq_len) is
made in a temporary folder; `lab.lengths.plan` then compiles the lengths evaluator's scoring
step (eval.batch_size = 4 windows) at half and the whole training length, computing in bf16, for
each target: `host` (this machine's devices, XLA's CPU compiler), a TPU topology (the TPU
compiler through libtpu) or GPU hosts (`h100:1`: XLA's GPU compiler through jax's CUDA plugin),
as benchmarks/compile.py. One JSON line per model x target is appended to --json (a pair
already there is skipped: rerun to go on) and the markdown table of the file printed. Nothing
is read or allocated.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import jax
from absl import app, flags

from lab import cli, files
from lab.hf import PUBLISHED, run_config
from lab.lengths import plan

flags.DEFINE_list("models", ["Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"], f"of {', '.join(PUBLISHED)}")
flags.DEFINE_list("targets", ["host", "v5p:1x1x1"], "host, TPU topologies (v5p:1x1x1, v5e:2x2, ...) or GPU hosts (h100:1, ...)")
flags.DEFINE_integer("seq_len", 4096, "the training length the plans evaluate at (and half of it)")
flags.DEFINE_string("json", "benchmarks/results/eval_plans.jsonl", "one JSON line per model x target")
FLAGS = flags.FLAGS


def gib(n) -> str:
    return f"{n / 2 ** 30:,.2f}"


def table(path: str) -> str:
    lines = ["| model | target | parameters | length | arguments GiB | temporaries GiB | total GiB / device | "
             "device GiB | fits |", "|---|---|---|---|---|---|---|---|---|"]
    for r in map(json.loads, open(path)):
        for row in r["lengths"]:
            fits = "?" if row["fits"] is None else "yes" if row["fits"] else "NO"
            lines.append(f"| {r['model']} | {r['target']} ({r['device_kind']}) | {r['params'] / 1e9:.2f} B | "
                         f"{row['length']:,} | {gib(row['argument_bytes'])} | {gib(row['temp_bytes'])} | "
                         f"{gib(row['total_bytes'])} | {gib(r['capacity_bytes']) if r['capacity_bytes'] else '?'} | "
                         f"{fits} |")
    return "\n".join(lines)


def benchmark() -> None:
    unknown = sorted(set(FLAGS.models) - set(PUBLISHED))
    if unknown:
        raise ValueError(f"--models: unknown {', '.join(unknown)}; known: {', '.join(PUBLISHED)}")
    done = {(r["model"], r["target"]) for r in map(json.loads, open(FLAGS.json))} if os.path.exists(FLAGS.json) else set()
    # This host's devices first: once libtpu is loaded for a topology, JAX's default backend is unchanged,
    # but the host plans need nothing of it.
    targets = sorted(FLAGS.targets, key=lambda t: t != "host")
    with tempfile.TemporaryDirectory() as root:
        for target in targets:
            for name in FLAGS.models:
                if (name, target) in done:
                    continue
                workdir = os.path.join(root, name)
                config = run_config(PUBLISHED[name], f"{name} config.json", workdir, FLAGS.seq_len, "bfloat16")
                files.write_text(os.path.join(workdir, "config.json"), config.to_json_best_effort(indent=2))
                print(f"== {name} on {target}", flush=True)
                result = plan(workdir, 1, dtype="bfloat16", topology="" if target == "host" else target)
                result.update(model=name, target=target, jax=jax.__version__, workdir=None)
                os.makedirs(os.path.dirname(FLAGS.json) or ".", exist_ok=True)
                with open(FLAGS.json, "a") as f:
                    f.write(json.dumps(result) + "\n")
    print(table(FLAGS.json))


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags only", file=sys.stderr)
        sys.exit(1)
    cli.quiet()
    cli.run_cli(benchmark)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
