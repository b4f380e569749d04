"""Sessa's feedback solve (I - B) s = f in Pallas: blocked forward substitution, no T x T buffer.

Same signature and result as `positional.feedback.solve_reference` (s in fp32), segment ids
included (packed rows: the past of t is the strict past in t's segment). Every tile of
B = gamma alpha is recomputed from qb, kb, the row log-sum-exp and gamma (the tile functions
below, shared with the plain-JAX blocked solve of `positional/feedback.py`). Five kernels, each
a program per row chunk i (or feature tile) folding over the chunks k it needs:

  lse    per (b, i):        row log-sum-exp of the strict-past logits, flash style (k <= i).
  solve  per (b, Dt tile):  chunks in time order: R_i = f_i + gamma_i sum_{k<i} alpha_ik S_k,
                            S_i = (I - B_ii)^{-1} R_i; also h_i = sum_{k<=i} alpha_ik S_k.
  lambda per (b, Dt tile):  the backward's reverse-time solve lambda = (I - B)^{-T} ds, last
                            chunk first: lambda_i = (I - B_ii)^{-T} (ds_i + sum_{k>i} B_ki^T lambda_k).
  dq, dk per (b, i):        dlogit = gamma alpha (<lambda_t, s_j> - dgamma_t), dgamma_t = <lambda_t, h_t>,
                            contracted with kb (over key chunks k <= i) or qb (over query
                            chunks k >= i), as flash attention's backward does with dP.

The solve is sequential over chunks and parallel over (batch, feature tiles). Inside a chunk,
(I - M)^{-1} for strictly lower M [C, C] is the exact doubling product prod_k (I + M^(2^k)),
k < ceil(log2 C) (M^C = 0), so a chunk costs matmuls only. Everything is fp32 (bf16 inputs are
cast first): the solve is a recurrence whose error would otherwise compound along T.

Tiles: C (`block`) and Dt (`block_d`). On GPU (Triton) C must be a power of two >= 16 (by
default as the widths allow: `gpu_block`); on TPU (Mosaic) a multiple of 128; in interpret mode
(the CPU default) any size >= 1: each for the platform being lowered for
(`positional.kernels.per_platform`). The feature and feedback widths are zero-padded to a power
of two >= 16 (Triton's block rule), which changes no dot product and gives zero columns of s.

Two grid forms of the same kernel bodies (`_fold`), by the platform lowered for:
  - Triton (and the interpreter): grid (B, T/C) or (B, D/Dt); a program loops over chunks k of
    whole-sequence refs, which stay in global memory (only the tiles loaded are in registers).
  - TPU (Mosaic): the chunk pair is on the grid, (B, T/C, T/C) or (B, D/Dt, T/C, T/C), the last
    axis (k) sequential ("arbitrary"); every BlockSpec is one chunk [C, width], a key chunk's index
    clamped to the active range so the steps outside it fetch nothing new, and the fold's
    accumulator waits in VMEM scratch between steps. Resident for a whole sequence: only the
    solve's s and the lambda kernel's lambda, one [Tp, Dt] fp32 VMEM scratch each (4 MiB at
    T=8192, Dt=128; 16 MiB at 32K), because chunk i reads every earlier (later) chunk's result,
    written by the same program (an output block cannot be read back once written to HBM). At
    T=8192, dk = D = 1024, C = 128, a program holds about 2.4 (lse), 7.8 (solve), 8.1 (lambda)
    and 6 MiB (dq, dk) of VMEM, double buffers included, against 65-168 MiB with whole-sequence
    blocks. The TPU form asks for VMEM_LIMIT plus the resident scratch; it runs on CPU in Pallas's
    TPU interpret mode (`interpret="tpu"`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from positional.kernels import check_tile, per_platform, resident_limit
from positional.softmax import MASKED

# C when not given: TPU needs lane-sized (128) tiles; on GPU it depends on the widths (gpu_block).
DEFAULT_BLOCK = {"tpu": 128, "interpret": 64}
# TPU: the scoped VMEM asked for on top of the resident s (or lambda) of the sequential kernels.
VMEM_LIMIT = 32 * 2 ** 20
# GPU (Triton): a program holds chunk tiles [C, width] of the whole feedback and feature widths
# (the feature tile Dt bounds the solve's own only), so C x width bounds its shared memory.
# Compiled for an H100 (227 KiB a block) by XLA's GPU compiler, forward + backward
# (benchmarks/sessa_gpu_tiles.py): C x width = 8,192 fits (C = 32 at width 256, 16 at 512),
# 16,384 asks 258-402 KiB (C = 64 at 256, 32 at 512, 16 at 1,024), and C = 64 at width 128,
# which fits, compiled for 145-231 s against 5-12 s at 32.
GPU_TILE = 8192


def gpu_block(width: int) -> int:
    """The chunk C on GPU for padded feedback / feature widths up to `width`."""
    c = 64 if width <= 64 else min(32, GPU_TILE // width)
    if c < 16:
        raise ValueError(f"feedback solve kernel: on GPU a chunk of the {width}-wide feedback or feature rows does "
                         f"not fit the shared memory even at block=16 (block x width at most {GPU_TILE}); use "
                         "solve='blocked' (plain JAX), or model widths and feedback_dim of at most 512")
    return c


def check_inputs(qb, kb, gamma, f, segment_ids=None) -> None:
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
    if segment_ids is not None and (segment_ids.shape != qb.shape[:2]
                                    or not jnp.issubdtype(segment_ids.dtype, jnp.integer)):
        raise ValueError(f"feedback solve segment_ids must be integers [B, T] = {list(qb.shape[:2])}; "
                         f"got {segment_ids.dtype} {list(segment_ids.shape)}")


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

    @property
    def stream(self) -> bool:
        """The grid streams the chunks (TPU); otherwise a program loops over whole-sequence refs."""
        return self.backend == "tpu"


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


def _at(ref, k, st, axis=0):
    """Chunk k of a time-major operand (time on `axis`: 1 for the key segment row [1, Tp]): the
    block itself when the grid streams it (its BlockSpec already picked chunk k), else a slice."""
    if st.stream:
        return ref[...]
    return ref[:, _chunk(k, st.block)] if axis else ref[_chunk(k, st.block), :]


def _put(ref, k, st, value):
    if st.stream:
        ref[...] = value
    else:
        ref[_chunk(k, st.block), :] = value


def _fold(st, axis, lo, hi, init, step, finish, acc_refs):
    """finish(*acc) for the tuple acc = step(k, acc) folded from init over chunks lo <= k < hi.

    Triton and the interpreter: a loop inside the program. TPU: k is grid axis `axis`, the last,
    run in order; each grid step holds chunk k of the streamed operands, acc waits in the VMEM
    scratch `acc_refs` between steps, and finish runs on the last step."""
    if not st.stream:
        return finish(*lax.fori_loop(lo, hi, step, init))
    k = pl.program_id(axis)

    def store(values):
        for ref, value in zip(acc_refs, values):
            ref[...] = value

    pl.when(k == 0)(lambda: store(init))
    pl.when((lo <= k) & (k < hi))(lambda: store(step(k, tuple(r[...] for r in acc_refs))))
    pl.when(k == pl.num_programs(axis) - 1)(lambda: finish(*(r[...] for r in acc_refs)))


def _lse_kernel(qb_ref, segq_ref, kb_ref, segk_ref, lse_ref, *acc, st: _Static):
    c, i = st.block, pl.program_id(1)
    qb_i, seg_i = qb_ref[...], segq_ref[...]

    def step(j, carry):
        return lse_update(carry, qb_i, _at(kb_ref, j, st), i * c, j * c, st.scale, (seg_i, _at(segk_ref, j, st, 1)))

    def finish(m, row_sum):
        lse_ref[...] = lse_finish(m, row_sum)

    init = (jnp.full((c, 1), MASKED, jnp.float32), jnp.zeros((c, 1), jnp.float32))
    _fold(st, 2, 0, i + 1, init, step, finish, acc)


def _solve_kernel(qb_ref, segq_ref, lse_ref, gamma_ref, f_ref, kbi_ref, segki_ref, kb_ref, segk_ref,
                  s_ref, h_ref, *scratch, st: _Static):
    c = st.block
    s_all, acc = (scratch[0], scratch[1:]) if st.stream else (s_ref, ())  # s of every chunk so far

    def chunk(i, carry=None):
        at = lambda ref, axis=0: _at(ref, i, st, axis)  # noqa: E731
        qb_i, seg_i, lse_i, g_i = at(qb_ref), at(segq_ref), at(lse_ref), at(gamma_ref)

        def step(j, carry):  # alpha_ij S_j for an earlier chunk j
            a = alpha_tile(qb_i, _at(kb_ref, j, st), lse_i, i * c, j * c, st.scale, (seg_i, _at(segk_ref, j, st, 1)))
            return (carry[0] + dot(a, s_all[_chunk(j, c), :]),)

        def finish(h_past):
            a_ii = alpha_tile(qb_i, at(kbi_ref), lse_i, i * c, i * c, st.scale, (seg_i, at(segki_ref, 1)))
            s_i = unit_lower_solve(g_i * a_ii, at(f_ref) + g_i * h_past)
            s_all[_chunk(i, c), :] = s_i
            if st.stream:
                s_ref[...] = s_i
            _put(h_ref, i, st, h_past + dot(a_ii, s_i))

        _fold(st, 3, 0, i, (jnp.zeros((c, st.block_d), jnp.float32),), step, finish, acc)
        return carry

    if st.stream:
        chunk(pl.program_id(2))
    else:
        lax.fori_loop(0, qb_ref.shape[0] // c, chunk, 0)


def _lambda_kernel(qb_ref, segq_ref, lse_ref, gamma_ref, kbi_ref, segki_ref, ds_ref,
                   qbk_ref, segqk_ref, lsek_ref, gammak_ref, lam_ref, *scratch, st: _Static):
    c = st.block
    lam_all, acc = (scratch[0], scratch[1:]) if st.stream else (lam_ref, ())  # lambda of the later chunks
    n = pl.num_programs(2) if st.stream else qb_ref.shape[0] // c

    def chunk(i, carry=None):
        at = lambda ref, axis=0: _at(ref, i, st, axis)  # noqa: E731
        kb_i, segk_i = at(kbi_ref), at(segki_ref, 1)

        def step(k, carry):  # B_ki^T lambda_k for a later chunk k
            at_k = lambda ref, axis=0: _at(ref, k, st, axis)  # noqa: E731
            a = alpha_tile(at_k(qbk_ref), kb_i, at_k(lsek_ref), k * c, i * c, st.scale, (at_k(segqk_ref), segk_i))
            return (carry[0] + dot(at_k(gammak_ref) * a, lam_all[_chunk(k, c), :], transpose_a=True),)

        def finish(rhs):
            a_ii = alpha_tile(at(qb_ref), kb_i, at(lse_ref), i * c, i * c, st.scale, (at(segq_ref), segk_i))
            lam_i = unit_lower_solve(at(gamma_ref) * a_ii, at(ds_ref) + rhs, transpose=True)
            lam_all[_chunk(i, c), :] = lam_i
            if st.stream:
                lam_ref[...] = lam_i

        _fold(st, 3, i + 1, n, (jnp.zeros((c, st.block_d), jnp.float32),), step, finish, acc)
        return carry

    if st.stream:
        chunk(n - 1 - pl.program_id(2))
    else:
        lax.fori_loop(0, n, lambda step, carry: chunk(n - 1 - step, carry), 0)


def _dq_kernel(qb_ref, segq_ref, lse_ref, gamma_ref, dgamma_ref, lam_ref, kb_ref, segk_ref, s_ref,
               dqb_ref, *acc, st: _Static):
    c, i = st.block, pl.program_id(1)
    qb_i, seg_i, lse_i, g_i, dg_i, lam_i = (r[...] for r in (qb_ref, segq_ref, lse_ref, gamma_ref, dgamma_ref, lam_ref))

    def step(j, carry):
        kb_j = _at(kb_ref, j, st)
        a = alpha_tile(qb_i, kb_j, lse_i, i * c, j * c, st.scale, (seg_i, _at(segk_ref, j, st, 1)))
        return (carry[0] + dot(dlogit_tile(a, g_i, dg_i, lam_i, _at(s_ref, j, st), st.scale), kb_j),)

    def finish(dq):
        dqb_ref[...] = dq

    _fold(st, 2, 0, i + 1, (jnp.zeros(qb_i.shape, jnp.float32),), step, finish, acc)


def _dk_kernel(kb_ref, segk_ref, s_ref, qb_ref, segq_ref, lse_ref, gamma_ref, dgamma_ref, lam_ref,
               dkb_ref, *acc, st: _Static):
    c, j = st.block, pl.program_id(1)
    kb_j, seg_j, s_j = kb_ref[...], segk_ref[...], s_ref[...]

    def step(i, carry):
        at = lambda ref: _at(ref, i, st)  # noqa: E731
        qb_i = at(qb_ref)
        a = alpha_tile(qb_i, kb_j, at(lse_ref), i * c, j * c, st.scale, (at(segq_ref), seg_j))
        dlogit = dlogit_tile(a, at(gamma_ref), at(dgamma_ref), at(lam_ref), s_j, st.scale)
        return (carry[0] + dot(dlogit, qb_i, transpose_a=True),)

    def finish(dk):
        dkb_ref[...] = dk

    _fold(st, 2, j, pl.num_programs(1), (jnp.zeros(kb_j.shape, jnp.float32),), step, finish, acc)


# ---- block specs and calls -------------------------------------------------------------------
# Each operand has a role: "row", the program's own chunk i; "tile", the same in the program's
# feature tile (the solve and lambda kernels' f, ds, s, h, lambda); "key", the chunk k the fold is
# on (earlier chunks, or later ones with later=True). Arrays are [B, Tp, w], except the key
# segment ids [B, 1, Tp] (integers), time last, so that a chunk of them is a row [1, C].
def _spec(st, x, role, sequential, later):
    time_last = jnp.issubdtype(x.dtype, jnp.integer) and x.shape[1] == 1
    c, tp = st.block, x.shape[2] if time_last else x.shape[1]
    width = st.block_d if role == "tile" else x.shape[2]
    if st.stream:  # grid (B, [D/Dt,] i, k): one chunk each; a key clamped to the active range
        n = tp // c
        row = (lambda g: n - 1 - g[-2]) if later and sequential else (lambda g: g[-2])
        clamp = jnp.maximum if later else jnp.minimum
        pick = row if role != "key" else lambda g: clamp(row(g), g[-1])
        length = c
    elif sequential:  # grid (B, D/Dt): the whole sequence, a program loops over the chunks
        pick, length = (lambda g: 0), tp
    else:  # grid (B, T/C): the program's chunk, or the whole sequence for the loop over keys
        pick, length = ((lambda g: 0), tp) if role == "key" else ((lambda g: g[1]), c)
    col = (lambda g: g[1]) if role == "tile" else (lambda g: 0)
    if time_last:
        return pl.BlockSpec((None, 1, length), lambda *g: (g[0], 0, pick(g)))
    return pl.BlockSpec((None, length, width), lambda *g: (g[0], pick(g), col(g)))


def _call(kernel, st, args, roles, outs, *, tiles=None, later=False, scratch=()):
    """Run kernel over args (by `roles`) giving outs (ShapeDtypeStructs, role "row" or "tile").

    tiles: the feature tile count of the sequential kernels (solve, lambda), None for the others.
    scratch: on TPU, the VMEM scratch shapes (fp32) the kernel's fold keeps between grid steps."""
    b, tp = args[0].shape[:2]
    n, sequential = tp // st.block, tiles is not None
    grid = (b, tiles) if sequential else (b, n)
    out_roles = ["tile" if sequential else "row"] * len(outs)
    params = {}
    if st.stream:
        grid += (n, n) if sequential else (n,)
        semantics = ("parallel", "parallel") + ("arbitrary",) * (len(grid) - 2)
        resident = sum(4 * math.prod(s) for s in scratch)
        params["compiler_params"] = pltpu.CompilerParams(dimension_semantics=semantics,
                                                         vmem_limit_bytes=VMEM_LIMIT + resident)
        params["scratch_shapes"] = [pltpu.VMEM(s, jnp.float32) for s in scratch]
    elif not st.interpret and st.backend == "gpu":  # Triton: JAX's Mosaic GPU path has no dot here
        params["compiler_params"] = pltriton.CompilerParams()
    interpret = pltpu.InterpretParams() if st.interpret and st.stream else st.interpret
    spec = lambda x, role: _spec(st, x, role, sequential, later)  # noqa: E731
    return pl.pallas_call(functools.partial(kernel, st=st), grid=grid, name=f"sessa{kernel.__name__.removesuffix('_kernel')}",
                          in_specs=[spec(x, r) for x, r in zip(args, roles)],
                          out_specs=[spec(x, r) for x, r in zip(outs, out_roles)],
                          out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in outs],
                          interpret=interpret, **params)(*args)


