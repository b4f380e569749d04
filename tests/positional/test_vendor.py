"""positional/vendor.py: cuDNN and splash attention against the reference, on this CPU.

cuDNN needs a GPU to run: its semantics are checked through the very call impl='cudnn' builds
(`cudnn_call`: masks, padding) with jax's "xla" implementation in place of "cudnn", and its
lowering for cuda through jax.export. Splash runs in the Pallas interpreter, and lowers for tpu
(Mosaic) through jax.export. Every refusal is one line naming the field and what to use.
"""

import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from lab.lowering import target
from helpers.exported import MOSAIC, excess_precision, lowered
from helpers.flash_rounding import rounded_attention
from positional import vendor
from models.registry import make_scheme
from positional.fox import forget_bias
from positional.logits import Bias, sum_of
from positional.softmax import reference_attention



def inputs(seed, b=2, t=12, s=None, h=4, kh=2, d=16, dtype=jnp.bfloat16):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    s = s or t
    return normal(kq, (b, t, h, d), dtype), normal(kk, (b, s, kh, d), dtype), normal(kv, (b, s, kh, d), dtype)


def segments(b, t, seed=0):
    """Sorted ids 1..3 per row: packed documents, the last row one document."""
    ids = np.sort(np.random.default_rng(seed).integers(1, 4, size=(b, t)), axis=1)
    ids[-1] = 1
    return jnp.asarray(ids, jnp.int32)


def values_and_grads(fn, q, k, v, *extra):
    """out and d/d(q, k, v) of sum(out * w), w fixed: fn(q, k, v, *extra) jitted."""
    w = normal(jax.random.key(99), q.shape, jnp.float32)

    def loss(q, k, v, *extra):
        out = fn(q, k, v, *extra)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q, k, v, *extra)
    return out, grads


def assert_close(got, want, rel):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.linalg.norm(got - want) <= rel * np.linalg.norm(want), np.abs(got - want).max()


def fp32(*xs):
    return tuple(x.astype(jnp.float32) for x in xs)


# ---- cuDNN's call, run by XLA ----------------------------------------------------------------

@pytest.mark.parametrize("t,s,q_offset,with_segments", [
    (12, 12, 0, False),   # training: cuDNN's own causal mask, no bias
    (12, 12, 0, True),    # packed: causal + a segment mask (the bias)
    (11, 11, 0, True),    # odd: padded to 12 (a query row, a masked key)
    (11, 11, 0, False),   # odd, no mask: the padded key is after every query
    pytest.param(3, 10, 6, False, marks=pytest.mark.slow),  # decoding, a static offset (causal mask)
    (1, 9, "traced", False),  # one decoding step at a traced index
    (12, 12, 0, "window"),    # a sliding window of 5: cuDNN's, in the causal form
    (1, 9, "traced", "window"),  # and in the mask form
])
def test_cudnn_call_by_xla_equals_reference(t, s, q_offset, with_segments):
    """GQA (4 query heads on 2 kv heads), bf16: the output within bf16 rounding of the fp32
    reference on the same inputs, the gradients likewise."""
    q, k, v = inputs(t + s, t=t, s=s)
    window = 5 if with_segments == "window" else None
    seg = segments(2, t) if with_segments is True else None
    traced = q_offset == "traced"
    offset = 8 if traced else q_offset

    def ours(q, k, v, off):
        return vendor.cudnn_call(q, k, v, segment_ids=seg, q_offset=off if traced else offset,
                                 implementation="xla", window=window)

    def ref(q, k, v, off):
        return reference_attention(q, k, v, segment_ids=seg, q_offset=offset, window=window)

    out, grads = values_and_grads(ours, q, k, v, jnp.int32(offset))
    want, want_grads = values_and_grads(ref, *fp32(q, k, v), jnp.int32(offset))
    assert out.dtype == jnp.bfloat16 and out.shape == q.shape
    assert_close(out, want, 6e-3)  # bf16 rounding: 2.5e-3 here; a mask off by one key: O(0.1)
    for g, w in zip(grads, want_grads):
        assert_close(g, w, 1e-2)


def test_cudnn_call_scale():
    q, k, v = inputs(1)
    out = jax.jit(functools.partial(vendor.cudnn_call, scale=0.3, implementation="xla"))(q, k, v)
    assert_close(out, reference_attention(*fp32(q, k, v), scale=0.3), 1e-2)


