"""impl="auto": what it picks per platform, that on this CPU it is the reference's result, that
each choice is logged once, and that lowering for cuda / tpu reaches the fused kernels."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from lab.lowering import target
from helpers.exported import MOSAIC, TRITON, lowered, simplified
from helpers.tiny_setup import ROOT
from models.registry import make_scheme
from positional import attention as dispatch
from positional.attention import REFERENCE_MAX, attention, choose

BF16 = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.bfloat16)
F32 = jax.ShapeDtypeStruct((1, 256, 4, 128), jnp.float32)
ALIBI = make_scheme("alibi", num_heads=4, head_dim=128).bias_fn(None, None)
KERPLE = make_scheme("kerple_log", num_heads=4, head_dim=128).bias_fn(
    {"kerple_r1": jnp.ones(4), "kerple_r2": jnp.ones(4)}, None)


@pytest.fixture
def cudnn():
    """This CPU jaxlib has no cuDNN: `choose` asks whether jax could build a cuDNN call."""
    with target("cuda"):
        yield


@pytest.mark.parametrize("platform,x,kw,impl,why", [
    ("cpu", BF16, {}, "reference", "256 keys <= 2048"),
    ("cpu", jax.ShapeDtypeStruct((1, REFERENCE_MAX + 1, 4, 128), jnp.float32), {}, "blockwise", "> 2048"),
    ("cuda", BF16, {}, "cudnn", "plain softmax"),
    ("cuda", BF16, {"segment_ids": True}, "cudnn", "packed rows as cuDNN segments"),  # an H100
    ("cuda", BF16, {"segment_ids": True, "q_offset": 3}, "pallas", "packed rows (segment ids) while decoding"),
    ("cuda", F32, {}, "pallas", "float32"),
    ("cuda", BF16, {"bias_fn": ALIBI}, "cudnn", "per-key bias in q.k channels (head dim 128 -> 136)"),
    ("cuda", BF16, {"bias_fn": KERPLE}, "pallas", "takes a bias_fn only when it is per key"),
    ("cuda", BF16, {"bias_fn": lambda qi, kj: 0.0}, "blockwise", "bias_fn must be a positional.logits.Bias"),
    ("tpu", BF16, {}, "splash", "plain softmax"),
    ("tpu", BF16, {"segment_ids": True}, "splash", "plain softmax"),
    ("tpu", BF16, {"bias_fn": ALIBI}, "splash", "per-key bias in q.k channels (head dim 128 -> 192)"),
    ("tpu", BF16, {"bias_fn": KERPLE}, "pallas", "the fused kernel"),
    ("tpu", BF16, {"q_offset": jnp.int32(3)}, "blockwise", "q_offset must be a Python int"),
])
def test_choices(cudnn, platform, x, kw, impl, why):
    if kw.get("segment_ids"):
        kw = {**kw, "segment_ids": jnp.zeros(x.shape[:2], jnp.int32)}
    got, reason = choose(x, x, x, platform=platform, **kw)
    assert (got, why in reason) == (impl, True), reason


def test_packed_rows_before_hopper_get_the_fused_kernel():
    """cuDNN's packed form needs Hopper; its mask form (T x S) is not auto's."""
    seg = jnp.zeros(BF16.shape[:2], jnp.int32)
    with target("cuda", chip="A100"):
        assert choose(BF16, BF16, BF16, platform="cuda") == ("cudnn", "plain softmax")
        impl, why = choose(BF16, BF16, BF16, platform="cuda", segment_ids=seg)
    assert impl == "pallas" and "packed rows need cuDNN's packed form (Hopper or later)" in why


def test_without_cudnn_the_gpu_gets_the_fused_kernel():
    assert choose(BF16, BF16, BF16, platform="cuda") == ("pallas", "the fused kernel; not cudnn: this JAX has no cuDNN")


@pytest.mark.parametrize("name", ["rope", "alibi", "tapa+alibi", "path_fox"])
def test_auto_on_cpu_is_the_reference(name, caplog):
    """On this CPU auto runs the reference (short rows): the same numbers, and one log line per
    platform for a call site however often it is traced."""
    scheme = make_scheme(name, num_heads=4, head_dim=16)
    q, k, v = (normal(jax.random.key(i), (2, 24, 4, 16)) for i in range(3))
    pos = jnp.broadcast_to(jnp.arange(24), (2, 24))
    dispatch._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="positional.attention"):
        got = [jax.jit(lambda q, s=s: scheme.attend(q, k, v, positions=pos, impl="auto", key=jax.random.key(0)))(q)
               for s in range(2)]  # two traces of one call site
    want = jax.jit(lambda q: scheme.attend(q, k, v, positions=pos, impl="reference", key=jax.random.key(0)))(q)
    for out in got:
        np.testing.assert_array_equal(out, want)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    if "auto" in scheme.impls:
        assert len(lines) == 3 and {line.split(" on ")[1].split(":")[0] for line in lines} == {"cpu", "cuda", "tpu"}
    else:  # PaTH brings its own attention: auto is its reference at this length, nothing logged
        assert lines == []


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_auto_lowers_to_the_fused_kernels(platform):
    """Exported for a platform on this CPU, auto reaches cuDNN / splash for plain softmax and a
    per-key bias (ALiBi, through q.k channels), and the project's kernel for another bias
    (KERPLE), forward and backward; no T x T buffer on the way. (The module as exported holds
    zeros standing for the other platforms' residuals, the CPU reference's T x T among them:
    differentiating a platform_dependent keeps every branch's; dead code, which XLA removes:
    `test_other_platforms_residuals_cost_no_memory`.)"""
    def lowered_step(bias):
        def loss(q):
            return attention(q, q, q, impl="auto", bias_fn=bias).astype(jnp.float32).sum()
        return lowered(jax.value_and_grad(loss), BF16, platforms=[platform])

    plain, per_key, other = lowered_step(None), lowered_step(ALIBI), lowered_step(KERPLE)
    if platform == "cuda":
        for text in (plain, per_key):
            assert "__cudnn$fmhaSoftmaxBackward" in text and TRITON not in text
        assert other.count(TRITON) == 3 and "__cudnn" not in other  # forward, dK/dV, dQ
    else:
        for text in (plain, per_key):
            assert text.count(MOSAIC) == 3 and "splash_mha_dkv" in text
        assert other.count(MOSAIC) == 3 and "splash" not in other  # the project's kernel
    assert "x256x136x" in per_key if platform == "cuda" else "x256x192x" in per_key  # the bias channels
    for text in (plain, per_key, other):  # no [., ., T, T] tensor is left once dead code is gone
        assert "x256x256x" not in simplified(text)


def test_other_platforms_residuals_cost_no_memory():
    """Compiled for this CPU, auto's forward + backward needs the temporary memory of the
    reference alone: the zeros standing for the cuda and tpu branches' residuals are dropped."""
    x = normal(jax.random.key(0), (1, 512, 4, 64))

    def temp(impl):
        grad = jax.jit(jax.grad(lambda q: attention(q, q, q, impl=impl, bias_fn=ALIBI).sum()))
        return grad.lower(x).compile().memory_analysis().temp_size_in_bytes

    assert temp("auto") <= temp("reference")


