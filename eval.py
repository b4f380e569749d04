"""The shared eval loop: perplexity of held-out text at many lengths, for one or several runs.

    python eval.py --workdirs=runs/rope,runs/alibi --out=runs/compare --max_multiplier=16

For every length L (multiples of each run's training length) the same N target tokens of the
held-out stream are scored, in windows of L tokens (non-overlapping, or sliding with a
stride, where each window scores only the tokens the previous one did not). A run trained on
a synthetic task (`data.tasks`) is scored instead by exact match on the answers of its test
split, overall and by lag. Writes `results.json`, `results.md` (perplexity and ratio
ppl(L) / ppl(train length); task accuracy), `results.png` and, for task runs, `tasks.png`
into --out.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags
from flax import nnx

from models.lm import DecoderLM, token_nll


def eval_lengths(train_len: int, multipliers) -> list[int]:
    return sorted({max(1, int(round(m * train_len))) for m in multipliers})


def scoring_plan(n_tokens: int, length: int, stride: int):
    """Windows that together score targets 1..N of the stream exactly once.

    Returns (starts [W], first_scored [W]): window w reads stream[start : start + length + 1]
    and scores its targets from index first_scored on. N = n_tokens rounded up to a whole
    number of windows (non-overlapping) or strides (sliding).
    """
    if stride <= 0 or stride >= length:
        n_windows = max(1, -(-n_tokens // length))
        return np.arange(n_windows) * length, np.zeros(n_windows, np.int64)
    n_extra = max(0, -(-(n_tokens - length) // stride))
    starts = np.arange(n_extra + 1) * stride
    first = np.where(starts == 0, 0, length - stride)
    return starts, first


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def _window_nll(graphdef, state, tokens, first_scored, rng, impl):
    model = nnx.merge(graphdef, state)
    nll, _ = token_nll(model, tokens, impl=impl, rng=rng)
    scored = jnp.arange(nll.shape[1])[None] >= first_scored[:, None]
    return jnp.sum(jnp.where(scored, nll, 0.0)), jnp.sum(scored)


def perplexity(model: DecoderLM, stream: np.ndarray, length: int, n_tokens: int, *,
               stride: int = 0, batch_size: int = 4, impl: str = "reference", seed: int = 0) -> dict:
    """Perplexity of `model` on the first ~n_tokens targets of `stream`, windows of `length`.

    Schemes with random features get a fresh draw for every batch of windows, from `seed`:
    the same draws for every model evaluated with the same seed.
    """
    starts, first = scoring_plan(n_tokens, length, stride)
    if starts[-1] + length + 1 > len(stream):
        raise ValueError(f"the held-out stream has {len(stream)} tokens; length {length} with "
                         f"{n_tokens} scored tokens needs {starts[-1] + length + 1}. Lower eval.tokens "
                         "or the largest length, or use a larger corpus")
    graphdef, state = nnx.split(model)
    total, count, t0 = 0.0, 0, time.perf_counter()
    for i in range(0, len(starts), batch_size):
        rows = np.stack([stream[s:s + length + 1] for s in starts[i:i + batch_size]])
        rng = jax.random.fold_in(jax.random.key(seed), i)
        nll, n = _window_nll(graphdef, state, jnp.asarray(rows), jnp.asarray(first[i:i + batch_size]), rng,
                             impl)
        total, count = total + float(nll), count + int(n)
    return {"length": length, "ppl": math.exp(total / count), "nll": total / count, "tokens": count,
            "seconds": time.perf_counter() - t0, "impl": impl}


def eval_impl(impl: str, length: int, blockwise_from: int) -> str:
    """The run's attention impl, except that the materialising reference gives way to blockwise
    from `blockwise_from` tokens on (a fused kernel such as TAPA's "pallas" is kept)."""
    return "blockwise" if impl == "reference" and length >= blockwise_from else impl


def perplexity_at(config, model, length, n_tokens) -> float:
    """Validation perplexity at one length with a run's own eval settings (used during training)."""
    stream = _stream(config, n_tokens + length + 1)
    impl = eval_impl(config.model.attention_impl, length, config.eval.blockwise_from)
    return perplexity(model, stream, length, n_tokens, batch_size=config.eval.batch_size, impl=impl)["ppl"]


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def _answer_stats(graphdef, state, batch, rng, impl):
    """Per row of a task batch: (answers predicted exactly, answers, summed answer nll): [B] each."""
    model = nnx.merge(graphdef, state)
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1], positions=batch["positions"][:, :-1],
                   segment_ids=batch["segment_ids"][:, :-1], impl=impl, rng=rng)
    targets, answer = tokens[:, 1:], batch["loss_mask"][:, 1:]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    correct = (jnp.argmax(logits, -1) == targets) & (answer > 0)
    return correct.sum(1), answer.sum(1), jnp.sum(nll * answer, 1)


