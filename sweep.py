"""Train the arms of an experiment x seeds, then evaluate them all (lab/sweep.py).

    python sweep.py --config configs/path.py --seeds=0,1,2 --out=runs/sweeps/path
    python sweep.py --config configs/default.py --arms=rope,alibi --seeds=0,1 --out=runs/sweeps/tiny \\
        --config.train.steps=200 --config.model.num_layers=2

Arms: --arms (each the config file's argument), else the file's VARIANTS. Every arm x seed
trains into <out>/<arm>/seed<seed> with the --config.<field>=<value> overrides (as train.py);
finished runs are skipped and interrupted ones resume, so the same command completes a sweep.
Then --evals (eval.py's evaluators, run with each run's own eval settings) write their reports
under <out>/<evaluator>/; `python -m lab.results.seeds <out>/lengths/results.json X.json`
turns perplexity by length into a table of means and intervals over seeds.
"""

from __future__ import annotations

import os

import jax
from absl import app, flags
from ml_collections import config_flags

from lab import cli
from lab.evaluators import evaluate, get_evaluator
from lab.sweep import sweep

CONFIG = cli.define_config_flag()
flags.DEFINE_list("arms", [], "the arms: the config file's arguments (default: its VARIANTS)")
flags.DEFINE_list("seeds", ["0"], "the seeds of every arm")
flags.DEFINE_string("out", "", "the sweep's folder: <out>/<arm>/seed<seed> per run, <out>/<evaluator> per report")
flags.DEFINE_list("evals", ["lengths"], "evaluators run on every run once all are trained (none: --evals=)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    cli.quiet()
    cli.checked_config(CONFIG)
    flag = FLAGS["config"]
    file = config_flags.get_config_filename(flag).partition(":")[0]
    cli.run_cli(lambda: _check(FLAGS.out, FLAGS.seeds, FLAGS.evals))
    workdirs, stopped = cli.run_cli(lambda: sweep(file, FLAGS.arms, [int(s) for s in FLAGS.seeds], FLAGS.out,
                                                  config_flags.get_override_values(flag)))
    if stopped:
        cli.exit_if_interrupted(stopped)
    for name in FLAGS.evals:
        markdown = cli.run_cli(lambda: evaluate(name, workdirs, os.path.join(FLAGS.out, name)))
        if jax.process_index() == 0:
            print(markdown)
    print(f"swept {len(workdirs)} runs into {FLAGS.out}" + (f"; reports: {', '.join(FLAGS.evals)}" if FLAGS.evals else ""))


def _check(out: str, seeds, evals) -> None:
    """One line for a bad flag, before anything trains."""
    if not out:
        raise ValueError("--out is required: the folder the sweep's runs and reports go in")
    if not seeds or not all(s.isdigit() for s in seeds):
        raise ValueError(f"--seeds={','.join(seeds)}: give non-negative integers, comma-separated")
    for name in evals:
        get_evaluator(name, "evaluator in --evals")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
