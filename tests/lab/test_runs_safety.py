"""Runs that cannot be lost: one trainer per workdir (a lock naming its holder, taken over
when its holder died), a rerun with another model refused, a corrupt newest checkpoint set aside
with the metrics cut back to the resumed step, write failures as one line after an emergency
save, and config values checked before any work, one line each."""

import errno
import glob
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest

from lab import training
from lab.checkpoints import checkpoint_manager, load_params
from lab.training import TrainingError, dry_run, train, workdir_lock
from helpers.tiny_setup import ROOT, abstract_params, cli, overrides, tiny_config


def tree_bytes(root):
    """{relative path: bytes} of every file under root."""
    out = {}
    for path in glob.glob(os.path.join(root, "**"), recursive=True):
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = f.read()
    return out


def metric_lines(workdir, name="metrics.jsonl"):
    with open(os.path.join(workdir, name)) as f:
        return [json.loads(line) for line in f]


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
    with pytest.raises(TrainingError, match="different model"):  # another data source on this workdir
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
    ("train.keep_checkpoints", 0, "train.keep_checkpoints=0; valid: an integer >= 1", "slow"),
    ("train.lr", 0.0, "train.lr=0.0; valid: a number > 0", False),
    ("train.explode_factor", 0.5, "train.explode_factor=0.5; valid: a number > 1, or 0", False),
    ("mesh.fsdp", 0, "mesh.fsdp=0; valid: an integer >= 1, or -1", "slow"),
    ("mesh.data", -2, "mesh.data=-2; valid: an integer >= 1, or -1", False),
    ("model.d_model", 0, "model.d_model=0; valid: an integer >= 1", False),
    ("model.num_layers", 0, "model.num_layers=0; valid: an integer >= 1", False),
    ("model.num_heads", 0, "model.num_heads=0; valid: an integer >= 1", False),
    ("model.num_kv_heads", 3, "model.num_heads=2 must be a multiple of model.num_kv_heads=3", False),
    ("model.dtype", "float8", "model.dtype='float8'; valid: float32, bfloat16, float16", "slow"),
    ("distributed.timeout_s", -5, "distributed.timeout_s=-5; valid: a number of seconds > 0", "slow"),
    ("model.scheme_options.base", "abc", "scheme 'rope' option base='abc' must be a number; set it as "
     "model.scheme_options.base=<float>", True),
]


# through_cli: also through train.py's command line ("slow": that part in `make test-slow` only;
# the command line's path is the same for every field, and two fields take it in `make test`).
@pytest.mark.parametrize("field,value,error,through_cli",
                         [case for case in BAD_VALUES if case[3] != "slow"]
                         + [(*case[:3], False) for case in BAD_VALUES if case[3] == "slow"]
                         + [pytest.param(*case[:3], True, marks=pytest.mark.slow) for case in BAD_VALUES
                            if case[3] == "slow"])
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


def test_a_rerun_with_another_model_is_refused_and_changes_nothing(tiny_run, tmp_path):
    config, _ = tiny_run
    workdir = tmp_path / "run"
    shutil.copytree(config.workdir, workdir)
    os.remove(workdir / "lock")
    before = tree_bytes(workdir)
    changed = tiny_config(workdir, steps=20)
    changed.model.d_model, changed.model.scheme = 48, "alibi"
    with pytest.raises(TrainingError) as e:
        train(changed)
    assert "\n" not in str(e.value)
    assert str(e.value) == (
        f"{workdir} holds the checkpoints of a different model (model.d_model 32 -> 48, model.scheme 'rope' -> "
        f"'alibi'); nothing was changed. Give this run another --config.workdir, or start it from that run's "
        f"parameters with --config.init_from={workdir}")
    after = tree_bytes(workdir)
    assert after.pop("lock") == b"" and after == {k: v for k, v in before.items()}
    # How attention is computed is not the model: the same run goes on with another impl.
    same = tiny_config(workdir, steps=13)
    same.model.attention_impl = "blockwise"
    assert train(same)["step"] == 13


