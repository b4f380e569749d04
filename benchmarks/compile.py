"""Compile a config's train step for TPUs or GPUs with their compilers, on a host without either.

    python benchmarks/compile.py --topology v5e:2x2 --config configs/default.py:alibi \
        --config.seq_len=8192 --config.model.dtype=bfloat16
    python benchmarks/compile.py --topology v5p:2x2x4 --config configs/long_context.py:tpu16/rope
    python benchmarks/compile.py --topology h100:8 --config configs/long_context.py:gpu8/rope

The full train step (forward, backward and the AdamW update, as train.py builds it) is built
from abstract shapes over the topology's devices, with the config's mesh (default: every axis 1
but data, which takes every device; `--config.mesh.X=N` as for training), lowered by jit for
those devices (the Pallas kernels are sized for the topology's own chip: `lab.lowering.target`)
and compiled by libtpu for a TPU topology (`v5e:2x2`; `make` installs it in .venv/libtpu, `pip
install -e '.[tpu]'` does too) or by XLA's GPU compiler for GPU hosts (`h100:8`: one host of 8
H100s, `h200:1`, `h100:2x8`; through jax's CUDA plugin, which `make` installs in .venv/cuda).
Nothing runs. It prints what benchmarks/lowering.py prints (what auto chose at each call
site and why, the fused custom calls, the largest tensor, any T x T tensor), then the compile
time and the compiler's memory per device (arguments, outputs, temporaries, their total)
against the device's memory (a TPU chip's HBM; a GPU's whole memory, of which JAX by default
takes 75%: XLA_PYTHON_CLIENT_MEM_FRACTION).

Exit status 1, with one line on stderr ("error: ..."), on what benchmarks/lowering.py fails (a
scheme with a fused path fell back to a T x T path), a compile error (its first line: VMEM or
HBM exhausted, a Mosaic check, a Triton kernel over the GPU's shared memory), or a total over
the device's memory. A bad flag, an unknown topology, no libtpu or no CUDA plugin: one line and
exit 1.

The table of benchmarks/RESULTS.md: `--schemes all --lengths 8192,32768 --topology
v4:1x1x1,v5e:1x1,v5p:1x1x1,v6e:1x1 --json benchmarks/results/compile_tpu.jsonl` compiles
configs/default.py for every registered scheme and the Sessa mixer (`sessa`, its solve the
Pallas kernel) at each length,
with configs/default.py's tokens per step (16 rows of 8,192; 4 of 32,768), bf16, on each topology, one JSON line per compile appended to --json (rows already there are
skipped: rerun to go on), and prints the markdown table of the file; `--table` only prints it.
"""

from __future__ import annotations

import json
import os
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from benchmarks import lowering
from configs.default import get_config
from lab import cli
from lab.lowering import hbm_per_device, memory, platform_of, topology_devices
from models.registry import REGISTRY

FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_list("topology", None, "TPU topology <generation>:<chips per axis> (v4:2x2x1, v5e:2x2, v5p:2x2x1, "
                  "v6e:2x2, ...) or GPU hosts <gpu>:[<hosts>x]<gpus per host> (h100:8, h200:1); required, several "
                  "with --schemes", flag_values=FLAGS)
flags.DEFINE_list("schemes", [], "a table: these schemes of configs/default.py ('all': every registered one and "
                  "the Sessa mixer, 'sessa')", flag_values=FLAGS)
flags.DEFINE_list("lengths", ["8192", "32768"], "the table's sequence lengths", flag_values=FLAGS)
flags.DEFINE_string("json", "benchmarks/results/compile_tpu.jsonl", "the table's rows, one JSON line per compile",
                    flag_values=FLAGS)
flags.DEFINE_bool("redo", False, "a table: compile again the asked rows already in --json, replacing them",
                  flag_values=FLAGS)
