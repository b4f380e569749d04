"""Mean +- sample standard deviation over seeds, the runs grouped by name without their seed
suffix (`<name>_s<seed>` or `<name>/seed<seed>`; a name without one is seed 0, the configs'
default seed), or by the arm and seed a run's config names (`arm`, `seed`: lab/sweep.py sets them,
eval.py's report carries them). A source is an eval.py report (results.json: perplexity per length, or for a
synthetic task accuracy over all examples and per group, lag), a retrieval report as
retrieval_merge.py writes it (exact match per length, mean over depths; one arm per run and
task), a run's metrics.jsonl (a learning curve: its in-training `lengths` evaluations by step,
the run named by its last two directories, `<name>/seed<seed>`), or this script's own json (to
add seeds to a committed table). Several sources merge; they must have the same columns,
measure and axis, and no arm's seed may come twice. Prints the
markdown table (means, then every seed; an arm of one seed gets its value, no interval; '-'
where a task does not fit the length), writes the json (per arm: seeds, values [seed, column],
null for '-'; and where every seed's report scored documents one by one, eval.py's
`documents` option, per_document [seed, column, document] = [summed NLL, targets], which
lab/results/claims.py reads for its intervals over documents) and, with a .png last, the plot
with error bars (`draw`).

    python -m lab.results.seeds SOURCE.json [SOURCE.json ...] docs/results/X.json [docs/results/X.png]
    python -m lab.results.seeds runs/*/seed*/metrics.jsonl docs/results/X_curves.json X_curves.png
"""

import json
import os
import re

import numpy as np
from absl import app

from lab.retrieval import by_length
from lab.provenance import stamped


LENGTH, LAG, STEP = "evaluation length (tokens)", "lag", "training step"  # what the columns are


def arm_and_seed(name: str) -> tuple[str, int]:
    arm, seed = re.fullmatch(r"(.+?)(?:(?:_s|/seed)(\d+))?", name).groups()
    return arm.replace("_plus_", "+"), int(seed or 0)


def arms(results: dict) -> tuple[list, str, str, dict, dict]:
    """(columns, measure, axis, {arm: {seed: [value per column, None where none]}}, {arm: {seed:
    [per column: [[summed NLL, targets] per document]]}} where the source has them) of one source."""
    if "arms" in results:
        task = results["columns"][0] == "all"
        measure = results.get("measure", "accuracy" if task else "perplexity per byte")
        return results["columns"], measure, results.get("axis", LAG if task else LENGTH), {
            arm: dict(zip(rec["seeds"], rec["values"])) for arm, rec in results["arms"].items()}, {
            arm: dict(zip(rec["seeds"], rec["per_document"])) for arm, rec in results["arms"].items()
            if "per_document" in rec}
    out, documents, columns, measure = {}, {}, results["lengths"], "perplexity per byte"
    for name, run in results["runs"].items():
        arm, seed = (run["arm"], run["seed"]) if run.get("arm") else arm_and_seed(name)
        if "tasks" in run:  # a retrieval report
            measure = "exact match"
            for task, scores in run["tasks"].items():
                out.setdefault(f"{arm} {task}", {})[seed] = [by_length(scores, n, "accuracy") for n in columns]
            continue
        if "task_results" in run:
            task, measure = run["task_results"], "accuracy"
            columns = ["all", *task["by_group"]]
            values = [task["accuracy"], *task["by_group"].values()]
        else:
            at = {x["length"]: x for x in run["results"]}
            values = [at[n]["ppl"] for n in columns]
            if all("per_document" in at[n] for n in columns):
                documents.setdefault(arm, {})[seed] = [at[n]["per_document"] for n in columns]
        out.setdefault(arm, {})[seed] = values
    return columns, measure, LAG if measure == "accuracy" else LENGTH, out, documents


def curve(path: str) -> tuple[list, str, str, dict]:
    """`arms` of one run's in-training `lengths` evaluations (its metrics.jsonl): task accuracy, or
    perplexity at the longest length, by step; the arm and seed from the run's config.json beside
    it (where it names an arm: lab/sweep.py), else from the run's directory."""
    records = [json.loads(line) for line in open(path)]
    key = "lengths/accuracy" if any("lengths/accuracy" in r for r in records) else "lengths/ppl_longest"
    by_step = {r["step"]: r[key] for r in records if key in r}
    if not by_step:
        raise SystemExit(f"{path}: no in-training lengths evaluation; train with --config.evals=lengths "
                         "and train.eval_every")
    config = os.path.join(os.path.dirname(path), "config.json")
    saved = json.load(open(config)) if os.path.exists(config) else {}
    arm, seed = ((saved["arm"], saved["seed"]) if saved.get("arm") else
                 arm_and_seed("/".join(os.path.normpath(path).split(os.sep)[-3:-1])))
    measure = "accuracy" if key == "lengths/accuracy" else "perplexity per byte at the longest length"
    return list(by_step), measure, STEP, {arm: {seed: list(by_step.values())}}, {}


