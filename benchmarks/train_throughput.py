"""Training-step throughput of every registered position scheme, as a ratio to RoPE.

    python benchmarks/train_throughput.py                   # all schemes, 16 x 256 tokens
    python benchmarks/train_throughput.py --schemes rope,alibi --steps 10 --rounds 3
    python benchmarks/train_throughput.py --schemes rope,path@blockwise --seq-len 512 --block-size 64

A scheme written name@impl trains with that attention impl; the others use --impl.

Each scheme gets the default model (configs/default.py, byte vocab 258) and a jitted step like
train.py's: forward + backward through `token_nll`, then the AdamW update from
`train.make_optimizer`. Random token batches stand in for data, since the data pipeline is not
what is measured. All schemes are compiled first, then timed in interleaved rounds (the order
rotates each round) so that load from other jobs on a shared machine falls on all of them
alike; the median round per scheme is reported. The process's CPU time is reported beside the
wall clock: on a shared machine, time spent descheduled inflates the wall clock of whichever
scheme it hits but not its CPU time, so the CPU-time ratio is the steadier of the two.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable

# train.py sits at the repository root, outside the installed packages.

import jax
import jax.numpy as jnp
import optax
from absl import app, flags
from flax import nnx

from configs.default import get_config
from models.lm import DecoderLM, token_nll
from models.registry import REGISTRY
from lab.state import make_optimizer, model_config

VOCAB = 258
BASELINE = "rope"

# Run as a script, the flags are the process's own (app.run parses them, --help lists them).
# Imported (tests/project/test_benchmarks.py, benchmarks/espr.py), a module keeps its flags to itself,
# so that benchmarks sharing flag names, or one module loaded twice, never collide: the other
# benchmarks do the same.
FLAGS = flags.FLAGS if __name__ == "__main__" else flags.FlagValues()
flags.DEFINE_string("schemes", ",".join(REGISTRY), "comma-separated registry names", flag_values=FLAGS)
flags.DEFINE_integer("batch", 16, "rows per step", flag_values=FLAGS)
flags.DEFINE_integer("seq_len", 256, "tokens per row", flag_values=FLAGS)
flags.DEFINE_integer("steps", 10, "timed steps per scheme per round", flag_values=FLAGS)
flags.DEFINE_integer("rounds", 3, "interleaved rounds", flag_values=FLAGS)
flags.DEFINE_integer("warmup", 2, "untimed steps after compiling", flag_values=FLAGS)
flags.DEFINE_string("impl", "reference", "attention impl, as model.attention_impl", flag_values=FLAGS)
flags.DEFINE_integer("block_size", 512, "model.block_size (blockwise impls)", flag_values=FLAGS)
flags.DEFINE_alias("seq-len", "seq_len", flag_values=FLAGS)  # as docs and RESULTS.md spell it
flags.DEFINE_alias("block-size", "block_size", flag_values=FLAGS)


def make_step(scheme: str, impl: str, block_size: int = 512) -> tuple[Callable, tuple]:
    """A jitted (state, tokens) -> (state, loss) for the default model with `scheme`."""
    config = get_config(scheme)
    config.model.block_size = block_size
    model = DecoderLM(model_config(config, VOCAB), rngs=nnx.Rngs(config.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params)
    tx, _ = make_optimizer(config.train)

    def loss_fn(params, tokens, rng):
        nll, _ = token_nll(nnx.merge(graphdef, params, rest), tokens, impl=impl, rng=rng)
        return nll.mean()

    def step(state, tokens):
        params, opt_state = state
        # A fresh key per step, as train.py draws it: random schemes pay for their draws.
        rng = jax.random.fold_in(jax.random.key(0), opt_state[1][0].count)
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return jax.jit(step, donate_argnums=0), (params, jax.jit(tx.init)(params))


def time_steps(step: Callable, state, batches: list, n: int):
    """Run n steps, cycling through batches; returns (state, wall seconds, CPU seconds)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(n):
        state, loss = step(state, batches[i % len(batches)])
    jax.block_until_ready((state, loss))
    return state, time.perf_counter() - t0, time.process_time() - c0


def markdown(results: dict[str, list[float]], cpu: dict[str, list[float]]) -> str:
    """results: tokens per wall second per round; cpu: tokens per CPU second per round."""
    def ratio(d, name):
        if BASELINE not in d:
            return "n/a"
        return f"{statistics.median(d[name]) / statistics.median(d[BASELINE]):.2f}"

    lines = [f"| scheme | tokens/s (median) | min - max over rounds | ratio to {BASELINE} | "
             f"tokens per CPU-s (median) | ratio to {BASELINE} (CPU time) |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, rates in results.items():
        lines.append(f"| {name} | {statistics.median(rates):,.0f} | {min(rates):,.0f} - {max(rates):,.0f} | "
                     f"{ratio(results, name)} | {statistics.median(cpu[name]):,.0f} | {ratio(cpu, name)} |")
    return "\n".join(lines)


def benchmark() -> dict[str, list[float]]:
    """Tokens per second per round of each scheme, as FLAGS ask."""
    schemes = FLAGS.schemes.split(",")
    unknown = [s for s in schemes if s.split("@")[0] not in REGISTRY]
    if unknown:
        raise SystemExit(f"unknown scheme(s) {unknown}; registered: {', '.join(REGISTRY)}")

    key = jax.random.key(0)
    # A few distinct batches, made once, so no step waits on data and no step reuses a cache.
    batches = [jax.random.randint(k, (FLAGS.batch, FLAGS.seq_len + 1), 0, VOCAB, jnp.int32)
               for k in jax.random.split(key, 4)]
    steps, states = {}, {}
    for s in schemes:
        t0 = time.perf_counter()
        name, _, impl = s.partition("@")
        steps[s], states[s] = make_step(name, impl or FLAGS.impl, FLAGS.block_size)
        states[s] = time_steps(steps[s], states[s], batches, 1 + FLAGS.warmup)[0]  # compile + warm up
        print(f"# {s}: compile + {FLAGS.warmup} warm-up steps {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)

    tokens = FLAGS.batch * FLAGS.seq_len * FLAGS.steps
    results: dict[str, list[float]] = {s: [] for s in schemes}
    cpu: dict[str, list[float]] = {s: [] for s in schemes}
    for r in range(FLAGS.rounds):
        for s in schemes[r % len(schemes):] + schemes[:r % len(schemes)]:
            states[s], seconds, cpu_seconds = time_steps(steps[s], states[s], batches, FLAGS.steps)
            results[s].append(tokens / seconds)
            cpu[s].append(tokens / cpu_seconds)

    print(f"batch {FLAGS.batch} x seq_len {FLAGS.seq_len}, impl {FLAGS.impl}, {FLAGS.steps} steps x "
          f"{FLAGS.rounds} rounds, jax {jax.__version__} on {jax.devices()[0].platform}\n")
    print(markdown(results, cpu))
    return results


def main(argv):
    del argv  # flags only
    benchmark()


if __name__ == "__main__":
    app.run(main)
