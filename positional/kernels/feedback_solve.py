"""Sessa's feedback solve (I - B) s = f in Pallas: blocked forward substitution, no T x T buffer.

Same signature and result as `positional.feedback.solve_reference` (s in fp32). Every tile of
B = gamma alpha is recomputed from qb, kb, the row log-sum-exp and gamma (the tile functions
below, shared with the plain-JAX blocked solve of `positional/feedback.py`). Five kernels:

  lse    grid (B, T/C):     row log-sum-exp of the strict-past logits, flash style.
  solve  grid (B, D/Dt):    chunks in time order: R_i = f_i + gamma_i sum_{j<i} alpha_ij S_j,
                            S_i = (I - B_ii)^{-1} R_i; also h_i = sum_{j<=i} alpha_ij S_j.
  lambda grid (B, D/Dt):    the backward's reverse-time solve lambda = (I - B)^{-T} ds, last
                            chunk first: lambda_i = (I - B_ii)^{-T} (ds_i + sum_{k>i} B_ki^T lambda_k).
  dq, dk grid (B, T/C):     dlogit = gamma alpha (<lambda_t, s_j> - dgamma_t), dgamma_t = <lambda_t, h_t>,
                            contracted with kb (over key chunks) or qb (over query chunks), as
                            flash attention's backward does with dP.

The solve is sequential over chunks and parallel over (batch, feature tiles). Inside a chunk,
(I - M)^{-1} for strictly lower M [C, C] is the exact doubling product prod_k (I + M^(2^k)),
k < ceil(log2 C) (M^C = 0), so a chunk costs matmuls only. Everything is fp32 (bf16 inputs are
cast first): the solve is a recurrence whose error would otherwise compound along T.

Tiles: C (`block`) and Dt (`block_d`). On GPU (Triton) C must be a power of two >= 16; on TPU
(Mosaic) a multiple of 128; in interpret mode (the CPU default) any size >= 1: each for the
platform being lowered for (`positional.kernels.per_platform`). The feature and
feedback widths are zero-padded to a power of two >= 16 (Triton's block rule), which changes
no dot product and gives zero columns of s. Each program holds whole-sequence qb, kb (and s in
the solve) in fast memory; past that size the inputs need manual DMA (not done here).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from positional.kernels import check_tile, per_platform
from positional.softmax import MASKED

# C when not given: TPU needs lane-sized (128) tiles; 64 keeps GPU tiles in registers.
DEFAULT_BLOCK = {"gpu": 64, "tpu": 128, "interpret": 64}


def check_inputs(qb, kb, gamma, f) -> None:
    """Raise naming the argument when shapes do not fit together."""
    if qb.ndim != 3 or kb.ndim != 3 or f.ndim != 3:
        raise ValueError(f"feedback solve expects qb, kb [B, T, dk] and f [B, T, D]; got qb{qb.shape} "
                         f"kb{kb.shape} f{f.shape}")
    if qb.shape[-1] != kb.shape[-1]:
        raise ValueError(f"feedback head width mismatch: qb has width {qb.shape[-1]} but kb has "
                         f"{kb.shape[-1]}; the feedback score qb_t . kb_j needs one width (feedback_dim)")
    if qb.shape[:2] != kb.shape[:2] or qb.shape[:2] != f.shape[:2] or gamma.shape != qb.shape[:2]:
        raise ValueError(f"feedback solve: qb{qb.shape}, kb{kb.shape}, gamma{gamma.shape} and f{f.shape} "
                         "must share batch and time [B, T]")


# ---- tiles (2-D arrays, no batch), shared with the blocked solve of positional/feedback.py ----
def tile_logits(qb_i, kb_j, q0, k0, scale, seg=None):
    """Logits scale qb_i . kb_j of one tile [tq, tk] fp32, and its strict-past mask.

    qb_i [tq, dk] holds rows q0.., kb_j [tk, dk] rows k0..; the mask is key index < query index
    (and, with seg = (query segment ids [tq, 1], key segment ids [1, tk]), the same segment).
    `scale` is 1/sqrt(dk) of the unpadded width (the kernel zero-pads dk).
    """
    logits = dot(qb_i, kb_j, transpose_b=True) * scale
    rows = q0 + lax.broadcasted_iota(jnp.int32, logits.shape, 0)
    cols = k0 + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    past = cols < rows
    return logits, past if seg is None else past & (seg[0] == seg[1])


def alpha_tile(qb_i, kb_j, lse_i, q0, k0, scale, seg=None):
    """alpha of one tile [tq, tk] fp32 from the row log-sum-exp lse_i [tq, 1]."""
    logits, past = tile_logits(qb_i, kb_j, q0, k0, scale, seg)
    return jnp.where(past, jnp.exp(logits - lse_i), 0.0)


def lse_update(carry, qb_i, kb_j, q0, k0, scale, seg=None):
    """One online-softmax step of the row statistics (max m, sum row_sum), each [tq, 1]."""
    m, row_sum = carry
    logits, past = tile_logits(qb_i, kb_j, q0, k0, scale, seg)
    logits = jnp.where(past, logits, MASKED)
    m_new = jnp.maximum(m, logits.max(axis=1, keepdims=True))
    p = jnp.where(past, jnp.exp(logits - m_new), 0.0)
    return m_new, row_sum * jnp.exp(m - m_new) + p.sum(axis=1, keepdims=True)


def lse_finish(m, row_sum):
    """Row log-sum-exp; 0 for a row with no past (row 0), whose alpha is masked to 0 anyway."""
    return jnp.where(row_sum > 0, m + jnp.log(jnp.where(row_sum > 0, row_sum, 1.0)), 0.0)


def dot(a, b, *, transpose_a=False, transpose_b=False):
    """a @ b, a^T @ b or a @ b^T of 2-D arrays, in fp32 at full precision."""
    dims = (((0 if transpose_a else 1,), (1 if transpose_b else 0,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def dlogit_tile(a, g_i, dg_i, lam_i, s_j, scale):
    """d loss / d(qb_i . kb_j) of one tile [tq, tk]: gamma_t alpha (<lambda_t, s_j> - dgamma_t) scale."""
    return g_i * a * (dot(lam_i, s_j, transpose_b=True) - dg_i) * scale


# ---- the kernels ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    block: int
    block_d: int
    scale: float  # 1/sqrt(dk) of the unpadded feedback width
    interpret: bool
    backend: str  # "gpu", "tpu" or "cpu": the platform this configuration lowers for


def check_blocks(block: int, backend: str, interpret: bool) -> None:
    """Raise naming the field when the chunk size cannot run on this backend."""
    check_tile("feedback solve", "block", block, backend, interpret)


def unit_lower_solve(m, r, *, transpose: bool = False):
    """(I - m)^{-1} r, or (I - m)^{-T} r, for strictly lower m [C, C] and r [C, D], by doubling."""
    steps = (m.shape[0] - 1).bit_length()
    for k in range(steps):
        r = r + dot(m, r, transpose_a=transpose)
        if k + 1 < steps:
            m = dot(m, m)
    return r


def _chunk(i, c):
    return pl.ds(pl.multiple_of(i * c, c), c)


def _lse_kernel(qb_ref, kb_ref, lse_ref, *, st: _Static):
    c, i = st.block, pl.program_id(1)
    qb_i = qb_ref[...]
    init = (jnp.full((c, 1), MASKED, jnp.float32), jnp.zeros((c, 1), jnp.float32))
    step = lambda j, carry: lse_update(carry, qb_i, kb_ref[_chunk(j, c), :], i * c, j * c, st.scale)  # noqa: E731
    lse_ref[...] = lse_finish(*lax.fori_loop(0, i + 1, step, init))


def _solve_kernel(qb_ref, kb_ref, lse_ref, gamma_ref, f_ref, s_ref, h_ref, *, st: _Static):
    c = st.block

    def chunk(i, carry):
        rows = _chunk(i, c)
        qb_i, lse_i, g_i = qb_ref[rows, :], lse_ref[rows, :], gamma_ref[rows, :]

        def past(j, acc):
            keys = _chunk(j, c)
            return acc + dot(alpha_tile(qb_i, kb_ref[keys, :], lse_i, i * c, j * c, st.scale), s_ref[keys, :])

        h_past = lax.fori_loop(0, i, past, jnp.zeros((c, st.block_d), jnp.float32))
        a_ii = alpha_tile(qb_i, kb_ref[rows, :], lse_i, i * c, i * c, st.scale)
        s_i = unit_lower_solve(g_i * a_ii, f_ref[rows, :] + g_i * h_past)
        s_ref[rows, :] = s_i
        h_ref[rows, :] = h_past + dot(a_ii, s_i)
        return carry

    lax.fori_loop(0, qb_ref.shape[0] // c, chunk, 0)


def _lambda_kernel(qb_ref, kb_ref, lse_ref, gamma_ref, ds_ref, lam_ref, *, st: _Static):
    c = st.block
    n = qb_ref.shape[0] // c

    def chunk(step, carry):
        i = n - 1 - step
        rows = _chunk(i, c)
        kb_i = kb_ref[rows, :]

        def later(k, acc):  # B_ki^T lambda_k for a later chunk k
            ks = _chunk(k, c)
            a = alpha_tile(qb_ref[ks, :], kb_i, lse_ref[ks, :], k * c, i * c, st.scale)
            return acc + dot(gamma_ref[ks, :] * a, lam_ref[ks, :], transpose_a=True)

        rhs = lax.fori_loop(i + 1, n, later, ds_ref[rows, :])
        a_ii = alpha_tile(qb_ref[rows, :], kb_i, lse_ref[rows, :], i * c, i * c, st.scale)
        lam_ref[rows, :] = unit_lower_solve(gamma_ref[rows, :] * a_ii, rhs, transpose=True)
        return carry

    lax.fori_loop(0, n, chunk, 0)


def _dq_kernel(qb_ref, kb_ref, lse_ref, gamma_ref, dgamma_ref, lam_ref, s_ref, dqb_ref, *, st: _Static):
    c, i = st.block, pl.program_id(1)
    qb_i, lse_i, g_i, dg_i, lam_i = qb_ref[...], lse_ref[...], gamma_ref[...], dgamma_ref[...], lam_ref[...]

    def body(j, dq):
        keys = _chunk(j, c)
        kb_j = kb_ref[keys, :]
        a = alpha_tile(qb_i, kb_j, lse_i, i * c, j * c, st.scale)
        return dq + dot(dlogit_tile(a, g_i, dg_i, lam_i, s_ref[keys, :], st.scale), kb_j)

    dqb_ref[...] = lax.fori_loop(0, i + 1, body, jnp.zeros(qb_i.shape, jnp.float32))


def _dk_kernel(qb_ref, kb_ref, lse_ref, gamma_ref, dgamma_ref, lam_ref, s_ref, dkb_ref, *, st: _Static):
    c, j = st.block, pl.program_id(1)
    kb_j, s_j = kb_ref[...], s_ref[...]

    def body(i, dk):
        rows = _chunk(i, c)
        qb_i = qb_ref[rows, :]
        a = alpha_tile(qb_i, kb_j, lse_ref[rows, :], i * c, j * c, st.scale)
        dlogit = dlogit_tile(a, gamma_ref[rows, :], dgamma_ref[rows, :], lam_ref[rows, :], s_j, st.scale)
        return dk + dot(dlogit, qb_i, transpose_a=True)

    dkb_ref[...] = lax.fori_loop(j, qb_ref.shape[0] // c, body, jnp.zeros(kb_j.shape, jnp.float32))


def _whole(x):
    """BlockSpec of the whole sequence of batch row b: [Tp, width]."""
    return pl.BlockSpec((None, x.shape[1], x.shape[2]), lambda b, i: (b, 0, 0))


def _rows(x, c):
    """BlockSpec of time chunk i: [C, width]."""
    return pl.BlockSpec((None, c, x.shape[2]), lambda b, i: (b, i, 0))


def _cols(x, dt):
    """BlockSpec of feature tile i over the whole sequence: [Tp, Dt]."""
    return pl.BlockSpec((None, x.shape[1], dt), lambda b, i: (b, 0, i))


def _call(kernel, st, grid, args, specs, out_like, out_specs):
    params = {}
    if not st.interpret and st.backend == "gpu":  # Triton: JAX's Mosaic GPU path has no dot here
        params["compiler_params"] = pltriton.CompilerParams()
    return pl.pallas_call(functools.partial(kernel, st=st), grid=grid, in_specs=specs, out_specs=out_specs,
                          out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in out_like],
                          interpret=st.interpret, **params)(*args)


def _forward(qb, kb, gamma, f, st):
    b, tp = qb.shape[:2]
    c, dt = st.block, st.block_d
    lse_like = jax.ShapeDtypeStruct((b, tp, 1), jnp.float32)
    (lse,) = _call(_lse_kernel, st, (b, tp // c), (qb, kb), [_rows(qb, c), _whole(kb)], [lse_like],
                   [_rows(lse_like, c)])
    args = (qb, kb, lse, gamma, f)
    s, h = _call(_solve_kernel, st, (b, f.shape[2] // dt), args,
                 [_whole(qb), _whole(kb), _whole(lse), _whole(gamma), _cols(f, dt)], [f, f],
                 [_cols(f, dt), _cols(f, dt)])
    return s, (qb, kb, lse, gamma, s, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _fused(qb, kb, gamma, f, st):
    return _forward(qb, kb, gamma, f, st)[0]


def _fused_bwd(st, res, ds):
    qb, kb, lse, gamma, s, h = res
    b, tp = qb.shape[:2]
    c, dt = st.block, st.block_d
    (lam,) = _call(_lambda_kernel, st, (b, s.shape[2] // dt), (qb, kb, lse, gamma, ds),
                   [_whole(qb), _whole(kb), _whole(lse), _whole(gamma), _cols(ds, dt)], [ds], [_cols(ds, dt)])
    dgamma = jnp.sum(lam * h, axis=-1, keepdims=True)
    args = (qb, kb, lse, gamma, dgamma, lam, s)
    (dqb,) = _call(_dq_kernel, st, (b, tp // c), args,
                   [_rows(qb, c), _whole(kb), _rows(lse, c), _rows(gamma, c), _rows(dgamma, c),
                    _rows(lam, c), _whole(s)], [qb], [_rows(qb, c)])
    (dkb,) = _call(_dk_kernel, st, (b, tp // c), args,
                   [_whole(qb), _rows(kb, c), _whole(lse), _whole(gamma), _whole(dgamma), _whole(lam),
                    _rows(s, c)], [kb], [_rows(kb, c)])
    return dqb, dkb, dgamma, lam


_fused.defvjp(lambda *a: _forward(*a), _fused_bwd)


def _pad(x, length, width):
    return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, length - x.shape[1]), (0, width - x.shape[2])))


def feedback_solve_pallas(qb, kb, gamma, f, *, block: int | None = None, block_d: int | None = None,
                          interpret: bool | None = None) -> jax.Array:
    """s [B, T, D] fp32 solving (I - B) s = f. qb, kb [B, T, dk]; gamma [B, T]; f [B, T, D].

    `interpret`: None (the default) lowers for the platform being lowered for (the Pallas
    interpreter on CPU, Triton on cuda, Mosaic on tpu, each with its own default `block` and
    rules: `positional.kernels.per_platform`); True interprets everywhere. `block_d` (the
    feature tile, parallel over the grid) defaults to the padded width, or 128 when that is a
    larger multiple of 128.
    """
    check_inputs(qb, kb, gamma, f)
    dk, d = qb.shape[2], f.shape[2]
    wd = max(16, pl.next_power_of_2(d))
    block_d = block_d or (128 if wd % 128 == 0 else wd)
    if wd % block_d:
        raise ValueError(f"feedback solve kernel block_d={block_d} must divide the padded feature width {wd}")

    def settings(backend: str, interpret: bool) -> _Static:
        c = block or DEFAULT_BLOCK.get("interpret" if interpret else backend, 64)
        check_blocks(c, backend, interpret)
        return _Static(block=c, block_d=block_d, scale=dk ** -0.5, interpret=interpret, backend=backend)

    return per_platform(settings, _padded, (qb, kb, gamma, f), interpret)


def _padded(st: _Static, qb, kb, gamma, f):
    """The solve on inputs padded to st's chunk (and widths to a power of two >= 16)."""
    t = qb.shape[1]
    tp = -(-t // st.block) * st.block
    wk, wd = (max(16, pl.next_power_of_2(w)) for w in (qb.shape[2], f.shape[2]))
    # Padded rows sit after every real row (hidden by the strict-past mask) and have gamma = 0.
    s = _fused(_pad(qb, tp, wk), _pad(kb, tp, wk), _pad(gamma[..., None], tp, 1), _pad(f, tp, wd), st)
    return s[:, :t, :f.shape[2]]
