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
sums over the whole sequence; their gradients are summed over the devices. Plain closures
work too: `jax.closure_convert` turns the arrays they hold into such features.
A bias comes back for the whole batch and every head and each device keeps its own rows and
heads of it, so one block's bias is computed for all of them.

Batch stays split over `batch_axes` and heads over `head_axes` inside the shard_map where they
divide (query and key/value heads both, so a query head's key/value head is on its device), as
models/sharding.spec splits them outside; otherwise those dimensions are replicated.

Causal skipping and load imbalance: a key shard wholly after the query shard (j > i) is skipped
by a `lax.cond`, so device i computes i + 1 shard pairs: the last device n, the first one, and a
step waits for the busiest (a zig-zag layout, device i holding chunks i and 2n-1-i, would even
it out; not done). The transfers happen in every step on every device.

Gradients: a custom VJP with a ring of its own. The forward keeps only its shard's output and
row log-sum-exp; the backward recomputes each block's scores from them (no online softmax:
p = exp(s - lse), ds = p (dp - rowsum(dO O))), keeps dq at home, and sends each key/value
shard round the ring again with its dk, dv accumulating on the way, n passes, so they arrive
back at their owner. Memory per device is O(T K D / n), one block of scores and the replicated
features in both passes; the score's own gradient (bias parameters, TAPA's, FoX's gates) comes
from jax.vjp of one block's scores. (Autodiff through the forward ring would keep every visiting shard: O(T)
per device, which is what the gather costs.) The shard_maps run with check_vma=False.
Precision as in positional/softmax.py: with bf16 inputs the shards travel in bf16 and every
matmul of both passes takes bf16 operands, accumulating in fp32 (`matmul`); p, dp, ds, delta
and the dq, dk, dv sums are fp32, a block pair's dq, dk (from the vjp) are rounded to bf16
before they are added.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from positional.softmax import (MASKED, BiasFn, ScoreFn, block_scores, blockwise_attention, blockwise_lse,
                                causal_mask, check_shapes, matmul)

Hooks = Callable[[Any], tuple[BiasFn | None, ScoreFn | None]]


def _dividing(mesh, names, *sizes) -> tuple:
    """The axes of `names` in `mesh` (size > 1) if together they divide every size, else ()."""
    names = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in names)
    return names if all(size % n == 0 for size in sizes) else ()


def _hooks_of(bias_fn, score_fn, qb, kb):
    """(hooks, features) for plain closures: the arrays they hold become explicit features
    (`jax.closure_convert`), so they can enter the shard_maps and get their gradient there.
    The converted functions are traced once, at the shapes of one block on one device: qb
    [B, blk, K, G, D], kb [B, blk, K, D], index vectors of blk."""
    idx = jnp.arange(qb.shape[1], dtype=jnp.int32)
    parts = {}
    if bias_fn is not None:
        parts["bias"] = jax.closure_convert(bias_fn, idx, idx)
    if score_fn is not None:
        parts["score"] = jax.closure_convert(score_fn, qb, kb, idx, idx)

    def hooks(features):
        made = {name: (lambda *a, fn=fn, c=features[name]: fn(*a, *c)) for name, (fn, _) in parts.items()}
        return made.get("bias"), made.get("score")

    return hooks, {name: list(consts) for name, (_, consts) in parts.items()}


