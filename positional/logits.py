"""Logit hooks in a form every attention implementation evaluates, the fused kernel included.

A scheme that changes the logit says how from a few numbers per token, never from a T x T array:

  Bias(fn, values)   an additive bias b_ij = fn(q, k, qi, kj). `values` maps names to arrays of
                     one number per key slot and head, [B or 1, S or 1, H or 1] (positions, FoX's
                     cumulative log gates, per-head slopes as [1, 1, H]); fn reads them at the
                     query slot, q[name] [..., tq, 1], and at the key slot, k[name] [..., 1, tk];
                     qi [tq, 1] and kj [1, tk] are the slot indices themselves. `key`, where
                     given, says the bias is per key: b_ij = c_i + key(k, kj) (FoX, ALiBi).
                     `tables` maps names to per-head tables [B or 1, H or 1, n] (T5's bucketed
                     bias): fn reads one as `lookup(q[name], index)`, the entries at integer
                     indices [..., tq, tk] (a learned distance table read at the pair's bucket).
  Score(split, fn)   a logit that replaces scale * q.k (TAPA): split(q, k) -> (q_parts, k_parts)
                     cuts the head vectors into parts (whole arrays, [B, T, H, d_i] and
                     [B, S, K, d_i]); fn(dots, qi, kj) combines the tiles dots[i] = q_part_i .
                     k_part_i (fp32) into the logit.

fn uses elementwise operations, broadcasting and `lookup` only (it runs on [B, H, tq, tk]
blocks in the plain-JAX paths and on [tq, tk] tiles inside the Pallas kernel,
positional/kernels/flash.py, which differentiates it there), and stays finite on masked pairs (keys after the query), whose
logits are discarded. Both are callables with the contracts of positional/softmax.py (BiasFn
(qi, kj) and ScoreFn (qb, kb, qi, kj)), so the reference, blockwise and ring paths take them as
they take any bias or score function; the fused kernel takes only these two forms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp


def slot_values(x, idx):
    """x [B|1, S|1, H|1] read at slots idx [n] -> [B|1, H|1, n] (an axis of size 1 stays 1;
    padded blocks past the end clip)."""
    x = jnp.asarray(x, jnp.float32)
    if x.shape[1] != 1:
        x = jnp.take(x, idx, axis=1, mode="clip")
    return jnp.swapaxes(x, 1, 2)


@dataclasses.dataclass(frozen=True, eq=False)
class Bias:
    fn: Callable
    values: dict = dataclasses.field(default_factory=dict)
    # Per-key (separable): fn(q, k, qi, kj) = (a term of the query alone) + key(k, kj), k[name]
    # [B|1, H|1, S] and kj [S]. In a causal softmax row the query's term cancels, so the bias is
    # one number per key and head, which plain kernels take through q.k (positional/vendor.py).
    key: Callable | None = None
    # A per-key bias's largest |key term| over `length` key slots, where known without the data
    # (ALiBi: its steepest slope x (length - 1)); None where the data decide it (FoX).
    key_bound: Callable[[int], float] | None = None
    # Per-head tables [B|1, H|1, n] fn reads with `lookup`, as q[name] (not per slot: no key form).
    tables: dict = dataclasses.field(default_factory=dict)
    # Whether the values are learned (FoX's gates), so their gradient matters: auto keeps such a
    # bias off the vendor kernels' q.k channels, which carry its gradient in bf16 (positional/vendor.py).
    learned: bool = False

    def __post_init__(self):
        for name, x in self.values.items():
            if jnp.ndim(x) != 3:
                raise ValueError(f"bias value {name!r} must be [B or 1, S or 1, H or 1] (one number per "
                                 f"slot and head); got shape {tuple(jnp.shape(x))}")
        for name, x in self.tables.items():
            if jnp.ndim(x) != 3 or name in self.values:
                raise ValueError(f"bias table {name!r} must be [B or 1, H or 1, n] (n entries per head) with a "
                                 f"name no value has; got shape {tuple(jnp.shape(x))}")
        if self.tables and self.key is not None:
            raise ValueError("a Bias with tables has no per-key form (key): a table entry depends on the pair")

    def __call__(self, qi, kj):
        """The bias of query slots qi [tq] against key slots kj [tk]: [B|1, H|1, tq, tk] fp32."""
        q = {n: slot_values(x, qi)[..., None] for n, x in self.values.items()}
        q.update({n: jnp.asarray(x, jnp.float32)[:, :, None, :] for n, x in self.tables.items()})
        k = {n: slot_values(x, kj)[..., None, :] for n, x in self.values.items()}
        out = jnp.asarray(self.fn(q, k, qi[:, None], kj[None, :]), jnp.float32)
        return out.reshape((1,) * (4 - out.ndim) + out.shape)

    def per_slot(self, b: int, s: int, h: int) -> dict:
        """The values broadcast to [B, S, H] fp32, one number per key slot and query head, as the
        Pallas kernels read them; a value that does not broadcast is one line naming it."""
        out = {}
        for name, x in self.values.items():
            if x.shape[0] not in (1, b) or x.shape[1] not in (1, s) or x.shape[2] not in (1, h):
                raise ValueError(f"bias value {name!r} has shape {tuple(x.shape)}; it must broadcast to "
                                 f"[B, S, H] = {(b, s, h)} (one number per key slot and query head)")
            out[name] = jnp.broadcast_to(jnp.asarray(x, jnp.float32), (b, s, h))
        return out

    def key_terms(self, length: int) -> jax.Array:
        """A per-key bias's term at key slots 0 .. length - 1: [B|1, H|1, length] fp32."""
        kj = jnp.arange(length)
        out = jnp.asarray(self.key({n: slot_values(x, kj) for n, x in self.values.items()}, kj), jnp.float32)
        return out.reshape((1,) * (3 - out.ndim) + out.shape)


