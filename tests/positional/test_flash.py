"""The fused kernel (positional/kernels/flash.py) against the reference, in the interpreter, in
both loop structures (GPU's loop over whole-sequence refs, TPU's streamed grid), and lowered
for cuda and tpu. The conformance suite runs it for every registered scheme at the layer."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from helpers.exported import MOSAIC, TRITON, compiled_for, lowered
from lab.lowering import max_registers, triton_kernels
from models.registry import REGISTRY, Entry, make_scheme
from positional import kernels
from positional.kernels import flash
from positional.kernels.flash import fused_attention
from positional.logits import Bias, lookup, sum_of
from positional.scheme import Scheme, position_values
from positional.softmax import reference_attention
from positional.tapa import tapa_score_fn


def gates(key, b, t, h):
    return -jax.nn.softplus(normal(key, (b, t, h)))


def hooks(name, t, h, d, gate):
    """(bias_fn, score_fn) of a few schemes' kinds: FoX's per-token gates plus ALiBi (a sum of
    two Biases with per-head and per-slot values), TAPA's score with a bias, plain softmax."""
    pos = jnp.broadcast_to(jnp.arange(t), (2, t))
    alibi = make_scheme("alibi", num_heads=h, head_dim=d).bias_fn(None, pos)
    fox = make_scheme("fox", num_heads=h, head_dim=d).bias_fn({"log_forget": gate}, pos)
    bias = {"fox+alibi": sum_of([fox, alibi]), "tapa+alibi": alibi, "plain": None}[name]
    return bias, (tapa_score_fn(d) if name.startswith("tapa") else None)


def loss(fn):
    def f(*args):
        out = fn(*args).astype(jnp.float32)
        return jnp.sum(out * jnp.cos(jnp.arange(out.shape[-1], dtype=jnp.float32)))
    return f


def rel(a, b):
    a, b = (np.asarray(x, np.float32) for x in (a, b))
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))  # 0 where both are 0


@pytest.mark.parametrize("name,dtype,stream", [("fox+alibi", jnp.float32, False), ("fox+alibi", jnp.float32, True),
                                               ("tapa+alibi", jnp.float32, True), ("plain", jnp.bfloat16, False)])
def test_kernel_matches_reference_values_and_gradients(name, dtype, stream):
    """T = 37 (a multiple of neither tile), 4 query heads on 2 kv heads, three segments: the
    output and the gradients of q, k, v and of the bias's per-token values (FoX's gates)."""
    b, t, h, kh, d = 2, 37, 4, 2, 16
    ks = jax.random.split(jax.random.key(t), 4)
    q, k, v = normal(ks[0], (b, t, h, d), dtype), normal(ks[1], (b, t, kh, d), dtype), normal(ks[2], (b, t, kh, d), dtype)
    gate = gates(ks[3], b, t, h)
    seg = jnp.asarray(np.repeat([[0] * 11 + [1] * 20 + [2] * 6], b, 0), jnp.int32)

    def attend(impl):
        def f(q, k, v, gate):
            bias, score = hooks(name, t, h, d, gate)
            kw = dict(block_q=8, block_k=16, interpret=True, stream=stream) if impl is fused_attention else {}
            return impl(q, k, v, bias_fn=bias, score_fn=score, segment_ids=seg, **kw)
        return f

    up = [x.astype(jnp.float32) for x in (q, k, v)] + [gate]
    tol = 1e-5 if dtype == jnp.float32 else 1e-2  # bf16: P and dS are cast to bf16 for the matmuls
    got = jax.jit(attend(fused_attention))(q, k, v, gate)
    assert got.dtype == dtype and rel(got, attend(reference_attention)(*up)) < tol
    grads = jax.jit(jax.grad(loss(attend(fused_attention)), (0, 1, 2, 3)))(q, k, v, gate)
    want = jax.grad(loss(attend(reference_attention)), (0, 1, 2, 3))(*up)
    for g, w in zip(grads, want):
        assert rel(g, w) < tol


