"""PaTH: attention along an accumulated product of data-dependent Householder transforms.

Each token t emits a unit vector w_t and a gain beta_t in (0, 2): H_t = I - beta_t w_t w_t^T
(orthogonal when beta_t = 2, the identity when beta_t = 0). The logit of query i on key j is

    s_ij = q_i^T H_i H_{i-1} ... H_{j+1} k_j / sqrt(D)                    (the route (j, i])

Route convention, as in PaTH (Yang et al. 2025): the route from key j to query i holds the
steps of tokens j+1..i, the query's own step included and the key's excluded, so a key is
carried forward by every token that arrives after it. The accumulated-transformations paper
writes routes as the steps of tokens j..i-1 (P_{j->i} = M_{i-1}^{-1} ... M_j^{-1}); the two
are the same family with the step index shifted by one (its M_{t-1}^{-1} is our H_t), which
only changes which token's hidden state emits a step. Values are not transported.

Algorithms, all exact (tests/test_householder.py compares values and gradients):
  route_products     the dense products P[i, j] [T, T, D, D]: obviously correct, small T only;
  ut_matrix          the UT transform: H_n ... H_1 = I - W^T U W with U = (I + diag(beta) L)^-1
                     diag(beta), L the strictly lower part of W W^T (a unit-lower-triangular
                     solve). A contiguous range of steps uses the diagonal block of the same U,
                     which gives every route at once (`path_scores`, O(T^2) memory; with
                     `chunk`, one solve per chunk and a scan carrying earlier keys forward);
  chunk_products     each chunk's product in that compact form, combined across chunks by
                     `jax.lax.associative_scan`: the suffix products that carry every key to
                     the end of the sequence (a decode cache prefilled in parallel);
  chunked_attention  flash-style: keys carried to the end of their chunk, queries carried
                     back one chunk at a time, online softmax; O(T * D) memory.

Shapes: q [B, T, H, D]; k, v, w [B, T, K, D]; beta [B, T, K] (K kv heads, H % K == 0: a
query head reads the transport of its kv head).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from positional.attention import attention
from positional.softmax import MASKED, check_shapes
from positional.linalg import unit_lower_inverse
from positional.scheme import Scheme

HIGHEST = jax.lax.Precision.HIGHEST


def check_transport(k, w, beta) -> None:
    """Shapes always; beta's range [0, 2] where its values are known (not under jit)."""
    if w.shape != k.shape:
        raise ValueError(f"Householder vectors w{w.shape} must have the keys' shape k{k.shape}")
    if beta.shape != k.shape[:3]:
        raise ValueError(f"Householder gains beta{beta.shape} must be [B, T, K] = {k.shape[:3]}")
    if not isinstance(beta, jax.core.Tracer) and not bool(jnp.all((beta >= 0) & (beta <= 2))):
        raise ValueError(f"Householder gains must lie in [0, 2] (H = I - beta w w^T is then a contraction); "
                         f"got beta in [{float(beta.min())}, {float(beta.max())}]")


# ---- dense references ------------------------------------------------------------------------

def householder_matrices(w, beta) -> jax.Array:
    """H_t = I - beta_t w_t w_t^T: w [..., D], beta [...] -> [..., D, D] fp32."""
    w = w.astype(jnp.float32)
    return jnp.eye(w.shape[-1]) - beta[..., None, None] * w[..., :, None] * w[..., None, :]


def route_products(w, beta) -> jax.Array:
    """P[i, j] = H_i ... H_{j+1} for j <= i (the identity at j = i), 0 above the diagonal.

    w [T, D], beta [T] -> [T, T, D, D]. Row i is built from row i-1 by one left product.
    """
    h = householder_matrices(w, beta)
    t, d = w.shape
    eye = jnp.eye(d)

    def step(prev, i):  # prev[j] = P[i-1, j]
        row = jnp.where((jnp.arange(t) < i)[:, None, None], jnp.matmul(h[i], prev, precision=HIGHEST), 0.0)
        row = row.at[i].set(eye)
        return row, row

    return jax.lax.scan(step, jnp.zeros((t, d, d)), jnp.arange(t))[1]


# ---- the UT transform -------------------------------------------------------------------------

