"""data/pipeline.py: packing, loader determinism and exact resume, documents, eval stream."""

from __future__ import annotations

import json
import re

import grain
import numpy as np
import pytest

from data import DataError, local_text, pipeline
from data.tokenizers import ByteTokenizer

EOS = ByteTokenizer().eos_id


def unpack(rows: dict[str, np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Splits packed rows [N, L] back into (tokens, positions) pieces, one per segment."""
    pieces = []
    for tokens, segments, positions in zip(rows["tokens"], rows["segment_ids"], rows["positions"]):
        for segment in range(1, segments.max() + 1):
            mask = segments == segment
            pieces.append((tokens[mask], positions[mask]))
    return pieces


def docs_of(rows: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The whole documents in a packed stream of real documents (each ends in EOS)."""
    tokens = rows["tokens"][rows["segment_ids"] > 0]
    return np.split(tokens, np.flatnonzero(tokens == EOS) + 1)[:-1]


def stack(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.mark.parametrize("seq_len", [1, 5, 16, 100])
def test_packing_keeps_every_token_in_order(seq_len):
    rng = np.random.default_rng(seq_len)
    docs = [rng.integers(2, 258, size=n).astype(np.int32) for n in rng.integers(1, 40, size=30)]
    rows = list(pipeline.PackIterDataset(grain.MapDataset.source(docs).to_iter_dataset(), seq_len))
    rows = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    assert all(v.shape == (len(rows["tokens"]), seq_len) and v.dtype == np.int32 for v in rows.values())

    # Segment ids number a row's pieces 1, 2, ... left to right; only the last row has padding (0).
    segments = rows["segment_ids"]
    assert np.all(np.diff(segments[:-1], axis=1) >= 0) and np.all(segments[:-1, 0] == 1)
    for row in segments:
        assert set(np.unique(row[row > 0])) == set(range(1, row.max() + 1))
    padding = segments == 0
    assert not padding[:-1].any() and padding.sum() == segments.size - sum(map(len, docs))
    assert np.all(padding[-1, seq_len - padding[-1].sum() :]) and np.all(rows["tokens"][padding] == 0)

    # Pieces, in order, are consecutive slices of the documents, and positions count from each
    # piece's start, so a document continued in the next row restarts at 0 there.
    pieces = unpack(rows)
    np.testing.assert_array_equal(np.concatenate([t for t, _ in pieces]), np.concatenate(docs))
    for _, positions in pieces:
        np.testing.assert_array_equal(positions, np.arange(len(positions)))
    assert rows["positions"].max() < seq_len


def test_documents_end_in_eos_and_decode_to_the_files(corpus, corpus_config):
    _, files = corpus
    docs = pipeline.documents(corpus_config, "validation")
    records = local_text.open_split(corpus_config, "validation").records
    assert len(docs) == len(records) > 0
    for i in range(len(docs)):
        doc = docs[i]
        assert doc.dtype == np.int32
        assert doc[-1] == ByteTokenizer.eos_id and ByteTokenizer.eos_id not in doc[:-1]
        assert ByteTokenizer().decode(doc).encode("utf-8") == files[records[i]["path"].decode()]


def take(loader, n: int) -> list[dict[str, np.ndarray]]:
    return [next(loader) for _ in range(n)]


def test_loader_batches_are_deterministic_per_seed(corpus_config):
    first = take(pipeline.train_loader(corpus_config, seed=0, batch_size=3, seq_len=64), 5)
    again = take(pipeline.train_loader(corpus_config, seed=0, batch_size=3, seq_len=64), 5)
    other = take(pipeline.train_loader(corpus_config, seed=1, batch_size=3, seq_len=64), 5)
    for batch in first:
        assert set(batch) == {"tokens", "segment_ids", "positions"}
        assert all(v.shape == (3, 64) and v.dtype == np.int32 for v in batch.values())
        assert np.all(batch["segment_ids"] > 0)  # an endless stream has no padding
    assert all(np.array_equal(a[k], b[k]) for a, b in zip(first, again) for k in a)
    assert not np.array_equal(stack(first)["tokens"], stack(other)["tokens"])


def test_every_epoch_is_every_train_document_once_in_a_new_order(corpus, corpus_config):
    _, files = corpus
    train = sorted(text for path, text in files.items() if local_text.split_of(path) == "train")
    tokens_per_epoch = sum(len(t) + 1 for t in train)  # + EOS
    loader = pipeline.train_loader(corpus_config, seed=3, batch_size=4, seq_len=128)
    docs = docs_of(stack(take(loader, 2 * tokens_per_epoch // (4 * 128) + 2)))
    texts = [ByteTokenizer().decode(d).encode("utf-8") for d in docs]
    epoch1, epoch2 = texts[: len(train)], texts[len(train) : 2 * len(train)]
    assert sorted(epoch1) == train and sorted(epoch2) == train
    assert epoch1 != epoch2


def test_loader_resumes_exactly_from_a_json_state(corpus_config):
    # seq_len 48: most batches end inside a document, so the state holds an offset into it.
    loader = pipeline.train_loader(corpus_config, seed=5, batch_size=2, seq_len=48)
    batches, states = [], []
    for _ in range(7):
        batches.append(next(loader))
        states.append(json.loads(json.dumps(loader.get_state())))
    for resume_after in range(1, 6):
        resumed = pipeline.train_loader(corpus_config, seed=5, batch_size=2, seq_len=48)
        resumed.set_state(states[resume_after - 1])
        for expected in batches[resume_after:]:
            got = next(resumed)
            assert all(np.array_equal(got[k], expected[k]) for k in expected)
    assert any(state["offset"] > 0 for state in states)


def test_shards_read_disjoint_documents(corpus, corpus_config):
    _, files = corpus
    train = sorted(text for path, text in files.items() if local_text.split_of(path) == "train")
    seen = []
    for shard in range(2):
        docs = pipeline.documents(corpus_config, "train")[shard::2]
        shard_tokens = sum(len(docs[i]) for i in range(len(docs)))
        loader = pipeline.train_loader(
            corpus_config, seed=0, batch_size=2, seq_len=512, shard_index=shard, num_shards=2
        )
        shard_docs = docs_of(stack(take(loader, shard_tokens // (2 * 512) + 1)))[: len(docs)]
        seen += [ByteTokenizer().decode(d).encode("utf-8") for d in shard_docs]
    assert sorted(seen) == train


def test_eval_stream_is_the_split_by_path_with_eos(corpus, corpus_config):
    _, files = corpus
    expected = []
    for path in sorted(p for p in files if local_text.split_of(p) == "validation"):
        expected += [ByteTokenizer().encode(files[path]), [ByteTokenizer.eos_id]]
    expected = np.concatenate(expected).astype(np.int32)
    stream = pipeline.eval_stream(corpus_config)
    assert stream.dtype == np.int32
    np.testing.assert_array_equal(stream, expected)
    np.testing.assert_array_equal(pipeline.eval_stream(corpus_config, max_tokens=50), expected[:50])


def test_sentencepiece_pipeline(corpus, corpus_config):
    _, files = corpus
    config = corpus_config.copy_and_resolve_references()
    config.tokenizer, config.spm_vocab_size = "sentencepiece", 320
    tok = pipeline.tokenizer(config)
    assert tok.vocab_size <= 320
    doc = pipeline.documents(config, "test")[0]
    path = local_text.open_split(config, "test").records[0]["path"].decode()
    assert doc[-1] == tok.eos_id and tok.decode(doc) == files[path].decode("utf-8")
    batch = next(pipeline.train_loader(config, seed=0, batch_size=2, seq_len=32))
    assert batch["tokens"].max() < tok.vocab_size


def test_each_process_loads_its_own_streams_and_together_the_batch(corpus_config):
    """Two processes' loaders (rows 0-3 and 4-7 of a batch of 8 in 4 streams) read disjoint
    documents, and their rows stacked are the rows one loader of the whole batch gives."""
    kw = dict(seed=3, batch_size=8, seq_len=64, streams=4)
    whole = pipeline.Streams(corpus_config, **kw)
    halves = [pipeline.Streams(corpus_config, rows=rows, **kw) for rows in (range(0, 4), range(4, 8))]
    assert [sorted(h.loaders) for h in halves] == [[0, 1], [2, 3]]
    for _ in range(4):
        batch = next(whole)
        parts = [next(h) for h in halves]
        for k in batch:
            np.testing.assert_array_equal(np.concatenate([p[k] for p in parts]), batch[k])
    # Disjoint documents: stream s reads documents s, s + 4, ... of the train split.
    n = len(pipeline.documents(corpus_config, "train"))
    streams = [set(range(n)[s::4]) for s in range(4)]
    assert all(not (a & b) for i, a in enumerate(streams) for b in streams[i + 1:])
    # The state of the whole is the union of the halves' states, and resumes each of them.
    state = {**halves[0].get_state(), **halves[1].get_state()}
    assert state == whole.get_state()
    again = pipeline.Streams(corpus_config, rows=range(4, 8), **kw)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["tokens"], next(halves[1])["tokens"])


def test_retrieval_mix_replaces_a_fraction_of_rows_with_examples_and_resumes_exactly(corpus_config):
    """data.retrieval_mix: about that fraction of rows become one-document retrieval examples of the
    row's length (needle, haystack, question, then the answer the needle holds); the other rows are
    the rows without the mix, unchanged; a loader resumed from any state gives the same batches."""
    mixed = corpus_config.copy_and_resolve_references()
    mixed.update(retrieval_mix=0.5, retrieval_tasks="passkey,multikey")
    plain = stack(take(pipeline.train_loader(corpus_config, seed=2, batch_size=4, seq_len=320), 10))
    loader = pipeline.train_loader(mixed, seed=2, batch_size=4, seq_len=320)
    batches, states = [], []
    for _ in range(10):
        batches.append(next(loader))
        states.append(json.loads(json.dumps(loader.get_state())))
    rows, examples = stack(batches), 0
    for i, tokens in enumerate(rows["tokens"]):
        if np.array_equal(tokens, plain["tokens"][i]):
            assert all(np.array_equal(rows[k][i], plain[k][i]) for k in rows)
            continue
        examples += 1
        np.testing.assert_array_equal(rows["segment_ids"][i], 1)
        np.testing.assert_array_equal(rows["positions"][i], np.arange(320))
        text = ByteTokenizer().decode(tokens)
        if "pass key" in text:
            asked = re.search(r"What is the pass key\? The pass key is (\d{5})$", text).group(1)
            assert f"The pass key is {asked}. Remember it." in text
        else:
            key, value = re.search(r"What is the special magic number for (\w+)\? The special magic number for \1 "
                                   r"is (\d{7})$", text).groups()
            assert f"The special magic number for {key} is {value}." in text
    assert 10 <= examples <= 30  # of 40 rows, at one half (binomial: 3 standard deviations)
    for resume_after in (1, 4, 9):
        resumed = pipeline.train_loader(mixed, seed=2, batch_size=4, seq_len=320)
        resumed.set_state(states[resume_after - 1])
        for expected in batches[resume_after:]:
            got = next(resumed)
            assert all(np.array_equal(got[k], expected[k]) for k in expected)


def test_retrieval_answer_weight_weights_the_answer_tokens_and_nothing_else(corpus_config):
    """data.retrieval_answer_weight: the same rows as without it, each with a float32
    'loss_weight' that is 1 everywhere but on a mixed example's answer (the row's last tokens)."""
    mixed = corpus_config.copy_and_resolve_references()
    mixed.update(retrieval_mix=0.5, retrieval_tasks="passkey")
    weighted = mixed.copy_and_resolve_references()
    weighted.retrieval_answer_weight = 20.0
    rows = stack(take(pipeline.train_loader(mixed, seed=2, batch_size=4, seq_len=320), 5))
    got = stack(take(pipeline.train_loader(weighted, seed=2, batch_size=4, seq_len=320), 5))
    assert "loss_weight" not in rows and got["loss_weight"].dtype == np.float32
    assert all(np.array_equal(got[k], rows[k]) for k in rows)
    examples = 0
    for tokens, weight in zip(got["tokens"], got["loss_weight"]):
        text = ByteTokenizer().decode(tokens)
        if "What is the pass key?" not in text:
            np.testing.assert_array_equal(weight, 1)
            continue
        examples += 1
        answer = re.search(r"The pass key is (\d{5})$", text).group(1)
        np.testing.assert_array_equal(weight[-len(answer):], 20)
        np.testing.assert_array_equal(weight[:-len(answer)], 1)
    assert examples >= 3


@pytest.mark.parametrize("field, value, error", [
    ("retrieval_mix", 1.5, "data.retrieval_mix=1.5 is the fraction of training rows that are retrieval examples"),
    ("retrieval_tasks", "passkey,nope", "data.retrieval_tasks='passkey,nope' names no task or unknown ones ['nope']"),
    ("retrieval_answer_weight", 0.0, "data.retrieval_answer_weight=0.0 is the loss weight of a retrieval answer's"),
])
def test_bad_retrieval_mix_is_one_line(corpus_config, field, value, error):
    bad = corpus_config.copy_and_resolve_references()
    bad.update({"retrieval_mix": 0.5, field: value})
    with pytest.raises(DataError, match=re.escape(error)):
        pipeline.train_loader(bad, seed=0, batch_size=2, seq_len=64)
