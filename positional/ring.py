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
it out; not done). With a sliding window a key shard wholly before a query shard's window is
skipped the same way (and inside a visited pair, blockwise_lse skips the blocks outside it), so
a device computes at most 1 + ceil((W - 1) / (T/n)) shard pairs. The transfers happen in every
step on every device.

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

A device's part of both passes is `Ring.forward` / `Ring.backward`, wrapped by `ring_call` in
the shard_maps and the custom VJP. PaTH's ring (positional/path/ring.py `ring_path_attention`)
reuses them with two options: its own shard is scored by its own algorithm (`diagonal=False`),
and a visiting shard's keys are mapped before they are scored (`key_map`: carried through the
Householder products of the shards in between).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from positional.logits import Bias
from positional.softmax import (MASKED, BiasFn, ScoreFn, block_scores, blockwise_attention, blockwise_lse,
                                causal_mask, check_shapes, check_window, matmul, merged)

Hooks = Callable[[Any], tuple[BiasFn | None, ScoreFn | None]]


def dividing(mesh, names, *sizes) -> tuple:
    """The axes of `names` in `mesh` (size > 1) if together they divide every size, else ()."""
    names = tuple(a for a in names if mesh.shape.get(a, 1) > 1)
    n = math.prod(mesh.shape[a] for a in names)
    return names if all(size % n == 0 for size in sizes) else ()


def _hooks_of(bias_fn, score_fn, qb, kb):
    """(hooks, features) for plain closures: the arrays they hold become explicit features, so
    they can enter the shard_maps and get their gradient there. A `Bias`'s are its values, the
    Bias rebuilt on each device from them; other closures are converted (`jax.closure_convert`),
    traced once at the shapes of one block on one device: qb [B, blk, K, G, D], kb [B, blk, K,
    D], index vectors of blk. (A converted closure keeps the types of the arrays it was traced
    with: where they carry a mesh, as in a sharded train step, its backward inside the
    shard_map mixes that mesh with the shard_map's; a rebuilt Bias does not.)"""
    idx = jnp.arange(qb.shape[1], dtype=jnp.int32)
    parts = {}
    if isinstance(bias_fn, Bias):
        parts["bias"] = ((lambda qi, kj, values, tables: Bias(bias_fn.fn, values, tables=tables)(qi, kj)),
                         [bias_fn.values, bias_fn.tables])
    elif bias_fn is not None:
        parts["bias"] = jax.closure_convert(bias_fn, idx, idx)
    if score_fn is not None:
        parts["score"] = jax.closure_convert(score_fn, qb, kb, idx, idx)

    def hooks(features):
        made = {name: (lambda *a, fn=fn, c=features[name]: fn(*a, *c)) for name, (fn, _) in parts.items()}
        return made.get("bias"), made.get("score")

    return hooks, {name: list(consts) for name, (_, consts) in parts.items()}


def _divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def float_part(tree):
    """(the floating-point leaves of a pytree, rebuild, cotangent): rebuild(leaves) is the tree
    with those leaves in place of its own, cotangent(grads) the tree's cotangent given theirs
    (float0 zeros for the other leaves, which have none)."""
    leaves, treedef = jax.tree.flatten(tree)
    floats = [jnp.issubdtype(x.dtype, jnp.floating) for x in leaves]

    def fill(values, other):
        it = iter(values)
        return jax.tree.unflatten(treedef, [next(it) if f else other(x) for x, f in zip(leaves, floats)])

    return ([x for x, f in zip(leaves, floats) if f], lambda diff: fill(diff, lambda x: x),
            lambda grads: fill(grads, lambda x: np.zeros(x.shape, jax.dtypes.float0)))


