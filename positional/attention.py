"""The attention dispatcher: one call, an implementation chosen by name.

    attention(q, k, v, impl="auto", bias_fn=..., segment_ids=..., window=...)

Implementations (same arguments, same semantics; see positional/softmax.py for the shapes and
the bias and score hooks, and the sliding `window`, which every implementation takes and
skips the work outside of: blocks, tiles, shards; a `sink` [H], gpt-oss's logit per head in
every row's normaliser, reference, blockwise and pallas take, the others refuse in one line;
a chunked window, `Chunk(C)` (Llama 4's chunked local attention), reference and blockwise take,
and auto runs them by length on every platform):
  "reference"  materialises the [B, H, T, S] scores (positional/softmax.py);
  "blockwise"  online softmax over key blocks, O(T * block) memory (positional/softmax.py);
  "ring"       the sequence split over the `sequence` axis of the enclosing `ring_mesh`, keys
               and values passed around the ring (positional/ring.py); blockwise elsewhere;
  "pallas"     the fused flash-attention kernel (positional/kernels/flash.py): any `Bias` and
               `Score` hook (positional/logits.py) fused into its tiles;
  "cudnn"      cuDNN flash attention, CUDA GPUs, bf16/fp16, no score_fn, a bias_fn only per key
               (FoX, ALiBi: through q.k channels) (positional/vendor.py);
  "splash"     TPU splash attention (Pallas), training shapes (q_offset 0, T == S), no score_fn, a
               bias_fn only per key (positional/vendor.py);
  "auto"       the fastest of them that can take the call, for the platform being lowered for
               (`choose`): ring on a sequence mesh; on CPU reference up to REFERENCE_MAX keys,
               blockwise past it; on GPU cuDNN for plain softmax and fixed per-key biases
               (ALiBi; packed rows in its packed form, Hopper on), on TPU splash, else the fused
               kernel (learned per-key biases, FoX: `FACTS["channel_gradient"]`), else
               blockwise. Each choice is logged once (logger "positional.attention");
               `per_platform_choice` does the same for a scheme with its own attention (PaTH,
               whose kernel `choose` weighs as an `OwnKernel`). `choose` is the one place auto
               is decided, and FACTS the one place for the measurements it relies on.

This module sits above every implementation it names, so none of them imports it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from positional.kernels.flash import fused_attention
from positional.kernels.flash import refusal as fused_refusal
from positional.logits import Bias
from positional.ring import dividing, enclosing_mesh, mesh_ring_attention, ring_active
from positional.softmax import Chunk, blockwise_attention, check_window, reference_attention
from positional.vendor import (CHANNEL_BOUND, PACKED_SEGMENTS, cudnn_attention, cudnn_call, cudnn_hopper, cudnn_present, static_int,
                               cudnn_refusal, splash_attention, splash_call, splash_refusal, widened_head_dim)

IMPLEMENTATIONS = {"reference": reference_attention, "blockwise": blockwise_attention,
                   "ring": mesh_ring_attention, "pallas": fused_attention, "cudnn": cudnn_attention,
                   "splash": splash_attention}
SINKS = ("reference", "blockwise", "pallas")  # the implementations that take sink logits
CHUNKED = ("reference", "blockwise")  # ... and a chunked window
REFERENCE_MAX = 2048  # "auto" on CPU: reference attention up to this many keys, blockwise past it
LOG = logging.getLogger("positional.attention")
_LOGGED: set = set()


@dataclasses.dataclass(frozen=True)
class Fact:
    """A measurement auto relies on: what, on which device, when, and where it is written up."""
    what: str
    device: str
    date: str
    source: str

    def __str__(self) -> str:
        return f"{self.what} ({self.device}, {self.date})"


# Every measured fact behind a choice, once; docs and log lines cite them from here.
FACTS = {
    "path_kernel_gpu": Fact("its forward + backward took 5.5x (head dim 64) and 7.8x (128) the time of the "
                            "chunked form at 8,192 tokens", "NVIDIA H100", "2026-11-24",
                            "benchmarks/RESULTS.md, PaTH on an NVIDIA H100"),
    "channel_gradient": Fact("a learned per-key bias's gradient through the q.k channels (cuDNN's bf16 dS and dk) "
                             "was 18-31x the bf16 reference's error (FoX's gates: 8.7e-2 and 5.1e-2 against 2.8e-3)",
                             "NVIDIA H200", "2026-11-28",
                             "benchmarks/RESULTS.md, The GPU check and PaTH against fla on an NVIDIA H200"),
}


@dataclasses.dataclass(frozen=True)
class OwnKernel:
    """A scheme's own fused kernel (PaTH's), for `choose`: refusal(platform) says why it cannot
    take the call lowered for a platform (or None); `slower` names, per platform, the FACTS
    entry that keeps auto off it there."""
    name: str
    refusal: Callable[[str], str | None]
    slower: dict = dataclasses.field(default_factory=dict)


def by_length(keys: int) -> tuple[str, str]:
    """(impl, why) where no kernel is chosen (a CPU; a scheme without one): the reference up to
    REFERENCE_MAX keys, blockwise past it."""
    if keys <= REFERENCE_MAX:
        return "reference", f"{keys} keys <= {REFERENCE_MAX}: the T x S scores are small"
    return "blockwise", f"{keys} keys > {REFERENCE_MAX}: memory bounded by the block"


def choose(q, k, v, *, platform: str, bias_fn=None, score_fn=None, segment_ids=None, q_offset=0,
           own: OwnKernel | None = None, sink=None) -> tuple[str, str]:
    """(impl, why): what impl="auto" runs for this call lowered for `platform` ("cpu", "cuda",
    "tpu"), off a sequence mesh; `own`: the scheme brings its own kernel (else the vendor
    kernels and the fused hook kernel are considered). Reads shapes, dtypes and the hooks'
    kinds only. The one place auto is decided."""
    if platform == "cpu":
        impl, why = by_length(k.shape[1])
        return impl, f"CPU, {why}"
    if own is not None:
        if platform in own.slower:
            return "blockwise", f"not {own.name}: {FACTS[own.slower[platform]]}"
        why_not = own.refusal(platform)
        return ("pallas", own.name) if why_not is None else ("blockwise", f"not {own.name}: {why_not}")
    hooks = dict(segment_ids=segment_ids, q_offset=q_offset, bias_fn=bias_fn, score_fn=score_fn)
    why = "plain softmax"
    if platform == "cuda":
        vendor, why_not = "cudnn", cudnn_refusal(q, k, v, platform=platform, **hooks)
        if why_not is None and segment_ids is not None:
            if not (static_int(q_offset) == 0 and q.shape[1] == k.shape[1]):
                why_not = "packed rows (segment ids) while decoding would reach cuDNN as a T x S mask"
            elif not cudnn_hopper():
                why_not = "packed rows need cuDNN's packed form (Hopper or later); its mask form costs T x S"
            else:
                why = (f"plain softmax, packed rows as cuDNN segments (a batch with a row of more than "
                       f"{PACKED_SEGMENTS} documents: the fused kernel)")
        if why_not is None and not cudnn_present():
            why_not = "this JAX has no cuDNN"
    else:
        vendor, why_not = "splash", splash_refusal(q, k, v, platform=platform, **hooks)
    if why_not is None and sink is not None:
        why_not = f"{vendor} takes no sink logit"
    bound = getattr(bias_fn, "key_bound", None) and bias_fn.key_bound(k.shape[1])
    if why_not is None and bound and bound > CHANNEL_BOUND:
        why_not = (f"its per-key bias reaches {bound:,.0f} at {k.shape[1]} keys, past {CHANNEL_BOUND:,.0f}, where "
                   f"q.k channels round it more than the kernel's own bias")
    if why_not is None and getattr(bias_fn, "learned", False):
        why_not = f"its per-key bias is learned: {FACTS['channel_gradient']}"
    if why_not is None and bias_fn is not None:
        wide = widened_head_dim(q, k, bias_fn, 8 if vendor == "cudnn" else 64)
        why = f"{why}, the per-key bias in q.k channels (head dim {q.shape[-1]} -> {wide})"
    if why_not is None:
        return vendor, why
    why_not = why_not.split("; use impl=")[0]
    not_fused = fused_refusal(bias_fn, score_fn, q_offset)
    if not_fused is None:
        return "pallas", f"the fused kernel; not {vendor}: {why_not}"
    return "blockwise", f"no fused path: {not_fused}"


def auto_attention(q, k, v, *, label: str = "", bias_fn=None, score_fn=None, segment_ids=None, q_offset=0,
                   scale=None, block_size: int = 512, window: int | None = None, sink=None) -> jax.Array:
    """Impl "auto": per platform of the lowering (`jax.lax.platform_dependent`), `choose`'s pick."""
    window = check_window(window)
    kwargs = dict(bias_fn=bias_fn, score_fn=score_fn, segment_ids=segment_ids, q_offset=q_offset, scale=scale,
                  window=window, **({} if sink is None else {"sink": sink}))
    if isinstance(window, Chunk):  # no fused form takes it yet: the same program on every platform
        if ring_active():
            raise ValueError("chunked local attention on a sequence mesh: the ring takes no chunks yet; split the "
                             "mesh by data, fsdp or tensor instead (mesh.sequence=1)")
        impl, why = by_length(k.shape[1])
        for platform in ("cpu", "cuda", "tpu"):
            log_choice(platform, impl, f"chunked local attention (reference and blockwise only), {why}", label)
        return attention(q, k, v, impl=impl, block_size=block_size, **kwargs)
    if ring_active():
        if sink is not None:
            raise ValueError("sink logits on a sequence mesh: the ring takes none yet; split the mesh by data, fsdp "
                             "or tensor instead (mesh.sequence=1), or leave the sinks out")
        log_ring(label)
        return mesh_ring_attention(q, k, v, block_size=block_size, **kwargs)

    def pick(platform):
        impl, why = choose(q, k, v, platform=platform, bias_fn=bias_fn, score_fn=score_fn,
                           segment_ids=segment_ids, q_offset=q_offset, sink=sink)
        if impl == "cudnn":
            def kernel(q, k, v, bias, seg):
                fused = functools.partial(fused_attention, platform=platform, q_offset=q_offset, scale=scale,
                                          bias_fn=bias, window=window)
                return cudnn_call(q, k, v, bias=bias, segment_ids=seg, q_offset=q_offset, scale=scale,
                                  overflow=fused, window=window)
        elif impl == "splash":
            def kernel(q, k, v, bias, seg):
                return splash_call(q, k, v, bias=bias, segment_ids=seg, scale=scale, block_size=block_size,
                                   window=window)
        elif impl == "pallas":
            def kernel(q, k, v, bias, seg):
                return fused_attention(q, k, v, platform=platform, bias_fn=bias, score_fn=score_fn,
                                       segment_ids=seg, q_offset=q_offset, scale=scale, window=window, sink=sink)
        else:
            return impl, why, lambda q, k, v: attention(q, k, v, impl=impl, block_size=block_size, **kwargs)
        return impl, why, lambda q, k, v: per_device(kernel, q, k, v, bias_fn=bias_fn, segment_ids=segment_ids)

    return per_platform_choice(pick, q, k, v, label=label)


