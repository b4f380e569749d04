"""Vendor attention kernels behind the dispatcher's signature: cuDNN flash attention on CUDA
GPUs ("cudnn", through `jax.nn.dot_product_attention` and jax's cuDNN binding) and Pallas
splash attention on TPU ("splash", `jax.experimental.pallas.ops.tpu.splash_attention`).

Both compute plain causal softmax attention with the semantics of positional/softmax.py (GQA,
causal with `q_offset`, same-segment masking, `scale`, output in q's dtype), no `score_fn`,
and a `bias_fn` only when it is per key (`positional.logits.Bias.key`: FoX, ALiBi, their sums).
Each has a pure `*_refusal(...)` that says, in one line, why it cannot take a call (or None);
the implementation raises ValueError with that line. A chooser calls the refusal with the
platform being lowered for.

Per-key biases through q.k (`key_bias_channels`)
  In a causal softmax row a bias c_i + e_j may take any c_i (a constant of the row), so the
  logit is scale * q.k + e_j - e_i (0 on the diagonal): each key gets CHANNELS more head dims
  holding e_j / scale split into bf16 hi + mid + lo (fp32's 24 bits, `split_float`; one bf16
  number is not enough), each query ones in the channels of its own head (CHANNELS per query
  head sharing a key head under GQA), and CHANNELS more with -e_i / scale at the query's own
  slot against ones in every key; the kernel's fp32 accumulation adds them, and autodiff gives
  e's gradient through the hi channels. The query's term changes no value; it is there for the
  gradient: the kernels take D = rowsum(dO * O) from the bf16 output and round dS to bf16, so a
  row's dS no longer sums to 0, and e_j's gradient (dS summed down column j) carries those
  residues; through the query's channel each row's residue comes back with the other sign
  (dS summed along row i), and FoX's gates, a sum of e's gradient over later slots, see the
  rows' residues cancel. In an emulation of those roundings (tests/helpers/flash_rounding.py)
  the gates' error fell 3x; what is left is dk's own bf16 rounding, 5-9x the bf16 reference's,
  so auto keeps a `learned` bias (FoX) off the channels. e is rebased per document (e minus e
  at the first key of its document: a constant of every row that reads it), so its size is that
  of one document's, as an in-kernel fp32 bias computes it; auto uses the channels only while a
  bias's static `key_bound` stays within CHANNEL_BOUND (below). Head dims are zero-padded to a
  multiple of 8 (cuDNN) or 64 (splash); v keeps its own on splash, and is padded to q's on
  cuDNN (jax.nn's call takes one head dim).

cudnn (`cudnn_attention`)
  bf16 or fp16 q, k, v of one dtype; head_dim a multiple of 8 and at most 128 (256 where this
  process's GPU is Hopper or later: the rule jax applies when it traces the call). GQA is
  native. Causal with q_offset 0 and T == S (training) is cuDNN's causal mask, no bias.
  Packed rows (segment ids) in the training case are cuDNN's packed form: each maximal run of
  equal ids is one segment (`packed_segments`: lengths and offsets per row, at most
  `max_segments` of them, a static number), causal within it (PADDING_CAUSAL), no bias. This
  equals the same-segment mask when every id is one contiguous run, as the data pipeline makes
  them (documents numbered 1, 2, ... along a row); an id that comes back after another id is a
  new document here. cuDNN takes the packed form from Hopper on; an odd length gets one more
  token in the row's last document (after every real query; its output is dropped). A batch with a row of more
  runs than `max_segments` takes `overflow` instead (a `lax.cond`: both are compiled, one runs;
  default the mask form below), so the result is exact for any packing.
  Everything else is an explicit boolean mask that jax passes to cuDNN as a [B or 1, 1, T, S]
  additive bias: segment ids before Hopper or with max_segments=0, and decoding (q_offset > 0,
  static or traced, T <= S). That bias is O(B T S) memory, and cuDNN's backward also writes
  its gradient (jax always asks for it). With a bias, cuDNN's backward needs even lengths: an
  odd T gets one padded query row, an odd S one padded, masked key.
  cuDNN's backward is reported to miscompute dq and dk silently past 2^31 elements in one call
  (the cuDNN that jax 0.11.2 ships): a call whose q or k holds more is split along the batch,
  and a single row that large is refused.
  jax asks cuDNN for its version when it traces the call, so a process without cuDNN (a CPU-only
  jaxlib) refuses at trace time; where cuDNN is present, the call is built with
  `jax.lax.platform_dependent` (positional.kernels.per_platform), so lowering it for a platform
  other than cuda raises the one-line refusal there.

splash (`splash_attention`)
  Training shapes only: q_offset the static 0 and T == S (no decoding); bf16 or fp32; head_dim
  a multiple of 64 (the head dims jax's splash tests run: 64, 128, 192, 256). GQA is native
  (the kernel's MHA form with fewer kv heads); segment ids are the kernel's SegmentIds. The
  kernel takes [H, T, D] per example (vmapped over the batch) and no scale, so q is pre-scaled
  (rounded to q's dtype: one more rounding than positional/softmax.py's fp32 scale). Its tiles
  must be multiples of 128 dividing the sequence: T is padded up to a multiple of 128 and the
  tile is the largest 128 * 2^i <= max(block_size, 128) that divides it. Padded keys sit after
  every real query, so the causal mask already hides them (no extra segment id needed); padded
  queries see themselves, and their rows are dropped (zero cotangent, exact gradients). Lowered
  with `per_platform`: Mosaic on tpu, the refusal elsewhere; interpret=True runs the Pallas
  interpreter on any platform (tests), where head_dim is not checked.
"""

