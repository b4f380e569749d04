"""The conformance suite of DESIGN.md, run over every registered scheme at the attention layer.

A new scheme registered in models/registry.py is covered here with no new test code.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.draws import normal
from models import lm
from models.layers import Attention, ModelConfig
from models.lm import DecoderLM
from models.registry import REGISTRY, Entry, make_scheme
from positional import attention as dispatch
from positional import vendor
from positional.logits import Bias
from positional.scheme import Scheme, position_values
from positional.softmax import Chunk

SCHEMES = sorted(REGISTRY) + ["rope+alibi", "so2_learned_qkv+alibi"]  # and composed with a bias
T = 12
RNG = jax.random.key(42)  # schemes with random features draw them from (RNG, row, position)
# Relative tolerance of fp32 comparisons: with the perturbed weights, TAPA's phases reach tens
# of radians, where fp32 rounding of the phase (~1e-7 relative) moves logits by ~1e-5.
RTOL = 2e-4


def tokens_of(x):
    """Token ids consistent with the inputs (schemes with learned per-token features read them)."""
    return (jnp.abs(x[..., 0]) * 1000).astype(jnp.int32) % 16


def make_layer(scheme, dtype="float32", window=0, sinks=False, chunk=0):
    cfg = ModelConfig(vocab_size=16, d_model=32, num_heads=4, num_kv_heads=2, scheme=scheme,
                      block_size=4, dtype=dtype, window=window, sinks=sinks, chunk=chunk)
    return Attention(cfg, rngs=nnx.Rngs(0))


def perturbed(params):
    """Every floating parameter moved by 0.3 N(0, 1), so that parts initialised to zero (learned
    step-angle tables, say) are exercised too."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(tree, [x + (0.3 * jax.random.normal(k, x.shape)).astype(x.dtype)
                                     if jnp.issubdtype(x.dtype, jnp.floating) else x
                                     for x, k in zip(leaves, keys)])


@functools.lru_cache(maxsize=None)
def forward(scheme, dtype="float32", window=0, sinks=False, chunk=0):
    """Perturbed parameters (`perturbed`: sink logits too) and a jitted (params, x, positions,
    segment_ids, impl) -> out."""
    graphdef, params = nnx.split(make_layer(scheme, dtype, window, sinks, chunk))
    params = perturbed(params)

    @functools.partial(jax.jit, static_argnames="impl")
    def apply(params, x, positions, segment_ids=None, impl="reference", tokens=None):
        layer = nnx.merge(graphdef, params)
        tokens = tokens_of(x) if tokens is None else tokens
        return layer(x, tokens=tokens, positions=positions, segment_ids=segment_ids, impl=impl, rng=RNG)

    @jax.jit
    def decode(params, x, cache, tokens):  # jitted: eager decoding compiles every op on its own
        return nnx.merge(graphdef, params).decode(x, cache, tokens=tokens, rng=RNG)

    @functools.partial(jax.jit, static_argnames="impl")
    def value_and_grads(params, x, positions, segment_ids, impl):
        """d/d(params, x) of sum(sin(out)), with out: one program per impl, forward and backward."""
        def loss(params, x):
            out = apply(params, x, positions, segment_ids, impl=impl)
            return jnp.sum(jnp.sin(out)), out
        return jax.value_and_grad(loss, (0, 1), has_aux=True)(params, x)

    apply.graphdef, apply.decode, apply.value_and_grads = graphdef, decode, value_and_grads
    scheme_ = nnx.merge(graphdef, params).scheme
    # Off a mesh "ring" is blockwise (tests/positional/test_ring.py runs it on one); "auto" on CPU is one of
    # the others; cuDNN and splash cannot run here (tests/positional/test_vendor.py runs their semantics).
    apply.impls = tuple(i for i in scheme_.impls if i not in ("ring", "auto", "cudnn", "splash"))
    apply.relative = scheme_.relative
    # Plain softmax after the scheme's transform: cuDNN's call can take it (run here by XLA).
    apply.plain = "cudnn" in scheme_.impls and not (scheme_.adds_bias or scheme_.has_score or sinks)
    return params, apply