def corrupt_arrays(d):
    for f in glob.glob(os.path.join(d, "state", "ocdbt.process_0", "d", "*")):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def corrupt_manifest(d):
    os.remove(os.path.join(d, "state", "manifest.ocdbt"))


def corrupt_meta(d):
    with open(os.path.join(d, "meta", "metadata"), "w") as f:
        f.write("{garbage")


def corrupt_loader(d):
    open(os.path.join(d, "loader", "metadata"), "w").close()


def corrupt_bits(d):
    """Flip 16 bytes in the middle of the largest array file: orbax restores it without a word
    (it keeps no checksums); the checksums stored in meta find it."""
    f = max(glob.glob(os.path.join(d, "state", "ocdbt.process_0", "d", "*")), key=os.path.getsize)
    with open(f, "r+b") as fh:
        data = bytearray(fh.read())
        middle = len(data) // 2
        data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
        fh.seek(0)
        fh.write(data)


CORRUPTIONS = [corrupt_arrays, corrupt_manifest, corrupt_meta, corrupt_loader, corrupt_bits]


@pytest.mark.parametrize("corrupt", [c if c in (corrupt_arrays, corrupt_bits) else pytest.param(c, marks=pytest.mark.slow)
                                     for c in CORRUPTIONS], ids=lambda f: getattr(f, "__name__", ""))
def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_run_goes_on(tiny_run, tmp_path, capsys, corrupt):
    config, summary = tiny_run
    workdir = tmp_path / "run"
    shutil.copytree(config.workdir, workdir)
    corrupt(str(workdir / "checkpoints" / "12"))
    (workdir / "checkpoints" / "16.orbax-checkpoint-tmp-3").mkdir()  # a save a SIGKILL cut short
    rerun = config.copy_and_resolve_references()
    rerun.workdir = str(workdir)
    resumed = train(rerun)
    err = capsys.readouterr().err
    assert resumed["step"] == 12 and resumed["losses"] == summary["losses"][8:]  # bitwise
    assert sorted(os.listdir(workdir / "checkpoints")) == ["12", "4", "8"]
    aside = sorted(os.listdir(workdir / "checkpoints.unreadable"))
    assert [name.split("-")[0] for name in aside] == ["12", "16.orbax"]
    assert f"skipping unreadable checkpoint at step 12 in {workdir / 'checkpoints'}; moved to " in err
    assert f"{workdir / 'checkpoints' / '16.orbax-checkpoint-tmp-3'} is a save a stopped run did not finish" in err
    # Each step is logged once: the lines of steps 9-12 from before the rerun are kept aside.
    assert [r["step"] for r in metric_lines(workdir)] == list(range(1, 13))
    assert [r["loss"] for r in metric_lines(workdir)] == summary["losses"]
    assert [r["step"] for r in metric_lines(workdir, "metrics.dropped.jsonl")] == [9, 10, 11, 12]
    # A second rerun finds nothing to repair (before: 'Checkpoint for step 12 already exists').
    assert train(rerun)["step"] == 12 and "warning" not in capsys.readouterr().err


def test_a_line_cut_off_mid_write_is_moved_aside(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo')
    training.cut_metrics(str(path), 2)
    assert path.read_text() == '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n'
    assert (tmp_path / "metrics.dropped.jsonl").read_text() == '{"step": 3, "lo\n'


def test_a_failed_metrics_write_is_one_line_after_an_emergency_save(tmp_path, capsys):
    config = tiny_config(tmp_path, steps=12)
    (tmp_path / "metrics.jsonl").mkdir()  # unwritable as a file, even for root
    with pytest.raises(TrainingError) as e:
        train(config)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"cannot write {tmp_path / 'metrics.jsonl'} (IsADirectoryError: ")
    assert ("Free space or fix permissions; no checkpoint is complete (a rerun starts from step 0); the state of "
            "step 2 was saved to ") in message
    assert f"move it into {tmp_path / 'checkpoints'} to continue from it" in message
    where = message.split("was saved to ")[1].split(" ")[0]
    step, params = load_params(os.path.dirname(where), abstract_params(config))
    assert step == 2


