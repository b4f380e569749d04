"""TAPA, token-aware phase attention (Wang et al. 2025, eq. 12), and its linear-phase ablation.

Each head vector is split into an amplitude part (the first n_A = theta * D coordinates) and
a phase part (the last n_P = D - n_A). The logit of query i against key j is

    L_ij = c_A (q_A . k_A) * cos(2 pi |i - j|^alpha * c_P phi_ij),   c_A = n_A^-1/2, c_P = n_P^-1/2

with the quadratic phase phi_ij = q_P . k_P (the paper's choice) or the linear phase of the
ablation (eq. 16), phi_ij = sum(q_P) + sum(k_P): the paper writes (q^T, k^T) 1 / sqrt(n_P), which
we read as the sum of the phase coordinates of q and of k. The linear phase is a dot product of
augmented vectors, (sum q_P, 1) . (1, sum k_P), so one kernel serves both.

RoPE is removed: q and k are not rotated, the logit depends only on (q_i, k_j, |i - j|), so the
decode cache holds raw keys and values, their positions being the cache indices. |i - j| is
taken on attention indices, which differ from token positions only by a per-segment constant.
The phase (S_P, |i - j|^alpha and the cosine) is fp32 whatever the input dtype.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from positional.kernels.flash import fused_attention
from positional.logits import Score
from positional.scheme import Scheme

PHASES = ("quadratic", "linear")


def split_dims(head_dim: int, theta: float) -> tuple[int, int]:
    """(n_A, n_P): amplitude and phase dimensions; both must be non-empty."""
    if not 0.0 < theta < 1.0:
        raise ValueError(f"tapa theta must be in (0, 1) (the amplitude share of head_dim); got theta={theta}")
    n_amp = round(theta * head_dim)
    if not 0 < n_amp < head_dim:
        raise ValueError(f"tapa theta={theta} with head_dim={head_dim} leaves an empty "
                         f"{'amplitude' if n_amp == 0 else 'phase'} part ({n_amp} of {head_dim} dims "
                         "are amplitude); choose theta or head_dim so both parts are non-empty")
    return n_amp, head_dim - n_amp


def check_options(alpha: float, phase: str) -> None:
    if not alpha > 0:
        raise ValueError(f"tapa alpha must be > 0 (the distance exponent |i-j|^alpha); got alpha={alpha}")
    if phase not in PHASES:
        raise ValueError(f"tapa phase must be one of {PHASES}; got phase={phase!r}")


def distance_power(qi, kj, alpha: float) -> jax.Array:
    """|i - j|^alpha fp32, 0 on the diagonal, for query slots qi [n, 1] and key slots kj [1, m]."""
    d = jnp.abs(qi - kj).astype(jnp.float32)
    return jnp.where(d > 0, jnp.exp(alpha * jnp.log(jnp.maximum(d, 1.0))), 0.0)


def split_qk(q, k, theta: float, phase: str = "quadratic"):
    """(q_A, k_A, q_P, k_P, c_A, c_P) with L = c_A (q_A.k_A) cos(2 pi r^alpha c_P (q_P.k_P)).

    q [..., D], k [..., D]. For the linear phase q_P, k_P are the augmented 2-vectors, fp32.
    """
    n_amp, n_phase = split_dims(q.shape[-1], theta)
    qa, qp = q[..., :n_amp], q[..., n_amp:]
    ka, kp = k[..., :n_amp], k[..., n_amp:]
    if phase == "linear":
        ones = jnp.ones(qp.shape[:-1] + (1,), jnp.float32)
        qp = jnp.concatenate([qp.astype(jnp.float32).sum(-1, keepdims=True), ones], -1)
        ones = jnp.ones(kp.shape[:-1] + (1,), jnp.float32)
        kp = jnp.concatenate([ones, kp.astype(jnp.float32).sum(-1, keepdims=True)], -1)
    return qa, ka, qp, kp, n_amp ** -0.5, n_phase ** -0.5


def tapa_score_fn(head_dim: int, alpha: float = 0.1, theta: float = 0.5, phase: str = "quadratic") -> Score:
    """TAPA's logit as a `Score`: parts (q_A, q_P), (k_A, k_P) and their combination."""
    check_options(alpha, phase)
    n_amp, n_phase = split_dims(head_dim, theta)
    c_amp, phase_scale = n_amp ** -0.5, 2 * math.pi * n_phase ** -0.5

    def split(q, k):
        qa, ka, qp, kp, _, _ = split_qk(q, k, theta, phase)
        return (qa, qp), (ka, kp)

    def score(dots, qi, kj):
        return c_amp * dots[0] * jnp.cos(phase_scale * distance_power(qi, kj, alpha) * dots[1])

    return Score(split, score)


def tapa_attention(q, k, v, *, alpha: float = 0.1, theta: float = 0.5, phase: str = "quadratic",
                   **kernel_options) -> jax.Array:
    """TAPA causal attention by the fused kernel (positional/kernels/flash.py) with TAPA's score,
    with the signature of the reference: q [B, T, H, D]; k, v [B, S, K, D] -> [B, T, H, D].
    kernel_options: those of `fused_attention` (segment_ids, q_offset, tiles, interpret, ...)."""
    return fused_attention(q, k, v, score_fn=tapa_score_fn(q.shape[-1], alpha, theta, phase), **kernel_options)


@dataclasses.dataclass(frozen=True)
class Tapa(Scheme):
    alpha: float = 0.1
    theta: float = 0.5
    phase: str = "quadratic"  # "quadratic" (eq. 10) | "linear" (the eq. 16 ablation)

    has_score = True

    def __post_init__(self):
        super().__post_init__()
        check_options(self.alpha, self.phase)
        split_dims(self.head_dim, self.theta)

    def score_fn(self, features):
        return tapa_score_fn(self.head_dim, self.alpha, self.theta, self.phase)
