"""Lower a Pallas kernel for an accelerator on this CPU (through jax.export): block shapes,
layouts and every op are checked; running needs the accelerator itself. For TPU the kernels
are also compiled, by libtpu for a topology's devices (`compiled_for`): VMEM limits,
layouts and Mosaic's own checks, on the chip the topology names."""

import jax
import jax.numpy as jnp

from lab.lowering import MOSAIC, TRITON, compiled_for, exported_text, simplified

__all__ = ["MOSAIC", "TRITON", "compiled_for", "excess_precision", "lowered", "simplified"]


def lowered(fn, *args, platforms=("cuda",)) -> str:
    """The StableHLO text of jit(fn)(*args) exported for the one platform in `platforms`; the
    kernels lower for the platform exported for by themselves (positional.kernels.per_platform),
    whatever this machine. Triton and cuDNN calls carry no serialization guarantee, so that
    check is waived: the text is for inspection, not for storage."""
    (platform,) = platforms
    return exported_text(fn, *args, platform=platform)


def excess_precision(fn):
    """fn as XLA on GPU computes it: its excess-precision rewrite (on by default there) drops a
    float's round trip through a narrower float (fp32 -> bf16 -> fp32 is the identity)."""
    def evaluate(jaxpr, consts, *args):
        env, wider = dict(zip(jaxpr.constvars, consts)), {}
        env.update(zip(jaxpr.invars, args))
        read = lambda v: v.val if isinstance(v, jax.extend.core.Literal) else env[v]  # noqa: E731
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if eqn.primitive.name == "convert_element_type":
                src, new = eqn.invars[0], jnp.dtype(eqn.params["new_dtype"])
                if src in wider and wider[src].dtype == new:
                    env[eqn.outvars[0]] = wider[src]
                    continue
                x = ins[0]
                if jnp.issubdtype(x.dtype, jnp.floating) and jnp.issubdtype(new, jnp.floating) \
                        and jnp.finfo(new).bits < jnp.finfo(x.dtype).bits:
                    wider[eqn.outvars[0]] = x
            if eqn.primitive.name in ("jit", "pjit", "closed_call"):
                inner = eqn.params.get("jaxpr") or eqn.params["call_jaxpr"]
                outs = evaluate(inner.jaxpr, inner.consts, *ins)
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def run(*args):
        closed = jax.make_jaxpr(fn)(*args)
        return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *args)),
                                  evaluate(closed.jaxpr, closed.consts, *jax.tree.leaves(args)))
    return run
