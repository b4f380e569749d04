"""Several processes, one run: train.py and eval.py launched as 2 (and 4) CPU processes on this
machine, talking through a coordinator on 127.0.0.1, against one process with the same global
batch; SIGTERM to one process; resume; bad launches. (The data streams each process loads:
tests/data/test_data_pipeline.py.)"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from tiny_setup import ROOT, overrides, tiny_config

DEVICES = 4  # in all, over the processes of a job
STEPS = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir, processes: int, *extra, port=None, only=None):
    """Start train.py as `processes` processes of one job (DEVICES CPU devices in all); `only`:
    {process id: its own extra flags} starts just those processes."""
    port = port or free_port()
    flags = [*overrides(tiny_config(workdir)), f"--config.train.steps={STEPS}", "--config.data.streams=4",
             "--config.train.checkpoint_every=4", *extra]
    if processes > 1:
        flags += [f"--config.distributed.coordinator=127.0.0.1:{port}", f"--config.distributed.num_processes={processes}"]
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES // processes}"}
    only = only if only is not None else {i: [] for i in range(processes)}
    return [subprocess.Popen([sys.executable, "train.py", "--config", "configs/default.py", *flags, *own,
                              *([f"--config.distributed.process_id={i}"] if processes > 1 else [])],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i, own in only.items()]


def finish(procs, timeout=300):
    """(exit code, stdout, stderr) of each process, once all have ended."""
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


def logged(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process with all DEVICES devices, the same global batch (4 streams)."""
    workdir = tmp_path_factory.mktemp("one")
    (code, out, err), = finish(launch(workdir, 1))
    assert code == 0, err
    return types.SimpleNamespace(workdir=workdir, losses=[r["loss"] for r in logged(workdir)])


@pytest.mark.parametrize("processes", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_processes_train_like_one_process_and_one_writes(tmp_path, one_process, processes):
    results = finish(launch(tmp_path, processes))
    assert [code for code, _, _ in results] == [0] * processes, results[0][2][-2000:]
    records = logged(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))  # one line per step: process 0 writes
    np.testing.assert_allclose([r["loss"] for r in records], one_process.losses, rtol=1e-6)
    assert sorted(os.listdir(tmp_path / "checkpoints"), key=int) == [str(s) for s in range(4, STEPS + 1, 4)]


def test_sigterm_to_one_process_stops_all_at_one_step_and_a_rerun_resumes_exactly(tmp_path, one_process):
    procs = launch(tmp_path, 2, "--config.train.checkpoint_every=1000")
    deadline = time.time() + 240
    while time.time() < deadline and (not (tmp_path / "metrics.jsonl").exists() or len(logged(tmp_path)) < 5):
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGTERM)
    results = finish(procs)
    assert [code for code, _, _ in results] == [128 + signal.SIGTERM] * 2, results[1][2][-2000:]
    stopped = [int(err.strip().splitlines()[-1].split(" at step ")[1].split(";")[0]) for _, _, err in results]
    assert stopped[0] == stopped[1] < STEPS  # the same step on both, with its checkpoint
    assert os.listdir(tmp_path / "checkpoints") == [str(stopped[0])]
    results = finish(launch(tmp_path, 2, "--config.train.checkpoint_every=1000"))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:]
    assert f"resumed from step {stopped[0]}" in results[1][1]
    records = logged(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in records], one_process.losses, rtol=1e-6)


def test_processes_with_different_configs_stop_at_start_naming_the_field(tmp_path):
    results = finish(launch(tmp_path, 2, only={0: [], 1: ["--config.seq_len=64"]}))
    for code, _, err in results:
        assert code == 1
        assert err.strip().splitlines()[-1] == (
            "error: the processes were launched with different configs (process 1: seq_len 64 vs 32 on process 0); "
            "launch every process with the same flags")
    assert not (tmp_path / "checkpoints").exists()


def test_an_unreachable_coordinator_fails_in_bounded_time_with_one_line(tmp_path):
    t0 = time.time()
    (code, _, err), = finish(launch(tmp_path, 2, "--config.distributed.timeout_s=5", only={1: []}))
    assert code == 1 and time.time() - t0 < 60
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: the job's processes did not start together within distributed.timeout_s=5 s "
                           "(coordinator 127.0.0.1:")


def test_asynchronous_saves_change_nothing(tiny_run, tmp_path):
    """The shared tiny run saved asynchronously (the default); the same run saving synchronously
    logs the same losses and keeps the same parameters. (A kill during an asynchronous save is
    tests/test_runs_safety.py's fault test: the previous checkpoint stays loadable.)"""
    from lab.checkpoints import load_params
    from lab.training import train
    from test_train import _abstract
    import jax
    config, summary = tiny_run
    assert config.train.async_checkpoints
    sync = config.copy_and_resolve_references()
    sync.workdir, sync.train.async_checkpoints = str(tmp_path), False
    assert train(sync)["losses"] == summary["losses"]
    (step_a, a), (step_b, b) = (load_params(w, _abstract(config)) for w in (config.workdir, str(tmp_path)))
    assert step_a == step_b == 12
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_eval_over_two_processes_scores_like_one(one_process, tmp_path):
    """eval.py as 2 processes (each scores its rows of every batch of windows, process 0 writes)
    reports the perplexities of one process."""
    port = free_port()
    flags = [f"--workdirs={one_process.workdir}", "--max_multiplier=4", "--tokens=256"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, "eval.py", *flags, f"--out={tmp_path / 'two'}",
                               f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    procs.append(subprocess.Popen([sys.executable, "eval.py", *flags, f"--out={tmp_path / 'one'}"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = finish(procs)
    assert [code for code, _, _ in results] == [0, 0, 0], results[0][2][-2000:]
    assert "| run |" not in results[1][1]  # process 1 wrote no report

    def ppl(out):
        with open(tmp_path / out / "results.json") as f:
            return [(r["length"], r["tokens"], r["ppl"]) for r in next(iter(json.load(f)["runs"].values()))["results"]]

    one, two = ppl("one"), ppl("two")
    assert [r[:2] for r in two] == [r[:2] for r in one] == [(16, 256), (32, 256), (64, 256), (128, 256)]
    np.testing.assert_allclose([r[2] for r in two], [r[2] for r in one], rtol=1e-5)
