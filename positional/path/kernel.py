"""PaTH attention in Pallas, forward and a recomputing backward: no T x T buffer, and no D x D
product per token. The semantics of PaTH's reference (positional/path/reference.py: causal,
grouped-query heads, segment ids), with a per-slot score `Bias` (positional/logits.py; FoX's
gates) fused into the tiles as positional/kernels/flash.py fuses it.

    s_ij = q_i^T H_i ... H_{j+1} k_j / sqrt(D),   H_t = I - beta_t w_t w_t^T

q [B, T, H, D]; k, v, w [B, T, K, D]; beta [B, T, K] (H % K == 0: a query head reads the
transport of its kv head). The sequence is cut into chunks of c tokens. A chunk's product is
I - W^T U W with U its UT matrix (c x c, one unit-lower-triangular inverse), and any range of
steps inside the chunk uses the diagonal block of the same U. So for query chunk n and key
chunk m < n the route splits as (prefix of n up to i) x P_{n-1} ... P_{m+1} x (suffix of m
after j): the queries carried back to their chunk's start, then past one chunk per step, and
the keys carried to their chunk's end (k_end).

Per chunk, in plain JAX (differentiated by autodiff, O(T * c) memory): U and k_end. The rest
is the kernels', which read q, k, v, w, U, k_end, the bias's per-slot values and segment ids:

  forward, a program per (batch, query head, query chunk n): the in-chunk logits and the
    queries at the chunk's start (from q, k, w, U of chunk n), then key chunks m = n-1 .. 0:
    logits x . k_end_m, online softmax, x <- x (I - W_m^T U_m W_m). Writes out and the row
    log-sum-exp (the backward's only residuals besides the inputs).
  backward, a program per (batch, query head), query chunks in order. For chunk n the query
    chain (x at every earlier key chunk, [n * c, D]) is recomputed and kept; then the key
    chunks are walked from the farthest to the nearest, each tile recomputed (P = exp(logits -
    lse), dS = P (dP - delta)), the chain's adjoint g carried the other way (g <- g (I - W_m^T
    U_m W_m)^T + dS k_end_m, with dW_m, dU_m on the way); last, the in-chunk tile and the
    chunk's own pieces give dq, dk, dw, dU of chunk n. The chain cannot be run backwards (H_t
    is singular at beta_t = 1), hence kept; the key side's gradients (dk_end, dv, dw, dU and the
    bias values read at key slots) accumulate over the query chunks in whole-sequence buffers
    the program owns (O(T * D) per head). This is chunked.far_bwd with groups of one
    chunk, run per head; parallel over batch and heads, and on GPU optionally over `groups`
    programs per head, each taking every groups-th query chunk with accumulators of its own.

Two loop structures share the tile functions (as in flash.py): on GPU (Triton) and by default
in the interpreter, a program loops over whole-sequence refs (blocks loaded as needed; the
chain is an extra output it writes and reads back); on TPU (Mosaic, `stream`) the chunk walk
is the grid's last, sequential dimension, each step gets its chunk by BlockSpec, and the
running state and the chain live in VMEM scratch. The TPU backward keeps its key-side
accumulators and the chain resident in VMEM: 36 MiB at T = 8192 with D <= 128 and c = 128
(the accumulators twice, as double-buffered output blocks, and the chain), which it asks for
on top of VMEM_LIMIT: 68 MiB at 8K, within a v5e's, v5p's or v6e's VMEM. Past RESIDENT_MAX
(about 14K tokens), or past the chip's VMEM less its tiles' (`positional.kernels.resident_limit`:
on a v4's 16 MiB, about 1.8K tokens), lowering for TPU is refused (`refusal`; auto runs blockwise there). The GPU
backward reads back, in the same program, chain rows and accumulators it wrote to global
memory a step before; that relies on Triton giving each load the layout of the store it reads
(the same shape and slicing). The GPU form has run on an H100 (benchmarks/RESULTS.md, section
'PaTH on an NVIDIA H100: the Pallas kernel, the chunked form, fla and cuDNN'): it matches the
reference in values and every gradient, but its backward, parallel over batch x heads only
(groups=1), is slower than the plain-JAX chunked form there
(positional.attention.FACTS["path_kernel_gpu"]), so `auto` does not pick it on GPU. The TPU form has run only in Pallas's TPU
interpreter; both lower for cuda and tpu.

Transport arithmetic and softmax statistics are fp32 whatever the input dtype, its products at
full fp32 precision (on GPU `transport` may trade that for tensor cores: three or one TF32
products); P . V and dO . V^T take V's dtype (P cast to it), as flash attention does.

Chunk c: on GPU a power of two >= 16 (default 16), on TPU a multiple of 128 (default 128), in
the interpreter any size >= 1 (default 64, or the caller's block_size); the platform is the one
being lowered for (`positional.kernels.per_platform`). The length is padded to whole chunks
(beta 0: H = I), the head dimension to a power of two >= 16 (zeros change no dot product).
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

from positional.kernels import backward_inputs, check_tile, per_platform, resident_limit
from positional.linalg import unit_lower_inverse
from positional.logits import Bias, at_positions
from positional.path.transport import check_transport
from positional.softmax import MASKED, check_shapes

# GPU: of the chunks measured on an H100 (benchmarks/RESULTS.md, section 'PaTH on an NVIDIA
# H100'), 64 exceeds the shared memory (227 KiB per block) and 16 trains fastest.
DEFAULT_CHUNK = {"gpu": 16, "tpu": 128, "interpret": 64}
# TPU backward: the scoped VMEM asked for on top of its resident accumulators and chain (whose
# most is positional.kernels.RESIDENT_MAX, and the chip's own limit: `resident_limit`).
VMEM_LIMIT = 32 * 2 ** 20
# fp32 products on GPU (Triton): IEEE fp32 (CUDA cores), three TF32 products (tensor cores,
# about fp32's accuracy) or one. Other platforms always take "highest".
TRANSPORT = {"highest": lax.Precision.HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
             "tf32": lax.Precision.DEFAULT}
NN = (((1,), (0,)), ((), ()))  # a . b
NT = (((1,), (1,)), ((), ()))  # a . b^T
TN = (((0,), (0,)), ((), ()))  # a^T . b
# The key side's per-slot numbers are rows [1, T] (sequence last: lane-dense on TPU).
ROWS = ("seg", "values")


@dataclasses.dataclass(frozen=True)
class _Static:
    bias: Callable | None  # the Bias's fn(q values, k values, qi, kj), or None
    chunk: int
    heads: int  # query heads
    scale: float
    stream: bool  # the chunk walk on the grid with VMEM state (TPU) vs a loop over whole refs
    interpret: bool | str  # "tpu": Pallas's TPU interpreter
    backend: str
    num_warps: tuple = (4, 4)  # Triton's, (forward, backward)
    num_stages: tuple = (2, 1)
    transport: str = "highest"  # the precision of fp32 tiles' products (TRANSPORT); GPU only
    groups: int = 1  # loop form's backward: programs per head, each its own query chunks (n % groups)

    def dot(self, a, b, dims=NN):
        """a . b accumulated in fp32; fp32 operands at the `transport` precision, others (P . V) as given."""
        precision = TRANSPORT[self.transport] if a.dtype == jnp.float32 else None
        return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


# ---- tiles: 2-D arrays of one chunk ([c, D], [c, c]), fp32 --------------------------------------


def _iota(c, axis):
    return lax.broadcasted_iota(jnp.int32, (c, c), axis)


def _in_chunk(st, q, k, w, u):
    """(A, B, AU, in-chunk dots, q_start) of one chunk: q, k, w [c, D], u [c, c] fp32.

    A_is = q_i . w_s (s <= i) and B_tj = w_t . k_j (t > j) select the steps on each route
    (j, i] from the chunk's U; q_start: the queries carried to the chunk's start."""
    c = q.shape[0]
    row, col = _iota(c, 0), _iota(c, 1)
    a = jnp.where(col <= row, st.dot(q, w, NT), 0.0)
    b = jnp.where(row > col, st.dot(w, k, NT), 0.0)
    au = st.dot(a, u)
    return a, b, au, st.dot(q, k, NT) - st.dot(au, b), q - st.dot(au, w)


def _in_chunk_bwd(st, q, k, w, u, a, b, au, d_dots, g):
    """(dq, dk, dw, du) of `_in_chunk` given d(in-chunk dots) and g = d q_start."""
    c = q.shape[0]
    row, col = _iota(c, 0), _iota(c, 1)
    d_au = -st.dot(d_dots, b, NT) - st.dot(g, w, NT)
    d_a = jnp.where(col <= row, st.dot(d_au, u, NT), 0.0)
    d_b = jnp.where(row > col, -st.dot(au, d_dots, TN), 0.0)
    dq = g + st.dot(d_dots, k) + st.dot(d_a, w)
    dk = st.dot(d_dots, q, TN) + st.dot(d_b, w, TN)
    dw = st.dot(d_a, q, TN) + st.dot(d_b, k) - st.dot(au, g, TN)
    return dq, dk, dw, st.dot(a, d_au, TN)


def _carry(st, x, w, u):
    """Query rows x [c, D] carried back past a whole chunk: x (I - W^T U W)."""
    return x - st.dot(st.dot(st.dot(x, w, NT), u), w)


def _carry_bwd(st, x, w, u, g):
    """(dx, dw, du) of `_carry` given g = d(its output)."""
    xw = st.dot(x, w, NT)
    d_y = -st.dot(g, w, NT)
    d_xw = st.dot(d_y, u, NT)
    dw = st.dot(d_xw, x, TN) - st.dot(st.dot(xw, u), g, TN)
    return g + st.dot(d_xw, w), dw, st.dot(xw, d_y, TN)


def _logits(st, dots, q_values, k_values, qb, kb, n, m):
    """Scaled, biased, masked logits of query chunk n against key chunk m: dots [c, c]."""
    c = st.chunk
    qi = n * c + lax.broadcasted_iota(jnp.int32, (c, 1), 0)
    kj = m * c + lax.broadcasted_iota(jnp.int32, (1, c), 1)
    s = dots * st.scale
    if st.bias is not None:
        s = s + st.bias(q_values, k_values, qi, kj)
    return jnp.where((kj <= qi) & (qb["seg"] == kb["seg"]), s, MASKED)


def _softmax_step(st, state, s, v):
    o, m, row_sum = state
    m_new = jnp.maximum(m, s.max(axis=1, keepdims=True))
    p = jnp.exp(s - m_new)
    corr = jnp.exp(m - m_new)
    return o * corr + st.dot(p.astype(v.dtype), v), m_new, row_sum * corr + p.sum(axis=1, keepdims=True)


def _tile_bwd(st, dots, qb, kb, n, m):
    """(d dots, d q values, d k values, dv) of one tile, by dS = P (dP - delta)."""
    s, vjp = jax.vjp(lambda d, a, b: _logits(st, d, a, b, qb, kb, n, m), dots, qb["values"], kb["values"])
    p = jnp.exp(s - qb["lse"])
    dp = st.dot(qb["do"], kb["v"], NT)
    d_dots, dqv, dkv = vjp(p * (dp - qb["delta"]))
    return d_dots, dqv, dkv, st.dot(p.astype(qb["do"].dtype), qb["do"], TN)


# ---- refs: whole sequences or one chunk ---------------------------------------------------------
def _span(m, c):
    return pl.ds(pl.multiple_of(m * c, c), c)


def _at(ref, m, c, row: bool):
    """Chunk m of a whole-sequence ref ([T, w], or [1, T] for a row)."""
    return ref[:, _span(m, c)] if row else ref[_span(m, c), :]


def _put(ref, m, c, row: bool, x, add=False):
    """Write (or add) x at chunk m of a whole-sequence ref; m None: the ref is that chunk."""
    if m is None:
        ref[...] = x
        return
    idx = (slice(None), _span(m, c)) if row else (_span(m, c), slice(None))
    ref[idx] = ref[idx] + x if add else x


def _load(refs: dict, side: str, m, c) -> dict:
    """A side's arrays at chunk m of whole-sequence refs, or (m None) refs of one chunk."""
    return {name: jax.tree.map(lambda r, n=name: r[...] if m is None else _at(r, m, c, side == "k" and n in ROWS),
                               group) for name, group in refs.items()}


