"""Tokenizers: bytes (default, nothing to train) and sentencepiece (trained on a train split).

Both share one interface: `encode(text) -> int32[n]` (no EOS added), `decode(ids) -> str`
(PAD and EOS skipped), and the attributes `pad_id = 0`, `eos_id = 1`, `vocab_size`.
"""

from __future__ import annotations

import io
import itertools
import os
import re
import tempfile
from typing import Callable, Iterable, Sequence

import numpy as np
import sentencepiece as spm

from data import DataError, absent_dirs, remove_empty_dirs

PAD_ID = 0
EOS_ID = 1


def _as_bytes(text: str | bytes) -> bytes:
    return text.encode("utf-8") if isinstance(text, str) else bytes(text)


def _as_str(text: str | bytes) -> str:
    # Some source files are not UTF-8 (the standard library tests its own decoders on them).
    return text if isinstance(text, str) else bytes(text).decode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes: byte b -> id b + 2, after PAD = 0 and EOS = 1. Exact for any bytes."""

    pad_id = PAD_ID
    eos_id = EOS_ID
    vocab_size = 256 + 2

    def encode(self, text: str | bytes) -> np.ndarray:
        """Returns int32[len(utf-8 bytes of text)]."""
        return np.frombuffer(_as_bytes(text), dtype=np.uint8).astype(np.int32) + 2

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        return (ids[ids >= 2] - 2).astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class SentencePieceTokenizer:
    """A sentencepiece model with PAD = 0, EOS = 1, UNK = 2, no BOS, and byte fallback.

    Trained with identity normalisation and whitespace kept as is, so encode/decode round
    trips any UTF-8 text, code indentation included (characters outside the vocabulary go
    through byte pieces).
    """

    pad_id = PAD_ID
    eos_id = EOS_ID

    def __init__(self, model_path: str):
        self.model_path = model_path
        self._processor = spm.SentencePieceProcessor(model_file=model_path)
        self.vocab_size = self._processor.get_piece_size()

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, model_path: str) -> SentencePieceTokenizer:
        """Trains on `texts` (documents) and writes the model to `model_path` atomically.

        Documents are fed line by line: sentencepiece drops "sentences" longer than
        `max_sentence_length`, and whole files usually are.
        """
        sentences = (line for text in texts for line in _as_str(text).splitlines() if line.strip())
        first = next(sentences, None)
        if first is None:  # sentencepiece would fail with "INTERNAL: ... [!sentences_.empty()]"
            raise DataError(
                "No text to train the sentencepiece tokenizer on: its train texts have no non-blank line. "
                "Use a corpus with text in it, or data.tokenizer='byte'."
            )
        model = io.BytesIO()
        spm.SentencePieceTrainer.train(
            sentence_iterator=itertools.chain([first], sentences),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            character_coverage=0.9995,
            byte_fallback=True,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=2,
            bos_id=-1,
            # Small corpora (tests) cannot fill a large vocabulary; train what they support.
            hard_vocab_limit=False,
            input_sentence_size=2_000_000,
            shuffle_input_sentence=True,
            num_threads=os.cpu_count() or 1,
            minloglevel=2,
        )
        _write_atomically(model_path, model.getvalue())
        return cls(model_path)

    def encode(self, text: str | bytes) -> np.ndarray:
        """Returns int32[n] piece ids."""
        return np.asarray(self._processor.encode(_as_str(text)), dtype=np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1) if i not in (PAD_ID, EOS_ID)]
        return self._processor.decode(ids)


Tokenizer = ByteTokenizer | SentencePieceTokenizer
TOKENIZERS = ("byte", "sentencepiece")


def _write_atomically(path: str, content: bytes) -> None:
    """Writes via a temporary file and a rename, so readers never see a half-written file; on
    failure, the temporary file and the folders this call created are removed."""
    folder = os.path.dirname(path) or "."
    new_dirs = absent_dirs(folder)
    os.makedirs(folder, exist_ok=True)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            os.unlink(tmp)
        remove_empty_dirs(new_dirs)
        raise


def get_tokenizer(
    name: str,
    data_dir: str,
    *,
    corpus_id: str = "",
    train_texts: Callable[[], Iterable[str]] | None = None,
    vocab_size: int = 8192,
) -> Tokenizer:
    """Returns the tokenizer `name` ('byte' or 'sentencepiece').

    A sentencepiece model is cached as `<data_dir>/tokenizers/spm-<corpus_id>-<vocab_size>.model`
    and trained on `train_texts()` (the corpus' train split) the first time it is asked for.
    """
    if name == "byte":
        return ByteTokenizer()
    if name == "sentencepiece":
        safe_id = re.sub(r"[^A-Za-z0-9_.-]+", "_", corpus_id) or "corpus"
        model_path = os.path.join(data_dir, "tokenizers", f"spm-{safe_id}-{vocab_size}.model")
        if os.path.exists(model_path):
            return SentencePieceTokenizer(model_path)
        if train_texts is None:
            raise DataError(f"No sentencepiece model at {model_path} and no train texts to train one on.")
        return SentencePieceTokenizer.train(train_texts(), vocab_size, model_path)
    raise ValueError(f"Unknown tokenizer {name!r}; valid names: {', '.join(TOKENIZERS)}.")