def task_accuracy(model: DecoderLM, task, split: str, n_examples: int, *, batch_size: int = 8,
                  impl: str = "reference", seed: int = 0) -> dict:
    """Exact match (argmax over the vocabulary) on every answer token of the first `n_examples`
    of a synthetic task's `split`, overall and by the task's group (the lag for Diffuse MQAR),
    and the mean answer nll. For SymbolSoup (one answer per example) it is classification
    accuracy."""
    from data import tasks
    graphdef, state = nnx.split(model)
    stats, t0 = [], time.perf_counter()
    for i, (batch, groups) in enumerate(tasks.eval_batches(task, split, n_examples, batch_size)):
        rng = jax.random.fold_in(jax.random.key(seed), i)
        out = _answer_stats(graphdef, state, {k: jnp.asarray(v) for k, v in batch.items()}, rng, impl)
        stats.append(np.stack([*map(np.asarray, out), groups], 1))
    correct, answers, nll, groups = np.concatenate(stats).T
    by_group = {int(g): float(correct[groups == g].sum() / answers[groups == g].sum())
                for g in np.unique(groups)}
    return {"accuracy": float(correct.sum() / answers.sum()), "nll": float(nll.sum() / answers.sum()),
            "by_group": by_group, "examples": n_examples, "answers": int(answers.sum()),
            "seconds": time.perf_counter() - t0, "impl": impl}


def task_accuracy_at(config, model, split: str = "test", n_examples: int = 0) -> dict:
    """`task_accuracy` with a task run's own eval settings (all the split's examples by default)."""
    from data import tasks
    task = tasks.get_task(config.data)
    impl = eval_impl(config.model.attention_impl, task.max_len(split), config.eval.blockwise_from)
    return task_accuracy(model, task, split, n_examples or task.eval_examples,
                         batch_size=config.eval.batch_size, impl=impl)


@functools.lru_cache(maxsize=4)
def _stream_cached(data_json: str, split: str, max_tokens: int) -> np.ndarray:
    from data import pipeline
    return pipeline.eval_stream(ml_collections.ConfigDict(json.loads(data_json)), split, max_tokens)


def _stream(config, max_tokens: int) -> np.ndarray:
    return _stream_cached(config.data.to_json(), config.eval.split, max_tokens)


# ---- runs on disk --------------------------------------------------------------------------

def run_name(workdir: str, workdirs) -> str:
    """A run's name in reports: its folder name, with as many parent folders as it takes to
    tell it apart from the other runs compared (runs/a/tapa vs runs/b/tapa -> a/tapa, b/tapa)."""
    parts = lambda w: os.path.normpath(w).split(os.sep)  # noqa: E731
    for depth in range(1, len(parts(workdir)) + 1):
        name = "/".join(parts(workdir)[-depth:])
        if sum("/".join(parts(w)[-depth:]) == name for w in workdirs) == 1:
            return name
    return workdir


