"""Transport probes on inputs whose answers are known in closed form."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.lm import DecoderLM, ModelConfig, attention_internals
from positional import so2
from positional.probes import transport


def uniform_psi(a, shape=(256, 257, 2), seed=0):
    return jax.random.uniform(jax.random.key(seed), shape, minval=-a, maxval=a)


@pytest.mark.parametrize("a", [0.5, 2.0])
def test_spectral_gap_and_route_decay_match_sinc_powers(a):
    psi = uniform_psi(a)
    beta = math.sin(a) / a
    tol = 4 / math.sqrt(psi.shape[0] * (psi.shape[1] - 4))  # 4 standard errors of a mean phasor
    np.testing.assert_allclose(transport.spectral_gap(psi), abs(beta), atol=tol)
    decay = transport.route_decay(so2.accumulate(psi), [0, 1, 2, 4])
    np.testing.assert_allclose(decay, np.abs(beta) ** np.array([0, 1, 2, 4])[:, None] * np.ones(2),
                               atol=tol)


def causal_uniform(t):
    w = np.tril(np.ones((t, t))) / np.arange(1, t + 1)[:, None]
    return jnp.asarray(w[None, None])


def test_mass_by_distance_and_far_mass_by_hand():
    t = 8
    w = causal_uniform(t)
    want = [np.mean([1 / (i + 1) for i in range(d, t)]) for d in range(t)]
    np.testing.assert_allclose(transport.mass_by_distance(w), want, rtol=1e-6)
    # Query i >= 3 puts (i - 2) / (i + 1) of its mass on keys at distance >= 3.
    want_far = np.mean([(i - 2) / (i + 1) for i in range(3, t)])
    assert float(transport.far_mass(w, 3)) == pytest.approx(want_far, rel=1e-6)


def test_value_cancellation():
    t, d = 64, 8
    w = causal_uniform(t)
    v = jnp.ones((1, t, 1, d))  # coherent values: every far value points the same way
    none = transport.value_cancellation(w, v, jnp.zeros((1, t, d // 2)), window=8)
    assert float(none["ratio"]) == pytest.approx(1.0, abs=1e-6)
    scrambled = so2.accumulate(uniform_psi(3.0, (1, t, d // 2)))
    assert float(transport.value_cancellation(w, v, scrambled, window=8)["ratio"]) < 0.5


@pytest.mark.parametrize("scheme", ["rope", "so2_learned_qk", "alibi", "path_fox"])
def test_attention_internals_reproduce_the_layer(scheme):
    m = DecoderLM(ModelConfig(vocab_size=30, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              scheme=scheme), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, 30)
    layers = attention_internals(m, tokens)
    assert len(layers) == 2
    w = layers[0]["weights"]
    np.testing.assert_allclose(w.sum(-1), 1.0, atol=1e-5)
    assert float(jnp.abs(jnp.triu(w[0, 0], 1)).max()) == 0.0
    # Layer 0's attention output is the weights applied to its values (no value transport).
    blk = m.blocks[0]
    h = blk.attn_norm(m.embed(tokens))
    index = jnp.broadcast_to(jnp.arange(10), (2, 10))
    q, k, v, f = blk.attn.project(h, tokens, index, None, None)
    out = blk.attn.scheme.attend(q, k, v, f, positions=index)
    values = jnp.repeat(layers[0]["v"], 2, axis=2)  # kv head h // 2 serves query head h
    np.testing.assert_allclose(jnp.einsum("bhij,bjhd->bihd", w, values), out, atol=1e-5)
    np.testing.assert_allclose(layers[0]["out"], blk.attn.o(out.reshape(2, 10, -1)), atol=1e-5)
    causal = jnp.tril(jnp.ones((10, 10), bool))
    np.testing.assert_allclose(jax.nn.softmax(jnp.where(causal, layers[0]["logits"], -jnp.inf)), w, atol=1e-6)
    # The next layer reads the residual stream the model computes.
    x = m.embed(tokens) + layers[0]["out"]
    x = x + blk.mlp(blk.mlp_norm(x))
    h1 = m.blocks[1].attn_norm(x)
    np.testing.assert_allclose(layers[1]["q"], m.blocks[1].attn.project(h1, tokens, index, None, None)[0],
                               atol=1e-5)
    assert "logits" not in attention_internals(m, tokens, maps=False)[0]


@pytest.mark.parametrize("d", [4, 8])
def test_householder_gap_and_route_decay_with_uniform_directions(d):
    """w uniform on the sphere, beta = 2: E[H] = (1 - 2/d) I and E[P_n] = (1 - 2/d)^n I."""
    w = jax.random.normal(jax.random.key(d), (64, 130, 1, d))
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = jnp.full((64, 130, 1), 2.0)
    gap = transport.householder_spectral_gap(w, beta)
    np.testing.assert_allclose(gap, 1 - 2 / d, atol=0.02)
    decay = transport.householder_route_decay(w, beta, [1, 2, 4])
    # The route means have per-entry standard error about 1/sqrt(64 * 130) and the operator
    # norm of a d x d mean picks up about sqrt(d) times that.
    np.testing.assert_allclose(decay[:, 0], [(1 - 2 / d) ** n for n in (1, 2, 4)], atol=0.06)
    # Steps of one fixed direction never mix: E[P_n] keeps norm 1 (no gap).
    fixed = jnp.broadcast_to(jnp.eye(d)[0], w.shape)
    assert float(transport.householder_spectral_gap(fixed, beta)[0]) == pytest.approx(1.0)
