"""Diagnostics of trained runs on held-out text: the transport probes (attention mass by
distance, far mass; spectral gap and route decay of the steps for schemes that have them;
value cancellation) and the near-minus-far logit differences (the TAPA paper's Figure 1).
Each is an evaluator (lab/evaluators.py): a `..._runs` function and its report.

Of several processes, each computes the layers of its own windows where the windows divide
evenly among the batch shards, else every process all of them (`distributed.place_windows`:
the probes are statistics over all the windows, which padding rows would change); results
reach every process's host through `distributed.to_host`."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from lab import files, provenance
from lab.distributed import place_windows, to_host
from lab.runs import held_out_windows, named_runs, pyplot
from models.lm import attention_internals
from positional.probes import transport
from positional.probes.logits import near_far_differences


ROUTE_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


# ---- memory: refuse a length whose attention maps cannot fit, before computing them -------------

def available_memory() -> int:
    """Bytes free for the probes' arrays: the accelerator's limit less what is in use, where JAX
    reports them (this process's first device); on the host, /proc/meminfo's MemAvailable, else
    the physical memory."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"] - stats.get("bytes_in_use", 0)
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def maps_bytes(config, length: int, windows: int, maps: int) -> int:
    """Bytes of `maps` float32 attention maps [windows, heads, length, length]."""
    return maps * windows * config.model.num_heads * length ** 2 * 4


def check_memory(config, what: str, length: int, windows: int, maps: int, lower: str) -> None:
    """Refuse `what` (ValueError, one line) where its peak, `maps` float32 attention maps
    [windows, heads, length, length] (measured on CPU: what it keeps for every layer, plus its
    temporaries), exceeds `available_memory()`; `lower` names what to lower."""
    heads = config.model.num_heads
    need, have = maps_bytes(config, length, windows, maps), available_memory()
    if need > have:
        of = f"{windows} window{'s' if windows > 1 else ''} x {heads} heads x {length} x {length}"
        raise ValueError(f"{what} at length {length}: about {need / 2**30:,.1f} GiB ({maps} float32 attention maps "
                         f"of {of}), more than the {have / 2**30:,.1f} GiB available; lower {lower}")


