"""Mechanistic probes of accumulated transport (the accumulated-transformations paper's future
work): spectral gap of the steps, decay of the mean route with its length, attention mass by
distance, far mass, and value-side cancellation.

All pure functions on arrays a model produced (see `models.lm.attention_internals`):
psi, theta [B, T, nb] (SO(2) step angles and their prefix), attention weights a [B, H, T, T]
(rows sum to one over the causal past), values v [B, T, H, D] (before any transport).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from positional.rope import rotate


def spectral_gap(psi: jnp.ndarray) -> jnp.ndarray:
    """beta_b = ||E[R(psi_b)]||_op = |E exp(i psi_b)| per block, over all tokens: [nb].

    For i.i.d. steps E[P_n] = (E M)^n, so routes of n steps lose all but beta^n of their mean:
    beta < 1 is the paper's spectral-gap condition, per block.
    """
    psi = psi.reshape(-1, psi.shape[-1]).astype(jnp.float32)
    return jnp.hypot(jnp.cos(psi).mean(0), jnp.sin(psi).mean(0))


def route_decay(theta: jnp.ndarray, lengths) -> jnp.ndarray:
    """||E[P_n]||_op per block for routes of n steps, P = R(Theta_j - Theta_i), i - j = n.

    theta [B, T, nb] -> [len(lengths), nb]; the operator norm of the block-diagonal mean is
    the max over blocks. The expectation runs over every (batch, query) pair with i >= n.
    """
    theta = theta.astype(jnp.float32)
    out = []
    for n in lengths:
        d = theta[:, n:] - theta[:, :-n] if n else jnp.zeros_like(theta)
        d = d.reshape(-1, d.shape[-1])
        out.append(jnp.hypot(jnp.cos(d).mean(0), jnp.sin(d).mean(0)))
    return jnp.stack(out)


def mass_by_distance(weights: jnp.ndarray) -> jnp.ndarray:
    """Mean attention weight on the key at distance d = i - j, over heads and queries: [T]."""
    t = weights.shape[-1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    dist = jnp.where(j <= i, i - j, t)  # future keys go to an overflow bin
    total = jnp.zeros(t + 1).at[dist.ravel()].add(weights.mean((0, 1)).ravel())
    count = jnp.zeros(t + 1).at[dist.ravel()].add(1.0)
    return (total / jnp.maximum(count, 1))[:t]


def far_mass(weights: jnp.ndarray, window: int) -> jnp.ndarray:
    """rho_D: attention mass on keys at distance >= window, averaged over queries i >= window."""
    t = weights.shape[-1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    far = (i - j >= window).astype(weights.dtype)
    per_query = (weights * far).sum(-1)  # [B, H, T]
    return per_query[..., window:].mean()


def value_cancellation(weights, v, theta, window: int, layout: str = "half") -> dict:
    """Norm of the far contribution sum_{i-j>=w} a_ij P_{j->i} v_j with and without transport.

    P_{j->i} = R(Theta_j - Theta_i) (the Q/K/V variant's value route). The ratio
    transported / identity below 1 is the paper's value-side decoherence: far values that
    arrive with scrambled phases cancel instead of adding up.
    """
    t = weights.shape[-1]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    a = weights * (i - j >= window)
    vt = jnp.moveaxis(v, 2, 1).astype(jnp.float32)  # [B, H, T, D]
    plain = jnp.einsum("bhij,bhjd->bhid", a, vt)
    pre = jnp.moveaxis(rotate(v, theta[:, :, None], layout), 2, 1).astype(jnp.float32)
    moved = jnp.einsum("bhij,bhjd->bhid", a, pre)
    moved = jnp.moveaxis(rotate(jnp.moveaxis(moved, 1, 2), -theta[:, :, None], layout), 2, 1)
    norm = lambda x: jnp.linalg.norm(x[:, :, window:], axis=-1).mean()  # noqa: E731
    return {"identity": norm(plain), "transported": norm(moved),
            "ratio": norm(moved) / jnp.maximum(norm(plain), 1e-30)}


def householder_spectral_gap(w: jnp.ndarray, beta: jnp.ndarray) -> jnp.ndarray:
    """||E[H_t]||_op with H_t = I - beta_t w_t w_t^T, over all tokens, per kv head: [K].

    w [B, T, K, D], beta [B, T, K]. E[H] = I - E[beta w w^T] is symmetric, so its operator
    norm is its largest |eigenvalue|: below 1 iff the gained directions span R^D.
    """
    w, beta = w.astype(jnp.float32), beta.astype(jnp.float32)
    mean = jnp.eye(w.shape[-1]) - jnp.einsum("btk,btkd,btke->kde", beta, w, w) / (w.shape[0] * w.shape[1])
    return jnp.abs(jnp.linalg.eigvalsh(mean)).max(-1)


def householder_route_decay(w: jnp.ndarray, beta: jnp.ndarray, lengths) -> jnp.ndarray:
    """||E[P_n]||_op for routes of n steps, P_n = H_{s+n} ... H_{s+1}, per kv head: [len(lengths), K].

    The mean runs over every start s with s + n < T (and the batch); the routes of all starts
    grow together, one left product per step, so memory is [B, T, K, D, D].
    """
    w, beta = w.astype(jnp.float32), beta.astype(jnp.float32)
    b, t, kh, d = w.shape
    eye = jnp.eye(d)

    def grow(p, n):  # p[:, s] = P_{n-1} starting after s; multiply by H_{s+n}
        ws, bs = jnp.roll(w, -n, axis=1), jnp.roll(beta, -n, axis=1)
        p = p - bs[..., None, None] * ws[..., :, None] * jnp.einsum("btkd,btkde->btke", ws, p)[..., None, :]
        valid = (jnp.arange(t) + n < t)[None, :, None, None, None]
        mean = jnp.where(valid, p, 0.0).sum((0, 1)) / (b * jnp.maximum(t - n, 1))
        return p, jnp.linalg.norm(mean, ord=2, axis=(-2, -1))

    _, norms = jax.lax.scan(grow, jnp.broadcast_to(eye, (b, t, kh, d, d)), jnp.arange(1, max(lengths) + 1))
    return norms[jnp.asarray(lengths) - 1]
