"""Long-context retrieval: passkey and RULER-style needle-in-a-haystack tasks in held-out text,
generated deterministically from a seed and scored at every evaluation length and depth (the
"retrieval" evaluator, lab/evaluators.py).

An example is (prompt, answer) tokens, exactly L tokens together: BOS where the run's tokenizer
expects one (an imported model's), a haystack of the run's held-out text (its eval split, PAD,
EOS and BOS removed, from a seeded offset) with the task's needles inserted, then a question
that the answer completes. Its depth d is the fraction of the haystack before the anchor
needle (the one asked about; the first of several values or of a variable chain): round(d * F)
of the F haystack tokens come before it, so d = 0 puts it first and d = 1 right before the
question. Other needles go at seeded haystack offsets (after the anchor, in order, for the
tasks that ask for an order). Needles and question + answer are tokenised as the text they
spell in the middle of a document, whatever the tokenizer (with Llama 2's, "is 71432", not
"is  71432"); the answer ids are the tail of question + answer from the token where the answer
begins (data/needles.py, `encode_completion`). Each task, `task(rng) -> (needles, question,
answer, ordered)`:

  passkey            "\\nThe pass key is 71432. Remember it.\\n" ... "\\nWhat is the pass key?
                     The pass key is " -> "71432"
  single             "\\nThe special magic number for qvxmbe is 4839201.\\n" ... "\\nWhat is the
                     special magic number for qvxmbe? The special magic number for qvxmbe is "
                     -> "4839201"
  multikey           four such needles with different keys; one is asked
  multivalue         four values of one key, all asked: "... numbers for qvxmbe are " ->
                     "4839201, 1177203, 9020417, 3356128" (in the order they appear)
  distractor         four needles whose keys differ from the asked one in one letter
  variable_tracking  "\\nVAR KQZTW = 12345.\\n", "\\nVAR PLMOX = KQZTW.\\n", ... (a chain of 4, in
                     order) ... "\\nWhich variables equal 12345? They are: " -> "KQZTW PLMOX ..."

Two scores per example. Teacher-forced, one parallel forward over prompt + answer: the mean
log-probability of the answer tokens, and exact match, every answer token the argmax. Greedy
decoding through the KV cache (`models.lm.generate`): exact match of the generated tokens.
Greedy decoding emits the answer exactly when every answer token is the argmax after the
answer's own prefix, so the two exact matches agree but for near-ties between the decode path
and the parallel forward. Decoding prefills the prompt eval.blockwise_from tokens at a time
(generate's `prefill_chunk`): a prompt up to that length in one piece, a longer one in pieces
whose attention scores are [blockwise_from, L] per row and head, in the fewer rows per call
that the teacher-forced forward also gets past blockwise_from (about the memory of the
reference attention at blockwise_from, until the rows are down to one). So every length is
decoded by default; `decode_max_length` caps the lengths decoded, longer ones getting the
teacher-forced scores only.

Of several processes, each scores its own rows of every batch of examples, teacher-forced and
by greedy decoding alike (`ModelScorer`: `generate` runs sharded over the processes' devices),
the last batch padded with copies of its last example whose scores are dropped; the scores
reach every process through `distributed.to_host`, and process 0 writes the report.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.needles import TASKS, Example, example_seed, make_example, separators
from data.pipeline import tokenizer as run_tokenizer
from data.tasks import is_task
from lab import distributed, files, provenance
from lab.lengths import checked, checked_list, eval_impl, eval_lengths
from lab.runs import held_out_stream, named_runs, pyplot
from models.lm import generate

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


def haystack_text(config, tokenizer, longest: int) -> np.ndarray:
    """The run's held-out tokens without PAD, EOS and BOS (documents run on), at least `longest`."""
    stream = held_out_stream(config, max(2 * longest, 1 << 16))
    text = stream[~np.isin(stream, separators(tokenizer))]
    if len(text) < longest:
        raise ValueError(f"the held-out split has {len(text)} tokens; retrieval at length {longest} needs "
                         f"{longest}. Lower the longest retrieval length, or use a larger corpus")
    return text


# ---- scoring --------------------------------------------------------------------------------------

