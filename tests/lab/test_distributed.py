"""Several processes, one run: train.py, eval.py and analyze.py launched as 2 (and 4) CPU
processes on this machine, talking through a coordinator on 127.0.0.1, against one process with
the same global batch; SIGTERM to one process; resume; bad launches. (The data streams each process loads:
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

from helpers.tiny_setup import ROOT, overrides, tiny_config

DEVICES = 4  # in all, over the processes of a job
STEPS = 40


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(workdir, processes: int, *extra, port=None, only=None, script="train.py", devices=None):
    """Start train.py (or `script`) as `processes` processes of one job (DEVICES CPU devices in
    all, or {process id: its count} in `devices`); `only`: {process id: its own extra flags}
    starts just those processes."""
    port = port or free_port()
    flags = [*overrides(tiny_config(workdir)), f"--config.train.steps={STEPS}", "--config.data.streams=4",
             "--config.train.checkpoint_every=4", *extra]
    if processes > 1:
        flags += [f"--config.distributed.coordinator=127.0.0.1:{port}", f"--config.distributed.num_processes={processes}"]
    devices = devices or {}
    env = lambda i: {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices.get(i, DEVICES // processes)}"}  # noqa: E731
    only = only if only is not None else {i: [] for i in range(processes)}
    entry = [script, "train"] if script == "tests/helpers/faulty.py" else [script]
    return [subprocess.Popen([sys.executable, *entry, "--config", "configs/default.py", *flags, *own,
                              *([f"--config.distributed.process_id={i}"] if processes > 1 else [])],
                             cwd=ROOT, env=env(i), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


# What no stderr of a job's process may hold after a fault: tracebacks, C++ stacks, aborts.
STACKS = ("Traceback", "stack trace", "Fatal", "terminate called", "Check failed", "Aborted")


@pytest.mark.parametrize("fault", ["sigkill", pytest.param("exception", marks=pytest.mark.slow),
                                   pytest.param("sigint", marks=pytest.mark.slow)])  # 50 s, 45 s
def test_a_fault_on_one_process_ends_the_job_fast_with_one_line_each_and_a_rerun_resumes_exactly(
        tmp_path, one_process, fault):
    """SIGKILL of process 1, an exception on it (a data read failing), SIGINT to it: every
    process ends within 30 s with one project line as its last (no traceback, no C++ stack),
    the healthy one naming process 1; SIGINT stops both at one step with a checkpoint. Then a
    rerun of both resumes and logs the losses of one uninterrupted process."""
    fails = {1: ["--fault=read:12"]} if fault == "exception" else {1: []}
    procs = launch(tmp_path, 2, "--config.distributed.heartbeat_s=5", only={0: [], **fails},
                   script="tests/helpers/faulty.py")
    deadline = time.time() + 240
    while time.time() < deadline and (not (tmp_path / "metrics.jsonl").exists() or len(logged(tmp_path)) < 6):
        time.sleep(0.2)
    t0 = time.time()
    if fault != "exception":
        procs[1].send_signal(signal.SIGKILL if fault == "sigkill" else signal.SIGINT)
    results = finish(procs, timeout=60)
    assert time.time() - t0 < 30
    codes = {"sigkill": [1, -signal.SIGKILL], "exception": [1, 1], "sigint": [128 + signal.SIGTERM, 130]}[fault]
    assert [code for code, _, _ in results] == codes, results[0][2][-2000:]
    for i, (code, _, err) in enumerate(results):
        if code == -signal.SIGKILL:
            continue
        assert not [s for s in STACKS if s in err], err[-3000:]
        lines = [line for line in err.splitlines() if line.startswith(("error:", "interrupted:"))]
        assert lines == [err.strip().splitlines()[-1]], err[-3000:]
        if fault == "sigint":
            assert lines[0].startswith(f"interrupted: {'SIGINT' if i else 'SIGTERM'} at step ")
        elif i == 0:
            assert lines[0].startswith(f"error: process 1 {'stopped responding' if fault == 'sigkill' else 'failed'}"
                                       ) or "another process ended" in lines[0], lines[0]
            assert lines[0].endswith("it resumes from the newest checkpoint [process 0]")
        else:
            assert lines[0] == "error: injected: reading batch 12 failed [process 1]"
    if fault == "sigint":  # both at one step, with its checkpoint
        stopped = {int(err.strip().splitlines()[-1].split(" at step ")[1].split(";")[0]) for _, _, err in results}
        assert len(stopped) == 1 and str(stopped.pop()) in os.listdir(tmp_path / "checkpoints")
    results = finish(launch(tmp_path, 2))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:]
    assert "resumed from step" in results[1][1]
    records = logged(tmp_path)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r["loss"] for r in records], one_process.losses, rtol=1e-6)


def test_processes_with_different_configs_stop_at_start_naming_the_field(tmp_path):
    results = finish(launch(tmp_path, 2, only={0: [], 1: ["--config.seq_len=64"]}))
    for i, (code, _, err) in enumerate(results):
        assert code == 1
        assert err.strip().splitlines()[-1] == (
            "error: the processes were launched with different configs (process 1: seq_len 64 vs 32 on process 0); "
            f"launch every process with the same flags [process {i}]")
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.slow  # 15 s; processes with different configs stop at start in make test
def test_processes_with_different_device_counts_stop_at_start_naming_them(tmp_path):
    """Was `cannot reshape array of size 3 into shape (2,1)`."""
    results = finish(launch(tmp_path, 2, devices={0: 2, 1: 1}))
    for code, _, err in results:
        assert code == 1
        assert err.strip().splitlines()[-1].startswith(
            "error: the processes have different numbers of devices (process 0: 2, process 1: 1); every process of a "
            "job needs the same number"), err[-2000:]
    assert not tmp_path.exists() or not (tmp_path / "checkpoints").exists()


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
    tests/lab/test_runs_safety.py's fault test: the previous checkpoint stays loadable.)"""
    from lab.checkpoints import load_params
    from lab.training import train
    from helpers.tiny_setup import abstract_params
    import jax
    config, summary = tiny_run
    assert config.train.async_checkpoints
    sync = config.copy_and_resolve_references()
    sync.workdir, sync.train.async_checkpoints = str(tmp_path), False
    assert train(sync)["losses"] == summary["losses"]
    (step_a, a), (step_b, b) = (load_params(w, abstract_params(config)) for w in (config.workdir, str(tmp_path)))
    assert step_a == step_b == 12
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def two_and_one(script, flags, tmp_path):
    """`script` with `flags` as 2 processes of 2 CPU devices each (--out=tmp_path/two) beside one
    process of one device (tmp_path/one), all at once: (exit code, stdout, stderr) of each."""
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    procs = [subprocess.Popen([sys.executable, script, *flags, f"--out={tmp_path / 'two'}",
                               f"--coordinator=127.0.0.1:{port}", "--num_processes=2", f"--process_id={i}"],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    procs.append(subprocess.Popen([sys.executable, script, *flags, f"--out={tmp_path / 'one'}"], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = finish(procs)
    assert [code for code, _, _ in results] == [0, 0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert "| run |" not in results[1][1]  # process 1 wrote no report
    return results


def first_run(path):
    with open(path) as f:
        return next(iter(json.load(f)["runs"].values()))


def test_eval_over_two_processes_scores_like_one(one_process, tmp_path):
    """eval.py as 2 processes (each scores its rows of every batch of windows, process 0 writes)
    reports the perplexities of one process."""
    two_and_one("eval.py", [f"--workdirs={one_process.workdir}", "--max_multiplier=4", "--tokens=256"], tmp_path)

    def ppl(out):
        return [(r["length"], r["tokens"], r["ppl"]) for r in first_run(tmp_path / out / "results.json")["results"]]

    one, two = ppl("one"), ppl("two")
    assert [r[:2] for r in two] == [r[:2] for r in one] == [(16, 256), (32, 256), (64, 256), (128, 256)]
    np.testing.assert_allclose([r[2] for r in two], [r[2] for r in one], rtol=1e-5)


@pytest.mark.slow  # about a minute; the retrieval/transport test below runs the same placement in make test
def test_analyze_over_two_processes_writes_the_numbers_of_one(one_process, tmp_path):
    """analyze.py as 2 processes: the decompositions' and perturbations' 4 windows split over the
    4 devices, the feature shift's 2 (which do not split) computed whole by both; process 0
    writes analysis.json with the numbers of one process."""
    results = two_and_one("analyze.py", [f"--workdirs={one_process.workdir}", "--windows=4", "--perturb_windows=4",
                                         "--gammas=0.1,0.5", "--l_max=5", "--shift_multiplier=2",
                                         "--shift_windows=2"], tmp_path)
    assert "wrote" in results[0][1] and "wrote" not in results[1][1]
    one, two = (first_run(tmp_path / out / "analysis.json") for out in ("one", "two"))
    for key in ("three_axis_r", "three_axis_r2", "fake_r", "fg_r_1", "fg_r_4"):
        np.testing.assert_allclose([layer[key] for layer in two["layers"]], [layer[key] for layer in one["layers"]],
                                   rtol=1e-5, err_msg=key)
    # perplexities, not their changes: a change is a difference of close numbers (rtol meaningless near 0)
    ppl = lambda p: [p["clean_ppl"], *(p["clean_ppl"] + d for d in p["delta_ppl"].values())]  # noqa: E731
    assert list(two["perturbation"]["delta_ppl"]) == list(one["perturbation"]["delta_ppl"])
    np.testing.assert_allclose(ppl(two["perturbation"]), ppl(one["perturbation"]), rtol=1e-5)
    for key in ("log_ppl", "kl", "kl_control"):
        np.testing.assert_allclose(two["feature_shift"][key], one["feature_shift"][key], rtol=1e-5, err_msg=key)


@pytest.mark.slow  # 23 s; eval over two processes (the test above) scores like one in make test
def test_retrieval_and_transport_over_two_processes_score_like_one(one_process, tmp_path):
    """eval.py --evals=retrieval,transport as 2 processes: 2 retrieval examples padded to the 4
    devices' rows (teacher-forced and greedily decoded), the transport probes' 2 windows whole
    on every process; the reports of one process."""
    two_and_one("eval.py", [f"--workdirs={one_process.workdir}", "--evals=retrieval,transport", "--probe_length=64",
                            "--retrieval_tasks=passkey", "--retrieval_lengths=128", "--retrieval_depths=0,1",
                            "--retrieval_examples=1"], tmp_path)
    one, two = (first_run(tmp_path / out / "retrieval.json")["tasks"]["passkey"]["records"] for out in ("one", "two"))
    assert len(one) == 2 and all("generated" in r for r in one)
    for key in ("exact", "predicted", "generated", "decoded"):
        assert [r[key] for r in two] == [r[key] for r in one], key
    np.testing.assert_allclose([r["logprob"] for r in two], [r["logprob"] for r in one], rtol=1e-5)
    one, two = (first_run(tmp_path / out / "probes.json")["layers"] for out in ("one", "two"))
    np.testing.assert_allclose([list(layer["far_mass"].values()) for layer in two],
                               [list(layer["far_mass"].values()) for layer in one], rtol=1e-5)
    np.testing.assert_allclose([layer["mass_by_distance"] for layer in two],
                               [layer["mass_by_distance"] for layer in one], rtol=1e-5)


@pytest.mark.parametrize("fields,error", [
    ({"coordinator": "localhost", "num_processes": 2, "process_id": 0}, "distributed.coordinator='localhost'; valid: host:port"),
    ({"coordinator": "localhost:99999", "num_processes": 2, "process_id": 0}, "distributed.coordinator='localhost:99999'"),
    ({"coordinator": "localhost:1234", "num_processes": 2, "process_id": 0, "timeout_s": -5},
     "distributed.timeout_s=-5; valid: a number of seconds > 0"),
    ({"coordinator": "localhost:1234", "num_processes": 2, "process_id": 0, "heartbeat_s": "x"},
     "distributed.heartbeat_s='x'; valid: a number of seconds > 0"),
])
def test_a_bad_coordinator_or_timeout_is_one_line_before_connecting(fields, error):
    """A coordinator without a port (was blamed on the start-up timeout after waiting for it)."""
    from lab import distributed
    with pytest.raises(ValueError) as e:
        distributed.initialize(fields)
    assert str(e.value).startswith(error) and "\n" not in str(e.value)
