"""PaTH Householder transport and FoX gates: every algorithm against explicit matrix products,
the route convention, the paper's identities, decoding, head dimensions and bad input."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.draws import normal, uniform

from positional.alibi import alibi_slopes
from positional.attention import attention, reference_attention
from positional.fox import forget_bias
from positional.path import chunked, reference, transport

# Jitted: called eagerly, every op compiles on its own, which took most of this file's time.
# (test_bad_input_names_the_problem calls the library eagerly: its checks need concrete values.)
chunked_attention = jax.jit(chunked.chunked_attention, static_argnames=("bias_fn", "chunk", "group", "scale"))
route_products = jax.jit(reference.route_products)
dense_reference = jax.jit(lambda q, k, v, w, beta: reference_attention(  # 8-dim heads
    q, k, v, score_fn=reference.dense_score_fn(w, beta, 8 ** -0.5)))


def inputs(key=0, b=2, t=11, h=4, kh=2, d=8, beta_range=(0.0, 2.0), dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(key), 5)
    q = normal(ks[0], (b, t, h, d))
    k, v, w = (normal(kk, (b, t, kh, d)) for kk in ks[1:4])
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = uniform(ks[4], (b, t, kh), minval=beta_range[0], maxval=beta_range[1])
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), w, beta


def product_scores(q, k, w, beta):
    """Logits q_i^T H_i ... H_{j+1} k_j / sqrt(D) from explicit D x D products (NumPy float64)."""
    q, k, w, beta = (np.asarray(x, np.float64) for x in (q, k, w, beta))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    out = np.full((b, h, t, t), -np.inf)
    for bi in range(b):
        for hi in range(h):
            kv = hi // g
            for i in range(t):
                p = np.eye(d)
                for j in range(i, -1, -1):  # p = H_i ... H_{j+1}
                    out[bi, hi, i, j] = q[bi, i, hi] @ p @ k[bi, j, kv] / np.sqrt(d)
                    p = p @ (np.eye(d) - beta[bi, j, kv] * np.outer(w[bi, j, kv], w[bi, j, kv]))
    return out


def product_attention(q, k, v, w, beta, bias=0.0):
    s = product_scores(q, k, w, beta) + bias  # bias [B, H, T, T] added to the scaled logits
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    g = q.shape[2] // k.shape[2]
    return np.einsum("bhij,bjhd->bihd", p, np.repeat(np.asarray(v, np.float64), g, axis=2))


@pytest.mark.parametrize("chunk", [None, 1, 4, 5, 11, 64])
def test_dense_ut_and_route_products_match_explicit_products(chunk):
    q, k, v, w, beta = inputs()
    qh, kh_, wh, bh = reference.heads_first(q, k, w, beta)
    scores = jax.jit(reference.path_scores, static_argnums=4)(qh, kh_, wh, bh, chunk)  # one solve per chunk
    s = np.asarray(scores).reshape(2, 4, 11, 11) / np.sqrt(8)
    expected = product_scores(q, k, w, beta)
    tril = np.tril(np.ones((11, 11), bool))
    np.testing.assert_allclose(s[..., tril], expected[..., tril], atol=2e-5)
    p = route_products(w[0, :, 1], beta[0, :, 1])  # [T, T, D, D]
    np.testing.assert_allclose(np.einsum("d,ijde,je->ij", q[0, 7, 2], p, k[0, :, 1])[7, :8] / np.sqrt(8),
                               expected[0, 2, 7, :8], atol=2e-5)


@pytest.mark.parametrize("form", [{}, {"span": 8}, {"kernel": {"interpret": True}},
                                  {"span": 8, "kernel": {"interpret": True}}],
                         ids=["one_level", "two_levels", "kernel", "kernel_in_blocks"])
def test_with_lse_gives_the_rows_log_sum_exp(form):
    """chunked_attention(with_lse=True) (a ring's own shard): the output as without it, and the
    rows' log-sum-exp of the explicit products' logits, in each form."""
    q, k, v, w, beta = inputs(t=20)
    s = product_scores(q, k, w, beta)  # [B, H, T, T], -inf above the diagonal
    want = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    out, lse = jax.jit(lambda *x: chunked.chunked_attention(*x, chunk=4, with_lse=True, **form))(q, k, v, w, beta)
    np.testing.assert_allclose(np.moveaxis(np.asarray(lse), 1, 2), want, atol=2e-5)
    np.testing.assert_allclose(out, product_attention(q, k, v, w, beta), atol=2e-5)


def test_route_convention_query_step_counts_key_step_does_not():
    """Which H_t lie on the route from key j to query i: t in (j, i]."""
    q, k, v, w, beta = inputs(t=6)
    qh, kh_, wh, _ = reference.heads_first(q, k, w, beta)
    scores = jax.jit(reference.path_scores)
    plain = np.asarray(scores(qh, kh_, wh, jnp.zeros((2, 2, 6))))
    for t in range(6):
        only = jnp.zeros((2, 2, 6)).at[..., t].set(1.5)
        s = np.asarray(scores(qh, kh_, wh, only))
        i, j = np.meshgrid(np.arange(6), np.arange(6), indexing="ij")
        on_route = (j < t) & (t <= i)
        changed = ~np.isclose(s, plain, atol=1e-6).all(axis=(0, 1, 2))
        assert (changed[j <= i] == on_route[j <= i]).all(), t


def gated_path_grads(t, d, chunk, group, segments, gated, impls, solve=None, span=None, outer_group=8):
    """{impl: ((loss, output), gradients of q, k, v, w, beta and the FoX log-gates)} of PaTH
    attention (GQA: 4 query heads on 2 kv heads; FoX gates as a `Bias` read from the log-gates
    when `gated`) for impls "reference" (the materialised logits, one UT solve per `solve`
    tokens or one over T), "recompute" (chunked, its own backward; two levels with `span`) and
    "autodiff" (chunked, autodiff through its scans)."""
    q, k, v, w, beta = inputs(t=t, d=d)
    log_f = uniform(jax.random.key(3), (2, t, 4), minval=-1.0, maxval=0.0)
    seg = jnp.asarray([[1] * 5 + [2] * t, [3] * (t + 5)])[:, :t] if segments else None

    def attend(impl, q, k, v, w, beta, log_f):
        bias = forget_bias(log_f) if gated else None
        if impl == "reference":
            return reference_attention(q, k, v, bias_fn=bias, segment_ids=seg,
                                       score_fn=reference.dense_score_fn(w, beta, d ** -0.5, solve))
        return chunked.chunked_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, chunk=chunk, group=group,
                                    autodiff=impl == "autodiff", span=span, outer_group=outer_group)

    def loss(impl, *args):
        out = attend(impl, *args)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out

    return {impl: jax.jit(jax.value_and_grad(functools.partial(loss, impl), argnums=range(6), has_aux=True))(
        q, k, v, w, beta, log_f) for impl in impls}


def assert_same_values_and_gradients(results, against, atol=1e-4):
    (_, o1), g1 = results[against]
    (_, o2), g2 = results["recompute"]
    np.testing.assert_allclose(o1, o2, atol=2e-5)
    for name, a, b in zip("q k v w beta log_forget".split(), g1, g2):
        np.testing.assert_allclose(a, b, atol=atol, rtol=1e-4, err_msg=name)


@pytest.mark.parametrize("t,d,chunk,group,segments,gated,solve", [
    (1, 16, 4, 8, False, True, None),  # one token: one chunk, no far tile
    (7, 16, 3, 2, True, True, None),  # D > c: compact chunk operators; two groups
    (16, 8, 4, 8, True, True, 3),
    (13, 8, 1, 3, False, True, 4),
    (22, 8, 2, 2, True, False, 5),
    (200, 48, 64, 2, True, False, None),  # D <= c: dense chunk operators
    (200, 48, 32, 3, False, True, None),  # 7 chunks padded to 9: a whole chunk of padding
])
def test_chunked_equals_reference_values_and_gradients(t, d, chunk, group, segments, gated, solve):
    """The flash-style chunked form, with its recomputing backward, against autodiff of the
    materialised logits (one UT solve over T, or one per `solve` tokens: both exact): values,
    and gradients of q, k, v, w, beta and of the FoX gates (the bias hook's arrays)."""
    assert_same_values_and_gradients(
        gated_path_grads(t, d, chunk, group, segments, gated, ("reference", "recompute"), solve), "reference")


@pytest.mark.parametrize("t,d,chunk,span,group,outer_group,segments,gated", [
    (16, 8, 2, 4, 2, 2, True, True),  # 4 blocks of 2 chunks, two outer groups
    (13, 8, 1, 3, 3, 2, False, True),  # chunks of one token; 5 blocks padded to 6
    (37, 16, 4, 8, 8, 1, True, True),  # D > c: compact chunk operators inside, dense per block
    pytest.param(100, 16, 8, 32, 4, 8, True, True, marks=pytest.mark.slow),  # every block in one outer group
    pytest.param(200, 48, 16, 64, 8, 2, True, False, marks=pytest.mark.slow),
])
def test_two_levels_equal_reference_values_and_gradients(t, d, chunk, span, group, outer_group, segments, gated):
    """`span`: the chunked form inside blocks of span tokens and again across blocks, merged by
    log-sum-exp, each level's backward from the merged statistics: the same values and
    gradients as the materialised logits (documents crossing block boundaries, FoX gates)."""
    assert_same_values_and_gradients(gated_path_grads(t, d, chunk, group, segments, gated, ("reference", "recompute"),
                                                      span=span, outer_group=outer_group), "reference")


@pytest.mark.slow  # the reference test above checks the same gradients
def test_two_levels_autodiff_through_the_scans_agrees():
    assert_same_values_and_gradients(gated_path_grads(37, 16, 4, 2, True, True, ("autodiff", "recompute"), span=8,
                                                      outer_group=2), "autodiff")


def test_span_must_hold_whole_chunks():
    q, k, v, w, beta = inputs(t=20)
    with pytest.raises(ValueError, match=r"^PaTH chunked_attention span=6 must be a multiple of chunk=4$"):
        chunked.chunked_attention(q, k, v, w, beta, chunk=4, span=6)


@pytest.mark.slow  # the reference test above checks the same gradients; this one the old path
def test_recomputing_backward_equals_autodiff_through_the_scans():
    assert_same_values_and_gradients(gated_path_grads(50, 16, 16, 1, True, True, ("autodiff", "recompute")),
                                     "autodiff")


@pytest.mark.slow
def test_chunked_equals_reference_at_1000_tokens():
    assert_same_values_and_gradients(
        gated_path_grads(1000, 48, 64, 8, True, True, ("reference", "recompute")), "reference", atol=2e-4)


def grad_temp_bytes(t, autodiff, d=64):
    """XLA's temporary memory for forward + backward of chunked PaTH-FoX, one row, 2 heads
    (compiled only, backend optimisation off to compile faster: the buffer plan is the same)."""
    q, kv = jax.ShapeDtypeStruct((1, t, 2, d), jnp.float32), jax.ShapeDtypeStruct((1, t, 1, d), jnp.float32)
    beta, log_f = jax.ShapeDtypeStruct((1, t, 1), jnp.float32), jax.ShapeDtypeStruct((1, t, 2), jnp.float32)

    def loss(q, k, v, w, beta, log_f):
        return chunked.chunked_attention(q, k, v, w, beta, bias_fn=forget_bias(log_f), autodiff=autodiff).sum()

    lowered = jax.jit(jax.grad(loss, argnums=range(6))).lower(q, kv, kv, kv, beta, log_f)
    return lowered.compile({"xla_backend_optimization_level": 0}).memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("autodiff", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_backward_memory_grows_linearly_with_length(autodiff):
    """4x the tokens: the recomputing backward's temporary memory grows about 4x (seen: 3.4x,
    14 -> 47 MiB at 1K -> 4K tokens), autodiff's faster than linear (seen: 8.1x, 33 -> 266 MiB)."""
    short, long = (grad_temp_bytes(t, autodiff) for t in (1024, 4096))
    print(f"{'autodiff' if autodiff else 'recompute'}: temp {short / 2 ** 20:.1f} MiB at 1024 tokens, "
          f"{long / 2 ** 20:.1f} MiB at 4096 ({long / short:.1f}x)")
    assert long / short > 6 if autodiff else long / short < 5


def test_reference_equals_explicit_products_end_to_end():
    q, k, v, w, beta = inputs(t=9)
    out = dense_reference(q, k, v, w, beta)
    np.testing.assert_allclose(out, product_attention(q, k, v, w, beta), atol=1e-5)


def test_bf16_inputs_fp32_transport_values_and_gradients():
    q, k, v, w, beta = inputs(t=20, dtype=jnp.bfloat16)
    out = chunked_attention(q, k, v, w, beta, chunk=8)
    assert out.dtype == jnp.bfloat16
    exact = product_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), w, beta)
    np.testing.assert_allclose(np.asarray(out, np.float32), exact, atol=3e-2)

    # Gradients with bf16 q, k, v against the fp32 reference at the same (rounded) inputs.
    def grads(fn, dtype):
        def loss(q, k, v, w, beta):
            out = fn(*(x.astype(dtype) for x in (q, k, v)), w, beta).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape)))
        return jax.jit(jax.grad(loss, argnums=range(5)))(*(x.astype(jnp.float32) for x in (q, k, v)), w, beta)

    fast = grads(lambda q, k, v, w, beta: chunked.chunked_attention(q, k, v, w, beta, chunk=8), jnp.bfloat16)
    ref = grads(lambda q, k, v, w, beta: reference_attention(
        q, k, v, score_fn=reference.dense_score_fn(w, beta, 8 ** -0.5)), jnp.float32)
    for name, a, b in zip("q k v w beta".split(), fast, ref):
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b), name  # seen: 1.3e-3 to 2.2e-3


