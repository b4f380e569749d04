"""Smoke tests: each benchmark runs end to end on a tiny setting, so the scripts cannot rot."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tiny_setup import load_benchmark
from lab.lowering import require_compiler

ROOT = Path(__file__).resolve().parents[2]


load = load_benchmark


def run(name: str, argv: list[str]):
    """The benchmark's results with these flags, in this process (an imported benchmark parses
    into flags of its own, so one test's flags never reach another's)."""
    module = load(name)
    module.FLAGS([name, *argv])
    return module.benchmark()


def test_train_throughput_runs(capsys):
    results = run("train_throughput", ["--schemes", "rope,alibi,path@blockwise", "--batch", "2", "--seq-len", "32",
                                       "--steps", "2", "--rounds", "2", "--warmup", "0", "--block-size", "16"])
    assert set(results) == {"rope", "alibi", "path@blockwise"}
    assert all(len(r) == 2 and min(r) > 0 for r in results.values())
    out = capsys.readouterr().out
    assert "| alibi |" in out and "ratio to rope (CPU time)" in out


@pytest.mark.slow  # 12 s
def test_long_context_runs(capsys):
    rows = run("long_context", ["--lengths", "512", "--memory-cap-gib", "1e-9"])
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["reference"]["skipped"].startswith("skipped")
    assert by_impl["blockwise"]["seconds"] > 0 and by_impl["blockwise"]["peak"] > 0
    assert "| 512 | blockwise |" in capsys.readouterr().out


@pytest.mark.slow
def test_blockwise_forward_at_65536_tokens_fits_in_4_gib():
    """The project's long-context target: the default model, one row, peak RSS < 4 GiB."""
    rows = run("long_context", ["--lengths", "65536", "--impls", "blockwise"])
    assert rows[0]["peak"] < 4 * 2 ** 30, rows[0]


@pytest.mark.slow
def test_random_position_schemes_train_in_the_benchmark(capsys):
    results = run("train_throughput", ["--schemes", "rope,so2_random_qkv", "--batch", "2", "--seq-len", "32",
                                       "--steps", "1", "--rounds", "1", "--warmup", "0"])
    assert min(results["so2_random_qkv"]) > 0


def test_path_length_runs(capsys):
    seconds = run("path_length", ["--lengths", "64", "--repeats", "1"])
    assert set(seconds[64]) == {"rope", "path"} and min(seconds[64].values()) > 0
    assert "| 64 |" in capsys.readouterr().out


def test_logit_fits_runs(capsys):
    rows = run("logit_fits", ["--lengths", "48", "--repeats", "1"])
    assert rows[0]["three_axis"] > 0 and rows[0]["max_diff"] < 1e-3  # the fit is the dense solve's
    assert "| 48 |" in capsys.readouterr().out


@pytest.mark.slow  # the sequence axis itself: tests/models/test_scale.py, tests/positional/test_ring.py
def test_sequence_parallel_runs(capsys):
    rows = run("sequence_parallel", ["--seq-len", "512", "--devices", "1,2", "--steps", "1"])
    assert [r["devices"] for r in rows] == [1, 2] and rows[1]["mesh"]["sequence"] == 2
    assert rows[1]["temp_bytes"] < rows[0]["temp_bytes"]  # the sequence axis splits the activations
    assert all(r["step_seconds"] > 0 for r in rows)
    assert "| rope | 2 |" in capsys.readouterr().out


@pytest.mark.slow
def test_ring_attention_runs(capsys):
    rows = run("ring_attention", ["--seq-len", "256", "--devices", "2", "--steps", "0", "--heads", "2",
                                        "--block-size", "64"])
    assert [(r["impl"], r["devices"]) for r in rows] == [("blockwise", 2), ("ring", 2)]
    assert rows[1]["total_bytes"] < rows[0]["total_bytes"]  # the ring keeps half the keys and values
    assert "| 2 |" in capsys.readouterr().out


def test_rotation_benchmark_runs(capsys):
    rows = run("rotation", ["--shape", "2,16,2,8", "--repeats", "1"])
    assert set(rows) == {"forward", "fwd + bwd (x)", "fwd + bwd (x, angles)"}
    assert all(t > 0 for row in rows.values() for t in row.values())
    assert "| fwd + bwd (x, angles) |" in capsys.readouterr().out