from __future__ import annotations

import functools
import math
import operator

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.cudnn import fused_attention_stablehlo
from jax.experimental.pallas.ops.tpu import splash_attention as splash

from positional.angles import split_bits
from positional.kernels import per_platform
from positional.logits import Bias
from positional.softmax import BiasFn, ScoreFn, causal_mask, check_shapes, check_window, segment_starts

INSTEAD = "use impl='blockwise' or 'auto'"
# per_platform's backend names -> the platform names refusals use.
_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}


def static_int(x) -> int | None:
    """x as a Python int when it is known at trace time, else None (a traced value)."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return operator.index(np.asarray(x).item())
    except TypeError:
        return None


def _dtype_name(x) -> str:
    return jnp.dtype(x.dtype).name


def per_key(bias_fn) -> bool:
    """Whether a bias_fn is a per-key `positional.logits.Bias` (plain kernels take it)."""
    return isinstance(bias_fn, Bias) and bias_fn.key is not None


def _hooks_refusal(impl: str, bias_fn, score_fn) -> str | None:
    if bias_fn is not None and not per_key(bias_fn):
        return (f"impl={impl!r} is plain softmax attention and takes a bias_fn only when it is per key (a "
                f"positional.logits.Bias with `key`, as FoX's and ALiBi's); this scheme's bias reads query "
                f"and key together; use impl='pallas' (the fused kernel), 'blockwise' or 'auto'")
    if score_fn is not None:
        return (f"impl={impl!r} is plain softmax attention and cannot take score_fn (this scheme's logit "
                f"is not scale * q.k); {INSTEAD}")
    return None


def _dtype_refusal(impl: str, q, k, v, allowed: tuple[str, ...], why: str) -> str | None:
    names = (_dtype_name(q), _dtype_name(k), _dtype_name(v))
    if names[0] not in allowed:
        return (f"impl={impl!r} cannot take q dtype {names[0]}: {why} needs {' or '.join(allowed)}; "
                f"cast q, k, v or {INSTEAD}")
    if len(set(names)) > 1:
        return (f"impl={impl!r} needs q, k, v of one dtype, got q {names[0]}, k {names[1]}, v {names[2]}; "
                f"cast them or {INSTEAD}")
    return None


# ---- per-key biases through q.k -------------------------------------------------------------

CHANNELS = 3  # bf16 numbers per key term and query head: hi + mid + lo
# The kernels add the channels to q.k in fp32, so a key term e reaches the logit rounded by about
# |e| 2^-24 (the scale cancels), where an in-kernel bias b_ij is rounded by |b_ij| 2^-24. Past
# |e| = 2^15 that passes bf16's own rounding of the weights (2^-9) for the nearest keys, which an
# in-kernel ALiBi (m (p_i - p_j), small for them) does not suffer: auto keeps a bias whose
# `key_bound` passes this on the fused kernel (ALiBi with slope 0.71, 16 heads: from 46K keys).
CHANNEL_BOUND = 2.0 ** 15


def widened_head_dim(q, k, bias_fn, multiple: int) -> int:
    """q's and k's head dim in the channel form (q's own without a bias), padded to `multiple`:
    CHANNELS per query head sharing a key head for the key term, CHANNELS for the query term."""
    if bias_fn is None:
        return q.shape[-1]
    return -(-(q.shape[-1] + CHANNELS * (q.shape[2] // k.shape[2] + 1)) // multiple) * multiple


def split_float(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """fp32 x as three numbers of `dtype` (bf16 or fp16) whose sum is x to fp32's 24 bits
    (`split_bits` twice); the gradient flows through the first (d hi / d x = 1)."""
    bits = jnp.finfo(dtype).nmant + 1
    hi, rest = split_bits(x, bits)
    mid, lo = split_bits(jax.lax.stop_gradient(rest), bits)
    return (x + jax.lax.stop_gradient(hi - x)).astype(dtype), mid.astype(dtype), lo.astype(dtype)


def key_bias_channels(q, k, bias: Bias, *, segment_ids=None, q_offset=0, scale: float, multiple: int):
    """(q', k') with q' . k' * scale = q . k * scale + e_j - e_i (bias's per-key term at the key's
    slot and at the query's, q_offset + i, rebased per document), in head dims padded to
    `multiple` (the module doc)."""
    b, t, h, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = h // kh
    term = jnp.broadcast_to(bias.key_terms(s), (b, h, s))
    first = jnp.zeros((b, s), jnp.int32)  # the first key of each key's document
    if segment_ids is not None and segment_ids.shape[1] == s:
        first = jax.lax.cummax(jnp.where(segment_starts(segment_ids), jnp.arange(s), 0), axis=1)
    term = term - jnp.take_along_axis(term, jnp.broadcast_to(first[:, None], term.shape), axis=2)
    x = (term / scale).reshape(b, kh, g, s).transpose(0, 3, 1, 2)  # [B, S, K, G]
    own = -jax.lax.dynamic_slice_in_dim(term, q_offset, t, axis=2) / scale  # [B, H, T]
    keys = jnp.stack(split_float(x, k.dtype), axis=-1).reshape(b, s, kh, CHANNELS * g)
    queries = jnp.stack(split_float(own.transpose(0, 2, 1), q.dtype), axis=-1)  # [B, T, H, CHANNELS]
    pad = widened_head_dim(q, k, bias, multiple) - d - CHANNELS * (g + 1)
    ones = jnp.repeat(jnp.eye(g, dtype=q.dtype), CHANNELS, axis=1)  # query head (kappa, i): ones at its own
    qc = jnp.broadcast_to(ones, (b, t, kh, g, CHANNELS * g)).reshape(b, t, h, CHANNELS * g)
    q = jnp.concatenate([q, qc, queries, jnp.zeros((b, t, h, pad), q.dtype)], axis=-1)
    k = jnp.concatenate([k, keys, jnp.ones((b, s, kh, CHANNELS), k.dtype), jnp.zeros((b, s, kh, pad), k.dtype)],
                        axis=-1)
    return q, k


# ---- cuDNN ---------------------------------------------------------------------------------

def cudnn_present() -> bool:
    """Whether jax can build a cuDNN call in this process: it asks the cuDNN library for its
    version when it traces one (a CPU-only jaxlib has none)."""
    try:
        fused_attention_stablehlo.check_cudnn_version()
    except (RuntimeError, ImportError, AttributeError):
        return False
    return True


def cudnn_hopper() -> bool:
    """Whether this process's GPU is Hopper or later, by jax's own test (it reads the default
    backend's first device when it traces a cuDNN call; False without a CUDA GPU)."""
    try:
        return fused_attention_stablehlo.check_compute_capability("9.0")
    except (RuntimeError, AttributeError, ValueError):
        return False


def cudnn_head_dim_limit() -> int:
    """The largest head_dim jax lets cuDNN take here: 256 on Hopper or later, else 128."""
    return 256 if cudnn_hopper() else 128


PACKED_SEGMENTS = 16  # default static maximum of segments per row in cuDNN's packed form
ELEMENTS_PER_CALL = 2 ** 31  # cuDNN's backward is wrong past this many q (or k) elements in one call


def packed_segments(segment_ids, max_segments: int):
    """cuDNN's packed form of segment ids [B, T]: (seqlen [B, M], offsets [B, M + 1], fits [B]).
    Segment m of row b is the m-th maximal run of equal ids: it starts at offsets[b, m] and is
    seqlen[b, m] tokens long; unused slots (and offsets' last) are -1. fits[b]: the row has at
    most M = max_segments runs (else its runs past the M-th are not described)."""
    t = segment_ids.shape[1]
    starts = segment_starts(segment_ids)

    def row(start):
        first = jnp.nonzero(start, size=max_segments, fill_value=t)[0]
        end = jnp.concatenate([first[1:], jnp.full((1,), t, first.dtype)])
        used = first < t
        offsets = jnp.concatenate([jnp.where(used, first, -1), jnp.full((1,), -1, first.dtype)])
        return jnp.where(used, end - first, -1), offsets

    seqlen, offsets = jax.vmap(row)(starts)
    return seqlen.astype(jnp.int32), offsets.astype(jnp.int32), starts.sum(axis=1) <= max_segments


def packed_mask(seqlen, offsets, length: int, window: int | None = None):
    """The [B, 1, T, T] boolean mask cuDNN's packed causal form applies: query i reads key j iff
    both lie in one described segment and j <= i (and i - j < window, with one; tokens outside
    every segment read nothing)."""
    pos = jnp.arange(length)
    inside = ((seqlen[..., None] > 0) & (pos >= offsets[:, :-1, None])
              & (pos < offsets[:, :-1, None] + seqlen[..., None]))  # [B, M, T]
    segment = jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1), -1)
    same = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0)
    return same[:, None] & causal_mask(pos, pos, None, None, window)


