"""Lowering for an accelerator on a host without one (jax.export): the stand-ins it needs and a
reading of the module. Used by benchmarks/lowering.py and the tests' lowering checks.

Two stand-ins, set only while a function is lowered: for cuda, jax's query of the cuDNN version
(it asks the library when it traces a cuDNN call; a CPU jaxlib has none) answers 9.10; for tpu,
Mosaic's TPU generation is named (v5e) for this host's device kind. Nothing is compiled.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import jax
from jax._src.cudnn import fused_attention_stablehlo
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir, passmanager

try:
    from jax._src.pallas.mosaic import tpu_info
except ImportError:  # a jaxlib without Mosaic
    tpu_info = None

TRITON = "__gpu$xla.gpu.triton"  # a Pallas kernel on GPU
MOSAIC = "tpu_custom_call"  # a Pallas kernel (ours or splash) on TPU
CUDNN = "__cudnn$fmha"  # prefix of jax's cuDNN flash-attention calls
# Custom calls without a serialization guarantee: an exported module is for inspection only.
UNSTABLE_CALLS = (TRITON, *(f"{CUDNN}{name}" for name in (
    "Softmax", "SoftmaxBackward", "ScaleBiasSoftmax", "ScaleBiasSoftmaxBackward", "SoftmaxDropout",
    "SoftmaxDropoutBackward", "ScaleBiasSoftmaxDropout", "ScaleBiasSoftmaxDropoutBackward", "SoftmaxF8",
    "SoftmaxBackwardF8")))


@contextlib.contextmanager
def cudnn_stand_in():
    """The cuDNN version query answers 9.10 while the block runs (lowering needs no more)."""
    with mock.patch.object(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000):
        yield


@contextlib.contextmanager
def tpu_chip_stand_in():
    """A TPU generation (v5e) named for this host's device kind while the block runs; one
    ValueError line where this JAX offers no way to."""
    if tpu_info is None or not all(hasattr(tpu_info, n) for n in ("registry", "get_tpu_info_for_chip", "ChipVersion")):
        raise ValueError("this JAX has no way to name a TPU generation for lowering on a CPU host")
    kind = jax.devices()[0].device_kind
    previous = tpu_info.registry.get(kind)
    tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        yield
    finally:
        if previous is None:
            tpu_info.registry.pop(kind, None)
        else:
            tpu_info.registry[kind] = previous


def stand_in(platform: str):
    return {"cuda": cudnn_stand_in, "tpu": tpu_chip_stand_in}.get(platform, contextlib.nullcontext)()


def exported_text(fn, *args, platform: str) -> str:
    """The StableHLO text of jit(fn)(*args) exported for `platform`, with its stand-in."""
    checks = [jax.export.DisabledSafetyCheck.custom_call(name) for name in UNSTABLE_CALLS]
    with stand_in(platform):
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
