"""The claims ledger (docs/results/claims.py) and its statistics (lab/stats.py)."""

import math
import os

import numpy as np
import pytest
from scipy import stats as scipy_stats

from lab.stats import paired, verdict
from tiny_setup import ROOT


def test_the_committed_ledger_is_what_the_script_writes_from_the_committed_json():
    import importlib.util
    spec = importlib.util.spec_from_file_location("claims", os.path.join(ROOT, "docs", "results", "claims.py"))
    claims = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(claims)
    with open(os.path.join(ROOT, "docs", "results", "claims.md")) as f:
        assert f.read() == claims.ledger(), "rerun: python docs/results/claims.py"


def test_paired_interval_is_students_t_on_the_differences():
    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 1.0, 7), rng.normal(0.0, 1.0, 7)
    r = paired(a, b)
    d = a - b
    half = scipy_stats.t.ppf(0.975, 6) * d.std(ddof=1) / math.sqrt(7)
    assert r["n"] == 7 and r["mean"] == pytest.approx(d.mean())
    assert (r["low"], r["high"]) == pytest.approx((d.mean() - half, d.mean() + half))
    assert r["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue)
    assert r["chance_same_sign"] == 2.0 ** -6


def test_the_verdict_rule():
    assert verdict({"low": -2, "high": -1}, "negative") == "supported"
    assert verdict({"low": -2, "high": -1}, "positive") == "contradicted"
    assert verdict({"low": -2, "high": 1}, "negative") == "not resolved"
    assert verdict(paired([1.0], [0.0]), "positive") == "not resolved"  # one seed: no interval
    # Three seeds with the same sign and a wide spread: the sign is no evidence.
    assert verdict(paired([0.1, 0.5, 3.0], [0, 0, 0]), "positive") == "not resolved"