@dataclasses.dataclass(frozen=True)
class Ring:
    """One ring over mesh axis `axis`: what a device's `forward` and `backward` (run inside a
    shard_map, see `ring_call`) need besides the arrays. `batch` and `heads` are the mesh axes
    that split the batch and the heads inside it (`_dividing`), b and h the whole batch and
    query heads (a bias comes back for all of them), `block` the tokens of one block of scores.

    Two options serve a scheme whose own shard needs an algorithm of its own (PaTH,
    positional/path/ring.py `ring_path_attention`): `diagonal=False` skips a device's own key
    shard (every key it then scores lies in an earlier shard), and `key_map(features, k, src)`
    maps the visiting keys of shard src before they are scored (once per visit; the backward
    takes its vjp once per visit too, so the map's features get their gradient).
    """
    mesh: Any
    axis: str
    batch: tuple
    heads: tuple
    b: int
    h: int
    shard_len: int
    block: int
    scale: float
    hooks: Hooks
    diagonal: bool = True
    key_map: Callable | None = None
    window: int | None = None  # a sliding window (positional/softmax.py)

    @property
    def n(self) -> int:
        return self.mesh.shape[self.axis]

    @property
    def specs(self) -> tuple:
        """PartitionSpecs of [B, T, heads, D] arrays, [B, T] rows and [B, T, heads] per-head rows."""
        b, h = self.batch or None, self.heads or None
        return P(b, self.axis, h, None), P(b, self.axis), P(b, self.axis, h)

    def visible(self, src, me):
        """Whether device me scores key shard src: an earlier one (or its own, with `diagonal`),
        and with a window one whose last key lies within its first query's window."""
        seen = src <= me if self.diagonal else src < me
        if self.window is None:
            return seen
        return seen & ((me - src) * self.shard_len - self.shard_len + 1 < self.window)

    def own_part(self, x, dim, names, size):
        """This device's part of dimension `dim` of a bias computed for all `size` of it."""
        if not names or x.shape[dim] != size:
            return x
        part = size // math.prod(self.mesh.shape[a] for a in names)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(names) * part, part, dim)

    def local_hooks(self, features):
        """(bias, score) of this device's batch rows and heads."""
        bias, score = self.hooks(features)
        if bias is not None:
            return (lambda qi, kj: self.own_part(self.own_part(bias(qi, kj), 0, self.batch, self.b), 1, self.heads,
                                                 self.h)), score
        return None, score

    def forward(self, q, k, v, seg, features):
        """One device: (out [B, L, H, D] fp32, lse [B, L, H]) of its queries on every key shard it sees."""
        me = jax.lax.axis_index(self.axis)
        bias, score = self.local_hooks(features)
        n, shard_len = self.n, self.shard_len

        def visit(acc, kv, src):
            def merge(acc):
                o, lse = acc
                keys = kv[0] if self.key_map is None else self.key_map(features, kv[0], src)
                o_s, lse_s = blockwise_lse(q, keys, kv[1], bias_fn=bias, segment_ids=seg, key_segment_ids=kv[2],
                                           q_offset=me * shard_len, k_offset=src * shard_len, scale=self.scale,
                                           score_fn=score, block_size=self.block, window=self.window)
                return merged(o, lse, o_s, lse_s)

            return jax.lax.cond(self.visible(src, me), merge, lambda acc: acc, acc)  # else all in the future

        def step(carry, s):
            acc, kv = carry
            acc = visit(acc, kv, (me - s) % n)
            return (acc, jax.lax.ppermute(kv, self.axis, [(i, (i + 1) % n) for i in range(n)])), None

        acc = (jnp.zeros(q.shape, jnp.float32), jnp.full(q.shape[:3], MASKED, jnp.float32))
        (acc, kv), _ = jax.lax.scan(step, (acc, (k, v, seg)), jnp.arange(n - 1))
        return visit(acc, kv, (me - n + 1) % n)  # the last shard needs no passing on

    def backward(self, q, k, v, seg, features, o, lse, do):
        """One device's gradients: its query shard's dq stays home; each key/value shard collects
        its dk, dv as it goes round the ring and is back with its owner after n passes. Block
        pairs are recomputed from the saved lse (no online softmax), so memory is a block of
        scores and O(T K D / n). Returns (dq, dk, dv, the gradients of the features' float
        leaves from this device's pairs: the caller sums them over the devices)."""
        me = jax.lax.axis_index(self.axis)
        f32, d, n, shard_len, blk = jnp.float32, q.shape[-1], self.n, self.shard_len, self.block
        nb, kl = shard_len // blk, k.shape[2]  # blocks per shard, this device's kv heads
        g = q.shape[2] // kl
        ring = [(i, (i + 1) % n) for i in range(n)]

        def blocks(x):  # [B, L, ...] -> [B, nb, blk, ...]
            return x.reshape(x.shape[0], nb, blk, *x.shape[2:])

        qg, dog = (blocks(x.reshape(*x.shape[:2], kl, g, d)) for x in (q, do))  # [B,nb,blk,K,G,D]
        lse_g = blocks(lse.reshape(*lse.shape[:2], kl, g))
        delta = jnp.sum(dog.astype(f32) * blocks(o.reshape(*o.shape[:2], kl, g, d)), -1)  # [B,nb,blk,K,G]
        seg_q = blocks(seg)
        diff, rebuild, _ = float_part(features)  # the features with a gradient

        def pair_grads(i, j, kk, vv, sk, src):
            """(dq, dk, dv, dfeatures) of query block i against block j of the visiting shard."""
            qi = me * shard_len + i * blk + jnp.arange(blk)
            kj = src * shard_len + j * blk + jnp.arange(blk)

            def scores(qb, kb, diff):
                bias, score = self.local_hooks(rebuild(diff))
                return block_scores(qb, kb, qi, kj, bias, self.scale, score)

            s, vjp = jax.vjp(scores, qg[:, i], kk[:, j], diff)
            keep = causal_mask(qi, kj, seg_q[:, i], sk[:, j], self.window)[:, :, None]
            lse_b, do_b = jnp.moveaxis(lse_g[:, i], 1, -1)[..., None], dog[:, i]
            p = jnp.where(keep, jnp.exp(s - lse_b), 0.0)  # [B, K, G, tq, tk]
            dp = matmul("btkgd,bskd->bkgts", do_b, vv[:, j], v.dtype)  # fp32, as p and delta
            dq, dk, dfeat = vjp(p * (dp - jnp.moveaxis(delta[:, i], 1, -1)[..., None]))
            return dq, dk, matmul("bkgts,btkgd->bskd", p, do_b, v.dtype), dfeat

        def visit(dq, dfeat, kk, vv, sk, dk, dv, src):
            def all_pairs(state):
                dq, dfeat, dk, dv = state
                keys, dk_home = kk, dk
                if self.key_map is not None:  # the pairs' dk is the mapped keys'; mapped back below
                    keys, key_vjp = jax.vjp(lambda kk, diff: self.key_map(rebuild(diff), kk, src), kk, diff)
                    dk = jnp.zeros(k.shape, f32)
                keys, vb, sb, dk, dv = (blocks(x) for x in (keys, vv, sk, dk, dv))

                def key_block(state, j):
                    def query_block(state, i):
                        def add(state):
                            dq, dfeat, dk_j, dv_j = state
                            gq, gk, gv, gf = pair_grads(i, j, keys, vb, sb, src)
                            return (dq.at[:, i].add(gq), [a + b for a, b in zip(dfeat, gf)], dk_j + gk,
                                    dv_j + gv)
                        # Key block j wholly after query block i (or before its window): nothing.
                        first_key, first_query = src * shard_len + j * blk, me * shard_len + i * blk
                        visible = first_key <= first_query + blk - 1
                        if self.window is not None:
                            visible = visible & (first_query - (first_key + blk - 1) < self.window)
                        return jax.lax.cond(visible, add, lambda s: s, state), None

                    dq, dfeat, dk, dv = state
                    dq, dfeat, dk_j, dv_j = jax.lax.scan(query_block, (dq, dfeat, dk[:, j], dv[:, j]),
                                                         jnp.arange(nb))[0]
                    return (dq, dfeat, dk.at[:, j].set(dk_j), dv.at[:, j].set(dv_j)), None

                dq, dfeat, dk, dv = jax.lax.scan(key_block, (dq, dfeat, dk, dv), jnp.arange(nb))[0]
                dk, dv = dk.reshape(k.shape), dv.reshape(v.shape)
                if self.key_map is not None:
                    dk_map, dfeat_map = key_vjp(dk)
                    dk, dfeat = dk_home + dk_map, [a + b for a, b in zip(dfeat, dfeat_map)]
                return dq, dfeat, dk, dv

            return jax.lax.cond(self.visible(src, me), all_pairs, lambda s: s, (dq, dfeat, dk, dv))

        def step(carry, s):
            dq, dfeat, (kk, vv, sk, dk, dv) = carry
            dq, dfeat, dk, dv = visit(dq, dfeat, kk, vv, sk, dk, dv, (me - s) % n)
            return (dq, dfeat, jax.lax.ppermute((kk, vv, sk, dk, dv), self.axis, ring)), None

        zero_kv = jnp.zeros(k.shape, f32)
        init = (jnp.zeros(qg.shape, f32), [jnp.zeros(x.shape, f32) for x in diff], (k, v, seg, zero_kv, zero_kv))
        (dq, dfeat, (kk, vv, sk, dk, dv)), _ = jax.lax.scan(step, init, jnp.arange(n - 1))
        dq, dfeat, dk, dv = visit(dq, dfeat, kk, vv, sk, dk, dv, (me - n + 1) % n)
        dk, dv = jax.lax.ppermute((dk, dv), self.axis, ring)  # the n-th pass takes dk, dv home, not k, v
        return dq.reshape(q.shape), dk, dv, dfeat