def test_warnings_at_exit_after_a_failure_go_to_the_file(tmp_path):
    """After a failed run, what Python warns as it exits (here a coroutine freed unawaited, as
    a write cut off by a full disk leaves) goes to the run's errors file, not after the error
    line on the terminal; before the failure was closed, warnings still reach the terminal."""
    errors = tmp_path / "errors.log"
    script = (
        "import sys, warnings\n"
        "from lab.training import _BackgroundOutput\n"
        "async def write(): pass\n"
        f"out = _BackgroundOutput({str(errors)!r})\n"
        "out.close(keep_filter=True)\n"
        "warnings.warn('while running', UserWarning)\n"
        "print('error: the one line', file=sys.stderr)\n"
        "pending = write()  # freed at exit, never awaited\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "error: the one line", done.stderr
    assert "while running" in done.stderr
    assert "coroutine 'write' was never awaited" in errors.read_text()


def test_a_failed_save_is_one_line_naming_the_last_checkpoint(tmp_path, monkeypatch):
    config = tiny_config(tmp_path, steps=12)
    real = training.save

    def full_disk(manager, state, *args):
        if int(state["step"]) == 8 and str(tmp_path) in str(manager.directory):
            raise ValueError("RESOURCE_EXHAUSTED: Failed to write 156816 bytes: No space left on device")
        return real(manager, state, *args)

    monkeypatch.setattr(training, "save", full_disk)
    with pytest.raises(TrainingError) as e:
        train(config)
    message = str(e.value)
    assert message.startswith(f"cannot write checkpoint 8 in {tmp_path / 'checkpoints'} (ValueError: "
                              "RESOURCE_EXHAUSTED")
    assert ("Free space or fix permissions; the newest complete checkpoint is step 4 in "
            f"{tmp_path / 'checkpoints'} (a rerun resumes from it); the state of step 8 was saved to ") in message
    monkeypatch.setattr(training, "save", real)
    assert train(config)["step"] == 12  # from step 4, once there is room again



@pytest.fixture
def small_disk(tmp_path):
    """A 3 MiB tmpfs (five of the tiny model's checkpoints fill it), mounted for the test."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN); the failed-write tests above simulate the error")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def fill(path) -> None:
    """Write zeros to `path` until its disk has no byte left."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, bytes(1 << 16))
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)
    assert shutil.disk_usage(os.path.dirname(path)).free == 0


@pytest.mark.slow  # 30 s
def test_a_full_disk_twice_is_one_true_line_each_time_and_nothing_is_lost(small_disk, tmp_path):
    """train.py on a disk that fills up: one line naming the write that failed, the newest
    complete checkpoint and the emergency save of the live state (orbax's tracebacks in a log,
    not on the terminal). Rerun on the disk filled to its last byte: one line again, naming the
    same checkpoint, nothing trained. With room again, the emergency save moved into place resumes
    the run, which logs the losses of a run that never failed."""
    workdir = small_disk / "run"
    flags = [*overrides(tiny_config(workdir)), "--config.train.steps=40", "--config.train.checkpoint_every=4"]
    first = cli("train.py", "--config", "configs/default.py", *flags)
    assert first.returncode == 1
    *before, line = first.stderr.strip().splitlines()  # before: preparing the corpus, on a first run
    assert not [b for b in before if "Traceback" in b or "orbax" in b or "rror" in b], first.stderr[-3000:]
    assert line.startswith("error: cannot write ") and "No space left on device" in line, line
    complete = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    assert 0 < len(complete) < 10
    assert f"the newest complete checkpoint is step {complete[-1]} in {workdir / 'checkpoints'}" in line
    emergency = line.split("was saved to ")[1].split(" ")[0]
    step = int(os.path.basename(emergency))
    assert step > complete[-1] and os.path.isdir(emergency)
    log = line.split("the writers' own messages: ")[1].rstrip(")")
    assert "Traceback" in open(log).read()

    # The disk filled to the last page: what the failed run left free (the pages of its files
    # it emptied as it stopped) would let a rerun train a few steps, and fail where chance puts it.
    fill(small_disk / "filler")
    again = cli("train.py", "--config", "configs/default.py", *flags)
    assert again.returncode == 1
    *before, line = again.stderr.strip().splitlines()
    assert not before, before
    assert line.startswith(f"error: cannot write {workdir / 'lock'} (") and line.endswith(
        f"the newest complete checkpoint is step {complete[-1]} in {workdir / 'checkpoints'} (a rerun resumes "
        "from it); nothing was trained since"), line
    assert sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == complete

    os.remove(small_disk / "filler")
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    shutil.move(emergency, workdir / "checkpoints" / str(step))
    shutil.rmtree(os.path.dirname(emergency))
    last = cli("train.py", "--config", "configs/default.py", *flags)
    assert last.returncode == 0, last.stderr[-2000:]
    assert f"resumed from step {step}" in last.stdout
    reference = train(tiny_config(tmp_path / "reference", steps=40, checkpoint_every=4))["losses"]
    logged = {r["step"]: r["loss"] for r in metric_lines(workdir)}
    # Every step once, but those whose metrics write failed (between the failure and the emergency save).
    assert set(range(1, complete[-1] + 1)) | set(range(step + 1, 41)) <= set(logged) <= set(range(1, 41))
    assert list(logged.values()) == pytest.approx([reference[s - 1] for s in logged], rel=1e-6)


