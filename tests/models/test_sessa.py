"""The Sessa macro-block and its mixers: decode == parallel, SSD chunked == sequential scan,
packing, the end-to-end Jacobian tail, parameter matching and bad input."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers.draws import normal
from models import lm, sessa
from models.lm import DecoderLM, ModelConfig


def _config(mixer, **kw):
    return ModelConfig(vocab_size=11, d_model=16, num_layers=2, num_heads=2, mixer=mixer, **kw)


def _forward(model):
    graphdef, state = nnx.split(model)
    return jax.jit(lambda state, tokens, seg=None: nnx.merge(graphdef, state)(tokens, segment_ids=seg)), state


def test_ssd_chunked_matches_the_sequential_scan():
    k = jax.random.split(jax.random.key(0), 5)
    x = normal(k[0], (2, 37, 3, 4))
    log_a = -jax.nn.softplus(normal(k[1], (2, 37, 3)))
    b, c = normal(k[2], (2, 37, 5)), normal(k[3], (2, 37, 5))
    h0 = normal(k[4], (2, 3, 4, 5))
    y_seq, h_seq = jax.jit(sessa.ssd_sequential)(x, log_a, b, c, h0)
    y_chunk, h_chunk = jax.jit(sessa.ssd_chunked, static_argnames="chunk")(x, log_a, b, c, h0, chunk=8)
    np.testing.assert_allclose(y_chunk, y_seq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h_chunk, h_seq, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixer", ["sessa", "mamba2"])
def test_decode_matches_parallel(mixer):
    model = DecoderLM(_config(mixer), rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, 11)
    forward, state = _forward(model)
    full = forward(state, tokens)
    graphdef, _ = nnx.split(model)
    decode = jax.jit(lambda state, tokens, cache: nnx.merge(graphdef, state).decode(tokens, cache))
    cache, pieces, index = model.init_cache(2, 16), [], 0
    for n in (6, 1, 6):  # prefill, one step, a chunked prefill
        logits, cache = decode(state, tokens[:, index:index + n], cache)
        pieces.append(logits)
        index += n
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), full, rtol=1e-4, atol=1e-4)


def test_blocked_solve_and_packing_in_the_model():
    """The blocked solve and the Pallas kernel (interpreted) give the reference's logits on a
    packed row, and packed sequences equal separate runs."""
    tokens = jax.random.randint(jax.random.key(2), (1, 20), 0, 11)
    seg = jnp.array([[1] * 8 + [2] * 12])
    outs = {}
    for solve in ("reference", "pallas", "blocked"):
        cfg = _config("sessa", mixer_options=(("solve", solve), ("solve_block", 8)))
        forward, state = _forward(DecoderLM(cfg, rngs=nnx.Rngs(0)))
        outs[solve] = forward(state, tokens, seg)
    for solve in ("blocked", "pallas"):
        np.testing.assert_allclose(outs[solve], outs["reference"], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(outs["reference"][:, 8:], forward(state, tokens[:, 8:]), rtol=1e-4, atol=1e-4)


def _uniform_block(mixer, gamma):
    """One macro-block whose forward and feedback attention both route uniformly, constant gamma."""
    cfg = ModelConfig(d_model=8, num_layers=1, num_heads=1, mixer=mixer, scheme="nope")
    block = sessa.MacroBlock(cfg, rngs=nnx.Rngs(3))
    mixer = block.mixer
    for layer in (mixer.attn.q, mixer.attn.k):
        layer.kernel[...] = jnp.zeros_like(layer.kernel[...])
    if mixer.feedback:
        mixer.qk_b.kernel[...] = jnp.zeros_like(mixer.qk_b.kernel[...])
        mixer.qk_b.bias[...] = jnp.zeros_like(mixer.qk_b.bias[...])
        mixer.w_g.kernel[...] = jnp.zeros_like(mixer.w_g.kernel[...])
        mixer.b_g[...] = jnp.arctanh(gamma / mixer.gamma_max)
    return block


def _jacobian_tail_slope(block, t=96):
    """Log-log slope of ||dy_t / dx_0|| over lags 16..t-1 (x_0 is the source)."""
    x = normal(jax.random.key(4), (1, t, 8))
    positions = jnp.arange(t)[None]

    def y_of_x0(x0):
        return block(x.at[0, 0].set(x0), tokens=None, positions=positions)[0]

    jac = jax.jit(jax.jacrev(y_of_x0))(x[0, 0])  # [T, D, D]
    norms = np.linalg.norm(np.asarray(jac), axis=(1, 2))
    ell = np.arange(16, t)
    return np.polyfit(np.log(ell), np.log(norms[ell]), 1)[0]


def test_end_to_end_jacobian_tail():
    """Uniform routing: attention's influence of an old token decays like 1/ell; Sessa's like
    ell^-(1-gamma) (Prop 29, Thm 23), here gamma = 0.9 (theory slope -0.1, up to a log factor)."""
    attention = _jacobian_tail_slope(_uniform_block("sessa_nofb", 0.0))
    feedback = _jacobian_tail_slope(_uniform_block("sessa", 0.9))
    assert -1.2 < attention < -0.8
    assert -0.35 < feedback < 0.0


def test_param_count_and_matched_width():
    cfg = dataclasses.replace(_config("sessa"), d_model=32)
    model = DecoderLM(cfg, rngs=nnx.Rngs(0))
    actual = sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert lm.param_count(cfg) == actual
    for mixer in ("transformer", "mamba2"):
        width = lm.matched_width(cfg, mixer, actual)
        count = lm.param_count(dataclasses.replace(cfg, mixer=mixer, d_model=width))
        step = 2 * cfg.num_heads
        neighbours = [lm.param_count(dataclasses.replace(cfg, mixer=mixer, d_model=width + s))
                      for s in (-step, step)]
        assert all(abs(count - actual) <= abs(n - actual) for n in neighbours)


def test_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="gamma_max=1.0 must be in \\(0, 1\\)"):
        DecoderLM(_config("sessa", mixer_options=(("gamma_max", 1.0),)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="unknown mixer 'rnn'; valid: attention, sessa"):
        DecoderLM(_config("rnn"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mixer 'sessa' has no option\\(s\\) \\['state_dim'\\]"):
        DecoderLM(_config("sessa", mixer_options=(("state_dim", 4),)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mixer 'transformer' has no option\\(s\\) \\['solve'\\]; it takes none"):
        DecoderLM(_config("transformer", mixer_options=(("solve", "blocked"),)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="model.mixer='attention' has none"):
        _config("attention", mixer_options=(("solve", "blocked"),))
    model = DecoderLM(_config("sessa"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="too long for the cache.*larger max_len"):
        model.decode(jnp.zeros((1, 5), jnp.int32), model.init_cache(1, 4))


def test_torch_init_is_pytorch_linear_default_and_sessa_config_uses_it():
    """init="torch": every linear layer's weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    (PyTorch's nn.Linear default, the authors' code), q/k/v biases in the forward branch; the
    default stays N(0, 1/fan_in) weights and zero biases."""
    from configs import sessa as sessa_configs
    c = sessa_configs.get_config("symbolsoup/sessa/0")
    assert (c.model.qkv_bias, c.model.init) == (True, "torch")
    width = 64
    torch_model = DecoderLM(dataclasses.replace(_config("sessa", init="torch", qkv_bias=True), d_model=width),
                            rngs=nnx.Rngs(0))
    mixer = torch_model.blocks[0].mixer
    layers = {"W_in": torch_model.blocks[0].in_proj, "W_out": torch_model.blocks[0].out_proj, "q": mixer.attn.q,
              "k": mixer.attn.k, "v": mixer.attn.v, "feedback q/k": mixer.qk_b}
    for name, layer in layers.items():
        bound = layer.kernel.shape[0] ** -0.5
        for x in (layer.kernel[...], layer.bias[...]):
            x = np.asarray(x)
            assert np.abs(x).max() <= bound and np.abs(x).max() > 0.9 * bound, name
        w = np.asarray(layer.kernel[...])  # U(-b, b): std b / sqrt(3), mean 0
        assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.1 and abs(w.mean()) < 0.1 * bound, name
    assert mixer.w_g.bias is None and mixer.attn.o.bias is None  # bias-free there, as the authors' code
    normal_block = DecoderLM(dataclasses.replace(_config("sessa"), d_model=width), rngs=nnx.Rngs(0)).blocks[0]
    assert normal_block.mixer.attn.q.bias is None
    np.testing.assert_array_equal(normal_block.in_proj.bias[...], 0.0)
    assert abs(np.asarray(normal_block.in_proj.kernel[...]).std() * math.sqrt(width) - 1) < 0.1
    with pytest.raises(ValueError, match="model.init='xavier' is not an initialisation; valid: normal, torch"):
        _config("sessa", init="xavier")
