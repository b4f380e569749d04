"""The decoder LM: causality, KV-cache decoding exact against the parallel forward, generate."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import layers
from lab.state import check_windows
from models import lm
from models.lm import DecoderLM, ModelConfig, generate
from models.registry import REGISTRY

V = 40


def model(scheme="rope", **kw):
    cfg = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      scheme=scheme, block_size=8, **kw)
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


def tokens(t=14, b=2, seed=1):
    return jax.random.randint(jax.random.key(seed), (b, t), 0, V)


def jitted(m):
    """m's forward (tokens, rng=None) and decode (tokens, cache, rng=None), jitted: called
    eagerly, every op compiles on its own, which takes most of these tests' time."""
    graphdef, state = nnx.split(m)
    forward = jax.jit(lambda state, x, rng=None: nnx.merge(graphdef, state)(x, rng=rng))
    decode = jax.jit(lambda state, x, cache, rng=None: nnx.merge(graphdef, state).decode(x, cache, rng))
    return functools.partial(forward, state), functools.partial(decode, state)


def test_model_is_causal():
    m = model()
    forward, _ = jitted(m)
    x = tokens()
    y = x.at[:, 9:].set((x[:, 9:] + 1) % V)
    a, b = forward(x), forward(y)
    np.testing.assert_allclose(a[:, :9], b[:, :9], atol=1e-6)
    assert not np.allclose(a[:, 9:], b[:, 9:])


@pytest.mark.parametrize("scheme", sorted(REGISTRY))
def test_decode_equals_parallel_forward(scheme):
    m = model(scheme)
    forward, decode = jitted(m)
    x = tokens()
    rng = jax.random.key(5)  # used by schemes with random features, the same for the whole sequence
    parallel = forward(x, rng=rng)
    cache = m.init_cache(2, 20)
    logits, cache = decode(x[:, :6], cache, rng)  # prefill
    steps = [logits]
    for t in range(6, x.shape[1]):
        logits, cache = decode(x[:, t:t + 1], cache, rng)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), parallel, atol=5e-5)
    assert int(cache[0]["index"]) == x.shape[1]


@pytest.mark.parametrize("tie", [True, False])
def test_greedy_generate_is_argmax_of_the_parallel_forward(tie):
    m = model(tie_embeddings=tie)
    forward, _ = jitted(m)
    prompt = tokens(t=5)
    out = generate(m, prompt, 6)
    assert out.shape == (2, 11)
    np.testing.assert_array_equal(out[:, :5], prompt)
    seq = prompt
    for _ in range(6):  # the slow way: rerun the whole prefix, take the argmax
        seq = jnp.concatenate([seq, jnp.argmax(forward(seq)[:, -1], -1)[:, None].astype(seq.dtype)], 1)
    np.testing.assert_array_equal(out, seq)


def test_sampling_is_reproducible_and_depends_on_the_key():
    m = model()
    prompt = tokens(t=3)
    a = generate(m, prompt, 12, rng=jax.random.key(1), temperature=1.0)
    b = generate(m, prompt, 12, rng=jax.random.key(1), temperature=1.0)
    c = generate(m, prompt, 12, rng=jax.random.key(2), temperature=1.0)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert int(a.min()) >= 0 and int(a.max()) < V


def test_sampling_follows_the_model_distribution():
    """Many one-token samples at temperature 1 match softmax(logits) of the last position."""
    m = model()
    prompt = jnp.tile(tokens(t=4, b=1), (2000, 1))
    out = generate(m, prompt, 1, rng=jax.random.key(3), temperature=1.0)[:, -1]
    p = jax.nn.softmax(m(prompt[:1])[0, -1])
    freq = np.bincount(np.asarray(out), minlength=V) / len(out)
    assert np.abs(freq - p).max() < 4 * np.sqrt(p.max() / len(out)) + 1e-3


