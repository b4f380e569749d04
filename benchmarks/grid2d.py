"""The 2-D grid task (data/grid2d.py): 1-D RoPE over the flattened order, axial 2-D RoPE (espr,
nothing learned), learned STRING (espr with d_c = 2: commuting generators) and relaxed ESPR
(free skew parts in the generators, which then need not commute), also with a penalty on
their commutators; same model, data and steps per seed. Every trained model is scored on
held-out grids as trained and under position shifts (SHIFTS): the whole grid translated by (dr, dc), and larger grids than trained.
Prints markdown tables (every run, then mean +- std over seeds); --json writes them.

    POSITIONAL_DATA_DIR=/tmp/pdata PYTHONPATH=. python benchmarks/grid2d.py --steps 400 \\
        --methods axial_2d_rope,string_2d,espr_relaxed_2d --seeds 0,1,2 --json out.json

With commuting generators the scores depend on position differences only, so a translated
grid gives the same logits (tests/data/test_grid2d.py); the relaxed model's need not.

The task's targets weigh cells (padding counts 0) and its positions are 2-D, which the
project's training loop (lab/training.py) does not take; hence this small loop of its own.
"""

from __future__ import annotations

import functools
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from data.grid2d import grid_batch
from lab.provenance import stamped
from models.features import SchemeFeatures
from models.lm import DecoderLM, ModelConfig
from positional import espr
from positional.espr import Espr


METHODS = {  # name: (scheme, options, which positions)
    "rope_1d_flattened": ("rope", {"layout": "interleaved"}, "flat"),
    "axial_2d_rope": ("espr", {"num_axes": 2, "learned": False}, "grid"),
    "string_2d": ("espr", {"num_axes": 2}, "grid"),
    "espr_relaxed_2d": ("espr", {"num_axes": 2, "relaxed": True}, "grid"),
    # The theorems' regime, |[L_a, L_b]| <= eps_comm small: the same model trained with
    # COMMUTATOR_PENALTY x sum over layers and pairs of |[L_a, L_b]|_F^2 added to its loss.
    "espr_relaxed_2d_penalised": ("espr", {"num_axes": 2, "relaxed": True}, "grid"),
}
COMMUTATOR_PENALTY = {"espr_relaxed_2d_penalised": 10.0}

SHIFTS = {  # name: grid_batch options of the held-out grids. Offsets move the 2-D positions only.
    "none": {},
    "offset_3_3": {"offset": (3, 3)},
    "offset_10_10": {"offset": (10, 10)},
    "offset_40_40": {"offset": (40, 40)},
    "offset_0_20": {"offset": (0, 20)},
    "larger_12x10_14": {"rows": 12, "widths": (10, 14)},  # trained on 6 rows, widths 5..9
}

# Process-wide only when run as a script (why: benchmarks/train_throughput.py).
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_integer("steps", 300, "training steps per method", flag_values=FLAGS)
flags.DEFINE_integer("batch", 32, "grids per step", flag_values=FLAGS)
flags.DEFINE_string("seeds", "0", "comma-separated seeds (initialisation and data)", flag_values=FLAGS)
flags.DEFINE_string("methods", ",".join(METHODS), "comma-separated names of METHODS", flag_values=FLAGS)
flags.DEFINE_string("shifts", ",".join(SHIFTS), "comma-separated names of SHIFTS", flag_values=FLAGS)
flags.DEFINE_integer("eval_batches", 8, "held-out batches per shift", flag_values=FLAGS)
flags.DEFINE_string("json", "", "write the runs and the summary here", flag_values=FLAGS)
flags.DEFINE_string("plot", "", "write accuracy per shift (mean +- std over seeds) here", flag_values=FLAGS)


def loss_fn(model, tokens, targets, weight, positions):
    """(weighted cross-entropy, weighted accuracy) over the cells."""
    logits = model(tokens, positions=positions)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    acc = (logits.argmax(-1) == targets).astype(jnp.float32)
    return (nll * weight).sum() / weight.sum(), (acc * weight).sum() / weight.sum()


def commutators(model) -> jax.Array:
    """sum over layers and pairs (a, b) of |[L_a, L_b]|_F^2 of a relaxed model's generators."""
    total = jnp.zeros(())
    for _, m in nnx.iter_graph(model):
        if isinstance(m, SchemeFeatures) and isinstance(m.scheme, Espr) and m.scheme.relaxed:
            total += jnp.sum(espr.commutators(m(None, tokens=None, index=None)["generators"]) ** 2)
    return total


@functools.partial(nnx.jit, static_argnames="penalty")
def train_step(model, opt, tokens, targets, weight, positions, penalty: float = 0.0):
    def loss(model):
        task, acc = loss_fn(model, tokens, targets, weight, positions)
        return task + penalty * commutators(model) if penalty else task, task
    (_, task), grads = nnx.value_and_grad(loss, has_aux=True)(model)
    opt.update(model, grads)
    return task


evaluate = nnx.jit(loss_fn)


def make_model(method: str, seed: int, d_model: int = 64, num_layers: int = 2, num_heads: int = 4) -> DecoderLM:
    scheme, options, _ = METHODS[method]
    cfg = ModelConfig(vocab_size=9, d_model=d_model, num_layers=num_layers, num_heads=num_heads, scheme=scheme,
                      scheme_options=tuple(sorted(options.items())))
    return DecoderLM(cfg, rngs=nnx.Rngs(seed))