def cudnn_refusal(q, k, v, *, segment_ids=None, q_offset=0, bias_fn: BiasFn | None = None,
                  score_fn: ScoreFn | None = None, platform: str) -> str | None:
    """Why impl='cudnn' cannot take this call when lowered for `platform` ('cuda'; 'gpu', jax's
    backend name, counts as cuda), as one line, or None. Reads shapes and dtypes only (q, k, v
    may be ShapeDtypeStructs); segment_ids and q_offset (static or traced) are always expressible."""
    del segment_ids, q_offset  # expressed as a mask (the module doc)
    reason = _hooks_refusal("cudnn", bias_fn, score_fn)
    if reason:
        return reason
    if platform not in ("cuda", "gpu"):
        return f"impl='cudnn' runs on CUDA GPUs (cuDNN flash attention), not on platform {platform!r}; {INSTEAD}"
    reason = _dtype_refusal("cudnn", q, k, v, ("bfloat16", "float16"), "cuDNN flash attention")
    if reason:
        return reason
    d, limit = q.shape[-1], cudnn_head_dim_limit()
    wide = widened_head_dim(q, k, bias_fn, 8)
    if d % 8 or wide > limit:
        shown = f"head_dim={d}" + (f" (+ the bias channels: {wide})" if wide != d else "")
        return (f"impl='cudnn' cannot take {shown}: cuDNN needs a multiple of 8 and at most {limit} "
                f"on this GPU (256 from Hopper on); {INSTEAD}")
    row = max(math.prod(q.shape[1:]), math.prod(k.shape[1:]))
    if row >= ELEMENTS_PER_CALL:
        return (f"impl='cudnn' cannot take {row:,} elements in one row of q or k (length x heads x head_dim): "
                f"cuDNN's backward miscomputes dq and dk past 2^31 in one call; shorten the rows or {INSTEAD}")
    return None


