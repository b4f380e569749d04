"""Shared test set-up: a private data dir and tiny configs for the training / eval tests, for every
folder below (a test file sits in the folder of the package it mainly tests: tests/README.md)."""

import os
import shutil
import tempfile

import pytest

# Before any config is built: the embedded corpus is prepared once per test session in a
# private directory (about 2 s), never in the user's cache, and removed when the session ends
# (by the process that made it: pytest-xdist's workers inherit the variable).
DATA_DIR = None
if "POSITIONAL_DATA_DIR" not in os.environ:
    DATA_DIR = os.environ["POSITIONAL_DATA_DIR"] = tempfile.mkdtemp(prefix="positional-test-data-")

from helpers.tiny_setup import tiny_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One trained tiny run (12 steps, checkpoints at 4, 8, 12), shared by read-only tests."""
    from lab.training import train
    config = tiny_config(tmp_path_factory.mktemp("runs") / "rope")
    return config, train(config)


def pytest_unconfigure(config):
    if DATA_DIR:
        shutil.rmtree(DATA_DIR, ignore_errors=True)


@pytest.fixture(autouse=True)
def private_tmp(tmp_path_factory, monkeypatch):
    """What a test (or a command it runs) writes to the system's temporary directory (an
    emergency checkpoint, an errors file) goes under pytest's own, which pytest prunes."""
    where = str(tmp_path_factory.mktemp("tmp"))
    monkeypatch.setattr(tempfile, "tempdir", where)
    monkeypatch.setenv("TMPDIR", where)
