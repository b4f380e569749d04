"""TAPA: the logit against its definition, the paper's expected-score values (closed form and
Monte Carlo), the fused Pallas kernel against the reference (interpret mode), bad input, and
lowering for TPU."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from models.registry import make_scheme
from positional.kernels.flash import check_blocks
from positional.rope import rope_frequencies, rotate
from positional.tapa import distance_power, split_dims, tapa_attention, tapa_score_fn


def logits_of(q, k, **options):
    """TAPA logits [T, S] of one head through the attention score hook (q [T, D], k [S, D])."""
    t, s = q.shape[0], k.shape[0]
    out = tapa_score_fn(q.shape[-1], **options)(q.reshape(1, t, 1, 1, -1), k.reshape(1, s, 1, -1),
                                                 jnp.arange(t), jnp.arange(s))
    return np.asarray(out[0, 0, 0], np.float64)


@pytest.mark.parametrize("phase", ["quadratic", "linear"])
def test_logit_matches_the_definition_in_float64(phase):
    rng = np.random.default_rng(0)
    t, d, theta, alpha = 9, 12, 0.25, 0.3
    q, k = rng.normal(size=(t, d)), rng.normal(size=(t, d))
    n_amp = 3  # theta * D
    want = np.zeros((t, t))
    for i in range(t):
        for j in range(t):
            amp = q[i, :n_amp] @ k[j, :n_amp] / math.sqrt(n_amp)
            if phase == "quadratic":
                ph = q[i, n_amp:] @ k[j, n_amp:] / math.sqrt(d - n_amp)
            else:  # eq. 16: the phase coordinates of q and of k, summed
                ph = (q[i, n_amp:].sum() + k[j, n_amp:].sum()) / math.sqrt(d - n_amp)
            want[i, j] = amp * math.cos(2 * math.pi * abs(i - j) ** alpha * ph)
    got = logits_of(jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), alpha=alpha, theta=theta,
                    phase=phase)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_distance_power_values():
    r = np.asarray(distance_power(jnp.arange(70000)[:, None], jnp.zeros((1, 1), jnp.int32), 0.1))[:, 0]
    # the notes' table of r^0.1
    for dist, value in [(0, 0.0), (1, 1.0), (2, 1.072), (100, 1.585), (1024, 2.0), (8192, 2.462),
                        (32768, 2.828), (49152, 2.946), (65536, 3.031)]:
        assert abs(r[dist] - value) < 1e-3, (dist, r[dist])


def test_rope_expected_score_curve_and_monte_carlo():
    """Notes, RoPE theory: C_D(lam) for b = 5e5, D = 128, and E score = 2 sqrt(D) C_D for q = k."""
    d = 128
    freqs = np.asarray(rope_frequencies(d, base=5e5), np.float64)
    lams = [0, 1, 2, 3, 10, 100, 1000, 8192, 32768, 65536]
    c_d = [np.cos(lam * freqs).sum() / d for lam in lams]
    np.testing.assert_allclose(c_d, [.5, .489, .4619, .4329, .3821, .3055, .2461, .1327, .1049, .0226],
                               atol=6e-4)
    q = normal(jax.random.key(0), (20000, 1, 1, d))
    for lam, want in [(0, 11.314), (10, 8.646), (100, 6.913), (1000, 5.569), (10000, 2.116)]:
        angles = jnp.asarray(freqs, jnp.float32).reshape(1, 1, 1, -1)  # [B, T, 1, D/2]
        qr, kr = rotate(q, (lam + 7) * angles), rotate(q, 7 * angles)
        score = np.asarray(jnp.sum(qr * kr, -1)).ravel() / math.sqrt(d)
        assert abs(score.mean() - want) < 4 * score.std() / math.sqrt(score.size) + 1e-3, (lam, score.mean())


def pair_logits(q, k, r):
    """TAPA logit of each pair (q_n, k_n) [N, D] at distance r: [N]."""
    d = q.shape[-1]

    def one(a, b):
        return tapa_score_fn(d)(a.reshape(1, 1, 1, 1, d), b.reshape(1, 1, 1, d), jnp.asarray([r]),
                                jnp.asarray([0]))[0, 0, 0, 0, 0]

    return np.asarray(jax.vmap(one)(q, k))


def tapa_expected_logit(c, r, d, theta=0.5, alpha=0.1):
    """Notes, closed form: c sqrt(theta D) Re[((1 - i t c)^2 + t^2)^(-(1 - theta) D / 2)]."""
    n_amp, n_phase = split_dims(d, theta)
    t = 2 * math.pi * (r ** alpha if r else 0.0) / math.sqrt(n_phase)
    return c * math.sqrt(n_amp) * (((1 - 1j * t * c) ** 2 + t ** 2) ** (-n_phase / 2)).real


@pytest.mark.parametrize("d", [8, 128])
def test_tapa_expected_logit_closed_form_and_monte_carlo(d):
    """q, k Gaussian with per-coordinate correlation c: the closed form of the notes, checked
    against Monte Carlo through the implementation (and the notes' values at D = 128)."""
    c, n = 0.9, 40000
    if d == 128:
        assert abs(tapa_expected_logit(c, 0, d) - 7.2) < 1e-9
        assert all(abs(tapa_expected_logit(c, r, d)) < 1e-7 for r in (1, 2, 10, 1000))
    kq, kn = jax.random.split(jax.random.key(d))
    q = normal(kq, (n, d))
    k = c * q + math.sqrt(1 - c * c) * normal(kn, (n, d))
    for r in (0, 1, 3, 50):
        logit = pair_logits(q, k, r)
        want = tapa_expected_logit(c, r, d)
        assert abs(logit.mean() - want) < 4 * logit.std() / math.sqrt(n), (d, r, logit.mean(), want)


def test_tapa_variance_values():
    """Notes: c = 0, D = 128: Var = 1.0 at r = 0 and 0.50 for r >= 1 (Thm 3.3: >= sigma^2 / 2)."""
    n, d = 40000, 128
    kq, kk = jax.random.split(jax.random.key(5))
    q, k = normal(kq, (n, d)), normal(kk, (n, d))
    for r, want in [(0, 1.0), (1, 0.5), (100, 0.5)]:
        logit = pair_logits(q, k, r)
        assert abs(logit.var() - want) < 0.03, (r, logit.var())


@pytest.mark.parametrize("options,field", [
    ({"theta": 0.01}, "empty amplitude"), ({"theta": 0.99}, "empty phase"), ({"theta": 1.0}, "theta"),
    ({"alpha": 0.0}, "alpha"), ({"alpha": -1.0}, "alpha"), ({"phase": "cubic"}, "phase"),
])
def test_bad_options_name_the_field(options, field):
    with pytest.raises(ValueError, match=field):
        make_scheme("tapa", num_heads=2, head_dim=16, **options)


def test_block_sizes_the_backend_cannot_use():
    check_blocks(16, 64, "gpu", interpret=False)
    check_blocks(128, 256, "tpu", interpret=False)
    check_blocks(5, 7, "cpu", interpret=True)
    for args, field in [((48, 64, "gpu"), "block_q=48"), ((64, 8, "gpu"), "block_k=8"),
                        ((64, 128, "tpu"), "block_q=64"), ((64, 64, "cpu"), "interpret")]:
        with pytest.raises(ValueError, match=field):
            check_blocks(*args, interpret=False)


def test_tapa_with_a_bias_runs_fused():
    """TAPA's score and ALiBi's bias in one kernel: impl='pallas' of tapa+alibi is the reference."""
    scheme = make_scheme("tapa+alibi", num_heads=2, head_dim=16)
    q, k, v = (normal(jax.random.key(i), (1, 19, 2, 16)) for i in range(3))
    pos = jnp.arange(19)[None]
    got = jax.jit(functools.partial(scheme.attend, positions=pos, impl="pallas"))(q, k, v)
    np.testing.assert_allclose(got, scheme.attend(q, k, v, positions=pos), atol=2e-5)
    alone = make_scheme("tapa", num_heads=2, head_dim=16)  # and tapa_attention, the kernel's own signature
    np.testing.assert_allclose(jax.jit(tapa_attention)(q, k, v), alone.attend(q, k, v, positions=pos), atol=2e-5)