def ut_matrix(w, beta) -> jax.Array:
    """U with H_n ... H_1 = I - W^T U W, lower triangular: w [..., n, D], beta [..., n] -> [..., n, n].

    Writing the product as I - W^T X gives x_t = beta_t (w_t - sum_{s<t} x_s (w_s . w_t)),
    i.e. (I + diag(beta) L) X = diag(beta) W with L = strict_lower(W W^T). fp32.
    """
    w = w.astype(jnp.float32)
    beta = beta.astype(jnp.float32)
    n = w.shape[-2]
    gram = jnp.einsum("...sd,...td->...st", w, w, precision=HIGHEST)
    return unit_lower_inverse(jnp.eye(n) + beta[..., :, None] * jnp.tril(gram, -1)) * beta[..., None, :]


def _route_terms(q, k, w, u):
    """The pieces of q_i^T (I - W_r^T U_r W_r) k_j for all routes r = (j, i] inside one range.

    q [..., n, D]; k, w [..., n, D]; u [..., n, n] (leading axes broadcast) -> (qw masked to
    s <= i, wk masked to t > j), each [..., n, n]; the route term of (i, j) is (qw @ u @ wk)[i, j].
    """
    n = w.shape[-2]
    i = jnp.arange(n)
    qw = jnp.matmul(q, jnp.swapaxes(w, -1, -2), precision=HIGHEST) * (i[None, :] <= i[:, None])
    wk = jnp.matmul(w, jnp.swapaxes(k, -1, -2), precision=HIGHEST) * (i[:, None] > i[None, :])
    return qw, wk


