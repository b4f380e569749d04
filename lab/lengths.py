"""How a run does at many lengths: perplexity of held-out text by evaluation length, and, for a
run trained on a synthetic task (`data.tasks`), exact-match accuracy on its answers.

For every length L (multiples of each run's training length) the same targets 1..N of the
held-out stream are scored, N = max(eval.tokens, the longest length), in windows of exactly L
tokens (non-overlapping, or sliding with a stride, the last one shifted back to end at N; each
window scores only the targets no earlier one did; `scoring_plan`). `evaluate_runs` and
`write_report` are the "lengths" evaluator (lab/evaluators.py); `perplexity_at` and
`task_accuracy_at` are what training validates with.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import jax
import jax.numpy as jnp
import matplotlib.ticker
import numpy as np
from flax import nnx

from data import tasks
from lab import distributed, files, provenance
from lab.lowering import hbm_per_device, memory, platform_of, target, topology_devices
from lab.runs import abstract_run, device_memory, held_out_documents, held_out_stream, named_runs, pyplot
from models.lm import DecoderLM, token_nll


def checked(field: str, value, lo, hi=None, *, kind=int, meaning: str = ""):
    """`value` (a number, or its text from a flag) as `kind` within [lo, hi] (hi None: no upper
    bound); else ValueError, one line: the field, why, and the valid range."""
    what = "an integer" if kind is int else "a number"
    valid = f"valid: {what} >= {lo}" if hi is None else f"valid: {what} in [{lo}, {hi}]"
    try:
        x = kind(value)
        if not isinstance(value, str) and x != value:  # 2.5 for an integer
            raise ValueError
    except (TypeError, ValueError):
        why = f"is not {what}"
    else:
        if lo <= x and (hi is None or x <= hi):
            return x
        why = f"is below {lo}" if x < lo else f"is above {hi}" if hi is not None and x > hi else "is not in range"
    raise ValueError(f"{field}={value} {why}; {valid}" + (f" ({meaning})" if meaning else ""))


def checked_list(field: str, texts, lo, hi=None, *, kind=int, meaning: str = "") -> list:
    """`checked` for every item of a list flag, which must not be empty."""
    if not texts:
        raise ValueError(f"{field} is empty; valid: one or more comma-separated values ({meaning})")
    return [checked(field, text, lo, hi, kind=kind, meaning=meaning) for text in texts]


def eval_lengths(train_len: int, multipliers) -> list[int]:
    return sorted({max(1, int(round(m * train_len))) for m in multipliers})


def length_multipliers(multipliers, max_multiplier: float | None) -> list:
    """The evaluation lengths' multiples of the training length: `multipliers` up to
    `max_multiplier`, doubled on from the largest of them while within it."""
    multipliers = list(multipliers)
    if max_multiplier:
        if max_multiplier < min(multipliers):
            raise ValueError(f"lengths option max_multiplier={max_multiplier} is below every length multiplier "
                             f"{sorted(multipliers)}; valid: >= {min(multipliers)}")
        multipliers = [m for m in multipliers if m <= max_multiplier]
        m = max(multipliers) * 2
        while m <= max_multiplier:
            multipliers.append(m)
            m *= 2
    return multipliers


def plan(workdir: str, max_multiplier: float | None = None, *, param_dtype: str | None = None, fsdp: int = 1,
         tensor: int = 1, dtype: str | None = None, topology: str = "") -> dict:
    """eval.py --dry_run: the lengths evaluator's scoring step (a batch of eval.batch_size
    windows) compiled at each evaluation length on abstract inputs, from the run's config.json
    alone (no weights read, nothing allocated), for this host's devices or a `topology` (a
    TPU's, by libtpu; GPU hosts', by XLA's GPU compiler: `lab.lowering.topology_devices`). Per length, per device: the compiler's memory analysis
    (arguments: the parameters and the batch; temporaries: the step's activations) and whether
    the total fits in a device's memory. Lengths as `evaluate_runs` takes them."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    devices = topology_devices(topology) if topology else None
    config, graphdef, rest, params = abstract_run(workdir, param_dtype, fsdp, tensor, devices, dtype)
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    capacity = hbm_per_device(topology, devices) if topology else device_memory()
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    batch = -(-config.eval.batch_size // shards) * shards
    rows, whole = NamedSharding(mesh, P(("data", "fsdp"))), NamedSharding(mesh, P())
    state = nnx.merge_state(params, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole),
                                                 rest))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=whole)
    out = {"workdir": workdir, "devices": len(mesh.devices.flat), "device_kind": mesh.devices.flat[0].device_kind,
           "mesh": dict(mesh.shape), "capacity_bytes": capacity, "batch": batch, "dtype": config.model.dtype,
           "param_dtype": str(jax.tree.leaves(params)[0].dtype),
           "params": sum(math.prod(x.shape) for x in jax.tree.leaves(params)), "lengths": []}
    for length in eval_lengths(config.seq_len, length_multipliers(config.eval.multipliers, max_multiplier)):
        impl = eval_impl(config.model.attention_impl, length, config.eval.blockwise_from)
        tokens = jax.ShapeDtypeStruct((batch, length + 1), jnp.int32, sharding=rows)
        first = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
        with target(platform_of(topology), mesh) if topology else contextlib.nullcontext():
            mem = memory(_window_nll.lower(graphdef, state, tokens, first, key, impl).compile())
        fits = None if capacity is None else mem["total_bytes"] <= capacity
        out["lengths"].append({"length": length, "impl": impl, **mem, "fits": fits})
    return out


