"""Decoder-only LM in Flax NNX whose attention takes any registered position scheme.

Pre-norm blocks: x + Attn(RMSNorm(x)), then x + SwiGLU(RMSNorm(x)) (or the norms where
`ModelConfig.norms` puts them); final RMSNorm; tied or untied output head. The decode path carries an explicit cache pytree (one scheme cache per
layer) and is exact against the parallel forward.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from models.layers import REMAT_POLICIES, Block, ModelConfig, linear, rms_norm
from models.sessa import MacroBlock
from models.sharding import constrain
from positional.scheme import check_cache_room, sink_in
from positional.softmax import causal_softmax


class DecoderLM(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, rngs=rngs,
                               embedding_init=nnx.initializers.normal(stddev=1.0))
        if cfg.mixer == "attention":
            self.blocks = nnx.List([Block(cfg, rngs=rngs, layer=i) for i in range(cfg.num_layers)])
        else:
            self.blocks = nnx.List([MacroBlock(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.norm = rms_norm(cfg, rngs)
        self.head = None if cfg.tie_embeddings else linear(cfg.d_model, cfg.vocab_size, cfg, rngs)

    def embed_tokens(self, tokens) -> jax.Array:
        """The residual stream's start: the embeddings in the compute dtype (times sqrt(d_model)
        with `cfg.embed_scale`)."""
        x = self.embed(tokens).astype(jnp.dtype(self.cfg.dtype))
        return x * jnp.asarray(self.cfg.d_model ** 0.5, x.dtype) if self.cfg.embed_scale else x

    def project(self, x, entries=None):
        """The head on normed hidden states, in the compute dtype: [B, T, vocab], or with `entries`
        (start, size) the logits of those vocabulary entries only (`start` may be traced)."""
        cut = (lambda w, axis: w) if entries is None else (
            lambda w, axis: jax.lax.dynamic_slice_in_dim(w, entries[0], entries[1], axis))
        if self.head is None:  # as nnx.Embed.attend, on the rows asked for
            x, table = self.embed.promote_dtype((x, cut(self.embed.embedding[...], 0)), dtype=self.embed.dtype)
            logits = jnp.dot(x, table.T)
            # Scaled, logits start O(1) with unit-variance embeddings; unscaled in HF checkpoints.
            return logits * self.cfg.d_model ** -0.5 if self.cfg.scale_tied_logits else logits
        x, kernel = self.head.promote_dtype((x, cut(self.head.kernel[...], 1)), dtype=self.head.dtype)
        return jnp.dot(x, kernel, precision=self.head.precision)  # as nnx.Linear (no bias), on the columns asked for

    def logits(self, x) -> jax.Array:
        """The final norm and the head: hidden states [B, T, d_model] -> logits [B, T, vocab] (float32)."""
        return constrain(self.project(self.norm(x)).astype(jnp.float32), ("batch", "sequence", "vocab"))

    def __call__(self, tokens, *, positions=None, segment_ids=None, impl=None, rng=None,
                 key_slots=None, hidden: bool = False) -> jax.Array:
        """tokens [B, T] int -> logits [B, T, vocab] (float32); with `hidden`, the last block's
        output [B, T, d_model] instead (for `logits` to take in parts: `token_nll`).

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
        x = self.embed_tokens(tokens)

        def run(block, x, tokens, positions, segment_ids, rng, extra):  # arrays only: remat traces it
            return block(x, tokens=tokens, positions=positions, segment_ids=segment_ids, impl=impl, rng=rng,
                         **extra)

        if self.cfg.remat != "none":
            run = nnx.remat(run, policy=REMAT_POLICIES[self.cfg.remat])
        for i, block in enumerate(self.blocks):
            x = constrain(x, ("batch", "sequence", None))
            x = run(block, x, tokens, positions, segment_ids, _layer_key(rng, i), extra)
        return x if hidden else self.logits(x)

    @property
    def reencode_length(self) -> int | None:
        """The shortest length past which a layer's scheme changes the angles of tokens already
        seen (`Scheme.reencode_length`: LongRoPE), where `generate` re-encodes; None: none does."""
        lengths = [b.attn.scheme.reencode_length for b in self.blocks if hasattr(b, "attn")]
        return min((n for n in lengths if n is not None), default=None)

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
        x = self.embed_tokens(tokens)
        new_cache = []
        for i, (block, c) in enumerate(zip(self.blocks, cache)):
            x, c = block.decode(x, c, tokens=tokens, rng=_layer_key(rng, i), positions=positions)
            new_cache.append(c)
        return self.project(self.norm(x)).astype(jnp.float32), new_cache


