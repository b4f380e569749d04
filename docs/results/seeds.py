"""Mean +- sample standard deviation over seeds of an eval.py perplexity report, the runs grouped
by name without their seed suffix (`<name>_s<seed>`): prints the markdown table (means, then
every seed), writes the json (per arm: seeds, perplexity [seed, length]) and, with a third
argument, the plot with error bars.

    python docs/results/seeds.py <eval out>/results.json docs/results/X.json [docs/results/X.png]
"""

import json
import re
import sys

import numpy as np


def arms(results: dict) -> dict:
    """{arm: {seed: {length: perplexity}}}."""
    out = {}
    for name, run in results["runs"].items():
        arm, seed = re.fullmatch(r"(.+)_s(\d+)", name).groups()
        out.setdefault(arm.replace("_plus_", "+"), {})[int(seed)] = {x["length"]: x["ppl"] for x in run["results"]}
    return out


def main(source: str, target: str, plot: str = "") -> None:
    results = json.load(open(source))
    lengths, out = results["lengths"], {"lengths": results["lengths"], "arms": {}}
    means = ["| run | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---|" * len(lengths)]
    each = []
    for arm, seeds in arms(results).items():
        ppl = np.array([[seeds[s][n] for n in lengths] for s in sorted(seeds)])
        out["arms"][arm] = {"seeds": sorted(seeds), "ppl": ppl.tolist()}
        means.append(f"| {arm} (seeds {', '.join(map(str, sorted(seeds)))}) | "
                     + " | ".join(f"{m:.3f} +- {s:.3f}" for m, s in zip(ppl.mean(0), ppl.std(0, ddof=1))) + " |")
        each += [f"| {arm} seed {s} | " + " | ".join(f"{x:.3f}" for x in row) + " |" for s, row in zip(sorted(seeds), ppl)]
    print("\n".join(means + each))
    with open(target, "w") as f:
        json.dump(out, f, indent=1)
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        for arm, rec in out["arms"].items():
            ppl = np.array(rec["ppl"])
            ax.errorbar(lengths, ppl.mean(0), yerr=ppl.std(0, ddof=1), marker="o", capsize=3,
                        label=f"{arm} (mean +- std, {len(rec['seeds'])} seeds)")
        ax.set(xscale="log", xlabel="evaluation length (tokens)", ylabel="perplexity per byte")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
