"""Grain input pipelines: tokenized documents, packed training batches, evaluation streams.

Every function takes `config`, the `data` section of an experiment config
(`data.default_data_config()`).

Packing is concatenate-then-split: documents (each ending in EOS, and starting with BOS where the
tokenizer's model expects one: `tokenizers.encode_document`) are laid end to end and
cut into rows of `seq_len` tokens, so there is no padding. A document that does not fit in
the rest of a row continues at the start of the next row. Positions count tokens from the
start of each piece of a document within its row, so they restart at 0 in a continuation
row and every position seen in training is below `seq_len`: a model trained at length L never
meets a larger position index, which is what length-extrapolation studies assume.

Grain's own `ConcatThenSplitIterDataset` (grain 0.2.18) restarts positions at each row and
cannot restore a state that went through JSON (its `remainder_slices` tuples come back as
lists and read as a remainder), which orbax checkpointing does, so packing is the small
iterator below; its state is two JSON numbers on top of grain's.
"""

from __future__ import annotations

import functools
import zlib
from typing import Any, Iterator

import grain
import ml_collections
import numpy as np

from data import DataError, batch, local_text, needles, tasks, tokenizers

# Sentencepiece trains on at most this many characters of the train split (taken in the
# split's stored order): more costs minutes and changes little.
SPM_TRAIN_CHARS = 20_000_000
# Whole documents can be large (books); a few in flight are enough to keep packing fed.
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=32)


def tokenizer(config: ml_collections.ConfigDict) -> tokenizers.Tokenizer:
    """The tokenizer `config` names; a sentencepiece model is trained on the train split the
    first time and cached in `config.data_dir`; 'hf' reads `config.tokenizer_path`. A synthetic
    task has its own symbol table.
    """
    if tasks.is_task(config):
        return tasks.tokenizer(tasks.get_task(config))

    def train_texts() -> Iterator[bytes]:
        source = local_text.open_split(config, "train")
        chars = 0
        for record in source.records:
            if chars >= SPM_TRAIN_CHARS:
                return
            text = record[source.text_key]
            chars += len(text)
            yield text

    spm = config.tokenizer == "sentencepiece"
    return tokenizers.get_tokenizer(
        config.tokenizer,
        config.data_dir,
        corpus_id=local_text.open_split(config, "train").corpus_id if spm else "",
        train_texts=train_texts,
        vocab_size=config.spm_vocab_size,
        path=config.get("tokenizer_path", ""),
    )


def _tokenize(tok: tokenizers.Tokenizer, text_key: str, record: dict[str, Any]) -> np.ndarray:
    return tokenizers.encode_document(tok, record[text_key])


def documents(config: ml_collections.ConfigDict, split: str) -> grain.MapDataset:
    """The documents of `split`, tokenized, each int32[n] ending in EOS (BOS first where the
    tokenizer's model expects one), in stored order."""
    source = local_text.open_split(config, split)
    tokenize = functools.partial(_tokenize, tokenizer(config), source.text_key)
    return grain.MapDataset.source(source.records).map(tokenize)


