"""docs/results/seeds.py: the mean +- std tables of the results pages, from an eval report."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "docs" / "results" / "seeds.py"


def load():
    spec = importlib.util.spec_from_file_location("seeds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
