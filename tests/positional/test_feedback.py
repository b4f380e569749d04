"""Sessa's feedback solve: the paper's closed forms and bounds, and reference == blocked == kernel.

Expected values come from the Sessa paper (Prop 29, Lemma 4.10, Lemma 4.2) and from an
independent float64 NumPy solve listed in the implementation notes, never from the code here.
"""

import base64
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers.draws import normal
from helpers.exported import MOSAIC, TRITON, compiled_for, lowered
from positional import feedback as fb
from positional.kernels.feedback_solve import check_blocks, feedback_solve_pallas, gpu_block


# Jitted: called eagerly, every op compiles on its own. (The bad-input test calls the library.)
solve_reference = jax.jit(fb.solve_reference)


def _uniform_routing(t, gamma, f):
    """qb = kb = 0 gives alpha[t, j] = 1/t over the strict past; constant gamma."""
    zeros = jnp.zeros((1, t, 4))
    return solve_reference(zeros, zeros, jnp.full((1, t), gamma), f)


@pytest.mark.parametrize("gamma, values, slope", [
    (0.5, [0.5, 0.375, 0.176197, 0.0563485, 0.017839, 0.0124662], -0.5),
    (0.9, [0.9, 0.855, 0.740023, 0.590171, 0.468979, 0.436547], -0.1)])
def test_uniform_routing_influence_and_tail_slope(gamma, values, slope):
    t, lags = 2049, [1, 2, 10, 100, 1000, 2048]
    impulse = jnp.zeros((1, t, 1)).at[0, 0, 0].set(1.0)
    y = np.asarray(_uniform_routing(t, gamma, impulse)[0, :, 0])
    np.testing.assert_allclose(y[lags], values, rtol=2e-4)
    ell = np.arange(100, 2049)
    fit = np.polyfit(np.log(ell), np.log(y[ell]), 1)[0]
    assert abs(fit - slope) < 2e-3  # theory -(1 - gamma); the notes measured -0.4996 and -0.0999
    assert y[-1] > 20 / (t + 1)  # far above a uniform attention read, 1/(t+1)


@pytest.mark.parametrize("gamma", [0.5, 0.9])
def test_uniform_routing_closed_form_for_a_later_source(gamma):
    """y_{tau+ell} = gamma G(tau+1)/G(tau+1+gamma) G(tau+ell+gamma)/G(tau+ell+1) (Prop 29)."""
    t, tau = 300, 7
    impulse = jnp.zeros((1, t, 1)).at[0, tau, 0].set(1.0)
    y = np.asarray(_uniform_routing(t, gamma, impulse)[0, :, 0])
    ell = np.arange(1, t - tau)
    lg = math.lgamma
    expected = [gamma * math.exp(lg(tau + 1) - lg(tau + 1 + gamma) + lg(tau + e + gamma) - lg(tau + e + 1))
                for e in ell]
    np.testing.assert_allclose(y[tau + ell], expected, rtol=1e-4)
    assert y[tau + 1] == pytest.approx(gamma / (tau + 1), rel=1e-6)
    np.testing.assert_array_equal(y[:tau], 0.0)


@pytest.mark.parametrize("gamma, values", [(0.5, [1, 1.5, 1.625, 1.8238, 1.9437, 1.9875]),
                                           (0.9, [1, 1.9, 2.305, 3.3398, 4.6885, 6.0711])])
def test_positional_code_sequence(gamma, values):
    """Constant f and uniform routing write c_t: c_0 = 1, c_t = 1 + (gamma/t) sum_{j<t} c_j."""
    t = 2049
    c = np.asarray(_uniform_routing(t, gamma, jnp.ones((1, t, 1)))[0, :, 0])
    np.testing.assert_allclose(c[[0, 1, 2, 10, 100, 2048]], values, rtol=1e-4)
    assert np.all(np.diff(c) > 0)


def _random_inputs(key, b, t, dk, d, rho=0.9, dtype=jnp.float32, sharp=1.0):
    k = jax.random.split(key, 4)
    qb = sharp * normal(k[0], (b, t, dk))
    kb = normal(k[1], (b, t, dk))
    gamma = fb.gain(3 * normal(k[2], (b, t)), rho)
    f = normal(k[3], (b, t, d))
    return qb.astype(dtype), kb.astype(dtype), gamma, f.astype(dtype)