def cudnn_call(q, k, v, *, bias: Bias | None = None, segment_ids=None, q_offset=0, scale: float | None = None,
               max_segments: int = PACKED_SEGMENTS, overflow=None, implementation: str = "cudnn",
               window: int | None = None) -> jax.Array:
    """The cuDNN call impl='cudnn' makes, with its masks, padding, packed form and bias channels
    (the module doc). max_segments=0: never the packed form. overflow(q, k, v, segment_ids=):
    the batches with a row of more runs than max_segments (default: the mask form).
    `implementation` is jax's ("cudnn", or "xla": the same masks on any platform, the packed
    form as `packed_mask`, for tests). A sliding `window` W is cuDNN's sliding window (its
    `sliding_window_length`, jax's local_window_size (W - 1, 0)) in the causal and packed
    forms, which then skip the tiles outside it; part of the mask in the mask form."""
    if bias is not None:
        d, dv = q.shape[-1], v.shape[-1]
        scale = d ** -0.5 if scale is None else scale
        q, k = key_bias_channels(q, k, bias, segment_ids=segment_ids, q_offset=q_offset, scale=scale, multiple=8)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - dv)))  # jax.nn takes one head dim
        if overflow is not None:  # it takes the inputs as they came (and the bias), gives v's width back
            def overflow(q, k, v, *, segment_ids, given=overflow):
                out = given(q[..., :d], k[..., :d], v[..., :dv], segment_ids=segment_ids)
                return jnp.pad(out, ((0, 0), (0, 0), (0, 0), (0, v.shape[-1] - dv)))
        out = cudnn_call(q, k, v, segment_ids=segment_ids, q_offset=q_offset, scale=scale,
                         max_segments=max_segments, overflow=overflow, implementation=implementation, window=window)
        return out[..., :dv]
    b, t, s = q.shape[0], q.shape[1], k.shape[1]
    rows = max(1, (ELEMENTS_PER_CALL - 1) // max(math.prod(q.shape[1:]), math.prod(k.shape[1:])))
    if b > rows:  # split along the batch, under cuDNN's element limit per call
        pieces = [cudnn_call(q[i:i + rows], k[i:i + rows], v[i:i + rows], q_offset=q_offset, scale=scale,
                             segment_ids=None if segment_ids is None else segment_ids[i:i + rows],
                             max_segments=max_segments, overflow=overflow, implementation=implementation,
                             window=window)
                  for i in range(0, b, rows)]
        return jnp.concatenate(pieces)
    square = static_int(q_offset) == 0 and t == s  # the training case: cuDNN's own causal mask
    packs = implementation == "xla" or cudnn_hopper()
    if square and segment_ids is not None and max_segments > 0 and packs:
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        if t % 2:  # cuDNN's backward takes even lengths: one more token, in the last document, dropped
            pad = ((0, 0), (0, 1), (0, 0), (0, 0))
            out = cudnn_call(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), scale=scale,
                             segment_ids=jnp.pad(segment_ids, ((0, 0), (0, 1)), mode="edge"),
                             max_segments=max_segments, overflow=overflow, implementation=implementation,
                             window=window)
            return out[:, :t]
        seqlen, offsets, fits = packed_segments(segment_ids, max_segments)

        def packed(q, k, v, _):
            if implementation == "xla":
                return jax.nn.dot_product_attention(q, k, v, mask=packed_mask(seqlen, offsets, t, window),
                                                    scale=scale, implementation="xla").astype(q.dtype)
            return fused_attention_stablehlo.dot_product_attention(
                q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets, scale=scale,
                mask_type=fused_attention_stablehlo.MaskType.PADDING_CAUSAL,
                sliding_window_length=window).astype(q.dtype)

        overflow = overflow or functools.partial(cudnn_call, scale=scale, max_segments=0,
                                                 implementation=implementation, window=window)
        return jax.lax.cond(jnp.all(fits), packed, lambda *a: overflow(*a[:3], segment_ids=a[3]),
                            q, k, v, segment_ids)
    mask = None
    if segment_ids is not None:
        mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    if not square:
        causal = causal_mask(q_offset + jnp.arange(t), jnp.arange(s), None, None, window)
        mask = causal if mask is None else mask & causal
    pt, ps = t % 2, s % 2
    if pt or ps:
        # jax lets cuDNN's backward take even lengths only: a padded query row sees every real
        # key (its output is dropped); a padded key is masked, or, in the square causal case
        # (both padded), after every real query.
        q = jnp.pad(q, ((0, 0), (0, pt), (0, 0), (0, 0)))
        k, v = (jnp.pad(x, ((0, 0), (0, ps), (0, 0), (0, 0))) for x in (k, v))
        if mask is not None:
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pt), (0, 0)), constant_values=True)
            mask = jnp.pad(mask, ((0, 0), (0, 0), (0, 0), (0, ps)), constant_values=False)
    local = (window - 1, 0) if square and window is not None else None
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=square, local_window_size=local,
                                       implementation=implementation)
    return out[:, :t].astype(q.dtype)


