"""Per-device memory of the sharded train step as the sequence axis grows, at a fixed total
length: simulated CPU devices, XLA's memory analysis of the compiled step (train.dry_run).

    python benchmarks/sequence_parallel.py --seq-len 4096 --devices 1,2,4,8 --schemes rope,path

Each device count runs in its own process (`--xla_force_host_platform_device_count=n`) with
mesh sequence=n, one row of --seq-len tokens, the default model. The memory is the plan (the
dry run allocates nothing); the reference attention's T x T scores dominate, and they should
fall as 1/n when the partitioner splits the queries over the sequence axis. With --steps the
step also runs and its median wall time is reported: simulated devices share this host's
cores, so that time shows the partitioned program's overhead, not a real speed-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_integer("seq_len", 4096, "tokens in the one row", flag_values=FLAGS)
flags.DEFINE_alias("seq-len", "seq_len", flag_values=FLAGS)  # as docs and RESULTS.md spell it
flags.DEFINE_string("devices", "1,2,4,8", "simulated device counts, comma-separated", flag_values=FLAGS)
flags.DEFINE_string("schemes", "rope", "comma-separated registry names", flag_values=FLAGS)
flags.DEFINE_string("impl", "", "attention impl (default: the scheme's default config)", flag_values=FLAGS)
flags.DEFINE_integer("steps", 0, "also run this many steps and report the median time", flag_values=FLAGS)
flags.DEFINE_bool("child", False, "internal: measure the one scheme and device count given, print its "
                  "JSON (the process `on_devices` starts)", flag_values=FLAGS)


def child(scheme: str, seq_len: int, n: int, impl: str, steps: int) -> dict:
    import time

    import jax
    import numpy as np

    from configs.default import get_config
    from lab.state import init_state, mesh_and_batch
    from lab.state import make_train_step
    from lab.training import dry_run
    c = get_config(scheme)
    c.model.vocab_size, c.seq_len, c.batch_size = 258, seq_len, 1
    c.mesh.update(data=1, sequence=n)
    if impl:
        c.model.attention_impl = impl
    out = dry_run(c)
    if steps:  # run the step too: wall time on simulated devices that share this host's cores
        mesh, batch_sharding = mesh_and_batch(c)
        graphdef, rest, tx, _, state = init_state(c, 258, mesh)
        shardings = jax.tree.map(lambda x: x.sharding, state)
        step = make_train_step(graphdef, rest, tx, c, shardings, batch_sharding)
        row = np.arange(seq_len + 1, dtype=np.int32)[None] % 258
        batch = {k: jax.device_put(v, batch_sharding) for k, v in
                 {"tokens": row, "segment_ids": np.ones_like(row), "positions": row}.items()}
        times = []
        for _ in range(steps + 1):
            t0 = time.perf_counter()
            state, metrics = step(state, batch)
            float(metrics["loss"])
            times.append(time.perf_counter() - t0)
        out["step_seconds"] = float(np.median(times[1:]))
    return out


def on_devices(script: str, n: int, argv: list[str]) -> dict:
    """Run `script` with flags `argv` in a process with n simulated devices; its last stdout line's JSON."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    run = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    if run.returncode:
        raise RuntimeError(run.stderr[-2000:])
    return json.loads(run.stdout.strip().splitlines()[-1])


def benchmark() -> list[dict]:
    """One row per (scheme, device count), as FLAGS ask; none in a --child process."""
    if FLAGS.child:
        print(json.dumps(child(FLAGS.schemes, FLAGS.seq_len, int(FLAGS.devices), FLAGS.impl, FLAGS.steps)))
        return []
    rows = []
    for scheme in FLAGS.schemes.split(","):
        for n in (int(x) for x in FLAGS.devices.split(",")):
            point = [f"--schemes={scheme}", f"--seq_len={FLAGS.seq_len}", f"--devices={n}",
                     f"--impl={FLAGS.impl}", f"--steps={FLAGS.steps}", "--child"]
            rows.append({"scheme": scheme, "devices": n, **on_devices(__file__, n, point)})
            print(f"# {rows[-1]}", file=sys.stderr, flush=True)
    print(f"\nper-device memory of the train step, {FLAGS.seq_len} tokens, one row, mesh sequence=n\n")
    print("| scheme | devices | arguments MiB | temporaries MiB | total MiB | total x devices / one device "
          "| step s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        one = next(x for x in rows if x["scheme"] == r["scheme"] and x["devices"] == rows[0]["devices"])
        mib = lambda b: f"{b / 2 ** 20:,.1f}"  # noqa: E731
        print(f"| {r['scheme']} | {r['devices']} | {mib(r['argument_bytes'])} | {mib(r['temp_bytes'])} | "
              f"{mib(r['total_bytes'])} | {r['total_bytes'] * r['devices'] / one['total_bytes']:.2f} | "
              f"{r.get('step_seconds', float('nan')):.2f} |")
    return rows


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
