"""PaTH across blocks as a Pallas kernel: the outer level of the two-level form
(positional/path/chunked.py, `span`), flash attention in which a query has one version per
earlier block.

Split at the boundaries of blocks of `span` tokens, the route from key j (block J) to query i
(block I > J) is (i carried back to the end of block J) x (j carried to the end of block J), so
s_ij = qv[J, i] . k_j, with qv[J, i] the query carried back across the whole blocks I - 1 ..
J + 1 (one D x D product each) and k_j the key carried to its block's end, both made by the
caller (`versions`, plain JAX). Across blocks PaTH is then plain attention, each query taking
the version of the key's block. This kernel is that attention: block-causal (query i sees the
keys of the blocks before its own), segment ids, grouped-query heads, a per-slot `Bias` (FoX's
gates) fused into the tiles, returning the rows' log-sum-exp so that it merges with the level
inside the blocks. Three kernels, each parallel over (batch, query head, tiles), no atomics:

  forward  a program per query tile: the key tiles of the earlier blocks, each against the
           query tile's version for that key's block, by an online softmax; out and lse;
  dq       a program per (query tile, version J): block J's key tiles, writing d qv[J] and
           its share of the bias values' gradient at query slots (summed over J after);
  dk, dv   a program per key tile (of block J): the query tiles of the later blocks at their
           version J, writing dk, dv and the bias values' gradient at key slots.

The versions cost memory: qv and d qv hold T / span copies of the queries, [B, H, T / span, T,
D] each (the authors' kernels keep every query carried to each 512-token boundary so), quadratic
in T. A caller may instead pass a run of whole query blocks at a time (`q_offset`, which may be
traced, so one kernel serves every run under a lax.map): the versions of one run live at once,
linear in T. A row with no key it may see (the first block's, or one whose
document starts in its own block) gets out 0 and lse -inf.

Two loop structures as in positional/kernels/flash.py: on GPU (Triton) and in the interpreter a
program loops over whole-sequence refs; on TPU (Mosaic, `stream`) the loop is the grid's last,
sequential dimension, one tile per step by BlockSpec, the running sums in VMEM scratch.
Statistics are fp32; q.k and P.V take the operands' dtype (P cast to V's) accumulated in fp32,
fp32 operands at full precision. Tiles (block_q, block_k) divide span; GPU: powers of two >= 16,
TPU: multiples of 128. Lengths are padded to whole blocks, head dimensions to a power of two >= 16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from positional.kernels import backward_inputs, check_tile, per_platform
from positional.logits import Bias
from positional.path.transport import HIGHEST
from positional.softmax import MASKED

# The kernel's outputs by name, for a caller's jax.checkpoint policy to keep (and not run the
# forward kernel again in the backward).
ACROSS_OUT = ("path_across_out", "path_across_lse")
DEFAULT_TILES = {"gpu": (64, 64), "tpu": (128, 128), "interpret": (64, 64)}
NT = (((1,), (1,)), ((), ()))  # a . b^T
TN = (((0,), (0,)), ((), ()))  # a^T . b


@dataclasses.dataclass(frozen=True)
class _Static:
    bias: Callable | None  # the Bias's fn(q values, k values, qi, kj), or None
    span: int
    block_q: int
    block_k: int
    heads: int  # query heads
    scale: float
    stream: bool
    interpret: bool
    backend: str
    num_warps: int = 4
    num_stages: int = 2

    def tiles(self, arrays: dict):
        """(query tiles, key tiles, query tiles per block, key tiles per block) of the padded
        arrays (the queries may be fewer than the keys)."""
        tq, t = arrays["q"]["seg"].shape[2], arrays["k"]["k"].shape[2]
        return tq // self.block_q, t // self.block_k, self.span // self.block_q, self.span // self.block_k


def _dot(a, b, dims=(((1,), (0,)), ((), ()))):
    return lax.dot_general(a, b, dims, precision=HIGHEST if a.dtype == jnp.float32 else None,
                           preferred_element_type=jnp.float32)


def _logits(st, dots, q_values, k_values, qb, kb, i, j):
    """Scaled, biased logits of query tile i against key tile j (of an earlier block), masked
    across segments: dots [bq, bk] fp32."""
    qi = i * st.block_q + lax.broadcasted_iota(jnp.int32, (st.block_q, 1), 0)
    kj = j * st.block_k + lax.broadcasted_iota(jnp.int32, (1, st.block_k), 1)
    s = dots * st.scale
    if st.bias is not None:
        s = s + st.bias(q_values, k_values, qi, kj)
    return jnp.where(qb["seg"] == kb["seg"], s, MASKED)


def _fwd_step(st, carry, q, qb, kb, i, j):
    o, m, row_sum = carry
    s = _logits(st, _dot(q, kb["k"], NT), qb["values"], kb["values"], qb, kb, i, j)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    corr = jnp.exp(m - m_new)
    v = kb["v"]
    return o * corr + _dot(p.astype(v.dtype), v), m_new, row_sum * corr + p.sum(axis=1, keepdims=True)


def _bwd_tile(st, q, qb, kb, i, j):
    """(P, d dots, d q values, d k values) of one tile, by dS = P (dP - delta)."""
    s, vjp = jax.vjp(lambda d, a, b: _logits(st, d, a, b, qb, kb, i, j), _dot(q, kb["k"], NT), qb["values"],
                     kb["values"])
    p = jnp.exp(s - qb["lse"])
    return (p, *vjp(p * (_dot(qb["do"], kb["v"], NT) - qb["delta"])))


def _dq_step(st, carry, q, qb, kb, i, j):
    _, d_dots, dqv, _ = _bwd_tile(st, q, qb, kb, i, j)
    k = kb["k"]
    return {"q": carry["q"] + _dot(d_dots.astype(k.dtype), k), "values": jax.tree.map(jnp.add, carry["values"], dqv)}


def _dkv_step(st, carry, q, qb, kb, i, j):
    p, d_dots, _, dkv = _bwd_tile(st, q, qb, kb, i, j)
    do = qb["do"]
    return {"k": carry["k"] + _dot(d_dots.astype(q.dtype), q, TN), "v": carry["v"] + _dot(p.astype(do.dtype), do, TN),
            "values": jax.tree.map(jnp.add, carry["values"], dkv)}


# ---- specs and refs ------------------------------------------------------------------------------
# Arrays are 4-D [B, heads, ., .], heads H (per query head), K (kv heads) or 1, the sequence on
# axis 2 ([n, d]) or, for the key side's seg and values, axis 3 ([1, n]). The query side: "seg"
# [B, 1, T, 1], "values" {name: [B, H, T, 1]}, in the backward "do", "lse", "delta"; the versions
# "qv" [B, H, N * T, D] (version J at rows J * T ..); the key side: "k", "v" [B, K, T, .], "seg"
# [B, 1, 1, T], "values" {name: [B, H, 1, T]}.

def _axis(side: str, name: str) -> int:
    return 3 if side == "k" and name in ("seg", "values") else 2


def _spec(st, x, axis: int, size: int, index: Callable | None):
    """BlockSpec of x on a grid (B, H, ...): a tile of `size` along `axis` at index(o,
    *grid[2:]), o the queries' offset in query tiles (streamed, the scalar prefetched), or the
    whole array (index None)."""
    shape = list(x.shape[2:])
    if index is not None:
        shape[axis - 2] = size

    def index_map(b, h, *rest):
        pos = [0, 0]
        if index is not None:
            *rest, offset = rest if st.stream else (*rest, None)
            pos[axis - 2] = index(0 if offset is None else offset[0], *rest)
        return (b, h // (st.heads // x.shape[1]), *pos)

    return pl.BlockSpec((None, None, *shape), index_map)


def _side_specs(st, side: str, arrays: dict, index: Callable | None) -> dict:
    size = st.block_q if side == "q" else st.block_k
    return {name: jax.tree.map(lambda x, n=name: _spec(st, x, _axis(side, n), size, index), group)
            for name, group in arrays.items()}


def _tile(ref, axis: int, start, size: int):
    at = pl.ds(pl.multiple_of(start, size), size)
    return ref[at, :] if axis == 2 else ref[:, at]


def _load(refs: dict, side: str, start=None, size: int = 0) -> dict:
    """A side's arrays: whole (start None: the refs are its tiles) or the tile at start."""
    return {name: jax.tree.map(lambda r, n=name: r[...] if start is None else _tile(r, _axis(side, n), start, size),
                               group) for name, group in refs.items()}


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pl.BlockSpec))


