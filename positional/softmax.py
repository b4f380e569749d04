"""Causal softmax attention: a reference and a blockwise (online-softmax) implementation, and
the pieces other implementations build on (the mask, one block of scores, the shape check).
The ring implementation over a device mesh (positional/ring.py) builds on the blockwise one;
positional/attention.py is the dispatcher that picks an implementation by name.

Shapes: q [B, T, H, D]; k, v [B, S, K, D] with H % K == 0 (grouped-query attention: query head
h reads key/value head h // (H // K)). Query t sits at absolute index `q_offset + t`, key s at
index s, and query i sees key j iff j <= i (and, with segment ids, both are in the same
segment; with a sliding `window` W, also i - j < W: the query and the W - 1 keys before it;
with a `Chunk(C)` window, Llama 4's chunked local attention, also j >= C floor(i / C): the keys
of the query's own chunk of C tokens, up to it).
A `sink` [H] (fp32 logits, one per query head: gpt-oss's learned sinks) is one more logit in
every row's softmax normaliser, with no value: the weights of a row sum to less than 1.
`q_offset` lets the same function serve decoding, where S is the cache length.

Schemes that change the score pass `bias_fn(qi, kj) -> [B or 1, H or 1, len(qi), len(kj)]`, an
additive logit bias evaluated on index vectors, so the blockwise version only ever builds one
block of it. Schemes whose logit is not a dot product (TAPA) pass `score_fn(qb, kb, qi, kj)`,
which replaces `scale * q.k` for one block: qb [B, tq, K, G, D], kb [B, tk, K, D] ->
[B, K, G, tq, tk] fp32. Scores, softmax statistics and the output accumulation are fp32 whatever the
input dtype; the output has q's dtype. With bf16 (or fp16) inputs the matmuls take operands of that
dtype and accumulate in fp32, in the forward and the backward (`matmul`): the flash-attention
convention, at the accelerators' low-precision matmul rate; with fp32 inputs they are plain fp32
einsums.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp

BiasFn = Callable[[jax.Array, jax.Array], jax.Array]
ScoreFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
MASKED = -1e30  # finite, so a row is never all -inf and never NaN


def segment_starts(segment_ids, shape=None) -> jax.Array:
    """True where a token starts a segment (a run of equal ids; always at t = 0): [B, T] bool.
    segment_ids None: one segment per row of `shape`."""
    if segment_ids is None:
        return jnp.zeros(shape, bool).at[:, 0].set(True)
    return jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                            segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def check_shapes(q, k, v, segment_ids, key_segment_ids=None):
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"attention expects [B, T, H, D] arrays, got q{q.shape} k{k.shape} v{v.shape}")
    if k.shape != v.shape[:3] + (k.shape[3],) or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"incompatible q{q.shape} k{k.shape} v{v.shape}: key/value lengths and heads, "
                         "and query/key head_dim must match")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"num query heads {q.shape[2]} is not a multiple of num kv heads {k.shape[2]}")
    if key_segment_ids is not None:  # the keys' own: segment_ids are the queries'
        if key_segment_ids.shape[1] != k.shape[1] or (segment_ids is not None and segment_ids.shape[1] != q.shape[1]):
            raise ValueError(f"key_segment_ids {key_segment_ids.shape} must be [B, S] and segment_ids "
                             f"{None if segment_ids is None else segment_ids.shape} [B, T] (q{q.shape}, k{k.shape})")
    elif segment_ids is not None and (segment_ids.shape != q.shape[:2] or q.shape[1] != k.shape[1]):
        raise ValueError(f"segment_ids {segment_ids.shape} must be [B, T] with T = key length "
                         f"(q{q.shape}, k{k.shape})")


def _dot(spec, a, b, dtype):
    return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _low_matmul(spec, dtype, a, b):
    return _dot(spec, a, b, dtype)


def _low_matmul_fwd(spec, dtype, a, b):
    return _dot(spec, a, b, dtype), (a, b)


def _low_matmul_bwd(spec, dtype, res, g):
    (a, b), (ins, out) = res, spec.split("->")
    sa, sb = ins.split(",")
    to_a, to_b, g_low = f"{out},{sb}->{sa}", f"{sa},{out}->{sb}", g.astype(dtype)
    da = _dot(to_a, g_low, b, dtype)
    if a.dtype != dtype:
        # A gradient kept in fp32 (P.V's dP): add g's rounding error times b's mean over the
        # summed axes (V's over the keys), so dP's part common to every key is fp32-exact and
        # cancels in the softmax backward's dP - rowsum(P dP) however large V's mean is
        # (blockwise_lse's autodiff takes that rowsum from the fp32 cotangent). A dot of size D.
        summed = tuple(i for i, c in enumerate(sb) if c not in out)
        da = da + _dot(to_a, g - g_low.astype(g.dtype), jnp.mean(b.astype(jnp.float32), summed, keepdims=True),
                       dtype)
    return da.astype(a.dtype), _dot(to_b, a, g_low, dtype).astype(b.dtype)


_low_matmul.defvjp(_low_matmul_fwd, _low_matmul_bwd)


def matmul(spec, a, b, dtype) -> jax.Array:
    """einsum(spec, a, b) in fp32, its operands cast to `dtype`. For a dtype narrower than fp32
    (bf16), a `dtype` x `dtype` matmul accumulated in fp32, and so are the two of its backward:
    the fp32 cotangent is cast to `dtype` for them and each operand's gradient is returned in
    that operand's own dtype. So q.k (bf16 q, k) gives bf16 dq, dk, and P.V (fp32 P, bf16 V)
    an fp32 dP, never rounded to bf16 before the softmax backward's dP - rowsum(P dP). For a
    dtype of fp32 or wider, the plain einsum (and autodiff's backward)."""
    if jnp.finfo(dtype).bits >= 32:
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)
    return _low_matmul(spec, jnp.dtype(dtype), a, b)


