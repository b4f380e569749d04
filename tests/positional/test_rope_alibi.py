"""RoPE, its extensions and ALiBi against their definitions, with hand-computed values."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from models.registry import make_scheme
from positional.alibi import alibi_slopes
from positional.attention import reference_attention
from positional.rope import rope_angles, rope_frequencies, rotate, yarn_attention_factor


def rope_as_complex(x, positions, theta):
    """RoFormer's definition: pair (x[2i], x[2i+1]) is the complex number multiplied by e^{i p theta_i}."""
    z = x[..., 0::2] + 1j * x[..., 1::2]
    z = z * np.exp(1j * positions[..., None, None] * theta)
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


def test_interleaved_layout_is_complex_multiplication():
    x = np.random.default_rng(0).normal(size=(1, 5, 2, 8))
    pos = np.arange(5)[None] * 3
    theta = rope_frequencies(8)
    got = rotate(jnp.asarray(x, jnp.float32), rope_angles(jnp.asarray(pos), theta), "interleaved")
    np.testing.assert_allclose(got, rope_as_complex(x, pos, theta), atol=1e-5)


def test_half_layout_is_interleaved_up_to_a_permutation():
    x = normal(jax.random.key(0), (1, 6, 2, 8))
    angles = rope_angles(jnp.arange(6)[None], rope_frequencies(8))
    perm = np.array([0, 4, 1, 5, 2, 6, 3, 7])  # half -> interleaved order of the dimensions
    half = rotate(x, angles, "half")
    inter = rotate(x[..., perm], angles, "interleaved")
    np.testing.assert_allclose(half[..., perm], inter, atol=1e-6)


def rotate_by_complex_numbers(x, angles, layout):
    """The rotation as complex multiplication, differentiated by JAX's own autodiff."""
    if layout == "half":
        x1, x2 = jnp.split(x, 2, axis=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    z = (x1 + 1j * x2) * jnp.exp(1j * angles)
    if layout == "half":
        return jnp.concatenate([z.real, z.imag], axis=-1)
    return jnp.stack([z.real, z.imag], axis=-1).reshape(*z.shape[:-1], -1)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("x_shape, angle_shape", [((2, 5, 3, 8), (2, 5, 1, 4)),  # shared by heads
                                                  ((2, 5, 3, 8), (5, 1, 4)),  # shared by rows too
                                                  ((2, 5, 1, 8), (2, 5, 3, 4)),  # x broadcast
                                                  ((2, 5, 3, 8), (2, 5, 3, 4))])
def test_rotate_gradients_match_autodiff_of_the_definition(layout, x_shape, angle_shape):
    """rotate's written-out VJP (angle cotangent from the saved output) against autodiff."""
    kx, ka, kg = jax.random.split(jax.random.key(1), 3)
    x, angles = normal(kx, x_shape), normal(ka, angle_shape)
    out_shape = jnp.broadcast_shapes(x_shape[:-1], angle_shape[:-1]) + x_shape[-1:]
    g = normal(kg, out_shape)

    def loss(fn, x, angles):
        return jnp.sum(fn(x, angles, layout) * g)

    want = jax.grad(lambda x, a: loss(rotate_by_complex_numbers, x, a), (0, 1))(x, angles)
    got = jax.grad(lambda x, a: loss(rotate, x, a), (0, 1))(x, angles)
    want_y = rotate_by_complex_numbers(x, angles, layout)
    np.testing.assert_allclose(rotate(x, angles, layout), want_y, atol=1e-6)
    for w, o in zip(want, got):
        assert o.shape == w.shape
        np.testing.assert_allclose(o, w, atol=2e-5)
    # inverse=True is the rotation by -angles, gradients included.
    inverse = functools.partial(rotate, inverse=True)
    inv = jax.grad(lambda x, a: loss(inverse, x, a), (0, 1))(x, angles)
    want_inv = jax.grad(lambda x, a: loss(rotate_by_complex_numbers, x, -a), (0, 1))(x, angles)
    for w, o in zip(want_inv, inv):
        np.testing.assert_allclose(o, w, atol=2e-5)
    # bf16 input: the output and the input cotangent stay bf16, the angle cotangent fp32.
    dx, da = jax.grad(lambda x, a: jnp.sum(rotate(x, a, layout).astype(jnp.float32) * g), (0, 1))(
        x.astype(jnp.bfloat16), angles)
    assert dx.dtype == jnp.bfloat16 and da.dtype == jnp.float32
    np.testing.assert_allclose(da, want[1], atol=0.05 * float(jnp.abs(want[1]).max()))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("scaling", ["none", "pi", "ntk", "yarn"])
def test_scores_depend_on_relative_position_only(layout, scaling):
    q, k = normal(jax.random.key(1), (2, 1, 1, 1, 16))
    theta = rope_frequencies(16, scaling=scaling, factor=4.0)

    def score(m, n):
        rq = rotate(q, rope_angles(jnp.array([[m]]), theta), layout)
        rk = rotate(k, rope_angles(jnp.array([[n]]), theta), layout)
        return float(jnp.sum(rq * rk))

    for m, n in [(5, 2), (9, 0), (40, 40)]:
        assert score(m, n) == pytest.approx(score(m + 37, n + 37), abs=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 3), abs=1e-3)


