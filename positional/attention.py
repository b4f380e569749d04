"""The attention dispatcher: one call, an implementation chosen by name.

    attention(q, k, v, impl="blockwise", bias_fn=..., segment_ids=...)

Implementations (same arguments, same semantics; see positional/softmax.py for the shapes and
the bias and score hooks):
  "reference"  materialises the [B, H, T, S] scores (positional/softmax.py);
  "blockwise"  online softmax over key blocks, O(T * block) memory (positional/softmax.py);
  "ring"       the sequence split over the `sequence` axis of the enclosing `ring_mesh`, keys
               and values passed around the ring (positional/ring.py); blockwise elsewhere;
  "cudnn"      cuDNN flash attention through jax.nn.dot_product_attention, CUDA GPUs, bf16/fp16,
               no bias_fn or score_fn (positional/vendor.py);
  "splash"     TPU splash attention (Pallas), training shapes (q_offset 0, T == S), no bias_fn or
               score_fn (positional/vendor.py).

This module sits above every implementation it names, so none of them imports it.
"""

from __future__ import annotations

import jax

from positional.ring import mesh_ring_attention
from positional.softmax import blockwise_attention, reference_attention
from positional.vendor import cudnn_attention, splash_attention

IMPLEMENTATIONS = {"reference": reference_attention, "blockwise": blockwise_attention,
                   "ring": mesh_ring_attention, "cudnn": cudnn_attention, "splash": splash_attention}


def attention(q, k, v, *, impl: str = "reference", **kwargs) -> jax.Array:
    """Dispatch to an implementation by name (a key of IMPLEMENTATIONS)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; valid: {sorted(IMPLEMENTATIONS)}")
    if impl == "reference":
        kwargs.pop("block_size", None)
    return IMPLEMENTATIONS[impl](q, k, v, **kwargs)
