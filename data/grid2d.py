"""A 2-D grid task where the position in the grid matters, and its small comparison run.

Each example is an h x w grid of random symbols (vocabulary `symbols`) read row by row; the
width w varies per example. The target at cell (i, j) is (symbol above + symbol to the left)
mod `symbols` (a missing neighbour counts as 0). In the flattened order the cell above is w
tokens back, so a 1-D position sees a different offset for every width, while 2-D positions
(row, column) name the neighbours directly. Everything is a function of (seed, step).

    POSITIONAL_DATA_DIR=/tmp/pdata PYTHONPATH=. python data/grid2d.py --steps 300

compares 1-D RoPE over the flattened order, axial 2-D RoPE (espr, nothing learned) and learned
espr with d_c = 2: same model, data, steps and seed; prints a markdown table of accuracy.
"""

from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.lm import DecoderLM, ModelConfig


def grid_batch(seed: int, step: int, batch: int, rows: int = 6, widths=(5, 9), symbols: int = 8):
    """(tokens [B, T], targets [B, T], positions [B, T, 2] (row, col), flat [B, T]), T = rows * 9.

    Grids narrower than the widest are padded at the end with token `symbols` (never a target:
    weight 0), so every row of the batch has the same length.
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
    flat = np.broadcast_to(np.arange(t), (batch, t))
    return (jnp.asarray(tokens), jnp.asarray(targets), jnp.asarray(weight), jnp.asarray(pos),
            jnp.asarray(flat, jnp.int32))


METHODS = {  # name: (scheme, options, which positions)
    "rope_1d_flattened": ("rope", {"layout": "interleaved"}, "flat"),
    "axial_2d_rope": ("espr", {"num_axes": 2, "learned": False}, "grid"),
    "espr_2d": ("espr", {"num_axes": 2}, "grid"),
}


def run(method: str, steps: int, seed: int, batch: int, eval_batches: int = 8) -> dict:
    scheme, options, which = METHODS[method]
    cfg = ModelConfig(vocab_size=9, d_model=64, num_layers=2, num_heads=4, scheme=scheme,
                      scheme_options=tuple(sorted(options.items())))
    model = DecoderLM(cfg, rngs=nnx.Rngs(seed))
    schedule = optax.warmup_cosine_decay_schedule(0, 3e-3, min(30, steps // 2), steps)
    opt = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)

    def loss_fn(model, tokens, targets, weight, positions):
        logits = model(tokens, positions=positions)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        acc = (logits.argmax(-1) == targets).astype(jnp.float32)
        return (nll * weight).sum() / weight.sum(), (acc * weight).sum() / weight.sum()

    @nnx.jit
    def train_step(model, opt, tokens, targets, weight, positions):
        grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
        (loss, _), grads = grad_fn(model, tokens, targets, weight, positions)
        opt.update(model, grads)
        return loss

    evaluate = nnx.jit(loss_fn)
    t0 = time.perf_counter()
    for step in range(steps):
        tokens, targets, weight, grid, flat = grid_batch(seed, step, batch)
        loss = train_step(model, opt, tokens, targets, weight, grid if which == "grid" else flat)
    accs = []
    for i in range(eval_batches):  # held out: steps the training never draws
        tokens, targets, weight, grid, flat = grid_batch(seed, 10**6 + i, batch)
        accs.append(float(evaluate(model, tokens, targets, weight, grid if which == "grid" else flat)[1]))
    return {"method": method, "final_train_loss": float(loss), "eval_accuracy": float(np.mean(accs)),
            "seconds": time.perf_counter() - t0}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", default=",".join(METHODS))
    args = p.parse_args(argv)
    print("| method | eval accuracy | final train loss | seconds |\n|---|---:|---:|---:|", flush=True)
    for m in args.methods.split(","):
        r = run(m, args.steps, args.seed, args.batch)
        print(f"| {m} | {r['eval_accuracy']:.3f} | {r['final_train_loss']:.3f} | {r['seconds']:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
