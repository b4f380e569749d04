"""Decoder-only LM in Flax NNX whose attention takes any registered position scheme.

Pre-norm blocks: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)); final RMSNorm; tied or
untied output head. The decode path carries an explicit cache pytree (one scheme cache per
layer) and is exact against the parallel forward.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.registry import make_features, make_scheme
from models.sharding import constrain
from positional.attention import causal_softmax
from positional.scheme import check_cache_room


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
    tie_embeddings: bool = True
    attention_impl: str = "reference"  # or "blockwise", "ring" (sequence over the mesh), "pallas"
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
        d["scheme_options"] = tuple(sorted(dict(d.get("scheme_options", {})).items()))
        d["mixer_options"] = tuple(sorted(dict(d.get("mixer_options", {})).items()))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config field(s) {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**d)

    def __post_init__(self):
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r} is not a rematerialisation policy; valid: "
                             f"{', '.join(REMAT_POLICIES)}")
        if self.num_heads <= 0 or (self.head_dim == 0 and self.d_model % self.num_heads):
            raise ValueError(f"model.d_model={self.d_model} is not divisible by model.num_heads="
                             f"{self.num_heads}; set model.head_dim explicitly")
        if self.kv_heads <= 0 or self.num_heads % self.kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of "
                             f"model.num_kv_heads={self.kv_heads}")

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.num_heads

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim or -(-8 * self.d_model // 3 // 64) * 64


def _linear(din, dout, cfg, rngs):
    return nnx.Linear(din, dout, use_bias=False, dtype=jnp.dtype(cfg.dtype), rngs=rngs,
                      kernel_init=nnx.initializers.normal(stddev=din ** -0.5))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h, kh, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
        self.scheme = make_scheme(cfg.scheme, num_heads=h, head_dim=d, **dict(cfg.scheme_options))
        self.q = _linear(cfg.d_model, h * d, cfg, rngs)
        self.k = _linear(cfg.d_model, kh * d, cfg, rngs)
        self.v = _linear(cfg.d_model, kh * d, cfg, rngs)
        self.o = _linear(h * d, cfg.d_model, cfg, rngs)
        self.features = make_features(cfg.scheme, self.scheme, cfg, rngs=rngs)

    def _qkv(self, x, tokens, index, segment_ids, rng, past=None):
        b, t, _ = x.shape
        d = self.cfg.dim_per_head
        q = self.q(x).reshape(b, t, self.cfg.num_heads, d)
        k = self.k(x).reshape(b, t, self.cfg.kv_heads, d)
        v = self.v(x).reshape(b, t, self.cfg.kv_heads, d)
        features = None
        if self.features is not None:
            # Features that read earlier tokens (a short convolution) get the cache when decoding.
            extra = {"past": past} if getattr(self.features, "reads_past", False) else {}
            features = self.features(x, tokens=tokens, index=index, segment_ids=segment_ids, rng=rng, **extra)
        return q, k, v, features

    def __call__(self, x, *, tokens, positions, segment_ids=None, impl=None, rng=None, key_slots=None):
        index = jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32), x.shape[:2])
        q, k, v, features = self._qkv(x, tokens, index, segment_ids, rng)
        if key_slots is not None:  # the perturbation probes (see Scheme.placed_attention)
            out = self.scheme.placed_attention(q, k, v, features, positions=positions, key_slots=key_slots)
        else:
            out = self.scheme.attend(q, k, v, features, positions=positions, segment_ids=segment_ids,
                                     impl=impl or self.cfg.attention_impl, block_size=self.cfg.block_size)
        return self.o(out.reshape(*x.shape[:2], -1))

    def decode(self, x, cache, *, tokens, rng=None, positions=None):
        b, n = tokens.shape
        index = jnp.broadcast_to(cache["index"] + jnp.arange(n, dtype=jnp.int32), (b, n))
        q, k, v, features = self._qkv(x, tokens, index, None, rng, past=cache)
        # Only multi-axis schemes take positions when decoding; the others use the cache slots.
        extra = {} if positions is None else {"positions": positions}
        out, cache = self.scheme.decode_step(cache, q, k, v, features, **extra)
        return self.o(out.reshape(*x.shape[:2], -1)), cache


class MLP(nnx.Module):
    """SwiGLU: W2 (silu(W1 x) * W3 x)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.gate = _linear(cfg.d_model, cfg.hidden_dim, cfg, rngs)
        self.up = _linear(cfg.d_model, cfg.hidden_dim, cfg, rngs)
        self.down = _linear(cfg.hidden_dim, cfg.d_model, cfg, rngs)

    def __call__(self, x):
        return self.down(nnx.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(cfg.dtype)
        self.attn_norm = nnx.RMSNorm(cfg.d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(cfg.d_model, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, **kw):
        x = x + self.attn(self.attn_norm(x), **kw)
        return x + self.mlp(self.mlp_norm(x))

    def init_cache(self, batch: int, max_len: int) -> dict:
        cfg = self.attn.cfg
        return self.attn.scheme.init_cache(batch, max_len, cfg.kv_heads, jnp.dtype(cfg.dtype))

    def decode(self, x, cache, **kw):
        a, cache = self.attn.decode(self.attn_norm(x), cache, **kw)
        x = x + a
        return x + self.mlp(self.mlp_norm(x)), cache


class DecoderLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                               embedding_init=nnx.initializers.normal(stddev=1.0))
        from models.sessa import MacroBlock  # models.sessa builds its attention from this module
        block = Block if cfg.mixer == "attention" else MacroBlock
        self.blocks = nnx.List([block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = nnx.RMSNorm(cfg.d_model, epsilon=1e-6, dtype=jnp.dtype(cfg.dtype), rngs=rngs)
        self.head = None if cfg.tie_embeddings else _linear(cfg.d_model, cfg.vocab_size, cfg, rngs)

    def _logits(self, x):
        x = self.norm(x)
        if self.head is None:  # tied: scale so logits start O(1) with unit-variance embeddings
            return self.embed.attend(x) * self.cfg.d_model ** -0.5
        return self.head(x)

    def __call__(self, tokens, *, positions=None, segment_ids=None, impl=None, rng=None,
                 key_slots=None) -> jax.Array:
        """tokens [B, T] int -> logits [B, T, vocab] (float32).

        positions: [B, T] int (default 0..T-1), or [B, T, d_c] for multi-axis schemes (ESPR).

        `rng` feeds schemes with random features (a different key per layer is derived from
        it); pass a fresh one per forward pass. Other schemes ignore it.

        `key_slots` [B, T] int (probes only): in every layer, key and value j sit at slot
        key_slots[:, j] (`Scheme.placed_attention`); attention models only.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        extra = {}
        if key_slots is not None:
            if self.cfg.mixer != "attention":
                raise ValueError(f"key_slots moves attention keys; mixer {self.cfg.mixer!r} has none")
            extra = {"key_slots": key_slots}
        x = self.embed(tokens).astype(jnp.dtype(self.cfg.dtype))

        def run(block, x, tokens, positions, segment_ids, rng, extra):  # arrays only: remat traces it
            return block(x, tokens=tokens, positions=positions, segment_ids=segment_ids, impl=impl, rng=rng,
                         **extra)

        if self.cfg.remat != "none":
            run = nnx.remat(run, policy=REMAT_POLICIES[self.cfg.remat])
        for i, block in enumerate(self.blocks):
            x = constrain(x, ("batch", "sequence", None))
            x = run(block, x, tokens, positions, segment_ids, _layer_key(rng, i), extra)
        return constrain(self._logits(x).astype(jnp.float32), ("batch", "sequence", "vocab"))

    def init_cache(self, batch: int, max_len: int) -> list:
        return [blk.init_cache(batch, max_len) for blk in self.blocks]

    def decode(self, tokens, cache, rng=None, positions=None):
        """Feed n new tokens [B, n] after what `cache` holds. Returns (logits [B, n, V], cache).

        `positions` [B, n, d_c] of the new tokens are needed only by multi-axis schemes (ESPR).

        Schemes with random features draw them from (rng, position): use one rng for a whole
        sequence so decoding sees the angles the parallel forward with that rng sees.
        """
        index = cache[0]["index"]
        if not isinstance(index, jax.core.Tracer):  # under jit the caller checks (see generate)
            check_cache_room(cache_len(cache), int(index), tokens.shape[1])
        x = self.embed(tokens).astype(jnp.dtype(self.cfg.dtype))
        new_cache = []
        for i, (block, c) in enumerate(zip(self.blocks, cache)):
            x, c = block.decode(x, c, tokens=tokens, rng=_layer_key(rng, i), positions=positions)
            new_cache.append(c)
        return self._logits(x).astype(jnp.float32), new_cache


def _layer_key(rng, layer: int):
    return None if rng is None else jax.random.fold_in(rng, layer)


def cache_len(cache) -> int | float:
    """Tokens the cache can hold; unbounded for a running-state cache (random-feature attention)."""
    return cache[0]["k"].shape[1] if "k" in cache[0] else float("inf")


def generate(model: DecoderLM, prompt: jax.Array, max_new_tokens: int, *, rng: jax.Array | None = None,
             temperature: float = 0.0, max_len: int | None = None,
             positions: jax.Array | None = None) -> jax.Array:
    """Prefill `prompt` [B, P] then sample `max_new_tokens`. Returns [B, P + max_new_tokens].

    temperature 0 is greedy decoding; otherwise tokens are sampled from softmax(logits / T)
    with `rng` (required), which also feeds schemes with random features. The whole loop is
    one jitted `lax.scan`. `positions` [B, P + max_new_tokens, d_c] place the prompt and every
    generated token, for multi-axis schemes (ESPR); the others use the cache slots.
    """
    b, p = prompt.shape
    max_len = max_len or p + max_new_tokens
    check_cache_room(max_len, p, max_new_tokens)
    if temperature > 0 and rng is None:
        raise ValueError("sampling with temperature > 0 needs an explicit rng key")
    if positions is not None and positions.shape[:2] != (b, p + max_new_tokens):
        raise ValueError(f"generate positions must be [B, P + max_new_tokens, ...] = [{b}, "
                         f"{p + max_new_tokens}, ...]; got shape {tuple(positions.shape)}")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, rng, max_new_tokens, float(temperature), max_len, positions)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6))
def _generate(graphdef, state, prompt, rng, max_new_tokens, temperature, max_len, positions):
    model = nnx.merge(graphdef, state)
    p = prompt.shape[1]
    feature_rng, sample_rng = (None, jax.random.key(0)) if rng is None else jax.random.split(rng)
    logits, cache = model.decode(prompt, model.init_cache(prompt.shape[0], max_len), feature_rng,
                                 positions=None if positions is None else positions[:, :p])

    def pick(logits, key):
        if temperature == 0:
            return jnp.argmax(logits, -1).astype(prompt.dtype)
        return jax.random.categorical(key, logits / temperature).astype(prompt.dtype)

    def step(carry, xs):
        last_logits, cache = carry
        key, position = xs  # the new token's position [B, 1, ...], or None
        token = pick(last_logits, key)
        logits, cache = model.decode(token[:, None], cache, feature_rng, positions=position)
        return (logits[:, -1], cache), token

    keys = jax.random.split(sample_rng, max_new_tokens)
    new_positions = None if positions is None else jnp.moveaxis(positions[:, p:, None], 1, 0)
    _, tokens = jax.lax.scan(step, (logits[:, -1], cache), (keys, new_positions))
    return jnp.concatenate([prompt, tokens.T], axis=1)


def token_nll(model: DecoderLM, tokens, *, segment_ids=None, positions=None, impl=None, rng=None,
              key_slots=None):
    """Next-token negative log-likelihood of rows of tokens.

    tokens [B, T + 1]: the model reads tokens[:, :-1] and predicts tokens[:, 1:]. Returns
    (nll [B, T] float32, weight [B, T] float32), weight 0 where the target starts another
    document or is padding (segment id 0). key_slots [B, T]: see DecoderLM.
    """
    seg_in = None if segment_ids is None else segment_ids[:, :-1]
    pos_in = None if positions is None else positions[:, :-1]
    extra = {} if key_slots is None else {"key_slots": key_slots}
    logits = model(tokens[:, :-1], positions=pos_in, segment_ids=seg_in, impl=impl, rng=rng, **extra)
    targets = tokens[:, 1:]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
    if segment_ids is None:
        return nll, jnp.ones_like(nll)
    weight = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
    return nll, weight.astype(jnp.float32)


def attention_internals(model: DecoderLM, tokens, *, rng=None, maps: bool = True) -> list[dict]:
    """What each layer's attention does on `tokens` [B, T], for the probes.

    Per layer: 'q' [B, T, H, D], 'k', 'v' [B, T, K, D] (before the scheme's transform), the
    scheme's 'features', 'out' [B, T, d_model] (the attention
    sublayer's output, added to the residual stream) and, with `maps`, 'logits' and
    'weights' [B, H, T, T] (the scheme's logits before the causal mask, and the softmax
    weights).
    """
    b, t = tokens.shape
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    x = model.embed(tokens).astype(jnp.dtype(model.cfg.dtype))
    layers = []
    for i, block in enumerate(model.blocks):
        attn, key = block.attn, _layer_key(rng, i)
        h = block.attn_norm(x)
        q, k, v, features = attn._qkv(h, tokens, index, None, key)
        layer = {"q": q, "k": k, "v": v, "features": features}
        if maps:
            logits = attn.scheme.logits(q, k, v, features, index)
            layer |= {"logits": logits.reshape(b, -1, t, t),
                      "weights": causal_softmax(logits).reshape(b, -1, t, t)}
        layer["out"] = attn(h, tokens=tokens, positions=index, rng=key)
        x = x + layer["out"]
        x = x + block.mlp(block.mlp_norm(x))
        layers.append(layer)
    return layers