def per_device(kernel, q, k, v, *extra, bias_fn=None, segment_ids=None) -> jax.Array:
    """kernel(q, k, v, *extra, bias_fn, segment_ids) on each device's shard of the enclosing mesh
    (a shard_map over the batch axes and the heads axis that divide the call: XLA cannot
    partition a Pallas or Mosaic kernel); a `Bias`'s values and the `extra` per-token arrays
    ([B, T, K, ...]: PaTH's directions and gains) go in split the same way. On one device, or
    off a mesh, the kernel itself."""
    mesh = enclosing_mesh()
    if mesh is None or mesh.size == 1:
        return kernel(q, k, v, *extra, bias_fn, segment_ids)
    b, h = q.shape[0], q.shape[2]
    batch = dividing(mesh, ("data", "fsdp"), b) or None
    heads = dividing(mesh, ("tensor",), h, k.shape[2]) or None
    values, tables = (bias_fn.values, bias_fn.tables) if isinstance(bias_fn, Bias) else ({}, {})
    value_specs = {n: P(batch if x.shape[0] == b else None, None, heads if x.shape[2] == h else None)
                   for n, x in values.items()}
    table_specs = {n: P(batch if x.shape[0] == b else None, heads if x.shape[1] == h else None, None)
                   for n, x in tables.items()}
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids

    def local(q, k, v, seg, values, tables, *extra):
        bias = dataclasses.replace(bias_fn, values=values, tables=tables) if isinstance(bias_fn, Bias) else bias_fn
        return kernel(q, k, v, *extra, bias, None if segment_ids is None else seg)

    spec = P(batch, None, heads, None)
    extra_specs = tuple(P(batch, None, heads, *[None] * (x.ndim - 3)) for x in extra)
    in_specs = (spec, spec, spec, P(batch, None), value_specs, table_specs, *extra_specs)
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=spec,
                         check_vma=False)(q, k, v, seg, values, tables, *extra)