def relative_errors(t, **options):
    """Relative L2 errors of PaTH-FoX's chunked form on bf16 q, k, v (fp32 w, beta, gates) against
    the reference in fp32 at the same rounded inputs: output and the gradients of q, k, v, w,
    beta and the gates."""
    q, k, v, w, beta = inputs(t=t, d=64)
    log_f = uniform(jax.random.key(3), (2, t, 4), minval=-1.0, maxval=0.0)

    def grads(fn, dtype):
        def loss(q, k, v, w, beta, log_f):
            out = fn(*(x.astype(dtype) for x in (q, k, v)), w, beta, log_f).astype(jnp.float32)
            return jnp.sum(out * jnp.cos(jnp.arange(out.size).reshape(out.shape))), out
        rounded = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (q, k, v))
        (_, out), g = jax.jit(jax.value_and_grad(loss, argnums=range(6), has_aux=True))(*rounded, w, beta, log_f)
        return (out, *g)

    ref = grads(lambda q, k, v, w, beta, log_f: reference_attention(
        q, k, v, bias_fn=forget_bias(log_f), score_fn=reference.dense_score_fn(w, beta, 64 ** -0.5)), jnp.float32)
    got = grads(lambda q, k, v, w, beta, log_f: chunked.chunked_attention(q, k, v, w, beta, bias_fn=forget_bias(log_f),
                                                                     **options), jnp.bfloat16)
    return np.array([np.linalg.norm(np.float64(a) - b) / np.linalg.norm(np.float64(b)) for a, b in zip(got, ref)])


