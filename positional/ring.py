"""Ring attention: causal attention with the sequence split over a mesh axis, the keys and
values passed from device to device around the ring.

Each of the n devices along `axis` holds T/n consecutive queries, keys, values and segment ids.
In step s = 0..n-1 a device attends its queries to the key/value shard it holds (blockwise,
`blockwise_lse`: one block of scores at a time), then hands that shard (keys, values and the
keys' segment ids) to the next device with `jax.lax.ppermute` and receives the previous
device's: device i sees shard (i - s) mod n at step s, so every key once in n steps. The steps'
partial outputs merge by their log-sum-exp (the online softmax one level up), in fp32. In the
forward no device holds more than its own and one visiting key/value shard, where the
partitioner's gather (impl "blockwise" on a sequence-sharded mesh) gives every device all T.

Semantics are those of `reference_attention` (GQA, causal and same-segment mask, fp32 scores,
statistics and accumulation, output in q's dtype). Scores of a (query shard, key shard) pair use
global indices (shard i's token t at i T/n + t), so `bias_fn(qi, kj)` and `score_fn(qb, kb, qi,
kj)` (ALiBi, FoX, TAPA) work unchanged. Schemes pass them as `hooks(features)`, built inside
the shard_map from their per-token features passed in replicated: every device holds all of
them (for FoX log f [B, T, H], small beside the activations) and recomputes, e.g., FoX's gate
sums over the whole sequence; their gradients are summed over devices at the boundary. (Plain
closures also work, but not over arrays of a partitioner-sharded program: see ring_attention.)
A bias comes back for the whole batch and every head and each device keeps its own rows and
heads of it, so one block's bias is computed for all of them.

Batch stays split over `batch_axes` and heads over `head_axes` inside the shard_map where they
divide (query and key/value heads both, so a query head's key/value head is on its device), as
models/sharding.spec splits them outside; otherwise those dimensions are replicated.

Causal skipping and load imbalance: a key shard wholly after the query shard (j > i) is skipped
by a `lax.cond`, so device i computes i + 1 shard pairs: the last device n, the first one, and a
step waits for the busiest (a zig-zag layout, device i holding chunks i and 2n-1-i, would even
it out; not done). The transfers happen in every step on every device.

Gradients are JAX's autodiff through the scan, the cond and ppermute (whose transpose sends the
cotangents the other way round). The scan keeps each step's visiting shard and partial output, so
the backward holds all T keys and values per device, O(T K D) as the gather does, while scores
stay one block at a time; a custom VJP passing dK, dV round the ring would make it O(T K D / n).
The shard_map runs with check_vma=False: with the check, JAX sums a replicated input's gradient
inside the skip's cond, where the devices that skip never join the sum and the program hangs.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from positional.attention import (MASKED, BiasFn, ScoreFn, _check_shapes, blockwise_attention,
                                  blockwise_lse)

Hooks = Callable[[Any], tuple[BiasFn | None, ScoreFn | None]]


def _dividing(mesh, names, *sizes) -> tuple:
    """The axes of `names` in `mesh` (size > 1) if together they divide every size, else ()."""
    names = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in names)
    return names if all(size % n == 0 for size in sizes) else ()


def ring_attention(q, k, v, *, mesh, axis: str = "sequence", bias_fn: BiasFn | None = None,
                   score_fn: ScoreFn | None = None, segment_ids=None, scale: float | None = None,
                   block_size: int = 512, hooks: Hooks | None = None, features=None,
                   batch_axes=("data", "fsdp"), head_axes=("tensor",)) -> jax.Array:
    """Causal attention of q [B, T, H, D] on k, v [B, T, K, D] with T split over mesh axis `axis`
    (T a multiple of its size), keys and values passed round the ring. Returns [B, T, H, D].

    `hooks(features) -> (bias_fn, score_fn)`, if given, replaces bias_fn and score_fn: it runs
    inside the shard_map on `features` (a pytree of arrays, passed in replicated). Hooks that
    close over arrays of a program sharded by the partitioner must come this way: in jax 0.10
    the gradient of such a closed-over array fails inside a shard_map ("Context mesh ... should
    match the mesh of sharding ..."), while closures over unsharded arrays are fine.
    """
    _check_shapes(q, k, v, segment_ids)
    b, t, h, _ = q.shape
    n = mesh.shape[axis]
    if k.shape[1] != t or t % n:
        raise ValueError(f"ring attention needs as many keys as queries and a length that the {n} devices "
                         f"of mesh axis {axis!r} divide; got q{q.shape} k{k.shape}")
    batch, heads = _dividing(mesh, batch_axes, b), _dividing(mesh, head_axes, h, k.shape[2])
    spec = P(batch or None, axis, heads or None, None)
    shard_len, ring = t // n, [(i, (i + 1) % n) for i in range(n)]
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)

    def own_part(x, dim, names, size):
        """This device's part of dimension `dim` of a bias computed for all `size` of it."""
        if not names or x.shape[dim] != size:
            return x
        part = size // math.prod(mesh.shape[a] for a in names)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(names) * part, part, dim)

    def shard(q, k, v, seg, features):
        me = jax.lax.axis_index(axis)
        bias, score = hooks(features) if hooks else (bias_fn, score_fn)

        def local_bias(qi, kj):
            return own_part(own_part(bias(qi, kj), 0, batch, b), 1, heads, h)

        def visit(acc, kv, src):
            def merge(acc):
                o, lse = acc
                o_s, lse_s = blockwise_lse(q, *kv[:2], bias_fn=local_bias if bias else None,
                                           segment_ids=seg, key_segment_ids=kv[2], q_offset=me * shard_len,
                                           k_offset=src * shard_len, scale=scale, score_fn=score,
                                           block_size=block_size)
                lse_new = jnp.logaddexp(lse, lse_s)
                return (o * jnp.exp(lse - lse_new)[..., None] + o_s * jnp.exp(lse_s - lse_new)[..., None],
                        lse_new)

            return jax.lax.cond(src <= me, merge, lambda acc: acc, acc)  # src > me: all in the future

        def step(carry, s):
            acc, kv = carry
            acc = visit(acc, kv, (me - s) % n)
            return (acc, jax.lax.ppermute(kv, axis, ring)), None

        acc = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], MASKED, jnp.float32))
        (acc, kv), _ = jax.lax.scan(step, (acc, (k, v, seg)), jnp.arange(n - 1))
        o, _ = visit(acc, kv, (me - n + 1) % n)  # the last shard needs no passing on
        return o.astype(q.dtype)

    features = {} if features is None else features
    in_specs = (spec, spec, spec, P(batch or None, axis), jax.tree.map(lambda _: P(), features))
    return jax.shard_map(shard, mesh=mesh, in_specs=in_specs, out_specs=spec, check_vma=False)(
        q, k, v, segment_ids, features)


