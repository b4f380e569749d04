"""The analysis command on a tiny trained run: every diagnostic lands in the JSON, the markdown
and the plots, and a perturbation of ratio 0 changes nothing (note T8)."""

import json
import math
import time

import numpy as np
import pytest

from lab import probes
from lab.analysis import analyze_runs, flag_options, shift_buckets, write_analysis
from helpers.tiny_setup import cli


def test_shift_buckets():
    assert shift_buckets(128, 8) == [(0, 128), (128, 192), (192, 256), (256, 512), (512, 1024)]
    assert shift_buckets(32, 2) == [(0, 32), (32, 48), (48, 64)]


def test_analysis_of_a_trained_and_an_untrained_model(tiny_run, tmp_path):
    config, _ = tiny_run
    results, maps = analyze_runs([config.workdir], untrained=True, windows=2, gammas=(0.0, 0.5), l_maxes=(3,),
                                 perturb_windows=2, shift_multiplier=2, shift_windows=4, log=lambda *_: None)
    assert list(results["runs"]) == ["rope", "rope (untrained)"]
    for name, run in results["runs"].items():
        assert run["step"] == (0 if "untrained" in name else 12)
        layers = run["layers"]
        assert len(layers) == 2 and len(layers[0]["three_axis_r"]) == 2  # layers x heads
        assert layers[0]["chance"] == math.sqrt(6 / 32)
        for key in ("three_axis_r_all", "fake_r_all", "fg_r_1", "fg_r_4"):
            r = np.asarray([layer[key] for layer in layers])
            assert np.isfinite(r).all() and (np.abs(r) <= 1 + 1e-6).all()
        assert len(layers[0]["fake_a"][0]) == 32 and np.shape(layers[0]["pairs"]["rotation"]) == (2, 8)
        p = run["perturbation"]["delta_ppl"]
        assert all(p[f"{mode}/0.0/3"] == 0.0 for mode in ("text", "keys", "positions"))  # T8
        assert all(p[f"{mode}/0.5/3"] != 0.0 for mode in ("text", "keys", "positions"))
        shift = run["feature_shift"]
        assert [tuple(b) for b in shift["buckets"]] == [(0, 32), (32, 48), (48, 64)]
        assert np.asarray(shift["kl"]).shape == (2, 2) and (np.asarray(shift["kl"]) > 0).all()
        assert len(shift["log_ppl"]) == 3
        # Table 2's LM-Infinite row: the same parameters, window 32; within it nothing changes.
        lm = shift["lm_infinite"]
        assert (lm["window"], lm["global_tokens"], np.shape(lm["kl"])) == (32, 10, (2, 2))
        np.testing.assert_allclose(lm["kl_control"], shift["kl_control"], rtol=1e-5)
        np.testing.assert_allclose(lm["log_ppl"][0], shift["log_ppl"][0], rtol=1e-6)
        assert lm["log_ppl"][1:] != shift["log_ppl"][1:]
        # Figure 6: per layer the in-length cloud, the last bucket, 3 queries over windows every 8 tokens.
        pca = shift["pca"]
        assert len(pca) == 2 and np.shape(pca[0]["cloud"]) == (64, 2) and np.shape(pca[0]["beyond"]) == (32, 2)
        assert np.shape(pca[1]["traces"]) == (3, 5, 2) and pca[1]["queries"] == [32, 47, 63]
    # The trained model predicts better than the untrained one at every length.
    trained, fresh = (results["runs"][n]["feature_shift"]["log_ppl"] for n in ("rope", "rope (untrained)"))
    assert all(a < b for a, b in zip(trained, fresh))
    md = write_analysis(results, maps, str(tmp_path))
    assert "| rope (untrained) | rope |" in md and "## Perturbation 'keys'" in md
    assert "| rope + LM-Infinite (window 32, 10 starting tokens) |" in md
    assert "| rope | 1 | 1 |" in md  # Observation 1: layer 1, head 1
    assert json.load(open(tmp_path / "analysis.json"))["gammas"] == [0.0, 0.5]
    for png in ("maps_rope.png", "curves_rope.png", "maps_rope_untrained_.png", "perturbation.png",
                "feature_shift.png", "pca_rope.png", "pca_rope_untrained_.png"):
        assert (tmp_path / png).stat().st_size > 5_000, png


