"""The scheme contract: how a position scheme wraps ordinary causal attention.

A `Scheme` is a frozen dataclass whose fields are its options (so it is hashable and can sit
on an NNX module as static data). Its hooks, all pure:

  transform(q, k, v, features, positions) -> (q, k, v)   before attention (RoPE, SO(2), ...)
  transform_out(out, features, positions) -> out         after it (Q/K/V variants rotate back)
  bias_fn(features, positions) -> Bias | None            additive logit bias (ALiBi, FoX, ...)
  score_fn(features) -> Score | None                     a logit that is not q.k/sqrt(D) (TAPA)
  feature_cache(batch, max_len) -> dict                  per-token features the score bias reads
                                                         at key positions (FoX's gates), zeros
  default_features(q, k, *, positions, key, segment_ids) -> dict
                                                         features a notebook can use without a
                                                         model: its features at initialisation
                                                         (random draws from `key`)
  init_parameters(keys, model) -> dict                   the scheme's learned parameters at
                                                         initialisation, a nested dict of arrays
                                                         (`keys()` a fresh key per call: a model's
                                                         `rngs.params`; `model` the layer's sizes:
                                                         d_model, vocab_size, resolved_kv_heads)
  features(params, x, *, tokens, index, segment_ids, rng, past) -> dict
                                                         the per-token features the hooks read,
                                                         from those parameters and the layer input
                                                         x [B, T, d_model]; a model holds the
                                                         parameters per layer in one NNX adapter
                                                         (models/features.py) and calls this

Biases and scores are `positional.logits.Bias` and `Score`: a function of a few numbers per
slot, which every implementation evaluates (the fused kernel inside its tiles, with their
gradients), so a new bias scheme runs fused with no kernel code of its own. A bias reads
positions, not row indices: `positions` [B, S] holds the position of every key slot, and
`position_values(positions)` makes them the bias's values; so the conformance suite's shift
check sees an absolute bias. The decode cache keeps the positions of the cached slots.

`biases` holds score-bias schemes added to this one's logits (a registry name such as
"so2_learned_qkv+alibi"), so a transport can be combined with explicit far-mass control.

`sliding_window` W > 0 makes every form of the scheme attend within a sliding window: query i
sees key j iff i - W < j <= i (the attention implementations' `window`, which skip the work
outside it); `attention_chunk` C > 0, Llama 4's chunked local attention: i sees j iff
C floor(i / C) <= j <= i (the reference and blockwise forms, and decode). It is the layer's, not an option of the scheme (models/registry.py `make_scheme`
takes it apart from the options); a scheme that brings its own attention takes none unless it
declares `generic_attention`. So with sink logits: where the features hold "sink" [H] (the
layer's learned per-head sinks, models/layers.py), every form's softmax has that one more logit
per row (positional/softmax.py).

What a scheme can do is declared on its class (never inferred elsewhere), as class attributes:

  has_bias         bias_fn returns a bias (it is None otherwise)
  has_score        score_fn returns a score function (it is None otherwise)
  bias_only        a pure score-bias scheme (has_bias, no other hook overridden): it may be
                   added to another with "+"
  needs_features   its hooks read the per-token features (`features`, from the parameters
                   `init_parameters` declares: both on the scheme, so its file is the whole scheme)
  has_parameters   its features are its learned parameters themselves, no function of the input
                   (the base `features` and `default_features` then serve: KERPLE, T5)
  reads_past       `features` reads the layer cache when decoding (`past`: PaTH's convolution)
  random_features  its features hold a random draw, taken each forward pass from the key the
                   caller passes (or from the `draw_seed` option, where that is >= 0)
  default_key      its `default_features` draw from a key (as random_features schemes do)
  relative         scores depend only on position differences (checked by the conformance suite)
  probes           the probe families that apply, from PROBE_FAMILIES (the attention-mass probes
                   apply to every scheme and are not listed)
  config_defaults  model config fields this scheme sets by default (configs/default.py)
  train_len_options  options that default to the training length of the run whose config builds
                   the model (config.seq_len, lab/state.py `model_config`): LM-Infinite's window
  generic_attention  its attention is the generic one, which takes `sliding_window` and sinks
                   (True unless it overrides `transformed_attention`)

From those the base class derives the parallel form `attend` and an exact decode form
(`init_cache` / `decode_step`) whose cache holds keys and values already transformed. Schemes
whose transport of a key changes as the sequence grows (PaTH) or that need state of the past
(accumulated angles) override the decode pair; schemes that change the whole path override
`attend` too. `impls` lists the attention implementations a scheme runs on. Impls "ring"
(positional/ring.py: the sequence split over the devices of a mesh), "pallas" (the fused
kernel, positional/kernels/flash.py, with the scheme's Bias and Score in its tiles), "cudnn",
"splash" and "auto" (positional/attention.py) are the generic `transformed_attention`'s
(GENERIC_ONLY), so a scheme that overrides it loses them unless its `impls` lists them.

Shapes: q [B, T, H, D]; k, v [B, T, K, D]; positions, segment_ids [B, T] int32 (multi-axis
schemes, ESPR, also take positions [B, T, d_c]).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from positional.attention import CHUNKED, IMPLEMENTATIONS, attention, by_length, log_ring
from positional.ring import ring_active
from positional.logits import Bias, Score, sum_of
from positional.softmax import BiasFn, Chunk, attention_logits, causal_softmax

Features = dict | None
# Implementations of the generic `Scheme.transformed_attention` alone.
GENERIC_ONLY = ("auto", "ring", "pallas", "cudnn", "splash")

# Probe families: "angles", SO(2) step angles (features 'psi' and 'theta'); "householder", PaTH's
# steps (features 'w' and 'beta'); "rope_pairs", fixed RoPE frequencies (`theta`), decomposed
# explicitly per pair into f(distance) + g(key).
PROBE_FAMILIES = ("angles", "householder", "rope_pairs")


@dataclasses.dataclass(frozen=True)
class Scheme:
    num_heads: int
    head_dim: int
    biases: tuple = ()  # bias-only schemes whose logit biases are added to this one's
    sliding_window: int = 0  # > 0: attend within a sliding window of this many tokens (the module doc)
    attention_chunk: int = 0  # > 0: attend within chunks of this many tokens (the module doc)

    #: rotary schemes rotate pairs of dimensions and need an even head_dim.
    needs_even_head_dim = False
    has_bias = False
    has_score = False
    bias_only = False
    needs_features = False
    has_parameters = False
    reads_past = False
    random_features = False
    default_key = False
    relative = True
    probes = ()
    config_defaults = {}  # read only: copied where applied
    train_len_options = ()
    generic_attention = True
    #: attention implementations this scheme runs on.
    impls = ("auto", *IMPLEMENTATIONS)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        unknown = set(cls.probes) - set(PROBE_FAMILIES)
        if unknown:
            raise TypeError(f"{cls.__name__}.probes names unknown probe families {sorted(unknown)}; "
                            f"valid: {', '.join(PROBE_FAMILIES)}")
        if cls.has_parameters and not cls.needs_features:
            raise TypeError(f"{cls.__name__}.has_parameters: its hooks read them as features, so it needs_features")
        if cls.needs_features and not cls.has_parameters and cls.features is Scheme.features:
            raise TypeError(f"{cls.__name__}.needs_features: define `features(params, x, ...)`, the features "
                            "its hooks read (or set has_parameters where they are its parameters)")
        if "attention" in vars(cls):  # the method's name before it was renamed
            raise TypeError(f"{cls.__name__} defines `attention`, which is called `transformed_attention` now "
                            "(attention on q, k, v after `transform`): rename the method")
        # "ring" (the sequence split over devices), the fused kernels and "auto" run the generic
        # attention below; a scheme that brings its own `transformed_attention` (PaTH, ESPR random
        # features) has them only if it says so (its "auto" is then its own "ring" on a sequence
        # mesh where its `impls` list one, else its reference or blockwise, by length).
        if "transformed_attention" in vars(cls) and "impls" not in vars(cls):
            cls.impls = tuple(i for i in cls.impls if i not in GENERIC_ONLY)
        if "transformed_attention" in vars(cls) and "generic_attention" not in vars(cls):
            cls.generic_attention = False

    def __post_init__(self):
        w = self.sliding_window
        if isinstance(w, bool) or not isinstance(w, int) or w < 0:
            raise ValueError(f"sliding_window={w!r} must be an int >= 0 (0: no window; W: each query sees itself "
                             "and the W - 1 tokens before it)")
        c = self.attention_chunk
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise ValueError(f"attention_chunk={c!r} must be an int >= 0 (0: none; C: each query sees the tokens of "
                             "its own chunk of C, up to itself)")
        if c and w:
            raise ValueError(f"sliding_window={w} and attention_chunk={c}: a layer takes one of the two")
        if c and not self.generic_attention:
            raise ValueError(f"{type(self).__name__} brings its own attention, which takes no chunks "
                             f"(attention_chunk={c}); use chunk 0 for this layer, or another scheme")
        if c:  # the forms that take a chunked window (positional/attention.py CHUNKED)
            object.__setattr__(self, "impls", tuple(i for i in self.impls if i in ("auto", *CHUNKED)))
        if w and not self.generic_attention:
            raise ValueError(f"{type(self).__name__} brings its own attention, which takes no sliding window "
                             f"(sliding_window={w}); use window 0 for this layer, or a scheme with a window")
        if self.needs_even_head_dim and self.head_dim % 2:
            raise ValueError(f"{type(self).__name__} rotates pairs of dimensions, so head_dim must be "
                             f"even; got head_dim={self.head_dim}")

    # ---- hooks -------------------------------------------------------------------------------
    def transform(self, q, k, v, features, positions):
        return q, k, v

    def transform_out(self, out, features, positions):
        return out

    def bias_fn(self, features, positions) -> Bias | None:
        return None

    def score_fn(self, features) -> Score | None:
        return None

    def feature_cache(self, batch: int, max_len: int) -> dict:
        return {}

    def default_features(self, q, k, *, positions, key=None, segment_ids=None) -> dict:
        if not self.has_parameters:
            return {}
        key = self.draw_key(key) if self.default_key else None
        return self.init_parameters(lambda: key, None)

    # ---- learned parameters ------------------------------------------------------------------
    def init_parameters(self, keys, model) -> dict:
        return {}

    def features(self, params, x, *, tokens, index, segment_ids=None, rng=None, past=None) -> dict:
        return dict(params)  # has_parameters: the features are the parameters

    # ---- derived -----------------------------------------------------------------------------
    @property
    def attention_window(self) -> "int | Chunk | None":
        """The window as the attention implementations take it: W, Chunk(C), or None."""
        return Chunk(self.attention_chunk) if self.attention_chunk else self.sliding_window or None

    @property
    def adds_bias(self) -> bool:
        """Whether any part (this scheme or one of `biases`) adds a logit bias."""
        return self.has_bias or bool(self.biases)

    def score_bias(self, features, positions) -> BiasFn | None:
        """This scheme's bias plus those of `biases`, as one Bias (or None); positions [B, S]
        of every key slot (None: the slot indices themselves).

        Every part reads the same features dict: the layer merges all the parts' features
        (see models/registry.py).
        """
        if not self.adds_bias:
            return None
        fns = [f for f in (self.bias_fn(features, positions), *(b.bias_fn(features, positions)
                                                                for b in self.biases)) if f]
        if all(isinstance(f, Bias) for f in fns):
            return sum_of(fns) if fns else None
        return lambda qi, kj: sum(f(qi, kj) for f in fns)  # a plain BiasFn: no fused path

    def draw_key(self, key):
        """The key of a random draw: the `draw_seed` option's where that is >= 0, else `key`."""
        seed = getattr(self, "draw_seed", -1)
        if seed >= 0:
            return jax.random.key(seed)
        if key is None:
            fix = ", or set the scheme option draw_seed >= 0 to fix the draw" if hasattr(self, "draw_seed") else ""
            raise ValueError(f"{type(self).__name__} draws random features: pass a key (key=jax.random.key(0) "
                             f"to attend, rng= to a model){fix}")
        return key

    def features_or_default(self, features, q, k, *, positions, key=None, segment_ids=None) -> Features:
        """`features` if given; else every part's `default_features` merged (None if no part
        reads features). A scheme with random features needs `key`, or raises one line."""
        parts = (self, *self.biases)
        if features is not None or not any(p.needs_features for p in parts):
            return features
        out = {}
        for part in parts:
            if part.needs_features:
                out.update(part.default_features(q, k, positions=positions, key=key, segment_ids=segment_ids))
        return out

    # ---- parallel form -----------------------------------------------------------------------
    # `features` None: the schemes that read features use their `default_features` (a notebook
    # call with no model); those with random features then need `key`.
    def attend(self, q, k, v, features=None, *, positions, segment_ids=None,
               impl: str = "reference", block_size: int = 512, key=None) -> jax.Array:
        """Causal attention under this scheme. Returns [B, T, H, D]."""
        if impl == "auto" and impl not in self.impls:  # its own ring on a sequence mesh, else by length
            impl = "ring" if "ring" in self.impls and ring_active() else by_length(k.shape[1])[0]
        if impl not in self.impls:
            why = ": ring splits the generic attention, which this scheme replaces" if impl == "ring" else ""
            raise ValueError(f"scheme {type(self).__name__} has no attention impl {impl!r}{why}; "
                             f"valid: {', '.join(self.impls)}")
        features = self.features_or_default(features, q, k, positions=positions, key=key, segment_ids=segment_ids)
        q, k, v = self.transform(q, k, v, features, positions)
        out = self.transformed_attention(q, k, v, features, positions=positions, segment_ids=segment_ids, impl=impl,
                             block_size=block_size)
        return self.transform_out(out, features, positions)

    def logits(self, q, k, v, features=None, positions=None, *, key=None) -> jax.Array:
        """Attention logits [B, K, G, T, T] of the parallel form, fp32, before the causal mask
        (entries above the diagonal are scores the mask discards). For the probes."""
        features = self.features_or_default(features, q, k, positions=positions, key=key)
        return self._scored(q, k, v, features, positions)[0]

    def _scored(self, q, k, v, features, positions):
        """(logits [B, K, G, T, T], transformed values) of the parallel form."""
        q, k, v = self.transform(q, k, v, features, positions)
        return attention_logits(q, k, bias_fn=self.score_bias(features, positions),
                                score_fn=self.score_fn(features)), v

    def weights(self, q, k, v, features=None, positions=None, *, key=None) -> jax.Array:
        """Softmax attention weights [B, K, G, T, T] of the parallel form (for the probes)."""
        features = self.features_or_default(features, q, k, positions=positions, key=key)
        return causal_softmax(self.logits(q, k, v, features, positions, key=key), window=self.attention_window,
                              sink=sink_in(features))

    def placed_attention(self, q, k, v, features, *, positions, key_slots) -> jax.Array:
        """Causal attention in which key and value j sit at slot key_slots[b, j] instead of j.

        The perturbation probes' attention (eval's analysis): key j is scored, and its value
        transformed, as the content of slot key_slots[b, j], under the real features and
        positions of the sequence (the transport between that slot and the query is the real
        one), while the mask stays causal in content: query i reads key j iff j <= i, wherever
        it sits, so nothing from the future leaks. Moved keys must go to distinct slots;
        key_slots = arange gives the ordinary attention. Materialises [B, H, T, T]; any scheme
        whose logits `logits` gives. Returns [B, T, H, D].
        """
        b, t, h, d = q.shape
        index = jnp.arange(t)
        moved = key_slots != index
        # Second pass: slot s holds the key moved there, or its own key where none was.
        src = jnp.broadcast_to(index, (b, t)).at[jnp.arange(b)[:, None], jnp.where(moved, key_slots, t)].set(
            jnp.broadcast_to(index, (b, t)), mode="drop")

        def gather(x, idx):
            return jnp.take_along_axis(x, idx[:, :, None, None], axis=1)

        own, v_own = self._scored(q, k, v, features, positions)
        at, v_at = self._scored(q, gather(k, src), gather(v, src), features, positions)
        at = jnp.take_along_axis(at, jnp.broadcast_to(key_slots[:, None, None, None], at.shape), axis=-1)
        scores = jnp.where(moved[:, None, None, None], at, own)
        w = causal_softmax(scores, window=self.attention_window, sink=sink_in(features))
        values = jnp.where(moved[:, :, None, None], gather(v_at, key_slots), v_own)
        out = jnp.einsum("bkgts,bskd->btkgd", w, values.astype(jnp.float32)).reshape(b, t, h, -1)
        return self.transform_out(out.astype(q.dtype), features, positions)

    def transformed_attention(self, q, k, v, features, *, positions=None, segment_ids=None, q_offset=0, impl="reference",
                  block_size=512, **decoding) -> jax.Array:
        """Attention on transformed q, k, v with this scheme's score and bias; positions [B, S] of
        the key slots (the bias reads them; None: the slot indices). `decoding`: the reference's
        key_segment_ids, which a decode step on a ring buffer passes (`ring_step`), and a window
        other than the layer's (None: a chunked layer's ring, whose segments are its chunks)."""
        window = decoding.pop("window", self.attention_window)
        if impl == "auto" and ring_active():
            impl = "ring"
            log_ring(type(self).__name__)
        hooks = {"bias_fn": self.score_bias(features, positions), "score_fn": self.score_fn(features)}
        if impl == "ring" and any(hooks.values()):  # built inside the ring's shard_map (positional/ring.py)
            hooks = {"hooks": lambda f: (self.score_bias(f["features"], f["positions"]), self.score_fn(f["features"])),
                     "features": {"features": features, "positions": positions}}
        label = {"label": type(self).__name__} if impl == "auto" else {}
        sink = {} if sink_in(features) is None else {"sink": sink_in(features)}
        return attention(q, k, v, segment_ids=segment_ids, q_offset=q_offset, impl=impl,
                         block_size=block_size, window=window, **hooks, **label, **decoding, **sink)

    # ---- decode form -------------------------------------------------------------------------
    def init_cache(self, batch: int, max_len: int, num_kv_heads: int, dtype=jnp.float32) -> dict:
        """The decode cache of up to max_len tokens: every token's key and value (and cached
        features, and positions where a bias reads them); with a sliding window W < max_len (or
        an attention chunk C < max_len) a ring buffer of the last W (C) tokens (`ring_step`: no
        earlier key can reach a query), marked by its entry "ring", which holds no more than W
        (C) tokens whatever the sequence's length."""
        span = self.sliding_window or self.attention_chunk
        ring = bool(span) and span < max_len
        slots = span if ring else max_len
        shape = (batch, slots, num_kv_heads, self.head_dim)
        cached = {}
        for part in (self, *self.biases):
            cached.update(part.feature_cache(batch, slots))
        cache = {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype),
                 "index": jnp.zeros((), jnp.int32), "features": cached}
        if self.adds_bias:  # the bias reads the positions of the cached keys
            cache["positions"] = jnp.zeros((batch, slots), jnp.int32)
        if ring:
            cache["ring"] = jnp.zeros((), jnp.int32)
        return cache

    def remember(self, cache: dict, features, positions):
        """Write the new tokens' cached features (and positions, where a bias reads them) at the
        cache index; return (cache, features with those entries covering every cached slot,
        positions of every cached slot or None)."""
        def put(buf, x):
            return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), cache["index"], axis=1)

        cached = {name: put(x, features[name]) for name, x in cache["features"].items()}
        cache = {**cache, "features": cached}
        if "positions" in cache:
            cache["positions"] = put(cache["positions"], positions)
        return cache, ({**features, **cached} if cached else features), cache.get("positions")

    # The length past which the scheme changes the angles of tokens already seen (LongRoPE's
    # switch of factors): `models.lm.generate` re-encodes the sequence there. None: never.
    reencode_length = None

    def decode_step(self, cache: dict, q, k, v, features=None, positions=None):
        """Attend n new tokens (q, k, v: [B, n, ., D]) at positions index..index+n-1.

        n = 1 is one decoding step; n > 1 is a (chunked) prefill. Returns (out, cache).
        The caller guarantees index + n <= max_len (see `check_cache_room`). `positions` of
        the new tokens are given only where they are not the cache slots (multi-axis, ESPR).
        """
        b, n = q.shape[:2]
        index = cache["index"]
        if positions is None:
            positions = jnp.broadcast_to(index + jnp.arange(n, dtype=jnp.int32), (b, n))
        q, k, v = self.transform(q, k, v, features, positions)
        if "ring" in cache:
            return self.ring_step(cache, q, k, v, features, positions)
        ck = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), index, axis=1)
        cv = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), index, axis=1)
        cache, attn_features, key_positions = self.remember(cache, features, positions)
        out = self.transformed_attention(q, ck, cv, attn_features, positions=key_positions, q_offset=index)
        out = self.transform_out(out, features, positions)
        return out, {**cache, "k": ck, "v": cv, "index": index + n}

    def ring_step(self, cache: dict, q, k, v, features, positions):
        """`decode_step` on a ring buffer of the last C tokens (q, k, v transformed): the cached
        keys in token order, then the n new ones, the queries at slots C .. C + n - 1 (so slots
        differ as positions do), the slots no token has been written to yet masked (key segment
        -1); then the last min(n, C) new tokens overwrite the oldest. A chunked layer's keys and
        queries have their chunk's number as their segment (the chunk mask is not the same at every
        slot, as a window's is)."""
        b, n = q.shape[:2]
        index, c = cache["index"], cache["k"].shape[1]
        order = (index - c + jnp.arange(c)) % c  # the ring slots of tokens index - C .. index - 1
        kept = min(n, c)
        dest = (index + n - kept + jnp.arange(kept)) % c

        def view(buf, new):
            return jnp.concatenate([buf[:, order], new.astype(buf.dtype)], axis=1)

        def put(buf, new):
            return buf.at[:, dest].set(new[:, n - kept:].astype(buf.dtype))

        cached = {name: view(buf, features[name]) for name, buf in cache["features"].items()}
        key_positions = view(cache["positions"], positions) if "positions" in cache else None
        slots = jnp.arange(c + n)
        written = jnp.where(slots >= c - index, 0, -1)
        masks = {}
        if self.attention_chunk:  # the tokens at slots: index - c + slot
            chunk = self.attention_chunk
            written = jnp.where(written == 0, (index - c + slots) // chunk, -1)
            masks = {"window": None, "segment_ids": jnp.broadcast_to((index + jnp.arange(n)) // chunk, (b, n))}
        out = self.transformed_attention(q, view(cache["k"], k), view(cache["v"], v),
                                         {**features, **cached} if cached else features, positions=key_positions,
                                         q_offset=c, key_segment_ids=jnp.broadcast_to(written, (b, c + n)), **masks)
        new = {**cache, "k": put(cache["k"], k), "v": put(cache["v"], v), "index": index + n,
               "features": {name: put(buf, features[name]) for name, buf in cache["features"].items()}}
        if "positions" in cache:
            new["positions"] = put(cache["positions"], positions)
        return self.transform_out(out, features, positions), new


def sink_in(features):
    """The sink logits [H] the features hold (a layer with sinks puts them there), else None."""
    return features.get("sink") if isinstance(features, dict) else None


def position_values(positions) -> dict:
    """A bias's values holding the position of every slot, {"position": [B, S, 1] fp32}; {} when
    positions are None (the slots themselves: a bias then reads qi and kj)."""
    if positions is None:
        return {}
    if positions.ndim != 2:
        raise ValueError(f"this bias needs one position per token, positions [B, T]; got shape "
                         f"{tuple(positions.shape)}")
    return {"position": positions.astype(jnp.float32)[..., None]}


def check_cache_room(cache_len: int, index: int, n: int) -> None:
    """Raise a readable error when n more tokens do not fit in a cache of cache_len."""
    if index + n > cache_len:
        raise ValueError(f"sequence too long for the cache: {index} cached + {n} new tokens > "
                         f"cache length {cache_len}; create the cache with a larger max_len")


def linear_parameters(keys, n: int, m: int, stddev: float, bias: float | None = None) -> dict:
    """A learned linear map n -> m: {'kernel' [n, m] ~ N(0, stddev^2) (stddev 0: zeros)}, with
    `bias` also {'bias' [m]} of that constant; one key drawn for each, as flax's nnx.Linear draws
    them (so a model's later draws, and its parameters' names, are those of an nnx.Linear)."""
    key = keys()
    kernel = jax.nn.initializers.normal(stddev)(key, (n, m), jnp.float32) if stddev else jnp.zeros((n, m), jnp.float32)
    if bias is None:
        return {"kernel": kernel}
    keys()
    return {"kernel": kernel, "bias": jnp.full((m,), bias, jnp.float32)}


def dense(x, p: dict) -> jax.Array:
    """x [..., n] through the linear map `linear_parameters` made, as nnx.Linear computes it."""
    dtype = jnp.result_type(x, *p.values())  # as nnx.Linear promotes its operands
    y = jax.lax.dot_general(jnp.asarray(x, dtype), jnp.asarray(p["kernel"], dtype), (((x.ndim - 1,), (0,)), ((), ())))
    return y + jnp.asarray(p["bias"], dtype).reshape((1,) * (y.ndim - 1) + (-1,)) if "bias" in p else y