def test_bf16_tiles_stay_within_a_stated_bound():
    """tiles="bf16" (q.k and P.V on bf16 operands, fp32 accumulation; transport fp32), one level
    and two, at 160 tokens: every error (output, six gradients) at most 5e-3 and twice that of
    fp32 tiles on the same bf16 inputs (seen at 300 tokens: 1.8e-3 to 3.0e-3 against 1.3e-3 to
    2.3e-3; plain bf16 softmax attention, blockwise: 1.8e-3 to 3.6e-3). Both levels by kernels
    (interpreted; the kernel inside the blocks takes P.V in V's dtype, bf16, whatever `tiles`),
    across="blocks" and "chunks": at most 5e-3 and 2.5 times (seen at 160 tokens: 1.8e-3 to
    3.5e-3, at most 2.1 times)."""
    exact = relative_errors(160, chunk=16)
    kernels = [{"chunk": 16, "span": 64, "kernel": {"interpret": True}, "across": a} for a in ("blocks", "chunks")]
    for options, times in (({"chunk": 16}, 2), ({"chunk": 16, "span": 64}, 2), *((x, 2.5) for x in kernels)):
        errors = relative_errors(160, tiles="bf16", **options)
        assert (errors <= 5e-3).all() and (errors <= times * exact).all(), (options, errors, exact)