def plan_report(p: dict) -> str:
    """`plan`'s result as a table."""
    gib = lambda b: f"{b / 2 ** 30:,.2f}"  # noqa: E731
    capacity = "unknown" if p["capacity_bytes"] is None else f"{gib(p['capacity_bytes'])} GiB"
    lines = [f"dry run of {p['workdir']}: {p['params']:,} parameters ({p['param_dtype']}, computing in {p['dtype']}) "
             f"on {p['devices']} x {p['device_kind']} (mesh {p['mesh']}, {capacity} each), batches of {p['batch']} "
             "windows",
             "| length | attention | arguments GiB | temporaries GiB | total GiB / device | fits |",
             "|---|---|---|---|---|---|"]
    for r in p["lengths"]:
        fits = "?" if r["fits"] is None else "yes" if r["fits"] else "NO"
        lines.append(f"| {r['length']:,} | {r['impl']} | {gib(r['argument_bytes'])} | {gib(r['temp_bytes'])} | "
                     f"{gib(r['total_bytes'])} | {fits} |")
    return "\n".join(lines)


def window_step(length: int, stride: int) -> int:
    """How far consecutive windows of `length` tokens advance: the stride where it is below the
    length, else the length (non-overlapping windows: stride 0, or one too long to slide)."""
    return stride if 0 < stride < length else length


def scoring_plan(n_tokens: int, length: int, stride: int):
    """Windows of exactly `length` tokens that together score targets 1..N of the stream once
    each, N = max(n_tokens, length): the same targets at every length.

    Returns (starts [W], first_scored [W]): window w reads stream[start : start + length + 1]
    (targets start + 1 .. start + length) and scores its targets from index first_scored on.
    The windows end at targets length, length + step, ... (`window_step`) and, where that grid
    misses N, one more shifted back to end exactly at N; each scores only the targets after the
    previous window's end.
    """
    n = max(n_tokens, length)
    ends = np.arange(length, n + 1, window_step(length, stride))
    if ends[-1] != n:
        ends = np.append(ends, n)
    return ends - length, np.concatenate([[0], length - np.diff(ends)])


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "rows"))
def _window_nll(graphdef, state, tokens, first_scored, rng, impl, rows=False):
    """(summed NLL, scored targets) of a batch of windows; per row [B] each with `rows`."""
    model = nnx.merge(graphdef, state)
    nll, _ = token_nll(model, tokens, impl=impl, rng=rng)
    scored = jnp.arange(nll.shape[1])[None] >= first_scored[:, None]
    axis = 1 if rows else None
    return jnp.sum(jnp.where(scored, nll, 0.0), axis=axis), jnp.sum(scored, axis=axis)


