"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; compiling and running need the accelerator itself."""

import jax

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowers to on GPU (Triton)
MOSAIC = "tpu_custom_call"  # ... and on TPU (Mosaic)


def lowered(fn, *args, platforms=("cuda",)) -> str:
    """The StableHLO text of jit(fn)(*args) exported for `platforms`; the kernels lower for
    those platforms by themselves (positional.kernels.per_platform), whatever this machine is.

    Triton calls carry no serialization guarantee (their IR is tied to the jaxlib version), so
    that check is waived: the text is for inspection, not for storage."""
    return exported(fn, *args, platforms=platforms).mlir_module()


def exported(fn, *args, platforms=("cuda",)) -> jax.export.Exported:
    return jax.export.export(jax.jit(fn), platforms=list(platforms),
                             disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])(*args)