def test_bad_model_inputs():
    m = model()
    with pytest.raises(ValueError, match="too long for the cache"):
        generate(m, tokens(t=5), 10, max_len=12)
    cache = m.init_cache(2, 6)
    _, cache = m.decode(tokens(t=5), cache)
    with pytest.raises(ValueError, match="5 cached \\+ 2 new tokens > cache length 6"):
        m.decode(tokens(t=2), cache)
    with pytest.raises(ValueError, match="rng"):
        generate(m, tokens(t=5), 2, temperature=0.7)
    for chunk in (0, -3, 2.5, True, "4"):
        with pytest.raises(ValueError, match=r"^prefill_chunk=.+ must be an int >= 1 \(prompt tokens per ") as err:
            generate(m, tokens(t=5), 2, prefill_chunk=chunk)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="registered schemes"):
        model("spiral")
    with pytest.raises(ValueError, match="even"):
        model(head_dim=7)
    with pytest.raises(ValueError, match="multiple"):
        DecoderLM(ModelConfig(d_model=32, num_heads=4, num_kv_heads=3), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown model config"):
        ModelConfig.from_dict({"d_modle": 3})


# Per-layer attention (models/layers.py): Gemma-style local layers (a window and a RoPE base of
# their own) among global ones, NoPE layers (RNoPE-SWA), a learned scheme in one layer only.
KINDS = {"local": {"window": 4, "scheme_options": {"base": 100.0}}, "global": {"scheme": "nope"},
         "learned": {"scheme": "so2_learned_qk", "window": 5}}


def layered(pattern="local*2,global", overrides="", num_layers=4, **kw):
    cfg = ModelConfig.from_dict(dict(vocab_size=V, d_model=32, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                                     block_size=8, scheme_options={"base": 1e4}, layer_kinds=KINDS,
                                     layer_pattern=pattern, layer_overrides=overrides, **kw))
    return DecoderLM(cfg, rngs=nnx.Rngs(0))


def test_each_layer_has_its_kind():
    m = layered(num_layers=7, overrides="0=learned")
    got = [(b.attn.scheme.__class__.__name__, b.attn.scheme.sliding_window, getattr(b.attn.scheme, "base", None))
           for b in m.blocks]
    # The pattern repeats and is cut at the seventh layer; layer 0 is overridden.
    assert got == [("SO2", 5, None), ("Rope", 4, 100.0), ("NoPE", 0, None), ("Rope", 4, 100.0), ("Rope", 4, 100.0),
                   ("NoPE", 0, None), ("Rope", 4, 100.0)]
    assert [m.cfg.layer_kind(i) for i in range(7)] == ["learned", "local", "global", "local", "local", "global",
                                                       "local"]
    # Only the learned layer holds the learned step-angle table; the model's own options apply
    # to a layer of its scheme whose kind sets none.
    assert m.blocks[0].attn.features is not None and all(b.attn.features is None for b in m.blocks[1:])
    assert layered(pattern="").blocks[0].attn.scheme.base == 1e4


def test_layered_decode_equals_parallel_past_the_windows():
    m = layered(overrides="3=learned")
    forward, decode = jitted(m)
    x = tokens(t=14)
    parallel = forward(x)
    cache = m.init_cache(2, 20)
    # Windowed layers keep a ring buffer of their window (4, 4, the learned one's 5); the global one 20.
    assert [c["k"].shape[1] for c in cache] == [4, 4, 20, 5] and lm.cache_len(cache) == 20
    logits, cache = decode(x[:, :6], cache)  # a prefill longer than the rings
    steps = [logits]
    for t in range(6, x.shape[1]):
        logits, cache = decode(x[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), parallel, atol=5e-5)
    # The windows act: the same model without them gives other logits past the window.
    full = layered(pattern="")
    assert not np.allclose(jitted(full)[0](x)[:, 6:], parallel[:, 6:], atol=1e-3)


def test_a_windowed_model_decodes_past_max_len_in_bounded_memory():
    """Every layer windowed: the cache is W slots a layer, whatever max_len, and decoding goes on
    past it, equal to the parallel forward."""
    m = model(window=3)
    forward, decode = jitted(m)
    x = tokens(t=14)
    cache = m.init_cache(2, 5)
    assert [c["k"].shape[1] for c in cache] == [3, 3] and lm.cache_len(cache) == float("inf")
    steps = []
    for t in range(0, 14, 2):
        logits, cache = decode(x[:, t:t + 2], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), forward(x), atol=5e-5)


def test_the_layer_experiment_arms_are_as_documented():
    """configs/layers.py: 12 layers each; the windowed RoPE layers and the global ones in the
    papers' ratios (RNoPE-SWA 3:1 with NoPE globals, Gemma 5:1 with bases 10K and 1M)."""
    layouts = {}
    for arm in layers.VARIANTS:
        c = layers.get_config(arm)
        check_windows(c)
        cfg = ModelConfig.from_dict({**c.model.to_dict(), "vocab_size": V})
        layouts[arm] = [(a.scheme, dict(a.scheme_options).get("base", 1e4), a.window) for a in cfg.layers]
    local = swa = ("rope", 1e4, 64)
    assert layouts == {"rope": [("rope", 1e4, 0)] * 12, "nope": [("nope", 1e4, 0)] * 12, "rope_swa": [swa] * 12,
                       "rnope_swa": ([swa] * 3 + [("nope", 1e4, 0)]) * 3,
                       "local_global": ([local] * 5 + [("rope", 1e6, 0)]) * 2}


