"""The PaTH kernel (positional/path/kernel.py) against PaTH's reference (the materialised logits,
positional/path/reference.py), in the interpreter and in both loop structures (GPU's loop over
whole-sequence refs, TPU's streamed grid), values and the gradients of q, k, v, w, beta and the
FoX gates; lowered for cuda and tpu; what impl="auto" picks; bad input. The conformance suite
runs impl "pallas" for path and path_fox at the layer."""

import functools
import logging
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.draws import normal, uniform
from helpers.exported import MOSAIC, TRITON, compiled_for, lowered, simplified

from models.registry import make_scheme
from positional.fox import forget_bias
from positional.logits import Bias, at_positions
from positional.path import chunked, kernel, reference
from positional.path import scheme as path_scheme
from positional.path.kernel import path_attention
from positional.softmax import reference_attention

NAMES = ("q", "k", "v", "w", "beta", "log_forget")


def inputs(t, d, h=4, kh=2, dtype=jnp.float32, key=0):
    ks = jax.random.split(jax.random.key(key), 6)
    q = normal(ks[0], (2, t, h, d))
    k, v, w = (normal(x, (2, t, kh, d)) for x in ks[1:4])
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = uniform(ks[4], (2, t, kh), minval=0.0, maxval=2.0)
    log_f = uniform(ks[5], (2, t, h), minval=-1.0, maxval=0.0)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w, beta, log_f


def segments(t):
    """Two rows: three documents (lengths 3, 5, the rest), and one."""
    return jnp.asarray([[0] * 3 + [1] * 5 + [2] * t, [7] * (t + 8)])[:, :t]


def value_and_grads(impl, args, seg, gated, **kw):
    """(output, gradients of the six inputs) of a fixed loss, jitted."""
    d = args[0].shape[-1]

    def attend(q, k, v, w, beta, log_f):
        bias = forget_bias(log_f) if gated else None
        if impl == "reference":
            return reference_attention(q, k, v, bias_fn=bias, segment_ids=seg,
                                       score_fn=reference.dense_score_fn(w, beta, d ** -0.5))
        return path_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, **{"interpret": True, **kw})

    def loss(*args):
        out = attend(*args)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*args)
    return out, grads


def rel(a, b):
    a, b = (np.asarray(x, np.float32) for x in (a, b))
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))


def check(t, d, chunk, stream, *, kh=2, gated=True, packed=True, tol=1e-5, groups=1):
    args = inputs(t, d, kh=kh)
    seg = segments(t) if packed else None
    got, got_grads = value_and_grads("kernel", args, seg, gated, chunk=chunk, stream=stream, groups=groups)
    want, want_grads = value_and_grads("reference", args, seg, gated)
    assert rel(got, want) < tol
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert rel(g, w) < tol, name


SLOW = pytest.mark.slow  # interpreting costs about 10 s a case on a 2-core CPU, mostly compiling


@pytest.mark.parametrize("t,d,chunk,stream,kh,gated,packed", [
    (7, 48, 3, True, 2, True, True),  # streamed (TPU's form); 3 chunks, 2 tokens of padding, D padded to 64
    (7, 16, 2, False, 1, False, True),  # the loop (GPU's form); one kv head for 4 query heads, no gate
    pytest.param(1, 16, 4, False, 2, True, True, marks=SLOW),  # one token: the in-chunk tile alone
    pytest.param(200, 64, 64, False, 2, True, True, marks=SLOW),  # chunk 64; padded to 256
    pytest.param(200, 16, 32, True, 4, True, False, marks=SLOW),  # 7 chunks, no grouping, no segments
    pytest.param(200, 128, 64, True, 2, True, True, marks=SLOW),
    pytest.param(1000, 128, 64, False, 2, True, True, marks=SLOW),
    pytest.param(1000, 48, 128, True, 2, True, True, marks=SLOW),  # the TPU chunk
])
def test_kernel_equals_reference_values_and_gradients(t, d, chunk, stream, kh, gated, packed):
    """Values, and gradients of q, k, v, w, beta and the FoX gates (the Bias's per-slot arrays)."""
    check(t, d, chunk, stream, kh=kh, gated=gated, packed=packed, tol=2e-5 if t > 200 else 1e-5)


