"""Every results json committed since the lock names what computed it (lab/provenance.py): Python,
jax, jaxlib, flax, optax, numpy and the lock's SHA-256; the writers add it, and the record is the
installed one."""

import hashlib
import json
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from lab import provenance

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("docs/results", "benchmarks/results")
# The results jsons committed before the lock (commit 7f19380), which record no environment.
BEFORE_THE_LOCK = frozenset((
    "accumulated.json", "accumulated_probes_seeds.json", "accumulated_seeds.json", "accumulated_sweep5.json",
    "accumulated_sweep5b.json", "demo.json", "demo_across.json", "demo_decay.json", "demo_decay_tables.json",
    "demo_documents.json", "demo_documents_eval.json", "demo_pinned.json", "demo_seeds.json",
    "demo_seeds_across.json", "espr_lm_seeds.json", "espr_shift.json", "espr_shift_penalty.json",
    "espr_sweep5.json", "gpu_check_h200.json", "gpu_check_h200_7561e56.json", "paper_claims.json", "path.json",
    "path_across_runs_tpu_v4.json", "path_fla_h200_7561e56.json", "path_fox_scale.json",
    "path_fox_scale_within.json", "path_fox_sweep5.json", "path_kernel_h100.json", "path_probes.json",
    "path_seeds.json", "path_sweep5.json", "path_two_levels_cpu.json", "path_two_levels_cpu_8k.json",
    "position_generalization.json", "position_generalization_decomposition_seeds.json",
    "position_generalization_lm_infinite.json", "position_generalization_path_fox_scale.json",
    "position_generalization_seeds.json", "retrieval_mix.json", "retrieval_mix_lengths.json",
    "retrieval_mix_pk1600.json", "retrieval_needles.json", "retrieval_weighted.json",
    "retrieval_weighted_seeds.json", "retrieval_weighted_seeds12.json", "sessa_lm_seeds.json",
    "sessa_lm_sweep5.json", "sessa_mqar_seeds.json", "sessa_mqar_sweep5.json", "sessa_symbolsoup_budget.json",
    "sessa_symbolsoup_budget_seed2.json", "sessa_symbolsoup_budget_seeds34.json",
    "sessa_symbolsoup_curriculum.json", "sessa_symbolsoup_full.json", "sessa_symbolsoup_full_seeds.json",
    "sessa_symbolsoup_seeds.json", "sweep_demo_fast.json", "sweep_demo_fast_t5.json", "tapa_10x.json",
    "tapa_extended.json", "tapa_extended_across.json", "tapa_fair_extended.json", "tapa_fair_zeroshot.json",
    "tapa_head128_extended.json", "tapa_head128_zeroshot.json", "tapa_head64_extended.json",
    "tapa_head64_zeroshot.json", "tapa_kernel_h100.json", "tapa_kernel_h100_before_bwd_fix.json",
    "tapa_lowlr_extended.json", "tapa_lowlr_zeroshot.json", "tapa_near_far.json", "tapa_zeroshot.json"))
KEYS = {"python", "jax", "jaxlib", "flax", "optax", "numpy", "lock"}


def lacking(path: Path) -> str | None:
    """Why the json at `path` does not name its environment, or None."""
    data = json.loads(path.read_text())
    env = data.get("environment") if isinstance(data, dict) else None
    if not isinstance(env, dict) or not KEYS <= env.keys():
        return f"{path}: no \"environment\" with {sorted(KEYS)} (write it with lab.provenance)"
    if not all(env[key] for key in KEYS - {"lock"}):
        return f"{path}: an empty version in its environment {env}"
    return None


def test_every_results_json_since_the_lock_names_its_environment():
    new = [p for folder in FOLDERS for p in sorted((ROOT / folder).glob("*.json")) if p.name not in BEFORE_THE_LOCK]
    assert not [why for p in new if (why := lacking(p))]


def test_the_check_fails_on_a_json_without_it(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"rows": [1, 2]}))
    stamped = tmp_path / "stamped.json"
    provenance.write_results(str(stamped), {"rows": [1, 2]})
    assert "no \"environment\"" in lacking(bare)
    assert lacking(stamped) is None


def test_the_environment_is_the_installed_one(tmp_path, monkeypatch):
    """The versions are those the packages report of themselves, and the lock is the one the
    environment's installed-from names (`make` writes it); without one, None."""
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    env = provenance.environment()
    assert (env["jax"], env["numpy"], env["lock"]) == (jax.__version__, np.__version__, None)
    assert env["python"] == ".".join(map(str, sys.version_info[:3]))
    (tmp_path / "installed-from").write_text("lock/main.txt sha256:" + "ab" * 32 + "\n")
    env = provenance.environment()
    assert env["lock"] == "lock/main.txt sha256:" + "ab" * 32
    assert provenance.describe(env).endswith(f"numpy {np.__version__}, installed from lock/main.txt (sha256 abababababab)")


@pytest.mark.skipif(not (Path(sys.prefix) / "installed-from").is_file(), reason="an environment `make` did not install")
def test_make_records_the_lock_it_installed_from():
    lock, digest = provenance.environment()["lock"].split(" sha256:")
    assert digest == hashlib.sha256((ROOT / lock).read_bytes()).hexdigest()
