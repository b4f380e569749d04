"""ESPR / STRING rotations: commuting skew generators over multi-axis positions.

Positions r in R^{d_c} (d_c = 1 text, 2 image grids, 3 video/3-D). The generators are
L_k = U [(+)_u lambda_{k,u} J (+) 0_{d_null}] U^T for one shared orthogonal basis U, so they
commute by construction; plane u turns by theta_u(r) = beta_u . r with beta_u in R^{d_c}
(beta: [m, d_c]) and R_STR(r) = expm(sum_k r_k L_k) = U [(+)_u R2(theta_u(r)) (+) I] U^T.
In U coordinates the active planes are the interleaved pairs (2u, 2u + 1) of the first
d_act = 2m coordinates, the last d_null = d_h - 2m are null (`carry` hands them out in half
layout, plane u at (u, m + u)).

Score (T4.4): alpha_ij = (2m)^-1/2 q~_i . k~_j with q~ = Pi_act R_STR(r) P Pi_act q, where
P = (I - S)(I + S)^-1 is the Cayley post-rotation of a skew S and Pi_act = U_a U_a^T
(U_a = U[:, :2m]). The outer U cancels in the dot product, so a token is carried as its
active U coordinates, z = R2(theta(r)) W q with the read-in W = U_a^T P U_a U_a^T [2m, d_h]:
one matmul and one elementwise cos/sin. The null part of q and k never reaches the score.
Values are not rotated.

Special cases (tests/positional/test_espr.py): RoPE is d_c = 1, beta_u = omega_u, d_null = 0, P = I and
U the pair layout's permutation; axial 2-D/3-D RoPE is beta_u = omega_u e_axis(u); RoPE-Mixed
is a free beta with U = I.

The relaxed (ESPR) option adds free skew parts to the generators; they then need not commute,
the rotation is a matrix exponential per token, scores are only approximately relative, and
`commutator_norm` reports max_ab |[L_a, L_b]| for a penalty.

`Espr` transports q and k before any attention implementation. `EsprRF` replaces softmax
attention by positive random features phi_w(x) = exp(w.x - |x|^2/2) on q^ = d_act^-1/4 z_q,
k^ = d_act^-1/4 z_k (so q^ . k^ = alpha exactly and E[phi(q^) . phi(k^)] = exp(alpha)), with
causal attention by prefix sums: linear in the sequence length, decoded from a running state.

Shapes: q [B, T, H, D]; k, v [B, T, K, D]; positions [B, T, d_c] (or [B, T] when d_c = 1);
beta [m, d_c]; U, S, P [D, D]; generators [d_c, D, D]; w [n_rf, 2m].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from positional.angles import split_bits, wrap
from positional.linalg import expm
from positional.rope import rope_frequencies, rotate
from positional.scheme import Scheme
from positional.softmax import check_shapes

# ---- generators, rotations, Cayley --------------------------------------------------------------


def check_planes(head_dim: int, num_planes: int) -> int:
    """The number m of active planes (0 means head_dim // 2); 2m must fit in head_dim."""
    m = num_planes or head_dim // 2
    if m < 1 or 2 * m > head_dim:
        raise ValueError(f"espr num_planes={num_planes} needs 1 <= num_planes and 2 * num_planes <= "
                         f"head_dim={head_dim}: each active plane uses two head dimensions")
    return m


def check_positions(positions: jax.Array, num_axes: int) -> jax.Array:
    """positions [B, T] (d_c = 1 only) or [B, T, d_c] -> [B, T, d_c] float32."""
    if positions.ndim == 2 and num_axes == 1:
        positions = positions[..., None]
    if positions.ndim != 3 or positions.shape[-1] != num_axes:
        raise ValueError(f"espr positions must be [B, T, d_c] with d_c = num_axes = {num_axes} "
                         f"(or [B, T] when num_axes = 1); got shape {tuple(positions.shape)}")
    return positions.astype(jnp.float32)


def axial_beta(num_planes: int, num_axes: int, base: float = 10000.0) -> np.ndarray:
    """Axial RoPE frequencies beta_u = omega_u e_axis(u): [m, d_c] float64.

    The planes are split into d_c contiguous groups (the last may be shorter); group a turns
    with axis a at the RoPE frequencies of a 2 * (group size)-dimensional head. d_c = 1 gives
    plain RoPE frequencies.
    """
    per_axis = -(-num_planes // num_axes)
    omega = rope_frequencies(2 * per_axis, base)
    beta = np.zeros((num_planes, num_axes))
    for u in range(num_planes):
        beta[u, u // per_axis] = omega[u % per_axis]
    return beta


def plane_angles(positions: jax.Array, beta: jax.Array) -> jax.Array:
    """theta_u(r) = beta_u . r, wrapped into [-pi, pi): positions [B, T, d_c], beta [m, d_c] -> [B, T, 1, m].

    Each product beta_{u,c} r_c is formed as four exact products of 12-bit halves, each reduced
    by whole turns before the sum, so the angle's error stays near fp32 resolution of [-pi, pi)
    however far the position (a plain fp32 product at r = 65,536 is off by up to 2e-3 rad), and
    no fused multiply-add can change it.
    """
    (rh, rl), (bh, bl) = split_bits(positions[..., None, :], 12), split_bits(beta, 12)
    turns = wrap(rh * bh) + wrap(rh * bl) + wrap(rl * bh) + wrap(rl * bl)
    return wrap(jnp.sum(turns, -1))[:, :, None, :]


def skew(a: jax.Array) -> jax.Array:
    """The skew part (a - a^T) / 2 of a square matrix (the parametrisation of learned S)."""
    return (a - jnp.swapaxes(a, -1, -2)) / 2


def check_skew(s, name: str = "S") -> None:
    """Raise if a concrete s is not skew-symmetric (traced values are taken as built skew)."""
    if isinstance(s, jax.core.Tracer):
        return
    s = np.asarray(s, np.float64)
    if s.ndim < 2 or s.shape[-1] != s.shape[-2]:
        raise ValueError(f"{name} must be a square (skew-symmetric) matrix; got shape {s.shape}")
    err = np.abs(s + np.swapaxes(s, -1, -2)).max()
    if err > 1e-5 * max(1.0, np.abs(s).max()):
        raise ValueError(f"{name} must be skew-symmetric ({name}^T = -{name}) for the Cayley map to be a "
                         f"rotation; max |{name} + {name}^T| = {err:.3g}. Use skew(a) to build one")


@jax.custom_vjp
@jax.jit  # compiled once per shape, also when called outside jit
def _inverse_unit_skew(s: jax.Array) -> jax.Array:
    """(I + S)^-1 for skew S [..., D, D], by Gauss-Jordan elimination without pivoting.

    The symmetric part of I + S is I, and so is that of every Schur complement's (it becomes
    I + s s^T), so every pivot is >= 1 and no pivoting is needed. Plain XLA ops rather than a
    LAPACK call: on CPU the LAPACK solve runs on multi-threaded BLAS, whose threads fight the
    XLA threads for the cores and make each call far slower on a busy machine than the solve
    itself (benchmarks/RESULTS.md, section 'ESPR / STRING').
    """
    n = s.shape[-1]
    eye = jnp.eye(n, dtype=s.dtype)
    aug = jnp.concatenate([eye + s, jnp.broadcast_to(eye, s.shape)], -1)  # [..., D, 2D]

    def eliminate(i, aug):
        row = jax.lax.dynamic_index_in_dim(aug, i, -2, keepdims=False)  # [..., 2D]
        row = row / jax.lax.dynamic_index_in_dim(row, i, -1)
        col = jax.lax.dynamic_index_in_dim(aug, i, -1) * (jnp.arange(n) != i)[:, None]  # [..., D, 1]
        aug = aug - col * row[..., None, :]
        return jax.lax.dynamic_update_index_in_dim(aug, row, i, -2)

    return jax.lax.fori_loop(0, n, eliminate, aug, unroll=8)[..., n:]


def _inverse_unit_skew_fwd(s):
    x = _inverse_unit_skew(s)
    return x, x


def _inverse_unit_skew_bwd(x, g):
    # d(A^-1) = -A^-1 dA A^-1, so the cotangent of A (and of S) is -X^T G X^T.
    xt = jnp.swapaxes(x, -1, -2)
    return (-jnp.matmul(xt, jnp.matmul(g, xt, precision="highest"), precision="highest"),)


_inverse_unit_skew.defvjp(_inverse_unit_skew_fwd, _inverse_unit_skew_bwd)


def cayley(s: jax.Array) -> jax.Array:
    """P = (I - S)(I + S)^-1 = (I + S)^-1 (I - S) = 2 (I + S)^-1 - I for skew S [..., D, D]; P in SO(D).

    I + S is invertible for skew S (its eigenvalues are 1 + i mu); one inverse gives P, once
    per step (it depends on parameters only). fp32 at least.
    """
    check_skew(s)
    s = s.astype(jnp.promote_types(s.dtype, jnp.float32))
    return 2 * _inverse_unit_skew(s) - jnp.eye(s.shape[-1], dtype=s.dtype)


def plane_generators(basis: jax.Array, beta: jax.Array) -> jax.Array:
    """The commuting generators L_k = U [(+)_u beta_{u,k} J (+) 0] U^T: [d_c, D, D].

    basis U [D, D] orthogonal, beta [m, d_c]; plane u is U's columns (2u, 2u + 1).
    """
    m, _ = beta.shape
    a, b = basis[:, 0:2 * m:2], basis[:, 1:2 * m:2]  # [D, m]: the planes' first and second axes
    # J = [[0, -1], [1, 0]] on (e_a, e_b): U J U^T = b a^T - a b^T, summed with weights beta_{u,k}
    return jnp.einsum("iu,ju,uk->kij", b, a, beta) - jnp.einsum("iu,ju,uk->kij", a, b, beta)


def rotation(positions: jax.Array, generators: jax.Array) -> jax.Array:
    """R(r) = expm(sum_k r_k L_k) for any skew generators: positions [..., d_c] -> [..., D, D].

    By matmuls (positional/linalg.py): with jax.scipy.linalg.expm (a batched LAPACK solve) a
    CPU training step of benchmarks/grid2d.py hung."""
    a = jnp.einsum("...c,cij->...ij", positions.astype(generators.dtype), generators)
    return expm(a)


def commutators(generators: jax.Array) -> jax.Array:
    """[L_a, L_b] = L_a L_b - L_b L_a of generators [d_c, D, D]: [d_c, d_c, D, D]."""
    return (jnp.einsum("aij,bjk->abik", generators, generators)
            - jnp.einsum("bij,ajk->abik", generators, generators))


def commutator_norm(generators: jax.Array) -> jax.Array:
    """epsilon_comm = max_{a,b} |[L_a, L_b]| (spectral norm) of generators [d_c, D, D]."""
    return jnp.linalg.norm(commutators(generators), ord=2, axis=(-2, -1)).max()


def read_in(basis: jax.Array, post: jax.Array, num_planes: int) -> jax.Array:
    """W = U_a^T P U_a U_a^T [2m, D]: a head vector to its post-rotated active U coordinates."""
    ua = basis[:, :2 * num_planes]
    return ua.T @ post @ ua @ ua.T


def half_layout(w: jax.Array, axis: int = 0) -> jax.Array:
    """Plane u's two axes (2u, 2u + 1) moved to (u, m + u) along `axis`."""
    return jnp.concatenate([jax.lax.slice_in_dim(w, i, None, 2, axis) for i in (0, 1)], axis)


def carry(x: jax.Array, readin: jax.Array, angles: jax.Array) -> jax.Array:
    """z = R2(theta) W x: x [B, T, H, D], W [2m, D], angles [B, T, 1, m] -> [B, T, H, 2m] fp32,
    plane u at coordinates (u, m + u) (`half_layout`: contiguous halves rotate faster than
    strided pairs; dot products of carried vectors do not see the order)."""
    y = jnp.einsum("bthd,ed->bthe", x.astype(jnp.float32), half_layout(readin.astype(jnp.float32)),
                   precision=jax.lax.Precision.HIGHEST)
    return rotate(y, angles, "half")


def carry_relaxed(x: jax.Array, post: jax.Array, basis: jax.Array, rot: jax.Array) -> jax.Array:
    """z = U_a^T R(r) P Pi_act x for any rotations R(r): -> [B, T, H, 2m] fp32 (half layout).

    x [B, T, H, D]; post = P Pi_act [D, D]; basis = U_a [D, 2m]; rot [B, T, D, D]. With
    commuting plane generators U_a^T R(r) = R2(theta) U_a^T and this equals `carry`.
    """
    hi = jax.lax.Precision.HIGHEST
    y = jnp.einsum("bthd,ed->bthe", x.astype(jnp.float32), post, precision=hi)
    y = jnp.einsum("btij,bthj->bthi", rot, y, precision=hi)
    return jnp.einsum("ia,bthi->btha", half_layout(basis, 1), y, precision=hi)


# ---- positive random features -------------------------------------------------------------------


def draw_features(key: jax.Array, num_features: int, dim: int) -> jax.Array:
    """w_t ~ N(0, I_dim), i.i.d.: [n_rf, dim] fp32."""
    return jax.random.normal(key, (num_features, dim), jnp.float32)


def positive_features(x: jax.Array, w: jax.Array, shift: jax.Array | float = 0.0) -> jax.Array:
    """Phi(x) = n_rf^-1/2 [exp(w_t . x - |x|^2/2 - shift)]_t: x [..., d], w [n, d] -> [..., n] fp32.

    E[Phi(x) . Phi(y)] = exp(x . y) when shift = 0; a shift scales every feature alike, which
    the attention ratio cancels, and keeps the exponentials in range.
    """
    x = x.astype(jnp.float32)
    logits = jnp.einsum("...d,nd->...n", x, w, precision=jax.lax.Precision.HIGHEST)
    return jnp.exp(logits - 0.5 * jnp.sum(x * x, -1, keepdims=True) - shift) * w.shape[0] ** -0.5


def _log_features(q, k, w):
    """Stabilised log-features: per feature t, exp(|w_t|^2/2) moves from the key to the query side.

    lk_t = w_t . k - |k|^2/2 - |w_t|^2/2 = -|k - w_t|^2/2 <= 0 never overflows, and its shift
    depends on neither the data nor the position, so causality and the running decode state
    stay exact; the query side w_t . q + |w_t|^2/2 is shifted by its own max over t, which
    cancels in the ratio out = Phi(q)^T sum Phi(k) v^T / Phi(q)^T sum Phi(k).
    q [B, T, K, G, d], k [B, S, K, d] -> ([B, T, K, G, n], [B, S, K, n]).
    """
    hi = jax.lax.Precision.HIGHEST
    half_w2 = 0.5 * jnp.sum(w * w, -1)
    lq = jnp.einsum("btkgd,nd->btkgn", q.astype(jnp.float32), w, precision=hi) + half_w2
    lq = lq - jax.lax.stop_gradient(lq.max(-1, keepdims=True))
    kf = k.astype(jnp.float32)
    lk = jnp.einsum("bskd,nd->bskn", kf, w, precision=hi) - 0.5 * jnp.sum(kf * kf, -1, keepdims=True)
    return lq, lk - half_w2


_TINY = 1e-30  # below it a denominator counts as 0: a row whose every key underflowed, a padded row


def _ratio(num, den):
    """num / den; num itself (about 0 too) where den < _TINY (a floor of 1, not of _TINY: the gradient
    divides by den^2, which would underflow to 0 and give NaN even where the cotangent is 0)."""
    return num / jnp.where(den < _TINY, 1.0, den)


def rf_reference(q, k, v, w, *, segment_ids=None, q_offset: int = 0) -> jax.Array:
    """Causal random-feature attention, obviously correct: builds the [T, S] kernel matrix.

    q [B, T, H, d], k [B, S, K, d], v [B, S, K, dv], w [n, d] -> [B, T, H, dv] (v's dtype).
    """
    check_shapes(q, k, v, segment_ids)
    b, t, h, d = q.shape
    kh = k.shape[2]
    lq, lk = _log_features(q.reshape(b, t, kh, h // kh, d), k, w)
    a = jnp.einsum("btkgn,bskn->bkgts", jnp.exp(lq), jnp.exp(lk), precision=jax.lax.Precision.HIGHEST)
    qi, kj = q_offset + jnp.arange(t), jnp.arange(k.shape[1])
    mask = kj[None, :] <= qi[:, None]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None, None]
    a = jnp.where(mask, a, 0.0)
    out = jnp.einsum("bkgts,bskd->btkgd", a, v.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    den = jnp.moveaxis(a.sum(-1), -1, 1)[..., None]  # [B, T, K, G, 1]
    return _ratio(out, den).reshape(b, t, h, -1).astype(v.dtype)


def _rf_chunk(state, fq, fk, v, seg):
    """One chunk of causal prefix-sum attention, after the state of earlier chunks.

    state: (kv [B, K, n, dv], norm [B, K, n], seg [B]) sums of Phi(k) v^T and Phi(k) over
    earlier keys of the segment `seg`; fq [B, C, K, G, n], fk [B, C, K, n], v [B, C, K, dv],
    seg [B, C]. Segments are contiguous (packing), so the state carried out holds only the
    keys of the chunk's last segment. Returns (num [B, C, K, G, dv], den [B, C, K, G], state).
    """
    kv, norm, seg_state = state
    hi = jax.lax.Precision.HIGHEST
    sees_state = (seg == seg_state[:, None])[:, :, None, None]
    num = jnp.einsum("bckgn,bknd->bckgd", fq, kv, precision=hi) * sees_state[..., None]
    den = jnp.einsum("bckgn,bkn->bckg", fq, norm, precision=hi) * sees_state
    c = seg.shape[1]
    mask = (jnp.tril(jnp.ones((c, c), bool))[None] & (seg[:, :, None] == seg[:, None, :]))[:, None, None]
    a = jnp.where(mask, jnp.einsum("btkgn,bskn->bkgts", fq, fk, precision=hi), 0.0)
    num = num + jnp.einsum("bkgts,bskd->btkgd", a, v, precision=hi)
    den = den + jnp.moveaxis(a.sum(-1), -1, 1)
    last = seg[:, -1]
    keep = (seg_state == last).astype(kv.dtype)
    fk_last = fk * (seg == last[:, None]).astype(fk.dtype)[:, :, None, None]
    kv = kv * keep[:, None, None, None] + jnp.einsum("bskn,bskd->bknd", fk_last, v, precision=hi)
    norm = norm * keep[:, None, None] + fk_last.sum(1)
    return num, den, (kv, norm, last)


def rf_blockwise(q, k, v, w, *, segment_ids=None, chunk_size: int = 512) -> jax.Array:
    """Causal random-feature attention by prefix sums over chunks: O(T n (d + dv)) time,
    O(chunk^2 + n dv) working memory per head beyond the features. Same shapes as `rf_reference`.
    """
    b, t, h, d = q.shape
    kh, dv = k.shape[2], v.shape[-1]
    if k.shape[1] != t:
        raise ValueError(f"rf_blockwise attends a sequence to itself: q{q.shape} and k{k.shape} "
                         "lengths differ")
    lq, lk = _log_features(q.reshape(b, t, kh, h // kh, d), k, w)
    fq, fk = jnp.exp(lq), jnp.exp(lk)
    c = min(chunk_size, t)
    nc = -(-t // c)
    pad = nc * c - t
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    # Padded tokens come last, in a segment of their own; their outputs are dropped.
    seg = jnp.pad(seg, ((0, 0), (0, pad)), constant_values=jnp.iinfo(jnp.int32).min)

    def chunks(x):
        x = jnp.pad(x, ((0, 0), (0, nc * c - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, nc, c, *x.shape[2:]), 1, 0)

    def step(state, xs):
        num, den, state = _rf_chunk(state, *xs)
        return state, _ratio(num, den[..., None])

    n = w.shape[0]
    init = (jnp.zeros((b, kh, n, dv), jnp.float32), jnp.zeros((b, kh, n), jnp.float32), seg[:, 0])
    _, out = jax.lax.scan(step, init, (chunks(fq), chunks(fk), chunks(v.astype(jnp.float32)), chunks(seg)))
    out = jnp.moveaxis(out, 0, 1).reshape(b, nc * c, h, dv)[:, :t]
    return out.astype(v.dtype)


# ---- schemes ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Espr(Scheme):
    """ESPR / STRING transport of q and k.

    Learned per layer, shared by the heads: beta [m, d_c], starting at axial RoPE frequencies; the
    basis U = Cayley(skew(A_U)) and the post-rotation P = Cayley(skew(A_P)), starting at I
    (A = 0), so the layer starts as axial RoPE; with `relaxed`, the generators' free skew parts
    skew(E_k), starting at 0. With `learned` False nothing is learned: axial RoPE, U = P = I.
    EsprRF also draws w [n_rf, 2m] ~ N(0, I): from `rng` every forward pass, or fixed by
    `draw_seed` >= 0.

    features: 'beta' [m, d_c] and 'readin' W [2m, D]; with `relaxed`, also 'generators'
    [d_c, D, D], 'post' = P Pi_act [D, D], 'basis' = U_a [D, 2m] and 'commutator_norm'.
    """
    num_axes: int = 1  # d_c, the number of position coordinates
    num_planes: int = 0  # m active planes; 0 means head_dim // 2 (no null dimensions)
    learned: bool = True  # learn beta, U and S; False: axial RoPE frequencies, U = I, P = I
    relaxed: bool = False  # free skew parts in the generators (non-commuting, ESPR proper)
    base: float = 10000.0  # RoPE base of the initial (or fixed) frequencies

    needs_features = True

    def __post_init__(self):
        super().__post_init__()
        if self.num_axes < 1:
            raise ValueError(f"espr num_axes (d_c) must be >= 1; got num_axes={self.num_axes}")
        check_planes(self.head_dim, self.num_planes)

    @property
    def planes(self) -> int:
        return check_planes(self.head_dim, self.num_planes)

    @property
    def relative(self) -> bool:
        return not self.relaxed  # non-commuting generators are only approximately relative

    def features_from(self, beta, basis, post, drift=None, key=None) -> dict:
        """The hooks' features from the learned parts: beta [m, d_c], the basis U and the
        post-rotation P [D, D], with `relaxed` the generators' free skew parts drift [d_c, D, D];
        with random features, w drawn from `key` (or the `draw_seed` option)."""
        m = self.planes
        out = {"beta": beta, "readin": read_in(basis, post, m)}
        if self.relaxed:
            ua = basis[:, :2 * m]
            generators = plane_generators(basis, beta) + skew(drift)
            out.update(generators=generators, post=post @ ua @ ua.T, basis=ua,
                       commutator_norm=commutator_norm(generators))
        if self.random_features:
            out["w"] = draw_features(self.draw_key(key), self.num_features, 2 * m)
        return out

    def init_parameters(self, keys, model):
        d = self.head_dim
        out = {}
        if self.learned:
            out = {"beta": jnp.asarray(self._axial_beta()), "basis_skew": jnp.zeros((d, d), jnp.float32),
                   "post_skew": jnp.zeros((d, d), jnp.float32)}
        if self.relaxed:
            out["drift"] = jnp.zeros((self.num_axes, d, d), jnp.float32)
        return out

    def features(self, params, x, *, tokens, index, segment_ids=None, rng=None, past=None):
        if self.learned:
            beta = params["beta"]
            basis, post = (cayley(skew(params[name])) for name in ("basis_skew", "post_skew"))
        else:
            beta = jnp.asarray(self._axial_beta())
            basis = post = jnp.eye(self.head_dim, dtype=jnp.float32)
        return self.features_from(beta, basis, post, params.get("drift"), rng)

    def default_features(self, q, k, *, positions, key=None, segment_ids=None):
        """Axial RoPE frequencies, U = P = I, no drift: the parameters at initialisation."""
        eye = jnp.eye(self.head_dim, dtype=jnp.float32)
        return self.features_from(jnp.asarray(self._axial_beta()), eye, eye,
                                  jnp.zeros((self.num_axes,) + eye.shape, jnp.float32), key)

    def _axial_beta(self) -> np.ndarray:
        return np.asarray(axial_beta(self.planes, self.num_axes, self.base), np.float32)

    def carry(self, x, features, positions):
        """Active U coordinates of the transported x: [B, T, H, 2m] fp32."""
        r = check_positions(positions, self.num_axes)
        if self.relaxed:
            rot = rotation(r, features["generators"])
            return carry_relaxed(x, features["post"], features["basis"], rot)
        return carry(x, features["readin"], plane_angles(r, features["beta"]))

    def transform(self, q, k, v, features, positions):
        # Zero-padded back to D, with q rescaled so the attention's D^-1/2 becomes (2m)^-1/2.
        pad = [(0, 0)] * 3 + [(0, self.head_dim - 2 * self.planes)]
        zq = self.carry(q, features, positions) * (self.head_dim / (2 * self.planes)) ** 0.5
        zk = self.carry(k, features, positions)
        return jnp.pad(zq, pad).astype(q.dtype), jnp.pad(zk, pad).astype(k.dtype), v

    def decode_step(self, cache, q, k, v, features=None, positions=None):
        if positions is None and self.num_axes > 1:
            raise ValueError(f"espr with num_axes={self.num_axes} cannot infer positions when decoding: "
                             "pass positions [B, n, d_c] for the new tokens")
        return super().decode_step(cache, q, k, v, features, positions=positions)


@dataclasses.dataclass(frozen=True)
class EsprRF(Espr):
    """ESPR transport with positive-random-feature attention (linear time); features add 'w'.

    Not relative for a fixed draw w: shifting every position rotates q^, k^ and hence what w
    sees; scores are shift-invariant only in distribution over w (tests/positional/test_espr.py).
    """
    num_features: int = 128  # n_rf
    draw_seed: int = -1  # >= 0 fixes the draw; otherwise a fresh draw per forward pass (key)

    impls = ("reference", "blockwise")
    relative = False
    random_features = True

    def __post_init__(self):
        super().__post_init__()
        if self.num_features < 1:
            raise ValueError(f"espr_rf num_features must be >= 1; got num_features={self.num_features}")
        if self.biases:
            raise ValueError("espr_rf replaces softmax attention by random features, which cannot take "
                             "an additive logit bias; use espr with '+' instead")

    def transform(self, q, k, v, features, positions):
        # q^ = d_act^-1/4 z_q, k^ = d_act^-1/4 z_k, so q^ . k^ = alpha_ij.
        scale = (2 * self.planes) ** -0.25
        return (self.carry(q, features, positions) * scale, self.carry(k, features, positions) * scale, v)

    def transformed_attention(self, q, k, v, features, *, positions=None, segment_ids=None, q_offset=0, impl="reference",
                  block_size=512):
        if impl == "blockwise":
            return rf_blockwise(q, k, v, features["w"], segment_ids=segment_ids, chunk_size=block_size)
        return rf_reference(q, k, v, features["w"], segment_ids=segment_ids, q_offset=q_offset)

    def init_cache(self, batch, max_len, num_kv_heads, dtype=jnp.float32):
        """A running prefix-sum state; its size does not grow with the sequence (max_len unused)."""
        n = self.num_features
        return {"kv": jnp.zeros((batch, num_kv_heads, n, self.head_dim), jnp.float32),
                "norm": jnp.zeros((batch, num_kv_heads, n), jnp.float32),
                "index": jnp.zeros((), jnp.int32)}

    def decode_step(self, cache, q, k, v, features=None, positions=None):
        b, n = q.shape[:2]
        if positions is None:
            if self.num_axes > 1:
                return super().decode_step(cache, q, k, v, features)  # raises the readable error
            positions = jnp.broadcast_to(cache["index"] + jnp.arange(n, dtype=jnp.int32), (b, n))
        q, k, v = self.transform(q, k, v, features, positions)
        kh, h = k.shape[2], q.shape[2]
        lq, lk = _log_features(q.reshape(b, n, kh, h // kh, -1), k, features["w"])
        zeros = jnp.zeros((b, n), jnp.int32)  # one segment: decoding continues one sequence
        num, den, (kv, norm, _) = _rf_chunk((cache["kv"], cache["norm"], zeros[:, 0]), jnp.exp(lq),
                                            jnp.exp(lk), v.astype(jnp.float32), zeros)
        out = _ratio(num, den[..., None]).reshape(b, n, h, -1).astype(v.dtype)
        return out, {"kv": kv, "norm": norm, "index": cache["index"] + n}
