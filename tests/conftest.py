"""Shared test set-up: a private data dir and tiny configs for the training / eval tests, for every
folder below (a test file sits in the folder of the package it mainly tests: tests/README.md)."""

import os
import tempfile

# Before any config is built: the embedded corpus is prepared once per test session in a
# private directory (about 2 s), never in the user's cache.
os.environ.setdefault("POSITIONAL_DATA_DIR", tempfile.mkdtemp(prefix="positional-test-data-"))

import pytest

from helpers.tiny_setup import tiny_config


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One trained tiny run (12 steps, checkpoints at 4, 8, 12), shared by read-only tests."""
    from lab.training import train
    config = tiny_config(tmp_path_factory.mktemp("runs") / "rope")
    return config, train(config)
