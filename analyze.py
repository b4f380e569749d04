"""Why a scheme extrapolates: the "analysis" evaluator (lab/analysis.py), an alias of
`eval.py --config.evals=analysis` with flags of its own.

    python analyze.py --workdirs=runs/accumulated/rope,runs/accumulated/alibi --untrained \\
        --out=runs/analysis

Logit decompositions on --windows held-out windows of --length tokens, perplexity changes
under perturbations, and the feature shift past the training length; writes analysis.json,
analysis.md and plots under --out. Its flags are shorthands of the evaluator's options, which
eval.py and a training config spell --config.eval_options.analysis.<option> (this script takes
that spelling too, and --config.model.scheme / scheme_options); `eval.py --config.evals=analysis`
runs the same, and `decompositions`, `perturbations` or `feature_shift` one of its parts.

Several processes (--coordinator, --num_processes, --process_id on every host, as eval.py;
none under a cluster launcher JAX detects): each computes its share of the windows and
process 0 alone writes and prints the report.
"""

from __future__ import annotations

import jax
from absl import app, flags

from lab import analysis, cli
from lab.checkpoints import unmap_large_blocks_when_freed
from lab.evaluators import checked_options, evaluate

flags.DEFINE_list("workdirs", [], "training run directories to analyse")
flags.DEFINE_string("out", "runs/analysis", "where analysis.json / .md and the plots go")
flags.DEFINE_bool("untrained", False, "also analyse a freshly initialised copy of the first run's model")
flags.DEFINE_integer("length", 0, "window length of the logit decompositions (0: the training length)")
flags.DEFINE_integer("windows", 4, "held-out windows for the decompositions")
flags.DEFINE_bool("dry_run", False, "say from the runs' config.json alone (no weights read) whether the "
                  "decompositions fit in memory at --length, and the longest length that does")
flags.DEFINE_list("gammas", ["0.01", "0.05", "0.1", "0.5"], "perturbation ratios")
flags.DEFINE_list("l_max", ["5", "10", "100"], "perturbation ranges")
flags.DEFINE_integer("perturb_windows", 8, "windows of the training length for the perturbations")
flags.DEFINE_integer("shift_multiplier", 8, "feature-shift windows are this many training lengths "
                     "(a power of two)")
flags.DEFINE_integer("shift_windows", 8, "windows for the feature shift")
cli.define_distributed_flags()
cli.define_scheme_flags()
cli.define_loading_flags()
CONFIG = cli.define_eval_config_flag()
FLAGS = flags.FLAGS


def main(argv):
    del argv
    cli.quiet()
    unmap_large_blocks_when_freed()  # a process that holds a loaded model
    cli.run_cli(lambda: cli.require_workdirs(FLAGS.workdirs))
    if FLAGS.dry_run:  # from the runs' config.json alone: nothing read, nothing run
        for workdir in FLAGS.workdirs:
            print(cli.run_cli(lambda: analysis.plan(workdir, length=FLAGS.length, **cli.loading())))
        return
    cli.run_cli(cli.start_processes)  # before anything touches a device
    config = cli.run_cli(lambda: cli.eval_config(CONFIG))
    options = cli.run_cli(lambda: checked_options("analysis", {**analysis.flag_options(
        length=FLAGS.length, windows=FLAGS.windows, gammas=FLAGS.gammas, l_max=FLAGS.l_max,
        perturb_windows=FLAGS.perturb_windows, shift_multiplier=FLAGS.shift_multiplier,
        shift_windows=FLAGS.shift_windows), "untrained": FLAGS.untrained, **config.eval_options.analysis}))
    runs = cli.run_cli(lambda: cli.eval_runs(FLAGS.workdirs, config))
    markdown = cli.run_cli(lambda: evaluate("analysis", runs, FLAGS.out, **options))
    if jax.process_index() == 0:  # of several processes, process 0 wrote the report
        print(markdown)
        print(f"wrote {FLAGS.out}/analysis.json, analysis.md and the plots")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
