"""LM-Infinite (Han et al. 2024, "LM-Infinite: Zero-Shot Extreme Length Generalization for Large
Language Models"): RoPE under a Lambda-shaped mask with a distance ceiling, for a RoPE-trained
model read zero-shot past its training length. No parameters of its own.

With window W (the pretraining length L) and G global tokens, query i sees key j iff

    p_j < G  (one of the document's first G tokens: the "starting tokens")  or  i - j < W

(and j <= i in the same document), and scores it as RoPE does at the distance min(i - j, W):
keys within the window at their own distance, the starting tokens beyond it at distance W.
The starting tokens, as queries, are ordinary ones (they see what precedes them). This is the
authors' code (`lambda_attention.py`: local branch W, global branch G, distance limit W).
Within W tokens nothing is masked or capped, so a window >= the sequence length is RoPE.

Parts: `transform` is RoPE's (q, k rotated by their positions); the mask is a `Bias` reading the
positions (0 or MASKED), so a document's first G tokens are its starting tokens wherever it
sits in a packed row; the ceiling is the score, `q . k` of the rotated pair within the window
and (R((W - i) theta) q) . (R(-j theta) k) past it, with i, j the attention indices, which
differ from the positions by a per-segment constant: that is q . R(-W theta) k of the
unrotated pair, RoPE's logit at distance W. Reference, blockwise and ring attention evaluate it
block by block; the fused kernel takes no such score (`impls`). The decode cache is RoPE's
(every rotated key and value, O(max_len)) plus the positions the mask reads; it does not drop
the keys between the starting tokens and the window, as the authors' decoding does.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from positional.logits import Bias
from positional.rope import Rope, rope_angles, rotate
from positional.scheme import position_values
from positional.softmax import MASKED, matmul


@dataclasses.dataclass(frozen=True)
class LMInfinite(Rope):
    # The pretraining length L. In a run, unless its config sets it, the run's training length
    # (config.seq_len: `train_len_options`); 512 (RoPE's original_max_len) outside any run.
    window: int = 512
    global_tokens: int = 10  # n_global: the authors' drop-in conversion uses 10 (their README: 10-100 alike)

    has_bias = has_score = True
    relative = False  # the starting tokens are absolute positions: relative only within a document
    impls = ("auto", "reference", "blockwise", "ring")
    train_len_options = ("window",)

    def __post_init__(self):
        super().__post_init__()
        if self.window < 1:
            raise ValueError(f"rope_lm_infinite window={self.window} must be >= 1: the pretraining length, "
                             "the farthest distance a key is scored at")
        if self.global_tokens < 0:
            raise ValueError(f"rope_lm_infinite global_tokens={self.global_tokens} must be >= 0: the starting "
                             "tokens every query sees")
        if self.rotary_dim:
            raise ValueError("rope_lm_infinite rotates every dimension of a head: leave rotary_dim 0")
        if self.scaling == "dynamic":
            raise ValueError("rope_lm_infinite caps distances at the window, and scaling='dynamic' changes the "
                             "frequencies with the sequence length; use scaling none, pi, ntk, yarn or llama3")

    def bias_fn(self, features, positions):
        window, starting = self.window, self.global_tokens

        def bias(q, k, qi, kj):
            query, key = q.get("position", qi), k.get("position", kj)
            return jnp.where((key < starting) | (query - key < window), 0.0, MASKED)

        return Bias(bias, position_values(positions))

    def score_fn(self, features):
        window, scale, layout = self.window, self.head_dim ** -0.5, self.layout
        theta = self.theta

        def score(qb, kb, qi, kj):  # qb [B, tq, K, G, D], kb [B, tk, K, D], rotated by their positions
            dtype = jnp.promote_types(qb.dtype, kb.dtype)
            near = matmul("btkgd,bskd->bkgts", qb, kb, dtype) * scale  # RoPE's logit, as block_scores has it
            q_far = rotate(qb, rope_angles(window - qi, theta)[:, None], layout)  # angles [tq, 1, 1, D/2]
            k_far = rotate(kb, rope_angles(-kj, theta), layout)  # [tk, 1, D/2]
            far = matmul("btkgd,bskd->bkgts", q_far, k_far, dtype) * scale
            return jnp.where(qi[:, None] - kj[None, :] < window, near, far)

        return score
