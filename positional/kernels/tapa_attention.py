"""Fused TAPA attention in Pallas: flash-style forward and backward, no T x T buffer.

The semantics of `positional.tapa`'s reference, `attention(..., score_fn=tapa_score_fn)` (causal,
grouped-query heads, segment ids, `q_offset`), on q and k split into amplitude and phase parts
(the kernel takes the parts, so it needs nothing from the scheme file), for the logit

    L_ij = c_A S_A cos(Phi),  S_A = q_A . k_A,  Phi = 2 pi c_P r_ij S_P,  S_P = q_P . k_P,
    r_ij = |i - j|^alpha (0 on the diagonal), computed in the kernel from the tile's indices.

Forward (grid: batch x query heads x query blocks): online softmax over key blocks up to the
diagonal (later blocks are skipped), writing the output and the row log-sum-exp (in base 2:
the kernel's softmax runs on exp2). Backward, by
the flash-attention recurrences with the TAPA chain rule, dL = P (dP - delta):

    dS_A = c_A dL cos(Phi),   dS_P = -2 pi c_P r dL c_A S_A sin(Phi),
    dq_A = dS_A k_A, dq_P = dS_P k_P, dk_A = dS_A^T q_A, dk_P = dS_P^T q_P, dv = P^T dO,

in two kernels that recompute the tiles (one over key blocks for dK, dV; one over query blocks
for dQ). Grouped-query dK, dV are summed over the group outside the kernel. The phase (S_P,
r^alpha, cos, sin) and all statistics are fp32; matmuls take the input dtype with fp32
accumulation (P and dS are cast to it, as flash attention does), except S_P, whose fp32 inputs
(the linear phase) get full fp32 precision rather than TF32.

Tiles: block_q x block_k. On GPU (Triton) both must be powers of two >= 16; on TPU (Mosaic)
multiples of 128; in interpret mode (CPU, the default there) any size >= 1; `DEFAULT_TILES`
when not given. The platform is the one being lowered for (an export for tpu from a CPU host
gives Mosaic); a tile given explicitly that a platform cannot take fails only its lowering. Head parts are zero-padded to a power of two >= 16, which changes no dot
product. On GPU, exp2, log2, cos and sin are single special-function instructions (`fast_math`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from positional.angles import wrap
from positional.kernels import check_tile, per_platform
from positional.softmax import MASKED, check_shapes

LOG2E = 1.4426950408889634
# (block_q, block_k) when not given: on an H100 64 x 32 gave the fastest forward + backward of
# the tiles in benchmarks/RESULTS.md; TPU needs lane-sized (128) tiles.
DEFAULT_TILES = {"gpu": (64, 32), "tpu": (128, 128), "interpret": (64, 64)}


@dataclasses.dataclass(frozen=True)
class _Static:
    alpha: float
    c_amp: float
    phase_scale: float  # 2 pi c_P
    q_offset: int
    kv_len: int
    group: int
    block_q: int
    block_k: int
    interpret: bool
    backend: str  # "gpu", "tpu" or "cpu": the platform this configuration lowers for
    num_warps: int
    num_stages: int
    fast_math: bool


def check_blocks(block_q: int, block_k: int, backend: str, interpret: bool) -> None:
    """Raise naming the field when a tile size cannot run on this backend."""
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        check_tile("tapa", name, size, backend, interpret)


def _mufu(op: str, x):
    """One special-function-unit instruction per element (`ex2.approx.ftz.f32`, ...); GPU only."""
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)
    return plgpu.elementwise_inline_asm(f"{op}.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f",
                                        pack=1, result_shape_dtypes=[out])[0]


def _exp2(x, st: _Static):
    return _mufu("ex2", x) if st.fast_math else jnp.exp2(x)


def _cos(x, st: _Static):  # fast: wrapped into [-pi, pi) first, where cos.approx is accurate to 1e-6
    return _mufu("cos", wrap(x)) if st.fast_math else jnp.cos(x)


def _sin(x, st: _Static):
    return _mufu("sin", wrap(x)) if st.fast_math else jnp.sin(x)


def _tile(qa, ka, qp, kp, qi, kj, sq, sk, st: _Static):
    """One tile: (c_A S_A, r, c_P 2 pi S_P, mask), all [tq, tk] fp32 (mask bool).

    Query indices and segment ids come as columns [tq, 1], keys' as rows [1, tk].
    """
    contract = (((1,), (1,)), ((), ()))
    s_amp = lax.dot_general(qa, ka, contract, preferred_element_type=jnp.float32) * st.c_amp
    s_phase = lax.dot_general(qp, kp, contract, precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32) * st.phase_scale
    d = (qi - kj).astype(jnp.float32)
    log2_d = _mufu("lg2", jnp.maximum(d, 1.0)) if st.fast_math else jnp.log2(jnp.maximum(d, 1.0))
    r = jnp.where(d > 0, _exp2(st.alpha * log2_d, st), 0.0)
    mask = (d >= 0) & (sq == sk) & (kj < st.kv_len)
    return s_amp, r, s_phase, mask


def _rows(start, size):
    return start + lax.broadcasted_iota(jnp.int32, (size, 1), 0)


def _cols(start, size):
    return start + lax.broadcasted_iota(jnp.int32, (1, size), 1)


def _fwd_kernel(qa_ref, ka_ref, qp_ref, kp_ref, v_ref, sq_ref, sk_ref, o_ref, lse_ref, *, st: _Static):
    bq, bk = st.block_q, st.block_k
    iq = pl.program_id(2)
    qa, qp, sq = qa_ref[...], qp_ref[...], sq_ref[...]
    qi = _rows(st.q_offset + iq * bq, bq)

    def body(ik, carry):
        o, m, row_sum = carry
        k0 = pl.multiple_of(ik * bk, bk)
        keys = pl.ds(k0, bk)
        s_amp, r, s_phase, mask = _tile(qa, ka_ref[keys, :], qp, kp_ref[keys, :], qi,
                                        _cols(k0, bk), sq, sk_ref[:, keys], st)
        # Base-2 softmax; masked entries equal the initial max, so a row with no visible key
        # (a padded query) gets finite statistics, never 0 / 0.
        logits = jnp.where(mask, s_amp * _cos(r * s_phase, st) * LOG2E, MASKED)
        m_new = jnp.maximum(m, logits.max(axis=1, keepdims=True))
        p = _exp2(logits - m_new, st)
        corr = _exp2(m - m_new, st)
        v = v_ref[keys, :]
        o = o * corr + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o, m_new, row_sum * corr + p.sum(axis=1, keepdims=True)

    num_k = ka_ref.shape[0] // bk
    upper = jnp.minimum(num_k, lax.div(st.q_offset + (iq + 1) * bq + bk - 1, bk))
    init = (jnp.zeros((bq, v_ref.shape[-1]), jnp.float32), jnp.full((bq, 1), MASKED, jnp.float32),
            jnp.zeros((bq, 1), jnp.float32))
    o, m, row_sum = lax.fori_loop(0, upper, body, init)
    o_ref[...] = (o / row_sum).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log2(row_sum)  # log2-sum-exp2 of the base-2 logits


def _grads_of_tile(qa, ka, qp, kp, v, do, lse, delta, qi, kj, sq, sk, st: _Static):
    """(P, dS_A, dS_P) of one tile; dS are w.r.t. the raw dot products q_A.k_A and q_P.k_P."""
    s_amp, r, s_phase, mask = _tile(qa, ka, qp, kp, qi, kj, sq, sk, st)
    angle = r * s_phase
    cos = _cos(angle, st)
    p = _exp2(jnp.where(mask, s_amp * cos * LOG2E, MASKED) - lse, st)
    dp = lax.dot_general(do, v, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    dl = p * (dp - delta)
    ds_amp = dl * cos * st.c_amp
    ds_phase = -dl * s_amp * _sin(angle, st) * r * st.phase_scale
    return p, ds_amp, ds_phase


def _dkv_kernel(qa_ref, ka_ref, qp_ref, kp_ref, v_ref, sq_ref, sk_ref, do_ref, lse_ref, delta_ref,
                dka_ref, dkp_ref, dv_ref, *, st: _Static):
    bq, bk = st.block_q, st.block_k
    ik = pl.program_id(2)
    ka, kp, v, sk = ka_ref[...], kp_ref[...], v_ref[...], sk_ref[...]
    kj = _cols(ik * bk, bk)
    tn = (((0,), (0,)), ((), ()))  # A^T B

    def body(iq, carry):
        dka, dkp, dv = carry
        q0 = pl.multiple_of(iq * bq, bq)
        rows = pl.ds(q0, bq)
        qa, qp, do = qa_ref[rows, :], qp_ref[rows, :], do_ref[rows, :]
        p, ds_amp, ds_phase = _grads_of_tile(qa, ka, qp, kp, v, do, lse_ref[rows, :], delta_ref[rows, :],
                                             _rows(st.q_offset + q0, bq), kj, sq_ref[rows, :], sk, st)
        dv = dv + lax.dot_general(p.astype(do.dtype), do, tn, preferred_element_type=jnp.float32)
        dka = dka + lax.dot_general(ds_amp.astype(qa.dtype), qa, tn, preferred_element_type=jnp.float32)
        dkp = dkp + lax.dot_general(ds_phase.astype(qp.dtype), qp, tn, preferred_element_type=jnp.float32)
        return dka, dkp, dv

    num_q = qa_ref.shape[0] // bq
    lower = lax.div(jnp.maximum(ik * bk - st.q_offset, 0), bq)
    init = (jnp.zeros(ka.shape, jnp.float32), jnp.zeros(kp.shape, jnp.float32),
            jnp.zeros(v.shape, jnp.float32))
    dka, dkp, dv = lax.fori_loop(lower, num_q, body, init)
    dka_ref[...], dkp_ref[...], dv_ref[...] = dka, dkp, dv


def _dq_kernel(qa_ref, ka_ref, qp_ref, kp_ref, v_ref, sq_ref, sk_ref, do_ref, lse_ref, delta_ref,
               dqa_ref, dqp_ref, *, st: _Static):
    bq, bk = st.block_q, st.block_k
    iq = pl.program_id(2)
    qa, qp, do, sq = qa_ref[...], qp_ref[...], do_ref[...], sq_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    qi = _rows(st.q_offset + iq * bq, bq)

    def body(ik, carry):
        dqa, dqp = carry
        k0 = pl.multiple_of(ik * bk, bk)
        keys = pl.ds(k0, bk)
        ka, kp = ka_ref[keys, :], kp_ref[keys, :]
        _, ds_amp, ds_phase = _grads_of_tile(qa, ka, qp, kp, v_ref[keys, :], do, lse, delta, qi,
                                             _cols(k0, bk), sq, sk_ref[:, keys], st)
        dqa = dqa + jnp.dot(ds_amp.astype(ka.dtype), ka, preferred_element_type=jnp.float32)
        dqp = dqp + jnp.dot(ds_phase.astype(kp.dtype), kp, preferred_element_type=jnp.float32)
        return dqa, dqp

    num_k = ka_ref.shape[0] // bk
    upper = jnp.minimum(num_k, lax.div(st.q_offset + (iq + 1) * bq + bk - 1, bk))
    dqa, dqp = lax.fori_loop(0, upper, body, (jnp.zeros(qa.shape, jnp.float32),
                                              jnp.zeros(qp.shape, jnp.float32)))
    dqa_ref[...], dqp_ref[...] = dqa, dqp


def _specs(st: _Static, q_len: int, k_len: int, by: str):
    """BlockSpecs of (qa, ka, qp, kp, v, seg_q, seg_k) on a grid (B, H, blocks of `by`)."""
    g = st.group

    def rows(n, kv):  # [B, H or K, n, D], whole sequence
        return lambda d: pl.BlockSpec((None, None, n, d), (lambda b, h, i: (b, h // g, 0, 0)) if kv
                                      else (lambda b, h, i: (b, h, 0, 0)))

    def tiled(n, kv):
        return lambda d: pl.BlockSpec((None, None, n, d), (lambda b, h, i: (b, h // g, i, 0)) if kv
                                      else (lambda b, h, i: (b, h, i, 0)))

    q_spec = tiled(st.block_q, False) if by == "q" else rows(q_len, False)
    k_spec = tiled(st.block_k, True) if by == "k" else rows(k_len, True)
    # Segment ids of queries as a column [B, T, 1], of keys as a row [B, 1, S].
    seg_q = (pl.BlockSpec((None, st.block_q, 1), lambda b, h, i: (b, i, 0)) if by == "q"
             else pl.BlockSpec((None, q_len, 1), lambda b, h, i: (b, 0, 0)))
    seg_k = (pl.BlockSpec((None, 1, st.block_k), lambda b, h, i: (b, 0, i)) if by == "k"
             else pl.BlockSpec((None, 1, k_len), lambda b, h, i: (b, 0, 0)))
    return q_spec, k_spec, seg_q, seg_k


def _call(kernel, st, grid, in_specs, out_specs, out_shape, args):
    params = {}
    if not st.interpret and st.backend == "gpu":
        params["compiler_params"] = plgpu.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages)
    return pl.pallas_call(functools.partial(kernel, st=st), grid=grid, in_specs=in_specs,
                          out_specs=out_specs, out_shape=out_shape, interpret=st.interpret,
                          **params)(*args)


def _forward(qa, ka, qp, kp, v, sq, sk, st):
    b, h, t, da = qa.shape
    s, dp, dv = ka.shape[2], qp.shape[-1], v.shape[-1]
    q_spec, k_spec, seg_q, seg_k = _specs(st, t, s, "q")
    f32 = jnp.float32
    return _call(
        _fwd_kernel, st, (b, h, t // st.block_q),
        [q_spec(da), k_spec(da), q_spec(dp), k_spec(dp), k_spec(dv), seg_q, seg_k],
        [q_spec(dv), q_spec(1)],
        [jax.ShapeDtypeStruct((b, h, t, dv), v.dtype), jax.ShapeDtypeStruct((b, h, t, 1), f32)],
        (qa, ka, qp, kp, v, sq, sk))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _fused(qa, ka, qp, kp, v, sq, sk, st):
    return _forward(qa, ka, qp, kp, v, sq, sk, st)[0]


def _fused_fwd(qa, ka, qp, kp, v, sq, sk, st):
    o, lse = _forward(qa, ka, qp, kp, v, sq, sk, st)
    return o, (qa, ka, qp, kp, v, sq, sk, o, lse)


def _fused_bwd(st, res, do):
    qa, ka, qp, kp, v, sq, sk, o, lse = res
    b, h, t, da = qa.shape
    kh, s, dp, dv = ka.shape[1], ka.shape[2], qp.shape[-1], v.shape[-1]
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1, keepdims=True)
    do = do.astype(v.dtype)
    args = (qa, ka, qp, kp, v, sq, sk, do, lse, delta)
    f32 = jnp.float32

    # dK, dV: one program per (batch, query head, key block), looping over query blocks.
    q_spec, k_spec, seg_q, seg_k = _specs(st, t, s, "k")
    per_head = lambda d: pl.BlockSpec((None, None, st.block_k, d), lambda b_, h_, i: (b_, h_, i, 0))  # noqa: E731
    dka, dkp, dvv = _call(
        _dkv_kernel, st, (b, h, s // st.block_k),
        [q_spec(da), k_spec(da), q_spec(dp), k_spec(dp), k_spec(dv), seg_q, seg_k, q_spec(dv),
         q_spec(1), q_spec(1)],
        [per_head(da), per_head(dp), per_head(dv)],
        [jax.ShapeDtypeStruct((b, h, s, d), f32) for d in (da, dp, dv)], args)
    group_sum = lambda x: x.reshape(b, kh, st.group, s, x.shape[-1]).sum(2)  # noqa: E731

    # dQ: one program per (batch, query head, query block), looping over key blocks.
    q_spec, k_spec, seg_q, seg_k = _specs(st, t, s, "q")
    dqa, dqp = _call(
        _dq_kernel, st, (b, h, t // st.block_q),
        [q_spec(da), k_spec(da), q_spec(dp), k_spec(dp), k_spec(dv), seg_q, seg_k, q_spec(dv),
         q_spec(1), q_spec(1)],
        [q_spec(da), q_spec(dp)],
        [jax.ShapeDtypeStruct((b, h, t, d), f32) for d in (da, dp)], args)
    cast = lambda x, like: x.astype(like.dtype)  # noqa: E731
    return (cast(dqa, qa), cast(group_sum(dka), ka), cast(dqp, qp), cast(group_sum(dkp), kp),
            cast(group_sum(dvv), v), None, None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _pad_to(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def phase_attention(qa, ka, qp, kp, v, *, c_amp: float, c_phase: float, alpha: float,
                    segment_ids=None, q_offset: int = 0, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None, num_warps: int = 4,
                    num_stages: int = 2, fast_math: bool = True) -> jax.Array:
    """Causal attention with the logit c_amp (qa.ka) cos(2 pi c_phase |i-j|^alpha (qp.kp)), fused.

    The amplitude and phase parts come split (positional/tapa.py: `split_qk`, and
    `tapa_attention` there, the fused TAPA with the reference's signature): qa [B, T, H, dA],
    qp [B, T, H, dP]; ka [B, S, K, dA], kp [B, S, K, dP], v [B, S, K, D] -> [B, T, H, D].

    `interpret`: None (the default) lowers for the platform being lowered for (the Pallas
    interpreter on CPU, Triton on cuda, Mosaic on tpu, each with its own default tiles and tile
    rules: `positional.kernels.per_platform`); True interprets everywhere.
    GPU only: `num_warps` and `num_stages` tune the Triton compilation; `fast_math` computes
    exp2, log2, cos and sin with one special-function instruction each (cos and sin after
    exact wrapping into [-pi, pi)) instead of libdevice's accurate routines.
    """
    check_shapes(qa, ka, v, segment_ids)
    if qp.shape[:3] != qa.shape[:3] or kp.shape[:3] != ka.shape[:3] or qp.shape[-1] != kp.shape[-1]:
        raise ValueError(f"phase parts qp{qp.shape} kp{kp.shape} must match the amplitude parts "
                         f"qa{qa.shape} ka{ka.shape} in batch, length and heads, and each other in width")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0 (the distance exponent |i-j|^alpha); got alpha={alpha}")

    def settings(backend: str, interpret: bool) -> _Static:
        default_q, default_k = DEFAULT_TILES.get("interpret" if interpret else backend, (64, 64))
        bq, bk = block_q or default_q, block_k or default_k
        check_blocks(bq, bk, backend, interpret)
        return _Static(alpha=float(alpha), c_amp=float(c_amp), phase_scale=float(2 * math.pi * c_phase),
                       q_offset=int(q_offset), kv_len=ka.shape[1], group=qa.shape[2] // ka.shape[2],
                       block_q=bq, block_k=bk, interpret=interpret, backend=backend,
                       num_warps=num_warps, num_stages=num_stages,
                       fast_math=bool(fast_math) and not interpret and backend == "gpu")

    if segment_ids is None:
        segment_ids = jnp.zeros(qa.shape[:2], jnp.int32)
    return per_platform(settings, _padded, (qa, ka, qp, kp, v, segment_ids.astype(jnp.int32)), interpret)


def _padded(st: _Static, qa, ka, qp, kp, v, seg):
    """The kernel on inputs padded to st's tiles (and head parts to a power of two >= 16)."""
    b, t, _, _ = qa.shape
    s, d = ka.shape[1], v.shape[-1]
    tp, sp = -(-t // st.block_q) * st.block_q, -(-s // st.block_k) * st.block_k

    def layout(x, n, length):  # [B, n, H, d] -> [B, H, n_padded, d_padded]
        width = max(16, pl.next_power_of_2(x.shape[-1]))
        return jnp.swapaxes(_pad_to(_pad_to(x, 1, length), 3, width), 1, 2)

    # Keys beyond the query length (decoding) see segment 0, as the reference does without ids.
    seg_k = seg if s == t else jnp.zeros((b, s), jnp.int32)
    o = _fused(layout(qa, t, tp), layout(ka, s, sp), layout(qp, t, tp), layout(kp, s, sp),
               layout(v, s, sp), _pad_to(seg, 1, tp)[:, :, None], _pad_to(seg_k, 1, sp)[:, None, :], st)
    return jnp.swapaxes(o, 1, 2)[:, :t, :, :d].astype(qa.dtype)