def _call(st, body, grid, arrays, specs, outputs, out_specs, init, name):
    """pallas_call of body(o, ins, outs, scratch), o the queries' offset in query tiles
    (arrays["offset"], [1] int32: streamed a prefetched scalar the index maps read, else an
    input); streamed, the running sums (init()'s shapes) in VMEM scratch and the grid's last
    axis sequential."""
    offset, arrays = arrays["offset"], {name: x for name, x in arrays.items() if name != "offset"}
    params, specs = {}, _leaves(specs)
    if st.stream:
        scratch = [pltpu.VMEM(x.shape, x.dtype) for x in jax.tree.leaves(jax.eval_shape(init))]
        params["grid_spec"] = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=1, grid=grid, in_specs=specs,
                                                           out_specs=_leaves(out_specs), scratch_shapes=scratch)
        if not st.interpret:
            params["compiler_params"] = pltpu.CompilerParams(
                dimension_semantics=("parallel",) * (len(grid) - 1) + ("arbitrary",))
    else:
        params |= {"grid": grid, "in_specs": [pl.BlockSpec((1,), lambda *_: (0,))] + specs,
                   "out_specs": _leaves(out_specs)}
        if not st.interpret and st.backend == "gpu":
            params["compiler_params"] = plgpu.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages)
    n_in, n_out = len(jax.tree.leaves(arrays)), len(jax.tree.leaves(outputs))

    def kernel(offset, *refs):
        ins = jax.tree.unflatten(jax.tree.structure(arrays), refs[:n_in])
        outs = jax.tree.unflatten(jax.tree.structure(outputs), refs[n_in:n_in + n_out])
        body(offset[0], ins, outs, refs[n_in + n_out:])

    out = pl.pallas_call(kernel, out_shape=jax.tree.leaves(outputs), interpret=st.interpret, name=f"path_across_{name}",
                         **params)(offset, *jax.tree.leaves(arrays))
    return jax.tree.unflatten(jax.tree.structure(outputs), out)