@pytest.mark.parametrize("rho, sharp", [(0.5, 1.0), (0.9, 4.0), (0.999, 0.0)])
def test_stability_bound(rho, sharp):
    """max_t ||s_t|| <= max_t ||f_t|| / (1 - rho) when |gamma_t| <= rho (Lemma 4.2)."""
    qb, kb, gamma, f = _random_inputs(jax.random.key(1), 2, 200, 8, 6, rho=rho, sharp=sharp)
    f = jnp.abs(f)  # same-sign inputs push s towards the bound
    s = solve_reference(qb, kb, gamma, f)
    assert float(jnp.max(jnp.abs(gamma))) <= rho * (1 + 1e-6)  # rho itself rounded to fp32
    bound = jnp.max(jnp.linalg.norm(f, axis=-1), axis=1) / (1 - rho)
    assert bool(jnp.all(jnp.max(jnp.linalg.norm(s, axis=-1), axis=1) <= bound * (1 + 1e-5)))


def test_neumann_series_equals_the_solve():
    """B is nilpotent (strictly lower), so (I - B)^{-1} = sum_{k<T} B^k exactly."""
    qb, kb, gamma, f = _random_inputs(jax.random.key(2), 2, 24, 8, 3)
    b = np.asarray(jax.jit(fb.feedback_matrix)(qb, kb, gamma), np.float64)
    term, total = np.asarray(f, np.float64), np.zeros(f.shape)
    for _ in range(24):
        total, term = total + term, b @ term
    assert np.abs(term).max() == 0.0  # B^T = 0
    np.testing.assert_allclose(solve_reference(qb, kb, gamma, f), total, rtol=1e-5, atol=1e-5)


def test_row_zero_and_the_recurrence():
    """s_0 = f_0 and s_t = f_t + gamma_t sum_{j<t} alpha[t, j] s_j, with alpha a softmax over j < t."""
    qb, kb, gamma, f = _random_inputs(jax.random.key(3), 1, 12, 8, 3)
    alpha = np.asarray(jax.jit(fb.feedback_weights)(qb, kb))[0]
    np.testing.assert_array_equal(alpha[0], 0.0)
    np.testing.assert_allclose(alpha[1:].sum(-1), 1.0, rtol=1e-6)
    assert np.all(np.triu(alpha) == 0.0)
    s, g, ff = (np.asarray(x)[0] for x in (solve_reference(qb, kb, gamma, f), gamma, f))
    expected = [ff[0]]
    for t in range(1, 12):
        expected.append(ff[t] + g[t] * alpha[t, :t] @ np.stack(expected))
    np.testing.assert_allclose(s, np.stack(expected), rtol=1e-5, atol=1e-6)


IMPLS = {"blocked": fb.solve_blocked, "pallas": functools.partial(feedback_solve_pallas, interpret=True),
         "pallas_tpu": functools.partial(feedback_solve_pallas, interpret="tpu")}  # TPU form, TPU interpreter


def _segments(t):
    """Segment ids [2, t] of packed rows: row 0 holds a length-1 segment (5) and one across a
    chunk boundary; row 1 ends in a length-1 segment."""
    cuts = ([5, 6, 13], [8, t - 1])
    return jnp.asarray(np.stack([np.searchsorted(c, np.arange(t), side="right") for c in cuts]))


def _solve_and_vjp(fn, w, seg):
    """One jitted function giving s and the gradient of sum(s * w) for qb, kb, gamma, f."""
    def run(*args):
        s, vjp = jax.vjp(lambda *a: fn(*a, seg), *args)
        return s, vjp(w)
    return jax.jit(run)


@pytest.mark.parametrize("impl, t, block, d, dtype, packed", [
    ("blocked", 37, 8, 5, jnp.float32, True), ("blocked", 5, 8, 4, jnp.bfloat16, False),
    ("pallas", 19, 8, 20, jnp.float32, True), ("pallas", 13, 8, 6, jnp.bfloat16, False),
    ("pallas_tpu", 19, 8, 20, jnp.float32, True)])