def distance_table(table, slope=None):
    """A Bias reading a per-head table [1, H, n] at the distance, clipped to n - 1 (a learned
    distance table, T5's without its buckets), plus a per-head slope on the key's position."""
    n = table.shape[-1]

    def fn(q, k, qi, kj):
        out = lookup(q["table"], jnp.clip(q.get("position", qi) - k.get("position", kj), 0, n - 1).astype(jnp.int32))
        return out if slope is None else out + q["slope"] * kj

    return Bias(fn, {} if slope is None else {"slope": slope}, tables={"table": table})


@pytest.mark.parametrize("stream", [False, True])
def test_a_per_head_table_is_looked_up_in_the_tiles(stream):
    """A table read at each pair's distance (more entries than a tile spans) plus a per-head
    value: the output and the gradients of q, k, v, the table and the value, T = 37, GQA, three
    segments. `lookup` itself equals numpy's indexing."""
    b, t, h, kh, d, n = 2, 37, 4, 2, 16, 20
    ks = jax.random.split(jax.random.key(3), 5)
    q, k, v = normal(ks[0], (b, t, h, d)), normal(ks[1], (b, t, kh, d)), normal(ks[2], (b, t, kh, d))
    table, slope = normal(ks[3], (1, h, n)), 0.1 * normal(ks[4], (1, 1, h))
    seg = jnp.asarray(np.repeat([[0] * 11 + [1] * 20 + [2] * 6], b, 0), jnp.int32)
    index = np.arange(t)[:, None] - np.arange(t)[None, :]
    np.testing.assert_array_equal(lookup(table[:, :, None], jnp.asarray(index)),
                                  np.where((index >= 0) & (index < n), np.asarray(table)[:, :, np.clip(index, 0, n - 1)], 0))

    def attend(impl):
        def f(q, k, v, table, slope):
            kw = dict(block_q=8, block_k=16, interpret=True, stream=stream) if impl is fused_attention else {}
            return impl(q, k, v, bias_fn=distance_table(table, slope), segment_ids=seg, **kw)
        return f

    args = (q, k, v, table, slope)
    assert rel(jax.jit(attend(fused_attention))(*args), attend(reference_attention)(*args)) < 1e-5
    grads = jax.jit(jax.grad(loss(attend(fused_attention)), range(5)))(*args)
    want = jax.grad(loss(attend(reference_attention)), range(5))(*args)
    for g, w in zip(grads, want):
        assert rel(g, w) < 1e-5


@pytest.mark.parametrize("stream", [False, True])
def test_a_query_offset_prefill(stream):
    """Queries at q_offset 16 of 21 keys (a prefill after 16 cached tokens), with a bias."""
    q = normal(jax.random.key(0), (1, 5, 2, 16))
    k, v = normal(jax.random.key(1), (2, 1, 21, 2, 16))
    bias = make_scheme("alibi", num_heads=2, head_dim=16).bias_fn(None, jnp.arange(21)[None] + 7)
    got = fused_attention(q, k, v, bias_fn=bias, q_offset=16, block_q=8, block_k=8, interpret=True, stream=stream)
    np.testing.assert_allclose(got, reference_attention(q, k, v, bias_fn=bias, q_offset=16), atol=1e-5)


@pytest.mark.parametrize("window,q_offset,block_q,block_k", [(None, 0, 16, 16), (40, 0, 16, 16), (1, 0, 8, 16),
                                                              (100, 24, 16, 8), (7, 40, 8, 8)])
def test_the_tiles_visited_are_those_with_a_visible_key(window, q_offset, block_q, block_k):
    """Both loop orders visit exactly the tiles holding a (query, key) pair the mask keeps
    (causal and, with a window, i - j < W): O(T W) tiles with a window, not O(T^2)."""
    t, s = 128 - q_offset, 128
    st = flash._Static(logit=None, q_offset=q_offset, kv_len=s, group=1, block_q=block_q, block_k=block_k,
                       stream=True, interpret=True, backend="cpu", num_warps=4, num_stages=2, fast_math=False,
                       window=window)
    qi, kj = q_offset + np.arange(t)[:, None], np.arange(s)[None, :]
    keep = (kj <= qi) & ((qi - kj < window) if window else True)
    nq, nk = t // block_q, s // block_k
    want = {(i, j) for i in range(nq) for j in range(nk)
            if keep[i * block_q:(i + 1) * block_q, j * block_k:(j + 1) * block_k].any()}
    by_query = {(i, j) for i in range(nq) for j in range(*map(int, flash._bounds(st, "q", i, nk)))}
    by_key = {(i, j) for j in range(nk) for i in range(*map(int, flash._bounds(st, "k", j, nq)))}
    assert by_query == want and by_key == want