def test_bf16_tiles_lower_to_bf16_dots_for_cuda():
    """The two-level form's forward and backward exported for a GPU: the tiles' dots take bf16
    operands (tensor cores) and accumulate in fp32; with fp32 tiles none does."""
    from helpers.exported import lowered
    q, k, v, w, beta = inputs(t=64, d=16)

    def text(tiles):
        def loss(q, k, v, w, beta):
            return chunked.chunked_attention(q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16), w,
                                        beta, chunk=8, span=32, tiles=tiles).astype(jnp.float32).sum()
        return lowered(jax.grad(loss, argnums=(0, 1, 2)), q, k, v, w, beta)

    pattern = r"dot_general[^\n]*\(tensor<[0-9x]*xbf16>, tensor<[0-9x]*xbf16>\) -> tensor<[0-9x]*xf32>"
    assert len(re.findall(pattern, text("bf16"))) >= 12  # q.k, P.V; dP, dV, dq, dk: both levels (seen: 19)
    assert not re.findall(pattern, text("fp32"))


def test_beta_zero_is_nope():
    q, k, v, w, _ = inputs(t=10)
    zero = jnp.zeros((2, 10, 2))
    for out in (chunked_attention(q, k, v, w, zero, chunk=4),
                dense_reference(q, k, v, w, zero)):
        np.testing.assert_allclose(out, jax.jit(attention)(q, k, v), atol=1e-5)


