"""The PaTH scheme (positional/path/__init__.py): its options and features, the impls and their
`auto` choice, and decoding."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from positional.attention import OwnKernel, attention, choose, per_device, per_platform_choice
from positional.path.chunked import ACROSS, TILES, chunked_attention
from positional.path.kernel import refusal
from positional.path.reference import dense_score_fn
from positional.path.ring import ring_path_attention
from positional.path.transport import HIGHEST, check_transport, transport_to_end
from positional.ring import active_mesh, ring_active
from positional.scheme import Scheme, dense, linear_parameters


@dataclasses.dataclass(frozen=True)
class Path(Scheme):
    """PaTH transport of keys; `features` = {'w': [B, T, K, D] unit, 'beta': [B, T, K] in (0, 2)}.

    Learned per layer: w_t = normalise(conv(W_up W_down x_t)) per kv head, a rank-`rank`
    projection, as in the public PaTH layer, then (`conv` > 0) a causal depthwise convolution of
    that width with SiLU, restarted at document starts; beta_t = 2 sigmoid(W_b x_t + b) in (0, 2)
    per kv head, starting near 1 (b = 0). Decoding, the convolution reads the previous
    projections from the layer cache (`past`), where `feature_cache` stores them.

    impl "reference" materialises the T x T logits (`path_scores`, one UT solve per
    `solve_chunk` tokens), "blockwise" is the flash-style chunked form with `block_size` tokens
    per chunk and O(T * D) memory, training included (`chunked_attention`; in two levels with
    blocks of `span` tokens where span > 0; with "pallas" the kernel inside them, and `across`
    says what scores the routes between them), "pallas" the same
    algorithm as a Pallas kernel (positional/path/kernel.py; the interpreter on CPU, with
    `block_size`-token chunks there), "ring" splits the sequence over the devices of the
    enclosing sequence mesh (`ring_path_attention`, its own shard by the chunked form; off one,
    the chunked form), and "auto" the ring on a sequence mesh (its own shard by the kernel where
    auto would pick it for one shard, i.e. TPU; with `span`, inside blocks), else the kernel on
    TPU (blockwise where it refuses the call), blockwise on GPU (attention.FACTS
    ["path_kernel_gpu"]), on CPU the reference up to attention.REFERENCE_MAX keys and blockwise
    past it.
    The decode cache holds keys already carried to the latest token; each new token applies its
    H_t to all of them (O(T * D) per token).
    """
    rank: int = 32  # w = normalise(conv(W_up W_down x)): the rank of that projection
    conv: int = 3  # width of the short causal convolution in w (0: none); 3 as the public layer
    qk_norm: bool = False  # RMS-normalise q and k per head (parameter-free) before the transport
    solve_chunk: int = 64  # impl "reference": tokens per UT solve in the logits (0: one solve over T)
    # impls "blockwise" and "pallas": two levels, blocks of `span` tokens (a multiple of block_size;
    # 0: one level): the chunked form (or the kernel, each block its own sequence) inside the
    # blocks, the chunked form across them (`chunked_attention`).
    span: int = 0
    # two levels: query blocks at a time across the blocks: per step of the outer scan (its backward
    # keeps about T x outer_group x D numbers per head of query chains), or per call of the
    # across-blocks kernel (which holds T / span versions of outer_group x span queries at once);
    # fewer: less memory, more steps
    outer_group: int = 8
    tiles: str = "fp32"  # the chunked form's q.k and P.V tiles' operands, "fp32" or "bf16" (TILES)
    # two levels with the kernel inside the blocks: across them the chunked form's scan ("scan"), or
    # the across-blocks kernel ("blocks": T / span copies of outer_group blocks' queries at a time;
    # positional/path/across.py),
    # or that kernel across each block's chunks too, no PaTH kernel ("chunks"; chunked.ACROSS)
    across: str = "scan"

    relative = False  # routes depend on the tokens between, not on positions
    impls = ("auto", "reference", "blockwise", "pallas", "ring")
    has_score = needs_features = default_key = True
    probes = ("householder",)
    # The reference form materialises the logits with one UT solve per 64 tokens (the fastest at
    # training lengths: benchmarks/RESULTS.md, section 'PaTH and FoX training-step throughput');
    # from eval.blockwise_from on, the chunked algorithm runs 64-token chunks.
    config_defaults = {"block_size": 64}

    def __post_init__(self):
        super().__post_init__()
        for name, least in (("rank", 1), ("conv", 0), ("solve_chunk", 0), ("span", 0), ("outer_group", 1)):
            if getattr(self, name) < least:
                raise ValueError(f"PaTH option {name}={getattr(self, name)} must be >= {least}")
        if self.tiles not in TILES:
            raise ValueError(f"PaTH option tiles={self.tiles!r} must be one of {sorted(TILES)}")
        if self.across not in ACROSS:
            raise ValueError(f"PaTH option across={self.across!r} must be one of {ACROSS}")

    def transform(self, q, k, v, features, positions):
        if self.qk_norm:
            q, k = (x * jax.lax.rsqrt(jnp.mean(jnp.square(x.astype(jnp.float32)), -1, keepdims=True) + 1e-6)
                    .astype(x.dtype) for x in (q, k))
        return q, k, v

    def score_fn(self, features):  # the whole sequence as one block: reference attention only
        w, beta = features["w"], features["beta"]
        return dense_score_fn(w, beta, self.head_dim ** -0.5, self.solve_chunk or None)

    @property
    def reads_past(self) -> bool:
        return bool(self.conv)

    def init_parameters(self, keys, model):
        kv, d = model.resolved_kv_heads, model.d_model
        out = {"down": linear_parameters(keys, d, self.rank, d ** -0.5),
               "up": linear_parameters(keys, self.rank, kv * self.head_dim, self.rank ** -0.5),
               "gain": linear_parameters(keys, d, kv, d ** -0.5, bias=0.0)}
        if self.conv:
            out["kernel"] = jax.nn.initializers.normal(self.conv ** -0.5)(keys(), (self.conv, kv * self.head_dim))
        return out

    def features(self, params, x, *, tokens, index, segment_ids=None, rng=None, past=None):
        x = x.astype(jnp.float32)
        u = dense(dense(x, params["down"]), params["up"])  # [B, T, K * D]
        out = {"beta": 2 * jax.nn.sigmoid(dense(x, params["gain"]))}
        if self.conv:
            out["w_in"] = u
            u = causal_conv(u, params["kernel"], segment_ids, past)
        w = u.reshape(*out["beta"].shape, -1)  # [B, T, K, D]
        out["w"] = w * jax.lax.rsqrt(jnp.sum(w * w, -1, keepdims=True) + 1e-12)
        return out

    def default_features(self, q, k, *, positions, key=None, segment_ids=None):
        """Steps of random directions (uniform on the sphere, drawn from `key`) with beta = 1,
        the gain at initialisation."""
        w = jax.random.normal(self.draw_key(key), k.shape, jnp.float32)
        return {"w": w * jax.lax.rsqrt(jnp.sum(w * w, -1, keepdims=True)), "beta": jnp.ones(k.shape[:3], jnp.float32)}

    def transformed_attention(self, q, k, v, features, *, positions=None, segment_ids=None, q_offset=0, impl="reference",
                  block_size=512, platform=None):
        w, beta = features["w"], features["beta"]
        check_transport(k, w, beta)
        bias = self.score_bias(features, positions)
        span = self.span if 0 < self.span < k.shape[1] else None
        if impl == "auto" and ring_active():  # the sequence split over a mesh: PaTH's own ring, on every platform
            mesh = active_mesh()
            shard = k.shape[1] // mesh.shape["sequence"]  # its own shard by the kernel where auto picks it
            inner = self.span if 0 < self.span < shard else shard  # (inside blocks of span tokens)
            own = OwnKernel("PaTH's kernel", lambda platform: refusal(bias, k[:, :inner], platform),
                            slower={"cuda": "path_kernel_gpu"})

            def ring(platform):
                chosen, why = choose(q[:, :shard], k[:, :shard], v[:, :shard], platform=platform, own=own)
                kernel = {"block_size": block_size, "platform": platform} if chosen == "pallas" else None
                own_span = inner if kernel and inner < shard else None

                # The arrays as operands: a shard_map in a platform_dependent branch may close over none.
                def run(q, k, v, features, positions, segment_ids):
                    return ring_path_attention(q, k, v, features["w"], features["beta"], mesh=mesh,
                                               bias_fn=self.score_bias(features, positions), segment_ids=segment_ids,
                                               chunk=block_size, kernel=kernel, span=own_span,
                                               outer_group=self.outer_group, across=self.across)
                return "ring", f"the sequence axis of the mesh splits the keys; own shard: {why}", run
            return per_platform_choice(ring, q, k, v, features, positions, segment_ids, label=type(self).__name__)

        def kernel(q, k, v, w, beta, bias, seg, platform=platform):  # with span: inside blocks, the chunked form across
            return chunked_attention(q, k, v, w, beta, bias_fn=bias, segment_ids=seg, chunk=block_size, span=span,
                                     outer_group=self.outer_group, tiles=self.tiles, across=self.across,
                                     kernel={"block_size": block_size, "platform": platform})

        if impl == "auto":  # on CPU by length, on GPU blockwise (FACTS["path_kernel_gpu"]), on TPU the kernel
            own = OwnKernel("PaTH's kernel", lambda platform: refusal(bias, k[:, :span], platform),
                            slower={"cuda": "path_kernel_gpu"})

            def pick(platform):
                chosen, why = choose(q, k, v, platform=platform, own=own)
                if chosen == "pallas":  # the kernel per device on a mesh (XLA cannot partition it)
                    return chosen, why, lambda q, k, v: per_device(functools.partial(kernel, platform=platform),
                                                                   q, k, v, w, beta, bias_fn=bias,
                                                                   segment_ids=segment_ids)
                return chosen, why, lambda q, k, v: self.transformed_attention(
                    q, k, v, features, positions=positions, segment_ids=segment_ids, impl=chosen,
                    block_size=block_size, platform=platform)
            return per_platform_choice(pick, q, k, v, label=type(self).__name__)
        if impl == "ring" and active_mesh() is not None:
            return ring_path_attention(q, k, v, w, beta, mesh=active_mesh(), bias_fn=bias, segment_ids=segment_ids,
                                       chunk=block_size)
        if impl in ("blockwise", "ring"):  # "ring" off a sequence mesh: the chunked form
            return chunked_attention(q, k, v, w, beta, segment_ids=segment_ids, bias_fn=bias, chunk=block_size,
                                     span=span, outer_group=self.outer_group, tiles=self.tiles)
        if impl == "pallas":  # the Pallas interpreter on CPU, with block_size-token chunks
            return kernel(q, k, v, w, beta, bias, segment_ids)
        return super().transformed_attention(q, k, v, features, positions=positions, segment_ids=segment_ids)

    def init_cache(self, batch, max_len, num_kv_heads, dtype=jnp.float32):
        # Keys are carried by every new token, so they stay fp32 whatever the model dtype.
        cache = super().init_cache(batch, max_len, num_kv_heads, dtype)
        if self.conv:  # the projections the convolution of w reads (`features`)
            cache["features"]["w_in"] = jnp.zeros((batch, max_len, num_kv_heads * self.head_dim), jnp.float32)
        return {**cache, "k": cache["k"].astype(jnp.float32)}

    def decode_step(self, cache, q, k, v, features=None):
        """n new tokens at the cache index. One token: carry every cached key by H_t (a rank-one
        update), append k_t, attend. Several (a prefill): the whole cache as one sequence in
        which the cached slots take no step (beta 0: their keys are already carried to the
        index) and the new tokens take theirs, attended by the chunked algorithm; the keys are
        then carried to the last new token by `transport_to_end`. O(L * D) memory either way."""
        q, k, v = self.transform(q, k, v, features, None)
        b, n = q.shape[:2]
        index = cache["index"]
        cache, bias_features, key_positions = self.remember(
            cache, features, jnp.broadcast_to(index + jnp.arange(n, dtype=jnp.int32), (b, n)))
        bias_fn = self.score_bias(bias_features, key_positions)
        w, beta = features["w"].astype(jnp.float32), features["beta"].astype(jnp.float32)

        def put(buf, x):
            return jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), index, axis=1)

        cv = put(cache["v"], v)
        if n == 1:  # the new token's own step does not act on its key: carry, then append
            ck = cache["k"]
            ck = put(ck - beta[..., None] * w * jnp.einsum("bskd,bkd->bsk", ck, w[:, 0], precision=HIGHEST)[
                ..., None], k)
            out = attention(q, ck, cv, bias_fn=bias_fn, q_offset=index)
        else:
            ck = put(cache["k"], k)
            ws = put(jnp.zeros(ck.shape, jnp.float32), w)
            betas = put(jnp.zeros(ck.shape[:3], jnp.float32), beta)
            qs = put(jnp.zeros(ck.shape[:2] + q.shape[2:], q.dtype), q)
            out = chunked_attention(qs, ck, cv, ws, betas, bias_fn=bias_fn)
            out = jax.lax.dynamic_slice_in_dim(out, index, n, axis=1)
            ck = transport_to_end(ck, ws, betas)
        return out, {**cache, "k": ck, "v": cv, "index": index + n}


def causal_conv(u, kernel, segment_ids=None, past=None):
    """Causal depthwise convolution of width c = len(kernel), then SiLU: silu(sum_s kernel[s] u_{t-s})
    over u [B, T, n]; in the parallel form (`past` None) zeros before the start and none across
    documents; decoding, the c - 1 projections before the cache index (`past`, the layer cache),
    zeros before token 0."""
    c, t = kernel.shape[0], u.shape[1]
    if past is None:
        seg = jnp.zeros(u.shape[:2], jnp.int32) if segment_ids is None else segment_ids
        hist = jnp.pad(u, ((0, 0), (c - 1, 0), (0, 0)))
        hist_seg = jnp.pad(seg, ((0, 0), (c - 1, 0)), constant_values=-1)
    else:
        start = past["index"] - (c - 1)
        padded = jnp.pad(past["features"]["w_in"], ((0, 0), (c - 1, 0), (0, 0)))
        prev = jax.lax.dynamic_slice_in_dim(padded, start + c - 1, c - 1, axis=1)
        hist = jnp.concatenate([prev, u], axis=1)
        hist_seg = jnp.where(start + jnp.arange(t + c - 1) >= 0, 0, -1)[None]
        seg = jnp.zeros(u.shape[:2], jnp.int32)
    acc = 0.0
    for s in range(c):  # tap s reads token t - s
        same = (hist_seg[:, c - 1 - s:c - 1 - s + t] == seg)[..., None]
        acc = acc + kernel[s] * jnp.where(same, hist[:, c - 1 - s:c - 1 - s + t], 0.0)
    return jax.nn.silu(acc)
