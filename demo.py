"""`make demo`: train the baseline schemes on the embedded corpus and compare how they
extrapolate, with the shared eval loop.

    python demo.py [--fast] [--schemes rope,alibi,nope] [--out runs/demo/compare]

Runs resume from their checkpoints, so a second call only re-evaluates.
"""

from __future__ import annotations

import argparse
import os
import time

from absl import logging

DEMO_SCHEMES = ("rope", "alibi", "nope", "so2_learned_qkv", "tapa", "path_fox")


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the ~2-minute version")
    parser.add_argument("--schemes", default=",".join(DEMO_SCHEMES))
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.WARNING)

    from configs import demo
    from eval import evaluate_runs, write_report
    from train import run_cli, train

    workdirs = []
    for scheme in args.schemes.split(","):
        config = demo.get_config(scheme + (",fast" if args.fast else ""))
        t0 = time.perf_counter()
        summary = run_cli(lambda: train(config))
        final = f"final loss {summary['losses'][-1]:.4f}" if summary["losses"] else "already trained"
        print(f"[{scheme}] {summary['step']} steps, {final}, {time.perf_counter() - t0:.0f}s")
        workdirs.append(summary["workdir"])
    out = args.out or os.path.join(os.path.dirname(workdirs[0]), "compare")
    results = run_cli(lambda: evaluate_runs(workdirs))
    table = write_report(results, out)
    print("\n" + table + f"\nwrote {out}/results.json, results.md, results.png")
    return table


if __name__ == "__main__":
    main()