def example(key=0, b=2, t=T, dtype=jnp.float32):
    x = normal(jax.random.key(key), (b, t, 32), dtype)
    return x, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_causal(scheme):
    params, apply = forward(scheme)
    x, pos = example()
    changed = x.at[:, 7:].set(normal(jax.random.key(9), x[:, 7:].shape))
    a, b = apply(params, x, pos), apply(params, changed, pos)
    np.testing.assert_allclose(a[:, :7], b[:, :7], atol=1e-6)
    assert not np.allclose(a[:, 7:], b[:, 7:])


# Every scheme whose attention takes a sliding window, and the window the window tests use (T = 12
# tokens, blocks of 4: the blockwise and fused forms skip whole blocks).
WINDOWED = [s for s in SCHEMES if REGISTRY[s.split("+")[0]].scheme_cls.generic_attention]
W = 3


# With sink logits (gpt-oss's: every generic scheme takes them), in `make test` one scheme of each
# kind of logit, and with a window; the others are slow.
FAST_SINKS = {"rope", "alibi", "fox", "tapa"}
SINK_CASES = [pytest.param(s, 0, True, marks=() if s in FAST_SINKS else pytest.mark.slow) for s in WINDOWED]
SINK_CASES.append(pytest.param("rope", W, True))


# Chunked local attention (Llama 4's): chunks of C = 5 over T = 12 tokens (a query sees 1 to 5
# keys; blocks of 4 straddle chunks). In `make test` a transport and a learned per-key bias; the
# others are slow (every one passed when chunks were added).
C = 5
FAST_CHUNKED = {"rope", "fox"}
CHUNK_CASES = [pytest.param(s, C, marks=() if s in FAST_CHUNKED else pytest.mark.slow) for s in WINDOWED]


@pytest.mark.parametrize("scheme,window,sinks", [(s, 0, False) for s in SCHEMES] + [(s, W, False) for s in WINDOWED]
                         + SINK_CASES + [pytest.param(s, -C, False) for s in ("rope", "fox")])
def test_decode_equals_parallel(scheme, window, sinks):
    """Decoding (a prefill of 5, then token by token) equals the parallel form; a negative window
    here is a chunk of that size."""
    window, chunk = max(window, 0), max(-window, 0)
    params, apply = forward(scheme, window=window, sinks=sinks, chunk=chunk)
    x, pos = example()
    layer = nnx.merge(apply.graphdef, params)
    cache = layer.scheme.init_cache(2, T + 3, layer.cfg.resolved_kv_heads)
    tokens = tokens_of(x)
    out, cache = apply.decode(params, x[:, :5], cache, tokens[:, :5])  # chunked prefill
    outs = [out]
    for t in range(5, T):  # then one token at a time
        out, cache = apply.decode(params, x[:, t:t + 1], cache, tokens[:, t:t + 1])
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), apply(params, x, pos), atol=2e-5, rtol=RTOL)


# generate's prefill in pieces (models.lm.prefill) against the whole prompt at once, in a one-layer
# LM of every scheme and in the Sessa and Mamba2 macro-blocks (whose caches are their own).
# In `make test` one scheme of each decode path (the generic cache, PaTH's own, random features,
# a windowed mask, a mixer's state); the others are slow (every one passed when this was added).
FAST_PREFILL = {("rope", "attention"), ("path_fox", "attention"), ("so2_random_qkv", "attention"),
                ("rope_lm_infinite", "attention"), ("rope", "sessa")}
PREFILL_CASES = [pytest.param(*case, 0, marks=() if case in FAST_PREFILL else pytest.mark.slow)
                 for case in [(scheme, "attention") for scheme in SCHEMES] + [("rope", "sessa"), ("rope", "mamba2")]]
PREFILL_CASES.append(pytest.param("fox", "attention", W))  # a ring buffer of W slots (with cached features)
PREFILL_CASES.append(pytest.param("rope", "attention", -C))  # (negative: a chunk) a ring of C slots, chunks as segments
PROMPT = 11