def test_grouped_backward_equals_reference():
    """groups=4 programs per head over 6 chunks (groups of 2, 2, 1 and 1 chunks), each with
    its own accumulators and chain: the same values and gradients."""
    check(11, 16, 2, False, kh=2, gated=True, packed=True, groups=4)


def two_level_grads(impl, args, seg, span, chunk, stream=False, across="scan", outer_group=8):
    """(output, gradients of q, k, v, w, beta and a bias's values) of PaTH with a bias that
    reads absolute key positions and the FoX gates, by the reference or by two levels with
    kernels (chunked_attention's `across`, `outer_group`)."""
    d = args[0].shape[-1]

    def attend(q, k, v, w, beta, log_f):
        gates = forget_bias(log_f)
        bias = Bias(fn=lambda q_, k_, qi, kj: gates.fn(q_, k_, qi, kj) + 0.03 * kj, values=gates.values)
        if impl == "reference":
            return reference_attention(q, k, v, bias_fn=bias, segment_ids=seg,
                                       score_fn=reference.dense_score_fn(w, beta, d ** -0.5))
        return chunked.chunked_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, chunk=chunk, span=span,
                                         kernel={"interpret": True, "stream": stream}, across=across,
                                         outer_group=outer_group)

    def loss(*args):
        out = attend(*args)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    return jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*args)


@pytest.mark.parametrize("t,d,chunk,span,stream,kh,across,runs", [
    (21, 16, 2, 8, False, 2, "scan", 8),  # 3 blocks (the last padded), documents across their boundaries
    (21, 16, 2, 8, False, 2, "blocks", 8),  # the across-blocks kernel between the blocks
    (21, 16, 2, 8, False, 2, "chunks", 8),  # ... and between the chunks inside them
    (21, 16, 2, 4, False, 2, "blocks", 2),  # 6 blocks, the queries 2 blocks a call (3 runs)
    pytest.param(21, 48, 4, 8, True, 1, "scan", 8, marks=SLOW),  # the streamed form; D padded to 64; one kv head
    (21, 48, 4, 8, True, 1, "blocks", 8),
    (21, 48, 4, 8, True, 1, "chunks", 2),  # 3 blocks: runs of 2 blocks (the last of padding and one block)
    pytest.param(200, 64, 16, 64, False, 2, "blocks", 8, marks=SLOW),  # 4 blocks, chunk 16
    pytest.param(200, 64, 16, 64, False, 2, "chunks", 8, marks=SLOW),
    (7, 128, 2, 4, False, 4, "chunks", 8),  # 2 blocks of 2 chunks, no GQA
    pytest.param(1000, 128, 32, 256, False, 2, "chunks", 3, marks=SLOW),  # 4 blocks of 8 chunks, the last short
])
def test_kernel_inside_blocks_chunked_across_equals_reference(t, d, chunk, span, stream, kh, across, runs):
    """`span` with `kernel`: the kernel runs each block of span tokens as a sequence of its own
    (its rows' log-sum-exp differentiable), the chunked form (or with across="blocks" the
    across-blocks kernel over the queries carried back to each earlier block) scores the routes
    between blocks, merged by log-sum-exp; with across="chunks" the in-chunk tiles and that
    kernel over each block's chunks replace PaTH's kernel: values and every gradient as the
    reference, the bias read at the tokens' own positions (it adds 0.03 x the key's absolute
    position); the across-blocks kernel takes the queries `runs` blocks a call (outer_group)."""
    args, seg = inputs(t, d, kh=kh), segments(t)
    (_, got), got_grads = two_level_grads("kernel", args, seg, span, chunk, stream, across, runs)
    (_, want), want_grads = two_level_grads("reference", args, seg, span, chunk)
    assert rel(got, want) < 1e-5
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert rel(g, w) < 1e-5, name