def test_implementations_agree_values_and_gradients(impl, t, block, d, dtype, packed):
    """T not a multiple of the block; packed rows: 3 and 4 segments, of length 1 among them."""
    qb, kb, gamma, f = _random_inputs(jax.random.key(4), 2, t, 8, d, dtype=dtype)
    w = normal(jax.random.key(5), (2, t, d))
    seg = _segments(t) if packed else None
    fast = functools.partial(IMPLS[impl], block_size=block) if impl == "blocked" else \
        functools.partial(IMPLS[impl], block=block)
    if impl != "blocked" and d == 20:  # two feature tiles on the grid
        fast = functools.partial(fast, block_d=16)
    s_fast, g_fast = _solve_and_vjp(fast, w, seg)(qb, kb, gamma, f)
    s_ref, g_ref = _solve_and_vjp(fb.solve_reference, w, seg)(qb, kb, gamma, f)
    assert s_fast.dtype == jnp.float32 and s_fast.shape == (2, t, d)
    np.testing.assert_allclose(s_fast, s_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_ref, g_fast):
        assert a.dtype == b.dtype
        tol = 2e-2 if b.dtype == jnp.bfloat16 else 1e-4  # bf16 only rounds the cotangent's storage
        np.testing.assert_allclose(np.asarray(b, np.float32), np.asarray(a, np.float32), rtol=tol, atol=tol)


def test_blocked_jits_and_vmaps():
    qb, kb, gamma, f = _random_inputs(jax.random.key(6), 3, 20, 4, 2)
    fast = jax.jit(jax.vmap(lambda *a: fb.solve_blocked(*(x[None] for x in a), block_size=8)[0]))
    np.testing.assert_allclose(fast(qb, kb, gamma, f), solve_reference(qb, kb, gamma, f), atol=1e-5)


def test_decode_solve_extends_a_prefix_exactly():
    qb, kb, gamma, f = _random_inputs(jax.random.key(7), 2, 30, 8, 4)
    kb_cache, s_cache = jnp.zeros((2, 32, 8)), jnp.zeros((2, 32, 4))
    pieces, index = [], 0
    decode = jax.jit(fb.decode_solve)  # the index is traced, as in a decoding loop
    for n in (7, 1, 1, 21):  # a prefill, two single steps, a chunked prefill
        sl = slice(index, index + n)
        s_new, kb_cache, s_cache = decode(kb_cache, s_cache, index, qb[:, sl], kb[:, sl],
                                                   gamma[:, sl], f[:, sl])
        pieces.append(s_new)
        index += n
    np.testing.assert_allclose(jnp.concatenate(pieces, 1), solve_reference(qb, kb, gamma, f), atol=1e-5)


def test_bad_input_is_a_clear_error():
    x = jnp.zeros((1, 4, 8))
    with pytest.raises(ValueError, match="gamma_max=1.0 must be in \\(0, 1\\).*no longer stable"):
        fb.gain(jnp.zeros((1, 4)), 1.0)
    with pytest.raises(ValueError, match="feedback head width mismatch: qb has width 8 but kb has 6"):
        fb.solve_blocked(x, jnp.zeros((1, 4, 6)), jnp.zeros((1, 4)), x)
    with pytest.raises(ValueError, match="must share batch and time"):
        fb.solve_reference(x, x, jnp.zeros((1, 5)), x)
    with pytest.raises(ValueError, match="unknown feedback solve impl 'dense'"):
        fb.feedback_solve(x, x, jnp.zeros((1, 4)), x, impl="dense")
    with pytest.raises(ValueError, match="segment_ids must be integers \\[B, T\\] = \\[1, 4\\]; got float32 \\[1, 4\\]"):
        fb.feedback_solve(x, x, jnp.zeros((1, 4)), x, jnp.zeros((1, 4)), impl="pallas")
    with pytest.raises(ValueError, match="segment_ids must be integers .*; got int32 \\[1, 5\\]"):
        fb.solve_reference(x, x, jnp.zeros((1, 4)), x, jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="interpret='gpu' must be None, True, False or 'tpu'"):
        feedback_solve_pallas(x, x, jnp.zeros((1, 4)), x, interpret="gpu")
    check_blocks(128, "tpu", interpret=False)
    for (block, backend), msg in [((64, "tpu"), "block=64 .* multiple of 128"),
                                  ((48, "gpu"), "block=48 .* power of two"), ((64, "cpu"), "interpret")]:
        with pytest.raises(ValueError, match=msg):
            check_blocks(block, backend, interpret=False)