@pytest.mark.parametrize("scheme,mixer,window", PREFILL_CASES)
def test_chunked_prefill_equals_the_whole_prompt(scheme, mixer, window):
    """Pieces of 1 token and of 3 (multi-token decodes on a non-empty cache, then a last piece
    of 2) give the last prompt token's logits and every cache entry of the one-call prefill,
    and generate the same greedy tokens; a piece longer than the prompt is the one call."""
    cfg = ModelConfig(vocab_size=16, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2, scheme=scheme,
                      block_size=4, mixer=mixer, window=max(window, 0), chunk=max(-window, 0))
    graphdef, params = nnx.split(DecoderLM(cfg, rngs=nnx.Rngs(0)))
    params = perturbed(params)
    prompt = jax.random.randint(jax.random.key(3), (2, PROMPT), 0, 16)

    # One program for every piece size, lightly optimised: compiling it takes most of the time.
    @functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})
    def run(params, prompt):
        model = nnx.merge(graphdef, params)
        return [(lm.prefill(model, prompt, model.init_cache(2, PROMPT + 2), rng=RNG, chunk=chunk),
                 lm.generate(model, prompt, 2, rng=RNG, prefill_chunk=chunk)) for chunk in (None, 1, 3, PROMPT + 5)]

    (want, want_tokens), *pieces = run(params, prompt)
    for got, tokens in pieces:
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-5, rtol=RTOL)
        np.testing.assert_array_equal(tokens, want_tokens)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_packing_equals_separate_runs(scheme):
    params, apply = forward(scheme)
    x, _ = example(b=1)
    lengths = (5, 7)
    segments = jnp.asarray([[1] * 5 + [2] * 7])
    positions = jnp.asarray([list(range(5)) + list(range(7))])
    packed = apply(params, x, positions, segments)
    start = 0
    for n in lengths:
        alone = apply(params, x[:, start:start + n], positions[:, start:start + n])
        np.testing.assert_allclose(packed[:, start:start + n], alone, atol=2e-5, rtol=RTOL)
        start += n


def cudnn_by_xla(q, k, v, *, segment_ids=None, q_offset=0, scale=None, bias_fn=None, score_fn=None,
                 block_size=None, window=None):
    """The jax.nn.dot_product_attention call of impl "cudnn", with jax's XLA implementation."""
    assert bias_fn is None and score_fn is None
    return vendor.cudnn_call(q, k, v, segment_ids=segment_ids, q_offset=q_offset, scale=scale, implementation="xla",
                             window=window)


# With a window, in `make test` one scheme of each kind of logit (a transport under plain softmax,
# a fixed bias, a learned per-key bias, a score, a mask of its own); the others are slow (every
# one passed when windows were added).
FAST_WINDOWED = {"rope", "alibi", "fox", "tapa", "rope_lm_infinite"}
WINDOW_CASES = [(s, 0, False) for s in SCHEMES] + [
    pytest.param(s, W, False, marks=() if s in FAST_WINDOWED else pytest.mark.slow) for s in WINDOWED]


@pytest.mark.parametrize("scheme,window,sinks", WINDOW_CASES + SINK_CASES)
def test_implementations_agree_values_and_gradients(scheme, window, sinks, monkeypatch):
    """Every impl against the reference (the fused kernel in the interpreter; for plain softmax
    cuDNN's call, by XLA), GQA, two segments in one row, and a length that is not a multiple
    of the block (4); with and without a sliding window, and sink logits (their gradient too)."""
    params, apply = forward(scheme, window=window, sinks=sinks)
    x, pos = example(t=T + 1)
    seg = jnp.asarray([[1] * 6 + [2] * 7, [1] * (T + 1)])
    monkeypatch.setitem(dispatch.IMPLEMENTATIONS, "cudnn", cudnn_by_xla)
    impls = apply.impls + (("cudnn",) if apply.plain else ())
    results = {impl: apply.value_and_grads(params, x, pos, seg, impl=impl) for impl in impls}
    (_, ref_out), ref_grads = results.pop("reference")
    # fp32 rounding relative to the output's scale: TAPA's phase moves logits by ~1e-5 (RTOL), which
    # an output near 0 in a row of outputs ~10 sees whole; a wrong mask or weight moves one by O(0.1).
    scale = max(1.0, float(np.abs(ref_out).max()))
    for (_, out), grads in results.values():
        np.testing.assert_allclose(out, ref_out, atol=2e-5 * scale, rtol=RTOL)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):  # per parameter, in norm
            assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-6, (a, b)


