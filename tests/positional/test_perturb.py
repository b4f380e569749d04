"""Perturbation probes (notes D6, T8) and the scheme-generic fake distance: moved keys are
scored as the content of their new slot, nothing leaks from the future, and no perturbation
leaves the model untouched."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.lm import DecoderLM, ModelConfig, attention_internals, token_nll
from positional.alibi import alibi_slopes
from positional.probes import logits, perturb
from positional.rope import rotate

T = 12


@pytest.mark.parametrize("gamma,l_max", [(0.25, 1), (0.5, 3), (0.75, 40)])
def test_swap_pairs_is_an_involution_of_disjoint_near_pairs(gamma, l_max):
    perm = perturb.swap_pairs(np.random.default_rng(0), 64, gamma, l_max)
    assert sorted(perm) == list(range(64))
    np.testing.assert_array_equal(perm[perm], np.arange(64))
    moved = perm != np.arange(64)
    assert moved.sum() == 2 * round(gamma * 32)
    assert np.abs(perm - np.arange(64)).max() <= l_max


def test_offset_slots_moves_gamma_of_the_keys_to_distinct_slots():
    slots = perturb.offset_slots(np.random.default_rng(1), 100, 0.2, 5)
    moved = slots != np.arange(100)
    assert moved.sum() == 20
    assert len(set(slots[moved])) == 20
    assert 0 < np.abs(slots - np.arange(100))[moved].min() and np.abs(slots - np.arange(100)).max() <= 5


def test_perturbations_reject_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="gamma"):
        perturb.swap_pairs(rng, 10, 1.5, 2)
    with pytest.raises(ValueError, match="l_max"):
        perturb.offset_slots(rng, 10, 0.1, 0)
    with pytest.raises(ValueError, match="valid: text, keys, positions"):
        perturb.draw("tokens", rng, (1, 10), 0.1, 2)


@functools.lru_cache(maxsize=None)
def model(scheme, mixer="attention"):
    return DecoderLM(ModelConfig(vocab_size=30, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 scheme=scheme, mixer=mixer), rngs=nnx.Rngs(0))


def layer0(scheme):
    """Layer 0's scheme and its q, k, v, features on random tokens."""
    m = model(scheme)
    tokens = jax.random.randint(jax.random.key(1), (2, T), 0, 30)
    layer = attention_internals(m, tokens, rng=jax.random.key(2))[0]
    return m.blocks[0].attn.scheme, layer


index = jnp.broadcast_to(jnp.arange(T), (2, T))


def slots_of(mode, seed=3):
    return jnp.asarray(perturb.draw(mode, np.random.default_rng(seed), (2, T), 0.5, 3))


@pytest.mark.parametrize("scheme", ["rope_qkv", "alibi", "so2_learned_qkv", "path_fox", "tapa"])
def test_keys_at_their_own_slots_is_the_schemes_attention(scheme):
    s, x = layer0(scheme)
    args = (x["q"], x["k"], x["v"], x["features"])
    want = s.attend(*args, positions=index)
    got = s.placed_attention(*args, positions=index, key_slots=index)
    np.testing.assert_allclose(got, want, atol=2e-5)
    moved = s.placed_attention(*args, positions=index, key_slots=slots_of("keys"))
    assert float(jnp.abs(moved - want).max()) > 1e-3  # a perturbation that changes nothing is no test


@pytest.mark.parametrize("mode", ["keys", "positions"])
def test_nope_does_not_see_where_keys_sit(mode):
    s, x = layer0("nope")
    args = (x["q"], x["k"], x["v"], x["features"])
    np.testing.assert_allclose(s.placed_attention(*args, positions=index, key_slots=slots_of(mode)),
                               s.attend(*args, positions=index), atol=1e-6)


