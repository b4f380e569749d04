"""The Sessa macro-block and the mixers compared inside it (Sessa paper, Sec 3 and Sec 5).

One block, no separate MLP (the mixer sits inside a gated-MLP-style wrapper):

    (a, g) = split(LN(x) W_in + b_in)          W_in: D x 2D, a first
    s      = Mixer(GELU(a))                    exact GELU
    y      = x + (s * g) W_out + b_out         g is a linear gate

Mixers (`ModelConfig.mixer`), all [B, T, D] -> [B, T, D]:
  sessa       multi-head causal attention under the configured position scheme (f), then the
              feedback solve (I - B) s = f with B = gamma alpha_fb: single-head attention over
              the strict past at full width, no position encoding, gamma_t = gamma_max
              tanh(w_g . abar_t + b_g), b_g initialised to 1.0 as the official code does.
  sessa_nofb  the ablation B = 0 (s = f): the feedback branch removed, the rest unchanged.
  transformer the attention mixer alone, to be matched to Sessa in parameters by width
              (`models.lm.param_count`, `matched_width`); at equal width it is sessa_nofb.
  mamba2      a Mamba2-style selective SSM: causal depthwise conv + SiLU on (x, B, C),
              per-head dt = softplus(.), a_t = exp(-dt exp(A_log)), scalar decay per head,
              h_t = a_t h_{t-1} + dt_t x_t B_t^T, y_t = h_t C_t + D x_t, by the chunked SSD
              algorithm (`ssd_chunked`, tested against `ssd_sequential`).

Mixer options (`ModelConfig.mixer_options`): gamma_max (0.999), feedback_dim (D), solve
("reference" | "blocked" | "pallas"), solve_block (0: the solve's own, 256 blocked, the kernel's by
platform and widths) for Sessa; state_dim (16), conv_width (4), chunk (64) for mamba2. Decoding:
Sessa caches forward keys and values (the scheme's cache), feedback keys and past s; mamba2
carries its fixed-size state and the last conv inputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import Attention, linear
from positional.feedback import decode_solve, feedback_solve, gain

SESSA_DEFAULTS = {"gamma_max": 0.999, "feedback_dim": 0, "solve": "reference", "solve_block": 0}
MAMBA2_DEFAULTS = {"state_dim": 16, "conv_width": 4, "chunk": 64}


def _options(cfg, defaults: dict) -> dict:
    options = dict(cfg.mixer_options)
    unknown = set(options) - set(defaults)
    if unknown:
        takes = f"its options: {sorted(defaults)}" if defaults else "it takes none; leave model.mixer_options empty"
        raise ValueError(f"mixer {cfg.mixer!r} has no option(s) {sorted(unknown)}; {takes}")
    return {**defaults, **options}


# ---- attention and Sessa -----------------------------------------------------------------------
class AttentionMixer(nnx.Module):
    """f = causal multi-head attention (models.layers.Attention, any registered scheme); with
    `feedback`, s = (I - B)^{-1} f in fp32."""

    def __init__(self, cfg, *, feedback: bool, rngs: nnx.Rngs):
        self.attn = Attention(cfg, rngs=rngs)
        self.feedback = feedback
        opts = _options(cfg, SESSA_DEFAULTS if feedback else {})
        if not feedback:
            return
        gain(jnp.zeros(()), opts["gamma_max"])  # a clear error now for gamma_max outside (0, 1)
        self.gamma_max, self.solve = opts["gamma_max"], opts["solve"]
        self.solve_block = opts["solve_block"]
        self.feedback_dim = opts["feedback_dim"] or cfg.d_model
        self.qk_b = linear(cfg.d_model, 2 * self.feedback_dim, cfg, rngs, bias=True)
        self.w_g = linear(cfg.d_model, 1, cfg, rngs)
        self.b_g = nnx.Param(jnp.ones((), jnp.float32))  # gamma ~ 0.76 gamma_max at init

    def _feedback_inputs(self, abar):
        qb, kb = jnp.split(self.qk_b(abar), 2, axis=-1)
        return qb, kb, gain(self.w_g(abar)[..., 0] + self.b_g[...], self.gamma_max)

    def __call__(self, abar, *, tokens, positions, segment_ids=None, impl=None, rng=None):
        f = self.attn(abar, tokens=tokens, positions=positions, segment_ids=segment_ids, impl=impl, rng=rng)
        if not self.feedback:
            return f
        qb, kb, gamma = self._feedback_inputs(abar)
        s = feedback_solve(qb, kb, gamma, f, segment_ids, impl=self.solve, block_size=self.solve_block)
        return s.astype(abar.dtype)

    def init_cache(self, batch: int, max_len: int) -> dict:
        cfg = self.attn.cfg
        cache = self.attn.scheme.init_cache(batch, max_len, cfg.resolved_kv_heads, jnp.dtype(cfg.dtype))
        if not self.feedback:
            return cache
        return {**cache, "kb": jnp.zeros((batch, max_len, self.feedback_dim), jnp.float32),
                "s": jnp.zeros((batch, max_len, cfg.d_model), jnp.float32)}

    def decode(self, abar, cache, **kw):
        """kw (tokens, rng, positions) as `models.layers.Attention.decode` takes them."""
        index = cache["index"]
        f, cache = self.attn.decode(abar, cache, **kw)
        if not self.feedback:
            return f, cache
        qb, kb, gamma = self._feedback_inputs(abar)
        s, kb_cache, s_cache = decode_solve(cache["kb"], cache["s"], index, qb, kb, gamma, f)
        return s.astype(abar.dtype), {**cache, "kb": kb_cache, "s": s_cache}


# ---- Mamba2-style selective SSM ----------------------------------------------------------------
def _segsum(a):
    """[..., L] -> [..., L, L]: out[i, j] = sum_{j < k <= i} a_k for j <= i, -inf above the diagonal.

    Summed from masked copies rather than as a difference of cumulative sums, which would lose
    precision once the cumulative log-decay is large."""
    n = a.shape[-1]
    x = jnp.where(jnp.tril(jnp.ones((n, n), bool), -1), a[..., :, None], 0.0)  # x[k, j] = a_k, k > j
    x = jnp.cumsum(x, axis=-2)
    return jnp.where(jnp.tril(jnp.ones((n, n), bool)), x, -jnp.inf)


def ssd_sequential(x, log_a, b, c, h0=None):
    """The recurrence, one step at a time: h_t = exp(log_a_t) h_{t-1} + x_t b_t^T, y_t = h_t c_t.

    x [B, T, H, P]; log_a [B, T, H]; b, c [B, T, N]; h0 [B, H, P, N]. Returns (y [B, T, H, P], h_T).
    """
    h0 = jnp.zeros(x.shape[:1] + x.shape[2:] + b.shape[-1:], jnp.float32) if h0 is None else h0

    def step(h, inputs):
        x_t, la_t, b_t, c_t = inputs
        h = jnp.exp(la_t)[..., None, None] * h + x_t[..., None] * b_t[:, None, None, :]
        return h, jnp.einsum("bhpn,bn->bhp", h, c_t)

    h, y = jax.lax.scan(step, h0, tuple(jnp.moveaxis(z, 1, 0) for z in (x, log_a, b, c)))
    return jnp.moveaxis(y, 0, 1), h


def ssd_chunked(x, log_a, b, c, h0=None, *, chunk: int = 64):
    """The same map by the SSD chunked algorithm: quadratic attention-like form inside chunks of
    `chunk` steps, the recurrence only across chunk boundaries. Shapes as `ssd_sequential`."""
    bsz, t, h, p = x.shape
    n = b.shape[-1]
    q = min(chunk, t)
    pad = -t % q
    # Padded steps come last with x = 0 and log_a = 0: they change neither y nor the state.
    x, log_a, b, c = (jnp.pad(z.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (z.ndim - 2))
                      for z in (x, log_a, b, c))
    k = (t + pad) // q
    x, b, c = x.reshape(bsz, k, q, h, p), b.reshape(bsz, k, q, n), c.reshape(bsz, k, q, n)
    la = log_a.reshape(bsz, k, q, h).transpose(0, 3, 1, 2)  # [B, H, K, Q]
    cum = jnp.cumsum(la, axis=-1)
    y_in = jnp.einsum("bkln,bksn,bhkls,bkshp->bklhp", c, b, jnp.exp(_segsum(la)), x)
    # State each chunk leaves behind, then carried across chunks from h0.
    states = jnp.einsum("bkln,bhkl,bklhp->bkhpn", b, jnp.exp(cum[..., -1:] - cum), x)
    h0 = jnp.zeros((bsz, h, p, n), jnp.float32) if h0 is None else h0
    states = jnp.concatenate([h0[:, None], states], axis=1)
    carry = jnp.exp(_segsum(jnp.pad(cum[..., -1], ((0, 0), (0, 0), (1, 0)))))  # [B, H, K+1, K+1]
    states = jnp.einsum("bhzk,bkhpn->bzhpn", carry, states)
    y_across = jnp.einsum("bkln,bkhpn,bhkl->bklhp", c, states[:, :-1], jnp.exp(cum))
    y = (y_in + y_across).reshape(bsz, k * q, h, p)[:, :t]
    return y, states[:, -1]


class Mamba2Mixer(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs):
        opts = _options(cfg, MAMBA2_DEFAULTS)
        d, h = cfg.d_model, cfg.num_heads
        if d % h:
            raise ValueError(f"mamba2 mixer: d_model={d} must be a multiple of num_heads={h}")
        self.heads, self.state_dim, self.chunk = h, opts["state_dim"], opts["chunk"]
        self.conv_width = opts["conv_width"]
        channels = d + 2 * self.state_dim
        self.in_proj = linear(d, channels + h, cfg, rngs, bias=True)  # x, B, C and dt
        self.conv_w = nnx.Param(jax.random.normal(rngs.params(), (self.conv_width, channels)) *
                                self.conv_width ** -0.5)
        self.conv_b = nnx.Param(jnp.zeros((channels,)))
        # Mamba's initialisation: dt log-uniform in [1e-3, 0.1], decay rates uniform in [1, 16].
        dt = jnp.exp(jax.random.uniform(rngs.params(), (h,), minval=math.log(1e-3), maxval=math.log(0.1)))
        self.dt_bias = nnx.Param(dt + jnp.log(-jnp.expm1(-dt)))  # softplus^{-1}(dt)
        self.a_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (h,), minval=1.0, maxval=16.0)))
        self.d_skip = nnx.Param(jnp.ones((h,)))

    def _conv(self, u, past):
        """Causal depthwise conv + SiLU. u [B, n, C]; past [B, width-1, C] (the previous inputs)."""
        full = jnp.concatenate([past, u], axis=1)
        n = u.shape[1]
        out = sum(full[:, i:i + n] * self.conv_w[i] for i in range(self.conv_width)) + self.conv_b[...]
        return jax.nn.silu(out), full[:, -(self.conv_width - 1):]

    def _mix(self, abar, conv_past, h0):
        bsz, n, d = abar.shape
        proj = self.in_proj(abar).astype(jnp.float32)
        u, dt = proj[..., :-self.heads], proj[..., -self.heads:]
        u, conv_past = self._conv(u, conv_past)
        x, b, c = jnp.split(u, [d, d + self.state_dim], axis=-1)
        x = x.reshape(bsz, n, self.heads, d // self.heads)
        dt = jax.nn.softplus(dt + self.dt_bias[...])
        log_a = -dt * jnp.exp(self.a_log[...])
        y, h = ssd_chunked(x * dt[..., None], log_a, b, c, h0, chunk=self.chunk)
        y = y + self.d_skip[...][:, None] * x
        return y.reshape(bsz, n, d).astype(abar.dtype), conv_past, h

    def __call__(self, abar, *, tokens=None, positions=None, segment_ids=None, impl=None, rng=None):
        """Packed sequences are not separated (the state flows across segment boundaries)."""
        return self._mix(abar, self._empty_conv(abar.shape[0]), None)[0]

    def _empty_conv(self, batch):
        return jnp.zeros((batch, self.conv_width - 1, self.conv_w.shape[1]), jnp.float32)

    def init_cache(self, batch: int, max_len: int) -> dict:
        """A fixed-size state: max_len only bounds the position index."""
        d = self.in_proj.in_features
        return {"h": jnp.zeros((batch, self.heads, d // self.heads, self.state_dim), jnp.float32),
                "conv": self._empty_conv(batch), "index": jnp.zeros((), jnp.int32)}

    def decode(self, abar, cache, *, tokens=None, rng=None, positions=None):
        y, conv, h = self._mix(abar, cache["conv"], cache["h"])
        return y, {"h": h, "conv": conv, "index": cache["index"] + abar.shape[1]}


MIXERS = {
    "sessa": lambda cfg, rngs: AttentionMixer(cfg, feedback=True, rngs=rngs),
    "sessa_nofb": lambda cfg, rngs: AttentionMixer(cfg, feedback=False, rngs=rngs),
    "transformer": lambda cfg, rngs: AttentionMixer(cfg, feedback=False, rngs=rngs),
    "mamba2": lambda cfg, rngs: Mamba2Mixer(cfg, rngs=rngs),
}


class MacroBlock(nnx.Module):
    """x + (Mixer(GELU(a)) * g) W_out + b_out, (a, g) = LN(x) W_in + b_in."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        if cfg.mixer not in MIXERS:
            raise ValueError(f"unknown mixer {cfg.mixer!r}; valid: attention, {', '.join(MIXERS)}")
        d, dtype = cfg.d_model, jnp.dtype(cfg.dtype)
        self.norm = nnx.LayerNorm(d, epsilon=1e-5, dtype=dtype, rngs=rngs)
        self.in_proj = linear(d, 2 * d, cfg, rngs, bias=True)
        self.mixer = MIXERS[cfg.mixer](cfg, rngs)
        self.out_proj = linear(d, d, cfg, rngs, bias=True)

    def _gate_inputs(self, x):
        a, g = jnp.split(self.in_proj(self.norm(x)), 2, axis=-1)
        return jax.nn.gelu(a, approximate=False), g

    def __call__(self, x, **kw):
        abar, g = self._gate_inputs(x)
        return x + self.out_proj(self.mixer(abar, **kw) * g)

    def init_cache(self, batch: int, max_len: int) -> dict:
        return self.mixer.init_cache(batch, max_len)

    def decode(self, x, cache, **kw):
        abar, g = self._gate_inputs(x)
        s, cache = self.mixer.decode(abar, cache, **kw)
        return x + self.out_proj(s * g), cache
