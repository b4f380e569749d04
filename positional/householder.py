"""PaTH: attention along an accumulated product of data-dependent Householder transforms.

Each token t emits a unit vector w_t and a gain beta_t in (0, 2): H_t = I - beta_t w_t w_t^T
(orthogonal when beta_t = 2, the identity when beta_t = 0). The logit of query i on key j is

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(D)                    (the route (j, i])

Route convention, as in PaTH (Yang et al. 2025): the route from key j to query i holds the
steps of tokens j+1..i, the query's own step included and the key's excluded, so a key is
carried forward by every token that arrives after it. The accumulated-transformations paper
writes routes as the steps of tokens j..i-1 (P_{j->i} = M_{i-1}^{-1} ... M_j^{-1}); the two
are the same family with the step index shifted by one (its M_{t-1}^{-1} is our H_t), which
only changes which token's hidden state emits a step. Values are not transported.

Algorithms, all exact (tests/test_householder.py compares values and gradients):
  route_products     the dense products P[i, j] [T, T, D, D]: obviously correct, small T only;
  ut_matrix          the UT transform: H_n ... H_1 = I - W^T U W with U = (I + diag(beta) L)^-1
                     diag(beta), L the strictly lower part of W W^T (a unit-lower-triangular
                     solve). A contiguous range of steps uses the diagonal block of the same U,
                     which gives every route at once (`path_scores`, O(T^2) memory; with
                     `chunk`, one solve per chunk and a scan carrying earlier keys forward);
  chunk_products     each chunk's product in that compact form, combined across chunks by
                     `jax.lax.associative_scan`: the suffix products that carry every key to
                     the end of the sequence (a decode cache prefilled in parallel);
  chunked_attention  flash-style: keys carried to the end of their chunk, queries carried
                     back one chunk at a time, online softmax; O(T * D) memory, and a
                     backward that recomputes (a custom VJP) so training keeps it too. With
                     `span`, in two levels: the same inside blocks of span tokens (or PaTH's
                     kernel, each block a sequence of its own) and across the blocks, one D x D
                     product per block, merged by log-sum-exp (few, large steps; tiles="bf16"
                     puts the q.k and P.V tiles on bf16 operands).

Shapes: q [B, T, H, D]; k, v, w [B, T, K, D]; beta [B, T, K] (K kv heads, H % K == 0: a
query head reads the transport of its kv head).

PaTH-FoX (`path_fox`) adds FoX's gate sums F_i - F_j (positional/fox.py) on the PaTH authors'
scale: s_ij = (q_i^T P k_j + F_i - F_j) / sqrt(D), as their reference, kernels and decoding
compute it. FoX itself adds F_i - F_j after the 1 / sqrt(D); `path+fox` keeps that convention.
Every algorithm here takes the gate as a score bias, so the scale lives in one place (Fox's
`logit_scale`, fixed by path_fox's registry entry).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from positional.attention import OwnKernel, attention, choose, log_ring, per_device, per_platform_choice
from positional.kernels.path import check_transport, path_attention, refusal
from positional.ring import active_mesh, float_part, make_ring, ring_active, ring_call
from positional.softmax import MASKED, check_shapes, matmul, merged, rounded
from positional.linalg import unit_lower_inverse
from positional.scheme import Scheme

HIGHEST = jax.lax.Precision.HIGHEST
# The chunked form's tile operands (`tiles`): fp32 at highest precision, or bf16 accumulating in
# fp32 (tensor cores / the MXU, as flash attention and the authors' kernels take q.k and P.V).
TILES = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


# ---- dense references ------------------------------------------------------------------------

def householder_matrices(w, beta) -> jax.Array:
    """H_t = I - beta_t w_t w_t^T: w [..., D], beta [...] -> [..., D, D] fp32."""
    w = w.astype(jnp.float32)
    return jnp.eye(w.shape[-1]) - beta[..., None, None] * w[..., :, None] * w[..., None, :]


def route_products(w, beta) -> jax.Array:
    """P[i, j] = H_i ... H_{j+1} for j <= i (the identity at j = i), 0 above the diagonal.

    w [T, D], beta [T] -> [T, T, D, D]. Row i is built from row i-1 by one left product.
    """
    h = householder_matrices(w, beta)
    t, d = w.shape
    eye = jnp.eye(d)

    def step(prev, i):  # prev[j] = P[i-1, j]
        row = jnp.where((jnp.arange(t) < i)[:, None, None], jnp.matmul(h[i], prev, precision=HIGHEST), 0.0)
        row = row.at[i].set(eye)
        return row, row

    return jax.lax.scan(step, jnp.zeros((t, d, d)), jnp.arange(t))[1]


# ---- the UT transform -------------------------------------------------------------------------

def ut_matrix(w, beta) -> jax.Array:
    """U with H_n ... H_1 = I - W^T U W, lower triangular: w [..., n, D], beta [..., n] -> [..., n, n].

    Writing the product as I - W^T X gives x_t = beta_t (w_t - sum_{s<t} x_s (w_s . w_t)),
    i.e. (I + diag(beta) L) X = diag(beta) W with L = strict_lower(W W^T). fp32.
    """
    w = w.astype(jnp.float32)
    beta = beta.astype(jnp.float32)
    n = w.shape[-2]
    gram = jnp.einsum("...sd,...td->...st", w, w, precision=HIGHEST)
    return unit_lower_inverse(jnp.eye(n) + beta[..., :, None] * jnp.tril(gram, -1)) * beta[..., None, :]


def _route_terms(q, k, w, u):
    """The pieces of q_i^T (I - W_r^T U_r W_r) k_j for all routes r = (j, i] inside one range.

    q [..., n, D]; k, w [..., n, D]; u [..., n, n] (leading axes broadcast) -> (qw masked to
    s <= i, wk masked to t > j), each [..., n, n]; the route term of (i, j) is (qw @ u @ wk)[i, j].
    """
    n = w.shape[-2]
    i = jnp.arange(n)
    qw = jnp.matmul(q, jnp.swapaxes(w, -1, -2), precision=HIGHEST) * (i[None, :] <= i[:, None])
    wk = jnp.matmul(w, jnp.swapaxes(k, -1, -2), precision=HIGHEST) * (i[:, None] > i[None, :])
    return qw, wk


def path_scores(q, k, w, beta, chunk: int | None = None) -> jax.Array:
    """Unscaled logits q_i^T H_i ... H_{j+1} k_j for all j <= i (garbage above the diagonal).

    q [B, K, G, T, D]; k, w [B, K, T, D]; beta [B, K, T] -> [B, K, G, T, T] fp32. With chunk
    None (or >= T) one T x T unit-lower-triangular solve per kv head gives every route (the
    UT form over the whole range). Otherwise one solve per chunk of `chunk` tokens: a scan
    over query chunks m carries all earlier keys to the start of chunk m (one D x D operator
    per chunk), so the solves cost O(T * chunk^2) instead of O(T^3); the logits are the same.
    """
    b, kh, g, t, d = q.shape
    c = t if chunk is None else min(chunk, t)
    n = -(-t // c)
    f32 = jnp.float32
    qc, kc, wc = (_chunked(jnp.moveaxis(x.astype(f32), -2, 1), c) for x in (q, k, w))  # [B, N, c, ...]
    qc = jnp.moveaxis(qc, (1, 2), (-3, -2))  # [B, K, G, N, c, D]
    kc, wc = (jnp.moveaxis(x, (1, 2), (-3, -2)) for x in (kc, wc))  # [B, K, N, c, D]
    u = ut_matrix(wc, jnp.moveaxis(_chunked(jnp.moveaxis(beta, -1, 1), c), -1, 1))  # [B, K, N, c, c]
    k_end, uk = _carry_to_chunk_end(kc, wc, u)
    qw, _ = _route_terms(qc, kc[:, :, None], wc[:, :, None], u[:, :, None])
    near = jnp.einsum("bkgnid,bknjd->bkgnij", qc, kc, precision=HIGHEST) - jnp.matmul(
        qw, uk[:, :, None], precision=HIGHEST)  # routes inside a chunk
    if n == 1:
        return near[:, :, :, 0, :t, :t]
    q_start = qc - jnp.matmul(jnp.matmul(qw, u[:, :, None], precision=HIGHEST), wc[:, :, None],
                              precision=HIGHEST)  # queries carried back to their chunk's start
    ops = dense_product(wc, u)  # whole-chunk operators [B, K, N, D, D]

    def step(carried, x):  # carried [B, K, N * c, D]: keys of chunks < m at the start of chunk m, else 0
        qs, near_m, k_end_m, op, m = x
        s = jnp.einsum("bkgid,bkjd->bkgij", qs, carried, precision=HIGHEST)
        s = jax.lax.dynamic_update_slice_in_dim(s, near_m, m * c, axis=-1)
        carried = jnp.einsum("bkjd,bked->bkje", carried, op, precision=HIGHEST)  # past chunk m
        return jax.lax.dynamic_update_slice_in_dim(carried, k_end_m, m * c, axis=2), s

    xs = (q_start, near, k_end, ops, jnp.arange(n))
    xs = tuple(jnp.moveaxis(x, 3 if x.ndim == 6 else 2, 0) for x in xs[:4]) + xs[4:]
    _, s = jax.lax.scan(step, jnp.zeros((b, kh, n * c, d), f32), xs)  # [N, B, K, G, c, N * c]
    return jnp.moveaxis(s, 0, 3).reshape(b, kh, g, n * c, n * c)[..., :t, :t]


def _heads_first(q, k, w, beta):
    b, t, h, d = q.shape
    kh = k.shape[2]
    qh = jnp.moveaxis(q.reshape(b, t, kh, h // kh, d), 1, 3)  # [B, K, G, T, D]
    return qh, jnp.moveaxis(k, 1, 2), jnp.moveaxis(w, 1, 2), jnp.moveaxis(beta, 1, 2)


def dense_score_fn(w, beta, scale, chunk: int | None = None):
    """A `ScoreFn` for the reference attention (whole sequence in one block: q_offset 0)."""
    def score(qb, kb, qi, kj):  # qb [B, T, K, G, D], kb [B, T, K, D]
        kb, wh, bh = (jnp.moveaxis(x, 1, 2) for x in (kb, w, beta))
        return path_scores(jnp.moveaxis(qb, 1, 3), kb, wh, bh, chunk) * scale
    return score


# ---- chunks ------------------------------------------------------------------------------------

def _chunked(x, c, pad_value=0, n=None):
    """[B, T, ...] -> [B, N, c, ...], padding T up to N * c (N = ceil(T / c) unless given)."""
    b, t = x.shape[:2]
    n = n or -(-t // c)
    x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2), constant_values=pad_value)
    return x.reshape(b, n, c, *x.shape[2:])


def apply_product(x, w, u, transpose=False):
    """Rows x [..., m, D] times I - W^T U W (or its transpose): x - ((x W^T) U) W."""
    u = jnp.swapaxes(u, -1, -2) if transpose else u
    xw = jnp.einsum("...md,...nd->...mn", x, w, precision=HIGHEST)
    return x - jnp.einsum("...mn,...nd->...md", jnp.matmul(xw, jnp.swapaxes(u, -1, -2), precision=HIGHEST),
                          w, precision=HIGHEST)


def _carry_to_chunk_end(k, w, u):
    """Keys k [..., c, D] carried to the end of their chunk, and u @ wk (the route terms' right half)."""
    _, wk = _route_terms(k, k, w, u)
    uk = jnp.matmul(u, wk, precision=HIGHEST)
    return k - jnp.matmul(jnp.swapaxes(uk, -1, -2), w, precision=HIGHEST), uk


def dense_product(w, u) -> jax.Array:
    """I - W^T U W as a D x D matrix: w [..., c, D], u [..., c, c] -> [..., D, D]."""
    return jnp.eye(w.shape[-1]) - jnp.einsum("...sd,...st,...te->...de", w, u, w, precision=HIGHEST)


def chunk_products(w, beta, chunk: int) -> jax.Array:
    """Dense products of whole chunks P_c = H_{last} ... H_{first}: w [B, T, K, D] -> [B, N, K, D, D]."""
    wc = jnp.moveaxis(_chunked(w.astype(jnp.float32), chunk), 3, 2)  # [B, N, K, c, D]
    return dense_product(wc, ut_matrix(wc, jnp.moveaxis(_chunked(beta, chunk), 3, 2)))


def exclusive_products(ops, axis: int, reverse: bool = False) -> jax.Array:
    """Products of the D x D matrices `ops` along `axis`, each leaving its own out: out[m] =
    ops[m-1] ... ops[0], or with `reverse` ops[N-1] ... ops[m+1] (the identity where empty).
    By `jax.lax.associative_scan`: log N rounds of matmuls, never anything larger than ops."""
    def mul(a, b):  # a holds the earlier elements of the scan (the later ones with `reverse`)
        return jnp.matmul(a, b, precision=HIGHEST) if reverse else jnp.matmul(b, a, precision=HIGHEST)

    inclusive = jax.lax.associative_scan(mul, ops, reverse=reverse, axis=axis)
    eye = jnp.broadcast_to(jnp.eye(ops.shape[-1]), jax.lax.slice_in_dim(ops, 0, 1, axis=axis).shape)
    if reverse:
        return jnp.concatenate([jax.lax.slice_in_dim(inclusive, 1, None, axis=axis), eye], axis)
    return jnp.concatenate([eye, jax.lax.slice_in_dim(inclusive, 0, -1, axis=axis)], axis)


def transport_to_end(k, w, beta, chunk: int = 64) -> jax.Array:
    """Every key carried to the last position: k_j -> H_{T-1} ... H_{j+1} k_j, [B, T, K, D] fp32.

    Inside a chunk by the UT form; across chunks by the suffix products of whole-chunk
    operators, computed with `jax.lax.associative_scan` on [N, D, D] (never T x T x D x D).
    """
    b, t, kh, d = k.shape
    kc = jnp.moveaxis(_chunked(k.astype(jnp.float32), chunk), 3, 2)  # [B, N, K, c, D]
    wc = jnp.moveaxis(_chunked(w.astype(jnp.float32), chunk), 3, 2)
    u = ut_matrix(wc, jnp.moveaxis(_chunked(beta, chunk), 3, 2))
    to_chunk_end, _ = _carry_to_chunk_end(kc, wc, u)
    after = exclusive_products(dense_product(wc, u), 1, reverse=True)  # P_{N-1} ... P_{c+1} [B, N, K, D, D]
    out = jnp.einsum("bnkde,bnkce->bnkcd", after, to_chunk_end, precision=HIGHEST)
    return jnp.moveaxis(out, 2, 3).reshape(b, -1, kh, d)[:, :t]


def chunked_attention(q, k, v, w, beta, *, bias_fn=None, segment_ids=None, chunk: int = 64,
                      group: int | None = None, scale: float | None = None, autodiff: bool = False,
                      span: int | None = None, outer_group: int = 8, tiles: str = "fp32",
                      kernel: dict | None = None) -> jax.Array:
    """PaTH attention with O(T * D) memory, forward and backward: returns [B, T, H, D] in q's dtype.

    For query chunk n and key chunk m < n the route splits as (prefix of chunk n up to i) x
    P_{n-1} ... P_{m+1} x (suffix of chunk m after j). Per chunk (plain JAX, differentiated by
    autodiff, O(T * chunk) memory): the UT solve, keys carried to the end of their chunk,
    queries to the start of theirs, the in-chunk logits. Across chunks, `_far`: queries carried
    back one whole chunk per step of a scan over the chunk distance, with an online softmax,
    and its own recomputing backward (see `_far_bwd`). Query chunks go `group` at a time (so
    one step's tiles stay in cache; default 8), and a group skips the distances that would take
    all its chunks before the start. `autodiff`: differentiate `_far` through its scans instead, which
    keeps every step's carry (about T^2 / chunk * D floats per head: for comparison only).

    `span` (a multiple of the chunk, shorter than T): two levels, the same split one level up.
    The inner level is the above restricted to blocks of `span` tokens (the scan reaches back at
    most span / chunk - 1 chunks); the outer level treats each block as one chunk: its queries
    carried back to the block's start and its keys to the block's end (the chunks' D x D
    products, prefix and suffix), one D x D product per block, no in-block logits, `outer_group`
    blocks at a time. The two merge by their log-sum-exp, and the backward runs `_far_bwd` on
    each level with the merged output and log-sum-exp. The same logits and result; the inner
    level takes every chunk in one group by default (its scans are span / chunk - 1 steps long),
    so the scans take about span / chunk + (T / span)^2 / outer_group steps where one level
    takes (T / chunk)^2 / group, for O(T * D * (span / chunk + outer_group)) memory per head.

    `tiles`: the operands of the q.k and P.V tiles, both passes (TILES): "fp32" (highest
    precision) or "bf16" (accumulated in fp32, as flash attention's). The transport, the
    in-chunk pieces and the softmax statistics stay fp32.

    `kernel`: the inner level by PaTH's Pallas kernel, each block a sequence of its own
    (positional/kernels/path.py `path_attention` with `span`; the dict: its options, e.g.
    block_size, platform); without span (or span >= T) the kernel does it all.
    """
    check_shapes(q, k, v, segment_ids)
    check_transport(k, w, beta)
    if tiles not in TILES:
        raise ValueError(f"PaTH chunked_attention tiles={tiles!r} must be one of {sorted(TILES)}")
    b, t, h, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    c = min(chunk, t)
    if span is not None and span < t:
        if span % c:
            raise ValueError(f"PaTH chunked_attention span={span} must be a multiple of chunk={c}")
        return _two_levels(q, k, v, w, beta, bias_fn, segment_ids, c, span, group, outer_group, scale, autodiff,
                           tiles, kernel)
    if kernel is not None:
        return path_attention(q, k, v, w, beta, bias_fn=bias_fn, segment_ids=segment_ids, scale=scale, **kernel)
    c, gq, n = _chunking(t, chunk, group or 8)
    (q_start, near, k_end, vc, wc, u), seg = _chunk_pieces(q, k, v, w, beta, c, n), _chunk_rows(segment_ids, b, t, c, n)
    bias, consts = _bias_hook(bias_fn, c)
    st = _Far(length=t, chunk=c, group=gq, heads=h, scale=scale, bias=bias, autodiff=autodiff, tiles=tiles)
    args = (q_start, near, k_end, vc, _chunk_operators(wc, u), seg, consts)
    o = (_far_forward if autodiff else _far)(st, *args)[0]  # [B,K,G,N,c,D]
    return _unchunked(o, t).astype(q.dtype)


def _bias_hook(bias_fn, c: int):
    """(bias(qpos, kpos, *consts) for tiles of c x c, consts): the arrays bias_fn reads become
    inputs of `_far`, which returns their gradients. (None, ()) without a bias."""
    if bias_fn is None:
        return None, ()
    bias, consts = jax.closure_convert(bias_fn, jnp.arange(c), jnp.arange(c))
    return bias, tuple(consts)


def _two_levels(q, k, v, w, beta, bias_fn, segment_ids, c: int, span: int, group: int | None, outer_group: int,
                scale: float, autodiff: bool, tiles: str, kernel: dict | None):
    """`chunked_attention` with `span`: the per-chunk pieces, the outer blocks' pieces made from
    them, each level's (o, lse), merged by their log-sum-exp (autodiff outside `_far` and the
    kernel). The inner level by `_far`, or with `kernel` by PaTH's Pallas kernel (its options)."""
    b, t, h, d = q.shape
    kh, per = k.shape[2], span // c
    blocks = -(-t // span)
    g2 = min(outer_group, blocks)
    blocks = -(-blocks // g2) * g2
    n = blocks * per
    (q_start, near, k_end, vc, wc, u), seg = _chunk_pieces(q, k, v, w, beta, c, n), _chunk_rows(segment_ids, b, t, c, n)

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
    far = _far_forward if autodiff else _far
    if kernel is None:
        bias, consts = _bias_hook(bias_fn, c)
        inner = _Far(length=t, chunk=c, group=math.gcd(n, group or n), heads=h, scale=scale, bias=bias,
                     autodiff=autodiff, span=per, tiles=tiles)
        o1, lse1 = far(inner, q_start, near, k_end, vc, _chunk_operators(wc, u), seg, consts)
        o1, lse1 = (x.reshape(*x.shape[:3], blocks, span, *x.shape[5:]) for x in (o1, lse1))  # [.., n, c, ..] -> blocks
    else:
        o1, lse1 = path_attention(q, k, v, w, beta, bias_fn=bias_fn, segment_ids=segment_ids, scale=scale, span=span,
                                  **kernel)
        o1, lse1 = _chunk_heads(o1.astype(jnp.float32), kh, span, blocks), _chunk_heads(lse1, kh, span, blocks)
    bias, consts = _bias_hook(bias_fn, span)
    outer = _Far(length=t, chunk=span, group=g2, heads=h, scale=scale, bias=bias, autodiff=autodiff, near=False,
                 tiles=tiles)
    o2, lse2 = far(outer, q_outer.reshape(*q_outer.shape[:3], blocks, span, d), None,
                   k_outer.reshape(b, kh, blocks, span, d), vc.reshape(b, kh, blocks, span, d), (whole,),
                   seg.reshape(b, blocks, span), consts)
    return _unchunked(merged(o1, lse1, o2, lse2)[0], t).astype(q.dtype)


def _chunking(t: int, chunk: int, group: int) -> tuple[int, int, int]:
    """(tokens per chunk, query chunks per group, chunks: a whole number of groups) for length t."""
    c = min(chunk, t)
    gq = min(group, -(-t // c))
    return c, gq, -(-t // (c * gq)) * gq


def _chunk_rows(segment_ids, b, t, c, n):
    """Segment ids [B, T] (None: one segment) in n chunks [B, N, c]; padding gets -1."""
    return _chunked(jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids, c, -1, n)


def _chunk_heads(x, kh, c, n, pad_value=0):
    """[B, T, K * G, ...] -> [B, K, G, N, c, ...] (padding pad_value); `_unchunked` inverts it."""
    b, t, h = x.shape[:3]
    return jnp.moveaxis(_chunked(x.reshape(b, t, kh, h // kh, *x.shape[3:]), c, pad_value, n), (3, 4), (1, 2))


def _unchunked(x, t):
    """[B, K, G, N, c, ...] -> [B, T, K * G, ...] (padding dropped)."""
    x = jnp.moveaxis(x, (1, 2), (3, 4))
    return x.reshape(x.shape[0], -1, x.shape[3] * x.shape[4], *x.shape[5:])[:, :t]


def _chunk_pieces(q, k, v, w, beta, c: int, n: int):
    """PaTH's per-chunk pieces, fp32, of q [B, T, H, D], k, v, w [B, T, K, D], beta [B, T, K] in n
    chunks of c tokens (padding: steps of beta 0, the identity): q_start [B, K, G, N, c, D] (queries
    carried back to their chunk's start), near [B, K, G, N, c, c] (unscaled in-chunk logits),
    k_end [B, K, N, c, D] (keys carried to their chunk's end), v, w [B, K, N, c, D] and the UT
    matrices u [B, K, N, c, c] (chunk m's product is I - w_m^T u_m w_m)."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    f32 = jnp.float32
    qc = _chunk_heads(q.astype(f32), kh, c, n)  # [B,K,G,N,c,D]
    kc, vc, wc = (jnp.moveaxis(_chunked(x.astype(f32), c, n=n), 3, 1) for x in (k, v, w))  # [B,K,N,c,D]
    u = ut_matrix(wc, jnp.moveaxis(_chunked(beta, c, n=n), 3, 1))  # [B,K,N,c,c]
    k_end, uk = _carry_to_chunk_end(kc, wc, u)  # uk [B,K,N,c,c]
    qw, _ = _route_terms(qc, kc[:, :, None], wc[:, :, None], u[:, :, None])
    q_start = qc - jnp.matmul(jnp.matmul(qw, u[:, :, None], precision=HIGHEST), wc[:, :, None], precision=HIGHEST)
    near = jnp.einsum("bkgnid,bknjd->bkgnij", qc, kc, precision=HIGHEST) - jnp.matmul(qw, uk[:, :, None],
                                                                                      precision=HIGHEST)
    return q_start, near, k_end, vc, wc, u


def _chunk_operators(wc, u):
    """The whole-chunk operators as `_carry_back` takes them: dense D x D matrices when D <= c
    (carrying a query past a chunk is then one matmul instead of three, as with 64-dim heads),
    else the compact (w, u)."""
    return (dense_product(wc, u),) if wc.shape[-1] <= wc.shape[-2] else (wc, u)


@dataclasses.dataclass(frozen=True)
class _Far:
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


def _far_forward(st: _Far, q_start, near, k, v, op, seg, consts):
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
def _far(st: _Far, q_start, near, k, v, op, seg, consts):
    """(o, lse) of `_far_forward`, with its own backward (`_far_bwd`)."""
    return _far_forward(st, q_start, near, k, v, op, seg, consts)


def _far_fwd(st, *args):
    o, lse = _far_forward(st, *args)
    return (o, lse), (args, o, lse)


def _far_bwd(st, res, cotangents):
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


_far.defvjp(_far_fwd, _far_bwd)


# ---- the sequence split over a ring of devices ----------------------------------------------

def ring_path_attention(q, k, v, w, beta, *, mesh, axis: str = "sequence", bias_fn=None, segment_ids=None,
                        chunk: int = 64, group: int = 8, scale: float | None = None, batch_axes=("data", "fsdp"),
                        head_axes=("tensor",)) -> jax.Array:
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
    forward (`_far_forward`, the bias shifted to global indices); the two merge by their
    log-sum-exp. Per step a device applies one D x D matrix to the visiting keys.

    Backward (a custom VJP, recomputing from the saved output and log-sum-exp): the ring's own
    backward for the visiting shards (each shard's d k_end travels with it back home; dq0 and
    dA stay home), `_far_bwd` for the own shard, dA back to the products through the
    all-gather's transpose (a reduce-scatter of n D x D matrices), and everything through the
    per-shard pieces by autodiff. Memory per device, forward and backward: O(L D) for the
    shard's pieces, one visiting shard, the n products, a block of scores and `_far`'s
    O(L D group) query chains; plus the bias's per-token features (FoX's log f [B, T, H]), which
    every device holds whole, as in `ring_attention`.

    bias_fn(qi, kj) reads global indices; the arrays it holds (a `Bias`'s values: FoX's F)
    become inputs of the ring (positional/ring.py `make_ring`). The largest divisor of L up to `chunk` is both the own
    shard's chunk and the ring's block of scores (one shape for the bias). fp32 inside (as
    `chunked_attention`); batch and heads split inside as in `ring_attention`.
    """
    check_shapes(q, k, v, segment_ids)
    check_transport(k, w, beta)
    ring, features = make_ring(q, k, mesh=mesh, axis=axis, bias_fn=bias_fn, scale=scale, block_size=chunk,
                               batch_axes=batch_axes, head_axes=head_axes)
    bias_hooks = ring.hooks
    # The ring's features: (A [n, B, K, D, D] of this device, the bias's arrays).
    ring = dataclasses.replace(ring, hooks=lambda f: bias_hooks(f[1]), diagonal=False,
                               key_map=lambda f, keys, src: jnp.einsum("bkde,bske->bskd", f[0][src], keys,
                                                                       precision=HIGHEST))
    n, length, d = ring.n, ring.shard_len, q.shape[-1]
    c, gq, nc = _chunking(length, ring.block, group)

    def pieces(q, k, v, w, beta):
        """One device's shard: (own-shard pieces for `_far`, q0 [B, L, H, D], k_end [B, L, K, D],
        v fp32, P_r [B, K, D, D])."""
        q_start, near, k_end, vc, wc, u = _chunk_pieces(q, k, v, w, beta, c, nc)
        ops = dense_product(wc, u)  # [B, K, N, D, D]
        before = exclusive_products(ops, 2)
        q0 = jnp.matmul(q_start, before[:, :, None], precision=HIGHEST)  # q <- (P_{m-1} ... P_0)^T q
        keys = jnp.einsum("bknde,bknce->bkncd", exclusive_products(ops, 2, reverse=True), k_end, precision=HIGHEST)
        keys = jnp.moveaxis(keys, 1, 3).reshape(q.shape[0], -1, k.shape[2], d)[:, :length]
        whole = jnp.matmul(ops[:, :, -1], before[:, :, -1], precision=HIGHEST)
        return ((q_start, near, k_end, vc, _chunk_operators(wc, u)), _unchunked(q0, length), keys,
                v.astype(jnp.float32), whole)

    def spans(whole):
        """P_r [B, K, D, D] of each device -> A [n, B, K, D, D]: A[s] = P_{r-1} ... P_{s+1} (r this one)."""
        before_me = jnp.arange(n)[:, None, None, None, None] < jax.lax.axis_index(axis)
        return exclusive_products(jnp.where(before_me, jax.lax.all_gather(whole, axis), jnp.eye(d)), 0, reverse=True)

    def own_shard(seg, features, heads):
        """(`_Far` of this device's shard, with the bias at global indices; its arrays; its rows)."""
        diff, rebuild, _ = float_part(features)
        bias = None
        if ring.local_hooks((None, features))[0] is not None:
            def bias(qpos, kpos, *diff):
                start = jax.lax.axis_index(axis) * length
                return ring.local_hooks((None, rebuild(diff)))[0](start + qpos, start + kpos)
        st = _Far(length=length, chunk=c, group=gq, heads=heads, scale=ring.scale, bias=bias)
        return st, tuple(diff), _chunk_rows(seg, seg.shape[0], length, c, nc)

    def forward(q, k, v, w, beta, seg, features):
        own, q0, keys, vf, whole = pieces(q, k, v, w, beta)
        st, consts, rows = own_shard(seg, features, q.shape[2])
        o_own, lse_own = (_unchunked(x, length) for x in _far_forward(st, *own, rows, consts))
        o_far, lse_far = ring.forward(q0, keys, vf, seg, (spans(whole), features))
        return merged(o_own, lse_own, o_far, lse_far)

    def backward(q, k, v, w, beta, seg, features, o, lse, do):
        (own, q0, keys, vf, whole), pieces_vjp = jax.vjp(pieces, q, k, v, w, beta)
        a, spans_vjp = jax.vjp(spans, whole)
        st, consts, rows = own_shard(seg, features, q.shape[2])
        kh = k.shape[2]
        # Padding rows get lse +1e30: weights exp(s - lse) = 0, as their dO is.
        saved = (_chunk_heads(o, kh, c, nc), _chunk_heads(lse, kh, c, nc, -MASKED))
        *d_own, _, d_consts = _far_bwd(st, ((*own, rows, consts), *saved), (_chunk_heads(do, kh, c, nc), 0.0))
        dq0, d_keys, dv, (da, *d_bias) = ring.backward(q0, keys, vf, seg, (a, features), o, lse, do)
        grads = pieces_vjp((tuple(d_own), dq0, d_keys, dv, spans_vjp(da)[0]))
        return (*grads, [x + y for x, y in zip(d_consts, d_bias)])

    if segment_ids is None:
        segment_ids = jnp.zeros(q.shape[:2], jnp.int32)
    spec, _, row_spec = ring.specs
    return ring_call(ring, forward, backward, (q, k, v, w, beta), (spec,) * 4 + (row_spec,), segment_ids, features)


# ---- the scheme -------------------------------------------------------------------------------



@dataclasses.dataclass(frozen=True)
class Path(Scheme):
    """PaTH transport of keys; `features` = {'w': [B, T, K, D] unit, 'beta': [B, T, K] in (0, 2)}.

    impl "reference" materialises the T x T logits (`path_scores`, one UT solve per
    `solve_chunk` tokens), "blockwise" is the flash-style chunked form with `block_size` tokens
    per chunk and O(T * D) memory, training included (`chunked_attention`; in two levels with
    blocks of `span` tokens where span > 0; with "pallas" the kernel inside them), "pallas" the same
    algorithm as a Pallas kernel (positional/kernels/path.py; the interpreter on CPU, with
    `block_size`-token chunks there), "ring" splits the sequence over the devices of the
    enclosing sequence mesh (`ring_path_attention`; off one, the chunked form), and "auto" the
    ring on a sequence mesh, else the kernel on TPU (blockwise where it refuses the call),
    blockwise on GPU (attention.FACTS["path_kernel_gpu"]), on CPU the reference up to
    attention.REFERENCE_MAX keys and blockwise past it.
    The decode cache holds keys already carried to the latest token; each new token applies its
    H_t to all of them (O(T * D) per token).
    """
    rank: int = 32  # w = normalise(conv(W_up W_down x)): the rank of that projection
    conv: int = 3  # width of the short causal convolution in w (0: none); 3 as the public layer
    qk_norm: bool = False  # RMS-normalise q and k per head (parameter-free) before the transport
    solve_chunk: int = 64  # impl "reference": tokens per UT solve in the logits (0: one solve over T)
    # impls "blockwise" and "pallas": two levels, blocks of `span` tokens (a multiple of block_size;
    # 0: one level): the chunked form (or the kernel, each block its own sequence) inside the
    # blocks, the chunked form across them (`chunked_attention`).
    span: int = 0
    tiles: str = "fp32"  # the chunked form's q.k and P.V tiles' operands, "fp32" or "bf16" (TILES)

    relative = False  # routes depend on the tokens between, not on positions
    impls = ("auto", "reference", "blockwise", "pallas", "ring")
    has_score = needs_features = default_key = True
    probes = ("householder",)
    # The reference form materialises the logits with one UT solve per 64 tokens (the fastest at
    # training lengths); from eval.blockwise_from on, the chunked algorithm runs 64-token chunks.
    config_defaults = {"block_size": 64}

    def __post_init__(self):
        super().__post_init__()
        for name, least in (("rank", 1), ("conv", 0), ("solve_chunk", 0), ("span", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"PaTH option {name}={getattr(self, name)} must be >= {least}")
        if self.tiles not in TILES:
            raise ValueError(f"PaTH option tiles={self.tiles!r} must be one of {sorted(TILES)}")

    def transform(self, q, k, v, features, positions):
        if self.qk_norm:
            q, k = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
                    .astype(x.dtype) for x in (q, k))
        return q, k, v

    def score_fn(self, features):  # the whole sequence as one block: reference attention only
        w, beta = features["w"], features["beta"]
        return dense_score_fn(w, beta, self.head_dim ** -0.5, self.solve_chunk or None)

    def default_features(self, q, k, *, positions, key=None, segment_ids=None):
        """Steps of random directions (uniform on the sphere, drawn from `key`) with beta = 1,
        the gain of the features module at its initialisation."""
        w = jax.random.normal(self.draw_key(key), k.shape, jnp.float32)
        return {"w": w * jax.lax.rsqrt(jnp.sum(w * w, -1, keepdims=True)), "beta": jnp.ones(k.shape[:3], jnp.float32)}

    def attention(self, q, k, v, features, *, positions=None, segment_ids=None, q_offset=0, impl="reference",
                  block_size=512, platform=None):
        w, beta = features["w"], features["beta"]
        check_transport(k, w, beta)
        bias = self.score_bias(features, positions)
        if impl == "auto" and ring_active():  # the sequence split over a mesh: PaTH's own ring
            impl = "ring"
            log_ring(type(self).__name__)
        span = self.span if 0 < self.span < k.shape[1] else None

        def kernel(q, k, v, w, beta, bias, seg, platform=platform):  # with span: inside blocks, the chunked form across
            return chunked_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, chunk=block_size, span=span,
                                     tiles=self.tiles, kernel={"block_size": block_size, "platform": platform})

        if impl == "auto":  # on CPU by length, on GPU blockwise (FACTS["path_kernel_gpu"]), on TPU the kernel
            own = OwnKernel("PaTH's kernel", lambda platform: refusal(bias, k[:, :span], platform),
                            slower={"cuda": "path_kernel_gpu"})

            def pick(platform):
                chosen, why = choose(q, k, v, platform=platform, own=own)
                if chosen == "pallas":  # the kernel per device on a mesh (XLA cannot partition it)
                    return chosen, why, lambda q, k, v: per_device(functools.partial(kernel, platform=platform),
                                                                   q, k, v, w, beta, bias_fn=bias,
                                                                   segment_ids=segment_ids)
                return chosen, why, lambda q, k, v: self.attention(
                    q, k, v, features, positions=positions, segment_ids=segment_ids, impl=chosen,
                    block_size=block_size, platform=platform)
            return per_platform_choice(pick, q, k, v, label=type(self).__name__)
        if impl == "ring" and active_mesh() is not None:
            return ring_path_attention(q, k, v, w, beta, mesh=active_mesh(), bias_fn=bias, segment_ids=segment_ids,
                                       chunk=block_size)
        if impl in ("blockwise", "ring"):  # "ring" off a sequence mesh: the chunked form
            return chunked_attention(q, k, v, w, beta, segment_ids=segment_ids, bias_fn=bias, chunk=block_size,
                                     span=span, tiles=self.tiles)
        if impl == "pallas":  # the Pallas interpreter on CPU, with block_size-token chunks
            return kernel(q, k, v, w, beta, bias, segment_ids)
        return super().attention(q, k, v, features, positions=positions, segment_ids=segment_ids)

    def init_cache(self, batch, max_len, num_kv_heads, dtype=jnp.float32):
        # Keys are carried by every new token, so they stay fp32 whatever the model dtype.
        cache = super().init_cache(batch, max_len, num_kv_heads, dtype)
        if self.conv:  # the projections the convolution of w reads (models/features.py)
            cache["features"]["w_in"] = jnp.zeros((batch, max_len, num_kv_heads * self.head_dim), jnp.float32)
        return {**cache, "k": cache["k"].astype(jnp.float32)}

    def decode_step(self, cache, q, k, v, features=None):
        """n new tokens at the cache index. One token: carry every cached key by H_t (a rank-one
        update), append k_t, attend. Several (a prefill): the whole cache as one sequence in
        which the cached slots take no step (beta 0: their keys are already carried to the
        index) and the new tokens take theirs, attended by the chunked algorithm; the keys are
        then carried to the last new token by `transport_to_end`. O(L * D) memory either way."""
        q, k, v = self.transform(q, k, v, features, None)
        b, n = q.shape[:2]
        index = cache["index"]
        cache, bias_features, key_positions = self.remember(
            cache, features, jnp.broadcast_to(index + jnp.arange(n, dtype=jnp.int32), (b, n)))
        bias_fn = self.score_bias(bias_features, key_positions)
        w, beta = features["w"].astype(jnp.float32), features["beta"].astype(jnp.float32)

        def put(buf, x):
            return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), index, axis=1)

        cv = put(cache["v"], v)
        if n == 1:  # the new token's own step does not act on its key: carry, then append
            ck = cache["k"]
            ck = put(ck - beta[..., None] * w * jnp.einsum("bskd,bkd->bsk", ck, w[:, 0], precision=HIGHEST)[
                ..., None], k)
            out = attention(q, ck, cv, bias_fn=bias_fn, q_offset=index)
        else:
            ck = put(cache["k"], k)
            ws = put(jnp.zeros(ck.shape, jnp.float32), w)
            betas = put(jnp.zeros(ck.shape[:3], jnp.float32), beta)
            qs = put(jnp.zeros(ck.shape[:2] + q.shape[2:], q.dtype), q)
            out = chunked_attention(qs, ck, cv, ws, betas, bias_fn=bias_fn)
            out = jax.lax.dynamic_slice_in_dim(out, index, n, axis=1)
            ck = transport_to_end(ck, ws, betas)
        return out, {**cache, "k": ck, "v": cv, "index": index + n}