@pytest.mark.slow
def test_grid2d_runs(capsys, tmp_path):
    rows = run("grid2d", ["--steps", "2", "--batch", "2", "--eval_batches", "1", "--seeds", "0,1",
                          "--methods", "rope_1d_flattened,espr_relaxed_2d", "--json", str(tmp_path / "g.json")])
    assert [(r["method"], r["seed"]) for r in rows] == [("rope_1d_flattened", 0), ("espr_relaxed_2d", 0),
                                                        ("rope_1d_flattened", 1), ("espr_relaxed_2d", 1)]
    shifts = set(load("grid2d").SHIFTS)
    assert all(set(r["accuracy"]) == shifts and 0 <= min(r["accuracy"].values()) <= 1 for r in rows)
    assert rows[1]["commutator_norm"] >= 0 and "commutator_norm" not in rows[0]
    report = json.loads((tmp_path / "g.json").read_text())
    assert [(r["method"], r["seed"], set(r["accuracy"])) for r in report["runs"]] == [
        (r["method"], r["seed"], shifts) for r in rows]
    assert {m: set(v) for m, v in report["summary"].items()} == {m: shifts for m in ("rope_1d_flattened",
                                                                                     "espr_relaxed_2d")}
    # the ledger's layout (lab/results/seeds.py): columns the shifts, values [seed, shift]
    assert set(report["columns"]) == shifts and report["arms"]["espr_relaxed_2d"]["seeds"] == [0, 1]
    assert report["arms"]["espr_relaxed_2d"]["values"][1] == [rows[3]["accuracy"][s] for s in report["columns"]]
    assert "| espr_relaxed_2d | 1 |" in capsys.readouterr().out


def test_attention_runs(capsys):
    rows = run("attention", ["--schemes", "rope,alibi", "--lengths", "64", "--impls", "auto,pallas", "--repeats", "1",
                             "--heads", "2", "--head_dim", "16"])
    assert {r["impl"] for r in rows} == {"softmax/xla", "rope/auto", "rope/pallas", "alibi/auto", "alibi/pallas"}
    assert all(r["ms"] > 0 for r in rows)
    assert "| 64 | alibi/pallas |" in capsys.readouterr().out


@pytest.mark.slow  # about 25 s of interpreting; the script ran on an H100 (benchmarks/RESULTS.md)
def test_path_kernel_runs(capsys, tmp_path):
    """On CPU: the kernel in the interpreter and the chunked form, with the gate (no fla, and
    cuDNN fails and is reported), and the JSON it writes."""
    out = tmp_path / "path.json"
    result = run("path_kernel", ["--lengths", "40", "--head_dims", "16", "--model_dim", "32", "--repeats", "1",
                                 "--tiles", "16/w8/s1.3/g2/r255/tf32x3", "--blockwise_max", "64", "--gates", "1", "--nocheck", "--nofla",
                                 "--blockwise", "8,8/s16/o2/bf16/k", f"--json={out}"])
    rows, kernel = result["rows"], "path/pallas 16/w8/s1.3/g2/r255/tf32x3"
    assert {(r["impl"], r["gate"]) for r in rows} == {(kernel, True), ("path/blockwise 8", True),
                                                        ("path/blockwise 8/s16/o2/bf16/k", True)}
    assert all(r["ms"] > 0 for r in rows) and json.loads(out.read_text())["rows"] == rows
    text = capsys.readouterr().out
    assert "cudnn D16 T40: failed" in text and "| 16 | 40 | yes | path/blockwise 8 |" in text


@pytest.mark.slow  # 36 s; PaTH's kernel compiles for TPU in tests/positional/test_path_kernel.py too
def test_path_kernel_compiles_for_tpu(capsys, tmp_path):
    """--tpu: a two-level form by kernels (across="chunks") compiled for a v5e chip by libtpu,
    nothing run: the compiler's temporaries in the table and the JSON."""
    out = tmp_path / "tpu.json"
    result = run("path_kernel", ["--tpu", "v5e:1x1", "--lengths", "512", "--head_dims", "64", "--model_dim", "128",
                                 "--gates", "1", "--blockwise", "128/s256/bf16/k/a:chunks", f"--json={out}"])
    (row,) = result["rows"]
    assert row["impl"] == "path/blockwise 128/s256/bf16/k/a:chunks" and 0 < row["temp_gib"] < 1
    assert json.loads(out.read_text())["rows"] == [row]
    assert "| 64 | 512 | yes | path/blockwise 128/s256/bf16/k/a:chunks |" in capsys.readouterr().out