@pytest.mark.parametrize("d,n", [(4, 3), (8, 5)])
def test_mean_route_with_uniform_directions_and_beta_two(d, n):
    """w uniform on the sphere, beta = 2: E[P_n] = (1 - 2/d)^n I (Monte Carlo)."""
    samples = 20000
    w = normal(jax.random.key(d), (samples, n, d))
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    h = transport.householder_matrices(w, jnp.full((samples, n), 2.0))
    p = h[:, 0]
    for t in range(1, n):
        p = jnp.matmul(h[:, t], p, precision=transport.HIGHEST)
    mean = np.asarray(p.mean(0))
    # Each entry of P_n is bounded by 1, so its mean has standard error <= 1/sqrt(samples).
    np.testing.assert_allclose(mean, (1 - 2 / d) ** n * np.eye(d), atol=5 / np.sqrt(samples))


def test_routes_are_orthogonal_when_beta_is_two():
    _, k, _, w, _ = inputs(t=12)
    two = jnp.full((2, 12, 2), 2.0)
    p = route_products(w[0, :, 0], two[0, :, 0])
    np.testing.assert_allclose(jnp.einsum("ijde,ijfe->ijdf", p, p)[np.tril_indices(12)],
                               np.broadcast_to(np.eye(8), (78, 8, 8)), atol=1e-5)
    ops = jax.jit(transport.chunk_products, static_argnames="chunk")(w, two, chunk=5)
    np.testing.assert_allclose(jnp.einsum("bnkde,bnkfe->bnkdf", ops, ops),
                               np.broadcast_to(np.eye(8), ops.shape), atol=1e-5)


@pytest.mark.parametrize("chunk", [3, 5, 64])
def test_transport_to_end_is_the_last_route(chunk):
    _, k, _, w, beta = inputs(t=13)
    out = jax.jit(transport.transport_to_end, static_argnames="chunk")(k, w, beta, chunk=chunk)
    p = route_products(w[1, :, 0], beta[1, :, 0])
    np.testing.assert_allclose(out[1, :, 0], jnp.einsum("jde,je->jd", p[-1], k[1, :, 0]), atol=1e-5)


@pytest.mark.parametrize("d", [16, 48, 100, 256])
def test_any_head_dimension(d):
    q, k, v, w, beta = inputs(t=10, h=2, kh=1, d=d)
    out = chunked_attention(q, k, v, w, beta, chunk=4)
    np.testing.assert_allclose(out, product_attention(q, k, v, w, beta), atol=2e-5)


def test_scheme_solve_chunk_reaches_the_reference_logits():
    """Path(solve_chunk=3) over 11 tokens (four solves) equals the explicit products."""
    from models.registry import make_scheme
    q, k, v, w, beta = inputs(t=11)
    scheme = make_scheme("path", num_heads=4, head_dim=8, solve_chunk=3)
    attend = jax.jit(lambda q, k, v, w, beta: scheme.transformed_attention(q, k, v, {"w": w, "beta": beta}))
    out = attend(q, k, v, w, beta)
    np.testing.assert_allclose(out, product_attention(q, k, v, w, beta), atol=2e-5)
    with pytest.raises(ValueError, match="solve_chunk"):
        make_scheme("path", num_heads=4, head_dim=8, solve_chunk=-1)


