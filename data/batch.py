"""The batch contract: what the training loaders yield, and what the loss, the train step,
the dry run and the task evaluator read.

A batch is a dict of arrays [rows, length] (a loader's rows hold seq_len + 1 tokens: inputs
[:, :-1], targets [:, 1:]):
  tokens       int32    token ids.
  segment_ids  int32    1, 2, ... for the documents of a row, 0 on padding.
  positions    int32    each token's position from the start of its piece of a document.
  loss_weight  float32  optional: the loss weight of each token as a target (0: not scored).
               A synthetic task's rows carry it (1 on answer tokens, 0 elsewhere), as does a
               retrieval mix whose answers weigh other than 1; without it every target inside
               a document weighs 1.

`pipeline.batch_keys(config)` says which keys a config's loader yields; the dry run compiles
the train step for exactly those.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import numpy as np


class Batch(TypedDict):
    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    loss_weight: NotRequired[np.ndarray]


DTYPES = {"tokens": np.int32, "segment_ids": np.int32, "positions": np.int32, "loss_weight": np.float32}
REQUIRED = ("tokens", "segment_ids", "positions")
