"""Angle arithmetic in fp32 that does not drift: wrapping into [-pi, pi) and compensated
(hi, lo) addition. Used by the accumulated SO(2) angles (positional/so2.py) and ESPR's phases."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


# 2 pi split Cody-Waite style: _TWO_PI_HI has few significant bits, so k * _TWO_PI_HI is exact
# for the small integers k seen here, and _TWO_PI_LO carries the rest.
_TWO_PI_HI = 6.28125
_TWO_PI_LO = 2 * math.pi - _TWO_PI_HI


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
