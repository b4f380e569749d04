"""The claims ledger (lab/results/claims.py) and its statistics (lab/stats.py)."""

import glob
import json
import math
import os
import re

import numpy as np
import pytest
from scipy import stats as scipy_stats

from lab.lengths import evaluate_runs
from lab.results import claims, documents
from lab.stats import bootstrap, log_ppl, paired, verdict
from helpers.tiny_setup import ROOT


RESULTS = os.path.join(ROOT, "docs", "results")
TAG = re.compile(r"\[claim ([a-z0-9-]+): (supported|not resolved|contradicted)\]\((?:docs/results/)?claims\.md\)")


def load_claims():
    return claims


def test_the_committed_ledger_is_what_the_script_writes_from_the_committed_json():
    with open(os.path.join(RESULTS, "claims.md")) as f:
        assert f.read() == load_claims().ledger(), "rerun: python -m lab.results.claims"


def test_every_page_states_the_ledgers_verdicts():
    """Each ledger claim is tagged on its page with the ledger's verdict, every tag on a results
    page or the README names a ledger claim with its verdict, and no page cites the ledger
    without a tag (a verdict in words alone is not checked)."""
    claims = load_claims()
    ledger = {r["id"]: r for r in map(claims.row, claims.CLAIMS)}
    assert len(ledger) == len(claims.CLAIMS), "claim ids must be unique"
    pages = sorted(glob.glob(os.path.join(RESULTS, "*.md"))) + [os.path.join(ROOT, "README.md")]
    tagged = {}
    for path in pages:
        name = os.path.basename(path)
        if name == "claims.md":
            continue
        with open(path) as f:
            text = f.read()
        for m in TAG.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            assert m.group(1) in ledger, f"{name}:{line}: no claim {m.group(1)!r} in the ledger"
            want = ledger[m.group(1)]["verdict"]
            assert m.group(2) == want, f"{name}:{line}: claim {m.group(1)} tagged {m.group(2)!r}; the ledger: {want!r}"
            tagged.setdefault(m.group(1), set()).add(name)
        bare = TAG.sub("", text).count("claims.md")
        assert not bare, f"{name}: {bare} mention(s) of claims.md without a [claim <id>: <verdict>](claims.md) tag"
    for name, r in ledger.items():
        assert r["page"] in tagged.get(name, set()), f"claim {name} is not tagged on {r['page']}"


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


def test_bootstrap_over_documents_agrees_with_the_normal_interval_and_keeps_arms_paired():
    """The percentile bootstrap of a mean over 400 documents is the normal interval to within 10%
    of its width; arrays are resampled with the same documents, so an arm that is another plus a
    constant gives that constant with no width; log_ppl pools the documents' NLL and targets."""
    rng = np.random.default_rng(1)
    x = rng.normal(0.3, 1.0, 400)
    r = bootstrap(np.mean, x, resamples=4000)
    half = 1.96 * x.std(ddof=1) / math.sqrt(400)
    assert r["n"] == 400 and r["mean"] == pytest.approx(x.mean())
    assert (r["low"], r["high"]) == pytest.approx((x.mean() - half, x.mean() + half), abs=0.1 * half)
    assert r["p"] < 0.01 and verdict(r, "positive") == "supported"
    a = rng.uniform(1, 3, size=(12, 2)) * [100, 50]  # [summed NLL, targets] per document
    b = a + [[5.0, 0.0]]
    d = bootstrap(lambda a, b: log_ppl(b) - log_ppl(a), a, b, resamples=500)
    assert d["low"] < d["mean"] < d["high"] and d["low"] > 0
    same = bootstrap(lambda a, b: log_ppl(b) - log_ppl(a), a, a.copy(), resamples=200)
    assert same["low"] == same["high"] == same["mean"] == 0.0
    assert log_ppl([[10.0, 4], [2.0, 1]]) == pytest.approx(12.0 / 5)
    with pytest.raises(ValueError, match="one entry per document"):
        bootstrap(lambda a, b: 0.0, a, b[:5])


