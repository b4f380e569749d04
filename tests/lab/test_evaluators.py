"""The named evaluators: analysis's parts alone give analysis's numbers and files, training
runs evaluators on its live model (the numbers eval.py gets from the checkpoint), and a bad
evaluator name in a config fails before training."""

import json

import jax
import pytest

from lab.evaluators import EVALUATORS, evaluate
from lab.training import train
from helpers.tiny_setup import tiny_config

OPTIONS = dict(windows=2, gammas=(0.0, 0.5), l_maxes=(3,), perturb_windows=2, shift_multiplier=2, shift_windows=4)


def test_the_parts_of_analysis_alone(tiny_run, tmp_path):
    config, _ = tiny_run
    analysis = EVALUATORS["analysis"]
    outcome = analysis.run([config.workdir], **OPTIONS, log=lambda *_: None)
    analysis.report(outcome, tmp_path / "analysis")
    whole = json.load(open(tmp_path / "analysis" / "analysis.json"))["runs"]["rope"]
    assert set(analysis.summary(outcome)) == {"three_axis_r", "fake_r", "clean_ppl", "delta_ppl_max",
                                              "kl_farthest", "log_ppl_farthest"}
    common = {"workdir", "step", "scheme", "arm", "seed", "train_len", "seconds"}  # Run.identity()
    files = {"decompositions": ("maps_rope.png", "curves_rope.png"), "perturbations": ("perturbation.png",),
             "feature_shift": ("feature_shift.png", "pca_rope.png")}  # pca: Figure 6, for rope runs
    fields = {"decompositions": {"length", "windows", "layers"}, "perturbations": {"perturbation"},
              "feature_shift": {"feature_shift"}}
    for part, pngs in files.items():
        out = tmp_path / part
        md = evaluate(part, [config.workdir], out, **OPTIONS, log=lambda *_: None)
        results = json.load(open(out / f"{part}.json"))
        run = results["runs"]["rope"]
        assert set(run) == common | fields[part]
        assert {k: run[k] for k in fields[part]} == {k: whole[k] for k in fields[part]}  # the same numbers
        assert ("gammas" in results) == (part == "perturbations")
        assert (out / f"{part}.md").read_text() == md and md in (tmp_path / "analysis" / "analysis.md").read_text()
        assert sorted(p.name for p in out.glob("*.png")) == sorted(pngs)


def test_training_runs_evaluators_on_its_live_model(tmp_path):
    config = tiny_config(tmp_path, steps=4, checkpoint_every=4, eval_every=2)
    config.evals = "transport,lengths"
    config.eval_options.transport = {"length": 64}
    config.eval_options.lengths = {"multipliers": (1, 2)}
    train(config)
    records = {r["step"]: r for r in map(json.loads, open(tmp_path / "metrics.jsonl"))}
    scalars = {step: {key for key in r if "/" in key} for step, r in records.items()}
    assert scalars[1] == scalars[3] == set()
    assert scalars[2] == scalars[4] == {"transport/far_mass_32", "lengths/ppl_longest", "lengths/ratio_longest"}
    assert sorted(p.name for p in (tmp_path / "evals").iterdir()) == ["2", "4"]
    assert (tmp_path / "evals" / "4" / "lengths" / "results.png").exists()
    live = json.load(open(tmp_path / "evals" / "4" / "transport" / "probes.json"))
    # The checkpoint of step 4, loaded the way eval.py loads it, gives the live model's numbers.
    loaded = EVALUATORS["transport"].run([str(tmp_path)], length=64, log=lambda *_: None)
    assert live.pop("environment")["jax"] == jax.__version__  # what computed it (lab/provenance.py)
    assert json.loads(json.dumps(loaded)) == live
    assert records[4]["transport/far_mass_32"] == EVALUATORS["transport"].summary(loaded)["far_mass_32"]


@pytest.mark.parametrize("field,value,message", [
    ("evals", "lengths,nope", "unknown evaluator in config.evals 'nope'; valid: lengths, transport, near_far,"),
    ("eval_options", {"lenghts": {}}, "unknown evaluator in config.eval_options 'lenghts'"),
    ("evals", ("lengths",), "config.evals=lengths runs every train.eval_every steps; set it > 0"),
])
def test_a_bad_evaluator_config_fails_before_training(tmp_path, field, value, message):
    config = tiny_config(tmp_path / "run", eval_every=0 if field == "evals" and value == ("lengths",) else 4)
    if isinstance(value, tuple):
        del config[field]  # a config built without the string default may name them in a tuple
    config[field] = value
    with pytest.raises(ValueError, match=message):
        train(config)
    assert not (tmp_path / "run").exists()


def test_an_analysis_with_every_run_skipped_reports_nothing(tmp_path):
    """A run without attention (a Sessa mixer) is skipped; training with evals=analysis goes on."""
    outcome = ({"runs": {}}, {})
    assert EVALUATORS["analysis"].report(outcome, tmp_path) == "\n" and EVALUATORS["analysis"].summary(outcome) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis.json", "analysis.md"]
