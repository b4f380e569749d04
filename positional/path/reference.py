"""PaTH's references (positional/path/__init__.py): obviously correct, for the tests and short
sequences: the dense route products and the materialised logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from positional.path.transport import (HIGHEST, carry_to_chunk_end, dense_product, householder_matrices, route_terms,
                                       to_chunks, ut_matrix)


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
    qc, kc, wc = (to_chunks(jnp.moveaxis(x.astype(f32), -2, 1), c) for x in (q, k, w))  # [B, N, c, ...]
    qc = jnp.moveaxis(qc, (1, 2), (-3, -2))  # [B, K, G, N, c, D]
    kc, wc = (jnp.moveaxis(x, (1, 2), (-3, -2)) for x in (kc, wc))  # [B, K, N, c, D]
    u = ut_matrix(wc, jnp.moveaxis(to_chunks(jnp.moveaxis(beta, -1, 1), c), -1, 1))  # [B, K, N, c, c]
    k_end, uk = carry_to_chunk_end(kc, wc, u)
    qw, _ = route_terms(qc, kc[:, :, None], wc[:, :, None], u[:, :, None])
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


def heads_first(q, k, w, beta):
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