def lowering_check(argv: list[str], monkeypatch) -> int:
    """benchmarks/lowering.py's exit status with these flags, in this process (ml_collections
    reads a config file's --config.x overrides from sys.argv, so they are the process's here)."""
    monkeypatch.setattr(sys, "argv", ["lowering", *argv])
    module = load("lowering")
    module.FLAGS(sys.argv)
    try:
        module.main(["lowering"])
    except SystemExit as e:
        return e.code
    return 0


TINY_LOWERING = ["--config", "configs/default.py:alibi", "--config.seq_len=256", "--config.batch_size=2",
                 "--config.model.d_model=64", "--config.model.num_layers=2", "--config.model.dtype=bfloat16"]


def test_lowering_check_picks_the_fused_kernel(capsys, monkeypatch):
    """KERPLE (a bias that is not per key: the fused kernel on both accelerators) and ALiBi (per
    key: cuDNN through q.k channels; on tpu, at head dim 16, splash refuses and the fused kernel
    takes it), lowered on this CPU for each: auto's choice at both call sites, the kernels in the
    module, no T x T buffer."""
    cases = [("kerple_log", "tpu", "KerpleLog (layers 0-1): pallas -- the fused kernel", "mosaic (tpu_custom_call) 6"),
             ("kerple_log", "cuda", "KerpleLog (layers 0-1): pallas -- the fused kernel", "triton 6"),
             ("alibi", "tpu", "Alibi (layers 0-1): pallas -- the fused kernel; not splash: impl='splash' cannot take "
              "head_dim=16", "mosaic (tpu_custom_call) 6"),
             ("alibi", "cuda", "Alibi (layers 0-1): cudnn -- plain softmax, packed rows as cuDNN segments", "cudnn fmha 4")]
    for scheme, platform, choice, kernels in cases:
        argv = ["--config", f"configs/default.py:{scheme}", *TINY_LOWERING[2:], "--platform", platform]
        assert lowering_check(argv, monkeypatch) == 0
        out = capsys.readouterr().out
        assert f"2 x {choice}" in out, out
        assert kernels in out and "T x T tensor (two axes >= 256): none" in out and out.rstrip().endswith("result: ok"), out


