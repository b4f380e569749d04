"""KERPLE-log (Chi et al. 2022, "KERPLE: Kernelized Relative Positional Embedding for Length
Extrapolation"): a learned logarithmic distance penalty added to the logits, no embedding.

b_ij = -r1_h log(1 + r2_h (p_i - p_j)) for key j <= i (p the positions), with r1_h, r2_h > 0
learned per head: the logarithmic variant of the paper's conditionally positive definite
kernels, its best on extrapolation. As in the authors' code, r1 starts ~ U(0, 2), r2 ~ U(0, 1),
and both are clamped to >= 0.01 where used (the constraint r > 0 as a projection).

features = {'kerple_r1': [H], 'kerple_r2': [H]} float32: its learned parameters
(`init_parameters`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from positional.logits import Bias
from positional.scheme import Scheme, position_values

R_MIN = 0.01


@dataclasses.dataclass(frozen=True)
class KerpleLog(Scheme):
    has_bias = bias_only = needs_features = has_parameters = default_key = True

    def init_parameters(self, keys, model) -> dict:
        """r1 ~ U(0, 2), r2 ~ U(0, 1) per head (before the clamp)."""
        k1, k2 = jax.random.split(keys())
        return {"kerple_r1": jax.random.uniform(k1, (self.num_heads,), jnp.float32, 0.0, 2.0),
                "kerple_r2": jax.random.uniform(k2, (self.num_heads,), jnp.float32, 0.0, 1.0)}

    def bias_fn(self, features, positions):
        r = {name: jnp.maximum(features[name].astype(jnp.float32), R_MIN)[None, None] for name in ("kerple_r1", "kerple_r2")}

        def bias(q, k, qi, kj):
            # Keys after the query are masked; the clamp keeps their log finite.
            distance = jnp.maximum(q.get("position", qi) - k.get("position", kj), 0)
            return -q["kerple_r1"] * jnp.log1p(q["kerple_r2"] * distance)

        return Bias(bias, {**r, **position_values(positions)})
