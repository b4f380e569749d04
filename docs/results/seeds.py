"""Mean +- sample standard deviation over seeds of an eval.py report, the runs grouped by name
without their seed suffix (`<name>_s<seed>` or `<name>/seed<seed>`): perplexity per length, or
for a synthetic task accuracy over all examples and per group (lag). Prints the markdown table
(means, then every seed; an arm of one seed gets its value, no interval), writes the json (per arm: seeds, values [seed, column]) and, with a
third argument, the plot with error bars.

    python docs/results/seeds.py <eval out>/results.json docs/results/X.json [docs/results/X.png]
"""

import json
import re
import sys

import numpy as np


def arms(results: dict) -> tuple[list, dict]:
    """(columns, {arm: {seed: [value per column]}}): lengths and perplexities, or for a task
    'all' and its groups, and accuracies."""
    out, columns = {}, results["lengths"]
    for name, run in results["runs"].items():
        arm, seed = re.fullmatch(r"(.+?)(?:_s|/seed)(\d+)", name).groups()
        if "task_results" in run:
            task = run["task_results"]
            columns = ["all", *task["by_group"]]
            values = [task["accuracy"], *task["by_group"].values()]
        else:
            values = [{x["length"]: x["ppl"] for x in run["results"]}[n] for n in columns]
        out.setdefault(arm.replace("_plus_", "+"), {})[int(seed)] = values
    return columns, out


def spread(values: np.ndarray) -> np.ndarray:
    """The sample standard deviation over seeds (axis 0); zeros for a single seed (no interval)."""
    return values.std(0, ddof=1) if len(values) > 1 else np.zeros(values.shape[1:])


def main(source: str, target: str, plot: str = "") -> None:
    columns, groups = arms(json.load(open(source)))
    out = {"columns": columns, "arms": {}}
    means = ["| run | " + " | ".join(map(str, columns)) + " |", "|---|" + "---|" * len(columns)]
    each = []
    for arm, seeds in groups.items():
        values = np.array([seeds[s] for s in sorted(seeds)])
        out["arms"][arm] = {"seeds": sorted(seeds), "values": values.tolist()}
        means.append(f"| {arm} (seeds {', '.join(map(str, sorted(seeds)))}) | "
                     + " | ".join(f"{m:.4f} +- {s:.4f}" if len(values) > 1 else f"{m:.4f}"
                                  for m, s in zip(values.mean(0), spread(values))) + " |")
        each += [f"| {arm} seed {s} | " + " | ".join(f"{x:.4f}" for x in row) + " |"
                 for s, row in zip(sorted(seeds), values)]
    print("\n".join(means + each))
    with open(target, "w") as f:
        json.dump(out, f, indent=1)
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        task = columns[0] == "all"
        x = [int(c) for c in columns[1:]] if task else columns
        for arm, rec in out["arms"].items():
            values = np.array(rec["values"])[:, 1:] if task else np.array(rec["values"])
            ax.errorbar(x, values.mean(0), yerr=spread(values), marker="o", capsize=3,
                        label=f"{arm} (mean +- std, {len(rec['seeds'])} seeds)" if len(values) > 1 else f"{arm} (1 seed)")
        ax.set(xscale="log", xlabel="lag" if task else "evaluation length (tokens)",
               ylabel="accuracy" if task else "perplexity per byte")
        ax.set_xticks(x, [str(v) for v in x])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
