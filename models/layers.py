"""The layers of the decoder LM and the Sessa macro-block: the model config, the attention
layer under any registered position scheme, the gated MLP and the block (pre-norm, or the
norms of OLMo 2 and Gemma: `ModelConfig.norms`).

Layers need not share one attention. Each layer's scheme, scheme options, sliding window and
attention chunk (`LayerAttention`; a layer takes a window or a chunk, Llama 4's chunked local
attention) are the model's (`scheme`, `scheme_options`, `window`, `chunk`) unless its kind says
otherwise: `layer_kinds` names kinds, each a dict of some of those four fields (a kind naming
another scheme drops the model's scheme options; one naming the same scheme updates them);
`layer_pattern` gives the kinds of the first layers, "local*5,global" (a kind n times), and
repeats over the layers, cut where they end (Gemma 3's 26 layers: four whole patterns of six and
two layers); `layer_overrides` sets single layers, "0=global,25=global". In a config file:

    c.model.layer_kinds = {"local": {"window": 512, "scheme_options": {"base": 1e4}},
                           "global": {"scheme_options": {"base": 1e6}}}
    c.model.layer_pattern = "local*5,global"

and on the command line --config.model.layer_pattern=local*3,global,
--config.model.layer_kinds.local.window=1024 (a kind the file defines), or a new kind whole,
"--config.model.layer_kinds.nope={'scheme': 'nope'}".

The attention layer builds its scheme from the registry (models/registry.py) and holds the
scheme's learned parameters (models/features.py); `project` gives the queries, keys, values
and features the scheme's hooks read, for the layer itself and for the probes
(models.lm.attention_internals).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from models.registry import get_entry, make_features, make_scheme


INITS = ("normal", "torch")
# QK-norm, an RMS norm (with a learned scale) of the queries and keys before the scheme's transform:
# "head" over each head's D dimensions (Qwen3, Gemma 3), "projection" over the whole projection,
# H x D or K x D (OLMo 2).
QK_NORMS = ("none", "head", "projection")
# Where each block's norms sit: "pre" x + f(norm(x)) (Llama); "post" x + norm(f(x)) (OLMo 2);
# "sandwich" x + norm'(f(norm(x))), a norm before and after each sublayer (Gemma 2/3).
NORMS = ("pre", "post", "sandwich")
MLP_ACTS = {"silu": nnx.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}  # the gate's activation
KIND_FIELDS = ("scheme", "scheme_options", "window", "chunk")
REMAT_POLICIES = {"none": None, "block": jax.checkpoint_policies.nothing_saveable,
                  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 258
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 0  # 0 means num_heads (no grouped-query attention)
    head_dim: int = 0  # 0 means d_model // num_heads
    mlp_dim: int = 0  # 0 means the SwiGLU convention: 8/3 d_model rounded up to 64
    scheme: str = "rope"
    scheme_options: tuple = ()  # (name, value) pairs, hashable; see `from_dict`
    window: int = 0  # every layer's sliding window (0: none) unless its kind sets one
    chunk: int = 0  # every layer's attention chunk (0: none; Llama 4's chunked local attention) unless its kind sets one
    # Per-layer attention (the module doc): a pattern of kinds, single layers' kinds, and the kinds
    # as (kind, ((field, value), ...)) pairs, hashable (`from_dict` takes {kind: {field: value}}).
    layer_pattern: str = ""
    layer_overrides: str = ""
    layer_kinds: tuple = ()
    tie_embeddings: bool = True
    # Tied head: logits x E^T / sqrt(d_model), O(1) at unit-variance embeddings; False: x E^T
    # (Hugging Face checkpoints).
    scale_tied_logits: bool = True
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    qk_norm: str = "none"  # QK_NORMS
    sinks: bool = False  # a learned sink logit per head in every row's softmax normaliser (gpt-oss)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    norms: str = "pre"  # NORMS
    norm_offset: float = 0.0  # every RMS norm scales by offset + its learned scale (Gemma: 1, the scale from 0)
    mlp_act: str = "silu"  # MLP_ACTS: the gated MLP's activation (SwiGLU; GeGLU with tanh's GELU in Gemma)
    embed_scale: bool = False  # embeddings times sqrt(d_model) on the way in (Gemma)
    # Attention logits are q.k / sqrt(scale_dim) (0: head_dim), queries scaled before the scheme's
    # transform (Gemma's query_pre_attn_scalar).
    scale_dim: int = 0
    # Linear layers: "normal" weights N(0, 1/fan_in) and zero biases; "torch" PyTorch's nn.Linear
    # default, weights and biases U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (the Sessa authors' code).
    init: str = "normal"
    attention_impl: str = "auto"  # or by name: "reference", "blockwise", "ring", "pallas", "cudnn", "splash"
    block_size: int = 512
    dtype: str = "float32"  # compute dtype; parameters stay float32
    # "attention": the blocks above; "sessa", "sessa_nofb", "transformer", "mamba2": the Sessa
    # macro-block with that mixer (models/sessa.py), configured by mixer_options (pairs, hashable).
    mixer: str = "attention"
    mixer_options: tuple = ()
    # Rematerialisation of each block in the backward pass (REMAT_POLICIES): "none" keeps every
    # activation; "block" keeps only each block's input; "dots" also keeps the matmul outputs
    # without batch dimensions (the projections), recomputing the rest.
    remat: str = "none"

    @classmethod
    def from_dict(cls, d) -> "ModelConfig":
        d = dict(d)
        d["scheme_options"] = _options(d.get("scheme_options", {}))
        d["mixer_options"] = tuple(sorted(dict(d.get("mixer_options", {})).items()))
        d["layer_kinds"] = tuple(sorted((name, _kind(name, fields))
                                        for name, fields in dict(d.get("layer_kinds", {})).items()))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config field(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**d)

    def __post_init__(self):
        if self.init not in INITS:
            raise ValueError(f"model.init={self.init!r} is not an initialisation; valid: {', '.join(INITS)}")
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"model.qk_norm={self.qk_norm!r}; valid: {', '.join(QK_NORMS)} (an RMS norm of q and k "
                             "per head, or over the whole projection)")
        for field, value, valid in (("norms", self.norms, NORMS), ("mlp_act", self.mlp_act, MLP_ACTS)):
            if value not in valid:
                raise ValueError(f"model.{field}={value!r}; valid: {', '.join(valid)}")
        if self.scale_dim < 0:
            raise ValueError(f"model.scale_dim={self.scale_dim} must be >= 0: logits are q.k / sqrt(scale_dim), "
                             "0 for head_dim")
        if self.mixer == "attention" and self.mixer_options:
            raise ValueError(f"model.mixer_options {dict(self.mixer_options)} set, but model.mixer='attention' "
                             "has none; they configure the Sessa macro-block mixers (models/sessa.py)")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r} is not a rematerialisation policy; valid: "
                             f"{', '.join(REMAT_POLICIES)}")
        if self.num_heads <= 0 or (self.head_dim == 0 and self.d_model % self.num_heads):
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.num_heads="
                             f"{self.num_heads}; set model.head_dim explicitly")
        if self.resolved_kv_heads <= 0 or self.num_heads % self.resolved_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                             f"model.num_kv_heads={self.resolved_kv_heads}")
        kinds = self.layer_kinds_by_name
        if (self.layer_pattern or self.layer_overrides) and self.mixer != "attention":
            raise ValueError(f"model.layer_pattern / layer_overrides set the attention of each layer, and "
                             f"model.mixer={self.mixer!r} has one attention for every block; leave them empty")
        for field in ("window", "chunk"):
            if getattr(self, field) and self.mixer != "attention":
                what = "sliding window" if field == "window" else "attention chunk"
                raise ValueError(f"model.{field}={getattr(self, field)}: the {what} is the attention blocks', and "
                                 f"model.mixer={self.mixer!r} has none; set {field} 0")
        for field, kind in [("layer_pattern", k) for k in _pattern(self.layer_pattern)] + [
                ("layer_overrides", k) for k in _overrides(self.layer_overrides, self.num_layers).values()]:
            if kind not in kinds:
                raise ValueError(f"model.{field} names the layer kind {kind!r}, which model.layer_kinds does not "
                                 f"define (defined: {', '.join(kinds) or 'none'}); define it, e.g. "
                                 f"--config.model.layer_kinds.{kind}=\"{{'window': 512}}\"")
        for i in range(self.num_layers):
            self.layer(i)  # each layer's fields checked

    # The fields above are what was asked for, 0 meaning "derive it"; the model reads the values
    # below. The fields stay as given (a width change, `models.lm.matched_width`, derives again).
    @property
    def resolved_kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def resolved_mlp_dim(self) -> int:
        return self.mlp_dim or -(-8 * self.d_model // 3 // 64) * 64

    @property
    def layer_kinds_by_name(self) -> dict:
        return {name: dict(fields) for name, fields in self.layer_kinds}

    def layer_kind(self, i: int) -> str | None:
        """The kind of layer i (module doc): its override, else the pattern's; None: the model's."""
        pattern = _pattern(self.layer_pattern)
        default = pattern[i % len(pattern)] if pattern else None
        return _overrides(self.layer_overrides, self.num_layers).get(i, default)

    def layer(self, i: int) -> "LayerAttention":
        """Layer i's attention: the model's scheme, options and window, with its kind's applied."""
        kind = self.layer_kind(i)
        fields = self.layer_kinds_by_name.get(kind, {})
        scheme = fields.get("scheme", self.scheme)
        options = dict(self.scheme_options) if scheme == self.scheme else {}
        options.update(dict(fields.get("scheme_options", ())))
        where = f"model.layer_kinds.{kind}" if fields else "model"
        window, chunk = fields.get("window", self.window), fields.get("chunk", self.chunk)
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"{where}.window={window!r} (layer {i}) must be an int >= 0: 0 for none, W for a "
                             "sliding window of W tokens (each query and the W - 1 before it)")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            raise ValueError(f"{where}.chunk={chunk!r} (layer {i}) must be an int >= 0: 0 for none, C for chunked "
                             "local attention (each query sees its own chunk of C tokens, up to itself)")
        if window and chunk:
            raise ValueError(f"{where} (layer {i}): window={window} and chunk={chunk}; a layer takes one of the two "
                             "(set the other 0 in its kind)")
        try:
            entry = get_entry(scheme)
        except ValueError as e:
            raise ValueError(f"{where}.scheme (layer {i}): {e}") from None
        if (window or chunk) and not entry.scheme_cls.generic_attention:
            raise ValueError(f"{where}.{'window' if window else 'chunk'}={window or chunk} (layer {i}): scheme "
                             f"{scheme!r} brings its own attention, which takes no sliding window or chunks; set it 0 "
                             "for its layers")
        if self.sinks and not entry.scheme_cls.generic_attention:
            raise ValueError(f"model.sinks (layer {i}): scheme {scheme!r} brings its own attention, which takes no "
                             "sink logits; set model.sinks=False or use another scheme")
        return LayerAttention(scheme, tuple(sorted(options.items())), window, chunk)

    @property
    def layers(self) -> tuple:
        """Every layer's `LayerAttention`, first to last."""
        return tuple(self.layer(i) for i in range(self.num_layers))


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's attention (the module doc): a registered scheme name, its options as sorted
    (name, value) pairs, its sliding window and its attention chunk (0: none)."""
    scheme: str
    scheme_options: tuple = ()
    window: int = 0
    chunk: int = 0

    def make_scheme(self, num_heads: int, head_dim: int):
        return make_scheme(self.scheme, num_heads=num_heads, head_dim=head_dim, sliding_window=self.window,
                           attention_chunk=self.chunk, **dict(self.scheme_options))


def _kind(name: str, fields) -> tuple:
    """A layer kind's fields as hashable pairs; one line for a field that is not one."""
    fields = dict(fields)
    unknown = sorted(set(fields) - set(KIND_FIELDS))
    if unknown:
        raise ValueError(f"model.layer_kinds.{name} has unknown field(s) {unknown}; a kind sets some of "
                         f"{', '.join(KIND_FIELDS)}")
    if "scheme_options" in fields:
        fields["scheme_options"] = _options(fields["scheme_options"])
    return tuple(sorted(fields.items()))


