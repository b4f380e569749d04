"""One fused flash-attention kernel in Pallas for every scheme's logit: no T x T buffer.

The semantics of `positional.softmax.reference_attention` (causal, grouped-query heads, segment
ids, `q_offset`, `scale`) with the logit hooks of positional/logits.py fused into the tiles:
a `Score` (TAPA's phase logit) replaces scale * q.k, a `Bias` (ALiBi, FoX's gates, KERPLE, any
sum of them) is added, each computed in the tile from a few numbers per slot. The kernel takes
the hooks as arguments and imports no scheme, so a scheme whose bias is a `Bias` runs fused
with no kernel code of its own.

Forward (one program per batch, query head and query block): online softmax over the key
blocks up to the diagonal, in base 2 (exp2), writing the output and the row log-sum-exp.
Backward by the flash-attention recurrences, dL = P (dP - delta) with delta = rowsum(dO * O),
in two recomputing kernels: one per key block (dK, dV, and the gradients of the bias values
read at key slots), one per query block (dQ, and those read at query slots). The hooks'
derivatives are taken in the tile (`jax.vjp` of the logit function on the tile), so a new hook
needs no backward of its own. Grouped-query dK, dV are summed over the group outside.

Two loop structures share the tile functions: on GPU (Triton) and in the interpreter a program
loops over the other axis's blocks of whole-sequence refs (they stay in HBM, blocks are loaded
as needed); on TPU (Mosaic, `stream`) that axis is the grid's last, sequential dimension, each
step gets one block of K/V (or Q) by BlockSpec, and the running statistics live in VMEM
scratch, so nothing whole-sequence is resident. Blocks past the diagonal are skipped, and with
a sliding window those wholly before it (on TPU their index maps repeat the nearest visible
block, so they cost no copy): a windowed call does O(T x W) work.

A sink logit per head (gpt-oss's: one more logit in each row's normaliser, no value) is merged
into a row's running statistics when the row is done; its gradient is -sum_i p_sink,i delta_i
from the saved log-sum-exp (`sink_grad`), so neither backward kernel changes.

Statistics, the logit hooks and accumulation are fp32; matmuls take the input dtype (P and
dS are cast to it, as flash attention does), fp32 parts at full fp32 precision.

Tiles: block_q x block_k. On GPU powers of two >= 16, on TPU multiples of 128, in the
interpreter any size >= 1; the platform is the one being lowered for
(`positional.kernels.per_platform`). Lengths are padded to whole tiles, head parts to a power
of two >= 16 (which changes no dot product).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from positional.kernels import backward_inputs, check_tile, per_platform
from positional.logits import Bias, Score
from positional.softmax import MASKED, check_shapes, check_window, sink_of

LOG2E = 1.4426950408889634
# (block_q, block_k) when not given: the GPU tiles are the fastest forward + backward of the TAPA
# tiles measured (benchmarks/RESULTS.md, section 'TAPA: the fused Pallas kernel on an NVIDIA
# H100'); TPU needs lane-sized (128) tiles.
DEFAULT_TILES = {"gpu": (64, 32), "tpu": (128, 128), "interpret": (64, 64)}
NT = (((1,), (1,)), ((), ()))  # a . b^T
TN = (((0,), (0,)), ((), ()))  # a^T . b


@dataclasses.dataclass(frozen=True)
class _Static:
    logit: Callable  # (dots, q values, k values, qi, kj, tables) -> [tq, tk] fp32 logits
    q_offset: int
    kv_len: int
    group: int
    block_q: int
    block_k: int
    stream: bool  # grid over the inner blocks with VMEM accumulators (TPU) vs a loop (GPU, interpreter)
    interpret: bool
    backend: str
    num_warps: int
    num_stages: int
    fast_math: bool
    window: int | None = None  # sliding window: query i sees key j iff i - window < j <= i


def check_blocks(block_q: int, block_k: int, backend: str, interpret: bool) -> None:
    """Raise naming the field when a tile size cannot run on this backend."""
    for name, size in (("block_q", block_q), ("block_k", block_k)):
        check_tile("fused attention", name, size, backend, interpret)


def _exp2(x, st: _Static):
    if not st.fast_math:
        return jnp.exp2(x)
    out = jax.ShapeDtypeStruct(x.shape, x.dtype)  # one special-function instruction (GPU)
    return plgpu.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f",
                                        pack=1, result_shape_dtypes=[out])[0]


def _dots(qs, ks):
    precision = lambda a: lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # noqa: E731
    return tuple(lax.dot_general(a, b, NT, precision=precision(a), preferred_element_type=jnp.float32)
                 for a, b in zip(qs, ks))


def _mask(qi, kj, sq, sk, st: _Static):
    m = (kj <= qi) & (sq == sk) & (kj < st.kv_len)
    return m if st.window is None else m & (qi - kj < st.window)


def _rows(start, size):
    return start + lax.broadcasted_iota(jnp.int32, (size, 1), 0)


def _cols(start, size):
    return start + lax.broadcasted_iota(jnp.int32, (1, size), 1)


# ---- one tile, as each kernel's step: (q side, k side) blocks -> updated carry ---------------
# The q side's block qb: "parts" (tuple of [tq, d_i]), "values" ({name: [tq, 1]}), "tables"
# ({name: [1, n]}, the query head's), "seg" [tq, 1], and in the backward "do" [tq, dv], "lse",
# "delta" [tq, 1]; the k side's kb:
# "parts" ([tk, d_i]), "v" [tk, dv], "values" ({name: [1, tk]}), "seg" [1, tk]. i, j: the
# query and key block numbers.

def _fwd_step(st, carry, qb, kb, i, j):
    o, m, row_sum = carry
    qi, kj = _rows(st.q_offset + i * st.block_q, st.block_q), _cols(j * st.block_k, st.block_k)
    logits = st.logit(_dots(qb["parts"], kb["parts"]), qb["values"], kb["values"], qi, kj, qb["tables"])
    s = jnp.where(_mask(qi, kj, qb["seg"], kb["seg"], st), logits * LOG2E, MASKED)
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = _exp2(s - m_new, st)
    corr = _exp2(m - m_new, st)
    v = kb["v"]
    o = o * corr + jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m_new, row_sum * corr + p.sum(axis=1, keepdims=True)


def _bwd_tile(st, qb, kb, i, j, side: str):
    """(P, d logits/d dots, d logits/d the `side` values (and, side q, the tables)) of one tile,
    after dL = P (dP - delta)."""
    qi, kj = _rows(st.q_offset + i * st.block_q, st.block_q), _cols(j * st.block_k, st.block_k)
    dots = _dots(qb["parts"], kb["parts"])
    if side == "q":
        logits, vjp = jax.vjp(lambda d, a, t: st.logit(d, a, kb["values"], qi, kj, t), dots, qb["values"],
                              qb["tables"])
    else:
        logits, vjp = jax.vjp(lambda d, b: st.logit(d, qb["values"], b, qi, kj, qb["tables"]), dots,
                              kb["values"])
    s = jnp.where(_mask(qi, kj, qb["seg"], kb["seg"], st), logits * LOG2E, MASKED)
    p = _exp2(s - qb["lse"], st)
    dp = lax.dot_general(qb["do"], kb["v"], NT, preferred_element_type=jnp.float32)
    return (p, *vjp(p * (dp - qb["delta"])))


def _dq_step(st, carry, qb, kb, i, j):
    _, d_dots, d_values, d_tables = _bwd_tile(st, qb, kb, i, j, "q")
    dq = tuple(acc + jnp.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
               for acc, ds, k in zip(carry["parts"], d_dots, kb["parts"]))
    return {"parts": dq, "values": jax.tree.map(jnp.add, carry["values"], d_values),
            "table_sums": jax.tree.map(jnp.add, carry["table_sums"], d_tables)}


def _dkv_step(st, carry, qb, kb, i, j):
    p, d_dots, d_values = _bwd_tile(st, qb, kb, i, j, "k")
    do = qb["do"]
    dk = tuple(acc + lax.dot_general(ds.astype(q.dtype), q, TN, preferred_element_type=jnp.float32)
               for acc, ds, q in zip(carry["parts"], d_dots, qb["parts"]))
    dv = carry["v"] + lax.dot_general(p.astype(do.dtype), do, TN, preferred_element_type=jnp.float32)
    return {"parts": dk, "v": dv, "values": jax.tree.map(jnp.add, carry["values"], d_values)}


# ---- the two loop structures -------------------------------------------------------------------
# Every array is 4-D [B, heads, ., .] with its sequence on axis 2 ([n, d]) or 3 ([1, n]): the
# query side's parts, values, seg, do, lse, delta are [B, H or 1, T, .]; the key side's parts
# and v [B, K, S, .], its values [B, H, 1, S] and seg [B, 1, 1, S]. The query side's tables
# [B, H, 1, n] have no sequence axis (whole in every program); the dQ kernel's partial sums of
# their gradients, "table_sums" [B, H, query blocks, 1, n], one per program, are summed after.

def _layout(side: str, name: str) -> tuple[str, int | None]:
    """(heads, sequence axis) of an array: heads "q" (query head h), "kv" (h // group), "one"."""
    if name == "tables":
        return "q", None
    if name == "seg":
        return "one", 2 if side == "q" else 3
    if side == "k" and name in ("parts", "v"):
        return "kv", 2
    return "q", 3 if side == "k" and name == "values" else 2


def _bounds(st: _Static, outer: str, o, n_inner: int):
    """The inner blocks lo <= j < hi that outer block o sees (causality; and the window)."""
    w = st.window
    if outer == "q":
        first_query = st.q_offset + o * st.block_q
        lo = 0 if w is None else lax.div(jnp.maximum(first_query - w + 1, 0), st.block_k)
        return lo, jnp.minimum(n_inner, lax.div(first_query + st.block_q + st.block_k - 1, st.block_k))
    lo = lax.div(jnp.maximum(o * st.block_k - st.q_offset, 0), st.block_q)
    if w is None:
        return lo, n_inner
    last_query = o * st.block_k + st.block_k - 1 + w - 1 - st.q_offset  # the last that sees this block
    hi = lax.div(jnp.maximum(last_query + st.block_q, 0), st.block_q)  # floor(last_query / block_q) + 1
    return lo, jnp.clip(hi, lo, n_inner)  # hi = lo: no query sees this key block


def _specs(st: _Static, side: str, arrays: dict, role: str, n_inner: int = 0, heads: str | None = None):
    """BlockSpecs of a side's arrays on the grid (B, H, outer[, inner]): `role` "outer" (one
    block per program), "whole" (the whole sequence: loops) or "inner" (streamed blocks).
    heads: every array's head mapping, if not its own (outputs are per query head)."""
    block = st.block_q if side == "q" else st.block_k
    outer = "k" if side == "q" else "q"

    def spec(x, name):
        head_map, axis = _layout(side, name)
        head_map = heads or head_map
        shape = list(x.shape[2:])
        if role != "whole" and axis is not None:
            shape[axis - 2] = None if name == "table_sums" else block  # its program's row, [1, n]

        def index_map(b, h, o, *j):
            if axis is None:
                at = 0
            elif role == "whole":
                at = 0
            elif role == "outer":
                at = o
            else:  # a block outside the visible range repeats a visible one (no copy)
                lo, hi = _bounds(st, outer, o, n_inner)
                at = jnp.maximum(jnp.minimum(j[0], hi - 1), lo)
            pos = [0] * len(shape)
            pos[(axis or 2) - 2] = at
            return (b, {"q": h, "kv": h // st.group, "one": 0}[head_map], *pos)

        return pl.BlockSpec((None, None, *shape), index_map)

    return {name: jax.tree.map(lambda x, n=name: spec(x, n), group) for name, group in arrays.items()}


def _load(refs: dict, side: str, start=None, size=None) -> dict:
    """The arrays of a side's refs: whole, or the block start:start+size of the sequence."""
    def one(ref, name):
        if start is None or _layout(side, name)[1] is None:
            return ref[...]
        return ref[pl.ds(start, size), :] if _layout(side, name)[1] == 2 else ref[:, pl.ds(start, size)]
    return {name: jax.tree.map(lambda r, n=name: one(r, n), group) for name, group in refs.items()}


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pl.BlockSpec))


def _run(st: _Static, outer: str, step, init, finish, arrays: dict, outputs: dict):
    """One kernel: a program per (batch, query head, `outer` block) runs `step` over the visible
    blocks of the other side, looping over whole-sequence refs (GPU, interpreter) or, streamed
    (TPU), one block per step of the grid's last dimension, the carry in VMEM scratch.

    arrays {"q": {...}, "k": {...}} (see _layout); outputs: ShapeDtypeStructs laid out as the
    outer side's arrays, per query head; init() -> carry; finish(out_refs, carry, outer block)
    writes them."""
    inner = "k" if outer == "q" else "q"
    b, h = arrays["q"]["parts"][0].shape[:2]
    length = lambda side: arrays[side]["seg"].shape[_layout(side, "seg")[1]]  # noqa: E731
    n_outer, n_inner = (length(side) // (st.block_q if side == "q" else st.block_k) for side in (outer, inner))
    carry_shapes = jax.eval_shape(init)
    specs = {outer: _specs(st, outer, arrays[outer], "outer"),
             inner: _specs(st, inner, arrays[inner], "inner" if st.stream else "whole", n_inner)}
    size = st.block_k if inner == "k" else st.block_q

    def kernel(*refs):
        n_in, n_out = len(jax.tree.leaves(arrays)), len(jax.tree.leaves(outputs))
        in_refs = jax.tree.unflatten(jax.tree.structure(arrays), refs[:n_in])
        out_refs = jax.tree.unflatten(jax.tree.structure(outputs), refs[n_in:n_in + n_out])
        scratch = refs[n_in + n_out:]
        o = pl.program_id(2)
        lo, hi = _bounds(st, outer, o, n_inner)
        ob = _load(in_refs[outer], outer)

        def do_step(carry, blocks, j):
            qb, kb, i, jk = (ob, blocks, o, j) if outer == "q" else (blocks, ob, j, o)
            return step(st, carry, qb, kb, i, jk)

        if not st.stream:
            def body(j, carry):
                return do_step(carry, _load(in_refs[inner], inner, pl.multiple_of(j * size, size), size), j)
            finish(out_refs, lax.fori_loop(lo, hi, body, init()), ob)
            return
        j, tree = pl.program_id(3), jax.tree.structure(carry_shapes)

        def read():
            return jax.tree.unflatten(tree, [r[...] for r in scratch])

        def write(carry):
            for ref, x in zip(scratch, jax.tree.leaves(carry)):
                ref[...] = x

        pl.when(j == 0)(lambda: write(init()))
        pl.when((j >= lo) & (j < hi))(lambda: write(do_step(read(), _load(in_refs[inner], inner), j)))
        pl.when(j == n_inner - 1)(lambda: finish(out_refs, read(), ob))

    params = {}
    if st.stream:
        params["scratch_shapes"] = [pltpu.VMEM(x.shape, x.dtype) for x in jax.tree.leaves(carry_shapes)]
        if not st.interpret:
            params["compiler_params"] = pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    elif not st.interpret and st.backend == "gpu":
        params["compiler_params"] = plgpu.CompilerParams(num_warps=st.num_warps, num_stages=st.num_stages)
    out = pl.pallas_call(
        kernel, grid=(b, h, n_outer) + ((n_inner,) if st.stream else ()), in_specs=_leaves(specs),
        out_specs=_leaves(_specs(st, outer, outputs, "outer", heads="q")), out_shape=jax.tree.leaves(outputs),
        interpret=st.interpret, name=f"flash_{step.__name__.strip('_').removesuffix('_step')}",
        **params)(*jax.tree.leaves(arrays))
    return jax.tree.unflatten(jax.tree.structure(outputs), out)


# ---- forward, backward, custom VJP -------------------------------------------------------------
def _forward(st: _Static, arrays: dict):
    b, h, t = arrays["q"]["parts"][0].shape[:3]
    v = arrays["k"]["v"]
    bq, f32 = st.block_q, jnp.float32

    def init():
        return jnp.zeros((bq, v.shape[-1]), f32), jnp.full((bq, 1), MASKED, f32), jnp.zeros((bq, 1), f32)

    def finish(out, carry, qb):
        o, m, row_sum = carry
        if "sink" in qb:  # one more logit in the normaliser, no value (base 2, as m)
            m_new = jnp.maximum(m, qb["sink"])
            corr = _exp2(m - m_new, st)
            o, row_sum, m = o * corr, row_sum * corr + _exp2(qb["sink"] - m_new, st), m_new
        out["o"][...] = (o / row_sum).astype(out["o"].dtype)
        out["lse"][...] = m + jnp.log2(row_sum)  # of the base-2 logits

    outputs = {"o": jax.ShapeDtypeStruct((b, h, t, v.shape[-1]), v.dtype),
               "lse": jax.ShapeDtypeStruct((b, h, t, 1), f32)}
    out = _run(st, "q", _fwd_step, init, finish, arrays, outputs)
    return out["o"], out["lse"]


def _gradients(st: _Static, side: str, step, arrays: dict):
    """Per query head, fp32: d parts (and dv) of `side` and d its values (read at its slots)."""
    b, h = arrays["q"]["parts"][0].shape[:2]
    block = st.block_q if side == "q" else st.block_k
    mine = arrays[side]

    def like(x, n):  # the gradient of x [B, heads, ., .] per query head, and its block
        shape = (b, h, *x.shape[2:])
        tile = [block, x.shape[3]] if _layout(side, n)[1] == 2 else [1, block]
        return jax.ShapeDtypeStruct(shape, jnp.float32), tuple(tile)

    names = ("parts", "values") + (("v",) if side == "k" else ())
    outputs = {n: jax.tree.map(lambda x, n=n: like(x, n)[0], mine[n]) for n in names}
    tiles = {n: jax.tree.map(lambda x, n=n: like(x, n)[1], mine[n]) for n in names}
    if side == "q":  # one row of partial sums per program
        n_blocks = mine["seg"].shape[2] // block
        outputs["table_sums"] = {n: jax.ShapeDtypeStruct((b, h, n_blocks, 1, x.shape[-1]), jnp.float32)
                                 for n, x in mine["tables"].items()}
        tiles["table_sums"] = {n: (1, x.shape[-1]) for n, x in mine["tables"].items()}

    def init():
        return jax.tree.map(lambda t: jnp.zeros(t, jnp.float32), tiles, is_leaf=lambda t: isinstance(t, tuple)
                            and all(isinstance(i, int) for i in t))

    def finish(out, carry, _):
        for ref, x in zip(jax.tree.leaves(out), jax.tree.leaves(carry)):
            ref[...] = x

    return _run(st, side, step, init, finish, arrays, outputs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(st, arrays):
    return _forward(st, arrays)[0]


def _fused_fwd(st, arrays):
    o, lse = _forward(st, arrays)
    return o, (arrays, o, lse)


def _fused_bwd(st, res, do):
    arrays, o, lse = res
    v, full = arrays["k"]["v"], backward_inputs(arrays, o, lse, do)
    dq = _gradients(st, "q", _dq_step, full)
    dk = _gradients(st, "k", _dkv_step, full)
    b, kh = v.shape[:2]
    group_sum = lambda x, like: x.reshape(b, kh, st.group, *x.shape[2:]).sum(2).astype(like.dtype)  # noqa: E731
    grads = {"q": {"parts": tuple(g.astype(x.dtype) for g, x in zip(dq["parts"], arrays["q"]["parts"])),
                   "values": dq["values"], "seg": None,
                   "tables": {n: x.sum(2) for n, x in dq["table_sums"].items()}, **sink_grad(arrays, full)},
             "k": {"parts": tuple(map(group_sum, dk["parts"], arrays["k"]["parts"])),
                   "v": group_sum(dk["v"], v), "values": dk["values"], "seg": None}}
    return (grads,)


_fused.defvjp(_fused_fwd, _fused_bwd)


def sink_grad(arrays: dict, full: dict) -> dict:
    """{"sink": the gradient of the rows' base-2 sink logits}, {} without one: the sink's weight
    in row i is p_i = 2^(sink - lse_i), and d loss / d sink = -p_i delta_i (in base-2 units, so
    divided by log2(e)); the kernels need no code of their own for it."""
    if "sink" not in arrays["q"]:
        return {}
    q = full["q"]
    return {"sink": -jnp.exp2(arrays["q"]["sink"] - q["lse"]) * q["delta"] / LOG2E}


# ---- the public function -------------------------------------------------------------------------
def refusal(bias_fn, score_fn, q_offset) -> str | None:
    """Why the kernel cannot take these hooks and offset, or None."""
    for name, hook, kind in (("bias_fn", bias_fn, Bias), ("score_fn", score_fn, Score)):
        if hook is not None and not isinstance(hook, kind):
            return (f"{name} must be a positional.logits.{kind.__name__} (a function of per-slot values) to be "
                    f"fused; got {type(hook).__name__}")
    if not isinstance(q_offset, int):
        return "q_offset must be a Python int (the kernel's causal offset is static), not a traced value (decoding)"
    return None


def _pad_to(x, axis, size):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def fused_attention(q, k, v, *, bias_fn: Bias | None = None, score_fn: Score | None = None, segment_ids=None,
                    q_offset: int = 0, scale: float | None = None, block_q: int | None = None,
                    block_k: int | None = None, interpret: bool | None = None, stream: bool | None = None,
                    num_warps: int = 4, num_stages: int = 2, fast_math: bool = True,
                    block_size: int | None = None, platform: str | None = None, window: int | None = None,
                    sink=None) -> jax.Array:
    """Causal attention with the reference's signature and semantics, fused: q [B, T, H, D];
    k, v [B, S, K, D] -> [B, T, H, D]. bias_fn a `Bias`, score_fn a `Score` (positional/logits.py).

    `interpret`: None (the default) lowers for the platform being lowered for (the Pallas
    interpreter on CPU, Triton on cuda, Mosaic on tpu, each with its own default tiles and tile
    rules: `positional.kernels.per_platform`); True interprets everywhere. `stream`: None
    streams on TPU and in the interpreter (the faster of the two there), loops on GPU;
    True/False forces it (the interpreter runs both). GPU only:
    `num_warps`, `num_stages` (Triton), `fast_math` (exp2 by one special-function instruction).
    `platform` ("cpu", "cuda", "tpu"): build that platform's kernel alone (for a caller that
    branches per platform itself, the "auto" dispatcher). `window`: a sliding window
    (positional/softmax.py), tiles outside it skipped. `sink` [H]: one more logit per query
    head in every row's normaliser, merged into the online softmax when a row is done. `block_size` (the plain-JAX paths' block) is the interpreter's tile where none is given, so a
    model's CPU tests run the kernel over several tiles; lowering for GPU or TPU ignores it.
    """
    check_shapes(q, k, v, segment_ids)
    window = check_window(window)
    why = refusal(bias_fn, score_fn, q_offset)
    if why:
        raise ValueError(f"fused attention: {why}; use impl='blockwise'")
    b, t, h, d = q.shape
    s = k.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    q_parts, k_parts = score_fn.split(q, k) if score_fn is not None else ((q,), (k,))
    values = bias_fn.per_slot(b, s, h) if bias_fn is not None else {}
    tables = {}
    for name, x in (bias_fn.tables if bias_fn is not None else {}).items():
        if x.shape[0] not in (1, b) or x.shape[1] not in (1, h):
            raise ValueError(f"bias table {name!r} has shape {tuple(x.shape)}; it must broadcast to "
                             f"[B, H, n] = {(b, h, x.shape[2])} (n entries per query head)")
        tables[name] = jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b, h, x.shape[2]))[:, :, None]

    def logit(dots, qv, kv, qi, kj, tables):
        out = score_fn.fn(dots, qi, kj) if score_fn is not None else dots[0] * scale
        return out + bias_fn.fn({**qv, **tables}, kv, qi, kj) if bias_fn is not None else out

    def settings(backend: str, interpret: bool) -> _Static:
        if interpret and block_size:
            default_q = default_k = block_size
        else:
            default_q, default_k = DEFAULT_TILES.get("interpret" if interpret else backend, (64, 64))
        bq, bk = block_q or default_q, block_k or default_k
        check_blocks(bq, bk, backend, interpret)
        return _Static(logit=logit, q_offset=q_offset, kv_len=s, group=h // k.shape[2], block_q=bq, block_k=bk,
                       stream=backend != "gpu" if stream is None else bool(stream), interpret=interpret,
                       backend=backend, num_warps=num_warps, num_stages=num_stages,
                       fast_math=bool(fast_math) and not interpret and backend == "gpu", window=window)

    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    q_values = {n: x[:, q_offset:q_offset + t] for n, x in values.items()}
    # The sink per query row, as [B, H, T, 1] in base 2 (read by the forward's last step of a row).
    sinks = {} if sink is None else {"sink": jnp.broadcast_to(
        sink_of(sink, (h, 1)).reshape(1, h, 1, 1) * LOG2E, (b, h, t, 1))}
    return per_platform(settings, _padded, (q_parts, k_parts, v, q_values, values, tables, seg, sinks), interpret,
                        platform)


def _padded(st: _Static, q_parts, k_parts, v, q_values, k_values, tables, seg, sinks):
    """The kernel on inputs padded to st's tiles (and head parts to a power of two >= 16)."""
    b, t = seg.shape
    s, d = v.shape[1], v.shape[-1]
    tp, sp = -(-t // st.block_q) * st.block_q, -(-s // st.block_k) * st.block_k

    def layout(x, length):  # [B, n, heads, d] -> [B, heads, n_padded, d_padded]
        width = max(16, pl.next_power_of_2(x.shape[-1]))
        return jnp.swapaxes(_pad_to(_pad_to(x, 1, length), 3, width), 1, 2)

    # Keys beyond the query length (decoding) see segment 0, as the reference does without ids.
    seg_k = seg if s == t else jnp.zeros((b, s), jnp.int32)
    arrays = {"q": {"parts": tuple(layout(x, tp) for x in q_parts),
                    "values": {n: jnp.swapaxes(_pad_to(x, 1, tp), 1, 2)[..., None] for n, x in q_values.items()},
                    "tables": tables, "seg": _pad_to(seg, 1, tp)[:, None, :, None],
                    **{n: _pad_to(x, 2, tp) for n, x in sinks.items()}},
              "k": {"parts": tuple(layout(x, sp) for x in k_parts), "v": layout(v, sp),
                    "values": {n: jnp.swapaxes(_pad_to(x, 1, sp), 1, 2)[:, :, None] for n, x in k_values.items()},
                    "seg": _pad_to(seg_k, 1, sp)[:, None, None, :]}}
    o = _fused(st, arrays)
    return jnp.swapaxes(o, 1, 2)[:, :t, :, :d].astype(v.dtype)
