"""Shared test set-up: a private data dir and tiny configs for the training / eval tests, for every
folder below (a test file sits in the folder of the package it mainly tests: tests/README.md)."""

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Before any config is built: the embedded corpus is prepared once per test session in a
# private directory (about 2 s), never in the user's cache, and removed when the session ends
# (by the process that made it: pytest-xdist's workers inherit the variable).
DATA_DIR = None
if "POSITIONAL_DATA_DIR" not in os.environ:
    DATA_DIR = os.environ["POSITIONAL_DATA_DIR"] = tempfile.mkdtemp(prefix="positional-test-data-")

from helpers.maps import release_programs  # noqa: E402
from lab.lowering import CompilerMissing  # noqa: E402
from helpers.tiny_setup import tiny_config  # noqa: E402


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One trained tiny run (12 steps, checkpoints at 4, 8, 12), shared by read-only tests."""
    from lab.training import train
    config = tiny_config(tmp_path_factory.mktemp("runs") / "rope")
    return config, train(config)


# A pytest-xdist worker that dies on a signal (a segfault, an illegal instruction) leaves only
# "node down" in the report: each worker writes its fault trace to a file of the directory the
# controlling process made, and the controller prints the traces it finds in its summary.
FAULT_DIR = None
if "POSITIONAL_TEST_FAULTS" not in os.environ:
    FAULT_DIR = os.environ["POSITIONAL_TEST_FAULTS"] = tempfile.mkdtemp(prefix="positional-test-faults-")
_fault_file = None


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler, which writes to the lost stderr
def pytest_configure(config):
    global _fault_file
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        _fault_file = open(Path(os.environ["POSITIONAL_TEST_FAULTS"]) / f"{worker}.txt", "w")
        faulthandler.enable(file=_fault_file, all_threads=True)  # a thread beside the crash shows too


def pytest_terminal_summary(terminalreporter):
    for trace in sorted(Path(FAULT_DIR).glob("*.txt")) if FAULT_DIR else ():
        if text := trace.read_text().strip():
            terminalreporter.write_sep("=", f"fault trace of worker {trace.stem}")
            terminalreporter.write_line(text)


def pytest_unconfigure(config):
    for made in (DATA_DIR, FAULT_DIR):
        if made:
            shutil.rmtree(made, ignore_errors=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """A check that compiles for an accelerator whose compiler is not installed here (`make` could
    not install it: lab.lowering.CompilerMissing) is skipped, with the install's line as the reason."""
    try:
        return (yield)
    except CompilerMissing as e:
        pytest.skip(str(e))


@pytest.fixture(autouse=True)
def private_tmp(tmp_path_factory, monkeypatch):
    """What a test (or a command it runs) writes to the system's temporary directory (an
    emergency checkpoint, an errors file) goes under pytest's own, which pytest prunes."""
    where = str(tmp_path_factory.mktemp("tmp"))
    monkeypatch.setattr(tempfile, "tempdir", where)
    monkeypatch.setenv("TMPDIR", where)


@pytest.fixture(autouse=True)
def bounded_memory_maps():
    """After each test: JAX's caches cleared in a process near its memory-map limit (helpers/maps.py)."""
    yield
    release_programs()
