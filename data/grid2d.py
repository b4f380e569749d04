"""A 2-D grid task where the position in the grid matters (the experiment on it:
benchmarks/grid2d.py).

Each example is an h x w grid of random symbols (vocabulary `symbols`) read row by row; the
width w varies per example. The target at cell (i, j) is (symbol above + symbol to the left)
mod `symbols` (a missing neighbour counts as 0). In the flattened order the cell above is w
tokens back, so a 1-D position sees a different offset for every width, while 2-D positions
(row, column) name the neighbours directly. Everything is a function of (seed, step).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np


def grid_batch(seed: int, step: int, batch: int, rows: int = 6, widths=(5, 9), symbols: int = 8,
               offset=(0, 0)):
    """(tokens [B, T], targets [B, T], weight [B, T], positions [B, T, 2] (row, col), flat [B, T]),
    T = rows * widths[1].

    Grids narrower than the widest are padded at the end with token `symbols` (never a target:
    weight 0), so every row of the batch has the same length. `offset` (dr, dc) is added to
    every 2-D position (padding included), a translation of the whole grid; the tokens, targets
    and `flat` do not change with it.
    """
    rng = np.random.default_rng([seed, step])
    t = rows * widths[1]
    tokens = np.full((batch, t), symbols)
    targets = np.zeros((batch, t), np.int64)
    weight = np.zeros((batch, t), np.float32)
    pos = np.zeros((batch, t, 2), np.float32)
    for b in range(batch):
        w = rng.integers(widths[0], widths[1] + 1)
        g = rng.integers(0, symbols, (rows, w))
        above = np.vstack([np.zeros((1, w), np.int64), g[:-1]])
        left = np.hstack([np.zeros((rows, 1), np.int64), g[:, :-1]])
        n = rows * w
        tokens[b, :n] = g.ravel()
        targets[b, :n] = ((above + left) % symbols).ravel()
        weight[b, :n] = 1.0
        r, c = np.divmod(np.arange(n), w)
        pos[b, :n] = np.stack([r, c], -1)
        pos[b, n:] = np.stack([np.full(t - n, rows), np.arange(t - n)], -1)
    if any(offset):
        pos += np.asarray(offset, np.float32)
    flat = np.broadcast_to(np.arange(t), (batch, t))
    return (jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(weight), jnp.asarray(pos),
            jnp.asarray(flat, jnp.int32))

