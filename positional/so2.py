"""Accumulated token-dependent SO(2) transport ("Why do accumulated transformations extrapolate?").

Each token t emits step angles psi_t [nb] (one per 2-D block, nb = head_dim / 2). The
transport to token i is the exclusive prefix Theta_i = sum_{t < i} psi_t (reset at document
boundaries), so the route from key j to query i is P_{j->i} = R(Theta_j - Theta_i): it holds
the steps of tokens j..i-1, including the source's, excluding the query's own.

As in the paper, queries and keys are rotated by R(-Theta) before an ordinary attention call,
q~_i . k~_j = q_i . R(Theta_i - Theta_j) k_j; the Q/K/V variant also pre-rotates values by
R(+Theta_j) and post-rotates each head output by R(-Theta_i), so the output is
sum_j a_ij P_{j->i} v_j. Angles are fp32 and wrapped into [-pi, pi) at every addition of the
scan, so their error does not grow with position. Position-only steps psi_t = -f (f the RoPE
frequencies) give Theta_i = -i f and reproduce RoPE exactly.

Shapes: psi, theta [B, T, nb]; q [B, T, H, D]; k, v [B, T, K, D]; segment_ids [B, T].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from positional.angles import wrap, wrapped_add
from positional.rope import rope_frequencies, rotate_out, rotate_qkv
from positional.scheme import Scheme, dense, linear_parameters
from positional.softmax import segment_starts


STEP_SOURCES = ("random", "learned", "hidden")


def accumulate(psi: jax.Array, segment_ids: jax.Array | None = None) -> jax.Array:
    """Exclusive, segment-reset, wrapped prefix sum of step angles: Theta [B, T, nb] in fp32.

    Theta_i = sum of psi_t over t < i in the same segment (0 at each segment start), computed
    by `jax.lax.associative_scan` on (hi, lo) fp32 pairs: every addition keeps its rounding
    error in `lo` and every wrap subtracts whole turns from `hi` exactly. A plain wrapped fp32
    scan drifts systematically over tens of thousands of tokens of RoPE-like drift; this one
    stays at float32 resolution (tests/positional/test_so2.py checks it at 65,536 tokens against
    a float64 reference).
    """
    psi = psi.astype(jnp.float32)
    start = segment_starts(segment_ids, psi.shape[:2])
    # Shift right inside each segment: token i receives psi_{i-1}, segment starts receive 0.
    shifted = wrap(jnp.where(start[..., None], 0.0, jnp.roll(psi, 1, axis=1)))
    reset = jnp.broadcast_to(start[..., None], psi.shape)

    def combine(a, b):  # segmented sum: b's running value restarts where b saw a segment start
        (ha, la, ra), (hb, lb, rb) = a, b
        hi, lo = wrapped_add(ha, la + lb, hb)
        return jnp.where(rb, hb, hi), jnp.where(rb, lb, lo), ra | rb

    hi, lo, _ = jax.lax.associative_scan(combine, (shifted, jnp.zeros_like(shifted), reset), axis=1)
    return wrap(hi + lo)


def index_in_segment(index: jax.Array, segment_ids: jax.Array | None) -> jax.Array:
    """Each token's index counted from the start of its segment: [B, T] int32."""
    if segment_ids is None:
        return index
    start = segment_starts(segment_ids, index.shape)
    return index - jax.lax.cummax(jnp.where(start, index, 0), axis=1)


def uniform_steps(key: jax.Array, draw_index: jax.Array, frequencies: jax.Array) -> jax.Array:
    """psi ~ Uniform(-f_b, f_b), i.i.d. per row, token and block: [B, T, nb].

    The draw for a token is a function of (key, its row, draw_index), with draw_index its
    index in its document (`index_in_segment`), so the parallel form, the decode form and a
    packed row see the same angles, and shifting position ids changes nothing.
    """
    def one(row, position):
        k = jax.random.fold_in(jax.random.fold_in(key, row), position)
        return jax.random.uniform(k, frequencies.shape, jnp.float32, -1.0, 1.0)

    rows = jnp.broadcast_to(jnp.arange(draw_index.shape[0])[:, None], draw_index.shape)
    return jax.vmap(jax.vmap(one))(rows, draw_index) * frequencies


