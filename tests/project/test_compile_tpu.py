"""benchmarks/compile_tpu.py: a train step compiled for a TPU by libtpu on this CPU host (no TPU):
a bias scheme and a score scheme on the fused kernel, PaTH-FoX on its own kernel, each through
the TPU compiler for one generation; and its one-line failures."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab import lowering
from lab.lowering import tpu_topology

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--config.seq_len=256", "--config.batch_size=2", "--config.model.d_model=64",
        "--config.model.num_layers=1", "--config.model.dtype=bfloat16"]


def compile_tpu(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/compile_tpu.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("scheme,site", [("alibi", "1 x Alibi (layer 0): pallas -- the fused kernel"),
                                         ("tapa", "1 x Tapa (layer 0): pallas -- the fused kernel"),
                                         ("path_fox", "1 x Path (layer 0): pallas -- PaTH's kernel")])
def test_a_train_step_compiles_for_tpu(scheme, site):
    run = compile_tpu("--topology", "v5e:1x1", "--config", f"configs/default.py:{scheme}", *TINY)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert site in out, out
    mosaic = int(out.split("mosaic (tpu_custom_call) ")[1].split(",")[0])
    assert mosaic >= 2, out  # forward and backward kernels, in the step the TPU compiler took
    assert "compiled for v5e:1x1 (1 x TPU v5 lite)" in out and "of 16.00 GiB HBM: fits" in out, out


@pytest.mark.parametrize("scheme,site", [("alibi", "1 x Alibi (layer 0): splash"),
                                         ("tapa", "1 x Tapa (layer 0): pallas -- the fused kernel"),
                                         pytest.param("path_fox", "1 x Path (layer 0): pallas -- PaTH's kernel",
                                                      marks=pytest.mark.slow)])  # 47 s
def test_a_train_step_compiles_for_several_chips(scheme, site):
    """On 4 chips (batch over data 2, heads over tensor 2) every Mosaic call runs per device
    (positional.attention.per_device): XLA cannot partition one ("Mosaic kernels cannot be
    automatically partitioned" before it)."""
    run = compile_tpu("--topology", "v5e:2x2", "--config", f"configs/default.py:{scheme}", "--config.seq_len=1024",
                      "--config.batch_size=4", "--config.model.d_model=256", "--config.model.num_layers=1",
                      "--config.model.dtype=bfloat16", "--config.mesh.tensor=2")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert site in run.stdout and "compiled for v5e:2x2 (4 x TPU v5 lite)" in run.stdout, run.stdout


def test_a_step_over_the_chips_memory_fails_in_one_line(monkeypatch):
    """The total the TPU compiler plans is checked against the chip's HBM (here a pretend 0-GiB chip)."""
    monkeypatch.setitem(lowering.TPU_HBM_GIB, "v5e", 0)
    from benchmarks import compile_tpu
    from configs.default import get_config
    config = get_config("rope")
    config.update_from_flattened_dict({"seq_len": 256, "batch_size": 2, "model.d_model": 64,
                                       "model.num_layers": 1, "model.dtype": "bfloat16"})
    result = compile_tpu.compile_check(config, "v5e:1x1")
    assert result["memory"]["total_bytes"] > 0
    assert "per device on v5e:1x1, over the 0.00 GiB of HBM" in result["failure"], result["failure"]


def test_bad_topology_or_no_libtpu_is_one_line(monkeypatch):
    run = compile_tpu("--topology", "v9x:2x2", "--config", "configs/default.py:rope")
    assert run.returncode == 1 and run.stderr.strip().count("\n") == 0, run.stderr
    assert "unknown TPU topology 'v9x:2x2': pass <generation>:<chips per axis>" in run.stderr
    monkeypatch.setattr(lowering, "libtpu_path", lambda: None)
    with pytest.raises(ValueError, match=r"needs the TPU compiler \(libtpu\): run `make`"):
        tpu_topology("v5e:2x2")


def test_a_sweep_goes_on_from_its_file_and_redo_replaces_rows(monkeypatch, tmp_path):
    """The table's sweep skips the rows its json has (rerun to go on); with redo it compiles the
    asked ones again, each replacing its old row, the others kept (compiling stood in for here)."""
    from benchmarks import compile_tpu
    compiled = []

    def compile_check(config, topology):
        compiled.append((config.model.scheme, topology))
        return {"topology": topology, "device_kind": "TPU", "compile_s": float(len(compiled)), "failure": None}

    monkeypatch.setattr(compile_tpu, "compile_check", compile_check)
    path = str(tmp_path / "rows.jsonl")
    compile_tpu.sweep(["rope", "alibi"], ["8192"], ["v4:1x1x1"], path)
    compile_tpu.sweep(["rope", "alibi"], ["8192"], ["v4:1x1x1"], path)  # nothing left
    assert compiled == [("rope", "v4:1x1x1"), ("alibi", "v4:1x1x1")]
    compile_tpu.sweep(["alibi"], ["8192"], ["v4:1x1x1"], path, redo=True)
    rows = [json.loads(line) for line in open(path)]
    assert [(r["scheme"], r["compile_s"]) for r in rows] == [("rope", 1.0), ("alibi", 3.0)]