def _options(options) -> tuple:
    """Scheme options as sorted (name, value) pairs, hashable: a list value (LongRoPE's factors
    read back from config.json) as a tuple."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in dict(options).items()))


def _pattern(text: str) -> list[str]:
    """The kinds of "local*5,global": ['local'] * 5 + ['global']; one line for a bad count."""
    out = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, count = item.partition("*")
        if count and not (count.strip().isdigit() and int(count) > 0):
            raise ValueError(f"model.layer_pattern item {item!r}: the count after '*' must be an integer >= 1, "
                             "e.g. local*5,global")
        out += [name.strip()] * (int(count) if count else 1)
    return out


def _overrides(text: str, num_layers: int) -> dict[int, str]:
    """{layer: kind} of "0=global,25=global"; one line for an item that is not layer=kind."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        layer, _, kind = item.partition("=")
        if not (layer.strip().isdigit() and kind.strip()) or int(layer) >= num_layers:
            raise ValueError(f"model.layer_overrides item {item!r} must be <layer>=<kind> with a layer from 0 to "
                             f"{num_layers - 1} (model.num_layers={num_layers}), e.g. 0=global")
        out[int(layer)] = kind.strip()
    return out


def _symmetric_uniform(bound: float):
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def linear(din, dout, cfg, rngs, bias: bool = False):
    """A dense layer initialised as `cfg.init` says (ModelConfig.init)."""
    if cfg.init == "torch":
        inits = {"kernel_init": _symmetric_uniform(din ** -0.5), "bias_init": _symmetric_uniform(din ** -0.5)}
    else:
        inits = {"kernel_init": nnx.initializers.normal(stddev=din ** -0.5)}
    return nnx.Linear(din, dout, use_bias=bias, dtype=jnp.dtype(cfg.dtype), rngs=rngs, **inits)


