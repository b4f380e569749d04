"""Perturbations of "Computation Mechanism Behind LLM Position Generalization" (Han & Ji, Sec 4):
how much a model's loss depends on the exact order of its text, of its keys, and on the
position each key is encoded at. Each perturbation moves a fraction gamma of the tokens by at
most l_max; all are host-side (numpy) draws from an explicit generator, so every model
compared sees the same perturbations.

  swap_pairs    a permutation that swaps round(gamma T / 2) disjoint pairs (a, b), 0 < |a - b|
                <= l_max. Text transposition reads the tokens in this order; the key-order
                perturbation puts key and value j at slot perm[j] in every layer.
  offset_slots  slots j + delta_j, delta_j uniform in [-l_max, l_max] minus 0, for
                round(gamma T) keys: the position-index perturbation (a key moves, the others
                stay: two keys can share a slot, so this is not a permutation).

The paper gives neither the pairing nor the offset distribution; these are the plainest
reading of its words. Keys move under `Scheme.placed_attention`: scored and transformed as
the content of their new slot, with the real features in between, and never seen by a query
before their own position (no leak from the future).
"""

from __future__ import annotations

import numpy as np

MODES = ("text", "keys", "positions")


def _check(t: int, gamma: float, l_max: int) -> None:
    if not 0 <= gamma <= 1:
        raise ValueError(f"perturbation ratio gamma={gamma} must lie in [0, 1]")
    if l_max < 1:
        raise ValueError(f"perturbation range l_max={l_max} must be >= 1")
    if t < 2:
        raise ValueError(f"cannot perturb a sequence of {t} tokens")


def swap_pairs(rng: np.random.Generator, t: int, gamma: float, l_max: int) -> np.ndarray:
    """A permutation of range(t) [t] swapping round(gamma t / 2) disjoint pairs within l_max.

    Pairs are drawn one at a time: a uniform free index a, a partner b = a +- U{1..l_max};
    draws that leave the sequence or hit a used index are retried (up to 20 t draws, so a
    request that cannot be met, gamma near 1 with l_max 1 say, returns fewer pairs).
    """
    _check(t, gamma, l_max)
    perm = np.arange(t)
    used = np.zeros(t, bool)
    want, made = int(round(gamma * t / 2)), 0
    for _ in range(20 * t):
        if made == want:
            break
        a = int(rng.integers(t))
        b = a + int(rng.integers(1, l_max + 1)) * (1 if rng.random() < 0.5 else -1)
        if 0 <= b < t and not used[a] and not used[b]:
            perm[a], perm[b] = b, a
            used[a] = used[b] = True
            made += 1
    return perm


def offset_slots(rng: np.random.Generator, t: int, gamma: float, l_max: int) -> np.ndarray:
    """Slots [t]: round(gamma t) distinct keys j move to j + delta_j, delta_j uniform on
    {-l_max..l_max} minus 0, landing on distinct slots inside the sequence (retried up to 20
    times each); the other keys stay at their own slot."""
    _check(t, gamma, l_max)
    slots = np.arange(t)
    taken = set()
    for j in rng.permutation(t)[:int(round(gamma * t))]:
        for _ in range(20):
            s = int(j) + int(rng.integers(1, l_max + 1)) * (1 if rng.random() < 0.5 else -1)
            if 0 <= s < t and s not in taken:
                slots[j] = s
                taken.add(s)
                break
    return slots


def draw(mode: str, rng: np.random.Generator, shape: tuple[int, int], gamma: float, l_max: int) -> np.ndarray:
    """One draw per row [B, T]: the token order (mode 'text', of a window of T tokens) or the key
    slots (modes 'keys' and 'positions', for a model input of T tokens)."""
    if mode not in MODES:
        raise ValueError(f"unknown perturbation {mode!r}; valid: {', '.join(MODES)}")
    fn = offset_slots if mode == "positions" else swap_pairs
    return np.stack([fn(rng, shape[1], gamma, l_max) for _ in range(shape[0])])
