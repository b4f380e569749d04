"""Synthetic tasks, generated deterministically from a seed: SymbolSoup and Diffuse MQAR.

Every example is a token sequence and an answer mask (1 on the tokens the model must predict
from what comes before them); training scores only those tokens, evaluation reports exact
match on them. Example `i` of a split depends only on (task options, split, i), so the data
set exists without being stored, every machine sees the same one, and a loader's state is one
index.

SymbolSoup (the Sessa paper's long-range classification task, with the official generator's
parameters): two stylized letter blocks, one from each of two style families (4 left x 5 right
styles = 20 classes), in random order among three blocks of uniform noise letters:

    <bos> \\n noise \\n <sep1> \\n block \\n <sep2> \\n noise \\n
    <sep1> \\n block \\n <sep2> \\n noise \\n <sep> ' ' <label> CLASS

One token per character, spaces and newlines included (letters are space-separated), so
M letters make 2 M + 13 tokens; the label is read out as the token predicted after <label>.
A style is a Markov chain over 16 letters (unigram weights 3 / 2 / 1 for 4 primary, 4
secondary and 8 other letters; preferred bigrams weighted by 1 + bigram_strength), with motif
insertions (contiguous runs of the alphabet, 3 to 5 letters, weighted towards the style's
letters) and letter flips. The style tables are drawn as the official generator draws them
(Python's `random` seeded 123 for the left family, 456 for the right), so the 20 classes are
the official ones.

Diffuse MQAR (multi-query associative recall with multi-token keys, structured distractors and
a controlled lag; the paper gives only this outline, the layout below is ours):

    <bos> k k v  k k v ...  <sep> [filler] d d v  d d v ...  <q> k k v  k k v ...
          memory block             noise block (lag tokens)       query block

Memory keys are distinct tuples of `key_len` key tokens, each followed by a value token.
Distractors in the noise block share all but the last token with a memory key and differ in
the last (mismatched suffix), so they are never a memory key; each carries a random value.
The query block repeats `queries` memory keys in random order; the value after each is the
answer. The lag is the noise block's length, so a query's distance to its source pair is the
lag plus at most the memory and query blocks' lengths. Training lags are drawn uniformly from
[lag_min, lag_max]; evaluation example i has lag eval_lags[i % len(eval_lags)].
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import random
from typing import Any, Iterator, NamedTuple

import ml_collections
import numpy as np

from data import DataError
from data.batch import Batch
from data.tokenizers import EOS_ID, PAD_ID

SPLITS = ("train", "validation", "test")


class Example(NamedTuple):
    tokens: np.ndarray  # int32[n]
    answer: np.ndarray  # int32[n]: 1 where the token is an answer (predicted from tokens before it)
    group: int  # what evaluation reports accuracy by (the lag for Diffuse MQAR; 0 otherwise)


class SymbolTokenizer:
    """Ids for a fixed symbol list, after PAD = 0 and EOS = 1 (as the text tokenizers)."""

    pad_id = PAD_ID
    eos_id = EOS_ID

    def __init__(self, symbols: tuple[str, ...]):
        self.symbols = symbols
        self.vocab_size = len(symbols) + 2
        self._ids = {s: i + 2 for i, s in enumerate(symbols)}

    def encode(self, symbols) -> np.ndarray:
        """A sequence of symbols -> int32[n]."""
        return np.array([self._ids[s] for s in symbols], np.int32)

    def decode(self, ids) -> str:
        ids = np.asarray(ids).reshape(-1)
        return " ".join(self.symbols[i - 2] for i in ids if i >= 2)


def _example_rng(task, split: str, index: int, salt: str = "") -> random.Random:
    """The random stream of one example: a function of the task's seed, split and index only.

    (String seeds are hashed with SHA-512 by `random`, identically in every process.)
    """
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    return random.Random(f"{type(task).__name__}/{task.seed}/{split}/{index}{salt}")


def _split_size(task, split: str) -> int:
    return task.train_examples if split == "train" else task.eval_examples


# ---- SymbolSoup ----------------------------------------------------------------------------

LETTERS = tuple("abcdefghijklmnop")
N_LEFT, N_RIGHT = 4, 5
# All contiguous runs of the alphabet of 3, 4 and 5 letters, shortest first.
MOTIFS = tuple("".join(LETTERS[i:i + n]) for n in (3, 4, 5) for i in range(len(LETTERS) - n + 1))


class Style(NamedTuple):
    unigram: dict[str, float]  # letter -> weight
    bigrams: frozenset  # preferred (previous, next) letter pairs
    motif_weights: dict[str, float]  # motif -> weight


def _styles(count: int, seed: int) -> tuple[Style, ...]:
    """`count` styles drawn in sequence from Python's `random` seeded `seed` (one shuffle of the
    letters each): 4 primaries (weight 3), 4 secondaries (2), 8 others (1); preferred bigrams
    p_i -> p_(i+1) (cyclic), p_i -> p_i, s_i -> s_i, p_i -> s_i, s_i -> p_i; a motif weighs
    1 + 0.9 (its distinct primaries) + 0.5 (its distinct secondaries)."""
    rng = random.Random(seed)
    styles = []
    for _ in range(count):
        letters = list(LETTERS)
        rng.shuffle(letters)
        primary, secondary = letters[:4], letters[4:8]
        unigram = {t: 3.0 if t in primary else 2.0 if t in secondary else 1.0 for t in letters}
        bigrams = {(p, primary[(i + 1) % 4]) for i, p in enumerate(primary)} | {(p, p) for p in primary}
        bigrams |= {(s, s) for s in secondary}
        bigrams |= {pair for p, s in zip(primary, secondary) for pair in ((p, s), (s, p))}
        motifs = {m: 1.0 + 0.9 * len(set(m) & set(primary)) + 0.5 * len(set(m) & set(secondary))
                  for m in MOTIFS}
        styles.append(Style(unigram, frozenset(bigrams), motifs))
    return tuple(styles)


LEFT_STYLES = _styles(N_LEFT, 123)
RIGHT_STYLES = _styles(N_RIGHT, 456)


@functools.lru_cache(maxsize=None)
def _markov_table(family: str, style: int, bigram_strength: float) -> dict:
    """prev letter (None at the start) -> cumulative weights over LETTERS for the next one:
    unigram weight, times 1 + bigram_strength for a preferred (prev, next) pair."""
    s = (LEFT_STYLES if family == "left" else RIGHT_STYLES)[style]
    table = {None: list(itertools.accumulate(s.unigram[t] for t in LETTERS))}
    for prev in LETTERS:
        table[prev] = list(itertools.accumulate(
            s.unigram[t] * (1.0 + bigram_strength if (prev, t) in s.bigrams else 1.0) for t in LETTERS))
    return table


@functools.lru_cache(maxsize=None)
def _motif_table(family: str, style: int, max_len: int) -> tuple[tuple[str, ...], list[float]]:
    """Motifs of at most `max_len` letters and their cumulative weights."""
    weights = (LEFT_STYLES if family == "left" else RIGHT_STYLES)[style].motif_weights
    motifs = tuple(m for m in MOTIFS if len(m) <= max_len)
    return motifs, list(itertools.accumulate(weights[m] for m in motifs))


def _pick(rng: random.Random, items, cum_weights) -> Any:
    return items[bisect.bisect_left(cum_weights, rng.random() * cum_weights[-1])]


def style_pieces(rng: random.Random, family: str, style: int, length: int, *, bigram_strength: float,
                 motif_prob: float) -> list[str]:
    """A clean stylized block of `length` letters as the pieces it was built from: a motif
    (inserted with probability `motif_prob` wherever at least 3 letters remain, chosen among
    those that fit) or a single letter from the style's Markov chain given the previous one."""
    pieces, n, prev = [], 0, None
    while n < length:
        remaining = length - n
        if remaining >= 3 and rng.random() < motif_prob:
            piece = _pick(rng, *_motif_table(family, style, min(remaining, 5)))
        else:
            piece = _pick(rng, LETTERS, _markov_table(family, style, bigram_strength)[prev])
        pieces.append(piece)
        n, prev = n + len(piece), piece[-1]
    return pieces


