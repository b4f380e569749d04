"""Why a scheme extrapolates: the diagnostics of "Computation Mechanism Behind LLM Position
Generalization" (Han & Ji) on trained runs, side by side, as three evaluators
(lab/evaluators.py) and "analysis", which runs all three loading each run once
(`eval.py --evals=analysis`, or `analyze.py` with its own flags):

    python analyze.py --workdirs=runs/accumulated/rope,runs/accumulated/alibi --untrained \
        --out=runs/analysis
    python eval.py --workdirs=runs/rope --evals=decompositions,feature_shift --out=runs/why

For every run (and, with --untrained, a freshly initialised copy of the first run's model):

  decompositions  on --windows held-out windows of --length tokens (default: the training
                  length), every layer and head (one layer, window and head at a time): the
                  3-axis fit of the logit map (r, R^2, against the chance level sqrt(6/n));
                  the fake-distance fit of the last query of each window, with key contents
                  moved through the scheme itself (`placed_fake_logits`: the paper's fake
                  distance for RoPE, the slot swap for data-dependent schemes); for RoPE heads
                  the explicit f + g with 1, 2 and 4 slow pairs and Observation 1's per-pair
                  statistics;
                  writes decompositions.json / .md, maps_<run>.png (logit maps beside their
                  reconstructions) and curves_<run>.png (positional curves per layer and head);
  perturbations   the change in perplexity under text transposition, key-order shuffle and
                  key position offsets (positional/probes/perturb.py) over --gammas x
                  --l_max, on --perturb_windows windows of the training length, the same
                  draws for every run; writes perturbations.json / .md and perturbation.png;
  feature_shift   the Gaussian-fit KL between each layer's attention output at positions
                  beyond the training length and within it, per length bucket, beside the
                  log-perplexity per bucket, on --shift_windows windows of --shift_multiplier
                  times the training length; writes feature_shift.json / .md and
                  feature_shift.png.

"analysis" writes analysis.json and analysis.md (every part's fields and sections) and all
the plots under --out.

Of several processes (analyze.py and eval.py take --coordinator, --num_processes and
--process_id), each computes its own windows of every part where the windows divide evenly
among the batch shards, else every process all of them (`distributed.place_windows`: every
part's numbers are statistics over all its windows, a mean or the feature shift's halves,
which padding rows would change); results reach every process's host through
`distributed.to_host`, and process 0 writes the report.
"""

from __future__ import annotations

import functools
import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lab import files, provenance
from lab.distributed import place_windows, to_host
from lab.lengths import checked, checked_list, eval_impl
from lab.probes import available_memory, check_memory, maps_bytes
from lab.runs import abstract_run, held_out_windows, named_runs, pyplot, with_scheme
from models.lm import attention_internals, token_nll
from positional.probes import logits as lp
from positional.probes import perturb

SLOW_PAIRS = (1, 2, 4)


# ---- decompositions ----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0)
def _window_logits(scheme, q, k, v, features):
    """The scheme's logits of one window, [1, H, T, T] (before the causal mask)."""
    t = q.shape[1]
    positions = jnp.broadcast_to(jnp.arange(t), q.shape[:2])
    return scheme.logits(q, k, v, features, positions).reshape(q.shape[0], -1, t, t)


@functools.partial(jax.jit, static_argnums=(0, 5))
def _fake_logits(scheme, q, k, v, features, query):
    """The fake-distance logits of the query at slot `query` against every earlier key, [1, H,
    distances, keys] (`lp.placed_fake_logits`: one full logit map per key, made one at a time)."""
    positions = jnp.broadcast_to(jnp.arange(q.shape[1]), q.shape[:2])
    fn = functools.partial(scheme.logits, features=features, positions=positions)
    w = lp.placed_fake_logits(fn, q, k, v, query, jnp.arange(query + 1))
    return w.reshape(w.shape[0], -1, *w.shape[-2:])


