"""PaTH's across-blocks kernel (positional/path/across.py) against attention written out densely
from the same query versions, in both loop structures, values, log-sum-exp and every gradient;
`versions` against the dense route products; lowered for cuda and tpu and compiled through
libtpu; bad input. (Against PaTH's reference, as the outer level of the two-level form:
tests/positional/test_path_kernel.py, `test_kernel_inside_blocks_chunked_across_equals_reference`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.draws import normal, uniform
from helpers.exported import MOSAIC, TRITON, compiled_for, lowered, simplified

from positional.fox import forget_bias
from positional.logits import Bias
from positional.path.across import across_blocks, versions
from positional.path.reference import route_products
from positional.path.transport import HIGHEST


def dense(qv, k, v, span, bias, seg, scale):
    """(out, lse) written out: query i scores key j of an earlier block J by qv[J, i] . k_j."""
    qv = jnp.moveaxis(qv, 1, 3)  # [B, N, T, H, D]
    b, n, t, h, d = qv.shape
    g = h // k.shape[2]
    k, v = (jnp.repeat(x, g, axis=2) for x in (k, v))
    block = jnp.arange(t) // span
    s = jnp.einsum("bjihd,bjhd->bhij", qv[:, block], k, precision=HIGHEST) * scale  # qv[:, block]: key j's version
    if bias is not None:
        s = s + bias(jnp.arange(t), jnp.arange(t))
    ok = (block[None, :] < block[:, None])[None, None] & (seg[:, None, :, None] == seg[:, None, None, :])
    s = jnp.where(ok, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    return jnp.einsum("bhij,bjhd->bihd", p, v, precision=HIGHEST), jnp.swapaxes(lse, 1, 2)


def inputs(t, span, d, h, kh, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(1), 4)
    qv = normal(ks[0], (2, h, -(-t // span), t, d)).astype(dtype)
    k, v = (normal(x, (2, t, kh, d)).astype(dtype) for x in ks[1:3])
    log_f = uniform(ks[3], (2, t, h), minval=-1.0, maxval=0.0)
    # Row 0: documents of 3, 5 and the rest (the second starts inside the first block, so its
    # rows there see no key); row 1: one document.
    seg = jnp.asarray([[0] * 3 + [1] * 5 + [2] * t, [7] * (t + 8)])[:, :t]
    return qv, k, v, log_f, seg


def value_and_grads(fn, qv, k, v, log_f, seg):
    """(out, lse, the gradients of qv, k, v and the gates) of a loss on out and the finite lse."""
    def loss(qv, k, v, log_f):
        gates = forget_bias(log_f)
        bias = Bias(lambda q_, k_, qi, kj: gates.fn(q_, k_, qi, kj) + 0.03 * kj, gates.values)
        o, lse = fn(qv, k, v, bias, seg)
        weights = jnp.cos(jnp.arange(o.size).reshape(o.shape))
        return jnp.sum(o * weights) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * jnp.sin(lse.shape[1] * 1.0)), \
            (o, lse)

    (_, (o, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=range(4), has_aux=True))(qv, k, v, log_f)
    return o, lse, grads


def rel(a, b):
    a, b = (np.asarray(x, np.float32) for x in (a, b))
    return float(np.linalg.norm(a - b) / (np.linalg.norm(b) or 1.0))


@pytest.mark.parametrize("t,span,d,kh,stream,tiles", [
    (21, 8, 16, 2, False, (4, 2)),  # 3 blocks, the last padded; the loop (GPU's form)
    (21, 8, 48, 1, True, (2, 4)),  # streamed (TPU's form); D padded to 64; one kv head for 4 query heads
    pytest.param(100, 32, 64, 2, False, (None, None), marks=pytest.mark.slow),  # default tiles (gcd with span)
])
def test_equals_attention_over_the_versions(t, span, d, kh, stream, tiles):
    """Values, the rows' log-sum-exp (-inf exactly where a row sees no key: the first block's,
    and a document's rows in the block it starts in) and the gradients of qv, k, v and the
    bias's values (FoX gates plus a term in the key's position)."""
    qv, k, v, log_f, seg = inputs(t, span, d, 4, kh)
    kernel = lambda qv, k, v, bias, seg: across_blocks(qv, k, v, span=span, bias_fn=bias, segment_ids=seg,  # noqa: E731
                                                        interpret=True, stream=stream, block_q=tiles[0],
                                                        block_k=tiles[1])
    got_o, got_lse, got_grads = value_and_grads(kernel, qv, k, v, log_f, seg)
    want_o, want_lse, want_grads = value_and_grads(lambda *a: dense(*a[:3], span, *a[3:], d ** -0.5),
                                                   qv, k, v, log_f, seg)
    block, ids = np.arange(t) // span, np.asarray(seg)
    sees = ((block[None, None, :] < block[None, :, None]) & (ids[:, None, :] == ids[:, :, None])).any(-1)  # [B, T]
    assert (~sees[:, span:]).any() == (span == 8)  # span 8: the third document starts a block
    np.testing.assert_array_equal(np.isfinite(got_lse), np.broadcast_to(sees[..., None], got_lse.shape))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.where(finite, got_lse, 0), np.where(finite, want_lse, 0), atol=2e-6)
    assert rel(got_o, want_o) < 1e-6
    for name, g, w in zip(("qv", "k", "v", "gates"), got_grads, want_grads):
        assert rel(g, w) < 1e-6, name


@pytest.mark.parametrize("stream", [False, True])
def test_queries_a_run_at_a_time_equal_attention_over_the_versions(stream):
    """The queries taken a run of whole blocks at a time (q_offset traced: one kernel under a
    lax.map over the runs, each run's versions alone) give the whole attention: values, lse and
    the gradients of qv, k, v and the gates; 40 tokens in blocks of 8, runs of 16 (the last
    run holds the padded tail only as far as its blocks)."""
    t, span, run = 40, 8, 16
    qv, k, v, log_f, seg = inputs(t, span, 16, 4, 2)

    def runs(qv, k, v, bias, seg):
        padded = jnp.pad(qv, [(0, 0), (0, 0), (0, 1), (0, 48 - t), (0, 0)])  # 6 blocks

        def one(offset):
            part = jax.lax.dynamic_slice_in_dim(padded, offset, run, 3)
            return across_blocks(part, jnp.pad(k, [(0, 0), (0, 48 - t), (0, 0), (0, 0)]),
                                 jnp.pad(v, [(0, 0), (0, 48 - t), (0, 0), (0, 0)]), span=span, q_offset=offset,
                                 bias_fn=Bias(bias.fn, {n: jnp.pad(x, [(0, 0), (0, 48 - t), (0, 0)])
                                                        for n, x in bias.values.items()}),
                                 segment_ids=jnp.pad(seg, [(0, 0), (0, 48 - t)], constant_values=-1),
                                 interpret=True, stream=stream, block_q=4, block_k=8)

        o, lse = jax.lax.map(one, jnp.arange(0, 48, run))  # [runs, B, run, H, ...]
        return (jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])[:, :t] for x in (o, lse))

    got_o, got_lse, got_grads = value_and_grads(runs, qv, k, v, log_f, seg)
    want_o, want_lse, want_grads = value_and_grads(lambda *a: dense(*a[:3], span, *a[3:], 16 ** -0.5),
                                                   qv, k, v, log_f, seg)
    np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
    finite = np.isfinite(want_lse)
    np.testing.assert_allclose(np.where(finite, got_lse, 0), np.where(finite, want_lse, 0), atol=2e-6)
    assert rel(got_o, want_o) < 1e-6
    for name, g, w in zip(("qv", "k", "v", "gates"), got_grads, want_grads):
        assert rel(g, w) < 1e-6, name


def test_versions_are_the_queries_carried_back_to_each_earlier_block():
    """versions(q_start, whole)[J, I] = block I's queries times the products of blocks I - 1 ..
    J + 1, against route_products (the dense H_i ... H_{j+1}): 3 blocks of 4 tokens."""
    t, span, d = 12, 4, 8
    ks = jax.random.split(jax.random.key(2), 3)
    w = normal(ks[0], (t, d))
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    beta = uniform(ks[1], (t,), minval=0.0, maxval=2.0)
    q = normal(ks[2], (t, d))
    p = route_products(w, beta)  # p[i, j] = H_i ... H_{j+1}
    # Block m's product, as a row x takes it (x -> x @ P; block 0's is never used).
    whole = jnp.stack([jnp.eye(d)] + [p[(m + 1) * span - 1, m * span - 1] for m in (1, 2)])
    q_start = q.reshape(3, span, d)  # taken as the blocks' queries at their start
    got = versions(q_start, whole)
    for big in range(3):
        for j in range(3):
            if j >= big:
                np.testing.assert_array_equal(got[j, big], 0.0)
                continue
            # the route from the end of block j to the start of block big: H over blocks j + 1 .. big - 1
            route = p[big * span - 1, (j + 1) * span - 1]
            np.testing.assert_allclose(got[j, big], q_start[big] @ route, atol=1e-5)


def test_versions_gradients_equal_autodiff_of_the_products_written_out():
    """The gradients of `versions` (its own backward, a scan the other way) in q_start and the
    blocks' products, a product broadcast over a leading axis, against autodiff of the products
    written out: 4 blocks of 3 tokens, fp32 output."""
    n, span, d = 4, 3, 5
    ks = jax.random.split(jax.random.key(3), 3)
    q_start, whole = normal(ks[0], (2, n, span, d)), normal(ks[1], (1, n, d, d)) / d ** 0.5
    weights = normal(ks[2], (2, n, n, span, d))

    def written_out(q_start, whole):
        rows = []
        for j in range(n):
            row = []
            for big in range(n):
                x = q_start[:, big] if big > j else jnp.zeros_like(q_start[:, big])
                for m in range(big - 1, j, -1) if big > j else ():
                    x = jnp.matmul(x, whole[:, m], precision=HIGHEST)
                row.append(x)
            rows.append(jnp.stack(row, 1))
        return jnp.stack(rows, 1)

    np.testing.assert_allclose(versions(q_start, whole), written_out(q_start, whole), atol=1e-5)
    got, want = (jax.grad(lambda a, b, f=f: jnp.sum(f(a, b) * weights), (0, 1))(q_start, whole)
                 for f in (versions, written_out))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)


def test_versions_of_a_run_of_blocks_are_those_blocks_of_all_the_versions():
    """versions(blocks 1 .. 2, first=1 traced) = versions(all)[:, :, 1:3] in value and in the
    gradients of q_start and the products: 4 blocks of 3 tokens."""
    n, span, d = 4, 3, 5
    ks = jax.random.split(jax.random.key(4), 3)
    q_start, whole = normal(ks[0], (2, n, span, d)), normal(ks[1], (2, n, d, d)) / d ** 0.5
    weights = normal(ks[2], (2, n, 2, span, d))

    def run(q_start, whole, first):
        return versions(jax.lax.dynamic_slice_in_dim(q_start, first, 2, 1), whole, first=first)

    whole_run = lambda q_start, whole, first: versions(q_start, whole)[:, :, 1:3]  # noqa: E731
    np.testing.assert_allclose(jax.jit(run)(q_start, whole, 1), whole_run(q_start, whole, 1), atol=1e-6)
    got, want = (jax.grad(lambda a, b, f=f: jnp.sum(f(a, b, 1) * weights), (0, 1))(q_start, whole)
                 for f in (jax.jit(run), whole_run))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, atol=1e-5)


@pytest.mark.parametrize("platform,call", [("cuda", TRITON), ("tpu", MOSAIC)])
def test_lowers_for_gpu_and_tpu(platform, call):
    """Forward (1 kernel) and forward + backward (3: forward, dq, dk-dv) exported for an
    accelerator: bf16, head dimension 128, GQA, FoX gates, segment ids, 2,048 tokens in blocks
    of 512. No T x T tensor."""
    t, span = 2048, 512
    qv = jax.ShapeDtypeStruct((1, 4, t // span, t, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    log_f, seg = jax.ShapeDtypeStruct((1, t, 4), jnp.float32), jax.ShapeDtypeStruct((1, t), jnp.int32)

    def f(qv, k, v, log_f, seg):
        return across_blocks(qv, k, v, span=span, bias_fn=forget_bias(log_f), segment_ids=seg, platform=platform)

    grad = jax.grad(lambda *a: sum(jnp.sum(jnp.where(jnp.isfinite(x), x, 0.0)) for x in f(*a)), range(4))
    forward, backward = (simplified(lowered(fn, qv, k, k, log_f, seg, platforms=[platform])) for fn in (f, grad))
    assert forward.count(call) == 1 and backward.count(call) == 3
    assert not [x for x in __import__("re").findall(r"tensor<((?:\d+x)+)[a-z]\w*>", backward)
                if sum(int(n) >= t for n in x.split("x")[:-1]) >= 2]


@pytest.mark.parametrize("topology", ["v4:2x2x1", "v5e:1x1"])
def test_compiles_for_tpu(topology):
    """Forward + backward compiled by the TPU compiler (libtpu) for one chip: 8,192 tokens in
    blocks of 1,024, bf16, head dimension 128, GQA, FoX gates, segment ids; on a v4 (16 MiB of
    VMEM) too, as the kernel keeps nothing of the whole sequence in VMEM."""
    t, span = 8192, 1024
    qv = jax.ShapeDtypeStruct((1, 4, t // span, t, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, t, 2, 128), jnp.bfloat16)
    log_f, seg = jax.ShapeDtypeStruct((1, t, 4), jnp.float32), jax.ShapeDtypeStruct((1, t), jnp.int32)

    def loss(qv, k, v, log_f, seg):
        o, _ = across_blocks(qv, k, v, span=span, bias_fn=forget_bias(log_f), segment_ids=seg, platform="tpu")
        return o.sum()

    compiled = compiled_for(jax.grad(loss, range(4)), qv, k, k, log_f, seg, topology=topology)
    assert compiled.as_text().count("tpu_custom_call") >= 3


def test_bad_input_is_one_line_naming_the_field():
    qv, k, v, _, seg = inputs(21, 8, 16, 4, 2)
    cases = [
        (dict(span=0), r"^PaTH across_blocks span=0 must be a positive integer \(tokens per block\)$"),
        (dict(span=4), r"^PaTH across_blocks: qv\(2, 4, 3, 21, 16\) must be \[B, H, ceil\(T / span\), Tq, D\] = "
                       r"\[2, a multiple of 2, 6, 21 or a multiple of 4 up to it, 16\]"),
        (dict(span=8, q_offset=8), r"^PaTH across_blocks q_offset=8 must be a multiple of span=8 with "
                                   r"q_offset \+ Tq <= T \(Tq 21, T 21\)$"),
        (dict(span=8, block_q=3, interpret=True), r"^PaTH across_blocks block_q=3 must divide span=8$"),
        (dict(span=8, bias_fn=lambda qi, kj: 0.0), r"^PaTH across_blocks: bias_fn must be a positional.logits.Bias"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=message):
            across_blocks(qv, k, v, segment_ids=seg, **kw)