def make_ring(q, k, *, mesh, axis: str = "sequence", bias_fn: BiasFn | None = None, score_fn: ScoreFn | None = None,
              scale: float | None = None, block_size: int = 512, hooks: Hooks | None = None, features=None,
              batch_axes=("data", "fsdp"), head_axes=("tensor",), **options) -> tuple[Ring, Any]:
    """(the Ring of q [B, T, H, D], k [B, T, K, D] on `mesh`, the features its hooks read): plain
    bias_fn / score_fn closures become hooks (`_hooks_of`); options go to `Ring`. One line if
    the length does not split over the ring."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    n = mesh.shape[axis]
    if k.shape[1] != t or t % n:
        raise ValueError(f"ring attention splits the sequence over the {n} devices of mesh axis {axis!r}, so it needs "
                         f"as many keys as queries and a length that {n} divides; got q{q.shape} k{k.shape}: make "
                         f"the sequence length (seq_len) a multiple of {n} or change mesh.{axis}")
    batch, heads = dividing(mesh, batch_axes, b), dividing(mesh, head_axes, h, kh)
    blk = _divisor(t // n, block_size)
    if hooks is None:
        b_loc, kh_loc = (size // math.prod(mesh.shape[a] for a in names)
                         for size, names in ((b, batch), (kh, heads)))
        hooks, features = _hooks_of(bias_fn, score_fn, jnp.zeros((b_loc, blk, kh_loc, h // kh, d), q.dtype),
                                    jnp.zeros((b_loc, blk, kh_loc, d), k.dtype))
    ring = Ring(mesh, axis, batch, heads, b, h, t // n, blk, d ** -0.5 if scale is None else scale, hooks, **options)
    return ring, {} if features is None else features


def ring_call(ring: Ring, forward, backward, arrays, specs, segment_ids, features) -> jax.Array:
    """forward(*arrays, seg, features) -> (o [B, L, H, D] fp32, lse [B, L, H]) and backward(*arrays,
    seg, features, o, lse, do) -> (the arrays' gradients..., this device's gradients of the
    features' float leaves), run on every device of ring.mesh (shard_maps, the arrays split as
    `specs` say, segment ids [B, T] as rows, the features whole on every device), as one
    function with a custom VJP: the forward keeps only o and lse; the backward sums the
    features' gradients over the devices. Returns the output in the first array's dtype."""
    spec, row_spec, lse_spec = ring.specs
    in_specs = (*specs, row_spec, jax.tree.map(lambda _: P(), features))
    fwd_map = jax.shard_map(forward, mesh=ring.mesh, in_specs=in_specs, out_specs=(spec, lse_spec), check_vma=False)

    def summed(*args):
        *grads, dfeat = backward(*args)
        return (*grads, jax.lax.psum(dfeat, tuple(ring.mesh.axis_names)))

    bwd_map = jax.shard_map(summed, mesh=ring.mesh, in_specs=(*in_specs, spec, lse_spec, spec),
                            out_specs=(*specs, [P()] * len(float_part(features)[0])), check_vma=False)

    # Every array an operand (none closed over), so the call can sit in a branch of
    # `jax.lax.platform_dependent` (PaTH's auto on a sequence mesh).
    @jax.custom_vjp
    def run(arrays, segment_ids, features):
        return fwd_map(*arrays, segment_ids, features)[0].astype(arrays[0].dtype)

    def run_fwd(arrays, segment_ids, features):
        o, lse = fwd_map(*arrays, segment_ids, features)
        return o.astype(arrays[0].dtype), (arrays, segment_ids, features, o, lse)

    def run_bwd(res, do):
        arrays, segment_ids, features, o, lse = res
        *grads, dfeat = bwd_map(*arrays, segment_ids, features, o, lse, do)
        return (tuple(g.astype(x.dtype) for g, x in zip(grads, arrays)), None,
                float_part(features)[2](dfeat))

    run.defvjp(run_fwd, run_bwd)
    return run(tuple(arrays), segment_ids, features)


def ring_attention(q, k, v, *, mesh, axis: str = "sequence", bias_fn: BiasFn | None = None,
                   score_fn: ScoreFn | None = None, segment_ids=None, scale: float | None = None,
                   block_size: int = 512, hooks: Hooks | None = None, features=None,
                   batch_axes=("data", "fsdp"), head_axes=("tensor",), window: int | None = None) -> jax.Array:
    """Causal attention of q [B, T, H, D] on k, v [B, T, K, D] with T split over mesh axis `axis`
    (T a multiple of its size), keys and values passed round the ring. Returns [B, T, H, D].

    `hooks(features) -> (bias_fn, score_fn)`, if given, replaces bias_fn and score_fn: it runs
    inside the shard_maps on `features` (a pytree of arrays, passed in replicated); plain
    bias_fn / score_fn closures are converted to that form (`jax.closure_convert`). `window`: a
    sliding window; shards and blocks wholly outside it are skipped.
    """
    check_shapes(q, k, v, segment_ids)
    ring, features = make_ring(q, k, mesh=mesh, axis=axis, bias_fn=bias_fn, score_fn=score_fn, scale=scale,
                               block_size=block_size, hooks=hooks, features=features, batch_axes=batch_axes,
                               head_axes=head_axes, window=check_window(window))
    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    return ring_call(ring, ring.forward, ring.backward, (q, k, v), (ring.specs[0],) * 3, segment_ids, features)


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


def enclosing_mesh():
    """The mesh of the innermost enclosing `ring_mesh` (whatever it splits), else None."""
    return _MESHES[-1] if _MESHES else None


def active_mesh(axis: str = "sequence"):
    """The mesh of the innermost enclosing `ring_mesh` if it splits `axis` over more than one
    device, else None."""
    return _MESHES[-1] if _MESHES and _MESHES[-1].shape.get(axis, 1) > 1 else None


def ring_active(axis: str = "sequence") -> bool:
    """Whether an enclosing `ring_mesh` splits `axis` over more than one device."""
    return active_mesh(axis) is not None


def mesh_ring_attention(q, k, v, *, q_offset=0, axis: str = "sequence", hooks: Hooks | None = None,
                        features=None, **kwargs) -> jax.Array:
    """Attention impl "ring": `ring_attention` over the mesh of the enclosing `ring_mesh`.
    Outside any, where its `axis` has size 1, and for decoding (q_offset, or fewer queries
    than keys) it is `blockwise_attention`, with the same arguments and result."""
    mesh = active_mesh(axis)
    decoding = not isinstance(q_offset, int) or q_offset != 0 or q.shape[1] != k.shape[1]
    if mesh is None or decoding:
        if hooks:
            kwargs["bias_fn"], kwargs["score_fn"] = hooks(features)
        return blockwise_attention(q, k, v, q_offset=q_offset, **kwargs)
    return ring_attention(q, k, v, mesh=mesh, axis=axis, hooks=hooks, features=features, **kwargs)
