"""Defaults of the `config.data` section shared by every experiment."""

from __future__ import annotations

import os

import ml_collections


def default_data_config() -> ml_collections.ConfigDict:
    """The `data` section of an experiment config.

    Fields:
      name: 'local_text' (a directory of text files), a prepared TFDS data set: 'pg19',
        'lm1b', 'c4', or a synthetic task (`data.tasks`): 'symbolsoup', 'diffuse_mqar'.
      source_dir: for 'local_text'; '' means the default corpus, the Python sources of two
        pinned releases from PyPI (`data.corpus`: sympy 1.13.3 and Django 5.1.4, fetched and
        hash-checked once), the same on every machine; a .jsonl or .parquet file is a corpus of
        one document per record (its 'text' field).
      suffixes: comma-separated file suffixes read from `source_dir` (the default corpus is
        always its *.py files).
      data_dir: where TFDS files and tokenizer models go: $POSITIONAL_DATA_DIR, else
        ~/.cache/positional.
      tokenizer: 'byte', 'sentencepiece' (trained on the train split, cached in data_dir), or 'hf':
        a pretrained model's own (`data.tokenizers.PretrainedTokenizer`), at tokenizer_path.
      tokenizer_path: for 'hf': a checkpoint directory (tokenizer.json, else tokenizer.model, else
        *.tiktoken, and the files naming its special tokens) or one tokenizer file.
      spm_vocab_size: vocabulary size of the sentencepiece model.
      streams: independent document streams the training batch is made of (`pipeline.Streams`);
        each process loads only the streams of its rows, so its rows must be whole streams (one
        per row always works). The batch depends on it, not on how many processes load it.
      retrieval_mix: the fraction of training rows replaced by a retrieval example (passkey or
        needles in the row's own text: `data.needles.mix_row`), 0 for none.
      retrieval_tasks: comma-separated tasks of that mix (`data.needles.TASKS`).
      retrieval_answer_weight: the training-loss weight of each answer token of a mixed
        retrieval example, relative to every other token (1: the plain LM loss, where a 5-token
        answer in a 256-token row is 2% of that row's loss). Other than 1, every row carries a
        per-token 'loss_weight'.
      task: a synthetic task's options (`data.tasks.default_options(name)` lists them all;
        missing ones take their defaults).
    """
    return ml_collections.ConfigDict(
        dict(
            name="local_text",
            source_dir="",
            suffixes=".py,.txt,.md,.rst",
            data_dir=os.environ.get(
                "POSITIONAL_DATA_DIR", os.path.join(os.path.expanduser("~"), ".cache", "positional")
            ),
            tokenizer="byte",
            tokenizer_path="",
            spm_vocab_size=8192,
            streams=1,
            retrieval_mix=0.0,
            retrieval_tasks="passkey",
            retrieval_answer_weight=1.0,
            task=ml_collections.ConfigDict({}),
        )
    )