# ---- cuDNN's packed form -------------------------------------------------------------------

def random_packing(rng, t, runs):
    """Ids of `runs` contiguous documents (random lengths >= 1) along a row of t tokens,
    numbered 1, 2, ... as the data pipeline does; runs=0: a row of padding (id 0)."""
    if runs == 0:
        return np.zeros(t, np.int32)
    cuts = np.sort(rng.choice(np.arange(1, t), size=runs - 1, replace=False))
    return np.repeat(np.arange(1, runs + 1), np.diff(np.concatenate([[0], cuts, [t]]))).astype(np.int32)


def cudnn_packed_semantics(seqlen, offsets, t):
    """What jax's cuDNN binding documents for its packed form, by loops: segment m of a row
    covers offsets[m] .. offsets[m] + seqlen[m] - 1 (unused slots -1), causal inside it."""
    allowed = np.zeros((len(seqlen), t, t), bool)
    for b, (lengths, starts) in enumerate(zip(seqlen, offsets)):
        for n, o in zip(lengths, starts):
            if n >= 0:
                for i in range(o, o + n):
                    allowed[b, i, o:i + 1] = True
    return allowed


def test_packed_segments_equal_the_segment_mask():
    """Random packings of 1-12 documents in rows of 24 (a row of padding, one long document, a
    document per token): where a row has at most M runs, cuDNN's packed form of it is exactly
    the causal same-segment mask; `fits` is False for exactly the rows with more."""
    rng, t, m = np.random.default_rng(0), 24, 6
    rows = [random_packing(rng, t, n) for n in (0, 1, 2, 3, 5, 6, 7, 12, 24, *rng.integers(1, 13, size=23))]
    ids = np.stack(rows)
    seqlen, offsets, fits = jax.jit(vendor.packed_segments, static_argnums=1)(jnp.asarray(ids), m)
    seqlen, offsets, fits = map(np.asarray, (seqlen, offsets, fits))
    runs = 1 + (ids[:, 1:] != ids[:, :-1]).sum(1)
    assert seqlen.shape == (len(rows), m) and offsets.shape == (len(rows), m + 1)
    assert (fits == (runs <= m)).all() and not fits.all() and fits.any()
    want = (ids[:, :, None] == ids[:, None, :]) & np.tril(np.ones((t, t), bool))
    got = cudnn_packed_semantics(seqlen, offsets, t)
    assert (got[fits] == want[fits]).all()
    assert (np.asarray(vendor.packed_mask(jnp.asarray(seqlen), jnp.asarray(offsets), t))[:, 0] == got).all()
    assert (offsets[:, -1] == -1).all() and ((seqlen == -1) == (offsets[:, :-1] == -1)).all()


@pytest.mark.parametrize("t,max_segments,window", [(12, 3, None), (11, 1, None), (12, 3, 4), (11, 1, 4)])
def test_cudnn_packed_by_xla_equals_reference(t, max_segments, window):
    """The packed form (run by XLA through `packed_mask`) with its overflow branch: rows of 1-3
    documents, max_segments 3 (every batch packed) or 1 (the batch overflows: the mask form
    computes it); values and gradients against the fp32 reference, GQA, bf16, an odd length;
    with and without a sliding window."""
    q, k, v = inputs(t, t=t)
    seg = segments(2, t)

    def ours(q, k, v):
        return vendor.cudnn_call(q, k, v, segment_ids=seg, max_segments=max_segments, implementation="xla",
                                 window=window)

    out, grads = values_and_grads(ours, q, k, v)
    want, want_grads = values_and_grads(lambda q, k, v: reference_attention(q, k, v, segment_ids=seg, window=window),
                                        *fp32(q, k, v))
    assert out.dtype == jnp.bfloat16
    assert_close(out, want, 6e-3)
    for g, w in zip(grads, want_grads):
        assert_close(g, w, 1e-2)