def test_scheme_span_runs_two_levels_with_the_same_result():
    """Path(span=8) with impls blockwise and pallas (the kernel inside blocks, interpreted; with
    across="blocks" the across-blocks kernel between them, with "chunks" between chunks too),
    and blockwise one block a step (outer_group=1), with 2-token chunks over 21 tokens (3
    blocks) equals the explicit products; a span that is not whole chunks, and an unknown
    `across`, are refused in one line."""
    from models.registry import make_scheme
    q, k, v, w, beta = inputs(t=21)
    scheme = make_scheme("path", num_heads=4, head_dim=8, span=8)
    features = {"w": w, "beta": beta}
    one_block_a_step = make_scheme("path", num_heads=4, head_dim=8, span=8, outer_group=1)
    kernels = [make_scheme("path", num_heads=4, head_dim=8, span=8, across=a) for a in ("blocks", "chunks")]
    for impl, scheme_ in (("blockwise", scheme), ("pallas", scheme), ("blockwise", one_block_a_step),
                          *(("pallas", x) for x in kernels)):
        out = jax.jit(lambda q, k, v, f: scheme_.transformed_attention(q, k, v, f, impl=impl, block_size=2))(q, k, v, features)
        np.testing.assert_allclose(out, product_attention(q, k, v, w, beta), atol=2e-5, err_msg=impl)
    with pytest.raises(ValueError, match=r"span=8 must be a multiple of chunk=3"):
        scheme.transformed_attention(q, k, v, features, impl="blockwise", block_size=3)
    with pytest.raises(ValueError, match="span"):
        make_scheme("path", num_heads=4, head_dim=8, span=-1)
    with pytest.raises(ValueError, match=r"^PaTH option outer_group=0 must be >= 1$"):
        make_scheme("path", num_heads=4, head_dim=8, outer_group=0)
    with pytest.raises(ValueError, match=r"^PaTH option across='pallas' must be one of \('scan', 'blocks', 'chunks'\)$"):
        make_scheme("path", num_heads=4, head_dim=8, across="pallas")


def test_decode_prefills_in_parallel_at_any_index():
    """Prefill 4, prefill 5 more (parallel, into a non-empty cache), then one at a time: the
    outputs equal the explicit products over the whole sequence, and the cache holds every key
    carried to the latest token."""
    from models.registry import make_scheme
    t = 12
    q, k, v, w, beta = inputs(t=t)
    scheme = make_scheme("path", num_heads=4, head_dim=8, conv=0)
    step = jax.jit(lambda cache, q, k, v, w, beta: scheme.decode_step(cache, q, k, v, {"w": w, "beta": beta}))
    cache = scheme.init_cache(2, t + 3, 2)
    outs = []
    for a, b in ((0, 4), (4, 9), (9, 10), (10, 11), (11, 12)):
        out, cache = step(cache, *(x[:, a:b] for x in (q, k, v, w, beta)))
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), product_attention(q, k, v, w, beta), atol=2e-5)
    np.testing.assert_allclose(cache["k"][:, :t], transport.transport_to_end(k, w, beta), atol=2e-5)


def test_fox_with_constant_gates_is_alibi():
    slopes = alibi_slopes(4)
    log_f = jnp.broadcast_to(-jnp.asarray(slopes, jnp.float32), (2, 9, 4))
    qi, kj = jnp.arange(9), jnp.arange(9)
    fox = forget_bias(log_f)(qi, kj)
    alibi = -slopes[None, :, None, None] * (qi[:, None] - kj[None, :])[None, None]
    tril = np.tril(np.ones((9, 9), bool))
    np.testing.assert_allclose(np.asarray(fox)[..., tril], np.broadcast_to(alibi, fox.shape)[..., tril],
                               atol=1e-5)


