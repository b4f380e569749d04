"""FoX, the Forgetting Transformer's forget gate (Lin et al. 2025), as a score bias.

Each token t and query head h emits a forget gate f_t in (0, 1), from the hidden state; the
logit of query i on key j gains sum_{t=j+1}^{i} log f_t = F_i - F_j (F the cumulative sum of
log f): a data-dependent, never positive, monotone-in-distance decay. The same route convention
as PaTH (positional/path/): the query's own gate counts, the key's does not. With
every f_t = exp(-m_h) it is exactly ALiBi with slopes m_h (a test).

Like every bias-only scheme it can be added to any other ("so2_learned_qkv+fox"); `path_fox`
is PaTH with it. Cross-document pairs are masked, so F need not restart at document starts.
The decode cache keeps log f of every cached token (`feature_cache`), so F_i - F_j of a step
is computed from the same numbers as in the parallel form.

Two scales for the gate term. FoX (Lin et al.) adds F_i - F_j to the already scaled logit,
q.k / sqrt(D) + F_i - F_j: the default, and what `fox` and `scheme+fox` compute. The PaTH
authors' PaTH-FoX scales it with the dots, (q^T P k + F_i - F_j) / sqrt(D), in their reference,
kernels and decoding; `path_fox` does the same (`logit_scale=True`, fixed by its registry
entry). With the gate bias at 0 the initial per-token log-decay is then log(1/2) / sqrt(D)
(-0.12 at D = 32) instead of log(1/2) = -0.69; `path+fox` keeps the FoX scale.

features = {'log_forget': [B, T, H] float32}: log f_t = log sigmoid(W_f x_t + b_f), one gate per
query head; b_f starts at the `gate_bias` option: 0 by default, as in the public FoX layer (f near
1/2: the model starts local and learns how far each head should remember); b_f = 5 starts at
f = 0.993, a memory of about 150 tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from positional.logits import Bias
from positional.scheme import Scheme, dense, linear_parameters


def forget_bias(log_forget, scale: float = 1.0) -> Bias:
    """The Bias scale * (F_i - F_j) (F the cumulative sum of log f over slots), fp32."""
    cum = scale * jnp.cumsum(log_forget.astype(jnp.float32), axis=1)  # scale * F [B, T, H]
    return Bias(lambda q, k, qi, kj: q["F"] - k["F"], {"F": cum}, key=lambda k, kj: -k["F"], learned=True)


@dataclasses.dataclass(frozen=True)
class Fox(Scheme):
    gate_bias: float = 0.0  # initial b_f of the gates: 0 gives f near 1/2
    logit_scale: bool = False  # gate term times head_dim^-1/2, like the dots (PaTH authors' PaTH-FoX)

    has_bias = bias_only = needs_features = True

    def bias_fn(self, features, positions):  # the gates between key and query: by slot, not position
        return forget_bias(features["log_forget"], self.head_dim ** -0.5 if self.logit_scale else 1.0)

    def init_parameters(self, keys, model):
        return {"proj": linear_parameters(keys, model.d_model, self.num_heads, model.d_model ** -0.5, self.gate_bias)}

    def features(self, params, x, *, tokens, index, segment_ids=None, rng=None, past=None):
        return {"log_forget": jax.nn.log_sigmoid(dense(x.astype(jnp.float32), params["proj"]))}

    def default_features(self, q, k, *, positions, key=None, segment_ids=None):
        """Every gate at its initial bias: log f = log sigmoid(gate_bias) (ALiBi-like decay)."""
        b, t, h, _ = q.shape
        return {"log_forget": jnp.full((b, t, h), jax.nn.log_sigmoid(self.gate_bias), jnp.float32)}

    def feature_cache(self, batch, max_len):
        return {"log_forget": jnp.zeros((batch, max_len, self.num_heads), jnp.float32)}
