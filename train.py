"""Train a decoder LM with any registered position scheme.

    python train.py --config configs/default.py:alibi --config.train.steps=500 \\
        --config.workdir=runs/alibi

Resumes from the latest complete checkpoint in `<workdir>/checkpoints` when there is one, so
rerunning the same command after a crash or preemption continues the exact same run. A run
stopped by SIGTERM/SIGINT saves a checkpoint and exits 128 + the signal's number; one trainer
at a time per workdir (`<workdir>/lock`).
`--config.dry_run=True` compiles the sharded train step and prints each device's memory.
The work is done by the runs library: lab/training.py.
"""

from __future__ import annotations

from absl import app

from lab import cli
from lab.training import dry_run, dry_run_report, train

CONFIG = cli.define_config_flag()


def main(argv):
    del argv
    cli.quiet()
    config = cli.checked_config(CONFIG)
    if config.get("dry_run"):
        print(dry_run_report(cli.run_cli(lambda: dry_run(config))))
        return
    summary = cli.run_cli(lambda: train(config))
    cli.exit_if_interrupted(summary)
    if summary["losses"]:
        print(f"done: step {summary['step']}, final loss {summary['losses'][-1]:.4f}, "
              f"workdir {summary['workdir']}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