def test_cudnn_splits_a_batch_past_its_element_limit(monkeypatch):
    """Past 2^31 elements in one call the batch is split (here the limit is made 3 rows' worth:
    5 rows go as 2 + 2 + 1), the result unchanged; one row past it is refused in one line."""
    q, k, v = inputs(5, b=5)
    whole = vendor.cudnn_call(q, k, v, implementation="xla")
    calls = []
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(jax.nn, "dot_product_attention",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or real(q, *a, **kw))
    monkeypatch.setattr(vendor, "ELEMENTS_PER_CALL", 3 * 12 * 4 * 16 - 1)
    split = vendor.cudnn_call(q, k, v, implementation="xla")
    assert sorted(calls) == [1, 2, 2] and (np.asarray(split, np.float32) == np.asarray(whole, np.float32)).all()
    monkeypatch.setattr(vendor, "ELEMENTS_PER_CALL", 12 * 4 * 16)
    line = vendor.cudnn_refusal(q, k, v, platform="cuda")
    assert "\n" not in line and line.startswith("impl='cudnn' cannot take 768 elements in one row") and "2^31" in line


# ---- per-key biases through q.k channels -----------------------------------------------------

def per_key_biases(b, t, h, seed=0):
    """FoX (gates from log sigmoid of N(0, 3^2): |F| up to ~100), ALiBi over packed-row
    positions, and their sum: each with the values it reads."""
    log_forget = jax.nn.log_sigmoid(3 * normal(jax.random.key(seed), (b, t, h)))
    positions = jnp.asarray(np.concatenate([np.arange(t)[None], np.arange(t)[None] % 9]), jnp.int32)
    alibi = make_scheme("alibi", num_heads=h, head_dim=16)
    return log_forget, {
        "fox": lambda lf: forget_bias(lf),
        "alibi": lambda lf: alibi.bias_fn(None, positions),
        "fox+alibi": lambda lf: sum_of([forget_bias(lf), alibi.bias_fn(None, positions)]),
    }


CHANNEL_IMPLS = {
    "cudnn": lambda q, k, v, bias, seg: vendor.cudnn_call(q, k, v, bias=bias, segment_ids=seg, implementation="xla"),
    "splash": lambda q, k, v, bias, seg: vendor.splash_call(q, k, v, bias=bias, segment_ids=seg, block_size=128,
                                                            interpret=True),
}


@pytest.mark.parametrize("impl", sorted(CHANNEL_IMPLS))
@pytest.mark.parametrize("name", ["fox", "alibi", "fox+alibi"])
def test_per_key_bias_channels_equal_reference(impl, name):
    """The channel form (cuDNN's call by XLA; splash interpreted) of a per-key bias equals the
    reference with the bias in the logits, values and the gradients of q, k, v and the gates:
    fp32 to 1e-5; bf16 within 1e-2 (out, dq, dk, dv) and 3e-2 (the gates: the kernels round dS
    to bf16 before summing it into a key's channel, where the fused kernel sums fp32 products;
    4e-3 for it here). GQA (4 query heads on 2), packed rows (1-3 documents), 37 tokens."""
    b, t, h = 2, 37, 4
    q, k, v = inputs(7, b=b, t=t, h=h, dtype=jnp.float32)
    seg = segments(b, t)
    log_forget, biases = per_key_biases(b, t, h)
    w = normal(jax.random.key(5), q.shape, jnp.float32)

    def grads(fn, dtype):
        def loss(q, k, v, lf):
            out = fn(*(x.astype(dtype) for x in (q, k, v)), biases[name](lf), seg)
            return jnp.sum(out.astype(jnp.float32) * w), out
        return jax.jit(jax.grad(loss, (0, 1, 2, 3), has_aux=True))(q, k, v, log_forget)

    want, want_out = grads(lambda q, k, v, bias, seg: reference_attention(q, k, v, bias_fn=bias, segment_ids=seg),
                           jnp.float32)
    for dtype, rel, gate_rel in [(jnp.float32, 1e-5, 1e-5), (jnp.bfloat16, 1e-2, 3e-2)]:
        got, out = grads(CHANNEL_IMPLS[impl], dtype)
        assert out.dtype == dtype
        assert_close(out, want_out, rel)
        for g, w_ in zip(got[:3], want[:3]):
            assert_close(g, w_, rel)
        if name != "alibi":  # ALiBi reads no gates
            assert_close(got[3], want[3], gate_rel)


@pytest.mark.parametrize("q_offset", [6, "traced"])
def test_per_key_bias_channels_while_decoding(q_offset):
    """Queries 6 .. 8 of 10 keys (a static or traced offset, cuDNN's mask form): the channels
    read each query's own term at its slot and give the reference's values, FoX + ALiBi, fp32."""
    t, s, h = 3, 10, 4
    q, k, v = inputs(11, t=t, s=s, h=h, dtype=jnp.float32)
    log_forget, biases = per_key_biases(2, s, h)
    bias = biases["fox+alibi"](log_forget)
    traced = q_offset == "traced"
    got = jax.jit(lambda q, k, v, off: vendor.cudnn_call(q, k, v, bias=bias, q_offset=off if traced else 6,
                                                         implementation="xla"))(q, k, v, jnp.int32(6))
    assert_close(got, reference_attention(q, k, v, bias_fn=bias, q_offset=6), 1e-5)


