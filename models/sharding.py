"""Logical axes: how parameters and activations map onto the device mesh.

Every parameter dimension and every activation dimension has a logical name (batch, sequence,
embed, heads, mlp, vocab); `RULES` maps each name to mesh axes (data, fsdp, tensor, sequence).
JAX's SPMD partitioner does the rest: a sequence split over the `sequence` axis gives the same
result as on one device, for every scheme, because the partitioner keeps the program's
semantics (cumulative angle, gate and transport carries included); what changes is where the
work and the memory go.

Parameters get their logical axes from their place in the model (`PARAM_AXES`, matched on the
end of the parameter's path, so optimizer moments of the same parameter get the same axes).
Parameters not listed (norm scales, position features, the Sessa mixers) are split over
`fsdp` along their largest dimension that it divides. A dimension whose size the mesh axis
does not divide is replicated rather than rejected.
"""

from __future__ import annotations

import contextlib

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from positional.ring import ring_mesh

MESH_AXES = ("data", "fsdp", "tensor", "sequence")

# logical name -> mesh axis or axes (None: replicated)
RULES = (("batch", ("data", "fsdp")), ("sequence", "sequence"), ("embed", "fsdp"), ("heads", "tensor"),
         ("mlp", "tensor"), ("vocab", "tensor"))

# (module, parameter) at the end of a parameter's path -> logical axes of its dimensions
PARAM_AXES = {
    ("q", "kernel"): ("embed", "heads"), ("k", "kernel"): ("embed", "heads"),
    ("v", "kernel"): ("embed", "heads"), ("o", "kernel"): ("heads", "embed"),
    ("q", "bias"): ("heads",), ("k", "bias"): ("heads",), ("v", "bias"): ("heads",),
    ("gate", "kernel"): ("embed", "mlp"), ("up", "kernel"): ("embed", "mlp"),
    ("down", "kernel"): ("mlp", "embed"),
    ("embed", "embedding"): ("vocab", "embed"), ("head", "kernel"): ("embed", "vocab"),
}
# Position features have modules named like the MLP's (PaTH's w projection has up/down).
_FEATURES = "features"


def spec(mesh, axes, shape, rules=RULES) -> P:
    """PartitionSpec of an array with logical `axes` on `mesh` (undividable dims replicated)."""
    table = dict(rules)
    out = []
    for name, size in zip(axes, shape):
        mesh_axes = table.get(name)
        mesh_axes = (mesh_axes,) if isinstance(mesh_axes, str) else tuple(mesh_axes or ())
        mesh_axes = tuple(a for a in mesh_axes if mesh.shape.get(a, 1) > 1)
        n = 1
        for a in mesh_axes:
            n *= mesh.shape[a]
        if not mesh_axes or size % n:
            out.append(None)
        else:
            out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def param_axes(path) -> tuple | None:
    """Logical axes of the parameter (or optimizer moment) at `path`, or None (replicated)."""
    keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
    if _FEATURES in keys:
        return None
    return PARAM_AXES.get(tuple(keys[-2:]))


def param_sharding(mesh, path, x, rules=RULES) -> NamedSharding:
    axes = param_axes(path)
    if axes is not None and len(axes) == x.ndim:
        return NamedSharding(mesh, spec(mesh, axes, x.shape, rules))
    n, out = mesh.shape.get("fsdp", 1), [None] * x.ndim  # FSDP only: the largest dim it divides
    for i in sorted(range(x.ndim), key=lambda i: -x.shape[i]):
        if n > 1 and x.shape[i] % n == 0:
            out[i] = "fsdp"
            break
    return NamedSharding(mesh, P(*out))


def state_shardings(mesh, tree, rules=RULES):
    """NamedShardings for a tree of parameters / optimizer state (arrays or shape structs)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: param_sharding(mesh, p, x, rules), tree)


_ACTIVE: list = []  # (mesh, rules) while a sharded program is traced


@contextlib.contextmanager
def activation_rules(mesh, rules=RULES):
    """Within this context, `constrain` pins activations to the mesh (train.py traces its step
    inside it) and attention impl "ring" splits the sequence over it (positional/ring.py);
    outside, `constrain` does nothing, so the model runs unchanged anywhere."""
    _ACTIVE.append((mesh, rules))
    try:
        with ring_mesh(mesh):
            yield
    finally:
        _ACTIVE.pop()


def constrain(x, axes):
    """Sharding constraint on an activation with logical `axes` (no-op outside activation_rules)."""
    if not _ACTIVE:
        return x
    mesh, rules = _ACTIVE[-1]
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(mesh, axes, x.shape, rules)))
