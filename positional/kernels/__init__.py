"""Pallas kernels, each with the signature of the reference it accelerates.

A kernel lowers for the platform it is lowered for (`per_platform`), not for the machine that
traces it: `jax.export(..., platforms=["tpu"])` on a CPU host gives Mosaic, `["cuda"]` Triton.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
from jax.interpreters import batching, mlir

# platform_dependent's platform names -> the backend names of the tile rules and defaults.
PLATFORMS = {"cpu": "cpu", "cuda": "gpu", "tpu": "tpu"}
# TPU: the VMEM a kernel's tiles use beside the buffers it keeps for a whole sequence. Measured
# by the TPU compiler on a v4 (16 MiB): PaTH's backward at 8K and the Sessa solve at 32K used
# less than this beyond their resident buffers (benchmarks/RESULTS.md, section 'TPU compiled
# through libtpu on this CPU host', the notes under its compile table).
VMEM_HEADROOM = 8 * 2 ** 20
# TPU: the most VMEM a kernel keeps for a whole sequence on any chip (with the scoped VMEM the
# kernels ask for beside it, 96 MiB: within a v5e's or v6e's 128 MiB).
RESIDENT_MAX = 64 * 2 ** 20


def tpu_vmem_bytes() -> int | None:
    """VMEM per TensorCore of the TPU being lowered for, as Pallas describes it (this process's
    TPU, or the one `lab.lowering.target` or an abstract mesh names); None where none is known
    (a host without a TPU, outside those)."""
    try:
        from jax._src.pallas.mosaic import tpu_info
        info = getattr(tpu_info.get_tpu_info, "__wrapped__", tpu_info.get_tpu_info)  # uncached: asked per chip
        return info().vmem_capacity_bytes
    except (ImportError, ValueError, AttributeError, RuntimeError):
        return None


def resident_limit(most: int = RESIDENT_MAX) -> tuple[int, str]:
    """(the most VMEM a TPU kernel may keep for a whole sequence, how that was decided, for its
    one-line refusal): `most`, and on a TPU whose VMEM is known, no more than it less VMEM_HEADROOM."""
    vmem = tpu_vmem_bytes()
    if vmem is None or vmem - VMEM_HEADROOM >= most:
        return most, f"at most {most // 2 ** 20} MiB"
    limit = max(vmem - VMEM_HEADROOM, 0)
    return limit, f"at most {limit // 2 ** 20} MiB on a TPU with {vmem // 2 ** 20} MiB of VMEM"


def check_tile(kernel: str, name: str, size: int, backend: str, interpret: bool) -> None:
    """Raise naming the field when a tile size cannot run on this backend."""
    if interpret:
        ok, need = size >= 1, "a positive integer"
    elif backend == "gpu":
        ok, need = size >= 16 and size & (size - 1) == 0, "a power of two >= 16 on GPU (Triton)"
    elif backend == "tpu":
        ok, need = size % 128 == 0 and size > 0, "a multiple of 128 on TPU (Mosaic)"
    else:
        raise ValueError(f"the {kernel} Pallas kernel runs on GPU or TPU, or in interpret mode; "
                         f"backend {backend!r} needs interpret=True")
    if not ok:
        raise ValueError(f"{kernel} kernel {name}={size} is not usable: it must be {need}")


def _refuse_lowering(ctx, *args, message: str, avals):
    raise ValueError(message)


def _refused_batched(args, dims, *, message: str, avals):
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)  # None: not batched
    avals = tuple(jax.core.ShapedArray((size, *a.shape), a.dtype) for a in avals)
    return _refused_p.bind(*args, message=message, avals=avals), [0] * len(avals)


# Stands for a kernel a platform cannot take (an explicit tile it refuses): it traces like the
# kernel, so the other platforms' branches lower, and raises the reason if lowered itself.
_refused_p = jex.core.Primitive("pallas_kernel_refused")
_refused_p.multiple_results = True
_refused_p.def_abstract_eval(lambda *args, message, avals: list(avals))
mlir.register_lowering(_refused_p, _refuse_lowering)
batching.primitive_batchers[_refused_p] = _refused_batched


def _refused(message: str, like, args):
    leaves, tree = jax.tree.flatten(like)
    avals = tuple(jax.core.ShapedArray(x.shape, x.dtype) for x in leaves)
    return tree.unflatten(_refused_p.bind(*args, message=message, avals=avals))


def _refusal(message: str, out) -> Callable:
    """A function of the kernel's arrays, shaped like its output `out` (a pytree of
    ShapeDtypeStruct), whose forward and gradient raise ValueError(message) when lowered."""

    @jax.custom_vjp
    def refused(*args):
        return _refused(message, out, args)

    def backward(args, cotangent):
        floats = [a for a in args if jnp.issubdtype(a.dtype, jnp.inexact)]
        grads = iter(_refused(message, floats, (*args, *jax.tree.leaves(cotangent))))
        return tuple(next(grads) if jnp.issubdtype(a.dtype, jnp.inexact) else None
                     for a in args)

    refused.defvjp(lambda *args: (refused(*args), args), backward)
    return refused


def per_platform(settings: Callable[[str, bool], Any], run: Callable, args: tuple,
                 interpret: bool | None, platform: str | None = None):
    """run(settings(backend, interpret), *args), lowered for the platform being lowered for.

    `settings` gives a platform's static configuration (tiles, compiler options) and raises
    ValueError when the platform cannot take what the caller asked for. interpret=None: the
    Pallas interpreter on CPU, Triton on cuda, Mosaic on tpu; True: the interpreter everywhere;
    False: never the interpreter (lowering for CPU fails). A platform whose settings raise is
    refused when lowered for, with that error; the others lower as usual (jax.export).
    `platform` ("cpu", "cuda" or "tpu"), where given, builds that platform's alone: for a caller
    that is itself one branch of a `platform_dependent`.

    One platform per lowering: JAX 0.10 lowers a pallas_call inside a platform_dependent branch
    for every platform of the module, so an export for ["cpu", "cuda"] fails in Pallas ("Only
    interpret mode is supported on CPU backend").
    """
    if interpret:
        return run(settings("cpu", True), *args)
    if platform is not None:  # the caller already branches per platform (the "auto" dispatcher)
        return run(settings(PLATFORMS[platform], interpret is None and platform == "cpu"), *args)
    flat, tree = jax.tree.flatten(args)  # the branches and the refusal take arrays, not pytrees
    branches, refused = {}, {}
    for platform, backend in PLATFORMS.items():
        try:
            static = settings(backend, interpret is None and backend == "cpu")
        except ValueError as error:
            refused[platform] = str(error)
        else:
            branches[platform] = lambda *a, st=static: run(st, *jax.tree.unflatten(tree, a))
    if not branches:
        raise ValueError("; ".join(f"{p}: {m}" for p, m in refused.items()))
    if refused:
        out = jax.eval_shape(next(iter(branches.values())), *flat)
        branches |= {p: _refusal(m, out) for p, m in refused.items()}
    return jax.lax.platform_dependent(*flat, **branches)


def backward_inputs(arrays: dict, o, lse, do, d_lse=None) -> dict:
    """A flash-style kernel's backward inputs: its forward `arrays` ({'q': ..., 'k': {..., 'v'}})
    with the output's cotangent `do` (in V's dtype), the rows' log-sum-exp `lse` and
    delta = rowsum(o * do) on the query side, less the log-sum-exp's cotangent `d_lse` where the
    kernel returns it (d lse_i / d s_ij = p_ij)."""
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    if d_lse is not None:
        delta = delta - d_lse
    q = {**arrays["q"], "do": do.astype(arrays["k"]["v"].dtype), "lse": lse, "delta": delta}
    return {"q": q, "k": arrays["k"]}
