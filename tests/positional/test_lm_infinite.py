"""rope_lm_infinite (positional/lm_infinite.py): the conformance suite with its mask and ceiling
in play, an explicit float64 Lambda mask and clamped distances, RoPE wherever the window covers
the sequence, one-line refusals; and zero-shot use on a trained RoPE run (lab.runs.with_scheme,
eval.py --scheme) and the analysis's sliding windows (lab.analysis.window_outputs)."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import test_conformance as conformance
from helpers.draws import normal
from lab.analysis import window_outputs
from lab.cli import scheme_runs
from lab.runs import Run, held_out_windows, load_run, with_scheme
from models.lm import attention_internals
from models.registry import REGISTRY, Entry, make_scheme
from positional.lm_infinite import LMInfinite
from helpers.tiny_setup import cli

SMALL = "rope_lm_infinite_w4"  # window 4, 2 starting tokens: the suite's 12 tokens cross both
B, T, H, K, D = 2, 13, 4, 2, 8


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setitem(REGISTRY, SMALL, Entry(LMInfinite, fixed={"rotate_values": False, "window": 4,
                                                                   "global_tokens": 2}))
    return SMALL


def test_the_conformance_suite_with_the_mask_in_play(small, monkeypatch):
    """The registered scheme's window (512) covers the suite's 12 tokens; at window 4 the suite's
    tests run with keys masked and capped (the rest of them: the slow test below), and the shift
    check finds the scheme absolute."""
    conformance.test_decode_equals_parallel(small, 0, False)
    conformance.test_implementations_agree_values_and_gradients(small, 0, False, monkeypatch)
    assert conformance.shift_error(small) > 1e-2  # the starting tokens are positions 0 and 1


@pytest.mark.slow
def test_the_rest_of_the_conformance_suite_with_the_mask_in_play(small):
    conformance.test_causal(small)
    conformance.test_packing_equals_separate_runs(small)
    conformance.test_vmap(small)
    conformance.test_bf16_is_finite_and_close(small)
    conformance.test_notebook_call_needs_no_model(small)


def qkv(t=T):
    q = normal(jax.random.key(0), (B, t, H, D))
    k, v = normal(jax.random.key(1), (2, B, t, K, D))
    return q, k, v


def explicit(q, k, v, segments, window, starting):
    """LM-Infinite in float64, written out: per document (positions restart at its first token),
    query i reads key j <= i iff p_j < starting or i - j < window, scored as RoPE ('half' pairs,
    base 10^4) at the distance min(i - j, window)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    theta = 10000.0 ** (-np.arange(0, D, 2) / D)

    def turn(x, angle):  # pair r = (x[r], x[r + D/2]) rotated by angle_r
        a, b = x[:D // 2], x[D // 2:]
        return np.concatenate([a * np.cos(angle) - b * np.sin(angle), a * np.sin(angle) + b * np.cos(angle)])

    out = np.zeros_like(q)
    for row in range(q.shape[0]):
        seg = np.asarray(segments[row])
        start = np.array([np.argmax(seg == s) for s in seg])  # each token's document start
        for i in range(q.shape[1]):
            for h in range(H):
                keys = [j for j in range(i + 1) if seg[j] == seg[i] and (j - start[j] < starting or i - j < window)]
                logits = np.array([turn(q[row, i, h], min(i - j, window) * theta) @ k[row, j, h // (H // K)]
                                   for j in keys]) / np.sqrt(D)
                w = np.exp(logits - logits.max())
                out[row, i, h] = (w / w.sum()) @ v[row, keys, h // (H // K)]
    return out


@pytest.mark.parametrize("window,starting", [(4, 2), (3, 5)])
def test_float64_lambda_mask_and_clamped_distances(window, starting):
    """Reference and blockwise on two packed documents, and token-by-token decoding of a whole
    row, against the float64 computation (also with more starting tokens than the window)."""
    s = make_scheme("rope_lm_infinite", num_heads=H, head_dim=D, window=window, global_tokens=starting)
    q, k, v = qkv()
    segments = jnp.asarray([[1] * 4 + [2] * 9, [1] * T])
    positions = jnp.asarray([list(range(4)) + list(range(9)), list(range(T))])
    want = explicit(q, k, v, segments, window, starting)
    attend = jax.jit(s.attend, static_argnames=("impl", "block_size"))
    for impl in ("reference", "blockwise"):
        got = attend(q, k, v, positions=positions, segment_ids=segments, impl=impl, block_size=4)
        np.testing.assert_allclose(got, want, atol=2e-6, err_msg=impl)
    cache, outs, step = s.init_cache(B, T + 2, K), [], jax.jit(s.decode_step)
    for lo, hi in [(0, 5)] + [(t, t + 1) for t in range(5, T)]:  # a chunked prefill, then one token at a time
        out, cache = step(cache, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi])
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1)[1], want[1], atol=2e-6)


def test_a_window_covering_the_sequence_is_rope():
    """Window T: the farthest key, at T - 1, is within it. RoPE's values bit for bit (the
    reference), and its gradients too (blockwise, jitted; the reference agrees with blockwise
    in the conformance suite: in the jitted reference XLA fuses the mask's + 0 otherwise, an ulp)."""
    q, k, v = qkv()
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def attend(name, impl, **options):
        s = make_scheme(name, num_heads=H, head_dim=D, **options)
        return lambda q, k, v: s.attend(q, k, v, positions=positions, impl=impl, block_size=4)

    def grads(name, impl, **options):
        loss = lambda *qkv: jnp.sum(jnp.sin(attend(name, impl, **options)(*qkv)))  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)

    np.testing.assert_array_equal(attend("rope_lm_infinite", "reference", window=T)(q, k, v),
                                  attend("rope", "reference")(q, k, v))
    jax.tree.map(np.testing.assert_array_equal, grads("rope_lm_infinite", "blockwise", window=T),
                 grads("rope", "blockwise"))