@pytest.mark.parametrize("name, gate_scale", [("path_fox", 8 ** -0.5), ("path+fox", 1.0)])
def test_path_fox_scales_the_gate_with_the_dots_and_path_plus_fox_does_not(name, gate_scale):
    """path_fox: (q^T P k + F_i - F_j) / sqrt(D), as the PaTH authors' PaTH-FoX; path+fox: FoX's
    q^T P k / sqrt(D) + F_i - F_j. Explicit products in float64 against the reference, the
    chunked form and token-by-token decoding."""
    from models.registry import make_scheme
    t = 10
    q, k, v, w, beta = inputs(t=t)
    log_f = jax.nn.log_sigmoid(normal(jax.random.key(7), (2, t, 4)))
    f = np.cumsum(np.asarray(log_f, np.float64), axis=1).transpose(0, 2, 1)  # F [B, H, T]
    want = product_attention(q, k, v, w, beta, gate_scale * (f[..., :, None] - f[..., None, :]))
    scheme = make_scheme(name, num_heads=4, head_dim=8, conv=0)
    features = {"w": w, "beta": beta, "log_forget": log_f}
    for impl in ("reference", "blockwise"):
        out = scheme.transformed_attention(q, k, v, features, positions=jnp.arange(t), impl=impl, block_size=4)
        np.testing.assert_allclose(out, want, atol=2e-5, err_msg=impl)
    step = jax.jit(scheme.decode_step)
    cache, outs = scheme.init_cache(2, t, 2), []
    for i in range(t):
        out, cache = step(cache, *(x[:, i:i + 1] for x in (q, k, v)), {n: x[:, i:i + 1] for n, x in features.items()})
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), want, atol=2e-5, err_msg="decode")


def test_path_fox_fixes_the_gate_scale():
    from models.registry import make_scheme, table_row
    assert make_scheme("path_fox", num_heads=4, head_dim=8).biases[0].logit_scale
    assert not make_scheme("path+fox", num_heads=4, head_dim=8).biases[0].logit_scale
    assert make_scheme("rope+fox", num_heads=4, head_dim=8, logit_scale=True).biases[0].logit_scale
    with pytest.raises(ValueError, match="fixes option.*logit_scale.*choose another scheme"):
        make_scheme("path_fox", num_heads=4, head_dim=8, logit_scale=False)
    assert "logit_scale" not in table_row("path_fox") and "logit_scale" in table_row("fox")


def test_bad_input_names_the_problem():
    q, k, v, w, beta = inputs(t=6)
    with pytest.raises(ValueError, match="beta"):
        chunked.chunked_attention(q, k, v, w, beta + 2.5)
    with pytest.raises(ValueError, match="w"):
        chunked.chunked_attention(q, k, v, w[..., :4], beta)
    with pytest.raises(ValueError, match="beta"):
        chunked.chunked_attention(q, k, v, w, beta[..., 0])
    from models.registry import make_scheme
    with pytest.raises(ValueError, match="rank"):
        make_scheme("path", num_heads=2, head_dim=8, rank=0)


def test_gate_bias_reaches_the_fox_part_of_a_composed_scheme():
    from flax import nnx

    from models.lm import DecoderLM, ModelConfig
    from models.registry import make_scheme
    assert make_scheme("path_fox", num_heads=4, head_dim=8, gate_bias=5.0).biases[0].gate_bias == 5.0
    rope_fox = make_scheme("rope+fox", num_heads=4, head_dim=8, base=500.0, gate_bias=2.0)
    assert (rope_fox.base, rope_fox.biases[0].gate_bias) == (500.0, 2.0)
    with pytest.raises(ValueError, match="has no option.*'gate_bias'"):
        make_scheme("path", num_heads=4, head_dim=8, gate_bias=5.0)
    m = DecoderLM(ModelConfig(vocab_size=30, d_model=32, num_layers=1, num_heads=4, scheme="path_fox",
                              scheme_options=(("gate_bias", 5.0),)), rngs=nnx.Rngs(0))
    gates = m.blocks[0].attn.features.parts[1]
    np.testing.assert_allclose(gates.proj.bias[...], 5.0)
    np.testing.assert_allclose(jnp.exp(gates(jnp.zeros((1, 3, 32)), tokens=None, index=None)["log_forget"]),
                               jax.nn.sigmoid(5.0), rtol=1e-6)  # f = 0.993 at the start