def test_frequencies_by_hand():
    # D = 8, base 10^4: theta = 1, 0.1, 0.01, 0.001.
    np.testing.assert_allclose(rope_frequencies(8), [1, 0.1, 0.01, 0.001], rtol=1e-12)
    np.testing.assert_allclose(rope_frequencies(8, base=100.0), [1, 0.1 ** 0.5, 0.1, 0.1 ** 1.5])
    np.testing.assert_allclose(rope_frequencies(8, scaling="pi", factor=4), [0.25, 0.025, 0.0025, 0.00025])
    # NTK: base' = 10^4 * 4^(8/6), so theta_1 = base'^(-1/4) = 0.1 * 4^(-1/3).
    ntk = rope_frequencies(8, scaling="ntk", factor=4)
    np.testing.assert_allclose(ntk, [1, 0.1 * 4 ** (-1 / 3), 0.01 * 4 ** (-2 / 3), 0.001 / 4])
    # YaRN, L = 512, s = 4: r = 512 theta / 2pi = 81.487, 8.1487, 0.81487, 0.081487
    # gamma = clip((r - 1) / 31, 0, 1) = 1, 0.230604, 0, 0.
    gamma = (512 * 0.1 / (2 * math.pi) - 1) / 31
    assert gamma == pytest.approx(0.230604, abs=1e-6)
    np.testing.assert_allclose(rope_frequencies(8, scaling="yarn", factor=4, original_max_len=512),
                               [1, (1 - gamma) * 0.025 + gamma * 0.1, 0.0025, 0.00025], rtol=1e-12)
    assert yarn_attention_factor(4.0) == pytest.approx(1.138629, abs=1e-6)
    assert yarn_attention_factor(1.0) == 1.0


def test_ntk_keeps_highest_and_divides_lowest_frequency_by_the_factor():
    for d, s in [(64, 8.0), (128, 2.5)]:
        plain, ntk = rope_frequencies(d), rope_frequencies(d, scaling="ntk", factor=s)
        assert ntk[0] == plain[0]
        assert ntk[-1] == pytest.approx(plain[-1] / s, rel=1e-12)


def test_yarn_scales_logits_by_the_temperature():
    scheme = make_scheme("rope", num_heads=1, head_dim=8, scaling="yarn", factor=4.0)
    plain = make_scheme("rope", num_heads=1, head_dim=8, base=10000.0)
    q, k, v = normal(jax.random.key(2), (3, 1, 1, 1, 8))
    pos = jnp.zeros((1, 1), jnp.int32)  # angle 0: only the temperature differs
    qy, ky, _ = scheme.transform(q, k, v, None, pos)
    qp, kp, _ = plain.transform(q, k, v, None, pos)
    assert float(jnp.sum(qy * ky)) == pytest.approx(float(jnp.sum(qp * kp)) * 1.138629 ** 2, rel=1e-5)