@dataclasses.dataclass(frozen=True)
class SO2(Scheme):
    """Rotation of q, k (and v, out) by accumulated angles; `features` = {'psi', 'theta'}.

    Per layer, the step angles psi [B, T, nb] come from `steps`:
      "random":  psi ~ Uniform(-f_b, f_b), f_b the RoPE frequencies (base 10^4), i.i.d. per
                 token and block, shared by the heads, a fresh draw for every forward pass from
                 the `rng` the caller passes (training step, evaluation window); with
                 draw_seed >= 0 the draw is fixed instead.
      "learned": psi_t = omega + g[token_t], g a learned vocab x nb table (as in the paper).
                 omega = f_b, fixed: a learned omega would be redundant with adding the same
                 vector to every row of g. g starts at 0, so the model starts as RoPE-like
                 position-only transport and learns how much each token advances each block.
      "hidden":  psi_t = omega + W h_t, a projection of the layer input (not in the paper: the
                 step reads the context, not only the token id); W starts at 0, as g does.
    and theta = accumulate(psi, segment_ids); the decode form keeps the running angle after the
    last cached token.
    """
    steps: str = "learned"  # where psi comes from: "random" | "learned" | "hidden"
    rotate_values: bool = False
    layout: str = "half"
    draw_seed: int = -1  # random steps: >= 0 fixes the draw instead of a fresh one per forward pass

    needs_even_head_dim = True
    needs_features = True
    probes = ("angles",)

    @property
    def random_features(self) -> bool:
        return self.steps == "random"

    def __post_init__(self):
        super().__post_init__()
        if self.steps not in STEP_SOURCES:
            raise ValueError(f"unknown SO(2) step source steps={self.steps!r}; valid: {STEP_SOURCES}")

    @property
    def frequencies(self) -> np.ndarray:
        """f_b, the RoPE frequencies (base 10^4): the position-only step omega and the random
        steps' range. numpy, so a constant even where the model is built abstractly."""
        return np.asarray(rope_frequencies(self.head_dim), np.float32)

    def random_steps(self, key, index, segment_ids=None) -> jax.Array:
        """psi ~ Uniform(-f_b, f_b) for tokens at index [B, T], from `key` (or `draw_seed`)."""
        return uniform_steps(self.draw_key(key), index_in_segment(index, segment_ids), self.frequencies)

    def init_parameters(self, keys, model):
        if self.steps == "learned":
            return {"table": jnp.zeros((model.vocab_size, self.head_dim // 2), jnp.float32)}
        if self.steps == "hidden":
            return {"proj": linear_parameters(keys, model.d_model, self.head_dim // 2, 0.0)}
        return {}

    def features(self, params, x, *, tokens, index, segment_ids=None, rng=None, past=None):
        if self.steps == "random":
            psi = self.random_steps(rng, index, segment_ids)
        elif self.steps == "learned":
            psi = self.frequencies + params["table"][tokens]
        else:
            psi = self.frequencies + dense(x, params["proj"]).astype(jnp.float32)
        return {"psi": psi, "theta": accumulate(psi, segment_ids)}

    def default_features(self, q, k, *, positions, key=None, segment_ids=None):
        """The steps at initialisation: a random draw, or (learned, hidden:
        a zero table or projection) the position-only psi = omega = f_b."""
        b, t = q.shape[:2]
        index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        psi = (self.random_steps(key, index, segment_ids) if self.random_features
               else jnp.broadcast_to(self.frequencies, (b, t, self.head_dim // 2)))
        return {"psi": psi, "theta": accumulate(psi, segment_ids)}

    def transform(self, q, k, v, features, positions):
        return rotate_qkv(q, k, v, -features["theta"][:, :, None, :], self.layout, self.rotate_values)

    def transform_out(self, out, features, positions):
        return rotate_out(out, -features["theta"][:, :, None, :], self.layout, self.rotate_values)

    def init_cache(self, batch, max_len, num_kv_heads, dtype=jnp.float32):
        # The running angle after the last cached token, as an exact (hi, lo) pair.
        zeros = jnp.zeros((batch, self.head_dim // 2), jnp.float32)
        return {**super().init_cache(batch, max_len, num_kv_heads, dtype), "theta": zeros, "theta_lo": zeros}

    def decode_step(self, cache, q, k, v, features=None):
        # The new tokens' local prefix (from 0) moves by the angle accumulated so far.
        hi, lo = cache["theta"][:, None], cache["theta_lo"][:, None]
        theta = wrap((hi + features["theta"]) + lo)
        out, new = super().decode_step(cache, q, k, v, {**features, "theta": theta})
        chunk = wrap(features["theta"][:, -1] + features["psi"][:, -1].astype(jnp.float32))
        new["theta"], new["theta_lo"] = wrapped_add(cache["theta"], cache["theta_lo"], chunk)
        return out, new


def rope_steps(head_dim: int, shape) -> jax.Array:
    """Position-only steps psi = -f that make SO(2) transport equal to RoPE: [*shape, nb]."""
    return jnp.broadcast_to(-jnp.asarray(rope_frequencies(head_dim), jnp.float32), (*shape, head_dim // 2))