@pytest.mark.parametrize("mode", ["keys", "positions"])
def test_rope_scores_a_moved_key_at_its_slot_and_masks_by_content(mode):
    s, x = layer0("rope")
    slots = slots_of(mode)
    got = s.placed_attention(x["q"], x["k"], x["v"], x["features"], positions=index, key_slots=slots)
    angles = lambda p: p[..., None, None].astype(jnp.float32) * jnp.asarray(s.theta, jnp.float32)  # noqa: E731
    q = rotate(x["q"], angles(index), s.layout)
    k = jnp.repeat(rotate(x["k"], angles(slots), s.layout), 2, axis=2)  # key j rotated by its slot
    scores = jnp.einsum("bihd,bjhd->bhij", q, k) / jnp.sqrt(q.shape[-1])
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((T, T), bool)), scores, -jnp.inf), -1)
    want = jnp.einsum("bhij,bjhd->bihd", w, jnp.repeat(x["v"], 2, axis=2))
    np.testing.assert_allclose(got, want, atol=2e-5)


@pytest.mark.parametrize("scheme", ["rope", "path_fox"])
def test_t8_gamma_zero_reproduces_the_clean_loss(scheme):
    m = model(scheme)
    tokens = jax.random.randint(jax.random.key(4), (2, T + 1), 0, 30)
    clean, _ = token_nll(m, tokens, impl="reference")
    for mode in perturb.MODES:
        draw = perturb.draw(mode, np.random.default_rng(0), (2, T + 1 if mode == "text" else T), 0.0, 5)
        if mode == "text":
            nll, _ = token_nll(m, jnp.take_along_axis(tokens, jnp.asarray(draw), 1), impl="reference")
        else:
            nll, _ = token_nll(m, tokens, key_slots=jnp.asarray(draw))
        np.testing.assert_allclose(nll, clean, atol=1e-5)
    moved, _ = token_nll(m, tokens, key_slots=slots_of("keys"))
    assert float(jnp.abs(moved - clean).max()) > 1e-4


def test_key_slots_need_attention():
    with pytest.raises(ValueError, match="mixer 'sessa' has none"):
        model("nope", "sessa")(jnp.zeros((1, T), jnp.int32), key_slots=index[:1])


def fake(scheme, query=T - 1):
    s, x = layer0(scheme)
    fn = functools.partial(s.logits, features=x["features"], positions=index)
    w = logits.placed_fake_logits(fn, x["q"], x["k"], x["v"], query, jnp.arange(T))
    return s, x, fn, w


@pytest.mark.parametrize("scheme", ["rope", "alibi", "so2_learned_qk", "path_fox", "tapa"])
def test_placed_fake_logits_at_the_real_distance_are_the_real_logits(scheme):
    s, x, fn, w = fake(scheme)
    real = fn(x["q"], x["k"], x["v"])[..., T - 1, :]  # [B, K, G, T]
    j = np.arange(T)
    np.testing.assert_allclose(w[..., T - 1 - j, j], real, atol=1e-5)


def test_placed_fake_logits_of_rope_and_alibi_in_closed_form():
    s, x, _, w = fake("rope")
    q = x["q"][:, -1].reshape(2, 2, 2, -1)  # [B, K, G, D]
    keys = jnp.moveaxis(x["k"], 2, 1)[:, :, None]  # [B, K, 1, T, D]
    angles = jnp.arange(T)[:, None] * jnp.asarray(s.theta, jnp.float32)  # the paper's fake distance d
    want = logits.slot_swap_logits(q, keys, angles, s.layout)
    np.testing.assert_allclose(w, want / np.sqrt(q.shape[-1]), atol=1e-5)
    _, x, _, w = fake("alibi")
    q = x["q"][:, -1].reshape(2, 2, 2, -1)
    qk = jnp.einsum("bkgd,bjkd->bkgj", q, x["k"]) / np.sqrt(q.shape[-1])
    slopes = jnp.asarray(alibi_slopes(4)).reshape(2, 2)
    want = qk[..., None, :] - slopes[None, :, :, None, None] * jnp.arange(T)[:, None]
    np.testing.assert_allclose(w, want, atol=1e-5)
    assert float(logits.fake_distance_fit(w)["r"].min()) == pytest.approx(1.0, abs=1e-5)
