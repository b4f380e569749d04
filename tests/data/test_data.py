"""Bad data input gives one clear line: binary source files, failed preparations, empty corpora.

(The other tests here use the shared corpora of conftest.py; these build their own small
directories, since each needs files of a particular kind.)
"""

from __future__ import annotations

import json
import os
import sysconfig

import numpy as np
import pytest

import data
from data import local_text, pipeline, tokenizers

TEXT = "def f(x):\n    return x + 1  # naïve größe 日本\n"


def write_files(root, n: int = 60, content=lambda i: TEXT.encode()) -> str:
    """`n` files f0.txt ... under `root` (60 fill all three splits); returns `root` as a str."""
    os.makedirs(root, exist_ok=True)
    for i in range(n):
        with open(os.path.join(root, f"f{i}.txt"), "wb") as f:
            f.write(content(i))
    return str(root)


def random_bytes(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 3000, dtype=np.uint8).tobytes()


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("warning:")]


def single_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_looks_binary_rule():
    assert not local_text.looks_binary(TEXT.encode())
    assert not local_text.looks_binary(b"")
    assert not local_text.looks_binary(("le caf\xe9 est servi au comptoir du bistrot, " * 20).encode("latin-1"))  # a few accents
    assert not local_text.looks_binary(("日本" * 5000).encode()[: local_text.SNIFF_BYTES])  # cut character
    assert local_text.looks_binary(b"text\0text")
    assert local_text.looks_binary("text".encode("utf-16"))
    no_nul = bytes(b for b in random_bytes(0) if b)
    assert local_text.looks_binary(no_nul)


def test_text_files_and_stdlib_files_give_no_warning(tmp_path, capsys):
    root = write_files(tmp_path / "src", n=4)
    local_text.check_text(root, sorted(os.listdir(root)))
    stdlib = ["os.py", "json/__init__.py", "textwrap.py", "this.py", "encodings/cp1252.py"]
    local_text.check_text(sysconfig.get_paths()["stdlib"], stdlib)
    assert capsys.readouterr().err == ""


def test_mostly_binary_directory_warns_in_one_line(tmp_path, capsys):
    source = write_files(tmp_path / "src", content=lambda i: TEXT.encode() if i < 20 else random_bytes(i))
    builder = local_text.prepare(str(tmp_path / "data"), source, [".txt"])
    assert builder.info.splits.total_num_examples == 60  # prepared anyway: a warning only
    [warning] = warnings_in(capsys.readouterr().err)
    assert source in warning and "40 of its 60 files" in warning and "not UTF-8" in warning
    assert "config.data.source_dir" in warning


def test_text_directory_prepares_without_warning(tmp_path, capsys):
    latin1 = "caf\xe9, na\xefve\n".encode("latin-1")
    source = write_files(tmp_path / "src", content=lambda i: latin1 if i == 3 else b"" if i == 4 else TEXT.encode())
    local_text.prepare(str(tmp_path / "data"), source, [".txt"])
    assert warnings_in(capsys.readouterr().err) == []


@pytest.mark.parametrize("content, message", [(random_bytes, "60 of its 60 files"),
                                              (lambda i: b"", "all its 60 files are empty")])
def test_directory_without_text_is_refused_and_leaves_nothing(tmp_path, content, message):
    source = write_files(tmp_path / "src", content=content)
    data_dir = tmp_path / "new" / "data"
    with pytest.raises(data.DataError) as error:
        local_text.prepare(str(data_dir), source, [".txt"])
    assert source in single_line(error) and message in str(error.value) and "has no text" in str(error.value)
    assert os.listdir(tmp_path) == ["src"]


def test_failed_prepare_leaves_no_new_folder_and_a_retry_works(tmp_path):
    (tmp_path / "src").mkdir()
    data_dir = str(tmp_path / "new" / "data")
    with pytest.raises(data.DataError) as error:
        local_text.prepare(data_dir, str(tmp_path / "src"))
    assert "has no files ending in" in single_line(error)
    assert sorted(os.listdir(tmp_path)) == ["src"]
    write_files(tmp_path / "src")
    assert local_text.prepare(data_dir, str(tmp_path / "src")).info.splits.total_num_examples == 60


def test_failure_mid_write_removes_only_what_it_created(tmp_path, monkeypatch):
    source = write_files(tmp_path / "src")
    data_dir = tmp_path / "data"
    (data_dir / "downloads").mkdir(parents=True)  # an empty folder from before: kept
    (data_dir / "keep.txt").write_text("mine")
    before = sorted(os.path.relpath(os.path.join(r, n), data_dir) for r, ds, fs in os.walk(data_dir) for n in ds + fs)
    generate = local_text.LocalText._generate_examples

    def fail_mid_write(self, paths):
        yield paths[0], {"text": b"x", "path": paths[0]}
        raise data.DataError("disk gone")

    monkeypatch.setattr(local_text.LocalText, "_generate_examples", fail_mid_write)
    with pytest.raises(data.DataError, match="disk gone"):
        local_text.prepare(str(data_dir), source, [".txt"])
    after = sorted(os.path.relpath(os.path.join(r, n), data_dir) for r, ds, fs in os.walk(data_dir) for n in ds + fs)
    assert after == before
    monkeypatch.setattr(local_text.LocalText, "_generate_examples", generate)
    assert local_text.prepare(str(data_dir), source, [".txt"]).info.splits.total_num_examples == 60


