"""PaTH's transport algebra (positional/path/__init__.py): Householder steps, the UT transform,
chunks' products and the keys carried to the end; the checks of w and beta."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from positional.linalg import unit_lower_inverse

HIGHEST = jax.lax.Precision.HIGHEST


def check_transport(k, w, beta) -> None:
    """Shapes always; beta's range [0, 2] where its values are known (not under jit)."""
    if w.shape != k.shape:
        raise ValueError(f"Householder vectors w{w.shape} must have the keys' shape k{k.shape}")
    if beta.shape != k.shape[:3]:
        raise ValueError(f"Householder gains beta{beta.shape} must be [B, T, K] = {k.shape[:3]}")
    if not isinstance(beta, jax.core.Tracer) and not bool(jnp.all((beta >= 0) & (beta <= 2))):
        raise ValueError(f"Householder gains must lie in [0, 2] (H = I - beta w w^T is then a contraction); "
                         f"got beta in [{float(beta.min())}, {float(beta.max())}]")


# ---- steps ------------------------------------------------------------------------------------

def householder_matrices(w, beta) -> jax.Array:
    """H_t = I - beta_t w_t w_t^T: w [..., D], beta [...] -> [..., D, D] fp32."""
    w = w.astype(jnp.float32)
    return jnp.eye(w.shape[-1]) - beta[..., None, None] * w[..., :, None] * w[..., None, :]

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


def route_terms(q, k, w, u):
    """The pieces of q_i^T (I - W_r^T U_r W_r) k_j for all routes r = (j, i] inside one range.

    q [..., n, D]; k, w [..., n, D]; u [..., n, n] (leading axes broadcast) -> (qw masked to
    s <= i, wk masked to t > j), each [..., n, n]; the route term of (i, j) is (qw @ u @ wk)[i, j].
    """
    n = w.shape[-2]
    i = jnp.arange(n)
    qw = jnp.matmul(q, jnp.swapaxes(w, -1, -2), precision=HIGHEST) * (i[None, :] <= i[:, None])
    wk = jnp.matmul(w, jnp.swapaxes(k, -1, -2), precision=HIGHEST) * (i[:, None] > i[None, :])
    return qw, wk


# ---- chunks ------------------------------------------------------------------------------------

def to_chunks(x, c, pad_value=0, n=None):
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


def carry_to_chunk_end(k, w, u):
    """Keys k [..., c, D] carried to the end of their chunk, and u @ wk (the route terms' right half)."""
    _, wk = route_terms(k, k, w, u)
    uk = jnp.matmul(u, wk, precision=HIGHEST)
    return k - jnp.matmul(jnp.swapaxes(uk, -1, -2), w, precision=HIGHEST), uk


def dense_product(w, u) -> jax.Array:
    """I - W^T U W as a D x D matrix: w [..., c, D], u [..., c, c] -> [..., D, D]."""
    return jnp.eye(w.shape[-1]) - jnp.einsum("...sd,...st,...te->...de", w, u, w, precision=HIGHEST)


def chunk_products(w, beta, chunk: int) -> jax.Array:
    """Dense products of whole chunks P_c = H_{last} ... H_{first}: w [B, T, K, D] -> [B, N, K, D, D]."""
    wc = jnp.moveaxis(to_chunks(w.astype(jnp.float32), chunk), 3, 2)  # [B, N, K, c, D]
    return dense_product(wc, ut_matrix(wc, jnp.moveaxis(to_chunks(beta, chunk), 3, 2)))


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
    kc = jnp.moveaxis(to_chunks(k.astype(jnp.float32), chunk), 3, 2)  # [B, N, K, c, D]
    wc = jnp.moveaxis(to_chunks(w.astype(jnp.float32), chunk), 3, 2)
    u = ut_matrix(wc, jnp.moveaxis(to_chunks(beta, chunk), 3, 2))
    to_chunk_end, _ = carry_to_chunk_end(kc, wc, u)
    after = exclusive_products(dense_product(wc, u), 1, reverse=True)  # P_{N-1} ... P_{c+1} [B, N, K, D, D]
    out = jnp.einsum("bnkde,bnkce->bnkcd", after, to_chunk_end, precision=HIGHEST)
    return jnp.moveaxis(out, 2, 3).reshape(b, -1, kh, d)[:, :t]
