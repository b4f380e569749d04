"""Does the feature shift explain extrapolation, over seeds? For each trained model and seed:
the KL of attention outputs at 512-1,024 tokens (4-8x the training length) over the
within-length control (mean over layers; analyze.py's feature shift), and the perplexity ratio
at 64x and 8x the training length (eval.py, within documents); then the Spearman correlation
across the ten schemes, per seed, and of the seed means.

    python -m lab.results.position_generalization_seeds <analyze out>/analysis.json \
        <eval out>/results.json[,<eval out>/results.json ...] docs/results/position_generalization_seeds.json

With `decompositions` first: the logit decompositions' mean r per model and seed (3-axis and
fake-distance fits over every map), their Spearman correlation with the 64x ratio taken from the
json the first form wrote, and the perturbations (every cell's clean and perturbed perplexity in
the json; printed: three cells as a relative change per seed, and the page's eight cells as the
change in perplexity, mean +- std over seeds):

    python -m lab.results.position_generalization_seeds decompositions <analyze out>/analysis.json \
        docs/results/position_generalization_seeds.json docs/results/position_generalization_decomposition_seeds.json

Run names are `<prefix><scheme>_s<seed>` (prefix `acc_` or `pg_` or none); `so2_learned_qk`
runs, not in the ten, are left out.
"""

import json
import re

import numpy as np
from absl import app
from scipy.stats import spearmanr

from lab.provenance import stamped

SCHEMES = ("rope", "rope_qkv", "alibi", "nope", "so2_random_qkv", "so2_learned_qkv", "so2_learned_qkv+alibi",
           "path", "fox", "path_fox")


def split(name: str) -> tuple[str, int]:
    scheme, seed = re.fullmatch(r"(?:acc_|pg_)?(.+)_s(\d+)", name).groups()
    return scheme.replace("_plus_", "+"), int(seed)


def main(analysis: str, evals: str, target: str) -> None:
    shift = {}
    for name, run in json.load(open(analysis))["runs"].items():
        fs = run["feature_shift"]
        shift[split(name)] = float(np.mean(np.asarray(fs["kl"])[:, -1]) / np.mean(fs["kl_control"]))
    ratio = {}
    for path in evals.split(","):
        results = json.load(open(path))
        for name, run in results["runs"].items():
            ppl = {x["length"]: x["ppl"] for x in run["results"]}
            train = run.get("train_len", 128)
            ratio[split(name)] = {m: ppl[m * train] / ppl[train] for m in (8, 64)}
    seeds = sorted({s for _, s in shift})
    table = {s: {} for s in SCHEMES}
    for scheme in SCHEMES:
        for seed in seeds:
            if (scheme, seed) in shift and (scheme, seed) in ratio:
                table[scheme][seed] = {"kl_over_control": shift[scheme, seed], **{
                    f"ppl_ratio_{m}x": r for m, r in ratio[scheme, seed].items()}}
    out = {"schemes": table, "spearman": {}}
    print("| scheme | KL 512-1024 / control, seeds " + " / ".join(map(str, seeds)) + " | 64x ratio | 8x ratio |")
    print("|---|---|---|---|")
    for scheme, per in table.items():
        cells = [" / ".join(f"{per[s][k]:.2f}" for s in seeds if s in per) for k in
                 ("kl_over_control", "ppl_ratio_64x", "ppl_ratio_8x")]
        print(f"| {scheme} | " + " | ".join(cells) + " |")
    for m in (64, 8):
        key = f"ppl_ratio_{m}x"
        per_seed = {}
        for seed in seeds:
            have = [s for s in SCHEMES if seed in table[s]]
            rho = spearmanr([table[s][seed]["kl_over_control"] for s in have], [table[s][seed][key] for s in have])
            per_seed[seed] = {"rho": float(rho.statistic), "p": float(rho.pvalue), "models": len(have)}
        full = [s for s in SCHEMES if all(seed in table[s] for seed in seeds)]
        means = spearmanr([np.mean([table[s][x]["kl_over_control"] for x in seeds]) for s in full],
                          [np.mean([table[s][x][key] for x in seeds]) for s in full])
        out["spearman"][f"{m}x"] = {"per_seed": per_seed, "of_seed_means": {
            "rho": float(means.statistic), "p": float(means.pvalue), "models": len(full)}}
        print(f"Spearman with the {m}x ratio: per seed " + ", ".join(
            f"{v['rho']:.2f} ({v['models']} models)" for v in per_seed.values())
              + f"; of the seed means {means.statistic:.2f} ({len(full)} models, p {means.pvalue:.1g})")
    json.dump(stamped(out), open(target, "w"), indent=1)


