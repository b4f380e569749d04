"""Passkey and RULER-style needle-in-a-haystack examples, generated deterministically from a
seed: the tasks lab/retrieval.py scores at every evaluation length and depth, and the training
mix that puts them among a run's training rows (`data.retrieval_mix`, `mix_row`).

An example is (prompt, answer) tokens, exactly L tokens together: BOS where the tokenizer
expects one, a haystack of text with the task's needles inserted, then a question that the
answer completes. Its depth d is the fraction of the haystack before the anchor needle (the one
asked about; the first of several values or of a variable chain): round(d * F) of the F
haystack tokens come before it, so d = 0 puts it first and d = 1 right before the question.
Other needles go at seeded haystack offsets (after the anchor, in order, for the tasks that ask
for an order). The tasks are listed in lab/retrieval.py's docstring. Needles and question +
answer are the tokenizer's ids of their text where it stands in the middle of a document (no
space before them, which Llama 2's tokenizers put before a text alone), the answer the tail of
question + answer from where its own tokens begin (`encode_completion`).
"""

from __future__ import annotations

import dataclasses
import string
import zlib

import numpy as np

NEEDLES = 4  # needles of the multi-needle tasks; hops of the variable chain


# ---- the tasks: (needles, the anchor first; question; answer; whether the needles keep their order) ----

def _number(rng, digits: int) -> str:
    return str(rng.integers(10 ** (digits - 1), 10 ** digits))


def _word(rng, letters=string.ascii_lowercase, size: int = 6) -> str:
    return "".join(map(str, rng.choice(list(letters), size)))


def _distinct(draw, n: int) -> list[str]:
    out = []
    while len(out) < n:
        x = draw()
        if x not in out:
            out.append(x)
    return out


def _magic(key: str, value: str) -> str:
    return f"\nThe special magic number for {key} is {value}.\n"


def _ask(key: str) -> str:
    return f"\nWhat is the special magic number for {key}? The special magic number for {key} is "


def passkey(rng):
    value = _number(rng, 5)
    return [f"\nThe pass key is {value}. Remember it.\n"], "\nWhat is the pass key? The pass key is ", value, False


def single(rng):
    key, value = _word(rng), _number(rng, 7)
    return [_magic(key, value)], _ask(key), value, False


def multikey(rng):
    keys = _distinct(lambda: _word(rng), NEEDLES)
    values = [_number(rng, 7) for _ in keys]
    return [_magic(k, v) for k, v in zip(keys, values)], _ask(keys[0]), values[0], False


def multivalue(rng):
    key, values = _word(rng), _distinct(lambda: _number(rng, 7), NEEDLES)
    question = f"\nWhat are all the special magic numbers for {key}? The special magic numbers for {key} are "
    return [_magic(key, v) for v in values], question, ", ".join(values), True


def distractor(rng):
    key = _word(rng)

    def similar():  # one letter of the key changed
        i = rng.integers(len(key))
        return key[:i] + str(rng.choice([c for c in string.ascii_lowercase if c != key[i]])) + key[i + 1:]

    keys = [key, *_distinct(similar, NEEDLES - 1)]
    values = _distinct(lambda: _number(rng, 7), NEEDLES)
    return [_magic(k, v) for k, v in zip(keys, values)], _ask(key), values[0], False


def variable_tracking(rng):
    names, value = _distinct(lambda: _word(rng, string.ascii_uppercase, 5), NEEDLES), _number(rng, 5)
    needles = [f"\nVAR {b} = {a}.\n" for a, b in zip([value, *names], names)]
    return needles, f"\nWhich variables equal {value}? They are: ", " ".join(names), True


TASKS = {task.__name__: task for task in (passkey, single, multikey, multivalue, distractor, variable_tracking)}


# ---- examples ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class Example:
    """prompt int32[P] and answer int32[A], P + A = L; needles: (start, length) in the prompt of
    each needle, the anchor first; free: the haystack tokens (round(depth * free) before the anchor)."""
    prompt: np.ndarray
    answer: np.ndarray
    needles: tuple
    free: int


def example_seed(seed: int, task: str, length: int, depth: float, index: int) -> list[int]:
    """The example's own seed: the same example whatever else is generated beside it."""
    return [seed, zlib.crc32(task.encode()), length, round(depth * 10 ** 6), index]