def cudnn_attention(q, k, v, *, bias_fn: BiasFn | None = None, segment_ids=None, q_offset=0,
                    scale: float | None = None, score_fn: ScoreFn | None = None,
                    block_size: int | None = None, max_segments: int = PACKED_SEGMENTS,
                    window: int | None = None) -> jax.Array:
    """Causal softmax attention by cuDNN flash attention (the module doc); block_size is ignored."""
    del block_size
    window = check_window(window)
    check_shapes(q, k, v, segment_ids)
    reason = cudnn_refusal(q, k, v, segment_ids=segment_ids, q_offset=q_offset, bias_fn=bias_fn,
                           score_fn=score_fn, platform="cuda")
    if reason:
        raise ValueError(reason)

    def settings(backend, interpret):
        reason = cudnn_refusal(q, k, v, platform=_PLATFORM[backend])
        if reason:
            raise ValueError(reason)

    offset = None if static_int(q_offset) is not None else jnp.asarray(q_offset)
    args = tuple(x for x in (q, k, v, segment_ids, offset) if x is not None)

    def run(_, q, k, v, *rest):
        rest = list(rest)
        seg = rest.pop(0) if segment_ids is not None else None
        off = rest.pop(0) if offset is not None else q_offset
        return cudnn_call(q, k, v, bias=bias_fn, segment_ids=seg, q_offset=off, scale=scale,
                          max_segments=max_segments, window=window)

    try:
        return per_platform(settings, run, args, interpret=False)
    except NotImplementedError as error:  # jax's own check of cuDNN's limits on this GPU
        raise ValueError(f"impl='cudnn' cannot take this call on this GPU: {_one_line(error)}; "
                         f"{INSTEAD}") from error
    except RuntimeError as error:  # jax found no cuDNN library when tracing the call
        raise ValueError(f"impl='cudnn' needs cuDNN, which this JAX cannot use here "
                         f"({_one_line(error)}): run on a CUDA GPU with jax[cuda12], or {INSTEAD}") from error


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split())