def rounded(x, dtype):
    """fp32 x with its values rounded to `dtype`'s significand, to nearest even (the type stays
    fp32; `dtype`'s exponent range is not applied: bf16's is fp32's); the gradient passes
    through unrounded. x itself for a dtype of fp32 or wider. By the bit pattern, not a round
    trip through `dtype`, which XLA on GPU removes (positional/angles.py)."""
    if jnp.finfo(dtype).bits >= 32:
        return x
    drop = 23 - jnp.finfo(dtype).nmant
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    bits = bits + jnp.uint32((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)  # ties to even
    near = jax.lax.bitcast_convert_type(bits & jnp.uint32((0xFFFFFFFF << drop) & 0xFFFFFFFF), jnp.float32)
    return x + jax.lax.stop_gradient(near - x)


def merged(o1, lse1, o2, lse2):
    """Attention over two disjoint sets of keys as one: (o, lse), each part's output weighted by
    its share of the row's softmax, exp(lse_part - lse) (a part a row has no key in: lse -inf or
    ~MASKED, weight 0). The ring's steps and PaTH's levels merge so."""
    lse = jnp.logaddexp(lse1, lse2)
    return o1 * jnp.exp(lse1 - lse)[..., None] + o2 * jnp.exp(lse2 - lse)[..., None], lse


@dataclasses.dataclass(frozen=True)
class Chunk:
    """Chunked local attention as a `window`: query i sees the keys j <= i of its own chunk,
    j >= C floor(i / C) (Llama 4's attention_chunk_size). Like a sliding window of C, a query's
    keys lie within C - 1 before it, so the blockwise form loops over as many key blocks; only
    the reference and blockwise forms take it (`CHUNKED` in positional/attention.py)."""
    size: int

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"chunk size {self.size!r} must be an int >= 1 (each query sees the keys of its own "
                             "chunk of that many tokens, up to itself)")


def window_size(window) -> int | None:
    """How far before a query its keys can lie, plus one: W, or a chunk's C; None for no window."""
    return window.size if isinstance(window, Chunk) else window


def first_key(window, i):
    """The first key query index `i` sees (before masking by segments): i - W + 1, or its
    chunk's start."""
    return i // window.size * window.size if isinstance(window, Chunk) else i - window + 1


