"""Text corpora as TFDS data sets in ArrayRecord files, read by random access without TensorFlow.

`LocalText` turns a directory of text files into a TFDS data set, one example per file:
{"text": the file's bytes, "path": its path relative to the directory}. The default
directory is the pinned corpus of `data.corpus` (the Python sources of two releases from PyPI,
their hashes in its manifest): real text, the same on every machine and Python version, with
many files over 64K bytes.

Files are split train / validation / test (90 / 5 / 5) by a SHA-256 of their relative path,
so the split never depends on file order, the machine or the run. Each directory (and set of
suffixes) gets its own builder config, named after a hash of its absolute path, so several
corpora live side by side under one data_dir; the cache is keyed by path, not content, so
rebuild (delete its folder) after editing the files.

TFDS writes a data set into `incomplete.XXXXXX_<version>` and renames the folder only once
every split and `dataset_info.json` are written, so a crash mid-prepare leaves no folder
that reads as prepared; the next call prepares again. A preparation that fails with an error
also removes the folders it created (they are empty by then: TFDS deletes its temporary
folder), so no empty data set folder is left behind. Two processes preparing at once each
write their own temporary folder; the loser of the final rename reuses the winner's data.

A `.jsonl` or `.parquet` file in place of the directory is a corpus too: one document per
record, its `text` field; a record's "path" is its index (nine digits), which also splits it.

Before preparing, `check_text` looks at the first 8 KiB of every file: a directory that is
mostly binary (or not UTF-8) gets a warning on stderr, and one with no text at all is refused.

Named public TFDS data sets (pg19, lm1b, c4) are read where the user has prepared them in
ArrayRecord format; they are never downloaded from here.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import logging
import os
import re
import sys
from typing import Any, Iterator, Mapping, NamedTuple, Sequence

import ml_collections
from etils import epath
import tensorflow_datasets as tfds

from data import DataError, absent_dirs, corpus, remove_empty_dirs


def _not_tfds_config_note(record) -> bool:
    """TFDS logs a warning naming the whole builder config, local paths included, each time a
    local-text builder is made (seven times per demo); it says nothing the project does not."""
    return not str(record.msg).startswith("Using custom data configuration")


logging.getLogger("absl").addFilter(_not_tfds_config_note)

SPLITS = ("train", "validation", "test")
DEFAULT_SUFFIXES = (".py", ".txt", ".md", ".rst")
_EXCLUDED_DIRS = ("site-packages", "dist-packages")
# Cumulative split boundaries on a uniform [0, 1) hash: 90% train, 5% validation, 5% test.
_SPLIT_BOUNDS = ((0.90, "train"), (0.95, "validation"), (1.0, "test"))
# `check_text`: how much of a file's start it reads, and the share of those bytes that may be
# invalid UTF-8 (each becomes one U+FFFD when decoded with errors="replace") in a text file.
SNIFF_BYTES = 8192
MAX_INVALID_UTF8 = 0.05


def split_of(relative_path: str) -> str:
    """The split ('train', 'validation' or 'test') a document belongs to, by path hash."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return next(split for bound, split in _SPLIT_BOUNDS if u < bound)


RECORD_FILES = (".jsonl", ".parquet")  # one document per record, in its `text` field


def read_records(path: str) -> Iterator[tuple[str, bytes]]:
    """(key, text) of each record of a .jsonl or .parquet file: the key is the record's index in
    nine digits, the text its `text` field as UTF-8 bytes; a record without one is a DataError."""
    def bad(where, why):
        return DataError(f"{path}: {where} {why}; every record needs a string field 'text' (one document each)")

    if path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for i, line in enumerate(f):
                try:
                    text = json.loads(line)["text"] if line.strip() else None
                except (ValueError, KeyError, TypeError):
                    raise bad(f"line {i + 1}", "is not a JSON object with a 'text' field") from None
                if text is not None:
                    if not isinstance(text, str):
                        raise bad(f"line {i + 1}", f"has a 'text' of type {type(text).__name__}")
                    yield f"{i:09d}", text.encode("utf-8")
        return
    import pyarrow.parquet as pq  # only for parquet corpora
    table = pq.ParquetFile(path)
    if "text" not in table.schema_arrow.names:
        raise bad("its columns", f"are {table.schema_arrow.names}, without 'text'")
    i = 0
    for batch in table.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield f"{i:09d}", text.encode("utf-8")
            i += 1


