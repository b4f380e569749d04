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

from positional.logits import Bias
from positional.scheme import Scheme, position_values


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
        slopes = jnp.asarray(alibi_slopes(self.num_heads), jnp.float32)[None, None]  # [1, 1, H]

        def bias(q, k, qi, kj):
            return -q["slope"] * (q.get("position", qi) - k.get("position", kj))

        return Bias(bias, {"slope": slopes, **position_values(positions)},
                    key=lambda k, kj: k["slope"] * k.get("position", kj),  # per key: m p_j
                    key_bound=lambda length: float(alibi_slopes(self.num_heads).max()) * (length - 1))
