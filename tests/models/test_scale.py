"""Training at scale: rematerialisation policies and the dry run (compile the sharded train
step, print per-device memory, run nothing)."""


import jax
import numpy as np
import pytest
from flax import nnx

from models.lm import DecoderLM, ModelConfig, token_nll
from models.registry import REGISTRY
from helpers.tiny_setup import check_sharded, cli, sharded_step, tiny_config
from lab.training import dry_run


@pytest.mark.parametrize("scheme", ["rope", "path_fox"])
def test_remat_policies_recompute_and_keep_the_gradients(scheme):
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 30)
    grads, dots = {}, {}
    for remat in ("none", "dots", "block"):
        m = DecoderLM(ModelConfig(vocab_size=30, d_model=32, num_layers=2, num_heads=4, scheme=scheme,
                                  remat=remat), rngs=nnx.Rngs(0))
        graphdef, state = nnx.split(m)
        loss = lambda s: token_nll(nnx.merge(graphdef, s), tokens, rng=jax.random.key(3))[0].mean()  # noqa: E731
        fn = jax.jit(jax.grad(loss))
        grads[remat] = fn(state)
        # Recomputation shows in the program JAX hands to XLA: the forward's matmuls again.
        dots[remat] = fn.lower(state).as_text().count("dot_general")
    for remat in ("dots", "block"):
        for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert dots["none"] < dots["dots"] < dots["block"], dots  # "dots" keeps the projections


def test_unknown_remat_policy_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid: none, block, dots"):
        ModelConfig(remat="everything")


def test_dry_run_counts_state_bytes_per_device(tmp_path):
    config = tiny_config(tmp_path / "run")
    config.model.vocab_size = 258
    r = dry_run(config)
    n = r["params"]
    assert r["devices"] == 1 and n > 10_000
    # params + two Adam moments (fp32) + counters, all on the one device; donated to the output.
    assert 12 * n <= r["argument_bytes"] <= 12 * n + 4096
    batch = 3 * 8 * 33 * 4  # tokens, segment ids, positions: int32 [8, 33]
    assert r["alias_bytes"] == r["argument_bytes"] - batch and r["temp_bytes"] > 0
    assert not (tmp_path / "run").exists()  # nothing written


def test_dry_run_on_8_devices_shards_the_state(tmp_path):
    config = tiny_config(tmp_path / "run")
    flags = [f"--config.{k}={v}" for k, v in (("workdir", config.workdir), ("seq_len", 32), ("batch_size", 8),
                                               ("model.d_model", 64), ("model.num_layers", 2),
                                               ("model.vocab_size", 256))]
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    run = cli("train.py", "--config", "configs/default.py", "--config.dry_run=True", "--config.mesh.data=2",
              "--config.mesh.fsdp=4", *flags, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "8 devices, mesh {'data': 2, 'fsdp': 4, 'sequence': 1, 'tensor': 1}" in run.stdout
    assert "total" in run.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sequence_and_tensor_parallel_steps_equal_one_device():
    """Gradients and train steps of packed rows (two documents each) on all four axes at once
    equal the one-device ones: the partitioner keeps every cross-shard carry (PaTH's transport,
    FoX's gate sums; rope's sharded step is tests/lab/test_train.py's). Every scheme on three meshes:
    the slow test below."""
    all_four = {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 2}
    check_sharded(sharded_step(["path_fox"], [all_four], 16))


@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(REGISTRY) + ["mixer:sessa", "mixer:mamba2"])  # Sessa's solve too
def test_every_scheme_on_every_mesh_equals_one_device(model):
    check_sharded(sharded_step([model], [{"data": 2, "sequence": 4}, {"fsdp": 2, "tensor": 4},
                                         {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 2}], 16))


def test_long_context_configs():
    from configs import long_context
    c = long_context.get_config("tpu16/path_fox")
    assert (c.seq_len, c.batch_size, c.model.scheme) == (131072, 2, "path_fox")
    assert dict(c.mesh) == {"data": 1, "fsdp": 2, "tensor": 1, "sequence": 8}
    assert c.model.attention_impl == "auto" and c.model.block_size == 64  # PaTH keeps its chunks
    c = long_context.get_config("gpu8")
    assert (c.model.attention_impl, c.model.block_size) == ("auto", 1024)  # auto: the ring on the mesh
    with pytest.raises(ValueError, match="valid: gpu8, tpu16"):
        long_context.get_config("gpu4/rope")
