"""Helpers shared by the training and eval tests: a tiny config and a subprocess runner."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