def decompositions(analysis: str, shift_json: str, target: str) -> None:
    ratios = json.load(open(shift_json))["schemes"]
    rows = {}
    for name, run in json.load(open(analysis))["runs"].items():
        rows.setdefault(split(name)[0], {})[split(name)[1]] = {
            **{key: float(np.mean(np.concatenate([np.ravel(layer[f"{key}_all"]) for layer in run["layers"]])))
               for key in ("three_axis_r", "fake_r")},
            "perturbation": run["perturbation"]}  # clean_ppl, delta_ppl per cell
    perturbed = ("text/0.1/10", "keys/0.1/10", "positions/0.1/10")
    out = {"schemes": {s: rows[s] for s in SCHEMES if s in rows}, "spearman_with_64x": {}}
    print("| run | 3-axis r, seeds 0 / 1 / 2 | mean +- std | fake-distance r, seeds 0 / 1 / 2 | mean +- std |")
    print("|---|---|---|---|---|")
    for scheme, per in out["schemes"].items():
        cells = []
        for key in ("three_axis_r", "fake_r"):
            x = np.array([per[seed][key] for seed in sorted(per)])
            cells += [" / ".join(f"{v:.3f}" for v in x), f"{x.mean():.3f} +- {x.std(ddof=1):.3f}"]
        print(f"| {scheme} | " + " | ".join(cells) + " |")
    print("| run | " + " | ".join(f"{c}, seeds 0 / 1 / 2" for c in perturbed) + " |")
    print("|---|" + "---|" * len(perturbed))
    relative = lambda p, c: p["delta_ppl"][c] / p["clean_ppl"]  # noqa: E731
    mean_std = lambda x: f"{np.mean(x):.2f} +- {np.std(x, ddof=1):.2f}"  # noqa: E731
    for scheme, per in out["schemes"].items():
        print(f"| {scheme} | " + " | ".join(" / ".join(f"{100 * relative(per[seed]['perturbation'], c):+.1f}%"
                                                   for seed in sorted(per)) for c in perturbed) + " |")
    cells = ("text/0.1/10", "text/0.5/100", "keys/0.1/10", "keys/0.1/100", "keys/0.5/100", "positions/0.1/10",
             "positions/0.1/100", "positions/0.5/100")
    print("| run | clean ppl | " + " | ".join(c.replace("/", " ", 1) for c in cells) + " |")
    print("|---|---|" + "---|" * len(cells))
    for scheme, per in out["schemes"].items():
        print(f"| {scheme} | {mean_std([per[seed]['perturbation']['clean_ppl'] for seed in per])} | "
              + " | ".join("+" + mean_std([per[seed]['perturbation']['delta_ppl'][c] for seed in per])
                           for c in cells) + " |")
    for key in ("three_axis_r", "fake_r"):
        per_seed = []
        for seed in sorted({seed for per in rows.values() for seed in per}):
            have = [s for s in out["schemes"] if seed in rows[s] and str(seed) in ratios.get(s, {})]
            per_seed.append(float(spearmanr([rows[s][seed][key] for s in have],
                                            [ratios[s][str(seed)]["ppl_ratio_64x"] for s in have]).statistic))
        out["spearman_with_64x"][key] = per_seed
        print(f"{key}: Spearman with the 64x ratio per seed " + " / ".join(f"{x:.2f}" for x in per_seed))
    json.dump(stamped(out), open(target, "w"), indent=1)


def run(argv):
    if argv[1:2] == ["decompositions"]:
        decompositions(*argv[2:])
    else:
        main(*argv[1:])


if __name__ == "__main__":
    app.run(run)