class _PackIterator(grain.DatasetIterator):
    """Rows {'tokens', 'segment_ids', 'positions'}: int32[seq_len] each; see the module doc."""

    def __init__(self, parent: grain.DatasetIterator, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len
        self._doc_state = parent.get_state()  # the parent's state before the current document
        self._doc = np.zeros(0, np.int32)  # the current document
        self._offset = 0  # how many of its tokens were already emitted

    def __next__(self) -> dict[str, np.ndarray]:
        row = {k: np.zeros(self._seq_len, np.int32) for k in ("tokens", "segment_ids", "positions")}
        filled, segment = 0, 0
        while filled < self._seq_len:
            if self._offset == len(self._doc):
                state = self._parent.get_state()
                try:
                    self._doc = next(self._parent)
                except StopIteration:
                    if filled == 0:
                        raise
                    break  # a finite input ends in one padded row (segment id 0)
                self._doc_state, self._offset = state, 0
            n = min(self._seq_len - filled, len(self._doc) - self._offset)
            segment += 1
            row["tokens"][filled : filled + n] = self._doc[self._offset : self._offset + n]
            row["segment_ids"][filled : filled + n] = segment
            row["positions"][filled : filled + n] = np.arange(n)
            filled += n
            self._offset += n
        return row

    def get_state(self) -> dict[str, Any]:
        return {"parent": self._doc_state, "offset": self._offset}

    def set_state(self, state: dict[str, Any]) -> None:
        # Re-read the document that was being cut; the rows before `offset` were emitted.
        self._parent.set_state(state["parent"])
        self._doc_state, self._offset = state["parent"], state["offset"]
        self._doc = next(self._parent, np.zeros(0, np.int32))


class PackIterDataset(grain.IterDataset):
    """Packs a stream of int32[n] documents into rows of `seq_len` tokens (concatenate, then
    split; see the module doc). Elements: {'tokens', 'segment_ids', 'positions'}: int32[seq_len].
    """

    def __init__(self, parent: grain.IterDataset, seq_len: int):
        super().__init__(parent)
        self._seq_len = seq_len

    def __iter__(self) -> grain.DatasetIterator:
        return _PackIterator(self._parent.__iter__(), self._seq_len)


def train_loader(
    config: ml_collections.ConfigDict,
    *,
    seed: int,
    batch_size: int,
    seq_len: int,
    shard_index: int = 0,
    num_shards: int = 1,
) -> grain.DatasetIterator:
    """An endless iterator of packed training batches with exact resume.

    Yields {'tokens', 'segment_ids', 'positions'}: int32[batch_size, seq_len]. Segment ids
    number the documents of a row 1, 2, ... (0 is padding, which an endless stream never
    has); positions count tokens from the start of each piece of a document in its row.
    Documents are shuffled with `seed` (in [0, 2**32)), differently but deterministically in
    every epoch. Process `shard_index` of `num_shards` reads every num_shards-th document,
    and `batch_size` is per process. `get_state()` is JSON-serialisable; `set_state` on a
    fresh loader with the same arguments continues exactly where the state was taken.
    A synthetic task (`data.tasks`) gives one padded example per row. The batch is a
    `data.batch.Batch`; `batch_keys(config)` names its keys.
    """
    if tasks.is_task(config):
        return tasks.train_loader(config, seed=seed, batch_size=batch_size, seq_len=seq_len,
                                  shard_index=shard_index, num_shards=num_shards)
    docs = documents(config, "train")[shard_index::num_shards]
    _check_fills_a_row(docs, seq_len, config, shard_index, num_shards)
    rows = PackIterDataset(docs.shuffle(seed).repeat().to_iter_dataset(READ_OPTIONS), seq_len)
    if mix := retrieval_mix(config):  # each stream its own draws, exact on resume (grain's random_map)
        rows = rows.random_map(functools.partial(needles.mix_row, tokenizer(config), *mix),
                               seed=zlib.crc32(f"retrieval mix {seed} {shard_index}".encode()))
    return iter(rows.batch(batch_size, drop_remainder=True))


def batch_keys(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The keys of the batches `train_loader(config)` yields (`data.batch`): the required ones, and
    'loss_weight' for a synthetic task and for a retrieval mix whose answers weigh other than 1."""
    mix = retrieval_mix(config)
    weighted = tasks.is_task(config) or mix is not None and mix[2] != 1
    return batch.REQUIRED + (("loss_weight",) if weighted else ())


def retrieval_mix(config: ml_collections.ConfigDict) -> tuple[float, tuple[str, ...], float] | None:
    """(fraction, tasks, answer weight) of `data.retrieval_mix` / `retrieval_tasks` /
    `retrieval_answer_weight`, None for no mix; DataError naming the field for a bad value."""
    fraction = config.get("retrieval_mix", 0.0)
    if not 0 <= fraction <= 1:
        raise DataError(f"data.retrieval_mix={fraction} is the fraction of training rows that are retrieval "
                        "examples; valid: 0 (none) to 1")
    tasks = tuple(t.strip() for t in config.get("retrieval_tasks", "passkey").split(",") if t.strip())
    unknown = [t for t in tasks if t not in needles.TASKS]
    if unknown or not tasks:
        raise DataError(f"data.retrieval_tasks={config.retrieval_tasks!r} names no task or unknown ones "
                        f"{unknown}; valid: one or more of {', '.join(needles.TASKS)}, comma-separated")
    weight = config.get("retrieval_answer_weight", 1.0)
    if not (isinstance(weight, (int, float)) and 0 < weight < float("inf")):
        raise DataError(f"data.retrieval_answer_weight={weight!r} is the loss weight of a retrieval answer's "
                        "tokens relative to the other tokens; valid: a finite number > 0 (1: the plain LM loss)")
    return (fraction, tasks, float(weight)) if fraction else None


def _check_fills_a_row(docs: grain.MapDataset, seq_len: int, config: ml_collections.ConfigDict,
                       shard_index: int, num_shards: int) -> None:
    """Raises DataError if the documents `docs` hold fewer than `seq_len` tokens in all (the
    endless loader would then repeat them within every row, or, with none, stop at once).
    Reads documents only until one row is filled: the first one or two for a real corpus."""
    tokens = 0
    for i in range(len(docs)):
        tokens += len(docs[i])
        if tokens >= seq_len:
            return
    shard = f" (shard {shard_index} of {num_shards})" if num_shards > 1 else ""
    where = (config.source_dir or "the default corpus") if config.name == "local_text" else config.name
    raise DataError(
        f"The train split{shard} of {where} has {len(docs)} documents and {tokens} tokens, fewer "
        f"than one training row of {seq_len}: use a larger corpus or a smaller seq_len."
    )


class Streams:
    """Training batches made of independent streams: stream s of S packs every S-th document
    (`train_loader` with shard s of S) into batch_size / S rows, and a batch is the streams' rows
    one after the other. A process loads only the streams of its rows, so the processes of a job
    read disjoint documents and their rows together are the batch one process would load with
    the same S. With S = 1 it is `train_loader` itself. State: {stream: its loader's state}.
    """

    def __init__(self, config, *, seed: int, batch_size: int, seq_len: int, streams: int = 1,
                 rows: range | None = None):
        rows = range(batch_size) if rows is None else rows
        per = batch_size // streams if streams >= 1 else 0
        if per < 1 or batch_size % streams or rows.start % per or rows.stop % per:
            raise DataError(f"data.streams={streams} must divide batch_size={batch_size} into whole streams, "
                            f"and this process's rows {rows.start}..{rows.stop - 1} into whole streams of "
                            f"{max(per, 1)} rows; valid: a divisor of batch_size that splits every process's "
                            f"rows into whole streams (one per row always does: data.streams={batch_size})")
        self.loaders = {s: train_loader(config, seed=seed, batch_size=per, seq_len=seq_len, shard_index=s,
                                        num_shards=streams) for s in range(rows.start // per, rows.stop // per)}

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(loader) for loader in self.loaders.values()]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self) -> dict[str, Any]:
        return {str(s): loader.get_state() for s, loader in self.loaders.items()}

    def set_state(self, state: dict[str, Any]) -> None:
        if "0" not in state and list(self.loaders) == [0]:  # saved before streams: one loader's state
            state = {"0": state}
        for s, loader in self.loaders.items():
            loader.set_state(state[str(s)])


def eval_stream(
    config: ml_collections.ConfigDict, split: str = "validation", max_tokens: int | None = None
) -> np.ndarray:
    """The documents of `split` tokenized and concatenated, each followed by EOS (and preceded by
    BOS where the tokenizer's model expects one): int32[n].

    A fixed order (by path for local text, stored order for TFDS data sets), so the eval loop
    can slice the same windows out of it on every machine; reading stops after `max_tokens`.
    """
    pieces, total = [], 0
    for doc in eval_documents(config, split):
        if max_tokens is not None and total >= max_tokens:
            break
        pieces.append(doc)
        total += len(doc)
    return np.concatenate(pieces or [np.zeros(0, np.int32)])[:max_tokens]


def eval_documents(config: ml_collections.ConfigDict, split: str = "validation") -> Iterator[np.ndarray]:
    """The documents of `split` one by one, tokenized as `documents` are, in `eval_stream`'s order."""
    source = local_text.open_split(config, split)
    tok = tokenizer(config)
    records = (source.records[i] for i in range(len(source.records)))
    if source.path_key is not None:
        records = iter(sorted(records, key=lambda record: record[source.path_key]))
    for record in records:
        yield _tokenize(tok, source.text_key, record)
