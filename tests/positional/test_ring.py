"""Ring attention (positional/ring.py, and PaTH's own, positional/path/
`ring_path_attention`): against the reference on meshes of simulated devices (in subprocesses:
tests/helpers/ring_check.py, tests/helpers/path_ring_check.py, tests/helpers/sharded_step.py
--impl ring), its fallback to blockwise attention off a sequence mesh, and which schemes run on it."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.registry import REGISTRY, make_scheme
from models.sharding import activation_rules
from positional.attention import attention, blockwise_attention
from positional.path.chunked import chunked_attention
from positional.path.ring import ring_path_attention
from positional.path.scheme import Path
from positional.ring import ring_mesh
from positional.scheme import Scheme
from helpers.tiny_setup import check_sharded, cli, sharded_step


def ring_check(meshes, script="tests/helpers/ring_check.py", *args):
    run = cli(script, json.dumps(meshes), *args, env={"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def check_ring(result, sizes):
    held = (2 // sizes.get("data", 1), 2 // sizes.get("tensor", 1))  # B = 2 rows, K = 2 kv heads
    for case, d in result.items():
        bf16 = d["dtype"] == "bfloat16"
        assert d["out"] <= (1e-2 if bf16 else 1e-5), (case, d)
        for what in ("dq", "dk", "dv", "dbias"):  # bf16 gradients: one rounding of bf16 (2^-8 relative);
            # the bias's, fp32, from bf16 matmuls rounded in other places (ring: its own backward)
            assert d.get(what, 0) <= ((5e-3 if what == "dbias" else 2e-2) if bf16 else 1e-5), (case, what, d)
        if "held" in d:
            assert tuple(d["held"]) == held, (case, d)


def test_ring_equals_reference_on_data_by_sequence_mesh():
    """sequence=4 with data=2: GQA, packed documents across shards, ALiBi and FoX-style biases
    (values and gradients, the bias parameter's too), bf16; batch rows stay split over data."""
    sizes = {"data": 2, "sequence": 4}
    check_ring(ring_check([sizes]), sizes)


@pytest.mark.slow
def test_ring_equals_reference_on_sequence_and_tensor_meshes():
    result = ring_check([{"sequence": 4}, {"tensor": 2, "sequence": 4}])
    for sizes in ({"sequence": 4}, {"tensor": 2, "sequence": 4}):
        key = json.dumps(sizes, sort_keys=True)
        check_ring({c: d for c, d in result.items() if c.startswith(key + " ")}, sizes)


@pytest.mark.slow
def test_ring_train_step_equals_one_device():
    """The FoX scheme's train step (a bias built from per-token gates, packed rows) with impl
    "ring" on data=2 x sequence=4: loss, gradients and parameters as on one device."""
    check_sharded(sharded_step(["fox"], [{"data": 2, "sequence": 4}], 8, impl="ring"))


def check_path_ring(result, sizes):
    """Values and gradients (q, k, v, w, beta, the bias's parameters) as the reference's to fp32
    rounding; the compiled program all-gathers only the n shards' D x D products of this
    device's batch rows and kv heads ([n, B, K, D, D]; B = 2 rows, K = 2 kv heads, D = 8)."""
    n = sizes["sequence"]
    gathered = [f"{n},{2 // sizes.get('data', 1)},{2 // sizes.get('tensor', 1)},8,8"]
    for case, d in result.items():
        assert d.pop("gathered") == gathered, (case, d)
        assert max(d.values()) <= 1e-5, (case, d)


def test_path_ring_equals_reference_on_4_devices():
    """PaTH with FoX gates on sequence=4: GQA, packed documents across shards, beta over [0, 2],
    chunks that pad a shard: values and gradients of every input; the own shard by the chunked
    form and by PaTH's kernel (interpreted; in two levels with span, "/span", and with the
    across-blocks kernel between the blocks, "/across"), whose bias must read global positions
    ("slots")."""
    sizes = {"sequence": 4}
    check_path_ring(ring_check([sizes], "tests/helpers/path_ring_check.py", "fox,fox/kernel,slots/span,fox/across,slots/across"), sizes)


@pytest.mark.slow
def test_path_ring_equals_reference_on_8_devices_and_with_batch_or_heads_split():
    meshes = [{"sequence": 8}, {"data": 2, "sequence": 4}, {"tensor": 2, "sequence": 4}]
    result = ring_check(meshes, "tests/helpers/path_ring_check.py", "plain,fox,alibi,slots,plain/kernel,slots/kernel,fox/span")
    for sizes in meshes:
        key = json.dumps(sizes, sort_keys=True)
        check_path_ring({c: d for c, d in result.items() if c.startswith(key + " ")}, sizes)


@pytest.mark.slow
def test_path_ring_train_step_equals_one_device():
    """path and path_fox with impl "ring": the model's train step (packed rows) on sequence
    meshes of 4 and 8 devices and with the batch or the heads split too, against one device
    (the chunked algorithm): loss, gradients and parameters."""
    meshes = [{"sequence": 4}, {"sequence": 8}, {"data": 2, "sequence": 4}, {"tensor": 2, "sequence": 4}]
    check_sharded(sharded_step(["path", "path_fox"], meshes, 8, impl="ring"))


@pytest.mark.slow  # 44 s
def test_path_auto_on_a_sequence_mesh_trains_as_one_device():
    """path_fox with impl "auto" on sequence=4: PaTH's ring in a platform_dependent branch (its own
    shard chosen per platform: the kernel's TPU branch traced, the chunked form run on CPU): loss,
    gradients and parameters as on one device."""
    check_sharded(sharded_step(["path_fox"], [{"sequence": 4}], 4, impl="auto"))


def test_path_ring_refuses_a_length_the_ring_does_not_divide():
    """One line naming the length, the mesh axis and what to change; through the scheme too."""
    mesh = jax.sharding.AbstractMesh((4,), ("sequence",))
    x, w = jnp.ones((1, 10, 2, 8)), jnp.ones((1, 10, 2, 8)) / 8 ** 0.5
    line = r"^ring attention splits the sequence over the 4 devices of mesh axis 'sequence'.*seq_len.*mesh.sequence$"
    with pytest.raises(ValueError, match=line):
        ring_path_attention(x, x, x, w, jnp.ones((1, 10, 2)), mesh=mesh)
    with ring_mesh(mesh), pytest.raises(ValueError, match=line):
        make_scheme("path_fox", num_heads=2, head_dim=8).attend(x, x, x, None, positions=None, impl="ring",
                                                                key=jax.random.key(0))


def test_path_ring_off_a_sequence_mesh_is_the_chunked_form():
    scheme = make_scheme("path", num_heads=2, head_dim=8)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 12, 2, 8)) for i in range(3))
    features = scheme.default_features(q, k, positions=None, key=jax.random.key(3))
    got, want = jax.jit(lambda q, f: (scheme.attend(q, k, v, f, positions=None, impl="ring", block_size=4),
                                      chunked_attention(q, k, v, f["w"], f["beta"], chunk=4)))(q, features)
    np.testing.assert_array_equal(got, want)