def test_per_key_bias_overflow_takes_the_inputs_as_they_came():
    """A batch over max_segments with a bias: the overflow function gets the original q, k, v
    (and computes the bias itself: here the reference), and the result is still exact."""
    b, t, h = 2, 12, 4
    q, k, v = inputs(9, b=b, t=t, h=h, dtype=jnp.float32)
    seg = segments(b, t)
    log_forget, biases = per_key_biases(b, t, h)
    bias = biases["fox"](log_forget)
    seen = []

    def overflow(q, k, v, *, segment_ids):
        seen.append((q.shape, k.shape, v.shape))
        return reference_attention(q, k, v, bias_fn=bias, segment_ids=segment_ids)

    out = vendor.cudnn_call(q, k, v, bias=bias, segment_ids=seg, max_segments=1, overflow=overflow,
                            implementation="xla")
    assert seen == [(q.shape, k.shape, v.shape)]
    assert_close(out, reference_attention(q, k, v, bias_fn=bias, segment_ids=seg), 1e-6)


def test_excess_precision_drops_round_trips():
    """The emulation above is faithful to what it claims: x - bf16(x) is 0 under it."""
    x = jnp.asarray([1.0 + 2 ** -12, 3.3], jnp.float32)
    rest = lambda x: x - x.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    assert np.all(np.asarray(rest(x)) != 0) and np.all(np.asarray(excess_precision(rest)(x)) == 0)


@pytest.mark.parametrize("compiler", ["as written", "GPU's excess precision"])
def test_channels_carry_fp32_where_one_bf16_number_does_not(compiler):
    """A key term of ~1e4 (FoX over a long document): hi + mid + lo reproduce it to fp32's
    rounding, a bf16 number alone is off by up to 2^-9 of it (tens of logit units). Also when
    the compiler drops fp32 -> bf16 -> fp32 round trips, as XLA on GPU does: the split that
    relied on one lost mid and lo there (an H200 measured the FoX output 0.22 off)."""
    term = jnp.asarray(np.random.default_rng(0).uniform(-2e4, 0, size=(1, 1, 64)), jnp.float32)
    bias = Bias(lambda q, k, qi, kj: -k["e"], {"e": -term.transpose(0, 2, 1)}, key=lambda k, kj: k["e"])
    q = jnp.zeros((1, 64, 1, 8), jnp.bfloat16)
    channels = functools.partial(vendor.key_bias_channels, bias=bias, scale=1.0, multiple=8)
    qc, kc = (channels if compiler == "as written" else excess_precision(channels))(q, q)
    carried = jnp.einsum("btd,bsd->bts", qc[:, :, 0].astype(jnp.float32), kc[:, :, 0].astype(jnp.float32))[0, 0]
    want = np.asarray(-term[0, 0] + term[0, 0, 0], np.float64)  # rebased at the first key
    assert np.abs(np.asarray(carried, np.float64) - want).max() <= 2e4 * 2 ** -22
    one = np.asarray(jnp.asarray(want, jnp.bfloat16), np.float64)
    assert np.abs(one - want).max() > 1.0
    assert qc.shape[-1] == kc.shape[-1] == 16  # 8 + 3, padded to a multiple of 8


