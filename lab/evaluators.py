"""The named evaluators, the one place eval.py, analyze.py, demo.py, training and a notebook
look them up.

An evaluator has `run(runs, **options) -> outcome` (the runs are training directories or
`lab.runs.Run`s already in memory; the options are the evaluator's own keyword arguments),
`report(outcome, out) -> markdown`, which writes its JSON, markdown and plots under `out`, and
`summary(outcome) -> {name: float}`, a scalar or two of the first run for the training log:

  lengths         perplexity of held-out text by evaluation length; task accuracy for runs
                  trained on a synthetic task (lab/lengths.py): results.json / .md / .png
  transport       the transport probes: attention mass by distance, far mass, and for schemes
                  with steps the spectral gap, route decay and value cancellation (lab/probes.py)
  near_far        near-minus-far logit differences, the TAPA paper's Figure 1 (lab/probes.py)
  decompositions  logit decompositions of the position-generalization paper (lab/analysis.py)
  perturbations   perplexity changes under its perturbations (lab/analysis.py)
  feature_shift   its feature shift past the training length (lab/analysis.py)
  analysis        the last three, each run loaded once: analysis.json / .md and their plots
  retrieval       passkey and RULER-style needle-in-a-haystack accuracy by length and needle
                  depth, teacher-forced and by greedy decoding (lab/retrieval.py)

Training runs the evaluators its config names (`evals`, with `eval_options`) on its live model
every `train.eval_every` steps (`in_training`), reports under <workdir>/evals/<step>/<name>/.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable

import jax

from lab import analysis, files, lengths, probes, retrieval


@dataclasses.dataclass(frozen=True)
class Evaluator:
    run: Callable[..., Any]
    report: Callable[[Any, str], str]
    summary: Callable[[Any], dict]
    doc: str


def analysis_evaluator(parts: tuple[str, ...], stem: str, doc: str) -> Evaluator:
    """The parts of lab/analysis.py named, reported as <stem>.json / .md and their plots."""
    return Evaluator(functools.partial(analysis.analyze_runs, parts=parts),
                     functools.partial(analysis.report, parts=parts, stem=stem),
                     functools.partial(analysis.summary, parts=parts), doc)


EVALUATORS = {
    "lengths": Evaluator(lengths.evaluate_runs, lengths.write_report, lengths.summary,
                         "perplexity by length, task accuracy"),
    "transport": Evaluator(probes.probe_runs, probes.probe_report, probes.probe_summary, "transport probes"),
    "near_far": Evaluator(probes.near_far_runs, probes.near_far_report, probes.near_far_summary,
                          "near-minus-far logit differences"),
    **{part: analysis_evaluator((part,), part, doc) for part, doc in (
        ("decompositions", "logit decompositions"), ("perturbations", "perplexity under perturbations"),
        ("feature_shift", "feature shift past the training length"))},
    "analysis": analysis_evaluator(analysis.PARTS, "analysis",
                                   "logit decompositions, perturbations, feature shift"),
    "retrieval": Evaluator(retrieval.retrieval_runs, retrieval.report, retrieval.summary,
                           "passkey and needle-in-a-haystack accuracy by length and depth"),
}


def get_evaluator(name: str, field: str = "evaluator") -> Evaluator:
    if name not in EVALUATORS:
        raise ValueError(f"unknown {field} {name!r}; valid: {', '.join(EVALUATORS)}")
    return EVALUATORS[name]


NOT_OPTIONS = ("runs", "log", "parts")  # run()'s arguments that are not the user's options
REQUIRED = object()  # the default of an option an evaluator cannot do without


def options_of(name: str) -> dict:
    """{option: its default} of evaluator `name`: its run()'s keyword arguments (REQUIRED where
    it has no default)."""
    return {p.name: REQUIRED if p.default is p.empty else p.default
            for p in inspect.signature(get_evaluator(name).run).parameters.values() if p.name not in NOT_OPTIONS}


def checked_options(name: str, options, field: str = "eval_options") -> dict:
    """The options of evaluator `name` as a dict, after checking them against its run()'s
    keyword arguments: an unknown or missing one, or a value of another type than its default's,
    is a ValueError, one line naming `<field>.<name>.<option>`. (What a value may be beyond its
    type, the evaluator checks.)"""
    known, options = options_of(name), dict(options or {})
    for key, value in options.items():
        if key not in known:
            raise ValueError(f"{field}.{name}.{key} is not an option of evaluator {name}; valid: "
                             f"{', '.join(known) or 'none'}")
        if not _fits(value, known[key]):
            raise ValueError(f"{field}.{name}.{key}={value!r} is not {KINDS[type(known[key])]}, as its default "
                             f"{known[key]!r} is")
    missing = [key for key, default in known.items() if default is REQUIRED and key not in options]
    if missing:
        raise ValueError(f"evaluator {name} needs {', '.join(f'{field}.{name}.{key}' for key in missing)}")
    return {key: tuple(v) if isinstance(v, list) else v for key, v in options.items()}


KINDS = {bool: "a boolean", int: "an integer", float: "a number", tuple: "a tuple", str: "a string"}


def _fits(value, default) -> bool:
    """Whether `value` has the type of an option's `default` (None, REQUIRED: any type)."""
    if default is None or default is REQUIRED:
        return True
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    if isinstance(default, tuple):
        return isinstance(value, (tuple, list))
    return isinstance(value, type(default))


def evaluate(name: str, runs, out: str, **options) -> str:
    """Run the named evaluator on `runs` and write its report under `out`; the markdown. Of
    several processes, every one computes and process 0 writes (the others return '')."""
    evaluator = get_evaluator(name)
    outcome = evaluator.run(list(runs), **options)
    return evaluator.report(outcome, out) if jax.process_index() == 0 else ""


def configured(config) -> dict[str, dict]:
    """{name: options} of the evaluators a training config names: `evals` (a comma-separated
    string or a sequence of names), their options from `eval_options` ({name: {option: value}}).
    Raises ValueError on an unknown name, before any training is done."""
    names = config.get("evals", "")
    names = [n.strip() for n in names.split(",") if n.strip()] if isinstance(names, str) else list(names)
    options = dict(config.get("eval_options", {}))
    for name in names:
        get_evaluator(name, "evaluator in config.evals")
    for name in options:
        get_evaluator(name, "evaluator in config.eval_options")
    if names and not config.train.eval_every:
        raise ValueError(f"config.evals={','.join(names)} runs every train.eval_every steps; set it > 0")
    return {name: checked_options(name, options.get(name, {}), "config.eval_options") for name in names}


def in_training(evaluators: dict[str, dict], run, out: str, write: bool = True) -> dict:
    """Run `evaluators` ({name: options}) on one run, writing each report under out/<name>/
    where `write` (on process 0 only: every process computes, one writes); the summaries,
    {'<name>/<scalar>': value}, for the training log."""
    record = {}
    for name, options in evaluators.items():
        evaluator = EVALUATORS[name]
        outcome = evaluator.run([run], **options)
        if write:
            evaluator.report(outcome, files.join(out, name))
        record.update({f"{name}/{key}": float(value) for key, value in evaluator.summary(outcome).items()})
    return record
