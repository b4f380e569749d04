"""One option grammar: evaluator and scheme options spelled as training config fields
(--config.eval_options.<evaluator>.<option>, --config.model.scheme_options.<option>) in
train.py, eval.py and analyze.py, checked by name and type against the evaluator."""

import json

import pytest

from configs import default
from helpers.tiny_setup import cli, overrides, tiny_config
from lab.evaluators import EVALUATORS, checked_options, options_of


def test_a_training_config_has_one_options_group_per_evaluator():
    assert default.EVALUATORS == tuple(EVALUATORS)
    assert set(default.get_config().eval_options) == set(EVALUATORS)


def test_options_are_an_evaluators_keyword_arguments_checked_by_name_and_type():
    assert set(options_of("transport")) == {"length", "windows"}
    assert checked_options("retrieval", {"depths": [0.5], "examples": 2}) == {"depths": (0.5,), "examples": 2}
    assert checked_options("lengths", {"max_multiplier": 16}) == {"max_multiplier": 16}  # None default: any
    for name, options, error in [
        ("transport", {"lenght": 64}, "eval_options.transport.lenght is not an option of evaluator transport; "
                                      "valid: length, windows"),
        ("transport", {}, "evaluator transport needs eval_options.transport.length"),
        ("retrieval", {"examples": 2.5}, "eval_options.retrieval.examples=2.5 is not an integer, as its default 4 is"),
        ("analysis", {"untrained": 1}, "eval_options.analysis.untrained=1 is not a boolean, as its default False is"),
        ("near_far", {"length": 8, "near": (0, 2), "far": (4, 8), "pairs": "many"},
         "eval_options.near_far.pairs='many' is not an integer"),
    ]:
        with pytest.raises(ValueError) as raised:
            checked_options(name, options)
        assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


@pytest.mark.slow  # 24 s
def test_eval_py_takes_the_training_spelling_and_gives_what_the_shorthands_give(tiny_run, tmp_path):
    workdir = tiny_run[0].workdir
    short = cli("eval.py", f"--workdirs={workdir}", f"--out={tmp_path / 'short'}", "--probe_length=64",
                "--near_far=0:4,48:64", "--evals=near_far,transport")
    long = cli("eval.py", f"--workdirs={workdir}", f"--out={tmp_path / 'long'}", "--config.evals=near_far,transport",
               "--config.eval_options.transport.length=64", "--config.eval_options.near_far.length=64",
               "--config.eval_options.near_far.near=(0, 4)", "--config.eval_options.near_far.far=48:64")
    assert short.returncode == 0 and long.returncode == 0, long.stderr[-2000:]
    for report in ("probes.json", "near_far.json"):
        assert json.load(open(tmp_path / "short" / report)) == json.load(open(tmp_path / "long" / report))


@pytest.mark.parametrize("flags,error", [
    (["--config.eval_options.transport.lenght=64", "--config.evals=transport"],
     "error: eval_options.transport.lenght is not an option of evaluator transport; valid: length, windows"),
    (["--config.evals=transport"], "error: evaluator transport needs eval_options.transport.length"),
    (["--config.evals=near_far", "--config.eval_options.near_far.length=64", "--config.eval_options.near_far.near=0:4",
      "--config.eval_options.near_far.far=(48, 99)"], "error: eval_options.near_far.near,far=0:4,48:99: '48:99' "
     "reaches past the probe length 64"),
    (["--config.eval_options.retrieval.examples=2.5", "--config.evals=retrieval"],
     "error: eval_options.retrieval.examples=2.5 is not an integer, as its default 4 is"),
    (["--config.evals=lenghts"], "error: unknown evaluator in --config.evals 'lenghts'"),
    (["--config.scheme=rope"], "error: --config.scheme: not a field here; valid: --config.evals,"),
    (["--config.eval_options.lenghts.tokens=5"], "error: unknown config field"),
])
def test_eval_py_bad_options_are_one_line(tiny_run, tmp_path, flags, error):
    run = cli("eval.py", f"--workdirs={tiny_run[0].workdir}", f"--out={tmp_path}", *flags)
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert run.stderr.strip().splitlines()[-1].startswith(error), run.stderr


@pytest.mark.slow  # 32 s
def test_train_py_spells_evaluator_options_as_eval_py_does(tmp_path):
    workdir = tmp_path / "run"
    flags = [*overrides(tiny_config(workdir)), "--config.train.steps=2", "--config.train.eval_every=2",
             "--config.evals=transport"]
    bad = cli("train.py", "--config", "configs/default.py", *flags, "--config.eval_options.transport.lenght=16")
    assert bad.returncode == 1 and bad.stderr.strip().splitlines()[-1].startswith(
        "error: config.eval_options.transport.lenght is not an option of evaluator transport"), bad.stderr
    assert not workdir.exists()
    good = cli("train.py", "--config", "configs/default.py", *flags, "--config.eval_options.transport.length=16")
    assert good.returncode == 0, good.stderr[-2000:]
    records = [json.loads(line) for line in open(workdir / "metrics.jsonl")]
    assert any(key.startswith("transport/far_mass_") for key in records[-1]), records[-1]
    assert json.load(open(workdir / "config.json"))["eval_options"]["transport"] == {"length": 16}


def test_a_zero_shot_scheme_in_the_training_spelling(tiny_run, tmp_path):
    workdir = tiny_run[0].workdir
    run = cli("eval.py", f"--workdirs={workdir}", f"--out={tmp_path}", "--config.model.scheme=rope_lm_infinite",
              "--config.model.scheme_options.global_tokens=4", "--max_multiplier=1")
    assert run.returncode == 0, run.stderr[-2000:]
    assert json.load(open(tmp_path / "results.json"))["runs"]["rope"]["scheme"] == "rope_lm_infinite"


@pytest.mark.parametrize("script,flag", [("train.py", "--config.modle.dim=3"), ("analyze.py", "--config.model.nope.x=1")])
def test_an_override_under_a_group_the_config_lacks_is_one_line(script, flag):
    run = cli(script, flag)
    assert run.returncode == 1 and run.stderr.strip().startswith("error: unknown config field '") and \
        len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]