def merged(sources: list[str]) -> tuple[list, str, str, dict, dict]:
    """`arms` (or `curve`) of every source together; SystemExit, one line, where they do not fit."""
    first, groups, documents = None, {}, {}
    for source in sources:
        *kind, found, scored = curve(source) if source.endswith(".jsonl") else arms(json.load(open(source)))
        if first is not None and kind != first:
            raise SystemExit(f"{source}: its columns {kind[0]} ({kind[1]} by {kind[2]}) differ from "
                             f"{sources[0]}'s {first[0]} ({first[1]} by {first[2]}); merge only like with like")
        first = kind
        for arm, seeds in found.items():
            if twice := set(seeds) & set(groups.get(arm, {})):
                raise SystemExit(f"{source}: arm {arm} seed {min(twice)} is also in an earlier source; "
                                 "give each seed of an arm once")
            groups.setdefault(arm, {}).update(seeds)
        for arm, seeds in scored.items():
            documents.setdefault(arm, {}).update(seeds)
    return *first, groups, documents


def spread(values: np.ndarray) -> np.ndarray:
    """The sample standard deviation over seeds (axis 0); zeros for a single seed (no interval)."""
    return values.std(0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1:])


def cell(mean: float, std: float, seeds: int) -> str:
    return "-" if np.isnan(mean) else f"{mean:.4f} +- {std:.4f}" if seeds > 1 else f"{mean:.4f}"


def main(*args: str) -> None:
    if len(args) < 2:
        raise SystemExit("give the sources, then the json to write (and a .png to plot): "
                         "python -m lab.results.seeds SOURCE.json [...] X.json [X.png]")
    plot = args[-1] if args[-1].endswith(".png") else ""
    *sources, target = args[:-1] if plot else args
    columns, measure, axis, groups, documents = merged(sources)
    out = {"columns": columns, "measure": measure, "axis": axis, "arms": {}}
    means = ["| run | " + " | ".join(map(str, columns)) + " |", "|---|" + "---|" * len(columns)]
    each = []
    for arm, seeds in groups.items():
        values = np.array([seeds[s] for s in sorted(seeds)], float)  # None -> nan
        out["arms"][arm] = {"seeds": sorted(seeds), "values": [[None if np.isnan(v) else v for v in row]
                                                              for row in values.tolist()]}
        if set(documents.get(arm, {})) == set(seeds):  # every seed scored document by document
            out["arms"][arm]["per_document"] = [documents[arm][s] for s in sorted(seeds)]
        means.append(f"| {arm} (seeds {', '.join(map(str, sorted(seeds)))}) | "
                     + " | ".join(cell(m, s, len(values)) for m, s in zip(values.mean(0), spread(values))) + " |")
        each += [f"| {arm} seed {s} | " + " | ".join(cell(x, 0, 1) for x in row) + " |"
                 for s, row in zip(sorted(seeds), values)]
    print("\n".join(means + each))
    with open(target, "w") as f:
        json.dump(stamped(out), f, indent=1)
    if plot:
        draw(out, plot)


def draw(out: dict, path: str):
    """The plot of `main`'s json: mean +- std per arm along its columns (lengths, lags or training
    steps), or, where a table has one column, the arms side by side with every seed a dot.
    Returns the axes."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    columns, task = out["columns"], out["columns"][0] == "all"
    axis = out.get("axis", LAG if task else LENGTH)  # jsons written before the axis was named
    x = [int(c) for c in columns[1:]] if task else columns
    single = len(x) < 2  # a task without groups (its one group is the whole), or one length
    names = list(out["arms"])
    for i, (arm, rec) in enumerate(out["arms"].items()):
        values = np.array(rec["values"], float)
        values = values[:, :1] if single else values[:, 1 if task else 0:]
        label = f"{arm} (mean +- std, {len(values)} seeds)" if len(values) > 1 else f"{arm} (1 seed)"
        line = ax.errorbar([i] if single else x, values.mean(0), yerr=spread(values), marker="o", capsize=3,
                           label=label)
        if single:  # every seed beside its mean
            ax.plot(np.full(len(values), i + 0.15), values[:, 0], "o", alpha=0.5, color=line[0].get_color())
    if single:
        ax.set_xticks(range(len(names)), names)
        ax.set(xlim=(-0.5, len(names) - 0.5), ylabel=f"{out['measure']} (dots: the seeds)",
               xlabel="" if task else f"{axis}: {x[0]}")
    else:
        ax.set(xscale="linear" if axis == STEP else "log", xlabel=axis, ylabel=out["measure"])
        ax.set_xticks(x, [f"{v // 1024}K" if v >= 1024 and v % 1024 == 0 else str(v) for v in x])  # 768 | 1K
        ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: it covered curves
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return ax


if __name__ == "__main__":
    app.run(lambda argv: main(*argv[1:]))
