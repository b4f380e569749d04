"""Runs that cannot be lost: one trainer per workdir (a lock naming its holder, taken over
when its holder died), and config values checked before any work, one line each."""

import os
import socket
import subprocess
import sys

import pytest

from data import DataError
from lab.training import dry_run, train, workdir_lock
from tiny_setup import ROOT, cli, overrides, tiny_config


def test_a_second_trainer_on_a_held_workdir_stops_at_once_naming_the_holder(tmp_path):
    with workdir_lock(str(tmp_path)):
        run = cli("train.py", "--config", "configs/default.py", *overrides(tiny_config(tmp_path)))
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {tmp_path} is in use by ")
    assert f"{socket.gethostname()} pid {os.getpid()}" in lines[0]
    assert os.listdir(tmp_path) == ["lock"]  # it stopped before writing or preparing anything


def test_a_dead_holders_lock_is_taken_over_with_a_warning_and_every_exit_releases_it(tmp_path, capsys):
    # A holder that dies without releasing (os._exit: no finally runs, as under SIGKILL).
    dead = subprocess.run([sys.executable, "-c", "import os; from lab.training import workdir_lock; "
                           f"lock = workdir_lock({str(tmp_path)!r}); lock.__enter__(); print(os.getpid()); os._exit(0)"],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    train(tiny_config(tmp_path, steps=2, checkpoint_every=2))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "lock" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: ")
    assert f"{socket.gethostname()} pid {int(dead.stdout)}" in warnings[0]

    def released_cleanly():
        with workdir_lock(str(tmp_path)):
            pass
        return "lock" not in capsys.readouterr().err

    assert released_cleanly()  # after a normal end
    failing = tiny_config(tmp_path, steps=4)
    failing.data.source_dir = str(tmp_path / "no_such_dir")
    with pytest.raises(DataError):
        train(failing)
    assert released_cleanly()  # after an error


# (field, bad value, the error's start, through train.py too): every row through train() and
# dry_run(); a few through the command line as well (a subprocess costs ~5 s).
BAD_VALUES = [
    ("seq_len", 0, "seq_len=0; valid: an integer >= 1", False),
    ("batch_size", -8, "batch_size=-8; valid: an integer >= 1", False),
    ("train.steps", -3, "train.steps=-3; valid: an integer >= 1", True),
    ("train.checkpoint_every", 0, "train.checkpoint_every=0; valid: an integer >= 1", False),
    ("train.log_every", 0, "train.log_every=0; valid: an integer >= 1", False),
    ("train.keep_checkpoints", 0, "train.keep_checkpoints=0; valid: an integer >= 1", True),
    ("train.lr", 0.0, "train.lr=0.0; valid: a number > 0", False),
    ("train.explode_factor", 0.5, "train.explode_factor=0.5; valid: a number > 1, or 0", False),
    ("mesh.fsdp", 0, "mesh.fsdp=0; valid: an integer >= 1, or -1", True),
    ("mesh.data", -2, "mesh.data=-2; valid: an integer >= 1, or -1", False),
    ("model.d_model", 0, "model.d_model=0; valid: an integer >= 1", False),
    ("model.num_layers", 0, "model.num_layers=0; valid: an integer >= 1", False),
    ("model.num_heads", 0, "model.num_heads=0; valid: an integer >= 1", False),
    ("model.num_kv_heads", 3, "model.num_heads=2 must be a multiple of model.num_kv_heads=3", False),
    ("model.dtype", "float8", "model.dtype='float8'; valid: float32, bfloat16, float16", True),
]


@pytest.mark.parametrize("field,value,error,through_cli", BAD_VALUES)
def test_a_bad_value_is_one_line_naming_the_field_before_any_work(tmp_path, field, value, error, through_cli):
    config = tiny_config(tmp_path / "run")
    *groups, name = field.split(".")
    node = config
    for group in groups:
        node = node[group]
    node[name] = value
    for fn in (train, dry_run):
        with pytest.raises(ValueError) as raised:
            fn(config)
        assert str(raised.value).startswith(error)
    assert not (tmp_path / "run").exists()
    if through_cli:
        run = cli("train.py", "--config", "configs/default.py", *overrides(config), f"--config.{field}={value}")
        assert run.returncode == 1
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: {error}")
        assert not (tmp_path / "run").exists()


def test_steps_zero_is_valid_only_with_init_from(tmp_path):
    config = tiny_config(tmp_path / "run", steps=0)
    with pytest.raises(ValueError, match=r"train.steps=0; valid: an integer >= 1 \(0 with init_from"):
        train(config)