@dataclasses.dataclass(frozen=True)
class SqrtDistance(Scheme):
    """A bias scheme written for this test only: -sqrt(p_i - p_j) / 2, no kernel code of its own."""
    has_bias = bias_only = True

    def bias_fn(self, features, positions):
        def bias(q, k, qi, kj):
            return -0.5 * jnp.sqrt(jnp.maximum(q.get("position", qi) - k.get("position", kj), 0.0))
        return Bias(bias, position_values(positions))


def test_a_new_bias_scheme_runs_fused_with_no_kernel_code(monkeypatch):
    monkeypatch.setitem(REGISTRY, "sqrt_distance", Entry(SqrtDistance))
    scheme = make_scheme("rope+sqrt_distance", num_heads=2, head_dim=16)
    assert "pallas" in scheme.impls
    q, k, v = (normal(jax.random.key(i), (1, 21, 2, 16)) for i in range(3))
    pos = jnp.arange(21)[None] * 3

    def run(impl):
        return lambda q, k, v: scheme.attend(q, k, v, positions=pos, impl=impl, block_size=8)

    np.testing.assert_allclose(jax.jit(run("pallas"))(q, k, v), run("reference")(q, k, v), atol=2e-5)
    got, want = (jax.jit(jax.grad(loss(run(impl)), (0, 1, 2)))(q, k, v) for impl in ("pallas", "reference"))
    for g, w in zip(got, want):
        assert rel(g, w) < 1e-5


def test_hooks_it_cannot_fuse_say_so():
    x = jnp.ones((1, 4, 2, 16))
    with pytest.raises(ValueError, match="bias_fn must be a positional.logits.Bias.*use impl='blockwise'"):
        fused_attention(x, x, x, bias_fn=lambda qi, kj: 0.0 * qi[:, None])
    with pytest.raises(ValueError, match="q_offset must be a Python int"):
        jax.jit(lambda o: fused_attention(x, x, x, q_offset=o))(0)


LOWERED = {"plain": lambda t: (None, None),
           "kerple": lambda t: (make_scheme("kerple_log", num_heads=4, head_dim=128).bias_fn(
               {"kerple_r1": jnp.ones(4), "kerple_r2": jnp.ones(4)}, jnp.arange(t)[None]), None),
           "tapa+alibi": lambda t: (make_scheme("alibi", num_heads=4, head_dim=128).bias_fn(None, None),
                                    tapa_score_fn(128)),
           "table": lambda t: (distance_table(jnp.ones((1, 4, 32))), None),
           "window+sinks": lambda t: (None, None)}
# Options of a variant beside its hooks: a sliding window (tiles outside it skipped, on TPU their
# index maps clamped) and sink logits (merged when a row is done).
OPTIONS = {"window+sinks": dict(window=300, sink=jnp.linspace(-1.0, 1.0, 4))}


def test_triton_kernels_are_read_back_from_the_exported_module():
    """`lab.lowering.triton_kernels` (benchmarks/triton_compile.py compiles what it returns):
    the forward + backward's three Triton kernels, in the module's order, each with the
    kernel's num_warps / num_stages and its Triton IR as text, one function of the tt dialect."""
    q = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
    grad = jax.grad(lambda q, k, v: fused_attention(q, k, v, num_warps=8, num_stages=3).astype(jnp.float32).sum(),
                    (0, 1, 2))
    text = lowered(grad, q, q, q)
    found = triton_kernels(text)
    assert len(found) == text.count(TRITON) == 3
    assert {(x["num_warps"], x["num_stages"]) for x in found} == {(8, 3)}
    for x in found:
        assert x["ttir"].count("tt.func public @") == 1 and "tt.dot" in x["ttir"], x["ttir"][:300]

    with max_registers(168):  # a fresh function: jit's cache would keep the kernels lowered above
        limited = triton_kernels(lowered(lambda *x: grad(*x), q, q, q))
    assert ["ttg.maxnreg = 168 : i32" in x["ttir"] for x in limited] == [True] * 3
    assert not any("maxnreg" in x["ttir"] for x in found)