def find_documents(source_dir: str, suffixes: Sequence[str]) -> list[str]:
    """Sorted relative paths ('/'-separated) of the files under `source_dir` with a suffix in
    `suffixes`, skipping installed packages (site-packages, dist-packages) and symlinked dirs.
    """
    if not os.path.isdir(source_dir):
        problem = "is not a directory" if os.path.exists(source_dir) else "does not exist"
        raise DataError(
            f"Text source directory {source_dir!r} {problem}. Set config.data.source_dir to a "
            "directory of text files, or to '' for the default corpus."
        )
    if not suffixes:
        raise DataError(
            f"No file suffixes given for {source_dir!r}: set config.data.suffixes to comma-separated "
            "suffixes, e.g. '.py,.txt'."
        )
    paths = []
    for root, dirs, files in os.walk(source_dir):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
        rel_root = os.path.relpath(root, source_dir)
        for file in files:
            if file.endswith(tuple(suffixes)):
                rel = file if rel_root == "." else os.path.join(rel_root, file)
                paths.append(rel.replace(os.sep, "/"))
    if not paths:
        raise DataError(
            f"Text source directory {source_dir!r} has no files ending in {', '.join(suffixes)}. "
            "Put text files there, or change config.data.suffixes / config.data.source_dir."
        )
    return sorted(paths)


def looks_binary(head: bytes) -> bool:
    """Whether a file whose first SNIFF_BYTES bytes are `head` is not text: `head` holds a NUL
    byte, or more than MAX_INVALID_UTF8 (5%) of its bytes are not valid UTF-8. (Latin-1 prose
    with a few accents passes; UTF-16, compressed or random bytes do not.)
    """
    if b"\0" in head:
        return True
    return head.decode("utf-8", errors="replace").count("\ufffd") > MAX_INVALID_UTF8 * len(head)


def check_text(source_dir: str, paths: Sequence[str]) -> None:
    """Checks that the files `paths` (relative to `source_dir`) are mostly text (`looks_binary`
    on the first SNIFF_BYTES bytes of each; an empty file counts as text).

    Prints one warning line on stderr if more than half of the files, or of their bytes, look
    binary; raises DataError if no byte of the corpus is text (every file binary or empty), or
    if a file cannot be read.
    """
    binary_files = binary_bytes = total_bytes = text_bytes = 0
    for path in paths:
        full = os.path.join(source_dir, path)
        try:
            with open(full, "rb") as f:
                head = f.read(SNIFF_BYTES)
            size = os.path.getsize(full)
        except OSError as e:
            raise DataError(f"Cannot read {full!r} ({e.strerror or e}); fix its permissions or remove it.") from e
        total_bytes += size
        if looks_binary(head):
            binary_files, binary_bytes = binary_files + 1, binary_bytes + size
        else:
            text_bytes += size
    share = (
        f"{binary_files} of its {len(paths)} files ({binary_bytes:,} of {total_bytes:,} bytes) look binary or "
        f"are not UTF-8 (a NUL byte, or over {MAX_INVALID_UTF8:.0%} invalid UTF-8, in their first 8 KiB)"
    )
    advice = "point config.data.source_dir at text files, or narrow config.data.suffixes"
    if text_bytes == 0:
        what = f"all its {len(paths)} files are empty" if not binary_files else share + (
            ", the rest are empty" if binary_files < len(paths) else "")
        raise DataError(f"Text source directory {source_dir!r} has no text: {what}; {advice}.")
    if binary_files > len(paths) / 2 or binary_bytes > total_bytes / 2:
        print(f"warning: text source directory {source_dir!r} is mostly not text: {share}; {advice}.",
              file=sys.stderr)


