"""How a run does at many lengths: perplexity of held-out text by evaluation length, and, for a
run trained on a synthetic task (`data.tasks`), exact-match accuracy on its answers.

For every length L (multiples of each run's training length) the same N target tokens of the
held-out stream are scored, in windows of L tokens (non-overlapping, or sliding with a stride,
where each window scores only the tokens the previous one did not). `evaluate_runs` and
`write_report` are the "lengths" evaluator (lab/evaluators.py); `perplexity_at` and
`task_accuracy_at` are what training validates with.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import matplotlib.ticker
import numpy as np
from flax import nnx

from data import tasks
from lab.runs import held_out_stream, named_runs, pyplot
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
    from `blockwise_from` tokens on: "reference", and "auto" where it runs on a CPU (elsewhere
    auto's fused kernels are linear in memory already; "pallas" and the others are kept)."""
    materialises = impl == "reference" or impl == "auto" and jax.default_backend() == "cpu"
    return "blockwise" if materialises and length >= blockwise_from else impl


def perplexity_at(config, model, length, n_tokens) -> float:
    """Validation perplexity at one length with a run's own eval settings (used during training)."""
    tokens = held_out_stream(config, n_tokens + length + 1)
    impl = eval_impl(config.model.attention_impl, length, config.eval.blockwise_from)
    return perplexity(model, tokens, length, n_tokens, batch_size=config.eval.batch_size, impl=impl)["ppl"]


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
    task = tasks.get_task(config.data)
    impl = eval_impl(config.model.attention_impl, task.max_len(split), config.eval.blockwise_from)
    return task_accuracy(model, task, split, n_examples or task.eval_examples,
                         batch_size=config.eval.batch_size, impl=impl)


def evaluate_runs(runs, *, multipliers=None, max_multiplier=None, tokens=None, stride=None,
                  log=print) -> dict:
    """Evaluate every run at the same lengths (multiples of the first LM run's training length);
    a run trained on a synthetic task gets its task accuracy on the test split instead."""
    runs = list(named_runs(runs))
    lm_runs = [run for _, run in runs if not tasks.is_task(run.config.data)]
    base = (lm_runs or [run for _, run in runs])[0].config
    ev = base.eval
    multipliers = list(multipliers or ev.multipliers)
    if max_multiplier:
        if max_multiplier < min(multipliers):
            raise ValueError(f"lengths option max_multiplier={max_multiplier} is below every length multiplier "
                             f"{sorted(multipliers)}; valid: >= {min(multipliers)}")
        multipliers = [m for m in multipliers if m <= max_multiplier]
        m = max(multipliers) * 2
        while m <= max_multiplier:
            multipliers.append(m)
            m *= 2
    lengths = eval_lengths(base.seq_len, multipliers)
    tokens = tokens or ev.tokens
    stride = ev.stride if stride is None else stride
    if tokens < 1:
        raise ValueError(f"lengths option tokens={tokens}; valid: an integer >= 1 (scored tokens per length)")
    if stride < 0:
        raise ValueError(f"lengths option stride={stride}; valid: 0 (non-overlapping windows) or a positive "
                         "sliding-window stride")
    held_out = held_out_stream(base, tokens + max(lengths) + 1 + max(lengths)) if lm_runs else None
    results = {"lengths": lengths, "tokens": tokens, "stride": stride, "runs": {}}
    for name, run in runs:
        workdir, config, model, step = run.workdir, run.config, run.model, run.step
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
            r = perplexity(model, held_out, length, tokens, stride=stride, batch_size=n_rows, impl=impl)
            rows.append(r)
            log(f"{name:>16s}  L={length:>6d}  ppl={r['ppl']:9.3f}  ({r['seconds']:.1f}s, {impl})")
        train_ppl = next((r["ppl"] for r in rows if r["length"] == config.seq_len), None)
        for r in rows:
            r["ratio"] = r["ppl"] / train_ppl if train_ppl else None
        results["runs"][name] = {"workdir": workdir, "step": step, "scheme": config.model.scheme,
                                 "model": _model_name(config), "train_len": config.seq_len,
                                 "results": rows}
    return results


def summary(results: dict) -> dict:
    """The training log's scalars for the first run: perplexity at the longest length and its
    ratio to the training length's, or the task accuracy."""
    run = next(iter(results["runs"].values()))
    if "task_results" in run:
        return {"accuracy": run["task_results"]["accuracy"]}
    longest = run["results"][-1]
    return {"ppl_longest": longest["ppl"], **({"ratio_longest": longest["ratio"]} if longest["ratio"] else {})}


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
    plt = pyplot()
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
    plt = pyplot()
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
