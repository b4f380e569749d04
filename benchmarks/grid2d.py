"""The 2-D grid task (data/grid2d.py): 1-D RoPE over the flattened order, axial 2-D RoPE (espr,
nothing learned) and learned espr with d_c = 2, same model, data, steps and seed; prints a
markdown table of accuracy on held-out grids.

    POSITIONAL_DATA_DIR=/tmp/pdata PYTHONPATH=. python benchmarks/grid2d.py --steps 300

The task's targets weigh cells (padding counts 0) and its positions are 2-D, which the
project's training loop (lab/training.py) does not take; hence this small loop of its own.
"""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from data.grid2d import grid_batch
from models.lm import DecoderLM, ModelConfig


METHODS = {  # name: (scheme, options, which positions)
    "rope_1d_flattened": ("rope", {"layout": "interleaved"}, "flat"),
    "axial_2d_rope": ("espr", {"num_axes": 2, "learned": False}, "grid"),
    "espr_2d": ("espr", {"num_axes": 2}, "grid"),
}

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_integer("steps", 300, "training steps per method", flag_values=FLAGS)
flags.DEFINE_integer("batch", 32, "grids per step", flag_values=FLAGS)
flags.DEFINE_integer("seed", 0, "initialisation and data", flag_values=FLAGS)
flags.DEFINE_string("methods", ",".join(METHODS), "comma-separated names of METHODS", flag_values=FLAGS)


def run(method: str, steps: int, seed: int, batch: int, eval_batches: int = 8) -> dict:
    """Train one method's model on the task, then score it on held-out grids."""
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


def benchmark() -> list[dict]:
    """One row per method, as FLAGS ask."""
    print("| method | eval accuracy | final train loss | seconds |\n|---|---:|---:|---:|", flush=True)
    rows = []
    for m in FLAGS.methods.split(","):
        rows.append(run(m, FLAGS.steps, FLAGS.seed, FLAGS.batch))
        r = rows[-1]
        print(f"| {m} | {r['eval_accuracy']:.3f} | {r['final_train_loss']:.3f} | {r['seconds']:.0f} |",
              flush=True)
    return rows


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
