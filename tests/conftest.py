"""Shared test set-up: a private data dir and tiny configs for the training / eval tests."""

import os
import tempfile

# Before any config is built: the embedded corpus is prepared once per test session in a
# private directory (about 2 s), never in the user's cache.
os.environ.setdefault("POSITIONAL_DATA_DIR", tempfile.mkdtemp(prefix="positional-test-data-"))

import pytest  # noqa: E402


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


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """One trained tiny run (12 steps, checkpoints at 4, 8, 12), shared by read-only tests."""
    from train import train
    config = tiny_config(tmp_path_factory.mktemp("runs") / "rope")
    return config, train(config)