def test_kernel_span_returns_the_blocks_log_sum_exp():
    """path_attention(span=8): the same output as the kernel run on each block alone, and the
    rows' log-sum-exp of the block's scores; bad spans refused in one line."""
    q, k, v, w, beta, _ = inputs(16, 16)
    out, lse = path_attention(q, k, v, w, beta, span=8, chunk=4, interpret=True)
    for start in (0, 8):
        piece = slice(start, start + 8)
        alone = path_attention(*(x[:, piece] for x in (q, k, v, w, beta)), chunk=4, interpret=True)
        np.testing.assert_allclose(out[:, piece], alone, atol=1e-6)
    logits = jnp.where(jnp.tril(jnp.ones((8, 8), bool)), reference.path_scores(
        *reference.heads_first(q[:, 8:], k[:, 8:], w[:, 8:], beta[:, 8:])) * 16 ** -0.5, -jnp.inf)
    want = jax.nn.logsumexp(logits, -1).reshape(2, 4, 8)  # [B, K * G, T]
    np.testing.assert_allclose(jnp.moveaxis(lse[:, 8:], 1, 2), want, atol=1e-5)
    with pytest.raises(ValueError, match=r"^PaTH kernel span=0 must be a positive integer \(tokens per block\)$"):
        path_attention(q, k, v, w, beta, span=0, interpret=True)


@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=SLOW)])
def test_bf16_inputs_fp32_transport(stream):
    """bf16 q, k, v: the output is bf16, and it and the gradients match the fp32 reference at
    the same (rounded) inputs to bf16's precision (P . V and dO . V^T take bf16 operands)."""
    args = inputs(37, 64, dtype=jnp.bfloat16)
    up = [x.astype(jnp.float32) for x in args[:3]] + list(args[3:])
    seg = segments(37)
    got, got_grads = value_and_grads("kernel", args, seg, True, chunk=16, stream=stream)
    want, want_grads = value_and_grads("reference", up, seg, True)
    assert got.dtype == jnp.bfloat16 and rel(got, want) < 1e-2
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert g.dtype == (jnp.bfloat16 if name in "qkv" else jnp.float32) and rel(g, w) < 1e-2, name


@pytest.mark.slow
def test_tpu_form_in_the_tpu_interpreter():
    """The streamed form in Pallas's TPU interpreter, TPU's chunk (128), uninitialised memory
    NaN: every block and accumulator is written before it is read."""
    args = inputs(300, 64)
    seg = segments(300)
    got, got_grads = value_and_grads("kernel", args, seg, True, chunk=128, interpret="tpu")
    want, want_grads = value_and_grads("reference", args, seg, True)
    assert rel(got, want) < 1e-5
    for name, g, w in zip(NAMES, got_grads, want_grads):
        assert rel(g, w) < 1e-5, name


def t_by_t(text, t):
    """Tensor types of a module with two axes of at least t."""
    types = re.findall(r"tensor<((?:\d+x)+)[a-z]\w*>", text)
    return [dims for dims in types if sum(int(x) >= t for x in dims.split("x")[:-1]) >= 2]