def test_the_query_term_gives_the_gates_back_the_rows_residues():
    """Through a kernel that rounds as cuDNN and splash do (bf16 output into D, bf16 dS;
    tests/helpers/flash_rounding.py), FoX's gate gradient through the channels: with the query's
    channels (-e_i) its error is about a third of what the key's channels alone give (the form
    an H200 measured 18-31x the bf16 reference's error with), the output the same; still well
    over the bf16 reference's own error, which is why auto keeps learned biases off them."""
    b, t, h, kh, d = 2, 256, 4, 2, 32
    q, k, v = inputs(4, b=b, t=t, h=h, kh=kh, d=d, dtype=jnp.float32)
    seg = segments(b, t)
    log_forget = jax.nn.log_sigmoid(3 * normal(jax.random.key(1), (b, t, h)))
    w = normal(jax.random.key(2), (b, t, h, d), jnp.float32)
    g = h // kh

    def channels(q, k, v, bias, keys_only=False):
        qc, kc = vendor.key_bias_channels(q, k, bias, segment_ids=seg, scale=d ** -0.5, multiple=8)
        if keys_only:  # the query's term dropped: a constant of each row, so the same softmax
            qc = qc.at[..., d + vendor.CHANNELS * g:d + vendor.CHANNELS * (g + 1)].set(0)
        vp = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, qc.shape[-1] - d)))
        with mock.patch.object(jax.nn, "dot_product_attention", rounded_attention):
            return vendor.cudnn_call(qc, kc, vp, segment_ids=seg, scale=d ** -0.5, implementation="xla")[..., :d]

    def run(fn, dtype):
        def loss(lf):
            out = fn(*(x.astype(dtype) for x in (q, k, v)), forget_bias(lf)).astype(jnp.float32)
            return jnp.sum(out * w), out
        return jax.grad(loss, has_aux=True)(log_forget)

    reference = lambda q, k, v, bias: reference_attention(q, k, v, bias_fn=bias, segment_ids=seg)  # noqa: E731
    want, want_out = run(reference, jnp.float32)
    error = lambda x, y: float(jnp.linalg.norm(x - y) / jnp.linalg.norm(y))  # noqa: E731
    (both, out), (keys_only, out_keys) = run(channels, jnp.bfloat16), run(
        lambda *a: channels(*a, keys_only=True), jnp.bfloat16)
    own = error(run(reference, jnp.bfloat16)[0], want)
    assert error(out, want_out) < 5e-3 and error(out_keys, want_out) < 5e-3
    assert error(keys_only, want) > 2.5 * error(both, want), (error(keys_only, want), error(both, want))
    assert 2 * own < error(both, want) < 2e-2, (own, error(both, want))


@pytest.mark.parametrize("name", ["alibi", "fox", "rope+fox", "so2_learned_qkv+alibi", "tapa+alibi", "path+fox",
                                  "kerple_log", "rope_lm_infinite", "alibi+kerple_log"])
def test_which_biases_are_per_key(name):
    """A bias that declares `key` is c_i + key_j: fn - key is constant along every query's row
    (checked on random features and packed-row positions); KERPLE, LM-Infinite's window and
    any sum with them do not declare it."""
    scheme = make_scheme(name, num_heads=4, head_dim=16)
    q, k, _ = inputs(3, b=2, t=20, h=4, kh=4, dtype=jnp.float32)
    positions = jnp.asarray(np.stack([np.arange(20), np.arange(20) % 7]), jnp.int32)
    features = scheme.features_or_default(None, q, k, positions=positions, key=jax.random.key(0))
    if features and "log_forget" in features:
        features["log_forget"] = jax.nn.log_sigmoid(2 * normal(jax.random.key(1), (2, 20, 4)))
    bias = scheme.score_bias(features, positions)
    separable = name in ("alibi", "fox", "rope+fox", "so2_learned_qkv+alibi", "tapa+alibi", "path+fox")
    assert vendor.per_key(bias) == separable
    if separable:
        full = bias(jnp.arange(20), jnp.arange(20))  # [B, H, T, S]
        rest = np.asarray(full - bias.key_terms(20)[:, :, None, :])
        assert np.abs(rest - rest[..., :1]).max() <= 1e-4 * max(1.0, np.abs(full).max())


# ---- splash, interpreted ---------------------------------------------------------------------

def test_splash_tiling():
    assert vendor.splash_tiling(1023, 512) == (1024, 512)
    assert vendor.splash_tiling(200, 512) == (256, 256)
    assert vendor.splash_tiling(1152, 512) == (1152, 128)  # 9 * 128: only 128 divides it
    assert vendor.splash_tiling(12, 64) == (128, 128)      # tiles are at least 128
    assert vendor.splash_tiling(4096, None) == (4096, 512)


@pytest.mark.parametrize("t,with_segments,dtype,window", [
    (200, True, jnp.float32, None), (200, True, jnp.float32, 100),
    pytest.param(12, False, jnp.bfloat16, None, marks=pytest.mark.slow)])