@pytest.mark.parametrize("scheme,chunk", CHUNK_CASES)
def test_chunked_attention_values_and_gradients(scheme, chunk):
    """Chunked local attention: blockwise (whose query blocks of 4 straddle chunks of 5, two
    segments in a row) against the reference in values and gradients; each output reads its own
    chunk up to itself and nothing before the chunk; the fused forms refuse in one line."""
    params, apply = forward(scheme, chunk=chunk)
    assert apply.impls == ("reference", "blockwise")  # auto, ring and the vendors left out here
    x, pos = example(t=T + 1)
    seg = jnp.asarray([[1] * 6 + [2] * 7, [1] * (T + 1)])
    (_, ref_out), ref_grads = apply.value_and_grads(params, x, pos, seg, impl="reference")
    (_, out), grads = apply.value_and_grads(params, x, pos, seg, impl="blockwise")
    scale = max(1.0, float(np.abs(ref_out).max()))
    np.testing.assert_allclose(out, ref_out, atol=2e-5 * scale, rtol=RTOL)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-6, (a, b)
    x, pos = example()
    for changed_upto in (3, 7):  # tokens 0..changed_upto-1 changed: chunks [0, 5), [5, 10), [10, 12)
        changed = x.at[:, :changed_upto].set(normal(jax.random.key(9), x[:, :changed_upto].shape))
        a, b = apply(params, x, pos), apply(params, changed, pos)
        first_free = -(-changed_upto // C) * C  # the first chunk wholly after the change
        np.testing.assert_allclose(a[:, first_free:], b[:, first_free:], atol=2e-5, rtol=RTOL)
        assert not np.allclose(a[:, changed_upto:first_free], b[:, changed_upto:first_free])
    with pytest.raises(ValueError, match=r"^impl 'pallas' takes no chunked window; use one of reference, blockwise"):
        dispatch.attention(x.reshape(2, T, 4, 8), x.reshape(2, T, 4, 8), x.reshape(2, T, 4, 8), impl="pallas",
                           window=Chunk(C))


@pytest.mark.parametrize("scheme", WINDOWED)
def test_window_reads_only_the_window(scheme):
    """With a sliding window of W, a layer's output at t does not depend on the tokens before
    t - W + 1 (their keys are masked, and no scheme's features carry them further: SO(2)'s
    angles and FoX's gates between key and query lie inside the window: only their rounding
    sees the tokens before), but does on those in it."""
    params, apply = forward(scheme, window=W)
    x, pos = example()
    changed = x.at[:, :3].set(normal(jax.random.key(9), x[:, :3].shape))
    a, b = apply(params, x, pos), apply(params, changed, pos)
    np.testing.assert_allclose(a[:, 3 + W - 1:], b[:, 3 + W - 1:], atol=2e-5, rtol=RTOL)
    assert not np.allclose(a[:, 3:3 + W - 1], b[:, 3:3 + W - 1])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_vmap(scheme):
    params, apply = forward(scheme)
    x, pos = example(b=1)
    xs = jnp.stack([x, 2 * x])
    batched = jax.vmap(lambda x: apply(params, x, pos))(xs)
    want = np.asarray(apply(params, 2 * x, pos))
    # Batched, XLA may order fp32 sums differently (so2_hidden's scans over time, jax 0.12: up
    # to 5e-6 of the output's scale); a batching bug is O(1).
    np.testing.assert_allclose(batched[1], want, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_bf16_is_finite_and_close(scheme):
    params16, apply16 = forward(scheme, "bfloat16")
    params, apply = forward(scheme)
    x, pos = example()
    # A quarter of unit scale keeps logits O(1): at the perturbed weights' full scale TAPA's
    # phases reach tens of radians, where bf16 rounding of q (0.4%) moves a cosine by O(1).
    x = 0.25 * x
    ref = np.asarray(apply(params, x, pos))
    for impl in ("reference", "pallas") if "pallas" in apply.impls else apply.impls:  # blockwise: test_precision.py
        out16 = apply16(params16, x.astype(jnp.bfloat16), pos, impl=impl, tokens=tokens_of(x))
        assert out16.dtype == jnp.bfloat16
        assert np.isfinite(np.asarray(out16, np.float32)).all()
        assert np.abs(np.asarray(out16, np.float32) - ref).max() <= 0.02 * np.abs(ref).max()


def shift_error(scheme) -> float:
    """Largest change of the layer's output when every position moves by 1000."""
    params, apply = forward(scheme)
    x, pos = example()
    return float(np.abs(apply(params, x, pos + 1000) - apply(params, x, pos)).max())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_shift_invariance_of_relative_schemes(scheme):
    if not forward(scheme)[1].relative:
        pytest.skip(f"{scheme} is not a relative scheme")
    assert shift_error(scheme) <= 5e-4


@dataclasses.dataclass(frozen=True)
class AbsoluteBias(Scheme):
    """A deliberately absolute bias (it reads the key's position alone), declared relative."""
    has_bias = bias_only = True

    def bias_fn(self, features, positions):
        return Bias(lambda q, k, qi, kj: jnp.cos(k.get("position", kj) * 1.0), position_values(positions))


def test_shift_check_sees_an_absolute_bias(monkeypatch):
    monkeypatch.setitem(REGISTRY, "absolute_bias", Entry(AbsoluteBias))
    assert shift_error("absolute_bias") > 1e-2
    assert shift_error("rope+absolute_bias") > 1e-2


def qkv(key=0, b=2, t=T):
    q = normal(jax.random.key(key), (b, t, 4, 8))
    k, v = normal(jax.random.key(key + 1), (2, b, t, 2, 8))
    return q, k, v, jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))