@pytest.mark.parametrize("platform,call", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_lowers_for_gpu_and_tpu(platform, call, monkeypatch):
    """Forward (1 kernel) and forward + backward (2) lower through jax.export on this CPU: bf16,
    head dimension 128, GQA, FoX gates, segment ids, a length of no whole chunk. No T x T
    tensor; on GPU the key side is read from whole-sequence refs, on TPU every block streamed
    in is one chunk (128)."""
    t = 1000
    q = jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    w, beta = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.float32), jax.ShapeDtypeStruct((1, t, 2), jnp.float32)
    log_f, seg = jax.ShapeDtypeStruct((1, t, 4), jnp.float32), jax.ShapeDtypeStruct((1, t), jnp.int32)
    blocks = []
    pallas_call = kernel.pl.pallas_call

    def recording(*args, in_specs, **kw):
        blocks.extend(s.block_shape for s in in_specs)
        return pallas_call(*args, in_specs=in_specs, **kw)

    monkeypatch.setattr(kernel.pl, "pallas_call", recording)

    def f(q, k, v, w, beta, log_f, seg):
        return path_attention(q, k, v, w, beta, bias_fn=forget_bias(log_f), segment_ids=seg, platform=platform)

    grad = jax.grad(lambda *a: f(*a).astype(jnp.float32).sum(), range(6))
    forward, backward = (lowered(fn, q, k, k, w, beta, log_f, seg, platforms=[platform]) for fn in (f, grad))
    assert forward.count(call) == 1 and backward.count(call) == 2
    assert t_by_t(simplified(backward), t) == []
    longest = max(max(s for s in shape if s is not None) for shape in blocks)
    gpu_chunk = kernel.DEFAULT_CHUNK["gpu"]
    assert longest == (-(-t // gpu_chunk) * gpu_chunk if platform == "cuda" else 128)


@pytest.mark.parametrize("platform,call,kernels", [("cuda", TRITON, 0), ("tpu", MOSAIC, 2)])
@pytest.mark.parametrize("name", ["path", "path_fox"])
def test_auto_on_gpu_and_tpu_has_no_t_by_t_tensor(name, platform, call, kernels):
    """impl="auto" at the scheme, exported for an accelerator: on TPU the kernel, forward and
    backward; on GPU the chunked form (the kernel is slower there); no T x T tensor either way
    (on this CPU auto stays the reference: tests/positional/test_auto.py)."""
    scheme = make_scheme(name, num_heads=4, head_dim=64)
    x = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(2048), (1, 2048))

    def loss(q, k, v):
        return scheme.attend(q, k, v, positions=pos, impl="auto", key=jax.random.key(0)).astype(jnp.float32).sum()

    text = simplified(lowered(jax.grad(loss, (0, 1, 2)), x, x, x, platforms=[platform]))
    assert text.count(call) == kernels and t_by_t(text, 2048) == []


@pytest.mark.parametrize("t,want", [
    (256, {"cpu": "reference", "cuda": "blockwise", "tpu": "pallas"}),
    (16384, {"cpu": "blockwise", "cuda": "blockwise", "tpu": "blockwise"}),  # TPU: VMEM
])
def test_auto_choices(t, want, caplog):
    """What PaTH's auto picks per platform (the dispatcher's log records; traced, not run): on
    CPU what it picked before the kernel, by length; on GPU the chunked form, saying why; the
    kernel on TPU, except where its backward's resident VMEM would pass RESIDENT_MAX."""
    scheme = make_scheme("path_fox", num_heads=4, head_dim=64)
    x = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="positional.attention"):
        jax.eval_shape(lambda q: scheme.attend(q, q, q, positions=None, impl="auto", key=jax.random.key(0)), x)
    records = [r for r in caplog.records if getattr(r, "label", None) == "Path"]
    assert {r.platform: r.impl for r in records} == want
    if t > 8192:
        assert "MiB of VMEM for 16384 tokens" in next(r.why for r in records if r.platform == "tpu")
    assert next(r.why for r in records if r.platform == "cuda") == (
        "not PaTH's kernel: its forward + backward took 5.5x (head dim 64) and 7.8x (128) the time of the chunked "
        "form at 8,192 tokens (NVIDIA H100, 2026-11-24)")


@pytest.mark.parametrize("chip,t,kernel", [("TPU_V4", 8192, False), ("TPU_V4", 1024, True),
                                            ("TPU_V5P", 8192, True), ("TPU_V5E", 8192, True)])
def test_auto_on_tpu_keeps_the_kernel_within_the_chips_vmem(chip, t, kernel, caplog):
    """On TPU auto takes the kernel only where its backward's resident VMEM fits the chip being
    lowered for, less the tiles' headroom: a v4 (16 MiB) compiled it at 8K only to fail (39.6 MiB
    used, the compile table), so there auto runs blockwise and says why in one line."""
    from lab.lowering import target
    scheme = make_scheme("path_fox", num_heads=4, head_dim=64)
    x = jax.ShapeDtypeStruct((1, t, 4, 64), jnp.bfloat16)
    with target("tpu", chip=chip), caplog.at_level(logging.DEBUG, logger="positional.attention"):
        jax.eval_shape(lambda q: scheme.attend(q, q, q, positions=None, impl="auto", key=jax.random.key(0)), x)
    tpu = next(r for r in caplog.records if getattr(r, "label", None) == "Path" and r.platform == "tpu")
    assert tpu.impl == ("pallas" if kernel else "blockwise")
    if not kernel:
        assert "on a TPU with 16 MiB of VMEM" in tpu.why and "\n" not in tpu.why