def test_the_probes_attention_maps_are_each_layers_own():
    """attention_internals (what the probes and logit analyses read) on a model whose layers
    differ, with sinks: each layer's weights under its own window (nothing outside it), rows
    summing to less than 1 (the sink's share), and weights x values through the output
    projection give the layer's output."""
    m = layered(sinks=True)
    for block in m.blocks:
        block.attn.sink[...] = jnp.full(block.attn.sink[...].shape, 0.5)
    x = tokens(t=12)
    layers = lm.attention_internals(m, x)
    for i, (block, layer) in enumerate(zip(m.blocks, layers)):
        w = np.asarray(layer["weights"])  # [B, H, T, T]
        window = block.attn.scheme.sliding_window or 12
        far = np.arange(12)[:, None] - np.arange(12)[None, :] >= window
        assert (w[..., far] == 0).all() and (w.sum(-1) < 1 - 1e-3).all(), i
        if block.attn.scheme.__class__.__name__ in ("Rope", "NoPE"):  # values untransformed
            v = jnp.repeat(layer["v"], 2, axis=2)  # per query head
            heads = jnp.einsum("bhts,bshd->bthd", w, v).reshape(2, 12, -1)
            np.testing.assert_allclose(block.attn.o(heads), layer["out"], atol=2e-5)


def test_bad_layer_patterns_say_what_to_do():
    cases = [(dict(pattern="local,glob"), r"^model.layer_pattern names the layer kind 'glob', which model.layer_kinds "
                                          r"does not define \(defined: global, learned, local\); define it"),
             (dict(pattern="local*0"), r"^model.layer_pattern item 'local\*0': the count after '\*' must be"),
             (dict(overrides="9=local"), r"^model.layer_overrides item '9=local' must be <layer>=<kind> with a layer "
                                         r"from 0 to 3"),
             (dict(layer_kinds={"local": {"scheme": "spiral"}}), r"^model.layer_kinds.local.scheme \(layer 0\): "
                                                                 r"unknown position scheme 'spiral'"),
             (dict(layer_kinds={"local": {"windw": 3}}), r"^model.layer_kinds.local has unknown field\(s\) \['windw'\]"),
             (dict(layer_kinds={"local": {"window": -2}}), r"^model.layer_kinds.local.window=-2 \(layer 0\) must be "
                                                           r"an int >= 0"),
             (dict(layer_kinds={"local": {"scheme": "path", "window": 4}}), r"^model.layer_kinds.local.window=4 \(layer 0\): "
                                                                            r"scheme 'path' brings its own attention"),
             (dict(mixer="sessa"), r"^model.layer_pattern / layer_overrides set the attention of each layer"),
             (dict(pattern="", mixer="sessa", window=4), r"^model.window=4: the sliding window is the attention blocks'")]
    for kw, message in cases:
        args = {"pattern": kw.pop("pattern", "local*2,global"), "overrides": kw.pop("overrides", "")}
        if "layer_kinds" in kw:
            kw["layer_kinds"] = {**KINDS, **kw["layer_kinds"]}
            with pytest.raises(ValueError, match=message) as err:
                cfg = ModelConfig.from_dict(dict(vocab_size=V, d_model=32, num_layers=4, num_heads=4,
                                                 layer_pattern=args["pattern"], **kw))
                DecoderLM(cfg, rngs=nnx.Rngs(0))
        else:
            with pytest.raises(ValueError, match=message) as err:
                layered(**args, **kw)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("head", ["tied", "tied_unscaled", "untied"])
