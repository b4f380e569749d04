"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; compiling and running need the accelerator itself."""

import contextlib

import jax
import pytest
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir, passmanager

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowers to on GPU (Triton)
MOSAIC = "tpu_custom_call"  # ... and on TPU (Mosaic)


def lowered(fn, *args, platforms=("cuda",)) -> str:
    """The StableHLO text of jit(fn)(*args) exported for `platforms`; the kernels lower for the
    platform exported for by themselves (positional.kernels.per_platform), whatever this machine.

    Triton calls carry no serialization guarantee (their IR is tied to the jaxlib version), so
    that check is waived: the text is for inspection, not for storage."""
    exported = jax.export.export(jax.jit(fn), platforms=list(platforms),
                                 disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])
    return exported(*args).mlir_module()


@contextlib.contextmanager
def tpu_chip():
    """Lowering for tpu on a CPU host: Mosaic asks the device for its TPU generation, so name one
    (v5e) for this machine's device kind while the block runs; skip where this JAX cannot."""
    tpu_info = pytest.importorskip("jax._src.pallas.mosaic.tpu_info")
    if not all(hasattr(tpu_info, n) for n in ("registry", "get_tpu_info_for_chip", "ChipVersion")):
        pytest.skip("this JAX has no way to name a TPU generation for lowering on a CPU")
    kind = jax.devices()[0].device_kind
    tpu_info.registry[kind] = lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5E, 1)
    try:
        yield
    finally:
        tpu_info.registry.pop(kind)


def simplified(text: str) -> str:
    """The module after MLIR's canonicalize, symbol-dce and cse: what a platform_dependent
    leaves for other platforms (their branches' residuals, zeros here) is gone, as XLA's own
    dead-code elimination removes it before anything is allocated."""
    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        passmanager.PassManager.parse("builtin.module(canonicalize,symbol-dce,cse)").run(module.operation)
        return str(module)