def _windows(config, windows: int, length: int) -> jax.Array:
    """The first `windows` held-out windows of `length` tokens: [windows, length]."""
    stream = _stream(config, windows * length + 1)
    return jnp.asarray(stream[:windows * length].reshape(windows, length))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def load_run(workdir: str, untrained: bool = False):
    """(config, model with the latest complete checkpoint's parameters, step) of a training run;
    with `untrained`, the model as its config initialises it (seed included), step 0."""
    from train import init_state, load_params, make_mesh
    path = os.path.join(workdir, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{workdir!r} is not a training run directory (no config.json); "
                                "pass the --config.workdir of a train.py run")
    with open(path) as f:
        config = ml_collections.ConfigDict(json.load(f))
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1))
    from data import pipeline
    vocab = config.model.vocab_size or pipeline.tokenizer(config.data).vocab_size
    graphdef, rest, _, _, state = init_state(config, vocab, make_mesh(config))
    if untrained:
        return config, nnx.merge(graphdef, state["params"], rest), 0
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            state["params"])
    step, params = load_params(workdir, abstract)
    return config, nnx.merge(graphdef, params, rest), step


def evaluate_runs(workdirs, *, multipliers=None, max_multiplier=None, tokens=None, stride=None,
                  log=print) -> dict:
    """Evaluate every run at the same lengths (multiples of the first LM run's training length);
    a run trained on a synthetic task gets its task accuracy on the test split instead."""
    from data import tasks
    runs = [(w, *load_run(w)) for w in workdirs]
    lm_runs = [r for r in runs if not tasks.is_task(r[1].data)]
    base = (lm_runs or runs)[0][1]
    ev = base.eval
    multipliers = list(multipliers or ev.multipliers)
    if max_multiplier:
        multipliers = [m for m in multipliers if m <= max_multiplier]
        m = max(multipliers) * 2
        while m <= max_multiplier:
            multipliers.append(m)
            m *= 2
    lengths = eval_lengths(base.seq_len, multipliers)
    tokens = tokens or ev.tokens
    stride = ev.stride if stride is None else stride
    stream = _stream(base, tokens + max(lengths) + 1 + max(lengths)) if lm_runs else None
    results = {"lengths": lengths, "tokens": tokens, "stride": stride, "runs": {}}
    for workdir, config, model, step in runs:
        name = run_name(workdir, workdirs)
        if tasks.is_task(config.data):
            r = task_accuracy_at(config, model, n_examples=config.eval.get("task_examples", 0))
            log(f"{name:>16s}  {config.data.name} accuracy {r['accuracy']:.4f}  ({r['seconds']:.1f}s)")
            results["runs"][name] = {"workdir": workdir, "step": step, "scheme": config.model.scheme,
                                     "mixer": config.model.get("mixer", "attention"),
                                     "model": _model_name(config), "task": config.data.name,
                                     "train_len": config.seq_len, "task_results": r}
            continue
        rows = []
        for length in lengths:
            impl = eval_impl(config.model.attention_impl, length, ev.blockwise_from)
            # Past blockwise_from, fewer rows per call keep activation memory about constant.
            n_rows = max(1, min(ev.batch_size, ev.batch_size * ev.blockwise_from // length))
            r = perplexity(model, stream, length, tokens, stride=stride, batch_size=n_rows, impl=impl)
            rows.append(r)
            log(f"{name:>16s}  L={length:>6d}  ppl={r['ppl']:9.3f}  ({r['seconds']:.1f}s, {impl})")
        train_ppl = next((r["ppl"] for r in rows if r["length"] == config.seq_len), None)
        for r in rows:
            r["ratio"] = r["ppl"] / train_ppl if train_ppl else None
        results["runs"][name] = {"workdir": workdir, "step": step, "scheme": config.model.scheme,
                                 "model": _model_name(config), "train_len": config.seq_len,
                                 "results": rows}
    return results


def _model_name(config) -> str:
    """The position scheme of the decoder block, or the mixer of a Sessa macro-block (not every
    mixer uses the scheme; results.json has both)."""
    mixer = config.model.get("mixer", "attention")
    return config.model.scheme if mixer == "attention" else mixer


def _runs(results: dict, *, task: bool) -> dict:
    """The runs evaluated on a synthetic task (task=True) or by perplexity (task=False)."""
    return {name: run for name, run in results["runs"].items() if ("task_results" in run) == task}


def task_table(results: dict) -> str:
    """One row per task run: accuracy on the test split, and by lag where the task has lags."""
    runs = _runs(results, task=True)
    # SymbolSoup has the one group 0; Diffuse MQAR one per test lag.
    groups = sorted({g for run in runs.values() for g in run["task_results"]["by_group"]
                     if list(run["task_results"]["by_group"]) != [0]})
    head = "| run | model | task | accuracy |" + "".join(f" lag {g} |" for g in groups)
    lines = [head, "|" + "---|" * (4 + len(groups))]
    for name, run in runs.items():
        r = run["task_results"]
        cells = "".join(f" {r['by_group'][g]:.4f} |" if g in r["by_group"] else " - |" for g in groups)
        lines.append(f"| {name} | {run['model']} | {run['task']} | {r['accuracy']:.4f} |{cells}")
    n = sorted({run["task_results"]["examples"] for run in runs.values()})
    return (f"Task accuracy (exact match on answer tokens) over {'/'.join(map(str, n))} test examples.\n\n"
            + "\n".join(lines) + "\n")


def task_plot(results: dict, path: str) -> None:
    """Accuracy by lag (one line per run) for tasks with lags, else one bar per run."""
    plt = _pyplot()
    runs = _runs(results, task=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = []
    for name, run in runs.items():
        by_group = {int(g): a for g, a in run["task_results"]["by_group"].items()}
        if list(by_group) == [0]:
            ax.bar(len(bars), run["task_results"]["accuracy"], label=name)
            bars.append(name)
        else:
            ax.plot(list(by_group), list(by_group.values()), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("lag (tokens between the memory and query blocks)")
    if bars:
        ax.set_xticks(range(len(bars)), bars, rotation=20, fontsize=7)
    ax.set_ylabel("accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(results: dict) -> str:
    lengths = results["lengths"]
    head = "| run | model | " + " | ".join(f"{n}" for n in lengths) + " |"
    lines = [head, "|" + "---|" * (len(lengths) + 2)]
    for name, run in _runs(results, task=False).items():
        cells = [f"{r['ppl']:.3f} ({r['ratio']:.2f}x)" if r["ratio"] else f"{r['ppl']:.3f}"
                 for r in run["results"]]
        lines.append(f"| {name} | {run['model']} | " + " | ".join(cells) + " |")
    return ("Perplexity by evaluation length (ratio to the training length in brackets); "
            f"{results['tokens']} scored tokens per length, stride {results['stride'] or 'none'}.\n\n"
            + "\n".join(lines) + "\n")


def plot(results: dict, path: str) -> None:
    import matplotlib.ticker
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, run in _runs(results, task=False).items():
        x = [r["length"] for r in run["results"]]
        axes[0].plot(x, [r["ppl"] for r in run["results"]], marker="o", label=name)
        if run["results"][0]["ratio"]:
            axes[1].plot(x, [r["ratio"] for r in run["results"]], marker="o", label=name)
    for ax, label in zip(axes, ("perplexity", "ppl(L) / ppl(train length)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        train_len = next(iter(_runs(results, task=False).values()))["train_len"]
        ax.axvline(train_len, color="gray", ls="--", lw=1)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(results: dict, out: str) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    has_lm = bool(_runs(results, task=False))
    table = markdown_table(results) if has_lm else ""
    if _runs(results, task=True):
        table += ("\n" if table else "") + task_table(results)
        task_plot(results, os.path.join(out, "tasks.png"))
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    if has_lm:
        plot(results, os.path.join(out, "results.png"))
    return table


# ---- transport probes ----------------------------------------------------------------------

ROUTE_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def probe_runs(workdirs, *, length: int, windows: int = 2, log=print) -> dict:
    """The transport probes (positional/probes/transport.py) on held-out text, per run and layer.

    Attention-mass probes apply to every scheme; the spectral gap, route decay and value
    cancellation to schemes with step angles (features 'psi' / 'theta'); the spectral gap
    (per kv head) and route decay (routes up to 128 steps) to Householder steps ('w', 'beta').
    """
    from models.lm import attention_internals
    from positional.probes import transport
    results = {"length": length, "windows": windows, "runs": {}}
    for workdir in workdirs:
        config, model, step = load_run(workdir)
        tokens = _windows(config, windows, length)
        far_windows = sorted({max(1, config.seq_len // 4), config.seq_len,
                              min(4 * config.seq_len, length // 2)})
        layers = []
        for i, layer in enumerate(attention_internals(model, tokens, rng=jax.random.key(0))):
            w, feats = layer["weights"], layer["features"]
            rec = {"far_mass": {n: float(transport.far_mass(w, n)) for n in far_windows},
                   "mass_by_distance": np.asarray(transport.mass_by_distance(w)).tolist()}
            if isinstance(feats, dict) and "theta" in feats:
                lengths = [n for n in ROUTE_LENGTHS if n < length]
                decay = transport.route_decay(feats["theta"], lengths)
                v = jnp.repeat(layer["v"], w.shape[1] // layer["v"].shape[2], axis=2)  # per query head
                cancel = transport.value_cancellation(w, v, feats["theta"], config.seq_len,
                                                      model.blocks[i].attn.scheme.layout)
                rec.update(spectral_gap=np.asarray(transport.spectral_gap(feats["psi"])).tolist(),
                           route_decay={n: float(d.max()) for n, d in zip(lengths, decay)},
                           value_ratio=float(cancel["ratio"]))
            elif isinstance(feats, dict) and "beta" in feats:  # Householder steps (PaTH)
                lengths = [n for n in ROUTE_LENGTHS if n < min(length, 129)]
                decay = transport.householder_route_decay(feats["w"], feats["beta"], lengths)
                rec.update(spectral_gap=np.asarray(transport.householder_spectral_gap(feats["w"],
                                                                                      feats["beta"])).tolist(),
                           route_decay={n: float(d.max()) for n, d in zip(lengths, decay)})
            layers.append(rec)
        name = run_name(workdir, workdirs)
        results["runs"][name] = {"workdir": workdir, "step": step, "scheme": config.model.scheme,
                                 "train_len": config.seq_len, "layers": layers}
        log(f"probed {name}")
    return results


def probe_report(results: dict, out: str) -> str:
    """probes.json, probes.md (one row per run and layer) and probes.png."""
    plt = _pyplot()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "probes.json"), "w") as f:
        json.dump(results, f, indent=2)
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
    fig.savefig(os.path.join(out, "probes.png"), dpi=120)
    plt.close(fig)
    table = (f"Transport probes on {results['windows']} held-out windows of {results['length']} tokens; "
             "far mass over queries past the window.\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out, "probes.md"), "w") as f:
        f.write(table)
    return table


# ---- near-minus-far logit differences (the TAPA paper's Figure 1) -------------------------

def near_far_runs(workdirs, *, length: int, near, far, pairs: int = 10000, windows: int = 2,
                  log=print) -> dict:
    """Per run: `pairs` samples of logit(i, i - lam) - logit(i, i - Lam), lam in `near`, Lam in
    `far`, pooled over layers, heads and held-out windows of `length` tokens."""
    from models.lm import attention_internals
    from positional.probes.logits import near_far_differences
    results = {"length": length, "near": list(near), "far": list(far), "runs": {}}
    for workdir in workdirs:
        config, model, step = load_run(workdir)
        tokens = _windows(config, windows, length)
        weights = jnp.stack([layer["weights"] for layer in attention_internals(model, tokens,
                                                                               rng=jax.random.key(0))])
        diffs = np.asarray(near_far_differences(jnp.log(weights), near, far, pairs, jax.random.key(1)))
        diffs = diffs[np.isfinite(diffs)]  # a weight that underflowed to 0 has no finite log
        name = run_name(workdir, workdirs)
        results["runs"][name] = {"workdir": workdir, "step": step, "scheme": config.model.scheme,
                                 "mean": float(diffs.mean()), "std": float(diffs.std()),
                                 "n": int(diffs.size), "diffs": diffs.tolist()}
        log(f"{name}: mean {diffs.mean():.3f} std {diffs.std():.3f} over {diffs.size} pairs")
    return results


def near_far_report(results: dict, out: str) -> str:
    """near_far.json, near_far.md and near_far.png (one histogram per run)."""
    plt = _pyplot()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "near_far.json"), "w") as f:
        json.dump(results, f)
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
    fig.savefig(os.path.join(out, "near_far.png"), dpi=120)
    plt.close(fig)
    table = (f"Near-minus-far logit differences on windows of {results['length']} tokens, pooled over "
             "layers and heads.\n\n" + "\n".join(lines) + "\n")
    with open(os.path.join(out, "near_far.md"), "w") as f:
        f.write(table)
    return table


# ---- command line --------------------------------------------------------------------------

flags.DEFINE_list("workdirs", [], "training run directories to evaluate and compare")
flags.DEFINE_string("out", "runs/eval", "where results.json / .md / .png go")
flags.DEFINE_float("max_multiplier", 0, "largest length as a multiple of the training length "
                   "(0: the run's eval.multipliers)")
flags.DEFINE_integer("tokens", 0, "scored tokens per length (0: the run's eval.tokens)")
flags.DEFINE_integer("stride", -1, "sliding-window stride (0: non-overlapping; -1: the run's)")
flags.DEFINE_integer("probe_length", 0, "instead of perplexity, run the transport probes on "
                     "windows of this many tokens (writes probes.json / .md / .png)")
flags.DEFINE_list("near_far", [], "with --probe_length: instead of the transport probes, "
                  "histogram logit(lam) - logit(Lam) for lam in NEAR, Lam in FAR, given as "
                  "lo:hi,lo:hi (writes near_far.json / .md / .png)")


def cli_flags():
    """The parsed flags of an entry point that reads runs (this one, analyze.py), with logging
    quiet; exits with one readable line when --workdirs is missing."""
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    if not flags.FLAGS.workdirs:
        print("error: pass --workdirs=run1[,run2,...]", file=sys.stderr)
        sys.exit(1)
    return flags.FLAGS


def main(argv):
    del argv
    from train import run_cli
    FLAGS = cli_flags()
    if FLAGS.near_far:
        if len(FLAGS.near_far) != 2 or not FLAGS.probe_length:
            print("error: --near_far=lo:hi,lo:hi needs two ranges and --probe_length", file=sys.stderr)
            sys.exit(1)
        near, far = (tuple(int(x) for x in r.split(":")) for r in FLAGS.near_far)
        results = run_cli(lambda: near_far_runs(FLAGS.workdirs, length=FLAGS.probe_length, near=near,
                                                far=far))
        print(near_far_report(results, FLAGS.out))
        return
    if FLAGS.probe_length:
        results = run_cli(lambda: probe_runs(FLAGS.workdirs, length=FLAGS.probe_length))
        print(probe_report(results, FLAGS.out))
        return
    results = run_cli(lambda: evaluate_runs(
        FLAGS.workdirs, max_multiplier=FLAGS.max_multiplier or None, tokens=FLAGS.tokens or None,
        stride=None if FLAGS.stride < 0 else FLAGS.stride))
    print(write_report(results, FLAGS.out))
    print(f"wrote {FLAGS.out}/results.json, results.md and the plots")


if __name__ == "__main__":
    app.run(main)