def _walk(st, scratch, init, step, finish, lo, hi, axis: int, steps: int):
    """step(carry, n) for n = lo .. hi - 1 from init(), then finish(carry): a loop, or streamed
    grid axis `axis` (`steps` long, n its index; every step fetches its tiles), the carry in VMEM
    scratch."""
    if not st.stream:
        finish(lax.fori_loop(lo, hi, lambda n, carry: step(carry, n), init()))
        return
    tree, n = jax.tree.structure(jax.eval_shape(init)), pl.program_id(axis)

    def read():
        return jax.tree.unflatten(tree, [r[...] for r in scratch])

    def write(carry):
        for ref, x in zip(scratch, jax.tree.leaves(carry)):
            ref[...] = x

    pl.when(n == 0)(lambda: write(init()))
    pl.when((n >= lo) & (n < hi))(lambda: write(step(read(), n)))
    pl.when(n == steps - 1)(lambda: finish(read()))


def _store(outs):
    def finish(carry):
        for ref, x in zip(jax.tree.leaves(outs), jax.tree.leaves(carry)):
            ref[...] = x.astype(ref.dtype)
    return finish


def _zeros(tiles: dict):
    return lambda: jax.tree.map(lambda shape: jnp.zeros(shape, jnp.float32), tiles,
                                is_leaf=lambda x: isinstance(x, tuple))