# ---- splash (TPU) --------------------------------------------------------------------------

LANES = 128  # splash tiles are multiples of this


def splash_tiling(length: int, block_size: int | None) -> tuple[int, int]:
    """(padded length, tile): the length rounded up to a multiple of 128, and the largest
    128 * 2^i <= max(block_size, 128) dividing it (block_size None: 512)."""
    padded = -(-length // LANES) * LANES
    cap = max(512 if block_size is None else block_size, LANES)
    tile = LANES
    while tile * 2 <= cap and padded % (tile * 2) == 0:
        tile *= 2
    return padded, tile


def splash_refusal(q, k, v, *, segment_ids=None, q_offset=0, bias_fn: BiasFn | None = None,
                   score_fn: ScoreFn | None = None, platform: str, interpret: bool = False) -> str | None:
    """Why impl='splash' cannot take this call when lowered for `platform` ('tpu'), as one line,
    or None. interpret=True: the Pallas interpreter, any platform and head_dim. Reads shapes and
    dtypes only (q, k, v may be ShapeDtypeStructs); any length is padded to whole tiles."""
    del segment_ids  # the kernel's SegmentIds
    reason = _hooks_refusal("splash", bias_fn, score_fn)
    if reason:
        return reason
    if not interpret and platform != "tpu":
        return (f"impl='splash' runs on TPU (a Pallas Mosaic kernel), not on platform {platform!r}; "
                f"{INSTEAD}")
    offset = static_int(q_offset)
    if offset != 0:
        shown = "a traced value" if offset is None else offset
        return (f"impl='splash' cannot take q_offset={shown}: it attends a whole sequence to itself "
                f"(training), not a decoding step; {INSTEAD}")
    if q.shape[1] != k.shape[1]:
        return (f"impl='splash' cannot take q length {q.shape[1]} with key length {k.shape[1]}: it attends "
                f"a whole sequence to itself; {INSTEAD}")
    reason = _dtype_refusal("splash", q, k, v, ("bfloat16", "float32"), "splash attention")
    if reason:
        return reason
    d = q.shape[-1]
    if not interpret and d % 64:
        return (f"impl='splash' cannot take head_dim={d}: splash attention on TPU takes multiples of 64 "
                f"(64, 128, 192, 256 tested by jax); {INSTEAD}")
    return None


def _splash_kernel(heads: int, length: int, tile: int, interpret: bool, window: int | None = None):
    # Built per call: it holds its mask tables as jax arrays (traced under jit); the tables'
    # numpy computation is cached by jax. The backward is splash's two kernels (dq; dk, dv):
    # its fused one writes a partial dq per key tile, [T / tile] x the size of dq, which grows
    # as T^2. A sliding window is splash's local mask (W - 1 keys left, none right: causal),
    # whose tables list only the tiles inside it.
    one = (splash.CausalMask((length, length)) if window is None
           else splash.LocalMask((length, length), window_size=(window - 1, 0), offset=0))
    mask = splash.MultiHeadMask([one] * heads)
    tiles = splash.BlockSizes(block_q=tile, block_kv=tile, block_kv_compute=tile, block_q_dkv=tile,
                              block_kv_dkv=tile, block_kv_dkv_compute=tile, block_q_dq=tile, block_kv_dq=tile,
                              use_fused_bwd_kernel=False)
    return splash.make_splash_mha(mask, block_sizes=tiles, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_call(q, k, v, *, bias: Bias | None = None, segment_ids=None, scale: float | None = None,
                block_size: int | None = 512, interpret: bool = False, window: int | None = None) -> jax.Array:
    """The splash kernel on q [B, T, H, D], k, v [B, T, K, D] (the module doc: padding, tiles,
    bias channels, added after q is scaled: their ones stay exact)."""
    b, t, h, d = q.shape
    length, tile = splash_tiling(t, block_size)
    scale = d ** -0.5 if scale is None else scale
    q = (q.astype(jnp.float32) * scale).astype(q.dtype)
    if bias is not None:
        q, k = key_bias_channels(q, k, bias, segment_ids=segment_ids, scale=1.0, multiple=64)

    def heads_first(x):  # [B, T, N, D] -> [B, N, length, D]
        return jnp.pad(x, ((0, 0), (0, length - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    kernel = _splash_kernel(h, length, tile, interpret, window)
    qh, kh, vh = heads_first(q), heads_first(k), heads_first(v)
    if segment_ids is None:
        out = jax.vmap(kernel)(qh, kh, vh)
    else:
        seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, length - t)))
        out = jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=splash.SegmentIds(s, s)))(qh, kh, vh, seg)
    return out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)


def splash_attention(q, k, v, *, bias_fn: BiasFn | None = None, segment_ids=None, q_offset=0,
                     scale: float | None = None, score_fn: ScoreFn | None = None,
                     block_size: int | None = 512, interpret: bool = False, window: int | None = None) -> jax.Array:
    """Causal softmax attention by TPU splash attention (the module doc); block_size caps the tile."""
    check_shapes(q, k, v, segment_ids)
    window = check_window(window)
    reason = splash_refusal(q, k, v, segment_ids=segment_ids, q_offset=q_offset, bias_fn=bias_fn,
                            score_fn=score_fn, platform="tpu", interpret=interpret)
    if reason:
        raise ValueError(reason)

    def settings(backend, interp):
        reason = splash_refusal(q, k, v, platform=_PLATFORM[backend], interpret=interp)
        if reason:
            raise ValueError(reason)
        return interp

    args = (q, k, v) if segment_ids is None else (q, k, v, segment_ids)

    def run(interp, q, k, v, seg=None):
        return splash_call(q, k, v, bias=bias_fn, segment_ids=seg, scale=scale, block_size=block_size,
                           interpret=interp, window=window)

    return per_platform(settings, run, args, interpret=True if interpret else False)