def lookup(table, index):
    """table[..., index]: the entries of a table as fn receives it, [..., 1, n], at integer
    indices [..., tq, tk] (leading axes broadcast) -> [..., tq, tk] fp32, 0 outside 0..n-1.
    By n selects, no gather, so the fused kernels evaluate it in their tiles and differentiate
    it there (each broadcast along one axis: Triton reduces one axis at a time)."""
    table = jnp.asarray(table, jnp.float32)
    n = table.shape[-1]
    iota = jax.lax.broadcasted_iota(jnp.int32, table.shape, table.ndim - 1)
    out = None
    for b in range(n):
        entry = jnp.sum(jnp.where(iota == b, table, 0.0), axis=-1, keepdims=True)  # [..., 1, 1]
        entry = jnp.broadcast_to(entry, entry.shape[:-1] + index.shape[-1:])  # [..., 1, tk]
        out = jnp.where(index == b, entry, 0.0 if out is None else out)
    return out


POSITION = "__position__"  # `at_positions`: the tokens' positions, read by the bias as a value


def at_positions(bias: Bias | None, positions) -> Bias | None:
    """The bias with the slot indices its fn reads (qi, kj) replaced by `positions` [B|1, T, 1]
    (a value of the Bias, so every implementation reads it): a part cut out of a sequence (a
    block of PaTH's two levels, a ring's shard) scored at its tokens' own positions. A bias
    already so placed is returned as it is (its positions are the sequence's); None stays None.
    The per-key form (`key`) is dropped: the slots' indices no longer name the positions."""
    if bias is None or POSITION in bias.values:
        return bias

    def fn(q, k, qi, kj):
        q, k = dict(q), dict(k)
        return bias.fn(q, k, q.pop(POSITION).astype(jnp.int32), k.pop(POSITION).astype(jnp.int32))

    return Bias(fn, {**bias.values, POSITION: jnp.asarray(positions, jnp.float32)}, tables=bias.tables,
                learned=bias.learned)


def sum_of(biases: list[Bias]) -> Bias:
    """One Bias adding several: each part reads its own values (names kept apart by index)."""
    if len(biases) == 1:
        return biases[0]
    values = {f"{i}.{n}": x for i, b in enumerate(biases) for n, x in b.values.items()}
    tables = {f"{i}.{n}": x for i, b in enumerate(biases) for n, x in b.tables.items()}

    def part(d, i):
        return {n.split(".", 1)[1]: x for n, x in d.items() if n.split(".", 1)[0] == str(i)}

    def fn(q, k, qi, kj):
        return sum(b.fn(part(q, i), part(k, i), qi, kj) for i, b in enumerate(biases))

    def key(k, kj):
        return sum(b.key(part(k, i), kj) for i, b in enumerate(biases))

    def key_bound(length):
        return sum(b.key_bound(length) for b in biases if b.key_bound is not None)

    per_key = all(b.key is not None for b in biases)
    bounded = per_key and any(b.key_bound is not None for b in biases)
    return Bias(fn, values, key if per_key else None, key_bound if bounded else None, tables,
                any(b.learned for b in biases))


def dot_tile(a, b, contract: str):
    """Tiles of a . b with fp32 accumulation (full fp32 precision for fp32 inputs)."""
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 == b.dtype else None
    return jnp.einsum(contract, a, b, preferred_element_type=jnp.float32, precision=precision)


@dataclasses.dataclass(frozen=True, eq=False)
class Score:
    split: Callable
    fn: Callable

    def __call__(self, qb, kb, qi, kj):
        """One block of logits [B, K, G, tq, tk] from qb [B, tq, K, G, D], kb [B, tk, K, D]."""
        q_parts, k_parts = self.split(qb, kb[:, :, :, None])
        dots = tuple(dot_tile(a, b[:, :, :, 0], "btkgd,bskd->bkgts") for a, b in zip(q_parts, k_parts))
        return jnp.asarray(self.fn(dots, qi[:, None], kj[None, :]), jnp.float32)
