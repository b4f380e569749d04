"""Helpers shared by the tests: a tiny config and its abstract parameters, a subprocess runner,
the sharded-step check, and a benchmark script loaded as a module. (Test modules import these,
never each other: tests/project/test_architecture.py.)"""

import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tiny_config(workdir, scheme="rope", **train):
    """A model small enough that a training step takes milliseconds on CPU."""
    from configs import default
    c = default.get_config(scheme)
    c.workdir = str(workdir)
    c.model.update(d_model=32, num_layers=2, num_heads=2)
    c.seq_len, c.batch_size = 32, 8
    c.train.update(steps=12, warmup_steps=2, lr=3e-3, log_every=1, checkpoint_every=4,
                   keep_checkpoints=10)
    c.train.update(**train)
    c.eval.update(multipliers=(0.5, 1, 2, 4), tokens=256, batch_size=2, blockwise_from=128)
    return c


def overrides(config):
    """The command-line flags that reproduce the tiny config."""
    return [f"--config.{k}={v}" for k, v in [
        ("workdir", config.workdir), ("model.d_model", 32), ("model.num_layers", 2),
        ("model.num_heads", 2), ("seq_len", 32), ("batch_size", 8), ("train.warmup_steps", 2),
        ("train.log_every", 1), ("train.keep_checkpoints", 10)]]


def cli(*args, env=None, cwd=ROOT):
    """Run a project entry point in a subprocess (from the repository root by default)."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def abstract_params(config):
    """Abstract parameters of the tiny config's model (what load_params restores into)."""
    import jax
    from flax import nnx

    from lab.state import model_config
    from models.lm import DecoderLM
    model = DecoderLM(model_config(config, 258), rngs=nnx.Rngs(0))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                        nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def sharded_step(schemes, meshes, devices, impl=None):
    """tests/helpers/sharded_step.py on `devices` simulated CPU devices: per scheme and mesh, how far a
    sharded train step is from the one-device one."""
    impl = ["--impl", impl] if impl else []
    run = cli("tests/helpers/sharded_step.py", ",".join(schemes), json.dumps(meshes), *impl,
              env={"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_sharded(result):
    # Parameters after Adam's first non-zero step (lr 1.5e-3) only to within the learning rate:
    # Adam divides by |g|, so a near-zero gradient entry that rounds differently in another
    # summation order can move by up to ~lr (seen: ESPR's zero-initialised skew parameters).
    for scheme, by_mesh in result.items():
        for mesh, d in by_mesh.items():
            assert d["loss"] < 1e-5 and d["grads"] < 1e-4 and d["params"] < 1.5e-3, (scheme, mesh, d)


def load_benchmark(name: str):
    """benchmarks/<name>.py imported afresh, under its own name: a new module, so its flags (a FlagValues
    of its own when not __main__) start unparsed for each test."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sub_mesh(sizes: dict):
    """(a mesh of every axis of models.sharding.MESH_AXES, those `sizes` leaves out of size 1, on
    the first devices it needs; its name in a check's report: the axes over 1 as sorted JSON)."""
    import jax
    from models.sharding import MESH_AXES
    full = {a: sizes.get(a, 1) for a in MESH_AXES}
    n = 1
    for size in full.values():
        n *= size
    mesh = jax.make_mesh(tuple(full.values()), MESH_AXES, devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Auto,) * len(full))
    return mesh, json.dumps({a: s for a, s in full.items() if s > 1}, sort_keys=True)
