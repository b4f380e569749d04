"""fp32 arithmetic that does not drift: exact splits of a number into leading bits and the rest,
wrapping angles into [-pi, pi), compensated (hi, lo) addition. Used by the accumulated SO(2)
angles (positional/so2.py), ESPR's phases and the per-key bias channels (positional/vendor.py).

Each is written so that what XLA on GPU does to float code cannot change it: it forms fused
multiply-adds (an exact product is unchanged by one) and drops fp32 -> bf16 -> fp32 round trips
(its excess precision), so a split masks bits instead of rounding through a narrower type."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


# 2 pi split Cody-Waite style: _TWO_PI_HI has few significant bits, so k * _TWO_PI_HI is exact
# for the small integers k seen here, and _TWO_PI_LO carries the rest.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI


def split_bits(x: jax.Array, bits: int) -> tuple[jax.Array, jax.Array]:
    """fp32 x = hi + lo exactly: hi x's leading `bits` significant bits (its bit pattern masked),
    lo the rest (at most 24 - bits significant bits). Two 12-bit halves multiply exactly in fp32."""
    keep = jnp.uint32((0xFFFFFFFF << (24 - bits)) & 0xFFFFFFFF)
    x = x.astype(jnp.float32)
    hi = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & keep, jnp.float32)
    return hi, x - hi


def _turns(angle):
    return jnp.floor(angle * (1 / (2 * math.pi)) + 0.5)


def wrap(angle: jax.Array) -> jax.Array:
    """Map angles into [-pi, pi), subtracting whole turns without a systematic error."""
    k = _turns(angle)
    return (angle - k * _TWO_PI_HI) - k * _TWO_PI_LO


def _two_sum(a, b):
    """a + b = s + e exactly (Knuth), in the input precision."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def wrapped_add(hi, lo, x):
    """(hi, lo) + x as a wrapped (hi, lo) pair, hi in [-pi, pi), no rounding error lost."""
    hi, err = _two_sum(hi, x)
    k = _turns(hi)
    return _two_sum(hi - k * _TWO_PI_HI, lo + err - k * _TWO_PI_LO)
