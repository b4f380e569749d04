"""Lowering and compiling for an accelerator on a host without one: the chip the kernels are
told they target, and a reading of the module. Used by benchmarks/lowering.py (jax.export),
benchmarks/compile_tpu.py (the TPU compiler through libtpu) and the tests' lowering checks.

Pallas sizes a kernel for the chip of the abstract mesh's device where one is set (else it asks
the default device, here a CPU, which it refuses); `target` sets it while a function is lowered:
for cuda an H100 (and jax's query of the cuDNN version, which a CPU jaxlib cannot answer, answers
9.10), for tpu the generation asked for (v5e unless told), or the devices of a TPU topology.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys
from unittest import mock

import jax
from jax._src import cloud_tpu_init
from jax.experimental import topologies
from jax._src.cudnn import fused_attention_stablehlo
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir, passmanager

TRITON = "__gpu$xla.gpu.triton"  # a Pallas kernel on GPU
MOSAIC = "tpu_custom_call"  # a Pallas kernel (ours or splash) on TPU
CUDNN = "__cudnn$fmha"  # prefix of jax's cuDNN flash-attention calls
# Custom calls without a serialization guarantee: an exported module is for inspection only.
UNSTABLE_CALLS = (TRITON, *(f"{CUDNN}{name}" for name in (
    "Softmax", "SoftmaxBackward", "ScaleBiasSoftmax", "ScaleBiasSoftmaxBackward", "SoftmaxDropout",
    "SoftmaxDropoutBackward", "ScaleBiasSoftmaxDropout", "ScaleBiasSoftmaxDropoutBackward", "SoftmaxF8",
    "SoftmaxBackwardF8")))

# The device kind a platform's kernels are lowered for when no device is named: (kind, cores).
DEFAULT_CHIPS = {"cuda": ("NVIDIA H100 80GB HBM3", 132), "tpu": ("TPU v5 lite", 1)}
_JAX_PLATFORM = {"cuda": "gpu", "tpu": "tpu"}


@contextlib.contextmanager
def target(platform: str, device=None, mesh: jax.sharding.Mesh | None = None):
    """While the block runs, Pallas kernels lower for `device` (a jax device or
    jax.sharding.AbstractDevice; default DEFAULT_CHIPS[platform]), through the abstract mesh of
    `mesh` (default one device); on cuda the cuDNN version query answers 9.10. Other platforms:
    nothing is set."""
    if platform not in _JAX_PLATFORM:
        yield
        return
    if device is None:
        kind, cores = DEFAULT_CHIPS[platform]
        device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform=_JAX_PLATFORM[platform])
    elif not isinstance(device, jax.sharding.AbstractDevice):
        device = jax.sharding.AbstractDevice(device_kind=device.device_kind, platform=device.platform,
                                             num_cores=getattr(device, "num_cores", None))
    abstract = (mesh.abstract_mesh if mesh is not None else jax.sharding.AbstractMesh((1,), ("target",), (jax.sharding.AxisType.Auto,)))
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.sharding.use_abstract_mesh(abstract.update(abstract_device=device)))
        if platform == "cuda":
            stack.enter_context(mock.patch.object(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000))
        yield


def exported_text(fn, *args, platform: str) -> str:
    """The StableHLO text of jit(fn)(*args) exported for `platform`, with its stand-in."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in UNSTABLE_CALLS]
    with target(platform):
        exported = jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(*args)
    return exported.mlir_module()


def simplified(text: str) -> str:
    """The module after MLIR's canonicalize, symbol-dce and cse. Differentiating a
    `jax.lax.platform_dependent` joins the branches' residuals, so the branch lowered returns
    zeros in the slots of the others' (the CPU reference's T x T scores among them): dead code,
    which XLA removes before anything is allocated, and which these passes remove here."""
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse("builtin.module(canonicalize,symbol-dce,cse)").run(module.operation)
        return str(module)


# ---- compiling for a TPU topology on this host (libtpu, no TPU) -------------------------------

# Each generation's name in a topology (`v5e:2x2`) -> HBM per chip, in GiB.
TPU_HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
TOPOLOGY = re.compile(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+){1,2})")


def libtpu_path() -> str | None:
    """The TPU compiler JAX will load: TPU_LIBRARY_PATH, an installed libtpu module, or the one
    `make` puts beside the interpreter's environment (<venv>/libtpu, off the import path)."""
    found = cloud_tpu_init.get_tpu_library_path()
    beside = os.path.join(sys.prefix, "libtpu", "libtpu", "libtpu.so")
    return found or (beside if os.path.isfile(beside) else None)


def tpu_topology(name: str) -> list:
    """The devices of a TPU topology (`v4:2x2x1`, `v5e:2x2`, `v5p:2x2x4`, `v6e:2x2`), to lower and
    compile for with the TPU compiler on this host; one ValueError line for an unknown name or a
    missing libtpu."""
    if not TOPOLOGY.fullmatch(name):
        raise ValueError(f"unknown TPU topology {name!r}: pass <generation>:<chips per axis>, generation one "
                         f"of {', '.join(TPU_HBM_GIB)}, e.g. v4:2x2x1, v5e:2x2, v5p:2x2x4, v6e:2x2")
    jax.devices()  # this host's own backends first: with the library named, JAX would look for a TPU
    path = libtpu_path()
    if path is None:
        raise ValueError("compiling for TPU needs the TPU compiler (libtpu): run `make` (installs it in "
                         ".venv/libtpu) or `pip install -e '.[tpu]'`")
    os.environ["TPU_LIBRARY_PATH"] = path
    # libtpu reads this host's TPU from these when it loads and, on a host without one, prints a
    # page of errors; they do not choose what is compiled for (the topology does).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    try:
        # v4 and v5p chips have two TensorCores, which JAX shows as one device ("megacore").
        megacore = {"chip_config_name": "megacore"} if name.split(":")[0] in ("v4", "v5p") else {}
        return list(topologies.get_topology_desc(platform="tpu", topology_name=name, **megacore).devices)
    except Exception as e:  # noqa: BLE001 -- libtpu's own message, in one line
        raise ValueError(f"TPU topology {name!r}: {str(e).splitlines()[0]}") from None


def tpu_hbm_per_device(name: str, devices: list) -> int:
    """HBM bytes of one device of the topology (a chip's, shared by its devices where a chip
    shows several)."""
    chips = math.prod(int(n) for n in name.split(":")[1].split("x"))
    return TPU_HBM_GIB[name.split(":")[0]] * 2 ** 30 * chips // len(devices)
