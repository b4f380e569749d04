"""lab/sweep.py and sweep.py: an experiment's arms x seeds trained as data, skipped when
finished, resumed when not; reports carry each run's arm and seed from its config."""

import json
from pathlib import Path

import pytest

from helpers.tiny_setup import ROOT, cli
from lab.lengths import evaluate_runs
from lab.results import seeds
from lab.sweep import configs, sweep
from lab.training import train

DEFAULT = "configs/default.py"
TINY = {"model.d_model": 32, "model.num_layers": 1, "model.num_heads": 2, "seq_len": 32, "batch_size": 4,
        "train.steps": 2, "train.warmup_steps": 1, "train.checkpoint_every": 1, "train.log_every": 1,
        "eval.multipliers": (1, 2), "eval.tokens": 64, "eval.batch_size": 2}


def seeds_script():
    return seeds


def test_configs_are_the_arms_configs_with_seed_arm_overrides_and_a_workdir_each(tmp_path):
    found = configs(f"{ROOT}/configs/path.py", None, [0, 3], str(tmp_path), {"train.steps": 7, "model.d_model": 16})
    arms = ("rope", "so2_learned_qkv", "path", "path_fox", "fox")  # configs/path.py's VARIANTS
    assert [(c.arm, c.seed) for c in found] == [(arm, seed) for arm in arms for seed in (0, 3)]
    assert {c.model.scheme for c in found} == set(arms)
    assert all(c.train.steps == 7 and c.model.d_model == 16 for c in found)
    assert found[3].workdir == str(tmp_path / "so2_learned_qkv" / "seed3")
    with pytest.raises(ValueError, match="declares no VARIANTS"):
        configs(f"{ROOT}/{DEFAULT}", None, [0], str(tmp_path))


def test_a_sweep_trains_every_arm_and_seed_once_and_resumes_and_reports_group_by_config(tmp_path):
    out, file = str(tmp_path), f"{ROOT}/{DEFAULT}"
    workdirs, stopped = sweep(file, ["rope", "alibi"], [0, 1], out, TINY, log=lambda _: None)
    assert stopped is None and len(workdirs) == 4
    for workdir in workdirs:
        saved = json.loads((Path(workdir) / "config.json").read_text())
        assert f"{saved['arm']}/seed{saved['seed']}" == "/".join(Path(workdir).parts[-2:])

    def refuse(config):
        raise AssertionError(f"{config.workdir} trained again")

    lines = []
    assert sweep(file, ["rope", "alibi"], [0, 1], out, TINY, log=lines.append, train_fn=refuse)[0] == workdirs
    assert all("finished" in line for line in lines)
    trained = []
    sweep(file, ["rope"], [0, 1], out, {**TINY, "train.steps": 3}, log=lambda _: None,
          train_fn=lambda c: trained.append(summary := train(c)) or summary)
    assert [(s["step"], len(s["losses"])) for s in trained] == [(3, 1), (3, 1)]  # resumed at 2: one more step

    report = evaluate_runs(workdirs, log=lambda _: None)
    assert {(r["arm"], r["seed"]) for r in report["runs"].values()} == {(a, s) for a in ("rope", "alibi") for s in (0, 1)}
    _, _, _, arms, _ = seeds_script().arms(report)
    assert {arm: sorted(by_seed) for arm, by_seed in arms.items()} == {"rope": [0, 1], "alibi": [0, 1]}


def test_seeds_reads_arm_and_seed_from_the_report_before_the_run_name():
    runs = {name: {"arm": arm, "seed": seed, "results": [{"length": 64, "ppl": ppl}]}
            for name, arm, seed, ppl in [("x", "rope", 0, 5.0), ("y", "rope", 4, 6.0), ("z_s9", "", 0, 7.0)]}
    _, _, _, arms, _ = seeds_script().arms({"lengths": [64], "runs": runs})
    assert arms == {"rope": {0: [5.0], 4: [6.0]}, "z": {9: [7.0]}}


@pytest.mark.parametrize("args, error", [
    (["--seeds=0,a", "--out=x"], "--seeds=0,a: give non-negative integers"),
    (["--seeds=0"], "--out is required"),
    (["--out=x", "--evals=lengths,nope"], "unknown evaluator in --evals 'nope'"),
    (["--out=x", "--config.train.stepz=3"], "unknown config field 'train.stepz'"),
    (["--out=x", "--config.seed=3"], "--config.seed is set by the sweep for each run"),
])
def test_bad_sweep_flags_are_one_line_before_anything_trains(tmp_path, args, error):
    proc = cli("sweep.py", "--config", DEFAULT, "--arms=rope", *args)
    assert proc.returncode == 1 and error in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