def _per_head(x, heads):
    """[B, T, K, D] keys -> [B, H, T, D] per query head (grouped-query heads share a key)."""
    return jnp.moveaxis(jnp.repeat(x, heads // x.shape[2], axis=2), 2, 1)


def _by_head(fit, maps) -> dict:
    """`fit` of each head's map alone (maps [1, H, n, m]), its results stacked over heads; of the
    fitted maps ('fit') only head 0's is kept (the plots'), so a fit's temporaries are one head's."""
    parts = [fit(maps[:, h:h + 1]) for h in range(maps.shape[1])]
    return {key: parts[0][key] if key == "fit" or jnp.ndim(x) < 2 else jnp.concatenate([p[key] for p in parts], 1)
            for key, x in parts[0].items()}


def _window(x, w: int, windows: int):
    """Row w of an array with a leading axis of the windows (features of another shape as they are)."""
    return x[w:w + 1] if jnp.ndim(x) and x.shape[0] == windows else x


def decompose(model, tokens, train_len: int) -> tuple[list[dict], dict]:
    """Per layer: the fits' scores per head (mean over windows) and their curves; plus the
    arrays of window 0, head 0 for the map plots. Streamed: one layer's logits of one window
    at a time, fitted head by head, so memory holds about `DECOMPOSITION_MAPS` maps of one
    window's heads whatever the layers and windows."""
    layers, maps = [], []
    tokens = place_windows({"tokens": tokens}, model)["tokens"]
    windows, n = tokens.shape
    for i, layer in enumerate(attention_internals(model, tokens, rng=jax.random.key(0), maps=False)):
        scheme = model.blocks[i].attn.scheme
        heads = layer["q"].shape[2]
        fits = []
        for w in range(windows):
            q, k, v, features = jax.tree.map(lambda x: _window(x, w, windows),
                                              (layer["q"], layer["k"], layer["v"], layer["features"]))
            logits = _window_logits(scheme, q, k, v, features)
            three = _by_head(lp.three_axis_fit, logits)
            fake_w = _fake_logits(scheme, q, k, v, features, n - 1)
            fake = _by_head(lp.fake_distance_fit, fake_w)
            if w == 0:
                shown = (("logits", logits), ("three_axis", three["fit"]), ("fake", fake_w), ("fake_fit", fake["fit"]))
                maps.append({key: to_host(x[0, 0]) for key, x in shown})
            fits.append((three, fake))
            del logits, fake_w
        three, fake = ({key: jnp.concatenate([f[j][key] for f in fits]) if jnp.ndim(x) >= 2 else x
                        for key, x in fits[0][j].items() if key != "fit"} for j in (0, 1))
        rec = {"three_axis_r": three["r"].mean(0), "three_axis_r2": three["r2"].mean(0),
               "three_axis_r_all": three["r"], "chance": three["chance"],
               "fake_r": fake["r"].mean(0), "fake_r2": fake["r2"].mean(0), "fake_r_all": fake["r"],
               "three_axis_a": three["a"].mean(0), "fake_a": fake["a"].mean(0)}
        if "rope_pairs" in scheme.probes:
            q, k = jnp.moveaxis(layer["q"], 2, 1), _per_head(layer["k"], heads)
            stats = [lp.pair_stats(scheme.rotated_part(q[:, h]), scheme.rotated_part(k[:, h]), scheme.theta, train_len,
                                   scheme.layout)
                     for h in range(heads)]
            for m in SLOW_PAIRS:
                slow = [lp.slow_pairs(st, m) for st in stats]
                rs = [lp.explicit_fg(scheme.rotated_part(q[:, h]), scheme.rotated_part(k[:, h]), scheme.theta, slow[h],
                                 scheme.layout)["r"]
                      for h in range(heads)]
                rec[f"fg_r_{m}"] = jnp.stack(rs, -1).mean(0)
            rec["pairs"] = {key: jnp.stack([st[key] for st in stats])  # [H, D/2]
                            for key in ("rotation", "kbar_share", "coherence", "deviation", "theta_delta")}
        layers.append(jax.tree.map(lambda x: to_host(x).tolist(), rec))
    return layers, maps


# ---- perturbations -----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnums=0)
def _mean_nll(graphdef, state, tokens, key_slots):
    nll, _ = token_nll(nnx.merge(graphdef, state), tokens, impl="reference", rng=jax.random.key(0),
                       key_slots=key_slots)
    return nll.mean()


def perturbation_grid(model, tokens, gammas, l_maxes, seed: int = 0) -> dict:
    """Perplexity change per (mode, gamma, l_max) on windows tokens [B, T + 1]; the draws depend
    on the seed and the grid cell only, so every model gets the same ones."""
    graphdef, state = nnx.split(model)
    tokens = np.asarray(tokens)

    def mean_nll(tokens, key_slots=None):
        placed = place_windows({"tokens": tokens, **({} if key_slots is None else {"slots": key_slots})}, model)
        return float(to_host(_mean_nll(graphdef, state, placed["tokens"], placed.get("slots"))))

    clean = math.exp(mean_nll(tokens))
    out = {"clean_ppl": clean, "delta_ppl": {}}
    b, t = tokens.shape
    for mi, mode in enumerate(perturb.MODES):
        for gi, gamma in enumerate(gammas):
            for li, l_max in enumerate(l_maxes):
                rng = np.random.default_rng([seed, mi, gi, li])
                if mode == "text":
                    order = perturb.draw(mode, rng, (b, t), gamma, l_max)
                    nll = mean_nll(np.take_along_axis(tokens, order, 1))
                else:
                    nll = mean_nll(tokens, perturb.draw(mode, rng, (b, t - 1), gamma, l_max))
                out["delta_ppl"][f"{mode}/{gamma}/{l_max}"] = math.exp(nll) - clean
    return out


# ---- feature shift -----------------------------------------------------------------------------

def shift_buckets(train_len: int, multiplier: int) -> list[tuple[int, int]]:
    """[lo, hi) query positions: the training range, then (1, 1.5], (1.5, 2], (2, 4], (4, 8] ...
    times the training length, up to the multiplier."""
    edges = [1.0, 1.5] + [2.0 ** e for e in range(1, int(math.log2(multiplier)) + 1)]
    edges = [e for e in edges if e <= multiplier]
    return [(0, train_len)] + [(int(a * train_len), int(b * train_len)) for a, b in zip(edges, edges[1:])]


def feature_shift(model, config, tokens, dims: int = 16, traces: int = 0) -> dict:
    """KL(attention outputs in a bucket || within the training length) per layer, and the mean
    next-token NLL (log-perplexity) per bucket, on windows tokens [B, T + 1].

    The reference is the outputs at positions [0, L_train) of the first half of the windows;
    every bucket, and the control (positions [0, L_train) again), comes from the other half,
    so the control KL is the floor that sampling alone gives. Outputs are projected on the
    reference's top `dims` principal directions first: a full-covariance fit in d_model
    dimensions from a few hundred samples is mostly estimation bias (about d^2 / 2n).

    With `traces` > 0 (schemes without per-token features), also 'pca' per layer, the paper's
    Figure 6 on the reference's top two principal directions: 'cloud', the reference outputs;
    'beyond', the outputs in the last bucket; 'traces', `traces` queries of the first compared
    window each attending to the sliding key/value windows [i, i + L_train) of that window
    (`window_outputs`), i every L_train / 4 tokens. At most PCA_POINTS points per cloud.
    """
    train_len, t = config.seq_len, tokens.shape[1] - 1
    buckets = shift_buckets(train_len, t // train_len)
    half = tokens.shape[0] // 2
    if half < 1:
        raise ValueError("the feature shift needs at least 2 windows (--shift_windows)")
    placed = place_windows({"tokens": tokens}, model)["tokens"]
    layers = attention_internals(model, placed[:, :-1], rng=jax.random.key(0), maps=False)
    impl = eval_impl(config.model.attention_impl, t, config.eval.blockwise_from)
    nll, _ = token_nll(model, placed, impl=impl, rng=jax.random.key(0))
    out = {"buckets": buckets, "dims": dims,
           "log_ppl": [float(to_host(nll[half:, lo:hi].mean())) for lo, hi in buckets],
           "kl": [], "kl_control": []}
    for i, layer in enumerate(layers):
        o = to_host(layer["out"]).astype(np.float64)
        ref = o[:half, :train_len].reshape(-1, o.shape[-1])
        basis = np.linalg.svd(ref - ref.mean(0), full_matrices=False)[2][:dims].T  # [d_model, dims]
        kl = lambda x: float(lp.gaussian_kl(jnp.asarray(x @ basis), jnp.asarray(ref @ basis)))  # noqa: E731
        out["kl"].append([kl(o[half:, lo:hi]) for lo, hi in buckets[1:]])
        out["kl_control"].append(kl(o[half:, :train_len]))
        if traces:
            plane = lambda x: np.round((x.reshape(-1, x.shape[-1]) - ref.mean(0)) @ basis[:, :2], 4)  # noqa: E731
            queries = np.linspace(train_len, t - 1, traces).astype(int)
            outputs = to_host(window_outputs(model.blocks[i].attn, layer, half, queries, train_len)).astype(np.float64)
            lo, hi = buckets[-1]
            out.setdefault("pca", []).append({
                "cloud": plane(ref)[:PCA_POINTS].tolist(), "beyond": plane(o[half:, lo:hi])[:PCA_POINTS].tolist(),
                "queries": queries.tolist(), "traces": [plane(x).tolist() for x in outputs]})
    return out


PCA_POINTS = 512


def window_outputs(attn, layer: dict, row: int, queries, length: int) -> jax.Array:
    """The attention sublayer's output for the query of each position in `queries` (of window
    `row`) attending, under the layer's own scheme, to the keys and values of the same window at
    [i, i + length), at distances length - 1 .. 0, for i = 0, length / 4, ... (the paper's
    Figure 6): [len(queries), windows, d_model]. `layer` is attention_internals' record."""
    q, k, v = (layer[name][row] for name in ("q", "k", "v"))
    starts = np.arange(0, k.shape[0] - length + 1, max(1, length // 4))
    rows = np.repeat(np.asarray(queries), len(starts))  # query-major: [queries x windows]
    window = np.tile(starts, len(queries))[:, None] + np.arange(length)  # [rows, length] key indices
    positions = jnp.broadcast_to(jnp.arange(length), window.shape)
    out = attn.scheme.attend(jnp.broadcast_to(q[rows][:, None], (len(rows), length, *q.shape[1:])), k[window],
                             v[window], positions=positions)[:, -1]  # the query sits at the last slot
    return attn.o(out.reshape(len(queries), len(starts), -1))


# ---- running and reporting ---------------------------------------------------------------------

PARTS = ("decompositions", "perturbations", "feature_shift")


def analyze_runs(runs, *, parts=PARTS, untrained=False, length=0, windows=4, gammas=(0.01, 0.05, 0.1, 0.5),
                 l_maxes=(5, 10, 100), perturb_windows=8, shift_multiplier=8, shift_windows=8,
                 log=print) -> tuple[dict, dict]:
    """(results, maps) of the `parts` (of PARTS) on every run (workdirs or `lab.runs.Run`s),
    each loaded once: results JSON-ready per run; maps the arrays the map plots need. Every
    part takes the same options and uses its own, so that "analysis" and its parts share them."""
    results = {"runs": {}}
    if "perturbations" in parts:
        results.update(gammas=list(gammas), l_maxes=list(l_maxes))
    maps = {}
    for name, run in named_runs(runs, untrained):
        start = time.perf_counter()
        config, model = run.config, run.model
        if config.model.get("mixer", "attention") != "attention":
            log(f"skipping {name}: mixer {config.model.mixer!r} has no attention to analyse")
            continue
        train_len = config.seq_len
        rec = {**run.identity(), "train_len": train_len}
        if "decompositions" in parts:
            rec.update(length=length or train_len, windows=windows)
            check_memory(config, "the logit decompositions", rec["length"], 1, DECOMPOSITION_MAPS,
                         "analyze.py --length")
            rec["layers"], maps[name] = decompose(model, held_out_windows(config, windows, rec["length"]),
                                                  train_len)
        if "perturbations" in parts:
            rec["perturbation"] = perturbation_grid(
                model, held_out_windows(config, perturb_windows, train_len + 1), gammas, l_maxes)
        if "feature_shift" in parts:
            tokens = held_out_windows(config, shift_windows, shift_multiplier * train_len + 1)
            rope = config.model.scheme == "rope"
            rec["feature_shift"] = feature_shift(model, config, tokens, traces=3 if rope else 0)
            if rope:  # Table 2's other row: the same parameters under LM-Infinite (window: train_len)
                lm = with_scheme(run, "rope_lm_infinite").model
                options = {key: getattr(lm.blocks[0].attn.scheme, key) for key in ("window", "global_tokens")}
                rec["feature_shift"]["lm_infinite"] = {**options, **feature_shift(lm, config, tokens)}
        rec["seconds"] = time.perf_counter() - start
        results["runs"][name] = rec
        log(f"analysed {name} in {rec['seconds']:.0f} s")
    return results, maps


# The logit decompositions' peak in float32 attention maps of one window's heads [H, T, T],
# whatever the layers and windows (`decompose` streams them): one window's logits and its fake-
# distance logits, one head's fits. Peak RSS on CPU over the step, compiled (4 layers, 16 heads):
# 4.9 maps at T 512 with 2 windows, 4.6 at 768 with 1, 7.2 at 768 with 2, 5.7 at 1,024 with 2 (before:
# 2 per layer and window plus 15, e.g. 30.7 at 512 with 2 windows).
DECOMPOSITION_MAPS = 8


def plan(workdir: str, *, length: int = 0, **load) -> str:
    """analyze.py --dry_run: one line, from a run's config.json alone (nothing read), saying
    whether the logit decompositions fit in this host's available memory with the parameters
    (`load`: `lab.runs.load_run`'s options) and, where they do not, the longest length that does."""
    config, _, _, params = abstract_run(workdir, **load)
    length = length or config.seq_len
    weights = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params))
    maps, have = maps_bytes(config, length, 1, DECOMPOSITION_MAPS), available_memory()
    gib = lambda b: f"{b / 2 ** 30:,.1f} GiB"  # noqa: E731
    head = (f"{workdir}: the logit decompositions at length {length:,} need about {gib(weights + maps)} "
            f"({gib(weights)} of parameters, {gib(maps)} of float32 attention maps, one window's at a time) of "
            f"the {gib(have)} available")
    if weights + maps <= have:
        return f"{head}: they fit"
    longest = math.isqrt(max(0, have - weights) // maps_bytes(config, 1, 1, DECOMPOSITION_MAPS))
    return f"{head}: they do not fit; the longest length that does is {longest:,} (analyze.py --length)"


def flag_options(*, length, windows, gammas, l_max, perturb_windows, shift_multiplier, shift_windows) -> dict:
    """analyze.py's flags as `analyze_runs` options; a bad one is a ValueError, one line naming
    the flag, why, and the valid range."""
    if shift_multiplier < 2 or shift_multiplier & (shift_multiplier - 1):
        raise ValueError(f"--shift_multiplier={shift_multiplier} must be a power of two >= 2; valid: 2, 4, 8, ... "
                         "(feature-shift windows in training lengths)")
    return dict(
        length=checked("--length", length, 0, meaning="window length of the decompositions; 0: the training length"),
        windows=checked("--windows", windows, 1, meaning="held-out windows for the decompositions"),
        gammas=checked_list("--gammas", gammas, 0, 1, kind=float, meaning="perturbation ratios"),
        l_maxes=checked_list("--l_max", l_max, 1, meaning="perturbation ranges in tokens"),
        perturb_windows=checked("--perturb_windows", perturb_windows, 1, meaning="windows for the perturbations"),
        shift_multiplier=shift_multiplier,
        shift_windows=checked("--shift_windows", shift_windows, 2,
                              meaning="windows for the feature shift, split into reference and compared halves"))


def _spread(values) -> str:
    v = np.ravel(values)
    return f"{v.mean():.3f} ({v.min():.3f} / {v.max():.3f})"


def summary_table(results: dict) -> str:
    lines = ["| run | scheme | 3-axis r: mean (min / max) | 3-axis R^2 | chance r | fake-distance r: mean "
             "(min / max) | fake R^2 | f+g r, slow pairs 1 / 2 / 4 |", "|---|---|---|---|---|---|---|---|"]
    for name, run in results["runs"].items():
        ls = run["layers"]
        fg = "-"
        if "fg_r_1" in ls[0]:
            fg = " / ".join(f"{np.mean([layer[f'fg_r_{m}'] for layer in ls]):.3f}" for m in SLOW_PAIRS)
        lines.append(f"| {name} | {run['scheme']} | {_spread([layer['three_axis_r_all'] for layer in ls])} | "
                     f"{np.mean([layer['three_axis_r2'] for layer in ls]):.3f} | {ls[0]['chance']:.3f} | "
                     f"{_spread([layer['fake_r_all'] for layer in ls])} | "
                     f"{np.mean([layer['fake_r2'] for layer in ls]):.3f} | {fg} |")
    return "\n".join(lines)


def per_layer_table(results: dict) -> str:
    lines = ["| run | layer | 3-axis r per head | fake-distance r per head |", "|---|---|---|---|"]
    for name, run in results["runs"].items():
        for i, layer in enumerate(run["layers"]):
            lines.append(f"| {name} | {i} | {' '.join(f'{r:.2f}' for r in layer['three_axis_r'])} | "
                         f"{' '.join(f'{r:.2f}' for r in layer['fake_r'])} |")
    return "\n".join(lines)


def pairs_table(results: dict) -> str:
    """Observation 1 for RoPE runs, per layer and head: how much of the mean key's energy sits
    in the slow pairs (theta_r L_train < pi), and the statistics of its most prominent pair."""
    keys = ("rotation", "kbar_share", "coherence", "deviation", "theta_delta")
    lines = ["| run | layer | head | kbar energy in slow pairs | top pair | " + " | ".join(keys) + " |",
             "|---|---|---|---|---|" + "---|" * len(keys)]
    for name, run in results["runs"].items():
        for i, layer in enumerate(run["layers"]):
            pr = {key: np.asarray(x) for key, x in layer.get("pairs", {}).items()}
            for h in range(len(pr.get("rotation", []))):
                top = int(pr["kbar_share"][h].argmax())
                slow = pr["kbar_share"][h][pr["rotation"][h] < math.pi].sum()
                lines.append(f"| {name} | {i} | {h} | {slow:.3f} | {top} | "
                             + " | ".join(f"{pr[key][h][top]:.3f}" for key in keys) + " |")
    return "\n".join(lines)


def perturbation_table(results: dict, mode: str) -> str:
    cells = [(g, r) for g in results["gammas"] for r in results["l_maxes"]]
    head = "| run | clean ppl | " + " | ".join(f"{g} / {r}" for g, r in cells) + " |"
    lines = [head, "|---|---|" + "---|" * len(cells)]
    for name, run in results["runs"].items():
        p = run["perturbation"]
        lines.append(f"| {name} | {p['clean_ppl']:.3f} | "
                     + " | ".join(f"{p['delta_ppl'][f'{mode}/{g}/{r}']:+.3f}" for g, r in cells) + " |")
    return "\n".join(lines)


def shift_rows(results: dict) -> list[tuple[str, dict, int]]:
    """(label, feature-shift record, training length) of every run, each RoPE run followed by
    its LM-Infinite arm (the paper's Table 2 rows)."""
    rows = []
    for name, run in results["runs"].items():
        s = run["feature_shift"]
        rows.append((name, s, run["train_len"]))
        if "lm_infinite" in s:
            lm = s["lm_infinite"]
            rows.append((f"{name} + LM-Infinite (window {lm['window']}, {lm['global_tokens']} starting tokens)",
                         lm, run["train_len"]))
    return rows


def shift_table(results: dict) -> str:
    first = next(iter(results["runs"].values()))["feature_shift"]["buckets"]
    names = [f"{lo}-{hi}" for lo, hi in first]
    lines = ["| run | control KL | " + " | ".join(f"KL {b}" for b in names[1:]) + " | "
             + " | ".join(f"log-ppl {b}" for b in names) + " |",
             "|---|---|" + "---|" * (2 * len(names) - 1)]
    for name, s, _ in shift_rows(results):
        kl = np.mean(s["kl"], axis=0)  # mean over layers
        cells = [f"{np.mean(s['kl_control']):.3f}"] + [f"{x:.3f}" for x in (*kl, *s["log_ppl"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name)


def plot_maps(name: str, maps: list[dict], out: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(maps), 4, figsize=(13, 3.1 * len(maps)), squeeze=False)
    titles = ("logits", "3-axis fit", "fake-distance W' (d x key)", "a_d + b_j")
    for row, m in zip(axes, maps):
        causal = np.tril(np.ones_like(m["logits"], bool))
        shown = [np.where(causal, m["logits"], np.nan), np.where(causal, m["three_axis"], np.nan),
                 m["fake"], m["fake_fit"]]
        for ax, x, title in zip(row, shown, titles):
            lo, hi = np.nanpercentile(x, [1, 99])
            ax.imshow(x, cmap="viridis", vmin=lo, vmax=hi, interpolation="nearest")
            ax.set_title(title, fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
    for i, row in enumerate(axes):
        row[0].set_ylabel(f"layer {i}, head 0")
    fig.suptitle(f"{name}: window 0", fontsize=9)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, f"maps_{_slug(name)}.png"), dpi=100)
    plt.close(fig)


def plot_curves(name: str, run: dict, out: str) -> None:
    plt = pyplot()
    layers = run["layers"]
    fig, axes = plt.subplots(2, len(layers), figsize=(3.6 * len(layers), 5.5), squeeze=False)
    for i, layer in enumerate(layers):
        for row, key, label in ((0, "fake_a", "fake-distance a_d - a_0"), (1, "three_axis_a", "3-axis a_d")):
            for h, curve in enumerate(np.asarray(layer[key])):
                axes[row, i].plot(curve - (curve[0] if row == 0 else 0), lw=1, label=f"head {h}")
            axes[row, i].set(title=f"layer {i}", xlabel="distance d", ylabel=label)
            axes[row, i].grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{name}: positional curves (mean over windows)", fontsize=9)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, f"curves_{_slug(name)}.png"), dpi=100)
    plt.close(fig)


def plot_perturbation(results: dict, out: str) -> None:
    plt = pyplot()
    names, g, lm = list(results["runs"]), results["gammas"], results["l_maxes"]
    fig, axes = plt.subplots(len(names), 3, figsize=(10, 2.4 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        d = results["runs"][name]["perturbation"]["delta_ppl"]
        for ax, mode in zip(row, perturb.MODES):
            grid = np.array([[d[f"{mode}/{x}/{y}"] for x in g] for y in lm])
            im = ax.imshow(grid, cmap="magma", origin="lower", aspect="auto")
            for (r, c), v in np.ndenumerate(grid):
                ax.text(c, r, f"{v:.2f}", ha="center", va="center", fontsize=6, color="cyan")
            ax.set_xticks(range(len(g)), [str(x) for x in g], fontsize=7)
            ax.set_yticks(range(len(lm)), [str(y) for y in lm], fontsize=7)
            ax.set_title(f"{name}: {mode}", fontsize=8)
            fig.colorbar(im, ax=ax)
        row[0].set_ylabel("l_max")
    for ax in axes[-1]:
        ax.set_xlabel("gamma")
    fig.suptitle("change in perplexity", fontsize=9)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, "perturbation.png"), dpi=100)
    plt.close(fig)


def plot_shift(results: dict, out: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, s, train_len) in enumerate(shift_rows(results)):
        centres = [(lo + hi) / 2 / train_len for lo, hi in s["buckets"]]
        style = {"marker": "o", "label": name, "color": plt.cm.tab20(i % 20), "ls": ("-", "--")[i // 20 % 2]}
        # The first point is the control: within-length outputs of other documents.
        axes[0].plot(centres, [np.mean(s["kl_control"]), *np.mean(s["kl"], axis=0)], **style)
        axes[1].plot(centres, s["log_ppl"], **style)
    axes[0].set(xlabel="bucket centre / training length", yscale="log",
                ylabel="KL to within-length outputs (layer mean)\nfirst point: the control")
    axes[1].set(xlabel="bucket centre / training length", ylabel="log-perplexity")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, "feature_shift.png"), dpi=120)
    plt.close(fig)


def plot_pca(name: str, pca: list[dict], out: str) -> None:
    """The paper's Figure 6 per layer: in-length outputs as a cloud, those past the training
    length, and each query's outputs over sliding windows as a trace."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(pca), figsize=(4.2 * len(pca), 4), squeeze=False)
    for i, (ax, layer) in enumerate(zip(axes[0], pca)):
        ax.scatter(*np.asarray(layer["cloud"]).T, s=3, alpha=0.3, color="tab:blue", label="within the training length")
        ax.scatter(*np.asarray(layer["beyond"]).T, s=3, alpha=0.3, color="tab:gray", label="last bucket (vanilla)")
        for t, trace in zip(layer["queries"], layer["traces"]):
            ax.plot(*np.asarray(trace).T, "--", marker=".", lw=1, label=f"query {t} over sliding windows")
        ax.set(title=f"layer {i}", xlabel="PC 1", ylabel="PC 2")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(f"{name}: attention outputs on the top two principal directions of the in-length ones", fontsize=9)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, f"pca_{_slug(name)}.png"), dpi=100)
    plt.close(fig)


def decompositions_section(results: dict, maps: dict, out: str) -> list[str]:
    for name, run in results["runs"].items():
        plot_maps(name, maps[name], out)
        plot_curves(name, run, out)
    return ["## Logit decompositions (r over layers x heads x windows)", summary_table(results),
            "## Per layer (mean over windows)", per_layer_table(results),
            "## Observation 1 (RoPE heads, pooled per layer)", pairs_table(results)]


def perturbations_section(results: dict, maps: dict, out: str) -> list[str]:
    plot_perturbation(results, out)
    return [text for mode in perturb.MODES
            for text in (f"## Perturbation '{mode}': change in perplexity, columns gamma / l_max",
                         perturbation_table(results, mode))]


def feature_shift_section(results: dict, maps: dict, out: str) -> list[str]:
    plot_shift(results, out)
    for name, run in results["runs"].items():
        if "pca" in run["feature_shift"]:
            plot_pca(name, run["feature_shift"]["pca"], out)
    return ["## Feature shift: KL of attention outputs to those within the training length "
            "(layer mean), and log-perplexity per query-position bucket", shift_table(results)]


SECTIONS = {"decompositions": decompositions_section, "perturbations": perturbations_section,
            "feature_shift": feature_shift_section}  # part -> writes its plots, returns its markdown


def write_analysis(results: dict, maps: dict, out: str, parts=PARTS, stem: str = "analysis") -> str:
    """<stem>.json, <stem>.md and the plots of the `parts`; returns the markdown."""
    provenance.write_results(files.join(out, f"{stem}.json"), results, indent=1)
    if not results["runs"]:  # every run skipped (no attention): nothing to tabulate or plot
        parts = ()
    md = "\n\n".join(text for part in parts for text in SECTIONS[part](results, maps, out)) + "\n"
    files.write_text(files.join(out, f"{stem}.md"), md)
    return md


def report(outcome: tuple[dict, dict], out: str, parts=PARTS, stem: str = "analysis") -> str:
    """The evaluator's report: `write_analysis` of what `analyze_runs` returned."""
    results, maps = outcome
    return write_analysis(results, maps, out, parts, stem)


SCALARS = {  # part -> the training log's scalars of one run's record
    "decompositions": lambda run: {
        "three_axis_r": float(np.mean([layer["three_axis_r"] for layer in run["layers"]])),
        "fake_r": float(np.mean([layer["fake_r"] for layer in run["layers"]]))},
    "perturbations": lambda run: {
        "clean_ppl": run["perturbation"]["clean_ppl"],
        "delta_ppl_max": max(run["perturbation"]["delta_ppl"].values())},
    "feature_shift": lambda run: {
        "kl_farthest": float(np.mean(run["feature_shift"]["kl"], axis=0)[-1]),
        "log_ppl_farthest": run["feature_shift"]["log_ppl"][-1]},
}


def summary(outcome: tuple[dict, dict], parts=PARTS) -> dict:
    """The training log's scalars of the first run: the mean 3-axis and fake-distance r, the
    clean perplexity and the largest change under a perturbation, the layer-mean KL and the
    log-perplexity of the farthest bucket (those of the `parts`)."""
    run = next(iter(outcome[0]["runs"].values()), None)  # None: no run with attention to analyse
    return {key: value for part in parts for key, value in SCALARS[part](run).items()} if run else {}
