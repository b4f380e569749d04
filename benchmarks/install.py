"""The locked install of .venv (what `make demo` installs: pyproject.toml's dependencies with the
extras test and hf, at lock/main.txt's versions, hashes checked), by uv as the Makefile does it
and by pip from the same pins, each into a new venv, with an empty download cache (cold) and
again with the cache the first left (warm). Prints seconds and the ratio pip / uv.

    .venv/bin/python benchmarks/install.py [--tools uv,pip]

Needs the network (PyPI) and about 4 GB of disk in a temporary folder; uv is the one `make`
installs in .venv (lock/tools.txt), pip the one it installs in each new venv.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

from absl import app, flags

ROOT = Path(__file__).resolve().parents[1]
UV = Path(sys.prefix) / "bin" / "uv"

flags.DEFINE_list("tools", ["uv", "pip"], "installers to time")
FLAGS = flags.FLAGS


def run(*command) -> None:
    subprocess.run([str(c) for c in command], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def install(tool: str, venv: Path, cache: Path, pins: Path) -> float:
    """Seconds to install the locked set into a new venv (the venv and its installers are made first, untimed)."""
    run(sys.executable, "-m", "venv", venv)
    run(venv / "bin" / "python", "-m", "pip", "--isolated", "install", "--quiet", "--require-hashes", "--no-deps",
        "-r", ROOT / "lock" / "tools.txt")
    start = time.perf_counter()
    if tool == "uv":  # the Makefile's command
        run(UV, "pip", "install", "--quiet", "--cache-dir", cache, "--python", venv / "bin" / "python",
            "-c", "lock/main.txt", "-b", "lock/tools.txt", "-e", ".[test,hf]")
    else:  # the same pins and hashes, by pip (--isolated: no pip.conf, no extra index or wheel folder)
        pip = [venv / "bin" / "python", "-m", "pip", "--isolated", "install", "--quiet", "--cache-dir", cache, "--no-deps"]
        run(*pip, "--require-hashes", "-r", pins)
        run(*pip, "--no-build-isolation", "-e", ".")
    return time.perf_counter() - start


def size(path: Path) -> int:
    return int(subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True).stdout.split()[0])


def main(argv):
    del argv
    with tempfile.TemporaryDirectory(prefix="install-bench-") as tmp:
        tmp = Path(tmp)
        pins = tmp / "venv.txt"  # .venv's part of the lock, every package pinned with its hashes
        run(UV, "pip", "compile", "--quiet", "--python", sys.executable, "pyproject.toml", "--extra", "test",
            "--extra", "hf", "-c", "lock/main.txt", "--generate-hashes", "--no-header", "-o", pins)
        seconds = {}
        for tool in FLAGS.tools:
            cache = tmp / f"cache-{tool}"
            for state in ("cold", "warm"):
                venv = tmp / f"venv-{tool}-{state}"
                seconds[tool, state] = install(tool, venv, cache, pins)
                print(f"{tool} {state}: {seconds[tool, state]:.1f} s, venv {size(venv) / 2 ** 30:.2f} GiB, "
                      f"download cache {size(cache) / 2 ** 30:.2f} GiB", flush=True)
        if set(FLAGS.tools) == {"uv", "pip"}:
            for state in ("cold", "warm"):
                print(f"{state}: pip / uv = {seconds['pip', state] / seconds['uv', state]:.1f}x")


if __name__ == "__main__":
    app.run(main)
