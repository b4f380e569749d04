"""Small dense linear algebra built from matmuls only, for the triangular systems of PaTH's UT
transform (positional/path/transport.py) and Sessa's feedback solve (positional/feedback.py), and
the per-token matrix exponentials of relaxed ESPR (positional/espr.py: jax.scipy.linalg.expm
solves a Pade system by LAPACK, and vmapped over the tokens of a training step it hung on this
2-core machine, jaxlib 0.10.2, every XLA pool thread idle and the main thread waiting to launch
a computation; by matmuls the same steps run).

Why not `lax.linalg.triangular_solve`: on CPU it calls LAPACK, whose batched form shares XLA's
intra-op thread pool; two such calls running at once can each wait for pool threads the other
holds, and the program hangs (reproduced with jaxlib 0.10 on a 2-core machine, with and without
--xla_cpu_multi_thread_eigen=false). Matmuls have no such path, batch well, and lower to any
backend. The doubling inverse costs O(n^3) like the solve; its rounding is that of a product of
log2(n) well-scaled triangular factors, fine for the unit-diagonal, bounded systems used here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

HIGHEST = jax.lax.Precision.HIGHEST

def unit_lower_inverse(m) -> jax.Array:
    """Inverse of unit-lower-triangular m [..., n, n], by doubling the inverted diagonal blocks:
    [[A, 0], [C, B]]^-1 = [[A^-1, 0], [-B^-1 C A^-1, B^-1]]. Matmuls only, log2(n) rounds;
    n is padded to a power of two with an identity block."""
    n = m.shape[-1]
    p = 1 << max(n - 1, 0).bit_length()
    pad = jnp.diag(jnp.arange(p) >= n).astype(m.dtype)
    m = jnp.pad(m, [(0, 0)] * (m.ndim - 2) + [(0, p - n)] * 2) + pad
    inv = jnp.ones(m.shape[:-2] + (p, 1, 1), m.dtype)  # the inverted diagonal blocks, size 1
    s = 1
    while s < p:
        blocks = m.reshape(*m.shape[:-2], p // (2 * s), 2, s, p // (2 * s), 2, s)
        # c: the lower-left s x s block of every 2s x 2s diagonal block, [..., p / 2s, s, s]
        c = jnp.moveaxis(jnp.diagonal(blocks[..., 1, :, :, 0, :], axis1=-4, axis2=-2), -1, -3)
        a, b = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        low = -jnp.matmul(b, jnp.matmul(c, a, precision=HIGHEST), precision=HIGHEST)
        top = jnp.concatenate([a, jnp.zeros_like(a)], -1)
        inv = jnp.concatenate([top, jnp.concatenate([low, b], -1)], -2)
        s *= 2
    return inv[..., 0, :n, :n]


def solve_unit_lower(m, b, transpose: bool = False) -> jax.Array:
    """x with m x = b (or m^T x = b): m [..., n, n] unit lower triangular, b [..., n, k]."""
    inv = unit_lower_inverse(m)
    if transpose:
        inv = jnp.swapaxes(inv, -1, -2)
    return jnp.matmul(inv, b, precision=HIGHEST)


def expm(a, max_squarings: int = 16, order: int = 12) -> jax.Array:
    """exp(a) for square a [..., n, n]: scaling and squaring around a Taylor polynomial, matmuls only.

    Each matrix is scaled by 2^-s with s = ceil(log2 |a|_1) clipped to [0, max_squarings], so
    |a 2^-s|_1 <= 1 (for |a|_1 <= 2^max_squarings) and the Taylor remainder of degree `order`
    = 12 is below 1/13! = 1.6e-10; then squared s times. The count differs per matrix: a
    squaring round runs while any matrix still needs one (`lax.cond` skips the rest; under vmap
    it becomes a select and computes them all), and keeps the others as they are.
    """
    n = a.shape[-1]
    norm = jnp.abs(a).sum(-2).max(-1)  # the 1-norm (max column sum), [...]
    s = jax.lax.stop_gradient(jnp.clip(jnp.ceil(jnp.log2(jnp.maximum(norm, 1e-30))), 0, max_squarings))
    x = a * jnp.exp2(-s)[..., None, None]
    eye = jnp.eye(n, dtype=a.dtype)
    r = eye + x / order  # Horner: I + x (I + x/2 (I + ... (I + x/order)))
    for k in range(order - 1, 0, -1):
        r = eye + jnp.matmul(x, r, precision=HIGHEST) / k
    most = jnp.max(s, initial=0)
    for j in range(max_squarings):
        r = jax.lax.cond(j < most, lambda r, j=j: jnp.where((j < s)[..., None, None],
                                                            jnp.matmul(r, r, precision=HIGHEST), r),
                         lambda r: r, r)
    return r
