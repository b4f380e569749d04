"""Intervals for comparisons over seeds (`paired`) and over evaluation documents (`bootstrap`):
what the results pages and the claims ledger (lab/results/claims.py) state instead of "the same
sign in every seed", which 3 seeds give 25% of the time when there is no effect."""

from __future__ import annotations

import math

import numpy as np
from scipy import stats as scipy_stats


def paired(a, b, level: float = 0.95) -> dict:
    """Student's t interval for the mean of the paired differences a - b (one pair per seed):
    {'n', 'mean', 'low', 'high', 'p' (two-sided, no difference), 'same_sign' (every difference on
    one side of 0), 'chance_same_sign' (of that with no effect and symmetric noise: 2^(1-n))}.
    With one pair the interval is unbounded."""
    d = np.asarray(a, float) - np.asarray(b, float)
    n, mean = len(d), float(np.mean(d))
    if n < 2:
        return {"n": n, "mean": mean, "low": -math.inf, "high": math.inf, "p": math.nan, "same_sign": True,
                "chance_same_sign": 1.0}
    sem = float(np.std(d, ddof=1)) / math.sqrt(n)
    half = float(scipy_stats.t.ppf(0.5 + level / 2, n - 1)) * sem
    p = float(2 * scipy_stats.t.sf(abs(mean) / sem, n - 1)) if sem > 0 else (0.0 if mean else 1.0)
    return {"n": n, "mean": mean, "low": mean - half, "high": mean + half, "p": p,
            "same_sign": bool(np.all(d > 0) or np.all(d < 0)), "chance_same_sign": 2.0 ** (1 - n)}


def bootstrap(statistic, *per_document, resamples: int = 10_000, level: float = 0.95, seed: int = 0) -> dict:
    """Percentile bootstrap over evaluation documents: each array of `per_document` has one
    entry per document along its first axis (e.g. an arm's [summed NLL, targets] per document,
    lab.lengths's 'per_document'), every array resampled with the same documents (so arms and
    lengths stay paired), and statistic(*arrays) -> a number computed on each resample.
    {'n' (documents), 'mean' (the statistic on all of them), 'low', 'high', 'p' (two-sided: twice
    the share of resamples on the far side of 0)}, as `paired` gives, for `verdict`."""
    arrays = [np.asarray(x, float) for x in per_document]
    n = len(arrays[0])
    if any(len(x) != n for x in arrays):
        raise ValueError(f"bootstrap: every array needs one entry per document; got lengths {[len(x) for x in arrays]}")
    picks = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    values = np.array([statistic(*(x[pick] for x in arrays)) for pick in picks])
    mean = float(statistic(*arrays))
    low, high = np.quantile(values, [0.5 - level / 2, 0.5 + level / 2])
    far = np.mean(values <= 0) if mean > 0 else np.mean(values >= 0)
    return {"n": n, "mean": mean, "low": float(low), "high": float(high), "p": float(min(1.0, 2 * far))}


def log_ppl(per_document) -> float:
    """Log perplexity of documents given as rows [summed NLL, targets]."""
    d = np.asarray(per_document, float)
    return float(d[:, 0].sum() / d[:, 1].sum())


def verdict(interval: dict, claimed: str) -> str:
    """The ledger's one rule for a claimed sign of a - b ('negative' or 'positive'): 'supported'
    where the 95% interval lies wholly on that side of 0, 'contradicted' where wholly on the other,
    else 'not resolved'."""
    low, high = interval["low"], interval["high"]
    below, above = high < 0, low > 0
    if (below and claimed == "negative") or (above and claimed == "positive"):
        return "supported"
    if below or above:
        return "contradicted"
    return "not resolved"
