"""T5's relative position bias (Raffel et al. 2020, "Exploring the Limits of Transfer Learning
with a Unified Text-to-Text Transformer"), in its causal (decoder) form: a learned table of one
number per head and bucket, added to the logits, no embedding.

b_ij = table[h, bucket(p_i - p_j)], with buckets of the distance d = max(p_i - p_j, 0): one per
distance below num_buckets / 2, then log-spaced up to `max_distance`, every longer distance in
the last bucket (the bucketing of the authors' code and of transformers' T5Attention with
bidirectional=False). The table starts at 0 (the model starts position-free and learns it).

features = {'t5_table': [H, num_buckets]} float32: its learned parameters (`init_parameters`),
read in every implementation, the fused kernel included, by `positional.logits.lookup`.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from positional.logits import Bias, lookup
from positional.scheme import Scheme, position_values


def bucket(distance, num_buckets: int, max_distance: int):
    """The bucket [int32] of distances >= 0 (fp32 or int), as T5's decoder computes it."""
    exact = num_buckets // 2
    d = jnp.maximum(jnp.asarray(distance, jnp.float32), 0.0)
    # max(d, exact): no log of 0 on the exact side, which the where discards
    far = exact + (jnp.log(jnp.maximum(d, exact) / exact) / math.log(max_distance / exact)
                   * (num_buckets - exact)).astype(jnp.int32)
    return jnp.where(d < exact, d.astype(jnp.int32), jnp.minimum(far, num_buckets - 1))


@dataclasses.dataclass(frozen=True)
class T5Bias(Scheme):
    num_buckets: int = 32
    max_distance: int = 128
    has_bias = bias_only = needs_features = has_parameters = True

    def __post_init__(self):
        super().__post_init__()
        if not 2 <= self.num_buckets // 2 < self.max_distance:
            raise ValueError(f"T5 bias needs 4 <= num_buckets and num_buckets / 2 < max_distance; got "
                             f"num_buckets={self.num_buckets}, max_distance={self.max_distance}")

    def init_parameters(self, keys, model) -> dict:
        keys()  # a draw it does not use (the table starts at 0): the model's later draws stay those of sweep.md's runs
        return {"t5_table": jnp.zeros((self.num_heads, self.num_buckets), jnp.float32)}

    def bias_fn(self, features, positions):
        def bias(q, k, qi, kj):
            distance = q.get("position", qi) - k.get("position", kj)
            return lookup(q["t5_table"], bucket(distance, self.num_buckets, self.max_distance))

        table = jnp.asarray(features["t5_table"], jnp.float32)[None]  # [1, H, n]
        return Bias(bias, position_values(positions), tables={"t5_table": table})
