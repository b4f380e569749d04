"""benchmarks/compile.py: a train step compiled for a TPU by libtpu, and for a GPU by XLA's GPU
compiler, on this CPU host (neither present): a bias scheme and a score scheme on the fused
kernel (ALiBi on cuDNN on a GPU), PaTH-FoX on its own kernel, each through the chip's compiler;
and its one-line failures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import lowering
from lab.lowering import gpu_topology, hbm_per_device, tpu_topology

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config.seq_len=256", "--config.batch_size=2", "--config.model.d_model=64",
        "--config.model.num_layers=1", "--config.model.dtype=bfloat16"]


def compile_for(*argv) -> subprocess.CompletedProcess:
    """benchmarks/compile.py run; skipped (tests/conftest.py) where the compiler of a valid topology
    is not installed here."""
    topology = argv[argv.index("--topology") + 1]
    if lowering.TOPOLOGY.fullmatch(topology) or lowering.GPU_TOPOLOGY.fullmatch(topology):
        lowering.require_compiler(lowering.platform_of(topology))
    return subprocess.run([sys.executable, "benchmarks/compile.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("scheme,site", [
    pytest.param("alibi", "1 x Alibi (layer 0): pallas -- the fused kernel", marks=pytest.mark.slow),  # 17 s
    ("tapa", "1 x Tapa (layer 0): pallas -- the fused kernel"),
    pytest.param("path_fox", "1 x Path (layer 0): pallas -- PaTH's kernel", marks=pytest.mark.slow)])  # 46 s
def test_a_train_step_compiles_for_tpu(scheme, site):
    run = compile_for("--topology", "v5e:1x1", "--config", f"configs/default.py:{scheme}", *TINY)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert site in out, out
    mosaic = int(out.split("mosaic (tpu_custom_call) ")[1].split(",")[0])
    assert mosaic >= 2, out  # forward and backward kernels, in the step the TPU compiler took
    assert "compiled for v5e:1x1 (1 x TPU v5 lite)" in out and "of 16.00 GiB: fits" in out, out


@pytest.mark.parametrize("scheme,site,calls", [
    ("alibi", "1 x Alibi (layer 0): cudnn -- plain softmax, packed rows as cuDNN segments", "cudnn fmha 2"),
    pytest.param("tapa", "1 x Tapa (layer 0): pallas -- the fused kernel", "triton 3", marks=pytest.mark.slow),
    pytest.param("path_fox", "every call site runs 'pallas'", "triton 2", marks=pytest.mark.slow)])  # 16 s, 25 s
# (PaTH's kernel is not auto's on GPU.)
def test_a_train_step_compiles_for_gpu(scheme, site, calls):
    """XLA's GPU compiler (jax's CUDA plugin, no GPU) takes the step whole: the Triton kernels
    through Triton's passes and ptxas for sm_90, cuDNN's calls, the memory plan for an H100."""
    forced = ["--noforce_auto", "--config.model.attention_impl=pallas"] if scheme == "path_fox" else []
    run = compile_for("--topology", "h100:1", "--config", f"configs/default.py:{scheme}", *TINY, *forced)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert site in out and calls in out.split("fused custom calls per step: ")[1].splitlines()[0], out
    assert "compiled for h100:1 (1 x NVIDIA H100 80GB HBM3)" in out and "of 79.65 GiB: fits" in out, out


@pytest.mark.parametrize("scheme,site", [("alibi", "1 x Alibi (layer 0): splash"),
                                         pytest.param("tapa", "1 x Tapa (layer 0): pallas -- the fused kernel",
                                                      marks=pytest.mark.slow),  # 15 s
                                         pytest.param("path_fox", "1 x Path (layer 0): pallas -- PaTH's kernel",
                                                      marks=pytest.mark.slow)])  # 47 s
def test_a_train_step_compiles_for_several_chips(scheme, site):
    """On 4 chips (batch over data 2, heads over tensor 2) every Mosaic call runs per device
    (positional.attention.per_device): XLA cannot partition one ("Mosaic kernels cannot be
    automatically partitioned" before it)."""
    run = compile_for("--topology", "v5e:2x2", "--config", f"configs/default.py:{scheme}", "--config.seq_len=1024",
                      "--config.batch_size=4", "--config.model.d_model=256", "--config.model.num_layers=1",
                      "--config.model.dtype=bfloat16", "--config.mesh.tensor=2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert site in run.stdout and "compiled for v5e:2x2 (4 x TPU v5 lite)" in run.stdout, run.stdout


def test_a_step_over_the_chips_memory_fails_in_one_line(monkeypatch):
    """The total the TPU compiler plans is checked against the chip's HBM (here a pretend 0-GiB chip)."""
    monkeypatch.setitem(lowering.TPU_HBM_GIB, "v5e", 0)
    from benchmarks import compile as compile_script
    from configs.default import get_config
    config = get_config("rope")
    config.update_from_flattened_dict({"seq_len": 256, "batch_size": 2, "model.d_model": 64,
                                       "model.num_layers": 1, "model.dtype": "bfloat16"})
    result = compile_script.compile_check(config, "v5e:1x1")
    assert result["memory"]["total_bytes"] > 0
    assert "per device on v5e:1x1, over the 0.00 GiB of its memory" in result["failure"], result["failure"]


def test_bad_topology_or_no_libtpu_is_one_line(monkeypatch, tmp_path):
    run = compile_for("--topology", "v9x:2x2", "--config", "configs/default.py:rope")
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "unknown topology 'v9x:2x2': pass a TPU topology <generation>:<chips per axis>" in run.stderr
    monkeypatch.setattr(lowering, "libtpu_path", lambda: None)
    monkeypatch.setenv("POSITIONAL_COMPILERS", str(tmp_path))  # no line left by an install that failed
    with pytest.raises(ValueError, match=r"needs the TPU compiler \(libtpu\): run `make`"):
        tpu_topology("v5e:2x2")


def test_gpu_hosts_and_their_one_line_failures(monkeypatch, tmp_path):
    """h100:2x8 is 2 hosts of 8 H100s, each the memory nvidia-smi gives an H100 80GB; a GPU the
    table lacks, or no CUDA plugin, is one line naming what to do."""
    devices = gpu_topology("h100:2x8")
    assert len(devices) == 16 and {d.device_kind for d in devices} == {"NVIDIA H100 80GB HBM3"}
    # XLA's GPU compiler calls the ptxas installed beside the plugin (not whichever is on PATH)
    assert os.path.isfile(os.path.join(lowering.jax_lib.cuda_path, "bin", "ptxas")), lowering.jax_lib.cuda_path
    assert hbm_per_device("h200:1", gpu_topology("h200:1")) == 143_771 * 2 ** 20
    run = compile_for("--topology", "a100:8", "--config", "configs/default.py:rope")
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "or GPU hosts <gpu>:[<hosts>x]<gpus per host> (gpu one of h100, h200" in run.stderr
    with pytest.raises(ValueError, match="unknown GPU topology 'h100:x8': pass <gpu>:"):
        gpu_topology("h100:x8")
    monkeypatch.setattr(lowering, "cuda_plugin_path", lambda: None)
    monkeypatch.setenv("POSITIONAL_COMPILERS", str(tmp_path))
    monkeypatch.setattr(lowering.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"compiling for GPU needs jax's CUDA plugin: run `make`"):
        gpu_topology("h100:8")


def test_a_sweep_goes_on_from_its_file_and_redo_replaces_rows(monkeypatch, tmp_path):
    """The table's sweep skips the rows its json has (rerun to go on); with redo it compiles the
    asked ones again, each replacing its old row, the others kept (compiling stood in for here)."""
    from benchmarks import compile as compile_script
    compiled = []

    def compile_check(config, topology):
        compiled.append((config.model.scheme, topology))
        return {"topology": topology, "device_kind": "TPU", "compile_s": float(len(compiled)), "failure": None}

    monkeypatch.setattr(compile_script, "compile_check", compile_check)
    path = str(tmp_path / "rows.jsonl")
    compile_script.sweep(["rope", "alibi"], ["8192"], ["v4:1x1x1"], path)
    compile_script.sweep(["rope", "alibi"], ["8192"], ["v4:1x1x1"], path)  # nothing left
    assert compiled == [("rope", "v4:1x1x1"), ("alibi", "v4:1x1x1")]
    compile_script.sweep(["alibi"], ["8192"], ["v4:1x1x1"], path, redo=True)
    rows = [json.loads(line) for line in open(path)]
    assert [(r["scheme"], r["compile_s"]) for r in rows] == [("rope", 1.0), ("alibi", 3.0)]