def test_splash_interpreted_equals_reference(t, with_segments, dtype, window):
    """GQA; t=200 pads to 256, two 128-tiles (block_size=128), with packed segments; a sliding
    window of 100 (splash's local mask) crossing the tiles' edge."""
    q, k, v = inputs(t, t=t, dtype=dtype)
    seg = segments(2, t, seed=t) if with_segments else None
    ours = functools.partial(vendor.splash_attention, segment_ids=seg, block_size=128, interpret=True, window=window)
    out, grads = values_and_grads(ours, q, k, v)
    want, want_grads = values_and_grads(functools.partial(reference_attention, segment_ids=seg, window=window),
                                        *fp32(q, k, v))
    assert out.dtype == dtype and out.shape == q.shape
    rel = 1e-5 if dtype == jnp.float32 else 6e-3
    assert_close(out, want, rel)
    for g, w in zip(grads, want_grads):
        assert_close(g, w, 2 * rel)


# ---- lowering for the accelerators, on this CPU --------------------------------------------

@pytest.fixture
def cudnn_version():
    """For the whole test (lowering for cpu traces the cuda branch too): lab.lowering's stand-in."""
    with target("cuda"):
        yield


def grad_of(fn):
    return jax.grad(lambda q, k, v, *extra: fn(q, k, v, *extra).astype(jnp.float32).sum(), (0, 1, 2))


def test_cudnn_lowers_for_cuda(cudnn_version):
    """T = S = 255 (odd: padded): without segment ids the causal flash call; with them the
    packed form (no bias; PADDING_CAUSAL) and its overflow branch, the mask form (the bias
    call), or the bias call alone with max_segments=0; forward and backward. Lowered for cpu,
    the same function refuses in one line."""
    q = jax.ShapeDtypeStruct((2, 255, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 255, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 255), jnp.int32)
    plain = lambda q, k, v, seg: vendor.cudnn_attention(q, k, v)  # noqa: E731
    packed = lambda q, k, v, seg: vendor.cudnn_attention(q, k, v, segment_ids=seg)  # noqa: E731
    masked = lambda q, k, v, seg: vendor.cudnn_attention(q, k, v, segment_ids=seg, max_segments=0)  # noqa: E731
    fwd, bias = ["__cudnn$fmhaSoftmax"], ["__cudnn$fmhaScaleBiasSoftmax"]
    for fn, calls, masks in [
            (plain, fwd, ["CAUSAL"]),
            (grad_of(plain), [*fwd, "__cudnn$fmhaSoftmaxBackward"], ["CAUSAL"]),
            (packed, [*bias, *fwd], ["CAUSAL", "PADDING_CAUSAL"]),
            (grad_of(packed), [bias[0], "__cudnn$fmhaScaleBiasSoftmaxBackward", fwd[0],
                               "__cudnn$fmhaSoftmaxBackward"], ["CAUSAL", "PADDING_CAUSAL"]),
            (masked, bias, ["CAUSAL"]),
            (grad_of(masked), [*bias, "__cudnn$fmhaScaleBiasSoftmaxBackward"], ["CAUSAL"])]:
        text = lowered(fn, q, k, k, seg, platforms=["cuda"])
        assert sorted(set(re.findall(r"__cudnn\$\w+", text))) == sorted(calls)
        # cuDNN skips the future in every call, bias or not
        assert sorted(set(re.findall(r'\\22mask_type\\22: \\22(\w+)\\22', text))) == masks
        with pytest.raises(ValueError, match=r"^impl='cudnn' runs on CUDA GPUs .* not on platform 'cpu'; use impl"):
            lowered(fn, q, k, k, seg, platforms=["cpu"])
    # A decoding step at a traced index: the causal mask as a bias.
    step = jax.ShapeDtypeStruct((2, 1, 4, 64), jnp.bfloat16)
    text = lowered(lambda q, k, v, i: vendor.cudnn_attention(q, k, v, q_offset=i), step, k, k,
                   jax.ShapeDtypeStruct((), jnp.int32), platforms=["cuda"])
    assert "__cudnn$fmhaScaleBiasSoftmax" in text


