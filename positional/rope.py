"""Rotary position embedding (RoPE) and its context-extension variants.

Frequencies: theta_i = base^(-2i/D), i = 0..D/2-1. Token at position p has its pair i rotated
by the angle p * theta_i, so q_m . k_n depends on m - n only.

Pair layouts (which dimensions form a rotated pair):
  "half"        (x[i], x[i + D/2])  as in GPT-NeoX / LLaMA checkpoints;
  "interleaved" (x[2i], x[2i + 1])  as in the RoFormer paper and GPT-J.
The two are the same scheme up to a fixed permutation of the head dimensions.

Extensions (`scaling`, with `factor` s and the pretraining length `original_max_len` L):
  "none"  plain RoPE; changing `base` is the plain base-change extension;
  "pi"    position interpolation (Chen et al. 2023): theta_i / s;
  "ntk"   NTK-aware base scaling: base' = base * s^(D / (D - 2));
  "yarn"  YaRN (Peng et al. 2023): per-pair ramp on r_i = L / wavelength_i,
          gamma_i = clip((r_i - beta_slow) / (beta_fast - beta_slow), 0, 1),
          theta_i' = (1 - gamma_i) theta_i / s + gamma_i theta_i,
          and attention temperature sqrt(1/t) = 0.1 ln s + 1 multiplying q and k.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from positional.scheme import Scheme

SCALINGS = ("none", "pi", "ntk", "yarn")
LAYOUTS = ("half", "interleaved")


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: str = "none",
                     factor: float = 1.0, original_max_len: int = 512,
                     beta_fast: float = 32.0, beta_slow: float = 1.0) -> np.ndarray:
    """Angular frequencies theta_i, [head_dim // 2] float64 (cast at use)."""
    if scaling not in SCALINGS:
        raise ValueError(f"unknown RoPE scaling {scaling!r}; valid: {SCALINGS}")
    if factor <= 0:
        raise ValueError(f"RoPE scaling factor must be positive, got {factor}")
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    theta = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling == "pi":
        theta = theta / factor
    elif scaling == "yarn":
        ratio = original_max_len * theta / (2 * math.pi)  # = L / wavelength
        gamma = np.clip((ratio - beta_slow) / (beta_fast - beta_slow), 0.0, 1.0)
        theta = (1 - gamma) * theta / factor + gamma * theta
    return theta


def yarn_attention_factor(factor: float) -> float:
    """sqrt(1/t) of YaRN: multiplies both q and k, so logits scale by its square."""
    return 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0


def _pairs(x: jax.Array, layout: str):
    """The two coordinates of every rotated pair: (x1, x2), each [..., D/2]."""
    if layout == "half":
        return jnp.split(x, 2, axis=-1)
    if layout == "interleaved":
        return x[..., 0::2], x[..., 1::2]
    raise ValueError(f"unknown RoPE layout {layout!r}; valid: {LAYOUTS}")


def _unpairs(a: jax.Array, b: jax.Array, layout: str) -> jax.Array:
    """The inverse of `_pairs`."""
    if layout == "half":
        return jnp.concatenate([a, b], axis=-1)
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def _turn(x: jax.Array, cos: jax.Array, sin: jax.Array, layout: str) -> jax.Array:
    x1, x2 = _pairs(x, layout)
    return _unpairs(x1 * cos - x2 * sin, x1 * sin + x2 * cos, layout)


def _sum_to(x: jax.Array, shape) -> jax.Array:
    """Sum x over the axes along which an operand of `shape` was broadcast to x.shape."""
    x = jnp.sum(x, axis=tuple(range(x.ndim - len(shape))))
    return jnp.sum(x, axis=tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1), keepdims=True)


def _cos_sin(angles: jax.Array):
    """(cos, sin) of angles, each evaluated once per angle.

    XLA:CPU evaluates sin and cos by scalar library calls and fuses them into every consumer,
    where they run once per output element: 2H times per angle for angles shared by H heads,
    which made a rotation several times slower than its memory traffic. On CPU the pair is
    computed inside a conditional, which XLA does not fuse through; elsewhere (where a
    conditional would cost a host round trip and the fused form is cheap) it is plain.
    """
    def plain(a):
        return jnp.cos(a), jnp.sin(a)

    def once(a):  # the barrier keeps XLA from folding the predicate; vmap keeps the cond too
        return jax.lax.cond(jax.lax.optimization_barrier(jnp.bool_(True)), plain, plain, a)

    return jax.lax.platform_dependent(angles, cpu=once, default=plain)