def _layer_key(rng, layer: int):
    return None if rng is None else jax.random.fold_in(rng, layer)


def cache_len(cache) -> int | float:
    """Tokens the cache can hold: its shortest layer's; unbounded for a running state
    (random-feature attention, a mixer's) and a windowed layer's ring buffer."""
    return min(float("inf") if "ring" in c or "k" not in c else c["k"].shape[1] for c in cache)


def check_prefill_chunk(chunk) -> int | None:
    """`chunk` as an int, or None; ValueError, one line, unless it is None or an int >= 1."""
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
        raise ValueError(f"prefill_chunk={chunk!r} must be an int >= 1 (prompt tokens per prefill call, bounding "
                         "its attention scores to [chunk, max_len] per head) or None (the whole prompt at once)")
    return int(chunk)


def prefill(model: DecoderLM, tokens, cache, *, rng=None, positions=None, chunk: int | None = None):
    """Feed `tokens` [B, P] after what `cache` holds, `chunk` tokens per `model.decode` call
    (None, or chunk >= P: all P in one call), each piece attending to the cache filled so far,
    so attention scores are at most [chunk, max_len] per head. Returns (logits of the last
    token [B, V], cache).

    The P // chunk whole pieces go through one `lax.scan` (of one step without a chunk), the
    P % chunk tokens left, if any, through one more call. `positions` [B, P, d_c] as `decode`
    takes them, or None.
    """
    p = tokens.shape[1]
    chunk = min(check_prefill_chunk(chunk) or p, p)
    head = p - p % chunk  # tokens in whole pieces

    def pieces(x):  # [B, head, ...] -> [head // chunk, B, chunk, ...]
        return None if x is None else jnp.moveaxis(x[:, :head].reshape(x.shape[0], -1, chunk, *x.shape[2:]), 1, 0)

    def piece(cache, xs):
        logits, cache = model.decode(xs[0], cache, rng, positions=xs[1])
        return cache, logits[:, -1]

    cache, last = jax.lax.scan(piece, cache, (pieces(tokens), pieces(positions)))
    if head == p:
        return last[-1], cache
    logits, cache = model.decode(tokens[:, head:], cache, rng, positions=None if positions is None
                                 else positions[:, head:])
    return logits[:, -1], cache


def generate(model: DecoderLM, prompt: jax.Array, max_new_tokens: int, *, rng: jax.Array | None = None,
             temperature: float = 0.0, max_len: int | None = None,
             positions: jax.Array | None = None, prefill_chunk: int | None = None) -> jax.Array:
    """Prefill `prompt` [B, P] then sample `max_new_tokens`. Returns [B, P + max_new_tokens].

    temperature 0 is greedy decoding; otherwise tokens are sampled from softmax(logits / T)
    with `rng` (required), which also feeds schemes with random features. The whole loop is
    one jitted `lax.scan`. `positions` [B, P + max_new_tokens, d_c] place the prompt and every
    generated token, for multi-axis schemes (ESPR); the others use the cache slots.

    `prefill_chunk`: feed the prompt `prefill_chunk` tokens at a time (`prefill`), so its
    attention scores are [prefill_chunk, max_len] per head rather than [P, max_len]: the same
    tokens as the whole prompt at once (None), up to float rounding. Except past
    original_max_len under RoPE's "dynamic" scaling, which rotates each piece, as each decoding
    step, with the frequencies of its own length. Where a layer's scheme changes the angles of
    tokens already seen past some length (LongRoPE: `DecoderLM.reencode_length`), the step that
    crosses it encodes the whole sequence again, as Hugging Face's generate does.
    """
    b, p = prompt.shape
    max_len = max_len or p + max_new_tokens
    check_cache_room(max_len, p, max_new_tokens)
    prefill_chunk = check_prefill_chunk(prefill_chunk)
    if prefill_chunk is not None and prefill_chunk >= p:  # one piece: the same program as None
        prefill_chunk = None
    if temperature > 0 and rng is None:
        raise ValueError("sampling with temperature > 0 needs an explicit rng key")
    if positions is not None and positions.shape[:2] != (b, p + max_new_tokens):
        raise ValueError(f"generate positions must be [B, P + max_new_tokens, ...] = [{b}, "
                         f"{p + max_new_tokens}, ...]; got shape {tuple(positions.shape)}")
    graphdef, state = nnx.split(model)
    return _generate(graphdef, state, prompt, rng, max_new_tokens, float(temperature), max_len, positions,
                     prefill_chunk)