def answer_scores(logits, targets, mask):
    """logits [B, T, V], targets [B, T], mask [B, T] (1 on answer targets) -> (mean log-probability
    of the answer targets [B], argmax token [B, T] int32)."""
    logp = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], -1)[..., 0]
    return jnp.sum(logp * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1), jnp.argmax(logits, -1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"))
def _teacher_forced(graphdef, state, tokens, mask, rng, impl):
    logits = nnx.merge(graphdef, state)(tokens[:, :-1], impl=impl, rng=rng)
    return answer_scores(logits, tokens[:, 1:], mask)


class ModelScorer:
    """What `score` calls, on a DecoderLM: `teacher_forced(tokens [B, L], mask [B, L - 1])` ->
    (mean answer log-probability [B], argmax [B, L - 1]) and `greedy(prompts [B, P], n)` -> the
    n greedily decoded tokens [B, n] (the prompts prefilled `prefill_chunk` tokens at a time,
    None: at once), host arrays; rows split over the processes as in
    lab/lengths.py (B a multiple of `distributed.row_multiple`)."""

    def __init__(self, model, impl: str, rng, prefill_chunk: int | None = None):
        self.model, self.impl, self.rng, self.prefill_chunk = model, impl, rng, prefill_chunk
        self.graphdef, self.state = nnx.split(model)

    def teacher_forced(self, tokens, mask):
        batch = distributed.place_rows({"tokens": tokens, "mask": mask}, self.model)
        # generate feeds random features from the first half of split(rng): the same draws here.
        out = _teacher_forced(self.graphdef, self.state, batch["tokens"], batch["mask"],
                              jax.random.split(self.rng)[0], self.impl)
        return tuple(map(distributed.to_host, out))

    def greedy(self, prompts, n):
        prompts = distributed.place_rows({"prompts": prompts}, self.model)["prompts"]
        return distributed.to_host(generate(self.model, prompts, n, rng=self.rng,
                                            prefill_chunk=self.prefill_chunk)[:, -n:])


def _chunks(items: list, rows: int):
    """`items` in chunks of `rows`, the last padded with copies of its last item: (chunk, real count)."""
    for i in range(0, len(items), rows):
        chunk = items[i:i + rows]
        yield chunk + chunk[-1:] * (rows - len(chunk)), len(chunk)


def score(scorer, examples: list[Example], rows: int, decode: bool) -> list[dict]:
    """Both scores of every example (all of one length L), `rows` per call: per example
    'logprob' (mean over the answer tokens), 'exact' (teacher-forced: every answer token the
    argmax), 'predicted' (those argmax tokens) and, with `decode`, 'generated' (greedy decoding
    of as many tokens as the answer has) and 'decoded' (they equal the answer)."""
    records = []
    for chunk, n in _chunks(examples, rows):
        tokens = np.stack([np.concatenate([e.prompt, e.answer]) for e in chunk])
        mask = np.zeros((len(chunk), tokens.shape[1] - 1), np.float32)
        for r, e in enumerate(chunk):
            mask[r, -len(e.answer):] = 1
        logprob, argmax = scorer.teacher_forced(tokens, mask)
        for r, e in enumerate(chunk[:n]):
            predicted = np.asarray(argmax[r, -len(e.answer):])
            records.append({"logprob": float(logprob[r]), "exact": bool((predicted == e.answer).all()),
                            "predicted": predicted.tolist()})
    if decode:  # one generate call needs one prompt length
        for size in sorted({(len(e.prompt), len(e.answer)) for e in examples}):
            group = [i for i, e in enumerate(examples) if (len(e.prompt), len(e.answer)) == size]
            for chunk, n in _chunks(group, rows):
                generated = scorer.greedy(np.stack([examples[i].prompt for i in chunk]), size[1])
                for i, out in zip(chunk[:n], np.asarray(generated)):
                    records[i].update(generated=out.tolist(), decoded=bool((out == examples[i].answer).all()))
    return records


def cells(records: list[dict], depths) -> list[dict]:
    """Per depth of one (task, length): accuracy (teacher-forced exact match), decode_accuracy
    (None where nothing was decoded), mean answer log-probability, examples."""
    out = []
    for depth in depths:
        rs = [r for r in records if r["depth"] == depth]
        decoded = [r["decoded"] for r in rs if "decoded" in r]
        out.append({"length": rs[0]["length"], "depth": depth, "examples": len(rs),
                    "accuracy": float(np.mean([r["exact"] for r in rs])),
                    "decode_accuracy": float(np.mean(decoded)) if decoded else None,
                    "logprob": float(np.mean([r["logprob"] for r in rs]))})
    return out


# ---- the evaluator ------------------------------------------------------------------------------

def checked_options(tasks, lengths, depths, examples, seed, decode_max_length) -> dict:
    """The options as the evaluator uses them; ValueError, one line, on a bad one."""
    tasks = list(TASKS) if tasks is None else [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) \
        else list(tasks)
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        why = f"={','.join(tasks)}: unknown {','.join(unknown)}" if unknown else " is empty"
        raise ValueError(f"retrieval option tasks{why}; valid: one or more of {', '.join(TASKS)}")
    return {"tasks": tasks,
            "lengths": None if lengths is None else checked_list(
                "retrieval option lengths", lengths, 2, meaning="example lengths in tokens"),
            "depths": checked_list("retrieval option depths", depths, 0.0, 1.0, kind=float,
                                   meaning="relative depths of the needle in the haystack"),
            "examples": checked("retrieval option examples", examples, 1, meaning="examples per length and depth"),
            "seed": checked("retrieval option seed", seed, 0),
            "decode_max_length": None if decode_max_length is None else checked(
                "retrieval option decode_max_length", decode_max_length, 0,
                meaning="longest length also scored by greedy decoding; 0: none, None: every length")}


def retrieval_runs(runs, *, tasks=None, lengths=None, depths=DEPTHS, examples: int = 4, seed: int = 0,
                   decode_max_length: int | None = None, log=print) -> dict:
    """Every task at every length and depth, `examples` each, for every run trained on text (runs
    trained on a synthetic task are listed under 'skipped'). Lengths default to the first text
    run's evaluation lengths (eval.multipliers times its training length); a length too short
    for a task's needles, question and answer is skipped for that task. Examples come from
    `seed` and each run's own held-out text and tokenizer (the same examples for runs on the
    same data). Attention is the run's eval impl at each length (`eval_impl`); each call takes
    eval.batch_size rows, fewer past eval.blockwise_from, as the "lengths" evaluator does. Greedy
    decoding scores every length up to `decode_max_length` (None: every length), its prefill in
    pieces of eval.blockwise_from tokens."""
    options = checked_options(tasks, lengths, depths, examples, seed, decode_max_length)
    tasks, depths = options["tasks"], options["depths"]
    results = {**options, "runs": {}, "skipped": {}}
    for name, run in named_runs(runs):
        config, model, start = run.config, run.model, time.perf_counter()
        if is_task(config.data):
            results["skipped"][name] = f"trained on the synthetic task {config.data.name}, not on text"
            log(f"skipping {name}: {results['skipped'][name]}")
            continue
        ev = config.eval
        if results["lengths"] is None:  # the first text run's lengths, for every run
            results["lengths"] = eval_lengths(config.seq_len, ev.multipliers)
        tokenizer = run_tokenizer(config.data)
        text = haystack_text(config, tokenizer, max(results["lengths"]))
        record = {**run.identity(), "mixer": config.model.get("mixer", "attention"), "train_len": config.seq_len,
                  "decode_max_length": results["decode_max_length"], "prefill_chunk": ev.blockwise_from,
                  "tasks": {}}
        for task in tasks:
            rec = record["tasks"][task] = {"cells": [], "skipped": {}, "records": []}
            for length in results["lengths"]:
                made = [(d, i, make_example(task, tokenizer, text, length, d, example_seed(seed, task, length, d, i)))
                        for d in depths for i in range(examples)]
                if any(e is None for *_, e in made):
                    rec["skipped"][length] = "shorter than the task's needles, question and answer"
                    continue
                impl = eval_impl(config.model.attention_impl, length, ev.blockwise_from)
                rows = max(1, min(ev.batch_size, ev.batch_size * ev.blockwise_from // length))
                rows = -(-rows // distributed.row_multiple(model)) * distributed.row_multiple(model)
                scorer = ModelScorer(model, impl, jax.random.fold_in(jax.random.key(seed), length), ev.blockwise_from)
                decode = results["decode_max_length"] is None or length <= results["decode_max_length"]
                scored = score(scorer, [e for *_, e in made], rows, decode=decode)
                for (d, i, e), r in zip(made, scored):
                    r.update(length=length, depth=d, index=i, answer=e.answer.tolist(),
                             answer_text=tokenizer.decode(e.answer))
                    if "generated" in r:
                        r["generated_text"] = tokenizer.decode(r["generated"])
                rec["records"] += scored
                rec["cells"] += cells(scored, depths)
                acc = np.mean([r["exact"] for r in scored])
                log(f"{name:>16s}  {task:>17s}  L={length:>6d}  accuracy {acc:.3f}  ({impl})")
        record["seconds"] = time.perf_counter() - start
        results["runs"][name] = record
    return results


def summary(results: dict) -> dict:
    """The training log's scalars of the first run: teacher-forced exact match over every example
    and at the longest length scored, and the mean answer log-probability ({} if none scored)."""
    run = next(iter(results["runs"].values()), None)
    records = [r for task in (run or {"tasks": {}})["tasks"].values() for r in task["records"]]
    if not records:
        return {}
    longest = max(r["length"] for r in records)
    return {"accuracy": float(np.mean([r["exact"] for r in records])),
            "accuracy_longest": float(np.mean([r["exact"] for r in records if r["length"] == longest])),
            "logprob": float(np.mean([r["logprob"] for r in records]))}


def by_length(task: dict, length: int, field: str):
    """The mean of a cell field over the depths of one length (None where no cell has it)."""
    values = [c[field] for c in task["cells"] if c["length"] == length and c[field] is not None]
    return float(np.mean(values)) if values else None


def markdown(results: dict) -> str:
    lengths = results["lengths"] or []
    text = (f"Retrieval accuracy by length (mean over depths {', '.join(map(str, results['depths']))}; "
            f"{results['examples']} examples per length and depth, seed {results['seed']}): teacher-forced "
            "exact match (every answer token the argmax), greedy-decoding exact match in brackets where "
            "decoded, and the mean answer log-probability. '-': the length is too short for the task.\n")
    for task in results["tasks"]:
        lines = ["| run | model | " + " | ".join(map(str, lengths)) + " |", "|" + "---|" * (len(lengths) + 2)]
        for name, run in results["runs"].items():
            t, cells_ = run["tasks"][task], []
            for length in lengths:
                if length in t["skipped"] or str(length) in t["skipped"]:
                    cells_.append("-")
                    continue
                decoded = by_length(t, length, "decode_accuracy")
                cells_.append(f"{by_length(t, length, 'accuracy'):.2f}"
                              + (f" ({decoded:.2f})" if decoded is not None else "")
                              + f", {by_length(t, length, 'logprob'):.2f}")
            model = run["scheme"] if run["mixer"] == "attention" else run["mixer"]
            lines.append(f"| {name} | {model} | " + " | ".join(cells_) + " |")
        text += f"\n{task}\n\n" + "\n".join(lines) + "\n"
    for name, why in results["skipped"].items():
        text += f"\nskipped {name}: {why}\n"
    return text


def plot_heatmaps(results: dict, path: str) -> None:
    """Teacher-forced accuracy over length x depth: a row of heatmaps (one per task) per run."""
    plt = pyplot()
    runs, tasks, lengths, depths = results["runs"], results["tasks"], results["lengths"], results["depths"]
    fig, axes = plt.subplots(len(runs), len(tasks), figsize=(2.6 * len(tasks) + 1, 2.4 * len(runs) + 0.4),
                             squeeze=False, layout="constrained")  # titles clear of the row above
    for row, (name, run) in zip(axes, runs.items()):
        for ax, task in zip(row, tasks):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for c in run["tasks"][task]["cells"]:
                grid[depths.index(c["depth"]), lengths.index(c["length"])] = c["accuracy"]
            image = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
            for (y, x), value in np.ndenumerate(grid):  # '-': the length is too short for the task
                ax.text(x, y, "-" if np.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=6,
                        color="black" if np.isnan(value) or value > 0.5 else "white")
            ax.set_xticks(range(len(lengths)), lengths, fontsize=6, rotation=45)
            ax.set_yticks(range(len(depths)), depths, fontsize=6)
            ax.set_title(f"{name}: {task}", fontsize=7)
        row[0].set_ylabel("needle depth", fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("length (tokens)", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.8, label="accuracy")
    files.save_figure(fig, path, dpi=110)
    plt.close(fig)


def plot_lengths(results: dict, path: str) -> None:
    """Accuracy against length, one panel per task, one line per run: teacher-forced (solid) and
    greedy decoding (dashed, where decoded)."""
    plt = pyplot()
    tasks = results["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(3.2 * len(tasks), 3), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for i, (name, run) in enumerate(results["runs"].items()):
            t = run["tasks"][task]
            scored = sorted({c["length"] for c in t["cells"]})
            line, = ax.plot(scored, [by_length(t, n, "accuracy") for n in scored], marker="o", label=name)
            decoded = [n for n in scored if by_length(t, n, "decode_accuracy") is not None]
            ax.plot(decoded, [by_length(t, n, "decode_accuracy") for n in decoded], ls="--", marker="x",
                    color=line.get_color(), label=f"{name} (greedy)")
            if i == 0:
                ax.axvline(run["train_len"], color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(results["lengths"], results["lengths"], fontsize=6)
        ax.set_ylim(-0.05, 1.05)
        ax.set_title(task, fontsize=8)
        ax.set_xlabel("length (tokens)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("exact match")
    fig.tight_layout()
    axes[0][-1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.02, 0.5))  # beside the plots
    files.save_figure(fig, path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def report(results: dict, out: str) -> str:
    """retrieval.json, retrieval.md, retrieval_heatmaps.png and retrieval.png (the plots where a
    run was scored)."""
    provenance.write_results(files.join(out, "retrieval.json"), results, indent=2)
    text = markdown(results)
    files.write_text(files.join(out, "retrieval.md"), text)
    if results["runs"]:
        plot_heatmaps(results, files.join(out, "retrieval_heatmaps.png"))
        plot_lengths(results, files.join(out, "retrieval.png"))
    return text
