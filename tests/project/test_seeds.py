"""lab/results/seeds.py: the mean +- std tables of the results pages, from an eval report."""

import json
import re
from pathlib import Path

import pytest

from lab.results import PAGES, seeds


def load():
    return seeds


def report(runs: dict) -> dict:
    """An eval.py lengths report with these {name: [ppl at 64, ppl at 128]}."""
    return {"lengths": [64, 128], "runs": {name: {"results": [{"length": n, "ppl": p} for n, p in zip((64, 128), ppl)]}
                                           for name, ppl in runs.items()}}


def test_seeds_groups_runs_by_arm_and_gives_mean_and_sample_std(tmp_path, capsys):
    source = tmp_path / "results.json"
    source.write_text(json.dumps(report({"rope_s0": [5.0, 6.0], "rope_s2": [7.0, 9.0], "path_plus_fox_s1": [4.0, 4.5],
                                         "alibi/seed0": [6.0, 6.5], "alibi/seed1": [6.0, 7.5]})))
    load().main(str(source), str(tmp_path / "out.json"), str(tmp_path / "out.png"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["columns"] == [64, 128]
    assert out["arms"]["rope"] == {"seeds": [0, 2], "values": [[5.0, 6.0], [7.0, 9.0]]}
    assert out["arms"]["path+fox"]["seeds"] == [1] and out["arms"]["alibi"]["seeds"] == [0, 1]
    table = capsys.readouterr().out
    # rope: mean 6, sample std sqrt(2) = 1.4142 at 64; mean 7.5, std 2.1213 at 128
    assert "| rope (seeds 0, 2) | 6.0000 +- 1.4142 | 7.5000 +- 2.1213 |" in table, table
    assert "| path+fox (seeds 1) | 4.0000 | 4.5000 |" in table and "nan" not in table, table
    assert "| alibi seed 1 | 6.0000 | 7.5000 |" in table
    assert (tmp_path / "out.png").stat().st_size > 0


def test_seeds_keeps_each_seeds_documents_where_every_seed_has_them(tmp_path):
    """Reports scored document by document (eval.py's documents option) leave each seed's
    [summed NLL, targets] per document in the json, per column, and keep them when the json is
    a source again; an arm with a seed lacking them gets none."""
    rows = lambda x: [[x, 10], [2 * x, 20]]  # noqa: E731
    source = report({"rope_s0": [5.0, 6.0], "rope_s1": [7.0, 9.0], "alibi_s0": [6.0, 6.5], "alibi_s1": [6.0, 7.5]})
    for name, run in source["runs"].items():
        for r in run["results"]:
            if name != "alibi_s1":
                r["per_document"] = rows(r["ppl"])
    (tmp_path / "results.json").write_text(json.dumps(source))
    load().main(str(tmp_path / "results.json"), str(tmp_path / "out.json"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["arms"]["rope"]["per_document"] == [[rows(5.0), rows(6.0)], [rows(7.0), rows(9.0)]]
    assert "per_document" not in out["arms"]["alibi"]
    load().main(str(tmp_path / "out.json"), str(tmp_path / "again.json"))
    assert json.loads((tmp_path / "again.json").read_text()) == out


def retrieval_report(runs: dict) -> dict:
    """A retrieval_merge.py report: {name: {task: {length: [accuracy at depth 0, at depth 1]}}}."""
    return {"lengths": [128, 256], "runs": {name: {"tasks": {task: {
        "cells": [{"length": n, "depth": d, "examples": 4, "accuracy": a} for n, accs in by_len.items()
                  for d, a in zip((0.0, 1.0), accs)],
        "skipped": {str(n): "too short" for n in (128, 256) if n not in by_len}}
        for task, by_len in tasks.items()}} for name, tasks in runs.items()}}


def test_seeds_adds_seeds_to_its_own_json_and_reads_retrieval_reports(tmp_path, capsys):
    seeds = load()
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    first.write_text(json.dumps(retrieval_report({"pk_rope": {"passkey": {128: [1.0, 0.5], 256: [1.0, 1.0]},
                                                               "single": {256: [0.0, 0.5]}}})))
    second.write_text(json.dumps(retrieval_report({"pk_rope_s1": {"passkey": {128: [0.5, 0.5], 256: [0.0, 1.0]},
                                                                  "single": {256: [0.5, 0.5]}}})))
    seeds.main(str(first), str(tmp_path / "seed0.json"))  # a name without a suffix is seed 0
    seeds.main(str(tmp_path / "seed0.json"), str(second), str(tmp_path / "both.json"), str(tmp_path / "both.png"))
    out = json.loads((tmp_path / "both.json").read_text())
    assert out["measure"] == "exact match" and out["columns"] == [128, 256]
    # exact match per length is the mean over depths; a length too short for the task is null
    assert out["arms"]["pk_rope passkey"] == {"seeds": [0, 1], "values": [[0.75, 1.0], [0.5, 0.5]]}
    assert out["arms"]["pk_rope single"] == {"seeds": [0, 1], "values": [[None, 0.25], [None, 0.5]]}
    table = capsys.readouterr().out
    # passkey at 128: mean 0.625, sample std 0.25 / sqrt(2) = 0.1768
    assert "| pk_rope passkey (seeds 0, 1) | 0.6250 +- 0.1768 | 0.7500 +- 0.3536 |" in table, table
    assert "| pk_rope single (seeds 0, 1) | - | 0.3750 +- 0.1768 |" in table, table


def test_seeds_refuses_a_seed_twice_and_sources_that_do_not_fit(tmp_path):
    seeds = load()
    text, task = tmp_path / "text.json", tmp_path / "task.json"
    text.write_text(json.dumps(report({"rope_s0": [5.0, 6.0]})))
    task.write_text(json.dumps(retrieval_report({"rope": {"passkey": {128: [1.0, 1.0], 256: [1.0, 1.0]}}})))
    with pytest.raises(SystemExit, match="arm rope seed 0 is also in an earlier source"):
        seeds.main(str(text), str(text), str(tmp_path / "out.json"))
    with pytest.raises(SystemExit, match="differ from .*merge only like with like"):
        seeds.main(str(text), str(task), str(tmp_path / "out.json"))


def test_seeds_plots_a_one_column_table_as_arms_side_by_side(tmp_path):
    """A task with one group (SymbolSoup: accuracy over all examples) has no axis of lags: the arms
    stand side by side, the mean with its error bar and every seed a dot beside it."""
    seeds = load()
    source = tmp_path / "results.json"
    accuracy = {"sessa/seed0": 0.05, "sessa/seed1": 0.15, "transformer/seed0": 0.3}
    source.write_text(json.dumps({"lengths": [], "runs": {name: {"task_results": {"accuracy": a, "by_group": {"0": a}}}
                                                          for name, a in accuracy.items()}}))
    seeds.main(str(source), str(tmp_path / "out.json"))
    ax = seeds.draw(json.loads((tmp_path / "out.json").read_text()), str(tmp_path / "out.png"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["sessa", "transformer"]
    means = [line.get_ydata() for line in ax.lines if line.get_marker() == "o" and line.get_alpha() is None]
    dots = [line.get_ydata() for line in ax.lines if line.get_alpha() == 0.5]
    assert [list(m) for m in means] == [[pytest.approx(0.1)], [pytest.approx(0.3)]]
    assert [list(d) for d in dots] == [[0.05, 0.15], [0.3]]
    assert (tmp_path / "out.png").stat().st_size > 0


def test_seeds_names_lengths_of_whole_kibitokens_short_so_close_ticks_stay_apart(tmp_path):
    """768 and 1,024 lie 0.4 octaves apart on the log axis: "1024" ran into "768"."""
    out = {"columns": [512, 768, 1024, 2048], "measure": "perplexity", "axis": "evaluation length (tokens)",
           "arms": {"rope": {"seeds": [0], "values": [[5.0, 5.1, 5.2, 5.4]]}}}
    ax = load().draw(out, str(tmp_path / "out.png"))
    assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "768", "1K", "2K"]


def test_seeds_reads_learning_curves_from_metrics(tmp_path, capsys):
    """A run's metrics.jsonl gives its in-training task accuracy by step, the arm and seed from its
    directory; a run without in-training evaluations is one clear line."""
    seeds = load()
    curves = {"sessa/seed0": [0.05, 0.25], "sessa/seed1": [0.15, 0.35], "transformer/seed0": [0.1, 0.2]}
    for name, accuracy in curves.items():
        (tmp_path / name).mkdir(parents=True)
        lines = [{"step": 50, "loss": 3.0}, {"step": 100, "loss": 2.9, "lengths/accuracy": accuracy[0]},
                 {"step": 150, "loss": 2.8}, {"step": 200, "loss": 2.7, "lengths/accuracy": accuracy[1]}]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    sources = [str(tmp_path / name / "metrics.jsonl") for name in curves]
    seeds.main(*sources, str(tmp_path / "out.json"), str(tmp_path / "out.png"))
    out = json.loads((tmp_path / "out.json").read_text())
    assert (out["columns"], out["measure"], out["axis"]) == ([100, 200], "accuracy", "training step")
    assert out["arms"]["sessa"] == {"seeds": [0, 1], "values": [[0.05, 0.25], [0.15, 0.35]]}
    # sessa at step 100: mean 0.1, sample std 0.1 / sqrt(2) = 0.0707
    assert "| sessa (seeds 0, 1) | 0.1000 +- 0.0707 | 0.3000 +- 0.0707 |" in capsys.readouterr().out
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "metrics.jsonl").write_text(json.dumps({"step": 50, "loss": 3.0}) + "\n")
    with pytest.raises(SystemExit, match="no in-training lengths evaluation; train with --config.evals=lengths"):
        seeds.main(str(tmp_path / "plain" / "metrics.jsonl"), str(tmp_path / "x.json"))


def test_a_learning_curve_takes_arm_and_seed_from_the_runs_config(tmp_path):
    """Where the run's config.json beside its metrics names an arm (lab/sweep.py), the arm and
    seed are read from there, not from the folder names."""
    run = tmp_path / "sweep" / "whatever"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 10, "lengths/ppl_longest": 7.5}) + "\n")
    (run / "config.json").write_text(json.dumps({"arm": "rope/fast", "seed": 3}))
    assert load().curve(str(run / "metrics.jsonl"))[3] == {"rope/fast": {3: [7.5]}}


# A row of seeds.py's table of means, in its own format (4 decimals; pages' hand-made tables use others).
SEEDS_ROW = re.compile(r"\| .+ \(seeds [\d, ]+\) \|( (\d+\.\d{4} \+- \d+\.\d{4}|\d+\.\d{4}|-) \|)+")


def test_the_pages_tables_of_means_regenerate_from_their_json(capsys):
    """Every row of seeds.py's table of means on a results page ('| arm (seeds 0, 1, ...) | ...',
    its arm perhaps renamed for the page) is what seeds.py prints today from a json that page
    names: the committed numbers come back from the committed json, digit for digit."""
    seeds, results = load(), Path(PAGES)

    def numbers(row: str) -> str:  # the seeds and the cells, without the arm's name
        return row[row.index(" (seeds "):]

    checked = 0
    for page in sorted(results.glob("*.md")):
        text = page.read_text()
        rows = [line for line in text.splitlines() if SEEDS_ROW.fullmatch(line)]
        rendered = set()
        for source in sorted(results.glob("*.json")) if rows else ():
            if source.name in text and "arms" in json.loads(source.read_text()):
                capsys.readouterr()
                seeds.main(str(source), "/dev/null")
                rendered |= {numbers(line) for line in capsys.readouterr().out.splitlines() if SEEDS_ROW.fullmatch(line)}
        assert [row for row in rows if numbers(row) not in rendered] == [], page.name
        checked += len(rows)
    assert checked >= 10
