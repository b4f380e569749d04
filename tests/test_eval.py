"""eval.py: every target scored once, perplexity by hand, reports, and the command line."""

import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lab.lengths import eval_impl, evaluate_runs, perplexity, scoring_plan, write_report
from lab.runs import load_run, run_name
from models.lm import DecoderLM, ModelConfig, token_nll
from tiny_setup import cli


@pytest.mark.parametrize("n_tokens,length,stride", [(100, 10, 0), (95, 10, 0), (100, 10, 3),
                                                    (100, 10, 10), (7, 10, 0), (64, 16, 4)])
def test_scoring_plan_scores_each_target_once(n_tokens, length, stride):
    starts, first = scoring_plan(n_tokens, length, stride)
    scored = np.concatenate([s + 1 + np.arange(f, length) for s, f in zip(starts, first)])
    assert len(np.unique(scored)) == len(scored)  # never twice
    np.testing.assert_array_equal(scored, np.arange(1, len(scored) + 1))  # targets 1..N in order
    assert len(scored) >= n_tokens
    if 0 < stride < length:
        # every scored token but the first window's has at least length - stride tokens of context
        context = np.concatenate([np.arange(f, length) for f in first])
        assert context[length:].min() >= length - stride


@pytest.mark.parametrize("stride", [0, 4])
def test_perplexity_by_hand(stride):
    model = DecoderLM(ModelConfig(vocab_size=30, d_model=16, num_layers=1, num_heads=2), rngs=nnx.Rngs(0))
    stream = np.random.default_rng(0).integers(0, 30, 200).astype(np.int32)
    got = perplexity(model, stream, 16, 64, stride=stride, batch_size=3)
    # By hand: for each target t, its nll given the window that scores it.
    total, count = 0.0, 0
    for start, first in zip(*scoring_plan(64, 16, stride)):
        nll, _ = token_nll(model, jnp.asarray(stream[start:start + 17])[None])
        total += float(nll[0, first:].sum())
        count += 16 - first
    assert got["tokens"] == count
    assert got["ppl"] == pytest.approx(math.exp(total / count), rel=1e-5)
    blockwise = perplexity(model, stream, 16, 64, stride=stride, batch_size=3, impl="blockwise")
    assert blockwise["ppl"] == pytest.approx(got["ppl"], rel=1e-5)


def test_evaluate_runs_writes_json_markdown_and_plot(tiny_run, tmp_path):
    config, _ = tiny_run
    results = evaluate_runs([config.workdir, config.workdir], max_multiplier=8, log=lambda *_: None)
    assert results["lengths"] == [16, 32, 64, 128, 256]
    run = next(iter(results["runs"].values()))
    assert run["step"] == 12
    at_train = [r for r in run["results"] if r["length"] == 32][0]
    assert at_train["ratio"] == 1.0
    assert all(r["tokens"] >= 256 and np.isfinite(r["ppl"]) for r in run["results"])
    assert [r["impl"] for r in run["results"]][-2:] == ["blockwise", "blockwise"]  # blockwise_from 128
    table = write_report(results, str(tmp_path))
    assert "| 16 | 32 | 64 | 128 | 256 |" in table
    assert json.load(open(tmp_path / "results.json"))["lengths"] == results["lengths"]
    assert (tmp_path / "results.png").stat().st_size > 10_000


def test_load_run_restores_the_trained_parameters(tiny_run):
    config, _ = tiny_run
    loaded_config, model, step = load_run(config.workdir)
    assert step == 12 and loaded_config.model.scheme == "rope"
    assert np.isfinite(np.asarray(model(jnp.zeros((1, 4), jnp.int32)))).all()


def test_cli_compares_runs_and_reports_missing_ones(tiny_run, tmp_path):
    config, _ = tiny_run
    out = tmp_path / "cmp"
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={out}", "--tokens=128")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "| rope | rope |" in run.stdout and os.path.exists(out / "results.png")
    missing = cli("eval.py", f"--workdirs={tmp_path / 'nope'}", f"--out={out}")
    assert missing.returncode != 0 and "Traceback" not in missing.stderr
    assert "not a training run directory" in missing.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("options,error", [
    ({"stride": -7}, "lengths option stride=-7; valid: 0 (non-overlapping windows) or a positive"),
    ({"tokens": -5}, "lengths option tokens=-5; valid: an integer >= 1"),
    ({"max_multiplier": 0.25}, "lengths option max_multiplier=0.25 is below every length multiplier"),
])
def test_bad_lengths_options_are_one_line(tiny_run, options, error):
    config, _ = tiny_run
    with pytest.raises(ValueError) as raised:
        evaluate_runs([config.workdir], **options)
    assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


def test_cli_bad_stride_is_one_line_not_ignored(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--stride=-7")
    assert run.returncode == 1
    assert run.stderr.strip().splitlines()[-1].startswith("error: lengths option stride=-7")


def test_probe_command_reports_every_layer(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--probe_length=64")
    assert run.returncode == 0, run.stderr[-2000:]
    probes = json.load(open(tmp_path / "probes.json"))
    layers = probes["runs"]["rope"]["layers"]
    assert len(layers) == 2 and set(layers[0]["far_mass"]) == {"8", "32"}
    assert all(0 <= m <= 1 for rec in layers for m in rec["far_mass"].values())
    assert "| rope | 1 |" in run.stdout and (tmp_path / "probes.png").exists()


def test_near_far_command(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--probe_length=64",
              "--near_far=0:4,48:64")
    assert run.returncode == 0, run.stderr
    result = json.load(open(tmp_path / "near_far.json"))["runs"]["rope"]
    assert result["n"] == 10000 and np.isfinite(result["mean"]) and result["std"] > 0
    assert "| rope |" in run.stdout and (tmp_path / "near_far.png").exists()


def test_run_names_tell_runs_with_the_same_folder_name_apart():
    runs = ["runs/tapa/extend/tapa", "runs/tapa/zeroshot/tapa", "runs/tapa/extend/rope"]
    assert [run_name(w, runs) for w in runs] == ["extend/tapa", "zeroshot/tapa", "rope"]


def test_long_evaluation_switches_only_the_reference_to_blockwise():
    assert eval_impl("reference", 1024, 1024) == "blockwise"
    assert eval_impl("reference", 512, 1024) == "reference"
    assert eval_impl("pallas", 4096, 1024) == "pallas"
