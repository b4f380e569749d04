"""data/tokenizers.py: byte and sentencepiece round trips, ids, caching, names."""

from __future__ import annotations

import os

import numpy as np
import pytest

from data.tokenizers import ByteTokenizer, SentencePieceTokenizer, get_tokenizer

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "class A:\n\tpass  # naïve größe 日本語\n",
    "  two leading spaces,   three inside, trailing  \n\n\n",
    "emoji 🎉 and cyrillic ж",
    "",
]


def test_byte_round_trip_and_ids():
    tok = ByteTokenizer()
    assert (tok.pad_id, tok.eos_id, tok.vocab_size) == (0, 1, 258)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids.dtype == np.int32 and ids.ndim == 1
        assert len(ids) == len(text.encode("utf-8"))
        assert ids.size == 0 or (ids.min() >= 2 and ids.max() < 258)
        assert tok.decode(ids) == text
    np.testing.assert_array_equal(tok.encode("A\x00\xff".encode("latin-1")), [ord("A") + 2, 2, 257])


def test_byte_decode_skips_pad_eos_and_replaces_invalid_utf8():
    tok = ByteTokenizer()
    ids = np.concatenate([tok.encode("hé"), [tok.eos_id, tok.pad_id, tok.pad_id]])
    assert tok.decode(ids) == "hé"
    assert tok.decode(tok.encode(b"a\xffb")) == "a\ufffdb"


def test_sentencepiece_trains_and_round_trips(tmp_path):
    model_path = str(tmp_path / "sub" / "spm.model")
    tok = SentencePieceTokenizer.train(TEXTS * 10, vocab_size=400, model_path=model_path)
    assert os.path.exists(model_path)
    assert (tok.pad_id, tok.eos_id) == (0, 1)
    assert 300 < tok.vocab_size <= 400  # 256 byte pieces + PAD, EOS, UNK, then learned pieces
    unseen = "unseen characters: ∮ λ ⊕ and tabs\t\tnewlines\n"
    for text in TEXTS + [unseen]:
        ids = tok.encode(text)
        assert ids.dtype == np.int32
        assert ids.size == 0 or ids.min() > tok.eos_id  # no PAD/EOS inside a text
        assert tok.decode(ids) == text
        assert tok.decode(np.concatenate([ids, [tok.eos_id, tok.pad_id]])) == text
    assert len(tok.encode(TEXTS[0])) < len(TEXTS[0])  # it learned pieces longer than a byte
    reloaded = SentencePieceTokenizer(model_path)
    np.testing.assert_array_equal(reloaded.encode(TEXTS[1]), tok.encode(TEXTS[1]))


def test_get_tokenizer_caches_sentencepiece(tmp_path):
    assert isinstance(get_tokenizer("byte", str(tmp_path)), ByteTokenizer)
    tok = get_tokenizer(
        "sentencepiece", str(tmp_path), corpus_id="c/1", train_texts=lambda: TEXTS * 10, vocab_size=300
    )
    assert os.listdir(tmp_path / "tokenizers") == ["spm-c_1-300.model"]

    def must_not_train():
        raise AssertionError("the cached model should be used")

    again = get_tokenizer(
        "sentencepiece", str(tmp_path), corpus_id="c/1", train_texts=must_not_train, vocab_size=300
    )
    np.testing.assert_array_equal(again.encode(TEXTS[0]), tok.encode(TEXTS[0]))


def test_get_tokenizer_unknown_name_lists_valid_names(tmp_path):
    with pytest.raises(ValueError, match="byte, sentencepiece"):
        get_tokenizer("wordpiece", str(tmp_path))