def rms_norm(cfg: ModelConfig, rngs, size: int = 0):
    """An RMS norm over the last `size` (default d_model) dims with a learned scale; with
    `cfg.norm_offset`, one that scales by offset + scale, the scale starting at 0."""
    if not cfg.norm_offset:
        return nnx.RMSNorm(size or cfg.d_model, epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
    return OffsetRMSNorm(size or cfg.d_model, cfg, rngs)


class OffsetRMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale), in float32, cast to the compute dtype (Gemma's norm)."""

    def __init__(self, size: int, cfg: ModelConfig, rngs):
        self.offset, self.dtype = cfg.norm_offset, jnp.dtype(cfg.dtype)
        self.norm = nnx.RMSNorm(size, epsilon=cfg.norm_eps, use_scale=False, dtype=jnp.float32, rngs=rngs)
        self.scale = nnx.Param(jnp.zeros((size,), jnp.float32))

    def __call__(self, x):
        return (self.norm(x.astype(jnp.float32)) * (self.offset + self.scale[...].astype(jnp.float32))).astype(self.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.cfg = cfg
        h, kh, d = cfg.num_heads, cfg.resolved_kv_heads, cfg.resolved_head_dim
        self.scheme = cfg.layer(layer).make_scheme(h, d)
        self.q = linear(cfg.d_model, h * d, cfg, rngs, cfg.qkv_bias)
        self.k = linear(cfg.d_model, kh * d, cfg, rngs, cfg.qkv_bias)
        self.v = linear(cfg.d_model, kh * d, cfg, rngs, cfg.qkv_bias)
        self.o = linear(h * d, cfg.d_model, cfg, rngs)
        per_head, normed = cfg.qk_norm == "head", cfg.qk_norm != "none"
        self.q_norm = rms_norm(cfg, rngs, d if per_head else h * d) if normed else None
        self.k_norm = rms_norm(cfg, rngs, d if per_head else kh * d) if normed else None
        self.features = make_features(self.scheme, cfg, rngs=rngs)
        # Sink logits start at 0: each row's normaliser gains exp(0) = 1 beside its keys'.
        self.sink = nnx.Param(jnp.zeros((h,), jnp.float32)) if cfg.sinks else None

    def project(self, x, tokens, index, segment_ids=None, rng=None, past=None):
        """(q [B, T, H, D], k, v [B, T, K, D], features) of the layer input x [B, T, d_model];
        index [B, T] is each token's index (the cache slot when decoding)."""
        b, t, _ = x.shape
        d = self.cfg.resolved_head_dim
        q, k = self.q(x), self.k(x)
        if self.cfg.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(b, t, self.cfg.num_heads, d)
        k = k.reshape(b, t, self.cfg.resolved_kv_heads, d)
        if self.cfg.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.cfg.scale_dim:
            q = q * (d / self.cfg.scale_dim) ** 0.5
        v = self.v(x).reshape(b, t, self.cfg.resolved_kv_heads, d)
        features = None
        if self.features is not None:
            # Features that read earlier tokens (a short convolution) get the cache when decoding.
            extra = {"past": past} if self.features.reads_past else {}
            features = self.features(x, tokens=tokens, index=index, segment_ids=segment_ids, rng=rng, **extra)
        if self.sink is not None:
            features = {**(features or {}), "sink": self.sink[...]}
        return q, k, v, features

    def __call__(self, x, *, tokens, positions, segment_ids=None, impl=None, rng=None, key_slots=None):
        index = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        q, k, v, features = self.project(x, tokens, index, segment_ids, rng)
        if key_slots is not None:  # the perturbation probes (see Scheme.placed_attention)
            out = self.scheme.placed_attention(q, k, v, features, positions=positions, key_slots=key_slots)
        else:
            out = self.scheme.attend(q, k, v, features, positions=positions, segment_ids=segment_ids,
                                     impl=impl or self.cfg.attention_impl, block_size=self.cfg.block_size)
        return self.o(out.reshape(*x.shape[:2], -1))

    def decode(self, x, cache, *, tokens, rng=None, positions=None):
        b, n = tokens.shape
        index = jnp.broadcast_to(cache["index"] + jnp.arange(n, dtype=jnp.int32), (b, n))
        q, k, v, features = self.project(x, tokens, index, None, rng, past=cache)
        # Only multi-axis schemes take positions when decoding; the others use the cache slots.
        extra = {} if positions is None else {"positions": positions}
        out, cache = self.scheme.decode_step(cache, q, k, v, features, **extra)
        return self.o(out.reshape(*x.shape[:2], -1)), cache


class MLP(nnx.Module):
    """A gated MLP: W2 (act(W1 x) * W3 x), SwiGLU with silu (`ModelConfig.mlp_act`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.act = MLP_ACTS[cfg.mlp_act]
        self.gate = linear(cfg.d_model, cfg.resolved_mlp_dim, cfg, rngs)
        self.up = linear(cfg.d_model, cfg.resolved_mlp_dim, cfg, rngs)
        self.down = linear(cfg.resolved_mlp_dim, cfg.d_model, cfg, rngs)

    def __call__(self, x):
        return self.down(self.act(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """Attention then the MLP, each added to the residual stream, with norms where `cfg.norms`
    puts them: attn_norm and mlp_norm before each sublayer ("pre", "sandwich") or after it
    ("post"); "sandwich" adds attn_post_norm and mlp_post_norm after them."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, layer: int = 0):
        self.norms = cfg.norms
        self.attn_norm = rms_norm(cfg, rngs)
        self.attn = Attention(cfg, rngs=rngs, layer=layer)
        self.mlp_norm = rms_norm(cfg, rngs)
        self.mlp = MLP(cfg, rngs=rngs)
        sandwich = cfg.norms == "sandwich"
        self.attn_post_norm = rms_norm(cfg, rngs) if sandwich else None
        self.mlp_post_norm = rms_norm(cfg, rngs) if sandwich else None

    def attn_input(self, x):
        """What the attention sublayer reads of the residual stream x."""
        return x if self.norms == "post" else self.attn_norm(x)

    def attn_output(self, a):
        """What the residual stream gains from the attention sublayer's output a."""
        return self.attn_norm(a) if self.norms == "post" else a if self.attn_post_norm is None else self.attn_post_norm(a)

    def mlp_part(self, x):
        """The MLP sublayer's addition to the residual stream x."""
        if self.norms == "post":
            return self.mlp_norm(self.mlp(x))
        y = self.mlp(self.mlp_norm(x))
        return y if self.mlp_post_norm is None else self.mlp_post_norm(y)

    def __call__(self, x, **kw):
        x = x + self.attn_output(self.attn(self.attn_input(x), **kw))
        return x + self.mlp_part(x)

    def init_cache(self, batch: int, max_len: int) -> dict:
        cfg = self.attn.cfg
        return self.attn.scheme.init_cache(batch, max_len, cfg.resolved_kv_heads, jnp.dtype(cfg.dtype))

    def decode(self, x, cache, **kw):
        a, cache = self.attn.decode(self.attn_input(x), cache, **kw)
        x = x + self.attn_output(a)
        return x + self.mlp_part(x), cache
