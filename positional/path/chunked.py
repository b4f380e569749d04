"""PaTH in plain JAX, flash-style (positional/path/__init__.py): O(T * D) memory in the forward
and the recomputing backward, in one level or two (`span`)."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from positional.logits import Bias, at_positions
from positional.path.across import ACROSS_OUT, across_blocks, versions
from positional.path.kernel import blocks_as_rows, path_attention
from positional.path.transport import (HIGHEST, apply_product, carry_to_chunk_end, check_transport, dense_product,
                                       exclusive_products, route_terms, to_chunks, ut_matrix)
from positional.softmax import MASKED, check_shapes, matmul, merged, rounded

# The chunked form's tile operands (`tiles`): fp32 at highest precision, or bf16 accumulating in
# fp32 (tensor cores / the MXU, as flash attention and the authors' kernels take q.k and P.V).
TILES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}
# Two levels with kernels: what scores the routes across the blocks ("scan": the chunked form's;
# "blocks": the across-blocks kernel) and across a block's chunks ("chunks": that kernel there too,
# in place of PaTH's kernel inside the blocks).
ACROSS = ("scan", "blocks", "chunks")


def chunked_attention(q, k, v, w, beta, *, bias_fn=None, segment_ids=None, chunk: int = 64,
                      group: int | None = None, scale: float | None = None, autodiff: bool = False,
                      span: int | None = None, outer_group: int = 8, tiles: str = "fp32",
                      kernel: dict | None = None, across: str = "scan", with_lse: bool = False):
    """PaTH attention with O(T * D) memory, forward and backward: returns [B, T, H, D] in q's dtype
    (with `with_lse`, and the rows' log-sum-exp [B, T, H] fp32, both differentiable: a part of a
    longer attention, as a ring's own shard).

    For query chunk n and key chunk m < n the route splits as (prefix of chunk n up to i) x
    P_{n-1} ... P_{m+1} x (suffix of chunk m after j). Per chunk (plain JAX, differentiated by
    autodiff, O(T * chunk) memory): the UT solve, keys carried to the end of their chunk,
    queries to the start of theirs, the in-chunk logits. Across chunks, `_far`: queries carried
    back one whole chunk per step of a scan over the chunk distance, with an online softmax,
    and its own recomputing backward (see `far_bwd`). Query chunks go `group` at a time (so
    one step's tiles stay in cache; default 8), and a group skips the distances that would take
    all its chunks before the start. `autodiff`: differentiate `_far` through its scans instead, which
    keeps every step's carry (about T^2 / chunk * D floats per head: for comparison only).

    `span` (a multiple of the chunk, shorter than T): two levels, the same split one level up.
    The inner level is the above restricted to blocks of `span` tokens (the scan reaches back at
    most span / chunk - 1 chunks); the outer level treats each block as one chunk: its queries
    carried back to the block's start and its keys to the block's end (the chunks' D x D
    products, prefix and suffix), one D x D product per block, no in-block logits, `outer_group`
    blocks at a time. The two merge by their log-sum-exp, and the backward runs `far_bwd` on
    each level with the merged output and log-sum-exp. The same logits and result; the inner
    level takes every chunk in one group by default (its scans are span / chunk - 1 steps long),
    so the scans take about span / chunk + (T / span)^2 / outer_group steps where one level
    takes (T / chunk)^2 / group, for O(T * D * (span / chunk + outer_group)) memory per head.

    `tiles`: the operands of the q.k and P.V tiles, both passes (TILES): "fp32" (highest
    precision) or "bf16" (accumulated in fp32, as flash attention's). The transport, the
    in-chunk pieces and the softmax statistics stay fp32.

    `kernel`: the inner level by PaTH's Pallas kernel, each block a sequence of its own
    (positional/path/kernel.py `path_attention` with `span`; the dict: its options, e.g.
    block_size, platform); without span (or span >= T) the kernel does it all. `across` (ACROSS),
    with `kernel` and span: the outer level by the chunked form ("scan") or by the across-blocks
    kernel ("blocks", positional/path/across.py: each query carried back to the end of every
    earlier block, then flash attention over those versions, the queries `outer_group` blocks a
    call, so T / span versions of outer_group x span queries live at once: linear in T);
    "chunks": that kernel across the chunks inside each block too (span / chunk versions of
    every query, linear in T too), so no PaTH kernel runs, only the in-chunk tiles in plain JAX.
    """
    check_shapes(q, k, v, segment_ids)
    check_transport(k, w, beta)
    if tiles not in TILES:
        raise ValueError(f"PaTH chunked_attention tiles={tiles!r} must be one of {sorted(TILES)}")
    if across not in ACROSS or (across != "scan" and kernel is None):
        raise ValueError(f"PaTH chunked_attention across={across!r} must be one of {ACROSS}, other than 'scan' only "
                         f"with kernel (its options: the levels' Pallas kernels)")
    b, t, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    c = min(chunk, t)
    if span is not None and span < t:
        if span % c:
            raise ValueError(f"PaTH chunked_attention span={span} must be a multiple of chunk={c}")
        o, lse = _two_levels(q, k, v, w, beta, bias_fn, segment_ids, c, span, group, outer_group, scale, autodiff,
                             tiles, kernel, across)
        return (o, lse) if with_lse else o
    if kernel is not None:  # with_lse: one block of T tokens, which returns the log-sum-exp too
        return path_attention(q, k, v, w, beta, bias_fn=bias_fn, segment_ids=segment_ids, scale=scale,
                              span=t if with_lse else None, **kernel)
    c, gq, n = chunking(t, chunk, group or 8)
    (q_start, near, k_end, vc, wc, u), seg = chunk_pieces(q, k, v, w, beta, c, n), chunk_rows(segment_ids, b, t, c, n)
    bias, consts = _bias_hook(bias_fn, c)
    st = Far(length=t, chunk=c, group=gq, heads=h, scale=scale, bias=bias, autodiff=autodiff, tiles=tiles)
    args = (q_start, near, k_end, vc, chunk_operators(wc, u), seg, consts)
    o, lse = (unchunked(x, t) for x in (far_forward if autodiff else _far)(st, *args))  # from [B,K,G,N,c,...]
    return (o.astype(q.dtype), lse) if with_lse else o.astype(q.dtype)


def _bias_hook(bias_fn, c: int):
    """(bias(qpos, kpos, *consts) for tiles of c x c, consts): the arrays bias_fn reads become
    inputs of `_far`, which returns their gradients. (None, ()) without a bias."""
    if bias_fn is None:
        return None, ()
    bias, consts = jax.closure_convert(bias_fn, jnp.arange(c), jnp.arange(c))
    return bias, tuple(consts)


def _two_levels(q, k, v, w, beta, bias_fn, segment_ids, c: int, span: int, group: int | None, outer_group: int,
                scale: float, autodiff: bool, tiles: str, kernel: dict | None, across: str):
    """`chunked_attention` with `span`: the per-chunk pieces, the outer blocks' pieces made from
    them, each level's (o, lse), merged by their log-sum-exp (autodiff outside `_far` and the
    kernels). The inner level by `_far`, or with `kernel` by PaTH's Pallas kernel (its options),
    or with across="chunks" by the in-chunk tiles (`_far` reaching back no chunk) and the
    across-blocks kernel over each block's chunks; the outer by `_far`, or with across "blocks"
    or "chunks" by the across-blocks kernel."""
    b, t, h, d = q.shape
    kh, per = k.shape[2], span // c
    blocks = -(-t // span)
    g2 = -(-blocks // -(-blocks // min(outer_group, blocks)))  # at most outer_group, the runs as even as can be
    blocks = -(-blocks // g2) * g2
    n = blocks * per
    (q_start, near, k_end, vc, wc, u), seg = chunk_pieces(q, k, v, w, beta, c, n), chunk_rows(segment_ids, b, t, c, n)

    @jax.checkpoint  # the chunks' products are recomputed in the backward, not kept
    def outer_pieces(q_start, k_end, wc, u):
        ops = dense_product(wc, u).reshape(b, kh, blocks, per, d, d)  # chunk products by block
        before = exclusive_products(ops, 3)  # the block's chunks before chunk m, [B, K, blocks, per, D, D]
        q_outer = jnp.matmul(q_start.reshape(*q_start.shape[:3], blocks, per, c, d), before[:, :, None],
                             precision=HIGHEST)
        k_outer = jnp.einsum("bknmde,bknmce->bknmcd", exclusive_products(ops, 3, reverse=True),
                             k_end.reshape(b, kh, blocks, per, c, d), precision=HIGHEST)
        return q_outer, k_outer, jnp.matmul(ops[:, :, :, -1], before[:, :, :, -1], precision=HIGHEST)

    q_outer, k_outer, whole = outer_pieces(q_start, k_end, wc, u)  # whole: [B, K, blocks, D, D]
    far = far_forward if autodiff else _far
    if across == "chunks":
        o1, lse1 = _inside_by_across(q_start, near, k_end, vc, wc, u, seg, bias_fn, t, span, scale, tiles, kernel)
    elif kernel is None:
        bias, consts = _bias_hook(bias_fn, c)
        inner = Far(length=t, chunk=c, group=math.gcd(n, group or n), heads=h, scale=scale, bias=bias,
                     autodiff=autodiff, span=per, tiles=tiles)
        o1, lse1 = far(inner, q_start, near, k_end, vc, chunk_operators(wc, u), seg, consts)
        o1, lse1 = (x.reshape(*x.shape[:3], blocks, span, *x.shape[5:]) for x in (o1, lse1))  # [.., n, c, ..] -> blocks
    else:
        o1, lse1 = path_attention(q, k, v, w, beta, bias_fn=bias_fn, segment_ids=segment_ids, scale=scale, span=span,
                                  **kernel)
        o1, lse1 = chunk_heads(o1.astype(jnp.float32), kh, span, blocks), chunk_heads(lse1, kh, span, blocks)
    if across != "scan":
        o2, lse2 = _across_kernel(q_outer, k_outer, vc, whole, bias_fn, seg, t, g2, span, scale, tiles, kernel)
        o, lse = (unchunked(x, t) for x in merged(o1, lse1, o2, lse2))
        return o.astype(q.dtype), lse
    bias, consts = _bias_hook(bias_fn, span)
    outer = Far(length=t, chunk=span, group=g2, heads=h, scale=scale, bias=bias, autodiff=autodiff, near=False,
                 tiles=tiles)
    o2, lse2 = far(outer, q_outer.reshape(*q_outer.shape[:3], blocks, span, d), None,
                   k_outer.reshape(b, kh, blocks, span, d), vc.reshape(b, kh, blocks, span, d), (whole,),
                   seg.reshape(b, blocks, span), consts)
    o, lse = (unchunked(x, t) for x in merged(o1, lse1, o2, lse2))
    return o.astype(q.dtype), lse


def _across_kernel(q_outer, k_outer, vc, whole, bias_fn, seg, t: int, g2: int, span: int, scale: float,
                   tiles: str, kernel: dict):
    """The outer level by the across-blocks kernel: (o, lse) as [B, K, G, blocks, span, ...].
    The queries go g2 blocks at a time (a lax.map over the runs, each run's versions made,
    used and, in the backward, made again: T / span versions of g2 * span queries live at
    once, not of all T; the kernel's outputs are kept)."""
    b, kh, g, blocks = q_outer.shape[:4]
    d, tp = q_outer.shape[-1], blocks * span
    runs = q_outer.reshape(b, kh, g, blocks // g2, g2, span, d)
    k_outer, vc = (jnp.swapaxes(x.reshape(b, kh, -1, x.shape[-1]), 1, 2) for x in (k_outer, vc))  # [B, T_p, K, .]
    if bias_fn is not None:  # its values over the padded blocks (the padding is a segment of its own)
        bias_fn = Bias(bias_fn.fn, {name: jnp.pad(x, [(0, 0), (0, tp - x.shape[1]), (0, 0)])
                                    for name, x in bias_fn.per_slot(b, t, kh * g).items()})

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.save_only_these_names(*ACROSS_OUT))
    def run(r):
        qv = versions(lax.dynamic_index_in_dim(runs, r, 3, keepdims=False), whole[:, :, None], TILES[tiles],
                      first=r * g2)  # [B, K, G, blocks (J), g2 (I), span, D]
        return _across_call(qv.reshape(b, kh * g, blocks, g2 * span, d), k_outer, vc, span, bias_fn,
                            seg.reshape(b, tp), scale, tiles, kernel, q_offset=r * g2 * span)

    o, lse = lax.map(run, jnp.arange(blocks // g2))  # [runs, B, g2 * span, H, ...]
    o, lse = (jnp.moveaxis(x, 0, 1).reshape(b, tp, *x.shape[3:]) for x in (o, lse))
    return chunk_heads(o, kh, span, blocks), chunk_heads(lse, kh, span, blocks)


def _across_call(qv, k, v, span, bias_fn, seg, scale, tiles, kernel, q_offset=0):
    """across_blocks on the `tiles` dtype with the kernels' options (interpret, stream, platform, block_size)."""
    low = TILES[tiles]
    options = {name: kernel[name] for name in ("interpret", "stream", "platform", "block_size") if name in kernel}
    return across_blocks(qv.astype(low), k.astype(low), v.astype(low), span=span, bias_fn=bias_fn, segment_ids=seg,
                         scale=scale, q_offset=q_offset, **options)


def _inside_by_across(q_start, near, k_end, vc, wc, u, seg, bias_fn, t: int, span: int, scale: float, tiles: str,
                      kernel: dict):
    """The inner level with across="chunks", (o, lse) as [B, K, G, blocks, span, ...]: the
    in-chunk tiles by `_far` reaching back no chunk, and each block as a sequence of its own
    (so B x blocks rows) whose chunks the across-blocks kernel scores (a block of `span / c`
    chunks, the queries carried back to the end of each earlier chunk of their block), the bias
    read at the tokens' own positions; merged by log-sum-exp."""
    b, kh, g, n, c, d = q_start.shape
    h, blocks, per = kh * g, n * c // span, span // c
    bias, consts = _bias_hook(bias_fn, c)
    in_chunk = Far(length=t, chunk=c, group=n, heads=h, scale=scale, bias=bias, span=1, tiles=tiles)
    o0, lse0 = (x.reshape(b, kh, g, blocks, span, *x.shape[5:])
                for x in _far(in_chunk, q_start, near, k_end, vc, chunk_operators(wc, u), seg, consts))
    ops = dense_product(wc, u).reshape(b, kh, 1, blocks, per, d, d)
    qv = versions(q_start.reshape(b, kh, g, blocks, per, c, d), ops, TILES[tiles])  # [B, K, G, blocks, J, I, c, D]
    qv = jnp.moveaxis(qv, 3, 1).reshape(b * blocks, h, per, span, d)
    rows = lambda x: jnp.moveaxis(x.reshape(b, kh, blocks, span, x.shape[-1]), 1, 3).reshape(  # noqa: E731
        b * blocks, span, kh, x.shape[-1])
    blocked = None
    if bias_fn is not None:
        placed = at_positions(bias_fn, jnp.arange(t)[None, :, None])
        blocked = Bias(placed.fn, {name: blocks_as_rows(x, span, blocks)
                                   for name, x in placed.per_slot(b, t, h).items()})
    o, lse = _across_call(qv, rows(k_end), rows(vc), c, blocked, seg.reshape(b * blocks, span), scale, tiles, kernel)
    o2, lse2 = chunk_heads(o.reshape(b, blocks * span, h, -1), kh, span, blocks), chunk_heads(
        lse.reshape(b, blocks * span, h), kh, span, blocks)
    return merged(o0, lse0, o2, lse2)


def chunking(t: int, chunk: int, group: int) -> tuple[int, int, int]:
    """(tokens per chunk, query chunks per group, chunks: a whole number of groups) for length t."""
    c = min(chunk, t)
    gq = min(group, -(-t // c))
    return c, gq, -(-t // (c * gq)) * gq


def chunk_rows(segment_ids, b, t, c, n):
    """Segment ids [B, T] (None: one segment) in n chunks [B, N, c]; padding gets -1."""
    return to_chunks(jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids, c, -1, n)


def chunk_heads(x, kh, c, n, pad_value=0):
    """[B, T, K * G, ...] -> [B, K, G, N, c, ...] (padding pad_value); `unchunked` inverts it."""
    b, t, h = x.shape[:3]
    return jnp.moveaxis(to_chunks(x.reshape(b, t, kh, h // kh, *x.shape[3:]), c, pad_value, n), (3, 4), (1, 2))


def unchunked(x, t):
    """[B, K, G, N, c, ...] -> [B, T, K * G, ...] (padding dropped)."""
    x = jnp.moveaxis(x, (1, 2), (3, 4))
    return x.reshape(x.shape[0], -1, x.shape[3] * x.shape[4], *x.shape[5:])[:, :t]


def chunk_pieces(q, k, v, w, beta, c: int, n: int):
    """PaTH's per-chunk pieces, fp32, of q [B, T, H, D], k, v, w [B, T, K, D], beta [B, T, K] in n
    chunks of c tokens (padding: steps of beta 0, the identity): q_start [B, K, G, N, c, D] (queries
    carried back to their chunk's start), near [B, K, G, N, c, c] (unscaled in-chunk logits),
    k_end [B, K, N, c, D] (keys carried to their chunk's end), v, w [B, K, N, c, D] and the UT
    matrices u [B, K, N, c, c] (chunk m's product is I - w_m^T u_m w_m)."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    f32 = jnp.float32
    qc = chunk_heads(q.astype(f32), kh, c, n)  # [B,K,G,N,c,D]
    kc, vc, wc = (jnp.moveaxis(to_chunks(x.astype(f32), c, n=n), 3, 1) for x in (k, v, w))  # [B,K,N,c,D]
    u = ut_matrix(wc, jnp.moveaxis(to_chunks(beta, c, n=n), 3, 1))  # [B,K,N,c,c]
    k_end, uk = carry_to_chunk_end(kc, wc, u)  # uk [B,K,N,c,c]
    qw, _ = route_terms(qc, kc[:, :, None], wc[:, :, None], u[:, :, None])
    q_start = qc - jnp.matmul(jnp.matmul(qw, u[:, :, None], precision=HIGHEST), wc[:, :, None], precision=HIGHEST)
    near = jnp.einsum("bkgnid,bknjd->bkgnij", qc, kc, precision=HIGHEST) - jnp.matmul(qw, uk[:, :, None],
                                                                                      precision=HIGHEST)
    return q_start, near, k_end, vc, wc, u


def chunk_operators(wc, u):
    """The whole-chunk operators as `_carry_back` takes them: dense D x D matrices when D <= c
    (carrying a query past a chunk is then one matmul instead of three, as with 64-dim heads),
    else the compact (w, u)."""
    return (dense_product(wc, u),) if wc.shape[-1] <= wc.shape[-2] else (wc, u)


@dataclasses.dataclass(frozen=True)
class Far:
    """The static part of `_far`: the length (positions from it on are padding), chunk size,
    query chunks per group, query heads, logit scale, the closure-converted bias hook
    bias(qpos, kpos, *consts) (None: no bias), and whether autodiff differentiates the forward
    (it then recomputes each group and step in the backward, `jax.checkpoint`). `span`: the
    chunks of an outer block (None: the whole sequence is one); only key chunks in the query's
    own outer block are scored (`chunked_attention`'s inner level). `near`: the in-chunk logits
    are scored (False: only earlier chunks, the outer level, whose first chunk's queries then
    see no key: out 0, log-sum-exp -inf)."""
    length: int
    chunk: int
    group: int
    heads: int
    scale: float
    bias: Callable | None
    autodiff: bool = False
    span: int | None = None
    near: bool = True
    tiles: str = "fp32"  # the q.k and P.V tiles' operands (TILES): fp32 at highest precision, or bf16

    def remat(self, fn):
        return jax.checkpoint(fn) if self.autodiff else fn

    def mm(self, spec, a, b):
        """A tile's einsum (q.k, P.V and theirs in the backward), accumulated in fp32. spec's
        g (a query head of the kv head) is a row axis: with bf16 tiles it is folded into the
        rows (i), so every dot, its transposes included, has the batch axes first (XLA's CPU
        dot takes bf16 operands only so)."""
        if self.tiles == "fp32":
            return jnp.einsum(spec, a, b, precision=HIGHEST)
        ins, out = spec.split("->")
        g = next(x.shape[ax.index("g")] for x, ax in zip((a, b), ins.split(",")) if "g" in ax)

        def fold(x, ax):  # [b, k, g, n, i, ...] -> [b, k, n, g * i, ...]
            return jnp.moveaxis(x, 2, 3).reshape(x.shape[0], x.shape[1], x.shape[3], -1, *x.shape[5:]) if "g" in ax else x

        plain = lambda ax: ax.replace("g", "")  # noqa: E731
        y = matmul(f"{plain(ins.split(',')[0])},{plain(ins.split(',')[1])}->{plain(out)}",
                   *(fold(x, ax) for x, ax in zip((a, b), ins.split(","))), TILES[self.tiles])
        if "g" not in out:
            return y
        return jnp.moveaxis(y.reshape(y.shape[0], y.shape[1], y.shape[2], g, -1, *y.shape[4:]), 3, 2)

    def dots(self, qt, kt):
        """q.k tiles: qt [B, K, G, M, c, D], kt [B, K, M, c, D] -> [B, K, G, M, c, c]."""
        return self.mm("bkgnid,bknjd->bkgnij", qt, kt)

    def distances(self, n: int) -> jax.Array:
        """The chunk distances 1 .. (span or n) - 1 a query chunk may reach back."""
        return jnp.arange(1, min(self.span or n, n))

    def reaches(self, ids, delta, n: int):
        """Whether query chunks ids see key chunks ids - delta: in the same outer block."""
        return ids % min(self.span or n, n) >= delta

    def logits(self, s, ids, delta, seg, consts):
        """Query chunks ids [M] against key chunks ids - delta (all masked before the first):
        s [B, K, G, M, c, c] unscaled dots -> scaled, biased, masked logits."""
        c = self.chunk
        src = _sources(ids, delta)
        qpos, kpos = (x[:, None] * c + jnp.arange(c) for x in (ids, src))  # [M, c]
        s = s * self.scale
        if self.bias is not None:
            kh, g, m = s.shape[1:4]
            bias = jax.vmap(lambda qp, kp: self.bias(qp, kp, *consts), out_axes=2)(qpos, kpos)  # [B|1,H|1,M,c,c]
            bias = jnp.broadcast_to(bias, (bias.shape[0], self.heads, m, c, c)).reshape(bias.shape[0], kh, g, m, c, c)
            s = s + bias.astype(jnp.float32)
        qseg, kseg = (jnp.take(seg, x, axis=1) for x in (ids, src))  # [B, M, c]
        ok = ((kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < self.length)
              & self.reaches(ids, delta, seg.shape[1])[:, None, None])
        ok = ok[None] & (qseg[..., :, None] == kseg[..., None, :])  # [B, M, c, c]
        return jnp.where(ok[:, None, None], s, MASKED)


def _sources(ids, delta):
    """The key chunks at distance delta from query chunks ids (clipped at 0: masked there)."""
    return jnp.clip(ids - delta, 0)


def _take(x, idx):
    """Chunks idx of every array in x (chunk axis 2: [B, K, N, ...])."""
    return jax.tree.map(lambda a: jnp.take(a, idx, axis=2), x)


def _carry_back(qt, op):
    """Queries qt [B, K, G, M, c, D] carried back past whole chunks, q <- P^T q; op the dense
    (P,) [B, K, M, D, D] or the compact (w [B, K, M, c, D], u [B, K, M, c, c])."""
    if len(op) == 1:
        return jnp.matmul(qt, op[0][:, :, None], precision=HIGHEST)
    return apply_product(qt, op[0][:, :, None], op[1][:, :, None], transpose=True)


def _regroup(x):
    """[N / gq, B, K, G, gq, ...] (one entry per query group) -> [B, K, G, N, ...]."""
    return jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], -1, *x.shape[5:])


def far_forward(st: Far, q_start, near, k, v, op, seg, consts):
    """(o [B, K, G, N, c, D], log-sum-exp [B, K, G, N, c]) of PaTH attention from the per-chunk
    pieces: q_start [B, K, G, N, c, D] (queries at their chunk's start), near [B, K, G, N, c, c]
    (unscaled in-chunk logits), k [B, K, N, c, D] (keys at their chunk's end), v, op (the
    whole-chunk operators, see `_carry_back`), seg [B, N, c], consts (the bias hook's arrays)."""
    n, gq = seg.shape[1], st.group

    def query_group(first):  # query chunks first .. first + gq - 1
        ids = first + jnp.arange(gq)

        def tile(state, s, delta):  # one step of the online softmax
            m, row_sum, acc = state
            s = st.logits(s, ids, delta, seg, consts)
            m_new = jnp.maximum(m, s.max(-1))
            p = rounded(jnp.exp(s - m_new[..., None]), TILES[st.tiles])  # as P.V takes it
            corr = jnp.exp(m - m_new)
            pv = st.mm("bkgnij,bknjd->bkgnid", p, _take(v, _sources(ids, delta)))
            return m_new, row_sum * corr + p.sum(-1), acc * corr[..., None] + pv

        def far(carry, delta):  # query chunk ids[i] sees key chunk ids[i] - delta
            def update(carry):
                qt, state = carry
                src = _sources(ids, delta)
                return _carry_back(qt, _take(op, src)), tile(state, st.dots(qt, _take(k, src)), delta)

            # At distances beyond the group's reach every key chunk is before the start (or its block's).
            return jax.lax.cond(jnp.any(st.reaches(ids, delta, n)), st.remat(update), lambda c: c, carry), None

        rows = jax.lax.dynamic_slice_in_dim(q_start, first, gq, axis=3)
        state = (jnp.full(rows.shape[:-1], MASKED), jnp.zeros(rows.shape[:-1]), jnp.zeros(rows.shape))
        if st.near:
            state = tile(state, jax.lax.dynamic_slice_in_dim(near, first, gq, axis=3), 0)
        (_, (m, row_sum, acc)), _ = jax.lax.scan(far, (rows, state), st.distances(n))
        return acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None], m + jnp.log(row_sum)

    o, lse = jax.lax.map(st.remat(query_group), jnp.arange(0, n, gq))
    return _regroup(o), _regroup(lse)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _far(st: Far, q_start, near, k, v, op, seg, consts):
    """(o, lse) of `far_forward`, with its own backward (`far_bwd`)."""
    return far_forward(st, q_start, near, k, v, op, seg, consts)


def _far_fwd(st, *args):
    o, lse = far_forward(st, *args)
    return (o, lse), (args, o, lse)


def far_bwd(st, res, cotangents):
    """The gradients of `_far`'s inputs in O(T * D * group) memory, by recomputation.

    Per tile, flash attention's recurrences: P = exp(logits - lse) from the forward's log-sum-
    exp, dS = P (dP - delta) with dP = dO V^T and delta_i = dO_i . O_i, and the logits' own
    backward (`jax.vjp` of the tile: scale, the bias hook, the dots) gives d q, d k and the bias
    arrays' gradients; dV = P^T dO.

    The hard part is the query chain of a query chunk n: q^(1) = its queries at the chunk's
    start, q^(e+1) = P_{n-e}^T q^(e), scored at distance e against the keys of chunk n - e.
    Its adjoint runs the other way, g^(e) = (the tile's d q^(e)) + P_{n-e} g^(e+1), with
    dP_{n-e} += q^(e) g^(e+1)^T: the farthest distance first. The chain cannot be run
    backwards (H_t is singular at beta_t = 1), and g^(e) cannot be run forwards without every
    earlier key chunk carried to chunk n - e. So one query group at a time: recompute its chain
    (a scan of one small matmul per distance, kept: [N, gq * c, D] per head, O(T * D * gq)),
    then walk the distances from the farthest to the nearest carrying g, recomputing each
    tile. dK, dV, dP and the bias arrays' gradients are accumulated over the groups (O(T * D));
    the groups run one after another, so nothing grows faster than T. (Autodiff keeps the
    chains of all the groups at once, T^2 / c * D per head; fla's Triton backward keeps every
    query carried to the boundary of each 512-token block, T^2 / 512 * D.)
    """
    (q_start, near, k, v, op, seg, consts), o, lse = res
    do, d_lse = cotangents
    n, gq = seg.shape[1], st.group
    # d lse_i / d s_ij = p_ij: a cotangent of the log-sum-exp enters as delta - d_lse.
    delta_o = jnp.sum(o * do, -1) - d_lse  # [B,K,G,N,c]
    lse = jnp.where(jnp.isfinite(lse), lse, -MASKED)  # a row with no key: every p = 0
    add = functools.partial(jax.tree.map, jnp.add)

    def query_group(grads, first):
        ids = first + jnp.arange(gq)
        rows = functools.partial(jax.lax.dynamic_slice_in_dim, start_index=first, slice_size=gq, axis=3)
        do_g, lse_g, delta_g = rows(do), rows(lse), rows(delta_o)

        def tile(logits, primals, src):  # (d primals, dV of key chunks src) of one tile
            s, vjp = jax.vjp(logits, *primals)
            p = jnp.exp(s - lse_g[..., None])
            dp = st.mm("bkgnid,bknjd->bkgnij", do_g, _take(v, src))
            return vjp(p * (dp - delta_g[..., None])), st.mm("bkgnij,bkgnid->bknjd", p, do_g)

        d_near = None
        if st.near:
            (d_near, d_consts), dv_near = tile(lambda s, cs: st.logits(s, ids, 0, seg, cs), (rows(near), consts),
                                               ids)
            dk, dv, dop, dcs = grads
            grads = (dk, dv.at[:, :, ids].add(dv_near), dop, add(dcs, d_consts))

        def advance(qt, delta):  # the forward's query chain, kept: chain[e - 1] = q^(e)
            step = lambda q: _carry_back(q, _take(op, _sources(ids, delta)))  # noqa: E731
            return jax.lax.cond(jnp.any(st.reaches(ids, delta, n)), step, lambda q: q, qt), qt

        _, chain = jax.lax.scan(advance, rows(q_start), st.distances(n))

        def back(carry, xs):  # carry: g^(e+1), the gradients so far
            delta, qt = xs

            def update(carry):
                g, (dk, dv, dop, dcs) = carry
                src = _sources(ids, delta)
                (dq, dkt, d_consts), dvt = tile(lambda q, kt, cs: st.logits(st.dots(q, kt), ids, delta, seg, cs),
                                                (qt, _take(k, src), consts), src)
                _, chain_vjp = jax.vjp(_carry_back, qt, _take(op, src))
                dq_chain, dop_t = chain_vjp(g)
                at = lambda acc, x: acc.at[:, :, src].add(x)  # noqa: E731
                return dq + dq_chain, (at(dk, dkt), at(dv, dvt), jax.tree.map(at, dop, dop_t), add(dcs, d_consts))

            return jax.lax.cond(jnp.any(st.reaches(ids, delta, n)), update, lambda c: c, carry), None

        (dq, grads), _ = jax.lax.scan(back, (jnp.zeros_like(rows(q_start)), grads), (st.distances(n), chain),
                                      reverse=True)
        return grads, (dq, d_near)

    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    (dk, dv, dop, dcs), (dq, d_near) = jax.lax.scan(query_group, zeros((k, v, op, consts)), jnp.arange(0, n, gq))
    return _regroup(dq), None if d_near is None else _regroup(d_near), dk, dv, dop, None, dcs


_far.defvjp(_far_fwd, far_bwd)