@dataclasses.dataclass(eq=False)
class LocalTextConfig(tfds.core.BuilderConfig):
    """A directory of text files; build it with `local_text_config`."""

    source_dir: str = ""
    suffixes: tuple[str, ...] = DEFAULT_SUFFIXES


def local_text_config(source_dir: str, suffixes: Sequence[str] = DEFAULT_SUFFIXES) -> LocalTextConfig:
    """The builder config of a directory (or a .jsonl / .parquet file).

    Its name, `<dir name>-<hash of absolute path and suffixes>`, keeps corpora apart in the cache.
    """
    label = os.path.basename(source_dir.rstrip("/"))
    source_dir = os.path.abspath(os.path.expanduser(source_dir))
    suffixes = tuple(sorted(set(suffixes)))
    key = hashlib.sha256(f"{source_dir}\n{','.join(suffixes)}".encode("utf-8")).hexdigest()[:10]
    label = re.sub(r"[^A-Za-z0-9_]+", "_", label) or "dir"
    return LocalTextConfig(
        name=f"{label}-{key}",
        description=f"Files ending in {', '.join(suffixes)} under {source_dir}.",
        source_dir=source_dir,
        suffixes=suffixes,
    )


class LocalText(tfds.core.GeneratorBasedBuilder):
    """One example per text file: {'text': bytes, 'path': relative path}."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "First version."}

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # TFDS 4.9.10 finds a builder's file through the `importlib_resources` backport, which
        # it installs only for Python < 3.9; telling it directly avoids that import.
        return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=self.builder_config.description,
            features=tfds.features.FeaturesDict({"text": tfds.features.Text(), "path": tfds.features.Text()}),
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict[str, Iterator]:
        config = self.builder_config
        by_split = {split: [] for split in SPLITS}
        records = config.source_dir.endswith(RECORD_FILES) and os.path.isfile(config.source_dir)
        if records:
            paths = [key for key, _ in read_records(config.source_dir)]
        else:
            paths = find_documents(config.source_dir, config.suffixes)
            check_text(config.source_dir, paths)
        for path in paths:
            by_split[split_of(path)].append(path)
        empty = [split for split, paths in by_split.items() if not paths]
        if empty:
            raise DataError(
                f"{config.source_dir!r} has too few documents ({sum(map(len, by_split.values()))}) to fill "
                f"every split (empty: {', '.join(empty)}); each {'record' if records else 'file'} goes to train / "
                "validation / test with probability 0.90 / 0.05 / 0.05. Use "
                + ("a file with more records (one document per line)." if records else "a directory with more files."))
        if records:
            return {split: self._generate_records(split) for split in SPLITS}
        return {split: self._generate_examples(paths) for split, paths in by_split.items()}

    def _generate_records(self, split: str) -> Iterator[tuple[str, dict[str, Any]]]:
        for key, text in read_records(self.builder_config.source_dir):
            if split_of(key) == split:
                yield key, {"text": text, "path": key}

    def _generate_examples(self, paths: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
        for path in paths:
            with open(os.path.join(self.builder_config.source_dir, path), "rb") as f:
                # Raw bytes: some files are not UTF-8, and the byte tokenizer wants them exact.
                yield path, {"text": f.read(), "path": path}


def prepare(data_dir: str, source_dir: str = "", suffixes: Sequence[str] = DEFAULT_SUFFIXES) -> LocalText:
    """Prepares (once; later calls only read metadata) and returns the builder of a directory;
    '' is the default corpus (`data.corpus`, its *.py files), made in data_dir first.

    If preparing fails, the folders this call created (data_dir and the ones TFDS makes in it)
    are removed again where they are empty; nothing that existed before is touched.
    """
    if not source_dir:
        source_dir, suffixes = corpus.corpus_dir(data_dir), corpus.SUFFIXES
    config = local_text_config(source_dir, suffixes)
    builder = LocalText(config=config, data_dir=data_dir, file_format="array_record")
    if builder.is_prepared():
        return builder
    # What TFDS may create: data_dir/local_text/<config>/<version> and data_dir/downloads/extracted.
    new_dirs = absent_dirs(builder.data_dir) + absent_dirs(os.path.join(data_dir, "downloads", "extracted"))
    try:
        builder.download_and_prepare()
    except OSError:
        # Another process finished first and its rename took the folder; use its data.
        builder = LocalText(config=config, data_dir=data_dir, file_format="array_record")
        if not builder.is_prepared():
            remove_empty_dirs(new_dirs)
            raise
    except BaseException:
        remove_empty_dirs(new_dirs)
        raise
    return builder


@dataclasses.dataclass(frozen=True)
class NamedDataset:
    tfds_name: str  # with its config, e.g. 'c4/en'
    text_key: str
    splits: Mapping[str, str]  # our split -> the data set's split


NAMED_DATASETS = {
    "pg19": NamedDataset("pg19", "book_text", {"train": "train", "validation": "validation", "test": "test"}),
    # lm1b has no validation split: its test split serves as both.
    "lm1b": NamedDataset("lm1b", "text", {"train": "train", "validation": "test", "test": "test"}),
    # c4 publishes no test split: its validation split serves as both.
    "c4": NamedDataset("c4/en", "text", {"train": "train", "validation": "validation", "test": "validation"}),
}
DATASETS = ("local_text", *NAMED_DATASETS)


class TextSource(NamedTuple):
    """One split of a corpus, read by random access."""

    records: Sequence[Mapping[str, Any]]  # a tfds ArrayRecord data source: len() and [i]
    text_key: str
    path_key: str | None  # a key giving documents a fixed order, if the corpus has one
    corpus_id: str  # names the corpus in caches (tokenizer models)


def _prepare_command(tfds_name: str, data_dir: str) -> str:
    return f"tfds build {tfds_name} --file_format=array_record --data_dir={data_dir}"


def _named_split(dataset: NamedDataset, data_dir: str, split: str) -> Sequence[Mapping[str, Any]]:
    # Look for a prepared version ourselves: asking TFDS about an absent data set creates
    # empty folders and may try to download it.
    if not glob.glob(os.path.join(data_dir, dataset.tfds_name, "*", "dataset_info.json")):
        raise DataError(
            f"Data set {dataset.tfds_name!r} is not prepared in {data_dir}. Prepare it on a machine "
            f"with network access (and copy {data_dir} here if needed):\n"
            f"  {_prepare_command(dataset.tfds_name, data_dir)}"
        )
    try:
        return tfds.data_source(
            dataset.tfds_name, data_dir=data_dir, split=dataset.splits[split], download=False
        )
    except NotImplementedError as e:  # prepared as TFRecord, which has no random access
        raise DataError(
            f"Data set {dataset.tfds_name!r} in {data_dir} is not in ArrayRecord format. Rebuild it:\n"
            f"  {_prepare_command(dataset.tfds_name, data_dir)}"
        ) from e


def open_split(config: ml_collections.ConfigDict, split: str) -> TextSource:
    """One split ('train', 'validation' or 'test') of the corpus `config` (the `data` section)
    names, preparing a local text corpus on first use.
    """
    if split not in SPLITS:
        raise ValueError(f"Unknown split {split!r}; valid splits: {', '.join(SPLITS)}.")
    if config.name == "local_text":
        suffixes = [s.strip() for s in config.suffixes.split(",") if s.strip()]
        name = prepare(config.data_dir, config.source_dir, suffixes).builder_config.name
        records = tfds.data_source(
            f"local_text/{name}", data_dir=config.data_dir, split=split, download=False
        )
        return TextSource(records, "text", "path", name)
    if config.name in NAMED_DATASETS:
        dataset = NAMED_DATASETS[config.name]
        records = _named_split(dataset, config.data_dir, split)
        return TextSource(records, dataset.text_key, None, dataset.tfds_name.replace("/", "-"))
    raise ValueError(f"Unknown data set {config.name!r}; valid names: {', '.join(DATASETS)}.")
