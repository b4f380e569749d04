"""Per-token features of the learned or random position schemes (the scheme contract, part 1).

A features module is built as `Module(scheme, cfg, rngs=rngs)` and called as
`module(x, *, tokens, index, segment_ids, rng)` with x [B, T, d_model]; tokens, index (each
token's index in the sequence: 0..T-1 in the parallel form, the cache slot when decoding) and
segment_ids [B, T]; `rng` a per-layer key (or None). It returns the pytree the scheme's hooks
read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from positional import espr, so2


class StepAngles(nnx.Module):
    """SO(2) step angles psi_t [B, T, nb] and their accumulation theta (positional/so2.py).

    scheme.steps selects the source:
      "random":  psi ~ Uniform(-f_b, f_b), f_b the RoPE frequencies (base 10^4), i.i.d. per
                 token and block, shared by the heads, a fresh draw for every forward pass from
                 the `rng` the caller passes (training step, evaluation window); with
                 scheme.draw_seed >= 0 the draw is fixed instead.
      "learned": psi_t = omega + g[token_t], g a learned vocab x nb table, per layer (as in the
                 paper). omega = f_b, fixed: a learned omega would be redundant with adding the
                 same vector to every row of g. g starts at 0, so the model starts as RoPE-like
                 position-only transport and learns how much each token advances each block.
      "hidden":  psi_t = omega + W h_t, a projection of the layer input (not in the paper: the
                 step reads the context, not only the token id); W starts at 0, as g does.
    """

    def __init__(self, scheme, cfg, *, rngs: nnx.Rngs):
        self.scheme = scheme
        nb = scheme.head_dim // 2
        self.omega = scheme.frequencies
        if scheme.steps == "learned":
            self.table = nnx.Param(jnp.zeros((cfg.vocab_size, nb), jnp.float32))
        elif scheme.steps == "hidden":
            self.proj = nnx.Linear(cfg.d_model, nb, use_bias=False, rngs=rngs,
                                   kernel_init=nnx.initializers.zeros_init())

    def __call__(self, x, *, tokens, index, segment_ids=None, rng=None):
        steps = self.scheme.steps
        if steps == "random":
            psi = self.scheme.random_steps(rng, index, segment_ids)
        elif steps == "learned":
            psi = self.omega + self.table[...][tokens]
        else:
            psi = self.omega + self.proj(x).astype(jnp.float32)
        return {"psi": psi, "theta": so2.accumulate(psi, segment_ids)}


class EsprFeatures(nnx.Module):
    """The learned parts of ESPR / STRING (positional/espr.py), shared by its heads, per layer.

    beta [m, d_c] starts at axial RoPE frequencies; the basis U = Cayley(skew(A_U)) and the
    post-rotation P = Cayley(skew(A_P)) start at I (A = 0), so the layer starts as axial RoPE.
    With scheme.relaxed, the generators get a free skew part skew(E_k), starting at 0.
    With scheme.learned False nothing is learned: axial RoPE with U = P = I.
    EsprRF also draws w [n_rf, 2m] ~ N(0, I): from `rng` every forward pass, or fixed by
    scheme.draw_seed >= 0.
    """

    def __init__(self, scheme, cfg, *, rngs: nnx.Rngs):
        self.scheme = scheme
        d, m = scheme.head_dim, scheme.planes
        beta = np.asarray(espr.axial_beta(m, scheme.num_axes, scheme.base), np.float32)  # numpy: as omega above
        if scheme.learned:
            self.beta = nnx.Param(jnp.asarray(beta))
            self.basis_skew = nnx.Param(jnp.zeros((d, d), jnp.float32))
            self.post_skew = nnx.Param(jnp.zeros((d, d), jnp.float32))
        else:
            self.beta = beta
        if scheme.relaxed:
            self.drift = nnx.Param(jnp.zeros((scheme.num_axes, d, d), jnp.float32))

    def __call__(self, x, *, tokens, index, segment_ids=None, rng=None):
        scheme = self.scheme
        if scheme.learned:
            basis = espr.cayley(espr.skew(self.basis_skew[...]))
            post = espr.cayley(espr.skew(self.post_skew[...]))
        else:
            basis = post = jnp.eye(scheme.head_dim, dtype=jnp.float32)
        drift = self.drift[...] if scheme.relaxed else None
        return scheme.features_from(jnp.asarray(self.beta[...]), basis, post, drift, rng)


class HouseholderVectors(nnx.Module):
    """PaTH's per-token Householder vectors and gains (positional/path/), per layer.

    w_t = normalise(conv(W_up W_down x_t)) per kv head: a rank-`scheme.rank` projection, as in
    the public PaTH layer, then (scheme.conv > 0) a causal depthwise convolution of that width
    with SiLU, restarted at document starts; beta_t = 2 sigmoid(W_b x_t + b) in (0, 2) per kv
    head, starting near 1 (b = 0). Decoding, the convolution reads the previous projections
    from the layer cache (`past`), where the scheme stores them (`Path.feature_cache`).
    """

    def __init__(self, scheme, cfg, *, rngs: nnx.Rngs):
        self.scheme, self.kv_heads = scheme, cfg.resolved_kv_heads
        width = cfg.resolved_kv_heads * scheme.head_dim
        init = nnx.initializers.normal
        self.down = nnx.Linear(cfg.d_model, scheme.rank, use_bias=False, rngs=rngs,
                               kernel_init=init(stddev=cfg.d_model ** -0.5))
        self.up = nnx.Linear(scheme.rank, width, use_bias=False, rngs=rngs,
                             kernel_init=init(stddev=scheme.rank ** -0.5))
        self.gain = nnx.Linear(cfg.d_model, cfg.resolved_kv_heads, rngs=rngs,
                               kernel_init=init(stddev=cfg.d_model ** -0.5))
        if scheme.conv:
            self.kernel = nnx.Param(init(stddev=scheme.conv ** -0.5)(rngs.params(), (scheme.conv, width)))
        self.reads_past = bool(scheme.conv)

    def __call__(self, x, *, tokens, index, segment_ids=None, rng=None, past=None):
        b, t, _ = x.shape
        u = self.up(self.down(x.astype(jnp.float32)))  # [B, T, K * D]
        out = {"beta": 2 * jax.nn.sigmoid(self.gain(x.astype(jnp.float32)))}
        if self.scheme.conv:
            out["w_in"] = u
            u = self._conv(u, segment_ids, past)
        w = u.reshape(b, t, self.kv_heads, -1)
        out["w"] = w * jax.lax.rsqrt(jnp.sum(w * w, -1, keepdims=True) + 1e-12)
        return out

    def _conv(self, u, segment_ids, past):
        """Causal depthwise convolution of width c: sum_s kernel[s] u_{t-s}, then SiLU."""
        c, t = self.scheme.conv, u.shape[1]
        if past is None:  # parallel form: zeros before the start, none across documents
            seg = jnp.zeros(u.shape[:2], jnp.int32) if segment_ids is None else segment_ids
            hist = jnp.pad(u, ((0, 0), (c - 1, 0), (0, 0)))
            hist_seg = jnp.pad(seg, ((0, 0), (c - 1, 0)), constant_values=-1)
        else:  # decoding: the c - 1 projections before the cache index, zeros before token 0
            start = past["index"] - (c - 1)
            padded = jnp.pad(past["features"]["w_in"], ((0, 0), (c - 1, 0), (0, 0)))
            prev = jax.lax.dynamic_slice_in_dim(padded, start + c - 1, c - 1, axis=1)
            hist = jnp.concatenate([prev, u], axis=1)
            hist_seg = jnp.where(start + jnp.arange(t + c - 1) >= 0, 0, -1)[None]
            seg = jnp.zeros(u.shape[:2], jnp.int32)
        acc = 0.0
        for s in range(c):  # tap s reads token t - s
            same = (hist_seg[:, c - 1 - s:c - 1 - s + t] == seg)[..., None]
            acc = acc + self.kernel[s] * jnp.where(same, hist[:, c - 1 - s:c - 1 - s + t], 0.0)
        return jax.nn.silu(acc)


class ForgetGate(nnx.Module):
    """FoX forget gates log f_t = log sigmoid(W_f x_t + b_f), one per query head (positional/fox.py).

    b_f starts at the scheme's gate_bias: 0 by default, as in the public FoX layer (f near 1/2:
    the model starts local and learns how far each head should remember); b_f = 5 starts at
    f = 0.993, a memory of about 150 tokens.
    """

    def __init__(self, scheme, cfg, *, rngs: nnx.Rngs):
        self.proj = nnx.Linear(cfg.d_model, scheme.num_heads, rngs=rngs,
                               kernel_init=nnx.initializers.normal(stddev=cfg.d_model ** -0.5),
                               bias_init=nnx.initializers.constant(scheme.gate_bias))

    def __call__(self, x, *, tokens, index, segment_ids=None, rng=None):
        return {"log_forget": jax.nn.log_sigmoid(self.proj(x.astype(jnp.float32)))}


class Parameters(nnx.Module):
    """The learned parameters a scheme declares (`Scheme.init_parameters`: KERPLE's r1 and r2,
    T5's table), held per layer under their names and returned as the features, whatever the
    input: a scheme that learns only these needs no module of its own."""

    def __init__(self, scheme, cfg, *, rngs: nnx.Rngs):
        init = scheme.init_parameters(rngs.params())
        self.names = tuple(init)
        for name, x in init.items():
            setattr(self, name, nnx.Param(x))

    def __call__(self, x, **kw):
        return {name: getattr(self, name)[...] for name in self.names}


class MergedFeatures(nnx.Module):
    """The features modules of a composed scheme ("path+fox"): one merged dict."""

    def __init__(self, modules):
        self.parts = nnx.List(modules)
        self.reads_past = any(getattr(m, "reads_past", False) for m in modules)

    def __call__(self, x, past=None, **kw):
        out = {}
        for m in self.parts:
            got = m(x, **kw, **({"past": past} if getattr(m, "reads_past", False) else {}))
            clash = set(out) & set(got)
            if clash:
                raise ValueError(f"composed schemes both produce feature(s) {sorted(clash)}")
            out.update(got)
        return out
