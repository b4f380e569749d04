"""ESPR / STRING rotations (positional/espr.py): the checkable statements of the notes, §4.

Matrix identities and bounds are checked on random instances through the library's fp32
functions, with float64 NumPy references where a reference is needed; the slack added
to each bound is fp32 rounding, far below the bounds' own size.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.lm import DecoderLM, ModelConfig, generate, prefill
from positional import espr
from positional.rope import Rope, rope_angles, rope_frequencies, rotate

D = 8  # head_dim of the matrix tests


def random_skew(rng, d, scale=1.0):
    a = rng.normal(size=(d, d)) * scale
    return (a - a.T) / 2


def random_orthogonal(rng, d):
    return np.asarray(espr.cayley(jnp.asarray(random_skew(rng, d), jnp.float32)), np.float64)


def op_norm(a):
    return np.linalg.norm(np.asarray(a, np.float64), 2)


def commuting_setup(rng, m=3, d_c=2, d=D):
    """(U, beta, generators) with m active planes (d_null = d - 2m)."""
    u = random_orthogonal(rng, d)
    beta = rng.normal(size=(m, d_c))
    gens = np.asarray(espr.plane_generators(jnp.asarray(u, jnp.float32), jnp.asarray(beta, jnp.float32)))
    return u, beta, gens


_rotation = jax.jit(espr.rotation)  # compiled once per shape: the tests call it for every pair (i, j)


def rot(r, gens):
    return np.asarray(_rotation(jnp.asarray(r, jnp.float32), jnp.asarray(gens, jnp.float32)), np.float64)


def test_commuting_generators_give_rotations_with_the_group_and_relative_properties():
    rng = np.random.default_rng(0)
    u, beta, gens = commuting_setup(rng)
    for g in gens:
        np.testing.assert_allclose(g.T, -g, atol=1e-6)
    assert float(espr.commutator_norm(jnp.asarray(gens))) < 1e-5
    r, s = rng.normal(size=2), rng.normal(size=2)
    rr, rs = rot(r, gens), rot(s, gens)
    np.testing.assert_allclose(rr.T @ rr, np.eye(D), atol=1e-5)
    assert abs(np.linalg.det(rr) - 1) < 1e-5
    np.testing.assert_allclose(rot(np.zeros(2), gens), np.eye(D), atol=1e-6)
    np.testing.assert_allclose(rr @ rs, rot(r + s, gens), atol=1e-5)
    np.testing.assert_allclose(rr.T @ rs, rot(s - r, gens), atol=1e-5)  # T2.9
    # T2.7: expm(A(r)) equals the U-block form U [(+) R2(beta_u . r) (+) I] U^T (float64 reference).
    block = np.eye(D)
    for i, th in enumerate(beta @ r):
        block[2 * i:2 * i + 2, 2 * i:2 * i + 2] = [[np.cos(th), -np.sin(th)], [np.sin(th), np.cos(th)]]
    np.testing.assert_allclose(rr, u @ block @ u.T, atol=1e-5)
    pi_act = u[:, :6] @ u[:, :6].T
    np.testing.assert_allclose(rr @ pi_act, pi_act @ rr, atol=1e-5)  # T2.11


def test_cayley_is_an_orthogonal_involution_and_rejects_non_skew():
    rng = np.random.default_rng(1)
    s = random_skew(rng, D, 2.0)
    p = np.asarray(espr.cayley(jnp.asarray(s, jnp.float32)), np.float64)
    np.testing.assert_allclose(p.T @ p, np.eye(D), atol=1e-5)
    assert abs(np.linalg.det(p) - 1) < 1e-5
    np.testing.assert_allclose(p, 2 * np.linalg.inv(np.eye(D) + s) - np.eye(D), atol=1e-5)
    # Involution (T3.3): the Cayley map of P gives back S (P has no eigenvalue -1).
    np.testing.assert_allclose((np.eye(D) - p) @ np.linalg.inv(np.eye(D) + p), s, atol=1e-4)
    # The Gauss-Jordan inverse's custom gradient equals that of a LAPACK solve.
    a, c = (jnp.asarray(rng.normal(size=(D, D)), jnp.float32) for _ in range(2))
    eye = jnp.eye(D)
    grads = [jax.grad(lambda a, f=f: jnp.sum(f(espr.skew(a)) * c))(a)
             for f in (espr.cayley, lambda s: jnp.linalg.solve(eye + s, eye - s))]
    np.testing.assert_allclose(grads[0], grads[1], atol=1e-5)
    assert np.abs(grads[0]).max() > 0.1
    with pytest.raises(ValueError, match="skew-symmetric"):
        espr.cayley(jnp.asarray(s + np.eye(D), jnp.float32))


def scores(scheme_transform, q, k):
    """alpha [T, T] of one head: q, k [1, T, 1, D] after the transform, scaled as the layer does."""
    return np.einsum("id,jd->ij", q[0, :, 0], k[0, :, 0]) * q.shape[-1] ** -0.5


def transformed(scheme, features, q, k, positions):
    """Carried q, k with plane u back at coordinates (2u, 2u + 1) (carry uses the half layout)."""
    tq, tk, _ = scheme.transform(q, k, k, features, positions)
    m = scheme.planes
    pairs = np.stack([np.arange(m), m + np.arange(m)], 1).ravel()
    order = np.concatenate([pairs, np.arange(2 * m, q.shape[-1])])
    return np.asarray(tq, np.float64)[..., order], np.asarray(tk, np.float64)[..., order]


def espr_features(u, post, beta, m):
    u, post = jnp.asarray(u, jnp.float32), jnp.asarray(post, jnp.float32)
    return {"beta": jnp.asarray(beta, jnp.float32), "readin": espr.read_in(u, post, m)}


def test_scores_are_shift_invariant_for_any_post_rotation_and_exact_for_p_in_a():
    rng = np.random.default_rng(2)
    m, t = 3, 6
    u, beta, gens = commuting_setup(rng, m)
    scheme = espr.Espr(num_heads=1, head_dim=D, num_axes=2, num_planes=m)
    q, k = (jnp.asarray(rng.normal(size=(1, t, 1, D)), jnp.float32) for _ in range(2))
    r = jnp.asarray(rng.normal(size=(1, t, 2)) * 3, jnp.float32)
    shift = jnp.asarray([5.0, -7.0])
    p_any = random_orthogonal(rng, D)  # mixes active and null dimensions
    feats = espr_features(u, p_any, beta, m)
    a = scores(None, *transformed(scheme, feats, q, k, r))
    b = scores(None, *transformed(scheme, feats, q, k, r + shift))
    np.testing.assert_allclose(a, b, atol=2e-4)
    # P in A (a rotation of the null block only): alpha = alpha* = (2m)^-1/2 q^T Pi R(r_j - r_i) Pi k.
    null_rot = np.eye(D)
    null_rot[2 * m:, 2 * m:] = random_orthogonal(rng, D - 2 * m)
    feats = espr_features(u, u @ null_rot @ u.T, beta, m)
    a = scores(None, *transformed(scheme, feats, q, k, r))
    pi = u[:, :2 * m] @ u[:, :2 * m].T
    qn, kn, rn = np.asarray(q[0, :, 0], np.float64), np.asarray(k[0, :, 0], np.float64), np.asarray(r[0])
    star = np.array([[qn[i] @ pi @ rot(rn[j] - rn[i], gens) @ pi @ kn[j] for j in range(t)]
                     for i in range(t)])
    np.testing.assert_allclose(a, star * (2 * m) ** -0.5, atol=2e-4)


def test_commutator_and_trotter_bounds_on_random_non_commuting_generators():
    rng = np.random.default_rng(3)
    for trial in range(5):
        gens = np.stack([random_skew(rng, D, 0.3) for _ in range(3)])
        eps_ab = np.array([[op_norm(a @ b - b @ a) for b in gens] for a in gens])
        eps = float(espr.commutator_norm(jnp.asarray(gens, jnp.float32)))
        np.testing.assert_allclose(eps, eps_ab.max(), rtol=1e-4)
        r, s = rng.normal(size=3), rng.normal(size=3)
        ar, as_ = np.einsum("c,cij->ij", r, gens), np.einsum("c,cij->ij", s, gens)
        comm = op_norm(ar @ as_ - as_ @ ar)
        assert comm <= np.abs(r) @ eps_ab @ np.abs(s) + 1e-6 <= eps * np.abs(r).sum() * np.abs(s).sum() + 2e-6
        # The sharp replacement of 5.3 / 6'.3: |R(r)^T R(s) - R(s - r)| <= |[A(r), A(s)]| / 2.
        gap = op_norm(rot(r, gens).T @ rot(s, gens) - rot(s - r, gens))
        assert comm > 1e-2 and gap <= 0.5 * comm + 1e-5


def test_cayley_lipschitz_pure_mix_and_corrected_mixing_bounds():
    rng = np.random.default_rng(4)
    m = 2
    for trial in range(5):
        s1, s2 = random_skew(rng, D, 1.0), random_skew(rng, D, 1.0)
        p1, p2 = (np.asarray(espr.cayley(jnp.asarray(s, jnp.float32)), np.float64) for s in (s1, s2))
        smin = [np.linalg.svd(np.eye(D) + s, compute_uv=False).min() for s in (s1, s2)]
        assert min(smin) >= 1 - 1e-9  # 6'.4 for skew S
        assert op_norm(p1 - p2) <= 2 * op_norm(s1 - s2) / (smin[0] * smin[1]) + 1e-5  # 6'.5
        # Pure mix (6'.7): S only couples active and null blocks, rho < 1.
        e = np.zeros((D, D))
        e[:2 * m, 2 * m:] = rng.normal(size=(2 * m, D - 2 * m))
        e = e - e.T
        e *= rng.uniform(0.1, 0.9) / op_norm(e)
        rho = eta = op_norm(e)
        p = np.asarray(espr.cayley(jnp.asarray(e, jnp.float32)), np.float64)
        assert op_norm(p[:2 * m, :2 * m] - np.eye(2 * m)) <= 2 * eta ** 2 / (1 - rho) + 1e-5
        # Model-free, corrected (6'.8 is false): A = Pi P Pi is within 1 - sqrt(1 - eta_mix^2) of O(2m).
        q = random_orthogonal(rng, D)
        eta_mix = max(op_norm(q[2 * m:, :2 * m]), op_norm(q[:2 * m, 2 * m:]))
        sv = np.linalg.svd(q[:2 * m, :2 * m], compute_uv=False)
        assert np.abs(sv - 1).max() <= 1 - np.sqrt(1 - min(eta_mix, 1.0) ** 2) + 1e-5
    flip = np.diag([-1.0, -1, 1, 1])  # the counterexample: eta_mix = 0 yet |A - I| = 2
    assert op_norm(flip[:2, :2] - np.eye(2)) == 2 and op_norm(flip[2:, :2]) == 0


def test_score_error_bounds_commuting_any_p_and_non_commuting():
    rng = np.random.default_rng(5)
    m, t = 3, 5
    u, beta, gens = commuting_setup(rng, m)
    scheme = espr.Espr(num_heads=1, head_dim=D, num_axes=2, num_planes=m)
    q, k = (jnp.asarray(rng.normal(size=(1, t, 1, D)), jnp.float32) for _ in range(2))
    r = jnp.asarray(rng.normal(size=(1, t, 2)), jnp.float32)
    pi = u[:, :2 * m] @ u[:, :2 * m].T
    p = np.asarray(espr.cayley(jnp.asarray(random_skew(rng, D, 0.2), jnp.float32)), np.float64)
    a = scores(None, *transformed(scheme, espr_features(u, p, beta, m), q, k, r))
    a_star = scores(None, *transformed(scheme, espr_features(u, np.eye(D), beta, m), q, k, r))
    delta = op_norm(pi @ p @ pi - pi)
    qa = np.linalg.norm(np.asarray(q[0, :, 0]) @ pi, axis=-1)
    ka = np.linalg.norm(np.asarray(k[0, :, 0]) @ pi, axis=-1)
    bound = (2 * m) ** -0.5 * np.outer(qa, ka) * (2 * delta + delta ** 2)
    assert (np.abs(a - a_star) <= bound + 1e-5).all() and np.abs(a - a_star).max() > 1e-3
    # Non-commuting generators with d_null = 0 (Pi = I): the relaxed path against alpha*.
    m = D // 2
    relaxed = espr.Espr(num_heads=1, head_dim=D, num_axes=2, relaxed=True)
    u, beta, gens = commuting_setup(rng, m)
    gens = gens + np.stack([random_skew(rng, D, 0.05) for _ in range(2)])
    eps = float(espr.commutator_norm(jnp.asarray(gens, jnp.float32)))
    feats = {"generators": jnp.asarray(gens, jnp.float32), "post": jnp.eye(D),
             "basis": jnp.asarray(u, jnp.float32)}
    a = scores(None, *transformed(relaxed, feats, q, k, r))
    qn, kn, rn = np.asarray(q[0, :, 0], np.float64), np.asarray(k[0, :, 0], np.float64), np.asarray(r[0])
    star = np.array([[qn[i] @ rot(rn[j] - rn[i], gens) @ kn[j] for j in range(t)] for i in range(t)])
    star = star * D ** -0.5
    l1 = np.abs(rn).sum(-1)
    norms = np.outer(np.linalg.norm(qn, axis=-1), np.linalg.norm(kn, axis=-1))
    bound = D ** -0.5 * norms * 0.5 * eps * np.outer(l1, l1)
    assert (np.abs(a - star) <= bound + 1e-5).all() and np.abs(a - star).max() > 1e-4


def test_relaxed_path_equals_commuting_path_when_the_drift_is_zero():
    rng = np.random.default_rng(6)
    m = 3
    u, beta, gens = commuting_setup(rng, m)
    p = random_orthogonal(rng, D)
    q = jnp.asarray(rng.normal(size=(2, 4, 3, D)), jnp.float32)
    r = jnp.asarray(rng.normal(size=(2, 4, 2)), jnp.float32)
    ua = u[:, :2 * m]
    feats = {**espr_features(u, p, beta, m), "generators": jnp.asarray(gens, jnp.float32),
             "post": jnp.asarray(p @ ua @ ua.T, jnp.float32), "basis": jnp.asarray(ua, jnp.float32)}
    plain = espr.Espr(num_heads=3, head_dim=D, num_axes=2, num_planes=m)
    relaxed = espr.Espr(num_heads=3, head_dim=D, num_axes=2, num_planes=m, relaxed=True)
    np.testing.assert_allclose(relaxed.carry(q, feats, r), plain.carry(q, feats, r), atol=1e-5)
    assert plain.relative and not relaxed.relative


# ---- special cases ------------------------------------------------------------------------------

def test_rope_both_layouts_axial_and_mixed_are_special_cases():
    rng = np.random.default_rng(7)
    d, b, t, h = 16, 2, 5, 2
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32) + 3, (b, t))
    one_axis = espr.Espr(num_heads=h, head_dim=d, learned=False)
    beta = espr.axial_beta(d // 2, 1)
    np.testing.assert_allclose(beta[:, 0], rope_frequencies(d))
    for layout in ("interleaved", "half"):
        rope = Rope(num_heads=h, head_dim=d, layout=layout)
        # "half" pairs (i, i + D/2): U is the permutation that lists each pair's two axes together.
        pairs = np.stack([np.arange(d // 2), np.arange(d // 2, d)], 1).ravel()
        order = np.arange(d) if layout == "interleaved" else pairs
        u = np.eye(d)[:, order]
        got, _ = transformed(one_axis, espr_features(u, np.eye(d), beta, d // 2), q, q, pos)
        want = np.asarray(rope.transform(q, q, q, None, pos)[0])
        np.testing.assert_allclose(got @ u.T, want, atol=1e-5)  # the same vectors, in U coordinates
    # Axial 2-D RoPE: planes 0..m/2-1 turn with x, the rest with y, at the RoPE frequencies of D/2.
    xy = jnp.asarray(rng.integers(0, 30, size=(b, t, 2)), jnp.float32)
    two_axes = espr.Espr(num_heads=h, head_dim=d, num_axes=2, learned=False)
    beta = espr.axial_beta(d // 2, 2)
    got, _ = transformed(two_axes, espr_features(np.eye(d), np.eye(d), beta, d // 2), q, q, xy)
    half = rope_frequencies(d // 2)
    want = np.concatenate([rotate(q[..., :d // 2], rope_angles(xy[..., 0], half), "interleaved"),
                           rotate(q[..., d // 2:], rope_angles(xy[..., 1], half), "interleaved")], -1)
    np.testing.assert_allclose(got, want, atol=1e-5)
    # RoPE-Mixed: a free beta in R^{m x 2} with U = I turns pair u by beta_u . (x, y).
    beta = rng.normal(size=(d // 2, 2))
    got, _ = transformed(two_axes, espr_features(np.eye(d), np.eye(d), beta, d // 2), q, q, xy)
    angles = (np.asarray(xy) @ beta.T)[:, :, None, :]
    np.testing.assert_allclose(got, rotate(q, jnp.asarray(angles, jnp.float32), "interleaved"), atol=1e-4)


def test_angles_stay_accurate_far_from_the_origin():
    beta = espr.axial_beta(32, 1)
    r = jnp.asarray([[[65_536.0], [65_535.0], [12_345.0]]])
    got = np.asarray(espr.plane_angles(r, jnp.asarray(beta, jnp.float32)))[0, :, 0]
    exact = np.asarray(r[0], np.float64) * np.asarray(jnp.asarray(beta, jnp.float32), np.float64)[:, 0]
    err = np.abs(np.angle(np.exp(1j * (got - exact))))
    assert err.max() < 1e-6


def test_split_bits_is_exact_and_its_half_products_are_exact():
    """x = hi + lo exactly, hi with at most 12 significant bits, and the products of 12-bit halves
    exact in fp32: so a fused multiply-add (XLA on GPU forms them) cannot change the angles."""
    from positional.angles import split_bits
    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.uniform(-1, 1, 4096) * 10.0 ** rng.integers(-4, 6, 4096), jnp.float32) for _ in "ab")
    (ah, al), (bh, bl) = split_bits(a, 12), split_bits(b, 12)
    assert np.array_equal(np.asarray(ah + al), np.asarray(a))
    mantissa, _ = np.frexp(np.asarray(ah, np.float64))
    assert np.all(mantissa * 2 ** 12 == np.round(mantissa * 2 ** 12))  # 12 significant bits at most
    for x, y in [(ah, bh), (ah, bl), (al, bh), (al, bl)]:
        assert np.array_equal(np.asarray(x * y, np.float64), np.asarray(x, np.float64) * np.asarray(y, np.float64))


def test_bad_input_is_a_clear_error():
    scheme = espr.Espr(num_heads=1, head_dim=D, num_axes=2)
    feats = espr_features(np.eye(D), np.eye(D), espr.axial_beta(D // 2, 2), D // 2)
    q = jnp.ones((1, 3, 1, D))
    with pytest.raises(ValueError, match="num_axes = 2"):
        scheme.transform(q, q, q, feats, jnp.zeros((1, 3), jnp.int32))
    with pytest.raises(ValueError, match="num_axes = 2"):
        scheme.transform(q, q, q, feats, jnp.zeros((1, 3, 3)))
    with pytest.raises(ValueError, match="num_planes"):
        espr.Espr(num_heads=1, head_dim=D, num_planes=5)
    with pytest.raises(ValueError, match="S must be skew"):
        espr.cayley(jnp.ones((D, D)))
    with pytest.raises(ValueError, match="pass positions"):
        scheme.decode_step(scheme.init_cache(1, 4, 1), q[:, :1], q[:, :1], q[:, :1], feats)


# ---- random features ------------------------------------------------------------------------------

def test_positive_random_features_are_unbiased_with_the_exact_variance():
    rng = np.random.default_rng(8)
    d, n = 6, 200_000
    x, y = rng.normal(size=d) * 0.3, rng.normal(size=d) * 0.3
    w = espr.draw_features(jax.random.key(0), n, d)
    fx, fy = (np.asarray(espr.positive_features(jnp.asarray(v, jnp.float32), w), np.float64) for v in (x, y))
    z = n * fx * fy  # Z(x, y; w_t) for each draw
    assert (z > 0).all()
    mean, var = np.exp(x @ y), np.exp(2 * x @ y) * np.expm1(np.sum((x + y) ** 2))  # 7.3, 7.4
    assert abs(z.mean() - mean) <= 4 * np.sqrt(var / n)
    assert abs(z.var() / var - 1) < 0.1
    # 7.5: the variance of the n_rf-feature estimate is Var Z / n_rf (repeated small draws).
    def estimate(key):
        wk = espr.draw_features(key, 16, d)
        return espr.positive_features(jnp.asarray(x, jnp.float32), wk) @ espr.positive_features(
            jnp.asarray(y, jnp.float32), wk)

    small = np.asarray(jax.jit(jax.vmap(estimate))(jax.random.split(jax.random.key(1), 4000)), np.float64)
    assert abs(small.var() / (var / 16) - 1) < 0.15


def rf_inputs(rng, b=1, t=7, h=2, kh=1, d=4, dv=3):
    q = jnp.asarray(rng.normal(size=(b, t, h, d)) * 0.5, jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, kh, d)) * 0.5, jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, kh, dv)), jnp.float32)
    return q, k, v


def test_random_feature_attention_converges_to_softmax_attention():
    from positional.attention import reference_attention
    q, k, v = rf_inputs(np.random.default_rng(9), dv=4)
    w = espr.draw_features(jax.random.key(3), 100_000, q.shape[-1])
    # q^ . k^ = alpha: softmax attention with scale 1 on the same vectors is the target.
    exact = reference_attention(q, k, v, scale=1.0)
    np.testing.assert_allclose(espr.rf_reference(q, k, v, w), exact, atol=0.03)
    np.testing.assert_allclose(espr.rf_blockwise(q, k, v, w, chunk_size=3), espr.rf_reference(q, k, v, w),
                               atol=1e-5)


def test_espr_rf_decodes_multi_axis_positions_through_the_model():
    forward = nnx.jit(lambda model, tokens, pos: model(tokens, positions=pos))
    decode = nnx.jit(lambda model, tokens, cache, pos: model.decode(tokens, cache, positions=pos))
    for scheme in ("espr", "espr_rf"):
        cfg = ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, scheme=scheme,
                          scheme_options=(("draw_seed", 0), ("num_axes", 2)) if scheme == "espr_rf"
                          else (("num_axes", 2),))
        model = DecoderLM(cfg, rngs=nnx.Rngs(0))
        tokens = jnp.asarray(np.random.default_rng(10).integers(0, 16, (2, 6)), jnp.int32)
        pos = jnp.stack(jnp.meshgrid(jnp.arange(3), jnp.arange(2), indexing="ij"), -1).reshape(1, 6, 2)
        pos = jnp.broadcast_to(pos, (2, 6, 2)).astype(jnp.float32)
        full = forward(model, tokens, pos)
        cache = model.init_cache(2, 6)
        out1, cache = decode(model, tokens[:, :3], cache, pos[:, :3])
        out2, cache = decode(model, tokens[:, 3:], cache, pos[:, 3:])
        np.testing.assert_allclose(jnp.concatenate([out1, out2], 1), full, atol=2e-5)
        with pytest.raises(ValueError, match="num_axes = 2"):
            model(tokens)  # [B, T] positions cannot serve two axes
    # generate places the prompt and every new token at its given position: greedy tokens are
    # the argmax of the parallel forward at those positions (the last layout is the transpose).
    for grid in (pos, pos[..., ::-1]):
        out = generate(model, tokens[:, :2], 4, positions=grid)
        np.testing.assert_array_equal(out[:, 2:], jnp.argmax(forward(model, out, grid)[:, 1:5], -1))
    # A prefill in pieces (2, 2, then 1 token) gives each piece its positions: the last logits are
    # the parallel forward's.
    last, _ = nnx.jit(lambda model, tokens, pos: prefill(model, tokens, model.init_cache(2, 6), positions=pos,
                                                         chunk=2))(model, tokens[:, :5], grid[:, :5])
    np.testing.assert_allclose(last, forward(model, tokens, grid)[:, 4], atol=2e-5)
    with pytest.raises(ValueError, match="pass positions"):
        generate(model, tokens[:, :2], 4)