@pytest.mark.parametrize("scheme", ["rope", pytest.param("path_fox", marks=pytest.mark.slow)])  # path_fox: 19 s
def test_lowering_check_names_the_ring_on_a_sequence_mesh(scheme):
    """On a sequence mesh (2 simulated devices, its own process) auto is the ring at every call
    site, and the report says so: a call site that logs nothing fails the check."""
    argv = [sys.executable, "benchmarks/lowering.py", "--platform", "cuda", "--config", f"configs/default.py:{scheme}",
            *TINY_LOWERING[2:], "--config.mesh.sequence=2"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    label = {"rope": "Rope", "path_fox": "Path"}[scheme]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"2 x {label} (layers 0-1): ring -- the sequence axis of the mesh splits the keys" in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith("result: ok"), proc.stdout


def test_lowering_check_fails_on_a_t_by_t_path(capsys, monkeypatch):
    """The config's reference impl, kept (--noforce_auto): a warning, a T x T tensor, and
    exit 1 with one line naming the scheme."""
    argv = [*TINY_LOWERING, "--platform", "tpu", "--config.model.attention_impl=reference", "--noforce_auto"]
    assert lowering_check(argv, monkeypatch) == 1
    captured = capsys.readouterr()
    assert "warning: model.attention_impl='reference'" in captured.out
    assert "T x T tensor (two axes >= 256): yes" in captured.out
    error = captured.err.strip()
    assert "\n" not in error and error.startswith("error: alibi (Alibi) runs 'reference' on tpu"), error


@pytest.mark.slow  # 52 s; run it before a GPU session (`make test-slow`, or this test alone)
def test_gpu_check_runs_end_to_end_at_toy_sizes(tmp_path, capsys, monkeypatch):
    """`make gpu-check`'s script with --tiny on this CPU: every item runs or says why in one line
    (cuDNN: no GPU here), every Pallas path passes its check interpreted, and the json holds it."""
    path = tmp_path / "gpu_check.json"
    result = run("gpu_check", ["--tiny", "--budget_s", "100000", "--json", str(path)])
    rows = {r["item"]: r for r in result["rows"]}
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    assert not result["skipped"] and result["commit"] != "unknown"
    for item, r in rows.items():
        if r["section"] == "checks":
            if item.startswith("cudnn"):
                assert "impl='cudnn' needs cuDNN" in r["failed"] and "\n" not in r["failed"]
            else:
                assert r["ok"], r
    assert {r["section"] for r in rows.values() if "failed" not in r} == {"checks", "attention", "train", "eval plan"}
    assert [x["fits"] for x in rows["tiny"]["lengths"]] == [True, True]  # eval.py --dry_run of a tiny Llama
    assert result["modules"]["sentencepiece"] is not None and "torch" in result["modules"]  # what the machine has
    assert all(r["tokens_per_s"] > 0 and r["loss"] > 0 for r in rows.values() if r["section"] == "train")
    assert rows["ceiling at 256"]["ms"] > 0 and rows["path_fox at 256"]["ms"] > 0
    assert rows["path_fox blockwise chunk 32 span 128 bf16 tiles at 256"]["ms"] > 0
    assert rows["path_fox pallas chunk 32 span 128 bf16 tiles at 256"]["ms"] > 0
    assert rows["path_fox pallas chunk 32 span 128 bf16 tiles across blocks at 256"]["ms"] > 0
    assert rows["path_fox pallas chunk 32 span 128 bf16 tiles across chunks at 256"]["ms"] > 0
    out = capsys.readouterr().out
    assert "| pallas PaTH-FoX (its kernel) | yes |" in out and "| fox auto |" in out and "| path_fox blockwise |" in out


@pytest.mark.slow  # 60 s; the fused paths compile for an H100 in tests/project/test_compile.py too
def test_gpu_checks_fused_paths_compile_for_an_h100():
    """Every fused path the GPU check runs compiles for an H100 by XLA's GPU compiler on this
    host (no GPU; lab.lowering.compiled_for), forward + backward in bf16 at the check's toy shape:
    cuDNN's calls where the check names cuDNN, Pallas-Triton kernels through Triton and ptxas for
    the rest (auto's FoX among them: its learned gates keep it off the channels). What a GPU
    session would otherwise find first (a Triton module that does not verify, a kernel over the
    shared memory) fails here."""
    import jax
    import jax.numpy as jnp

    from lab.lowering import compiled_for
    gpu_check = load("gpu_check")
    b, t, h, kh, d = gpu_check.sizes(True)["check"]
    args = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in ((b, t, h, d), (b, t, kh, d), (b, t, kh, d), (b, t, h))]
    for name, (ours, _, _) in gpu_check.check_cases(b, t, h, kh, d).items():
        def loss(q, k, v, gates, ours=ours):
            return ours(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), gates).astype(
                jnp.float32).sum()
        text = compiled_for(jax.grad(loss, (0, 1, 2, 3)), *args, topology="h100:1").as_text()
        want = "__cudnn$fmha" if name.startswith("cudnn") else "__gpu$xla.gpu.triton"
        assert want in text, name


def test_gpu_check_skips_what_does_not_fit(monkeypatch):
    """Items run in the plan's order while their estimate, scaled by how the finished ones
    compared with theirs, fits in the budget left; the others are named as skipped."""
    gpu_check = load("gpu_check")
    clock = iter(range(0, 1000, 10))  # every reading of the clock is 10 s later
    monkeypatch.setattr(gpu_check.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(gpu_check, "plan", lambda tiny: [
        ("checks", "a", 10, lambda: {"x": 1}), ("attention", "b", 500, lambda: {"x": 2}),
        ("train", "c", 5, lambda: 1 / 0)])
    result = gpu_check.run(100, tiny=True)
    assert [r["item"] for r in result["rows"]] == ["a", "c"]
    assert result["rows"][1]["failed"] == "ZeroDivisionError: division by zero"
    assert result["skipped"] == ["attention: b (about 500 s, 50 s left)"]
    result = gpu_check.run(1000, tiny=True, only=("train", "checks: a"))
    assert [r["item"] for r in result["rows"]] == ["a", "c"] and result["skipped"] == ["attention: b (not in --only)"]


def test_gpu_check_cut_off_keeps_its_rows(monkeypatch, tmp_path):
    """A run killed inside an item (the device call's limit) leaves the json with every finished
    row and the item it was in."""
    gpu_check = load("gpu_check")

    def killed():
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu_check, "plan", lambda tiny: [
        ("checks", "a", 1, lambda: {"x": 1}), ("checks", "b", 1, killed), ("train", "c", 1, lambda: {"x": 3})])
    path = tmp_path / "out" / "gpu_check.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_check.run(100, tiny=True, path=str(path))
    saved = json.loads(path.read_text())
    assert [r["item"] for r in saved["rows"]] == ["a"] and saved["in_flight"] == "checks: b"