@functools.partial(jax.jit, static_argnums=(0, 4, 5, 6, 8))
def _generate(graphdef, state, prompt, rng, max_new_tokens, temperature, max_len, positions, prefill_chunk):
    model = nnx.merge(graphdef, state)
    p = prompt.shape[1]
    feature_rng, sample_rng = (None, jax.random.key(0)) if rng is None else jax.random.split(rng)
    last, cache = prefill(model, prompt, model.init_cache(prompt.shape[0], max_len), rng=feature_rng,
                          positions=None if positions is None else positions[:, :p], chunk=prefill_chunk)

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
    # The step that feeds the token at position `at` takes the sequence past a scheme's
    # reencode_length: there the whole sequence is encoded again (prefill from an empty cache).
    at = model.reencode_length
    cut = max_new_tokens if at is None or not p <= at < p + max_new_tokens else at - p
    carry, tokens = jax.lax.scan(step, (last, cache), jax.tree.map(lambda x: x[:cut], (keys, new_positions)))
    if cut == max_new_tokens:
        return jnp.concatenate([prompt, tokens.T], axis=1)
    token = pick(carry[0], keys[cut])
    seen = jnp.concatenate([prompt, tokens.T, token[:, None]], axis=1)
    last, cache = prefill(model, seen, model.init_cache(prompt.shape[0], max_len), rng=feature_rng,
                          positions=None if positions is None else positions[:, :at + 1])
    _, rest = jax.lax.scan(step, (last, cache), jax.tree.map(lambda x: x[cut + 1:], (keys, new_positions)))
    return jnp.concatenate([seen, rest.T], axis=1)


# A vocabulary larger than VOCAB_PER_CHUNK is scored in chunks of about that many entries (a
# running log-sum-exp), so the [B, T, vocab] logits never exist and the head's weights are
# read a chunk at a time (XLA:CPU would otherwise widen a whole bf16 embedding to fp32 for the
# fp32 logits: benchmarks/RESULTS.md, 'Host memory of loading and evaluating...'). Logits of
# more than LOGITS_PER_CHUNK entries per row ([T, vocab chunk]) are made and scored in chunks
# of positions.
VOCAB_PER_CHUNK = 2 ** 14
LOGITS_PER_CHUNK = 2 ** 25


