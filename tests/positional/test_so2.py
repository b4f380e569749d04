"""Accumulated SO(2) transport against its definitions and the paper's closed forms."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal, uniform
from models.registry import make_scheme
from positional import so2
from positional.rope import rope_frequencies
from lab.state import model_config


def reference_theta(psi, segment_ids):
    """Exclusive per-segment cumsum in float64 NumPy, wrapped into [-pi, pi)."""
    psi = np.asarray(psi, np.float64)
    theta = np.zeros_like(psi)
    for b in range(psi.shape[0]):
        run = np.zeros(psi.shape[2])
        for t in range(psi.shape[1]):
            if t == 0 or segment_ids[b, t] != segment_ids[b, t - 1]:
                run = np.zeros(psi.shape[2])
            theta[b, t] = run
            run = run + psi[b, t]
    return np.mod(theta + np.pi, 2 * np.pi) - np.pi


def angle_error(a, b):
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return np.abs(np.mod(d + np.pi, 2 * np.pi) - np.pi).max()


def test_accumulate_is_the_exclusive_segment_reset_prefix():
    psi = uniform(jax.random.key(0), (2, 9, 3), minval=-2, maxval=2)
    seg = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    theta = so2.accumulate(psi, jnp.asarray(seg))
    assert angle_error(theta, reference_theta(psi, seg)) < 1e-6
    assert np.all(np.asarray(theta)[0, [0, 3, 5]] == 0)  # each document starts untransported
    assert float(jnp.abs(theta).max()) <= math.pi
    # Gradient: d Theta_i / d psi_t = 1 for t < i in the same segment (wrapping has slope 1),
    # so psi_t receives the sum of the cotangents of the later tokens of its segment.
    g = np.asarray(normal(jax.random.key(1), (2, 9, 3)), np.float64)
    later = (np.arange(9)[None, :, None] > np.arange(9)[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    want = np.einsum("bit,bin->btn", later, g)  # later[b, i, t]: token i comes after t, same document
    got = jax.jit(jax.grad(lambda p: jnp.sum(so2.accumulate(p, jnp.asarray(seg)) * g)))(psi)
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_angles_at_65536_tokens_match_float64(dtype):
    """With RoPE's drift (up to 1 rad per token) Theta reaches ~6.5e4 rad; wrapping keeps it exact."""
    t, nb = 65536, 8
    f = rope_frequencies(2 * nb)
    noise = np.random.default_rng(0).uniform(-1, 1, (1, t, nb)) * f
    psi = jnp.asarray(f + noise, dtype)  # what the model would hand over in that dtype
    theta = jax.jit(so2.accumulate)(psi)
    exact = reference_theta(np.asarray(psi.astype(jnp.float32)), np.ones((1, t), int))
    assert angle_error(theta, exact) < 1e-4


@pytest.mark.parametrize("a", [0.3, 1.0])
def test_first_moment_decays_as_sinc_power(a):
    """E[cos Theta_n] = (sin a / a)^n for i.i.d. Uniform(-a, a) steps (notes, Sec. 4)."""
    n_samples, n_max = 20000, 12
    index = jnp.broadcast_to(jnp.arange(n_max + 1), (n_samples, n_max + 1))
    psi = so2.uniform_steps(jax.random.key(1), index, jnp.full((1,), a))
    cos = np.cos(np.asarray(so2.accumulate(psi)[..., 0], np.float64))
    for n in (1, 3, 6, 12):
        want = (math.sin(a) / a) ** n
        se = cos[:, n].std() / math.sqrt(n_samples)
        assert abs(cos[:, n].mean() - want) < 4 * se + 1e-6, (n, cos[:, n].mean(), want)
        var_want = (1 + (math.sin(2 * a) / (2 * a)) ** n) / 2 - (math.sin(a) / a) ** (2 * n)
        centred = cos[:, n] - cos[:, n].mean()
        var_se = math.sqrt(max(np.mean(centred ** 4) - np.mean(centred ** 2) ** 2, 0) / n_samples)
        assert abs(centred.var() - var_want) < 4 * var_se + 1e-6, (n, centred.var(), var_want)


def test_random_steps_are_bounded_fresh_per_key_and_fixed_per_index():
    f = jnp.asarray(rope_frequencies(16), jnp.float32)
    idx = jnp.broadcast_to(jnp.arange(50), (3, 50))
    a = so2.uniform_steps(jax.random.key(0), idx, f)
    assert bool(jnp.all(jnp.abs(a) <= f))
    assert not np.allclose(a, so2.uniform_steps(jax.random.key(1), idx, f))  # fresh draw per key
    assert not np.allclose(a[0], a[1])  # rows independent
    np.testing.assert_array_equal(a[:, 10:20], so2.uniform_steps(jax.random.key(0), idx[:, 10:20], f))


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("qkv", [False, True])
def test_position_only_steps_reproduce_rope_exactly(layout, qkv):
    h, d, t = 2, 16, 20
    q, k, v = normal(jax.random.key(2), (3, 2, t, h, d))
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    rope = make_scheme("rope_qkv" if qkv else "rope", num_heads=h, head_dim=d, layout=layout)
    scheme = so2.SO2(num_heads=h, head_dim=d, rotate_values=qkv, layout=layout)
    psi = so2.rope_steps(d, (2, t))
    features = {"psi": psi, "theta": so2.accumulate(psi)}
    np.testing.assert_allclose(scheme.attend(q, k, v, features, positions=pos),
                               rope.attend(q, k, v, positions=pos), atol=2e-5)