def test_lowering_check_takes_a_measured_choice_as_intended(capsys, monkeypatch):
    """path_fox on cuda runs its chunked form by a measured fact (positional.attention.FACTS):
    a note and exit 0, not a FAIL (an unintended fallback still fails: the T x T test above)."""
    argv = ["--config", "configs/default.py:path_fox", *TINY_LOWERING[2:], "--platform", "cuda"]
    assert lowering_check(argv, monkeypatch) == 0
    out = capsys.readouterr().out
    assert "note: Path runs 'blockwise' on cuda by a measured choice" in out and "(NVIDIA H100, 2026-11-24)" in out


def test_triton_compile_finds_each_forms_kernels():
    """benchmarks/triton_compile.py's kernels: a scheme spec's options reach the scheme and
    attend (block_size), and every Triton kernel of the forward + backward comes back: the fused
    kernel's 3, PaTH's two-level form across blocks 5 (its kernel inside the blocks 2, the
    across-blocks kernel 3), each under its own name."""
    triton_compile = load_benchmark("triton_compile")
    assert len(triton_compile.kernels("plain", 256, 4, 2, 64)) == 3
    found = triton_compile.kernels("path_fox/span=128/across=blocks/tiles=bf16/block_size=32", 512, 4, 4, 64)
    assert len(found) == 5 and all("tt.func public @" in x["ttir"] for x in found)
    assert [x["name"] for x in found] == ["path_forward", "path_across_forward", "path_across_dq", "path_across_dkdv",
                                          "path_backward"]


@pytest.mark.slow  # 19 s
def test_sessa_gpu_tiles_tells_a_fit_from_an_overflow():
    """benchmarks/sessa_gpu_tiles.py: Sessa's solve compiled for an H100 with a chunk that fits
    (16 at width 64) and one whose kernels ask more shared memory than a block has (16 at 1,024)."""
    tiles = load_benchmark("sessa_gpu_tiles")
    small, wide = tiles.compile_tile(64, 64, 16, 0, 64), tiles.compile_tile(1024, 1024, 16, 64, 64)
    assert small["fits"] and small["asked_kib"] is None, small
    assert not wide["fits"] and wide["asked_kib"] > 227, wide


@pytest.mark.slow  # 17 s
def test_triton_compile_reads_xlas_ptxas_report_of_each_kernel():
    """The script compiles through XLA's GPU compiler for an H100 (no GPU) and finds each Pallas
    kernel in ptxas's report and XLA's launch plan: registers used (a Triton kernel of 4 warps
    takes at least a few dozen), shared memory, spills."""
    require_compiler("cuda")  # skipped where jax's CUDA plugin is not installed here (tests/conftest.py)
    run = subprocess.run([sys.executable, "benchmarks/triton_compile.py", "--schemes", "plain,path_fox/block_size=16",
                          "--tokens", "64", "--heads", "2", "--kv_heads", "1", "--head_dim", "16"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in run.stdout.splitlines() if line.startswith("| plain") or
            line.startswith("| path_fox")]
    assert [r[1].strip() for r in rows] == ["1 of 3: flash_fwd", "2 of 3: flash_dq", "3 of 3: flash_dkv",
                                            "1 of 2: path_forward", "2 of 2: path_backward"], run.stdout
    for r in rows:
        shared, registers, spilled = float(r[6]), int(r[7]), int(r[8])
        assert 0 < shared < 227 and 24 <= registers <= 255 and spilled >= 0, r
