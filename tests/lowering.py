"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; compiling and running need the accelerator itself."""

import jax

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
