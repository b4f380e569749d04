"""Every "mean +- std" in a results page's tables recomputes from per-seed values the page
points to: a json it names (docs/results/*.json, in any of the layouts its scripts write), or the
per-seed values shown in the same row ("0.1000 / 0.0800", within a unit of the last digit: those
values are rounded themselves). A column headed with "paper" holds a
paper's numbers and is not ours to check. So a number typed by hand, or left behind when its json
changed, fails here (tests/project/test_seeds.py checks seeds.py's own rows digit for digit)."""

import itertools
import json
import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results"
MEAN_STD = re.compile(r"([+-]?\d+\.\d+) \+- (\d+\.\d+)")
PER_SEED = re.compile(r"-?\d+\.\d+(?: / -?\d+\.\d+)+")


def leaves(tree, path=()):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from leaves(value, path + (key,))
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, float(tree)


def samples(tree):
    """Every set of per-seed values in a json: seeds.py's arms (each column, and each column over
    another: the ratios pages show), {seed: {...}} maps (each leaf across the seeds) and lists of
    records with a "seed" (each leaf across the records that agree in every text field)."""
    if isinstance(tree, dict):
        for arm in (tree.get("arms") or {}).values() if isinstance(tree.get("arms"), dict) else ():
            values = np.array(arm["values"], float)
            yield from values.T
            for a, b in itertools.permutations(range(values.shape[1]), 2):
                with np.errstate(all="ignore"):
                    yield values[:, a] / values[:, b]
        if len(tree) > 1 and all(str(key).isdigit() for key in tree):
            across = {}
            for seed in tree.values():
                for path, x in leaves(seed):
                    across.setdefault(path, []).append(x)
            yield from (np.array(xs) for xs in across.values() if len(xs) == len(tree))
        for value in tree.values():
            yield from samples(value)
    elif isinstance(tree, list):
        if tree and all(isinstance(r, dict) and "seed" in r for r in tree):
            groups = {}
            for r in tree:
                kind = tuple(sorted((k, v) for k, v in r.items() if isinstance(v, str)))
                for path, x in leaves({k: v for k, v in r.items() if k != "seed"}):
                    groups.setdefault((kind, path), []).append(x)
            yield from (np.array(xs) for xs in groups.values())
        for value in tree:
            yield from samples(value)


def renderings(x: float, decimals: int) -> set:
    """x at `decimals`, rounded once, or rounded half up from its 4-decimal form (seeds.py's)."""
    step = Decimal(1).scaleb(-decimals)
    return {f"{x:.{decimals}f}", str(Decimal(f"{x:.4f}").quantize(step, rounding=ROUND_HALF_UP))}


def shown(xs) -> set:
    """The ("mean", "std") cells the per-seed values xs can be shown as (1 to 4 decimals)."""
    xs = np.asarray(xs, float)
    if len(xs) < 2 or not np.all(np.isfinite(xs)):
        return set()
    mean, std = xs.mean(), xs.std(ddof=1)
    return {(m, s) for k in (1, 2, 3, 4) for m in renderings(mean, k) for s in renderings(std, k)}


def near(xs, mean: str, std: str) -> bool:
    """Whether the rounded per-seed values xs give `mean` and `std` within a unit of their last digit."""
    xs = np.asarray(xs, float)
    unit = 10.0 ** -len(std.split(".")[1])
    return abs(xs.mean() - float(mean)) <= 1.5 * unit and abs(xs.std(ddof=1) - float(std)) <= 1.5 * unit


def table_cells(text: str):
    """(header, cell, row) of every body cell of every table."""
    header = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = line.strip().strip("|").split("|")
        if header is None:
            header = cells
        elif not set(line.strip()) <= set("|-: "):
            yield from ((h, cell, line) for h, cell in zip(header, cells))


def test_every_mean_and_std_in_a_pages_tables_recomputes_from_its_seeds():
    checked, unexplained = 0, []
    for page in sorted(RESULTS.glob("*.md")):
        text = page.read_text()
        known = set()
        for source in RESULTS.glob("*.json"):
            if source.name in text:
                for xs in samples(json.loads(source.read_text())):
                    known |= shown(xs)
        for header, cell, row in table_cells(text):
            if "paper" in header.lower():
                continue
            for mean, std in MEAN_STD.findall(cell):
                in_row = any(near([float(x) for x in seeds.split(" / ")], mean, std) for seeds in PER_SEED.findall(row))
                if (mean.lstrip("+"), std) not in known and not in_row:
                    unexplained.append(f"{page.name}: {mean} +- {std} in column {header.strip()!r} of {row[:60]!r}")
                checked += 1
    assert unexplained == [], "\n".join(unexplained)
    assert checked > 500  # 705 when this was written