def _mosaic_operands(text):
    """Per TPU kernel of an exported module, the shapes of its VMEM operands (blocks, scratch),
    read from the Mosaic module each tpu_custom_call carries (MLIR bytecode, base64)."""
    try:
        from jax._src.lib import tpu
        from jax._src.lib.mlir import ir
    except ImportError:
        pytest.skip("this JAX cannot read a Mosaic module back")
    context = ir.Context()
    tpu.register_dialect(context)
    context.allow_unregistered_dialects = True  # the serialized ops are "stable_mosaic.*"
    kernels = []
    with context:
        for body in re.findall(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', text):
            module = str(ir.Module.parse(base64.b64decode(body)))
            signature = module[module.index("^bb0"):].split("\n", 1)[0]
            kernels.append([tuple(map(int, m.split("x"))) for m in
                            re.findall(r"memref<([0-9x]+)x\w+, #tpu.memory_space<vmem>>", signature)])
    return kernels


def test_kernel_lowers_for_tpu():
    """Forward and backward lower to Mosaic (TPU) on this CPU, through jax.export, with segment
    ids: the kernel lowers for the platform exported for, not this machine's. Compiling needs a
    TPU; lowering checks block shapes and every op. Every block is one chunk: the only T-long
    operand is the [T, Dt] scratch the solve (s) and lambda kernels keep resident."""
    t = 2048
    qb = jax.ShapeDtypeStruct((1, t, 128), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((1, t), jnp.float32)
    f = jax.ShapeDtypeStruct((1, t, 256), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    for block in (None, 256):  # TPU's default chunk (128), and a given one
        solve = functools.partial(feedback_solve_pallas, block=block)
        grad = jax.grad(lambda *a: solve(*a).sum(), (0, 1, 2, 3))
        for fn, kernels, resident in ((solve, 2, 1), (grad, 5, 2)):  # solve; lambda
            text = lowered(fn, qb, qb, gamma, f, seg, platforms=["tpu"])
            assert text.count(MOSAIC) == kernels
            operands = _mosaic_operands(text)
            assert len(operands) == kernels
            long = sorted([shape for shape in shapes if t in shape] for shapes in operands)
            assert long == [[]] * (kernels - resident) + [[(t, 128)]] * resident
            assert all(max(shape[-2:]) <= max(block or 128, 256) for shapes in operands
                       for shape in shapes if t not in shape)


@pytest.mark.parametrize("topology", ["v4:1x1x1", "v5e:1x1"])
def test_kernel_compiles_for_tpu(topology):
    """The solve's forward + backward compiled by the TPU compiler (libtpu) for one chip, 4,096
    tokens with segment ids. (From 32K tokens its [T, 128] fp32 scratch passes a v4's 16 MiB of
    VMEM: benchmarks/RESULTS.md, the compile table.)"""
    t = 4096
    qb = jax.ShapeDtypeStruct((1, t, 128), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((1, t), jnp.float32)
    f = jax.ShapeDtypeStruct((1, t, 256), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.grad(lambda *a: feedback_solve_pallas(*a).sum(), (0, 1, 2, 3))
    assert compiled_for(grad, qb, qb, gamma, f, seg, topology=topology).as_text().count("tpu_custom_call") >= 5


@pytest.mark.parametrize("chip,refused", [("TPU_V4", True), ("TPU_V5E", False)])
def test_kernel_refuses_in_one_line_what_the_chips_vmem_cannot_keep(chip, refused):
    """At 32K tokens the solve's resident [T, 128] fp32 (16 MiB) passes a v4's VMEM (16 MiB, less
    the tiles'): lowering for that chip says so in one line, naming solve='blocked', where the TPU
    compiler failed (21.63 of 16 MiB used, the compile table); a v5e (128 MiB) takes it."""
    from lab.lowering import target
    t = 32768
    qb = jax.ShapeDtypeStruct((1, t, 128), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((1, t), jnp.float32)
    f = jax.ShapeDtypeStruct((1, t, 128), jnp.bfloat16)
    # A function of its own: the chip is read when tracing, which jit caches per function.
    export = jax.export.export(jax.jit(lambda *a: feedback_solve_pallas(*a)), platforms=["tpu"])
    with target("tpu", chip=chip):
        if not refused:
            assert MOSAIC in export(qb, qb, gamma, f).mlir_module()
            return
        with pytest.raises(ValueError) as error:
            export(qb, qb, gamma, f)
    line = str(error.value)
    assert "\n" not in line and "16.1 MiB of VMEM for 32768 tokens" in line and "16 MiB of VMEM" in line
    assert "solve='blocked'" in line


def test_kernel_lowers_for_gpu():
    """Forward (2 kernels) and backward (5) lower to Triton on this CPU, with segment ids; a
    chunk Mosaic refuses (64) fails only the lowering for tpu. Whether the solve kernel, which
    re-reads the chunks of s it wrote, needs a barrier there is for a GPU run to show."""
    qb = jax.ShapeDtypeStruct((1, 256, 64), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((1, 256), jnp.float32)
    f = jax.ShapeDtypeStruct((1, 256, 256), jnp.bfloat16)
    seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
    for block in (None, 64):
        solve = functools.partial(feedback_solve_pallas, block=block)
        grad = jax.grad(lambda *a: solve(*a).sum(), (0, 1, 2, 3))
        for fn, kernels in ((solve, 2), (grad, 5)):
            assert lowered(fn, qb, qb, gamma, f, seg).count(TRITON) == kernels
    with pytest.raises(ValueError, match="block=64 is not usable: it must be a multiple of 128"):
        lowered(grad, qb, qb, gamma, f, platforms=["tpu"])


def test_gpu_chunk_fits_the_widths():
    """The GPU's default chunk: 64 up to 64 wide, then block x width within 8,192 and at most 32
    (64 at width 128 fits but took 231 s to compile); past 512 wide nothing fits: one line."""
    assert [gpu_block(w) for w in (16, 64, 128, 256, 512)] == [64, 64, 32, 32, 16]
    wide = jax.ShapeDtypeStruct((1, 64, 1024), jnp.float32)
    gamma = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    with pytest.raises(ValueError) as error:  # lowered for cuda; on this CPU it runs (interpreted)
        lowered(feedback_solve_pallas, wide, wide, gamma, wide)
    assert "\n" not in str(error.value) and "the 1024-wide feedback or feature rows" in str(error.value)
    assert "solve='blocked'" in str(error.value)
    x = jnp.ones((1, 16, 1024), jnp.float32)
    assert feedback_solve_pallas(x * 0.01, x * 0.01, jnp.full((1, 16), 0.5), x).shape == (1, 16, 1024)


@pytest.mark.slow  # 25 s
def test_kernel_compiles_for_an_h100_at_a_models_widths():
    """configs/default.py's Sessa (d_model 256, feedback_dim its default D): forward + backward
    compiled for an H100 by XLA's GPU compiler with the default chunk (32). The former default
    (64) asks 400 KiB of shared memory at 512 tokens, where a block has 227 KiB, and the model's
    former solve_block (256) kept XLA compiling for over 25 minutes (benchmarks/RESULTS.md)."""
    t, width = 512, 256
    qb = jax.ShapeDtypeStruct((1, t, width), jnp.bfloat16)
    gamma = jax.ShapeDtypeStruct((1, t), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, t), jnp.int32)
    grad = jax.grad(lambda *a: feedback_solve_pallas(*a).sum(), (0, 1, 2, 3))
    assert compiled_for(grad, qb, qb, gamma, qb, seg, topology="h100:1").as_text().count(TRITON) >= 5