def needs_key(scheme) -> bool:
    return any(p.random_features or p.default_key for p in (scheme, *scheme.biases))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_notebook_call_needs_no_model(scheme):
    """`make_scheme(name).attend(q, k, v, positions=...)`: default features, no model; a scheme
    whose features are random asks for a key in one line, and a key makes the call
    deterministic."""
    s = make_scheme(scheme, num_heads=4, head_dim=8)
    q, k, v, pos = qkv()
    attend = jax.jit(lambda q, k, v, pos, key: s.attend(q, k, v, positions=pos, key=key))
    out = attend(q, k, v, pos, jax.random.key(1))
    assert out.shape == q.shape and np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(out, attend(q, k, v, pos, jax.random.key(1)))
    later = attend(q, k, v.at[:, 7:].set(0.0), pos, jax.random.key(1))  # causal
    np.testing.assert_allclose(later[:, :7], out[:, :7], atol=1e-6)
    if s.relative:
        np.testing.assert_allclose(attend(q, k, v, pos + 1000, jax.random.key(1)), out, atol=5e-4)
    weights = s.weights(q, k, v, positions=pos, key=jax.random.key(1))
    assert weights.shape == (2, 2, 2, T, T)
    if needs_key(s):
        with pytest.raises(ValueError, match=r"pass a key \(key=") as err:
            s.attend(q, k, v, positions=pos)
        assert "\n" not in str(err.value)
    else:
        np.testing.assert_allclose(s.attend(q, k, v, positions=pos), out, atol=1e-6)


# Every registered scheme that reads features, and a composition: the default features (none
# given: a notebook call) have the names, shapes and dtypes of the layer's features at
# initialisation; and, where its entry says so, the same values on a zero input (those whose
# defaults are drawn from the call's key say not: PaTH's directions, KERPLE's r1 and r2).
WITH_FEATURES = [name for name, entry in REGISTRY.items() if entry.scheme_cls.needs_features] + ["rope+fox"]


def _shapes(tree):
    return jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), tree)


@pytest.mark.parametrize("scheme", WITH_FEATURES)
def test_default_features_are_the_layers_at_initialisation(scheme):
    layer = make_layer(scheme)
    q, k, v, pos = qkv()
    features = layer.project(jnp.zeros((2, T, 32)), pos % 16, pos, rng=RNG)[3]
    default = layer.scheme.features_or_default(None, q, k, positions=pos, key=RNG)
    internal = {"w_in"}  # PaTH's convolution input, kept for the decode cache only
    assert _shapes(default) == _shapes({name: x for name, x in features.items() if name not in internal})
    if REGISTRY[scheme.split("+")[0]].features_at_init:
        np.testing.assert_allclose(layer.scheme.attend(q, k, v, positions=pos, key=RNG),
                                   layer.scheme.attend(q, k, v, features, positions=pos), atol=1e-6)
