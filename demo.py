"""`make demo`: train the baseline schemes on the embedded corpus and compare how they
extrapolate, with the shared eval loop.

    python demo.py [--fast] [--schemes rope,alibi,nope] [--out runs/demo/compare]

Runs resume from their checkpoints, so a second call only re-evaluates.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from configs import demo
from lab import cli
from lab.evaluators import evaluate
from lab.training import train

DEMO_SCHEMES = ("rope", "alibi", "nope", "so2_learned_qkv", "tapa", "path_fox")


flags.DEFINE_bool("fast", False, "the ~2-minute version")
flags.DEFINE_list("schemes", list(DEMO_SCHEMES), "schemes to train and compare")
flags.DEFINE_string("out", "", "where the comparison goes (default: beside the runs)")
FLAGS = flags.FLAGS


def run(schemes, fast: bool = False, out: str = "") -> str:
    """Train (or resume) each scheme's demo run, then compare them by length; the table."""
    workdirs = []
    for scheme in schemes:
        config = demo.get_config(scheme + ("/fast" if fast else ""))
        t0 = time.perf_counter()
        summary = cli.run_cli(lambda: train(config))
        cli.exit_if_interrupted(summary)  # a stopped run ends the demo (rerun to continue)
        final = f"final loss {summary['losses'][-1]:.4f}" if summary["losses"] else "already trained"
        print(f"[{scheme}] {summary['step']} steps, {final}, {time.perf_counter() - t0:.0f}s")
        workdirs.append(summary["workdir"])
    out = out or os.path.join(os.path.dirname(workdirs[0]), "compare")
    table = cli.run_cli(lambda: evaluate("lengths", workdirs, out))
    print("\n" + table + f"\nwrote {out}/results.json, results.md, results.png")
    return table


def main(argv):
    del argv
    cli.quiet()
    run(FLAGS.schemes, FLAGS.fast, FLAGS.out)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