flags.DEFINE_bool("table", False, "only print the markdown table of --json", flag_values=FLAGS)
flags.DEFINE_bool("force_auto", True, "set model.attention_impl='auto' (as benchmarks/lowering.py)", flag_values=FLAGS)
config_flags.DEFINE_config_file("config", None, "experiment config: configs/<file>.py[:arg] (required)",
                                flag_values=FLAGS, lock_config=False, accept_new_attributes=True)


def gib(n: int) -> str:
    return f"{n / 2 ** 30:,.2f} GiB"


def first_line(e: Exception) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def compile_check(config, topology: str, force_auto: bool = True) -> dict:
    """Lower and compile `config`'s train step for `topology`, print the report; returns
    benchmarks/lowering.py's dict with 'compile_s', 'memory' and 'hbm_bytes' added, 'failure'
    the one line to exit with (None: it compiled and fits)."""
    devices = topology_devices(topology)
    platform = platform_of(topology)
    compiler = {"cuda": "XLA's GPU compiler", "tpu": "libtpu"}[platform]
    try:
        result = lowering.check(config, platform, force_auto, devices=devices)
    except Exception as e:  # noqa: BLE001 -- lowering for these devices failed: JAX's reason, in one line
        reason = first_line(e)
        print(f"lowering: FAILED: {reason}", flush=True)
        return {"topology": topology, "scheme": config.model.scheme, "device_kind": devices[0].device_kind,
                "failure": f"{config.model.scheme} does not lower for {topology}: {reason}", "compile_s": None,
                "memory": None, "sites": {}, "custom_calls": {}}
    hbm = hbm_per_device(topology, devices)
    result.update(topology=topology, device_kind=devices[0].device_kind, hbm_bytes=hbm, compile_s=None,
                  memory=None)
    start = time.perf_counter()
    try:
        compiled = result["lowered"].compile()
    except Exception as e:  # noqa: BLE001 -- the compiler's reason, in one line
        result["compile_s"] = time.perf_counter() - start
        reason = first_line(e)
        result["failure"] = result["failure"] or f"{compiler} refused it ({topology}): {reason}"
        print(f"compile: FAILED after {result['compile_s']:.1f} s: {reason}", flush=True)
        return result
    result["compile_s"] = time.perf_counter() - start
    mem = result["memory"] = memory(compiled)
    fits = mem["total_bytes"] <= hbm
    print(f"compiled for {topology} ({len(devices)} x {devices[0].device_kind}) in {result['compile_s']:.1f} s, "
          f"jax {jax.__version__}\n"
          f"per device ({compiler}): arguments {gib(mem['argument_bytes'])}, outputs {gib(mem['output_bytes'])} "
          f"(aliased {gib(mem['alias_bytes'])}), temporaries {gib(mem['temp_bytes'])}; total "
          f"{gib(mem['total_bytes'])} of {gib(hbm)}: {'fits' if fits else 'DOES NOT FIT'}", flush=True)
    if not fits and result["failure"] is None:
        result["failure"] = (f"{config.model.scheme} needs {gib(mem['total_bytes'])} per device on {topology}, over the "
                             f"{gib(hbm)} of its memory; shard it further (--config.mesh.fsdp=N) or shorten the batch")
    return result


def row(result: dict, seq_len: int, batch: int) -> dict:
    """What the table keeps of one compile."""
    choices = sorted({f"{label} {chosen}" for label, chosen, _ in result.get("sites", {})})
    return {"scheme": result["scheme"], "seq_len": seq_len, "topology": result["topology"], "batch": batch,
            "device_kind": result["device_kind"], "compiled": result.get("memory") is not None,
            "auto": choices, "mosaic_calls": result.get("custom_calls", {}).get("mosaic"),
            "fused_calls": {k: n for k, n in result.get("custom_calls", {}).items() if n},
            "compile_s": result["compile_s"], "memory": result.get("memory"), "hbm_bytes": result.get("hbm_bytes"),
            "failure": result["failure"], "jax": jax.__version__}