def test_intervals_over_documents_from_an_eval_report(tiny_run):
    """lab/results/documents.py on a report made with documents=N: each run's perplexity with
    its interval (the mean is the report's own), and a run against the base paired by document;
    a report made without it is one line."""
    config, _ = tiny_run
    report = evaluate_runs([config.workdir], tokens=300, documents=5, log=lambda *_: None)
    worse = json.loads(json.dumps(report["runs"]["rope"]))
    for r in worse["results"]:  # a second run: 0.1 nats worse on every target of every document
        r["per_document"] = [[s + 0.1 * n, n] for s, n in r["per_document"]]
    report["runs"]["worse"] = worse
    rows = documents.intervals(report, "rope", 300)
    for r, own in zip(rows, report["runs"]["rope"]["results"]):
        assert r["ppl"]["mean"] == pytest.approx(own["nll"]) and r["ppl"]["low"] <= r["ppl"]["mean"] <= r["ppl"]["high"]
    worse_rows = [r for r in rows if r["run"] == "worse"]
    assert all(r["ppl_vs_base"]["low"] == pytest.approx(0.1) == r["ppl_vs_base"]["high"] for r in worse_rows)
    assert all(abs(r["ratio_vs_base"]["mean"]) < 1e-9 for r in worse_rows)
    assert "| worse | 128 |" in documents.table(rows, "rope", 5)
    del report["runs"]["rope"]["results"][0]["per_document"]
    with pytest.raises(ValueError, match="run rope has no per_document rows: evaluate with eval.py --documents=N"):
        documents.intervals(report, "rope", 10)


def test_every_claim_has_one_paper_row():
    """docs/results/paper_claims.json covers each ledger claim once, with a direction the table
    reads, and a quote or a place wherever the paper reports the comparison."""
    claims = load_claims()
    rows = claims.papers()
    assert [p["id"] for p in rows] == [c[1] for c in claims.CLAIMS]
    for p in rows:
        assert p["direction"] in ("same", "opposite", "none"), p["id"]
        assert p["direction"] == "none" or (p["paper"] and p["where"] and p["paper_says"]), p["id"]
    assert claims.agreement("same", "contradicted") == "disagrees" and claims.agreement("opposite", "supported") == (
        "disagrees") and claims.agreement("same", "supported") == "agrees"


def test_the_interval_over_documents_pairs_documents_and_averages_the_seeds(tmp_path, monkeypatch):
    """Where a json holds each seed's documents, a claim also gets Student's t over the documents
    of each document's A - B averaged over the seeds: B's documents 0.1 nats above A's in every
    seed (whatever the seed adds) give exactly 0.1 with no width, in log perplexity and in the log
    ratio to the training length alike; a json without documents gives none."""
    claims = load_claims()
    rng = np.random.default_rng(0)
    n = np.full((3, 2, 4), 100.0)  # [seed, column, document] targets
    nll_a = rng.uniform(1, 3, (3, 2, 4)) * n + rng.normal(0, 50, (3, 1, 1))  # each seed shifts every document
    nll_b = nll_a + 0.1 * n * np.array([1.0, 2.0])[None, :, None]  # 0.1 nats at column 0, 0.2 at column 1
    arm = lambda nll: {"seeds": [0, 1, 2], "values": np.exp(nll.sum(2) / n.sum(2)).tolist(),  # noqa: E731
                       "per_document": np.stack([nll, n], -1).tolist()}
    (tmp_path / "docs.json").write_text(json.dumps({"columns": [128, 512], "arms": {"a": arm(nll_a), "b": arm(nll_b)}}))
    monkeypatch.setattr(claims, "HERE", str(tmp_path))
    ppl = claims.row(("x.md", "x", "b worse", "docs.json", "b", "a", "ppl", 128, None, "positive"))
    ratio = claims.row(("x.md", "y", "b degrades more", "docs.json", "b", "a", "ratio", 512, 128, "positive"))
    for r, want in ((ppl, 0.1), (ratio, 0.1)):
        d = r["documents"]
        assert d["n"] == 4 and d["mean"] == pytest.approx(want) and d["low"] == pytest.approx(d["high"])
        assert d["verdict"] == "supported"
    (tmp_path / "plain.json").write_text(json.dumps({"columns": [128], "arms": {k: {"seeds": [0, 1, 2], "values": [[1.0], [2.0], [3.0]]}
                                                                             for k in "ab"}}))
    assert "documents" not in claims.row(("x.md", "z", "-", "plain.json", "a", "b", "ppl", 128, None, "positive"))