def _spec(x, row: bool, heads: int, index: Callable | None, c: int):
    """BlockSpec of x [B, heads of x, ., .] on a grid (B, H, ...): one chunk at index(*grid[2:])
    along the sequence (axis 3 for a row, else 2), or the whole sequence (index None)."""
    shape = list(x.shape[2:])
    axis = 1 if row else 0
    if index is not None:
        shape[axis] = c

    def index_map(b, h, *rest):
        pos = [0, 0]
        if index is not None:
            pos[axis] = index(*rest)
        return (b, h // (heads // x.shape[1]), *pos)

    return pl.BlockSpec((None, None, *shape), index_map)


def _specs(st, side: str, arrays: dict, index: Callable) -> dict:
    """Specs of a side's arrays; index(name): the chunk index map of that array (a function of
    grid[2:]), or None for the whole sequence."""
    return {name: jax.tree.map(lambda x, n=name: _spec(x, side == "k" and n in ROWS, st.heads, index(n), st.chunk),
                               group) for name, group in arrays.items()}


def _leaves(tree):
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, pl.BlockSpec))


def _call(st, kernel, grid, arrays, specs, outputs, out_specs, scratch=(), semantics=(), vmem=0, part=0):
    params = {}
    if st.stream:
        params["scratch_shapes"] = list(scratch)
        if not st.interpret:
            params["compiler_params"] = pltpu.CompilerParams(dimension_semantics=semantics,
                                                             vmem_limit_bytes=VMEM_LIMIT + vmem)
    elif not st.interpret and st.backend == "gpu":
        params["compiler_params"] = plgpu.CompilerParams(num_warps=st.num_warps[part], num_stages=st.num_stages[part])
    n_in, n_out = len(jax.tree.leaves(arrays)), len(jax.tree.leaves(outputs))

    def body(*refs):
        ins = jax.tree.unflatten(jax.tree.structure(arrays), refs[:n_in])
        outs = jax.tree.unflatten(jax.tree.structure(outputs), refs[n_in:n_in + n_out])
        kernel(ins, outs, refs[n_in + n_out:])

    # The TPU interpreter fills uninitialised memory with NaN: a block read before written shows.
    interpret = pltpu.InterpretParams(uninitialized_memory="nan") if st.interpret == "tpu" else st.interpret
    out = pl.pallas_call(body, grid=grid, in_specs=_leaves(specs), out_specs=_leaves(out_specs),
                         out_shape=jax.tree.leaves(outputs), interpret=interpret, name=("path_forward", "path_backward")[part],
                         **params)(*jax.tree.leaves(arrays))
    return jax.tree.unflatten(jax.tree.structure(outputs), out)