def _max_step(path):
    try:
        with open(path) as f:
            return max((json.loads(line)["step"] for line in f if line.endswith("\n")), default=0)
    except (OSError, ValueError):
        return 0


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_random_kills_and_corruptions_lose_nothing(tmp_path, seed):
    """train.py in a subprocess, killed (SIGKILL or SIGTERM) at random points of a run that saves
    every step and keeps 2 checkpoints (so kills land in saves and in deletions of old ones),
    its newest checkpoint sometimes corrupted after the kill; rerun until it finishes. Then every
    step is logged once with the loss of an uninterrupted run, and nothing else was touched."""
    rng = random.Random(seed)
    steps, kw = 20, dict(checkpoint_every=1, keep_checkpoints=2)
    reference = train(tiny_config(tmp_path / "reference", steps=steps, **kw))["losses"]
    workdir, other = tmp_path / "run", tmp_path / "other"
    for d in (workdir, other / "checkpoints" / "7"):
        d.mkdir(parents=True)
        (d / "notes.txt").write_text(str(d))
    untouched = {d: tree_bytes(d) for d in (other, )}
    config = tiny_config(workdir)
    cmd = [sys.executable, "train.py", "--config", "configs/default.py", *overrides(config),
           f"--config.train.steps={steps}", "--config.train.checkpoint_every=1", "--config.train.keep_checkpoints=2"]
    aside, kills = set(), 0
    while True:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if kills < 3:
            target, deadline = _max_step(workdir / "metrics.jsonl") + rng.randint(1, 5), time.time() + 120
            while proc.poll() is None and _max_step(workdir / "metrics.jsonl") < target and time.time() < deadline:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 0.3))
            sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
            proc.send_signal(sig)
            kills += 1
        err = proc.communicate(timeout=300)[1]
        if proc.returncode == 0:
            break
        assert proc.returncode in (-signal.SIGKILL, 128 + signal.SIGTERM), err
        steps_now = sorted(int(s) for s in os.listdir(workdir / "checkpoints") if s.isdigit())
        if steps_now and rng.random() < 0.4:
            rng.choice(CORRUPTIONS)(str(workdir / "checkpoints" / str(steps_now[-1])))
        now = set(os.listdir(workdir / "checkpoints.unreadable")) if (workdir / "checkpoints.unreadable").exists() else set()
        assert aside <= now  # what was set aside stays
        aside = now
    records = metric_lines(workdir)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["loss"] for r in records] == reference
    assert (workdir / "notes.txt").read_text() == str(workdir)
    assert {d: tree_bytes(d) for d in (other, )} == untouched
    assert sorted(os.listdir(workdir / "checkpoints")) == [str(steps - 1), str(steps)]