def test_a_window_reaches_cudnn_and_splash(cudnn_version):
    """A sliding window of 64 is cuDNN's own in every call, forward and backward, plain and packed
    (`sliding_window_length`, whose tiles outside it cuDNN skips); splash's local mask lists only
    the tiles within it (2 of 16 key tiles per query tile at 8,192 tokens in tiles of 512 with a
    window of 512, against the causal mask's 136 of 256)."""
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 256), jnp.int32)
    for fn in (lambda q, k, v, seg: vendor.cudnn_attention(q, k, v, window=64),
               lambda q, k, v, seg: vendor.cudnn_attention(q, k, v, segment_ids=seg, window=64)):
        for f in (fn, grad_of(fn)):
            text = lowered(f, q, k, k, seg, platforms=["cuda"])
            calls = re.findall(r"__cudnn\$\w+", text)
            assert calls
            assert re.findall(r"sliding_window_length\\22: (\d+)", text) == ["64"] * len(calls), calls
    causal, local = (vendor._splash_kernel(2, 8192, 512, True, w).fwd_mask_info.block_mask for w in (None, 512))
    assert (np.asarray(causal) > 0).sum() == 136 and np.asarray(local).shape == (1, 16, 2)
    assert (np.asarray(local) > 0).sum() == 31  # the first query tile has one key tile


def test_cudnn_on_cpu_refuses_in_one_line(cudnn_version):
    q, k, v = inputs(2)
    with pytest.raises(ValueError) as error:
        jax.jit(vendor.cudnn_attention)(q, k, v)
    assert "\n" not in str(error.value) and "platform 'cpu'" in str(error.value)


def test_cudnn_without_cudnn_refuses_at_trace_time():
    """This CPU jaxlib has no cuDNN: jax cannot even build the call, and says so in one line."""
    from jax._src.lib import cuda_versions
    if cuda_versions is not None:
        pytest.skip("this jaxlib has cuDNN")
    q, k, v = inputs(3)
    with pytest.raises(ValueError) as error:
        vendor.cudnn_attention(q, k, v)
    message = str(error.value)
    assert "\n" not in message and message.startswith("impl='cudnn' needs cuDNN") and "impl='blockwise'" in message


def test_splash_lowers_for_tpu():
    """T = 1023 (padded to 1024, 512-tiles), GQA, segment ids: one Mosaic kernel forward, three
    with the gradient (the forward keeping its residuals; dq; dk and dv), and no tensor of
    [T / tile] partial dq's (the fused backward's). Lowered for cpu, the same function refuses
    in one line."""
    q = jax.ShapeDtypeStruct((2, 1023, 4, 128), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, 1023, 2, 128), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((2, 1023), jnp.int32)
    f = lambda q, k, v, seg: vendor.splash_attention(q, k, v, segment_ids=seg)  # noqa: E731
    for fn, kernels in ((f, 1), (grad_of(f), 3)):
        text = lowered(fn, q, k, k, seg, platforms=["tpu"])
        assert text.count(MOSAIC) == kernels and "x2x4x1024x128x" not in text
        with pytest.raises(ValueError, match=r"^impl='splash' runs on TPU .* not on platform 'cpu'; use impl"):
            lowered(fn, q, k, k, seg, platforms=["cpu"])


# ---- refusals ------------------------------------------------------------------------------

def shapes(b=1, t=256, s=None, h=4, kh=2, d=128, dtype=jnp.bfloat16, k_dtype=None):
    s = s or t
    return (jax.ShapeDtypeStruct((b, t, h, d), dtype), jax.ShapeDtypeStruct((b, s, kh, d), k_dtype or dtype),
            jax.ShapeDtypeStruct((b, s, kh, d), k_dtype or dtype))


def some_bias(qi, kj):
    return jnp.zeros((1, 1, qi.shape[0], kj.shape[0]))


def some_score(qb, kb, qi, kj):
    return jnp.einsum("btkgd,bskd->bkgts", qb, kb)


PER_KEY = Bias(lambda q, k, qi, kj: kj - qi + 0.0, key=lambda k, kj: kj + 0.0)


CUDNN_REFUSALS = [
    ({"bias_fn": some_bias}, {}, "bias_fn"),
    ({"score_fn": some_score}, {}, "score_fn"),
    ({"platform": "cpu"}, {}, "platform 'cpu'"),
    ({"platform": "tpu"}, {}, "platform 'tpu'"),
    ({}, {"dtype": jnp.float32}, "q dtype float32"),
    ({}, {"k_dtype": jnp.float16}, "k float16"),
    ({}, {"d": 100}, "head_dim=100"),
    ({}, {"d": 512}, "head_dim=512"),
    ({"bias_fn": PER_KEY}, {"d": 128}, "head_dim=128 (+ the bias channels: 144)"),  # 128 at most before Hopper
]
SPLASH_REFUSALS = [
    ({"bias_fn": some_bias}, {}, "bias_fn"),
    ({"score_fn": some_score}, {}, "score_fn"),
    ({"platform": "cpu"}, {}, "platform 'cpu'"),
    ({"platform": "cuda"}, {}, "platform 'cuda'"),
    ({"q_offset": 3}, {"t": 1}, "q_offset=3"),
    ({}, {"t": 128, "s": 256}, "q length 128 with key length 256"),
    ({}, {"dtype": jnp.float16}, "q dtype float16"),
    ({}, {"k_dtype": jnp.float32}, "k float32"),
    ({}, {"d": 32}, "head_dim=32"),
]


