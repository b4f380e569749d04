"""One train step of a tiny model on several meshes against one device (run by
tests/models/test_scale.py in a process with simulated devices).

    XLA_FLAGS=--xla_force_host_platform_device_count=16 python tests/helpers/sharded_step.py \
        rope,path_fox,mixer:sessa '[{"data": 2, "sequence": 4}]' [--impl ring]

Prints JSON: per scheme and mesh, against the one-device run, the difference of the loss, the
largest gradient difference relative to the largest gradient, and the largest parameter
difference after two train steps. `--impl` sets model.attention_impl of both runs (default: the
scheme's config); impl "ring" is ring attention on the meshes, blockwise on the one device.
"""

import json
import math

import jax
from absl import app, flags
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from lab.state import init_state
from lab.state import make_loss, make_train_step
from models.sharding import MESH_AXES, activation_rules
from tiny_setup import tiny_config  # beside this script, whose folder Python puts on the path

VOCAB, ROWS, LENGTH = 64, 8, 32


def one_step(config, sizes, batch):
    sizes = {a: sizes.get(a, 1) for a in MESH_AXES}
    n = math.prod(sizes.values())
    mesh = jax.make_mesh(tuple(sizes.values()), MESH_AXES, devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
    graphdef, rest, tx, _, state = init_state(config, VOCAB, mesh)
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    batch = {k: jax.device_put(v, batch_sharding) for k, v in batch.items()}
    rng = jax.random.key(config.seed)
    with activation_rules(mesh):  # as the train step traces its loss
        loss, grads = jax.jit(jax.value_and_grad(make_loss(graphdef, rest, config)))(
            state["params"], batch, rng)
    step = make_train_step(graphdef, rest, tx, config, jax.tree.map(lambda x: x.sharding, state),
                                 batch_sharding)
    for _ in range(2):  # the learning rate is 0 at step 0
        state, _ = step(state, batch)
    return float(loss), [np.asarray(x) for x in jax.tree.leaves((grads, state["params"]))]


def main(schemes, meshes, impl=None):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (ROWS, LENGTH + 1)).astype(np.int32)
    segments = np.where(np.arange(LENGTH + 1) < 20, 1, 2).astype(np.int32) * np.ones((ROWS, 1), np.int32)
    positions = np.where(segments == 1, np.arange(LENGTH + 1), np.arange(LENGTH + 1) - 20).astype(np.int32)
    batch = {"tokens": tokens, "segment_ids": segments, "positions": positions}
    out = {}
    for scheme in schemes:  # "mixer:sessa" runs a Sessa macro-block model instead
        mixer = scheme.split(":")[1] if scheme.startswith("mixer:") else "attention"
        config = tiny_config("unused", scheme="nope" if mixer != "attention" else scheme)
        config.model.update(vocab_size=VOCAB, num_heads=4, mixer=mixer)
        config.seq_len, config.batch_size = LENGTH, ROWS
        if impl:
            config.model.attention_impl = impl
        loss0, params0 = one_step(config, {}, batch)
        out[scheme] = {}
        for sizes in meshes:
            loss, params = one_step(config, sizes, batch)
            # Gradients relative to the largest one; parameters after two steps through the train
            # step (Adam divides by |g|, so entries with near-zero gradients move by up to ~lr).
            n = len(params) // 2
            scale = max(float(np.abs(g).max()) for g in params0[:n])
            out[scheme][json.dumps(sizes, sort_keys=True)] = {
                "loss": abs(loss - loss0),
                "grads": max(float(np.abs(a - b).max()) for a, b in zip(params[:n], params0[:n])) / scale,
                "params": max(float(np.abs(a - b).max()) for a, b in zip(params[n:], params0[n:]))}
    print(json.dumps(out))


flags.DEFINE_string("impl", None, "model.attention_impl of both runs (default: the scheme's config)")


def cli(argv):
    if len(argv) != 3:
        raise app.UsageError("arguments: SCHEMES (comma-separated) MESHES (a JSON list of axis sizes)")
    main(argv[1].split(","), json.loads(argv[2]), flags.FLAGS.impl)


if __name__ == "__main__":
    app.run(cli)