def test_rope_qkv_transports_values_by_the_relative_rotation():
    """out_i = sum_j a_ij R((i - j) theta) v_j with a_ij the RoPE attention weights."""
    scheme = make_scheme("rope_qkv", num_heads=2, head_dim=8)
    plain = make_scheme("rope", num_heads=2, head_dim=8)
    q, k, v = normal(jax.random.key(3), (3, 1, 6, 2, 8))
    pos = jnp.arange(6)[None]
    got = scheme.attend(q, k, v, positions=pos)
    qr, kr, _ = plain.transform(q, k, v, None, pos)
    logits = np.einsum("bihd,bjhd->bhij", qr, kr) / math.sqrt(8)
    logits = np.where(np.tril(np.ones((6, 6), bool)), logits, -np.inf)
    a = np.exp(logits - logits.max(-1, keepdims=True))
    a /= a.sum(-1, keepdims=True)
    theta = rope_frequencies(8)
    want = np.zeros((1, 6, 2, 8))
    for i in range(6):
        for j in range(i + 1):
            vj = rotate(v[:, j:j + 1], rope_angles(jnp.array([[i - j]]), theta), "half")
            want[:, i] += a[:, :, i, j][..., None] * np.asarray(vj[:, 0])
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_alibi_slopes_by_hand():
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -k for k in range(1, 9)])
    np.testing.assert_allclose(alibi_slopes(4), [2.0 ** -k for k in (2, 4, 6, 8)])
    # Not a power of two (Press et al.): slopes of 4 heads, then every other slope of 8.
    np.testing.assert_allclose(alibi_slopes(6), [2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3])


def test_alibi_bias_is_minus_slope_times_distance():
    scheme = make_scheme("alibi", num_heads=4, head_dim=8)
    q, k, v = normal(jax.random.key(4), (3, 1, 5, 4, 8))
    dist = np.arange(5)[:, None] - np.arange(5)[None, :]
    bias = -alibi_slopes(4)[:, None, None] * dist[None]
    got = scheme.attend(q, k, v, positions=jnp.arange(5)[None])
    want = reference_attention(q, k, v, bias_fn=lambda qi, kj: jnp.asarray(bias, jnp.float32)[None])
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(scheme.bias_fn(None, None)(jnp.arange(5), jnp.arange(5))[0], bias, atol=1e-6)
    # The bias reads positions, not slots: positions 0, 2, 4, ... double every distance.
    spread = scheme.bias_fn(None, 2 * jnp.arange(5)[None])(jnp.arange(5), jnp.arange(5))[0]
    np.testing.assert_allclose(spread, 2 * bias, atol=1e-6)


def test_bad_scheme_options():
    with pytest.raises(ValueError, match="registered schemes: .*alibi.*rope"):
        make_scheme("ropee", num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="head_dim must be even"):
        make_scheme("rope", num_heads=2, head_dim=7)
    with pytest.raises(ValueError, match="options are"):
        make_scheme("rope", num_heads=2, head_dim=8, bsae=5.0)
    with pytest.raises(ValueError, match="scaling"):
        make_scheme("rope", num_heads=2, head_dim=8, scaling="linear")
    with pytest.raises(ValueError, match="layout"):
        make_scheme("rope", num_heads=2, head_dim=8, layout="odd")
    with pytest.raises(ValueError, match="fixes"):
        make_scheme("rope_qkv", num_heads=2, head_dim=8, rotate_values=False)


def test_kerple_log_bias_is_minus_r1_log_one_plus_r2_distance():
    scheme = make_scheme("kerple_log", num_heads=2, head_dim=8)
    features = {"kerple_r1": jnp.asarray([0.5, 1.5]), "kerple_r2": jnp.asarray([0.25, 0.001])}  # 0.001: clamped
    positions = jnp.asarray([[0, 1, 3, 7]])  # distances read from positions, not slots
    got = scheme.bias_fn(features, positions)(jnp.arange(4), jnp.arange(4))[0]
    d = np.maximum(np.asarray(positions[0])[:, None] - np.asarray(positions[0])[None, :], 0)
    want = [-0.5 * np.log1p(0.25 * d), -1.5 * np.log1p(0.01 * d)]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fraction,same_as", [(1.0, "rope"), (0.0, "nope")])