def test_qkv_output_is_the_transported_value_sum():
    """out_i = sum_j a_ij R(Theta_j - Theta_i) v_j with a_ij from the rotated q, k."""
    h, d, t = 1, 4, 6
    q, k, v = normal(jax.random.key(3), (3, 1, t, h, d))
    psi = uniform(jax.random.key(4), (1, t, d // 2), minval=-1, maxval=1)
    theta = so2.accumulate(psi)
    scheme = so2.SO2(num_heads=h, head_dim=d, rotate_values=True, layout="interleaved")
    got = scheme.attend(q, k, v, {"psi": psi, "theta": theta}, positions=jnp.arange(t)[None])

    def rot(x, angle):  # 2x2 blocks on interleaved pairs
        out = np.array(x, np.float64)
        for b in range(d // 2):
            c, s = np.cos(angle[b]), np.sin(angle[b])
            out[2 * b], out[2 * b + 1] = c * x[2 * b] - s * x[2 * b + 1], s * x[2 * b] + c * x[2 * b + 1]
        return out

    th = np.asarray(theta[0], np.float64)
    qn, kn, vn = (np.asarray(x[0, :, 0], np.float64) for x in (q, k, v))
    for i in range(t):
        logits = np.array([qn[i] @ rot(kn[j], th[i] - th[j]) / math.sqrt(d) for j in range(i + 1)])
        a = np.exp(logits - logits.max())
        a /= a.sum()
        want = sum(a[j] * rot(vn[j], th[j] - th[i]) for j in range(i + 1))
        np.testing.assert_allclose(got[0, i, 0], want, atol=1e-5)


def test_composition_with_alibi_adds_its_bias():
    h, d, t = 4, 8, 10
    q, k, v = normal(jax.random.key(5), (3, 1, t, h, d))
    pos = jnp.arange(t)[None]
    psi = uniform(jax.random.key(6), (1, t, d // 2))
    feats = {"psi": psi, "theta": so2.accumulate(psi)}
    both = make_scheme("so2_learned_qkv+alibi", num_heads=h, head_dim=d)
    alone = make_scheme("so2_learned_qkv", num_heads=h, head_dim=d)
    alibi = make_scheme("alibi", num_heads=h, head_dim=d)
    qr, kr, vr = alone.transform(q, k, v, feats, pos)
    want = alone.transform_out(alibi.attend(qr, kr, vr, positions=pos), feats, pos)
    np.testing.assert_allclose(both.attend(q, k, v, feats, positions=pos), want, atol=1e-5)


def test_bad_so2_inputs():
    with pytest.raises(ValueError, match="head_dim must be even"):
        make_scheme("so2_learned_qk", num_heads=2, head_dim=9)
    with pytest.raises(ValueError, match="steps"):
        so2.SO2(num_heads=2, head_dim=8, steps="brownian")
    with pytest.raises(ValueError, match="only score-bias.*'rope' is not one; bias-only schemes: alibi"):
        make_scheme("so2_learned_qk+rope", num_heads=2, head_dim=8)
    with pytest.raises(ValueError, match="registered schemes"):
        make_scheme("so2_learned_qk+alibii", num_heads=2, head_dim=8)


def test_vocabulary_smaller_than_the_tokenizer_is_an_error():
    from configs import default
    config = default.get_config("so2_learned_qkv")
    config.model.vocab_size = 100
    with pytest.raises(ValueError, match="model.vocab_size=100 .* tokenizer's vocabulary \\(258\\)"):
        model_config(config, 258)


def test_random_scheme_without_rng_says_how_to_fix_it():
    from flax import nnx

    from models.lm import DecoderLM, ModelConfig
    m = DecoderLM(ModelConfig(vocab_size=20, d_model=16, num_layers=1, num_heads=2, scheme="so2_random_qk"),
                  rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="rng= to a model.*draw_seed"):
        m(jnp.zeros((1, 4), jnp.int32))
    cfg = ModelConfig(vocab_size=20, d_model=16, num_layers=1, num_heads=2, scheme="so2_random_qk",
                      scheme_options=(("draw_seed", 3),))
    fixed = DecoderLM(cfg, rngs=nnx.Rngs(0))
    x = jnp.arange(4)[None]
    np.testing.assert_array_equal(fixed(x), fixed(x))
