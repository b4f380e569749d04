"""Intervals over evaluation documents: from an eval.py report made with `--documents=N` (each
length's `per_document` [summed NLL, targets]), each run's perplexity at every length with a 95%
percentile bootstrap over the documents, and each run against a base run: its perplexity and its
degradation (perplexity at a length over the training length's) relative to the base's, paired
by document (`lab.stats.bootstrap`: the same documents resampled for both runs and both lengths).
One seed: the intervals cover which text was scored, not training noise (lab/results/claims.py
covers seeds).

    python -m lab.results.documents runs/demo/compare/results.json --base rope [--json X.json]
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
from absl import app, flags

from lab.stats import bootstrap, log_ppl
from lab.provenance import stamped

FLAGS = flags.FLAGS


def per_document(report: dict) -> dict:
    """{run: {length: [D, 2] array}}, with a one-line error for a report made without --documents."""
    out = {}
    for name, run in report["runs"].items():
        rows = run.get("results") or []
        if not rows or any("per_document" not in r for r in rows):
            raise ValueError(f"run {name} has no per_document rows: evaluate with eval.py --documents=N "
                             "(within documents)")
        out[name] = {r["length"]: np.asarray(r["per_document"], float) for r in rows}
    return out


def shown(r: dict, percent: bool) -> str:
    f = (lambda x: f"{100 * (math.exp(x) - 1):+.1f}%") if percent else (lambda x: f"{math.exp(x):.3f}")
    return f"{f(r['mean'])} ({f(r['low'])} to {f(r['high'])})"


def intervals(report: dict, base: str, resamples: int) -> list[dict]:
    docs = per_document(report)
    base = base or next(iter(docs))
    if base not in docs:
        raise ValueError(f"--base {base!r} is not a run of this report; its runs: {', '.join(docs)}")
    train = {name: report["runs"][name]["train_len"] for name in docs}
    rows = []
    for name, by_length in docs.items():
        for length, d in by_length.items():
            row = {"run": name, "length": length, "ppl": bootstrap(log_ppl, d, resamples=resamples)}
            if name != base:
                b, t, bt = docs[base][length], by_length[train[name]], docs[base][train[base]]
                row["ppl_vs_base"] = bootstrap(lambda a, b: log_ppl(a) - log_ppl(b), d, b, resamples=resamples)
                row["ratio_vs_base"] = bootstrap(
                    lambda a, t, b, bt: (log_ppl(a) - log_ppl(t)) - (log_ppl(b) - log_ppl(bt)), d, t, b, bt,
                    resamples=resamples)
            rows.append(row)
    return rows


def table(rows: list[dict], base: str, documents: int) -> str:
    lines = [f"Perplexity with a 95% bootstrap interval over the {documents} documents; against {base}: perplexity "
             f"and degradation from the training length (ratio), A / {base} - 1, paired by document.", "",
             f"| run | length | perplexity | vs {base}: perplexity | vs {base}: ratio |", "|---|---|---|---|---|"]
    for r in rows:
        vs = [shown(r[k], True) if k in r else "-" for k in ("ppl_vs_base", "ratio_vs_base")]
        lines.append(f"| {r['run']} | {r['length']:,} | {shown(r['ppl'], False)} | {vs[0]} | {vs[1]} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) != 2:
        sys.exit("usage: python -m lab.results.documents REPORT.json [--base RUN] [--json OUT.json]")
    with open(argv[1]) as f:
        report = json.load(f)
    try:
        rows = intervals(report, FLAGS.base, FLAGS.resamples)
    except ValueError as e:
        sys.exit(f"error: {e}")
    print(table(rows, FLAGS.base or next(iter(report["runs"])), report.get("documents", 0)))
    if FLAGS.json:
        with open(FLAGS.json, "w") as f:
            json.dump(stamped({"documents": report.get("documents"), "rows": rows}), f, indent=1)


if __name__ == "__main__":  # its flags only for the command: importing the module defines none
    flags.DEFINE_string("base", "", "the run the others are compared with (default: the first)")
    flags.DEFINE_integer("resamples", 10_000, "bootstrap resamples")
    flags.DEFINE_string("json", "", "also write the rows here")
    app.run(main)