def test_identity_change_names_what_changed_and_ignores_fields_added_since():
    from lab.checkpoints import identity, identity_change
    config = tiny_config("/tmp/unused")
    stored = identity(config)
    assert identity_change(stored, config) is None
    older = {k: v for k, v in stored.items() if k != "data.streams"}  # a run from before the field
    assert identity_change(older, config) is None
    config.model.scheme_options.base = 500000.0  # an option set now that the run did not have
    config.model.d_model = 48
    assert identity_change(stored, config) == "model.d_model 32 -> 48, model.scheme_options.base (unset) -> 500000.0"


@pytest.mark.parametrize("entry,names", [
    ("train.py", ["--config"]), ("eval.py", ["--workdirs", "--evals", "--scheme", "--scheme_options"]),
    ("analyze.py", ["--workdirs", "--scheme"]), ("import_checkpoint.py", ["--source", "--workdir"]), ("demo.py", ["--schemes", "--out"])])
def test_help_lists_the_flags_and_exits_0(entry, names):
    """--help on every entry point: its flags (those lab/cli.py defines for it included), the
    usage example intact, exit 0."""
    run = cli(entry, "--help")
    assert run.returncode == 0, run.stderr[-1000:]
    assert all(f"  {name}:" in run.stdout for name in names), run.stdout
    assert " \\\n" in run.stdout or entry not in ("train.py", "analyze.py")  # the example's line break kept


def test_a_missing_config_file_or_a_file_as_workdir_is_one_line(tmp_path):
    """A config file that does not exist (with overrides after it, as usual), and a workdir that
    is a file: one line each, exit 1, nothing created."""
    run = cli("train.py", "--config", "configs/no_such.py", f"--config.workdir={tmp_path / 'run'}")
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0, run.stderr[-2000:]
    assert run.stderr.startswith("error: --config: cannot load the config file: [Errno 2] No such file")
    (tmp_path / "afile").write_text("")
    config = tiny_config(tmp_path / "afile")
    with pytest.raises(ValueError, match=r"^workdir='.*afile' is a file, not a directory; pass a new directory"):
        train(config)
    assert not (tmp_path / "run").exists()



def test_a_corrupt_config_json_is_named(tmp_path):
    """eval.py and analyze.py read a run's config.json: broken JSON is one line naming the file."""
    from lab.runs import load_run
    (tmp_path / "config.json").write_text('{"model": {')
    with pytest.raises(ValueError) as e:
        load_run(str(tmp_path))
    message = str(e.value)
    assert message.startswith(f"{tmp_path / 'config.json'} is not valid JSON (") and "\n" not in message


def test_a_start_that_fails_leaves_no_workdir(tmp_path):
    """A start that fails after creating its workdir (here: a data source that does not exist)
    removes what it made: only the lock, config.json and empty folders were there."""
    config = tiny_config(tmp_path / "run")
    config.data.source_dir = str(tmp_path / "no_such_dir")
    with pytest.raises(Exception, match="does not exist"):
        train(config)
    assert not (tmp_path / "run").exists()


def test_checksums_do_not_depend_on_the_slices_an_array_is_summed_in(monkeypatch):
    """`lab.checkpoints.checksums` sums each array in slices (XLA on a CPU would otherwise widen
    every array at once, doubling a model's memory as it loads): the same numbers as the sum of
    every element's bits computed here by numpy, whatever the slice size, for each dtype width."""
    import jax.numpy as jnp
    import numpy as np
    from lab import checkpoints
    rng = np.random.default_rng(0)
    tree = {"w": jnp.asarray(rng.standard_normal((37, 5, 3)), jnp.float32),
            "h": jnp.asarray(rng.standard_normal((64, 9)), jnp.bfloat16),
            "b": jnp.asarray(rng.integers(0, 255, (11,)), jnp.uint8), "s": jnp.asarray(3.5, jnp.float32)}
    width = {4: np.uint32, 2: np.uint16, 1: np.uint8}
    expected = {f"['{k}']": [str(x.dtype), int(np.asarray(x).view(width[x.dtype.itemsize]).astype(np.uint64).sum()
                                               % 2 ** 32)] for k, x in tree.items()}
    for size in (10 ** 9, 64, 7):
        monkeypatch.setattr(checkpoints, "CHECKSUM_BYTES", size)
        assert checkpoints.checksums(tree) == expected