def test_p_rope_limits_are_rope_and_nope(fraction, same_as):
    q, k, v = normal(jax.random.key(5), (3, 2, 9, 4, 8))
    pos = jnp.broadcast_to(jnp.arange(9), (2, 9))
    got = make_scheme("p_rope", num_heads=4, head_dim=8, fraction=fraction).attend(q, k, v, positions=pos)
    want = make_scheme(same_as, num_heads=4, head_dim=8).attend(q, k, v, positions=pos)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_p_rope_keeps_the_highest_frequencies():
    theta = make_scheme("p_rope", num_heads=4, head_dim=16, fraction=0.75).theta
    np.testing.assert_array_equal(theta[:6], rope_frequencies(16)[:6])
    np.testing.assert_array_equal(theta[6:], 0.0)
    with pytest.raises(ValueError, match="fraction=1.5 must be in"):
        make_scheme("p_rope", num_heads=4, head_dim=16, fraction=1.5)


def rotate_half_by_hand(x, positions, rotary_dim, base):
    """GPT-NeoX / Phi partial rotary, written out: the first R dimensions as RoPE of head dim R
    (pairs (i, i + R/2), theta_i = base^(-2i/R)), the rest untouched."""
    r = rotary_dim
    theta = base ** (-np.arange(0, r, 2) / r)
    angle = positions[..., None, None] * theta  # [B, T, 1, R/2]
    x1, x2, rest = x[..., :r // 2], x[..., r // 2:r], x[..., r:]
    return np.concatenate([x1 * np.cos(angle) - x2 * np.sin(angle), x2 * np.cos(angle) + x1 * np.sin(angle), rest], -1)


@pytest.mark.parametrize("rotary_dim", [4, 12, 16])
def test_partial_rotary_rotates_the_first_dims_as_rope_of_that_size(rotary_dim):
    q, k, v = (np.asarray(normal(jax.random.key(i), (2, 9, 2, 16))) for i in range(3))
    pos = np.broadcast_to(np.arange(9) + 3, (2, 9))
    s = make_scheme("rope", num_heads=2, head_dim=16, rotary_dim=rotary_dim, base=500.0)
    rq, rk, rv = jax.jit(s.transform)(q, k, v, None, jnp.asarray(pos))
    np.testing.assert_allclose(rq, rotate_half_by_hand(q, pos, rotary_dim, 500.0), atol=1e-5)
    np.testing.assert_allclose(rk, rotate_half_by_hand(k, pos, rotary_dim, 500.0), atol=1e-5)
    np.testing.assert_array_equal(rv, v)
    # Relative: shifting every position leaves the attention output unchanged.
    attend = jax.jit(lambda pos: s.attend(q, k, v, positions=pos))
    np.testing.assert_allclose(attend(jnp.asarray(pos) + 100), attend(jnp.asarray(pos)), atol=1e-5)
    with pytest.raises(ValueError, match=r"^rotary_dim=5 must be an even number from 2 to head_dim=16"):
        make_scheme("rope", num_heads=2, head_dim=16, rotary_dim=5)


def test_llama4_query_temperature_by_hand_and_in_decoding():
    """nope_temperature at floor_scale 4: queries at positions 0..2 unscaled, 3..6 by 1 + 0.1 log 2,
    7..10 by 1 + 0.1 log 3 (Llama 4's floor((p + 1) / 4)); decoding equals the parallel form."""
    s = make_scheme("nope_temperature", num_heads=2, head_dim=8, floor_scale=4, attn_scale=0.1)
    pos = jnp.broadcast_to(jnp.arange(11), (1, 11))
    want = 1 + 0.1 * np.log1p(np.floor((np.arange(11) + 1) / 4))
    np.testing.assert_allclose(s.temperature(pos)[0, :, 0, 0], want, rtol=1e-6)
    assert want[2] == 1 and want[3] > 1
    q, k, v = (normal(jax.random.key(i), (1, 11, 2, 8)) for i in range(3))
    out = jax.jit(s.attend)(q, k, v, positions=pos)
    nope = make_scheme("nope", num_heads=2, head_dim=8)
    np.testing.assert_allclose(out, jax.jit(nope.attend)(q * want[None, :, None, None], k, v, positions=pos),
                               atol=1e-5)
    cache, step = s.init_cache(1, 11, 2), jax.jit(s.decode_step)
    steps = []
    for t in (slice(0, 5), *(slice(i, i + 1) for i in range(5, 11))):
        o, cache = step(cache, q[:, t], k[:, t], v[:, t])
        steps.append(o)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), out, atol=1e-5)