def _divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def ring_attention(q, k, v, *, mesh, axis: str = "sequence", bias_fn: BiasFn | None = None,
                   score_fn: ScoreFn | None = None, segment_ids=None, scale: float | None = None,
                   block_size: int = 512, hooks: Hooks | None = None, features=None,
                   batch_axes=("data", "fsdp"), head_axes=("tensor",)) -> jax.Array:
    """Causal attention of q [B, T, H, D] on k, v [B, T, K, D] with T split over mesh axis `axis`
    (T a multiple of its size), keys and values passed round the ring. Returns [B, T, H, D].

    `hooks(features) -> (bias_fn, score_fn)`, if given, replaces bias_fn and score_fn: it runs
    inside the shard_maps on `features` (a pytree of arrays, passed in replicated); plain
    bias_fn / score_fn closures are converted to that form (`jax.closure_convert`).
    """
    check_shapes(q, k, v, segment_ids)
    b, t, h, d = q.shape
    kh = k.shape[2]
    n = mesh.shape[axis]
    if k.shape[1] != t or t % n:
        raise ValueError(f"ring attention needs as many keys as queries and a length that the {n} devices "
                         f"of mesh axis {axis!r} divide; got q{q.shape} k{k.shape}")
    batch, heads = _dividing(mesh, batch_axes, b), _dividing(mesh, head_axes, h, kh)
    spec = P(batch or None, axis, heads or None, None)
    row_spec, lse_spec = P(batch or None, axis), P(batch or None, axis, heads or None)
    shard_len, ring = t // n, [(i, (i + 1) % n) for i in range(n)]
    blk = _divisor(shard_len, block_size)
    if hooks is None:
        b_loc, kh_loc = (size // math.prod(mesh.shape[a] for a in names)
                         for size, names in ((b, batch), (kh, heads)))
        hooks, features = _hooks_of(bias_fn, score_fn, jnp.zeros((b_loc, blk, kh_loc, h // kh, d), q.dtype),
                                    jnp.zeros((b_loc, blk, kh_loc, d), k.dtype))
    features = {} if features is None else features
    scale = d ** -0.5 if scale is None else scale
    if segment_ids is None:
        segment_ids = jnp.zeros((b, t), jnp.int32)

    def own_part(x, dim, names, size):
        """This device's part of dimension `dim` of a bias computed for all `size` of it."""
        if not names or x.shape[dim] != size:
            return x
        part = size // math.prod(mesh.shape[a] for a in names)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(names) * part, part, dim)

    def local_hooks(features):
        bias, score = hooks(features)
        if bias is not None:
            return (lambda qi, kj: own_part(own_part(bias(qi, kj), 0, batch, b), 1, heads, h)), score
        return None, score

    def forward(q, k, v, seg, features):  # one device: (out [B, L, H, D] fp32, lse [B, L, H])
        me = jax.lax.axis_index(axis)
        bias, score = local_hooks(features)

        def visit(acc, kv, src):
            def merge(acc):
                o, lse = acc
                o_s, lse_s = blockwise_lse(q, *kv[:2], bias_fn=bias, segment_ids=seg, key_segment_ids=kv[2],
                                           q_offset=me * shard_len, k_offset=src * shard_len, scale=scale,
                                           score_fn=score, block_size=blk)
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
        return visit(acc, kv, (me - n + 1) % n)  # the last shard needs no passing on

    def backward(q, k, v, seg, features, o, lse, do):
        """One device's gradients: its query shard's dq stays home; each key/value shard collects
        its dk, dv as it goes round the ring and is back with its owner after n passes; the
        features' gradients are summed over the devices. Block pairs are recomputed from the
        saved lse (no online softmax), so memory is a block of scores and O(T K D / n)."""
        me = jax.lax.axis_index(axis)
        f32 = jnp.float32
        nb, kl = shard_len // blk, k.shape[2]  # blocks per shard, this device's kv heads
        g = q.shape[2] // kl

        def blocks(x):  # [B, L, ...] -> [B, nb, blk, ...]
            return x.reshape(x.shape[0], nb, blk, *x.shape[2:])

        qg, dog = (blocks(x.reshape(*x.shape[:2], kl, g, d)) for x in (q, do))  # [B,nb,blk,K,G,D]
        lse_g = blocks(lse.reshape(*lse.shape[:2], kl, g))
        delta = jnp.sum(dog.astype(f32) * blocks(o.reshape(*o.shape[:2], kl, g, d)), -1)  # [B,nb,blk,K,G]
        seg_q = blocks(seg)
        leaves, tree = jax.tree.flatten(features)
        floats = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]
        diff = [x for x, fl in zip(leaves, floats) if fl]  # the features with a gradient
        dfeat0 = [jnp.zeros(x.shape, f32) for x in diff]

        def pair_grads(i, j, kk, vv, sk, src):
            """(dq, dk, dv, dfeatures) of query block i against block j of the visiting shard."""
            qi = me * shard_len + i * blk + jnp.arange(blk)
            kj = src * shard_len + j * blk + jnp.arange(blk)

            def scores(qb, kb, diff):
                it = iter(diff)
                bias, score = local_hooks(jax.tree.unflatten(tree, [next(it) if fl else x
                                                                    for x, fl in zip(leaves, floats)]))
                return block_scores(qb, kb, qi, kj, bias, scale, score)

            s, vjp = jax.vjp(scores, qg[:, i], kk[:, j], diff)
            keep = causal_mask(qi, kj, seg_q[:, i], sk[:, j])[:, :, None]
            lse_b, do_b = jnp.moveaxis(lse_g[:, i], 1, -1)[..., None], dog[:, i]
            p = jnp.where(keep, jnp.exp(s - lse_b), 0.0)  # [B, K, G, tq, tk]
            dp = matmul("btkgd,bskd->bkgts", do_b, vv[:, j], v.dtype)  # fp32, as p and delta
            dq, dk, dfeat = vjp(p * (dp - jnp.moveaxis(delta[:, i], 1, -1)[..., None]))
            return dq, dk, matmul("bkgts,btkgd->bskd", p, do_b, v.dtype), dfeat

        def visit(dq, dfeat, kk, vv, sk, dk, dv, src):
            kk, vv, dk, dv = (blocks(x) for x in (kk, vv, dk, dv))  # dk, dv: fp32
            sk = blocks(sk)

            def all_pairs(state):
                def key_block(state, j):
                    def query_block(state, i):
                        def add(state):
                            dq, dfeat, dk_j, dv_j = state
                            gq, gk, gv, gf = pair_grads(i, j, kk, vv, sk, src)
                            return (dq.at[:, i].add(gq), [a + b for a, b in zip(dfeat, gf)], dk_j + gk,
                                    dv_j + gv)
                        # Key block j wholly after query block i: nothing.
                        visible = src * shard_len + j * blk <= me * shard_len + i * blk + blk - 1
                        return jax.lax.cond(visible, add, lambda s: s, state), None

                    dq, dfeat, dk, dv = state
                    dq, dfeat, dk_j, dv_j = jax.lax.scan(query_block, (dq, dfeat, dk[:, j], dv[:, j]),
                                                         jnp.arange(nb))[0]
                    return (dq, dfeat, dk.at[:, j].set(dk_j), dv.at[:, j].set(dv_j)), None

                return jax.lax.scan(key_block, state, jnp.arange(nb))[0]

            dq, dfeat, dk, dv = jax.lax.cond(src <= me, all_pairs, lambda s: s, (dq, dfeat, dk, dv))
            return dq, dfeat, dk.reshape(k.shape), dv.reshape(v.shape)

        def step(carry, s):
            dq, dfeat, (kk, vv, sk, dk, dv) = carry
            dq, dfeat, dk, dv = visit(dq, dfeat, kk, vv, sk, dk, dv, (me - s) % n)
            return (dq, dfeat, jax.lax.ppermute((kk, vv, sk, dk, dv), axis, ring)), None

        zero_kv = jnp.zeros(k.shape, f32)
        init = (jnp.zeros(qg.shape, f32), dfeat0, (k, v, seg, zero_kv, zero_kv))
        (dq, dfeat, (kk, vv, sk, dk, dv)), _ = jax.lax.scan(step, init, jnp.arange(n - 1))
        dq, dfeat, dk, dv = visit(dq, dfeat, kk, vv, sk, dk, dv, (me - n + 1) % n)
        dk, dv = jax.lax.ppermute((dk, dv), axis, ring)  # the n-th pass takes dk, dv home, not k, v
        it = iter(jax.lax.psum(dfeat, tuple(mesh.axis_names)))
        dfeat = [next(it) if fl else np.zeros(x.shape, jax.dtypes.float0) for x, fl in zip(leaves, floats)]
        return dq.reshape(q.shape), dk, dv, jax.tree.unflatten(tree, dfeat)

    feat_spec = jax.tree.map(lambda _: P(), features)
    fwd_map = jax.shard_map(forward, mesh=mesh, in_specs=(spec, spec, spec, row_spec, feat_spec),
                            out_specs=(spec, lse_spec), check_vma=False)
    bwd_map = jax.shard_map(backward, mesh=mesh, out_specs=(spec, spec, spec, feat_spec), check_vma=False,
                            in_specs=(spec, spec, spec, row_spec, feat_spec, spec, lse_spec, spec))

    @jax.custom_vjp
    def run(q, k, v, features):
        return fwd_map(q, k, v, segment_ids, features)[0].astype(q.dtype)

    def run_fwd(q, k, v, features):
        o, lse = fwd_map(q, k, v, segment_ids, features)
        return o.astype(q.dtype), (q, k, v, features, o, lse)

    def run_bwd(res, do):
        q, k, v, features, o, lse = res
        dq, dk, dv, dfeat = bwd_map(q, k, v, segment_ids, features, o, lse, do)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dfeat

    run.defvjp(run_fwd, run_bwd)
    return run(q, k, v, features)


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


def ring_active(axis: str = "sequence") -> bool:
    """Whether an enclosing `ring_mesh` splits `axis` over more than one device."""
    return bool(_MESHES) and _MESHES[-1].shape.get(axis, 1) > 1


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