def probe_runs(runs, *, length: int, windows: int = 2, log=print) -> dict:
    """The transport probes (positional/probes/transport.py) on held-out text, per run and layer.

    Attention-mass probes apply to every scheme; the spectral gap, route decay and value
    cancellation to schemes whose class lists the "angles" probes (step angles: features 'psi',
    'theta'); the spectral gap (per kv head) and route decay (routes up to 128 steps) to those
    listing "householder" (features 'w', 'beta').
    """
    results = {"length": length, "windows": windows, "runs": {}}
    for name, run in named_runs(runs):
        config, model = run.config, run.model
        # Every layer's logits and weights, and the probes' temporaries (peak RSS on CPU, in maps:
        # 6.0 with 2 layers, 9.9 with 4).
        check_memory(config, "the transport probes", length, windows, 2 * config.model.num_layers + 2,
                     "the probe length (eval.py --probe_length; the transport option length)")
        tokens = place_windows({"tokens": held_out_windows(config, windows, length)}, model)["tokens"]
        far_windows = sorted({max(1, config.seq_len // 4), config.seq_len,
                              min(4 * config.seq_len, length // 2)})
        layers = []
        for i, layer in enumerate(attention_internals(model, tokens, rng=jax.random.key(0))):
            w, feats = layer["weights"], layer["features"]
            rec = {"far_mass": {n: float(to_host(transport.far_mass(w, n))) for n in far_windows},
                   "mass_by_distance": to_host(transport.mass_by_distance(w)).tolist()}
            scheme = model.blocks[i].attn.scheme
            if "angles" in scheme.probes:
                lengths = [n for n in ROUTE_LENGTHS if n < length]
                decay = transport.route_decay(feats["theta"], lengths)
                v = jnp.repeat(layer["v"], w.shape[1] // layer["v"].shape[2], axis=2)  # per query head
                cancel = transport.value_cancellation(w, v, feats["theta"], config.seq_len,
                                                      scheme.layout)
                rec.update(spectral_gap=to_host(transport.spectral_gap(feats["psi"])).tolist(),
                           route_decay={n: float(to_host(d.max())) for n, d in zip(lengths, decay)},
                           value_ratio=float(to_host(cancel["ratio"])))
            elif "householder" in scheme.probes:
                lengths = [n for n in ROUTE_LENGTHS if n < min(length, 129)]
                decay = transport.householder_route_decay(feats["w"], feats["beta"], lengths)
                gap = transport.householder_spectral_gap(feats["w"], feats["beta"])
                rec.update(spectral_gap=to_host(gap).tolist(),
                           route_decay={n: float(to_host(d.max())) for n, d in zip(lengths, decay)})
            layers.append(rec)
        results["runs"][name] = {**run.identity(), "train_len": config.seq_len, "layers": layers}
        log(f"probed {name}")
    return results


def probe_summary(results: dict) -> dict:
    """The training log's scalar for the first run: the far mass over its widest window (layer mean)."""
    layers = next(iter(results["runs"].values()))["layers"]
    widest = max(layers[0]["far_mass"])
    return {f"far_mass_{widest}": float(np.mean([rec["far_mass"][widest] for rec in layers]))}


def probe_report(results: dict, out: str) -> str:
    """probes.json, probes.md (one row per run and layer) and probes.png."""
    plt = pyplot()
    provenance.write_results(files.join(out, "probes.json"), results, indent=2)
    lines = ["| run | layer | far mass (window: mass) | spectral gap min / median | "
             "norm of E[P_n], n = 16 / 128 | far value norm, transported / identity |",
             "|---|---|---|---|---|---|"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in results["runs"].items():
        for i, rec in enumerate(run["layers"]):
            far = ", ".join(f"{n}: {m:.3f}" for n, m in rec["far_mass"].items())
            gap = decay = ratio = "-"
            if "spectral_gap" in rec:
                g = np.asarray(rec["spectral_gap"])
                gap = f"{g.min():.3f} / {np.median(g):.3f}"
                decay = " / ".join(f"{rec['route_decay'].get(n, float('nan')):.3f}" for n in (16, 128))
                ratio = f"{rec['value_ratio']:.3f}" if "value_ratio" in rec else "-"
            lines.append(f"| {name} | {i} | {far} | {gap} | {decay} | {ratio} |")
        mass = np.mean([rec["mass_by_distance"] for rec in run["layers"]], axis=0)
        axes[0].loglog(np.arange(1, len(mass)), mass[1:], label=name)
        decays = [rec["route_decay"] for rec in run["layers"] if "route_decay" in rec]
        if decays:
            n = sorted(decays[0], key=int)
            axes[1].semilogx([int(k) for k in n], np.mean([[d[k] for k in n] for d in decays], axis=0),
                             marker="o", label=name)
    axes[0].set(xlabel="distance i - j", ylabel="mean attention weight (layer mean)")
    axes[1].set(xlabel="route length n", ylabel="||E[P_n]||_op (layer mean)")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, "probes.png"), dpi=120)
    plt.close(fig)
    table = (f"Transport probes on {results['windows']} held-out windows of {results['length']} tokens; "
             "far mass over queries past the window.\n\n" + "\n".join(lines) + "\n")
    files.write_text(files.join(out, "probes.md"), table)
    return table


# ---- near-minus-far logit differences (the TAPA paper's Figure 1) -------------------------

def near_far_ranges(field: str, texts, length: int) -> dict:
    """{'near': (lo, hi), 'far': (lo, hi)} from the two distance ranges 'lo:hi' of a list flag;
    else ValueError, one line naming the field, why, and the valid range: 0 <= lo < hi <= length."""
    valid = f"valid: two distance ranges lo:hi,lo:hi (near, then far), integers with 0 <= lo < hi <= {length}"
    if len(texts) != 2:
        raise ValueError(f"{field}={','.join(texts)} has {len(texts)} ranges; {valid}")
    ranges = []
    for text in texts:
        lo, _, hi = text.partition(":")
        try:
            lo, hi = int(lo), int(hi)
        except ValueError:
            raise ValueError(f"{field}={','.join(texts)}: {text!r} is not two integers lo:hi; {valid}") from None
        if not 0 <= lo < hi <= length:
            why = ("is negative" if lo < 0 else "is empty (lo >= hi)" if lo >= hi
                   else f"reaches past the probe length {length}")
            raise ValueError(f"{field}={','.join(texts)}: {text!r} {why}; {valid}")
        ranges.append((lo, hi))
    return {"near": ranges[0], "far": ranges[1]}


def near_far_runs(runs, *, length: int, near, far, pairs: int = 10000, windows: int = 2,
                  log=print) -> dict:
    """Per run: `pairs` samples of logit(i, i - lam) - logit(i, i - Lam), lam in `near`, Lam in
    `far`, pooled over layers, heads and held-out windows of `length` tokens."""
    results = {"length": length, "near": list(near), "far": list(far), "runs": {}}
    for name, run in named_runs(runs):
        config, model = run.config, run.model
        # Every layer's logits and weights, then their stack and its log (peak RSS on CPU, in maps:
        # 6.1 with 2 layers, 12.6 with 4).
        check_memory(config, "the near_far probe", length, windows, 3 * config.model.num_layers + 1,
                     "the probe length (eval.py --probe_length; the near_far option length)")
        tokens = place_windows({"tokens": held_out_windows(config, windows, length)}, model)["tokens"]
        weights = jnp.stack([layer["weights"] for layer in attention_internals(model, tokens,
                                                                               rng=jax.random.key(0))])
        diffs = to_host(near_far_differences(jnp.log(weights), near, far, pairs, jax.random.key(1)))
        diffs = diffs[np.isfinite(diffs)]  # a weight that underflowed to 0 has no finite log
        results["runs"][name] = {**run.identity(), "mean": float(diffs.mean()), "std": float(diffs.std()),
                                 "n": int(diffs.size), "diffs": diffs.tolist()}
        log(f"{name}: mean {diffs.mean():.3f} std {diffs.std():.3f} over {diffs.size} pairs")
    return results


def near_far_summary(results: dict) -> dict:
    """The training log's scalars for the first run: the differences' mean and spread."""
    run = next(iter(results["runs"].values()))
    return {"mean": run["mean"], "std": run["std"]}


def near_far_report(results: dict, out: str) -> str:
    """near_far.json, near_far.md and near_far.png (one histogram per run)."""
    plt = pyplot()
    provenance.write_results(files.join(out, "near_far.json"), results)
    near, far = results["near"], results["far"]
    fig, ax = plt.subplots(figsize=(6, 4))
    lines = ["| run | mean | std | pairs |", "|---|---|---|---|"]
    for name, run in results["runs"].items():
        ax.hist(run["diffs"], bins=80, alpha=0.5, density=True,
                label=f"{name}: mean {run['mean']:.2f}, std {run['std']:.2f}")
        lines.append(f"| {name} | {run['mean']:.3f} | {run['std']:.3f} | {run['n']} |")
    ax.set(xlabel=f"logit(lam) - logit(Lam), lam in [{near[0]}, {near[1]}), Lam in [{far[0]}, {far[1]})",
           ylabel="density")
    ax.legend(fontsize=7)
    fig.tight_layout()
    files.save_figure(fig, files.join(out, "near_far.png"), dpi=120)
    plt.close(fig)
    table = (f"Near-minus-far logit differences on windows of {results['length']} tokens, pooled over "
             "layers and heads.\n\n" + "\n".join(lines) + "\n")
    files.write_text(files.join(out, "near_far.md"), table)
    return table
