"""ALiBi (Press et al. 2022): a linear distance penalty added to the logits, no embedding.

b_ij = -m_h (p_i - p_j) for key j <= i (p the positions: i - j in a plain sequence), with head slopes m_h = 2^(-8h/H), h = 1..H, when H is a
power of two. Otherwise the paper's rule: the slopes of the closest smaller power of two n,
then every other slope of 2n, until H slopes.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from positional.scheme import Scheme, at_slots


def alibi_slopes(num_heads: int) -> np.ndarray:
    """Head slopes m_h, [num_heads] float64."""
    def power_of_two(n):
        return 2.0 ** (-8.0 * np.arange(1, n + 1) / n)

    n = 2 ** int(math.floor(math.log2(num_heads)))
    if n == num_heads:
        return power_of_two(n)
    return np.concatenate([power_of_two(n), power_of_two(2 * n)[0::2][: num_heads - n]])


@dataclasses.dataclass(frozen=True)
class Alibi(Scheme):
    has_bias = bias_only = True

    def bias_fn(self, features, positions):
        if positions is not None and positions.ndim != 2:
            raise ValueError(f"alibi needs one position per token, positions [B, T]; got shape "
                             f"{tuple(positions.shape)}")
        slopes = jnp.asarray(alibi_slopes(self.num_heads), jnp.float32)

        def bias(qi, kj):  # [B or 1, H, tq, tk]
            distance = (at_slots(positions, qi)[:, :, None] - at_slots(positions, kj)[:, None, :]).astype(jnp.float32)
            return -slopes[None, :, None, None] * distance[:, None]

        return bias