def path_scores(q, k, w, beta, chunk: int | None = None) -> jax.Array:
    """Unscaled logits q_i^T H_i ... H_{j+1} k_j for all j <= i (garbage above the diagonal).

    q [B, K, G, T, D]; k, w [B, K, T, D]; beta [B, K, T] -> [B, K, G, T, T] fp32. With chunk
    None (or >= T) one T x T unit-lower-triangular solve per kv head gives every route (the
    UT form over the whole range). Otherwise one solve per chunk of `chunk` tokens: a scan
    over query chunks m carries all earlier keys to the start of chunk m (one D x D operator
    per chunk), so the solves cost O(T * chunk^2) instead of O(T^3); the logits are the same.
    """
    b, kh, g, t, d = q.shape
    c = t if chunk is None else min(chunk, t)
    n = -(-t // c)
    f32 = jnp.float32
    qc, kc, wc = (_chunked(jnp.moveaxis(x.astype(f32), -2, 1), c) for x in (q, k, w))  # [B, N, c, ...]
    qc = jnp.moveaxis(qc, (1, 2), (-3, -2))  # [B, K, G, N, c, D]
    kc, wc = (jnp.moveaxis(x, (1, 2), (-3, -2)) for x in (kc, wc))  # [B, K, N, c, D]
    u = ut_matrix(wc, jnp.moveaxis(_chunked(jnp.moveaxis(beta, -1, 1), c), -1, 1))  # [B, K, N, c, c]
    k_end, uk = _carry_to_chunk_end(kc, wc, u)
    qw, _ = _route_terms(qc, kc[:, :, None], wc[:, :, None], u[:, :, None])
    near = jnp.einsum("bkgnid,bknjd->bkgnij", qc, kc, precision=HIGHEST) - jnp.matmul(
        qw, uk[:, :, None], precision=HIGHEST)  # routes inside a chunk
    if n == 1:
        return near[:, :, :, 0, :t, :t]
    q_start = qc - jnp.matmul(jnp.matmul(qw, u[:, :, None], precision=HIGHEST), wc[:, :, None],
                              precision=HIGHEST)  # queries carried back to their chunk's start
    ops = dense_product(wc, u)  # whole-chunk operators [B, K, N, D, D]

    def step(carried, x):  # carried [B, K, N * c, D]: keys of chunks < m at the start of chunk m, else 0
        qs, near_m, k_end_m, op, m = x
        s = jnp.einsum("bkgid,bkjd->bkgij", qs, carried, precision=HIGHEST)
        s = jax.lax.dynamic_update_slice_in_dim(s, near_m, m * c, axis=-1)
        carried = jnp.einsum("bkjd,bked->bkje", carried, op, precision=HIGHEST)  # past chunk m
        return jax.lax.dynamic_update_slice_in_dim(carried, k_end_m, m * c, axis=2), s

    xs = (q_start, near, k_end, ops, jnp.arange(n))
    xs = tuple(jnp.moveaxis(x, 3 if x.ndim == 6 else 2, 0) for x in xs[:4]) + xs[4:]
    _, s = jax.lax.scan(step, jnp.zeros((b, kh, n * c, d), f32), xs)  # [N, B, K, G, c, N * c]
    return jnp.moveaxis(s, 0, 3).reshape(b, kh, g, n * c, n * c)[..., :t, :t]


def _heads_first(q, k, w, beta):
    b, t, h, d = q.shape
    kh = k.shape[2]
    qh = jnp.moveaxis(q.reshape(b, t, kh, h // kh, d), 1, 3)  # [B, K, G, T, D]
    return qh, jnp.moveaxis(k, 1, 2), jnp.moveaxis(w, 1, 2), jnp.moveaxis(beta, 1, 2)


def dense_score_fn(w, beta, scale, chunk: int | None = None):
    """A `ScoreFn` for the reference attention (whole sequence in one block: q_offset 0)."""
    def score(qb, kb, qi, kj):  # qb [B, T, K, G, D], kb [B, T, K, D]
        kb, wh, bh = (jnp.moveaxis(x, 1, 2) for x in (kb, w, beta))
        return path_scores(jnp.moveaxis(qb, 1, 3), kb, wh, bh, chunk) * scale
    return score


# ---- chunks ------------------------------------------------------------------------------------

def _chunked(x, c, pad_value=0, n=None):
    """[B, T, ...] -> [B, N, c, ...], padding T up to N * c (N = ceil(T / c) unless given)."""
    b, t = x.shape[:2]
    n = n or -(-t // c)
    x = jnp.pad(x, [(0, 0), (0, n * c - t)] + [(0, 0)] * (x.ndim - 2), constant_values=pad_value)
    return x.reshape(b, n, c, *x.shape[2:])


def apply_product(x, w, u, transpose=False):
    """Rows x [..., m, D] times I - W^T U W (or its transpose): x - ((x W^T) U) W."""
    u = jnp.swapaxes(u, -1, -2) if transpose else u
    xw = jnp.einsum("...md,...nd->...mn", x, w, precision=HIGHEST)
    return x - jnp.einsum("...mn,...nd->...md", jnp.matmul(xw, jnp.swapaxes(u, -1, -2), precision=HIGHEST),
                          w, precision=HIGHEST)


def _carry_to_chunk_end(k, w, u):
    """Keys k [..., c, D] carried to the end of their chunk, and u @ wk (the route terms' right half)."""
    _, wk = _route_terms(k, k, w, u)
    uk = jnp.matmul(u, wk, precision=HIGHEST)
    return k - jnp.matmul(jnp.swapaxes(uk, -1, -2), w, precision=HIGHEST), uk


def dense_product(w, u) -> jax.Array:
    """I - W^T U W as a D x D matrix: w [..., c, D], u [..., c, c] -> [..., D, D]."""
    return jnp.eye(w.shape[-1]) - jnp.einsum("...sd,...st,...te->...de", w, u, w, precision=HIGHEST)


def chunk_products(w, beta, chunk: int) -> jax.Array:
    """Dense products of whole chunks P_c = H_{last} ... H_{first}: w [B, T, K, D] -> [B, N, K, D, D]."""
    wc = jnp.moveaxis(_chunked(w.astype(jnp.float32), chunk), 3, 2)  # [B, N, K, c, D]
    return dense_product(wc, ut_matrix(wc, jnp.moveaxis(_chunked(beta, chunk), 3, 2)))


def transport_to_end(k, w, beta, chunk: int = 64) -> jax.Array:
    """Every key carried to the last position: k_j -> H_{T-1} ... H_{j+1} k_j, [B, T, K, D] fp32.

    Inside a chunk by the UT form; across chunks by the suffix products of whole-chunk
    operators, computed with `jax.lax.associative_scan` on [N, D, D] (never T x T x D x D).
    """
    b, t, kh, d = k.shape
    kc = jnp.moveaxis(_chunked(k.astype(jnp.float32), chunk), 3, 2)  # [B, N, K, c, D]
    wc = jnp.moveaxis(_chunked(w.astype(jnp.float32), chunk), 3, 2)
    u = ut_matrix(wc, jnp.moveaxis(_chunked(beta, chunk), 3, 2))
    to_chunk_end, _ = _carry_to_chunk_end(kc, wc, u)
    ops = dense_product(wc, u)  # [B, N, K, D, D]
    # after[c] = P_{N-1} ... P_{c+1}: a reverse scan of left products, shifted by one chunk.
    suffix = jax.lax.associative_scan(lambda a, b: jnp.matmul(a, b, precision=HIGHEST), ops, reverse=True,
                                      axis=1)
    after = jnp.concatenate([suffix[:, 1:], jnp.broadcast_to(jnp.eye(d), ops[:, :1].shape)], axis=1)
    out = jnp.einsum("bnkde,bnkce->bnkcd", after, to_chunk_end, precision=HIGHEST)
    return jnp.moveaxis(out, 2, 3).reshape(b, -1, kh, d)[:, :t]


def chunked_attention(q, k, v, w, beta, *, bias_fn=None, segment_ids=None, chunk: int = 64,
                      group: int = 8, scale: float | None = None) -> jax.Array:
    """PaTH attention with O(T * D) memory: returns [B, T, H, D] in q's dtype.

    For query chunk c and key chunk m < c the route splits as (prefix of chunk c up to i) x
    P_{c-1} ... P_{m+1} x (suffix of chunk m after j). Keys are carried to the end of their
    chunk once; queries are carried to the start of theirs, then back one whole chunk per
    step of a scan over the chunk distance, with an online softmax. Query chunks go `group`
    at a time (so one step's tiles stay in cache), and a group skips the distances that
    would take all its chunks before the start.
    """
    check_shapes(q, k, v, segment_ids)
    check_transport(k, w, beta)
    b, t, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    scale = d ** -0.5 if scale is None else scale
    c = min(chunk, t)
    gq = min(group, -(-t // c))
    n = -(-t // (c * gq)) * gq  # chunks, a whole number of groups
    f32 = jnp.float32
    qc = _chunked(q.astype(f32).reshape(b, t, kh, g, d), c, n=n)
    qc = jnp.moveaxis(qc, (3, 4), (1, 2))  # [B,K,G,N,c,D]
    kc, vc, wc = (jnp.moveaxis(_chunked(x.astype(f32), c, n=n), 3, 1) for x in (k, v, w))  # [B,K,N,c,D]
    u = ut_matrix(wc, jnp.moveaxis(_chunked(beta, c, n=n), 3, 1))  # [B,K,N,c,c]; padding: beta 0, H = I
    seg = _chunked(jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids, c, -1, n)  # [B,N,c]
    pos = jnp.arange(n * c).reshape(n, c)

    k_end, uk = _carry_to_chunk_end(kc, wc, u)  # keys at their chunk's end; uk [B,K,N,c,c]
    # Whole-chunk operators P_m = I - W^T U W as dense D x D matrices: carrying a query past a
    # chunk is then one matmul instead of three (when D <= c, as with 64-dim heads).
    ops = None
    if d <= c:
        ops = dense_product(wc, u)
    qw, _ = _route_terms(qc, kc[:, :, None], wc[:, :, None], u[:, :, None])
    q_start = qc - jnp.matmul(jnp.matmul(qw, u[:, :, None], precision=HIGHEST), wc[:, :, None],
                              precision=HIGHEST)  # queries at their chunk's start

    def scores(s, qpos, kpos, qseg, kseg):  # s [B,K,G,M,c,c] unscaled; pos [M,c]; seg [B,M,c]
        s = s * scale
        if bias_fn is not None:
            m = qpos.shape[0]
            bias = jax.vmap(bias_fn, in_axes=(0, 0), out_axes=2)(qpos, kpos)  # [B|1, H|1, M, c, c]
            bias = jnp.broadcast_to(bias, (bias.shape[0], h, m, c, c)).reshape(bias.shape[0], kh, g, m, c, c)
            s = s + bias.astype(f32)
        ok = (kpos[:, None, :] <= qpos[:, :, None]) & (kpos[:, None, :] < t)
        ok = ok[None] & (qseg[..., :, None] == kseg[..., None, :])  # [B,N,c,c]
        return jnp.where(ok[:, None, None], s, MASKED)

    s = jnp.einsum("bkgnid,bknjd->bkgnij", qc, kc, precision=HIGHEST) - jnp.matmul(
        qw, uk[:, :, None], precision=HIGHEST)
    s = scores(s, pos, pos, seg, seg)
    m0 = s.max(-1)
    p = jnp.exp(s - m0[..., None])
    near = (q_start, m0, p.sum(-1), jnp.einsum("bkgnij,bknjd->bkgnid", p, vc, precision=HIGHEST))

    def query_group(first):  # query chunks first .. first + gq - 1
        ids = first + jnp.arange(gq)
        qseg = jax.lax.dynamic_slice_in_dim(seg, first, gq, axis=1)

        def far(state, delta):  # query chunk ids[i] sees key chunk ids[i] - delta
            def update(state):
                qt, m, row_sum, acc = state
                src = jnp.clip(ids - delta, 0)
                kt, vt = (jnp.take(x, src, axis=2) for x in (k_end, vc))
                kseg = jnp.where((ids >= delta)[None, :, None], jnp.take(seg, src, axis=1), -2)
                s = jnp.einsum("bkgnid,bknjd->bkgnij", qt, kt, precision=HIGHEST)
                s = scores(s, pos[ids], pos[src], qseg, kseg)
                m_new = jnp.maximum(m, s.max(-1))
                p = jnp.exp(s - m_new[..., None])
                corr = jnp.exp(m - m_new)
                acc = acc * corr[..., None] + jnp.einsum("bkgnij,bknjd->bkgnid", p, vt, precision=HIGHEST)
                if ops is None:  # past chunk src: q <- P_src^T q
                    wt, ut = (jnp.take(x, src, axis=2) for x in (wc, u))
                    qt = apply_product(qt, wt[:, :, None], ut[:, :, None], transpose=True)
                else:
                    qt = jnp.matmul(qt, jnp.take(ops, src, axis=2)[:, :, None], precision=HIGHEST)
                return qt, m_new, row_sum * corr + p.sum(-1), acc

            # At distances beyond the group's last chunk every key chunk is before the start.
            return jax.lax.cond(delta < first + gq, jax.checkpoint(update), lambda s: s, state), None

        state = tuple(jax.lax.dynamic_slice_in_dim(x, first, gq, axis=3) for x in near)
        (_, _, row_sum, acc), _ = jax.lax.scan(far, state, jnp.arange(1, n))
        return acc / row_sum[..., None]  # [B,K,G,gq,c,D]

    o = jax.lax.map(jax.checkpoint(query_group), jnp.arange(0, n, gq))  # [N/gq,B,K,G,gq,c,D]
    o = jnp.moveaxis(o, 0, 3).reshape(b, kh, g, n, c, d)
    o = jnp.moveaxis(o, (1, 2), (3, 4)).reshape(b, n * c, h, d)[:, :t]
    return o.astype(q.dtype)


# ---- the scheme -------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Path(Scheme):
    """PaTH transport of keys; `features` = {'w': [B, T, K, D] unit, 'beta': [B, T, K] in (0, 2)}.

    impl "reference" materialises the T x T logits (`path_scores`, one UT solve per
    `solve_chunk` tokens), "blockwise" is the flash-style chunked form with `block_size` tokens
    per chunk and O(T * D) memory. The decode cache holds keys already carried to the latest
    token; each new token applies its H_t to all of them (O(T * D) per token).
    """
    rank: int = 32  # w = normalise(conv(W_up W_down x)): the rank of that projection
    conv: int = 3  # width of the short causal convolution in w (0: none); 3 as the public layer
    qk_norm: bool = False  # RMS-normalise q and k per head (parameter-free) before the transport
    solve_chunk: int = 64  # impl "reference": tokens per UT solve in the logits (0: one solve over T)

    relative = False  # routes depend on the tokens between, not on positions
    has_score = needs_features = default_key = True
    probes = ("householder",)
    # The reference form materialises the logits with one UT solve per 64 tokens (the fastest at
    # training lengths); from eval.blockwise_from on, the chunked algorithm runs 64-token chunks.
    config_defaults = {"block_size": 64}

    def __post_init__(self):
        super().__post_init__()
        for name, least in (("rank", 1), ("conv", 0), ("solve_chunk", 0)):
            if getattr(self, name) < least:
                raise ValueError(f"PaTH option {name}={getattr(self, name)} must be >= {least}")

    def transform(self, q, k, v, features, positions):
        if self.qk_norm:
            q, k = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
                    .astype(x.dtype) for x in (q, k))
        return q, k, v

    def score_fn(self, features):  # the whole sequence as one block: reference attention only
        w, beta = features["w"], features["beta"]
        return dense_score_fn(w, beta, self.head_dim ** -0.5, self.solve_chunk or None)

    def default_features(self, q, k, *, positions, key=None, segment_ids=None):
        """Steps of random directions (uniform on the sphere, drawn from `key`) with beta = 1,
        the gain of the features module at its initialisation."""
        w = jax.random.normal(self.draw_key(key), k.shape, jnp.float32)
        return {"w": w * jax.lax.rsqrt(jnp.sum(w * w, -1, keepdims=True)), "beta": jnp.ones(k.shape[:3], jnp.float32)}

    def attention(self, q, k, v, features, *, positions=None, segment_ids=None, q_offset=0, impl="reference",
                  block_size=512):
        check_transport(k, features["w"], features["beta"])
        if impl == "blockwise":
            return chunked_attention(q, k, v, features["w"], features["beta"], segment_ids=segment_ids,
                                     bias_fn=self.score_bias(features, positions), chunk=block_size)
        return super().attention(q, k, v, features, positions=positions, segment_ids=segment_ids)

    def init_cache(self, batch, max_len, num_kv_heads, dtype=jnp.float32):
        # Keys are carried by every new token, so they stay fp32 whatever the model dtype.
        cache = super().init_cache(batch, max_len, num_kv_heads, dtype)
        if self.conv:  # the projections the convolution of w reads (models/features.py)
            cache["features"]["w_in"] = jnp.zeros((batch, max_len, num_kv_heads * self.head_dim), jnp.float32)
        return {**cache, "k": cache["k"].astype(jnp.float32)}

    def decode_step(self, cache, q, k, v, features=None):
        """n new tokens at the cache index. One token: carry every cached key by H_t (a rank-one
        update), append k_t, attend. Several (a prefill): the whole cache as one sequence in
        which the cached slots take no step (beta 0: their keys are already carried to the
        index) and the new tokens take theirs, attended by the chunked algorithm; the keys are
        then carried to the last new token by `transport_to_end`. O(L * D) memory either way."""
        q, k, v = self.transform(q, k, v, features, None)
        b, n = q.shape[:2]
        index = cache["index"]
        cache, bias_features, key_positions = self.remember(
            cache, features, jnp.broadcast_to(index + jnp.arange(n, dtype=jnp.int32), (b, n)))
        bias_fn = self.score_bias(bias_features, key_positions)
        w, beta = features["w"].astype(jnp.float32), features["beta"].astype(jnp.float32)

        def put(buf, x):
            return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), index, axis=1)

        cv = put(cache["v"], v)
        if n == 1:  # the new token's own step does not act on its key: carry, then append
            ck = cache["k"]
            ck = put(ck - beta[..., None] * w * jnp.einsum("bskd,bkd->bsk", ck, w[:, 0], precision=HIGHEST)[
                ..., None], k)
            out = attention(q, ck, cv, bias_fn=bias_fn, q_offset=index)
        else:
            ck = put(cache["k"], k)
            ws = put(jnp.zeros(ck.shape, jnp.float32), w)
            betas = put(jnp.zeros(ck.shape[:3], jnp.float32), beta)
            qs = put(jnp.zeros(ck.shape[:2] + q.shape[2:], q.dtype), q)
            out = chunked_attention(qs, ck, cv, ws, betas, bias_fn=bias_fn)
            out = jax.lax.dynamic_slice_in_dim(out, index, n, axis=1)
            ck = transport_to_end(ck, ws, betas)
        return out, {**cache, "k": ck, "v": cv, "index": index + n}