def vocab_chunk(vocab: int) -> int:
    """Vocabulary entries per chunk of `token_nll`'s logits: `vocab` (no chunks) up to
    VOCAB_PER_CHUNK, else the fewest chunks of at most that size, made equal (the last one
    overlaps the one before where they do not divide the vocabulary)."""
    chunks = -(-vocab // VOCAB_PER_CHUNK)
    return -(-vocab // chunks)


def logits_chunk(length: int, vocab: int) -> int:
    """Positions per chunk of `token_nll`'s logits: `length` (no chunks) up to LOGITS_PER_CHUNK
    entries a row of one vocabulary chunk, else halved while it is even and above it."""
    chunk, entries = length, vocab_chunk(vocab)
    while chunk * entries > LOGITS_PER_CHUNK and chunk % 2 == 0:
        chunk //= 2
    return chunk


def _scored(model: DecoderLM, x, targets):
    """-log p(targets) [B, t] from hidden states x [B, t, d_model]; a large vocabulary in chunks
    of `vocab_chunk` entries (a running log-sum-exp), each chunk's logits recomputed in the
    backward pass."""
    vocab = model.cfg.vocab_size
    size = vocab_chunk(vocab)
    if size == vocab:
        return -jnp.take_along_axis(jax.nn.log_softmax(model.logits(x)), targets[..., None], axis=-1)[..., 0]
    x = model.norm(x)

    @jax.checkpoint
    def chunk(carry, i):
        top, total, picked = carry
        start = jnp.minimum(i * size, vocab - size)  # the last chunk ends at the vocabulary's end
        logits = constrain(model.project(x, (start, size)).astype(jnp.float32), ("batch", "sequence", "vocab"))
        logits = jnp.where(start + jnp.arange(size) >= i * size, logits, -jnp.inf)  # the chunk before has these
        new_top = jax.lax.stop_gradient(jnp.maximum(top, logits.max(-1)))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(-1)
        inside = (targets >= i * size) & (targets < (i + 1) * size)
        at = jnp.take_along_axis(logits, jnp.clip(targets - start, 0, size - 1)[..., None], axis=-1)[..., 0]
        return (new_top, total, picked + jnp.where(inside, at, 0.0)), None

    zeros = jnp.zeros(targets.shape, jnp.float32)
    (top, total, picked), _ = jax.lax.scan(chunk, (zeros - jnp.inf, zeros, zeros), jnp.arange(-(-vocab // size)))
    return top + jnp.log(total) - picked


def token_nll(model: DecoderLM, tokens, *, segment_ids=None, positions=None, impl=None, rng=None,
              key_slots=None):
    """Next-token negative log-likelihood of rows of tokens.

    tokens [B, T + 1]: the model reads tokens[:, :-1] and predicts tokens[:, 1:]. Returns
    (nll [B, T] float32, weight [B, T] float32), weight 0 where the target starts another
    document or is padding (segment id 0). key_slots [B, T]: see DecoderLM. A large vocabulary
    at a long length is scored in chunks of its entries (`vocab_chunk`) and of positions
    (`logits_chunk`): the same numbers without the whole [B, T, vocab] array at once.
    """
    seg_in = None if segment_ids is None else segment_ids[:, :-1]
    pos_in = None if positions is None else positions[:, :-1]
    extra = {} if key_slots is None else {"key_slots": key_slots}
    x = model(tokens[:, :-1], positions=pos_in, segment_ids=seg_in, impl=impl, rng=rng, hidden=True, **extra)
    targets = tokens[:, 1:]
    scored = functools.partial(_scored, model)
    (b, t), chunk = targets.shape, logits_chunk(targets.shape[1], model.cfg.vocab_size)
    if chunk == t:
        nll = scored(x, targets)
    else:  # chunks of positions, each one's logits recomputed in the backward pass
        parts = jax.lax.map(jax.checkpoint(lambda part: scored(*part)),
                            (x.reshape(b, t // chunk, chunk, -1).swapaxes(0, 1),
                             targets.reshape(b, t // chunk, chunk).swapaxes(0, 1)))
        nll = parts.swapaxes(0, 1).reshape(b, t)
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
    x = model.embed_tokens(tokens)
    layers = []
    for i, block in enumerate(model.blocks):
        attn, key = block.attn, _layer_key(rng, i)
        h = block.attn_input(x)
        q, k, v, features = attn.project(h, tokens, index, None, key)
        layer = {"q": q, "k": k, "v": v, "features": features}
        if maps:  # the weights under the layer's window and sinks
            logits = attn.scheme.logits(q, k, v, features, index)
            weights = causal_softmax(logits, window=attn.scheme.attention_window, sink=sink_in(features))
            layer |= {"logits": logits.reshape(b, -1, t, t), "weights": weights.reshape(b, -1, t, t)}
        layer["out"] = block.attn_output(attn(h, tokens=tokens, positions=index, rng=key))
        x = x + layer["out"]
        x = x + block.mlp_part(x)
        layers.append(layer)
    return layers


def param_count(cfg) -> int:
    """Parameters of the whole DecoderLM for `cfg`, counted without allocating them."""
    state = nnx.state(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    return sum(math.prod(x.shape) for x in jax.tree.leaves(state))


def matched_width(cfg, mixer: str, target: int, *, multiple: int = 0) -> int:
    """The d_model (a multiple of `multiple`, default 2 * num_heads) whose `mixer` model has the
    parameter count closest to `target`, everything else as in `cfg`."""
    step = multiple or 2 * cfg.num_heads
    count = lambda d: param_count(dataclasses.replace(cfg, mixer=mixer, d_model=d))  # noqa: E731
    lo, hi = step, step
    while count(hi) < target:  # parameter counts grow with width: bracket, then bisect
        lo, hi = hi, hi * 2
    while hi - lo > step:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if count(mid) < target else (lo, mid)
    return min((lo, hi), key=lambda d: abs(count(d) - target))
