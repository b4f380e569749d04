"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; compiling and running need the accelerator itself."""

from lab.lowering import MOSAIC, TRITON, exported_text, simplified

__all__ = ["MOSAIC", "TRITON", "lowered", "simplified"]


def lowered(fn, *args, platforms=("cuda",)) -> str:
    """The StableHLO text of jit(fn)(*args) exported for the one platform in `platforms`; the
    kernels lower for the platform exported for by themselves (positional.kernels.per_platform),
    whatever this machine. Triton and cuDNN calls carry no serialization guarantee, so that
    check is waived: the text is for inspection, not for storage."""
    (platform,) = platforms
    return exported_text(fn, *args, platform=platform)