def rotate(x: jax.Array, angles: jax.Array, layout: str = "half", inverse: bool = False) -> jax.Array:
    """Rotate pairs of x by angles (by -angles with `inverse`). x: [B, T, H, D]; angles:
    [B, T, 1 or H, D/2] (fp32), broadcast against x.

    The rotation is computed in fp32 and cast back to x's dtype. The gradient is written out
    (`_rotate_bwd`): the rotation's derivative in its angle is J y (J the quarter turn, y the
    output), so the angle cotangent reads the saved output, which attention keeps anyway.
    XLA's own transpose re-sliced x and the cotangent into pair-half temporaries. With
    `_cos_sin`, this is 1.6-4.6x faster than the plain form on CPU and brought the learned-angle
    Q/K/V schemes from 0.86 to 0.94 of RoPE's training speed (benchmarks/RESULTS.md).
    """
    return _rotate(x, angles, layout, x.shape, -1.0 if inverse else 1.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rotate(x, angles, layout, shape, sign):
    return _rotate_fwd(x, angles, layout, shape, sign)[0]


def _rotate_fwd(x, angles, layout, shape, sign):
    cos, sin = _cos_sin(angles)
    sin = sign * sin
    y = _turn(x.astype(jnp.float32), cos, sin, layout).astype(x.dtype)
    return y, (y, cos, sin)


def _rotate_bwd(layout, shape, sign, res, g):
    y, cos, sin = res
    g = g.astype(jnp.float32)
    g1, g2 = _pairs(g, layout)
    y1, y2 = _pairs(y.astype(jnp.float32), layout)
    dx = _unpairs(g1 * cos + g2 * sin, g2 * cos - g1 * sin, layout)  # the inverse rotation of g
    da = sign * _sum_to(g2 * y1 - g1 * y2, cos.shape)
    return _sum_to(dx, shape).astype(y.dtype), da.astype(cos.dtype)


_rotate.defvjp(_rotate_fwd, _rotate_bwd)


def rotate_qkv(q, k, v, angles, layout: str, values: bool):
    """The rotary transport: q, k rotated by `angles`; with `values`, v by `-angles`.

    Paired with `rotate_out`, the head output is sum_j a_ij R(angle_i - angle_j) v_j.
    """
    q, k = rotate(q, angles, layout), rotate(k, angles, layout)
    return q, k, rotate(v, angles, layout, inverse=True) if values else v


def rotate_out(out, angles, layout: str, values: bool):
    """Undo the value rotation at the query: out rotated by +angles (only with `values`)."""
    return rotate(out, angles, layout) if values else out


def rope_angles(positions: jax.Array, theta) -> jax.Array:
    """positions [B, T] -> angles [B, T, 1, D/2] in fp32."""
    return positions.astype(jnp.float32)[..., None, None] * jnp.asarray(theta, jnp.float32)


@dataclasses.dataclass(frozen=True)
class Rope(Scheme):
    """RoPE on q and k; with `rotate_values`, also the Q/K/V variant ("rope_qkv").

    Q/K/V (accumulated-transformations paper, App. C, variant 2): values are rotated by
    R(-p_j theta) and the head output by R(+p_i theta), so the output is
    sum_j a_ij R((p_i - p_j) theta) v_j. This is the paper's convention, where q and k are
    rotated by R(-Theta) and values by R(+Theta) with Theta = -p theta: the value route is the
    inverse of the score's rotation (they differ only in the sign of the sine terms), and
    `rope_qkv` equals SO(2) transport with position-only steps exactly (tests/test_so2.py).
    """
    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    original_max_len: int = 512
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    layout: str = "half"
    rotate_values: bool = False

    needs_even_head_dim = True
    probes = ("rope_pairs",)

    def __post_init__(self):
        super().__post_init__()
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown RoPE layout {self.layout!r}; valid: {LAYOUTS}")
        rope_frequencies(self.head_dim, self.base, self.scaling, self.factor)  # validates

    @property
    def theta(self) -> np.ndarray:
        return rope_frequencies(self.head_dim, self.base, self.scaling, self.factor,
                                self.original_max_len, self.beta_fast, self.beta_slow)

    def transform(self, q, k, v, features, positions):
        angles = rope_angles(positions, self.theta)
        q, k, v = rotate_qkv(q, k, v, angles, self.layout, self.rotate_values)
        if self.scaling == "yarn":
            q = q * jnp.asarray(yarn_attention_factor(self.factor) ** 2, q.dtype)
        return q, k, v

    def transform_out(self, out, features, positions):
        return rotate_out(out, rope_angles(positions, self.theta), self.layout, self.rotate_values)
