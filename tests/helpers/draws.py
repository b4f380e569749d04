"""Random test inputs, drawn flat and reshaped.

XLA's compile time for a draw grows with the rank of its shape (about 0.3 s at rank 1 and
2 s at rank 4 on CPU, once per shape and dtype), and most inputs here are [B, T, H, D].
JAX's threefry is partitionable, so each number depends on its position in the flattened
array only: these draws equal `jax.random.normal(key, shape, dtype)` and
`jax.random.uniform(key, shape, dtype, minval, maxval)` value for value (checked in
`test_flat_draws_equal_shaped_draws`, in test_attention.py).
"""

import math

import jax
import jax.numpy as jnp


def normal(key, shape, dtype=jnp.float32):
    return jax.random.normal(key, (math.prod(shape),), dtype).reshape(shape)


def uniform(key, shape, dtype=jnp.float32, minval=0.0, maxval=1.0):
    return jax.random.uniform(key, (math.prod(shape),), dtype, minval, maxval).reshape(shape)