def check_window(window) -> "int | Chunk | None":
    """A window as the implementations take it: None (every earlier key), an int >= 1 (a
    sliding window) or a `Chunk`; ValueError, one line, otherwise. 0 means None (a config's "no
    window")."""
    if window is None or (isinstance(window, int) and not isinstance(window, bool) and window == 0):
        return None
    if isinstance(window, Chunk):
        return window
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window={window!r} must be an int >= 1 (each query sees itself and the window - 1 keys "
                         "before it) or None / 0 (every earlier key)")
    return window


def causal_mask(qi, kj, seg_q, seg_k, window: "int | Chunk | None" = None):
    """Boolean [B or 1, 1, tq, tk]: causal, same-segment and, with a window W, i - j < W (with a
    `Chunk`, j at or after the start of i's chunk)."""
    m = kj[None, :] <= qi[:, None]
    if window is not None:
        m = m & (kj[None, :] >= first_key(window, qi)[:, None])
    m = m[None, None]
    if seg_q is not None:
        m = m & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
    return m


def block_scores(qb, kb, qi, kj, bias_fn, scale, score_fn):
    """Scores of one query block against one key block: [B, K, G, tq, tk] in fp32."""
    b, tq, kh, g, _ = qb.shape
    if score_fn is None:
        s = matmul("btkgd,bskd->bkgts", qb, kb, jnp.promote_types(qb.dtype, kb.dtype)) * scale
    else:
        s = score_fn(qb, kb, qi, kj)
    if bias_fn is not None:
        bias = bias_fn(qi, kj).astype(jnp.float32)
        bias = jnp.broadcast_to(bias, (bias.shape[0], kh * g, tq, kj.shape[0]))
        s = s + bias.reshape(bias.shape[0], kh, g, tq, kj.shape[0])
    return s