# ---- forward ----------------------------------------------------------------------------------
# arrays: {"q": {"q" [B, H, T, D], "seg" [B, 1, T, 1], "values" {name: [B, H, T, 1]}},
#          "k": {"k", "ke" (k_end), "v", "w" [B, K, T, D], "u" [B, K, T, c],
#                "seg" [B, 1, 1, T], "values" {name: [B, H, 1, T]}}}; T padded to whole chunks.
def _forward(st: _Static, arrays: dict):
    b, h, t, d = arrays["q"]["q"].shape
    c, n_chunks = st.chunk, t // st.chunk
    v = arrays["k"]["v"]
    f32 = jnp.float32

    def kernel(ins, outs, scratch):
        n = pl.program_id(2)
        qb = _load(ins["q"], "q", None, c)
        q = qb["q"].astype(f32)

        def near(kb):  # -> (softmax state, queries at the chunk's start)
            *_, dots, x = _in_chunk(st, q, kb["k"].astype(f32), kb["w"], kb["u"])
            state = (jnp.zeros((c, v.shape[-1]), f32), jnp.full((c, 1), MASKED, f32), jnp.zeros((c, 1), f32))
            return _softmax_step(st, state, _logits(st, dots, qb["values"], kb["values"], qb, kb, n, n), kb["v"]), x

        def far(state, x, kb, m):
            s = _logits(st, st.dot(x, kb["ke"], NT), qb["values"], kb["values"], qb, kb, n, m)
            return _softmax_step(st, state, s, kb["v"]), _carry(st, x, kb["w"], kb["u"])

        def finish(state):
            o, m, row_sum = state
            outs["o"][...] = (o / row_sum).astype(outs["o"].dtype)
            outs["lse"][...] = m + jnp.log(row_sum)

        if not st.stream:
            def body(j, carry):
                return far(*carry, _load(ins["k"], "k", n - 1 - j, c), n - 1 - j)
            finish(lax.fori_loop(0, n, body, near(_load(ins["k"], "k", n, c)))[0])
            return
        # Streamed: step j = 0 the in-chunk tile, j = 1 .. n key chunk n - j; later steps idle.
        j, kb = pl.program_id(3), _load(ins["k"], "k", None, c)

        def read():
            o, m, row_sum, x = (r[...] for r in scratch)
            return (o, m, row_sum), x

        def write(carry):
            for ref, x in zip(scratch, jax.tree.leaves(carry)):
                ref[...] = x

        pl.when(j == 0)(lambda: write(near(kb)))
        pl.when((j >= 1) & (j <= n))(lambda: write(far(*read(), kb, n - j)))
        pl.when(j == n_chunks - 1)(lambda: finish(read()[0]))

    outputs = {"o": jax.ShapeDtypeStruct((b, h, t, v.shape[-1]), v.dtype),
               "lse": jax.ShapeDtypeStruct((b, h, t, 1), f32)}
    own = lambda name: lambda n, *j: n  # noqa: E731  the program's query chunk
    if st.stream:  # past chunk 0 the index stays at 0: no copy
        k_specs = _specs(st, "k", arrays["k"], lambda name: own(name) if name == "k" else
                         lambda n, j: jnp.where(j == 0, n, jnp.maximum(n - j, 0)))
        grid = (b, h, n_chunks, n_chunks)
        scratch = [pltpu.VMEM(shape, f32) for shape in ((c, v.shape[-1]), (c, 1), (c, 1), (c, d))]
    else:
        k_specs, grid, scratch = _specs(st, "k", arrays["k"], lambda name: None), (b, h, n_chunks), ()
    out = _call(st, kernel, grid, arrays, {"q": _specs(st, "q", arrays["q"], own), "k": k_specs}, outputs,
                _specs(st, "q", outputs, own), scratch, ("parallel", "parallel", "parallel", "arbitrary"))
    return out["o"], out["lse"]


