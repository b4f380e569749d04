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
          and attention temperature sqrt(1/t) = 0.1 ln s + 1 multiplying q and k
          (`attention_factor` > 0 sets sqrt(1/t) itself). `ramp` "ratio" is the paper's ramp,
          linear in r_i; "index" is the YaRN authors' code (and Hugging Face's): linear in
          the pair index i between the indices where r = beta_fast and r = beta_slow,
          those rounded outwards to whole pairs ("index_exact": not rounded);
  "llama3" Llama 3.1's: the "ratio" ramp with (beta_slow, beta_fast) = (low_freq_factor,
          high_freq_factor), no temperature;
  "dynamic" dynamic NTK (Hugging Face's "dynamic"): NTK base scaling whose factor follows the
          sequence length T = max(position) + 1 of the call: base' = base * (s T / L - (s - 1))
          ^ (D / (D - 2)) once T > L, plain RoPE up to L. A decoding step rotates its token
          with the frequencies of its own length, so keys cached earlier keep theirs (as in
          Hugging Face's generate); decode then differs from the parallel form past L.
  "longrope" LongRoPE (Ding et al. 2024; Phi-3's "longrope"/"su"): theta_i / short_factor[i] for
          calls of length T = max(position) + 1 up to L, theta_i / long_factor[i] past it (the
          per-pair rescale factors a search found), and q and k times
          sqrt(1 + ln s / ln L) (`attention_factor` > 0 sets it). A decoding step rotates its
          token with the factors of its own length, as "dynamic"; `models.lm.generate`
          re-encodes the whole sequence at the step that crosses L, as Hugging Face's generate
          does, so that what it decodes past L equals the parallel form.

HF checkpoints (Llama, Mistral, Qwen2) rotate pairs (x[i], x[i + D/2]) ("rotate_half"): the
"half" layout, with no permutation of their q/k weights.

Partial rotary (GPT-NeoX's rotary_pct, Phi's partial_rotary_factor): `rotary_dim` R < D rotates
the first R dimensions of each head as RoPE of head dimension R (frequencies base^(-2i/R), pairs
in the layout over those R), and leaves the other D - R as they are. Not p-RoPE (positional/
prope.py), which keeps all D/2 pairs and stops the slowest.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from positional.scheme import Scheme

SCALINGS = ("none", "pi", "ntk", "yarn", "llama3", "dynamic", "longrope")
LAYOUTS = ("half", "interleaved")
RAMPS = ("ratio", "index", "index_exact")


def rope_frequencies(head_dim: int, base: float = 10000.0, scaling: str = "none",
                     factor: float = 1.0, original_max_len: int = 512,
                     beta_fast: float = 32.0, beta_slow: float = 1.0, *, ramp: str = "ratio",
                     low_freq_factor: float = 1.0, high_freq_factor: float = 4.0) -> np.ndarray:
    """Angular frequencies theta_i, [head_dim // 2] float64 (cast at use). For "dynamic", those
    of sequences up to `original_max_len` (`dynamic_frequencies` scales them past it)."""
    if scaling not in SCALINGS:
        raise ValueError(f"unknown RoPE scaling {scaling!r}; valid: {SCALINGS}")
    if ramp not in RAMPS:
        raise ValueError(f"unknown YaRN ramp {ramp!r}; valid: {RAMPS}")
    if factor <= 0:
        raise ValueError(f"RoPE scaling factor must be positive, got {factor}")
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    theta = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling == "pi":
        theta = theta / factor
    elif scaling == "yarn" and ramp != "ratio":
        gamma = 1 - _index_ramp(head_dim, base, original_max_len, beta_fast, beta_slow, ramp == "index")
        theta = (1 - gamma) * theta / factor + gamma * theta
    elif scaling in ("yarn", "llama3"):
        slow, fast = (beta_slow, beta_fast) if scaling == "yarn" else (low_freq_factor, high_freq_factor)
        ratio = original_max_len * theta / (2 * math.pi)  # = L / wavelength
        gamma = np.clip((ratio - slow) / (fast - slow), 0.0, 1.0)
        theta = (1 - gamma) * theta / factor + gamma * theta
    return theta


def _index_ramp(head_dim: int, base: float, length: int, beta_fast: float, beta_slow: float,
                rounded: bool) -> np.ndarray:
    """The YaRN code's ramp, [head_dim // 2]: 0 at pair indices up to the (fractional) index
    where L / wavelength = beta_fast, 1 from the one where it is beta_slow, linear between.
    Pair i has L / wavelength_i = r where i = D ln(L / (2 pi r)) / (2 ln base)."""
    def index(r):
        return head_dim * math.log(length / (2 * math.pi * r)) / (2 * math.log(base))

    low, high = index(beta_fast), index(beta_slow)
    if rounded:
        low, high = math.floor(low), math.ceil(high)
    # The upper clip is D - 1, not D/2 - 1, as in the reference code: it sets the slope when
    # the ramp would end past the last pair.
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    return np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)


def dynamic_frequencies(theta, factor: float, original_max_len: int, length: jax.Array) -> jax.Array:
    """Dynamic NTK: the plain frequencies `theta` [D/2] for a sequence of `length` tokens (a
    traced scalar), fp32. base' = base * g^(D / (D - 2)), g = s max(T, L) / L - (s - 1), so
    theta_i' = theta_i g^(-2i / (D - 2)): pairs that do not rotate (theta_i = 0) stay still."""
    half = len(theta)
    g = factor * jnp.maximum(length, original_max_len).astype(jnp.float32) / original_max_len - (factor - 1)
    exponent = jnp.arange(half, dtype=jnp.float32) * 2 / (2 * half - 2)
    return jnp.asarray(theta, jnp.float32) * g ** -exponent


def yarn_attention_factor(factor: float, attention_factor: float = 0.0) -> float:
    """sqrt(1/t) of YaRN: multiplies both q and k, so logits scale by its square.
    `attention_factor` > 0 is that value, given (a checkpoint's config may set it)."""
    if attention_factor > 0:
        return attention_factor
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
    `_cos_sin`, this is faster than the plain form on CPU and brought the learned-angle Q/K/V
    schemes closer to RoPE's training speed (benchmarks/RESULTS.md, section 'The rotation's
    cos/sin once per angle, and its written-out VJP').
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
    `rope_qkv` equals SO(2) transport with position-only steps exactly (tests/positional/test_so2.py).
    """
    base: float = 10000.0
    scaling: str = "none"
    factor: float = 1.0
    original_max_len: int = 512
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    layout: str = "half"
    rotate_values: bool = False
    ramp: str = "ratio"  # yarn: "ratio", "index" or "index_exact" (see the module docstring)
    attention_factor: float = 0.0  # yarn: sqrt(1/t) (0: 0.1 ln factor + 1); longrope: (0: sqrt(1 + ln s / ln L))
    short_factor: tuple = ()  # longrope: pair i's rescale factor up to original_max_len
    long_factor: tuple = ()  # longrope: ... past it
    low_freq_factor: float = 1.0  # llama3: ratio L / wavelength below which theta / factor
    high_freq_factor: float = 4.0  # llama3: ... above which theta is kept
    rotary_dim: int = 0  # partial rotary: the first rotary_dim dimensions rotate (0: all of them)

    needs_even_head_dim = True
    probes = ("rope_pairs",)

    def __post_init__(self):
        super().__post_init__()
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown RoPE layout {self.layout!r}; valid: {LAYOUTS}")
        if self.scaling == "dynamic" and self.rotary_dims < 4:
            raise ValueError(f"dynamic RoPE scaling needs head_dim >= 4; got {self.rotary_dims}")
        if not (0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim={self.rotary_dim} must be an even number from 2 to head_dim="
                             f"{self.head_dim} (the dimensions of each head that rotate), or 0 for all of them")
        for name in ("short_factor", "long_factor"):  # tuples, hashable (a config file may give lists)
            object.__setattr__(self, name, tuple(float(f) for f in getattr(self, name)))
        if self.scaling == "longrope" and self.rotate_values:
            raise ValueError("longrope RoPE scaling rotates queries and keys only; rotate_values is not supported")
        if self.scaling == "longrope" and not (len(self.short_factor) == len(self.long_factor) == self.rotary_dims // 2
                                               and min(self.short_factor + self.long_factor) > 0):
            raise ValueError(f"longrope RoPE scaling needs short_factor and long_factor of {self.rotary_dims // 2} "
                             f"positive numbers each (one per rotated pair); got {len(self.short_factor)} and "
                             f"{len(self.long_factor)}")
        self.theta  # validates the options

    @property
    def rotary_dims(self) -> int:
        """The dimensions of each head that rotate: the first rotary_dims."""
        return self.rotary_dim or self.head_dim

    def rotated_part(self, x) -> jax.Array:
        """x [..., D] cut to the dimensions that rotate, those whose pairs `theta` gives."""
        return x[..., :self.rotary_dims]

    @property
    def theta(self) -> np.ndarray:
        return rope_frequencies(self.rotary_dims, self.base, self.scaling, self.factor,
                                self.original_max_len, self.beta_fast, self.beta_slow, ramp=self.ramp,
                                low_freq_factor=self.low_freq_factor, high_freq_factor=self.high_freq_factor)

    def angles(self, positions) -> jax.Array:
        """Rotation angles [B, T, 1, D/2] of tokens at `positions` [B, T]; with dynamic scaling,
        under the frequencies of the call's length, max(positions) + 1."""
        theta = self.theta
        if self.scaling == "dynamic":
            theta = dynamic_frequencies(theta, self.factor, self.original_max_len, jnp.max(positions) + 1)
        if self.scaling == "longrope":
            long = jnp.max(positions) + 1 > self.original_max_len
            theta = jnp.where(long, theta / np.asarray(self.long_factor), theta / np.asarray(self.short_factor))
        return rope_angles(positions, theta)

    def transform(self, q, k, v, features, positions):
        angles = self.angles(positions)
        # YaRN's and LongRoPE's temperature scales the rotated dims only (as Hugging Face's cos and
        # sin carry it), all of them unless the rotary is partial.
        scale = self.temperature ** 2 if self.scaling in ("yarn", "longrope") else 1.0

        def turn(q, k, v):
            q, k, v = rotate_qkv(q, k, v, angles, self.layout, self.rotate_values)
            return (q if scale == 1.0 else q * jnp.asarray(scale, q.dtype)), k, v

        return self.partly(turn, q, k, v)

    @property
    def temperature(self) -> float:
        """The factor YaRN and LongRoPE multiply q and k by (logits by its square)."""
        if self.scaling == "longrope":
            if self.attention_factor > 0 or self.factor <= 1:
                return self.attention_factor or 1.0
            return math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_len))
        return yarn_attention_factor(self.factor, self.attention_factor)

    @property
    def reencode_length(self) -> int | None:
        """LongRoPE: the length past which every key's angles change (short to long factors);
        `models.lm.generate` re-encodes the sequence when decoding crosses it."""
        return self.original_max_len if self.scaling == "longrope" else None

    def transform_out(self, out, features, positions):
        angles = self.angles(positions)
        return self.partly(lambda out: rotate_out(out, angles, self.layout, self.rotate_values), out)

    def partly(self, fn, *xs):
        """fn on the dimensions that rotate of each x [..., D], the others passed through."""
        r = self.rotary_dims
        if r == self.head_dim:
            return fn(*xs)
        out = fn(*(x[..., :r] for x in xs))
        joined = [jnp.concatenate([a, x[..., r:]], axis=-1) for a, x in zip(out if len(xs) > 1 else (out,), xs)]
        return tuple(joined) if len(xs) > 1 else joined[0]