@pytest.mark.parametrize("options,error", [
    ({"window": 0}, "rope_lm_infinite window=0 must be >= 1: the pretraining length"),
    ({"global_tokens": -1}, "rope_lm_infinite global_tokens=-1 must be >= 0"),
    ({"scaling": "dynamic"}, "rope_lm_infinite caps distances at the window, and scaling='dynamic'"),
    ({"rotate_values": True}, "scheme 'rope_lm_infinite' fixes option(s) ['rotate_values']"),
])
def test_bad_options_are_one_line(options, error):
    with pytest.raises(ValueError) as raised:
        make_scheme("rope_lm_infinite", num_heads=H, head_dim=D, **options)
    assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


def logits_of(model, tokens):
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda state: nnx.merge(graphdef, state)(tokens, impl="reference"))(state))


def test_zero_shot_on_a_trained_rope_run(tiny_run):
    """The run's own parameters, LM-Infinite's window its training length (32); RoPE's logits up
    to it, others past it; a scheme with parameters of its own is refused in one line."""
    config, _ = tiny_run
    run = Run(config.workdir, *load_run(config.workdir))
    lm = with_scheme(run, "rope_lm_infinite")
    scheme = lm.model.blocks[0].attn.scheme
    assert (lm.config.model.scheme, scheme.window, scheme.global_tokens) == ("rope_lm_infinite", 32, 10)
    for a, b in zip(jax.tree.leaves(nnx.state(lm.model)), jax.tree.leaves(nnx.state(run.model))):
        assert a is b
    tokens = held_out_windows(config, 2, 96)
    rope, capped = logits_of(run.model, tokens), logits_of(lm.model, tokens)
    np.testing.assert_allclose(capped[:, :32], rope[:, :32], atol=1e-5)
    assert not np.allclose(capped[:, 32:], rope[:, 32:], atol=1e-3)
    narrow = with_scheme(run, "rope_lm_infinite", {"window": 16}).model
    assert narrow.blocks[1].attn.scheme.window == 16 and not np.allclose(logits_of(narrow, tokens)[:, 16:32],
                                                                         rope[:, 16:32], atol=1e-3)
    with pytest.raises(ValueError) as raised:
        with_scheme(run, "kerple_log")
    assert str(raised.value) == (f"{config.workdir}: scheme 'kerple_log' does not fit the run's parameters (it "
                                 "needs blocks/0/attn/features/kerple_r1 (2,), which the run lacks); a zero-shot "
                                 "scheme must take them as they are")


def test_window_outputs_are_the_models_own(tiny_run):
    """A query over the window that ends at it reads what the model reads: RoPE's output at the
    training length's last position, LM-Infinite's (no starting tokens) past it."""
    config, _ = tiny_run
    run = Run(config.workdir, *load_run(config.workdir))
    tokens = held_out_windows(config, 1, 72)

    @functools.partial(jax.jit, static_argnums=(0, 2))
    def check(graphdef, state, t):  # per layer: (its output at t, the window ending at t's; windows every 8)
        model = nnx.merge(graphdef, state)
        return [(layer["out"][0, t], window_outputs(block.attn, layer, 0, [t], 32)[0, (t - 31) // 8])
                for block, layer in zip(model.blocks, attention_internals(model, tokens, maps=False))]

    for model, t in ((run.model, 31), (with_scheme(run, "rope_lm_infinite", {"global_tokens": 0}).model, 71)):
        for want, got in check(*nnx.split(model), t):
            np.testing.assert_allclose(got, want, atol=1e-5)


def test_scheme_flags(tiny_run):
    workdir = tiny_run[0].workdir
    assert [r.workdir for r in scheme_runs([workdir], "", [])] == [workdir]
    run, = scheme_runs([workdir], "rope_lm_infinite", ["global_tokens=4", "scaling=pi", "factor=2.0"])
    assert run.model.blocks[0].attn.scheme == make_scheme("rope_lm_infinite", num_heads=2, head_dim=16, window=32,
                                                          global_tokens=4, scaling="pi", factor=2.0)
    for flags, error in (((["window"]), "--scheme_options=window is not name=value; valid: e.g. window=128,"),
                         (["window=8"], "--scheme_options sets options of --scheme; pass --scheme=<registered")):
        with pytest.raises(ValueError) as raised:
            scheme_runs([workdir], "rope_lm_infinite" if flags == ["window"] else "", flags)
        assert str(raised.value).startswith(error) and "\n" not in str(raised.value)


@pytest.mark.slow
def test_eval_under_another_scheme(tiny_run, tmp_path):
    config, _ = tiny_run
    run = cli("eval.py", f"--workdirs={config.workdir}", f"--out={tmp_path}", "--tokens=64", "--max_multiplier=2",
              "--scheme=rope_lm_infinite", "--scheme_options=global_tokens=4")
    assert run.returncode == 0, run.stderr
    assert json.load(open(tmp_path / "results.json"))["runs"]["rope"]["scheme"] == "rope_lm_infinite"