# ---- the three kernels -------------------------------------------------------------------------
# The queries may be a run of whole blocks starting o query tiles into the keys' sequence (o
# traced: one kernel for every run); query tile i is then the sequence's tile i + o.
def _forward(st: _Static, arrays: dict):
    b, h, tq = arrays["q"]["seg"].shape[0], st.heads, arrays["q"]["seg"].shape[2]
    nq, nk, qper, kper = st.tiles(arrays)
    bq, bk, dv = st.block_q, st.block_k, arrays["k"]["v"].shape[-1]
    visible = lambda i: (i // qper) * kper  # noqa: E731  key tiles 0 .. visible - 1: the earlier blocks'

    def init():
        return (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq, 1), MASKED, jnp.float32),
                jnp.zeros((bq, 1), jnp.float32))

    def body(o, ins, outs, scratch):
        i = pl.program_id(2)
        qb = _load(ins["q"], "q")

        def step(carry, j):
            if st.stream:
                q, kb = ins["qv"][...], _load(ins["k"], "k")
            else:
                q, kb = _tile(ins["qv"], 2, ((j // kper) * nq + i) * bq, bq), _load(ins["k"], "k", j * bk, bk)
            return _fwd_step(st, carry, q, qb, kb, i + o, j)

        def finish(carry):
            out, m, row_sum = carry
            empty = m <= MASKED  # no key this row may see
            outs["o"][...] = jnp.where(empty, 0.0, out / jnp.where(empty, 1.0, row_sum))
            outs["lse"][...] = jnp.where(empty, -jnp.inf, m + jnp.log(row_sum))

        _walk(st, scratch, init, step, finish, 0, visible(i + o), 3, nk)

    if st.stream:  # a key tile past the visible ones repeats the last visible (no copy)
        seen = lambda o, i, s: jnp.minimum(s, jnp.maximum(visible(i + o) - 1, 0))  # noqa: E731
        k_index, qv_index = seen, lambda o, i, s: (seen(o, i, s) // kper) * nq + i
    else:
        k_index = qv_index = None
    specs = {"q": _side_specs(st, "q", arrays["q"], lambda o, i, *s: i),
             "k": _side_specs(st, "k", arrays["k"], k_index), "qv": _spec(st, arrays["qv"], 2, bq, qv_index)}
    outputs = {"o": jax.ShapeDtypeStruct((b, h, tq, dv), jnp.float32),
               "lse": jax.ShapeDtypeStruct((b, h, tq, 1), jnp.float32)}
    out = _call(st, body, (b, h, nq) + ((nk,) if st.stream else ()), arrays, specs, outputs,
                _side_specs(st, "q", outputs, lambda o, i, *s: i), init, "forward")
    return out["o"], out["lse"]


def _dq(st: _Static, arrays: dict):
    """d qv [B, H, N * Tq, D] and the bias values' gradients at query slots, per version."""
    b, h, tq = arrays["q"]["seg"].shape[0], st.heads, arrays["q"]["seg"].shape[2]
    nq, nk, qper, kper = st.tiles(arrays)
    bq, bk, d = st.block_q, st.block_k, arrays["qv"].shape[-1]
    n = arrays["qv"].shape[2] // tq
    values = arrays["q"]["values"]
    init = _zeros({"q": (bq, d), "values": {name: (bq, 1) for name in values}})

    def body(o, ins, outs, scratch):
        i, v = pl.program_id(2), pl.program_id(3)  # query tile, version (the key block)
        qb, q = _load(ins["q"], "q"), ins["qv"][...]

        def step(carry, s):
            j = v * kper + s
            kb = _load(ins["k"], "k") if st.stream else _load(ins["k"], "k", j * bk, bk)
            return _dq_step(st, carry, q, qb, kb, i + o, j)

        # (the bound as a product: Pallas-Triton lowers `jnp.where(c, kper, 0)`, two literals, to
        # a select of two i1 `false` constants, an invalid loop bound)
        _walk(st, scratch, init, step, _store(outs), 0, kper * (v < (i + o) // qper).astype(jnp.int32), 4, kper)

    k_index = (lambda o, i, v, s: jnp.where(v < (i + o) // qper, v * kper + s, 0)) if st.stream else None
    version = lambda o, i, v, *s: v * nq + i  # noqa: E731
    specs = {"q": _side_specs(st, "q", arrays["q"], lambda o, i, *r: i),
             "k": _side_specs(st, "k", arrays["k"], k_index), "qv": _spec(st, arrays["qv"], 2, bq, version)}
    outputs = {"q": jax.ShapeDtypeStruct((b, h, n * tq, d), arrays["qv"].dtype),
               "values": {name: jax.ShapeDtypeStruct((b, h, n * tq, 1), jnp.float32) for name in values}}
    grid = (b, h, nq, n) + ((kper,) if st.stream else ())
    return _call(st, body, grid, arrays, specs, outputs, _side_specs(st, "q", outputs, version), init, "dq")


def _dkv(st: _Static, arrays: dict):
    """dk, dv [B, H, T, .] per query head and the bias values' gradients at key slots."""
    b, h = arrays["q"]["seg"].shape[0], st.heads
    nq, nk, qper, kper = st.tiles(arrays)
    bq, bk = st.block_q, st.block_k
    ks = arrays["k"]
    first = lambda o, j: jnp.maximum((j // kper + 1) * qper - o, 0)  # noqa: E731  the later blocks' query tiles
    init = _zeros({"k": (bk, ks["k"].shape[-1]), "v": (bk, ks["v"].shape[-1]),
                   "values": {name: (1, bk) for name in ks["values"]}})

    def body(o, ins, outs, scratch):
        j = pl.program_id(2)
        kb = _load(ins["k"], "k")

        def step(carry, i):
            if st.stream:
                q, qb = ins["qv"][...], _load(ins["q"], "q")
            else:
                q, qb = _tile(ins["qv"], 2, ((j // kper) * nq + i) * bq, bq), _load(ins["q"], "q", i * bq, bq)
            return _dkv_step(st, carry, q, qb, kb, i + o, j)

        _walk(st, scratch, init, step, _store(outs), first(o, j), nq, 3, nq)

    if st.stream:  # a query tile before the visible ones repeats the first visible
        seen = lambda o, j, s: jnp.minimum(jnp.maximum(s, first(o, j)), nq - 1)  # noqa: E731
        q_index, qv_index = seen, lambda o, j, s: (j // kper) * nq + seen(o, j, s)
    else:
        q_index = qv_index = None
    specs = {"q": _side_specs(st, "q", arrays["q"], q_index), "k": _side_specs(st, "k", ks, lambda o, j, *s: j),
             "qv": _spec(st, arrays["qv"], 2, bq, qv_index)}
    per_head = lambda x: jax.ShapeDtypeStruct((b, h, *x.shape[2:]), jnp.float32)  # noqa: E731
    outputs = {"k": per_head(ks["k"]), "v": per_head(ks["v"]), "values": jax.tree.map(per_head, ks["values"])}
    return _call(st, body, (b, h, nk) + ((nq,) if st.stream else ()), arrays, specs, outputs,
                 _side_specs(st, "k", outputs, lambda o, j, *s: j), init, "dkdv")


# ---- custom VJP -------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _across(st, arrays):
    """(out [B, H, T, Dv], the rows' log-sum-exp [B, H, T, 1]), both differentiable."""
    return _forward(st, arrays)


def _across_fwd(st, arrays):
    o, lse = (checkpoint_name(x, name) for x, name in zip(_forward(st, arrays), ACROSS_OUT))
    return (o, lse), (arrays, o, lse)


def _across_bwd(st, res, cotangents):
    arrays, o, lse = res
    do, d_lse = cotangents
    lse = jnp.where(jnp.isfinite(lse), lse, -MASKED)  # a row with no key: every p = 0
    full = {**backward_inputs(arrays, o, lse, do, d_lse), "qv": arrays["qv"], "offset": arrays["offset"]}
    dq, dk = _dq(st, full), _dkv(st, full)
    ks, (b, kh), tq = arrays["k"], arrays["k"]["k"].shape[:2], arrays["q"]["seg"].shape[2]

    def group_sum(x, like):  # per query head -> per kv head
        return x.reshape(b, kh, st.heads // kh, *x.shape[2:]).sum(2).astype(like.dtype)

    versions = lambda x: x.reshape(b, st.heads, -1, tq, 1).sum(2)  # noqa: E731
    return ({"qv": dq["q"], "offset": None,
             "q": {"seg": None, "values": jax.tree.map(versions, dq["values"])},
             "k": {"k": group_sum(dk["k"], ks["k"]), "v": group_sum(dk["v"], ks["v"]), "seg": None,
                   "values": dk["values"]}},)


_across.defvjp(_across_fwd, _across_bwd)


# ---- the public function ------------------------------------------------------------------------
def across_blocks(qv, k, v, *, span: int, bias_fn: Bias | None = None, segment_ids=None, scale: float | None = None,
                  q_offset=0, block_q: int | None = None, block_k: int | None = None,
                  block_size: int | None = None, interpret: bool | None = None, stream: bool | None = None,
                  platform: str | None = None, num_warps: int = 4, num_stages: int = 2):
    """Attention from each query to the keys of the blocks of `span` tokens before its own:
    qv [B, H, N, Tq, D], query i's version for key block J (N = ceil(T / span); read where
    J < i // span; d qv comes in qv's dtype); k [B, T, K, D], v [B, T, K, Dv] (H % K == 0);
    bias_fn a `Bias` or None; segment_ids [B, T] -> (out [B, Tq, H, Dv], the rows'
    log-sum-exp [B, Tq, H]), fp32, both differentiable in qv, k, v and the bias's values.
    The queries are tokens q_offset .. q_offset + Tq - 1 of the keys' sequence: all of them
    (Tq = T, q_offset 0), or a run of whole blocks (Tq a multiple of span, q_offset a multiple
    of span with q_offset + Tq <= T; an int, or a traced int32 scalar whose run the caller
    keeps in range: one kernel for every run), so that a caller can take the queries a run at
    a time and hold the versions of one run only. `versions` makes qv and the keys from PaTH's
    pieces. Tiles: block_q, block_k (dividing span; by default the platform's, or in the
    interpreter `block_size` where given, each made to divide span); interpret, stream,
    platform, num_warps, num_stages as positional/path/kernel.py's `path_attention`."""
    b, t, kh, d = k.shape
    n = -(-t // span) if isinstance(span, int) and span >= 1 else 0
    if not n:
        raise ValueError(f"PaTH across_blocks span={span!r} must be a positive integer (tokens per block)")
    tq = qv.shape[3] if qv.ndim == 5 else 0
    if qv.ndim != 5 or (qv.shape[0], qv.shape[2], qv.shape[4]) != (b, n, d) or qv.shape[1] % kh or not (
            tq == t or (tq % span == 0 and 0 < tq <= t)):
        raise ValueError(f"PaTH across_blocks: qv{tuple(qv.shape)} must be [B, H, ceil(T / span), Tq, D] = "
                         f"[{b}, a multiple of {kh}, {n}, {t} or a multiple of {span} up to it, {d}] "
                         f"for k{tuple(k.shape)} and span {span}")
    if isinstance(q_offset, int) and (q_offset % span or q_offset < 0 or q_offset + tq > t or (tq == t and q_offset)):
        raise ValueError(f"PaTH across_blocks q_offset={q_offset} must be a multiple of span={span} with "
                         f"q_offset + Tq <= T (Tq {tq}, T {t})")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"PaTH across_blocks: v{tuple(v.shape)} must be [B, T, K, Dv] with k{tuple(k.shape)}'s B, T, K")
    if bias_fn is not None and (not isinstance(bias_fn, Bias) or bias_fn.tables):
        raise ValueError("PaTH across_blocks: bias_fn must be a positional.logits.Bias of per-slot values (no tables)")
    h = qv.shape[1]
    values = bias_fn.per_slot(b, t, h) if bias_fn is not None else {}
    dtype = jnp.promote_types(qv.dtype, k.dtype)

    def settings(backend: str, interpret: bool) -> _Static:
        tiles = []
        for name, size, default in zip(("block_q", "block_k"), (block_q, block_k),
                                       DEFAULT_TILES["interpret" if interpret else backend]):
            if span % (size or 1):
                raise ValueError(f"PaTH across_blocks {name}={size} must divide span={span}")
            size = size or math.gcd(span, block_size if interpret and block_size else default)
            try:
                check_tile("PaTH across-blocks", name, size, backend, interpret)
            except ValueError as error:
                raise ValueError(f"{error}; the tiles divide span={span}") from None
            tiles.append(size)
        return _Static(bias=bias_fn.fn if bias_fn is not None else None, span=span, block_q=tiles[0],
                       block_k=tiles[1], heads=h, scale=d ** -0.5 if scale is None else float(scale),
                       stream=backend == "tpu" and not interpret if stream is None else bool(stream),
                       interpret=interpret, backend=backend, num_warps=num_warps, num_stages=num_stages)

    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    offset = jnp.asarray(q_offset, jnp.int32)
    return per_platform(settings, _padded, (qv.astype(dtype), k.astype(dtype), v, values, seg, offset), interpret,
                        platform)


def _padded(st: _Static, qv, k, v, values, seg, offset):
    """The kernel on inputs padded to whole blocks (head dimensions to a power of two >= 16),
    the query side read from `offset` (tokens) on."""
    b, h, n, tq, d = qv.shape
    t, tp = k.shape[1], n * st.span
    tqp = tp if tq == t else tq

    def pad(x, axis, size, value=0):  # (no copy where nothing is added)
        if x.shape[axis] == size:
            return x
        return jnp.pad(x, [(0, size - x.shape[a]) if a == axis else (0, 0) for a in range(x.ndim)],
                       constant_values=value)

    def layout(x):  # [B, T, heads, d] -> [B, heads, T_padded, d_padded]
        return jnp.swapaxes(pad(pad(x, 1, tp), 3, max(16, pl.next_power_of_2(x.shape[-1]))), 1, 2)

    qv = pad(pad(qv, 3, tqp), 4, max(16, pl.next_power_of_2(d)))  # [B, H, N, Tq_p, D_p]
    seg = pad(seg, 1, tp, -1)  # padding: a segment of its own
    vals = {name: jnp.swapaxes(pad(x, 1, tp), 1, 2) for name, x in values.items()}  # [B, H, T_p]
    run = lambda x, axis: lax.dynamic_slice_in_dim(x, offset, tqp, axis)  # noqa: E731  the queries' tokens
    arrays = {"q": {"seg": run(seg, 1)[:, None, :, None],
                    "values": {name: run(x, 2)[..., None] for name, x in vals.items()}},
              "k": {"k": layout(k), "v": layout(v), "seg": seg[:, None, None, :],
                    "values": {name: x[:, :, None] for name, x in vals.items()}},
              "qv": qv.reshape(b, h, n * tqp, qv.shape[-1]), "offset": (offset // st.block_q).reshape(1)}
    o, lse = _across(st, arrays)
    return jnp.swapaxes(o, 1, 2)[:, :tq, :, :v.shape[-1]], jnp.swapaxes(lse[..., 0], 1, 2)[:, :tq]


# ---- the versions, in plain JAX -------------------------------------------------------------------
def versions(q_start, whole, dtype=jnp.float32, first=0):
    """Every query carried back to the end of each earlier block: q_start [..., G, span, D] (the
    queries of blocks first .. first + G - 1 at their start; G = N and first 0 by default),
    whole [..., N, D, D] (each block's product, as rows take it: x -> x @ whole; leading axes
    broadcast) -> [..., N (J), G (I), span, D] in `dtype`, block I's queries at the end of
    block J for J < I (0 for J >= I). `first` may be traced. By a scan over J from the last
    block, fp32, N steps of one [G * span, D] x [D, D] product; the backward (a scan the other
    way) keeps only this output (in `dtype`) and `whole`."""
    return _versions(q_start, whole, jnp.asarray(first, jnp.int32), jnp.dtype(dtype), q_start.dtype)


def _stacked(out):
    return jnp.moveaxis(out, 0, -4)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _versions(q_start, whole, first, dtype, q_dtype):
    return _versions_fwd(q_start, whole, first, dtype, q_dtype)[0]


def _blocks(q_start, first):
    return first + jnp.arange(q_start.shape[-3])[:, None, None]


def _versions_fwd(q_start, whole, first, dtype, q_dtype):
    n, blocks = whole.shape[-3], _blocks(q_start, first)

    def step(x, j):  # x: the versions for block j + 1 -> for block j
        past = jnp.matmul(x, jnp.take(whole, jnp.minimum(j + 1, n - 1), axis=-3)[..., None, :, :], precision=HIGHEST)
        x = jnp.where(blocks == j + 1, q_start.astype(jnp.float32), past)
        return x, x.astype(dtype)

    _, out = lax.scan(step, jnp.zeros(q_start.shape, jnp.float32), jnp.arange(n), reverse=True)
    return _stacked(out), (out, whole, first)


def _versions_bwd(dtype, q_dtype, res, g):
    """The scan the other way: the cotangent of version j flows into version j + 1 through the
    product of block j + 1, whose gradient reads version j + 1 (the forward's output)."""
    out, whole, first = res
    n, blocks = whole.shape[-3], _blocks(g, first)
    g = jnp.moveaxis(g, -4, 0)

    def step(carry, j):
        c, dq, dw = carry
        a = g[j].astype(jnp.float32) + c  # the cotangent of version j
        dq = dq + jnp.where(blocks == j + 1, a, 0.0)
        m = jnp.where(blocks == j + 1, 0.0, a)  # ... of version j + 1 times block j + 1's product
        nxt = jnp.minimum(j + 1, n - 1)
        x = jnp.where(j + 1 < n, out[nxt].astype(jnp.float32), 0.0)
        dw_j = jnp.einsum("...nsd,...nse->...de", x, m, precision=HIGHEST)
        dw_j = jnp.sum(dw_j, [i for i, s in enumerate(whole.shape[:-3]) if s == 1 and dw_j.shape[i] > 1], keepdims=True)
        dw = dw.at[..., nxt, :, :].add(dw_j)
        w_next = jnp.take(whole, nxt, axis=-3)[..., None, :, :]
        return (jnp.matmul(m, jnp.swapaxes(w_next, -1, -2), precision=HIGHEST), dq, dw), None

    zeros = jnp.zeros(g.shape[1:], jnp.float32)
    (_, dq, dw), _ = lax.scan(step, (zeros, zeros, jnp.zeros(whole.shape, jnp.float32)), jnp.arange(n))
    return dq.astype(q_dtype), dw.astype(whole.dtype), None


_versions.defvjp(_versions_fwd, _versions_bwd)
