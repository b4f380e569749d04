"""The install (Makefile, lock/): the lock is current with pyproject.toml, a stale lock or an old
Python is one line before anything changes, and a compiler for an accelerator that cannot be
installed is one line, the install goes on, and the checks that need it are skipped with that line."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
UV = Path(sys.prefix) / "bin" / "uv"  # `make` installs uv in the venv, from lock/tools.txt
MADE_BY_MAKE = pytest.mark.skipif(not UV.is_file(), reason="an environment `make` did not install (no uv in it)")


def make(*args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "-s", *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def without_libtpu_path() -> dict:
    """This process's environment less TPU_LIBRARY_PATH, which lab.lowering sets where a test of this
    worker compiled for TPU (JAX would find libtpu through it)."""
    return {key: value for key, value in os.environ.items() if key != "TPU_LIBRARY_PATH"}


def project_copy(tmp_path: Path) -> Path:
    """What `make` reads, copied: the Makefile, pyproject.toml and lock/."""
    copy = tmp_path / "project"
    copy.mkdir()
    for name in ("Makefile", "pyproject.toml", ".python-version"):
        shutil.copy(ROOT / name, copy / name)
    shutil.copytree(ROOT / "lock", copy / "lock")
    return copy


def test_the_lock_is_made_from_pyproject_as_it_is():
    run = make("check-lock", f"PYTHON={sys.executable}")
    assert run.returncode == 0, run.stderr


def test_a_dependency_added_without_make_lock_is_one_line_and_nothing_is_installed(tmp_path):
    copy = project_copy(tmp_path)
    text = (copy / "pyproject.toml").read_text()
    (copy / "pyproject.toml").write_text(text.replace('  "scipy>=1.12",', '  "scipy>=1.12",\n  "six>=1.16",', 1))
    run = make("test", f"PYTHON={sys.executable}", cwd=copy)
    assert run.returncode != 0 and run.stderr.count("\n") == 1, run.stderr
    assert ("lock/main.txt was not made from pyproject.toml's dependencies as they are now (changed without "
            "`make lock`): run make lock") in run.stderr
    assert not (copy / ".venv").exists()


def test_an_old_python_is_one_line(tmp_path):
    old = shutil.which("python3.11") or shutil.which("python3.10")
    if old is None:
        pytest.skip("no Python older than 3.12 on this machine")
    run = make("test", f"PYTHON={old}", cwd=project_copy(tmp_path))
    assert run.returncode != 0 and run.stderr.count("\n") == 1, run.stderr
    assert f"make needs Python >= 3.12 (found: {old}): install one, or run make PYTHON=/path/to/python3.12" in run.stderr


@MADE_BY_MAKE
def test_a_compiler_that_cannot_be_installed_is_one_line_and_its_checks_skip(tmp_path):
    """The releases of libtpu and of jax's CUDA plugin hidden from uv (uploaded 'before 2000'): the
    compilers' step of `make` prints one line for each, naming the release the installed JAX asks
    for, and succeeds; the compile checks then skip, each with that line as its reason."""
    venv = tmp_path / "venv"
    subprocess.run([UV, "venv", "--quiet", "--python", sys.executable, venv], check=True)
    subprocess.run([UV, "pip", "install", "--quiet", "--python", venv / "bin" / "python", "-c", ROOT / "lock" / "main.txt",
                    "jax", "jaxlib"], check=True)
    (venv / "bin" / "uv").symlink_to(UV)
    (venv / ".installed").touch()  # the venv itself counts as installed: only its compilers are made
    hidden = tmp_path / "uv.toml"
    hidden.write_text('[pip]\nexclude-newer-package = { libtpu = "2000-01-01T00:00:00Z", '
                      'jax-cuda13-plugin = "2000-01-01T00:00:00Z" }\n')
    run = make(f"{venv}/.compilers", f"VENV={venv}", f"PYTHON={sys.executable}", env={"UV_CONFIG_FILE": str(hidden)})
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2, run.stdout
    # e.g. "libtpu (extra tpu, for jax 0.12.0.1) could not be installed: Because there is no version of
    # libtpu==0.0.50.1 and jax[tpu]==0.12.0.1 depends on libtpu==0.0.50.1, ...; the checks that need it are skipped"
    v = re.escape(jax.__version__)
    assert re.match(rf"libtpu \(extra tpu, for jax {v}\) could not be installed: Because there is no version of "
                    rf"libtpu==(\S+) and jax\[tpu\]=={v} depends on libtpu==\1\b", lines[0]), lines[0]
    assert re.match(r"jax-cuda13-plugin jax-cuda13-pjrt nvidia-cuda-nvcc nvidia-nvvm nvidia-cuda-crt \(extra "
                    rf"cuda-compile, for jax {v}\) could not be installed: Because there is no version of "
                    r"jax-cuda13-plugin==", lines[1]), lines[1]
    assert all(line.endswith(" -- the checks that need it are skipped") for line in lines)
    assert (venv / "libtpu.missing").read_text().strip() == lines[0]
    assert (venv / ".compilers").is_file() and not (venv / "libtpu").exists() and not (venv / "cuda").exists()

    checks = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:xdist", "-p", "no:cacheprovider",
                             "tests/project/test_compile.py", "-k", "compiles_for_tpu or compiles_for_gpu or gpu_hosts"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600,
                            env={**without_libtpu_path(), "POSITIONAL_COMPILERS": str(venv)})
    assert checks.returncode == 0, checks.stdout[-3000:]
    # Every check selected (those of `make test`: the slow ones are deselected) skips, none fails.
    assert re.fullmatch(r"[3-9] skipped(, \d+ deselected)? in [\d.]+s", checks.stdout.splitlines()[-1]), \
        checks.stdout[-3000:]
    summary = [line for line in checks.stdout.splitlines() if line.startswith("SKIPPED")]
    assert {line.split(": ", 1)[1] for line in summary} == set(lines), summary