@pytest.mark.parametrize("platform,call", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_kernels_lower_for_gpu_and_tpu(platform, call, monkeypatch):
    """Forward (1 kernel) and backward (3) lower for each platform through jax.export on this
    CPU, bf16, d = 128, GQA; on TPU no kernel holds a whole-sequence block (K/V stream)."""
    t = 1024
    q = jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    blocks = []
    pallas_call = kernels.flash.pl.pallas_call

    def recording(*args, in_specs, **kw):  # the blocks of the platform's own kernels
        if not kw["interpret"] and (platform == "cuda") != ("scratch_shapes" in kw):
            blocks.extend(s.block_shape for s in in_specs)
        return pallas_call(*args, in_specs=in_specs, **kw)

    monkeypatch.setattr(kernels.flash.pl, "pallas_call", recording)
    for name, make in LOWERED.items():
        def f(q, k, v):
            bias, score = make(t)
            return fused_attention(q, k, v, bias_fn=bias, score_fn=score, **OPTIONS.get(name, {}))
        grad = jax.grad(lambda q, k, v: f(q, k, v).astype(jnp.float32).sum(), (0, 1, 2))
        assert lowered(f, q, k, k, platforms=[platform]).count(call) == 1, name
        assert lowered(grad, q, k, k, platforms=[platform]).count(call) == 3, name
    longest = max(max(s for s in shape if s is not None) for shape in blocks)
    assert longest == (t if platform == "cuda" else 128)


@pytest.mark.parametrize("topology", ["v4:1x1x1", pytest.param("v6e:1x1", marks=pytest.mark.slow)])  # v6e: 16 s
def test_kernels_compile_for_tpu(topology):
    """Forward + backward of each fused variant compiled by the TPU compiler (libtpu) for one
    chip of each generation named, at 2,048 tokens, bf16, d = 128, GQA: within its VMEM, Mosaic's
    checks passed."""
    t = 2048
    q = jax.ShapeDtypeStruct((1, t, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    for name, make in LOWERED.items():
        def loss(q, k, v):
            bias, score = make(t)
            return fused_attention(q, k, v, bias_fn=bias, score_fn=score,
                                   **OPTIONS.get(name, {})).astype(jnp.float32).sum()
        compiled = compiled_for(jax.grad(loss, (0, 1, 2)), q, k, k, topology=topology)
        assert compiled.as_text().count("tpu_custom_call") >= 3, name


def test_a_tile_one_platform_refuses_fails_only_its_lowering():
    """block_k=64 suits Triton, not Mosaic (multiples of 128): cuda and CPU lower and run, and
    only lowering for tpu fails, naming the field; interpret=True interprets on every platform."""
    f = functools.partial(fused_attention, block_q=128, block_k=64)
    x = normal(jax.random.key(0), (1, 64, 2, 16))
    grad = jax.grad(lambda q, k, v: f(q, k, v).sum(), (0, 1, 2))
    for fn in (f, grad):
        assert TRITON in lowered(fn, x, x, x)
        with pytest.raises(ValueError, match="block_k=64 is not usable: it must be a multiple of 128"):
            lowered(fn, x, x, x, platforms=["tpu"])
    want = f(x, x, x, interpret=True)
    np.testing.assert_allclose(jax.jit(f)(x, x, x), want, atol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.vmap(f))(x[None], x[None], x[None])[0], want, atol=1e-6)
    assert TRITON not in lowered(functools.partial(f, interpret=True), x, x, x)
    with pytest.raises(ValueError, match="block_q=48 .* power of two.*block_q=48 .* multiple of 128"):
        f(x, x, x, block_q=48, interpret=False)  # no platform can take it: an error at once
