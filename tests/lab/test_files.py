"""Run and report files in a bucket (lab/files.py): every file a run or report writes under a
gs:// path goes through etils.epath. No bucket is reachable here, so epath's mock backend
stands in for one: a gs://bucket/x path lands in ./gs:/bucket/x, and the mock records each
path epath opens or renames. A file that appears there unrecorded was written around epath
(builtin open or os on the URI string, which would fail on a real bucket)."""

import json

import jax
import pytest
from etils.epath import testing as epath_testing

from lab import files
from lab.checkpoints import PARTIAL, set_aside_partial_saves
from lab.lengths import evaluate_runs, write_report
from lab.training import cut_metrics, workdir_lock


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """(recorded paths, local root of gs://) while epath's backend is mocked."""
    monkeypatch.chdir(tmp_path)
    recorded = set()

    def record(original, path, *args, **kwargs):
        recorded.update(str(p) for p in (path, *args) if "://" in str(p))  # the path, a rename's target
        return original(path, *args, **kwargs)

    with epath_testing.mock_epath(open=record, rename=record, replace=record):
        yield recorded, tmp_path / "gs:"


def written(root):
    """The gs:// paths of the files under the bucket's local root."""
    return {"gs:/" + str(p.relative_to(root.parent))[3:] for p in root.rglob("*") if p.is_file()}


def test_eval_reports_to_a_bucket_are_written_through_epath(tiny_run, bucket):
    recorded, root = bucket
    config, _ = tiny_run
    results = evaluate_runs([config.workdir], max_multiplier=2, tokens=64, log=lambda *_: None)
    table = write_report(results, "gs://bucket/eval")
    assert written(root) == {f"gs://bucket/eval/{n}" for n in ("results.json", "results.md", "results.png")}
    assert written(root) <= recorded
    assert json.loads(files.read_text("gs://bucket/eval/results.json"))["lengths"] == results["lengths"]
    report = files.read_text("gs://bucket/eval/results.md")  # the table, then what computed it
    assert report.startswith(table) and f", jax {jax.__version__}, " in report.splitlines()[-1], report


def test_metrics_in_a_bucket_are_appended_and_cut_back_through_epath(bucket):
    recorded, root = bucket
    path = "gs://bucket/run/metrics.jsonl"
    for step in range(1, 6):
        files.append_lines(path, [json.dumps({"step": step}) + "\n"])
    files.append_lines(path, ['{"step": 6, "lo'])  # cut off mid-write
    cut_metrics(path, 3)
    assert [json.loads(line)["step"] for line in files.read_text(path).splitlines()] == [1, 2, 3]
    dropped = files.read_text("gs://bucket/run/metrics.dropped.jsonl").splitlines()
    assert dropped == ['{"step": 4}', '{"step": 5}', '{"step": 6, "lo']
    assert written(root) == {path, "gs://bucket/run/metrics.dropped.jsonl"} and written(root) <= recorded


def test_partial_saves_in_a_bucket_are_set_aside_through_epath(bucket, capsys):
    recorded, root = bucket
    partial = f"gs://bucket/run/checkpoints/8{PARTIAL}-1"
    files.write_text(f"{partial}/array", "x")
    files.write_text("gs://bucket/run/checkpoints/4/array", "y")
    (moved,) = set_aside_partial_saves("gs://bucket/run/checkpoints", "gs://bucket/run/checkpoints.unreadable")
    assert moved.startswith(f"gs://bucket/run/checkpoints.unreadable/8{PARTIAL}-1-")
    assert files.read_text(f"{moved}/array") == "x" and not files.path(partial).exists()
    assert files.read_text("gs://bucket/run/checkpoints/4/array") == "y"
    assert partial in recorded and f"{partial} is a save a stopped run did not finish" in capsys.readouterr().err


def test_a_bucket_workdir_is_not_locked_and_says_so(bucket, capsys):
    _, root = bucket
    with workdir_lock("gs://bucket/run"):
        pass
    assert "gs://bucket/run is not on a local filesystem and cannot be locked" in capsys.readouterr().err
    assert not root.exists()  # nothing written


def test_local_paths_and_uris():
    assert files.is_local("/tmp/run") and files.is_local("runs/rope") and not files.is_local("gs://b/run")
    assert files.join("gs://b/run", "checkpoints", "4") == "gs://b/run/checkpoints/4"
    assert files.join("runs/rope", "config.json") == "runs/rope/config.json"