def per_platform_choice(pick, *args, label: str = ""):
    """fn(*args) for the platform being lowered for (`jax.lax.platform_dependent`), with
    (impl, why, fn) = pick(platform) for "cpu", "cuda" and "tpu"; each choice is logged (DEBUG on
    every trace, INFO once per line). Auto for a scheme that brings its own attention (PaTH)."""
    def branch(platform):
        impl, why, fn = pick(platform)
        log_choice(platform, impl, why, label)
        return fn

    return jax.lax.platform_dependent(*args, cpu=branch("cpu"), cuda=branch("cuda"), tpu=branch("tpu"))


def log_choice(platform: str, impl: str, why: str, label: str = "") -> None:
    """What auto picked for one call site on `platform`: DEBUG on every trace (benchmarks/lowering.py
    collects these), INFO once per line."""
    line = f"attention impl auto{f' ({label})' if label else ''} on {platform}: {impl}, {why}"
    LOG.debug(line, extra={"platform": platform, "impl": impl, "why": why, "label": label})
    if line not in _LOGGED:
        _LOGGED.add(line)
        LOG.info(line)


def log_ring(label: str = "") -> None:
    """Auto on a sequence mesh is the ring on every platform (no `platform_dependent`: one program)."""
    for platform in ("cpu", "cuda", "tpu"):
        log_choice(platform, "ring", "the sequence axis of the mesh splits the keys", label)


def attention(q, k, v, *, impl: str = "reference", **kwargs) -> jax.Array:
    """Dispatch to an implementation by name ("auto" or a key of IMPLEMENTATIONS)."""
    if impl == "auto":
        return auto_attention(q, k, v, **kwargs)
    kwargs.pop("label", None)
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; valid: auto, {', '.join(sorted(IMPLEMENTATIONS))}")
    if kwargs.get("sink") is not None and impl not in SINKS:
        raise ValueError(f"impl {impl!r} takes no sink logits; use one of {', '.join(SINKS)} (or auto)")
    if isinstance(kwargs.get("window"), Chunk) and impl not in CHUNKED:
        raise ValueError(f"impl {impl!r} takes no chunked window; use one of {', '.join(CHUNKED)} (or auto)")
    kwargs = {name: x for name, x in kwargs.items() if not (name == "sink" and x is None)}
    if impl == "reference":
        kwargs.pop("block_size", None)
    return IMPLEMENTATIONS[impl](q, k, v, **kwargs)
