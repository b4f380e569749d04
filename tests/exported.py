"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; running needs the accelerator itself. For TPU the kernels
are also compiled, by libtpu for a topology's devices (`compiled_for_tpu`): VMEM limits,
layouts and Mosaic's own checks, on the chip the topology names."""

import jax

from lab.lowering import MOSAIC, TRITON, exported_text, simplified, target, tpu_topology

__all__ = ["MOSAIC", "TRITON", "compiled_for_tpu", "lowered", "simplified"]


def compiled_for_tpu(fn, *args, topology: str = "v5e:1x1"):
    """jit(fn)(*args) compiled by the TPU compiler (libtpu, no TPU) for one chip of `topology`,
    args ShapeDtypeStructs placed on it; the kernels are sized for that chip."""
    mesh = jax.sharding.Mesh(tpu_topology(topology)[:1], ("x",))
    placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec())) for a in args]
    with target("tpu", mesh):
        return jax.jit(fn).lower(*placed).compile()


def lowered(fn, *args, platforms=("cuda",)) -> str:
    """The StableHLO text of jit(fn)(*args) exported for the one platform in `platforms`; the
    kernels lower for the platform exported for by themselves (positional.kernels.per_platform),
    whatever this machine. Triton and cuDNN calls carry no serialization guarantee, so that
    check is waived: the text is for inspection, not for storage."""
    (platform,) = platforms
    return exported_text(fn, *args, platform=platform)