def test_a_long_alibi_stays_on_the_fused_kernel(cudnn):
    """ALiBi's key term (slope x position) grows with the length; past 2^15 (16 heads, steepest
    slope 0.71: from 46K keys) q.k channels would round it more than the kernel's own bias, so
    auto keeps it on the fused kernel, saying so. FoX (learned) stays on the fused kernel at
    any length: its gates' gradient through the channels is bf16's (FACTS["channel_gradient"])."""
    alibi = make_scheme("alibi", num_heads=16, head_dim=128).bias_fn(None, None)
    fox = make_scheme("fox", num_heads=16, head_dim=128).bias_fn(
        {"log_forget": jnp.zeros((1, 65536, 16))}, None)
    for platform in ("cuda", "tpu"):
        short, long = (jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16) for t in (32768, 65536))
        assert choose(short, short, short, platform=platform, bias_fn=alibi)[0] in ("cudnn", "splash")
        impl, why = choose(long, long, long, platform=platform, bias_fn=alibi)
        assert impl == "pallas" and "its per-key bias reaches 46,340 at 65536 keys, past 32,768" in why, why
        for x in (short, long):
            impl, why = choose(x, x, x, platform=platform, bias_fn=fox)
            assert impl == "pallas" and "its per-key bias is learned: a learned per-key bias's gradient" in why, why


PER_DEVICE_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from positional.attention import per_device
from positional.fox import forget_bias
from positional.ring import ring_mesh
from positional.softmax import reference_attention
mesh = jax.make_mesh((2, 1, 2, 1), ("data", "fsdp", "tensor", "sequence"),
                     axis_types=(jax.sharding.AxisType.Auto,) * 4)
keys = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(keys[0], (4, 24, 4, 8)); k, v = (jax.random.normal(x, (4, 24, 2, 8)) for x in keys[1:3])
gates = jax.nn.log_sigmoid(jax.random.normal(keys[3], (4, 24, 4)))
seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(1, 4, size=(4, 24)), axis=1), jnp.int32)
shapes = []
def kernel(q, k, v, bias, seg):  # a stand-in kernel: the reference on the local shard
    shapes.append((q.shape, k.shape, bias.values["F"].shape, seg.shape))
    return reference_attention(q, k, v, bias_fn=bias, segment_ids=seg)
def loss(q, k, v, g, sharded):
    run = (lambda: per_device(kernel, q, k, v, bias_fn=forget_bias(g), segment_ids=seg)) if sharded else (
        lambda: kernel(q, k, v, forget_bias(g), seg))
    if sharded:
        with ring_mesh(mesh):
            return jnp.sum(run() ** 2)
    return jnp.sum(run() ** 2)
put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
got = jax.jit(jax.grad(lambda *a: loss(*a, True), range(4)))(*map(put, (q, k, v, gates)))
want = jax.grad(lambda *a: loss(*a, False), range(4))(q, k, v, gates)
err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want))
print("max relative error", err)
assert err < 1e-5
assert ((2, 24, 2, 8), (2, 24, 1, 8), (2, 24, 2), (2, 24)) in shapes, shapes  # a quarter per device
"""


def test_per_device_equals_one_device():
    """A kernel (here the reference, standing in) run per shard by `per_device` on 4 devices
    (batch over data 2, heads over tensor 2, GQA, FoX gates and packed rows split with them):
    the same values and gradients (q, k, v, the gates) as on one device."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    run = subprocess.run([sys.executable, "-c", PER_DEVICE_CHECK], capture_output=True, text=True, env=env,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "max relative error" in run.stdout