def flip_letters(rng: random.Random, letters: list[str], prob: float) -> list[str]:
    """Each letter, with probability `prob`, replaced by one of the 15 other letters."""
    out = []
    for t in letters:
        if rng.random() < prob:
            t = rng.choice([x for x in LETTERS if x != t])
        out.append(t)
    return out


@dataclasses.dataclass(frozen=True)
class SymbolSoup:
    """SymbolSoup options; defaults are the official generator's (20,000 / 2,000 / 2,000 examples)."""

    seed: int = 0
    train_examples: int = 20000
    eval_examples: int = 2000  # validation and test each
    min_tokens: int = 400
    max_tokens: int = 600
    bigram_strength: float = 3.0
    motif_prob: float = 0.3
    flip_prob: float = 0.03

    classes = N_LEFT * N_RIGHT
    symbols = LETTERS + (" ", "\n", "<bos>", "<sep1>", "<sep2>", "<sep>", "<label>") + tuple(
        f"CLASS_{k}" for k in range(N_LEFT * N_RIGHT))

    def __post_init__(self):
        if self.max_tokens < self.min_tokens or self.letter_bounds()[0] > self.letter_bounds()[1]:
            raise ValueError(f"data.task.min_tokens={self.min_tokens} / max_tokens={self.max_tokens}: "
                             "no example length 2 M + 13 (M >= 5 letters) lies in that range")
        for name in ("train_examples", "eval_examples"):
            if getattr(self, name) % self.classes:
                raise ValueError(f"data.task.{name}={getattr(self, name)} must be a multiple of the "
                                 f"{self.classes} classes (every class equally often)")
        for name in ("motif_prob", "flip_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"data.task.{name}={getattr(self, name)} is not a probability")

    def letter_bounds(self) -> tuple[int, int]:
        """Smallest and largest total letter count M with 2 M + 13 tokens in range."""
        return max(5, -(-(self.min_tokens - 13) // 2)), max(5, (self.max_tokens - 13) // 2)

    def max_len(self, split: str) -> int:
        return 2 * self.letter_bounds()[1] + 13 + 1  # + the class token

    def label(self, split: str, index: int) -> int:
        """Classes are balanced in every run of 20 consecutive examples (a shuffled 0..19)."""
        perm = list(range(self.classes))
        _example_rng(self, split, index // self.classes, "/labels").shuffle(perm)
        return perm[index % self.classes]

    def symbols_of(self, split: str, index: int) -> list[str]:
        """Example `index` of `split` as symbols, ending in its class symbol."""
        rng = _example_rng(self, split, index)
        cls = self.label(split, index)
        m = rng.randint(*self.letter_bounds())
        noise_min = max(3, int(0.3 * m))
        n_noise = min(max(3, rng.randint(noise_min, max(noise_min, int(0.6 * m)))), m - 2)
        main = m - n_noise
        n_left = rng.randint(1, main - 1)
        blocks = [self._block(rng, "left", cls // N_RIGHT, n_left),
                  self._block(rng, "right", cls % N_RIGHT, main - n_left)]
        if rng.random() < 0.5:
            blocks.reverse()
        n0 = rng.randint(1, n_noise - 2)
        n1 = rng.randint(1, n_noise - n0 - 1)
        noise = [[rng.choice(LETTERS) for _ in range(n)] for n in (n0, n1, n_noise - n0 - n1)]

        def line(letters):
            return [x for t in letters for x in (t, " ")][:-1] + ["\n"]

        out = ["<bos>", "\n"] + line(noise[0])
        for block, gap in zip(blocks, noise[1:]):
            out += ["<sep1>", "\n"] + line(block) + ["<sep2>", "\n"] + line(gap)
        return out + ["<sep>", " ", "<label>", f"CLASS_{cls}"]

    def _block(self, rng, family, style, length):
        pieces = style_pieces(rng, family, style, length, bigram_strength=self.bigram_strength,
                              motif_prob=self.motif_prob)
        return flip_letters(rng, list("".join(pieces)), self.flip_prob)

    def example(self, split: str, index: int) -> Example:
        tokens = tokenizer(self).encode(self.symbols_of(split, index))
        answer = np.zeros_like(tokens)
        answer[-1] = 1
        return Example(tokens, answer, 0)


# ---- Diffuse MQAR --------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DiffuseMQAR:
    """Diffuse MQAR options (the layout is in the module doc)."""

    seed: int = 0
    train_examples: int = 20000
    eval_examples: int = 2000  # validation and test each, spread evenly over eval_lags
    key_vocab: int = 16
    value_vocab: int = 16
    key_len: int = 2
    pairs: int = 8
    queries: int = 8
    lag_min: int = 32  # training lags: uniform in [lag_min, lag_max]
    lag_max: int = 128
    eval_lags: tuple = (32, 64, 128, 256, 512)  # up to 4x lag_max

    def __post_init__(self):
        if self.key_len < 2:
            raise ValueError(f"data.task.key_len={self.key_len}: keys need at least 2 tokens "
                             "(a distractor shares the prefix and changes the last)")
        if not 1 <= self.pairs <= self.key_vocab ** (self.key_len - 1):
            raise ValueError(f"data.task.pairs={self.pairs} must be in [1, key_vocab^(key_len-1)] so "
                             "memory keys can have distinct prefixes, each with free suffixes")
        if self.key_vocab < 2 or self.value_vocab < 2:
            raise ValueError("data.task.key_vocab and value_vocab must be at least 2")
        if not 1 <= self.queries <= self.pairs:
            raise ValueError(f"data.task.queries={self.queries} must be in [1, pairs={self.pairs}]")
        lags = (self.lag_min, self.lag_max, *self.eval_lags)
        if not (0 <= self.lag_min <= self.lag_max and min(lags) >= 0 and self.eval_lags):
            raise ValueError(f"data.task lags: need 0 <= lag_min <= lag_max and non-empty non-negative "
                             f"eval_lags; got lag_min={self.lag_min}, lag_max={self.lag_max}, "
                             f"eval_lags={self.eval_lags}")

    @property
    def symbols(self) -> tuple[str, ...]:
        return (("<bos>", "<sep>", "<q>", ".") + tuple(f"k{i}" for i in range(self.key_vocab))
                + tuple(f"v{i}" for i in range(self.value_vocab)))

    def length(self, lag: int) -> int:
        """Tokens in an example with this lag."""
        return 3 + lag + (self.pairs + self.queries) * (self.key_len + 1)

    def max_len(self, split: str) -> int:
        return self.length(self.lag_max if split == "train" else max(self.eval_lags))

    def lag(self, split: str, index: int) -> int:
        if split == "train":
            return _example_rng(self, split, index, "/lag").randint(self.lag_min, self.lag_max)
        return self.eval_lags[index % len(self.eval_lags)]

    def symbols_of(self, split: str, index: int) -> tuple[list[str], list[int]]:
        """Example `index` of `split` as symbols, and the indices of its answers."""
        rng, lag = _example_rng(self, split, index), self.lag(split, index)
        keys = [f"k{i}" for i in range(self.key_vocab)]
        value = lambda: f"v{rng.randrange(self.value_vocab)}"  # noqa: E731
        # Distinct prefixes, so a distractor's prefix names one memory key.
        prefixes = rng.sample(list(itertools.product(keys, repeat=self.key_len - 1)), self.pairs)
        memory = [(list(p) + [rng.choice(keys)], value()) for p in prefixes]
        out = ["<bos>"] + [t for key, v in memory for t in key + [v]] + ["<sep>"]
        n_distractors, filler = divmod(lag, self.key_len + 1)
        out += ["."] * filler
        for _ in range(n_distractors):
            key, _ = rng.choice(memory)
            out += key[:-1] + [rng.choice([k for k in keys if k != key[-1]]), value()]
        out += ["<q>"]
        answers = []
        for key, v in rng.sample(memory, self.queries):
            out += key + [v]
            answers.append(len(out) - 1)
        return out, answers

    def example(self, split: str, index: int) -> Example:
        symbols, answers = self.symbols_of(split, index)
        answer = np.zeros(len(symbols), np.int32)
        answer[answers] = 1
        return Example(tokenizer(self).encode(symbols), answer, self.lag(split, index))


# ---- configs and loaders -------------------------------------------------------------------

TASKS = {"symbolsoup": SymbolSoup, "diffuse_mqar": DiffuseMQAR}


def is_task(config: ml_collections.ConfigDict) -> bool:
    return config.name in TASKS


def default_options(name: str) -> ml_collections.ConfigDict:
    """Every option of task `name` with its default, for `config.data.task` (so the command line
    can override any of them)."""
    return ml_collections.ConfigDict(dataclasses.asdict(TASKS[name]()))


def get_task(config: ml_collections.ConfigDict):
    """The task that the `data` section `config` names, with its `task` options."""
    options = dict(config.get("task") or {})
    known = {f.name for f in dataclasses.fields(TASKS[config.name])}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"data.task has unknown option(s) {unknown} for data.name={config.name!r}; "
                         f"valid: {sorted(known)}")
    if "eval_lags" in options:
        options["eval_lags"] = tuple(options["eval_lags"])
    return TASKS[config.name](**options)


@functools.lru_cache(maxsize=None)
def tokenizer(task) -> SymbolTokenizer:
    return SymbolTokenizer(task.symbols)


def row(example: Example, length: int) -> Batch:
    """One example padded to `length`, a row of a `data.batch.Batch`: segment id 1 on the example
    and 0 (padding) after it, positions count from 0, and loss_weight is the answer mask (1 on
    the answer's tokens, 0 elsewhere)."""
    n = len(example.tokens)
    if n > length:
        raise DataError(f"a task example has {n} tokens but rows hold {length}; raise seq_len to at "
                        f"least {n - 1}")
    pad = lambda x: np.pad(x, (0, length - n)).astype(np.int32)  # noqa: E731
    return {"tokens": pad(example.tokens), "segment_ids": pad(np.ones(n)),
            "positions": pad(np.arange(n)), "loss_weight": pad(example.answer).astype(np.float32)}


def train_loader(config: ml_collections.ConfigDict, *, seed: int, batch_size: int, seq_len: int,
                 shard_index: int = 0, num_shards: int = 1) -> Iterator:
    """Endless training batches of rows (see `row`) of `seq_len` tokens, with exact resume.

    The train split's examples are shuffled with `seed`, differently in every epoch; process
    `shard_index` of `num_shards` reads every num_shards-th example. Same interface as
    `pipeline.train_loader`.
    """
    import grain
    task = get_task(config)
    if task.max_len("train") > seq_len:
        raise DataError(f"data.name={config.name!r}: training examples have up to {task.max_len('train')} "
                        f"tokens; raise seq_len to at least {task.max_len('train') - 1}")
    indices = grain.MapDataset.range(task.train_examples)[shard_index::num_shards]
    rows = indices.shuffle(seed).repeat().map(lambda i: row(task.example("train", int(i)), seq_len))
    return iter(rows.batch(batch_size, drop_remainder=True).to_iter_dataset())


def eval_batches(task, split: str, n: int, batch_size: int) -> Iterator[tuple[dict, np.ndarray]]:
    """The first `n` examples of `split` in batches of rows padded to the split's longest
    example: (a `data.batch.Batch` [b, L] of `row`s, groups int[b])."""
    length = task.max_len(split)
    for start in range(0, n, batch_size):
        examples = [task.example(split, i) for i in range(start, min(n, start + batch_size))]
        rows = [row(e, length) for e in examples]
        yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}, np.array([e.group for e in examples])