GENERIC = ["nope", "rope", "alibi", "tapa", "so2_random_qk", "so2_learned_qkv+alibi", "espr", "rope+t5"]


@pytest.mark.slow
@pytest.mark.parametrize("model", GENERIC + ["mixer:sessa"])
def test_ring_train_step_of_every_generic_scheme_equals_one_device(model):
    meshes = [{"sequence": 4}, {"tensor": 2, "sequence": 4},
              {"data": 2, "fsdp": 2, "tensor": 2, "sequence": 2}]
    check_sharded(sharded_step([model], meshes, 16, impl="ring"))


def test_ring_off_a_sequence_mesh_is_blockwise():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, 24, 4, 8))
    k, v = (jax.random.normal(kk, (1, 24, 2, 8)) for kk in keys[1:])
    want = blockwise_attention(q, k, v, block_size=8)
    np.testing.assert_array_equal(attention(q, k, v, impl="ring", block_size=8), want)  # no mesh
    mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "tensor", "sequence"))
    with activation_rules(mesh):  # a mesh whose sequence axis has one device
        np.testing.assert_array_equal(attention(q, k, v, impl="ring", block_size=8), want)


def test_ring_is_for_schemes_with_the_generic_attention_and_path():
    for name in sorted(REGISTRY):
        scheme = make_scheme(name, num_heads=2, head_dim=8)
        generic = type(scheme).transformed_attention is Scheme.transformed_attention
        assert ("ring" in scheme.impls) == (generic or isinstance(scheme, Path)), name
    x = jnp.zeros((1, 8, 2, 8))
    with pytest.raises(ValueError, match="has no attention impl 'ring'.*valid: reference, blockwise$"):
        make_scheme("espr_rf", num_heads=2, head_dim=8).attend(x, x, x, None, positions=None, impl="ring")
