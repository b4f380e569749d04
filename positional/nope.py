"""NoPE: no position information at all; the causal mask is the only source of order.

`TemperedNoPE` is Llama 4's global NoPE layer with its query temperature
(`attn_temperature_tuning`): each query is scaled by

    1 + attn_scale * log(1 + floor((p + 1) / floor_scale))

at its position p, so attention sharpens slowly as the context grows past floor_scale tokens
(1 up to floor_scale - 1). A per-query scale of q, so every attention implementation takes it
unchanged, decoding included; it reads absolute positions, so it is not relative.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from positional.scheme import Scheme


@dataclasses.dataclass(frozen=True)
class NoPE(Scheme):
    pass


@dataclasses.dataclass(frozen=True)
class TemperedNoPE(NoPE):
    floor_scale: int = 8192  # Llama 4's
    attn_scale: float = 0.1

    relative = False

    def __post_init__(self):
        super().__post_init__()
        if self.floor_scale < 1:
            raise ValueError(f"nope_temperature floor_scale={self.floor_scale} must be >= 1 (tokens per step of "
                             "the query temperature)")

    def temperature(self, positions) -> jnp.ndarray:
        """The query scale at positions [B, T]: [B, T, 1, 1] fp32."""
        steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / self.floor_scale)
        return (1.0 + self.attn_scale * jnp.log1p(steps))[..., None, None]

    def transform(self, q, k, v, features, positions):
        return (q.astype(jnp.float32) * self.temperature(positions)).astype(q.dtype), k, v
