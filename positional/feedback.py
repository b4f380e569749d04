"""Sessa's feedback path: attention over the strict past inside a unit-lower-triangular solve.

The mixer output s solves (I - B) s = f, one scalar matrix B for all D features:

    alpha[t, j] = softmax_{j < t}(qb_t . kb_j / sqrt(dk))   (row 0 is zero: it has no past)
    B[t, j]     = gamma_t alpha[t, j]  for j < t, 0 otherwise
    s_0 = f_0,  s_t = f_t + gamma_t sum_{j<t} alpha[t, j] s_j

With |gamma_t| <= rho < 1 every row of B sums to at most rho in absolute value, so the solve is
a contraction: ||s_t|| <= max ||f|| / (1 - rho) (Sessa, Lemma 4.2).

Three implementations, all fp32 whatever the input dtype, returning s in fp32:
  - `solve_reference`: builds B [B, T, T] and calls a triangular solve (obviously correct).
  - `solve_blocked`: forward substitution over chunks of `block_size` rows, recomputing each
    block x block tile of B from qb, kb, the row log-sum-exp and gamma; memory O(T (D + dk) +
    block^2). Its `custom_vjp` backward is the reverse-time (upper-triangular) solve
        lambda = (I - B)^{-T} ds,   df = lambda,   dB[t, j] = <lambda_t, s_j>  (j < t),
        dgamma_t = sum_j alpha[t, j] dB[t, j] = <lambda_t, h_t>,  h_t = sum_j alpha[t, j] s_j,
        dlogit[t, j] = gamma_t alpha[t, j] (dB[t, j] - dgamma_t)     (the softmax VJP),
    with h saved by the forward so dgamma needs no division by gamma.
  - the Pallas kernel in `positional/kernels/feedback_solve.py` (same tiles, same backward;
    the tile functions live there and the blocked solve here imports them).
`decode_solve` extends a solved prefix by n new tokens, for recurrent decoding.

Shapes: qb, kb [B, T, dk]; gamma [B, T]; f [B, T, D].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from positional.kernels.feedback_solve import (alpha_tile, check_inputs, dlogit_tile, dot, feedback_solve_pallas,
                                              lse_finish, lse_update)
from positional.linalg import solve_unit_lower
from positional.softmax import MASKED

IMPLEMENTATIONS = ("reference", "blocked", "pallas")


def check_gamma_max(gamma_max: float) -> None:
    if not 0.0 < gamma_max < 1.0:
        raise ValueError(f"gamma_max={gamma_max} must be in (0, 1): with |gamma_t| <= gamma_max >= 1 the "
                         "feedback rows no longer sum below 1 and the solve is no longer stable")


def gain(z: jax.Array, gamma_max: float) -> jax.Array:
    """gamma_t = gamma_max tanh(z_t), in fp32; z [B, T] is w_g . abar_t + b_g."""
    check_gamma_max(gamma_max)
    return gamma_max * jnp.tanh(z.astype(jnp.float32))


# ---- reference ---------------------------------------------------------------------------------
def feedback_weights(qb, kb, segment_ids=None) -> jax.Array:
    """alpha [B, T, T] fp32: softmax over the strict past of qb_t . kb_j / sqrt(dk); row 0 zero.

    With segment_ids [B, T] (packed sequences) the past is the strict past in the same segment.
    """
    t, dk = qb.shape[1], qb.shape[-1]
    logits = jnp.einsum("btd,bsd->bts", qb.astype(jnp.float32), kb.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * dk ** -0.5
    past = jnp.tril(jnp.ones((t, t), bool), -1)
    if segment_ids is not None:
        past = past & (segment_ids[:, :, None] == segment_ids[:, None, :])
    return jnp.where(past, jax.nn.softmax(jnp.where(past, logits, MASKED), axis=-1), 0.0)


def feedback_matrix(qb, kb, gamma, segment_ids=None) -> jax.Array:
    """B [B, T, T] fp32, strictly lower-triangular: B[t, j] = gamma_t alpha[t, j]."""
    return gamma.astype(jnp.float32)[..., None] * feedback_weights(qb, kb, segment_ids)


def solve_reference(qb, kb, gamma, f, segment_ids=None) -> jax.Array:
    """s [B, T, D] fp32 solving (I - B) s = f, with B built in full."""
    check_inputs(qb, kb, gamma, f, segment_ids)
    t = qb.shape[1]
    i_minus_b = jnp.eye(t, dtype=jnp.float32) - feedback_matrix(qb, kb, gamma, segment_ids)
    return solve_unit_lower(i_minus_b, f.astype(jnp.float32))


# ---- blocked forward substitution in plain JAX -------------------------------------------------
def _slice(x, i, c):
    return lax.dynamic_slice_in_dim(x, i * c, c, axis=0)


def _put(x, i, c, value):
    return lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), i * c, axis=0)


def _seg(seg, i, j, c):
    """Segment ids of query chunk i as a column and of key chunk j as a row."""
    return _slice(seg, i, c), _slice(seg, j, c).T


def _row_lse(qb, kb, seg, c):
    """Row log-sum-exp [Tp, 1] of the strict-past logits, one query chunk at a time."""
    scale = qb.shape[-1] ** -0.5

    def chunk(i):
        qb_i = _slice(qb, i, c)
        init = (jnp.full((c, 1), MASKED, jnp.float32), jnp.zeros((c, 1), jnp.float32))
        step = lambda j, st: lse_update(st, qb_i, _slice(kb, j, c), i * c, j * c, scale,  # noqa: E731
                                        _seg(seg, i, j, c))
        m, row_sum = lax.fori_loop(0, i + 1, step, init)
        return lse_finish(m, row_sum)
    return lax.map(chunk, jnp.arange(qb.shape[0] // c)).reshape(-1, 1)


def _forward_2d(qb, kb, lse, gamma, f, seg, c):
    """(s, h) [Tp, D]: chunk i gets R_i = f_i + gamma_i sum_{j<i} alpha_ij S_j, then
    S_i = (I - gamma_i alpha_ii)^{-1} R_i; h_i = sum_{j<=i} alpha_ij S_j is kept for the backward."""
    scale = qb.shape[-1] ** -0.5

    def chunk(i, carry):
        s, h = carry
        qb_i, lse_i, g_i = _slice(qb, i, c), _slice(lse, i, c), _slice(gamma, i, c)
        tile = lambda j: alpha_tile(qb_i, _slice(kb, j, c), lse_i, i * c, j * c, scale, _seg(seg, i, j, c))  # noqa: E731
        h_past = lax.fori_loop(0, i, lambda j, acc: acc + dot(tile(j), _slice(s, j, c)),
                               jnp.zeros((c, f.shape[1]), jnp.float32))
        a_ii = tile(i)
        s_i = solve_unit_lower(jnp.eye(c) - g_i * a_ii, _slice(f, i, c) + g_i * h_past)
        return _put(s, i, c, s_i), _put(h, i, c, h_past + dot(a_ii, s_i))
    return lax.fori_loop(0, qb.shape[0] // c, chunk, (jnp.zeros_like(f), jnp.zeros_like(f)))


def _backward_2d(qb, kb, lse, gamma, s, h, seg, ds, c):
    """(dqb, dkb, dgamma, df) by the reverse-time solve, last chunk first.

    After lambda_i is solved, row block i of B is recomputed once, tile by tile: it pushes
    B_ij^T lambda_i into the right-hand side of the earlier chunks j and gives dlogit_ij.
    """
    scale = qb.shape[-1] ** -0.5
    n = qb.shape[0] // c

    def chunk(step, carry):
        lam, rhs, dqb, dkb, dgamma = carry
        i = n - 1 - step
        qb_i, lse_i, g_i = _slice(qb, i, c), _slice(lse, i, c), _slice(gamma, i, c)
        a_ii = alpha_tile(qb_i, _slice(kb, i, c), lse_i, i * c, i * c, scale, _seg(seg, i, i, c))
        lam_i = solve_unit_lower(jnp.eye(c) - g_i * a_ii, _slice(ds, i, c) + _slice(rhs, i, c),
                                 transpose=True)
        dg_i = jnp.sum(lam_i * _slice(h, i, c), axis=1, keepdims=True)

        def tile(j, inner):
            rhs, dq_i, dkb = inner
            kb_j = _slice(kb, j, c)
            a = alpha_tile(qb_i, kb_j, lse_i, i * c, j * c, scale, _seg(seg, i, j, c))
            dlogit = dlogit_tile(a, g_i, dg_i, lam_i, _slice(s, j, c), scale)
            rhs = _put(rhs, j, c, _slice(rhs, j, c) + dot(g_i * a, lam_i, transpose_a=True))
            dkb = _put(dkb, j, c, _slice(dkb, j, c) + dot(dlogit, qb_i, transpose_a=True))
            return rhs, dq_i + dot(dlogit, kb_j), dkb

        # j == i adds to rhs_i, already consumed: harmless, and it keeps one loop for all tiles.
        rhs, dq_i, dkb = lax.fori_loop(0, i + 1, tile, (rhs, jnp.zeros_like(qb_i), dkb))
        return (_put(lam, i, c, lam_i), rhs, _put(dqb, i, c, dq_i), dkb, _put(dgamma, i, c, dg_i))

    init = (jnp.zeros_like(s), jnp.zeros_like(s), jnp.zeros_like(qb), jnp.zeros_like(kb),
            jnp.zeros_like(gamma))
    lam, _, dqb, dkb, dgamma = lax.fori_loop(0, n, chunk, init)
    return dqb, dkb, dgamma, lam


def _forward_blocked(qb, kb, gamma, f, seg, c):
    lse = jax.vmap(_row_lse, in_axes=(0, 0, 0, None))(qb, kb, seg, c)
    s, h = jax.vmap(_forward_2d, in_axes=(0, 0, 0, 0, 0, 0, None))(qb, kb, lse, gamma, f, seg, c)
    return s, (qb, kb, lse, gamma, s, h, seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _solve_blocked(qb, kb, gamma, f, seg, c):
    return _forward_blocked(qb, kb, gamma, f, seg, c)[0]


def _solve_blocked_bwd(c, res, ds):
    grads = jax.vmap(_backward_2d, in_axes=(0,) * 8 + (None,))(*res, ds, c)
    return (*grads, None)


_solve_blocked.defvjp(lambda *a: _forward_blocked(*a), _solve_blocked_bwd)


def pad_chunks(qb, kb, gamma, f, block_size: int):
    """fp32 copies padded along T to whole chunks; gamma as [B, Tp, 1].

    Padded keys sit after every real query, so the strict-past mask hides them; padded rows
    have gamma = 0 and f = 0, so they feed nothing back into the real rows' gradients.
    """
    t = qb.shape[1]
    c = min(block_size, t)
    pad = -t % c
    p = lambda x: jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    return p(qb), p(kb), p(gamma[..., None]), p(f), c


def solve_blocked(qb, kb, gamma, f, segment_ids=None, *, block_size: int = 256) -> jax.Array:
    """s [B, T, D] fp32 by blocked forward substitution; T need not be a multiple of block_size."""
    check_inputs(qb, kb, gamma, f, segment_ids)
    t = qb.shape[1]
    qb_p, kb_p, gamma_p, f_p, c = pad_chunks(qb, kb, gamma, f, block_size)
    seg = jnp.zeros(qb.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    seg = jnp.pad(seg, ((0, 0), (0, qb_p.shape[1] - t)))[..., None]
    return _solve_blocked(qb_p, kb_p, gamma_p, f_p, seg, c)[:, :t]


def feedback_solve(qb, kb, gamma, f, segment_ids=None, *, impl: str = "reference",
                   block_size: int = 0) -> jax.Array:
    """Dispatch to an implementation by name; s [B, T, D] fp32. `block_size` 0: the
    implementation's own (blocked 256; the kernel's per platform and widths)."""
    if impl == "reference":
        return solve_reference(qb, kb, gamma, f, segment_ids)
    if impl == "blocked":
        return solve_blocked(qb, kb, gamma, f, segment_ids, block_size=block_size or 256)
    if impl == "pallas":
        return feedback_solve_pallas(qb, kb, gamma, f, segment_ids, block=block_size or None)
    raise ValueError(f"unknown feedback solve impl {impl!r}; valid: {', '.join(IMPLEMENTATIONS)}")


# ---- recurrent decoding ------------------------------------------------------------------------
def decode_solve(kb_cache, s_cache, index, qb, kb, gamma, f):
    """Solve n new rows after `index` solved ones. Returns (s_new [B, n, D] fp32, kb_cache, s_cache).

    kb_cache [B, L, dk] and s_cache [B, L, D] hold the feedback keys and solutions of rows
    0..index-1 (zeros after). The new rows see the cached past and each other:
    s_new = (I - B_nn)^{-1} (f + B_np s_past), which for n = 1 is s_t = f_t + gamma_t alpha_t s_<t.
    """
    n, length = qb.shape[1], kb_cache.shape[1]
    kb_cache = lax.dynamic_update_slice_in_dim(kb_cache, kb.astype(kb_cache.dtype), index, axis=1)
    logits = jnp.einsum("btd,bsd->bts", qb.astype(jnp.float32), kb_cache.astype(jnp.float32),
                        precision=lax.Precision.HIGHEST) * qb.shape[-1] ** -0.5
    past = jnp.arange(length)[None, :] < index + jnp.arange(n)[:, None]
    alpha = jnp.where(past, jax.nn.softmax(jnp.where(past, logits, MASKED), axis=-1), 0.0)
    b = gamma.astype(jnp.float32)[..., None] * alpha  # [B, n, L]
    b_np = jnp.where(jnp.arange(length) < index, b, 0.0)
    r = f.astype(jnp.float32) + jnp.einsum("bts,bsd->btd", b_np, s_cache.astype(jnp.float32),
                                           precision=lax.Precision.HIGHEST)
    b_nn = lax.dynamic_slice_in_dim(b, index, n, axis=2)
    s_new = solve_unit_lower(jnp.eye(n) - b_nn, r)
    s_cache = lax.dynamic_update_slice_in_dim(s_cache, s_new.astype(s_cache.dtype), index, axis=1)
    return s_new, kb_cache, s_cache
