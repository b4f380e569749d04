"""The shared eval loop: named evaluators (lab/evaluators.py) over one or several trained runs.

    python eval.py --workdirs=runs/rope,runs/alibi --out=runs/compare --config.eval_options.lengths.max_multiplier=16
    python eval.py --workdirs=runs/rope --config.evals=lengths,transport --config.eval_options.transport.length=1024
    python eval.py --workdirs=runs/rope --config.evals=retrieval --config.eval_options.retrieval.tasks=passkey,multikey
    python eval.py --workdirs=runs/rope --config.model.scheme=rope_lm_infinite --out=runs/rope_lm_infinite

Evaluators, their options and a zero-shot scheme are spelled as in a training config (the same
fields, `lab.cli.define_eval_config_flag`): --config.evals picks the evaluators (default:
lengths, i.e. perplexity by length, or task accuracy for runs trained on a synthetic task), each
writing its JSON, markdown and plots into --out; --config.eval_options.<evaluator>.<option> sets
an option (the evaluator's keyword arguments, checked by name and type); --config.model.scheme
evaluates the runs zero-shot under another scheme with their own parameters
(--config.model.scheme_options.<option> its options; LM-Infinite's window defaults to the run's
training length). Shorthands, kept for the commands of the results pages: --evals, --scheme,
--scheme_options, and the evaluators' flags below (each names the option it sets); --probe_length
alone runs `transport`, and with --near_far `near_far`. Training runs the same evaluators on its
live model when its `config.evals` names them.
"""

from __future__ import annotations

import jax
from absl import app, flags

from lab import cli
from lab.checkpoints import unmap_large_blocks_when_freed
from lab.evaluators import EVALUATORS, evaluate, get_evaluator, options_of
from lab.evaluators import checked_options as checked_options_of
from lab.lengths import checked, plan, plan_report
from lab.probes import near_far_ranges
from lab.retrieval import DEPTHS, TASKS, checked_options as retrieval_options

flags.DEFINE_list("workdirs", [], "training run directories to evaluate and compare")
flags.DEFINE_bool("dry_run", False, "lengths: compile the scoring step at each length from the runs' config.json "
                  "alone (no weights read) and print each device's memory and which lengths fit")
flags.DEFINE_string("topology", "", "--dry_run for a TPU topology (v5p:1x1x1, v5e:2x2, ...: the TPU compiler "
                    "through libtpu) or GPU hosts (h100:1, h200:8: XLA's GPU compiler through jax's CUDA plugin) "
                    "instead of this host's devices")
flags.DEFINE_string("out", "runs/eval", "where the evaluators' reports go")
flags.DEFINE_list("evals", [], f"evaluators to run, of: {', '.join(EVALUATORS)} (default: lengths, "
                  "or the probes --probe_length / --near_far name; a shorthand of --config.evals)")
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


CONFIG = cli.define_eval_config_flag()

PROBE_LENGTH = "the window length that the transport and near_far evaluators need"


def _probe_length(v) -> int:
    return checked("--probe_length", v, 1, meaning=PROBE_LENGTH)


def _near_far(which: str):
    return lambda v: near_far_ranges("--near_far", v, FLAGS.probe_length)[which]


# Shorthand flags: evaluator -> (option, flag, the option's value from the flag's), used where given.
SHORTHANDS = {
    "lengths": (("max_multiplier", "max_multiplier", lambda v: v or None), ("tokens", "tokens", lambda v: v or None),
                ("stride", "stride", lambda v: None if v == -1 else v),
                ("within_documents", "within_documents", lambda v: None if v is None else v == "true"),
                ("documents", "documents", lambda v: v or None)),
    "transport": (("length", "probe_length", _probe_length),),
    "near_far": (("length", "probe_length", _probe_length), ("near", "near_far", _near_far("near")),
                 ("far", "near_far", _near_far("far"))),
    "retrieval": (("tasks", "retrieval_tasks", list), ("lengths", "retrieval_lengths", list),
                  ("depths", "retrieval_depths", list), ("examples", "retrieval_examples", int),
                  ("seed", "retrieval_seed", int),
                  ("decode_max_length", "decode_max_length", lambda v: None if v == -1 else v)),
}


for _flag in {flag for items in SHORTHANDS.values() for _, flag, _ in items}:  # --help names what each sets
    FLAGS[_flag].help += " (a shorthand of " + ", ".join(
        f"--config.eval_options.{name}.{option}" for name, items in SHORTHANDS.items()
        for option, flag, _ in items if flag == _flag) + ")"


def _length(name: str, o: dict) -> dict:
    return {**o, "length": checked(f"eval_options.{name}.length", o["length"], 1, meaning=PROBE_LENGTH)}


def _ranges(o: dict) -> dict:
    """near and far, each (lo, hi) or 'lo:hi', as (lo, hi) within the probe length."""
    texts = [":".join(map(str, r)) if isinstance(r, (tuple, list)) else str(r) for r in (o["near"], o["far"])]
    return {**o, **near_far_ranges("eval_options.near_far.near,far", texts, o["length"])}


def _retrieval(options: dict) -> dict:
    o = {**options_of("retrieval"), **options}
    return retrieval_options(o["tasks"], o["lengths"], o["depths"], o["examples"], o["seed"], o["decode_max_length"])


VALUES = {  # evaluator -> its options with their values checked (beyond their types), one line each
    "transport": lambda o: _length("transport", o),
    "near_far": lambda o: _ranges(_length("near_far", o)),
    "retrieval": _retrieval,
}


def chosen() -> list[str]:
    if names := [n.strip() for n in CONFIG.value.evals.split(",") if n.strip()] or FLAGS.evals:
        return names
    if FLAGS.near_far:
        return ["near_far"]
    return ["transport"] if FLAGS.probe_length else ["lengths"]


def checked_options() -> dict:
    """{evaluator: its options}, from --config.eval_options and the shorthand flags given (the
    former win), every name, type and value checked before any evaluator runs."""
    config = cli.eval_config(CONFIG)
    for name in chosen():
        get_evaluator(name, f"evaluator in {'--config.evals' if config.evals else '--evals'}")
    found = {}
    for name in chosen():
        given = {option: convert(FLAGS[flag].value) for option, flag, convert in SHORTHANDS.get(name, ())
                 if FLAGS[flag].present}
        options = checked_options_of(name, {**given, **config.eval_options[name]})
        found[name] = VALUES.get(name, dict)(options)
    return found


def main(argv):
    del argv
    cli.quiet()
    unmap_large_blocks_when_freed()  # a process that holds a loaded model
    cli.run_cli(lambda: cli.require_workdirs(FLAGS.workdirs))
    if FLAGS.dry_run:  # from the runs' config.json alone: nothing read, nothing run
        options = cli.run_cli(checked_options).get("lengths", {})
        for workdir in FLAGS.workdirs:
            print(plan_report(cli.run_cli(lambda: plan(workdir, options.get("max_multiplier"), **cli.loading(),
                                                       topology=FLAGS.topology))))
        return
    cli.run_cli(cli.start_processes)  # several processes: each scores its windows, process 0 writes
    options = cli.run_cli(checked_options)
    runs = cli.run_cli(lambda: cli.eval_runs(FLAGS.workdirs, cli.eval_config(CONFIG)))
    for name, option in options.items():
        markdown = cli.run_cli(lambda: evaluate(name, runs, FLAGS.out, **option))
        if jax.process_index() == 0:  # of several processes, process 0 wrote the reports
            print(markdown)
    if jax.process_index() == 0:
        print(f"wrote {', '.join(chosen())} reports into {FLAGS.out}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