def check_line(message, impl, field):
    assert message is not None and "\n" not in message, message
    assert message.startswith(f"impl={impl!r}") and field in message, message
    assert message.endswith("'blockwise' or 'auto'") or "or use impl='blockwise' or 'auto'" in message


@pytest.mark.parametrize("options,shape,field", CUDNN_REFUSALS)
def test_cudnn_refusals(options, shape, field):
    q, k, v = shapes(**shape)
    call = {"platform": "cuda"} | options
    check_line(vendor.cudnn_refusal(q, k, v, **call), "cudnn", field)
    if "platform" not in options:  # the implementation raises the same line (before it traces)
        with pytest.raises(ValueError) as error:
            jax.eval_shape(functools.partial(vendor.cudnn_attention, **options), q, k, v)
        assert str(error.value) == vendor.cudnn_refusal(q, k, v, **call)


@pytest.mark.parametrize("options,shape,field", SPLASH_REFUSALS)
def test_splash_refusals(options, shape, field):
    q, k, v = shapes(**shape)
    call = {"platform": "tpu"} | options
    check_line(vendor.splash_refusal(q, k, v, **call), "splash", field)
    if "platform" not in options:
        with pytest.raises(ValueError) as error:
            jax.eval_shape(functools.partial(vendor.splash_attention, **options), q, k, v)
        assert str(error.value) == vendor.splash_refusal(q, k, v, **call)


def test_splash_refuses_a_traced_offset():
    q, k, v = shapes(t=1)
    with pytest.raises(ValueError, match=r"^impl='splash' cannot take q_offset=a traced value"):
        jax.jit(lambda q, k, v, i: vendor.splash_attention(q, k, v, q_offset=i))(
            *(jnp.zeros(x.shape, x.dtype) for x in (q, k, v)), jnp.int32(0))


def test_what_each_takes():
    """No refusal for what the module doc says each takes; segment ids and decoding for cuDNN."""
    q, k, v = shapes(d=64)
    assert vendor.cudnn_refusal(q, k, v, segment_ids=jnp.ones((1, 256), jnp.int32), platform="cuda") is None
    assert vendor.cudnn_refusal(*shapes(t=1, s=256, dtype=jnp.float16), q_offset=200, platform="gpu") is None
    assert vendor.cudnn_head_dim_limit() == 128  # no CUDA device here
    assert vendor.splash_refusal(q, k, v, segment_ids=jnp.ones((1, 256), jnp.int32), platform="tpu") is None
    assert vendor.splash_refusal(*shapes(t=100, d=192, dtype=jnp.float32), platform="tpu") is None
    # The interpreter takes any platform and head dim; not decoding.
    assert vendor.splash_refusal(*shapes(d=16), platform="cpu", interpret=True) is None
    check_line(vendor.splash_refusal(*shapes(t=1, s=9, d=16), q_offset=8, platform="cpu", interpret=True),
               "splash", "q_offset=8")


def test_the_dispatcher_names_them():
    """attention(impl=...) reaches both, block_size passed on (splash: its tile cap; cudnn: ignored)."""
    from positional.attention import IMPLEMENTATIONS, attention
    assert IMPLEMENTATIONS["cudnn"] is vendor.cudnn_attention
    assert IMPLEMENTATIONS["splash"] is vendor.splash_attention
    q, k, v = inputs(4, t=12, dtype=jnp.float32)
    out = jax.jit(functools.partial(attention, impl="splash", block_size=128, interpret=True))(q, k, v)
    assert_close(out, reference_attention(q, k, v), 1e-5)
    with pytest.raises(ValueError, match=r"^impl='cudnn' cannot take q dtype float32"):
        attention(q, k, v, impl="cudnn", block_size=512)
