"""Logit diagnostics of "Computation Mechanism Behind LLM Position Generalization" (Han & Ji):
how far attention logits split into a positional part and a semantic part.

  three_axis_fit      W_ij ~ a_{i-j} + b_i + c_j on the causal triangle (Sec 3.1, App A);
  fake_logits,        W'_dj = w(d, q, k_j): key j's content scored at a fake distance d, or at
  slot_swap_logits,     slot i - d with the real intervening transport (Sec 3.2; the note's D2);
  placed_fake_logits    the same through any scheme's own logits;
  fake_distance_fit   W'_dj ~ a_d + b_j in closed form (App B);
  pair_stats,         Observation 1 per rotary pair, the choice of R_slow, and the explicit
  slow_pairs,           f + g of Theorems 2/3 (Sec 3.4, App C);
  explicit_fg
  gaussian_kl         the feature-shift measure of Table 2.

Logits are the unscaled q . k (the model divides by sqrt(D)); every fit is linear and r, R^2
are scale-free. Rotary pairs follow `positional.rope`'s layouts: pair r of x is the complex
number x_r = x[r] + i x[r + D/2] ("half") or x[2r] + i x[2r + 1] ("interleaved"), so
rotate(x, alpha) is x_r e^{i alpha_r}, and the RoPE logit of query i and key j is
sum_r Re(q_r conj(k_r) e^{i (i - j) theta_r}) = sum_r |q_r||k_r| cos((i-j) theta_r + th_q - th_k).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from positional.rope import LAYOUTS, rotate


def _scores(w, fit, mask):
    """Pearson r between w and fit, and R^2 = 1 - SS_res / SS_tot, over `mask` (last two axes)."""
    axes = (-2, -1)
    count = mask.sum()
    dw = jnp.where(mask, w - jnp.where(mask, w, 0).sum(axes, keepdims=True) / count, 0)
    dfit = jnp.where(mask, fit - jnp.where(mask, fit, 0).sum(axes, keepdims=True) / count, 0)
    ss = (dw ** 2).sum(axes)
    r = (dw * dfit).sum(axes) / jnp.sqrt(ss * (dfit ** 2).sum(axes))
    residual = jnp.where(mask, w - fit, 0)
    return r, 1 - (residual ** 2).sum(axes) / ss


def _suffix_sum(x):
    return jnp.flip(jnp.cumsum(jnp.flip(x, -1), -1), -1)


def _three_axis_gauge(n: int):
    """Unit gauge rows: the mean of a and the linear trend of a (the mean of c uses the first)."""
    i = jnp.arange(n, dtype=jnp.float32)
    one, trend = jnp.ones(n), i - (n - 1) / 2
    return one / jnp.linalg.norm(one), trend / jnp.linalg.norm(trend)


def _three_axis_normal(theta):
    """(X^T X + n G^T G) theta for the causal design X = [a | b | c] and the gauge rows G, in O(n).

    X^T X couples the unknowns through the cells they share: (a_d, b_i) when i >= d, (a_d, c_j)
    when j + d < n, (b_i, c_j) when j <= i; so each row of the product is a count times the
    unknown plus prefix or suffix sums of the other two.
    """
    a, b, c = theta
    n = a.shape[-1]
    i = jnp.arange(n, dtype=jnp.float32)
    prefix_a, prefix_c, suffix_b = jnp.cumsum(a, -1), jnp.cumsum(c, -1), _suffix_sum(b)
    one, trend = _three_axis_gauge(n)
    on = lambda x, g: g * (x * g).sum(-1, keepdims=True)  # noqa: E731
    return ((n - i) * a + suffix_b + jnp.flip(prefix_c, -1) + n * (on(a, one) + on(a, trend)),
            prefix_a + (i + 1) * b + prefix_c,
            jnp.flip(prefix_a, -1) + suffix_b + (n - i) * c + n * on(c, one))


@functools.partial(jax.jit, static_argnames="max_iter")
def _three_axis_solve(w, tol=1e-6, max_iter=1000):
    """Preconditioned conjugate gradients on the gauge-fixed normal equations (see three_axis_fit)."""
    n = w.shape[-1]
    i = jnp.arange(n)
    dist = i[:, None] - i[None, :]
    causal = dist >= 0
    wc = jnp.where(causal, w.astype(jnp.float32), 0)
    by_distance = jnp.take_along_axis(wc, jnp.broadcast_to(jnp.maximum(dist, 0), w.shape), -1)
    rhs = (jnp.where(causal, by_distance, 0).sum(-2), wc.sum(-1), wc.sum(-2))
    fi = jnp.arange(n, dtype=jnp.float32)
    one, trend = _three_axis_gauge(n)
    diagonal = (n - fi + n * (one ** 2 + trend ** 2), fi + 1, n - fi + n * one ** 2)  # the preconditioner

    def dot(x, y):
        return sum((u * v).sum(-1) for u, v in zip(x, y))

    def axpy(alpha, x, y):  # alpha x + y
        return tuple(alpha[..., None] * u + v for u, v in zip(x, y))

    def precondition(r):
        return tuple(u / d for u, d in zip(r, diagonal))

    def unconverged(state):
        k, _, r, _, _ = state
        return (k < max_iter) & jnp.any(dot(r, r) > tol ** 2 * dot(rhs, rhs))

    def step(state):
        k, x, r, p, rz = state
        ap = _three_axis_normal(p)
        alpha = rz / dot(p, ap)
        x, r = axpy(alpha, p, x), axpy(-alpha, ap, r)
        z = precondition(r)
        rz_next = dot(r, z)
        return k + 1, x, r, axpy(rz_next / rz, p, z), rz_next

    z = precondition(rhs)
    zero = tuple(jnp.zeros_like(u) for u in rhs)
    _, (a, b, c), _, _, _ = jax.lax.while_loop(unconverged, step, (0, zero, rhs, z, dot(rhs, z)))
    fit = jnp.where(causal, jnp.take(a, jnp.maximum(dist, 0), axis=-1)
                    + b[..., :, None] + c[..., None, :], 0)
    r, r2 = _scores(wc, fit, causal)
    return {"a": a, "b": b, "c": c, "fit": fit, "r": r, "r2": r2}


def three_axis_fit(w: jnp.ndarray) -> dict:
    """Least-squares W_ij ~ a_{i-j} + b_i + c_j over the causal cells j <= i of w [..., n, n].

    a [..., n] is the distance axis (a_d on diagonal d = i - j), b [..., n] the query axis (rows;
    softmax-invariant), c [..., n] the key axis (columns). Cells above the diagonal are ignored.

    Gauge: the design has rank 3n - 3. Moving a constant from a to b, or from b to c, and the
    trend a_d += g d, b_i -= g i, c_j += g j (since d = i - j on every cell) leave every fitted
    cell unchanged, so the shape of a is fixed only up to a constant plus a linear trend (a
    linear positional curve, such as ALiBi's, is indistinguishable from row and column trends).
    This fit returns the representative with sum_d a_d = 0, sum_d (d - mean d) a_d = 0 (a has
    no least-squares line) and sum_j c_j = 0; b carries the level. The paper's 1e-6 ridge picks
    another (near minimum-norm) representative: same fit, same r, different a.

    Solver: the normal equations plus n G^T G (G: the three unit gauge rows; on the 3-D null
    space of X they are independent, so the system is positive definite and its solution is
    the least-squares fit that satisfies the gauge). The matrix is never formed: a product
    with it costs O(n) (`_three_axis_normal`), so conjugate gradients preconditioned by its
    diagonal converge in ~30 steps for any n; the O(n^2) work is reading w and scoring the fit.
    Returns a, b, c, 'fit' [..., n, n] (zero above the diagonal), Pearson 'r' and 'r2' (R^2)
    over the causal cells, and 'chance' = sqrt(6 / n): r of a fit to pure noise, since R^2 is
    then about (#unknowns) / (#cells) = 3n / (n^2 / 2).
    """
    return _three_axis_solve(w) | {"chance": math.sqrt(6 / w.shape[-1])}


def fake_logits(score, q: jnp.ndarray, k: jnp.ndarray, distances: jnp.ndarray) -> jnp.ndarray:
    """W'_dj = score(q, k_j, d) for one query q [D], keys k [n_k, D], distances [n_d]: [n_d, n_k].

    `score(q, k, d)` is the scheme's logit of a query and a key at distance d, for schemes
    whose logit is a fixed function of the distance: NoPE q . k, ALiBi q . k - m d, RoPE
    rotate(q, d theta) . k (equal to `slot_swap_logits` with angles d theta).
    """
    return jax.vmap(jax.vmap(score, (None, 0, None)), (None, None, 0))(q, k, distances)


@functools.partial(jax.jit, static_argnames="layout")
def slot_swap_logits(q: jnp.ndarray, k: jnp.ndarray, transport: jnp.ndarray,
                     layout: str = "half") -> jnp.ndarray:
    """The note's slot swap: W'_dj = q^T T_d k_j, key j's content placed at slot i - d of the
    real sequence, with the real transport T_d = T_{i <- i-d} from that slot to the query's.

    q [..., D] (the query at slot i, before position is applied), k [..., n_k, D] -> [..., n_d, n_k].
    transport, for d = 0..n_d-1, either
      angles [n_d, D/2], rotary: T_d = R(angles_d)^T, so W'_dj = rotate(q, angles_d) . k_j.
        With phi_p the angle a scheme rotates q_p and k_p by, angles_d = phi_i - phi_{i-d}.
        RoPE: phi_p = p theta, so angles_d = d theta, the paper's fake distance. Accumulated
        SO(2) (positional.so2 rotates by -Theta): angles_d = Theta_{i-d} - Theta_i;
      or matrices [n_d, D, D]: PaTH, T_d = H_i H_{i-1} ... H_{i-d+1} (T_0 = I).
    Schemes whose logit is not bilinear (TAPA, Sessa) need the model itself to run key j's
    content at slot i - d; this function cannot stand in for that.
    """
    if transport.shape[-1] == q.shape[-1]:
        moved = jnp.einsum("...e,def->...df", q.astype(jnp.float32), transport.astype(jnp.float32))
    else:
        shape = q.shape[:-1] + transport.shape[:1] + q.shape[-1:]
        moved = rotate(jnp.broadcast_to(q[..., None, :], shape).astype(jnp.float32), transport, layout)
    return jnp.einsum("...de,...je->...dj", moved, k.astype(jnp.float32))


def placed_fake_logits(logits_fn, q, k, v, query: int, keys) -> jnp.ndarray:
    """The slot swap run through the scheme itself: W'_dj = logit of the query at slot `query`
    with key j's content placed at slot query - d, d = 0..query, for any scheme (bilinear or
    not: TAPA, FoX biases), with the real features and positions of the sequence.

    logits_fn(q, k, v) -> [B, K, G, T, T]: the scheme's logits with its features and positions
    bound (`Scheme.logits`). q [B, T, H, D], k, v [B, T, K, D] before the scheme's transform;
    keys [n_k] int. Returns [B, K, G, query + 1, n_k]. One full logit map per key: O(n_k T^2).
    For RoPE this is the paper's fake distance, for bilinear schemes `slot_swap_logits`.
    """
    def one(j):
        kj, vj = (jnp.broadcast_to(jax.lax.dynamic_slice_in_dim(x, j, 1, axis=1), x.shape) for x in (k, v))
        return jnp.flip(logits_fn(q, kj, vj)[..., query, :query + 1], -1)

    return jnp.moveaxis(jax.lax.map(one, jnp.asarray(keys)), 0, -1)


@jax.jit
def fake_distance_fit(w: jnp.ndarray) -> dict:
    """Least-squares W'_dj ~ a_d + b_j over every cell of w [..., n_d, n_k], in closed form.

    With m the mean of W', a = (row means) - m + s and b = (column means) - s for any s (the
    one-dimensional gauge); the minimum-norm choice, which any L2 term selects (App B),
    is s = n_k m / (n_d + n_k), i.e. s = m / 2 and sum a = sum b for a square W'. a is the
    positional curve f(q, d), b the semantic part g(q, k_j).
    Returns a [..., n_d], b [..., n_k], 'fit' [..., n_d, n_k], Pearson 'r' and 'r2' (R^2).
    """
    w = w.astype(jnp.float32)
    n_d, n_k = w.shape[-2:]
    m = w.mean((-2, -1))
    s = n_k / (n_d + n_k) * m
    a = w.mean(-1) - (m - s)[..., None]
    b = w.mean(-2) - s[..., None]
    fit = a[..., :, None] + b[..., None, :]
    r, r2 = _scores(w, fit, jnp.ones((n_d, n_k), bool))
    return {"a": a, "b": b, "fit": fit, "r": r, "r2": r2}


def _pairs(x: jnp.ndarray, layout: str) -> jnp.ndarray:
    """x [..., D] -> the rotary pairs as complex numbers [..., D/2] (see the module docstring)."""
    x = x.astype(jnp.float32)
    if layout == "half":
        x1, x2 = jnp.split(x, 2, axis=-1)
    elif layout == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        raise ValueError(f"unknown RoPE layout {layout!r}; valid: {LAYOUTS}")
    return jax.lax.complex(x1, x2)


@functools.partial(jax.jit, static_argnames="layout")
def pair_stats(q: jnp.ndarray, k: jnp.ndarray, theta, train_len: int, layout: str = "half") -> dict:
    """Observation 1 per rotary pair r, over all tokens of q, k [..., D] (before rotation).

    'rotation'    theta_r L_train, the arc of Fig 4 (small for the "mostly static" pairs);
    'weight'      E|q_r| |kb_r|, kb_r = E k_r (the note's score for choosing R_slow);
    'kbar_share'  |kb_r|^2 / sum_r' |kb_r'|^2 (the "prominent" pairs);
    'coherence'   |kb_r| / E|k_r|, 1 when every key points the same way;
    'deviation'   E|k_r - kb_r| / |kb_r|, small for Observation 1's pairs;
    'theta_delta' circular mean of th_q - th_k over all (query, key) pairs, minus pi, wrapped
                  to (-pi, pi]: the proof's theta_delta;
    'arrow'       E q_r conj(k_r) over all (query, key) pairs (complex; Fig 4's arrow: the sum
                  of the real parts is the mean logit at distance 0), 'spread' its std.
    All [D/2].
    """
    qc = _pairs(q, layout).reshape(-1, q.shape[-1] // 2)
    kc = _pairs(k, layout).reshape(-1, k.shape[-1] // 2)
    kbar = kc.mean(0)
    kbar_norm, q_norm, k_norm = jnp.abs(kbar), jnp.abs(qc), jnp.abs(kc)
    direction = ((qc / jnp.maximum(q_norm, 1e-30)).mean(0)
                 * jnp.conj((kc / jnp.maximum(k_norm, 1e-30)).mean(0)))
    arrow = qc.mean(0) * jnp.conj(kbar)
    return {"rotation": jnp.asarray(theta, jnp.float32) * train_len,
            "weight": q_norm.mean(0) * kbar_norm,
            "kbar_share": kbar_norm ** 2 / (kbar_norm ** 2).sum(),
            "coherence": kbar_norm / k_norm.mean(0),
            "deviation": jnp.abs(kc - kbar).mean(0) / kbar_norm,
            "theta_delta": jnp.angle(-direction),
            "arrow": arrow,
            "spread": jnp.sqrt(jnp.maximum(
                (q_norm ** 2).mean(0) * (k_norm ** 2).mean(0) - jnp.abs(arrow) ** 2, 0))}


@functools.partial(jax.jit, static_argnames="num_slow")
def slow_pairs(stats: dict, num_slow: int, max_rotation: float = math.pi) -> jnp.ndarray:
    """R_slow: the num_slow pairs of largest 'weight' among those with 'rotation' < max_rotation,
    as a bool mask [D/2] (fewer if fewer qualify). The paper gives no rule; this is the note's.
    """
    eligible = stats["rotation"] < max_rotation
    top = jax.lax.top_k(jnp.where(eligible, stats["weight"], -jnp.inf), num_slow)[1]
    return jnp.zeros(eligible.shape, bool).at[top].set(True) & eligible


@functools.partial(jax.jit, static_argnames="layout")
def explicit_fg(q: jnp.ndarray, k: jnp.ndarray, theta, slow: jnp.ndarray,
                layout: str = "half") -> dict:
    """The explicit f + g of Theorems 2/3 for a RoPE head, with R_slow given by `slow` [D/2].

    q, k [..., T, D] before rotation, at positions 0..T-1; kb = mean of k over the T keys.
    Per slow pair, with d = i - j and e_r = e^{i d theta_r}:
      f_r = Re(q_r conj(kb_r) e_r)              position part f(q, i-j): the mean key's term;
      g_r = Re(q_r conj(k_r - kb_r))            semantic part g(q, k): the key's deviation at d = 0;
      l_r = Re(q_r conj(k_r - kb_r) (e_r - 1))  remainder, |l_r| <= 2 |q_r||k_r - kb_r| |sin(d theta_r / 2)|.
    The paper's f_r, g_r (App C) are these when k_r - kb_r is parallel to kb_r: its proof
    writes |kb + (k - kb)| = |kb| + |k - kb|. Here the split is exact:
    W_ij = f + g + l + fast, 'fast' the full contribution of the other pairs, and W_ij is the
    RoPE logit <rotate(q_i, i theta), rotate(k_j, j theta)>.
    Returns 'f', 'g', 'l', 'fast' [..., T, T] and 'r' = corr(f + g, W) over the causal cells.
    """
    qc, kc = _pairs(q, layout), _pairs(k, layout)
    t = q.shape[-2]
    i = jnp.arange(t)
    angle = i[:, None] * jnp.asarray(theta, jnp.float32)
    phase = jax.lax.complex(jnp.cos(angle), jnp.sin(angle))  # e^{i p theta_r}: [T, D/2]
    kbar = kc.mean(-2, keepdims=True)
    slow = slow.astype(jnp.float32)

    def cross(x, y, mask):  # sum_r mask_r Re(x_ir conj(y_jr)): [..., T, T]
        return jnp.einsum("...ir,...jr->...ij", x * mask, jnp.conj(y)).real

    f = cross(qc * phase, kbar * phase, slow)
    g = cross(qc, kc - kbar, slow)
    remainder = cross(qc * phase, (kc - kbar) * phase, slow) - g
    fast = cross(qc * phase, kc * phase, 1 - slow)
    r, _ = _scores(f + g + remainder + fast, f + g, i[:, None] >= i[None, :])
    return {"f": f, "g": g, "l": remainder, "fast": fast, "r": r}


@jax.jit
def gaussian_kl(x: jnp.ndarray, y: jnp.ndarray, ridge: float = 1e-6) -> jnp.ndarray:
    """KL(N_x || N_y) between full-covariance Gaussian fits of x [..., D] and y [..., D].

    Each fit is the sample mean and the unbiased covariance over all leading positions, plus
    eps I with eps = ridge * tr(Cov_y) / D (the same for both, so KL is unchanged when x and
    y are scaled together). Closed form, through Cholesky factors L:
    KL = (tr(Cy^-1 Cx) + (my - mx)^T Cy^-1 (my - mx) - D + log det Cy - log det Cx) / 2.
    Table 2's use: x = attention outputs at positions beyond the training length, y = within.
    With fewer samples than dimensions the ridge must be positive.
    """
    d = x.shape[-1]
    x, y = x.reshape(-1, d).astype(jnp.float32), y.reshape(-1, d).astype(jnp.float32)

    def moments(z):
        mean = z.mean(0)
        return mean, (z - mean).T @ (z - mean) / (z.shape[0] - 1)

    (mx, cx), (my, cy) = moments(x), moments(y)
    eps = ridge * jnp.trace(cy) / d * jnp.eye(d)
    lx, ly = jnp.linalg.cholesky(cx + eps), jnp.linalg.cholesky(cy + eps)
    trace = (solve_triangular(ly, lx, lower=True) ** 2).sum()
    mahalanobis = (solve_triangular(ly, my - mx, lower=True) ** 2).sum()
    logdet = 2 * (jnp.log(jnp.diag(ly)) - jnp.log(jnp.diag(lx))).sum()
    return (trace + mahalanobis - d + logdet) / 2


def near_far_differences(log_weights, near: tuple[int, int], far: tuple[int, int], num: int, key):
    """logit(i, i - lam) - logit(i, i - Lam) for `num` random (matrix, query i, lam in [near),
    Lam in [far)): the TAPA paper's Figure 1, its measure of a scheme's distance bias.

    log_weights [..., T, T]: log softmax weights of causal attention (rows are queries). Within
    one row the softmax normaliser cancels, so differences of log weights are differences of
    logits, whatever the scheme's score. Requires far[1] <= T.
    """
    t = log_weights.shape[-1]
    if not (0 <= near[0] < near[1] and 0 <= far[0] < far[1] <= t):
        raise ValueError(f"near={near}, far={far}: need 0 <= lo < hi, and far hi <= T = {t}")
    w = log_weights.reshape(-1, t, t)
    km, kl, kf, ki = jax.random.split(key, 4)
    m = jax.random.randint(km, (num,), 0, w.shape[0])
    lam = jax.random.randint(kl, (num,), *near)
    big = jax.random.randint(kf, (num,), *far)
    i = jax.random.randint(ki, (num,), far[1] - 1, t)  # every sampled key lies in the past
    return w[m, i, i - lam] - w[m, i, i - big]