def generator_stats(model: DecoderLM) -> dict:
    """Max over layers of |[L_a, L_b]| and of |skew(E_k)| (spectral norms) of a relaxed model's
    generators; {} for other schemes."""
    comm, drift = [], []
    for _, m in nnx.iter_graph(model):
        if isinstance(m, SchemeFeatures) and isinstance(m.scheme, Espr) and m.scheme.relaxed:
            comm.append(float(m(None, tokens=None, index=None)["commutator_norm"]))
            e = m.drift[...]
            drift.append(float(jnp.linalg.norm((e - jnp.swapaxes(e, -1, -2)) / 2, ord=2, axis=(-2, -1)).max()))
    return {"commutator_norm": max(comm), "drift_norm": max(drift)} if comm else {}


def run(method: str, steps: int, seed: int, batch: int, shifts=tuple(SHIFTS), eval_batches: int = 8) -> dict:
    """Train one method's model on the task, then score it on held-out grids under each shift."""
    which = METHODS[method][2]
    model = make_model(method, seed)
    schedule = optax.warmup_cosine_decay_schedule(0, 3e-3, min(30, steps // 2), steps)
    opt = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)
    t0 = time.perf_counter()
    loss = float("nan")
    for step in range(steps):
        tokens, targets, weight, grid, flat = grid_batch(seed, step, batch)
        loss = train_step(model, opt, tokens, targets, weight, grid if which == "grid" else flat,
                          penalty=COMMUTATOR_PENALTY.get(method, 0.0))
    train_seconds = time.perf_counter() - t0
    accuracy = {}
    for name in shifts:
        accs = []
        for i in range(eval_batches):  # held out: steps the training never draws; the same grids per shift
            tokens, targets, weight, grid, flat = grid_batch(seed, 10**6 + i, batch, **SHIFTS[name])
            accs.append(float(evaluate(model, tokens, targets, weight, grid if which == "grid" else flat)[1]))
        accuracy[name] = float(np.mean(accs))
    return {"method": method, "seed": seed, "final_train_loss": float(loss), "accuracy": accuracy,
            **generator_stats(model), "train_seconds": train_seconds, "seconds": time.perf_counter() - t0}


def summary(rows: list[dict]) -> dict:
    """{method: {shift: [mean, sample std (0 for one seed), n]}} over the runs' seeds."""
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows):
        runs = [r for r in rows if r["method"] == method]
        out[method] = {}
        for shift in runs[0]["accuracy"]:
            a = np.array([r["accuracy"][shift] for r in runs])
            out[method][shift] = [float(a.mean()), float(a.std(ddof=1)) if len(a) > 1 else 0.0, len(a)]
    return out


def by_arm(rows: list[dict], shifts) -> dict:
    """The runs' accuracies in lab/results/seeds.py's layout (columns: the shifts; per method its
    seeds and values [seed, shift]), which the claims ledger (lab/results/claims.py) reads."""
    arms = {}
    for r in rows:
        arm = arms.setdefault(r["method"], {"seeds": [], "values": []})
        arm["seeds"].append(r["seed"])
        arm["values"].append([r["accuracy"][s] for s in shifts])
    return {"columns": list(shifts), "measure": "accuracy", "axis": "shift", "arms": arms}


def plot(table: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    shifts = list(next(iter(table.values())))
    width = 0.8 / len(table)
    for i, (method, by_shift) in enumerate(table.items()):
        mean, std, n = np.array([by_shift[s] for s in shifts]).T
        ax.bar(np.arange(len(shifts)) + (i - (len(table) - 1) / 2) * width, mean, width, yerr=std, capsize=3,
               label=method)
    ax.set_xticks(np.arange(len(shifts)), shifts, rotation=20, fontsize=8)
    ax.set(ylabel=f"held-out accuracy (mean +- std, {int(n[0])} seeds)", ylim=(0, 1.05))
    ax.axhline(1 / 8, color="gray", lw=0.8, ls=":")  # chance
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=len(table))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def benchmark() -> list[dict]:
    """One row per method and seed, as FLAGS ask."""
    shifts = FLAGS.shifts.split(",")
    print("| method | seed | " + " | ".join(shifts) + " | final train loss | commutator norm | seconds |\n"
          + "|---|---:|" + "---:|" * (len(shifts) + 3), flush=True)
    rows = []
    for seed in map(int, FLAGS.seeds.split(",")):
        for m in FLAGS.methods.split(","):
            r = run(m, FLAGS.steps, seed, FLAGS.batch, shifts, FLAGS.eval_batches)
            rows.append(r)
            comm = f"{r['commutator_norm']:.3g}" if "commutator_norm" in r else "-"
            print(f"| {m} | {seed} | " + " | ".join(f"{r['accuracy'][s]:.3f}" for s in shifts)
                  + f" | {r['final_train_loss']:.3f} | {comm} | {r['seconds']:.0f} |", flush=True)
    table = summary(rows)
    print("\n| method | " + " | ".join(shifts) + " |\n|---|" + "---:|" * len(shifts))
    for m, by_shift in table.items():
        print(f"| {m} | " + " | ".join(f"{by_shift[s][0]:.3f} +- {by_shift[s][1]:.3f}" for s in shifts) + " |")
    if FLAGS.json:
        config = {"steps": FLAGS.steps, "batch": FLAGS.batch, "eval_batches": FLAGS.eval_batches,
                  "seeds": FLAGS.seeds, "methods": {m: METHODS[m][:2] for m in FLAGS.methods.split(",")},
                  "commutator_penalty": {m: COMMUTATOR_PENALTY[m] for m in FLAGS.methods.split(",")
                                         if m in COMMUTATOR_PENALTY},
                  "shifts": {s: SHIFTS[s] for s in shifts}}
        with open(FLAGS.json, "w") as f:
            json.dump(stamped({"config": config, "jax": jax.__version__, "runs": rows, "summary": table,
                               **by_arm(rows, shifts)}), f, indent=1)
    if FLAGS.plot:
        plot(table, FLAGS.plot)
    return rows


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
