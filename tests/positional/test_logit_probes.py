"""Logit probes of the position-generalization paper (notes T1-T7) against float64 references
and inputs whose answers are known in closed form."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

from positional.alibi import alibi_slopes
from positional.probes import logits
from positional.rope import rope_frequencies, rotate


def normal(seed, *shape):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


rotate_jit = jax.jit(rotate, static_argnames="layout")


def causal_design(n):
    """The 3-axis design [a | b | c] over the cells j <= i, float64 [n(n+1)/2, 3n]."""
    i, j = np.tril_indices(n)
    x = np.zeros((len(i), 3 * n))
    rows = np.arange(len(i))
    x[rows, i - j] = x[rows, n + i] = x[rows, 2 * n + j] = 1.0
    return x, i, j


def test_t1_three_axis_fit_recovers_additive_logits_up_to_a_3d_gauge():
    n = 32
    x, i, j = causal_design(n)
    d = np.arange(n)
    null = [np.r_[np.ones(n), -np.ones(n), np.zeros(n)], np.r_[np.zeros(n), np.ones(n), -np.ones(n)],
            np.r_[d, -d, d]]
    assert np.linalg.matrix_rank(x) == 3 * n - 3
    assert all(np.abs(x @ v).max() == 0 for v in null)

    rng = np.random.default_rng(0)
    a, b, c = rng.standard_normal((3, 2, n))
    a += 0.1 * d - 1.0  # a trend and an offset for the gauge to move
    w = np.triu(rng.standard_normal((2, n, n)) * 1e3, 1)  # garbage above the diagonal: ignored
    w[:, i, j] = a[:, i - j] + b[:, i] + c[:, j]
    out = logits.three_axis_fit(jnp.asarray(w, jnp.float32))

    # The gauge representative: a without its least-squares line, c with zero sum.
    line = np.linalg.lstsq(np.c_[np.ones(n), d], a.T, rcond=None)[0]  # [2 (offset, slope), batch]
    alpha, gamma = line[0][:, None], line[1][:, None]
    c_want = c - gamma * d
    beta = c_want.mean(-1, keepdims=True)
    np.testing.assert_allclose(out["a"], a - alpha - gamma * d, atol=2e-4)
    np.testing.assert_allclose(out["b"], b + alpha + gamma * d + beta, atol=2e-4)
    np.testing.assert_allclose(out["c"], c_want - beta, atol=2e-4)
    np.testing.assert_allclose(out["fit"], np.tril(w), atol=2e-4)
    np.testing.assert_allclose(out["r"], 1.0, atol=1e-6)
    np.testing.assert_allclose(out["r2"], 1.0, atol=1e-5)


def test_three_axis_fit_is_the_least_squares_fit():
    n = 24
    x, i, j = causal_design(n)
    w = np.random.default_rng(1).standard_normal((2, 3, n, n))
    out = logits.three_axis_fit(jnp.asarray(w, jnp.float32))
    cells = w[..., i, j].reshape(-1, len(i))
    want = x @ np.linalg.lstsq(x, cells.T, rcond=None)[0]  # the fit is gauge-free
    np.testing.assert_allclose(np.asarray(out["fit"])[..., i, j].reshape(-1, len(i)), want.T, atol=1e-4)
    r = [np.corrcoef(u, v)[0, 1] for u, v in zip(cells, want.T)]
    np.testing.assert_allclose(np.ravel(out["r"]), r, atol=1e-5)
    np.testing.assert_allclose(out["r2"], out["r"] ** 2, atol=1e-5)  # the intercept is in the span
    d = np.arange(n) - (n - 1) / 2
    np.testing.assert_allclose([out["a"].sum(-1), (out["a"] * d).sum(-1), out["c"].sum(-1)], 0,
                               atol=1e-3)


def test_t6_three_axis_fit_on_noise_is_at_chance():
    n, batch = 48, 32
    w = normal(2, batch, n, n)
    out = logits.three_axis_fit(w)
    # Gaussian noise, p = 3n - 3 regressors with the intercept among them, N cells:
    # R^2 ~ Beta((p - 1) / 2, (N - p) / 2).
    cells, p = n * (n + 1) // 2, 3 * n - 3
    mean = (p - 1) / (cells - 1)
    sd = math.sqrt(mean * (1 - mean) / ((cells - 1) / 2 + 1) / batch)
    assert abs(float(out["r2"].mean()) - mean) < 4 * sd
    assert float(out["chance"]) == pytest.approx(math.sqrt(6 / n))
    assert float(out["r"].mean()) == pytest.approx(math.sqrt(6 / n), rel=0.05)


def test_t2_fake_distance_fit_is_the_min_norm_least_squares_fit():
    n_d, n_k = 24, 40
    w = np.random.default_rng(3).standard_normal((2, n_d, n_k)) + 0.7
    out = jax.tree.map(np.asarray, logits.fake_distance_fit(jnp.asarray(w, jnp.float32)))
    x = np.concatenate([np.repeat(np.eye(n_d), n_k, 0), np.tile(np.eye(n_k), (n_d, 1))], 1)
    for t in range(2):
        sol = np.linalg.lstsq(x, w[t].ravel(), rcond=None)[0]  # minimum norm
        np.testing.assert_allclose(out["a"][t], sol[:n_d], atol=1e-5)
        np.testing.assert_allclose(out["b"][t], sol[n_d:], atol=1e-5)
        np.testing.assert_allclose(out["fit"][t], (x @ sol).reshape(n_d, n_k), atol=1e-5)
        want_r = np.corrcoef(w[t].ravel(), x @ sol)[0, 1]
        assert float(out["r"][t]) == pytest.approx(want_r, abs=1e-5)
        assert float(out["r2"][t]) == pytest.approx(want_r ** 2, abs=1e-5)
    square = logits.fake_distance_fit(jnp.asarray(w[:, :, :n_d], jnp.float32))
    np.testing.assert_allclose(square["a"].sum(-1), square["b"].sum(-1), atol=1e-4)  # App B, Eq12


def test_t3_nope_and_alibi_fake_logits_are_exactly_additive():
    n, dim = 48, 16
    q = normal(4, dim)
    k = normal(5, n, dim) + 0.5
    distances = np.arange(n)
    nope = logits.fake_distance_fit(logits.fake_logits(lambda q, k, d: q @ k, q, k, distances))
    assert float(nope["r"]) == pytest.approx(1.0, abs=1e-6)
    assert np.ptp(nope["a"]) < 1e-5  # NoPE has no positional curve
    for m in alibi_slopes(8)[[0, 3]]:
        fit = logits.fake_distance_fit(logits.fake_logits(lambda q, k, d: q @ k - m * d, q, k, distances))
        assert float(fit["r"]) == pytest.approx(1.0, abs=1e-6)
        np.testing.assert_allclose(fit["a"] - fit["a"][0], -m * np.arange(n), atol=2e-5 * m * n)


def rotation_matrices(angles):
    """R(angles) acting as positional.rope.rotate with the "half" layout: [n, D, D] float64."""
    cos, sin = np.cos(angles), np.sin(angles)
    return np.block([[np.apply_along_axis(np.diag, -1, cos), np.apply_along_axis(np.diag, -1, -sin)],
                     [np.apply_along_axis(np.diag, -1, sin), np.apply_along_axis(np.diag, -1, cos)]])


def householders(t, dim, seed):
    """PaTH-like factors H_s = I - beta_s w_s w_s^T, beta in (0, 2), unit w: [t, D, D] float64."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((t, dim))
    w /= np.linalg.norm(w, axis=-1, keepdims=True)
    beta = rng.uniform(0.2, 1.8, t)
    return np.eye(dim) - beta[:, None, None] * w[:, :, None] * w[:, None, :]