def perplexity(model: DecoderLM, stream: np.ndarray, length: int, n_tokens: int, *,
               stride: int = 0, batch_size: int = 4, impl: str = "reference", seed: int = 0,
               spans=None, per_document: bool = False) -> dict:
    """Perplexity of `model` on targets 1..N of `stream`, N = max(n_tokens, length), in windows
    of `length` (`scoring_plan`); 'tokens' is N and 'stride' how far the windows slide (0: they
    do not overlap, also where `stride` >= length). With `spans`, [(offset, n)] (one document
    each, n >= length), the targets offset + 1 .. offset + n of each instead, in windows that
    stay inside their span ('tokens' is the sum of the n; n_tokens is not used); with
    `per_document`, also each span's [summed NLL, targets] ('per_document').

    Schemes with random features get a fresh draw for every batch of windows, from `seed`:
    the same draws for every model evaluated with the same seed.
    """
    plans = [(offset, *scoring_plan(n, length, stride)) for offset, n in spans or [(0, n_tokens)]]
    starts = np.concatenate([offset + s for offset, s, _ in plans])
    first = np.concatenate([f for _, _, f in plans])
    document = np.concatenate([np.full(len(s), i) for i, (_, s, _) in enumerate(plans)])
    sums = np.zeros((len(plans), 2))  # per document: summed NLL, targets
    if starts[-1] + length + 1 > len(stream):
        raise ValueError(f"the held-out stream has {len(stream)} tokens; length {length} with "
                         f"{max(n_tokens, length)} scored tokens needs {starts[-1] + length + 1}. Lower eval.tokens "
                         "or the largest length, or use a larger corpus")
    graphdef, state = nnx.split(model)
    total, count, t0 = 0.0, 0, time.perf_counter()
    for i in range(0, len(starts), batch_size):
        rows = np.stack([stream[s:s + length + 1] for s in starts[i:i + batch_size]])
        # A whole number of rows per batch shard (over several processes, each scores its own);
        # a padding row repeats the last one and scores nothing.
        pad = -len(rows) % distributed.row_multiple(model)
        batch = distributed.place_rows({"tokens": np.concatenate([rows, rows[-1:].repeat(pad, 0)]),
                                        "first": np.append(first[i:i + batch_size], [length] * pad)}, model)
        rng = jax.random.fold_in(jax.random.key(seed), i)
        nll, n = _window_nll(graphdef, state, batch["tokens"], batch["first"], rng, impl, rows=per_document)
        if per_document:  # the padding rows score nothing
            rows_nll, rows_n = (distributed.to_host(x)[:len(rows)] for x in (nll, n))
            np.add.at(sums, document[i:i + batch_size], np.stack([rows_nll, rows_n], 1))
            nll, n = rows_nll.sum(), rows_n.sum()
        total, count = total + float(nll), count + int(n)
    step = window_step(length, stride)
    return {"length": length, "ppl": math.exp(total / count), "nll": total / count, "tokens": count,
            "stride": step if step < length else 0, "seconds": time.perf_counter() - t0, "impl": impl,
            **({"per_document": sums.tolist()} if per_document else {})}


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
    targets, answer = tokens[:, 1:], batch["loss_weight"][:, 1:]
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
        pad = -len(groups) % distributed.row_multiple(model)  # padding rows: group -1, no answers
        batch = {k: np.concatenate([v, v[-1:].repeat(pad, 0)]) for k, v in batch.items()}
        batch["loss_weight"][len(groups):] = 0
        out = _answer_stats(graphdef, state, distributed.place_rows(batch, model), rng, impl)
        stats.append(np.stack([*map(distributed.to_host, out), np.append(groups, [-1] * pad)], 1))
    table = np.concatenate(stats)
    correct, answers, nll, groups = table[table[:, 3] >= 0].T
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
                  within_documents=None, documents=None, log=print) -> dict:
    """Evaluate every run at the same lengths (multiples of the first LM run's training length);
    a run trained on a synthetic task gets its task accuracy on the test split instead.

    Every length scores targets 1..N, N = max(tokens, longest length) ('tokens'; the value asked
    is 'tokens_asked'), of the held-out documents laid end to end, so a long window spans
    several documents. `within_documents` (default: eval.within_documents) scores only whole
    documents of at least the longest length + 1 tokens, each in windows that stay inside it,
    the same targets at every length ('documents': how many; 'tokens': their targets, at least
    the tokens asked); `documents` N > 0 (default: eval.documents) takes the first N such
    documents, the targets spread over them, and keeps each one's NLL ('per_document'). A stride
    >= a length cannot slide there: those windows do not overlap, and the length's row records
    stride 0 (refusing it would refuse configs/tapa.py, whose stride 64 slides from length 128
    on and tiles 16 ... 64)."""
    runs = list(named_runs(runs))
    lm_runs = [run for _, run in runs if not tasks.is_task(run.config.data)]
    base = (lm_runs or [run for _, run in runs])[0].config
    ev = base.eval
    lengths = eval_lengths(base.seq_len, length_multipliers(multipliers or ev.multipliers, max_multiplier))
    # The same validation for an option passed and for the run's config value.
    tokens = checked("lengths option tokens" if tokens else "eval.tokens", tokens or ev.tokens, 1,
                     meaning="scored tokens per length")
    stride = checked("eval.stride" if stride is None else "lengths option stride", ev.stride if stride is None
                     else stride, 0, meaning="0: non-overlapping windows; else the sliding-window stride")
    within = ev.get("within_documents", False) if within_documents is None else within_documents
    documents = checked("lengths option documents" if documents else "eval.documents",
                        documents or ev.get("documents", 0), 0, meaning="documents scored (0: whole ones until tokens)")
    held_out, spans = None, None
    if lm_runs and within:
        held_out, spans = _documents(base, max(lengths), tokens, documents)
        n_scored = sum(n for _, n in spans)
    else:  # targets 1..N at every length: N is raised to the longest length where it is below it
        n_scored = max(tokens, max(lengths))
        held_out = held_out_stream(base, n_scored + 1) if lm_runs else None
    results = {"lengths": lengths, "tokens": n_scored, "tokens_asked": tokens, "stride": stride,
               **({"documents": len(spans)} if spans else {}), "runs": {}}
    for name, run in runs:
        results["runs"][name] = (_task_run(name, run, log) if tasks.is_task(run.config.data) else
                                 _lengths_run(name, run, ev, lengths, held_out, n_scored, stride, spans, documents, log))
    return results


