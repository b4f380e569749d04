"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; compiling and running need the accelerator itself."""

import jax

TRITON = "__gpu$xla.gpu.triton"  # the custom call a Pallas kernel lowers to on GPU (Triton)


def lowered_for_gpu(fn, *args) -> str:
    """The StableHLO text of jit(fn)(*args) exported for CUDA, with the kernels chosen as on a GPU.

    Triton calls carry no serialization guarantee (their IR is tied to the jaxlib version), so
    that check is waived: the text is for inspection, not for storage."""
    backend = jax.default_backend
    try:
        jax.default_backend = lambda: "gpu"  # the kernels pick GPU tile rules and compiler params
        exported = jax.export.export(jax.jit(fn), platforms=["cuda"],
                                     disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])
        return exported(*args).mlir_module()
    finally:
        jax.default_backend = backend