_MESHES: list = []  # the meshes of enclosing `ring_mesh` contexts, innermost last


@contextlib.contextmanager
def ring_mesh(mesh):
    """Within this context attention impl "ring" splits the sequence over `mesh`
    (models.sharding.activation_rules enters it while train.py traces its step).

    A context of its own, not JAX's (jax.sharding.use_abstract_mesh): that one puts the mesh
    in the type of every array of the program, which changes how the whole step traces.
    """
    _MESHES.append(mesh)
    try:
        yield
    finally:
        _MESHES.pop()


def mesh_ring_attention(q, k, v, *, q_offset=0, axis: str = "sequence", hooks: Hooks | None = None,
                        features=None, **kwargs) -> jax.Array:
    """Attention impl "ring": `ring_attention` over the mesh of the enclosing `ring_mesh`.
    Outside any, where its `axis` has size 1, and for decoding (q_offset, or fewer queries
    than keys) it is `blockwise_attention`, with the same arguments and result."""
    mesh = _MESHES[-1] if _MESHES else None
    decoding = not isinstance(q_offset, int) or q_offset != 0 or q.shape[1] != k.shape[1]
    if mesh is None or mesh.shape.get(axis, 1) == 1 or decoding:
        if hooks:
            kwargs["bias_fn"], kwargs["score_fn"] = hooks(features)
        return blockwise_attention(q, k, v, q_offset=q_offset, **kwargs)
    return ring_attention(q, k, v, mesh=mesh, axis=axis, hooks=hooks, features=features, **kwargs)