def _forward(qb, kb, gamma, f, segq, segk, st):
    c, dt = st.block, st.block_d
    lse_like = jax.ShapeDtypeStruct((*qb.shape[:2], 1), jnp.float32)
    (lse,) = _call(_lse_kernel, st, (qb, segq, kb, segk), ("row", "row", "key", "key"), [lse_like],
                   scratch=[(c, 1), (c, 1)])
    args = (qb, segq, lse, gamma, f, kb, segk, kb, segk)
    s, h = _call(_solve_kernel, st, args, ("row",) * 4 + ("tile", "row", "row", "key", "key"), [f, f],
                 tiles=f.shape[2] // dt, scratch=[(qb.shape[1], dt), (c, dt)])
    return s, (qb, kb, lse, gamma, segq, segk, s, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _fused(qb, kb, gamma, f, segq, segk, st):
    return _forward(qb, kb, gamma, f, segq, segk, st)[0]


def _fused_bwd(st, res, ds):
    qb, kb, lse, gamma, segq, segk, s, h = res
    c, dt = st.block, st.block_d
    args = (qb, segq, lse, gamma, kb, segk, ds, qb, segq, lse, gamma)
    (lam,) = _call(_lambda_kernel, st, args, ("row",) * 6 + ("tile",) + ("key",) * 4, [ds],
                   tiles=ds.shape[2] // dt, later=True, scratch=[(qb.shape[1], dt), (c, dt)])
    dgamma = jnp.sum(lam * h, axis=-1, keepdims=True)
    (dqb,) = _call(_dq_kernel, st, (qb, segq, lse, gamma, dgamma, lam, kb, segk, s),
                   ("row",) * 6 + ("key",) * 3, [qb], scratch=[(c, qb.shape[2])])
    (dkb,) = _call(_dk_kernel, st, (kb, segk, s, qb, segq, lse, gamma, dgamma, lam),
                   ("row",) * 3 + ("key",) * 6, [kb], later=True, scratch=[(c, kb.shape[2])])
    return dqb, dkb, dgamma, lam, None, None


_fused.defvjp(lambda *a: _forward(*a), _fused_bwd)


def _pad(x, length, width):
    return jnp.pad(x.astype(jnp.float32), ((0, 0), (0, length - x.shape[1]), (0, width - x.shape[2])))


def feedback_solve_pallas(qb, kb, gamma, f, segment_ids=None, *, block: int | None = None,
                          block_d: int | None = None, interpret: bool | str | None = None) -> jax.Array:
    """s [B, T, D] fp32 solving (I - B) s = f. qb, kb [B, T, dk]; gamma [B, T]; f [B, T, D];
    segment_ids [B, T] integer (packed rows: the past is the strict past in the same segment).

    `interpret`: None (the default) lowers for the platform being lowered for (the Pallas
    interpreter on CPU, Triton on cuda, Mosaic on tpu, each with its own default `block` and
    rules: `positional.kernels.per_platform`); True interprets everywhere (the Triton form);
    "tpu" runs the TPU form (streamed chunks, VMEM scratch) in Pallas's TPU interpret mode.
    `block_d` (the feature tile, parallel over the grid) defaults to the padded width, or 128
    when that is a larger multiple of 128.
    """
    check_inputs(qb, kb, gamma, f, segment_ids)
    if interpret not in (None, True, False, "tpu"):
        raise ValueError(f"feedback solve kernel interpret={interpret!r} must be None, True, False or 'tpu'")
    dk, d = qb.shape[2], f.shape[2]
    wk, wd = (max(16, pl.next_power_of_2(w)) for w in (dk, d))
    block_d = block_d or (128 if wd % 128 == 0 else wd)
    if wd % block_d:
        raise ValueError(f"feedback solve kernel block_d={block_d} must divide the padded feature width {wd}")

    def settings(backend: str, interpret: bool) -> _Static:
        if block:
            c = block
        elif backend == "gpu" and not interpret:
            c = gpu_block(max(wk, wd))
        else:
            c = DEFAULT_BLOCK.get("interpret" if interpret else backend, 64)
        check_blocks(c, backend, interpret)
        if backend == "tpu" and not interpret:  # the sequential kernels keep s (or lambda) in VMEM
            need = 4 * (-(-qb.shape[1] // c) * c + c) * block_d
            limit, rule = resident_limit()
            if need > limit:
                raise ValueError(f"feedback solve kernel: on TPU it would keep {need / 2 ** 20:.1f} MiB of VMEM for "
                                 f"{qb.shape[1]} tokens ({rule}); use solve='blocked' (plain JAX) for this length")
        return _Static(block=c, block_d=block_d, scale=dk ** -0.5, interpret=interpret, backend=backend)

    seg = jnp.zeros(qb.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if interpret == "tpu":
        return _padded(settings("tpu", True), qb, kb, gamma, f, seg)
    return per_platform(settings, _padded, (qb, kb, gamma, f, seg), interpret)


def _padded(st: _Static, qb, kb, gamma, f, seg):
    """The solve on inputs padded to st's chunk (and widths to a power of two >= 16)."""
    t = qb.shape[1]
    tp = -(-t // st.block) * st.block
    wk, wd = (max(16, pl.next_power_of_2(w)) for w in (qb.shape[2], f.shape[2]))
    # Padded rows sit after every real row (hidden by the strict-past mask) and have gamma = 0.
    seg = jnp.pad(seg, ((0, 0), (0, tp - t)))
    s = _fused(_pad(qb, tp, wk), _pad(kb, tp, wk), _pad(gamma[..., None], tp, 1), _pad(f, tp, wd),
               seg[..., None], seg[:, None, :], st)
    return s[:, :t, :f.shape[2]]