def test_a_large_vocabulary_is_scored_in_chunks_of_entries_and_positions_with_the_same_numbers(monkeypatch, head):
    """token_nll past VOCAB_PER_CHUNK entries scores the vocabulary in chunks (a running
    log-sum-exp over a scan, the last chunk overlapping the one before), and past
    LOGITS_PER_CHUNK logits a row of one chunk also chunks of positions (lax.map); each chunk is
    recomputed in the backward pass. The NLL, its weights and every gradient equal the
    unchunked computation's, for a tied (scaled or not) and an untied head; targets at the
    chunks' edges and in the overlap included."""
    import models.lm as lm
    cfg = ModelConfig(vocab_size=301, d_model=32, num_layers=2, num_heads=2, scheme="rope",
                      tie_embeddings=head != "untied", scale_tied_logits=head == "tied")
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 65), 0, 301).at[0, 1:7].set(jnp.asarray([0, 100, 101, 200, 201, 300]))
    segments = jnp.asarray(np.repeat([[1] * 40 + [2] * 25], 2, 0))

    def run():
        def loss(m):
            nll, w = lm.token_nll(m, tokens, segment_ids=segments)
            return jnp.sum(nll * w), (nll, w)
        (_, (nll, w)), grads = nnx.value_and_grad(loss, has_aux=True)(model)
        return nll, w, jax.tree.leaves(nnx.state(grads))

    assert lm.vocab_chunk(301) == 301 and lm.logits_chunk(64, 301) == 64
    whole = run()
    monkeypatch.setattr(lm, "VOCAB_PER_CHUNK", 128)
    assert lm.vocab_chunk(301) == 101 and lm.vocab_chunk(256) == 128 and lm.logits_chunk(64, 301) == 64
    entries = run()
    monkeypatch.setattr(lm, "LOGITS_PER_CHUNK", 101 * 8)
    assert lm.logits_chunk(64, 301) == 8 and lm.logits_chunk(63, 301) == 63
    both = run()
    for parts in (entries, both):
        np.testing.assert_allclose(parts[0], whole[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(parts[1], whole[1])
        for a, b in zip(parts[2], whole[2]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())  # fp32 sums in another order


@pytest.mark.parametrize("qk_norm", ["head", "projection"])
def test_qk_norm_normalises_queries_and_keys_before_the_scheme(qk_norm):
    """RMS norm of q and k (learned scale, here perturbed) per head or over the projection, before
    RoPE; the decode path too."""
    m = model(qk_norm=qk_norm)
    attn = m.blocks[0].attn
    attn.q_norm.scale[...] = attn.q_norm.scale[...] * 1.5
    x = jax.random.normal(jax.random.key(0), (2, 5, 32))
    graphdef, state = nnx.split(attn)
    q, k, q_raw, k_raw = jax.jit(lambda state, x: (lambda a: (*a.project(x, None, None)[:2], a.q(x), a.k(x)))(
        nnx.merge(graphdef, state)))(state, x)

    def rms(a, axes):
        return a / jnp.sqrt(jnp.mean(a * a, axis=axes, keepdims=True) + 1e-6)

    if qk_norm == "head":
        want_q = rms(q_raw.reshape(2, 5, 4, 8), -1) * 1.5
        want_k = rms(k_raw.reshape(2, 5, 2, 8), -1)
    else:
        want_q = (rms(q_raw, -1) * 1.5).reshape(2, 5, 4, 8)
        want_k = rms(k_raw, -1).reshape(2, 5, 2, 8)
    np.testing.assert_allclose(q, want_q, atol=1e-5)
    np.testing.assert_allclose(k, want_k, atol=1e-5)
    forward, decode = jitted(m)
    x = tokens()
    logits, cache = decode(x[:, :6], m.init_cache(2, 20))
    last, _ = decode(x[:, 6:7], cache)
    np.testing.assert_allclose(jnp.concatenate([logits, last], 1), forward(x)[:, :7], atol=5e-5)
    with pytest.raises(ValueError, match=r"^model.qk_norm='both'; valid: none, head, projection"):
        ModelConfig(qk_norm="both")


@pytest.mark.parametrize("norms", ["post", "sandwich"])
def test_block_norms_offset_geglu_scaled_embeddings_and_query_scale(norms):
    """OLMo 2's norms after each sublayer and Gemma's before and after, written out by hand from
    the sublayers; Gemma's norm scale 1 + w (w from 0), GeGLU, embeddings times sqrt(d_model),
    logits q.k / sqrt(scale_dim); decoding equals the parallel forward, and attention_internals
    adds to the stream what the block adds."""
    m = model(norms=norms, norm_offset=1.0, mlp_act="gelu_tanh", embed_scale=True, scale_dim=5, qk_norm="head")
    blk = m.blocks[0]
    assert float(jnp.abs(blk.attn_norm.scale[...]).max()) == 0.0  # the offset's scale starts at 0
    for norm in (blk.attn_norm, blk.mlp_norm, blk.attn_post_norm, blk.mlp_post_norm):
        if norm is not None:
            norm.scale[...] = 0.3 * jax.random.normal(jax.random.key(3), norm.scale.shape)
    x = tokens()
    stream = m.embed.embedding[...][x] * 32 ** 0.5
    np.testing.assert_allclose(m.embed_tokens(x), stream, rtol=1e-6)

    def rms(a, scale):
        return a / jnp.sqrt(jnp.mean(a * a, -1, keepdims=True) + 1e-6) * (1 + scale[...])

    def mlp(h):
        return blk.mlp.down(jax.nn.gelu(blk.mlp.gate(h), approximate=True) * blk.mlp.up(h))

    def attn(h):
        return blk.attn(h, tokens=x, positions=jnp.broadcast_to(jnp.arange(14), (2, 14)), impl="reference")

    if norms == "post":
        h = stream + rms(attn(stream), blk.attn_norm.scale)
        want = h + rms(mlp(h), blk.mlp_norm.scale)
    else:
        h = stream + rms(attn(rms(stream, blk.attn_norm.scale)), blk.attn_post_norm.scale)
        want = h + rms(mlp(rms(h, blk.mlp_norm.scale)), blk.mlp_post_norm.scale)
    np.testing.assert_allclose(blk(stream, tokens=x, positions=jnp.broadcast_to(jnp.arange(14), (2, 14)),
                                   impl="reference"), want, atol=1e-4)
    np.testing.assert_allclose(lm.attention_internals(m, x)[0]["out"], h - stream, atol=1e-4)
    # scale_dim 5: the scheme sees queries times sqrt(head_dim / 5) = sqrt(8 / 5).
    q = blk.attn.project(stream, x, None)[0]
    np.testing.assert_allclose(q, blk.attn.q_norm(blk.attn.q(stream).reshape(2, 14, 4, 8)) * (8 / 5) ** 0.5,
                               rtol=1e-5, atol=1e-6)
    forward, decode = jitted(m)
    logits, cache = decode(x[:, :6], m.init_cache(2, 20))
    last, _ = decode(x[:, 6:7], cache)
    np.testing.assert_allclose(jnp.concatenate([logits, last], 1), forward(x)[:, :7], atol=5e-5)


def test_bad_block_fields_get_one_line():
    for field, value, message in (("norms", "middle", r"model.norms='middle'; valid: pre, post, sandwich"),
                                  ("mlp_act", "relu", r"model.mlp_act='relu'; valid: silu, gelu_tanh"),
                                  ("scale_dim", -1, r"model.scale_dim=-1 must be >= 0")):
        with pytest.raises(ValueError, match="^" + message) as err:
            ModelConfig(**{field: value})
        assert "\n" not in str(err.value)


def test_llama4_irope_chunked_rope_layers_and_a_tempered_nope_layer():
    """Llama 4's pattern as a config: three RoPE layers in chunks of 4 tokens, then a global NoPE
    layer with the position-dependent query temperature; decoding (a ring buffer of 4 slots in
    the chunked layers) equals the parallel forward past two chunk boundaries, with a prefill
    that ends inside a chunk, and a layer cannot take a window and a chunk at once."""
    kinds = {"local": {"chunk": 4}, "global": {"scheme": "nope_temperature",
                                               "scheme_options": {"floor_scale": 4, "attn_scale": 0.5}}}
    cfg = ModelConfig.from_dict(dict(vocab_size=V, d_model=32, num_layers=4, num_heads=4, num_kv_heads=2, block_size=8,
                                     layer_kinds=kinds, layer_pattern="local*3,global"))
    m = DecoderLM(cfg, rngs=nnx.Rngs(0))
    assert [(b.attn.scheme.attention_chunk, type(b.attn.scheme).__name__) for b in m.blocks] == [
        (4, "Rope")] * 3 + [(0, "TemperedNoPE")]
    forward, decode = jitted(m)
    x = tokens()
    assert [c["k"].shape[1] for c in m.init_cache(2, 14)] == [4, 4, 4, 14]
    logits, cache = decode(x[:, :3], m.init_cache(2, 14))
    steps = [logits]
    for t in range(3, 14):
        logits, cache = decode(x[:, t:t + 1], cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps, 1), forward(x), atol=5e-5)
    with pytest.raises(ValueError, match=r"^model.layer_kinds.local \(layer 0\): window=3 and chunk=4; a layer takes "
                                         r"one of the two"):
        ModelConfig.from_dict(dict(layer_kinds={"local": {"chunk": 4, "window": 3}}, layer_pattern="local"))
