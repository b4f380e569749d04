"""The attention dispatcher: one call, an implementation chosen by name.

    attention(q, k, v, impl="blockwise", bias_fn=..., segment_ids=...)

Implementations (same arguments, same semantics; see positional/softmax.py for the shapes and
the bias and score hooks):
  "reference"  materialises the [B, H, T, S] scores (positional/softmax.py);
  "blockwise"  online softmax over key blocks, O(T * block) memory (positional/softmax.py);
  "ring"       the sequence split over the `sequence` axis of the enclosing `ring_mesh`, keys
               and values passed around the ring (positional/ring.py); blockwise elsewhere;
  "pallas"     the fused flash-attention kernel (positional/kernels/flash.py): any `Bias` and
               `Score` hook (positional/logits.py) fused into its tiles.

This module sits above every implementation it names, so none of them imports it.
"""

from __future__ import annotations

import jax

from positional.kernels.flash import fused_attention
from positional.ring import mesh_ring_attention
from positional.softmax import blockwise_attention, reference_attention

IMPLEMENTATIONS = {"reference": reference_attention, "blockwise": blockwise_attention,
                   "ring": mesh_ring_attention, "pallas": fused_attention}


def attention(q, k, v, *, impl: str = "reference", **kwargs) -> jax.Array:
    """Dispatch to an implementation by name (a key of IMPLEMENTATIONS)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention impl {impl!r}; valid: {sorted(IMPLEMENTATIONS)}")
    if impl == "reference":
        kwargs.pop("block_size", None)
    return IMPLEMENTATIONS[impl](q, k, v, **kwargs)