def test_source_errors_are_one_line(tmp_path):
    source = write_files(tmp_path / "src")
    with pytest.raises(data.DataError, match="No file suffixes given") as error:
        local_text.prepare(str(tmp_path / "data"), source, [])
    single_line(error)
    with pytest.raises(data.DataError, match="is not a directory"):
        local_text.prepare(str(tmp_path / "data"), os.path.join(source, "f0.txt"))
    os.symlink("missing.txt", os.path.join(source, "dangling.txt"))
    with pytest.raises(data.DataError, match="Cannot read .*dangling.txt") as error:
        local_text.prepare(str(tmp_path / "data"), source, [".txt"])
    single_line(error)
    assert os.listdir(tmp_path) == ["src"]


@pytest.fixture
def one_byte_config(tmp_path):
    """A corpus of 60 one-byte files: about 108 train tokens (each file is 2 with EOS)."""
    config = data.default_data_config()
    config.source_dir = write_files(tmp_path / "src", content=lambda i: b"x")
    config.suffixes, config.data_dir = ".txt", str(tmp_path / "data")
    return config


def test_corpus_shorter_than_one_row_or_an_empty_shard_is_refused(one_byte_config):
    assert next(pipeline.train_loader(one_byte_config, seed=0, batch_size=2, seq_len=64))["tokens"].shape == (2, 64)
    with pytest.raises(data.DataError, match="fewer than one training row of 1000") as error:
        pipeline.train_loader(one_byte_config, seed=0, batch_size=2, seq_len=1000)
    assert one_byte_config.source_dir in single_line(error)
    with pytest.raises(data.DataError, match=r"\(shard 999 of 1000\) .* has 0 documents"):
        pipeline.train_loader(one_byte_config, seed=0, batch_size=2, seq_len=8, shard_index=999, num_shards=1000)


def test_sentencepiece_without_text_is_refused_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    with pytest.raises(data.DataError, match="No text to train the sentencepiece tokenizer") as error:
        tokenizers.get_tokenizer("sentencepiece", str(tmp_path / "d"), train_texts=lambda: [b"", b"  \n\n"])
    single_line(error)

    def no_space(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(tokenizers.os, "replace", no_space)
    with pytest.raises(OSError, match="No space left"):
        tokenizers.get_tokenizer("sentencepiece", str(tmp_path / "d"), train_texts=lambda: [TEXT] * 50,
                                 vocab_size=300)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_a_jsonl_or_parquet_file_is_a_corpus_of_one_document_per_record(tmp_path, kind):
    texts = [f"document {i}: " + "x" * (i % 7) + " é" for i in range(80)]
    path = str(tmp_path / f"corpus.{kind}")
    if kind == "jsonl":
        with open(path, "w") as f:
            for i, text in enumerate(texts):
                f.write(json.dumps({"text": text, "id": i}) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": texts, "id": list(range(80))}), path, row_group_size=16)
    config = data.default_data_config()
    config.update(source_dir=path, data_dir=str(tmp_path / "data"))
    for split in local_text.SPLITS:  # each record in the split its index hashes to, in order
        expected = [t for i, t in enumerate(texts) if local_text.split_of(f"{i:09d}") == split]
        docs = [pipeline.tokenizer(config).decode(d[:-1]) for d in pipeline.eval_documents(config, split)]
        assert docs == expected and expected
    assert len(pipeline.eval_stream(config, "validation")) == sum(
        len(t.encode()) + 1 for i, t in enumerate(texts) if local_text.split_of(f"{i:09d}") == "validation")


def test_a_record_without_text_is_one_line_naming_it(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    config = data.default_data_config()
    config.update(source_dir=str(path), data_dir=str(tmp_path / "data"))
    with pytest.raises(data.DataError) as e:
        pipeline.eval_stream(config, "validation")
    assert single_line(e) == (f"{path}: line 2 is not a JSON object with a 'text' field; every record needs a "
                              "string field 'text' (one document each)")
    assert not (tmp_path / "data").exists()  # nothing left behind


def test_tfds_config_note_is_not_logged(tmp_path, caplog):
    """TFDS's warning naming the builder config (with local paths) is filtered out."""
    import logging as std_logging  # local_text, imported above, installs the filter
    with caplog.at_level(std_logging.WARNING):
        std_logging.getLogger("absl").warning("Using custom data configuration: LocalTextConfig(source_dir='/x')")
        std_logging.getLogger("absl").warning("another warning")
    assert "custom data configuration" not in caplog.text and "another warning" in caplog.text