def fused_calls(row: dict) -> str:
    """The step's fused custom calls by kind ("mosaic 24", "triton 3, cudnn 2"); rows written
    before kinds were kept have the Mosaic count alone."""
    calls = row.get("fused_calls", {"mosaic": row["mosaic_calls"]} if row["mosaic_calls"] else {})
    return ", ".join(f"{kind} {n}" for kind, n in calls.items()) or ("-" if row["mosaic_calls"] is None else "0")


def table(path: str) -> str:
    lines = ["| scheme | rows x tokens | topology | compiled | auto chose | fused calls | compile s | peak GiB / memory | failure |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(map(json.loads, open(path)), key=lambda r: (r["topology"], r["seq_len"], r["scheme"])):
        mem = r["memory"]
        peak = f"{mem['total_bytes'] / 2 ** 30:.2f} / {r['hbm_bytes'] / 2 ** 30:.0f}" if mem else "-"
        secs = f"{r['compile_s']:.0f}" if r["compile_s"] is not None else "-"
        lines.append(f"| {r['scheme']} | {r.get('batch', 16)} x {r['seq_len']:,} | {r['topology']} | {'yes' if r['compiled'] else 'no'} | "
                     f"{', '.join(r['auto']) or '-'} | {fused_calls(r)} | "
                     f"{secs} | {peak} | {(r['failure'] or '').replace('|', '/')} |")
    return "\n".join(lines)


def sweep(schemes, lengths, topologies, path: str, redo: bool = False) -> list:
    """Compile configs/default.py for each scheme x length x topology (see the module's doc);
    `redo`: the rows already in `path` too, each replacing its old row."""
    schemes = [*sorted(REGISTRY), "sessa"] if schemes == ["all"] else schemes
    old = list(map(json.loads, open(path))) if os.path.exists(path) else []
    done = set() if redo else {(r["scheme"], r["seq_len"], r["topology"]) for r in old}
    failures = []
    for topology in topologies:
        for seq_len in map(int, lengths):
            for scheme in schemes:
                name = "rope" if scheme == "sessa" else scheme
                if (scheme, seq_len, topology) in done:
                    continue
                config = get_config(name)
                # configs/default.py's tokens per step at 8,192: longer rows, fewer of them
                batch = max(1, config.batch_size * 8192 // seq_len)
                config.update_from_flattened_dict({"seq_len": seq_len, "model.dtype": "bfloat16", "batch_size": batch})
                if scheme == "sessa":  # the Sessa mixer (over rope), its feedback solve the Pallas kernel
                    config.model.update(mixer="sessa", mixer_options={"solve": "pallas"})
                print(f"\n== {scheme} at {seq_len:,} on {topology}", flush=True)
                result = compile_check(config, topology)
                result["scheme"] = scheme
                os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
                new = row(result, seq_len, batch)
                if redo:  # the file rewritten whole, the old row out (one writer at a time)
                    rows = [r for r in map(json.loads, open(path)) if (r["scheme"], r["seq_len"], r["topology"])
                            != (scheme, seq_len, topology)] if os.path.exists(path) else []
                    with open(path + ".part", "w") as f:
                        f.writelines(json.dumps(r) + "\n" for r in [*rows, new])
                    os.replace(path + ".part", path)
                else:
                    with open(path, "a") as f:
                        f.write(json.dumps(new) + "\n")
                failures += [result["failure"]] if result["failure"] else []
    print("\n" + table(path))
    return failures


def benchmark():
    if FLAGS.table:
        print(table(FLAGS.json))
        return None
    if FLAGS.topology is None:
        raise ValueError("pass --topology <generation>:<chips per axis> or <gpu>:<gpus>, e.g. --topology v5e:2x2 "
                         "or h100:8")
    if FLAGS.schemes:
        return sweep(FLAGS.schemes, FLAGS.lengths, FLAGS.topology, FLAGS.json, FLAGS.redo)
    if len(FLAGS.topology) > 1:
        raise ValueError("pass one --topology, or several with --schemes")
    return compile_check(lowering.configured(FLAGS), FLAGS.topology[0], FLAGS.force_auto)


main = lowering.main_of(benchmark)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