@pytest.mark.parametrize("across,calls", [("scan", 2), ("blocks", 5), ("chunks", 6)])
@pytest.mark.parametrize("platform,call", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_kernel_inside_blocks_lowers_for_gpu_and_tpu(platform, call, across, calls):
    """Path(span=512) with impl pallas at 2,048 tokens, forward + backward exported for an
    accelerator: the kernel's two calls (on blocks of 512 tokens), with across="blocks" the
    across-blocks kernel's three, with "chunks" its three twice (across the blocks and across
    each block's chunks, no PaTH kernel: on TPU with 128-token chunks, 64 refused in one line);
    the rest plain JAX, no T x T tensor."""
    scheme = make_scheme("path_fox", num_heads=4, head_dim=64, span=512, across=across)
    x = jax.ShapeDtypeStruct((1, 2048, 4, 64), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(2048), (1, 2048))

    def loss(q, k, v, block_size=128 if platform == "tpu" and across == "chunks" else 64):
        out = scheme.attend(q, k, v, positions=pos, impl="pallas", block_size=block_size, key=jax.random.key(0))
        return out.astype(jnp.float32).sum()

    if platform == "tpu" and across == "chunks":
        with pytest.raises(ValueError, match=r"^PaTH across-blocks kernel block_q=64 is not usable: it must be a "
                                             r"multiple of 128 on TPU \(Mosaic\); the tiles divide span=64"):
            lowered(jax.grad(functools.partial(loss, block_size=64), (0, 1, 2)), x, x, x, platforms=[platform])

    text = simplified(lowered(jax.grad(loss, (0, 1, 2)), x, x, x, platforms=[platform]))
    assert text.count(call) == calls and t_by_t(text, 2048) == []


@pytest.mark.parametrize("across", ["blocks", "chunks"])
def test_across_kernel_holds_one_run_of_query_versions(across):
    """Forward + backward lowered for TPU at 4,096 tokens in 16 blocks of 256: with
    outer_group=16 (every query block in one call) the step holds the versions of all the
    queries, 16 x 4,096 x 64 numbers per head; with outer_group=2 no tensor of the step holds
    more than those of a run of 2 blocks (1/8), so the versions grow linearly in T."""
    t, span, heads, d = 4096, 256, 4, 64
    x = jax.ShapeDtypeStruct((1, t, heads, d), jnp.bfloat16)
    pos = jnp.broadcast_to(jnp.arange(t), (1, t))
    every = heads * (t // span) * t * d

    def largest(outer_group):
        scheme = make_scheme("path_fox", num_heads=heads, head_dim=d, span=span, across=across,
                             outer_group=outer_group)
        grad = jax.grad(lambda q, k, v: scheme.attend(q, k, v, positions=pos, impl="pallas", block_size=128,
                                                      key=jax.random.key(0)).astype(jnp.float32).sum(), (0, 1, 2))
        types = re.findall(r"tensor<((?:\d+x)+)[a-z]\w*>", simplified(lowered(grad, x, x, x, platforms=["tpu"])))
        return max(math.prod(int(n) for n in dims.split("x")[:-1]) for dims in types)

    whole, runs = largest(16), largest(2)
    assert whole >= every and runs <= every // 8, (whole, runs)


@pytest.mark.parametrize("chip", ["TPU_V4", "TPU_V5E"])
def test_auto_on_tpu_with_span_keeps_the_kernel_at_32k(chip, caplog):
    """Without span the kernel's backward keeps whole-sequence buffers in VMEM and auto leaves
    it past about 14K tokens (1.8K on a v4); with span=1024 it keeps a block's, so auto takes
    the kernel at 32K on a v4 and a v5e."""
    from lab.lowering import target
    scheme = make_scheme("path_fox", num_heads=4, head_dim=64, span=1024)
    x = jax.ShapeDtypeStruct((1, 32768, 4, 64), jnp.bfloat16)
    with target("tpu", chip=chip), caplog.at_level(logging.DEBUG, logger="positional.attention"):
        jax.eval_shape(lambda q: scheme.attend(q, q, q, positions=None, impl="auto", block_size=64,
                                               key=jax.random.key(0)), x)
    tpu = next(r for r in caplog.records if getattr(r, "label", None) == "Path" and r.platform == "tpu")
    assert tpu.impl == "pallas", tpu.why


def test_at_positions_reads_a_cut_part_at_its_own_positions():
    """A Bias placed at positions 12..19 (a block, a ring's shard) scores as the whole sequence's
    rows and columns 12..19, for a bias that a shift of both positions changes; placing twice
    keeps the first placement."""
    bias = Bias(lambda q, k, qi, kj: q["slope"] * (qi - kj) / (1.0 + qi), {"slope": jnp.array([[[0.5, -0.25]]])})
    whole = bias(jnp.arange(20), jnp.arange(20))  # [1, H, 20, 20]
    part = at_positions(bias, (12 + jnp.arange(8))[None, :, None])
    np.testing.assert_allclose(part(jnp.arange(8), jnp.arange(8)), whole[:, :, 12:, 12:], rtol=1e-6)
    assert float(jnp.abs(bias(jnp.arange(8), jnp.arange(8)) - whole[:, :, 12:, 12:]).max()) > 0.1
    assert at_positions(part, jnp.zeros((1, 8, 1))) is part and at_positions(None, jnp.zeros((1, 8, 1))) is None


def test_auto_on_a_sequence_mesh_is_the_ring(monkeypatch, caplog):
    """On a sequence mesh auto is PaTH's ring on every platform, its own shard by the kernel on
    TPU only (chunked on CPU, and on GPU where the kernel is slower), and it says so for each
    platform (benchmarks/lowering.py reads these records)."""
    calls = []
    mesh = jax.sharding.AbstractMesh((4,), ("sequence",))
    monkeypatch.setattr(path_scheme, "ring_active", lambda: True)
    monkeypatch.setattr(path_scheme, "active_mesh", lambda: mesh)
    monkeypatch.setattr(path_scheme, "ring_path_attention",
                        lambda q, *args, mesh, kernel, **kw: calls.append((mesh, kernel)) or q)
    scheme = make_scheme("path_fox", num_heads=4, head_dim=64)
    x = jax.ShapeDtypeStruct((1, 1024, 4, 64), jnp.bfloat16)
    with caplog.at_level(logging.DEBUG, logger="positional.attention"):
        jax.eval_shape(lambda q: scheme.attend(q, q, q, positions=None, impl="auto", key=jax.random.key(0)), x)
    records = [r for r in caplog.records if getattr(r, "label", None) == "Path" and r.levelno == logging.DEBUG]
    assert {r.platform: r.impl for r in records} == {"cpu": "ring", "cuda": "ring", "tpu": "ring"}
    assert len(records) == 3 and all("own shard" in r.why for r in records)
    assert [m for m, _ in calls] == [mesh] * 3
    assert [kernel and kernel["platform"] for _, kernel in calls] == [None, None, "tpu"]  # cpu, cuda, tpu


@pytest.mark.parametrize("topology", ["v5e:1x1", pytest.param("v6e:1x1", marks=pytest.mark.slow)])  # v6e: 39 s
def test_compiles_for_tpu(topology):
    """Forward + backward with FoX gates and segment ids compiled by the TPU compiler (libtpu)
    for one chip, 1,000 tokens, bf16, head dim 128, GQA. (On a v4, 16 MiB of VMEM, it fails
    from 8K tokens: benchmarks/RESULTS.md, the compile table.)"""
    t = 1000
    q = jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    w, beta = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.float32), jax.ShapeDtypeStruct((1, t, 2), jnp.float32)
    log_f, seg = jax.ShapeDtypeStruct((1, t, 4), jnp.float32), jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(q, k, v, w, beta, log_f, seg):
        out = path_attention(q, k, v, w, beta, bias_fn=forget_bias(log_f), segment_ids=seg, platform="tpu")
        return out.astype(jnp.float32).sum()

    compiled = compiled_for(jax.grad(loss, range(6)), q, k, k, w, beta, log_f, seg, topology=topology)
    assert compiled.as_text().count("tpu_custom_call") >= 2


def test_a_chunk_one_platform_refuses_fails_only_its_lowering():
    """chunk=64 suits Triton, not Mosaic (multiples of 128): cuda lowers, and only lowering for
    tpu fails, naming the field; a chunk no platform takes fails at once."""
    q, k, v, w, beta, _ = inputs(64, 16)
    f = functools.partial(path_attention, chunk=64)
    grad = jax.grad(lambda *a: f(*a).sum(), range(5))
    for fn in (f, grad):
        assert TRITON in lowered(fn, q, k, v, w, beta)
        with pytest.raises(ValueError, match="PaTH kernel chunk=64 is not usable: it must be a multiple of 128"):
            lowered(fn, q, k, v, w, beta, platforms=["tpu"])
    with pytest.raises(ValueError, match="chunk=48 .* power of two.*chunk=48 .* multiple of 128"):
        path_attention(q, k, v, w, beta, chunk=48, interpret=False)
    with pytest.raises(ValueError, match="stream=True is the TPU form"):
        lowered(functools.partial(path_attention, stream=True), q, k, v, w, beta)
    long = [jax.ShapeDtypeStruct((1, 16384, *x.shape[2:]), x.dtype) for x in (q, k, v, w, beta)]
    assert TRITON in lowered(path_attention, *long)
    # 16384 rows of 128 fp32 lanes are 8 MiB: the chain, and twice the accumulators of k_end, v, w and U
    with pytest.raises(ValueError, match="on TPU its backward would keep 72 MiB of VMEM for 16384 tokens"):
        lowered(path_attention, *long, platforms=["tpu"])


@pytest.mark.slow  # 16 s
def test_gpu_settings_reach_triton_alone():
    """transport, num_warps, num_stages and groups change what is lowered for cuda (the Triton
    kernel's dots, launch and backward grid), not the TPU kernel."""
    q, k, v, w, beta, _ = inputs(64, 16)
    grad = lambda **kw: jax.grad(lambda *a: path_attention(*a, **kw).sum(), range(5))  # noqa: E731
    for platform in ("cuda", "tpu"):
        text = {kw: lowered(grad(**dict([kw])), q, k, v, w, beta, platforms=[platform])
                for kw in (("transport", "highest"), ("transport", "tf32x3"), ("num_warps", 8), ("num_stages", 3),
                           ("groups", 4))}
        assert len(set(text.values())) == (5 if platform == "cuda" else 1), platform


def test_bad_input_is_one_line_naming_the_field():
    q, k, v, w, beta, log_f = inputs(6, 16)
    cases = [
        (dict(w=w[..., :8]), r"Householder vectors w\(2, 6, 2, 8\) must have the keys' shape"),
        (dict(beta=beta[..., 0]), r"Householder gains beta\(2, 6\) must be \[B, T, K\]"),
        (dict(beta=beta + 2.5), r"Householder gains must lie in \[0, 2\]"),
        (dict(q=q[:, :, :3]), "num query heads 3 is not a multiple of num kv heads 2"),
        (dict(bias_fn=lambda qi, kj: 0.0), "bias_fn must be a positional.logits.Bias.*use impl='blockwise'"),
        (dict(bias_fn=Bias(lambda a, b, qi, kj: a["F"] - b["F"], {"F": log_f[:, :4]})), "bias value 'F' has shape"),
        (dict(segment_ids=jnp.zeros((2, 5), jnp.int32)), "segment_ids"),
        (dict(chunk=0, interpret=True), "PaTH kernel chunk=0 is not usable: it must be a positive integer"),
        (dict(interpret="gpu"), "interpret='gpu' must be None, True, False or 'tpu'"),
        (dict(transport="bf16"), r"transport='bf16' must be one of \['highest', 'tf32', 'tf32x3'\]"),
        (dict(groups=0), r"groups=0 must be an integer >= 1"),
    ]
    for change, message in cases:
        kw = dict(q=q, k=k, v=v, w=w, beta=beta) | change
        with pytest.raises(ValueError, match=message) as raised:
            path_attention(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("w"), kw.pop("beta"), **kw)
        assert "\n" not in str(raised.value)
