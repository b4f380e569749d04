"""positional/attention.py: reference against a loop over (b, h, i, j), blockwise against reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from positional.attention import attention, blockwise_attention, reference_attention


def naive(q, k, v, bias=None, segment_ids=None, q_offset=0):
    """Softmax attention written as loops, in float64: the definition, nothing clever."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    out = np.zeros((b, t, h, d))
    for bi in range(b):
        for hi in range(h):
            kv = hi // (h // kh)
            for i in range(t):
                qi = q_offset + i
                js = [j for j in range(s_len) if j <= qi and
                      (segment_ids is None or segment_ids[bi, i] == segment_ids[bi, j])]
                logits = np.array([q[bi, i, hi] @ k[bi, j, kv] / np.sqrt(d) +
                                   (0 if bias is None else bias[bi % bias.shape[0], hi, i, j]) for j in js])
                p = np.exp(logits - logits.max())
                out[bi, i, hi] = (p / p.sum()) @ v[bi, js, kv]
    return out


def inputs(key, b=2, t=11, h=4, kh=2, d=8, s=None, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(key, 3)
    s = s or t
    return (normal(kq, (b, t, h, d), dtype), normal(kk, (b, s, kh, d), dtype),
            normal(kv, (b, s, kh, d), dtype))


# Jitted: called eagerly, every op compiles on its own. (test_bad_inputs calls the library.)
reference = jax.jit(reference_attention, static_argnames=("bias_fn", "q_offset"))


SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 0]])


def random_bias(qi, kj):
    # A bias that depends on both indices and the head, not only on i - j.
    h = jnp.arange(4)[:, None, None]
    return jnp.sin(0.3 * qi[None, :, None] + 0.7 * kj[None, None, :] + h)[None]


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_segments", [False, True])
def test_reference_matches_loops(with_bias, with_segments):
    q, k, v = inputs(jax.random.key(0))
    seg = jnp.asarray(SEGMENTS) if with_segments else None
    bias_fn = random_bias if with_bias else None
    got = reference(q, k, v, bias_fn=bias_fn, segment_ids=seg)
    bias = np.asarray(random_bias(jnp.arange(11), jnp.arange(11))) if with_bias else None
    np.testing.assert_allclose(got, naive(q, k, v, bias, SEGMENTS if with_segments else None),
                               atol=1e-5)


def test_reference_with_offset_matches_loops():
    """Decoding: 3 queries at indices 5..7 against a cache of 9 keys (the last one unwritten)."""
    q, _, _ = inputs(jax.random.key(1), t=3)
    _, k, v = inputs(jax.random.key(2), t=9)
    got = reference(q, k, v, q_offset=5)
    np.testing.assert_allclose(got, naive(q, k, v, q_offset=5), atol=1e-5)


@pytest.mark.parametrize("t,block", [(11, 4), (16, 8), (7, 16), (33, 8)])
@pytest.mark.parametrize("with_segments", [False, True])
def test_blockwise_equals_reference_values_and_gradients(t, block, with_segments):
    q, k, v = inputs(jax.random.key(t), t=t)
    seg = None
    if with_segments:
        seg = jnp.asarray(np.sort(np.random.default_rng(t).integers(1, 4, size=(2, t)), axis=1))

    def loss(fn, q, k, v):
        out = fn(q, k, v, bias_fn=random_bias, segment_ids=seg)
        return jnp.sum(out * jnp.cos(out)), out

    def value_and_grads(fn):
        return jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), (0, 1, 2), has_aux=True))(q, k, v)

    (_, ref), g_ref = value_and_grads(reference_attention)
    (_, blk), g_blk = value_and_grads(functools.partial(blockwise_attention, block_size=block))
    np.testing.assert_allclose(blk, ref, atol=2e-5)
    for a, b in zip(g_blk, g_ref):
        np.testing.assert_allclose(a, b, atol=2e-5)


def test_blockwise_with_offset():
    q, _, _ = inputs(jax.random.key(3), t=5)
    _, k, v = inputs(jax.random.key(4), t=20)
    blk = jax.jit(functools.partial(blockwise_attention, q_offset=12, block_size=4))
    np.testing.assert_allclose(blk(q, k, v), reference(q, k, v, q_offset=12), atol=2e-5)


def test_bf16_inputs_accumulate_in_fp32():
    q, k, v = inputs(jax.random.key(5), t=64, dtype=jnp.bfloat16)
    for impl in ("reference", "blockwise"):
        out = jax.jit(attention, static_argnames=("impl", "block_size"))(q, k, v, impl=impl, block_size=16)
        assert out.dtype == jnp.bfloat16
        exact = naive(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
        np.testing.assert_allclose(np.asarray(out, np.float32), exact, atol=2e-2)


def test_bad_inputs():
    q, k, v = inputs(jax.random.key(6))
    with pytest.raises(ValueError, match="valid"):
        attention(q, k, v, impl="flash9")
    with pytest.raises(ValueError, match="multiple"):
        reference_attention(q[:, :, :3], k, v)
    with pytest.raises(ValueError, match="head_dim"):
        reference_attention(q[..., :4], k, v)
    with pytest.raises(ValueError, match="segment_ids"):
        reference_attention(q, k, v, segment_ids=jnp.zeros((2, 5), jnp.int32))


def test_flat_draws_equal_shaped_draws():
    """The test inputs of tests/helpers/draws.py (drawn flat, then reshaped) are jax.random's own draws."""
    from helpers import draws
    key = jax.random.key(0)
    np.testing.assert_array_equal(draws.normal(key, (2, 3, 4), jnp.bfloat16),
                                  jax.random.normal(key, (2, 3, 4), jnp.bfloat16))
    np.testing.assert_array_equal(draws.uniform(key, (3, 2, 2), minval=-1.0, maxval=2.0),
                                  jax.random.uniform(key, (3, 2, 2), minval=-1.0, maxval=2.0))