def test_cli_rejects_a_bad_multiplier(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("analyze.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--shift_multiplier=3")
    assert run.returncode != 0 and "power of two" in run.stderr
    missing = cli("analyze.py", f"--workdirs={tmp_path / 'none'}", f"--out={tmp_path}")
    assert missing.returncode != 0 and "not a training run directory" in missing.stderr


FLAGS = dict(length=0, windows=4, gammas=["0.01", "0.5"], l_max=["5", "10"], perturb_windows=8, shift_multiplier=8,
             shift_windows=8)


@pytest.mark.parametrize("flag,value,error", [
    ("windows", 0, "--windows=0 is below 1; valid: an integer >= 1 (held-out windows for the decompositions)"),
    ("perturb_windows", 0, "--perturb_windows=0 is below 1; valid: an integer >= 1"),
    ("shift_windows", 0, "--shift_windows=0 is below 2; valid: an integer >= 2"),
    ("gammas", ["0.1", "x"], "--gammas=x is not a number; valid: a number in [0, 1] (perturbation ratios)"),
    ("gammas", ["2"], "--gammas=2 is above 1; valid: a number in [0, 1]"),
    ("gammas", [], "--gammas is empty; valid: one or more comma-separated values"),
    ("l_max", ["0"], "--l_max=0 is below 1; valid: an integer >= 1"),
    ("l_max", ["1.5"], "--l_max=1.5 is not an integer; valid: an integer >= 1"),
    ("length", -3, "--length=-3 is below 0; valid: an integer >= 0 (window length of the decompositions; 0: the"),
    ("shift_multiplier", 3, "--shift_multiplier=3 must be a power of two >= 2; valid: 2, 4, 8, ..."),
])
def test_bad_flags_are_one_line(flag, value, error):
    with pytest.raises(ValueError) as raised:
        flag_options(**{**FLAGS, flag: value})
    assert str(raised.value).startswith(error) and "\n" not in str(raised.value)
    assert flag_options(**FLAGS) == dict(length=0, windows=4, gammas=[0.01, 0.5], l_maxes=[5, 10], perturb_windows=8,
                                         shift_multiplier=8, shift_windows=8)


def test_a_length_too_long_for_memory_is_refused_at_once(tiny_run, monkeypatch):
    config, _ = tiny_run
    monkeypatch.setattr(probes, "available_memory", lambda: 8 * 2**30)
    start = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        analyze_runs([config.workdir], length=100_000, windows=4, log=lambda *_: None)
    assert time.perf_counter() - start < 30
    need = 8 * 2 * 100_000 ** 2 * 4 / 2**30  # maps of one window x 2 heads x T^2 float32, whatever the windows
    assert str(raised.value) == (f"the logit decompositions at length 100000: about {need:,.1f} GiB (8 float32 "
                                 "attention maps of 1 window x 2 heads x 100000 x 100000), more than the 8.0 GiB "
                                 "available; lower analyze.py --length")
    probes.check_memory(config, "the logit decompositions", 32, 4, 19, "")  # the training length fits


def test_cli_refuses_a_huge_length_in_seconds(tiny_run, tmp_path):
    """It died out of memory after 115 s; now one line before any heavy work."""
    start = time.perf_counter()
    run = cli("analyze.py", f"--workdirs={tiny_run[0].workdir}", f"--out={tmp_path}", "--length=100000")
    assert run.returncode == 1 and "Traceback" not in run.stderr and time.perf_counter() - start < 60
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("error: the logit decompositions at length 100000: about ") and "GiB available" in line


def test_analyze_dry_run_says_what_the_decompositions_need_and_the_longest_length_that_fits(tiny_run, tmp_path,
                                                                                             monkeypatch):
    """analyze.py --dry_run from a directory holding only a run's config.json: parameters plus
    the decompositions' maps against the memory available; where they do not fit, the longest
    length that does (it fits, one token more does not)."""
    import os
    import shutil
    import jax
    from lab import analysis
    config, _ = tiny_run
    shutil.copy(os.path.join(config.workdir, "config.json"), tmp_path / "config.json")
    run = cli("analyze.py", f"--workdirs={tmp_path}", "--dry_run", "--length=64")
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith(f"{tmp_path}: the logit decompositions at length 64 need about ")
    assert run.stdout.strip().endswith(": they fit")
    weights = 4 * 10 ** 6
    have = weights + probes.maps_bytes(config, 1000, 1, analysis.DECOMPOSITION_MAPS) + 1
    monkeypatch.setattr(analysis, "available_memory", lambda: have)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = {"w": jax.ShapeDtypeStruct((weights,), np.uint8, sharding=one_device)}
    monkeypatch.setattr(analysis, "abstract_run", lambda *a, **k: (config, None, None, params))
    line = analysis.plan(str(tmp_path), length=4096)
    assert "\n" not in line and line.endswith(": they do not fit; the longest length that does is 1,000 (analyze.py "
                                               "--length)"), line


def test_streamed_decompositions_equal_the_fits_of_whole_maps(tiny_run):
    """decompose fits one layer, window and head at a time; its scores equal the fits of every
    window's and head's maps at once (attention_internals' logits)."""
    import jax
    from lab.analysis import decompose
    from lab.runs import held_out_windows, load_run
    from models.lm import attention_internals
    from positional.probes import logits as lp
    config, _ = tiny_run
    _, model, _ = load_run(config.workdir)
    tokens = np.asarray(held_out_windows(config, 3, 32))
    layers, maps = decompose(model, tokens, config.seq_len)
    for layer, whole in zip(layers, attention_internals(model, tokens, rng=jax.random.key(0)), strict=True):
        three = lp.three_axis_fit(whole["logits"])
        np.testing.assert_allclose(layer["three_axis_r_all"], three["r"], atol=1e-4)
        np.testing.assert_allclose(layer["three_axis_a"], three["a"].mean(0), atol=1e-3)
    np.testing.assert_allclose(maps[0]["logits"], attention_internals(model, tokens)[0]["logits"][0, 0], atol=1e-5)
