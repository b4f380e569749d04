"""The 2-D grid task (data/grid2d.py) and the shift evaluation of benchmarks/grid2d.py: a
commuting (STRING) espr model is exactly invariant to translating the grid; a relaxed one
with non-zero free generator parts is not."""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from data.grid2d import grid_batch
from models.features import SchemeFeatures
from positional.espr import Espr
from helpers.tiny_setup import load_benchmark as load

bench = load("grid2d")  # benchmarks/grid2d.py


def test_grid_batch_default_is_unchanged_and_offset_moves_the_positions_only():
    base = grid_batch(3, 7, 4)
    h = hashlib.sha256()
    for a in base:
        h.update(np.asarray(a).tobytes())
    # The output before `offset` existed (commit e879a79), bit for bit.
    assert h.hexdigest() == "af8735163855c782abc0775ee14013819084f6e741c4d4a7c9e4d7102bafd639"
    for a, b in zip(base, grid_batch(3, 7, 4, offset=(0, 0))):
        np.testing.assert_array_equal(a, b)
    moved = grid_batch(3, 7, 4, offset=(40, 3))
    for i in (0, 1, 2, 4):
        np.testing.assert_array_equal(base[i], moved[i])
    np.testing.assert_array_equal(moved[3], base[3] + np.array([40.0, 3.0], np.float32))


def test_grid_batch_larger_grids():
    tokens, targets, weight, pos, flat = grid_batch(0, 0, 3, rows=12, widths=(10, 14))
    assert tokens.shape == targets.shape == weight.shape == flat.shape == (3, 12 * 14) and pos.shape == (3, 168, 2)
    w = weight.sum(1) / 12  # each grid's width
    assert np.all((w >= 10) & (w <= 14)) and np.all(w == np.round(w))
    assert float(pos[..., 0][weight > 0].max()) == 11 and float(pos[..., 1][weight > 0].max()) <= 13


def _tiny(method, seed=0):
    """A tiny grid model with every learned espr part set to non-zero random values."""
    model = bench.make_model(method, seed, d_model=32, num_layers=2, num_heads=2)
    key = jax.random.key(seed + 1)
    for _, m in nnx.iter_graph(model):
        if isinstance(m, SchemeFeatures) and isinstance(m.scheme, Espr):
            for name in ("basis_skew", "post_skew", "drift"):
                if hasattr(m, name):
                    key, sub = jax.random.split(key)
                    p = getattr(m, name)
                    p[...] = 0.1 * jax.random.normal(sub, p[...].shape)
    return model


def _logits_under(model, offset):
    tokens, _, _, pos, _ = grid_batch(5, 0, 2)
    _, _, _, moved, _ = grid_batch(5, 0, 2, offset=offset)
    return np.asarray(model(tokens, positions=pos)), np.asarray(model(tokens, positions=moved))


def test_commuting_espr_is_translation_invariant():
    model = _tiny("string_2d")
    for offset in [(3, 3), (40, 40), (0, 20)]:
        a, b = _logits_under(model, offset)
        np.testing.assert_allclose(b, a, atol=2e-5 * np.abs(a).max())


def test_relaxed_espr_with_free_parts_is_not_translation_invariant():
    model = _tiny("espr_relaxed_2d")
    stats = bench.generator_stats(model)
    assert stats["commutator_norm"] > 1e-2 and stats["drift_norm"] > 0
    a, b = _logits_under(model, (10, 10))
    assert np.abs(b - a).max() > 1e-2 * np.abs(a).max()


def test_relaxed_espr_without_free_parts_is_translation_invariant():
    """At its initialisation (drift 0) the relaxed model is a commuting one, computed by expm."""
    model = bench.make_model("espr_relaxed_2d", 0, d_model=32, num_layers=1, num_heads=2)
    assert bench.generator_stats(model)["commutator_norm"] < 1e-5
    a, b = _logits_under(model, (3, 3))
    np.testing.assert_allclose(b, a, atol=1e-4 * np.abs(a).max())
    assert jnp.isfinite(a).all()


def test_matmul_expm_matches_scipy_and_its_gradient_matches_jax():
    """positional.linalg.expm (relaxed ESPR's rotations; no LAPACK) against scipy in float64 on
    the same fp32 inputs, skew and general, across norms: within a few fp32 roundings of |a|_1
    (the conditioning of exp to first order), relative to |exp(a)|; one gradient against jax's."""
    import scipy.linalg

    from positional.linalg import expm

    rng = np.random.default_rng(0)
    eps = np.finfo(np.float32).eps
    for scale in (0.0, 1e-3, 0.3, 3.0, 40.0, 300.0):
        g = rng.normal(size=(3, 6, 6))
        for a in (scale * (g - np.swapaxes(g, -1, -2)) / 2, 0.1 * scale * g):
            a = a.astype(np.float32)
            want = np.stack([scipy.linalg.expm(x) for x in a.astype(np.float64)])
            got = np.asarray(expm(jnp.asarray(a)), np.float64)
            norm = max(1.0, np.abs(a).sum(-2).max())
            assert np.abs(got - want).max() <= 4 * eps * norm * max(1.0, np.abs(want).max())
    a = jnp.asarray(rng.normal(size=(5, 5)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(5, 5)), jnp.float32)
    mine, ref = (jax.grad(lambda a, f=f: jnp.sum(w * f(a)))(a) for f in (expm, jax.scipy.linalg.expm))
    np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-4)


def test_the_commutator_penalty_is_the_squared_commutators_and_one_step_with_it_shrinks_them():
    """benchmarks/grid2d.py's penalty: 0 for commuting generators (STRING, the relaxed model at
    initialisation), sum over layers and pairs of |[L_a, L_b]|_F^2 otherwise (checked against the
    features' generators directly); a step of plain gradient descent on it alone lowers it."""
    assert float(bench.commutators(bench.make_model("string_2d", 0, d_model=32, num_layers=1, num_heads=2))) == 0
    assert float(bench.commutators(bench.make_model("espr_relaxed_2d", 0, d_model=32, num_layers=1,
                                                    num_heads=2))) < 1e-10
    model = _tiny("espr_relaxed_2d")
    want = 0.0
    for _, m in nnx.iter_graph(model):
        if isinstance(m, SchemeFeatures) and isinstance(m.scheme, Espr):
            g = np.asarray(m(None, tokens=None, index=None)["generators"], np.float64)
            want += sum(np.sum((g[a] @ g[b] - g[b] @ g[a]) ** 2) for a in range(len(g)) for b in range(len(g)))
    got = float(bench.commutators(model))
    assert want > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-4)
    grads = nnx.grad(bench.commutators)(model)
    nnx.update(model, jax.tree.map(lambda p, g: p - 1e-3 * g, nnx.state(model, nnx.Param), nnx.state(grads, nnx.Param)))
    assert float(bench.commutators(model)) < got
