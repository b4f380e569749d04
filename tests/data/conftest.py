"""Small corpora of text files generated per test session, and data configs pointing at them."""

from __future__ import annotations

import os

import numpy as np
import pytest

import data

WORDS = ["def", "return", "self", "x", "value", "class", "naïve", "größe", "日本", "é", "🎉", "\t", "\n"]


def write_corpus(root: str, n_files: int = 120, seed: int = 0) -> dict[str, bytes]:
    """Writes `n_files` .py/.txt files (0 to ~2 KB, some non-ASCII) under `root`, plus files
    the builder must skip; returns {relative path: bytes} of the files it must read."""
    rng = np.random.default_rng(seed)
    files = {}
    for i in range(n_files):
        rel = f"pkg{i % 4}/sub{i % 3}/mod_{i}" + (".py" if i % 2 else ".txt")
        length = 0 if i == 7 else int(rng.integers(1, 400))
        files[rel] = " ".join(rng.choice(WORDS, size=length)).encode("utf-8")
    skipped = {
        "site-packages/pkg/skip.py": b"skip",
        "pkg0/dist-packages/skip.py": b"skip",
        "pkg0/data.bin": b"\0",
    }
    for rel, content in {**files, **skipped}.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content)
    return files


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> tuple[str, dict[str, bytes]]:
    root = str(tmp_path_factory.mktemp("corpus"))
    return root, write_corpus(root)


@pytest.fixture(scope="session")
def corpus_config(corpus, tmp_path_factory):
    """A data config for `corpus`, with its own data_dir shared by the session."""
    config = data.default_data_config()
    config.source_dir = corpus[0]
    config.suffixes = ".py,.txt"
    config.data_dir = str(tmp_path_factory.mktemp("data_dir"))
    return config