def test_parameters_read_in_groups_equal_one_read_and_a_flipped_bit_in_any_group_is_found(tiny_run, tmp_path,
                                                                                         monkeypatch, capsys):
    """load_params reads a checkpoint's arrays in groups of about RESTORE_GROUP_BYTES, the largest
    first (each verified, so the reader's buffers are one group's): one array a group gives the very arrays
    of one group for all; bits flipped through the newest checkpoint's data are found, and the
    step before is read."""
    import jax
    import numpy as np
    from lab import checkpoints
    config, _ = tiny_run
    abstract = abstract_params(config)
    whole = load_params(config.workdir, abstract)
    monkeypatch.setattr(checkpoints, "RESTORE_GROUP_BYTES", 1)
    groups = checkpoints.leaf_groups(abstract, 1)
    assert len(groups) == len(jax.tree.leaves(abstract)) > 3
    sizes = [jax.tree.leaves(g)[0].size for g in groups]  # the largest first (one dtype here)
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]
    step, params = load_params(config.workdir, abstract)
    assert step == whole[0] == 12
    assert jax.tree.structure(params) == jax.tree.structure(whole[1])
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole[1])))
    workdir = tmp_path / "run"
    shutil.copytree(config.workdir, workdir)
    for f in glob.glob(str(workdir / "checkpoints" / "12" / "state" / "ocdbt.process_0" / "d" / "*")):
        with open(f, "r+b") as fh:  # bits flipped all through the arrays' data: parameters' among them
            data = bytearray(fh.read())
            for i in range(512, len(data) - 16, 1024):
                data[i:i + 16] = bytes(b ^ 0xFF for b in data[i:i + 16])
            fh.seek(0)
            fh.write(data)
    assert load_params(str(workdir), abstract)[0] == 8
    assert "skipping unreadable checkpoint at step 12" in capsys.readouterr().err


def test_an_out_of_line_checkpoint_before_any_good_one_says_none_is_good_yet(tmp_path, monkeypatch, capsys):
    """A checkpoint whose loss is out of line with the run is still saved where no good one
    exists yet, and the warning says so (it named 'step None' before)."""
    monkeypatch.setattr(training, "in_line", lambda *a: False)
    train(tiny_config(tmp_path, steps=4, checkpoint_every=4))
    warning = [line for line in capsys.readouterr().err.splitlines() if "out of line" in line]
    assert warning and warning[0].endswith("saved, but no saved checkpoint is in line with the run yet"), warning
    assert "None" not in warning[0]


def test_the_last_step_out_of_line_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    """keep_checkpoints=2, step 4 in line, steps 8 and 12 out of line: the last step is saved
    all the same, and the room for it comes from step 8, not from step 4, the last good one the
    warning names (the rotation deleted step 4 before)."""
    verdicts = iter([True, False, False])
    monkeypatch.setattr(training, "in_line", lambda *a: next(verdicts))
    config = tiny_config(tmp_path, steps=12, checkpoint_every=4, keep_checkpoints=2)
    train(config)
    assert sorted(checkpoint_manager(tmp_path / "checkpoints", create=False).all_steps()) == [4, 12]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "out of line" in line]
    assert len(warnings) == 2 and warnings[-1].endswith("saved, but step 4 stays the last good checkpoint"), warnings


def test_parameters_renamed_since_the_save_are_one_line_and_nothing_is_set_aside(tiny_run, tmp_path):
    """A model whose parameter names differ from the checkpoint's (a scheme's learned parameters
    renamed since the run was saved) is told so in one line naming the first array on each side,
    not taken for a damaged checkpoint: no checkpoint is skipped or moved."""
    import pytest
    config, _ = tiny_run
    abstract = abstract_params(config)
    abstract["renamed_embed"] = abstract.pop("embed")
    before = tree_bytes(config.workdir)
    with pytest.raises(ValueError) as raised:
        load_params(config.workdir, abstract)
    line = str(raised.value)
    assert "\n" not in line and "step 12" in line and "params/renamed_embed" in line and "params/embed" in line
    assert tree_bytes(config.workdir) == before
