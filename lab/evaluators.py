"""The named evaluators, the one place eval.py, analyze.py, demo.py and a notebook look them up.

An evaluator has `run(workdirs, **options) -> outcome` (the runs are training directories; the
options are the evaluator's own keyword arguments) and `report(outcome, out) -> markdown`,
which writes its JSON, markdown and plots under `out`:

  lengths    perplexity of held-out text by evaluation length; task accuracy for runs trained
             on a synthetic task (lab/lengths.py): results.json / .md / .png
  transport  the transport probes: attention mass by distance, far mass, and for schemes with
             steps the spectral gap, route decay and value cancellation (lab/probes.py)
  near_far   near-minus-far logit differences, the TAPA paper's Figure 1 (lab/probes.py)
  analysis   logit decompositions, perturbations and the feature shift of the
             position-generalization paper (lab/analysis.py)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from lab import analysis, lengths, probes


@dataclasses.dataclass(frozen=True)
class Evaluator:
    run: Callable[..., Any]
    report: Callable[[Any, str], str]
    doc: str


EVALUATORS = {
    "lengths": Evaluator(lengths.evaluate_runs, lengths.write_report, "perplexity by length, task accuracy"),
    "transport": Evaluator(probes.probe_runs, probes.probe_report, "transport probes"),
    "near_far": Evaluator(probes.near_far_runs, probes.near_far_report, "near-minus-far logit differences"),
    "analysis": Evaluator(analysis.analyze_runs, analysis.report,
                          "logit decompositions, perturbations, feature shift"),
}


def get_evaluator(name: str) -> Evaluator:
    if name not in EVALUATORS:
        raise ValueError(f"unknown evaluator {name!r}; valid: {', '.join(EVALUATORS)}")
    return EVALUATORS[name]


def evaluate(name: str, workdirs, out: str, **options) -> str:
    """Run the named evaluator on `workdirs` and write its report under `out`; the markdown."""
    evaluator = get_evaluator(name)
    return evaluator.report(evaluator.run(list(workdirs), **options), out)