def _task_run(name, run, log) -> dict:
    """`evaluate_runs`' entry for a run trained on a synthetic task: its test-split accuracy."""
    config = run.config
    r = task_accuracy_at(config, run.model, n_examples=config.eval.get("task_examples", 0))
    log(f"{name:>16s}  {config.data.name} accuracy {r['accuracy']:.4f}  ({r['seconds']:.1f}s)")
    return {**run.identity(), "mixer": config.model.get("mixer", "attention"), "model": _model_name(config),
            "task": config.data.name, "train_len": config.seq_len, "task_results": r}


def _lengths_run(name, run, ev, lengths, held_out, n_scored, stride, spans, documents, log) -> dict:
    """`evaluate_runs`' entry for a language-model run: its perplexity at every length, and each
    one's ratio to that at its training length (batch size and blockwise_from: `ev`, the first
    run's eval settings, shared by every run)."""
    config = run.config
    rows = []
    for length in lengths:
        impl = eval_impl(config.model.attention_impl, length, ev.blockwise_from)
        # Past blockwise_from, fewer rows per call keep activation memory about constant.
        n_rows = max(1, min(ev.batch_size, ev.batch_size * ev.blockwise_from // length))
        r = perplexity(run.model, held_out, length, n_scored, stride=stride, batch_size=n_rows, impl=impl,
                       spans=spans, per_document=bool(spans and documents))
        rows.append(r)
        log(f"{name:>16s}  L={length:>6d}  ppl={r['ppl']:9.3f}  ({r['seconds']:.1f}s, {impl})")
    train_ppl = next((r["ppl"] for r in rows if r["length"] == config.seq_len), None)
    for r in rows:
        r["ratio"] = r["ppl"] / train_ppl if train_ppl else None
    return {**run.identity(), "model": _model_name(config), "train_len": config.seq_len, "results": rows}



def _documents(config, longest: int, tokens: int, documents: int = 0):
    """(their tokens laid end to end, [(offset, targets)]) of the first held-out documents with
    at least longest + 1 tokens, until `tokens` targets; the last document is cut there (to no
    fewer than `longest` targets). `documents` N > 0: the first N such documents, each its first
    max(longest, tokens / N) targets (all it has where fewer)."""
    if documents:
        docs = held_out_documents(config, longest + 1, 2 ** 62)[:documents]
        if len(docs) < documents:
            raise ValueError(f"eval.documents (--documents): the held-out split has {len(docs)} documents of at "
                             f"least {longest + 1} tokens, fewer than the {documents} asked; ask fewer, or lower the "
                             "longest length (--max_multiplier)")
        each = max(longest, -(-tokens // documents))
        ends = np.cumsum([0] + [len(d) for d in docs])
        return np.concatenate(docs), [(int(o), min(len(d) - 1, each)) for o, d in zip(ends, docs)]
    # Every document has at least 2 tokens, so documents of 2 x tokens hold at least `tokens` targets.
    docs = held_out_documents(config, longest + 1, 2 * tokens)
    spans, offset, total = [], 0, 0
    for doc in docs:
        if total >= tokens:
            break
        n = min(len(doc) - 1, max(tokens - total, longest))
        spans.append((offset, n))
        offset, total = offset + len(doc), total + n
    if total < tokens:
        raise ValueError(f"the held-out split has {len(spans)} documents of at least {longest + 1} tokens, "
                         f"{total} targets in all, fewer than the {tokens} asked; lower --tokens or the longest "
                         "length (--max_multiplier), or evaluate across documents (eval.within_documents=False)")
    return (np.concatenate(docs[:len(spans)]), spans)


def summary(results: dict) -> dict:
    """The training log's scalars for the first run: perplexity at the longest length and its
    ratio to the training length's, or the task accuracy."""
    run = next(iter(results["runs"].values()))
    if "task_results" in run:
        return {"accuracy": run["task_results"]["accuracy"]}
    longest = run["results"][-1]
    return {"ppl_longest": longest["ppl"], **({"ratio_longest": longest["ratio"]} if longest["ratio"] else {})}


def _model_name(config) -> str:
    """The position scheme of the decoder block with the options the run set (rope(scaling=yarn,
    factor=4)), or the mixer of a Sessa macro-block (not every mixer uses the scheme;
    results.json has both)."""
    mixer = config.model.get("mixer", "attention")
    if mixer != "attention":
        return mixer
    options = dict(config.model.get("scheme_options", {}))
    shown = ", ".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{config.model.scheme}({shown})" if shown else config.model.scheme


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
    files.save_figure(fig, path, dpi=120)
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
            f"{_scored(results)}.\n\n" + "\n".join(lines) + "\n")


def _scored(results: dict) -> str:
    """What every length scored: the tokens (and why more than asked), the stride (and where the
    windows could not slide)."""
    n, asked = results["tokens"], results.get("tokens_asked", results["tokens"])
    text = f"{n} scored tokens per length"
    if "documents" in results:
        text += (f", within each of {results['documents']} held-out documents of at least {max(results['lengths']) + 1} "
                 "tokens (no window crosses a document boundary)")
    elif n > asked:
        text += f" ({asked} asked, raised to the longest length: the same targets at every length)"
    text += f", stride {results['stride'] or 'none'}"
    if results["stride"]:
        rows = next(iter(_runs(results, task=False).values()))["results"]
        flat = [r["length"] for r in rows if not r.get("stride", results["stride"])]
        if flat:
            text += f" (non-overlapping windows at lengths {', '.join(map(str, flat))}, not longer than the stride)"
    return text


def plot(results: dict, path: str) -> None:
    """Perplexity and its ratio to the training length's against the evaluation length, both
    on log axes with labelled ticks, the legend beside the plots (not over the curves)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    runs = _runs(results, task=False)
    for name, run in runs.items():
        x = [r["length"] for r in run["results"]]
        axes[0].plot(x, [r["ppl"] for r in run["results"]], marker="o", label=name)
        if run["results"][0]["ratio"]:
            axes[1].plot(x, [r["ratio"] for r in run["results"]], marker="o", label=name)
    train_len = next(iter(runs.values()))["train_len"]
    titles = ("perplexity by evaluation length", f"relative to the training length ({train_len:,}, dashed)")
    for ax, label, title in zip(axes, ("perplexity", "ppl(L) / ppl(train length)"), titles):
        ax.set_xscale("log", base=2)
        log_ticks(ax)
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
        ax.axvline(train_len, color="gray", ls="--", lw=1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    fig.tight_layout()
    files.save_figure(fig, path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def log_ticks(ax) -> None:
    """A log y axis labelled with plain numbers, densely enough to read off a small range
    (1, 1.25, 1.5, 1.75, 2, ... over less than 4x; 1, 1.5, 2, 3, ... over less than 32x)."""
    ax.set_yscale("log")
    low, high = ax.get_ylim()
    span = high / low
    subs = (1.0, 1.25, 1.5, 1.75) if span < 4 else (1.0, 1.5) if span < 32 else (1.0,)
    ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=2, subs=subs))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda y, _: f"{y:.3g}"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def write_report(results: dict, out: str) -> str:
    provenance.write_results(files.join(out, "results.json"), results, indent=2)
    has_lm = bool(_runs(results, task=False))
    table = markdown_table(results) if has_lm else ""
    if _runs(results, task=True):
        table += ("\n" if table else "") + task_table(results)
        task_plot(results, files.join(out, "tasks.png"))
    files.write_text(files.join(out, "results.md"), f"{table}\nComputed with {provenance.describe(provenance.environment())}.\n")
    if has_lm:
        plot(results, files.join(out, "results.png"))
    return table