# ---- backward ---------------------------------------------------------------------------------
# The q side adds "do" [B, H, T, D], "lse" and "delta" [B, H, T, 1]. Outputs, per query head,
# fp32: the q side's "q" and "values"; the k side's "k" and the ACCUMULATED ones.
ACCUMULATED = ("ke", "v", "w", "u", "values")  # k-side gradients summed over the query chunks


def _backward(st: _Static, arrays: dict):
    b, h, t, d = arrays["q"]["q"].shape
    c, n_chunks = st.chunk, t // st.chunk
    f32 = jnp.float32
    ks = arrays["k"]

    groups = 1 if st.stream else st.groups

    def per_head(x, copies=1):  # copies: one buffer per group of query chunks
        return jax.ShapeDtypeStruct((b, h * copies, *x.shape[2:]), f32)

    outputs = {"q": {"q": per_head(arrays["q"]["q"]), "values": jax.tree.map(per_head, arrays["q"]["values"])},
               "k": {"k": per_head(ks["k"]),
                     **{name: jax.tree.map(lambda x: per_head(x, groups), ks[name]) for name in ACCUMULATED}}}
    if not st.stream:  # the chain: an output the program writes and reads back (Triton has no scratch)
        outputs["chain"] = jax.ShapeDtypeStruct((b, h * groups, t, d), f32)

    def kernel(ins, outs, scratch):
        chain = scratch[0] if st.stream else outs["chain"]

        def accumulate(m, grads, add):  # k-side gradients of chunk m; its first write (finish) sets them
            for name, group in grads.items():
                jax.tree.map(lambda ref, x, n=name: _put(ref, m, c, n in ROWS, x, add), outs["k"][name], group)

        def start(qb, kb):  # (in-chunk pieces, queries at the chunk's start)
            q, k = qb["q"].astype(f32), kb["k"].astype(f32)
            a, bm, au, dots, x = _in_chunk(st, q, k, kb["w"], kb["u"])
            return (q, k, a, bm, au, dots), x

        def walk(n, m, qb, kb, g, dqv):  # key chunk m of query chunk n, far to near; g = d chain[m - 1]
            x = _at(chain, m, c, False)
            dx, dw, du = _carry_bwd(st, x, kb["w"], kb["u"], g)
            d_dots, dqv_t, dkv, dv = _tile_bwd(st, st.dot(x, kb["ke"], NT), qb, kb, n, m)
            accumulate(m, {"ke": st.dot(d_dots, x, TN), "v": dv, "w": dw, "u": du, "values": dkv}, True)
            return dx + st.dot(d_dots, kb["ke"]), jax.tree.map(jnp.add, dqv, dqv_t)

        def finish(n, qb, kb, g, dqv, at):  # chunk n's in-chunk tile and pieces, g = d q_start; at: its
            (q, k, a, bm, au, dots), _ = start(qb, kb)  # chunk in the q-side outputs (None: theirs)
            d_dots, dqv_t, dkv, dv = _tile_bwd(st, dots, qb, kb, n, n)
            dq, dk, dw, du = _in_chunk_bwd(st, q, k, kb["w"], kb["u"], a, bm, au, d_dots, g)
            # The chunk's first write sets its accumulators; with groups they start at zero (below).
            accumulate(n, {"ke": jnp.zeros_like(dk), "v": dv, "w": dw, "u": du, "values": dkv}, groups > 1)
            _put(outs["q"]["q"], at, c, False, dq)
            _put(outs["k"]["k"], at, c, False, dk)
            jax.tree.map(lambda ref, x, y: _put(ref, at, c, False, x + y), outs["q"]["values"], dqv, dqv_t)

        zero_g = jnp.zeros((c, d), f32)
        zero_qv = jax.tree.map(lambda r: jnp.zeros((c, 1), f32), ins["q"]["values"])
        if not st.stream:
            def chunk(n, carry):
                qb, kb = _load(ins["q"], "q", n, c), _load(ins["k"], "k", n, c)

                def keep(j, x):  # chain[m] = x, m = n - 1 - j
                    m = n - 1 - j
                    _put(chain, m, c, False, x)
                    return _carry(st, x, _at(ins["k"]["w"], m, c, False), _at(ins["k"]["u"], m, c, False))

                lax.fori_loop(0, n, keep, start(qb, kb)[1])
                g, dqv = lax.fori_loop(0, n, lambda m, gd: walk(n, m, qb, _load(ins["k"], "k", m, c), *gd),
                                       (zero_g, zero_qv))
                finish(n, qb, kb, g, dqv, n)
                return carry

            # Query chunks first, first + groups, ...; with groups, each its own accumulators, zeroed first.
            first = pl.program_id(2)

            def clear(m, carry):
                for name in ACCUMULATED:
                    jax.tree.map(lambda ref, row=name in ROWS: _put(ref, m, c, row, jnp.zeros(
                        (1, c) if row else (c, ref.shape[1]), f32)), outs["k"][name])
                return carry

            if groups > 1:
                lax.fori_loop(0, n_chunks, clear, 0)
            lax.fori_loop(0, (n_chunks - first + groups - 1) // groups, lambda i, x: chunk(first + i * groups, x), 0)
            return
        # Streamed: step 0 starts chunk n's chain, steps 1 .. n-1 extend it, steps n .. 2n-1 walk
        # key chunks 0 .. n-1, step 2n finishes chunk n; later steps idle.
        n, step = pl.program_id(2), pl.program_id(3)
        qb, kb = _load(ins["q"], "q", None, c), _load(ins["k"], "k", None, c)
        g_ref, qv_refs = scratch[1], jax.tree.unflatten(jax.tree.structure(zero_qv), scratch[2:])

        def state():
            return g_ref[...], jax.tree.map(lambda r: r[...], qv_refs)

        def keep(g, dqv):
            _put(g_ref, None, c, False, g)
            jax.tree.map(lambda r, x: _put(r, None, c, False, x), qv_refs, dqv)

        def extend():  # chain[m - 1] from chain[m], m = n - step
            _put(chain, n - step - 1, c, False, _carry(st, _at(chain, n - step, c, False), kb["w"], kb["u"]))

        pl.when(step == 0)(lambda: keep(zero_g, zero_qv))
        pl.when((step == 0) & (n > 0))(lambda: _put(chain, n - 1, c, False, start(qb, kb)[1]))
        pl.when((step >= 1) & (step < n))(extend)
        pl.when((step >= n) & (step < 2 * n))(lambda: keep(*walk(n, step - n, qb, kb, *state())))
        pl.when(step == 2 * n)(lambda: finish(n, qb, kb, *state(), None))

    own = lambda name: lambda n, *step: n  # noqa: E731  the program's query chunk
    if st.stream:
        def k_index(name):
            if name == "k":
                return own(name)
            if name in ("w", "u"):  # the chain's chunks, then the walk's
                return lambda n, s: jnp.where(s == 0, n, jnp.where(s < n, n - s, jnp.where(s < 2 * n, s - n, n)))
            return lambda n, s: jnp.where(s < n, 0, jnp.where(s < 2 * n, s - n, n))  # the walk's

        specs = {"q": _specs(st, "q", arrays["q"], own), "k": _specs(st, "k", ks, k_index)}
        out_specs = {"q": _specs(st, "q", outputs["q"], own),
                     "k": _specs(st, "k", outputs["k"], lambda name: own(name) if name == "k" else None)}
        grid = (b, h, n_chunks, 2 * n_chunks - 1)
        scratch = [pltpu.VMEM((t, d), f32), pltpu.VMEM((c, d), f32)]
        scratch += [pltpu.VMEM((c, 1), f32) for _ in jax.tree.leaves(arrays["q"]["values"])]
        vmem = _resident(t, d, c, len(jax.tree.leaves(arrays["q"]["values"])))
    else:
        whole = lambda name: None  # noqa: E731
        own_group = lambda x: pl.BlockSpec((None, None, *x.shape[2:]),  # noqa: E731
                                           lambda b, h, g: (b, h * groups + g, 0, 0))
        specs = {side: _specs(st, side, arrays[side], whole) for side in ("q", "k")}
        out_specs = {"q": _specs(st, "q", outputs["q"], whole),
                     "k": {"k": _spec(outputs["k"]["k"], False, h, None, c),
                           **{name: jax.tree.map(own_group, outputs["k"][name]) for name in ACCUMULATED}},
                     "chain": own_group(outputs["chain"])}
        grid, scratch, vmem = (b, h, groups), (), 0
    out = _call(st, kernel, grid, arrays, specs, outputs, out_specs, scratch,
                ("parallel", "parallel", "arbitrary", "arbitrary"), vmem, part=1)
    if groups == 1:
        return out["q"], out["k"]
    summed = {name: jax.tree.map(lambda x: x.reshape(b, h, groups, *x.shape[2:]).sum(2), out["k"][name])
              for name in ACCUMULATED}
    return out["q"], {**out["k"], **summed}


def _resident(t, d, c, n_values) -> int:
    """Bytes of VMEM the TPU backward keeps for the whole sequence (t padded, d the padded head
    dimension): the chain, and twice (double-buffered output blocks) the accumulators of
    k_end, v, w ([t, d]), U ([t, c]) and the bias values ([1, t] each); fp32 in (8, 128) tiles."""
    def size(rows, cols):
        return 4 * (-(-rows // 8) * 8) * (-(-cols // 128) * 128)
    return size(t, d) + 2 * (3 * size(t, d) + size(t, c) + n_values * size(1, t))


def refusal(bias_fn, k, platform: str, chunk: int | None = None) -> str | None:
    """Why the kernel cannot take keys k [B, T, K, D] and this bias when lowered for `platform`
    ("cpu", "cuda", "tpu"), or None: a bias that is not a `Bias`; on TPU, a sequence whose
    backward would keep more than RESIDENT_MAX of VMEM (about 14K tokens), or more than the chip's
    VMEM less the tiles' (`resident_limit`: a v4 has 16 MiB, a v5p 64)."""
    if bias_fn is not None and not isinstance(bias_fn, Bias):
        return (f"bias_fn must be a positional.logits.Bias (a function of per-slot values) to be fused; "
                f"got {type(bias_fn).__name__}")
    if bias_fn is not None and bias_fn.tables:
        return f"its bias reads per-head tables ({', '.join(bias_fn.tables)}), which this kernel does not take"
    if platform == "tpu":
        c = chunk or DEFAULT_CHUNK["tpu"]
        need = _resident(-(-k.shape[1] // c) * c, max(16, pl.next_power_of_2(k.shape[3])), c,
                         len(bias_fn.values) if bias_fn is not None else 0)
        limit, rule = resident_limit()
        if need > limit:
            return f"on TPU its backward would keep {need / 2 ** 20:.0f} MiB of VMEM for {k.shape[1]} tokens ({rule})"
    return None


# ---- custom VJP -------------------------------------------------------------------------------
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _path(st, arrays):
    """(out, the rows' log-sum-exp [B, H, T, 1]), both differentiable."""
    return _forward(st, arrays)


def _path_fwd(st, arrays):
    o, lse = _forward(st, arrays)
    return (o, lse), (arrays, o, lse)


def _path_bwd(st, res, cotangents):
    arrays, o, lse = res
    do, d_lse = cotangents
    v, full = arrays["k"]["v"], backward_inputs(arrays, o, lse, do, d_lse)
    dq, dk = _backward(st, full)
    b, kh = v.shape[:2]

    def group_sum(x, like):  # per query head -> per kv head
        return x.reshape(b, kh, st.heads // kh, *x.shape[2:]).sum(2).astype(like.dtype)

    ks = arrays["k"]
    grads = {"q": {"q": dq["q"].astype(arrays["q"]["q"].dtype), "values": dq["values"], "seg": None},
             "k": {**{name: group_sum(dk[name], ks[name]) for name in ("k", "ke", "v", "w", "u")},
                   "values": dk["values"], "seg": None}}
    return (grads,)


_path.defvjp(_path_fwd, _path_bwd)


# ---- the public function ------------------------------------------------------------------------
def path_attention(q, k, v, w, beta, *, bias_fn: Bias | None = None, segment_ids=None, scale: float | None = None,
                   chunk: int | None = None, block_size: int | None = None, interpret: bool | str | None = None,
                   stream: bool | None = None, platform: str | None = None, num_warps: int | tuple | None = None,
                   num_stages: int | tuple | None = None, transport: str = "highest", groups: int = 1,
                   span: int | None = None):
    """PaTH attention, q [B, T, H, D]; k, v, w [B, T, K, D] (w unit vectors); beta [B, T, K] in
    [0, 2]; bias_fn a `positional.logits.Bias` or None; segment_ids [B, T] -> [B, T, H, D] in
    q's dtype. Differentiable in q, k, v, w, beta and the bias's values (a custom VJP).

    `span`: only the routes inside blocks of `span` tokens, each block run as a sequence of its
    own (so B * T / span rows of span tokens: that much more parallel, and on TPU the resident
    buffers of span tokens, not T), the bias still read at the tokens' own positions; returns
    (out, the rows' log-sum-exp [B, T, H] fp32), both differentiable: the inner level of
    positional/path/chunked.py's two-level form, which adds the routes between blocks.

    `chunk`: the chunk (tile) size; None takes the platform's default, or in the interpreter
    `block_size` where given (the plain-JAX paths' block, so a model's CPU tests run the kernel
    over several chunks). `interpret`: None lowers for the platform being lowered for (the
    Pallas interpreter on CPU, Triton on cuda, Mosaic on tpu: `positional.kernels.per_platform`);
    True interprets everywhere; "tpu" runs the TPU form in Pallas's TPU interpreter (slower; it
    checks the streamed blocks as Mosaic moves them). `stream`: None streams on TPU only;
    True/False forces it (the interpreter runs both). `platform` ("cpu", "cuda", "tpu"): build
    that platform's kernel alone. `num_warps`, `num_stages`: Triton's (GPU), one number for both
    kernels or (forward, backward); None the defaults of `_Static`. `transport`: the precision
    of the fp32 products on GPU (`TRANSPORT`: "highest", "tf32x3" or "tf32"); the interpreter
    and TPU always compute them at "highest". `groups`: the loop form's backward (GPU, and the
    interpreter unless `stream`) runs that many programs per head, program g taking query chunks
    g, g + groups, ... with key-side accumulators and a chain of its own (summed after): more
    parallel, `groups` times that O(T * D) memory.
    """
    check_shapes(q, k, v, segment_ids)
    check_transport(k, w, beta)
    if transport not in TRANSPORT:
        raise ValueError(f"PaTH kernel transport={transport!r} must be one of {sorted(TRANSPORT)}")
    if not (isinstance(groups, int) and groups >= 1):
        raise ValueError(f"PaTH kernel groups={groups!r} must be an integer >= 1 (programs per head in the backward)")
    why = refusal(bias_fn, k, "cpu")
    if why:
        raise ValueError(f"PaTH kernel: {why}; use impl='blockwise'")
    b, t, h, d = q.shape
    if span is not None and span < t:  # the bias read at the tokens' own positions, not the block's
        bias_fn = at_positions(bias_fn, jnp.arange(t)[None, :, None])
    values = bias_fn.per_slot(b, t, h) if bias_fn is not None else {}
    bias = bias_fn.fn if bias_fn is not None else None
    seg = jnp.zeros((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    if span is not None:
        if not (isinstance(span, int) and span >= 1):
            raise ValueError(f"PaTH kernel span={span!r} must be a positive integer (tokens per block)")
        q, k, v, w, beta, seg = (blocks_as_rows(x, span) for x in (q, k, v, w, beta, seg))
        values = {name: blocks_as_rows(x, span) for name, x in values.items()}

    def settings(backend: str, interpret: bool) -> _Static:
        c = chunk if chunk is not None else (block_size if interpret and block_size else
                                             DEFAULT_CHUNK["interpret" if interpret else backend])
        check_tile("PaTH", "chunk", c, backend, interpret)
        if stream and backend == "gpu" and not interpret:
            raise ValueError("PaTH kernel stream=True is the TPU form (VMEM scratch); Triton (GPU) takes "
                             "stream=False or None")
        why = None if interpret else refusal(bias_fn, k, backend, c)
        if why:
            raise ValueError(f"PaTH kernel: {why}; use impl='blockwise'")
        triton = {name: (x, x) if isinstance(x, int) else tuple(x)
                  for name, x in (("num_warps", num_warps), ("num_stages", num_stages)) if x is not None}
        return _Static(bias=bias, chunk=c, heads=h,
                       scale=d ** -0.5 if scale is None else float(scale),
                       stream=backend == "tpu" and not interpret if stream is None else bool(stream),
                       interpret=interpret, backend=backend,
                       transport=transport if backend == "gpu" and not interpret else "highest", groups=groups,
                       **triton)

    if interpret == "tpu":
        out = _padded(dataclasses.replace(settings("tpu", True), stream=True, interpret="tpu"), q, k, v, w, beta,
                      values, seg)
    elif interpret not in (None, True, False):
        raise ValueError(f"PaTH kernel interpret={interpret!r} must be None, True, False or 'tpu'")
    else:
        out = per_platform(settings, _padded, (q, k, v, w, beta, values, seg), interpret, platform)
    if span is None:
        return out[0]
    return tuple(x.reshape(b, -1, *x.shape[2:])[:, :t] for x in out)


def blocks_as_rows(x, span: int, blocks: int | None = None):
    """[B, T, ...] -> [B * blocks, span, ...], T padded with zeros to whole blocks, or to
    `blocks` of them (beta 0: no step; padded keys come after every real query of their block,
    so the causal mask drops them)."""
    b, t = x.shape[:2]
    n = blocks or -(-t // span)
    x = jnp.pad(x, [(0, 0), (0, n * span - t)] + [(0, 0)] * (x.ndim - 2))
    return x.reshape(b * n, span, *x.shape[2:])


def _padded(st: _Static, q, k, v, w, beta, values, seg):
    """The kernel on inputs padded to whole chunks (and the head dimension to a power of two
    >= 16), with the per-chunk UT matrices and the keys carried to their chunk's end."""
    b, t, h, d = q.shape
    kh, c = k.shape[2], st.chunk
    n = -(-t // c)
    tp, dp = n * c, max(16, pl.next_power_of_2(d))
    f32 = jnp.float32

    def layout(x):  # [B, T, heads, d] -> [B, heads, T_padded, D_padded]
        x = jnp.pad(x, ((0, 0), (0, tp - t), (0, 0), (0, dp - x.shape[-1])))
        return jnp.swapaxes(x, 1, 2)

    def chunks(x):  # [B, heads, T_padded, ...] -> [B, heads, N, c, ...]
        return x.reshape(x.shape[0], x.shape[1], n, c, *x.shape[3:])

    wc, kc = chunks(layout(w.astype(f32))), chunks(layout(k.astype(f32)))
    bc = chunks(jnp.swapaxes(jnp.pad(beta.astype(f32), ((0, 0), (0, tp - t), (0, 0))), 1, 2))  # padding: H = I
    gram = jnp.einsum("...sd,...td->...st", wc, wc, precision=lax.Precision.HIGHEST)
    u = unit_lower_inverse(jnp.eye(c) + bc[..., :, None] * jnp.tril(gram, -1)) * bc[..., None, :]  # [B,K,N,c,c]
    wk = jnp.tril(jnp.einsum("...td,...jd->...tj", wc, kc, precision=lax.Precision.HIGHEST), -1)  # w_t . k_j, t > j
    uk = jnp.matmul(u, wk, precision=lax.Precision.HIGHEST)
    k_end = kc - jnp.einsum("...sj,...sd->...jd", uk, wc, precision=lax.Precision.HIGHEST)
    flat = lambda x: x.reshape(b, kh, tp, x.shape[-1])  # noqa: E731
    seg = jnp.pad(seg, ((0, 0), (0, tp - t)))
    vals = {name: jnp.swapaxes(jnp.pad(x, ((0, 0), (0, tp - t), (0, 0))), 1, 2) for name, x in values.items()}
    arrays = {"q": {"q": layout(q), "seg": seg[:, None, :, None], "values": {n_: x[..., None] for n_, x in vals.items()}},
              "k": {"k": layout(k), "ke": flat(k_end), "v": layout(v), "w": flat(wc), "u": flat(u),
                    "seg": seg[:, None, None, :], "values": {n_: x[:, :, None] for n_, x in vals.items()}}}
    o, lse = _path(st, arrays)
    return jnp.swapaxes(o, 1, 2)[:, :t, :, :d].astype(q.dtype), jnp.swapaxes(lse[..., 0], 1, 2)[:, :t]
