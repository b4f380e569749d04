"""What a result was computed with, recorded in every results json the project writes, so that a
number can be traced to the install that gave it (and `make` in a fresh clone gives that install
again: the lock, README "The two commands").

The record: Python's version, the installed versions of the packages that decide the numbers,
and the lock the environment was installed from, by its SHA-256 (`make` writes it in
<venv>/installed-from; None for an environment `make` did not install, such as the lent GPU
machine's).
"""

from __future__ import annotations

import json
import os
import platform
import sys
from importlib import metadata

from lab import files

# The distributions whose release moves the numbers (XLA's code generation, the initialisers, the
# optimizer, the data's arithmetic).
PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy")
INSTALLED_FROM = "installed-from"  # in the environment's folder: "<lock file> sha256:<hex>"


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """{"python": "3.12.1", "jax": ..., "jaxlib": ..., "flax": ..., "optax": ..., "numpy": ...,
    "lock": "lock/main.txt sha256:<hex>" or None}."""
    record = os.path.join(sys.prefix, INSTALLED_FROM)
    lock = open(record).read().strip() if os.path.isfile(record) else None
    return {"python": platform.python_version(), **{name: installed_version(name) for name in PACKAGES},
            "lock": lock}


def stamped(results: dict) -> dict:
    """`results` with the environment it was computed in (key "environment")."""
    return {**results, "environment": environment()}


def write_results(path: str, results: dict, indent: int | None = None) -> None:
    """A results json: `results` with its environment, written to `path` (a local path or a URI)."""
    files.write_text(path, json.dumps(stamped(results), indent=indent))


def describe(env: dict) -> str:
    """One line for a results page: "Python 3.12.1, jax 0.12.0.1, ..., installed from lock/main.txt (sha256
    1a2b3c4d5e6f)"."""
    versions = ", ".join([f"Python {env['python']}"] + [f"{name} {env.get(name)}" for name in PACKAGES])
    if not env.get("lock"):
        return versions + ", not installed from the lock"
    lock, digest = env["lock"].split(" sha256:")
    return versions + f", installed from {lock} (sha256 {digest[:12]})"
