"""PaTH over a sequence mesh (positional/path/__init__.py): positional/ring.py's ring, each
visiting shard's keys mapped by one D x D product, the own shard by the chunked form or the kernel."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from positional.logits import Bias, at_positions
from positional.path.chunked import (Far, chunk_heads, chunk_operators, chunk_pieces, chunk_rows, chunked_attention,
                                     chunking, far_bwd, far_forward, unchunked)
from positional.path.transport import HIGHEST, check_transport, dense_product, exclusive_products
from positional.ring import float_part, make_ring, ring_call
from positional.softmax import MASKED, check_shapes, merged


def ring_path_attention(q, k, v, w, beta, *, mesh, axis: str = "sequence", bias_fn=None, segment_ids=None,
                        chunk: int = 64, group: int = 8, scale: float | None = None, batch_axes=("data", "fsdp"),
                        head_axes=("tensor",), kernel: dict | None = None, span: int | None = None,
                        outer_group: int = 8, across: str = "scan") -> jax.Array:
    """PaTH attention with the sequence split over mesh axis `axis` (T a multiple of its size n),
    keys and values passed round the ring (positional/ring.py): no device holds more than its
    own shard and one visiting shard of them. Returns [B, T, H, D] in q's dtype.

    Device r holds the L = T / n tokens of shard r. The route from key j of an earlier shard s
    to query i splits at the shards' boundaries,

        q_i^T [H_i ... H_{start of r}] [P_{r-1} ... P_{s+1}] [H_{end of s} ... H_{j+1}] k_j,

    P_x the product of shard x's steps. So each device, from the chunked algorithm's pieces
    (plain JAX, O(L D) memory): carries its queries back to the start of its shard (q0, by the
    chunk operators' prefix products) and its keys to the end (k_end, by their suffix products),
    and forms its shard's product P_r as one D x D matrix per row and kv head. The n products
    are all-gathered (n D^2 numbers per row and kv head, little beside a shard of keys), so
    device r knows A_s = P_{r-1} ... P_{s+1} for every s < r. Keys at their shard's end,
    values and segment ids travel as in `ring_attention`; device r scores a visiting shard s < r
    as ordinary attention of q0 on A_s k_end (the Ring's `key_map`; bias at global indices, so
    FoX's F_i - F_j is the one-device bias), and its own shard by the chunked algorithm's
    forward (`far_forward`, the bias shifted to global indices); the two merge by their
    log-sum-exp. Per step a device applies one D x D matrix to the visiting keys.

    Backward (a custom VJP, recomputing from the saved output and log-sum-exp): the ring's own
    backward for the visiting shards (each shard's d k_end travels with it back home; dq0 and
    dA stay home), `far_bwd` for the own shard, dA back to the products through the
    all-gather's transpose (a reduce-scatter of n D x D matrices), and everything through the
    per-shard pieces by autodiff. Memory per device, forward and backward: O(L D) for the
    shard's pieces, one visiting shard, the n products, a block of scores and `_far`'s
    O(L D group) query chains; plus the bias's per-token features (FoX's log f [B, T, H]), which
    every device holds whole, as in `ring_attention`.

    `kernel` (a dict of `path_attention`'s options, e.g. interpret, platform, block_size): the
    own shard by PaTH's Pallas kernel instead, with `span` in two levels (the kernel inside
    blocks of span tokens, the chunked form across them, `outer_group` blocks a step, or with
    `across` the across-blocks kernel (positional/path/chunked.py ACROSS): `chunked_attention`
    with_lse), the bias a `Bias` read at the tokens' global positions
    (`positional.logits.at_positions`). Its backward is that of `chunked_attention`, given the
    cotangents the merge sends its (out, lse) (d out = dO e^(lse_own - lse), d lse_own =
    e^(lse_own - lse) <dO, out_own - O>); that recomputes the own shard's forward once.

    bias_fn(qi, kj) reads global indices; the arrays it holds (a `Bias`'s values: FoX's F)
    become inputs of the ring (positional/ring.py `make_ring`). The largest divisor of L up to `chunk` is both the own
    shard's chunk and the ring's block of scores (one shape for the bias). fp32 inside (as
    `chunked_attention`); batch and heads split inside as in `ring_attention`.
    """
    check_shapes(q, k, v, segment_ids)
    check_transport(k, w, beta)
    fused = isinstance(bias_fn, Bias) and not bias_fn.tables  # its values are the ring's features; the kernel reads them too
    if kernel is None and span is not None:
        raise ValueError("PaTH's ring takes span only with kernel (the own shard in two levels)")
    if kernel is not None and bias_fn is not None and not fused:
        raise ValueError(f"PaTH's ring with the kernel takes a positional.logits.Bias as bias_fn (fused in the "
                         f"kernel); got {type(bias_fn).__name__}: pass kernel=None for the chunked form")
    ring, features = make_ring(q, k, mesh=mesh, axis=axis, bias_fn=bias_fn, scale=scale, block_size=chunk,
                               batch_axes=batch_axes, head_axes=head_axes,
                               hooks=(lambda values: (Bias(bias_fn.fn, values), None)) if fused else None,
                               features=dict(bias_fn.values) if fused else None)
    bias_hooks = ring.hooks
    # The ring's features: (A [n, B, K, D, D] of this device, the bias's arrays).
    ring = dataclasses.replace(ring, hooks=lambda f: bias_hooks(f[1]), diagonal=False,
                               key_map=lambda f, keys, src: jnp.einsum("bkde,bske->bskd", f[0][src], keys,
                                                                       precision=HIGHEST))
    n, length, d = ring.n, ring.shard_len, q.shape[-1]
    c, gq, nc = chunking(length, ring.block, group)

    def pieces(q, k, v, w, beta):
        """One device's shard: (own-shard pieces for `_far`, q0 [B, L, H, D], k_end [B, L, K, D],
        v fp32, P_r [B, K, D, D])."""
        q_start, near, k_end, vc, wc, u = chunk_pieces(q, k, v, w, beta, c, nc)
        ops = dense_product(wc, u)  # [B, K, N, D, D]
        before = exclusive_products(ops, 2)
        q0 = jnp.matmul(q_start, before[:, :, None], precision=HIGHEST)  # q <- (P_{m-1} ... P_0)^T q
        keys = jnp.einsum("bknde,bknce->bkncd", exclusive_products(ops, 2, reverse=True), k_end, precision=HIGHEST)
        keys = jnp.moveaxis(keys, 1, 3).reshape(q.shape[0], -1, k.shape[2], d)[:, :length]
        whole = jnp.matmul(ops[:, :, -1], before[:, :, -1], precision=HIGHEST)
        return ((q_start, near, k_end, vc, chunk_operators(wc, u)), unchunked(q0, length), keys,
                v.astype(jnp.float32), whole)

    def spans(whole):
        """P_r [B, K, D, D] of each device -> A [n, B, K, D, D]: A[s] = P_{r-1} ... P_{s+1} (r this one)."""
        before_me = jnp.arange(n)[:, None, None, None, None] < jax.lax.axis_index(axis)
        return exclusive_products(jnp.where(before_me, jax.lax.all_gather(whole, axis), jnp.eye(d)), 0, reverse=True)

    def own_shard(seg, features, heads):
        """(`Far` of this device's shard, with the bias at global indices; its arrays; its rows)."""
        diff, rebuild, _ = float_part(features)
        bias = None
        if ring.local_hooks((None, features))[0] is not None:
            def bias(qpos, kpos, *diff):
                start = jax.lax.axis_index(axis) * length
                return ring.local_hooks((None, rebuild(diff)))[0](start + qpos, start + kpos)
        st = Far(length=length, chunk=c, group=gq, heads=heads, scale=ring.scale, bias=bias)
        return st, tuple(diff), chunk_rows(seg, seg.shape[0], length, c, nc)

    def own_kernel(q, k, v, w, beta, seg, values):
        """(out, lse) of this device's shard on itself by the kernel, the bias at global positions."""
        start = jax.lax.axis_index(axis) * length
        bias = None
        if fused:  # this device's tokens, batch rows and heads of each [B|1, T|1, H|1] value
            def local(x):
                x = x if x.shape[1] == 1 else jax.lax.dynamic_slice_in_dim(x, start, length, 1)
                return ring.own_part(ring.own_part(x, 0, ring.batch, ring.b), 2, ring.heads, ring.h)
            bias = at_positions(Bias(bias_fn.fn, {name: local(x) for name, x in values.items()}),
                                (start + jnp.arange(length))[None, :, None])
        o, lse = chunked_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, scale=ring.scale, chunk=c,
                                   span=span, outer_group=outer_group, kernel=kernel, across=across, with_lse=True)
        return o.astype(jnp.float32), lse

    def forward(q, k, v, w, beta, seg, features):
        own, q0, keys, vf, whole = pieces(q, k, v, w, beta)
        if kernel is not None:
            o_own, lse_own = own_kernel(q, k, v, w, beta, seg, features)
        else:
            st, consts, rows = own_shard(seg, features, q.shape[2])
            o_own, lse_own = (unchunked(x, length) for x in far_forward(st, *own, rows, consts))
        o_far, lse_far = ring.forward(q0, keys, vf, seg, (spans(whole), features))
        return merged(o_own, lse_own, o_far, lse_far)

    def backward(q, k, v, w, beta, seg, features, o, lse, do):
        # With the kernel the own shard's chunked pieces are not used: left out of the vjp.
        used = (lambda *x: (None, *pieces(*x)[1:])) if kernel is not None else pieces
        (own, q0, keys, vf, whole), pieces_vjp = jax.vjp(used, q, k, v, w, beta)
        a, spans_vjp = jax.vjp(spans, whole)
        dq0, d_keys, dv, (da, *d_bias) = ring.backward(q0, keys, vf, seg, (a, features), o, lse, do)
        if kernel is not None:
            diff, rebuild, _ = float_part(features)
            (o_own, lse_own), own_vjp = jax.vjp(lambda *x: own_kernel(*x[:5], seg, rebuild(x[5])), q, k, v, w,
                                                beta, diff)
            p = jnp.exp(lse_own - lse)  # the own shard's weight in each row
            *d_kernel, d_consts = own_vjp((do * p[..., None], p * jnp.sum(do * (o_own - o), -1)))
            grads = pieces_vjp((None, dq0, d_keys, dv, spans_vjp(da)[0]))
            grads = [x + y for x, y in zip(grads, d_kernel)]
        else:
            st, consts, rows = own_shard(seg, features, q.shape[2])
            kh = k.shape[2]
            # Padding rows get lse +1e30: weights exp(s - lse) = 0, as their dO is.
            saved = (chunk_heads(o, kh, c, nc), chunk_heads(lse, kh, c, nc, -MASKED))
            *d_own, _, d_consts = far_bwd(st, ((*own, rows, consts), *saved), (chunk_heads(do, kh, c, nc), 0.0))
            grads = pieces_vjp((tuple(d_own), dq0, d_keys, dv, spans_vjp(da)[0]))
        return (*grads, [x + y for x, y in zip(d_consts, d_bias)])

    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    spec, _, row_spec = ring.specs
    return ring_call(ring, forward, backward, (q, k, v, w, beta), (spec,) * 4 + (row_spec,), segment_ids, features)

