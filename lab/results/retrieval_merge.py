"""One retrieval report from runs evaluated one at a time: the `runs` of each eval.py output's
retrieval.json (per-example records left out), its perplexity (results.json, where the eval
had `lengths`), and the in-training retrieval summaries of each run's metrics.jsonl (step,
exact match, answer log-probability). Writes the json and the two plots, prints the tables.

    python -m lab.results.retrieval_merge docs/results/X runs/a_eval runs/b_eval ...
    # -> X.json, X.png (exact match against length), X_heatmaps.png (length x depth)
"""

import json
import os

from absl import app

from lab import retrieval
from lab.provenance import stamped


def merge(evals: list[str]) -> dict:
    merged, lengths = None, {}
    for out in evals:
        report = json.load(open(os.path.join(out, "retrieval.json")))
        merged = merged or {k: v for k, v in report.items() if k not in ("runs", "skipped")} | {"runs": {}, "skipped": {}}
        if any(report[k] != merged[k] for k in ("tasks", "lengths", "depths", "examples", "seed")):
            raise SystemExit(f"{out}: its retrieval settings differ from {evals[0]}'s; merge only like with like")
        for name, run in report["runs"].items():
            for task in run["tasks"].values():
                task.pop("records", None)
            curve = os.path.join(run["workdir"], "metrics.jsonl")
            run["in_training"] = [
                {"step": r["step"], "accuracy": r["retrieval/accuracy"], "logprob": r["retrieval/logprob"]}
                for r in map(json.loads, open(curve)) if "retrieval/accuracy" in r] if os.path.exists(curve) else []
            merged["runs"][name] = run
        merged["skipped"].update(report.get("skipped", {}))
        if os.path.exists(os.path.join(out, "results.json")):
            for name, run in json.load(open(os.path.join(out, "results.json")))["runs"].items():
                lengths[name] = {str(r["length"]): r["ppl"] for r in run["results"]}
    merged["perplexity"] = lengths
    return merged


def main(target: str, *evals: str) -> None:
    merged = merge(list(evals))
    open(f"{target}.json", "w").write(json.dumps(stamped(merged), indent=1))
    retrieval.plot_lengths(merged, f"{target}.png")
    retrieval.plot_heatmaps(merged, f"{target}_heatmaps.png")
    print(retrieval.markdown(merged))
    if merged["perplexity"]:
        columns = sorted({int(n) for p in merged["perplexity"].values() for n in p})
        print("| run | " + " | ".join(map(str, columns)) + " |\n|---|" + "---|" * len(columns))
        for name, p in merged["perplexity"].items():
            print(f"| {name} | " + " | ".join(f"{p[str(n)]:.3f}" if str(n) in p else "-" for n in columns) + " |")
    print("\nin training (exact match / answer log-probability at the step):")
    for name, run in merged["runs"].items():
        print(f"{name}: " + ", ".join(f"{r['step']}: {r['accuracy']:.2f} / {r['logprob']:.2f}" for r in run["in_training"]))


if __name__ == "__main__":
    app.run(lambda argv: main(*argv[1:]))