def encode_completion(tokenizer, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
    """`prompt + completion` as one text that follows other text (`encode(..., continuation=True)`),
    split where the completion's tokens begin: (the longest run of leading ids that spell prompt text
    only, the rest), int32[P] and int32[C]. Where the tokenizer joins the two across the boundary
    (GPT-2's pattern reads "is 71432" as "is", " 71432"; a merged ": K" or " K"), the joined token
    starts the completion, whose ids then spell the prompt's tail too (" 71432"): the prompt ends
    where the completion's own tokens begin, and prompt ids + completion ids are always the
    tokenizer's ids of the whole text."""
    ids = tokenizer.encode(prompt + completion, continuation=True)
    text = tokenizer.decode(ids)  # prompt + completion, but a leading space some decoders drop
    boundary, end = len(text) - len(completion), len(ids)
    while end and (len(part := tokenizer.decode(ids[:end])) > boundary or not text.startswith(part)):
        end -= 1
    return ids[:end], ids[end:]


def make_example(task: str, tokenizer, text: np.ndarray, length: int, depth: float, seed) -> Example | None:
    """One example of `task`, exactly `length` tokens, its anchor needle at `depth`, its haystack
    from `text` (int32[n] tokens, n >= length); None where its needles, question and answer
    alone are longer than `length`. The needles and the question + answer are tokenised as text
    in the middle of a document (no prefix space: "is 71432", not "is  71432", with Llama 2's
    tokenizer), the answer as the tail of the question + answer (`encode_completion`)."""
    rng = np.random.default_rng(seed)
    needles, question, answer, ordered = TASKS[task](rng)
    needles = [tokenizer.encode(n, continuation=True) for n in needles]
    question, answer = encode_completion(tokenizer, question, answer)
    bos = [tokenizer.bos_id] if tokenizer.add_bos else []
    free = length - len(bos) - len(question) - len(answer) - sum(map(len, needles))
    if free < 0:
        return None
    start = rng.integers(0, len(text) - free + 1)
    haystack, anchor = text[start:start + free], round(depth * free)
    others = rng.integers(anchor if ordered else 0, free + 1, len(needles) - 1)
    offsets = [anchor, *map(int, np.sort(others) if ordered else others)]  # haystack tokens before each needle
    pieces, spans, taken, at = [bos], [None] * len(needles), 0, len(bos)
    for i in sorted(range(len(needles)), key=lambda i: (offsets[i], i)):
        pieces += [haystack[taken:offsets[i]], needles[i]]
        at += offsets[i] - taken
        spans[i], taken, at = (at, len(needles[i])), offsets[i], at + len(needles[i])
    prompt = np.concatenate([*pieces, haystack[taken:], question]).astype(np.int32)
    return Example(prompt, answer.astype(np.int32), tuple(spans), free)


def separators(tokenizer) -> list[int]:
    """The ids that are not text: PAD, EOS and BOS (where the tokenizer has them)."""
    return [i for i in (tokenizer.pad_id, tokenizer.eos_id, tokenizer.bos_id) if i is not None]


def mix_row(tokenizer, fraction: float, tasks: tuple, answer_weight: float, row: dict,
            rng: np.random.Generator) -> dict:
    """A training row, or with probability `fraction` a retrieval example in its place: one of
    `tasks` at a uniform depth, its haystack the row's own text (separators removed), one
    document (segment 1, positions 0..L-1) of the row's length L. The loss covers every token,
    the answer's with weight `answer_weight`; other than 1, every row (mixed or not) gets a
    float32 'loss_weight' (`data.batch`), 1 on every token but the answer's. A row too short for the task's
    needles stays as it is."""
    example = None
    if rng.random() < fraction:
        length = len(row["tokens"])
        task, depth = tasks[rng.integers(len(tasks))], float(rng.random())
        text = row["tokens"][~np.isin(row["tokens"], separators(tokenizer))]
        example = make_example(task, tokenizer, np.resize(text, length), length, depth, rng.integers(2 ** 63))
        if example is not None and len(text):
            row = {**row, "tokens": np.concatenate([example.prompt, example.answer]).astype(np.int32),
                   "segment_ids": np.ones(length, np.int32), "positions": np.arange(length, dtype=np.int32)}
        else:
            example = None
    if answer_weight != 1:
        weight = np.ones(len(row["tokens"]), np.float32)
        if example is not None:
            weight[len(weight) - len(example.answer):] = answer_weight
        row = {**row, "loss_weight": weight}
    return row
