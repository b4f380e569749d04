"""The analysis command on a tiny trained run: every diagnostic lands in the JSON, the markdown
and the plots, and a perturbation of ratio 0 changes nothing (note T8)."""

import json
import math

import numpy as np

from lab.analysis import analyze_runs, shift_buckets, write_analysis
from tiny_setup import cli


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
    # The trained model predicts better than the untrained one at every length.
    trained, fresh = (results["runs"][n]["feature_shift"]["log_ppl"] for n in ("rope", "rope (untrained)"))
    assert all(a < b for a, b in zip(trained, fresh))
    md = write_analysis(results, maps, str(tmp_path))
    assert "| rope (untrained) | rope |" in md and "## Perturbation 'keys'" in md
    assert "| rope | 1 | 1 |" in md  # Observation 1: layer 1, head 1
    assert json.load(open(tmp_path / "analysis.json"))["gammas"] == [0.0, 0.5]
    for png in ("maps_rope.png", "curves_rope.png", "maps_rope_untrained_.png", "perturbation.png",
                "feature_shift.png"):
        assert (tmp_path / png).stat().st_size > 5_000, png


def test_cli_rejects_a_bad_multiplier(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("analyze.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--shift_multiplier=3")
    assert run.returncode != 0 and "power of two" in run.stderr
    missing = cli("analyze.py", f"--workdirs={tmp_path / 'none'}", f"--out={tmp_path}")
    assert missing.returncode != 0 and "not a training run directory" in missing.stderr