def path_transports(h):
    """T_d = H_i H_{i-1} ... H_{i-d+1} for the query at i = t - 1, d = 0..t-1: [t, D, D]."""
    out = [np.eye(h.shape[-1])]
    for d in range(1, len(h)):
        out.append(out[-1] @ h[len(h) - d])
    return np.stack(out)


@pytest.mark.parametrize("scheme", ["rope_half", "rope_interleaved", "so2", "path"])
def test_slot_swap_reproduces_the_real_logit_at_the_real_slot(scheme):
    """W'[i - j, j] is the real logit of the last query i and key j: the slot swap moves key j's
    content to slot i - d, so at d = i - j it has not moved."""
    t, dim = 40, 8
    q = normal(6, t, dim)
    k = normal(7, t, dim)
    if scheme == "path":
        h = householders(t, dim, 0)
        real = []
        for j in range(t):  # q_i^T H_i ... H_{j+1} k_j, the factors applied to k_j in turn
            v = np.asarray(k[j], np.float64)
            for s in range(j + 1, t):
                v = h[s] @ v
            real.append(np.asarray(q[-1], np.float64) @ v)
        fake = logits.slot_swap_logits(q[-1], k, jnp.asarray(path_transports(h), jnp.float32))
    else:
        if scheme == "so2":
            steps = np.random.default_rng(8).uniform(-3, 3, (t, dim // 2))
            phi = jnp.asarray(-np.cumsum(steps, 0) + steps, jnp.float32)  # -Theta, Theta exclusive
            layout = "half"
        else:
            phi = (np.arange(t)[:, None] * rope_frequencies(dim, base=100.0)).astype(np.float32)
            layout = scheme.split("_")[1]
        rq, rk = rotate_jit(q, phi, layout), rotate_jit(k, phi, layout)  # what the scheme does
        real = np.asarray(rk) @ np.asarray(rq)[-1]
        fake = logits.slot_swap_logits(q[-1], k, phi[-1] - phi[::-1], layout)
    np.testing.assert_allclose(np.asarray(fake)[t - 1 - np.arange(t), np.arange(t)], real, atol=1e-4)


def test_rope_slot_swap_is_the_papers_fake_distance():
    dim, n = 16, 32
    theta = jnp.asarray(rope_frequencies(dim), jnp.float32)
    q = normal(9, dim)
    k = normal(10, n, dim)
    paper = logits.fake_logits(lambda q, k, d: rotate(q, d * theta) @ k, q, k, np.arange(n))
    swap = logits.slot_swap_logits(q, k, np.arange(n)[:, None] * theta)
    np.testing.assert_allclose(swap, paper, atol=1e-5)


@pytest.mark.parametrize("scheme", ["rope", "path"])
def test_t4_residual_identity_for_bilinear_schemes(scheme):
    """For w = q^T T_d k: residual = q^T (T_d - Tbar)(k_j - kbar), a_d = q^T T_d kbar + const,
    b_j = q^T Tbar k_j - q^T Tbar kbar - const (the note drops the grand mean q^T Tbar kbar)."""
    dim, n_d, n_k = 16, 32, 48
    rng = np.random.default_rng(11)
    q = rng.standard_normal(dim)
    k = rng.standard_normal((n_k, dim)) + rng.standard_normal(dim)  # keys with a shared mean
    if scheme == "rope":
        angles = np.arange(n_d)[:, None] * rope_frequencies(dim, base=100.0)
        transports = rotation_matrices(angles).transpose(0, 2, 1)  # <R q, k> = q^T R^T k
        fake = logits.slot_swap_logits(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                       jnp.asarray(angles, jnp.float32))
    else:
        transports = path_transports(householders(n_d, dim, 1))
        fake = logits.slot_swap_logits(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32),
                                       jnp.asarray(transports, jnp.float32))
    np.testing.assert_allclose(fake, np.einsum("e,def,jf->dj", q, transports, k), atol=1e-4)
    out = logits.fake_distance_fit(fake)
    tbar, kbar = transports.mean(0), k.mean(0)
    residual = np.einsum("e,def,jf->dj", q, transports - tbar, k - kbar)
    np.testing.assert_allclose(fake - out["fit"], residual, atol=1e-4)
    shift_a = np.asarray(out["a"]) - np.einsum("e,def,f->d", q, transports, kbar)
    shift_b = np.asarray(out["b"]) - k @ tbar.T @ q
    np.testing.assert_allclose(shift_a, shift_a[0], atol=1e-4)
    np.testing.assert_allclose(shift_b, -shift_a[0] - q @ tbar @ kbar, atol=1e-4)


def test_t5_rope_fake_fit_on_iid_vectors_is_not_at_chance():
    """E[R^2] ~ sum_r |q_r|^2 rho_r^2 / sum_r |q_r|^2, rho_r = |sin(n th_r / 2) / (n sin(th_r / 2))|:
    the key axis b_j = mean over d of W' keeps the slow pairs, whatever the vectors."""
    dim, n, draws = 64, 256, 16
    theta = rope_frequencies(dim)
    rho = np.abs(np.sin(n * theta / 2) / (n * np.sin(theta / 2)))
    angles = (np.arange(n)[:, None] * theta).astype(np.float32)
    chance = math.sqrt((n + n - 1) / (n * n))
    for seed in range(3):
        q = normal(100 + seed, dim)
        k = normal(200 + seed, draws, n, dim)
        out = logits.fake_distance_fit(logits.slot_swap_logits(q, k, angles))
        qn = q[: dim // 2] ** 2 + q[dim // 2:] ** 2
        assert float(out["r2"].mean()) == pytest.approx((qn * rho ** 2).sum() / qn.sum(), abs=0.03)
        assert float(out["r"].min()) > 4 * chance
        # a_d is noise of size |q| / sqrt(n) (the mean key), b_j carries the signal.
        a = np.asarray(out["a"])
        assert np.sqrt(((a - a.mean(-1, keepdims=True)) ** 2).mean()) < 2 * np.linalg.norm(q) / math.sqrt(n)
    for pairs, check in [(slice(dim // 2 - 4, dim // 2), lambda r: r > 0.999),
                         (slice(0, 8), lambda r: r < 3 * chance)]:
        mask = np.zeros(dim // 2)
        mask[pairs] = 1
        q_sub = q * np.r_[mask, mask].astype(np.float32)
        r = logits.fake_distance_fit(logits.slot_swap_logits(q_sub, k, angles))["r"]
        assert check(float(r.mean())), float(r.mean())


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_explicit_fg_splits_the_rope_logit_exactly(layout):
    t, dim = 32, 16
    theta = rope_frequencies(dim, base=100.0)
    q = normal(12, 2, t, dim)
    k = normal(13, 2, t, dim) + 1.0
    slow = np.isin(np.arange(dim // 2), [5, 7])
    out = logits.explicit_fg(q, k, theta, slow, layout)
    phi = (np.arange(t)[:, None] * theta).astype(np.float32)
    real = np.einsum("bid,bjd->bij", rotate_jit(q, phi, layout), rotate_jit(k, phi, layout))
    np.testing.assert_allclose(out["f"] + out["g"] + out["l"] + out["fast"], real, atol=1e-4)
    # App C's bound on the remainder, pair by pair, in float64.
    pair = (lambda x: x[..., :dim // 2] + 1j * x[..., dim // 2:]) if layout == "half" else \
        (lambda x: x[..., 0::2] + 1j * x[..., 1::2])
    qc, kc = pair(np.asarray(q, np.float64)), pair(np.asarray(k, np.float64))
    dev = np.abs(kc - kc.mean(1, keepdims=True))
    d = np.arange(t)[:, None] - np.arange(t)[None, :]
    bound = sum(2 * np.abs(qc[:, :, None, r]) * dev[:, None, :, r] * np.abs(np.sin(d * theta[r] / 2))
                for r in (5, 7))
    assert np.all(np.abs(out["l"]) <= bound + 1e-4)
    # g is the slow pairs' logit at distance 0 less the mean key's: a function of (q, k) alone.
    qk = np.einsum("bir,bjr->bijr", qc, np.conj(kc - kc.mean(1, keepdims=True))).real
    np.testing.assert_allclose(out["g"], qk[..., [5, 7]].sum(-1), atol=1e-4)


def observation_1(s, t=64, dim=16, seed=0):
    """One query content over t positions and keys that meet Observation 1 to the degree s -> 0:
    pairs 6, 7 slow (theta_r t = 0.6 s, 0.4 s) with a large mean key and deviations 0.3 s of it;
    the fast pairs' norms scale with s."""
    rng = np.random.default_rng(seed)
    nb = dim // 2
    theta = rope_frequencies(dim)
    theta[6:] = np.array([0.6, 0.4]) * s / t
    qc = 0.1 * s * (rng.standard_normal(nb) + 1j * rng.standard_normal(nb))
    qc[6:] = np.exp(1j * np.array([2.0, -1.0]))
    kbar = np.zeros(nb, complex)
    kbar[6:] = 3 * np.exp(1j * np.array([-0.5, 0.7]))
    scale = np.r_[0.1 * s * np.ones(6), 0.3 * s * np.abs(kbar[6:])]
    kc = kbar + scale * (rng.standard_normal((t, nb)) + 1j * rng.standard_normal((t, nb)))
    q = np.repeat(np.r_[qc.real, qc.imag][None], t, 0)
    return q.astype(np.float32), np.c_[kc.real, kc.imag].astype(np.float32), theta


def test_t7_f_plus_g_tightens_under_observation_1():
    misfit = []
    for s in [1.0, 0.3, 0.1, 0.03]:
        q, k, theta = observation_1(s)
        slow = logits.slow_pairs(logits.pair_stats(q, k, theta, train_len=64), 2, max_rotation=1.0)
        np.testing.assert_array_equal(slow, np.arange(8) >= 6)
        misfit.append(1 - float(logits.explicit_fg(q, k, theta, slow)["r"]))
    assert misfit[0] > 1e-2 and misfit[-1] < 1e-4
    assert all(x > y for x, y in zip(misfit, misfit[1:]))


def test_pair_stats_and_slow_pairs_by_hand():
    t, eps = 64, 0.2
    amp_q, alpha = np.array([1.0, 2.0, 0.5, 1.5]), np.array([0.3, -2.0, 1.0, 2.5])
    amp_k, beta = np.array([2.0, 1.0, 4.0, 3.0]), np.array([-1.0, 0.5, 2.0, -2.9])
    sign = np.where(np.arange(t) % 2, 1.0, -1.0)[:, None]  # zero mean: E k_r = amp_k e^{i beta}
    qc = np.repeat((amp_q * np.exp(1j * alpha))[None], t, 0)
    kc = amp_k * np.exp(1j * beta) * (1 + eps * sign)
    q, k = np.c_[qc.real, qc.imag], np.c_[kc.real, kc.imag]
    theta = np.array([1.0, 0.1, 0.01, 0.001])
    out = logits.pair_stats(jnp.asarray(q[None], jnp.float32), jnp.asarray(k[None], jnp.float32),
                            theta, train_len=100)
    np.testing.assert_allclose(out["rotation"], theta * 100, rtol=1e-6)
    np.testing.assert_allclose(out["weight"], amp_q * amp_k, rtol=1e-5)
    np.testing.assert_allclose(out["kbar_share"], amp_k ** 2 / (amp_k ** 2).sum(), rtol=1e-5)
    np.testing.assert_allclose(out["coherence"], 1.0, rtol=1e-5)
    np.testing.assert_allclose(out["deviation"], eps, rtol=1e-5)
    np.testing.assert_allclose(out["theta_delta"], np.angle(np.exp(1j * (alpha - beta - np.pi))),
                               atol=1e-5)
    np.testing.assert_allclose(out["arrow"], amp_q * amp_k * np.exp(1j * (alpha - beta)), rtol=1e-5)
    np.testing.assert_allclose(out["spread"], amp_q * amp_k * eps, rtol=1e-4)
    # Weights 2, 2, 2, 4.5: pair 3 is heaviest, pair 0 turns too far (100 rad).
    np.testing.assert_array_equal(logits.slow_pairs(out, 1), [False, False, False, True])
    np.testing.assert_array_equal(logits.slow_pairs(out, 4, max_rotation=5.0), [False, False, True, True])


def test_gaussian_kl_closed_form():
    x = normal(14, 500, 8)
    assert abs(float(logits.gaussian_kl(x, x))) < 1e-5
    # 1-D samples with exact sample moments: the textbook KL.
    z = np.random.default_rng(15).standard_normal(200)
    z = (z - z.mean()) / z.std(ddof=1)
    (m1, s1), (m2, s2) = (0.3, 1.5), (-0.2, 0.8)
    want = math.log(s2 / s1) + (s1 ** 2 + (m1 - m2) ** 2) / (2 * s2 ** 2) - 0.5
    got = logits.gaussian_kl(jnp.asarray(m1 + s1 * z[:, None]), jnp.asarray(m2 + s2 * z[:, None]), ridge=0.0)
    assert float(got) == pytest.approx(want, rel=1e-5)


def test_gaussian_kl_matches_monte_carlo():
    dim, ridge = 4, 1e-3
    rng = np.random.default_rng(16)
    x = rng.standard_normal((400, dim)) @ rng.standard_normal((dim, dim)) + 1.0
    y = rng.standard_normal((300, dim)) @ rng.standard_normal((dim, dim))
    got = float(logits.gaussian_kl(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), ridge))
    eps = ridge * np.trace(np.cov(y.T)) / dim * np.eye(dim)
    px = scipy_stats.multivariate_normal(x.mean(0), np.cov(x.T) + eps)
    py = scipy_stats.multivariate_normal(y.mean(0), np.cov(y.T) + eps)
    draws = px.rvs(200_000, random_state=17)
    log_ratio = px.logpdf(draws) - py.logpdf(draws)
    assert got == pytest.approx(log_ratio.mean(), abs=4 * log_ratio.std() / math.sqrt(len(draws)))
    scaled = logits.gaussian_kl(jnp.asarray(3 * x, jnp.float32), jnp.asarray(3 * y, jnp.float32), ridge)
    assert float(scaled) == pytest.approx(got, rel=1e-4)



def test_near_far_differences_of_alibi_logits():
    """Logits -m (i - j): every difference is m (Lam - lam), and the softmax normaliser cancels."""
    t, m = 40, 0.3
    i, j = np.arange(t)[:, None], np.arange(t)[None, :]
    z = np.where(j <= i, -m * (i - j), -np.inf)
    log_w = jnp.asarray(z - np.log(np.exp(z).sum(-1, keepdims=True)))[None]
    key = jax.random.key(0)
    got = np.asarray(logits.near_far_differences(log_w, (0, 3), (20, 25), 500, key))
    _, kl, kf, _ = jax.random.split(key, 4)
    lam = np.asarray(jax.random.randint(kl, (500,), 0, 3))
    big = np.asarray(jax.random.randint(kf, (500,), 20, 25))
    np.testing.assert_allclose(got, m * (big - lam), atol=1e-4)
    with pytest.raises(ValueError, match="far hi"):
        logits.near_far_differences(log_w, (0, 3), (20, 41), 5, key)
