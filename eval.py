"""The shared eval loop: named evaluators (lab/evaluators.py) over one or several trained runs.

    python eval.py --workdirs=runs/rope,runs/alibi --out=runs/compare --max_multiplier=16
    python eval.py --workdirs=runs/rope --evals=lengths,transport --probe_length=1024
    python eval.py --workdirs=runs/rope --evals=retrieval --retrieval_tasks=passkey,multikey
    python eval.py --workdirs=runs/rope --scheme=rope_lm_infinite --out=runs/rope_lm_infinite

--evals picks the evaluators (default: lengths, i.e. perplexity by length, or task accuracy for
runs trained on a synthetic task); each writes its JSON, markdown and plots into --out.
--scheme evaluates the runs zero-shot under another scheme with their own parameters
(--scheme_options its options; LM-Infinite's window defaults to the run's training length). For
compatibility, --probe_length alone runs `transport`, and with --near_far `near_far`. Training
runs the same evaluators on its live model when its `config.evals` names them.
"""

from __future__ import annotations

import jax
from absl import app, flags

from lab import cli
from lab.evaluators import EVALUATORS, evaluate, get_evaluator
from lab.lengths import checked, plan, plan_report
from lab.probes import near_far_ranges
from lab.retrieval import DEPTHS, TASKS, checked_options as retrieval_options

flags.DEFINE_list("workdirs", [], "training run directories to evaluate and compare")
flags.DEFINE_bool("dry_run", False, "lengths: compile the scoring step at each length from the runs' config.json "
                  "alone (no weights read) and print each device's memory and which lengths fit")
flags.DEFINE_string("topology", "", "--dry_run for a TPU topology (v5p:1x1x1, v5e:2x2, ...: the TPU compiler "
                    "through libtpu) instead of this host's devices")
flags.DEFINE_string("out", "runs/eval", "where the evaluators' reports go")
flags.DEFINE_list("evals", [], f"evaluators to run, of: {', '.join(EVALUATORS)} (default: lengths, "
                  "or the probes --probe_length / --near_far name)")
flags.DEFINE_float("max_multiplier", 0, "lengths: largest length as a multiple of the training length "
                   "(0: the run's eval.multipliers)")
flags.DEFINE_integer("tokens", 0, "lengths: scored tokens per length (0: the run's eval.tokens)")
flags.DEFINE_integer("stride", -1, "lengths: sliding-window stride (0: non-overlapping; -1: the run's)")
flags.DEFINE_enum("within_documents", None, ["true", "false"], "lengths: score only documents longer than the "
                  "longest length, no window crossing a document's end (default: the run's eval.within_documents)")
flags.DEFINE_integer("documents", 0, "lengths, within documents: score the first N documents long enough, the "
                     "targets spread over them, each one's NLL kept (0: the run's eval.documents)")
flags.DEFINE_integer("probe_length", 0, "transport, near_far: window length of the probes")
flags.DEFINE_list("near_far", [], "near_far: histogram logit(lam) - logit(Lam) for lam in NEAR, Lam in FAR, "
                  "given as lo:hi,lo:hi")
flags.DEFINE_list("retrieval_tasks", [], f"retrieval: tasks, of {', '.join(TASKS)} (default: all)")
flags.DEFINE_list("retrieval_lengths", [], "retrieval: example lengths in tokens (default: the run's eval lengths)")
flags.DEFINE_list("retrieval_depths", [], f"retrieval: needle depths in [0, 1] (default: {','.join(map(str, DEPTHS))})")
flags.DEFINE_integer("retrieval_examples", 4, "retrieval: examples per length and depth")
flags.DEFINE_integer("retrieval_seed", 0, "retrieval: the seed the examples are generated from")
flags.DEFINE_integer("decode_max_length", -1, "retrieval: longest length also scored by greedy decoding "
                     "(-1: every length, its prefill in pieces of eval.blockwise_from tokens; 0: none)")
cli.define_distributed_flags()
cli.define_scheme_flags()
cli.define_loading_flags()
FLAGS = flags.FLAGS


def _probe_length() -> dict:
    return {"length": checked("--probe_length", FLAGS.probe_length, 1,
                              meaning="the window length that the transport and near_far evaluators need")}


def _ranges() -> dict:
    return near_far_ranges("--near_far", FLAGS.near_far, FLAGS.probe_length)


OPTIONS = {  # evaluator -> its options from the flags
    "lengths": lambda: {"max_multiplier": FLAGS.max_multiplier or None, "tokens": FLAGS.tokens or None,
                        "stride": None if FLAGS.stride == -1 else FLAGS.stride,
                        "within_documents": None if FLAGS.within_documents is None else FLAGS.within_documents == "true",
                        "documents": FLAGS.documents or None},
    "transport": _probe_length,
    "near_far": lambda: {**_probe_length(), **_ranges()},
    "analysis": dict,
    "retrieval": lambda: retrieval_options(FLAGS.retrieval_tasks or None, FLAGS.retrieval_lengths or None,
                                           FLAGS.retrieval_depths or DEPTHS, FLAGS.retrieval_examples,
                                           FLAGS.retrieval_seed,
                                           None if FLAGS.decode_max_length == -1 else FLAGS.decode_max_length),
}


def chosen() -> list[str]:
    if FLAGS.evals:
        return FLAGS.evals
    if FLAGS.near_far:
        return ["near_far"]
    return ["transport"] if FLAGS.probe_length else ["lengths"]


def checked_options() -> dict:
    """{evaluator: its options from the flags}, every name and flag checked before any evaluator runs."""
    for name in chosen():
        get_evaluator(name, "evaluator in --evals")
    return {name: OPTIONS.get(name, dict)() for name in chosen()}


def main(argv):
    del argv
    cli.quiet()
    cli.run_cli(lambda: cli.require_workdirs(FLAGS.workdirs))
    if FLAGS.dry_run:  # from the runs' config.json alone: nothing read, nothing run
        for workdir in FLAGS.workdirs:
            print(plan_report(cli.run_cli(lambda: plan(workdir, FLAGS.max_multiplier or None, **cli.loading(),
                                                       topology=FLAGS.topology))))
        return
    cli.run_cli(cli.start_processes)  # several processes: each scores its windows, process 0 writes
    options = cli.run_cli(checked_options)
    runs = cli.run_cli(lambda: cli.scheme_runs(FLAGS.workdirs, FLAGS.scheme, FLAGS.scheme_options, cli.loading()))
    for name, option in options.items():
        markdown = cli.run_cli(lambda: evaluate(name, runs, FLAGS.out, **option))
        if jax.process_index() == 0:  # of several processes, process 0 wrote the reports
            print(markdown)
    if jax.process_index() == 0:
        print(f"wrote {', '.join(chosen())} reports into {FLAGS.out}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