def attention_logits(q, k, *, bias_fn: BiasFn | None = None, q_offset=0, scale: float | None = None,
                     score_fn: ScoreFn | None = None) -> jax.Array:
    """Every query's score of every key [B, K, G, T, S] (fp32, no mask), query head h = k * G + g."""
    b, t, h, d = q.shape
    kh = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    return block_scores(q.reshape(b, t, kh, h // kh, d), k, q_offset + jnp.arange(t), jnp.arange(k.shape[1]),
                   bias_fn, scale, score_fn)


def causal_softmax(logits, segment_ids=None, q_offset=0, window: int | None = None, key_segment_ids=None,
                   sink=None) -> jax.Array:
    """Softmax over the keys each query sees, of logits [B, K, G, T, S]; key_segment_ids [B, S]
    where the keys' segments are not the queries' (a decode cache's unwritten slots: -1 against
    the new tokens' 0); `sink` [H], a logit per query head in every row's normaliser."""
    qi, kj = q_offset + jnp.arange(logits.shape[-2]), jnp.arange(logits.shape[-1])
    if key_segment_ids is not None and segment_ids is None:
        segment_ids = jnp.zeros(logits.shape[:1] + logits.shape[-2:-1], jnp.int32)
    key_segment_ids = segment_ids if key_segment_ids is None else key_segment_ids
    mask = causal_mask(qi, kj, segment_ids, key_segment_ids, check_window(window))[:, :, None]
    logits = jnp.where(mask, logits, MASKED)
    if sink is None:
        return jax.nn.softmax(logits, axis=-1)
    column = jnp.broadcast_to(sink_of(sink, logits.shape[1:3])[..., None, None], logits.shape[:-1] + (1,))
    return jax.nn.softmax(jnp.concatenate([logits, column], axis=-1), axis=-1)[..., :-1]


def sink_of(sink, heads) -> jax.Array:
    """A sink [H] as fp32 [K, G] (heads = (K, G)); one line when it is not one logit per query head."""
    if jnp.shape(sink) != (heads[0] * heads[1],):
        raise ValueError(f"sink has shape {tuple(jnp.shape(sink))}; it must be [H] = [{heads[0] * heads[1]}], one "
                         "logit per query head")
    return jnp.asarray(sink, jnp.float32).reshape(heads)


def attention_weights(q, k, *, bias_fn: BiasFn | None = None, segment_ids=None, q_offset=0,
                      scale: float | None = None, score_fn: ScoreFn | None = None, window: int | None = None,
                      key_segment_ids=None, sink=None) -> jax.Array:
    """Softmax attention weights [B, K, G, T, S] (fp32), query head h = k * G + g."""
    s = attention_logits(q, k, bias_fn=bias_fn, q_offset=q_offset, scale=scale, score_fn=score_fn)
    return causal_softmax(s, segment_ids, q_offset, window, key_segment_ids, sink)


def reference_attention(q, k, v, *, bias_fn: BiasFn | None = None, segment_ids=None,
                        q_offset=0, scale: float | None = None, score_fn: ScoreFn | None = None,
                        window: int | None = None, key_segment_ids=None, sink=None) -> jax.Array:
    """Obviously correct causal attention; materialises the [B, H, T, S] score matrix.
    key_segment_ids [B, S]: the keys' segment ids where they are not `segment_ids` (`causal_softmax`)."""
    check_shapes(q, k, v, segment_ids, key_segment_ids)
    p = attention_weights(q, k, bias_fn=bias_fn, segment_ids=segment_ids, q_offset=q_offset, scale=scale,
                          score_fn=score_fn, window=window, key_segment_ids=key_segment_ids, sink=sink)
    o = matmul("bkgts,bskd->btkgd", p, v, v.dtype)
    return o.reshape(q.shape).astype(q.dtype)


def blockwise_attention(q, k, v, *, bias_fn: BiasFn | None = None, segment_ids=None,
                        q_offset=0, scale: float | None = None, score_fn: ScoreFn | None = None,
                        block_size: int = 512, window: int | None = None, sink=None) -> jax.Array:
    """Online-softmax attention over key blocks, for each query block in turn.

    Memory is O(B * H * block_size^2) for scores plus O(T * D) for the output, in the forward
    and, because both loops are rematerialised, in the backward too. Key blocks wholly in the
    future of a query block are skipped (no FLOPs spent on them); with a sliding window, so are
    those wholly before its window: a query block loops over the (W + block) / block key
    blocks that can reach it, so time is O(T * W), not O(T^2).
    """
    check_shapes(q, k, v, segment_ids)
    out, _ = blockwise_lse(q, k, v, bias_fn=bias_fn, segment_ids=segment_ids, q_offset=q_offset, scale=scale,
                           score_fn=score_fn, block_size=block_size, window=window, sink=sink)
    return out.astype(q.dtype)


def blockwise_lse(q, k, v, *, bias_fn: BiasFn | None = None, segment_ids=None, key_segment_ids=None,
                  q_offset=0, k_offset=0, scale: float | None = None, score_fn: ScoreFn | None = None,
                  block_size: int = 512, window: int | None = None, sink=None) -> tuple[jax.Array, jax.Array]:
    """`blockwise_attention` with keys at indices k_offset + s, returning fp32 (out [B, T, H, D],
    lse [B, T, H]), lse the log-sum-exp of each row's masked scores: results over disjoint key
    sets merge by it (positional/ring.py). segment_ids [B, T] are the queries', key_segment_ids
    [B, S] the keys' (default: the same array). Every query block must see the first key
    block (k_offset <= q_offset); a query whose visible keys are all masked gets lse ~ MASKED.
    `window`: a sliding window (`causal_mask`); a query block then loops over only the key
    blocks that can hold a key of its rows' windows. `sink` [H]: the online softmax starts from
    it (running max the sink, running sum 1), so lse includes it.
    """
    window = check_window(window)
    b, t, h, d = q.shape
    s_len, kh = k.shape[1], k.shape[2]
    g = h // kh
    scale = d ** -0.5 if scale is None else scale
    key_segment_ids = segment_ids if key_segment_ids is None else key_segment_ids
    bq, bk = min(block_size, t), min(block_size, s_len)
    nq, nk = -(-t // bq), -(-s_len // bk)
    # Pad to whole blocks. Padded keys get index >= s_len... they are masked by giving them a
    # segment id no query has; padded queries are dropped at the end.
    pad_q, pad_k = nq * bq - t, nk * bk - s_len
    qg = jnp.pad(q.reshape(b, t, kh, g, d), ((0, 0), (0, pad_q), (0, 0), (0, 0), (0, 0)))
    kp = jnp.pad(k, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
    vp = jnp.pad(v, ((0, 0), (0, pad_k), (0, 0), (0, 0)))
    key_valid = jnp.arange(nk * bk) < s_len
    if segment_ids is None:
        seg_q = jnp.zeros((1, nq * bq), jnp.int32)
        seg_k = jnp.where(key_valid, 0, -1)[None]
    else:
        seg_q = jnp.pad(segment_ids, ((0, 0), (0, pad_q)))
        seg_k = jnp.where(key_valid[None], jnp.pad(key_segment_ids, ((0, 0), (0, pad_k))), -1)

    # Key blocks a query block loops over: all of them, or with a window those from the one
    # holding its first row's first key on (a span of (W - 1 + bq) / bk blocks, rounded up, plus
    # one for a span that does not start at a block's edge).
    span = nk if window is None else min(nk, -(-(window_size(window) - 1 + bq) // bk) + 1)

    def query_block(iq):
        q0 = iq * bq
        qb = jax.lax.dynamic_slice_in_dim(qg, q0, bq, axis=1)
        sq = jax.lax.dynamic_slice_in_dim(seg_q, q0, bq, axis=1)
        qi = q_offset + q0 + jnp.arange(bq)
        first = 0 if window is None else jnp.clip((first_key(window, q_offset + q0) - k_offset) // bk, 0, nk - span)

        def key_block(carry, ik):
            ik = first + ik

            def update(carry):
                o, m, row_sum = carry
                k0 = ik * bk
                kb = jax.lax.dynamic_slice_in_dim(kp, k0, bk, axis=1)
                vb = jax.lax.dynamic_slice_in_dim(vp, k0, bk, axis=1)
                sk = jax.lax.dynamic_slice_in_dim(seg_k, k0, bk, axis=1)
                kj = k_offset + k0 + jnp.arange(bk)
                s = block_scores(qb, kb, qi, kj, bias_fn, scale, score_fn)
                s = jnp.where(causal_mask(qi, kj, sq, sk, window)[:, :, None], s, MASKED)
                m_new = jnp.maximum(m, s.max(-1))
                # The weights as P.V takes them, so that row_sum normalises exactly those.
                p = rounded(jnp.exp(s - m_new[..., None]), vb.dtype)
                corr = jnp.exp(m - m_new)
                row_sum_new = row_sum * corr + p.sum(-1)
                o_new = o * corr[..., None] + matmul("bkgts,bskd->bkgtd", p, vb, vb.dtype)
                return o_new, m_new, row_sum_new

            # A key block strictly after the last query of this block contributes nothing.
            visible = k_offset + ik * bk <= q_offset + q0 + bq - 1
            return jax.lax.cond(visible, jax.checkpoint(update), lambda c: c, carry), None

        if sink is None:
            start, total = jnp.full((b, kh, g, bq), MASKED, jnp.float32), jnp.zeros((b, kh, g, bq), jnp.float32)
        else:
            start = jnp.broadcast_to(sink_of(sink, (kh, g))[None, :, :, None], (b, kh, g, bq))
            total = jnp.ones((b, kh, g, bq), jnp.float32)
        init = (jnp.zeros((b, kh, g, bq, d), jnp.float32), start, total)
        (o, m, row_sum), _ = jax.lax.scan(key_block, init, jnp.arange(span))
        # row_sum >= 1 for every real query: the first key block is visible (masked keys count
        # until a visible one resets them, and blockwise_attention's queries always see themselves).
        return o / row_sum[..., None], m + jnp.log(row_sum)

    o, lse = jax.lax.map(jax.checkpoint(query_block), jnp.arange(nq))  # [nq, B, K, G, bq, (D)]
    o = jnp.moveaxis(o, 0, 3).reshape(b, kh, g, nq * bq, d)[:, :, :, :t]
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, h, nq * bq)[:, :, :t]
    return jnp.moveaxis(o, 3, 1).reshape(b, t, h, d), jnp.moveaxis(lse, 2, 1)
